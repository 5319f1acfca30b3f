//! GGUF block formats: byte layouts and a plain reference dequantizer.
//!
//! This is the definition of what each stored format means, written to be read, and
//! checked bit for bit against gguf-py's `gguf.quants.dequantize` (fixtures made by
//! `scripts/make_quant_vectors.py`). Kernels never call it on whole tensors: they
//! compute on the blocks where they lie. It serves embedding lookups
//! (`sluice_cpu::row_to_f32`) and tests.
//!
//! Every multiply and add below is one f32 operation in the order gguf-py does it
//! (Rust never fuses them into an FMA), which is what makes the results bit-exact.
//!
//! Layouts (little-endian; `f16` is IEEE half, `[u8; n]` raw bytes). Elements are
//! numbered in the order they appear in the dequantized row.
//!
//! | type | elems | bytes | layout | element `i` |
//! | --- | --- | --- | --- | --- |
//! | Q8_0 | 32 | 34 | `d: f16, qs: [i8; 32]` | `d * qs[i]` |
//! | Q4_0 | 32 | 18 | `d: f16, qs: [u8; 16]` | `d * (nib(i) - 8)` |
//! | Q4_1 | 32 | 20 | `d: f16, m: f16, qs: [u8; 16]` | `d * nib(i) + m` |
//! | Q5_0 | 32 | 22 | `d: f16, qh: u32, qs: [u8; 16]` | `d * (nib(i) + 16 * bit(qh, i) - 16)` |
//! | Q5_1 | 32 | 24 | `d: f16, m: f16, qh: u32, qs: [u8; 16]` | `d * (nib(i) + 16 * bit(qh, i)) + m` |
//! | MXFP4 | 32 | 17 | `e: u8, qs: [u8; 16]` | `e8m0_half(e) * MXFP4_VALUES[nib(i)]` |
//!
//! where `nib(i)` is the low nibble of `qs[i]` for `i < 16` and the high nibble of
//! `qs[i - 16]` otherwise.
//!
//! K-quants hold 256 elements in a super-block:
//! - Q4_K (144 bytes): `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`. Eight
//!   sub-blocks of 32, each with a 6-bit scale `sc[j]` and min `m[j]` packed in
//!   `scales` (see [`k_scale_min`]). Sub-block `j` takes its nibbles from
//!   `qs[32 * (j / 2)..][..32]`, low nibbles for even `j`, high for odd. Element
//!   `32 j + l` is `(d * sc[j]) * q - (dmin * m[j])`.
//! - Q5_K (176 bytes): `d, dmin, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]`; as Q4_K
//!   with a fifth bit, bit `j` of `qh[l]`, adding 16 to element `32 j + l`.
//! - Q6_K (210 bytes): `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`. Two halves
//!   of 128; in half `h`, element `32 s + l` (s < 4, l < 32) has its low four bits in
//!   `ql[64 h + 32 (s % 2) + l]` (low nibble for s < 2, high for s >= 2) and its top two
//!   bits at bit `2 s` of `qh[32 h + l]`. Element `e` of the block is
//!   `(d * scales[e / 16]) * (q - 32)`.
//!
//! MXFP4 (gpt-oss experts): `MXFP4_VALUES` are the e2m1 values doubled, and the
//! e8m0 scale is halved to compensate: `e8m0_half(e) = 2^(e - 128)`, built from bits
//! exactly as ggml's `ggml_e8m0_to_fp32_half` (subnormal for `e < 2`).

use crate::DType;

/// Elements per block of the 32-element formats.
pub const QK: usize = 32;
/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// MXFP4's e2m1 code points, doubled so they are integers (`0, 0.5, 1, ... 6` becomes
/// `0, 1, 2, ... 12`), indexed by the 4-bit code.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// IEEE half to f32 (exact).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// `2^(e - 128)`: the e8m0 scale `2^(e - 127)` halved, because [`MXFP4_VALUES`] are doubled.
#[inline]
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { (e as u32 - 1) << 23 };
    f32::from_bits(bits)
}

/// The eight 6-bit scales and eight 6-bit mins of a Q4_K / Q5_K super-block, from its
/// 12 packed bytes: bytes 0..4 hold `sc[0..4]` in their low six bits, bytes 4..8 hold
/// `m[0..4]`; bytes 8..12 hold the low four bits of `sc[4..8]` (low nibble) and
/// `m[4..8]` (high nibble), whose top two bits are the spare top bits of bytes 0..8.
#[inline]
pub fn k_scale_min(scales: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = scales[j] & 63;
        m[j] = scales[j + 4] & 63;
        sc[j + 4] = (scales[j + 8] & 0x0F) | ((scales[j] >> 2) & 0x30);
        m[j + 4] = (scales[j + 8] >> 4) | ((scales[j + 4] >> 2) & 0x30);
    }
    (sc, m)
}

