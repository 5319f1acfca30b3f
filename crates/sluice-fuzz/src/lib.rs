//! The parsers sluice runs on files and text from outside, as fuzz targets: each takes
//! arbitrary bytes and must return (an error is fine) without panicking, aborting,
//! hanging or allocating more than the input justifies. `fuzz/` drives them with
//! `cargo fuzz` (libFuzzer, coverage-guided); `tests/corpus.rs` runs each over its seeds
//! (`fuzz/seeds`) and the inputs that once failed (`fuzz/regressions`) on every test run.
//!
//! The readers take paths, as sluice does, so each input is first written to a scratch
//! file (in `/dev/shm` where there is one): what is fuzzed is the code a user's file
//! reaches, not a bytes-only twin of it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use sluice_formats::Checkpoint;
use sluice_formats::gguf::GgufFile;
use sluice_tokenizer::{ChatMessage, Tokenizer};

/// One fuzz target: a parser and what is done with what it accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// A GGUF file: header, metadata, tensor infos, alignment, every type; then the
    /// model description (`ModelSpec`) and the family's tensor rearrangements, and the
    /// vocabulary and chat template it carries.
    Gguf,
    /// One `.safetensors` file: its header and its tensors' extents.
    Safetensors,
    /// A Hugging Face `config.json` into a `ModelSpec`, for every family.
    HfConfig,
    /// A Hugging Face `tokenizer.json`, then encoding and decoding with it.
    TokenizerJson,
    /// A chat template (Jinja from a model's files is code) rendered with hostile messages.
    ChatTemplate,
    /// The manifest of a packed folder (`sluice-pack.json`: the expert layout, offsets
    /// and sizes into `experts.bin`), checked against a real packed model's files.
    PackManifest,
    /// A request to `sluice serve` (the Qwen3 fixture behind it): the first byte picks
    /// the route, the rest is the body. Every route of OpenAI's, Anthropic's and Ollama's
    /// APIs; the answer must be a status and a body, whatever was asked.
    ServerRequest,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Gguf,
        Target::Safetensors,
        Target::HfConfig,
        Target::TokenizerJson,
        Target::ChatTemplate,
        Target::PackManifest,
        Target::ServerRequest,
    ];

    /// The name of its folders under `fuzz/` and of its `cargo fuzz` target.
    pub fn name(self) -> &'static str {
        match self {
            Target::Gguf => "gguf",
            Target::Safetensors => "safetensors",
            Target::HfConfig => "hf_config",
            Target::TokenizerJson => "tokenizer_json",
            Target::ChatTemplate => "chat_template",
            Target::PackManifest => "pack_manifest",
            Target::ServerRequest => "server_request",
        }
    }

    /// The target of that name (`Target::name`).
    pub fn named(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Runs the target on one input. Errors are the expected outcome of most inputs and
    /// are dropped; anything else (a panic, an abort, a hang) is a finding.
    pub fn run(self, data: &[u8]) {
        match self {
            Target::Gguf => gguf(data),
            Target::Safetensors => safetensors(data),
            Target::HfConfig => hf_config(data),
            Target::TokenizerJson => tokenizer_json(data),
            Target::ChatTemplate => chat_template(data),
            Target::PackManifest => pack_manifest(data),
            Target::ServerRequest => server_request(data),
        }
    }
}

/// This process's scratch folder, made once.
/// The Qwen3 fixture, which the template and server targets stand on. `SLUICE_FUZZ_FIXTURES`
/// names the `fixtures/tiny` folder where the binary runs away from the tree it was built
/// in (`scripts/fuzz_device.sh`).
fn qwen3_fixture() -> PathBuf {
    match std::env::var_os("SLUICE_FUZZ_FIXTURES") {
        Some(dir) => PathBuf::from(dir).join("qwen3"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny/qwen3"),
    }
}

fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
        let dir = base.join(format!("sluice-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("cannot make the fuzz scratch folder");
        dir
    })
}

/// Writes `data` as `name` in the scratch folder.
fn put(name: &str, data: &[u8]) -> PathBuf {
    let path = scratch().join(name);
    std::fs::write(&path, data).expect("cannot write to the fuzz scratch folder");
    path
}

/// Messages a hostile client could send, for templates to render.
fn hostile_messages() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "{{ raise_exception('x') }}{% for i in range(999999999) %}"),
        ChatMessage::new("user", "<|im_start|>assistant\n\u{0}\u{fffd}\u{202e}"),
        ChatMessage::new("assistant", "x".repeat(4096)),
        ChatMessage::new("tool", "{\"a\": [1, 2, {\"b\": null}]}"),
        ChatMessage::new("user", ""),
    ]
}

/// Uses a tokenizer the way sluice does: encode, decode, stream, render.
fn exercise(tok: &Tokenizer) {
    let text = "Hello world! <|im_start|>user\n\u{1F600} ÿ\u{0}\t  \n\n12345 <s></s>";
    if let Ok(ids) = tok.encode(text, true) {
        let _ = tok.decode(&ids, false);
        let _ = tok.decode(&ids, true);
    }
    let n = tok.vocab_size().min(512) as u32;
    let ids: Vec<u32> = (0..n).chain([u32::MAX, n + 7]).collect();
    let _ = tok.decode(&ids, false);
    let _ = tok.token_bytes();
    let _ = tok.stop_ids(&[]);
    if tok.has_chat_template() {
        let _ = tok.apply_chat_template(&hostile_messages(), true);
    }
}

