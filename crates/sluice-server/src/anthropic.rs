//! Anthropic's Messages API: `POST /v1/messages`, whole or streamed as its named
//! server-sent events (`message_start`, `content_block_delta`, ..., `message_stop`).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::sse::{Event as Sse, Sse as SseBody};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use sluice_tokenizer::ChatMessage;

use crate::App;
use crate::api::{self, Api, ApiError, Content, Defaults, Sampling};
use crate::scheduler::{Event, Finish, FinishReason, GenParams};

const API: Api = Api::Anthropic;
/// Anthropic's defaults: temperature 1, no top-p or top-k cut.
const DEFAULTS: Defaults = Defaults { temperature: 1.0, top_p: 1.0, top_k: 0 };

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Content,
}

#[derive(Deserialize)]
struct Request {
    model: Option<String>,
    messages: Vec<Message>,
    max_tokens: i64,
    system: Option<Content>,
    stop_sequences: Option<Vec<String>>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    stream: Option<bool>,
}

/// Anthropic's stop reason; stop texts from `user_stops` on are the template's own (a
/// base model's next "User:" line), which end the turn.
fn stop_reason(f: &Finish, params: &GenParams, user_stops: usize) -> (&'static str, Option<String>) {
    match f.reason {
        FinishReason::Eos => ("end_turn", None),
        FinishReason::StopText(i) if i >= user_stops => ("end_turn", None),
        FinishReason::StopText(i) => ("stop_sequence", Some(params.stop[i].clone())),
        FinishReason::Length => ("max_tokens", None),
    }
}

pub async fn messages(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    match messages_inner(&app, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

fn sse(name: &str, v: &Value) -> Result<Sse, Infallible> {
    Ok(Sse::default().event(name).data(v.to_string()))
}

async fn messages_inner(app: &Arc<App>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: Request = api::parse_body(API, &app.metrics, body)?;
    api::check_model(app, API, req.model.as_deref())?;
    let mut messages = Vec::new();
    if let Some(s) = req.system {
        messages.push(ChatMessage::new("system", s.text(API)?));
    }
    for m in req.messages {
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::bad_request(API, format!("messages: role '{}' is not user or assistant", m.role)));
        }
        messages.push(ChatMessage::new(m.role, m.content.text(API)?));
    }
    let prompt = api::chat_prompt(app, API, &messages, None)?;
    let sampling = Sampling {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        seed: None,
        stop: req.stop_sequences.unwrap_or_default(),
        max_tokens: Some(req.max_tokens),
        logprobs: None,
        ignore_eos: false,
        json_schema: None,
    };
    let mut params = sampling.params(app, API, DEFAULTS, prompt.len())?;
    let user_stops = params.stop.len();
    api::add_chat_stop(app, &mut params);
    let prompt_tokens = prompt.len();
    let rx = api::submit(app, API, prompt, params.clone())?;
    let id = app.id("msg_");
    let name = app.cfg.name.clone();

    if req.stream != Some(true) {
        let r = api::collect(API, rx).await?;
        let (reason, sequence) = stop_reason(&r.finish, &params, user_stops);
        return Ok(axum::Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": name,
            "content": [{"type": "text", "text": r.text}],
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": r.finish.prompt_tokens, "output_tokens": r.finish.completion_tokens,
                      "cache_read_input_tokens": r.finish.cached_tokens},
        }))
        .into_response());
    }
    let start = vec![
        sse(
            "message_start",
            &json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": name, "content": [],
                "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
            }}),
        ),
        sse(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        sse("ping", &json!({"type": "ping"})),
    ];
    let events = api::translate(rx, move |ev| match ev {
        Event::Token { text, .. } if text.is_empty() => Vec::new(),
        Event::Token { text, .. } => vec![sse(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
        )],
        Event::Done(f) => {
            let (reason, sequence) = stop_reason(&f, &params, user_stops);
            vec![
                sse("content_block_stop", &json!({"type": "content_block_stop", "index": 0})),
                sse(
                    "message_delta",
                    &json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                            "usage": {"output_tokens": f.completion_tokens}}),
                ),
                sse("message_stop", &json!({"type": "message_stop"})),
            ]
        }
        Event::Failed(m) => vec![sse("error", &ApiError::new(API, StatusCode::INTERNAL_SERVER_ERROR, m).body())],
    });
    Ok(SseBody::new(futures_util::stream::iter(start).chain(events)).into_response())
}
