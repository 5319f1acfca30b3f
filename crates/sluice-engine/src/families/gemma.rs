//! Gemma 3 and Gemma 4 text: the Gemma 4 26B-A4B MoE, the dense E2B/E4B, and Gemma 3,
//! which is the same layer without experts, per-layer embeddings or v norm.
//!
//! Per layer:
//!   x += post_attn_norm(attention(attn_norm(x)))
//!   f  = mlp(ffn_norm(x))
//!   MoE layers: f = post_norm_1(f) + post_norm_2(experts(pre_norm_2(x)));
//!               the router reads x itself (weightless norm, * scale * hidden^-0.5)
//!   x += post_ffn_norm(f)
//!   PLE:        x += ple_post_norm(ple_proj(act(ple_gate(x)) * per_layer_input[layer]))
//!   x *= layer_scalar
//! Gemma 4 attention: q/k norms with weights, a weightless v norm, scale 1, sliding layers
//! on a window with default RoPE, full layers with proportional RoPE and their own
//! head dim and KV heads; k_eq_v full layers take V from the k projection; the last
//! layers may read an earlier layer's cache (KV sharing). Logits are soft-capped.
//! Gemma 3 norms multiply by 1 + w (`norm_weight_offset`) and attention scales by
//! query_pre_attn_scalar^-0.5; both come from the spec.

use sluice_core::{ModelSpec, Result};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use super::Network;
use crate::backend::{Backend, Routing};
use crate::blocks::{Attention, Mlp, RouterParams, Step, check_tokens, experts, load_mat, load_vector, route};

struct Moe<B: Backend> {
    router: B::Mat,
    router_scale: B::Vector,
    /// Kept on the host: it scales the routing weights, which live there.
    expert_scale: Vec<f32>,
    bias: Option<Vec<f32>>,
    n_experts: usize,
    top_k: usize,
    post_norm_1: B::Vector,
    pre_norm_2: B::Vector,
    post_norm_2: B::Vector,
}

struct LayerPle<B: Backend> {
    gate: B::Mat,
    proj: B::Mat,
    post_norm: B::Vector,
}

struct Layer<B: Backend> {
    attn_norm: B::Vector,
    attn: Attention<B>,
    attn_post_norm: B::Vector,
    ffn_norm: B::Vector,
    mlp: Mlp<B>,
    ffn_post_norm: B::Vector,
    moe: Option<Moe<B>>,
    ple: Option<LayerPle<B>>,
    layer_scalar: f32,
}

/// Model-level per-layer-embedding weights.
struct Ple<B: Backend> {
    embed: B::Mat,
    model_proj: B::Mat,
    proj_norm: B::Vector,
    dim: usize,
}

