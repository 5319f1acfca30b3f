//! The backend interface the families are written against.
//!
//! A family says what a layer computes in these operations and nothing else: no
//! SIMD, no threads, no I/O. A backend owns where activations, weights, layer state
//! and expert weights live (host memory for [`Cpu`]; device memory for a GPU backend)
//! and how each operation runs. Every operation can fail (a device can run out of
//! memory). Routing is an operation too, so a device backend decides it where the
//! router logits are; only the chosen expert ids come back to the host, for the
//! expert store. Experts reach the backend through [`Backend::fetch_experts`], which
//! hands back the backend's own handles: the CPU backend computes on the host store's
//! slots, a GPU backend would keep its own VRAM tier in front of them.

mod cpu;

pub use cpu::{Cpu, HostAct, HostRouting};

use sluice_core::{Activation, AttentionSpec, DeltaNetSpec, Error, Glu, KvLayout, Result, RopeSpec, RouterKind};
use sluice_experts::{ExpertStore, PageLock};
use sluice_formats::TensorView;

use crate::batch::{Batch, RowPrecision, SeqRows};

/// One layer's new keys and values (every row of the step) and the cache of one
/// sequence that takes its rows of them.
pub struct KvAppend<'a, B: Backend> {
    pub kv: &'a mut B::Kv,
    pub k: &'a B::Act,
    pub v: &'a B::Act,
}

/// An RMS norm over each `group` elements of each row, times `weight + offset` if
/// given.
pub struct Norm<'a, B: Backend> {
    pub group: usize,
    pub weight: Option<&'a B::Vector>,
    pub offset: f32,
    pub eps: f32,
}

/// Causal attention of a batch: each sequence's rows of `q` over its cache (`caches`,
/// one per sequence of `batch`) and its own new rows of `k` and `v`.
pub struct AttnOp<'a, B: Backend> {
    pub spec: &'a AttentionSpec,
    pub q: &'a B::Act,
    pub k: &'a B::Act,
    pub v: &'a B::Act,
    pub batch: &'a Batch,
    pub caches: &'a [&'a B::Kv],
    /// One logit per query head that joins each softmax without a value (gpt-oss).
    pub sinks: Option<&'a B::Vector>,
    /// Per row, the positions it attends to, ascending, in place of all it may see
    /// (Qwen4-Exp's QSA).
    pub select: Option<&'a [Vec<u32>]>,
}

/// A run of columns in each of `heads` equal heads of a row: columns `start..start +
/// len` of every head (`heads: 1` is a plain run of a row's columns).
#[derive(Clone, Copy, Debug)]
pub struct HeadCols {
    pub heads: usize,
    pub start: usize,
    pub len: usize,
}

/// Checks a [`Backend::copy_columns`] request against the `(rows, cols)` of its two
/// activations: the same rows, heads and lengths, and every run inside its head.
pub fn check_head_cols(dst: (usize, usize), to: HeadCols, src: (usize, usize), from: HeadCols) -> Result<()> {
    let fits = |(_, cols): (usize, usize), c: HeadCols| {
        c.heads > 0 && cols.is_multiple_of(c.heads) && c.start + c.len <= cols / c.heads
    };
    if dst.0 != src.0 || to.heads != from.heads || to.len != from.len || !fits(dst, to) || !fits(src, from) {
        return Err(Error::Unsupported(format!(
            "copy_columns: {from:?} of a {}x{} activation do not fit {to:?} of a {}x{} one",
            src.0, src.1, dst.0, dst.1
        )));
    }
    Ok(())
}

