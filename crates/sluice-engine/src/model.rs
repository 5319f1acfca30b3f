//! A loaded model, the steps that run it over many sequences at once, and the
//! one-sequence [`Session`] built on them.
//!
//! [`Model::step`] takes any set of sequences, each with the tokens it feeds this
//! step (a prompt chunk, or one token to decode), and runs them as one batch: every
//! weight is read once for all of their rows, and a MoE layer fetches the union of
//! their experts once. Each sequence's rows are computed exactly as they would be
//! alone (the kernels' rows do not depend on each other, and a row's activation
//! precision follows its own sequence), so batching never changes a result.

use std::path::Path;

use sluice_core::{DType, Error, ExactRows, Family, KvFormat, ModelSpec, Precision, Result};
use sluice_experts::{ExpertStore, StoreConfig};
use sluice_formats::Checkpoint;

use crate::backend::{Backend, Cpu, KvAppend};
use crate::batch::Batch;
use crate::blocks::{Cx, Pending, check_tokens};
use crate::families::{
    Network, deepseek::DeepSeek, gemma3::Gemma3, gemma4::Gemma4, gpt_oss::GptOss, llama::Llama, qwen4_exp::Qwen4Exp,
    qwen35::Qwen35,
};
use crate::pilot::{Pilot, PilotStats};
use crate::state::{KeyForm, SeqState, StateSpec};
use crate::stats::Timers;

/// Most rows pushed through the layers at once; longer steps run in passes of this
/// many rows to bound activation memory.
pub const PREFILL_CHUNK: usize = 512;

/// Read-ahead of routed experts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Prefetch {
    #[default]
    Off,
    /// Probe the next layer's router on the current residual and read its picks early.
    Pilot,
}

/// How a model is loaded beyond its files.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    pub store: StoreConfig,
    pub prefetch: Prefetch,
    /// Activation precision for every step; `None` picks per sequence ([`Model::precision`]).
    pub precision: Option<Precision>,
    /// How KV caches store their positions (`--kv-bits`); `None` is
    /// [`default_kv_format`].
    pub kv: Option<KvFormat>,
}

/// The KV cache's width when none is asked for: the width the keys are computed
/// from. A checkpoint whose key projections are f32 keeps f32 caches (the fixtures
/// stay exact against their references); a 16-bit or quantized one 16 bits. The CUDA
/// backend's kernels read f32 caches, so it keeps f32.
pub fn default_kv_format<B: Backend>(be: &B, ckpt: &Checkpoint) -> KvFormat {
    use sluice_formats::names::{TensorId, TensorKind};
    if be.name() == "cuda" {
        return KvFormat::F32;
    }
    let keys = (0..ckpt.spec.layers.len())
        .flat_map(|l| [TensorKind::AttnK, TensorKind::AttnKvAMqa].map(|k| ckpt.get(TensorId::layer(l, k))))
        .flatten()
        .next();
    match keys.map(|t| t.dtype) {
        None | Some(DType::F32) => KvFormat::F32,
        Some(_) => KvFormat::F16,
    }
}

pub struct Model<B: Backend = Cpu> {
    pub spec: ModelSpec,
    pub be: B,
    net: Box<dyn Network<B>>,
    state: Vec<StateSpec>,
    pub store: ExpertStore,
    /// The most positions a sequence may hold (the model's, or less if asked).
    pub max_context: usize,
    pub prefetch: Prefetch,
    /// Activation precision of quantized matrix products. `None` (the default) picks
    /// per sequence and step: [`Precision::Accurate`] for a sequence feeding one token
    /// (a decode step, mostly reading and unpacking weights, where it costs at most a
    /// few percent) and [`Precision::Fast`] for one feeding several (a prefill,
    /// bound by arithmetic, where it would cost 6-24%). A prompt's last token is then
    /// run on its own ([`Session::prefill`]), so every sampled token comes from
    /// accurate logits.
    pub precision: Option<Precision>,
    /// How every sequence's KV caches store positions (a sliding layer's at most 16
    /// bits); [`LoadOptions::kv`], or [`default_kv_format`] when it is `None`.
    pub kv_format: KvFormat,
    /// The positions a TurboQuant cache (`kv_format` of 2 to 4 bits) keeps as computed:
    /// [`ExactRows::DEFAULT`]; [`ExactRows::NONE`] measures the codes alone.
    pub kv_exact: ExactRows,
    /// Per layer, how its coded caches code keys.
    key_forms: Vec<KeyForm>,
    /// Weight bytes one decode step reads: every resident matrix, the output
    /// projection, one row of each embedding table, and top-k experts per MoE layer
    /// (their average size). Divided into memory bandwidth it gives the roofline.
    pub bytes_per_token: u64,
}

