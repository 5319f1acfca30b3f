//! [`Backend`] on one GPU.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;
use sluice_core::{Activation, Error, Glu, Result, RopeSpec, RopeStyle};
use sluice_engine::backend::{AttnOp, Backend, ExpertFfn, Norm, RouterOp};
use sluice_engine::batch::{Batch, RowPrecision, SeqRows};
use sluice_experts::{ExpertLease, ExpertStore, FetchMode};
use sluice_formats::TensorView;

use crate::device::{Device, elementwise, fail, format_suffix, grid, launch};

/// A row-major `[rows, cols]` f32 matrix in device memory.
pub struct DevAct {
    pub rows: usize,
    pub cols: usize,
    buf: CudaSlice<f32>,
}

impl DevAct {
    fn len(&self) -> usize {
        self.rows * self.cols
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

/// Each row's experts and weights (chosen on the host for now, see the crate docs).
pub struct DevRouting {
    top_k: usize,
    ids: Vec<u32>,
    weights: Vec<f32>,
}

/// One expert's three matrices in device memory.
struct DevExpert {
    gate: DevMat,
    up: DevMat,
    down: DevMat,
}

impl DevExpert {
    fn bytes(&self) -> usize {
        self.gate.buf.len() + self.up.buf.len() + self.down.buf.len()
    }
}

/// One layer's experts for one step: those the VRAM tier holds, and a lease on the
/// host store for the others, each copied to the device (and into the tier) when
/// [`Backend::moe`] reaches it.
pub struct DevExperts<'s> {
    /// The store's id and the layer: the tier's key, with the expert.
    key: (u64, usize),
    held: Vec<(usize, Arc<DevExpert>)>,
    lease: Option<ExpertLease<'s>>,
}

/// Experts kept in device memory after their first use, least recently used out
/// first, while the GPU keeps [`VRAM_HEADROOM`] free (or within an explicit budget).
#[derive(Default)]
struct VramTier {
    map: HashMap<TierKey, (Arc<DevExpert>, u64)>,
    bytes: usize,
    tick: u64,
    stats: ExpertTraffic,
}

/// What the expert tiers of a GPU did since it opened.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExpertTraffic {
    /// Experts found in VRAM.
    pub vram_hits: u64,
    /// Experts copied from the host store.
    pub host_fills: u64,
    /// Bytes copied from the host store to the device.
    pub fill_bytes: u64,
    /// Experts dropped from VRAM to make room.
    pub evictions: u64,
    /// Bytes the VRAM tier holds now.
    pub vram_bytes: u64,
}

/// An expert of a layer of an expert store.
type TierKey = (u64, usize, usize);

/// Device memory the VRAM tier leaves free for KV caches and activations.
const VRAM_HEADROOM: usize = 4 << 30;

/// The CUDA backend on one GPU. Cloning shares the device and its expert tier.
#[derive(Clone)]
pub struct Cuda {
    dev: Arc<Device>,
    tier: Arc<Mutex<VramTier>>,
    /// Most bytes of experts the VRAM tier may hold (`None`: as free memory allows).
    tier_budget: Option<usize>,
    /// Most device bytes this process may take, and the device's use when it opened.
    limit: Option<(usize, usize)>,
}

impl Cuda {
    /// GPU `ordinal`: starts a context and compiles the kernels (a fraction of a
    /// second), or says why CUDA cannot be used here.
    pub fn open(ordinal: usize) -> Result<Cuda> {
        Ok(Cuda { dev: Arc::new(Device::open(ordinal)?), tier: Arc::default(), tier_budget: None, limit: None })
    }

    /// The same GPU, taking at most `bytes` of its memory: resident weights must fit
    /// (an error names the tensor that does not), and the VRAM tier stays within what
    /// they leave.
    pub fn with_memory_limit(self, bytes: usize) -> Result<Cuda> {
        let (free, total) = self.dev.memory()?;
        Ok(Cuda { limit: Some((bytes, total - free)), ..self })
    }

    /// Device bytes this process has taken since it opened the GPU, and its limit.
    fn taken(&self) -> Result<Option<(usize, usize)>> {
        let Some((limit, at_open)) = self.limit else { return Ok(None) };
        let (free, total) = self.dev.memory()?;
        Ok(Some(((total - free).saturating_sub(at_open), limit)))
    }

