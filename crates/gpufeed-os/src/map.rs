//! Memory mappings of files: read-only, shared (read-write) and private (copy-on-write), and
//! many files side by side in one range ([`FilesMap`]).
//!
//! A mapping is only as stable as the file under it: if the file shrinks while mapped, touching
//! a page past the new end raises `SIGBUS` and kills the process. Rust cannot check that, so
//! every constructor is `unsafe` and the promise ("nobody truncates this file while it is
//! mapped") belongs to the caller. [`FileMap`] records the file's [`FileIdentity`] so that the
//! caller can check, with [`FileMap::verify_unchanged`], that the promise held. Files that may
//! change are better read with a reader (`gpufeed-uring`) than mapped.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapMut, MmapOptions};

use crate::advise::{self, MemAdvice};
use crate::error::{Error, Result};
use crate::file::{FileIdentity, OpenedFile, open_regular};
use crate::lock::{self, LockedRegion};

/// How a file is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MapMode {
    /// `PROT_READ`, `MAP_SHARED`: the page cache itself, read-only. The mode to hand to a GPU
    /// (register it with `CU_MEMHOSTREGISTER_READ_ONLY`) and to share between processes.
    ReadOnly,
    /// `PROT_READ | PROT_WRITE`, `MAP_SHARED`: writes go to the file (the file is opened
    /// read-write).
    Shared,
    /// `PROT_READ | PROT_WRITE`, `MAP_PRIVATE`: writes stay in this process (copy-on-write);
    /// the file is never changed.
    Private,
}

#[derive(Debug)]
enum Mapping {
    Read(Mmap),
    Write(MmapMut),
}

/// A mapping of a whole file or of a byte range of it.
///
/// # Example
/// ```
/// use gpufeed_os::map::{FileMap, MapMode};
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("data.bin");
/// std::fs::write(&path, b"hello, gpu")?;
/// // SAFETY: the file is ours and nobody truncates it while it is mapped.
/// let map = unsafe { FileMap::open_range(&path, 7, 3, MapMode::ReadOnly)? };
/// assert_eq!(&map[..], b"gpu");
/// map.verify_unchanged()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct FileMap {
    mapping: Mapping,
    file: File,
    path: PathBuf,
    offset: u64,
    mode: MapMode,
    identity: FileIdentity,
}

