//! Activations quantized to 8 bits, twice, once per matmul.
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
//! With `Precision::Accurate` each input row is quantized a second time: the
//! remainder `x - d * q`, with its own scales (at most `d / 254` each). The kernels
//! treat the two parts as two tokens and the matmul adds their outputs, so
//! activations carry about 15 bits instead of 8. One part alone left SmolLM2-135M's
//! logits up to 1.4 (5% of the largest) from the f32 reference over the same
//! weights, enough to flip a greedy answer whose top two candidates were 0.08
//! apart; with both parts the difference was 0.0065. In decode the second part
//! cost 5-15% of the speed on a 2-core x86 machine (most of the time goes to
//! reading, transposing and unpacking weights, which both parts share); in prefill,
//! which is bound by the integer arithmetic, it about doubles the time.
//!
//! Alongside come the sums the weight formats fold in, so kernels never sum
//! activations themselves:
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

/// `n` input rows of `cols` elements, quantized in one part or two (the row, then
/// what the first part left over) as `parts * n` rows: part `p` of input row `i` is
/// row `parts * i + p`.
pub(crate) struct QAct {
    cols: usize,
    blocks: usize,
    xq: Vec<i8>,
    d: Vec<f32>,
    aux: Vec<i32>,
    sx: Vec<f32>,
    aux16: Vec<i32>,
}

/// One token's quantized activations, as raw pointers for the kernels' inner loops.
#[derive(Clone, Copy)]
pub(crate) struct Tok {
    /// `cols` codes, natural order.
    pub xq: *const i8,
    /// Per 32-element block: the scale, `-off * sum(q)`, and `d * sum(q)`.
    pub d: *const f32,
    pub aux: *const i32,
    pub sx: *const f32,
    /// Per 16 elements: `-32 * sum(q)` (Q6_K only).
    pub aux16: *const i32,
}

impl QAct {
    /// Quantizes `x` (`[n, cols]`), using several threads for long prefill batches.
    pub fn new(kind: ActKind, x: &[f32], n: usize, cols: usize, parts: usize) -> QAct {
        assert!(cols.is_multiple_of(QB) && x.len() == n * cols && (1..=2).contains(&parts));
        let blocks = cols / QB;
        let n = parts * n;
        let per16 = if kind.sums16 { 2 * blocks } else { 0 };
        let mut a = QAct {
            cols,
            blocks,
            xq: vec![0; n * cols],
            d: vec![0.0; n * blocks],
            aux: vec![0; n * blocks],
            sx: vec![0.0; n * blocks],
            aux16: vec![0; n * per16],
        };
        let mut aux16 = a.aux16.chunks_mut(per16.max(1));
        let rows =
            a.xq.chunks_mut(cols)
                .zip(a.d.chunks_mut(blocks))
                .zip(a.aux.chunks_mut(blocks))
                .zip(a.sx.chunks_mut(blocks))
                .map(|(((xq, d), aux), sx)| RowOut { xq, d, aux, sx, aux16: aux16.next().unwrap_or_default() });
        // Pair each input row with its two output rows.
        let mut rows = rows;
        let mut pairs = Vec::with_capacity(n / parts);
        for x in x.chunks(cols) {
            let first = rows.next().unwrap();
            let rest = if parts == 2 { rows.next() } else { None };
            pairs.push((x, first, rest));
        }
        let quantize = |(x, first, rest): (&[f32], RowOut, Option<RowOut>)| match rest {
            Some(rest) => {
                let mut left = vec![0f32; x.len()];
                quantize_row(kind, x, first, Some(&mut left));
                quantize_row(kind, &left, rest, None);
            }
            None => quantize_row(kind, x, first, None),
        };
        if n > parts && n * cols >= 1 << 16 {
            pairs.into_par_iter().for_each(quantize);
        } else {
            pairs.into_iter().for_each(quantize);
        }
        a
    }

    #[inline]
    pub fn tok(&self, i: usize) -> Tok {
        let b = i * self.blocks;
        Tok {
            xq: self.xq[i * self.cols..].as_ptr(),
            d: self.d[b..].as_ptr(),
            aux: self.aux[b..].as_ptr(),
            sx: self.sx[b..].as_ptr(),
            aux16: if self.aux16.is_empty() { std::ptr::null() } else { self.aux16[2 * b..].as_ptr() },
        }
    }
}

/// Where one quantized row goes.
struct RowOut<'a> {
    xq: &'a mut [i8],
    d: &'a mut [f32],
    aux: &'a mut [i32],
    sx: &'a mut [f32],
    aux16: &'a mut [i32],
}

/// Quantizes `x` into `r`, and writes `x - d * q` to `left` if given.
fn quantize_row(kind: ActKind, x: &[f32], r: RowOut, left: Option<&mut [f32]>) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // Same code, compiled with wider vectors; the arithmetic is exact or one
            // IEEE operation per element, so the result does not change.
            return unsafe { quantize_row_avx2(kind, x, r, left) };
        }
    }
    quantize_row_generic(kind, x, r, left)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_avx2(kind: ActKind, x: &[f32], r: RowOut, left: Option<&mut [f32]>) {
    quantize_row_generic(kind, x, r, left)
}

#[inline(always)]
fn quantize_row_generic(kind: ActKind, x: &[f32], r: RowOut, mut left: Option<&mut [f32]>) {
    let RowOut { xq, d, aux, sx, aux16 } = r;
    for (b, (xb, qb)) in x.chunks_exact(QB).zip(xq.chunks_exact_mut(QB)).enumerate() {
        // Whole blocks, so the loops over them unroll and vectorise.
        let (xb, qb): (&[f32; QB], &mut [i8; QB]) = (xb.try_into().unwrap(), qb.try_into().unwrap());
        let amax = abs_max(xb);
        let db = amax / 127.0;
        let id = if db != 0.0 { 1.0 / db } else { 0.0 };
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = to_code(v * id);
        }
        if let Some(left) = left.as_deref_mut() {
            // A product then a difference, each rounded once (Rust never fuses them).
            for ((l, &v), &q) in left[QB * b..QB * b + QB].iter_mut().zip(xb).zip(qb.iter()) {
                *l = v - db * q as f32;
            }
        }
        let half = |h: usize| qb[16 * h..16 * h + 16].iter().map(|&q| q as i32).sum::<i32>();
        let (s0, s1) = (half(0), half(1));
        d[b] = db;
        aux[b] = -kind.off * (s0 + s1);
        sx[b] = db * (s0 + s1) as f32;
        if kind.sums16 {
            aux16[2 * b] = -32 * s0;
            aux16[2 * b + 1] = -32 * s1;
        }
    }
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
}
