//! Compiles the CUDA kernels with NVRTC for Hopper (sm_90) and reports the PTX size:
//! a check of `kernels.cu` on a machine with NVRTC but no GPU.
//!
//!     LD_LIBRARY_PATH=<dir with libnvrtc.so.13> cargo run -p sluice-cuda --example nvrtc_check
//!
//! (`pip download nvidia-cuda-nvrtc` and unzip the wheel for such a directory.)

fn main() {
    match sluice_cuda::compile(9, 0) {
        Ok(ptx) => println!("compiled: {} bytes of PTX", ptx.to_src().len()),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1)
        }
    }
}