/// One step of a Gated DeltaNet layer over a batch (Qwen3.5's linear attention):
/// each sequence's rows run through the layer's causal convolution and gated
/// delta-rule recurrence from its state (see `sluice_cpu::delta`).
pub struct DeltaOp<'a, B: Backend> {
    pub spec: &'a DeltaNetSpec,
    /// `[rows, conv_dim]`: the q, k and v projections before the convolution.
    pub mixed: &'a B::Act,
    /// `[rows, v_heads]`: the pre-activations of beta and of the decay.
    pub b: &'a B::Act,
    pub a: &'a B::Act,
    /// `[conv_dim * conv_kernel]`, channel-major.
    pub conv: &'a B::Vector,
    /// `-exp(A_log)` and the decay's bias, `[v_heads]` each.
    pub a_neg: &'a B::Vector,
    pub dt_bias: &'a B::Vector,
    pub batch: &'a Batch,
    /// Each sequence's state before the step, in batch order.
    pub states: &'a [&'a B::Act],
}

/// A router: how its logits become each row's experts and weights.
pub struct RouterOp<B: Backend> {
    pub kind: RouterKind,
    pub n_experts: usize,
    pub top_k: usize,
    /// Added to the logits (a router's own bias).
    pub logit_bias: Option<B::Vector>,
    /// Added to the scores only to choose (DeepSeek-V3's correction bias).
    pub choice_bias: Option<B::Vector>,
    /// Multiplies each chosen expert's weight (Gemma 4).
    pub expert_scale: Option<B::Vector>,
}

/// What one expert computes: `down(glu(gate(x) [+ b], up(x) [+ b])) [+ b]`.
pub struct ExpertFfn<B: Backend> {
    pub glu: Glu,
    pub bias: Option<ExpertBias<B>>,
}

/// Per-expert biases (gpt-oss), each `[n_experts * width]`, expert-major.
pub struct ExpertBias<B: Backend> {
    pub gate: B::Vector,
    pub up: B::Vector,
    pub down: B::Vector,
}

/// What a backend's own expert tier (a GPU's VRAM) did since the backend opened.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ExpertTraffic {
    /// Experts found in the tier.
    pub vram_hits: u64,
    /// Experts copied from the host store.
    pub host_fills: u64,
    /// Bytes copied from the host store to the device.
    pub fill_bytes: u64,
    /// Experts dropped from the tier to make room.
    pub evictions: u64,
    /// Layer steps served from the tier without the host seeing the routing.
    pub whole_layers: u64,
    /// Experts copied to the tier before their first use, when all of them fit.
    pub adopted: u64,
    /// Experts copied into the tier ahead of their layer, as the pilot predicted them
    /// (`--prefetch pilot`), beside the computation.
    pub prefetched: u64,
    /// Bytes the tier holds now.
    pub vram_bytes: u64,
}

/// A device with memory of its own, as measured for `sluice plan`
/// ([`Backend::device_rates`]).
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceRates {
    pub name: String,
    pub total_bytes: u64,
    /// Bytes a copy within the device memory moves per second (each read once and
    /// written once): the rate a product reading its weights can approach.
    pub copy_bytes_per_s: f64,
    /// Host to device, from page-locked memory (a resident store's experts) and from
    /// pageable memory (the page cache's, for mapped experts).
    pub locked_bytes_per_s: f64,
    pub pageable_bytes_per_s: f64,
}

