//! OpenAI's API: `GET /v1/models`, `POST /v1/chat/completions` and `/v1/completions`,
//! whole or streamed as server-sent events ending in `data: [DONE]`.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as Sse, Sse as SseBody};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use sluice_tokenizer::ChatMessage;

use crate::api::{self, Api, ApiError, Content, Defaults, MAX_TOP_LOGPROBS, Reply, Sampling, StopField};
use crate::scheduler::{Event, Finish, FinishReason, GenParams, TokenLogprob};
use crate::tools::ToolStream;
use crate::{App, tools};
use tokio::sync::mpsc::UnboundedReceiver;

const API: Api = Api::OpenAi;
/// OpenAI's defaults: temperature 1, top_p 1, no top-k.
const DEFAULTS: Defaults = Defaults { temperature: 1.0, top_p: 1.0, top_k: 0 };
/// Most choices one request may ask for (`n`).
const MAX_CHOICES: usize = 8;

fn model_object(app: &App) -> Value {
    json!({"id": app.cfg.name, "object": "model", "created": app.started, "owned_by": "sluice"})
}

pub async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_object(&app)]})).into_response()
}

pub async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if id == app.cfg.name {
        axum::Json(model_object(&app)).into_response()
    } else {
        ApiError::new(
            API,
            StatusCode::NOT_FOUND,
            format!("the model '{id}' does not exist (this server has '{}')", app.cfg.name),
        )
        .into_response()
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<Content>,
    tool_calls: Option<Value>,
    tool_call_id: Option<String>,
    name: Option<String>,
}

/// Fields both endpoints take.
#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    seed: Option<u64>,
    max_tokens: Option<i64>,
    stop: Option<StopField>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    n: Option<usize>,
    /// An extension (vLLM, llama.cpp): generate past end-of-turn tokens.
    ignore_eos: Option<bool>,
}

#[derive(Deserialize)]
struct ChatRequest {
    messages: Vec<Message>,
    #[serde(flatten)]
    common: Common,
    max_completion_tokens: Option<i64>,
    logprobs: Option<bool>,
    top_logprobs: Option<usize>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    response_format: Option<Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
struct CompletionRequest {
    prompt: Prompt,
    #[serde(flatten)]
    common: Common,
    logprobs: Option<usize>,
    echo: Option<bool>,
    suffix: Option<String>,
}

impl Common {
    fn sampling(&self, max_tokens: Option<i64>, logprobs: Option<usize>) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            stop: self.stop.clone().map(StopField::into_vec).unwrap_or_default(),
            max_tokens: max_tokens.or(self.max_tokens),
            logprobs,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            json_schema: None,
        }
    }

    fn choices(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            0 => Err(ApiError::bad_request(API, "n must be at least 1")),
            n if n > MAX_CHOICES => Err(ApiError::bad_request(API, format!("n may be at most {MAX_CHOICES}, got {n}"))),
            n => Ok(n),
        }
    }
}

fn message_of(m: Message) -> Result<ChatMessage, ApiError> {
    let content = m.content.map(|c| c.text(API)).transpose()?.unwrap_or_default();
    // OpenAI's tool calls carry their arguments as a JSON text; templates (Qwen's,
    // Llama's) write `arguments` out with tojson, so they get the object.
    let tool_calls = m.tool_calls.map(|mut calls| {
        if let Some(list) = calls.as_array_mut() {
            for c in list {
                if let Some(f) = c.get_mut("function")
                    && let Some(Value::String(a)) = f.get("arguments").cloned()
                    && let Ok(v) = serde_json::from_str::<Value>(&a)
                {
                    f["arguments"] = v;
                }
            }
        }
        calls
    });
    Ok(ChatMessage { role: m.role, content, tool_calls, tool_call_id: m.tool_call_id, name: m.name })
}

fn finish_reason(f: &Finish, called: bool) -> &'static str {
    match f.reason {
        _ if called => "tool_calls",
        FinishReason::Eos | FinishReason::StopText(_) => "stop",
        FinishReason::Length => "length",
    }
}

