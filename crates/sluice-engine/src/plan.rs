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

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use sluice_core::{DType, Error, KvFormat, KvLayout, ModelSpec, Precision, Result};
use sluice_experts::{CacheBudget, ExpertLayout, Policy, Residency, RoutingHistogram, human_bytes};
use sluice_formats::{Checkpoint, MappedFile, TensorId, TensorKind, TensorView};

use crate::backend::{AttnOp, Backend, DeviceRates};
use crate::batch::{Batch, RowPrecision, SeqRows};
use sluice_experts::ExpertStore;

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
    pub layers: usize,
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

impl AttnShape {
    /// A layer's KV cache of this shape in `kv`'s format (a sliding window's ring at
    /// least 16 bits, as the engine keeps it).
    fn kv_layout(&self, kv: KvFormat) -> KvLayout<'static> {
        let format = if self.window.is_some() { kv.for_sliding() } else { kv };
        KvLayout { window: self.window, ..KvLayout::plain(self.n_kv_heads * self.head_dim, self.head_dim, format) }
    }
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
        Profile { layers: spec.n_layers(), products, attention, moe_layers }
    }
}

/// The measured time of one product shape.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ProductTime {
    #[serde(serialize_with = "dtype_name")]
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// Seconds of a one-row product, the weights coming from memory (an expert's
    /// share of a layer's top-k products run together, as the experts of a step are).
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

/// The measured rates of the machine a backend computes on.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub threads: usize,
    pub memory_read_bytes_per_s: f64,
    /// The backend's kernels on each product shape of the model (random weights of
    /// its types, in the backend's memory).
    pub products: Vec<ProductTime>,
    /// The attention kernel on each of the model's geometries, as [`Profile::attention`].
    pub attention: Vec<AttnTime>,
    /// A MoE layer's routing, expert fetch and expert products as the backend runs
    /// them (the first MoE layer's, for every one): in place of the expert products
    /// of `products`, which a backend runs together, one launch for a layer's top-k on
    /// a GPU.
    pub experts: Option<ExpertsTime>,
    /// Seconds of one small operation on a row (a sum of two rows), one after another:
    /// a layer's norms, RoPE, KV writes, sums and routing cost `small_ops_per_layer`
    /// of them, a kernel launch each on a GPU.
    pub small_op_s: f64,
    /// The backend's count of those a decode layer ([`Backend::small_ops_per_layer`]).
    pub small_ops_per_layer: usize,
    /// O_DIRECT reads of this model's experts, when measured.
    pub disk_bytes_per_s: Option<f64>,
    /// The backend's device, for one with memory of its own.
    pub device: Option<DeviceRates>,
}

/// The measured time of one MoE layer's experts (see [`Machine::experts`]).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ExpertsTime {
    /// One row routed to its top-k, the weights coming from memory.
    pub decode_s: f64,
    /// [`PROMPT`] rows, each routed to its top-k.
    pub prefill_s: f64,
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

/// The operations of a decode layer other than its products, attention and experts,
/// as the CPU backend runs them: two norms (one fused with the residual's sum), the
/// query's and key's norm and RoPE, the KV write, the routing's top-k and plan, the
/// experts' combine and the last sum (a backend's own count:
/// [`Backend::small_ops_per_layer`]).
pub const SMALL_OPS_PER_LAYER: usize = 10;

/// What [`Machine::measure`] times the backend on.
pub struct MeasureOn<'a> {
    /// The model: its spec, and its first MoE layer's router and experts.
    pub ckpt: &'a Checkpoint,
    pub profile: &'a Profile,
    pub precision: Precisions,
    /// The KV cache's format (the model's default or `--kv-bits`).
    pub kv: KvFormat,
    /// The model's expert layout when the disk rate matters (streamed experts).
    pub disk: Option<&'a ExpertLayout>,
}

