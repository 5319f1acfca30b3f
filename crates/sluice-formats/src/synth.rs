//! Synthetic MoE checkpoints with a real model's geometry, for benchmarks.
//!
//! The weights are random, written straight in their quantized block format (random
//! quants under f16 scales chosen for a target standard deviation), one row chunk at a
//! time, so a model of tens of GB never sits in memory and nothing passes through f32.
//! Each chunk comes from its own seed (the run's seed, the tensor's name, the expert, the
//! chunk), so the bytes do not depend on the order they are written in: the GGUF form
//! and the packed form of one seed hold the same experts byte for byte.
//!
//! Scales keep activations well-scaled through every layer ([`Tuning`]): matrices have
//! elements of standard deviation 1/sqrt(input width), so each projection keeps unit
//! variance; the residual starts at unit RMS (the embedding); each block's output
//! projection (Gemma 4: its post-norm) is scaled by 1/sqrt(2 x layers), as GPT-2 scales
//! its residual branches; q/k norm weights make the attention scores' standard deviation
//! 3; other norm weights are near 1; the output projection gives logits of unit scale.
//! Without the branch scaling and the sharper attention a deep random network collapses:
//! every token's residual ends up alike, and deep layers route every token to the same
//! few experts (measured: top-8 of 128 experts taking 70% of the routing at layer 47 of
//! 48). With them, routing at every depth is as uniform as independent draws.
//!
//! Routers are f32 with logits of standard deviation [`ROUTER_LOGIT_STD`] for a normed
//! input: input-dependent, and uniform over the experts on average. A skew `alpha` gives
//! each layer's experts a Zipf-like popularity `p_e ∝ (rank_e + 1)^-alpha` over a random
//! per-layer ranking, written as a router bias `blk.N.ffn_gate_inp.bias = ln p_e` that the
//! engine adds to the logits before the softmax. Measured with LRU per layer over 300
//! decoded tokens (Qwen3-MoE and Gemma 4 shapes alike), hit rates at 8/16/32/64 of 128
//! slots: alpha 0: 6/13/25/50%; alpha 0.8: 34/55/76/90%; alpha 0.9: 40/62/82/93%
//! (95% of the routing in ~50 experts); alpha 1: 45/68/86/95%. Real models report about
//! 63-66% at 16 slots and 83-85% at 32, so alpha 0.9 is the realistic setting.
//!
//! A model whose output projection is tied to its embedding (Gemma 4) gets random signs in
//! its final norm, or every token would predict itself (its own embedding dominates the
//! residual) and generation would repeat one token forever.
//!
//! Quantization: `quant` (Q4_K by default) for every matrix whose rows it can hold; rows
//! that are not whole 256-element super-blocks fall back to a 32-element type as llama.cpp
//! does (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0). The output projection (or a tied
//! embedding) is Q6_K below 8 bits. Norms, routers and biases are f32.
//!
//! The vocabulary is byte-level (`gpt2`): the 256 bytes, `<|endoftext|>`, `<|im_start|>`,
//! `<|im_end|>`, then `<unused_N>` up to the geometry's vocabulary size, no merges, and a
//! ChatML chat template, so `sluice run` works on the result.

use std::io::{self, Write};
use std::path::Path;

use sluice_core::{DType, Error, Result};

use crate::gguf::GgufValue;
use crate::gguf_write::{GgufWriter, tensor_bytes};
use crate::pack::{self, ExpertsWriter, MatShape, PackSummary, SourceInfo};

/// Standard deviation of the router logits for a normed input.
pub const ROUTER_LOGIT_STD: f32 = 1.0;

/// Bytes of rows generated from one seed (and one buffer).
const CHUNK_BYTES: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `qwen3moe`: every layer routed experts, q/k norms.
    Qwen3Moe,
    /// `gemma4`: sliding and full attention interleaved, a dense MLP beside the experts.
    Gemma4,
    /// `gpt-oss`: even layers slide ([`GPT_OSS_WINDOW`]), biases on the attention
    /// projections, the router and the experts, attention sinks, YaRN RoPE, no q/k
    /// norms; the experts in MXFP4 (their native format) whatever `--quant` says.
    GptOss,
    /// `deepseek2` (DeepSeek-V3): multi-head latent attention, dense first layers,
    /// sigmoid routing in groups with a correction bias beside shared experts.
    DeepSeek2(SynthMla),
    /// `qwen35moe` (Qwen3.5-MoE): Gated DeltaNet layers with every `interval`-th
    /// full (gated) attention, experts beside a gated shared expert.
    Qwen35Moe(SynthDelta),
}

/// A Qwen3.5 geometry's linear-attention and shared-expert shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynthDelta {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub conv_kernel: usize,
    /// Layers `interval - 1`, `2 interval - 1`, ... are full attention.
    pub interval: usize,
    pub shared_ffn: usize,
    /// Rotated dims of a full-attention head.
    pub rope_dim: usize,
}

/// A DeepSeek geometry's attention and routing shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynthMla {
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
    /// The first layers, with a dense MLP of `dense_ffn` instead of experts.
    pub dense_layers: usize,
    pub n_groups: usize,
    pub topk_groups: usize,
    /// Shared experts, each of the routed experts' width.
    pub shared: usize,
}

/// gpt-oss's sliding window (its config's `sliding_window`).
pub const GPT_OSS_WINDOW: usize = 128;

/// Gemma 4's interleaved attention.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Interleaved {
    /// Layers `period - 1`, `2 period - 1`, ... and the last are full attention; the
    /// others slide.
    pub period: usize,
    pub window: usize,
    /// KV heads and head dim of the full layers, which take V from K.
    pub full_kv_heads: usize,
    pub full_head_dim: usize,
    pub rope_theta_swa: f32,
    /// The fraction of a full layer's rotary pairs that rotate (proportional RoPE).
    pub full_rotary_fraction: f32,
}

/// A model's shape, from its public config.
#[derive(Clone, Debug, PartialEq)]
pub struct Geometry {
    pub name: &'static str,
    pub arch: Arch,
    pub n_layers: usize,
    /// Layers of the whole model (`n_layers` until [`with_layers`](Self::with_layers)
    /// keeps fewer). Scales depend on it, so a cut model is the whole one's first layers.
    pub full_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    /// KV heads and head dim (Gemma 4: of the sliding layers).
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub n_experts: usize,
    pub top_k: usize,
    pub expert_ffn: usize,
    /// Gemma 4: the dense MLP beside the experts. Qwen3-MoE: the config's
    /// `intermediate_size`, recorded in the metadata as the converter does, unused.
    pub dense_ffn: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub softcap: Option<f32>,
    pub interleaved: Option<Interleaved>,
}