/// Which rows of logits a step returns for a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// One row per token fed.
    All,
    /// Only the last token's row (generation).
    Last,
    /// None: the tokens only fill the state.
    None,
}

/// One sequence's part of a step.
pub struct Chunk<'a, B: Backend> {
    pub state: &'a mut SeqState<B>,
    /// The tokens it feeds, after what its state holds.
    pub tokens: &'a [u32],
    pub logits: Logits,
}

/// Timings and probe counts, summed over the steps that were given them.
#[derive(Clone, Debug, Default)]
pub struct StepStats {
    pub timers: Timers,
    pub pilot: PilotStats,
}

impl Model<Cpu> {
    /// Opens a checkpoint and loads it for the CPU.
    pub fn open(path: &Path) -> Result<Model<Cpu>> {
        let ckpt = Checkpoint::open(path)?;
        Model::load(Cpu::default(), &ckpt)
    }
}

/// Part of a pass: `len` tokens of chunk `chunk`, from its token `from`.
#[derive(Clone, Copy, Debug)]
struct Part {
    chunk: usize,
    from: usize,
    len: usize,
}

/// Why a pass failed, and whom it stops.
struct PassError {
    error: Error,
    /// The chunks it stops, if it could tell (an expert read that fails for them).
    affected: Option<Vec<usize>>,
}

impl<B: Backend> Model<B> {
    /// Loads with every expert served in place from the mapped files.
    pub fn load(be: B, ckpt: &Checkpoint) -> Result<Model<B>> {
        Model::load_with(be, ckpt, &LoadOptions::default(), None)
    }

    /// Loads with the given expert residency and prefetch; `progress` sees bytes
    /// loaded of total while a resident store reads its experts.
    pub fn load_with(
        be: B,
        ckpt: &Checkpoint,
        opts: &LoadOptions,
        mut progress: Option<&mut dyn FnMut(u64, u64)>,
    ) -> Result<Model<B>> {
        let net: Box<dyn Network<B>> = match ckpt.family() {
            Family::Gemma if ckpt.spec.arch == "gemma4" => Box::new(Gemma4::load(&be, ckpt)?),
            Family::Gemma => Box::new(Gemma3::load(&be, ckpt)?),
            Family::Llama => Box::new(Llama::load(&be, ckpt)?),
            Family::GptOss => Box::new(GptOss::load(&be, ckpt)?),
            Family::DeepSeek => Box::new(DeepSeek::load(&be, ckpt)?),
            Family::Qwen35 => Box::new(Qwen35::load(&be, ckpt)?),
            Family::Qwen4Exp => Box::new(Qwen4Exp::load(&be, ckpt)?),
        };
        let mut store_cfg = opts.store.clone();
        if store_cfg.page_lock.is_none() {
            store_cfg.page_lock = be.page_lock();
        }
        let store =
            ExpertStore::open(ckpt, &store_cfg, progress.as_mut().map(|p| &mut **p as &mut dyn FnMut(u64, u64)))?;
        be.adopt_experts(&store, progress)?;
        Ok(Model {
            spec: ckpt.spec.clone(),
            max_context: ckpt.spec.max_context,
            prefetch: if ckpt.spec.is_moe() { opts.prefetch } else { Prefetch::Off },
            precision: opts.precision,
            kv_format: opts.kv.unwrap_or_else(|| default_kv_format(&be, ckpt)),
            kv_exact: ExactRows::DEFAULT,
            bytes_per_token: decode_bytes_per_token(ckpt, &store),
            key_forms: KeyForm::of(ckpt)?,
            state: net.state(),
            store,
            be,
            net,
        })
    }

