//! Disk read bandwidth, the roofline of streamed decode.
//!
//! Reads a large file with parallel chunked `pread`s, through O_DIRECT (the page
//! cache bypassed, which is the point) and through the page cache made cold for
//! the file with `posix_fadvise(DONTNEED)` before each run, over a grid of thread
//! counts and chunk sizes, in three patterns:
//!
//! - `seq`: the threads take consecutive chunks of the file from a shared cursor.
//! - `expert`: what streamed decode does. Batches of `--batch` experts of
//!   `--expert` bytes each at random aligned offsets; each batch's chunks are
//!   shared by all the threads and the batch ends when its last chunk is read
//!   (one layer's misses), then the next batch starts.
//! - `store`: the same through `ExpertStore` itself: the file cut into packed
//!   experts of `--expert` bytes, 128 to a layer, `--batch` slots per layer, and
//!   each step a fetch of `--batch` random experts of a random layer (nearly all
//!   misses). The gap to `expert` is the store's own overhead.
//!
//! ```text
//! cargo run --release -p sluice-experts --example readbench -- \
//!     --file /work/readbench.bin --create 4GiB [--threads 1,2,4] [--chunks 256K,1M,4M] \
//!     [--modes direct,buffered] [--patterns seq,expert,store] [--bytes 2GiB] \
//!     [--expert 2652K] [--batch 8] [--repeat 3] [--delete]
//! ```
//!
//! Each cell is the median of `--repeat` runs (min and max beside it).
//!
//! ```text
//! ```

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;

const ALIGN: usize = 4096;

