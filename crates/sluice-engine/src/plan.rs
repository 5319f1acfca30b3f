//! The placement planner: where each part of a model lives (the resident weights in
//! sluice's memory or mapped from the file; the routed experts resident, mapped, or
//! streamed through a cache of some size) and how fast it will then run here.
//!
//! [`place`] turns what was asked (with `auto` left open) into a [`Placement`] from
//! the model's sizes and the memory available; `run`, `bench` and the server take
//! their `auto` choices from it. [`predict`] estimates decode and prefill speed from
//! a [`Profile`] of what one token reads and computes and a [`Machine`] of measured
//! rates: memory read bandwidth, the kernels' rate per stored type, a matrix
//! product's fixed cost, and the disk's O_DIRECT bandwidth; expert-cache hit rates
//! come from a routing histogram when one is given (uniform routing otherwise).

use std::time::{Duration, Instant};

use serde::Serialize;
use sluice_core::{DType, Error, MatRef, Precision, Result};
use sluice_experts::{CacheBudget, ExpertLayout, Residency, RoutingHistogram, human_bytes};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

/// Where the weights other than routed experts live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightsPlace {
    /// Read into sluice's own memory at load (on huge pages where the OS has them).
    Memory,
    /// Used in place in the file's page-cache pages.
    Mapped,
}

/// What was asked; `None` leaves a choice to the planner (`auto`).
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub residency: Option<Residency>,
    pub expert_cache: Option<CacheBudget>,
    pub weights: Option<WeightsPlace>,
    /// Bytes this process may take ([`crate::memory::available`]); `None` if unknown.
    pub available: Option<u64>,
    /// Bytes of experts the backend's own tier could take ([`Backend::expert_room`]);
    /// `None` for a backend without one. Where the model's other weights leave it too
    /// little for every expert, `auto` keeps the experts resident when the model fits
    /// in memory (a device copies its misses from there, page-locked) instead of in the
    /// page cache.
    ///
    /// [`Backend::expert_room`]: crate::backend::Backend::expert_room
    pub device_room: Option<u64>,
}

/// Where each part of a model lives.
#[derive(Clone, Debug)]
pub struct Placement {
    pub total_bytes: u64,
    /// Everything but the routed experts.
    pub resident_bytes: u64,
    pub expert_bytes: u64,
    pub available_bytes: Option<u64>,
    pub weights: WeightsPlace,
    pub residency: Residency,
    /// The expert cache asked for or chosen (streamed).
    pub budget: Option<CacheBudget>,
    /// Expert bytes held in memory by sluice: the cache (streamed), every expert
    /// (resident), none (mapped).
    pub cache_bytes: u64,
    /// Slots of each MoE layer's cache (streamed), or its experts.
    pub slots_per_layer: usize,
    pub experts_per_layer: usize,
    /// Why `auto` chose streamed or resident, when it did.
    pub note: Option<String>,
}

/// The share of available memory the model's bytes may take before `auto` streams
/// experts or maps the weights.
const FIT: f64 = 0.8;

