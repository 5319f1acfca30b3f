//! The shape every quantized kernel shares, and the loops that drive it over a tile.
//!
//! A weight row is a sequence of units (a 32-element block or a 256-element
//! super-block). For a tile of `S::N` rows, a format says how to unpack a unit's
//! per-row scales (`head`) and its weights, 32 elements at a time (`chunk`: eight
//! vectors of four unsigned codes per lane), and how one token's quantized
//! activations combine with them: a state started by `start` from the running f32
//! result, advanced by `step` for each chunk (integer dot products, and for
//! K-quants an f32 update per sub-block), and turned back into the running result
//! by `finish`. `step` is compiled twice, for 8-bit activations and for 16-bit ones
//! (`TWO`, two bytes per element, see `act.rs`), which [`dot4`] joins into one sum.
//!
//! The f32 result of an output depends only on the sequence of those calls, unit by
//! unit and chunk by chunk in order, which is the same whether a tile is computed straight from the
//! weights (decode, [`direct`]) or from a panel unpacked once and reused for many
//! tokens (prefill, [`Panel::build`] then [`Panel::group`]). So decode and prefill agree bit for
//! bit, and so do all thread counts (a tile is always computed whole by one thread).

use super::act::Tok;
use super::lanes::{Lanes, Tile, word};
use super::seg::{Seg, SegBuf, units_per_segment};

pub(crate) type Chunk<S> = [<S as Lanes>::I; 8];

/// Runs `$body` for `c` in `0..$n` (at most 8), written out with each `c` a constant,
/// so the per-token states indexed by `c` stay in registers. (LLVM would not unroll
/// the loop, and the states then made a round trip through memory at every step.)
macro_rules! each_token {
    ($n:expr, |$c:ident| $body:expr) => {{
        each_token!(@one $n, $c, $body, 0);
        each_token!(@one $n, $c, $body, 1);
        each_token!(@one $n, $c, $body, 2);
        each_token!(@one $n, $c, $body, 3);
        each_token!(@one $n, $c, $body, 4);
        each_token!(@one $n, $c, $body, 5);
        each_token!(@one $n, $c, $body, 6);
        each_token!(@one $n, $c, $body, 7);
    }};
    (@one $n:expr, $c:ident, $body:expr, $k:literal) => {
        if $k < $n {
            let $c = $k;
            $body;
        }
    };
}

pub(crate) trait Kernel<S: Lanes> {
    /// 32-element chunks per unit.
    const CHUNKS: usize;
    /// Bytes and elements per unit.
    const UNIT_BYTES: usize;
    const UNIT_ELEMS: usize;
    type Head: Copy;
    /// The per-token state within a unit (integer sums, and the running f32 result).
    type Acc: Copy;

    /// The unit at byte `off` of the segment: its per-row scales.
    unsafe fn head(src: &Seg<S>, off: usize) -> Self::Head;
    /// Chunk `c` of the unit at byte `off`: lane `i` of `[k]` holds row `i`'s codes
    /// for four elements; which ones is the format's business, matched by `step`.
    unsafe fn chunk(src: &Seg<S>, off: usize, c: usize, h: &Self::Head) -> Chunk<S>;
    /// The state for unit `u` of token `a`, given the running result `f`.
    unsafe fn start(h: &Self::Head, a: &Tok, u: usize, f: S::F) -> Self::Acc;
    /// Chunk `c` of unit `u` against token `a`, whose activations have 16 bits if `TWO`.
    unsafe fn step<const TWO: bool>(
        w: &Chunk<S>,
        h: &Self::Head,
        a: &Tok,
        u: usize,
        c: usize,
        acc: Self::Acc,
    ) -> Self::Acc;
    /// The running result with unit `u` added.
    unsafe fn finish(h: &Self::Head, a: &Tok, u: usize, acc: Self::Acc) -> S::F;
}

/// `acc` plus the dot product of four words of codes with activation elements
/// `e..e + 16` of `a` (word `k` with elements `e + 4k..`); `MAX` is the largest code
/// (see [`Lanes::dpbusd4`]). With 16-bit activations (`TWO`) both bytes meet the same
/// codes and are joined exactly, `acc + (w·hi << 8) + w·lo`.
#[inline(always)]
pub(crate) unsafe fn dot4<S: Lanes, const TWO: bool, const MAX: u32>(
    acc: S::I,
    w: [S::I; 4],
    a: &Tok,
    e: usize,
) -> S::I {
    unsafe {
        if TWO {
            let t = S::dpbusd4::<MAX>(S::splat(0), w, words(a.xq, e));
            S::dpbusd4::<MAX>(S::add(acc, S::slli::<8>(t)), w, words(a.lo, e))
        } else {
            S::dpbusd4::<MAX>(acc, w, words(a.xq, e))
        }
    }
}

