//! A loaded model and the sessions that run it.

use std::path::Path;

use sluice_core::{Error, Family, ModelSpec, Result};
use sluice_experts::ExpertStore;
use sluice_formats::Checkpoint;

use crate::backend::{Backend, Cpu};
use crate::blocks::{Step, check_tokens};
use crate::families::{Network, gemma::Gemma, llama::Llama};
use crate::stats::Timers;

/// Longest run of tokens pushed through the layers at once; longer prompts are
/// prefilled in chunks of this size to bound activation memory.
pub const PREFILL_CHUNK: usize = 512;

pub struct Model<B: Backend = Cpu> {
    pub spec: ModelSpec,
    pub be: B,
    net: Box<dyn Network<B>>,
    pub store: ExpertStore,
    /// The most positions a session may hold (the model's, or less if asked).
    pub max_context: usize,
}

impl Model<Cpu> {
    /// Opens a checkpoint and loads it for the CPU.
    pub fn open(path: &Path) -> Result<Model<Cpu>> {
        let ckpt = Checkpoint::open(path)?;
        Model::load(Cpu, &ckpt)
    }
}

impl<B: Backend + 'static> Model<B> {
    pub fn load(be: B, ckpt: &Checkpoint) -> Result<Model<B>> {
        let net: Box<dyn Network<B>> = match ckpt.family() {
            Family::Gemma => Box::new(Gemma::load(&be, ckpt)?),
            Family::Llama => Box::new(Llama::load(&be, ckpt)?),
        };
        Ok(Model {
            spec: ckpt.spec.clone(),
            max_context: ckpt.spec.max_context,
            store: ExpertStore::open(ckpt)?,
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
        Session { model: self, caches, timers: Timers::default() }
    }
}

/// One sequence being run: its KV caches and timings.
pub struct Session<'m, B: Backend> {
    model: &'m Model<B>,
    caches: Vec<Option<B::Kv>>,
    pub timers: Timers,
}

/// Which rows of logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// One row per input token.
    All,
    /// Only the last token's row (generation).
    Last,
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
    /// `[rows, vocab]` flattened. Nothing is appended if it fails.
    pub fn forward(&mut self, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        let m = self.model;
        check_tokens(tokens, m.spec.vocab_size)?;
        let needed = self.len() + tokens.len();
        if needed > m.max_context {
            return Err(Error::ContextTooLong { needed, limit: m.max_context });
        }
        let mut out = Vec::new();
        let chunks: Vec<&[u32]> = tokens.chunks(PREFILL_CHUNK).collect();
        for (ci, chunk) in chunks.iter().enumerate() {
            let last_chunk = ci + 1 == chunks.len();
            let mut step = Step {
                be: &m.be,
                caches: &self.caches,
                pending: (0..self.caches.len()).map(|_| None).collect(),
                store: &m.store,
                timers: &mut self.timers,
                eps: m.spec.rms_norm_eps,
                norm_offset: m.spec.norm_weight_offset,
            };
            let x = m.net.forward(&mut step, chunk)?;
            let pending = std::mem::take(&mut step.pending);
            if which == Logits::All || last_chunk {
                let be = &m.be;
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
        let mut logits = self.forward(prompt, Logits::Last)?;
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