#[inline]
fn f16_at(b: &[u8], off: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

/// The 4-bit code of element `i` (< 32) of a 16-byte nibble array.
#[inline]
fn nib(qs: &[u8], i: usize) -> u8 {
    if i < 16 { qs[i] & 0x0F } else { qs[i - 16] >> 4 }
}

/// Dequantizes one row (`out.len()` elements of `dtype`, stored in `bytes`).
///
/// Panics if `bytes` is not exactly that many elements.
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let n = out.len();
    assert_eq!(Some(bytes.len()), dtype.bytes_for(n), "dequantize_row: {n} {dtype} elements need other byte count");
    let bb = dtype.block_bytes();
    let be = dtype.block_elems();
    for (blk, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        dequantize_block(dtype, blk, o);
    }
}

/// Dequantizes one block (one element for plain types).
pub fn dequantize_block(dtype: DType, b: &[u8], o: &mut [f32]) {
    match dtype {
        DType::F32 => o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        DType::F16 => o[0] = f16_at(b, 0),
        DType::BF16 => o[0] = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16),
        DType::Q8_0 => {
            let d = f16_at(b, 0);
            for (i, v) in o.iter_mut().enumerate() {
                *v = (b[2 + i] as i8) as f32 * d;
            }
        }
        DType::Q4_0 => {
            let d = f16_at(b, 0);
            for (i, v) in o.iter_mut().enumerate() {
                *v = d * (nib(&b[2..18], i) as i32 - 8) as f32;
            }
        }
        DType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for (i, v) in o.iter_mut().enumerate() {
                *v = d * nib(&b[4..20], i) as f32 + m;
            }
        }
        DType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for (i, v) in o.iter_mut().enumerate() {
                let q = nib(&b[6..22], i) as i32 | (((qh >> i) & 1) << 4) as i32;
                *v = d * (q - 16) as f32;
            }
        }
        DType::Q5_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            for (i, v) in o.iter_mut().enumerate() {
                let q = nib(&b[8..24], i) as u32 | (((qh >> i) & 1) << 4);
                *v = d * q as f32 + m;
            }
        }
        DType::MXFP4 => {
            let d = e8m0_half(b[0]);
            for (i, v) in o.iter_mut().enumerate() {
                *v = d * MXFP4_VALUES[nib(&b[1..17], i) as usize] as f32;
            }
        }
        DType::Q4K | DType::Q5K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (sc, m) = k_scale_min(&b[4..16]);
            let (qh, qs) = if dtype == DType::Q5K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for j in 0..8 {
                let (scale, min) = (d * sc[j] as f32, dmin * m[j] as f32);
                for l in 0..32 {
                    let byte = qs[32 * (j / 2) + l];
                    let mut q = if j % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                    if let Some(qh) = qh {
                        q |= ((qh[l] >> j) & 1) << 4;
                    }
                    o[32 * j + l] = scale * q as f32 - min;
                }
            }
        }
        DType::Q6K => {
            let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            for h in 0..2 {
                for s in 0..4 {
                    for l in 0..32 {
                        let lb = ql[64 * h + 32 * (s % 2) + l];
                        let lo = if s < 2 { lb & 0x0F } else { lb >> 4 };
                        let hi = (qh[32 * h + l] >> (2 * s)) & 3;
                        let q = (lo | (hi << 4)) as i32 - 32;
                        let e = 128 * h + 32 * s + l;
                        o[e] = (d * (scales[e / 16] as i8) as f32) * q as f32;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// Reads `fixtures/quant/<NAME>.bin` (see `scripts/make_quant_vectors.py`):
    /// the raw blocks and gguf-py's dequantization of them.
    pub(crate) fn vectors(dtype: DType) -> (Vec<u8>, Vec<f32>) {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/quant")
            .join(format!("{}.bin", dtype.name()));
        let raw = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let word = |i: usize| u32::from_le_bytes(raw[4 * i..4 * i + 4].try_into().unwrap()) as usize;
        let (n, bb, be) = (word(0), word(1), word(2));
        assert_eq!((bb, be), (dtype.block_bytes(), dtype.block_elems()), "{}", path.display());
        let blocks = raw[12..12 + n * bb].to_vec();
        let vals = raw[12 + n * bb..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        (blocks, vals)
    }

    #[test]
    fn matches_gguf_py_bit_for_bit() {
        for dt in DType::ALL {
            let (blocks, want) = vectors(dt);
            assert_eq!(want.len(), blocks.len() / dt.block_bytes() * dt.block_elems());
            let mut got = vec![0f32; want.len()];
            dequantize_row(dt, &blocks, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{dt} element {i}: {g} vs gguf-py {w}");
            }
        }
    }

    #[test]
    fn e8m0_edges() {
        assert_eq!(e8m0_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_half(2), 2f32.powi(-126));
        assert_eq!(e8m0_half(128), 1.0);
        assert_eq!(e8m0_half(255), 2f32.powi(127));
    }
}
