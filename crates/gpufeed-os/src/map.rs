//! Memory mappings of files: read-only, shared (read-write) and private (copy-on-write).
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
