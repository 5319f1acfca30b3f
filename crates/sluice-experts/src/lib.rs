//! The expert store: the one owner of every routed-expert byte.
//!
//! A family asks for `(layer, expert ids)` and gets matrix views back for as long
//! as it holds the [`ExpertLease`]; whether those bytes were mapped, copied into
//! memory at open or read from disk into a slot is the store's affair, and they
//! are the file's bytes exactly whichever it was.
//!
//! - [`Residency::Mapped`]: views into the mapped checkpoint; the page cache decides.
//! - [`Residency::Resident`]: every expert copied into memory at open.
//! - [`Residency::Streamed`]: a fixed pool of slots per layer (see `cache.rs` for
//!   the slot protocol); misses are read with `pread` by a pool of reader threads
//!   (O_DIRECT where the filesystem allows), split into chunks.

mod cache;
mod disk;
mod histogram;
mod io;
mod layout;
mod pool;
mod stats;
mod stream;
mod trace;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use sluice_core::{Error, Result};
use sluice_formats::{Checkpoint, ExpertMats};

use crate::cache::{Claim, LayerCache, SlotState};
use crate::io::{AlignedBuf, DirectStatus, FileHandle};
use crate::layout::MatLayout;
use crate::pool::{IoCounters, Load, LoadReq, ReadPool, Reader, Target};

pub use crate::disk::{DiskBench, measure_expert_reads};
pub use crate::histogram::RoutingHistogram;
pub use crate::io::ALIGN;
pub use crate::layout::{CacheBudget, ExpertLayout, LayerExperts, human_bytes};
pub use crate::stats::{DirectIoStats, LayerStats, PrefetchStats, StoreStats};
pub use crate::trace::trace;

pub use sluice_core::MatRef;

/// One expert's three matrices as computed on.
#[derive(Clone, Copy, Debug)]
pub struct ExpertRef<'a> {
    pub gate: MatRef<'a>,
    pub up: MatRef<'a>,
    pub down: MatRef<'a>,
}

/// Where the experts live while a model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    Mapped,
    Resident,
    Streamed,
}

impl Residency {
    pub fn name(self) -> &'static str {
        match self {
            Residency::Mapped => "mapped",
            Residency::Resident => "resident",
            Residency::Streamed => "streamed",
        }
    }
}

/// Which unpinned expert a streamed layer gives up for a new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// Least frequently routed to (counts of this run), least recently used among equals.
    Lfu,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Lfu => "lfu",
        }
    }
}

#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub residency: Residency,
    /// Required for streamed residency; ignored otherwise.
    pub budget: Option<CacheBudget>,
    pub policy: Policy,
    /// Pin each layer's most-routed experts from this histogram (streamed).
    pub pin: Option<RoutingHistogram>,
    /// The fraction of each layer's slots the pinned set may take; at most the
    /// slots beyond one token's top-k.
    pub pin_fraction: f32,
    pub read_threads: usize,
    /// Use O_DIRECT where the filesystem allows.
    pub direct_io: bool,
    /// The largest single read; rounded up to a multiple of 4 KiB.
    pub chunk_bytes: usize,
    /// Locks a resident store's buffers for a device's copies (a GPU backend's,
    /// [`PageLocker`]); `None`: they stay pageable.
    pub page_lock: Option<PageLock>,
}

/// Locks host memory in place for a device's direct reads: a GPU copies from
/// page-locked memory at its link's full rate, from pageable memory only through a
/// staging copy of the driver's, at a fraction of it.
pub trait PageLocker: Send + Sync {
    /// Locks `len` bytes at `ptr` (page-aligned, allocated and kept by the caller)
    /// until the returned guard is dropped, which the caller does before freeing
    /// them; `None` where it cannot (the memory stays as it was).
    fn lock(&self, ptr: *mut u8, len: usize) -> Option<Box<dyn Send + Sync>>;
}

/// A shared [`PageLocker`], as a [`StoreConfig`] holds it.
#[derive(Clone)]
pub struct PageLock(pub Arc<dyn PageLocker>);

impl std::fmt::Debug for PageLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PageLock")
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            residency: Residency::Mapped,
            budget: None,
            policy: Policy::Lru,
            pin: None,
            pin_fraction: 0.5,
            read_threads: 4,
            direct_io: true,
            chunk_bytes: 1 << 20,
            page_lock: None,
        }
    }
}

/// A streamed fetch's layer and how it hands out its experts.
struct Want<'a> {
    layer: usize,
    le: &'a LayerExperts,
    mode: FetchMode,
}

enum Src<'a> {
    Mapped(&'a ExpertMats),
    /// A slot or a resident copy that the store owns.
    Buf {
        buf: &'a AlignedBuf,
        base: usize,
        mats: &'a [MatLayout; 3],
    },
    /// A buffer of the lease's own (a miss read while every slot was held).
    Owned {
        buf: Arc<AlignedBuf>,
        mats: &'a [MatLayout; 3],
    },
}

