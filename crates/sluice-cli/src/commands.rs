//! The subcommands. Each loads what it needs, does one thing, and returns an error
//! that names the file, tensor or value at fault.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use serde_json::json;
use sluice_core::{Error, Precision, Result};
use sluice_engine::plan::{self, Placement, Request, WeightsPlace};
use sluice_engine::stats::{PhaseMs, peak_rss_bytes, storage_read_bytes};
use sluice_engine::{
    Backend, Chunk, Cpu, LoadOptions, Logits, Model, PerplexityOptions, PilotStats, Prefetch, Sampler, SamplerConfig,
    StepStats, WindowDone,
};
use sluice_experts::{CacheBudget, ExpertLayout, Policy, Residency, RoutingHistogram, StoreConfig, human_bytes};
use sluice_formats::Checkpoint;
use sluice_formats::gguf::GgufFile;
use sluice_tokenizer::{ChatMessage, StopText, StreamDecoder, Tokenizer};

use crate::{BackendArg, EngineArgs, LogitsMode, PolicyArg, PrecisionArg, PrefetchArg, ResidencyArg, WeightsArg};

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Text to continue, or with --chat the user's message
    #[arg(long, short = 'p')]
    prompt: Option<String>,
    /// Read the prompt from FILE (UTF-8), for prompts longer than a command line holds
    #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
    prompt_file: Option<PathBuf>,
    /// Use the model's chat template; without --prompt, chat interactively on stdin
    #[arg(long)]
    chat: bool,
    /// System message for --chat
    #[arg(long)]
    system: Option<String>,
    /// Jinja chat template file to use instead of the model's own (a model without
    /// one, a base model, is asked as a plain "User: ... / Assistant:" transcript)
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// End the reply where the generated text reaches TEXT (not shown); repeatable
    #[arg(long, value_name = "TEXT")]
    stop: Vec<String>,
    /// Most tokens to generate
    #[arg(long, short = 'n', default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Keep only the K most likely tokens (0: all)
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1: all)
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Random seed (default: from the clock; printed by --stats)
    #[arg(long)]
    seed: Option<u64>,
    /// Print one JSON object of timings and counters to stderr at the end
    #[arg(long)]
    stats: bool,
}

#[derive(Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Comma-separated token ids of one sequence; repeat for several sequences, which
    /// then run as one batch (their rows follow each other in the order given, the
    /// same bits as each run alone)
    #[arg(long, value_name = "IDS", required = true)]
    tokens: Vec<String>,
    /// Output file: little-endian f32, row-major [n_tokens, vocab]
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// prefill runs the tokens as one sequence; decode feeds them one at a time
    #[arg(long, value_enum, default_value_t = LogitsMode::Prefill)]
    mode: LogitsMode,
}

#[derive(Args)]
pub struct TokenizeArgs {
    /// Model: a .gguf file or a Hugging Face folder (only its tokenizer is read)
    #[arg(long, short = 'm', value_name = "PATH")]
    model: PathBuf,
    #[arg(long)]
    text: String,
}

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Prompt length for the prefill measurement
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens to decode after the prompt
    #[arg(long, default_value_t = 32)]
    gen_tokens: usize,
    /// Runs; medians are reported
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Sequences run together, each with its own prompt: their prompts are prefilled
    /// as one batch, then every decode step feeds one token of each (decode_tok_s is
    /// then the aggregate over all of them)
    #[arg(long, value_name = "N", default_value_t = 1)]
    parallel: usize,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
    /// Skip measuring memory bandwidth (the resident-decode roofline)
    #[arg(long)]
    no_roofline: bool,
    /// Compare KV cache widths in one process (16,4,3.5): one sequence per width, each
    /// prefilled from the same prompt, then --gen-tokens decoded for each in turns of
    /// 4 tokens, the widths taking turns so that the machine's drift falls on all alike;
    /// decode_tok_s is the median over a width's turns
    #[arg(long, value_name = "BITS,..", value_delimiter = ',', value_parser = crate::parse_kv_bits, conflicts_with_all = ["kv_bits", "parallel", "repeat"])]
    compare_kv_bits: Vec<sluice_core::KvFormat>,
}

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Text file to score, tokenized with the model's tokenizer (no chat template)
    #[arg(long, short = 'f', value_name = "FILE")]
    file: PathBuf,
    /// Tokens per window (llama-perplexity's -c): each window runs from an empty state,
    /// BOS first when the tokenizer adds one, and its second half is scored
    #[arg(long, short = 'c', value_name = "N", default_value_t = 512)]
    context: usize,
    /// Most windows to evaluate (default: every whole window of the text)
    #[arg(long, value_name = "K")]
    chunks: Option<usize>,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct PlanArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// A routing histogram saved by --record-routing: the predicted expert-cache hit
    /// rates follow its experts' popularity (uniform routing otherwise)
    #[arg(long, value_name = "FILE")]
    routing: Option<PathBuf>,
    /// Only decide where the parts live; do not measure this machine or predict speed
    #[arg(long)]
    no_measure: bool,
    /// With a GPU: the positions of one sequence's KV cache that its memory keeps
    /// room for beside the weights (what is left holds experts)
    #[arg(long, value_name = "N", default_value_t = plan::DEVICE_CONTEXT)]
    context: usize,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Address to listen on (loopback by default; another address serves the network,
    /// where --api-key should be set)
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one, printed at start)
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require this key as `Authorization: Bearer KEY` or `x-api-key: KEY` (default:
    /// $SLUICE_API_KEY if set, else no key)
    #[arg(long, value_name = "KEY", env = "SLUICE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model's name in the APIs (default: the file or folder name)
    #[arg(long)]
    name: Option<String>,
    /// Requests generated together in one batch; more wait in the queue. Each running
    /// request holds its own KV cache (up to --context positions), so this bounds that
    /// memory; on a machine with room, more gives more tokens per second in all and a
    /// shorter wait for the first token under load (64 clients on 2 cores: see README)
    #[arg(long, value_name = "N", default_value_t = 8)]
    parallel: usize,
    /// Requests that may wait for a place in the batch; beyond them a request is
    /// answered 503 with Retry-After
    #[arg(long, value_name = "N", default_value_t = 64)]
    max_queue: usize,
    /// Most tokens one step computes: decode rows first, prompt chunks in what is left
    /// (smaller keeps the others' tokens flowing while a long prompt is read)
    #[arg(long, value_name = "N", default_value_t = 256)]
    step_tokens: usize,
    /// KV cache bytes of finished requests kept so that a later prompt continuing one
    /// (the next turn of a conversation), or beginning as one did (a system prompt),
    /// starts after that part (0: none)
    #[arg(long, value_name = "SIZE", default_value = "1GiB")]
    prompt_cache: String,
    /// Most positions a sequence may hold (default: the model's context)
    #[arg(long, value_name = "N")]
    context: Option<usize>,
    /// Largest request body accepted
    #[arg(long, value_name = "SIZE", default_value = "16MiB")]
    max_body: String,
    /// Seconds a request body may take to arrive; a client that stalls is answered 408
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    body_timeout: f64,
    /// Jinja chat template file to use instead of the model's own
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
}

#[derive(Args)]
pub struct InspectArgs {
    /// Model: a .gguf file or a Hugging Face folder
    #[arg(long, short = 'm', value_name = "PATH")]
    model: PathBuf,
    /// List every tensor
    #[arg(long)]
    tensors: bool,
}

