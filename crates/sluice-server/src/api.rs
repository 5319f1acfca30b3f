//! What the three APIs share: errors in each one's shape, request bodies parsed with
//! an error that says what is wrong, sampling parameters checked, and a request turned
//! into a queued job whose events come back on a channel.

use std::sync::atomic::Ordering;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::json;
use sluice_engine::SamplerConfig;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::grammar::{Grammar, Grammars};
use crate::scheduler::{Event, Finish, GenParams, Job, Refused, TokenLogprob};
use crate::{App, Metrics};

/// Whose error shape a response takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    OpenAi,
    Anthropic,
    Ollama,
}

impl Api {
    pub fn of_path(path: &str) -> Api {
        if path.starts_with("/api/") {
            Api::Ollama
        } else if path.starts_with("/v1/messages") {
            Api::Anthropic
        } else {
            Api::OpenAi
        }
    }
}

/// An error answered in the API's own shape with its status.
#[derive(Debug)]
pub struct ApiError {
    pub api: Api,
    pub status: StatusCode,
    pub message: String,
    /// Seconds a client should wait before trying again (503).
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(api: Api, status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { api, status, message: message.into(), retry_after: None }
    }

    pub fn bad_request(api: Api, message: impl Into<String>) -> Self {
        ApiError::new(api, StatusCode::BAD_REQUEST, message)
    }

    /// The `error` object of this error (OpenAI's and Anthropic's type names).
    fn kind(&self) -> &'static str {
        match (self.api, self.status.as_u16()) {
            (Api::Anthropic, 400 | 413 | 422) => "invalid_request_error",
            (Api::Anthropic, 401) => "authentication_error",
            (Api::Anthropic, 404) => "not_found_error",
            (Api::Anthropic, 503 | 529) => "overloaded_error",
            (Api::Anthropic, 408) => "timeout_error",
            (Api::Anthropic, _) => "api_error",
            (_, 400 | 408 | 413 | 422) => "invalid_request_error",
            (_, 401) => "authentication_error",
            (_, 404) => "not_found_error",
            (_, 503) => "server_overloaded",
            _ => "server_error",
        }
    }

    /// The body, in the API's shape.
    pub fn body(&self) -> serde_json::Value {
        match self.api {
            Api::OpenAi => {
                json!({"error": {"message": self.message, "type": self.kind(), "param": null, "code": null}})
            }
            Api::Anthropic => json!({"type": "error", "error": {"type": self.kind(), "message": self.message}}),
            Api::Ollama => json!({"error": self.message}),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// Parses a JSON body, answering a body too large with 413 and anything else wrong
/// with 400 naming what serde found.
pub fn parse_body<T: DeserializeOwned>(
    api: Api,
    metrics: &Metrics,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let fail = |e: ApiError| {
        metrics.rejected.fetch_add(1, Ordering::Relaxed);
        e
    };
    let bytes = body.map_err(|e| {
        fail(match e.status() {
            StatusCode::PAYLOAD_TOO_LARGE => {
                ApiError::new(api, StatusCode::PAYLOAD_TOO_LARGE, "request body too large")
            }
            s => ApiError::new(api, s, e.body_text()),
        })
    })?;
    serde_json::from_slice(&bytes).map_err(|e| fail(ApiError::bad_request(api, format!("invalid request body: {e}"))))
}

/// A message's content as OpenAI and Anthropic give it: a string, or a list of typed
/// parts (`{"type": "text", "text": ..}`), of which only text is taken.
#[derive(serde::Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(serde::Deserialize, Debug)]
pub struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

impl Content {
    /// The text, its parts joined; a part that is not text is refused naming its type.
    pub fn text(self, api: Api) -> Result<String, ApiError> {
        match self {
            Content::Text(t) => Ok(t),
            Content::Parts(parts) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => text += &t,
                        (kind, _) => {
                            return Err(ApiError::bad_request(
                                api,
                                format!("content parts of type '{kind}' are not supported (text only)"),
                            ));
                        }
                    }
                }
                Ok(text)
            }
        }
    }
}

