//! Page-cache residency of files, and moving files into and out of the cache.
//!
//! [`residency`] asks the kernel how much of a file sits in the page cache: `cachestat(2)`
//! (Linux 6.5+) counts exactly, including dirty pages; where it is missing, `mincore(2)` over a
//! temporary mapping. Both show page-cache state only to a caller who owns the file, may write
//! it, or is privileged (`mincore` since Linux 5.2 reports every page resident otherwise;
//! `cachestat` since the 2025 side-channel fix answers `EPERM`): for other files the answer is
//! [`Error::ResidencyUnknown`] with the reason, never a figure that may be wrong.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;

use memmap2::MmapOptions;

use crate::advise::{self, FileAdvice};
use crate::error::{Error, Result, with_path};
use crate::file::open_regular;
use crate::page_size;

/// How residency was measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ResidencyMethod {
    /// `cachestat(2)`: exact page-cache counts.
    Cachestat,
    /// `mincore(2)` on a mapping of the file.
    Mincore,
}

/// The system call's name: `cachestat`, `mincore`.
impl std::fmt::Display for ResidencyMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ResidencyMethod::Cachestat => "cachestat",
            ResidencyMethod::Mincore => "mincore",
        })
    }
}

/// How much of a file is in the page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Residency {
    /// Pages of the file in the page cache.
    pub resident_pages: u64,
    /// Pages the file spans.
    pub total_pages: u64,
    /// Dirty pages (not yet written back), where the method tells.
    pub dirty_pages: Option<u64>,
    /// Page size in bytes.
    pub page_size: u64,
    /// The file's size in bytes.
    pub file_bytes: u64,
    /// How it was measured.
    pub method: ResidencyMethod,
    /// True when the count is an estimate from samples ([`residency_estimate`]).
    pub approximate: bool,
}

impl Residency {
    /// Resident share of the file, from 0.0 to 1.0 (1.0 for an empty file).
    pub fn fraction(&self) -> f64 {
        if self.total_pages == 0 {
            1.0
        } else {
            self.resident_pages as f64 / self.total_pages as f64
        }
    }

    /// Resident bytes (capped at the file's size).
    pub fn resident_bytes(&self) -> u64 {
        (self.resident_pages * self.page_size).min(self.file_bytes)
    }
}

/// The page-cache residency of the file at `path`; `cachestat` where the kernel has it, else
/// `mincore`.
///
/// # Example
/// ```
/// let r = gpufeed_os::cache::residency("/proc/self/exe")?;
/// assert!(r.resident_pages <= r.total_pages);
/// # Ok::<(), gpufeed_os::Error>(())
/// ```
pub fn residency(path: impl AsRef<Path>) -> Result<Residency> {
    let path = path.as_ref();
    let (file, _) = open_regular(path, false)?;
    residency_of(&file).map_err(|e| with_path(e, path))
}

/// The page-cache residency of an open file; see [`residency`].
pub fn residency_of(file: &File) -> Result<Residency> {
    match residency_with(file, ResidencyMethod::Cachestat) {
        Err(Error::Unsupported { .. }) => residency_with(file, ResidencyMethod::Mincore),
        other => other,
    }
}

/// The page-cache residency of an open file measured with the given method.
///
/// # Errors
/// [`Error::Unsupported`] for `Cachestat` on kernels before 6.5 (or where seccomp refuses it);
/// [`Error::ResidencyUnknown`] for a file the kernel does not show us (neither owner, nor
/// writer, nor privileged).
pub fn residency_with(file: &File, method: ResidencyMethod) -> Result<Residency> {
    let file_bytes = file
        .metadata()
        .map_err(|e| Error::io("fstat", None, e))?
        .len();
    let page = page_size() as u64;
    let total_pages = file_bytes.div_ceil(page);
    let (resident_pages, dirty_pages, approximate) = match method {
        ResidencyMethod::Cachestat => {
            let stat = cachestat(file, 0, file_bytes)?;
            (stat.nr_cache, Some(stat.nr_dirty), false)
        }
        ResidencyMethod::Mincore => (mincore_count(file, 0, file_bytes)?, None, false),
    };
    Ok(Residency {
        resident_pages: resident_pages.min(total_pages),
        total_pages,
        dirty_pages,
        page_size: page,
        file_bytes,
        method,
        approximate,
    })
}

