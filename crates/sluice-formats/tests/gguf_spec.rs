//! A GGUF written the way llama.cpp's converter writes it (tensor names from gguf-py's
//! TENSOR_NAMES, metadata keys and values from convert_hf_to_gguf.py's model classes)
//! gives the same `ModelSpec` as the Hugging Face folder it came from, and the same
//! tensors under the same canonical ids.

use std::path::{Path, PathBuf};

use serde_json::Value;
use sluice_core::{DType, Family, ModelSpec, RopeStyle};
use sluice_formats::names::gguf_name;
use sluice_formats::{Checkpoint, GgufFile, GgufValue, GgufWriter, TensorId, TensorKind};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny").join(name)
}

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gguf-spec");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

const MODEL_KINDS: &[TensorKind] = &[
    TensorKind::TokenEmbd,
    TensorKind::OutputNorm,
    TensorKind::Output,
    TensorKind::PleTokenEmbd,
    TensorKind::PleModelProj,
    TensorKind::PleProjNorm,
];

const LAYER_KINDS: &[TensorKind] = &[
    TensorKind::AttnNorm,
    TensorKind::AttnQ,
    TensorKind::AttnK,
    TensorKind::AttnV,
    TensorKind::AttnOut,
    TensorKind::AttnQBias,
    TensorKind::AttnKBias,
    TensorKind::AttnVBias,
    TensorKind::AttnQNorm,
    TensorKind::AttnKNorm,
    TensorKind::AttnPostNorm,
    TensorKind::FfnNorm,
    TensorKind::FfnGate,
    TensorKind::FfnUp,
    TensorKind::FfnDown,
    TensorKind::FfnPostNorm,
    TensorKind::FfnPostNorm1,
    TensorKind::FfnPreNorm2,
    TensorKind::FfnPostNorm2,
    TensorKind::Router,
    TensorKind::RouterScale,
    TensorKind::RouterExpertScale,
    TensorKind::ExpsGateUp,
    TensorKind::ExpsGate,
    TensorKind::ExpsUp,
    TensorKind::ExpsDown,
    TensorKind::LayerScalar,
    TensorKind::PleGate,
    TensorKind::PleProj,
    TensorKind::PlePostNorm,
];

/// The layer kinds of a family. Llama-shaped families have no post-attention norm in
/// GGUF's sense: Hugging Face's `post_attention_layernorm` is their FfnNorm.
fn layer_kinds(hf: &Checkpoint) -> Vec<TensorKind> {
    let llama = hf.family() == Family::Llama;
    LAYER_KINDS.iter().copied().filter(|&k| !(llama && k == TensorKind::AttnPostNorm)).collect()
}

/// Every tensor of `hf` under its GGUF name. With `split_gate_up`, fused 3-D gate_up
/// experts become separate gate and up tensors (the Qwen MoE converters do that; the
/// Gemma 4 converter keeps them fused).
fn add_tensors<'a>(w: &mut GgufWriter<'a>, hf: &'a Checkpoint, split_gate_up: bool) -> usize {
    let mut n = 0;
    for &k in MODEL_KINDS {
        if let Some(t) = hf.get(TensorId::model(k)) {
            w.add_tensor(&gguf_name(TensorId::model(k)), t.dtype, &t.shape, t.bytes());
            n += 1;
        }
    }
    for l in 0..hf.spec.n_layers() {
        for k in layer_kinds(hf) {
            let id = TensorId::layer(l, k);
            let Some(t) = hf.get(id) else { continue };
            n += 1;
            if k == TensorKind::ExpsGateUp && split_gate_up {
                let (e, i2, h) = (t.shape[0], t.shape[1], t.shape[2]);
                let i = i2 / 2;
                let mut gate = Vec::new();
                let mut up = Vec::new();
                for x in 0..e {
                    let m = t.index0(x);
                    gate.extend_from_slice(m.rows(0, i).bytes());
                    up.extend_from_slice(m.rows(i, i).bytes());
                }
                w.add_tensor(&gguf_name(TensorId::layer(l, TensorKind::ExpsGate)), t.dtype, &[e, i, h], gate);
                w.add_tensor(&gguf_name(TensorId::layer(l, TensorKind::ExpsUp)), t.dtype, &[e, i, h], up);
                continue;
            }
            // The llama converter permutes Q and K so that each head's rotary pairs are
            // adjacent rows (interleaved RoPE) instead of half a head apart.
            let heads = match k {
                TensorKind::AttnQ => Some(hf.spec.layers[l].attention.n_heads),
                TensorKind::AttnK => Some(hf.spec.layers[l].attention.n_kv_heads),
                _ => None,
            };
            if let (Some(heads), "llama") = (heads, hf.spec.arch.as_str()) {
                w.add_tensor(&gguf_name(id), t.dtype, &t.shape, interleave_rows(t.bytes(), t.shape[0], heads));
                continue;
            }
            w.add_tensor(&gguf_name(id), t.dtype, &t.shape, t.bytes());
        }
    }
    assert_eq!(n, hf.tensors().len(), "every tensor of the fixture has a canonical id");
    n
}

