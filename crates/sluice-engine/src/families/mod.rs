//! One file per family. Each says what its layers compute in terms of the shared
//! blocks and backend operations, and nothing about how they run.

pub mod gemma;
pub mod llama;

use sluice_core::Result;

use crate::backend::Backend;
use crate::blocks::Step;

/// A family's network: tokens in, final-normed hidden states out.
pub trait Network<B: Backend>: Send + Sync {
    /// Runs `tokens` (at the positions following the caches) through every layer.
    fn forward(&self, step: &mut Step<'_, B>, tokens: &[u32]) -> Result<B::Act>;
    /// The output projection (the tied embedding or lm_head).
    fn lm_head(&self) -> &B::Mat;
}
