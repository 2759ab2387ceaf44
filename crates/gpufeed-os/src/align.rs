//! Aligned buffers and the alignment rules of `O_DIRECT`.
//!
//! CUDA copies are fastest from 64-byte aligned memory (256 bytes for frames shared with the
//! GPU), `O_DIRECT` needs buffers, offsets and lengths aligned to what the file system asks
//! ([`dio_alignment`]), and huge pages need 2 MiB alignment. [`AlignedBuf`] covers all of them.

use std::alloc::Layout;
use std::fs::File;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsFd;
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::page_size;

/// Whether `value` is a multiple of `align` (a power of two).
#[inline]
pub const fn is_aligned(value: u64, align: u64) -> bool {
    align.is_power_of_two() && value & (align - 1) == 0
}

/// Whether `ptr` is aligned to `align` (a power of two).
#[inline]
pub fn is_aligned_ptr<T>(ptr: *const T, align: usize) -> bool {
    is_aligned(ptr as usize as u64, align as u64)
}

/// `value` rounded down to a multiple of `align` (a power of two).
#[inline]
pub const fn align_down(value: u64, align: u64) -> u64 {
    value & !(align - 1)
}

/// `value` rounded up to a multiple of `align` (a power of two), `None` on overflow.
#[inline]
pub const fn align_up(value: u64, align: u64) -> Option<u64> {
    match value.checked_add(align - 1) {
        Some(v) => Some(v & !(align - 1)),
        None => None,
    }
}

/// Allocations of at least this size (or page alignment) come from `mmap`, whose pages the
/// kernel zeroes lazily: zeroed memory then costs nothing until it is touched.
const MMAP_THRESHOLD: usize = 256 * 1024;

#[derive(Debug)]
enum Backing {
    Heap(Layout),
    Mmap { base: usize, map_len: usize },
}

/// A heap buffer with a chosen alignment.
///
/// Small buffers come from the global allocator; page-aligned or large ones from anonymous
/// `mmap` (zeroed lazily by the kernel; 2 MiB-aligned ones are advised `MADV_HUGEPAGE`).
///
/// # Example
/// ```
/// use gpufeed_os::align::{AlignedBuf, is_aligned_ptr};
/// let mut buf = AlignedBuf::new(1000, 256)?;
/// assert!(is_aligned_ptr(buf.as_ptr(), 256));
/// assert!(buf.iter().all(|&b| b == 0));
/// buf[999] = 7;
/// # Ok::<(), gpufeed_os::Error>(())
/// ```
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    align: usize,
    backing: Backing,
}

// SAFETY: AlignedBuf owns its memory exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access is only through `&[u8]`, like a Box<[u8]>.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes whose first byte is aligned to `align`.
    ///
    /// # Errors
    /// [`Error::ZeroLength`], [`Error::InvalidAlignment`] (not a power of two),
    /// [`Error::OutOfMemory`].
    pub fn new(len: usize, align: usize) -> Result<Self> {
        Self::allocate(len, align, true)
    }

    /// A buffer of `len` bytes aligned to `align` whose contents are not initialised, for
    /// buffers that a read (`pread`, `O_DIRECT`, a DMA) fills before anyone looks at them.
    ///
    /// # Safety
    /// 1. Every byte is written (through [`AlignedBuf::as_mut_ptr`] or by the kernel) before
    ///    it is read through `Deref`, `as_slice` or a copy of the buffer.
    pub unsafe fn new_uninit(len: usize, align: usize) -> Result<Self> {
        Self::allocate(len, align, false)
    }

    fn allocate(len: usize, align: usize, zeroed: bool) -> Result<Self> {
        if len == 0 {
            return Err(Error::ZeroLength { what: "AlignedBuf" });
        }
        if !align.is_power_of_two() {
            return Err(Error::InvalidAlignment { align });
        }
        let oom = Error::OutOfMemory { len, align };
        let page = page_size();
        if align < page && len < MMAP_THRESHOLD {
            let layout = Layout::from_size_align(len, align).map_err(|_| oom)?;
            // SAFETY: the layout has a non-zero size.
            let raw = unsafe {
                if zeroed {
                    std::alloc::alloc_zeroed(layout)
                } else {
                    std::alloc::alloc(layout)
                }
            };
            let ptr = NonNull::new(raw).ok_or(Error::OutOfMemory { len, align })?;
            return Ok(AlignedBuf {
                ptr,
                len,
                align,
                backing: Backing::Heap(layout),
            });
        }
        // Over-allocate by (align - page) and trim, so that the kept part starts aligned.
        let map_align = align.max(page);
        let rounded = len
            .checked_next_multiple_of(page)
            .ok_or(Error::OutOfMemory { len, align })?;
        let map_len = rounded
            .checked_add(map_align - page)
            .ok_or(Error::OutOfMemory { len, align })?;
        // SAFETY: a fresh private anonymous mapping aliases nothing.
        let raw = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                map_len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .map_err(|e| match e {
            rustix::io::Errno::NOMEM => Error::OutOfMemory { len, align },
            e => Error::io("mmap", None, e),
        })?;
        let base = raw as usize;
        let start = base.next_multiple_of(map_align);
        let head = start - base;
        let tail = map_len - head - rounded;
        // SAFETY: the head and tail pieces are parts of the mapping just made, outside the
        // range we keep, and nothing refers to them.
        unsafe {
            if head > 0 {
                let _ = rustix::mm::munmap(base as *mut _, head);
            }
            if tail > 0 {
                let _ = rustix::mm::munmap((start + rounded) as *mut _, tail);
            }
        }
        if align >= 2 * 1024 * 1024 {
            // A hint: failure (THP disabled) leaves ordinary pages, which work the same.
            let _ = crate::advise::madvise(
                start as *const u8,
                rounded,
                crate::advise::MemAdvice::HugePage,
            );
        }
        Ok(AlignedBuf {
            ptr: NonNull::new(start as *mut u8).ok_or(Error::OutOfMemory { len, align })?,
            len,
            align,
            backing: Backing::Mmap {
                base: start,
                map_len: rounded,
            },
        })
    }

    /// The number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: an `AlignedBuf` has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The alignment asked for.
    pub fn align(&self) -> usize {
        self.align
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The first byte, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self
    }

    /// The bytes, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr points to len bytes owned by self; they are initialised (zeroed, or
        // written as `new_uninit` requires).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: allocated by the global allocator with this layout.
            Backing::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) },
            Backing::Mmap { base, map_len } => {
                // SAFETY: the range is the part of our mapping that we kept, and the buffer
                // (and every borrow of it) ends here.
                let _ = unsafe { rustix::mm::munmap(base as *mut _, map_len) };
            }
        }
    }
}

