//! Several GPUs: which can reach which (peer access, the link between them), peer access
//! enabled between two contexts, and a device buffer cut into disjoint parts that different
//! threads (or GPUs' copies) fill at once.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaViewMut, DeviceSlice, sys};

use crate::error::{Error, Result, driver};
use crate::gpu::Gpu;
use crate::raw;

/// What links GPU `from` to GPU `to`, as the driver reports it (no context is created).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PeerLink {
    /// The GPU that reads or writes.
    pub from: usize,
    /// The GPU whose memory it reaches.
    pub to: usize,
    /// Whether `from` can map `to`'s memory (`cuDeviceCanAccessPeer`): peer copies then go
    /// straight over the link, not through host memory.
    pub access: bool,
    /// The driver's relative performance rank of the link (`CU_DEVICE_P2P_ATTRIBUTE_
    /// PERFORMANCE_RANK`, 0 best); `None` where the driver does not say.
    pub performance_rank: Option<i32>,
    /// Whether atomics work natively across the link: true over NVLink, false over PCIe on
    /// the machines we know; the [`PeerLink::kind`] is read from it.
    pub native_atomics: bool,
}

impl PeerLink {
    /// `"nvlink"` where peer atomics are native (an NVLink or NVSwitch fabric), `"pcie"` where
    /// peers reach each other without them, `"none"` without peer access (copies go through
    /// host memory). Read from the driver's attributes, not measured.
    pub fn kind(&self) -> &'static str {
        match (self.access, self.native_atomics) {
            (false, _) => "none",
            (true, true) => "nvlink",
            (true, false) => "pcie",
        }
    }
}

impl Gpu {
    /// The link from every GPU to every other (ordered pairs), without creating a context;
    /// empty with one GPU. [`Error::NoCudaDriver`] without a driver.
    ///
    /// # Example
    /// ```no_run
    /// for l in gpufeed_cuda::Gpu::peer_links()? {
    ///     println!("GPU {} -> GPU {}: {} (peer access {})", l.from, l.to, l.kind(), l.access);
    /// }
    /// # Ok::<(), gpufeed_cuda::Error>(())
    /// ```
    pub fn peer_links() -> Result<Vec<PeerLink>> {
        let count = Self::count()?;
        let mut links = Vec::new();
        for from in 0..count {
            for to in (0..count).filter(|&to| to != from) {
                links.push(link(from, to)?);
            }
        }
        Ok(links)
    }

    /// Lets this GPU's context read and write `peer`'s memory directly (`cuCtxEnablePeerAccess`,
    /// and `cuMemPoolSetAccess` on `peer`'s stream-ordered pool for its pooled memory),
    /// so that copies between them ([`cudarc::driver::CudaStream::memcpy_dtod`] across the two
    /// contexts) go over the link between them. Returns `false`, changing nothing, where the
    /// two cannot be peers (copies between them then go through host memory, slower but
    /// correct) or `peer` is this GPU; enabling twice is not an error.
    ///
    /// # Errors
    /// [`Error::Cuda`] for a refusal other than "already enabled".
    pub fn enable_peer_access(&self, peer: &Gpu) -> Result<bool> {
        driver()?;
        let (me, other) = (self.info().ordinal, peer.info().ordinal);
        if me == other || !link(me, other)?.access {
            return Ok(false);
        }
        self.context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: both contexts are alive (held by the two `Gpu`s) and this one is current.
        unsafe { raw::ctx_enable_peer_access(peer.context().cu_ctx()) }?;
        // The same for the peer's stream-ordered pool, whose memory peer access to the context
        // does not cover: without it copies from or into pool memory go through the host
        // (28 GB/s instead of NVLink's hundreds on two H200s; docs/benchmarks.md, GPU run 44).
        // SAFETY: both devices came from cuDeviceGet (the contexts' devices).
        unsafe {
            raw::mem_pool_grant_access(peer.context().cu_device(), self.context().cu_device())
        }?;
        Ok(true)
    }
}

