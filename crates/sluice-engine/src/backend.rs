//! The backend interface the families are written against, and the CPU backend.
//!
//! A family says what a layer computes in these operations and nothing else: no
//! SIMD, no threads, no I/O. A backend owns where activations, weights and KV
//! caches live (host memory here; device memory for a GPU backend) and how each
//! operation runs. Small results that steer control flow (router logits) come back
//! to the host through [`Backend::to_host`].

use sluice_core::{Activation, AttentionSpec, MatRef, Precision, Result, RopeSpec};
use sluice_cpu::{AttnParams, KvCache};
use sluice_experts::ExpertLease;
use sluice_formats::TensorView;

/// Which experts each token goes to, and with what weight.
#[derive(Clone, Debug, Default)]
pub struct Routing {
    pub top_k: usize,
    /// `[n_tokens * top_k]` expert ids, each token's in router order.
    pub ids: Vec<usize>,
    /// `[n_tokens * top_k]` combine weights.
    pub weights: Vec<f32>,
}

impl Routing {
    /// The distinct experts used, ascending.
    pub fn unique(&self) -> Vec<usize> {
        let mut u = self.ids.clone();
        u.sort_unstable();
        u.dedup();
        u
    }
}

pub trait Backend: Send + Sync + Sized {
    /// A `[rows, cols]` f32 activation.
    type Act: Send + Sync;
    /// A weight matrix `[out, in]` in its stored format.
    type Mat: Send + Sync;
    /// A small f32 parameter vector (norm weights, scales).
    type Vector: Send + Sync;
    /// One layer's KV cache.
    type Kv: Send + Sync;

    fn name(&self) -> &'static str;
    /// The same backend computing matrix products at precision `p` (each forward step
    /// picks one, see [`crate::Model::precision`]).
    fn with_precision(&self, p: Precision) -> Self;

    fn mat(&self, t: &TensorView) -> Result<Self::Mat>;
    fn vector(&self, t: &TensorView) -> Result<Self::Vector>;

    /// Rows `tokens` of an embedding table, times `scale`.
    fn embed(&self, table: &Self::Mat, tokens: &[u32], scale: f32) -> Self::Act;
    /// `x · Wᵀ`.
    fn matmul(&self, x: &Self::Act, w: &Self::Mat) -> Self::Act;
    /// `x · W_iᵀ` for each of `ws`, matrices that share the input (q, k and v; gate
    /// and up): a backend may run them as one job.
    fn matmul_many(&self, x: &Self::Act, ws: &[&Self::Mat]) -> Vec<Self::Act> {
        ws.iter().map(|w| self.matmul(x, w)).collect()
    }
    /// RMS norm of each `group` columns of each row, times `w + offset` if given.
    fn rms_norm(&self, x: &mut Self::Act, group: usize, w: Option<&Self::Vector>, offset: f32, eps: f32);
    fn add(&self, x: &mut Self::Act, y: &Self::Act);
    fn mul(&self, x: &mut Self::Act, y: &Self::Act);
    fn scale(&self, x: &mut Self::Act, s: f32);
    /// Multiplies every row by `v` element-wise.
    fn mul_row(&self, x: &mut Self::Act, v: &Self::Vector);
    /// Adds `v` to every row (a bias).
    fn add_row(&self, x: &mut Self::Act, v: &Self::Vector);
    fn copy(&self, x: &Self::Act) -> Self::Act;
    /// Row `i` alone.
    fn row(&self, x: &Self::Act, i: usize) -> Self::Act;
    /// Columns `start..start + len` of every row.
    fn columns(&self, x: &Self::Act, start: usize, len: usize) -> Self::Act;
    fn activate(&self, x: &mut Self::Act, act: Activation);
    /// `gate = act(gate) * up`.
    fn glu(&self, gate: &mut Self::Act, up: &Self::Act, act: Activation);
    fn softcap(&self, x: &mut Self::Act, cap: f32);
    /// RoPE on whole heads; row `i` is at position `start + i`.
    fn rope(&self, x: &mut Self::Act, head_dim: usize, start: usize, rope: &RopeSpec);