/// Decides the `auto` choices of `req` for a model.
pub fn place(ckpt: &Checkpoint, layout: &ExpertLayout, req: &Request) -> Result<Placement> {
    let expert_bytes = layout.expert_bytes_total();
    let total_bytes: u64 = ckpt.tensors().iter().map(|t| t.len_bytes() as u64).sum();
    let resident_bytes = total_bytes - expert_bytes;
    let avail = req.available;
    let fits = |b: u64| avail.is_some_and(|a| (b as f64) < a as f64 * FIT);
    // Leave room for the resident weights, the KV cache and the OS.
    let default_budget = || {
        let room = avail.map_or(0, |a| (a as f64 * FIT) as u64).saturating_sub(resident_bytes + (1 << 30));
        CacheBudget::Bytes(room.max(layout.min_budget_bytes()))
    };
    let budget = req.expert_cache;
    let mut note = None;
    let residency = match req.residency {
        _ if expert_bytes == 0 => {
            if budget.is_some() {
                return Err(Error::Usage("--expert-cache: this model has no routed experts".into()));
            }
            Residency::Mapped
        }
        Some(Residency::Resident | Residency::Mapped) if budget.is_some() => {
            return Err(Error::Usage("--expert-cache goes with --residency streamed or auto".into()));
        }
        Some(r) => r,
        None if budget.is_none() && fits(total_bytes) => match req.device_room {
            Some(room) if expert_bytes > room.saturating_sub(resident_bytes) => {
                note = Some(format!(
                    "experts {} in page-locked memory; the device has room for {} of them",
                    human_bytes(expert_bytes),
                    human_bytes(room.saturating_sub(resident_bytes))
                ));
                Residency::Resident
            }
            _ => Residency::Mapped,
        },
        None => {
            note = Some(format!(
                "model {}, experts {}, memory available {}",
                human_bytes(total_bytes),
                human_bytes(expert_bytes),
                avail.map_or("unknown".into(), human_bytes)
            ));
            Residency::Streamed
        }
    };
    let budget = (residency == Residency::Streamed).then(|| budget.unwrap_or_else(default_budget));
    let experts_per_layer = layout.layers.iter().flatten().map(|l| l.experts.len()).max().unwrap_or(0);
    let (cache_bytes, slots_per_layer) = match (residency, budget) {
        (Residency::Streamed, Some(b)) => (layout.cache_bytes(b)?, layout.slots_for(b)?.into_iter().max().unwrap_or(0)),
        (Residency::Resident, _) => (expert_bytes, experts_per_layer),
        _ => (0, experts_per_layer),
    };
    let weights = req.weights.unwrap_or(if fits(resident_bytes) { WeightsPlace::Memory } else { WeightsPlace::Mapped });
    Ok(Placement {
        total_bytes,
        resident_bytes,
        expert_bytes,
        available_bytes: avail,
        weights,
        residency,
        budget,
        cache_bytes,
        slots_per_layer,
        experts_per_layer,
        note,
    })
}

/// Which part of a step a product belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Part {
    /// Attention, MLPs, routers, per-layer embeddings: every row.
    Dense,
    /// The output projection: only the rows whose logits are wanted.
    Head,
    /// A routed expert: the rows routed to it.
    Expert,
}

/// Matrix products of one stored type and shape, and how many of them a decoded
/// token runs.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Product {
    #[serde(serialize_with = "dtype_name")]
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub part: Part,
    /// Per decoded token (top-k of each MoE layer's experts).
    pub per_token: usize,
    /// Bytes of one such matrix.
    pub bytes: u64,
}

fn dtype_name<S: serde::Serializer>(d: &DType, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

/// What one token reads and computes.
#[derive(Clone, Debug, Serialize)]
pub struct Profile {
    pub products: Vec<Product>,
    pub attention: Vec<AttnShape>,
    pub moe_layers: Vec<MoeLayer>,
}

/// Attention layers of one geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub window: Option<usize>,
    pub layers: usize,
}

/// A MoE layer's routing geometry.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct MoeLayer {
    pub layer: usize,
    pub experts: usize,
    pub top_k: usize,
    /// The bytes of one expert (their average).
    pub expert_bytes: u64,
}

