//! The subcommands. Each loads what it needs, does one thing, and returns an error
//! that names the file, tensor or value at fault.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde_json::json;
use sluice_core::{Error, Result};
use sluice_engine::stats::{PhaseMs, peak_rss_bytes};
use sluice_engine::{Logits, Model, Sampler, SamplerConfig};
use sluice_formats::Checkpoint;
use sluice_tokenizer::{ChatMessage, StreamDecoder, Tokenizer};

use crate::{EngineArgs, LogitsMode};

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Text to continue, or with --chat the user's message
    #[arg(long, short = 'p')]
    prompt: Option<String>,
    /// Use the model's chat template; without --prompt, chat interactively on stdin
    #[arg(long)]
    chat: bool,
    /// System message for --chat
    #[arg(long)]
    system: Option<String>,
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
    /// Comma-separated token ids
    #[arg(long, value_name = "IDS")]
    tokens: String,
    /// Output file: little-endian f32, row-major [n_tokens, vocab]
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// prefill runs the tokens as one sequence; decode feeds them one at a time
    #[arg(long, value_enum, default_value_t = LogitsMode::Prefill)]
    mode: LogitsMode,
}

#[derive(Args)]
pub struct TokenizeArgs {
    /// Model folder (only its tokenizer is read)
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
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct InspectArgs {
    /// Model folder
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

fn load_model(e: &EngineArgs) -> Result<(Model, f64)> {
    let t = Instant::now();
    let model = Model::open(&e.model)?;
    Ok((model, t.elapsed().as_secs_f64()))
}

fn stop_ids(model: &Model, tok: &Tokenizer) -> Vec<u32> {
    let mut ids: Vec<u32> = tok.eos_ids().to_vec();
    ids.extend(&model.spec.eos_token_ids);
    ids.sort_unstable();
    ids.dedup();
    ids
}

pub fn run(a: RunArgs) -> Result<()> {
    if a.prompt.is_none() && !a.chat {
        return Err(Error::Usage("give --prompt TEXT, or --chat to chat".into()));
    }
    if a.system.is_some() && !a.chat {
        return Err(Error::Usage("--system goes with --chat".into()));
    }
    if !(0.0..=1.0).contains(&a.top_p) || a.temperature < 0.0 || !a.temperature.is_finite() {
        return Err(Error::Usage("--temperature must be >= 0 and --top-p in [0, 1]".into()));
    }
    let threads = init_threads(a.engine.threads)?;
    let tok = Tokenizer::from_hf_dir(&a.engine.model)?;
    let (model, load_s) = load_model(&a.engine)?;
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
    });
    let mut sampler = Sampler::new(SamplerConfig { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed });
    let stops = stop_ids(&model, &tok);
    let mut session = model.session();
    let mut out = std::io::stdout().lock();
    let mut totals = Vec::new();

    let mut generate_into = |session: &mut sluice_engine::Session<'_, sluice_engine::Cpu>,
                             prompt: &[u32],
                             out: &mut std::io::StdoutLock<'_>|
     -> Result<(Vec<u32>, sluice_engine::GenerationStats)> {
        let mut dec = StreamDecoder::with_context(&tok, prompt, true)?;
        let mut produced = Vec::new();
        let st = session.generate(prompt, a.max_tokens, &stops, &mut sampler, |id| {
            produced.push(id);
            let piece = dec.push(id)?;
            out.write_all(piece.as_bytes()).map_err(|e| Error::io("<stdout>", e))?;
            out.flush().map_err(|e| Error::io("<stdout>", e))?;
            Ok(true)
        })?;
        let rest = dec.finish()?;
        writeln!(out, "{rest}").map_err(|e| Error::io("<stdout>", e))?;
        Ok((produced, st))
    };

    if !a.chat {
        let prompt = tok.encode(a.prompt.as_deref().unwrap_or(""), true)?;
        if prompt.is_empty() {
            return Err(Error::Usage("the prompt encodes to no tokens".into()));
        }
        write!(out, "{}", a.prompt.as_deref().unwrap_or("")).map_err(|e| Error::io("<stdout>", e))?;
        let (_, st) = generate_into(&mut session, &prompt, &mut out)?;
        totals.push(st);
    } else {
        if !tok.has_chat_template() {
            return Err(Error::Template(format!(
                "{} has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja)",
                a.engine.model.display()
            )));
        }
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
                session.reset();
                &ids
            };
            let (produced, st) = generate_into(&mut session, new, &mut out)?;
            totals.push(st);
            let reply = tok.decode(&produced, true)?;
            messages.push(ChatMessage::new("assistant", reply));
            // The session holds the prompt and every generated token but the last.
            held = ids;
            held.extend(&produced[..produced.len().saturating_sub(1)]);
            if session.len() != held.len() {
                held.clear();
                session.reset();
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
            "load_s": load_s,
            "prompt_tokens": prompt_tokens,
            "generated_tokens": generated,
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "prefill_tok_s": prompt_tokens as f64 / prefill_s.max(1e-9),
            "decode_tok_s": decode_steps as f64 / decode_s.max(1e-9),
            "stop": totals.last().map(|s| s.stop),
            "kv_cache_bytes": session.kv_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
            "phases": PhaseMs::from(&session.timers),
            "experts": expert_counters(&model),
        });
        eprintln!("{stats}");
    }
    Ok(())
}

