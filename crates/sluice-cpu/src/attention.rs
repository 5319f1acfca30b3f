//! Causal attention over a KV cache plus the keys and values of the current chunk.
//!
//! The cache holds the positions before the chunk; the chunk's own keys and values
//! are passed alongside and appended only after every layer has run. That lets a
//! sliding layer's ring hold just `window` entries even while a prefill chunk is
//! longer than the window, and lets KV-sharing layers read the producer's chunk.

use rayon::prelude::*;
use sluice_core::ExactRows;

use crate::dot::dot_f32;
pub use crate::kv::KvCache;
use crate::ops::{exp_fast, softcap};
use crate::tile::{self, Lanes};

#[derive(Clone, Copy, Debug)]
pub struct AttnParams<'a> {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Sliding window: a query sees itself and the `window - 1` positions before it.
    pub window: Option<usize>,
    pub softcap: Option<f32>,
    /// One logit per query head that joins the softmax and takes its share of the
    /// weight without a value (gpt-oss's attention sinks).
    pub sinks: Option<&'a [f32]>,
    /// Per row of `q`, the positions it attends to (ascending), in place of every
    /// position up to its own (Qwen4-Exp's QSA).
    pub select: Option<&'a [Vec<u32>]>,
}

/// One sequence's share of a batched attention call: rows `first..first + rows` of
/// `q`, `k_new` and `v_new` are its positions `cache.len()..`, and `cache` holds the
/// positions before them.
#[derive(Clone, Copy, Debug)]
pub struct AttnSeq<'a> {
    pub first: usize,
    pub rows: usize,
    pub cache: &'a KvCache,
}

/// Causal attention for a batch of sequences, each over its own cache and its own
/// new rows. `q` is `[n, n_heads * head_dim]`, `k_new` and `v_new` `[n, kv_dim]`,
/// the sequences' rows one after another as `seqs` says; writes `out`, shaped like
/// `q`.
///
/// One task takes a block of one sequence's rows and some of the query heads that share
/// a KV head, and walks the positions in tiles of [`TILE`] (aligned to multiples of
/// [`TILE`]), each tile's keys and values read (or decoded) once for every query of the
/// task, with an online softmax. Each query sums its own tiles in the same order
/// whatever else the task holds, so a row's result does not depend on the rows it is
/// computed with, the chunk it came in, the other sequences of the batch or the thread
/// count.
pub fn attention(p: &AttnParams<'_>, q: &[f32], k_new: &[f32], v_new: &[f32], seqs: &[AttnSeq<'_>], out: &mut [f32]) {
    let hd = p.head_dim;
    let q_dim = p.n_heads * hd;
    let n = q.len() / q_dim;
    let mut covered = 0;
    for s in seqs {
        assert_eq!(s.first, covered, "attention: sequences must cover the rows in order");
        covered += s.rows;
    }
    assert_eq!(covered, n, "attention: the sequences cover {covered} rows of {n}");
    let group = p.n_heads / p.n_kv_heads;
    let total: usize = seqs.iter().map(|s| s.rows * p.n_heads * (s.cache.len() + s.rows) * hd).sum();
    let parallel = total >= 1 << 14;
    // Query heads per task: a KV head's whole group shares each tile, but one decode
    // row then has as few tasks as KV heads (one on Gemma 3), so the group is split
    // until every thread has a task, and no further, since each task reads the tiles of
    // its KV head (Qwen2.5's decode row, two KV heads on two threads: split in four, every
    // tile was read twice; decode after 4096 positions 2% slower in 16 bits, more coded).
    let threads = if parallel { rayon::current_num_threads() } else { 1 };
    let blocks: usize = seqs.iter().map(|s| s.rows.div_ceil(ROWS)).sum();
    let heads =
        (1..=group).rev().find(|&d| group.is_multiple_of(d) && blocks * (p.n_heads / d) >= threads).unwrap_or(1);
    // A coded cache's sequences code their new rows in the same format first, so that
    // a chunk reads its own keys and values as every later step will (a prompt gives the
    // same result however it is cut into chunks).
    let kd = p.n_kv_heads * hd;
    let coded: Vec<KvCache> = seqs
        .iter()
        .filter(|s| s.cache.codec().is_some())
        .map(|s| {
            let mut c = s.cache.empty_like();
            c.append(&k_new[s.first * kd..(s.first + s.rows) * kd], &v_new[s.first * kd..(s.first + s.rows) * kd]);
            c
        })
        .collect();
    assert!(coded.is_empty() || coded.len() == seqs.len(), "attention: one call's caches share their format");
    let mut tasks = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for r0 in (0..s.rows).step_by(ROWS) {
            for h0 in (0..p.n_heads).step_by(heads) {
                tasks.push(Task { seq: si, rows: r0..(r0 + ROWS).min(s.rows), h0 });
            }
        }
    }
    let job = Job { p, q, k_new, v_new, seqs, coded: &coded, heads };
    let results: Vec<Vec<f32>> = if parallel {
        tasks.par_iter().map(|t| job.run(t)).collect()
    } else {
        tasks.iter().map(|t| job.run(t)).collect()
    };
    for (t, r) in tasks.iter().zip(results) {
        for (i, row) in t.rows.clone().enumerate() {
            let at = (seqs[t.seq].first + row) * q_dim + t.h0 * hd;
            out[at..at + heads * hd].copy_from_slice(&r[i * heads * hd..(i + 1) * heads * hd]);
        }
    }
}