    /// The same GPU with a VRAM expert tier of its own, bounded to `bytes` (0: no
    /// tier, every expert copied from the host at each use).
    pub fn with_expert_budget(&self, bytes: usize) -> Cuda {
        Cuda { dev: self.dev.clone(), tier: Arc::default(), tier_budget: Some(bytes), limit: self.limit }
    }

    /// What the expert tiers did so far.
    pub fn expert_traffic(&self) -> ExpertTraffic {
        let t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
        ExpertTraffic { vram_bytes: t.bytes as u64, ..t.stats }
    }

    /// Keeps `x` as expert `key` in the VRAM tier if it fits, evicting the least
    /// recently used.
    fn keep(&self, key: TierKey, x: Arc<DevExpert>) -> Result<()> {
        let need = x.bytes();
        let mut t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
        let taken = self.taken()?;
        let fits = |t: &VramTier, free: usize, gone: usize| {
            let under_limit = taken.is_none_or(|(used, limit)| used.saturating_sub(gone) + need <= limit);
            under_limit
                && match self.tier_budget {
                    Some(b) => t.bytes + need <= b,
                    None => free >= need + VRAM_HEADROOM,
                }
        };
        let mut free = self.dev.memory()?.0;
        let mut gone_bytes = 0;
        while !fits(&t, free, gone_bytes) {
            let Some((&old, _)) = t.map.iter().min_by_key(|(_, (_, used))| *used) else { return Ok(()) };
            let (gone, _) = t.map.remove(&old).expect("just found");
            t.bytes -= gone.bytes();
            t.stats.evictions += 1;
            // Freed when the last step using it lets go; count it as free now.
            free += gone.bytes();
            gone_bytes += gone.bytes();
        }
        t.tick += 1;
        let tick = t.tick;
        t.bytes += need;
        t.map.insert(key, (x, tick));
        Ok(())
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
        Ok(DevAct { rows, cols, buf: self.dev.upload(data)? })
    }

    /// Waits for every queued operation.
    pub fn sync(&self) -> Result<()> {
        self.dev.sync()
    }

    fn act(&self, rows: usize, cols: usize) -> Result<DevAct> {
        Ok(DevAct { rows, cols, buf: self.dev.alloc(rows * cols)? })
    }

    fn p<T>(&self, s: &CudaSlice<T>) -> u64 {
        self.dev.ptr(s)
    }

    /// `y = x · Wᵀ` for weight bytes at device address `w`.
    fn product(&self, x: &DevAct, w: MatDesc) -> Result<DevAct> {
        if x.cols != w.cols {
            return Err(Error::Device(format!(
                "cuda: a product of {} columns with a weight of {} (internal error)",
                x.cols, w.cols
            )));
        }
        let y = self.act(x.rows, w.rows)?;
        if x.rows == 0 {
            return Ok(y);
        }
        let cfg = grid((w.rows.div_ceil(4) as u32, x.rows.div_ceil(MM_ROWS) as u32), 128, 0);
        let name = format!("mm_{}", format_suffix(w.dtype));
        launch!(&self.dev, &name, cfg;
            w.ptr, w.row_bytes as i64, w.rows as i32, w.cols as i32, self.p(&x.buf), x.rows as i32, self.p(&y.buf))?;
        Ok(y)
    }

    /// A host weight matrix's bytes on the device (an expert, for now at every use).
    pub fn upload_mat(&self, m: sluice_core::MatRef<'_>) -> Result<DevMat> {
        Ok(DevMat {
            dtype: m.dtype,
            rows: m.rows,
            cols: m.cols,
            row_bytes: m.row_bytes(),
            buf: self.dev.upload(m.data)?,
        })
    }