/// The experts a step asked for. They cannot be evicted or overwritten while the
/// lease holds them.
///
/// A fetch with [`FetchMode::Wait`] returns with every expert in memory, and the
/// lease holds them all until it drops ([`ExpertLease::get`]). One with
/// [`FetchMode::Stream`] returns as soon as its reads are queued: the caller takes
/// the experts one by one ([`ExpertLease::take`], in [`ExpertLease::order`]),
/// computing on each as its read ends while the next ones are read, and each
/// streamed slot goes back to the cache when its [`Taken`] drops, for a miss still
/// waiting for one. A layer whose misses outnumber its slots is then read through
/// its own cache, in the cache's memory.
pub struct ExpertLease<'a> {
    ids: Vec<usize>,
    inner: Inner<'a>,
}

enum Inner<'a> {
    Ready {
        srcs: Vec<Src<'a>>,
        /// Slots this lease pins in a streamed layer.
        pinned: Option<(&'a LayerCache, Vec<usize>)>,
    },
    Stream(stream::Stream<'a>),
}

/// How a fetch hands out its experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FetchMode {
    /// Every expert in memory when the fetch returns.
    Wait,
    /// The fetch returns once its reads are queued; the experts are taken as they arrive.
    Stream,
    /// As `Stream`, for a device copying experts into a tier of its own ahead of their
    /// use (its pilot's picks, or every expert at load): not counted as routed to in
    /// the routing histogram.
    Ahead,
}

impl FetchMode {
    fn streams(self) -> bool {
        self != FetchMode::Wait
    }
}

/// One expert taken from a lease; a streamed slot is given back when it drops.
pub struct Taken<'l> {
    src: Src<'l>,
    release: Option<(&'l stream::Stream<'l>, usize)>,
}

impl Taken<'_> {
    pub fn mats(&self) -> ExpertRef<'_> {
        self.src.mats()
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if let Some((s, i)) = self.release {
            s.release(i);
        }
    }
}

impl Src<'_> {
    fn mats(&self) -> ExpertRef<'_> {
        fn from<'b>(buf: &'b AlignedBuf, base: usize, m: &[MatLayout; 3]) -> ExpertRef<'b> {
            let end = m.iter().map(|l| l.slot_off + l.len).max().unwrap_or(0);
            // SAFETY: nothing writes these bytes while they are handed out. A slot is
            // `Ready` and pinned by the lease (the slot protocol in `cache.rs` writes
            // only `Loading` slots and never picks a pinned one to load); a resident
            // copy is written only at open; an owned buffer's load completed before it
            // was handed out and it has no other user.
            let bytes = unsafe { buf.slice(base, end) };
            ExpertRef { gate: m[0].mat(bytes), up: m[1].mat(bytes), down: m[2].mat(bytes) }
        }
        match self {
            Src::Mapped(e) => ExpertRef { gate: e.gate.mat(), up: e.up.mat(), down: e.down.mat() },
            Src::Buf { buf, base, mats } => from(buf, *base, mats),
            Src::Owned { buf, mats } => from(buf, 0, mats),
        }
    }
}

impl ExpertLease<'_> {
    /// The matrices of expert `id`, which must be one of the ids fetched, of a lease
    /// fetched with [`FetchMode::Wait`].
    pub fn get(&self, id: usize) -> ExpertRef<'_> {
        let i = self.index(id);
        match &self.inner {
            Inner::Ready { srcs, .. } => srcs[i].mats(),
            Inner::Stream(_) => panic!("a streamed lease hands its experts out with take"),
        }
    }

    fn index(&self, id: usize) -> usize {
        self.ids.iter().position(|&x| x == id).expect("expert was not fetched")
    }

    /// The ids this lease holds, in the order asked (duplicates dropped).
    pub fn ids(&self) -> &[usize] {
        &self.ids
    }

    /// The ids in the order to take them: those in memory first, then in the order
    /// their reads were started.
    pub fn order(&self) -> Vec<usize> {
        match &self.inner {
            Inner::Ready { .. } => self.ids.clone(),
            Inner::Stream(s) => s.order().into_iter().map(|i| self.ids[i]).collect(),
        }
    }

    /// Expert `id` once its bytes are in memory (blocking on its read). A read that
    /// fails gives an error naming the file, the layer and the expert. Each expert
    /// of a streamed lease is taken at most once.
    pub fn take(&self, id: usize) -> Result<Taken<'_>> {
        let i = self.index(id);
        match &self.inner {
            Inner::Ready { srcs, .. } => Ok(Taken { src: srcs[i].reborrow(), release: None }),
            Inner::Stream(s) => Ok(Taken { src: s.take(i)?, release: Some((s, i)) }),
        }
    }

    /// Whether expert `id` can be taken without waiting for its read.
    pub fn is_ready(&self, id: usize) -> bool {
        match &self.inner {
            Inner::Ready { .. } => true,
            Inner::Stream(s) => s.is_ready(self.index(id)),
        }
    }

    /// Whether misses of this lease wait for slots that its taken experts will give
    /// back (a prompt that needs more experts than the layer's cache holds): holding
    /// experts taken then keeps their reads from starting.
    pub fn has_queued(&self) -> bool {
        match &self.inner {
            Inner::Ready { .. } => false,
            Inner::Stream(s) => s.has_queued(),
        }
    }

    /// Takes every expert in turn: whether all of them can be read.
    pub fn wait_all(&self) -> Result<()> {
        self.order().into_iter().try_for_each(|id| self.take(id).map(drop))
    }

    /// Time spent blocked in [`take`](Self::take) so far.
    pub fn waited(&self) -> std::time::Duration {
        match &self.inner {
            Inner::Ready { .. } => std::time::Duration::ZERO,
            Inner::Stream(s) => s.waited(),
        }
    }
}