impl Machine {
    /// Times `be`'s kernels on every product shape and attention geometry of the
    /// model, one small operation, its device's copies (a backend with one), and the
    /// memory and disk bandwidth of the host (a few seconds).
    pub fn measure<B: Backend>(be: &B, on: &MeasureOn<'_>) -> Result<Machine> {
        let MeasureOn { ckpt, profile, precision, kv, disk } = *on;
        let spec = &ckpt.spec;
        let decode_be = be.with_precision(RowPrecision::All(precision.decode));
        let prefill_be = be.with_precision(RowPrecision::All(precision.prefill));
        let mut products = Vec::new();
        for p in profile.products.iter().filter(|p| p.part != Part::Expert) {
            products.push(ProductTime {
                dtype: p.dtype,
                rows: p.rows,
                cols: p.cols,
                decode_s: decode_time(&decode_be, p)?,
                prefill_s: prefill_time(&prefill_be, p, PROMPT)?,
                prefill_rows: PROMPT,
            });
        }
        let experts = match profile.moe_layers.first() {
            Some(m) => Some(experts_time((&decode_be, &prefill_be), ckpt, m)?),
            None => None,
        };
        let mut attention = Vec::new();
        for a in &profile.attention {
            attention.push(attention_time((&decode_be, &prefill_be), precision, spec, a, kv)?);
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
            attention,
            experts,
            small_op_s: small_op_time(&decode_be, spec.hidden_size)?,
            small_ops_per_layer: be.small_ops_per_layer(),
            disk_bytes_per_s,
            device: be.device_rates()?,
        })
    }

    fn time_of(&self, p: &Product) -> &ProductTime {
        self.products
            .iter()
            .find(|t| (t.dtype, t.rows, t.cols) == (p.dtype, p.rows, p.cols))
            .expect("every product of the profile was measured")
    }
}

/// `copies` matrices of `rows x cols` of `d`, one after another in memory, filled with
/// a pattern that decodes to small normal numbers in every format.
fn test_matrices(d: DType, rows: usize, cols: usize, copies: usize) -> Result<Vec<TensorView>> {
    let len = rows * d.bytes_for(cols).expect("a whole number of blocks");
    let stride = len.next_multiple_of(64);
    let file = MappedFile::in_memory(Path::new("(the planner's test matrices)"), &vec![0x11u8; stride * copies])?;
    (0..copies)
        .map(|i| TensorView::new(format!("test {d} {rows}x{cols}"), d, vec![rows, cols], file.clone(), i * stride, len))
        .collect()
}

/// Best seconds per call of `f` over a few trials of at least `min` each.
fn best_time(min: Duration, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let (t, mut n) = (Instant::now(), 0u32);
        while t.elapsed() < min || n < 2 {
            f()?;
            n += 1;
        }
        best = best.min(t.elapsed().as_secs_f64() / n as f64);
    }
    Ok(best)
}

/// Waits for the backend's work on `x` (a device's queue) by reading back its first
/// column: reading all of a prompt's rows back would time the copy rather than the
/// kernels (a q product's 128 rows, 2 MB, were half of its 613 us on an H100).
fn wait<B: Backend>(be: &B, x: Option<B::Act>) -> Result<()> {
    if let Some(x) = x {
        be.to_host_owned(be.columns(&x, 0, 1)?)?;
    }
    Ok(())
}

/// Seconds per run of `op` (run `i` of `runs`), a trial's runs queued before one
/// wait: a device's round trip is tens of microseconds, more than one run of a small
/// operation would show.
fn per_run<B: Backend>(be: &B, min: Duration, runs: usize, mut op: impl FnMut(usize) -> Result<B::Act>) -> Result<f64> {
    let t = best_time(min, || {
        let mut last = None;
        for i in 0..runs {
            last = Some(op(i)?);
        }
        wait(be, last)
    })?;
    Ok(t / runs as f64)
}

