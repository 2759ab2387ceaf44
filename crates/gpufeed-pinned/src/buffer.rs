//! Page-locked host memory from the CUDA driver (`cuMemHostAlloc`).

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};

use crate::driver::raw;
use crate::error::{Error, Result};

/// Flags of a [`PinnedBuffer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedFlags {
    /// `CU_MEMHOSTALLOC_PORTABLE`: usable by every CUDA context (default on).
    pub portable: bool,
    /// `CU_MEMHOSTALLOC_DEVICEMAP`: also mapped into the device address space.
    pub device_map: bool,
    /// `CU_MEMHOSTALLOC_WRITECOMBINED`: faster host-to-device transfers on some systems, but
    /// the CPU reads it very slowly: only for buffers the CPU writes and never reads.
    pub write_combined: bool,
}

impl Default for PinnedFlags {
    fn default() -> Self {
        PinnedFlags {
            portable: true,
            device_map: false,
            write_combined: false,
        }
    }
}

impl PinnedFlags {
    fn bits(self) -> u32 {
        (if self.portable {
            sys::CU_MEMHOSTALLOC_PORTABLE
        } else {
            0
        }) | (if self.device_map {
            sys::CU_MEMHOSTALLOC_DEVICEMAP
        } else {
            0
        }) | (if self.write_combined {
            sys::CU_MEMHOSTALLOC_WRITECOMBINED
        } else {
            0
        })
    }
}

/// Page-locked host memory allocated by the CUDA driver: the fastest source and destination of
/// host/device copies (about 10x pageable memory). Allocation is expensive (`cuMemHostAlloc`
/// of 1 GiB took 443 ms on the project's GPU machine): get buffers from a
/// [`crate::PinnedPool`] rather than allocating per transfer. The contents start zeroed.
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    flags: PinnedFlags,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer owns its allocation exclusively, like a Box<[u8]>; the context handle is
// Send + Sync.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access is only through `&[u8]`.
unsafe impl Sync for PinnedBuffer {}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .field("flags", &self.flags)
            .field("device", &self.ctx.ordinal())
            .finish()
    }
}

impl PinnedBuffer {
    /// `len` bytes of portable pinned memory.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        Self::with_flags(ctx, len, PinnedFlags::default())
    }

    /// `len` bytes with explicit flags.
    ///
    /// # Errors
    /// [`Error::NoCudaDriver`], [`Error::Cuda`] (e.g. `CUDA_ERROR_OUT_OF_MEMORY` when the
    /// platform caps page-locked memory).
    pub fn with_flags(ctx: &Arc<CudaContext>, len: usize, flags: PinnedFlags) -> Result<Self> {
        crate::driver_available()?;
        if len == 0 {
            return Err(gpufeed_os::Error::ZeroLength {
                what: "PinnedBuffer",
            }
            .into());
        }
        ctx.bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: zeroed below before any use; freed once, by drop.
        let raw = unsafe { raw::host_alloc(len, flags.bits()) }?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or(Error::NullAllocation {
            op: "cuMemHostAlloc",
        })?;
        // SAFETY: the driver returned len writable bytes; zeroing makes every byte initialised
        // (the driver does not promise fresh pages).
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedBuffer {
            ptr,
            len,
            flags,
            ctx: Arc::clone(ctx),
        })
    }

    /// The number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The first byte, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The flags it was allocated with.
    pub fn flags(&self) -> PinnedFlags {
        self.flags
    }

    /// The CUDA context it belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl std::ops::Deref for PinnedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: len initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, exclusive through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc; no borrow outlives self. Copies that read it
        // were waited for by whoever enqueued them (the pool and scheduler keep the event).
        if let Err(e) = unsafe { raw::host_free(self.ptr.as_ptr().cast()) } {
            tracing::warn!("{e}");
        }
    }
}