/// Positions per tile: a tile's keys and values (f32) stay in the first-level cache, and
/// a coded cache keeps each head's rows of a tile together.
const TILE: usize = crate::kv::BLOCK;
/// Rows per task: each tile is read once for this many rows' queries.
const ROWS: usize = 16;

/// Rows `rows` (of the sequence's new rows) of sequence `seq`, query heads `h0..`.
struct Task {
    seq: usize,
    rows: std::ops::Range<usize>,
    h0: usize,
}

/// What every task of one attention call reads.
struct Job<'a> {
    p: &'a AttnParams<'a>,
    q: &'a [f32],
    k_new: &'a [f32],
    v_new: &'a [f32],
    seqs: &'a [AttnSeq<'a>],
    /// Per sequence, its new rows coded as its cache codes them (none for f32 caches).
    coded: &'a [KvCache],
    /// Query heads per task, all of one KV head's group.
    heads: usize,
}

/// A task's queries' running softmax: per query the largest score so far, the sum of
/// the weights relative to it, and the weighted sum of values (`head_dim` apart).
struct Online {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
    head_dim: usize,
}

impl Online {
    fn new(queries: usize, head_dim: usize) -> Online {
        Online {
            max: vec![f32::NEG_INFINITY; queries],
            sum: vec![0.0; queries],
            acc: vec![0.0; queries * head_dim],
            head_dim,
        }
    }

    /// Folds a tile into the softmax: `w` holds each query's scaled scores over the
    /// tile's `len` positions (`[len][queries]`), and query `i` reads positions
    /// `spans[i]`. Each query's sums are rescaled to its new maximum, and its weights
    /// replace its scores (zero where it reads nothing), ready for [`tile::values`].
    /// A query's bits depend only on the scores it reads: the maximum is exact, and
    /// the sum adds the weights in order of position (and zeros, which change nothing).
    fn fold(&mut self, w: &mut [f32], len: usize, spans: &[std::ops::Range<usize>]) {
        tile::fold(w, len, spans, (&mut self.max, &mut self.sum), (&mut self.acc, self.head_dim));
    }

    /// The first `out.len() / head_dim` queries' results, each sum of values over its
    /// weights (and the weight of its sink logit, if `sink` gives one).
    fn finish(&self, out: &mut [f32], sink: impl Fn(usize) -> Option<f32>) {
        for (q, o) in out.chunks_mut(self.head_dim).enumerate() {
            let sum = self.sum[q] + sink(q).map_or(0.0, |s| exp_fast(s - self.max[q]));
            let inv = 1.0 / sum;
            for (o, a) in o.iter_mut().zip(&self.acc[q * self.head_dim..]) {
                *o = a * inv;
            }
        }
    }
}

