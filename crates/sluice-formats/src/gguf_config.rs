//! GGUF metadata to [`ModelSpec`].
//!
//! Each key is read the way llama.cpp reads it (defaults included), and where GGUF says
//! something only through which tensors exist (tied output, MoE layers, Gemma 4's k = v
//! layers), the tensors are asked. The result is the spec the Hugging Face reader
//! (`hf_config`) gives for the same model, so one family file runs both; the
//! differences are deliberate and follow what llama.cpp's converter did to the weights:
//!
//! - `llama`: the converter permutes Q and K so that rotary pairs are adjacent, so GGUF
//!   llama rotates interleaved pairs ([`RopeStyle::Interleaved`]); every other
//!   architecture here keeps Hugging Face's halves ([`RopeStyle::Half`]).
//! - `gemma3`: the converter adds 1 to every norm weight, so the norms apply `w` as
//!   stored (`norm_weight_offset` 0). Gemma 4's converter adds nothing (its norms already
//!   apply `w`).
//! - Llama 3 RoPE scaling and Gemma 4's proportional RoPE reach GGUF as a `rope_freqs`
//!   tensor of per-pair frequency divisors; a divisor of 1e30 (Gemma 4's unrotated
//!   pairs) becomes a zero frequency.

use std::collections::HashMap;

use sluice_core::{
    Activation, AttentionSpec, DType, DeltaNetSpec, Error, Family, Glu, HeadOrder, LayerSpec, MAX_CONFIG_SIZE,
    MAX_LAYERS, MlaSpec, ModelSpec, MoeSpec, PleSpec, Result, RopeScaling, RopeSpec, RopeStyle, RouterKind,
    SharedExperts,
};

use crate::gguf::{GgufFile, GgufValue};
use crate::names::{TensorId, TensorKind, gguf_name};

pub const SUPPORTED: &str = "deepseek2, gemma3, gemma4, gpt-oss, llama, qwen2, qwen3, qwen35moe, qwen3moe";

/// A frequency divisor at least this large leaves its rotary pair unrotated.
const UNROTATED_FREQ_FACTOR: f32 = 1e20;

/// The metadata of one architecture, with the file for errors.
struct Meta<'a> {
    g: &'a GgufFile,
    arch: &'a str,
}