impl FileMap {
    /// Maps all of `path`.
    ///
    /// # Safety
    /// 1. The file is not truncated while the mapping lives (a page past the new end raises
    ///    `SIGBUS`); [`FileMap::verify_unchanged`] can check afterwards that it was not.
    /// 2. In [`MapMode::ReadOnly`] and [`MapMode::Private`], no one writes the file while the
    ///    returned slices are borrowed (a change would show through a `&[u8]`).
    ///
    /// # Errors
    /// [`Error::NotFound`], [`Error::IsDirectory`], [`Error::NotRegularFile`],
    /// [`Error::EmptyFile`], or [`Error::Io`] from `open`/`mmap`.
    pub unsafe fn open(path: impl AsRef<Path>, mode: MapMode) -> Result<Self> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { Self::map(path.as_ref(), 0, None, mode) }
    }

    /// Maps `len` bytes of `path` starting at byte `offset` (any offset: the page-aligned start
    /// is handled inside).
    ///
    /// # Safety
    /// As for [`FileMap::open`].
    ///
    /// # Errors
    /// As for [`FileMap::open`], plus [`Error::ZeroLength`] and [`Error::RangePastEof`].
    pub unsafe fn open_range(
        path: impl AsRef<Path>,
        offset: u64,
        len: u64,
        mode: MapMode,
    ) -> Result<Self> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { Self::map(path.as_ref(), offset, Some(len), mode) }
    }

    /// Maps `len` bytes at `offset` of a file opened once for a load ([`OpenedFile`]), read
    /// only, through a duplicate of its descriptor (the path is not looked up again); the
    /// identity the mapping checks against is the one the file had when it was opened.
    ///
    /// # Safety
    /// As for [`FileMap::open`].
    ///
    /// # Errors
    /// As for [`FileMap::open_range`], plus [`Error::Io`] where the descriptor cannot be
    /// duplicated.
    pub unsafe fn of_opened(opened: &OpenedFile, offset: u64, len: u64) -> Result<Self> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { Self::of_opened_as(opened, offset, len, MapMode::ReadOnly) }
    }

    /// [`FileMap::of_opened`] in `mode`: [`MapMode::Private`] gives writable copy-on-write
    /// pages (what safetensors' CPU tensors are: writes stay in the process, never reach the
    /// file). [`MapMode::Shared`] needs a descriptor opened for writing, which an
    /// [`OpenedFile`] is not (`mmap` then fails with `EACCES`).
    ///
    /// # Safety
    /// As for [`FileMap::open`].
    ///
    /// # Errors
    /// As for [`FileMap::of_opened`].
    pub unsafe fn of_opened_as(
        opened: &OpenedFile,
        offset: u64,
        len: u64,
        mode: MapMode,
    ) -> Result<Self> {
        let file = opened.duplicate()?;
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe {
            Self::map_file(
                file,
                *opened.identity(),
                opened.path(),
                offset,
                Some(len),
                mode,
            )
        }
    }

    unsafe fn map(path: &Path, offset: u64, len: Option<u64>, mode: MapMode) -> Result<Self> {
        let (file, identity) = open_regular(path, mode == MapMode::Shared)?;
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { Self::map_file(file, identity, path, offset, len, mode) }
    }

    unsafe fn map_file(
        file: File,
        identity: FileIdentity,
        path: &Path,
        offset: u64,
        len: Option<u64>,
        mode: MapMode,
    ) -> Result<Self> {
        let file_len = identity.size;
        if len == Some(0) {
            return Err(Error::ZeroLength { what: "FileMap" });
        }
        if file_len == 0 {
            return Err(Error::EmptyFile { path: path.into() });
        }
        let len = len.unwrap_or(file_len.saturating_sub(offset));
        let past_eof = Error::RangePastEof {
            path: path.into(),
            offset,
            len,
            file_len,
        };
        match offset.checked_add(len) {
            Some(end) if end <= file_len && len > 0 => {}
            _ => return Err(past_eof),
        }
        let map_len = usize::try_from(len).map_err(|_| Error::RangePastEof {
            path: path.into(),
            offset,
            len,
            file_len,
        })?;
        let mut options = MmapOptions::new();
        options.offset(offset).len(map_len);
        let mapped = match mode {
            // SAFETY: the caller promises the file is neither truncated nor (while borrowed)
            // written; the length was checked against the file's size above.
            MapMode::ReadOnly => unsafe { options.map(&file) }.map(Mapping::Read),
            // SAFETY: as above; the file was opened read-write.
            MapMode::Shared => unsafe { options.map_mut(&file) }.map(Mapping::Write),
            // SAFETY: as above; MAP_PRIVATE keeps our writes away from the file.
            MapMode::Private => unsafe { options.map_copy(&file) }.map(Mapping::Write),
        }
        .map_err(|e| Error::io("mmap", Some(path.into()), e))?;
        Ok(FileMap {
            mapping: mapped,
            file,
            path: path.into(),
            offset,
            mode,
            identity,
        })
    }

    /// The mapped bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.mapping {
            Mapping::Read(m) => m,
            Mapping::Write(m) => m,
        }
    }

    /// The mapped bytes for writing; `None` for a [`MapMode::ReadOnly`] mapping.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        match &mut self.mapping {
            Mapping::Read(_) => None,
            Mapping::Write(m) => Some(m),
        }
    }

    /// First mapped byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.as_slice().as_ptr()
    }

    /// Number of mapped bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Always false: empty mappings are refused at construction.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The file's offset of the first mapped byte.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// How the file is mapped.
    pub fn mode(&self) -> MapMode {
        self.mode
    }

    /// The path the file was opened by.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open file under the mapping.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The file's identity when it was mapped.
    pub fn identity(&self) -> FileIdentity {
        self.identity
    }

    /// Checks that the mapped file still has the identity it had when mapped (same inode,
    /// size and mtime).
    ///
    /// # Errors
    /// [`Error::FileChanged`] saying what changed.
    pub fn verify_unchanged(&self) -> Result<()> {
        let now = FileIdentity::of(&self.file)?;
        match self.identity.difference(&now) {
            None => Ok(()),
            Some(what) => Err(Error::FileChanged {
                path: self.path.clone(),
                what,
            }),
        }
    }

    /// Faults every page of the mapping in now (`MADV_POPULATE_READ`), reading the file from
    /// disk where it is not cached, so that later accesses take no page faults. On kernels
    /// before 5.14 it touches one byte per page instead.
    pub fn populate(&self) -> Result<()> {
        populate_read(self.as_slice())
    }

    /// Advises the kernel how the mapping will be accessed; see [`advise::madvise`].
    pub fn advise(&self, advice: MemAdvice) -> Result<()> {
        advise::madvise(self.as_ptr(), self.len(), advice)
    }

    /// Locks the mapping's pages into RAM (reading them in first); see [`lock::mlock`].
    pub fn lock(&self) -> Result<LockedRegion<'_>> {
        lock::mlock(self.as_slice())
    }

    /// Writes changes of a [`MapMode::Shared`] mapping back to the file (`msync`); a no-op
    /// for the other modes.
    pub fn flush(&self) -> Result<()> {
        match (&self.mapping, self.mode) {
            (Mapping::Write(m), MapMode::Shared) => m
                .flush()
                .map_err(|e| Error::io("msync", Some(self.path.clone()), e)),
            _ => Ok(()),
        }
    }
}

