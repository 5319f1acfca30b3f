//! Finding CUDA, starting a context, compiling and launching the kernels.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig};
use sluice_core::cache::{cache_dir, fnv64};
use sluice_core::{DType, Error, Result};

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

/// A compilation unit of `kernels.cu`: the kernels every model uses, or one weight
/// format's products and embedding. Each is compiled when first needed, so a model
/// pays only for the formats it stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    Common,
    Format(DType),
}

impl Unit {
    /// The unit that holds kernel `name`.
    fn of(name: &str) -> Unit {
        let format = ["mmgq_", "mmq_", "mmgt_", "mmt_", "mmgo_", "mmo_", "mmg_", "mm_", "embed_"]
            .iter()
            .find_map(|p| name.strip_prefix(p));
        format
            .and_then(|f| DType::ALL.iter().find(|&&d| format_suffix(d) == f))
            .map_or(Unit::Common, |&d| Unit::Format(d))
    }

    /// The unit's name: `common`, or its format's suffix (`q4_k`).
    pub fn label(self) -> &'static str {
        match self {
            Unit::Common => "common",
            Unit::Format(d) => format_suffix(d),
        }
    }

    fn defines(self) -> Vec<String> {
        // A developer's choice among kernel variants under measurement (kernels.cu's
        // SLUICE_VARIANT).
        let variant = variant().map(|v| format!("-DSLUICE_VARIANT={v}"));
        let mut d = self.format_defines();
        d.extend(variant);
        d
    }

    fn format_defines(self) -> Vec<String> {
        match self {
            Unit::Common => Vec::new(),
            Unit::Format(d) => {
                use DType::*;
                // The format's code, as kernels.cu's F_ macros name it.
                let code = match d {
                    F32 => "F_F32",
                    F16 => "F_F16",
                    BF16 => "F_BF16",
                    Q8_0 => "F_Q8_0",
                    Q4_0 => "F_Q4_0",
                    Q4_1 => "F_Q4_1",
                    Q5_0 => "F_Q5_0",
                    Q5_1 => "F_Q5_1",
                    MXFP4 => "F_MXFP4",
                    Q4K => "F_Q4K",
                    Q5K => "F_Q5K",
                    Q6K => "F_Q6K",
                };
                vec![format!("-DSLUICE_FORMAT={code}"), format!("-DSLUICE_FORMAT_NAME={}", format_suffix(d))]
            }
        }
    }
}

/// Unit `unit` of the kernels compiled by NVRTC to machine code for compute
/// capability `major.minor` (needs only NVRTC, no GPU).
pub fn compile(major: i32, minor: i32, unit: Unit) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let what = format!("compiling the {} kernels for sm_{major}{minor}", unit.label());
    let src = CString::new(source()).map_err(|_| fail(&what, "the kernels' source holds a NUL byte"))?;
    let prog = result::create_program(&src, Some(c"kernels.cu")).map_err(|e| fail(&what, e))?;
    let mut opts = vec![format!("--gpu-architecture=sm_{major}{minor}")];
    opts.extend(unit.defines());
    // SAFETY: `prog` was just created and is destroyed once, below.
    unsafe {
        let compiled = result::compile_program(prog, &opts);
        let cubin = compiled.map_err(|e| {
            let log = result::get_program_log(prog).unwrap_or_default();
            let log: String = log.iter().map(|&c| c as u8 as char).filter(|&c| c != '\0').collect();
            fail(&what, format!("{e}\n{log}"))
        });
        let cubin = cubin.and_then(|()| {
            let mut size = 0usize;
            sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| fail(&what, e))?;
            let mut bin = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast()).result().map_err(|e| fail(&what, e))?;
            Ok(bin)
        });
        let _ = result::destroy_program(prog);
        cubin
    }
}