    /// A new, empty sequence.
    pub fn new_state(&self) -> Result<SeqState<B>> {
        self.new_state_in(self.kv_format)
    }

    /// A new, empty sequence whose KV caches store positions in `format` rather than
    /// the model's [`Model::kv_format`] (a step reads each sequence's own format).
    pub fn new_state_in(&self, format: KvFormat) -> Result<SeqState<B>> {
        SeqState::new(&self.be, &self.state, (format, self.kv_exact), &self.key_forms)
    }

    /// A one-sequence session.
    pub fn session(&self) -> Result<Session<'_, B>> {
        Ok(Session { model: self, state: self.new_state()?, stats: StepStats::default() })
    }

    /// Whether `tokens` may follow what `state` holds: ids in the vocabularies, and
    /// room in the context.
    fn check_chunk(&self, state: &SeqState<B>, tokens: &[u32]) -> Result<()> {
        check_tokens(tokens, self.spec.vocab_size)?;
        self.net.check(tokens)?;
        let needed = state.len() + tokens.len();
        if needed > self.max_context {
            return Err(Error::ContextTooLong { needed, limit: self.max_context });
        }
        Ok(())
    }

    /// Runs one step over several sequences as one batch and returns each one's
    /// logits (`[rows, vocab]` flattened, the rows its [`Logits`] asks for), in the
    /// order given. A sequence whose tokens are not valid for it (outside the
    /// vocabulary, past the context), or whose experts cannot be read, gets an
    /// error and keeps its state as it was; the others go on. Steps of more than
    /// [`PREFILL_CHUNK`] rows run in passes of that many: a sequence that fails in a
    /// later pass keeps the tokens of the passes before.
    pub fn step(&self, chunks: &mut [Chunk<'_, B>], stats: &mut StepStats) -> Vec<Result<Vec<f32>>> {
        // Run on a worker of the kernels' thread pool, not beside it: a caller
        // outside the pool would be one runnable thread more than there are workers,
        // and between parallel kernels the idle workers' spinning would take its core.
        if rayon::current_thread_index().is_some() {
            self.step_in_pool(chunks, stats)
        } else {
            rayon::scope(|_| self.step_in_pool(chunks, stats))
        }
    }

    fn step_in_pool(&self, chunks: &mut [Chunk<'_, B>], stats: &mut StepStats) -> Vec<Result<Vec<f32>>> {
        let mut results: Vec<Option<Result<Vec<f32>>>> =
            chunks.iter().map(|c| self.check_chunk(c.state, c.tokens).err().map(Err)).collect();
        let mut out: Vec<Vec<f32>> = vec![Vec::new(); chunks.len()];
        let mut done = vec![0usize; chunks.len()];
        loop {
            // The next pass: every live chunk's next tokens, in order, up to the row budget.
            let mut parts = Vec::new();
            let mut room = PREFILL_CHUNK;
            for (i, c) in chunks.iter().enumerate() {
                let left = c.tokens.len() - done[i];
                if results[i].is_some() || left == 0 || room == 0 {
                    continue;
                }
                let len = left.min(room);
                parts.push(Part { chunk: i, from: done[i], len });
                room -= len;
            }
            if parts.is_empty() {
                break;
            }
            match self.pass(chunks, &parts, stats) {
                Ok(logits) => {
                    for (p, l) in parts.iter().zip(logits) {
                        out[p.chunk].extend(l);
                        done[p.chunk] += p.len;
                    }
                }
                Err(PassError { error, affected }) => {
                    // Those it stops end with the error; a pass that fails for no
                    // one in particular ends all of its sequences.
                    let stopped = affected.unwrap_or_else(|| parts.iter().map(|p| p.chunk).collect());
                    for c in stopped {
                        results[c] = Some(Err(error.duplicate()));
                    }
                }
            }
        }
        results.into_iter().zip(out).map(|(r, o)| r.unwrap_or(Ok(o))).collect()
    }

    /// Feeds each sequence its prompt and returns the last token's logits, the ones
    /// its first generated token is sampled from. When the model picks precision per
    /// sequence, the prompts' last tokens run as a step of their own (so those logits
    /// are accurate too); the rest of the prompts run together before it. Errors are
    /// per sequence, as in [`Model::step`]; a prompt that is not valid is refused
    /// before any of it runs.
    pub fn prefill(
        &self,
        states: &mut [&mut SeqState<B>],
        prompts: &[&[u32]],
        stats: &mut StepStats,
    ) -> Vec<Result<Vec<f32>>> {
        assert_eq!(states.len(), prompts.len(), "prefill: one prompt per state");
        let mut results: Vec<Option<Result<Vec<f32>>>> =
            states.iter().zip(prompts).map(|(s, p)| self.check_chunk(s, p).err().map(Err)).collect();
        let split = self.precision.is_none();
        // Phase 0: all but the last tokens (when split); phase 1: the rest.
        for phase in 0..2 {
            let mut chunks = Vec::new();
            let mut which = Vec::new();
            for (i, (state, p)) in states.iter_mut().zip(prompts).enumerate() {
                let cut = if split { p.len().saturating_sub(1) } else { 0 };
                let (tokens, logits) = if phase == 0 { (&p[..cut], Logits::None) } else { (&p[cut..], Logits::Last) };
                if results[i].is_none() && (phase == 1 || !tokens.is_empty()) {
                    chunks.push(Chunk { state: &mut **state, tokens, logits });
                    which.push(i);
                }
            }
            for (i, r) in which.into_iter().zip(self.step(&mut chunks, stats)) {
                match r {
                    Err(e) => results[i] = Some(Err(e)),
                    Ok(l) if phase == 1 => results[i] = Some(Ok(l)),
                    Ok(_) => {}
                }
            }
        }
        results.into_iter().map(|r| r.expect("every prompt ends in a result")).collect()
    }

    /// The precision of a chunk's rows.
    fn precision_of(&self, c: &Chunk<'_, B>) -> Precision {
        self.precision.unwrap_or(if c.tokens.len() == 1 { Precision::Accurate } else { Precision::Fast })
    }

    /// One forward pass over `parts`, then the logits asked for and the state updates.
    /// A failure changes no state. An expert read that fails is tried again once
    /// when it failed for no sequence on its own (a passing fault).
    fn pass(
        &self,
        chunks: &mut [Chunk<'_, B>],
        parts: &[Part],
        stats: &mut StepStats,
    ) -> Result<Vec<Vec<f32>>, PassError> {
        let mut tries = 0;
        loop {
            match self.try_pass(chunks, parts, stats) {
                Err(PassError { affected: Some(a), .. }) if a.is_empty() && tries == 0 => tries += 1,
                Err(PassError { error, affected: Some(a) }) if a.is_empty() => {
                    return Err(PassError { error, affected: None });
                }
                r => return r,
            }
        }
    }

    fn try_pass(
        &self,
        chunks: &mut [Chunk<'_, B>],
        parts: &[Part],
        stats: &mut StepStats,
    ) -> Result<Vec<Vec<f32>>, PassError> {
        let fail = |error| PassError { error, affected: None };
        let tokens: Vec<u32> =
            parts.iter().flat_map(|p| &chunks[p.chunk].tokens[p.from..p.from + p.len]).copied().collect();
        let shape: Vec<(usize, usize, Precision)> =
            parts.iter().map(|p| (chunks[p.chunk].state.len(), p.len, self.precision_of(&chunks[p.chunk]))).collect();
        let batch = Batch::new(&shape);
        let be = self.be.with_precision(batch.precision.clone());
        let piloting = self.prefetch == Prefetch::Pilot;
        let mut pilot_stats = PilotStats::default();
        let (x, mut pending) = {
            let states: Vec<&SeqState<B>> = parts.iter().map(|p| &*chunks[p.chunk].state).collect();
            let mut cx = Cx {
                be: &be,
                batch: &batch,
                states: &states,
                pending: (0..self.spec.n_layers()).map(|_| None).collect(),
                store: &self.store,
                timers: &mut stats.timers,
                pilot: piloting.then(|| Pilot::new(self.net.as_ref(), self.spec.n_layers(), &mut pilot_stats)),
                eps: self.spec.rms_norm_eps,
                norm_offset: self.spec.norm_weight_offset,
                affected: None,
            };
            match self.net.forward(&mut cx, &tokens) {
                Ok(x) => (x, std::mem::take(&mut cx.pending)),
                Err(error) => {
                    let affected = cx.affected.map(|a| a.into_iter().map(|s| parts[s].chunk).collect());
                    return Err(PassError { error, affected });
                }
            }
        };
        stats.pilot.add(&pilot_stats);

        // The rows whose logits are wanted, and how many of them each part gets.
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(parts.len());
        for (p, s) in parts.iter().zip(&batch.seqs) {
            let c = &chunks[p.chunk];
            let last = p.from + p.len == c.tokens.len();
            let before = rows.len();
            match c.logits {
                Logits::All => rows.extend(s.first..s.first + s.rows),
                Logits::Last if last => rows.push(s.first + s.rows - 1),
                _ => {}
            }
            counts.push(rows.len() - before);
        }
        let logits = if rows.is_empty() {
            Vec::new()
        } else {
            // The gathered rows keep their own precisions (a decode row's logits beside
            // a prompt's last row are what it gives alone).
            let be = be.with_precision(batch.precision.gather(rows.iter().copied()));
            self.logits(&be, &x, &rows, stats).map_err(fail)?
        };

        // Nothing failed: the sequences take their new keys and values.
        for (i, (p, s)) in parts.iter().zip(&batch.seqs).enumerate() {
            let state = &mut *chunks[p.chunk].state;
            // Every layer's keys and values at once (one or two launches on a GPU).
            let appends = state
                .kvs_mut()
                .filter_map(|(layer, kv)| match &pending[layer] {
                    Some(Pending::Kv(k, v) | Pending::IndexedKv(k, v, _)) => Some(KvAppend { kv, k, v }),
                    _ => None,
                })
                .collect();
            be.kv_append_layers(appends, *s).map_err(fail)?;
            for (layer, p) in pending.iter_mut().enumerate() {
                match p {
                    Some(Pending::Kv(..)) | None => {}
                    Some(Pending::IndexedKv(k, _, keys)) => {
                        if let Some(held) = state.index_keys_mut(layer) {
                            let width = keys.len() / be.n_rows(k).max(1);
                            held.extend_from_slice(&keys[s.first * width..(s.first + s.rows) * width]);
                        }
                    }
                    Some(Pending::Recurrent(next)) => {
                        let next = next[i].take().expect("one recurrent state per sequence");
                        state.set_recurrent(layer, next).map_err(fail)?;
                    }
                }
            }
            state.advance(p.len);
        }
        // One part takes the logits whole; several take a copy of their rows each.
        if let [_] = counts[..] {
            return Ok(vec![logits]);
        }
        let vocab = self.spec.vocab_size;
        let mut at = 0;
        Ok(counts
            .into_iter()
            .map(|n| {
                let l = logits[at * vocab..(at + n) * vocab].to_vec();
                at += n;
                l
            })
            .collect())
    }

    /// The output projection of rows `rows` of the final hidden states.
    fn logits(&self, be: &B, x: &B::Act, rows: &[usize], stats: &mut StepStats) -> Result<Vec<f32>> {
        stats.timers.time(
            |t| &mut t.lm_head,
            || {
                let all = rows.len() == be.n_rows(x) && rows.iter().enumerate().all(|(i, &r)| i == r);
                let picked;
                let x = if all {
                    x
                } else {
                    picked = be.gather_rows(x, rows)?;
                    &picked
                };
                let mut l = be.matmul(x, self.net.lm_head())?;
                if let Some(cap) = self.spec.final_logit_softcap {
                    be.softcap(&mut l, cap)?;
                }
                be.to_host_owned(l)
            },
        )
    }
}

fn decode_bytes_per_token(ckpt: &Checkpoint, store: &ExpertStore) -> u64 {
    use sluice_formats::{TensorId, TensorKind};
    let spec = &ckpt.spec;
    let all: u64 = ckpt.tensors().iter().map(|t| t.len_bytes() as u64).sum();
    let mut bytes = all - store.total_bytes();
    for kind in [TensorKind::TokenEmbd, TensorKind::PleTokenEmbd] {
        if let Some(t) = ckpt.get(TensorId::model(kind)) {
            let rows = t.shape.first().copied().unwrap_or(1).max(1) as u64;
            let row = t.len_bytes() as u64 / rows;
            // A tied output projection reads the whole table; a lookup one row.
            let read = if kind == TensorKind::TokenEmbd && spec.tie_word_embeddings { t.len_bytes() as u64 } else { 0 };
            bytes = bytes - t.len_bytes() as u64 + row + read;
        }
    }
    for (l, ls) in spec.layers.iter().enumerate() {
        if let Some(m) = &ls.moe {
            bytes += store.layer_bytes(l) / m.n_experts.max(1) as u64 * m.top_k as u64;
        }
    }
    bytes
}

/// One sequence being run: its state and the timings of its steps.
pub struct Session<'m, B: Backend> {
    model: &'m Model<B>,
    pub state: SeqState<B>,
    pub stats: StepStats,
}

/// How long a generation took, split into its two phases.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Why it stopped: "eos", "length" or "caller".
    pub stop: &'static str,
}

impl GenerationStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_s.max(1e-9)
    }
    /// Decode rate over the tokens after the first (the first comes from prefill).
    pub fn decode_tok_s(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_s.max(1e-9)
    }
}

