//! Access-pattern hints to the kernel: `posix_fadvise`, `readahead` and `madvise`.
//!
//! Hints are hints: the kernel may ignore them, and they never change the bytes a program
//! reads. Ranges are widened to whole pages before they are passed on, because the kernel
//! ignores partial pages for most advice (a `DONTNEED` on half a page drops nothing).

use std::os::fd::AsFd;

use rustix::fs::Advice as RawFileAdvice;
use rustix::mm::Advice as RawMemAdvice;

use crate::error::{Error, Result};
use crate::page_size;

/// Advice for [`fadvise`] about how a file range will be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FileAdvice {
    /// `POSIX_FADV_NORMAL`: the default read-ahead.
    Normal,
    /// `POSIX_FADV_SEQUENTIAL`: read front to back; doubles the read-ahead window.
    Sequential,
    /// `POSIX_FADV_RANDOM`: random access; disables read-ahead.
    Random,
    /// `POSIX_FADV_WILLNEED`: start reading the range into the page cache now.
    WillNeed,
    /// `POSIX_FADV_DONTNEED`: drop clean cached pages of the range.
    DontNeed,
    /// `POSIX_FADV_NOREUSE`: the data is read once (a no-op before Linux 6.3).
    NoReuse,
}

impl From<FileAdvice> for RawFileAdvice {
    fn from(advice: FileAdvice) -> Self {
        match advice {
            FileAdvice::Normal => RawFileAdvice::Normal,
            FileAdvice::Sequential => RawFileAdvice::Sequential,
            FileAdvice::Random => RawFileAdvice::Random,
            FileAdvice::WillNeed => RawFileAdvice::WillNeed,
            FileAdvice::DontNeed => RawFileAdvice::DontNeed,
            FileAdvice::NoReuse => RawFileAdvice::NoReuse,
        }
    }
}

/// Advice for [`madvise`] about a range of mapped memory.
///
/// Only advice that leaves the contents of memory unchanged is offered, which is what keeps
/// [`madvise`] safe to call: `MADV_DONTNEED`, `MADV_FREE` and `MADV_REMOVE` discard data and
/// are deliberately absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemAdvice {
    /// `MADV_NORMAL`: the default.
    Normal,
    /// `MADV_SEQUENTIAL`: read front to back; aggressive read-ahead, pages freed soon after.
    Sequential,
    /// `MADV_RANDOM`: random access; no read-ahead on faults.
    Random,
    /// `MADV_WILLNEED`: start reading the range in now.
    WillNeed,
    /// `MADV_HUGEPAGE`: back the range with transparent huge pages (THP mode `madvise`).
    HugePage,
    /// `MADV_NOHUGEPAGE`: never use huge pages for the range.
    NoHugePage,
    /// `MADV_POPULATE_READ` (Linux 5.14): fault every page in readable now, without touching it.
    PopulateRead,
    /// `MADV_POPULATE_WRITE` (Linux 5.14): fault every page in writable now.
    PopulateWrite,
    /// `MADV_COLD` (Linux 5.4): the range is a good candidate for reclaim.
    Cold,
}

impl From<MemAdvice> for RawMemAdvice {
    fn from(advice: MemAdvice) -> Self {
        match advice {
            MemAdvice::Normal => RawMemAdvice::Normal,
            MemAdvice::Sequential => RawMemAdvice::Sequential,
            MemAdvice::Random => RawMemAdvice::Random,
            MemAdvice::WillNeed => RawMemAdvice::WillNeed,
            MemAdvice::HugePage => RawMemAdvice::LinuxHugepage,
            MemAdvice::NoHugePage => RawMemAdvice::LinuxNoHugepage,
            MemAdvice::PopulateRead => RawMemAdvice::LinuxPopulateRead,
            MemAdvice::PopulateWrite => RawMemAdvice::LinuxPopulateWrite,
            MemAdvice::Cold => RawMemAdvice::LinuxCold,
        }
    }
}

