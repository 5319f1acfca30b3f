//! `sluice synth` (synthetic MoE checkpoints with a real model's geometry) and
//! `sluice pack` (the expert-contiguous layout).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use sluice_core::{DType, Error, Result};
use sluice_experts::human_bytes;
use sluice_formats::Checkpoint;
use sluice_formats::pack::{self, PackSummary};
use sluice_formats::synth::{Arch, Geometry, Synth, SynthOptions};

#[derive(Args)]
pub struct SynthArgs {
    /// Geometry to copy: qwen3-30b-a3b, qwen3-235b-a22b, gemma4-26b-a4b, gpt-oss-120b,
    /// deepseek-v3, qwen3.5-397b-a17b; for tests tiny-moe, tiny-gemma4, tiny-gpt-oss,
    /// tiny-deepseek, tiny-qwen3.5
    #[arg(long, value_name = "NAME")]
    geometry: String,
    /// Keep only the first N layers (Gemma 4 keeps its last layer full attention)
    #[arg(long, value_name = "N")]
    layers: Option<usize>,
    /// Weight type of the matrices: q4_k, q5_k, q6_k, q8_0, q4_0, q4_1, q5_0, q5_1, mxfp4,
    /// f16, bf16 (rows that are not whole super-blocks fall back to a 32-element type);
    /// gpt-oss geometries keep their experts in MXFP4, their native format
    #[arg(long, value_name = "TYPE", default_value = "q4_k")]
    quant: String,
    /// Zipf exponent of each layer's expert popularity (a router bias); 0 is uniform, 0.9
    /// gives LRU hit rates like a real model's (about 62% with 16 of 128 slots, 82% with 32)
    #[arg(long, value_name = "ALPHA", default_value_t = 0.0)]
    skew: f32,
    /// Random seed: the same seed gives the same weights
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output GGUF file
    #[arg(long, value_name = "FILE", required_unless_present = "packed", conflicts_with = "packed")]
    out: Option<PathBuf>,
    /// Write the packed layout (model.gguf, experts.bin, sluice-pack.json) into this folder instead
    #[arg(long, value_name = "DIR")]
    packed: Option<PathBuf>,
}

#[derive(Args)]
pub struct PackArgs {
    /// Model to pack: a .gguf file or a Hugging Face folder
    #[arg(long, short = 'm', value_name = "PATH")]
    model: PathBuf,
    /// Folder to write (must not exist, or be empty)
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

/// `q4_k`, `Q4_K`, `q4k` and the like.
fn parse_quant(s: &str) -> Result<DType> {
    let key = |x: &str| x.replace(['_', '-'], "").to_ascii_uppercase();
    let want = key(s);
    DType::ALL.into_iter().find(|d| key(d.name()) == want).ok_or_else(|| {
        Error::Usage(format!(
            "--quant: '{s}' is not a weight type (q4_k, q5_k, q6_k, q8_0, q4_0, q4_1, q5_0, q5_1, mxfp4, f16, bf16)"
        ))
    })
}

/// A byte progress bar on a terminal, nothing elsewhere.
fn progress_bar(total: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(total);
    let template =
        format!("{what} {{bar:40}} {{binary_bytes}}/{{binary_total_bytes}} {{binary_bytes_per_sec}} {{eta}}");
    b.set_style(ProgressStyle::with_template(&template).expect("a valid template"));
    b
}

fn share(part: u64, total: u64) -> f64 {
    100.0 * part as f64 / total.max(1) as f64
}

pub fn synth(a: SynthArgs) -> Result<()> {
    let geometry = Geometry::named(&a.geometry).ok_or_else(|| {
        Error::Usage(format!("--geometry: unknown geometry '{}' (known: {})", a.geometry, Geometry::names().join(", ")))
    })?;
    let geometry = match a.layers {
        Some(n) => geometry.with_layers(n)?,
        None => geometry,
    };
    let quant = parse_quant(&a.quant)?;
    let synth = Synth::new(SynthOptions { geometry, quant, skew: a.skew, seed: a.seed, tuning: Default::default() })?;
    let g = &synth.opts.geometry;
    let (total, experts, resident) = (synth.total_bytes(), synth.expert_bytes(), synth.resident_bytes());
    let types = match g.arch {
        Arch::GptOss => format!("{quant}, experts MXFP4"),
        _ => quant.to_string(),
    };
    println!(
        "synth {}: {} layers, hidden {}, {} experts top-{} of width {}, vocab {}, {types}, skew {}, seed {}",
        g.name, g.n_layers, g.hidden, g.n_experts, g.top_k, g.expert_ffn, g.vocab, a.skew, a.seed
    );
    println!(
        "  {} in all: experts {} ({:.1}%), resident {}",
        human_bytes(total),
        human_bytes(experts),
        share(experts, total),
        human_bytes(resident)
    );
    let bar = progress_bar(total, "writing");
    let inc = |n: u64| bar.inc(n);
    let t = Instant::now();
    let target = match (&a.out, &a.packed) {
        (Some(out), _) => {
            // The file is written beside its name and renamed over it: never over a device.
            if std::fs::metadata(out).is_ok_and(|m| !m.is_file()) {
                return Err(Error::Usage(format!("--out {}: exists and is not a regular file", out.display())));
            }
            synth.write_gguf(out, &inc)?;
            out.clone()
        }
        (None, Some(dir)) => synth.write_packed(dir, &inc)?.dir,
        (None, None) => return Err(Error::Usage("give --out FILE.gguf or --packed DIR".into())),
    };
    bar.finish_and_clear();
    let s = t.elapsed().as_secs_f64();
    println!("wrote {} in {s:.1} s ({:.0} MB/s)", target.display(), total as f64 / s.max(1e-9) / 1e6);
    Ok(())
}

pub fn pack(a: PackArgs) -> Result<()> {
    let ckpt = Checkpoint::open(&a.model)?;
    let total: u64 = ckpt.tensors().iter().map(|t| t.len_bytes() as u64).sum();
    let bar = progress_bar(total, "packing");
    let inc = |n: u64| bar.inc(n);
    let t = Instant::now();
    let PackSummary { dir, model_file, model_bytes, experts_bytes, moe_layers, experts } =
        pack::pack(&ckpt, &a.out, &inc)?;
    bar.finish_and_clear();
    let s = t.elapsed().as_secs_f64();
    println!("packed {} into {} in {s:.1} s", a.model.display(), dir.display());
    println!("  {}: {}", model_file.display(), human_bytes(model_bytes));
    println!(
        "  {}: {} ({experts} experts over {moe_layers} MoE layers, each one {}-aligned read)",
        dir.join(pack::EXPERTS_FILE).display(),
        human_bytes(experts_bytes),
        human_bytes(pack::EXPERT_ALIGN)
    );
    Ok(())
}
