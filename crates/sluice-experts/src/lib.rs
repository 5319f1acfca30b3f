//! The expert store: the one owner of every routed-expert byte.
//!
//! A family asks for `(layer, expert ids)` and gets matrix views back for as long
//! as it holds the [`ExpertLease`]; whether those bytes were resident, mapped or
//! read from disk into a slot is the store's affair. Today every expert is served
//! in place from the mapped checkpoint; the streamed slot cache and its read pool
//! plug in behind the same two calls.

use std::sync::atomic::{AtomicU64, Ordering};

use sluice_core::{Error, MatRef, Result};
use sluice_formats::{Checkpoint, ExpertMats};

/// One expert's three matrices as computed on.
#[derive(Clone, Copy, Debug)]
pub struct ExpertRef<'a> {
    pub gate: MatRef<'a>,
    pub up: MatRef<'a>,
    pub down: MatRef<'a>,
}

/// The experts a step asked for, valid while the lease lives.
pub struct ExpertLease<'a> {
    ids: Vec<usize>,
    mats: Vec<ExpertRef<'a>>,
}

impl<'a> ExpertLease<'a> {
    /// The matrices of expert `id`, which must be one of the ids fetched.
    pub fn get(&self, id: usize) -> ExpertRef<'a> {
        let i = self.ids.iter().position(|&x| x == id).expect("expert was not fetched");
        self.mats[i]
    }
}

#[derive(Default, Debug)]
pub struct StoreCounters {
    pub fetches: AtomicU64,
    pub experts_served: AtomicU64,
    pub bytes_served: AtomicU64,
}

pub struct ExpertStore {
    layers: Vec<Vec<ExpertMats>>,
    pub counters: StoreCounters,
}

impl ExpertStore {
    /// Indexes every MoE layer's experts in the checkpoint, checking their shapes.
    pub fn open(ckpt: &Checkpoint) -> Result<ExpertStore> {
        let spec = &ckpt.spec;
        let layers = spec
            .layers
            .iter()
            .enumerate()
            .map(|(l, ls)| match &ls.moe {
                Some(moe) => ckpt.experts(l, moe, spec.hidden_size),
                None => Ok(Vec::new()),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ExpertStore { layers, counters: StoreCounters::default() })
    }

    pub fn n_experts(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, Vec::len)
    }

    /// Bytes of all routed experts.
    pub fn total_bytes(&self) -> u64 {
        self.layers.iter().flatten().map(|e| e.bytes() as u64).sum()
    }

    /// Serves the given experts of one layer.
    pub fn fetch(&self, layer: usize, ids: &[usize]) -> Result<ExpertLease<'_>> {
        let experts = self
            .layers
            .get(layer)
            .filter(|l| !l.is_empty())
            .ok_or_else(|| Error::Unsupported(format!("layer {layer} has no routed experts")))?;
        let mut mats = Vec::with_capacity(ids.len());
        let mut bytes = 0u64;
        for &id in ids {
            let e = experts.get(id).ok_or_else(|| {
                Error::Unsupported(format!("expert {id} requested from layer {layer}, which has {}", experts.len()))
            })?;
            bytes += e.bytes() as u64;
            mats.push(ExpertRef { gate: e.gate.mat(), up: e.up.mat(), down: e.down.mat() });
        }
        self.counters.fetches.fetch_add(1, Ordering::Relaxed);
        self.counters.experts_served.fetch_add(ids.len() as u64, Ordering::Relaxed);
        self.counters.bytes_served.fetch_add(bytes, Ordering::Relaxed);
        Ok(ExpertLease { ids: ids.to_vec(), mats })
    }
}
