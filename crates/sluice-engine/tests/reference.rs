//! Every tiny fixture checkpoint against the logits `transformers` computed for it
//! (fixtures/tiny, made by scripts/make_fixtures.py): prefill and token-by-token
//! decode both within max |diff| <= 1e-3 x max |ref|.

use std::path::{Path, PathBuf};

use sluice_core::{DType, KvFormat, Precision};
use sluice_engine::{Cpu, LoadOptions, Logits, Model, default_kv_format};
use sluice_formats::Checkpoint;
use sluice_formats::names::{TensorId, TensorKind};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny")
}

struct Reference {
    tokens: Vec<u32>,
    vocab: usize,
    logits: Vec<f32>,
}

fn reference(dir: &Path) -> Reference {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let tokens = meta["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let vocab = meta["vocab_size"].as_u64().unwrap() as usize;
    let bytes = std::fs::read(dir.join(meta["logits"].as_str().unwrap())).unwrap();
    let logits = bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    Reference { tokens, vocab, logits }
}

/// max |a - b| / max |b|
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let max_ref = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    max_diff / max_ref
}

fn check(name: &str) {
    check_file(name, &fixtures().join(name));
}

/// The fixture `name`'s reference against the model at `path` (its folder, or another
/// form of the same weights). Products on quantized weights take 16-bit activations
/// (`Precision::Accurate`), so the only difference from transformers' f32 forward over
/// the same (dequantized) weights is rounding.
fn check_file(name: &str, path: &Path) {
    check_form(name, path, Vocab::Whole);
}

/// How much of the reference's vocabulary a form keeps.
enum Vocab {
    Whole,
    /// The first n ids: llama.cpp's Gemma converter cuts the embedding rows past the
    /// tokenizer's own (the tiny fixture pads its vocabulary; real Gemma files do not).
    First(usize),
}

fn check_form(name: &str, path: &Path, vocab: Vocab) {
    let dir = fixtures().join(name);
    let mut r = reference(&dir);
    if let Vocab::First(n) = vocab {
        r.logits = r.logits.chunks(r.vocab).flat_map(|row| &row[..n]).copied().collect();
        r.vocab = n;
    }
    let ckpt = Checkpoint::open(path).unwrap_or_else(|e| panic!("{name}: {e}"));
    // An f32 KV cache, so that only arithmetic differs; the default width is checked
    // after.
    let opts = LoadOptions { precision: Some(Precision::Accurate), kv: Some(KvFormat::F32), ..Default::default() };
    let mut model = Model::load_with(Cpu::default(), &ckpt, &opts, None).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(model.spec.vocab_size, r.vocab);

    let mut s = model.session().unwrap();
    let prefill = s.forward(&r.tokens, Logits::All).unwrap();
    let e = rel_err(&prefill, &r.logits);
    assert!(e <= 1e-3, "{name} prefill: max|diff|/max|ref| = {e:e}");

    let mut s = model.session().unwrap();
    let mut decode = Vec::new();
    for &t in &r.tokens {
        decode.extend(s.forward(&[t], Logits::All).unwrap());
    }
    let e2 = rel_err(&decode, &r.logits);
    assert!(e2 <= 1e-3, "{name} decode: max|diff|/max|ref| = {e2:e}");
    eprintln!("{name}: prefill {e:.2e}, decode {e2:.2e}");

    // Each mode is bitwise repeatable.
    let mut s = model.session().unwrap();
    assert_eq!(s.forward(&r.tokens, Logits::All).unwrap(), prefill, "{name}: prefill not repeatable");

    // The default cache: f32 for an f32 checkpoint (what was just checked), 16 bits for
    // a 16-bit or quantized one, whose keys and values then round to f16 (a relative
    // 2^-11 each) before attention reads them.
    let default = default_kv_format(&model.be, &ckpt);
    let keys = [TensorKind::AttnK, TensorKind::AttnKvAMqa].into_iter().find_map(|k| ckpt.get(TensorId::layer(0, k)));
    let f32_ckpt = keys.is_none_or(|t| t.dtype == DType::F32);
    assert_eq!(default, if f32_ckpt { KvFormat::F32 } else { KvFormat::F16 }, "{name}: default KV width");
    if default != KvFormat::F32 {
        model.kv_format = default;
        let e16 = rel_err(&model.session().unwrap().forward(&r.tokens, Logits::All).unwrap(), &r.logits);
        eprintln!("{name}: prefill with a 16-bit cache {e16:.2e}");
        assert!(e16 <= 5e-3, "{name} prefill, 16-bit cache: max|diff|/max|ref| = {e16:e}");
    }
}

#[test]
fn gemma4_moe() {
    check("gemma4-moe");
}

/// The same weights as llama.cpp's converter writes them (gguf-py, not sluice's writer):
/// norms, the router's scale and the per-expert scales under llama.cpp's names, the
/// experts fused per layer.
#[test]
fn gemma4_moe_gguf_from_llama_cpps_converter() {
    check_form("gemma4-moe", &fixtures().join("gemma4-moe/gemma4-moe.gguf"), Vocab::First(492));
}

#[test]
fn gemma4_dense() {
    check("gemma4-dense");
}

#[test]
fn qwen3_moe() {
    check("qwen3-moe");
}