fn parse_size(s: &str) -> usize {
    let s = s.trim();
    let (num, mul) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => {
            let m = match s[i..].to_ascii_lowercase().as_str() {
                "k" | "kb" | "kib" => 1 << 10,
                "m" | "mb" | "mib" => 1 << 20,
                "g" | "gb" | "gib" => 1 << 30,
                "b" => 1,
                u => panic!("unknown unit '{u}'"),
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    (num.parse::<f64>().unwrap_or_else(|_| panic!("not a size: {s}")) * mul as f64) as usize
}

struct Args {
    file: PathBuf,
    create: Option<usize>,
    threads: Vec<usize>,
    chunks: Vec<usize>,
    modes: Vec<String>,
    patterns: Vec<String>,
    bytes: usize,
    expert: usize,
    batch: usize,
    repeat: usize,
    delete: bool,
}

fn args() -> Args {
    let mut a = Args {
        file: PathBuf::from("readbench.bin"),
        create: None,
        threads: vec![1, 2, 4],
        chunks: vec![256 << 10, 1 << 20, 4 << 20],
        modes: vec!["direct".into(), "buffered".into()],
        patterns: vec!["seq".into(), "expert".into()],
        bytes: 2 << 30,
        // One Qwen3-30B-A3B expert at Q4_K: 3 x 768 x 2048 x 4.5 bits.
        expert: 3 * 768 * 2048 * 9 / 16,
        batch: 8,
        repeat: 3,
        delete: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        let list = |s: String| s.split(',').map(str::to_string).collect::<Vec<_>>();
        match k.as_str() {
            "--file" => a.file = v().into(),
            "--create" => a.create = Some(parse_size(&v())),
            "--threads" => a.threads = list(v()).iter().map(|s| s.parse().unwrap()).collect(),
            "--chunks" => a.chunks = list(v()).iter().map(|s| parse_size(s)).collect(),
            "--modes" => a.modes = list(v()),
            "--patterns" => a.patterns = list(v()),
            "--bytes" => a.bytes = parse_size(&v()),
            "--expert" => a.expert = parse_size(&v()),
            "--batch" => a.batch = v().parse().unwrap(),
            "--repeat" => a.repeat = v().parse().unwrap(),
            "--delete" => a.delete = true,
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// Writes `size` bytes of random data (xorshift), flushed to disk and dropped
/// from the page cache.
fn create(path: &PathBuf, size: usize) {
    let t = Instant::now();
    let mut f = File::create(path).unwrap();
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut buf = vec![0u8; 8 << 20];
    let mut left = size;
    while left > 0 {
        for w in buf.chunks_exact_mut(8) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            w.copy_from_slice(&s.to_le_bytes());
        }
        let n = left.min(buf.len());
        f.write_all(&buf[..n]).unwrap();
        left -= n;
    }
    f.sync_all().unwrap();
    drop_cache(&f);
    eprintln!("wrote {} MiB in {:.1} s", size >> 20, t.elapsed().as_secs_f64());
}

fn drop_cache(f: &File) {
    // SAFETY: a plain syscall on a descriptor we own.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// One 4 KiB-aligned page; a `Vec` of them is an aligned buffer.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; ALIGN]);

fn aligned(len: usize) -> Vec<Page> {
    vec![Page([0; ALIGN]); len.div_ceil(ALIGN)]
}

fn as_bytes(v: &mut [Page]) -> &mut [u8] {
    // SAFETY: `Page` is `repr(C)` plain bytes with no padding (its size equals its
    // alignment), so the pages are one initialised run of `len * ALIGN` bytes.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), v.len() * ALIGN) }
}

/// Reads every (offset, len) of each batch with `threads` threads; returns bytes read.
fn run(f: &Arc<File>, batches: Arc<Vec<Vec<(u64, usize)>>>, threads: usize, chunk: usize) -> usize {
    let next: Arc<Vec<AtomicUsize>> = Arc::new(batches.iter().map(|_| AtomicUsize::new(0)).collect());
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (f, batches, next, barrier) = (f.clone(), batches.clone(), next.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut buf = aligned(chunk);
                let buf = as_bytes(&mut buf);
                let mut total = 0;
                for (b, jobs) in batches.iter().enumerate() {
                    loop {
                        let i = next[b].fetch_add(1, Ordering::Relaxed);
                        let Some(&(off, len)) = jobs.get(i) else { break };
                        let mut got = 0;
                        while got < len {
                            let n = f.read_at(&mut buf[got..len], off + got as u64).expect("read");
                            if n == 0 {
                                break;
                            }
                            got += n;
                        }
                        total += got;
                    }
                    if batches.len() > 1 {
                        barrier.wait();
                    }
                }
                total
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).sum()
}

/// The `store` pattern: fetches through an `ExpertStore` over the file.
fn store_bench(a: &Args, direct: bool, threads: usize, chunk: usize, bytes: usize) {
    use sluice_core::DType;
    use sluice_experts::{CacheBudget, ExpertLayout, ExpertStore, Residency, StoreConfig};
    use sluice_formats::{ExpertMats, MappedFile, TensorView};

    let file = MappedFile::open(&a.file).unwrap();
    let tensor = a.expert / 3 / 4 * 4;
    let stride = (3 * tensor).div_ceil(ALIGN) * ALIGN;
    let n = file.len() / stride;
    let per_layer = 128.min(n);
    let view =
        |off: usize| TensorView::new(String::new(), DType::F32, vec![tensor / 4], file.clone(), off, tensor).unwrap();
    let layers: Vec<Option<(Vec<ExpertMats>, usize)>> = (0..n / per_layer)
        .map(|l| {
            let experts = (0..per_layer)
                .map(|x| {
                    let o = (l * per_layer + x) * stride;
                    ExpertMats { gate: view(o), up: view(o + tensor), down: view(o + 2 * tensor) }
                })
                .collect();
            Some((experts, a.batch))
        })
        .collect();
    let n_layers = layers.len();
    let cfg = StoreConfig {
        residency: Residency::Streamed,
        budget: Some(CacheBudget::SlotsPerLayer(a.batch)),
        read_threads: threads,
        chunk_bytes: chunk,
        direct_io: direct,
        ..StoreConfig::default()
    };
    let mut rng = 0xDEAD_BEEF_CAFE_F00Du64;
    let mut rand = move |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng as usize % n
    };
    let mut rates = Vec::new();
    let mut last = None;
    for _ in 0..a.repeat.max(1) {
        let store = ExpertStore::open_layout(ExpertLayout::new(layers.clone()).unwrap(), &cfg, None).unwrap();
        // Touch every slot once first: the timed part measures steady state.
        for l in 0..n_layers {
            drop(store.fetch(l, &(0..a.batch).collect::<Vec<_>>()).unwrap());
        }
        drop_cache(&File::open(&a.file).unwrap());
        let start = store.stats().bytes_read as usize;
        let t = Instant::now();
        while (store.stats().bytes_read as usize) < start + bytes {
            let l = rand(n_layers);
            let mut ids = Vec::new();
            while ids.len() < a.batch {
                let x = rand(per_layer);
                if !ids.contains(&x) {
                    ids.push(x);
                }
            }
            drop(store.fetch(l, &ids).unwrap());
        }
        let s = store.stats();
        rates.push((s.bytes_read as usize - start) as f64 / t.elapsed().as_secs_f64() / (1 << 20) as f64);
        last = Some(s);
    }
    rates.sort_by(f64::total_cmp);
    let s = last.unwrap();
    println!(
        "{:<8} {:<9} {:>7} {:>7}K {:>12.0} {:>8.0} {:>8.0}   hit rate {:.3}, direct {}",
        "store",
        if direct { "direct" } else { "buffered" },
        threads,
        chunk >> 10,
        rates[rates.len() / 2],
        rates[0],
        rates[rates.len() - 1],
        s.hit_rate.unwrap_or(0.0),
        s.direct_io.active
    );
}

fn main() {
    let a = args();
    if let Some(size) = a.create {
        create(&a.file, size);
    }
    let size = std::fs::metadata(&a.file).unwrap().len() as usize;
    let bytes = a.bytes.min(size) / ALIGN * ALIGN;
    println!("file {} ({} MiB), {} MiB per run", a.file.display(), size >> 20, bytes >> 20);
    println!(
        "{:<8} {:<9} {:>7} {:>8} {:>12} {:>8} {:>8}",
        "pattern", "mode", "threads", "chunk", "median MiB/s", "min", "max"
    );
    let mut rng = 0x1234_5678_9ABC_DEF1u64;
    let expert = a.expert.div_ceil(ALIGN) * ALIGN;
    for pattern in &a.patterns {
        for &chunk in &a.chunks {
            let chunk = chunk.div_ceil(ALIGN) * ALIGN;
            let batches: Vec<Vec<(u64, usize)>> = match pattern.as_str() {
                "seq" => vec![(0..bytes).step_by(chunk).map(|o| (o as u64, chunk.min(bytes - o))).collect()],
                "expert" => {
                    let n_experts = bytes / expert;
                    let mut v = Vec::new();
                    for b in 0..n_experts.div_ceil(a.batch) {
                        let mut jobs = Vec::new();
                        for _ in b * a.batch..((b + 1) * a.batch).min(n_experts) {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            let start = (rng as usize % (size - expert)) / ALIGN * ALIGN;
                            let mut o = 0;
                            while o < expert {
                                jobs.push(((start + o) as u64, chunk.min(expert - o)));
                                o += chunk;
                            }
                        }
                        v.push(jobs);
                    }
                    v
                }
                "store" => Vec::new(),
                p => panic!("unknown pattern {p}"),
            };
            if pattern == "store" {
                for mode in &a.modes {
                    for &threads in &a.threads {
                        store_bench(&a, mode == "direct", threads, chunk, bytes);
                    }
                }
                continue;
            }
            let batches = Arc::new(batches);
            for mode in &a.modes {
                for &threads in &a.threads {
                    let mut o = OpenOptions::new();
                    o.read(true);
                    if mode == "direct" {
                        o.custom_flags(libc::O_DIRECT);
                    }
                    let f = Arc::new(o.open(&a.file).unwrap());
                    let mut rates: Vec<f64> = (0..a.repeat.max(1))
                        .map(|_| {
                            drop_cache(&f);
                            let t = Instant::now();
                            let n = run(&f, batches.clone(), threads, chunk);
                            n as f64 / t.elapsed().as_secs_f64() / (1 << 20) as f64
                        })
                        .collect();
                    rates.sort_by(f64::total_cmp);
                    println!(
                        "{:<8} {:<9} {:>7} {:>7}K {:>12.0} {:>8.0} {:>8.0}",
                        pattern,
                        mode,
                        threads,
                        chunk >> 10,
                        rates[rates.len() / 2],
                        rates[0],
                        rates[rates.len() - 1]
                    );
                }
            }
        }
    }
    if a.delete {
        std::fs::remove_file(&a.file).unwrap();
        eprintln!("deleted {}", a.file.display());
    }
}