impl Profile {
    pub fn of(ckpt: &Checkpoint, layout: &ExpertLayout) -> Profile {
        let spec = &ckpt.spec;
        let mut products: Vec<Product> = Vec::new();
        let mut add = |dtype: DType, shape: &[usize], part: Part, n: usize, bytes: usize| {
            let [rows, cols] = shape[shape.len() - 2..] else { return };
            match products.iter_mut().find(|p| (p.dtype, p.rows, p.cols, p.part) == (dtype, rows, cols, part)) {
                Some(p) => p.per_token += n,
                None => products.push(Product { dtype, rows, cols, part, per_token: n, bytes: bytes as u64 }),
            }
        };
        let lookups: Vec<String> = [TensorKind::TokenEmbd, TensorKind::PleTokenEmbd]
            .into_iter()
            .filter_map(|k| ckpt.get(TensorId::model(k)).map(|t| t.name.clone()))
            .collect();
        let head = ckpt.get(TensorId::model(if spec.tie_word_embeddings {
            TensorKind::TokenEmbd
        } else {
            TensorKind::Output
        }));
        let mut expert_names = std::collections::HashSet::new();
        let mut moe_layers = Vec::new();
        for (l, le) in layout.layers.iter().enumerate() {
            let Some(le) = le else { continue };
            for m in [&le.experts[0].gate, &le.experts[0].up, &le.experts[0].down] {
                add(m.dtype, &m.shape, Part::Expert, le.top_k, m.len_bytes());
            }
            for e in &le.experts {
                expert_names.extend([&e.gate.name, &e.up.name, &e.down.name].map(String::clone));
            }
            let n = le.experts.len().max(1) as u64;
            let expert_bytes = le.experts.iter().map(|e| e.bytes() as u64).sum::<u64>() / n;
            moe_layers.push(MoeLayer { layer: l, experts: le.experts.len(), top_k: le.top_k, expert_bytes });
        }
        let head_name = head.map(|h| h.name.clone());
        for t in ckpt.tensors().iter().filter(|t| t.shape.len() == 2 && !expert_names.contains(&t.name)) {
            if !lookups.contains(&t.name) && Some(&t.name) != head_name.as_ref() {
                add(t.dtype, &t.shape, Part::Dense, 1, t.len_bytes());
            }
        }
        if let Some(h) = head {
            add(h.dtype, &h.shape, Part::Head, 1, h.len_bytes());
        }
        let mut attention: Vec<AttnShape> = Vec::new();
        // Linear-attention layers keep a fixed-size state: no attention over positions.
        for a in spec.layers.iter().filter(|l| l.linear.is_none()).map(|l| &l.attention) {
            let shape = AttnShape {
                n_heads: a.n_heads,
                n_kv_heads: a.n_kv_heads,
                head_dim: a.head_dim,
                window: a.window,
                layers: 1,
            };
            match attention.iter_mut().find(|s| AttnShape { layers: 1, ..**s } == shape) {
                Some(s) => s.layers += 1,
                None => attention.push(shape),
            }
        }
        Profile { products, attention, moe_layers }
    }
}

/// The measured time of one product shape.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ProductTime {
    #[serde(serialize_with = "dtype_name")]
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// Seconds of a one-row product, the weights coming from memory.
    pub decode_s: f64,
    /// Seconds of a product over `prefill_rows` rows.
    pub prefill_s: f64,
    pub prefill_rows: usize,
}

/// The measured time of one attention geometry, per layer.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct AttnTime {
    /// One row over [`PROMPT`] cached positions.
    pub decode_s: f64,
    /// [`PROMPT`] rows from an empty cache.
    pub prefill_s: f64,
}

/// This machine's measured rates.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub threads: usize,
    pub memory_read_bytes_per_s: f64,
    /// The kernels on each product shape of the model (random weights of its types).
    pub products: Vec<ProductTime>,
    /// The attention kernel on each of the model's geometries, as [`Profile::attention`].
    pub attention: Vec<AttnTime>,
    /// O_DIRECT reads of this model's experts, when measured.
    pub disk_bytes_per_s: Option<f64>,
}

/// Which activation precision each phase computes at.
#[derive(Clone, Copy, Debug)]
pub struct Precisions {
    pub decode: Precision,
    pub prefill: Precision,
}

impl Precisions {
    /// What a model with `p` uses (`None`: accurate decode, fast prefill).
    pub fn of(p: Option<Precision>) -> Precisions {
        Precisions { decode: p.unwrap_or(Precision::Accurate), prefill: p.unwrap_or(Precision::Fast) }
    }
}

/// A prompt the predictions are for: its length sets the rows of a prefill pass.
pub const PROMPT: usize = 128;

