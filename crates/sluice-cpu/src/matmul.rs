//! `out = x · Wᵀ` for a stored weight matrix W (`[rows, cols]`, any format) and `n`
//! f32 input rows.

use rayon::prelude::*;
use sluice_core::MatRef;

use crate::dot::dot_row;

/// Output rows per parallel task: enough work to pay for the task, few enough that
/// two to sixteen threads all get some.
const ROWS_PER_TASK: usize = 16;

/// `x` is `[n, w.cols]`, `out` is `[n, w.rows]`, both row-major.
///
/// Each output element is one [`dot_row`], computed by exactly one task, so the
/// result does not depend on how many threads run it. A weight row is read once and
/// used against every input row while it is in cache.
pub fn matmul(w: MatRef<'_>, x: &[f32], n: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(x.len(), n * cols, "matmul: input is not [{n}, {cols}]");
    assert_eq!(out.len(), n * rows, "matmul: output is not [{n}, {rows}]");
    let rb = w.row_bytes();
    let parallel = rows * cols * n >= 1 << 15;
    if n == 1 {
        let body = |(t, chunk): (usize, &mut [f32])| {
            for (j, o) in chunk.iter_mut().enumerate() {
                let r = t * ROWS_PER_TASK + j;
                *o = dot_row(w.dtype, &w.data[r * rb..(r + 1) * rb], x);
            }
        };
        if parallel {
            out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(body);
        } else {
            out.chunks_mut(ROWS_PER_TASK).enumerate().for_each(body);
        }
        return;
    }
    // Several input rows: compute the transpose (weight row major) so each task owns
    // a contiguous block, then scatter.
    let mut t_out = vec![0f32; rows * n];
    let body = |(t, chunk): (usize, &mut [f32])| {
        for (j, per_row) in chunk.chunks_mut(n).enumerate() {
            let r = t * ROWS_PER_TASK + j;
            let wr = &w.data[r * rb..(r + 1) * rb];
            for (i, o) in per_row.iter_mut().enumerate() {
                *o = dot_row(w.dtype, wr, &x[i * cols..(i + 1) * cols]);
            }
        }
    };
    if parallel {
        t_out.par_chunks_mut(ROWS_PER_TASK * n).enumerate().for_each(body);
    } else {
        t_out.chunks_mut(ROWS_PER_TASK * n).enumerate().for_each(body);
    }
    for r in 0..rows {
        for i in 0..n {
            out[i * rows + r] = t_out[r * n + i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::DType;

    #[test]
    fn matches_naive() {
        let (rows, cols, n) = (37, 19, 3);
        let w: Vec<f32> = (0..rows * cols).map(|i| (i % 13) as f32 * 0.25 - 1.5).collect();
        let x: Vec<f32> = (0..n * cols).map(|i| (i % 7) as f32 * 0.5 - 1.0).collect();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let m = MatRef::new(DType::F32, rows, cols, &bytes).unwrap();
        let mut out = vec![0f32; n * rows];
        matmul(m, &x, n, &mut out);
        for i in 0..n {
            for r in 0..rows {
                let want: f32 = (0..cols).map(|c| w[r * cols + c] * x[i * cols + c]).sum();
                assert!((out[i * rows + r] - want).abs() < 1e-4);
            }
        }
        // One row at a time gives bitwise the same numbers as the batch.
        for i in 0..n {
            let mut one = vec![0f32; rows];
            matmul(m, &x[i * cols..(i + 1) * cols], 1, &mut one);
            assert_eq!(one, out[i * rows..(i + 1) * rows]);
        }
    }
}
