//! A streamed fetch handed out expert by expert.
//!
//! [`crate::FetchMode::Stream`] queues the reads of a fetch's misses and returns at
//! once; the caller takes each expert when its read has ended (its hits straight
//! away) and computes on it while the rest are read. A miss that found no free slot
//! waits in a queue: every expert the caller gives back unpins its slot, and the
//! slot goes to the next queued miss. So a prompt chunk that needs more experts than
//! a layer has slots is read through the layer's own cache, its reads running ahead
//! of the computation by as many slots as the cache has, in the cache's memory. Only
//! when the caller takes a queued miss for which no slot is free (another lease holds
//! them) is it read into a buffer of its own, so that taking never waits on a slot.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_core::Result;

use crate::cache::{Claim, LayerCache};
use crate::io::AlignedBuf;
use crate::layout::LayerExperts;
use crate::pool::{Load, LoadReq, Target};
use crate::trace::trace;
use crate::{ExpertStore, Src, Streamed};

/// Where one expert of the lease is.
pub(crate) enum Item {
    /// In a slot the lease pins; `load` is its read, if it was not ready.
    Slot { slot: usize, load: Option<Arc<Load>> },
    /// Waiting for a slot.
    Queued,
    /// Read into a buffer of its own.
    Owned { buf: Arc<AlignedBuf>, load: Arc<Load> },
    /// Taken and given back.
    Done,
}

/// What a stream reads through.
pub(crate) struct Parts<'a> {
    pub store: &'a ExpertStore,
    pub s: &'a Streamed,
    pub cache: &'a LayerCache,
    pub le: &'a LayerExperts,
    pub layer: usize,
}

struct State {
    items: Vec<Item>,
    queue: VecDeque<usize>,
}

pub(crate) struct Stream<'a> {
    parts: Parts<'a>,
    ids: Vec<usize>,
    /// Indices into `ids` in the order to take them.
    order: Vec<usize>,
    state: Mutex<State>,
    waited_ns: AtomicU64,
}

impl<'a> Stream<'a> {
    /// `items` says where each of `ids` is; `started` lists the misses whose reads the
    /// fetch started, in that order. The rest of the misses (`Queued`) wait.
    pub fn new(parts: Parts<'a>, ids: &[usize], items: Vec<Item>, started: Vec<usize>) -> Stream<'a> {
        let ready = (0..ids.len()).filter(|&i| matches!(items[i], Item::Slot { load: None, .. }));
        let joined =
            (0..ids.len()).filter(|&i| matches!(items[i], Item::Slot { load: Some(_), .. }) && !started.contains(&i));
        let queue: VecDeque<usize> = (0..ids.len()).filter(|&i| matches!(items[i], Item::Queued)).collect();
        let order = ready.chain(joined).chain(started.iter().copied()).chain(queue.iter().copied()).collect();
        Stream {
            parts,
            ids: ids.to_vec(),
            order,
            state: Mutex::new(State { items, queue }),
            waited_ns: AtomicU64::new(0),
        }
    }

    pub fn order(&self) -> Vec<usize> {
        self.order.clone()
    }

    pub fn waited(&self) -> Duration {
        Duration::from_nanos(self.waited_ns.load(Ordering::Relaxed))
    }

    /// Whether item `i` can be taken without waiting: in memory, or its read ended.
    pub fn is_ready(&self, i: usize) -> bool {
        match &self.state.lock().unwrap().items[i] {
            Item::Slot { load: None, .. } => true,
            Item::Slot { load: Some(load), .. } | Item::Owned { load, .. } => load.is_done(),
            Item::Queued | Item::Done => false,
        }
    }

    /// Whether misses wait for a slot that a taken item will give back.
    pub fn has_queued(&self) -> bool {
        !self.state.lock().unwrap().queue.is_empty()
    }

    /// Item `i`'s bytes, once its read has ended.
    pub fn take(&self, i: usize) -> Result<Src<'_>> {
        let mats = &self.parts.le.plans[self.ids[i]].mats;
        let (src, load) = {
            let mut st = self.state.lock().unwrap();
            if matches!(st.items[i], Item::Queued) {
                st.queue.retain(|&q| q != i);
                self.start(&mut st, i, true);
            }
            match &st.items[i] {
                Item::Slot { slot, load } => {
                    (Src::Buf { buf: &self.parts.cache.bufs[*slot], base: 0, mats }, load.clone())
                }
                Item::Owned { buf, load } => (Src::Owned { buf: buf.clone(), mats }, Some(load.clone())),
                Item::Done => panic!("expert {} was taken twice", self.ids[i]),
                Item::Queued => unreachable!("a taken expert was started"),
            }
        };
        if let Some(load) = load {
            let t = Instant::now();
            trace(|| format!("take L{} E{} wait={}", self.parts.layer, self.ids[i], !load.is_done()));
            let r = load.wait();
            trace(|| format!("took L{} E{}", self.parts.layer, self.ids[i]));
            let ns = t.elapsed().as_nanos() as u64;
            self.waited_ns.fetch_add(ns, Ordering::Relaxed);
            self.parts.store.layer_wait_ns[self.parts.layer].fetch_add(ns, Ordering::Relaxed);
            r?;
        }
        Ok(src)
    }

    /// Gives item `i` back: its slot goes to the next queued miss.
    pub fn release(&self, i: usize) {
        trace(|| format!("release L{} E{}", self.parts.layer, self.ids[i]));
        let mut st = self.state.lock().unwrap();
        if let Item::Slot { slot, .. } = st.items[i] {
            self.parts.cache.unpin(&[slot]);
        }
        st.items[i] = Item::Done;
        while let Some(&q) = st.queue.front() {
            if !self.start(&mut st, q, false) {
                break;
            }
            st.queue.pop_front();
        }
    }

    /// Starts reading queued item `i` into a free or evictable slot, or when there
    /// is none and `owned`, into a buffer of its own. Returns whether it started.
    fn start(&self, st: &mut State, i: usize, owned: bool) -> bool {
        let Parts { store, s, cache, le, layer } = self.parts;
        let x = self.ids[i];
        let plan = &le.plans[x];
        let jobs = {
            let mut cs = cache.state.lock().unwrap();
            cs.clock += 1;
            match cs.victim(s.policy, &store.hist[layer], None) {
                Some(si) => {
                    let target = Target::Slot { cache: s.caches[layer].clone().expect("a cache"), slot: si };
                    let req = LoadReq { layer, expert: x, speculative: false, target };
                    let (load, jobs) = s.reader.start(req, plan, &cache.bufs[si], 0);
                    cs.assign(si, x, load.clone(), Claim::Fetch);
                    st.items[i] = Item::Slot { slot: si, load: Some(load) };
                    jobs
                }
                None if owned => {
                    cs.c.overflow += 1;
                    let buf = Arc::new(AlignedBuf::new(le.slot_bytes));
                    let req = LoadReq { layer, expert: x, speculative: false, target: Target::Plain };
                    let (load, jobs) = s.reader.start(req, plan, &buf, 0);
                    st.items[i] = Item::Owned { buf, load };
                    jobs
                }
                None => return false,
            }
        };
        s.reader.pool.submit(jobs, true);
        true
    }
}

impl Drop for Stream<'_> {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let slots: Vec<usize> = st
            .items
            .iter()
            .filter_map(|it| if let Item::Slot { slot, .. } = it { Some(*slot) } else { None })
            .collect();
        self.parts.cache.unpin(&slots);
    }
}
