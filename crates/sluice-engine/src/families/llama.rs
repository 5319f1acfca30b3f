//! Llama-shaped decoders: Llama, Qwen2, Qwen3 and Qwen3-MoE.
//!
//! Pre-norm residual blocks; attention with optional q/k norms (Qwen3) and q/k/v
//! biases (Qwen2); a SwiGLU MLP, or on sparse layers routed experts (Qwen3-MoE):
//!
//!   x += attn(attn_norm(x))
//!   x += mlp(ffn_norm(x))            or  experts(ffn_norm(x)), routed on ffn_norm(x)

use sluice_core::{ModelSpec, Result};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use super::{Network, attention_state};
use crate::backend::Backend;
use crate::blocks::{Attention, Cx, Mlp, load_mat, load_output, load_vector};
use crate::moe::{Moe, RouterInput};
use crate::state::StateSpec;

enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    Sparse(Moe<B>),
}

struct Layer<B: Backend> {
    attn_norm: B::Vector,
    attn: Attention<B>,
    ffn_norm: B::Vector,
    ffn: Ffn<B>,
}

impl<B: Backend> Layer<B> {
    fn load(be: &B, ckpt: &Checkpoint, i: usize) -> Result<Self> {
        let h = ckpt.spec.hidden_size;
        let ls = &ckpt.spec.layers[i];
        let norm = |k| load_vector(be, ckpt, TensorId::layer(i, k), h);
        let ffn = match (&ls.moe, ls.mlp) {
            // The router reads the FFN's normed input.
            (Some(_), _) => Ffn::Sparse(Moe::load(be, ckpt, i, RouterInput::Norm(norm(TensorKind::FfnNorm)?))?),
            (None, Some(inter)) => Ffn::Dense(Mlp::load(be, ckpt, i, inter)?),
            (None, None) => unreachable!("a llama layer has an MLP or experts"),
        };
        Ok(Layer {
            attn_norm: norm(TensorKind::AttnNorm)?,
            attn: Attention::load(be, ckpt, i)?,
            ffn_norm: norm(TensorKind::FfnNorm)?,
            ffn,
        })
    }

    fn forward(&self, cx: &mut Cx<'_, B>, x: &mut B::Act, h: usize) -> Result<()> {
        let a = cx.normed(x, &self.attn_norm, h)?;
        let a = self.attn.forward(cx, &a)?;
        cx.be.add(x, &a)?;
        let f = cx.normed(x, &self.ffn_norm, h)?;
        let f = match &self.ffn {
            Ffn::Dense(mlp) => mlp.forward(cx, &f)?,
            Ffn::Sparse(moe) => moe.forward(cx, x, &f)?,
        };
        cx.be.add(x, &f)
    }
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
        Ok(Llama {
            embed: load_mat(be, ckpt, TensorId::model(TensorKind::TokenEmbd), spec.vocab_size, h)?,
            output: load_output(be, ckpt)?,
            final_norm: load_vector(be, ckpt, TensorId::model(TensorKind::OutputNorm), h)?,
            layers: (0..spec.n_layers()).map(|i| Layer::load(be, ckpt, i)).collect::<Result<_>>()?,
            spec,
        })
    }
}

impl<B: Backend> Network<B> for Llama<B> {
    fn state(&self) -> Vec<StateSpec> {
        attention_state(&self.spec)
    }

    fn forward(&self, cx: &mut Cx<'_, B>, tokens: &[u32]) -> Result<B::Act> {
        let h = self.spec.hidden_size;
        let mut x = cx.embed(&self.embed, tokens, self.spec.embed_scale)?;
        for l in &self.layers {
            l.forward(cx, &mut x, h)?;
        }
        cx.norm(&mut x, &self.final_norm, h)?;
        Ok(x)
    }

    fn lm_head(&self) -> &B::Mat {
        &self.output
    }

    fn moe(&self, layer: usize) -> Option<&Moe<B>> {
        match &self.layers.get(layer)?.ffn {
            Ffn::Sparse(m) => Some(m),
            Ffn::Dense(_) => None,
        }
    }
}