impl<'a> Meta<'a> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn err(&self, msg: String) -> Error {
        Error::config(self.g.path(), msg)
    }

    fn usize_opt(&self, k: &str) -> Result<Option<usize>> {
        let key = self.key(k);
        match self.g.get_u64(&key)? {
            None => Ok(None),
            Some(v) if v > MAX_CONFIG_SIZE as u64 => Err(self.err(format!(
                "metadata key '{key}' is {v}, more than sluice accepts for a size or count ({MAX_CONFIG_SIZE})"
            ))),
            Some(v) => Ok(Some(v as usize)),
        }
    }

    fn usize(&self, k: &str) -> Result<usize> {
        self.usize_opt(k)?.ok_or_else(|| self.err(format!("metadata key '{}' is missing", self.key(k))))
    }

    /// A number that must be positive and finite (a clamp limit), or `default`.
    fn positive_f32(&self, k: &str, default: f32) -> Result<f32> {
        match self.f32_opt(k)?.unwrap_or(default) {
            x if x > 0.0 && x.is_finite() => Ok(x),
            x => Err(self.err(format!("metadata key '{}' is {x}; it must be a positive number", self.key(k)))),
        }
    }

    fn f32_opt(&self, k: &str) -> Result<Option<f32>> {
        Ok(self.g.get_f64(&self.key(k))?.map(|v| v as f32))
    }

    fn bool_opt(&self, k: &str) -> Result<Option<bool>> {
        self.g.get_bool(&self.key(k))
    }

    /// A per-layer integer: one value for every layer, or an array with one per layer
    /// (llama.cpp's `get_key_or_arr`).
    fn per_layer(&self, k: &str, n_layers: usize) -> Result<Option<Vec<usize>>> {
        let key = self.key(k);
        let Some(v) = self.g.get(&key) else { return Ok(None) };
        let wrong = || {
            Error::format(
                self.g.path(),
                format!("metadata key '{key}' is {}, expected an integer or an array of integers", v.describe()),
            )
        };
        let vals: Vec<u64> = match v {
            GgufValue::Array(items) => items.iter().map(|e| e.as_u64().ok_or_else(wrong)).collect::<Result<_>>()?,
            other => vec![other.as_u64().ok_or_else(wrong)?; n_layers],
        };
        if vals.len() != n_layers {
            return Err(self.err(format!("metadata key '{key}' has {} entries for {n_layers} layers", vals.len())));
        }
        vals.into_iter()
            .map(|x| usize::try_from(x).map_err(|_| self.err(format!("metadata key '{key}' holds {x}"))))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn has(&self, id: TensorId) -> bool {
        self.g.tensor(&gguf_name(id)).is_some()
    }

    /// Which layers use sliding-window attention: `attention.sliding_window_pattern` as
    /// one bool per layer, or as a period n (the last layer of every n is global), or
    /// Gemma's default period of 6.
    fn sliding_pattern(&self, n_layers: usize, default_period: usize) -> Result<Vec<bool>> {
        let key = self.key("attention.sliding_window_pattern");
        let period = |n: usize| (0..n_layers).map(|i| n == 0 || i % n < n - 1).collect::<Vec<bool>>();
        match self.g.get(&key) {
            None => Ok(period(default_period)),
            Some(GgufValue::Array(items)) => {
                let v = items
                    .iter()
                    .map(|e| e.as_bool())
                    .collect::<Option<Vec<bool>>>()
                    .ok_or_else(|| self.err(format!("metadata key '{key}' must be an array of bools")))?;
                if v.len() != n_layers {
                    return Err(self.err(format!("metadata key '{key}' has {} entries for {n_layers} layers", v.len())));
                }
                Ok(v)
            }
            Some(v) => match v.as_u64() {
                Some(n) => Ok(period(n as usize)),
                None => Err(Error::format(
                    self.g.path(),
                    format!("metadata key '{key}' is {}, expected an array of bools or an integer", v.describe()),
                )),
            },
        }
    }

    /// `rope.scaling.*` as llama.cpp reads it: the type defaults to linear, the factor
    /// comes from `rope.scaling.factor` or the older `rope.scale_linear`.
    fn rope_scaling(&self) -> Result<RopeScaling> {
        let kind = self.g.get_str(&self.key("rope.scaling.type"))?.unwrap_or("linear");
        let factor = match self.f32_opt("rope.scaling.factor")? {
            Some(f) if f != 0.0 => Some(f),
            _ => self.f32_opt("rope.scale_linear")?.filter(|&f| f != 0.0),
        };
        match (kind, factor) {
            ("none", _) | (_, None) => Ok(RopeScaling::None),
            ("linear", Some(1.0)) => Ok(RopeScaling::None),
            ("linear", Some(factor)) => Ok(RopeScaling::Linear { factor }),
            (other, Some(_)) => Err(self.err(format!(
                "RoPE scaling type '{other}' ('{}') is not supported (none, linear)",
                self.key("rope.scaling.type")
            ))),
        }
    }

    /// The `rope_freqs` tensor: one frequency divisor per rotary pair.
    fn rope_freq_factors(&self, n_rot: usize) -> Result<Option<Vec<f32>>> {
        let Some(t) = self.g.tensor("rope_freqs.weight") else { return Ok(None) };
        let v = t.to_f32_vec()?;
        if v.len() != n_rot / 2 {
            return Err(Error::TensorShape {
                path: self.g.path().to_path_buf(),
                name: t.name.clone(),
                expected: format!("{} frequency factors (rope dimension count {n_rot} / 2)", n_rot / 2),
                got: format!("shape {:?}", t.shape),
            });
        }
        if let Some(bad) = v.iter().find(|&&f| f.is_nan() || f <= 0.0) {
            return Err(self.err(format!("tensor 'rope_freqs.weight' holds the frequency factor {bad}")));
        }
        Ok(Some(v))
    }

    fn rope(
        &self,
        style: RopeStyle,
        theta: f32,
        head_dim: usize,
        n_rot: usize,
        scaling: &RopeScaling,
        factors: Option<&[f32]>,
    ) -> Result<RopeSpec> {
        if n_rot == 0 || !n_rot.is_multiple_of(2) || n_rot > head_dim {
            return Err(self.err(format!(
                "the RoPE dimension count {n_rot} must be even and between 2 and the head dim {head_dim}"
            )));
        }
        let mut rope = RopeSpec::new(style, theta, head_dim, n_rot, scaling);
        if let Some(ff) = factors {
            for (f, &k) in rope.inv_freq.iter_mut().zip(ff) {
                if k >= UNROTATED_FREQ_FACTOR {
                    *f = 0.0;
                } else {
                    *f /= k;
                }
            }
        }
        Ok(rope)
    }

    /// Routed-expert geometry, for the layers that have a router; `experts` says what
    /// the architecture's routers and experts compute, the file says the rest.
    fn moe(&self, experts: Experts, moe_layer: Option<usize>) -> Result<Option<MoeSpec>> {
        let Some(layer) = moe_layer else { return Ok(None) };
        let Experts { router, glu } = experts;
        let n_experts = self.usize("expert_count")?;
        let top_k = self.usize("expert_used_count")?;
        if n_experts == 0 || top_k == 0 || top_k > n_experts {
            return Err(self.err(format!(
                "'{}' ({top_k}) must be between 1 and '{}' ({n_experts})",
                self.key("expert_used_count"),
                self.key("expert_count")
            )));
        }
        // gpt-oss's softmax over the chosen logits is the architecture's own, whatever
        // this key says (llama.cpp sets it in code).
        let sigmoid = matches!(router, RouterKind::SigmoidGroupLimited { .. });
        let gating = self.g.get_u64(&self.key("expert_gating_func"))?;
        match (gating, sigmoid) {
            // DeepSeek-V3's sigmoid scores (2); llama.cpp reads a missing key as
            // DeepSeek-V2's softmax, which sluice does not compute.
            (Some(2), true) | (Some(1) | None, false) => {}
            _ if router == RouterKind::TopKSoftmax => {}
            (f, _) => {
                let key = self.key("expert_gating_func");
                let want = if sigmoid { "sigmoid gating (2), as DeepSeek-V3's" } else { "softmax gating (1)" };
                return Err(self.err(format!("'{key}' = {f:?}: only {want} is supported")));
            }
        }
        if !sigmoid
            && let Some(s) = self.f32_opt("expert_weights_scale")?
            && s != 0.0
            && s != 1.0
        {
            return Err(self.err(format!("'{}' = {s} is not supported", self.key("expert_weights_scale"))));
        }
        // The expert width: its own key, or the down experts' shape [E, H, I].
        let intermediate = match self.usize_opt("expert_feed_forward_length")? {
            Some(i) => i,
            None => {
                let down = self.g.tensor(&gguf_name(TensorId::layer(layer, TensorKind::ExpsDown)));
                match down.map(|t| t.shape.as_slice()) {
                    Some(&[_, _, i]) => i,
                    _ => {
                        return Err(
                            self.err(format!("metadata key '{}' is missing", self.key("expert_feed_forward_length")))
                        );
                    }
                }
            }
        };
        let router = match router {
            // llama.cpp always renormalises the top-k weights of these architectures;
            // `expert_weights_norm` says otherwise where a file needs it.
            RouterKind::Softmax { .. } => {
                RouterKind::Softmax { normalize_top_k: self.bool_opt("expert_weights_norm")?.unwrap_or(true) }
            }
            other => other,
        };
        let expert_bias = self.has(TensorId::layer(layer, TensorKind::ExpsDownBias));
        Ok(Some(MoeSpec { n_experts, top_k, intermediate, router, glu, expert_bias, shared: None }))
    }
}

