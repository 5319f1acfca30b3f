//! aarch64 lanes: four rows per tile in 128-bit NEON registers.
//!
//! The byte dot products use widening multiplies (`smull`-style: u8 and i8 widened to
//! i16, multiplied, pairwise added), which every AArch64 core has; the `sdot`
//! instruction of the optional dot-product extension would be faster but is not
//! assumed. Half floats are converted with integer arithmetic because Rust's
//! `float16x4_t` is not stable.

use std::arch::aarch64::*;

use super::lanes::{Lanes, Tile};

#[derive(Clone, Copy)]
pub(crate) struct Neon;

impl Lanes for Neon {
    const N: usize = 4;
    type I = uint32x4_t;
    type F = float32x4_t;

    const WIN: usize = 16;

    #[inline(always)]
    unsafe fn transpose(t: &Tile, off: usize, out: *mut uint32x4_t) {
        unsafe {
            let ld = |i: usize| vreinterpretq_u32_u8(vld1q_u8(t.row(i).add(off)));
            let (r0, r1, r2, r3) = (ld(0), ld(1), ld(2), ld(3));
            let t0 = vtrn1q_u32(r0, r1);
            let t1 = vtrn2q_u32(r0, r1);
            let t2 = vtrn1q_u32(r2, r3);
            let t3 = vtrn2q_u32(r2, r3);
            let q = |v: uint32x4_t| vreinterpretq_u64_u32(v);
            let u = |v: uint64x2_t| vreinterpretq_u32_u64(v);
            out.write(u(vtrn1q_u64(q(t0), q(t2))));
            out.add(1).write(u(vtrn1q_u64(q(t1), q(t3))));
            out.add(2).write(u(vtrn2q_u64(q(t0), q(t2))));
            out.add(3).write(u(vtrn2q_u64(q(t1), q(t3))));
        }
    }

    #[inline(always)]
    unsafe fn splat(v: u32) -> uint32x4_t {
        unsafe { vdupq_n_u32(v) }
    }
    #[inline(always)]
    unsafe fn and(a: uint32x4_t, b: uint32x4_t) -> uint32x4_t {
        unsafe { vandq_u32(a, b) }
    }
    #[inline(always)]
    unsafe fn or(a: uint32x4_t, b: uint32x4_t) -> uint32x4_t {
        unsafe { vorrq_u32(a, b) }
    }
    #[inline(always)]
    unsafe fn xor(a: uint32x4_t, b: uint32x4_t) -> uint32x4_t {
        unsafe { veorq_u32(a, b) }
    }
    #[inline(always)]
    unsafe fn add(a: uint32x4_t, b: uint32x4_t) -> uint32x4_t {
        unsafe { vaddq_u32(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: uint32x4_t, b: uint32x4_t) -> uint32x4_t {
        unsafe { vsubq_u32(a, b) }
    }
    #[inline(always)]
    unsafe fn srli<const S: u32>(a: uint32x4_t) -> uint32x4_t {
        unsafe { Self::srl(a, S) }
    }
    #[inline(always)]
    unsafe fn slli<const S: u32>(a: uint32x4_t) -> uint32x4_t {
        unsafe { vshlq_u32(a, vdupq_n_s32(S as i32)) }
    }
    #[inline(always)]
    unsafe fn srai<const S: u32>(a: uint32x4_t) -> uint32x4_t {
        unsafe { vreinterpretq_u32_s32(vshlq_s32(vreinterpretq_s32_u32(a), vdupq_n_s32(-(S as i32)))) }
    }
    #[inline(always)]
    unsafe fn srl(a: uint32x4_t, s: u32) -> uint32x4_t {
        // A negative count shifts right.
        unsafe { vshlq_u32(a, vdupq_n_s32(-(s as i32))) }
    }
    #[inline(always)]
    unsafe fn sll(a: uint32x4_t, s: u32) -> uint32x4_t {
        unsafe { vshlq_u32(a, vdupq_n_s32(s as i32)) }
    }
    #[inline(always)]
    unsafe fn lut16(a: uint32x4_t, table: &[u8; 16]) -> uint32x4_t {
        unsafe { vreinterpretq_u32_u8(vqtbl1q_u8(vld1q_u8(table.as_ptr()), vreinterpretq_u8_u32(a))) }
    }

    #[inline(always)]
    unsafe fn dpbusd(acc: uint32x4_t, w: uint32x4_t, x: u32) -> uint32x4_t {
        unsafe {
            let wb = vreinterpretq_u8_u32(w);
            let xb = vreinterpretq_s8_u32(vdupq_n_u32(x));
            // |u8 * i8| <= 255 * 128 fits i16.
            let lo = vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(wb))), vmovl_s8(vget_low_s8(xb)));
            let hi = vmulq_s16(vreinterpretq_s16_u16(vmovl_high_u8(wb)), vmovl_high_s8(xb));
            // Pairs, then pairs of pairs: lane i = sum of the four products of lane i.
            let s = vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi));
            vaddq_u32(acc, vreinterpretq_u32_s32(s))
        }
    }
    #[inline(always)]
    unsafe fn dpbusd_full(acc: uint32x4_t, w: uint32x4_t, x: u32) -> uint32x4_t {
        unsafe { Self::dpbusd(acc, w, x) }
    }
    #[inline(always)]
    unsafe fn zero_f() -> float32x4_t {
        unsafe { vdupq_n_f32(0.0) }
    }
    #[inline(always)]
    unsafe fn splat_f(v: f32) -> float32x4_t {
        unsafe { vdupq_n_f32(v) }
    }
    #[inline(always)]
    unsafe fn cvt(a: uint32x4_t) -> float32x4_t {
        unsafe { vcvtq_f32_s32(vreinterpretq_s32_u32(a)) }
    }
    #[inline(always)]
    unsafe fn f16_lo(a: uint32x4_t) -> float32x4_t {
        unsafe {
            // Exponent and mantissa moved into f32 position and scaled by 2^112 are exact
            // for normals and subnormals; infinities and NaNs get the f32 all-ones exponent.
            let h = vandq_u32(a, vdupq_n_u32(0xFFFF));
            let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
            let em = vshlq_n_u32::<13>(vandq_u32(h, vdupq_n_u32(0x7FFF)));
            let scaled =
                vreinterpretq_u32_f32(vmulq_f32(vreinterpretq_f32_u32(em), vdupq_n_f32(f32::from_bits(0x7780_0000))));
            let special = vcgeq_u32(em, vdupq_n_u32(0x0F80_0000));
            let inf_nan = vorrq_u32(em, vdupq_n_u32(0x7F80_0000));
            vreinterpretq_f32_u32(vorrq_u32(vbslq_u32(special, inf_nan, scaled), sign))
        }
    }
    #[inline(always)]
    unsafe fn bits_f(a: uint32x4_t) -> float32x4_t {
        unsafe { vreinterpretq_f32_u32(a) }
    }
    #[inline(always)]
    unsafe fn mul_f(a: float32x4_t, b: float32x4_t) -> float32x4_t {
        unsafe { vmulq_f32(a, b) }
    }
    #[inline(always)]
    unsafe fn fma_f(a: float32x4_t, b: float32x4_t, c: float32x4_t) -> float32x4_t {
        unsafe { vfmaq_f32(c, a, b) }
    }
    #[inline(always)]
    unsafe fn store(v: float32x4_t, out: *mut f32, valid: usize) {
        unsafe {
            if valid == 4 {
                vst1q_f32(out, v)
            } else {
                let mut tmp = [0f32; 4];
                vst1q_f32(tmp.as_mut_ptr(), v);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), out, valid);
            }
        }
    }
}