/// One `stop` value: a string or a list of them.
#[derive(serde::Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// Most stop texts a request may give, and the longest one.
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 512;

/// Sampling parameters as a request gives them, with the API's defaults.
#[derive(Debug, Default)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub max_tokens: Option<i64>,
    pub logprobs: Option<usize>,
    pub ignore_eos: bool,
    /// Output constrained to JSON following this schema.
    pub json_schema: Option<serde_json::Value>,
}

/// Defaults of one API: temperature, top_p, top_k (0: none).
pub struct Defaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
}

impl Sampling {
    /// Checks the values and fills in the defaults; `prompt_len` and the context
    /// bound `max_tokens` (when not given: the rest of the context).
    pub fn params(mut self, app: &App, api: Api, defaults: Defaults, prompt_len: usize) -> Result<GenParams, ApiError> {
        let context = app.context;
        let bad = |m: String| ApiError::bad_request(api, m);
        let temperature = self.temperature.unwrap_or(defaults.temperature);
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(bad(format!("temperature must be a number >= 0, got {temperature}")));
        }
        let top_p = self.top_p.unwrap_or(defaults.top_p);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(bad(format!("top_p must be in (0, 1], got {top_p}")));
        }
        let top_k = match self.top_k {
            None => defaults.top_k,
            Some(k) if k >= 0 => k as usize,
            Some(k) => return Err(bad(format!("top_k must be >= 0, got {k}"))),
        };
        if self.stop.len() > MAX_STOPS {
            return Err(bad(format!("at most {MAX_STOPS} stop sequences, got {}", self.stop.len())));
        }
        self.stop.retain(|s| !s.is_empty());
        if let Some(s) = self.stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(bad(format!("a stop sequence may be at most {MAX_STOP_BYTES} bytes, got {}", s.len())));
        }
        if prompt_len == 0 {
            return Err(bad("the prompt is empty".into()));
        }
        if prompt_len >= context {
            return Err(bad(format!(
                "the prompt is {prompt_len} tokens, but the model's context holds {context} (with room for one more)"
            )));
        }
        let room = context - prompt_len;
        let max_tokens = match self.max_tokens {
            None => room,
            Some(n) if n < 1 => return Err(bad(format!("max_tokens must be at least 1, got {n}"))),
            Some(n) if n as u64 > room as u64 => {
                return Err(bad(format!(
                    "the model's context holds {context} tokens, but {} were asked for ({prompt_len} of prompt, \
                     {n} to generate)",
                    prompt_len as u64 + n as u64
                )));
            }
            Some(n) => n as usize,
        };
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
        });
        Ok(GenParams {
            max_tokens,
            sampler: SamplerConfig { temperature, top_k, top_p, seed },
            stop: self.stop,
            logprobs: self.logprobs,
            ignore_eos: self.ignore_eos,
            grammar: self.json_schema.map(|s| json_grammar(app, api, s)).transpose()?,
        })
    }
}

/// Largest `top_logprobs` (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Queues a request; its events come back on the channel returned.
pub fn submit(app: &App, api: Api, prompt: Vec<u32>, params: GenParams) -> Result<UnboundedReceiver<Event>, ApiError> {
    let (tx, rx) = unbounded_channel();
    app.metrics.requests.fetch_add(1, Ordering::Relaxed);
    match app.scheduler.submit(Job { prompt, params, events: tx }) {
        Ok(()) => Ok(rx),
        Err(Refused::Busy { queued }) => {
            app.metrics.rejected.fetch_add(1, Ordering::Relaxed);
            let mut e = ApiError::new(
                api,
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the server is busy ({queued} requests waiting); try again shortly"),
            );
            e.retry_after = Some(1);
            Err(e)
        }
        Err(Refused::Stopped) => {
            Err(ApiError::new(api, StatusCode::INTERNAL_SERVER_ERROR, "the model's scheduler has stopped"))
        }
    }
}

