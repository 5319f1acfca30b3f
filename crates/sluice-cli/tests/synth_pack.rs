//! `sluice synth` and `sluice pack` end to end: a packed folder computes bitwise the
//! logits of its source in every residency, with one read per expert; a synthetic model
//! runs, streams identically, and its skew concentrates the routing; bad input ends in
//! one clear error line.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::assert_one_error;

use sluice_experts::{CacheBudget, ExpertLayout, ExpertStore, Residency, StoreConfig};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny").join(name)
}

fn sluice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice")).args(args).output().expect("sluice runs")
}

fn ok(args: &[&str]) -> Output {
    let o = sluice(args);
    assert!(o.status.success(), "sluice {}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr));
    o
}

/// A fresh scratch folder.
fn scratch(tag: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("synth-pack-{tag}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn synth(geometry: &str, extra: &[&str], out: &Path) {
    let mut args = vec!["synth", "--geometry", geometry, "--out", s(out)];
    args.extend_from_slice(extra);
    ok(&args);
}

/// The logits of `tokens` as little-endian f32 bytes.
fn logits(model: &Path, tokens: &str, mode: &str, residency: &[&str], out: &Path) -> Vec<u8> {
    let mut args = vec!["logits", "--model", s(model), "--tokens", tokens, "--out", s(out), "--mode", mode];
    args.extend_from_slice(residency);
    ok(&args);
    std::fs::read(out).unwrap()
}

fn min_slots(model: &Path) -> String {
    let ckpt = Checkpoint::open(model).unwrap();
    ExpertLayout::from_checkpoint(&ckpt).unwrap().min_slots_per_layer().to_string()
}

const TOKENS: &str = "1,5,9,100,200,33,7,300,12,12,12,45,6,78,90,250,3,400,401,2";

#[test]
fn packed_folders_compute_the_sources_logits_bitwise() {
    let dir = scratch("identity");
    let tiny = dir.join("tiny-moe.gguf");
    synth("tiny-moe", &["--skew", "0.9"], &tiny);
    let gemma = dir.join("tiny-gemma4.gguf");
    synth("tiny-gemma4", &["--seed", "3"], &gemma);
    let sources = [fixture("qwen3-moe"), fixture("qwen3-moe-fused"), fixture("gemma4-moe"), tiny, gemma];
    for (i, src) in sources.iter().enumerate() {
        let packed = dir.join(format!("packed-{i}"));
        let o = ok(&["pack", "--model", s(src), "--out", s(&packed)]);
        assert!(String::from_utf8_lossy(&o.stdout).contains("experts.bin"));
        let min = min_slots(src);
        assert_eq!(min, min_slots(&packed));
        let vocab = Checkpoint::open(src).unwrap().spec.vocab_size;
        let tokens: Vec<String> =
            TOKENS.split(',').map(|t| (t.parse::<usize>().unwrap() % vocab).to_string()).collect();
        let tokens = tokens.join(",");
        for mode in ["prefill", "decode"] {
            let want = logits(src, &tokens, mode, &["--residency", "mapped"], &dir.join("want.f32"));
            assert!(!want.is_empty());
            let streamed = ["--residency", "streamed", "--expert-cache", min.as_str()];
            for residency in [&["--residency", "mapped"][..], &streamed[..], &["--residency", "resident"][..]] {
                let got = logits(&packed, &tokens, mode, residency, &dir.join("got.f32"));
                assert!(got == want, "{}: {mode} {residency:?} differs from the source", src.display());
            }
        }
    }
}

#[test]
fn a_packed_expert_is_one_read() {
    let dir = scratch("reads");
    // Separate gate, up and down tensors (Qwen's GGUF form): three reads an expert; fused
    // gate_up (Gemma 4's): two; packed: one.
    for (geometry, source_reads) in [("tiny-moe", 3), ("tiny-gemma4", 2)] {
        let src = dir.join(format!("{geometry}.gguf"));
        synth(geometry, &[], &src);
        let packed = dir.join(format!("{geometry}-packed"));
        ok(&["pack", "--model", s(&src), "--out", s(&packed)]);
        for (model, reads) in [(&src, source_reads), (&packed, 1)] {
            let ckpt = Checkpoint::open(model).unwrap();
            let cfg = StoreConfig {
                residency: Residency::Streamed,
                budget: Some(CacheBudget::SlotsPerLayer(16)),
                chunk_bytes: 1 << 30,
                direct_io: false,
                ..StoreConfig::default()
            };
            let store = ExpertStore::open(&ckpt, &cfg, None).unwrap();
            let layers: Vec<usize> = store.layout().moe_layers().collect();
            let mut experts = 0;
            for &l in &layers {
                let all: Vec<usize> = (0..store.n_experts(l)).collect();
                store.fetch(l, &all).unwrap();
                experts += all.len() as u64;
            }
            let st = store.stats();
            assert_eq!(st.misses, experts);
            assert_eq!(st.read_calls, reads * experts, "{}", model.display());
        }
    }
}

/// In both logits modes, `model`'s logits (mapped) are finite and of unit scale, and
/// the same bits streamed through a cache of four experts a layer, and from `packed`
/// (its `sluice pack`) if given.
fn streams_like_mapped(model: &Path, dir: &Path, packed: Option<&Path>) {
    let vocab = Checkpoint::open(model).unwrap().spec.vocab_size;
    for mode in ["prefill", "decode"] {
        let mapped = logits(model, TOKENS, mode, &["--residency", "mapped"], &dir.join("a.f32"));
        let values: Vec<f32> = mapped.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(values.len(), 20 * vocab);
        assert!(values.iter().all(|v| v.is_finite()), "{mode}: finite logits");
        let mean = values.iter().sum::<f32>() / values.len() as f32;
        let sd = (values.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / values.len() as f32).sqrt();
        assert!((0.3..3.0).contains(&sd), "{mode}: logits of unit scale, got sd {sd}");
        let streamed = ["--residency", "streamed", "--expert-cache", "4"];
        assert!(logits(model, TOKENS, mode, &streamed, &dir.join("b.f32")) == mapped, "{mode}: streamed differs");
        if let Some(p) = packed {
            assert!(
                logits(p, TOKENS, mode, &streamed, &dir.join("c.f32")) == mapped,
                "{mode}: the packed form differs"
            );
        }
    }
}

#[test]
fn synth_tiny_moe_runs_and_streams_identically() {
    let dir = scratch("tiny");
    let model = dir.join("tiny.gguf");
    let o = ok(&["synth", "--geometry", "tiny-moe", "--out", s(&model)]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("experts") && text.contains("resident") && text.contains("wrote"), "{text}");
    let o = ok(&["run", "--model", s(&model), "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0"]);
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("Hello"));
    ok(&["run", "--model", s(&model), "--chat", "--prompt", "Hi", "--max-tokens", "4", "--seed", "1"]);
    streams_like_mapped(&model, &dir, None);
    // Other weight types run too.
    for quant in ["q8_0", "q6_k", "q5_k", "q4_0", "mxfp4", "bf16"] {
        let m = dir.join(format!("{quant}.gguf"));
        ok(&["synth", "--geometry", "tiny-moe", "--quant", quant, "--out", s(&m)]);
        let l = logits(&m, TOKENS, "prefill", &[], &dir.join("q.f32"));
        assert!(l.chunks_exact(4).all(|c| f32::from_le_bytes(c.try_into().unwrap()).is_finite()), "{quant}");
    }
    // The packed form written directly runs and tokenizes from its inner model.gguf.
    let packed = dir.join("packed");
    ok(&["synth", "--geometry", "tiny-moe", "--packed", s(&packed)]);
    ok(&["run", "--model", s(&packed), "--prompt", "Hello", "--max-tokens", "4", "--residency", "streamed"]);
    let t = ok(&["tokenize", "--model", s(&packed), "--text", "Hi"]);
    assert_eq!(String::from_utf8_lossy(&t.stdout).trim(), "[72,105]");
    let a = logits(&model, TOKENS, "prefill", &[], &dir.join("a.f32"));
    assert!(logits(&packed, TOKENS, "prefill", &[], &dir.join("b.f32")) == a, "synth --packed is the same model");
}

/// gpt-oss's geometry: MXFP4 experts whatever --quant says, biases, sinks, YaRN; logits
/// of unit scale, streamed and packed bitwise as mapped.
#[test]
fn synth_gpt_oss_runs_streamed_and_packed_identically() {
    let dir = scratch("gpt-oss");
    let model = dir.join("gpt-oss.gguf");
    ok(&["synth", "--geometry", "tiny-gpt-oss", "--quant", "q8_0", "--skew", "0.9", "--out", s(&model)]);
    let ckpt = Checkpoint::open(&model).unwrap();
    assert_eq!(ckpt.spec.family, sluice_core::Family::GptOss);
    let g = ckpt.gguf().unwrap();
    assert_eq!(g.tensor("blk.0.ffn_gate_exps.weight").unwrap().dtype, sluice_core::DType::MXFP4);
    assert_eq!(g.tensor("blk.0.attn_q.weight").unwrap().dtype, sluice_core::DType::Q8_0);
    let a = ckpt.spec.layers.iter().map(|l| l.attention.window).collect::<Vec<_>>();
    assert_eq!(a, vec![Some(128), None, Some(128), None]);
    let packed = dir.join("packed");
    ok(&["pack", "--model", s(&model), "--out", s(&packed)]);
    streams_like_mapped(&model, &dir, Some(&packed));
}

/// DeepSeek-V3's geometry: the latent attention, a dense first layer, grouped sigmoid
/// routing with a correction bias and shared experts; logits of unit scale, streamed
/// bitwise as mapped.
#[test]
fn synth_deepseek_runs_and_streams_identically() {
    let dir = scratch("deepseek");
    let model = dir.join("deepseek.gguf");
    ok(&["synth", "--geometry", "tiny-deepseek", "--quant", "q8_0", "--skew", "0.9", "--out", s(&model)]);
    let ckpt = Checkpoint::open(&model).unwrap();
    assert_eq!(ckpt.spec.family, sluice_core::Family::DeepSeek);
    let moe: Vec<bool> = ckpt.spec.layers.iter().map(|l| l.moe.is_some()).collect();
    assert_eq!(moe, vec![false, true, true, true]);
    streams_like_mapped(&model, &dir, None);
}

/// Qwen3.5-MoE's geometry: three Gated DeltaNet layers and a gated full-attention one,
/// experts beside a gated shared expert; streamed bitwise as mapped.
#[test]
fn synth_qwen35_runs_and_streams_identically() {
    let dir = scratch("qwen3.5");
    let model = dir.join("qwen3.5.gguf");
    ok(&["synth", "--geometry", "tiny-qwen3.5", "--quant", "q8_0", "--skew", "0.9", "--out", s(&model)]);
    let ckpt = Checkpoint::open(&model).unwrap();
    assert_eq!(ckpt.spec.family, sluice_core::Family::Qwen35);
    let linear: Vec<bool> = ckpt.spec.layers.iter().map(|l| l.linear.is_some()).collect();
    assert_eq!(linear, vec![true, true, true, false]);
    streams_like_mapped(&model, &dir, None);
}

/// Per layer, the share of decode-step routing that went to the `n` experts the router
/// bias ranks most popular.
fn popular_share(model: &Path, bias_of: &Path, n: usize, dir: &Path) -> Vec<f64> {
    let hist = dir.join("routing.json");
    let tokens: Vec<String> = (0..96u64).map(|i| ((i * 2654435761) % 509).to_string()).collect();
    logits(model, &tokens.join(","), "decode", &["--record-routing", s(&hist)], &dir.join("l.f32"));
    let h: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&hist).unwrap()).unwrap();
    let ckpt = Checkpoint::open(bias_of).unwrap();
    (0..ckpt.spec.n_layers())
        .map(|l| {
            let bias = ckpt.get(TensorId::layer(l, TensorKind::RouterBias)).unwrap().to_f32_vec().unwrap();
            let mut order: Vec<usize> = (0..bias.len()).collect();
            order.sort_by(|&a, &b| bias[b].total_cmp(&bias[a]));
            let counts: Vec<u64> = h["layers"][l].as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).collect();
            let total: u64 = counts.iter().sum();
            order[..n].iter().map(|&e| counts[e]).sum::<u64>() as f64 / total as f64
        })
        .collect()
}