/// The link from device `from` to device `to`.
fn link(from: usize, to: usize) -> Result<PeerLink> {
    use sys::CUdevice_P2PAttribute as P;
    let dev = |o: usize| {
        cudarc::driver::result::device::get(o as i32).map_err(|e| Error::cuda("cuDeviceGet", e))
    };
    let (a, b) = (dev(from)?, dev(to)?);
    // SAFETY: `a` and `b` came from cuDeviceGet; each call writes one integer.
    let access = unsafe { raw::device_can_access_peer(a, b) }?;
    let attr = |p| {
        // SAFETY: as above.
        unsafe { raw::device_p2p_attribute(p, a, b) }
    };
    Ok(PeerLink {
        from,
        to,
        access,
        performance_rank: attr(P::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK).ok(),
        native_atomics: attr(P::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)
            .is_ok_and(|v| v != 0),
    })
}

/// Cuts `slice` into disjoint mutable views at `bounds` (ascending offsets inside it): parts
/// `[0, b0)`, `[b0, b1)`, ..., `[bn, len)`, which threads may fill at once (each part is
/// `Send`). `None` where `bounds` is not ascending or passes the end.
///
/// # Example
/// ```no_run
/// let gpu = gpufeed_cuda::Gpu::open(0)?;
/// let mut buf = gpu.alloc_zeroed(100)?;
/// let parts = gpufeed_cuda::split_mut(&mut buf, &[30, 60]).expect("ascending, inside");
/// assert_eq!(parts.iter().map(|p| p.len()).collect::<Vec<_>>(), [30, 30, 40]);
/// # Ok::<(), gpufeed_cuda::Error>(())
/// ```
pub fn split_mut<'a>(
    slice: &'a mut CudaSlice<u8>,
    bounds: &[usize],
) -> Option<Vec<CudaViewMut<'a, u8>>> {
    if bounds.windows(2).any(|w| w[0] > w[1]) || bounds.last().is_some_and(|&b| b > slice.len()) {
        return None;
    }
    let mut parts = Vec::with_capacity(bounds.len() + 1);
    let mut rest = slice.try_slice_mut(..)?;
    let mut at = 0;
    for &b in bounds {
        let (head, tail) = rest.try_split_at_mut(b - at)?;
        // SAFETY: a view's references (the slice's events and stream) point into `slice`,
        // borrowed mutably for 'a, not into the view split; the two halves are disjoint
        // ranges of it. Lengthening the halves' lifetime from the borrow of `rest` to 'a thus
        // keeps every reference valid and no byte reachable through two views.
        let (head, tail) = unsafe {
            (
                std::mem::transmute::<CudaViewMut<'_, u8>, CudaViewMut<'a, u8>>(head),
                std::mem::transmute::<CudaViewMut<'_, u8>, CudaViewMut<'a, u8>>(tail),
            )
        };
        parts.push(head);
        rest = tail;
        at = b;
    }
    parts.push(rest);
    Some(parts)
}

/// One GPU's share of a buffer replicated on several GPUs: its own part (`own`, on its GPU),
/// filled by the caller piece by piece, and the same part of every other GPU's copy, which
/// [`PeerFanout::send`] fills from `own` over the peer links while the caller goes on. The other
/// copies are views of this process's buffers on other GPUs ([`PeerFanout::new`]) or another
/// process's buffers opened through CUDA IPC ([`PeerFanout::to_ipc`]). Each destination has a
/// stream of its own; the copies carry no cudarc event of the buffers, so that they neither
/// wait for nor hold up other work on other parts of the same buffers (the peers' own loads).
/// It holds every destination until the copies have completed: [`PeerFanout::finish`] waits
/// for them, and so does dropping it.
pub struct PeerFanout<'a> {
    own: CudaViewMut<'a, u8>,
    peers: Vec<Dest<'a>>,
    streams: Vec<std::sync::Arc<cudarc::driver::CudaStream>>,
}

/// Where a fanout's copies go.
enum Dest<'a> {
    /// A view of a buffer on another GPU of this process.
    View(CudaViewMut<'a, u8>),
    /// Bytes from `offset` of another process's buffer, opened here.
    Ipc { mem: &'a IpcMemory, offset: usize },
}

impl std::fmt::Debug for PeerFanout<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerFanout")
            .field("len", &self.own.len())
            .field("peers", &self.peers.len())
            .finish()
    }
}

