//! Activations quantized to 8 or 16 bits per block of 32, once per matmul.
//!
//! Every block of 32 inputs gets a scale `d = max|x| / 127` and
//! `q = round_half_even(x / d)`, computed as `x * (1 / d)`; elements stay in their
//! natural order. 32-element blocks serve every weight format, the K-quants
//! included (ggml's Q8_K uses one scale per 256): models with massive activation
//! channels (Qwen2.5, for one) put a value hundreds of times larger than the rest
//! into some blocks, which then quantize everything else in them to zero. With 256
//! per block that erased half of a 1536-wide input and cost a mean KL of 0.13 on
//! Qwen2.5-Coder-1.5B Q4_K_M; with 32 it is confined to a few small blocks.
//!
//! With `Precision::Accurate` each block is quantized to 16 bits instead, with
//! `d = max|x| / 32512` (127 * 256) and `Q = round_half_even(x / d)`, and `Q` is
//! split into a high and a low byte, `Q = 256 * hi + lo` (`hi` in -127..=127, `lo` in
//! -128..=127), because the kernels multiply bytes. A kernel takes both byte dot
//! products with the same unpacked weights and joins them as integers,
//! `(w·hi << 8) + w·lo = w·Q` (exact: at most 2^28 in magnitude), before anything
//! else, so everything after the integer sums (scaling, folding, the lane
//! transposes of the row kernels) is done once, as for 8 bits. 8 bits left
//! SmolLM2-135M's logits up to 1.4 (5% of the largest) from the f32 reference over
//! the same weights, enough to flip a greedy answer whose top two candidates were
//! 0.08 apart; with 16 the difference was a few thousandths. In decode the second
//! byte costs one more `vpdpbusd` per four codes and a shift, a few percent (most of
//! the time goes to reading and unpacking weights); in prefill, which is bound by
//! that integer arithmetic, it about doubles the time.
//!
//! Alongside come the sums the weight formats fold in, so kernels never sum
//! activations themselves (`q` is the 8- or 16-bit code):
//!
//! - offset formats (Q4_0, Q5_0, Q8_0 and MXFP4 are stored as unsigned codes
//!   `c = q + off`): `aux = -off * sum(q)` per block, the start value of the block's
//!   integer dot product, so that `aux + sum(c * x) = sum(q * x)` exactly;
//! - min formats (Q4_1, Q5_1, and the mins of Q4_K and Q5_K):
//!   `sx = d * sum(q)`, the block's activation sum that multiplies the min;
//! - Q6_K (codes `c = q + 32`): `aux16 = -32 * sum` of each 16-element half-block.
//!
//! Everything here is exact integer arithmetic or a single IEEE operation, so the
//! result is the same whatever vector width the compiler picks.

use rayon::prelude::*;

/// Elements per activation block.
pub(crate) const QB: usize = 32;

/// What a weight format needs from the quantized activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ActKind {
    /// `aux = -off * sum(q)` per block.
    pub off: i32,
    /// Whether `-32 * sum` of each 16 elements is wanted (Q6_K).
    pub sums16: bool,
}

/// `n` input rows of `cols` elements, quantized to 8 bits (one byte of codes per
/// element) or 16 (`parts == 2`: the high bytes, then the low ones).
pub(crate) struct QAct {
    cols: usize,
    blocks: usize,
    parts: usize,
    /// `parts * n` rows of `cols` codes: input row `i`'s bytes `p` are row `parts * i + p`.
    xq: Vec<i8>,
    d: Vec<f32>,
    aux: Vec<i32>,
    sx: Vec<f32>,
    aux16: Vec<i32>,
}