/// What an architecture's routed experts compute (GGUF states it by architecture).
struct Experts {
    router: RouterKind,
    glu: Glu,
}

/// Reads the model description from a GGUF file's metadata (and, where GGUF encodes
/// things that way, from which tensors it holds).
pub fn read(g: &GgufFile) -> Result<ModelSpec> {
    let arch = g
        .get_str("general.architecture")?
        .ok_or_else(|| Error::config(g.path(), "metadata key 'general.architecture' is missing"))?;
    let m = Meta { g, arch };
    let mut spec = match arch {
        "llama" | "qwen2" | "qwen3" | "qwen3moe" => llama_like(&m)?,
        "gemma3" | "gemma4" => gemma(&m)?,
        "gpt-oss" => gpt_oss(&m)?,
        "deepseek2" => deepseek2(&m)?,
        "qwen35moe" => qwen35moe(&m)?,
        other => {
            return Err(Error::UnknownArchitecture {
                path: g.path().to_path_buf(),
                model_type: other.to_string(),
                supported: SUPPORTED.into(),
            });
        }
    };
    spec.weight_dtype = dominant_matrix_type(g);
    spec.check_sizes().map_err(|e| Error::config(g.path(), e))?;
    Ok(spec)
}

/// The most common type among the file's matrices (ties to the one holding more
/// elements): Q4_1 for a Q4_1 file whose embedding is Q8_0, say.
fn dominant_matrix_type(g: &GgufFile) -> Option<DType> {
    dominant_type(g.tensors().iter().map(|t| (t.dtype, t.shape.as_slice())))
}

/// [`dominant_matrix_type`] over `(type, shape)` pairs (a file about to be written).
pub(crate) fn dominant_type<'a>(tensors: impl Iterator<Item = (DType, &'a [usize])>) -> Option<DType> {
    let mut counts: HashMap<DType, (usize, usize)> = HashMap::new();
    for (dtype, shape) in tensors.filter(|(_, s)| s.len() >= 2) {
        let c = counts.entry(dtype).or_default();
        c.0 += 1;
        c.1 += shape.iter().product::<usize>();
    }
    counts.into_iter().max_by_key(|&(d, c)| (c, d.name())).map(|(d, _)| d)
}

/// Geometry every architecture reads the same way.
struct Base {
    n_layers: usize,
    hidden: usize,
    n_heads: Vec<usize>,
    n_kv: Vec<usize>,
    vocab: usize,
    eps: f32,
    max_context: usize,
}

fn base(m: &Meta) -> Result<Base> {
    let n_layers = m.usize("block_count")?;
    if n_layers > MAX_LAYERS {
        return Err(m.err(format!(
            "metadata key '{}' is {n_layers}, more layers than sluice accepts ({MAX_LAYERS})",
            m.key("block_count")
        )));
    }
    let hidden = m.usize("embedding_length")?;
    let n_heads = m
        .per_layer("attention.head_count", n_layers)?
        .ok_or_else(|| m.err(format!("metadata key '{}' is missing", m.key("attention.head_count"))))?;
    let n_kv = m.per_layer("attention.head_count_kv", n_layers)?.unwrap_or_else(|| n_heads.clone());
    if n_layers == 0 || hidden == 0 {
        return Err(m.err(format!("{} layers of width {hidden} is not a model", n_layers)));
    }
    for (i, (&h, &kv)) in n_heads.iter().zip(&n_kv).enumerate() {
        if h == 0 || kv == 0 || h % kv != 0 {
            return Err(m.err(format!("layer {i}: {h} query heads are not a positive multiple of {kv} KV heads")));
        }
    }
    let embd = m.g.tensor(&gguf_name(TensorId::model(TensorKind::TokenEmbd))).ok_or_else(|| Error::MissingTensor {
        path: m.g.path().to_path_buf(),
        name: gguf_name(TensorId::model(TensorKind::TokenEmbd)),
    })?;
    let vocab = match embd.shape.as_slice() {
        &[v, h] if h == hidden => v,
        _ => {
            return Err(Error::TensorShape {
                path: m.g.path().to_path_buf(),
                name: embd.name.clone(),
                expected: format!("shape [vocab, {hidden}]"),
                got: format!("shape {:?}", embd.shape),
            });
        }
    };
    let eps = m
        .f32_opt("attention.layer_norm_rms_epsilon")?
        .ok_or_else(|| m.err(format!("metadata key '{}' is missing", m.key("attention.layer_norm_rms_epsilon"))))?;
    let max_context = m.usize("context_length")?;
    Ok(Base { n_layers, hidden, n_heads, n_kv, vocab, eps, max_context })
}

