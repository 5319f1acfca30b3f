//! Row dot products: one stored weight row (any format) against an f32 vector, and
//! rows converted to f32.
//!
//! `dot_f32` and the plain-typed `dot_row` are single-row kernels (four independent
//! accumulators, short latency chains; attention's tiles are [`crate::tile`]'s);
//! matrix products go through [`crate::matmul`], whose summation order differs. A
//! quantized `dot_row` runs the matmul kernels on one row, so it equals that row of
//! `matmul` bit for bit.

use sluice_core::DType;

use crate::isa::{Isa, isa};

/// `a · b` over f32.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let bytes = unsafe { std::slice::from_raw_parts(a.as_ptr() as *const u8, a.len() * 4) };
    dot_row(DType::F32, bytes, b)
}

/// Converts `out.len()` little-endian f16s to f32: an f16 KV cache's rows, read
/// position by position, where a call per element (or a library's per-call dispatch)
/// cost more than the attention that reads them.
pub fn f16_to_f32(src: &[u8], out: &mut [f32]) {
    assert!(src.len() >= 2 * out.len(), "f16_to_f32: {} bytes for {} values", src.len(), out.len());
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::f16_to_f32_avx512(src, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::f16_to_f32_avx2(src, out) },
        _ => out.iter_mut().enumerate().for_each(|(i, o)| *o = load(DType::F16, src, i)),
    }
}

/// Dot product of one stored row (`x.len()` elements of `dtype`) with `x`.
pub fn dot_row(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    let n = x.len();
    match (isa(), dtype) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, DType::F32 | DType::F16 | DType::BF16) => unsafe { x86::dot_avx512(dtype, row, x) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, DType::F32 | DType::F16 | DType::BF16) => unsafe { x86::dot_avx2(dtype, row, x) },
        #[cfg(target_arch = "aarch64")]
        (Isa::Neon, DType::F32 | DType::F16 | DType::BF16) => unsafe { neon::dot(dtype, row, x) },
        (_, DType::F32 | DType::F16 | DType::BF16) => scalar::dot(dtype, row, x, 0, n),
        (_, quantized) => crate::quant::dot_row(quantized, row, x),
    }
}

/// Converts one stored row to f32 (`out.len()` elements): embedding lookups. Exact,
/// and for quantized rows bitwise what gguf-py's dequantizer gives.
pub fn row_to_f32(dtype: DType, row: &[u8], out: &mut [f32]) {
    sluice_core::quant::dequantize_row(dtype, row, out)
}

/// Reads element `i` of a plain-typed row.
#[inline(always)]
fn load(dtype: DType, row: &[u8], i: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]),
        DType::F16 => half::f16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
        DType::BF16 => f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16),
        _ => unreachable!(),
    }
}

mod scalar {
    use super::*;

    /// Elements `start..end`, with eight independent partial sums so the order is
    /// fixed and the compiler can keep them in vector registers.
    pub fn dot(dtype: DType, row: &[u8], x: &[f32], start: usize, end: usize) -> f32 {
        let mut acc = [0f32; 8];
        let mut i = start;
        while i + 8 <= end {
            for l in 0..8 {
                acc[l] += load(dtype, row, i + l) * x[i + l];
            }
            i += 8;
        }
        let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        while i < end {
            s += load(dtype, row, i) * x[i];
            i += 1;
        }
        s
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(dtype: DType, p: *const u8) -> __m256 {
        unsafe {
            match dtype {
                DType::F32 => _mm256_loadu_ps(p as *const f32),
                DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                _ => {
                    let h = _mm_loadu_si128(p as *const __m128i);
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_to_f32_avx2(src: &[u8], out: &mut [f32]) {
        let n = out.len();
        let mut i = 0;
        unsafe {
            while i + 8 <= n {
                _mm256_storeu_ps(out.as_mut_ptr().add(i), load8(DType::F16, src.as_ptr().add(2 * i)));
                i += 8;
            }
        }
        for (j, o) in out.iter_mut().enumerate().skip(i) {
            *o = load(DType::F16, src, j);
        }
    }

    /// Sixteen at a time, the rest as [`f16_to_f32_avx2`] (a 16-bit cache's rows at
    /// long contexts: half the instructions of eight at a time).
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn f16_to_f32_avx512(src: &[u8], out: &mut [f32]) {
        let n = out.len();
        let mut i = 0;
        unsafe {
            while i + 16 <= n {
                let h = _mm256_loadu_si256(src.as_ptr().add(2 * i) as *const __m256i);
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
                i += 16;
            }
            f16_to_f32_avx2(&src[2 * i..], &mut out[i..]);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum256(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let es = dtype.block_bytes();
        let (w, xp) = (row.as_ptr(), x.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        unsafe {
            while i + 32 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let j = i + 8 * k;
                    *a = _mm256_fmadd_ps(load8(dtype, w.add(j * es)), _mm256_loadu_ps(xp.add(j)), *a);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(load8(dtype, w.add(i * es)), _mm256_loadu_ps(xp.add(i)), acc[0]);
                i += 8;
            }
            let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            hsum256(s) + scalar::dot(dtype, row, x, i, n)
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn load16(dtype: DType, p: *const u8) -> __m512 {
        unsafe {
            match dtype {
                DType::F32 => _mm512_loadu_ps(p as *const f32),
                DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
                _ => {
                    let h = _mm256_loadu_si256(p as *const __m256i);
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                }
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let es = dtype.block_bytes();
        let (w, xp) = (row.as_ptr(), x.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        unsafe {
            while i + 64 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let j = i + 16 * k;
                    *a = _mm512_fmadd_ps(load16(dtype, w.add(j * es)), _mm512_loadu_ps(xp.add(j)), *a);
                }
                i += 64;
            }
            while i + 16 <= n {
                acc[0] = _mm512_fmadd_ps(load16(dtype, w.add(i * es)), _mm512_loadu_ps(xp.add(i)), acc[0]);
                i += 16;
            }
            let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
            _mm512_reduce_add_ps(s) + scalar::dot(dtype, row, x, i, n)
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::*;
    use std::arch::aarch64::*;

    #[target_feature(enable = "neon")]
    unsafe fn load4(dtype: DType, row: &[u8], i: usize) -> float32x4_t {
        unsafe {
            match dtype {
                DType::F32 => vld1q_f32(row.as_ptr().add(4 * i) as *const f32),
                DType::BF16 => {
                    let h = vld1_u16(row.as_ptr().add(2 * i) as *const u16);
                    vreinterpretq_f32_u32(vshll_n_u16::<16>(h))
                }
                _ => {
                    let v = [
                        load(dtype, row, i),
                        load(dtype, row, i + 1),
                        load(dtype, row, i + 2),
                        load(dtype, row, i + 3),
                    ];
                    vld1q_f32(v.as_ptr())
                }
            }
        }
    }

    #[target_feature(enable = "neon")]
    pub unsafe fn dot(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let xp = x.as_ptr();
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        unsafe {
            while i + 16 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let j = i + 4 * k;
                    *a = vfmaq_f32(*a, load4(dtype, row, j), vld1q_f32(xp.add(j)));
                }
                i += 16;
            }
            let s = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
            vaddvq_f32(s) + scalar::dot(dtype, row, x, i, n)
        }
    }
}