/// Every layer routed (llama.cpp's qwen3moe has no dense layers), from the folder and
/// from the GGUF llama.cpp's converter writes of it (gguf-py, not sluice's writer).
#[test]
fn qwen3_moe_sparse() {
    check("qwen3-moe-sparse");
}

#[test]
fn qwen3_moe_gguf_from_llama_cpps_converter() {
    check_file("qwen3-moe-sparse", &fixtures().join("qwen3-moe-sparse/qwen3-moe-sparse.gguf"));
}

#[test]
fn qwen3_moe_fused() {
    check("qwen3-moe-fused");
}

#[test]
fn qwen3() {
    check("qwen3");
}

#[test]
fn llama() {
    check("llama");
}

#[test]
fn gemma3() {
    check("gemma3");
}

#[test]
fn gpt_oss() {
    check("gpt-oss");
}

/// The same weights as llama.cpp's converter wrote them (gate and up experts apart,
/// `post_attention_norm`, its YaRN keys): the same logits.
#[test]
fn gpt_oss_gguf_from_llama_cpps_converter() {
    check_file("gpt-oss", &fixtures().join("gpt-oss/gpt-oss.gguf"));
}

/// As published: bf16, experts in MXFP4 byte tensors (blocks and scales), rearranged
/// into GGUF's MXFP4 blocks at open.
#[test]
fn gpt_oss_mxfp4() {
    check("gpt-oss-mxfp4");
}

#[test]
fn gpt_oss_mxfp4_gguf_from_llama_cpps_converter() {
    check_file("gpt-oss-mxfp4", &fixtures().join("gpt-oss-mxfp4/gpt-oss-mxfp4.gguf"));
}

/// Multi-head latent attention with a query bottleneck and YaRN, computed in the
/// absorbed form; dense first layer; sigmoid routing in groups (the limit changes 13
/// of the fixture's choices) with a correction bias and a shared expert.
#[test]
fn deepseek_v3() {
    check("deepseek-v3");
}

/// llama.cpp's conversion: the latent up-projection already split per head
/// (`attn_k_b`, `attn_v_b`), the scale from `yarn_log_multiplier`.
#[test]
fn deepseek_v3_gguf_from_llama_cpps_converter() {
    check_file("deepseek-v3", &fixtures().join("deepseek-v3/deepseek-v3.gguf"));
}

/// Gated DeltaNet layers (GQA over the value heads, a convolution longer than its
/// first tokens) and a gated full-attention layer with partial RoPE, from the
/// multimodal wrapper (its vision tower skipped); routed experts beside the gated
/// shared expert.
#[test]
fn qwen35_moe() {
    check("qwen3.5-moe");
}

/// llama.cpp's conversion: norms stored with their 1 + w, `ssm_a` as -exp(A_log), the
/// value heads tiled over the key heads instead of grouped.
#[test]
fn qwen35_moe_gguf_from_llama_cpps_converter() {
    check_file("qwen3.5-moe", &fixtures().join("qwen3.5-moe/qwen3.5-moe.gguf"));
}

/// 150 tokens, which transformers' prompt path takes through the gated delta rule in
/// chunks of 64 (sluice token by token): the prompt whole, and 100 tokens then 50
/// decoded one at a time, from the folder and from the GGUF.
#[test]
fn qwen35_moe_long_prompt_across_chunks() {
    let dir = fixtures().join("qwen3.5-moe");
    for path in [dir.clone(), dir.join("qwen3.5-moe.gguf")] {
        check_long(&dir, &path);
    }
}

/// The fixture's 150-token reference (`long_tokens`, `long_logits`) against the model at
/// `path`: the prompt whole, and 100 tokens then 50 decoded one at a time.
fn check_long(dir: &Path, path: &Path) {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let tokens: Vec<u32> = meta["long_tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let bytes = std::fs::read(dir.join(meta["long_logits"].as_str().unwrap())).unwrap();
    let want: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(tokens.len(), 150);
    let model = Model::open(path).unwrap();
    let mut s = model.session().unwrap();
    let e = rel_err(&s.forward(&tokens, Logits::All).unwrap(), &want);
    assert!(e <= 1e-3, "{}: 150-token prompt {e:e}", path.display());
    let mut s = model.session().unwrap();
    let mut got = s.forward(&tokens[..100], Logits::All).unwrap();
    for &t in &tokens[100..] {
        got.extend(s.forward(&[t], Logits::All).unwrap());
    }
    let e2 = rel_err(&got, &want);
    assert!(e2 <= 1e-3, "{}: 100 + 50 decoded {e2:e}", path.display());
    eprintln!("{}: 150 tokens {e:.2e}, 100 + 50 decoded {e2:.2e}", path.display());
}

/// Qwen4-Exp: three residual streams mixed by hyper-connections, QSA attention choosing
/// 2 blocks of 2 (from position 6 on a query sees a selection), hashed 2- and 3-gram
/// embeddings on layers 0 and 3, an end of text at position 9 cutting the n-grams.
#[test]
fn qwen4_exp() {
    check("qwen4-exp");
}

/// 150 tokens (end of text at 9 and 100): past a DeltaNet prefill chunk, with most queries
/// choosing among many blocks; whole, and 100 then 50 decoded one at a time.
#[test]
fn qwen4_exp_long_prompt() {
    let dir = fixtures().join("qwen4-exp");
    check_long(&dir, &dir);
}
