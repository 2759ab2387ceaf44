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

/// `cuMemcpy2DAsync` between device memory: `height` rows of `width` bytes, `src_pitch` bytes
/// apart at `src` and `dst_pitch` apart at `dst`.
///
/// # Safety
/// Every row of both sides is device memory of the current context, the destination's written
/// by nothing else until the stream's work queued now has run.
#[allow(clippy::too_many_arguments, reason = "a pitched copy's fields")]
pub(crate) unsafe fn memcpy_2d_dtod_async(
    dst: sys::CUdeviceptr,
    dst_pitch: usize,
    src: sys::CUdeviceptr,
    src_pitch: usize,
    width: usize,
    height: usize,
    stream: sys::CUstream,
) -> Result<()> {
    let params = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: height,
    };
    // SAFETY: the caller's promise above; `params` lives over the call, which reads it then.
    unsafe { sys::cuMemcpy2DAsync_v2(&params, stream) }
        .result()
        .map_err(|e| Error::cuda("cuMemcpy2DAsync", e))
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
    // SAFETY: `pool` came from the driver; `accessor` from the caller.
    unsafe { mem_pool_set_access(pool, accessor) }
}

fn device_location(device: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    }
}

/// `cuMemPoolSetAccess`: device `accessor` may read and write `pool`'s memory.
///
/// # Safety
/// `pool` is a live pool (made or imported here); `accessor` came from `cuDeviceGet`.
pub(crate) unsafe fn mem_pool_set_access(
    pool: sys::CUmemoryPool,
    accessor: sys::CUdevice,
) -> Result<()> {
    let desc = sys::CUmemAccessDesc {
        location: device_location(accessor),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the caller's promise; one descriptor is passed.
    unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) }
        .result()
        .map_err(|e| Error::cuda("cuMemPoolSetAccess", e))
}

/// `cuMemPoolGetAccess`: whether device `accessor` may already read and write `pool`'s memory.
///
/// # Safety
/// As [`mem_pool_set_access`].
pub(crate) unsafe fn mem_pool_can_write(
    pool: sys::CUmemoryPool,
    accessor: sys::CUdevice,
) -> Result<bool> {
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    let mut location = device_location(accessor);
    // SAFETY: the caller's promise; the call writes one flag.
    unsafe { sys::cuMemPoolGetAccess(&mut flags, pool, &mut location) }
        .result()
        .map_err(|e| Error::cuda("cuMemPoolGetAccess", e))?;
    Ok(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
}

/// `cuMemPoolCreate`: a pool of device `device`'s memory that other processes can import
/// (POSIX file descriptor handles), keeping freed memory however much it holds (release
/// threshold unlimited).
///
/// # Safety
/// `device` came from `cuDeviceGet`.
pub(crate) unsafe fn mem_pool_create_shareable(device: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    // SAFETY: a plain C struct of integers and a null pointer: all zero is its "unset" value.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    props.location = device_location(device);
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the properties are filled above; the call writes one handle.
    unsafe { sys::cuMemPoolCreate(&mut pool, &props) }
        .result()
        .map_err(|e| Error::cuda("cuMemPoolCreate", e))?;
    // SAFETY: `pool` was just made.
    if let Err(e) = unsafe { mem_pool_set_release_threshold(pool, u64::MAX) } {
        // SAFETY: the pool was made above and holds nothing.
        let _ = unsafe { mem_pool_destroy(pool) };
        return Err(e);
    }
    Ok(pool)
}

/// `cuMemPoolSetAttribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)`: how much freed memory `pool` keeps
/// from the device at synchronizations.
///
/// # Safety
/// `pool` is a live pool.
pub(crate) unsafe fn mem_pool_set_release_threshold(
    pool: sys::CUmemoryPool,
    mut bytes: u64,
) -> Result<()> {
    // SAFETY: the caller's promise; the attribute takes a u64.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&raw mut bytes).cast(),
        )
    }
    .result()
    .map_err(|e| Error::cuda("cuMemPoolSetAttribute", e))
}

/// `cuMemPoolDestroy` (memory still allocated from it is released once freed).
///
/// # Safety
/// `pool` is a live pool, destroyed once.
pub(crate) unsafe fn mem_pool_destroy(pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: the caller's promise above.
    unsafe { sys::cuMemPoolDestroy(pool) }
        .result()
        .map_err(|e| Error::cuda("cuMemPoolDestroy", e))
}

