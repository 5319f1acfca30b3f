//! Tokenizers from GGUF metadata, the `tokenizer.ggml.*` keys llama.cpp writes.
//!
//! A GGUF file has no `tokenizer.json`: it stores the vocabulary, the merges (or SentencePiece
//! scores), each token's type and the special ids as metadata. The reference for what they
//! mean is the tokenizer Hugging Face transformers builds from the same file
//! (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`, in
//! `integrations/gguf/gguf_tokenizer_mapping.py`), since that is what the reference model was
//! fed. This module rebuilds the same `tokenizers` pipeline in memory, so encoding and
//! decoding are shared with the Hugging Face path:
//!
//! - `gpt2` (byte-level BPE: SmolLM, Qwen, Llama 3, gpt-oss): the vocabulary in GPT-2's byte
//!   alphabet, the file's merges, and a split regex chosen by `tokenizer.ggml.pre`;
//! - `llama` (SentencePiece-style BPE with byte fallback): Llama 2 and Mistral prepend "▁" to
//!   the text (unless `add_space_prefix` is false, where we follow llama.cpp; transformers
//!   ignores that key); the Gemma 1-3 architectures replace spaces with "▁" and prepend
//!   nothing, and their files carry no merges, so the merges are rebuilt from the vocabulary
//!   in its order; Phi-3 prepends with a normalizer; where a file has no merges they are
//!   rebuilt from the scores;
//! - `gemma4`: Gemma's pipeline with the file's merges and no BOS added.
//!
//! Control tokens (`token_type` 3) become special added tokens, user-defined ones (4) plain
//! added tokens, both matched whole in text as llama.cpp matches them.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use minijinja::Value;
use sluice_core::{Error, Result};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::normalizers::{NFC, NormalizerWrapper, Prepend, Replace};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::template::TemplateSource;
use crate::{Extras, Tokenizer};

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// Everything a GGUF file says about its tokenizer, read out of the metadata first so that
/// building the tokenizer does not depend on how the file is parsed (and tests can write one
/// by hand). Keys are `tokenizer.ggml.<field>` unless noted.
#[derive(Clone, Debug, Default)]
pub(crate) struct GgufVocab<'a> {
    /// The file, named in every error.
    pub path: PathBuf,
    /// `general.architecture`: picks the SentencePiece flavour (Gemma, Phi-3).
    pub architecture: Option<&'a str>,
    /// `model`: `gpt2`, `llama` or `gemma4`.
    pub model: Option<&'a str>,
    /// `pre`: the pre-tokenizer of a byte-level vocabulary (`qwen2`, `llama-bpe`, ...).
    pub pre: Option<&'a str>,
    pub tokens: Option<Vec<&'a str>>,
    pub token_types: Option<Vec<i64>>,
    pub scores: Option<Vec<f32>>,
    /// `"left right"` pairs, best first.
    pub merges: Option<Vec<&'a str>>,
    pub bos_id: Option<u64>,
    pub eos_id: Option<u64>,
    /// End of turn and end of message (Llama 3's `<|eot_id|>`, `<|eom_id|>`): generation
    /// stops there too.
    pub eot_id: Option<u64>,
    pub eom_id: Option<u64>,
    pub unk_id: Option<u64>,
    pub pad_id: Option<u64>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    /// Whether a plain `llama` vocabulary prepends "▁" to the text (SentencePiece's
    /// `add_dummy_prefix`); unset means yes. transformers ignores this key and always
    /// prepends; we follow the file, as llama.cpp does, which agrees with transformers on
    /// every file that does not say `false`. Gemma and Phi-3 go by their architecture.
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<&'a str>,
}

/// Which of transformers' GGUF tokenizer builders a file gets.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// `gpt2`: `GPT2Tokenizer`.
    ByteLevel,
    /// `llama` in general: `LlamaTokenizer` ("▁" prepended to the text unless
    /// `add_space_prefix` is false).
    Llama,
    /// `llama` with architecture gemma, gemma2, gemma3: `GemmaTokenizer`, whitespace-only
    /// tokens respelled with "▁", merges rebuilt in the order of the vocabulary.
    Gemma,
    /// `llama` with architecture phi3: a normalizer prepends "▁" to the whole text.
    Phi3,
    /// `gemma4`: `GemmaTokenizer` over the file's own merges; no BOS is added.
    Gemma4,
}

