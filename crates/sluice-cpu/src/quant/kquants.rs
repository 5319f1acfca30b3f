//! Kernels for the K-quant super-blocks (256 elements): Q4_K, Q5_K, Q6_K.
//!
//! A super-block is one unit of eight 32-element chunks. Activations carry a scale
//! per 32 elements (see `act.rs` for why not per 256), so each sub-block's integer
//! dot product is scaled in f32, by `d * sc_j` (per row; exact in f32) times `d_x`
//! of its activation block:
//!
//! ```text
//! Q4_K, Q5_K:  f = fma(cvt(dot_j), (d * sc_j) * d_x, f)         for each 32-element j
//!              f = fma(sum_j m_j * (d_x * xsum)_j, -dmin, f)    once per super-block
//! Q6_K:        f = fma(cvt(dot_g - 32 * xsum_g), (d * sc_g) * d_x, f)   for each 16 g
//! ```
//!
//! where `dot` is the dot product of the unsigned codes with the activation codes
//! and `xsum` the sum of those activation codes (precomputed, `act.rs`).

use super::act::Tok;
use super::kernel::{Chunk, Kernel, dot4, words};
use super::lanes::Lanes;
use super::seg::Seg;

const LOW4: u32 = 0x0F0F_0F0F;

/// A Q4_K / Q5_K super-block's per-row data.
#[derive(Clone, Copy)]
pub(crate) struct HeadK<S: Lanes> {
    /// `d * sc_j` for the eight sub-blocks.
    dsc: [S::F; 8],
    /// The eight mins `m_j`.
    mins: [S::F; 8],
    neg_dmin: S::F,
    /// Q5_K's fifth bits, `qh[4k..4k + 4]` in `[k]`.
    qh: [S::I; 8],
}

/// Unpacks `d`, `dmin` and the 12 bytes of packed 6-bit scales and mins (the 16
/// bytes at `off`), per `sluice_core::quant::k_scale_min`.
#[inline(always)]
unsafe fn head_k<S: Lanes>(src: &Seg<S>, off: usize) -> HeadK<S> {
    unsafe { head_k_words::<S>(src.t4(off)) }
}

/// [`head_k`] from the four words of the 16 bytes, already in lanes.
#[inline(always)]
pub(crate) unsafe fn head_k_words<S: Lanes>(words: [S::I; 4]) -> HeadK<S> {
    unsafe {
        let [dm, s0, s1, s2] = words;
        let m6 = S::splat(63);
        let (m4, top) = (S::splat(0xF), S::splat(0x30));
        let d = S::f16_lo(dm);
        let mut dsc = [S::zero_f(); 8];
        let mut mins = [S::zero_f(); 8];
        for j in 0..4u32 {
            let sh = 8 * j;
            let sc_lo = S::and(S::srl(s0, sh), m6);
            let m_lo = S::and(S::srl(s1, sh), m6);
            let sc_hi = S::or(S::and(S::srl(s2, sh), m4), S::and(S::srl(s0, sh + 2), top));
            let m_hi = S::or(S::and(S::srl(s2, sh + 4), m4), S::and(S::srl(s1, sh + 2), top));
            // An f16 times a 6-bit integer is exact in f32.
            dsc[j as usize] = S::mul_f(d, S::cvt(sc_lo));
            dsc[j as usize + 4] = S::mul_f(d, S::cvt(sc_hi));
            mins[j as usize] = S::cvt(m_lo);
            mins[j as usize + 4] = S::cvt(m_hi);
        }
        // Negating the half before converting is exact and saves a float op per token.
        let neg_dmin = S::f16_lo(S::xor(S::srli::<16>(dm), S::splat(0x8000)));
        HeadK { dsc, mins, neg_dmin, qh: [S::splat(0); 8] }
    }
}

/// Chunk `c` of a Q4_K / Q5_K super-block covers 16 bytes of `qs` (`qs[16c..]`),
/// part `c % 2` of sub-block pair `c / 2`: `[k]` (low nibbles) is elements
/// `64p + 16hh + 4k..` of sub-block `2p`, `[4 + k]` (high) the same of sub-block `2p + 1`.
#[inline(always)]
unsafe fn chunk_k<S: Lanes, const Q5: bool>(src: &Seg<S>, qs_off: usize, c: usize, h: &HeadK<S>) -> Chunk<S> {
    unsafe {
        let raw = src.t4(qs_off + 16 * c);
        let m = S::splat(LOW4);
        let mut w: Chunk<S> = [m; 8];
        for k in 0..4 {
            w[k] = S::and(raw[k], m);
            w[4 + k] = S::and(S::srli::<4>(raw[k]), m);
        }
        if Q5 {
            let (p, hh) = (c / 2, c % 2);
            let ones = S::splat(0x0101_0101);
            for k in 0..4 {
                let qh = h.qh[4 * hh + k];
                w[k] = S::or(w[k], S::slli::<4>(S::and(S::srl(qh, 2 * p as u32), ones)));
                w[4 + k] = S::or(w[4 + k], S::slli::<4>(S::and(S::srl(qh, 2 * p as u32 + 1), ones)));
            }
        }
        w
    }
}

