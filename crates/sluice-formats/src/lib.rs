//! Reading model files in place: Hugging Face folders (config.json + safetensors), GGUF
//! files and packed folders (`pack`). Everything here is checked against the file's own
//! header before a byte of tensor data is touched. `synth` writes synthetic checkpoints
//! with a real model's geometry.

pub mod checkpoint;
mod deepseek;
pub mod gguf;
pub mod gguf_config;
pub mod gguf_write;
mod gpt_oss;
pub mod hf_config;
pub mod mapped;
pub mod names;
pub mod pack;
mod qwen35;
mod qwen4_exp;
pub mod safetensors;
pub mod synth;

pub use checkpoint::{Checkpoint, ExpertMats};
pub use gguf::{GgufFile, GgufValue};
pub use gguf_write::GgufWriter;
pub use mapped::{Backing, MappedFile, TensorView};
pub use names::{HcPart, NgramPart, TensorId, TensorKind};