fn expert_counters(model: &Model) -> serde_json::Value {
    use std::sync::atomic::Ordering::Relaxed;
    let c = &model.store.counters;
    json!({
        "total_bytes": model.store.total_bytes(),
        "fetches": c.fetches.load(Relaxed),
        "experts_served": c.experts_served.load(Relaxed),
        "bytes_served": c.bytes_served.load(Relaxed),
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
    let tokens = parse_tokens(&a.tokens)?;
    init_threads(a.engine.threads)?;
    let (model, _) = load_model(&a.engine)?;
    let mut s = model.session();
    let logits = match a.mode {
        LogitsMode::Prefill => s.forward(&tokens, Logits::All)?,
        LogitsMode::Decode => {
            let mut all = Vec::with_capacity(tokens.len() * model.spec.vocab_size);
            for &t in &tokens {
                all.extend(s.forward(&[t], Logits::All)?);
            }
            all
        }
    };
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    // Write beside the target and rename, so a failure leaves no half-written file.
    let tmp = a.out.with_extension("partial");
    std::fs::write(&tmp, &bytes).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, &a.out).map_err(|e| Error::io(&a.out, e))?;
    Ok(())
}

pub fn tokenize(a: TokenizeArgs) -> Result<()> {
    let tok = Tokenizer::from_hf_dir(&a.model)?;
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

pub fn bench(a: BenchArgs) -> Result<()> {
    if a.repeat == 0 || a.prompt_tokens == 0 {
        return Err(Error::Usage("--repeat and --prompt-tokens must be at least 1".into()));
    }
    let threads = init_threads(a.engine.threads)?;
    let (model, load_s) = load_model(&a.engine)?;
    let vocab = model.spec.vocab_size as u64;
    // A fixed pseudo-random prompt: the same tokens on every run and machine.
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let prompt: Vec<u32> = (0..a.prompt_tokens)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab) as u32
        })
        .collect();
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut last = None;
    for _ in 0..a.repeat {
        let mut s = model.session();
        let mut sampler = Sampler::new(SamplerConfig { temperature: 0.0, ..Default::default() });
        let st = s.generate(&prompt, a.gen_tokens, &[], &mut sampler, |_| Ok(true))?;
        prefill.push(st.prefill_tok_s());
        decode.push(st.decode_tok_s());
        last = Some((PhaseMs::from(&s.timers), s.kv_bytes()));
    }
    let (phases, kv) = last.expect("at least one run");
    let p = median(&mut prefill);
    let d = median(&mut decode);
    let rss = peak_rss_bytes();
    if a.json {
        let j = json!({
            "model": a.engine.model,
            "arch": model.spec.arch,
            "threads": threads,
            "isa": format!("{:?}", sluice_cpu::isa()),
            "load_s": load_s,
            "prompt_tokens": a.prompt_tokens,
            "gen_tokens": a.gen_tokens,
            "repeat": a.repeat,
            "prefill_tok_s": p,
            "decode_tok_s": d,
            "prefill_tok_s_runs": prefill,
            "decode_tok_s_runs": decode,
            "peak_rss_bytes": rss,
            "kv_cache_bytes": kv,
            "phases_last_run": phases,
            "experts": expert_counters(&model),
        });
        println!("{j}");
    } else {
        println!("{}: {} threads ({:?})", a.engine.model.display(), threads, sluice_cpu::isa());
        println!("prompt  {:>6} tokens  {:>9.1} tok/s  (median of {})", a.prompt_tokens, p, a.repeat);
        println!("decode  {:>6} tokens  {:>9.1} tok/s", a.gen_tokens, d);
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
    let is_expert = |name: &str| name.contains(".experts.");
    let total: u64 = tensors.iter().map(|t| t.len_bytes() as u64).sum();
    let expert: u64 = tensors.iter().filter(|t| is_expert(&t.name)).map(|t| t.len_bytes() as u64).sum();
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
    println!("tensors    {} in all, {:.3} GiB", tensors.len(), gib(total));
    println!("resident   {:.3} GiB (everything but routed experts)", gib(total - expert));
    println!("experts    {:.3} GiB", gib(expert));
    for (d, b) in &dtypes {
        println!("  {d:<6} {:.3} GiB", gib(*b));
    }
    println!("per layer:");
    for (i, l) in spec.layers.iter().enumerate() {
        let at = &l.attention;
        let mut desc = format!(
            "  {i:>3}  {} heads {}x{} kv {}",
            if at.window.is_some() { "sliding" } else { "full   " },
            at.n_heads,
            at.head_dim,
            at.n_kv_heads
        );
        if let Some(src) = at.kv_source {
            desc += &format!(" (KV of layer {src})");
        }
        if at.k_eq_v {
            desc += " k=v";
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