/// One token's quantized activations, as raw pointers for the kernels' inner loops.
#[derive(Clone, Copy)]
pub(crate) struct Tok {
    /// `cols` codes, natural order: the 8-bit codes, or the high bytes of 16-bit ones.
    pub xq: *const i8,
    /// The low bytes of 16-bit codes (null for 8 bits).
    pub lo: *const i8,
    /// Per 32-element block: the scale, `-off * sum(q)`, and `d * sum(q)`.
    pub d: *const f32,
    pub aux: *const i32,
    pub sx: *const f32,
    /// Per 16 elements: `-32 * sum(q)` (Q6_K only).
    pub aux16: *const i32,
}

impl QAct {
    /// Quantizes `x` (`[n, cols]`) to 8 bits per element (`parts == 1`) or 16 (`2`),
    /// using several threads for long prefill batches.
    pub fn new(kind: ActKind, x: &[f32], n: usize, cols: usize, parts: usize) -> QAct {
        assert!(cols.is_multiple_of(QB) && x.len() == n * cols && (1..=2).contains(&parts));
        let blocks = cols / QB;
        let per16 = if kind.sums16 { 2 * blocks } else { 0 };
        let mut a = QAct {
            cols,
            blocks,
            parts,
            xq: vec![0; parts * n * cols],
            d: vec![0.0; n * blocks],
            aux: vec![0; n * blocks],
            sx: vec![0.0; n * blocks],
            aux16: vec![0; n * per16],
        };
        let mut aux16 = a.aux16.chunks_mut(per16.max(1));
        let rows: Vec<_> = x
            .chunks(cols)
            .zip(a.xq.chunks_mut(parts * cols))
            .zip(a.d.chunks_mut(blocks))
            .zip(a.aux.chunks_mut(blocks))
            .zip(a.sx.chunks_mut(blocks))
            .map(|((((x, xq), d), aux), sx)| (x, RowOut { xq, d, aux, sx, aux16: aux16.next().unwrap_or_default() }))
            .collect();
        let quantize = |(x, r): (&[f32], RowOut)| quantize_row(kind, parts, x, r);
        if n > 1 && parts * n * cols >= 1 << 16 {
            rows.into_par_iter().for_each(quantize);
        } else {
            rows.into_iter().for_each(quantize);
        }
        a
    }

    #[inline]
    pub fn tok(&self, i: usize) -> Tok {
        let b = i * self.blocks;
        let xq = self.xq[self.parts * i * self.cols..].as_ptr();
        Tok {
            xq,
            lo: if self.parts == 2 { xq.wrapping_add(self.cols) } else { std::ptr::null() },
            d: self.d[b..].as_ptr(),
            aux: self.aux[b..].as_ptr(),
            sx: self.sx[b..].as_ptr(),
            aux16: if self.aux16.is_empty() { std::ptr::null() } else { self.aux16[2 * b..].as_ptr() },
        }
    }
}

/// Where one quantized row goes (`xq` holds `parts` rows of codes).
struct RowOut<'a> {
    xq: &'a mut [i8],
    d: &'a mut [f32],
    aux: &'a mut [i32],
    sx: &'a mut [f32],
    aux16: &'a mut [i32],
}

/// Quantizes `x` into `r`, to 8 bits or (`parts == 2`) 16.
fn quantize_row(kind: ActKind, parts: usize, x: &[f32], r: RowOut) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // Same code, compiled with wider vectors; the arithmetic is exact or one
            // IEEE operation per element, so the result does not change.
            return unsafe { quantize_row_avx2(kind, parts, x, r) };
        }
    }
    quantize_row_generic(kind, parts, x, r)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_avx2(kind: ActKind, parts: usize, x: &[f32], r: RowOut) {
    quantize_row_generic(kind, parts, x, r)
}

/// The largest 16-bit code, 127 * 256: its high byte rounds to 127.
const Q16_MAX: f32 = 32512.0;

