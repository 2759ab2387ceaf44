//! Device-to-device copies by address, queued on a stream: what a caller that holds device
//! addresses (a checkpoint's staging, tensors Python owns) needs without raw driver calls of
//! its own.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::{Result, raw};

/// Queues a copy of `len` bytes from `src` to `dst` on `stream` (`cuMemcpyDtoDAsync`).
///
/// # Safety
/// `src .. src + len` and `dst .. dst + len` must be device memory of `stream`'s context (or
/// mapped in it), the destination written by nothing else until the work queued on `stream`
/// now has run, the source kept until then.
///
/// # Errors
/// [`crate::Error::Cuda`] naming `cuMemcpyDtoDAsync`.
pub unsafe fn dtod_async(stream: &Arc<CudaStream>, dst: u64, src: u64, len: usize) -> Result<()> {
    // SAFETY: the caller's promise above.
    unsafe { raw::memcpy_dtod_async(dst, src, len, stream.cu_stream()) }
}

/// Queues a pitched copy on `stream` (`cuMemcpy2DAsync`): `height` rows of `width` bytes,
/// `src_pitch` bytes apart from `src` on, into rows `dst_pitch` apart from `dst` on.
///
/// # Safety
/// As for [`dtod_async`], for every row of both sides.
///
/// # Errors
/// [`crate::Error::Cuda`] naming `cuMemcpy2DAsync` (a pitch the driver refuses: rows of more
/// than 2 GiB, or a width over its pitch).
#[allow(clippy::too_many_arguments, reason = "a pitched copy's fields")]
pub unsafe fn dtod_2d_async(
    stream: &Arc<CudaStream>,
    dst: u64,
    dst_pitch: usize,
    src: u64,
    src_pitch: usize,
    width: usize,
    height: usize,
) -> Result<()> {
    // SAFETY: the caller's promise above.
    unsafe {
        raw::memcpy_2d_dtod_async(
            dst,
            dst_pitch,
            src,
            src_pitch,
            width,
            height,
            stream.cu_stream(),
        )
    }
}
