//! Ollama's API: `POST /api/chat` and `/api/generate` (streamed as newline-delimited
//! JSON unless `"stream": false`), `GET /api/tags`, `POST /api/show`, `GET /api/version`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use sluice_tokenizer::ChatMessage;

use crate::App;
use crate::api::{self, Api, ApiError, Defaults, Sampling, StopField};
use crate::scheduler::{Event, Finish, FinishReason};

const API: Api = Api::Ollama;
/// Ollama's defaults: temperature 0.8, top_k 40, top_p 0.9.
const DEFAULTS: Defaults = Defaults { temperature: 0.8, top_p: 0.9, top_k: 40 };

#[derive(Deserialize, Default)]
struct Options {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    seed: Option<u64>,
    /// Tokens to generate; -1 (or absent): until the end or the context.
    num_predict: Option<i64>,
    stop: Option<StopField>,
}

impl Options {
    fn sampling(self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            stop: self.stop.map(StopField::into_vec).unwrap_or_default(),
            max_tokens: self.num_predict.filter(|&n| n >= 0),
            logprobs: None,
            ignore_eos: false,
            json_schema: None,
        }
    }
}

#[derive(Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: String,
    images: Option<Vec<Value>>,
}

#[derive(Deserialize)]
struct ChatRequest {
    model: Option<String>,
    messages: Vec<Message>,
    stream: Option<bool>,
    #[serde(default)]
    options: Options,
    format: Option<Value>,
}

#[derive(Deserialize)]
struct GenerateRequest {
    model: Option<String>,
    #[serde(default)]
    prompt: String,
    system: Option<String>,
    /// The prompt as it is, without the chat template.
    raw: Option<bool>,
    stream: Option<bool>,
    #[serde(default)]
    options: Options,
    format: Option<Value>,
    images: Option<Vec<Value>>,
}

/// An RFC 3339 UTC time, as Ollama writes `created_at` and `modified_at`.
fn rfc3339(unix: u64) -> String {
    let (days, secs) = (unix / 86400, unix % 86400);
    let (y, m, d) = sluice_tokenizer::civil_from_days(days as i64);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs / 60 % 60, secs % 60)
}

/// The schema `format` asks the output to follow ("json": any object; an object: that
/// JSON schema); images are refused.
fn output_schema(format: Option<Value>, images: bool) -> Result<Option<Value>, ApiError> {
    if images {
        return Err(ApiError::bad_request(API, "images are not supported (text only)"));
    }
    match format {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) if s == "json" => Ok(Some(json!({"type": "object"}))),
        Some(schema @ Value::Object(_)) => Ok(Some(schema)),
        Some(other) => {
            Err(ApiError::bad_request(API, format!("format must be \"json\" or a JSON schema, got {other}")))
        }
    }
}

fn done_reason(f: &Finish) -> &'static str {
    match f.reason {
        FinishReason::Eos | FinishReason::StopText(_) => "stop",
        FinishReason::Length => "length",
    }
}

/// The closing object's timings (nanoseconds) and counts.
fn stats(f: &Finish, begun: Instant) -> Value {
    let ns = |s: f64| (s * 1e9) as u64;
    json!({
        "done": true,
        "done_reason": done_reason(f),
        "total_duration": begun.elapsed().as_nanos() as u64,
        "load_duration": 0,
        "prompt_eval_count": f.prompt_tokens,
        "prompt_eval_duration": ns(f.prefill_s),
        "eval_count": f.completion_tokens,
        "eval_duration": ns(f.decode_s),
    })
}

fn merge(mut a: Value, b: Value) -> Value {
    if let (Some(a), Value::Object(b)) = (a.as_object_mut(), b) {
        a.extend(b);
    }
    a
}

/// How each API route writes a piece of text: a chat `message` or a `response`.
#[derive(Clone, Copy)]
enum Shape {
    Chat,
    Generate,
}

impl Shape {
    fn piece(self, name: &str, text: &str) -> Value {
        let head = json!({"model": name, "created_at": rfc3339(crate::unix_now())});
        match self {
            Shape::Chat => merge(head, json!({"message": {"role": "assistant", "content": text}, "done": false})),
            Shape::Generate => merge(head, json!({"response": text, "done": false})),
        }
    }
}