fn init_threads(n: Option<usize>) -> Result<usize> {
    let n = match n {
        Some(0) => return Err(Error::Usage("--threads must be at least 1".into())),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    // Only fails if a pool already exists, which cannot happen in this process.
    let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
    Ok(n)
}

/// A loaded model, the seconds its loading took, and where its weights live
/// ("memory" or "mapped").
struct Loaded<B: Backend> {
    model: Model<B>,
    load_s: f64,
    weights: &'static str,
}

/// Runs `$body` with `$loaded` the model loaded on the backend `--backend` chooses
/// (each backend's code is its own instance of the generic command).
macro_rules! with_backend {
    ($e:expr, |$loaded:ident| $body:expr) => {
        match choose_backend($e)? {
            BackendArg::Cpu => {
                let $loaded = load_model(Cpu::default(), $e)?;
                $body
            }
            BackendArg::Cuda => {
                let be = open_cuda($e)?;
                let (free, total) = be.memory()?;
                eprintln!(
                    "GPU: {}, {} free of {}",
                    be.device_name(),
                    human_bytes(free as u64),
                    human_bytes(total as u64)
                );
                let gpu = be.clone();
                let $loaded = load_model(be, $e)?;
                let done = $body;
                let t = gpu.expert_traffic().unwrap_or_default();
                if t.vram_hits + t.host_fills + t.whole_layers > 0 {
                    eprintln!(
                        "GPU experts: {} copied at load, {} layer steps wholly in VRAM, {} more from VRAM, {} copied \
                         from the host as needed and {} ahead ({} in all), {} evicted, {} held",
                        t.adopted,
                        t.whole_layers,
                        t.vram_hits,
                        t.host_fills,
                        t.prefetched,
                        human_bytes(t.fill_bytes),
                        t.evictions,
                        human_bytes(t.vram_bytes)
                    );
                }
                done
            }
            BackendArg::Auto => unreachable!("choose_backend resolves auto"),
        }
    };
}

/// The first GPU, its VRAM tier evicting as `--cache-policy` says, within
/// `--gpu-memory` where given.
fn open_cuda(e: &EngineArgs) -> Result<sluice_cuda::Cuda> {
    let be = sluice_cuda::Cuda::open(0)?.with_expert_policy(policy_of(e.cache_policy));
    match &e.gpu_memory {
        Some(m) => be.with_memory_limit(parse_size("--gpu-memory", m, "not a size (24GiB)")? as usize),
        None => Ok(be),
    }
}

fn policy_of(p: PolicyArg) -> Policy {
    match p {
        PolicyArg::Lru => Policy::Lru,
        PolicyArg::Lfu => Policy::Lfu,
    }
}

/// `--backend`, with `auto` resolved: CUDA where a GPU can be used, else the CPU.
fn choose_backend(e: &EngineArgs) -> Result<BackendArg> {
    let b = match e.backend {
        BackendArg::Auto if sluice_cuda::probe().is_none() => BackendArg::Cuda,
        BackendArg::Auto => BackendArg::Cpu,
        b => b,
    };
    if b == BackendArg::Cpu && e.gpu_memory.is_some() {
        return Err(Error::Usage("--gpu-memory goes with --backend cuda (or auto on a machine with a GPU)".into()));
    }
    Ok(b)
}

fn load_model<B: Backend>(be: B, e: &EngineArgs) -> Result<Loaded<B>> {
    let t = Instant::now();
    let mut ckpt = Checkpoint::open(&e.model)?;
    let (opts, placement) = load_options(e, &ckpt, be.expert_room()?)?;
    let copy = placement.weights == WeightsPlace::Memory;
    let bar = |what: &'static str| {
        std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new(0);
            b.set_style(
                indicatif::ProgressStyle::with_template(&format!(
                    "loading {what} {{bar:40}} {{binary_bytes}}/{{binary_total_bytes}} {{eta}}"
                ))
                .expect("a valid template"),
            );
            b
        })
    };
    let show = |b: &Option<indicatif::ProgressBar>, done: u64, all: u64| {
        if let Some(b) = b {
            b.set_length(all);
            b.set_position(done);
        }
    };
    if copy {
        let b = bar("weights");
        ckpt.copy_to_memory(&mut |done, all| show(&b, done, all))?;
        if let Some(b) = b {
            b.finish_and_clear();
        }
    }
    // A resident store reads its experts, and a GPU copies them to its memory when
    // they all fit there.
    let b = if opts.store.residency == Residency::Resident || be.name() != "cpu" { bar("experts") } else { None };
    let mut progress = |done: u64, all: u64| show(&b, done, all);
    let model = Model::load_with(be, &ckpt, &opts, Some(&mut progress))?;
    if let Some(b) = b {
        b.finish_and_clear();
    }
    Ok(Loaded { model, load_s: t.elapsed().as_secs_f64(), weights: if copy { "memory" } else { "mapped" } })
}

/// `4GiB`, `512MiB`, `1.5G`, `2GB` as bytes; a bare number as slots per layer.
fn parse_cache(s: &str) -> Result<CacheBudget> {
    if let Ok(n) = s.trim().parse::<usize>() {
        return Ok(CacheBudget::SlotsPerLayer(n));
    }
    parse_size("--expert-cache", s, "neither a size (4GiB) nor a slot count (16)").map(CacheBudget::Bytes)
}

/// `4GiB`, `512MiB`, `1.5G`, `2GB` as bytes, for `flag`; `what` says what else it is not.
fn parse_size(flag: &str, s: &str, what: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.trim().parse().map_err(|_| Error::Usage(format!("{flag}: '{s}' is {what}")))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1024.0 * 1024.0,
        "mb" => 1e6,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "gb" => 1e9,
        "t" | "tib" => 1024f64.powi(4),
        "tb" => 1e12,
        other => return Err(Error::Usage(format!("{flag}: unknown unit '{other}' (use KiB, MiB, GiB)"))),
    };
    if value <= 0.0 || !value.is_finite() {
        return Err(Error::Usage(format!("{flag}: '{s}' must be positive")));
    }
    Ok((value * mult) as u64)
}

/// The placement the flags ask for, with `auto` left to the planner.
fn request(e: &EngineArgs, device_room: Option<u64>) -> Result<Request> {
    Ok(Request {
        residency: match e.residency {
            ResidencyArg::Auto => None,
            ResidencyArg::Resident => Some(Residency::Resident),
            ResidencyArg::Mapped => Some(Residency::Mapped),
            ResidencyArg::Streamed => Some(Residency::Streamed),
        },
        expert_cache: e.expert_cache.as_deref().map(parse_cache).transpose()?,
        weights: match e.weights {
            WeightsArg::Auto => None,
            WeightsArg::Memory => Some(WeightsPlace::Memory),
            WeightsArg::Mapped => Some(WeightsPlace::Mapped),
        },
        available: sluice_engine::memory::available(),
        device_room,
    })
}

/// Turns the flags into load options, the planner deciding what they leave to `auto`
/// (expert residency and cache size from the model's size and the memory available;
/// whether the weights are copied into memory).
fn load_options(e: &EngineArgs, ckpt: &Checkpoint, device_room: Option<u64>) -> Result<(LoadOptions, Placement)> {
    let layout = ExpertLayout::from_checkpoint(ckpt)?;
    let placement = plan::place(ckpt, &layout, &request(e, device_room)?)?;
    // Only worth a line when the model does not simply sit in the page cache.
    match (&placement.note, placement.residency) {
        (Some(note), Residency::Streamed) => {
            eprintln!("residency auto: streamed, expert cache {} ({note})", human_bytes(placement.cache_bytes))
        }
        (Some(note), r) => eprintln!("residency auto: {} ({note})", r.name()),
        (None, _) => {}
    }
    let residency = placement.residency;
    let pin = e.pin_hot.as_deref().map(RoutingHistogram::load).transpose()?;
    if pin.is_some() && residency != Residency::Streamed {
        return Err(Error::Usage("--pin-hot goes with streamed residency".into()));
    }
    if e.read_threads == 0 {
        return Err(Error::Usage("--read-threads must be at least 1".into()));
    }
    let store = StoreConfig {
        residency,
        budget: placement.budget,
        policy: policy_of(e.cache_policy),
        pin,
        read_threads: e.read_threads,
        direct_io: !e.no_direct_io,
        ..Default::default()
    };
    let prefetch = match e.prefetch {
        PrefetchArg::Off => Prefetch::Off,
        PrefetchArg::Pilot => Prefetch::Pilot,
    };
    Ok((LoadOptions { store, prefetch, precision: precision(e), kv: e.kv_bits }, placement))
}

