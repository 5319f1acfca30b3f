mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{ARRANGEMENTS, Arrangement, Geometry, Model, Rng, SMALL, TempDir, within};
use sluice_core::{DType, Error};
use sluice_experts::{CacheBudget, ExpertStore, FetchMode, Policy, Residency, RoutingHistogram, StoreConfig};
use sluice_formats::Checkpoint;

fn streamed(slots: usize) -> StoreConfig {
    StoreConfig {
        residency: Residency::Streamed,
        budget: Some(CacheBudget::SlotsPerLayer(slots)),
        read_threads: 3,
        chunk_bytes: 4096,
        ..StoreConfig::default()
    }
}

fn open(m: &Model, cfg: &StoreConfig) -> ExpertStore {
    ExpertStore::open_layout(m.layout(), cfg, None).unwrap()
}

/// A random fetch sequence with prefetches and overlapping leases, every lease
/// checked against the file.
fn exercise(m: &Model, store: &ExpertStore, seed: u64, steps: usize) {
    let mut rng = Rng::new(seed);
    let layers: Vec<usize> = store.layout().moe_layers().collect();
    let mut held = Vec::new();
    for _ in 0..steps {
        let l = layers[rng.below(layers.len())];
        let n = store.n_experts(l);
        let k = match rng.below(10) {
            0 => n,                // a prefill-sized request
            1 => 1 + rng.below(n), // anything
            _ => 1 + rng.below(SMALL.top_k),
        };
        if rng.below(4) == 0 {
            let next = layers[rng.below(layers.len())];
            store.prefetch(next, &rng.ids(n, k));
        }
        let ids = rng.ids(n, k);
        let lease = store.fetch(l, &ids).unwrap();
        m.check(&lease, l, &ids);
        // Sometimes keep a lease across the next fetches (two leases at once).
        if rng.below(3) == 0 {
            held.push((l, ids, lease));
        } else {
            drop(lease);
        }
        if held.len() > 2 {
            let (l, ids, lease) = held.remove(0);
            m.check(&lease, l, &ids);
        }
    }
    for (l, ids, lease) in &held {
        m.check(lease, *l, ids);
    }
}

#[test]
fn every_residency_serves_the_files_bytes() {
    within(300, || {
        let moe = [true, false, true, true];
        for (ai, arr) in ARRANGEMENTS.into_iter().enumerate() {
            let m = Model::build("identity", arr, SMALL, &moe, ai as u64 + 1);
            let mut cfgs = vec![
                StoreConfig::default(),
                StoreConfig { residency: Residency::Resident, ..StoreConfig::default() },
                StoreConfig {
                    residency: Residency::Resident,
                    direct_io: false,
                    chunk_bytes: 4096,
                    ..StoreConfig::default()
                },
            ];
            for slots in [SMALL.top_k, SMALL.top_k + 1, 5, SMALL.n_experts] {
                for policy in [Policy::Lru, Policy::Lfu] {
                    for (direct_io, chunk_bytes, read_threads) in [(true, 4096, 3), (false, 1 << 20, 1)] {
                        cfgs.push(StoreConfig { policy, direct_io, chunk_bytes, read_threads, ..streamed(slots) });
                    }
                }
            }
            for (ci, cfg) in cfgs.iter().enumerate() {
                let store = open(&m, cfg);
                exercise(&m, &store, 100 * ai as u64 + ci as u64, 120);
                let s = store.stats();
                if cfg.residency == Residency::Streamed {
                    assert!(s.misses > 0 && s.bytes_read > 0, "{arr:?} {cfg:?}: {s:?}");
                    assert_eq!(s.requests, s.hits + s.joined + s.prefetch_hits + s.misses);
                }
            }
        }
    });
}

/// A page locker that records what it locks and unlocks (or refuses everything).
struct Recorder {
    refuse: bool,
    locked: std::sync::Mutex<Vec<(usize, usize)>>,
    unlocked: Arc<std::sync::atomic::AtomicUsize>,
}

