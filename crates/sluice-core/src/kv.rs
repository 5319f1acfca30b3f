//! How a KV cache stores its positions (`--kv-bits`).

use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

/// The width of one cached key or value coordinate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// f32, as computed: bit for bit what an unquantized cache gives.
    F32,
    /// IEEE half precision (llama.cpp's default cache type).
    F16,
    /// 8-bit integers with one f32 scale per head and position (the plain 8-bit form).
    Q8,
    /// TurboQuant: a random rotation (Walsh-Hadamard with random signs), then a Lloyd-Max
    /// scalar code per coordinate and one f16 norm per rotated block.
    Turbo(TurboBits),
}

/// TurboQuant's code widths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TurboBits {
    Two,
    Three,
    /// Half of each rotated block's coordinates at 4 bits, half at 3.
    ThreeHalf,
    Four,
}

impl TurboBits {
    /// Bits of the code of coordinate `i` of a block of `block`.
    pub fn of(self, i: usize, block: usize) -> u32 {
        match self {
            TurboBits::Two => 2,
            TurboBits::Three => 3,
            TurboBits::Four => 4,
            TurboBits::ThreeHalf => {
                if i < block / 2 {
                    4
                } else {
                    3
                }
            }
        }
    }
}

impl KvFormat {
    /// Every width `--kv-bits` takes, in its spelling.
    pub const NAMES: &'static str = "2, 3, 3.5, 4, 8, 16 or 32";

    /// Bits per coordinate, without the per-block scales.
    pub fn bits(self) -> f32 {
        match self {
            KvFormat::F32 => 32.0,
            KvFormat::F16 => 16.0,
            KvFormat::Q8 => 8.0,
            KvFormat::Turbo(TurboBits::Two) => 2.0,
            KvFormat::Turbo(TurboBits::Three) => 3.0,
            KvFormat::Turbo(TurboBits::ThreeHalf) => 3.5,
            KvFormat::Turbo(TurboBits::Four) => 4.0,
        }
    }

    /// The format of a layer that keeps a ring of its last positions (a sliding
    /// window): never narrower than 16 bits, since a window is small and its layers
    /// are the ones that see every nearby token.
    pub fn for_sliding(self) -> KvFormat {
        if self.bits() < 16.0 { KvFormat::F16 } else { self }
    }
}

impl FromStr for KvFormat {
    type Err = Error;

    fn from_str(s: &str) -> Result<KvFormat> {
        Ok(match s.trim() {
            "32" => KvFormat::F32,
            "16" => KvFormat::F16,
            "8" => KvFormat::Q8,
            "4" => KvFormat::Turbo(TurboBits::Four),
            "3.5" => KvFormat::Turbo(TurboBits::ThreeHalf),
            "3" => KvFormat::Turbo(TurboBits::Three),
            "2" => KvFormat::Turbo(TurboBits::Two),
            other => {
                return Err(Error::Usage(format!("--kv-bits {other:?}: the KV cache takes {}", KvFormat::NAMES)));
            }
        })
    }
}

impl fmt::Display for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bits())
    }
}

/// One layer's KV cache as the engine asks a backend for it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvLayout<'a> {
    /// Floats per position (`kv_heads * head_dim`).
    pub kv_dim: usize,
    /// Floats per head: a quantized cache scales and rotates within heads.
    pub head_dim: usize,
    /// A ring of the last `window` positions, or every position.
    pub window: Option<usize>,
    pub format: KvFormat,
    /// Chooses the rotation's signs (the layer's index): fixed per layer and head.
    pub seed: u64,
    /// A vector of `kv_dim` that a coded cache subtracts from every key before coding
    /// it: the part all positions share, which would otherwise take most of the codes'
    /// range (Qwen2.5's key bias reaches 350 in channels where the rest is near 1).
    /// Attention adds `q · key_shift` back to each score, so the result does not
    /// depend on it but for rounding. `None` for none.
    pub key_shift: Option<&'a [f32]>,
}