/// Row `h*hd + 2i + j` of the result is row `h*hd + j*hd/2 + i` of `rows`: what the
/// converter's `permute` does to llama's Q and K projections.
fn interleave_rows(bytes: &[u8], n_rows: usize, heads: usize) -> Vec<u8> {
    let rb = bytes.len() / n_rows;
    let hd = n_rows / heads;
    let mut out = Vec::with_capacity(bytes.len());
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let r = h * hd + j * hd / 2 + i;
                out.extend_from_slice(&bytes[r * rb..(r + 1) * rb]);
            }
        }
    }
    out
}

fn config(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("{k}"))
}

fn f(v: &Value, k: &str) -> f32 {
    v[k].as_f64().unwrap_or_else(|| panic!("{k}")) as f32
}

/// Metadata as convert_hf_to_gguf.py's Gemma4Model (over Gemma3Model and TextModel)
/// writes it for this text config.
fn gemma4_metadata(w: &mut GgufWriter, c: &Value) {
    let a = "gemma4";
    let n = u(c, "num_hidden_layers") as usize;
    let types: Vec<bool> = c["layer_types"].as_array().unwrap().iter().map(|t| t == "sliding_attention").collect();
    let swa_hd = u(c, "head_dim") as u32;
    // The older form names the full-attention head dim; per_layer_config names it per layer.
    let full_hd = match c.get("global_head_dim").and_then(|v| v.as_u64()) {
        Some(h) => h as u32,
        None => {
            let plc = c["per_layer_config"].as_object().unwrap();
            let full = (0..n).find(|&i| !types[i]).unwrap();
            plc[&full.to_string()]["head_dim"].as_u64().unwrap() as u32
        }
    };
    let kv = u(c, "num_key_value_heads") as u32;
    let shared = u(c, "num_kv_shared_layers") as usize;
    w.add_str("general.architecture", a)
        .add_u32(&format!("{a}.block_count"), n as u32)
        .add_u32(&format!("{a}.context_length"), u(c, "max_position_embeddings") as u32)
        .add_u32(&format!("{a}.embedding_length"), u(c, "hidden_size") as u32)
        .add_u32(&format!("{a}.feed_forward_length"), u(c, "intermediate_size") as u32)
        .add_u32(&format!("{a}.attention.head_count"), u(c, "num_attention_heads") as u32)
        .add_u32(&format!("{a}.attention.head_count_kv"), kv)
        .add_f32(&format!("{a}.attention.layer_norm_rms_epsilon"), f(c, "rms_norm_eps"))
        .add_f32(&format!("{a}.rope.freq_base"), f(&c["rope_parameters"]["full_attention"], "rope_theta"))
        .add_f32(&format!("{a}.rope.freq_base_swa"), f(&c["rope_parameters"]["sliding_attention"], "rope_theta"))
        .add_f32(&format!("{a}.final_logit_softcapping"), f(c, "final_logit_softcapping"))
        .add_u32(&format!("{a}.attention.sliding_window"), u(c, "sliding_window") as u32)
        .add_u32(&format!("{a}.attention.shared_kv_layers"), shared as u32)
        .add_u32(
            &format!("{a}.embedding_length_per_layer_input"),
            c["hidden_size_per_layer_input"].as_u64().unwrap_or(0) as u32,
        )
        .add_bool_array(&format!("{a}.attention.sliding_window_pattern"), &types)
        .add_u32(&format!("{a}.attention.key_length"), full_hd)
        .add_u32(&format!("{a}.attention.value_length"), full_hd)
        .add_u32(&format!("{a}.attention.key_length_swa"), swa_hd)
        .add_u32(&format!("{a}.attention.value_length_swa"), swa_hd)
        .add_u32(&format!("{a}.rope.dimension_count"), full_hd)
        .add_u32(&format!("{a}.rope.dimension_count_swa"), swa_hd)
        .add_u32("general.file_type", 0)
        .add_u32("tokenizer.ggml.bos_token_id", u(c, "bos_token_id") as u32)
        .add_u32("tokenizer.ggml.eos_token_id", c["eos_token_id"][0].as_u64().unwrap() as u32);
    if let Some(e) = c["num_experts"].as_u64() {
        w.add_u32(&format!("{a}.expert_count"), e as u32)
            .add_u32(&format!("{a}.expert_used_count"), u(c, "top_k_experts") as u32)
            .add_u32(&format!("{a}.expert_feed_forward_length"), u(c, "moe_intermediate_size") as u32);
    }
    if c["use_double_wide_mlp"].as_bool() == Some(true) {
        let ff = u(c, "intermediate_size") as u32;
        let arr: Vec<u32> = (0..n).map(|i| if i < n - shared { ff } else { 2 * ff }).collect();
        w.add_u32_array(&format!("{a}.feed_forward_length"), &arr);
    }
    if let Some(g) = c.get("num_global_key_value_heads").and_then(|v| v.as_u64()) {
        let arr: Vec<u32> = types.iter().map(|&s| if s { kv } else { g as u32 }).collect();
        w.add_u32_array(&format!("{a}.attention.head_count_kv"), &arr);
    }
    // Proportional RoPE on full layers: divisor 1 for the rotated pairs, 1e30 for the rest.
    let partial = f(&c["rope_parameters"]["full_attention"], "partial_rotary_factor");
    let n_rot = (full_hd as f32 * partial / 2.0) as usize;
    let factors: Vec<f32> = (0..full_hd as usize / 2).map(|i| if i < n_rot { 1.0 } else { 1e30 }).collect();
    w.add_f32_tensor("rope_freqs.weight", &[factors.len()], &factors);
}

