//! Blocks the families share: attention, the gated MLP, routers and the routed
//! experts. Each is written once against [`Backend`].

use sluice_core::{Activation, AttentionSpec, Error, Result};
use sluice_experts::ExpertStore;
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use crate::backend::{Backend, Routing};
use crate::stats::Timers;

/// What one forward step carries through the layers.
pub struct Step<'a, B: Backend> {
    pub be: &'a B,
    /// Each layer's cache as it was before this step (`None` for layers that read
    /// another layer's).
    pub caches: &'a [Option<B::Kv>],
    /// This step's keys and values per layer, appended to the caches after the last
    /// layer has run.
    pub pending: Vec<Option<(B::Act, B::Act)>>,
    pub store: &'a ExpertStore,
    pub timers: &'a mut Timers,
    pub eps: f32,
    pub norm_offset: f32,
    /// Next-layer router probes (`--prefetch pilot`), when on for this step.
    pub pilot: Option<&'a mut Pilot>,
}

impl<B: Backend> Step<'_, B> {
    /// RMS norm over whole rows, with a weight.
    pub fn norm(&self, x: &mut B::Act, w: &B::Vector, width: usize) {
        self.be.rms_norm(x, width, Some(w), self.norm_offset, self.eps);
    }

    /// Whether this step probes the next layer's router.
    pub fn piloting(&self) -> bool {
        self.pilot.is_some()
    }

    /// Starts reading the experts a pilot probe predicts for `layer`.
    pub fn prefetch(&mut self, layer: usize, predicted: &Routing) {
        let ids = predicted.unique();
        self.store.prefetch(layer, &ids);
        if let Some(p) = self.pilot.as_deref_mut() {
            p.stats.probes += 1;
            p.stats.predicted += ids.len() as u64;
            p.predicted[layer] = Some(ids);
        }
    }

    /// Scores the pilot's prediction for `layer` against the experts it really routed to.
    pub fn observe(&mut self, layer: usize, routing: &Routing) {
        if let Some(p) = self.pilot.as_deref_mut()
            && let Some(pred) = p.predicted[layer].take()
        {
            let actual = routing.unique();
            p.stats.chosen += actual.len() as u64;
            p.stats.recalled += actual.iter().filter(|e| pred.contains(e)).count() as u64;
        }
    }
}

/// Next-layer router probes: while layer l runs, layer l+1's router is applied to
/// the residual after layer l's attention, and the experts it picks are read ahead.
#[derive(Debug, Default)]
pub struct Pilot {
    predicted: Vec<Option<Vec<usize>>>,
    pub stats: PilotStats,
}

impl Pilot {
    pub fn new(n_layers: usize) -> Self {
        Pilot { predicted: vec![None; n_layers], stats: PilotStats::default() }
    }
}

#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct PilotStats {
    /// Probes run (one per MoE layer per decode step).
    pub probes: u64,
    /// Experts the probes predicted, and how many experts the routers really chose.
    pub predicted: u64,
    pub chosen: u64,
    /// Chosen experts that had been predicted.
    pub recalled: u64,
}

impl PilotStats {
    /// Predicted among the chosen.
    pub fn recall(&self) -> Option<f64> {
        (self.chosen > 0).then(|| self.recalled as f64 / self.chosen as f64)
    }
}

/// Loads a norm weight `[n]`.
pub fn load_vector<B: Backend>(be: &B, ckpt: &Checkpoint, id: TensorId, n: usize) -> Result<B::Vector> {
    be.vector(&ckpt.tensor(id, &[n])?)
}

/// Loads a matrix `[rows, cols]`.
pub fn load_mat<B: Backend>(be: &B, ckpt: &Checkpoint, id: TensorId, rows: usize, cols: usize) -> Result<B::Mat> {
    be.mat(&ckpt.tensor(id, &[rows, cols])?)
}

