//! gpt-oss (20b, 120b).
//!
//! Pre-norm residual blocks, routed experts on every layer:
//!
//!   x += o(attn(attn_norm(x))) + o_bias     q, k, v with biases; a learned sink logit
//!                                           per head joins each softmax; even layers
//!                                           slide (128), odd ones see everything;
//!                                           YaRN RoPE
//!   x += experts(ffn_norm(x))               router logits (with a bias), top-k, softmax
//!                                           over those k; each expert gate/up with
//!                                           biases, the clamped SwiGLU, down + bias
//!
//! The attention's sinks and biases and the experts' router kind, biases and GLU are
//! in the spec; this file only says how the layer is put together.

use sluice_core::Result;
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use super::{Block, Stack};
use crate::backend::Backend;
use crate::blocks::{Attention, Cx, load_vector};
use crate::moe::{Moe, RouterInput};

/// One layer; the model is a [`Stack`] of them.
pub struct Layer<B: Backend> {
    attn_norm: B::Vector,
    attn: Attention<B>,
    /// `post_attention_layernorm`: the norm before the experts.
    ffn_norm: B::Vector,
    experts: Moe<B>,
}

impl<B: Backend> Block<B> for Layer<B> {
    fn load(be: &B, ckpt: &Checkpoint, i: usize) -> Result<Self> {
        let h = ckpt.spec.hidden_size;
        let norm = |k| load_vector(be, ckpt, TensorId::layer(i, k), h);
        Ok(Layer {
            attn_norm: norm(TensorKind::AttnNorm)?,
            attn: Attention::load(be, ckpt, i)?,
            ffn_norm: norm(TensorKind::AttnPostNorm)?,
            // The router reads the experts' normed input.
            experts: Moe::load(be, ckpt, i, RouterInput::Norm(norm(TensorKind::AttnPostNorm)?))?,
        })
    }

    fn experts(&self) -> Option<&Moe<B>> {
        Some(&self.experts)
    }

    fn forward(&self, cx: &mut Cx<'_, B>, x: &mut B::Act, before: Option<B::Act>, h: usize) -> Result<B::Act> {
        let a = cx.then_normed(x, before, &self.attn_norm, h)?;
        let a = self.attn.forward(cx, &a)?;
        let f = cx.add_normed(x, &a, &self.ffn_norm, h)?;
        let f = self.experts.forward(cx, x, &f)?;
        Ok(f)
    }
}

pub type GptOss<B> = Stack<B, Layer<B>>;
