//! Incremental detokenizing for streamed output.
//!
//! Decoding one token at a time does not work: byte-level BPE and SentencePiece byte
//! fallback split one character over several tokens, and SentencePiece decoders drop the
//! leading space of the first token of whatever they decode. So, as TGI and vLLM do, we
//! decode a short window twice, once without the new tokens and once with them, and emit
//! the difference; the window starts one emitted chunk back, which gives the decoder the
//! context it needs for spaces. Text is held back while it ends in U+FFFD, which is how a
//! decoder shows an incomplete UTF-8 sequence.

use sluice_core::Result;

use crate::Tokenizer;

/// Incremental detokenizer for streaming: push ids one at a time, get back the newly
/// completed text.
///
/// Everything [`push`](Self::push) returns, followed by [`finish`](Self::finish), equals
/// `tok.decode(all_ids, skip_special)` (for decoders that only add text at the end, which
/// is every byte-level and SentencePiece decoder; one that rewrites earlier text, such as
/// WordPiece's cleanup, can only be matched as far as the text already emitted allows).
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    /// Context ids (see [`with_context`](Self::with_context)) followed by every pushed id.
    ids: Vec<u32>,
    /// `ids[prefix_offset..read_offset]` is the window already turned into text; its decode
    /// is subtracted from the decode of `ids[prefix_offset..]`.
    prefix_offset: usize,
    read_offset: usize,
    /// Decode of the context ids alone, which is not part of the output.
    context_text: String,
    /// Everything returned so far, so that `finish` can reconcile with a full decode.
    emitted: String,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer, skip_special: bool) -> Self {
        StreamDecoder {
            tok,
            skip_special,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            context_text: String::new(),
            emitted: String::new(),
        }
    }

    /// A decoder for text that continues `context` (typically the prompt). Its last few
    /// ids seed the window, so that the first generated token decodes as it would in the
    /// middle of a text: with SentencePiece, "▁Paris" after a prompt streams as " Paris",
    /// where a fresh decoder gives "Paris". The output is then
    /// `decode(tail + generated)` minus `decode(tail)`.
    pub fn with_context(tok: &'a Tokenizer, context: &[u32], skip_special: bool) -> Result<Self> {
        // vLLM starts with five tokens of context; that covers every decoder's look-back
        // (one token for the leading space, up to four byte tokens for one character).
        const CONTEXT_TOKENS: usize = 5;
        let tail = &context[context.len().saturating_sub(CONTEXT_TOKENS)..];
        for &id in tail {
            tok.check_id(id)?;
        }
        let context_text = tok.decode_unchecked(tail, skip_special)?;
        Ok(StreamDecoder {
            tok,
            skip_special,
            ids: tail.to_vec(),
            prefix_offset: 0,
            read_offset: tail.len(),
            context_text,
            emitted: String::new(),
        })
    }

    /// Adds one id; returns the text it completes (often empty: an incomplete character, a
    /// skipped special token).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.tok.check_id(id)?;
        self.ids.push(id);
        let prefix_text = self.decode(self.prefix_offset, self.read_offset)?;
        let new_text = self.decode(self.prefix_offset, self.ids.len())?;
        if new_text.ends_with('\u{FFFD}') {
            // An incomplete character: wait for the bytes that complete it. A genuinely
            // invalid sequence is released by the next complete character or by `finish`.
            return Ok(String::new());
        }
        let start = common_prefix_len(&prefix_text, &new_text);
        if new_text.len() <= start {
            return Ok(String::new());
        }
        let out = new_text[start..].to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.emitted.push_str(&out);
        Ok(out)
    }

    /// Returns the text still held back (an incomplete or invalid trailing sequence, shown
    /// as U+FFFD as `decode` shows it). Pushing may continue afterwards.
    pub fn finish(&mut self) -> Result<String> {
        // One full decode at the end makes the invariant exact: whatever the window
        // arithmetic missed, the output ends as `decode(all)` does.
        let full = self.decode(0, self.ids.len())?;
        let rest = match full
            .strip_prefix(self.context_text.as_str())
            .and_then(|text| text.strip_prefix(self.emitted.as_str()))
        {
            Some(rest) => rest.to_string(),
            // The decoder rewrote text already emitted; all we can add is the window's tail.
            None => {
                let prefix_text = self.decode(self.prefix_offset, self.read_offset)?;
                let new_text = self.decode(self.prefix_offset, self.ids.len())?;
                new_text[common_prefix_len(&prefix_text, &new_text)..].to_string()
            }
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.emitted.push_str(&rest);
        Ok(rest)
    }

    fn decode(&self, start: usize, end: usize) -> Result<String> {
        self.tok.decode_unchecked(&self.ids[start..end], self.skip_special)
    }
}

/// Length in bytes of the longest common prefix of `a` and `b`, on a character boundary.
/// For the decoders we meet it is all of `a`; it differs only when adding a token changed
/// text before it.
fn common_prefix_len(a: &str, b: &str) -> usize {
    if b.starts_with(a) {
        return a.len();
    }
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}
