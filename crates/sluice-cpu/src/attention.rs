//! Causal attention over a KV cache plus the keys and values of the current chunk.
//!
//! The cache holds the positions before the chunk; the chunk's own keys and values
//! are passed alongside and appended only after every layer has run. That lets a
//! sliding layer's ring hold just `window` entries even while a prefill chunk is
//! longer than the window, and lets KV-sharing layers read the producer's chunk.

use rayon::prelude::*;

use crate::dot::{dot_f32_rows, weighted_sum};
use crate::ops::{softmax, softmax_with_sink};

/// One layer's keys and values, `kv_dim` floats per position. Full-attention layers
/// keep every position; sliding layers keep a ring of the last `window`.
#[derive(Clone, Debug)]
pub struct KvCache {
    kv_dim: usize,
    window: Option<usize>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Positions written so far; the next one appended is position `len`.
    len: usize,
}

impl KvCache {
    pub fn new(kv_dim: usize, window: Option<usize>) -> Self {
        KvCache { kv_dim, window, k: Vec::new(), v: Vec::new(), len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Oldest position still held.
    pub fn first(&self) -> usize {
        self.window.map_or(0, |w| self.len.saturating_sub(w))
    }

    pub fn bytes(&self) -> usize {
        (self.k.capacity() + self.v.capacity()) * 4
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    fn slot(&self, pos: usize) -> usize {
        self.window.map_or(pos, |w| pos % w)
    }

    pub fn key(&self, pos: usize) -> &[f32] {
        debug_assert!(pos >= self.first() && pos < self.len);
        let s = self.slot(pos) * self.kv_dim;
        &self.k[s..s + self.kv_dim]
    }

    pub fn value(&self, pos: usize) -> &[f32] {
        let s = self.slot(pos) * self.kv_dim;
        &self.v[s..s + self.kv_dim]
    }

    /// A cache holding this one's positions `0..keep` (as a ring: the last `window` of
    /// them), or `None` when some of those positions are no longer held (a ring that
    /// has gone round past them). For a prompt that shares only a prefix with a kept
    /// sequence (the same system prompt, another question).
    pub fn prefix(&self, keep: usize) -> Option<KvCache> {
        let from = self.window.map_or(0, |w| keep.saturating_sub(w));
        if keep > self.len || from < self.first() {
            return None;
        }
        // A ring keeps position `pos` in slot `pos % window` whatever its length, so the
        // slots of positions `from..keep` are the first `min(keep, window)` as they are.
        let rows = self.window.map_or(keep, |w| keep.min(w)) * self.kv_dim;
        Some(KvCache {
            kv_dim: self.kv_dim,
            window: self.window,
            k: self.k[..rows].to_vec(),
            v: self.v[..rows].to_vec(),
            len: keep,
        })
    }

    /// Appends `n` positions (`[n, kv_dim]` each).
    pub fn append(&mut self, k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        let n = k.len() / d;
        assert_eq!(v.len(), n * d);
        // Only the last `window` of a long chunk survive in a ring.
        let skip = self.window.map_or(0, |w| n.saturating_sub(w));
        let held = self.window.map_or(self.len + n, |w| (self.len + n).min(w));
        if self.k.len() < held * d {
            self.k.resize(held * d, 0.0);
            self.v.resize(held * d, 0.0);
        }
        for i in skip..n {
            let s = self.slot(self.len + i) * d;
            self.k[s..s + d].copy_from_slice(&k[i * d..(i + 1) * d]);
            self.v[s..s + d].copy_from_slice(&v[i * d..(i + 1) * d]);
        }
        self.len += n;
    }
}

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
/// `q`. One task computes some of one row's query heads that share a KV head (each
/// key and value read once for them), whole and in a fixed order, so a sequence's result
/// does not depend on the others in the batch or the thread count.
pub fn attention(p: &AttnParams<'_>, q: &[f32], k_new: &[f32], v_new: &[f32], seqs: &[AttnSeq<'_>], out: &mut [f32]) {
    let hd = p.head_dim;
    let q_dim = p.n_heads * hd;
    let n = q.len() / q_dim;
    let mut row_seq = Vec::with_capacity(n);
    for (si, s) in seqs.iter().enumerate() {
        assert_eq!(s.first, row_seq.len(), "attention: sequences must cover the rows in order");
        row_seq.extend(std::iter::repeat_n(si as u32, s.rows));
    }
    assert_eq!(row_seq.len(), n, "attention: the sequences cover {} rows of {n}", row_seq.len());
    let group = p.n_heads / p.n_kv_heads;
    let total: usize = seqs.iter().map(|s| s.rows * p.n_heads * (s.cache.len() + s.rows) * hd).sum();
    let parallel = total >= 1 << 14;
    // Query heads per task: a KV head's whole group shares each key and value read,
    // but one decode row then has as few tasks as KV heads (one on Gemma 3), so the
    // group is split until every thread has work. A head's result does not depend on
    // the heads it is computed with.
    let threads = if parallel { rayon::current_num_threads() } else { 1 };
    let heads = (1..=group).rev().find(|&d| group.is_multiple_of(d) && n * (p.n_heads / d) >= 2 * threads).unwrap_or(1);
    let job = Job { p, q, k_new, v_new, seqs, row_seq: &row_seq, heads };
    let tasks_per_row = p.n_heads / heads;
    let task = |(idx, o): (usize, &mut [f32])| job.run(idx / tasks_per_row, (idx % tasks_per_row) * heads, o);
    if parallel {
        out.par_chunks_mut(heads * hd).enumerate().for_each(task);
    } else {
        out.chunks_mut(heads * hd).enumerate().for_each(task);
    }
}

/// What every task of one attention call reads.
struct Job<'a> {
    p: &'a AttnParams<'a>,
    q: &'a [f32],
    k_new: &'a [f32],
    v_new: &'a [f32],
    seqs: &'a [AttnSeq<'a>],
    row_seq: &'a [u32],
    /// Query heads per task, all of one KV head's group.
    heads: usize,
}

