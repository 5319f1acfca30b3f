//! [`Backend`] on one GPU.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaSlice;
use sluice_core::{
    Activation, AttentionSpec, DType, Error, Glu, HeadOrder, KvFormat, KvLayout, Precision, Result, RopeSpec,
    RopeStyle, RouterKind,
};
use sluice_engine::backend::{
    AttnOp, Backend, DeltaOp, DeviceRates, ExpertFfn, ExpertTraffic, HeadCols, KvAppend, Norm, RouterOp,
    check_head_cols,
};
use sluice_engine::batch::{Batch, RowPrecision, SeqRows};
use sluice_experts::{ExpertLease, ExpertStore, FetchMode, PageLock, Policy, Residency};
use sluice_formats::TensorView;

use crate::device::{Device, HostLocker, Scratch, elementwise, fail, format_suffix, grid, launch};
use crate::tier::{TierKey, TierPolicy};

/// A row-major `[rows, cols]` f32 matrix in device memory.
pub struct DevAct {
    pub rows: usize,
    pub cols: usize,
    buf: Scratch<f32>,
    /// Its rows quantized for the integer products, made by the first such product
    /// and shared by the others (q, k and v; gate and up). Kernels that write the
    /// matrix take its address by [`Cuda::w`], which forgets this.
    quant: OnceLock<DevQ>,
}

impl DevAct {
    fn new(rows: usize, cols: usize, buf: Scratch<f32>) -> DevAct {
        DevAct { rows, cols, buf, quant: OnceLock::new() }
    }

    fn len(&self) -> usize {
        self.rows * self.cols
    }
}

/// An activation's rows quantized per 32 elements to 8 or 16 bits (kernels.cu's
/// `quantize_act` and `QIn`).
struct DevQ {
    /// Codes, four a word: row i's (or its high bytes) at byte i * cols, a 16-bit
    /// row's low bytes at (rows + i) * cols.
    codes: Scratch<u32>,
    /// Per 32 elements: the scale, then (from rows * blocks on) scale * sum of codes.
    scales: Scratch<f32>,
    /// Per 16 elements, the sum of codes (as i32); then one word a row, 1 for 16 bits.
    sums: Scratch<u32>,
}

/// How the products multiply K-quant weights (Q4_K, Q5_K, Q6_K); other formats always
/// take the float products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Products {
    /// Rows at 8 bits (a prompt's, `Precision::Fast`) on tensor cores, int8 `mma`
    /// against activations quantized as the CPU quantizes them; rows at 16 bits (decode
    /// rows) unpacked to f32 as `Float` does, the faster for one row. The default from
    /// compute capability 8.0 (int8 `mma`): on an H100, a 512-token prompt of the
    /// Qwen3-30B-A3B geometry at 3280 tok/s against 937 for `Float`, decode the same
    /// (scripts/device-notes.md, stop 54).
    Tensor,
    /// Against activations quantized to the row's precision, by `dp4a`
    /// (`SLUICE_CUDA_PRODUCTS=int`; slower than the float products in this first
    /// version, scripts/device-notes.md).
    Integer,
    /// Each weight unpacked to f32 against f32 activations (`SLUICE_CUDA_PRODUCTS=float`,
    /// and the default before compute capability 8.0).
    Float,
}

impl Products {
    fn from_env(capability: (i32, i32)) -> Products {
        match std::env::var("SLUICE_CUDA_PRODUCTS").as_deref() {
            Ok("int") => Products::Integer,
            Ok("float") => Products::Float,
            _ if capability.0 >= 8 => Products::Tensor,
            _ => Products::Float,
        }
    }
}

/// The kernels a product over the step's rows takes (`Cuda::path`). A row's bits
/// depend on its precision, never on the rows beside it: where a step mixes rows at 8
/// and 16 bits, every row is computed by the float products and the rows at 8 bits
/// again by the tensor cores, whose results replace them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Float,
    Integer,
    Tensor,
    FloatThenTensor,
}

impl Path {
    fn of(products: Products, precision: &RowPrecision, dtype: DType) -> Path {
        if !matches!(dtype, DType::Q4K | DType::Q5K | DType::Q6K) {
            return Path::Float;
        }
        match (products, precision) {
            (Products::Float, _) => Path::Float,
            (Products::Integer, _) => Path::Integer,
            (Products::Tensor, RowPrecision::All(Precision::Fast)) => Path::Tensor,
            (Products::Tensor, RowPrecision::All(Precision::Accurate)) => Path::Float,
            (Products::Tensor, RowPrecision::PerRow(_)) => Path::FloatThenTensor,
        }
    }

    fn float(self) -> bool {
        matches!(self, Path::Float | Path::FloatThenTensor)
    }

    fn tensor(self) -> bool {
        matches!(self, Path::Tensor | Path::FloatThenTensor)
    }
}

/// A weight matrix `[rows, cols]` in its stored format, in device memory.
pub struct DevMat {
    dtype: sluice_core::DType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    buf: CudaSlice<u8>,
}

impl DevMat {
    /// Device bytes `buf` as a matrix of `m`'s format and shape.
    fn shaped(m: sluice_core::MatRef<'_>, buf: CudaSlice<u8>) -> DevMat {
        DevMat { dtype: m.dtype, rows: m.rows, cols: m.cols, row_bytes: m.row_bytes(), buf }
    }
}

/// A parameter vector, on the device and (for the host-side router) on the host.
pub struct DevVector {
    host: Vec<f32>,
    dev: CudaSlice<f32>,
}

/// One layer's KV cache of one sequence: every position, or a ring of `window`.
pub struct DevKv {
    kv_dim: usize,
    window: Option<usize>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    /// Positions the buffers have room for.
    cap: usize,
    /// Positions written so far.
    len: usize,
}

/// Each row's `top_k` experts and their weights, in device memory; the ids come to
/// the host only when something there asks for them (the expert store).
pub struct DevRouting {
    top_k: usize,
    n_experts: usize,
    /// Rows times `top_k`.
    len: usize,
    ids: Scratch<u32>,
    weights: Scratch<f32>,
    host_ids: Mutex<Option<Vec<u32>>>,
    /// The grouped products' plan, where the routing's launch made it too.
    plan: Option<ExpertPlan>,
}

/// The grouped expert products' plan of a routing (kernels.cu's `plan_block`): the
/// (row, slot)s routed to each expert, expert after expert, their step rows and
/// experts, and the work items of up to `MM_ROWS` rows of one expert (and of `MT_ROWS`).
struct ExpertPlan {
    slots: Scratch<u32>,
    rows: Scratch<u32>,
    expert_of: Scratch<u32>,
    work: Scratch<u32>,
    n_work: usize,
    /// Work items of up to `MT_ROWS` rows of one expert (tiles), for the tensor-core
    /// products.
    tiles: Scratch<u32>,
    n_tiles: usize,
}

/// A MoE layer's step as its grouped products take it: the input rows, their routing
/// and its plan, the experts' kind, and the output of each (row, slot).
#[derive(Clone, Copy)]
struct MoeStep<'a> {
    x: &'a DevAct,
    routing: &'a DevRouting,
    plan: &'a ExpertPlan,
    ffn: &'a ExpertFfn<Cuda>,
    per_slot: &'a DevAct,
}

/// One expert's three matrices in device memory.
pub struct DevExpert {
    gate: DevMat,
    up: DevMat,
    down: DevMat,
}

impl DevExpert {
    fn bytes(&self) -> usize {
        self.gate.buf.len() + self.up.buf.len() + self.down.buf.len()
    }
}

/// One layer's experts for one step.
// One lives per MoE layer step, never in a collection: its size does not matter.
#[allow(clippy::large_enum_variant)]
pub enum DevExperts<'s> {
    /// The VRAM tier holds the whole layer: no ids were needed on the host.
    Whole(Arc<LayerTable>),
    /// Those the VRAM tier holds, and a lease on the host store for the others, each
    /// copied to the device (and into the tier) when [`Backend::moe`] reaches it.
    Some {
        /// The store's id and the layer: the tier's key, with the expert.
        key: (u64, usize),
        held: Vec<(usize, Arc<DevExpert>)>,
        lease: Option<ExpertLease<'s>>,
        /// Whether the lease's host bytes outlive the step where they are.
        host: HostBytes,
    },
}

/// Whether a lease's host bytes stay where they are after the step: a resident
/// store's page-locked memory does, so its misses are copied while the held experts
/// compute; a mapped store's pages and a streamed store's buffers are let go with
/// the lease, so their misses are copied (and waited for) before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostBytes {
    Stable,
    Leased,
}

/// Every expert of a layer held in VRAM, and their weights' addresses by expert id,
/// in device memory, for the grouped products.
pub struct LayerTable {
    experts: Vec<Arc<DevExpert>>,
    tables: ExpertTables,
}

/// The device addresses of the gate, up and down matrices of a layer's experts,
/// indexed by expert id (0 for an expert not on the device this step).
struct ExpertTables {
    gate: CudaSlice<u64>,
    up: CudaSlice<u64>,
    down: CudaSlice<u64>,
}

/// Experts kept in device memory after their first use, given up in the order of
/// the tier's policy (least recently used first, or least often), while the GPU keeps
/// [`VRAM_HEADROOM`] free (or within an explicit budget).
#[derive(Default)]
struct VramTier {
    map: HashMap<TierKey, Arc<DevExpert>>,
    bytes: usize,
    tick: u64,
    policy: TierPolicy,
    stats: ExpertTraffic,
    /// Experts held per (store, layer), to see when a layer is whole.
    held: HashMap<(u64, usize), usize>,
    /// The address tables of the whole layers (dropped when one of theirs is evicted).
    whole: HashMap<(u64, usize), Arc<LayerTable>>,
    /// The prefetch's copies the compute stream has not yet been ordered after.
    pending: Option<PendingCopies>,
}

/// Copies into the tier under way on the copy stream.
struct PendingCopies {
    /// Reached by the copy stream once the last prefetch's copies are done (the
    /// stream is in order, so it covers every earlier one): the compute stream waits
    /// for it before it reads the next layer's experts.
    done: cudarc::driver::CudaEvent,
    /// The experts being copied into: never evicted while pending, since their buffers
    /// would be freed on the compute stream under the copy. (Waiting for the copies at
    /// an eviction instead held a layer's products back until the next layer's copies
    /// were done: decode 82 -> 72 tok/s with the pilot at stop 51.)
    keys: Vec<TierKey>,
}

impl Drop for VramTier {
    fn drop(&mut self) {
        // The held experts are freed on the compute stream, which nothing orders
        // after copies still under way into them: wait for those first.
        if let Some(p) = &self.pending {
            let _ = p.done.synchronize();
        }
    }
}

impl VramTier {
    fn insert(&mut self, key: TierKey, x: Arc<DevExpert>) {
        self.tick += 1;
        self.bytes += x.bytes();
        self.policy.held(key, self.tick);
        if self.map.insert(key, x).is_none() {
            *self.held.entry((key.0, key.1)).or_default() += 1;
        }
    }

    /// An empty tier that gives up experts as `policy` orders, to share.
    fn shared(policy: Policy) -> Arc<Mutex<VramTier>> {
        let mut t = VramTier::default();
        t.policy = TierPolicy::new(policy);
        Arc::new(Mutex::new(t))
    }

    /// Drops expert `key`; its bytes, or `None` if it is not held.
    fn remove(&mut self, key: TierKey) -> Option<usize> {
        let gone = self.map.remove(&key)?;
        self.policy.dropped(key);
        self.bytes -= gone.bytes();
        if let Some(n) = self.held.get_mut(&(key.0, key.1)) {
            *n -= 1;
        }
        self.whole.remove(&(key.0, key.1));
        Some(gone.bytes())
    }
}

/// Device memory the VRAM tier leaves free for KV caches and activations.
const VRAM_HEADROOM: usize = 4 << 30;

/// Warps of an attention block (`ATT_WARPS` in kernels.cu).
const ATT_WARPS: usize = 4;
/// kernels.cu's attention entry points by the widest head each takes, narrowest
/// first: a lane keeps width / 32 sums in registers, so a model takes the narrowest
/// that fits its heads (the sums, and so the bits, are the same in each).
const ATT_KERNELS: [(usize, &str); 3] = [(128, "attention_128"), (256, "attention_256"), (576, "attention_576")];
const ATT_MAX_HEAD_DIM: usize = ATT_KERNELS[ATT_KERNELS.len() - 1].0;

