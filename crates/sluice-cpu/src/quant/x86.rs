//! x86-64 lanes: AVX-512 (16 rows per tile, VNNI `vpdpbusd`) and AVX2 (8 rows, with
//! AVX-VNNI's `vpdpbusd` or `vpmaddubsw` + `vpmaddwd`).

use std::arch::x86_64::*;

use super::lanes::{Lanes, Tile};

#[derive(Clone, Copy)]
pub(crate) struct Avx512;

impl Lanes for Avx512 {
    const N: usize = 16;
    type I = __m512i;
    type F = __m512;

    const WIN: usize = 64;
    /// Thirty-two registers hold a chunk (eight) and eight tokens' states. Against two
    /// passes of four, 8 rows of 4096 x 4096 ran 16% (Q4_K) and 31% (Q6_K) faster per
    /// row with 8-bit activations (one core, hot), and decode of 8 sequences of
    /// Qwen2.5-Coder-1.5B 21% faster (16-bit activations, whose `vpdpbusd` rate then
    /// binds).
    const DIRECT_GROUP: usize = 8;

    #[inline(always)]
    unsafe fn transpose(t: &Tile, off: usize, out: *mut __m512i) {
        unsafe {
            // A 16x16 transpose of 32-bit words: pairs, then quads within 128-bit
            // lanes, then the 128-bit lanes themselves.
            let mut r = [_mm512_setzero_si512(); 16];
            for (i, v) in r.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(t.row(i).add(off) as *const __m512i);
            }
            let mut a = [r[0]; 16];
            for m in 0..8 {
                a[2 * m] = _mm512_unpacklo_epi32(r[2 * m], r[2 * m + 1]);
                a[2 * m + 1] = _mm512_unpackhi_epi32(r[2 * m], r[2 * m + 1]);
            }
            // b[4m + e], 128-bit lane q: word 4q + e of rows 4m..4m + 4.
            let mut b = [r[0]; 16];
            for m in 0..4 {
                b[4 * m] = _mm512_unpacklo_epi64(a[4 * m], a[4 * m + 2]);
                b[4 * m + 1] = _mm512_unpackhi_epi64(a[4 * m], a[4 * m + 2]);
                b[4 * m + 2] = _mm512_unpacklo_epi64(a[4 * m + 1], a[4 * m + 3]);
                b[4 * m + 3] = _mm512_unpackhi_epi64(a[4 * m + 1], a[4 * m + 3]);
            }
            for e in 0..4 {
                let c0 = _mm512_shuffle_i32x4::<0x44>(b[e], b[4 + e]);
                let c1 = _mm512_shuffle_i32x4::<0xEE>(b[e], b[4 + e]);
                let c2 = _mm512_shuffle_i32x4::<0x44>(b[8 + e], b[12 + e]);
                let c3 = _mm512_shuffle_i32x4::<0xEE>(b[8 + e], b[12 + e]);
                out.add(e).write(_mm512_shuffle_i32x4::<0x88>(c0, c2));
                out.add(4 + e).write(_mm512_shuffle_i32x4::<0xDD>(c0, c2));
                out.add(8 + e).write(_mm512_shuffle_i32x4::<0x88>(c1, c3));
                out.add(12 + e).write(_mm512_shuffle_i32x4::<0xDD>(c1, c3));
            }
        }
    }

    #[inline(always)]
    unsafe fn splat(v: u32) -> __m512i {
        unsafe { _mm512_set1_epi32(v as i32) }
    }
    #[inline(always)]
    unsafe fn and(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_and_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn or(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_or_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn xor(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_xor_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_sub_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn srli<const S: u32>(a: __m512i) -> __m512i {
        unsafe { _mm512_srli_epi32::<S>(a) }
    }
    #[inline(always)]
    unsafe fn slli<const S: u32>(a: __m512i) -> __m512i {
        unsafe { _mm512_slli_epi32::<S>(a) }
    }
    #[inline(always)]
    unsafe fn srai<const S: u32>(a: __m512i) -> __m512i {
        unsafe { _mm512_srai_epi32::<S>(a) }
    }
    #[inline(always)]
    unsafe fn srl(a: __m512i, s: u32) -> __m512i {
        unsafe { _mm512_srl_epi32(a, _mm_cvtsi32_si128(s as i32)) }
    }
    #[inline(always)]
    unsafe fn sll(a: __m512i, s: u32) -> __m512i {
        unsafe { _mm512_sll_epi32(a, _mm_cvtsi32_si128(s as i32)) }
    }
    #[inline(always)]
    unsafe fn lut16(a: __m512i, table: &[u8; 16]) -> __m512i {
        unsafe {
            let t = _mm512_broadcast_i32x4(_mm_loadu_si128(table.as_ptr() as *const __m128i));
            _mm512_shuffle_epi8(t, a)
        }
    }

    #[inline(always)]
    unsafe fn dpbusd(acc: __m512i, w: __m512i, x: u32) -> __m512i {
        unsafe { _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x as i32)) }
    }
    #[inline(always)]
    unsafe fn dpbusd_full(acc: __m512i, w: __m512i, x: u32) -> __m512i {
        unsafe { Self::dpbusd(acc, w, x) }
    }
    #[inline(always)]
    unsafe fn zero_f() -> __m512 {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat_f(v: f32) -> __m512 {
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn cvt(a: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(a) }
    }
    #[inline(always)]
    unsafe fn f16_lo(a: __m512i) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm512_cvtepi32_epi16(a)) }
    }
    #[inline(always)]
    unsafe fn bits_f(a: __m512i) -> __m512 {
        unsafe { _mm512_castsi512_ps(a) }
    }
    #[inline(always)]
    unsafe fn mul_f(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma_f(a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn store(v: __m512, out: *mut f32, valid: usize) {
        unsafe {
            if valid == 16 {
                _mm512_storeu_ps(out, v)
            } else {
                _mm512_mask_storeu_ps(out, ((1u32 << valid) - 1) as u16, v)
            }
        }
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) }
    }
    #[inline(always)]
    unsafe fn prefetch_l2(p: *const u8) {
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) }
    }
}

