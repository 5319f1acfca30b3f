//! Canonical tensor identities, and what each source format calls them.
//!
//! The families ask for tensors by meaning (`TensorKind::AttnQ` of layer 3); the
//! name maps here say where each format keeps them. The kinds follow GGUF's
//! semantics: `AttnNorm` is the norm before attention, `FfnNorm` the one before the
//! feed-forward block, whatever a Hugging Face family happens to call them.

use sluice_core::Family;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorKind {
    TokenEmbd,
    OutputNorm,
    Output,
    // Gemma 4 per-layer embeddings, model level.
    PleTokenEmbd,
    PleModelProj,
    PleProjNorm,
    // Attention.
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnOut,
    AttnQBias,
    AttnKBias,
    AttnVBias,
    AttnOutBias,
    /// gpt-oss: one learned logit per query head that joins each attention softmax.
    AttnSinks,
    AttnQNorm,
    AttnKNorm,
    AttnPostNorm,
    // Multi-head latent attention (DeepSeek).
    /// The queries' bottleneck `[q_lora_rank, hidden]`, its norm, and the up-projection
    /// `[heads * (nope + rope), q_lora_rank]`.
    AttnQA,
    AttnQANorm,
    AttnQB,
    /// `[kv_lora_rank + rope, hidden]`: the latent and the shared RoPE key.
    AttnKvAMqa,
    AttnKvANorm,
    /// The latent's up-projection `[heads * (nope + v), kv_lora_rank]` (Hugging Face and
    /// older GGUFs), or its two halves per head: `AttnKB [heads, kv_lora_rank, nope]`
    /// (each head's key half, transposed, to absorb into the query) and `AttnVB
    /// [heads, v, kv_lora_rank]`.
    AttnKvB,
    AttnKB,
    AttnVB,
    // Gated DeltaNet (Qwen3.5's linear attention).
    /// `[2 k_heads k_dim + v_heads v_dim, hidden]`: q, k and v before the convolution.
    SsmQkv,
    /// The output gate `[v_heads v_dim, hidden]`, beta's `[v_heads, hidden]` and the
    /// decay's `[v_heads, hidden]` projections.
    SsmZ,
    SsmBeta,
    SsmAlpha,
    /// The depthwise convolution `[conv_dim, kernel]`.
    SsmConv,
    /// `-exp(A_log)` `[v_heads]` (GGUF stores it so; a Hugging Face folder's `A_log`
    /// is turned into it at open), and the decay's bias.
    SsmA,
    SsmDtBias,
    /// The gated output norm `[v_dim]` and the output projection.
    SsmNorm,
    SsmOut,
    // Feed-forward.
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnDown,
    FfnPostNorm,
    /// Gemma 4 MoE layers: after the dense MLP, before and after the experts.
    FfnPostNorm1,
    FfnPreNorm2,
    FfnPostNorm2,
    /// Router projection `[n_experts, hidden]`.
    Router,
    /// Router bias `[n_experts]`, added to the router logits (gpt-oss; synthetic
    /// checkpoints use it to give experts a popularity skew).
    RouterBias,
    RouterScale,
    RouterExpertScale,
    /// Added to the router's scores only to choose experts (DeepSeek-V3's
    /// `e_score_correction_bias`).
    RouterChoiceBias,
    /// The shared experts as one MLP (DeepSeek, Qwen), and the `[1, hidden]`
    /// projection whose sigmoid scales them (Qwen).
    ShexpGate,
    ShexpUp,
    ShexpDown,
    ShexpGateInp,
    /// Experts fused in one 3-D tensor `[E, 2I, H]` (gate rows, then up rows).
    ExpsGateUp,
    ExpsGate,
    ExpsUp,
    ExpsDown,
    /// Per-expert biases `[E, I]` (gate, up) and `[E, H]` (down) (gpt-oss).
    ExpsGateBias,
    ExpsUpBias,
    ExpsDownBias,
    /// One expert's 2-D tensors (the Hugging Face hub form).
    ExpGate(usize),
    ExpUp(usize),
    ExpDown(usize),
    LayerScalar,
    // Gemma 4 per-layer embeddings, per layer.
    PleGate,
    PleProj,
    PlePostNorm,
    // Qwen4-Exp.
    /// The hyper-connections before attention, before the MLP, and (model level) before
    /// the output.
    AttnHc(HcPart),
    FfnHc(HcPart),
    OutHc(HcPart),
    /// The QSA indexer: its query heads and key `[(heads + 1) head_dim, hidden]`, and
    /// their norms.
    IdxQk,
    IdxQNorm,
    IdxKNorm,
    /// The hashed n-gram embeddings of a layer.
    Ngram(NgramPart),
}

