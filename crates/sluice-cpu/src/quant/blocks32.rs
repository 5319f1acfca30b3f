//! Kernels for the 32-element block formats: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4.
//!
//! Each block is one unit of one chunk. The codes are made unsigned (`c = q + off`,
//! the activation side's `aux = -off * sum(x)` starts the integer sum, see
//! `act.rs`), the chunk's `[k]` covers elements `4k..4k + 4` for `k < 4` and
//! `16 + 4(k - 4)..` for `k >= 4`, which is where low and high nibbles of a 16-byte
//! nibble array land, and each output advances by
//!
//! ```text
//! f = fma(cvt(sum(c * x) + aux), d_w * d_x, f)      then, for Q4_1 and Q5_1,
//! f = fma(m_w, d_x * sum(q), f)
//! ```

use sluice_core::quant::MXFP4_VALUES;

use super::act::Tok;
use super::kernel::{Chunk, Kernel, dot4};
use super::lanes::{Lanes, spread4_bit4};
use super::seg::Seg;

const LOW4: u32 = 0x0F0F_0F0F;

/// A block's per-row data: scale `d`, min `m` (Q4_1, Q5_1) and high bits `qh` (Q5_*).
#[derive(Clone, Copy)]
pub(crate) struct Head32<S: Lanes> {
    d: S::F,
    m: S::F,
    qh: S::I,
}

/// The integer dot product of a chunk with the block's 32 activation elements from
/// `e`, on top of `acc`.
#[inline(always)]
unsafe fn dot<S: Lanes, const TWO: bool, const MAX: u32>(w: &Chunk<S>, a: &Tok, e: usize, acc: S::I) -> S::I {
    unsafe {
        // Two chains so that decode, with one token, is not latency-bound.
        let a0 = dot4::<S, TWO, MAX>(acc, [w[0], w[1], w[2], w[3]], a, e);
        let a1 = dot4::<S, TWO, MAX>(S::splat(0), [w[4], w[5], w[6], w[7]], a, e + 16);
        S::add(a0, a1)
    }
}

/// Splits 16 bytes of nibbles (`t`, as from `Seg::t4`) into codes 0..16.
#[inline(always)]
unsafe fn nibbles<S: Lanes>(t: [S::I; 4]) -> Chunk<S> {
    unsafe {
        let m = S::splat(LOW4);
        let mut w = [m; 8];
        for k in 0..4 {
            w[k] = S::and(t[k], m);
            w[4 + k] = S::and(S::srli::<4>(t[k]), m);
        }
        w
    }
}

/// Adds the fifth bit from `qh` (bit `j` for element `j`) to nibble codes.
#[inline(always)]
unsafe fn fifth_bit<S: Lanes>(w: Chunk<S>, qh: S::I) -> Chunk<S> {
    unsafe {
        let mut w = w;
        for (k, v) in w.iter_mut().enumerate() {
            // [k] holds elements 4k.. for k < 4 and 16 + 4(k - 4).. after: bit 4k of qh on.
            *v = S::or(*v, spread4_bit4::<S>(S::srl(qh, 4 * k as u32)));
        }
        w
    }
}

#[inline(always)]
unsafe fn finish32<S: Lanes, const MIN: bool>(h: &Head32<S>, a: &Tok, u: usize, (acc, f): Acc32<S>) -> S::F {
    unsafe {
        let dx = *a.d.add(u);
        let f = S::fma_f(S::cvt(acc), S::mul_f(h.d, S::splat_f(dx)), f);
        if MIN { S::fma_f(h.m, S::splat_f(*a.sx.add(u)), f) } else { f }
    }
}

/// A block's integer sum and the running result it will be added to.
type Acc32<S> = (<S as Lanes>::I, <S as Lanes>::F);

/// What the 32-element formats share: one chunk per block, and the arithmetic,
/// which differs only in whether codes carry an offset (folded in from the
/// activations' `aux`) or a min (`MIN`, added in `finish`), and in the largest code
/// (`max`: 255 for Q8_0's sign-flipped bytes, 31 for five bits, 24 for MXFP4's).
macro_rules! block32_common {
    ($bytes:expr, min: $min:literal, max: $max:literal) => {
        const CHUNKS: usize = 1;
        const UNIT_BYTES: usize = $bytes;
        const UNIT_ELEMS: usize = 32;
        type Head = Head32<S>;
        type Acc = Acc32<S>;
        #[inline(always)]
        unsafe fn start(_: &Head32<S>, a: &Tok, u: usize, f: S::F) -> Acc32<S> {
            unsafe { (if $min { S::splat(0) } else { S::splat(*a.aux.add(u) as u32) }, f) }
        }
        #[inline(always)]
        unsafe fn step<const TWO: bool>(
            w: &Chunk<S>,
            _: &Head32<S>,
            a: &Tok,
            u: usize,
            _: usize,
            (i, f): Acc32<S>,
        ) -> Acc32<S> {
            unsafe { (dot::<S, TWO, $max>(w, a, 32 * u, i), f) }
        }
        #[inline(always)]
        unsafe fn finish(h: &Head32<S>, a: &Tok, u: usize, acc: Acc32<S>) -> S::F {
            unsafe { finish32::<S, $min>(h, a, u, acc) }
        }
    };
}

pub(crate) struct Q8_0;
pub(crate) struct Q4_0;
pub(crate) struct Q4_1;
pub(crate) struct Q5_0;
pub(crate) struct Q5_1;
pub(crate) struct Mxfp4;