/// AVX2 lanes; `VNNI` picks AVX-VNNI's `vpdpbusd` over `vpmaddubsw` + `vpmaddwd`
/// (the integers are the same either way).
#[derive(Clone, Copy)]
pub(crate) struct Avx2<const VNNI: bool>;

impl<const VNNI: bool> Lanes for Avx2<VNNI> {
    const N: usize = 8;
    type I = __m256i;
    type F = __m256;

    const WIN: usize = 32;

    #[inline(always)]
    unsafe fn transpose(t: &Tile, off: usize, out: *mut __m256i) {
        unsafe {
            // An 8x8 transpose of 32-bit words: pairs, quads, then 128-bit halves.
            let mut r = [_mm256_setzero_si256(); 8];
            for (i, v) in r.iter_mut().enumerate() {
                *v = _mm256_loadu_si256(t.row(i).add(off) as *const __m256i);
            }
            let mut a = [r[0]; 8];
            for m in 0..4 {
                a[2 * m] = _mm256_unpacklo_epi32(r[2 * m], r[2 * m + 1]);
                a[2 * m + 1] = _mm256_unpackhi_epi32(r[2 * m], r[2 * m + 1]);
            }
            // b[4m + e], 128-bit half q: word 4q + e of rows 4m..4m + 4.
            let mut b = [r[0]; 8];
            for m in 0..2 {
                b[4 * m] = _mm256_unpacklo_epi64(a[4 * m], a[4 * m + 2]);
                b[4 * m + 1] = _mm256_unpackhi_epi64(a[4 * m], a[4 * m + 2]);
                b[4 * m + 2] = _mm256_unpacklo_epi64(a[4 * m + 1], a[4 * m + 3]);
                b[4 * m + 3] = _mm256_unpackhi_epi64(a[4 * m + 1], a[4 * m + 3]);
            }
            for e in 0..4 {
                out.add(e).write(_mm256_permute2x128_si256::<0x20>(b[e], b[4 + e]));
                out.add(4 + e).write(_mm256_permute2x128_si256::<0x31>(b[e], b[4 + e]));
            }
        }
    }

