//! Matrix products on f32, f16 and bf16 weights (Hugging Face checkpoints).
//!
//! Each output keeps 16 f32 partial sums: partial `l` accumulates
//! `w[16i + l] * x[16i + l]` over the chunks `i` with fused multiply-adds (the last
//! chunk zero-padded), and the 16 are summed as a fixed tree, halves first
//! (`l + 8`, then `+ 4`, `+ 2`, `+ 1`). Every ISA does exactly that (AVX-512 in one
//! register, AVX2 in two, NEON in four, scalar in an array), so results are bitwise
//! the same everywhere and for every tiling: decode computes a tile of rows against
//! one token, prefill a tile of rows against a few tokens, reusing each loaded
//! weight chunk across them.

use std::ops::Range;

use sluice_core::{DType, MatRef};

use crate::isa::{Isa, isa};
use crate::par::{OutPtr, for_each_range};

/// Stored element kinds, as const parameters.
const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

const fn elem_bytes(e: u8) -> usize {
    if e == F32 { 4 } else { 2 }
}

/// Element `i` of a row of kind `E`, as f32 (exact).
#[inline(always)]
unsafe fn load_elem<const E: u8>(p: *const u8, i: usize) -> f32 {
    unsafe {
        match E {
            F32 => f32::from_le_bytes(std::ptr::read_unaligned(p.add(4 * i) as *const [u8; 4])),
            F16 => half::f16::from_le_bytes(std::ptr::read_unaligned(p.add(2 * i) as *const [u8; 2])).to_f32(),
            _ => f32::from_bits(
                (u16::from_le_bytes(std::ptr::read_unaligned(p.add(2 * i) as *const [u8; 2])) as u32) << 16,
            ),
        }
    }
}

/// Sixteen f32 lanes.
trait V16: Copy {
    type V: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn load_x(p: *const f32) -> Self::V;
    unsafe fn load_w<const E: u8>(p: *const u8) -> Self::V;
    /// `a * b + c`, rounded once per lane.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// The fixed tree: `((v[l] + v[l+8]) + (v[l+4] + v[l+12])) ...`, see the module doc.
    unsafe fn hsum(v: Self::V) -> f32;
}

/// Tokens per pass over the weights in prefill, so their f32 rows stay in L2.
const TOKEN_BLOCK: usize = 32;

