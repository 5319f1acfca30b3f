//! The read pool: worker threads that read chunks of experts with `pread`.
//!
//! A miss becomes one [`Load`] (one expert into one buffer) cut into chunk
//! [`Job`]s; every worker takes jobs from the same queues, so one expert's miss
//! uses all the readers. Fetches queue their jobs as urgent; prefetches queue
//! theirs as speculative, which workers take only when nothing is urgent, and
//! which a fetch that comes to need that expert promotes to urgent.

use std::collections::VecDeque;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use sluice_core::Error;

use crate::cache::LayerCache;
use crate::io::{AlignedBuf, DirectStatus, FileHandle};
use crate::layout::ExpertPlan;
use crate::trace::trace;

/// Counters the workers keep.
#[derive(Default)]
pub(crate) struct IoCounters {
    pub bytes_read: AtomicU64,
    pub read_calls: AtomicU64,
    pub read_ns: AtomicU64,
    pub read_errors: AtomicU64,
    pub last_error: Mutex<Option<String>>,
}

/// Why a load failed: enough to name the file, the layer and the expert.
#[derive(Clone, Debug)]
pub(crate) struct LoadError {
    pub path: PathBuf,
    pub kind: io::ErrorKind,
    pub msg: String,
}

impl From<LoadError> for Error {
    fn from(e: LoadError) -> Error {
        Error::Io { path: e.path, source: io::Error::new(e.kind, e.msg) }
    }
}

/// Where a load's bytes go, and who must hear that it finished.
pub(crate) enum Target {
    /// A slot of a layer's cache; the cache moves the slot out of its loading state.
    Slot { cache: Arc<LayerCache>, slot: usize },
    /// A buffer someone else owns (a resident layer, a lease's overflow buffer).
    Plain,
}

/// One expert being read into one buffer.
pub(crate) struct Load {
    pub layer: usize,
    pub expert: usize,
    /// Bytes the load reads (its aligned extents).
    pub read_bytes: usize,
    remaining: AtomicUsize,
    failed: AtomicBool,
    error: Mutex<Option<LoadError>>,
    outcome: Mutex<Option<Result<(), LoadError>>>,
    done: Condvar,
    /// Started by a prefetch that no fetch has claimed yet.
    pub speculative: AtomicBool,
    target: Target,
}

/// What one load reads and for whom.
pub(crate) struct LoadReq {
    pub layer: usize,
    pub expert: usize,
    pub speculative: bool,
    pub target: Target,
}

/// The files, the pool and the chunk size: everything needed to read experts.
pub(crate) struct Reader {
    pub files: Vec<Arc<FileHandle>>,
    pub chunk_bytes: usize,
    pub pool: ReadPool,
}

impl Reader {
    /// A load and its jobs: the plan's extents cut into chunks of at most
    /// `chunk_bytes`, written into `buf` from `base`. Nothing is queued yet.
    pub fn start(&self, req: LoadReq, plan: &ExpertPlan, buf: &Arc<AlignedBuf>, base: usize) -> (Arc<Load>, Vec<Job>) {
        let mut chunks = Vec::new();
        for e in &plan.extents {
            let mut o = 0;
            while o < e.len {
                let len = self.chunk_bytes.min(e.len - o);
                chunks.push((
                    e.file,
                    e.file_off + o as u64,
                    len,
                    e.needed.saturating_sub(o).min(len),
                    base + e.slot_off + o,
                ));
                o += len;
            }
        }
        assert!(!chunks.is_empty(), "an expert with no bytes");
        let load = Arc::new(Load {
            layer: req.layer,
            expert: req.expert,
            read_bytes: plan.read_bytes,
            remaining: AtomicUsize::new(chunks.len()),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            outcome: Mutex::new(None),
            done: Condvar::new(),
            speculative: AtomicBool::new(req.speculative),
            target: req.target,
        });
        let jobs = chunks
            .into_iter()
            .map(|(f, file_off, len, needed, dst_off)| Job {
                load: load.clone(),
                file: self.files[f].clone(),
                file_off,
                len,
                needed,
                dst: buf.clone(),
                dst_off,
            })
            .collect();
        (load, jobs)
    }
}

impl Load {
    fn fail(&self, e: LoadError) {
        let mut slot = self.error.lock().unwrap();
        if slot.is_none() {
            *slot = Some(e);
        }
        self.failed.store(true, Ordering::Release);
    }

    /// Counts one chunk done; the last one publishes the outcome.
    fn chunk_done(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let outcome = match self.error.lock().unwrap().take() {
            None => Ok(()),
            Some(e) => Err(e),
        };
        trace(|| format!("read L{} E{}", self.layer, self.expert));
        if let Target::Slot { cache, slot } = &self.target {
            cache.finish_load(*slot, self, outcome.is_ok());
        }
        *self.outcome.lock().unwrap() = Some(outcome);
        self.done.notify_all();
    }

    /// Whether the load has ended (read or failed): [`wait`](Self::wait) would not block.
    pub fn is_done(&self) -> bool {
        self.outcome.lock().unwrap().is_some()
    }

