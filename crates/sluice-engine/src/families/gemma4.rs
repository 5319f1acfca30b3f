//! Gemma 4 text: the 26B-A4B MoE and the dense E2B/E4B with per-layer embeddings.
//!
//! Per layer:
//!   x += post_attn_norm(attention(attn_norm(x)))
//!   f  = mlp(ffn_norm(x))
//!   MoE layers: f = post_norm_1(f) + post_norm_2(experts(pre_norm_2(x)));
//!               the router reads x itself (weightless norm, * scale * hidden^-0.5)
//!   x += post_ffn_norm(f)
//!   PLE:        x += ple_post_norm(ple_proj(act(ple_gate(x)) * per_layer_input[layer]))
//!   x *= layer_scalar
//! Attention: q/k norms with weights, a weightless v norm, scale 1, sliding layers on a
//! window with default RoPE, full layers with proportional RoPE and their own head
//! dim and KV heads; k_eq_v full layers take V from the k projection; the last layers
//! may read an earlier layer's cache (KV sharing). Logits are soft-capped. All of
//! that comes from the spec.

use sluice_core::{Activation, ModelSpec, Result};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use super::{Network, attention_state};
use crate::backend::Backend;
use crate::blocks::{Attention, Cx, Mlp, check_tokens, load_mat, load_output, load_vector};
use crate::moe::{Moe, RouterInput};
use crate::state::StateSpec;

/// A MoE layer's experts beside its dense MLP, with their own norms.
struct Experts<B: Backend> {
    moe: Moe<B>,
    post_norm_1: B::Vector,
    pre_norm_2: B::Vector,
    post_norm_2: B::Vector,
}

/// A layer's share of the per-layer embeddings.
struct LayerPle<B: Backend> {
    gate: B::Mat,
    proj: B::Mat,
    post_norm: B::Vector,
}

struct Layer<B: Backend> {
    index: usize,
    hidden: usize,
    act: Activation,
    attn_norm: B::Vector,
    attn: Attention<B>,
    attn_post_norm: B::Vector,
    ffn_norm: B::Vector,
    mlp: Mlp<B>,
    ffn_post_norm: B::Vector,
    experts: Option<Experts<B>>,
    ple: Option<LayerPle<B>>,
    layer_scalar: f32,
}

/// Model-level per-layer-embedding weights.
struct Ple<B: Backend> {
    embed: B::Mat,
    model_proj: B::Mat,
    proj_norm: B::Vector,
    dim: usize,
    vocab_size: usize,
}