impl Job<'_> {
    /// Row `row`'s query heads `h0..h0 + self.heads` into `out` (`heads * head_dim`).
    fn run(&self, row: usize, h0: usize, out: &mut [f32]) {
        let p = self.p;
        let hd = p.head_dim;
        let (kv_dim, q_dim) = (p.n_kv_heads * hd, p.n_heads * hd);
        let heads = self.heads;
        let kvh = h0 / (p.n_heads / p.n_kv_heads);
        let s = &self.seqs[self.row_seq[row] as usize];
        let (cache, start) = (s.cache, s.cache.len());
        let pos = start + row - s.first;
        let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        assert!(lo >= cache.first(), "attention: position {lo} is no longer in the cache");
        let kh = kvh * hd;
        // Position j of this sequence: in its cache, or one of its new rows.
        let new_row = |j: usize| (s.first + j - start) * kv_dim + kh;
        let key = |j: usize| -> &[f32] {
            if j < start { &cache.key(j)[kh..kh + hd] } else { &self.k_new[new_row(j)..new_row(j) + hd] }
        };
        let value = |j: usize| -> &[f32] {
            if j < start { &cache.value(j)[kh..kh + hd] } else { &self.v_new[new_row(j)..new_row(j) + hd] }
        };
        let qs = &self.q[row * q_dim + h0 * hd..row * q_dim + (h0 + heads) * hd];
        // The positions the row attends to: a window's, or the ones chosen for it.
        let chosen = p.select.map(|sel| sel[row].as_slice());
        if let Some(c) = chosen {
            assert!(
                c.iter().all(|&j| j as usize <= pos && j as usize >= lo),
                "attention: a chosen position is not visible"
            );
        }
        let at = |t: usize| chosen.map_or(lo + t, |c| c[t] as usize);
        let len = chosen.map_or(pos + 1 - lo, <[u32]>::len);
        // Scores of every head of the task, head-major (the keys stay in cache from
        // one head to the next).
        let mut sc = vec![0f32; heads * len];
        for (j, (qh, w)) in qs.chunks(hd).zip(sc.chunks_mut(len)).enumerate() {
            dot_f32_rows(qh, |t| key(at(t)), w);
            w.iter_mut().for_each(|x| *x *= p.scale);
            if let Some(cap) = p.softcap {
                w.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap);
            }
            match p.sinks {
                Some(s) => softmax_with_sink(w, s[h0 + j]),
                None => softmax(w),
            }
        }
        for (o, w) in out.chunks_mut(hd).zip(sc.chunks(len)) {
            weighted_sum(o, w, |t| value(at(t)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                let mut cache = KvCache::new(kd, window);
                let mut got = vec![0f32; n * qd];
                let mut s = 0;
                while s < n {
                    let e = (s + chunk).min(n);
                    let seq = [AttnSeq { first: 0, rows: e - s, cache: &cache }];
                    attention(
                        &p,
                        &q[s * qd..e * qd],
                        &k[s * kd..e * kd],
                        &v[s * kd..e * kd],
                        &seq,
                        &mut got[s * qd..e * qd],
                    );
                    cache.append(&k[s * kd..e * kd], &v[s * kd..e * kd]);
                    s = e;
                }
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
}