    /// Blocks until every chunk is read or the load failed.
    pub fn wait(&self) -> Result<(), LoadError> {
        let mut o = self.outcome.lock().unwrap();
        loop {
            if let Some(r) = &*o {
                return r.clone();
            }
            o = self.done.wait(o).unwrap();
        }
    }
}

/// One chunk of a load.
pub(crate) struct Job {
    load: Arc<Load>,
    file: Arc<FileHandle>,
    file_off: u64,
    len: usize,
    needed: usize,
    dst: Arc<AlignedBuf>,
    dst_off: usize,
}

impl Job {
    fn run(self, io: &IoCounters, direct: &DirectStatus) {
        let load = &self.load;
        trace(|| format!("chunk L{} E{} spec={}", load.layer, load.expert, load.speculative.load(Ordering::Relaxed)));
        // Once a chunk of the load failed the rest are not read, so waiters hear
        // of the failure as soon as the chunks in progress end.
        if !load.failed.load(Ordering::Acquire) {
            let t = Instant::now();
            // SAFETY: this job is the only writer of `dst_off..dst_off + len`: the
            // chunks of a load are disjoint, the buffer belongs to this load until
            // it completes (a loading slot is never reassigned, an overflow or
            // resident buffer has one load per range), and no reader looks at the
            // range before the load completes (a loading slot is never handed out;
            // completion is published through `remaining` and a mutex).
            let dst = unsafe { self.dst.slice_mut(self.dst_off, self.len) };
            let r = self.file.read_covering(dst, self.file_off, self.needed, direct);
            io.read_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            io.read_calls.fetch_add(1, Ordering::Relaxed);
            match r {
                Ok(n) => {
                    io.bytes_read.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    let msg = format!("reading layer {} expert {}: {e}", load.layer, load.expert);
                    io.read_errors.fetch_add(1, Ordering::Relaxed);
                    *io.last_error.lock().unwrap() = Some(format!("{}: {msg}", self.file.path.display()));
                    load.fail(LoadError { path: self.file.path.clone(), kind: e.kind(), msg });
                }
            }
        }
        load.chunk_done();
    }

    /// Fails the job without reading (the pool is closing).
    fn abandon(self) {
        self.load.fail(LoadError {
            path: self.file.path.clone(),
            kind: io::ErrorKind::Interrupted,
            msg: format!("layer {} expert {}: the expert store was closed", self.load.layer, self.load.expert),
        });
        self.load.chunk_done();
    }
}

#[derive(Default)]
struct Queues {
    urgent: VecDeque<Job>,
    speculative: VecDeque<Job>,
    closing: bool,
}

struct Shared {
    queues: Mutex<Queues>,
    work: Condvar,
    io: Arc<IoCounters>,
    direct: Arc<DirectStatus>,
}

pub(crate) struct ReadPool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl ReadPool {
    pub fn new(threads: usize, io: Arc<IoCounters>, direct: Arc<DirectStatus>) -> ReadPool {
        let shared = Arc::new(Shared { queues: Mutex::default(), work: Condvar::new(), io, direct });
        let threads = (0..threads.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("sluice-read-{i}"))
                    .spawn(move || worker(&s))
                    .expect("spawning a reader thread")
            })
            .collect();
        ReadPool { shared, threads }
    }

    pub fn submit(&self, jobs: Vec<Job>, urgent: bool) {
        if jobs.is_empty() {
            return;
        }
        let mut q = self.shared.queues.lock().unwrap();
        if urgent {
            q.urgent.extend(jobs)
        } else {
            q.speculative.extend(jobs)
        }
        drop(q);
        self.shared.work.notify_all();
    }

    /// Moves the queued chunks of a speculative load ahead of all speculative work.
    pub fn promote(&self, load: &Arc<Load>) {
        let mut q = self.shared.queues.lock().unwrap();
        let spec = std::mem::take(&mut q.speculative);
        let (mine, rest): (VecDeque<Job>, VecDeque<Job>) = spec.into_iter().partition(|j| Arc::ptr_eq(&j.load, load));
        q.speculative = rest;
        q.urgent.extend(mine);
    }
}

fn worker(s: &Shared) {
    loop {
        let job = {
            let mut q = s.queues.lock().unwrap();
            loop {
                if q.closing {
                    return;
                }
                if let Some(j) = q.urgent.pop_front().or_else(|| q.speculative.pop_front()) {
                    break j;
                }
                q = s.work.wait(q).unwrap();
            }
        };
        job.run(&s.io, &s.direct);
    }
}

impl Drop for ReadPool {
    fn drop(&mut self) {
        self.shared.queues.lock().unwrap().closing = true;
        self.shared.work.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // Loads still queued are failed, which also returns their slots.
        let left = {
            let mut q = self.shared.queues.lock().unwrap();
            let mut v: Vec<Job> = q.urgent.drain(..).collect();
            v.extend(q.speculative.drain(..));
            v
        };
        left.into_iter().for_each(Job::abandon);
    }
}
