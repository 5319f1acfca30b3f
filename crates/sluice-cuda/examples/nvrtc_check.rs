//! Compiles every unit of the CUDA kernels with NVRTC for Hopper (sm_90) and reports
//! each one's machine code and compile time: a check of `kernels.cu` on a machine
//! with NVRTC but no GPU.
//!
//!     LD_LIBRARY_PATH=<dir with libnvrtc.so.13> cargo run -p sluice-cuda --example nvrtc_check [DIR]
//!
//! (`pip download nvidia-cuda-nvrtc` and unzip the wheel for such a directory.) With
//! DIR, each unit's machine code is written there as UNIT.cubin, for
//! `cuobjdump --dump-resource-usage` (registers a thread, shared memory) without a GPU.

use sluice_cuda::Unit;

fn main() {
    let out = std::env::args_os().nth(1).map(std::path::PathBuf::from);
    let units = std::iter::once(Unit::Common).chain(sluice_core::DType::ALL.iter().map(|&d| Unit::Format(d)));
    for unit in units {
        let t = std::time::Instant::now();
        match sluice_cuda::compile(9, 0, unit) {
            Ok(bin) => {
                println!("{unit:?}: {} bytes of sm_90 code in {:.2} s", bin.len(), t.elapsed().as_secs_f64());
                if let Some(dir) = &out {
                    let path = dir.join(format!("{}.cubin", unit.label()));
                    if let Err(e) = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, &bin)) {
                        eprintln!("{}: {e}", path.display());
                        std::process::exit(1)
                    }
                }
            }
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1)
            }
        }
    }
}
