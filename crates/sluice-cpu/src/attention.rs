//! Causal attention over a KV cache plus the keys and values of the current chunk.
//!
//! The cache holds the positions before the chunk; the chunk's own keys and values
//! are passed alongside and appended only after every layer has run. That lets a
//! sliding layer's ring hold just `window` entries even while a prefill chunk is
//! longer than the window, and lets KV-sharing layers read the producer's chunk.

use rayon::prelude::*;

use crate::dot::dot_f32;
use crate::ops::softmax;

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
pub struct AttnParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Sliding window: a query sees itself and the `window - 1` positions before it.
    pub window: Option<usize>,
    pub softcap: Option<f32>,
}

/// `q` is `[n, n_heads * head_dim]` for positions `cache.len()..cache.len() + n`;
/// `k_new` and `v_new` are the same positions' `[n, kv_dim]`. Writes `out`, shaped
/// like `q`.
pub fn attention(p: &AttnParams, q: &[f32], k_new: &[f32], v_new: &[f32], cache: &KvCache, out: &mut [f32]) {
    let hd = p.head_dim;
    let kv_dim = p.n_kv_heads * hd;
    let q_dim = p.n_heads * hd;
    let n = q.len() / q_dim;
    let group = p.n_heads / p.n_kv_heads;
    let start = cache.len();
    let work = |(idx, o): (usize, &mut [f32])| {
        let (i, h) = (idx / p.n_heads, idx % p.n_heads);
        let pos = start + i;
        let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        assert!(lo >= cache.first(), "attention: position {lo} is no longer in the cache");
        let kh = (h / group) * hd;
        let qh = &q[i * q_dim + h * hd..i * q_dim + (h + 1) * hd];
        let key = |j: usize| -> &[f32] {
            if j < start {
                &cache.key(j)[kh..kh + hd]
            } else {
                &k_new[(j - start) * kv_dim + kh..(j - start) * kv_dim + kh + hd]
            }
        };
        let value = |j: usize| -> &[f32] {
            if j < start {
                &cache.value(j)[kh..kh + hd]
            } else {
                &v_new[(j - start) * kv_dim + kh..(j - start) * kv_dim + kh + hd]
            }
        };
        let mut s: Vec<f32> = (lo..=pos).map(|j| dot_f32(qh, key(j)) * p.scale).collect();
        if let Some(cap) = p.softcap {
            s.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap);
        }
        softmax(&mut s);
        o.fill(0.0);
        for (j, &w) in (lo..=pos).zip(&s) {
            o.iter_mut().zip(value(j)).for_each(|(a, &b)| *a += w * b);
        }
    };
    let total = n * p.n_heads * (start + n) * hd;
    if total >= 1 << 14 {
        out.par_chunks_mut(hd).enumerate().for_each(work);
    } else {
        out.chunks_mut(hd).enumerate().for_each(work);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(p: &AttnParams, q: &[f32], k: &[f32], v: &[f32], pos0: usize, n: usize) -> Vec<f32> {
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

    /// Prefill in one chunk, in chunks, and one token at a time through a ring all
    /// agree with a naive implementation over the whole sequence.
    #[test]
    fn chunks_and_ring_match_naive() {
        let p = AttnParams { n_heads: 4, n_kv_heads: 2, head_dim: 8, scale: 0.35, window: Some(3), softcap: None };
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
                    attention(
                        &p,
                        &q[s * qd..e * qd],
                        &k[s * kd..e * kd],
                        &v[s * kd..e * kd],
                        &cache,
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
}
