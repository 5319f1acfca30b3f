//! The engine: the backend interface, the model families built from shared blocks,
//! layer state, batched steps over many sequences, sessions, sampling and statistics.

pub mod backend;
pub mod batch;
pub mod blocks;
pub mod delta_net;
pub mod families;
pub mod memory;
pub mod mla;
pub mod model;
pub mod moe;
pub mod perplexity;
pub mod pilot;
pub mod plan;
pub mod sampler;
pub mod state;
pub mod stats;

pub use backend::{Backend, Cpu};
pub use model::{Chunk, GenerationStats, LoadOptions, Logits, Model, Prefetch, Session, StepStats, default_kv_format};
pub use perplexity::{Perplexity, PerplexityOptions, WindowDone, perplexity};
pub use pilot::PilotStats;
pub use sampler::{Sampler, SamplerConfig};
pub use state::{SeqState, StateSpec};
