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

/// The inside of a reply that is one fenced code block (```json ... ```).
fn fenced(reply: &str) -> Option<&str> {
    let inner = reply.strip_prefix("```")?.strip_suffix("```")?;
    let inner = inner.strip_prefix("json").unwrap_or(inner);
    (!inner.contains("```")).then(|| inner.trim())
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

    #[test]
    fn text_without_calls_stays() {
        assert_eq!(parse("Paris is sunny."), ("Paris is sunny.".into(), vec![]));
        let broken = "<tool_call>{not json}</tool_call> ok";
        assert_eq!(parse(broken), (broken.into(), vec![]));
        assert_eq!(parse("{\"city\": \"Paris\"}"), ("{\"city\": \"Paris\"}".into(), vec![]));
    }
}
