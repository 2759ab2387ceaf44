//! Page locking: `mlock` as a guard, and the `RLIMIT_MEMLOCK` budget.
//!
//! Locked pages cannot be swapped out, which is what DMA engines need from host memory that is
//! not pinned by the CUDA driver. Unprivileged processes may lock at most `RLIMIT_MEMLOCK`
//! bytes (containers often set 64 KiB or 8 MiB); a process with `CAP_IPC_LOCK` (root, usually)
//! is not limited. [`mlock`] checks the budget first so that the error says what to do.

use std::marker::PhantomData;

use crate::error::{Error, Result};
use crate::{page_size, procfs};

/// The `RLIMIT_MEMLOCK` of this process, in bytes (`None` = unlimited).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// The soft limit, the one enforced.
    pub soft: Option<u64>,
    /// The hard limit, up to which an unprivileged process may raise the soft one.
    pub hard: Option<u64>,
}

/// `getrlimit(RLIMIT_MEMLOCK)` — how many bytes this process may lock.
///
/// See [getrlimit(2)](https://man7.org/linux/man-pages/man2/getrlimit.2.html).
pub fn memlock_limit() -> Limit {
    let raw = rustix::process::getrlimit(rustix::process::Resource::Memlock);
    Limit {
        soft: raw.current,
        hard: raw.maximum,
    }
}

/// Whether this process holds `CAP_IPC_LOCK` in its effective set, which lifts the memlock
/// limit entirely.
pub fn has_cap_ipc_lock() -> bool {
    rustix::thread::capabilities(None)
        .map(|caps| {
            caps.effective
                .contains(rustix::thread::CapabilitySet::IPC_LOCK)
        })
        .unwrap_or(false)
}

/// Bytes this process has locked now (`VmLck` of `/proc/self/status`), `None` where /proc is
/// not readable.
pub fn locked_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    procfs::meminfo_bytes(&status, "VmLck")
}

/// Memory that must stay available after a lock: a tenth of what is available, at least
/// 256 MiB.
fn memory_margin(available: u64) -> u64 {
    (available / 10).max(256 << 20)
}

/// Checks that `bytes` more could be page-locked now as far as memory goes (the memlock limit
/// aside: for pinning that does not count against it, such as a registration with CUDA).
///
/// # Errors
/// [`Error::NotEnoughMemory`] when `bytes` (rounded up to pages) exceed `MemAvailable` less a
/// margin (a tenth, at least 256 MiB). Where `MemAvailable` cannot be read, nothing is checked.
pub fn check_memory(bytes: u64) -> Result<()> {
    let requested = bytes.next_multiple_of(page_size() as u64);
    if let Ok(available) = crate::sys::mem_available() {
        let margin = memory_margin(available);
        if requested > available.saturating_sub(margin) {
            return Err(Error::NotEnoughMemory {
                requested,
                available,
                margin,
            });
        }
    }
    Ok(())
}

/// Checks that `bytes` more could be locked now, without locking anything.
///
/// # Errors
/// [`Error::NotEnoughMemory`] when `bytes` (rounded up to pages) exceed `MemAvailable` less a
/// margin (a tenth, at least 256 MiB) — also for a process that no limit stops (root), which
/// the OOM killer would otherwise end; [`Error::MemlockLimit`] when this process lacks
/// `CAP_IPC_LOCK` and the locked bytes plus `bytes` exceed the soft limit.
pub fn check_budget(bytes: u64) -> Result<()> {
    check_memory(bytes)?;
    let requested = bytes.next_multiple_of(page_size() as u64);
    if has_cap_ipc_lock() {
        return Ok(());
    }
    let limit = memlock_limit();
    let Some(soft) = limit.soft else {
        return Ok(());
    };
    let locked = locked_bytes().unwrap_or(0);
    if locked.saturating_add(requested) > soft {
        return Err(Error::MemlockLimit {
            requested,
            locked,
            soft: limit.soft,
            hard: limit.hard,
        });
    }
    Ok(())
}

/// A range of memory locked into RAM; unlocked when dropped.
///
/// Locks do not nest: unlocking a range unlocks every page in it, also pages that another
/// `LockedRegion` locked. Keep locked ranges disjoint.
#[derive(Debug)]
#[must_use = "the memory is unlocked again when the LockedRegion is dropped"]
pub struct LockedRegion<'a> {
    start: usize,
    len: usize,
    _memory: PhantomData<&'a [u8]>,
}

