//! Where each routed expert lies on disk and where it goes in a slot: the aligned
//! reads that cover its three tensors, and the sizes a cache budget is cut into.

use std::sync::Arc;

use sluice_core::{DType, Error, MatRef, Result};
use sluice_formats::{Checkpoint, ExpertMats, MappedFile, TensorView};

use crate::io::{ALIGN, align_down, align_up};

/// One read: an aligned byte range of a file, landing at an aligned offset of a slot.
#[derive(Clone, Debug)]
pub(crate) struct Extent {
    /// Index into [`ExpertLayout::files`].
    pub file: usize,
    pub file_off: u64,
    /// Aligned length read.
    pub len: usize,
    /// How many of those bytes must come back: up to the end of the last real
    /// tensor byte (the aligned tail may run past the end of the file).
    pub needed: usize,
    pub slot_off: usize,
}

/// One matrix of an expert inside its slot.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatLayout {
    pub slot_off: usize,
    pub len: usize,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

impl MatLayout {
    fn of(t: &TensorView, slot_off: usize) -> MatLayout {
        let m = t.mat();
        MatLayout { slot_off, len: t.len_bytes(), dtype: m.dtype, rows: m.rows, cols: m.cols }
    }

    pub fn mat<'a>(&self, slot: &'a [u8]) -> MatRef<'a> {
        MatRef {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            data: &slot[self.slot_off..self.slot_off + self.len],
        }
    }
}

/// How one expert is read into a slot.
#[derive(Clone, Debug)]
pub(crate) struct ExpertPlan {
    pub extents: Vec<Extent>,
    /// gate, up, down.
    pub mats: [MatLayout; 3],
    /// Bytes read from disk for it (the aligned extents).
    pub read_bytes: usize,
    /// Bytes of its tensors.
    pub bytes: usize,
}

/// The routed experts of one MoE layer.
pub struct LayerExperts {
    pub experts: Vec<ExpertMats>,
    /// Experts one token uses: the fewest slots this layer can run with.
    pub top_k: usize,
    pub(crate) plans: Vec<ExpertPlan>,
    /// Bytes of one slot: the largest aligned footprint of any expert of the layer.
    pub slot_bytes: usize,
}

/// Every routed expert of a model and how it is laid out on disk. Cheap to build
/// (no byte is read); the CLI uses it to decide a residency before opening a store.
pub struct ExpertLayout {
    /// One entry per layer; `None` for layers without routed experts.
    pub layers: Vec<Option<LayerExperts>>,
    pub(crate) files: Vec<Arc<MappedFile>>,
}

/// How large the streamed cache is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheBudget {
    /// Bytes of slots in all, split evenly over the MoE layers.
    Bytes(u64),
    /// The same number of slots in every MoE layer.
    SlotsPerLayer(usize),
}

