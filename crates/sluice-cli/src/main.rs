//! `sluice`: run Mixture-of-Experts language models larger than memory.

mod commands;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Run Mixture-of-Experts language models that do not fit in memory",
    long_about = "Run Mixture-of-Experts language models that do not fit in memory.\n\n\
MODEL is a Hugging Face folder (config.json, safetensors, tokenizer.json).\n\
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
    /// Describe a model: architecture, tensors, quant types, resident and expert bytes
    Inspect(commands::InspectArgs),
}

/// Flags shared by every command that runs a model.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// Model: a Hugging Face folder
    #[arg(long, short = 'm', value_name = "PATH")]
    pub model: std::path::PathBuf,
    /// Worker threads for the kernels (default: all cores)
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsMode {
    /// Run the tokens as one sequence
    Prefill,
    /// Feed the tokens one at a time through the KV cache
    Decode,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => commands::run(a),
        Command::Logits(a) => commands::logits(a),
        Command::Tokenize(a) => commands::tokenize(a),
        Command::Bench(a) => commands::bench(a),
        Command::Inspect(a) => commands::inspect(a),
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
