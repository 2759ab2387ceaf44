//! Registering memory that already exists with CUDA (`cuMemHostRegister`), so the GPU copies
//! straight out of it: a file mapping in the page cache, a shared-memory segment, a slice.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};
use gpufeed_os::{FileMap, MapMode, ShmSegment};

use crate::driver::raw;
use crate::error::{Error, Result};

/// Largest piece registered in one `cuMemHostRegister` call.
pub const MAX_REGISTER_CHUNK: usize = 64 << 30;

/// A range of host memory registered with CUDA; unregistered when dropped. It borrows what it
/// registered, so the memory cannot be unmapped or freed while registered.
///
/// Registering 1 GiB of resident memory took 40 ms on the project's GPU machine, ten times
/// less than allocating pinned memory, and a registered read-only file mapping in the page
/// cache is the cheapest warm path to the GPU per CPU thread (no copy on the host at all).
pub struct HostRegistration<'a> {
    ptr: *const u8,
    len: usize,
    chunks: Vec<(usize, usize)>,
    read_only: bool,
    ctx: Arc<CudaContext>,
    _memory: PhantomData<&'a [u8]>,
}

// SAFETY: the registration holds addresses and a context handle; the registered memory is
// borrowed for 'a and only read through raw pointers by the copy engine.
unsafe impl Send for HostRegistration<'_> {}
// SAFETY: as above.
unsafe impl Sync for HostRegistration<'_> {}

impl std::fmt::Debug for HostRegistration<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("chunks", &self.chunks.len())
            .field("read_only", &self.read_only)
            .finish()
    }
}

impl<'a> HostRegistration<'a> {
    /// Registers a read-only file mapping (`CU_MEMHOSTREGISTER_READ_ONLY`): the GPU reads the
    /// page cache directly.
    ///
    /// # Errors
    /// [`Error::NotReadOnly`] for a writable mapping; [`Error::AlreadyRegistered`];
    /// [`Error::Cuda`].
    pub fn file_map(ctx: &Arc<CudaContext>, map: &'a FileMap) -> Result<Self> {
        if map.mode() != MapMode::ReadOnly {
            return Err(Error::NotReadOnly);
        }
        // SAFETY: the mapping lives for 'a (borrowed), and read-only memory is registered
        // read-only.
        unsafe { Self::register(ctx, map.as_ptr(), map.len(), true) }
    }

    /// Registers a shared-memory segment (read-write, so the GPU can also copy into it).
    pub fn shm(ctx: &Arc<CudaContext>, segment: &'a ShmSegment) -> Result<Self> {
        // SAFETY: the segment's mapping lives for 'a (borrowed).
        unsafe { Self::register(ctx, segment.as_ptr(), segment.len(), false) }
    }

    /// Registers a slice read-only, for copies to the device.
    pub fn slice(ctx: &Arc<CudaContext>, data: &'a [u8]) -> Result<Self> {
        // SAFETY: the slice lives for 'a (borrowed); registered read-only.
        unsafe { Self::register(ctx, data.as_ptr(), data.len(), true) }
    }

    /// Registers `[ptr, ptr + len)` (widened to whole pages) in chunks of at most
    /// [`MAX_REGISTER_CHUNK`].
    ///
    /// # Safety
    /// 1. The range stays mapped until the registration is dropped.
    /// 2. With `read_only`, nothing copies from the device into the range.
    pub unsafe fn register(
        ctx: &Arc<CudaContext>,
        ptr: *const u8,
        len: usize,
        read_only: bool,
    ) -> Result<Self> {
        crate::driver_available()?;
        if len == 0 {
            return Err(gpufeed_os::Error::ZeroLength {
                what: "HostRegistration",
            }
            .into());
        }
        ctx.bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let page = gpufeed_os::page_size();
        let start = ptr as usize / page * page;
        let end = (ptr as usize + len).next_multiple_of(page);
        // Ask the driver whether the range is page-locked already.
        if raw::host_is_locked(start as *mut _) {
            return Err(Error::AlreadyRegistered {
                ptr: start,
                len: end - start,
            });
        }
        let bits = sys::CU_MEMHOSTREGISTER_PORTABLE
            | if read_only {
                sys::CU_MEMHOSTREGISTER_READ_ONLY
            } else {
                0
            };
        let mut reg = HostRegistration {
            ptr,
            len,
            chunks: Vec::new(),
            read_only,
            ctx: Arc::clone(ctx),
            _memory: PhantomData,
        };
        let mut at = start;
        while at < end {
            let n = (end - at).min(MAX_REGISTER_CHUNK);
            // SAFETY: the caller keeps [start, end) mapped while registered; on error the
            // chunks registered so far are unregistered by `reg`'s drop.
            unsafe { raw::host_register(at as *mut _, n, bits) }?;
            reg.chunks.push((at, n));
            at += n;
        }
        Ok(reg)
    }

    /// The first byte registered (as given, not page-aligned).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Bytes registered (as given).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether registered `READ_ONLY`.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The context it is registered with.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for &(ptr, _) in &self.chunks {
            // SAFETY: registered by us; the copies reading it were waited for by their owners.
            if let Err(e) = unsafe { raw::host_unregister(ptr as *mut _) } {
                tracing::warn!("{e}");
            }
        }
    }
}
