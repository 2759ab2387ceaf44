//! CUDA devices: enumeration, facts, and an open device.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, result, sys};

use crate::error::{Error, Result, driver};

/// What is known about one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Product name.
    pub name: String,
    /// Device memory in bytes.
    pub memory_bytes: u64,
    /// PCI bus id in sysfs form (`0000:3b:00.0`).
    pub pci_bus_id: String,
    /// The NUMA node it is attached to, where known (gpufeed-numa).
    pub numa_node: Option<u32>,
    /// PCIe generation of the current link (from /sys), where readable.
    pub pcie_gen: Option<u32>,
    /// PCIe lanes of the current link (from /sys), where readable.
    pub pcie_width: Option<u32>,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
}

fn attr(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32> {
    // SAFETY: `dev` came from cuDeviceGet; the call writes one integer.
    unsafe { result::device::get_attribute(dev, a) }
        .map_err(|e| Error::cuda("cuDeviceGetAttribute", e))
}

/// Reads the facts of device `ordinal` without creating a context.
fn info(ordinal: usize, topology: Option<&gpufeed_numa::Topology>) -> Result<GpuInfo> {
    use sys::CUdevice_attribute as A;
    let dev = result::device::get(ordinal as i32).map_err(|e| Error::cuda("cuDeviceGet", e))?;
    let name = result::device::get_name(dev).map_err(|e| Error::cuda("cuDeviceGetName", e))?;
    // SAFETY: as for attr.
    let memory_bytes = unsafe { result::device::total_mem(dev) }
        .map_err(|e| Error::cuda("cuDeviceTotalMem", e))? as u64;
    let pci_bus_id = format!(
        "{:04x}:{:02x}:{:02x}.0",
        attr(dev, A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
        attr(dev, A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
        attr(dev, A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
    );
    let numa_node = topology.and_then(|t| t.node_of_pci(&pci_bus_id).ok().flatten());
    let sys_dir = format!("/sys/bus/pci/devices/{pci_bus_id}");
    let read = |f: &str| std::fs::read_to_string(format!("{sys_dir}/{f}")).ok();
    let pcie_gen = read("current_link_speed").and_then(|s| link_gen(&s));
    let pcie_width = read("current_link_width").and_then(|s| s.trim().parse().ok());
    Ok(GpuInfo {
        ordinal,
        name,
        memory_bytes,
        pci_bus_id,
        numa_node,
        pcie_gen,
        pcie_width,
        compute_capability: (
            attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
    })
}

/// `32.0 GT/s PCIe` -> 5.
pub(crate) fn link_gen(text: &str) -> Option<u32> {
    let gts: f64 = text.split_whitespace().next()?.parse().ok()?;
    Some(match gts {
        x if x < 3.0 => 1,
        x if x < 6.0 => 2,
        x if x < 10.0 => 3,
        x if x < 20.0 => 4,
        x if x < 40.0 => 5,
        x if x < 80.0 => 6,
        _ => 7,
    })
}

/// An open GPU: its context (cudarc's primary context) and facts.
///
/// # Example
/// ```
/// match gpufeed_cuda::Gpu::open(0) {
///     Ok(gpu) => println!("{} on NUMA node {:?}", gpu.info().name, gpu.info().numa_node),
///     Err(e) if e.is_no_gpu() => println!("no GPU here: {e}"),
///     Err(e) => return Err(e),
/// }
/// # Ok::<(), gpufeed_cuda::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    info: GpuInfo,
    /// Buffers let go and kept for reuse ([`Gpu::keep_for_reuse`]), the device's.
    pub(crate) kept: Arc<crate::kept::Kept>,
}

/// Where new device memory comes from ([`Gpu::alloc_filled`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DeviceAlloc {
    /// The context's stream-ordered pool ([`Gpu::alloc`]): memory freed earlier is reused at
    /// no cost; growing the pool is paid by the allocation.
    #[default]
    Pool,
    /// `cuMemAlloc` ([`Gpu::alloc_unpooled`]): cheap to get, freed synchronously, never
    /// reused: for memory that lives long (weights loaded once).
    Unpooled,
}

impl Gpu {
    /// The number of CUDA devices; [`Error::NoCudaDriver`] without a driver.
    pub fn count() -> Result<usize> {
        driver()?;
        result::init().map_err(|e| Error::cuda("cuInit", e))?;
        result::device::get_count()
            .map(|n| n as usize)
            .map_err(|e| Error::cuda("cuDeviceGetCount", e))
    }

    /// Every GPU with its facts (no context is created).
    pub fn list() -> Result<Vec<GpuInfo>> {
        let count = Self::count()?;
        let topology = gpufeed_numa::Topology::detect().ok();
        (0..count).map(|i| info(i, topology.as_ref())).collect()
    }

    /// Runs `f`, then makes the calling thread's current CUDA context what it was before
    /// (none, or another GPU's): [`ContextGuard`] around `f`.
    ///
    /// # Example
    /// ```no_run
    /// let gpu = gpufeed_cuda::Gpu::keeping_current_context(|| gpufeed_cuda::Gpu::open(1))?;
    /// # Ok::<(), gpufeed_cuda::Error>(())
    /// ```
    pub fn keeping_current_context<R>(f: impl FnOnce() -> R) -> R {
        let _guard = ContextGuard::new();
        f()
    }

    /// Opens GPU `ordinal`.
    ///
    /// # Errors
    /// [`Error::NoCudaDriver`], [`Error::NoDevice`], [`Error::Cuda`].
    pub fn open(ordinal: usize) -> Result<Self> {
        let count = Self::count()?;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let topology = gpufeed_numa::Topology::detect().ok();
        let info = info(ordinal, topology.as_ref())?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| Error::cuda("cuDevicePrimaryCtxRetain", e))?;
        Ok(Gpu {
            ctx,
            info,
            kept: crate::kept::for_device(ordinal),
        })
    }

    /// Its facts.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// Its CUDA context (cudarc), for cudarc and candle users.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The GPU's UUID (`cuDeviceGetUuid`), as cuFile's and NVML's statistics name it.
    ///
    /// # Errors
    /// [`Error::Cuda`] where the driver does not answer.
    pub fn uuid(&self) -> Result<[u8; 16]> {
        let id = cudarc::driver::result::device::get_uuid(self.ctx.cu_device())
            .map_err(|e| Error::cuda("cuDeviceGetUuid", e))?;
        Ok(id.bytes.map(|b| b as u8))
    }

    /// The context's default stream.
    pub fn default_stream(&self) -> Arc<CudaStream> {
        self.ctx.default_stream()
    }

    /// `len` bytes of device memory, zeroed (where the device is full, memory kept by
    /// [`Gpu::keep_for_reuse`] is given back and the allocation tried again).
    pub fn alloc_zeroed(&self, len: usize) -> Result<CudaSlice<u8>> {
        self.retrying_when_full(|| self.default_stream().alloc_zeros::<u8>(len))
    }

    /// `len` bytes of device memory, zeroed, allocated and zeroed in `stream`'s order (a
    /// stream of this GPU's context): for work that must not wait for, or hold up, the legacy
    /// default stream that [`Gpu::alloc_zeroed`] uses (torch's default stream is that one).
    /// Where the device is full, memory kept by [`Gpu::keep_for_reuse`] is given back and the
    /// allocation tried again.
    pub fn alloc_zeroed_on(&self, stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<u8>> {
        self.retrying_when_full(|| stream.alloc_zeros::<u8>(len))
    }

    /// `len` bytes of device memory, not initialised, from the context's stream-ordered pool
    /// (cudarc's allocator): memory freed earlier is reused at no cost, but growing the pool is
    /// paid here (8-12 ms for 4 GiB, 37-52 ms for 16 GiB on the H200 machine; docs/benchmarks.md,
    /// GPU run 8). Where the device is full, memory kept by [`Gpu::keep_for_reuse`] is given
    /// back and the allocation tried again.
    ///
    /// # Safety
    /// 1. Nothing reads the memory before it has been written (an upload fills it).
    pub unsafe fn alloc(&self, len: usize) -> Result<CudaSlice<u8>> {
        // SAFETY: passed on to the caller.
        self.retrying_when_full(|| unsafe { self.default_stream().alloc::<u8>(len) })
    }

    /// `len` bytes of device memory, not initialised, from `cuMemAlloc` rather than the pool:
    /// cheap to get (about 1 ms for 4 GiB on the H200 machine, against 8-12 ms to grow the pool)
    /// but freed synchronously when dropped, and never reused by the pool. For memory that
    /// lives long (weights loaded once at start-up); [`Gpu::alloc`] for memory freed and
    /// allocated again. The buffer is an ordinary cudarc `CudaSlice` (its stream-ordered free
    /// accepts `cuMemAlloc` memory). A buffer of exactly `len` bytes kept by
    /// [`Gpu::keep_for_reuse`] is handed out first; where the device is full, kept memory is
    /// given back and the allocation tried again.
    ///
    /// # Safety
    /// 1. Nothing reads the memory before it has been written (an upload fills it).
    pub unsafe fn alloc_unpooled(&self, len: usize) -> Result<CudaSlice<u8>> {
        if len == 0 {
            // SAFETY: an empty allocation has nothing to read.
            return unsafe { self.alloc(0) };
        }
        self.check_events()?;
        if let Some(kept) = self.kept.take(len) {
            return Ok(kept);
        }
        // SAFETY: a plain allocation; the caller's obligation covers its contents.
        let ptr = self.retrying_when_full(|| unsafe { result::malloc_sync(len) })?;
        // SAFETY: `ptr` is a live allocation of `len` bytes of this context, owned from here on
        // by the slice, whose drop frees it (stream-ordered, after its recorded uses).
        Ok(unsafe { self.default_stream().upgrade_device_ptr::<u8>(ptr, len) })
    }

    /// Waits for the work queued on `stream` so far with the thread asleep: an event made
    /// with `CU_EVENT_BLOCKING_SYNC` is recorded and waited for. `cuStreamSynchronize` in the
    /// primary context's default scheduling (`CU_CTX_SCHED_AUTO`, which spins while the
    /// process has fewer contexts than cores) keeps a core busy for the whole wait; threads
    /// that wait on long GPU work (the image decoders: tens of milliseconds a batch) sleep
    /// through it this way, at the cost of a wake-up (microseconds).
    ///
    /// # Errors
    /// The event's creation, record or wait (the stream's work failed, ...).
    pub fn wait_asleep(&self, stream: &CudaStream) -> Result<()> {
        let event = stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        event
            .synchronize()
            .map_err(|e| Error::cuda("cuEventSynchronize", e))
    }

    /// Binds the context to this thread and makes an event: cudarc's `upgrade_device_ptr`
    /// creates two events and unwraps their creation, so a context unable to make events must
    /// be found first (an error, not a panic).
    pub(crate) fn check_events(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        drop(
            self.ctx
                .new_event(None)
                .map_err(|e| Error::cuda("cuEventCreate", e))?,
        );
        Ok(())
    }

    /// New device memory of `len` bytes from `from`, filled by `fill` before it is returned:
    /// the safe way to get device memory without paying for zeroing it first. `fill` gets the
    /// uninitialised memory and must write every byte (uploads, a load into it); what it
    /// returns comes back beside the memory, and when it returns an error the memory is freed
    /// unread. A `fill` that leaves bytes unwritten is a
    /// bug but not undefined behaviour (every bit pattern is a valid `u8`): those bytes hold
    /// whatever the memory held before.
    ///
    /// # Example
    /// ```no_run
    /// use gpufeed_cuda::{DeviceAlloc, Gpu, HostSource, TransferOptions, TransferScheduler};
    /// let gpu = Gpu::open(0)?;
    /// let sched = TransferScheduler::new(&gpu, TransferOptions::default())?;
    /// let data = vec![7u8; 1 << 20];
    /// let (dev, stats) = gpu.alloc_filled(data.len(), DeviceAlloc::Pool, |dst| {
    ///     sched.upload(HostSource::Pageable(&data), dst, 0)
    /// })?;
    /// println!("{:.1} GB/s", stats.gbps());
    /// assert_eq!(gpu.to_vec(&dev)?, data);
    /// # Ok::<(), gpufeed_cuda::Error>(())
    /// ```
    pub fn alloc_filled<T, E: From<Error>>(
        &self,
        len: usize,
        from: DeviceAlloc,
        fill: impl FnOnce(&mut CudaSlice<u8>) -> std::result::Result<T, E>,
    ) -> std::result::Result<(CudaSlice<u8>, T), E> {
        // SAFETY: handed to `fill`, which writes it (see above; u8 has no invalid values), and
        // dropped unread when `fill` fails.
        let mut dst = unsafe { self.alloc_from(len, from)? };
        let filled = fill(&mut dst)?;
        Ok((dst, filled))
    }

    /// [`Gpu::alloc_filled`] on several GPUs at once: `len` bytes on each of `gpus` (in
    /// order), all handed to `fill` together (a replicated load fills each GPU's copy from the
    /// others' over their peer links), freed unread when it fails.
    pub fn alloc_filled_each<T, E: From<Error>>(
        gpus: &[Gpu],
        len: usize,
        from: DeviceAlloc,
        fill: impl FnOnce(&mut [CudaSlice<u8>]) -> std::result::Result<T, E>,
    ) -> std::result::Result<(Vec<CudaSlice<u8>>, T), E> {
        let mut dsts = Vec::with_capacity(gpus.len());
        for gpu in gpus {
            // SAFETY: as in `alloc_filled`: written by `fill` or dropped unread.
            dsts.push(unsafe { gpu.alloc_from(len, from)? });
        }
        let filled = fill(&mut dsts)?;
        Ok((dsts, filled))
    }

    /// `len` bytes from `from`, not initialised (an empty slice for 0).
    ///
    /// # Safety
    /// As [`Gpu::alloc`].
    unsafe fn alloc_from(&self, len: usize, from: DeviceAlloc) -> Result<CudaSlice<u8>> {
        if len == 0 {
            return self
                .default_stream()
                .null::<u8>()
                .map_err(|e| Error::cuda("cuMemAlloc", e));
        }
        // SAFETY: passed on to the caller.
        unsafe {
            match from {
                DeviceAlloc::Pool => self.alloc(len),
                DeviceAlloc::Unpooled => self.alloc_unpooled(len),
            }
        }
    }

    /// Copies device memory back into a new `Vec` (synchronously; for checks and small data).
    pub fn to_vec(&self, src: &CudaSlice<u8>) -> Result<Vec<u8>> {
        self.default_stream()
            .clone_dtoh(src)
            .map_err(|e| Error::cuda("cuMemcpyDtoH", e))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pcie_link_generations() {
        assert_eq!(super::link_gen("32.0 GT/s PCIe\n"), Some(5));
        assert_eq!(super::link_gen("16.0 GT/s PCIe"), Some(4));
        assert_eq!(super::link_gen("8.0 GT/s PCIe"), Some(3));
        assert_eq!(super::link_gen("2.5 GT/s"), Some(1));
        assert_eq!(super::link_gen("Unknown"), None);
    }
}

/// Puts the calling thread's current CUDA context back as it was when the guard was made
/// (none, or another GPU's) when it is dropped. gpufeed binds a GPU's context to the thread
/// that works on it; a caller sharing the thread with a framework that tracks "the current
/// device" through that context (PyTorch's `torch.cuda.current_device()`) holds a guard over
/// its calls, so that a load onto GPU 1 does not switch the framework to GPU 1.
#[derive(Debug)]
pub struct ContextGuard {
    /// The context current before (`Some(None)`: none); `None` without a driver.
    before: Option<Option<sys::CUcontext>>,
}

impl ContextGuard {
    /// Notes the thread's current context (nothing without a CUDA driver).
    pub fn new() -> Self {
        let before = match driver() {
            Ok(()) => result::ctx::get_current().ok(),
            Err(_) => None,
        };
        ContextGuard { before }
    }
}

// SAFETY: a CUcontext is a handle the driver accepts on any thread; the guard only compares
// it and makes it current again (on the thread that drops the guard, which its users keep to
// the thread that made it: a guard lives within one call).
unsafe impl Send for ContextGuard {}
// SAFETY: as above; a shared guard gives no access to the handle.
unsafe impl Sync for ContextGuard {}

impl Default for ContextGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        let Some(before) = self.before else {
            return;
        };
        if result::ctx::get_current().ok().flatten() == before {
            return;
        }
        let ctx = before.unwrap_or(std::ptr::null_mut());
        // SAFETY: `ctx` was the thread's current context when the guard was made (a primary
        // context stays alive while whoever made it current holds it), or null, which unbinds
        // the thread.
        if let Err(e) = unsafe { result::ctx::set_current(ctx) } {
            tracing::warn!("restoring the thread's CUDA context failed: {e}");
        }
    }
}