impl GgufVocab<'_> {
    fn err(&self, msg: impl Into<String>) -> Error {
        Error::tokenizer(&self.path, msg)
    }

    fn kind(&self) -> Result<Kind> {
        let model = self.model.ok_or_else(|| {
            self.err("tokenizer.ggml.model is missing: the file carries no tokenizer (a tokenizer.json is needed)")
        })?;
        Ok(match (model, self.architecture.unwrap_or("")) {
            ("gpt2", _) => Kind::ByteLevel,
            ("llama", "gemma" | "gemma2" | "gemma3") => Kind::Gemma,
            ("llama", "phi3") => Kind::Phi3,
            ("llama", _) => Kind::Llama,
            ("gemma4", _) => Kind::Gemma4,
            (other, _) => {
                return Err(self
                    .err(format!("tokenizer.ggml.model '{other}' is not supported (supported: gpt2, llama, gemma4)")));
            }
        })
    }

    /// An id key, checked against the vocabulary.
    fn id(&self, key: &str, id: Option<u64>, n_tokens: usize) -> Result<Option<u32>> {
        match id {
            None => Ok(None),
            Some(id) if id < n_tokens as u64 => Ok(Some(id as u32)),
            Some(id) => Err(self.err(format!("tokenizer.ggml.{key} is {id} but the vocabulary has {n_tokens} tokens"))),
        }
    }
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, with
    /// the chat template from `tokenizer.chat_template`. The result matches the tokenizer
    /// transformers builds from the same file.
    pub fn from_gguf(gguf: &sluice_formats::gguf::GgufFile) -> Result<Tokenizer> {
        let key = |name: &str| format!("tokenizer.ggml.{name}");
        let vocab = GgufVocab {
            path: gguf.path().to_path_buf(),
            architecture: gguf.get_str("general.architecture")?,
            model: gguf.get_str(&key("model"))?,
            pre: gguf.get_str(&key("pre"))?,
            tokens: gguf.get_str_array(&key("tokens"))?,
            token_types: gguf.get_i64_array(&key("token_type"))?,
            scores: gguf.get_f32_array(&key("scores"))?,
            merges: gguf.get_str_array(&key("merges"))?,
            bos_id: gguf.get_u64(&key("bos_token_id"))?,
            eos_id: gguf.get_u64(&key("eos_token_id"))?,
            eot_id: gguf.get_u64(&key("eot_token_id"))?,
            eom_id: gguf.get_u64(&key("eom_token_id"))?,
            unk_id: gguf.get_u64(&key("unknown_token_id"))?,
            pad_id: gguf.get_u64(&key("padding_token_id"))?,
            add_bos: gguf.get_bool(&key("add_bos_token"))?,
            add_eos: gguf.get_bool(&key("add_eos_token"))?,
            add_space_prefix: gguf.get_bool(&key("add_space_prefix"))?,
            chat_template: gguf.get_str("tokenizer.chat_template")?,
        };
        Tokenizer::from_gguf_vocab(&vocab)
    }

    pub(crate) fn from_gguf_vocab(v: &GgufVocab) -> Result<Tokenizer> {
        let (inner, extras) = build(v)?;
        Tokenizer::assemble(inner, v.path.clone(), extras)
    }
}

fn build(v: &GgufVocab) -> Result<(tokenizers::Tokenizer, Extras)> {
    let kind = v.kind()?;
    let tokens = v.tokens.as_deref().ok_or_else(|| v.err("tokenizer.ggml.tokens is missing"))?;
    if tokens.is_empty() {
        return Err(v.err("tokenizer.ggml.tokens is empty"));
    }
    let n = tokens.len();
    if let Some(types) = &v.token_types
        && types.len() != n
    {
        return Err(v.err(format!("tokenizer.ggml.token_type has {} entries for {n} tokens", types.len())));
    }
    if let Some(scores) = &v.scores
        && scores.len() != n
    {
        return Err(v.err(format!("tokenizer.ggml.scores has {} entries for {n} tokens", scores.len())));
    }
    let bos_id = v.id("bos_token_id", v.bos_id, n)?;
    let eos_id = v.id("eos_token_id", v.eos_id, n)?;
    let eot_id = v.id("eot_token_id", v.eot_id, n)?;
    let eom_id = v.id("eom_token_id", v.eom_id, n)?;
    let unk_id = v.id("unknown_token_id", v.unk_id, n)?;
    let pad_id = v.id("padding_token_id", v.pad_id, n)?;

    // The model's vocabulary, as the builder for this kind spells it.
    let types = v.token_types.as_deref().unwrap_or_default();
    let spelled: Vec<String> = match kind {
        Kind::ByteLevel => tokens
            .iter()
            .enumerate()
            .map(|(i, t)| match types.get(i) {
                // A control token is matched as written, never spelled in bytes (DeepSeek's
                // `<｜User｜>` is outside the byte alphabet).
                Some(&TOKEN_CONTROL) => t.to_string(),
                _ => byte_level_spelling(t),
            })
            .collect(),
        Kind::Gemma => tokens.iter().map(|t| gemma_spelling(t)).collect(),
        _ => tokens.iter().map(|t| t.to_string()).collect(),
    };
    // A Python dict built in order: a token spelled twice keeps the later id.
    let index: HashMap<&str, u32> = spelled.iter().enumerate().map(|(i, t)| (t.as_str(), i as u32)).collect();
    let mut inner = tokenizers::Tokenizer::new(bpe_model(v, kind, &spelled, &index)?);
    set_pipeline(&mut inner, v, kind)?;

    let named = |id: Option<u32>| id.map(|id| tokens[id as usize]);
    let named_tokens = [
        ("bos_token", named(bos_id)),
        ("eos_token", named(eos_id)),
        ("unk_token", named(unk_id)),
        ("pad_token", named(pad_id)),
    ];
    let named_present: Vec<&str> = named_tokens.iter().filter_map(|(_, token)| *token).collect();
    add_special_tokens(&mut inner, v, tokens, &index, &named_present);

    // BOS/EOS as the file says; a SentencePiece vocabulary that does not say gets BOS, as in
    // llama.cpp; Gemma 4's chat template writes `<bos>` itself.
    let add_bos = match kind {
        Kind::ByteLevel => v.add_bos.unwrap_or(false),
        Kind::Gemma4 => false,
        _ => v.add_bos.unwrap_or(true),
    };
    let add_eos = v.add_eos.unwrap_or(false);
    let post =
        post_processor(&inner, add_bos.then(|| named(bos_id)).flatten(), add_eos.then(|| named(eos_id)).flatten())
            .map_err(|e| v.err(format!("post-processor: {e}")))?;
    inner.with_post_processor(Some(post));

    let template_tokens =
        named_tokens.iter().filter_map(|(name, token)| Some((name.to_string(), Value::from((*token)?)))).collect();
    let template = v.chat_template.map(|text| TemplateSource {
        name: format!("{} (tokenizer.chat_template)", v.path.display()),
        text: text.to_string(),
    });
    let eos_ids = [eos_id, eot_id, eom_id].into_iter().flatten().collect();
    Ok((inner, Extras { bos_id, eos_ids, template_tokens, template }))
}

