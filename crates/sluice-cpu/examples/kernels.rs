//! Matmul kernel speed, per stored format, against the machine's own limits.
//!
//!     cargo run --release -p sluice-cpu --example kernels -- [--only Q4_K,Q6_K] [--bw 40]
//!         [--no-cold] [--no-hot] [--no-prefill] [--no-big] [--no-small] [--no-models]
//!
//! Per format, with 1 and 2 threads:
//! - decode (n = 1) on 4096 x 4096, cycling through enough copies that they do not fit
//!   the L3 cache: GB/s of weight bytes read and the fraction of `--bw` GB/s (the
//!   machine's measured read bandwidth, 40 by default);
//! - decode on one 4096 x 4096 matrix repeated (cache-resident where it fits);
//! - prefill (n = 128) on 4096 x 4096: GFLOP/s (2 * rows * cols * n per call).
//!
//! With `--rows` (`--accurate`: 16-bit activations), a few rows on the hot 4096 x 4096
//! matrix (n = 1, 2, 4, 8, 16, the decode steps of a few sequences and the rows an
//! expert gets): integer
//! multiply-accumulates per second (rows * cols * n per call) and time per row against
//! n = 1, to see where arithmetic binds.
//!
//! Then small-model shapes (SmolLM2-135M: 576 x 576 and 1536 x 576 / 576 x 1536, Q4_1;
//! Qwen2.5-1.5B: 896 x 1536 Q4_K and Q6_K): microseconds per decode call, and the
//! per-call overhead, measured on a 16 x 32 matrix whose arithmetic is negligible.
//!
//! Last, the matmuls of whole models (real shapes and formats, random values) per
//! decoded token and per 128-token prompt; `--decode-rows N` adds N tokens decoded
//! together (`--accurate` for 16-bit activations, as decode steps use), the aggregate
//! tokens per second of a batch of sequences. With `KERN_HOT` set in the environment,
//! the matrices of one shape share their bytes, so that the same work runs from the
//! caches: the difference to the default says how much of it memory binds.
//!
//! Times are the best of five trials, so that other processes on a shared machine
//! disturb them less; run it on an idle machine all the same.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::{Rng, random_input, random_matrix, time};
use sluice_core::{DType, MatRef, Precision};
use sluice_cpu::matmul;

const BIG: usize = 4096;

fn parse(name: &str) -> DType {
    common::ALL
        .into_iter()
        .find(|d| d.name().eq_ignore_ascii_case(name))
        .unwrap_or_else(|| panic!("unknown type {name}"))
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| args.iter().position(|a| a == name).map(|i| args[i + 1].clone());
    let bw: f64 = flag("--bw").map_or(40.0, |v| v.parse().unwrap());
    let only: Vec<DType> = flag("--only").map_or(
        vec![
            DType::Q4_0,
            DType::Q4_1,
            DType::Q5_0,
            DType::Q5_1,
            DType::Q8_0,
            DType::Q4K,
            DType::Q5K,
            DType::Q6K,
            DType::MXFP4,
            DType::BF16,
            DType::F16,
            DType::F32,
        ],
        |v| v.split(',').map(parse).collect(),
    );
    let has = |name: &str| args.iter().any(|a| a == name);
    let skip_small = has("--no-small");
    // For profiling one phase: skip the others.
    let (skip_cold, skip_hot, skip_prefill) = (has("--no-cold"), has("--no-hot"), has("--no-prefill"));
    println!("isa {:?}; read bandwidth reference {bw} GB/s", sluice_cpu::isa());
    println!(
        "{:<6} {:>3} | {:>22} | {:>16} | {:>14}",
        "type", "thr", "decode DRAM GB/s (frac)", "decode hot GB/s", "prefill GFLOP/s"
    );
    let mut rng = Rng(7);
    let pools = [pool(1), pool(2)];
    let only = if has("--no-big") || has("--rows") { vec![] } else { only };
    for dtype in only {
        let one = random_matrix(dtype, BIG, BIG, &mut rng);
        // Enough copies to overflow a 32 MiB L3 several times.
        let copies = (256usize << 20).div_ceil(one.len()).max(2);
        let many: Vec<Vec<u8>> = (0..copies).map(|_| one.clone()).collect();
        let x1 = random_input(1, BIG, &mut rng);
        let xp = random_input(128, BIG, &mut rng);
        let mut out1 = vec![0f32; BIG];
        let mut outp = vec![0f32; 128 * BIG];
        for (ti, p) in pools.iter().enumerate() {
            let mut k = 0;
            let cold = if skip_cold {
                f64::NAN
            } else {
                p.install(|| {
                    time(Duration::from_millis(600), || {
                        let w = MatRef::new(dtype, BIG, BIG, &many[k % copies]).unwrap();
                        matmul(w, &x1, 1, &mut out1, Precision::Fast);
                        k += 1;
                    })
                })
            };
            let w = MatRef::new(dtype, BIG, BIG, &one).unwrap();
            let hot = if skip_hot {
                f64::NAN
            } else {
                p.install(|| time(Duration::from_millis(400), || matmul(w, &x1, 1, &mut out1, Precision::Fast)))
            };
            let pre = if skip_prefill {
                f64::NAN
            } else {
                p.install(|| time(Duration::from_millis(1000), || matmul(w, &xp, 128, &mut outp, Precision::Fast)))
            };
            let gb = one.len() as f64 / 1e9;
            println!(
                "{:<6} {:>3} | {:>12.1} ({:>5.2}) | {:>16.1} | {:>14.1}",
                dtype.name(),
                ti + 1,
                gb / cold,
                gb / cold / bw,
                gb / hot,
                2.0 * (BIG * BIG * 128) as f64 / pre / 1e9
            );
        }
    }
    if has("--rows") {
        let p = if has("--accurate") { Precision::Accurate } else { Precision::Fast };
        few_rows(&pools, &only_rows(&args), p, &mut rng);
    }
    if !skip_small {
        small(&pools, &mut rng);
    }
    if !has("--no-models") {
        // `--decode-rows N`: also N tokens decoded together (a batch of sequences),
        // at the precision `--accurate` picks.
        let rows = flag("--decode-rows").map(|v| v.parse::<usize>().expect("--decode-rows N"));
        let p = if has("--accurate") { Precision::Accurate } else { Precision::Fast };
        models(&pools, &mut rng, rows.map(|n| (n, p)));
    }
}