impl<'a> PeerFanout<'a> {
    /// `own` and the same-sized `peers` (views of other GPUs' buffers in this process).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for a peer of another length; [`Error::Cuda`] when a stream
    /// cannot be made.
    pub fn new(own: CudaViewMut<'a, u8>, peers: Vec<CudaViewMut<'a, u8>>) -> Result<Self> {
        driver()?;
        if let Some(p) = peers.iter().find(|p| p.len() != own.len()) {
            return Err(Error::OutOfBounds {
                len: own.len() as u64,
                offset: 0,
                capacity: p.len() as u64,
            });
        }
        let streams = peers
            .iter()
            .map(|p| new_stream(p.stream().context()))
            .collect::<Result<_>>()?;
        Ok(PeerFanout {
            own,
            peers: peers.into_iter().map(Dest::View).collect(),
            streams,
        })
    }

    /// `own` and, for each other process, its buffer opened here and where in it the same
    /// part lies (another process's copy of the same replicated buffer).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] where a part would pass the end of a peer's buffer;
    /// [`Error::Cuda`] when a stream cannot be made.
    pub fn to_ipc(own: CudaViewMut<'a, u8>, peers: Vec<(&'a IpcMemory, usize)>) -> Result<Self> {
        driver()?;
        if let Some((mem, offset)) = peers.iter().find(|(mem, offset)| {
            offset
                .checked_add(own.len())
                .is_none_or(|end| end > mem.len())
        }) {
            return Err(Error::OutOfBounds {
                len: own.len() as u64,
                offset: *offset as u64,
                capacity: mem.len() as u64,
            });
        }
        let ctx = std::sync::Arc::clone(own.stream().context());
        let streams = peers
            .iter()
            .map(|_| new_stream(&ctx))
            .collect::<Result<_>>()?;
        Ok(PeerFanout {
            own,
            peers: peers
                .into_iter()
                .map(|(mem, offset)| Dest::Ipc { mem, offset })
                .collect(),
            streams,
        })
    }

    /// The caller's part of its own GPU's buffer, `range` of it, to fill (a load into it).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for a range outside it.
    pub fn own_mut(&mut self, range: std::ops::Range<usize>) -> Result<CudaViewMut<'_, u8>> {
        part_mut(&mut self.own, range)
    }

    /// Enqueues copies of `range` of the own part into the same range of every peer, after
    /// the work already enqueued on the own part's stream (which every upload of the
    /// scheduler has completed when it returns).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for a range outside the part; [`Error::Cuda`].
    pub fn send(&mut self, range: std::ops::Range<usize>) -> Result<()> {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        if range.start > range.end || range.end > self.own.len() {
            return Err(Error::OutOfBounds {
                len: range.end.saturating_sub(range.start) as u64,
                offset: range.start as u64,
                capacity: self.own.len() as u64,
            });
        }
        let len = range.end - range.start;
        if len == 0 {
            return Ok(());
        }
        let own_stream = std::sync::Arc::clone(self.own.stream());
        let ready = own_stream
            .record_event(None)
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        // Raw pointers: the guards would record the copies in the buffers' shared events,
        // which the peers' own loads into other parts then wait for (and the copies for them).
        let (src, guard) = self.own.device_ptr(&own_stream);
        std::mem::forget(guard);
        let src = src + range.start as u64;
        let src_ctx = own_stream.context().cu_ctx();
        for (peer, stream) in self.peers.iter_mut().zip(&self.streams) {
            stream
                .wait(&ready)
                .map_err(|e| Error::cuda("cuStreamWaitEvent", e))?;
            match peer {
                Dest::View(view) => {
                    let peer_stream = std::sync::Arc::clone(view.stream());
                    let (dst, guard) = view.device_ptr_mut(&peer_stream);
                    std::mem::forget(guard);
                    // SAFETY: both ranges lie inside live device memory (the views, held by
                    // `self` until `finish` or drop has waited for these streams); the
                    // destination range is written by nothing else (the peers' parts belong to
                    // this fanout), and the source was complete when `ready` was recorded,
                    // which the stream waits for.
                    unsafe {
                        raw::memcpy_peer_async(
                            dst + range.start as u64,
                            peer_stream.context().cu_ctx(),
                            src,
                            src_ctx,
                            len,
                            stream.cu_stream(),
                        )
                    }?;
                }
                Dest::Ipc { mem, offset } => {
                    own_stream
                        .context()
                        .bind_to_thread()
                        .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
                    // SAFETY: the destination lies inside the peer's buffer, mapped here until
                    // `mem` is dropped, which outlives this fanout (its borrow), whose drop
                    // waits for the copy; the part is this process's to write (the ranks'
                    // parts are disjoint); the source as above.
                    unsafe {
                        raw::memcpy_dtod_async(
                            mem.ptr + (*offset + range.start) as u64,
                            src,
                            len,
                            stream.cu_stream(),
                        )
                    }?;
                }
            }
        }
        Ok(())
    }

    /// Waits until every copy sent has completed.
    ///
    /// # Errors
    /// [`Error::Cuda`]: a copy failed.
    pub fn finish(self) -> Result<()> {
        self.wait()
    }

    fn wait(&self) -> Result<()> {
        for s in &self.streams {
            s.synchronize()
                .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        }
        Ok(())
    }
}