/// Running state within a Q4_K / Q5_K super-block: the f32 result, and the integer
/// sums of the current sub-block pair until both halves are in.
#[derive(Clone, Copy)]
pub(crate) struct AccK<S: Lanes> {
    f: S::F,
    lo: S::I,
    hi: S::I,
    /// With 16-bit activations, the high bytes' sums, kept apart from the low bytes'
    /// (`lo`, `hi`) until the pair is folded: one shift per sub-block instead of one
    /// per chunk.
    lo_h: S::I,
    hi_h: S::I,
}

impl<S: Lanes> AccK<S> {
    /// The state at the start of a super-block, given the running result.
    #[inline(always)]
    unsafe fn start(f: S::F) -> AccK<S> {
        unsafe { AccK { f, lo: S::splat(0), hi: S::splat(0), lo_h: S::splat(0), hi_h: S::splat(0) } }
    }
}

#[inline(always)]
unsafe fn step_k<S: Lanes, const TWO: bool, const MAX: u32>(
    w: &Chunk<S>,
    h: &HeadK<S>,
    a: &Tok,
    u: usize,
    c: usize,
    acc: AccK<S>,
) -> AccK<S> {
    unsafe {
        let (p, hh) = (c / 2, c % 2);
        let e = 256 * u + 64 * p + 16 * hh;
        let AccK { mut f, mut lo, mut hi, mut lo_h, mut hi_h } = acc;
        if hh == 0 {
            lo = S::splat(0);
            hi = S::splat(0);
            lo_h = S::splat(0);
            hi_h = S::splat(0);
        }
        let (wl, wh) = ([w[0], w[1], w[2], w[3]], [w[4], w[5], w[6], w[7]]);
        if TWO {
            // (w·hi << 8) + w·lo summed over both chunks, exactly as `dot4` joins
            // each chunk's (the shift distributes over the wrapping sums).
            lo_h = S::dpbusd4::<MAX>(lo_h, wl, words(a.xq, e));
            lo = S::dpbusd4::<MAX>(lo, wl, words(a.lo, e));
            hi_h = S::dpbusd4::<MAX>(hi_h, wh, words(a.xq, e + 32));
            hi = S::dpbusd4::<MAX>(hi, wh, words(a.lo, e + 32));
            if hh == 1 {
                lo = S::add(S::slli::<8>(lo_h), lo);
                hi = S::add(S::slli::<8>(hi_h), hi);
            }
        } else {
            lo = dot4::<S, false, MAX>(lo, wl, a, e);
            hi = dot4::<S, false, MAX>(hi, wh, a, e + 32);
        }
        if hh == 1 {
            f = fold_k(h, a, u, p, lo, hi, f);
        }
        AccK { f, lo, hi, lo_h, hi_h }
    }
}

/// The running result with sub-blocks `2p` and `2p + 1` of unit `u` added, given
/// their integer dot products.
#[inline(always)]
pub(crate) unsafe fn fold_k<S: Lanes>(h: &HeadK<S>, a: &Tok, u: usize, p: usize, lo: S::I, hi: S::I, f: S::F) -> S::F {
    unsafe {
        // Sub-blocks 2p and 2p + 1 are activation blocks 8u + 2p and 8u + 2p + 1.
        let b = 8 * u + 2 * p;
        let f = S::fma_f(S::cvt(lo), S::mul_f(h.dsc[2 * p], S::splat_f(*a.d.add(b))), f);
        S::fma_f(S::cvt(hi), S::mul_f(h.dsc[2 * p + 1], S::splat_f(*a.d.add(b + 1))), f)
    }
}

#[inline(always)]
unsafe fn finish_k<S: Lanes>(h: &HeadK<S>, a: &Tok, u: usize, acc: AccK<S>) -> S::F {
    unsafe { fold_mins_k(h, a, u, acc.f) }
}

