//! Finding CUDA, starting a context, compiling and launching the kernels.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use sluice_core::{Error, Result};

const SOURCE: &str = include_str!("kernels.cu");

/// Whether a library loads, by each of the names cudarc would try.
fn loadable(lib: &str) -> bool {
    cudarc::get_lib_name_candidates(lib).iter().any(|name| {
        let Ok(c) = CString::new(name.as_str()) else { return false };
        // SAFETY: dlopen with a valid C string; the handle is closed again at once.
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            if h.is_null() {
                false
            } else {
                libc::dlclose(h);
                true
            }
        }
    })
}

/// Why CUDA cannot be used here, or `None` if its driver and NVRTC load and a device
/// is there. Checked before cudarc is touched: its loader panics when a library is
/// missing.
pub fn probe() -> Option<String> {
    if !loadable("cuda") {
        return Some("no CUDA driver (libcuda.so) on this machine".into());
    }
    if !loadable("nvrtc") {
        return Some(
            "CUDA's runtime compiler (libnvrtc.so) was not found: install the CUDA toolkit, or add its lib \
             directory to LD_LIBRARY_PATH"
                .into(),
        );
    }
    match CudaContext::device_count() {
        Ok(0) => Some("the CUDA driver sees no GPU".into()),
        Ok(_) => None,
        Err(e) => Some(format!("the CUDA driver did not start: {e}")),
    }
}

/// The kernels compiled for compute capability `major.minor` (needs only NVRTC, no GPU).
pub fn compile(major: i32, minor: i32) -> Result<cudarc::nvrtc::Ptx> {
    // NVRTC keeps the option string; one per capability for the process.
    let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
    let opts = CompileOptions { arch: Some(arch), name: Some("kernels.cu".into()), ..Default::default() };
    compile_ptx_with_opts(SOURCE, opts).map_err(|e| fail("compiling the kernels", e))
}

/// A device error as sluice's, saying what was being done.
pub(crate) fn fail(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Device(format!("cuda: {what}: {e}"))
}

/// One GPU: its context, the stream every operation runs on, and the kernels.
pub(crate) struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    kernels: HashMap<String, CudaFunction>,
    pub name: String,
}

impl Device {
    pub fn open(ordinal: usize) -> Result<Device> {
        if let Some(why) = probe() {
            return Err(Error::Device(format!("cuda: {why}")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| fail(&format!("opening GPU {ordinal}"), e))?;
        // One stream, so operations are ordered by it; the per-buffer events cudarc
        // would record for several streams are not needed.
        // SAFETY: set before any buffer is allocated.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let (major, minor) = ctx.compute_capability().map_err(|e| fail("reading the compute capability", e))?;
        let ptx = compile(major, minor)?;
        let module = ctx.load_module(ptx).map_err(|e| fail("loading the kernels", e))?;
        let mut kernels = HashMap::new();
        for name in kernel_names() {
            let f = module.load_function(&name).map_err(|e| fail(&format!("kernel {name}"), e))?;
            kernels.insert(name, f);
        }
        let name = ctx.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
        Ok(Device { ctx, stream, kernels, name })
    }

    /// Free and total device memory, in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(|e| fail("reading the memory size", e))
    }

    pub fn kernel(&self, name: &str) -> Result<&CudaFunction> {
        self.kernels.get(name).ok_or_else(|| Error::Device(format!("cuda: no kernel {name}")))
    }

    /// `len` uninitialised elements (at least one: the driver refuses empty buffers).
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every buffer is written before it is read (kernels write their
        // whole output; `zeros` clears).
        unsafe { self.stream.alloc::<T>(len.max(1)) }
            .map_err(|e| fail(&format!("allocating {} bytes", len * size_of::<T>()), e))
    }

    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| fail(&format!("allocating {} bytes", len * size_of::<T>()), e))
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        let mut d = self.alloc::<T>(host.len())?;
        if !host.is_empty() {
            self.stream
                .memcpy_htod(host, &mut d.slice_mut(..host.len()))
                .map_err(|e| fail(&format!("copying {} bytes to the GPU", std::mem::size_of_val(host)), e))?;
        }
        Ok(d)
    }

    pub fn download<T: DeviceRepr + Default + Clone>(&self, d: &CudaSlice<T>, len: usize) -> Result<Vec<T>> {
        let mut host = vec![T::default(); len];
        if len > 0 {
            self.stream.memcpy_dtoh(&d.slice(..len), &mut host).map_err(|e| fail("copying from the GPU", e))?;
        }
        Ok(host)
    }

    /// The device address of `s` (operations are ordered by the one stream).
    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    pub fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| fail("waiting for the GPU", e))
    }
}

/// A launch of `blocks` blocks of `threads`.
pub(crate) fn grid(blocks: (u32, u32), threads: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.0.max(1), blocks.1.max(1), 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// Enough blocks of 256 for a grid-stride loop over `n` elements.
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    grid((n.div_ceil(256).min(65_535) as u32, 1), 256, 0)
}

/// Launches kernel `$name` of device `$dev` with `$cfg`, each argument a scalar
/// (device addresses as `u64`) held in a local for the launch.
macro_rules! launch {
    ($dev:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let dev: &$crate::device::Device = $dev;
        let name: &str = $name;
        let f = dev.kernel(name)?;
        let mut b = dev.stream.launch_builder(f);
        $crate::device::launch!(@push b; $($arg),*);
        // SAFETY: the arguments match the kernel's parameters in kernels.cu, and the
        // buffers they address outlive the launch (freeing is ordered by the stream).
        unsafe { b.launch($cfg) }.map(|_| ()).map_err(|e| $crate::device::fail(name, e))
    }};
    (@push $b:ident; ) => {};
    (@push $b:ident; $a:expr $(, $rest:expr)*) => {
        let v = $a;
        cudarc::driver::PushKernelArg::arg(&mut $b, &v);
        $crate::device::launch!(@push $b; $($rest),*);
    };
}
pub(crate) use launch;

/// Kernel names by weight format.
pub(crate) fn format_suffix(d: sluice_core::DType) -> &'static str {
    use sluice_core::DType::*;
    match d {
        F32 => "f32",
        F16 => "f16",
        BF16 => "bf16",
        Q8_0 => "q8_0",
        Q4_0 => "q4_0",
        Q4_1 => "q4_1",
        Q5_0 => "q5_0",
        Q5_1 => "q5_1",
        MXFP4 => "mxfp4",
        Q4K => "q4_k",
        Q5K => "q5_k",
        Q6K => "q6_k",
    }
}

fn kernel_names() -> Vec<String> {
    let mut names: Vec<String> = sluice_core::DType::ALL
        .iter()
        .flat_map(|&d| ["mm", "mmg", "embed"].map(|k| format!("{k}_{}", format_suffix(d))))
        .collect();
    for n in [
        "add",
        "mul",
        "scale",
        "mul_row",
        "add_row",
        "activate",
        "softcap",
        "glu",
        "gather_rows",
        "scatter_rows",
        "columns",
        "combine",
        "add_expert_bias",
        "rms_norm",
        "rope",
        "kv_write",
        "attention",
    ] {
        names.push(n.into());
    }
    names
}