fn usage(finishes: &[Finish]) -> Value {
    let prompt = finishes.first().map_or(0, |f| f.prompt_tokens);
    let cached = finishes.first().map_or(0, |f| f.cached_tokens);
    let completion: usize = finishes.iter().map(|f| f.completion_tokens).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn chat_logprob(lp: &TokenLogprob) -> Value {
    let entry = |t: &str, l: f32| json!({"token": t, "logprob": l, "bytes": t.as_bytes()});
    let mut v = entry(&lp.token, lp.logprob);
    v["top_logprobs"] = lp.top.iter().map(|(t, l)| entry(t, *l)).collect();
    v
}

/// Queues `n` copies of a request (seeds `seed`, `seed + 1`, ...); if one cannot be
/// queued, those already queued are dropped (and so cancelled).
fn submit_choices(app: &App, prompt: &[u32], params: &GenParams, n: usize) -> Result<Vec<Events>, ApiError> {
    (0..n)
        .map(|i| {
            let mut p = params.clone();
            p.sampler.seed = p.sampler.seed.wrapping_add(i as u64);
            api::submit(app, API, prompt.to_vec(), p)
        })
        .collect()
}

/// Submits `n` copies of a request and waits for all.
async fn run_choices(app: &App, prompt: &[u32], params: &GenParams, n: usize) -> Result<Vec<Reply>, ApiError> {
    let mut replies = Vec::with_capacity(n);
    for rx in submit_choices(app, prompt, params, n)? {
        replies.push(api::collect(API, rx).await?);
    }
    Ok(replies)
}

type Events = UnboundedReceiver<Event>;
type SseItem = Result<Sse, Infallible>;
/// How the choices of a streamed response ended, for its usage chunk.
type Finishes = Arc<Mutex<Vec<Finish>>>;

/// A streamed response of several choices: `first` items, then each choice's items
/// (`choice(index, events, finishes)`, which records its `Finish`) as they come, then
/// the usage chunk when asked (`usage_chunk`: the chunk, given the usage) and `[DONE]`.
fn stream_choices<S, C>(first: Vec<SseItem>, rxs: Vec<Events>, mut choice: C, usage_chunk: Option<Value>) -> Response
where
    S: futures_util::Stream<Item = SseItem> + Send + 'static,
    C: FnMut(usize, Events, Finishes) -> S,
{
    let finishes: Finishes = Arc::default();
    let merged = futures_util::stream::select_all(
        rxs.into_iter().enumerate().map(|(i, rx)| choice(i, rx, finishes.clone()).boxed()),
    );
    let end = futures_util::stream::once(async move {
        let mut out = Vec::new();
        if let Some(mut chunk) = usage_chunk {
            chunk["usage"] = usage(&finishes.lock().unwrap());
            out.push(sse(&chunk));
        }
        out.push(sse_done());
        futures_util::stream::iter(out)
    })
    .flatten();
    SseBody::new(futures_util::stream::iter(first).chain(merged).chain(end)).into_response()
}

fn sse(v: &Value) -> Result<Sse, Infallible> {
    Ok(Sse::default().data(v.to_string()))
}

fn sse_done() -> Result<Sse, Infallible> {
    Ok(Sse::default().data("[DONE]"))
}

pub async fn chat(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    match chat_inner(&app, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(app: &Arc<App>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: ChatRequest = api::parse_body(API, &app.metrics, body)?;
    api::check_model(app, API, req.common.model.as_deref())?;
    let n = req.common.choices()?;
    let json_schema = response_schema(req.response_format.as_ref())?;
    if req.top_logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
        return Err(ApiError::bad_request(API, format!("top_logprobs may be at most {MAX_TOP_LOGPROBS}")));
    }
    let use_tools = req.tools.as_ref().is_some_and(|t| !t.is_empty())
        && req.tool_choice.as_ref().and_then(Value::as_str) != Some("none");
    let tools = use_tools.then(|| Value::Array(req.tools.clone().unwrap_or_default()));
    let messages = req.messages.into_iter().map(message_of).collect::<Result<Vec<_>, _>>()?;
    let prompt = api::chat_prompt(app, API, &messages, tools.as_ref())?;
    let logprobs = req.logprobs.unwrap_or(false).then(|| req.top_logprobs.unwrap_or(0));
    let mut sampling = req.common.sampling(req.max_completion_tokens, logprobs);
    sampling.json_schema = json_schema;
    let mut params = sampling.params(app, API, DEFAULTS, prompt.len())?;
    api::add_chat_stop(app, &mut params);
    let id = app.id("chatcmpl-");
    let created = crate::unix_now();
    let name = app.cfg.name.clone();

    if req.common.stream != Some(true) {
        let replies = run_choices(app, &prompt, &params, n).await?;
        let choices: Vec<Value> = replies
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let (content, calls) = if use_tools { tools::parse(&r.text) } else { (r.text.clone(), Vec::new()) };
                let mut message = json!({"role": "assistant", "content": content});
                if !calls.is_empty() {
                    message["content"] = if content.is_empty() { Value::Null } else { Value::String(content) };
                    message["tool_calls"] = tool_calls_json(app, &calls);
                }
                json!({
                    "index": i,
                    "message": message,
                    "logprobs": logprobs.map(|_| json!({"content": r.logprobs.iter().map(chat_logprob).collect::<Vec<_>>()})),
                    "finish_reason": finish_reason(&r.finish, !calls.is_empty()),
                })
            })
            .collect();
        let finishes: Vec<Finish> = replies.iter().map(|r| r.finish).collect();
        return Ok(axum::Json(json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": usage(&finishes),
            "system_fingerprint": null,
        }))
        .into_response());
    }

    let include_usage = req.common.stream_options.is_some_and(|o| o.include_usage);
    let rxs = submit_choices(app, &prompt, &params, n)?;
    let chunk = {
        let (id, name) = (id.clone(), name.clone());
        move |i: usize, delta: Value, logprobs: Option<Value>, finish: Option<&str>| {
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": name,
                "system_fingerprint": null,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            })
        }
    };
    let first = (0..n).map(|i| sse(&chunk(i, json!({"role": "assistant", "content": ""}), None, None))).collect();
    let usage_chunk = include_usage.then(
        || json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": name, "choices": []}),
    );
    let app = app.clone();
    let choice = move |i: usize, rx: Events, finishes: Finishes| {
        let chunk = chunk.clone();
        let app = app.clone();
        // With tools, text that may be a call is held until the reply ends.
        let mut calls = use_tools.then(ToolStream::default);
        api::translate(rx, move |ev| match ev {
            Event::Token { text, logprob } => {
                let text = match &mut calls {
                    Some(c) => c.push(&text),
                    None => text,
                };
                let lp = logprob.as_ref().map(|l| json!({"content": [chat_logprob(l)]}));
                if text.is_empty() && lp.is_none() {
                    return Vec::new();
                }
                vec![sse(&chunk(i, json!({"content": text}), lp, None))]
            }
            Event::Done(f) => {
                let mut out = Vec::new();
                let (content, calls) = calls.take().map(ToolStream::finish).unwrap_or_default();
                if !content.is_empty() {
                    out.push(sse(&chunk(i, json!({"content": content}), None, None)));
                }
                if !calls.is_empty() {
                    let mut list = tool_calls_json(&app, &calls);
                    for (k, c) in list.as_array_mut().into_iter().flatten().enumerate() {
                        c["index"] = json!(k);
                    }
                    out.push(sse(&chunk(i, json!({"tool_calls": list}), None, None)));
                }
                out.push(sse(&chunk(i, json!({}), None, Some(finish_reason(&f, !calls.is_empty())))));
                finishes.lock().unwrap().push(f);
                out
            }
            Event::Failed(m) => vec![sse(&ApiError::new(API, StatusCode::INTERNAL_SERVER_ERROR, m).body())],
        })
    };
    Ok(stream_choices(first, rxs, choice, usage_chunk))
}

