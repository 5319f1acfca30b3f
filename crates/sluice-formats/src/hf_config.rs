//! Hugging Face `config.json` to [`ModelSpec`].
//!
//! Each family's reading follows what its `transformers` configuration class does
//! with the same fields, defaults included, since a checkpoint's config.json only
//! holds what differs from those defaults.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use sluice_core::{
    Activation, AttentionSpec, DeltaNetSpec, Error, Family, Glu, HeadOrder, HyperSpec, IndexerSpec, LayerSpec,
    MAX_CONFIG_SIZE, MAX_LAYERS, MlaSpec, ModelSpec, MoeSpec, NgramSpec, PleSpec, Result, RopeScaling, RopeSpec,
    RopeStyle, RouterKind, SharedExperts,
};

pub const SUPPORTED: &str = "deepseek_v3, gemma3, gemma3_text, gemma4, gemma4_text, gpt_oss, llama, qwen2, qwen3, \
                             qwen3_moe, qwen3_5_moe, qwen3_5_moe_text, qwen4_exp, qwen4_exp_text";

/// A JSON object with the file it came from, for errors that name both.
#[derive(Clone, Copy)]
struct Cfg<'a> {
    path: &'a Path,
    obj: &'a Map<String, Value>,
}

impl<'a> Cfg<'a> {
    fn err(&self, msg: String) -> Error {
        Error::config(self.path, msg)
    }
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }
    /// A size or count, at most [`MAX_CONFIG_SIZE`].
    fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.u64_opt(key)? {
            Some(x) if x > MAX_CONFIG_SIZE as u64 => {
                Err(self
                    .err(format!("'{key}' is {x}, more than sluice accepts for a size or count ({MAX_CONFIG_SIZE})")))
            }
            x => Ok(x.map(|x| x as usize)),
        }
    }
    /// A number of layers, at most [`MAX_LAYERS`].
    fn layers_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.usize_opt(key)? {
            Some(n) if n > MAX_LAYERS => {
                Err(self.err(format!("'{key}' is {n}, more layers than sluice accepts ({MAX_LAYERS})")))
            }
            n => Ok(n),
        }
    }
    /// Any non-negative integer (a seed, a hash modulus).
    fn u64_opt(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.err(format!("'{key}' must be a non-negative integer, found {v}"))),
        }
    }
    fn usize(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?.ok_or_else(|| self.err(format!("'{key}' is missing")))
    }
    /// A window or similar length that must not be zero (a window of 0 sees nothing).
    fn positive_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.usize_opt(key)? {
            Some(0) => Err(self.err(format!("'{key}' is 0; it must be positive"))),
            n => Ok(n),
        }
    }
    /// A number that must be positive and finite (a clamp limit), or `default`.
    fn positive_f32(&self, key: &str, default: f32) -> Result<f32> {
        match self.f32_opt(key)?.unwrap_or(default) {
            x if x > 0.0 && x.is_finite() => Ok(x),
            x => Err(self.err(format!("'{key}' is {x}; it must be a positive number"))),
        }
    }
    /// A share of something (`partial_rotary_factor`): in (0, 1].
    fn fraction_opt(&self, key: &str) -> Result<Option<f32>> {
        match self.f32_opt(key)? {
            Some(x) if !(x > 0.0 && x <= 1.0) => Err(self.err(format!("'{key}' is {x}; it must be in (0, 1]"))),
            x => Ok(x),
        }
    }
    fn f32_opt(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.err(format!("'{key}' must be a number, found {v}"))),
        }
    }
    fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                v.as_bool().map(Some).ok_or_else(|| self.err(format!("'{key}' must be true or false, found {v}")))
            }
        }
    }
    fn str_opt(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.err(format!("'{key}' must be a string, found {v}"))),
        }
    }
    fn ids(&self, key: &str) -> Result<Vec<u32>> {
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().map(|x| x as u32))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| self.err(format!("'{key}' must be a list of token ids"))),
            Some(v) => v
                .as_u64()
                .map(|x| vec![x as u32])
                .ok_or_else(|| self.err(format!("'{key}' must be a token id or a list of them, found {v}"))),
        }
    }
    fn sub(&self, key: &str) -> Result<Option<Cfg<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Cfg { path: self.path, obj })),
            Some(v) => Err(self.err(format!("'{key}' must be an object, found {v}"))),
        }
    }
}

/// What a Hugging Face folder's config says, plus where its tensors are named from.
pub struct HfConfig {
    pub spec: ModelSpec,
    /// True when the language model sits inside a multimodal wrapper
    /// (`model.language_model.*` tensor names).
    pub wrapped: bool,
}

pub fn read(dir: &Path) -> Result<HfConfig> {
    let path: PathBuf = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let root: Value = serde_json::from_str(&text).map_err(|e| Error::config(&path, format!("invalid JSON: {e}")))?;
    let obj = root.as_object().ok_or_else(|| Error::config(&path, "the top level is not an object"))?;
    let top = Cfg { path: &path, obj };
    let outer_type = top.str_opt("model_type")?.unwrap_or("").to_string();
    // Multimodal wrappers keep the language model's settings under text_config.
    let (cfg, wrapped) = match top.sub("text_config")? {
        Some(t) => (t, true),
        None => (top, false),
    };
    let model_type = cfg.str_opt("model_type")?.map(str::to_string).unwrap_or(outer_type.clone());
    let spec = match model_type.as_str() {
        "gemma4" | "gemma4_text" => gemma4(&cfg, &top)?,
        "gemma3" | "gemma3_text" => gemma3(&cfg, &top)?,
        "llama" | "qwen2" | "qwen3" | "qwen3_moe" => llama_like(&cfg, &model_type)?,
        "gpt_oss" => gpt_oss(&cfg)?,
        "deepseek_v3" => deepseek_v3(&cfg)?,
        "qwen3_5_moe" | "qwen3_5_moe_text" => qwen35_moe(&cfg, &top, Hybrid::Qwen35)?,
        "qwen4_exp" | "qwen4_exp_text" => qwen4_exp(&cfg, &top)?,
        _ => {
            return Err(Error::UnknownArchitecture {
                path,
                model_type: if model_type.is_empty() { "(none)".into() } else { model_type },
                supported: SUPPORTED.into(),
            });
        }
    };
    spec.check_sizes().map_err(|e| Error::config(&path, e))?;
    Ok(HfConfig { spec, wrapped })
}

fn activation(cfg: &Cfg, key: &str, default: Activation) -> Result<Activation> {
    Ok(match cfg.str_opt(key)? {
        None => default,
        Some("silu") | Some("swish") => Activation::Silu,
        Some("gelu_pytorch_tanh") | Some("gelu_tanh") | Some("gelu_new") => Activation::GeluTanh,
        Some(other) => return Err(cfg.err(format!("activation '{other}' is not supported (silu, gelu_pytorch_tanh)"))),
    })
}

