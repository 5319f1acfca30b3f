//! Batching is invisible to the arithmetic. Several sequences of different lengths run
//! as one step give, each of them, bitwise the logits it gives alone, on every tiny
//! fixture (MoE, per-layer embeddings, KV sharing, sliding windows shorter than the
//! sequences), in every expert residency, with and without the pilot, for whole
//! prompts, token-by-token decode, and steps that mix prompt chunks with decode rows.
//! Quantized checkpoints check it with each row at its own activation precision (a
//! one-token chunk is accurate, a longer one fast). A `Model` serves several threads
//! at once; a sequence whose input is bad, or whose experts cannot be read, ends with
//! an error while the others in its step go on.

use std::path::{Path, PathBuf};

use sluice_core::{DType, Error};
use sluice_engine::{Chunk, Cpu, LoadOptions, Logits, Model, Prefetch, SeqState, StepStats};
use sluice_experts::{CacheBudget, ExpertLayout, Residency, StoreConfig};
use sluice_formats::Checkpoint;
use sluice_formats::synth::{Geometry, Synth, SynthOptions};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny").join(name)
}

fn scratch(tag: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("batch-{tag}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn fixture_tokens(dir: &Path) -> Vec<u32> {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    meta["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

/// Four sequences of lengths 16, 7, 1 and 12 cut from `t` (16 tokens).
fn sequences(t: &[u32]) -> Vec<Vec<u32>> {
    let mut rev: Vec<u32> = t[4..].to_vec();
    rev.reverse();
    vec![t.to_vec(), t[3..10].to_vec(), t[5..6].to_vec(), rev]
}

/// Per sequence, the chunk lengths it feeds at steps 0, 1, 2, ... (0: not in that step).
type Schedule = Vec<Vec<usize>>;

/// Every sequence whole, in one step.
fn whole(seqs: &[Vec<u32>]) -> Schedule {
    seqs.iter().map(|s| vec![s.len()]).collect()
}

/// One token per step, shorter sequences dropping out.
fn one_by_one(seqs: &[Vec<u32>]) -> Schedule {
    seqs.iter().map(|s| vec![1; s.len()]).collect()
}

/// Prompt chunks and decode rows in the same steps, sequences joining late.
fn mixed(seqs: &[Vec<u32>]) -> Schedule {
    let lens: Vec<usize> = seqs.iter().map(Vec::len).collect();
    assert_eq!(lens, [16, 7, 1, 12]);
    vec![vec![9, 1, 6], vec![0, 7], vec![0, 0, 1], vec![3, 1, 1, 7]]
}

/// Each sequence alone, chunked as the schedule says: the reference.
fn alone(model: &Model, seqs: &[Vec<u32>], sched: &Schedule, logits: Logits) -> Vec<Vec<f32>> {
    seqs.iter()
        .zip(sched)
        .map(|(seq, lens)| {
            let mut s = model.session().unwrap();
            let mut at = 0;
            let mut out = Vec::new();
            for &n in lens.iter().filter(|&&n| n > 0) {
                out.extend(s.forward(&seq[at..at + n], logits).unwrap());
                at += n;
            }
            out
        })
        .collect()
}

/// The sequences together, step by step as the schedule says.
fn together(model: &Model, seqs: &[Vec<u32>], sched: &Schedule, logits: Logits) -> Vec<Vec<f32>> {
    let mut states: Vec<_> = seqs.iter().map(|_| model.new_state().unwrap()).collect();
    let mut at = vec![0usize; seqs.len()];
    let mut out = vec![Vec::new(); seqs.len()];
    let steps = sched.iter().map(Vec::len).max().unwrap();
    let mut stats = StepStats::default();
    for step in 0..steps {
        let mut chunks = Vec::new();
        let mut who = Vec::new();
        for (i, state) in states.iter_mut().enumerate() {
            let n = sched[i].get(step).copied().unwrap_or(0);
            if n > 0 {
                chunks.push(Chunk { state, tokens: &seqs[i][at[i]..at[i] + n], logits });
                who.push(i);
                at[i] += n;
            }
        }
        for (i, r) in who.into_iter().zip(model.step(&mut chunks, &mut stats)) {
            out[i].extend(r.unwrap());
        }
    }
    out
}

fn check_model(what: &str, model: &Model, seqs: &[Vec<u32>]) {
    // The last rows only, too: the output projection then takes rows gathered from the
    // step's, each at its own precision.
    let runs = [
        ("whole", whole(seqs), Logits::All),
        ("one by one", one_by_one(seqs), Logits::All),
        ("mixed", mixed(seqs), Logits::All),
        ("mixed, last rows", mixed(seqs), Logits::Last),
    ];
    for (name, sched, logits) in runs {
        let want = alone(model, seqs, &sched, logits);
        let got = together(model, seqs, &sched, logits);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), w.len(), "{what}, {name}: sequence {i} has the wrong number of rows");
            assert!(g == w, "{what}, {name}: sequence {i} differs from its run alone");
        }
    }
}