/// `attention_tile` (kernels.cu's `PT_Q`, `PT_MAX_HD`, `PT_THREADS`, `PT_T`,
/// `PT_SHARED`): query vectors a block, the widest head, threads, positions a pass, and
/// its shared memory.
const TILE_QUERIES: usize = 64;
const TILE_MAX_HEAD_DIM: usize = 128;
const TILE_THREADS: u32 = 256;
const TILE_POSITIONS: usize = 64;
pub(crate) const ATTENTION_TILE_SHARED: u32 = ((TILE_QUERIES * (TILE_MAX_HEAD_DIM + 4)
    + TILE_POSITIONS * (TILE_MAX_HEAD_DIM + 4)
    + TILE_POSITIONS * (TILE_QUERIES + 1)
    + 3 * TILE_QUERIES)
    * 4) as u32;

/// The attention kernel for heads of `hd` dimensions: the narrowest that takes them.
fn attention_kernel(hd: usize) -> Result<&'static str> {
    match ATT_KERNELS.iter().find(|(width, _)| hd <= *width) {
        Some(&(_, kernel)) => Ok(kernel),
        None => {
            Err(Error::Unsupported(format!("cuda: attention heads of {hd} dimensions (at most {ATT_MAX_HEAD_DIM})")))
        }
    }
}

/// The blocks attention splits a row's `len` positions over, as kernels.cu's
/// `att_split_len` cuts them: runs of 64, longer once there would be more than 16.
fn attention_splits(len: usize) -> usize {
    const MAX_SPLITS: usize = 16;
    let run = len.div_ceil(MAX_SPLITS).div_ceil(64).max(1) * 64;
    len.div_ceil(run).max(1)
}

/// A run of one sequence's rows that `attention_tile` takes in one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PromptTile {
    first: usize,
    rows: usize,
}

/// The rows a block of `attention_tile` takes in a layer of `spec` (its query heads
/// sharing a kv head, `TILE_QUERIES` query vectors a block), or `None` where the kernel
/// does not take the layer: a window, or heads it does not fit.
fn tile_rows(spec: &AttentionSpec) -> Option<usize> {
    let group = spec.n_heads / spec.n_kv_heads.max(1);
    let fits = spec.window.is_none()
        && spec.head_dim <= TILE_MAX_HEAD_DIM
        && spec.head_dim % 4 == 0
        && spec.n_kv_heads * group == spec.n_heads
        && (1..=TILE_QUERIES).contains(&group);
    fits.then_some(TILE_QUERIES / group)
}

/// The tiles of up to `per_tile` rows that `attention_tile` takes of a step whose
/// sequences are `seqs` (`rings`: each one's cache ring, if it has one): the rows at 8
/// bits of a sequence with several rows in the step (a prompt's chunk; a decode row
/// keeps the split kernel, which spreads one row's positions over many blocks), each
/// tile within one sequence. Each is a fact of the row and its own sequence, so a row
/// takes the same kernel in any batch.
fn prompt_tiles(
    per_tile: usize,
    seqs: &[SeqRows],
    rings: &[Option<usize>],
    precision: &RowPrecision,
) -> Vec<PromptTile> {
    let fast = |row: usize| precision.of(row) == Precision::Fast;
    let mut tiles = Vec::new();
    for (r, ring) in seqs.iter().zip(rings) {
        if r.rows < 2 || ring.is_some() {
            continue;
        }
        let mut i = 0;
        while i < r.rows {
            let mut n = 0;
            while i + n < r.rows && n < per_tile && fast(r.first + i + n) {
                n += 1;
            }
            if n > 0 {
                tiles.push(PromptTile { first: r.first + i, rows: n });
            }
            i += n.max(1);
        }
    }
    tiles
}

/// See [`Cuda::constant`]: the constants by content, and the generation before.
#[derive(Default)]
struct Constants {
    current: HashMap<Vec<u8>, CudaSlice<u8>>,
    retired: HashMap<Vec<u8>, CudaSlice<u8>>,
}

/// The most key dims a Gated DeltaNet head may have on the device (`kernels.cu`'s
/// `DELTA_MAX_DK`: a thread holds a column of the head's state).
const DELTA_MAX_DK: usize = 256;

/// Distinct constants kept on the device before the cache of them starts again.
const CONSTANTS_KEPT: usize = 1024;

/// The CUDA backend on one GPU. Cloning shares the device and its expert tier.
#[derive(Clone)]
pub struct Cuda {
    dev: Arc<Device>,
    tier: Arc<Mutex<VramTier>>,
    /// Most bytes of experts the VRAM tier may hold (`None`: as free memory allows).
    tier_budget: Option<usize>,
    /// Most device bytes this process may take, and the device's use when it opened.
    limit: Option<(usize, usize)>,
    /// See [`Cuda::constant`].
    constants: Arc<Mutex<Constants>>,
    /// The precision of each row of the step ([`Backend::with_precision`]).
    precision: RowPrecision,
    products: Products,
}

impl Cuda {
    /// GPU `ordinal`: starts a context and compiles the kernels (a fraction of a
    /// second), or says why CUDA cannot be used here.
    pub fn open(ordinal: usize) -> Result<Cuda> {
        let dev = Arc::new(Device::open(ordinal)?);
        Ok(Cuda {
            tier: Arc::default(),
            tier_budget: None,
            limit: None,
            constants: Arc::default(),
            precision: RowPrecision::default(),
            products: Products::from_env(dev.capability()),
            dev,
        })
    }

    /// The same GPU, taking at most `bytes` of its memory: resident weights must fit
    /// (an error names the tensor that does not), and the VRAM tier stays within what
    /// they leave.
    pub fn with_memory_limit(self, bytes: usize) -> Result<Cuda> {
        let (free, total) = self.dev.memory()?;
        // Refused before any work rather than found out by the first allocation past
        // what the card has.
        if bytes > free {
            return Err(Error::Usage(format!(
                "--gpu-memory {}: more than the {} free on {} (of {})",
                sluice_experts::human_bytes(bytes as u64),
                sluice_experts::human_bytes(free as u64),
                self.dev.name,
                sluice_experts::human_bytes(total as u64)
            )));
        }
        Ok(Cuda { limit: Some((bytes, total - free)), ..self })
    }

    /// Device bytes this process has taken since it opened the GPU, and its limit.
    fn taken(&self) -> Result<Option<(usize, usize)>> {
        let (free, total) = self.dev.memory()?;
        Ok(self.taken_of(free, total))
    }

    /// [`Cuda::taken`] from a reading of free and total device memory.
    fn taken_of(&self, free: usize, total: usize) -> Option<(usize, usize)> {
        let (limit, at_open) = self.limit?;
        Some(((total - free).saturating_sub(at_open), limit))
    }

    /// The same GPU with a VRAM expert tier of its own, bounded to `bytes` (0: no
    /// tier, every expert copied from the host at each use).
    pub fn with_expert_budget(&self, bytes: usize) -> Cuda {
        Cuda { tier: self.fresh_tier(), tier_budget: Some(bytes), ..self.clone() }
    }

    /// The same GPU with a VRAM expert tier of its own that gives up experts as
    /// `policy` orders (`--cache-policy`): the least recently used, or the least used.
    pub fn with_expert_policy(&self, policy: Policy) -> Cuda {
        Cuda { tier: VramTier::shared(policy), ..self.clone() }
    }

    /// An empty VRAM tier with this one's policy.
    fn fresh_tier(&self) -> Arc<Mutex<VramTier>> {
        VramTier::shared(self.tier.lock().unwrap_or_else(|e| e.into_inner()).policy.policy())
    }

    /// Bytes of experts the VRAM tier may hold beyond what it holds now, and those
    /// it could free: within the explicit budget, or free memory less the headroom,
    /// and under `--gpu-memory`.
    fn room(&self, t: &VramTier) -> Result<usize> {
        let (free, total) = self.dev.memory()?;
        let mut room = match self.tier_budget {
            Some(b) => b.saturating_sub(t.bytes),
            None => free.saturating_sub(VRAM_HEADROOM),
        };
        if let Some((used, limit)) = self.taken_of(free, total) {
            room = room.min(limit.saturating_sub(used));
        }
        Ok(room)
    }

    /// Keeps `x` as expert `key` in the VRAM tier if it fits, evicting as the tier's
    /// policy orders.
    fn keep(&self, key: TierKey, x: Arc<DevExpert>) -> Result<()> {
        let mut t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
        if self.make_room(&mut t, x.bytes(), &[])? {
            t.insert(key, x);
        }
        Ok(())
    }

    /// Evicts as the tier's policy orders until `need` bytes fit, but none of
    /// `spare` nor of the copies under way; whether they fit. Evicted experts are freed
    /// when the last step using them lets go (on the compute stream): they count as
    /// free now.
    fn make_room(&self, t: &mut VramTier, need: usize, spare: &[TierKey]) -> Result<bool> {
        let mut room = self.room(t)?;
        while room < need {
            let copying = t.pending.as_ref().map_or(&[][..], |p| &p.keys[..]);
            let Some(gone) = t.policy.victim(|k| spare.contains(k) || copying.contains(k)) else { return Ok(false) };
            t.stats.evictions += 1;
            room += t.remove(gone).unwrap_or(0);
        }
        Ok(true)
    }

    /// Orders the compute stream after the prefetch copies queued so far.
    fn await_prefetch(&self, t: &mut VramTier) -> Result<()> {
        match t.pending.take() {
            Some(p) => self.dev.compute_after(&p.done),
            None => Ok(()),
        }
    }

    /// The address tables of `exs` (expert id and matrices) for a layer of
    /// `n_experts`, checking that they share one format and shape.
    fn tables(&self, n_experts: usize, exs: &[(usize, &DevExpert)]) -> Result<ExpertTables> {
        let Some((_, first)) = exs.first() else {
            return Err(Error::Device("cuda: an expert table of no experts (internal error)".into()));
        };
        let same = |a: &DevMat, b: &DevMat| a.dtype == b.dtype && a.rows == b.rows && a.cols == b.cols;
        if exs
            .iter()
            .any(|(_, e)| !same(&e.gate, &first.gate) || !same(&e.up, &first.up) || !same(&e.down, &first.down))
        {
            return Err(Error::Unsupported(
                "cuda: the experts of a layer are stored in different formats or shapes".into(),
            ));
        }
        let table = |m: fn(&DevExpert) -> &DevMat| -> Result<CudaSlice<u64>> {
            let mut t = vec![0u64; n_experts];
            for (e, x) in exs {
                t[*e] = self.p(&m(x).buf);
            }
            self.dev.upload(&t)
        };
        Ok(ExpertTables { gate: table(|e| &e.gate)?, up: table(|e| &e.up)?, down: table(|e| &e.down)? })
    }

    /// The whole layer's table if the tier holds all `n_experts` of it.
    fn whole_layer(&self, key: (u64, usize), n_experts: usize) -> Result<Option<Arc<LayerTable>>> {
        let mut t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = t.whole.get(&key) {
            return Ok(Some(w.clone()));
        }
        if t.held.get(&key).copied().unwrap_or(0) < n_experts || n_experts == 0 {
            return Ok(None);
        }
        let mut experts = Vec::with_capacity(n_experts);
        for e in 0..n_experts {
            let Some(x) = t.map.get(&(key.0, key.1, e)) else { return Ok(None) };
            experts.push(x.clone());
        }
        let refs: Vec<(usize, &DevExpert)> = experts.iter().map(|x| x.as_ref()).enumerate().collect();
        let tables = self.tables(n_experts, &refs)?;
        let w = Arc::new(LayerTable { experts, tables });
        t.whole.insert(key, w.clone());
        Ok(Some(w))
    }

    /// Copies a host store's expert to the device.
    fn upload_expert(&self, m: sluice_experts::ExpertRef<'_>) -> Result<Arc<DevExpert>> {
        Ok(Arc::new(DevExpert {
            gate: self.upload_mat(m.gate)?,
            up: self.upload_mat(m.up)?,
            down: self.upload_mat(m.down)?,
        }))
    }