/// Where a [`DioAlignment`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DioAlignmentSource {
    /// `statx(STATX_DIOALIGN)`, the file system's own answer (Linux 6.1+).
    Statx,
    /// The logical block size of the device under the file system (from /sys).
    LogicalBlockSize,
    /// Neither was available: the page size, which satisfies every common device.
    PageSizeAssumed,
}

impl std::fmt::Display for DioAlignmentSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DioAlignmentSource::Statx => "statx",
            DioAlignmentSource::LogicalBlockSize => "the device's logical block size",
            DioAlignmentSource::PageSizeAssumed => "assumed: the page size",
        })
    }
}

/// The alignment `O_DIRECT` needs for one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DioAlignment {
    /// Required alignment of the user buffer's address, in bytes (0 = O_DIRECT unsupported).
    pub mem_align: u32,
    /// Required alignment of file offsets and lengths, in bytes (0 = O_DIRECT unsupported).
    pub offset_align: u32,
    /// How it was found out.
    pub source: DioAlignmentSource,
}

impl DioAlignment {
    /// Whether the file system accepts `O_DIRECT` for this file at all.
    pub fn supported(&self) -> bool {
        self.mem_align != 0 && self.offset_align != 0
    }
}

/// The alignment that `O_DIRECT` reads of `file` need: `statx(STATX_DIOALIGN)` where the kernel
/// and file system answer it, else the logical block size of the device, else the page size.
///
/// # Example
/// ```
/// let file = std::fs::File::open("/proc/self/exe").expect("our own binary");
/// let dio = gpufeed_os::align::dio_alignment(&file)?;
/// if dio.supported() {
///     assert!(dio.offset_align.is_power_of_two());
/// }
/// # Ok::<(), gpufeed_os::Error>(())
/// ```
pub fn dio_alignment(file: &File) -> Result<DioAlignment> {
    use rustix::fs::{AtFlags, StatxFlags};
    let stx = rustix::fs::statx(
        file.as_fd(),
        "",
        AtFlags::EMPTY_PATH,
        StatxFlags::DIOALIGN | StatxFlags::BASIC_STATS,
    )
    .map_err(|e| Error::io("statx", None, e))?;
    if StatxFlags::from_bits_retain(stx.stx_mask).contains(StatxFlags::DIOALIGN) {
        return Ok(DioAlignment {
            mem_align: stx.stx_dio_mem_align,
            offset_align: stx.stx_dio_offset_align,
            source: DioAlignmentSource::Statx,
        });
    }
    if let Some(lbs) = logical_block_size(stx.stx_dev_major, stx.stx_dev_minor) {
        return Ok(DioAlignment {
            mem_align: lbs,
            offset_align: lbs,
            source: DioAlignmentSource::LogicalBlockSize,
        });
    }
    let page = page_size() as u32;
    Ok(DioAlignment {
        mem_align: page,
        offset_align: page,
        source: DioAlignmentSource::PageSizeAssumed,
    })
}

/// `/sys/dev/block/MAJ:MIN/queue/logical_block_size`, also for partitions (whose queue is
/// their parent's).
fn logical_block_size(major: u32, minor: u32) -> Option<u32> {
    let dev = format!("/sys/dev/block/{major}:{minor}");
    ["queue/logical_block_size", "../queue/logical_block_size"]
        .iter()
        .find_map(|rel| std::fs::read_to_string(format!("{dev}/{rel}")).ok())
        .and_then(|text| crate::procfs::single_u64(&text))
        .and_then(|v| u32::try_from(v).ok())
        .filter(|v| v.is_power_of_two())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers() {
        assert!(is_aligned(0, 64));
        assert!(is_aligned(4096, 4096));
        assert!(!is_aligned(4097, 4096));
        assert!(!is_aligned(64, 3), "not a power of two");
        assert_eq!(align_down(4097, 4096), 4096);
        assert_eq!(align_up(4097, 4096), Some(8192));
        assert_eq!(align_up(8192, 4096), Some(8192));
        assert_eq!(align_up(u64::MAX, 4096), None);
    }
}
