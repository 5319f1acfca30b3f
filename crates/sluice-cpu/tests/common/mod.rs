//! Random weights in every stored format, shaped like real ones, for kernel tests
//! and benchmarks.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use sluice_core::DType;

pub const ALL: [DType; 12] = DType::ALL;

/// splitmix64: small, seedable, good enough for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }
    pub fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
}

/// `rows` x `cols` random weights stored as `dtype`: random codes, and scales of
/// the size real checkpoints have (so values are around +-0.1).
pub fn random_matrix(dtype: DType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let n = rows * cols;
    match dtype {
        DType::F32 => return (0..n).flat_map(|_| rng.range(-0.2, 0.2).to_le_bytes()).collect(),
        DType::F16 => return (0..n).flat_map(|_| half::f16::from_f32(rng.range(-0.2, 0.2)).to_le_bytes()).collect(),
        DType::BF16 => return (0..n).flat_map(|_| half::bf16::from_f32(rng.range(-0.2, 0.2)).to_le_bytes()).collect(),
        _ => {}
    }
    let bb = dtype.block_bytes();
    let blocks = n / dtype.block_elems();
    let mut out = vec![0u8; blocks * bb];
    for b in out.chunks_exact_mut(bb) {
        b.iter_mut().for_each(|v| *v = rng.byte());
        let d = rng.range(0.002, 0.02);
        match dtype {
            DType::Q8_0 | DType::Q4_0 | DType::Q5_0 => put_f16(b, 0, d),
            DType::Q4_1 | DType::Q5_1 => {
                put_f16(b, 0, d);
                put_f16(b, 2, -rng.range(4.0, 12.0) * d);
            }
            DType::MXFP4 => b[0] = 118 + (rng.byte() % 8),
            DType::Q4K | DType::Q5K => {
                put_f16(b, 0, d * 0.05);
                put_f16(b, 2, d * 0.05);
            }
            DType::Q6K => put_f16(b, 208, d * 0.05),
            _ => unreachable!(),
        }
    }
    out
}

/// Activations with some structure: a per-row offset and a few outliers, as after a norm.
pub fn random_input(n: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x = Vec::with_capacity(n * cols);
    for _ in 0..n {
        let bias = rng.range(-0.3, 0.3);
        for _ in 0..cols {
            let mut v = rng.range(-1.0, 1.0) + bias;
            if rng.unit() < 0.01 {
                v *= 8.0;
            }
            x.push(v);
        }
    }
    x
}

/// Seconds per call of `f`: the best of five trials, each the mean over at least
/// `min / 5` of repeated calls (the best trial is the one least disturbed by other
/// processes on a shared machine).
pub fn time(min: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let mut calls = 0u64;
        let t = Instant::now();
        while t.elapsed() < min / 5 || calls < 2 {
            f();
            calls += 1;
        }
        best = best.min(t.elapsed().as_secs_f64() / calls as f64);
    }
    best
}