fn precision(e: &EngineArgs) -> Option<Precision> {
    match e.precision {
        PrecisionArg::Auto => None,
        PrecisionArg::Fast => Some(Precision::Fast),
        PrecisionArg::Accurate => Some(Precision::Accurate),
    }
}

/// Saves the routing histogram if `--record-routing` asked for it.
fn record_routing<B: Backend>(e: &EngineArgs, model: &Model<B>) -> Result<()> {
    match &e.record_routing {
        Some(path) => model.store.histogram().save(path),
        None => Ok(()),
    }
}

/// The tokenizer of a model: from a GGUF file's metadata (a packed folder's inner
/// model.gguf), or a Hugging Face folder's tokenizer.json.
fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let path = &sluice_formats::pack::model_path(path);
    // A path that is not there is named as the model, not as a folder missing its tokenizer.
    std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if path.is_file() { Tokenizer::from_gguf(&GgufFile::open(path)?) } else { Tokenizer::from_hf_dir(path) }
}

/// Makes sure `tok` has a chat template: `file` if given, else the model's own, else
/// the plain transcript ([`Tokenizer::ensure_chat_template`]), whose stop string is
/// then returned.
fn ensure_chat_template(tok: &mut Tokenizer, file: Option<&Path>) -> Result<Option<&'static str>> {
    let stop = tok.ensure_chat_template(file)?;
    if stop.is_some() {
        eprintln!(
            "note: the model has no chat template, so it is probably a base model that was never trained to chat; \
             asking it as a plain User:/Assistant: transcript (--chat-template FILE to choose a template, or \
             leave out --chat to complete plain text)"
        );
    }
    Ok(stop)
}

fn stop_ids<B: Backend>(model: &Model<B>, tok: &Tokenizer) -> Vec<u32> {
    tok.stop_ids(&model.spec.eos_token_ids)
}

pub fn run(mut a: RunArgs) -> Result<()> {
    if let Some(file) = &a.prompt_file {
        a.prompt = Some(read_text(file)?);
    }
    if a.prompt.is_none() && !a.chat {
        return Err(Error::Usage("give --prompt TEXT or --prompt-file FILE, or --chat to chat".into()));
    }
    if a.system.is_some() && !a.chat {
        return Err(Error::Usage("--system goes with --chat".into()));
    }
    if !(0.0..=1.0).contains(&a.top_p) || a.temperature < 0.0 || !a.temperature.is_finite() {
        return Err(Error::Usage("--temperature must be >= 0 and --top-p in [0, 1]".into()));
    }
    if a.stop.iter().any(|s| s.is_empty()) {
        return Err(Error::Usage("--stop needs a non-empty text".into()));
    }
    let threads = init_threads(a.engine.threads)?;
    let mut tok = load_tokenizer(&a.engine.model)?;
    let mut stop_texts = a.stop.clone();
    if a.chat {
        stop_texts.extend(ensure_chat_template(&mut tok, a.chat_template.as_deref())?.map(String::from));
    }
    with_backend!(&a.engine, |loaded| run_on(&a, threads, tok, stop_texts, loaded))
}

fn run_on<B: Backend>(
    a: &RunArgs,
    threads: usize,
    tok: Tokenizer,
    stop_texts: Vec<String>,
    Loaded { model, load_s, weights }: Loaded<B>,
) -> Result<()> {
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
    });
    let mut sampler = Sampler::new(SamplerConfig { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed });
    let stops = stop_ids(&model, &tok);
    let mut session = model.session()?;
    let mut out = std::io::stdout().lock();
    let mut totals = Vec::new();

    let mut generate_into = |session: &mut sluice_engine::Session<'_, B>,
                             prompt: &[u32],
                             out: &mut std::io::StdoutLock<'_>|
     -> Result<(Vec<u32>, String, sluice_engine::GenerationStats)> {
        let mut dec = StreamDecoder::with_context(&tok, prompt, true)?;
        let mut filter = StopText::new(stop_texts.clone());
        let (mut produced, mut shown) = (Vec::new(), String::new());
        let st = session.generate(prompt, a.max_tokens, &stops, &mut sampler, |id| {
            produced.push(id);
            let (mut piece, stop) = filter.push(&dec.push(id)?);
            if a.chat && shown.is_empty() {
                // A reply starts at its first visible character (after a transcript's
                // "Assistant:" the model writes a space first).
                piece = piece.trim_start().to_string();
            }
            out.write_all(piece.as_bytes()).map_err(|e| Error::io("<stdout>", e))?;
            out.flush().map_err(|e| Error::io("<stdout>", e))?;
            shown += &piece;
            Ok(!stop)
        })?;
        let (piece, _) = filter.push(&dec.finish()?);
        let rest = piece + &filter.finish();
        writeln!(out, "{rest}").map_err(|e| Error::io("<stdout>", e))?;
        shown += &rest;
        Ok((produced, shown, st))
    };

    if !a.chat {
        let prompt = tok.encode(a.prompt.as_deref().unwrap_or(""), true)?;
        if prompt.is_empty() {
            return Err(Error::Usage("the prompt encodes to no tokens".into()));
        }
        write!(out, "{}", a.prompt.as_deref().unwrap_or("")).map_err(|e| Error::io("<stdout>", e))?;
        let (_, _, st) = generate_into(&mut session, &prompt, &mut out)?;
        totals.push(st);
    } else {
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(ChatMessage::new("system", s.clone()));
        }
        // Tokens the session holds, to feed only what is new on each turn.
        let mut held: Vec<u32> = Vec::new();
        let stdin = std::io::stdin();
        let interactive = a.prompt.is_none();
        let mut turns = a.prompt.clone().into_iter();
        loop {
            let user = if interactive {
                if stdin.is_terminal() {
                    eprint!("> ");
                }
                let mut line = String::new();
                let n = stdin.lock().read_line(&mut line).map_err(|e| Error::io("<stdin>", e))?;
                if n == 0 || line.trim() == "/exit" {
                    break;
                }
                line.trim_end_matches(['\n', '\r']).to_string()
            } else {
                match turns.next() {
                    Some(p) => p,
                    None => break,
                }
            };
            messages.push(ChatMessage::new("user", user));
            let ids = tok.encode_chat(&messages, true)?;
            let new: &[u32] = if ids.starts_with(&held) && held.len() < ids.len() {
                &ids[held.len()..]
            } else {
                session.reset()?;
                &ids
            };
            let (produced, reply, st) = generate_into(&mut session, new, &mut out)?;
            totals.push(st);
            messages.push(ChatMessage::new("assistant", reply));
            // The session holds the prompt and every generated token but the last.
            held = ids;
            held.extend(&produced[..produced.len().saturating_sub(1)]);
            if session.len() != held.len() {
                held.clear();
                session.reset()?;
            }
        }
    }
    if a.stats {
        let prompt_tokens: usize = totals.iter().map(|s| s.prompt_tokens).sum();
        let generated: usize = totals.iter().map(|s| s.generated_tokens).sum();
        let prefill_s: f64 = totals.iter().map(|s| s.prefill_s).sum();
        let decode_s: f64 = totals.iter().map(|s| s.decode_s).sum();
        let decode_steps: usize = totals.iter().map(|s| s.generated_tokens.saturating_sub(1)).sum();
        let stats = json!({
            "model": a.engine.model,
            "threads": threads,
            "isa": format!("{:?}", sluice_cpu::isa()),
            "seed": seed,
            "backend": model.be.name(),
            "precision": precision_name(&model),
            "weights": weights,
            "load_s": load_s,
            "prompt_tokens": prompt_tokens,
            "generated_tokens": generated,
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "prefill_tok_s": prompt_tokens as f64 / prefill_s.max(1e-9),
            "decode_tok_s": decode_steps as f64 / decode_s.max(1e-9),
            "stop": totals.last().map(|s| s.stop),
            "kv_bits": model.kv_format.bits(),
            "kv_cache_bytes": session.kv_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
            "phases": PhaseMs::from(&session.stats.timers),
            "experts": expert_stats(&model, &session.stats.pilot),
            "device_experts": model.be.expert_traffic(),
        });
        eprintln!("{stats}");
    }
    record_routing(&a.engine, &model)?;
    Ok(())
}