/// Unit `unit`'s machine code: from the cache if an earlier run compiled this
/// source for this device and NVRTC, else compiled now and cached (best effort: an
/// unwritable cache only means compiling again next time).
fn machine_code(major: i32, minor: i32, unit: Unit) -> Result<Vec<u8>> {
    let (mut nv_major, mut nv_minor) = (0, 0);
    // SAFETY: two out-parameters.
    let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut nv_major, &mut nv_minor) };
    let key = format!("{major}.{minor} nvrtc {nv_major}.{nv_minor} {:?}", unit.defines());
    let name =
        format!("{}-sm_{major}{minor}-{:016x}.cubin", unit.label(), fnv64(&[source().as_bytes(), key.as_bytes()]));
    // Kept in `$SLUICE_CACHE_DIR/cuda` (see `sluice_core::cache::cache_dir`).
    let path = cache_dir("cuda").map(|d| d.join(name));
    if let Some(bin) = path.as_ref().and_then(|p| std::fs::read(p).ok())
        && !bin.is_empty()
    {
        return Ok(bin);
    }
    let bin = compile(major, minor, unit)?;
    if let Some(p) = &path
        && let Some(dir) = p.parent()
        && std::fs::create_dir_all(dir).is_ok()
    {
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &bin).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(bin)
}

/// A device error as sluice's, saying what was being done.
pub(crate) fn fail(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Device(format!("cuda: {what}: {e}"))
}

/// One GPU: its context, the stream every operation runs on, and the kernels of
/// the units compiled so far.
pub(crate) struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// Copies of experts into the VRAM tier ahead of their use (the pilot's picks),
    /// beside the kernels of `stream`; ordered against it by events.
    pub copies: Arc<CudaStream>,
    capability: (i32, i32),
    /// Each kernel, and how it follows the one before it.
    kernels: Mutex<HashMap<String, (CudaFunction, Launches)>>,
    loaded: Mutex<Vec<Unit>>,
    pub name: String,
    /// Buffers of intermediates given back by [`Scratch`], for the next of the same size.
    pools: Arc<Pools>,
    /// `SLUICE_CUDA_TRACE`: time by kernel and kind of call.
    trace: Option<(Trace, TraceCounts)>,
    /// How each kernel follows the one before it on `stream`.
    launches: Launches,
}

/// How a kernel follows the one before it on the compute stream.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Launches {
    /// Started once that one has ended (the driver's default).
    Serial,
    /// Started while that one is still running, each kernel waiting at its entry
    /// for the one before to end (kernels.cu's `grid_entry`; Hopper's programmatic
    /// dependent launch): a decode step's some 530 kernels, most of them a few
    /// microseconds long, no longer each wait a launch's latency. Compute capability
    /// 9.0 and later; `SLUICE_CUDA_PDL=0` turns it off, for measuring.
    Overlapped,
}

