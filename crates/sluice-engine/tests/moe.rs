//! The expert product's options, which the families sluice runs today do not use yet
//! (gpt-oss's per-expert biases and clamped SwiGLU), against a float64 evaluation of
//! the same formula over the same weights.

use std::path::Path;

use sluice_core::Glu;
use sluice_engine::Backend;
use sluice_engine::backend::{Cpu, ExpertBias, ExpertFfn, HostAct, HostRouting};
use sluice_experts::ExpertStore;
use sluice_formats::Checkpoint;

fn floats(m: sluice_core::MatRef<'_>) -> Vec<f64> {
    m.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect()
}

/// `W x` for a row-major `[rows, cols]` W.
fn mv(w: &[f64], cols: usize, x: &[f64]) -> Vec<f64> {
    w.chunks(cols).map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

#[test]
fn biases_and_clamped_swiglu() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny/qwen3-moe");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let store = ExpertStore::open_mapped(&ckpt).unwrap();
    let (layer, n_experts, hidden, inter) = (2, 8, 64, 32);
    let be = Cpu::default();
    let val = |i: usize, s: f32| ((i * 7919 % 211) as f32 / 211.0 - 0.5) * s;
    let x = HostAct { rows: 3, cols: hidden, data: (0..3 * hidden).map(|i| val(i, 40.0)).collect() };
    let routing = HostRouting { top_k: 2, ids: vec![1, 5, 5, 0, 7, 2], weights: vec![0.7, 0.3, 0.6, 0.4, 0.9, 0.1] };
    let bias = ExpertBias {
        gate: (0..n_experts * inter).map(|i| val(i + 1, 2.0)).collect(),
        up: (0..n_experts * inter).map(|i| val(i + 2, 2.0)).collect(),
        down: (0..n_experts * hidden).map(|i| val(i + 3, 2.0)).collect(),
    };
    let (alpha, limit) = (1.702f32, 7.0f32);
    let ffn = ExpertFfn { glu: Glu::ClampedSwiglu { alpha, limit }, bias: Some(bias) };
    let ids: Vec<usize> = vec![0, 1, 2, 5, 7];
    let experts = be.fetch_experts(&store, layer, &ids).unwrap();
    let got = be.moe(&x, &routing, &experts, &ffn).unwrap();

    let lease = store.fetch(layer, &ids).unwrap();
    let b = ffn.bias.as_ref().unwrap();
    let mut clamped = 0;
    for r in 0..3 {
        let xr: Vec<f64> = x.row(r).iter().map(|&v| v as f64).collect();
        let mut want = vec![0f64; hidden];
        for k in 0..2 {
            let (e, w) = (routing.ids[r * 2 + k] as usize, routing.weights[r * 2 + k] as f64);
            let m = lease.get(e);
            let g = mv(&floats(m.gate), hidden, &xr);
            let u = mv(&floats(m.up), hidden, &xr);
            let mid: Vec<f64> = (0..inter)
                .map(|i| {
                    let g = g[i] + b.gate[e * inter + i] as f64;
                    let u = u[i] + b.up[e * inter + i] as f64;
                    clamped += (g > limit as f64 || u.abs() > limit as f64) as usize;
                    let (g, u) = (g.min(limit as f64), u.clamp(-limit as f64, limit as f64));
                    g / (1.0 + (-(alpha as f64) * g).exp()) * (u + 1.0)
                })
                .collect();
            let d = mv(&floats(m.down), inter, &mid);
            for (o, (dv, bd)) in want.iter_mut().zip(d.iter().zip(&b.down[e * hidden..(e + 1) * hidden])) {
                *o += w * (dv + *bd as f64);
            }
        }
        let max = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (i, (&a, &w)) in got.row(r).iter().zip(&want).enumerate() {
            assert!((a as f64 - w).abs() <= 1e-4 * max, "row {r} col {i}: {a} vs {w}");
        }
    }
    assert!(clamped > 0, "the inputs must reach the clamp for the test to mean anything");
}
