//! What the real-vocabulary tests share: where fetched models live and the check of a
//! tokenizer against a reference written by transformers (fixtures/tokenizer/<name>.json).

#![allow(dead_code)] // each test file uses its own part

use serde_json::Value;
use sluice_tokenizer::{ChatMessage, StreamDecoder, Tokenizer};

#[allow(unused_imports)] // each test file uses its own part
pub use sluice_core::testing::{models_dir, repo_root};

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

pub fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> String {
    let mut decoder = StreamDecoder::new(tok, skip_special);
    let mut out = String::new();
    for &id in ids {
        out.push_str(&decoder.push(id).unwrap());
    }
    out.push_str(&decoder.finish().unwrap());
    out
}

/// Where a tokenizer under test was read from. A GGUF marks every special token as control,
/// including those tokenizer.json leaves unskipped; its reference for decoding without special
/// tokens (`decoded_skip_control`, where it differs) skips them all, as llama.cpp does.
#[derive(Clone, Copy, PartialEq)]
pub enum Form {
    HfFolder,
    Gguf,
}

/// Every corpus entry and the chat against the reference; all mismatches are listed at once.
pub fn check_parity(name: &str, tok: &Tokenizer, fixture: &Value, form: Form) {
    let mut failures: Vec<String> = Vec::new();
    let entries = fixture["encode"].as_array().unwrap();
    for entry in entries {
        let text = entry["text"].as_str().unwrap();
        let expected = ids(&entry["ids"]);
        let got = tok.encode(text, true).unwrap();
        if got != expected {
            failures.push(format!("encode {text:?}:\n  got      {got:?}\n  expected {expected:?}"));
        }
        let plain = tok.encode(text, false).unwrap();
        let round = tok.decode(&plain, false).unwrap();
        let want = entry["decoded_plain"].as_str().unwrap_or(text);
        if round != want {
            failures.push(format!("decode(encode({text:?})) gave {round:?}, expected {want:?}"));
        }
        let want = match (form, entry["decoded_skip_control"].as_str()) {
            (Form::Gguf, Some(want)) => want,
            _ => entry["decoded_skip_special"].as_str().unwrap(),
        };
        let skipped = tok.decode(&expected, true).unwrap();
        if skipped != want {
            failures.push(format!("decode({text:?} ids, skip_special) gave {skipped:?}, expected {want:?}"));
        }
        for skip in [false, true] {
            let full = tok.decode(&expected, skip).unwrap();
            let streamed = stream(tok, &expected, skip);
            if streamed != full {
                failures.push(format!("stream decode of {text:?} (skip {skip}) gave {streamed:?}, full {full:?}"));
            }
        }
    }

    let chat = &fixture["chat"];
    if chat.is_null() {
        if tok.has_chat_template() {
            failures.push("has a chat template, but transformers found none".into());
        }
    } else {
        let messages: Vec<ChatMessage> = chat["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let add = chat["add_generation_prompt"].as_bool().unwrap();
        let mut text = tok.apply_chat_template(&messages, add).unwrap();
        let got = tok.encode_chat(&messages, add).unwrap();
        if got != tok.encode(&text, false).unwrap() {
            failures.push("encode_chat differs from encoding the rendered chat".into());
        }
        // A template that prints today's date (strftime_now) was rendered on the fixture's
        // day; ours prints today's, put back to that day before comparing.
        let got = match chat["date"].as_str() {
            Some(then) if !text.contains(then) && chat["text"].as_str().unwrap().contains(then) => {
                let now = today();
                assert!(
                    text.contains(&now),
                    "{name}: the fixture is dated {then}; the chat shows neither it nor {now}"
                );
                text = text.replace(&now, then);
                tok.encode(&text, false).unwrap()
            }
            _ => got,
        };
        if text != chat["text"].as_str().unwrap() {
            failures.push(format!("chat render:\n  got      {text:?}\n  expected {:?}", chat["text"]));
        }
        if got != ids(&chat["ids"]) {
            failures.push(format!("chat ids:\n  got      {got:?}\n  expected {:?}", ids(&chat["ids"])));
        }
    }
    assert!(failures.is_empty(), "{name}: {} mismatches:\n{}", failures.len(), failures.join("\n"));
    eprintln!(
        "{name}: {} texts{} match transformers",
        entries.len(),
        if chat.is_null() { "" } else { " and the chat" }
    );
}

/// Today's UTC date as strftime's `%Y-%m-%d` writes it.
fn today() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let (y, m, d) = sluice_tokenizer::civil_from_days(secs.div_euclid(86_400));
    format!("{y:04}-{m:02}-{d:02}")
}