/// Copies out of other processes' memory ([`IpcMemory`]) into one buffer of this process, on a
/// stream per source, over the peer links: the gathering side of a replicated load whose
/// parts each process reads into memory the others mapped. It holds the buffer and the
/// sources until every copy has completed ([`PeerGather::wait`], or its drop, waits).
/// Whether a source's bytes are the ones meant when a copy runs is the caller's ordering
/// (copies are enqueued at once and run later).
///
/// # Example
/// ```no_run
/// # fn f(dst: &mut gpufeed_cuda::cudarc::driver::CudaSlice<u8>, peer: &gpufeed_cuda::IpcMemory)
/// # -> gpufeed_cuda::Result<()> {
/// let mut gather = gpufeed_cuda::PeerGather::new(dst.as_view_mut(), vec![peer])?;
/// gather.copy(0, 0, 0, 1 << 20)?; // the first MiB of the peer's memory to the start of `dst`
/// gather.wait()?;
/// # Ok(()) }
/// ```
pub struct PeerGather<'a> {
    dst: CudaViewMut<'a, u8>,
    sources: Vec<&'a IpcMemory>,
    streams: Vec<std::sync::Arc<cudarc::driver::CudaStream>>,
}

impl std::fmt::Debug for PeerGather<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerGather")
            .field("len", &self.dst.len())
            .field("sources", &self.sources.len())
            .finish()
    }
}

impl<'a> PeerGather<'a> {
    /// Gathers into `dst` from `sources` (each opened for `dst`'s GPU). Waits for the work
    /// already enqueued on `dst`'s stream (its allocation) first.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn new(dst: CudaViewMut<'a, u8>, sources: Vec<&'a IpcMemory>) -> Result<Self> {
        driver()?;
        let stream = std::sync::Arc::clone(dst.stream());
        stream
            .synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        let streams = sources
            .iter()
            .map(|_| new_stream(stream.context()))
            .collect::<Result<_>>()?;
        Ok(PeerGather {
            dst,
            sources,
            streams,
        })
    }

    /// `range` of the buffer, to fill otherwise (a load, a local copy) while copies into other
    /// parts run.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for a range outside it.
    pub fn dst_mut(&mut self, range: std::ops::Range<usize>) -> Result<CudaViewMut<'_, u8>> {
        part_mut(&mut self.dst, range)
    }

    /// Enqueues a copy of `len` bytes from `from` of source `source` to `at` of the buffer, on
    /// that source's stream.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for a source that is not one, or a range past either end;
    /// [`Error::Cuda`].
    pub fn copy(&mut self, source: usize, from: usize, at: usize, len: usize) -> Result<()> {
        use cudarc::driver::DevicePtrMut;
        let out = |offset: usize, capacity: usize| Error::OutOfBounds {
            len: len as u64,
            offset: offset as u64,
            capacity: capacity as u64,
        };
        let (Some(src), Some(stream)) = (self.sources.get(source), self.streams.get(source)) else {
            return Err(out(source, self.sources.len()));
        };
        if from.checked_add(len).is_none_or(|end| end > src.len()) {
            return Err(out(from, src.len()));
        }
        if at.checked_add(len).is_none_or(|end| end > self.dst.len()) {
            return Err(out(at, self.dst.len()));
        }
        if len == 0 {
            return Ok(());
        }
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // A raw pointer: the guard would record the copy in the buffer's shared events, which
        // the fills of its other parts would then wait for.
        let dst_stream = std::sync::Arc::clone(self.dst.stream());
        let (to, guard) = self.dst.device_ptr_mut(&dst_stream);
        std::mem::forget(guard);
        // SAFETY: both ranges lie inside their memory (checked above), the source mapped and
        // the destination borrowed by `self` until `wait` or the drop has seen this copy
        // complete; `dst_mut` hands out parts of the buffer only through `&mut self`, and the
        // caller copies each part once (a part filled twice at once is a bug of its order, not
        // memory safety: both are bytes).
        unsafe {
            raw::memcpy_dtod_async(
                to + at as u64,
                src.ptr + from as u64,
                len,
                stream.cu_stream(),
            )
        }
    }

    /// Waits until every copy enqueued has completed.
    ///
    /// # Errors
    /// [`Error::Cuda`]: a copy failed.
    pub fn wait(&self) -> Result<()> {
        for s in &self.streams {
            s.synchronize()
                .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        }
        Ok(())
    }
}