impl std::ops::Deref for FileMap {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

/// Many files mapped read-only (`PROT_READ`, `MAP_SHARED`: the page cache itself) side by
/// side in one range of address space, each from a page boundary of the range, in the order
/// given. One `cuMemHostRegister` of [`FilesMap::as_ptr`]..+[`FilesMap::len`] page-locks them
/// all, so a GPU kernel can gather any of them over the bus (gpufeed-data's `gpu_gather` for an
/// `ImageFolder`).
///
/// Each file takes its size rounded up to whole pages; the bytes between its end and the next
/// page boundary read as zero (the kernel's rule for a mapping's last page). Empty files take no
/// space. Each non-empty file is one mapping of the kernel's (`vm.max_map_count`, 65,530 by
/// default, bounds how many a process holds). The descriptors are closed once mapped.
///
/// # Example
/// ```
/// use gpufeed_os::map::FilesMap;
/// # let dir = tempfile::tempdir()?;
/// let (a, b) = (dir.path().join("a"), dir.path().join("b"));
/// std::fs::write(&a, b"first")?;
/// std::fs::write(&b, b"second file")?;
/// // SAFETY: the files are ours and nobody truncates or writes them while they are mapped.
/// let files = unsafe { FilesMap::open([(a.as_path(), 5), (b.as_path(), 11)])? };
/// assert_eq!(files.file(1), Some(&b"second file"[..]));
/// assert_eq!(files.offset_of(1), Some(gpufeed_os::page_size()));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct FilesMap {
    /// Start of the range (page-aligned); dangling when `len` is 0.
    base: std::ptr::NonNull<u8>,
    /// Bytes of the range: the files' sizes, each rounded up to whole pages.
    len: usize,
    /// Each file's offset in the range and its size.
    files: Vec<(usize, usize)>,
    /// Bytes of the files on file systems held in memory (tmpfs, ramfs).
    in_memory: u64,
}

// SAFETY: the range is mapped read-only and only read (through `&[u8]`s whose stability the
// constructor's caller vouches for); unmapping happens once, in `Drop`, with `&mut self`.
unsafe impl Send for FilesMap {}
// SAFETY: as above.
unsafe impl Sync for FilesMap {}

impl std::fmt::Debug for FilesMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FilesMap")
            .field("base", &self.base)
            .field("len", &self.len)
            .field("files", &self.files.len())
            .finish()
    }
}