/// Metadata as Qwen3MoeModel (over Qwen2MoeModel and TextModel) writes it.
fn qwen3moe_metadata(w: &mut GgufWriter, c: &Value) {
    let a = "qwen3moe";
    w.add_str("general.architecture", a)
        .add_u32(&format!("{a}.block_count"), u(c, "num_hidden_layers") as u32)
        .add_u32(&format!("{a}.context_length"), u(c, "max_position_embeddings") as u32)
        .add_u32(&format!("{a}.embedding_length"), u(c, "hidden_size") as u32)
        .add_u32(&format!("{a}.feed_forward_length"), u(c, "intermediate_size") as u32)
        .add_u32(&format!("{a}.attention.head_count"), u(c, "num_attention_heads") as u32)
        .add_u32(&format!("{a}.attention.head_count_kv"), u(c, "num_key_value_heads") as u32)
        .add_f32(&format!("{a}.rope.freq_base"), f(&c["rope_parameters"], "rope_theta"))
        .add_f32(&format!("{a}.attention.layer_norm_rms_epsilon"), f(c, "rms_norm_eps"))
        .add_u32(&format!("{a}.expert_count"), u(c, "num_local_experts") as u32)
        .add_u32(&format!("{a}.expert_used_count"), u(c, "num_experts_per_tok") as u32)
        .add_u32(&format!("{a}.attention.key_length"), u(c, "head_dim") as u32)
        .add_u32(&format!("{a}.attention.value_length"), u(c, "head_dim") as u32)
        .add_u32("general.file_type", 1)
        .add_u32(&format!("{a}.expert_feed_forward_length"), u(c, "moe_intermediate_size") as u32)
        .add_u32("tokenizer.ggml.bos_token_id", u(c, "bos_token_id") as u32)
        .add_u32("tokenizer.ggml.eos_token_id", u(c, "eos_token_id") as u32);
    // The converter does not record norm_topk_prob, and llama.cpp always renormalises
    // qwen3moe's top-k weights; a file for a model that does not says so with
    // expert_weights_norm (a key llama.cpp reads for other MoE architectures).
    if c["norm_topk_prob"].as_bool() == Some(false) {
        w.add_bool(&format!("{a}.expert_weights_norm"), false);
    }
}