/// Activation bytes `e..e + 16` at `p` as four words, word `k` from `e + 4k`.
#[inline(always)]
pub(crate) unsafe fn words(p: *const i8, e: usize) -> [u32; 4] {
    unsafe { std::array::from_fn(|k| word(p.add(e + 4 * k))) }
}

/// Unit `u` of a tile against `C` tokens, adding to their running results `f`;
/// `chunk(c)` gives its chunk `c`.
///
/// Chunks are taken two at a time, each token stepping through both before the
/// next token starts: a token's state between two chunks (a K-quant's four integer
/// sums of a sub-block pair) then lives only while that token is stepped, instead of
/// eight tokens' states at once, which did not fit in the registers (measured: the
/// states spilled to the stack at every chunk). Every token sees the same calls in
/// the same order either way, so the results are the same bits. Callers mark the
/// `chunk` closure `#[inline(always)]`: left to itself LLVM called it, and a chunk
/// then went through memory (2 to 8 rows ran five times slower).
#[inline(always)]
unsafe fn unit<S: Lanes, K: Kernel<S>, const C: usize, const TWO: bool>(
    chunk: impl Fn(usize) -> Chunk<S>,
    h: &K::Head,
    toks: &[Tok; C],
    u: usize,
    f: &mut [S::F; C],
) {
    unsafe {
        let mut acc = [K::start(h, &toks[0], u, f[0]); C];
        each_token!(C, |c| acc[c] = K::start(h, &toks[c], u, f[c]));
        if K::CHUNKS % 2 == 0 {
            for ch in (0..K::CHUNKS).step_by(2) {
                let (w0, w1) = (chunk(ch), chunk(ch + 1));
                each_token!(C, |c| {
                    acc[c] = K::step::<TWO>(&w0, h, &toks[c], u, ch, acc[c]);
                    acc[c] = K::step::<TWO>(&w1, h, &toks[c], u, ch + 1, acc[c]);
                });
            }
        } else {
            for ch in 0..K::CHUNKS {
                let w = chunk(ch);
                each_token!(C, |c| acc[c] = K::step::<TWO>(&w, h, &toks[c], u, ch, acc[c]));
            }
        }
        each_token!(C, |c| f[c] = K::finish(h, &toks[c], u, acc[c]));
    }
}

/// How far past the window being transposed each row is prefetched (on Zen 5, 256
/// bytes measured best of 256 to 4096).
const PREFETCH_AHEAD: usize = 256;

