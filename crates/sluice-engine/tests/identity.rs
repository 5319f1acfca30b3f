//! Residency is invisible to the arithmetic: for every MoE fixture, every residency,
//! every streamed cache size from the minimum up, with prefetch off and on, in both
//! logits modes, the logits are bitwise those of the fully resident model.

use std::path::Path;

use sluice_engine::{Cpu, LoadOptions, Logits, Model, Prefetch};
use sluice_experts::{CacheBudget, Policy, Residency, StoreConfig};
use sluice_formats::Checkpoint;

fn logits(model: &Model, tokens: &[u32], decode: bool) -> Vec<f32> {
    let mut s = model.session().unwrap();
    if !decode {
        return s.forward(tokens, Logits::All).unwrap();
    }
    tokens.iter().flat_map(|&t| s.forward(&[t], Logits::All).unwrap()).collect()
}

fn tokens(dir: &Path) -> Vec<u32> {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    meta["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny").join(name)
}

fn check(name: &str) {
    check_file(name, &fixture(name));
}

/// The fixture `name`'s tokens through the model at `path`.
fn check_file(name: &str, path: &Path) {
    let dir = fixture(name);
    let ckpt = Checkpoint::open(path).unwrap();
    let toks = tokens(&dir);
    let load = |store: StoreConfig, prefetch: Prefetch| {
        Model::load_with(Cpu::default(), &ckpt, &LoadOptions { store, prefetch, precision: None, kv: None }, None)
            .unwrap()
    };
    let resident = load(StoreConfig { residency: Residency::Resident, ..Default::default() }, Prefetch::Off);
    let want = [logits(&resident, &toks, false), logits(&resident, &toks, true)];
    let n_experts = ckpt.spec.layers.iter().find_map(|l| l.moe.as_ref()).unwrap().n_experts;
    let top_k = ckpt.spec.layers.iter().find_map(|l| l.moe.as_ref()).unwrap().top_k;

    let mut configs = vec![StoreConfig { residency: Residency::Mapped, ..Default::default() }];
    for slots in top_k..=n_experts {
        for policy in [Policy::Lru, Policy::Lfu] {
            configs.push(StoreConfig {
                residency: Residency::Streamed,
                budget: Some(CacheBudget::SlotsPerLayer(slots)),
                policy,
                ..Default::default()
            });
        }
    }
    // A byte budget, and buffered reads.
    configs.push(StoreConfig {
        residency: Residency::Streamed,
        budget: Some(CacheBudget::Bytes(ckpt_min_bytes(&ckpt) * 2)),
        direct_io: false,
        ..Default::default()
    });
    for cfg in configs {
        for prefetch in [Prefetch::Off, Prefetch::Pilot] {
            let m = load(cfg.clone(), prefetch);
            for (decode, want) in [false, true].into_iter().zip(&want) {
                let got = logits(&m, &toks, decode);
                assert!(
                    got == *want,
                    "{name}: {:?} budget {:?} {:?} prefetch {prefetch:?} decode {decode}: logits differ",
                    cfg.residency,
                    cfg.budget,
                    cfg.policy
                );
            }
        }
    }
}

fn ckpt_min_bytes(ckpt: &Checkpoint) -> u64 {
    sluice_experts::ExpertLayout::from_checkpoint(ckpt).unwrap().min_budget_bytes()
}

#[test]
fn gemma4_moe() {
    check("gemma4-moe");
}

#[test]
fn qwen3_moe() {
    check("qwen3-moe");
}

#[test]
fn qwen3_moe_fused() {
    check("qwen3-moe-fused");
}

/// gpt-oss streams from its GGUF form (the Hugging Face folder's experts are rearranged
/// into memory at open, so they are served where they lie).
#[test]
fn gpt_oss_gguf() {
    check_file("gpt-oss", &fixture("gpt-oss/gpt-oss.gguf"));
}

/// The Hugging Face folders (experts rearranged at open, float or MXFP4) stream like any
/// file, through every residency.
#[test]
fn gpt_oss_folder() {
    check("gpt-oss");
}

#[test]
fn gpt_oss_mxfp4_folder() {
    check("gpt-oss-mxfp4");
}

/// A Hugging Face folder computes its GGUF's logits bitwise: the same weights in the
/// same layout once its experts are rearranged.
#[test]
fn gpt_oss_folders_equal_their_ggufs() {
    for (name, file) in [("gpt-oss", "gpt-oss.gguf"), ("gpt-oss-mxfp4", "gpt-oss-mxfp4.gguf")] {
        let dir = fixture(name);
        let toks = tokens(&dir);
        let hf = Model::open(&dir).unwrap();
        let gg = Model::open(&dir.join(file)).unwrap();
        for decode in [false, true] {
            assert!(logits(&hf, &toks, decode) == logits(&gg, &toks, decode), "{name} decode {decode}: logits differ");
        }
    }
}

#[test]
fn deepseek_v3() {
    check("deepseek-v3");
}

#[test]
fn deepseek_v3_gguf() {
    check_file("deepseek-v3", &fixture("deepseek-v3/deepseek-v3.gguf"));
}

#[test]
fn qwen35_moe() {
    check("qwen3.5-moe");
}

#[test]
fn qwen35_moe_gguf() {
    check_file("qwen3.5-moe", &fixture("qwen3.5-moe/qwen3.5-moe.gguf"));
}

#[test]
fn qwen4_exp() {
    check("qwen4-exp");
}