impl sluice_experts::PageLocker for Recorder {
    fn lock(&self, ptr: *mut u8, len: usize) -> Option<Box<dyn Send + Sync>> {
        if self.refuse {
            return None;
        }
        self.locked.lock().unwrap().push((ptr as usize, len));
        struct Guard(Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        Some(Box::new(Guard(self.unlocked.clone())))
    }
}

/// A resident store locks each MoE layer's buffer once through the configured
/// locker (page-aligned, whole), counts the bytes, serves the file's bytes from
/// them, and unlocks every one when dropped; a locker that refuses leaves the store
/// working, with nothing counted. Other residencies lock nothing.
#[test]
fn a_resident_store_locks_its_buffers_for_a_device() {
    let moe = [true, false, true, true];
    let m = Model::build("identity", ARRANGEMENTS[0], SMALL, &moe, 9);
    for refuse in [false, true] {
        let rec = Arc::new(Recorder { refuse, locked: Default::default(), unlocked: Arc::default() });
        let lock = Some(sluice_experts::PageLock(rec.clone()));
        let store =
            open(&m, &StoreConfig { residency: Residency::Resident, page_lock: lock, ..StoreConfig::default() });
        exercise(&m, &store, 31, 60);
        let locked = rec.locked.lock().unwrap().clone();
        let bytes = store.counters.locked_bytes.load(std::sync::atomic::Ordering::SeqCst);
        if refuse {
            assert!(locked.is_empty() && bytes == 0, "refused, yet {locked:?}, {bytes} bytes");
        } else {
            let layers: Vec<usize> = store.layout().moe_layers().collect();
            assert_eq!(locked.len(), layers.len(), "one lock per MoE layer: {locked:?}");
            let want: usize = layers.iter().map(|&l| store.layer_bytes(l) as usize).sum();
            assert!(bytes as usize >= want, "{bytes} bytes counted, the experts take {want}");
            for &(ptr, len) in &locked {
                assert!(ptr % 4096 == 0 && len % 4096 == 0 && len > 0, "lock of {len} bytes at {ptr:#x}");
            }
        }
        assert_eq!(rec.unlocked.load(std::sync::atomic::Ordering::SeqCst), 0, "unlocked while the store lives");
        drop(store);
        assert_eq!(rec.unlocked.load(std::sync::atomic::Ordering::SeqCst), locked.len(), "every lock let go");
    }
    for cfg in [StoreConfig::default(), streamed(SMALL.top_k + 1)] {
        let rec = Arc::new(Recorder { refuse: false, locked: Default::default(), unlocked: Arc::default() });
        let store = open(&m, &StoreConfig { page_lock: Some(sluice_experts::PageLock(rec.clone())), ..cfg });
        exercise(&m, &store, 32, 30);
        assert!(rec.locked.lock().unwrap().is_empty(), "{:?} locked buffers", store.residency());
    }
}

#[test]
fn reads_follow_the_layout() {
    // A packed expert is one read, a fused one two, a separate one three (with a
    // chunk size larger than any expert).
    for (arr, reads) in [(Arrangement::Packed, 1), (Arrangement::Fused, 2), (Arrangement::Separate, 3)] {
        let m = Model::build("reads", arr, SMALL, &[true], 5);
        let store = open(&m, &StoreConfig { chunk_bytes: 1 << 20, ..streamed(2) });
        let lease = store.fetch(0, &[3]).unwrap();
        m.check(&lease, 0, &[3]);
        assert_eq!(store.stats().read_calls, reads, "{arr:?}");
    }
    // With 4 KiB chunks a packed expert of 3.2 pages is 4 reads, spread over the pool.
    let m = Model::build("reads", Arrangement::Packed, SMALL, &[true], 5);
    let store = open(&m, &streamed(2));
    let _lease = store.fetch(0, &[3]).unwrap();
    assert_eq!(store.stats().read_calls, 4);
}

#[test]
fn budgets_from_the_minimum_up_work_and_below_is_refused() {
    let m = Model::build("budget", Arrangement::Separate, SMALL, &[true, false, true], 7);
    let layout = m.layout();
    let min = layout.min_budget_bytes();
    let slot = layout.layers.iter().flatten().map(|l| l.slot_bytes).max().unwrap() as u64;
    assert_eq!(min, 2 * SMALL.top_k as u64 * slot);
    assert!(layout.expert_bytes_total() < 2 * SMALL.n_experts as u64 * slot);
    let full = 2 * SMALL.n_experts as u64 * slot;
    let mut b = min;
    let mut seen_slots = Vec::new();
    while b <= full + 2 * slot {
        let cfg = StoreConfig { budget: Some(CacheBudget::Bytes(b)), ..streamed(0) };
        let store = open(&m, &cfg);
        seen_slots.push(store.slots(0));
        assert!(store.stats().cache_bytes <= b);
        exercise(&m, &store, b, 30);
        b += slot / 2 + 1;
    }
    assert_eq!(seen_slots.first(), Some(&SMALL.top_k));
    assert_eq!(seen_slots.last(), Some(&SMALL.n_experts));
    for slots in SMALL.top_k..=SMALL.n_experts + 3 {
        let store = open(&m, &streamed(slots));
        assert_eq!(store.slots(2), slots.min(SMALL.n_experts));
        exercise(&m, &store, slots as u64, 30);
    }

    let refused = |cfg: StoreConfig| match ExpertStore::open_layout(m.layout(), &cfg, None) {
        Err(Error::Usage(msg)) => msg,
        Err(e) => panic!("expected a usage error, got {e}"),
        Ok(_) => panic!("a budget too small was accepted"),
    };
    let msg = refused(StoreConfig { budget: Some(CacheBudget::Bytes(min - 1)), ..streamed(0) });
    assert!(msg.contains(&format!("at least {min} bytes")), "{msg}");
    assert!(msg.contains(&format!("{} slots per layer", SMALL.top_k)), "{msg}");
    let msg = refused(streamed(SMALL.top_k - 1));
    assert!(msg.contains(&format!("at least {min} bytes")) && msg.contains("1 slots per layer"), "{msg}");
    let msg = refused(StoreConfig { budget: None, ..streamed(0) });
    assert!(msg.contains(&format!("{min} bytes")), "{msg}");
}

fn one_layer(name: &str, top_k: usize) -> Model {
    Model::build(name, Arrangement::Packed, Geometry { top_k, ..SMALL }, &[true], 11)
}

#[test]
fn lru_evicts_the_least_recently_used() {
    let m = one_layer("lru", 1);
    let store = open(&m, &streamed(3));
    for x in [0, 1, 2, 0] {
        drop(store.fetch(0, &[x]).unwrap());
    }
    assert_eq!(store.cached(0), [0, 1, 2]);
    drop(store.fetch(0, &[3]).unwrap());
    assert_eq!(store.cached(0), [0, 2, 3]);
    drop(store.fetch(0, &[4]).unwrap());
    assert_eq!(store.cached(0), [0, 3, 4]);
    let s = store.stats();
    assert_eq!((s.requests, s.hits, s.misses, s.evictions), (6, 1, 5, 2));
    assert_eq!(s.layers[0].hit_rate, Some(1.0 / 6.0));
}

#[test]
fn lfu_evicts_the_least_frequently_used() {
    let m = one_layer("lfu", 1);
    let store = open(&m, &StoreConfig { policy: Policy::Lfu, ..streamed(3) });
    for x in [0, 0, 0, 1, 1, 2] {
        drop(store.fetch(0, &[x]).unwrap());
    }
    // Counts 0:3 1:2 2:1: 2 goes.
    drop(store.fetch(0, &[3]).unwrap());
    assert_eq!(store.cached(0), [0, 1, 3]);
    // Counts 0:3 1:2 3:1: 3 goes although 0 is older.
    drop(store.fetch(0, &[4]).unwrap());
    assert_eq!(store.cached(0), [0, 1, 4]);
    // Counts 0:3 1:2 4:2: of the two equals the least recent (1) goes.
    drop(store.fetch(0, &[4]).unwrap());
    drop(store.fetch(0, &[5]).unwrap());
    assert_eq!(store.cached(0), [0, 4, 5]);
}

#[test]
fn pinned_experts_are_never_evicted() {
    let m = one_layer("pin", 1);
    let mut h = RoutingHistogram { layers: vec![vec![0; 8]] };
    h.layers[0][5] = 100;
    h.layers[0][6] = 50;
    h.layers[0][2] = 10;
    let mut progress = Vec::new();
    let cfg = StoreConfig { pin: Some(h.clone()), policy: Policy::Lfu, ..streamed(4) };
    let mut record = |d: u64, t: u64| progress.push((d, t));
    let store = ExpertStore::open_layout(m.layout(), &cfg, Some(&mut record)).unwrap();
    // Half of 4 slots.
    assert_eq!(store.hot(0), [5, 6]);
    assert_eq!(store.cached(0), [5, 6]);
    let one = m.expert(0, 5).bytes() as u64;
    assert_eq!(progress.first(), Some(&(0, 2 * one)));
    assert_eq!(progress.last(), Some(&(2 * one, 2 * one)));
    let read_at_open = store.stats().bytes_read;
    let mut rng = Rng::new(3);
    for _ in 0..200 {
        let x = [0, 1, 2, 3, 4, 7][rng.below(6)];
        drop(store.fetch(0, &[x]).unwrap());
        store.prefetch(0, &[[0, 1, 3, 4][rng.below(4)]]);
        assert!(store.cached(0).contains(&5) && store.cached(0).contains(&6));
    }
    let before = store.stats();
    let lease = store.fetch(0, &[5, 6]).unwrap();
    m.check(&lease, 0, &[5, 6]);
    let after = store.stats();
    assert_eq!(after.hits, before.hits + 2);
    assert_eq!(after.layers[0].hot, 2);
    assert!(read_at_open > 0);

    // A pinned set never takes the slots one token needs.
    let cfg = StoreConfig { pin: Some(h.clone()), pin_fraction: 1.0, ..streamed(3) };
    let store = open(&Model::build("pin2", Arrangement::Packed, SMALL, &[true], 11), &cfg);
    assert_eq!(store.hot(0).len(), 1);

    // A histogram of another model is refused.
    let bad = RoutingHistogram { layers: vec![vec![1; 9]] };
    let r = ExpertStore::open_layout(m.layout(), &StoreConfig { pin: Some(bad), ..streamed(4) }, None);
    assert!(matches!(r, Err(Error::Usage(msg)) if msg.contains("does not fit")));
}

#[test]
fn a_lease_protects_its_experts_from_eviction() {
    within(60, || {
        let m = Model::build("lease", Arrangement::Fused, SMALL, &[true], 13);
        let store = open(&m, &streamed(2));
        let lease = store.fetch(0, &[0, 1]).unwrap();
        store.prefetch(0, &[2, 3]);
        let s = store.stats();
        assert_eq!((s.prefetch.issued, s.prefetch.skipped), (0, 2));
        assert_eq!(store.cached(0), [0, 1]);
        // A fetch of others while every slot is held reads into a buffer of its own.
        let other = store.fetch(0, &[4, 5]).unwrap();
        m.check(&other, 0, &[4, 5]);
        assert_eq!(store.stats().overflow_reads, 2);
        assert_eq!(store.cached(0), [0, 1]);
        m.check(&lease, 0, &[0, 1]);
        drop(other);
        drop(lease);
        // Free now: the prefetch takes the slots.
        store.prefetch(0, &[2, 3]);
        assert_eq!(store.stats().prefetch.issued, 2);
        let lease = store.fetch(0, &[2, 3]).unwrap();
        m.check(&lease, 0, &[2, 3]);
        // A fetch for more experts than there are slots is served too.
        drop(lease);
        let all: Vec<usize> = (0..8).collect();
        let lease = store.fetch(0, &all).unwrap();
        m.check(&lease, 0, &all);
    });
}

#[test]
fn prefetch_then_fetch_reads_once() {
    within(60, || {
        let m = Model::build("prefetch", Arrangement::Packed, SMALL, &[true, true], 17);
        let read_bytes = 4 * 4096; // one packed expert of 3.2 pages
        for wait in [true, false] {
            let store = open(&m, &StoreConfig { read_threads: 1, ..streamed(4) });
            store.prefetch(1, &[3]);
            if wait {
                store.wait_idle();
                assert_eq!(store.cached(1), [3]);
            }
            // Whether the read is done or still in flight, the fetch waits for it.
            let lease = store.fetch(1, &[3]).unwrap();
            m.check(&lease, 1, &[3]);
            let s = store.stats();
            assert_eq!(s.bytes_read, read_bytes, "wait {wait}");
            assert_eq!((s.misses, s.prefetch_hits, s.prefetch.used, s.prefetch.used_bytes), (0, 1, 1, read_bytes));
            assert_eq!((s.prefetch.issued, s.prefetch.wasted, s.prefetch.pending), (1, 0, 0));
        }
        // A prefetch nobody uses is wasted once evicted.
        let store = open(&m, &streamed(2));
        store.prefetch(0, &[6, 7]);
        store.prefetch(0, &[6]);
        store.wait_idle();
        drop(store.fetch(0, &[0, 1]).unwrap());
        let s = store.stats();
        assert_eq!((s.prefetch.issued, s.prefetch.already_cached, s.prefetch.wasted), (2, 1, 2));
        assert_eq!(s.prefetch.wasted_bytes, 2 * read_bytes);
        assert_eq!(s.bytes_read, 4 * read_bytes);
        // Pending until then.
        store.prefetch(0, &[5]);
        let s = store.stats();
        assert_eq!((s.prefetch.pending, s.prefetch.pending_bytes), (1, read_bytes));
    });
}

#[test]
fn concurrent_fetch_and_prefetch_stay_consistent() {
    within(300, || {
        let g = Geometry { n_experts: 16, top_k: 3, ..SMALL };
        let m = Arc::new(Model::build("stress", Arrangement::Separate, g, &[true, true, true], 19));
        for (policy, slots) in [(Policy::Lru, 3), (Policy::Lfu, 6), (Policy::Lru, 9)] {
            let store = Arc::new(open(&m, &StoreConfig { policy, read_threads: 4, ..streamed(slots) }));
            let threads: Vec<_> = (0..4)
                .map(|t| {
                    let (m, store) = (m.clone(), store.clone());
                    std::thread::spawn(move || {
                        let mut rng = Rng::new(1000 + t);
                        for _ in 0..400 {
                            let l = rng.below(3);
                            if rng.below(2) == 0 {
                                let (pl, k) = (rng.below(3), 1 + rng.below(4));
                                store.prefetch(pl, &rng.ids(16, k));
                            }
                            let k = 1 + rng.below(4);
                            if rng.below(3) == 0 {
                                // A streamed fetch, as large as a prompt chunk's.
                                let n = 4 + rng.below(12);
                                let ids = rng.ids(16, n);
                                let lease = store.fetch_with(l, &ids, FetchMode::Stream).unwrap();
                                for x in lease.order() {
                                    m.check_one(lease.take(x).unwrap().mats(), l, x);
                                }
                                continue;
                            }
                            let ids = rng.ids(16, k);
                            let lease = store.fetch(l, &ids).unwrap();
                            m.check(&lease, l, &ids);
                            if rng.below(4) == 0 {
                                std::thread::yield_now();
                                m.check(&lease, l, &ids);
                            }
                        }
                    })
                })
                .collect();
            threads.into_iter().for_each(|t| t.join().unwrap());
            store.wait_idle();
            let s = store.stats();
            assert_eq!(s.requests, s.hits + s.joined + s.prefetch_hits + s.misses);
            assert_eq!(s.read_errors, 0);
            // Every slot is free of pins once the leases are gone: a full refill works.
            for l in 0..3 {
                let ids: Vec<usize> = (0..slots).collect();
                let lease = store.fetch(l, &ids).unwrap();
                m.check(&lease, l, &ids);
                drop(lease);
                assert_eq!(store.cached(l), ids);
            }
        }
    });
}

fn truncate(path: &Path, len: u64) {
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(len).unwrap();
}

#[test]
fn a_truncated_file_gives_an_error_naming_file_and_expert() {
    within(60, || {
        for direct_io in [true, false] {
            let m = Model::build("truncated", Arrangement::Packed, SMALL, &[true], 23);
            let store = open(&m, &StoreConfig { direct_io, ..streamed(3) });
            drop(store.fetch(0, &[0, 1]).unwrap());
            // Cut the file in the middle of expert 7 (the last).
            let cut = m.expert(0, 7).up.offset() as u64 + 10;
            truncate(&m.path, cut);
            let t = Instant::now();
            let e = store.fetch(0, &[2, 7]).err().expect("a read past the end fails");
            assert!(t.elapsed() < Duration::from_secs(5));
            let msg = e.to_string();
            assert!(msg.contains(&m.path.display().to_string()), "{msg}");
            assert!(msg.contains("layer 0 expert 7"), "{msg}");
            assert!(msg.contains("short read"), "{msg}");
            assert!(matches!(e, Error::Io { .. }));
            // The store stays usable: intact experts are served, the failed slot is back.
            let lease = store.fetch(0, &[2, 3, 4]).unwrap();
            m.check(&lease, 0, &[2, 3, 4]);
            drop(lease);
            assert!(!store.cached(0).contains(&7));
            // Again, from several threads at once (waiters on one failed read).
            let store = Arc::new(store);
            let waiters: Vec<_> = (0..3)
                .map(|_| {
                    let store = store.clone();
                    std::thread::spawn(move || store.fetch(0, &[7]).err().map(|e| e.to_string()))
                })
                .collect();
            for w in waiters {
                let msg = w.join().unwrap().expect("every waiter hears of the failure");
                assert!(msg.contains("expert 7"), "{msg}");
            }
            // A failed prefetch: the fetch that wanted it hears of it.
            store.prefetch(0, &[7]);
            assert!(store.fetch(0, &[7]).is_err());
            let s = store.stats();
            assert!(s.read_errors >= 2, "{s:?}");
            assert!(s.last_error.as_deref().unwrap().contains("expert 7"));
            let lease = store.fetch(0, &[0, 1, 5]).unwrap();
            m.check(&lease, 0, &[0, 1, 5]);
            drop(lease);

            // Resident residency reads everything at open: it fails there.
            let e = ExpertStore::open_layout(
                m.layout(),
                &StoreConfig { residency: Residency::Resident, direct_io, ..StoreConfig::default() },
                None,
            )
            .err()
            .expect("a resident open of a truncated file fails");
            assert!(e.to_string().contains("expert 7"), "{e}");
        }
    });
}

/// Whether this filesystem takes O_DIRECT for reads.
fn direct_io_works(path: &Path) -> bool {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let Ok(f) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) else { return false };
    #[repr(align(4096))]
    struct Page([u8; 4096]);
    let mut p = Box::new(Page([0; 4096]));
    f.read_at(&mut p.0, 0).is_ok()
}

