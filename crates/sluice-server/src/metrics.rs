//! Counters and histograms for `GET /metrics`, in Prometheus' text format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// A histogram with fixed upper bounds (seconds or counts), lock-free.
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations at most each bound (not cumulative; summed when written).
    counts: Vec<AtomicU64>,
    /// Sum of observations, in millionths.
    sum_micro: AtomicU64,
    total: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micro: AtomicU64::new(0),
            total: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, v: f64) {
        let i = self.bounds.iter().position(|&b| v <= b).unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_micro.fetch_add((v.max(0.0) * 1e6) as u64, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut acc = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            acc += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {acc}");
        }
        acc += self.counts[self.bounds.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {acc}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_micro.load(Ordering::Relaxed) as f64 * 1e-6);
        let _ = writeln!(out, "{name}_count {}", self.total.load(Ordering::Relaxed));
    }
}

const SECONDS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const ROWS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// Everything the server counts.
pub struct Metrics {
    pub requests: AtomicU64,
    /// Requests refused before queueing (bad input, auth, busy).
    pub rejected: AtomicU64,
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub cancelled: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub queue_depth: AtomicU64,
    pub running: AtomicU64,
    pub steps: AtomicU64,
    /// Rows of each step (prompt tokens and decode tokens).
    pub step_rows: Histogram,
    /// Sequences in each step.
    pub step_seqs: Histogram,
    /// From a request reaching the scheduler to its first token.
    pub ttft: Histogram,
    /// Between a sequence's consecutive tokens.
    pub itl: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        let z = || AtomicU64::new(0);
        Metrics {
            requests: z(),
            rejected: z(),
            completed: z(),
            failed: z(),
            cancelled: z(),
            prompt_tokens: z(),
            cached_prompt_tokens: z(),
            generated_tokens: z(),
            queue_depth: z(),
            running: z(),
            steps: z(),
            step_rows: Histogram::new(ROWS),
            step_seqs: Histogram::new(ROWS),
            ttft: Histogram::new(SECONDS),
            itl: Histogram::new(SECONDS),
        }
    }
}

impl Metrics {
    pub fn observe_step(&self, rows: usize, seqs: usize) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.step_rows.observe(rows as f64);
        self.step_seqs.observe(seqs as f64);
    }

    /// The exposition text; `expert_hit_rate` is the expert store's, where it counts.
    pub fn render(&self, expert_hit_rate: Option<f64>) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(&mut out, "sluice_requests_total", "Generation requests received.", &self.requests);
        counter(&mut out, "sluice_requests_rejected_total", "Requests refused before queueing.", &self.rejected);
        counter(&mut out, "sluice_requests_completed_total", "Requests that ended normally.", &self.completed);
        counter(&mut out, "sluice_requests_failed_total", "Requests that ended with an error.", &self.failed);
        counter(&mut out, "sluice_requests_cancelled_total", "Requests whose client went away.", &self.cancelled);
        counter(&mut out, "sluice_prompt_tokens_total", "Prompt tokens of completed requests.", &self.prompt_tokens);
        counter(
            &mut out,
            "sluice_prompt_tokens_cached_total",
            "Prompt tokens served from a kept sequence instead of computed.",
            &self.cached_prompt_tokens,
        );
        counter(&mut out, "sluice_generation_tokens_total", "Tokens generated.", &self.generated_tokens);
        counter(&mut out, "sluice_steps_total", "Batched model steps.", &self.steps);
        gauge(&mut out, "sluice_queue_depth", "Requests waiting for a place in the batch.", {
            self.queue_depth.load(Ordering::Relaxed) as f64
        });
        gauge(&mut out, "sluice_running_sequences", "Sequences in the running batch.", {
            self.running.load(Ordering::Relaxed) as f64
        });
        if let Some(r) = expert_hit_rate {
            gauge(&mut out, "sluice_expert_cache_hit_rate", "Routed experts found in the expert cache.", r);
        }
        self.step_rows.write(&mut out, "sluice_step_rows", "Rows (tokens) computed per step.");
        self.step_seqs.write(&mut out, "sluice_batch_size", "Sequences per step.");
        self.ttft.write(&mut out, "sluice_time_to_first_token_seconds", "Queue to first generated token.");
        self.itl.write(&mut out, "sluice_time_per_output_token_seconds", "Between consecutive generated tokens.");
        out
    }
}