impl Machine {
    /// Times the kernels on every product shape of `profile` and measures the memory
    /// bandwidth (a second or two); `disk` is the model's expert layout when the disk
    /// rate matters (streamed experts).
    pub fn measure(profile: &Profile, precision: Precisions, disk: Option<&ExpertLayout>) -> Result<Machine> {
        let mut products = Vec::new();
        for p in &profile.products {
            // A prompt's rows: all of them for dense products, an expert's share of them.
            let rows = match p.part {
                Part::Dense | Part::Head => PROMPT,
                Part::Expert => {
                    let m = profile.moe_layers.first().expect("experts belong to a MoE layer");
                    (PROMPT * m.top_k).div_ceil(m.experts).max(1)
                }
            };
            products.push(ProductTime {
                dtype: p.dtype,
                rows: p.rows,
                cols: p.cols,
                decode_s: decode_time(p, precision.decode),
                prefill_s: prefill_time(p, rows, precision.prefill),
                prefill_rows: rows,
            });
        }
        let disk_bytes_per_s = match disk {
            Some(layout) => {
                let mut best = 0f64;
                for (threads, batch) in [(4, 8), (8, 32)] {
                    let b =
                        sluice_experts::measure_expert_reads(layout, threads, 1 << 20, batch, Duration::from_secs(2))?;
                    best = best.max(b.bytes_per_s);
                }
                Some(best)
            }
            None => None,
        };
        Ok(Machine {
            threads: rayon::current_num_threads(),
            memory_read_bytes_per_s: crate::stats::memory_read_bandwidth(1 << 29, 3),
            products,
            attention: profile.attention.iter().map(attention_time).collect(),
            disk_bytes_per_s,
        })
    }

    fn time_of(&self, p: &Product) -> &ProductTime {
        self.products
            .iter()
            .find(|t| (t.dtype, t.rows, t.cols) == (p.dtype, p.rows, p.cols))
            .expect("every product of the profile was measured")
    }
}

/// Bytes of a `rows x cols` matrix of `d`, filled with a pattern that decodes to
/// small normal numbers in every format.
fn test_matrix(d: DType, rows: usize, cols: usize) -> Vec<u8> {
    vec![0x11u8; rows * d.bytes_for(cols).expect("a whole number of blocks")]
}

/// Best seconds per call of `f` over a few trials of at least `min` each.
fn best_time(min: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let (t, mut n) = (Instant::now(), 0u32);
        while t.elapsed() < min || n < 2 {
            f();
            n += 1;
        }
        best = best.min(t.elapsed().as_secs_f64() / n as f64);
    }
    best
}

/// Seconds of a one-row product of `p`'s shape, over enough copies of the matrix
/// that they do not stay in the caches (as a decode step's weights do not).
fn decode_time(p: &Product, precision: Precision) -> f64 {
    let one = test_matrix(p.dtype, p.rows, p.cols);
    let copies = (64 << 20) / one.len() + 1;
    let mats: Vec<Vec<u8>> = (0..copies).map(|_| one.clone()).collect();
    let x = vec![0.5f32; p.cols];
    let mut out = vec![0f32; p.rows];
    let t = best_time(Duration::from_millis(60), || {
        for m in &mats {
            let w = MatRef::new(p.dtype, p.rows, p.cols, m).expect("a valid test matrix");
            sluice_cpu::matmul(w, &x, 1, &mut out, precision);
        }
    });
    t / copies as f64
}

/// Seconds of one layer's attention of geometry `a`, for a decode row and a prompt.
fn attention_time(a: &AttnShape) -> AttnTime {
    use sluice_cpu::{AttnParams, AttnSeq, KvCache, attention};
    let p = AttnParams {
        n_heads: a.n_heads,
        n_kv_heads: a.n_kv_heads,
        head_dim: a.head_dim,
        scale: 0.1,
        window: a.window,
        softcap: None,
        sinks: None,
        select: None,
    };
    let (qd, kd) = (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim);
    let kv = vec![0.25f32; PROMPT * kd];
    let mut held = KvCache::new(kd, a.window);
    held.append(&kv, &kv);
    let empty = KvCache::new(kd, a.window);
    let time = |rows: usize, cache: &KvCache| {
        let q = vec![0.5f32; rows * qd];
        let mut out = vec![0f32; rows * qd];
        let seq = [AttnSeq { first: 0, rows, cache }];
        best_time(Duration::from_millis(30), || attention(&p, &q, &kv[..rows * kd], &kv[..rows * kd], &seq, &mut out))
    };
    AttnTime { decode_s: time(1, &held), prefill_s: time(PROMPT, &empty) }
}