#[test]
fn direct_io_is_used_where_the_filesystem_allows_and_can_be_turned_off() {
    let m = Model::build("direct", Arrangement::PackedUnaligned, SMALL, &[true, true], 29);
    let store = open(&m, &streamed(3));
    exercise(&m, &store, 1, 50);
    let d = store.stats().direct_io;
    eprintln!("{}: {d:?}", m.path.display());
    assert!(d.requested);
    if direct_io_works(&m.path) {
        assert!(d.active && d.direct_files == 1 && d.fallback_reason.is_none(), "{d:?}");
    } else {
        assert!(!d.active && d.fallback_reason.as_deref().unwrap().contains("O_DIRECT"), "{d:?}");
        eprintln!("O_DIRECT not available under {}: fallback exercised", m.path.display());
    }

    let store = open(&m, &StoreConfig { direct_io: false, ..streamed(3) });
    exercise(&m, &store, 2, 50);
    let d = store.stats().direct_io;
    assert!(!d.requested && !d.active && d.buffered_files == 1, "{d:?}");
    assert!(d.fallback_reason.as_deref().unwrap().contains("turned off"), "{d:?}");

    let store = open(&m, &StoreConfig { residency: Residency::Resident, ..StoreConfig::default() });
    assert_eq!(store.stats().direct_io.active, direct_io_works(&m.path));
}

