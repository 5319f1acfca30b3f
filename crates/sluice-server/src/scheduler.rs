//! Continuous batching: one thread owns the model's steps. Each step it admits queued
//! requests into the running batch (up to `parallel` sequences), feeds every decoding
//! sequence its last token and the prefilling ones a chunk of their prompts within a
//! row budget (so a long prompt never stalls the others for more than one chunk),
//! samples, streams text out, and retires what has finished or whose client has gone.
//!
//! A prompt runs as `sluice run` runs it ([`sluice_engine::Model::prefill`]): all but
//! its last token in chunks of several tokens, then the last token alone, so that
//! greedy output through the server is the same as `sluice run` at the same
//! `--precision` (`serve` takes fast for auto: its steps carry many rows).

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use sluice_engine::{Backend, Chunk, Logits, Model, Sampler, SamplerConfig, SeqState, StepStats};
use sluice_tokenizer::{StopText, StreamDecoder, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use crate::grammar::Grammar;
use crate::metrics::Metrics;
use crate::prefix::PrefixCache;

/// What a request asks of generation.
#[derive(Clone, Debug)]
pub struct GenParams {
    /// Most tokens to generate (already within the context).
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Texts that end the reply where they appear (not shown).
    pub stop: Vec<String>,
    /// Log-probabilities of each chosen token, with this many alternatives.
    pub logprobs: Option<usize>,
    /// Output constrained to a grammar (JSON following a schema).
    pub grammar: Option<Grammar>,
    /// Go on past end-of-turn tokens (vLLM's and llama.cpp's `ignore_eos`, for
    /// benchmarks that want a fixed length).
    pub ignore_eos: bool,
}

/// One request for the scheduler.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: GenParams,
    pub events: UnboundedSender<Event>,
}

/// A token's log-probability and the most likely alternatives at its position.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// What the scheduler sends back for a job, in order: `Token`s, then one `Done` or
/// one `Failed`.
#[derive(Debug)]
pub enum Event {
    /// A generated token and the text it lets through (possibly empty: text that may
    /// begin a stop string, or an incomplete character, is held back).
    Token {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Done(Finish),
    Failed(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-turn token.
    Eos,
    /// A stop text (its index in [`GenParams::stop`]).
    StopText(usize),
    /// `max_tokens` or the context.
    Length,
}

/// How a sequence ends.
enum End {
    Finished(FinishReason),
    /// Generation cannot go on (the grammar allows no token): the request fails.
    Failed(String),
}

#[derive(Clone, Copy, Debug)]
pub struct Finish {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens that a held sequence had already computed.
    pub cached_tokens: usize,
    pub prefill_s: f64,
    pub decode_s: f64,
}

/// Why a job was not queued.
#[derive(Debug)]
pub enum Refused {
    /// The batch and the queue are full; try again later.
    Busy { queued: usize },
    /// The scheduler has stopped (the model failed in a way it could not recover from).
    Stopped,
}

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Sequences in the running batch.
    pub parallel: usize,
    /// Requests waiting beyond those.
    pub max_queue: usize,
    /// Rows one step computes at most (prompt chunks fill what decode rows leave).
    pub step_rows: usize,
    /// KV bytes of finished sequences kept for prefix reuse.
    pub prefix_cache_bytes: usize,
}

struct Queue {
    waiting: VecDeque<Job>,
    running: usize,
    stopped: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    limits: Limits,
    metrics: Arc<Metrics>,
}

/// The handle the HTTP side holds: it queues jobs.
#[derive(Clone)]
pub struct Scheduler {
    shared: Arc<Shared>,
}

impl Scheduler {
    /// Starts the scheduler's thread over `model`.
    pub fn start<B: Backend>(
        model: Arc<Model<B>>,
        tok: Arc<Tokenizer>,
        stop_ids: Vec<u32>,
        limits: Limits,
        metrics: Arc<Metrics>,
    ) -> Scheduler {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue { waiting: VecDeque::new(), running: 0, stopped: false }),
            wake: Condvar::new(),
            limits,
            metrics,
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("sluice-scheduler".into())
            .spawn(move || {
                let mut worker = Worker { model: &model, tok: &tok, stop_ids, shared: &s, stats: StepStats::default() };
                worker.run();
            })
            .expect("the scheduler thread starts");
        Scheduler { shared }
    }

    /// Queues a job, or says why not.
    pub fn submit(&self, job: Job) -> Result<(), Refused> {
        let mut q = self.shared.queue.lock().unwrap();
        if q.stopped {
            return Err(Refused::Stopped);
        }
        let free = self.shared.limits.parallel.saturating_sub(q.running);
        if q.waiting.len() >= free + self.shared.limits.max_queue {
            return Err(Refused::Busy { queued: q.waiting.len() });
        }
        q.waiting.push_back(job);
        self.shared.metrics.queue_depth.store(q.waiting.len() as u64, Ordering::Relaxed);
        drop(q);
        self.shared.wake.notify_one();
        Ok(())
    }
}