/// Reads one RoPE parameter object (`rope_parameters` in transformers 5 form, or the
/// older `rope_theta` + `rope_scaling` pair) into theta and scaling.
fn rope_params(cfg: &Cfg, params: Option<&Cfg>, default_theta: f32) -> Result<(f32, RopeScaling)> {
    let theta = match params {
        Some(p) => p.f32_opt("rope_theta")?,
        None => None,
    }
    .or(cfg.f32_opt("rope_theta")?)
    .unwrap_or(default_theta);
    let scaling_obj = match params {
        Some(p) => Some(Cfg { path: p.path, obj: p.obj }),
        None => cfg.sub("rope_scaling")?,
    };
    let Some(s) = scaling_obj else {
        return Ok((theta, RopeScaling::None));
    };
    let kind = s.str_opt("rope_type")?.or(s.str_opt("type")?).unwrap_or("default");
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: s.f32_opt("factor")?.unwrap_or(1.0) },
        "llama3" => RopeScaling::Llama3 {
            factor: s.f32_opt("factor")?.ok_or_else(|| s.err("llama3 RoPE needs 'factor'".into()))?,
            low_freq_factor: s.f32_opt("low_freq_factor")?.unwrap_or(1.0),
            high_freq_factor: s.f32_opt("high_freq_factor")?.unwrap_or(4.0),
            original_max_position: s
                .usize_opt("original_max_position_embeddings")?
                .ok_or_else(|| s.err("llama3 RoPE needs 'original_max_position_embeddings'".into()))?
                as f32,
        },
        "yarn" => RopeScaling::Yarn {
            factor: s.f32_opt("factor")?.ok_or_else(|| s.err("yarn RoPE needs 'factor'".into()))?,
            original_max_position: s
                .usize_opt("original_max_position_embeddings")?
                .ok_or_else(|| s.err("yarn RoPE needs 'original_max_position_embeddings'".into()))?
                as f32,
            // transformers reads these with `or`: a 0 takes the default too.
            beta_fast: s.f32_opt("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
            beta_slow: s.f32_opt("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
            attention_factor: s.f32_opt("attention_factor")?,
            truncate: s.bool_opt("truncate")?.unwrap_or(true),
        },
        "proportional" => RopeScaling::Proportional {
            partial: s.fraction_opt("partial_rotary_factor")?.unwrap_or(1.0),
            factor: s.f32_opt("factor")?.unwrap_or(1.0),
        },
        other => return Err(s.err(format!("RoPE type '{other}' is not supported"))),
    };
    Ok((theta, scaling))
}

fn llama_like(cfg: &Cfg, model_type: &str) -> Result<ModelSpec> {
    let hidden = cfg.usize("hidden_size")?;
    let n_heads = cfg.usize("num_attention_heads")?;
    let n_kv = cfg.usize_opt("num_key_value_heads")?.unwrap_or(n_heads);
    // Qwen3's config class defaults head_dim to 128; the others derive it.
    let default_hd = if model_type == "qwen3" { 128 } else { hidden / n_heads.max(1) };
    let head_dim = cfg.usize_opt("head_dim")?.unwrap_or(default_hd);
    if cfg.bool_opt("use_sliding_window")?.unwrap_or(false) {
        return Err(cfg.err("use_sliding_window = true is not supported for this family yet".into()));
    }
    let n_layers =
        cfg.layers_opt("num_hidden_layers")?.ok_or_else(|| cfg.err("'num_hidden_layers' is missing".into()))?;
    let vocab = cfg.usize("vocab_size")?;
    let intermediate = cfg.usize("intermediate_size")?;
    if n_heads == 0 || n_kv == 0 || n_heads % n_kv != 0 {
        return Err(cfg.err(format!(
            "num_attention_heads ({n_heads}) must be a positive multiple of num_key_value_heads ({n_kv})"
        )));
    }
    let rope_cfg = cfg.sub("rope_parameters")?;
    let (theta, scaling) = rope_params(cfg, rope_cfg.as_ref(), 10000.0)?;
    let partial = cfg.fraction_opt("partial_rotary_factor")?.unwrap_or(1.0);
    let rotary_dim = ((head_dim as f32 * partial) as usize).max(2);
    let rope = RopeSpec::new(RopeStyle::Half, theta, head_dim, rotary_dim, &scaling);
    let qwen3 = model_type.starts_with("qwen3");
    let moe = if model_type == "qwen3_moe" {
        // transformers maps num_experts to num_local_experts; both appear in files.
        let n_experts = match cfg.usize_opt("num_experts")? {
            Some(n) => n,
            None => cfg.usize_opt("num_local_experts")?.unwrap_or(128),
        };
        let top_k = cfg.usize_opt("num_experts_per_tok")?.unwrap_or(8);
        if n_experts > 0 && (top_k == 0 || top_k > n_experts) {
            return Err(
                cfg.err(format!("num_experts_per_tok ({top_k}) must be between 1 and num_experts ({n_experts})"))
            );
        }
        Some((
            MoeSpec {
                n_experts,
                top_k,
                intermediate: cfg.usize_opt("moe_intermediate_size")?.unwrap_or(768),
                router: RouterKind::Softmax { normalize_top_k: cfg.bool_opt("norm_topk_prob")?.unwrap_or(false) },
                glu: Glu::Gated(activation(cfg, "hidden_act", Activation::Silu)?),
                expert_bias: false,
                shared: None,
            },
            cfg.usize_opt("decoder_sparse_step")?.unwrap_or(1).max(1),
            cfg.ids("mlp_only_layers")?,
        ))
    } else {
        None
    };
    let layers = (0..n_layers)
        .map(|i| {
            let sparse = moe.as_ref().filter(|(m, step, dense_only)| {
                m.n_experts > 0 && !dense_only.contains(&(i as u32)) && (i + 1) % step == 0
            });
            LayerSpec {
                attention: AttentionSpec {
                    n_heads,
                    n_kv_heads: n_kv,
                    head_dim,
                    window: None,
                    rope: rope.clone(),
                    scale: (head_dim as f32).powf(-0.5),
                    qk_norm: qwen3,
                    v_norm: false,
                    k_eq_v: false,
                    qkv_bias: model_type == "qwen2" || cfg.bool_opt("attention_bias").ok().flatten().unwrap_or(false),
                    o_bias: false,
                    sinks: false,
                    kv_source: None,
                    mla: None,
                    output_gate: false,
                    indexer: None,
                },
                mlp: if sparse.is_some() { None } else { Some(intermediate) },
                moe: sparse.map(|(m, _, _)| m.clone()),
                linear: None,
                ngram: None,
            }
        })
        .collect();
    Ok(ModelSpec {
        family: Family::Llama,
        arch: model_type.to_string(),
        vocab_size: vocab,
        hidden_size: hidden,
        rms_norm_eps: cfg.f32_opt("rms_norm_eps")?.unwrap_or(1e-6),
        activation: activation(cfg, "hidden_act", Activation::Silu)?,
        embed_scale: 1.0,
        norm_weight_offset: 0.0,
        final_logit_softcap: None,
        tie_word_embeddings: cfg.bool_opt("tie_word_embeddings")?.unwrap_or(false),
        max_context: cfg.usize_opt("max_position_embeddings")?.unwrap_or(4096),
        layers,
        ple: None,
        hyper: None,
        bos_token_id: cfg.ids("bos_token_id")?.first().copied(),
        eos_token_ids: cfg.ids("eos_token_id")?,
        weight_dtype: None,
    })
}