/// The key and value head dims must agree: sluice (like llama.cpp for these
/// architectures) keeps one head dim per layer.
fn head_dim(m: &Meta, key_k: &str, key_v: &str, default: usize) -> Result<usize> {
    let k = m.usize_opt(key_k)?.unwrap_or(default);
    match m.usize_opt(key_v)? {
        Some(v) if v != k => Err(m.err(format!("'{}' ({k}) differs from '{}' ({v})", m.key(key_k), m.key(key_v)))),
        _ if k == 0 || !k.is_multiple_of(2) => {
            Err(m.err(format!("head dim '{}' = {k} must be even and positive", m.key(key_k))))
        }
        _ => Ok(k),
    }
}

fn token_ids(g: &GgufFile) -> Result<(Option<u32>, Vec<u32>)> {
    let id = |k: &str| -> Result<Option<u32>> {
        g.get_u64(k)?
            .map(|v| u32::try_from(v).map_err(|_| Error::config(g.path(), format!("metadata key '{k}' is {v}"))))
            .transpose()
    };
    let bos = id("tokenizer.ggml.bos_token_id")?;
    let mut eos = Vec::new();
    for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(v) = id(k)?
            && !eos.contains(&v)
        {
            eos.push(v);
        }
    }
    Ok((bos, eos))
}

fn ffn_lengths(m: &Meta, n_layers: usize, needed: bool) -> Result<Vec<usize>> {
    match m.per_layer("feed_forward_length", n_layers)? {
        Some(v) => Ok(v),
        None if needed => Err(m.err(format!("metadata key '{}' is missing", m.key("feed_forward_length")))),
        None => Ok(vec![0; n_layers]),
    }
}

fn llama_like(m: &Meta) -> Result<ModelSpec> {
    let b = base(m)?;
    let arch = m.arch;
    let head_dim = head_dim(m, "attention.key_length", "attention.value_length", b.hidden / b.n_heads[0])?;
    let n_rot = m.usize_opt("rope.dimension_count")?.unwrap_or(head_dim);
    let theta = m.f32_opt("rope.freq_base")?.unwrap_or(10_000.0);
    let style = if arch == "llama" { RopeStyle::Interleaved } else { RopeStyle::Half };
    let factors = m.rope_freq_factors(n_rot)?;
    let rope = m.rope(style, theta, head_dim, n_rot, &m.rope_scaling()?, factors.as_deref())?;

    let is_moe: Vec<bool> = (0..b.n_layers).map(|i| m.has(TensorId::layer(i, TensorKind::Router))).collect();
    let ffn = ffn_lengths(m, b.n_layers, is_moe.iter().any(|&x| !x))?;
    let experts = Experts { router: RouterKind::Softmax { normalize_top_k: true }, glu: Glu::Gated(Activation::Silu) };
    let moe = m.moe(experts, is_moe.iter().position(|&x| x))?;
    let qwen3 = arch == "qwen3" || arch == "qwen3moe";
    let qkv_bias = arch == "qwen2" || m.has(TensorId::layer(0, TensorKind::AttnQBias));

    let layers = (0..b.n_layers)
        .map(|i| LayerSpec {
            attention: AttentionSpec {
                n_heads: b.n_heads[i],
                n_kv_heads: b.n_kv[i],
                head_dim,
                window: None,
                rope: rope.clone(),
                scale: (head_dim as f32).powf(-0.5),
                qk_norm: qwen3,
                v_norm: false,
                k_eq_v: false,
                qkv_bias,
                o_bias: false,
                sinks: false,
                kv_source: None,
                mla: None,
                output_gate: false,
                indexer: None,
            },
            mlp: (!is_moe[i]).then_some(ffn[i]),
            moe: if is_moe[i] { moe.clone() } else { None },
            linear: None,
            ngram: None,
        })
        .collect();
    let (bos, eos) = token_ids(m.g)?;
    Ok(ModelSpec {
        family: Family::Llama,
        arch: arch.to_string(),
        vocab_size: b.vocab,
        hidden_size: b.hidden,
        rms_norm_eps: b.eps,
        activation: Activation::Silu,
        embed_scale: 1.0,
        norm_weight_offset: 0.0,
        final_logit_softcap: None,
        tie_word_embeddings: !m.has(TensorId::model(TensorKind::Output)),
        max_context: b.max_context,
        layers,
        ple: None,
        hyper: None,
        bos_token_id: bos,
        eos_token_ids: eos,
        weight_dtype: None,
    })
}

/// YaRN's magnitude correction `0.1 m ln s + 1` (1 for no extension).
fn yarn_mscale(scale: f32, m: f32) -> f32 {
    if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 }
}

