//! Perplexity over a text, measured as llama.cpp's `llama-perplexity` measures it, so
//! that the numbers compare with the ones published for GGUF quantizations.
//!
//! The tokens are cut into consecutive windows of `context` tokens (what is left over
//! after the last whole window is not used). Each window runs from an empty state, its
//! first token replaced by BOS when the tokenizer adds one, and only the second half of
//! its positions is scored, so that every scored token has at least `context / 2`
//! tokens before it: the NLL of token `t + 1` from the logits at position `t`, for `t`
//! in `[context / 2, context - 1)`. A window thus scores `context - 1 - context / 2`
//! tokens. The perplexity is exp(mean NLL); its standard error is llama-perplexity's,
//! the standard error of the mean NLL carried through the exponential.
//!
//! A window's logits are never held whole (8192 positions of a 151k vocabulary are
//! 5 GB): it runs in steps of `batch` positions, and each step's rows are turned into
//! NLLs before the next.

use std::time::Instant;

use sluice_core::{Error, Result};

use crate::backend::Backend;
use crate::blocks::check_tokens;
use crate::model::{Chunk, Logits, Model, PREFILL_CHUNK, StepStats};

/// What to measure and how.
#[derive(Clone, Debug)]
pub struct PerplexityOptions {
    /// Tokens per window (llama-perplexity's `-c`); at least 3, at most the model's
    /// context length.
    pub context: usize,
    /// Most windows to evaluate (llama-perplexity's `--chunks`); `None`: every whole
    /// window the tokens hold.
    pub chunks: Option<usize>,
    /// The token each window starts with in place of its own: BOS when the tokenizer
    /// adds one, as llama-perplexity does.
    pub bos: Option<u32>,
    /// Positions fed per step: a step's logits (`batch` x vocabulary floats) are the
    /// most held at once.
    pub batch: usize,
}

impl Default for PerplexityOptions {
    fn default() -> Self {
        PerplexityOptions { context: 512, chunks: None, bos: None, batch: PREFILL_CHUNK }
    }
}

impl PerplexityOptions {
    /// Tokens a window scores: positions `context / 2` to `context - 2`.
    pub fn scored_per_window(&self) -> usize {
        self.context.saturating_sub(1 + self.context / 2)
    }

    /// Windows evaluated over `n_tokens` tokens.
    pub fn windows(&self, n_tokens: usize) -> usize {
        let whole = n_tokens / self.context.max(1);
        self.chunks.map_or(whole, |k| k.min(whole))
    }

    /// Checks what can be checked without the model: a window that scores something,
    /// a number of windows, and text enough for one window.
    pub fn check(&self, n_tokens: usize) -> Result<()> {
        if self.context < 3 {
            return Err(Error::Usage(format!(
                "--context {}: a window needs at least 3 tokens (a window of N scores positions N/2 to N-2, \
                 none when N is 2)",
                self.context
            )));
        }
        if self.chunks == Some(0) {
            return Err(Error::Usage("--chunks 0: evaluate at least 1 window (leave it out for all)".into()));
        }
        if self.batch == 0 {
            return Err(Error::Usage("perplexity: the step size (batch) must be at least 1".into()));
        }
        if n_tokens < self.context {
            return Err(Error::Usage(format!(
                "the text has {n_tokens} tokens; --context {} needs at least {} (one window)",
                self.context, self.context
            )));
        }
        Ok(())
    }
}

/// Where a measurement stands after a window.
#[derive(Clone, Copy, Debug)]
pub struct WindowDone {
    /// Windows done so far (1 after the first).
    pub done: usize,
    /// Windows in all.
    pub windows: usize,
    /// Perplexity over the tokens scored so far.
    pub ppl: f64,
}

/// The result of [`perplexity`].
#[derive(Clone, Debug)]
pub struct Perplexity {
    /// Tokens per window.
    pub context: usize,
    pub windows: usize,
    pub tokens_scored: usize,
    /// exp(mean NLL).
    pub ppl: f64,
    /// Its standard error, as llama-perplexity gives it (`PPL = ppl +/- ppl_stderr`);
    /// `None` with fewer than 2 tokens scored.
    pub ppl_stderr: Option<f64>,
    /// Mean negative log-likelihood per scored token, in nats.
    pub mean_nll: f64,
    /// Positions run through the model (each window's first `context - 1`: the last
    /// token of a window is only predicted).
    pub tokens_evaluated: usize,
    /// Wall time of the evaluation.
    pub seconds: f64,
}