    /// An expert of `m`'s shapes in device memory, unwritten, and the copies that fill
    /// it from `m`'s host bytes (device address, bytes) for [`Cuda::queue_copies`].
    fn empty_expert<'m>(
        &self,
        m: sluice_experts::ExpertRef<'m>,
        copies: &mut Vec<(u64, &'m [u8])>,
    ) -> Result<DevExpert> {
        let empty = |m: sluice_core::MatRef<'_>| Ok::<_, Error>(DevMat::shaped(m, self.dev.alloc::<u8>(m.data.len())?));
        let x = DevExpert { gate: empty(m.gate)?, up: empty(m.up)?, down: empty(m.down)? };
        for (d, h) in [(&x.gate, m.gate), (&x.up, m.up), (&x.down, m.down)] {
            copies.push((self.p(&d.buf), h.data));
        }
        Ok(x)
    }

    /// Queues `copies` on the copy stream after what the compute stream has queued
    /// (the allocations they fill); the event the copy stream reaches once they are
    /// done (and every copy queued before them). Whoever reads their buffers orders
    /// the compute stream after it. On an error nothing is left under way.
    ///
    /// # Safety
    /// The host bytes stay allocated and unchanged until the copy stream has passed
    /// the event (the copy engine reads page-locked memory after this returns), and
    /// each device address holds its copy's bytes.
    unsafe fn queue_copies(&self, copies: &[(u64, &[u8])]) -> Result<cudarc::driver::CudaEvent> {
        let queued = || -> Result<cudarc::driver::CudaEvent> {
            self.dev.copies_after_compute()?;
            for &(dst, host) in copies {
                // SAFETY: as the caller promises.
                unsafe { self.dev.copy_ahead(host, dst)? };
            }
            self.dev.copies_done()
        };
        queued().inspect_err(|_| {
            // Nothing is freed under a copy still under way.
            let _ = self.dev.copies.synchronize();
        })
    }

    /// Host data in device memory that stays as it is (positions, frequencies,
    /// attention's tables): uploaded once for each distinct content and found again
    /// for the next layer and step. Its address stays valid for the operation that
    /// asked, whose kernels are queued before the buffer can be freed: when the cache
    /// is full its entries become the retired generation, freed only at the next
    /// turn, some thousand constants later (an operation asks for a handful).
    fn constant<T: Copy>(&self, data: &[T]) -> Result<u64> {
        // SAFETY: plain values (integers, floats and their structs) seen as bytes.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) };
        let mut c = self.constants.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = c.current.get(bytes) {
            return Ok(self.p(d));
        }
        if c.current.len() >= CONSTANTS_KEPT {
            c.retired = std::mem::take(&mut c.current);
        }
        let d = self.dev.upload(bytes)?;
        let p = self.p(&d);
        c.current.insert(bytes.to_vec(), d);
        Ok(p)
    }

    /// Whether products with weights of `dtype` multiply rows at `precision` as
    /// quantized activations (the integer and tensor-core products) rather than as f32.
    pub fn quantizes(&self, dtype: DType, precision: Precision) -> bool {
        match Path::of(self.products, &RowPrecision::All(precision), dtype) {
            Path::Integer | Path::Tensor => true,
            Path::Float | Path::FloatThenTensor => false,
        }
    }

    /// The kernels a product with weights of `dtype` takes over the step's rows.
    fn path(&self, dtype: DType) -> Path {
        Path::of(self.products, &self.precision, dtype)
    }

    /// The GPU's name, as the driver gives it.
    pub fn device_name(&self) -> &str {
        &self.dev.name
    }

