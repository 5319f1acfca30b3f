//! Tests over tiny tokenizers written here by hand: a byte-level BPE (GPT-2 / Qwen /
//! Llama 3 style) and a SentencePiece-style BPE with byte fallback (Llama 2 / Gemma style),
//! each in its own model folder with the configs HF ships next to tokenizer.json.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sluice_core::Error;
use sluice_tokenizer::{ChatMessage, StreamDecoder, Tokenizer};

/// A fresh, empty folder for one test.
fn folder(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sluice-tokenizer").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_json(dir: &Path, file: &str, value: &Value) {
    std::fs::write(dir.join(file), serde_json::to_string_pretty(value).unwrap()).unwrap();
}

fn added_token(id: u32, content: &str, special: bool) -> Value {
    json!({
        "id": id, "content": content, "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": special
    })
}

/// A post-processor that puts `bos` before every sequence, as Llama's and Gemma's do.
fn bos_processor(bos: &str, bos_id: u32) -> Value {
    json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}
    })
}

/// GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the rest
/// are shifted to U+0100 and up.
fn byte_chars() -> Vec<char> {
    let printable: Vec<u32> = (0x21..=0x7E).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut shifted = 0;
    (0u32..256)
        .map(|b| {
            if printable.contains(&b) {
                char::from_u32(b).unwrap()
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).unwrap()
            }
        })
        .collect()
}

fn byte_level(bytes: &[u8]) -> String {
    let table = byte_chars();
    bytes.iter().map(|&b| table[b as usize]).collect()
}

// Ids of the byte-level fixture's added tokens; the 256 bytes come first, then the merges.
const BL_MERGES: &[(&[u8], &[u8])] = &[
    (b"h", b"e"),
    (b"l", b"l"),
    (b"he", b"ll"),
    (b"hell", b"o"),
    (b" ", b"w"),
    (b"o", b"r"),
    (b" w", b"or"),
    // Merges that end a token in the middle of a character, so that decoding one token
    // at a time meets incomplete UTF-8: "f" + the first byte of "é", two of the three
    // bytes of "你", three of the four of "😀".
    (b"f", b"\xc3"),
    (b"\xe4", b"\xbd"),
    (b"\xf0", b"\x9f"),
    (b"\xf0\x9f", b"\x98"),
];
const BL_BOS: u32 = 256 + BL_MERGES.len() as u32;
const BL_EOS: u32 = BL_BOS + 1;
const BL_IM_START: u32 = BL_BOS + 2;
const BL_IM_END: u32 = BL_BOS + 3;
const BL_THINK: u32 = BL_BOS + 4; // an added token that is not special

/// A byte-level BPE folder with tokenizer.json only.
fn byte_level_folder(name: &str) -> PathBuf {
    let dir = folder(name);
    let mut vocab = serde_json::Map::new();
    for (b, c) in byte_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    let mut merges = Vec::new();
    for (i, (a, b)) in BL_MERGES.iter().enumerate() {
        let (a, b) = (byte_level(a), byte_level(b));
        vocab.insert(format!("{a}{b}"), json!(256 + i));
        merges.push(format!("{a} {b}"));
    }
    let byte_level_cfg = json!({"add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let with_type = |t: &str| {
        let mut v = byte_level_cfg.clone();
        v["type"] = json!(t);
        v
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            added_token(BL_BOS, "<|bos|>", true),
            added_token(BL_EOS, "<|eos|>", true),
            added_token(BL_IM_START, "<|im_start|>", true),
            added_token(BL_IM_END, "<|im_end|>", true),
            added_token(BL_THINK, "<think>", false),
        ],
        "normalizer": null,
        "pre_tokenizer": with_type("ByteLevel"),
        "post_processor": bos_processor("<|bos|>", BL_BOS),
        "decoder": with_type("ByteLevel"),
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges
        }
    });
    write_json(&dir, "tokenizer.json", &tokenizer);
    dir
}