/// Where a sequence is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Feeding its prompt; the count is how many prompt tokens its state holds.
    Prefill(usize),
    /// Feeding the token it sampled last.
    Decode(u32),
}

/// One running request.
struct Seq<'t, B: Backend> {
    job: Job,
    state: SeqState<B>,
    phase: Phase,
    /// The tokens its state holds, for prefix reuse when it ends.
    held: Vec<u32>,
    cached: usize,
    generated: usize,
    sampler: Sampler,
    grammar: Option<Grammar>,
    decoder: StreamDecoder<'t>,
    stop: StopText,
    started: Instant,
    first_token: Option<Instant>,
    last_token: Instant,
}

/// What becomes of a retired sequence's state.
enum Keep {
    /// Its step failed: the state is dropped.
    Drop,
    /// Kept in the prefix cache for a later prompt that continues it.
    Offer,
}

/// What one sequence feeds this step.
#[derive(Clone, Copy)]
enum Feed {
    /// Prompt tokens `from..to`, no logits.
    Prompt { from: usize, to: usize },
    /// The prompt's last token, or a decode token: logits to sample from.
    Sample,
}

struct Worker<'a, B: Backend> {
    model: &'a Model<B>,
    tok: &'a Tokenizer,
    stop_ids: Vec<u32>,
    shared: &'a Shared,
    stats: StepStats,
}

impl<'a, B: Backend> Worker<'a, B> {
    fn run(&mut self) {
        let mut active: Vec<Seq<'a, B>> = Vec::new();
        let mut prefixes = PrefixCache::new(self.shared.limits.prefix_cache_bytes);
        loop {
            self.admit(&mut active, &mut prefixes);
            if active.is_empty() {
                continue;
            }
            // A client that went away stops its sequence here, within one step.
            // The batch is counted before the cancellation, so that whoever sees the
            // cancellation also sees the batch without it.
            let before = active.len();
            active.retain(|s| !s.job.events.is_closed());
            if active.len() < before {
                self.set_running(active.len());
                self.shared.metrics.cancelled.fetch_add((before - active.len()) as u64, Ordering::Relaxed);
            }
            if active.is_empty() {
                continue;
            }
            let stepped = std::panic::catch_unwind(AssertUnwindSafe(|| self.step(&mut active, &mut prefixes)));
            if stepped.is_err() {
                // A panic inside the model: end every running request with an error and
                // go on serving (their states are dropped with them).
                for s in active.drain(..) {
                    let _ = s.job.events.send(Event::Failed("internal error: the model step panicked".into()));
                }
                self.shared.metrics.failed.fetch_add(1, Ordering::Relaxed);
            }
            self.set_running(active.len());
        }
    }

    fn set_running(&self, n: usize) {
        self.shared.queue.lock().unwrap().running = n;
        self.shared.metrics.running.store(n as u64, Ordering::Relaxed);
    }

    /// Moves queued jobs into the batch while there is room; waits when there is
    /// nothing to do.
    fn admit(&self, active: &mut Vec<Seq<'a, B>>, prefixes: &mut PrefixCache<B>) {
        let mut q = self.shared.queue.lock().unwrap();
        while active.is_empty() && q.waiting.is_empty() {
            q.running = 0;
            q = self.shared.wake.wait_timeout(q, Duration::from_millis(500)).unwrap().0;
        }
        while active.len() < self.shared.limits.parallel {
            let Some(job) = q.waiting.pop_front() else { break };
            if job.events.is_closed() {
                self.shared.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            active.extend(self.start(job, prefixes));
        }
        q.running = active.len();
        self.shared.metrics.running.store(active.len() as u64, Ordering::Relaxed);
        self.shared.metrics.queue_depth.store(q.waiting.len() as u64, Ordering::Relaxed);
    }

    /// A job's sequence, starting after the longest kept sequence its prompt
    /// continues; `None` when it cannot start (the job is told why).
    fn start(&self, job: Job, prefixes: &mut PrefixCache<B>) -> Option<Seq<'a, B>> {
        let fail = |job: Job, e: sluice_core::Error| {
            self.shared.metrics.failed.fetch_add(1, Ordering::Relaxed);
            let _ = job.events.send(Event::Failed(e.to_string()));
            None
        };
        let (state, held) = match prefixes.take(&self.model.be, &job.prompt) {
            Some(hit) => hit,
            None => match self.model.new_state() {
                Ok(s) => (s, Vec::new()),
                Err(e) => return fail(job, e),
            },
        };
        let decoder = match StreamDecoder::with_context(self.tok, &job.prompt, true) {
            Ok(d) => d,
            Err(e) => return fail(job, e),
        };
        let cached = held.len();
        self.shared.metrics.cached_prompt_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        let now = Instant::now();
        Some(Seq {
            sampler: Sampler::new(job.params.sampler),
            grammar: job.params.grammar.clone(),
            stop: StopText::new(job.params.stop.clone()),
            phase: Phase::Prefill(cached),
            held,
            cached,
            generated: 0,
            state,
            decoder,
            started: now,
            first_token: None,
            last_token: now,
            job,
        })
    }