/// Seconds of a one-row product of `p`'s shape, over enough copies of the matrix that
/// they do not stay in the caches (as a decode step's weights do not).
fn decode_time<B: Backend>(be: &B, p: &Product) -> Result<f64> {
    let one = p.rows * p.dtype.bytes_for(p.cols).expect("a whole number of blocks");
    let copies = (64 << 20) / one + 1;
    let mats =
        test_matrices(p.dtype, p.rows, p.cols, copies)?.iter().map(|t| be.mat(t)).collect::<Result<Vec<B::Mat>>>()?;
    let x = be.upload(1, p.cols, &vec![0.5f32; p.cols])?;
    per_run(be, Duration::from_millis(60), mats.len(), |i| be.matmul(&x, &mats[i]))
}

/// MoE layer `m`'s routing, fetch and expert products on the model's own experts
/// (mapped from its file), routed by random logits: a decode row on `decode`, a new
/// set of choices each run so that its weights come from memory as in a step (a
/// device's tier takes them in the first runs), and [`PROMPT`] rows on `prefill`.
fn experts_time<B: Backend>((decode, prefill): (&B, &B), ckpt: &Checkpoint, m: &MoeLayer) -> Result<ExpertsTime> {
    const SETS: usize = 16;
    let moe = crate::moe::Moe::load(decode, ckpt, m.layer, crate::moe::RouterInput::Plain)?;
    let store = ExpertStore::open_mapped(ckpt)?;
    let hidden = ckpt.spec.hidden_size;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 40) as f32 / (1u64 << 24) as f32
            })
            .collect()
    };
    // Seconds per set of runs of `be` over `rows` rows, one run per set of logits.
    let mut time = |be: &B, rows: usize, sets: usize| -> Result<f64> {
        let h = be.upload(rows, hidden, &vec![0.01f32; rows * hidden])?;
        let logits =
            (0..sets).map(|_| be.upload(rows, m.experts, &random(rows * m.experts))).collect::<Result<Vec<_>>>()?;
        per_run(be, Duration::from_millis(60), sets, |i| moe.experts_by(be, &store, &logits[i], &h))
    };
    Ok(ExpertsTime { decode_s: time(decode, 1, SETS)?, prefill_s: time(prefill, PROMPT, 1)? })
}

/// Seconds of a product of `p`'s shape over `n` rows (the weights in cache: a prompt
/// is bound by arithmetic), several to a wait (a device's round trip is tens of us).
fn prefill_time<B: Backend>(be: &B, p: &Product, n: usize) -> Result<f64> {
    const RUNS: usize = 4;
    let w = be.mat(&test_matrices(p.dtype, p.rows, p.cols, 1)?[0])?;
    let x = be.upload(n, p.cols, &vec![0.5f32; n * p.cols])?;
    per_run(be, Duration::from_millis(60), RUNS, |_| be.matmul(&x, &w))
}

/// Seconds of one layer's attention of geometry `a` (a layer of `spec` that has it),
/// for a decode row after [`PROMPT`] positions on `decode` and for a prompt of them
/// on `prefill` (a device's kernel for a prompt's rows may not be its decode rows').
/// Several runs to a wait, whose round trip a device's one attention would not show.
fn attention_time<B: Backend>(
    (decode, prefill): (&B, &B),
    precision: Precisions,
    spec: &ModelSpec,
    a: &AttnShape,
    kv: KvFormat,
) -> Result<AttnTime> {
    const RUNS: usize = 8;
    let be = decode;
    let layer = spec
        .layers
        .iter()
        .map(|l| &l.attention)
        .find(|s| (s.n_heads, s.n_kv_heads, s.head_dim, s.window) == (a.n_heads, a.n_kv_heads, a.head_dim, a.window))
        .expect("the profile's attention shapes come from the spec");
    let (qd, kd) = (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim);
    let layout = a.kv_layout(kv);
    let rows = |n: usize, width: usize| be.upload(n, width, &vec![0.25f32; n * width]);
    let mut held = be.kv_new(&layout)?;
    be.kv_append(&mut held, &rows(PROMPT, kd)?, &rows(PROMPT, kd)?, SeqRows { first: 0, rows: PROMPT, start: 0 })?;
    let empty = be.kv_new(&layout)?;
    let time = |be: &B, p: Precision, n: usize, start: usize, cache: &B::Kv| -> Result<f64> {
        let (q, k) = (rows(n, qd)?, rows(n, kd)?);
        let batch = Batch::new(&[(start, n, p)]);
        let op =
            AttnOp { spec: layer, q: &q, k: &k, v: &k, batch: &batch, caches: &[cache], sinks: None, select: None };
        per_run(be, Duration::from_millis(30), RUNS, |_| be.attention(&op))
    };
    Ok(AttnTime {
        decode_s: time(decode, precision.decode, 1, PROMPT, &held)?,
        prefill_s: time(prefill, precision.prefill, PROMPT, 0, &empty)?,
    })
}