impl Drop for PeerGather<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            tracing::warn!("waiting for copies out of other processes' memory failed: {e}");
        }
    }
}

/// [`Error::TooLargeToShare`] for an allocation of `len` bytes over [`SHARED_MAP_MAX_BYTES`].
fn check_shareable(len: usize) -> Result<()> {
    match len > SHARED_MAP_MAX_BYTES {
        true => Err(Error::TooLargeToShare {
            len: len as u64,
            max: SHARED_MAP_MAX_BYTES as u64,
        }),
        false => Ok(()),
    }
}

/// `range` of `view`, or [`Error::OutOfBounds`].
pub(crate) fn part_mut<'b>(
    view: &'b mut CudaViewMut<'_, u8>,
    range: std::ops::Range<usize>,
) -> Result<CudaViewMut<'b, u8>> {
    let len = view.len();
    let (start, end) = (range.start, range.end);
    view.try_slice_mut(range).ok_or(Error::OutOfBounds {
        len: end.saturating_sub(start) as u64,
        offset: start as u64,
        capacity: len as u64,
    })
}

fn new_stream(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
) -> Result<std::sync::Arc<cudarc::driver::CudaStream>> {
    ctx.new_stream()
        .map_err(|e| Error::cuda("cuStreamCreate", e))
}

/// A handle to device memory that another process can open ([`IpcMemory::open`]):
/// `cuIpcGetMemHandle`, 64 bytes to pass along (through gpufeed-ipc's `Rendezvous`, a pipe).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

impl IpcHandle {
    /// The handle of `buf`, which must come from `cuMemAlloc` ([`Gpu::alloc_unpooled`]; the
    /// stream-ordered pool's memory cannot be shared this way).
    ///
    /// # Errors
    /// [`Error::Cuda`]: pool memory, or a driver that refuses IPC.
    pub fn of(buf: &CudaSlice<u8>) -> Result<Self> {
        use cudarc::driver::DevicePtr;
        driver()?;
        buf.stream()
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let (ptr, guard) = buf.device_ptr(buf.stream());
        std::mem::forget(guard);
        // SAFETY: `ptr` is the start of a live allocation of the current context.
        unsafe { raw::ipc_get_mem_handle(ptr) }.map(IpcHandle)
    }
}

/// Another process's device memory opened in this process (`cuIpcOpenMemHandle`, peer access
/// enabled lazily; or imported from a [`SharedPool`] of it, [`IpcMemory::import`]), closed
/// when dropped. The other process must keep the memory allocated
/// until this process has closed it and every copy into it has completed.
#[derive(Debug)]
pub struct IpcMemory {
    gpu: Gpu,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// The pool it was imported from ([`IpcMemory::import`]); `None`: opened from a handle.
    pool: Option<Arc<ImportedPool>>,
}