impl Geometry {
    /// Every geometry `synth` knows, by name.
    pub fn all() -> Vec<Geometry> {
        let qwen = |name, n_layers, hidden, n_heads, expert_ffn, dense_ffn| Geometry {
            name,
            arch: Arch::Qwen3Moe,
            n_layers,
            full_layers: n_layers,
            hidden,
            n_heads,
            n_kv_heads: 4,
            head_dim: 128,
            n_experts: 128,
            top_k: 8,
            expert_ffn,
            dense_ffn,
            vocab: 151936,
            context: 40960,
            rope_theta: 1e6,
            rms_eps: 1e-6,
            softcap: None,
            interleaved: None,
        };
        vec![
            // Qwen/Qwen3-30B-A3B config.json.
            qwen("qwen3-30b-a3b", 48, 2048, 32, 768, 6144),
            // Qwen/Qwen3-235B-A22B config.json.
            qwen("qwen3-235b-a22b", 94, 4096, 64, 1536, 12288),
            // google/gemma-4-26B-A4B: 5 sliding layers (window 1024) to 1 full.
            Geometry {
                name: "gemma4-26b-a4b",
                arch: Arch::Gemma4,
                n_layers: 30,
                full_layers: 30,
                hidden: 2816,
                n_heads: 16,
                n_kv_heads: 8,
                head_dim: 256,
                n_experts: 128,
                top_k: 8,
                expert_ffn: 704,
                dense_ffn: 2112,
                vocab: 262144,
                context: 262144,
                rope_theta: 1e6,
                rms_eps: 1e-6,
                softcap: Some(30.0),
                interleaved: Some(Interleaved {
                    period: 6,
                    window: 1024,
                    full_kv_heads: 2,
                    full_head_dim: 512,
                    rope_theta_swa: 1e4,
                    full_rotary_fraction: 0.25,
                }),
            },
            // openai/gpt-oss-120b config.json.
            Geometry {
                name: "gpt-oss-120b",
                arch: Arch::GptOss,
                n_layers: 36,
                full_layers: 36,
                hidden: 2880,
                n_heads: 64,
                n_kv_heads: 8,
                head_dim: 64,
                n_experts: 128,
                top_k: 4,
                expert_ffn: 2880,
                dense_ffn: 2880,
                vocab: 201088,
                context: 131072,
                rope_theta: 150000.0,
                rms_eps: 1e-5,
                softcap: None,
                interleaved: None,
            },
            // deepseek-ai/DeepSeek-V3 config.json (671B).
            Geometry {
                name: "deepseek-v3",
                arch: Arch::DeepSeek2(SynthMla {
                    q_lora_rank: 1536,
                    kv_lora_rank: 512,
                    nope_dim: 128,
                    rope_dim: 64,
                    v_dim: 128,
                    dense_layers: 3,
                    n_groups: 8,
                    topk_groups: 4,
                    shared: 1,
                }),
                n_layers: 61,
                full_layers: 61,
                hidden: 7168,
                n_heads: 128,
                n_kv_heads: 1,
                head_dim: 576,
                n_experts: 256,
                top_k: 8,
                expert_ffn: 2048,
                dense_ffn: 18432,
                vocab: 129280,
                context: 163840,
                rope_theta: 10000.0,
                rms_eps: 1e-6,
                softcap: None,
                interleaved: None,
            },
            // Qwen/Qwen3.5-397B-A17B's shape as its model card gives it: 60 layers (15
            // of them full attention), 512 experts of 1024, 10 routed and one shared.
            Geometry {
                name: "qwen3.5-397b-a17b",
                arch: Arch::Qwen35Moe(SynthDelta {
                    k_heads: 16,
                    v_heads: 64,
                    k_dim: 128,
                    v_dim: 128,
                    conv_kernel: 4,
                    interval: 4,
                    shared_ffn: 1024,
                    rope_dim: 64,
                }),
                n_layers: 60,
                full_layers: 60,
                hidden: 4096,
                n_heads: 32,
                n_kv_heads: 2,
                head_dim: 256,
                n_experts: 512,
                top_k: 10,
                expert_ffn: 1024,
                dense_ffn: 1024,
                vocab: 248320,
                context: 262144,
                rope_theta: 1e7,
                rms_eps: 1e-6,
                softcap: None,
                interleaved: None,
            },
            Geometry {
                name: "tiny-qwen3.5",
                arch: Arch::Qwen35Moe(SynthDelta {
                    k_heads: 2,
                    v_heads: 4,
                    k_dim: 64,
                    v_dim: 64,
                    conv_kernel: 4,
                    interval: 4,
                    shared_ffn: 128,
                    rope_dim: 16,
                }),
                n_layers: 4,
                full_layers: 4,
                hidden: 256,
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: 64,
                n_experts: 16,
                top_k: 4,
                expert_ffn: 128,
                dense_ffn: 128,
                vocab: 512,
                context: 4096,
                rope_theta: 1e7,
                rms_eps: 1e-6,
                softcap: None,
                interleaved: None,
            },
            Geometry {
                name: "tiny-deepseek",
                arch: Arch::DeepSeek2(SynthMla {
                    q_lora_rank: 64,
                    kv_lora_rank: 64,
                    nope_dim: 32,
                    rope_dim: 32,
                    v_dim: 32,
                    dense_layers: 1,
                    n_groups: 4,
                    topk_groups: 2,
                    shared: 1,
                }),
                n_layers: 4,
                full_layers: 4,
                hidden: 256,
                n_heads: 4,
                n_kv_heads: 1,
                head_dim: 96,
                n_experts: 16,
                top_k: 4,
                expert_ffn: 128,
                dense_ffn: 256,
                vocab: 512,
                context: 4096,
                rope_theta: 10000.0,
                rms_eps: 1e-6,
                softcap: None,
                interleaved: None,
            },
            // Small enough for tests; the expert width (128) is not a whole Q4_K
            // super-block, so its down projection takes the 32-element fallback.
            Geometry {
                name: "tiny-moe",
                arch: Arch::Qwen3Moe,
                n_layers: 4,
                full_layers: 4,
                hidden: 256,
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: 64,
                n_experts: 16,
                top_k: 4,
                expert_ffn: 128,
                dense_ffn: 512,
                vocab: 512,
                context: 4096,
                rope_theta: 1e6,
                rms_eps: 1e-6,
                softcap: None,
                interleaved: None,
            },
            Geometry {
                name: "tiny-gpt-oss",
                arch: Arch::GptOss,
                n_layers: 4,
                full_layers: 4,
                hidden: 256,
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: 64,
                n_experts: 16,
                top_k: 4,
                expert_ffn: 128,
                dense_ffn: 128,
                vocab: 512,
                context: 4096,
                rope_theta: 150000.0,
                rms_eps: 1e-5,
                softcap: None,
                interleaved: None,
            },
            Geometry {
                name: "tiny-gemma4",
                arch: Arch::Gemma4,
                n_layers: 6,
                full_layers: 6,
                hidden: 256,
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: 64,
                n_experts: 16,
                top_k: 4,
                expert_ffn: 128,
                dense_ffn: 192,
                vocab: 512,
                context: 4096,
                rope_theta: 1e6,
                rms_eps: 1e-6,
                softcap: Some(30.0),
                interleaved: Some(Interleaved {
                    period: 6,
                    window: 16,
                    full_kv_heads: 1,
                    full_head_dim: 128,
                    rope_theta_swa: 1e4,
                    full_rotary_fraction: 0.25,
                }),
            },
        ]
    }

    pub fn names() -> Vec<&'static str> {
        Geometry::all().iter().map(|g| g.name).collect()
    }

    pub fn named(name: &str) -> Option<Geometry> {
        Geometry::all().into_iter().find(|g| g.name.eq_ignore_ascii_case(name))
    }

    /// The first `n` layers (Gemma 4 keeps its last layer full attention, as the
    /// model's own config does).
    pub fn with_layers(mut self, n: usize) -> Result<Geometry> {
        if n == 0 || n > self.n_layers {
            return Err(Error::Usage(format!("--layers must be between 1 and {} for {}", self.n_layers, self.name)));
        }
        self.n_layers = n;
        Ok(self)
    }

    /// Whether layer `l` is full attention (always, outside Gemma 4 and gpt-oss).
    pub fn is_full(&self, l: usize) -> bool {
        match self.interleaved {
            None if self.arch == Arch::GptOss => l % 2 == 1,
            None => true,
            Some(i) => l + 1 == self.n_layers || (l + 1).is_multiple_of(i.period),
        }
    }

    /// KV heads and head dim of layer `l`.
    pub fn attention(&self, l: usize) -> (usize, usize) {
        match self.interleaved {
            Some(i) if self.is_full(l) => (i.full_kv_heads, i.full_head_dim),
            _ => (self.n_kv_heads, self.head_dim),
        }
    }
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct SynthOptions {
    pub geometry: Geometry,
    /// The type of the matrices (Q4_K by default).
    pub quant: DType,
    /// Zipf exponent of the experts' popularity; 0 routes uniformly on average.
    pub skew: f32,
    pub seed: u64,
    pub tuning: Tuning,
}