/// The parts of a spec both forms must agree on: all but the architecture's spelling
/// and the end-of-sequence ids (GGUF holds one, generation_config.json a list).
fn comparable(s: &ModelSpec) -> ModelSpec {
    ModelSpec { arch: String::new(), eos_token_ids: vec![], ..s.clone() }
}

fn assert_same_tensors(hf: &Checkpoint, gg: &Checkpoint) {
    let ids = MODEL_KINDS
        .iter()
        .map(|&k| TensorId::model(k))
        .chain((0..hf.spec.n_layers()).flat_map(|l| layer_kinds(hf).into_iter().map(move |k| TensorId::layer(l, k))));
    for id in ids {
        let fused = |c: &Checkpoint| id.layer.is_some_and(|l| c.contains(TensorId::layer(l, TensorKind::ExpsGateUp)));
        let split = fused(hf) && !fused(gg);
        if split && matches!(id.kind, TensorKind::ExpsGateUp | TensorKind::ExpsGate | TensorKind::ExpsUp) {
            continue; // split in this GGUF; compared through experts() below
        }
        let permuted = hf.spec.arch == "llama" && matches!(id.kind, TensorKind::AttnQ | TensorKind::AttnK);
        if permuted {
            let (a, b) = (hf.get(id).unwrap(), gg.get(id).unwrap());
            let att = &hf.spec.layers[id.layer.unwrap()].attention;
            let heads = if id.kind == TensorKind::AttnQ { att.n_heads } else { att.n_kv_heads };
            assert_eq!(interleave_rows(a.bytes(), a.shape[0], heads), b.bytes(), "{id:?}");
            continue;
        }
        let a = hf.get(id).map(|t| (t.dtype, t.shape.clone(), t.bytes().to_vec()));
        let b = gg.get(id).map(|t| (t.dtype, t.shape.clone(), t.bytes().to_vec()));
        assert_eq!(a, b, "{id:?} ({} / {})", hf.name(id), gg.name(id));
    }
    for (l, layer) in hf.spec.layers.iter().enumerate() {
        let Some(moe) = &layer.moe else { continue };
        let x = hf.experts(l, moe, hf.spec.hidden_size).unwrap();
        let y = gg.experts(l, moe, gg.spec.hidden_size).unwrap();
        assert_eq!(x.len(), y.len());
        for (e, (p, q)) in x.iter().zip(&y).enumerate() {
            for (m, n) in [(&p.gate, &q.gate), (&p.up, &q.up), (&p.down, &q.down)] {
                assert_eq!(m.shape, n.shape, "layer {l} expert {e}");
                assert_eq!(m.bytes(), n.bytes(), "layer {l} expert {e} {}", m.name);
            }
        }
    }
}

#[test]
fn gemma4_moe_gguf_matches_its_hugging_face_form() {
    let dir = fixture("gemma4-moe");
    let hf = Checkpoint::open(&dir).unwrap();
    let cfg = config(&dir);
    let path = tmp("gemma4-moe.gguf");
    let mut w = GgufWriter::new();
    gemma4_metadata(&mut w, &cfg["text_config"]);
    add_tensors(&mut w, &hf, false);
    w.write(&path).unwrap();

    let gg = Checkpoint::open(&path).unwrap();
    assert!(gg.gguf().is_some() && hf.gguf().is_none());
    assert_eq!(gg.spec.arch, "gemma4");
    assert_eq!(gg.spec.layers, hf.spec.layers);
    assert_eq!(comparable(&gg.spec), comparable(&hf.spec));
    // The parts that make this fixture Gemma 4: k = v and one KV head of dim 32 on full
    // layers, proportional RoPE, experts beside the dense MLP, no PLE.
    let full = &gg.spec.layers[2].attention;
    assert!(full.k_eq_v && full.window.is_none() && full.head_dim == 32 && full.n_kv_heads == 1);
    assert_eq!(full.rope.inv_freq.iter().filter(|&&f| f != 0.0).count(), 4);
    assert!(gg.spec.layers.iter().all(|l| l.moe.is_some() && l.mlp == Some(96)));
    assert_eq!(gg.spec.ple, None);
    assert_same_tensors(&hf, &gg);
    // The fused expert tensor keeps its GGUF name and shape [E, 2I, H].
    let gu = gg.gguf().unwrap().tensor("blk.0.ffn_gate_up_exps.weight").unwrap();
    assert_eq!(gu.shape, vec![8, 64, 64]);
}

