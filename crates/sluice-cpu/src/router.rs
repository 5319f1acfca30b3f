//! Routers: each token's router logits to its experts and their combine weights,
//! for every [`RouterKind`].

use sluice_core::RouterKind;

use crate::ops::{softmax, top_k};

/// What turns router logits into a routing.
#[derive(Clone, Copy, Debug)]
pub struct RouteParams<'a> {
    pub kind: RouterKind,
    pub n_experts: usize,
    pub top_k: usize,
    /// Added to the logits before anything else (a router's own bias).
    pub logit_bias: Option<&'a [f32]>,
    /// Added to the scores only to choose experts, not to weigh them (DeepSeek-V3's
    /// correction bias).
    pub choice_bias: Option<&'a [f32]>,
    /// Multiplies each chosen expert's weight (Gemma 4's per-expert scale).
    pub expert_scale: Option<&'a [f32]>,
}

/// Routes every token of `logits` (`[n, n_experts]`): appends `top_k` expert ids and
/// weights per token to `ids` and `weights`, in the order chosen (best first).
pub fn route(logits: &[f32], p: &RouteParams<'_>, ids: &mut Vec<u32>, weights: &mut Vec<f32>) {
    let (e, k) = (p.n_experts, p.top_k);
    assert!(e > 0 && k <= e && logits.len().is_multiple_of(e), "route: logits are not [n, {e}] or top-k {k} > {e}");
    let mut row = vec![0f32; e];
    for l in logits.chunks(e) {
        row.copy_from_slice(l);
        if let Some(b) = p.logit_bias {
            row.iter_mut().zip(b).for_each(|(l, b)| *l += b);
        }
        let start = weights.len();
        match p.kind {
            RouterKind::Softmax { normalize_top_k } => softmax_top_k(&mut row, k, normalize_top_k, ids, weights),
            RouterKind::Gemma4 => softmax_top_k(&mut row, k, true, ids, weights),
            RouterKind::TopKSoftmax => {
                let chosen = top_k(&row, k);
                let mut w: Vec<f32> = chosen.iter().map(|&i| row[i]).collect();
                softmax(&mut w);
                ids.extend(chosen.iter().map(|&i| i as u32));
                weights.extend(w);
            }
            RouterKind::SigmoidGroupLimited { n_groups, topk_groups, normalize_top_k, scaling } => {
                let g = GroupLimit { n_groups, topk_groups, normalize_top_k, scaling };
                sigmoid_group_limited(&mut row, k, &g, p.choice_bias, (ids, weights));
            }
        }
        if let Some(s) = p.expert_scale {
            let chosen = &ids[start..];
            weights[start..].iter_mut().zip(chosen).for_each(|(w, &i)| *w *= s[i as usize]);
        }
    }
}

/// softmax, top-k, optionally renormalised over the k.
fn softmax_top_k(prob: &mut [f32], k: usize, renormalize: bool, ids: &mut Vec<u32>, weights: &mut Vec<f32>) {
    softmax(prob);
    let chosen = top_k(prob, k);
    let sum: f32 = chosen.iter().map(|&i| prob[i]).sum();
    for &i in &chosen {
        ids.push(i as u32);
        weights.push(if renormalize { prob[i] / sum } else { prob[i] });
    }
}

struct GroupLimit {
    n_groups: usize,
    topk_groups: usize,
    normalize_top_k: bool,
    scaling: f32,
}