#[test]
fn skew_sends_most_traffic_to_the_popular_experts() {
    let dir = scratch("skew");
    let (flat, skewed) = (dir.join("flat.gguf"), dir.join("skewed.gguf"));
    synth("tiny-moe", &["--seed", "4"], &flat);
    synth("tiny-moe", &["--seed", "4", "--skew", "1.5"], &skewed);
    // 4 of 16 experts: a quarter of the traffic under uniform routing.
    let uniform = popular_share(&flat, &skewed, 4, &dir);
    let popular = popular_share(&skewed, &skewed, 4, &dir);
    for (l, (u, p)) in uniform.iter().zip(&popular).enumerate() {
        assert!(*u < 0.4, "layer {l}: without skew the 4 experts take {u}");
        assert!(*p > 0.6 && p - u > 0.25, "layer {l}: with skew 1.5 the 4 most popular take {p} (flat {u})");
    }
}

#[test]
fn bad_input_is_one_clear_error() {
    let dir = scratch("bad");
    // A dense model has no experts to pack.
    let o = sluice(&["pack", "--model", s(&fixture("qwen3")), "--out", s(&dir.join("dense"))]);
    assert_one_error(&o, "no routed experts");
    assert!(!dir.join("dense").exists());

    let src = dir.join("tiny.gguf");
    synth("tiny-moe", &[], &src);
    let packed = dir.join("packed");
    ok(&["pack", "--model", s(&src), "--out", s(&packed)]);
    // Into a folder that holds files.
    assert_one_error(&sluice(&["pack", "--model", s(&src), "--out", s(&packed)]), "not empty");
    assert_one_error(&sluice(&["synth", "--geometry", "tiny-moe", "--packed", s(&packed)]), "not empty");

    let run =
        |model: &Path| sluice(&["logits", "--model", s(model), "--tokens", "1,2", "--out", s(&dir.join("x.f32"))]);
    // A truncated experts.bin.
    let bin = packed.join("experts.bin");
    let len = std::fs::metadata(&bin).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&bin).unwrap().set_len(len - 100).unwrap();
    assert_one_error(&run(&packed), "experts.bin");
    std::fs::OpenOptions::new().write(true).open(&bin).unwrap().set_len(len).unwrap();
    ok(&["logits", "--model", s(&packed), "--tokens", "1,2", "--out", s(&dir.join("x.f32"))]);
    // A corrupt manifest.
    let manifest = packed.join("sluice-pack.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, &text[..text.len() / 3]).unwrap();
    assert_one_error(&run(&packed), "sluice-pack.json");
    // A manifest that disagrees with the model.
    std::fs::write(&manifest, text.replacen("\"shape\":[128,256]", "\"shape\":[64,256]", 1)).unwrap();
    assert_one_error(&run(&packed), "sluice-pack.json");

    // Bad synth flags.
    let out = dir.join("x.gguf");
    assert_one_error(&sluice(&["synth", "--geometry", "qwen9", "--out", s(&out)]), "qwen3-30b-a3b");
    assert_one_error(&sluice(&["synth", "--geometry", "tiny-moe", "--quant", "q3_x", "--out", s(&out)]), "q3_x");
    assert_one_error(&sluice(&["synth", "--geometry", "tiny-moe", "--layers", "0", "--out", s(&out)]), "--layers");
    assert_one_error(&sluice(&["synth", "--geometry", "tiny-moe", "--skew=-1", "--out", s(&out)]), "--skew");
    assert!(!out.exists());
    assert_one_error(&sluice(&["synth", "--geometry", "tiny-moe", "--out", s(&dir)]), "not a regular file");
}