pub struct Gemma<B: Backend> {
    spec: ModelSpec,
    embed: B::Mat,
    output: B::Mat,
    final_norm: B::Vector,
    ple: Option<Ple<B>>,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> Gemma<B> {
    pub fn load(be: &B, ckpt: &Checkpoint) -> Result<Self> {
        let spec = ckpt.spec.clone();
        let h = spec.hidden_size;
        let n_layers = spec.n_layers();
        let model = TensorId::model;
        let embed = load_mat(be, ckpt, model(TensorKind::TokenEmbd), spec.vocab_size, h)?;
        let output = if spec.tie_word_embeddings {
            load_mat(be, ckpt, model(TensorKind::TokenEmbd), spec.vocab_size, h)?
        } else {
            load_mat(be, ckpt, model(TensorKind::Output), spec.vocab_size, h)?
        };
        let ple = match &spec.ple {
            Some(p) => Some(Ple {
                embed: load_mat(be, ckpt, model(TensorKind::PleTokenEmbd), p.vocab_size, n_layers * p.dim)?,
                model_proj: load_mat(be, ckpt, model(TensorKind::PleModelProj), n_layers * p.dim, h)?,
                proj_norm: load_vector(be, ckpt, model(TensorKind::PleProjNorm), p.dim)?,
                dim: p.dim,
            }),
            None => None,
        };
        let mut layers = Vec::with_capacity(n_layers);
        for (i, ls) in spec.layers.iter().enumerate() {
            let id = |k| TensorId::layer(i, k);
            let norm = |k| load_vector(be, ckpt, id(k), h);
            let moe = match &ls.moe {
                Some(m) => Some(Moe {
                    router: load_mat(be, ckpt, id(TensorKind::Router), m.n_experts, h)?,
                    router_scale: norm(TensorKind::RouterScale)?,
                    expert_scale: ckpt.tensor(id(TensorKind::RouterExpertScale), &[m.n_experts])?.to_f32_vec()?,
                    bias: ckpt
                        .optional(id(TensorKind::RouterBias), &[m.n_experts])?
                        .map(|t| t.to_f32_vec())
                        .transpose()?,
                    n_experts: m.n_experts,
                    top_k: m.top_k,
                    post_norm_1: norm(TensorKind::FfnPostNorm1)?,
                    pre_norm_2: norm(TensorKind::FfnPreNorm2)?,
                    post_norm_2: norm(TensorKind::FfnPostNorm2)?,
                }),
                None => None,
            };
            let ple_l = match &spec.ple {
                Some(p) => Some(LayerPle {
                    gate: load_mat(be, ckpt, id(TensorKind::PleGate), p.dim, h)?,
                    proj: load_mat(be, ckpt, id(TensorKind::PleProj), h, p.dim)?,
                    post_norm: norm(TensorKind::PlePostNorm)?,
                }),
                None => None,
            };
            let layer_scalar = match ckpt.optional(id(TensorKind::LayerScalar), &[1])? {
                Some(t) => t.to_f32_vec()?[0],
                None => 1.0,
            };
            let inter = ls.mlp.expect("every Gemma 4 layer has a dense MLP");
            layers.push(Layer {
                attn_norm: norm(TensorKind::AttnNorm)?,
                attn: Attention::load(be, ckpt, i, &ls.attention, h)?,
                attn_post_norm: norm(TensorKind::AttnPostNorm)?,
                ffn_norm: norm(TensorKind::FfnNorm)?,
                mlp: Mlp::load(be, ckpt, i, h, inter)?,
                ffn_post_norm: norm(TensorKind::FfnPostNorm)?,
                moe,
                ple: ple_l,
                layer_scalar,
            });
        }
        Ok(Gemma {
            final_norm: load_vector(be, ckpt, model(TensorKind::OutputNorm), h)?,
            spec,
            embed,
            output,
            ple,
            layers,
        })
    }

    /// The per-layer inputs `[n, n_layers * dim]`: the token's own per-layer
    /// embedding and a projection of its main embedding, normed, averaged.
    fn per_layer_inputs(&self, step: &mut Step<'_, B>, p: &Ple<B>, tokens: &[u32], x: &B::Act) -> B::Act {
        let be = step.be;
        let tok = be.embed(&p.embed, tokens, (p.dim as f32).sqrt());
        let mut proj = be.matmul(x, &p.model_proj);
        be.scale(&mut proj, (self.spec.hidden_size as f32).powf(-0.5));
        be.rms_norm(&mut proj, p.dim, Some(&p.proj_norm), step.norm_offset, step.eps);
        be.add(&mut proj, &tok);
        be.scale(&mut proj, std::f32::consts::FRAC_1_SQRT_2);
        proj
    }
}

impl<B: Backend> Gemma<B> {
    /// The router reads the residual itself: weightless norm, times its scale and
    /// hidden^-0.5, softmax, top-k, renormalised, times the per-expert scale.
    fn route(&self, step: &mut Step<'_, B>, m: &Moe<B>, x: &B::Act) -> Routing {
        let be = step.be;
        let h = self.spec.hidden_size;
        let eps = step.eps;
        step.timers.time(
            |t| &mut t.router,
            || {
                let mut r = be.copy(x);
                be.rms_norm(&mut r, h, None, 0.0, eps);
                be.mul_row(&mut r, &m.router_scale);
                be.scale(&mut r, (h as f32).powf(-0.5));
                let logits = be.to_host(&be.matmul(&r, &m.router));
                let params = RouterParams {
                    n_experts: m.n_experts,
                    top_k: m.top_k,
                    renormalize: true,
                    bias: m.bias.as_deref(),
                    expert_scale: Some(&m.expert_scale),
                };
                route(&logits, &params)
            },
        )
    }
}

impl<B: Backend> Network<B> for Gemma<B> {
    fn forward(&self, step: &mut Step<'_, B>, tokens: &[u32]) -> Result<B::Act> {
        let be = step.be;
        let h = self.spec.hidden_size;
        let act = self.spec.activation;
        if let Some(p) = &self.spec.ple {
            check_tokens(tokens, p.vocab_size)?;
        }
        let mut x = step.timers.time(|t| &mut t.embed, || be.embed(&self.embed, tokens, self.spec.embed_scale));
        let ple_inputs = match &self.ple {
            Some(p) => Some(self.per_layer_inputs(step, p, tokens, &x)),
            None => None,
        };
        for (i, l) in self.layers.iter().enumerate() {
            let mut a = be.copy(&x);
            step.norm(&mut a, &l.attn_norm, h);
            let mut a = l.attn.forward(step, &a);
            step.norm(&mut a, &l.attn_post_norm, h);
            be.add(&mut x, &a);

            // Pilot: the next layer's router on this layer's residual, to read its
            // experts while this layer computes.
            if step.piloting()
                && let Some(next) = self.layers.get(i + 1).and_then(|n| n.moe.as_ref())
            {
                let r = self.route(step, next, &x);
                step.prefetch(i + 1, &r);
            }

            let mut f = be.copy(&x);
            step.norm(&mut f, &l.ffn_norm, h);
            let mut f = l.mlp.forward(step, &f, act);
            if let Some(m) = &l.moe {
                step.norm(&mut f, &m.post_norm_1, h);
                let routing = self.route(step, m, &x);
                step.observe(i, &routing);
                let mut e = be.copy(&x);
                step.norm(&mut e, &m.pre_norm_2, h);
                let mut e = experts(step, i, &e, &routing, act)?;
                step.norm(&mut e, &m.post_norm_2, h);
                be.add(&mut f, &e);
            }
            step.norm(&mut f, &l.ffn_post_norm, h);
            be.add(&mut x, &f);

            if let (Some(lp), Some(inputs), Some(p)) = (&l.ple, &ple_inputs, &self.ple) {
                let mut g = be.matmul(&x, &lp.gate);
                be.activate(&mut g, act);
                be.mul(&mut g, &be.columns(inputs, i * p.dim, p.dim));
                let mut y = be.matmul(&g, &lp.proj);
                step.norm(&mut y, &lp.post_norm, h);
                be.add(&mut x, &y);
            }
            if l.layer_scalar != 1.0 {
                be.scale(&mut x, l.layer_scalar);
            }
        }
        step.norm(&mut x, &self.final_norm, h);
        Ok(x)
    }

    fn lm_head(&self) -> &B::Mat {
        &self.output
    }
}
