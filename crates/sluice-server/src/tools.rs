//! Tool calls parsed out of a model's reply, in the forms chat templates ask for:
//! Hermes/Qwen's `<tool_call>{"name": .., "arguments": {..}}</tool_call>` blocks (Qwen2.5,
//! Qwen3, SmolLM3, many fine-tunes) and Llama 3's bare JSON object `{"name": ..,
//! "parameters": {..}}` (optionally after `<|python_tag|>`), which is the whole reply.
//! Small models given Hermes-style tools often write the call as a fenced JSON block
//! instead (Qwen2.5-Coder-1.5B does): a reply that is one such block counts too.

use serde_json::Value;

/// One call: the function's name and its arguments as a JSON text (OpenAI's form).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// The reply's text outside any call, and the calls, in order. A block whose JSON does
/// not parse as a call stays in the text.
pub fn parse(reply: &str) -> (String, Vec<ToolCall>) {
    let (text, calls) = blocks(reply);
    if calls.is_empty() {
        let bare = reply.trim().trim_start_matches("<|python_tag|>").trim();
        let bare = fenced(bare).unwrap_or(bare);
        if bare.starts_with('{')
            && let Some(c) = call_of(bare)
        {
            return (String::new(), vec![c]);
        }
    }
    (text.trim().to_string(), calls)
}

/// The `<tool_call>` blocks of a reply, and its text outside them as it is.
fn blocks(reply: &str) -> (String, Vec<ToolCall>) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut calls = Vec::new();
    let mut text = String::new();
    let mut rest = reply;
    while let Some(at) = rest.find(OPEN) {
        let after = &rest[at + OPEN.len()..];
        // An unclosed last block (the reply ended at the limit, or at the end-of-turn
        // token before the closing tag) still counts when its JSON is whole.
        let (body, next) = match after.find(CLOSE) {
            Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
            None => (after, ""),
        };
        match call_of(body.trim()) {
            Some(c) => {
                text += &rest[..at];
                calls.push(c);
            }
            None => text += &rest[..at + OPEN.len() + body.len() + if next.is_empty() { 0 } else { CLOSE.len() }],
        }
        rest = next;
    }
    text += rest;
    (text, calls)
}

/// The inside of a reply that is one fenced code block (```json ... ```).
fn fenced(reply: &str) -> Option<&str> {
    let inner = reply.strip_prefix("```")?.strip_suffix("```")?;
    let inner = inner.strip_prefix("json").unwrap_or(inner);
    (!inner.contains("```")).then(|| inner.trim())
}

/// A streamed reply with tools on: text goes out as it comes, except what may be a call.
/// A reply that may be one whole JSON call (it starts with `{`, `<|python_tag|>` or a
/// fenced ```` ```json {```` block) is held to its end; otherwise text is shown up to the
/// first `<tool_call>`, holding back a tail that may begin one, and everything from
/// there on is held. [`ToolStream::finish`] parses what was held.
#[derive(Default)]
pub struct ToolStream {
    /// Text not shown yet.
    held: String,
    /// Whether the reply is past its beginning (it is not one whole JSON call).
    open: bool,
    /// Whether a `<tool_call>` has been seen: the rest is held.
    in_call: bool,
}

/// What the beginning of a reply says about it being one whole JSON call.
#[derive(PartialEq, Debug)]
enum Start {
    Call,
    Maybe,
    Text,
}

fn start_of(reply: &str) -> Start {
    const TAG: &str = "<|python_tag|>";
    let t = reply.trim_start();
    if t.is_empty() || (TAG.starts_with(t) && t.len() < TAG.len()) {
        return Start::Maybe;
    }
    let t = t.strip_prefix(TAG).unwrap_or(t).trim_start();
    if t.is_empty() || t.starts_with('{') {
        return if t.is_empty() { Start::Maybe } else { Start::Call };
    }
    let Some(rest) = t.strip_prefix("```") else {
        return if "```".starts_with(t) { Start::Maybe } else { Start::Text };
    };
    if rest.len() < 4 && "json".starts_with(rest) {
        return Start::Maybe;
    }
    let rest = rest.strip_prefix("json").unwrap_or(rest).trim_start();
    match rest.chars().next() {
        None => Start::Maybe,
        Some('{') => Start::Call,
        Some(_) => Start::Text,
    }
}