#[test]
fn the_histogram_counts_fetches_and_round_trips() {
    let m = Model::build("hist", Arrangement::Packed, SMALL, &[true, false, true], 31);
    for residency in [Residency::Mapped, Residency::Resident, Residency::Streamed] {
        let store = open(&m, &StoreConfig { residency, ..streamed(2) });
        drop(store.fetch(0, &[1, 2]).unwrap());
        drop(store.fetch(0, &[2, 2]).unwrap());
        drop(store.fetch(2, &[7]).unwrap());
        store.prefetch(2, &[6]);
        let h = store.histogram();
        assert_eq!(h.layers, vec![vec![0, 1, 2, 0, 0, 0, 0, 0], vec![], vec![0, 0, 0, 0, 0, 0, 0, 1]]);
        assert_eq!(h.top(0, 4), [2, 1]);
        let dir = TempDir::new("hist-file");
        let p = dir.path().join("routing.json");
        h.save(&p).unwrap();
        assert_eq!(RoutingHistogram::load(&p).unwrap(), h);
        // Pinning from it.
        let pinned = open(&m, &StoreConfig { pin: Some(RoutingHistogram::load(&p).unwrap()), ..streamed(4) });
        assert_eq!(pinned.hot(0), [1, 2]);
        assert_eq!(pinned.hot(2), [7]);
        std::fs::write(&p, "{\"layers\": 3}").unwrap();
        let e = RoutingHistogram::load(&p).unwrap_err();
        assert!(e.to_string().contains("routing.json"), "{e}");
    }
}

