//! One file per family. Each says what its layers compute in terms of the shared
//! blocks and backend operations, and nothing about how they run: no timing, no
//! read-ahead, no threads.

pub mod deepseek;
pub mod gemma3;
pub mod gemma4;
pub mod gpt_oss;
pub mod llama;

use sluice_core::Result;

use crate::backend::Backend;
use crate::blocks::Cx;
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
                None => StateSpec::Kv { kv_dim: a.kv_dim(), window: a.window },
            }
        })
        .collect()
}