impl<'a> Src<'a> {
    fn reborrow(&self) -> Src<'_> {
        match self {
            Src::Mapped(e) => Src::Mapped(e),
            Src::Buf { buf, base, mats } => Src::Buf { buf, base: *base, mats },
            Src::Owned { buf, mats } => Src::Owned { buf: buf.clone(), mats },
        }
    }
}

impl Drop for ExpertLease<'_> {
    fn drop(&mut self) {
        if let Inner::Ready { pinned: Some((cache, slots)), .. } = &self.inner {
            cache.unpin(slots);
        }
    }
}

/// Totals the engine's `--stats` has printed since the store existed.
#[derive(Default, Debug)]
pub struct StoreCounters {
    pub fetches: AtomicU64,
    pub experts_served: AtomicU64,
    pub bytes_served: AtomicU64,
    /// Bytes of a resident store's experts page-locked for a device ([`PageLock`]).
    pub locked_bytes: AtomicU64,
}

struct Streamed {
    /// Per layer; `None` for layers without experts.
    caches: Vec<Option<Arc<LayerCache>>>,
    reader: Reader,
    policy: Policy,
}

enum Kind {
    Mapped,
    Resident { bufs: Vec<Option<Arc<AlignedBuf>>>, files: Vec<bool> },
    Streamed(Streamed),
}

pub struct ExpertStore {
    layout: ExpertLayout,
    kind: Kind,
    residency: Residency,
    cfg_policy: Policy,
    read_threads: usize,
    chunk_bytes: usize,
    /// Routing counts per layer per expert (also the LFU policy's frequencies).
    hist: Vec<Vec<AtomicU64>>,
    layer_requests: Vec<AtomicU64>,
    layer_wait_ns: Vec<AtomicU64>,
    /// Unique in the process: a device tier keys the experts it holds by it.
    id: u64,
    io: Arc<IoCounters>,
    direct: Arc<DirectStatus>,
    /// Prefetches of mapped residency, which only hint the kernel.
    hints: Hints,
    pub counters: StoreCounters,
}

#[derive(Default)]
struct Hints {
    calls: AtomicU64,
    experts: AtomicU64,
    bytes: AtomicU64,
}

impl ExpertStore {
    /// Serves every expert in place from the mapped checkpoint (the default).
    /// This store's identity, unique in the process (a GPU backend's VRAM tier,
    /// shared by the models loaded on it, tells their experts apart by it).
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn open_mapped(ckpt: &Checkpoint) -> Result<ExpertStore> {
        ExpertStore::open(ckpt, &StoreConfig::default(), None)
    }

    /// Indexes every MoE layer's experts, checking their shapes, and sets up the
    /// residency asked for. Resident residency reads every expert here, streamed
    /// residency the pinned hot set; `progress(done, total)` hears of those bytes.
    pub fn open(
        ckpt: &Checkpoint,
        cfg: &StoreConfig,
        progress: Option<&mut dyn FnMut(u64, u64)>,
    ) -> Result<ExpertStore> {
        ExpertStore::open_layout(ExpertLayout::from_checkpoint(ckpt)?, cfg, progress)
    }

    /// [`open`](Self::open) for a layout built by other means.
    pub fn open_layout(
        layout: ExpertLayout,
        cfg: &StoreConfig,
        progress: Option<&mut dyn FnMut(u64, u64)>,
    ) -> Result<ExpertStore> {
        let n_layers = layout.layers.len();
        let hist = layout
            .layers
            .iter()
            .map(|l| (0..l.as_ref().map_or(0, |l| l.experts.len())).map(|_| AtomicU64::new(0)).collect())
            .collect();
        let direct = Arc::new(DirectStatus { requested: cfg.direct_io, ..Default::default() });
        let mut store = ExpertStore {
            kind: Kind::Mapped,
            residency: cfg.residency,
            cfg_policy: cfg.policy,
            read_threads: cfg.read_threads.max(1),
            chunk_bytes: io::align_up(cfg.chunk_bytes.max(1)),
            hist,
            layer_requests: (0..n_layers).map(|_| AtomicU64::new(0)).collect(),
            layer_wait_ns: (0..n_layers).map(|_| AtomicU64::new(0)).collect(),
            id: {
                static NEXT: AtomicU64 = AtomicU64::new(0);
                NEXT.fetch_add(1, Ordering::Relaxed)
            },
            io: Arc::default(),
            direct,
            hints: Hints::default(),
            counters: StoreCounters::default(),
            layout,
        };
        store.kind = match cfg.residency {
            Residency::Mapped => Kind::Mapped,
            Residency::Resident => store.load_resident(cfg.page_lock.as_ref(), progress)?,
            Residency::Streamed => store.open_streamed(cfg, progress)?,
        };
        Ok(store)
    }