/// The BPE model: the vocabulary and the file's merges, or merges rebuilt from a ranking of
/// the tokens where the file has none.
fn bpe_model(v: &GgufVocab, kind: Kind, spelled: &[String], index: &HashMap<&str, u32>) -> Result<BPE> {
    let merges = match (&v.merges, kind) {
        (Some(merges), _) => parse_merges(v, merges, index)?,
        // Gemma's scores do not follow its merge order; the order of the vocabulary does.
        (None, Kind::Gemma) => merges_from_ranking(spelled, index, |i| -(i as f64)),
        (None, _) => {
            let scores = v.scores.as_deref().ok_or_else(|| {
                v.err("the file has neither tokenizer.ggml.merges nor tokenizer.ggml.scores to build merges from")
            })?;
            merges_from_ranking(spelled, index, |i| f64::from(scores[i]))
        }
    };
    let vocab: Vocab = index.iter().map(|(t, &i)| (t.to_string(), i)).collect();
    let builder = BPE::builder().vocab_and_merges(vocab, merges);
    let builder = match kind {
        Kind::ByteLevel => {
            builder.continuing_subword_prefix(String::new()).end_of_word_suffix(String::new()).fuse_unk(false)
        }
        _ => builder.unk_token("<unk>".to_string()).fuse_unk(true).byte_fallback(true),
    };
    builder.build().map_err(|e| v.err(format!("cannot build the BPE model: {e}")))
}

/// Normalizer, pre-tokenizer and decoder, as transformers' builder for `kind` sets them.
fn set_pipeline(inner: &mut tokenizers::Tokenizer, v: &GgufVocab, kind: Kind) -> Result<()> {
    let replace = |from: &str, to: &str| Replace::new(from, to).expect("a plain string pattern always compiles");
    let sentencepiece_decoder = |strip_prefix: bool| {
        let mut decoders = vec![
            DecoderWrapper::Replace(replace("\u{2581}", " ")),
            DecoderWrapper::ByteFallback(ByteFallback::new()),
            DecoderWrapper::Fuse(Fuse::new()),
        ];
        if strip_prefix {
            // The prepended "▁" decodes as a space that was never in the text.
            decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
        }
        tokenizers::decoders::sequence::Sequence::new(decoders)
    };
    match kind {
        Kind::ByteLevel => {
            let pre = byte_level_pre_tokenizer(v.pre).map_err(|e| v.err(format!("pre-tokenizer: {e}")))?;
            inner.with_pre_tokenizer(Some(pre));
            inner.with_decoder(Some(ByteLevel::default()));
            // Qwen3.5's tokenizer.json (and its own tiktoken encoder) puts text in NFC first;
            // the GGUF does not say so, but its `pre` names the vocabulary.
            if v.pre == Some("qwen35") {
                inner.with_normalizer(Some(NormalizerWrapper::NFC(NFC)));
            }
        }
        Kind::Llama => {
            let prefix = v.add_space_prefix != Some(false);
            let scheme = if prefix { PrependScheme::First } else { PrependScheme::Never };
            inner.with_pre_tokenizer(Some(Metaspace::new('\u{2581}', scheme, false)));
            inner.with_decoder(Some(sentencepiece_decoder(prefix)));
        }
        Kind::Phi3 => {
            inner.with_normalizer(Some(tokenizers::normalizers::Sequence::new(vec![
                NormalizerWrapper::Prepend(Prepend::new("\u{2581}".into())),
                NormalizerWrapper::Replace(replace(" ", "\u{2581}")),
            ])));
            inner.with_decoder(Some(sentencepiece_decoder(true)));
        }
        Kind::Gemma | Kind::Gemma4 => {
            inner.with_normalizer(Some(replace(" ", "\u{2581}")));
            // Runs after the normalizer, so it never finds a space; transformers has it too.
            let split = Split::new(SplitPattern::String(" ".into()), SplitDelimiterBehavior::MergedWithPrevious, false)
                .expect("a plain string pattern always compiles");
            inner.with_pre_tokenizer(Some(split));
            inner.with_decoder(Some(sentencepiece_decoder(false)));
        }
    }
    Ok(())
}

