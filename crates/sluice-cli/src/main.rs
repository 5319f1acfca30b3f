//! `sluice`: run Mixture-of-Experts language models larger than memory.

mod commands;
mod synth_pack;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Run Mixture-of-Experts language models that do not fit in memory",
    long_about = "Run Mixture-of-Experts language models that do not fit in memory.\n\n\
MODEL is a GGUF file or a Hugging Face folder (config.json, safetensors, tokenizer.json).\n\
Everything a token always touches stays resident; routed experts are served by the expert store."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, or chat with the model's chat template
    Run(commands::RunArgs),
    /// Write the logits of a token sequence to a file (little-endian f32, [n_tokens, vocab])
    Logits(commands::LogitsArgs),
    /// Print the token ids of a text as a JSON array
    Tokenize(commands::TokenizeArgs),
    /// Measure prompt processing and decode speed
    Bench(commands::BenchArgs),
    /// Perplexity over a text file, as llama.cpp's llama-perplexity measures it: windows
    /// of --context tokens, each from an empty state, their second halves scored
    Perplexity(commands::PerplexityArgs),
    /// Describe a model: architecture, tensors, quant types, resident and expert bytes
    Inspect(commands::InspectArgs),
    /// Where each part of a model would live (memory, mapped, streamed, cache size) and
    /// the decode and prefill speed predicted from this machine's measured rates
    Plan(commands::PlanArgs),
    /// Serve the model over HTTP: OpenAI (/v1/chat/completions, /v1/completions,
    /// /v1/models), Anthropic (/v1/messages) and Ollama (/api/chat, /api/generate,
    /// /api/tags, /api/show) APIs, many requests batched together; /health, /metrics
    Serve(commands::ServeArgs),
    /// Write a synthetic MoE checkpoint with a real model's geometry (random weights)
    Synth(synth_pack::SynthArgs),
    /// Write a model's experts in the packed layout: each expert one contiguous, aligned read
    Pack(synth_pack::PackArgs),
}

/// Flags shared by every command that runs a model.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// Model: a .gguf file or a Hugging Face folder
    #[arg(long, short = 'm', value_name = "PATH")]
    pub model: std::path::PathBuf,
    /// Worker threads for the kernels (default: all cores)
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Where routed experts live: all in memory, mapped (the OS page cache decides),
    /// streamed (sluice's own cache and reads), or auto (mapped if the model fits in
    /// memory, streamed otherwise; memory available is MemAvailable, or the room under
    /// the process's memory cgroup limit if less)
    #[arg(long, value_enum, default_value_t = ResidencyArg::Auto)]
    pub residency: ResidencyArg,
    /// Where the model computes: cpu, cuda (the first NVIDIA GPU: weights, KV cache
    /// and activations in its memory; routed experts copied there at load when they all
    /// fit, else kept there from their first use while room lasts), or auto (cuda when
    /// a GPU and CUDA's libraries are there)
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    pub backend: BackendArg,
    /// With --backend cuda: the most device memory sluice takes (24GiB): resident
    /// weights first, then the VRAM expert tier (default: all but 4 GiB of what is free)
    #[arg(long, value_name = "SIZE")]
    pub gpu_memory: Option<String>,
    /// Expert cache for streamed residency: bytes with a unit (4GiB, 512MiB) or a number
    /// of slots per MoE layer (16)
    #[arg(long, value_name = "SIZE")]
    pub expert_cache: Option<String>,
    /// Read experts ahead: off, or pilot (probe the next layer's router)
    #[arg(long, value_enum, default_value_t = PrefetchArg::Off)]
    pub prefetch: PrefetchArg,
    /// Which cached expert a miss evicts, in the host's expert cache (streamed) and in
    /// the GPU's VRAM tier: the least recently used, or the least often
    #[arg(long, value_enum, default_value_t = PolicyArg::Lru)]
    pub cache_policy: PolicyArg,
    /// Pin each layer's most-used experts, from a histogram saved by --record-routing
    #[arg(long, value_name = "FILE")]
    pub pin_hot: Option<std::path::PathBuf>,
    /// Save how often each expert was routed to, at the end
    #[arg(long, value_name = "FILE")]
    pub record_routing: Option<std::path::PathBuf>,
    /// Threads reading experts from disk (streamed)
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub read_threads: usize,
    /// Read through the page cache instead of O_DIRECT (streamed)
    #[arg(long)]
    pub no_direct_io: bool,
    /// Activations against quantized weights: fast (8 bits, as llama.cpp), accurate
    /// (16 bits, logits within a few thousandths of f32; prefill 6-24% slower), or
    /// auto (accurate for decode steps and the prompt's last token, where it costs
    /// at most a few percent; fast for the rest of the prompt; with serve, fast)
    #[arg(long, value_enum, default_value_t = PrecisionArg::Auto)]
    pub precision: PrecisionArg,
    /// Where the weights other than routed experts live: memory (read into sluice's
    /// own memory at load, on huge pages where the OS has them: decode reads them
    /// faster), mapped (used in place in the file's page-cache pages: no load time,
    /// shared with other processes), or auto (memory if they fit in 80% of the memory
    /// available). Routed experts go by --residency.
    #[arg(long, value_enum, default_value_t = WeightsArg::Auto)]
    pub weights: WeightsArg,
    /// Bits per cached key and value: 32 (f32), 16 (f16), 8 (8-bit with a scale per
    /// head), or TurboQuant's 4, 3.5, 3, 2 (a random rotation, then Lloyd-Max codes;
    /// attention reads the codes). Sliding-window layers keep 16. Default: 16 for
    /// quantized and 16-bit checkpoints, 32 for f32 ones and on CUDA
    #[arg(long, value_name = "BITS", value_parser = parse_kv_bits)]
    pub kv_bits: Option<sluice_core::KvFormat>,
}

fn parse_kv_bits(s: &str) -> Result<sluice_core::KvFormat, String> {
    s.parse().map_err(|_| format!("takes {}", sluice_core::KvFormat::NAMES))
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightsArg {
    Auto,
    Memory,
    Mapped,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrecisionArg {
    Auto,
    Fast,
    Accurate,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendArg {
    Cpu,
    Cuda,
    Auto,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResidencyArg {
    Resident,
    Mapped,
    Streamed,
    Auto,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchArg {
    Off,
    Pilot,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyArg {
    Lru,
    Lfu,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsMode {
    /// Run the tokens as one sequence
    Prefill,
    /// Feed the tokens one at a time through the KV cache
    Decode,
}

fn main() -> ExitCode {
    // Die quietly when the reader of our output goes away (`sluice inspect | head`), as
    // Unix tools do, instead of panicking on a failed print.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => commands::run(a),
        Command::Logits(a) => commands::logits(a),
        Command::Tokenize(a) => commands::tokenize(a),
        Command::Bench(a) => commands::bench(a),
        Command::Perplexity(a) => commands::perplexity(a),
        Command::Inspect(a) => commands::inspect(a),
        Command::Plan(a) => commands::plan(a),
        Command::Serve(a) => commands::serve(a),
        Command::Synth(a) => synth_pack::synth(a),
        Command::Pack(a) => synth_pack::pack(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line a user can act on: it names the file, tensor or value.
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
