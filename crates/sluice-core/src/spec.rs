//! `ModelSpec`: one normalized description of any supported architecture.
//!
//! The format readers translate a `config.json` or GGUF metadata into this; the
//! families read only this. Everything a layer needs to know about its own shape
//! (head dim, KV heads, window, RoPE, whether it has experts) is per layer, because
//! Gemma 4 and its kin vary them from layer to layer.

use crate::DType;

/// The largest size or count a model's configuration may state (a dimension, a head
/// or expert count, a vocabulary, a context length). Real ones stay far below it (the
/// longest context, Llama 4 Scout's, is 10M positions); the readers refuse more, so
/// that a hostile config.json or GGUF cannot make sluice allocate what a number says
/// before any tensor has been checked against the file.
pub const MAX_CONFIG_SIZE: usize = 1 << 26;

/// The most layers a model may state (the deepest real MoE has 94): each layer is
/// described before its tensors are looked for.
pub const MAX_LAYERS: usize = 1 << 12;

/// Which family file runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Gemma 3 and Gemma 4 (the 26B-A4B MoE, the dense E2B/E4B with per-layer embeddings).
    Gemma,
    /// Llama-shaped decoders: Llama, Qwen2, Qwen3, Qwen3-MoE.
    Llama,
    /// gpt-oss: attention sinks, alternating sliding and full layers, routed experts
    /// with biases and a clamped SwiGLU on every layer.
    GptOss,
    /// DeepSeek-V3 (and V2's layout): multi-head latent attention, dense first
    /// layers, then sigmoid-routed experts beside shared experts.
    DeepSeek,
    /// Qwen3.5/3.6-MoE: Gated DeltaNet linear attention on most layers, gated full
    /// attention on the rest, routed experts beside a gated shared expert.
    Qwen35,
    /// Qwen4-Exp: Qwen3.5's layers on hyper-connections (several residual streams) in
    /// place of norms, QSA (indexed sparse) attention, hashed n-gram embeddings.
    Qwen4Exp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
    /// `1 / (1 + e^-x)` (output and shared-expert gates).
    Sigmoid,
}

/// How the two halves of a rotary pair are laid out in a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Element i pairs with i + head_dim/2 (Hugging Face `rotate_half`, NeoX).
    Half,
    /// Element 2i pairs with 2i + 1 (original Llama / GGUF llama).
    Interleaved,
}

impl RopeStyle {
    /// The two channels of rotary pair `p` in a head of `head_dim`.
    pub fn pair(self, p: usize, head_dim: usize) -> (usize, usize) {
        match self {
            RopeStyle::Half => (p, p + head_dim / 2),
            RopeStyle::Interleaved => (2 * p, 2 * p + 1),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    pub style: RopeStyle,
    /// One inverse frequency per rotary pair, `head_dim / 2` of them. A zero leaves
    /// its pair unrotated (proportional RoPE's "nope" part).
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor); 1 otherwise.
    pub attention_factor: f32,
}

/// The RoPE parameters as configs state them, before they become frequencies.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Frequencies divided by `factor`.
    Linear {
        factor: f32,
    },
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: f32,
    },
    /// Gemma 4 full-attention layers: only the first `partial` fraction of the pairs
    /// rotate, with exponents taken over the whole head dim.
    Proportional {
        partial: f32,
        factor: f32,
    },
    /// YaRN: pairs that turn fewer than `beta_slow` times over the original context
    /// are interpolated (divided by `factor`), those turning more than `beta_fast`
    /// times kept, with a linear ramp between; cos and sin are scaled by
    /// `attention_factor` (by default `0.1 ln(factor) + 1`). `truncate` rounds the
    /// ramp's ends to whole pairs (transformers' default; gpt-oss was trained without).
    Yarn {
        factor: f32,
        original_max_position: f32,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: Option<f32>,
        truncate: bool,
    },
}

