//! The CUDA backend against references: every weight format's product and embedding
//! against float64 over the dequantized weights, every tiny fixture against the
//! logits `transformers` computed (fixtures/tiny), and batches against each sequence
//! alone. On a machine without a GPU every test says so and passes without running:
//! CI has none; `scripts/gpu_check.sh` runs them on the GPU machine.

#[path = "../../sluice-cpu/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};

use common::{Rng, random_input, random_matrix};
use sluice_core::{DType, MatRef, Precision, RopeSpec, RopeStyle, RouterKind};
use sluice_cuda::Cuda;
use sluice_engine::backend::{Backend, Norm, RouterOp};
use sluice_engine::batch::{Batch, RowPrecision};
use sluice_engine::model::StepStats;
use sluice_engine::{Chunk, LoadOptions, Logits, Model, Prefetch};
use sluice_experts::{CacheBudget, Residency, StoreConfig};
use sluice_formats::Checkpoint;
use sluice_formats::synth::{Geometry, Synth, SynthOptions};

/// The GPU, or `None` (saying why) where there is none.
fn gpu() -> Option<Cuda> {
    if let Some(why) = sluice_cuda::probe() {
        eprintln!("skipping the GPU tests: {why}");
        return None;
    }
    Some(Cuda::open(0).expect("a GPU that the driver sees opens"))
}

/// Input row `x` as the integer products see it (Q4_K, Q5_K, Q6_K weights), as
/// `sluice_cpu::quant::act` quantizes it: per 32 elements `d = max|x| / 127` (16 bits:
/// `/ 32512`), codes `rint(x * (1 / d))`; each element's `code * d`.
fn quantized_row(x: &[f32], wide: bool) -> Vec<f64> {
    let (lo, hi) = if wide { (-32512.0f32, 32512.0f32) } else { (-128.0, 127.0) };
    x.chunks(32)
        .flat_map(|b| {
            let d = b.iter().fold(0f32, |m, v| m.max(v.abs())) / hi;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            b.iter().map(move |&v| (v * id).round_ties_even().clamp(lo, hi) as f64 * d as f64)
        })
        .collect()
}

/// Each format's product for 1, 3, 5, 9 and 40 input rows (each row bitwise as alone),
/// and its embedding, against float64 sums over `sluice_core::quant::dequantize_row`.
/// The K-quants' tensor-core products (rows at 8 bits, by default) and integer
/// products (`SLUICE_CUDA_PRODUCTS=int`) multiply quantized activations: against
/// those, with every row at 8 bits, at 16, and the two alternating in one product.
#[test]
fn every_format_against_dequantized_f64() {
    let Some(be) = gpu() else { return };
    let (fast, accurate) = (Precision::Fast, Precision::Accurate);
    let mut rng = Rng(11);
    for dtype in DType::ALL {
        // Plain formats also with a row length that is not a multiple of four.
        let odd = if dtype.block_elems() == 1 { &[(3, 37)][..] } else { &[] };
        for &(rows, cols) in [(67, 256), (300, 1536), (5, 4096)].iter().chain(odd) {
            let bytes = random_matrix(dtype, rows, cols, &mut rng);
            let m = MatRef::new(dtype, rows, cols, &bytes).unwrap();
            let w: Vec<Vec<f32>> = (0..rows)
                .map(|r| {
                    let mut o = vec![0f32; cols];
                    sluice_core::quant::dequantize_row(dtype, m.row(r), &mut o);
                    o
                })
                .collect();
            let dm = be.upload_mat(m).unwrap();
            let quantizes = |p| be.quantizes(dtype, p);
            let modes: &[&[Precision]] = if quantizes(fast) || quantizes(accurate) {
                &[&[fast], &[accurate], &[accurate, fast]]
            } else {
                &[&[fast]]
            };
            for (n, mode) in [1, 3, 5, 9, 40].into_iter().flat_map(|n| modes.iter().map(move |m| (n, m))) {
                let prec: Vec<Precision> = (0..n).map(|i| mode[i % mode.len()]).collect();
                let be_n = be.with_precision(RowPrecision::from_rows(prec.clone()));
                let x = random_input(n, cols, &mut rng);
                let xa = be.act_from_host(n, cols, &x).unwrap();
                let y = be.to_host(&be_n.matmul(&xa, &dm).unwrap()).unwrap();
                // The products take 1, 2, 4 or 8 rows at a time: a row's result is the
                // same whatever the rows beside it.
                let i = n / 2;
                let one = be.act_from_host(1, cols, &x[i * cols..(i + 1) * cols]).unwrap();
                let alone =
                    be.to_host(&be.with_precision(RowPrecision::All(prec[i])).matmul(&one, &dm).unwrap()).unwrap();
                assert!(
                    alone == y[i * rows..(i + 1) * rows],
                    "{dtype} {rows}x{cols}: row {i} of {n} ({mode:?}) differs from it alone"
                );
                for i in 0..n {
                    let xr = &x[i * cols..(i + 1) * cols];
                    let xr: Vec<f64> = if quantizes(prec[i]) {
                        quantized_row(xr, prec[i] == accurate)
                    } else {
                        xr.iter().map(|&v| v as f64).collect()
                    };
                    for (o, wr) in w.iter().enumerate() {
                        let want: f64 = wr.iter().zip(&xr).map(|(&a, &b)| a as f64 * b).sum();
                        let mag: f64 = wr.iter().zip(&xr).map(|(&a, &b)| (a as f64 * b).abs()).sum();
                        let got = y[i * rows + o] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * mag + 1e-30,
                            "{dtype} {rows}x{cols}, n {n} ({mode:?}), row {i} out {o}: {got} vs {want} (scale {mag})"
                        );
                    }
                }
            }
            let tokens: Vec<u32> = (0..rows as u32).rev().step_by(3).collect();
            let e = be.to_host(&be.embed(&dm, &tokens, 0.5).unwrap()).unwrap();
            for (i, &t) in tokens.iter().enumerate() {
                for (c, &want) in w[t as usize].iter().enumerate() {
                    let (got, want) = (e[i * cols + c], want * 0.5);
                    assert!(
                        (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                        "{dtype} embed {t}/{c}: {got} vs {want}"
                    );
                }
            }
        }
        eprintln!("{dtype}: products and embedding match");
    }
    // A token outside the table is an error, not a read past it.
    let bytes = random_matrix(DType::Q8_0, 4, 64, &mut rng);
    let dm = be.upload_mat(MatRef::new(DType::Q8_0, 4, 64, &bytes).unwrap()).unwrap();
    assert!(be.embed(&dm, &[4], 1.0).is_err());
}

