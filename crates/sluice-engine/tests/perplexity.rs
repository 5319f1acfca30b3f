//! `perplexity` against the perplexity computed from transformers' logits (the fixtures'
//! references, fixtures/tiny), against the NLLs of plain whole-window forwards, and its
//! errors.
//!
//! The tolerance follows from reference.rs: there every logit is within
//! eps = 1e-3 x max|ref| of transformers'. A token's NLL is logsumexp(row) - row[target];
//! moving every logit by at most eps moves each term by at most eps, so each NLL, their
//! mean and ln(PPL) by at most 2 eps.

use std::path::{Path, PathBuf};

use sluice_core::{Error, KvFormat, Precision};
use sluice_engine::{Cpu, LoadOptions, Logits, Model, PerplexityOptions, perplexity};
use sluice_formats::Checkpoint;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny")
}

/// The fixture as reference.rs checks it: 16-bit activations against quantized weights
/// and an f32 KV cache, where its logits are within 1e-3 x max|ref| of transformers'.
fn load(name: &str) -> Model<Cpu> {
    let ckpt = Checkpoint::open(&fixtures().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let opts = LoadOptions { precision: Some(Precision::Accurate), kv: Some(KvFormat::F32), ..Default::default() };
    Model::load_with(Cpu::default(), &ckpt, &opts, None).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// A fixture's reference: its tokens and transformers' logits `[tokens, vocab]`, the
/// 16-token one or (`long`) the 150-token one.
fn reference(name: &str, long: bool) -> (Vec<u32>, Vec<f32>, usize) {
    let dir = fixtures().join(name);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let (tokens_key, logits_key) = if long { ("long_tokens", "long_logits") } else { ("tokens", "logits") };
    let tokens: Vec<u32> = meta[tokens_key].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let bytes = std::fs::read(dir.join(meta[logits_key].as_str().unwrap())).unwrap();
    let logits: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let vocab = meta["vocab_size"].as_u64().unwrap() as usize;
    assert_eq!(logits.len(), tokens.len() * vocab, "{name}: reference shape");
    (tokens, logits, vocab)
}

/// -log softmax(row)[target], computed here on its own.
fn nll(row: &[f32], target: u32) -> f64 {
    let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
    z.ln() - row[target as usize] as f64
}

/// Mean NLL of one window from its logits `[n, vocab]` (or more rows): positions
/// n/2 to n-2, each predicting the next token.
fn window_mean_nll(logits: &[f32], vocab: usize, window: &[u32]) -> (f64, usize) {
    let n = window.len();
    let scored: Vec<f64> = (n / 2..n - 1).map(|t| nll(&logits[t * vocab..(t + 1) * vocab], window[t + 1])).collect();
    (scored.iter().sum::<f64>() / scored.len() as f64, scored.len())
}

/// One window over the whole reference: sluice's ln(PPL), in steps of `batch` positions,
/// against the one from transformers' logits, within 2 x 1e-3 x max|ref| (see the top).
fn check_reference(name: &str, long: bool, batch: usize) {
    let (tokens, logits, vocab) = reference(name, long);
    let model = load(name);
    let n = tokens.len();
    let (want, count) = window_mean_nll(&logits, vocab, &tokens);
    // The window's first token is the text's, so BOS in its place changes nothing here
    // (the fixtures that add one start with it).
    let opts = PerplexityOptions { context: n, chunks: None, bos: None, batch };
    let got = perplexity(&model, &tokens, &opts, &mut |_| {}).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!((got.windows, got.tokens_scored), (1, count), "{name}");
    assert_eq!(count, n - 1 - n / 2);
    let max_ref = logits.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    let bound = 2.0 * 1e-3 * max_ref;
    let diff = (got.ppl.ln() - want).abs();
    eprintln!("{name}: PPL {:.4} (transformers {:.4}), |d ln PPL| {diff:.2e} <= {bound:.2e}", got.ppl, want.exp());
    assert!(diff <= bound, "{name}: ln PPL {} vs transformers' {want}: {diff:e} > {bound:e}", got.ppl.ln());
    assert!((got.mean_nll - want).abs() <= bound);
}

/// Every fixture's 16 tokens as one window (positions 8 to 14 scored), in steps of 5
/// positions: 8 unscored fill 5 + 3, 7 scored 5 + 2.
#[test]
fn matches_transformers_on_every_fixture() {
    for name in [
        "llama",
        "qwen3",
        "qwen3-moe",
        "qwen3-moe-fused",
        "qwen3-moe-sparse",
        "gemma3",
        "gemma4-moe",
        "gemma4-dense",
        "gpt-oss",
        "gpt-oss-mxfp4",
        "deepseek-v3",
        "qwen3.5-moe",
        "qwen4-exp",
    ] {
        check_reference(name, false, 5);
    }
}

/// 150 tokens as one window (75 unscored, positions 75 to 148 scored), in steps of 32
/// and of 1, across the gated delta rule's chunks and QSA's block choices.
#[test]
fn matches_transformers_on_long_references() {
    for name in ["qwen3.5-moe", "qwen4-exp"] {
        check_reference(name, true, 32);
        check_reference(name, true, 1);
    }
}

/// K windows of N score K x (N - 1 - N/2) tokens (N/2 to N-2 of each), and each window
/// runs from an empty state with BOS in place of its first token: the perplexity is the
/// one from whole-window forwards (`Logits::All` over each window, a fresh session
/// each), whatever the step size, none of which divides a window's halves.
#[test]
fn windows_match_whole_window_forwards() {
    let (text, _, _) = reference("qwen3.5-moe", true);
    let model = load("qwen3-moe");
    let vocab = model.spec.vocab_size;
    let bos = 2;
    for (n, chunks, batch) in [(21, None, 4), (21, Some(3), 7), (20, None, 512), (3, Some(5), 1)] {
        let windows = (text.len() / n).min(chunks.unwrap_or(usize::MAX));
        let mut sum = 0.0;
        for w in text.chunks_exact(n).take(windows) {
            let mut w = w.to_vec();
            w[0] = bos;
            let logits = model.session().unwrap().forward(&w, Logits::All).unwrap();
            let (mean, count) = window_mean_nll(&logits, vocab, &w);
            sum += mean * count as f64;
        }
        let scored = windows * (n - 1 - n / 2);
        let want = sum / scored as f64;

        let opts = PerplexityOptions { context: n, chunks, bos: Some(bos), batch };
        let mut seen = Vec::new();
        let got = perplexity(&model, &text, &opts, &mut |p| seen.push((p.done, p.windows))).unwrap();
        assert_eq!((got.windows, got.tokens_scored), (windows, scored), "n {n} chunks {chunks:?}");
        assert_eq!(seen, (1..=windows).map(|d| (d, windows)).collect::<Vec<_>>());
        assert_eq!(got.tokens_evaluated, windows * (n - 1));
        // The same arithmetic on the same rows, fed in other steps: only rounding differs.
        let diff = (got.mean_nll - want).abs();
        eprintln!("n {n} chunks {chunks:?} batch {batch}: |d mean NLL| {diff:.2e}");
        assert!(diff <= 1e-5, "n {n} chunks {chunks:?} batch {batch}: mean NLL {} vs {want}: {diff:e}", got.mean_nll);
        assert!(got.ppl_stderr.is_some_and(|e| e > 0.0 && e < got.ppl));
    }
    // 150 tokens: 7 windows of 21 (3 tokens left over), 7 x 10 scored (positions 10 to 19).
    let opts = PerplexityOptions { context: 21, ..Default::default() };
    assert_eq!((opts.windows(text.len()), opts.scored_per_window()), (7, 10));
}

/// The standard error is llama-perplexity's: sqrt(var(NLL) / (count - 1)) x PPL.
#[test]
fn standard_error_as_llama_perplexity() {
    let (text, _, _) = reference("qwen3.5-moe", true);
    let model = load("llama");
    let vocab = model.spec.vocab_size;
    let n = 30;
    let mut nlls = Vec::new();
    for w in text.chunks_exact(n) {
        let logits = model.session().unwrap().forward(w, Logits::All).unwrap();
        nlls.extend((n / 2..n - 1).map(|t| nll(&logits[t * vocab..(t + 1) * vocab], w[t + 1])));
    }
    let count = nlls.len() as f64;
    let mean = nlls.iter().sum::<f64>() / count;
    let var = nlls.iter().map(|v| v * v).sum::<f64>() / count - mean * mean;
    let want = (var / (count - 1.0)).sqrt() * mean.exp();
    let opts = PerplexityOptions { context: n, batch: 9, ..Default::default() };
    let got = perplexity(&model, &text, &opts, &mut |_| {}).unwrap();
    assert_eq!(got.tokens_scored, nlls.len());
    let e = got.ppl_stderr.unwrap();
    assert!((e - want).abs() <= 1e-6 * want, "stderr {e} vs {want}");
}

fn usage(r: sluice_core::Result<sluice_engine::Perplexity>) -> String {
    match r {
        Err(Error::Usage(m)) => m,
        Err(e) => panic!("expected a usage error, got {e}"),
        Ok(p) => panic!("expected an error, got PPL {}", p.ppl),
    }
}

#[test]
fn errors_name_the_value() {
    let model = load("llama");
    assert_eq!(model.max_context, 256);
    let text: Vec<u32> = (0..300).map(|i| 12 + (i * 7) % 400).collect();
    let run = |context, chunks, tokens: &[u32]| {
        let opts = PerplexityOptions { context, chunks, ..Default::default() };
        perplexity(&model, tokens, &opts, &mut |_| {})
    };
    let m = usage(run(2, None, &text));
    assert!(m.contains("--context 2") && m.contains("at least 3"), "{m}");
    let m = usage(run(0, None, &text));
    assert!(m.contains("--context 0"), "{m}");
    let m = usage(run(257, None, &text));
    assert!(m.contains("--context 257") && m.contains("256"), "{m}");
    let m = usage(run(16, Some(0), &text));
    assert!(m.contains("--chunks 0"), "{m}");
    let m = usage(run(64, None, &text[..40]));
    assert!(m.contains("40 tokens") && m.contains("--context 64 needs at least 64"), "{m}");
    // An id outside the vocabulary, even one only predicted (a window's last token).
    let mut bad = text[..16].to_vec();
    bad[15] = 9999;
    assert!(matches!(run(16, None, &bad), Err(Error::TokenOutOfRange { id: 9999, .. })));
    // Exactly one window is enough; the tokens after the last whole window are not used.
    let one = run(16, None, &text[..16]).unwrap();
    let same = run(16, None, &text[..31]).unwrap();
    assert_eq!((one.windows, same.windows, one.ppl), (1, 1, same.ppl));
}