impl RopeSpec {
    /// Computes the inverse frequencies the way `transformers` does, in f32, so that
    /// the angles agree with the reference to the last bit where possible.
    pub fn new(style: RopeStyle, theta: f32, head_dim: usize, rotary_dim: usize, scaling: &RopeScaling) -> Self {
        let half = head_dim / 2;
        let mut inv_freq = vec![0f32; half];
        match *scaling {
            RopeScaling::Proportional { partial, factor } => {
                let angles = ((partial as f64) * head_dim as f64 / 2.0) as usize;
                for (i, f) in inv_freq.iter_mut().enumerate().take(angles.min(half)) {
                    *f = 1.0 / theta.powf((2 * i) as f32 / head_dim as f32) / factor;
                }
            }
            _ => {
                // Partial rotary (rotary_dim < head_dim) rotates the first rotary_dim dims.
                let rot_half = (rotary_dim / 2).min(half);
                for (i, f) in inv_freq.iter_mut().enumerate().take(rot_half) {
                    *f = 1.0 / theta.powf((2 * i) as f32 / rotary_dim as f32);
                }
                let rot = &mut inv_freq[..rot_half];
                match *scaling {
                    RopeScaling::Linear { factor } => rot.iter_mut().for_each(|f| *f /= factor),
                    RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                        let low_wavelen = original_max_position / low_freq_factor;
                        let high_wavelen = original_max_position / high_freq_factor;
                        for f in rot.iter_mut() {
                            let wavelen = 2.0 * std::f32::consts::PI / *f;
                            if wavelen > low_wavelen {
                                *f /= factor;
                            } else if wavelen >= high_wavelen {
                                let smooth = (original_max_position / wavelen - low_freq_factor)
                                    / (high_freq_factor - low_freq_factor);
                                *f = (1.0 - smooth) * *f / factor + smooth * *f;
                            }
                        }
                    }
                    RopeScaling::Yarn {
                        factor,
                        original_max_position,
                        beta_fast,
                        beta_slow,
                        attention_factor,
                        truncate,
                    } => {
                        // As transformers' `_compute_yarn_parameters`: the ramp's ends in
                        // pairs, from the number of turns a pair makes over the original
                        // context, computed in f64 as Python does.
                        let dim = rotary_dim as f64;
                        let base = theta as f64;
                        let corr = |turns: f64| {
                            dim * (original_max_position as f64 / (turns * 2.0 * std::f64::consts::PI)).ln()
                                / (2.0 * base.ln())
                        };
                        let (mut low, mut high) = (corr(beta_fast as f64), corr(beta_slow as f64));
                        if truncate {
                            (low, high) = (low.floor(), high.ceil());
                        }
                        let (low, high) = (low.max(0.0), high.min(dim - 1.0));
                        let span = (if low == high { high + 0.001 } else { high } - low) as f32;
                        for (i, f) in rot.iter_mut().enumerate() {
                            let pos = theta.powf((2 * i) as f32 / rotary_dim as f32);
                            // 1 where the pair keeps its frequency, 0 where it is interpolated.
                            let keep = 1.0 - ((i as f32 - low as f32) / span).clamp(0.0, 1.0);
                            *f = 1.0 / (factor * pos) * (1.0 - keep) + 1.0 / pos * keep;
                        }
                        let af = attention_factor.unwrap_or(if factor <= 1.0 {
                            1.0
                        } else {
                            (0.1 * (factor as f64).ln() + 1.0) as f32
                        });
                        return RopeSpec { style, inv_freq, attention_factor: af };
                    }
                    _ => {}
                }
            }
        }
        RopeSpec { style, inv_freq, attention_factor: 1.0 }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct AttentionSpec {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Sliding-window length (the query and the `window - 1` positions before it), or
    /// `None` for full attention.
    pub window: Option<usize>,
    pub rope: RopeSpec,
    /// Multiplies q·k before the softmax.
    pub scale: f32,
    /// RMS norms over each q and k head, with weights.
    pub qk_norm: bool,
    /// A weightless RMS norm over each v head (Gemma 4).
    pub v_norm: bool,
    /// V is the k projection's output, taken before k norm and RoPE (Gemma 4 full layers).
    pub k_eq_v: bool,
    /// Biases on the q, k and v projections (Qwen2, gpt-oss).
    pub qkv_bias: bool,
    /// A bias on the output projection (gpt-oss).
    pub o_bias: bool,
    /// A learned logit per query head that joins every softmax over the positions
    /// and takes its share of the weight without a value (gpt-oss's attention sinks).
    pub sinks: bool,
    /// This layer computes no K/V of its own and attends over the cache of the named
    /// earlier layer (Gemma 4 KV sharing).
    pub kv_source: Option<usize>,
    /// Multi-head latent attention (DeepSeek): the layer caches one latent vector and
    /// one RoPE key per position, and attends as one KV head whose keys are
    /// `[latent, rope key]` and whose values the latent; `head_dim` is then
    /// `kv_lora_rank + rope_dim`, `n_kv_heads` 1, `scale` the per-head dims' own, and
    /// `rope` rotates the `rope_dim` dims.
    pub mla: Option<MlaSpec>,
    /// The q projection gives each head its query and then as many gate values; the
    /// attention's output is multiplied by their sigmoid before the o projection
    /// (Qwen3.5's full-attention layers).
    pub output_gate: bool,
    /// Qwen4-Exp's QSA: each query attends to the blocks of keys an indexer chooses.
    pub indexer: Option<IndexerSpec>,
}

/// Qwen4-Exp's QSA indexer. Keys are pooled over fixed blocks of `block` positions;
/// each query scores the complete blocks before it (the sum over `heads` query heads of
/// the ReLU of their dot products with the block's key) and attends only to the best
/// `budget / block` blocks and the open block it is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexerSpec {
    pub heads: usize,
    pub head_dim: usize,
    pub budget: usize,
    pub block: usize,
}

