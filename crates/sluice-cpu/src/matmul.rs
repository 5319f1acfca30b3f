//! `out = x · Wᵀ` for a stored weight matrix W (`[rows, cols]`, any format) and `n`
//! f32 input rows.

use sluice_core::{MatRef, Precision};

/// `x` is `[n, w.cols]`, `out` is `[n, w.rows]`, both row-major.
///
/// Quantized weights are computed on in their blocks against activations quantized
/// once per call to 8 bits, or with [`Precision::Accurate`] to 16 (per block of 32
/// elements; the `quant` module's docs); f32, f16 and bf16 weights in f32. Every
/// output is computed whole by one thread in a fixed order, so the result is bitwise
/// the same for any thread count, for one token at a time or a batch (row `i` of a
/// batch equals a call with row `i` alone), and for every ISA.
pub fn matmul(w: MatRef<'_>, x: &[f32], n: usize, out: &mut [f32], p: Precision) {
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(x.len(), n * cols, "matmul: input is not [{n}, {cols}]");
    assert_eq!(out.len(), n * rows, "matmul: output is not [{n}, {rows}]");
    if n == 0 || rows == 0 {
        return;
    }
    if cols == 0 {
        out.fill(0.0);
        return;
    }
    if w.dtype.is_quantized() {
        crate::quant::matmul_many(&[w], x, n, &mut [out], p)
    } else {
        crate::plain::matmul(w, x, n, out)
    }
}

/// `outs[i] = x · W_iᵀ` for several matrices that share their input (the q, k and v
/// projections, or gate and up): bitwise what separate [`matmul`] calls give, but
/// as one parallel job, with the input quantized once per weight format. A decode
/// step makes hundreds of small matmul calls, and each one split over threads
/// costs a hand-off and a wait for the slowest part.
pub fn matmul_many(ws: &[MatRef<'_>], x: &[f32], n: usize, outs: &mut [&mut [f32]], p: Precision) {
    assert_eq!(ws.len(), outs.len(), "matmul_many: {} matrices but {} outputs", ws.len(), outs.len());
    let shared = ws.iter().all(|w| w.dtype.is_quantized() && w.rows > 0 && w.cols > 0 && w.cols == ws[0].cols);
    if ws.len() < 2 || n == 0 || !shared {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            matmul(*w, x, n, out, p);
        }
        return;
    }
    for (w, out) in ws.iter().zip(outs.iter()) {
        assert_eq!(x.len(), n * w.cols, "matmul_many: input is not [{n}, {}]", w.cols);
        assert_eq!(out.len(), n * w.rows, "matmul_many: output is not [{n}, {}]", w.rows);
    }
    crate::quant::matmul_many(ws, x, n, outs, p)
}