    fn kv_new(&self, kv_dim: usize, window: Option<usize>) -> Self::Kv;
    fn kv_len(&self, kv: &Self::Kv) -> usize;
    fn kv_bytes(&self, kv: &Self::Kv) -> usize;
    fn kv_append(&self, kv: &mut Self::Kv, k: &Self::Act, v: &Self::Act);
    /// Causal attention of `q` over the cache plus this chunk's `k` and `v`.
    fn attention(&self, spec: &AttentionSpec, q: &Self::Act, k: &Self::Act, v: &Self::Act, kv: &Self::Kv) -> Self::Act;

    /// The routed experts: `sum_k weight[t, k] * expert_k(x[t])` for every token.
    fn experts(&self, x: &Self::Act, routing: &Routing, experts: &ExpertLease<'_>, act: Activation) -> Self::Act;

    fn to_host(&self, x: &Self::Act) -> Vec<f32>;
    fn rows(&self, x: &Self::Act) -> usize;
}

/// A row-major `[rows, cols]` f32 matrix in host memory.
#[derive(Clone, Debug)]
pub struct HostAct {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl HostAct {
    pub fn zeros(rows: usize, cols: usize) -> Self {
        HostAct { rows, cols, data: vec![0.0; rows * cols] }
    }
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
}

/// The CPU backend: activations in host memory, weights used in place in the
/// mapped files, kernels from `sluice-cpu`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu {
    precision: Precision,
}

impl Cpu {
    fn matmul_host(&self, w: MatRef<'_>, x: &HostAct) -> HostAct {
        let mut out = HostAct::zeros(x.rows, w.rows);
        sluice_cpu::matmul(w, &x.data, x.rows, &mut out.data, self.precision);
        out
    }

    fn matmul_many_host(&self, ws: &[MatRef<'_>], x: &HostAct) -> Vec<HostAct> {
        let mut outs: Vec<HostAct> = ws.iter().map(|w| HostAct::zeros(x.rows, w.rows)).collect();
        let mut bufs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.data.as_mut_slice()).collect();
        sluice_cpu::matmul_many(ws, &x.data, x.rows, &mut bufs, self.precision);
        outs
    }
}

impl Backend for Cpu {
    type Act = HostAct;
    type Mat = TensorView;
    type Vector = Vec<f32>;
    type Kv = KvCache;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn with_precision(&self, precision: Precision) -> Cpu {
        Cpu { precision }
    }

    fn mat(&self, t: &TensorView) -> Result<TensorView> {
        Ok(t.clone())
    }

    fn vector(&self, t: &TensorView) -> Result<Vec<f32>> {
        t.to_f32_vec()
    }

    fn embed(&self, table: &TensorView, tokens: &[u32], scale: f32) -> HostAct {
        let m = table.mat();
        let mut out = HostAct::zeros(tokens.len(), m.cols);
        for (i, &t) in tokens.iter().enumerate() {
            let o = &mut out.data[i * m.cols..(i + 1) * m.cols];
            sluice_cpu::row_to_f32(m.dtype, m.row(t as usize), o);
            o.iter_mut().for_each(|v| *v *= scale);
        }
        out
    }

    fn matmul(&self, x: &HostAct, w: &TensorView) -> HostAct {
        self.matmul_host(w.mat(), x)
    }

    fn matmul_many(&self, x: &HostAct, ws: &[&TensorView]) -> Vec<HostAct> {
        self.matmul_many_host(&ws.iter().map(|w| w.mat()).collect::<Vec<_>>(), x)
    }

    fn rms_norm(&self, x: &mut HostAct, group: usize, w: Option<&Vec<f32>>, offset: f32, eps: f32) {
        sluice_cpu::ops::rms_norm(&mut x.data, group, w.map(|v| v.as_slice()), offset, eps);
    }

    fn add(&self, x: &mut HostAct, y: &HostAct) {
        debug_assert_eq!(x.data.len(), y.data.len());
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
    }

    fn mul(&self, x: &mut HostAct, y: &HostAct) {
        debug_assert_eq!(x.data.len(), y.data.len());
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a *= b);
    }

    fn scale(&self, x: &mut HostAct, s: f32) {
        x.data.iter_mut().for_each(|a| *a *= s);
    }

    fn mul_row(&self, x: &mut HostAct, v: &Vec<f32>) {
        for r in x.data.chunks_mut(x.cols) {
            r.iter_mut().zip(v).for_each(|(a, b)| *a *= b);
        }
    }