/// Windows [`residency_estimate`] looks at.
const SAMPLE_WINDOWS: u64 = 32;
/// Bytes per window.
const SAMPLE_BYTES: u64 = 1 << 20;

/// Estimates the page-cache residency of bytes `range` of the file at `path` from 32 windows
/// of 1 MiB spread evenly over it (counted exactly when the range is 32 MiB or less).
///
/// An exact count walks every page of the range: `cachestat` of a cached 2 GiB file took
/// 9-24 ms on the development VM (docs/benchmarks.md, GPU run 5), while the H200 machine
/// loads 4 GiB in about 80 ms. The estimate
/// is marked [`Residency::approximate`]; its page counts are those of the windows, so use
/// [`Residency::fraction`]. `file_bytes` is the file's size.
///
/// # Example
/// ```
/// let len = std::fs::metadata("/proc/self/exe")?.len();
/// let r = gpufeed_os::cache::residency_estimate("/proc/self/exe", 0..len)?;
/// assert!((0.0..=1.0).contains(&r.fraction()));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// A missing file or not a regular file, a range past its end ([`Error::RangePastEof`]);
/// failures of `cachestat` or `mincore`.
pub fn residency_estimate(
    path: impl AsRef<Path>,
    range: std::ops::Range<u64>,
) -> Result<Residency> {
    let path = path.as_ref();
    let (file, _) = open_regular(path, false)?;
    residency_estimate_of(&file, range).map_err(|e| with_path(e, path))
}

/// [`residency_estimate`] of an open file (`cachestat`, else `mincore`): what a load that
/// opened its file once samples.
///
/// # Errors
/// A range past the end of the file ([`Error::RangePastEof`], without a path); failures of
/// `cachestat` or `mincore`.
pub fn residency_estimate_of(file: &File, range: std::ops::Range<u64>) -> Result<Residency> {
    match residency_estimate_with(file, range.clone(), ResidencyMethod::Cachestat) {
        Err(Error::Unsupported { .. }) => {
            residency_estimate_with(file, range, ResidencyMethod::Mincore)
        }
        other => other,
    }
}

/// [`residency_estimate`] of an open file with the given method.
///
/// # Errors
/// [`Error::Unsupported`] for `Cachestat` on kernels before 6.5; a range past the end of the
/// file; failures of `cachestat` or `mincore`.
pub fn residency_estimate_with(
    file: &File,
    range: std::ops::Range<u64>,
    method: ResidencyMethod,
) -> Result<Residency> {
    let file_bytes = file
        .metadata()
        .map_err(|e| Error::io("fstat", None, e))?
        .len();
    if range.start > range.end || range.end > file_bytes {
        return Err(Error::RangePastEof {
            path: std::path::PathBuf::new(),
            offset: range.start,
            len: range.end.saturating_sub(range.start),
            file_len: file_bytes,
        });
    }
    let page = page_size() as u64;
    let len = range.end - range.start;
    let windows: Vec<(u64, u64)> = if len <= SAMPLE_WINDOWS * SAMPLE_BYTES {
        vec![(range.start, len)]
    } else {
        let step = (len - SAMPLE_BYTES) / (SAMPLE_WINDOWS - 1);
        (0..SAMPLE_WINDOWS)
            .map(|i| ((range.start + i * step) / page * page, SAMPLE_BYTES))
            .collect()
    };
    let (mut resident, mut total) = (0u64, 0u64);
    let mut dirty = (method == ResidencyMethod::Cachestat).then_some(0u64);
    for (off, n) in windows {
        // Whole pages covering [off, off + n).
        let first = off / page * page;
        let end = (off + n)
            .next_multiple_of(page)
            .min(file_bytes.next_multiple_of(page));
        if end <= first {
            continue;
        }
        total += (end - first) / page;
        match method {
            ResidencyMethod::Cachestat => {
                let stat = cachestat(file, first, end - first)?;
                resident += stat.nr_cache;
                dirty = dirty.map(|d| d + stat.nr_dirty);
            }
            ResidencyMethod::Mincore => resident += mincore_count(file, first, end)?,
        }
    }
    Ok(Residency {
        resident_pages: resident.min(total),
        total_pages: total,
        dirty_pages: dirty,
        page_size: page,
        file_bytes,
        method,
        approximate: true,
    })
}