/// A whole reply, for answers that are not streamed.
pub struct Reply {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Finish,
}

/// Waits for a request's events and joins them into its reply.
pub async fn collect(api: Api, mut rx: UnboundedReceiver<Event>) -> Result<Reply, ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { text: t, logprob } => {
                text += &t;
                logprobs.extend(logprob);
            }
            Event::Done(finish) => return Ok(Reply { text, logprobs, finish }),
            Event::Failed(m) => return Err(ApiError::new(api, StatusCode::INTERNAL_SERVER_ERROR, m)),
        }
    }
    Err(ApiError::new(api, StatusCode::INTERNAL_SERVER_ERROR, "the request ended without a reply"))
}

/// A matcher for JSON following `schema`; the vocabulary's trie is built at the first.
fn json_grammar(app: &App, api: Api, schema: serde_json::Value) -> Result<Grammar, ApiError> {
    let grammars =
        app.grammars.get_or_init(|| Grammars::new(app.tok.clone(), app.vocab_size, app.eos).map(std::sync::Arc::new));
    let grammars = grammars.as_ref().map_err(|e| {
        ApiError::new(api, StatusCode::INTERNAL_SERVER_ERROR, format!("constrained output is not available: {e}"))
    })?;
    grammars.json(schema).map_err(|e| ApiError::bad_request(api, format!("the JSON schema cannot be used: {e}")))
}

/// A request naming another model than the one served is 404 (naming none is fine).
pub fn check_model(app: &App, api: Api, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if !m.is_empty() && m != app.cfg.name => Err(ApiError::new(
            api,
            StatusCode::NOT_FOUND,
            format!("the model '{m}' does not exist (this server has '{}')", app.cfg.name),
        )),
        _ => Ok(()),
    }
}

/// Encodes a rendered chat prompt or a plain text, answering a tokenizer error with 400.
pub fn encode(app: &App, api: Api, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
    app.tok.encode(text, add_special).map_err(|e| ApiError::bad_request(api, e.to_string()))
}

/// A request's events turned into a stream of items (SSE events, NDJSON lines): `f`
/// maps each event to the items it writes; the stream ends after the last event.
/// Dropping the stream (the client went away) drops the channel, which stops the
/// request's sequence at the scheduler's next step.
pub fn translate<T, F>(rx: UnboundedReceiver<Event>, f: F) -> impl futures_util::Stream<Item = T> + Send
where
    T: Send + 'static,
    F: FnMut(Event) -> Vec<T> + Send + 'static,
{
    use futures_util::StreamExt;
    futures_util::stream::unfold((rx, f, false), |(mut rx, mut f, done)| async move {
        if done {
            return None;
        }
        let ev = rx.recv().await.unwrap_or_else(|| Event::Failed("the request ended without a reply".into()));
        let end = matches!(ev, Event::Done(_) | Event::Failed(_));
        let items = f(ev);
        Some((futures_util::stream::iter(items), (rx, f, end)))
    })
    .flatten()
}

/// A conversation rendered by the model's chat template and encoded; `tools` as HF's
/// `tools=` argument gives them to the template.
pub fn chat_prompt(
    app: &App,
    api: Api,
    messages: &[sluice_tokenizer::ChatMessage],
    tools: Option<&serde_json::Value>,
) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request(api, "messages is empty"));
    }
    let text = app
        .tok
        .apply_chat_template_with_tools(messages, tools, true)
        .map_err(|e| ApiError::bad_request(api, e.to_string()))?;
    encode(app, api, &text, false)
}

/// A chat reply also ends at the template's own stop text (a base model's transcript).
pub fn add_chat_stop(app: &App, params: &mut GenParams) {
    params.stop.extend(app.cfg.chat_stop.clone());
}
