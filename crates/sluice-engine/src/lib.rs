//! The engine: the backend interface, the model families built from shared blocks,
//! KV caches, sessions, sampling and statistics.

pub mod backend;
pub mod blocks;
pub mod families;
pub mod model;
pub mod sampler;
pub mod stats;

pub use backend::{Backend, Cpu};
pub use model::{GenerationStats, LoadOptions, Logits, Model, Prefetch, Session};
pub use sampler::{Sampler, SamplerConfig};
