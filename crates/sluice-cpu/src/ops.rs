//! Element-wise and row-wise kernels: norms, activations, RoPE, softmax, top-k.

use sluice_core::{Activation, Glu, RopeSpec};

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

/// e^x in f32 with a relative error of a few ulp, without branches or calls, so
/// that loops over slices vectorise (libm's expf and tanhf are scalar calls and cost
/// a quarter of a small model's prefill). x is clamped to [-87, 88].
#[inline(always)]
pub fn exp_fast(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // x = n ln2 + r, |r| <= ln2 / 2, with ln2 split in two for an exact r.
    // Rounded to nearest (ties to even) by adding and removing 1.5 * 2^23: plain
    // arithmetic, where `round` is a libm call on baseline x86-64 (no SSE4.1) and
    // kept the loops around it scalar.
    const MAGIC: f32 = 12_582_912.0;
    let n = (x * std::f32::consts::LOG2_E + MAGIC) - MAGIC;
    let r = (x - n * 0.693_145_75) - n * 1.428_606_8e-6;
    // e^r by its Taylor series to degree 7 (error < 2e-8 on the interval).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // Safety: n is a whole number in [-126, 127] (x was clamped).
    let n = unsafe { n.to_int_unchecked::<i32>() };
    f32::from_bits(((n + 127) << 23) as u32) * p
}

/// tanh(x) = 1 - 2 / (e^{2x} + 1).
#[inline(always)]
pub fn tanh_fast(x: f32) -> f32 {
    1.0 - 2.0 / (exp_fast(2.0 * x) + 1.0)
}

#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + tanh_fast(C * (x + 0.044715 * x * x * x)))
}

#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp_fast(-x))
}

#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_fast(-x))
}

#[inline(always)]
pub fn activate(act: Activation, x: f32) -> f32 {
    match act {
        Activation::Silu => silu(x),
        Activation::GeluTanh => gelu_tanh(x),
        Activation::Sigmoid => sigmoid(x),
    }
}

/// Applies `act` to every element.
pub fn activate_slice(act: Activation, x: &mut [f32]) {
    match act {
        Activation::Silu => x.iter_mut().for_each(|v| *v = silu(*v)),
        Activation::GeluTanh => x.iter_mut().for_each(|v| *v = gelu_tanh(*v)),
        Activation::Sigmoid => x.iter_mut().for_each(|v| *v = sigmoid(*v)),
    }
}

/// `gate = act(gate) * up`, the gated-linear-unit middle of an MLP.
pub fn glu(act: Activation, gate: &mut [f32], up: &[f32]) {
    match act {
        Activation::Silu => gate.iter_mut().zip(up).for_each(|(g, &u)| *g = silu(*g) * u),
        Activation::GeluTanh => gate.iter_mut().zip(up).for_each(|(g, &u)| *g = gelu_tanh(*g) * u),
        Activation::Sigmoid => gate.iter_mut().zip(up).for_each(|(g, &u)| *g = sigmoid(*g) * u),
    }
}

/// In-place softmax, max-subtracted.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = exp_fast(*v - max);
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// The softmax of `x` with one more logit, `sink`, whose share is left out: each
/// `exp(x_i)` over `exp(sink) + sum exp(x)`, the sink's column dropped after.
pub fn softmax_with_sink(x: &mut [f32], sink: f32) {
    let max = x.iter().copied().fold(sink, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = exp_fast(*v - max);
        sum += *v;
    }
    sum += exp_fast(sink - max);
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `cap * tanh(x / cap)`.
pub fn softcap(x: &mut [f32], cap: f32) {
    x.iter_mut().for_each(|v| *v = tanh_fast(*v / cap) * cap);
}

/// Indices of the `k` largest values, largest first; ties go to the lower index (as
/// `torch.topk` does on CPU for distinct values).
pub fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Applies rotary embeddings to `x`, rows of whole heads, row `i` at position
/// `positions[i]`. Angles are `pos * inv_freq` in f32, as `transformers` computes
/// them; pairs with a zero frequency are left as they are.
pub fn rope(x: &mut [f32], head_dim: usize, positions: &[usize], spec: &RopeSpec) {
    let n = positions.len();
    if n == 0 {
        return;
    }
    let row = x.len() / n;
    debug_assert_eq!(row * n, x.len());
    let pairs = spec.inv_freq.iter().rposition(|&f| f != 0.0).map_or(0, |p| p + 1);
    let mut cs = vec![(0f32, 0f32); pairs];
    for (r, &pos) in x.chunks_mut(row).zip(positions) {
        let pos = pos as f32;
        for (c, &f) in cs.iter_mut().zip(&spec.inv_freq) {
            let a = pos * f;
            *c = (a.cos() * spec.attention_factor, a.sin() * spec.attention_factor);
        }
        for h in r.chunks_mut(head_dim) {
            for (p, &(cos, sin)) in cs.iter().enumerate() {
                let (a, b) = spec.style.pair(p, head_dim);
                let (x1, x2) = (h[a], h[b]);
                h[a] = x1 * cos - x2 * sin;
                h[b] = x2 * cos + x1 * sin;
            }
        }
    }
}

/// `gate = f(gate) * up` for any [`Glu`].
pub fn glu_any(glu: Glu, gate: &mut [f32], up: &[f32]) {
    match glu {
        Glu::Gated(act) => self::glu(act, gate, up),
        Glu::ClampedSwiglu { alpha, limit } => gate.iter_mut().zip(up).for_each(|(g, &u)| {
            let x = g.min(limit);
            let u = u.clamp(-limit, limit);
            *g = x / (1.0 + exp_fast(-alpha * x)) * (u + 1.0);
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::{RopeScaling, RopeStyle};

    #[test]
    fn fast_exp_and_activations_are_accurate() {
        let mut worst = 0f64;
        for i in -8700..=8800 {
            let x = i as f32 * 0.01;
            let want = (x as f64).exp();
            worst = worst.max(((exp_fast(x) as f64 - want) / want).abs());
        }
        assert!(worst < 5e-7, "exp relative error {worst}");
        for i in -2000..=2000 {
            let x = i as f32 * 0.01;
            let g = 0.5 * x as f64 * (1.0 + (0.7978845608 * (x as f64 + 0.044715 * (x as f64).powi(3))).tanh());
            assert!((gelu_tanh(x) as f64 - g).abs() < 2e-6 * (1.0 + g.abs()), "gelu({x})");
            let si = x as f64 / (1.0 + (-(x as f64)).exp());
            assert!((silu(x) as f64 - si).abs() < 2e-6 * (1.0 + si.abs()), "silu({x})");
        }
        assert_eq!(tanh_fast(100.0), 1.0);
        assert_eq!(tanh_fast(-100.0), -1.0);
    }

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() {
        let spec = RopeSpec::new(RopeStyle::Half, 10000.0, 8, 8, &RopeScaling::None);
        let mut x: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 + 0.3).collect();
        let before: f32 = x.iter().map(|v| v * v).sum();
        rope(&mut x, 8, &[5, 6], &spec);
        let after: f32 = x.iter().map(|v| v * v).sum();
        assert!((before - after).abs() < 1e-4);
        // Position 0 is the identity.
        let mut y = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        rope(&mut y, 8, &[0], &spec);
        assert_eq!(y, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        // First pair at position 1 rotates by exactly 1 radian.
        let mut z = vec![1.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        rope(&mut z, 8, &[1], &spec);
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