#[test]
fn mapped_prefetch_only_hints() {
    let m = Model::build("hint", Arrangement::Separate, SMALL, &[true], 39);
    let store = open(&m, &StoreConfig::default());
    store.prefetch(0, &[1, 2, 99]);
    let lease = store.fetch(0, &[1, 2]).unwrap();
    m.check(&lease, 0, &[1, 2]);
    let s = store.stats();
    assert_eq!((s.prefetch.calls, s.prefetch.issued), (1, 2));
    assert_eq!((s.bytes_read, s.hit_rate), (0, None));
    assert!(!s.direct_io.active);
}

#[test]
fn bad_requests_are_errors() {
    let m = Model::build("bad", Arrangement::Packed, SMALL, &[true, false], 37);
    for cfg in [StoreConfig::default(), streamed(2)] {
        let store = open(&m, &cfg);
        assert!(matches!(store.fetch(1, &[0]), Err(Error::Unsupported(_))));
        assert!(matches!(store.fetch(5, &[0]), Err(Error::Unsupported(_))));
        assert!(matches!(store.fetch(0, &[8]), Err(Error::Unsupported(msg)) if msg.contains("expert 8")));
        store.prefetch(0, &[8, 100]);
        store.prefetch(1, &[0]);
        let lease = store.fetch(0, &[3, 3, 1]).unwrap();
        assert_eq!(lease.ids(), [3, 1]);
        m.check(&lease, 0, &[3, 1]);
    }
}