// The SentencePiece-style fixture: <unk> <s> </s>, the 256 byte pieces, then these.
const SP_PIECES: &[&str] = &[
    "▁", "H", "e", "l", "o", "w", "r", "d", "ll", "ell", "Hell", "Hello", "▁Hello", "▁w", "or", "▁wor", "ld", "▁world",
];
const SP_MERGES: &[&str] = &["l l", "e ll", "H ell", "Hell o", "▁ Hello", "▁ w", "o r", "▁w or", "l d", "▁wor ld"];
const SP_BOS: u32 = 1;
const SP_EOS: u32 = 2;
const SP_START_OF_TURN: u32 = 3 + 256 + SP_PIECES.len() as u32;
const SP_END_OF_TURN: u32 = SP_START_OF_TURN + 1;

fn sp_id(piece: &str) -> u32 {
    3 + 256 + SP_PIECES.iter().position(|p| *p == piece).unwrap() as u32
}

/// A Llama-2-style folder: BPE over "▁"-joined text, unknown characters as <0xNN> pieces,
/// and a decoder that strips the space the normalizer prepended.
fn sentencepiece_folder(name: &str) -> PathBuf {
    let dir = folder(name);
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), json!(i));
    }
    for b in 0..256 {
        vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
    }
    for p in SP_PIECES {
        vocab.insert(p.to_string(), json!(sp_id(p)));
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            added_token(0, "<unk>", true),
            added_token(SP_BOS, "<s>", true),
            added_token(SP_EOS, "</s>", true),
            added_token(SP_START_OF_TURN, "<start_of_turn>", true),
            added_token(SP_END_OF_TURN, "<end_of_turn>", true),
        ],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]},
        "pre_tokenizer": null,
        "post_processor": bos_processor("<s>", SP_BOS),
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
            "ignore_merges": false, "vocab": vocab, "merges": SP_MERGES
        }
    });
    write_json(&dir, "tokenizer.json", &tokenizer);
    dir
}

const MIXED: &str = "hello world, café 你好 😀! naïve 𝄞 ok";

fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
    pairs.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect()
}

// ---------------------------------------------------------------- encode / decode

#[test]
fn tokenizer_can_be_shared_across_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Tokenizer>();
}

#[test]
fn byte_level_roundtrip() {
    let tok = Tokenizer::from_hf_dir(&byte_level_folder("bl_roundtrip")).unwrap();
    assert_eq!(tok.vocab_size(), 256 + BL_MERGES.len() + 5);
    let ids = tok.encode("hello world", false).unwrap();
    assert_eq!(
        ids,
        vec![tok.token_to_id("hello").unwrap(), tok.token_to_id("Ġwor").unwrap(), b'l' as u32, b'd' as u32]
    );
    for text in [MIXED, "", " leading and trailing  ", "tab\tnew\nline\r\n"] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    assert_eq!(tok.id_to_token(BL_IM_END).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(BL_IM_START));
    assert_eq!(tok.token_to_id("no such token"), None);
}

#[test]
fn sentencepiece_roundtrip_and_byte_fallback() {
    let tok = Tokenizer::from_hf_dir(&sentencepiece_folder("sp_roundtrip")).unwrap();
    let ids = tok.encode("Hello world", false).unwrap();
    assert_eq!(ids, vec![sp_id("▁Hello"), sp_id("▁world")]);
    // "é" is not a piece: it falls back to its two UTF-8 bytes.
    let ids = tok.encode("é", false).unwrap();
    assert_eq!(ids, vec![sp_id("▁"), 3 + 0xC3, 3 + 0xA9]);
    for text in [MIXED, "Hello", "Hello  world "] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text, "{ids:?}");
    }
}

/// Each id's bytes (what constrained decoding matches grammars against) joined over an
/// encoding are the text's bytes, in both vocabulary kinds; special tokens are marked.
#[test]
fn token_bytes_spell_the_text() {
    let join = |tok: &Tokenizer, ids: &[u32]| {
        let bytes = tok.token_bytes();
        ids.iter().flat_map(|&i| bytes[i as usize].clone()).collect::<Vec<u8>>()
    };
    let bl = Tokenizer::from_hf_dir(&byte_level_folder("bl_bytes")).unwrap();
    assert_eq!(bl.token_bytes().len(), bl.vocab_size());
    for text in [MIXED, "tab\tnew\nline\r\n", " x "] {
        assert_eq!(join(&bl, &bl.encode(text, false).unwrap()), text.as_bytes(), "{text:?}");
    }
    assert_eq!(bl.token_bytes()[BL_IM_END as usize], b"\xff<|im_end|>");
    let sp = Tokenizer::from_hf_dir(&sentencepiece_folder("sp_bytes")).unwrap();
    for text in [MIXED, "Hello  world ", "é"] {
        // SentencePiece writes a space before the text.
        assert_eq!(join(&sp, &sp.encode(text, false).unwrap()), format!(" {text}").as_bytes(), "{text:?}");
    }
}

