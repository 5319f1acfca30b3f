//! The CUDA backend: weights, activations and KV caches in device memory, kernels
//! compiled by NVRTC when the backend starts (`kernels.cu`).
//!
//! CUDA is loaded at run time (cudarc's dynamic loading), so this crate builds and
//! its tests run on a machine without it; [`Cuda::open`] says why no GPU can be used
//! instead of failing inside the loader. Weights stay in their stored format on the
//! device and every product dequantizes them as it reads them, in f32.
//!
//! What this first version does and does not yet do:
//! - every operation of [`sluice_engine::backend::Backend`] on the device, for every
//!   weight format sluice reads, one sequence or a batch;
//! - routing: the router's logits come back to the host and the CPU's router chooses
//!   (the same choice as the CPU backend's); a device top-k comes next;
//! - routed experts are copied from the host store (any residency: memory, mapped,
//!   streamed from disk) to the device at first use and kept in a VRAM tier, least
//!   recently used out first, while the GPU has room; pinned host buffers, copies
//!   overlapping compute and the pilot's read-ahead into VRAM come next;
//! - products run on CUDA cores (one warp per output row, eight input rows per pass
//!   over the weights), not yet tensor cores.

mod backend;
mod device;

pub use backend::{Cuda, DevAct, DevExperts, DevKv, DevMat, DevRouting, DevVector, ExpertTraffic};
pub use device::{compile, probe};
