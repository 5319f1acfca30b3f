//! The disk roofline for streamed decode: how fast this machine reads experts of
//! this model from disk, measured the way the store reads them (each expert's
//! aligned extents, cut into chunks spread over reader threads, O_DIRECT so the page
//! cache neither helps nor hides anything).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use sluice_core::{Error, Result};

use crate::io::{AlignedBuf, DirectStatus, FileHandle, align_up};
use crate::layout::ExpertLayout;

#[derive(Clone, Debug, Serialize)]
pub struct DiskBench {
    pub bytes_per_s: f64,
    pub bytes: u64,
    pub seconds: f64,
    pub threads: usize,
    /// Experts read per batch (all chunks of a batch in flight together).
    pub batch: usize,
    pub chunk_bytes: usize,
    /// False when the filesystem refused O_DIRECT: the figure may then include
    /// page-cache hits and overstate the disk.
    pub direct: bool,
}

/// Reads batches of `batch` random experts (one layer's misses of a decode step)
/// for about `duration`.
pub fn measure_expert_reads(
    layout: &ExpertLayout,
    threads: usize,
    chunk_bytes: usize,
    batch: usize,
    duration: Duration,
) -> Result<DiskBench> {
    let status = DirectStatus { requested: true, ..Default::default() };
    let files = layout
        .files
        .iter()
        .map(|f| FileHandle::open(f.path(), true, &status).map_err(|e| Error::io(f.path(), e)))
        .collect::<Result<Vec<_>>>()?;
    let experts: Vec<(usize, usize)> = layout
        .layers
        .iter()
        .enumerate()
        .filter_map(|(l, le)| le.as_ref().map(|le| (l, le.plans.len())))
        .flat_map(|(l, n)| (0..n).map(move |e| (l, e)))
        .collect();
    if experts.is_empty() {
        return Err(Error::Usage("the model has no routed experts to read".into()));
    }
    let chunk = align_up(chunk_bytes.max(1));
    let threads = threads.max(1);
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let start = Instant::now();
    let mut total = 0u64;
    while start.elapsed() < duration {
        // The chunks of one batch, as (file, offset, length, needed).
        let mut jobs = Vec::new();
        for _ in 0..batch {
            let (l, e) = experts[(next() % experts.len() as u64) as usize];
            let plan = &layout.layers[l].as_ref().expect("a MoE layer").plans[e];
            for x in &plan.extents {
                let mut off = 0;
                while off < x.len {
                    let len = chunk.min(x.len - off);
                    let needed = x.needed.saturating_sub(off).min(len);
                    jobs.push((x.file, x.file_off + off as u64, len, needed));
                    off += len;
                }
            }
        }
        let cursor = AtomicUsize::new(0);
        let read = std::thread::scope(|s| -> Result<u64> {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| -> Result<u64> {
                        let buf = AlignedBuf::new(chunk);
                        let mut got = 0u64;
                        loop {
                            let i = cursor.fetch_add(1, Ordering::Relaxed);
                            let Some(&(f, off, len, needed)) = jobs.get(i) else { return Ok(got) };
                            // SAFETY: the buffer belongs to this thread alone.
                            let dst = unsafe { buf.slice_mut(0, len) };
                            let fh = &files[f];
                            got +=
                                fh.read_covering(dst, off, needed, &status).map_err(|e| Error::io(&fh.path, e))? as u64;
                        }
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().expect("reader thread")).sum()
        })?;
        total += read;
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(DiskBench {
        bytes_per_s: total as f64 / seconds,
        bytes: total,
        seconds,
        threads,
        batch,
        chunk_bytes: chunk,
        direct: files.iter().all(|f| f.is_direct()),
    })
}