#[test]
fn add_special_prepends_bos() {
    let tok = Tokenizer::from_hf_dir(&byte_level_folder("bl_bos")).unwrap();
    let plain = tok.encode("hello", false).unwrap();
    let with = tok.encode("hello", true).unwrap();
    assert_eq!(with[0], BL_BOS);
    assert_eq!(&with[1..], &plain[..]);
    // Without tokenizer_config.json nothing names the BOS.
    assert_eq!(tok.bos_id(), None);

    let tok = Tokenizer::from_hf_dir(&sentencepiece_folder("sp_bos")).unwrap();
    assert_eq!(tok.encode("Hello", true).unwrap(), vec![SP_BOS, sp_id("▁Hello")]);
}

#[test]
fn special_tokens_in_text_and_skipping() {
    let tok = Tokenizer::from_hf_dir(&byte_level_folder("bl_special")).unwrap();
    let ids = tok.encode("<|im_start|>hello<think><|im_end|>", false).unwrap();
    assert_eq!(ids, vec![BL_IM_START, tok.token_to_id("hello").unwrap(), BL_THINK, BL_IM_END]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>hello<think><|im_end|>");
    // Non-special added tokens (<think>) survive skipping, as in HF.
    assert_eq!(tok.decode(&ids, true).unwrap(), "hello<think>");
    assert!(tok.is_special(BL_BOS) && tok.is_special(BL_IM_END));
    assert!(!tok.is_special(BL_THINK) && !tok.is_special(b'a' as u32));
}

#[test]
fn decode_out_of_range_is_an_error() {
    let tok = Tokenizer::from_hf_dir(&byte_level_folder("bl_range")).unwrap();
    let bad = tok.vocab_size() as u32 + 7;
    match tok.decode(&[b'a' as u32, bad], false) {
        Err(Error::TokenOutOfRange { id, vocab_size }) => {
            assert_eq!(id, u64::from(bad));
            assert_eq!(vocab_size, tok.vocab_size());
        }
        other => panic!("expected TokenOutOfRange, got {other:?}"),
    }
    let mut stream = StreamDecoder::new(&tok, false);
    assert!(matches!(stream.push(bad), Err(Error::TokenOutOfRange { .. })));
}

// ---------------------------------------------------------------- streaming

/// Streams `ids` one at a time and checks what a streaming client relies on.
fn check_stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
    let mut stream = StreamDecoder::new(tok, skip_special);
    let mut pieces = Vec::new();
    for &id in ids {
        pieces.push(stream.push(id).unwrap());
    }
    pieces.push(stream.finish().unwrap());
    let full = tok.decode(ids, skip_special).unwrap();
    assert_eq!(pieces.concat(), full, "pieces {pieces:?}");
    if !full.contains('\u{FFFD}') {
        for p in &pieces {
            assert!(!p.contains('\u{FFFD}'), "half a character emitted: {pieces:?}");
        }
    }
    pieces
}

