//! Activations quantized to 8 bits, once per matmul, in the block size the weight
//! format wants.
//!
//! Each block of 32 (for the 32-element formats, like ggml's Q8_0) or 256 (for the
//! K-quants, like ggml's Q8_K) inputs gets a scale `d = max|x| / 127` and
//! `q = round_half_even(x / d)`, computed as `x * (1 / d)`. Elements stay in their
//! natural order. Alongside come the per-block integer sums the weight format folds
//! in, so the kernels never sum activations themselves:
//!
//! - offset formats (Q4_0, Q5_0, Q8_0 and MXFP4 are stored as unsigned codes
//!   `c = q + off`): `aux = -off * sum(q)` per block, the start value of the block's
//!   integer dot product, so that `aux + sum(c * x) = sum(q * x)` exactly;
//! - min formats (Q4_1, Q5_1: `w = d * c + m`): `sx = d_x * sum(q)`, the block's
//!   activation sum that multiplies `m`;
//! - Q4_K and Q5_K: the eight 32-element sums per super-block, packed two per word as
//!   16-bit halves (they multiply the 6-bit mins);
//! - Q6_K (codes `c = q + 32`): `aux = -32 * sum` of each 16-element group.
//!
//! Everything here is exact integer arithmetic or a single IEEE operation, so the
//! result is the same whatever vector width the compiler picks.

use rayon::prelude::*;

/// What a weight format needs from the quantized activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActKind {
    /// 32-element blocks; `aux = -off * sum(q)`; `sx = d * sum(q)` when `min`.
    B32 { off: i32, min: bool },
    /// 256-element blocks with the 32-element sums packed in pairs (Q4_K, Q5_K).
    KMins,
    /// 256-element blocks with `-32 * sum` of each 16 (Q6_K).
    K6,
}

impl ActKind {
    pub fn block(self) -> usize {
        match self {
            ActKind::B32 { .. } => 32,
            _ => 256,
        }
    }

    pub fn aux_per_block(self) -> usize {
        match self {
            ActKind::B32 { .. } => 1,
            ActKind::KMins => 4,
            ActKind::K6 => 16,
        }
    }
}

/// `n` quantized activation rows of `cols` elements.
pub(crate) struct QAct {
    kind: ActKind,
    cols: usize,
    blocks: usize,
    xq: Vec<i8>,
    d: Vec<f32>,
    aux: Vec<i32>,
    sx: Vec<f32>,
}

/// One token's quantized activations, as raw pointers for the kernels' inner loops.
#[derive(Clone, Copy)]
pub(crate) struct Tok {
    /// `cols` codes, natural order.
    pub xq: *const i8,
    /// One scale per block.
    pub d: *const f32,
    /// `aux_per_block` words per block (see [`ActKind`]).
    pub aux: *const i32,
    /// One `d * sum(q)` per block (min formats only).
    pub sx: *const f32,
}

impl QAct {
    /// Quantizes `x` (`[n, cols]`), using several threads for long prefill batches.
    pub fn new(kind: ActKind, x: &[f32], n: usize, cols: usize) -> QAct {
        let blk = kind.block();
        assert!(cols.is_multiple_of(blk) && x.len() == n * cols);
        let blocks = cols / blk;
        let ap = kind.aux_per_block();
        // `sx` is only read for min formats, but a few bytes per block are cheaper
        // than a special case.
        let mut a = QAct {
            kind,
            cols,
            blocks,
            xq: vec![0; n * cols],
            d: vec![0.0; n * blocks],
            aux: vec![0; n * blocks * ap],
            sx: vec![0.0; n * blocks],
        };
        let rows =
            a.xq.chunks_mut(cols)
                .zip(a.d.chunks_mut(blocks))
                .zip(a.aux.chunks_mut(blocks * ap))
                .zip(a.sx.chunks_mut(blocks))
                .zip(x.chunks(cols));
        let one = |((((q, d), aux), sx), x): ((((&mut [i8], &mut [f32]), &mut [i32]), &mut [f32]), &[f32])| {
            quantize_row(kind, x, q, d, aux, sx)
        };
        if n > 1 && n * cols >= 1 << 16 {
            rows.collect::<Vec<_>>().into_par_iter().for_each(one);
        } else {
            rows.for_each(one);
        }
        a
    }

    pub fn tok(&self, i: usize) -> Tok {
        let ap = self.kind.aux_per_block();
        Tok {
            xq: self.xq[i * self.cols..].as_ptr(),
            d: self.d[i * self.blocks..].as_ptr(),
            aux: self.aux[i * self.blocks * ap..].as_ptr(),
            sx: self.sx[i * self.blocks..].as_ptr(),
        }
    }
}

fn quantize_row(kind: ActKind, x: &[f32], xq: &mut [i8], d: &mut [f32], aux: &mut [i32], sx: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // Same code, compiled with wider vectors; the arithmetic is exact or one
            // IEEE operation per element, so the result does not change.
            return unsafe { quantize_row_avx2(kind, x, xq, d, aux, sx) };
        }
    }
    quantize_row_generic(kind, x, xq, d, aux, sx)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_avx2(kind: ActKind, x: &[f32], xq: &mut [i8], d: &mut [f32], aux: &mut [i32], sx: &mut [f32]) {
    quantize_row_generic(kind, x, xq, d, aux, sx)
}

#[inline(always)]
fn quantize_row_generic(kind: ActKind, x: &[f32], xq: &mut [i8], d: &mut [f32], aux: &mut [i32], sx: &mut [f32]) {
    let blk = kind.block();
    let ap = kind.aux_per_block();
    for (b, (xb, qb)) in x.chunks_exact(blk).zip(xq.chunks_exact_mut(blk)).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let db = amax / 127.0;
        let id = if db != 0.0 { 1.0 / db } else { 0.0 };
        for (q, &v) in qb.iter_mut().zip(xb) {
            // `as` saturates (and maps NaN to 0); |v * id| <= 127 up to rounding anyway.
            *q = (v * id).round_ties_even() as i8;
        }
        d[b] = db;
        let sums16 = |g: usize| qb[16 * g..16 * g + 16].iter().map(|&q| q as i32).sum::<i32>();
        match kind {
            ActKind::B32 { off, min } => {
                let s = qb.iter().map(|&q| q as i32).sum::<i32>();
                aux[b] = -off * s;
                if min {
                    sx[b] = db * s as f32;
                }
            }
            ActKind::KMins => {
                for i in 0..4 {
                    let lo = sums16(4 * i) + sums16(4 * i + 1);
                    let hi = sums16(4 * i + 2) + sums16(4 * i + 3);
                    aux[ap * b + i] = ((lo as u16 as u32) | ((hi as u16 as u32) << 16)) as i32;
                }
            }
            ActKind::K6 => {
                for g in 0..16 {
                    aux[ap * b + g] = -32 * sums16(g);
                }
            }
        }
    }
}
