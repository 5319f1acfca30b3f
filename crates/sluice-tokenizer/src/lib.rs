//! One tokenizer for every model source: text to ids and back, the chat template, and
//! streamed detokenizing.
//!
//! Two sources: a Hugging Face folder (`tokenizer.json` and its configs,
//! [`Tokenizer::from_hf_dir`]) and a GGUF file's `tokenizer.ggml.*` metadata
//! ([`Tokenizer::from_gguf`], which rebuilds in memory the `tokenizers::Tokenizer` that
//! transformers builds from the same file). Both fill an `Extras` (BOS/EOS ids, the chat
//! template and its token variables) and end in `Tokenizer::assemble`; nothing above that
//! line knows where the vocabulary came from.

mod gguf;
mod stop;
mod stream;
mod template;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use minijinja::Value;
use sluice_core::{Error, Result};

pub use stop::StopText;
pub use stream::StreamDecoder;
pub use template::civil_from_days;
use template::{ChatTemplate, TemplateSource};

/// One message of a conversation, as chat templates expect it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant's calls of tools, in OpenAI's form (`[{"type": "function",
    /// "function": {"name", "arguments"}}]`), as templates that know tools read them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool result's call id and the tool's name (role `tool`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into(), tool_calls: None, tool_call_id: None, name: None }
    }
}

/// How a model without a chat template (a base model, never trained on turn markers)
/// is asked to chat: as a plain transcript, which pre-training text is full of, ending
/// in `Assistant:`; its reply ends where it starts the user's next line
/// ([`TRANSCRIPT_STOP`]), as llama.cpp's chat examples for base models do with a
/// reverse prompt. (The family's turn markers, where the vocabulary has them, made the
/// base gemma-3-270m repeat the question; the transcript gets its answer.)
pub const TRANSCRIPT_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}\
{% if m.role == 'system' %}{{ m.content }}{{ '\\n\\n' }}\
{% elif m.role == 'user' %}User: {{ m.content }}{{ '\\n' }}\
{% else %}Assistant: {{ m.content | trim }}{{ '\\n' }}{% endif %}{% endfor %}\
{% if add_generation_prompt %}Assistant:{% endif %}";
/// Where a transcript's reply ends.
pub const TRANSCRIPT_STOP: &str = "\nUser:";

/// Tokens that end a turn in the chat formats we know. Many models list only their base
/// EOS (`<|endoftext|>`, `<eos>`) in the config, but an instruct model ends its answer with
/// the turn marker; stopping only at EOS would run on into a hallucinated next turn.
const END_OF_TURN_TOKENS: &[&str] = &[
    "<end_of_turn>", // Gemma 2/3
    "<turn|>",       // Gemma 4
    "<|im_end|>",    // ChatML: Qwen, SmolLM
    "<|eot_id|>",    // Llama 3
    "<|end|>",       // Phi-3; in gpt-oss's harmony format it is not the end (see below)
    "<|return|>",    // gpt-oss
];

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The file the vocabulary came from, named in errors.
    source: PathBuf,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    /// Ids that `decode(.., skip_special = true)` drops.
    special_ids: HashSet<u32>,
    template: Option<ChatTemplate>,
    /// The `*_token` template variables, kept for a template set later.
    template_tokens: Vec<(String, Value)>,
}

/// What a vocabulary source says besides the vocabulary: HF folders take it from
/// tokenizer_config.json and generation_config.json, a GGUF file from its metadata.
struct Extras {
    bos_id: Option<u32>,
    /// End-of-generation ids the source names; end-of-turn tokens are added to these.
    eos_ids: Vec<u32>,
    /// `bos_token`, `eos_token`, ... as template variables.
    template_tokens: Vec<(String, Value)>,
    template: Option<TemplateSource>,
}

/// A `TemplateProcessing` post-processor (alone or in a `Sequence`) must define every
/// special token its templates name: the crate reads one it lacks with an `expect` when
/// it encodes (found by fuzzing), long after loading. The crate tells processors apart
/// by their fields, not their `type` (a misspelt type still loads as a template; found
/// by fuzzing too), so neither does this check.
fn check_templates(p: &serde_json::Value) -> std::result::Result<(), String> {
    if let Some(inner) = p.get("processors").and_then(|v| v.as_array()) {
        inner.iter().try_for_each(check_templates)?;
    }
    let defined = p.get("special_tokens").and_then(|v| v.as_object());
    let pieces = ["single", "pair"].into_iter().filter_map(|k| p.get(k)?.as_array()).flatten();
    for piece in pieces {
        let Some(id) = piece.get("SpecialToken").and_then(|s| s.get("id")).and_then(|i| i.as_str()) else {
            continue;
        };
        if !defined.is_some_and(|d| d.contains_key(id)) {
            return Err(format!(
                "the post-processor's template uses the special token {id:?}, which its special_tokens do not define"
            ));
        }
    }
    Ok(())
}