/// `cuMemPoolExportToShareableHandle`: a new file descriptor for `pool`.
///
/// # Safety
/// `pool` is a live pool made with POSIX file descriptor handles.
pub(crate) unsafe fn mem_pool_export_fd(pool: sys::CUmemoryPool) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: the caller's promise; for this handle type the call writes one int.
    unsafe {
        sys::cuMemPoolExportToShareableHandle(
            (&raw mut fd).cast(),
            pool,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    }
    .result()
    .map_err(|e| Error::cuda("cuMemPoolExportToShareableHandle", e))?;
    // SAFETY: the driver made a new descriptor, now owned here alone.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// `cuMemPoolImportFromShareableHandle` of a pool exported as `fd` (which stays the caller's).
///
/// # Safety
/// A context is current on this thread.
pub(crate) unsafe fn mem_pool_import_fd(
    fd: std::os::fd::BorrowedFd<'_>,
) -> Result<sys::CUmemoryPool> {
    use std::os::fd::AsRawFd;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: for POSIX file descriptors the handle is the descriptor's value; the driver
    // checks it and writes one handle.
    unsafe {
        sys::cuMemPoolImportFromShareableHandle(
            &mut pool,
            fd.as_raw_fd() as isize as *mut std::ffi::c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    }
    .result()
    .map_err(|e| Error::cuda("cuMemPoolImportFromShareableHandle", e))?;
    Ok(pool)
}

/// `cuMemAllocFromPoolAsync`: `len` bytes from `pool`, ordered on `stream`.
///
/// # Safety
/// `pool` is a live pool of the current context's device and `stream` a stream of it; nothing
/// reads the memory before the allocation has completed on `stream` and it has been written.
pub(crate) unsafe fn mem_alloc_from_pool(
    len: usize,
    pool: sys::CUmemoryPool,
    stream: sys::CUstream,
) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: the caller's promise; the call writes one pointer.
    unsafe { sys::cuMemAllocFromPoolAsync(&mut ptr, len, pool, stream) }
        .result()
        .map_err(|e| Error::cuda("cuMemAllocFromPoolAsync", e))?;
    Ok(ptr)
}

/// `cuMemPoolExportPointer`: the 64 bytes another process imports `ptr` with.
///
/// # Safety
/// `ptr` is the start of a live allocation from a shareable pool.
pub(crate) unsafe fn mem_pool_export_pointer(ptr: sys::CUdeviceptr) -> Result<[u8; 64]> {
    let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
    // SAFETY: the caller's promise; the call writes the 64 bytes.
    unsafe { sys::cuMemPoolExportPointer(&mut data, ptr) }
        .result()
        .map_err(|e| Error::cuda("cuMemPoolExportPointer", e))?;
    Ok(data.reserved)
}

/// `cuMemPoolImportPointer`: another process's allocation of the imported `pool`, mapped here.
///
/// # Safety
/// `pool` came from [`mem_pool_import_fd`]; a context is current on this thread.
pub(crate) unsafe fn mem_pool_import_pointer(
    pool: sys::CUmemoryPool,
    data: [u8; 64],
) -> Result<sys::CUdeviceptr> {
    let mut data = sys::CUmemPoolPtrExportData { reserved: data };
    let mut ptr = 0;
    // SAFETY: the caller's promise; the driver checks the data and writes one pointer.
    unsafe { sys::cuMemPoolImportPointer(&mut ptr, pool, &mut data) }
        .result()
        .map_err(|e| Error::cuda("cuMemPoolImportPointer", e))?;
    Ok(ptr)
}

/// `cuMemFree` (synchronous).
///
/// # Safety
/// `ptr` is a live allocation or import of the current context, freed once, after every use.
pub(crate) unsafe fn mem_free(ptr: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: the caller's promise above.
    unsafe { sys::cuMemFree_v2(ptr) }
        .result()
        .map_err(|e| Error::cuda("cuMemFree", e))
}

/// `cuStreamQuery`: whether every piece of work enqueued on `stream` has completed.
///
/// # Safety
/// `stream` is a live stream of the current context.
pub(crate) unsafe fn stream_done(stream: sys::CUstream) -> Result<bool> {
    // SAFETY: the caller's promise above.
    match unsafe { sys::cuStreamQuery(stream) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        result => Err(Error::Cuda {
            op: "cuStreamQuery",
            result,
        }),
    }
}