#[test]
fn gemma4_dense_with_ple_and_shared_kv_gguf_matches_its_hugging_face_form() {
    let dir = fixture("gemma4-dense");
    let hf = Checkpoint::open(&dir).unwrap();
    let cfg = config(&dir);
    let path = tmp("gemma4-dense.gguf");
    let mut w = GgufWriter::new();
    gemma4_metadata(&mut w, &cfg);
    add_tensors(&mut w, &hf, false);
    w.write(&path).unwrap();

    let gg = Checkpoint::open(&path).unwrap();
    assert_eq!(gg.spec.layers, hf.spec.layers);
    assert_eq!(comparable(&gg.spec), comparable(&hf.spec));
    let kv: Vec<Option<usize>> = gg.spec.layers.iter().map(|l| l.attention.kv_source).collect();
    assert_eq!(kv, vec![None, None, None, None, Some(3), Some(2)]);
    let mlp: Vec<Option<usize>> = gg.spec.layers.iter().map(|l| l.mlp).collect();
    assert_eq!(mlp, vec![Some(96), Some(96), Some(96), Some(96), Some(192), Some(192)]);
    assert_eq!(gg.spec.ple.as_ref().map(|p| (p.dim, p.vocab_size)), Some((8, 512)));
    assert_eq!(gg.spec.weight_dtype, Some(DType::BF16));
    assert_same_tensors(&hf, &gg);
}

#[test]
fn qwen3_moe_gguf_with_split_experts_matches_its_hugging_face_form() {
    let dir = fixture("qwen3-moe-fused");
    let hf = Checkpoint::open(&dir).unwrap();
    let cfg = config(&dir);
    let path = tmp("qwen3-moe.gguf");
    let mut w = GgufWriter::new();
    qwen3moe_metadata(&mut w, &cfg);
    add_tensors(&mut w, &hf, true);
    w.write(&path).unwrap();

    let gg = Checkpoint::open(&path).unwrap();
    assert_eq!(gg.spec.arch, "qwen3moe");
    assert_eq!(gg.spec.layers, hf.spec.layers);
    assert_eq!(comparable(&gg.spec), comparable(&hf.spec));
    assert_eq!(gg.spec.eos_token_ids, hf.spec.eos_token_ids);
    let moe: Vec<bool> = gg.spec.layers.iter().map(|l| l.moe.is_some()).collect();
    assert_eq!(moe, vec![false, true, false]);
    assert!(!gg.spec.tie_word_embeddings);
    let g = gg.gguf().unwrap();
    assert!(g.tensor("blk.1.ffn_gate_exps.weight").is_some() && g.tensor("blk.1.ffn_gate_up_exps.weight").is_none());
    assert_same_tensors(&hf, &gg);

    // Without expert_weights_norm, qwen3moe renormalises as llama.cpp does.
    let path = tmp("qwen3-moe-norm.gguf");
    let mut w = GgufWriter::new();
    qwen3moe_metadata(&mut w, &cfg);
    w.add("qwen3moe.expert_weights_norm", GgufValue::Bool(true));
    add_tensors(&mut w, &hf, true);
    w.write(&path).unwrap();
    let gg = Checkpoint::open(&path).unwrap();
    let m = gg.spec.layers[1].moe.as_ref().unwrap();
    assert_eq!(m.router, sluice_core::RouterKind::Softmax { normalize_top_k: true });
}