/// Products of matrices that share an input (q, k and v) in one call give each
/// matrix the bits it has alone: formats mixed (the launch takes runs of one format),
/// shapes unequal (each matrix's blocks follow the one before), more matrices than
/// one launch takes; for decode rows (several matrices a launch) and a prompt's.
#[test]
fn products_together_give_each_ones_bits() {
    let Some(be) = gpu() else { return };
    let mut rng = Rng(12);
    let cols = 512;
    let shapes =
        [(DType::Q4K, 300), (DType::Q4K, 67), (DType::Q4K, 5), (DType::Q6K, 67), (DType::Q4K, 96), (DType::Q4K, 8)];
    let mats: Vec<_> = shapes
        .iter()
        .map(|&(dtype, rows)| {
            let bytes = random_matrix(dtype, rows, cols, &mut rng);
            be.upload_mat(MatRef::new(dtype, rows, cols, &bytes).unwrap()).unwrap()
        })
        .collect();
    let refs: Vec<_> = mats.iter().collect();
    for n in [1, 2, 3, 9] {
        let x = be.act_from_host(n, cols, &random_input(n, cols, &mut rng)).unwrap();
        let together = be.matmul_many(&x, &refs).unwrap();
        assert_eq!(together.len(), mats.len());
        for (i, (m, y)) in mats.iter().zip(&together).enumerate() {
            let alone = be.to_host(&be.matmul(&x, m).unwrap()).unwrap();
            let got = be.to_host(y).unwrap();
            assert_eq!(got.len(), n * shapes[i].1, "matrix {i}, {n} rows");
            assert!(got == alone, "matrix {i} ({:?}) of {n} rows differs from its product alone", shapes[i]);
            assert!(got.iter().any(|&v| v != 0.0), "matrix {i}, {n} rows: all zero");
        }
    }
}

/// The fixtures of the repository this test was built in, or of `SLUICE_REPO` (the
/// GPU machine runs a test binary built elsewhere, in its own copy of the tree).
fn fixtures() -> PathBuf {
    let repo = std::env::var_os("SLUICE_REPO")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."), PathBuf::from);
    repo.join("fixtures/tiny")
}