/// The formats `--only` names, or the two of the quantized models' large matrices.
fn only_rows(args: &[String]) -> Vec<DType> {
    let i = args.iter().position(|a| a == "--only");
    i.map_or(vec![DType::Q4K, DType::Q6K], |i| args[i + 1].split(',').map(parse).collect())
}

/// A few rows against one hot matrix: GMAC/s and time per row relative to one row.
fn few_rows(pools: &[rayon::ThreadPool], dtypes: &[DType], precision: Precision, rng: &mut Rng) {
    println!("\nfew rows, 4096 x 4096 hot, {precision:?}: GMAC/s (time per row against n = 1)");
    const NS: [usize; 5] = [1, 2, 4, 8, 16];
    println!("{:<6} {:>3} | {}", "type", "thr", NS.map(|n| format!("{:>15}", format!("n={n}"))).join(" "));
    for &dtype in dtypes {
        let bytes = random_matrix(dtype, BIG, BIG, rng);
        let w = MatRef::new(dtype, BIG, BIG, &bytes).unwrap();
        let x = random_input(16, BIG, rng);
        let mut out = vec![0f32; 16 * BIG];
        for (ti, p) in pools.iter().enumerate() {
            let per_row: Vec<f64> = NS
                .iter()
                .map(|&n| {
                    let (x, out) = (&x[..n * BIG], &mut out[..n * BIG]);
                    p.install(|| time(Duration::from_millis(400), || matmul(w, x, n, out, precision))) / n as f64
                })
                .collect();
            let cells: Vec<String> = per_row
                .iter()
                .map(|t| format!("{:>7.1} ({:>4.2})", (BIG * BIG) as f64 / t / 1e9, t / per_row[0]))
                .collect();
            println!("{:<6} {:>3} | {}", dtype.name(), ti + 1, cells.join(" "));
        }
    }
}

/// Small-model shapes, decode, and the per-call overhead.
fn small(pools: &[rayon::ThreadPool], rng: &mut Rng) {
    println!("\nsmall shapes (SmolLM2-135M), decode, microseconds per call");
    println!("{:<22} {:>3} | {:>8} | {:>8}", "shape", "thr", "us/call", "GB/s");
    for (dtype, rows, cols) in [
        (DType::Q4_1, 16, 32),
        (DType::Q4_1, 576, 576),
        (DType::Q4_1, 1536, 576),
        (DType::Q4_1, 576, 1536),
        (DType::Q4K, 1536, 1536),
        (DType::Q6K, 1536, 8960),
    ] {
        let bytes = random_matrix(dtype, rows, cols, rng);
        let x = random_input(1, cols, rng);
        let mut out = vec![0f32; rows];
        let w = MatRef::new(dtype, rows, cols, &bytes).unwrap();
        for (ti, p) in pools.iter().enumerate() {
            let t = p.install(|| time(Duration::from_millis(300), || matmul(w, &x, 1, &mut out, Precision::Fast)));
            let shape = format!("{} {}x{}", dtype.name(), rows, cols);
            println!("{:<22} {:>3} | {:>8.2} | {:>8.1}", shape, ti + 1, t * 1e6, bytes.len() as f64 / t / 1e9);
        }
    }
}