impl IpcMemory {
    /// Opens `handle` (memory of `len` bytes, as its owner says) in `gpu`'s context.
    ///
    /// # Errors
    /// [`Error::Cuda`]: a handle of this process, of a GPU this one cannot reach, or of
    /// memory already freed.
    pub fn open(gpu: &Gpu, handle: IpcHandle, len: usize) -> Result<Self> {
        driver()?;
        gpu.context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: the handle is 64 bytes as the driver made them; the driver checks it.
        let ptr = unsafe { raw::ipc_open_mem_handle(handle.0) }?;
        Ok(IpcMemory {
            gpu: gpu.clone(),
            ptr,
            len,
            pool: None,
        })
    }

    /// Maps allocation `shared` (of `len` bytes, as its owner says) of another process's
    /// [`SharedPool`], imported here as `pool` (`cuMemPoolImportPointer`); unmapped
    /// (`cuMemFree`) when dropped.
    ///
    /// # Errors
    /// [`Error::TooLargeToShare`] for a `len` over [`SHARED_MAP_MAX_BYTES`]; [`Error::Cuda`]:
    /// data of another pool, or of memory already freed.
    pub fn import(pool: &Arc<ImportedPool>, shared: SharedPointer, len: usize) -> Result<Self> {
        check_shareable(len)?;
        pool.gpu
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: the pool was imported in this process and lives (held below); the driver
        // checks the export data.
        let ptr = unsafe { raw::mem_pool_import_pointer(pool.pool.0, shared.0) }?;
        Ok(IpcMemory {
            gpu: pool.gpu.clone(),
            ptr,
            len,
            pool: Some(Arc::clone(pool)),
        })
    }

    /// Its length, as its owner said.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for IpcMemory {
    fn drop(&mut self) {
        if self.gpu.context().bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle or cuMemPoolImportPointer in this
            // context (as `pool` says) and is closed once; the copies into it have completed
            // (a fanout borrowing it waits for them when it ends).
            let closed = unsafe {
                match self.pool {
                    None => raw::ipc_close_mem_handle(self.ptr),
                    Some(_) => raw::mem_free(self.ptr),
                }
            };
            if let Err(e) = closed {
                tracing::warn!("closing another process's GPU memory failed: {e}");
            }
        }
    }
}

/// The largest [`SharedPool`] allocation another process maps (4 GiB): on the H200 machine's
/// driver a process that maps (`cuMemPoolImportPointer`) another process's pool allocation of
/// more than 4 GiB dies of a segmentation fault inside the driver (GPU runs 85-88: 6, 8 and 16
/// GiB; 4 GiB and less map and copy byte-exact), which no error check can catch. So
/// [`SharedPool::share`] and [`IpcMemory::import`] refuse larger ones
/// ([`Error::TooLargeToShare`]).
pub const SHARED_MAP_MAX_BYTES: usize = 4 << 30;

/// A memory pool handle of the driver's (a pointer), used from any thread.
#[derive(Debug)]
struct PoolHandle(sys::CUmemoryPool);

// SAFETY: a CUmemoryPool is a handle the driver accepts from any thread.
unsafe impl Send for PoolHandle {}
// SAFETY: as above; every call through it is a driver call, which the driver serializes.
unsafe impl Sync for PoolHandle {}