/// The tokens and `transformers`' logits of a fixture.
fn reference(dir: &Path) -> (Vec<u32>, Vec<f32>) {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let tokens = meta["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let bytes = std::fs::read(dir.join(meta["logits"].as_str().unwrap())).unwrap();
    (tokens, bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
}

/// max |a - b| / max |b|
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let max_ref = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / max_ref
}

/// Every fixture family (MoE, PLE and KV sharing, sliding windows, fused experts)
/// on the GPU: prefill and token-by-token decode within 1e-3 x max |ref| of
/// transformers; four sequences of different lengths in one step, and prompt chunks
/// beside decode rows, bitwise what each gives alone.
#[test]
fn fixtures_against_transformers() {
    let Some(be) = gpu() else { return };
    // One backend for all of them, as a server holding several models would: its VRAM
    // tier keeps each model's experts apart.
    let names = [
        "llama",
        "qwen3",
        "qwen3-moe",
        "qwen3-moe-fused",
        "gemma3",
        "gemma4-dense",
        "gemma4-moe",
        "gpt-oss",
        "deepseek-v3",
        "qwen3.5-moe",
        "qwen4-exp",
    ];
    for name in names {
        let dir = fixtures().join(name);
        let (tokens, want) = reference(&dir);
        // gpt-oss from its GGUF (llama.cpp's converter), the form people run.
        let file = if name == "gpt-oss" { dir.join("gpt-oss.gguf") } else { dir.clone() };
        let ckpt = Checkpoint::open(&file).unwrap();
        let model = Model::load(be.clone(), &ckpt).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut s = model.session().unwrap();
        let prefill = s.forward(&tokens, Logits::All).unwrap();
        let e1 = rel_err(&prefill, &want);
        let mut s = model.session().unwrap();
        let decode: Vec<f32> = tokens.iter().flat_map(|&t| s.forward(&[t], Logits::All).unwrap()).collect();
        let e2 = rel_err(&decode, &want);
        eprintln!("{name}: prefill {e1:.2e}, decode {e2:.2e}");
        assert!(e1 <= 1e-3 && e2 <= 1e-3, "{name}: prefill {e1:e}, decode {e2:e} against transformers");

        batch_is_alone(name, &model, &tokens);
    }
}

/// Sequences of 16, 7, 1 and 12 tokens cut from `tokens` (16 of them), fed in chunks
/// of 9/1/6, 7, 1 and 3/1/1/7 (prompt chunks beside decode rows, so rows of both
/// precisions in one step): each bitwise what it gives alone.
fn batch_is_alone(name: &str, model: &Model<Cuda>, tokens: &[u32]) {
    let mut rev = tokens[4..].to_vec();
    rev.reverse();
    let seqs = [tokens.to_vec(), tokens[3..10].to_vec(), tokens[5..6].to_vec(), rev];
    let sched: [&[usize]; 4] = [&[9, 1, 6], &[0, 7], &[0, 0, 1], &[3, 1, 1, 7]];
    let alone: Vec<Vec<f32>> = seqs
        .iter()
        .zip(sched)
        .map(|(seq, lens)| {
            let mut s = model.session().unwrap();
            let mut at = 0;
            let mut out = Vec::new();
            for &n in lens.iter().filter(|&&n| n > 0) {
                out.extend(s.forward(&seq[at..at + n], Logits::All).unwrap());
                at += n;
            }
            out
        })
        .collect();
    let mut states: Vec<_> = seqs.iter().map(|_| model.new_state().unwrap()).collect();
    let mut at = [0usize; 4];
    let mut got = vec![Vec::new(); 4];
    for step in 0..4 {
        let mut chunks = Vec::new();
        let mut who = Vec::new();
        for (i, state) in states.iter_mut().enumerate() {
            let n = sched[i].get(step).copied().unwrap_or(0);
            if n > 0 {
                chunks.push(Chunk { state, tokens: &seqs[i][at[i]..at[i] + n], logits: Logits::All });
                who.push(i);
                at[i] += n;
            }
        }
        for (i, r) in who.into_iter().zip(model.step(&mut chunks, &mut StepStats::default())) {
            got[i].extend(r.unwrap());
        }
    }
    for i in 0..4 {
        assert!(got[i] == alone[i], "{name}: sequence {i} in a batch differs from its run alone");
    }
}

/// Mean KL divergence of `got`'s softmax from `want`'s, and the share of rows whose
/// largest logit is the same, over rows of `vocab`.
fn kl_and_top1(got: &[f32], want: &[f32], vocab: usize) -> (f64, f64) {
    let softmax = |r: &[f32]| {
        let m = r.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let e: Vec<f64> = r.iter().map(|&v| (v as f64 - m).exp()).collect();
        let z: f64 = e.iter().sum();
        e.into_iter().map(|v| v / z).collect::<Vec<f64>>()
    };
    let argmax = |r: &[f32]| r.iter().enumerate().fold(0, |b, (i, &v)| if v > r[b] { i } else { b });
    let (mut kl, mut same, mut n) = (0.0, 0usize, 0usize);
    for (g, w) in got.chunks(vocab).zip(want.chunks(vocab)) {
        let (p, q) = (softmax(w), softmax(g));
        kl += p.iter().zip(&q).map(|(&p, &q)| if p > 0.0 { p * (p / q.max(1e-300)).ln() } else { 0.0 }).sum::<f64>();
        same += (argmax(g) == argmax(w)) as usize;
        n += 1;
    }
    (kl / n as f64, same as f64 / n as f64)
}

/// The model at `path` on the GPU against the CPU: `len` tokens, the last `decoded` of
/// them fed one at a time after the rest as one prompt. With both at
/// `Precision::Accurate`, mean KL <= 0.005 and the same top token on at least 99% of
/// rows. At the default precision the CPU takes a prompt's rows at 8 bits, whose own
/// error can pass that bound (gemma-3-270m's 8-bit rows against its 16-bit ones: mean
/// KL 2.9e-2 on an H100's CPU), so the GPU at the default precision is held to the KL
/// bound against the CPU run that quantizes as it does: the CPU at Accurate for the
/// float products (their inputs are not quantized at any precision), the CPU at the
/// default for `SLUICE_CUDA_PRODUCTS=int` (K-quant models: their inputs quantized as the
/// CPU's are). Returns the GPU's model.
fn gpu_against_cpu(what: &str, be: &Cuda, path: &Path, len: u32, decoded: usize) -> Model<Cuda> {
    let ckpt = Checkpoint::open(path).unwrap();
    let vocab = ckpt.spec.vocab_size;
    let tokens: Vec<u32> = (0..len).map(|i| (i * 37 + 11) % vocab as u32).collect();
    let prompt = tokens.len() - decoded;
    let go = |s: &mut dyn FnMut(&[u32]) -> Vec<f32>| {
        let mut out = s(&tokens[..prompt]);
        for &t in &tokens[prompt..] {
            out.extend(s(&[t]));
        }
        out
    };
    fn feed<B: Backend>(model: &Model<B>) -> impl FnMut(&[u32]) -> Vec<f32> + '_ {
        let mut s = model.session().unwrap();
        move |t| s.forward(t, Logits::All).unwrap()
    }
    let mut gpu_model = Model::load(be.clone(), &ckpt).unwrap();
    let mut cpu_model = Model::load(sluice_engine::backend::Cpu::default(), &ckpt).unwrap();
    let mut cpu = |precision| {
        cpu_model.precision = precision;
        go(&mut feed(&cpu_model))
    };
    let (cpu_accurate, cpu_default) = (cpu(Some(Precision::Accurate)), cpu(None));
    let (kl, _) = kl_and_top1(&cpu_default, &cpu_accurate, vocab);
    eprintln!("{what}: the CPU's default precision against its Accurate one, mean KL {kl:.2e}");
    let quantizes = be.quantizes(DType::Q4K, Precision::Fast);
    for precision in [Some(Precision::Accurate), None] {
        gpu_model.precision = precision;
        let g = go(&mut feed(&gpu_model));
        let c = if precision.is_none() && quantizes { &cpu_default } else { &cpu_accurate };
        let (kl, top1) = kl_and_top1(&g, c, vocab);
        let what = format!("{what}, GPU at precision {precision:?}");
        eprintln!(
            "{what}: against the CPU, mean KL {kl:.2e}, top-1 {:.1}%, {:.2e} of the largest",
            100.0 * top1,
            rel_err(&g, c)
        );
        assert!(kl <= 0.005, "{what}: mean KL {kl} against the CPU");
        if precision.is_some() {
            assert!(top1 >= 0.99, "{what}: top-1 {top1} against the CPU");
        }
    }
    gpu_model
}

