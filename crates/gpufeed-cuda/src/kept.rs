//! Device memory let go and kept for the next allocation of the same size
//! ([`Gpu::keep_for_reuse`]): what torch's caching allocator does for its tensors, for the
//! buffers of a load that is made again and again (a checkpoint reloaded in one process).
//!
//! A buffer freed by `cuMemFree` goes back to the device at the next synchronization, which
//! is then the next load's: about 2.5 ms per GiB on the H200 machine, 18-21 ms of a 200 ms
//! load of 8 GiB, plus an allocation per chunk (docs/benchmarks.md, GPU run 139). A kept one
//! is handed to the next [`Gpu::alloc_unpooled`] of its exact length at no cost. What keeps
//! memory decides when to give it back ([`Gpu::release_kept`]); an allocation that finds the
//! device full gives back what is kept and tries again.

use std::sync::{Arc, Weak};

use cudarc::driver::{CudaSlice, sys};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::gpu::{ContextGuard, Gpu};

/// Buffers kept, shared by every [`Gpu`] of one device in the process (they share its
/// primary context, so a buffer let go through one serves an allocation through another).
#[derive(Debug, Default)]
pub(crate) struct Kept {
    blocks: Mutex<Vec<CudaSlice<u8>>>,
}

impl Drop for Kept {
    /// The last `Gpu` of the device went: what is kept is freed, with its context current
    /// (cudarc frees on the current context's stream), the thread's own put back after.
    fn drop(&mut self) {
        free_bound(std::mem::take(self.blocks.get_mut()));
    }
}

/// Drops `blocks` (freeing them) with their context current, then makes the thread's
/// context what it was.
fn free_bound(blocks: Vec<CudaSlice<u8>>) {
    let Some(first) = blocks.first() else {
        return;
    };
    let _restore = ContextGuard::new();
    if let Err(e) = first.context().bind_to_thread() {
        tracing::warn!(error = %e, "binding a context to free kept device memory");
    }
    drop(blocks);
}

/// The kept buffers of device `ordinal`: those of the `Gpu`s open on it, or new ones (freed
/// when the last `Gpu` of the device goes).
pub(crate) fn for_device(ordinal: usize) -> Arc<Kept> {
    static ALL: Mutex<Vec<(usize, Weak<Kept>)>> = Mutex::new(Vec::new());
    let mut all = ALL.lock();
    all.retain(|(_, k)| k.strong_count() > 0);
    if let Some(kept) = all
        .iter()
        .find(|(o, _)| *o == ordinal)
        .and_then(|(_, k)| k.upgrade())
    {
        return kept;
    }
    let kept = Arc::new(Kept::default());
    all.push((ordinal, Arc::downgrade(&kept)));
    kept
}

impl Kept {
    /// A kept buffer of exactly `len` bytes, taken out.
    pub(crate) fn take(&self, len: usize) -> Option<CudaSlice<u8>> {
        let mut blocks = self.blocks.lock();
        let at = blocks.iter().position(|b| b.len() == len)?;
        Some(blocks.swap_remove(at))
    }
}

impl Gpu {
    /// Keeps `buf` for the next [`Gpu::alloc_unpooled`] of its length (through
    /// [`Gpu::alloc_filled`] with [`crate::DeviceAlloc::Unpooled`] too) instead of freeing it,
    /// so that a load made again does not pay for freeing and allocating its memory. Kept
    /// memory is at most half the device's: a buffer beyond that, an empty one, or one of
    /// another context is dropped (freed) here, and `false` returned. Every `Gpu` open on
    /// the device in this process shares what is kept. It stays kept until taken,
    /// [`Gpu::release_kept`], an allocation that finds the device full, or the last `Gpu` of
    /// the device going.
    ///
    /// Keeping is as safe as dropping: the uses cudarc tracks (its events on the buffer) are
    /// waited for by the next owner's, and, as after a free, work that uses the address
    /// without cudarc (a raw pointer on another stream, a DLPack tensor) must be done before
    /// the buffer is let go: synchronize first.
    ///
    /// # Example
    /// ```no_run
    /// use gpufeed_cuda::cudarc::driver::DevicePtr;
    /// use gpufeed_cuda::{DeviceAlloc, Error, Gpu};
    /// let gpu = Gpu::open(0)?;
    /// let fill = |_: &mut _| Ok::<_, Error>(()); // a real caller loads into it
    /// let (buf, ()) = gpu.alloc_filled(1 << 20, DeviceAlloc::Unpooled, fill)?;
    /// let address = buf.device_ptr(buf.stream()).0;
    /// gpu.context().synchronize()?;
    /// assert!(gpu.keep_for_reuse(buf));
    /// let (again, ()) = gpu.alloc_filled(1 << 20, DeviceAlloc::Unpooled, fill)?;
    /// assert_eq!(again.device_ptr(again.stream()).0, address);
    /// assert_eq!(gpu.release_kept()?, 0); // taken again: nothing left kept
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn keep_for_reuse(&self, buf: CudaSlice<u8>) -> bool {
        let len = buf.len();
        if len == 0 || buf.context().cu_ctx() != self.context().cu_ctx() {
            free_bound(vec![buf]);
            return false;
        }
        let cap = self.info().memory_bytes / 2;
        let mut blocks = self.kept.blocks.lock();
        let held: u64 = blocks.iter().map(|b| b.len() as u64).sum();
        if held + len as u64 > cap {
            drop(blocks);
            free_bound(vec![buf]);
            return false;
        }
        blocks.push(buf);
        true
    }

    /// Bytes kept for reuse ([`Gpu::keep_for_reuse`]).
    pub fn kept_bytes(&self) -> u64 {
        self.kept.blocks.lock().iter().map(|b| b.len() as u64).sum()
    }

    /// Frees what is kept for reuse ([`Gpu::keep_for_reuse`]) and, where there was any,
    /// synchronizes the context so that the device has it back when this returns (what the
    /// driver's free-memory figure then shows). Returns the bytes freed. The thread's current
    /// context is as it was before.
    ///
    /// # Errors
    /// [`Error::Cuda`] where the context cannot be made current (nothing is freed then) or the
    /// synchronization fails (the memory is freed regardless).
    pub fn release_kept(&self) -> Result<u64> {
        let _restore = ContextGuard::new();
        let mut kept = self.kept.blocks.lock();
        if kept.is_empty() {
            return Ok(0);
        }
        self.context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let blocks = std::mem::take(&mut *kept);
        drop(kept);
        let bytes: u64 = blocks.iter().map(|b| b.len() as u64).sum();
        drop(blocks);
        self.context()
            .synchronize()
            .map_err(|e| Error::cuda("cuCtxSynchronize", e))?;
        Ok(bytes)
    }

    /// `alloc()` (any of the context's allocations), and where it finds the device full
    /// while memory is kept, again after giving that back.
    pub(crate) fn retrying_when_full<T>(
        &self,
        alloc: impl Fn() -> std::result::Result<T, cudarc::driver::DriverError>,
    ) -> Result<T> {
        match alloc() {
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY && self.kept_bytes() > 0 => {
                let freed = self.release_kept()?;
                tracing::debug!(freed, "device full: kept memory given back");
                alloc().map_err(|e| Error::cuda("cuMemAlloc", e))
            }
            other => other.map_err(|e| Error::cuda("cuMemAlloc", e)),
        }
    }
}