    fn desc(&self, m: &DevMat) -> MatDesc {
        MatDesc { dtype: m.dtype, rows: m.rows, cols: m.cols, row_bytes: m.row_bytes, ptr: self.p(&m.buf) }
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

    /// The routed experts `exs` of a layer on the rows of `x` that chose them (`ids`,
    /// `k` per row), each output written to its (row, slot) row of `per_slot`: three
    /// grouped products, one launch each for every expert.
    fn grouped_experts(
        &self,
        x: &DevAct,
        k: usize,
        ids: &[u32],
        exs: &[(usize, Arc<DevExpert>)],
        ffn: &ExpertFfn<Self>,
        per_slot: &DevAct,
    ) -> Result<()> {
        let Some((_, first)) = exs.first() else { return Ok(()) };
        let same = |a: &DevMat, b: &DevMat| a.dtype == b.dtype && a.rows == b.rows && a.cols == b.cols;
        if exs
            .iter()
            .any(|(_, e)| !same(&e.gate, &first.gate) || !same(&e.up, &first.up) || !same(&e.down, &first.down))
        {
            return Err(Error::Unsupported(
                "cuda: the experts of a layer are stored in different formats or shapes".into(),
            ));
        }
        // The compact rows: expert after expert, each (row, slot) routed to it; work
        // items of at most eight rows of one expert.
        let (mut rows, mut slots, mut expert_of, mut work) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, (e, _)) in exs.iter().enumerate() {
            let start = slots.len();
            for (s, &id) in ids.iter().enumerate() {
                if id as usize == *e {
                    slots.push(s as u32);
                    rows.push((s / k) as u32);
                    expert_of.push(*e as u32);
                }
            }
            for from in (start..slots.len()).step_by(MM_ROWS) {
                work.push(Work {
                    expert: i as i32,
                    start: from as i32,
                    n: (slots.len() - from).min(MM_ROWS) as i32,
                    pad: 0,
                });
            }
        }
        let j = slots.len();
        if j == 0 {
            return Ok(());
        }
        let table = |m: fn(&DevExpert) -> &DevMat| -> Vec<u64> { exs.iter().map(|(_, e)| self.p(&m(e).buf)).collect() };
        let (gate_w, up_w, down_w) = (
            self.dev.upload(&table(|e| &e.gate))?,
            self.dev.upload(&table(|e| &e.up))?,
            self.dev.upload(&table(|e| &e.down))?,
        );
        let (rows, slots, work_d) = (self.dev.upload(&rows)?, self.dev.upload(&slots)?, self.dev.upload(&work)?);
        let grouped = |ws: &CudaSlice<u64>, m: &DevMat, input: &DevAct, xrow: u64, y: &DevAct| -> Result<()> {
            let cfg = grid((m.rows.div_ceil(4) as u32, work.len() as u32), 128, 0);
            let name = format!("mmg_{}", format_suffix(m.dtype));
            launch!(&self.dev, &name, cfg;
                self.p(ws), m.row_bytes as i64, m.rows as i32, m.cols as i32, self.p(&input.buf), xrow,
                self.p(&work_d), self.p(&y.buf), 0u64)
        };
        let (inter, hidden) = (first.gate.rows, first.down.rows);
        let (mut g, mut u, mut d) = (self.act(j, inter)?, self.act(j, inter)?, self.act(j, hidden)?);
        grouped(&gate_w, &first.gate, x, self.p(&rows), &g)?;
        grouped(&up_w, &first.up, x, self.p(&rows), &u)?;
        let ex_of = if ffn.bias.is_some() { Some(self.dev.upload(&expert_of)?) } else { None };
        let bias = |a: &mut DevAct, b: &DevVector| -> Result<()> {
            let n = a.len();
            let ex = ex_of.as_ref().expect("uploaded with the biases");
            launch!(&self.dev, "add_expert_bias", elementwise(n);
                self.p(&a.buf), self.p(&b.dev), self.p(ex), a.cols as i32, n as i64)
        };
        if let Some(b) = &ffn.bias {
            bias(&mut g, &b.gate)?;
            bias(&mut u, &b.up)?;
        }
        self.glu(&mut g, &u, ffn.glu)?;
        grouped(&down_w, &first.down, &g, 0, &d)?;
        if let Some(b) = &ffn.bias {
            bias(&mut d, &b.down)?;
        }
        let n = d.len();
        launch!(&self.dev, "scatter_rows", elementwise(n);
            self.p(&d.buf), self.p(&slots), hidden as i32, self.p(&per_slot.buf), n as i64)
    }
}

/// Input rows per pass of a product over the weights (`MM_ROWS` in kernels.cu).
const MM_ROWS: usize = 8;