/// DeepSeek-V3's router, as `transformers` (5.24) computes it: experts outside the
/// chosen groups are masked to minus infinity before the top-k, so a corrected score
/// below zero inside a chosen group still wins over every expert outside.
fn sigmoid_group_limited(
    row: &mut [f32],
    k: usize,
    g: &GroupLimit,
    choice_bias: Option<&[f32]>,
    (ids, weights): (&mut Vec<u32>, &mut Vec<f32>),
) {
    let e = row.len();
    row.iter_mut().for_each(|x| *x = 1.0 / (1.0 + (-*x).exp()));
    let mut choice: Vec<f32> = row.to_vec();
    if let Some(b) = choice_bias {
        choice.iter_mut().zip(b).for_each(|(c, b)| *c += b);
    }
    let n_groups = g.n_groups.max(1);
    let per = e / n_groups;
    if n_groups > 1 && per > 0 {
        let group_scores: Vec<f32> = choice
            .chunks(per)
            .map(|grp| {
                let best = top_k(grp, 2.min(grp.len()));
                best.iter().map(|&i| grp[i]).sum()
            })
            .collect();
        let keep = top_k(&group_scores, g.topk_groups.min(n_groups));
        for (gi, grp) in choice.chunks_mut(per).enumerate() {
            if !keep.contains(&gi) {
                grp.fill(f32::NEG_INFINITY);
            }
        }
    }
    let chosen = top_k(&choice, k);
    let mut w: Vec<f32> = chosen.iter().map(|&i| row[i]).collect();
    if g.normalize_top_k {
        let sum = w.iter().sum::<f32>() + 1e-20;
        w.iter_mut().for_each(|x| *x /= sum);
    }
    ids.extend(chosen.iter().map(|&i| i as u32));
    weights.extend(w.into_iter().map(|x| x * g.scaling));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(kind: RouterKind, logits: &[f32], e: usize, k: usize, choice_bias: Option<&[f32]>) -> (Vec<u32>, Vec<f32>) {
        let p = RouteParams { kind, n_experts: e, top_k: k, logit_bias: None, choice_bias, expert_scale: None };
        let (mut ids, mut w) = (Vec::new(), Vec::new());
        route(logits, &p, &mut ids, &mut w);
        (ids, w)
    }

    fn close(a: &[f32], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((*x as f64 - y).abs() < 1e-6, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn softmax_then_top_k_with_and_without_renormalising() {
        let l = [1.0f32, 3.0, 2.0, 0.0];
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        let p = |i: usize| (l[i] as f64).exp() / z;
        let (ids, w) = run(RouterKind::Softmax { normalize_top_k: false }, &l, 4, 2, None);
        assert_eq!(ids, [1, 2]);
        close(&w, &[p(1), p(2)]);
        let (_, w) = run(RouterKind::Softmax { normalize_top_k: true }, &l, 4, 2, None);
        close(&w, &[p(1) / (p(1) + p(2)), p(2) / (p(1) + p(2))]);
    }

    #[test]
    fn top_k_then_softmax_weighs_only_the_chosen() {
        // Two tokens; the second's best logits are 5 and 4.
        let l = [0.5f32, -1.0, 2.0, 1.0, 4.0, 0.0, 5.0, -3.0];
        let (ids, w) = run(RouterKind::TopKSoftmax, &l, 4, 2, None);
        assert_eq!(ids, [2, 3, 2, 0]);
        let s = |a: f64, b: f64| [a.exp() / (a.exp() + b.exp()), b.exp() / (a.exp() + b.exp())];
        let want: Vec<f64> = s(2.0, 1.0).into_iter().chain(s(5.0, 4.0)).collect();
        close(&w, &want);
    }

    #[test]
    fn sigmoid_group_limited_chooses_within_the_best_groups() {
        // 8 experts in 4 groups of 2; the correction bias favours group 3 for choosing
        // but the weights are the plain sigmoid scores.
        let l = [2.0f32, 1.9, -1.0, -2.0, 0.5, 0.4, -0.5, -0.6];
        let bias = [0.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 1.5, 1.5];
        let sig = |x: f32| 1.0 / (1.0 + (-(x as f64)).exp());
        let kind =
            RouterKind::SigmoidGroupLimited { n_groups: 4, topk_groups: 2, normalize_top_k: false, scaling: 2.5 };
        let (ids, w) = run(kind, &l, 8, 3, Some(&bias));
        // Group scores (sum of the two best choice scores): g0 1.75, g1 0.39, g2 1.22, g3 3.73;
        // groups 3 and 0 are kept, and the top 3 among their experts are 6, 7, 0.
        assert_eq!(ids, [6, 7, 0]);
        close(&w, &[2.5 * sig(-0.5), 2.5 * sig(-0.6), 2.5 * sig(2.0)]);
        let kind = RouterKind::SigmoidGroupLimited { n_groups: 4, topk_groups: 2, normalize_top_k: true, scaling: 2.5 };
        let (_, w) = run(kind, &l, 8, 3, Some(&bias));
        let s = sig(-0.5) + sig(-0.6) + sig(2.0);
        close(&w, &[2.5 * sig(-0.5) / s, 2.5 * sig(-0.6) / s, 2.5 * sig(2.0) / s]);
    }

    #[test]
    fn biases_and_expert_scale() {
        let l = [1.0f32, 0.0, 0.0];
        let bias = [0.0f32, 2.0, 0.0];
        let scale = [1.0f32, 0.5, 3.0];
        let p = RouteParams {
            kind: RouterKind::Gemma4,
            n_experts: 3,
            top_k: 1,
            logit_bias: Some(&bias),
            choice_bias: None,
            expert_scale: Some(&scale),
        };
        let (mut ids, mut w) = (Vec::new(), Vec::new());
        route(&l, &p, &mut ids, &mut w);
        assert_eq!((ids, w), (vec![1], vec![0.5]));
    }
}