/// Sums of NLLs and of their squares.
#[derive(Clone, Copy, Debug, Default)]
struct Sums {
    nll: f64,
    nll2: f64,
    count: usize,
}

impl Sums {
    fn add(&mut self, v: f64) {
        self.nll += v;
        self.nll2 += v * v;
        self.count += 1;
    }

    fn mean(&self) -> f64 {
        self.nll / self.count as f64
    }

    /// llama-perplexity's: the NLLs' variance over count - 1, its root, times the
    /// perplexity (the exponential's derivative at the mean).
    fn ppl_stderr(&self) -> Option<f64> {
        if self.count < 2 {
            return None;
        }
        let mean = self.mean();
        let var = (self.nll2 / self.count as f64 - mean * mean).max(0.0);
        Some((var / (self.count - 1) as f64).sqrt() * mean.exp())
    }
}

/// -log softmax(row)[target], in f64.
fn nll(row: &[f32], target: u32) -> f64 {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + sum.ln() - row[target as usize] as f64
}

/// Measures the perplexity of `model` over `tokens` (see the module's documentation);
/// `progress` is told after each window.
pub fn perplexity<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    opts: &PerplexityOptions,
    progress: &mut dyn FnMut(&WindowDone),
) -> Result<Perplexity> {
    opts.check(tokens.len())?;
    let n = opts.context;
    if n > model.max_context {
        return Err(Error::Usage(format!(
            "--context {n} is beyond the model's context length ({})",
            model.max_context
        )));
    }
    let windows = opts.windows(tokens.len());
    let used = &tokens[..windows * n];
    check_tokens(used, model.spec.vocab_size)?;
    if let Some(b) = opts.bos {
        check_tokens(&[b], model.spec.vocab_size)?;
    }
    let first = n / 2;
    let mut sums = Sums::default();
    let mut stats = StepStats::default();
    let t = Instant::now();
    for (w, window) in used.chunks_exact(n).enumerate() {
        // The inputs are positions 0..n-1: the last token is only a target.
        let mut input = window[..n - 1].to_vec();
        if let Some(b) = opts.bos {
            input[0] = b;
        }
        let mut state = model.new_state()?;
        let mut step = |tokens: &[u32], logits: Logits| {
            let mut chunk = [Chunk { state: &mut state, tokens, logits }];
            model.step(&mut chunk, &mut stats).pop().expect("one result per chunk")
        };
        // The unscored half only fills the state.
        for piece in input[..first].chunks(opts.batch) {
            step(piece, Logits::None)?;
        }
        let mut pos = first;
        for piece in input[first..].chunks(opts.batch) {
            let logits = step(piece, Logits::All)?;
            let vocab = logits.len() / piece.len();
            for row in logits.chunks_exact(vocab) {
                sums.add(nll(row, window[pos + 1]));
                pos += 1;
            }
        }
        progress(&WindowDone { done: w + 1, windows, ppl: sums.mean().exp() });
    }
    Ok(Perplexity {
        context: n,
        windows,
        tokens_scored: sums.count,
        ppl: sums.mean().exp(),
        ppl_stderr: sums.ppl_stderr(),
        mean_nll: sums.mean(),
        tokens_evaluated: windows * (n - 1),
        seconds: t.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_is_the_negative_log_softmax() {
        let row = [1.0f32, 2.0, 3.0];
        let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
        for t in 0..3 {
            let want = -((row[t] as f64).exp() / z).ln();
            assert!((nll(&row, t as u32) - want).abs() < 1e-12);
        }
    }

    #[test]
    fn scored_tokens_per_window() {
        let at = |context| PerplexityOptions { context, ..Default::default() }.scored_per_window();
        assert_eq!((at(3), at(4), at(5), at(16), at(512)), (1, 1, 2, 7, 255));
    }
}
