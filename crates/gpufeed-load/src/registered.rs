//! A file kept page-locked for repeated loads: [`RegisteredFile`].
//!
//! A staged load copies every byte on the host (page cache -> pinned staging) before the GPU
//! reads it, and a registered load pays for the registration (~40 ms per GiB on the H200
//! machine) on every call. Where the same file is loaded from again and again — tensors loaded
//! on demand from a checkpoint, ranges of a record file, a small file reloaded — register it
//! once and every later load is one copy by the GPU straight out of the page cache: no host
//! copy, no registration, no thread woken.

use std::ops::Range;
use std::path::Path;
use std::time::Instant;

use gpufeed_cuda::HostSource;
use gpufeed_os::{FileMap, OpenedFile};
use gpufeed_pinned::HostRegistration;

use crate::error::{Error, Result};
use crate::loader::Loader;
use crate::options::{DeviceBuffer, LoadReport, Strategy};
use crate::route::fits;

/// A file whose pages stay in the page cache, page-locked and registered with CUDA, until the
/// value is dropped: any [`Loader`] (of any GPU: the registration is portable) then loads
/// ranges of it with one copy by the GPU, at the speed of the link from the smallest sizes
/// up.
///
/// Registering reads what is not cached yet and costs about 40 ms per GiB on the H200
/// machine (0.2-0.4 ms for 1 MiB); the pages cannot be reclaimed while registered, so
/// register the files you load from often, not a data set larger than memory.
///
/// The file must not change while registered: every load checks its identity (inode, size,
/// modification time; of the mapped file and of what its path names now, so a file replaced
/// by a rename is noticed too) before and after the copy and answers
/// [`Error::RegisteredFileChanged`] when it moved (the pages kept may no longer be the
/// file's; register it again). Nothing reads the mapping on the CPU after registration, so a
/// file truncated meanwhile cannot raise `SIGBUS` here.
///
/// # Example
/// ```no_run
/// let loader = gpufeed_load::Loader::open(0, gpufeed_load::LoadOptions::default())?;
/// let file = gpufeed_load::RegisteredFile::open(&loader, "model.safetensors")?;
/// // Each later load is one copy out of the page cache.
/// let (head, report) = loader.load_registered(&file, 0..1 << 20)?;
/// println!("{} bytes in {:.0} us", head.len(), report.seconds * 1e6);
/// # Ok::<(), gpufeed_load::Error>(())
/// ```
pub struct RegisteredFile {
    // Declared before `map`: unregistered before the mapping goes.
    registration: Option<HostRegistration<'static>>,
    map: Option<FileMap>,
    path: std::path::PathBuf,
    len: u64,
    seconds: f64,
}

impl std::fmt::Debug for RegisteredFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredFile")
            .field("path", &self.path)
            .field("len", &self.len)
            .field("seconds", &self.seconds)
            .finish()
    }
}

impl RegisteredFile {
    /// Maps `path` read-only and registers the mapping with `loader`'s CUDA context (portable:
    /// every context of the process may copy from it).
    ///
    /// # Errors
    /// A missing file, a directory or another non-regular file (`gpufeed_os::Error`); the
    /// registration refused (`gpufeed_pinned::Error`: no driver, not permitted); no GPU.
    pub fn open(loader: &Loader, path: impl AsRef<Path>) -> Result<Self> {
        Self::of_opened(loader, &OpenedFile::open(path)?)
    }

