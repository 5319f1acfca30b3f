//! Decode (one input row) on AVX-512 for Q4_K and Q6_K, reading each weight row
//! front to back.
//!
//! The lane kernels (`kernel.rs`) read a tile's sixteen rows side by side, a cache
//! line of each in turn, so a thread's share of a matrix is sixteen interleaved
//! streams. With software prefetching that reached about 80% of the bandwidth of a
//! plain sequential read at two threads on a 2-core Zen 5, and no prefetch order or
//! distance did better; decode reads every weight once and little else, so that
//! was its speed. Here a tile takes two passes:
//!
//! 1. rows: each row read front to back, so a thread's rows are one sequential
//!    stream (prefetched a fixed distance ahead): the integer dot product of every
//!    sub-block with the activations (exact, in any order) and the row's scale
//!    bytes go to a buffer;
//! 2. lanes: those integers and scale bytes are transposed sixteen rows at a time
//!    into lanes and folded into the f32 results by the lane kernels' own functions
//!    (`kquants.rs`) in their order, so every result is bitwise what the lane
//!    kernels give (the tests compare them with the scalar kernels).
//!
//! The integer pass is also cheaper than unpacking transposed weights (the codes
//! meet the activations as they lie, or in a per-call permutation of them): decode
//! on cached weights ran 20-50% faster. From memory, a Qwen2.5-1.5B decode step's
//! matmuls ran about 7% faster at one and two threads. 16-bit activations
//! (`Precision::Accurate`) take a second `vpdpbusd` per four codes and join the two
//! bytes' sums before anything else (`act.rs`), so the rest is shared with 8 bits.

use std::arch::x86_64::*;
use std::ops::Range;

use super::kquants::{HeadK, Q4K, Q6_GROUP_ORDER, Q6K, fold_k, fold_mins_k, fold6, head_k_words, head6_words};
use super::lanes::{Lanes, Tile};
use super::x86::Avx512;
use super::{Job, Scratch, run_tiles};

type S = Avx512;

/// Rows per tile, one per lane.
const N: usize = 16;

/// How far ahead of the row being read its task prefetches (4 to 16 KiB measured
/// alike on Zen 5; without it the hardware prefetchers alone reached half the
/// bandwidth).
const AHEAD: usize = 8 << 10;

/// Q4_K on AVX-512: the row-wise kernel for one token, the lane kernels for several.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn tiles_q4k(job: &Job, tiles: Range<usize>) {
    unsafe {
        match (job.n, job.parts) {
            (1, 1) => q4k::<false>(job, tiles),
            (1, _) => q4k::<true>(job, tiles),
            _ => run_tiles::<S, Q4K>(job, tiles),
        }
    }
}

/// Q6_K on AVX-512, as [`tiles_q4k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn tiles_q6k(job: &Job, tiles: Range<usize>) {
    unsafe {
        match (job.n, job.parts) {
            (1, 1) => q6k::<false>(job, tiles),
            (1, _) => q6k::<true>(job, tiles),
            _ => run_tiles::<S, Q6K>(job, tiles),
        }
    }
}

/// Sixteen rows of `stride` bytes each from `base`, for [`Lanes::transpose`].
fn buffer_tile(base: *const u8, stride: usize) -> Tile {
    let offs = std::array::from_fn(|r| r * stride);
    Tile { base, offs, valid: N, bytes: stride, readable: stride }
}

/// What the row pass writes and the lane pass reads, in this thread's scratch
/// memory: a flat area, then buffers of sixteen rows each.
struct Buffers {
    scratch: Scratch,
    /// Byte offset and row stride of each buffer.
    layout: Vec<(usize, usize)>,
}

impl Buffers {
    /// `flat` bytes, then buffers of sixteen rows of `strides[i]` bytes each
    /// (multiples of 64).
    fn new(flat: usize, strides: &[usize]) -> Buffers {
        let mut layout = Vec::with_capacity(strides.len());
        let mut at = flat.next_multiple_of(64);
        for &s in strides {
            debug_assert!(s.is_multiple_of(64));
            layout.push((at, s));
            at += N * s;
        }
        Buffers { scratch: Scratch::take(at), layout }
    }

