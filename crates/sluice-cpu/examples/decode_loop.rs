//! Profiling aid: one decode matmul in a loop.
#[path = "../tests/common/mod.rs"]
mod common;
use common::{Rng, random_input, random_matrix};
use sluice_core::{DType, MatRef};
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let dtype = common::ALL.into_iter().find(|d| d.name() == a[1]).unwrap();
    let (rows, cols, n, iters): (usize, usize, usize, usize) = (a[2].parse().unwrap(), a[3].parse().unwrap(), a[4].parse().unwrap(), a[5].parse().unwrap());
    let mut rng = Rng(1);
    let w = random_matrix(dtype, rows, cols, &mut rng);
    let x = random_input(n, cols, &mut rng);
    let mut out = vec![0f32; rows * n];
    let m = MatRef::new(dtype, rows, cols, &w).unwrap();
    let t = std::time::Instant::now();
    for _ in 0..iters { sluice_cpu::matmul(m, &x, n, &mut out); }
    let dt = t.elapsed().as_secs_f64() / iters as f64;
    println!("{} {rows}x{cols} n={n}: {:.2} us/call, {:.1} GB/s, {:.1} GFLOP/s", a[1], dt * 1e6, w.len() as f64 / dt / 1e9, 2.0 * (rows * cols * n) as f64 / dt / 1e9);
}