pub struct Gemma4<B: Backend> {
    spec: ModelSpec,
    embed: B::Mat,
    output: B::Mat,
    final_norm: B::Vector,
    ple: Option<Ple<B>>,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> Layer<B> {
    fn load(be: &B, ckpt: &Checkpoint, i: usize) -> Result<Self> {
        let spec = &ckpt.spec;
        let h = spec.hidden_size;
        let id = |k| TensorId::layer(i, k);
        let norm = |k| load_vector(be, ckpt, id(k), h);
        let experts = match &spec.layers[i].moe {
            Some(_) => Some(Experts {
                moe: Moe::load(
                    be,
                    ckpt,
                    i,
                    RouterInput::ScaledNorm { scale: norm(TensorKind::RouterScale)?, factor: (h as f32).powf(-0.5) },
                )?,
                post_norm_1: norm(TensorKind::FfnPostNorm1)?,
                pre_norm_2: norm(TensorKind::FfnPreNorm2)?,
                post_norm_2: norm(TensorKind::FfnPostNorm2)?,
            }),
            None => None,
        };
        let ple = match &spec.ple {
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
        let inter = spec.layers[i].mlp.expect("every Gemma 4 layer has a dense MLP");
        Ok(Layer {
            index: i,
            hidden: h,
            act: spec.activation,
            attn_norm: norm(TensorKind::AttnNorm)?,
            attn: Attention::load(be, ckpt, i)?,
            attn_post_norm: norm(TensorKind::AttnPostNorm)?,
            ffn_norm: norm(TensorKind::FfnNorm)?,
            mlp: Mlp::load(be, ckpt, i, inter)?,
            ffn_post_norm: norm(TensorKind::FfnPostNorm)?,
            experts,
            ple,
            layer_scalar,
        })
    }

    /// `ple_inputs` is the step's per-layer inputs (models with per-layer embeddings).
    fn forward(&self, cx: &mut Cx<'_, B>, x: &mut B::Act, ple_inputs: Option<(&B::Act, usize)>) -> Result<()> {
        let h = self.hidden;
        let a = cx.normed(x, &self.attn_norm, h)?;
        let mut a = self.attn.forward(cx, &a)?;
        cx.norm(&mut a, &self.attn_post_norm, h)?;

        let f = cx.add_normed(x, &a, &self.ffn_norm, h)?;
        let mut f = self.mlp.forward(cx, &f)?;
        if let Some(e) = &self.experts {
            cx.norm(&mut f, &e.post_norm_1, h)?;
            let y = cx.normed(x, &e.pre_norm_2, h)?;
            let mut y = e.moe.forward(cx, x, &y)?;
            cx.norm(&mut y, &e.post_norm_2, h)?;
            cx.be.add(&mut f, &y)?;
        }
        cx.norm(&mut f, &self.ffn_post_norm, h)?;
        cx.be.add(x, &f)?;

        if let (Some(lp), Some((inputs, dim))) = (&self.ple, ple_inputs) {
            let be = cx.be;
            let mut g = be.matmul(x, &lp.gate)?;
            be.activate(&mut g, self.act)?;
            be.mul(&mut g, &be.columns(inputs, self.index * dim, dim)?)?;
            let mut y = be.matmul(&g, &lp.proj)?;
            cx.norm(&mut y, &lp.post_norm, h)?;
            cx.be.add(x, &y)?;
        }
        if self.layer_scalar != 1.0 {
            cx.be.scale(x, self.layer_scalar)?;
        }
        Ok(())
    }
}

impl<B: Backend> Gemma4<B> {
    pub fn load(be: &B, ckpt: &Checkpoint) -> Result<Self> {
        let spec = ckpt.spec.clone();
        let h = spec.hidden_size;
        let n_layers = spec.n_layers();
        let model = TensorId::model;
        let ple = match &spec.ple {
            Some(p) => Some(Ple {
                embed: load_mat(be, ckpt, model(TensorKind::PleTokenEmbd), p.vocab_size, n_layers * p.dim)?,
                model_proj: load_mat(be, ckpt, model(TensorKind::PleModelProj), n_layers * p.dim, h)?,
                proj_norm: load_vector(be, ckpt, model(TensorKind::PleProjNorm), p.dim)?,
                dim: p.dim,
                vocab_size: p.vocab_size,
            }),
            None => None,
        };
        Ok(Gemma4 {
            embed: load_mat(be, ckpt, model(TensorKind::TokenEmbd), spec.vocab_size, h)?,
            output: load_output(be, ckpt)?,
            final_norm: load_vector(be, ckpt, model(TensorKind::OutputNorm), h)?,
            ple,
            layers: (0..n_layers).map(|i| Layer::load(be, ckpt, i)).collect::<Result<_>>()?,
            spec,
        })
    }

    /// The per-layer inputs `[rows, n_layers * dim]`: the token's own per-layer
    /// embedding and a projection of its main embedding, normed, averaged.
    fn per_layer_inputs(&self, cx: &mut Cx<'_, B>, p: &Ple<B>, tokens: &[u32], x: &B::Act) -> Result<B::Act> {
        let tok = cx.embed(&p.embed, tokens, (p.dim as f32).sqrt())?;
        let be = cx.be;
        let mut proj = be.matmul(x, &p.model_proj)?;
        be.scale(&mut proj, (self.spec.hidden_size as f32).powf(-0.5))?;
        cx.norm(&mut proj, &p.proj_norm, p.dim)?;
        be.add(&mut proj, &tok)?;
        be.scale(&mut proj, std::f32::consts::FRAC_1_SQRT_2)?;
        Ok(proj)
    }
}

impl<B: Backend> Network<B> for Gemma4<B> {
    fn state(&self) -> Vec<StateSpec> {
        attention_state(&self.spec)
    }

    fn check(&self, tokens: &[u32]) -> Result<()> {
        match &self.ple {
            Some(p) => check_tokens(tokens, p.vocab_size),
            None => Ok(()),
        }
    }

    fn forward(&self, cx: &mut Cx<'_, B>, tokens: &[u32]) -> Result<B::Act> {
        let mut x = cx.embed(&self.embed, tokens, self.spec.embed_scale)?;
        let ple_inputs = match &self.ple {
            Some(p) => Some((self.per_layer_inputs(cx, p, tokens, &x)?, p.dim)),
            None => None,
        };
        for l in &self.layers {
            l.forward(cx, &mut x, ple_inputs.as_ref().map(|(a, d)| (a, *d)))?;
        }
        cx.norm(&mut x, &self.final_norm, self.spec.hidden_size)?;
        Ok(x)
    }

    fn lm_head(&self) -> &B::Mat {
        &self.output
    }

    fn moe(&self, layer: usize) -> Option<&Moe<B>> {
        self.layers.get(layer)?.experts.as_ref().map(|e| &e.moe)
    }
}
