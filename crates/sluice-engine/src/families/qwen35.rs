//! Qwen3.5/3.6-MoE.
//!
//! Pre-norm residual blocks. Most layers mix tokens with a Gated DeltaNet
//! (`delta_net.rs`: a fixed-size recurrent state per sequence), every
//! `full_attention_interval`-th with gated full attention (the q projection also
//! gives a sigmoid gate on the output; q/k norms; RoPE on a quarter of each head);
//! every layer has routed experts beside a shared expert scaled by its own gate:
//!
//!   x += mixer(attn_norm(x))
//!   x += experts(ffn_norm(x)) + sigmoid(gate · ffn_norm(x)) * shared(ffn_norm(x))
//!
//! Norms multiply by 1 + w in the Hugging Face form (the spec's offset), by w in GGUF,
//! which stores them shifted.

use sluice_core::{ModelSpec, Result};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use super::{Block, Stack};
use crate::backend::Backend;
use crate::blocks::{Attention, Cx, Mlp, load_mat, load_vector};
use crate::delta_net::DeltaNet;
use crate::moe::{Moe, RouterInput};
use crate::state::StateSpec;

enum Mixer<B: Backend> {
    Linear(DeltaNet<B>),
    Full(Attention<B>),
}

/// The shared expert and the `[1, hidden]` projection whose sigmoid scales it.
struct Shared<B: Backend> {
    mlp: Mlp<B>,
    gate: Option<B::Mat>,
}

/// One layer; the model is a [`Stack`] of them.
pub struct Layer<B: Backend> {
    attn_norm: B::Vector,
    mixer: Mixer<B>,
    ffn_norm: B::Vector,
    experts: Moe<B>,
    shared: Option<Shared<B>>,
}

impl<B: Backend> Block<B> for Layer<B> {
    fn load(be: &B, ckpt: &Checkpoint, i: usize) -> Result<Self> {
        let h = ckpt.spec.hidden_size;
        let ls = &ckpt.spec.layers[i];
        let norm = |k| load_vector(be, ckpt, TensorId::layer(i, k), h);
        let moe = ls.moe.as_ref().expect("every Qwen3.5-MoE layer has experts");
        let shared = match moe.shared {
            Some(sh) => Some(Shared {
                mlp: Mlp::load_shared(be, ckpt, i, sh.intermediate)?,
                gate: sh
                    .gated
                    .then(|| load_mat(be, ckpt, TensorId::layer(i, TensorKind::ShexpGateInp), 1, h))
                    .transpose()?,
            }),
            None => None,
        };
        Ok(Layer {
            attn_norm: norm(TensorKind::AttnNorm)?,
            mixer: match ls.linear {
                Some(_) => Mixer::Linear(DeltaNet::load(be, ckpt, i)?),
                None => Mixer::Full(Attention::load(be, ckpt, i)?),
            },
            // `post_attention_layernorm`: the norm before the experts.
            ffn_norm: norm(TensorKind::AttnPostNorm)?,
            // The router reads the experts' normed input.
            experts: Moe::load(be, ckpt, i, RouterInput::Norm(norm(TensorKind::AttnPostNorm)?))?,
            shared,
        })
    }

    fn experts(&self) -> Option<&Moe<B>> {
        Some(&self.experts)
    }

    /// A linear layer keeps its convolution's tail and its recurrent matrices; a full
    /// one its keys and values.
    fn state(spec: &ModelSpec) -> Vec<StateSpec> {
        spec.layers
            .iter()
            .map(|l| match l.linear {
                Some(d) => StateSpec::Recurrent { rows: 1, cols: d.state_len() },
                None => StateSpec::Kv {
                    kv_dim: l.attention.kv_dim(),
                    head_dim: l.attention.head_dim,
                    window: l.attention.window,
                },
            })
            .collect()
    }

    fn forward(&self, cx: &mut Cx<'_, B>, x: &mut B::Act, before: Option<B::Act>, h: usize) -> Result<B::Act> {
        let a = cx.then_normed(x, before, &self.attn_norm, h)?;
        let a = match &self.mixer {
            Mixer::Linear(d) => d.forward(cx, &a)?,
            Mixer::Full(att) => att.forward(cx, &a)?,
        };
        let f = cx.add_normed(x, &a, &self.ffn_norm, h)?;
        let mut y = self.experts.forward(cx, x, &f)?;
        if let Some(s) = &self.shared {
            let mut z = s.mlp.forward(cx, &f)?;
            if let Some(g) = &s.gate {
                let mut g = cx.be.matmul(&f, g)?;
                cx.be.activate(&mut g, sluice_core::Activation::Sigmoid)?;
                cx.be.scale_rows(&mut z, &g)?;
            }
            cx.be.add(&mut y, &z)?;
        }
        Ok(y)
    }
}

pub type Qwen35<B> = Stack<B, Layer<B>>;