pub struct Attention<B: Backend> {
    layer: usize,
    spec: AttentionSpec,
    q: B::Mat,
    /// `None` on layers that read another layer's cache.
    k: Option<B::Mat>,
    /// `None` on those and on k_eq_v layers.
    v: Option<B::Mat>,
    o: B::Mat,
    biases: Option<[B::Vector; 3]>,
    q_norm: Option<B::Vector>,
    k_norm: Option<B::Vector>,
}

impl<B: Backend> Attention<B> {
    pub fn load(be: &B, ckpt: &Checkpoint, layer: usize, spec: &AttentionSpec, hidden: usize) -> Result<Self> {
        let id = |k| TensorId::layer(layer, k);
        let (qd, kvd, hd) = (spec.q_dim(), spec.kv_dim(), spec.head_dim);
        let own_kv = spec.kv_source.is_none();
        let biases = if spec.qkv_bias {
            Some([
                load_vector(be, ckpt, id(TensorKind::AttnQBias), qd)?,
                load_vector(be, ckpt, id(TensorKind::AttnKBias), kvd)?,
                load_vector(be, ckpt, id(TensorKind::AttnVBias), kvd)?,
            ])
        } else {
            None
        };
        Ok(Attention {
            layer,
            spec: spec.clone(),
            q: load_mat(be, ckpt, id(TensorKind::AttnQ), qd, hidden)?,
            k: own_kv.then(|| load_mat(be, ckpt, id(TensorKind::AttnK), kvd, hidden)).transpose()?,
            v: (own_kv && !spec.k_eq_v).then(|| load_mat(be, ckpt, id(TensorKind::AttnV), kvd, hidden)).transpose()?,
            o: load_mat(be, ckpt, id(TensorKind::AttnOut), hidden, qd)?,
            biases,
            q_norm: spec.qk_norm.then(|| load_vector(be, ckpt, id(TensorKind::AttnQNorm), hd)).transpose()?,
            k_norm: (spec.qk_norm && own_kv)
                .then(|| load_vector(be, ckpt, id(TensorKind::AttnKNorm), hd))
                .transpose()?,
        })
    }

    /// `h` is the normed input `[n, hidden]`; returns the o-projection's output.
    pub fn forward(&self, step: &mut Step<'_, B>, h: &B::Act) -> B::Act {
        let be = step.be;
        let s = &self.spec;
        let hd = s.head_dim;
        let src = s.kv_source.unwrap_or(self.layer);
        let start = step.caches[src].as_ref().map_or(0, |c| be.kv_len(c));
        // The projections of `h` in one job: q, and k and v where this layer has them.
        let ws: Vec<&B::Mat> =
            [Some(&self.q), self.k.as_ref(), self.k.as_ref().and(self.v.as_ref())].into_iter().flatten().collect();
        let mut proj = be.matmul_many(h, &ws).into_iter();
        let mut q = proj.next().expect("q");
        if let Some(b) = &self.biases {
            be.add_row(&mut q, &b[0]);
        }
        if let Some(w) = &self.q_norm {
            be.rms_norm(&mut q, hd, Some(w), step.norm_offset, step.eps);
        }
        be.rope(&mut q, hd, start, &s.rope);

        if self.k.is_some() {
            let mut k = proj.next().expect("k");
            if let Some(b) = &self.biases {
                be.add_row(&mut k, &b[1]);
            }
            // k_eq_v: V is the k projection before k norm and RoPE.
            let mut v = match proj.next() {
                Some(mut v) => {
                    if let Some(b) = &self.biases {
                        be.add_row(&mut v, &b[2]);
                    }
                    v
                }
                None => be.copy(&k),
            };
            if let Some(w) = &self.k_norm {
                be.rms_norm(&mut k, hd, Some(w), step.norm_offset, step.eps);
            }
            if s.v_norm {
                be.rms_norm(&mut v, hd, None, 0.0, step.eps);
            }
            be.rope(&mut k, hd, start, &s.rope);
            step.pending[self.layer] = Some((k, v));
        }
        let (k, v) = step.pending[src].as_ref().expect("a KV-sharing layer runs after the layer it reads");
        let cache = step.caches[src].as_ref().expect("the source layer has a cache");
        let a = step.timers.time(|t| &mut t.attention, || be.attention(s, &q, k, v, cache));
        be.matmul(&a, &self.o)
    }
}