/// The residencies worth trying for a checkpoint, with and without the pilot.
fn configs(ckpt: &Checkpoint) -> Vec<(StoreConfig, Prefetch)> {
    let mut stores = vec![StoreConfig::default()];
    if ckpt.spec.is_moe() {
        let min = ExpertLayout::from_checkpoint(ckpt).unwrap().min_slots_per_layer();
        stores.push(StoreConfig { residency: Residency::Resident, ..Default::default() });
        for slots in [min, min + 2] {
            stores.push(StoreConfig {
                residency: Residency::Streamed,
                budget: Some(CacheBudget::SlotsPerLayer(slots)),
                ..Default::default()
            });
        }
    }
    let prefetch: &[Prefetch] = if ckpt.spec.is_moe() { &[Prefetch::Off, Prefetch::Pilot] } else { &[Prefetch::Off] };
    stores.into_iter().flat_map(|s| prefetch.iter().map(move |&p| (s.clone(), p))).collect()
}

fn check_checkpoint(what: &str, ckpt: &Checkpoint, seqs: &[Vec<u32>]) {
    for (store, prefetch) in configs(ckpt) {
        let desc = format!("{what} {:?} {:?} {prefetch:?}", store.residency, store.budget);
        let opts = LoadOptions { store, prefetch, precision: None, kv: None };
        let model = Model::load_with(Cpu::default(), ckpt, &opts, None).unwrap();
        check_model(&desc, &model, seqs);
    }
}

fn check_fixture(name: &str) {
    let dir = fixture(name);
    let ckpt = Checkpoint::open(&dir).unwrap();
    check_checkpoint(name, &ckpt, &sequences(&fixture_tokens(&dir)));
}

#[test]
fn gemma4_moe() {
    check_fixture("gemma4-moe");
}

#[test]
fn gemma4_dense_ple_and_kv_sharing() {
    check_fixture("gemma4-dense");
}

#[test]
fn gemma3_sliding_window() {
    check_fixture("gemma3");
}

#[test]
fn qwen3_moe() {
    check_fixture("qwen3-moe");
}

#[test]
fn qwen3_moe_fused() {
    check_fixture("qwen3-moe-fused");
}

#[test]
fn qwen3() {
    check_fixture("qwen3");
}

#[test]
fn llama() {
    check_fixture("llama");
}

/// Recurrent states per sequence (each sequence's own convolution tail and matrices)
/// beside a KV layer, in every residency.
#[test]
fn qwen35_moe() {
    check_fixture("qwen3.5-moe");
}

/// The latent cache, the dense layer and the shared experts, in every residency.
#[test]
fn deepseek_v3() {
    check_fixture("deepseek-v3");
}

/// Sinks with a window shorter than the sequences, through every residency (the GGUF
/// form streams; see identity.rs for the folder).
#[test]
fn gpt_oss() {
    let dir = fixture("gpt-oss");
    let ckpt = Checkpoint::open(&dir.join("gpt-oss.gguf")).unwrap();
    check_checkpoint("gpt-oss", &ckpt, &sequences(&fixture_tokens(&dir)));
}

/// A synthetic MoE checkpoint in Q4_K (the default), its matrices computed on 8- and
/// 16-bit activations side by side in the same steps.
fn synth_q4k(dir: &Path, geometry: &str) -> PathBuf {
    let opts = SynthOptions {
        geometry: Geometry::named(geometry).unwrap(),
        quant: DType::Q4K,
        skew: 0.9,
        seed: 5,
        tuning: Default::default(),
    };
    let path = dir.join(format!("{geometry}.gguf"));
    Synth::new(opts).unwrap().write_gguf(&path, &|_| {}).unwrap();
    path
}

