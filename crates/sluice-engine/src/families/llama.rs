//! Llama-shaped decoders: Llama, Qwen2, Qwen3 and Qwen3-MoE.
//!
//! Pre-norm residual blocks; attention with optional q/k norms (Qwen3) and q/k/v
//! biases (Qwen2); a SwiGLU MLP, or on sparse layers routed experts (Qwen3-MoE):
//!
//!   x += attn(attn_norm(x))
//!   x += mlp(ffn_norm(x))            or  experts(ffn_norm(x)), routed on ffn_norm(x)

use sluice_core::Result;
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use super::{Block, Stack};
use crate::backend::Backend;
use crate::blocks::{Attention, Cx, Mlp, load_vector};
use crate::moe::{Moe, RouterInput};

enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    Sparse(Moe<B>),
}

/// One layer; the model is a [`Stack`] of them.
pub struct Layer<B: Backend> {
    attn_norm: B::Vector,
    attn: Attention<B>,
    ffn_norm: B::Vector,
    ffn: Ffn<B>,
}

impl<B: Backend> Block<B> for Layer<B> {
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

    fn experts(&self) -> Option<&Moe<B>> {
        match &self.ffn {
            Ffn::Sparse(m) => Some(m),
            Ffn::Dense(_) => None,
        }
    }

    fn forward(&self, cx: &mut Cx<'_, B>, x: &mut B::Act, before: Option<B::Act>, h: usize) -> Result<B::Act> {
        let a = cx.then_normed(x, before, &self.attn_norm, h)?;
        let a = self.attn.forward(cx, &a)?;
        let f = cx.add_normed(x, &a, &self.ffn_norm, h)?;
        let f = match &self.ffn {
            Ffn::Dense(mlp) => mlp.forward(cx, &f)?,
            Ffn::Sparse(moe) => moe.forward(cx, x, &f)?,
        };
        Ok(f)
    }
}

pub type Llama<B> = Stack<B, Layer<B>>;