impl<B: Backend> Session<'_, B> {
    /// Positions held so far.
    pub fn len(&self) -> usize {
        self.state.len()
    }

    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }

    /// Bytes held by the KV caches.
    pub fn kv_bytes(&self) -> usize {
        self.state.kv_bytes(&self.model.be)
    }

    /// Forgets every position (the timings stay).
    pub fn reset(&mut self) -> Result<()> {
        self.state = self.model.new_state()?;
        Ok(())
    }

    /// Runs `tokens` after what the session already holds and returns their logits,
    /// `[rows, vocab]` flattened. If it fails, the state keeps the passes of
    /// [`PREFILL_CHUNK`] tokens before the one that failed ([`Session::len`] says how
    /// far it got); a prompt of one pass leaves it as it was.
    pub fn forward(&mut self, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        let mut chunk = [Chunk { state: &mut self.state, tokens, logits: which }];
        self.model.step(&mut chunk, &mut self.stats).pop().expect("one result per chunk")
    }

    /// Feeds a prompt and returns its last token's logits ([`Model::prefill`]). On
    /// failure the state may keep part of the prompt, as with [`Session::forward`].
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Vec<f32>> {
        self.model.prefill(&mut [&mut self.state], &[prompt], &mut self.stats).pop().expect("one result")
    }

    /// Feeds `prompt`, then samples up to `max_tokens` tokens, handing each to
    /// `on_token` (which returns false to stop). Stops early at any of `stop_ids`.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_tokens: usize,
        stop_ids: &[u32],
        sampler: &mut crate::Sampler,
        mut on_token: impl FnMut(u32) -> Result<bool>,
    ) -> Result<GenerationStats> {
        let mut st = GenerationStats { prompt_tokens: prompt.len(), stop: "length", ..Default::default() };
        if max_tokens == 0 {
            return Ok(st);
        }
        let room = self.model.max_context.saturating_sub(self.len() + prompt.len());
        let max_tokens = max_tokens.min(room + 1);
        let t = std::time::Instant::now();
        let mut logits = self.prefill(prompt)?;
        st.prefill_s = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        loop {
            let next = sampler.sample(&logits);
            st.generated_tokens += 1;
            if stop_ids.contains(&next) {
                st.stop = "eos";
                break;
            }
            if !on_token(next)? {
                st.stop = "caller";
                break;
            }
            if st.generated_tokens >= max_tokens {
                break;
            }
            logits = self.forward(&[next], Logits::Last)?;
        }
        st.decode_s = t.elapsed().as_secs_f64();
        Ok(st)
    }
}
