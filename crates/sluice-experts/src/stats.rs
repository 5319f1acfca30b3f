//! What the store did, as one serialisable snapshot.

use serde::Serialize;

/// A snapshot of the store's counters (`--stats`, `sluice bench --json`).
#[derive(Clone, Debug, Serialize)]
pub struct StoreStats {
    pub residency: &'static str,
    pub policy: &'static str,
    /// Bytes of all routed-expert tensors.
    pub expert_bytes_total: u64,
    /// Bytes of expert memory the store holds: slots (streamed), copies
    /// (resident), 0 (mapped).
    pub cache_bytes: u64,
    pub read_threads: usize,
    pub chunk_bytes: usize,
    pub direct_io: DirectIoStats,
    /// Experts asked for by fetches (each id of each fetch once).
    pub requests: u64,
    /// Found ready in a slot.
    pub hits: u64,
    /// Found being read for another fetch.
    pub joined: u64,
    /// Found read, or being read, by a prefetch.
    pub prefetch_hits: u64,
    /// Read by the fetch that asked.
    pub misses: u64,
    /// `(hits + joined + prefetch_hits) / requests`; `None` for mapped residency,
    /// where the page cache decides and nothing is counted.
    pub hit_rate: Option<f64>,
    /// Misses read into a lease's own buffer because every slot was held.
    pub overflow_reads: u64,
    pub evictions: u64,
    /// Bytes that came from disk (aligned reads, including the open).
    pub bytes_read: u64,
    pub read_calls: u64,
    /// Sum of the time reader threads spent in reads.
    pub read_busy_s: f64,
    /// Time fetches spent blocked on reads.
    pub fetch_wait_s: f64,
    pub read_errors: u64,
    pub last_error: Option<String>,
    pub prefetch: PrefetchStats,
    /// One entry per layer with routed experts.
    pub layers: Vec<LayerStats>,
}

#[derive(Clone, Debug, Serialize)]
pub struct DirectIoStats {
    /// Asked for by the configuration.
    pub requested: bool,
    /// Every expert file is read with O_DIRECT.
    pub active: bool,
    pub direct_files: usize,
    pub buffered_files: usize,
    /// Why some or all reads go through the page cache.
    pub fallback_reason: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct PrefetchStats {
    pub calls: u64,
    /// Experts a prefetch started reading, and their bytes.
    pub issued: u64,
    pub issued_bytes: u64,
    /// Of those, later asked for by a fetch before being evicted.
    pub used: u64,
    pub used_bytes: u64,
    /// Evicted (or failed) without any fetch asking for them.
    pub wasted: u64,
    pub wasted_bytes: u64,
    /// Still in a slot, neither used nor wasted yet.
    pub pending: u64,
    pub pending_bytes: u64,
    /// Asked for but already cached or loading.
    pub already_cached: u64,
    /// Asked for but every slot was held, loading or just prefetched.
    pub skipped: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct LayerStats {
    pub layer: usize,
    pub slots: usize,
    pub hot: usize,
    pub requests: u64,
    pub hits: u64,
    pub joined: u64,
    pub prefetch_hits: u64,
    pub misses: u64,
    pub hit_rate: Option<f64>,
    pub overflow_reads: u64,
    pub evictions: u64,
    pub bytes_read: u64,
    pub fetch_wait_s: f64,
}
