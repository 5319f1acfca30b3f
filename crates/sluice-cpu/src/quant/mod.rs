//! Matrix products on quantized weights, computed on the stored blocks.
//!
//! - `act.rs`: the activations, quantized once per matmul to 8 or 16 bits per
//!   32-element block, with the block sums each weight format folds in.
//! - `lanes.rs`: the vector operations, one weight row per lane (16 rows per tile on
//!   AVX-512), implemented in `x86.rs`, `neon.rs` and `scalar.rs`.
//! - `seg.rs`: rows read a cache line at a time and transposed into lanes.
//! - `blocks32.rs`, `kquants.rs`: each format's unpacking into unsigned 8-bit codes
//!   and per-row scales, and its arithmetic: integer dot products (`vpdpbusd`, the
//!   activation's four bytes broadcast), then an f32 fused multiply-add per output
//!   and block (32-element formats) or sub-block (K-quants).
//! - `kernel.rs`: the loops: up to eight tokens stream a tile straight through,
//!   each chunk unpacked once for all of them (decode, a few sequences' decode rows,
//!   an expert's rows); more share a panel unpacked once per tile (prefill), `GROUP`
//!   tokens per pass.
//! - `rows.rs`: decode for Q4_K and Q6_K on AVX-512, reading each weight row front
//!   to back and folding its integer sums into lanes afterwards, with the lane
//!   kernels' arithmetic.
//!
//! Every ISA computes the same integers and the same f32 operations in the same
//! order, lane by lane, so results are bitwise identical across ISAs, thread counts,
//! and decode versus prefill.

mod act;
mod blocks32;
mod kernel;
mod kquants;
mod lanes;
mod scalar;
mod seg;

#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod rows;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::cell::Cell;
use std::ops::Range;

use sluice_core::{DType, MatRef, Precision};

use crate::Product;
use crate::isa::{Isa, isa};
use crate::par::{OutPtr, for_each_part, tasks_for};
use act::{ActKind, QAct, Tok};
use kernel::{Kernel, Panel, direct};
use lanes::{Lanes, Tile};

/// How a weight format asks for its activations.
fn act_kind(dtype: DType) -> ActKind {
    match dtype {
        DType::Q8_0 => ActKind { off: 128, sums16: false },
        DType::Q4_0 => ActKind { off: 8, sums16: false },
        DType::Q5_0 => ActKind { off: 16, sums16: false },
        DType::MXFP4 => ActKind { off: 12, sums16: false },
        DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => ActKind { off: 0, sums16: false },
        DType::Q6K => ActKind { off: 0, sums16: true },
        other => panic!("{other} is not a quantized format"),
    }
}

/// What every task of one matmul shares.
struct Job<'a> {
    w: MatRef<'a>,
    act: &'a QAct,
    /// Input rows (tokens).
    n: usize,
    /// Bytes per activation element: 1 (8 bits) or 2 (16).
    parts: usize,
    out: OutPtr,
}

/// Computes the rows of `tiles` (tile `i` is rows `i * lanes..`) for every token.
type TilesFn = unsafe fn(&Job, Range<usize>);