#[inline(always)]
fn quantize_row_generic(kind: ActKind, parts: usize, x: &[f32], r: RowOut) {
    let RowOut { xq, d, aux, sx, aux16 } = r;
    let cols = x.len();
    let (hi, lo) = xq.split_at_mut(cols);
    for (b, xb) in x.chunks_exact(QB).enumerate() {
        // Whole blocks, so the loops over them unroll and vectorise.
        let xb: &[f32; QB] = xb.try_into().unwrap();
        let qb: &mut [i8; QB] = (&mut hi[QB * b..QB * b + QB]).try_into().unwrap();
        let amax = abs_max(xb);
        let mut q = [0i32; QB];
        let db = if parts == 1 {
            let db = amax / 127.0;
            let id = if db != 0.0 { 1.0 / db } else { 0.0 };
            for ((c, q), &v) in qb.iter_mut().zip(&mut q).zip(xb) {
                *c = to_code(v * id);
                *q = *c as i32;
            }
            db
        } else {
            let lb: &mut [i8; QB] = (&mut lo[QB * b..QB * b + QB]).try_into().unwrap();
            let db = amax / Q16_MAX;
            let id = if db != 0.0 { 1.0 / db } else { 0.0 };
            for (((h, l), q), &v) in qb.iter_mut().zip(lb.iter_mut()).zip(&mut q).zip(xb) {
                *q = to_code16(v * id);
                // Rounded high byte (-127..=127) and what is left (-128..=127).
                let top = (*q + 128) >> 8;
                *h = top as i8;
                *l = (*q - 256 * top) as i8;
            }
            db
        };
        let (s0, s1) = (q[..16].iter().sum::<i32>(), q[16..].iter().sum::<i32>());
        d[b] = db;
        aux[b] = -kind.off * (s0 + s1);
        sx[b] = db * (s0 + s1) as f32;
        if kind.sums16 {
            aux16[2 * b] = -32 * s0;
            aux16[2 * b + 1] = -32 * s1;
        }
    }
}

/// `r` rounded half to even and clamped to `±Q16_MAX` (NaN to 0), as [`to_code`].
#[inline(always)]
fn to_code16(r: f32) -> i32 {
    let r = r.round_ties_even();
    let r = if r.is_nan() { 0.0 } else { r.clamp(-Q16_MAX, Q16_MAX) };
    // Safety: `r` is a whole number in i32's range.
    unsafe { r.to_int_unchecked::<i32>() }
}

/// `r` rounded half to even and converted as `as i8` would (saturating, NaN to 0),
/// written so that the loop around it vectorises: `as i8` on a float does not.
#[inline(always)]
fn to_code(r: f32) -> i8 {
    let r = r.round_ties_even();
    let r = if r.is_nan() { 0.0 } else { r.clamp(-128.0, 127.0) };
    // Safety: `r` is a whole number in i32's range.
    unsafe { r.to_int_unchecked::<i32>() as i8 }
}

