//! Llama-shaped decoders: Llama, Qwen2, Qwen3 and Qwen3-MoE.
//!
//! Pre-norm residual blocks; attention with optional q/k norms (Qwen3) and q/k/v
//! biases (Qwen2); a SwiGLU MLP, or on sparse layers a softmax router over routed
//! experts (Qwen3-MoE).

use sluice_core::{ModelSpec, Result, RouterKind};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use super::Network;
use crate::backend::{Backend, Routing};
use crate::blocks::{Attention, Mlp, RouterParams, Step, experts, load_mat, load_vector, route};

enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    Sparse {
        router: B::Mat,
        /// Kept on the host, where the routing is decided.
        bias: Option<Vec<f32>>,
        n_experts: usize,
        top_k: usize,
        renormalize: bool,
    },
}

struct Layer<B: Backend> {
    attn_norm: B::Vector,
    attn: Attention<B>,
    ffn_norm: B::Vector,
    ffn: Ffn<B>,
}

pub struct Llama<B: Backend> {
    spec: ModelSpec,
    embed: B::Mat,
    output: B::Mat,
    final_norm: B::Vector,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> Llama<B> {
    pub fn load(be: &B, ckpt: &Checkpoint) -> Result<Self> {
        let spec = ckpt.spec.clone();
        let h = spec.hidden_size;
        let embed = load_mat(be, ckpt, TensorId::model(TensorKind::TokenEmbd), spec.vocab_size, h)?;
        let output = if spec.tie_word_embeddings {
            load_mat(be, ckpt, TensorId::model(TensorKind::TokenEmbd), spec.vocab_size, h)?
        } else {
            load_mat(be, ckpt, TensorId::model(TensorKind::Output), spec.vocab_size, h)?
        };
        let layers = spec
            .layers
            .iter()
            .enumerate()
            .map(|(i, ls)| {
                let id = |k| TensorId::layer(i, k);
                let ffn = match (&ls.moe, ls.mlp) {
                    (Some(moe), _) => Ffn::Sparse {
                        router: load_mat(be, ckpt, id(TensorKind::Router), moe.n_experts, h)?,
                        bias: ckpt
                            .optional(id(TensorKind::RouterBias), &[moe.n_experts])?
                            .map(|t| t.to_f32_vec())
                            .transpose()?,
                        n_experts: moe.n_experts,
                        top_k: moe.top_k,
                        renormalize: matches!(moe.router, RouterKind::Softmax { normalize_top_k: true }),
                    },
                    (None, Some(inter)) => Ffn::Dense(Mlp::load(be, ckpt, i, h, inter)?),
                    (None, None) => unreachable!("a llama layer has an MLP or experts"),
                };
                Ok(Layer {
                    attn_norm: load_vector(be, ckpt, id(TensorKind::AttnNorm), h)?,
                    attn: Attention::load(be, ckpt, i, &ls.attention, h)?,
                    ffn_norm: load_vector(be, ckpt, id(TensorKind::FfnNorm), h)?,
                    ffn,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Llama {
            final_norm: load_vector(be, ckpt, TensorId::model(TensorKind::OutputNorm), h)?,
            spec,
            embed,
            output,
            layers,
        })
    }
}

impl<B: Backend> Llama<B> {
    /// Routing of a sparse layer for its normed input.
    fn route(&self, step: &mut Step<'_, B>, layer: usize, h: &B::Act) -> Option<Routing> {
        let Ffn::Sparse { router, bias, n_experts, top_k, renormalize } = &self.layers[layer].ffn else {
            return None;
        };
        let be = step.be;
        let params = RouterParams {
            n_experts: *n_experts,
            top_k: *top_k,
            renormalize: *renormalize,
            bias: bias.as_deref(),
            expert_scale: None,
        };
        Some(step.timers.time(|t| &mut t.router, || route(&be.to_host(&be.matmul(h, router)), &params)))
    }
}

impl<B: Backend> Network<B> for Llama<B> {
    fn forward(&self, step: &mut Step<'_, B>, tokens: &[u32]) -> Result<B::Act> {
        let be = step.be;
        let h = self.spec.hidden_size;
        let act = self.spec.activation;
        let mut x = step.timers.time(|t| &mut t.embed, || be.embed(&self.embed, tokens, self.spec.embed_scale));
        for (i, l) in self.layers.iter().enumerate() {
            let mut a = be.copy(&x);
            step.norm(&mut a, &l.attn_norm, h);
            let a = l.attn.forward(step, &a);
            be.add(&mut x, &a);

            // Pilot: the next layer's router on this layer's residual, to read its
            // experts while this layer computes.
            if step.piloting()
                && let Some(next) = self.layers.get(i + 1).filter(|n| matches!(n.ffn, Ffn::Sparse { .. }))
            {
                let mut p = be.copy(&x);
                step.norm(&mut p, &next.ffn_norm, h);
                if let Some(r) = self.route(step, i + 1, &p) {
                    step.prefetch(i + 1, &r);
                }
            }

            let mut f = be.copy(&x);
            step.norm(&mut f, &l.ffn_norm, h);
            let f = match &l.ffn {
                Ffn::Dense(mlp) => mlp.forward(step, &f, act),
                Ffn::Sparse { .. } => {
                    let routing = self.route(step, i, &f).expect("a sparse layer routes");
                    step.observe(i, &routing);
                    experts(step, i, &f, &routing, act)?
                }
            };
            be.add(&mut x, &f);
        }
        step.norm(&mut x, &self.final_norm, h);
        Ok(x)
    }

    fn lm_head(&self) -> &B::Mat {
        &self.output
    }
}