/// Runs a prompt and answers in `shape`, streamed as NDJSON or whole.
async fn respond(
    app: &App,
    shape: Shape,
    prompt: Vec<u32>,
    sampling: Sampling,
    stream: bool,
    chat: bool,
) -> Result<Response, ApiError> {
    let begun = Instant::now();
    let mut params = sampling.params(app, API, DEFAULTS, prompt.len())?;
    if chat {
        api::add_chat_stop(app, &mut params);
    }
    let rx = api::submit(app, API, prompt, params)?;
    let name = app.cfg.name.clone();
    if !stream {
        let r = api::collect(API, rx).await?;
        return Ok(axum::Json(merge(shape.piece(&name, &r.text), stats(&r.finish, begun))).into_response());
    }
    let lines = api::translate(rx, move |ev| {
        let line = match ev {
            Event::Token { text, .. } if text.is_empty() => return Vec::new(),
            Event::Token { text, .. } => shape.piece(&name, &text),
            Event::Done(f) => merge(shape.piece(&name, ""), stats(&f, begun)),
            Event::Failed(m) => json!({"error": m}),
        };
        vec![Ok::<_, std::convert::Infallible>(format!("{line}\n"))]
    });
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(lines)).into_response())
}

pub async fn chat(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let req: ChatRequest = api::parse_body(API, &app.metrics, body)?;
        api::check_model(&app, API, req.model.as_deref())?;
        let images = req.messages.iter().any(|m| m.images.as_ref().is_some_and(|i| !i.is_empty()));
        let schema = output_schema(req.format, images)?;
        let messages: Vec<ChatMessage> =
            req.messages.into_iter().map(|m| ChatMessage::new(m.role, m.content)).collect();
        let prompt = api::chat_prompt(&app, API, &messages, None)?;
        let mut sampling = req.options.sampling();
        sampling.json_schema = schema;
        respond(&app, Shape::Chat, prompt, sampling, req.stream.unwrap_or(true), true).await
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn generate(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let req: GenerateRequest = api::parse_body(API, &app.metrics, body)?;
        api::check_model(&app, API, req.model.as_deref())?;
        let schema = output_schema(req.format, req.images.as_ref().is_some_and(|i| !i.is_empty()))?;
        if req.prompt.is_empty() {
            // Ollama answers an empty prompt by loading the model; it is loaded.
            let head = Shape::Generate.piece(&app.cfg.name, "");
            return Ok(axum::Json(merge(head, json!({"done": true, "done_reason": "load"}))).into_response());
        }
        let raw = req.raw.unwrap_or(false);
        let prompt = if raw {
            api::encode(&app, API, &req.prompt, true)?
        } else {
            let mut messages = Vec::new();
            messages.extend(req.system.map(|s| ChatMessage::new("system", s)));
            messages.push(ChatMessage::new("user", req.prompt));
            api::chat_prompt(&app, API, &messages, None)?
        };
        let mut sampling = req.options.sampling();
        sampling.json_schema = schema;
        respond(&app, Shape::Generate, prompt, sampling, req.stream.unwrap_or(true), !raw).await
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// "135M", "1.5B": a parameter count as Ollama shows it.
fn parameter_size(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n => format!("{}M", (n as f64 / 1e6).round()),
    }
}

fn details(app: &App) -> Value {
    let i = &app.cfg.info;
    json!({
        "parent_model": "",
        "format": i.format,
        "family": i.family,
        "families": [i.family],
        "parameter_size": parameter_size(i.parameters),
        "quantization_level": i.quantization,
    })
}

pub async fn tags(State(app): State<Arc<App>>) -> Response {
    let i = &app.cfg.info;
    axum::Json(json!({"models": [{
        "name": app.cfg.name,
        "model": app.cfg.name,
        "modified_at": rfc3339(app.started),
        "size": i.size_bytes,
        "digest": "",
        "details": details(&app),
    }]}))
    .into_response()
}

#[derive(Deserialize)]
struct ShowRequest {
    model: Option<String>,
    name: Option<String>,
}

pub async fn show(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let req: ShowRequest = api::parse_body(API, &app.metrics, body)?;
        let asked = req.model.or(req.name).unwrap_or_default();
        if asked != app.cfg.name {
            return Err(ApiError::new(API, StatusCode::NOT_FOUND, format!("model '{asked}' not found")));
        }
        let i = &app.cfg.info;
        let arch = &i.architecture;
        Ok(axum::Json(json!({
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": details(&app),
            "model_info": {
                "general.architecture": arch,
                "general.parameter_count": i.parameters,
                format!("{arch}.context_length"): i.context_length,
                format!("{arch}.block_count"): i.layers,
                format!("{arch}.embedding_length"): i.hidden_size,
                format!("{arch}.vocab_size"): i.vocab_size,
            },
            "capabilities": ["completion"],
            "modified_at": rfc3339(app.started),
        }))
        .into_response())
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn version() -> Response {
    axum::Json(json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_169_600 + 3661), "2026-12-02T01:01:01Z");
    }
}