/// The expert store's counters and the pilot's recall, for --stats and bench --json.
fn precision_name<B: Backend>(model: &Model<B>) -> &'static str {
    match model.precision {
        None => "auto",
        Some(Precision::Fast) => "fast",
        Some(Precision::Accurate) => "accurate",
    }
}

fn expert_stats<B: Backend>(model: &Model<B>, pilot: &PilotStats) -> serde_json::Value {
    json!({
        "store": model.store.stats(),
        "prefetch": match model.prefetch { Prefetch::Off => "off", Prefetch::Pilot => "pilot" },
        "pilot": pilot,
        "pilot_recall": pilot.recall(),
    })
}

fn parse_tokens(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>().map_err(|_| Error::Usage(format!("--tokens: '{t}' is not a token id"))))
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        return Err(Error::Usage("--tokens is empty".into()));
    }
    Ok(ids)
}

pub fn logits(a: LogitsArgs) -> Result<()> {
    let seqs = a.tokens.iter().map(|t| parse_tokens(t)).collect::<Result<Vec<_>>>()?;
    init_threads(a.engine.threads)?;
    with_backend!(&a.engine, |loaded| logits_on(&a, &seqs, loaded.model))
}

fn logits_on<B: Backend>(a: &LogitsArgs, seqs: &[Vec<u32>], model: Model<B>) -> Result<()> {
    let mut states = seqs.iter().map(|_| model.new_state()).collect::<Result<Vec<_>>>()?;
    let mut stats = StepStats::default();
    let mut rows: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
    // Prefill: each sequence's tokens in one step; decode: one token of every sequence
    // that has one left per step.
    let steps = match a.mode {
        LogitsMode::Prefill => 1,
        LogitsMode::Decode => seqs.iter().map(Vec::len).max().unwrap_or(0),
    };
    for t in 0..steps {
        let mut chunks = Vec::new();
        let mut which = Vec::new();
        for (i, (seq, state)) in seqs.iter().zip(states.iter_mut()).enumerate() {
            let tokens = match a.mode {
                LogitsMode::Prefill => &seq[..],
                LogitsMode::Decode if t < seq.len() => &seq[t..t + 1],
                LogitsMode::Decode => continue,
            };
            chunks.push(Chunk { state, tokens, logits: Logits::All });
            which.push(i);
        }
        for (i, r) in which.into_iter().zip(model.step(&mut chunks, &mut stats)) {
            let r = r.map_err(|e| match seqs.len() {
                1 => e,
                _ => Error::Usage(format!("--tokens #{}: {e}", i + 1)),
            })?;
            rows[i].extend(r);
        }
    }
    record_routing(&a.engine, &model)?;
    let bytes: Vec<u8> = rows.iter().flatten().flat_map(|v| v.to_le_bytes()).collect();
    // Write beside the target and rename, so a failure leaves no half-written file.
    let tmp = a.out.with_extension("partial");
    std::fs::write(&tmp, &bytes).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, &a.out).map_err(|e| Error::io(&a.out, e))?;
    Ok(())
}

/// Largest text file read whole (a prompt, a perplexity text): far more tokens than
/// any model's context, and checked before the read allocates.
const MAX_TEXT_FILE: u64 = 256 << 20;

/// The whole of a UTF-8 text file, refused with its name when it is larger than
/// [`MAX_TEXT_FILE`] or not UTF-8.
fn read_text(path: &Path) -> Result<String> {
    let len = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
    if len > MAX_TEXT_FILE {
        return Err(Error::format(path, format!("{len} bytes; a text file is read whole, at most {MAX_TEXT_FILE}")));
    }
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    String::from_utf8(bytes)
        .map_err(|e| Error::format(path, format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to())))
}

pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    let text = read_text(&a.file)?;
    init_threads(a.engine.threads)?;
    let tok = load_tokenizer(&a.engine.model)?;
    let tokens = tok.encode(&text, true)?;
    // The tokenizer adds BOS if the text's encoding starts with it; llama-perplexity
    // then starts every window with it.
    let bos = tok.bos_id().filter(|b| tokens.first() == Some(b));
    let opts = PerplexityOptions { context: a.context, chunks: a.chunks, bos, ..Default::default() };
    // What can be refused before the model loads.
    opts.check(tokens.len())?;
    with_backend!(&a.engine, |loaded| perplexity_on(&a, &tokens, &opts, loaded.model))
}