    /// Free and total device memory, in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.dev.memory()
    }

    /// An activation from host rows (for tests and callers that start from the host).
    pub fn act_from_host(&self, rows: usize, cols: usize, data: &[f32]) -> Result<DevAct> {
        if data.len() != rows * cols {
            return Err(Error::Usage(format!("{} values for a {rows} x {cols} activation", data.len())));
        }
        Ok(DevAct::new(rows, cols, self.dev.upload_scratch(data)?))
    }

    /// A parameter vector from host values (for tests).
    pub fn vector_from_host(&self, v: &[f32]) -> Result<DevVector> {
        Ok(DevVector { dev: self.dev.upload(v)?, host: v.to_vec() })
    }

    /// A routing's weights, `[rows * top_k]`, on the host (for tests).
    pub fn routing_weights(&self, r: &DevRouting) -> Result<Vec<f32>> {
        self.dev.download(&r.weights, r.len)
    }

    /// Waits for every queued operation.
    pub fn sync(&self) -> Result<()> {
        self.dev.sync()
    }

    fn act(&self, rows: usize, cols: usize) -> Result<DevAct> {
        Ok(DevAct::new(rows, cols, self.dev.scratch(rows * cols)?))
    }

    fn p<T>(&self, s: &CudaSlice<T>) -> u64 {
        self.dev.ptr(s)
    }

    /// The address of an activation a kernel is about to write: its quantized rows, if
    /// any were made, no longer hold.
    fn w(&self, x: &mut DevAct) -> u64 {
        x.quant.take();
        self.p(&x.buf)
    }

    /// `x`'s rows quantized, each at its precision, made once per activation. `map`:
    /// the step's row of each row of `x` (a grouped product's compact rows, on the
    /// device), whose precision it takes; without one, row i is the step's row i.
    fn quantized<'a>(&self, x: &'a DevAct, map: Option<u64>) -> Result<&'a DevQ> {
        if let Some(q) = x.quant.get() {
            return Ok(q);
        }
        let (rows, cols) = (x.rows, x.cols);
        let blocks = cols / 32;
        let q = DevQ {
            codes: self.dev.scratch::<u32>(2 * rows * cols / 4)?,
            scales: self.dev.scratch::<f32>(2 * rows * blocks)?,
            sums: self.dev.scratch::<u32>(2 * rows * blocks + rows)?,
        };
        // One precision for every row, or a flag per row of the step.
        let (uniform, flags) = match &self.precision {
            RowPrecision::All(p) => ((*p == Precision::Accurate) as i32, 0),
            RowPrecision::PerRow(v) => {
                let flags: Vec<u32> = v.iter().map(|&p| (p == Precision::Accurate) as u32).collect();
                if map.is_none() && flags.len() != rows {
                    return Err(Error::Device(format!(
                        "cuda: {} rows of precisions for a product of {rows} rows (internal error)",
                        flags.len()
                    )));
                }
                (-1, self.constant(&flags)?)
            }
        };
        let (codes, scales, sums) = (self.p(&q.codes), self.p(&q.scales), self.p(&q.sums));
        let warps = rows * blocks;
        launch!(&self.dev, "quantize_act", grid((warps.div_ceil(8) as u32, 1), 256, 0);
            self.p(&x.buf), rows as i32, cols as i32, uniform, flags, map.unwrap_or(0), codes, scales,
            scales + (4 * rows * blocks) as u64, sums, sums + (4 * 2 * rows * blocks) as u64)?;
        Ok(x.quant.get_or_init(|| q))
    }

    /// Where a quantized activation's arrays are, as the integer products take them.
    fn qin(&self, q: &DevQ, rows: usize, cols: usize) -> QIn {
        let blocks = (rows * cols / 32) as u64;
        let (scales, sums) = (self.p(&q.scales), self.p(&q.sums));
        QIn {
            codes: self.p(&q.codes),
            d: scales,
            sx: scales + 4 * blocks,
            s16: sums,
            wide: sums + 4 * 2 * blocks,
            rows: rows as i32,
            cols: cols as i32,
        }
    }

    /// `y_i = x · W_iᵀ` for weight bytes at device addresses `ws[i].ptr`: decode rows
    /// take matrices of one format together, one launch for up to [`MANY_MATS`].
    fn products(&self, x: &DevAct, ws: &[MatDesc]) -> Result<Vec<DevAct>> {
        if let Some(w) = ws.iter().find(|w| w.cols != x.cols) {
            return Err(Error::Device(format!(
                "cuda: a product of {} columns with a weight of {} (internal error)",
                x.cols, w.cols
            )));
        }
        let ys = ws.iter().map(|w| self.act(x.rows, w.rows)).collect::<Result<Vec<_>>>()?;
        if x.rows == 0 {
            return Ok(ys);
        }
        let (cols, rows, input) = (x.cols as i32, x.rows as i32, self.p(&x.buf));
        let row_passes = x.rows.div_ceil(MM_ROWS) as u32;
        let mut i = 0;
        while i < ws.len() {
            let (w, y_at) = (ws[i], self.p(&ys[i].buf));
            let suffix = format_suffix(w.dtype);
            let path = self.path(w.dtype);
            let qin = || Ok::<_, Error>(self.qin(self.quantized(x, None)?, x.rows, x.cols));
            if path == Path::Integer {
                launch!(&self.dev, &format!("mmq_{suffix}"), grid((w.rows as u32, row_passes), 128, 0);
                    w.ptr, w.row_bytes as i64, w.rows as i32, qin()?, y_at)?;
                i += 1;
                continue;
            }
            let ro = outputs_per_block(x.rows, w.cols);
            // The matrices this pass takes: this one, and for decode rows those after
            // it of its format, in one launch.
            let n = if path.float() && ro == 1 {
                let threads = product_threads(w.dtype, w.cols);
                launch!(&self.dev, &format!("mm_{suffix}"), grid((w.rows as u32, row_passes), threads, 0);
                    w.ptr, w.row_bytes as i64, w.rows as i32, cols, input, rows, y_at)?;
                1
            } else if path.float() {
                let (many, n) = Many::of(ro, ws[i..].iter().zip(&ys[i..]).map(|(m, y)| (m.ptr, self.p(&y.buf), *m)));
                let threads = product_threads(w.dtype, w.cols);
                launch!(&self.dev, &format!("mmo_{suffix}"), grid((many.blocks(), row_passes), threads, 0);
                    many, cols, input, rows, ro as i32)?;
                n
            } else {
                Many::of(MT_OUT, ws[i..].iter().zip(&ys[i..]).map(|(m, y)| (m.ptr, self.p(&y.buf), *m))).1
            };
            // The tensor cores over the same matrices, those of a format together.
            let mut k = i;
            while path.tensor() && k < i + n {
                let (many, m) =
                    Many::of(MT_OUT, ws[k..i + n].iter().zip(&ys[k..i + n]).map(|(m, y)| (m.ptr, self.p(&y.buf), *m)));
                let tiles = x.rows.div_ceil(MT_ROWS) as u32;
                launch!(&self.dev, &format!("mmt_{suffix}"), grid((many.blocks(), tiles), MT_THREADS, 0); many, qin()?)?;
                k += m;
            }
            i += n;
        }
        Ok(ys)
    }

    /// A host weight matrix's bytes on the device (an expert, for now at every use).
    pub fn upload_mat(&self, m: sluice_core::MatRef<'_>) -> Result<DevMat> {
        Ok(DevMat::shaped(m, self.dev.upload(m.data)?))
    }

    fn desc(&self, m: &DevMat) -> MatDesc {
        MatDesc { dtype: m.dtype, rows: m.rows, cols: m.cols, row_bytes: m.row_bytes, ptr: self.p(&m.buf) }
    }

    /// The `rms_norm` kernel over `io.len` elements in groups of `n.group`.
    fn norm_into(&self, io: NormIo, n: &Norm<'_, Self>) -> Result<()> {
        let groups = io.len / n.group.max(1);
        if groups == 0 {
            return Ok(());
        }
        let w = n.weight.map_or(0, |v| self.p(&v.dev));
        launch!(&self.dev, "rms_norm", grid((groups as u32, 1), 256, 0);
            io.x, io.add, io.y, n.group as i32, w, n.offset, n.eps)
    }

    /// What the rope kernels take of a step's positions and a RoPE: the pairs to turn
    /// are those up to the last nonzero frequency (the rest would turn by zero).
    fn rope_args(&self, batch: &Batch, rope: &RopeSpec) -> Result<RopeArgs> {
        let positions: Vec<u32> = batch.positions.iter().map(|&p| p as u32).collect();
        Ok(RopeArgs {
            positions: self.constant(&positions)?,
            inv_freq: self.constant(&rope.inv_freq)?,
            pairs: rope.inv_freq.iter().rposition(|&f| f != 0.0).map_or(0, |p| p + 1) as i32,
            style: match rope.style {
                RopeStyle::Half => 0,
                RopeStyle::Interleaved => 1,
            },
            factor: rope.attention_factor,
        })
    }

    fn same_len(&self, x: &DevAct, y: &DevAct, what: &str) -> Result<()> {
        if x.len() != y.len() {
            return Err(Error::Device(format!(
                "cuda: {what} of {} and {} elements (internal error)",
                x.len(),
                y.len()
            )));
        }
        Ok(())
    }

    /// Grows `kv` for one sequence's rows `seq` of `k` and `v` where it lacks room,
    /// and says what kernels.cu's `kv_write_layers` takes to append them (`None`: no rows).
    fn kv_room(&self, kv: &mut DevKv, k: &DevAct, v: &DevAct, seq: SeqRows) -> Result<Option<KvWrite>> {
        let (d, n) = (kv.kv_dim, seq.rows);
        if n == 0 {
            return Ok(None);
        }
        // Room for the positions held after this append: all of them, or the ring.
        let held = kv.window.map_or(kv.len + n, |w| (kv.len + n).min(w));
        if held > kv.cap {
            let cap = match kv.window {
                Some(w) => held.max((2 * kv.cap).min(w)),
                None => held.max(2 * kv.cap).max(16),
            };
            for buf in [&mut kv.k, &mut kv.v] {
                let mut grown = self.dev.zeros::<f32>(cap * d)?;
                if kv.cap > 0 {
                    self.dev
                        .stream
                        .memcpy_dtod(&buf.slice(..kv.cap * d), &mut grown.slice_mut(..kv.cap * d))
                        .map_err(|e| fail("growing a KV cache", e))?;
                }
                *buf = grown;
            }
            kv.cap = cap;
        }
        // Of a chunk longer than the ring only the last `window` rows survive.
        let skip = kv.window.map_or(0, |w| n.saturating_sub(w));
        let at = |src: &DevAct| self.p(&src.buf) + (seq.first * src.cols * 4) as u64;
        Ok(Some(KvWrite {
            kc: self.p(&kv.k),
            vc: self.p(&kv.v),
            k: at(k),
            v: at(v),
            len: kv.len as i64,
            kv_dim: d as i32,
            ring: kv.window.unwrap_or(0) as i32,
            skip: skip as i32,
            elements: (n - skip) * d,
        }))
    }

    /// Room for the plan of `j` (row, slot)s over `e` experts.
    fn expert_plan(&self, j: usize, e: usize) -> Result<ExpertPlan> {
        // Work items: at most one part-filled one per expert used, plus the full ones.
        let n_work = j.div_ceil(MM_ROWS) + e.min(j);
        let n_tiles = j.div_ceil(MT_ROWS) + e.min(j);
        Ok(ExpertPlan {
            tiles: self.dev.scratch::<u32>(4 * n_tiles)?,
            n_tiles,
            slots: self.dev.scratch::<u32>(j)?,
            rows: self.dev.scratch::<u32>(j)?,
            expert_of: self.dev.scratch::<u32>(j)?,
            // Work items (kernels.cu's `Work`) as four words each.
            work: self.dev.scratch::<u32>(4 * n_work)?,
            n_work,
        })
    }

    /// The grouped products' plan of `routing`: the one its launch made (a few rows),
    /// else one the device makes now into `made` (no ids on the host either way).
    fn routing_plan<'a>(&self, routing: &'a DevRouting, made: &'a mut Option<ExpertPlan>) -> Result<&'a ExpertPlan> {
        if let Some(p) = &routing.plan {
            return Ok(p);
        }
        let (j, k, e) = (routing.len, routing.top_k.max(1), routing.n_experts);
        let plan = self.expert_plan(j, e)?;
        launch!(&self.dev, "plan_experts", grid((1, 1), 256, plan_shared(e));
            self.p(&routing.ids), j as i32, k as i32, e as i32, self.p(&plan.slots), self.p(&plan.rows),
            self.p(&plan.expert_of), self.p(&plan.work), plan.n_work as i32, self.p(&plan.tiles),
            plan.n_tiles as i32)?;
        Ok(made.insert(plan))
    }

    /// The routed experts of `tables` on the rows of `step.x` that chose them, each
    /// (row, slot)'s output written to its row of `step.per_slot`, by the step's plan:
    /// grouped products for every expert of the layer, a launch each: gate and up (with
    /// their GLU, for decode rows), down. `shape` is any of the experts (they share one).
    fn grouped_experts(&self, step: &MoeStep<'_>, tables: &ExpertTables, shape: &DevExpert) -> Result<()> {
        let MoeStep { x, routing, plan, ffn, per_slot } = *step;
        let (j, k) = (routing.len, routing.top_k.max(1));
        if j == 0 {
            return Ok(());
        }
        let ExpertPlan { slots, rows, expert_of, work, n_work, tiles, n_tiles } = plan;
        let n_work = *n_work;
        // `xrow`: the step's row of each compact row (null: the input is the compact
        // rows themselves, whose step rows are `rows`).
        // A work item has at most as many rows as the step has (each row chooses an
        // expert once).
        let step_rows = j / k;
        // `yrow` likewise: where each compact row's output goes (null: row itself).
        // `mats`: (table of expert addresses, an expert's matrix, output) of matrices
        // that read `input`; decode rows take those of one format in one launch.
        let grouped = |mats: &[(&CudaSlice<u64>, &DevMat, &DevAct)], input: &DevAct, xrow: u64, yrow: u64| {
            let (cols, x_at, work) = (input.cols as i32, self.p(&input.buf), self.p(work));
            let mut i = 0;
            while i < mats.len() {
                let (ws, m, y) = mats[i];
                let suffix = format_suffix(m.dtype);
                let (ws, y_at) = (self.p(ws), self.p(&y.buf));
                let path = self.path(m.dtype);
                let qin = || {
                    let map = if xrow == 0 { Some(self.p(rows)) } else { None };
                    Ok::<_, Error>(self.qin(self.quantized(input, map)?, input.rows, input.cols))
                };
                if path == Path::Integer {
                    launch!(&self.dev, &format!("mmgq_{suffix}"), grid((m.rows as u32, n_work as u32), 128, 0);
                        ws, m.row_bytes as i64, m.rows as i32, qin()?, xrow, work, y_at, yrow)?;
                    i += 1;
                    continue;
                }
                let ro = outputs_per_block(step_rows, m.cols);
                let n = if path.float() && ro == 1 {
                    let threads = product_threads(m.dtype, m.cols);
                    launch!(&self.dev, &format!("mmg_{suffix}"), grid((m.rows as u32, n_work as u32), threads, 0);
                        ws, m.row_bytes as i64, m.rows as i32, cols, x_at, xrow, work, y_at, yrow)?;
                    1
                } else if path.float() {
                    let (many, n) =
                        Many::of(ro, mats[i..].iter().map(|&(t, m, y)| (self.p(t), self.p(&y.buf), self.desc(m))));
                    let threads = product_threads(m.dtype, m.cols);
                    launch!(&self.dev, &format!("mmgo_{suffix}"), grid((many.blocks(), n_work as u32), threads, 0);
                        many, cols, x_at, xrow, work, ro as i32, yrow)?;
                    n
                } else {
                    1
                };
                if path.tensor() {
                    for &(t, m, y) in &mats[i..i + n] {
                        launch!(&self.dev, &format!("mmgt_{suffix}"),
                            grid((m.rows.div_ceil(MT_OUT) as u32, *n_tiles as u32), MT_THREADS, 0);
                            self.p(t), m.row_bytes as i64, m.rows as i32, qin()?, xrow, self.p(tiles),
                            self.p(&y.buf), yrow)?;
                    }
                }
                i += n;
            }
            Ok::<(), Error>(())
        };
        let (inter, hidden) = (shape.gate.rows, shape.down.rows);
        let (gate, up) = (&shape.gate, &shape.up);
        if ffn.bias.is_none()
            && outputs_per_block(step_rows, gate.cols) == 4
            && gate.dtype == up.dtype
            && (gate.rows, gate.cols, gate.row_bytes) == (up.rows, up.cols, up.row_bytes)
            && self.path(gate.dtype) == Path::Float
        {
            // Decode rows: gate, up and their GLU in one launch (mmglu_), then down.
            let g = self.act(j, inter)?;
            let (kind, alpha, limit) = glu_args(ffn.glu);
            launch!(&self.dev, &format!("mmglu_{}", format_suffix(gate.dtype)),
                grid((inter.div_ceil(2) as u32, n_work as u32), product_threads(gate.dtype, gate.cols), 0);
                self.p(&tables.gate), self.p(&tables.up), gate.row_bytes as i64, inter as i32, gate.cols as i32,
                self.p(&x.buf), self.p(rows), self.p(work), self.p(&g.buf), kind, alpha, limit)?;
            return grouped(&[(&tables.down, &shape.down, per_slot)], &g, 0, self.p(slots));
        }
        let (mut g, mut u) = (self.act(j, inter)?, self.act(j, inter)?);
        grouped(&[(&tables.gate, &shape.gate, &g), (&tables.up, &shape.up, &u)], x, self.p(rows), 0)?;
        let bias = |a: &mut DevAct, b: &DevVector| -> Result<()> {
            let n = a.len();
            launch!(&self.dev, "add_expert_bias", elementwise(n);
                self.w(a), self.p(&b.dev), self.p(expert_of), a.cols as i32, n as i64)
        };
        let Some(b) = &ffn.bias else {
            self.glu(&mut g, &u, ffn.glu)?;
            // The down product writes each compact row's output to its slot.
            return grouped(&[(&tables.down, &shape.down, per_slot)], &g, 0, self.p(slots));
        };
        bias(&mut g, &b.gate)?;
        bias(&mut u, &b.up)?;
        self.glu(&mut g, &u, ffn.glu)?;
        // The biases are by compact row, so the down product's rows go to their slots
        // after them.
        let mut d = self.act(j, hidden)?;
        grouped(&[(&tables.down, &shape.down, &d)], &g, 0, 0)?;
        bias(&mut d, &b.down)?;
        let n = d.len();
        launch!(&self.dev, "scatter_rows", elementwise(n);
            self.p(&d.buf), self.p(slots), hidden as i32, self.p(&per_slot.buf), n as i64)
    }
}

/// Outputs one block of a product computes for `rows` input rows (the step's rows;
/// a grouped product's work items have no more) of `cols` columns: 4 for one row, 2
/// for two, else 1 (kernels.cu's `mm_block_outputs` and `mm_block`); 1 where rows are
/// not whole runs of four columns, which only `mm_block` takes. Every output has the
/// same bits for any choice, so this is speed alone: on an H100, decode of the
/// Qwen3-30B-A3B geometry 135-142 tok/s with (4, 2), 126 with (2, 2), 104 with (1, 1),
/// and the lm head's product 204, 256 and 398 us; eight for one row measured 137.6
/// against 152.9 at stop 51 (scripts/device-notes.md).
fn outputs_per_block(rows: usize, cols: usize) -> usize {
    match rows {
        _ if cols % 4 != 0 => 1,
        1 => 4,
        2 => 2,
        _ => 1,
    }
}

/// Threads a block of a float product (`mm_`, `mmg_`, and the decode rows' `mmo_`,
/// `mmgo_`, `mmglu_`) for a weight of `cols` columns: a warp per run of columns (two
/// super-blocks of Q4_K or Q5_K, one of Q6_K, 128 columns of other formats;
/// kernels.cu's `rows_loop`) up to `MM_WARPS`, so that a product of fewer runs (an
/// expert's down product of 768 columns: two) keeps no idle warp and an SM holds more
/// of its blocks. The sums are the same bits (`block_sums` adds the missing warps'
/// zeros).
fn product_threads(dtype: DType, cols: usize) -> u32 {
    let run = match dtype {
        DType::Q4K | DType::Q5K => 512,
        DType::Q6K => 256,
        _ => 128,
    };
    32 * cols.div_ceil(run).clamp(1, MM_WARPS) as u32
}

/// Shared memory of a plan over `e` experts (kernels.cu's `plan_block`: a count, a
/// start, a first work item and a first tile per expert).
fn plan_shared(e: usize) -> u32 {
    (4 * e * size_of::<i32>()) as u32
}

/// Input rows per pass of a product over the weights (`MM_ROWS` in kernels.cu).
const MM_ROWS: usize = 8;

/// Input rows and outputs of a tensor-core product's block, and its threads
/// (`MT_ROWS`, `MT_OUT`, `MT_WARPS` in kernels.cu).
const MT_ROWS: usize = 32;
const MT_OUT: usize = 64;
const MT_THREADS: u32 = 128;

/// Warps a product's block has at most (`MM_WARPS` in kernels.cu).
const MM_WARPS: usize = 4;

/// The most matrices one `mmo_`/`mmgo_` launch takes (`MANY_MATS` in kernels.cu).
const MANY_MATS: usize = 3;