#[test]
fn quantized_synthetic_moe_at_mixed_precision() {
    let dir = scratch("synth");
    for geometry in ["tiny-moe", "tiny-gemma4"] {
        let ckpt = Checkpoint::open(&synth_q4k(&dir, geometry)).unwrap();
        let t: Vec<u32> = (0..16u32).map(|i| (i * 37 + 11) % ckpt.spec.vocab_size as u32).collect();
        check_checkpoint(geometry, &ckpt, &sequences(&t));
    }
}

/// SmolLM2 (which CI fetches): real quantized weights, rows of both precisions in a step.
#[test]
fn real_smollm2_at_mixed_precision() {
    let Some(path) = sluice_core::testing::real_model("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2") else { return };
    let model = Model::open(&path).unwrap();
    let t: Vec<u32> = (0..16u32).map(|i| 1 + (i * 1009) % 40000).collect();
    check_model("smollm2", &model, &sequences(&t));
}

/// One `Model` stepped from several threads at once gives what it gives from one.
/// Feeds `tokens` after what `state` holds, in one chunk; every row's logits.
fn feed(model: &Model, state: &mut SeqState<Cpu>, tokens: &[u32]) -> Vec<f32> {
    let mut chunks = [Chunk { state, tokens, logits: Logits::All }];
    model.step(&mut chunks, &mut StepStats::default()).pop().unwrap().unwrap()
}

/// A state's first positions (`SeqState::prefix`, what the server starts a prompt from
/// when it shares a beginning with a kept sequence) continue bitwise as a state fed only
/// that far, on every fixture. A sliding window's ring that has gone past them gives
/// none; one that has not, and a prefix of every position, always do.
#[test]
fn a_states_prefix_continues_as_one_fed_that_far() {
    for (name, ring) in [("qwen3-moe", false), ("llama", false), ("gemma3", true), ("gemma4-dense", true)] {
        let dir = fixture(name);
        let t = fixture_tokens(&dir);
        let model = Model::load(Cpu::default(), &Checkpoint::open(&dir).unwrap()).unwrap();
        let fed_that_far = |keep: usize| {
            let mut s = model.new_state().unwrap();
            feed(&model, &mut s, &t[..keep]);
            s
        };
        let long = fed_that_far(13);
        for (held, keep) in [(13, 9), (13, 13), (3, 2)] {
            let source = if held == 13 { &long } else { &fed_that_far(held) };
            match source.prefix(&model.be, keep).unwrap() {
                Some(mut p) => {
                    assert_eq!(p.len(), keep);
                    let want = feed(&model, &mut fed_that_far(keep), &t[keep..]);
                    assert!(feed(&model, &mut p, &t[keep..]) == want, "{name}: prefix {keep} of {held} differs");
                }
                None => assert!(ring && keep < held && held > 4, "{name}: no prefix {keep} of {held}"),
            }
        }
        assert!(long.prefix(&model.be, 14).unwrap().is_none(), "{name}: a prefix longer than the state");
    }
}

#[test]
fn model_shared_across_threads() {
    let dir = fixture("qwen3-moe");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let store = StoreConfig {
        residency: Residency::Streamed,
        budget: Some(CacheBudget::SlotsPerLayer(3)),
        ..Default::default()
    };
    let model = Model::load_with(
        Cpu::default(),
        &ckpt,
        &LoadOptions { store, prefetch: Prefetch::Pilot, precision: None, kv: None },
        None,
    )
    .unwrap();
    let seqs = sequences(&fixture_tokens(&dir));
    let sched = one_by_one(&seqs);
    let want = alone(&model, &seqs, &sched, Logits::All);
    let got: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(|| together(&model, &seqs, &sched, Logits::All))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for g in got {
        assert!(g == want, "a thread's logits differ");
    }
}