/// Seconds of one sum of two rows of `width`, over a run of them.
fn small_op_time<B: Backend>(be: &B, width: usize) -> Result<f64> {
    const RUN: usize = 100;
    let y = be.upload(1, width, &vec![0.0f32; width])?;
    let mut x = Some(be.upload(1, width, &vec![0.5f32; width])?);
    let t = best_time(Duration::from_millis(20), || {
        let mut a = x.take().expect("the row is put back");
        for _ in 0..RUN {
            be.add(&mut a, &y)?;
        }
        be.to_host(&a)?;
        x = Some(a);
        Ok(())
    })?;
    Ok(t / RUN as f64)
}

/// Where a device backend's memory goes (`sluice plan --backend cuda`): the model's
/// weights other than routed experts, one sequence's KV cache, the kernels'
/// intermediates, and a VRAM tier of experts in what is left.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceSplit {
    /// What sluice may take on the device.
    pub room_bytes: u64,
    pub weights_bytes: u64,
    /// One sequence's KV cache (of [`DEVICE_CONTEXT`] positions by default).
    pub kv_bytes: u64,
    /// An allowance for activations and the kernels' intermediates.
    pub scratch_bytes: u64,
    /// The VRAM expert tier, at most every expert.
    pub tier_bytes: u64,
    /// A MoE layer's share of the tier, in experts.
    pub tier_experts_per_layer: usize,
}

/// The context a device plan reserves KV cache for unless told otherwise.
pub const DEVICE_CONTEXT: usize = 4096;

/// Device memory a plan leaves for activations and the kernels' pools of
/// intermediates: at `--gpu-memory 5GiB` on the Qwen3-30B-A3B geometry (an H100, stop
/// 51) the tier held 3.99 GiB beside 0.92 GiB of weights, so a short run's KV cache and
/// intermediates took under 100 MiB; prompts of 512 rows take more.
const SCRATCH_ALLOWANCE: u64 = 256 << 20;

/// Bytes of one sequence's KV cache over `positions` on `be` (sliding layers hold at
/// most their window), in `kv`'s format as [`Machine::measure`] times it.
pub fn kv_bytes<B: Backend>(be: &B, p: &Profile, kv: KvFormat, positions: usize) -> Result<u64> {
    let mut total = 0u64;
    for a in &p.attention {
        let per_position = be.kv_bytes_per_position(&be.kv_new(&a.kv_layout(kv))?) as u64;
        total += a.layers as u64 * per_position * a.window.map_or(positions, |w| w.min(positions)) as u64;
    }
    Ok(total)
}