impl Launches {
    fn of(capability: (i32, i32)) -> Launches {
        let off = std::env::var("SLUICE_CUDA_PDL").is_ok_and(|v| v == "0");
        if capability.0 >= 9 && !off { Launches::Overlapped } else { Launches::Serial }
    }
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
        let copies = ctx.new_stream().map_err(|e| fail("creating a copy stream", e))?;
        let capability = ctx.compute_capability().map_err(|e| fail("reading the compute capability", e))?;
        let name = ctx.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
        let trace = std::env::var("SLUICE_CUDA_TRACE")
            .ok()
            .map(|v| (if v == "cpu" { Trace::Cpu } else { Trace::Sync }, Mutex::default()));
        let dev = Device {
            ctx,
            stream,
            copies,
            capability,
            kernels: Mutex::default(),
            loaded: Mutex::default(),
            name,
            pools: Arc::default(),
            trace,
            launches: Launches::of(capability),
        };
        dev.prepare(Unit::Common)?;
        Ok(dev)
    }

    /// Compiles (or finds in the cache) and loads unit `unit` unless it is loaded.
    pub fn prepare(&self, unit: Unit) -> Result<()> {
        let mut loaded = lock(&self.loaded);
        if loaded.contains(&unit) {
            return Ok(());
        }
        let (major, minor) = self.capability;
        let bin = machine_code(major, minor, unit)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(bin))
            .map_err(|e| fail(&format!("loading the {} kernels", unit.label()), e))?;
        let mut kernels = lock(&self.kernels);
        for name in kernel_names(unit) {
            let f = module.load_function(&name).map_err(|e| fail(&format!("kernel {name}"), e))?;
            if let Some(bytes) = wide_shared(&name) {
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .map_err(|e| fail(&format!("kernel {name}: {bytes} bytes of shared memory"), e))?;
            }
            let launches = if waits_at_entry(&name) { self.launches } else { Launches::Serial };
            kernels.insert(name, (f, launches));
        }
        loaded.push(unit);
        Ok(())
    }

    /// The device's compute capability (major, minor).
    pub fn capability(&self) -> (i32, i32) {
        self.capability
    }

    /// Free and total device memory, in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(|e| fail("reading the memory size", e))
    }

    /// Kernel `name` and how it is launched, its unit loaded first if it is not yet.
    pub fn kernel(&self, name: &str) -> Result<(CudaFunction, Launches)> {
        if let Some(f) = lock(&self.kernels).get(name) {
            return Ok(f.clone());
        }
        self.prepare(Unit::of(name))?;
        lock(&self.kernels).get(name).cloned().ok_or_else(|| Error::Device(format!("cuda: no kernel {name}")))
    }

    /// Starts kernel `f` on the compute stream, `args` pointing at its arguments'
    /// values in the kernel's order.
    ///
    /// # Safety
    /// The arguments match the kernel's parameters in kernels.cu, and the buffers they
    /// address outlive the launch (freeing is ordered by the stream).
    pub unsafe fn launch(
        &self,
        (f, launches): &(CudaFunction, Launches),
        cfg: LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread()?;
        // SAFETY: a plain C struct and union, zero a valid value of both.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(*launches == Launches::Overlapped),
        };
        // SAFETY: the configuration lives through the call; the caller vouches for
        // the arguments.
        unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) }.result()
    }

    /// With `SLUICE_CUDA_TRACE` set: adds the time since `from` to `name`'s count,
    /// after waiting for what was queued (`sync`: the time a step spends in each
    /// kernel, with its launch) or not (`cpu`: the host's time in the call).
    pub fn traced(&self, name: &str, from: Instant) -> Result<()> {
        let Some((mode, t)) = &self.trace else { return Ok(()) };
        if *mode == Trace::Sync {
            self.sync()?;
        }
        let mut t = lock(t);
        let e = t.entry(name.to_string()).or_default();
        e.0 += 1;
        e.1 += from.elapsed();
        Ok(())
    }

    /// `len` uninitialised elements (at least one: the driver refuses empty buffers).
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        let from = Instant::now();
        // SAFETY: every buffer is written before it is read (kernels write their
        // whole output; `zeros` clears).
        let d = unsafe { self.stream.alloc::<T>(len.max(1)) }
            .map_err(|e| fail(&format!("allocating {} bytes", len * size_of::<T>()), e))?;
        self.traced("alloc", from)?;
        Ok(d)
    }

    /// `len` uninitialised elements for an intermediate, from the pool if it holds a
    /// buffer of that size (a step allocates and frees the same sizes in every layer;
    /// the driver's allocation and free cost the host some microseconds each).
    pub fn scratch<T: Pooled>(&self, len: usize) -> Result<Scratch<T>> {
        let len = len.max(1);
        let reused = lock(T::pool(&self.pools)).take(len);
        let buf = match reused {
            Some(b) => b,
            None => self.alloc::<T>(len)?,
        };
        Ok(Scratch { buf: Some(buf), pools: self.pools.clone() })
    }

    /// An intermediate holding `host`.
    pub fn upload_scratch<T: Pooled>(&self, host: &[T]) -> Result<Scratch<T>> {
        let mut d = self.scratch::<T>(host.len())?;
        self.copy_in(host, &mut d)?;
        Ok(d)
    }

    /// Copies `host` to the start of `d`.
    fn copy_in<T: DeviceRepr>(&self, host: &[T], d: &mut CudaSlice<T>) -> Result<()> {
        if !host.is_empty() {
            self.stream
                .memcpy_htod(host, &mut d.slice_mut(..host.len()))
                .map_err(|e| fail(&format!("copying {} bytes to the GPU", std::mem::size_of_val(host)), e))?;
        }
        Ok(())
    }

    /// An intermediate of `len` zeros.
    pub fn zeros_scratch<T: Pooled + cudarc::driver::ValidAsZeroBits>(&self, len: usize) -> Result<Scratch<T>> {
        let mut d = self.scratch::<T>(len)?;
        self.stream.memset_zeros(&mut *d).map_err(|e| fail("clearing device memory", e))?;
        Ok(d)
    }

    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| fail(&format!("allocating {} bytes", len * size_of::<T>()), e))
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        let from = Instant::now();
        let mut d = self.alloc::<T>(host.len())?;
        self.copy_in(host, &mut d)?;
        self.traced("upload", from)?;
        Ok(d)
    }

    /// Makes the copy stream wait for what the compute stream has queued so far (the
    /// allocations the copies fill).
    pub fn copies_after_compute(&self) -> Result<()> {
        let ev = self.stream.record_event(None).map_err(|e| fail("recording an event", e))?;
        self.copies.wait(&ev).map_err(|e| fail("ordering the copy stream", e))
    }

    /// Copies `host` into device memory at `dst` on the copy stream.
    ///
    /// # Safety
    /// `host` stays allocated and unchanged until the copy stream has passed this copy
    /// (page-locked memory is read after this returns), and `dst` holds `host.len()`
    /// bytes that nothing reads before then.
    pub unsafe fn copy_ahead(&self, host: &[u8], dst: u64) -> Result<()> {
        if !host.is_empty() {
            self.ctx.bind_to_thread().map_err(|e| fail("binding the context", e))?;
            // SAFETY: as the caller promises.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, host, self.copies.cu_stream()) }
                .map_err(|e| fail(&format!("copying {} bytes to the GPU ahead", host.len()), e))?;
        }
        Ok(())
    }

    /// An event the copy stream reaches once every copy queued on it so far is done.
    pub fn copies_done(&self) -> Result<cudarc::driver::CudaEvent> {
        self.copies.record_event(None).map_err(|e| fail("recording an event", e))
    }

    /// Makes the compute stream wait for `ev` (copies it is about to read).
    pub fn compute_after(&self, ev: &cudarc::driver::CudaEvent) -> Result<()> {
        self.stream.wait(ev).map_err(|e| fail("ordering the compute stream after copies", e))
    }

    pub fn download<T: DeviceRepr + Default + Clone>(&self, d: &CudaSlice<T>, len: usize) -> Result<Vec<T>> {
        let from = Instant::now();
        let mut host = vec![T::default(); len];
        if len > 0 {
            self.stream.memcpy_dtoh(&d.slice(..len), &mut host).map_err(|e| fail("copying from the GPU", e))?;
        }
        self.traced("download", from)?;
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

    /// Measures copies (about a second): within the device memory, counting each byte
    /// read and written, and to it from page-locked and from pageable host memory, in
    /// bytes per second (the best of three runs of 256 MiB each way). Page-locked falls
    /// back to pageable where the host will not lock the buffer.
    pub fn copy_rates(&self) -> Result<CopyRates> {
        const LEN: usize = 256 << 20;
        let best = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
            f()?;
            self.sync()?;
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let t = Instant::now();
                f()?;
                self.sync()?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            Ok(best)
        };
        let from = self.alloc::<u8>(LEN)?;
        let mut to = self.alloc::<u8>(LEN)?;
        let within =
            best(&mut || self.stream.memcpy_dtod(&from, &mut to).map_err(|e| fail("copying within the GPU", e)))?;
        let mut host = vec![1u8; LEN];
        let mut to_device = |host: &[u8]| {
            best(&mut || self.stream.memcpy_htod(host, &mut to).map_err(|e| fail("copying to the GPU", e)))
        };
        let pageable = to_device(&host)?;
        let guard = sluice_experts::PageLocker::lock(&HostLocker { ctx: self.ctx.clone() }, host.as_mut_ptr(), LEN);
        let locked = match guard {
            Some(_) => to_device(&host)?,
            None => pageable,
        };
        drop(guard);
        let rate = |bytes: usize, s: f64| bytes as f64 / s;
        Ok(CopyRates { within: rate(2 * LEN, within), locked: rate(LEN, locked), pageable: rate(LEN, pageable) })
    }
}

