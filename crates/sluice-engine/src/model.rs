//! A loaded model and the sessions that run it.

use std::path::Path;

use sluice_core::{Error, Family, ModelSpec, Precision, Result};
use sluice_experts::{ExpertStore, StoreConfig};
use sluice_formats::Checkpoint;

use crate::backend::{Backend, Cpu};
use crate::blocks::{Pilot, Step, check_tokens};
use crate::families::{Network, gemma::Gemma, llama::Llama};
use crate::stats::Timers;

/// Longest run of tokens pushed through the layers at once; longer prompts are
/// prefilled in chunks of this size to bound activation memory.
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
    /// Activation precision for every step; `None` picks per step ([`Model::precision`]).
    pub precision: Option<Precision>,
}

/// Decode-sized steps probe the next layer's router; a prefill chunk touches most
/// experts anyway, so probing it would only read ahead what it is about to read.
const PILOT_MAX_TOKENS: usize = 4;

pub struct Model<B: Backend = Cpu> {
    pub spec: ModelSpec,
    pub be: B,
    net: Box<dyn Network<B>>,
    pub store: ExpertStore,
    /// The most positions a session may hold (the model's, or less if asked).
    pub max_context: usize,
    pub prefetch: Prefetch,
    /// Activation precision of quantized matrix products. `None` (the default) picks
    /// per step: [`Precision::Accurate`] for one token (a decode step, mostly
    /// reading and unpacking weights, where it costs at most a few percent) and
    /// [`Precision::Fast`] for several (a prefill, bound by arithmetic, where it
    /// would cost 6-24%). A prompt's
    /// last token is then run on its own ([`Session::prefill`]), so every sampled
    /// token comes from accurate logits.
    pub precision: Option<Precision>,
    /// Weight bytes one decode step reads: every resident matrix, the output
    /// projection, one row of each embedding table, and top-k experts per MoE layer
    /// (their average size). Divided into memory bandwidth it gives the roofline.
    pub bytes_per_token: u64,
}

impl Model<Cpu> {
    /// Opens a checkpoint and loads it for the CPU.
    pub fn open(path: &Path) -> Result<Model<Cpu>> {
        let ckpt = Checkpoint::open(path)?;
        Model::load(Cpu::default(), &ckpt)
    }
}

impl<B: Backend + 'static> Model<B> {
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
        progress: Option<&mut dyn FnMut(u64, u64)>,
    ) -> Result<Model<B>> {
        let net: Box<dyn Network<B>> = match ckpt.family() {
            Family::Gemma => Box::new(Gemma::load(&be, ckpt)?),
            Family::Llama => Box::new(Llama::load(&be, ckpt)?),
        };
        let store = ExpertStore::open(ckpt, &opts.store, progress)?;
        Ok(Model {
            spec: ckpt.spec.clone(),
            max_context: ckpt.spec.max_context,
            prefetch: if ckpt.spec.is_moe() { opts.prefetch } else { Prefetch::Off },
            precision: opts.precision,
            bytes_per_token: decode_bytes_per_token(ckpt, &store),
            store,
            be,
            net,
        })
    }

    pub fn session(&self) -> Session<'_, B> {
        let caches = self
            .spec
            .layers
            .iter()
            .map(|l| {
                let a = &l.attention;
                a.kv_source.is_none().then(|| self.be.kv_new(a.kv_dim(), a.window))
            })
            .collect();
        Session { model: self, caches, timers: Timers::default(), pilot: Pilot::new(self.spec.n_layers()) }
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

/// One sequence being run: its KV caches and timings.
pub struct Session<'m, B: Backend> {
    model: &'m Model<B>,
    caches: Vec<Option<B::Kv>>,
    pub timers: Timers,
    pub pilot: Pilot,
}

/// Which rows of logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// One row per input token.
    All,
    /// Only the last token's row (generation).
    Last,
    /// None: the tokens only fill the caches.
    None,
}