/// Which layers slide, from `layer_types` (one entry per layer) or `default`.
fn sliding_layers(cfg: &Cfg, n_layers: usize, default: impl Fn(usize) -> bool) -> Result<Vec<bool>> {
    match cfg.get("layer_types") {
        None => Ok((0..n_layers).map(default).collect()),
        Some(Value::Array(a)) if a.len() == n_layers => a
            .iter()
            .map(|v| match v.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(cfg.err(format!("unknown layer type {v} in 'layer_types'"))),
            })
            .collect(),
        Some(Value::Array(a)) => Err(cfg.err(format!("'layer_types' has {} entries for {n_layers} layers", a.len()))),
        Some(v) => Err(cfg.err(format!("'layer_types' must be a list, found {v}"))),
    }
}

/// gpt-oss, as `GptOssConfig` reads it: every layer has attention sinks, biases on
/// all four attention projections, and routed experts (top-k of the router's logits,
/// softmax over those, a clamped SwiGLU with biases); layers alternate sliding
/// (even indices) and full attention; YaRN RoPE.
fn gpt_oss(cfg: &Cfg) -> Result<ModelSpec> {
    let hidden = cfg.usize_opt("hidden_size")?.unwrap_or(2880);
    let n_layers = cfg.layers_opt("num_hidden_layers")?.unwrap_or(36);
    let n_heads = cfg.usize_opt("num_attention_heads")?.unwrap_or(64);
    let n_kv = cfg.usize_opt("num_key_value_heads")?.unwrap_or(n_heads);
    let head_dim = cfg.usize_opt("head_dim")?.unwrap_or(64);
    if n_heads == 0 || n_kv == 0 || n_heads % n_kv != 0 {
        return Err(cfg.err(format!(
            "num_attention_heads ({n_heads}) must be a positive multiple of num_key_value_heads ({n_kv})"
        )));
    }
    let n_experts = match cfg.usize_opt("num_local_experts")? {
        Some(n) => n,
        None => cfg.usize_opt("num_experts")?.unwrap_or(128),
    };
    let top_k = cfg.usize_opt("num_experts_per_tok")?.unwrap_or(4);
    if top_k == 0 || top_k > n_experts {
        return Err(
            cfg.err(format!("num_experts_per_tok ({top_k}) must be between 1 and num_local_experts ({n_experts})"))
        );
    }
    let sliding = sliding_layers(cfg, n_layers, |i| i % 2 == 0)?;
    let window = cfg.positive_opt("sliding_window")?.unwrap_or(128);
    let rope_cfg = cfg.sub("rope_parameters")?;
    let (theta, scaling) = match (&rope_cfg, cfg.sub("rope_scaling")?) {
        (None, None) => (
            cfg.f32_opt("rope_theta")?.unwrap_or(150_000.0),
            RopeScaling::Yarn {
                factor: 32.0,
                original_max_position: 4096.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: None,
                truncate: false,
            },
        ),
        _ => rope_params(cfg, rope_cfg.as_ref(), 150_000.0)?,
    };
    let rope = RopeSpec::new(RopeStyle::Half, theta, head_dim, head_dim, &scaling);
    let bias = cfg.bool_opt("attention_bias")?.unwrap_or(true);
    let moe = MoeSpec {
        n_experts,
        top_k,
        intermediate: cfg.usize_opt("intermediate_size")?.unwrap_or(2880),
        router: RouterKind::TopKSoftmax,
        glu: Glu::ClampedSwiglu {
            alpha: cfg.f32_opt("swiglu_alpha")?.unwrap_or(1.702),
            limit: cfg.positive_f32("swiglu_limit", 7.0)?,
        },
        expert_bias: true,
        shared: None,
    };
    let layers = sliding
        .iter()
        .map(|&s| LayerSpec {
            attention: AttentionSpec {
                n_heads,
                n_kv_heads: n_kv,
                head_dim,
                window: s.then_some(window),
                rope: rope.clone(),
                scale: (head_dim as f32).powf(-0.5),
                qk_norm: false,
                v_norm: false,
                k_eq_v: false,
                qkv_bias: bias,
                o_bias: bias,
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
    Ok(ModelSpec {
        family: Family::GptOss,
        arch: "gpt_oss".into(),
        vocab_size: cfg.usize_opt("vocab_size")?.unwrap_or(201_088),
        hidden_size: hidden,
        rms_norm_eps: cfg.f32_opt("rms_norm_eps")?.unwrap_or(1e-5),
        activation: Activation::Silu,
        embed_scale: 1.0,
        norm_weight_offset: 0.0,
        final_logit_softcap: None,
        tie_word_embeddings: cfg.bool_opt("tie_word_embeddings")?.unwrap_or(false),
        max_context: cfg.usize_opt("max_position_embeddings")?.unwrap_or(131_072),
        layers,
        ple: None,
        hyper: None,
        bos_token_id: cfg.ids("bos_token_id")?.first().copied(),
        eos_token_ids: cfg.ids("eos_token_id")?,
        weight_dtype: None,
    })
}

/// YaRN's magnitude correction `0.1 m ln s + 1` (1 for no extension).
fn yarn_mscale(scale: f32, m: f32) -> f32 {
    if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 }
}

/// DeepSeek-V3, as `DeepseekV3Config` reads it: multi-head latent attention on every
/// layer (the query through a `q_lora_rank` bottleneck unless it is null), dense MLPs
/// on the first `first_k_dense_replace` layers, then sigmoid-routed experts in groups
/// beside `n_shared_experts` shared ones. `head_dim` in a saved config is the RoPE
/// width, not an attention head's.
fn deepseek_v3(cfg: &Cfg) -> Result<ModelSpec> {
    let hidden = cfg.usize("hidden_size")?;
    let n_layers =
        cfg.layers_opt("num_hidden_layers")?.ok_or_else(|| cfg.err("'num_hidden_layers' is missing".into()))?;
    let n_heads = cfg.usize_opt("num_attention_heads")?.unwrap_or(128);
    let positive = |key: &str, default: usize| -> Result<usize> {
        let v = cfg.usize_opt(key)?.unwrap_or(default);
        if v == 0 {
            return Err(cfg.err(format!("'{key}' must be positive for multi-head latent attention")));
        }
        Ok(v)
    };
    let kv_lora_rank = positive("kv_lora_rank", 512)?;
    let q_lora_rank = match cfg.get("q_lora_rank") {
        Some(Value::Null) => None,
        None => Some(1536),
        Some(_) => Some(positive("q_lora_rank", 1536)?),
    };
    let (nope_dim, rope_dim, v_dim) =
        (positive("qk_nope_head_dim", 128)?, positive("qk_rope_head_dim", 64)?, positive("v_head_dim", 128)?);
    if n_heads == 0 || rope_dim % 2 != 0 {
        return Err(
            cfg.err(format!("num_attention_heads ({n_heads}) must be positive and qk_rope_head_dim ({rope_dim}) even"))
        );
    }
    let rope_cfg = cfg.sub("rope_parameters")?;
    let (theta, mut scaling) = rope_params(cfg, rope_cfg.as_ref(), 10000.0)?;
    let rope_obj = match rope_cfg {
        Some(r) => Some(r),
        None => cfg.sub("rope_scaling")?,
    };
    // The softmax scale over the per-head dims, times YaRN's mscale(factor,
    // mscale_all_dim)^2; the cos/sin factor mscale(factor, mscale) / mscale(factor,
    // mscale_all_dim) when both are given.
    let mut scale = ((nope_dim + rope_dim) as f32).powf(-0.5);
    if let (RopeScaling::Yarn { factor, attention_factor, .. }, Some(r)) = (&mut scaling, &rope_obj) {
        let (m, m_all) = (r.f32_opt("mscale")?, r.f32_opt("mscale_all_dim")?.filter(|&m| m != 0.0));
        if let Some(m_all) = m_all {
            scale *= yarn_mscale(*factor, m_all).powi(2);
        }
        if let (None, Some(m), Some(m_all)) = (*attention_factor, m.filter(|&m| m != 0.0), m_all) {
            *attention_factor = Some(yarn_mscale(*factor, m) / yarn_mscale(*factor, m_all));
        }
    }
    let style = if cfg.bool_opt("rope_interleave")?.unwrap_or(true) { RopeStyle::Interleaved } else { RopeStyle::Half };
    let rope = RopeSpec::new(style, theta, rope_dim, rope_dim, &scaling);
    let n_experts = match cfg.usize_opt("n_routed_experts")? {
        Some(n) => n,
        None => cfg.usize_opt("num_local_experts")?.unwrap_or(256),
    };
    let top_k = cfg.usize_opt("num_experts_per_tok")?.unwrap_or(8);
    let (n_groups, topk_groups) = (cfg.usize_opt("n_group")?.unwrap_or(8), cfg.usize_opt("topk_group")?.unwrap_or(4));
    if top_k == 0 || top_k > n_experts || n_groups == 0 || n_experts % n_groups != 0 || n_experts / n_groups < 2 {
        return Err(cfg.err(format!(
            "{n_experts} routed experts in {n_groups} groups, top-{top_k}: the groups must be equal, of at least two \
             experts, and top-k between 1 and the experts"
        )));
    }
    if topk_groups == 0 || topk_groups > n_groups || topk_groups * (n_experts / n_groups) < top_k {
        return Err(cfg.err(format!(
            "topk_group ({topk_groups}) must be between 1 and n_group ({n_groups}) and hold top-{top_k} experts"
        )));
    }
    if cfg.str_opt("scoring_func")?.is_some_and(|f| f != "sigmoid") {
        return Err(cfg.err("scoring_func: only 'sigmoid' (DeepSeek-V3) is supported".into()));
    }
    let moe_i = cfg.usize_opt("moe_intermediate_size")?.unwrap_or(2048);
    let moe = MoeSpec {
        n_experts,
        top_k,
        intermediate: moe_i,
        router: RouterKind::SigmoidGroupLimited {
            n_groups,
            topk_groups,
            normalize_top_k: cfg.bool_opt("norm_topk_prob")?.unwrap_or(true),
            scaling: cfg.f32_opt("routed_scaling_factor")?.unwrap_or(2.5),
        },
        glu: Glu::Gated(activation(cfg, "hidden_act", Activation::Silu)?),
        expert_bias: false,
        shared: match cfg.usize_opt("n_shared_experts")?.unwrap_or(1) {
            0 => None,
            n => Some(SharedExperts { intermediate: n * moe_i, gated: false }),
        },
    };
    let dense = cfg.usize_opt("first_k_dense_replace")?.unwrap_or(3);
    let intermediate = cfg.usize_opt("intermediate_size")?.unwrap_or(18432);
    let mla = MlaSpec { q_lora_rank, kv_lora_rank, nope_dim, rope_dim, v_dim, latent_eps: 1e-6 };
    let attention = AttentionSpec {
        n_heads,
        n_kv_heads: 1,
        head_dim: kv_lora_rank + rope_dim,
        window: None,
        rope,
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
    };
    if cfg.bool_opt("attention_bias")?.unwrap_or(false) {
        return Err(cfg.err("attention_bias = true is not supported for DeepSeek-V3".into()));
    }
    let layers = (0..n_layers)
        .map(|i| LayerSpec {
            attention: attention.clone(),
            mlp: (i < dense).then_some(intermediate),
            moe: (i >= dense).then(|| moe.clone()),
            linear: None,
            ngram: None,
        })
        .collect();
    Ok(ModelSpec {
        family: Family::DeepSeek,
        arch: "deepseek_v3".into(),
        vocab_size: cfg.usize("vocab_size")?,
        hidden_size: hidden,
        rms_norm_eps: cfg.f32_opt("rms_norm_eps")?.unwrap_or(1e-6),
        activation: activation(cfg, "hidden_act", Activation::Silu)?,
        embed_scale: 1.0,
        norm_weight_offset: 0.0,
        final_logit_softcap: None,
        tie_word_embeddings: cfg.bool_opt("tie_word_embeddings")?.unwrap_or(false),
        max_context: cfg.usize_opt("max_position_embeddings")?.unwrap_or(4096),
        layers,
        ple: None,
        hyper: None,
        bos_token_id: cfg.ids("bos_token_id")?.first().copied(),
        eos_token_ids: cfg.ids("eos_token_id")?,
        weight_dtype: None,
    })
}

/// Qwen3.5/3.6-MoE, as `Qwen3_5MoeTextConfig` reads it (inside the multimodal
/// wrapper's `text_config`, or alone): `layer_types` (or every
/// `full_attention_interval`-th layer full) says which layers are Gated DeltaNet; the
/// full layers' attention is gated and rotates `partial_rotary_factor` of each head;
/// every layer has routed experts (softmax, top-k always renormalised) beside a gated
/// shared expert; every norm multiplies by 1 + w.
/// The two Qwen families of DeltaNet and attention layers, which read one config.
#[derive(Clone, Copy, PartialEq)]
enum Hybrid {
    Qwen35,
    /// Its attention layers are `indexed_attention` (also when written
    /// `full_attention`), RoPE covers the whole head unless told otherwise, and the
    /// router renormalises only under `norm_topk_prob`.
    Qwen4Exp,
}

fn qwen35_moe(cfg: &Cfg, top: &Cfg, hybrid: Hybrid) -> Result<ModelSpec> {
    let hidden = cfg.usize("hidden_size")?;
    let n_layers =
        cfg.layers_opt("num_hidden_layers")?.ok_or_else(|| cfg.err("'num_hidden_layers' is missing".into()))?;
    let n_heads = cfg.usize_opt("num_attention_heads")?.unwrap_or(16);
    let n_kv = cfg.usize_opt("num_key_value_heads")?.unwrap_or(2);
    let head_dim = cfg.usize_opt("head_dim")?.unwrap_or(256);
    if n_heads == 0 || n_kv == 0 || n_heads % n_kv != 0 {
        return Err(cfg.err(format!(
            "num_attention_heads ({n_heads}) must be a positive multiple of num_key_value_heads ({n_kv})"
        )));
    }
    let linear = DeltaNetSpec {
        k_heads: cfg.usize_opt("linear_num_key_heads")?.unwrap_or(16),
        v_heads: cfg.usize_opt("linear_num_value_heads")?.unwrap_or(32),
        k_dim: cfg.usize_opt("linear_key_head_dim")?.unwrap_or(128),
        v_dim: cfg.usize_opt("linear_value_head_dim")?.unwrap_or(128),
        conv_kernel: cfg.usize_opt("linear_conv_kernel_dim")?.unwrap_or(4),
        v_order: HeadOrder::Grouped,
        gate: Activation::Silu,
    };
    if linear.k_heads == 0 || linear.v_heads == 0 || !linear.v_heads.is_multiple_of(linear.k_heads) {
        return Err(cfg.err(format!(
            "linear_num_value_heads ({}) must be a positive multiple of linear_num_key_heads ({})",
            linear.v_heads, linear.k_heads
        )));
    }
    if linear.k_dim == 0 || linear.v_dim == 0 || linear.conv_kernel == 0 {
        return Err(
            cfg.err("linear_key_head_dim, linear_value_head_dim and linear_conv_kernel_dim must be positive".into())
        );
    }
    let interval = cfg.usize_opt("full_attention_interval")?.unwrap_or(4).max(1);
    let full: Vec<bool> = match cfg.get("layer_types") {
        None => (0..n_layers).map(|i| (i + 1) % interval == 0).collect(),
        Some(Value::Array(a)) if a.len() == n_layers => a
            .iter()
            .map(|v| match v.as_str() {
                Some("full_attention") => Ok(true),
                Some("indexed_attention") if hybrid == Hybrid::Qwen4Exp => Ok(true),
                Some("linear_attention") => Ok(false),
                _ => Err(cfg.err(format!("unknown layer type {v} in 'layer_types'"))),
            })
            .collect::<Result<_>>()?,
        Some(v) => return Err(cfg.err(format!("'layer_types' must be a list of {n_layers} layer types, found {v}"))),
    };
    let rope_cfg = cfg.sub("rope_parameters")?;
    let (theta, scaling) = rope_params(cfg, rope_cfg.as_ref(), 10000.0)?;
    if scaling != RopeScaling::None {
        return Err(cfg.err("RoPE scaling is not supported for Qwen3.5 (only the default RoPE)".into()));
    }
    let partial = match rope_cfg.as_ref().map(|r| r.fraction_opt("partial_rotary_factor")).transpose()?.flatten() {
        Some(p) => p,
        None => cfg.fraction_opt("partial_rotary_factor")?.unwrap_or(match hybrid {
            Hybrid::Qwen35 => 0.25,
            Hybrid::Qwen4Exp => 1.0,
        }),
    };
    let rot = (head_dim as f32 * partial) as usize;
    if rot == 0 || !rot.is_multiple_of(2) || rot > head_dim {
        return Err(
            cfg.err(format!("partial_rotary_factor {partial} of head_dim {head_dim} is not an even number of dims"))
        );
    }
    let n_experts = cfg.usize_opt("num_experts")?.unwrap_or(256);
    let top_k = cfg.usize_opt("num_experts_per_tok")?.unwrap_or(8);
    if top_k == 0 || top_k > n_experts {
        return Err(cfg.err(format!("num_experts_per_tok ({top_k}) must be between 1 and num_experts ({n_experts})")));
    }
    let moe = MoeSpec {
        n_experts,
        top_k,
        intermediate: cfg.usize_opt("moe_intermediate_size")?.unwrap_or(512),
        router: RouterKind::Softmax {
            normalize_top_k: hybrid == Hybrid::Qwen35 || cfg.bool_opt("norm_topk_prob")?.unwrap_or(true),
        },
        glu: Glu::Gated(activation(cfg, "hidden_act", Activation::Silu)?),
        expert_bias: false,
        shared: match cfg.usize_opt("shared_expert_intermediate_size")?.unwrap_or(512) {
            0 => None,
            i => Some(SharedExperts { intermediate: i, gated: true }),
        },
    };
    let attention = AttentionSpec {
        n_heads,
        n_kv_heads: n_kv,
        head_dim,
        window: None,
        // RoPE over the first `rot` dims of each head, NeoX halves of those.
        rope: RopeSpec::new(RopeStyle::Half, theta, rot, rot, &RopeScaling::None),
        scale: (head_dim as f32).powf(-0.5),
        qk_norm: true,
        v_norm: false,
        k_eq_v: false,
        qkv_bias: cfg.bool_opt("attention_bias")?.unwrap_or(false),
        o_bias: false,
        sinks: false,
        kv_source: None,
        mla: None,
        output_gate: true,
        indexer: None,
    };
    let layers = full
        .iter()
        .map(|&f| LayerSpec {
            attention: attention.clone(),
            mlp: None,
            moe: Some(moe.clone()),
            linear: (!f).then_some(linear),
            ngram: None,
        })
        .collect();
    let tie = match top.bool_opt("tie_word_embeddings")? {
        Some(t) => t,
        None => cfg.bool_opt("tie_word_embeddings")?.unwrap_or(false),
    };
    Ok(ModelSpec {
        family: Family::Qwen35,
        arch: "qwen3_5_moe".into(),
        vocab_size: cfg.usize("vocab_size")?,
        hidden_size: hidden,
        rms_norm_eps: cfg.f32_opt("rms_norm_eps")?.unwrap_or(1e-6),
        activation: activation(cfg, "hidden_act", Activation::Silu)?,
        embed_scale: 1.0,
        norm_weight_offset: 1.0,
        final_logit_softcap: None,
        tie_word_embeddings: tie,
        max_context: cfg.usize_opt("max_position_embeddings")?.unwrap_or(262_144),
        layers,
        ple: None,
        hyper: None,
        bos_token_id: cfg.ids("bos_token_id")?.first().copied(),
        eos_token_ids: cfg.ids("eos_token_id")?,
        weight_dtype: None,
    })
}

/// Qwen4-Exp: Qwen3.5's layers with hyper-connections for norms, the QSA indexer on
/// every attention layer and hashed n-gram embeddings on the listed linear layers.
fn qwen4_exp(cfg: &Cfg, top: &Cfg) -> Result<ModelSpec> {
    let mut spec = qwen35_moe(cfg, top, Hybrid::Qwen4Exp)?;
    spec.family = Family::Qwen4Exp;
    spec.arch = "qwen4_exp".into();
    let hidden = spec.hidden_size;
    let hyper = HyperSpec {
        streams: cfg.usize_opt("hc_count")?.unwrap_or(4),
        rank: cfg.usize_opt("hc_lowrank")?.unwrap_or(320),
    };
    if hyper.streams < 2 || hyper.rank == 0 {
        return Err(cfg
            .err(format!("hc_count ({}) must be at least 2 and hc_lowrank ({}) positive", hyper.streams, hyper.rank)));
    }
    spec.hyper = Some(hyper);
    let gate = match cfg.str_opt("output_gate_type")? {
        None => spec.activation,
        Some("silu") => Activation::Silu,
        Some("sigmoid") => Activation::Sigmoid,
        Some(other) => return Err(cfg.err(format!("output_gate_type '{other}' is not one of silu, sigmoid"))),
    };

    let need = |key: &str| -> Result<usize> {
        match cfg.usize_opt(key)? {
            Some(v) if v > 0 => Ok(v),
            Some(_) => Err(cfg.err(format!("'{key}' must be positive"))),
            None => Err(cfg.err(format!("'{key}' is missing (every attention layer has a QSA indexer)"))),
        }
    };
    let has_attention = spec.layers.iter().any(|l| l.linear.is_none());
    let indexer = if has_attention {
        let ix = IndexerSpec {
            heads: need("indexer_n_heads")?,
            head_dim: need("indexer_head_dim")?,
            budget: need("indexer_budget")?,
            block: need("indexer_compress_ratio")?,
        };
        if cfg.usize_opt("indexer_kv_heads")?.unwrap_or(1) != 1 {
            return Err(cfg.err("indexer_kv_heads must be 1".into()));
        }
        if !ix.budget.is_multiple_of(ix.block) {
            return Err(cfg.err(format!(
                "indexer_budget ({}) must be a multiple of indexer_compress_ratio ({})",
                ix.budget, ix.block
            )));
        }
        let rot = 2 * spec.layers[0].attention.rope.inv_freq.len();
        if ix.head_dim < rot || !ix.head_dim.is_multiple_of(2) {
            return Err(
                cfg.err(format!("indexer_head_dim ({}) must be even and cover the {rot} rotated dims", ix.head_dim))
            );
        }
        Some(ix)
    } else {
        None
    };

    // `ple_layer_ids` are one-indexed; each must be a linear layer.
    let mut ple_ids: Vec<usize> = match cfg.get("ple_layer_ids") {
        None => vec![],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v.as_u64() {
                Some(i) if i >= 1 && (i as usize) <= spec.layers.len() => Ok(i as usize - 1),
                _ => Err(cfg.err(format!("'ple_layer_ids' holds {v}, not a layer id in 1..={}", spec.layers.len()))),
            })
            .collect::<Result<_>>()?,
        Some(v) => return Err(cfg.err(format!("'ple_layer_ids' must be a list of layer ids, found {v}"))),
    };
    ple_ids.sort_unstable();
    ple_ids.dedup();
    let n = cfg.usize_opt("ngram_size")?.unwrap_or(3);
    let heads_per_n = cfg.usize_opt("heads_per_ngram")?.unwrap_or(8);
    let dim = cfg.usize_opt("ple_embed_dim")?.unwrap_or(hidden);
    let eos = spec.eos_token_ids.first().copied();
    let ngram = |index: usize| -> Result<NgramSpec> {
        let s = NgramSpec {
            index,
            n,
            heads_per_n,
            dim,
            conv_kernel: cfg.usize_opt("ple_conv_kernel_size")?.unwrap_or(4),
            vocab_base: cfg.u64_opt("ngram_vocab_size_base")?.unwrap_or(20_000_000),
            pad_to: cfg.u64_opt("make_ngram_vocab_size_divisible_by")?.unwrap_or(128).max(1),
            seed: cfg.u64_opt("seed")?.unwrap_or(1234),
            eos: eos.ok_or_else(|| cfg.err("eos_token_id is needed by the n-gram embeddings".into()))?,
        };
        if n < 2 || heads_per_n == 0 || s.conv_kernel == 0 || dim == 0 || !dim.is_multiple_of(s.heads()) {
            return Err(cfg.err(format!(
                "ple_embed_dim ({dim}) must be a positive multiple of (ngram_size - 1) * heads_per_ngram \
                 ({} * {heads_per_n}), with ngram_size at least 2",
                n.saturating_sub(1)
            )));
        }
        Ok(s)
    };
    for (index, &l) in ple_ids.iter().enumerate() {
        if spec.layers[l].linear.is_none() {
            return Err(cfg.err(format!("'ple_layer_ids' names layer {} (one-indexed), which is not linear", l + 1)));
        }
        spec.layers[l].ngram = Some(ngram(index)?);
    }
    for l in &mut spec.layers {
        l.attention.indexer = indexer;
        if let Some(d) = &mut l.linear {
            d.gate = gate;
        }
    }
    Ok(spec)
}

fn gemma4(cfg: &Cfg, top: &Cfg) -> Result<ModelSpec> {
    let hidden = cfg.usize_opt("hidden_size")?.unwrap_or(2304);
    let n_layers = cfg.layers_opt("num_hidden_layers")?.unwrap_or(30);
    let n_heads = cfg.usize_opt("num_attention_heads")?.unwrap_or(8);
    let n_kv = cfg.usize_opt("num_key_value_heads")?.unwrap_or(4);
    let head_dim = cfg.usize_opt("head_dim")?.unwrap_or(256);
    let vocab = cfg.usize_opt("vocab_size")?.unwrap_or(262_144);
    let intermediate = cfg.usize_opt("intermediate_size")?.unwrap_or(9216);
    let window = cfg.positive_opt("sliding_window")?.unwrap_or(512);
    let k_eq_v = cfg.bool_opt("attention_k_eq_v")?.unwrap_or(false);
    if cfg.str_opt("use_bidirectional_attention")? == Some("all") {
        return Err(cfg.err("use_bidirectional_attention = \"all\" is not supported for text generation".into()));
    }

    let layer_types: Vec<bool> = match cfg.get("layer_types") {
        Some(Value::Array(a)) => {
            if a.len() != n_layers {
                return Err(cfg.err(format!("'layer_types' has {} entries for {n_layers} layers", a.len())));
            }
            a.iter()
                .map(|v| match v.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(cfg.err(format!("unknown layer type {v} in 'layer_types'"))),
                })
                .collect::<Result<_>>()?
        }
        None => (0..n_layers).map(|i| (i + 1) % 6 != 0).collect(),
        Some(v) => return Err(cfg.err(format!("'layer_types' must be a list, found {v}"))),
    };
    let mut sliding = layer_types;
    // transformers forces the last layer to full attention.
    if let Some(last) = sliding.last_mut() {
        *last = false;
    }
    let type_name = |s: bool| if s { "sliding_attention" } else { "full_attention" };

    // Per-layer head dim and KV heads: either the newer sparse `per_layer_config`
    // (keys are layer indices or layer types) or the older global_* fields, which
    // apply to full-attention layers (global_head_dim defaults to 512, and the
    // KV-head override only applies when attention_k_eq_v is set).
    let mut dims: Vec<(usize, usize)> = vec![(head_dim, n_kv); n_layers];
    if let Some(plc) = cfg.sub("per_layer_config")? {
        for (key, val) in plc.obj {
            let o = val.as_object().ok_or_else(|| cfg.err(format!("per_layer_config['{key}'] must be an object")))?;
            let sub = Cfg { path: cfg.path, obj: o };
            let targets: Vec<usize> = match key.parse::<usize>() {
                Ok(i) if i < n_layers => vec![i],
                Ok(i) => return Err(cfg.err(format!("per_layer_config names layer {i} of {n_layers}"))),
                Err(_) => (0..n_layers).filter(|&i| type_name(sliding[i]) == key).collect(),
            };
            for i in targets {
                if let Some(hd) = sub.usize_opt("head_dim")? {
                    dims[i].0 = hd;
                }
                if let Some(kv) = sub.usize_opt("num_key_value_heads")? {
                    dims[i].1 = kv;
                }
            }
        }
    } else {
        let global_hd = cfg.usize_opt("global_head_dim")?.unwrap_or(512);
        let global_kv = if k_eq_v { cfg.usize_opt("num_global_key_value_heads")? } else { None };
        for (i, d) in dims.iter_mut().enumerate() {
            if !sliding[i] {
                d.0 = global_hd;
                if let Some(kv) = global_kv {
                    d.1 = kv;
                }
            }
        }
    }

    // RoPE per layer type.
    let rope_root = cfg.sub("rope_parameters")?;
    let rope_for = |is_sliding: bool, hd: usize| -> Result<RopeSpec> {
        let key = type_name(is_sliding);
        let p = match &rope_root {
            Some(r) => r.sub(key)?,
            None => None,
        };
        let (theta, scaling) = match p {
            Some(p) => rope_params(&p, Some(&p), if is_sliding { 10_000.0 } else { 1_000_000.0 })?,
            None if is_sliding => (10_000.0, RopeScaling::None),
            None => (1_000_000.0, RopeScaling::Proportional { partial: 0.25, factor: 1.0 }),
        };
        Ok(RopeSpec::new(RopeStyle::Half, theta, hd, hd, &scaling))
    };

    // KV sharing: the last `num_kv_shared_layers` layers reuse the cache of the last
    // earlier layer of the same type.
    let n_shared = cfg.usize_opt("num_kv_shared_layers")?.unwrap_or(0);
    if n_shared > n_layers {
        return Err(cfg.err(format!("num_kv_shared_layers ({n_shared}) exceeds num_hidden_layers ({n_layers})")));
    }
    let first_shared = n_layers - n_shared;
    let double_wide = cfg.bool_opt("use_double_wide_mlp")?.unwrap_or(false);

    let moe = if cfg.bool_opt("enable_moe_block")?.unwrap_or(false) {
        let n_experts = cfg.usize("num_experts")?;
        let top_k = cfg.usize("top_k_experts")?;
        if top_k == 0 || top_k > n_experts {
            return Err(cfg.err(format!("top_k_experts ({top_k}) must be between 1 and num_experts ({n_experts})")));
        }
        Some(MoeSpec {
            n_experts,
            top_k,
            intermediate: cfg.usize("moe_intermediate_size")?,
            router: RouterKind::Gemma4,
            glu: Glu::Gated(activation(cfg, "hidden_activation", Activation::GeluTanh)?),
            expert_bias: false,
            shared: None,
        })
    } else {
        None
    };

    let mut layers = Vec::with_capacity(n_layers);
    for i in 0..n_layers {
        let (hd, kv) = dims[i];
        if kv == 0 || n_heads % kv != 0 {
            return Err(cfg
                .err(format!("layer {i}: num_attention_heads ({n_heads}) must be a multiple of its KV heads ({kv})")));
        }
        let kv_source = if i >= first_shared {
            let src = (0..first_shared).rev().find(|&j| sliding[j] == sliding[i]).ok_or_else(|| {
                cfg.err(format!("layer {i} shares KV but no earlier layer has type {}", type_name(sliding[i])))
            })?;
            Some(src)
        } else {
            None
        };
        let shared = kv_source.is_some();
        layers.push(LayerSpec {
            attention: AttentionSpec {
                n_heads,
                n_kv_heads: kv,
                head_dim: hd,
                window: sliding[i].then_some(window),
                rope: rope_for(sliding[i], hd)?,
                scale: 1.0,
                qk_norm: true,
                v_norm: true,
                k_eq_v: k_eq_v && !sliding[i],
                qkv_bias: cfg.bool_opt("attention_bias")?.unwrap_or(false),
                o_bias: false,
                sinks: false,
                kv_source,
                mla: None,
                output_gate: false,
                indexer: None,
            },
            mlp: Some(intermediate * if double_wide && shared { 2 } else { 1 }),
            moe: moe.clone(),
            linear: None,
            ngram: None,
        });
    }

    let ple_dim = cfg.usize_opt("hidden_size_per_layer_input")?.unwrap_or(256);
    let ple = (ple_dim > 0).then(|| -> Result<PleSpec> {
        Ok(PleSpec { dim: ple_dim, vocab_size: cfg.usize_opt("vocab_size_per_layer_input")?.unwrap_or(262_144) })
    });
    let ple = ple.transpose()?;

    // Token ids may sit on the wrapper or on the text config.
    let eos = {
        let e = cfg.ids("eos_token_id")?;
        if e.is_empty() { top.ids("eos_token_id")? } else { e }
    };
    let bos = cfg.ids("bos_token_id")?.first().copied().or(top.ids("bos_token_id")?.first().copied());
    let tie = match cfg.bool_opt("tie_word_embeddings")? {
        Some(t) => t,
        None => top.bool_opt("tie_word_embeddings")?.unwrap_or(true),
    };

    Ok(ModelSpec {
        family: Family::Gemma,
        arch: "gemma4".into(),
        vocab_size: vocab,
        hidden_size: hidden,
        rms_norm_eps: cfg.f32_opt("rms_norm_eps")?.unwrap_or(1e-6),
        activation: activation(cfg, "hidden_activation", Activation::GeluTanh)?,
        embed_scale: (hidden as f64).sqrt() as f32,
        norm_weight_offset: 0.0,
        final_logit_softcap: cfg.f32_opt("final_logit_softcapping")?,
        tie_word_embeddings: tie,
        max_context: cfg.usize_opt("max_position_embeddings")?.unwrap_or(131_072),
        layers,
        ple,
        hyper: None,
        bos_token_id: bos.or(Some(2)),
        eos_token_ids: if eos.is_empty() { vec![1] } else { eos },
        weight_dtype: None,
    })
}