/// Bytes per second of copies within a device and to it ([`Device::copy_rates`]).
#[derive(Clone, Copy, Debug)]
pub struct CopyRates {
    pub within: f64,
    pub locked: f64,
    pub pageable: f64,
}

/// Page-locks host memory for the device's copies from it (`cuMemHostRegister`): the
/// copy engine then reads it directly at the link's full rate, and a copy returns to
/// the host at once instead of after the driver's staging copy.
pub(crate) struct HostLocker {
    pub ctx: Arc<CudaContext>,
}

impl sluice_experts::PageLocker for HostLocker {
    fn lock(&self, ptr: *mut u8, len: usize) -> Option<Box<dyn Send + Sync>> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread().ok()?;
        // SAFETY: the caller keeps `len` bytes at `ptr` allocated until the guard
        // drops (PageLocker's contract).
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, 0) }.result().ok()?;
        Some(Box::new(Locked { ctx: self.ctx.clone(), ptr: ptr as usize }))
    }
}

/// A range [`HostLocker`] locked, unlocked when dropped.
struct Locked {
    ctx: Arc<CudaContext>,
    ptr: usize,
}

impl Drop for Locked {
    fn drop(&mut self) {
        // Copies from the range may still be queued: they finish before it is let go.
        if self.ctx.bind_to_thread().is_ok() && self.ctx.synchronize().is_ok() {
            // SAFETY: registered by HostLocker::lock at this address, once.
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
        }
    }
}