/// Matrices of one format that read one input, for one launch of `mmo_` or `mmgo_`
/// (`Many` in kernels.cu): each one's weights (a grouped product's table of expert
/// addresses), output, row bytes and rows, and the launch's blocks up to the end of
/// it. Slots past the last matrix end where it does, so no block falls in them.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Many {
    w: [u64; MANY_MATS],
    y: [u64; MANY_MATS],
    row_bytes: [i64; MANY_MATS],
    out: [i32; MANY_MATS],
    end: [i32; MANY_MATS],
}

// SAFETY: addresses and integers, laid out as the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for Many {}

impl Many {
    /// The leading matrices of `mats` (weights, output, shape) that share the first
    /// one's format, up to [`MANY_MATS`], at `ro` outputs a block; and how many.
    fn of(ro: usize, mats: impl Iterator<Item = (u64, u64, MatDesc)>) -> (Many, usize) {
        let mut m = Many::default();
        let mut n = 0;
        let mut dtype = None;
        for (w, y, d) in mats.take(MANY_MATS) {
            if *dtype.get_or_insert(d.dtype) != d.dtype {
                break;
            }
            let start = if n == 0 { 0 } else { m.end[n - 1] };
            (m.w[n], m.y[n], m.row_bytes[n], m.out[n]) = (w, y, d.row_bytes as i64, d.rows as i32);
            m.end[n..].fill(start + d.rows.div_ceil(ro) as i32);
            n += 1;
        }
        (m, n)
    }

    fn blocks(&self) -> u32 {
        self.end[MANY_MATS - 1] as u32
    }
}

/// The addresses an `rms_norm` launch reads and writes: `x` (of `len` elements),
/// `add` (0: none) summed into it first, the result to `y` (which may be `x`).
struct NormIo {
    x: u64,
    add: u64,
    y: u64,
    len: usize,
}

/// The device arguments of a RoPE (`Cuda::rope_args`).
struct RopeArgs {
    positions: u64,
    inv_freq: u64,
    pairs: i32,
    style: i32,
    factor: f32,
}

/// What a product needs of a weight matrix on the device.
#[derive(Clone, Copy)]
struct MatDesc {
    dtype: sluice_core::DType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    ptr: u64,
}

/// One layer's append to a sequence's KV cache, as kernels.cu's `kv_write_layers` takes it:
/// the caches, the rows' keys and values, the cache's length, width, ring (0: none)
/// and the rows a ring drops; and the elements of keys (or values) written.
struct KvWrite {
    kc: u64,
    vc: u64,
    k: u64,
    v: u64,
    len: i64,
    kv_dim: i32,
    ring: i32,
    skip: i32,
    elements: usize,
}

/// Layers of one `kv_write_layers` launch at most (`KV_LAYERS` in kernels.cu).
const KV_LAYERS: usize = 32;

/// Up to [`KV_LAYERS`] layers' [`KvWrite`]s, as `KvWrites` in kernels.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct KvWrites {
    kc: [u64; KV_LAYERS],
    vc: [u64; KV_LAYERS],
    k: [u64; KV_LAYERS],
    v: [u64; KV_LAYERS],
    len: [i64; KV_LAYERS],
    kv_dim: [i32; KV_LAYERS],
    ring: [i32; KV_LAYERS],
    skip: [i32; KV_LAYERS],
}

// SAFETY: addresses and integers, laid out as the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for KvWrites {}

/// Attention's per-row description, as `RowMeta` in kernels.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RowMeta {
    pos: i32,
    start: i32,
    first: i32,
    seq: i32,
    /// The row's chosen positions (QSA): where they start in the list, and how many;
    /// `sel` -1 for every position up to its own.
    sel: i32,
    n_sel: i32,
}

// SAFETY: plain integers, laid out as the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for RowMeta {}

/// A quantized activation as the integer products take it, `QIn` in kernels.cu:
/// device addresses of the codes (high bytes, then a 16-bit row's low bytes), the
/// scales and the scaled sums per 32 elements, the sums per 16, the rows' widths.
#[repr(C)]
#[derive(Clone, Copy)]
struct QIn {
    codes: u64,
    d: u64,
    sx: u64,
    s16: u64,
    wide: u64,
    rows: i32,
    cols: i32,
}

// SAFETY: addresses and integers, laid out as the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for QIn {}

/// A gated unit as kernels.cu's `glu_of` takes it: its kind, alpha and limit.
fn glu_args(glu: Glu) -> (i32, f32, f32) {
    match glu {
        Glu::Gated(a) => (act_code(a), 0.0, 0.0),
        Glu::ClampedSwiglu { alpha, limit } => (2, alpha, limit),
    }
}

fn act_code(a: Activation) -> i32 {
    match a {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
        Activation::Sigmoid => 2,
    }
}

impl Backend for Cuda {
    type Act = DevAct;
    type Mat = DevMat;
    type Vector = DevVector;
    type Kv = DevKv;
    type Routing = DevRouting;
    type Experts<'s> = DevExperts<'s>;