    fn add_row(&self, x: &mut HostAct, v: &Vec<f32>) {
        for r in x.data.chunks_mut(x.cols) {
            r.iter_mut().zip(v).for_each(|(a, b)| *a += b);
        }
    }

    fn copy(&self, x: &HostAct) -> HostAct {
        x.clone()
    }

    fn row(&self, x: &HostAct, i: usize) -> HostAct {
        HostAct { rows: 1, cols: x.cols, data: x.row(i).to_vec() }
    }

    fn columns(&self, x: &HostAct, start: usize, len: usize) -> HostAct {
        let mut out = HostAct::zeros(x.rows, len);
        for i in 0..x.rows {
            out.data[i * len..(i + 1) * len].copy_from_slice(&x.row(i)[start..start + len]);
        }
        out
    }

    fn activate(&self, x: &mut HostAct, act: Activation) {
        sluice_cpu::ops::activate_slice(act, &mut x.data);
    }

    fn glu(&self, gate: &mut HostAct, up: &HostAct, act: Activation) {
        sluice_cpu::ops::glu(act, &mut gate.data, &up.data);
    }

    fn softcap(&self, x: &mut HostAct, cap: f32) {
        sluice_cpu::ops::softcap(&mut x.data, cap);
    }

    fn rope(&self, x: &mut HostAct, head_dim: usize, start: usize, rope: &RopeSpec) {
        sluice_cpu::ops::rope(&mut x.data, x.rows, head_dim, start, rope);
    }

    fn kv_new(&self, kv_dim: usize, window: Option<usize>) -> KvCache {
        KvCache::new(kv_dim, window)
    }

    fn kv_len(&self, kv: &KvCache) -> usize {
        kv.len()
    }

    fn kv_bytes(&self, kv: &KvCache) -> usize {
        kv.bytes()
    }

    fn kv_append(&self, kv: &mut KvCache, k: &HostAct, v: &HostAct) {
        kv.append(&k.data, &v.data);
    }

    fn attention(&self, spec: &AttentionSpec, q: &HostAct, k: &HostAct, v: &HostAct, kv: &KvCache) -> HostAct {
        let p = AttnParams {
            n_heads: spec.n_heads,
            n_kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
            scale: spec.scale,
            window: spec.window,
            softcap: None,
        };
        let mut out = HostAct::zeros(q.rows, q.cols);
        sluice_cpu::attention(&p, &q.data, &k.data, &v.data, kv, &mut out.data);
        out
    }

    fn experts(&self, x: &HostAct, routing: &Routing, experts: &ExpertLease<'_>, act: Activation) -> HostAct {
        let k = routing.top_k;
        let mut per_slot: Vec<Option<Vec<f32>>> = vec![None; routing.ids.len()];
        for e in routing.unique() {
            // The (token, slot) pairs routed to this expert, gathered into one batch.
            let slots: Vec<usize> = (0..routing.ids.len()).filter(|&s| routing.ids[s] == e).collect();
            let mut xe = HostAct::zeros(slots.len(), x.cols);
            for (r, &s) in slots.iter().enumerate() {
                xe.data[r * x.cols..(r + 1) * x.cols].copy_from_slice(x.row(s / k));
            }
            let m = experts.get(e);
            let [mut g, u]: [HostAct; 2] = self.matmul_many_host(&[m.gate, m.up], &xe).try_into().expect("two outputs");
            sluice_cpu::ops::glu(act, &mut g.data, &u.data);
            let d = self.matmul_host(m.down, &g);
            for (r, &s) in slots.iter().enumerate() {
                per_slot[s] = Some(d.row(r).to_vec());
            }
        }
        // Sum each token's experts in router order, so the result does not depend
        // on which experts other tokens in the batch chose.
        let mut out = HostAct::zeros(x.rows, x.cols);
        let slots = per_slot.chunks(k).zip(routing.weights.chunks(k));
        for (o, (ys, ws)) in out.data.chunks_mut(x.cols).zip(slots) {
            for (y, &w) in ys.iter().zip(ws) {
                let y = y.as_ref().expect("every slot computed");
                o.iter_mut().zip(y).for_each(|(a, b)| *a += w * b);
            }
        }
        out
    }

    fn to_host(&self, x: &HostAct) -> Vec<f32> {
        x.data.clone()
    }

    fn rows(&self, x: &HostAct) -> usize {
        x.rows
    }
}