impl Drop for Device {
    /// The trace's table, longest first, on stderr (set only by a developer's
    /// `SLUICE_CUDA_TRACE`).
    fn drop(&mut self) {
        let Some((_, t)) = &self.trace else { return };
        let mut rows: Vec<(String, (u64, Duration))> = lock(t).drain().collect();
        rows.sort_by_key(|(_, (_, d))| std::cmp::Reverse(*d));
        let total: Duration = rows.iter().map(|(_, (_, d))| *d).sum();
        eprintln!("cuda trace: {:.1} ms in {} kinds of operation", total.as_secs_f64() * 1e3, rows.len());
        for (name, (n, d)) in rows {
            eprintln!(
                "  {name:<20} {n:>8} calls {:>10.2} ms {:>8.1} us/call",
                d.as_secs_f64() * 1e3,
                d.as_secs_f64() * 1e6 / n as f64
            );
        }
    }
}

/// Most bytes the pools keep; buffers given back beyond it are freed.
const POOLED_BYTES: usize = 512 << 20;

/// Free buffers of one element type, by length.
pub(crate) struct Pool<T> {
    free: HashMap<usize, Vec<CudaSlice<T>>>,
    bytes: usize,
}

impl<T> Default for Pool<T> {
    fn default() -> Self {
        Pool { free: HashMap::new(), bytes: 0 }
    }
}

impl<T> Pool<T> {
    fn take(&mut self, len: usize) -> Option<CudaSlice<T>> {
        let b = self.free.get_mut(&len)?.pop()?;
        self.bytes -= len * size_of::<T>();
        Some(b)
    }
}

#[derive(Default)]
pub(crate) struct Pools {
    f32: Mutex<Pool<f32>>,
    u32: Mutex<Pool<u32>>,
}

/// The element types intermediates are made of.
pub(crate) trait Pooled: DeviceRepr + Sized {
    fn pool(p: &Pools) -> &Mutex<Pool<Self>>;
}

