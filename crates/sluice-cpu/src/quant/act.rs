//! Activations quantized to 8 bits, once per matmul.
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

/// `n` quantized activation rows of `cols` elements.
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
    pub fn new(kind: ActKind, x: &[f32], n: usize, cols: usize) -> QAct {
        assert!(cols.is_multiple_of(QB) && x.len() == n * cols);
        let blocks = cols / QB;
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
                .zip(x.chunks(cols))
                .map(|((((xq, d), aux), sx), x)| RowOut { x, xq, d, aux, sx, aux16: aux16.next().unwrap_or_default() });
        if n > 1 && n * cols >= 1 << 16 {
            rows.collect::<Vec<_>>().into_par_iter().for_each(|r| quantize_row(kind, r));
        } else {
            rows.for_each(|r| quantize_row(kind, r));
        }
        a
    }

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

/// One row's input and where its quantized form goes.
struct RowOut<'a> {
    x: &'a [f32],
    xq: &'a mut [i8],
    d: &'a mut [f32],
    aux: &'a mut [i32],
    sx: &'a mut [f32],
    aux16: &'a mut [i32],
}

fn quantize_row(kind: ActKind, r: RowOut) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // Same code, compiled with wider vectors; the arithmetic is exact or one
            // IEEE operation per element, so the result does not change.
            return unsafe { quantize_row_avx2(kind, r) };
        }
    }
    quantize_row_generic(kind, r)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_avx2(kind: ActKind, r: RowOut) {
    quantize_row_generic(kind, r)
}

#[inline(always)]
fn quantize_row_generic(kind: ActKind, r: RowOut) {
    let RowOut { x, xq, d, aux, sx, aux16 } = r;
    for (b, (xb, qb)) in x.chunks_exact(QB).zip(xq.chunks_exact_mut(QB)).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let db = amax / 127.0;
        let id = if db != 0.0 { 1.0 / db } else { 0.0 };
        for (q, &v) in qb.iter_mut().zip(xb) {
            // `as` saturates (and maps NaN to 0); |v * id| <= 127 up to rounding anyway.
            *q = (v * id).round_ties_even() as i8;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Scales, round-half-even codes, and the block sums, on a hand-checkable block.
    #[test]
    fn quantizes_blocks_and_sums() {
        // Block 0: max |x| = 127 so d = 1 and codes are x rounded half to even;
        // block 1: all zeros.
        let mut x = vec![0f32; 64];
        for (i, v) in x.iter_mut().take(32).enumerate() {
            *v = i as f32 - 16.5;
        }
        x[31] = -127.0;
        let a = QAct::new(ActKind { off: 8, sums16: true }, &x, 1, 64);
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
