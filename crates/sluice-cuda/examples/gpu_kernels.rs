//! Times the CUDA products on the shapes of a Qwen3-30B-A3B layer, for 1, 8 and 64
//! input rows, and what a launch and an allocation cost on the host: a table of
//! microseconds per product and the weight bytes read per second.
//!
//!     cargo build --release -p sluice-cuda --example gpu_kernels   (here)
//!     gpu_kernels                                                 (on the GPU machine)
//!
//! Each product is launched 200 times back to back and waited for once, so a row's
//! time is the GPU's when the GPU is the slower side and the host's launch rate when
//! it is not (the `add` row shows that rate). `SLUICE_CUDA_VARIANT` picks a kernel
//! variant of kernels.cu to compare; `SLUICE_CUDA_PRODUCTS=int` the integer products of
//! K-quant weights instead of the float ones. An integer product quantizes its input
//! at the first call only (the activation keeps its quantized rows), so its rows here
//! leave out that launch.

#[path = "../../sluice-cpu/tests/common/mod.rs"]
mod common;

use std::time::Instant;

use common::{Rng, random_input, random_matrix};
use sluice_core::{DType, MatRef};
use sluice_cuda::Cuda;
use sluice_engine::backend::Backend;

const REPS: usize = 200;

fn main() {
    if let Some(why) = sluice_cuda::probe() {
        eprintln!("no GPU: {why}");
        std::process::exit(1);
    }
    let be = Cuda::open(0).expect("the GPU opens");
    let mut rng = Rng(3);
    // The host's cost of one launch, with the allocation of its output.
    let x = be.act_from_host(1, 2048, &random_input(1, 2048, &mut rng)).unwrap();
    let time = |f: &mut dyn FnMut()| {
        f();
        be.sync().unwrap();
        let t = Instant::now();
        for _ in 0..REPS {
            f();
        }
        be.sync().unwrap();
        t.elapsed().as_secs_f64() * 1e6 / REPS as f64
    };
    let add = time(&mut || {
        let mut y = be.copy(&x).unwrap();
        be.add(&mut y, &x).unwrap();
    });
    println!("copy + add of 2048 floats (two launches, one allocation): {add:.2} us");
    println!("{:<6} {:>7} {:>6} {:>4} {:>9} {:>8}", "format", "rows", "cols", "n", "us", "GB/s");
    let shapes = [
        (DType::Q4K, 768, 2048),
        (DType::Q4K, 2048, 768),
        (DType::Q4K, 4096, 2048),
        (DType::Q4K, 512, 2048),
        (DType::Q4K, 2048, 4096),
        (DType::Q6K, 151_936, 2048),
        (DType::Q6K, 2048, 768),
        (DType::Q8_0, 4096, 2048),
        (DType::F32, 128, 2048),
    ];
    for (dtype, rows, cols) in shapes {
        let bytes = random_matrix(dtype, rows, cols, &mut rng);
        let w = be.upload_mat(MatRef::new(dtype, rows, cols, &bytes).unwrap()).unwrap();
        for n in [1, 8, 64] {
            let x = be.act_from_host(n, cols, &random_input(n, cols, &mut rng)).unwrap();
            let us = time(&mut || {
                be.matmul(&x, &w).unwrap();
            });
            let gbs = bytes.len() as f64 / us / 1e3;
            println!("{:<6} {rows:>7} {cols:>6} {n:>4} {us:>9.2} {gbs:>8.1}", dtype.to_string());
        }
    }
}