    fn reader(&self) -> Result<Reader> {
        let files = self
            .layout
            .files
            .iter()
            .map(|f| {
                FileHandle::open(f.path(), self.direct.requested, &self.direct)
                    .map(Arc::new)
                    .map_err(|e| Error::io(f.path(), e))
            })
            .collect::<Result<Vec<_>>>()?;
        if !self.direct.requested {
            *self.direct.fallback.lock().unwrap() = Some("O_DIRECT turned off by the configuration".into());
        }
        Ok(Reader {
            files,
            chunk_bytes: self.chunk_bytes,
            pool: ReadPool::new(self.read_threads, self.io.clone(), self.direct.clone()),
        })
    }

    /// Waits for loads in order, telling `progress` of the bytes done.
    fn wait_all(loads: &[(Arc<Load>, u64)], progress: Option<&mut dyn FnMut(u64, u64)>) -> Result<()> {
        if loads.is_empty() {
            return Ok(());
        }
        let total: u64 = loads.iter().map(|(_, b)| b).sum();
        let mut progress = progress;
        let mut done = 0;
        if let Some(p) = progress.as_mut() {
            p(0, total);
        }
        for (l, bytes) in loads {
            l.wait()?;
            done += bytes;
            if let Some(p) = progress.as_mut() {
                p(done, total);
            }
        }
        Ok(())
    }

    fn load_resident(&self, lock: Option<&PageLock>, progress: Option<&mut dyn FnMut(u64, u64)>) -> Result<Kind> {
        let reader = self.reader()?;
        let mut loads = Vec::new();
        let mut bufs = Vec::with_capacity(self.layout.layers.len());
        for (l, le) in self.layout.layers.iter().enumerate() {
            let Some(le) = le else {
                bufs.push(None);
                continue;
            };
            let len = le.experts.len() * le.slot_bytes;
            let buf = Arc::new(lock.map_or_else(|| AlignedBuf::new(len), |lock| AlignedBuf::locked(len, lock)));
            if buf.is_locked() {
                self.counters.locked_bytes.fetch_add(len as u64, Ordering::Relaxed);
            }
            for (x, plan) in le.plans.iter().enumerate() {
                let req = LoadReq { layer: l, expert: x, speculative: false, target: Target::Plain };
                let (load, jobs) = reader.start(req, plan, &buf, x * le.slot_bytes);
                reader.pool.submit(jobs, true);
                loads.push((load, plan.bytes as u64));
            }
            bufs.push(Some(buf));
        }
        Self::wait_all(&loads, progress)?;
        let files = reader.files.iter().map(|f| f.is_direct()).collect();
        Ok(Kind::Resident { bufs, files })
    }

    fn open_streamed(&self, cfg: &StoreConfig, progress: Option<&mut dyn FnMut(u64, u64)>) -> Result<Kind> {
        let budget = cfg.budget.ok_or_else(|| {
            Error::Usage(format!(
                "streamed residency needs an expert cache size (at least {} bytes, {}, or {} slots per layer)",
                self.layout.min_budget_bytes(),
                human_bytes(self.layout.min_budget_bytes()),
                self.layout.min_slots_per_layer()
            ))
        })?;
        let slots = self.layout.slots_for(budget)?;
        if let Some(h) = &cfg.pin {
            self.check_histogram(h)?;
        }
        let reader = self.reader()?;
        let mut caches = Vec::with_capacity(slots.len());
        let mut loads = Vec::new();
        for (l, (le, &n)) in self.layout.layers.iter().zip(&slots).enumerate() {
            let Some(le) = le else {
                caches.push(None);
                continue;
            };
            let cache = Arc::new(LayerCache::new(le.experts.len(), n, le.slot_bytes));
            if let Some(h) = &cfg.pin {
                let room = n - le.top_k;
                let want = ((n as f64 * cfg.pin_fraction.clamp(0.0, 1.0) as f64).floor() as usize).min(room);
                let mut st = cache.state.lock().unwrap();
                for (s, x) in h.top(l, want).into_iter().enumerate() {
                    let req = LoadReq {
                        layer: l,
                        expert: x,
                        speculative: false,
                        target: Target::Slot { cache: cache.clone(), slot: s },
                    };
                    let (load, jobs) = reader.start(req, &le.plans[x], &cache.bufs[s], 0);
                    st.assign(s, x, load.clone(), Claim::Preload);
                    st.slots[s].hot = true;
                    reader.pool.submit(jobs, true);
                    loads.push((load, le.plans[x].bytes as u64));
                }
            }
            caches.push(Some(cache));
        }
        Self::wait_all(&loads, progress)?;
        Ok(Kind::Streamed(Streamed { caches, reader, policy: cfg.policy }))
    }

