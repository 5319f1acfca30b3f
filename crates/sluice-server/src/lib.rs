//! `sluice serve`: OpenAI's, Anthropic's and Ollama's HTTP APIs over one model, its
//! requests run together by a continuous-batching scheduler.
//!
//! The HTTP side (axum on a small tokio runtime) parses and checks a request, turns it
//! into prompt tokens and generation parameters, and queues it with the [`Scheduler`],
//! whose own thread owns every model step; events (text, the end, an error) come back
//! on a channel per request and are written in the API's own shape, streamed or whole.
//! A client that goes away drops its channel, and the scheduler drops its sequence
//! at the next step.

mod anthropic;
mod api;
mod grammar;
mod metrics;
mod ollama;
mod openai;
mod prefix;
mod scheduler;
mod tools;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use sluice_core::{Error, Precision, Result};
use sluice_engine::{Backend, Model};
use sluice_tokenizer::Tokenizer;

pub use metrics::Metrics;
pub use scheduler::{Event, Finish, FinishReason, GenParams, Job, Limits, Refused, Scheduler};

use api::{Api, ApiError};

/// The activations a server computes with when none was asked for: 8 bits, as
/// llama.cpp does. A server's steps carry many sequences' rows, where arithmetic
/// binds and 16-bit activations cost up to twice as much: Qwen2.5-Coder-1.5B at 64
/// streaming clients (2 cores, AVX-512) gave 114 tok/s with 16-bit activations, 149
/// with 8-bit, llama-server 130. Load the model with this unless the user chose.
pub const DEFAULT_PRECISION: Precision = Precision::Fast;

/// How the server runs, beyond the model.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub host: String,
    /// 0 picks a free port (printed when listening).
    pub port: u16,
    /// Required as a bearer token (or `x-api-key`) when set.
    pub api_key: Option<String>,
    /// The model's name in responses and `/v1/models`.
    pub name: String,
    /// Largest request body accepted, bytes.
    pub max_body_bytes: usize,
    /// How long a request body may take to arrive (a client that stalls halfway gets
    /// 408 after it).
    pub body_timeout: std::time::Duration,
    pub limits: Limits,
    /// A stop text every chat reply ends at (a base model's transcript template).
    pub chat_stop: Option<String>,
    /// What `/api/show` and `/api/tags` describe.
    pub info: ModelInfo,
}

/// A description of the model for Ollama's routes.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ModelInfo {
    pub path: String,
    pub format: String,
    pub family: String,
    pub architecture: String,
    pub parameters: u64,
    pub size_bytes: u64,
    pub quantization: String,
    pub context_length: usize,
    pub layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
}

/// What every handler sees.
pub(crate) struct App {
    pub cfg: ServeConfig,
    pub tok: Arc<Tokenizer>,
    pub scheduler: Scheduler,
    pub metrics: Arc<Metrics>,
    pub context: usize,
    pub vocab_size: usize,
    /// The id that ends a reply, for grammars.
    pub eos: u32,
    /// Built at the first constrained request (it walks the whole vocabulary).
    pub grammars: std::sync::OnceLock<std::result::Result<Arc<grammar::Grammars>, String>>,
    /// Unix seconds at start (OpenAI's `created` of the model).
    pub started: u64,
    next_id: AtomicU64,
    hit_rate: Box<dyn Fn() -> Option<f64> + Send + Sync>,
}

impl App {
    /// A fresh id for a response, `prefix` then a number unique in this process.
    pub fn id(&self, prefix: &str) -> String {
        format!("{prefix}{:016x}", self.next_id.fetch_add(1, Ordering::Relaxed) ^ (self.started << 20))
    }
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Serves `model` until the process is interrupted. Prints the address it listens on
/// to stderr once it does (`listening on http://HOST:PORT`).
pub fn serve<B: Backend>(model: Model<B>, tok: Tokenizer, cfg: ServeConfig) -> Result<()> {
    let app = app(model, tok, &cfg);
    let rt = runtime()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| Error::Usage(format!("serve: cannot listen on {addr}: {e}")))?;
        let local: SocketAddr =
            listener.local_addr().map_err(|e| Error::Usage(format!("serve: cannot listen on {addr}: {e}")))?;
        eprintln!("sluice serve: model {} listening on http://{local}", cfg.name);
        axum::serve(listener, router(app))
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .map_err(|e| Error::Unsupported(format!("serve: {e}")))
    })
}

/// The HTTP runtime: two workers, the model's steps run on the scheduler's own thread.
fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("sluice-http")
        .enable_all()
        .build()
        .map_err(|e| Error::Unsupported(format!("serve: cannot start the HTTP runtime: {e}")))
}

/// The server without a socket: requests go straight to its router, in this process.
/// For fuzzing the routes with arbitrary bodies (crates/sluice-fuzz), where a socket
/// per input would measure the kernel instead.
pub struct InProcess {
    router: Router,
    rt: tokio::runtime::Runtime,
}