#[test]
fn stream_byte_level_multibyte() {
    let tok = Tokenizer::from_hf_dir(&byte_level_folder("bl_stream")).unwrap();
    let ids = tok.encode(MIXED, false).unwrap();
    // The fixture's merges split characters across tokens: "f\xc3" then "\xa9".
    let f_c3 = tok.token_to_id(&byte_level(b"f\xc3")).unwrap();
    assert!(ids.contains(&f_c3));
    let pieces = check_stream(&tok, &ids, false);
    assert_eq!(pieces.last().unwrap(), "", "nothing should be left for finish");

    // Byte by byte: "😀" is F0 9F 98 80; nothing comes out until the last byte.
    let mut stream = StreamDecoder::new(&tok, false);
    assert_eq!(stream.push(0xF0).unwrap(), "");
    assert_eq!(stream.push(0x9F).unwrap(), "");
    assert_eq!(stream.push(0x98).unwrap(), "");
    assert_eq!(stream.push(0x80).unwrap(), "😀");

    // With special tokens mixed in, skipped or kept.
    let mut ids = vec![BL_BOS];
    ids.extend(tok.encode("你好", false).unwrap());
    ids.push(BL_IM_END);
    ids.extend(tok.encode(" café", false).unwrap());
    ids.push(BL_EOS);
    check_stream(&tok, &ids, true);
    check_stream(&tok, &ids, false);
}

#[test]
fn stream_sentencepiece_spaces_and_bytes() {
    let tok = Tokenizer::from_hf_dir(&sentencepiece_folder("sp_stream")).unwrap();
    // The decoder strips the first token's leading space: "Hello world", not " Hello world".
    let ids = tok.encode("Hello world Hello", false).unwrap();
    let pieces = check_stream(&tok, &ids, false);
    assert_eq!(pieces[..3], ["Hello", " world", " Hello"]);

    let ids = tok.encode(MIXED, true).unwrap();
    check_stream(&tok, &ids, true);
    check_stream(&tok, &ids, false);

    // A space piece on its own and special tokens between words.
    let ids = vec![SP_BOS, sp_id("▁Hello"), sp_id("▁"), SP_END_OF_TURN, sp_id("▁world"), SP_START_OF_TURN, sp_id("▁")];
    check_stream(&tok, &ids, true);
    check_stream(&tok, &ids, false);
}

#[test]
fn stream_invalid_bytes_come_out_at_finish() {
    let tok = Tokenizer::from_hf_dir(&sentencepiece_folder("sp_invalid")).unwrap();
    // A lone lead byte stays held back until finish, which shows it as decode does.
    let mut stream = StreamDecoder::new(&tok, false);
    assert_eq!(stream.push(sp_id("▁Hello")).unwrap(), "Hello");
    assert_eq!(stream.push(3 + 0xE4).unwrap(), "");
    assert_eq!(stream.finish().unwrap(), "\u{FFFD}");
    assert_eq!(stream.finish().unwrap(), "");
    // An invalid byte followed by a complete character is released with it.
    let ids = [3 + 0xE4, sp_id("H"), 3 + 0xC3, 3 + 0xA9];
    let pieces = check_stream(&tok, &ids, false);
    assert_eq!(pieces.concat(), "\u{FFFD}Hé");
}

#[test]
fn stream_with_context_keeps_the_leading_space() {
    let tok = Tokenizer::from_hf_dir(&sentencepiece_folder("sp_context")).unwrap();
    let prompt = tok.encode("Hello", true).unwrap();
    let mut fresh = StreamDecoder::new(&tok, true);
    assert_eq!(fresh.push(sp_id("▁world")).unwrap(), "world");
    let mut cont = StreamDecoder::with_context(&tok, &prompt, true).unwrap();
    assert_eq!(cont.push(sp_id("▁world")).unwrap(), " world");
    assert_eq!(cont.push(3 + 0xC3).unwrap(), "");
    assert_eq!(cont.push(3 + 0xA9).unwrap(), "é");
    assert_eq!(cont.finish().unwrap(), "");
}

// ---------------------------------------------------------------- chat templates

