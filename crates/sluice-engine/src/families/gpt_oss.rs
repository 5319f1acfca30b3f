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

use sluice_core::{ModelSpec, Result};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use super::{Network, attention_state};
use crate::backend::Backend;
use crate::blocks::{Attention, Cx, load_mat, load_output, load_vector};
use crate::moe::{Moe, RouterInput};
use crate::state::StateSpec;

struct Layer<B: Backend> {
    attn_norm: B::Vector,
    attn: Attention<B>,
    /// `post_attention_layernorm`: the norm before the experts.
    ffn_norm: B::Vector,
    experts: Moe<B>,
}

impl<B: Backend> Layer<B> {
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

    fn forward(&self, cx: &mut Cx<'_, B>, x: &mut B::Act, h: usize) -> Result<()> {
        let a = cx.normed(x, &self.attn_norm, h)?;
        let a = self.attn.forward(cx, &a)?;
        cx.be.add(x, &a)?;
        let f = cx.normed(x, &self.ffn_norm, h)?;
        let f = self.experts.forward(cx, x, &f)?;
        cx.be.add(x, &f)
    }
}

pub struct GptOss<B: Backend> {
    spec: ModelSpec,
    embed: B::Mat,
    output: B::Mat,
    final_norm: B::Vector,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> GptOss<B> {
    pub fn load(be: &B, ckpt: &Checkpoint) -> Result<Self> {
        let spec = ckpt.spec.clone();
        let h = spec.hidden_size;
        Ok(GptOss {
            embed: load_mat(be, ckpt, TensorId::model(TensorKind::TokenEmbd), spec.vocab_size, h)?,
            output: load_output(be, ckpt)?,
            final_norm: load_vector(be, ckpt, TensorId::model(TensorKind::OutputNorm), h)?,
            layers: (0..spec.n_layers()).map(|i| Layer::load(be, ckpt, i)).collect::<Result<_>>()?,
            spec,
        })
    }
}

impl<B: Backend> Network<B> for GptOss<B> {
    fn state(&self) -> Vec<StateSpec> {
        attention_state(&self.spec)
    }

    fn forward(&self, cx: &mut Cx<'_, B>, tokens: &[u32]) -> Result<B::Act> {
        let h = self.spec.hidden_size;
        let mut x = cx.embed(&self.embed, tokens, 1.0)?;
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
        self.layers.get(layer).map(|l| &l.experts)
    }
}