/// The real models (scripts/fetch_models.sh) on the GPU against the CPU, as
/// `gpu_against_cpu` compares them: the files `SLUICE_GPU_MODELS` names (comma-
/// separated, in $SLUICE_MODELS), each of which must be there. They travel to the GPU
/// machine in parts (scripts/gpu_check.sh); where the variable is unset the test says
/// so and compares nothing.
#[test]
fn real_models_against_the_cpu() {
    let Some(be) = gpu() else { return };
    let Ok(names) = std::env::var("SLUICE_GPU_MODELS") else {
        eprintln!("no real models: SLUICE_GPU_MODELS is unset (scripts/gpu_check.sh sets it for those it carried)");
        return;
    };
    let dir = PathBuf::from(std::env::var_os("SLUICE_MODELS").expect("SLUICE_MODELS, where the models are"));
    for name in names.split(',').filter(|n| !n.is_empty()) {
        let path = dir.join(name);
        assert!(path.is_file(), "{} is not there", path.display());
        let model = gpu_against_cpu(name, &be, &path, 72, 8);
        batch_is_alone(name, &model, &(1..17).map(|i| i * 101 % 5000).collect::<Vec<u32>>());
    }
}

/// Quantized MoE checkpoints (`sluice synth`: Q4_K or Q5_K matrices, the expert down
/// products in Q5_0 or Q5_1 where their rows are not whole super-blocks, a Q6_K output)
/// on the GPU against the CPU on the same file, a 192-token prompt and 8 decoded
/// tokens: mean KL <= 0.005 and the same top token on at least 99% of rows with both
/// at `Precision::Accurate`; and batches of prompt chunks beside decode rows bitwise
/// what each sequence gives alone. At the default precision, as `gpu_against_cpu` says
/// (on tiny-gemma4 the CPU's 8-bit prompt rows against its 16-bit ones: mean KL 7.4e-4,
/// top-1 96.4%).
#[test]
fn quantized_moe_against_the_cpu() {
    let Some(be) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("sluice-gpu-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (geometry, quant) in [("tiny-moe", DType::Q4K), ("tiny-gemma4", DType::Q4K), ("tiny-moe", DType::Q5K)] {
        let opts = SynthOptions {
            geometry: Geometry::named(geometry).unwrap(),
            quant,
            skew: 0.9,
            seed: 5,
            tuning: Default::default(),
        };
        let path = dir.join(format!("{geometry}-{quant}.gguf"));
        Synth::new(opts).unwrap().write_gguf(&path, &|_| {}).unwrap();
        let gpu_model = gpu_against_cpu(&format!("{geometry} {quant}"), &be, &path, 200, 8);
        batch_is_alone(&format!("{geometry} {quant}"), &gpu_model, &(0..16).collect::<Vec<u32>>());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The real MoE geometries sluice synthesizes (`sluice synth --geometry`), each cut to
/// its first layers so that a file is a few GB, and its default formats (Q4_K
/// matrices, gpt-oss's experts in MXFP4, a Q6_K output): the GPU against the CPU on the
/// same file as `gpu_against_cpu` compares them (192 prompt tokens and 8 decoded), and a
/// batch bitwise its sequences alone (DeepSeek-V3's latent attention heads are 576
/// dimensions wide, the widest the attention kernels take). Tens of GB are written
/// and read in all, so it runs when
/// `SLUICE_GPU_GEOMETRIES` names the geometries (`all`, or a comma-separated list of
/// names); unset, it says so and compares nothing.
#[test]
fn every_moe_geometry_against_the_cpu() {
    let Some(be) = gpu() else { return };
    let Ok(wanted) = std::env::var("SLUICE_GPU_GEOMETRIES") else {
        eprintln!("no geometries: SLUICE_GPU_GEOMETRIES is unset (`all`, or names; scripts/gpu_check.sh)");
        return;
    };
    // Layers kept: enough for each kind of layer the geometry has (Gemma 4's sliding
    // and full attention, gpt-oss's alternating windows, DeepSeek's dense layers then a
    // MoE one, Qwen3.5's DeltaNet layers then a full-attention one).
    let cuts = [
        ("qwen3-30b-a3b", 8),
        ("qwen3-235b-a22b", 2),
        ("gemma4-26b-a4b", 6),
        ("gpt-oss-120b", 2),
        ("deepseek-v3", 4),
        ("qwen3.5-397b-a17b", 4),
    ];
    let names: Vec<&str> = wanted.split(',').map(str::trim).filter(|n| !n.is_empty()).collect();
    for n in &names {
        assert!(*n == "all" || cuts.iter().any(|(g, _)| g == n), "SLUICE_GPU_GEOMETRIES: no geometry {n}");
    }
    let dir = std::env::temp_dir().join(format!("sluice-gpu-geometries-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, layers) in cuts.into_iter().filter(|(g, _)| names.contains(&"all") || names.contains(g)) {
        let geometry = Geometry::named(name).unwrap().with_layers(layers).unwrap();
        let opts = SynthOptions { geometry, quant: DType::Q4K, skew: 0.9, seed: 7, tuning: Default::default() };
        let path = dir.join(format!("{name}-{layers}.gguf"));
        let from = std::time::Instant::now();
        Synth::new(opts).unwrap().write_gguf(&path, &|_| {}).unwrap();
        let size = std::fs::metadata(&path).unwrap().len();
        eprintln!(
            "{name}, {layers} layers: {:.2} GB written in {:.1} s",
            size as f64 / 1e9,
            from.elapsed().as_secs_f64()
        );
        let what = format!("{name} ({layers} layers)");
        let gpu_model = gpu_against_cpu(&what, &be, &path, 200, 8);
        batch_is_alone(&what, &gpu_model, &(0..16).map(|i| i * 7 + 3).collect::<Vec<u32>>());
        drop(gpu_model);
        let _ = std::fs::remove_file(&path);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--gpu-memory` past what the card has free is one clear error before any work, naming
/// the size; within it, accepted.
#[test]
fn a_memory_limit_past_the_card_is_refused() {
    let Some(be) = gpu() else { return };
    let (free, total) = be.memory().unwrap();
    let err = be.clone().with_memory_limit(total + (1 << 30)).err().expect("a limit past the card is refused");
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(matches!(err, sluice_core::Error::Usage(_)) && msg.contains("--gpu-memory"), "{msg}");
    assert!(be.with_memory_limit(free / 2).is_ok(), "half of the free memory refused");
}

/// The VRAM expert tier changes where experts come from, never the logits: the MoE
/// fixtures with no tier (every expert copied at every use), a tier of a quarter of
/// the experts (evicting) and an unbounded one give bitwise the same, with the rest
/// mapped, resident (page-locked: misses copied on the copy stream beside the held
/// experts' products; with the pilot copying ahead too) or streamed from disk (with
/// and without the pilot). gpt-oss's expert biases take the misses before the products.
#[test]
fn vram_tier_sizes_agree_bitwise() {
    let Some(be) = gpu() else { return };
    for name in ["qwen3-moe", "gemma4-moe", "gpt-oss"] {
        let dir = fixtures().join(name);
        let (tokens, _) = reference(&dir);
        let ckpt = Checkpoint::open(&dir).unwrap();
        // The store's experts mapped, or in its host memory (resident), page-locked
        // for the device's copies.
        // The logits of a 9-token prompt and the rest decoded one at a time.
        let logits_of = |be: Cuda, opts: &LoadOptions| {
            let model = Model::load_with(be, &ckpt, opts, None).unwrap();
            if opts.store.residency == Residency::Resident {
                let locked = model.store.counters.locked_bytes.load(std::sync::atomic::Ordering::Relaxed);
                assert!(locked > 0, "{name}: a resident store's experts were not page-locked");
            }
            let mut s = model.session().unwrap();
            let mut out = s.forward(&tokens[..9], Logits::All).unwrap();
            for &t in &tokens[9..] {
                out.extend(s.forward(&[t], Logits::All).unwrap());
            }
            out
        };
        let run_with = |be: Cuda, residency: Residency| {
            logits_of(be, &LoadOptions { store: StoreConfig { residency, ..Default::default() }, ..Default::default() })
        };
        let run = |be: Cuda| run_with(be, Residency::Mapped);
        // Room for all: every expert copied at load, each layer served whole without
        // the routing coming back to the host.
        let big = be.with_expert_budget(usize::MAX);
        let unbounded = run(big.clone());
        let t = big.expert_traffic().unwrap();
        assert!(t.whole_layers > 0 && t.host_fills == 0, "{name}: an unbounded tier did not hold whole layers: {t:?}");
        let none = run(be.with_expert_budget(0));
        let moe: Vec<_> =
            ckpt.spec.layers.iter().enumerate().filter_map(|(l, s)| s.moe.as_ref().map(|m| (l, m))).collect();
        let expert = ckpt.experts(moe[0].0, moe[0].1, ckpt.spec.hidden_size).unwrap()[0].bytes();
        let all: usize = moe.iter().map(|(_, m)| m.n_experts).sum();
        let small = be.with_expert_budget(all / 4 * expert);
        let quarter = run(small.clone());
        assert!(none == unbounded, "{name}: no VRAM tier differs from an unbounded one");
        assert!(quarter == unbounded, "{name}: a VRAM tier of a quarter of the experts differs from an unbounded one");
        // A quarter in VRAM, the rest page-locked in host memory (what `--residency
        // auto` chooses where the tier cannot hold them all).
        // Their misses are copied on the copy stream while the held experts compute
        // (gpt-oss's expert biases: all of a layer's experts after the copies).
        let lk = be.with_expert_budget(all / 4 * expert);
        let locked = run_with(lk.clone(), Residency::Resident);
        assert!(locked == unbounded, "{name}: a quarter in VRAM, the rest page-locked, differs from an unbounded tier");
        let t = lk.expert_traffic().unwrap();
        // (gpt-oss's four experts a layer, one a layer held: each layer's evicted by the
        // next, so no hits.)
        let few = moe[0].1.n_experts < 8;
        assert!(t.host_fills > 0 && (t.vram_hits > 0 || few), "{name}: page-locked: no misses beside hits: {t:?}");
        // The same with the pilot copying its picks for the next layer into the tier
        // on the copy stream, beside the computation.
        let ahead = be.with_expert_budget(all / 4 * expert);
        let opts = LoadOptions {
            store: StoreConfig { residency: Residency::Resident, ..Default::default() },
            prefetch: Prefetch::Pilot,
            ..Default::default()
        };
        let piloted = logits_of(ahead.clone(), &opts);
        let t = ahead.expert_traffic().unwrap();
        eprintln!("{name}, a quarter in VRAM, copies ahead: {t:?}");
        assert!(t.prefetched > 0, "{name}: the pilot copied nothing ahead: {t:?}");
        assert!(piloted == unbounded, "{name}: a quarter in VRAM with copies ahead differs from an unbounded tier");
        // A quarter in VRAM, the rest streamed from disk through a cache of top-k
        // slots a layer, with and without the pilot reading the next layer's picks
        // ahead.
        let top_k = moe[0].1.top_k;
        for prefetch in [Prefetch::Off, Prefetch::Pilot] {
            let store = StoreConfig {
                residency: Residency::Streamed,
                budget: Some(CacheBudget::SlotsPerLayer(top_k)),
                ..Default::default()
            };
            let opts = LoadOptions { store, prefetch, ..Default::default() };
            let streamed = logits_of(be.with_expert_budget(all / 4 * expert), &opts);
            assert!(
                streamed == unbounded,
                "{name}: a quarter in VRAM, the rest streamed (prefetch {prefetch:?}), differs from an unbounded tier"
            );
        }
        let t = small.expert_traffic().unwrap();
        eprintln!("{name}, a quarter of the experts in VRAM: {t:?}");
        assert!((t.vram_hits > 0 || few) && t.evictions > 0, "{name}: the tier was neither hit nor full: {t:?}");
    }
}

/// The device's router against the CPU's for every kind it runs (softmax then top-k,
/// with and without renormalising, Gemma 4's scaled form, top-k then softmax), with
/// and without a logit bias, 8 to 256 experts, top-1 to top-8: the same experts in the same
/// order, weights within 1e-5 (the GPU's expf); tied logits go to the lower expert.
#[test]
fn routing_on_the_device_chooses_as_the_cpu() {
    let Some(be) = gpu() else { return };
    let mut rng = Rng(5);
    let kinds = [
        RouterKind::Softmax { normalize_top_k: false },
        RouterKind::Softmax { normalize_top_k: true },
        RouterKind::Gemma4,
        RouterKind::TopKSoftmax,
    ];
    for kind in kinds {
        for (e, k) in [(8, 2), (64, 1), (128, 8), (256, 8)] {
            let rows = 37;
            let mut logits = random_input(rows, e, &mut rng);
            // Row 0: every logit tied (and no bias to part them, for half the shapes).
            logits[..e].fill(0.25);
            let bias = if e < 100 { vec![0.0; e] } else { random_input(1, e, &mut rng) };
            let scale: Vec<f32> = random_input(1, e, &mut rng).iter().map(|v| 1.0 + v.abs()).collect();
            let scaled = matches!(kind, RouterKind::Gemma4);
            let op = RouterOp {
                kind,
                n_experts: e,
                top_k: k,
                logit_bias: Some(be.vector_from_host(&bias).unwrap()),
                choice_bias: None,
                expert_scale: scaled.then(|| be.vector_from_host(&scale).unwrap()),
            };
            let r = be.route(&be.act_from_host(rows, e, &logits).unwrap(), &op).unwrap();
            let ids = be.routing_ids(&r).unwrap();
            let weights = be.routing_weights(&r).unwrap();
            let p = sluice_cpu::router::RouteParams {
                kind,
                n_experts: e,
                top_k: k,
                logit_bias: Some(&bias),
                choice_bias: None,
                expert_scale: scaled.then_some(scale.as_slice()),
            };
            let (mut want_ids, mut want_w) = (Vec::new(), Vec::new());
            sluice_cpu::router::route(&logits, &p, &mut want_ids, &mut want_w);
            assert_eq!(ids, want_ids, "{kind:?}, {e} experts, top-{k}: experts");
            for (i, (a, b)) in weights.iter().zip(&want_w).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1e-3),
                    "{kind:?}, {e} experts, top-{k}, slot {i}: {a} vs {b}"
                );
            }
        }
    }
}