impl<B: Backend + 'static> Session<'_, B> {
    /// Positions held so far.
    pub fn len(&self) -> usize {
        self.caches.iter().flatten().next().map_or(0, |c| self.model.be.kv_len(c))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held by the KV caches.
    pub fn kv_bytes(&self) -> usize {
        self.caches.iter().flatten().map(|c| self.model.be.kv_bytes(c)).sum()
    }

    pub fn reset(&mut self) {
        *self = self.model.session();
    }

    /// Runs `tokens` after what the session already holds and returns their logits,
    /// `[rows, vocab]` flattened. If it fails, the caches keep the chunks of
    /// [`PREFILL_CHUNK`] tokens before the one that failed ([`Session::len`] says how
    /// far it got); a prompt of one chunk leaves them as they were.
    pub fn forward(&mut self, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        // Run the step on a worker of the kernels' thread pool, not beside it: a
        // caller outside the pool would be one runnable thread more than there are
        // workers, and between parallel kernels the idle workers' spinning would
        // take its core.
        if rayon::current_thread_index().is_some() {
            self.forward_in_pool(tokens, which)
        } else {
            rayon::scope(|_| self.forward_in_pool(tokens, which))
        }
    }

    /// Whether `tokens` may follow what the session holds: ids in the vocabulary,
    /// and room in the context.
    fn check_next(&self, tokens: &[u32]) -> Result<()> {
        let m = self.model;
        check_tokens(tokens, m.spec.vocab_size)?;
        let needed = self.len() + tokens.len();
        if needed > m.max_context {
            return Err(Error::ContextTooLong { needed, limit: m.max_context });
        }
        Ok(())
    }

    fn forward_in_pool(&mut self, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        let m = self.model;
        self.check_next(tokens)?;
        let mut out = Vec::new();
        let chunks: Vec<&[u32]> = tokens.chunks(PREFILL_CHUNK).collect();
        for (ci, chunk) in chunks.iter().enumerate() {
            let last_chunk = ci + 1 == chunks.len();
            let pilot = (m.prefetch == Prefetch::Pilot && chunk.len() <= PILOT_MAX_TOKENS).then_some(&mut self.pilot);
            let precision = m.precision.unwrap_or(if chunk.len() == 1 { Precision::Accurate } else { Precision::Fast });
            let be = &m.be.with_precision(precision);
            let mut step = Step {
                be,
                caches: &self.caches,
                pending: (0..self.caches.len()).map(|_| None).collect(),
                store: &m.store,
                timers: &mut self.timers,
                eps: m.spec.rms_norm_eps,
                norm_offset: m.spec.norm_weight_offset,
                pilot,
            };
            let x = m.net.forward(&mut step, chunk)?;
            let pending = std::mem::take(&mut step.pending);
            if which == Logits::All || (which == Logits::Last && last_chunk) {
                let x = if which == Logits::Last { be.row(&x, be.rows(&x) - 1) } else { x };
                let head = m.net.lm_head();
                let logits = self.timers.time(
                    |t| &mut t.lm_head,
                    || {
                        let mut l = be.matmul(&x, head);
                        if let Some(cap) = m.spec.final_logit_softcap {
                            be.softcap(&mut l, cap);
                        }
                        be.to_host(&l)
                    },
                );
                out.extend_from_slice(&logits);
            }
            for (cache, p) in self.caches.iter_mut().zip(pending) {
                if let (Some(c), Some((k, v))) = (cache.as_mut(), p) {
                    m.be.kv_append(c, &k, &v);
                }
            }
        }
        Ok(out)
    }
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

impl<B: Backend + 'static> Session<'_, B> {
    /// Feeds a prompt and returns its last token's logits, the ones the first
    /// generated token is sampled from. When the model picks precision per step, the
    /// last token runs as a step of its own so that those logits are accurate too.
    /// On failure the caches may keep part of the prompt, as with [`Session::forward`].
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Vec<f32>> {
        match prompt.split_last() {
            Some((last, rest)) if self.model.precision.is_none() && !rest.is_empty() => {
                // Validate the whole prompt first, so that nothing is appended if
                // the last token is the bad one.
                self.check_next(prompt)?;
                self.forward(rest, Logits::None)?;
                self.forward(&[*last], Logits::Last)
            }
            _ => self.forward(prompt, Logits::Last),
        }
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