    fn name(&self) -> &'static str {
        "cuda"
    }

    /// Each row's precision for the integer products' quantized activations (f32,
    /// f16, bf16 and the other block formats compute in f32 whatever it is).
    fn with_precision(&self, precision: RowPrecision) -> Cuda {
        Cuda { precision, ..self.clone() }
    }

    fn mat(&self, t: &TensorView) -> Result<DevMat> {
        let m = t.mat();
        if let Some((used, limit)) = self.taken()?
            && used + m.data.len() > limit
        {
            return Err(Error::Device(format!(
                "cuda: the resident weights do not fit in --gpu-memory {:.2} GiB: {:.2} GiB taken before tensor {} \
                 ({:.1} MiB)",
                limit as f64 / (1u64 << 30) as f64,
                used as f64 / (1u64 << 30) as f64,
                t.name,
                m.data.len() as f64 / (1u64 << 20) as f64
            )));
        }
        self.upload_mat(m).map_err(|e| match e {
            Error::Device(msg) => Error::Device(format!("{msg} (tensor {})", t.name)),
            e => e,
        })
    }

    fn vector(&self, t: &TensorView) -> Result<DevVector> {
        let host = t.to_f32_vec()?;
        Ok(DevVector { dev: self.dev.upload(&host)?, host })
    }

    fn embed(&self, table: &DevMat, tokens: &[u32], scale: f32) -> Result<DevAct> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(Error::TokenOutOfRange { id: t as u64, vocab_size: table.rows });
        }
        let out = self.act(tokens.len(), table.cols)?;
        if tokens.is_empty() {
            return Ok(out);
        }
        let tok = self.dev.upload_scratch(tokens)?;
        let groups = table.cols.div_ceil(4);
        let cfg = grid((tokens.len() as u32, groups.div_ceil(128) as u32), 128, 0);
        let name = format!("embed_{}", format_suffix(table.dtype));
        launch!(&self.dev, &name, cfg;
            self.p(&table.buf), table.row_bytes as i64, table.cols as i32, self.p(&tok), scale, self.p(&out.buf))?;
        Ok(out)
    }

    fn matmul(&self, x: &DevAct, w: &DevMat) -> Result<DevAct> {
        Ok(self.products(x, &[self.desc(w)])?.pop().expect("one product"))
    }

    fn matmul_many(&self, x: &DevAct, ws: &[&DevMat]) -> Result<Vec<DevAct>> {
        self.products(x, &ws.iter().map(|w| self.desc(w)).collect::<Vec<_>>())
    }

    fn rms_norm(&self, x: &mut DevAct, n: &Norm<'_, Self>) -> Result<()> {
        let at = self.w(x);
        self.norm_into(NormIo { x: at, add: 0, y: at, len: x.len() }, n)
    }

    fn normed(&self, x: &DevAct, n: &Norm<'_, Self>) -> Result<DevAct> {
        let y = self.act(x.rows, x.cols)?;
        self.norm_into(NormIo { x: self.p(&x.buf), add: 0, y: self.p(&y.buf), len: x.len() }, n)?;
        Ok(y)
    }

    fn add_normed(&self, x: &mut DevAct, add: &DevAct, n: &Norm<'_, Self>) -> Result<DevAct> {
        self.same_len(x, add, "a sum")?;
        let y = self.act(x.rows, x.cols)?;
        let io = NormIo { x: self.w(x), add: self.p(&add.buf), y: self.p(&y.buf), len: x.len() };
        self.norm_into(io, n)?;
        Ok(y)
    }

    fn add(&self, x: &mut DevAct, y: &DevAct) -> Result<()> {
        self.same_len(x, y, "a sum")?;
        let n = x.len();
        launch!(&self.dev, "add", elementwise(n); self.w(x), self.p(&y.buf), n as i64)
    }

    fn mul(&self, x: &mut DevAct, y: &DevAct) -> Result<()> {
        self.same_len(x, y, "a product")?;
        let n = x.len();
        launch!(&self.dev, "mul", elementwise(n); self.w(x), self.p(&y.buf), n as i64)
    }

    fn scale(&self, x: &mut DevAct, s: f32) -> Result<()> {
        let n = x.len();
        launch!(&self.dev, "scale", elementwise(n); self.w(x), s, n as i64)
    }

    fn mul_row(&self, x: &mut DevAct, v: &DevVector) -> Result<()> {
        let n = x.len();
        launch!(&self.dev, "mul_row", elementwise(n); self.w(x), self.p(&v.dev), x.cols as i32, n as i64)
    }

    fn add_row(&self, x: &mut DevAct, v: &DevVector) -> Result<()> {
        let n = x.len();
        launch!(&self.dev, "add_row", elementwise(n); self.w(x), self.p(&v.dev), x.cols as i32, n as i64)
    }

    fn copy(&self, x: &DevAct) -> Result<DevAct> {
        let mut y = self.act(x.rows, x.cols)?;
        if x.len() > 0 {
            self.dev
                .stream
                .memcpy_dtod(&x.buf.slice(..x.len()), &mut y.buf.slice_mut(..x.len()))
                .map_err(|e| fail("copying on the GPU", e))?;
        }
        Ok(y)
    }

    fn gather_rows(&self, x: &DevAct, rows: &[usize]) -> Result<DevAct> {
        let out = self.act(rows.len(), x.cols)?;
        let n = out.len();
        if n == 0 {
            return Ok(out);
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.dev.upload_scratch(&idx)?;
        launch!(&self.dev, "gather_rows", elementwise(n);
            self.p(&x.buf), self.p(&idx), x.cols as i32, self.p(&out.buf), n as i64)?;
        Ok(out)
    }

    fn columns(&self, x: &DevAct, start: usize, len: usize) -> Result<DevAct> {
        let out = self.act(x.rows, len)?;
        let n = out.len();
        if n == 0 {
            return Ok(out);
        }
        launch!(&self.dev, "columns", elementwise(n);
            self.p(&x.buf), x.cols as i32, start as i32, len as i32, self.p(&out.buf), n as i64)?;
        Ok(out)
    }

    fn delta_net(&self, op: &DeltaOp<'_, Self>) -> Result<(DevAct, Vec<DevAct>)> {
        let d = op.spec;
        let (c, rows) = (d.conv_dim(), op.mixed.rows);
        if d.k_dim > DELTA_MAX_DK || d.v_dim > 1024 {
            return Err(Error::Unsupported(format!(
                "cuda: Gated DeltaNet heads of {}x{} (at most {DELTA_MAX_DK} key and 1024 value dims)",
                d.k_dim, d.v_dim
            )));
        }
        let out = self.act(rows, d.v_heads * d.v_dim)?;
        let next = op.states.iter().map(|_| self.act(1, d.state_len())).collect::<Result<Vec<_>>>()?;
        let n_seqs = op.batch.seqs.len();
        if rows == 0 || n_seqs == 0 {
            return Ok((out, next));
        }
        let conv = self.act(rows, c)?;
        let ins: Vec<u64> = op.states.iter().map(|s| self.p(&s.buf)).collect();
        let outs: Vec<u64> = next.iter().map(|s| self.p(&s.buf)).collect();
        let first: Vec<i32> = op.batch.seqs.iter().map(|s| s.first as i32).collect();
        let lens: Vec<i32> = op.batch.seqs.iter().map(|s| s.rows as i32).collect();
        let (ins, outs, first, lens) =
            (self.constant(&ins)?, self.constant(&outs)?, self.constant(&first)?, self.constant(&lens)?);
        launch!(&self.dev, "delta_conv", grid((c.div_ceil(128) as u32, n_seqs as u32), 128, 0);
            self.p(&op.mixed.buf), self.p(&op.conv.dev), ins, outs, first, lens, c as i32, d.conv_kernel as i32,
            self.p(&conv.buf))?;
        let order = match d.v_order {
            HeadOrder::Grouped => 0i32,
            HeadOrder::Tiled => 1,
        };
        let skip = ((d.conv_kernel - 1) * c) as i64;
        launch!(&self.dev, "delta_rule", grid((d.v_heads as u32, n_seqs as u32), d.v_dim.next_multiple_of(32) as u32, 0);
            self.p(&conv.buf), self.p(&op.b.buf), self.p(&op.a.buf), self.p(&op.a_neg.dev), self.p(&op.dt_bias.dev),
            ins, outs, first, lens, d.k_heads as i32, d.v_heads as i32, d.k_dim as i32, d.v_dim as i32, order, skip,
            self.p(&out.buf))?;
        Ok((out, next))
    }

    fn scale_rows(&self, x: &mut DevAct, s: &DevAct) -> Result<()> {
        if s.rows != x.rows || s.cols != 1 {
            return Err(Error::Unsupported(format!("scale_rows: a {}x{} scale for {} rows", s.rows, s.cols, x.rows)));
        }
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        launch!(&self.dev, "scale_rows", elementwise(n); self.w(x), self.p(&s.buf), x.cols as i32, n as i64)
    }

    fn copy_columns(&self, dst: &mut DevAct, to: HeadCols, src: &DevAct, from: HeadCols) -> Result<()> {
        check_head_cols((dst.rows, dst.cols), to, (src.rows, src.cols), from)?;
        let n = dst.rows * to.heads * to.len;
        if n == 0 {
            return Ok(());
        }
        launch!(&self.dev, "copy_columns", elementwise(n);
            self.w(dst), dst.cols as i32, to.start as i32, self.p(&src.buf), src.cols as i32, from.start as i32,
            to.heads as i32, to.len as i32, n as i64)
    }

    fn activate(&self, x: &mut DevAct, act: Activation) -> Result<()> {
        let n = x.len();
        launch!(&self.dev, "activate", elementwise(n); self.w(x), act_code(act), n as i64)
    }

    fn glu(&self, gate: &mut DevAct, up: &DevAct, glu: Glu) -> Result<()> {
        self.same_len(gate, up, "a gated unit")?;
        let n = gate.len();
        let (kind, alpha, limit) = glu_args(glu);
        launch!(&self.dev, "glu", elementwise(n); self.w(gate), self.p(&up.buf), kind, alpha, limit, n as i64)
    }

    fn softcap(&self, x: &mut DevAct, cap: f32) -> Result<()> {
        let n = x.len();
        launch!(&self.dev, "softcap", elementwise(n); self.w(x), cap, n as i64)
    }

    fn rope(&self, x: &mut DevAct, head_dim: usize, batch: &Batch, rope: &RopeSpec) -> Result<()> {
        let r = self.rope_args(batch, rope)?;
        let total = x.rows * (x.cols / head_dim) * r.pairs as usize;
        if total == 0 {
            return Ok(());
        }
        launch!(&self.dev, "rope", elementwise(total);
            self.w(x), x.cols as i32, head_dim as i32, r.positions, r.inv_freq, r.pairs, r.style, r.factor,
            total as i64)
    }

    fn norm_rope(&self, x: &mut DevAct, n: &Norm<'_, Self>, batch: &Batch, rope: &RopeSpec) -> Result<()> {
        let (Some(weight), hd) = (n.weight, n.group) else {
            self.rms_norm(x, n)?;
            return self.rope(x, n.group, batch, rope);
        };
        if hd == 0 || x.cols % hd != 0 {
            return Err(Error::Device(format!("cuda: heads of {hd} in rows of {} (internal error)", x.cols)));
        }
        if x.len() == 0 {
            return Ok(());
        }
        let r = self.rope_args(batch, rope)?;
        launch!(&self.dev, "norm_rope", grid(((x.cols / hd) as u32, x.rows as u32), 256, 0);
            self.w(x), x.cols as i32, self.p(&weight.dev), 0u64, 0i32, 0u64, hd as i32, n.offset, n.eps,
            r.positions, r.inv_freq, r.pairs, r.style, r.factor)
    }

    fn norm_rope_qk(
        &self,
        q: &mut DevAct,
        qn: &Norm<'_, Self>,
        k: &mut DevAct,
        kn: &Norm<'_, Self>,
        batch: &Batch,
        rope: &RopeSpec,
    ) -> Result<()> {
        let hd = qn.group;
        let one_launch = (qn.offset, qn.eps) == (kn.offset, kn.eps)
            && kn.group == hd
            && hd > 0
            && q.cols % hd == 0
            && k.cols % hd == 0
            && q.rows == k.rows
            && q.len() > 0;
        let (Some(qw), Some(kw), true) = (qn.weight, kn.weight, one_launch) else {
            self.norm_rope(q, qn, batch, rope)?;
            return self.norm_rope(k, kn, batch, rope);
        };
        let r = self.rope_args(batch, rope)?;
        launch!(&self.dev, "norm_rope", grid(((q.cols / hd + k.cols / hd) as u32, q.rows as u32), 256, 0);
            self.w(q), q.cols as i32, self.p(&qw.dev), self.w(k), k.cols as i32, self.p(&kw.dev), hd as i32,
            qn.offset, qn.eps, r.positions, r.inv_freq, r.pairs, r.style, r.factor)
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<DevAct> {
        Ok(DevAct::new(rows, cols, self.dev.zeros_scratch(rows * cols)?))
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<DevAct> {
        self.act_from_host(rows, cols, data)
    }

    fn kv_new(&self, layout: &KvLayout) -> Result<DevKv> {
        if layout.format != KvFormat::F32 {
            // The CUDA kernels read f32 caches; 16-bit and coded caches are the CPU's
            // for now (Model::kv_format defaults to 32 on this backend).
            return Err(Error::Unsupported(format!(
                "--kv-bits {} with --backend cuda: the CUDA backend keeps its KV cache in f32 (--kv-bits 32)",
                layout.format
            )));
        }
        let (kv_dim, window) = (layout.kv_dim, layout.window);
        Ok(DevKv { kv_dim, window, k: self.dev.alloc(1)?, v: self.dev.alloc(1)?, cap: 0, len: 0 })
    }

    fn kv_bytes(&self, kv: &DevKv) -> usize {
        kv.cap * self.kv_bytes_per_position(kv)
    }

    fn kv_bytes_per_position(&self, kv: &DevKv) -> usize {
        2 * kv.kv_dim * 4
    }

    fn kv_prefix(&self, kv: &DevKv, keep: usize) -> Result<Option<DevKv>> {
        let first = kv.window.map_or(0, |w| kv.len.saturating_sub(w));
        let from = kv.window.map_or(0, |w| keep.saturating_sub(w));
        if keep > kv.len || from < first {
            return Ok(None);
        }
        // Slots as the host cache's: position `pos` in `pos % window` of a ring, so the
        // first `min(keep, window)` slots hold positions `from..keep` as they are.
        let rows = kv.window.map_or(keep, |w| keep.min(w)).max(1);
        let n = keep.min(rows).min(kv.cap) * kv.kv_dim;
        let copy = |src: &CudaSlice<f32>| -> Result<CudaSlice<f32>> {
            let mut buf = self.dev.zeros::<f32>(rows * kv.kv_dim)?;
            if n > 0 {
                self.dev
                    .stream
                    .memcpy_dtod(&src.slice(..n), &mut buf.slice_mut(..n))
                    .map_err(|e| fail("copying a KV cache's prefix", e))?;
            }
            Ok(buf)
        };
        let out =
            DevKv { kv_dim: kv.kv_dim, window: kv.window, k: copy(&kv.k)?, v: copy(&kv.v)?, cap: rows, len: keep };
        Ok(Some(out))
    }

    fn kv_append(&self, kv: &mut DevKv, k: &DevAct, v: &DevAct, seq: SeqRows) -> Result<()> {
        self.kv_append_layers(vec![KvAppend { kv, k, v }], seq)
    }

    fn kv_append_layers(&self, mut appends: Vec<KvAppend<'_, Self>>, seq: SeqRows) -> Result<()> {
        for chunk in appends.chunks_mut(KV_LAYERS) {
            let mut t = KvWrites::default();
            let (mut layers, mut most) = (0, 0);
            for a in chunk.iter_mut() {
                let Some(w) = self.kv_room(a.kv, a.k, a.v, seq)? else { continue };
                let l = layers;
                (t.kc[l], t.vc[l], t.k[l], t.v[l]) = (w.kc, w.vc, w.k, w.v);
                (t.len[l], t.kv_dim[l], t.ring[l], t.skip[l]) = (w.len, w.kv_dim, w.ring, w.skip);
                most = most.max(w.elements);
                layers += 1;
            }
            if layers > 0 {
                let blocks = elementwise(2 * most).grid_dim.0;
                launch!(&self.dev, "kv_write_layers", grid((blocks, layers as u32), 256, 0); t, seq.rows as i32)?;
            }
            for a in chunk.iter_mut() {
                a.kv.len += seq.rows;
            }
        }
        Ok(())
    }

    fn attention(&self, op: &AttnOp<'_, Self>) -> Result<DevAct> {
        let s = op.spec;
        let hd = s.head_dim;
        let rows = op.q.rows;
        let out = self.act(rows, op.q.cols)?;
        if rows == 0 {
            return Ok(out);
        }
        let mut meta = vec![RowMeta::default(); rows];
        // The most blocks a row's positions are split over.
        let mut splits = 1;
        for (si, (r, cache)) in op.batch.seqs.iter().zip(op.caches).enumerate() {
            let start = cache.len;
            for i in 0..r.rows {
                let pos = start + i;
                let lo = s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                if lo < cache.window.map_or(0, |w| cache.len.saturating_sub(w)) {
                    return Err(Error::Device(format!("cuda: attention: position {lo} is no longer in the cache")));
                }
                let n = op.select.map_or(pos + 1 - lo, |sel| sel[r.first + i].len());
                splits = splits.max(attention_splits(n));
                meta[r.first + i] = RowMeta {
                    pos: pos as i32,
                    start: start as i32,
                    first: r.first as i32,
                    seq: si as i32,
                    sel: -1,
                    n_sel: 0,
                };
            }
        }
        // Each row's chosen positions one after another, where it has them.
        let mut chosen: Vec<u32> = Vec::new();
        if let Some(sel) = op.select {
            for (m, positions) in meta.iter_mut().zip(sel) {
                if positions.iter().any(|&j| j as i32 > m.pos) {
                    return Err(Error::Usage(format!("attention: a position chosen after row position {}", m.pos)));
                }
                m.sel = chosen.len() as i32;
                m.n_sel = positions.len() as i32;
                chosen.extend_from_slice(positions);
            }
        }
        // The kernel reads the list only for rows that have one; an empty one is a
        // one-element placeholder (a constant: no copy to the device in every layer).
        let chosen_keep;
        let chosen = if chosen.is_empty() {
            self.constant(&[0u32])?
        } else {
            chosen_keep = self.dev.upload_scratch(&chosen)?;
            self.p(&chosen_keep)
        };
        let kc: Vec<u64> = op.caches.iter().map(|c| self.p(&c.k)).collect();
        let vc: Vec<u64> = op.caches.iter().map(|c| self.p(&c.v)).collect();
        let ring: Vec<i32> = op.caches.iter().map(|c| c.window.unwrap_or(0) as i32).collect();
        let (kc, vc, ring, meta) =
            (self.constant(&kc)?, self.constant(&vc)?, self.constant(&ring)?, self.constant(&meta)?);
        let rings: Vec<Option<usize>> = op.caches.iter().map(|c| c.window).collect();
        let tiles = match tile_rows(s) {
            Some(per_tile) if op.select.is_none() => prompt_tiles(per_tile, &op.batch.seqs, &rings, &self.precision),
            _ => Vec::new(),
        };
        let sinks = op.sinks.map_or(0, |v| self.p(&v.dev));
        // Every row through the split kernel unless the tiles take them all; the tiles'
        // rows are then written again, by their own kernel, after the merge.
        if tiles.iter().map(|t| t.rows).sum::<usize>() < rows {
            let kernel = attention_kernel(hd)?;
            let part = self.dev.scratch::<f32>(rows * s.n_heads * splits * (hd + 2))?;
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: (s.n_heads as u32, rows as u32, splits as u32),
                block_dim: (32 * ATT_WARPS as u32, 1, 1),
                shared_mem_bytes: ((hd + ATT_WARPS * (hd + 2)) * 4) as u32,
            };
            let window = s.window.unwrap_or(0) as i32;
            launch!(&self.dev, kernel, cfg;
                self.p(&op.q.buf), self.p(&op.k.buf), self.p(&op.v.buf), kc, vc, ring,
                meta, chosen, s.n_heads as i32, s.n_kv_heads as i32, hd as i32, s.scale, window, 0.0f32,
                splits as i32, self.p(&part))?;
            launch!(&self.dev, "attention_merge", grid((s.n_heads as u32, rows as u32), 128, 0);
                self.p(&part), meta, sinks, s.n_heads as i32, hd as i32, window, splits as i32, self.p(&out.buf))?;
        }
        if !tiles.is_empty() {
            let list: Vec<u32> = tiles.iter().flat_map(|t| [t.first as u32, t.rows as u32]).collect();
            // The same list for every full-attention layer of the step: a constant.
            let list = self.constant(&list)?;
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: (s.n_kv_heads as u32, tiles.len() as u32, 1),
                block_dim: (TILE_THREADS, 1, 1),
                shared_mem_bytes: ATTENTION_TILE_SHARED,
            };
            launch!(&self.dev, "attention_tile", cfg;
                self.p(&op.q.buf), self.p(&op.k.buf), self.p(&op.v.buf), kc, vc, meta, list,
                s.n_heads as i32, s.n_kv_heads as i32, hd as i32, s.scale, 0.0f32, sinks, self.p(&out.buf))?;
        }
        Ok(out)
    }

    fn route(&self, logits: &DevAct, r: &RouterOp<Self>) -> Result<DevRouting> {
        let (rows, e, k) = (logits.rows, r.n_experts, r.top_k);
        let len = rows * k;
        let on_device = match r.kind {
            RouterKind::Softmax { normalize_top_k } => Some((0, normalize_top_k)),
            RouterKind::Gemma4 => Some((0, true)),
            RouterKind::TopKSoftmax => Some((1, false)),
            RouterKind::SigmoidGroupLimited { .. } => None,
        };
        // The kernel holds eight experts per lane and gives one chosen expert to each.
        if let Some((kind, renorm)) = on_device
            && e <= 256
            && k <= 32
            && r.choice_bias.is_none()
        {
            let (ids, weights) = (self.dev.scratch::<u32>(len)?, self.dev.scratch::<f32>(len)?);
            let vec = |v: &Option<DevVector>| v.as_ref().map_or(0, |v| self.p(&v.dev));
            let (logits, bias, scale) = (self.p(&logits.buf), vec(&r.logit_bias), vec(&r.expert_scale));
            let mut plan = None;
            if (1..=4).contains(&rows) {
                // A block of four warps routes up to four rows and then plans their
                // products: one launch instead of two.
                let p = self.expert_plan(len, e)?;
                launch!(&self.dev, "route_plan", grid((1, 1), 128, plan_shared(e));
                    logits, rows as i32, e as i32, k as i32, kind, renorm as i32, bias, scale, self.p(&ids),
                    self.p(&weights), self.p(&p.slots), self.p(&p.rows), self.p(&p.expert_of), self.p(&p.work),
                    p.n_work as i32, self.p(&p.tiles), p.n_tiles as i32)?;
                plan = Some(p);
            } else if rows > 0 {
                launch!(&self.dev, "route_top_k", grid((rows.div_ceil(4) as u32, 1), 128, 0);
                    logits, rows as i32, e as i32, k as i32, kind, renorm as i32, bias, scale, self.p(&ids),
                    self.p(&weights))?;
            }
            return Ok(DevRouting { top_k: k, n_experts: e, len, ids, weights, host_ids: Mutex::new(None), plan });
        }
        // The others on the host, as the CPU backend routes.
        let host = self.dev.download(&logits.buf, logits.len())?;
        let p = sluice_cpu::router::RouteParams {
            kind: r.kind,
            n_experts: e,
            top_k: k,
            logit_bias: r.logit_bias.as_ref().map(|v| v.host.as_slice()),
            choice_bias: r.choice_bias.as_ref().map(|v| v.host.as_slice()),
            expert_scale: r.expert_scale.as_ref().map(|v| v.host.as_slice()),
        };
        let (mut ids, mut weights) = (Vec::new(), Vec::new());
        sluice_cpu::router::route(&host, &p, &mut ids, &mut weights);
        Ok(DevRouting {
            top_k: k,
            n_experts: e,
            len,
            ids: self.dev.upload_scratch(&ids)?,
            weights: self.dev.upload_scratch(&weights)?,
            host_ids: Mutex::new(Some(ids)),
            plan: None,
        })
    }

    fn routing_ids(&self, r: &DevRouting) -> Result<Vec<u32>> {
        let mut host = r.host_ids.lock().unwrap_or_else(|e| e.into_inner());
        if host.is_none() {
            *host = Some(self.dev.download(&r.ids, r.len)?);
        }
        Ok(host.clone().unwrap_or_default())
    }

    fn fetch_routed<'s>(&self, store: &'s ExpertStore, layer: usize, routing: &DevRouting) -> Result<DevExperts<'s>> {
        self.await_prefetch(&mut self.tier.lock().unwrap_or_else(|e| e.into_inner()))?;
        if let Some(w) = self.whole_layer((store.id(), layer), store.n_experts(layer))? {
            self.tier.lock().unwrap_or_else(|e| e.into_inner()).stats.whole_layers += 1;
            return Ok(DevExperts::Whole(w));
        }
        let ids = self.routing_ids(routing)?;
        self.fetch_experts(store, layer, &sluice_engine::moe::unique(&ids))
    }

    fn fetch_experts<'s>(&self, store: &'s ExpertStore, layer: usize, ids: &[usize]) -> Result<DevExperts<'s>> {
        let (mut held, mut missing) = (Vec::new(), Vec::new());
        {
            let mut t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
            self.await_prefetch(&mut t)?;
            t.tick += 1;
            let tick = t.tick;
            for &e in ids {
                let key = (store.id(), layer, e);
                t.policy.used(key);
                match t.map.get(&key).cloned() {
                    Some(x) => {
                        t.policy.held(key, tick);
                        held.push((e, x));
                    }
                    None => missing.push(e),
                }
            }
            t.stats.vram_hits += held.len() as u64;
        }
        // The store counts what it serves; the routing histogram wants every choice.
        store.note_routed(layer, &held.iter().map(|(e, _)| *e).collect::<Vec<_>>());
        let lease =
            if missing.is_empty() { None } else { Some(store.fetch_with(layer, &missing, FetchMode::Stream)?) };
        let host = if store.residency() == Residency::Resident { HostBytes::Stable } else { HostBytes::Leased };
        Ok(DevExperts::Some { key: (store.id(), layer), held, lease, host })
    }

    /// Copies the pilot's picks that the tier lacks into it on the copy stream, most
    /// picked first, while room lasts without giving up another of them. Only from a
    /// resident store, whose page-locked buffers the copy engine reads after this
    /// returns; a mapped store's pages would be staged by the host (holding it back
    /// from queuing this layer's work), and a streamed store's reads are the store's
    /// own read-ahead.
    fn prefetch_experts(&self, store: &ExpertStore, layer: usize, ids: &[usize]) -> Result<()> {
        if store.residency() != Residency::Resident || self.tier_budget == Some(0) {
            return Ok(());
        }
        let mut t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
        let missing: Vec<usize> =
            ids.iter().copied().filter(|&e| !t.map.contains_key(&(store.id(), layer, e))).collect();
        if missing.is_empty() {
            return Ok(());
        }
        let lease = store.fetch_with(layer, &missing, FetchMode::Ahead)?;
        let taken = missing.iter().map(|&e| Ok((e, lease.take(e)?))).collect::<Result<Vec<_>>>()?;
        // Each pick kept as its buffers are allocated (so that the tier's room counts
        // it: evicted experts free their memory only later), most picked first, while
        // room lasts without giving up another of them; copied below.
        let mut keys: Vec<TierKey> = Vec::new();
        let mut copies: Vec<(u64, &[u8])> = Vec::new();
        let mut kept = || -> Result<()> {
            for (e, taken) in &taken {
                let m = taken.mats();
                if !self.make_room(&mut t, m.gate.data.len() + m.up.data.len() + m.down.data.len(), &keys)? {
                    break;
                }
                let x = self.empty_expert(m, &mut copies)?;
                keys.push((store.id(), layer, *e));
                t.insert((store.id(), layer, *e), Arc::new(x));
            }
            if copies.is_empty() {
                return Ok(());
            }
            // SAFETY: a resident store's buffers live and stay as they are as long as
            // the store, which outlives its model's steps (and the context's sync
            // before it unlocks them); each address was allocated for its bytes above.
            let done = unsafe { self.queue_copies(&copies)? };
            // The copy stream is in order: the new event covers copies still pending.
            // The compute stream waits for it before it reads one or frees one
            // (await_prefetch).
            let mut keys_copying = t.pending.take().map_or(Vec::new(), |p| p.keys);
            keys_copying.extend_from_slice(&keys);
            t.pending = Some(PendingCopies { done, keys: keys_copying });
            t.stats.prefetched += keys.len() as u64;
            t.stats.fill_bytes += copies.iter().map(|(_, h)| h.len() as u64).sum::<u64>();
            Ok(())
        };
        let done = kept();
        if done.is_err() {
            // Nothing half-copied stays in the tier.
            for k in keys {
                t.remove(k);
            }
        }
        done
    }

    fn experts_ready(&self, experts: &DevExperts<'_>) -> Result<()> {
        match experts {
            DevExperts::Some { lease: Some(l), .. } => l.wait_all(),
            _ => Ok(()),
        }
    }

    fn experts_queued(&self, experts: &DevExperts<'_>) -> bool {
        // A resident store's misses are copied in `moe`, on the copy stream that the
        // pilot's copies ahead take too: this layer's go first.
        matches!(experts, DevExperts::Some { lease: Some(_), host: HostBytes::Stable, .. })
    }

    fn experts_waited(&self, experts: &DevExperts<'_>) -> std::time::Duration {
        match experts {
            DevExperts::Some { lease: Some(l), .. } => l.waited(),
            _ => std::time::Duration::ZERO,
        }
    }

    fn expert_room(&self) -> Result<Option<u64>> {
        let t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
        Ok(Some(self.room(&t)? as u64))
    }

    /// Three launches: the attention's norm (the residual's sum fused in), the
    /// queries' and keys' norm and RoPE, the experts' norm (likewise). The KV writes
    /// are one launch a step for all layers; routing, plan and combine are timed with
    /// the experts, the split attention's join with attention.
    fn small_ops_per_layer(&self) -> usize {
        3
    }

    fn device_rates(&self) -> Result<Option<DeviceRates>> {
        let (_, total) = self.dev.memory()?;
        let rates = self.dev.copy_rates()?;
        Ok(Some(DeviceRates {
            name: self.dev.name.clone(),
            total_bytes: total as u64,
            copy_bytes_per_s: rates.within,
            locked_bytes_per_s: rates.locked,
            pageable_bytes_per_s: rates.pageable,
        }))
    }

    fn page_lock(&self) -> Option<PageLock> {
        Some(PageLock(Arc::new(HostLocker { ctx: self.dev.ctx.clone() })))
    }

    fn expert_traffic(&self) -> Option<ExpertTraffic> {
        let t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
        Some(ExpertTraffic { vram_bytes: t.bytes as u64, ..t.stats })
    }

    fn adopt_experts(&self, store: &ExpertStore, mut progress: Option<&mut dyn FnMut(u64, u64)>) -> Result<()> {
        let total = store.total_bytes();
        {
            let t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
            if total == 0 || (total as usize) > self.room(&t)? {
                return Ok(());
            }
        }
        let mut done = 0u64;
        for layer in 0..store.layout().layers.len() {
            let ids: Vec<usize> = (0..store.n_experts(layer)).collect();
            if ids.is_empty() {
                continue;
            }
            let lease = store.fetch_with(layer, &ids, FetchMode::Ahead)?;
            for e in lease.order() {
                let x = self.upload_expert(lease.take(e)?.mats())?;
                done += x.bytes() as u64;
                let mut t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
                t.stats.adopted += 1;
                t.insert((store.id(), layer, e), x);
                drop(t);
                if let Some(p) = progress.as_deref_mut() {
                    p(done, total);
                }
            }
            self.whole_layer((store.id(), layer), ids.len())?;
        }
        Ok(())
    }

    fn moe(&self, x: &DevAct, routing: &DevRouting, experts: &DevExperts<'_>, ffn: &ExpertFfn<Self>) -> Result<DevAct> {
        // Each (row, slot)'s expert output, then their weighted sum in router order.
        if routing.len == 0 {
            return self.zeros(x.rows, x.cols);
        }
        let per_slot = self.act(routing.len, x.cols)?;
        // The plan is made once for every pass below.
        let mut made = None;
        match experts {
            DevExperts::Whole(w) => {
                let shape = w.experts.first().expect("a whole layer has experts");
                let plan = self.routing_plan(routing, &mut made)?;
                let step = MoeStep { x, routing, plan, ffn, per_slot: &per_slot };
                self.grouped_experts(&step, &w.tables, shape)?;
            }
            DevExperts::Some { key, held, lease, host } => {
                // Where the misses' host bytes stay put until the copy engine has read
                // them, their copies run on the copy stream while the held experts are
                // computed (the grouped products pass over the experts a table lacks,
                // and a slot's output is the same expression whichever launch writes
                // it), then the misses'. An expert bias is added to every row, so a
                // layer with biases takes all its experts in one pass.
                let overlap = *host == HostBytes::Stable && ffn.bias.is_none();
                let taken = match lease {
                    Some(l) => l.order().into_iter().map(|e| Ok((e, l.take(e)?))).collect::<Result<Vec<_>>>()?,
                    None => Vec::new(),
                };
                let mut filled: Vec<(usize, Arc<DevExpert>)> = Vec::with_capacity(taken.len());
                let mut copies = Vec::new();
                for (e, t) in &taken {
                    let ex = match overlap {
                        true => Arc::new(self.empty_expert(t.mats(), &mut copies)?),
                        false => self.upload_expert(t.mats())?,
                    };
                    filled.push((*e, ex));
                }
                let Some((_, shape)) = held.first().or(filled.first()) else { return self.zeros(x.rows, x.cols) };
                let shape = shape.clone();
                // The passes' address tables first: their uploads wait for the compute
                // stream, which has only the allocations queued now.
                fn refs(v: &[(usize, Arc<DevExpert>)]) -> Vec<(usize, &DevExpert)> {
                    v.iter().map(|(e, x)| (*e, x.as_ref())).collect()
                }
                let passes = if copies.is_empty() {
                    vec![[refs(held), refs(&filled)].concat()]
                } else {
                    vec![refs(held), refs(&filled)]
                };
                let tables = passes
                    .iter()
                    .filter(|p| !p.is_empty())
                    .map(|p| self.tables(routing.n_experts, p))
                    .collect::<Result<Vec<_>>>()?;
                // SAFETY: `HostBytes::Stable`: a resident store's bytes live and stay as
                // they are as long as the store, which outlives its model's steps (and
                // the context's sync before it unlocks them); each address was
                // allocated for its bytes above.
                let copied = if copies.is_empty() { None } else { Some(unsafe { self.queue_copies(&copies)? }) };
                let mut computed = || -> Result<()> {
                    let plan = self.routing_plan(routing, &mut made)?;
                    let step = MoeStep { x, routing, plan, ffn, per_slot: &per_slot };
                    for (e, ex) in &filled {
                        let mut t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
                        t.stats.host_fills += 1;
                        t.stats.fill_bytes += ex.bytes() as u64;
                        drop(t);
                        self.keep((key.0, key.1, *e), ex.clone())?;
                    }
                    let last = tables.len() - 1;
                    for (i, t) in tables.iter().enumerate() {
                        if let (true, Some(done)) = (i == last, &copied) {
                            self.dev.compute_after(done)?;
                        }
                        self.grouped_experts(&step, t, &shape)?;
                    }
                    Ok(())
                };
                if let Err(e) = computed() {
                    // Nothing is freed under a copy still under way.
                    let _ = self.dev.copies.synchronize();
                    return Err(e);
                }
                // `held` and `filled` keep the experts until their products are queued
                // after the copies: one evicted meanwhile is freed on the compute
                // stream only after it has waited for them.
            }
        }
        let out = self.act(x.rows, x.cols)?;
        let n = out.len();
        if n > 0 {
            launch!(&self.dev, "combine", elementwise(n);
                self.p(&per_slot.buf), self.p(&routing.weights), routing.top_k.max(1) as i32, x.cols as i32,
                self.p(&out.buf), n as i64)?;
        }
        Ok(out)
    }

    fn to_host(&self, x: &DevAct) -> Result<Vec<f32>> {
        self.dev.download(&x.buf, x.len())
    }

    fn n_rows(&self, x: &DevAct) -> usize {
        x.rows
    }

    fn n_cols(&self, x: &DevAct) -> usize {
        x.cols
    }
}