// SAFETY: a LockedRegion holds only the address range it locked and gives no access to the
// memory, so moving or sharing it between threads is harmless.
unsafe impl Send for LockedRegion<'_> {}
// SAFETY: as above; `&LockedRegion` exposes only integers.
unsafe impl Sync for LockedRegion<'_> {}

impl LockedRegion<'_> {
    /// First locked address (page-aligned).
    pub fn as_ptr(&self) -> *const u8 {
        self.start as *const u8
    }

    /// Number of locked bytes (whole pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no byte is locked.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for LockedRegion<'_> {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: munlock neither reads nor writes the memory; the range was locked by us and,
        // by the lifetime (or the promise of `mlock_raw`), is still mapped.
        if let Err(err) = unsafe { rustix::mm::munlock(self.start as *mut _, self.len) } {
            tracing::warn!(%err, len = self.len, "munlock failed");
        }
    }
}

/// `mlock(addr, len)` — locks the pages under `region` into RAM until the guard is dropped.
///
/// See [mlock(2)](https://man7.org/linux/man-pages/man2/mlock.2.html).
///
/// # Errors
/// [`Error::MemlockLimit`] when the request does not fit in `RLIMIT_MEMLOCK` (checked before
/// the call, and mapped from the kernel's `ENOMEM`/`EPERM`).
///
/// # Example
/// ```
/// let data = gpufeed_os::align::AlignedBuf::new(64 * 1024, 4096)?;
/// let locked = gpufeed_os::lock::mlock(&data)?;
/// assert_eq!(locked.len(), 64 * 1024);
/// # Ok::<(), gpufeed_os::Error>(())
/// ```
pub fn mlock(region: &[u8]) -> Result<LockedRegion<'_>> {
    // SAFETY: the borrow keeps `region` alive and mapped for as long as the guard lives.
    let (start, len) = unsafe { lock_pages(region.as_ptr(), region.len())? };
    Ok(LockedRegion {
        start,
        len,
        _memory: PhantomData,
    })
}

/// Like [`mlock`] for memory that cannot be borrowed as a slice, such as shared memory another
/// process writes.
///
/// # Safety
/// 1. `[ptr, ptr + len)` stays mapped until the returned guard is dropped (unlocking an
///    unmapped range is harmless, but a new mapping at the same address would be unlocked).
pub unsafe fn mlock_raw(ptr: *const u8, len: usize) -> Result<LockedRegion<'static>> {
    // SAFETY: the caller keeps the range mapped for the guard's life.
    let (start, len) = unsafe { lock_pages(ptr, len)? };
    Ok(LockedRegion {
        start,
        len,
        _memory: PhantomData,
    })
}

/// Locks the whole pages under `[ptr, ptr + len)`; returns the locked page range.
///
/// # Safety
/// 1. The range stays mapped until it is unlocked.
unsafe fn lock_pages(ptr: *const u8, len: usize) -> Result<(usize, usize)> {
    if len == 0 {
        return Ok((ptr as usize, 0));
    }
    let page = page_size();
    let start = ptr as usize / page * page;
    let end = (ptr as usize)
        .checked_add(len)
        .and_then(|e| e.checked_next_multiple_of(page))
        .ok_or(Error::OutOfBounds {
            offset: ptr as usize,
            len,
            capacity: usize::MAX,
        })?;
    let bytes = end - start;
    check_budget(bytes as u64)?;
    // SAFETY: mlock does not read or write the memory; the caller keeps the range mapped.
    match unsafe { rustix::mm::mlock(start as *mut _, bytes) } {
        Ok(()) => Ok((start, bytes)),
        Err(err)
            if (err == rustix::io::Errno::NOMEM || err == rustix::io::Errno::PERM)
                && !has_cap_ipc_lock() =>
        {
            let limit = memlock_limit();
            Err(Error::MemlockLimit {
                requested: bytes as u64,
                locked: locked_bytes().unwrap_or(0),
                soft: limit.soft,
                hard: limit.hard,
            })
        }
        Err(err) => Err(Error::io("mlock", None, err)),
    }
}
