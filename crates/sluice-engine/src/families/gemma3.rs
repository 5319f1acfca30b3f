//! Gemma 3 text: pre- and post-norms around attention and the MLP.
//!
//!   x = embed(tokens) * sqrt(hidden)
//!   x += post_attn_norm(attn(attn_norm(x)))
//!   x += post_ffn_norm(mlp(ffn_norm(x)))
//!
//! Norms multiply by 1 + w (`norm_weight_offset`); attention has q/k norms, scales by
//! query_pre_attn_scalar^-0.5, and alternates sliding-window and full layers; all of
//! that comes from the spec.

use sluice_core::Result;
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use super::{Block, Stack};
use crate::backend::Backend;
use crate::blocks::{Attention, Cx, Mlp, load_vector};

/// One layer; the model is a [`Stack`] of them.
pub struct Layer<B: Backend> {
    attn_norm: B::Vector,
    attn: Attention<B>,
    attn_post_norm: B::Vector,
    ffn_norm: B::Vector,
    mlp: Mlp<B>,
    ffn_post_norm: B::Vector,
}

impl<B: Backend> Block<B> for Layer<B> {
    fn load(be: &B, ckpt: &Checkpoint, i: usize) -> Result<Self> {
        let norm = |k| load_vector(be, ckpt, TensorId::layer(i, k), ckpt.spec.hidden_size);
        let inter = ckpt.spec.layers[i].mlp.expect("every Gemma 3 layer has an MLP");
        Ok(Layer {
            attn_norm: norm(TensorKind::AttnNorm)?,
            attn: Attention::load(be, ckpt, i)?,
            attn_post_norm: norm(TensorKind::AttnPostNorm)?,
            ffn_norm: norm(TensorKind::FfnNorm)?,
            mlp: Mlp::load(be, ckpt, i, inter)?,
            ffn_post_norm: norm(TensorKind::FfnPostNorm)?,
        })
    }

    fn forward(&self, cx: &mut Cx<'_, B>, x: &mut B::Act, before: Option<B::Act>, h: usize) -> Result<B::Act> {
        let a = cx.then_normed(x, before, &self.attn_norm, h)?;
        let mut a = self.attn.forward(cx, &a)?;
        cx.norm(&mut a, &self.attn_post_norm, h)?;
        let f = cx.add_normed(x, &a, &self.ffn_norm, h)?;
        let mut f = self.mlp.forward(cx, &f)?;
        cx.norm(&mut f, &self.ffn_post_norm, h)?;
        Ok(f)
    }
}

pub type Gemma3<B> = Stack<B, Layer<B>>;