#[cfg(test)]
mod tests {
    use super::{
        ATT_KERNELS, MANY_MATS, Many, MatDesc, Path, Products, PromptTile, RowPrecision, SeqRows, attention_kernel,
        attention_splits, product_threads, prompt_tiles,
    };
    use crate::device::{Unit, kernel_names};
    use sluice_core::DType;

    /// Heads take the narrowest attention kernel that fits them (Qwen's 128, Gemma's
    /// 256 and 512, DeepSeek-V3's latent 576), wider ones one clear error; and each
    /// kernel is one the common unit compiles and loads.
    #[test]
    fn heads_take_the_narrowest_attention_kernel() {
        for (hd, want) in
            [(64, "attention_128"), (128, "attention_128"), (192, "attention_256"), (256, "attention_256")]
                .into_iter()
                .chain([(512, "attention_576"), (576, "attention_576")])
        {
            assert_eq!(attention_kernel(hd).unwrap(), want, "heads of {hd}");
        }
        let err = attention_kernel(640).unwrap_err().to_string();
        assert!(err.contains("640 dimensions") && err.contains("at most 576"), "{err}");
        // Each is one of the common unit's, defined in kernels.cu with width / 32 sums
        // a lane.
        let common = kernel_names(Unit::Common);
        let source = include_str!("kernels.cu");
        for (width, k) in ATT_KERNELS {
            assert!(common.iter().any(|c| c == k), "{k} is not among the common unit's kernels");
            let entry = format!("ATTENTION_ENTRY({k}, {})", width / 32);
            assert!(source.contains(&entry), "kernels.cu lacks {entry}");
        }
    }