#[test]
fn dropping_a_store_with_reads_queued_returns() {
    within(60, || {
        let g = Geometry { n_experts: 32, top_k: 2, hidden: 128, inter: 128, dtype: DType::F32 };
        let m = Model::build("drop", Arrangement::Separate, g, &[true, true], 41);
        for _ in 0..5 {
            let store = open(&m, &StoreConfig { read_threads: 2, ..streamed(32) });
            store.prefetch(0, &(0..32).collect::<Vec<_>>());
            store.prefetch(1, &(0..32).collect::<Vec<_>>());
            let lease = store.fetch(1, &[31]).unwrap();
            m.check(&lease, 1, &[31]);
            drop(lease);
            drop(store);
        }
    });
}

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny").join(name)
}

#[test]
fn fixtures_serve_identical_bytes_in_every_residency() {
    for name in ["qwen3-moe", "qwen3-moe-fused", "gemma4-moe"] {
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let mapped = ExpertStore::open_mapped(&ckpt).unwrap();
        let min = mapped.min_budget_bytes();
        let cfgs = [
            StoreConfig { residency: Residency::Resident, ..StoreConfig::default() },
            StoreConfig { budget: Some(CacheBudget::Bytes(min)), ..streamed(0) },
            StoreConfig { budget: Some(CacheBudget::Bytes(min * 3)), policy: Policy::Lfu, ..streamed(0) },
        ];
        let mut bar = 0;
        let mut progress = |d: u64, t: u64| {
            assert!(d <= t);
            bar = d;
        };
        for cfg in cfgs {
            let store = ExpertStore::open(&ckpt, &cfg, Some(&mut progress)).unwrap();
            let layers: Vec<usize> = store.layout().moe_layers().collect();
            assert!(!layers.is_empty(), "{name}");
            let mut rng = Rng::new(43);
            for _ in 0..3 {
                for &l in &layers {
                    let n = store.n_experts(l);
                    let k = 1 + rng.below(n);
                    let ids = rng.ids(n, k);
                    let (a, b) = (store.fetch(l, &ids).unwrap(), mapped.fetch(l, &ids).unwrap());
                    for &x in &ids {
                        let (a, b) = (a.get(x), b.get(x));
                        for (p, q) in [(a.gate, b.gate), (a.up, b.up), (a.down, b.down)] {
                            assert_eq!((p.dtype, p.rows, p.cols), (q.dtype, q.rows, q.cols));
                            assert!(p.data == q.data, "{name} layer {l} expert {x}");
                        }
                    }
                }
            }
        }
        assert_eq!(bar, mapped.expert_bytes_total(), "{name}: resident progress ends at the total");
    }
}