    /// The flat area.
    fn flat(&self) -> *mut u8 {
        self.scratch.ptr()
    }

    /// Row `r` of buffer `i`.
    fn row(&self, i: usize, r: usize) -> *mut u8 {
        let (at, s) = self.layout[i];
        unsafe { self.scratch.ptr().add(at + r * s) }
    }

    fn tile(&self, i: usize) -> Tile {
        buffer_tile(self.row(i, 0), self.layout[i].1)
    }
}

/// Row bytes for `units` items of `item` bytes, with room for a 64-byte transpose
/// starting at any item.
fn stride(units: usize, item: usize) -> usize {
    (units * item).next_multiple_of(64) + 64
}

/// Software prefetch [`AHEAD`] bytes ahead of a task's sequential read of its rows,
/// each cache line once, and never past its last row.
struct Ahead {
    next: usize,
    end: usize,
}

impl Ahead {
    /// For the rows of `tiles`, prefetching the first stretch at once.
    #[inline(always)]
    unsafe fn new(job: &Job, tiles: &Range<usize>) -> Ahead {
        let rb = job.w.row_bytes();
        let data = job.w.data.as_ptr() as usize;
        let start = data + tiles.start * N * rb;
        let end = data + (tiles.end * N).min(job.w.rows) * rb;
        let mut a = Ahead { next: start & !63, end };
        unsafe { a.upto(start) };
        a
    }

    /// Prefetches up to [`AHEAD`] bytes past address `p`.
    #[inline(always)]
    unsafe fn upto(&mut self, p: usize) {
        let limit = (p + AHEAD).min(self.end);
        while self.next < limit {
            unsafe { _mm_prefetch::<_MM_HINT_T0>(self.next as *const i8) };
            self.next += 64;
        }
    }
}

/// Tile `i`'s rows: the first, and how many exist. The row pass skips lanes past
/// the matrix; their buffer rows hold whatever an earlier tile left (scratch memory
/// is always initialised), and their results are never stored.
fn tile_rows(job: &Job, i: usize) -> (usize, usize) {
    let first = i * N;
    (first, (job.w.rows - first).min(N))
}

/// The dot products of four vectors of codes with the four 64-byte vectors of
/// activations at `x`, four bytes per lane; with 16-bit activations (`TWO`) those
/// are the high bytes, the low ones are at `lo`, and each product is
/// `(w·hi << 8) + w·lo`.
#[inline(always)]
unsafe fn dots<const TWO: bool>(codes: &[__m512i; 4], x: *const u8, lo: *const u8) -> [__m512i; 4] {
    unsafe {
        let mut v = [_mm512_setzero_si512(); 4];
        for k in 0..4 {
            v[k] = _mm512_dpbusd_epi32(v[k], codes[k], _mm512_loadu_si512(x.add(64 * k) as *const _));
            if TWO {
                v[k] = _mm512_slli_epi32::<8>(v[k]);
                v[k] = _mm512_dpbusd_epi32(v[k], codes[k], _mm512_loadu_si512(lo.add(64 * k) as *const _));
            }
        }
        v
    }
}

/// Sums the four 32-bit lanes of each 128-bit chunk of `v[0..4]`: chunk `q` of the
/// result is `[sum of v[0]'s chunk q, of v[1]'s, of v[2]'s, of v[3]'s]`.
#[inline(always)]
unsafe fn sum_chunks(v: [__m512i; 4]) -> __m512i {
    unsafe {
        let ab = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
        let cd = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
        _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd))
    }
}

// Q4_K: 144-byte units: d and dmin (4 bytes), 12 bytes of scales and mins, then 128
// bytes of codes; byte l of `qs[32p..32p + 32]` holds element l of sub-block 2p in
// its low nibble and of sub-block 2p + 1 in its high one.

/// Where sub-block `j`'s sum sits among a unit's eight stored words.
const Q4K_WORD: [usize; 8] = [0, 1, 4, 5, 2, 3, 6, 7];