/// The fused forms of the norms (`normed`, `add_normed`, `norm_rope`) give the bits of
/// their parts launched one by one: whole rows and heads, both RoPE styles, a partial
/// rotation (trailing zero frequencies) and YaRN's factor, at decode and prompt
/// positions.
#[test]
fn fused_norms_give_their_parts_bits() {
    let Some(be) = gpu() else { return };
    let mut rng = Rng(11);
    let host = |a: &sluice_cuda::DevAct| be.to_host(a).unwrap();
    for (rows, heads, hd, style, nope, factor) in [
        (1, 32, 128, RopeStyle::Half, 0, 1.0f32),
        (5, 4, 128, RopeStyle::Half, 0, 1.0),
        (7, 8, 64, RopeStyle::Interleaved, 0, 1.0),
        (3, 2, 256, RopeStyle::Half, 32, 1.2),
    ] {
        let cols = heads * hd;
        let what = format!("{rows} rows of {heads} heads of {hd}, {style:?}");
        let x = random_input(rows, cols, &mut rng);
        let y = random_input(rows, cols, &mut rng);
        let weight: Vec<f32> = random_input(1, cols, &mut rng);
        let w = be.vector_from_host(&weight[..hd]).unwrap();
        let row_w = be.vector_from_host(&weight).unwrap();
        let norm = |group, weight| Norm { group, weight, offset: 1.0, eps: 1e-6 };
        let mut inv_freq: Vec<f32> = (0..hd / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / hd as f32)).collect();
        let n = inv_freq.len();
        inv_freq[n - nope..].fill(0.0);
        let rope = RopeSpec { style, inv_freq, attention_factor: factor };
        // A decode row at position 41 and a prompt's rows from position 300.
        let seqs = [(41, 1, Precision::Accurate), (300, rows - 1, Precision::Fast)];
        let batch = Batch::new(if rows > 1 { &seqs } else { &seqs[..1] });

        let act = |v: &[f32]| be.act_from_host(rows, cols, v).unwrap();
        let (mut parts, mut fused) = (act(&x), act(&x));
        be.rms_norm(&mut parts, &norm(hd, Some(&w))).unwrap();
        be.rope(&mut parts, hd, &batch, &rope).unwrap();
        be.norm_rope(&mut fused, &norm(hd, Some(&w)), &batch, &rope).unwrap();
        assert_eq!(host(&fused), host(&parts), "norm_rope, {what}");
        let changed = host(&fused).iter().zip(&x).filter(|(a, b)| a != b).count();
        assert!(changed > cols * rows / 2, "norm_rope changed {changed} of {} elements, {what}", rows * cols);

        // Queries and keys (a quarter of the heads, their own weight) in one launch:
        // each the bits of its own norm_rope.
        let (kheads, kw) = ((heads / 4).max(1), be.vector_from_host(&weight[cols - hd..]).unwrap());
        let keys = random_input(rows, kheads * hd, &mut rng);
        let (mut q, mut k) = (act(&x), be.act_from_host(rows, kheads * hd, &keys).unwrap());
        be.norm_rope_qk(&mut q, &norm(hd, Some(&w)), &mut k, &norm(hd, Some(&kw)), &batch, &rope).unwrap();
        let mut k_alone = be.act_from_host(rows, kheads * hd, &keys).unwrap();
        be.norm_rope(&mut k_alone, &norm(hd, Some(&kw)), &batch, &rope).unwrap();
        assert_eq!(host(&q), host(&fused), "norm_rope_qk's queries, {what}");
        assert_eq!(host(&k), host(&k_alone), "norm_rope_qk's keys, {what}");
        assert_ne!(host(&k), keys, "norm_rope_qk left the keys, {what}");

        let mut parts = act(&x);
        be.rms_norm(&mut parts, &norm(cols, Some(&row_w))).unwrap();
        let src = act(&x);
        let fused = be.normed(&src, &norm(cols, Some(&row_w))).unwrap();
        assert_eq!(host(&fused), host(&parts), "normed, {what}");
        assert_eq!(host(&src), x, "normed left its input, {what}");

        let (mut sum, mut fused_sum) = (act(&x), act(&x));
        be.add(&mut sum, &act(&y)).unwrap();
        let mut parts = be.copy(&sum).unwrap();
        be.rms_norm(&mut parts, &norm(cols, None)).unwrap();
        let fused = be.add_normed(&mut fused_sum, &act(&y), &norm(cols, None)).unwrap();
        assert_eq!(host(&fused_sum), host(&sum), "add_normed's sum, {what}");
        assert_eq!(host(&fused), host(&parts), "add_normed, {what}");
    }
}