/// A streamed fetch of more experts than the layer has slots: taken in order, every
/// expert is the file's bytes, the misses are read through the layer's own slots
/// (no buffer of the lease's own), and each is read once.
#[test]
fn a_streamed_fetch_reads_a_whole_layer_through_its_slots() {
    within(60, || {
        let m = Model::build("stream", Arrangement::Packed, SMALL, &[true, true], 41);
        for slots in [SMALL.top_k, 3, SMALL.n_experts] {
            let store = open(&m, &streamed(slots));
            drop(store.fetch(1, &[6, 2]).unwrap());
            let ids: Vec<usize> = vec![5, 2, 7, 0, 6, 1, 3, 4];
            let lease = store.fetch_with(1, &ids, FetchMode::Stream).unwrap();
            let order = lease.order();
            // Those in memory come first.
            assert!(order[..2].iter().all(|x| [2, 6].contains(x)) || slots < 3, "{order:?}");
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..8).collect::<Vec<_>>());
            for &x in &order {
                let t = lease.take(x).unwrap();
                m.check_one(t.mats(), 1, x);
            }
            drop(lease);
            let s = store.stats();
            assert_eq!((s.overflow_reads, s.read_errors), (0, 0), "slots {slots}: {s:?}");
            assert_eq!(s.layers[1].misses, 2 + 8 - 2.min(slots) as u64, "slots {slots}");
            assert_eq!(store.cached(1).len(), slots);
            // Every slot is free again: a blocking fetch of a full cache works.
            let again: Vec<usize> = (0..slots).collect();
            m.check(&store.fetch(1, &again).unwrap(), 1, &again);
        }
    });
}