/// The scales that keep a deep random network from collapsing (every token's residual
/// ending up alike, which would route every token to the same experts).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tuning {
    /// Standard deviation of the router logits for a normed input.
    pub router_std: f32,
    /// Multiplies the standard deviation of each block's output projection (attention
    /// output, expert and dense down projections), times 1/sqrt(2 * the full model's
    /// layers), as GPT-2 scales its residual branches.
    pub branch_gain: f32,
    /// Standard deviation of the attention scores q·k·scale for unit-variance inputs
    /// (set through the q/k norm weights): larger is sharper attention.
    pub score_std: f32,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning { router_std: ROUTER_LOGIT_STD, branch_gain: 1.0, score_std: 3.0 }
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Debug, PartialEq)]
pub enum Init {
    /// Centred random values of this standard deviation.
    Random(f32),
    /// Within 5% of this value (norm weights, scales).
    Near(f32),
    /// Within 5% of this value, with a random sign.
    Signed(f32),
    /// Exactly these (f32 only).
    Values(Vec<f32>),
}

/// Which matrices of the routed experts a tensor holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPart {
    Gate,
    Up,
    /// Gate rows then up rows (Gemma 4).
    GateUp,
    Down,
}

#[derive(Clone, Debug)]
pub struct SynthTensor {
    pub name: String,
    pub dtype: DType,
    /// Outermost first.
    pub shape: Vec<usize>,
    pub init: Init,
    /// A routed-expert tensor `[n_experts, rows, cols]`: its layer and part.
    pub expert: Option<(usize, ExpertPart)>,
}

impl SynthTensor {
    pub fn bytes(&self) -> u64 {
        tensor_bytes(self.dtype, &self.shape).expect("synth shapes are whole blocks") as u64
    }

    /// Independent units: the experts of a 3-D tensor, or the tensor itself.
    fn units(&self) -> usize {
        if self.shape.len() == 3 { self.shape[0] } else { 1 }
    }

    /// `(rows, cols)` of one unit.
    fn rows_cols(&self) -> (usize, usize) {
        match self.shape.as_slice() {
            [c] => (1, *c),
            [.., r, c] => (*r, *c),
            [] => (1, 1),
        }
    }
}

/// A synthetic model: its metadata and its tensors, not yet generated.
pub struct Synth {
    pub opts: SynthOptions,
    pub metadata: Vec<(String, GgufValue)>,
    pub tensors: Vec<SynthTensor>,
}

/// What a matrix of `cols`-element rows is stored as, given the asked-for type.
pub fn matrix_type(quant: DType, cols: usize) -> DType {
    if cols.is_multiple_of(quant.block_elems()) {
        return quant;
    }
    let fallback = match quant {
        DType::Q4K => DType::Q5_0,
        DType::Q5K => DType::Q5_1,
        DType::Q6K => DType::Q8_0,
        _ => DType::F16,
    };
    if cols.is_multiple_of(fallback.block_elems()) { fallback } else { DType::F16 }
}

/// The output projection's type: Q6_K below 8 bits, the asked-for type otherwise.
fn output_type(quant: DType) -> DType {
    match quant {
        DType::F32 | DType::F16 | DType::BF16 | DType::Q8_0 => quant,
        _ => DType::Q6K,
    }
}

/// llama.cpp's `general.file_type` for a mostly-`quant` file.
fn file_type(quant: DType) -> u32 {
    match quant {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 7,
        DType::Q5_0 => 8,
        DType::Q5_1 => 9,
        DType::Q4K => 15,
        DType::Q5K => 17,
        DType::Q6K => 18,
        DType::BF16 => 32,
        DType::MXFP4 => 38,
    }
}

/// GPT-2's byte alphabet: printable bytes stand for themselves, the rest for U+0100 on.
pub fn byte_token(b: u8) -> char {
    let printable = |b: u8| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        b as char
    } else {
        let n = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(0x100 + n).expect("U+0100..U+0143")
    }
}

/// Special tokens after the 256 bytes.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n\
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Each layer's router bias for a skew: `ln p_e`, `p_e ∝ (rank_e + 1)^-alpha` over a
/// random ranking of the experts.
pub fn router_bias(n_experts: usize, alpha: f32, seed: u64, layer: usize) -> Vec<f32> {
    let mut rng = Rng::new(mix(seed, mix(hash_name("router-bias"), layer as u64)));
    // Fisher-Yates: rank[e] is expert e's place in the popularity order.
    let mut order: Vec<usize> = (0..n_experts).collect();
    for i in (1..n_experts).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let z: f64 = (1..=n_experts).map(|r| (r as f64).powf(-alpha as f64)).sum();
    let mut bias = vec![0f32; n_experts];
    for (rank, &e) in order.iter().enumerate() {
        bias[e] = (-(alpha as f64) * ((rank + 1) as f64).ln() - z.ln()) as f32;
    }
    bias
}

