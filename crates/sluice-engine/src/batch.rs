//! A step's rows: which sequence each belongs to, at what position, and at what
//! activation precision.
//!
//! A step runs the new tokens of several sequences as one batch of rows, one
//! sequence's rows after another's. Every row has its own position (RoPE, the causal
//! mask, a ring window) and reads only its own sequence's state.

use std::sync::Arc;

use sluice_core::Precision;

/// The activation precision of each row of a step (see [`crate::Model::precision`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowPrecision {
    /// Every row alike.
    All(Precision),
    /// Row `i` at `[i]`.
    PerRow(Arc<[Precision]>),
}

impl Default for RowPrecision {
    fn default() -> Self {
        RowPrecision::All(Precision::default())
    }
}

impl RowPrecision {
    /// From one precision per row; `All` when they agree.
    pub fn from_rows(rows: Vec<Precision>) -> RowPrecision {
        match rows.first() {
            Some(&p) if rows.iter().all(|&q| q == p) => RowPrecision::All(p),
            None => RowPrecision::default(),
            Some(_) => RowPrecision::PerRow(rows.into()),
        }
    }

    pub fn of(&self, row: usize) -> Precision {
        match self {
            RowPrecision::All(p) => *p,
            RowPrecision::PerRow(v) => v[row],
        }
    }

    /// The one precision of every row, if they agree.
    pub fn uniform(&self) -> Option<Precision> {
        match self {
            RowPrecision::All(p) => Some(*p),
            RowPrecision::PerRow(_) => None,
        }
    }

    /// The precisions of rows `rows`, in that order (the rows gathered for an expert).
    pub fn gather(&self, rows: impl Iterator<Item = usize>) -> RowPrecision {
        match self {
            RowPrecision::All(p) => RowPrecision::All(*p),
            RowPrecision::PerRow(v) => RowPrecision::from_rows(rows.map(|r| v[r]).collect()),
        }
    }
}

/// One sequence's rows in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqRows {
    /// Its first row in the step.
    pub first: usize,
    pub rows: usize,
    /// The position of its first row: how many positions it held before the step.
    pub start: usize,
}

/// The rows of one forward pass.
#[derive(Clone, Debug)]
pub struct Batch {
    /// The sequences, in row order.
    pub seqs: Vec<SeqRows>,
    /// Each row's position in its sequence.
    pub positions: Vec<usize>,
    /// Each row's sequence (an index into `seqs`).
    pub row_seq: Vec<usize>,
    pub precision: RowPrecision,
}

impl Batch {
    /// `parts` gives each sequence's positions held so far, its new rows, and their
    /// precision.
    pub fn new(parts: &[(usize, usize, Precision)]) -> Batch {
        let (mut seqs, mut positions, mut row_seq, mut prec) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (si, &(start, rows, p)) in parts.iter().enumerate() {
            seqs.push(SeqRows { first: positions.len(), rows, start });
            positions.extend(start..start + rows);
            row_seq.extend(std::iter::repeat_n(si, rows));
            prec.extend(std::iter::repeat_n(p, rows));
        }
        Batch { seqs, positions, row_seq, precision: RowPrecision::from_rows(prec) }
    }

    pub fn rows(&self) -> usize {
        self.positions.len()
    }

    /// Each sequence's last row.
    pub fn last_rows(&self) -> Vec<usize> {
        self.seqs.iter().map(|s| s.first + s.rows - 1).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_follow_the_sequences() {
        let b = Batch::new(&[(5, 2, Precision::Fast), (0, 1, Precision::Accurate), (3, 3, Precision::Fast)]);
        assert_eq!(b.positions, [5, 6, 0, 3, 4, 5]);
        assert_eq!(b.row_seq, [0, 0, 1, 2, 2, 2]);
        assert_eq!(b.seqs[2], SeqRows { first: 3, rows: 3, start: 3 });
        assert_eq!(b.last_rows(), [1, 2, 5]);
        assert_eq!(b.precision.of(2), Precision::Accurate);
        assert_eq!(b.precision.gather([0, 3].into_iter()), RowPrecision::All(Precision::Fast));
        assert_eq!(Batch::new(&[(0, 4, Precision::Accurate)]).precision, RowPrecision::All(Precision::Accurate));
    }
}
