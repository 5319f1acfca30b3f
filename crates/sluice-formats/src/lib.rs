//! Reading model files in place: Hugging Face folders (config.json + safetensors)
//! now, GGUF and the packed layout next. Everything here is checked against the
//! file's own header before a byte of tensor data is touched.

pub mod checkpoint;
pub mod hf_config;
pub mod mapped;
pub mod names;
pub mod safetensors;

pub use checkpoint::{Checkpoint, ExpertMats};
pub use mapped::{MappedFile, TensorView};
pub use names::{TensorId, TensorKind};