impl ToolStream {
    /// Takes the next piece of the reply; returns the text that may be shown now.
    pub fn push(&mut self, text: &str) -> String {
        const OPEN: &str = "<tool_call>";
        self.held += text;
        if self.in_call {
            return String::new();
        }
        if !self.open {
            match start_of(&self.held) {
                Start::Text => self.open = true,
                Start::Call | Start::Maybe => return String::new(),
            }
        }
        if let Some(at) = self.held.find(OPEN) {
            self.in_call = true;
            let shown = self.held[..at].to_string();
            self.held.drain(..at);
            return shown;
        }
        // Hold a tail that may be the beginning of `<tool_call>`.
        let keep = (1..OPEN.len())
            .rev()
            .find(|&n| {
                self.held.len() >= n
                    && self.held.is_char_boundary(self.held.len() - n)
                    && self.held.ends_with(&OPEN[..n])
            })
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let shown = self.held[..cut].to_string();
        self.held.drain(..cut);
        shown
    }

    /// At the end of the reply: the text still to show and the calls.
    pub fn finish(self) -> (String, Vec<ToolCall>) {
        match (self.open, self.in_call) {
            (true, false) => (self.held, Vec::new()),
            // Text before the first block has been shown as it was: the rest is not trimmed either.
            (_, true) => blocks(&self.held),
            (false, false) => parse(&self.held),
        }
    }
}

/// `{"name": "f", "arguments": {..}}` or `{"name": "f", "parameters": {..}}` as a call.
fn call_of(json: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(json).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters")).cloned().unwrap_or(Value::Object(Default::default()));
    let arguments = match args {
        // Some models write the arguments as a JSON string already.
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall { name: name.into(), arguments: arguments.into() }
    }

    #[test]
    fn hermes_blocks() {
        let r = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        assert_eq!(parse(r), ("Let me look.".into(), vec![call("get_weather", r#"{"city":"Paris"}"#)]));
        let two = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": {\"x\": 1}}</tool_call>";
        assert_eq!(parse(two), (String::new(), vec![call("a", "{}"), call("b", r#"{"x":1}"#)]));
        // Unclosed at the end of the reply.
        assert_eq!(parse("<tool_call>{\"name\": \"a\", \"arguments\": {}}"), (String::new(), vec![call("a", "{}")]));
    }

    #[test]
    fn llama3_bare_json() {
        let r = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}";
        assert_eq!(parse(r), (String::new(), vec![call("get_weather", r#"{"city":"Oslo"}"#)]));
        let tagged = "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}";
        assert_eq!(parse(tagged).1, vec![call("f", "{}")]);
        // Qwen2.5-Coder-1.5B's answer to a get_weather tool, as it wrote it.
        let fence =
            "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\n    \"city\": \"Paris\"\n  }\n}\n```";
        assert_eq!(parse(fence), (String::new(), vec![call("get_weather", r#"{"city":"Paris"}"#)]));
        // A code block that is not a call stays text.
        assert_eq!(parse("```json\n{\"a\": 1}\n```").1, vec![]);
    }

    /// Streamed in pieces of every size, a reply shows its text before any call as it
    /// comes, and ends with the same text and calls as parsed whole.
    #[test]
    fn streamed_replies_match_whole() {
        let replies = [
            "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\"city\": \"Paris\"}\n}\n```",
            "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}",
            "```python\nprint('<tool' + '_call>')\n```",
            "Paris is sunny. <tool and more < text",
            "  {\"city\": \"Paris\"}",
            "<tool_call>{not json}</tool_call> ok",
            "Two: <tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call> then <tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>",
        ];
        for reply in replies {
            let (want_text, want_calls) = parse(reply);
            for size in [1, 2, 3, 5, 100] {
                let mut s = ToolStream::default();
                let mut shown = String::new();
                let chars: Vec<char> = reply.chars().collect();
                for piece in chars.chunks(size) {
                    shown += &s.push(&piece.iter().collect::<String>());
                }
                let (rest, calls) = s.finish();
                shown += &rest;
                assert_eq!((shown.trim(), &calls), (want_text.as_str(), &want_calls), "{reply:?} in pieces of {size}");
            }
        }
        // Text before a call goes out before the reply ends.
        let mut s = ToolStream::default();
        assert_eq!(s.push("Let me "), "Let me ");
        assert_eq!(s.push("look. <tool"), "look. ");
        assert_eq!(s.push("_call>{\"name\""), "");
        // A code block that is not JSON is shown once that is clear.
        let mut s = ToolStream::default();
        assert_eq!(s.push("```"), "");
        assert_eq!(s.push("rust\nfn"), "```rust\nfn");
    }

    #[test]
    fn text_without_calls_stays() {
        assert_eq!(parse("Paris is sunny."), ("Paris is sunny.".into(), vec![]));
        let broken = "<tool_call>{not json}</tool_call> ok";
        assert_eq!(parse(broken), (broken.into(), vec![]));
        assert_eq!(parse("{\"city\": \"Paris\"}"), ("{\"city\": \"Paris\"}".into(), vec![]));
    }
}