/// Widens `[offset, offset + len)` to whole pages; `len == 0` stays 0 ("to the end of file").
fn page_range(offset: u64, len: u64) -> (u64, u64) {
    let page = page_size() as u64;
    let start = offset / page * page;
    if len == 0 {
        return (start, 0);
    }
    let end = offset.saturating_add(len).saturating_add(page - 1) / page * page;
    (start, end - start)
}

/// `posix_fadvise(fd, offset, len, advice)` — declares an expected access pattern for a file
/// range. `len == 0` means "to the end of the file". The range is widened to whole pages.
///
/// See [posix_fadvise(2)](https://man7.org/linux/man-pages/man2/posix_fadvise.2.html).
///
/// # Example
/// ```
/// use gpufeed_os::advise::{fadvise, FileAdvice};
/// let file = std::fs::File::open("/proc/self/exe").expect("our own binary");
/// fadvise(&file, 0, 0, FileAdvice::Sequential)?;
/// # Ok::<(), gpufeed_os::Error>(())
/// ```
pub fn fadvise(fd: impl AsFd, offset: u64, len: u64, advice: FileAdvice) -> Result<()> {
    let (offset, len) = page_range(offset, len);
    rustix::fs::fadvise(fd, offset, std::num::NonZeroU64::new(len), advice.into())
        .map_err(|e| Error::io("posix_fadvise", None, e))
}

/// `readahead(fd, offset, count)` — starts reading a file range into the page cache and
/// returns without waiting for it. The range is widened to whole pages; the kernel may read
/// less than asked (it caps each call at the device's read-ahead budget), so callers that need
/// the data resident use [`crate::cache::warm`].
///
/// See [readahead(2)](https://man7.org/linux/man-pages/man2/readahead.2.html).
pub fn readahead(fd: impl AsFd, offset: u64, len: u64) -> Result<()> {
    use std::os::fd::AsRawFd;
    let (offset, len) = page_range(offset, len);
    let offset = i64::try_from(offset).map_err(|_| {
        Error::io(
            "readahead",
            None,
            std::io::Error::from_raw_os_error(libc::EINVAL),
        )
    })?;
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    // SAFETY: readahead only reads the file descriptor number and the integers; it touches
    // no memory of ours.
    let rc = unsafe { libc::readahead(fd.as_fd().as_raw_fd(), offset, len) };
    if rc < 0 {
        return Err(Error::io(
            "readahead",
            None,
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// `madvise(addr, len, advice)` — declares an expected access pattern for a range of mapped
/// memory. The range is widened to whole pages.
///
/// This is safe for any pointer: every [`MemAdvice`] leaves memory contents unchanged, and
/// the kernel answers a range that is not mapped with `ENOMEM` rather than touching it.
///
/// See [madvise(2)](https://man7.org/linux/man-pages/man2/madvise.2.html).
pub fn madvise(ptr: *const u8, len: usize, advice: MemAdvice) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let page = page_size();
    let addr = ptr as usize;
    let start = addr / page * page;
    let end = addr
        .checked_add(len)
        .and_then(|e| e.checked_next_multiple_of(page))
        .ok_or(Error::OutOfBounds {
            offset: addr,
            len,
            capacity: usize::MAX,
        })?;
    // SAFETY: the advice offered by `MemAdvice` never changes memory contents (see the type's
    // docs), so no Rust reference into the range can observe a difference; the kernel checks
    // that the range is mapped.
    unsafe { rustix::mm::madvise(start as *mut _, end - start, advice.into()) }
        .map_err(|e| Error::io("madvise", None, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_widen_to_pages() {
        let page = page_size() as u64;
        assert_eq!(page_range(0, 0), (0, 0));
        assert_eq!(page_range(1, 1), (0, page));
        assert_eq!(page_range(page - 1, 2), (0, 2 * page));
        assert_eq!(page_range(page, page), (page, page));
        assert_eq!(page_range(page + 5, 0), (page, 0));
    }
}