/// Seconds of a product of `p`'s shape over `n` rows (the weights in cache: a prompt
/// is bound by arithmetic).
fn prefill_time(p: &Product, n: usize, precision: Precision) -> f64 {
    let m = test_matrix(p.dtype, p.rows, p.cols);
    let x = vec![0.5f32; n * p.cols];
    let mut out = vec![0f32; n * p.rows];
    let w = MatRef::new(p.dtype, p.rows, p.cols, &m).expect("a valid test matrix");
    best_time(Duration::from_millis(60), || sluice_cpu::matmul(w, &x, n, &mut out, precision))
}

/// Predicted speed and where the time goes.
#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    pub decode_tok_s: f64,
    pub prefill_tok_s: f64,
    /// Per decoded token: the products on weights in memory and the attention, and
    /// expert reads from disk (streamed, they overlap the expert products).
    pub decode_memory_s: f64,
    pub decode_disk_s: f64,
    /// Expected hit rate of the expert cache in decode (streamed).
    pub decode_hit_rate: Option<f64>,
    pub decode_disk_bytes_per_token: f64,
    /// Per prompt token: the arithmetic (products and attention), and expert reads
    /// from disk (overlapped with it).
    pub prefill_compute_s: f64,
    pub prefill_disk_s: f64,
}

/// Predicts decode (after a short prompt) and prefill speed (of a [`PROMPT`]-token prompt).
pub fn predict(p: &Profile, at: &Placement, m: &Machine, hist: Option<&RoutingHistogram>) -> Prediction {
    let mut decode_memory_s = 0.0;
    let mut decode_experts_s = 0.0;
    let mut prefill_compute_s = 0.0;
    for (a, t) in p.attention.iter().zip(&m.attention) {
        decode_memory_s += a.layers as f64 * t.decode_s;
        prefill_compute_s += a.layers as f64 * t.prefill_s / PROMPT as f64;
    }
    for pr in &p.products {
        let t = m.time_of(pr);
        decode_memory_s += pr.per_token as f64 * t.decode_s;
        if pr.part == Part::Expert {
            decode_experts_s += pr.per_token as f64 * t.decode_s;
        }
        // A prompt runs the dense products on all its rows at once, each expert on the
        // rows routed to it, and the head only on its last row.
        prefill_compute_s += match pr.part {
            Part::Dense | Part::Expert => pr.per_token as f64 * t.prefill_s / t.prefill_rows as f64,
            Part::Head => 0.0,
        };
    }

    // Experts that are not in memory come from disk: streamed ones through sluice's
    // cache, mapped ones through the page cache when the model does not fit in it.
    let page_cache = at.available_bytes.map(|a| (a as f64 * FIT) as u64).unwrap_or(u64::MAX);
    let slots = match at.residency {
        Residency::Streamed => Some(at.slots_per_layer),
        Residency::Mapped if at.total_bytes > page_cache && !p.moe_layers.is_empty() => {
            let per_expert = at.expert_bytes as f64 / (p.moe_layers.len() * at.experts_per_layer).max(1) as f64;
            let room = page_cache.saturating_sub(at.resident_bytes) as f64;
            Some((room / per_expert / p.moe_layers.len() as f64) as usize)
        }
        _ => None,
    };
    let disk_bps = m.disk_bytes_per_s.unwrap_or(f64::INFINITY);
    let (mut hits, mut wanted, mut miss_bytes, mut chunk_miss_bytes) = (0.0, 0.0, 0.0, 0.0);
    if let Some(slots) = slots {
        for &MoeLayer { layer, experts: n, top_k: k, expert_bytes: bytes } in &p.moe_layers {
            let probs = popularity(hist, layer, n, k);
            let h = lru_hit_rate(&probs, slots);
            hits += h * k as f64;
            wanted += k as f64;
            miss_bytes += (1.0 - h) * k as f64 * bytes as f64;
            // A prompt touches most experts of a layer; those not cached are read once.
            let touched: f64 = probs.iter().map(|&q| 1.0 - (1.0 - q).powf(PROMPT as f64)).sum();
            let cached = slots.min(n) as f64 / n as f64;
            chunk_miss_bytes += touched * (1.0 - cached) * bytes as f64;
        }
    }
    let decode_disk_s = miss_bytes / disk_bps;
    let prefill_disk_s = chunk_miss_bytes / disk_bps / PROMPT as f64;
    // A streamed layer computes its cached experts while its misses are read, so
    // the reads overlap the expert products (not the attention and dense products
    // around them, which wait for the layer's result). A mapped model's misses are
    // page faults inside the products: they add up.
    let decode_s = match at.residency {
        Residency::Streamed => decode_memory_s - decode_experts_s + decode_experts_s.max(decode_disk_s),
        _ => decode_memory_s + decode_disk_s,
    };
    Prediction {
        decode_tok_s: 1.0 / decode_s,
        prefill_tok_s: 1.0 / prefill_compute_s.max(prefill_disk_s),
        decode_memory_s,
        decode_disk_s,
        decode_hit_rate: (wanted > 0.0).then(|| hits / wanted),
        decode_disk_bytes_per_token: miss_bytes,
        prefill_compute_s,
        prefill_disk_s,
    }
}

