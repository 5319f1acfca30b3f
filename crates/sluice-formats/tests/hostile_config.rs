//! Hostile Hugging Face folders. Numbers in config.json: each gives one configuration error that
//! names the file and the key or size at fault, never a panic, an abort or an
//! allocation the number asks for. Before these checks, `num_hidden_layers` = 2^31 made
//! `sluice inspect` try to allocate 910 GB (the layer descriptions) and abort, and
//! `head_dim` = 2^62 asked for 2^61 floats of RoPE frequencies: the "2 TiB" class of
//! issue 15. Found by mutating the fixtures' configs (and the `hf_config` fuzz target).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sluice_core::Error;
use sluice_formats::hf_config;

fn fixture_config(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny").join(name).join("config.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The fixture's config with `key` (inside `text_config` when there is one) set to `value`.
fn with(name: &str, key: &str, value: Value) -> PathBuf {
    let mut cfg = fixture_config(name);
    let text = if cfg.get("text_config").is_some() { &mut cfg["text_config"] } else { &mut cfg };
    text[key] = value;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hostile-config").join(format!("{name}-{key}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string(&cfg).unwrap()).unwrap();
    dir
}

#[test]
fn hostile_numbers_are_config_errors() {
    let cases: &[(&str, &str, Value, &str)] = &[
        ("deepseek-v3", "num_hidden_layers", json!(1u64 << 31), "more than sluice accepts for a size or count"),
        ("llama", "num_hidden_layers", json!(5000), "more layers than sluice accepts"),
        ("gpt-oss", "head_dim", json!(1u64 << 62), "more than sluice accepts for a size or count"),
        ("qwen3.5-moe", "head_dim", json!(1u64 << 62), "more than sluice accepts for a size or count"),
        ("qwen3-moe", "hidden_size", json!(1u64 << 40), "'hidden_size' is 1099511627776"),
        ("llama", "head_dim", json!(0), "head dimension is 0"),
        ("llama", "vocab_size", json!(0), "vocabulary size is 0"),
        ("qwen3-moe", "num_experts_per_tok", json!(1000), "must be between 1 and num_experts"),
        ("llama", "num_key_value_heads", json!(3), "must be a positive multiple of num_key_value_heads"),
        ("gemma4-moe", "sliding_window", json!(0), "'sliding_window' is 0"),
        ("gpt-oss", "sliding_window", json!(0), "'sliding_window' is 0"),
        ("gpt-oss", "swiglu_limit", json!(-1e9), "'swiglu_limit' is -1000000000"),
        ("llama", "partial_rotary_factor", json!(1e30), "'partial_rotary_factor' is"),
    ];
    for (fixture, key, value, want) in cases {
        let dir = with(fixture, key, value.clone());
        let err = match hf_config::read(&dir) {
            Ok(_) => panic!("{fixture} with {key} = {value} was accepted"),
            Err(e) => e,
        };
        let msg = err.to_string();
        assert!(matches!(err, Error::Config { .. }), "{fixture} {key}: not a config error: {msg}");
        assert!(msg.contains("config.json"), "{fixture} {key}: the error does not name the file: {msg}");
        assert!(msg.contains(want), "{fixture} {key} = {value}: expected {want:?} in: {msg}");
    }
}

/// A shard index that names a file outside its folder is refused before anything is opened.
#[test]
fn an_index_names_only_files_of_its_folder() {
    for name in ["/etc/passwd", "../model.safetensors", "sub/model.safetensors", ""] {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hostile-index");
        std::fs::create_dir_all(&dir).unwrap();
        let index = json!({"weight_map": {"model.embed_tokens.weight": name}});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let err = sluice_formats::safetensors::read_folder(&dir).err().expect("accepted");
        let msg = err.to_string();
        assert!(
            msg.contains("model.safetensors.index.json") && msg.contains("is not a file name in this folder"),
            "{msg}"
        );
    }
}
