//! The CUDA backend: weights, activations and KV caches in device memory, kernels
//! compiled by NVRTC when the backend starts (`kernels.cu`).
//!
//! CUDA is loaded at run time (cudarc's dynamic loading), so this crate builds and
//! its tests run on a machine without it; [`Cuda::open`] says why no GPU can be used
//! instead of failing inside the loader. Weights stay in their stored format on the
//! device and every product dequantizes them as it reads them, in f32.
//!
//! What it does and does not yet do:
//! - every operation of [`sluice_engine::backend::Backend`] on the device, for every
//!   weight format sluice reads, one sequence or a batch; kernels compiled by NVRTC per
//!   weight format at first use and cached on disk (`device.rs`);
//! - routing on the device (every router kind but DeepSeek's group-limited sigmoid,
//!   which is routed on the host); the grouped expert products plan their work from
//!   the device's routing, so a layer the VRAM tier holds whole never waits for the
//!   host;
//! - routed experts copied to the device at load when all of them fit, else at first
//!   use from the host store (any residency) and kept in a VRAM tier, least recently
//!   or least often used out first (`tier.rs`), copied from page-locked host memory
//!   when the store is resident; with `--prefetch pilot` the next layer's predicted
//!   experts are copied on a second stream beside the computation (misses the pilot
//!   did not predict are still copied on the compute stream); CUDA graphs come next;
//! - a prompt's rows (8-bit activations) against K-quant weights on tensor cores (int8
//!   `mma`, a block of 64 outputs by 32 rows); decode rows and other formats on CUDA
//!   cores (a block of four warps per output row, eight input rows per pass over the
//!   weights).

mod backend;
mod device;
mod tier;

pub use backend::{Cuda, DevAct, DevExperts, DevKv, DevMat, DevRouting, DevVector};
pub use device::{Unit, compile, probe};
pub use sluice_engine::backend::ExpertTraffic;