#[inline(always)]
unsafe fn q4k<const TWO: bool>(job: &Job, tiles: Range<usize>) {
    unsafe {
        let units = job.w.cols / 256;
        let rb = job.w.row_bytes();
        let mut ahead = Ahead::new(job, &tiles);
        let tok = job.act.tok(0);
        // Flat: the activations permuted to meet the codes as they lie: 64-byte vector
        // k of unit u is sub-blocks (0, 2), (1, 3), (4, 6), (5, 7) for k = 0..4 (and for
        // 16 bits the low bytes the same way after them, 512 bytes per unit).
        // Buffer 0: scale bytes, 16 per unit. Buffer 1: sub-block sums, 8 words per unit.
        let ub = if TWO { 512 } else { 256 };
        let b = Buffers::new(units * ub, &[stride(units, 16), stride(units, 32)]);
        let xp = b.flat();
        let planes: &[*const i8] = if TWO { &[tok.xq, tok.lo] } else { &[tok.xq] };
        for u in 0..units {
            for (plane, &src) in planes.iter().enumerate() {
                for (k, (j0, j1)) in [(0, 2), (1, 3), (4, 6), (5, 7)].into_iter().enumerate() {
                    let dst = xp.add(ub * u + 256 * plane + 64 * k) as *mut i8;
                    std::ptr::copy_nonoverlapping(src.add(256 * u + 32 * j0), dst, 32);
                    std::ptr::copy_nonoverlapping(src.add(256 * u + 32 * j1), dst.add(32), 32);
                }
            }
        }
        let m4 = _mm512_set1_epi8(0x0F);
        for i in tiles {
            let (first, valid) = tile_rows(job, i);
            for r in 0..valid {
                let row = job.w.data.as_ptr().add((first + r) * rb);
                let (heads, sums) = (b.row(0, r), b.row(1, r));
                for u in 0..units {
                    let p = row.add(144 * u);
                    ahead.upto(p as usize);
                    _mm_storeu_si128(heads.add(16 * u) as *mut __m128i, _mm_loadu_si128(p as *const __m128i));
                    let (q0, q1) =
                        (_mm512_loadu_si512(p.add(16) as *const _), _mm512_loadu_si512(p.add(80) as *const _));
                    let codes = [
                        _mm512_and_si512(q0, m4),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(q0), m4),
                        _mm512_and_si512(q1, m4),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(q1), m4),
                    ];
                    // Chunks 0 and 1 hold halves of sub-blocks (0, 1, 4, 5), chunks 2 and
                    // 3 of (2, 3, 6, 7): add the halves.
                    let x = xp.add(ub * u);
                    let s = sum_chunks(dots::<TWO>(&codes, x, x.wrapping_add(256)));
                    let t = _mm512_add_epi32(
                        _mm512_shuffle_i32x4::<0b10_00_10_00>(s, s),
                        _mm512_shuffle_i32x4::<0b11_01_11_01>(s, s),
                    );
                    _mm256_storeu_si256(sums.add(32 * u) as *mut __m256i, _mm512_castsi512_si256(t));
                }
            }
            let mut f = S::zero_f();
            let (mut hw, mut sw) = ([S::splat(0); 16], [S::splat(0); 16]);
            for u in 0..units {
                if u % 4 == 0 {
                    S::transpose(&b.tile(0), 16 * u, hw.as_mut_ptr());
                }
                if u % 2 == 0 {
                    S::transpose(&b.tile(1), 32 * u, sw.as_mut_ptr());
                }
                let k = 4 * (u % 4);
                let h: HeadK<S> = head_k_words::<S>([hw[k], hw[k + 1], hw[k + 2], hw[k + 3]]);
                let o = 8 * (u % 2);
                for p in 0..4 {
                    f = fold_k(&h, &tok, u, p, sw[o + Q4K_WORD[2 * p]], sw[o + Q4K_WORD[2 * p + 1]], f);
                }
                f = fold_mins_k(&h, &tok, u, f);
            }
            S::store(f, job.out.at(0, first), valid);
        }
    }
}