    /// [`RegisteredFile::open`] of a file already opened (its header read through the same
    /// descriptor): mapped through a duplicate of it, never by the path again.
    ///
    /// # Errors
    /// As for [`RegisteredFile::open`].
    #[allow(
        unsafe_code,
        reason = "maps the file and registers the mapping; see below"
    )]
    pub fn of_opened(loader: &Loader, file: &OpenedFile) -> Result<Self> {
        let (path, started) = (file.path(), Instant::now());
        let len = file.len();
        if len == 0 {
            return Ok(RegisteredFile {
                registration: None,
                map: None,
                path: path.into(),
                len,
                seconds: started.elapsed().as_secs_f64(),
            });
        }
        // SAFETY: a file truncated while mapped raises SIGBUS only where the CPU touches the
        // lost pages; the CPU touches the mapping only inside cuMemHostRegister (which faults
        // the pages in and fails cleanly on a page past the end), and the GPU reads the pages
        // the registration holds, which stay allocated whatever happens to the file. Loads
        // check the file's identity (see the type's docs).
        let map = unsafe { FileMap::of_opened(file, 0, len)? };
        // SAFETY: `map` stays mapped until the registration is dropped (field order above,
        // and `Drop` below); the mapping is read-only and registered read-only.
        let registration = unsafe {
            HostRegistration::register(loader.gpu.context(), map.as_ptr(), map.len(), true)?
        };
        Ok(RegisteredFile {
            registration: Some(registration),
            map: Some(map),
            path: path.into(),
            len,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its length in bytes when registered.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The identity of the file as mapped (`None` for an empty file, which is not mapped).
    pub fn identity(&self) -> Option<gpufeed_os::FileIdentity> {
        self.map.as_ref().map(FileMap::identity)
    }

    /// Seconds the mapping and the registration took.
    pub fn seconds(&self) -> f64 {
        self.seconds
    }

    /// [`Error::RegisteredFileChanged`] where the file changed since it was registered: the
    /// mapped file written or truncated (its descriptor's identity), or the path naming
    /// another file now (replaced by a rename, as a crash-safe save does) or none.
    fn verify_unchanged(&self) -> Result<()> {
        let Some(map) = &self.map else {
            return Ok(());
        };
        let changed = |what: String| {
            Err(Error::RegisteredFileChanged {
                path: self.path.clone(),
                what,
            })
        };
        match map.verify_unchanged() {
            Ok(()) => {}
            Err(gpufeed_os::Error::FileChanged { what, .. }) => return changed(what),
            Err(e) => return Err(e.into()),
        }
        match gpufeed_os::FileIdentity::of_path(&self.path) {
            Ok(now) => match map.identity().difference(&now) {
                Some(what) => changed(what),
                None => Ok(()),
            },
            Err(e) => changed(format!("the path names no file now: {e}")),
        }
    }

    fn check_range(&self, range: &Range<u64>) -> Result<()> {
        if range.start > range.end || range.end > self.len {
            return Err(gpufeed_os::Error::RangePastEof {
                path: self.path.clone(),
                offset: range.start,
                len: range.end.saturating_sub(range.start),
                file_len: self.len,
            }
            .into());
        }
        Ok(())
    }
}

impl Drop for RegisteredFile {
    fn drop(&mut self) {
        // Unregister (every copy from it completed: loads synchronize) before unmapping.
        drop(self.registration.take());
        drop(self.map.take());
    }
}

impl Loader {
    /// Registers `path` for repeated loads: [`RegisteredFile::open`] with this loader's
    /// context.
    ///
    /// # Errors
    /// [`RegisteredFile::open`]'s.
    pub fn register_file(&self, path: impl AsRef<Path>) -> Result<RegisteredFile> {
        RegisteredFile::open(self, path)
    }

    /// Loads bytes `range` of a registered file into new GPU memory: one copy by the GPU out
    /// of the page cache, no host copy.
    ///
    /// # Errors
    /// A range past the end of the file as registered; [`Error::RegisteredFileChanged`];
    /// CUDA errors.
    pub fn load_registered(
        &self,
        file: &RegisteredFile,
        range: Range<u64>,
    ) -> Result<(DeviceBuffer, LoadReport)> {
        let started = Instant::now();
        file.check_range(&range)?;
        let len = (range.end - range.start) as usize;
        self.gpu.alloc_filled(len, self.device_alloc(len), |dst| {
            self.copy_registered(file, range, dst, 0, started)
        })
    }

    /// Loads bytes `range` of a registered file into `dst` starting at `dst_offset`.
    ///
    /// # Errors
    /// [`Loader::load_registered`]'s, and a destination too small.
    pub fn load_registered_into(
        &self,
        file: &RegisteredFile,
        range: Range<u64>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
    ) -> Result<LoadReport> {
        let started = Instant::now();
        file.check_range(&range)?;
        let len = range.end - range.start;
        // Nothing to load needs no room, as with `load_into`.
        let at = if len == 0 { 0 } else { dst_offset };
        fits(len, at, dst.len())?;
        self.copy_registered(file, range, dst, at, started)
    }

    fn copy_registered(
        &self,
        file: &RegisteredFile,
        range: Range<u64>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
        started: Instant,
    ) -> Result<LoadReport> {
        let len = range.end - range.start;
        let mut report =
            LoadReport::before(file.path.clone(), Strategy::Registered, len, Some(1.0));
        report.reason =
            "from a registered file (RegisteredFile): one copy out of the page cache".into();
        if let Some(registration) = file.registration.as_ref().filter(|_| len > 0) {
            file.verify_unchanged()?;
            self.sched.upload(
                HostSource::RegisteredRange {
                    registration,
                    offset: range.start as usize,
                    len: len as usize,
                },
                dst,
                dst_offset,
            )?;
            // A change during the copy may have mixed versions: drop what was loaded.
            file.verify_unchanged()?;
        }
        report.seconds = started.elapsed().as_secs_f64();
        Ok(report)
    }
}