/// One weight matrix of a model: format, rows (outputs), columns (inputs), how many.
type Layer = (DType, usize, usize, usize);

/// SmolLM2-135M-Instruct Q4_1 and Qwen2.5-Coder-1.5B-Instruct Q4_K_M, matrix by matrix
/// as their GGUF files store them (LM head last).
fn model_shapes() -> Vec<(&'static str, Vec<Layer>, Layer)> {
    let q41 = DType::Q4_1;
    let smol = vec![(q41, 576, 576, 60), (q41, 192, 576, 60), (q41, 1536, 576, 60), (q41, 576, 1536, 30)];
    let (q4k, q6k) = (DType::Q4K, DType::Q6K);
    let qwen = vec![
        (q4k, 1536, 1536, 56),
        (q4k, 256, 1536, 42),
        (q6k, 256, 1536, 14),
        (q4k, 8960, 1536, 56),
        (q4k, 1536, 8960, 14),
        (q6k, 1536, 8960, 14),
    ];
    vec![
        ("SmolLM2-135M Q4_1", smol, (DType::Q8_0, 49152, 576, 1)),
        ("Qwen2.5-Coder-1.5B Q4_K_M", qwen, (q6k, 151936, 1536, 1)),
    ]
}

/// Matmul time alone per decoded token and per 128-token prompt, over every weight
/// matrix of a real model (random values, real shapes and formats, each matrix in its
/// own memory so decode streams the whole model as a forward pass does). The LM head
/// runs on one token in both, as llama.cpp does for a prompt.
fn models(pools: &[rayon::ThreadPool], rng: &mut Rng, batch: Option<(usize, Precision)>) {
    println!("\nmodels, matmuls only (attention, norms etc. not included)");
    let batch_head = batch.map_or(String::new(), |(n, p)| format!(" | {:>18}", format!("{n} rows {p:?}")));
    println!("{:<27} {:>3} | {:>14} | {:>18}{batch_head}", "model", "thr", "decode tok/s", "prefill-128 tok/s");
    // `KERN_HOT`: the matrices of one shape share their bytes (cache-resident).
    let hot = std::env::var_os("KERN_HOT").is_some();
    for (name, layers, head) in model_shapes() {
        // Each matrix's shape and the index of its bytes in `bufs`.
        let mut bufs: Vec<Vec<u8>> = vec![];
        let mut mats: Vec<(DType, usize, usize, usize)> = vec![];
        for &(dtype, rows, cols, count) in layers.iter().chain(std::iter::once(&head)) {
            let one = random_matrix(dtype, rows, cols, rng);
            for k in 0..count {
                if k == 0 || !hot {
                    bufs.push(one.clone());
                }
                mats.push((dtype, rows, cols, bufs.len() - 1));
            }
        }
        let maxc = mats.iter().map(|m| m.2.max(m.1)).max().unwrap();
        let x = random_input(128, maxc, rng);
        let mut out = vec![0f32; 128 * mats.iter().map(|m| m.1).max().unwrap()];
        let last = mats.len() - 1;
        // A prompt's last layer computes one row of the head; a decode step all of them.
        let mut pass = |n: usize, head_rows: usize, precision: Precision| {
            for (i, &(dtype, rows, cols, b)) in mats.iter().enumerate() {
                let n = if i == last { head_rows } else { n };
                let w = MatRef::new(dtype, rows, cols, &bufs[b]).unwrap();
                matmul(w, &x[..n * cols], n, &mut out[..n * rows], precision);
            }
        };
        for (ti, p) in pools.iter().enumerate() {
            let dec = p.install(|| time(Duration::from_millis(1500), || pass(1, 1, Precision::Fast)));
            let pre = p.install(|| time(Duration::from_millis(3000), || pass(128, 1, Precision::Fast)));
            let many = batch.map_or(String::new(), |(n, precision)| {
                let t = p.install(|| time(Duration::from_millis(3000), || pass(n, n, precision)));
                format!(" | {:>18.1}", n as f64 / t)
            });
            println!("{:<27} {:>3} | {:>14.0} | {:>18.0}{many}", name, ti + 1, 1.0 / dec, 128.0 / pre);
        }
    }
}