/// The largest `|x|`, NaNs ignored (0 if there is nothing else), as `f32::max`
/// would fold it. Compared as bit patterns, which order non-negative floats as
/// their values do, so the loop vectorises (a float max fold does not: its NaN
/// rule fixes the order).
#[inline(always)]
fn abs_max(xb: &[f32]) -> f32 {
    // Eight running maxima, one per lane of a vector.
    let mut m = [0u32; 8];
    for c in xb.chunks_exact(8) {
        for (m, v) in m.iter_mut().zip(c) {
            let b = v.to_bits() & 0x7FFF_FFFF;
            // NaNs are the patterns above infinity's.
            *m = (*m).max(if b > 0x7F80_0000 { 0 } else { b });
        }
    }
    let tail = xb.chunks_exact(8).remainder().iter().map(|v| v.to_bits() & 0x7FFF_FFFF);
    f32::from_bits(m.into_iter().chain(tail.map(|b| if b > 0x7F80_0000 { 0 } else { b })).max().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scales, round-half-even codes, and the block sums, on a hand-checkable block.
    #[test]
    fn abs_max_is_the_float_fold() {
        let fold = |x: &[f32]| x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let cases: [&[f32]; 6] = [
            &[1.0, -3.5, 2.0],
            &[f32::NAN, -2.0, 1.0],
            &[f32::NAN, -f32::NAN],
            &[-0.0, 0.0],
            &[f32::NEG_INFINITY, 7.0, f32::NAN],
            &[1e-45, -1e-44, 0.0],
        ];
        for x in cases {
            assert_eq!(abs_max(x).to_bits(), fold(x).to_bits(), "{x:?}");
        }
    }

    #[test]
    fn to_code_is_the_saturating_cast() {
        for r in [0.0, -0.0, 0.5, 1.5, 2.5, -2.5, 126.5, 127.4, 127.5, 300.0, -128.5, -1e9, f32::INFINITY, f32::NAN] {
            assert_eq!(to_code(r), r.round_ties_even() as i8, "{r}");
        }
    }

    #[test]
    fn quantizes_blocks_and_sums() {
        // Block 0: max |x| = 127 so d = 1 and codes are x rounded half to even;
        // block 1: all zeros.
        let mut x = vec![0f32; 64];
        for (i, v) in x.iter_mut().take(32).enumerate() {
            *v = i as f32 - 16.5;
        }
        x[31] = -127.0;
        let a = QAct::new(ActKind { off: 8, sums16: true }, &x, 1, 64, 1);
        let t = a.tok(0);
        let q = unsafe { std::slice::from_raw_parts(t.xq, 64) };
        let want: Vec<i8> = (0..31).map(|i| (i as f32 - 16.5).round_ties_even() as i8).chain([-127]).collect();
        assert_eq!(&q[..32], &want[..]);
        assert!(q[32..].iter().all(|&v| v == 0));
        let (s0, s1) =
            (want[..16].iter().map(|&v| v as i32).sum::<i32>(), want[16..].iter().map(|&v| v as i32).sum::<i32>());
        unsafe {
            assert_eq!((*t.d, *t.d.add(1)), (1.0, 0.0));
            assert_eq!(*t.aux, -8 * (s0 + s1));
            assert_eq!(*t.sx, (s0 + s1) as f32);
            assert_eq!((*t.aux16, *t.aux16.add(1), *t.aux16.add(2)), (-32 * s0, -32 * s1, 0));
        }
    }

    /// 16-bit codes: the two bytes join to `round(x / d)` with `d = max|x| / 32512`,
    /// the high byte is the rounded `Q / 256`, and the sums are of `Q`.
    #[test]
    fn sixteen_bits_split_into_two_bytes() {
        let mut x: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 - 31.7) * 0.013).collect();
        x[5] = -1.5; // the block's largest, Q = -32512
        x[40] = 2.0;
        let a = QAct::new(ActKind { off: 16, sums16: true }, &x, 1, 64, 2);
        let t = a.tok(0);
        let (hi, lo) = unsafe { (std::slice::from_raw_parts(t.xq, 64), std::slice::from_raw_parts(t.lo, 64)) };
        for b in 0..2 {
            let xb = &x[32 * b..32 * b + 32];
            let d = xb.iter().fold(0f32, |m, v| m.max(v.abs())) / 32512.0;
            assert_eq!(unsafe { *t.d.add(b) }, d);
            let q: Vec<i32> = (0..32).map(|i| (xb[i] * (1.0 / d)).round_ties_even() as i32).collect();
            for i in 0..32 {
                let (h, l) = (hi[32 * b + i] as i32, lo[32 * b + i] as i32);
                assert_eq!(256 * h + l, q[i], "element {i} of block {b}");
                assert!((q[i] - 256 * h).abs() <= 128, "element {i} of block {b}");
                assert!((-127..=127).contains(&h));
            }
            let s: i32 = q.iter().sum();
            unsafe {
                assert_eq!(*t.aux.add(b), -16 * s);
                assert_eq!(*t.sx.add(b), d * s as f32);
                assert_eq!(*t.aux16.add(2 * b), -32 * q[..16].iter().sum::<i32>());
            }
        }
        assert_eq!(hi[5], -127);
        assert_eq!(hi[40], 127);
    }
}