/// Sequences long enough that attention splits a row's positions over several
/// blocks (runs of 64): 200 tokens of prompt and 40 decoded, on the GPU against the
/// CPU backend on the same fixture (f32 weights: both compute in f32).
#[test]
fn long_sequences_against_the_cpu() {
    let Some(be) = gpu() else { return };
    // gpt-oss: its sinks join the split softmax in the merge; Qwen4-Exp: each row's chosen
    // positions (QSA) split like any others.
    let names = [
        "qwen3",
        "qwen3-moe",
        "gemma4-moe",
        "gpt-oss/gpt-oss.gguf",
        "deepseek-v3/deepseek-v3.gguf",
        "qwen3.5-moe/qwen3.5-moe.gguf",
        "qwen4-exp",
    ];
    for name in names {
        let ckpt = Checkpoint::open(&fixtures().join(name)).unwrap();
        let tokens: Vec<u32> = (0..240u32).map(|i| (i * 37 + 11) % 512).collect();
        let run = |gpu: Option<&Cuda>| -> Vec<f32> {
            fn go<B: Backend>(model: Model<B>, tokens: &[u32]) -> Vec<f32> {
                let mut s = model.session().unwrap();
                let mut out = s.forward(&tokens[..200], Logits::Last).unwrap();
                for &t in &tokens[200..] {
                    out.extend(s.forward(&[t], Logits::Last).unwrap());
                }
                out
            }
            match gpu {
                Some(be) => go(Model::load(be.clone(), &ckpt).unwrap(), &tokens),
                // The CUDA backend keeps f32 caches; the CPU is compared at the same width.
                None => {
                    let opts =
                        sluice_engine::LoadOptions { kv: Some(sluice_core::KvFormat::F32), ..Default::default() };
                    go(Model::load_with(sluice_engine::backend::Cpu::default(), &ckpt, &opts, None).unwrap(), &tokens)
                }
            }
        };
        let (g, c) = (run(Some(&be)), run(None));
        let e = rel_err(&g, &c);
        eprintln!("{name}: 240 tokens, GPU against CPU {e:.2e}");
        assert!(e <= 1e-3, "{name}: 240 tokens on the GPU differ from the CPU by {e:e} of the largest logit");
    }
}