impl<S: Lanes> Kernel<S> for Q8_0 {
    block32_common!(34, min: false, max: 255);
    #[inline(always)]
    unsafe fn head(src: &Seg<S>, off: usize) -> Head32<S> {
        unsafe { Head32 { d: S::f16_lo(src.word(off)), m: S::zero_f(), qh: S::splat(0) } }
    }
    #[inline(always)]
    unsafe fn chunk(src: &Seg<S>, off: usize, _: usize, _: &Head32<S>) -> Chunk<S> {
        unsafe {
            // Signed codes made unsigned by flipping the sign bit: c = q + 128.
            let (a, b) = (src.t4(off + 2), src.t4(off + 18));
            let flip = S::splat(0x8080_8080);
            let mut w = [flip; 8];
            for k in 0..4 {
                w[k] = S::xor(a[k], flip);
                w[4 + k] = S::xor(b[k], flip);
            }
            w
        }
    }
}

impl<S: Lanes> Kernel<S> for Q4_0 {
    block32_common!(18, min: false, max: 15);
    #[inline(always)]
    unsafe fn head(src: &Seg<S>, off: usize) -> Head32<S> {
        unsafe { Head32 { d: S::f16_lo(src.word(off)), m: S::zero_f(), qh: S::splat(0) } }
    }
    #[inline(always)]
    unsafe fn chunk(src: &Seg<S>, off: usize, _: usize, _: &Head32<S>) -> Chunk<S> {
        unsafe { nibbles::<S>(src.t4(off + 2)) }
    }
}

impl<S: Lanes> Kernel<S> for Q4_1 {
    block32_common!(20, min: true, max: 15);
    #[inline(always)]
    unsafe fn head(src: &Seg<S>, off: usize) -> Head32<S> {
        unsafe {
            let dm = src.word(off);
            Head32 { d: S::f16_lo(dm), m: S::f16_lo(S::srli::<16>(dm)), qh: S::splat(0) }
        }
    }
    #[inline(always)]
    unsafe fn chunk(src: &Seg<S>, off: usize, _: usize, _: &Head32<S>) -> Chunk<S> {
        unsafe { nibbles::<S>(src.t4(off + 4)) }
    }
}

impl<S: Lanes> Kernel<S> for Q5_0 {
    block32_common!(22, min: false, max: 31);
    #[inline(always)]
    unsafe fn head(src: &Seg<S>, off: usize) -> Head32<S> {
        unsafe { Head32 { d: S::f16_lo(src.word(off)), m: S::zero_f(), qh: src.word(off + 2) } }
    }
    #[inline(always)]
    unsafe fn chunk(src: &Seg<S>, off: usize, _: usize, h: &Head32<S>) -> Chunk<S> {
        unsafe { fifth_bit::<S>(nibbles::<S>(src.t4(off + 6)), h.qh) }
    }
}

impl<S: Lanes> Kernel<S> for Q5_1 {
    block32_common!(24, min: true, max: 31);
    #[inline(always)]
    unsafe fn head(src: &Seg<S>, off: usize) -> Head32<S> {
        unsafe {
            let dm = src.word(off);
            Head32 { d: S::f16_lo(dm), m: S::f16_lo(S::srli::<16>(dm)), qh: src.word(off + 4) }
        }
    }
    #[inline(always)]
    unsafe fn chunk(src: &Seg<S>, off: usize, _: usize, h: &Head32<S>) -> Chunk<S> {
        unsafe { fifth_bit::<S>(nibbles::<S>(src.t4(off + 8)), h.qh) }
    }
}

/// MXFP4 codes looked up as `value + 12` (0..=24), doubled e2m1 values made unsigned.
const MXFP4_LUT: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (MXFP4_VALUES[i] + 12) as u8;
        i += 1;
    }
    t
};

/// `2^(e - 128)` per lane from the e8m0 byte `e` (low byte of each lane), built from
/// bits as `sluice_core::quant::e8m0_half`: `(e - 1) << 23` for `e >= 2`, and the
/// subnormals `0x200000 << e` for `e < 2`.
#[inline(always)]
unsafe fn e8m0_half<S: Lanes>(e: S::I) -> S::F {
    unsafe {
        let big = S::srli::<8>(S::add(e, S::splat(254))); // 1 when e >= 2, else 0
        let mask = S::sub(S::splat(0), big);
        let normal = S::slli::<23>(S::sub(e, S::splat(1)));
        let sub = S::add(S::splat(0x0020_0000), S::slli::<21>(e));
        S::bits_f(S::or(S::and(mask, normal), S::and(S::xor(mask, S::splat(!0)), sub)))
    }
}

impl<S: Lanes> Kernel<S> for Mxfp4 {
    block32_common!(17, min: false, max: 24);
    #[inline(always)]
    unsafe fn head(src: &Seg<S>, off: usize) -> Head32<S> {
        unsafe {
            let e = S::and(src.word(off), S::splat(0xFF));
            Head32 { d: e8m0_half::<S>(e), m: S::zero_f(), qh: S::splat(0) }
        }
    }
    #[inline(always)]
    unsafe fn chunk(src: &Seg<S>, off: usize, _: usize, _: &Head32<S>) -> Chunk<S> {
        unsafe {
            let mut w = nibbles::<S>(src.t4(off + 1));
            for v in w.iter_mut() {
                *v = S::lut16(*v, &MXFP4_LUT);
            }
            w
        }
    }
}