impl Job<'_> {
    /// The task's rows and heads, `[rows, heads, head_dim]`.
    fn run(&self, t: &Task) -> Vec<f32> {
        let p = self.p;
        let hd = p.head_dim;
        let q_dim = p.n_heads * hd;
        let kvh = t.h0 / (p.n_heads / p.n_kv_heads);
        let s = &self.seqs[t.seq];
        let (cache, start) = (s.cache, s.cache.len());
        let codec = cache.codec();
        // The queries, row-major then head; rotated into a TurboQuant cache's basis.
        let mut qs = Vec::with_capacity(t.rows.len() * self.heads * hd);
        for row in t.rows.clone() {
            let at = (s.first + row) * q_dim + t.h0 * hd;
            qs.extend_from_slice(&self.q[at..at + self.heads * hd]);
        }
        // What each query's scores lack when the cache codes keys relative to a shift.
        let shift = codec.and_then(|c| c.key_shift(kvh));
        let lifts: Vec<f32> = qs.chunks(hd).map(|q| shift.map_or(0.0, |s| dot_f32(q, s))).collect();
        if let Some(s) = codec.and_then(|c| c.key_scale(kvh)) {
            qs.chunks_mut(hd).for_each(|q| q.iter_mut().zip(s).for_each(|(q, s)| *q /= s));
        }
        if let Some(c) = codec.filter(|c| c.rotates()) {
            qs.chunks_mut(hd).for_each(|q| c.rotate(kvh, q));
        }
        let n = qs.len() / hd;
        let (mut kt, mut vt) = (vec![0f32; TILE * hd], vec![0f32; TILE * hd]);
        // A TurboQuant cache's first and most recent positions, as computed.
        let exact = cache.exact_rows();
        let (mut ke, mut ve) = if exact == ExactRows::NONE { Default::default() } else { (kt.clone(), vt.clone()) };
        // The window each row sees: `lo..=pos`.
        let seen = |row: usize| {
            let pos = start + row;
            let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            assert!(lo >= cache.first(), "attention: position {lo} is no longer in the cache");
            (lo, pos)
        };
        let mut out = vec![0f32; n * hd];
        // The sink logit of the task's `j`th head, if the layer has sinks.
        let sink = |j: usize| p.sinks.map(|s| s[t.h0 + j]);
        match p.select {
            None => {
                let lanes = Lanes::new(&qs, hd);
                let width = lanes.width();
                let mut state = Online::new(width, hd);
                let lifts = [lifts.as_slice(), &vec![0.0; width - n]].concat();
                // Every query's scores against the tile's codes and its exact rows, and
                // then its weights, `[TILE][width]`.
                let mut sc = vec![0f32; TILE * width];
                let mut se = if exact == ExactRows::NONE { Vec::new() } else { sc.clone() };
                let mut w = vec![0f32; TILE * width];
                let (lo, first) = seen(t.rows.start);
                let hi = seen(t.rows.end - 1).1;
                // Where each row's exact recent positions begin: the rows' earliest and latest.
                let (cut_lo, cut_hi) = (exact.recent_from(first), exact.recent_from(hi));
                // Per query, where its exact recent positions begin and the positions of
                // the tile it reads (past the queries, none).
                let cuts: Vec<usize> = (0..width)
                    .map(|qi| t.rows.clone().nth(qi / self.heads).map_or(usize::MAX, |r| exact.recent_from(seen(r).1)))
                    .collect();
                let mut spans = vec![0..0; width];
                let mut a = lo / TILE * TILE;
                while a <= hi {
                    let b = (a + TILE).min(hi + 1);
                    let from = a.max(lo);
                    // Each tile read and scored in the forms some row of the task reads it
                    // in (only the positions some row reads exact: the others may be gone).
                    let codes = from.max(exact.sinks)..b.min(cut_hi);
                    if !codes.is_empty() {
                        (b..(b + TILE).min(start)).for_each(|j| cache.prefetch(j, kvh));
                        self.score_run(t.seq, kvh, (from..b, codes), &lanes, (&mut kt, &mut vt), &mut sc);
                    }
                    let runs = [
                        (exact.sinks > 0, from..b.min(exact.sinks)),
                        (exact.recent > 0, from.max(cut_lo).max(exact.sinks)..b),
                    ];
                    for (kept, run) in runs {
                        if kept && !run.is_empty() {
                            self.gather_exact(t.seq, kvh, from, run.clone(), (&mut ke, &mut ve));
                            tile::scores(&lanes, &ke, run.start - from..run.end - from, &mut se);
                        }
                    }
                    for (i, row) in t.rows.clone().enumerate() {
                        let (rlo, pos) = seen(row);
                        let (x0, x1) = (from.max(rlo), b.min(pos + 1).max(from));
                        spans[i * self.heads..(i + 1) * self.heads].fill(x0.min(x1) - from..x1 - from);
                    }
                    // A position's form for a query whose recent positions begin at `cut`
                    // (where the query reads it; the scores it does not read are not used).
                    let is_exact = |x: usize, cut: usize| !se.is_empty() && (x < exact.sinks || x >= cut);
                    // Whether no query reads any of the tile's positions exact (most tiles of a
                    // long context: only the sinks' and the recent rows' tiles differ).
                    let all_coded = se.is_empty() || (from >= exact.sinks && b <= cut_lo);
                    for r in 0..b - from {
                        let x = from + r;
                        let at = r * width..(r + 1) * width;
                        if all_coded {
                            // (one vector a position: no query reads an exact row)
                            for ((o, s), l) in w[at.clone()].iter_mut().zip(&sc[at.clone()]).zip(&lifts) {
                                *o = (s + l) * p.scale;
                            }
                        } else {
                            for (qi, o) in w[at.clone()].iter_mut().enumerate() {
                                let sv = if is_exact(x, cuts[qi]) { &se } else { &sc };
                                *o = (sv[r * width + qi] + lifts[qi]) * p.scale;
                            }
                        }
                        if let Some(cap) = p.softcap {
                            softcap(&mut w[at], cap);
                        }
                    }
                    state.fold(&mut w, b - from, &spans);
                    // The value sums, for runs of rows that read the same positions in the
                    // same forms at once.
                    let mut q0 = 0;
                    while q0 < n {
                        let same = |qi: &usize| spans[*qi] == spans[q0] && (all_coded || cuts[*qi] == cuts[q0]);
                        let q1 = (q0..n).take_while(same).last().unwrap_or(q0) + 1;
                        let span = spans[q0].clone();
                        if !span.is_empty() {
                            let mut rows: [&[f32]; TILE] = [&[]; TILE];
                            for (o, r) in rows.iter_mut().zip(span.clone()) {
                                *o = if is_exact(from + r, cuts[q0]) {
                                    &ve[r * hd..][..hd]
                                } else {
                                    &vt[r * hd..][..hd]
                                };
                            }
                            let weights = (&w[span.start * width + q0..], width);
                            tile::values(&mut state.acc[q0 * hd..q1 * hd], hd, weights, &rows[..span.len()]);
                        }
                        q0 = q1;
                    }
                    a += TILE;
                }
                state.finish(&mut out, |qi| sink(qi % self.heads));
            }
            Some(select) => {
                // Each row its own positions, in tiles of its list.
                for (i, row) in t.rows.clone().enumerate() {
                    let (lo, pos) = seen(row);
                    let chosen = &select[s.first + row];
                    assert!(
                        chosen.iter().all(|&j| j as usize <= pos && j as usize >= lo),
                        "attention: a chosen position is not visible"
                    );
                    let q0 = i * self.heads;
                    let lanes = Lanes::new(&qs[q0 * hd..(q0 + self.heads) * hd], hd);
                    let width = lanes.width();
                    let mut state = Online::new(width, hd);
                    let (mut sc, mut w) = (vec![0f32; TILE * width], vec![0f32; TILE * width]);
                    for c in chosen.chunks(TILE) {
                        let m = c.len();
                        self.gather(t.seq, kvh, c.iter().map(|&j| j as usize), &mut kt, &mut vt);
                        // The chosen positions that are kept exact, in their place.
                        for (x, &j) in c.iter().enumerate() {
                            if exact.covers(pos, j as usize) {
                                let j = j as usize;
                                self.gather_exact(t.seq, kvh, j - x, j..j + 1, (&mut kt, &mut vt));
                            }
                        }
                        tile::scores(&lanes, &kt, 0..m, &mut sc);
                        for r in 0..m {
                            let row = &mut w[r * width..(r + 1) * width];
                            for ((o, s), l) in row.iter_mut().zip(&sc[r * width..]).zip(&lifts[q0..q0 + self.heads]) {
                                *o = (s + l) * p.scale;
                            }
                            if let Some(cap) = p.softcap {
                                softcap(row, cap);
                            }
                        }
                        let spans: Vec<_> = (0..width).map(|j| if j < self.heads { 0..m } else { 0..0 }).collect();
                        state.fold(&mut w, m, &spans);
                        let mut rows: [&[f32]; TILE] = [&[]; TILE];
                        rows.iter_mut().enumerate().take(m).for_each(|(r, o)| *o = &vt[r * hd..][..hd]);
                        tile::values(&mut state.acc[..self.heads * hd], hd, (&w, width), &rows[..m]);
                    }
                    state.finish(&mut out[q0 * hd..(q0 + self.heads) * hd], sink);
                }
            }
        }
        if let Some(c) = codec.filter(|c| c.rotates()) {
            out.chunks_mut(hd).for_each(|acc| c.unrotate(kvh, acc));
        }
        out
    }

    /// The keys and values of KV head `kvh` at `positions` (at most [`TILE`]) into
    /// `k` and `v`, one `head_dim` row each, decoded from a coded cache.
    fn gather(&self, seq: usize, kvh: usize, positions: impl Iterator<Item = usize>, k: &mut [f32], v: &mut [f32]) {
        let hd = self.p.head_dim;
        let kv_dim = self.p.n_kv_heads * hd;
        let s = &self.seqs[seq];
        let (cache, start) = (s.cache, s.cache.len());
        for (t, j) in positions.enumerate() {
            let (kr, vr) = (&mut k[t * hd..(t + 1) * hd], &mut v[t * hd..(t + 1) * hd]);
            if cache.codec().is_some() {
                let (c, j) = if j < start { (cache, j) } else { (&self.coded[seq], j - start) };
                c.key_into(j, kvh, kr);
                c.value_into(j, kvh, vr);
            } else if j < start {
                kr.copy_from_slice(&cache.key(j)[kvh * hd..(kvh + 1) * hd]);
                vr.copy_from_slice(&cache.value(j)[kvh * hd..(kvh + 1) * hd]);
            } else {
                let at = (s.first + j - start) * kv_dim + kvh * hd;
                kr.copy_from_slice(&self.k_new[at..at + hd]);
                vr.copy_from_slice(&self.v_new[at..at + hd]);
            }
        }
    }

    /// The values of KV head `kvh` at positions `run` into `v` (as [`Job::gather_run`]),
    /// and every query's scores against the keys at positions `codes` (within `run`) into
    /// `sc`, row `j - run.start` for position `j`. A TurboQuant cache on AVX-512 scores
    /// its codes where they lie ([`KvCache::key_scores`], `k` its scratch), the others
    /// decode the keys into `k` for [`tile::scores`]: the same bits.
    fn score_run(
        &self,
        seq: usize,
        kvh: usize,
        (run, codes): (std::ops::Range<usize>, std::ops::Range<usize>),
        lanes: &Lanes,
        (k, v): (&mut [f32], &mut [f32]),
        sc: &mut [f32],
    ) {
        if !self.seqs[seq].cache.scores_from_codes() {
            self.gather_run(seq, kvh, run.clone(), k, v);
            return tile::scores(lanes, k, codes.start - run.start..codes.end - run.start, sc);
        }
        let (hd, width) = (self.p.head_dim, lanes.width());
        for (c, rows, at) in self.run_parts(seq, run.clone()) {
            if !rows.is_empty() {
                c.values_into(rows, kvh, &mut v[at * hd..]);
            }
        }
        for (c, rows, at) in self.run_parts(seq, codes.clone()) {
            if !rows.is_empty() {
                let out = &mut sc[(codes.start + at - run.start) * width..];
                c.key_scores(rows, kvh, lanes, out, k);
            }
        }
    }

    /// The positions `run` of sequence `seq` split where its chunk begins: those already
    /// in its cache, then the chunk's own codes; each part as (the cache holding it, its
    /// rows there, its offset in `run`).
    fn run_parts(&self, seq: usize, run: std::ops::Range<usize>) -> [(&KvCache, std::ops::Range<usize>, usize); 2] {
        let cache = self.seqs[seq].cache;
        let start = cache.len();
        let mid = run.end.min(start).max(run.start);
        let own = mid.max(start) - start..run.end.max(start) - start;
        [(cache, run.start..mid, 0), (&self.coded[seq], own, mid - run.start)]
    }

    /// As [`Job::gather`] for the positions `run`, which a coded cache reads a block at
    /// a time.
    fn gather_run(&self, seq: usize, kvh: usize, run: std::ops::Range<usize>, k: &mut [f32], v: &mut [f32]) {
        if self.seqs[seq].cache.codec().is_none() {
            return self.gather(seq, kvh, run, k, v);
        }
        let hd = self.p.head_dim;
        for (c, rows, at) in self.run_parts(seq, run) {
            if !rows.is_empty() {
                let span = at * hd..(at + rows.len()) * hd;
                c.run_into(rows, kvh, &mut k[span.clone()], &mut v[span]);
            }
        }
    }

    /// The exact keys and values ([`ExactRows`]) of KV head `kvh` at `positions` into
    /// `k` and `v`, one `head_dim` row each, position `j` at row `j - from`.
    fn gather_exact(
        &self,
        seq: usize,
        kvh: usize,
        from: usize,
        positions: std::ops::Range<usize>,
        (k, v): (&mut [f32], &mut [f32]),
    ) {
        let hd = self.p.head_dim;
        let s = &self.seqs[seq];
        let start = s.cache.len();
        for j in positions {
            let t = j - from;
            let (c, j) = if j < start { (s.cache, j) } else { (&self.coded[seq], j - start) };
            c.exact_into(j, kvh, &mut k[t * hd..(t + 1) * hd], &mut v[t * hd..(t + 1) * hd]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::softmax;

    fn naive(p: &AttnParams<'_>, q: &[f32], k: &[f32], v: &[f32], pos0: usize, n: usize) -> Vec<f32> {
        let (hd, qd, kd) = (p.head_dim, p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim);
        let mut out = vec![0f32; n * qd];
        for i in 0..n {
            let pos = pos0 + i;
            for h in 0..p.n_heads {
                let kh = h / (p.n_heads / p.n_kv_heads);
                let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let mut s: Vec<f32> = (lo..=pos)
                    .map(|j| (0..hd).map(|d| q[i * qd + h * hd + d] * k[j * kd + kh * hd + d]).sum::<f32>() * p.scale)
                    .collect();
                softmax(&mut s);
                for (j, w) in (lo..=pos).zip(s) {
                    for d in 0..hd {
                        out[i * qd + h * hd + d] += w * v[j * kd + kh * hd + d];
                    }
                }
            }
        }
        out
    }

    /// One sequence's `q`, `k`, `v` fed through `cache` in chunks of `chunk` rows, each
    /// chunk's keys and values appended after it attends.
    fn chunked(p: &AttnParams<'_>, (q, k, v): (&[f32], &[f32], &[f32]), mut cache: KvCache, chunk: usize) -> Vec<f32> {
        let (qd, kd) = (p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim);
        let n = q.len() / qd;
        let mut got = vec![0f32; n * qd];
        let mut s = 0;
        while s < n {
            let e = (s + chunk).min(n);
            let (ks, vs) = (&k[s * kd..e * kd], &v[s * kd..e * kd]);
            let seq = [AttnSeq { first: 0, rows: e - s, cache: &cache }];
            attention(p, &q[s * qd..e * qd], ks, vs, &seq, &mut got[s * qd..e * qd]);
            cache.append(ks, vs);
            s = e;
        }
        got
    }

    /// A cache's prefix holds what a cache fed only those positions holds, for full
    /// caches and rings; a ring that has gone past the positions gives none.
    #[test]
    fn prefix_equals_a_cache_fed_that_far() {
        let d = 3;
        let row = |pos: usize, s: f32| (0..d).map(|j| s * pos as f32 + j as f32).collect::<Vec<f32>>();
        let fed = |window: Option<usize>, n: usize| {
            let mut c = KvCache::new(d, window);
            for pos in 0..n {
                c.append(&row(pos, 1.0), &row(pos, -1.0));
            }
            c
        };
        for window in [None, Some(4)] {
            let full = fed(window, 4);
            for keep in 0..=4 {
                let p = full.prefix(keep).expect("all positions held");
                let want = fed(window, keep);
                assert_eq!((p.len(), p.first()), (want.len(), want.first()));
                for pos in p.first()..keep {
                    assert_eq!((p.key(pos), p.value(pos)), (want.key(pos), want.value(pos)), "{window:?} {keep} {pos}");
                }
            }
            assert!(full.prefix(5).is_none());
        }
        let ring = fed(Some(4), 10);
        assert!(ring.prefix(7).is_none(), "positions 3..6 are overwritten");
        let p = ring.prefix(10).unwrap();
        for pos in 6..10 {
            assert_eq!(p.key(pos), row(pos, 1.0));
        }
        // Appending to a prefix continues it as the original went on.
        let mut p = fed(Some(4), 4).prefix(3).unwrap();
        p.append(&row(9, 1.0), &row(9, -1.0));
        p.append(&row(10, 1.0), &row(10, -1.0));
        assert_eq!((p.first(), p.key(3), p.key(4)), (1, &row(9, 1.0)[..], &row(10, 1.0)[..]));
        assert_eq!(p.key(2), row(2, 1.0));
    }

    /// Prefill in one chunk, in chunks, and one token at a time through a ring all
    /// agree with a naive implementation over the whole sequence.
    #[test]
    fn chunks_and_ring_match_naive() {
        let p = AttnParams {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            scale: 0.35,
            window: Some(3),
            softcap: None,
            sinks: None,
            select: None,
        };
        let n = 11;
        let (qd, kd) = (32, 16);
        let q: Vec<f32> = (0..n * qd).map(|i| ((i * 7 % 19) as f32 - 9.0) / 9.0).collect();
        let k: Vec<f32> = (0..n * kd).map(|i| ((i * 5 % 23) as f32 - 11.0) / 11.0).collect();
        let v: Vec<f32> = (0..n * kd).map(|i| ((i * 3 % 17) as f32 - 8.0) / 8.0).collect();
        for window in [Some(3), None] {
            let p = AttnParams { window, ..p };
            let want = naive(&p, &q, &k, &v, 0, n);
            for chunk in [n, 4, 1] {
                let got = chunked(&p, (&q, &k, &v), KvCache::new(kd, window), chunk);
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-5, "window {window:?} chunk {chunk}: {a} vs {b}");
                }
            }
        }
    }

    /// Sequences of different lengths and cache sizes in one call: each is bitwise
    /// what it gives alone.
    #[test]
    fn batch_of_sequences_equals_each_alone() {
        let p = AttnParams {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            scale: 0.35,
            window: Some(5),
            softcap: Some(20.0),
            sinks: None,
            select: None,
        };
        let (qd, kd) = (32, 16);
        let fill = |n: usize, m: usize, seed: usize| -> Vec<f32> {
            (0..n * m).map(|i| (((i + seed) * 7919 % 113) as f32 - 56.0) / 40.0).collect()
        };
        // (cached positions, new rows) per sequence.
        let shape = [(0usize, 3usize), (7, 1), (2, 6), (9, 2)];
        let mut caches = Vec::new();
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        let mut alone = Vec::new();
        for (si, &(held, rows)) in shape.iter().enumerate() {
            let mut c = KvCache::new(kd, p.window);
            c.append(&fill(held, kd, 11 * si), &fill(held, kd, 13 * si));
            let (qs, ks, vs) = (fill(rows, qd, 3 + si), fill(rows, kd, 5 + si), fill(rows, kd, 7 + si));
            let mut o = vec![0f32; rows * qd];
            attention(&p, &qs, &ks, &vs, &[AttnSeq { first: 0, rows, cache: &c }], &mut o);
            alone.extend(o);
            q.extend(qs);
            k.extend(ks);
            v.extend(vs);
            caches.push(c);
        }
        let mut first = 0;
        let seqs: Vec<AttnSeq> = shape
            .iter()
            .zip(&caches)
            .map(|(&(_, rows), cache)| {
                let s = AttnSeq { first, rows, cache };
                first += rows;
                s
            })
            .collect();
        let mut got = vec![0f32; q.len()];
        attention(&p, &q, &k, &v, &seqs, &mut got);
        assert!(got == alone);
    }

    /// Four query heads on two KV heads of 32, for Gaussian queries, keys and values of
    /// 13 positions (`[13, 128]` and `[13, 64]`).
    const GAUSSIAN_HEADS: AttnParams<'static> = AttnParams {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 32,
        scale: 0.18,
        window: None,
        softcap: None,
        sinks: None,
        select: None,
    };

    /// A coded cache: a prompt in one chunk, in chunks and token by token gives the same
    /// bits (a chunk reads its own rows coded), close to f32 attention by the format's
    /// precision; a batch of sequences gives each one's bits alone. The same with some
    /// positions kept exact ([`ExactRows`]: a ring shorter than a chunk), which are
    /// closer; with every position exact, as close as a 16-bit cache (what they are
    /// kept in).
    #[test]
    fn coded_caches_are_chunk_invariant() {
        use sluice_core::{KvFormat, KvLayout, TurboBits};
        let p = GAUSSIAN_HEADS;
        let n = 13;
        let (qd, kd) = (128, 64);
        // Gaussian keys, values and queries (a rotated real head looks like this).
        let g = |m: usize, seed: u64| crate::kv::tests::gaussian(m, seed);
        let (q, k, v) = (g(n * qd, 1), g(n * kd, 2), g(n * kd, 3));
        let want = naive(&p, &q, &k, &v, 0, n);
        let some = ExactRows { sinks: 2, recent: 4 };
        let two = KvFormat::Turbo(TurboBits::Two);
        for (format, exact, tol) in [
            (KvFormat::F16, ExactRows::NONE, 1e-3),
            (KvFormat::Q8, ExactRows::NONE, 0.015),
            (KvFormat::Turbo(TurboBits::Four), ExactRows::NONE, 0.15),
            (KvFormat::Turbo(TurboBits::ThreeHalf), ExactRows::NONE, 0.2),
            (two, ExactRows::NONE, 0.5),
            // Measured 0.37 with codes alone, 0.22 with these.
            // Measured 0.386 with codes alone, 0.173 with these (4 bits: 0.099, 0.036).
            (two, some, 0.25),
            (KvFormat::Turbo(TurboBits::Four), some, 0.06),
            (two, ExactRows { sinks: 0, recent: n }, 1e-3),
            (two, ExactRows { sinks: n, recent: 0 }, 1e-3),
        ] {
            let layout = KvLayout { seed: 7, exact, ..KvLayout::plain(kd, 32, format) };
            let mut runs = Vec::new();
            for chunk in [n, 5, 1] {
                runs.push(chunked(&p, (&q, &k, &v), KvCache::with_layout(&layout).unwrap(), chunk));
            }
            assert!(runs[1] == runs[0] && runs[2] == runs[0], "{format:?} {exact:?}: chunking changed the result");
            // Relative RMS error against f32 attention.
            let sq = |x: f32| (x as f64) * (x as f64);
            let err = (runs[0].iter().zip(&want).map(|(a, b)| sq(a - b)).sum::<f64>()
                / want.iter().map(|&b| sq(b)).sum::<f64>())
            .sqrt();
            eprintln!("{format:?} {exact:?}: relative RMS error {err:.5}");
            assert!(err < tol, "{format:?} {exact:?}: relative RMS error {err} against f32");
            // Two sequences in one call, each as alone.
            let mut c1 = KvCache::with_layout(&layout).unwrap();
            c1.append(&k[..5 * kd], &v[..5 * kd]);
            let c2 = KvCache::with_layout(&layout).unwrap();
            let mut alone = vec![0f32; 3 * qd];
            attention(
                &p,
                &q[5 * qd..6 * qd],
                &k[5 * kd..6 * kd],
                &v[5 * kd..6 * kd],
                &[AttnSeq { first: 0, rows: 1, cache: &c1 }],
                &mut alone[..qd],
            );
            attention(
                &p,
                &q[..2 * qd],
                &k[..2 * kd],
                &v[..2 * kd],
                &[AttnSeq { first: 0, rows: 2, cache: &c2 }],
                &mut alone[qd..],
            );
            let mut both = vec![0f32; 3 * qd];
            let (mut qb, mut kb, mut vb) =
                (q[5 * qd..6 * qd].to_vec(), k[5 * kd..6 * kd].to_vec(), v[5 * kd..6 * kd].to_vec());
            qb.extend(&q[..2 * qd]);
            kb.extend(&k[..2 * kd]);
            vb.extend(&v[..2 * kd]);
            let seqs = [AttnSeq { first: 0, rows: 1, cache: &c1 }, AttnSeq { first: 1, rows: 2, cache: &c2 }];
            attention(&p, &qb, &kb, &vb, &seqs, &mut both);
            assert!(both == alone, "{format:?} {exact:?}: batching changed a result");
        }
    }

    /// A TurboQuant cache's prefix carries its exact rows: the next position attends
    /// the same from it as from a cache fed that far, while one whose ring of recent
    /// exact positions has gone past the cut gives none.
    #[test]
    fn a_coded_prefix_keeps_its_exact_rows() {
        use sluice_core::{KvFormat, KvLayout, TurboBits};
        let p = GAUSSIAN_HEADS;
        let (qd, kd) = (128, 64);
        let g = |m: usize, seed: u64| crate::kv::tests::gaussian(m, seed);
        let (q, k, v) = (g(12 * qd, 1), g(12 * kd, 2), g(12 * kd, 3));
        let exact = ExactRows { sinks: 2, recent: 4 };
        let format = KvFormat::Turbo(TurboBits::Four);
        let layout = KvLayout { seed: 7, exact, ..KvLayout::plain(kd, 32, format) };
        let fed = |m: usize| {
            let mut c = KvCache::with_layout(&layout).unwrap();
            c.append(&k[..m * kd], &v[..m * kd]);
            c
        };
        let next = |c: &KvCache| {
            let at = c.len();
            let mut out = vec![0f32; qd];
            let rows = |x: &[f32], w: usize| x[at * w..(at + 1) * w].to_vec();
            let seqs = [AttnSeq { first: 0, rows: 1, cache: c }];
            attention(&p, &rows(&q, qd), &rows(&k, kd), &rows(&v, kd), &seqs, &mut out);
            out
        };
        for (len, keep) in [(9, 9), (3, 2), (4, 1)] {
            let cut = fed(len).prefix(keep).unwrap_or_else(|| panic!("{len} positions cut at {keep}"));
            assert_eq!(next(&cut), next(&fed(keep)), "{len} positions cut at {keep}");
        }
        assert!(fed(9).prefix(6).is_none(), "the ring of the last 4 holds positions 5 to 8");
    }

    /// Keys that share a large offset in a few channels (as a key bias puts there):
    /// a TurboQuant cache coding them relative to that offset is as close to f32
    /// attention as on plain Gaussian keys, and without the shift the offset takes the
    /// codes' range and the result is far off. The shift also survives chunking.
    #[test]
    fn a_key_shift_takes_a_shared_offset_out_of_the_codes() {
        use sluice_core::{KvFormat, KvLayout, TurboBits};
        let p = GAUSSIAN_HEADS;
        let n = 13;
        let (qd, kd) = (128, 64);
        let g = |m: usize, seed: u64| crate::kv::tests::gaussian(m, seed);
        let (q, mut k, v) = (g(n * qd, 1), g(n * kd, 2), g(n * kd, 3));
        let mut offset = vec![0f32; kd];
        for (c, o) in [(3, 300.0), (19, -250.0), (35, 180.0), (60, -320.0)] {
            offset[c] = o;
        }
        k.chunks_mut(kd).for_each(|row| row.iter_mut().zip(&offset).for_each(|(k, o)| *k += o));
        // The offset adds a constant to each query's scores: softmax takes it out.
        let want = naive(&p, &q, &k, &v, 0, n);
        let err_with = |shift: Option<&[f32]>, chunk: usize, exact: ExactRows| {
            let format = KvFormat::Turbo(TurboBits::Four);
            let layout = KvLayout { seed: 7, key_shift: shift, exact, ..KvLayout::plain(kd, 32, format) };
            let got = chunked(&p, (&q, &k, &v), KvCache::with_layout(&layout).unwrap(), chunk);
            let sq = |x: f32| (x as f64) * (x as f64);
            (got.iter().zip(&want).map(|(a, b)| sq(a - b)).sum::<f64>() / want.iter().map(|&b| sq(b)).sum::<f64>())
                .sqrt()
        };
        let err = |shift: Option<&[f32]>, chunk: usize| err_with(shift, chunk, ExactRows::NONE);
        let (shifted, plain) = (err(Some(&offset), n), err(None, n));
        eprintln!("relative RMS error: {shifted:.4} with the shift, {plain:.4} without");
        assert!(shifted < 0.15, "with the shift: {shifted}");
        assert!(plain > 3.0 * shifted, "without the shift: {plain} (with it {shifted})");
        assert_eq!(err(Some(&offset), 4), shifted, "chunking changed the result");
        // Exact rows are kept relative to the shift as well: every position exact is as
        // close as a 16-bit cache, and some exact survive chunking.
        let exact = err_with(Some(&offset), n, ExactRows { sinks: 0, recent: n });
        assert!(exact < 1e-3, "every position exact, with the shift: {exact}");
        let some = ExactRows { sinks: 1, recent: 3 };
        assert_eq!(err_with(Some(&offset), n, some), err_with(Some(&offset), 4, some), "chunking changed the result");
    }
}