/// `C` tokens against a tile, unpacking as it goes: the decode path.
///
/// Software-pipelined: while segment `s` is computed (vpdpbusd and FMA work), segment
/// `s + 1` is transposed into the other buffer a window or two per unit (loads and
/// shuffles, other execution ports), so memory reads, shuffles and arithmetic overlap
/// instead of taking turns. Each window transposed also prefetches the rows a little
/// further on: with arithmetic between the loads, the hardware prefetchers alone do
/// not run far enough ahead (measured on Zen 5: 2-thread decode from DRAM went from
/// about 60% to 75-80% of the read bandwidth).
#[inline(always)]
pub(crate) unsafe fn direct<S: Lanes, K: Kernel<S>, const C: usize, const TWO: bool>(
    t: &Tile,
    units: usize,
    toks: &[Tok; C],
    outs: [*mut f32; C],
) {
    unsafe {
        let ub = K::UNIT_BYTES;
        let per = units_per_segment::<S>(ub);
        let mut bufs = [SegBuf::new(), SegBuf::new()];
        let mut f = [S::zero_f(); C];
        let seg_len = |u0: usize| per.min(units.saturating_sub(u0)) * ub;
        // Fetch the next tile (the rows after this one) into L2, window by window
        // as it will be read, spread over this tile's units: a tile starts sixteen
        // streams from cold, and small ones are over before the hardware
        // prefetchers warm up (measured on Zen 5: 4096 x 4096 decode from DRAM +45%
        // on one thread; a 135M model's matmuls +50%).
        let next_lines = S::N * t.bytes.div_ceil(64);
        let (mut ndone, mut nacc) = (0, 0);
        Seg::<S>::fill(t, 0, seg_len(0), &mut bufs[0]);
        let mut u0 = 0;
        let mut cur = 0;
        while u0 < units {
            let n = per.min(units - u0);
            let seg = Seg::<S>::view(&bufs[cur]);
            let next_start = (u0 + n) * ub;
            let next_windows = if u0 + n < units { Seg::<S>::windows(seg_len(u0 + n)) } else { 0 };
            // Spread the next segment's windows over this segment's units (a counter
            // instead of divisions).
            let (mut wdone, mut wacc) = (0, 0);
            for k in 0..n {
                wacc += next_windows;
                while wacc >= n {
                    for i in 0..S::N {
                        S::prefetch(t.row(i).wrapping_add(next_start + wdone * S::WIN + PREFETCH_AHEAD));
                    }
                    Seg::<S>::fill_window(t, next_start, wdone, &mut bufs[1 - cur]);
                    wdone += 1;
                    wacc -= n;
                }
                let (u, off) = (u0 + k, k * ub);
                nacc += next_lines;
                while nacc >= units {
                    let (row, line) = (S::N + ndone % S::N, ndone / S::N);
                    S::prefetch_l2(t.base.wrapping_add(row * t.bytes + 64 * line));
                    ndone += 1;
                    nacc -= units;
                }
                let h = K::head(&seg, off);
                unit::<S, K, C, TWO>(
                    #[inline(always)]
                    |ch| K::chunk(&seg, off, ch, &h),
                    &h,
                    toks,
                    u,
                    &mut f,
                );
            }
            debug_assert_eq!(wdone, next_windows);
            u0 += n;
            cur = 1 - cur;
        }
        for c in 0..C {
            S::store(f[c], outs[c], t.valid);
        }
    }
}

/// A tile unpacked once for many tokens: `units` heads, then `units * CHUNKS` chunks.
pub(crate) struct Panel<S: Lanes, K: Kernel<S>> {
    heads: *mut K::Head,
    chunks: *mut Chunk<S>,
    units: usize,
}

impl<S: Lanes, K: Kernel<S>> Panel<S, K> {
    /// Bytes of scratch a panel of `units` needs (each part 64-byte aligned).
    pub fn bytes(units: usize) -> usize {
        round64(units * size_of::<K::Head>()) + units * K::CHUNKS * size_of::<Chunk<S>>()
    }

    /// Unpacks `t` into `scratch` (at least [`Panel::bytes`], 64-byte aligned).
    #[inline(always)]
    pub unsafe fn build(t: &Tile, units: usize, scratch: *mut u8) -> Self {
        unsafe {
            let heads = scratch as *mut K::Head;
            let chunks = scratch.add(round64(units * size_of::<K::Head>())) as *mut Chunk<S>;
            let per = units_per_segment::<S>(K::UNIT_BYTES);
            let mut buf = SegBuf::new();
            let mut u0 = 0;
            while u0 < units {
                let n = per.min(units - u0);
                let seg = Seg::<S>::fill(t, u0 * K::UNIT_BYTES, n * K::UNIT_BYTES, &mut buf);
                for k in 0..n {
                    let (u, off) = (u0 + k, k * K::UNIT_BYTES);
                    let h = K::head(&seg, off);
                    heads.add(u).write(h);
                    for c in 0..K::CHUNKS {
                        chunks.add(u * K::CHUNKS + c).write(K::chunk(&seg, off, c, &h));
                    }
                }
                u0 += n;
            }
            Panel { heads, chunks, units }
        }
    }

    /// `C` tokens (at most 8) against the panel, each output stored to
    /// `outs[c][0..valid]`.
    #[inline(always)]
    pub unsafe fn group<const C: usize, const TWO: bool>(&self, toks: &[Tok; C], outs: [*mut f32; C], valid: usize) {
        unsafe {
            let mut f = [S::zero_f(); C];
            for u in 0..self.units {
                let h = &*self.heads.add(u);
                unit::<S, K, C, TWO>(
                    #[inline(always)]
                    |ch| *self.chunks.add(u * K::CHUNKS + ch),
                    h,
                    toks,
                    u,
                    &mut f,
                );
            }
            for c in 0..C {
                S::store(f[c], outs[c], valid);
            }
        }
    }
}

fn round64(b: usize) -> usize {
    b.div_ceil(64) * 64
}