impl Pooled for f32 {
    fn pool(p: &Pools) -> &Mutex<Pool<f32>> {
        &p.f32
    }
}

impl Pooled for u32 {
    fn pool(p: &Pools) -> &Mutex<Pool<u32>> {
        &p.u32
    }
}

/// A device buffer for an intermediate, given back to its pool when dropped. Reuse
/// is safe because every operation runs on the one stream: the next kernel writing
/// the buffer is queued after the last one reading it.
pub(crate) struct Scratch<T: Pooled> {
    buf: Option<CudaSlice<T>>,
    pools: Arc<Pools>,
}

impl<T: Pooled> std::ops::Deref for Scratch<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        self.buf.as_ref().expect("held until dropped")
    }
}

impl<T: Pooled> std::ops::DerefMut for Scratch<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        self.buf.as_mut().expect("held until dropped")
    }
}

impl<T: Pooled> Drop for Scratch<T> {
    fn drop(&mut self) {
        let Some(b) = self.buf.take() else { return };
        let mut pool = lock(T::pool(&self.pools));
        let bytes = b.len() * size_of::<T>();
        if pool.bytes + bytes <= POOLED_BYTES {
            pool.bytes += bytes;
            pool.free.entry(b.len()).or_default().push(b);
        }
    }
}

/// Calls and time by kernel or kind of call.
type TraceCounts = Mutex<HashMap<String, (u64, Duration)>>;

/// What `SLUICE_CUDA_TRACE` times: each call waited for, or only its time on the host.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Trace {
    Sync,
    Cpu,
}

/// A lock, whatever a panicking holder left (the maps stay consistent).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
        let from = std::time::Instant::now();
        let mut args: Vec<*mut std::ffi::c_void> = Vec::new();
        $crate::device::launch!(@push args; $($arg),*);
        // SAFETY: the arguments match the kernel's parameters in kernels.cu, and the
        // buffers they address outlive the launch (freeing is ordered by the stream).
        unsafe { dev.launch(&f, $cfg, &mut args) }.map_err(|e| $crate::device::fail(name, e))?;
        dev.traced(name, from)
    }};
    (@push $args:ident; ) => {};
    (@push $args:ident; $a:expr $(, $rest:expr)*) => {
        // Held in a local until the launch, which copies the value it points at.
        let v = $a;
        $args.push($crate::device::arg_ptr(&v));
        $crate::device::launch!(@push $args; $($rest),*);
    };
}
pub(crate) use launch;

/// A kernel argument's address as the driver takes it; only types laid out as a
/// kernel's parameters (`DeviceRepr`) qualify.
pub(crate) fn arg_ptr<T: DeviceRepr>(v: &T) -> *mut std::ffi::c_void {
    std::ptr::from_ref(v).cast_mut().cast()
}

/// A developer's choice among kernel variants under measurement
/// (`SLUICE_CUDA_VARIANT`, kernels.cu's `SLUICE_VARIANT`), read once.
pub(crate) fn variant() -> Option<u32> {
    static VARIANT: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *VARIANT.get_or_init(|| std::env::var("SLUICE_CUDA_VARIANT").ok().and_then(|v| v.parse().ok()))
}

/// The kernels' source: the one built in, or a developer's edit of it named by
/// `SLUICE_CUDA_SOURCE` (a kernel change timed on the GPU machine without a new build;
/// the cache keys on the text). An unreadable file is reported and the built-in
/// source taken.
fn source() -> &'static str {
    static EDIT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let edit = EDIT.get_or_init(|| {
        let path = std::env::var_os("SLUICE_CUDA_SOURCE")?;
        std::fs::read_to_string(&path)
            .inspect_err(|e| {
                eprintln!("SLUICE_CUDA_SOURCE {}: {e}; the built-in kernels taken", path.to_string_lossy())
            })
            .ok()
    });
    edit.as_deref().unwrap_or(SOURCE)
}

