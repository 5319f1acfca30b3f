//! Tokenizers built from real GGUF files against the ones Hugging Face transformers builds
//! from the same files: fixtures/tokenizer/<model>.json, written by
//! scripts/make_tokenizer_reference.py. The models come from scripts/fetch_models.sh into
//! $SLUICE_MODELS or <repo>/.cache/models; a missing one fails in CI and is skipped,
//! saying so, elsewhere.

mod common;

use std::path::Path;
use std::time::Instant;

use common::{Form, check_parity, repo_root};
use serde_json::Value;
use sluice_formats::gguf::GgufFile;
use sluice_tokenizer::{ChatMessage, Tokenizer};

/// Opens a fetched model, or says how to fetch it and returns None.
fn open_model(name: &str, file: &str) -> Option<(Tokenizer, Value)> {
    let path = sluice_core::testing::real_model(file, name)?;
    let fixture_path = repo_root().join("fixtures/tokenizer").join(format!("{name}.json"));
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(&fixture_path).unwrap()).unwrap();
    assert_eq!(fixture["file"], file, "{} is for another file", fixture_path.display());

    let start = Instant::now();
    let gguf = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    eprintln!("{name}: tokenizer from {} in {:.2} s", path.display(), start.elapsed().as_secs_f64());
    Some((tok, fixture))
}

#[test]
fn smollm2_matches_transformers() {
    let Some((tok, fixture)) = open_model("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    check_parity("smollm2", &tok, &fixture, Form::Gguf);
    // gpt2 vocabulary, pre `smollm`; bos is <|im_start|> but add_bos_token is false.
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.id_to_token(1).as_deref(), Some("<|im_start|>"));
    assert_eq!(tok.eos_ids(), [2]);
    assert!(tok.is_special(0) && tok.is_special(16) && !tok.is_special(17));
    assert_eq!(tok.vocab_size(), 49152);
}

#[test]
fn gemma3_270m_matches_transformers() {
    let Some((tok, fixture)) = open_model("gemma3-270m", "gemma-3-270m-q4_k_m.gguf") else { return };
    check_parity("gemma3-270m", &tok, &fixture, Form::Gguf);
    // SentencePiece vocabulary with merges rebuilt from the token order; BOS added.
    assert_eq!(tok.bos_id(), Some(2));
    assert_eq!(tok.encode("Hi", true).unwrap()[0], 2);
    let end_of_turn = tok.token_to_id("<end_of_turn>").unwrap();
    assert_eq!(tok.eos_ids(), [1, end_of_turn]);
    // `\n\n` is a user-defined token: matched whole, not special.
    let newlines = tok.token_to_id("\n\n").unwrap();
    assert!(!tok.is_special(newlines) && tok.is_special(end_of_turn));
    assert_eq!(tok.vocab_size(), 262_144);
    // The base model's file carries no chat template.
    let err = tok.apply_chat_template(&[ChatMessage::new("user", "hi")], true).unwrap_err();
    assert!(err.to_string().contains("no tokenizer.chat_template"), "{err}");
}

#[test]
fn qwen2_5_coder_matches_transformers() {
    let Some((tok, fixture)) = open_model("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf") else {
        return;
    };
    check_parity("qwen2.5-coder-1.5b", &tok, &fixture, Form::Gguf);
    // gpt2 vocabulary, pre `qwen2`; `<tool_call>` is user-defined, the `[PAD...]` tail unused.
    assert_eq!(tok.bos_id(), Some(151_643));
    assert_eq!(tok.eos_ids(), [151_645]);
    let tool_call = tok.token_to_id("<tool_call>").unwrap();
    assert!(!tok.is_special(tool_call) && tok.is_special(151_643));
    assert_eq!(tok.encode("<tool_call>", false).unwrap(), [tool_call]);
    assert_eq!(tok.vocab_size(), 151_936);
}

/// GPT-2's byte alphabet, in byte order.
fn byte_chars() -> Vec<String> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut shifted = 0;
    (0u32..256)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                shifted += 1;
                255 + shifted
            };
            char::from_u32(c).unwrap().to_string()
        })
        .collect()
}

/// A GGUF file with only tokenizer metadata, written by sluice-formats' writer, read back
/// through `Tokenizer::from_gguf`.
#[test]
fn from_gguf_reads_the_tokenizer_keys() {
    use sluice_core::Error;
    use sluice_formats::GgufWriter;

    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sluice-tokenizer-gguf");
    std::fs::create_dir_all(&dir).unwrap();
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from).to_vec();
    tokens.extend(byte_chars());
    tokens.extend(["he", "ll", "hell", "hello"].map(String::from));
    let types: Vec<i32> = (0..tokens.len()).map(|i| if i < 3 { 3 } else { 1 }).collect();
    let write = |name: &str, eos: u32, tokens_as_numbers: bool| {
        let path = dir.join(name);
        let mut w = GgufWriter::new();
        w.add_str("general.architecture", "qwen2").add_str("tokenizer.ggml.model", "gpt2");
        w.add_str("tokenizer.ggml.pre", "qwen2");
        if tokens_as_numbers {
            w.add_i32_array("tokenizer.ggml.tokens", &types);
        } else {
            w.add_str_array("tokenizer.ggml.tokens", &tokens);
        }
        w.add_i32_array("tokenizer.ggml.token_type", &types)
            .add_str_array("tokenizer.ggml.merges", &["h e", "l l", "he ll", "hell o"])
            .add_u32("tokenizer.ggml.bos_token_id", 0)
            .add_u32("tokenizer.ggml.eos_token_id", eos)
            .add_bool("tokenizer.ggml.add_bos_token", false)
            .add_str(
                "tokenizer.chat_template",
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
            );
        w.write(&path).unwrap();
        path
    };

    let path = write("tiny.gguf", 2, false);
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let hello = tok.token_to_id("hello").unwrap();
    assert_eq!(tok.encode("<|im_start|>hello<|im_end|>", true).unwrap(), [1, hello, 2]);
    assert_eq!(tok.eos_ids(), [2]);
    let chat = [ChatMessage::new("user", "hello")];
    assert_eq!(tok.apply_chat_template(&chat, false).unwrap(), "<|im_start|>user\nhello<|im_end|>\n");

    let path = write("bad-eos.gguf", 9999, false);
    match Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()) {
        Err(Error::Tokenizer { path: p, msg }) => {
            assert_eq!(p, path);
            assert!(msg.contains("eos_token_id is 9999"), "{msg}");
        }
        other => panic!("expected a tokenizer error, got {:?}", other.map(|_| ())),
    }
    // A key of the wrong type is the file's fault, reported by the GGUF reader.
    let path = write("numbers.gguf", 2, true);
    let err = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).err().expect("tokens of the wrong type");
    assert!(
        err.to_string().contains(&path.display().to_string()) && err.to_string().contains("tokenizer.ggml.tokens"),
        "{err}"
    );
}