/// The running result with unit `u`'s mins term added (its last step).
#[inline(always)]
pub(crate) unsafe fn fold_mins_k<S: Lanes>(h: &HeadK<S>, a: &Tok, u: usize, f: S::F) -> S::F {
    unsafe {
        let mut mins = S::zero_f();
        for j in 0..8 {
            mins = S::fma_f(h.mins[j], S::splat_f(*a.sx.add(8 * u + j)), mins);
        }
        S::fma_f(mins, h.neg_dmin, f)
    }
}

pub(crate) struct Q4K;
pub(crate) struct Q5K;
pub(crate) struct Q6K;

impl<S: Lanes> Kernel<S> for Q4K {
    const CHUNKS: usize = 8;
    const UNIT_BYTES: usize = 144;
    const UNIT_ELEMS: usize = 256;
    type Head = HeadK<S>;
    type Acc = AccK<S>;
    #[inline(always)]
    unsafe fn head(src: &Seg<S>, off: usize) -> HeadK<S> {
        unsafe { head_k::<S>(src, off) }
    }
    #[inline(always)]
    unsafe fn chunk(src: &Seg<S>, off: usize, c: usize, h: &HeadK<S>) -> Chunk<S> {
        unsafe { chunk_k::<S, false>(src, off + 16, c, h) }
    }
    #[inline(always)]
    unsafe fn start(_: &HeadK<S>, _: &Tok, _: usize, f: S::F) -> AccK<S> {
        unsafe { AccK::start(f) }
    }
    #[inline(always)]
    unsafe fn step<const TWO: bool>(w: &Chunk<S>, h: &HeadK<S>, a: &Tok, u: usize, c: usize, acc: AccK<S>) -> AccK<S> {
        unsafe { step_k::<S, TWO, 15>(w, h, a, u, c, acc) }
    }
    #[inline(always)]
    unsafe fn finish(h: &HeadK<S>, a: &Tok, u: usize, acc: AccK<S>) -> S::F {
        unsafe { finish_k::<S>(h, a, u, acc) }
    }
}

impl<S: Lanes> Kernel<S> for Q5K {
    const CHUNKS: usize = 8;
    const UNIT_BYTES: usize = 176;
    const UNIT_ELEMS: usize = 256;
    type Head = HeadK<S>;
    type Acc = AccK<S>;
    #[inline(always)]
    unsafe fn head(src: &Seg<S>, off: usize) -> HeadK<S> {
        unsafe {
            let mut h = head_k::<S>(src, off);
            let (a, b) = (src.t4(off + 16), src.t4(off + 32));
            h.qh = [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]];
            h
        }
    }
    #[inline(always)]
    unsafe fn chunk(src: &Seg<S>, off: usize, c: usize, h: &HeadK<S>) -> Chunk<S> {
        unsafe { chunk_k::<S, true>(src, off + 48, c, h) }
    }
    #[inline(always)]
    unsafe fn start(_: &HeadK<S>, _: &Tok, _: usize, f: S::F) -> AccK<S> {
        unsafe { AccK::start(f) }
    }
    #[inline(always)]
    unsafe fn step<const TWO: bool>(w: &Chunk<S>, h: &HeadK<S>, a: &Tok, u: usize, c: usize, acc: AccK<S>) -> AccK<S> {
        unsafe { step_k::<S, TWO, 31>(w, h, a, u, c, acc) }
    }
    #[inline(always)]
    unsafe fn finish(h: &HeadK<S>, a: &Tok, u: usize, acc: AccK<S>) -> S::F {
        unsafe { finish_k::<S>(h, a, u, acc) }
    }
}

/// A Q6_K super-block's per-row data: `d * sc_g` for the sixteen 16-element groups.
#[derive(Clone, Copy)]
pub(crate) struct Head6<S: Lanes> {
    dsc: [S::F; 16],
}

/// Which elements chunk `c` of a Q6_K super-block holds: half `h = c / 4`, column
/// strip `t = (c / 2) % 2` (`l` in `16t..16t + 16`) and row parity `odd = c % 2`;
/// `[k]` is element `128h + 32s + 16t + 4k..` for `s = odd` (low nibbles) and
/// `[4 + k]` the same for `s = odd + 2` (high nibbles).
#[inline(always)]
const fn q6_chunk(c: usize) -> (usize, usize, usize) {
    (c / 4, (c / 2) % 2, c % 2)
}