impl ExpertLayout {
    /// The routed experts of every MoE layer of a checkpoint, their shapes checked.
    pub fn from_checkpoint(ckpt: &Checkpoint) -> Result<ExpertLayout> {
        let spec = &ckpt.spec;
        let layers = spec
            .layers
            .iter()
            .enumerate()
            .map(|(l, ls)| {
                ls.moe.as_ref().map(|moe| Ok((ckpt.experts(l, moe, spec.hidden_size)?, moe.top_k))).transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        ExpertLayout::new(layers)
    }

    /// A layout from experts found any other way (a packed file, a test): per layer,
    /// the experts and the layer's top-k, or `None` for a layer without experts.
    pub fn new(layers: Vec<Option<(Vec<ExpertMats>, usize)>>) -> Result<ExpertLayout> {
        let mut files: Vec<Arc<MappedFile>> = Vec::new();
        let mut file_index = |t: &TensorView| -> usize {
            let f = t.file();
            match files.iter().position(|g| Arc::ptr_eq(g, f) || g.path() == f.path()) {
                Some(i) => i,
                None => {
                    files.push(f.clone());
                    files.len() - 1
                }
            }
        };
        let mut out = Vec::with_capacity(layers.len());
        for (l, layer) in layers.into_iter().enumerate() {
            let Some((experts, top_k)) = layer else {
                out.push(None);
                continue;
            };
            if experts.is_empty() || top_k == 0 || top_k > experts.len() {
                return Err(Error::Unsupported(format!(
                    "layer {l}: {} routed experts with top-k {top_k}",
                    experts.len()
                )));
            }
            let mut plans = Vec::with_capacity(experts.len());
            for (x, e) in experts.iter().enumerate() {
                let ts = [&e.gate, &e.up, &e.down];
                if let Some(t) = ts.iter().find(|t| t.len_bytes() == 0) {
                    return Err(Error::format(t.path(), format!("layer {l} expert {x}: tensor '{}' is empty", t.name)));
                }
                let idx = ts.map(&mut file_index);
                plans.push(plan(ts, idx));
            }
            let slot_bytes = plans.iter().map(|p| p.read_bytes).max().unwrap_or(ALIGN);
            out.push(Some(LayerExperts { experts, top_k, plans, slot_bytes }));
        }
        Ok(ExpertLayout { layers: out, files })
    }

    pub fn layer(&self, l: usize) -> Option<&LayerExperts> {
        self.layers.get(l).and_then(Option::as_ref)
    }

    /// Indices of the layers with routed experts.
    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers.iter().enumerate().filter(|(_, l)| l.is_some()).map(|(i, _)| i)
    }

    /// Bytes of all routed-expert tensors.
    pub fn expert_bytes_total(&self) -> u64 {
        self.layers.iter().flatten().flat_map(|l| &l.plans).map(|p| p.bytes as u64).sum()
    }

    /// The smallest `CacheBudget::Bytes` that streamed residency accepts: every
    /// MoE layer's even share holds one token's top-k slots.
    pub fn min_budget_bytes(&self) -> u64 {
        let n = self.moe_layers().count() as u64;
        n * self.layers.iter().flatten().map(|l| (l.top_k * l.slot_bytes) as u64).max().unwrap_or(0)
    }

    /// The fewest slots per layer streamed residency accepts (the largest top-k).
    pub fn min_slots_per_layer(&self) -> usize {
        self.layers.iter().flatten().map(|l| l.top_k).max().unwrap_or(0)
    }

    /// Bytes of slot memory a budget turns into, once cut into whole slots.
    pub fn cache_bytes(&self, budget: CacheBudget) -> Result<u64> {
        let slots = self.slots_for(budget)?;
        Ok(self.layers.iter().zip(&slots).flat_map(|(l, &s)| l.as_ref().map(|l| (s * l.slot_bytes) as u64)).sum())
    }

    /// Slots per layer (0 for layers without experts) for a budget, or a usage
    /// error that states the minimum when one token's experts would not fit.
    pub fn slots_for(&self, budget: CacheBudget) -> Result<Vec<usize>> {
        let n_moe = self.moe_layers().count();
        let mut out = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let Some(l) = l else {
                out.push(0);
                continue;
            };
            let slots = match budget {
                CacheBudget::Bytes(b) => {
                    (b / n_moe.max(1) as u64 / l.slot_bytes as u64).min(usize::MAX as u64) as usize
                }
                CacheBudget::SlotsPerLayer(s) => s,
            };
            if slots < l.top_k {
                return Err(Error::Usage(self.too_small(budget)));
            }
            out.push(slots.min(l.experts.len()));
        }
        Ok(out)
    }

    fn too_small(&self, budget: CacheBudget) -> String {
        let min_bytes = self.min_budget_bytes();
        let min_slots = self.min_slots_per_layer();
        let n_moe = self.moe_layers().count();
        let slot = self.layers.iter().flatten().map(|l| l.slot_bytes).max().unwrap_or(0);
        let asked = match budget {
            CacheBudget::Bytes(b) => format!("{b} bytes ({})", human_bytes(b)),
            CacheBudget::SlotsPerLayer(s) => format!("{s} slots per layer"),
        };
        format!(
            "the expert cache of {asked} cannot hold one token's experts: streamed residency needs at least \
             {min_bytes} bytes ({}), that is {min_slots} slots per layer of {slot} bytes over {n_moe} MoE layers",
            human_bytes(min_bytes)
        )
    }
}

/// The aligned reads covering an expert's three tensors. Tensors in one file whose
/// aligned ranges touch or overlap share a read, so an expert stored contiguously
/// (a packed layout) is read at once, and gate and up halves of a fused tensor too.
fn plan(ts: [&TensorView; 3], file: [usize; 3]) -> ExpertPlan {
    let mut order = [0usize, 1, 2];
    order.sort_by_key(|&i| (file[i], ts[i].offset()));
    let mut extents: Vec<Extent> = Vec::new();
    let mut mat_off = [0usize; 3];
    let mut slot_end = 0;
    for &i in &order {
        let (start, end) = (ts[i].offset() as u64, (ts[i].offset() + ts[i].len_bytes()) as u64);
        let a = align_down(start);
        let joins = extents.last().is_some_and(|e: &Extent| e.file == file[i] && a <= e.file_off + e.len as u64);
        if !joins {
            extents.push(Extent { file: file[i], file_off: a, len: 0, needed: 0, slot_off: slot_end });
        }
        let e = extents.last_mut().expect("an extent");
        let needed = (end - e.file_off) as usize;
        e.needed = e.needed.max(needed);
        e.len = align_up(e.needed);
        slot_end = e.slot_off + e.len;
        mat_off[i] = e.slot_off + (start - e.file_off) as usize;
    }
    ExpertPlan {
        mats: [0, 1, 2].map(|i| MatLayout::of(ts[i], mat_off[i])),
        read_bytes: extents.iter().map(|e| e.len).sum(),
        bytes: ts.iter().map(|t| t.len_bytes()).sum(),
        extents,
    }
}

/// `1.50 GiB`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{b} B") } else { format!("{v:.2} {}", UNITS[u]) }
}
