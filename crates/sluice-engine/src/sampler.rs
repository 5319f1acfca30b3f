//! Next-token choice: greedy at temperature 0, otherwise temperature, top-k and
//! top-p over a seeded generator, so a seed reproduces a run.

/// SplitMix64: small, fast, and good enough to draw tokens; no dependency.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Clone, Copy, Debug)]
pub struct SamplerConfig {
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1 means no top-p cut.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 0 }
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        Sampler { cfg, rng: Rng(cfg.seed) }
    }

    /// Draws the next token. Only as many candidates are put in order as the cuts
    /// need (top-k by selection; top-p by growing the sorted prefix until it holds the
    /// mass), never the whole vocabulary: a full sort of 150k logits took longer than
    /// a decode step of a small model.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 {
            return argmax(logits);
        }
        // Each candidate's weight `exp((logit - max) / t)` is computed once.
        let mut cands: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if self.cfg.top_k > 0 && self.cfg.top_k < cands.len() {
            cands.select_nth_unstable_by(self.cfg.top_k - 1, by_logit);
            cands.truncate(self.cfg.top_k);
        }
        let t = self.cfg.temperature as f64;
        let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut cands: Vec<Cand> =
            cands.into_iter().map(|(id, l)| Cand { id, logit: l, weight: ((l as f64 - max) / t).exp() }).collect();
        let order = |a: &Cand, b: &Cand| b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id));
        if self.cfg.top_p < 1.0 {
            // The smallest prefix, in order, whose mass reaches top_p.
            let need = self.cfg.top_p as f64 * cands.iter().map(|c| c.weight).sum::<f64>();
            let mut m = 64.min(cands.len());
            loop {
                if m < cands.len() {
                    cands.select_nth_unstable_by(m - 1, order);
                }
                cands[..m].sort_unstable_by(order);
                let mut acc = 0.0;
                let keep = cands[..m].iter().position(|c| {
                    acc += c.weight;
                    acc >= need
                });
                if let Some(k) = keep {
                    cands.truncate(k + 1);
                    break;
                }
                if m == cands.len() {
                    break;
                }
                m = (m * 4).min(cands.len());
            }
        }
        let kept: f64 = cands.iter().map(|c| c.weight).sum();
        let mut r = self.rng.next_f64() * kept;
        let mut last = cands[0].id;
        for c in &cands {
            r -= c.weight;
            if r < 0.0 {
                return c.id;
            }
            if c.weight > 0.0 {
                last = c.id;
            }
        }
        // Rounding left a little of r: the last token that had any weight (never one
        // a grammar ruled out, whose weight is zero).
        last
    }
}

/// A token that may be drawn, with its weight.
#[derive(Clone, Copy)]
struct Cand {
    id: u32,
    logit: f32,
    weight: f64,
}

/// Index of the largest logit, lowest index on ties.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded() {
        let logits = [0.1, 2.0, 1.9, -1.0];
        let mut g = Sampler::new(SamplerConfig { temperature: 0.0, ..Default::default() });
        assert_eq!(g.sample(&logits), 1);
        let cfg = SamplerConfig { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 7 };
        let a: Vec<u32> = {
            let mut s = Sampler::new(cfg);
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(cfg);
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.contains(&1) && a.contains(&2));
        // top_k 1 is greedy whatever the temperature.
        let mut k1 = Sampler::new(SamplerConfig { top_k: 1, ..cfg });
        assert!((0..20).all(|_| k1.sample(&logits) == 1));
        // top_p small keeps only the most likely token.
        let mut p = Sampler::new(SamplerConfig { top_p: 0.1, ..cfg });
        assert!((0..20).all(|_| p.sample(&logits) == 1));
    }
}