/// Device memory that other processes can map: a memory pool of one GPU made shareable
/// (`cuMemPoolCreate` with POSIX file descriptor handles). Another process imports the pool
/// once ([`SharedPool::export`], passed as a file descriptor; [`ImportedPool::import`]) and
/// then each allocation by 64 bytes of data ([`SharedPool::share`], [`IpcMemory::import`]).
/// Memory freed (its buffer dropped) goes back to the pool and is reused by the next
/// allocation; the pool keeps it from the device until the pool is dropped (`cuMemPoolTrimTo`
/// gave nothing back on the H200 machine, GPU runs 85-88). Allocations of more than
/// [`SHARED_MAP_MAX_BYTES`] cannot be shared.
///
/// # Example
/// ```no_run
/// use gpufeed_cuda::{Gpu, HostSource, SharedPool, TransferOptions, TransferScheduler};
/// let gpu = Gpu::open(0)?;
/// let sched = TransferScheduler::new(&gpu, TransferOptions::default())?;
/// let pool = SharedPool::new(&gpu)?;
/// let data = vec![7u8; 1 << 20];
/// let (buf, _) = pool.alloc_filled(data.len(), |dst| {
///     sched.upload(HostSource::Pageable(&data), dst, 0)
/// })?;
/// let fd = pool.export()?; // pass it once (gpufeed_ipc::Rendezvous::share_fd)
/// let data = pool.share(&buf)?; // pass these 64 bytes per allocation
/// # let _ = (fd, data);
/// # Ok::<(), gpufeed_cuda::Error>(())
/// ```
#[derive(Debug)]
pub struct SharedPool {
    gpu: Gpu,
    pool: PoolHandle,
}

/// The 64 bytes another process maps one allocation of a [`SharedPool`] with
/// (`cuMemPoolExportPointer`; [`IpcMemory::import`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedPointer(pub [u8; 64]);

impl SharedPool {
    /// A shareable pool of `gpu`'s memory.
    ///
    /// # Errors
    /// [`Error::Cuda`] with `CUDA_ERROR_NOT_SUPPORTED` where the driver or device cannot share
    /// pools through file descriptors (no stream-ordered allocator, or another handle type
    /// only); other driver errors.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        use cudarc::driver::{DriverError, result};
        driver()?;
        let ctx = gpu.context();
        ctx.bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let unsupported =
            |op| Error::cuda(op, DriverError(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED));
        if !ctx.has_async_alloc() {
            return Err(unsupported("cuMemAllocFromPoolAsync"));
        }
        // SAFETY: the device came from the driver; the call reads one attribute.
        let types = unsafe {
            result::device::get_attribute(
                ctx.cu_device(),
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES,
            )
        }
        .map_err(|e| Error::cuda("cuDeviceGetAttribute", e))?;
        let fd_type =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0 as i32;
        if types & fd_type == 0 {
            return Err(unsupported("cuMemPoolCreate with file descriptor handles"));
        }
        // SAFETY: the device came from the driver.
        let pool = unsafe { raw::mem_pool_create_shareable(ctx.cu_device()) }?;
        Ok(SharedPool {
            gpu: gpu.clone(),
            pool: PoolHandle(pool),
        })
    }

    /// Its GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// A new file descriptor of the pool, for another process to import
    /// ([`ImportedPool::import`]); pass it over a Unix socket.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn export(&self) -> Result<OwnedFd> {
        // SAFETY: the pool lives and was made with file descriptor handles.
        unsafe { raw::mem_pool_export_fd(self.pool.0) }
    }

    /// New memory of `len` bytes from the pool, filled by `fill` before it is returned, as
    /// [`Gpu::alloc_filled`] does. The allocation has completed when `fill` starts, so other
    /// processes may map it ([`SharedPool::share`]) at once. Dropping the buffer gives the
    /// memory back to the pool (stream-ordered, on the GPU's default stream).
    ///
    /// # Errors
    /// [`Error::Cuda`] (out of memory); `fill`'s.
    pub fn alloc_filled<T, E: From<Error>>(
        &self,
        len: usize,
        fill: impl FnOnce(&mut CudaSlice<u8>) -> std::result::Result<T, E>,
    ) -> std::result::Result<(CudaSlice<u8>, T), E> {
        let mut dst = self.alloc(len)?;
        let filled = fill(&mut dst)?;
        Ok((dst, filled))
    }

    /// `len` zeroed bytes of the pool (for memory the caller and other processes fill in turn:
    /// a staging area). The zeroing has completed when this returns.
    ///
    /// # Errors
    /// [`Error::Cuda`] (out of memory).
    pub fn alloc_zeroed(&self, len: usize) -> Result<CudaSlice<u8>> {
        let stream = self.gpu.default_stream();
        self.alloc_filled(len, |dst| {
            stream
                .memset_zeros(dst)
                .and_then(|()| stream.synchronize())
                .map_err(|e| Error::cuda("cuMemsetD8", e))
        })
        .map(|(buf, ())| buf)
    }

    /// `len` bytes of the pool, not initialised; only [`SharedPool::alloc_filled`] hands them
    /// out (written before anything reads them).
    fn alloc(&self, len: usize) -> Result<CudaSlice<u8>> {
        let stream = self.gpu.default_stream();
        if len == 0 {
            return stream
                .null::<u8>()
                .map_err(|e| Error::cuda("cuMemAlloc", e));
        }
        self.gpu.check_events()?;
        // SAFETY: the pool is of this context's device (bound by `check_events`); the memory
        // is not read before `fill` has written it.
        let ptr = unsafe { raw::mem_alloc_from_pool(len, self.pool.0, stream.cu_stream()) }?;
        // SAFETY: a live allocation of `len` bytes of this context, owned from here on by the
        // slice, whose drop frees it on `stream` (back into the pool).
        let slice = unsafe { stream.upgrade_device_ptr::<u8>(ptr, len) };
        stream
            .synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        Ok(slice)
    }

    /// The data another process maps `buf` with ([`IpcMemory::import`]), `buf` being memory
    /// of this pool ([`SharedPool::alloc_filled`]). The other process must unmap it (drop its
    /// [`IpcMemory`]) before `buf` is dropped here.
    ///
    /// # Errors
    /// [`Error::TooLargeToShare`] for more than [`SHARED_MAP_MAX_BYTES`]; [`Error::Cuda`]:
    /// memory of another pool.
    pub fn share(&self, buf: &CudaSlice<u8>) -> Result<SharedPointer> {
        use cudarc::driver::DevicePtr;
        check_shareable(buf.len())?;
        let (ptr, guard) = buf.device_ptr(buf.stream());
        std::mem::forget(guard);
        // SAFETY: `ptr` starts a live allocation; the driver refuses memory of other pools.
        unsafe { raw::mem_pool_export_pointer(ptr) }.map(SharedPointer)
    }
}