impl Synth {
    pub fn new(opts: SynthOptions) -> Result<Synth> {
        if !opts.skew.is_finite() || opts.skew < 0.0 {
            return Err(Error::Usage(format!("--skew must be a number >= 0, not {}", opts.skew)));
        }
        let g = &opts.geometry;
        if g.vocab < 256 + SPECIAL_TOKENS.len() {
            return Err(Error::Usage(format!(
                "a vocabulary of {} cannot hold the 259 byte and special tokens",
                g.vocab
            )));
        }
        let metadata = metadata(&opts);
        let tensors = tensors(&opts);
        Ok(Synth { opts, metadata, tensors })
    }

    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes()).sum()
    }

    /// Bytes of the routed experts.
    pub fn expert_bytes(&self) -> u64 {
        self.tensors.iter().filter(|t| t.expert.is_some()).map(|t| t.bytes()).sum()
    }

    /// Bytes of everything else (what stays resident).
    pub fn resident_bytes(&self) -> u64 {
        self.total_bytes() - self.expert_bytes()
    }

    /// Writes one unit (an expert of a 3-D tensor, or a whole tensor), chunk by chunk.
    fn write_unit(
        &self,
        t: &SynthTensor,
        unit: usize,
        out: &mut dyn Write,
        progress: &(dyn Fn(u64) + Sync),
    ) -> io::Result<()> {
        if let Init::Values(v) = &t.init {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            out.write_all(&bytes)?;
            progress(bytes.len() as u64);
            return Ok(());
        }
        let (rows, cols) = t.rows_cols();
        let row_bytes = t.dtype.bytes_for(cols).expect("whole blocks");
        let per_chunk = (CHUNK_BYTES / row_bytes).max(1);
        let mut buf = vec![0u8; per_chunk * row_bytes];
        let base = mix(self.opts.seed, mix(hash_name(&t.name), unit as u64));
        for (c, start) in (0..rows).step_by(per_chunk).enumerate() {
            let n = per_chunk.min(rows - start);
            let chunk = &mut buf[..n * row_bytes];
            let mut rng = Rng::new(mix(base, c as u64));
            match t.init {
                Init::Random(std) => fill_random(t.dtype, std, &mut rng, chunk),
                Init::Near(v) => fill_near(t.dtype, v, false, &mut rng, chunk),
                Init::Signed(v) => fill_near(t.dtype, v, true, &mut rng, chunk),
                Init::Values(_) => unreachable!("written above"),
            }
            out.write_all(chunk)?;
            progress(chunk.len() as u64);
        }
        Ok(())
    }

    fn gguf_writer<'a>(&'a self, progress: &'a (dyn Fn(u64) + Sync), experts: bool) -> GgufWriter<'a> {
        let mut w = GgufWriter::new();
        for (k, v) in &self.metadata {
            w.add(k, v.clone());
        }
        for t in self.tensors.iter().filter(|t| experts || t.expert.is_none()) {
            w.add_tensor_fn(&t.name, t.dtype, &t.shape, move |out| {
                (0..t.units()).try_for_each(|u| self.write_unit(t, u, out, progress))
            });
        }
        w
    }

    /// Writes the model as one GGUF file; `progress` hears of bytes as they are written.
    pub fn write_gguf(&self, path: &Path, progress: &(dyn Fn(u64) + Sync)) -> Result<()> {
        self.gguf_writer(progress, true).write(path)
    }

    /// Writes the model in the packed layout (what `sluice pack` makes of the GGUF form,
    /// byte for byte in its experts) into the folder `dir`.
    pub fn write_packed(&self, dir: &Path, progress: &(dyn Fn(u64) + Sync)) -> Result<PackSummary> {
        let created = pack::prepare_dir(dir)?;
        let result = self.write_packed_into(dir, progress);
        if result.is_err() && created {
            let _ = std::fs::remove_dir_all(dir);
        }
        result
    }

    fn write_packed_into(&self, dir: &Path, progress: &(dyn Fn(u64) + Sync)) -> Result<PackSummary> {
        let g = &self.opts.geometry;
        let model_file = dir.join(pack::MODEL_GGUF);
        self.gguf_writer(progress, false).write(&model_file)?;

        // Per MoE layer, its expert tensors in the order gate, up, down (or gate_up, down).
        let mut layers: Vec<(usize, Vec<&SynthTensor>)> = Vec::new();
        for t in &self.tensors {
            if let Some((l, _)) = t.expert {
                match layers.last_mut() {
                    Some((last, ts)) if *last == l => ts.push(t),
                    _ => layers.push((l, vec![t])),
                }
            }
        }
        let (i, h) = (g.expert_ffn, g.hidden);
        let shapes: Vec<(usize, Vec<[MatShape; 3]>)> = layers
            .iter()
            .map(|(l, ts)| {
                let part = |p: ExpertPart| ts.iter().find(|t| t.expert.map(|x| x.1) == Some(p)).map(|t| t.dtype);
                let gate = part(ExpertPart::Gate).or(part(ExpertPart::GateUp)).expect("gate experts");
                let up = part(ExpertPart::Up).or(part(ExpertPart::GateUp)).expect("up experts");
                let down = part(ExpertPart::Down).expect("down experts");
                let m = [
                    MatShape { dtype: gate, shape: [i, h] },
                    MatShape { dtype: up, shape: [i, h] },
                    MatShape { dtype: down, shape: [h, i] },
                ];
                (*l, vec![m; g.n_experts])
            })
            .collect();
        let experts_path = dir.join(pack::EXPERTS_FILE);
        let (entries, total) = pack::layout(&shapes, &experts_path)?;
        let mut w = ExpertsWriter::create(&experts_path)?;
        let mut buf = Vec::new();
        let io = |e| Error::io(&experts_path, e);
        for ((_, ts), entry) in layers.iter().zip(&entries) {
            for (e, x) in entry.experts.iter().enumerate() {
                for t in ts {
                    buf.clear();
                    self.write_unit(t, e, &mut buf, progress).map_err(io)?;
                    match t.expert.map(|x| x.1) {
                        Some(ExpertPart::Gate) => w.put(&x.gate, &buf)?,
                        Some(ExpertPart::Up) => w.put(&x.up, &buf)?,
                        Some(ExpertPart::Down) => w.put(&x.down, &buf)?,
                        Some(ExpertPart::GateUp) => {
                            let half = buf.len() / 2;
                            w.put(&x.gate, &buf[..half])?;
                            w.put(&x.up, &buf[half..])?;
                        }
                        None => unreachable!("expert tensors only"),
                    }
                }
            }
        }
        w.finish(total)?;
        let source = SourceInfo { path: self.describe(), bytes: self.total_bytes() };
        let mut manifest = pack::Manifest::new(source, pack::MODEL_GGUF, total, entries);
        // What the GGUF form's reader calls the weight type.
        let dominant = crate::gguf_config::dominant_type(self.tensors.iter().map(|t| (t.dtype, t.shape.as_slice())));
        manifest.weight_dtype = dominant.map(|d| d.name().to_string());
        manifest.save(dir)?;
        let model_bytes = std::fs::metadata(&model_file).map_err(|e| Error::io(&model_file, e))?.len();
        Ok(PackSummary {
            dir: dir.to_path_buf(),
            model_file,
            model_bytes,
            experts_bytes: total,
            moe_layers: layers.len(),
            experts: layers.len() * g.n_experts,
        })
    }

    /// The command that makes this model: `synth --geometry qwen3-30b-a3b --layers 48 ...`.
    pub fn describe(&self) -> String {
        describe_opts(&self.opts)
    }
}