    #[inline(always)]
    unsafe fn splat(v: u32) -> __m256i {
        unsafe { _mm256_set1_epi32(v as i32) }
    }
    #[inline(always)]
    unsafe fn and(a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_and_si256(a, b) }
    }
    #[inline(always)]
    unsafe fn or(a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_or_si256(a, b) }
    }
    #[inline(always)]
    unsafe fn xor(a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_xor_si256(a, b) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_sub_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn srli<const S: u32>(a: __m256i) -> __m256i {
        unsafe { _mm256_srl_epi32(a, _mm_cvtsi32_si128(S as i32)) }
    }
    #[inline(always)]
    unsafe fn slli<const S: u32>(a: __m256i) -> __m256i {
        unsafe { _mm256_sll_epi32(a, _mm_cvtsi32_si128(S as i32)) }
    }
    #[inline(always)]
    unsafe fn srai<const S: u32>(a: __m256i) -> __m256i {
        unsafe { _mm256_sra_epi32(a, _mm_cvtsi32_si128(S as i32)) }
    }
    #[inline(always)]
    unsafe fn srl(a: __m256i, s: u32) -> __m256i {
        unsafe { _mm256_srl_epi32(a, _mm_cvtsi32_si128(s as i32)) }
    }
    #[inline(always)]
    unsafe fn sll(a: __m256i, s: u32) -> __m256i {
        unsafe { _mm256_sll_epi32(a, _mm_cvtsi32_si128(s as i32)) }
    }
    #[inline(always)]
    unsafe fn lut16(a: __m256i, table: &[u8; 16]) -> __m256i {
        unsafe {
            let t = _mm256_broadcastsi128_si256(_mm_loadu_si128(table.as_ptr() as *const __m128i));
            _mm256_shuffle_epi8(t, a)
        }
    }

    #[inline(always)]
    unsafe fn dpbusd(acc: __m256i, w: __m256i, x: u32) -> __m256i {
        unsafe {
            let x = _mm256_set1_epi32(x as i32);
            if VNNI {
                _mm256_dpbusd_avx_epi32(acc, w, x)
            } else {
                // Pairs of u8 * i8 products fit i16 because the weights are below 128.
                _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
            }
        }
    }
    #[inline(always)]
    unsafe fn dpbusd_full(acc: __m256i, w: __m256i, x: u32) -> __m256i {
        unsafe {
            if VNNI {
                Self::dpbusd(acc, w, x)
            } else {
                // Split the weights into nibbles so `vpmaddubsw` cannot saturate:
                // w.x = 16 (w >> 4).x + (w & 15).x.
                let xv = _mm256_set1_epi32(x as i32);
                let m = _mm256_set1_epi8(0x0F);
                let lo = _mm256_maddubs_epi16(_mm256_and_si256(w, m), xv);
                let hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16::<4>(w), m), xv);
                let s = _mm256_add_epi32(
                    _mm256_madd_epi16(hi, _mm256_set1_epi16(16)),
                    _mm256_madd_epi16(lo, _mm256_set1_epi16(1)),
                );
                _mm256_add_epi32(acc, s)
            }
        }
    }
    #[inline(always)]
    unsafe fn dpbusd4<const MAX: u32>(acc: __m256i, w: [__m256i; 4], x: [u32; 4]) -> __m256i {
        unsafe {
            if VNNI {
                let mut acc = acc;
                for k in 0..4 {
                    acc = Self::dpbusd(acc, w[k], x[k]);
                }
                return acc;
            }
            // `vpmaddubsw` gives 16-bit sums of two byte products, each lane at most
            // 2 * 128 * MAX in magnitude: add as many as fit in 16 bits before the
            // widening `vpmaddwd`, which, like `vpmaddubsw`, takes one of the two
            // multiply ports of Zen 3 (8 of them per four words become 5 for codes of
            // 4 and 5 bits, 6 for Q6_K's 6).
            let xv = x.map(|x| _mm256_set1_epi32(x as i32));
            let ones = _mm256_set1_epi16(1);
            if MAX > 127 {
                // Nibbles, as in `dpbusd_full`; four sums of each fit (15360).
                let m = _mm256_set1_epi8(0x0F);
                let nib = |w: __m256i, k: usize| {
                    (
                        _mm256_maddubs_epi16(_mm256_and_si256(w, m), xv[k]),
                        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16::<4>(w), m), xv[k]),
                    )
                };
                let (mut lo, mut hi) = nib(w[0], 0);
                for (k, &wk) in w.iter().enumerate().skip(1) {
                    let (l, h) = nib(wk, k);
                    lo = _mm256_add_epi16(lo, l);
                    hi = _mm256_add_epi16(hi, h);
                }
                let s = _mm256_add_epi32(_mm256_madd_epi16(hi, _mm256_set1_epi16(16)), _mm256_madd_epi16(lo, ones));
                return _mm256_add_epi32(acc, s);
            }
            let per = (i16::MAX as u32 / (256 * MAX.max(1))).max(1) as usize;
            let mut acc = acc;
            let mut k = 0;
            while k < 4 {
                let end = (k + per).min(4);
                let mut s = _mm256_maddubs_epi16(w[k], xv[k]);
                for j in k + 1..end {
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[j], xv[j]));
                }
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(s, ones));
                k = end;
            }
            acc
        }
    }
    #[inline(always)]
    unsafe fn zero_f() -> __m256 {
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat_f(v: f32) -> __m256 {
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn cvt(a: __m256i) -> __m256 {
        unsafe { _mm256_cvtepi32_ps(a) }
    }
    #[inline(always)]
    unsafe fn f16_lo(a: __m256i) -> __m256 {
        unsafe {
            // Gather the low halves of the eight lanes into one 128-bit vector.
            let sh = _mm256_setr_epi8(
                0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1,
                -1, -1, -1,
            );
            let p = _mm256_permute4x64_epi64::<0b1000>(_mm256_shuffle_epi8(a, sh));
            _mm256_cvtph_ps(_mm256_castsi256_si128(p))
        }
    }
    #[inline(always)]
    unsafe fn bits_f(a: __m256i) -> __m256 {
        unsafe { _mm256_castsi256_ps(a) }
    }
    #[inline(always)]
    unsafe fn mul_f(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma_f(a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn store(v: __m256, out: *mut f32, valid: usize) {
        unsafe {
            if valid == 8 {
                _mm256_storeu_ps(out, v)
            } else {
                let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid as i32), lane);
                _mm256_maskstore_ps(out, mask, v)
            }
        }
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) }
    }
    #[inline(always)]
    unsafe fn prefetch_l2(p: *const u8) {
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) }
    }
}
