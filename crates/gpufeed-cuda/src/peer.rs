//! Several GPUs: which can reach which (peer access, the link between them), peer access
//! enabled between two contexts, and a device buffer cut into disjoint parts that different
//! threads (or GPUs' copies) fill at once.

use cudarc::driver::{CudaSlice, CudaViewMut, sys};

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

    /// Lets this GPU's context read and write `peer`'s memory directly (`cuCtxEnablePeerAccess`),
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

/// Copies from one GPU's memory into other GPUs' (a replicated load's shares), each
/// destination GPU on a stream of its own so that the copies run while the caller goes on;
/// [`PeerCopies::wait`] waits for all of them. With peer access enabled
/// ([`Gpu::enable_peer_access`]) they go straight over the link between the GPUs.
#[derive(Debug)]
pub struct PeerCopies {
    streams: Vec<std::sync::Arc<cudarc::driver::CudaStream>>,
}

impl PeerCopies {
    /// A stream on each of `to`, in order.
    ///
    /// # Errors
    /// [`Error::Cuda`] when a stream cannot be made.
    pub fn new<'g>(to: impl IntoIterator<Item = &'g Gpu>) -> Result<Self> {
        driver()?;
        let streams = to
            .into_iter()
            .map(|g| {
                g.context()
                    .new_stream()
                    .map_err(|e| Error::cuda("cuStreamCreate", e))
            })
            .collect::<Result<_>>()?;
        Ok(PeerCopies { streams })
    }

    /// Enqueues a copy of `src` (device memory of any GPU, complete on its own stream) into
    /// `dst` on the `i`-th destination GPU, after the work already enqueued on `src`'s stream.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for lengths that differ or an `i` past the destinations;
    /// [`Error::Cuda`].
    pub fn copy(
        &self,
        i: usize,
        src: &cudarc::driver::CudaView<'_, u8>,
        dst: &mut CudaViewMut<'_, u8>,
    ) -> Result<()> {
        let stream = self.streams.get(i);
        let (Some(stream), true) = (stream, src.len() == dst.len()) else {
            return Err(Error::OutOfBounds {
                len: src.len() as u64,
                offset: 0,
                capacity: dst.len() as u64,
            });
        };
        stream
            .memcpy_dtod(src, dst)
            .map_err(|e| Error::cuda("cuMemcpyPeerAsync", e))
    }

    /// Waits until every copy enqueued so far has completed.
    pub fn wait(&self) -> Result<()> {
        for s in &self.streams {
            s.synchronize()
                .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        }
        Ok(())
    }
}
