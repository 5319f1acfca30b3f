//! Compiles every unit of the CUDA kernels with NVRTC for Hopper (sm_90) and reports
//! each one's machine code and compile time: a check of `kernels.cu` on a machine
//! with NVRTC but no GPU.
//!
//!     LD_LIBRARY_PATH=<dir with libnvrtc.so.13> cargo run -p sluice-cuda --example nvrtc_check
//!
//! (`pip download nvidia-cuda-nvrtc` and unzip the wheel for such a directory.)

use sluice_cuda::Unit;

fn main() {
    let units = std::iter::once(Unit::Common).chain(sluice_core::DType::ALL.iter().map(|&d| Unit::Format(d)));
    for unit in units {
        let t = std::time::Instant::now();
        match sluice_cuda::compile(9, 0, unit) {
            Ok(bin) => println!("{unit:?}: {} bytes of sm_90 code in {:.2} s", bin.len(), t.elapsed().as_secs_f64()),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1)
            }
        }
    }
}