impl Drop for SharedPool {
    fn drop(&mut self) {
        // Memory still allocated from it stays valid; the driver releases the pool after it.
        // SAFETY: the pool lives and is destroyed once.
        if let Err(e) = unsafe { raw::mem_pool_destroy(self.pool.0) } {
            tracing::warn!("destroying a shared memory pool failed: {e}");
        }
    }
}

/// Another process's [`SharedPool`], imported into this one for GPU `gpu` (which may be the
/// pool's GPU or a peer of it: access is granted on import). Its allocations are mapped with
/// [`IpcMemory::import`].
#[derive(Debug)]
pub struct ImportedPool {
    gpu: Gpu,
    pool: PoolHandle,
}

impl ImportedPool {
    /// Imports the pool exported as `fd` ([`SharedPool::export`]; the descriptor stays the
    /// caller's) for `gpu`'s use.
    ///
    /// # Errors
    /// [`Error::Cuda`]: not a pool's descriptor, or a pool `gpu` cannot reach.
    pub fn import(gpu: &Gpu, fd: BorrowedFd<'_>) -> Result<Self> {
        driver()?;
        let ctx = gpu.context();
        ctx.bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: a context is current; the driver checks the descriptor.
        let pool = PoolHandle(unsafe { raw::mem_pool_import_fd(fd) }?);
        // SAFETY: the pool was just imported; the device came from the driver.
        unsafe {
            if !raw::mem_pool_can_write(pool.0, ctx.cu_device())? {
                raw::mem_pool_set_access(pool.0, ctx.cu_device())?;
            }
        }
        Ok(ImportedPool {
            gpu: gpu.clone(),
            pool,
        })
    }
}

impl Drop for ImportedPool {
    fn drop(&mut self) {
        // SAFETY: the pool was imported here and is released once; its mappings hold an `Arc`
        // of it, so none is left.
        if let Err(e) = unsafe { raw::mem_pool_destroy(self.pool.0) } {
            tracing::warn!("releasing an imported memory pool failed: {e}");
        }
    }
}

impl Drop for PeerFanout<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            tracing::warn!("waiting for peer copies failed: {e}");
        }
    }
}