    fn check_histogram(&self, h: &RoutingHistogram) -> Result<()> {
        let shape = |v: &mut dyn Iterator<Item = usize>| v.map(|n| n.to_string()).collect::<Vec<_>>().join(",");
        let ours: Vec<usize> = self.hist.iter().map(Vec::len).collect();
        let theirs: Vec<usize> = h.layers.iter().map(Vec::len).collect();
        if ours != theirs {
            return Err(Error::Usage(format!(
                "the routing histogram does not fit this model: it counts experts per layer [{}], the model has [{}]",
                shape(&mut theirs.into_iter()),
                shape(&mut ours.into_iter())
            )));
        }
        Ok(())
    }

    pub fn residency(&self) -> Residency {
        self.residency
    }

    pub fn layout(&self) -> &ExpertLayout {
        &self.layout
    }

    pub fn n_experts(&self, layer: usize) -> usize {
        self.layout.layer(layer).map_or(0, |l| l.experts.len())
    }

    /// Bytes of all routed experts.
    pub fn total_bytes(&self) -> u64 {
        self.layout.expert_bytes_total()
    }

    /// Bytes of all routed experts of one layer (0 for a layer without).
    pub fn layer_bytes(&self, layer: usize) -> u64 {
        self.layout.layer(layer).map_or(0, |l| l.plans.iter().map(|p| p.bytes as u64).sum())
    }

    /// Bytes of all routed experts.
    pub fn expert_bytes_total(&self) -> u64 {
        self.layout.expert_bytes_total()
    }

    /// The smallest byte budget streamed residency accepts.
    pub fn min_budget_bytes(&self) -> u64 {
        self.layout.min_budget_bytes()
    }

    /// Slots of a layer (streamed), or its expert count (resident, mapped).
    pub fn slots(&self, layer: usize) -> usize {
        match &self.kind {
            Kind::Streamed(s) => s.caches.get(layer).and_then(Option::as_ref).map_or(0, |c| c.bufs.len()),
            _ => self.n_experts(layer),
        }
    }

    /// The experts of a layer that a fetch would find without reading, ascending.
    pub fn cached(&self, layer: usize) -> Vec<usize> {
        match &self.kind {
            Kind::Streamed(s) => {
                let Some(c) = s.caches.get(layer).and_then(Option::as_ref) else { return Vec::new() };
                let st = c.state.lock().unwrap();
                let mut v: Vec<usize> =
                    st.slots.iter().filter(|s| matches!(s.state, SlotState::Ready)).map(|s| s.expert).collect();
                v.sort_unstable();
                v
            }
            _ => (0..self.n_experts(layer)).collect(),
        }
    }

    /// The pinned hot experts of a layer, ascending.
    pub fn hot(&self, layer: usize) -> Vec<usize> {
        let Kind::Streamed(s) = &self.kind else { return Vec::new() };
        let Some(c) = s.caches.get(layer).and_then(Option::as_ref) else { return Vec::new() };
        let st = c.state.lock().unwrap();
        let mut v: Vec<usize> = st.slots.iter().filter(|s| s.hot).map(|s| s.expert).collect();
        v.sort_unstable();
        v
    }

