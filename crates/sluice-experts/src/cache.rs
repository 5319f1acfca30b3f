//! One layer's slot cache: which expert each slot holds and what may happen to it.
//!
//! # The slot protocol
//!
//! Every slot is one aligned buffer and one state, the state guarded by the
//! layer's mutex:
//!
//! - `Free`: holds nothing; may be assigned once no fetch still pins it (a slot
//!   whose load failed goes `Free` while its waiters still hold pins, and is
//!   reassigned only after they let go).
//! - `Loading(load)`: reader jobs are writing its buffer. It is never handed out
//!   and never chosen as a victim. Only the last job of its load moves it on, to
//!   `Ready` or (on a read error) `Free`.
//! - `Ready`: holds the expert's bytes. It is read by leases, never written.
//!
//! `pins` counts the fetches that hold the slot (live leases, and fetches waiting
//! for its load). A slot is chosen as a victim only when it is `Free` or `Ready`
//! with no pins and not hot, so the buffer is written only by the jobs of the
//! single load that owns it while `Loading`, and read only while `Ready` and
//! pinned. The mutex (and the load's completion, published under a mutex) orders
//! those writes before any read.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::Policy;
use crate::io::AlignedBuf;
use crate::pool::Load;

pub(crate) enum SlotState {
    Free,
    Loading(Arc<Load>),
    Ready,
}

pub(crate) struct Slot {
    /// The expert held (meaningless when `Free`).
    pub expert: usize,
    pub state: SlotState,
    pub pins: u32,
    /// Pinned from a routing histogram: never evicted.
    pub hot: bool,
    /// The layer clock at the last fetch or prefetch that wanted it.
    pub last_use: u64,
    /// Read by a prefetch and not used by any fetch yet.
    pub speculative: bool,
    /// Bytes its load reads.
    pub read_bytes: usize,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct LayerCounters {
    pub requests: u64,
    /// Found ready, not brought in by an unused prefetch.
    pub hits: u64,
    /// Found loading for another fetch.
    pub joined: u64,
    /// Read (or still being read) by a prefetch.
    pub prefetch_hits: u64,
    /// Read by this fetch.
    pub misses: u64,
    /// Misses read into a buffer of the lease because no slot was free.
    pub overflow: u64,
    pub evictions: u64,
    pub bytes_read: u64,
    pub read_errors: u64,
    pub prefetch_calls: u64,
    pub prefetch_issued: u64,
    pub prefetch_issued_bytes: u64,
    pub prefetch_used: u64,
    pub prefetch_used_bytes: u64,
    pub prefetch_wasted: u64,
    pub prefetch_wasted_bytes: u64,
    pub prefetch_already: u64,
    pub prefetch_skipped: u64,
}

pub(crate) struct CacheState {
    pub slots: Vec<Slot>,
    /// Expert id to the slot holding it (loading or ready).
    pub slot_of: Vec<Option<usize>>,
    pub clock: u64,
    pub c: LayerCounters,
}

impl CacheState {
    /// The slot to put a new expert in: a free one, else the policy's choice
    /// among the ready, unpinned, non-hot slots not used at tick `keep`.
    pub fn victim(&self, policy: Policy, counts: &[AtomicU64], keep: Option<u64>) -> Option<usize> {
        if let Some(i) = self.slots.iter().position(|s| matches!(s.state, SlotState::Free) && s.pins == 0) {
            return Some(i);
        }
        let candidates =
            self.slots.iter().enumerate().filter(|(_, s)| {
                matches!(s.state, SlotState::Ready) && s.pins == 0 && !s.hot && Some(s.last_use) != keep
            });
        match policy {
            Policy::Lru => candidates.min_by_key(|(_, s)| s.last_use).map(|(i, _)| i),
            Policy::Lfu => {
                candidates.min_by_key(|(_, s)| (counts[s.expert].load(Ordering::Relaxed), s.last_use)).map(|(i, _)| i)
            }
        }
    }

    /// Empties a victim and gives it to `expert`, loading, for `claim`.
    pub fn assign(&mut self, slot: usize, expert: usize, load: Arc<Load>, claim: Claim) {
        let (pins, speculative) = match claim {
            Claim::Fetch => (1, false),
            Claim::Prefetch => (0, true),
            Claim::Preload => (0, false),
        };
        let CacheState { slots, slot_of, c, clock } = self;
        let s = &mut slots[slot];
        debug_assert!(s.pins == 0 && !s.hot && !matches!(s.state, SlotState::Loading(_)));
        if matches!(s.state, SlotState::Ready) {
            slot_of[s.expert] = None;
            c.evictions += 1;
            if s.speculative {
                c.prefetch_wasted += 1;
                c.prefetch_wasted_bytes += s.read_bytes as u64;
            }
        }
        *s = Slot {
            expert,
            read_bytes: load.read_bytes,
            state: SlotState::Loading(load),
            pins,
            hot: false,
            last_use: *clock,
            speculative,
        };
        slot_of[expert] = Some(slot);
    }
}

/// Who a slot is loaded for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Claim {
    /// A fetch that waits for it: pinned by that fetch.
    Fetch,
    /// A prefetch: unpinned, and speculative until a fetch wants it.
    Prefetch,
    /// A hot expert loaded at open (hot slots are never evicted).
    Preload,
}

pub(crate) struct LayerCache {
    pub state: Mutex<CacheState>,
    pub bufs: Vec<Arc<AlignedBuf>>,
}

impl LayerCache {
    pub fn new(n_experts: usize, slots: usize, slot_bytes: usize) -> LayerCache {
        let empty = || Slot {
            expert: 0,
            state: SlotState::Free,
            pins: 0,
            hot: false,
            last_use: 0,
            speculative: false,
            read_bytes: 0,
        };
        LayerCache {
            state: Mutex::new(CacheState {
                slots: (0..slots).map(|_| empty()).collect(),
                slot_of: vec![None; n_experts],
                clock: 0,
                c: LayerCounters::default(),
            }),
            bufs: (0..slots).map(|_| Arc::new(AlignedBuf::new(slot_bytes))).collect(),
        }
    }

    /// Called by the last job of a slot's load.
    pub fn finish_load(&self, slot: usize, load: &Load, ok: bool) {
        let mut st = self.state.lock().unwrap();
        let CacheState { slots, slot_of, c, .. } = &mut *st;
        let s = &mut slots[slot];
        debug_assert!(matches!(&s.state, SlotState::Loading(l) if std::ptr::eq(Arc::as_ptr(l), load)));
        if ok {
            s.state = SlotState::Ready;
            c.bytes_read += load.read_bytes as u64;
        } else {
            c.read_errors += 1;
            if s.speculative {
                c.prefetch_wasted += 1;
                c.prefetch_wasted_bytes += s.read_bytes as u64;
            }
            slot_of[s.expert] = None;
            s.state = SlotState::Free;
            s.speculative = false;
            s.hot = false;
        }
    }

    /// Lets go of slots a fetch pinned.
    pub fn unpin(&self, slots: &[usize]) {
        let mut st = self.state.lock().unwrap();
        for &s in slots {
            let s = &mut st.slots[s];
            debug_assert!(s.pins > 0);
            s.pins -= 1;
        }
    }
}