/// Control tokens become special added tokens and user-defined ones plain added tokens, all
/// matched as written (not normalized); a user-defined token not in the vocabulary under its
/// own spelling is left alone. (transformers' GGUF builder also drops a byte-level control
/// token written outside the byte alphabet, DeepSeek's `<｜User｜>` among them; the model's
/// own tokenizer.json and llama.cpp keep them special, and so do we.) Then, as transformers
/// does, the `named` special tokens (bos, eos, unk, pad) that are not added tokens yet become
/// special ones.
fn add_special_tokens(
    inner: &mut tokenizers::Tokenizer,
    v: &GgufVocab,
    tokens: &[&str],
    index: &HashMap<&str, u32>,
    named: &[&str],
) {
    let types = v.token_types.as_deref().unwrap_or_default();
    let with_type = |want: i64| tokens.iter().zip(types).filter(move |(_, t)| **t == want).map(|(token, _)| *token);
    let control: Vec<AddedToken> =
        with_type(TOKEN_CONTROL).map(|token| AddedToken::from(token, true).normalized(false)).collect();
    if !control.is_empty() {
        inner.add_special_tokens(&control);
    }
    let control: HashSet<&str> = control.iter().map(|t| t.content.as_str()).collect();
    let user: Vec<AddedToken> = with_type(TOKEN_USER_DEFINED)
        .filter(|token| index.contains_key(token) || control.contains(token))
        .map(|token| AddedToken::from(token, false).normalized(false))
        .collect();
    if !user.is_empty() {
        inner.add_tokens(&user);
    }
    let added = inner.get_added_vocabulary().get_vocab();
    let named: Vec<AddedToken> = named
        .iter()
        .filter(|token| !added.contains_key(**token))
        .map(|token| AddedToken::from(*token, true).normalized(false))
        .collect();
    if !named.is_empty() {
        inner.add_tokens(&named);
    }
}

/// transformers' `update_post_processor`: `[bos] $A [eos]`, and `[bos] $A [eos] [bos] $B [eos]`
/// for pairs.
fn post_processor(
    inner: &tokenizers::Tokenizer,
    bos: Option<&str>,
    eos: Option<&str>,
) -> std::result::Result<TemplateProcessing, String> {
    let mut specials = Vec::new();
    let mut piece = |key: &str, token: Option<&str>| -> Option<String> {
        let token = token?;
        let id = inner.token_to_id(token)?;
        specials.push(SpecialToken::new(key.to_string(), vec![id], vec![token.to_string()]).ok()?);
        Some(key.to_string())
    };
    let bos = piece("BOS", bos);
    let eos = piece("EOS", eos);
    let sequence = |seq: &str, type_id: u32| {
        let mut parts: Vec<String> = Vec::new();
        parts.extend(bos.iter().map(|b| format!("{b}:{type_id}")));
        parts.push(format!("${seq}:{type_id}"));
        parts.extend(eos.iter().map(|e| format!("{e}:{type_id}")));
        parts.join(" ")
    };
    let single = sequence("A", 0);
    let pair = format!("{single} {}", sequence("B", 1));
    TemplateProcessing::builder()
        .try_single(single.as_str())?
        .try_pair(pair.as_str())?
        .special_tokens(specials)
        .build()
        .map_err(|e| e.to_string())
}

/// Parses `"left right"` merges, checking that both sides and their concatenation are tokens.
fn parse_merges(v: &GgufVocab, merges: &[&str], index: &HashMap<&str, u32>) -> Result<Merges> {
    merges
        .iter()
        .enumerate()
        .map(|(i, merge)| {
            let (left, right) = merge
                .split_once(' ')
                .filter(|(_, right)| !right.contains(' '))
                .ok_or_else(|| v.err(format!("tokenizer.ggml.merges[{i}] is '{merge}', not two tokens")))?;
            let joined = format!("{left}{right}");
            for token in [left, right, joined.as_str()] {
                if !index.contains_key(token) {
                    return Err(v.err(format!(
                        "tokenizer.ggml.merges[{i}] '{merge}' names '{token}', which is not in the vocabulary"
                    )));
                }
            }
            Ok((left.to_string(), right.to_string()))
        })
        .collect()
}

/// transformers' `generate_merges` with scores: every split of a token into two tokens is a
/// merge, ranked by the token's score (higher first), then by longer left and right sides.
/// `score(i)` is the score of token `i`; a token spelled twice keeps its first position and
/// its later score, as a Python dict does.
fn merges_from_ranking(spelled: &[String], index: &HashMap<&str, u32>, score: impl Fn(usize) -> f64) -> Merges {
    struct Candidate<'a> {
        score: f64,
        left_chars: usize,
        right_chars: usize,
        left: &'a str,
        right: &'a str,
    }
    let mut seen: HashSet<&str> = HashSet::with_capacity(spelled.len());
    let mut candidates: Vec<Candidate> = Vec::new();
    for token in spelled {
        if !seen.insert(token.as_str()) {
            continue;
        }
        let score = score(index[token.as_str()] as usize);
        let n_chars = token.chars().count();
        for (k, (at, _)) in token.char_indices().enumerate().skip(1) {
            let (left, right) = token.split_at(at);
            if index.contains_key(left) && index.contains_key(right) {
                candidates.push(Candidate { score, left_chars: k, right_chars: n_chars - k, left, right });
            }
        }
    }
    // Stable, and descending on every key, as Python's `sorted(..., reverse=True)`.
    candidates.sort_by(|a, b| {
        b.score
            .partial_cmp(&a.score)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(b.left_chars.cmp(&a.left_chars))
            .then(b.right_chars.cmp(&a.right_chars))
    });
    candidates.into_iter().map(|c| (c.left.to_string(), c.right.to_string())).collect()
}

/// GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the rest
/// move to U+0100 and up in byte order.
fn byte_chars() -> &'static [char; 256] {
    static TABLE: std::sync::OnceLock<[char; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let mut table = ['\0'; 256];
        let mut shifted = 0;
        for b in 0u32..256 {
            table[b as usize] = if printable(b) {
                char::from_u32(b).expect("Latin-1")
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).expect("below U+0200")
            };
        }
        table
    })
}

fn is_byte_char(c: char) -> bool {
    let c = c as u32;
    (0x21..=0x7E).contains(&c)
        || (0xA1..=0xAC).contains(&c)
        || (0xAE..=0xFF).contains(&c)
        || (0x100..=0x143).contains(&c)
}

/// A byte-level vocabulary entry as the BPE model looks it up: already in the byte alphabet
/// (every token llama.cpp writes for a real byte-level vocabulary), or respelled from its
/// UTF-8 bytes (as transformers does for the odd one that is not).
fn byte_level_spelling(token: &str) -> String {
    if token.chars().all(is_byte_char) {
        token.to_string()
    } else {
        let table = byte_chars();
        token.bytes().map(|b| table[b as usize]).collect()
    }
}

/// Gemma files store tokens of two or more spaces as real spaces, where the normalized text
/// has "▁"; transformers respells every whitespace-only token that holds a space.
fn gemma_spelling(token: &str) -> String {
    // Python's str.isspace also counts the separators U+001C..U+001F.
    let space = |c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c);
    if token.contains(' ') && token.chars().all(space) {
        "\u{2581}".repeat(token.chars().count())
    } else {
        token.to_string()
    }
}

const LLAMA3_SPLIT: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const TEKKEN_SPLIT: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const GPT4O_SPLIT: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek-V3's three splits, applied in turn: digit runs of up to three, CJK runs, then
/// words and punctuation.
const DEEPSEEK3_SPLITS: [&str; 3] = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

/// The split regexes for a `tokenizer.ggml.pre` value, as transformers maps them (and, for
/// `deepseek-v3`, as the model's tokenizer.json and llama.cpp split). Any other value
/// (`default`, `gpt2`, `smollm`, ...) gets GPT-2's own regex.
fn pre_splits(pre: &str) -> Option<&'static [&'static str]> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "jina-v5-nano" | "dbrx" | "smaug-bpe" => &[LLAMA3_SPLIT],
        "tekken" => &[TEKKEN_SPLIT],
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => &[QWEN2_SPLIT],
        "qwen35" => &[QWEN35_SPLIT],
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => &[GPT4O_SPLIT],
        // llama.cpp's converter names DeepSeek-V3's vocabulary by a hash of its output, which
        // transformers releases have moved onto JoyAI's entry; the splits are the same.
        "deepseek-v3" | "joyai-llm" => &DEEPSEEK3_SPLITS,
        _ => return None,
    })
}

