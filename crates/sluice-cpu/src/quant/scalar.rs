//! Portable lanes: eight rows per tile held in plain arrays. The reference for every
//! SIMD implementation (they must agree with it bit for bit), and the fallback on
//! CPUs without one.

use super::lanes::{Lanes, Tile};

const N: usize = 8;

#[derive(Clone, Copy)]
pub(crate) struct Scalar;

#[inline(always)]
fn map(a: [u32; N], f: impl Fn(u32) -> u32) -> [u32; N] {
    a.map(f)
}

#[inline(always)]
fn zip(a: [u32; N], b: [u32; N], f: impl Fn(u32, u32) -> u32) -> [u32; N] {
    std::array::from_fn(|i| f(a[i], b[i]))
}

impl Lanes for Scalar {
    const N: usize = N;
    type I = [u32; N];
    type F = [f32; N];

    const WIN: usize = 16;

    #[inline(always)]
    unsafe fn transpose(t: &Tile, off: usize, out: *mut [u32; N]) {
        for k in 0..4 {
            let v = std::array::from_fn(|i| unsafe {
                u32::from_le_bytes(std::ptr::read_unaligned(t.row(i).add(off + 4 * k) as *const [u8; 4]))
            });
            unsafe { out.add(k).write(v) };
        }
    }

    #[inline(always)]
    unsafe fn splat(v: u32) -> [u32; N] {
        [v; N]
    }
    #[inline(always)]
    unsafe fn and(a: [u32; N], b: [u32; N]) -> [u32; N] {
        zip(a, b, |x, y| x & y)
    }
    #[inline(always)]
    unsafe fn or(a: [u32; N], b: [u32; N]) -> [u32; N] {
        zip(a, b, |x, y| x | y)
    }
    #[inline(always)]
    unsafe fn xor(a: [u32; N], b: [u32; N]) -> [u32; N] {
        zip(a, b, |x, y| x ^ y)
    }
    #[inline(always)]
    unsafe fn add(a: [u32; N], b: [u32; N]) -> [u32; N] {
        zip(a, b, u32::wrapping_add)
    }
    #[inline(always)]
    unsafe fn sub(a: [u32; N], b: [u32; N]) -> [u32; N] {
        zip(a, b, u32::wrapping_sub)
    }
    #[inline(always)]
    unsafe fn srli<const S: u32>(a: [u32; N]) -> [u32; N] {
        map(a, |x| x >> S)
    }
    #[inline(always)]
    unsafe fn slli<const S: u32>(a: [u32; N]) -> [u32; N] {
        map(a, |x| x << S)
    }
    #[inline(always)]
    unsafe fn srai<const S: u32>(a: [u32; N]) -> [u32; N] {
        map(a, |x| ((x as i32) >> S) as u32)
    }
    #[inline(always)]
    unsafe fn srl(a: [u32; N], s: u32) -> [u32; N] {
        map(a, |x| x >> s)
    }
    #[inline(always)]
    unsafe fn sll(a: [u32; N], s: u32) -> [u32; N] {
        map(a, |x| x << s)
    }
    #[inline(always)]
    unsafe fn lut16(a: [u32; N], table: &[u8; 16]) -> [u32; N] {
        map(a, |x| u32::from_le_bytes(x.to_le_bytes().map(|b| table[b as usize & 15])))
    }

    #[inline(always)]
    unsafe fn dpbusd(acc: [u32; N], w: [u32; N], x: u32) -> [u32; N] {
        let xb = x.to_le_bytes().map(|b| b as i8 as i32);
        zip(acc, w, |a, w| {
            let wb = w.to_le_bytes();
            let s: i32 = (0..4).map(|j| wb[j] as i32 * xb[j]).sum();
            (a as i32).wrapping_add(s) as u32
        })
    }
    #[inline(always)]
    unsafe fn dpbusd_full(acc: [u32; N], w: [u32; N], x: u32) -> [u32; N] {
        unsafe { Self::dpbusd(acc, w, x) }
    }
    #[inline(always)]
    unsafe fn zero_f() -> [f32; N] {
        [0.0; N]
    }
    #[inline(always)]
    unsafe fn splat_f(v: f32) -> [f32; N] {
        [v; N]
    }
    #[inline(always)]
    unsafe fn cvt(a: [u32; N]) -> [f32; N] {
        a.map(|x| x as i32 as f32)
    }
    #[inline(always)]
    unsafe fn f16_lo(a: [u32; N]) -> [f32; N] {
        a.map(|x| half::f16::from_bits(x as u16).to_f32())
    }
    #[inline(always)]
    unsafe fn bits_f(a: [u32; N]) -> [f32; N] {
        a.map(f32::from_bits)
    }
    #[inline(always)]
    unsafe fn mul_f(a: [f32; N], b: [f32; N]) -> [f32; N] {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn fma_f(a: [f32; N], b: [f32; N], c: [f32; N]) -> [f32; N] {
        std::array::from_fn(|i| a[i].mul_add(b[i], c[i]))
    }
    #[inline(always)]
    unsafe fn store(v: [f32; N], out: *mut f32, valid: usize) {
        for (i, &x) in v.iter().enumerate().take(valid) {
            unsafe { *out.add(i) = x };
        }
    }
}