/// A prompt fed in two chunks gives the last row's bits of the prompt fed at once: the
/// second chunk's rows read the first chunk's keys from the cache rather than from the
/// step, and fall in other tiles of a prompt's attention (`attention_tile`) and of the
/// products, none of which may change a row's sums. gpt-oss: sinks and windowed layers
/// beside full ones.
#[test]
fn a_prompt_in_chunks_gives_the_bits_of_it_at_once() {
    let Some(be) = gpu() else { return };
    for name in ["qwen3", "qwen3-moe", "gpt-oss/gpt-oss.gguf"] {
        let model = Model::load(be.clone(), &Checkpoint::open(&fixtures().join(name)).unwrap()).unwrap();
        let tokens: Vec<u32> = (0..200u32).map(|i| (i * 37 + 11) % 512).collect();
        let whole = model.session().unwrap().forward(&tokens, Logits::Last).unwrap();
        for cut in [77, 128, 190] {
            let mut s = model.session().unwrap();
            s.forward(&tokens[..cut], Logits::Last).unwrap();
            let chunked = s.forward(&tokens[cut..], Logits::Last).unwrap();
            eprintln!("{name}: chunks of {cut} and {}: {:.2e} of the largest", 200 - cut, rel_err(&chunked, &whole));
            assert!(
                chunked == whole,
                "{name}: the prompt in chunks of {cut} and {} differs from it at once",
                200 - cut
            );
        }
    }
}

