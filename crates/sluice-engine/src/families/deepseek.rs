//! DeepSeek-V3 (and DeepSeek-V2's layout: `deepseek2` in GGUF).
//!
//! Pre-norm residual blocks; multi-head latent attention on every layer (`mla.rs`);
//! dense MLPs on the first layers, then routed experts beside shared ones:
//!
//!   x += mla(attn_norm(x))
//!   x += mlp(ffn_norm(x))                       the first `first_k_dense_replace` layers
//!   x += experts(ffn_norm(x)) + shared(ffn_norm(x))   the rest: sigmoid scores, a
//!                                               correction bias to choose, the best
//!                                               groups only, weights renormalised and
//!                                               scaled (the router kind in the spec)

use sluice_core::{ModelSpec, Result};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use super::{Block, Stack};
use crate::backend::Backend;
use crate::blocks::{Cx, Mlp, load_vector};
use crate::mla::Mla;
use crate::moe::{Moe, RouterInput};
use crate::state::StateSpec;

enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    Sparse { experts: Moe<B>, shared: Option<Mlp<B>> },
}

/// One layer; the model is a [`Stack`] of them.
pub struct Layer<B: Backend> {
    attn_norm: B::Vector,
    attn: Mla<B>,
    ffn_norm: B::Vector,
    ffn: Ffn<B>,
}

impl<B: Backend> Block<B> for Layer<B> {
    fn load(be: &B, ckpt: &Checkpoint, i: usize) -> Result<Self> {
        let h = ckpt.spec.hidden_size;
        let ls = &ckpt.spec.layers[i];
        let norm = |k| load_vector(be, ckpt, TensorId::layer(i, k), h);
        let ffn = match (&ls.moe, ls.mlp) {
            (Some(m), _) => Ffn::Sparse {
                // The router reads the FFN's normed input.
                experts: Moe::load(be, ckpt, i, RouterInput::Norm(norm(TensorKind::FfnNorm)?))?,
                shared: m.shared.map(|sh| Mlp::load_shared(be, ckpt, i, sh.intermediate)).transpose()?,
            },
            (None, Some(inter)) => Ffn::Dense(Mlp::load(be, ckpt, i, inter)?),
            (None, None) => unreachable!("a DeepSeek layer has an MLP or experts"),
        };
        Ok(Layer {
            attn_norm: norm(TensorKind::AttnNorm)?,
            attn: Mla::load(be, ckpt, i)?,
            ffn_norm: norm(TensorKind::FfnNorm)?,
            ffn,
        })
    }

    fn experts(&self) -> Option<&Moe<B>> {
        match &self.ffn {
            Ffn::Sparse { experts, .. } => Some(experts),
            Ffn::Dense(_) => None,
        }
    }

    /// Each layer caches its latent and RoPE key, one vector a position.
    fn state(spec: &ModelSpec) -> Vec<StateSpec> {
        spec.layers.iter().map(|l| StateSpec::Latent { width: l.attention.kv_dim() }).collect()
    }

    fn forward(&self, cx: &mut Cx<'_, B>, x: &mut B::Act, before: Option<B::Act>, h: usize) -> Result<B::Act> {
        let a = cx.then_normed(x, before, &self.attn_norm, h)?;
        let a = self.attn.forward(cx, &a)?;
        let f = cx.add_normed(x, &a, &self.ffn_norm, h)?;
        let f = match &self.ffn {
            Ffn::Dense(mlp) => mlp.forward(cx, &f)?,
            Ffn::Sparse { experts, shared } => {
                let mut y = experts.forward(cx, x, &f)?;
                if let Some(s) = shared {
                    cx.be.add(&mut y, &s.forward(cx, &f)?)?;
                }
                y
            }
        };
        Ok(f)
    }
}

pub type DeepSeek<B> = Stack<B, Layer<B>>;