    /// What each sequence feeds this step: every decoding sequence one token, then the
    /// prefilling ones, oldest first, chunks of their prompts within the rows left.
    fn plan(&self, active: &[Seq<'a, B>]) -> Vec<Option<Feed>> {
        let decoding = active.iter().filter(|s| matches!(s.phase, Phase::Decode(_))).count();
        // Prompts always get some rows, so a full batch of decoders cannot starve them.
        let mut room = self.shared.limits.step_rows.saturating_sub(decoding).max(16);
        active
            .iter()
            .map(|s| match s.phase {
                Phase::Decode(_) => Some(Feed::Sample),
                Phase::Prefill(fed) => {
                    // All but the last prompt token go in chunks of several tokens; a
                    // chunk of one would run at decode precision and change the bits
                    // against `sluice run` (which feeds that part as one chunk).
                    let body = s.job.prompt.len() - 1;
                    if room == 0 {
                        return None;
                    }
                    if fed == body {
                        room -= 1;
                        return Some(Feed::Sample);
                    }
                    let left = body - fed;
                    let mut take = left.min(room);
                    if left - take == 1 {
                        // Not a lone token left for the next step.
                        take -= 1;
                    }
                    if take == 1 && left > 1 {
                        take = 0;
                    }
                    (take > 0).then(|| {
                        room -= take;
                        Feed::Prompt { from: fed, to: fed + take }
                    })
                }
            })
            .collect()
    }

    fn step(&mut self, active: &mut Vec<Seq<'a, B>>, prefixes: &mut PrefixCache<B>) {
        let feeds = self.plan(active);
        let rows: usize = feeds
            .iter()
            .map(|f| match f {
                Some(Feed::Prompt { from, to }) => to - from,
                Some(Feed::Sample) => 1,
                None => 0,
            })
            .sum();
        let results = {
            let mut chunks = Vec::new();
            for (s, f) in active.iter_mut().zip(&feeds) {
                let Some(f) = f else { continue };
                let (tokens, logits): (&[u32], Logits) = match (*f, &s.phase) {
                    (Feed::Prompt { from, to }, _) => (&s.job.prompt[from..to], Logits::None),
                    (Feed::Sample, Phase::Prefill(fed)) => (&s.job.prompt[*fed..], Logits::Last),
                    (Feed::Sample, Phase::Decode(t)) => (std::slice::from_ref(t), Logits::Last),
                };
                chunks.push(Chunk { state: &mut s.state, tokens, logits });
            }
            self.model.step(&mut chunks, &mut self.stats)
        };
        self.shared.metrics.observe_step(rows, results.len());

        let mut results = results.into_iter();
        let mut finished = Vec::new();
        for (i, f) in feeds.iter().enumerate() {
            let Some(f) = f else { continue };
            let s = &mut active[i];
            match results.next().expect("one result per chunk") {
                Err(e) => finished.push((i, End::Failed(e.to_string()), Keep::Drop)),
                Ok(mut logits) => match (*f, s.phase) {
                    (Feed::Prompt { from, to }, _) => {
                        s.held.extend(&s.job.prompt[from..to]);
                        s.phase = Phase::Prefill(to);
                    }
                    (Feed::Sample, phase) => {
                        match phase {
                            Phase::Prefill(fed) => s.held.extend(&s.job.prompt[fed..]),
                            Phase::Decode(t) => s.held.push(t),
                        }
                        if let Some(end) = self.sample(s, &mut logits) {
                            finished.push((i, end, Keep::Offer));
                        }
                    }
                },
            }
        }
        // Retire from the back so the indices stay valid, and count the batch before
        // any client hears that its request ended: one that reads the metrics right
        // after its answer must not find its own sequence still running.
        let mut retired = Vec::with_capacity(finished.len());
        for (i, end, keep) in finished.into_iter().rev() {
            retired.push((active.remove(i), end, keep));
        }
        self.set_running(active.len());
        // Sequences whose step succeeded offer their state for a later prompt that
        // continues them.
        for (mut s, end, keep) in retired.into_iter().rev() {
            self.finish(&mut s, end);
            if let Keep::Offer = keep {
                let bytes = s.state.kv_bytes(&self.model.be);
                prefixes.put(s.held, s.state, bytes);
            }
        }
    }

    /// Samples the next token from `logits`, streams its text, and says whether the
    /// sequence has ended.
    fn sample(&self, s: &mut Seq<'a, B>, logits: &mut [f32]) -> Option<End> {
        let now = Instant::now();
        if let Some(Err(e)) = s.grammar.as_mut().map(|g| g.mask(logits, &self.stop_ids)) {
            return Some(End::Failed(e));
        }
        let logits = &*logits;
        let id = s.sampler.sample(logits);
        let logprob = s.job.params.logprobs.map(|n| self.logprob(logits, id, n));
        s.generated += 1;
        match s.first_token {
            None => {
                s.first_token = Some(now);
                self.shared.metrics.ttft.observe(now.duration_since(s.started).as_secs_f64());
            }
            Some(_) => self.shared.metrics.itl.observe(now.duration_since(s.last_token).as_secs_f64()),
        }
        s.last_token = now;
        self.shared.metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
        if !s.job.params.ignore_eos && self.stop_ids.contains(&id) {
            s.generated -= 1;
            return Some(End::Finished(FinishReason::Eos));
        }
        // The id came from the model's own vocabulary, which the decoder knows.
        let text = s.decoder.push(id).unwrap_or_default();
        let complete = match s.grammar.as_mut().map(|g| g.advance(id)) {
            Some(Err(e)) => return Some(End::Failed(e)),
            Some(Ok(done)) => done,
            None => false,
        };
        let (shown, stopped) = s.stop.push(&text);
        let _ = s.job.events.send(Event::Token { text: shown, logprob });
        if complete {
            return Some(End::Finished(FinishReason::Eos));
        }
        if stopped {
            let i = s.job.params.stop.iter().position(|t| Some(t.as_str()) == s.stop.matched()).unwrap_or(0);
            return Some(End::Finished(FinishReason::StopText(i)));
        }
        let room = self.model.max_context.saturating_sub(s.state.len());
        if s.generated >= s.job.params.max_tokens || room == 0 {
            return Some(End::Finished(FinishReason::Length));
        }
        s.phase = Phase::Decode(id);
        None
    }

    /// The log-probability of `id` under `logits` and the `n` most likely tokens'.
    fn logprob(&self, logits: &[f32], id: u32, n: usize) -> TokenLogprob {
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
        let log_z = max as f64 + sum.ln();
        let lp = |i: usize| (logits[i] as f64 - log_z) as f32;
        let text = |i: u32| self.tok.decode(&[i], false).unwrap_or_default();
        let mut top: Vec<usize> = Vec::new();
        if n > 0 {
            let mut idx: Vec<usize> = (0..logits.len()).collect();
            let k = n.min(idx.len());
            idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            idx.truncate(k);
            idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            top = idx;
        }
        TokenLogprob {
            token: text(id),
            logprob: lp(id as usize),
            top: top.into_iter().map(|i| (text(i as u32), lp(i))).collect(),
        }
    }

    /// Sends what was held back and the end of the request.
    fn finish(&self, s: &mut Seq<'a, B>, end: End) {
        let reason = match end {
            End::Finished(r) => r,
            End::Failed(e) => {
                self.shared.metrics.failed.fetch_add(1, Ordering::Relaxed);
                let _ = s.job.events.send(Event::Failed(e));
                return;
            }
        };
        if !matches!(reason, FinishReason::StopText(_)) {
            let rest = s.decoder.finish().unwrap_or_default();
            let (mut text, stopped) = s.stop.push(&rest);
            if !stopped {
                text += &s.stop.finish();
            }
            if !text.is_empty() {
                let _ = s.job.events.send(Event::Token { text, logprob: None });
            }
        }
        self.shared.metrics.completed.fetch_add(1, Ordering::Relaxed);
        self.shared.metrics.prompt_tokens.fetch_add(s.job.prompt.len() as u64, Ordering::Relaxed);
        let first = s.first_token.unwrap_or(s.last_token);
        let _ = s.job.events.send(Event::Done(Finish {
            reason,
            prompt_tokens: s.job.prompt.len(),
            completion_tokens: s.generated,
            cached_tokens: s.cached,
            prefill_s: first.duration_since(s.started).as_secs_f64(),
            decode_s: s.last_token.duration_since(first).as_secs_f64(),
        }));
    }
}