fn perplexity_on<B: Backend>(
    a: &PerplexityArgs,
    tokens: &[u32],
    opts: &PerplexityOptions,
    model: Model<B>,
) -> Result<()> {
    let windows = opts.windows(tokens.len());
    let terminal = std::io::stderr().is_terminal();
    let bar = if terminal {
        let b = indicatif::ProgressBar::new(windows as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("perplexity {bar:40} {pos}/{len} windows, {msg} {eta}")
                .expect("a valid template"),
        );
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut progress = |p: &WindowDone| {
        bar.set_position(p.done as u64);
        bar.set_message(format!("PPL {:.4}", p.ppl));
        // Elsewhere (a log) a line per window, as llama-perplexity prints them.
        if !terminal {
            eprintln!("[{}/{}] PPL {:.4}", p.done, p.windows, p.ppl);
        }
    };
    let r = sluice_engine::perplexity(&model, tokens, opts, &mut progress)?;
    bar.finish_and_clear();
    record_routing(&a.engine, &model)?;
    let tok_s = r.tokens_evaluated as f64 / r.seconds;
    if a.json {
        let j = json!({
            "model": a.engine.model,
            "file": a.file,
            "backend": model.be.name(),
            "context": r.context,
            "windows": r.windows,
            "tokens": tokens.len(),
            "tokens_scored": r.tokens_scored,
            "ppl": r.ppl,
            "ppl_stderr": r.ppl_stderr,
            "mean_nll": r.mean_nll,
            "kv_bits": model.kv_format.bits(),
            "seconds": r.seconds,
            "tok_s": tok_s,
        });
        println!("{j}");
    } else {
        println!(
            "{}: {} windows of {} tokens ({} in the text), {} tokens scored, {:.1} tok/s ({:.1} s)",
            a.engine.model.display(),
            r.windows,
            r.context,
            tokens.len(),
            r.tokens_scored,
            tok_s,
            r.seconds
        );
        match r.ppl_stderr {
            Some(e) => println!("PPL = {:.4} +/- {:.5}", r.ppl, e),
            None => println!("PPL = {:.4}", r.ppl),
        }
    }
    Ok(())
}

pub fn tokenize(a: TokenizeArgs) -> Result<()> {
    let tok = load_tokenizer(&a.model)?;
    let ids = tok.encode(&a.text, true)?;
    println!("{}", serde_json::to_string(&ids).expect("ids serialize"));
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A fixed pseudo-random prompt per run: the same tokens on every machine, but other
/// tokens each run, so a streamed cache is not flattered by the previous run's routing.
fn bench_prompt(vocab: usize, n: usize, run: usize) -> Vec<u32> {
    let mut x = 0x2545_F491_4F6C_DD1Du64 ^ (run as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// One bench run's figures.
#[derive(serde::Serialize)]
struct BenchRun {
    /// Prompt tokens per second over all sequences.
    prefill_tok_s: f64,
    /// Decoded tokens per second over all sequences (with --parallel N, the aggregate).
    decode_tok_s: f64,
    /// Decoded tokens per second of one sequence.
    decode_tok_s_per_sequence: f64,
    /// Expert bytes read from disk per decoded token (streamed residency).
    decode_disk_bytes_per_token: f64,
    /// Bytes the process read from storage per decoded token, as the kernel counts
    /// them: the store's reads, and for mapped residency the page-ins of its faults.
    decode_storage_bytes_per_token: Option<f64>,
    /// Expert requests served from the cache during decode (streamed residency).
    decode_hit_rate: Option<f64>,
    decode_fetch_wait_s: f64,
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if a.repeat == 0 || a.prompt_tokens == 0 || a.gen_tokens == 0 || a.parallel == 0 {
        return Err(Error::Usage("--repeat, --prompt-tokens, --gen-tokens and --parallel must be at least 1".into()));
    }
    let threads = init_threads(a.engine.threads)?;
    if !a.compare_kv_bits.is_empty() {
        return with_backend!(&a.engine, |loaded| bench_kv_widths(&a, threads, loaded));
    }
    with_backend!(&a.engine, |loaded| bench_on(&a, threads, loaded))
}

/// A `bench --json` report: what ran and how (model, threads, backend, prompt and
/// decode lengths), then `figures`' fields.
fn bench_report<B: Backend>(
    a: &BenchArgs,
    threads: usize,
    (model, load_s, weights): (&Model<B>, f64, &str),
    figures: serde_json::Value,
) -> serde_json::Value {
    let mut j = json!({
        "model": a.engine.model,
        "arch": model.spec.arch,
        "threads": threads,
        "isa": format!("{:?}", sluice_cpu::isa()),
        "backend": model.be.name(),
        "precision": precision_name(model),
        "weights": weights,
        "load_s": load_s,
        "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens,
    });
    if let (Some(head), serde_json::Value::Object(more)) = (j.as_object_mut(), figures) {
        head.extend(more);
    }
    j
}

/// Decode tokens a width runs in one turn of `bench --compare-kv-bits`: few enough that
/// the widths alternate many times, enough that a turn is not one token's noise.
const KV_TURN_TOKENS: usize = 4;

/// What `bench --compare-kv-bits` reports of one width.
#[derive(serde::Serialize)]
struct KvWidthFigures {
    kv_bits: f32,
    prefill_tok_s: f64,
    /// The median of its turns.
    decode_tok_s: f64,
    decode_turns_tok_s: Vec<f64>,
    kv_cache_bytes: usize,
    kv_bytes_per_position: usize,
    /// Memory bandwidth over the weights' bytes and the cache's at the decode's middle.
    roofline_decode_tok_s: Option<f64>,
    decode_fraction_of_roofline: Option<f64>,
}

/// One width of `bench --compare-kv-bits`: its sequence and what it measured.
struct KvWidthRun<B: Backend> {
    format: sluice_core::KvFormat,
    state: sluice_engine::SeqState<B>,
    logits: Vec<f32>,
    prefill_tok_s: f64,
    /// Tokens per second of each turn.
    turns: Vec<f64>,
}

fn bench_kv_widths<B: Backend>(
    a: &BenchArgs,
    threads: usize,
    Loaded { model, load_s, weights }: Loaded<B>,
) -> Result<()> {
    let prompt = bench_prompt(model.spec.vocab_size, a.prompt_tokens, 0);
    let mut stats = StepStats::default();
    let mut widths = Vec::new();
    for &format in &a.compare_kv_bits {
        let mut state = model.new_state_in(format)?;
        let t = Instant::now();
        let logits = model.prefill(&mut [&mut state], &[&prompt], &mut stats).pop().expect("one result")?;
        let prefill_tok_s = a.prompt_tokens as f64 / t.elapsed().as_secs_f64();
        if !a.json {
            eprintln!("--kv-bits {format}: prefilled {} tokens at {prefill_tok_s:.1} tok/s", a.prompt_tokens);
        }
        widths.push(KvWidthRun { format, state, logits, prefill_tok_s, turns: Vec::new() });
    }
    let n = widths.len();
    for round in 0..a.gen_tokens.div_ceil(KV_TURN_TOKENS) {
        // Each round starts with the next width, so none always follows the same one.
        for i in 0..n {
            let w = &mut widths[(round + i) % n];
            let t = Instant::now();
            for _ in 0..KV_TURN_TOKENS {
                let next = [sluice_engine::sampler::argmax(&w.logits)];
                let mut chunk = [Chunk { state: &mut w.state, tokens: &next, logits: Logits::Last }];
                w.logits = model.step(&mut chunk, &mut stats).pop().expect("one result")?;
            }
            w.turns.push(KV_TURN_TOKENS as f64 / t.elapsed().as_secs_f64());
        }
    }
    let bw = (!a.no_roofline).then(|| sluice_engine::stats::memory_read_bandwidth(1 << 30, 5));
    let rows: Vec<KvWidthFigures> = widths
        .into_iter()
        .map(|w| {
            let per_position = w.state.kv_bytes_per_position(&model.be);
            // A decode step reads the weights once and every held position's keys and
            // values once: at the decode's middle length, that over bandwidth bounds it.
            let positions = a.prompt_tokens + a.gen_tokens / 2;
            let roofline = bw.map(|bw| bw / (model.bytes_per_token as f64 + (per_position * positions) as f64));
            let decode = median(&mut w.turns.clone());
            KvWidthFigures {
                kv_bits: w.format.bits(),
                prefill_tok_s: w.prefill_tok_s,
                decode_tok_s: decode,
                decode_turns_tok_s: w.turns,
                kv_cache_bytes: w.state.kv_bytes(&model.be),
                kv_bytes_per_position: per_position,
                roofline_decode_tok_s: roofline,
                decode_fraction_of_roofline: roofline.map(|r| decode / r),
            }
        })
        .collect();
    if a.json {
        let j = bench_report(
            a,
            threads,
            (&model, load_s, weights),
            json!({
                "turn_tokens": KV_TURN_TOKENS,
                "weight_bytes_per_token": model.bytes_per_token,
                "memory_read_bytes_per_s": bw,
                "widths": rows,
                "peak_rss_bytes": peak_rss_bytes(),
            }),
        );
        println!("{j}");
        return Ok(());
    }
    println!(
        "{}: {} backend, {} threads ({:?}), {} prompt tokens, {} decoded per width in turns of {}",
        a.engine.model.display(),
        model.be.name(),
        threads,
        sluice_cpu::isa(),
        a.prompt_tokens,
        a.gen_tokens,
        KV_TURN_TOKENS
    );
    println!("kv bits  prefill tok/s  decode tok/s (median)  KV bytes/position  decode roofline");
    for r in &rows {
        println!(
            "{:>7}  {:>13.1}  {:>21.2}  {:>17}  {:>15}",
            r.kv_bits,
            r.prefill_tok_s,
            r.decode_tok_s,
            r.kv_bytes_per_position,
            r.roofline_decode_tok_s.map_or("-".into(), |v| format!("{v:.1}"))
        );
    }
    Ok(())
}

fn bench_on<B: Backend>(a: &BenchArgs, threads: usize, Loaded { model, load_s, weights }: Loaded<B>) -> Result<()> {
    let vocab = model.spec.vocab_size;
    let mut runs = Vec::new();
    let mut last = None;
    for run in 0..a.repeat {
        let prompts: Vec<Vec<u32>> =
            (0..a.parallel).map(|i| bench_prompt(vocab, a.prompt_tokens, run * a.parallel + i)).collect();
        let mut states = prompts.iter().map(|_| model.new_state()).collect::<Result<Vec<_>>>()?;
        let mut stats = StepStats::default();
        let t = Instant::now();
        let prompt_refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let mut logits = {
            let mut refs: Vec<&mut _> = states.iter_mut().collect();
            model.prefill(&mut refs, &prompt_refs, &mut stats).into_iter().collect::<Result<Vec<_>>>()?
        };
        let prefill_s = t.elapsed().as_secs_f64();
        let before = model.store.stats();
        let storage_before = storage_read_bytes();
        let t = Instant::now();
        for _ in 0..a.gen_tokens {
            let next: Vec<[u32; 1]> = logits.iter().map(|l| [sluice_engine::sampler::argmax(l)]).collect();
            let mut chunks: Vec<Chunk<'_, B>> = states
                .iter_mut()
                .zip(&next)
                .map(|(state, t)| Chunk { state, tokens: t, logits: Logits::Last })
                .collect();
            logits = model.step(&mut chunks, &mut stats).into_iter().collect::<Result<Vec<_>>>()?;
        }
        let decode_s = t.elapsed().as_secs_f64();
        let after = model.store.stats();
        let storage = storage_before.zip(storage_read_bytes()).map(|(b, a)| a.saturating_sub(b));
        let requests = after.requests - before.requests;
        let served =
            (after.hits + after.joined + after.prefetch_hits) - (before.hits + before.joined + before.prefetch_hits);
        let decoded = (a.gen_tokens * a.parallel) as f64;
        runs.push(BenchRun {
            prefill_tok_s: (a.prompt_tokens * a.parallel) as f64 / prefill_s,
            decode_tok_s: decoded / decode_s,
            decode_tok_s_per_sequence: a.gen_tokens as f64 / decode_s,
            decode_disk_bytes_per_token: (after.bytes_read - before.bytes_read) as f64 / decoded,
            decode_storage_bytes_per_token: storage.map(|b| b as f64 / decoded),
            decode_hit_rate: (after.hit_rate.is_some() && requests > 0).then(|| served as f64 / requests as f64),
            decode_fetch_wait_s: after.fetch_wait_s - before.fetch_wait_s,
        });
        let kv: usize = states.iter().map(|s| s.kv_bytes(&model.be)).sum();
        let per_position = states[0].kv_bytes_per_position(&model.be);
        last = Some((PhaseMs::from(&stats.timers), (kv, per_position), stats.pilot));
    }
    record_routing(&a.engine, &model)?;
    let (phases, (kv, per_position), pilot) = last.expect("at least one run");
    let med = |f: fn(&BenchRun) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
    let p = med(|r| r.prefill_tok_s);
    let d = med(|r| r.decode_tok_s);
    let d_seq = med(|r| r.decode_tok_s_per_sequence);
    let disk_per_tok = med(|r| r.decode_disk_bytes_per_token);
    let storage_per_tok = runs
        .iter()
        .all(|r| r.decode_storage_bytes_per_token.is_some())
        .then(|| med(|r| r.decode_storage_bytes_per_token.unwrap_or(0.0)));
    let hit = runs.iter().all(|r| r.decode_hit_rate.is_some()).then(|| med(|r| r.decode_hit_rate.unwrap_or(0.0)));
    let rss = peak_rss_bytes();
    // Resident decode reads every weight byte once per token: memory bandwidth over
    // bytes per token bounds it. Streamed decode also reads its cache misses from
    // disk: disk bandwidth over the bytes missed per token bounds it.
    let bw = (!a.no_roofline).then(|| sluice_engine::stats::memory_read_bandwidth(1 << 30, 5));
    // With several sequences a step reads the dense weights once for all of them (and
    // a MoE model the union of their experts, so there it is an upper bound).
    let roofline = bw.map(|bw| bw / model.bytes_per_token as f64 * a.parallel as f64);
    let streamed = model.store.residency() == Residency::Streamed;
    let disk = if streamed && !a.no_roofline {
        // The roofline is an upper bound: the best of a few queue depths, from one
        // layer's misses on the store's own readers to many experts on more threads.
        let st = model.store.stats();
        let mut best: Option<sluice_experts::DiskBench> = None;
        for (threads, batch) in [(st.read_threads, 8), (2 * st.read_threads, 32), (4 * st.read_threads, 64)] {
            let b = sluice_experts::measure_expert_reads(
                model.store.layout(),
                threads,
                st.chunk_bytes,
                batch,
                std::time::Duration::from_secs(2),
            )?;
            if best.as_ref().is_none_or(|x| b.bytes_per_s > x.bytes_per_s) {
                best = Some(b);
            }
        }
        best
    } else {
        None
    };
    let disk_roofline = disk.as_ref().filter(|_| disk_per_tok > 0.0).map(|b| b.bytes_per_s / disk_per_tok);
    if a.json {
        let j = bench_report(
            a,
            threads,
            (&model, load_s, weights),
            json!({
                "repeat": a.repeat,
                "parallel": a.parallel,
                "prefill_tok_s": p,
                "decode_tok_s": d,
                "decode_tok_s_per_sequence": d_seq,
                "runs": runs,
                "peak_rss_bytes": rss,
                "kv_bits": model.kv_format.bits(),
                "kv_cache_bytes": kv,
                // What one position of a sequence takes, every layer together, in the
                // caches' formats (kv_cache_bytes also counts the buffers' spare room).
                "kv_bytes_per_position": per_position,
                "weight_bytes_per_token": model.bytes_per_token,
                "memory_read_bytes_per_s": bw,
                "roofline_decode_tok_s": roofline,
                "decode_fraction_of_roofline": roofline.map(|r| d / r),
                "decode_disk_bytes_per_token": disk_per_tok,
                "decode_storage_bytes_per_token": storage_per_tok,
                "decode_hit_rate": hit,
                "disk": disk,
                "disk_roofline_decode_tok_s": disk_roofline,
                "decode_fraction_of_disk_roofline": disk_roofline.map(|r| d / r),
                "phases_last_run": phases,
                "experts": expert_stats(&model, &pilot),
                // The backend's own tier (VRAM) since it opened, over every run: null on the CPU.
                "device_experts": model.be.expert_traffic(),
            }),
        );
        println!("{j}");
    } else {
        println!(
            "{}: {} backend, {} threads ({:?}), {} precision, weights {}, experts {}",
            a.engine.model.display(),
            model.be.name(),
            threads,
            sluice_cpu::isa(),
            precision_name(&model),
            weights,
            model.store.residency().name()
        );
        println!("prompt  {:>6} tokens  {:>9.1} tok/s  (median of {})", a.prompt_tokens, p, a.repeat);
        if a.parallel > 1 {
            println!(
                "decode  {:>6} tokens x {} sequences  {:>9.2} tok/s ({:.2} per sequence)",
                a.gen_tokens, a.parallel, d, d_seq
            );
        } else {
            println!("decode  {:>6} tokens  {:>9.2} tok/s", a.gen_tokens, d);
        }
        if let (Some(bw), Some(r)) = (bw, roofline) {
            println!(
                "memory roofline {:.1} tok/s = {:.2} GB/s read / {:.1} MB per token; decode is {:.0}% of it",
                r,
                bw / 1e9,
                model.bytes_per_token as f64 / 1e6,
                100.0 * d / r
            );
        }
        if let Some(h) = hit {
            println!(
                "expert cache hit rate {:.1}% in decode, {:.1} MB read from disk per token",
                100.0 * h,
                disk_per_tok / 1e6
            );
        }
        if let Some(b) = storage_per_tok.filter(|&b| b > 0.0 && hit.is_none()) {
            println!("{:.1} MB read from storage per token in decode (page-ins)", b / 1e6);
        }
        if let (Some(b), Some(r)) = (&disk, disk_roofline) {
            println!(
                "disk roofline {:.2} tok/s = {:.2} GB/s{} / {:.1} MB per token; decode is {:.0}% of it",
                r,
                b.bytes_per_s / 1e9,
                if b.direct { " (O_DIRECT)" } else { " (buffered!)" },
                disk_per_tok / 1e6,
                100.0 * d / r
            );
        }
        if let Some(r) = pilot.recall() {
            println!("pilot prefetch recall {:.1}%", 100.0 * r);
        }
        if let Some(r) = rss {
            println!("peak RSS {:.1} MiB", r as f64 / (1 << 20) as f64);
        }
    }
    Ok(())
}

pub fn inspect(a: InspectArgs) -> Result<()> {
    let ckpt = Checkpoint::open(&a.model)?;
    let spec = &ckpt.spec;
    let tensors = ckpt.tensors();
    let total: u64 = tensors.iter().map(|t| t.len_bytes() as u64).sum();
    let expert = ExpertLayout::from_checkpoint(&ckpt)?.expert_bytes_total();
    let mut dtypes: Vec<(String, u64)> = Vec::new();
    for t in &tensors {
        let name = t.dtype.to_string();
        match dtypes.iter_mut().find(|(n, _)| *n == name) {
            Some((_, b)) => *b += t.len_bytes() as u64,
            None => dtypes.push((name, t.len_bytes() as u64)),
        }
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!("model      {}", a.model.display());
    println!("arch       {} ({:?} family)", spec.arch, spec.family);
    println!(
        "shape      {} layers, hidden {}, vocab {}, context {}",
        spec.n_layers(),
        spec.hidden_size,
        spec.vocab_size,
        spec.max_context
    );
    let sliding = spec.layers.iter().filter(|l| l.attention.window.is_some()).count();
    if sliding > 0 {
        println!(
            "attention  {} sliding (window {}), {} full",
            sliding,
            spec.layers.iter().find_map(|l| l.attention.window).unwrap_or(0),
            spec.n_layers() - sliding
        );
    }
    if let Some(m) = spec.layers.iter().find_map(|l| l.moe.as_ref()) {
        let moe_layers = spec.layers.iter().filter(|l| l.moe.is_some()).count();
        println!(
            "experts    {} of {} layers: {} experts, top-{}, intermediate {}",
            moe_layers,
            spec.n_layers(),
            m.n_experts,
            m.top_k,
            m.intermediate
        );
    }
    if let Some(p) = &spec.ple {
        println!("per-layer  embeddings of width {} (vocab {})", p.dim, p.vocab_size);
    }
    if let Some(h) = &spec.hyper {
        println!("residual   {} streams (hyper-connections, mixer rank {})", h.streams, h.rank);
    }
    println!("tensors    {} in all, {:.3} GiB", tensors.len(), gib(total));
    println!("resident   {:.3} GiB (everything but routed experts)", gib(total - expert));
    println!("experts    {:.3} GiB", gib(expert));
    for (d, b) in &dtypes {
        println!("  {d:<6} {:.3} GiB", gib(*b));
    }
    println!("per layer:");
    for (i, l) in spec.layers.iter().enumerate() {
        let at = &l.attention;
        let mut desc = match (l.linear, at.mla) {
            (Some(d), _) => format!(
                "  {i:>3}  delta-net k {}x{} v {}x{} conv {}",
                d.k_heads, d.k_dim, d.v_heads, d.v_dim, d.conv_kernel
            ),
            (None, Some(m)) => format!(
                "  {i:>3}  latent  heads {} latent {} rope {} (query rank {:?})",
                at.n_heads, m.kv_lora_rank, m.rope_dim, m.q_lora_rank
            ),
            (None, None) => format!(
                "  {i:>3}  {} heads {}x{} kv {}",
                if at.window.is_some() { "sliding" } else { "full   " },
                at.n_heads,
                at.head_dim,
                at.n_kv_heads
            ),
        };
        if let Some(src) = at.kv_source {
            desc += &format!(" (KV of layer {src})");
        }
        if at.k_eq_v {
            desc += " k=v";
        }
        if let (None, Some(ix)) = (l.linear, at.indexer) {
            desc += &format!(" qsa {} tokens in blocks of {}", ix.budget, ix.block);
        }
        if let Some(n) = l.ngram {
            desc += &format!("  n-grams 2..{} x{} ({} rows)", n.n, n.heads_per_n, n.table_rows());
        }
        if let Some(m) = l.mlp {
            desc += &format!("  mlp {m}");
        }
        if let Some(m) = &l.moe {
            desc += &format!("  moe {}x{} top-{}", m.n_experts, m.intermediate, m.top_k);
        }
        println!("{desc}");
    }
    if a.tensors {
        for t in &tensors {
            println!("  {:<60} {:<5} {:?}", t.name, t.dtype.to_string(), t.shape);
        }
    }
    Ok(())
}

pub fn plan(a: PlanArgs) -> Result<()> {
    if a.engine.record_routing.is_some() {
        return Err(Error::Usage("plan runs nothing to record: give a recorded histogram with --routing FILE".into()));
    }
    if a.context == 0 {
        return Err(Error::Usage("--context must be at least 1".into()));
    }
    match choose_backend(&a.engine)? {
        BackendArg::Cpu => plan_on(&Cpu::default(), &a),
        BackendArg::Cuda => plan_on(&open_cuda(&a.engine)?, &a),
        BackendArg::Auto => unreachable!("choose_backend resolves auto"),
    }
}

/// `sluice plan` for backend `be`: where the model would live (on a device: what its
/// memory holds), then, unless `--no-measure`, `be`'s kernels timed on the model's
/// shapes and the speed predicted from them.
fn plan_on<B: Backend>(be: &B, a: &PlanArgs) -> Result<()> {
    let threads = init_threads(a.engine.threads)?;
    let ckpt = Checkpoint::open(&a.engine.model)?;
    let layout = ExpertLayout::from_checkpoint(&ckpt)?;
    let device_room = be.expert_room()?;
    let (opts, at) = load_options(&a.engine, &ckpt, device_room)?;
    let hist = a.routing.as_deref().map(RoutingHistogram::load).transpose()?;
    let profile = plan::Profile::of(&ckpt, &layout);
    if let Some(h) = &hist {
        let ours: Vec<usize> = layout.layers.iter().map(|l| l.as_ref().map_or(0, |l| l.experts.len())).collect();
        if h.layers.iter().map(Vec::len).collect::<Vec<_>>() != ours {
            return Err(Error::Usage(format!(
                "--routing {}: the histogram does not fit this model's experts",
                a.routing.as_deref().map(Path::display).map(|d| d.to_string()).unwrap_or_default()
            )));
        }
    }
    let kv = opts.kv.unwrap_or_else(|| sluice_engine::default_kv_format(be, &ckpt));
    let device = match device_room {
        Some(room) => {
            let kv_bytes = plan::kv_bytes(be, &profile, kv, a.context)?;
            Some(at.on_device(&profile, room, kv_bytes)?)
        }
        None => None,
    };
    let reads_disk = at.residency == Residency::Streamed
        || (at.residency == Residency::Mapped
            && at.available_bytes.is_some_and(|m| at.total_bytes as f64 > m as f64 * 0.8));
    let measured = if a.no_measure {
        None
    } else {
        let on = plan::MeasureOn {
            ckpt: &ckpt,
            profile: &profile,
            precision: plan::Precisions::of(opts.precision),
            kv,
            disk: (reads_disk && at.expert_bytes > 0).then_some(&layout),
        };
        let machine = plan::Machine::measure(be, &on)?;
        let routing = plan::Routing { hist: hist.as_ref(), policy: opts.store.policy };
        let prediction = plan::predict(&profile, &at, &machine, routing, device.as_ref());
        Some((machine, prediction))
    };
    let spec = &ckpt.spec;
    let residency = at.residency.name();
    if a.json {
        let j = json!({
            "model": a.engine.model,
            "arch": spec.arch,
            "backend": be.name(),
            "threads": threads,
            "total_bytes": at.total_bytes,
            "resident_bytes": at.resident_bytes,
            "expert_bytes": at.expert_bytes,
            "available_bytes": at.available_bytes,
            "weights": at.weights,
            "residency": residency,
            "cache_bytes": at.cache_bytes,
            "slots_per_layer": at.slots_per_layer,
            "experts_per_layer": at.experts_per_layer,
            "device": device,
            "profile": profile,
            "machine": measured.as_ref().map(|m| &m.0),
            "prediction": measured.as_ref().map(|m| &m.1),
        });
        println!("{j}");
        return Ok(());
    }
    let gib = |b: u64| human_bytes(b);
    println!(
        "model      {}: {}, {} layers, {}",
        a.engine.model.display(),
        spec.arch,
        spec.n_layers(),
        gib(at.total_bytes)
    );
    println!(
        "memory     {} available (the least of MemAvailable and the memory cgroup's room)",
        at.available_bytes.map_or("unknown".into(), gib)
    );
    if let Some(d) = &device {
        println!(
            "device     {} for sluice ({}): weights {}, a KV cache of {} positions {}, {} for activations",
            gib(d.room_bytes),
            if a.engine.gpu_memory.is_some() { "--gpu-memory" } else { "all but 4 GiB of what is free" },
            gib(d.weights_bytes),
            a.context,
            gib(d.kv_bytes),
            gib(d.scratch_bytes)
        );
        if at.expert_bytes > 0 {
            println!(
                "           VRAM expert tier {}: {} of {} experts a layer ({})",
                gib(d.tier_bytes),
                d.tier_experts_per_layer,
                at.experts_per_layer,
                match d.tier_bytes == at.expert_bytes {
                    true => "all of them, copied at load",
                    false => "the rest copied from host memory as needed",
                }
            );
        }
    } else {
        println!(
            "weights    {} {}",
            gib(at.resident_bytes),
            match at.weights {
                WeightsPlace::Memory => "in sluice's memory (read at load, on huge pages)",
                WeightsPlace::Mapped => "mapped from the file (the page cache holds them)",
            }
        );
    }
    if at.expert_bytes > 0 {
        let how = match at.residency {
            Residency::Resident if device.is_some() => "resident: read into page-locked memory at load".to_string(),
            Residency::Resident => "resident: read into memory at load".to_string(),
            Residency::Mapped => "mapped: the page cache decides what stays".to_string(),
            Residency::Streamed => format!(
                "streamed from disk through a {} cache ({} of {} slots per layer, {})",
                gib(at.cache_bytes),
                at.slots_per_layer,
                at.experts_per_layer,
                opts.store.policy.name()
            ),
        };
        println!("experts    {} in {} layers: {how}", gib(at.expert_bytes), profile.moe_layers.len());
    }
    if let Some((m, p)) = &measured {
        match &m.device {
            Some(d) => println!(
                "machine    {} ({}): copies within it {:.2} TB/s (read + write), from the host {:.1} GB/s \
                 page-locked, {:.1} GB/s pageable; the model's {} product shapes timed on random weights",
                d.name,
                gib(d.total_bytes),
                d.copy_bytes_per_s / 1e12,
                d.locked_bytes_per_s / 1e9,
                d.pageable_bytes_per_s / 1e9,
                m.products.len()
            ),
            None => println!(
                "machine    {} threads; memory reads {:.1} GB/s; the model's {} product shapes timed on random weights",
                m.threads,
                m.memory_read_bytes_per_s / 1e9,
                m.products.len()
            ),
        }
        if let Some(d) = m.disk_bytes_per_s {
            println!("           disk {:.2} GB/s (O_DIRECT, this model's experts)", d / 1e9);
        }
        let ms = |s: f64| s * 1e3;
        let mut decode = format!(
            "decode  {:>8.2} tok/s  ({:.1} ms of products and attention, {:.1} ms of {} small operations",
            p.decode_tok_s,
            ms(p.decode_memory_s),
            ms(p.decode_small_ops_s),
            m.small_ops_per_layer * profile.layers
        );
        // The experts a cache lacks: how long moving them takes, how many bytes, where
        // from, and the cache's hit rate.
        let misses = |s: f64, bytes: f64, how: &str, cache: &str, h: f64| {
            format!(", {:.1} ms for {:.1} MB of experts {how}; {cache} hit rate {:.0}%", ms(s), bytes / 1e6, 100.0 * h)
        };
        if let Some(h) = p.decode_device_hit_rate {
            decode += &misses(p.decode_copy_s, p.decode_copy_bytes_per_token, "copied to the device", "VRAM tier", h);
        }
        if let Some(h) = p.decode_hit_rate {
            decode += &misses(p.decode_disk_s, p.decode_disk_bytes_per_token, "read from disk", "expert cache", h);
        }
        println!("predicted  {decode} per token)");
        let mut prefill =
            format!("prefill {:>8.1} tok/s  ({:.2} ms of arithmetic", p.prefill_tok_s, ms(p.prefill_compute_s));
        if p.prefill_copy_s > 0.0 {
            prefill += &format!(", {:.2} ms of copies to the device", ms(p.prefill_copy_s));
        }
        if p.prefill_disk_s > 0.0 {
            prefill += &format!(" and {:.2} ms of expert reads, overlapped", ms(p.prefill_disk_s));
        }
        println!("           {prefill} per token)");
        if hist.is_none() && (p.decode_hit_rate.is_some() || p.decode_device_hit_rate.is_some_and(|h| h < 1.0)) {
            println!(
                "           (hit rates assume uniform routing; --routing FILE from --record-routing for real ones)"
            );
        }
    }
    Ok(())
}

pub fn serve(mut a: ServeArgs) -> Result<()> {
    if a.engine.precision == PrecisionArg::Auto {
        a.engine.precision = match sluice_server::DEFAULT_PRECISION {
            Precision::Fast => PrecisionArg::Fast,
            Precision::Accurate => PrecisionArg::Accurate,
        };
    }
    for (flag, n) in [("--parallel", a.parallel), ("--step-tokens", a.step_tokens)] {
        if n == 0 {
            return Err(Error::Usage(format!("{flag} must be at least 1")));
        }
    }
    if a.context == Some(0) {
        return Err(Error::Usage("--context must be at least 1".into()));
    }
    if a.api_key.as_deref() == Some("") {
        return Err(Error::Usage("--api-key is empty".into()));
    }
    let prompt_cache = match a.prompt_cache.trim() {
        "0" => 0,
        s => parse_size("--prompt-cache", s, "not a size (1GiB, or 0)")?,
    };
    let max_body = parse_size("--max-body", &a.max_body, "not a size (16MiB)")?;
    if !(a.body_timeout.is_finite() && a.body_timeout > 0.0 && a.body_timeout < 1e6) {
        return Err(Error::Usage(format!(
            "--body-timeout must be a positive number of seconds, got {}",
            a.body_timeout
        )));
    }
    let is_loopback = a.host == "localhost" || a.host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !is_loopback && a.api_key.is_none() {
        eprintln!("warning: serving on {} without --api-key: anyone who can reach it can use the model", a.host);
    }
    init_threads(a.engine.threads)?;
    let mut tok = load_tokenizer(&a.engine.model)?;
    let chat_stop = ensure_chat_template(&mut tok, a.chat_template.as_deref())?;
    let ckpt = Checkpoint::open(&a.engine.model)?;
    let info = model_info(&ckpt);
    let name = a.name.clone().unwrap_or_else(|| {
        let p = a
            .engine
            .model
            .file_name()
            .map_or_else(|| a.engine.model.display().to_string(), |f| f.to_string_lossy().into());
        p.strip_suffix(".gguf").map(String::from).unwrap_or(p)
    });
    drop(ckpt);
    let cfg = sluice_server::ServeConfig {
        host: a.host.clone(),
        port: a.port,
        api_key: a.api_key.clone(),
        name,
        max_body_bytes: usize::try_from(max_body).unwrap_or(usize::MAX),
        body_timeout: std::time::Duration::from_secs_f64(a.body_timeout),
        limits: sluice_server::Limits {
            parallel: a.parallel,
            max_queue: a.max_queue,
            step_rows: a.step_tokens,
            prefix_cache_bytes: usize::try_from(prompt_cache).unwrap_or(usize::MAX),
        },
        chat_stop: chat_stop.map(String::from),
        info,
    };
    with_backend!(&a.engine, |loaded| {
        let mut model = loaded.model;
        if let Some(n) = a.context {
            model.max_context = model.max_context.min(n);
        }
        sluice_server::serve(model, tok, cfg)
    })
}

/// What Ollama's `/api/show` and `/api/tags` describe.
fn model_info(ckpt: &Checkpoint) -> sluice_server::ModelInfo {
    let spec = &ckpt.spec;
    let tensors = ckpt.tensors();
    let gguf = ckpt.path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    sluice_server::ModelInfo {
        path: ckpt.path.display().to_string(),
        format: if gguf { "gguf" } else { "safetensors" }.into(),
        family: format!("{:?}", spec.family).to_lowercase(),
        architecture: spec.arch.clone(),
        parameters: tensors.iter().map(|t| t.shape.iter().product::<usize>() as u64).sum(),
        size_bytes: tensors.iter().map(|t| t.len_bytes() as u64).sum(),
        quantization: spec.weight_dtype.map(|d| format!("{d:?}")).unwrap_or_default(),
        context_length: spec.max_context,
        layers: spec.n_layers(),
        hidden_size: spec.hidden_size,
        vocab_size: spec.vocab_size,
    }
}
