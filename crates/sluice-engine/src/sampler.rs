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

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if self.cfg.top_k > 0 {
            idx.truncate(self.cfg.top_k);
        }
        let t = self.cfg.temperature as f64;
        let max = logits[idx[0]] as f64;
        let mut p: Vec<f64> = idx.iter().map(|&i| ((logits[i] as f64 - max) / t).exp()).collect();
        let total: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= total);
        // Smallest prefix whose mass reaches top_p.
        if self.cfg.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = p.len();
            for (i, x) in p.iter().enumerate() {
                acc += x;
                if acc >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            p.truncate(keep);
            idx.truncate(keep);
        }
        let total: f64 = p.iter().sum();
        let mut r = self.rng.next_f64() * total;
        for (i, x) in p.iter().enumerate() {
            r -= x;
            if r < 0.0 {
                return idx[i] as u32;
            }
        }
        idx[p.len() - 1] as u32
    }
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
