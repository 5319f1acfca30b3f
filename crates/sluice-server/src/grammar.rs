//! Constrained output: JSON that follows a schema (`response_format` `json_object` or
//! `json_schema`, Ollama's `format`), by the `llguidance` crate. Its token trie is
//! built once from the model's vocabulary (each id's bytes); each request gets its own
//! matcher, which says at every step which tokens may come next; the others' logits
//! are set to minus infinity before sampling.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use sluice_tokenizer::Tokenizer;

/// The vocabulary as llguidance sees it.
struct Vocab {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tok.encode(&String::from_utf8_lossy(s), false).unwrap_or_default()
    }
}

/// Makes a matcher per request; built once per model.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// `vocab` is the model's output width (its logits), `eos` the id that ends a reply.
    pub fn new(tok: Arc<Tokenizer>, vocab: usize, eos: u32) -> Result<Grammars, String> {
        let mut words = tok.token_bytes();
        // Ids past the tokenizer's (padding rows of the output) spell nothing.
        words.resize(vocab, Vec::new());
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words);
        let env: TokEnv = Arc::new(Vocab { trie, tok });
        let factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        Ok(Grammars { factory })
    }

    /// A matcher for output that is JSON following `schema`. Unless the schema says
    /// otherwise (llguidance's `x-guidance` options), whitespace is fixed to `", "` and
    /// `": "` between items: flexible whitespace let a weak model pad its answer with
    /// newlines until it ran out of tokens.
    pub fn json(&self, mut schema: serde_json::Value) -> Result<Grammar, String> {
        if let Some(o) = schema.as_object_mut() {
            o.entry("x-guidance").or_insert_with(
                || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
            );
        }
        let parser =
            self.factory.create_parser(TopLevelGrammar::from_json_schema(schema)).map_err(|e| e.to_string())?;
        Ok(Grammar { matcher: Matcher::new(Ok(parser)), eos: self.factory.tok_env().tok_trie().eos_token() })
    }
}

/// One request's grammar state.
pub struct Grammar {
    matcher: Matcher,
    eos: TokenId,
}

impl Clone for Grammar {
    /// A matcher of its own (choices of one request advance separately).
    fn clone(&self) -> Self {
        Grammar { matcher: self.matcher.deep_clone(), eos: self.eos }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}

impl Grammar {
    /// Sets the logits of every token the grammar does not allow next to minus
    /// infinity; the end-of-reply ids are allowed where the grammar may end. Fails if
    /// the grammar is broken or allows nothing.
    pub fn mask(&mut self, logits: &mut [f32], stop_ids: &[u32]) -> Result<(), String> {
        let mask = self.matcher.compute_mask().map_err(|e| format!("grammar: {e}"))?;
        let may_end = mask.is_allowed(self.eos);
        // The stop ids follow the end of the grammar, not the mask: keep their logits.
        let stops: Vec<(usize, f32)> =
            stop_ids.iter().map(|&i| i as usize).filter(|&i| i < logits.len()).map(|i| (i, logits[i])).collect();
        let mut any = false;
        for (i, l) in logits.iter_mut().enumerate() {
            if mask.is_allowed(i as TokenId) {
                any = true;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        for (i, l) in stops {
            logits[i] = if may_end { l } else { f32::NEG_INFINITY };
        }
        any |= may_end && !stop_ids.is_empty();
        if any { Ok(()) } else { Err("grammar: no token may come next".into()) }
    }

    /// Advances past a generated token; returns whether the grammar is complete (no
    /// token may follow but the end).
    pub fn advance(&mut self, id: u32) -> Result<bool, String> {
        self.matcher.consume_token(id).map_err(|e| format!("grammar: {e}"))?;
        Ok(self.matcher.is_stopped())
    }
}