/// A queued expert taken while another lease holds every slot is read into a buffer
/// of its own, so taking never waits on a slot; errors name the expert and leave the
/// store usable.
#[test]
fn a_streamed_take_never_waits_on_a_slot_and_reports_read_errors() {
    within(60, || {
        let m = Model::build("stream-busy", Arrangement::Packed, SMALL, &[true], 43);
        let store = open(&m, &streamed(SMALL.top_k));
        let holder = store.fetch(0, &[0, 1]).unwrap();
        let lease = store.fetch_with(0, &[4, 5, 6], FetchMode::Stream).unwrap();
        for x in lease.order() {
            m.check_one(lease.take(x).unwrap().mats(), 0, x);
        }
        drop(lease);
        assert_eq!(store.stats().overflow_reads, 3);
        drop(holder);

        let cut = m.expert(0, 7).up.offset() as u64 + 10;
        truncate(&m.path, cut);
        let lease = store.fetch_with(0, &[3, 7, 2], FetchMode::Stream).unwrap();
        let mut errors = Vec::new();
        for x in lease.order() {
            match lease.take(x) {
                Ok(t) => m.check_one(t.mats(), 0, x),
                Err(e) => errors.push((x, e.to_string())),
            }
        }
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].0 == 7 && errors[0].1.contains("layer 0 expert 7"), "{errors:?}");
        drop(lease);
        assert!(store.fetch_with(0, &[7], FetchMode::Stream).unwrap().wait_all().is_err());
        m.check(&store.fetch(0, &[2, 3]).unwrap(), 0, &[2, 3]);
    });
}