fn metadata(o: &SynthOptions) -> Vec<(String, GgufValue)> {
    let g = &o.geometry;
    let mut m: Vec<(String, GgufValue)> = Vec::new();
    let mut put = |k: &str, v: GgufValue| m.push((k.to_string(), v));
    let u32v = |x: usize| GgufValue::U32(x as u32);
    let a = match g.arch {
        Arch::Qwen3Moe => "qwen3moe",
        Arch::Gemma4 => "gemma4",
        Arch::GptOss => "gpt-oss",
        Arch::DeepSeek2(_) => "deepseek2",
        Arch::Qwen35Moe(_) => "qwen35moe",
    };
    let key = |k: &str| format!("{a}.{k}");
    put("general.architecture", GgufValue::String(a.into()));
    put("general.name", GgufValue::String(format!("sluice synthetic {}", g.name)));
    put("general.description", GgufValue::String(format!("random weights: sluice {}", describe_opts(o))));
    put(&key("block_count"), u32v(g.n_layers));
    put(&key("context_length"), u32v(g.context));
    put(&key("embedding_length"), u32v(g.hidden));
    put(&key("feed_forward_length"), u32v(g.dense_ffn));
    put(&key("attention.head_count"), u32v(g.n_heads));
    match (g.interleaved, g.arch) {
        (None, Arch::DeepSeek2(m)) => {
            // As llama.cpp's converter writes DeepSeek-V3: one latent KV head,
            // `key_length` / `value_length` the latent's, the heads' own in `*_mla`.
            put(&key("attention.head_count_kv"), u32v(1));
            put(&key("rope.freq_base"), GgufValue::F32(g.rope_theta));
            put(&key("attention.key_length"), u32v(m.kv_lora_rank + m.rope_dim));
            put(&key("attention.value_length"), u32v(m.kv_lora_rank));
            put(&key("attention.key_length_mla"), u32v(m.nope_dim + m.rope_dim));
            put(&key("attention.value_length_mla"), u32v(m.v_dim));
            put(&key("attention.q_lora_rank"), u32v(m.q_lora_rank));
            put(&key("attention.kv_lora_rank"), u32v(m.kv_lora_rank));
            put(&key("rope.dimension_count"), u32v(m.rope_dim));
            put(&key("leading_dense_block_count"), u32v(m.dense_layers));
            put(&key("expert_shared_count"), u32v(m.shared));
            put(&key("expert_group_count"), u32v(m.n_groups));
            put(&key("expert_group_used_count"), u32v(m.topk_groups));
            put(&key("expert_gating_func"), u32v(2));
            put(&key("expert_weights_scale"), GgufValue::F32(2.5));
            put(&key("expert_weights_norm"), GgufValue::Bool(true));
            put(&key("rope.scaling.type"), GgufValue::String("yarn".into()));
            put(&key("rope.scaling.factor"), GgufValue::F32(40.0));
            put(&key("rope.scaling.original_context_length"), u32v(4096));
            put(&key("rope.scaling.yarn_beta_fast"), GgufValue::F32(32.0));
            put(&key("rope.scaling.yarn_beta_slow"), GgufValue::F32(1.0));
            put(&key("rope.scaling.yarn_log_multiplier"), GgufValue::F32(0.1));
        }
        (None, Arch::Qwen35Moe(d)) => {
            // As llama.cpp's converter writes Qwen3.5-MoE (without its prediction layers).
            put(&key("attention.head_count_kv"), u32v(g.n_kv_heads));
            put(&key("rope.freq_base"), GgufValue::F32(g.rope_theta));
            put(&key("attention.key_length"), u32v(g.head_dim));
            put(&key("attention.value_length"), u32v(g.head_dim));
            put(&key("rope.dimension_count"), u32v(d.rope_dim));
            // The multimodal RoPE's split of the rotated pairs (text, height, width; the
            // published [11, 11, 10] of 32 pairs). Text positions are the same in all
            // three, so it changes nothing for text; llama.cpp requires the key.
            let pairs = (d.rope_dim / 2) as u32;
            let first = pairs.div_ceil(3);
            let sections = [first, first, pairs.saturating_sub(2 * first), 0];
            put(&key("rope.dimension_sections"), GgufValue::Array(sections.map(GgufValue::U32).to_vec()));
            put(&key("ssm.conv_kernel"), u32v(d.conv_kernel));
            put(&key("ssm.state_size"), u32v(d.k_dim));
            put(&key("ssm.group_count"), u32v(d.k_heads));
            put(&key("ssm.time_step_rank"), u32v(d.v_heads));
            put(&key("ssm.inner_size"), u32v(d.v_heads * d.v_dim));
            put(&key("full_attention_interval"), u32v(d.interval));
            put(&key("expert_shared_feed_forward_length"), u32v(d.shared_ffn));
        }
        (None, _) => {
            put(&key("attention.head_count_kv"), u32v(g.n_kv_heads));
            put(&key("rope.freq_base"), GgufValue::F32(g.rope_theta));
            put(&key("attention.key_length"), u32v(g.head_dim));
            put(&key("attention.value_length"), u32v(g.head_dim));
        }
        (Some(i), _) => {
            let kv = (0..g.n_layers).map(|l| u32v(g.attention(l).0)).collect();
            put(&key("attention.head_count_kv"), GgufValue::Array(kv));
            put(&key("rope.freq_base"), GgufValue::F32(g.rope_theta));
            put(&key("rope.freq_base_swa"), GgufValue::F32(i.rope_theta_swa));
            put(&key("attention.sliding_window"), u32v(i.window));
            let pattern = (0..g.n_layers).map(|l| GgufValue::Bool(!g.is_full(l))).collect();
            put(&key("attention.sliding_window_pattern"), GgufValue::Array(pattern));
            put(&key("attention.shared_kv_layers"), u32v(0));
            put(&key("embedding_length_per_layer_input"), u32v(0));
            put(&key("attention.key_length"), u32v(i.full_head_dim));
            put(&key("attention.value_length"), u32v(i.full_head_dim));
            put(&key("attention.key_length_swa"), u32v(g.head_dim));
            put(&key("attention.value_length_swa"), u32v(g.head_dim));
            put(&key("rope.dimension_count"), u32v(i.full_head_dim));
            put(&key("rope.dimension_count_swa"), u32v(g.head_dim));
        }
    }
    if g.arch == Arch::GptOss {
        // What llama.cpp's converter writes for gpt-oss's config (YaRN, factor 32 over
        // 4096 positions).
        put(&key("attention.sliding_window"), u32v(GPT_OSS_WINDOW));
        put(&key("rope.scaling.type"), GgufValue::String("yarn".into()));
        put(&key("rope.scaling.factor"), GgufValue::F32(32.0));
        put(&key("rope.scaling.original_context_length"), u32v(4096));
        put(&key("rope.scaling.yarn_beta_fast"), GgufValue::F32(32.0));
        put(&key("rope.scaling.yarn_beta_slow"), GgufValue::F32(1.0));
    }
    put(&key("attention.layer_norm_rms_epsilon"), GgufValue::F32(g.rms_eps));
    if let Some(c) = g.softcap {
        put(&key("final_logit_softcapping"), GgufValue::F32(c));
    }
    put(&key("expert_count"), u32v(g.n_experts));
    put(&key("expert_used_count"), u32v(g.top_k));
    put(&key("expert_feed_forward_length"), u32v(g.expert_ffn));
    put("general.file_type", GgufValue::U32(file_type(o.quant)));
    put("general.quantization_version", GgufValue::U32(2));

    let mut tokens: Vec<GgufValue> = (0..=255u8).map(|b| GgufValue::String(byte_token(b).to_string())).collect();
    let mut types: Vec<GgufValue> = vec![GgufValue::I32(1); 256];
    for s in SPECIAL_TOKENS {
        tokens.push(GgufValue::String(s.into()));
        types.push(GgufValue::I32(3));
    }
    for i in 0..g.vocab - tokens.len() {
        tokens.push(GgufValue::String(format!("<unused_{i}>")));
        // llama.cpp's LLAMA_TOKEN_TYPE_UNUSED: in the vocabulary, never matched as text.
        types.push(GgufValue::I32(5));
    }
    let (eot, im_end) = (256u32, 258u32);
    put("tokenizer.ggml.model", GgufValue::String("gpt2".into()));
    put("tokenizer.ggml.pre", GgufValue::String("qwen2".into()));
    put("tokenizer.ggml.tokens", GgufValue::Array(tokens));
    put("tokenizer.ggml.token_type", GgufValue::Array(types));
    put("tokenizer.ggml.merges", GgufValue::Array(Vec::new()));
    put("tokenizer.ggml.eos_token_id", GgufValue::U32(im_end));
    put("tokenizer.ggml.padding_token_id", GgufValue::U32(eot));
    put("tokenizer.ggml.bos_token_id", GgufValue::U32(eot));
    put("tokenizer.ggml.add_bos_token", GgufValue::Bool(false));
    put("tokenizer.chat_template", GgufValue::String(CHATML.into()));
    m
}

fn describe_opts(o: &SynthOptions) -> String {
    format!(
        "synth --geometry {} --layers {} --quant {} --skew {} --seed {}",
        o.geometry.name,
        o.geometry.n_layers,
        o.quant.name().to_ascii_lowercase(),
        o.skew,
        o.seed
    )
}

/// Collects tensors in file order.
#[derive(Default)]
struct Tensors(Vec<SynthTensor>);

impl Tensors {
    fn push(&mut self, name: String, dtype: DType, shape: &[usize], init: Init, expert: Option<(usize, ExpertPart)>) {
        self.0.push(SynthTensor { name, dtype, shape: shape.to_vec(), init, expert });
    }

    /// A matrix `[.., rows, cols]` whose outputs have `gain` times the variance of its
    /// unit-variance inputs.
    fn mat(&mut self, name: String, quant: DType, shape: &[usize], gain: f32) {
        let cols = *shape.last().expect("a shape");
        self.push(name, matrix_type(quant, cols), shape, Init::Random(gain * (cols as f32).powf(-0.5)), None);
    }

    fn norm(&mut self, name: String, width: usize, center: f32) {
        self.push(name, DType::F32, &[width], Init::Near(center), None);
    }

    fn experts(&mut self, name: String, quant: DType, shape: [usize; 3], gain: f32, layer: usize, part: ExpertPart) {
        let (cols, std) = (shape[2], gain * (shape[2] as f32).powf(-0.5));
        self.push(name, matrix_type(quant, cols), &shape, Init::Random(std), Some((layer, part)));
    }
}