/// `synth --help` names every geometry the library knows (the list is written by hand).
#[test]
fn synth_help_lists_every_geometry() {
    let help = String::from_utf8(ok(&["synth", "--help"]).stdout).unwrap();
    for g in sluice_formats::synth::Geometry::all() {
        assert!(help.contains(g.name), "`sluice synth --help` does not name {}:\n{help}", g.name);
    }
}

/// What `sluice synth` and `sluice pack` write is read by another reader, gguf-py (the
/// copy in llama.cpp's converter, which scripts/fetch_vocabs.sh fetches), with the same
/// metadata keys and the same tensors (name, type, shape, offset) as sluice's reader.
#[test]
fn gguf_py_reads_what_sluice_writes() {
    let root = sluice_core::testing::repo_root();
    let Some(python) =
        sluice_core::testing::require(root.join(".cache/vocab-venv/bin/python"), "scripts/fetch_vocabs.sh")
    else {
        return;
    };
    let Some(gguf_py) =
        sluice_core::testing::require(root.join(".cache/llama.cpp-convert/gguf-py"), "scripts/fetch_vocabs.sh")
    else {
        return;
    };
    let dir = scratch("gguf-py");
    let mut files = Vec::new();
    for (geometry, quant) in
        [("tiny-moe", "q4_k"), ("tiny-gpt-oss", "q8_0"), ("tiny-deepseek", "q6_k"), ("tiny-qwen3.5", "q5_0")]
    {
        let out = dir.join(format!("{geometry}.gguf"));
        ok(&["synth", "--geometry", geometry, "--quant", quant, "--layers", "2", "--out", s(&out)]);
        files.push(out);
    }
    let packed = dir.join("packed");
    ok(&["synth", "--geometry", "tiny-gemma4", "--packed", s(&packed)]);
    files.push(packed.join("model.gguf"));

    const READ: &str = r#"
import json, sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
keys = sorted(k for k in r.fields if not k.startswith("GGUF."))
tensors = [[t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset)] for t in r.tensors]
print(json.dumps({"keys": keys, "tensors": tensors}))
"#;
    for file in &files {
        let o = Command::new(&python)
            .env("PYTHONPATH", &gguf_py)
            .args(["-c", READ, s(file)])
            .output()
            .expect("python runs");
        assert!(o.status.success(), "gguf-py cannot read {}: {}", file.display(), String::from_utf8_lossy(&o.stderr));
        let theirs: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let g = sluice_formats::GgufFile::open(file).unwrap();
        let mut keys: Vec<&str> = g.keys().collect();
        keys.sort_unstable();
        let ours_tensors: Vec<serde_json::Value> = g
            .tensors()
            .iter()
            .map(|t| {
                // gguf-py gives shapes innermost first, as the file stores them.
                let shape: Vec<usize> = t.shape.iter().rev().copied().collect();
                serde_json::json!([t.name, sluice_formats::gguf::ggml_type_id(t.dtype), shape, t.offset()])
            })
            .collect();
        assert_eq!(theirs["keys"], serde_json::json!(keys), "{}: metadata keys differ", file.display());
        assert_eq!(theirs["tensors"], serde_json::json!(ours_tensors), "{}: tensors differ", file.display());
    }
}