/// `down(act(gate(h)) * up(h))`.
pub struct Mlp<B: Backend> {
    gate: B::Mat,
    up: B::Mat,
    down: B::Mat,
}

impl<B: Backend> Mlp<B> {
    pub fn load(be: &B, ckpt: &Checkpoint, layer: usize, hidden: usize, inter: usize) -> Result<Self> {
        let id = |k| TensorId::layer(layer, k);
        Ok(Mlp {
            gate: load_mat(be, ckpt, id(TensorKind::FfnGate), inter, hidden)?,
            up: load_mat(be, ckpt, id(TensorKind::FfnUp), inter, hidden)?,
            down: load_mat(be, ckpt, id(TensorKind::FfnDown), hidden, inter)?,
        })
    }

    pub fn forward(&self, step: &mut Step<'_, B>, h: &B::Act, act: Activation) -> B::Act {
        let be = step.be;
        step.timers.time(
            |t| &mut t.mlp,
            || {
                let mut gu = be.matmul_many(h, &[&self.gate, &self.up]).into_iter();
                let (mut g, u) = (gu.next().expect("gate"), gu.next().expect("up"));
                be.glu(&mut g, &u, act);
                be.matmul(&g, &self.down)
            },
        )
    }
}

/// What turns router logits into a routing.
pub struct RouterParams<'a> {
    pub n_experts: usize,
    pub top_k: usize,
    /// Renormalise the top-k probabilities to sum to one.
    pub renormalize: bool,
    /// Added to the logits before the softmax.
    pub bias: Option<&'a [f32]>,
    /// Multiplies each chosen expert's weight (Gemma 4).
    pub expert_scale: Option<&'a [f32]>,
}

/// softmax over the router logits of each token (plus an optional bias), top-k,
/// optionally renormalised, optionally times a per-expert scale.
pub fn route(logits: &[f32], p: &RouterParams<'_>) -> Routing {
    let (n_experts, top_k) = (p.n_experts, p.top_k);
    let n = logits.len() / n_experts;
    let mut r = Routing { top_k, ids: Vec::with_capacity(n * top_k), weights: Vec::with_capacity(n * top_k) };
    for row in logits.chunks(n_experts) {
        let mut prob = row.to_vec();
        if let Some(b) = p.bias {
            prob.iter_mut().zip(b).for_each(|(l, b)| *l += b);
        }
        sluice_cpu::ops::softmax(&mut prob);
        let ids = sluice_cpu::ops::top_k(&prob, top_k);
        let sum: f32 = ids.iter().map(|&i| prob[i]).sum();
        for &i in &ids {
            let mut w = if p.renormalize { prob[i] / sum } else { prob[i] };
            if let Some(s) = p.expert_scale {
                w *= s[i];
            }
            r.ids.push(i);
            r.weights.push(w);
        }
    }
    r
}

/// Runs the routed experts of `layer` on `x` through the expert store.
pub fn experts<B: Backend>(
    step: &mut Step<'_, B>,
    layer: usize,
    x: &B::Act,
    routing: &Routing,
    act: Activation,
) -> Result<B::Act> {
    let store = step.store;
    let lease = step.timers.time(|t| &mut t.expert_wait, || store.fetch(layer, &routing.unique()))?;
    let be = step.be;
    Ok(step.timers.time(|t| &mut t.expert_compute, || be.experts(x, routing, &lease, act)))
}

/// Checks token ids against a vocabulary before any lookup.
pub fn check_tokens(tokens: &[u32], vocab: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(&t) => Err(Error::TokenOutOfRange { id: t as u64, vocab_size: vocab }),
        None => Ok(()),
    }
}
