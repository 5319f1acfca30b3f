//! Attention's products over one tile of the KV cache: many queries' scores against a
//! tile's keys, and the weighted sum of its values into each query's accumulator.
//!
//! A query's score against a key is one chain of fused multiply-adds over the head's
//! channels in order, and its value sum one chain per channel over the positions in
//! order. Every ISA computes exactly these chains (a fused multiply-add rounds once
//! everywhere), so the bits depend on neither the ISA nor which other queries share
//! the call: the queries are the vector lanes of the scores ([`Lanes`], eight to a
//! vector), so that a tile's keys are read once for all of a task's queries and never
//! transposed, and the channels are the lanes of the value sums.

use std::ops::Range;

use crate::isa::{Isa, isa};
use crate::ops::exp_fast;

/// Queries per vector of scores.
pub const LANES: usize = 8;

/// Queries laid out for [`scores`]: for each group of [`LANES`] queries, channel by
/// channel, the group's values side by side (`[groups][head_dim][LANES]`, the last
/// group padded with zeros).
pub struct Lanes {
    data: Vec<[f32; LANES]>,
    head_dim: usize,
    queries: usize,
}

impl Lanes {
    /// `q` is `[n][head_dim]`.
    pub fn new(q: &[f32], head_dim: usize) -> Lanes {
        let queries = q.len() / head_dim;
        let mut data = vec![[0f32; LANES]; queries.div_ceil(LANES) * head_dim];
        for (i, row) in q.chunks_exact(head_dim).enumerate() {
            let group = &mut data[i / LANES * head_dim..][..head_dim];
            for (d, &x) in row.iter().enumerate() {
                group[d][i % LANES] = x;
            }
        }
        Lanes { data, head_dim, queries }
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The queries given, before padding.
    pub fn queries(&self) -> usize {
        self.queries
    }

    /// Queries rounded up to whole groups: the row length of [`scores`]' output.
    pub fn width(&self) -> usize {
        self.data.len() / self.head_dim * LANES
    }

    /// Group `g`'s queries, `[head_dim][LANES]`.
    pub(crate) fn group(&self, g: usize) -> &[[f32; LANES]] {
        &self.data[g * self.head_dim..][..self.head_dim]
    }
}

/// For each key `t` of `keys` (`[n][head_dim]`) in `rows`, every query's score:
/// `out[t * q.width() + i] = sum over d of keys[t][d] * q_i[d]`, one fused chain over
/// `d` from zero.
pub fn scores(q: &Lanes, keys: &[f32], rows: Range<usize>, out: &mut [f32]) {
    assert!(keys.len() >= rows.end * q.head_dim && out.len() >= rows.end * q.width(), "scores: short tile");
    // SAFETY: `isa()` checked that the CPU has the features these functions enable.
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { scores_avx512(q, keys, rows, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { scores_avx2(q, keys, rows, out) },
        _ => scores_any(q, keys, rows, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn scores_avx512(q: &Lanes, keys: &[f32], rows: Range<usize>, out: &mut [f32]) {
    scores_any(q, keys, rows, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2(q: &Lanes, keys: &[f32], rows: Range<usize>, out: &mut [f32]) {
    scores_any(q, keys, rows, out)
}

#[inline(always)]
fn scores_any(q: &Lanes, keys: &[f32], rows: Range<usize>, out: &mut [f32]) {
    let mut t = rows.start;
    // One group (a decode step's few queries): eight keys at a time, so that the
    // chains in flight still fill the multipliers.
    if q.width() == LANES {
        while t + 8 <= rows.end {
            score_block::<8, 1>(q, keys, t, 0, out);
            t += 8;
        }
    }
    while t < rows.end {
        match rows.end - t {
            1 => score_keys::<1>(q, keys, t, out),
            2 => score_keys::<2>(q, keys, t, out),
            3 => score_keys::<3>(q, keys, t, out),
            _ => score_keys::<4>(q, keys, t, out),
        }
        t += 4;
    }
}

/// Keys `t..t + K` against every group, two groups at a time: `2 K` vectors of
/// chains in flight.
#[inline(always)]
fn score_keys<const K: usize>(q: &Lanes, keys: &[f32], t: usize, out: &mut [f32]) {
    let groups = q.width() / LANES;
    let mut g = 0;
    while g + 2 <= groups {
        score_block::<K, 2>(q, keys, t, g, out);
        g += 2;
    }
    if g < groups {
        score_block::<K, 1>(q, keys, t, g, out);
    }
}

#[inline(always)]
fn score_block<const K: usize, const G: usize>(q: &Lanes, keys: &[f32], t: usize, g: usize, out: &mut [f32]) {
    let hd = q.head_dim;
    let key: [&[f32]; K] = std::array::from_fn(|k| &keys[(t + k) * hd..][..hd]);
    let group: [&[[f32; LANES]]; G] = std::array::from_fn(|j| q.group(g + j));
    let mut acc = [[[0f32; LANES]; G]; K];
    for d in 0..hd {
        for k in 0..K {
            // Safety: every key and group was cut to `hd` entries above.
            let x = unsafe { *key[k].get_unchecked(d) };
            for j in 0..G {
                let qv = unsafe { group[j].get_unchecked(d) };
                for l in 0..LANES {
                    acc[k][j][l] = x.mul_add(qv[l], acc[k][j][l]);
                }
            }
        }
    }
    let width = q.width();
    for (k, a) in acc.iter().enumerate() {
        for (j, v) in a.iter().enumerate() {
            out[(t + k) * width + (g + j) * LANES..][..LANES].copy_from_slice(v);
        }
    }
}

/// `acc[i] += sum over r of w[r * stride + i] * rows[r]` for each of the
/// `acc.len() / head_dim` queries, one fused chain per channel over `r` in order.
pub fn values(acc: &mut [f32], head_dim: usize, (w, stride): (&[f32], usize), rows: &[&[f32]]) {
    let m = acc.len() / head_dim;
    assert!(rows.iter().all(|r| r.len() >= head_dim), "values: a row is shorter than the head");
    assert!(rows.is_empty() || m == 0 || w.len() >= (rows.len() - 1) * stride + m, "values: short weights");
    // SAFETY: `isa()` checked that the CPU has the features these functions enable.
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { values_avx512(acc, head_dim, (w, stride), rows) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { values_avx2(acc, head_dim, (w, stride), rows) },
        _ => values_any::<16, 4>(acc, head_dim, (w, stride), rows),
    }
}

/// Four queries, 64 channels at a time: sixteen vectors of sums in the 32 registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn values_avx512(acc: &mut [f32], hd: usize, w: (&[f32], usize), rows: &[&[f32]]) {
    values_any::<64, 4>(acc, hd, w, rows)
}

/// Two queries, 32 channels at a time: eight vectors of sums in the 16 registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn values_avx2(acc: &mut [f32], hd: usize, w: (&[f32], usize), rows: &[&[f32]]) {
    values_any::<32, 2>(acc, hd, w, rows)
}

/// Up to `M` queries at a time, `C` channels at a time, then sixteen, then one.
#[inline(always)]
fn values_any<const C: usize, const M: usize>(acc: &mut [f32], hd: usize, w: (&[f32], usize), rows: &[&[f32]]) {
    let m = acc.len() / hd;
    let mut i = 0;
    while i < m {
        let take = (m - i).min(M);
        let (a, w) = (&mut acc[i * hd..(i + take) * hd], (&w.0[i..], w.1));
        match take {
            1 => value_columns::<C, 1>(a, hd, w, rows),
            2 => value_columns::<C, 2>(a, hd, w, rows),
            3 => value_columns::<C, 3>(a, hd, w, rows),
            _ => value_columns::<C, 4>(a, hd, w, rows),
        }
        i += take;
    }
}

#[inline(always)]
fn value_columns<const C: usize, const M: usize>(acc: &mut [f32], hd: usize, w: (&[f32], usize), rows: &[&[f32]]) {
    let mut c = 0;
    while c + C <= hd {
        value_block::<M, C>(acc, hd, c, w, rows);
        c += C;
    }
    while c + 16 <= hd {
        value_block::<M, 16>(acc, hd, c, w, rows);
        c += 16;
    }
    while c < hd {
        value_block::<M, 1>(acc, hd, c, w, rows);
        c += 1;
    }
}

#[inline(always)]
fn value_block<const M: usize, const C: usize>(
    acc: &mut [f32],
    hd: usize,
    c: usize,
    (w, stride): (&[f32], usize),
    rows: &[&[f32]],
) {
    let mut a: [[f32; C]; M] = std::array::from_fn(|i| acc[i * hd + c..][..C].try_into().unwrap());
    for (r, row) in rows.iter().enumerate() {
        // Safety: `values` checked that every row holds `hd >= c + C` floats and that
        // `w` reaches `r * stride + M - 1` for every row.
        let v = unsafe { &*(row.as_ptr().add(c) as *const [f32; C]) };
        for (i, a) in a.iter_mut().enumerate() {
            let p = unsafe { *w.get_unchecked(r * stride + i) };
            for x in 0..C {
                a[x] = p.mul_add(v[x], a[x]);
            }
        }
    }
    for (i, a) in a.iter().enumerate() {
        acc[i * hd + c..][..C].copy_from_slice(a);
    }
}

/// Folds a tile into running softmaxes, [`LANES`] queries at a time: `w` holds each
/// query's scaled scores over the tile's `len` positions (`[len][queries]`, queries as
/// many as `max` holds), and query `i` reads positions `spans[i]`. Each query's sum
/// `sum[i]` and sums of values (`acc`, `head_dim` apart) are rescaled to its new
/// maximum `max[i]`, and its weights replace its scores (zero where it reads nothing),
/// ready for [`values`]. A query's bits depend only on the scores it reads: the maximum
/// is exact, and the sum adds the weights in order of position (and zeros, which
/// change nothing).
pub fn fold(
    w: &mut [f32],
    len: usize,
    spans: &[Range<usize>],
    (max, sum): (&mut [f32], &mut [f32]),
    (acc, head_dim): (&mut [f32], usize),
) {
    let width = max.len();
    assert!(
        width.is_multiple_of(LANES) && sum.len() == width && spans.len() == width && w.len() >= len * width,
        "fold: {width} queries, {} spans, {} weights for {len} positions",
        spans.len(),
        w.len()
    );
    // SAFETY: `isa()` checked that the CPU has the features these functions enable.
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { fold_avx512(w, len, spans, (max, sum), (acc, head_dim)) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { fold_avx2(w, len, spans, (max, sum), (acc, head_dim)) },
        _ => fold_any(w, len, spans, (max, sum), (acc, head_dim)),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn fold_avx512(
    w: &mut [f32],
    len: usize,
    spans: &[Range<usize>],
    state: (&mut [f32], &mut [f32]),
    acc: (&mut [f32], usize),
) {
    fold_any(w, len, spans, state, acc)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fold_avx2(
    w: &mut [f32],
    len: usize,
    spans: &[Range<usize>],
    state: (&mut [f32], &mut [f32]),
    acc: (&mut [f32], usize),
) {
    fold_any(w, len, spans, state, acc)
}

#[inline(always)]
fn fold_any(
    w: &mut [f32],
    len: usize,
    spans: &[Range<usize>],
    (max, sum): (&mut [f32], &mut [f32]),
    (acc, hd): (&mut [f32], usize),
) {
    let width = max.len();
    for l0 in (0..width).step_by(LANES) {
        let lo: [u32; LANES] = std::array::from_fn(|l| spans[l0 + l].start as u32);
        // A position `r` is read by lane `l` when `r - lo` (wrapping) is below the span's
        // length: one unsigned comparison, which the loops below take eight lanes at a
        // time (two, joined by `&&`, kept them scalar).
        let span: [u32; LANES] = std::array::from_fn(|l| spans[l0 + l].len() as u32);
        let mut m: [f32; LANES] = max[l0..l0 + LANES].try_into().unwrap();
        for r in 0..len {
            let row: &[f32; LANES] = w[r * width + l0..][..LANES].try_into().unwrap();
            for l in 0..LANES {
                let seen = (r as u32).wrapping_sub(lo[l]) < span[l];
                let x = if seen { row[l] } else { f32::NEG_INFINITY };
                // (a comparison, not `f32::max`, whose NaN rule kept this loop scalar;
                // scores are never NaN, and the maximum is the same)
                m[l] = if x > m[l] { x } else { m[l] };
            }
        }
        for (l, &m) in m.iter().enumerate() {
            let q = l0 + l;
            if m > max[q] {
                // Earlier weights were relative to a smaller maximum.
                let shrink = exp_fast(max[q] - m);
                sum[q] *= shrink;
                acc[q * hd..][..hd].iter_mut().for_each(|a| *a *= shrink);
                max[q] = m;
            }
        }
        let mut s: [f32; LANES] = sum[l0..l0 + LANES].try_into().unwrap();
        for r in 0..len {
            let row: &mut [f32; LANES] = (&mut w[r * width + l0..][..LANES]).try_into().unwrap();
            for l in 0..LANES {
                let seen = (r as u32).wrapping_sub(lo[l]) < span[l];
                let e = exp_fast(row[l] - m[l]);
                row[l] = if seen { e } else { 0.0 };
                s[l] += row[l];
            }
        }
        sum[l0..l0 + LANES].copy_from_slice(&s);
    }
}