#[test]
fn llama_gguf_rotates_interleaved_pairs_and_reads_llama3_rope_factors() {
    // The converter permutes llama Q/K for interleaved RoPE and turns llama3 scaling into
    // a rope_freqs tensor; the HF form of the same model rotates halves.
    let dir = fixture("llama");
    let hf = Checkpoint::open(&dir).unwrap();
    let c = config(&dir);
    let a = "llama";
    let (theta, hd) = (f(&c, "rope_theta"), u(&c, "hidden_size") / u(&c, "num_attention_heads"));
    // Llama 3 factors as the converter computes them.
    let s = &c["rope_scaling"];
    let (factor, low, high, old) =
        (f(s, "factor"), f(s, "low_freq_factor"), f(s, "high_freq_factor"), f(s, "original_max_position_embeddings"));
    let factors: Vec<f32> = (0..hd as usize / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f32 / hd as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect();
    let path = tmp("llama.gguf");
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", a)
        .add_u32(&format!("{a}.block_count"), u(&c, "num_hidden_layers") as u32)
        .add_u32(&format!("{a}.context_length"), u(&c, "max_position_embeddings") as u32)
        .add_u32(&format!("{a}.embedding_length"), u(&c, "hidden_size") as u32)
        .add_u32(&format!("{a}.feed_forward_length"), u(&c, "intermediate_size") as u32)
        .add_u32(&format!("{a}.attention.head_count"), u(&c, "num_attention_heads") as u32)
        .add_u32(&format!("{a}.attention.head_count_kv"), u(&c, "num_key_value_heads") as u32)
        .add_f32(&format!("{a}.rope.freq_base"), theta)
        .add_f32(&format!("{a}.attention.layer_norm_rms_epsilon"), f(&c, "rms_norm_eps"))
        .add_u32(&format!("{a}.rope.dimension_count"), hd as u32)
        .add_u32(&format!("{a}.vocab_size"), u(&c, "vocab_size") as u32);
    w.add_f32_tensor("rope_freqs.weight", &[factors.len()], &factors);
    add_tensors(&mut w, &hf, false);
    w.write(&path).unwrap();

    let gg = Checkpoint::open(&path).unwrap();
    for (x, y) in gg.spec.layers.iter().zip(&hf.spec.layers) {
        let (ra, rb) = (&x.attention.rope, &y.attention.rope);
        assert_eq!(ra.style, RopeStyle::Interleaved);
        assert_eq!(rb.style, RopeStyle::Half);
        for (p, q) in ra.inv_freq.iter().zip(&rb.inv_freq) {
            assert!((p - q).abs() <= 1e-6 * q.abs(), "{:?} vs {:?}", ra.inv_freq, rb.inv_freq);
        }
        let strip = |l: &sluice_core::LayerSpec| {
            let mut l = l.clone();
            l.attention.rope =
                sluice_core::RopeSpec { style: RopeStyle::Half, inv_freq: vec![], attention_factor: 1.0 };
            l
        };
        assert_eq!(strip(x), strip(y));
    }
    assert_eq!(gg.spec.vocab_size, hf.spec.vocab_size);
    assert!(!gg.spec.tie_word_embeddings);
    assert_same_tensors(&hf, &gg);
}

#[test]
fn gguf_metadata_is_readable_by_key_after_checkpoint_open() {
    let dir = fixture("qwen3-moe-fused");
    let hf = Checkpoint::open(&dir).unwrap();
    let path = tmp("qwen3-moe-keys.gguf");
    let mut w = GgufWriter::new();
    qwen3moe_metadata(&mut w, &config(&dir));
    w.add_str_array("tokenizer.ggml.tokens", &["<a>", "b"]).add_str("tokenizer.ggml.model", "gpt2");
    add_tensors(&mut w, &hf, true);
    w.write(&path).unwrap();
    let gg = Checkpoint::open(&path).unwrap();
    let g: &GgufFile = gg.gguf().unwrap();
    assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap(), Some(vec!["<a>", "b"]));
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), Some("gpt2"));
    assert_eq!(g.path(), path.as_path());
}