fn tensors(o: &SynthOptions) -> Vec<SynthTensor> {
    let g = &o.geometry;
    let q = o.quant;
    let (h, e, i) = (g.hidden, g.n_experts, g.expert_ffn);
    let gemma = g.arch == Arch::Gemma4;
    // Gemma 4 ties the output projection to the embedding.
    let tied = gemma;
    let tu = o.tuning;
    // Residual branches' output projections.
    let out = tu.branch_gain / (2.0 * g.full_layers as f32).sqrt();
    let mut t = Tensors::default();

    // The residual starts at unit RMS: Gemma multiplies its embedding by sqrt(hidden).
    let embd = if tied { matrix_type(output_type(q), h) } else { matrix_type(q, h) };
    let embd_std = if gemma { (h as f32).powf(-0.5) } else { 1.0 };
    t.push("token_embd.weight".into(), embd, &[g.vocab, h], Init::Random(embd_std), None);
    if let Some(il) = g.interleaved {
        // Proportional RoPE on full layers: divisor 1 for the rotated pairs, 1e30 (no
        // rotation) for the rest.
        let pairs = il.full_head_dim / 2;
        let rotated = (il.full_rotary_fraction * pairs as f32) as usize;
        let f = (0..pairs).map(|p| if p < rotated { 1.0 } else { 1e30 }).collect();
        t.push("rope_freqs.weight".into(), DType::F32, &[pairs], Init::Values(f), None);
    }

    for l in 0..g.n_layers {
        match g.arch {
            Arch::GptOss => {
                gpt_oss_layer(&mut t, o, l, out);
                continue;
            }
            Arch::DeepSeek2(m) => {
                deepseek_layer(&mut t, o, (l, m), out);
                continue;
            }
            Arch::Qwen35Moe(d) => {
                qwen35_layer(&mut t, o, (l, d), out);
                continue;
            }
            _ => {}
        }
        let n = |s: &str| format!("blk.{l}.{s}");
        let (kv, hd) = g.attention(l);
        let (qd, kvd) = (g.n_heads * hd, kv * hd);
        t.norm(n("attn_norm.weight"), h, 1.0);
        t.mat(n("attn_q.weight"), q, &[qd, h], 1.0);
        t.mat(n("attn_k.weight"), q, &[kvd, h], 1.0);
        // Gemma 4's full layers take V from K.
        if !(gemma && g.is_full(l)) {
            t.mat(n("attn_v.weight"), q, &[kvd, h], 1.0);
        }
        t.mat(n("attn_output.weight"), q, &[h, qd], out);
        // q and k leave their norms at RMS w: the scores q·k·scale have standard deviation
        // w² (Qwen scales by hd^-1/2) or w² sqrt(hd) (Gemma 4 does not scale).
        let qk = tu.score_std.sqrt() * if gemma { (hd as f32).powf(-0.25) } else { 1.0 };
        t.norm(n("attn_q_norm.weight"), hd, qk);
        t.norm(n("attn_k_norm.weight"), hd, qk);
        if gemma {
            // Gemma 4 norms each block's output before adding it: the branch scale goes
            // into that norm's weight.
            t.norm(n("post_attention_norm.weight"), h, out);
        }
        t.norm(n("ffn_norm.weight"), h, 1.0);
        if gemma {
            let f = g.dense_ffn;
            t.mat(n("ffn_gate.weight"), q, &[f, h], 1.0);
            t.mat(n("ffn_up.weight"), q, &[f, h], 1.0);
            t.mat(n("ffn_down.weight"), q, &[h, f], out);
            t.norm(n("post_ffw_norm.weight"), h, out);
        }
        // The router: logits of ROUTER_LOGIT_STD for its input. Qwen feeds it the normed
        // residual (unit RMS); Gemma 4 a weightless norm times its scale and hidden^-1/2.
        let router_std = if gemma { tu.router_std } else { tu.router_std * (h as f32).powf(-0.5) };
        t.push(n("ffn_gate_inp.weight"), DType::F32, &[e, h], Init::Random(router_std), None);
        if o.skew > 0.0 {
            let bias = router_bias(e, o.skew, o.seed, l);
            t.push(n("ffn_gate_inp.bias"), DType::F32, &[e], Init::Values(bias), None);
        }
        if gemma {
            t.norm(n("ffn_gate_inp.scale"), h, 1.0);
            t.norm(n("ffn_down_exps.scale"), e, 1.0);
            t.norm(n("post_ffw_norm_1.weight"), h, 1.0);
            t.norm(n("pre_ffw_norm_2.weight"), h, 1.0);
            t.norm(n("post_ffw_norm_2.weight"), h, 1.0);
            t.experts(n("ffn_gate_up_exps.weight"), q, [e, 2 * i, h], 1.0, l, ExpertPart::GateUp);
        } else {
            t.experts(n("ffn_gate_exps.weight"), q, [e, i, h], 1.0, l, ExpertPart::Gate);
            t.experts(n("ffn_up_exps.weight"), q, [e, i, h], 1.0, l, ExpertPart::Up);
        }
        t.experts(n("ffn_down_exps.weight"), q, [e, h, i], out, l, ExpertPart::Down);
    }
    // A tied output projection meets the current token's own embedding in the residual,
    // which would make every token predict itself: random signs in the final norm cancel
    // that alignment (the self-logit becomes as random as any other).
    let final_norm = if tied { Init::Signed(1.0) } else { Init::Near(1.0) };
    t.push("output_norm.weight".into(), DType::F32, &[h], final_norm, None);
    if !tied {
        t.mat("output.weight".into(), output_type(q), &[g.vocab, h], 1.0);
    }
    t.0
}

/// One gpt-oss layer, in llama.cpp's converter's names: biases beside every
/// projection, the router and the experts; a sink logit per head; the experts' norm is
/// `post_attention_norm`. `out` scales the residual branches' output projections.
fn gpt_oss_layer(t: &mut Tensors, o: &SynthOptions, l: usize, out: f32) {
    let (g, q, tu) = (&o.geometry, o.quant, o.tuning);
    let (h, e, i, hd) = (g.hidden, g.n_experts, g.expert_ffn, g.head_dim);
    let (qd, kvd) = (g.n_heads * hd, g.n_kv_heads * hd);
    let n = |s: &str| format!("blk.{l}.{s}");
    let bias =
        |t: &mut Tensors, name: String, shape: &[usize]| t.push(name, DType::F32, shape, Init::Random(0.02), None);
    t.norm(n("attn_norm.weight"), h, 1.0);
    // No q/k norms: q and k of RMS score_std^1/2 make scores q·k·hd^-1/2 of spread score_std.
    let qk = tu.score_std.sqrt();
    t.mat(n("attn_q.weight"), q, &[qd, h], qk);
    t.mat(n("attn_k.weight"), q, &[kvd, h], qk);
    t.mat(n("attn_v.weight"), q, &[kvd, h], 1.0);
    t.mat(n("attn_output.weight"), q, &[h, qd], out);
    bias(t, n("attn_q.bias"), &[qd]);
    bias(t, n("attn_k.bias"), &[kvd]);
    bias(t, n("attn_v.bias"), &[kvd]);
    bias(t, n("attn_output.bias"), &[h]);
    t.push(n("attn_sinks.weight"), DType::F32, &[g.n_heads], Init::Random(1.0), None);
    t.norm(n("post_attention_norm.weight"), h, 1.0);
    t.push(n("ffn_gate_inp.weight"), DType::F32, &[e, h], Init::Random(tu.router_std * (h as f32).powf(-0.5)), None);
    // gpt-oss's router always has a bias; the skew's popularity is all of it.
    let router_bias = if o.skew > 0.0 { router_bias(e, o.skew, o.seed, l) } else { vec![0.0; e] };
    t.push(n("ffn_gate_inp.bias"), DType::F32, &[e], Init::Values(router_bias), None);
    let x = DType::MXFP4;
    t.experts(n("ffn_gate_exps.weight"), x, [e, i, h], 1.0, l, ExpertPart::Gate);
    t.experts(n("ffn_up_exps.weight"), x, [e, i, h], 1.0, l, ExpertPart::Up);
    t.experts(n("ffn_down_exps.weight"), x, [e, h, i], out, l, ExpertPart::Down);
    bias(t, n("ffn_gate_exps.bias"), &[e, i]);
    bias(t, n("ffn_up_exps.bias"), &[e, i]);
    bias(t, n("ffn_down_exps.bias"), &[e, h]);
}