impl FilesMap {
    /// Maps each `(path, size)` of `files`, where `size` is the file's size as the caller
    /// listed it: a file of another size now is [`Error::FileChanged`] (naming it), since
    /// the caller's offsets would be wrong.
    ///
    /// # Safety
    /// As for [`FileMap::open`], for every file: none is truncated while the map lives, and
    /// none is written while a slice of it is borrowed.
    ///
    /// # Errors
    /// [`FileMap::open`]'s for each file ([`Error::NotFound`], [`Error::NotRegularFile`], ...),
    /// [`Error::FileChanged`], [`Error::Unsupported`] where the files would leave the process
    /// fewer than [`MAP_COUNT_MARGIN`] of the mappings `vm.max_map_count` allows (past the
    /// limit, every later `mmap`, thread stack or large allocation of the process fails), and
    /// [`Error::Io`] from `mmap` (no address range of their summed size is free). Nothing stays
    /// mapped after an error.
    pub unsafe fn open<'p>(files: impl IntoIterator<Item = (&'p Path, u64)>) -> Result<Self> {
        use rustix::mm::{MapFlags, ProtFlags};
        let page = crate::page_size();
        let files: Vec<(&Path, u64)> = files.into_iter().collect();
        let mappings = files.iter().filter(|&&(_, size)| size > 0).count();
        if let (Ok(limit), Ok(used)) = (max_map_count(), mappings_in_use()) {
            check_map_count(mappings, used, limit)?;
        }
        let mut placed = Vec::with_capacity(files.len());
        let mut len = 0usize;
        for &(path, size) in &files {
            let size = usize::try_from(size).map_err(|_| Error::Unsupported {
                what: "FilesMap",
                reason: format!("{} is larger than the address space", path.display()),
            })?;
            placed.push((len, size));
            len = size
                .checked_next_multiple_of(page)
                .and_then(|s| len.checked_add(s))
                .ok_or_else(|| Error::Unsupported {
                    what: "FilesMap",
                    reason: "the files' summed size is larger than the address space".into(),
                })?;
        }
        let mut map = FilesMap {
            base: std::ptr::NonNull::dangling(),
            len: 0,
            files: placed,
            in_memory: 0,
        };
        if len == 0 {
            return Ok(map);
        }
        // SAFETY: a new anonymous range, inaccessible (PROT_NONE) and reserving no memory,
        // placed by the kernel where nothing else is mapped; the files replace it below.
        let reserved = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| Error::io("mmap (reserving the files' range)", None, e))?;
        map.base = std::ptr::NonNull::new(reserved.cast::<u8>()).ok_or_else(|| Error::Io {
            op: "mmap (reserving the files' range)",
            path: None,
            source: std::io::Error::other("the kernel returned a null address"),
        })?;
        // From here on, dropping `map` unmaps whatever was mapped (the whole range).
        map.len = len;
        for (&(path, listed), &(offset, size)) in files.iter().zip(&map.files) {
            if size == 0 {
                continue;
            }
            let (file, identity, f_type) = crate::file::open_regular_on(path, false)?;
            if identity.size != listed {
                return Err(Error::FileChanged {
                    path: path.into(),
                    what: format!("size {listed} when listed, {} now", identity.size),
                });
            }
            if f_type.is_some_and(crate::file::in_memory_fs) {
                map.in_memory += listed;
            }
            // SAFETY: the address lies inside the range reserved above and owned by `map`,
            // with `size` rounded up to pages of it left from `offset` (the placement above);
            // MAP_FIXED replaces only that part of our own reservation. The caller promises
            // the file is not truncated while mapped.
            unsafe {
                rustix::mm::mmap(
                    map.base.as_ptr().add(offset).cast(),
                    size,
                    ProtFlags::READ,
                    MapFlags::SHARED | MapFlags::FIXED,
                    &file,
                    0,
                )
            }
            .map_err(|e| {
                // A failed MAP_FIXED may already have unmapped this file's part of the
                // reservation (older kernels), and another thread may have mapped something
                // there since: only the parts on either side, still ours, are unmapped; this
                // part's address space is left to whoever holds it.
                let slot = size.next_multiple_of(page);
                // SAFETY: both ranges lie in the reservation `map` owns and that nothing else
                // was mapped over (only this thread maps into it, part by part).
                unsafe {
                    let base = map.base.as_ptr();
                    let _ = rustix::mm::munmap(base.cast(), offset);
                    let _ =
                        rustix::mm::munmap(base.add(offset + slot).cast(), map.len - offset - slot);
                }
                map.len = 0;
                Error::io("mmap", Some(path.into()), e)
            })?;
        }
        Ok(map)
    }

    /// Bytes of the files on file systems held in memory (tmpfs such as `/dev/shm`, ramfs):
    /// memory they take already, whether or not they are mapped or page-locked.
    pub fn in_memory_bytes(&self) -> u64 {
        self.in_memory
    }

    /// Start of the range (page-aligned; dangling when no file has a byte).
    pub fn as_ptr(&self) -> *const u8 {
        self.base.as_ptr()
    }

    /// Bytes of the range: every file's size rounded up to whole pages.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No file has a byte (nothing is mapped).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of files (empty ones included).
    pub fn files(&self) -> usize {
        self.files.len()
    }

    /// Where file `i` starts in the range (a multiple of the page size).
    pub fn offset_of(&self, i: usize) -> Option<usize> {
        self.files.get(i).map(|&(offset, _)| offset)
    }

    /// The bytes of file `i`.
    pub fn file(&self, i: usize) -> Option<&[u8]> {
        let &(offset, size) = self.files.get(i)?;
        if size == 0 {
            return Some(&[]);
        }
        // SAFETY: `offset..offset + size` lies in the range, mapped read-only from the file
        // of this size until `self` drops; the constructor's caller promised it is neither
        // truncated nor written while borrowed.
        Some(unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(offset), size) })
    }
}