    /// One launch takes the leading matrices of the first one's format, at most
    /// MANY_MATS; each matrix's blocks follow the one before, and the unused slots end
    /// where the last matrix does (kernels.cu's `many_pick` gives no block to them).
    #[test]
    fn many_takes_a_run_of_one_format() {
        let mat = |dtype, rows| MatDesc { dtype, rows, cols: 256, row_bytes: 144, ptr: 0 };
        let run =
            |ro, mats: &[MatDesc]| Many::of(ro, mats.iter().enumerate().map(|(i, m)| (i as u64, 100 + i as u64, *m)));
        let (m, n) = run(4, &[mat(DType::Q4K, 4096), mat(DType::Q4K, 512), mat(DType::Q6K, 512)]);
        assert_eq!((n, m.end, m.blocks()), (2, [1024, 1152, 1152], 1152));
        assert_eq!((m.w, m.y, m.out), ([0, 1, 0], [100, 101, 0], [4096, 512, 0]));
        let (m, n) = run(2, &[mat(DType::Q6K, 5), mat(DType::Q6K, 3), mat(DType::Q6K, 1), mat(DType::Q6K, 8)]);
        assert_eq!((n, m.end), (MANY_MATS, [3, 5, 6]));
        let (m, n) = run(4, &[mat(DType::Q8_0, 3)]);
        assert_eq!((n, m.end, m.blocks()), (1, [1, 1, 1], 1));
    }

    /// A warp per run of columns, at most four: an expert's down product of 768
    /// columns in Q4_K takes two (two super-blocks a warp), in Q6_K three, a product
    /// of 2048 four, a small f32 one one.
    #[test]
    fn float_products_take_a_warp_a_run() {
        assert_eq!(product_threads(DType::Q4K, 768), 64);
        assert_eq!(product_threads(DType::Q5K, 1024), 64);
        assert_eq!(product_threads(DType::Q6K, 768), 96);
        assert_eq!(product_threads(DType::Q6K, 256), 32);
        assert_eq!(product_threads(DType::Q4K, 2048), 128);
        assert_eq!(product_threads(DType::Q4K, 4096), 128);
        assert_eq!(product_threads(DType::Q8_0, 384), 96);
        assert_eq!(product_threads(DType::F32, 64), 32);
        assert_eq!(product_threads(DType::F32, 4096), 128);
    }

    /// A prompt's rows (8 bits) take the tensor cores, decode rows (16 bits) the float
    /// products, a step of both kinds both (each row keeping its own kind's bits); only
    /// the K-quants have integer kernels, and the environment's choices hold.
    #[test]
    fn a_rows_precision_chooses_its_products() {
        use sluice_core::Precision::{Accurate, Fast};
        let mixed = RowPrecision::from_rows(vec![Fast, Accurate, Fast]);
        let all = |p| RowPrecision::All(p);
        assert_eq!(Path::of(Products::Tensor, &all(Fast), DType::Q4K), Path::Tensor);
        assert_eq!(Path::of(Products::Tensor, &all(Accurate), DType::Q6K), Path::Float);
        assert_eq!(Path::of(Products::Tensor, &mixed, DType::Q5K), Path::FloatThenTensor);
        assert_eq!(Path::of(Products::Tensor, &all(Fast), DType::Q8_0), Path::Float);
        assert_eq!(Path::of(Products::Integer, &mixed, DType::Q4K), Path::Integer);
        assert_eq!(Path::of(Products::Integer, &mixed, DType::MXFP4), Path::Float);
        assert_eq!(Path::of(Products::Float, &all(Fast), DType::Q4K), Path::Float);
        assert!(Path::FloatThenTensor.float() && Path::FloatThenTensor.tensor());
        assert!(!Path::Tensor.float() && !Path::Float.tensor());
    }

    /// A prompt's rows at 8 bits in tiles within their sequence; a decode row, rows at
    /// 16 bits and a sequence with a ring go to the split kernel.
    #[test]
    fn a_prompts_rows_take_the_tiles() {
        use sluice_core::Precision::{Accurate, Fast};
        let seqs = [
            SeqRows { first: 0, rows: 20, start: 0 },
            SeqRows { first: 20, rows: 1, start: 30 },
            SeqRows { first: 21, rows: 5, start: 0 },
            SeqRows { first: 26, rows: 4, start: 0 },
            SeqRows { first: 30, rows: 5, start: 9 },
        ];
        let rings = [None, None, None, Some(16), None];
        let mut rows = vec![Fast; 20];
        rows.extend([Fast, Accurate, Accurate, Accurate, Accurate, Accurate, Fast, Fast, Fast, Fast]);
        rows.extend([Fast, Fast, Accurate, Fast, Fast]);
        let tile = |first, rows| PromptTile { first, rows };
        assert_eq!(
            prompt_tiles(8, &seqs, &rings, &RowPrecision::from_rows(rows)),
            [tile(0, 8), tile(8, 8), tile(16, 4), tile(30, 2), tile(33, 2)]
        );
        assert_eq!(prompt_tiles(3, &seqs[..1], &rings[..1], &RowPrecision::All(Fast)).len(), 7);
        assert!(prompt_tiles(8, &seqs, &rings, &RowPrecision::All(Accurate)).is_empty());
    }

    /// Runs of 64 up to 16 of them, then longer runs: never more than 16 blocks, and
    /// every position in one.
    #[test]
    fn attention_splits_cover_every_position() {
        assert_eq!(attention_splits(1), 1);
        assert_eq!(attention_splits(64), 1);
        assert_eq!(attention_splits(65), 2);
        assert_eq!(attention_splits(1024), 16);
        assert_eq!(attention_splits(1025), 9);
        for len in 1..20_000 {
            let n = attention_splits(len);
            let run = len.div_ceil(16).div_ceil(64).max(1) * 64;
            assert!(n <= 16 && n * run >= len && (n - 1) * run < len, "{len} positions: {n} runs of {run}");
        }
    }
}
