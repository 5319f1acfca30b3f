//! CPU kernels: dot products and matrix products over every stored format,
//! norms, RoPE, attention, softmax and top-k. Pure functions over slices; the
//! engine's CPU backend strings them together.
//!
//! SIMD code is chosen once at run time ([`isa`]): AVX-512 or AVX2+FMA on x86-64,
//! NEON on aarch64, and a portable scalar path everywhere. Matrix products sum in a
//! fixed order that every ISA follows exactly, so results are bitwise repeatable run
//! to run and independent of the thread count and the ISA.

pub mod attention;
pub mod delta;
pub mod dot;
mod isa;
pub mod kv;
pub mod matmul;
pub mod ops;
mod par;
mod plain;
mod quant;
pub mod router;
pub mod tile;

pub use attention::{AttnParams, AttnSeq, KvCache, attention};
pub use dot::{dot_f32, dot_row, row_to_f32};
pub use isa::{Isa, isa, set_avx2_vnni, set_isa};
pub use matmul::{Product, matmul, matmul_grouped, matmul_many};