/// Quantized products, each on its own input (inputs that are the same slice are
/// quantized once per kind of activations); see [`crate::matmul_grouped`].
pub(crate) fn matmul_grouped(products: &mut [&mut Product<'_>]) {
    // One quantization per input, kind of activations and precision.
    let mut acts: Vec<(ActKey, QAct)> = Vec::new();
    for p in products.iter() {
        let key = act_key(p);
        if !acts.iter().any(|(k, _)| *k == key) {
            acts.push((key, QAct::new(key.2, p.x, p.n, p.w.cols, key.3)));
        }
    }
    // Every product's tiles in one index space, so one split of the threads covers
    // all, cut where the tiles' cost is shared evenly.
    let mut parts_of = Vec::with_capacity(products.len());
    let (mut tiles, mut cost, mut weight) = (0, 0, 0);
    for p in products.iter_mut() {
        let key = act_key(p);
        let act = &acts.iter().find(|(k, _)| *k == key).expect("quantized above").1;
        let (lanes, f) = kernel_for(isa(), p.w.dtype);
        let count = p.w.rows.div_ceil(lanes);
        // A tile's time grows with its rows, from a start that the unpacking of its
        // weights costs (an expert's products, per row against one: about 1.4x at 2
        // rows, 1.8x at 4, 2.8x at 8).
        let per_tile = p.w.row_bytes() * lanes * (p.n + 3);
        let job = Job { w: p.w, act, n: p.n, parts: key.3, out: OutPtr::new(p.out, p.w.rows) };
        parts_of.push(Span { job, f, tiles: tiles..tiles + count, before: weight, per_tile });
        tiles += count;
        weight += count * per_tile;
        // Work is counted in units of "weight bytes times tokens", what time follows.
        cost += p.w.data.len() * p.n;
    }
    if tiles == 0 {
        return;
    }
    let tasks = tasks_for(tiles, cost);
    // The first tile of task `t`: where the cost before it reaches `t / tasks` of the whole.
    let bound = |t: usize| {
        if t == 0 {
            return 0;
        }
        if t == tasks {
            return tiles;
        }
        let target = weight * t / tasks;
        let s = parts_of.iter().rev().find(|s| s.before <= target).expect("the first product starts at 0");
        (s.tiles.start + (target - s.before).div_ceil(s.per_tile)).min(s.tiles.end)
    };
    for_each_part(tasks, &bound, |r| {
        for s in &parts_of {
            let (lo, hi) = (r.start.max(s.tiles.start), r.end.min(s.tiles.end));
            if lo < hi {
                unsafe { (s.f)(&s.job, lo - s.tiles.start..hi - s.tiles.start) };
            }
        }
    });
}

/// One product's place in a grouped call's index space.
struct Span<'a> {
    job: Job<'a>,
    f: TilesFn,
    tiles: Range<usize>,
    /// The cost of the tiles before these, and of each of these.
    before: usize,
    per_tile: usize,
}

/// An input as quantized: where it lies, its rows, the kind of activations and
/// bytes per element.
type ActKey = (*const f32, usize, ActKind, usize);

fn act_key(p: &Product<'_>) -> ActKey {
    (p.x.as_ptr(), p.n, act_kind(p.w.dtype), parts(p.precision))
}

/// Bytes per activation element: 1 (8 bits) or 2 (16).
fn parts(p: Precision) -> usize {
    match p {
        Precision::Fast => 1,
        Precision::Accurate => 2,
    }
}