/// A state's first positions copied on the device (`Backend::kv_prefix`, what the
/// server starts a prompt from when it shares a beginning with a kept sequence) continue
/// as a state fed only that far; a ring that has gone past them gives none.
#[test]
fn a_states_prefix_continues_as_one_fed_that_far() {
    let Some(be) = gpu() else { return };
    for (name, ring) in [("qwen3-moe", false), ("gemma4-dense", true)] {
        let dir = fixtures().join(name);
        let (t, _) = reference(&dir);
        let model = Model::load(be.clone(), &Checkpoint::open(&dir).unwrap()).unwrap();
        let feed = |state: &mut sluice_engine::SeqState<Cuda>, tokens: &[u32]| {
            let mut chunks = [Chunk { state, tokens, logits: Logits::All }];
            model.step(&mut chunks, &mut StepStats::default()).pop().unwrap().unwrap()
        };
        let fed_that_far = |keep: usize| {
            let mut s = model.new_state().unwrap();
            feed(&mut s, &t[..keep]);
            s
        };
        for (held, keep) in [(13, 9), (13, 13), (3, 2)] {
            match fed_that_far(held).prefix(&model.be, keep).unwrap() {
                Some(mut p) => {
                    let want = feed(&mut fed_that_far(keep), &t[keep..]);
                    let e = rel_err(&feed(&mut p, &t[keep..]), &want);
                    eprintln!("{name}: prefix {keep} of {held} against fed that far {e:.2e}");
                    assert!(e <= 1e-5, "{name}: prefix {keep} of {held} differs by {e:e}");
                }
                None => assert!(ring && keep < held, "{name}: no prefix {keep} of {held}"),
            }
        }
    }
}

/// `sluice plan --backend cuda`'s measurement: the device's copies at plausible rates
/// for a GPU on PCIe (within the device above 100 GB/s, from page-locked memory at
/// least pageable's and above 1 GB/s), every product shape and attention geometry of
/// a fixture timed on the device, and the device's split of its memory.
#[test]
fn the_plan_measures_the_device() {
    use sluice_engine::plan::{self, Machine, MeasureOn, Precisions, Profile};
    let Some(be) = gpu() else { return };
    let ckpt = Checkpoint::open(&fixtures().join("qwen3-moe")).unwrap();
    let layout = sluice_experts::ExpertLayout::from_checkpoint(&ckpt).unwrap();
    let profile = Profile::of(&ckpt, &layout);
    let kv = sluice_engine::default_kv_format(&be, &ckpt);
    let on = MeasureOn { ckpt: &ckpt, profile: &profile, precision: Precisions::of(None), kv, disk: None };
    let m = Machine::measure(&be, &on).unwrap();
    let d = m.device.as_ref().expect("a device backend measures its device");
    eprintln!(
        "{}: within {:.0} GB/s, page-locked {:.1} GB/s, pageable {:.1} GB/s; a small op {:.1} us",
        d.name,
        d.copy_bytes_per_s / 1e9,
        d.locked_bytes_per_s / 1e9,
        d.pageable_bytes_per_s / 1e9,
        m.small_op_s * 1e6
    );
    assert!(d.copy_bytes_per_s > 100e9 && d.locked_bytes_per_s > 1e9, "{d:?}");
    assert!(d.locked_bytes_per_s >= 0.8 * d.pageable_bytes_per_s, "{d:?}");
    let positive = |s: f64| s > 0.0 && s < 1.0;
    assert!(m.products.iter().all(|t| positive(t.decode_s) && positive(t.prefill_s)), "{:?}", m.products);
    assert!(m.attention.iter().all(|t| positive(t.decode_s) && positive(t.prefill_s)), "{:?}", m.attention);
    assert!(m.experts.is_some_and(|e| positive(e.decode_s) && positive(e.prefill_s)), "{:?}", m.experts);
    let req = plan::Request { available: Some(1 << 40), ..Default::default() };
    let at = plan::place(&ckpt, &layout, &req).unwrap();
    let kv_bytes = plan::kv_bytes(&be, &profile, kv, plan::DEVICE_CONTEXT).unwrap();
    let split = at.on_device(&profile, be.expert_room().unwrap().unwrap(), kv_bytes).unwrap();
    assert_eq!(split.tier_bytes, at.expert_bytes, "a fixture's experts all fit");
}
