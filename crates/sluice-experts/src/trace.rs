//! `SLUICE_STORE_TRACE=1`: one line on stderr for each event of a streamed store, with
//! the milliseconds since the first, for seeing whether the disk and the products
//! overlap: a fetch of a layer's experts, a probe reading ahead, each chunk a reader
//! starts (`spec=true` for a read-ahead), each expert's read ending, each take (`wait`
//! if its read had not ended) and its end, each expert given back. `scripts/store_trace.py`
//! sums them per layer. Off, an event costs one load of a flag.

use std::sync::OnceLock;
use std::time::Instant;

/// The start of the trace, if `SLUICE_STORE_TRACE` is set.
static START: OnceLock<Option<Instant>> = OnceLock::new();

/// Writes the line `event` makes when tracing is on; off, `event` is not called, so
/// what it looks at (a load's state behind a mutex) costs nothing.
pub fn trace(event: impl FnOnce() -> String) {
    if let Some(t0) = START.get_or_init(|| std::env::var_os("SLUICE_STORE_TRACE").map(|_| Instant::now())) {
        eprintln!("store-trace {:.3} {}", t0.elapsed().as_secs_f64() * 1e3, event());
    }
}
