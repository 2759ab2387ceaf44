//! The driver calls the scheduler makes itself, as thin `unsafe fn`s that return a `Result`
//! naming the call (cudarc's result-layer style): no other module of this crate calls
//! `sys::cu*` functions.

use cudarc::driver::sys;

use crate::error::{Error, Result};

/// `cuMemcpyHtoDAsync`: enqueues a copy of `len` bytes from host `src` to device `dst` on
/// `stream`.
///
/// # Safety
/// `[src, src + len)` is readable and `[dst, dst + len)` is device memory of `stream`'s
/// context; both stay valid, and the host bytes unchanged, until the copy has completed on
/// `stream` (the caller waits for it, or records an event it waits on before reuse).
pub(crate) unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const u8,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's promise above.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream) }
        .result()
        .map_err(|e| Error::cuda("cuMemcpyHtoDAsync", e))
}

/// `cuMemcpyDtoHAsync`: enqueues a copy of `len` bytes from device `src` to host `dst` on
/// `stream`.
///
/// # Safety
/// `[dst, dst + len)` is writable and nothing else reads or writes it, and `[src, src + len)`
/// is device memory of `stream`'s context, until the copy has completed on `stream`.
pub(crate) unsafe fn memcpy_dtoh_async(
    dst: *mut u8,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's promise above.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, stream) }
        .result()
        .map_err(|e| Error::cuda("cuMemcpyDtoHAsync", e))
}

/// `cuCtxEnablePeerAccess` from the current context to `peer`; "already enabled" is success.
///
/// # Safety
/// A context is current on this thread and `peer` is a live context.
pub(crate) unsafe fn ctx_enable_peer_access(peer: sys::CUcontext) -> Result<()> {
    // SAFETY: the caller's promise above.
    let r = unsafe { sys::cuCtxEnablePeerAccess(peer, 0) };
    match r {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(())
        }
        other => Err(Error::cuda(
            "cuCtxEnablePeerAccess",
            other.result().unwrap_err(),
        )),
    }
}

/// `cuDeviceCanAccessPeer`.
///
/// # Safety
/// `dev` and `peer` came from `cuDeviceGet`.
pub(crate) unsafe fn device_can_access_peer(
    dev: sys::CUdevice,
    peer: sys::CUdevice,
) -> Result<bool> {
    let mut can = 0;
    // SAFETY: the caller's promise above; the call writes one integer.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, peer) }
        .result()
        .map_err(|e| Error::cuda("cuDeviceCanAccessPeer", e))?;
    Ok(can != 0)
}

/// `cuDeviceGetP2PAttribute` from `src` to `dst`.
///
/// # Safety
/// `src` and `dst` came from `cuDeviceGet`.
pub(crate) unsafe fn device_p2p_attribute(
    attr: sys::CUdevice_P2PAttribute,
    src: sys::CUdevice,
    dst: sys::CUdevice,
) -> Result<i32> {
    let mut v = 0;
    // SAFETY: the caller's promise above; the call writes one integer.
    unsafe { sys::cuDeviceGetP2PAttribute(&mut v, attr, src, dst) }
        .result()
        .map_err(|e| Error::cuda("cuDeviceGetP2PAttribute", e))?;
    Ok(v)
}

/// `cuMemcpyPeerAsync`: enqueues a copy of `len` bytes from `src` (memory of `src_ctx`) to `dst`
/// (memory of `dst_ctx`) on `stream`.
///
/// # Safety
/// Both ranges are device memory of their contexts and stay allocated, the source unchanged
/// and the destination touched by nothing else, until the copy has completed on `stream`.
pub(crate) unsafe fn memcpy_peer_async(
    dst: sys::CUdeviceptr,
    dst_ctx: sys::CUcontext,
    src: sys::CUdeviceptr,
    src_ctx: sys::CUcontext,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's promise above.
    unsafe { sys::cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, len, stream) }
        .result()
        .map_err(|e| Error::cuda("cuMemcpyPeerAsync", e))
}

/// `cuMemcpyDtoDAsync` in the current context (unified addressing: either side may be memory
/// of another GPU mapped here).
///
/// # Safety
/// As [`memcpy_peer_async`], both ranges mapped in the current context.
pub(crate) unsafe fn memcpy_dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's promise above.
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream) }
        .result()
        .map_err(|e| Error::cuda("cuMemcpyDtoDAsync", e))
}

/// `cuIpcGetMemHandle` of the allocation starting at `ptr`.
///
/// # Safety
/// `ptr` is the start of a live `cuMemAlloc` allocation of the current context.
pub(crate) unsafe fn ipc_get_mem_handle(ptr: sys::CUdeviceptr) -> Result<[u8; 64]> {
    let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: the caller's promise; the call writes the 64-byte handle.
    unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) }
        .result()
        .map_err(|e| Error::cuda("cuIpcGetMemHandle", e))?;
    Ok(handle.reserved.map(|c| c as u8))
}

/// `cuIpcOpenMemHandle` (peer access enabled lazily) in the current context.
///
/// # Safety
/// A context is current on this thread.
pub(crate) unsafe fn ipc_open_mem_handle(handle: [u8; 64]) -> Result<sys::CUdeviceptr> {
    let handle = sys::CUipcMemHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut ptr = 0;
    // SAFETY: the caller's promise; the call writes one pointer.
    unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            handle,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    }
    .result()
    .map_err(|e| Error::cuda("cuIpcOpenMemHandle", e))?;
    Ok(ptr)
}

/// `cuIpcCloseMemHandle`.
///
/// # Safety
/// `ptr` came from [`ipc_open_mem_handle`] in the current context and is closed once, after
/// every use.
pub(crate) unsafe fn ipc_close_mem_handle(ptr: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: the caller's promise above.
    unsafe { sys::cuIpcCloseMemHandle(ptr) }
        .result()
        .map_err(|e| Error::cuda("cuIpcCloseMemHandle", e))
}

/// Lets device `accessor` read and write memory of device `owner`'s current memory pool (the
/// stream-ordered allocator's), as `cuCtxEnablePeerAccess` does for `cuMemAlloc` memory.
///
/// # Safety
/// Both came from `cuDeviceGet`.
pub(crate) unsafe fn mem_pool_grant_access(
    owner: sys::CUdevice,
    accessor: sys::CUdevice,
) -> Result<()> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the caller's promise; the call writes one handle.
    unsafe { sys::cuDeviceGetMemPool(&mut pool, owner) }
        .result()
        .map_err(|e| Error::cuda("cuDeviceGetMemPool", e))?;
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: accessor,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: `pool` came from the driver; one descriptor is passed.
    unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) }
        .result()
        .map_err(|e| Error::cuda("cuMemPoolSetAccess", e))
}