/// A sequence past the context, one with a token outside the vocabulary, and a good
/// one in the same step: the good one gets its logits, the others an error each, and
/// no state changes for them.
#[test]
fn bad_sequences_end_alone() {
    let dir = fixture("qwen3");
    let mut model = Model::open(&dir).unwrap();
    model.max_context = 12;
    let t = fixture_tokens(&dir);
    let want = model.session().unwrap().forward(&t[..5], Logits::All).unwrap();
    let mut states: Vec<_> = (0..3).map(|_| model.new_state().unwrap()).collect();
    let [a, b, c] = &mut states[..] else { unreachable!() };
    let bad_id = [t[0], 512, t[1]];
    let mut chunks = vec![
        Chunk { state: a, tokens: &t[..13], logits: Logits::All },
        Chunk { state: b, tokens: &bad_id, logits: Logits::All },
        Chunk { state: c, tokens: &t[..5], logits: Logits::All },
    ];
    let r = model.step(&mut chunks, &mut StepStats::default());
    assert!(matches!(&r[0], Err(Error::ContextTooLong { needed: 13, limit: 12 })), "{:?}", r[0]);
    assert!(matches!(&r[1], Err(Error::TokenOutOfRange { id: 512, .. })), "{:?}", r[1]);
    assert!(matches!(&r[2], Ok(l) if *l == want));
    assert_eq!(states.iter().map(|s| s.len()).collect::<Vec<_>>(), [0, 0, 5]);
}

/// Experts that cannot be read stop the sequences routed to them; a sequence in the
/// same step that does not need them gets its logits, bitwise those of an intact file.
#[test]
fn an_expert_read_failing_stops_only_the_sequences_that_need_it() {
    let dir = scratch("read-fault");
    let packed = dir.join("packed");
    let src = Checkpoint::open(&fixture("qwen3-moe")).unwrap();
    sluice_formats::pack::pack(&src, &packed, &|_| {}).unwrap();
    let experts = packed.join("experts.bin");
    let intact = std::fs::read(&experts).unwrap();
    let ckpt = Checkpoint::open(&packed).unwrap();
    let streamed = || {
        let store = StoreConfig {
            residency: Residency::Streamed,
            budget: Some(CacheBudget::SlotsPerLayer(2)),
            ..Default::default()
        };
        Model::load_with(Cpu::default(), &ckpt, &LoadOptions { store, ..Default::default() }, None).unwrap()
    };
    let reference = streamed();
    // One-token sequences; which of them need the last layer's last experts, which
    // the cut below removes, is found by trying each alone on a fresh model.
    let cands: Vec<Vec<u32>> = (0..60u32).map(|t| vec![t * 7 % 512, (t * 13 + 5) % 512]).collect();
    let want: Vec<Vec<f32>> =
        cands.iter().map(|c| reference.session().unwrap().forward(c, Logits::All).unwrap()).collect();
    let probe = streamed();
    let faulty = streamed();
    std::fs::OpenOptions::new().write(true).open(&experts).unwrap().set_len(intact.len() as u64 * 15 / 16).unwrap();
    let fails: Vec<bool> = cands.iter().map(|c| probe.session().unwrap().forward(c, Logits::All).is_err()).collect();
    let good = fails.iter().position(|&f| !f).expect("a sequence that does not need the cut experts");
    let bad = fails.iter().position(|&f| f).expect("a sequence that needs them");

    let mut states: Vec<_> = (0..3).map(|_| faulty.new_state().unwrap()).collect();
    let [a, b, c] = &mut states[..] else { unreachable!() };
    let mut chunks = vec![
        Chunk { state: a, tokens: &cands[bad], logits: Logits::All },
        Chunk { state: b, tokens: &cands[good], logits: Logits::All },
        Chunk { state: c, tokens: &cands[bad], logits: Logits::Last },
    ];
    let r = faulty.step(&mut chunks, &mut StepStats::default());
    for i in [0, 2] {
        let msg = r[i].as_ref().err().unwrap_or_else(|| panic!("sequence {i} must fail")).to_string();
        assert!(msg.contains("experts.bin") && msg.contains("expert"), "{msg}");
    }
    assert!(matches!(&r[1], Ok(l) if *l == want[good]), "the sequence without the cut experts must go on");
    assert_eq!(states.iter().map(|s| s.len()).collect::<Vec<_>>(), [0, 2, 0]);

    // The bytes back: the same model serves the failed sequences.
    std::fs::write(&experts, &intact).unwrap();
    assert!(faulty.session().unwrap().forward(&cands[bad], Logits::All).unwrap() == want[bad]);
}

/// Hyper-connections, QSA choices per row and n-gram contexts, each sequence its own.
#[test]
fn qwen4_exp() {
    check_fixture("qwen4-exp");
}