/// The shapes of a multi-head latent attention layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaSpec {
    /// Width of the queries' low-rank bottleneck (`q_a` then `q_b`), or `None` for one
    /// `q` projection.
    pub q_lora_rank: Option<usize>,
    /// Width of the cached latent.
    pub kv_lora_rank: usize,
    /// Per head: the query and key dims without RoPE, with RoPE, and the value dims.
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
    /// The eps of the norms over the two bottlenecks.
    pub latent_eps: f32,
}

impl AttentionSpec {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// How a router's logits become each token's experts and their weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RouterKind {
    /// softmax over the router logits, top-k, then optionally renormalise the k weights.
    Softmax { normalize_top_k: bool },
    /// Gemma 4: weightless RMS norm, times `scale` and hidden^-0.5, softmax, top-k,
    /// renormalise, times `per_expert_scale`.
    Gemma4,
    /// top-k of the logits, then a softmax over the k chosen (gpt-oss).
    TopKSoftmax,
    /// DeepSeek-V3: sigmoid scores. Experts are chosen on the scores plus a
    /// correction bias, among the best `topk_groups` of `n_groups` equal groups (a
    /// group scores the sum of its two best); the weights are the chosen plain scores,
    /// optionally renormalised, times `scaling`.
    SigmoidGroupLimited { n_groups: usize, topk_groups: usize, normalize_top_k: bool, scaling: f32 },
}

/// The gated unit in the middle of an MLP or an expert: `f(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Glu {
    /// `act(gate) * up`.
    Gated(Activation),
    /// gpt-oss: `gate` clamped above at `limit`, `up` to `[-limit, limit]`, then
    /// `gate * sigmoid(alpha * gate) * (up + 1)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeSpec {
    pub n_experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    pub router: RouterKind,
    /// What each expert computes between its gate/up and down products.
    pub glu: Glu,
    /// Each expert's products add a bias (gpt-oss).
    pub expert_bias: bool,
    /// Experts every token goes through beside the routed ones, as one MLP.
    pub shared: Option<SharedExperts>,
}

