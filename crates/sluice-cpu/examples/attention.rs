//! Decode attention speed over a long cache, per KV format, against the memory limit.
//!
//!     cargo run --release -p sluice-cpu --example attention -- [--positions 8192]
//!         [--formats 16,4,3.5] [--threads 2] [--heads 12] [--kv-heads 2] [--head-dim 128]
//!         [--layers 28] [--bw 18.8]
//!
//! One decode row (Qwen2.5-1.5B's heads by default) attends over a cache of `--positions`
//! random positions in each format, TurboQuant's keeping the first and recent positions
//! exact as the engine's caches do, once per layer: `--layers` copies of the cache, one a
//! call, as a decode step reads them (one layer's cache alone would stay in the last-level
//! cache and hide what memory costs). Prints the time per call, the time of a whole
//! step's attention, and the cache bytes a step reads over that time against `--bw`
//! GB/s, the machine's measured read bandwidth: where the fraction is low, attention is
//! bound by arithmetic, not by the bytes a narrower cache saves. Times are the best of
//! five trials; run it on an idle machine.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::{Rng, time};
use sluice_core::{ExactRows, KvFormat, KvLayout};
use sluice_cpu::attention::{AttnParams, AttnSeq, KvCache, attention};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| args.iter().position(|a| a == name).map(|i| args[i + 1].clone());
    let num = |name: &str, default: usize| flag(name).map_or(default, |v| v.parse().unwrap());
    let positions = num("--positions", 8192);
    let (heads, kv_heads, hd, layers) =
        (num("--heads", 12), num("--kv-heads", 2), num("--head-dim", 128), num("--layers", 28));
    let bw: f64 = flag("--bw").map_or(18.8, |v| v.parse().unwrap());
    let formats: Vec<KvFormat> =
        flag("--formats").unwrap_or("16,4,3.5".into()).split(',').map(|f| f.parse().unwrap()).collect();
    let threads = num("--threads", 2);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let kv_dim = kv_heads * hd;
    let mut rng = Rng(11);
    let mut random = |n: usize| (0..n).map(|_| rng.range(-1.0, 1.0)).collect::<Vec<f32>>();
    let (q, k_new, v_new) = (random(heads * hd), random(kv_dim), random(kv_dim));
    // The cache's rows, appended in chunks as a prefill would.
    let (keys, values) = (random(positions * kv_dim), random(positions * kv_dim));
    println!(
        "isa {:?}, {threads} threads; {heads} heads, {kv_heads} KV heads of {hd}; {positions} positions; {layers} layers a step; {bw} GB/s",
        sluice_cpu::isa()
    );
    println!("{:>5} | {:>9} | {:>12} | {:>13} | {:>10}", "bits", "ms a call", "ms a step", "cache MB/call", "of bw");
    for format in formats {
        let exact = if format.bits() <= 4.0 { ExactRows::DEFAULT } else { ExactRows::NONE };
        let mut cache = KvCache::with_layout(&KvLayout { exact, ..KvLayout::plain(kv_dim, hd, format) }).unwrap();
        for (k, v) in keys.chunks(512 * kv_dim).zip(values.chunks(512 * kv_dim)) {
            cache.append(k, v);
        }
        let caches = vec![cache; layers];
        let p = AttnParams {
            n_heads: heads,
            n_kv_heads: kv_heads,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
            softcap: None,
            sinks: None,
            select: None,
        };
        let mut out = vec![0f32; heads * hd];
        let step = || {
            for cache in &caches {
                let seqs = [AttnSeq { first: 0, rows: 1, cache }];
                attention(&p, &q, &k_new, &v_new, &seqs, &mut out);
            }
        };
        let s = pool.install(|| time(Duration::from_millis(3000), step)) / layers as f64;
        let bytes = (caches[0].bytes_per_position() * positions) as f64;
        println!(
            "{:>5} | {:>9.3} | {:>12.1} | {:>13.2} | {:>10.2}",
            format.to_string(),
            s * 1e3,
            s * 1e3 * layers as f64,
            bytes / 1e6,
            bytes / s / 1e9 / bw
        );
    }
}