/// The schema `response_format` asks the output to follow: none for `text`, any object
/// for `json_object`, `json_schema.schema` for `json_schema`.
fn response_schema(format: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(f) = format else { return Ok(None) };
    match f.get("type").and_then(Value::as_str) {
        None | Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "object"}))),
        Some("json_schema") => match f.get("json_schema").and_then(|j| j.get("schema")) {
            Some(s) if s.is_object() || s.is_boolean() => Ok(Some(s.clone())),
            _ => Err(ApiError::bad_request(API, "response_format json_schema needs json_schema.schema, an object")),
        },
        Some(other) => Err(ApiError::bad_request(
            API,
            format!("response_format '{other}' is not one of text, json_object, json_schema"),
        )),
    }
}

fn tool_calls_json(app: &App, calls: &[tools::ToolCall]) -> Value {
    calls
        .iter()
        .map(|c| json!({"id": app.id("call_"), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
        .collect()
}

pub async fn completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    match completions_inner(&app, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// The completion API's `logprobs` object for a reply.
fn completion_logprobs(lps: &[TokenLogprob], start: usize) -> Value {
    let mut offset = start;
    let mut offsets = Vec::with_capacity(lps.len());
    for l in lps {
        offsets.push(offset);
        offset += l.token.len();
    }
    json!({
        "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|l| l.top.iter().map(|(t, p)| (t.clone(), json!(p))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

async fn completions_inner(app: &Arc<App>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: CompletionRequest = api::parse_body(API, &app.metrics, body)?;
    api::check_model(app, API, req.common.model.as_deref())?;
    let n = req.common.choices()?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad_request(API, "suffix is not supported"));
    }
    if req.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
        return Err(ApiError::bad_request(API, format!("logprobs may be at most {MAX_TOP_LOGPROBS}")));
    }
    let one = |k: usize| {
        (k == 1).then_some(()).ok_or_else(|| ApiError::bad_request(API, "one prompt per request is supported"))
    };
    // Text is encoded as `sluice run` encodes a prompt (with the tokenizer's BOS).
    let (prompt, prompt_text) = match req.prompt {
        Prompt::Text(t) => (api::encode(app, API, &t, true)?, t),
        Prompt::Texts(v) => {
            one(v.len())?;
            (api::encode(app, API, &v[0], true)?, v[0].clone())
        }
        Prompt::Ids(ids) => (check_ids(app, &ids)?, String::new()),
        Prompt::IdLists(v) => {
            one(v.len())?;
            (check_ids(app, &v[0])?, String::new())
        }
    };
    let echo = req
        .echo
        .unwrap_or(false)
        .then(|| if prompt_text.is_empty() { app.tok.decode(&prompt, false).unwrap_or_default() } else { prompt_text });
    let params = req.common.sampling(None, req.logprobs).params(app, API, DEFAULTS, prompt.len())?;
    let id = app.id("cmpl-");
    let created = crate::unix_now();
    let name = app.cfg.name.clone();
    if req.common.stream != Some(true) {
        let replies = run_choices(app, &prompt, &params, n).await?;
        let start = echo.as_ref().map_or(0, String::len);
        let choices: Vec<Value> = replies
            .iter()
            .enumerate()
            .map(|(i, r)| {
                json!({
                    "index": i,
                    "text": format!("{}{}", echo.as_deref().unwrap_or(""), r.text),
                    "logprobs": req.logprobs.map(|_| completion_logprobs(&r.logprobs, start)),
                    "finish_reason": finish_reason(&r.finish, false),
                })
            })
            .collect();
        let finishes: Vec<Finish> = replies.iter().map(|r| r.finish).collect();
        return Ok(axum::Json(json!({
            "id": id, "object": "text_completion", "created": created, "model": name,
            "choices": choices, "usage": usage(&finishes),
        }))
        .into_response());
    }
    let include_usage = req.common.stream_options.is_some_and(|o| o.include_usage);
    let rxs = submit_choices(app, &prompt, &params, n)?;
    let with_logprobs = req.logprobs.is_some();
    let start = echo.as_ref().map_or(0, String::len);
    let chunk = {
        let (id, name) = (id.clone(), name.clone());
        move |i: usize, text: &str, logprobs: Value, finish: Option<&str>| {
            json!({
                "id": id, "object": "text_completion", "created": created, "model": name,
                "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}],
            })
        }
    };
    let first = echo.iter().flat_map(|e| (0..n).map(|i| sse(&chunk(i, e, Value::Null, None)))).collect();
    let usage_chunk = include_usage
        .then(|| json!({"id": id, "object": "text_completion", "created": created, "model": name, "choices": []}));
    let choice = move |i: usize, rx: Events, finishes: Finishes| {
        let chunk = chunk.clone();
        let mut offset = start;
        api::translate(rx, move |ev| match ev {
            Event::Token { text, logprob } => {
                let lp = match (with_logprobs, logprob) {
                    (true, Some(l)) => {
                        let v = completion_logprobs(std::slice::from_ref(&l), offset);
                        offset += l.token.len();
                        v
                    }
                    _ => Value::Null,
                };
                if text.is_empty() && lp.is_null() {
                    return Vec::new();
                }
                vec![sse(&chunk(i, &text, lp, None))]
            }
            Event::Done(f) => {
                finishes.lock().unwrap().push(f);
                vec![sse(&chunk(i, "", Value::Null, Some(finish_reason(&f, false))))]
            }
            Event::Failed(m) => vec![sse(&ApiError::new(API, StatusCode::INTERNAL_SERVER_ERROR, m).body())],
        })
    };
    Ok(stream_choices(first, rxs, choice, usage_chunk))
}

/// Token ids given directly, checked against the vocabulary.
fn check_ids(app: &App, ids: &[u32]) -> Result<Vec<u32>, ApiError> {
    let vocab = app.vocab_size;
    match ids.iter().find(|&&i| i as usize >= vocab) {
        Some(i) => Err(ApiError::bad_request(API, format!("token id {i} is outside the vocabulary (size {vocab})"))),
        None => Ok(ids.to_vec()),
    }
}
