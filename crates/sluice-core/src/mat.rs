//! A borrowed view of a row-major matrix in any stored format.

use crate::DType;

/// `rows` rows of `cols` elements, each row a whole number of `dtype` blocks,
/// stored back to back in `data`. This is the layout of a Hugging Face `Linear`
/// weight (`[out, in]`) and of a GGUF 2-D tensor (`ne0 = in`), so both are computed
/// on where they lie.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> MatRef<'a> {
    /// Checks that `data` holds exactly `rows` x `cols` elements of `dtype`.
    pub fn new(dtype: DType, rows: usize, cols: usize, data: &'a [u8]) -> Option<Self> {
        let row_bytes = dtype.bytes_for(cols)?;
        (row_bytes.checked_mul(rows)? == data.len()).then_some(MatRef { dtype, rows, cols, data })
    }

    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Rows `start..start + n` as a matrix of their own.
    pub fn rows_range(&self, start: usize, n: usize) -> MatRef<'a> {
        let rb = self.row_bytes();
        MatRef { dtype: self.dtype, rows: n, cols: self.cols, data: &self.data[start * rb..(start + n) * rb] }
    }
}

/// How finely activations are quantized where they meet quantized weights (f32,
/// f16 and bf16 weights always take f32 activations).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// 8 bits per element, one scale per 32 (what llama.cpp does): the fastest.
    #[default]
    Fast,
    /// 16 bits per element, one scale per 32: logits within a few thousandths of f32
    /// arithmetic on the same weights. Twice the integer multiplies: a decode step
    /// (mostly reading and unpacking weights) measured within 2% of `Fast` on 2
    /// cores, a prefill (bound by arithmetic) 6-24% slower.
    Accurate,
}