fn gemma3(cfg: &Cfg, top: &Cfg) -> Result<ModelSpec> {
    let hidden = cfg.usize_opt("hidden_size")?.unwrap_or(2304);
    let n_layers = cfg.layers_opt("num_hidden_layers")?.unwrap_or(26);
    let n_heads = cfg.usize_opt("num_attention_heads")?.unwrap_or(8);
    let n_kv = cfg.usize_opt("num_key_value_heads")?.unwrap_or(4);
    let head_dim = cfg.usize_opt("head_dim")?.unwrap_or(256);
    let window = cfg.positive_opt("sliding_window")?.unwrap_or(4096);
    if n_kv == 0 || n_heads % n_kv != 0 {
        return Err(
            cfg.err(format!("num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv})"))
        );
    }
    let sliding: Vec<bool> = match cfg.get("layer_types") {
        Some(Value::Array(a)) if a.len() == n_layers => a
            .iter()
            .map(|v| match v.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(cfg.err(format!("unknown layer type {v} in 'layer_types'"))),
            })
            .collect::<Result<_>>()?,
        Some(v) => return Err(cfg.err(format!("'layer_types' must list {n_layers} layer types, found {v}"))),
        None => {
            let pattern = cfg.usize_opt("sliding_window_pattern")?.unwrap_or(6).max(1);
            (0..n_layers).map(|i| (i + 1) % pattern != 0).collect()
        }
    };
    // RoPE: per layer type in `rope_parameters`, or the older rope_theta (full
    // layers, with rope_scaling) and rope_local_base_freq (sliding layers).
    let rope_root = cfg.sub("rope_parameters")?;
    let rope_for = |is_sliding: bool| -> Result<RopeSpec> {
        let key = if is_sliding { "sliding_attention" } else { "full_attention" };
        let (theta, scaling) = match rope_root.as_ref().map(|r| r.sub(key)).transpose()?.flatten() {
            Some(p) => rope_params(&p, Some(&p), if is_sliding { 10_000.0 } else { 1_000_000.0 })?,
            None if is_sliding => (cfg.f32_opt("rope_local_base_freq")?.unwrap_or(10_000.0), RopeScaling::None),
            None => rope_params(cfg, None, 1_000_000.0)?,
        };
        Ok(RopeSpec::new(RopeStyle::Half, theta, head_dim, head_dim, &scaling))
    };
    let scale = (cfg.f32_opt("query_pre_attn_scalar")?.unwrap_or(256.0)).powf(-0.5);
    if cfg.f32_opt("attn_logit_softcapping")?.is_some() {
        return Err(cfg.err("attn_logit_softcapping is not supported yet".into()));
    }
    let intermediate = cfg.usize_opt("intermediate_size")?.unwrap_or(9216);
    let layers = (0..n_layers)
        .map(|i| {
            Ok(LayerSpec {
                attention: AttentionSpec {
                    n_heads,
                    n_kv_heads: n_kv,
                    head_dim,
                    window: sliding[i].then_some(window),
                    rope: rope_for(sliding[i])?,
                    scale,
                    qk_norm: true,
                    v_norm: false,
                    k_eq_v: false,
                    qkv_bias: cfg.bool_opt("attention_bias")?.unwrap_or(false),
                    o_bias: false,
                    sinks: false,
                    kv_source: None,
                    mla: None,
                    output_gate: false,
                    indexer: None,
                },
                mlp: Some(intermediate),
                moe: None,
                linear: None,
                ngram: None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let eos = {
        let e = cfg.ids("eos_token_id")?;
        if e.is_empty() { top.ids("eos_token_id")? } else { e }
    };
    Ok(ModelSpec {
        family: Family::Gemma,
        arch: "gemma3".into(),
        vocab_size: cfg.usize_opt("vocab_size")?.unwrap_or(262_208),
        hidden_size: hidden,
        rms_norm_eps: cfg.f32_opt("rms_norm_eps")?.unwrap_or(1e-6),
        activation: activation(cfg, "hidden_activation", Activation::GeluTanh)?,
        embed_scale: (hidden as f64).sqrt() as f32,
        // Gemma 3's RMSNorm multiplies by 1 + weight.
        norm_weight_offset: 1.0,
        final_logit_softcap: cfg.f32_opt("final_logit_softcapping")?,
        tie_word_embeddings: cfg
            .bool_opt("tie_word_embeddings")?
            .or(top.bool_opt("tie_word_embeddings")?)
            .unwrap_or(true),
        max_context: cfg.usize_opt("max_position_embeddings")?.unwrap_or(131_072),
        layers,
        ple: None,
        hyper: None,
        bos_token_id: cfg.ids("bos_token_id")?.first().copied().or(Some(2)),
        eos_token_ids: if eos.is_empty() { vec![1] } else { eos },
        weight_dtype: None,
    })
}