impl<S: Lanes> Kernel<S> for Q6K {
    const CHUNKS: usize = 8;
    const UNIT_BYTES: usize = 210;
    const UNIT_ELEMS: usize = 256;
    type Head = Head6<S>;
    type Acc = S::F;
    #[inline(always)]
    unsafe fn head(src: &Seg<S>, off: usize) -> Head6<S> {
        // d is the last two bytes; read the word ending there to stay in the block.
        unsafe { head6_words::<S>(src.t4(off + 192), src.word(off + 206)) }
    }
    #[inline(always)]
    unsafe fn chunk(src: &Seg<S>, off: usize, c: usize, _: &Head6<S>) -> Chunk<S> {
        unsafe {
            let (h, tt, odd) = q6_chunk(c);
            let ql = src.t4(off + 64 * h + 32 * odd + 16 * tt);
            let qh = src.t4(off + 128 + 32 * h + 16 * tt);
            let (m4, top) = (S::splat(LOW4), S::splat(0x3030_3030));
            let mut w = [m4; 8];
            for k in 0..4 {
                let q = qh[k];
                // Bits 2s..2s+2 of qh moved to bits 4..6, for s = odd and s = odd + 2.
                let (hi_lo, hi_hi) = if odd == 0 { (S::slli::<4>(q), q) } else { (S::slli::<2>(q), S::srli::<2>(q)) };
                w[k] = S::or(S::and(ql[k], m4), S::and(hi_lo, top));
                w[4 + k] = S::or(S::and(S::srli::<4>(ql[k]), m4), S::and(hi_hi, top));
            }
            w
        }
    }
    #[inline(always)]
    unsafe fn start(_: &Head6<S>, _: &Tok, _: usize, f: S::F) -> S::F {
        f
    }
    #[inline(always)]
    unsafe fn step<const TWO: bool>(w: &Chunk<S>, h: &Head6<S>, a: &Tok, u: usize, c: usize, f: S::F) -> S::F {
        unsafe {
            let mut f = f;
            for half in 0..2 {
                let g = Q6_GROUP_ORDER[2 * c + half];
                // The -32 offset of the codes, per 16 elements, from the activation side.
                let sub = S::splat(*a.aux16.add(16 * u + g) as u32);
                let k = 4 * half;
                let sub = dot4::<S, TWO, 63>(sub, [w[k], w[k + 1], w[k + 2], w[k + 3]], a, 256 * u + 16 * g);
                f = fold6(h, a, u, g, sub, f);
            }
            f
        }
    }
    #[inline(always)]
    unsafe fn finish(_: &Head6<S>, _: &Tok, _: usize, f: S::F) -> S::F {
        f
    }
}

/// The order in which a Q6_K unit's sixteen 16-element groups enter the result:
/// chunk `c` holds groups `[2c]` (its low nibbles) and `[2c + 1]` (high), see
/// [`q6_chunk`].
pub(crate) const Q6_GROUP_ORDER: [usize; 16] = {
    let mut order = [0; 16];
    let mut c = 0;
    while c < 8 {
        let (hf, tt, odd) = q6_chunk(c);
        order[2 * c] = 8 * hf + 2 * odd + tt;
        order[2 * c + 1] = 8 * hf + 2 * (odd + 2) + tt;
        c += 1;
    }
    order
};

/// The running result with group `g` of unit `u` added, given its integer dot
/// product with the `-32` offset folded in.
#[inline(always)]
pub(crate) unsafe fn fold6<S: Lanes>(h: &Head6<S>, a: &Tok, u: usize, g: usize, sub: S::I, f: S::F) -> S::F {
    unsafe {
        let dx = S::splat_f(*a.d.add(8 * u + g / 2));
        S::fma_f(S::cvt(sub), S::mul_f(h.dsc[g], dx), f)
    }
}

/// A Q6_K head from the four words of its scales and the word that ends with `d`.
#[inline(always)]
pub(crate) unsafe fn head6_words<S: Lanes>(s: [S::I; 4], dword: S::I) -> Head6<S> {
    unsafe {
        let d = S::f16_lo(S::srli::<16>(dword));
        let mut dsc = [S::zero_f(); 16];
        for k in 0..4 {
            // Signed 8-bit scales; an f16 times one is exact in f32.
            dsc[4 * k] = S::mul_f(d, S::cvt(S::srai::<24>(S::slli::<24>(s[k]))));
            dsc[4 * k + 1] = S::mul_f(d, S::cvt(S::srai::<24>(S::slli::<16>(s[k]))));
            dsc[4 * k + 2] = S::mul_f(d, S::cvt(S::srai::<24>(S::slli::<8>(s[k]))));
            dsc[4 * k + 3] = S::mul_f(d, S::cvt(S::srai::<24>(s[k])));
        }
        Head6 { dsc }
    }
}