/// The tile width and tile function for an ISA and format.
fn kernel_for(isa: Isa, dtype: DType) -> (usize, TilesFn) {
    macro_rules! pick {
        ($wrap:ident, $s:ty) => {
            match dtype {
                DType::Q8_0 => (<$s>::N, $wrap::<blocks32::Q8_0> as TilesFn),
                DType::Q4_0 => (<$s>::N, $wrap::<blocks32::Q4_0> as TilesFn),
                DType::Q4_1 => (<$s>::N, $wrap::<blocks32::Q4_1> as TilesFn),
                DType::Q5_0 => (<$s>::N, $wrap::<blocks32::Q5_0> as TilesFn),
                DType::Q5_1 => (<$s>::N, $wrap::<blocks32::Q5_1> as TilesFn),
                DType::MXFP4 => (<$s>::N, $wrap::<blocks32::Mxfp4> as TilesFn),
                DType::Q4K => (<$s>::N, $wrap::<kquants::Q4K> as TilesFn),
                DType::Q5K => (<$s>::N, $wrap::<kquants::Q5K> as TilesFn),
                DType::Q6K => (<$s>::N, $wrap::<kquants::Q6K> as TilesFn),
                other => panic!("{other} is not a quantized format"),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => match dtype {
            // One-token calls read each row front to back (`rows.rs`).
            DType::Q4K => (x86::Avx512::N, rows::tiles_q4k as TilesFn),
            DType::Q6K => (x86::Avx512::N, rows::tiles_q6k as TilesFn),
            _ => pick!(tiles_avx512, x86::Avx512),
        },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if crate::isa::avx2_vnni() => pick!(tiles_avx2_vnni, x86::Avx2<true>),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => pick!(tiles_avx2, x86::Avx2<false>),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => pick!(tiles_neon, neon::Neon),
        _ => pick!(tiles_scalar, scalar::Scalar),
    }
}

// One entry point per ISA, compiled with its features; everything below it is
// `#[inline(always)]` and so compiled with them too.

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tiles_avx512<K: Kernel<x86::Avx512>>(job: &Job, tiles: Range<usize>) {
    unsafe { run_tiles::<x86::Avx512, K>(job, tiles) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn tiles_avx2_vnni<K: Kernel<x86::Avx2<true>>>(job: &Job, tiles: Range<usize>) {
    unsafe { run_tiles::<x86::Avx2<true>, K>(job, tiles) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tiles_avx2<K: Kernel<x86::Avx2<false>>>(job: &Job, tiles: Range<usize>) {
    unsafe { run_tiles::<x86::Avx2<false>, K>(job, tiles) }
}

#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
unsafe fn tiles_neon<K: Kernel<neon::Neon>>(job: &Job, tiles: Range<usize>) {
    unsafe { run_tiles::<neon::Neon, K>(job, tiles) }
}

unsafe fn tiles_scalar<K: Kernel<scalar::Scalar>>(job: &Job, tiles: Range<usize>) {
    unsafe { run_tiles::<scalar::Scalar, K>(job, tiles) }
}

/// Tokens per pass over a panel: as many accumulators as the registers hold.
const GROUP: usize = 8;

/// The tiles of a job on any ISA and format, through the lane kernels.
#[inline(always)]
unsafe fn run_tiles<S: Lanes, K: Kernel<S>>(job: &Job, tiles: Range<usize>) {
    unsafe {
        if job.parts == 2 { run_tiles_as::<S, K, true>(job, tiles) } else { run_tiles_as::<S, K, false>(job, tiles) }
    }
}

/// [`run_tiles`] for 16-bit activations (`TWO`) or 8-bit ones.
#[inline(always)]
unsafe fn run_tiles_as<S: Lanes, K: Kernel<S>, const TWO: bool>(job: &Job, tiles: Range<usize>) {
    let w = job.w;
    let rb = w.row_bytes();
    let units = w.cols / K::UNIT_ELEMS;
    let rows = w.rows;

    unsafe {
        // One input row (decode): straight from the weights, its activation looked up
        // once rather than per tile (Gemma 3's output head is 32768 tiles of 640
        // columns; through the loop below its decode measured about 4% slower).
        if job.n == 1 {
            let toks = [job.act.tok(0)];
            for i in tiles {
                let t = Tile::new(w.data, rb, rows, i * S::N, S::N);
                direct::<S, K, 1, TWO>(&t, units, &toks, [job.out.at(0, i * S::N)]);
            }
            return;
        }
        // A few input rows: straight from the weights, each chunk unpacked once for
        // all of them, no panel. A pass costs about the same whether its last slots
        // carry tokens or not (the unpacking is shared), so 3 rows take a pass of 4
        // and 6 or 7 one of 8 rather than 2 + 1 or 4 + 2 (+ 1): an expert gets any
        // number of rows (Qwen3-30B-A3B's expert products, 2 threads: 3 rows 198 ->
        // 153 us, what 4 rows take).
        if job.n <= DIRECT_MAX {
            for i in tiles {
                let t = Tile::new(w.data, rb, rows, i * S::N, S::N);
                let mut c = 0;
                while c < job.n {
                    let left = job.n - c;
                    c += if S::DIRECT_GROUP >= 8 && left >= 6 {
                        direct_group::<S, K, 8, TWO>(&t, units, job, c, left.min(8), i)
                    } else if left >= 3 {
                        direct_group::<S, K, 4, TWO>(&t, units, job, c, left.min(4), i)
                    } else if left == 2 {
                        direct_group::<S, K, 2, TWO>(&t, units, job, c, 2, i)
                    } else {
                        direct_group::<S, K, 1, TWO>(&t, units, job, c, 1, i)
                    };
                }
            }
            return;
        }
        // Not a closure: closures do not inherit this function's target features.
        let scratch = Scratch::take(Panel::<S, K>::bytes(units));
        for i in tiles {
            let t = Tile::new(w.data, rb, rows, i * S::N, S::N);
            let panel = Panel::<S, K>::build(&t, units, scratch.ptr());
            let mut c = 0;
            while c < job.n {
                let left = job.n - c;
                // Largest group that fits, so any n is covered without dummy tokens.
                c += if left >= GROUP {
                    group::<S, K, GROUP, TWO>(&panel, job, c, i, t.valid)
                } else if left >= 4 {
                    group::<S, K, 4, TWO>(&panel, job, c, i, t.valid)
                } else if left >= 2 {
                    group::<S, K, 2, TWO>(&panel, job, c, i, t.valid)
                } else {
                    group::<S, K, 1, TWO>(&panel, job, c, i, t.valid)
                };
            }
        }
    }
}

/// Batches of at most this many rows (decode steps of a few sequences, the rows an
/// expert gets) take the decode path, each chunk unpacked once for every
/// [`Lanes::DIRECT_GROUP`] of them; more share a panel. Measured on AVX2 (4096 x 4096, 2 threads, per row against panels):
/// Q4_K 0.72x at 2 rows, 0.80x at 4, 0.90x at 8; Q6_K 0.69x, 0.70x, 0.71x (8-bit
/// activations; 0.76-1.0x with 16-bit); Q8_0 and Q4_1 0.9-1.0x.
const DIRECT_MAX: usize = 8;

/// Tokens `c0..c0 + real` straight against tile `i` in a pass of `C` (`real <= C`):
/// the slots past `real` repeat the last token into a spare output (each token's
/// arithmetic is its own, so the real ones' results do not change). Returns `real`.
#[inline(always)]
unsafe fn direct_group<S: Lanes, K: Kernel<S>, const C: usize, const TWO: bool>(
    t: &Tile,
    units: usize,
    job: &Job,
    c0: usize,
    real: usize,
    i: usize,
) -> usize {
    debug_assert!((1..=C).contains(&real) && S::N <= SPARE);
    let mut spare = [0f32; SPARE];
    let toks: [Tok; C] = std::array::from_fn(|c| job.act.tok(c0 + c.min(real - 1)));
    let outs = std::array::from_fn(|c| if c < real { job.out.at(c0 + c, i * S::N) } else { spare.as_mut_ptr() });
    unsafe { direct::<S, K, C, TWO>(t, units, &toks, outs) };
    real
}

/// Room for one tile's outputs (the widest lanes: sixteen rows on AVX-512).
const SPARE: usize = 16;

/// Tokens `c0..c0 + C` against tile `i`'s panel; returns `C`.
#[inline(always)]
unsafe fn group<S: Lanes, K: Kernel<S>, const C: usize, const TWO: bool>(
    panel: &Panel<S, K>,
    job: &Job,
    c0: usize,
    i: usize,
    valid: usize,
) -> usize {
    let toks: [Tok; C] = std::array::from_fn(|c| job.act.tok(c0 + c));
    let outs = std::array::from_fn(|c| job.out.at(c0 + c, i * S::N));
    unsafe { panel.group::<C, TWO>(&toks, outs, valid) };
    C
}

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

thread_local! {
    /// Per-thread panel memory, reused across calls (a panel is tens to hundreds of KiB).
    static SCRATCH: Cell<Vec<Line>> = const { Cell::new(Vec::new()) };
}

/// This thread's scratch memory, taken out of the thread-local while in use (so a
/// nested call gets its own) and put back on drop.
struct Scratch(Vec<Line>);

impl Scratch {
    fn take(bytes: usize) -> Scratch {
        let mut buf = SCRATCH.take();
        let lines = bytes.div_ceil(64);
        if buf.len() < lines {
            buf = vec![Line([0; 64]); lines];
        }
        Scratch(buf)
    }

    fn ptr(&self) -> *mut u8 {
        self.0.as_ptr() as *mut u8
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        SCRATCH.set(std::mem::take(&mut self.0));
    }
}

/// Dot product of one quantized row with `x`, through the same kernels as
/// [`crate::matmul`] with [`Precision::Fast`] (bitwise equal to its output for that row).
pub(crate) fn dot_row(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    let w = MatRef::new(dtype, 1, x.len(), row).expect("dot_row: row is not x.len() elements");
    let mut out = [0f32];
    matmul_grouped(&mut [&mut Product { w, x, n: 1, out: &mut out, precision: Precision::Fast }]);
    out[0]
}