#[test]
fn metadata_that_makes_no_sense_is_a_config_error_naming_the_key() {
    let dir = fixture("qwen3-moe-fused");
    let hf = Checkpoint::open(&dir).unwrap();
    let cfg = config(&dir);
    type Edit = fn(&mut GgufWriter);
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "no_blocks",
            |w| {
                w.remove("qwen3moe.block_count");
            },
            "'qwen3moe.block_count' is missing",
        ),
        (
            "no_eps",
            |w| {
                w.remove("qwen3moe.attention.layer_norm_rms_epsilon");
            },
            "layer_norm_rms_epsilon",
        ),
        (
            "kv_array",
            |w| {
                w.add_u32_array("qwen3moe.attention.head_count_kv", &[2, 2]);
            },
            "has 2 entries for 3 layers",
        ),
        (
            "kv_ratio",
            |w| {
                w.add_u32("qwen3moe.attention.head_count_kv", 3);
            },
            "multiple of 3 KV heads",
        ),
        (
            "yarn",
            |w| {
                w.add_str("qwen3moe.rope.scaling.type", "yarn").add_f32("qwen3moe.rope.scaling.factor", 4.0);
            },
            "RoPE scaling type 'yarn'",
        ),
        (
            "top_k",
            |w| {
                w.add_u32("qwen3moe.expert_used_count", 9);
            },
            "'qwen3moe.expert_used_count' (9)",
        ),
        (
            "kv_dims",
            |w| {
                w.add_u32("qwen3moe.attention.value_length", 8);
            },
            "differs from",
        ),
        (
            "no_arch",
            |w| {
                w.remove("general.architecture");
            },
            "'general.architecture' is missing",
        ),
    ];
    for (name, edit, needle) in cases {
        let path = tmp(&format!("cfg_{name}.gguf"));
        let mut w = GgufWriter::new();
        qwen3moe_metadata(&mut w, &cfg);
        edit(&mut w);
        add_tensors(&mut w, &hf, true);
        w.write(&path).unwrap();
        match Checkpoint::open(&path) {
            Err(sluice_core::Error::Config { path: p, msg }) => {
                assert_eq!(p, path, "{name}");
                assert!(msg.contains(needle), "{name}: {msg}");
            }
            Err(other) => panic!("{name}: {other:?}"),
            Ok(_) => panic!("{name}: opened"),
        }
    }

    // A rope_freqs tensor of the wrong length names the tensor.
    let path = tmp("cfg_rope_freqs.gguf");
    let mut w = GgufWriter::new();
    qwen3moe_metadata(&mut w, &cfg);
    w.add_f32_tensor("rope_freqs.weight", &[3], &[1.0, 1.0, 1.0]);
    add_tensors(&mut w, &hf, true);
    w.write(&path).unwrap();
    match Checkpoint::open(&path) {
        Err(sluice_core::Error::TensorShape { name, .. }) => assert_eq!(name, "rope_freqs.weight"),
        other => panic!("{:?}", other.err()),
    }
}