/// `tokenizer.json` through the `tokenizers` crate. Its deserializers panic on some
/// malformed files (`expect("Helper")` on a decoder whose JSON does not parse: a control
/// character, an invalid \u escape; found by fuzzing), so the text is parsed as JSON
/// first, for an error with its line and column, and a panic that still comes out of
/// the crate is turned into an error.
fn parse_tokenizer_json(path: &Path, bytes: &[u8]) -> Result<tokenizers::Tokenizer> {
    let json = serde_json::from_slice::<serde_json::Value>(bytes)
        .map_err(|e| Error::tokenizer(path, format!("not valid JSON: {e}")))?;
    if let Some(p) = json.get("post_processor") {
        check_templates(p).map_err(|e| Error::tokenizer(path, e))?;
    }
    match std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(bytes)) {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(Error::tokenizer(path, format!("cannot parse: {e}"))),
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Err(Error::tokenizer(path, format!("cannot parse (the tokenizers crate failed: {why})")))
        }
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` (optional), `chat_template.jinja`
    /// (optional), `generation_config.json` (optional) from a Hugging Face model folder.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let tokenizer_path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&tokenizer_path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                Error::tokenizer(&tokenizer_path, "not found (a Hugging Face model folder needs tokenizer.json)")
            }
            _ => Error::io(&tokenizer_path, e),
        })?;
        let mut inner = parse_tokenizer_json(&tokenizer_path, &bytes)?;
        // Some tokenizer.json files carry the truncation and padding of a training run.
        // transformers turns both off unless a call asks for them, and so do we.
        inner.with_truncation(None).map_err(|e| Error::tokenizer(&tokenizer_path, e.to_string()))?;
        inner.with_padding(None);

        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path)?
            .map(|v| match v {
                serde_json::Value::Object(map) => Ok(map),
                _ => Err(Error::tokenizer(&config_path, "expected a JSON object")),
            })
            .transpose()?
            .unwrap_or_default();
        let generation_path = dir.join("generation_config.json");
        let generation = read_json(&generation_path)?;

        let token_id = |v: &serde_json::Value| token_content(v).and_then(|s| inner.token_to_id(s));
        let gen_ids = |key: &str| -> Vec<u32> {
            match generation.as_ref().and_then(|g| g.get(key)) {
                Some(serde_json::Value::Array(items)) => items.iter().filter_map(json_u32).collect(),
                Some(v) => json_u32(v).into_iter().collect(),
                None => Vec::new(),
            }
        };

        // An explicit `"bos_token": null` (Qwen) means no BOS even where
        // generation_config.json names one; only a config that is silent defers to it.
        let bos_id = match config.get("bos_token") {
            Some(v) => token_id(v),
            None => gen_ids("bos_token_id").first().copied(),
        };
        let mut eos_ids: Vec<u32> = config.get("eos_token").and_then(token_id).into_iter().collect();
        eos_ids.extend(gen_ids("eos_token_id"));

        // HF passes `special_tokens_map` to templates: every special token attribute that
        // is set. Configs name them `*_token` (and newer ones add image_token, boi_token,
        // ...), each a string or an AddedToken object.
        let mut template_tokens: Vec<(String, Value)> = config
            .iter()
            .filter(|(key, _)| key.ends_with("_token"))
            .filter_map(|(key, v)| Some((key.clone(), Value::from(token_content(v)?))))
            .collect();
        if let Some(serde_json::Value::Array(items)) = config.get("additional_special_tokens") {
            let items: Vec<&str> = items.iter().filter_map(token_content).collect();
            template_tokens.push(("additional_special_tokens".into(), Value::from_serialize(items)));
        }

        let template = find_template(dir, &config_path, &config)?;
        Tokenizer::assemble(inner, tokenizer_path, Extras { bos_id, eos_ids, template_tokens, template })
    }

    /// Puts a vocabulary and what its source says about it together; every source ends here.
    fn assemble(inner: tokenizers::Tokenizer, source: PathBuf, extras: Extras) -> Result<Tokenizer> {
        let special_ids: HashSet<u32> =
            inner.get_added_tokens_decoder().into_iter().filter(|(_, token)| token.special).map(|(id, _)| id).collect();

        let mut eos_ids: Vec<u32> = Vec::new();
        let mut add = |id: u32| {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        };
        extras.eos_ids.iter().copied().for_each(&mut add);
        // In gpt-oss's harmony format `<|end|>` closes each message of a turn (the reasoning
        // before the answer, for one), and `<|return|>` closes the turn; stopping at
        // `<|end|>` would cut the answer off after the reasoning.
        let harmony = inner.token_to_id("<|return|>").is_some();
        for token in END_OF_TURN_TOKENS {
            if harmony && *token == "<|end|>" {
                continue;
            }
            if let Some(id) = inner.token_to_id(token) {
                add(id);
            }
        }

        let template_tokens = extras.template_tokens;
        let template = extras.template.map(|source| ChatTemplate::new(source, template_tokens.clone()));
        Ok(Tokenizer { inner, source, bos_id: extras.bos_id, eos_ids, special_ids, template, template_tokens })
    }

    /// Encodes text; `add_special` adds what the tokenizer's post-processor adds (e.g. BOS),
    /// as HF's `add_special_tokens=True`. Special tokens written in the text (`<|im_start|>`)
    /// are always recognized, as in HF.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special)
            .map_err(|e| Error::tokenizer(&self.source, format!("cannot encode: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        for &id in ids {
            self.check_id(id)?;
        }
        self.decode_unchecked(ids, skip_special)
    }

    /// With added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes each id stands for, by id: what constrained decoding matches grammars
    /// against. A byte-level BPE vocabulary (GPT-2's, Llama 3's, Qwen's: its space is
    /// `Ġ`) maps each character back to its byte; a SentencePiece one reads `▁` as a
    /// space and `<0xAB>` as that byte. Special tokens are 0xFF then their text, the
    /// convention of the `toktrie` crate, so that no text can match them.
    pub fn token_bytes(&self) -> Vec<Vec<u8>> {
        let n = self.vocab_size() as u32;
        let byte_level = self.inner.token_to_id("\u{120}").is_some();
        let unbyte = byte_level_inverse();
        (0..n)
            .map(|id| {
                let Some(tok) = self.inner.id_to_token(id) else { return Vec::new() };
                if self.special_ids.contains(&id) {
                    let mut v = vec![0xff];
                    v.extend(tok.as_bytes());
                    return v;
                }
                if byte_level {
                    let bytes: Option<Vec<u8>> =
                        tok.chars().map(|c| unbyte.get(c as usize).copied().flatten()).collect();
                    return bytes.unwrap_or_else(|| tok.into_bytes());
                }
                let hex = tok.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
                match hex.filter(|h| h.len() == 2).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => vec![b],
                    None => tok.replace('\u{2581}', " ").into_bytes(),
                }
            })
            .collect()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// All ids that end generation: eos_token from tokenizer_config.json, eos_token_id (int
    /// or list) from generation_config.json, plus the end-of-turn tokens of the chat formats
    /// we know (`<end_of_turn>`, `<turn|>`, `<|im_end|>`, `<|eot_id|>`, `<|end|>`,
    /// `<|return|>`) that exist in the vocabulary; `<|end|>` only where there is no
    /// `<|return|>`, since in gpt-oss's format it separates messages within one turn.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` is a special added token, i.e. one that `decode(.., true)` drops.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Replaces the chat template (a user's `--chat-template` file, or a built-in one for
    /// a model that ships none). `name` is what errors call it.
    pub fn set_chat_template(&mut self, name: &str, text: String) {
        let tokens = self.template_tokens.clone();
        self.template = Some(ChatTemplate::new(TemplateSource { name: name.to_string(), text }, tokens));
    }

    /// Makes sure there is a chat template: `file` if given, else the model's own, else
    /// the plain transcript ([`TRANSCRIPT_TEMPLATE`]), whose stop string is then returned
    /// (generation must end where the model starts the user's next line).
    pub fn ensure_chat_template(&mut self, file: Option<&Path>) -> Result<Option<&'static str>> {
        if let Some(f) = file {
            let text = std::fs::read_to_string(f).map_err(|e| Error::io(f, e))?;
            self.set_chat_template(&f.display().to_string(), text);
            return Ok(None);
        }
        if self.has_chat_template() {
            return Ok(None);
        }
        self.set_chat_template("built-in transcript template", TRANSCRIPT_TEMPLATE.to_string());
        Ok(Some(TRANSCRIPT_STOP))
    }

    /// Every id that ends generation: [`Tokenizer::eos_ids`] and the model's own
    /// (`extra`, from its config), sorted, once each.
    pub fn stop_ids(&self, extra: &[u32]) -> Vec<u32> {
        let mut ids: Vec<u32> = self.eos_ids.clone();
        ids.extend(extra);
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Renders the chat template (HF semantics: messages, add_generation_prompt, bos_token,
    /// eos_token, plus any other *_token strings from tokenizer_config.json, or bos, eos, unk
    /// and pad from a GGUF file's ids) to a string.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Tokenizer::apply_chat_template`] with the `tools` variable set (OpenAI's list
    /// of `{"type": "function", "function": {...}}`), as HF's `tools=` argument does.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.template.as_ref().ok_or_else(|| {
            Error::Template(if self.source.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
                format!("{} has no chat template (no tokenizer.chat_template in its metadata)", self.source.display())
            } else {
                format!(
                    "the model in {} has no chat template (no chat_template.jinja, and none in \
                     tokenizer_config.json)",
                    self.source.parent().unwrap_or(&self.source).display()
                )
            })
        })?;
        template.render(messages, tools, add_generation_prompt)
    }

    /// Encodes a rendered chat prompt. The template already wrote BOS and every other
    /// marker, so, as HF does, this encodes with add_special_tokens=False.
    pub fn encode_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<Vec<u32>> {
        let prompt = self.apply_chat_template(messages, add_generation_prompt)?;
        self.encode(&prompt, false)
    }

    /// `tokenizers` silently drops ids it does not know; we refuse them instead, since an
    /// id outside the vocabulary means a model/tokenizer mismatch.
    pub(crate) fn check_id(&self, id: u32) -> Result<()> {
        match self.inner.id_to_token(id) {
            Some(_) => Ok(()),
            None => Err(Error::TokenOutOfRange { id: u64::from(id), vocab_size: self.vocab_size() }),
        }
    }

    pub(crate) fn decode_unchecked(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| Error::tokenizer(&self.source, format!("cannot decode: {e}")))
    }
}