/// The always-on experts of a MoE layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedExperts {
    /// Intermediate size of the one MLP they make (DeepSeek: `n_shared_experts` times
    /// an expert's).
    pub intermediate: usize,
    /// Their output is scaled per token by the sigmoid of a learned projection of the
    /// input (Qwen's `shared_expert_gate`).
    pub gated: bool,
}

/// A Gated DeltaNet layer (Qwen3.5's linear attention): a causal depthwise
/// convolution over the q, k and v channels, then per value head a state `[k_dim,
/// v_dim]` that decays by `exp(g)` and takes a delta-rule update each token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNetSpec {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub conv_kernel: usize,
    /// Which key head a value head reads when there are more value heads.
    pub v_order: HeadOrder,
    /// The output gate's activation (SiLU; Qwen4-Exp may say sigmoid).
    pub gate: Activation,
}

/// How `v_heads` value heads share `k_heads` key heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadOrder {
    /// Value head `j` reads key head `j / (v_heads / k_heads)` (Hugging Face).
    Grouped,
    /// Value head `j` reads key head `j % k_heads` (llama.cpp's converter reorders them).
    Tiled,
}

impl DeltaNetSpec {
    /// Channels the convolution runs over: q, k (`k_heads * k_dim` each) and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }

    /// The key head value head `j` reads.
    pub fn k_head(&self, j: usize) -> usize {
        match self.v_order {
            HeadOrder::Grouped => j / (self.v_heads / self.k_heads),
            HeadOrder::Tiled => j % self.k_heads,
        }
    }

    /// Floats of one sequence's state: the convolution's last `conv_kernel - 1` inputs,
    /// then every value head's `[k_dim, v_dim]`.
    pub fn state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim() + self.v_heads * self.k_dim * self.v_dim
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    pub attention: AttentionSpec,
    /// Intermediate size of the dense MLP, if the layer has one (Gemma 4 MoE layers
    /// have both a dense MLP and experts).
    pub mlp: Option<usize>,
    pub moe: Option<MoeSpec>,
    /// A Gated DeltaNet in place of attention (Qwen3.5's linear layers); `attention`
    /// then describes the model's full-attention layers, not this one.
    pub linear: Option<DeltaNetSpec>,
    /// Hashed n-gram embeddings added to the residual streams first (Qwen4-Exp).
    pub ngram: Option<NgramSpec>,
}

/// Qwen4-Exp's hashed n-gram embeddings on one layer. Each token's 2- to `n`-grams
/// (cut at the last end of text before it) are hashed, `heads_per_n` ways each, into
/// rows of one table whose rows hold `dim / heads()` values; the `heads()` rows
/// concatenated are gated into every stream and pass a dilated causal convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramSpec {
    /// Which of the model's n-gram layers this is (it picks the primes and multipliers).
    pub index: usize,
    pub n: usize,
    pub heads_per_n: usize,
    pub dim: usize,
    /// Taps of the convolution, `n` positions apart.
    pub conv_kernel: usize,
    /// Each head's table size is a distinct prime at least this.
    pub vocab_base: u64,
    /// The table's rows are padded to a multiple of this.
    pub pad_to: u64,
    pub seed: u64,
    /// The token that cuts n-grams (and pads the start of a sequence).
    pub eos: u32,
}

impl NgramSpec {
    /// Hashed heads: `heads_per_n` for each order 2..=n.
    pub fn heads(&self) -> usize {
        (self.n - 1) * self.heads_per_n
    }

    /// Positions of the convolution's window before the current one.
    pub fn conv_rows(&self) -> usize {
        (self.conv_kernel - 1) * self.n
    }

