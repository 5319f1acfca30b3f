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
    /// A vector of `kv_dim` that a TurboQuant cache multiplies every key by (after the
    /// shift) before coding it, and attention divides each query by: the scores are
    /// the same in arithmetic, while the codes' error, spread evenly over a head's
    /// channels by the rotation, moves from the channels where queries are large to
    /// those where they are small (see the engine's `key_scales`). `None` for none.
    pub key_scale: Option<&'a [f32]>,
    /// The positions a TurboQuant cache also keeps as computed (ignored by the other
    /// formats).
    pub exact: ExactRows,
}

impl KvLayout<'_> {
    /// A cache of every position of `kv_dim` floats in heads of `head_dim`, in `format`,
    /// its keys coded as they are and no position kept exact; the other fields set by
    /// struct update where they matter.
    pub fn plain(kv_dim: usize, head_dim: usize, format: KvFormat) -> KvLayout<'static> {
        let exact = ExactRows::NONE;
        KvLayout { kv_dim, head_dim, window: None, format, seed: 0, key_shift: None, key_scale: None, exact }
    }
}

/// Positions a TurboQuant cache keeps as computed beside their codes: the first
/// `sinks` of the sequence, and for each query the `recent` positions up to its own.
///
/// Attention puts most of its weight on a sequence's first tokens (the "sinks" every
/// head parks weight on) and on the last hundred or so, so an error in those scores
/// moves every output, while an error in a far position's score moves only its small
/// share. Qwen2.5-Coder-1.5B at 4 bits over a 4096-token window of English: perplexity
/// +6.9% over 16 bits with codes everywhere, +0.1% with the first 4 and the last 128
/// exact. The window follows the query, not the cache's length, so a position is read
/// the same way whatever chunk the prompt came in (KIVI keeps a recent window in full
/// precision too, but by the cache's length; StreamingLLM found the four sinks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExactRows {
    pub sinks: usize,
    pub recent: usize,
}

impl ExactRows {
    /// Codes everywhere: the codec alone, for measuring it.
    pub const NONE: ExactRows = ExactRows { sinks: 0, recent: 0 };
    /// What `--kv-bits 2` to `4` keep: the first 4 and the last 128 positions (at
    /// most 132 positions exact in f32, 270 KB a layer for Qwen2.5-1.5B).
    pub const DEFAULT: ExactRows = ExactRows { sinks: 4, recent: 128 };
}

impl ExactRows {
    /// The first position a query at `pos` reads exact as one of its recent ones
    /// (`pos + 1` when none are; never below the sinks).
    pub fn recent_from(self, pos: usize) -> usize {
        (pos + 1).saturating_sub(self.recent).max(self.sinks)
    }

    /// Whether a query at `pos` reads position `j` (at most `pos`) exact.
    pub fn covers(self, pos: usize, j: usize) -> bool {
        j < self.sinks || j >= self.recent_from(pos)
    }
}

impl Default for ExactRows {
    fn default() -> Self {
        ExactRows::DEFAULT
    }
}