/// DeepSeek-V3 as llama.cpp's converter writes it (`deepseek2`): the attention's
/// per-head dims in `attention.key_length_mla` / `value_length_mla` (`key_length` /
/// `value_length` are then the latent's; older files have only those, per head),
/// the bottlenecks in `attention.q_lora_rank` / `kv_lora_rank`, the RoPE part in
/// `rope.dimension_count` (adjacent pairs); `leading_dense_block_count` dense layers,
/// then sigmoid routing in groups with the correction bias `exp_probs_b` and
/// `expert_shared_count` shared experts. The scale and RoPE are transformers': the
/// latents' norms take eps 1e-6 as its `DeepseekV3RMSNorm(dim)` does, and YaRN's
/// `yarn_log_multiplier` (0.1 mscale_all_dim) squares into the softmax scale.
fn deepseek2(m: &Meta) -> Result<ModelSpec> {
    let b = base(m)?;
    let kv_lora_rank = m.usize("attention.kv_lora_rank")?;
    let q_lora_rank = m.usize_opt("attention.q_lora_rank")?.filter(|&r| r > 0);
    let rope_dim = m.usize("rope.dimension_count")?;
    let (k_len, v_len) = match (m.usize_opt("attention.key_length_mla")?, m.usize_opt("attention.value_length_mla")?) {
        (Some(k), Some(v)) => (k, v),
        _ => (m.usize("attention.key_length")?, m.usize("attention.value_length")?),
    };
    if kv_lora_rank == 0 || rope_dim == 0 || !rope_dim.is_multiple_of(2) || k_len <= rope_dim || v_len == 0 {
        return Err(m.err(format!(
            "multi-head latent attention needs a positive kv_lora_rank ({kv_lora_rank}), an even RoPE width \
             ({rope_dim}) below the key length ({k_len}), and a positive value length ({v_len})"
        )));
    }
    let theta = m.f32_opt("rope.freq_base")?.unwrap_or(10_000.0);
    let log_mul = m.f32_opt("rope.scaling.yarn_log_multiplier")?.filter(|&x| x != 0.0);
    let mut scale = (k_len as f32).powf(-0.5);
    let scaling = match m.g.get_str(&m.key("rope.scaling.type"))? {
        Some("yarn") => {
            let factor = m.f32_opt("rope.scaling.factor")?.unwrap_or(1.0);
            if let Some(lm) = log_mul {
                scale *= yarn_mscale(factor, lm / 0.1).powi(2);
            }
            RopeScaling::Yarn {
                factor,
                original_max_position: m.usize("rope.scaling.original_context_length")? as f32,
                beta_fast: m.f32_opt("rope.scaling.yarn_beta_fast")?.filter(|&x| x != 0.0).unwrap_or(32.0),
                beta_slow: m.f32_opt("rope.scaling.yarn_beta_slow")?.filter(|&x| x != 0.0).unwrap_or(1.0),
                // With the log multiplier the cos/sin factor is mscale over itself, 1
                // (llama.cpp's reading, for mscale equal to mscale_all_dim).
                attention_factor: m.f32_opt("rope.scaling.yarn_attn_factor")?.or(log_mul.map(|_| 1.0)),
                truncate: true,
            }
        }
        None | Some("none") => RopeScaling::None,
        Some(other) => {
            return Err(m.err(format!(
                "RoPE scaling type '{other}' ('{}') is not supported for deepseek2 (yarn, none)",
                m.key("rope.scaling.type")
            )));
        }
    };
    let rope = m.rope(RopeStyle::Interleaved, theta, rope_dim, rope_dim, &scaling, None)?;
    let dense = m.usize_opt("leading_dense_block_count")?.unwrap_or(0).min(b.n_layers);
    let n_groups = m.usize_opt("expert_group_count")?.unwrap_or(1).max(1);
    let topk_groups = m.usize_opt("expert_group_used_count")?.unwrap_or(n_groups);
    let experts = Experts {
        router: RouterKind::SigmoidGroupLimited {
            n_groups,
            topk_groups,
            normalize_top_k: m.bool_opt("expert_weights_norm")?.unwrap_or(false),
            scaling: m.f32_opt("expert_weights_scale")?.filter(|&s| s != 0.0).unwrap_or(1.0),
        },
        glu: Glu::Gated(Activation::Silu),
    };
    let moe = match m.moe(experts, (dense < b.n_layers).then_some(dense))? {
        Some(mut moe) => {
            let n = moe.n_experts;
            if !n.is_multiple_of(n_groups) || n / n_groups < 2 || topk_groups == 0 || topk_groups > n_groups {
                return Err(m.err(format!(
                    "{n} experts in {n_groups} groups ('{}'), {topk_groups} used: the groups must be equal, of at \
                     least two experts, and the used ones between 1 and the groups",
                    m.key("expert_group_count")
                )));
            }
            moe.shared = match m.usize_opt("expert_shared_count")?.unwrap_or(0) {
                0 => None,
                s => Some(SharedExperts { intermediate: s * moe.intermediate, gated: false }),
            };
            Some(moe)
        }
        None => None,
    };
    let ffn = m.usize_opt("feed_forward_length")?;
    let layers = (0..b.n_layers)
        .map(|i| {
            let mla = MlaSpec {
                q_lora_rank,
                kv_lora_rank,
                nope_dim: k_len - rope_dim,
                rope_dim,
                v_dim: v_len,
                latent_eps: 1e-6,
            };
            let mlp = if i < dense {
                Some(ffn.ok_or_else(|| m.err(format!("metadata key '{}' is missing", m.key("feed_forward_length"))))?)
            } else {
                None
            };
            Ok(LayerSpec {
                attention: AttentionSpec {
                    n_heads: b.n_heads[i],
                    n_kv_heads: 1,
                    head_dim: kv_lora_rank + rope_dim,
                    window: None,
                    rope: rope.clone(),
                    scale,
                    qk_norm: false,
                    v_norm: false,
                    k_eq_v: false,
                    qkv_bias: false,
                    o_bias: false,
                    sinks: false,
                    kv_source: None,
                    mla: Some(mla),
                    output_gate: false,
                    indexer: None,
                },
                mlp,
                moe: if i < dense { None } else { moe.clone() },
                linear: None,
                ngram: None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let (bos, eos) = token_ids(m.g)?;
    Ok(ModelSpec {
        family: Family::DeepSeek,
        arch: m.arch.to_string(),
        vocab_size: b.vocab,
        hidden_size: b.hidden,
        rms_norm_eps: b.eps,
        activation: Activation::Silu,
        embed_scale: 1.0,
        norm_weight_offset: 0.0,
        final_logit_softcap: None,
        tie_word_embeddings: !m.has(TensorId::model(TensorKind::Output)),
        max_context: b.max_context,
        layers,
        ple: None,
        hyper: None,
        bos_token_id: bos,
        eos_token_ids: eos,
        weight_dtype: None,
    })
}

/// Qwen3.5-MoE as llama.cpp's converter writes it (`qwen35moe`): the DeltaNet
/// geometry in `ssm.*` (`group_count` key heads, `time_step_rank` value heads,
/// `state_size` the key dim, `inner_size` all value dims), which layers recur in
/// `attention.recurrent_layers` (else every `full_attention_interval`-th is full), the
/// partial RoPE in `rope.dimension_count`. The converter stores the norms with their
/// `1 +` added (all but `ssm_norm`), `ssm_a` as `-exp(A_log)`, and the value heads
/// tiled over the key heads rather than grouped; the layers it appends for multi-token
/// prediction (`nextn_predict_layers`) are not run.
fn qwen35moe(m: &Meta) -> Result<ModelSpec> {
    let b = base(m)?;
    let mtp = m.usize_opt("nextn_predict_layers")?.unwrap_or(0);
    if mtp >= b.n_layers {
        return Err(m.err(format!("'{}' ({mtp}) leaves no layers to run", m.key("nextn_predict_layers"))));
    }
    let n_layers = b.n_layers - mtp;
    let head_dim = m.usize("attention.key_length")?;
    let (k_heads, v_heads) = (m.usize("ssm.group_count")?, m.usize("ssm.time_step_rank")?);
    let inner = m.usize("ssm.inner_size")?;
    if k_heads == 0 || v_heads == 0 || v_heads % k_heads != 0 || inner % v_heads != 0 {
        return Err(m.err(format!(
            "'{}' ({v_heads}) must be a positive multiple of '{}' ({k_heads}) and divide '{}' ({inner})",
            m.key("ssm.time_step_rank"),
            m.key("ssm.group_count"),
            m.key("ssm.inner_size")
        )));
    }
    let linear = DeltaNetSpec {
        k_heads,
        v_heads,
        k_dim: m.usize("ssm.state_size")?,
        v_dim: inner / v_heads,
        conv_kernel: m.usize("ssm.conv_kernel")?,
        v_order: HeadOrder::Tiled,
        gate: Activation::Silu,
    };
    if linear.k_dim == 0 || linear.conv_kernel == 0 {
        return Err(m.err(format!(
            "'{}' and '{}' must be positive",
            m.key("ssm.state_size"),
            m.key("ssm.conv_kernel")
        )));
    }
    let recurrent: Vec<bool> = match m.g.get(&m.key("attention.recurrent_layers")) {
        Some(GgufValue::Array(items)) if items.len() >= n_layers => items[..n_layers]
            .iter()
            .map(|v| v.as_bool())
            .collect::<Option<_>>()
            .ok_or_else(|| m.err(format!("'{}' must be an array of bools", m.key("attention.recurrent_layers"))))?,
        Some(_) => {
            return Err(m.err(format!(
                "'{}' must hold a bool for each of {n_layers} layers",
                m.key("attention.recurrent_layers")
            )));
        }
        None => {
            let interval = m.usize_opt("full_attention_interval")?.unwrap_or(4).max(1);
            (0..n_layers).map(|i| (i + 1) % interval != 0).collect()
        }
    };
    let rot = m.usize("rope.dimension_count")?;
    let theta = m.f32_opt("rope.freq_base")?.unwrap_or(10_000.0);
    let rope = m.rope(RopeStyle::Half, theta, rot, rot, &RopeScaling::None, None)?;
    if rot > head_dim {
        return Err(m.err(format!("the RoPE dimension count {rot} is more than the head dim {head_dim}")));
    }
    let experts = Experts { router: RouterKind::Softmax { normalize_top_k: true }, glu: Glu::Gated(Activation::Silu) };
    let mut moe = m.moe(experts, Some(0))?.expect("every qwen35moe layer has experts");
    moe.router = RouterKind::Softmax { normalize_top_k: true };
    moe.shared = match m.usize_opt("expert_shared_feed_forward_length")?.unwrap_or(0) {
        0 => None,
        i => Some(SharedExperts { intermediate: i, gated: true }),
    };
    let layers = (0..n_layers)
        .map(|i| LayerSpec {
            attention: AttentionSpec {
                n_heads: b.n_heads[i],
                n_kv_heads: b.n_kv[i],
                head_dim,
                window: None,
                rope: rope.clone(),
                scale: (head_dim as f32).powf(-0.5),
                qk_norm: true,
                v_norm: false,
                k_eq_v: false,
                qkv_bias: false,
                o_bias: false,
                sinks: false,
                kv_source: None,
                mla: None,
                output_gate: true,
                indexer: None,
            },
            mlp: None,
            moe: Some(moe.clone()),
            linear: recurrent[i].then_some(linear),
            ngram: None,
        })
        .collect();
    let (bos, eos) = token_ids(m.g)?;
    Ok(ModelSpec {
        family: Family::Qwen35,
        arch: m.arch.to_string(),
        vocab_size: b.vocab,
        hidden_size: b.hidden,
        rms_norm_eps: b.eps,
        activation: Activation::Silu,
        embed_scale: 1.0,
        norm_weight_offset: 0.0,
        final_logit_softcap: None,
        tie_word_embeddings: !m.has(TensorId::model(TensorKind::Output)),
        max_context: b.max_context,
        layers,
        ple: None,
        hyper: None,
        bos_token_id: bos,
        eos_token_ids: eos,
        weight_dtype: None,
    })
}

/// gpt-oss as llama.cpp's converter writes it: gate and up experts apart (or fused,
/// gate rows first) with their biases, `post_attention_norm` before the experts,
/// sliding attention on even layers (llama.cpp's fixed pattern), YaRN RoPE.
fn gpt_oss(m: &Meta) -> Result<ModelSpec> {
    let b = base(m)?;
    let head_dim = head_dim(m, "attention.key_length", "attention.value_length", 64)?;
    let window = m.usize_opt("attention.sliding_window")?.filter(|&w| w > 0);
    let theta = m.f32_opt("rope.freq_base")?.unwrap_or(150_000.0);
    let scaling = match m.g.get_str(&m.key("rope.scaling.type"))? {
        Some("yarn") => RopeScaling::Yarn {
            factor: m.f32_opt("rope.scaling.factor")?.unwrap_or(32.0),
            original_max_position: m.usize_opt("rope.scaling.original_context_length")?.unwrap_or(4096) as f32,
            beta_fast: m.f32_opt("rope.scaling.yarn_beta_fast")?.filter(|&x| x != 0.0).unwrap_or(32.0),
            beta_slow: m.f32_opt("rope.scaling.yarn_beta_slow")?.filter(|&x| x != 0.0).unwrap_or(1.0),
            attention_factor: None,
            // The reference implementation's (transformers' config for gpt-oss says
            // `truncate: false`; llama.cpp rounds the ramp's ends to whole pairs).
            truncate: false,
        },
        None | Some("none") => RopeScaling::None,
        Some(other) => {
            return Err(m.err(format!(
                "RoPE scaling type '{other}' ('{}') is not supported for gpt-oss (yarn, none)",
                m.key("rope.scaling.type")
            )));
        }
    };
    let rope = m.rope(RopeStyle::Half, theta, head_dim, head_dim, &scaling, None)?;
    let experts = Experts {
        router: RouterKind::TopKSoftmax,
        glu: Glu::ClampedSwiglu {
            alpha: m.f32_opt("expert_swiglu_alpha")?.unwrap_or(1.702),
            limit: m.positive_f32("expert_swiglu_limit", 7.0)?,
        },
    };
    let moe = m.moe(experts, Some(0))?.expect("a MoE layer");
    let bias = m.has(TensorId::layer(0, TensorKind::AttnQBias));
    let layers = (0..b.n_layers)
        .map(|i| LayerSpec {
            attention: AttentionSpec {
                n_heads: b.n_heads[i],
                n_kv_heads: b.n_kv[i],
                head_dim,
                window: if i % 2 == 0 { window } else { None },
                rope: rope.clone(),
                scale: (head_dim as f32).powf(-0.5),
                qk_norm: false,
                v_norm: false,
                k_eq_v: false,
                qkv_bias: bias,
                o_bias: m.has(TensorId::layer(i, TensorKind::AttnOutBias)),
                sinks: true,
                kv_source: None,
                mla: None,
                output_gate: false,
                indexer: None,
            },
            mlp: None,
            moe: Some(moe.clone()),
            linear: None,
            ngram: None,
        })
        .collect();
    let (bos, eos) = token_ids(m.g)?;
    Ok(ModelSpec {
        family: Family::GptOss,
        arch: m.arch.to_string(),
        vocab_size: b.vocab,
        hidden_size: b.hidden,
        rms_norm_eps: b.eps,
        activation: Activation::Silu,
        embed_scale: 1.0,
        norm_weight_offset: 0.0,
        final_logit_softcap: None,
        tie_word_embeddings: !m.has(TensorId::model(TensorKind::Output)),
        max_context: b.max_context,
        layers,
        ple: None,
        hyper: None,
        bos_token_id: bos,
        eos_token_ids: eos,
        weight_dtype: None,
    })
}

fn gemma(m: &Meta) -> Result<ModelSpec> {
    let b = base(m)?;
    let gemma4 = m.arch == "gemma4";
    let n = b.n_layers;

    let full_hd = head_dim(m, "attention.key_length", "attention.value_length", b.hidden / b.n_heads[0])?;
    let swa_hd =
        if gemma4 { head_dim(m, "attention.key_length_swa", "attention.value_length_swa", full_hd)? } else { full_hd };

    // Sliding layers. llama.cpp drops sliding attention when the window is absent or 0.
    let window = m.usize_opt("attention.sliding_window")?.filter(|&w| w > 0);
    let mut sliding = match window {
        Some(_) => m.sliding_pattern(n, 6)?,
        None if gemma4 => return Err(m.err(format!("metadata key '{}' is missing", m.key("attention.sliding_window")))),
        None => vec![false; n],
    };
    if gemma4 && let Some(last) = sliding.last_mut() {
        // transformers makes Gemma 4's last layer global whatever layer_types says.
        *last = false;
    }

    // RoPE: full layers on rope.freq_base with the file's scaling and (Gemma 4) the
    // rope_freqs divisors; sliding layers on rope.freq_base_swa, unscaled.
    let theta = m.f32_opt("rope.freq_base")?.unwrap_or(10_000.0);
    let theta_swa = m.f32_opt("rope.freq_base_swa")?.unwrap_or(10_000.0);
    let n_rot_full = m.usize_opt("rope.dimension_count")?.unwrap_or(full_hd);
    let n_rot_swa =
        if gemma4 { m.usize_opt("rope.dimension_count_swa")?.unwrap_or(swa_hd) } else { n_rot_full.min(swa_hd) };
    let factors = if gemma4 { m.rope_freq_factors(n_rot_full)? } else { None };
    let rope_full = m.rope(RopeStyle::Half, theta, full_hd, n_rot_full, &m.rope_scaling()?, factors.as_deref())?;
    let rope_swa = m.rope(RopeStyle::Half, theta_swa, swa_hd, n_rot_swa, &RopeScaling::None, None)?;

    // Gemma 3 scales queries by query_pre_attn_scalar^-0.5. GGUF does not record that
    // scalar; llama.cpp takes it to be the head dim, except for the 27B (62 layers):
    // hidden / heads. An explicit `attention.scale` (which llama.cpp's converter does not
    // write for Gemma) wins. Gemma 4 scales by 1.
    let scale = match (gemma4, m.f32_opt("attention.scale")?) {
        (true, _) => 1.0,
        (false, Some(s)) if s > 0.0 => s,
        (false, _) => {
            let s = if n == 62 { b.hidden / b.n_heads[0] } else { full_hd };
            (s as f32).powf(-0.5)
        }
    };

    // KV sharing: the last `shared_kv_layers` layers read the cache of the last earlier
    // layer of their own type.
    let n_shared = if gemma4 { m.usize_opt("attention.shared_kv_layers")?.unwrap_or(0) } else { 0 };
    if n_shared >= n && n_shared > 0 {
        return Err(
            m.err(format!("'{}' ({n_shared}) leaves no layer with its own KV", m.key("attention.shared_kv_layers")))
        );
    }
    let first_shared = n - n_shared;
    // k = v: full layers that compute K/V but have no V projection take V from K.
    let k_eq_v = gemma4
        && (0..first_shared)
            .filter(|&i| !sliding[i])
            .any(|i| !m.has(TensorId::layer(i, TensorKind::AttnV)) && m.has(TensorId::layer(i, TensorKind::AttnK)));
    let qkv_bias = m.has(TensorId::layer(0, TensorKind::AttnQBias));

    let ffn = ffn_lengths(m, n, true)?;
    let is_moe: Vec<bool> = (0..n).map(|i| gemma4 && m.has(TensorId::layer(i, TensorKind::Router))).collect();
    let experts = Experts { router: RouterKind::Gemma4, glu: Glu::Gated(Activation::GeluTanh) };
    let moe = m.moe(experts, is_moe.iter().position(|&x| x))?;

    let mut layers = Vec::with_capacity(n);
    for i in 0..n {
        let kv_source = if i >= first_shared {
            let src = (0..first_shared)
                .rev()
                .find(|&j| sliding[j] == sliding[i])
                .ok_or_else(|| m.err(format!("layer {i} shares KV but no earlier layer has its attention type")))?;
            Some(src)
        } else {
            None
        };
        let s = sliding[i];
        layers.push(LayerSpec {
            attention: AttentionSpec {
                n_heads: b.n_heads[i],
                n_kv_heads: b.n_kv[i],
                head_dim: if s { swa_hd } else { full_hd },
                window: if s { window } else { None },
                rope: if s { rope_swa.clone() } else { rope_full.clone() },
                scale,
                qk_norm: true,
                v_norm: gemma4,
                k_eq_v: k_eq_v && !s,
                qkv_bias,
                o_bias: false,
                sinks: false,
                kv_source,
                mla: None,
                output_gate: false,
                indexer: None,
            },
            mlp: Some(ffn[i]),
            moe: if is_moe[i] { moe.clone() } else { None },
            linear: None,
            ngram: None,
        });
    }

    let ple = match gemma4.then(|| m.usize_opt("embedding_length_per_layer_input")).transpose()?.flatten() {
        Some(dim) if dim > 0 => {
            let rows = m.g.tensor(&gguf_name(TensorId::model(TensorKind::PleTokenEmbd))).map(|t| t.shape[0]);
            Some(PleSpec { dim, vocab_size: rows.unwrap_or(b.vocab) })
        }
        _ => None,
    };

    let (bos, eos) = token_ids(m.g)?;
    Ok(ModelSpec {
        family: Family::Gemma,
        arch: m.arch.to_string(),
        vocab_size: b.vocab,
        hidden_size: b.hidden,
        rms_norm_eps: b.eps,
        activation: Activation::GeluTanh,
        embed_scale: (b.hidden as f64).sqrt() as f32,
        norm_weight_offset: 0.0,
        final_logit_softcap: m.f32_opt("final_logit_softcapping")?.filter(|&c| c > 0.0),
        tie_word_embeddings: !m.has(TensorId::model(TensorKind::Output)),
        max_context: b.max_context,
        layers,
        ple,
        hyper: None,
        bos_token_id: bos,
        eos_token_ids: eos,
        weight_dtype: None,
    })
}