pub trait Backend: Send + Sync + Sized + 'static {
    /// A `[rows, cols]` f32 activation.
    type Act: Send + Sync;
    /// A weight matrix `[out, in]` in its stored format.
    type Mat: Send + Sync;
    /// A small f32 parameter vector (norm weights, scales, biases).
    type Vector: Send + Sync;
    /// One layer's KV cache of one sequence.
    type Kv: Send + Sync;
    /// A layer's routing of a batch: each row's top-k experts and weights.
    type Routing: Send + Sync;
    /// One layer's experts for one step, as the backend computes on them.
    type Experts<'s>
    where
        Self: 's;

    fn name(&self) -> &'static str;
    /// The same backend computing matrix products at each row's precision (each
    /// step picks them, see [`crate::Model::precision`]).
    fn with_precision(&self, p: RowPrecision) -> Self;

    fn mat(&self, t: &TensorView) -> Result<Self::Mat>;
    fn vector(&self, t: &TensorView) -> Result<Self::Vector>;

    /// Rows `tokens` of an embedding table, times `scale`.
    fn embed(&self, table: &Self::Mat, tokens: &[u32], scale: f32) -> Result<Self::Act>;
    /// `x · Wᵀ`.
    fn matmul(&self, x: &Self::Act, w: &Self::Mat) -> Result<Self::Act>;
    /// `x · W_iᵀ` for each of `ws`, matrices that share the input (q, k and v; gate
    /// and up): a backend may run them as one job.
    fn matmul_many(&self, x: &Self::Act, ws: &[&Self::Mat]) -> Result<Vec<Self::Act>> {
        ws.iter().map(|w| self.matmul(x, w)).collect()
    }
    fn rms_norm(&self, x: &mut Self::Act, norm: &Norm<'_, Self>) -> Result<()>;
    /// `norm(x)` as a new activation, `x` left as it is (a pre-norm block's input).
    /// The fused forms here and below exist for a device backend, where every launch
    /// has a cost of its own; each must give the bits of its parts run one by one.
    fn normed(&self, x: &Self::Act, norm: &Norm<'_, Self>) -> Result<Self::Act> {
        let mut h = self.copy(x)?;
        self.rms_norm(&mut h, norm)?;
        Ok(h)
    }
    /// `x += y`, then `norm(x)` as a new activation: a residual's sum and the next
    /// block's input.
    fn add_normed(&self, x: &mut Self::Act, y: &Self::Act, norm: &Norm<'_, Self>) -> Result<Self::Act> {
        self.add(x, y)?;
        self.normed(x, norm)
    }
    fn add(&self, x: &mut Self::Act, y: &Self::Act) -> Result<()>;
    fn mul(&self, x: &mut Self::Act, y: &Self::Act) -> Result<()>;
    fn scale(&self, x: &mut Self::Act, s: f32) -> Result<()>;
    /// Multiplies every row by `v` element-wise.
    fn mul_row(&self, x: &mut Self::Act, v: &Self::Vector) -> Result<()>;
    /// Adds `v` to every row (a bias).
    fn add_row(&self, x: &mut Self::Act, v: &Self::Vector) -> Result<()>;
    fn copy(&self, x: &Self::Act) -> Result<Self::Act>;
    /// Rows `rows` of `x`, in that order.
    fn gather_rows(&self, x: &Self::Act, rows: &[usize]) -> Result<Self::Act>;
    /// Columns `start..start + len` of every row.
    fn columns(&self, x: &Self::Act, start: usize, len: usize) -> Result<Self::Act>;
    /// Copies `src`'s columns `from` into `dst`'s columns `to`, row by row (the same
    /// rows, heads and lengths): gathers one part of every head, or places one head.
    fn copy_columns(&self, dst: &mut Self::Act, to: HeadCols, src: &Self::Act, from: HeadCols) -> Result<()>;
    fn activate(&self, x: &mut Self::Act, act: Activation) -> Result<()>;
    /// `gate = glu(gate, up)`.
    fn glu(&self, gate: &mut Self::Act, up: &Self::Act, glu: Glu) -> Result<()>;
    fn softcap(&self, x: &mut Self::Act, cap: f32) -> Result<()>;
    /// RoPE on whole heads; row `i` is at `batch.positions[i]`.
    fn rope(&self, x: &mut Self::Act, head_dim: usize, batch: &Batch, rope: &RopeSpec) -> Result<()>;
    /// `norm` over each head (`norm.group` is the head's width), then RoPE on whole
    /// heads: a query's or key's per-head norm and rotation.
    fn norm_rope(&self, x: &mut Self::Act, norm: &Norm<'_, Self>, batch: &Batch, rope: &RopeSpec) -> Result<()> {
        self.rms_norm(x, norm)?;
        self.rope(x, norm.group, batch, rope)
    }
    /// [`Backend::norm_rope`] on a step's queries and keys (heads of one width), in
    /// one operation where the backend has one.
    fn norm_rope_qk(
        &self,
        q: &mut Self::Act,
        q_norm: &Norm<'_, Self>,
        k: &mut Self::Act,
        k_norm: &Norm<'_, Self>,
        batch: &Batch,
        rope: &RopeSpec,
    ) -> Result<()> {
        self.norm_rope(q, q_norm, batch, rope)?;
        self.norm_rope(k, k_norm, batch, rope)
    }
    fn zeros(&self, rows: usize, cols: usize) -> Result<Self::Act>;
    /// `[rows, cols]` from the host's `data` (row-major).
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<Self::Act>;

    /// An empty KV cache; fails on a format the backend cannot store.
    fn kv_new(&self, layout: &KvLayout) -> Result<Self::Kv>;
    /// Bytes the buffers of `kv` hold (their room, not only the positions written).
    fn kv_bytes(&self, kv: &Self::Kv) -> usize;
    /// Bytes one more position takes in `kv`, keys and values, in its format.
    fn kv_bytes_per_position(&self, kv: &Self::Kv) -> usize;
    /// A new cache holding positions `0..keep` of `kv` (a ring: the last `window` of
    /// them), or `None` when `kv` no longer holds them all.
    fn kv_prefix(&self, kv: &Self::Kv, keep: usize) -> Result<Option<Self::Kv>>;
    /// Appends one sequence's rows `seq` of `k` and `v` to its cache.
    fn kv_append(&self, kv: &mut Self::Kv, k: &Self::Act, v: &Self::Act, seq: SeqRows) -> Result<()>;
    /// [`Backend::kv_append`] for each of one sequence's layers, in one operation
    /// where the backend has one.
    fn kv_append_layers(&self, appends: Vec<KvAppend<'_, Self>>, seq: SeqRows) -> Result<()> {
        appends.into_iter().try_for_each(|a| self.kv_append(a.kv, a.k, a.v, seq))
    }
    fn attention(&self, op: &AttnOp<'_, Self>) -> Result<Self::Act>;
    /// A Gated DeltaNet step: `[rows, v_heads * v_dim]` and each sequence's new state
    /// (the old ones are left as they were, for a step that fails later).
    fn delta_net(&self, op: &DeltaOp<'_, Self>) -> Result<(Self::Act, Vec<Self::Act>)>;
    /// Multiplies every row `i` of `x` by `s[i, 0]` (`s` is `[rows, 1]`).
    fn scale_rows(&self, x: &mut Self::Act, s: &Self::Act) -> Result<()>;

    /// Routes every row of `logits` (`[rows, n_experts]`).
    fn route(&self, logits: &Self::Act, router: &RouterOp<Self>) -> Result<Self::Routing>;
    /// The chosen expert ids, `[rows * top_k]`, on the host (for the expert store).
    fn routing_ids(&self, r: &Self::Routing) -> Result<Vec<u32>>;
    /// Makes experts `ids` of `layer` available to [`Backend::moe`]: from the store's
    /// tiers, or from the backend's own. Reads may still be under way when it returns
    /// ([`Backend::moe`] computes each expert as it arrives).
    fn fetch_experts<'s>(&self, store: &'s ExpertStore, layer: usize, ids: &[usize]) -> Result<Self::Experts<'s>>;
    /// Makes the experts `routing` chose at `layer` available to [`Backend::moe`]. A
    /// backend that holds a whole layer itself needs no ids on the host (a device
    /// backend then skips waiting for the router); by default, the ids come back
    /// and [`Backend::fetch_experts`] gets their union.
    fn fetch_routed<'s>(
        &self,
        store: &'s ExpertStore,
        layer: usize,
        routing: &Self::Routing,
    ) -> Result<Self::Experts<'s>> {
        let ids = self.routing_ids(routing)?;
        self.fetch_experts(store, layer, &crate::moe::unique(&ids))
    }
    /// Copies the store's experts into the backend's own tier ahead of their first
    /// use, where it has room for all of them (`progress` sees bytes copied of the
    /// total); by default the backend has no tier of its own and does nothing.
    fn adopt_experts(&self, _store: &ExpertStore, _progress: Option<&mut dyn FnMut(u64, u64)>) -> Result<()> {
        Ok(())
    }
    /// How a resident store's buffers are locked for this backend's copies from
    /// them (a GPU's: its copies of experts its own tier misses then run at the link's
    /// full rate); `None` (the default) for a backend that computes on them in place.
    fn page_lock(&self) -> Option<PageLock> {
        None
    }
    /// Bytes of experts the backend's own tier could take now, before a model's
    /// other weights (see [`Backend::adopt_experts`]); `None` for a backend without
    /// a tier of its own.
    fn expert_room(&self) -> Result<Option<u64>> {
        Ok(None)
    }
    /// The operations of a decode layer other than its products, attention and
    /// experts that the backend runs one after another (a kernel launch each on a
    /// GPU), for the planner's prediction ([`crate::plan::SMALL_OPS_PER_LAYER`] as the
    /// CPU runs them).
    fn small_ops_per_layer(&self) -> usize {
        crate::plan::SMALL_OPS_PER_LAYER
    }
    /// Measures the backend's device (about a second): its memory and the rates of
    /// copies within it and from the host. `None` (the default) for a backend that
    /// computes in host memory.
    fn device_rates(&self) -> Result<Option<DeviceRates>> {
        Ok(None)
    }
    /// What the backend's own expert tier did (see [`Backend::adopt_experts`]); `None`
    /// for a backend that has none and computes on the store's experts in place.
    fn expert_traffic(&self) -> Option<ExpertTraffic> {
        None
    }
    /// Starts copying experts `ids` of `layer` (the pilot's picks for the next
    /// layer, most picked first) into the backend's own tier, without waiting for
    /// them: the copies run beside this layer's computation. By default nothing (a
    /// backend without a tier reads the store's experts in place).
    fn prefetch_experts(&self, _store: &ExpertStore, _layer: usize, _ids: &[usize]) -> Result<()> {
        Ok(())
    }
    /// Blocks until every one of `experts` is available, or one cannot be.
    fn experts_ready(&self, experts: &Self::Experts<'_>) -> Result<()>;
    /// Whether some of `experts` wait for a slot of their layer's cache (a prompt chunk
    /// that needs more experts than the cache holds): their reads start as
    /// [`Backend::moe`] gives slots back. Likewise where a device's copies of them are
    /// queued by [`Backend::moe`]: the next layer's read-ahead then follows them.
    fn experts_queued(&self, _experts: &Self::Experts<'_>) -> bool {
        false
    }
    /// How long [`Backend::moe`] waited for `experts` to arrive.
    fn experts_waited(&self, experts: &Self::Experts<'_>) -> std::time::Duration;
    /// The routed experts: `sum_k weight[r, k] * expert_k(x[r])` for every row.
    fn moe(
        &self,
        x: &Self::Act,
        routing: &Self::Routing,
        experts: &Self::Experts<'_>,
        ffn: &ExpertFfn<Self>,
    ) -> Result<Self::Act>;

    fn to_host(&self, x: &Self::Act) -> Result<Vec<f32>>;
    /// [`to_host`](Self::to_host), consuming `x`: a backend whose activations are in
    /// host memory hands its buffer over (a step's logits are `rows x vocab`, 8 MB
    /// for 8 rows of Gemma 3).
    fn to_host_owned(&self, x: Self::Act) -> Result<Vec<f32>> {
        self.to_host(&x)
    }
    fn n_rows(&self, x: &Self::Act) -> usize;
    fn n_cols(&self, x: &Self::Act) -> usize;
}