#[test]
fn gemma3_gguf_has_the_norm_offset_baked_into_its_weights() {
    let dir = fixture("gemma3");
    let hf = Checkpoint::open(&dir).unwrap();
    assert_eq!(hf.spec.norm_weight_offset, 1.0);
    let c = config(&dir);
    let a = "gemma3";
    let n = u(&c, "num_hidden_layers") as usize;
    let hd = u(&c, "head_dim") as u32;
    let full = &c["rope_parameters"]["full_attention"];
    let path = tmp("gemma3.gguf");
    let mut w = GgufWriter::new();
    // What Gemma3Model (over TextModel) writes.
    w.add_str("general.architecture", a)
        .add_u32(&format!("{a}.block_count"), n as u32)
        .add_u32(&format!("{a}.context_length"), u(&c, "max_position_embeddings") as u32)
        .add_u32(&format!("{a}.embedding_length"), u(&c, "hidden_size") as u32)
        .add_u32(&format!("{a}.feed_forward_length"), u(&c, "intermediate_size") as u32)
        .add_u32(&format!("{a}.attention.head_count"), u(&c, "num_attention_heads") as u32)
        .add_u32(&format!("{a}.attention.head_count_kv"), u(&c, "num_key_value_heads") as u32)
        .add_str(&format!("{a}.rope.scaling.type"), "linear")
        .add_f32(&format!("{a}.rope.scaling.factor"), f(full, "factor"))
        .add_f32(&format!("{a}.rope.freq_base"), f(full, "rope_theta"))
        .add_f32(&format!("{a}.rope.freq_base_swa"), f(&c["rope_parameters"]["sliding_attention"], "rope_theta"))
        .add_f32(&format!("{a}.attention.layer_norm_rms_epsilon"), f(&c, "rms_norm_eps"))
        .add_u32(&format!("{a}.attention.key_length"), hd)
        .add_u32(&format!("{a}.attention.value_length"), hd)
        .add_u32(&format!("{a}.attention.sliding_window"), u(&c, "sliding_window") as u32)
        .add_u32("tokenizer.ggml.bos_token_id", u(&c, "bos_token_id") as u32)
        .add_u32("tokenizer.ggml.eos_token_id", c["eos_token_id"][0].as_u64().unwrap() as u32);
    // This fixture departs from every published Gemma 3 in two ways GGUF only holds
    // through optional keys: its layer pattern is not "every 6th layer is global", and
    // query_pre_attn_scalar (24) is not the head dim (16).
    let types: Vec<bool> = c["layer_types"].as_array().unwrap().iter().map(|t| t == "sliding_attention").collect();
    w.add_bool_array(&format!("{a}.attention.sliding_window_pattern"), &types)
        .add_f32(&format!("{a}.attention.scale"), f(&c, "query_pre_attn_scalar").powf(-0.5));
    // The converter adds 1 to every `*norm.weight` (Gemma3RMSNorm applies 1 + w).
    let norms = [
        TensorKind::AttnNorm,
        TensorKind::AttnQNorm,
        TensorKind::AttnKNorm,
        TensorKind::AttnPostNorm,
        TensorKind::FfnNorm,
        TensorKind::FfnPostNorm,
        TensorKind::OutputNorm,
    ];
    for id in MODEL_KINDS
        .iter()
        .map(|&k| TensorId::model(k))
        .chain((0..n).flat_map(|l| LAYER_KINDS.iter().map(move |&k| TensorId::layer(l, k))))
    {
        let Some(t) = hf.get(id) else { continue };
        if norms.contains(&id.kind) {
            let plus_one: Vec<f32> = t.to_f32_vec().unwrap().iter().map(|x| x + 1.0).collect();
            w.add_f32_tensor(&gguf_name(id), &t.shape, &plus_one);
        } else {
            w.add_tensor(&gguf_name(id), t.dtype, &t.shape, t.bytes());
        }
    }
    w.write(&path).unwrap();

    let gg = Checkpoint::open(&path).unwrap();
    assert_eq!(gg.spec.norm_weight_offset, 0.0);
    assert_eq!(gg.spec.layers, hf.spec.layers);
    let with_offset = ModelSpec { norm_weight_offset: 1.0, ..comparable(&gg.spec) };
    assert_eq!(with_offset, comparable(&hf.spec));
    let norm = |c: &Checkpoint| c.get(TensorId::layer(0, TensorKind::AttnQNorm)).unwrap().to_f32_vec().unwrap();
    assert_eq!(norm(&gg), norm(&hf).iter().map(|x| x + 1.0).collect::<Vec<_>>());

    // Without the optional keys, llama.cpp's defaults: every 6th layer global, scale
    // head_dim^-0.5.
    let path = tmp("gemma3-defaults.gguf");
    let mut w = GgufWriter::new();
    for (k, v) in GgufFile::open(&tmp("gemma3.gguf")).unwrap().metadata() {
        w.add(k, v.clone());
    }
    w.remove("gemma3.attention.sliding_window_pattern").remove("gemma3.attention.scale");
    add_tensors(&mut w, &hf, false);
    w.write(&path).unwrap();
    let gg = Checkpoint::open(&path).unwrap();
    assert!(gg.spec.layers.iter().all(|l| l.attention.window == Some(4) && l.attention.scale == 0.25));
}