/// Mappings [`FilesMap::open`] leaves free under `vm.max_map_count` (or a tenth of it, where
/// that is more) for the rest of the process: its allocations, thread stacks, libraries, and
/// the CUDA driver's own mappings.
pub const MAP_COUNT_MARGIN: usize = 8192;

/// Whether `mappings` more fit under `limit` beside the `used` ones, with the margin left.
fn check_map_count(mappings: usize, used: usize, limit: usize) -> Result<()> {
    let margin = MAP_COUNT_MARGIN.max(limit / 10);
    let needed = used
        .checked_add(mappings)
        .and_then(|n| n.checked_add(margin));
    if needed.is_none_or(|n| n > limit) {
        return Err(Error::Unsupported {
            what: "FilesMap",
            reason: format!(
                "{mappings} files take a mapping each; this process has {used} of the {limit} vm.max_map_count allows and keeps {margin} free for the rest of its work: raise vm.max_map_count (sysctl) or map fewer files"
            ),
        });
    }
    Ok(())
}

/// `vm.max_map_count`: the most mappings a process may hold.
fn max_map_count() -> Result<usize> {
    let path = "/proc/sys/vm/max_map_count";
    std::fs::read_to_string(path)
        .map_err(|e| Error::io("read", Some(path.into()), e))?
        .trim()
        .parse()
        .map_err(|e| Error::io("parse", Some(path.into()), std::io::Error::other(e)))
}

/// Mappings this process holds now (the lines of `/proc/self/maps`).
fn mappings_in_use() -> Result<usize> {
    let path = "/proc/self/maps";
    let maps = std::fs::read(path).map_err(|e| Error::io("read", Some(path.into()), e))?;
    Ok(maps.iter().filter(|&&b| b == b'\n').count())
}

impl Drop for FilesMap {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: the range was reserved by `open` and is unmapped once, here; no slice of it
        // outlives `self` (they borrow it).
        if let Err(e) = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) } {
            tracing::warn!("unmapping {} bytes of mapped files: {e}", self.len);
        }
    }
}

/// Faults in every page of `region` readable: `MADV_POPULATE_READ`, or one read per page on
/// kernels that lack it.
pub(crate) fn populate_read(region: &[u8]) -> Result<()> {
    match advise::madvise(region.as_ptr(), region.len(), MemAdvice::PopulateRead) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            let page = crate::page_size();
            let mut sum = 0u8;
            for i in (0..region.len()).step_by(page) {
                sum ^= region[i];
            }
            std::hint::black_box(sum);
            Ok(())
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Files that would leave fewer than the margin (8,192, or a tenth of the limit) of
    /// `vm.max_map_count` free are refused with the counts and the fix; fewer are not.
    #[test]
    fn files_past_the_map_count_margin_are_refused() {
        check_map_count(50_000, 2_000, 65_530).expect("13,530 left");
        let err = check_map_count(56_000, 2_000, 65_530).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("56000 files") && text.contains("65530") && text.contains("sysctl"),
            "{text}"
        );
        check_map_count(55_000, 2_000, 65_530).expect("8,530 left");
        // A tenth of a large limit.
        check_map_count(1_000_000, 0, 1_000_000).unwrap_err();
        check_map_count(899_000, 1_000, 1_000_000).expect("a tenth left");
        check_map_count(usize::MAX, 1, usize::MAX).unwrap_err();
    }
}
