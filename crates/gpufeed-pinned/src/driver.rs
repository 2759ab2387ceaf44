//! Whether the CUDA driver can be used at all. cudarc panics on its first call when libcuda is
//! missing, so every entry point asks here first.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// `Ok` when libcuda can be loaded; [`Error::NoCudaDriver`] otherwise. Cached after the first
/// call. Never panics.
pub fn driver_available() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the library by its known names.
    let present = *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() });
    if present {
        Ok(())
    } else {
        Err(Error::NoCudaDriver)
    }
}

/// The raw driver calls of this crate, as thin `unsafe fn`s that return a `Result` naming the
/// call (cudarc's result-layer style): no other module calls `sys::cu*` functions. Each needs
/// the right context current on the calling thread.
pub(crate) mod raw {
    use std::ffi::c_void;

    use cudarc::driver::sys;

    use crate::error::{Error, Result};

    /// `cuMemHostAlloc`: `len` bytes of page-locked memory with `flags`.
    ///
    /// # Safety
    /// The memory is uninitialised; it must be freed with [`host_free`] once.
    pub(crate) unsafe fn host_alloc(len: usize, flags: u32) -> Result<*mut c_void> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: a plain allocation call; `raw` receives the pointer.
        unsafe { sys::cuMemHostAlloc(&mut raw, len, flags) }
            .result()
            .map_err(|e| Error::cuda("cuMemHostAlloc", e))?;
        Ok(raw)
    }

    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// `ptr` came from [`host_alloc`], is freed once, and no copy still reads or writes it.
    pub(crate) unsafe fn host_free(ptr: *mut c_void) -> Result<()> {
        // SAFETY: the caller's promise above.
        unsafe { sys::cuMemFreeHost(ptr) }
            .result()
            .map_err(|e| Error::cuda("cuMemFreeHost", e))
    }

    /// `cuMemHostGetFlags`: whether the page at `ptr` is page-locked with CUDA already
    /// (allocated pinned or registered). A query: never changes anything.
    pub(crate) fn host_is_locked(ptr: *mut c_void) -> bool {
        let mut flags = 0u32;
        // SAFETY: a query of the driver's records; it only writes `flags`.
        let result = unsafe { sys::cuMemHostGetFlags(&mut flags, ptr) };
        result == sys::CUresult::CUDA_SUCCESS
    }

    /// `cuMemHostRegister`: page-locks `[ptr, ptr + len)` with `flags`
    /// (`CU_MEMHOSTREGISTER_*`).
    ///
    /// # Safety
    /// The range is mapped (readable, and writable unless registered read-only) until
    /// [`host_unregister`] of `ptr`.
    pub(crate) unsafe fn host_register(ptr: *mut c_void, len: usize, flags: u32) -> Result<()> {
        // SAFETY: the caller's promise above.
        unsafe { sys::cuMemHostRegister_v2(ptr, len, flags) }
            .result()
            .map_err(|e| Error::cuda("cuMemHostRegister", e))
    }

    /// `cuMemHostUnregister`.
    ///
    /// # Safety
    /// `ptr` starts a range registered by [`host_register`], unregistered once, and no copy
    /// still reads or writes it.
    pub(crate) unsafe fn host_unregister(ptr: *mut c_void) -> Result<()> {
        // SAFETY: the caller's promise above.
        unsafe { sys::cuMemHostUnregister(ptr) }
            .result()
            .map_err(|e| Error::cuda("cuMemHostUnregister", e))
    }
}
