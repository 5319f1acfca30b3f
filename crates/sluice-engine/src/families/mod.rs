//! One file per family. Each says what its layers compute in terms of the shared
//! blocks and backend operations, and nothing about how they run: no timing, no
//! read-ahead, no threads.

pub mod deepseek;
pub mod gemma3;
pub mod gemma4;
pub mod gpt_oss;
pub mod llama;
pub mod qwen35;
pub mod qwen4_exp;

use sluice_core::{ModelSpec, Result};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use crate::backend::Backend;
use crate::blocks::{Cx, load_mat, load_output, load_vector};
use crate::moe::Moe;
use crate::state::StateSpec;

/// A family's network: tokens in, final-normed hidden states out.
pub trait Network<B: Backend>: Send + Sync {
    /// What each layer keeps per sequence between steps.
    fn state(&self) -> Vec<StateSpec>;
    /// Checks a sequence's tokens beyond the vocabulary (which the engine checks).
    fn check(&self, _tokens: &[u32]) -> Result<()> {
        Ok(())
    }
    /// Runs `tokens` (the batch's rows: each sequence's new tokens, one sequence after
    /// another) through every layer.
    fn forward(&self, cx: &mut Cx<'_, B>, tokens: &[u32]) -> Result<B::Act>;
    /// The output projection (the tied embedding or lm_head).
    fn lm_head(&self) -> &B::Mat;
    /// Layer `layer`'s routed experts, if it has them (the pilot probes their routers).
    fn moe(&self, layer: usize) -> Option<&Moe<B>>;
}

/// The state of attention layers: their own KV (a ring on sliding layers), or
/// another layer's.
pub fn attention_state(spec: &sluice_core::ModelSpec) -> Vec<StateSpec> {
    spec.layers
        .iter()
        .map(|l| {
            let a = &l.attention;
            match a.kv_source {
                Some(source) => StateSpec::SharedKv { source },
                None => StateSpec::Kv { kv_dim: a.kv_dim(), head_dim: a.head_dim, window: a.window },
            }
        })
        .collect()
}

/// One layer of a [`Stack`]: what it loads and how it adds to the residual stream.
pub trait Block<B: Backend>: Sized + Send + Sync {
    fn load(be: &B, ckpt: &Checkpoint, layer: usize) -> Result<Self>;
    /// The layer's work on the residual `x` (rows of `hidden`) once `before` (the
    /// previous layer's output, if any) is added to it; returns its own output, which
    /// the next layer adds with its first norm ([`Cx::then_normed`]: one fused
    /// operation instead of two, the same bits).
    fn forward(&self, cx: &mut Cx<'_, B>, x: &mut B::Act, before: Option<B::Act>, hidden: usize) -> Result<B::Act>;
    /// The layer's routed experts, if it has them.
    fn experts(&self) -> Option<&Moe<B>> {
        None
    }
    /// What every layer keeps per sequence (attention's KV, by default).
    fn state(spec: &ModelSpec) -> Vec<StateSpec> {
        attention_state(spec)
    }
}

/// A decoder whose layers run one after another on the residual stream, between the
/// token embedding (times the spec's scale) and the final norm: the shape Llama,
/// Gemma 3, gpt-oss and DeepSeek share, each with its own [`Block`].
pub struct Stack<B: Backend, L> {
    spec: ModelSpec,
    embed: B::Mat,
    output: B::Mat,
    final_norm: B::Vector,
    layers: Vec<L>,
}

impl<B: Backend, L: Block<B>> Stack<B, L> {
    pub fn load(be: &B, ckpt: &Checkpoint) -> Result<Self> {
        let spec = ckpt.spec.clone();
        let h = spec.hidden_size;
        Ok(Stack {
            embed: load_mat(be, ckpt, TensorId::model(TensorKind::TokenEmbd), spec.vocab_size, h)?,
            output: load_output(be, ckpt)?,
            final_norm: load_vector(be, ckpt, TensorId::model(TensorKind::OutputNorm), h)?,
            layers: (0..spec.n_layers()).map(|i| L::load(be, ckpt, i)).collect::<Result<_>>()?,
            spec,
        })
    }
}

impl<B: Backend, L: Block<B>> Network<B> for Stack<B, L> {
    fn state(&self) -> Vec<StateSpec> {
        L::state(&self.spec)
    }

    fn forward(&self, cx: &mut Cx<'_, B>, tokens: &[u32]) -> Result<B::Act> {
        let h = self.spec.hidden_size;
        let mut x = cx.embed(&self.embed, tokens, self.spec.embed_scale)?;
        let mut out = None;
        for l in &self.layers {
            out = Some(l.forward(cx, &mut x, out.take(), h)?);
        }
        cx.then_normed(&mut x, out, &self.final_norm, h)
    }

    fn lm_head(&self) -> &B::Mat {
        &self.output
    }

    fn moe(&self, layer: usize) -> Option<&Moe<B>> {
        self.layers.get(layer)?.experts()
    }
}