/// Exercises pycompat methods, namespace(), loop controls, raise_exception, HF's tojson and
/// whitespace control. The expected strings were produced by jinja2 3.1 configured as
/// transformers configures it.
const PY_TEMPLATE: &str = r#"{{- bos_token }}
{%- set ns = namespace(system='', turns=0) %}
{%- for m in messages %}
    {%- if m['role'] == 'system' %}
        {%- set ns.system = m.content.strip() %}
        {%- continue %}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if m.role not in ['user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + m.role) }}
    {%- endif %}
<|im_start|>{{ m.role }}
{% if ns.turns == 1 and ns.system %}{{ ns.system.upper() }} | {% endif %}
{{- m.content.strip() }}
{%- if m.content.startswith('Q:') %} [{{ m.content.split(':')[1].lstrip().rstrip('?!') }}]{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
{%- for k, v in {'lang': 'fr'}.items() %}{{ k }}={{ v }};{% endfor %}
{{- {'x': 'é<&>', 'y': [1, 2.5, none, true]} | tojson }}[{{ pad_token }}]{{ eos_token }}{{ tools is none }}
"#;

/// Block tags on their own lines: the output depends on trim_blocks and lstrip_blocks.
const WS_TEMPLATE: &str = "{% for m in messages %}
    {% if m.role == 'user' %}
U: {{ m.content }}
    {% else %}
A: {{ m.content }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
A:
{% endif %}
";

fn conversation() -> Vec<ChatMessage> {
    msgs(&[("system", "  be brief \n"), ("user", "Q: why blue?!"), ("assistant", "Rayleigh.")])
}

/// The byte-level folder with a tokenizer_config.json holding `template`, AddedToken-style
/// and plain special tokens.
fn chat_folder(name: &str, template: Value) -> PathBuf {
    let dir = byte_level_folder(name);
    write_json(
        &dir,
        "tokenizer_config.json",
        &json!({
            "add_bos_token": false,
            "bos_token": {"content": "<|bos|>", "lstrip": false, "normalized": false,
                          "rstrip": false, "single_word": false, "special": true},
            "eos_token": "<|eos|>",
            "pad_token": null,
            "unk_token": "<|bos|>",
            "chat_template": template,
            "model_max_length": 1024
        }),
    );
    dir
}

#[test]
fn chat_template_python_methods() {
    let tok = Tokenizer::from_hf_dir(&chat_folder("chat_py", json!(PY_TEMPLATE))).unwrap();
    assert!(tok.has_chat_template());
    let body = "<|bos|><|im_start|>user\nBE BRIEF | Q: why blue?! [why blue]<|im_end|>\n\
                <|im_start|>assistant\nRayleigh.<|im_end|>\n";
    let tail = "lang=fr;{\"x\": \"é<&>\", \"y\": [1, 2.5, null, true]}[]<|eos|>True";
    assert_eq!(tok.apply_chat_template(&conversation(), true).unwrap(), format!("{body}<|im_start|>assistant\n{tail}"));
    assert_eq!(tok.apply_chat_template(&conversation(), false).unwrap(), format!("{body}{tail}"));
}

#[test]
fn chat_template_whitespace_like_hf() {
    let tok = Tokenizer::from_hf_dir(&chat_folder("chat_ws", json!(WS_TEMPLATE))).unwrap();
    assert_eq!(
        tok.apply_chat_template(&conversation(), true).unwrap(),
        "A:   be brief \n\nU: Q: why blue?!\nA: Rayleigh.\nA:\n"
    );
    assert_eq!(
        tok.apply_chat_template(&conversation(), false).unwrap(),
        "A:   be brief \n\nU: Q: why blue?!\nA: Rayleigh.\n"
    );
}

#[test]
fn chat_template_raise_exception_is_an_error() {
    let dir = chat_folder("chat_raise", json!(PY_TEMPLATE));
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    let err = tok.apply_chat_template(&msgs(&[("tool", "42")]), true).unwrap_err();
    let Error::Template(msg) = &err else { panic!("expected a template error, got {err:?}") };
    assert!(msg.contains("Unknown role: tool"), "{msg}");
    assert!(msg.contains("tokenizer_config.json"), "{msg}");
}

#[test]
fn chat_template_syntax_error_names_the_file_at_render() {
    let dir = byte_level_folder("chat_syntax");
    std::fs::write(dir.join("chat_template.jinja"), "{% for m in messages %}{{ m.content }").unwrap();
    // Loading succeeds: plain prompts do not need the template.
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(tok.encode("hello", false).unwrap().len(), 1);
    let err = tok.apply_chat_template(&conversation(), true).unwrap_err();
    assert!(matches!(&err, Error::Template(m) if m.contains("chat_template.jinja")), "{err}");
}

#[test]
fn chat_template_jinja_file_takes_precedence() {
    let dir = chat_folder("chat_precedence", json!("from config"));
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(tok.apply_chat_template(&[], false).unwrap(), "from config");
    // The file wins; like Jinja2, one trailing newline of the source is dropped.
    std::fs::write(dir.join("chat_template.jinja"), "from file {{ bos_token }}\n").unwrap();
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(tok.apply_chat_template(&[], false).unwrap(), "from file <|bos|>");
}

#[test]
fn chat_template_list_form() {
    let named = json!([
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default"}
    ]);
    let tok = Tokenizer::from_hf_dir(&chat_folder("chat_list_default", named)).unwrap();
    assert_eq!(tok.apply_chat_template(&[], false).unwrap(), "default");
    let unnamed = json!([{"name": "rag", "template": "first"}, {"name": "x", "template": "second"}]);
    let tok = Tokenizer::from_hf_dir(&chat_folder("chat_list_first", unnamed)).unwrap();
    assert_eq!(tok.apply_chat_template(&[], false).unwrap(), "first");
}

#[test]
fn chat_template_strftime_now() {
    let tok = Tokenizer::from_hf_dir(&chat_folder(
        "chat_date",
        json!("{{ strftime_now('%Y') }}|{{ strftime_now('%d %b %Y') }}"),
    ))
    .unwrap();
    let out = tok.apply_chat_template(&[], false).unwrap();
    let (year, date) = out.split_once('|').unwrap();
    assert!(year.len() == 4 && year.parse::<u32>().unwrap() >= 2025, "{out}");
    assert!(date.ends_with(year) && date.len() == 11, "{out}");
}

#[test]
fn encode_chat_does_not_add_a_second_bos() {
    let tok = Tokenizer::from_hf_dir(&chat_folder("chat_encode", json!(PY_TEMPLATE))).unwrap();
    let ids = tok.encode_chat(&conversation(), true).unwrap();
    let text = tok.apply_chat_template(&conversation(), true).unwrap();
    assert_eq!(ids, tok.encode(&text, false).unwrap());
    assert_eq!(ids[0], BL_BOS);
    assert_ne!(ids[1], BL_BOS);
    assert_eq!(ids[1], BL_IM_START);
}

#[test]
fn no_chat_template() {
    let tok = Tokenizer::from_hf_dir(&byte_level_folder("chat_none")).unwrap();
    assert!(!tok.has_chat_template());
    assert!(matches!(tok.apply_chat_template(&conversation(), true), Err(Error::Template(_))));
}

// ---------------------------------------------------------------- special ids

#[test]
fn bos_and_eos_ids() {
    let dir = chat_folder("ids", json!("x"));
    write_json(
        &dir,
        "generation_config.json",
        &json!({"bos_token_id": BL_EOS, "eos_token_id": [BL_EOS, BL_IM_START], "do_sample": true}),
    );
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    // tokenizer_config.json's bos_token wins over generation_config.json's bos_token_id.
    assert_eq!(tok.bos_id(), Some(BL_BOS));
    // Config EOS, then generation config (deduplicated), then the vocabulary's end of turn.
    assert_eq!(tok.eos_ids(), &[BL_EOS, BL_IM_START, BL_IM_END]);

    // A single int in generation_config.json; an explicit null bos_token (Qwen) means none.
    write_json(&dir, "generation_config.json", &json!({"bos_token_id": 7, "eos_token_id": 9}));
    write_json(&dir, "tokenizer_config.json", &json!({"bos_token": null, "eos_token": "<|eos|>"}));
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(tok.bos_id(), None);
    assert_eq!(tok.eos_ids(), &[BL_EOS, 9, BL_IM_END]);

    // Gemma-style: <end_of_turn> joins </s>.
    let tok = Tokenizer::from_hf_dir(&sentencepiece_folder("ids_sp")).unwrap();
    assert_eq!(tok.eos_ids(), &[SP_END_OF_TURN]);
}

#[test]
fn harmony_end_is_not_an_eos() {
    // gpt-oss: <|end|> closes a message inside a turn, <|return|> ends the turn.
    let dir = byte_level_folder("harmony");
    let path = dir.join("tokenizer.json");
    let mut tokenizer: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let extra = [(BL_BOS + 5, "<|end|>"), (BL_BOS + 6, "<|return|>")];
    for (id, content) in extra {
        tokenizer["added_tokens"].as_array_mut().unwrap().push(added_token(id, content, true));
    }
    write_json(&dir, "tokenizer.json", &tokenizer);
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(tok.eos_ids(), &[BL_IM_END, BL_BOS + 6]);

    // Without <|return|>, <|end|> is Phi-3's end of turn.
    tokenizer["added_tokens"].as_array_mut().unwrap().pop();
    write_json(&dir, "tokenizer.json", &tokenizer);
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(tok.eos_ids(), &[BL_IM_END, BL_BOS + 5]);
}

// ---------------------------------------------------------------- bad input

fn error_names(err: &Error, file: &str) {
    let text = err.to_string();
    assert!(text.contains(file), "error does not name {file}: {text}");
}

#[test]
fn missing_tokenizer_json_names_the_path() {
    let dir = folder("missing");
    let err = Tokenizer::from_hf_dir(&dir).err().unwrap();
    assert!(matches!(&err, Error::Tokenizer { path, .. } if path.ends_with("tokenizer.json")));
    error_names(&err, &dir.join("tokenizer.json").display().to_string());
}

#[test]
fn corrupt_files_name_the_file() {
    let dir = folder("corrupt_tokenizer");
    std::fs::write(dir.join("tokenizer.json"), "{\"version\": \"1.0\", \"model\": ").unwrap();
    let err = Tokenizer::from_hf_dir(&dir).err().unwrap();
    error_names(&err, &dir.join("tokenizer.json").display().to_string());

    for file in ["tokenizer_config.json", "generation_config.json"] {
        let dir = byte_level_folder(&format!("corrupt_{file}"));
        std::fs::write(dir.join(file), "{ not json").unwrap();
        let err = Tokenizer::from_hf_dir(&dir).err().unwrap();
        error_names(&err, &dir.join(file).display().to_string());
    }

    let dir = chat_folder("corrupt_template_entry", json!(42));
    let err = Tokenizer::from_hf_dir(&dir).err().unwrap();
    error_names(&err, "tokenizer_config.json");
}

// ---------------------------------------------------------------- real fixtures

fn read_reference(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect()
}

/// The checkpoints of fixtures/tiny, made by scripts/make_fixtures.py with transformers:
/// our encoding of the reference sentence, our rendering of each reference conversation and
/// its ids, and the template's error for a bad role must all match what transformers gave.
#[test]
fn fixture_checkpoints_match_transformers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny");
    let entries = std::fs::read_dir(&root).unwrap_or_else(|e| panic!("{}: {e}", root.display()));
    let mut dirs: Vec<PathBuf> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
    dirs.retain(|d| d.join("tokenizer.json").exists());
    dirs.sort();
    assert!(!dirs.is_empty());
    for dir in dirs {
        let name = dir.display().to_string();
        let tok = Tokenizer::from_hf_dir(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));

        let reference = read_reference(&dir.join("reference.json"));
        let text = reference["text"].as_str().unwrap();
        let text_ids = ids_of(&reference["text_ids"]);
        assert_eq!(tok.encode(text, true).unwrap(), text_ids, "{name}");
        assert_eq!(tok.decode(&text_ids, true).unwrap(), text, "{name}");
        check_stream(&tok, &text_ids, true);
        check_stream(&tok, &text_ids, false);
        let ids = tok.encode(MIXED, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), MIXED, "{name}");
        check_stream(&tok, &ids, false);

        // generation_config.json's eos_token_id (an int or a list) must all end generation.
        let eos = &read_reference(&dir.join("generation_config.json"))["eos_token_id"];
        let eos = if eos.is_array() { ids_of(eos) } else { ids_of(&json!([eos])) };
        for id in eos {
            assert!(tok.eos_ids().contains(&id), "{name}: {id} not in {:?}", tok.eos_ids());
        }

        assert!(tok.has_chat_template(), "{name}");
        let chat = read_reference(&dir.join("chat_reference.json"));
        for case in chat["cases"].as_array().unwrap() {
            let messages: Vec<ChatMessage> = case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
                .collect();
            let agp = case["add_generation_prompt"].as_bool().unwrap();
            let rendered = tok.apply_chat_template(&messages, agp).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(rendered, case["rendered"].as_str().unwrap(), "{name}");
            assert_eq!(tok.encode_chat(&messages, agp).unwrap(), ids_of(&case["ids"]), "{name}");
        }
        let err = tok.apply_chat_template(&msgs(&[("narrator", "x")]), false).unwrap_err();
        let want = chat["bad_role_raises"].as_str().unwrap();
        assert!(matches!(&err, Error::Template(m) if m.contains(want)), "{name}: {err}");
    }
}

