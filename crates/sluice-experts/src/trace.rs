//! `SLUICE_STORE_TRACE=1`: one line on stderr for each event of a streamed store, with
//! the milliseconds since the first, for seeing whether the disk and the products
//! overlap: a fetch of a layer's experts, a probe reading ahead, each chunk a reader
//! starts (`spec=true` for a read-ahead), each expert's read ending, each take (`wait`
//! if its read had not ended) and its end, each expert given back. `scripts/store_trace.py`
//! sums them per layer. Off, an event costs one load of a flag.

use std::fmt::Arguments;
use std::sync::OnceLock;
use std::time::Instant;

/// The start of the trace, if `SLUICE_STORE_TRACE` is set.
static START: OnceLock<Option<Instant>> = OnceLock::new();

/// Writes `event` as a trace line when tracing is on.
pub fn trace(event: Arguments<'_>) {
    if let Some(t0) = START.get_or_init(|| std::env::var_os("SLUICE_STORE_TRACE").map(|_| Instant::now())) {
        eprintln!("store-trace {:.3} {event}", t0.elapsed().as_secs_f64() * 1e3);
    }
}