/// One DeepSeek-V3 layer, in llama.cpp's converter's names: the latent attention's
/// bottlenecks and per-head up-projections (`attn_k_b` transposed), a dense MLP on the
/// first layers, else sigmoid-routed experts with a correction bias (`exp_probs_b`,
/// the skew's popularity at a tenth of its log, sigmoid scores being at most 1) beside
/// the shared experts. `out` scales the residual branches' output projections.
fn deepseek_layer(t: &mut Tensors, o: &SynthOptions, (l, m): (usize, SynthMla), out: f32) {
    let (g, q, tu) = (&o.geometry, o.quant, o.tuning);
    let (h, e, i, heads) = (g.hidden, g.n_experts, g.expert_ffn, g.n_heads);
    let (c, qk) = (m.kv_lora_rank, m.nope_dim + m.rope_dim);
    let n = |s: &str| format!("blk.{l}.{s}");
    t.norm(n("attn_norm.weight"), h, 1.0);
    t.mat(n("attn_q_a.weight"), q, &[m.q_lora_rank, h], 1.0);
    t.norm(n("attn_q_a_norm.weight"), m.q_lora_rank, 1.0);
    // Scores of spread about score_std: the query's latent part meets the unit-RMS
    // latent over kv_lora_rank dims, scaled by (nope + rope)^-1/2.
    let qk_gain = (tu.score_std * (qk as f32 / c as f32).sqrt()).sqrt();
    t.mat(n("attn_q_b.weight"), q, &[heads * qk, m.q_lora_rank], qk_gain);
    t.mat(n("attn_kv_a_mqa.weight"), q, &[c + m.rope_dim, h], 1.0);
    t.norm(n("attn_kv_a_norm.weight"), c, 1.0);
    t.mat(n("attn_k_b.weight"), q, &[heads, c, m.nope_dim], qk_gain);
    t.mat(n("attn_v_b.weight"), q, &[heads, m.v_dim, c], 1.0);
    t.mat(n("attn_output.weight"), q, &[h, heads * m.v_dim], out);
    t.norm(n("ffn_norm.weight"), h, 1.0);
    if l < m.dense_layers {
        let f = g.dense_ffn;
        t.mat(n("ffn_gate.weight"), q, &[f, h], 1.0);
        t.mat(n("ffn_up.weight"), q, &[f, h], 1.0);
        t.mat(n("ffn_down.weight"), q, &[h, f], out);
        return;
    }
    t.push(n("ffn_gate_inp.weight"), DType::F32, &[e, h], Init::Random(tu.router_std * (h as f32).powf(-0.5)), None);
    let bias = if o.skew > 0.0 {
        router_bias(e, o.skew, o.seed, l).into_iter().map(|b| 0.1 * b).collect()
    } else {
        vec![0.0; e]
    };
    t.push(n("exp_probs_b.bias"), DType::F32, &[e], Init::Values(bias), None);
    t.experts(n("ffn_gate_exps.weight"), q, [e, i, h], 1.0, l, ExpertPart::Gate);
    t.experts(n("ffn_up_exps.weight"), q, [e, i, h], 1.0, l, ExpertPart::Up);
    t.experts(n("ffn_down_exps.weight"), q, [e, h, i], out, l, ExpertPart::Down);
    let s = m.shared * i;
    t.mat(n("ffn_gate_shexp.weight"), q, &[s, h], 1.0);
    t.mat(n("ffn_up_shexp.weight"), q, &[s, h], 1.0);
    t.mat(n("ffn_down_shexp.weight"), q, &[h, s], out);
}

/// One Qwen3.5-MoE layer, in llama.cpp's converter's names (norms stored as the
/// weights they multiply by): a Gated DeltaNet, or on every `interval`-th layer gated
/// full attention with q/k norms; routed experts beside a shared expert and its gate.
fn qwen35_layer(t: &mut Tensors, o: &SynthOptions, (l, d): (usize, SynthDelta), out: f32) {
    let (g, q, tu) = (&o.geometry, o.quant, o.tuning);
    let (h, e, i) = (g.hidden, g.n_experts, g.expert_ffn);
    let n = |s: &str| format!("blk.{l}.{s}");
    t.norm(n("attn_norm.weight"), h, 1.0);
    if (l + 1) % d.interval != 0 {
        let (kd, vd) = (d.k_heads * d.k_dim, d.v_heads * d.v_dim);
        let conv = 2 * kd + vd;
        t.mat(n("attn_qkv.weight"), q, &[conv, h], 1.0);
        t.mat(n("attn_gate.weight"), q, &[vd, h], 1.0);
        t.push(n("ssm_beta.weight"), DType::F32, &[d.v_heads, h], Init::Random((h as f32).powf(-0.5)), None);
        t.push(n("ssm_alpha.weight"), DType::F32, &[d.v_heads, h], Init::Random((h as f32).powf(-0.5)), None);
        // A causal kernel that mostly passes the current input on.
        t.push(n("ssm_conv1d.weight"), DType::F32, &[conv, d.conv_kernel], Init::Random(0.5), None);
        // Decay rates between e^-0.5 and e^-8 a token's worth, as trained models spread them.
        let a: Vec<f32> = (0..d.v_heads).map(|j| -(0.5 + 7.5 * j as f32 / d.v_heads as f32)).collect();
        t.push(n("ssm_a"), DType::F32, &[d.v_heads], Init::Values(a), None);
        t.push(n("ssm_dt.bias"), DType::F32, &[d.v_heads], Init::Random(0.5), None);
        t.norm(n("ssm_norm.weight"), d.v_dim, 1.0);
        t.mat(n("ssm_out.weight"), q, &[h, vd], out);
    } else {
        let (hd, qd, kvd) = (g.head_dim, g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim);
        t.mat(n("attn_q.weight"), q, &[2 * qd, h], 1.0);
        t.mat(n("attn_k.weight"), q, &[kvd, h], 1.0);
        t.mat(n("attn_v.weight"), q, &[kvd, h], 1.0);
        t.mat(n("attn_output.weight"), q, &[h, qd], out);
        // q and k leave their norms at RMS w: the scores q·k·hd^-1/2 spread as w².
        let qk = tu.score_std.sqrt();
        t.norm(n("attn_q_norm.weight"), hd, qk);
        t.norm(n("attn_k_norm.weight"), hd, qk);
    }
    t.norm(n("post_attention_norm.weight"), h, 1.0);
    t.push(n("ffn_gate_inp.weight"), DType::F32, &[e, h], Init::Random(tu.router_std * (h as f32).powf(-0.5)), None);
    if o.skew > 0.0 {
        t.push(n("ffn_gate_inp.bias"), DType::F32, &[e], Init::Values(router_bias(e, o.skew, o.seed, l)), None);
    }
    t.experts(n("ffn_gate_exps.weight"), q, [e, i, h], 1.0, l, ExpertPart::Gate);
    t.experts(n("ffn_up_exps.weight"), q, [e, i, h], 1.0, l, ExpertPart::Up);
    t.experts(n("ffn_down_exps.weight"), q, [e, h, i], out, l, ExpertPart::Down);
    let s = d.shared_ffn;
    t.mat(n("ffn_gate_shexp.weight"), q, &[s, h], 1.0);
    t.mat(n("ffn_up_shexp.weight"), q, &[s, h], 1.0);
    t.mat(n("ffn_down_shexp.weight"), q, &[h, s], out);
    t.push(n("ffn_gate_inp_shexp.weight"), DType::F32, &[1, h], Init::Random((h as f32).powf(-0.5)), None);
}

/// A fast generator (wyrand): 64 bits a multiply.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    #[inline]
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = (self.0 as u128).wrapping_mul((self.0 ^ 0xe703_7ed1_a0b4_28db) as u128);
        ((t >> 64) as u64) ^ (t as u64)
    }

    fn fill(&mut self, b: &mut [u8]) {
        let mut chunks = b.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let v = self.next().to_le_bytes();
            rest.copy_from_slice(&v[..rest.len()]);
        }
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Roughly standard normal: the centred sum of four uniforms (Irwin-Hall), scaled.
    fn normal(&mut self) -> f32 {
        let r = self.next();
        let s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        (s as f32 / 65536.0 - 2.0) * 3f32.sqrt()
    }

    /// Uniform in 0..n.
    fn below(&mut self, n: usize) -> usize {
        ((self.next() as u128 * n as u128) >> 64) as usize
    }
}

/// splitmix64's finaliser.
fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn mix(a: u64, b: u64) -> u64 {
    splitmix(a ^ splitmix(b))
}

