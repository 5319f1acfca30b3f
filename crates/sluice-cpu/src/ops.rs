//! Element-wise and row-wise kernels: norms, activations, RoPE, softmax, top-k.

use sluice_core::{Activation, RopeSpec, RopeStyle};

/// RMS-normalises each `group`-long slice of `x` in place (a whole row, or one head),
/// then multiplies by `weight + offset` when a weight is given.
///
/// The mean of squares is summed in f64: for these lengths that costs nothing and
/// leaves the rounding to the one final f32 multiply.
pub fn rms_norm(x: &mut [f32], group: usize, weight: Option<&[f32]>, offset: f32, eps: f32) {
    debug_assert_eq!(x.len() % group, 0);
    for g in x.chunks_mut(group) {
        let ss: f64 = g.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let inv = ((ss / group as f64) as f32 + eps).powf(-0.5);
        match weight {
            Some(w) => g.iter_mut().zip(w).for_each(|(v, &w)| *v = (*v * inv) * (w + offset)),
            None => g.iter_mut().for_each(|v| *v *= inv),
        }
    }
}

#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn activate(act: Activation, x: f32) -> f32 {
    match act {
        Activation::Silu => silu(x),
        Activation::GeluTanh => gelu_tanh(x),
    }
}

/// `gate = act(gate) * up`, the gated-linear-unit middle of an MLP.
pub fn glu(act: Activation, gate: &mut [f32], up: &[f32]) {
    gate.iter_mut().zip(up).for_each(|(g, &u)| *g = activate(act, *g) * u);
}

/// In-place softmax, max-subtracted.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `cap * tanh(x / cap)`.
pub fn softcap(x: &mut [f32], cap: f32) {
    x.iter_mut().for_each(|v| *v = (*v / cap).tanh() * cap);
}

/// Indices of the `k` largest values, largest first; ties go to the lower index (as
/// `torch.topk` does on CPU for distinct values).
pub fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Applies rotary embeddings to `x`, `n` rows of whole heads, row `i` at position
/// `start + i`. Angles are `pos * inv_freq` in f32, as `transformers` computes them;
/// pairs with a zero frequency are left as they are.
pub fn rope(x: &mut [f32], n: usize, head_dim: usize, start: usize, spec: &RopeSpec) {
    let half = head_dim / 2;
    let row = x.len() / n.max(1);
    let pairs = spec.inv_freq.iter().rposition(|&f| f != 0.0).map_or(0, |p| p + 1);
    let mut cs = vec![(0f32, 0f32); pairs];
    for (i, r) in x.chunks_mut(row).enumerate() {
        let pos = (start + i) as f32;
        for (c, &f) in cs.iter_mut().zip(&spec.inv_freq) {
            let a = pos * f;
            *c = (a.cos() * spec.attention_factor, a.sin() * spec.attention_factor);
        }
        for h in r.chunks_mut(head_dim) {
            for (p, &(cos, sin)) in cs.iter().enumerate() {
                let (a, b) = match spec.style {
                    RopeStyle::Half => (p, p + half),
                    RopeStyle::Interleaved => (2 * p, 2 * p + 1),
                };
                let (x1, x2) = (h[a], h[b]);
                h[a] = x1 * cos - x2 * sin;
                h[b] = x2 * cos + x1 * sin;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::RopeScaling;

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() {
        let spec = RopeSpec::new(RopeStyle::Half, 10000.0, 8, 8, &RopeScaling::None);
        let mut x: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 + 0.3).collect();
        let before: f32 = x.iter().map(|v| v * v).sum();
        rope(&mut x, 1, 8, 5, &spec);
        let after: f32 = x.iter().map(|v| v * v).sum();
        assert!((before - after).abs() < 1e-4);
        // Position 0 is the identity.
        let mut y = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        rope(&mut y, 1, 8, 0, &spec);
        assert_eq!(y, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        // First pair at position 1 rotates by exactly 1 radian.
        let mut z = vec![1.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        rope(&mut z, 1, 8, 1, &spec);
        assert!((z[0] - 1f32.cos()).abs() < 1e-6 && (z[4] - 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn rms_norm_unit_rms() {
        let mut x = vec![3.0f32, -4.0, 0.0, 5.0];
        rms_norm(&mut x, 4, None, 0.0, 0.0);
        let ms: f32 = x.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-6);
    }

    #[test]
    fn top_k_order() {
        assert_eq!(top_k(&[0.1, 0.5, 0.3, 0.5], 3), vec![1, 3, 2]);
    }
}