#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// `cachestat` has number 451 in the unified syscall table of every 64-bit architecture.
const SYS_CACHESTAT: libc::c_long = 451;

/// `cachestat` over `len` bytes at `off` (a page multiple).
fn cachestat(file: &File, off: u64, len: u64) -> Result<Cachestat> {
    let range = CachestatRange {
        off,
        len: len.max(1),
    };
    let mut out = Cachestat::default();
    // SAFETY: both pointers point to live, correctly laid out structs (include/uapi/linux/mman.h)
    // for the duration of the call; flags must be 0.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const CachestatRange,
            &mut out as *mut Cachestat,
            0u32,
        )
    };
    if rc == 0 {
        return Ok(out);
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        // Since the page-cache side-channel fix (2025) cachestat refuses files the caller
        // neither owns nor may write; mincore would lie about them.
        Some(libc::EPERM) if !may_write(file) => Err(hidden(
            "cachestat(2) refuses (EPERM) a file the caller neither owns nor may write",
        )),
        Some(libc::ENOSYS) | Some(libc::EPERM) | Some(libc::EOPNOTSUPP) => {
            Err(Error::Unsupported {
                what: "cachestat(2)",
                reason: format!("{err} (needs Linux 6.5+ and a seccomp profile that allows it)"),
            })
        }
        _ => Err(Error::io("cachestat", None, err)),
    }
}

/// Counts resident pages of `[start, end)` (`start` a page multiple) with `mincore` over
/// 1 GiB windows of a read-only mapping.
fn mincore_count(file: &File, start: u64, end: u64) -> Result<u64> {
    const WINDOW: u64 = 1 << 30;
    if !may_write(file) {
        return Err(hidden(
            "mincore(2) reports every page of a file the caller may not write as resident",
        ));
    }
    let page = page_size() as u64;
    let mut resident = 0u64;
    let mut vec = Vec::new();
    let mut offset = start;
    while offset < end {
        let len = (end - offset).min(WINDOW) as usize;
        // SAFETY: the mapping is only passed to mincore, which does not read its pages, so a
        // concurrent truncation cannot fault here.
        let map = unsafe { MmapOptions::new().offset(offset).len(len).map(file) }
            .map_err(|e| Error::io("mmap", None, e))?;
        vec.clear();
        vec.resize((len as u64).div_ceil(page) as usize, 0u8);
        // SAFETY: map is a live mapping of len bytes; vec has one byte per page of it.
        let rc = unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, len, vec.as_mut_ptr()) };
        if rc != 0 {
            return Err(Error::io("mincore", None, std::io::Error::last_os_error()));
        }
        resident += vec.iter().filter(|&&b| b & 1 == 1).count() as u64;
        offset += len as u64;
    }
    Ok(resident)
}

fn hidden(reason: &str) -> Error {
    Error::ResidencyUnknown {
        path: None,
        reason: reason.to_owned(),
    }
}

/// Whether the kernel shows us the page cache of this file: we own it, may write it, or are
/// root.
fn may_write(file: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    let owner = file.metadata().map(|m| m.uid()).ok();
    owner == Some(rustix::process::geteuid().as_raw())
        || rustix::fs::fcntl_getfl(file.as_fd())
            .map(|fl| {
                fl.contains(rustix::fs::OFlags::RDWR) || fl.contains(rustix::fs::OFlags::WRONLY)
            })
            .unwrap_or(false)
        || rustix::process::geteuid().is_root()
}