/// `R` rows against `C` tokens, writing `out` for tokens `tok0..` and rows `row0..`.
#[inline(always)]
unsafe fn tile<S: V16, const E: u8, const R: usize, const C: usize>(
    w: &MatRef,
    x: &[f32],
    row0: usize,
    tok0: usize,
    out: OutPtr,
) {
    let cols = w.cols;
    let rb = w.row_bytes();
    let es = elem_bytes(E);
    unsafe {
        let wp: [*const u8; R] = std::array::from_fn(|r| w.data.as_ptr().add((row0 + r) * rb));
        let xp: [*const f32; C] = std::array::from_fn(|c| x.as_ptr().add((tok0 + c) * cols));
        let mut acc = [[S::zero(); C]; R];
        let full = cols / 16;
        for i in 0..full {
            // Activations are read as they are used (FMA memory operands on x86), so
            // only the accumulators and one weight vector live in registers.
            for r in 0..R {
                let wv = S::load_w::<E>(wp[r].add(16 * i * es));
                for c in 0..C {
                    acc[r][c] = S::fma(wv, S::load_x(xp[c].add(16 * i)), acc[r][c]);
                }
            }
        }
        let rem = cols - 16 * full;
        if rem > 0 {
            let xt: [[f32; 16]; C] = std::array::from_fn(|c| {
                let mut t = [0f32; 16];
                t[..rem].copy_from_slice(std::slice::from_raw_parts(xp[c].add(16 * full), rem));
                t
            });
            for r in 0..R {
                let mut wt = [0f32; 16];
                for (j, v) in wt.iter_mut().enumerate().take(rem) {
                    *v = load_elem::<E>(wp[r], 16 * full + j);
                }
                let wv = S::load_x(wt.as_ptr());
                for c in 0..C {
                    acc[r][c] = S::fma(wv, S::load_x(xt[c].as_ptr()), acc[r][c]);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (c, &a) in row.iter().enumerate() {
                *out.at(tok0 + c, row0 + r) = S::hsum(a);
            }
        }
    }
}

/// Rows `rows` (a task's share) for every token, in tiles of `RD` rows for one token
/// and of `RP` rows by `CP` tokens for several (per ISA, what its registers hold).
#[inline(always)]
unsafe fn run<S: V16, const E: u8, const RD: usize, const RP: usize, const CP: usize>(
    w: &MatRef,
    x: &[f32],
    n: usize,
    rows: Range<usize>,
    out: OutPtr,
) {
    unsafe {
        if n == 1 {
            let mut r = rows.start;
            while r + RD <= rows.end {
                tile::<S, E, RD, 1>(w, x, r, 0, out);
                r += RD;
            }
            for r in r..rows.end {
                tile::<S, E, 1, 1>(w, x, r, 0, out);
            }
            return;
        }
        for t0 in (0..n).step_by(TOKEN_BLOCK) {
            let t1 = (t0 + TOKEN_BLOCK).min(n);
            let mut r = rows.start;
            while r < rows.end {
                let full_rows = r + RP <= rows.end;
                let mut t = t0;
                while t + CP <= t1 {
                    if full_rows {
                        tile::<S, E, RP, CP>(w, x, r, t, out);
                    } else {
                        tile::<S, E, 1, CP>(w, x, r, t, out);
                    }
                    t += CP;
                }
                for t in t..t1 {
                    if full_rows {
                        tile::<S, E, RP, 1>(w, x, r, t, out);
                    } else {
                        tile::<S, E, 1, 1>(w, x, r, t, out);
                    }
                }
                r += if full_rows { RP } else { 1 };
            }
        }
    }
}

type RowsFn = unsafe fn(&MatRef, &[f32], usize, Range<usize>, OutPtr);

/// `out = x · Wᵀ` for a plain-typed `w`; see [`crate::matmul`].
pub(crate) fn matmul(w: MatRef<'_>, x: &[f32], n: usize, out: &mut [f32]) {
    let f = rows_fn(isa(), w.dtype);
    let out = OutPtr::new(out, w.rows);
    // Tasks take contiguous runs of 16-row groups; rows left over at the end of a
    // run after the register tiles go one at a time.
    let groups = w.rows.div_ceil(16);
    let cost = w.data.len() * n;
    for_each_range(groups, cost, |g| {
        let rows = 16 * g.start..(16 * g.end).min(w.rows);
        unsafe { f(&w, x, n, rows, out) }
    });
}

fn rows_fn(isa: Isa, dtype: DType) -> RowsFn {
    macro_rules! pick {
        ($wrap:ident) => {
            match dtype {
                DType::F32 => $wrap::<F32> as RowsFn,
                DType::F16 => $wrap::<F16> as RowsFn,
                DType::BF16 => $wrap::<BF16> as RowsFn,
                other => panic!("{other} is not a plain format"),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => pick!(rows_avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => pick!(rows_avx2),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => pick!(rows_neon),
        _ => pick!(rows_scalar),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn rows_avx512<const E: u8>(w: &MatRef, x: &[f32], n: usize, rows: Range<usize>, out: OutPtr) {
    unsafe { run::<x86::Avx512, E, 8, 6, 2>(w, x, n, rows, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2<const E: u8>(w: &MatRef, x: &[f32], n: usize, rows: Range<usize>, out: OutPtr) {
    unsafe { run::<x86::Avx2, E, 4, 3, 2>(w, x, n, rows, out) }
}

#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
unsafe fn rows_neon<const E: u8>(w: &MatRef, x: &[f32], n: usize, rows: Range<usize>, out: OutPtr) {
    unsafe { run::<neon::Neon, E, 4, 2, 2>(w, x, n, rows, out) }
}

unsafe fn rows_scalar<const E: u8>(w: &MatRef, x: &[f32], n: usize, rows: Range<usize>, out: OutPtr) {
    unsafe { run::<Scalar, E, 4, 2, 2>(w, x, n, rows, out) }
}

#[derive(Clone, Copy)]
struct Scalar;

impl V16 for Scalar {
    type V = [f32; 16];
    #[inline(always)]
    unsafe fn zero() -> [f32; 16] {
        [0.0; 16]
    }
    #[inline(always)]
    unsafe fn load_x(p: *const f32) -> [f32; 16] {
        unsafe { std::ptr::read_unaligned(p as *const [f32; 16]) }
    }
    #[inline(always)]
    unsafe fn load_w<const E: u8>(p: *const u8) -> [f32; 16] {
        std::array::from_fn(|i| unsafe { load_elem::<E>(p, i) })
    }
    #[inline(always)]
    unsafe fn fma(a: [f32; 16], b: [f32; 16], c: [f32; 16]) -> [f32; 16] {
        std::array::from_fn(|i| a[i].mul_add(b[i], c[i]))
    }
    #[inline(always)]
    unsafe fn hsum(v: [f32; 16]) -> f32 {
        let s8: [f32; 8] = std::array::from_fn(|l| v[l] + v[l + 8]);
        let s4: [f32; 4] = std::array::from_fn(|l| s8[l] + s8[l + 4]);
        let s2: [f32; 2] = std::array::from_fn(|l| s4[l] + s4[l + 2]);
        s2[0] + s2[1]
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    #[derive(Clone, Copy)]
    pub(super) struct Avx512;

    #[inline(always)]
    unsafe fn hsum8(s8: __m256) -> f32 {
        unsafe {
            let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
        }
    }

    impl V16 for Avx512 {
        type V = __m512;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load_x(p: *const f32) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_w<const E: u8>(p: *const u8) -> __m512 {
            unsafe {
                match E {
                    F32 => _mm512_loadu_ps(p as *const f32),
                    F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
                    _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                        p as *const __m256i,
                    )))),
                }
            }
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn hsum(v: __m512) -> f32 {
            unsafe {
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
                hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), hi))
            }
        }
    }

    /// Lanes 0..8 and 8..16 in two registers.
    #[derive(Clone, Copy)]
    pub(super) struct Avx2;

    #[inline(always)]
    unsafe fn load8<const E: u8>(p: *const u8) -> __m256 {
        unsafe {
            match E {
                F32 => _mm256_loadu_ps(p as *const f32),
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                    p as *const __m128i,
                )))),
            }
        }
    }

    impl V16 for Avx2 {
        type V = (__m256, __m256);
        #[inline(always)]
        unsafe fn zero() -> (__m256, __m256) {
            unsafe { (_mm256_setzero_ps(), _mm256_setzero_ps()) }
        }
        #[inline(always)]
        unsafe fn load_x(p: *const f32) -> (__m256, __m256) {
            unsafe { (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
        }
        #[inline(always)]
        unsafe fn load_w<const E: u8>(p: *const u8) -> (__m256, __m256) {
            unsafe { (load8::<E>(p), load8::<E>(p.add(8 * elem_bytes(E)))) }
        }
        #[inline(always)]
        unsafe fn fma(a: (__m256, __m256), b: (__m256, __m256), c: (__m256, __m256)) -> (__m256, __m256) {
            unsafe { (_mm256_fmadd_ps(a.0, b.0, c.0), _mm256_fmadd_ps(a.1, b.1, c.1)) }
        }
        #[inline(always)]
        unsafe fn hsum(v: (__m256, __m256)) -> f32 {
            unsafe { hsum8(_mm256_add_ps(v.0, v.1)) }
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::*;
    use std::arch::aarch64::*;

    /// Lanes in four registers of four.
    #[derive(Clone, Copy)]
    pub(super) struct Neon;

    impl V16 for Neon {
        type V = [float32x4_t; 4];
        #[inline(always)]
        unsafe fn zero() -> [float32x4_t; 4] {
            unsafe { [vdupq_n_f32(0.0); 4] }
        }
        #[inline(always)]
        unsafe fn load_x(p: *const f32) -> [float32x4_t; 4] {
            std::array::from_fn(|k| unsafe { vld1q_f32(p.add(4 * k)) })
        }
        #[inline(always)]
        unsafe fn load_w<const E: u8>(p: *const u8) -> [float32x4_t; 4] {
            unsafe {
                match E {
                    F32 => Self::load_x(p as *const f32),
                    BF16 => std::array::from_fn(|k| {
                        vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16((p as *const u16).add(4 * k))))
                    }),
                    _ => {
                        let v: [f32; 16] = std::array::from_fn(|i| load_elem::<E>(p, i));
                        Self::load_x(v.as_ptr())
                    }
                }
            }
        }
        #[inline(always)]
        unsafe fn fma(a: [float32x4_t; 4], b: [float32x4_t; 4], c: [float32x4_t; 4]) -> [float32x4_t; 4] {
            std::array::from_fn(|k| unsafe { vfmaq_f32(c[k], a[k], b[k]) })
        }
        #[inline(always)]
        unsafe fn hsum(v: [float32x4_t; 4]) -> f32 {
            unsafe {
                // Lanes 0..4, 4..8, 8..12, 12..16 are v[0..4]: the tree's first two levels.
                let s8 = [vaddq_f32(v[0], v[2]), vaddq_f32(v[1], v[3])];
                let s4 = vaddq_f32(s8[0], s8[1]);
                let s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
                vget_lane_f32::<0>(s2) + vget_lane_f32::<1>(s2)
            }
        }
    }
}