/// A hyper-connection's weights: the streams' norm `[streams hidden]`, the mixer's
/// down `[rank, streams hidden]` and up `[streams hidden, rank]` projections, and the
/// injection gates `[streams, streams hidden]` (not on the output's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HcPart {
    Norm,
    Down,
    Up,
    Inject,
}

/// An n-gram embedding layer's weights: the table `[rows, dim / heads]` (a folder may
/// hold it in shards), the key `[streams hidden, dim]` and value `[hidden, dim]`
/// projections, the norms of the key, the streams and the convolution's input
/// (`[streams hidden]` each), and the depthwise convolution `[streams hidden, kernel]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NgramPart {
    Table,
    Key,
    Value,
    NormKey,
    NormQuery,
    NormConv,
    Conv,
}

fn hc_name(part: HcPart) -> &'static str {
    match part {
        HcPart::Norm => "hc_norm.weight",
        HcPart::Down => "input_mix_weight_down.weight",
        HcPart::Up => "input_mix_weight_up.weight",
        HcPart::Inject => "block_inject_weight.weight",
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorId {
    pub layer: Option<usize>,
    pub kind: TensorKind,
}

impl TensorId {
    pub fn model(kind: TensorKind) -> Self {
        TensorId { layer: None, kind }
    }
    pub fn layer(layer: usize, kind: TensorKind) -> Self {
        TensorId { layer: Some(layer), kind }
    }
}

/// The Hugging Face name of a tensor. `prefix` is the language model's module path
/// (`model.` or `model.language_model.` for multimodal wrappers).
pub fn hf_name(family: Family, prefix: &str, id: TensorId) -> String {
    use TensorKind::*;
    let gemma = family == Family::Gemma;
    let global = |s: &str| format!("{prefix}{s}");
    let Some(l) = id.layer else {
        return match id.kind {
            TokenEmbd => global("embed_tokens.weight"),
            OutputNorm => global("norm.weight"),
            Output => "lm_head.weight".to_string(),
            PleTokenEmbd => global("embed_tokens_per_layer.weight"),
            PleModelProj => global("per_layer_model_projection.weight"),
            PleProjNorm => global("per_layer_projection_norm.weight"),
            OutHc(part) => global(&format!("hyper_connection_mixer.{}", hc_name(part))),
            other => format!("{prefix}<{other:?} has no model-level name>"),
        };
    };
    // Gemma 4 keeps the router and experts beside the MLP; Qwen keeps them inside it.
    let moe = if gemma { "" } else { "mlp." };
    let gpt_oss = family == Family::GptOss;
    // Qwen names its one shared expert in the singular.
    let shexp =
        if matches!(family, Family::Qwen35 | Family::Qwen4Exp) { "mlp.shared_expert" } else { "mlp.shared_experts" };
    let rel = match id.kind {
        AttnNorm => "input_layernorm.weight".to_string(),
        AttnQ => "self_attn.q_proj.weight".into(),
        AttnK => "self_attn.k_proj.weight".into(),
        AttnV => "self_attn.v_proj.weight".into(),
        AttnOut => "self_attn.o_proj.weight".into(),
        AttnQBias => "self_attn.q_proj.bias".into(),
        AttnKBias => "self_attn.k_proj.bias".into(),
        AttnVBias => "self_attn.v_proj.bias".into(),
        AttnOutBias => "self_attn.o_proj.bias".into(),
        AttnSinks => "self_attn.sinks".into(),
        AttnQNorm => "self_attn.q_norm.weight".into(),
        AttnKNorm => "self_attn.k_norm.weight".into(),
        AttnQA => "self_attn.q_a_proj.weight".into(),
        AttnQANorm => "self_attn.q_a_layernorm.weight".into(),
        AttnQB => "self_attn.q_b_proj.weight".into(),
        AttnKvAMqa => "self_attn.kv_a_proj_with_mqa.weight".into(),
        AttnKvANorm => "self_attn.kv_a_layernorm.weight".into(),
        AttnKvB => "self_attn.kv_b_proj.weight".into(),
        // Not in a Hugging Face folder: `Checkpoint` splits kv_b_proj into these.
        AttnKB => "self_attn.kv_b_proj.k_b".into(),
        AttnVB => "self_attn.kv_b_proj.v_b".into(),
        // Llama's "post_attention_layernorm" is the norm before the MLP.
        AttnPostNorm => "post_attention_layernorm.weight".into(),
        FfnNorm if gemma => "pre_feedforward_layernorm.weight".into(),
        FfnNorm => "post_attention_layernorm.weight".into(),
        FfnGate => "mlp.gate_proj.weight".into(),
        FfnUp => "mlp.up_proj.weight".into(),
        FfnDown => "mlp.down_proj.weight".into(),
        FfnPostNorm => "post_feedforward_layernorm.weight".into(),
        FfnPostNorm1 => "post_feedforward_layernorm_1.weight".into(),
        FfnPreNorm2 => "pre_feedforward_layernorm_2.weight".into(),
        FfnPostNorm2 => "post_feedforward_layernorm_2.weight".into(),
        Router if gemma => "router.proj.weight".into(),
        Router if gpt_oss => "mlp.router.weight".into(),
        Router => "mlp.gate.weight".into(),
        RouterBias if gemma => "router.proj.bias".into(),
        RouterBias if gpt_oss => "mlp.router.bias".into(),
        RouterBias => "mlp.gate.bias".into(),
        RouterScale => "router.scale".into(),
        RouterExpertScale => "router.per_expert_scale".into(),
        RouterChoiceBias => "mlp.gate.e_score_correction_bias".into(),
        ShexpGate => format!("{shexp}.gate_proj.weight"),
        ShexpUp => format!("{shexp}.up_proj.weight"),
        ShexpDown => format!("{shexp}.down_proj.weight"),
        ShexpGateInp => "mlp.shared_expert_gate.weight".into(),
        SsmQkv => "linear_attn.in_proj_qkv.weight".into(),
        SsmZ => "linear_attn.in_proj_z.weight".into(),
        SsmBeta => "linear_attn.in_proj_b.weight".into(),
        SsmAlpha => "linear_attn.in_proj_a.weight".into(),
        // Not in a folder as such: `Checkpoint` makes these from `conv1d.weight` [C, 1, K]
        // and `A_log`.
        SsmConv => "linear_attn.conv1d.weight_ck".into(),
        SsmA => "linear_attn.a_neg".into(),
        SsmDtBias => "linear_attn.dt_bias".into(),
        SsmNorm => "linear_attn.norm.weight".into(),
        SsmOut => "linear_attn.out_proj.weight".into(),
        ExpsGateUp => format!("{moe}experts.gate_up_proj"),
        ExpsGate => format!("{moe}experts.gate_proj"),
        ExpsUp => format!("{moe}experts.up_proj"),
        ExpsDown => format!("{moe}experts.down_proj"),
        // gpt-oss's own tensors are `gate_up_proj[_bias]` (transposed, gate and up
        // interleaved) and `down_proj[_bias]`; `Checkpoint` rearranges them into these.
        ExpsGateBias => format!("{moe}experts.gate_proj_bias"),
        ExpsUpBias => format!("{moe}experts.up_proj_bias"),
        ExpsDownBias => format!("{moe}experts.down_proj_bias"),
        ExpGate(e) => format!("{moe}experts.{e}.gate_proj.weight"),
        ExpUp(e) => format!("{moe}experts.{e}.up_proj.weight"),
        ExpDown(e) => format!("{moe}experts.{e}.down_proj.weight"),
        LayerScalar => "layer_scalar".into(),
        PleGate => "per_layer_input_gate.weight".into(),
        PleProj => "per_layer_projection.weight".into(),
        PlePostNorm => "post_per_layer_input_norm.weight".into(),
        AttnHc(part) => format!("attn_hyper_connection.{}", hc_name(part)),
        FfnHc(part) => format!("mlp_hyper_connection.{}", hc_name(part)),
        IdxQk => "self_attn.indexer.index_qk_proj.weight".into(),
        IdxQNorm => "self_attn.indexer.q_layernorm.weight".into(),
        IdxKNorm => "self_attn.indexer.k_layernorm.weight".into(),
        // Not in a folder as such: `Checkpoint` joins the table's shards and views the
        // convolution `[C, 1, K]` as `[C, K]`.
        Ngram(NgramPart::Table) => "ple.ple_embedding.ngram_embedding.weight".into(),
        Ngram(NgramPart::Key) => "ple.key_proj.weight".into(),
        Ngram(NgramPart::Value) => "ple.value_proj.weight".into(),
        Ngram(NgramPart::NormKey) => "ple.norm_key.weight".into(),
        Ngram(NgramPart::NormQuery) => "ple.norm_query.weight".into(),
        Ngram(NgramPart::NormConv) => "ple.norm_conv.weight".into(),
        Ngram(NgramPart::Conv) => "ple.conv1d.weight_ck".into(),
        other => format!("<{other:?} has no layer-level name>"),
    };
    format!("{prefix}layers.{l}.{rel}")
}

/// The GGUF name of a tensor, as llama.cpp's converter writes it (gguf-py's
/// `TENSOR_NAMES`). GGUF keeps experts only as 3-D tensors; the per-expert 2-D kinds map
/// to the legacy `blk.N.ffn_gate.E.weight` names of early Mixtral files, which other
/// files simply do not have.
pub fn gguf_name(id: TensorId) -> String {
    use TensorKind::*;
    let Some(l) = id.layer else {
        return match id.kind {
            TokenEmbd => "token_embd.weight".into(),
            OutputNorm => "output_norm.weight".into(),
            Output => "output.weight".into(),
            PleTokenEmbd => "per_layer_token_embd.weight".into(),
            PleModelProj => "per_layer_model_proj.weight".into(),
            PleProjNorm => "per_layer_proj_norm.weight".into(),
            other => format!("<{other:?} has no model-level name>"),
        };
    };
    let rel = match id.kind {
        AttnNorm => "attn_norm.weight".to_string(),
        AttnQ => "attn_q.weight".into(),
        AttnK => "attn_k.weight".into(),
        AttnV => "attn_v.weight".into(),
        AttnOut => "attn_output.weight".into(),
        AttnQBias => "attn_q.bias".into(),
        AttnKBias => "attn_k.bias".into(),
        AttnVBias => "attn_v.bias".into(),
        AttnOutBias => "attn_output.bias".into(),
        AttnSinks => "attn_sinks.weight".into(),
        AttnQNorm => "attn_q_norm.weight".into(),
        AttnKNorm => "attn_k_norm.weight".into(),
        AttnPostNorm => "post_attention_norm.weight".into(),
        AttnQA => "attn_q_a.weight".into(),
        AttnQANorm => "attn_q_a_norm.weight".into(),
        AttnQB => "attn_q_b.weight".into(),
        AttnKvAMqa => "attn_kv_a_mqa.weight".into(),
        AttnKvANorm => "attn_kv_a_norm.weight".into(),
        AttnKvB => "attn_kv_b.weight".into(),
        AttnKB => "attn_k_b.weight".into(),
        AttnVB => "attn_v_b.weight".into(),
        // Both Llama's post-attention norm and Gemma's pre-feedforward norm.
        FfnNorm => "ffn_norm.weight".into(),
        FfnGate => "ffn_gate.weight".into(),
        FfnUp => "ffn_up.weight".into(),
        FfnDown => "ffn_down.weight".into(),
        FfnPostNorm => "post_ffw_norm.weight".into(),
        FfnPostNorm1 => "post_ffw_norm_1.weight".into(),
        FfnPreNorm2 => "pre_ffw_norm_2.weight".into(),
        FfnPostNorm2 => "post_ffw_norm_2.weight".into(),
        Router => "ffn_gate_inp.weight".into(),
        RouterBias => "ffn_gate_inp.bias".into(),
        // Gemma 4: the converter stores router.scale and router.per_expert_scale as
        // `.scale` companions of the router and of the down experts.
        RouterScale => "ffn_gate_inp.scale".into(),
        RouterExpertScale => "ffn_down_exps.scale".into(),
        RouterChoiceBias => "exp_probs_b.bias".into(),
        ShexpGate => "ffn_gate_shexp.weight".into(),
        ShexpUp => "ffn_up_shexp.weight".into(),
        ShexpDown => "ffn_down_shexp.weight".into(),
        ShexpGateInp => "ffn_gate_inp_shexp.weight".into(),
        SsmQkv => "attn_qkv.weight".into(),
        SsmZ => "attn_gate.weight".into(),
        SsmBeta => "ssm_beta.weight".into(),
        SsmAlpha => "ssm_alpha.weight".into(),
        SsmConv => "ssm_conv1d.weight".into(),
        SsmA => "ssm_a".into(),
        SsmDtBias => "ssm_dt.bias".into(),
        SsmNorm => "ssm_norm.weight".into(),
        SsmOut => "ssm_out.weight".into(),
        ExpsGateUp => "ffn_gate_up_exps.weight".into(),
        ExpsGate => "ffn_gate_exps.weight".into(),
        ExpsUp => "ffn_up_exps.weight".into(),
        ExpsDown => "ffn_down_exps.weight".into(),
        ExpsGateBias => "ffn_gate_exps.bias".into(),
        ExpsUpBias => "ffn_up_exps.bias".into(),
        ExpsDownBias => "ffn_down_exps.bias".into(),
        ExpGate(e) => format!("ffn_gate.{e}.weight"),
        ExpUp(e) => format!("ffn_up.{e}.weight"),
        ExpDown(e) => format!("ffn_down.{e}.weight"),
        LayerScalar => "layer_output_scale.weight".into(),
        PleGate => "inp_gate.weight".into(),
        PleProj => "proj.weight".into(),
        PlePostNorm => "post_norm.weight".into(),
        other => format!("<{other:?} has no layer-level name>"),
    };
    format!("blk.{l}.{rel}")
}
