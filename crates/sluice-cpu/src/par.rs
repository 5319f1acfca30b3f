//! Splitting a matmul over threads.
//!
//! Work is a range of independent items (row tiles) split into a few contiguous
//! ranges, one per thread: an output is always computed whole by one task, so the
//! split never changes a value. Small calls stay on the calling thread, because
//! handing work to another thread costs microseconds and a small model's decode
//! makes hundreds of matmul calls per token.

use std::ops::Range;

/// Below this much work (weight bytes times tokens) per extra task, splitting costs
/// more than it saves.
const MIN_COST_PER_TASK: usize = 48 << 10;

/// Calls `f` on contiguous ranges covering `0..items`, in parallel when `cost` is
/// large enough to pay for it.
pub(crate) fn for_each_range(items: usize, cost: usize, f: impl Fn(Range<usize>) + Sync) {
    let tasks = tasks_for(items, cost);
    for_each_part(tasks, &|t| t * items / tasks, f);
}

/// How many tasks `items` items of `cost` in all are worth.
pub(crate) fn tasks_for(items: usize, cost: usize) -> usize {
    rayon::current_num_threads().min(items).min(cost / MIN_COST_PER_TASK).max(1)
}

/// Calls `f` on `bound(t)..bound(t + 1)` for every task `t < tasks`, in parallel.
pub(crate) fn for_each_part(tasks: usize, bound: &(impl Fn(usize) -> usize + Sync), f: impl Fn(Range<usize>) + Sync) {
    if tasks == 1 {
        f(bound(0)..bound(1));
    } else {
        split(0, tasks, bound, &f);
    }
}

/// Runs tasks `lo..hi` by halving with `rayon::join`, the cheapest way to start a
/// handful of tasks.
fn split(lo: usize, hi: usize, bound: &(impl Fn(usize) -> usize + Sync), f: &(impl Fn(Range<usize>) + Sync)) {
    if hi - lo == 1 {
        f(bound(lo)..bound(lo + 1));
    } else {
        let mid = (lo + hi) / 2;
        rayon::join(|| split(lo, mid, bound, f), || split(mid, hi, bound, f));
    }
}

/// The output of a matmul, `[n, rows]` row-major, shared by tasks that write
/// disjoint rows of it.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr {
    ptr: *mut f32,
    rows: usize,
}

// Tasks write disjoint elements (each output row range belongs to one task).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub fn new(out: &mut [f32], rows: usize) -> OutPtr {
        OutPtr { ptr: out.as_mut_ptr(), rows }
    }

    /// Where output `row` of token `tok` goes.
    pub fn at(self, tok: usize, row: usize) -> *mut f32 {
        debug_assert!(row <= self.rows);
        unsafe { self.ptr.add(tok * self.rows + row) }
    }
}
