//! Timings and counters of a session, printed by `--stats` and `bench --json`.

use std::time::{Duration, Instant};

use serde::Serialize;

/// Time spent per phase of the forward pass, summed over steps.
#[derive(Clone, Debug, Default)]
pub struct Timers {
    pub embed: Duration,
    pub attention: Duration,
    pub router: Duration,
    pub expert_wait: Duration,
    pub expert_compute: Duration,
    pub mlp: Duration,
    pub lm_head: Duration,
}

impl Timers {
    /// Runs `f`, adding its time to the field `pick` selects.
    pub fn time<T>(&mut self, pick: fn(&mut Timers) -> &mut Duration, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        *pick(self) += t.elapsed();
        r
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct PhaseMs {
    pub embed_ms: f64,
    pub attention_ms: f64,
    pub router_ms: f64,
    pub expert_wait_ms: f64,
    pub expert_compute_ms: f64,
    pub mlp_ms: f64,
    pub lm_head_ms: f64,
}

impl From<&Timers> for PhaseMs {
    fn from(t: &Timers) -> Self {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        PhaseMs {
            embed_ms: ms(t.embed),
            attention_ms: ms(t.attention),
            router_ms: ms(t.router),
            expert_wait_ms: ms(t.expert_wait),
            expert_compute_ms: ms(t.expert_compute),
            mlp_ms: ms(t.mlp),
            lm_head_ms: ms(t.lm_head),
        }
    }
}

/// Peak resident set size of this process, in bytes (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Bytes this process has caused to be read from storage (Linux `read_bytes` in
/// `/proc/self/io`): O_DIRECT reads, and the page-ins that mapped residency leaves
/// to the kernel, which the expert store cannot count itself.
pub fn storage_read_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/io").ok()?;
    let line = s.lines().find(|l| l.starts_with("read_bytes:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Measures how fast this machine reads memory with the kernels' thread pool: the
/// roofline for resident decode, where every weight byte is read once per token.
/// Reads `bytes` (well above the last-level cache) `reps` times; returns the best
/// rate in bytes per second.
pub fn memory_read_bandwidth(bytes: usize, reps: usize) -> f64 {
    use rayon::prelude::*;
    let words = bytes / 8;
    let buf: Vec<u64> = (0..words as u64).into_par_iter().map(|i| i.wrapping_mul(0x9E37_79B9)).collect();
    let mut best = 0f64;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let sum = buf
            .par_chunks(1 << 16)
            .map(|c| {
                // Eight independent lanes so the loop vectorises and is load-bound.
                let mut acc = [0u64; 8];
                for w in c.chunks_exact(8) {
                    for l in 0..8 {
                        acc[l] = acc[l].wrapping_add(w[l]);
                    }
                }
                acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
            })
            .reduce(|| 0, u64::wrapping_add);
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        best = best.max((words * 8) as f64 / dt);
    }
    best
}