/// Each expert's chance of being among a token's `k` (summing to `k`): from the
/// histogram's counts for the layer, or uniform.
fn popularity(hist: Option<&RoutingHistogram>, layer: usize, n: usize, k: usize) -> Vec<f64> {
    let counts = hist.and_then(|h| h.layers.get(layer)).filter(|c| c.len() == n && c.iter().any(|&x| x > 0));
    match counts {
        Some(c) => {
            let total: u64 = c.iter().sum();
            c.iter().map(|&x| (x as f64 / total as f64 * k as f64).min(1.0)).collect()
        }
        None => vec![k as f64 / n as f64; n],
    }
}

/// Hit rate of an LRU cache of `slots` under independent requests with per-step
/// probabilities `probs`, by Che's approximation: an expert is cached if it was
/// asked for within the cache's characteristic time `t`, where `t` fills the cache.
pub fn lru_hit_rate(probs: &[f64], slots: usize) -> f64 {
    let total: f64 = probs.iter().sum();
    if slots >= probs.len() || total <= 0.0 {
        return 1.0;
    }
    let filled = |t: f64| probs.iter().map(|&p| 1.0 - (-p * t).exp()).sum::<f64>();
    let (mut lo, mut hi) = (0.0, 1.0);
    while filled(hi) < slots as f64 && hi < 1e12 {
        hi *= 2.0;
    }
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if filled(mid) < slots as f64 { lo = mid } else { hi = mid }
    }
    probs.iter().map(|&p| p * (1.0 - (-p * hi).exp())).sum::<f64>() / total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_hit_rate_of_uniform_and_skewed_routing() {
        // Uniform: the cache's share of the experts.
        let uniform = vec![8.0 / 128.0; 128];
        assert!((lru_hit_rate(&uniform, 32) - 0.25).abs() < 1e-6);
        assert_eq!(lru_hit_rate(&uniform, 128), 1.0);
        // Zipf-skewed popularity hits more than uniform at the same size, and more
        // slots hit more.
        let z: Vec<f64> = (1..=128).map(|i| 1.0 / i as f64).collect();
        let s: f64 = z.iter().sum();
        let zipf: Vec<f64> = z.iter().map(|x| x / s * 8.0).collect();
        let (h16, h32) = (lru_hit_rate(&zipf, 16), lru_hit_rate(&zipf, 32));
        assert!(h16 > 16.0 / 128.0 && h32 > h16 && h32 < 1.0, "{h16} {h32}");
    }
}
