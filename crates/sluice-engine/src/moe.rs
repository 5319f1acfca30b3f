//! The routed experts of a layer, one block for every family: the router (its input,
//! its kind, its biases and scales), the expert store's fetch for the union of the
//! batch's choices, and the grouped expert products.

use std::time::Instant;

use sluice_core::{Result, RouterKind};
use sluice_experts::ExpertStore;
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use crate::backend::{Backend, ExpertBias, ExpertFfn, RouterOp};
use crate::blocks::{Cx, load_mat};

/// What a router reads: a transform of the residual stream.
pub enum RouterInput<B: Backend> {
    /// The residual RMS-normed with this weight: the layer's FFN norm (Llama, Qwen,
    /// gpt-oss, DeepSeek), so the experts' input itself, which [`Moe::forward`] routes
    /// on; the weight serves the pilot's probe, which routes a residual.
    Norm(B::Vector),
    /// Gemma 4: the residual RMS-normed without a weight, times a learned `scale`,
    /// times `factor` (hidden^-0.5).
    ScaledNorm { scale: B::Vector, factor: f32 },
    /// The input as it comes (Qwen4-Exp: the hyper-connection's mix, already normed).
    Plain,
}

/// A layer's routed experts.
pub struct Moe<B: Backend> {
    layer: usize,
    hidden: usize,
    router: B::Mat,
    input: RouterInput<B>,
    op: RouterOp<B>,
    ffn: ExpertFfn<B>,
}

impl<B: Backend> Moe<B> {
    /// Loads layer `layer`'s router; the experts stay with the expert store.
    pub fn load(be: &B, ckpt: &Checkpoint, layer: usize, input: RouterInput<B>) -> Result<Self> {
        let spec = &ckpt.spec;
        let m = spec.layers[layer].moe.as_ref().expect("a MoE layer");
        let id = |k| TensorId::layer(layer, k);
        let vector = |k| -> Result<Option<B::Vector>> {
            ckpt.optional(id(k), &[m.n_experts])?.map(|t| be.vector(&t)).transpose()
        };
        let expert_scale = match m.router {
            RouterKind::Gemma4 => Some(be.vector(&ckpt.tensor(id(TensorKind::RouterExpertScale), &[m.n_experts])?)?),
            _ => None,
        };
        Ok(Moe {
            layer,
            hidden: spec.hidden_size,
            router: load_mat(be, ckpt, id(TensorKind::Router), m.n_experts, spec.hidden_size)?,
            input,
            op: RouterOp {
                kind: m.router,
                n_experts: m.n_experts,
                top_k: m.top_k,
                logit_bias: vector(TensorKind::RouterBias)?,
                choice_bias: vector(TensorKind::RouterChoiceBias)?,
                expert_scale,
            },
            ffn: ExpertFfn { glu: m.glu, bias: if m.expert_bias { Some(expert_bias(be, ckpt, layer)?) } else { None } },
        })
    }

    /// Routes rows by `logits` (rows x experts), fetches their experts from `store` and
    /// runs them on `h`, without a sequence's context: the planner times a layer's
    /// experts with it (the router's product is timed with the other dense products).
    pub fn experts_by(&self, be: &B, store: &ExpertStore, logits: &B::Act, h: &B::Act) -> Result<B::Act> {
        let routing = be.route(logits, &self.op)?;
        let f = be.fetch_routed(store, self.layer, &routing)?;
        be.experts_ready(&f)?;
        be.moe(h, &routing, &f, &self.ffn)
    }

    /// Routes every row of the residual `x`.
    pub fn route(&self, cx: &mut Cx<'_, B>, x: &B::Act) -> Result<B::Routing> {
        self.route_from(cx, x, None)
    }

    /// [`Moe::route`], given the experts' input `h` where the caller has it: a `Norm`
    /// router reads exactly that (its weight is the experts' norm, on the same
    /// residual), so it is not normed a second time.
    fn route_from(&self, cx: &mut Cx<'_, B>, x: &B::Act, h: Option<&B::Act>) -> Result<B::Routing> {
        let be = cx.be;
        let made;
        let r = match (&self.input, h) {
            (RouterInput::Norm(_), Some(h)) => h,
            (RouterInput::Plain, _) => x,
            (RouterInput::Norm(w), None) => {
                made = cx.normed(x, w, self.hidden)?;
                &made
            }
            (RouterInput::ScaledNorm { scale, factor }, _) => {
                let mut r = be.normed(x, &cx.plain(self.hidden))?;
                be.mul_row(&mut r, scale)?;
                be.scale(&mut r, *factor)?;
                made = r;
                &made
            }
        };
        cx.timers.time(|t| &mut t.router, || be.route(&be.matmul(r, &self.router)?, &self.op))
    }