/// Drops the file's clean pages from the page cache (`fdatasync`, then
/// `POSIX_FADV_DONTNEED` over the whole file) and returns the residency afterwards.
///
/// Pages that another process has mapped, or that are dirty and could not be written back,
/// stay: the returned residency shows what remained.
///
/// # Errors
/// As for [`residency`]; [`Error::ResidencyUnknown`] comes after the pages were dropped (only
/// the measurement afterwards was refused).
pub fn evict(path: impl AsRef<Path>) -> Result<Residency> {
    let path = path.as_ref();
    let (file, _) = open_regular(path, false)?;
    // Write back dirty pages first: DONTNEED skips dirty ones. fdatasync works on a read-only
    // descriptor; a failure (EINVAL on special file systems) only means fewer pages drop.
    if let Err(err) = rustix::fs::fdatasync(&file) {
        tracing::debug!(%err, path = %path.display(), "fdatasync before evict failed");
    }
    advise::fadvise(&file, 0, 0, FileAdvice::DontNeed).map_err(|e| with_path(e, path))?;
    residency_of(&file).map_err(|e| with_path(e, path))
}

/// Reads the whole file into the page cache and returns the residency afterwards.
///
/// A file larger than the machine's memory (`MemTotal`) is refused before anything is read
/// ([`Error::FileLargerThanMemory`]): it could never be resident whole, and reading it through
/// (a 1 TiB sparse file, say) would take long and only push everything else out of the cache.
/// [`Error::ResidencyUnknown`] comes after the file was read in (only the measurement
/// afterwards was refused).
///
/// Faults the file in through a read-only mapping with `MADV_POPULATE_READ` (no copy into
/// user memory); on kernels without it, reads it in 8 MiB pieces. See [`warm_with_progress`]
/// to watch long runs.
pub fn warm(path: impl AsRef<Path>) -> Result<Residency> {
    warm_with_progress(path, |_, _| {})
}

/// Like [`warm`], calling `progress(done_bytes, total_bytes)` after each piece.
pub fn warm_with_progress(
    path: impl AsRef<Path>,
    mut progress: impl FnMut(u64, u64),
) -> Result<Residency> {
    const PIECE: u64 = 8 << 20;
    let path = path.as_ref();
    let (file, identity) = open_regular(path, false)?;
    let total = identity.size;
    if let Some(mem_total) = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| crate::procfs::meminfo_bytes(&m, "MemTotal"))
        && total > mem_total
    {
        return Err(Error::FileLargerThanMemory {
            path: path.into(),
            size: total,
            mem_total,
        });
    }
    let _ = advise::fadvise(&file, 0, 0, FileAdvice::Sequential);
    let mut done = 0u64;
    while done < total {
        let len = (total - done).min(PIECE);
        warm_piece(&file, done, len).map_err(|e| with_path(e, path))?;
        done += len;
        progress(done, total);
    }
    residency_of(&file).map_err(|e| with_path(e, path))
}

fn warm_piece(file: &File, offset: u64, len: u64) -> Result<()> {
    // SAFETY: the mapping is used only by madvise(POPULATE_READ), which reports a truncated
    // file as an error (EFAULT) instead of raising SIGBUS.
    let map = unsafe {
        MmapOptions::new()
            .offset(offset)
            .len(len as usize)
            .map(file)
    }
    .map_err(|e| Error::io("mmap", None, e))?;
    match advise::madvise(map.as_ptr(), map.len(), advise::MemAdvice::PopulateRead) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            drop(map);
            read_piece(file, offset, len)
        }
        Err(e) => Err(e),
    }
}

fn read_piece(file: &File, offset: u64, len: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len as usize];
    file.read_exact_at(&mut buf, offset)
        .map_err(|e| Error::io("pread", None, e))
}