/// FNV-1a.
fn hash_name(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

fn f16(x: f32) -> half::f16 {
    half::f16::from_f32(x)
}

/// The 12 bytes of a Q4_K / Q5_K super-block's eight 6-bit scales and mins (the inverse
/// of `sluice_core::quant::k_scale_min`).
pub fn pack_k_scales(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    s
}

/// Eight sub-block scales in 16..48 (RMS 32.8) and the mins that centre each sub-block
/// when `dmin = ratio * d`: `m = sc * mid / ratio`, `mid` the middle quant.
fn k_scales(rng: &mut Rng, mid: f32, ratio: f32) -> [u8; 12] {
    let r = rng.next();
    let sc: [u8; 8] = std::array::from_fn(|j| 16 + ((r >> (5 * j)) & 31) as u8);
    let m: [u8; 8] = std::array::from_fn(|j| (sc[j] as f32 * mid / ratio).round() as u8);
    pack_k_scales(&sc, &m)
}

/// RMS of the K-quant sub-block scales [`k_scales`] draws (16..=47).
const K_SCALE_RMS: f32 = 32.83;
/// Standard deviation of a uniform quant over 16, 32 and 64 levels.
const SD16: f32 = 4.610;
const SD32: f32 = 9.233;
const SD64: f32 = 18.47;

/// Random blocks of `dtype` whose elements have standard deviation `std`, centred.
fn fill_random(dtype: DType, std: f32, rng: &mut Rng, out: &mut [u8]) {
    let bb = dtype.block_bytes();
    match dtype {
        DType::F32 => out.chunks_exact_mut(4).for_each(|c| c.copy_from_slice(&(rng.normal() * std).to_le_bytes())),
        DType::F16 => out.chunks_exact_mut(2).for_each(|c| c.copy_from_slice(&f16(rng.normal() * std).to_le_bytes())),
        DType::BF16 => out
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&half::bf16::from_f32(rng.normal() * std).to_le_bytes())),
        DType::Q8_0 => {
            // Uniform over -127..=127 (-128 folded to 0): standard deviation 73.3.
            let d = f16(std / 73.3).to_le_bytes();
            rng.fill(out);
            for b in out.chunks_exact_mut(bb) {
                b[..2].copy_from_slice(&d);
                b[2..].iter_mut().filter(|q| **q == 0x80).for_each(|q| *q = 0);
            }
        }
        DType::Q4_0 => {
            // d (q - 8) with q = 0 folded to 8: centred, standard deviation 4.18.
            let d = f16(std / 4.183).to_le_bytes();
            rng.fill(out);
            for b in out.chunks_exact_mut(bb) {
                b[..2].copy_from_slice(&d);
                for q in &mut b[2..] {
                    let (lo, hi) = (*q & 0x0F, *q >> 4);
                    *q = if lo == 0 { 8 } else { lo } | (if hi == 0 { 8 } else { hi } << 4);
                }
            }
        }
        DType::Q4_1 | DType::Q5_1 => {
            let (sd, mid) = if dtype == DType::Q4_1 { (SD16, 7.5) } else { (SD32, 15.5) };
            let d = f16(std / sd);
            let m = f16(-mid * d.to_f32()).to_le_bytes();
            let d = d.to_le_bytes();
            rng.fill(out);
            for b in out.chunks_exact_mut(bb) {
                b[..2].copy_from_slice(&d);
                b[2..4].copy_from_slice(&m);
            }
        }
        DType::Q5_0 => {
            let d = f16(std / SD32).to_le_bytes();
            rng.fill(out);
            out.chunks_exact_mut(bb).for_each(|b| b[..2].copy_from_slice(&d));
        }
        DType::MXFP4 => {
            // The doubled e2m1 values have RMS 5.85; the scale is a power of two.
            let e = ((std / 5.852).log2().round() + 128.0).clamp(2.0, 254.0) as u8;
            rng.fill(out);
            out.chunks_exact_mut(bb).for_each(|b| b[0] = e);
        }
        DType::Q4K | DType::Q5K => {
            // (d sc) q - (dmin m), q uniform over 16 or 32 levels, m centring it.
            let (sd, mid, ratio) = if dtype == DType::Q4K { (SD16, 7.5, 8.0) } else { (SD32, 15.5, 16.0) };
            let d = f16(std / (K_SCALE_RMS * sd));
            let dmin = f16(d.to_f32() * ratio).to_le_bytes();
            let d = d.to_le_bytes();
            for b in out.chunks_exact_mut(bb) {
                b[..2].copy_from_slice(&d);
                b[2..4].copy_from_slice(&dmin);
                b[4..16].copy_from_slice(&k_scales(rng, mid, ratio));
                rng.fill(&mut b[16..]);
            }
        }
        DType::Q6K => {
            // ql, qh random; 16 scales in 16..48; (d sc) (q - 32).
            let d = f16(std / (K_SCALE_RMS * SD64)).to_le_bytes();
            rng.fill(out);
            for b in out.chunks_exact_mut(bb) {
                b[192..208].iter_mut().for_each(|s| *s = 16 + (*s & 31));
                b[208..210].copy_from_slice(&d);
            }
        }
    }
}

/// Values within 5% of `v`, with random signs if `signed` (f32 only: norms and scales
/// are f32 here).
fn fill_near(dtype: DType, v: f32, signed: bool, rng: &mut Rng, out: &mut [u8]) {
    debug_assert_eq!(dtype, DType::F32);
    for c in out.chunks_exact_mut(4) {
        let u = rng.uniform();
        let mut x = v * (1.0 + 0.1 * (u - 0.5));
        if signed && rng.next() & 1 == 1 {
            x = -x;
        }
        c.copy_from_slice(&x.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::quant::{dequantize_row, k_scale_min};

    #[test]
    fn k_scales_round_trip() {
        let mut rng = Rng::new(3);
        for _ in 0..100 {
            let sc: [u8; 8] = std::array::from_fn(|_| rng.below(64) as u8);
            let m: [u8; 8] = std::array::from_fn(|_| rng.below(64) as u8);
            assert_eq!(k_scale_min(&pack_k_scales(&sc, &m)), (sc, m));
        }
    }

    #[test]
    fn random_blocks_have_the_asked_for_spread() {
        for dt in DType::ALL {
            for std in [0.011f32, 0.05, 1.0] {
                let n = 256 * 512;
                let mut bytes = vec![0u8; dt.bytes_for(n).unwrap()];
                fill_random(dt, std, &mut Rng::new(7), &mut bytes);
                let mut x = vec![0f32; n];
                dequantize_row(dt, &bytes, &mut x);
                let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
                let sd = (x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
                // MXFP4's scale is a power of two: within a factor of sqrt(2).
                let tol = if dt == DType::MXFP4 { 0.42 } else { 0.06 };
                assert!((sd / std as f64 - 1.0).abs() < tol, "{dt} std {std}: got {sd}");
                assert!(mean.abs() < 0.08 * std as f64, "{dt} std {std}: mean {mean}");
            }
        }
    }

    #[test]
    fn byte_tokens_are_gpt2s_alphabet() {
        assert_eq!(byte_token(b'a'), 'a');
        assert_eq!(byte_token(b' '), '\u{120}');
        assert_eq!(byte_token(0), '\u{100}');
        assert_eq!(byte_token(0xAD), '\u{143}');
        let all: std::collections::HashSet<char> = (0..=255u8).map(byte_token).collect();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn the_bias_is_a_zipf_law_over_a_permutation() {
        let b = router_bias(128, 1.2, 9, 3);
        let p: Vec<f64> = b.iter().map(|&x| (x as f64).exp()).collect();
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-5);
        let mut sorted = p.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        assert!((sorted[0] / sorted[1] - 2f64.powf(1.2)).abs() < 1e-3);
        assert_ne!(b, router_bias(128, 1.2, 9, 4), "each layer has its own ranking");
        assert!(router_bias(16, 0.0, 1, 0).iter().all(|&x| (x - (1.0f32 / 16.0).ln()).abs() < 1e-6));
    }

    #[test]
    fn fallback_types_follow_llama_cpp() {
        assert_eq!(matrix_type(DType::Q4K, 2048), DType::Q4K);
        assert_eq!(matrix_type(DType::Q4K, 704), DType::Q5_0);
        assert_eq!(matrix_type(DType::Q5K, 704), DType::Q5_1);
        assert_eq!(matrix_type(DType::Q6K, 2112), DType::Q8_0);
        assert_eq!(matrix_type(DType::Q8_0, 704), DType::Q8_0);
    }
}