fn byte_level_pre_tokenizer(pre: Option<&str>) -> std::result::Result<PreTokenizerWrapper, String> {
    Ok(match pre.and_then(pre_splits) {
        Some(regexes) => {
            let mut steps = Vec::with_capacity(regexes.len() + 1);
            for regex in regexes {
                let split = Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false)
                    .map_err(|e| e.to_string())?;
                steps.push(PreTokenizerWrapper::Split(split));
            }
            steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)));
            PreTokenizerWrapper::Sequence(tokenizers::pre_tokenizers::sequence::Sequence::new(steps))
        }
        None => PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::ChatMessage;

    // Expected ids come from transformers 5.24 / tokenizers 0.23.3, from its GGUF builders
    // (`select_tokenizer_builder`, `add_gguf_special_tokens`, `set_split_regex`) fed the same
    // dictionaries as these fixtures.

    const PATH: &str = "/models/hand-built.gguf";

    /// Owned metadata that a `GgufVocab` borrows from.
    #[derive(Default)]
    struct Meta {
        tokens: Vec<String>,
        types: Vec<i64>,
        scores: Vec<f32>,
        merges: Vec<String>,
    }

    impl Meta {
        fn push(&mut self, token: &str, token_type: i64, score: f32) {
            self.tokens.push(token.to_string());
            self.types.push(token_type);
            self.scores.push(score);
        }

        fn vocab<'a>(&'a self, model: &'a str, architecture: &'a str) -> GgufVocab<'a> {
            GgufVocab {
                path: PathBuf::from(PATH),
                architecture: Some(architecture),
                model: Some(model),
                tokens: Some(self.tokens.iter().map(String::as_str).collect()),
                token_types: Some(self.types.clone()),
                scores: (model != "gpt2").then(|| self.scores.clone()),
                merges: (!self.merges.is_empty()).then(|| self.merges.iter().map(String::as_str).collect()),
                ..GgufVocab::default()
            }
        }
    }

    /// Byte-level: five special tokens (one control token outside the byte alphabet), the
    /// 256 byte symbols, then the merges' results.
    fn byte_level() -> Meta {
        let mut m = Meta::default();
        for (token, t) in
            [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4), ("<｜bad｜>", 3)]
        {
            m.push(token, t, 0.0);
        }
        for c in byte_chars() {
            m.push(&c.to_string(), 1, 0.0);
        }
        let merges =
            ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2", "12 3", "Ġ 1"];
        for merge in merges {
            m.push(&merge.replace(' ', ""), 1, 0.0);
            m.merges.push(merge.to_string());
        }
        m
    }

    const BYTE_LEVEL_TEXTS: [&str; 6] =
        ["hello world", "hello 12345", "<|im_start|>hello<|im_end|><think>", "<｜bad｜>", "héllo 😀", ""];

    /// SentencePiece: `specials`, the 256 byte tokens, then pieces with scores (`or` and
    /// `ld` tie).
    fn sentencepiece(specials: &[(&str, i64)]) -> Meta {
        let mut m = Meta::default();
        for (token, t) in specials {
            m.push(token, *t, 0.0);
        }
        for b in 0..=255u8 {
            m.push(&format!("<0x{b:02X}>"), 6, 0.0);
        }
        let pieces = [
            ("▁", -1.0),
            ("h", -2.0),
            ("e", -2.0),
            ("l", -2.0),
            ("o", -2.0),
            ("w", -2.0),
            ("r", -2.0),
            ("d", -2.0),
            ("▁h", -3.0),
            ("he", -4.0),
            ("ll", -5.0),
            ("llo", -6.0),
            ("hello", -7.0),
            ("▁hello", -8.0),
            ("▁w", -9.0),
            ("or", -10.0),
            ("▁wor", -11.0),
            ("ld", -10.0),
            ("▁world", -12.0),
        ];
        for (piece, score) in pieces {
            m.push(piece, 1, score);
        }
        m
    }

    fn llama() -> Meta {
        sentencepiece(&[("<unk>", 2), ("<s>", 3), ("</s>", 3)])
    }

    fn gemma() -> Meta {
        sentencepiece(&[
            ("<pad>", 3),
            ("<eos>", 3),
            ("<bos>", 3),
            ("<unk>", 3),
            ("<start_of_turn>", 3),
            ("<end_of_turn>", 3),
            ("\n", 4),
            ("\n\n", 4),
            ("  ", 4),
        ])
    }

    fn encode_all(tok: &Tokenizer, texts: &[&str]) -> Vec<Vec<u32>> {
        texts.iter().map(|t| tok.encode(t, true).unwrap()).collect()
    }

    #[test]
    fn byte_level_matches_transformers_for_each_pre() {
        let m = byte_level();
        // GPT-2's regex keeps " 12345" together, so `Ġ 1` loses to `1 2` and `12 3`;
        // qwen2 splits digits one by one; llama-bpe takes them three at a time. The control
        // token outside the byte alphabet is matched whole (transformers' GGUF builder spells
        // it in bytes; the model's tokenizer.json and llama.cpp do not).
        let default = vec![
            vec![264, 269],
            vec![264, 37, 271, 57, 58],
            vec![1, 264, 2, 3],
            vec![4],
            vec![109, 200, 174, 262, 116, 37, 245, 164, 157, 133],
            vec![],
        ];
        let mut qwen2 = default.clone();
        qwen2[1] = vec![264, 37, 54, 55, 56, 57, 58];
        for (pre, expected) in
            [(None, &default), (Some("smollm"), &default), (Some("qwen2"), &qwen2), (Some("llama-bpe"), &default)]
        {
            let mut v = m.vocab("gpt2", "llama");
            v.pre = pre;
            let tok = Tokenizer::from_gguf_vocab(&v).unwrap();
            assert_eq!(&encode_all(&tok, &BYTE_LEVEL_TEXTS), expected, "pre {pre:?}");
            for text in BYTE_LEVEL_TEXTS {
                assert_eq!(tok.decode(&tok.encode(text, false).unwrap(), false).unwrap(), text);
            }
        }
    }

    #[test]
    fn byte_level_special_tokens_and_template() {
        let m = byte_level();
        let mut v = m.vocab("gpt2", "qwen2");
        v.bos_id = Some(0);
        v.eos_id = Some(0);
        v.chat_template = Some(
            "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
             {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        );
        let tok = Tokenizer::from_gguf_vocab(&v).unwrap();
        // Control tokens are special, user-defined ones are not; one outside the byte
        // alphabet (DeepSeek's kind) keeps its own spelling.
        assert!(tok.is_special(0) && tok.is_special(1) && tok.is_special(2) && tok.is_special(4));
        assert!(!tok.is_special(3));
        assert_eq!(tok.token_to_id("<｜bad｜>"), Some(4));
        assert_eq!(tok.decode(&[264, 4], false).unwrap(), "hello<｜bad｜>");
        assert_eq!(tok.decode(&[1, 264, 2, 3], true).unwrap(), "hello<think>");
        // add_bos_token is unset: a byte-level vocabulary adds nothing.
        assert_eq!(tok.encode("hello", true).unwrap(), [264]);
        assert_eq!(tok.bos_id(), Some(0));
        // EOS from the file, then the ChatML end of turn.
        assert_eq!(tok.eos_ids(), [0, 2]);

        let chat = [ChatMessage::new("user", "hello")];
        let text = tok.apply_chat_template(&chat, true).unwrap();
        assert_eq!(text, "<|endoftext|><|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n");
        // Byte b is token 5 + b; "hello" is 264.
        let expected = [0, 1, 122, 120, 106, 119, 15, 264, 2, 15, 1, 102, 120, 120, 110, 120, 121, 102, 115, 121, 15];
        assert_eq!(tok.encode_chat(&chat, true).unwrap(), expected);
    }

    #[test]
    fn byte_level_adds_bos_and_eos_when_told() {
        let m = byte_level();
        let mut v = m.vocab("gpt2", "llama");
        v.bos_id = Some(1);
        v.eos_id = Some(2);
        v.add_bos = Some(true);
        v.add_eos = Some(true);
        let tok = Tokenizer::from_gguf_vocab(&v).unwrap();
        assert_eq!(tok.encode("hello", true).unwrap(), [1, 264, 2]);
        assert_eq!(tok.encode("hello", false).unwrap(), [264]);
        assert_eq!(tok.decode(&[1, 264, 2], true).unwrap(), "hello");
    }

    #[test]
    fn llama_matches_transformers() {
        let m = llama();
        let mut v = m.vocab("llama", "llama");
        v.bos_id = Some(1);
        v.eos_id = Some(2);
        v.unk_id = Some(0);
        let tok = Tokenizer::from_gguf_vocab(&v).unwrap();
        let texts = ["hello world", " hello", "héllo", "hello  world", ""];
        // No merges in the file: they come from the scores, so `▁h` (score -3) beats
        // `▁hello` (-8) and "hello" comes out as ▁h e llo.
        assert_eq!(
            encode_all(&tok, &texts),
            [
                vec![1, 267, 261, 270, 277],
                vec![1, 267, 261, 270],
                vec![1, 267, 198, 172, 270],
                vec![1, 267, 261, 270, 259, 277],
                vec![1]
            ]
        );
        let decoded = ["<s> hello world", "<s> hello", "<s> héllo", "<s> hello  world", "<s>"];
        for (text, want) in texts.iter().zip(decoded) {
            assert_eq!(tok.decode(&tok.encode(text, true).unwrap(), false).unwrap(), want);
        }
        assert_eq!(tok.decode(&tok.encode("hello world", true).unwrap(), true).unwrap(), "hello world");
        // `<unk>` is typed UNKNOWN, not CONTROL, but transformers makes every named special
        // token (bos, eos, unk, pad) a special added token.
        assert!(tok.is_special(0) && tok.is_special(1) && tok.is_special(2));
        assert_eq!(tok.encode("<unk>", false).unwrap(), [0]);
        assert_eq!(tok.eos_ids(), [2]);
    }

    #[test]
    fn llama_merges_rank_by_score_then_vocabulary_order() {
        let m = llama();
        let spelled = m.tokens.clone();
        let index: HashMap<&str, u32> = spelled.iter().enumerate().map(|(i, t)| (t.as_str(), i as u32)).collect();
        let merges = merges_from_ranking(&spelled, &index, |i| f64::from(m.scores[i]));
        let pairs: Vec<(&str, &str)> = merges.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        assert_eq!(
            pairs,
            [
                ("▁", "h"),
                ("h", "e"),
                ("l", "l"),
                ("ll", "o"),
                ("he", "llo"),
                ("▁", "hello"),
                ("▁", "w"),
                ("o", "r"),
                ("l", "d"),
                ("▁w", "or"),
                ("▁wor", "ld")
            ]
        );
    }

    #[test]
    fn llama_without_space_prefix_prepends_nothing() {
        let m = llama();
        let mut v = m.vocab("llama", "llama");
        v.bos_id = Some(1);
        v.add_bos = Some(false);
        v.add_space_prefix = Some(false);
        let tok = Tokenizer::from_gguf_vocab(&v).unwrap();
        assert_eq!(tok.encode("hello world", true).unwrap(), [271, 277]);
        assert_eq!(tok.decode(&[271, 277], false).unwrap(), "hello world");
        assert_eq!(tok.decode(&[277], false).unwrap(), " world");
    }

    #[test]
    fn gemma_matches_transformers() {
        let m = gemma();
        let mut v = m.vocab("llama", "gemma3");
        v.bos_id = Some(2);
        v.eos_id = Some(1);
        v.unk_id = Some(3);
        v.pad_id = Some(0);
        v.add_bos = Some(true);
        v.add_space_prefix = Some(false);
        let tok = Tokenizer::from_gguf_vocab(&v).unwrap();
        let texts = [
            "hello world",
            "hello  world",
            "<start_of_turn>user\nhello<end_of_turn>\n\n",
            "é",
            " hello",
            "hello   world",
        ];
        // No prefix space; the two-space token (stored as "  ") is found as "▁▁"; merges
        // follow the order of the vocabulary, not the scores; "é" falls back to bytes.
        assert_eq!(
            encode_all(&tok, &texts),
            [
                vec![2, 277, 283],
                vec![2, 277, 8, 270, 280, 282],
                vec![2, 4, 126, 124, 267, 271, 6, 277, 5, 7],
                vec![2, 204, 178],
                vec![2, 273, 267, 276],
                vec![2, 277, 8, 283]
            ]
        );
        for text in texts {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
        }
        assert!(tok.is_special(4) && !tok.is_special(7));
        assert_eq!(tok.eos_ids(), [1, 5]);
    }

    #[test]
    fn gemma4_uses_the_file_merges_and_adds_no_bos() {
        let mut m = gemma();
        m.push("hell", 1, 0.0);
        m.merges = ["h e", "l l", "he ll", "hell o"].map(String::from).to_vec();
        let mut v = m.vocab("gemma4", "gemma4");
        v.bos_id = Some(2);
        v.add_bos = Some(true);
        let tok = Tokenizer::from_gguf_vocab(&v).unwrap();
        // With the scores, "hello" would come out as "he" "llo"; Gemma 4's template writes
        // `<bos>` itself.
        assert_eq!(tok.encode("hello", true).unwrap(), [tok.token_to_id("hello").unwrap()]);
        assert_eq!(
            tok.encode(" hello", true).unwrap(),
            [tok.token_to_id("▁").unwrap(), tok.token_to_id("hello").unwrap()]
        );
    }

    fn expect_error(v: &GgufVocab, wanted: &str) {
        match Tokenizer::from_gguf_vocab(v) {
            Err(Error::Tokenizer { path, msg }) => {
                assert_eq!(path, Path::new(PATH));
                assert!(msg.contains(wanted), "message {msg:?} does not mention {wanted:?}");
            }
            Err(other) => panic!("expected a tokenizer error about {wanted:?}, got {other}"),
            Ok(_) => panic!("expected a tokenizer error about {wanted:?}, got a tokenizer"),
        }
    }

    #[test]
    fn bad_metadata_is_a_tokenizer_error_naming_the_file() {
        let m = byte_level();
        let mut v = m.vocab("gpt2", "llama");
        v.tokens = None;
        expect_error(&v, "tokenizer.ggml.tokens is missing");

        let v = GgufVocab { model: None, ..m.vocab("gpt2", "llama") };
        expect_error(&v, "tokenizer.ggml.model is missing");

        expect_error(&m.vocab("t5", "t5"), "'t5' is not supported");

        let mut v = m.vocab("gpt2", "llama");
        v.merges.as_mut().unwrap()[3] = "hell zz";
        expect_error(&v, "tokenizer.ggml.merges[3] 'hell zz' names 'zz', which is not in the vocabulary");
        v.merges.as_mut().unwrap()[3] = "h e l";
        expect_error(&v, "tokenizer.ggml.merges[3] is 'h e l', not two tokens");
        // Both sides known, but their concatenation is not a token.
        v.merges.as_mut().unwrap()[3] = "o o";
        expect_error(&v, "names 'oo'");

        let mut v = m.vocab("gpt2", "llama");
        v.token_types.as_mut().unwrap().pop();
        expect_error(&v, &format!("token_type has {} entries for {} tokens", m.tokens.len() - 1, m.tokens.len()));

        let mut v = m.vocab("gpt2", "llama");
        v.bos_id = Some(m.tokens.len() as u64);
        expect_error(
            &v,
            &format!("bos_token_id is {} but the vocabulary has {} tokens", m.tokens.len(), m.tokens.len()),
        );

        let s = llama();
        let mut v = s.vocab("llama", "llama");
        v.scores.as_mut().unwrap().truncate(3);
        expect_error(&v, "scores has 3 entries");
        v.scores = None;
        expect_error(&v, "neither tokenizer.ggml.merges nor tokenizer.ggml.scores");

        let mut v = m.vocab("gpt2", "llama");
        v.tokens = Some(Vec::new());
        expect_error(&v, "tokenizer.ggml.tokens is empty");
    }

    #[test]
    fn byte_table_matches_gpt2() {
        let table = byte_chars();
        assert_eq!(table[b' ' as usize], 'Ġ');
        assert_eq!(table[b'\n' as usize], 'Ċ');
        assert_eq!(table[b'a' as usize], 'a');
        assert_eq!(table[0xAD], 'Ń');
        assert!(table.iter().all(|&c| is_byte_char(c)));
        assert_eq!(table.iter().collect::<HashSet<_>>().len(), 256);
        assert!(!is_byte_char(' ') && !is_byte_char('€') && is_byte_char('é') && is_byte_char('Ń'));
        assert_eq!(byte_level_spelling("a b"), "aĠb");
        assert_eq!(byte_level_spelling("Ġx"), "Ġx");
        assert_eq!(gemma_spelling("  "), "▁▁");
        assert_eq!(gemma_spelling(" \n"), "▁▁");
        assert_eq!(gemma_spelling("\n\n"), "\n\n");
        assert_eq!(gemma_spelling(" a"), " a");
    }
}