/// Whether kernel `name` begins with kernels.cu's `grid_entry` (and so may be
/// started while the one before it runs): all but the products of prompt and batch
/// rows (`mm_`, `mmg_`, `mmq_`, `mmgq_`, `mmt_`, `mmgt_`), where the wait cost more
/// than it gave, and a prompt's attention (`attention_tile`), launched likewise.
fn waits_at_entry(name: &str) -> bool {
    !["mm_", "mmg_", "mmq_", "mmgq_", "mmt_", "mmgt_", "attention_tile"].iter().any(|p| name.starts_with(p))
}

/// The dynamic shared memory kernel `name` takes where it is more than the 48 KiB a
/// kernel may take without asking.
fn wide_shared(name: &str) -> Option<u32> {
    (name == "attention_tile").then_some(crate::backend::ATTENTION_TILE_SHARED)
}

/// Kernel names by weight format.
pub(crate) fn format_suffix(d: DType) -> &'static str {
    use DType::*;
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

/// The kernels of unit `unit`.
pub(crate) fn kernel_names(unit: Unit) -> Vec<String> {
    let d = match unit {
        Unit::Format(d) => {
            // The integer and tensor-core products exist for the K-quants only (kernels.cu).
            let integer: &[&str] =
                if matches!(d, DType::Q4K | DType::Q5K | DType::Q6K) { &["mmq", "mmgq", "mmt", "mmgt"] } else { &[] };
            return ["mm", "mmo", "mmg", "mmgo", "mmglu", "embed"]
                .iter()
                .chain(integer)
                .map(|k| format!("{k}_{}", format_suffix(d)))
                .collect();
        }
        Unit::Common => [
            "add",
            "mul",
            "scale",
            "mul_row",
            "add_row",
            "scale_rows",
            "activate",
            "softcap",
            "glu",
            "gather_rows",
            "scatter_rows",
            "columns",
            "copy_columns",
            "combine",
            "add_expert_bias",
            "rms_norm",
            "norm_rope",
            "rope",
            "kv_write_layers",
            "attention_128",
            "attention_256",
            "attention_576",
            "attention_merge",
            "attention_tile",
            "delta_conv",
            "delta_rule",
            "route_top_k",
            "plan_experts",
            "route_plan",
            "quantize_act",
        ],
    };
    d.map(String::from).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each kernel's name in kernels.cu (a format kernel's by its prefix, `mmg_`) and
    /// whether its body begins with `grid_entry();`.
    fn kernels_in_source() -> Vec<(String, bool)> {
        let mut found = Vec::new();
        let mut rest = SOURCE;
        while let Some(at) = rest.find("extern \"C\" __global__ void ") {
            rest = &rest[at + "extern \"C\" __global__ void ".len()..];
            // A launch-bounds macro (DECODE_BOUNDS) before the name.
            if let Some((_, r)) = rest.split_once(' ').filter(|(m, _)| m.ends_with("_BOUNDS")) {
                rest = r;
            }
            let name: String = match rest.strip_prefix("CAT(") {
                Some(r) => r.split(',').next().unwrap_or_default().to_string(),
                None => rest.split('(').next().unwrap_or_default().to_string(),
            };
            let body = &rest[rest.find('{').expect("a kernel has a body") + 1..];
            let first = body.trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
            found.push((name, first.starts_with("grid_entry();")));
        }
        found
    }

    #[test]
    fn kernels_wait_at_entry_exactly_where_they_are_launched_early() {
        let found = kernels_in_source();
        assert!(found.len() > 30, "read {} kernels from kernels.cu", found.len());
        for (name, waits) in &found {
            // A kernel launched early that does not wait would read its inputs before
            // the kernel that writes them has ended.
            assert_eq!(waits_at_entry(name), *waits, "kernel {name}: waits at its entry: {waits}");
        }
        let batch: Vec<&str> = found.iter().filter(|(_, w)| !w).map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            batch,
            ["mmg_", "mm_", "mmgq_", "mmq_", "mmgt_", "mmt_", "attention_tile"],
            "the kernels launched after the one before ends"
        );
    }
}