fn gguf(data: &[u8]) {
    let path = put("model.gguf", data);
    if let Ok(ckpt) = Checkpoint::open(&path) {
        // Every tensor the checkpoint names must lie within the file.
        for t in ckpt.tensors() {
            std::hint::black_box(t.bytes().len());
        }
    }
    if let Ok(file) = GgufFile::open(&path)
        && let Ok(tok) = Tokenizer::from_gguf(&file)
    {
        exercise(&tok);
    }
}

fn safetensors(data: &[u8]) {
    let path = put("model.safetensors", data);
    if let Ok(t) = sluice_formats::safetensors::read_file(&path) {
        for v in t.tensors.values() {
            std::hint::black_box(v.bytes().len());
        }
        for b in t.bytes.values() {
            std::hint::black_box(b.bytes().len());
        }
    }
}

fn hf_config(data: &[u8]) {
    let dir = scratch().join("hf_config");
    std::fs::create_dir_all(&dir).expect("cannot write to the fuzz scratch folder");
    std::fs::write(dir.join("config.json"), data).expect("cannot write to the fuzz scratch folder");
    if let Ok(cfg) = sluice_formats::hf_config::read(&dir) {
        std::hint::black_box(format!("{:?}", cfg.spec));
    }
}

fn tokenizer_json(data: &[u8]) {
    let dir = scratch().join("tokenizer_json");
    std::fs::create_dir_all(&dir).expect("cannot write to the fuzz scratch folder");
    std::fs::write(dir.join("tokenizer.json"), data).expect("cannot write to the fuzz scratch folder");
    if let Ok(tok) = Tokenizer::from_hf_dir(&dir) {
        exercise(&tok);
    }
}

thread_local! {
    /// A real vocabulary (the Qwen3 fixture's) that each input's chat template is set on.
    static TEMPLATE_HOST: std::cell::RefCell<Tokenizer> = std::cell::RefCell::new({
        let dir = qwen3_fixture();
        Tokenizer::from_hf_dir(&dir).unwrap_or_else(|e| panic!("the fuzz targets need {}: {e}", dir.display()))
    });
}

fn chat_template(data: &[u8]) {
    TEMPLATE_HOST.with_borrow_mut(|tok| {
        tok.set_chat_template("fuzz.jinja", String::from_utf8_lossy(data).into_owned());
        let messages = hostile_messages();
        let _ = tok.apply_chat_template(&messages, true);
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f{{x}}", "parameters": {}}}]);
        let _ = tok.apply_chat_template_with_tools(&messages, Some(&tools), false);
    });
}

/// A packed folder of a tiny synthetic MoE (`sluice synth --geometry tiny-moe --layers 2
/// --packed`), written once per process; its manifest is what the fuzzer writes.
fn packed_folder() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        use sluice_formats::synth::{Geometry, Synth, SynthOptions};
        let dir = scratch().join("packed");
        let _ = std::fs::remove_dir_all(&dir);
        let geometry = Geometry::named("tiny-moe").and_then(|g| g.with_layers(2).ok()).expect("tiny-moe geometry");
        let opts =
            SynthOptions { geometry, quant: sluice_core::DType::Q4K, skew: 0.0, seed: 0, tuning: Default::default() };
        Synth::new(opts).and_then(|s| s.write_packed(&dir, &|_| {})).expect("cannot write the packed folder");
        dir
    })
}

fn pack_manifest(data: &[u8]) {
    let dir = packed_folder();
    std::fs::write(dir.join(sluice_formats::pack::MANIFEST), data).expect("cannot write to the fuzz scratch folder");
    if let Ok(ckpt) = Checkpoint::open(dir) {
        for t in ckpt.tensors() {
            std::hint::black_box(t.bytes().len());
        }
    }
}

/// The routes a request may take: its method and path.
const ROUTES: [(&str, &str); 12] = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/api/chat"),
    ("POST", "/api/generate"),
    ("POST", "/api/show"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/fuzz"),
    ("GET", "/api/tags"),
    ("GET", "/metrics"),
    ("GET", "/health"),
    ("POST", "/v1/embeddings"),
];

/// A server over the Qwen3 fixture, started once per process, its context cut to 256
/// tokens so that no request can make an input slow.
fn server() -> &'static sluice_server::InProcess {
    static SERVER: OnceLock<sluice_server::InProcess> = OnceLock::new();
    SERVER.get_or_init(|| {
        let dir = qwen3_fixture();
        let mut model = sluice_engine::Model::open(&dir).expect("the Qwen3 fixture loads");
        model.max_context = model.max_context.min(256);
        let tok = Tokenizer::from_hf_dir(&dir).expect("the Qwen3 fixture's tokenizer loads");
        let cfg = sluice_server::ServeConfig {
            host: "127.0.0.1".into(),
            port: 0,
            api_key: None,
            name: "fuzz".into(),
            max_body_bytes: 1 << 20,
            body_timeout: std::time::Duration::from_secs(5),
            limits: sluice_server::Limits { parallel: 4, max_queue: 8, step_rows: 32, prefix_cache_bytes: 1 << 20 },
            chat_stop: None,
            info: Default::default(),
        };
        sluice_server::InProcess::new(model, tok, cfg).expect("the in-process server starts")
    })
}

fn server_request(data: &[u8]) {
    let Some((&route, body)) = data.split_first() else { return };
    let (method, path) = ROUTES[route as usize % ROUTES.len()];
    let (status, _) = server().request(method, path, body.to_vec());
    // An answer, never a failure of the server's own: a 500 is a bug found.
    assert!(status != 500, "{method} {path} answered 500");
}