impl Placement {
    /// The same placement on a device with `room` bytes for sluice: the weights, a KV
    /// cache of `kv` bytes and [`SCRATCH_ALLOWANCE`] first, the VRAM tier in the rest.
    /// An error where the first three do not fit, as loading would give.
    pub fn on_device(&self, p: &Profile, room: u64, kv: u64) -> Result<DeviceSplit> {
        let need = self.resident_bytes + kv + SCRATCH_ALLOWANCE;
        if need > room {
            return Err(Error::Usage(format!(
                "the device has room for {}: less than the model's weights other than routed experts ({}), a KV \
                 cache ({}) and {} for activations",
                human_bytes(room),
                human_bytes(self.resident_bytes),
                human_bytes(kv),
                human_bytes(SCRATCH_ALLOWANCE)
            )));
        }
        let tier_bytes = (room - need).min(self.expert_bytes);
        let experts = (p.moe_layers.len() * self.experts_per_layer).max(1) as f64;
        let per_layer = tier_bytes as f64 / (self.expert_bytes as f64 / experts) / p.moe_layers.len().max(1) as f64;
        Ok(DeviceSplit {
            room_bytes: room,
            weights_bytes: self.resident_bytes,
            kv_bytes: kv,
            scratch_bytes: SCRATCH_ALLOWANCE,
            tier_bytes,
            tier_experts_per_layer: (per_layer as usize).min(self.experts_per_layer),
        })
    }
}

/// How the experts are routed to and cached: a recorded histogram (uniform routing
/// without one) and the caches' eviction policy (`--cache-policy`).
#[derive(Clone, Copy)]
pub struct Routing<'a> {
    pub hist: Option<&'a RoutingHistogram>,
    pub policy: Policy,
}

/// Predicted speed and where the time goes.
#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    pub decode_tok_s: f64,
    pub prefill_tok_s: f64,
    /// Per decoded token: the products on weights in memory (the device's, for a
    /// backend with one) and the attention, the small operations between them, expert
    /// reads from disk (streamed, they overlap the expert products on the host), and
    /// copies of experts to the device that its tier lacks.
    pub decode_memory_s: f64,
    pub decode_small_ops_s: f64,
    pub decode_disk_s: f64,
    pub decode_copy_s: f64,
    /// Expected hit rate of the host's expert cache in decode (streamed).
    pub decode_hit_rate: Option<f64>,
    /// Expected hit rate of the device's expert tier in decode.
    pub decode_device_hit_rate: Option<f64>,
    pub decode_disk_bytes_per_token: f64,
    pub decode_copy_bytes_per_token: f64,
    /// Per prompt token: the arithmetic (products and attention), expert reads from
    /// disk (overlapped with it) and copies to the device (not overlapped).
    pub prefill_compute_s: f64,
    pub prefill_disk_s: f64,
    pub prefill_copy_s: f64,
}