/// The tokenizer.json files that once made the `tokenizers` crate panic (found by fuzzing,
/// fuzz/regressions/tokenizer_json: a decoder whose JSON does not parse, an invalid \u
/// escape, a template naming a special token it does not define) are refused at load,
/// with an error that names the file.
#[test]
fn fuzzed_tokenizer_json_is_refused_at_load() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions/tokenizer_json");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    assert!(files.len() >= 3, "{}: expected the regression inputs", root.display());
    for file in files {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzzed-tokenizer");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(&file, dir.join("tokenizer.json")).unwrap();
        let err = Tokenizer::from_hf_dir(&dir).err().unwrap_or_else(|| panic!("{} was accepted", file.display()));
        assert!(err.to_string().contains("tokenizer.json"), "{}: {err}", file.display());
        eprintln!("{}: {err}", file.display());
    }
}

/// A chat template is code from a model's files, rendered on every request: it runs on a
/// budget of steps and of output. A loop that does not end and a template that writes
/// gigabytes each stop with an error naming the template, in seconds; the real templates
/// of the fixtures render a 2000-message conversation with tools well within the budget.
#[test]
fn templates_render_on_a_bounded_budget() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny");
    let mut tok = Tokenizer::from_hf_dir(&fixtures.join("qwen3")).unwrap();
    let hi = [ChatMessage::new("user", "hi")];

    let forever = "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}";
    tok.set_chat_template("forever.jinja", forever.into());
    let t = std::time::Instant::now();
    let err = tok.apply_chat_template(&hi, true).unwrap_err().to_string();
    assert!(err.contains("forever.jinja") && err.contains("fuel"), "{err}");
    assert!(t.elapsed().as_secs() < 20, "the loop ran {:?}", t.elapsed());

    let huge = "{% for i in range(1000) %}{{ 'x' * 99999999 }}{% endfor %}";
    tok.set_chat_template("huge.jinja", huge.into());
    let err = tok.apply_chat_template(&hi, true).unwrap_err().to_string();
    assert!(err.contains("huge.jinja") && err.contains("MiB"), "{err}");

    // Repeating an empty sequence iterates inside minijinja without spending fuel (found
    // by fuzzing: this one would run for hours); the render is given up on its clock,
    // and the template is not run again.
    let spin = "{{ ()*6*544*544*5*544 }}";
    tok.set_chat_template("spin.jinja", spin.into());
    let t = std::time::Instant::now();
    let err = tok.apply_chat_template(&hi, true).unwrap_err().to_string();
    assert!(err.contains("spin.jinja") && err.contains("did not finish"), "{err}");
    assert!(t.elapsed().as_secs() < 20, "the render ran {:?}", t.elapsed());
    let err = tok.apply_chat_template(&hi, true).unwrap_err().to_string();
    assert!(err.contains("not run again"), "{err}");

    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let long: Vec<ChatMessage> = (0..2000)
        .map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, format!("message {i}")))
        .collect();
    for name in ["qwen3", "gpt-oss", "deepseek-v3", "gemma4-moe", "llama"] {
        let tok = Tokenizer::from_hf_dir(&fixtures.join(name)).unwrap();
        let prompt =
            tok.apply_chat_template_with_tools(&long, Some(&tools), true).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(prompt.contains("message 1999"), "{name}");
    }
}