    /// Checks a request and records it; returns the ids without duplicates.
    fn admit(&self, layer: usize, ids: &[usize], mode: FetchMode) -> Result<(&LayerExperts, Vec<usize>)> {
        let le = self
            .layout
            .layer(layer)
            .ok_or_else(|| Error::Unsupported(format!("layer {layer} has no routed experts")))?;
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            if id >= le.experts.len() {
                return Err(Error::Unsupported(format!(
                    "expert {id} requested from layer {layer}, which has {}",
                    le.experts.len()
                )));
            }
            if !out.contains(&id) {
                out.push(id);
            }
        }
        let mut bytes = 0;
        if mode != FetchMode::Ahead {
            self.note_routed(layer, &out);
        }
        for &id in &out {
            bytes += le.plans[id].bytes as u64;
        }
        self.layer_requests[layer].fetch_add(out.len() as u64, Ordering::Relaxed);
        self.counters.fetches.fetch_add(1, Ordering::Relaxed);
        self.counters.experts_served.fetch_add(out.len() as u64, Ordering::Relaxed);
        self.counters.bytes_served.fetch_add(bytes, Ordering::Relaxed);
        Ok((le, out))
    }

    /// Blocks until all `ids` of `layer` are available and returns them; they stay
    /// valid (cannot be evicted) while the lease lives. A read that fails gives an
    /// error naming the file, the layer and the expert; the store stays usable.
    pub fn fetch(&self, layer: usize, ids: &[usize]) -> Result<ExpertLease<'_>> {
        self.fetch_with(layer, ids, FetchMode::Wait)
    }

    /// [`fetch`](Self::fetch), or with [`FetchMode::Stream`] a lease whose experts are
    /// taken as their reads end (see [`ExpertLease`]).
    pub fn fetch_with(&self, layer: usize, ids: &[usize], mode: FetchMode) -> Result<ExpertLease<'_>> {
        let (le, ids) = self.admit(layer, ids, mode)?;
        let srcs = match &self.kind {
            Kind::Mapped => ids.iter().map(|&x| Src::Mapped(&le.experts[x])).collect(),
            Kind::Resident { bufs, .. } => {
                let buf = bufs[layer].as_deref().expect("a resident layer");
                ids.iter().map(|&x| Src::Buf { buf, base: x * le.slot_bytes, mats: &le.plans[x].mats }).collect()
            }
            Kind::Streamed(s) => return self.fetch_streamed(s, Want { layer, le, mode }, ids),
        };
        Ok(ExpertLease { ids, inner: Inner::Ready { srcs, pinned: None } })
    }

    fn fetch_streamed<'a>(&'a self, s: &'a Streamed, want: Want<'a>, ids: Vec<usize>) -> Result<ExpertLease<'a>> {
        let Want { layer, le, mode } = want;
        let cache = s.caches[layer].as_deref().expect("a streamed layer");
        let counts = &self.hist[layer];
        let mut srcs: Vec<Option<Src<'a>>> = (0..ids.len()).map(|_| None).collect();
        // Streaming: per id, its slot and the read to wait for, or queued for a slot.
        let mut items: Vec<stream::Item> = (0..ids.len()).map(|_| stream::Item::Queued).collect();
        let mut started = Vec::new();
        let mut pinned = Vec::with_capacity(ids.len());
        let mut waits = Vec::new();
        let mut promote = Vec::new();
        let mut jobs = Vec::new();
        {
            let mut st = cache.state.lock().unwrap();
            st.clock += 1;
            let now = st.clock;
            st.c.requests += ids.len() as u64;
            // Hits first, pinned before any miss picks a victim, so that a miss
            // cannot evict an expert this same fetch wants.
            for (i, &x) in ids.iter().enumerate() {
                let Some(si) = st.slot_of[x] else { continue };
                let slot = &mut st.slots[si];
                slot.pins += 1;
                slot.last_use = now;
                let was_spec = std::mem::take(&mut slot.speculative);
                let read_bytes = slot.read_bytes as u64;
                let load = match &slot.state {
                    SlotState::Loading(load) => {
                        waits.push(load.clone());
                        if load.speculative.swap(false, Ordering::Relaxed) {
                            promote.push(load.clone());
                        }
                        Some(load.clone())
                    }
                    SlotState::Ready => None,
                    SlotState::Free => unreachable!("a free slot is in no expert's index"),
                };
                if was_spec {
                    st.c.prefetch_hits += 1;
                    st.c.prefetch_used += 1;
                    st.c.prefetch_used_bytes += read_bytes;
                } else if load.is_some() {
                    st.c.joined += 1;
                } else {
                    st.c.hits += 1;
                }
                pinned.push(si);
                srcs[i] = Some(Src::Buf { buf: &cache.bufs[si], base: 0, mats: &le.plans[x].mats });
                items[i] = stream::Item::Slot { slot: si, load };
            }
            for (i, &x) in ids.iter().enumerate() {
                if srcs[i].is_some() {
                    continue;
                }
                st.c.misses += 1;
                let plan = &le.plans[x];
                match st.victim(s.policy, counts, None) {
                    Some(si) => {
                        let target = Target::Slot { cache: s.caches[layer].clone().expect("a cache"), slot: si };
                        let req = LoadReq { layer, expert: x, speculative: false, target };
                        let (load, j) = s.reader.start(req, plan, &cache.bufs[si], 0);
                        st.assign(si, x, load.clone(), Claim::Fetch);
                        jobs.extend(j);
                        waits.push(load.clone());
                        pinned.push(si);
                        srcs[i] = Some(Src::Buf { buf: &cache.bufs[si], base: 0, mats: &plan.mats });
                        items[i] = stream::Item::Slot { slot: si, load: Some(load) };
                        started.push(i);
                    }
                    // Streaming, a miss with no slot waits for one this lease gives back.
                    None if mode.streams() => {}
                    None => {
                        st.c.overflow += 1;
                        let buf = Arc::new(AlignedBuf::new(le.slot_bytes));
                        let req = LoadReq { layer, expert: x, speculative: false, target: Target::Plain };
                        let (load, j) = s.reader.start(req, plan, &buf, 0);
                        jobs.extend(j);
                        waits.push(load);
                        srcs[i] = Some(Src::Owned { buf, mats: &plan.mats });
                    }
                }
            }
        }
        s.reader.pool.submit(jobs, true);
        promote.iter().for_each(|l| s.reader.pool.promote(l));
        if mode.streams() {
            let stream = stream::Stream::new(stream::Parts { store: self, s, cache, le, layer }, &ids, items, started);
            return Ok(ExpertLease { ids, inner: Inner::Stream(stream) });
        }
        let lease = ExpertLease {
            ids,
            inner: Inner::Ready {
                srcs: srcs.into_iter().map(|s| s.expect("every id served")).collect(),
                pinned: Some((cache, pinned)),
            },
        };
        if !waits.is_empty() {
            let t = Instant::now();
            let mut first_err = None;
            for l in &waits {
                if let Err(e) = l.wait() {
                    first_err.get_or_insert(e);
                }
            }
            self.layer_wait_ns[layer].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if let Some(e) = first_err {
                // Dropping the lease lets go of its slots; failed ones are free already.
                drop(lease);
                return Err(e.into());
            }
        }
        Ok(lease)
    }

    /// Starts reading the misses among `ids` in the background and returns at
    /// once. It takes only free slots or ready, unpinned, non-hot ones (never one
    /// held by a lease or wanted by a fetch in flight, never one it is filling in
    /// the same call); when there is none it skips the expert. With mapped
    /// residency it only hints the kernel (`madvise(MADV_WILLNEED)`); with
    /// resident residency it does nothing.
    pub fn prefetch(&self, layer: usize, ids: &[usize]) {
        let s = match &self.kind {
            Kind::Streamed(s) => s,
            Kind::Mapped => return self.hint_mapped(layer, ids),
            Kind::Resident { .. } => return,
        };
        let (Some(le), Some(Some(cache))) = (self.layout.layer(layer), s.caches.get(layer)) else { return };
        let counts = &self.hist[layer];
        let mut jobs = Vec::new();
        {
            let mut st = cache.state.lock().unwrap();
            st.clock += 1;
            let now = st.clock;
            st.c.prefetch_calls += 1;
            let mut misses = Vec::new();
            for &x in ids {
                if x >= le.experts.len() || misses.contains(&x) {
                    continue;
                }
                match st.slot_of[x] {
                    Some(si) => {
                        st.slots[si].last_use = now;
                        st.c.prefetch_already += 1;
                    }
                    None => misses.push(x),
                }
            }
            for x in misses {
                let Some(si) = st.victim(s.policy, counts, Some(now)) else {
                    st.c.prefetch_skipped += 1;
                    continue;
                };
                let plan = &le.plans[x];
                let req = LoadReq {
                    layer,
                    expert: x,
                    speculative: true,
                    target: Target::Slot { cache: cache.clone(), slot: si },
                };
                let (load, j) = s.reader.start(req, plan, &cache.bufs[si], 0);
                st.assign(si, x, load, Claim::Prefetch);
                st.c.prefetch_issued += 1;
                st.c.prefetch_issued_bytes += plan.read_bytes as u64;
                jobs.extend(j);
            }
        }
        s.reader.pool.submit(jobs, false);
    }

    fn hint_mapped(&self, layer: usize, ids: &[usize]) {
        let Some(le) = self.layout.layer(layer) else { return };
        self.hints.calls.fetch_add(1, Ordering::Relaxed);
        for &x in ids {
            let Some(e) = le.experts.get(x) else { continue };
            for t in [&e.gate, &e.up, &e.down] {
                io::will_need(t.bytes());
            }
            self.hints.experts.fetch_add(1, Ordering::Relaxed);
            self.hints.bytes.fetch_add(le.plans[x].bytes as u64, Ordering::Relaxed);
        }
    }

    /// Blocks until no read is in flight (prefetches included), for benchmarks
    /// and tests that want a settled cache. Read errors are left to the fetches
    /// that meet them.
    pub fn wait_idle(&self) {
        let Kind::Streamed(s) = &self.kind else { return };
        for cache in s.caches.iter().flatten() {
            loop {
                let loading: Vec<Arc<Load>> = {
                    let st = cache.state.lock().unwrap();
                    st.slots
                        .iter()
                        .filter_map(|s| match &s.state {
                            SlotState::Loading(l) => Some(l.clone()),
                            _ => None,
                        })
                        .collect()
                };
                if loading.is_empty() {
                    break;
                }
                loading.iter().for_each(|l| {
                    let _ = l.wait();
                });
            }
        }
    }

    /// How often each expert was fetched so far.
    /// Counts experts `ids` of `layer` as routed to, for the routing histogram: a
    /// device serving them from its own tier fetches only the others from the store.
    pub fn note_routed(&self, layer: usize, ids: &[usize]) {
        for &id in ids {
            if let Some(c) = self.hist.get(layer).and_then(|h| h.get(id)) {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub fn histogram(&self) -> RoutingHistogram {
        RoutingHistogram {
            layers: self.hist.iter().map(|l| l.iter().map(|c| c.load(Ordering::Relaxed)).collect()).collect(),
        }
    }

    pub fn stats(&self) -> StoreStats {
        let secs = |ns: u64| ns as f64 * 1e-9;
        let rate = |hit: u64, req: u64| (req > 0).then(|| hit as f64 / req as f64);
        let mut prefetch = PrefetchStats::default();
        let mut layers = Vec::new();
        let (mut hits, mut joined, mut pf_hits, mut misses, mut overflow, mut evictions) = (0, 0, 0, 0, 0, 0);
        let mut requests = 0;
        let mut cache_bytes = 0;
        for l in self.layout.moe_layers() {
            let le = self.layout.layer(l).expect("a MoE layer");
            let wait = secs(self.layer_wait_ns[l].load(Ordering::Relaxed));
            let req = self.layer_requests[l].load(Ordering::Relaxed);
            requests += req;
            let ls = match &self.kind {
                Kind::Streamed(s) => {
                    let cache = s.caches[l].as_ref().expect("a streamed layer");
                    cache_bytes += (cache.bufs.len() * le.slot_bytes) as u64;
                    let st = cache.state.lock().unwrap();
                    let c = &st.c;
                    hits += c.hits;
                    joined += c.joined;
                    pf_hits += c.prefetch_hits;
                    misses += c.misses;
                    overflow += c.overflow;
                    evictions += c.evictions;
                    prefetch.calls += c.prefetch_calls;
                    prefetch.issued += c.prefetch_issued;
                    prefetch.issued_bytes += c.prefetch_issued_bytes;
                    prefetch.used += c.prefetch_used;
                    prefetch.used_bytes += c.prefetch_used_bytes;
                    prefetch.wasted += c.prefetch_wasted;
                    prefetch.wasted_bytes += c.prefetch_wasted_bytes;
                    prefetch.already_cached += c.prefetch_already;
                    prefetch.skipped += c.prefetch_skipped;
                    for s in st.slots.iter().filter(|s| s.speculative) {
                        prefetch.pending += 1;
                        prefetch.pending_bytes += s.read_bytes as u64;
                    }
                    LayerStats {
                        layer: l,
                        slots: st.slots.len(),
                        hot: st.slots.iter().filter(|s| s.hot).count(),
                        requests: c.requests,
                        hits: c.hits,
                        joined: c.joined,
                        prefetch_hits: c.prefetch_hits,
                        misses: c.misses,
                        hit_rate: rate(c.hits + c.joined + c.prefetch_hits, c.requests),
                        overflow_reads: c.overflow,
                        evictions: c.evictions,
                        bytes_read: c.bytes_read,
                        fetch_wait_s: wait,
                    }
                }
                kind => {
                    let resident = matches!(kind, Kind::Resident { .. });
                    if resident {
                        hits += req;
                        cache_bytes += (le.experts.len() * le.slot_bytes) as u64;
                    }
                    LayerStats {
                        layer: l,
                        slots: if resident { le.experts.len() } else { 0 },
                        hot: 0,
                        requests: req,
                        hits: if resident { req } else { 0 },
                        joined: 0,
                        prefetch_hits: 0,
                        misses: 0,
                        hit_rate: if resident { rate(req, req) } else { None },
                        overflow_reads: 0,
                        evictions: 0,
                        bytes_read: 0,
                        fetch_wait_s: wait,
                    }
                }
            };
            layers.push(ls);
        }
        if let Kind::Mapped = self.kind {
            prefetch.calls = self.hints.calls.load(Ordering::Relaxed);
            prefetch.issued = self.hints.experts.load(Ordering::Relaxed);
            prefetch.issued_bytes = self.hints.bytes.load(Ordering::Relaxed);
        }
        let files: Vec<bool> = match &self.kind {
            Kind::Mapped => Vec::new(),
            Kind::Resident { files, .. } => files.clone(),
            Kind::Streamed(s) => s.reader.files.iter().map(|f| f.is_direct()).collect(),
        };
        let direct_files = files.iter().filter(|&&d| d).count();
        let fallback_reason = match &self.kind {
            Kind::Mapped => Some("mapped residency reads through the page cache".into()),
            _ => self.direct.fallback.lock().unwrap().clone(),
        };
        StoreStats {
            residency: self.residency.name(),
            policy: self.cfg_policy.name(),
            expert_bytes_total: self.layout.expert_bytes_total(),
            cache_bytes,
            read_threads: self.read_threads,
            chunk_bytes: self.chunk_bytes,
            direct_io: DirectIoStats {
                requested: self.direct.requested,
                active: !files.is_empty() && direct_files == files.len(),
                direct_files,
                buffered_files: files.len() - direct_files,
                fallback_reason,
            },
            requests,
            hits,
            joined,
            prefetch_hits: pf_hits,
            misses,
            hit_rate: match self.kind {
                Kind::Mapped => None,
                _ => rate(hits + joined + pf_hits, requests),
            },
            overflow_reads: overflow,
            evictions,
            bytes_read: self.io.bytes_read.load(Ordering::Relaxed),
            read_calls: self.io.read_calls.load(Ordering::Relaxed),
            read_busy_s: secs(self.io.read_ns.load(Ordering::Relaxed)),
            fetch_wait_s: layers.iter().map(|l| l.fetch_wait_s).sum(),
            read_errors: self.io.read_errors.load(Ordering::Relaxed),
            last_error: self.io.last_error.lock().unwrap().clone(),
            prefetch,
            layers,
        }
    }
}
