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
        crate::quant::matmul_grouped(&mut [&mut Product { w, x, n, out, precision: p }])
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
    let mut products: Vec<Product<'_>> =
        ws.iter().zip(outs.iter_mut()).map(|(&w, out)| Product { w, x, n, out, precision: p }).collect();
    matmul_grouped(&mut products);
}

/// One product of [`matmul_grouped`]: `out = x · wᵀ` over `n` rows.
pub struct Product<'a> {
    pub w: MatRef<'a>,
    /// `[n, w.cols]`, row-major.
    pub x: &'a [f32],
    pub n: usize,
    /// `[n, w.rows]`, row-major.
    pub out: &'a mut [f32],
    pub precision: Precision,
}

/// Products with inputs of their own (the experts of a MoE layer, each on the rows
/// routed to it): bitwise what separate [`matmul`] calls give, but the quantized
/// ones as one parallel job, their tiles in one index space split by their cost.
/// A layer's experts are dozens of small products when several sequences step
/// together; splitting each over the threads costs a hand-off and a wait per product
/// (measured on Qwen3-30B-A3B's experts, 8 rows, 2 threads: 172 us an expert split
/// one by one, 123 us grouped). Inputs shared by several products (the same slice)
/// are quantized once.
pub fn matmul_grouped(products: &mut [Product<'_>]) {
    for p in products.iter() {
        assert_eq!(p.x.len(), p.n * p.w.cols, "matmul: input is not [{}, {}]", p.n, p.w.cols);
        assert_eq!(p.out.len(), p.n * p.w.rows, "matmul: output is not [{}, {}]", p.n, p.w.rows);
    }
    let mut quantized = Vec::new();
    for p in products.iter_mut() {
        if p.n == 0 || p.w.rows == 0 {
            continue;
        }
        if p.w.cols == 0 {
            p.out.fill(0.0);
        } else if p.w.dtype.is_quantized() {
            quantized.push(p);
        } else {
            crate::plain::matmul(p.w, p.x, p.n, p.out);
        }
    }
    crate::quant::matmul_grouped(&mut quantized);
}