/// Reads an optional JSON file: `None` when it does not exist, an error naming it when it
/// exists but cannot be read or parsed.
fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    serde_json::from_str(&text).map(Some).map_err(|e| Error::tokenizer(path, format!("invalid JSON: {e}")))
}

/// A special token in a config: a plain string or an AddedToken object `{"content": ...}`.
fn token_content(v: &serde_json::Value) -> Option<&str> {
    match v {
        serde_json::Value::String(s) => Some(s),
        serde_json::Value::Object(map) => map.get("content")?.as_str(),
        _ => None,
    }
}

fn json_u32(v: &serde_json::Value) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

/// Finds the chat template the way transformers does: a `chat_template.jinja` file wins
/// over `chat_template` in tokenizer_config.json (a string, or a list of `{name, template}`
/// of which "default" is used, else the first). Processor folders (Gemma 3 and other
/// multimodal models) may keep it in `chat_template.json` instead.
fn find_template(
    dir: &Path,
    config_path: &Path,
    config: &serde_json::Map<String, serde_json::Value>,
) -> Result<Option<TemplateSource>> {
    let jinja_path = dir.join("chat_template.jinja");
    match std::fs::read_to_string(&jinja_path) {
        Ok(text) => {
            return Ok(Some(TemplateSource { name: jinja_path.display().to_string(), text }));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(&jinja_path, e)),
    }

    if let Some(entry) = config.get("chat_template") {
        let bad =
            || Error::tokenizer(config_path, "chat_template must be a string or a list of {name, template} objects");
        let (which, text) = match entry {
            serde_json::Value::String(text) => (None, text.as_str()),
            serde_json::Value::Array(list) => {
                let named = |want: Option<&str>| {
                    list.iter().find(|item| want.is_none_or(|w| item.get("name").and_then(|n| n.as_str()) == Some(w)))
                };
                let item = named(Some("default")).or_else(|| named(None)).ok_or_else(bad)?;
                let text = item.get("template").and_then(|t| t.as_str()).ok_or_else(bad)?;
                (item.get("name").and_then(|n| n.as_str()), text)
            }
            serde_json::Value::Null => return Ok(None),
            _ => return Err(bad()),
        };
        let name = match which {
            Some(which) => format!("{} (chat_template '{which}')", config_path.display()),
            None => format!("{} (chat_template)", config_path.display()),
        };
        return Ok(Some(TemplateSource { name, text: text.to_string() }));
    }

    let json_path = dir.join("chat_template.json");
    if let Some(value) = read_json(&json_path)? {
        let text = value
            .get("chat_template")
            .and_then(|t| t.as_str())
            .ok_or_else(|| Error::tokenizer(&json_path, "no chat_template string"))?;
        return Ok(Some(TemplateSource { name: json_path.display().to_string(), text: text.to_string() }));
    }
    Ok(None)
}

/// GPT-2's byte-level alphabet read backwards: the byte each of its characters stands
/// for, by code point. Printable bytes are their own character; the others (0-32,
/// 127-160, 173) were moved to 256 and up, in order.
fn byte_level_inverse() -> Vec<Option<u8>> {
    let mut inv = vec![None; 512];
    let mut moved = 0;
    for b in 0..=255u8 {
        let printable = matches!(b, 33..=126 | 161..=172 | 174..=255);
        let c = if printable {
            b as usize
        } else {
            moved += 1;
            255 + moved
        };
        inv[c] = Some(b);
    }
    inv
}