    /// The experts' weighted sum for every row: the router reads the residual `x`,
    /// the experts take `h`. The experts are fetched once for the union of the
    /// batch's choices.
    pub fn forward(&self, cx: &mut Cx<'_, B>, x: &B::Act, h: &B::Act) -> Result<B::Act> {
        let routing = self.route_from(cx, x, Some(h))?;
        let probe = cx.probe_route(self.layer, x)?;
        if cx.pilot.is_some() {
            let chosen = unique(&cx.be.routing_ids(&routing)?);
            cx.observe(self.layer, &chosen);
        }
        let (be, store, layer) = (cx.be, cx.store, self.layer);
        sluice_experts::trace(|| format!("fetch L{layer}"));
        let t = Instant::now();
        let f = match be.fetch_routed(store, layer, &routing) {
            Ok(f) => f,
            Err(e) => {
                cx.affected = self.affected_by_failure(cx, &routing);
                return Err(e);
            }
        };
        let fetched = t.elapsed();
        // The probe's picks are read now, beside this layer's own (a device has just
        // waited for those): read after the products, they would wait for them.
        let mut picks = probe.map(|p| be.routing_ids(&p)).transpose()?;
        // The next layer's read-ahead starts once this layer's own reads have. When
        // this layer needs more experts than its cache holds (a prompt chunk), the
        // rest are read as the products give slots back and keep the disk busy until
        // the products end; the read-ahead then waits for them, and reads while the
        // next layer's attention computes instead of taking the disk from them. A
        // device that copies this layer's misses in `moe` likewise puts them first.
        if !be.experts_queued(&f) {
            cx.probe_read(layer, picks.take())?;
        }
        let t = Instant::now();
        let out = be.moe(h, &routing, &f, &self.ffn);
        // The products ran as the experts arrived: what they waited for is expert
        // wait, the rest computation.
        let waited = be.experts_waited(&f);
        cx.timers.expert_wait += fetched + waited;
        cx.timers.expert_compute += t.elapsed().saturating_sub(waited);
        drop(f);
        match out {
            Ok(out) => {
                // Not yet read when this layer's experts were queued (see above).
                cx.probe_read(layer, picks)?;
                Ok(out)
            }
            Err(e) => {
                cx.affected = self.affected_by_failure(cx, &routing);
                Err(e)
            }
        }
    }

    /// After the experts failed: the sequences whose own experts cannot be fetched
    /// (each tried alone, so a read that fails again names who needs it). Empty if
    /// every one succeeds on its own (the failure was passing); the step is then
    /// retried.
    fn affected_by_failure(&self, cx: &Cx<'_, B>, routing: &B::Routing) -> Option<Vec<usize>> {
        let k = self.op.top_k;
        let ids = cx.be.routing_ids(routing).ok()?;
        let affected = cx
            .batch
            .seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                let own = unique(&ids[s.first * k..(s.first + s.rows) * k]);
                cx.be.fetch_experts(cx.store, self.layer, &own).and_then(|f| cx.be.experts_ready(&f)).is_err()
            })
            .map(|(i, _)| i)
            .collect();
        Some(affected)
    }
}

/// Layer `layer`'s per-expert biases, `[E, I]` for gate and up, `[E, H]` for down.
fn expert_bias<B: Backend>(be: &B, ckpt: &Checkpoint, layer: usize) -> Result<ExpertBias<B>> {
    let m = ckpt.spec.layers[layer].moe.as_ref().expect("a MoE layer");
    let (e, i, h) = (m.n_experts, m.intermediate, ckpt.spec.hidden_size);
    let load = |k, w| be.vector(&ckpt.tensor(TensorId::layer(layer, k), &[e, w])?);
    Ok(ExpertBias {
        gate: load(TensorKind::ExpsGateBias, i)?,
        up: load(TensorKind::ExpsUpBias, i)?,
        down: load(TensorKind::ExpsDownBias, h)?,
    })
}

/// The distinct experts in `ids`, ascending.
pub fn unique(ids: &[u32]) -> Vec<usize> {
    let mut u: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
    u.sort_unstable();
    u.dedup();
    u
}