// Q6_K: 210-byte units: 128 bytes of low four bits (`ql`), 64 of high two bits
// (`qh`), 16 signed scales, then d. In half h (elements 128h..128h + 128), byte l of
// `ql[64h..64h + 64]` holds element 128h + l in its low nibble and 128h + 64 + l in
// its high one, and the high bits of element 128h + 32s + l' (l' < 32) are bits
// 2s..2s + 2 of `qh[32h + l']`.

#[inline(always)]
unsafe fn q6k<const TWO: bool>(job: &Job, tiles: Range<usize>) {
    unsafe {
        let units = job.w.cols / 256;
        let rb = job.w.row_bytes();
        let mut ahead = Ahead::new(job, &tiles);
        let tok = job.act.tok(0);
        // Buffers: scales (16 bytes per unit), the word that ends with d (4 per unit),
        // and the sixteen group sums (64 bytes per unit).
        let b = Buffers::new(0, &[stride(units, 16), stride(units, 4), stride(units, 64)]);
        let (m4, m30) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
        // Shifts per 16-bit word that bring a code's two high bits to bits 4..6: the
        // low 256 bits of a vector hold elements l < 32 of a 64-element run, the high
        // 256 bits elements 32 + l, whose high bits sit two places further up in qh.
        let half = |a: i16, b: i16| _mm512_inserti64x4::<1>(_mm512_set1_epi16(a), _mm256_set1_epi16(b));
        let (up_lo, down_hi) = (half(4, 2), half(0, 2));
        for i in tiles {
            let (first, valid) = tile_rows(job, i);
            for r in 0..valid {
                let row = job.w.data.as_ptr().add((first + r) * rb);
                let (scales, dwords, sums) = (b.row(0, r), b.row(1, r), b.row(2, r));
                for u in 0..units {
                    let p = row.add(210 * u);
                    ahead.upto(p as usize);
                    _mm_storeu_si128(scales.add(16 * u) as *mut __m128i, _mm_loadu_si128(p.add(192) as *const __m128i));
                    (dwords.add(4 * u) as *mut u32).write_unaligned((p.add(206) as *const u32).read_unaligned());
                    let mut codes = [_mm512_setzero_si512(); 4];
                    for h in 0..2 {
                        let ql = _mm512_loadu_si512(p.add(64 * h) as *const _);
                        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i));
                        // Elements 128h + 0..64: low nibbles, and qh bits (0, 1) or (2, 3).
                        let hi_lo = _mm512_and_si512(_mm512_sllv_epi16(qh, up_lo), m30);
                        codes[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), hi_lo);
                        // Elements 128h + 64..128: high nibbles, and qh bits (4, 5) or (6, 7).
                        let hi_hi = _mm512_and_si512(_mm512_srlv_epi16(qh, down_hi), m30);
                        codes[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4), hi_hi);
                    }
                    // Chunk q of dot m is group 4m + q; its sum lands in word 4q + m.
                    let (x, lo) = (tok.xq.add(256 * u) as *const u8, tok.lo.wrapping_add(256 * u) as *const u8);
                    let v = dots::<TWO>(&codes, x, lo);
                    _mm512_storeu_si512(sums.add(64 * u) as *mut _, sum_chunks(v));
                }
            }
            let mut f = S::zero_f();
            let (mut scw, mut dw, mut sw) = ([S::splat(0); 16], [S::splat(0); 16], [S::splat(0); 16]);
            for u in 0..units {
                if u % 4 == 0 {
                    S::transpose(&b.tile(0), 16 * u, scw.as_mut_ptr());
                }
                if u % 16 == 0 {
                    S::transpose(&b.tile(1), 4 * u, dw.as_mut_ptr());
                }
                S::transpose(&b.tile(2), 64 * u, sw.as_mut_ptr());
                let k = 4 * (u % 4);
                let h = head6_words::<S>([scw[k], scw[k + 1], scw[k + 2], scw[k + 3]], dw[u % 16]);
                for g in Q6_GROUP_ORDER {
                    // The -32 offset of the codes, from the activation side.
                    let sub = S::add(S::splat(*tok.aux16.add(16 * u + g) as u32), sw[4 * (g % 4) + g / 4]);
                    f = fold6(&h, &tok, u, g, sub, f);
                }
            }
            S::store(f, job.out.at(0, first), valid);
        }
    }
}
