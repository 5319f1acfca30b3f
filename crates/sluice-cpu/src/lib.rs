//! CPU kernels: dot products and matrix products over every stored format,
//! norms, RoPE, attention, softmax and top-k. Pure functions over slices; the
//! engine's CPU backend strings them together.
//!
//! SIMD code is chosen once at run time ([`isa`]): AVX-512 or AVX2+FMA on x86-64,
//! NEON on aarch64, and a portable scalar path everywhere. All of them sum in a
//! fixed order for a given ISA, so results are bitwise repeatable run to run and
//! independent of the thread count.

pub mod attention;
pub mod dot;
pub mod matmul;
pub mod ops;

pub use attention::{AttnParams, KvCache, attention};
pub use dot::{Isa, dot_f32, dot_row, isa, row_to_f32, set_isa};
pub use matmul::matmul;
