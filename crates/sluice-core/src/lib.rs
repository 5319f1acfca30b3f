//! Types shared by every sluice crate: element and block formats, the normalized
//! model description ([`ModelSpec`]) and the one error type.

pub mod cache;
pub mod dtype;
pub mod error;
pub mod kv;
pub mod mat;
pub mod quant;
pub mod spec;
pub mod testing;

pub use dtype::DType;
pub use error::{Error, Result};
pub use kv::{ExactRows, KvFormat, KvLayout, TurboBits};
pub use mat::{MatRef, Precision};
pub use spec::*;
