//! Causal attention over a KV cache plus the keys and values of the current chunk.
//!
//! The cache holds the positions before the chunk; the chunk's own keys and values
//! are passed alongside and appended only after every layer has run. That lets a
//! sliding layer's ring hold just `window` entries even while a prefill chunk is
//! longer than the window, and lets KV-sharing layers read the producer's chunk.

use rayon::prelude::*;

use crate::dot::{dot_f32, dot_f32_rows, weighted_sum};
pub use crate::kv::KvCache;
use crate::ops::{softmax, softmax_with_sink};

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
    // A coded cache's sequences code their new rows in the same format first, so that
    // a chunk reads its own keys and values as every later step will (a prompt gives the
    // same result however it is cut into chunks).
    let coded: Vec<KvCache> = seqs
        .iter()
        .filter(|s| s.cache.codec().is_some())
        .map(|s| {
            let kd = p.n_kv_heads * hd;
            let mut c = s.cache.empty_like();
            c.append(&k_new[s.first * kd..(s.first + s.rows) * kd], &v_new[s.first * kd..(s.first + s.rows) * kd]);
            c
        })
        .collect();
    assert!(coded.is_empty() || coded.len() == seqs.len(), "attention: one call's caches share their format");
    let job = Job { p, q, k_new, v_new, seqs, coded: &coded, row_seq: &row_seq, heads };
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
    /// Per sequence, its new rows coded as its cache codes them (none for f32 caches).
    coded: &'a [KvCache],
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
        let si = self.row_seq[row] as usize;
        let s = &self.seqs[si];
        let (cache, start) = (s.cache, s.cache.len());
        let pos = start + row - s.first;
        let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        assert!(lo >= cache.first(), "attention: position {lo} is no longer in the cache");
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
        if let Some(codec) = cache.codec() {
            // A coded cache: each key and value decoded once into a row of the head, for
            // every query head of the task; TurboQuant's rows are rotated, so the
            // queries are rotated once and the sum of values rotated back once.
            let chunk = &self.coded[si];
            let load = |j: usize, buf: &mut [f32], value: bool| {
                let (c, j) = if j < start { (cache, j) } else { (chunk, j - start) };
                if value { c.value_into(j, kvh, buf) } else { c.key_into(j, kvh, buf) }
            };
            let mut qr = qs.to_vec();
            if codec.rotates() {
                qr.chunks_mut(hd).for_each(|q| codec.rotate(kvh, q));
            }
            let mut buf = vec![0f32; hd];
            for t in 0..len {
                load(at(t), &mut buf, false);
                for (j, qh) in qr.chunks(hd).enumerate() {
                    sc[j * len + t] = dot_f32(qh, &buf);
                }
            }
            sc.chunks_mut(len).enumerate().for_each(|(j, w)| self.weights(w, h0 + j));
            out.fill(0.0);
            for t in 0..len {
                load(at(t), &mut buf, true);
                for (o, w) in out.chunks_mut(hd).zip(sc.chunks(len)) {
                    let w = w[t];
                    o.iter_mut().zip(&buf).for_each(|(o, v)| *o += w * v);
                }
            }
            if codec.rotates() {
                out.chunks_mut(hd).for_each(|o| codec.unrotate(kvh, o));
            }
            return;
        }
        let kh = kvh * hd;
        // Position j of this sequence: in its cache, or one of its new rows.
        let new_row = |j: usize| (s.first + j - start) * kv_dim + kh;
        let key = |j: usize| -> &[f32] {
            if j < start { &cache.key(j)[kh..kh + hd] } else { &self.k_new[new_row(j)..new_row(j) + hd] }
        };
        let value = |j: usize| -> &[f32] {
            if j < start { &cache.value(j)[kh..kh + hd] } else { &self.v_new[new_row(j)..new_row(j) + hd] }
        };
        for (j, (qh, w)) in qs.chunks(hd).zip(sc.chunks_mut(len)).enumerate() {
            dot_f32_rows(qh, |t| key(at(t)), w);
            self.weights(w, h0 + j);
        }
        for (o, w) in out.chunks_mut(hd).zip(sc.chunks(len)) {
            weighted_sum(o, w, |t| value(at(t)));
        }
    }

    /// Query head `head`'s raw scores into attention weights: scaled, soft-capped,
    /// softmax (with the head's sink).
    fn weights(&self, w: &mut [f32], head: usize) {
        let p = self.p;
        w.iter_mut().for_each(|x| *x *= p.scale);
        if let Some(cap) = p.softcap {
            w.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap);
        }
        match p.sinks {
            Some(s) => softmax_with_sink(w, s[head]),
            None => softmax(w),
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

    /// A coded cache: a prompt in one chunk, in chunks and token by token gives the same
    /// bits (a chunk reads its own rows coded), close to f32 attention by the format's
    /// precision; a batch of sequences gives each one's bits alone.
    #[test]
    fn coded_caches_are_chunk_invariant() {
        use sluice_core::{KvFormat, KvLayout, TurboBits};
        let p = AttnParams {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 32,
            scale: 0.18,
            window: None,
            softcap: None,
            sinks: None,
            select: None,
        };
        let n = 13;
        let (qd, kd) = (128, 64);
        // Gaussian keys, values and queries (a rotated real head looks like this).
        let g = |m: usize, seed: u64| crate::kv::tests::gaussian(m, seed);
        let (q, k, v) = (g(n * qd, 1), g(n * kd, 2), g(n * kd, 3));
        let want = naive(&p, &q, &k, &v, 0, n);
        for (format, tol) in [
            (KvFormat::F16, 1e-3),
            (KvFormat::Q8, 0.015),
            (KvFormat::Turbo(TurboBits::Four), 0.15),
            (KvFormat::Turbo(TurboBits::ThreeHalf), 0.2),
            (KvFormat::Turbo(TurboBits::Two), 0.5),
        ] {
            let layout = KvLayout { kv_dim: kd, head_dim: 32, window: None, format, seed: 7 };
            let mut runs = Vec::new();
            for chunk in [n, 5, 1] {
                runs.push(chunked(&p, (&q, &k, &v), KvCache::with_layout(&layout).unwrap(), chunk));
            }
            assert!(runs[1] == runs[0] && runs[2] == runs[0], "{format:?}: chunking changed the result");
            // Relative RMS error against f32 attention.
            let sq = |x: f32| (x as f64) * (x as f64);
            let err = (runs[0].iter().zip(&want).map(|(a, b)| sq(a - b)).sum::<f64>()
                / want.iter().map(|&b| sq(b)).sum::<f64>())
            .sqrt();
            eprintln!("{format:?}: relative RMS error {err:.5}");
            assert!(err < tol, "{format:?}: relative RMS error {err} against f32");
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
            assert!(both == alone, "{format:?}: batching changed a result");
        }
    }
}