    /// The odd multipliers of a token `s` places back, for s in 0..n (transformers'
    /// `_build_layer_multipliers`: splitmix64 of the seed, the layer's index and s,
    /// reduced so that a token id times one stays below 2^63).
    pub fn multipliers(&self, vocab: usize) -> Vec<u64> {
        const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
        let splitmix64 = |v: u64| {
            let v = v.wrapping_add(GAMMA);
            let v = (v ^ (v >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let v = (v ^ (v >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            v ^ (v >> 31)
        };
        let half = ((i64::MAX as u64 / vocab.max(1) as u64) / 2).max(1);
        let base = self.seed.wrapping_add(10_007 * self.index as u64);
        (0..self.n as u64).map(|i| 2 * (splitmix64(base.wrapping_add(GAMMA.wrapping_mul(i + 1))) % half) + 1).collect()
    }

    /// Each head's table size: the primes from `vocab_base` on, heads of earlier n-gram
    /// layers taking the first ones.
    pub fn head_sizes(&self) -> Vec<u64> {
        let is_prime = |p: u64| p >= 2 && (2..).take_while(|d| d * d <= p).all(|d| !p.is_multiple_of(d));
        let skip = self.index * self.heads();
        (self.vocab_base..).filter(|&p| is_prime(p)).skip(skip).take(self.heads()).collect()
    }

    /// Where each head's rows start in the one table.
    pub fn head_offsets(&self) -> Vec<u64> {
        self.head_sizes().iter().scan(0, |at, &size| Some(std::mem::replace(at, *at + size))).collect()
    }

    /// Rows of the table: the heads' sizes summed, padded to `pad_to`.
    pub fn table_rows(&self) -> u64 {
        self.head_sizes().iter().sum::<u64>().div_ceil(self.pad_to) * self.pad_to
    }
}

/// Qwen4-Exp's hyper-connections: `streams` copies of the residual; a gated mix of
/// rank `rank` of the normed streams feeds each sublayer, whose output each stream
/// takes back with its own gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HyperSpec {
    pub streams: usize,
    pub rank: usize,
}

/// Gemma 4's per-layer embeddings (PLE).
#[derive(Clone, Debug, PartialEq)]
pub struct PleSpec {
    /// Per-layer width.
    pub dim: usize,
    pub vocab_size: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    pub family: Family,
    /// The architecture name as the source spells it (`gemma4_text`, `qwen3_moe`, ...).
    pub arch: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub rms_norm_eps: f32,
    pub activation: Activation,
    /// Multiplies the token embedding (Gemma: sqrt(hidden)).
    pub embed_scale: f32,
    /// Added to every RMS norm weight (Gemma 3 stores w and applies 1 + w).
    pub norm_weight_offset: f32,
    pub final_logit_softcap: Option<f32>,
    pub tie_word_embeddings: bool,
    /// Longest sequence the model accepts.
    pub max_context: usize,
    pub layers: Vec<LayerSpec>,
    pub ple: Option<PleSpec>,
    /// Several residual streams in place of one (Qwen4-Exp).
    pub hyper: Option<HyperSpec>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The dominant storage type of the weights, for display.
    pub weight_dtype: Option<DType>,
}

impl ModelSpec {
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
    pub fn is_moe(&self) -> bool {
        self.layers.iter().any(|l| l.moe.is_some())
    }

    /// What a config may not say however it is written: a zero size that something is
    /// divided by or cut into (a head dimension, a head count, a vocabulary), more
    /// experts chosen than there are, heads that do not share out. The readers call this
    /// last, so the model code can divide and index by these without checking again.
    pub fn check_sizes(&self) -> std::result::Result<(), String> {
        let positive =
            |what: &str, n: usize| if n == 0 { Err(format!("{what} is 0; it must be positive")) } else { Ok(()) };
        positive("the vocabulary size", self.vocab_size)?;
        positive("the hidden size", self.hidden_size)?;
        positive("the number of layers", self.layers.len())?;
        for (i, l) in self.layers.iter().enumerate() {
            let a = &l.attention;
            let at = |what: &str| format!("layer {i}'s {what}");
            positive(&at("head count"), a.n_heads)?;
            positive(&at("key/value head count"), a.n_kv_heads)?;
            positive(&at("head dimension"), a.head_dim)?;
            if !a.n_heads.is_multiple_of(a.n_kv_heads) {
                return Err(format!(
                    "layer {i} has {} query heads for {} key/value heads; they must divide",
                    a.n_heads, a.n_kv_heads
                ));
            }
            if let Some(w) = a.window {
                positive(&at("sliding window"), w)?;
            }
            if let Some(m) = l.mlp {
                positive(&at("feed-forward size"), m)?;
            }
            if let Some(moe) = &l.moe {
                positive(&at("expert count"), moe.n_experts)?;
                positive(&at("experts per token"), moe.top_k)?;
                positive(&at("expert feed-forward size"), moe.intermediate)?;
                if moe.top_k > moe.n_experts {
                    return Err(format!(
                        "layer {i} chooses {} experts per token of {}; it cannot choose more than there are",
                        moe.top_k, moe.n_experts
                    ));
                }
            }
            if let Some(d) = &l.linear {
                positive(&at("DeltaNet key heads"), d.k_heads)?;
                positive(&at("DeltaNet value heads"), d.v_heads)?;
                positive(&at("DeltaNet key dimension"), d.k_dim)?;
                positive(&at("DeltaNet value dimension"), d.v_dim)?;
                positive(&at("DeltaNet convolution kernel"), d.conv_kernel)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proportional_rope_leaves_nope_pairs_unrotated() {
        let r = RopeSpec::new(RopeStyle::Half, 1e6, 32, 32, &RopeScaling::Proportional { partial: 0.25, factor: 1.0 });
        assert_eq!(r.inv_freq.len(), 16);
        assert_eq!(r.inv_freq[0], 1.0);
        assert!(r.inv_freq[3] > 0.0);
        assert!(r.inv_freq[4..].iter().all(|&f| f == 0.0));
    }

    #[test]
    fn llama3_scaling_divides_low_frequencies() {
        let plain = RopeSpec::new(RopeStyle::Half, 500000.0, 16, 16, &RopeScaling::None);
        let scaled = RopeSpec::new(
            RopeStyle::Half,
            500000.0,
            16,
            16,
            &RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 64.0,
            },
        );
        assert_eq!(plain.inv_freq[0], scaled.inv_freq[0]);
        assert!((scaled.inv_freq[7] - plain.inv_freq[7] / 8.0).abs() < 1e-12);
    }
}

#[cfg(test)]
mod ngram_tests {
    use super::NgramSpec;

    fn spec(index: usize) -> NgramSpec {
        NgramSpec {
            index,
            n: 3,
            heads_per_n: 2,
            dim: 32,
            conv_kernel: 4,
            vocab_base: 1000,
            pad_to: 128,
            seed: 1234,
            eos: 2,
        }
    }

    /// The constants transformers 5.24 computes (and saves as `layer_multipliers`,
    /// `ngram_heads_vocab_sizes`) for fixtures/tiny/qwen4-exp's two n-gram layers, and for
    /// the default config's first (vocabulary 248320, base 20M, 16 heads).
    #[test]
    fn constants_match_transformers() {
        assert_eq!(spec(0).multipliers(512), [4295158889763781, 17440218147737327, 1270917961434445]);
        assert_eq!(spec(1).multipliers(512), [17237745666423273, 2619768721783435, 15090836525362811]);
        assert_eq!(spec(0).head_sizes(), [1009, 1013, 1019, 1021]);
        assert_eq!(spec(1).head_sizes(), [1031, 1033, 1039, 1049]);
        assert_eq!(spec(1).head_offsets(), [0, 1031, 2064, 3103]);
        assert_eq!((spec(0).table_rows(), spec(1).table_rows()), (4096, 4224));
        let real = NgramSpec { heads_per_n: 8, dim: 2048, vocab_base: 20_000_000, ..spec(0) };
        assert_eq!(real.multipliers(248_320), [23703573157769, 20109073645365, 8052911324071]);
        assert_eq!(real.head_sizes()[..3], [20000003, 20000023, 20000033]);
        assert_eq!(real.head_sizes()[15], 20000171);
        assert_eq!(real.table_rows(), 320_001_536);
    }
}