/// Predicts decode (after a short prompt) and prefill speed (of a [`PROMPT`]-token
/// prompt), on the host, or on a device split as `device` says.
pub fn predict(
    p: &Profile,
    at: &Placement,
    m: &Machine,
    routing: Routing<'_>,
    device: Option<&DeviceSplit>,
) -> Prediction {
    let mut decode_memory_s = 0.0;
    let mut decode_experts_s = 0.0;
    let mut prefill_compute_s = 0.0;
    for (a, t) in p.attention.iter().zip(&m.attention) {
        decode_memory_s += a.layers as f64 * t.decode_s;
        prefill_compute_s += a.layers as f64 * t.prefill_s / PROMPT as f64;
    }
    for pr in p.products.iter().filter(|p| p.part != Part::Expert) {
        let t = m.time_of(pr);
        decode_memory_s += pr.per_token as f64 * t.decode_s;
        // A prompt runs the dense products on all its rows at once and the head only
        // on its last row.
        if pr.part == Part::Dense {
            prefill_compute_s += pr.per_token as f64 * t.prefill_s / t.prefill_rows as f64;
        }
    }
    if let Some(e) = &m.experts {
        let layers = p.moe_layers.len() as f64;
        decode_experts_s = layers * e.decode_s;
        decode_memory_s += decode_experts_s;
        prefill_compute_s += layers * e.prefill_s / PROMPT as f64;
    }
    let decode_small_ops_s = (p.layers * m.small_ops_per_layer) as f64 * m.small_op_s;

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
    // A device's copies come from the store: page-locked where it is resident.
    let link_bps = m.device.as_ref().map_or(f64::INFINITY, |d| match at.residency {
        Residency::Resident => d.locked_bytes_per_s,
        _ => d.pageable_bytes_per_s,
    });
    let (mut host, mut tier) = (Hits::default(), Hits::default());
    let (mut chunk_miss_bytes, mut chunk_copy_bytes) = (0.0, 0.0);
    for &MoeLayer { layer, experts: n, top_k: k, expert_bytes: bytes } in &p.moe_layers {
        let probs = popularity(routing.hist, layer, n, k);
        // A prompt touches most experts of a layer; those not held are read once.
        let touched: f64 = probs.iter().map(|&q| 1.0 - (1.0 - q).powf(PROMPT as f64)).sum();
        let held = |slots: usize| slots.min(n) as f64 / n as f64;
        if let Some(slots) = slots {
            host.add(hit_rate(routing.policy, &probs, slots), k, bytes);
            chunk_miss_bytes += touched * (1.0 - held(slots)) * bytes as f64;
        }
        if let Some(d) = device {
            tier.add(hit_rate(routing.policy, &probs, d.tier_experts_per_layer), k, bytes);
            chunk_copy_bytes += touched * (1.0 - held(d.tier_experts_per_layer)) * bytes as f64;
        }
    }
    let decode_disk_s = host.miss_bytes / disk_bps;
    let decode_copy_s = if device.is_some() { tier.miss_bytes / link_bps } else { 0.0 };
    let prefill_disk_s = chunk_miss_bytes / disk_bps / PROMPT as f64;
    let prefill_copy_s = if device.is_some() { chunk_copy_bytes / link_bps / PROMPT as f64 } else { 0.0 };
    // On the host, a streamed layer computes its cached experts while its misses are
    // read, so the reads overlap the expert products (not the attention and dense
    // products around them, which wait for the layer's result); a mapped model's
    // misses are page faults inside the products: they add up. A device waits for
    // the experts it lacks before its layer's expert products: copies and reads add up.
    let decode_s = decode_small_ops_s
        + decode_copy_s
        + match (at.residency, device) {
            (Residency::Streamed, None) => decode_memory_s - decode_experts_s + decode_experts_s.max(decode_disk_s),
            _ => decode_memory_s + decode_disk_s,
        };
    Prediction {
        decode_tok_s: 1.0 / decode_s,
        prefill_tok_s: 1.0 / (prefill_compute_s + prefill_copy_s).max(prefill_disk_s),
        decode_memory_s,
        decode_small_ops_s,
        decode_disk_s,
        decode_copy_s,
        decode_hit_rate: host.rate(),
        decode_device_hit_rate: device.and(tier.rate()),
        decode_disk_bytes_per_token: host.miss_bytes,
        decode_copy_bytes_per_token: if device.is_some() { tier.miss_bytes } else { 0.0 },
        prefill_compute_s,
        prefill_disk_s,
        prefill_copy_s,
    }
}

/// A cache's expected hits over a token's MoE layers.
#[derive(Default)]
struct Hits {
    hits: f64,
    wanted: f64,
    miss_bytes: f64,
}

impl Hits {
    /// A layer whose `k` experts of `bytes` each hit at rate `h`.
    fn add(&mut self, h: f64, k: usize, bytes: u64) {
        self.hits += h * k as f64;
        self.wanted += k as f64;
        self.miss_bytes += (1.0 - h) * k as f64 * bytes as f64;
    }

    fn rate(&self) -> Option<f64> {
        (self.wanted > 0.0).then(|| self.hits / self.wanted)
    }
}

/// Hit rate of a cache of `slots` under `policy`: LRU by Che's approximation
/// ([`lru_hit_rate`]), LFU as the cache of the most popular experts it converges to
/// on routing that keeps its popularity.
pub fn hit_rate(policy: Policy, probs: &[f64], slots: usize) -> f64 {
    match policy {
        Policy::Lru => lru_hit_rate(probs, slots),
        Policy::Lfu => {
            let total: f64 = probs.iter().sum();
            if slots >= probs.len() || total <= 0.0 {
                return 1.0;
            }
            let mut sorted = probs.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            sorted[..slots].iter().sum::<f64>() / total
        }
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