impl InProcess {
    pub fn new<B: Backend>(model: Model<B>, tok: Tokenizer, cfg: ServeConfig) -> Result<InProcess> {
        let app = app(model, tok, &cfg);
        Ok(InProcess { router: router(app), rt: runtime()? })
    }

    /// Sends one request and reads its whole answer: the status and the body.
    pub fn request(&self, method: &str, path: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
        use tower::ServiceExt;
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header(axum::http::header::CONTENT_TYPE, "application/json")
            .body(axum::body::Body::from(body));
        let Ok(req) = req else { return (400, Vec::new()) };
        self.rt.block_on(async {
            let Ok(resp) = self.router.clone().oneshot(req).await;
            let status = resp.status().as_u16();
            let body = axum::body::to_bytes(resp.into_body(), usize::MAX).await.map(|b| b.to_vec()).unwrap_or_default();
            (status, body)
        })
    }
}

fn app<B: Backend>(model: Model<B>, tok: Tokenizer, cfg: &ServeConfig) -> Arc<App> {
    let model = Arc::new(model);
    let tok = Arc::new(tok);
    let metrics = Arc::new(Metrics::default());
    let stop_ids = tok.stop_ids(&model.spec.eos_token_ids);
    let scheduler = Scheduler::start(model.clone(), tok.clone(), stop_ids.clone(), cfg.limits, metrics.clone());
    let m = model.clone();
    Arc::new(App {
        context: model.max_context,
        vocab_size: model.spec.vocab_size,
        eos: stop_ids.first().copied().unwrap_or(0),
        grammars: std::sync::OnceLock::new(),
        tok,
        scheduler,
        metrics,
        started: unix_now(),
        next_id: AtomicU64::new(1),
        hit_rate: Box::new(move || m.store.stats().hit_rate),
        cfg: cfg.clone(),
    })
}

fn router(app: Arc<App>) -> Router {
    let body_limit = app.cfg.max_body_bytes;
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{id}", get(openai::model))
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/version", get(ollama::version))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(app.clone(), read_body))
        .layer(middleware::from_fn_with_state(app.clone(), authorize))
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(app)
}

async fn health() -> Response {
    axum::Json(serde_json::json!({"status": "ok"})).into_response()
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    let body = app.metrics.render((app.hit_rate)());
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn not_found(req: Request) -> Response {
    let api = Api::of_path(req.uri().path());
    ApiError::new(api, StatusCode::NOT_FOUND, format!("no route for {} {}", req.method(), req.uri().path()))
        .into_response()
}

/// With `--api-key`, every route but `/health` wants `Authorization: Bearer KEY` (OpenAI,
/// Ollama) or `x-api-key: KEY` (Anthropic).
async fn authorize(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.cfg.api_key
        && req.uri().path() != "/health"
    {
        let h = req.headers();
        let bearer = h
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let x_key = h.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
        if !constant_time_eq(bearer, key) && !constant_time_eq(x_key, key) {
            app.metrics.rejected.fetch_add(1, Ordering::Relaxed);
            let api = Api::of_path(req.uri().path());
            return ApiError::new(
                api,
                StatusCode::UNAUTHORIZED,
                "a valid API key is required (Authorization: Bearer KEY)",
            )
            .into_response();
        }
    }
    next.run(req).await
}

/// Reads a request's whole body, within `--max-body` and the body timeout, before any
/// handler sees it: a body too large is 413, one that stalls is 408, and neither holds
/// anything of the model's.
async fn read_body(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let api = Api::of_path(req.uri().path());
    let limit = app.cfg.max_body_bytes;
    let too_large = || {
        app.metrics.rejected.fetch_add(1, Ordering::Relaxed);
        ApiError::new(api, StatusCode::PAYLOAD_TOO_LARGE, format!("request body too large (at most {limit} bytes)"))
            .into_response()
    };
    let declared =
        req.headers().get(axum::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_large();
    }
    let (parts, body) = req.into_parts();
    match tokio::time::timeout(app.cfg.body_timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => next.run(Request::from_parts(parts, axum::body::Body::from(bytes))).await,
        Ok(Err(e)) if e.to_string().contains("length limit") => too_large(),
        Ok(Err(e)) => {
            app.metrics.rejected.fetch_add(1, Ordering::Relaxed);
            ApiError::bad_request(api, format!("cannot read the request body: {e}")).into_response()
        }
        Err(_) => {
            app.metrics.rejected.fetch_add(1, Ordering::Relaxed);
            let secs = app.cfg.body_timeout.as_secs_f64();
            ApiError::new(api, StatusCode::REQUEST_TIMEOUT, format!("the request body did not arrive within {secs} s"))
                .into_response()
        }
    }
}

/// Compares a presented key with the expected one in time that does not depend on
/// where they differ.
fn constant_time_eq(given: Option<&str>, want: &str) -> bool {
    let Some(g) = given else { return false };
    let (g, w) = (g.as_bytes(), want.as_bytes());
    g.len() == w.len() && g.iter().zip(w).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}
