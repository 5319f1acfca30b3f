//! Gated DeltaNet (Qwen3.5's linear attention), one sequence at a time, as
//! transformers' recurrent form computes it.
//!
//! A sequence's state is the convolution's last `kernel - 1` inputs followed by one
//! `[k_dim, v_dim]` matrix per value head (`DeltaNetSpec::state_len` floats). Each
//! token:
//!
//!   c        = silu(causal depthwise conv of the q, k, v channels)
//!   q, k     = l2-normed per key head (eps 1e-6), q times k_dim^-1/2
//!   beta     = sigmoid(b),  g = a_neg * softplus(a + dt_bias)   (per value head)
//!   S       *= exp(g)
//!   S       += k ⊗ (beta (v - Sᵀk))
//!   out      = Sᵀq
//!
//! The chunked form transformers uses for prompts gives the same values in exact
//! arithmetic (it regroups the same sums); this is the order a decode step takes.

use sluice_core::DeltaNetSpec;

use crate::ops::{sigmoid, silu};

/// A layer's weights that are not matrices.
pub struct DeltaWeights<'a> {
    /// `[conv_dim, kernel]`.
    pub conv: &'a [f32],
    /// `-exp(A_log)`, `[v_heads]`.
    pub a_neg: &'a [f32],
    pub dt_bias: &'a [f32],
}

/// One sequence's `n` new rows: the q/k/v projections before the convolution
/// (`[n, conv_dim]`) and the pre-activations of beta and the decay (`[n, v_heads]`).
pub struct DeltaRows<'a> {
    pub mixed: &'a [f32],
    pub b: &'a [f32],
    pub a: &'a [f32],
}

/// torch's softplus: `ln(1 + e^x)`, `x` itself above 20.
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// `x / sqrt(sum x² + 1e-6)`.
fn l2norm(x: &mut [f32]) {
    let s: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (s + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Runs `rows` through the layer's convolution and recurrence from `state`, which
/// ends holding the state after them; writes `[n, v_heads * v_dim]` to `out`.
pub fn gated_delta_net(
    spec: &DeltaNetSpec,
    w: &DeltaWeights<'_>,
    rows: &DeltaRows<'_>,
    state: &mut [f32],
    out: &mut [f32],
) {
    let (hk, hv, dk, dv, kern) = (spec.k_heads, spec.v_heads, spec.k_dim, spec.v_dim, spec.conv_kernel);
    let c = spec.conv_dim();
    let n = rows.mixed.len() / c;
    assert_eq!(state.len(), spec.state_len(), "delta net: state of the wrong size");
    assert!(rows.b.len() == n * hv && rows.a.len() == n * hv && out.len() == n * hv * dv, "delta net: row shapes");
    let (conv_state, mats) = state.split_at_mut((kern - 1) * c);

    // The convolution over the previous inputs and these: window[i] is input i - (kernel - 1).
    let mut window = Vec::with_capacity((kern - 1 + n) * c);
    window.extend_from_slice(conv_state);
    window.extend_from_slice(rows.mixed);
    let mut conv = vec![0f32; n * c];
    for t in 0..n {
        for ch in 0..c {
            let taps = &w.conv[ch * kern..(ch + 1) * kern];
            let acc: f32 = taps.iter().enumerate().map(|(j, &tap)| tap * window[(t + j) * c + ch]).sum();
            conv[t * c + ch] = silu(acc);
        }
    }
    conv_state.copy_from_slice(&window[n * c..]);

    let scale = (dk as f32).powf(-0.5);
    let (mut q, mut k) = (vec![0f32; hk * dk], vec![0f32; hk * dk]);
    let mut kv = vec![0f32; dv];
    for t in 0..n {
        let row = &conv[t * c..(t + 1) * c];
        q.copy_from_slice(&row[..hk * dk]);
        k.copy_from_slice(&row[hk * dk..2 * hk * dk]);
        for h in 0..hk {
            l2norm(&mut q[h * dk..(h + 1) * dk]);
            l2norm(&mut k[h * dk..(h + 1) * dk]);
        }
        q.iter_mut().for_each(|x| *x *= scale);
        for j in 0..hv {
            let kh = spec.k_head(j);
            let (qh, kh) = (&q[kh * dk..(kh + 1) * dk], &k[kh * dk..(kh + 1) * dk]);
            let v = &row[2 * hk * dk + j * dv..2 * hk * dk + (j + 1) * dv];
            let beta = sigmoid(rows.b[t * hv + j]);
            let decay = (w.a_neg[j] * softplus(rows.a[t * hv + j] + w.dt_bias[j])).exp();
            let s = &mut mats[j * dk * dv..(j + 1) * dk * dv];
            s.iter_mut().for_each(|x| *x *= decay);
            kv.fill(0.0);
            for (i, &ki) in kh.iter().enumerate() {
                kv.iter_mut().zip(&s[i * dv..(i + 1) * dv]).for_each(|(a, &x)| *a += ki * x);
            }
            // kv becomes delta = beta (v - Sᵀk).
            kv.iter_mut().zip(v).for_each(|(d, &ve)| *d = (ve - *d) * beta);
            for (i, &ki) in kh.iter().enumerate() {
                s[i * dv..(i + 1) * dv].iter_mut().zip(&kv).for_each(|(x, &d)| *x += ki * d);
            }
            let o = &mut out[(t * hv + j) * dv..(t * hv + j + 1) * dv];
            o.fill(0.0);
            for (i, &qi) in qh.iter().enumerate() {
                o.iter_mut().zip(&s[i * dv..(i + 1) * dv]).for_each(|(a, &x)| *a += qi * x);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::HeadOrder;

    /// Two calls (a prompt, then a token) leave the state and the outputs of one call
    /// over all the rows: the convolution's tail and the matrices carry over.
    #[test]
    fn split_rows_continue_as_one_run() {
        let spec = DeltaNetSpec {
            k_heads: 2,
            v_heads: 4,
            k_dim: 4,
            v_dim: 3,
            conv_kernel: 4,
            v_order: HeadOrder::Grouped,
            gate: sluice_core::Activation::Silu,
        };
        let c = spec.conv_dim();
        let f =
            |n: usize, s: usize| -> Vec<f32> { (0..n).map(|i| (((i + s) * 7919 % 97) as f32 - 48.0) / 30.0).collect() };
        let (conv, a_neg, dt) = (f(c * 4, 1), vec![-1.0, -0.5, -2.0, -0.1], f(4, 3));
        let w = DeltaWeights { conv: &conv, a_neg: &a_neg, dt_bias: &dt };
        let n = 6;
        let (mixed, b, a) = (f(n * c, 5), f(n * 4, 7), f(n * 4, 11));
        let mut whole_state = vec![0f32; spec.state_len()];
        let mut whole = vec![0f32; n * 12];
        gated_delta_net(&spec, &w, &DeltaRows { mixed: &mixed, b: &b, a: &a }, &mut whole_state, &mut whole);
        let mut state = vec![0f32; spec.state_len()];
        let mut parts = vec![0f32; n * 12];
        for (lo, hi) in [(0, 5), (5, 6)] {
            let rows = DeltaRows { mixed: &mixed[lo * c..hi * c], b: &b[lo * 4..hi * 4], a: &a[lo * 4..hi * 4] };
            gated_delta_net(&spec, &w, &rows, &mut state, &mut parts[lo * 12..hi * 12]);
        }
        assert_eq!(parts, whole);
        assert_eq!(state, whole_state);
        assert!(whole.iter().any(|&x| x.abs() > 1e-3), "the output is not all zeros");
    }
}