/// A grouped product's unit of work, as `Work` in kernels.cu: compact rows
/// `start..start + n` of the layer's expert number `expert`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Work {
    expert: i32,
    start: i32,
    n: i32,
    pad: i32,
}

// SAFETY: plain integers, laid out as the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for Work {}

/// What a product needs of a weight matrix on the device.
#[derive(Clone, Copy)]
struct MatDesc {
    dtype: sluice_core::DType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    ptr: u64,
}

/// Attention's per-row description, as `RowMeta` in kernels.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RowMeta {
    pos: i32,
    start: i32,
    first: i32,
    seq: i32,
}

// SAFETY: plain integers, laid out as the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for RowMeta {}

fn act_code(a: Activation) -> i32 {
    match a {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
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

    /// The GPU computes every row in f32 from the stored weights, so the precision a
    /// step asks for changes nothing.
    fn with_precision(&self, _: RowPrecision) -> Cuda {
        self.clone()
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
        let tok = self.dev.upload(tokens)?;
        let pieces = table.cols.div_ceil(32);
        let cfg = grid((tokens.len() as u32, pieces.div_ceil(128) as u32), 128, 0);
        let name = format!("embed_{}", format_suffix(table.dtype));
        launch!(&self.dev, &name, cfg;
            self.p(&table.buf), table.row_bytes as i64, table.cols as i32, self.p(&tok), scale, self.p(&out.buf))?;
        Ok(out)
    }

    fn matmul(&self, x: &DevAct, w: &DevMat) -> Result<DevAct> {
        self.product(x, self.desc(w))
    }

    fn rms_norm(&self, x: &mut DevAct, n: &Norm<'_, Self>) -> Result<()> {
        let groups = x.len() / n.group.max(1);
        let w = n.weight.map_or(0, |v| self.p(&v.dev));
        launch!(&self.dev, "rms_norm", grid((groups as u32, 1), 256, 0);
            self.p(&x.buf), n.group as i32, w, n.offset, n.eps)
    }

    fn add(&self, x: &mut DevAct, y: &DevAct) -> Result<()> {
        self.same_len(x, y, "a sum")?;
        let n = x.len();
        launch!(&self.dev, "add", elementwise(n); self.p(&x.buf), self.p(&y.buf), n as i64)
    }

    fn mul(&self, x: &mut DevAct, y: &DevAct) -> Result<()> {
        self.same_len(x, y, "a product")?;
        let n = x.len();
        launch!(&self.dev, "mul", elementwise(n); self.p(&x.buf), self.p(&y.buf), n as i64)
    }

    fn scale(&self, x: &mut DevAct, s: f32) -> Result<()> {
        let n = x.len();
        launch!(&self.dev, "scale", elementwise(n); self.p(&x.buf), s, n as i64)
    }

    fn mul_row(&self, x: &mut DevAct, v: &DevVector) -> Result<()> {
        let n = x.len();
        launch!(&self.dev, "mul_row", elementwise(n); self.p(&x.buf), self.p(&v.dev), x.cols as i32, n as i64)
    }

    fn add_row(&self, x: &mut DevAct, v: &DevVector) -> Result<()> {
        let n = x.len();
        launch!(&self.dev, "add_row", elementwise(n); self.p(&x.buf), self.p(&v.dev), x.cols as i32, n as i64)
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
        let idx = self.dev.upload(&idx)?;
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

    fn activate(&self, x: &mut DevAct, act: Activation) -> Result<()> {
        let n = x.len();
        launch!(&self.dev, "activate", elementwise(n); self.p(&x.buf), act_code(act), n as i64)
    }

    fn glu(&self, gate: &mut DevAct, up: &DevAct, glu: Glu) -> Result<()> {
        self.same_len(gate, up, "a gated unit")?;
        let n = gate.len();
        let (kind, alpha, limit) = match glu {
            Glu::Gated(a) => (act_code(a), 0.0f32, 0.0f32),
            Glu::ClampedSwiglu { alpha, limit } => (2, alpha, limit),
        };
        launch!(&self.dev, "glu", elementwise(n); self.p(&gate.buf), self.p(&up.buf), kind, alpha, limit, n as i64)
    }

    fn softcap(&self, x: &mut DevAct, cap: f32) -> Result<()> {
        let n = x.len();
        launch!(&self.dev, "softcap", elementwise(n); self.p(&x.buf), cap, n as i64)
    }

    fn rope(&self, x: &mut DevAct, head_dim: usize, batch: &Batch, rope: &RopeSpec) -> Result<()> {
        let pairs = rope.inv_freq.iter().rposition(|&f| f != 0.0).map_or(0, |p| p + 1);
        let total = x.rows * (x.cols / head_dim) * pairs;
        if total == 0 {
            return Ok(());
        }
        let positions: Vec<u32> = batch.positions.iter().map(|&p| p as u32).collect();
        let pos = self.dev.upload(&positions)?;
        let freq = self.dev.upload(&rope.inv_freq)?;
        let style = match rope.style {
            RopeStyle::Half => 0i32,
            RopeStyle::Interleaved => 1,
        };
        launch!(&self.dev, "rope", elementwise(total);
            self.p(&x.buf), x.cols as i32, head_dim as i32, self.p(&pos), self.p(&freq), pairs as i32, style,
            rope.attention_factor, total as i64)
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<DevAct> {
        Ok(DevAct { rows, cols, buf: self.dev.zeros(rows * cols)? })
    }

    fn kv_new(&self, kv_dim: usize, window: Option<usize>) -> Result<DevKv> {
        Ok(DevKv { kv_dim, window, k: self.dev.alloc(1)?, v: self.dev.alloc(1)?, cap: 0, len: 0 })
    }

    fn kv_bytes(&self, kv: &DevKv) -> usize {
        2 * kv.cap * kv.kv_dim * 4
    }

    fn kv_append(&self, kv: &mut DevKv, k: &DevAct, v: &DevAct, seq: SeqRows) -> Result<()> {
        let (d, n) = (kv.kv_dim, seq.rows);
        if n == 0 {
            return Ok(());
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
        let ring = kv.window.unwrap_or(0) as i32;
        // Of a chunk longer than the ring only the last `window` rows survive.
        let skip = kv.window.map_or(0, |w| n.saturating_sub(w));
        let n_el = (n - skip) * d;
        for (cache, src) in [(&kv.k, k), (&kv.v, v)] {
            let at = self.p(&src.buf) + (seq.first * src.cols * 4) as u64;
            launch!(&self.dev, "kv_write", elementwise(n_el);
                self.p(cache), at, n as i32, d as i32, kv.len as i64, ring, skip as i32)?;
        }
        kv.len += n;
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
        let mut max_len = 1;
        for (si, (r, cache)) in op.batch.seqs.iter().zip(op.caches).enumerate() {
            let start = cache.len;
            for i in 0..r.rows {
                let pos = start + i;
                let lo = s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                if lo < cache.window.map_or(0, |w| cache.len.saturating_sub(w)) {
                    return Err(Error::Device(format!("cuda: attention: position {lo} is no longer in the cache")));
                }
                max_len = max_len.max(pos + 1 - lo);
                meta[r.first + i] =
                    RowMeta { pos: pos as i32, start: start as i32, first: r.first as i32, seq: si as i32 };
            }
        }
        let kc: Vec<u64> = op.caches.iter().map(|c| self.p(&c.k)).collect();
        let vc: Vec<u64> = op.caches.iter().map(|c| self.p(&c.v)).collect();
        let ring: Vec<i32> = op.caches.iter().map(|c| c.window.unwrap_or(0) as i32).collect();
        let (kc, vc, ring, meta) =
            (self.dev.upload(&kc)?, self.dev.upload(&vc)?, self.dev.upload(&ring)?, self.dev.upload(&meta)?);
        let scores = self.dev.alloc::<f32>(rows * s.n_heads * max_len)?;
        let cfg = grid((s.n_heads as u32, rows as u32), 128, (hd * 4) as u32);
        let window = s.window.unwrap_or(0) as i32;
        launch!(&self.dev, "attention", cfg;
            self.p(&op.q.buf), self.p(&op.k.buf), self.p(&op.v.buf), self.p(&kc), self.p(&vc), self.p(&ring),
            self.p(&meta), s.n_heads as i32, s.n_kv_heads as i32, hd as i32, s.scale, window, 0.0f32,
            self.p(&scores), max_len as i32, self.p(&out.buf))?;
        Ok(out)
    }

    fn route(&self, logits: &DevAct, r: &RouterOp<Self>) -> Result<DevRouting> {
        let host = self.dev.download(&logits.buf, logits.len())?;
        let p = sluice_cpu::router::RouteParams {
            kind: r.kind,
            n_experts: r.n_experts,
            top_k: r.top_k,
            logit_bias: r.logit_bias.as_ref().map(|v| v.host.as_slice()),
            choice_bias: r.choice_bias.as_ref().map(|v| v.host.as_slice()),
            expert_scale: r.expert_scale.as_ref().map(|v| v.host.as_slice()),
        };
        let mut out = DevRouting { top_k: r.top_k, ids: Vec::new(), weights: Vec::new() };
        sluice_cpu::router::route(&host, &p, &mut out.ids, &mut out.weights);
        Ok(out)
    }

    fn routing_ids(&self, r: &DevRouting) -> Result<Vec<u32>> {
        Ok(r.ids.clone())
    }

    fn fetch_experts<'s>(&self, store: &'s ExpertStore, layer: usize, ids: &[usize]) -> Result<DevExperts<'s>> {
        let (mut held, mut missing) = (Vec::new(), Vec::new());
        {
            let mut t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
            t.tick += 1;
            let tick = t.tick;
            for &e in ids {
                match t.map.get_mut(&(store.id(), layer, e)) {
                    Some((x, used)) => {
                        *used = tick;
                        held.push((e, x.clone()));
                    }
                    None => missing.push(e),
                }
            }
            t.stats.vram_hits += held.len() as u64;
        }
        let lease =
            if missing.is_empty() { None } else { Some(store.fetch_with(layer, &missing, FetchMode::Stream)?) };
        Ok(DevExperts { key: (store.id(), layer), held, lease })
    }

    fn experts_ready(&self, experts: &DevExperts<'_>) -> Result<()> {
        experts.lease.as_ref().map_or(Ok(()), |l| l.wait_all())
    }

    fn experts_waited(&self, experts: &DevExperts<'_>) -> std::time::Duration {
        experts.lease.as_ref().map_or(std::time::Duration::ZERO, |l| l.waited())
    }

    fn moe(&self, x: &DevAct, routing: &DevRouting, experts: &DevExperts<'_>, ffn: &ExpertFfn<Self>) -> Result<DevAct> {
        let k = routing.top_k.max(1);
        let slots_total = routing.ids.len();
        // Each (row, slot)'s expert output, then their weighted sum in router order.
        // Every expert on the device: those the tier holds, then the others as the
        // store delivers them, each copied over and kept.
        let mut exs: Vec<(usize, Arc<DevExpert>)> = experts.held.clone();
        if let Some(lease) = &experts.lease {
            for e in lease.order() {
                let taken = lease.take(e)?;
                let m = taken.mats();
                let ex = Arc::new(DevExpert {
                    gate: self.upload_mat(m.gate)?,
                    up: self.upload_mat(m.up)?,
                    down: self.upload_mat(m.down)?,
                });
                drop(taken);
                {
                    let mut t = self.tier.lock().unwrap_or_else(|e| e.into_inner());
                    t.stats.host_fills += 1;
                    t.stats.fill_bytes += ex.bytes() as u64;
                }
                self.keep((experts.key.0, experts.key.1, e), ex.clone())?;
                exs.push((e, ex));
            }
        }
        let per_slot = self.zeros(slots_total, x.cols)?;
        self.grouped_experts(x, k, &routing.ids, &exs, ffn, &per_slot)?;
        let out = self.act(x.rows, x.cols)?;
        let n = out.len();
        if n > 0 {
            let w = self.dev.upload(&routing.weights)?;
            launch!(&self.dev, "combine", elementwise(n);
                self.p(&per_slot.buf), self.p(&w), k as i32, x.cols as i32, self.p(&out.buf), n as i64)?;
        }
        Ok(out)
    }

    fn to_host(&self, x: &DevAct) -> Result<Vec<f32>> {
        self.dev.download(&x.buf, x.len())
    }

    fn n_rows(&self, x: &DevAct) -> usize {
        x.rows
    }
}
