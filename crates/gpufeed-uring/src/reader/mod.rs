//! The reader: files, read requests, and the one read-exact state machine of every backend.

mod buffers;
mod builder;
mod session;

use buffers::Borrowed;
pub use buffers::{Completion, IoBufMut, ReadOp};
pub use builder::{Direct, ReaderBuilder};
use session::Session;

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};

use gpufeed_os::{AlignedBuf, Fallback, Refused};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::probe::BackendKind;

/// A file opened by a [`Reader`]: valid until [`Reader::close`] (a closed file's id is refused
/// with [`Error::InvalidRequest`], also after its slot was given to another file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId {
    /// Index in the reader's table of open files (and the ring's registered files).
    slot: u32,
    /// Which opening of that slot.
    generation: u32,
}

/// How one file is read, as recorded in [`ReadStats`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileReport {
    /// The path.
    pub path: PathBuf,
    /// Whether reads use `O_DIRECT`.
    pub direct: bool,
    /// Why `O_DIRECT` is not used where [`Direct::Auto`] or the file system decided so.
    pub reason: Option<String>,
}

/// What a [`Reader`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadStats {
    /// The backend that ran.
    pub backend: BackendKind,
    /// Bytes delivered by completed requests.
    pub bytes: u64,
    /// Seconds spent in read sessions (first submission to last completion).
    pub seconds: f64,
    /// Reads that came back short and were resubmitted for the rest.
    pub short_reads: u64,
    /// Reads retried after EINTR, EAGAIN or EBUSY.
    pub retries: u64,
    /// Bounce buffers registered with the ring ([`ReaderBuilder::register_buffers`]).
    pub registered_buffers: usize,
    /// The files open now (in the order they were opened), direct or buffered, and why; a
    /// file's entry goes when [`Reader::close`] closes it.
    pub files: Vec<FileReport>,
    /// Slower paths taken: what was refused, why, and what ran instead.
    pub fallbacks: Vec<Fallback>,
}

impl ReadStats {
    /// Throughput in GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        gpufeed_os::gbps(self.bytes, self.seconds)
    }
}

#[derive(Debug)]
struct OpenFile {
    file: File,
    path: PathBuf,
    /// Its size when opened (the open's own `fstat`).
    len: u64,
    direct: Option<(u32, u32)>,
    fixed: Option<u32>,
    generation: u32,
    /// Read on the calling thread, not through the engine
    /// ([`ReaderBuilder::inline_memory_files`]).
    inline: bool,
}

impl OpenFile {
    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// Reads byte ranges of files into caller buffers through io_uring or a thread pool.
///
/// # Example
/// ```
/// use gpufeed_uring::{ReadOp, Reader};
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("data.bin");
/// std::fs::write(&path, vec![7u8; 3 << 20])?;
/// let mut reader = Reader::builder().queue_depth(8).build()?;
/// let file = reader.open(&path)?;
/// let ops = (0..3).map(|i| ReadOp::new(file, i << 20, vec![0u8; 1 << 20]).user_data(i));
/// reader.read_all(ops, |done| {
///     assert_eq!(done.result.unwrap(), 1 << 20);
///     assert!(done.buf.iter().all(|&b| b == 7));
/// })?;
/// println!("{:.2} GB/s with {}", reader.stats().gbps(), reader.stats().backend);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Reader {
    engine: Box<dyn Engine>,
    /// Open files by slot; closed slots are `None` and reused by the next `open`.
    files: Vec<Option<OpenFile>>,
    /// The slot of each entry of `stats.files`.
    reported: Vec<u32>,
    /// Openings so far: the next file's generation.
    opened: u32,
    bounce_free: Vec<Bounce>,
    bounce_made: usize,
    /// Bumped by every session and carried in the high half of every tag, so a completion of
    /// an earlier session can never be taken for one of the current session.
    session_gen: u32,
    stats: ReadStats,
    cfg: ReaderBuilder,
}

/// A bounce buffer, with its index when registered with the ring.
#[derive(Debug)]
struct Bounce {
    buf: AlignedBuf,
    index: Option<u16>,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("backend", &self.stats.backend)
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

/// Retries of one read after EINTR/EAGAIN/EBUSY before giving up.
const MAX_RETRIES: u32 = 1000;

impl Reader {
    /// A builder with the defaults: queue depth 32, 1 MiB blocks, `Direct::Auto`,
    /// `Backend::Auto`.
    pub fn builder() -> ReaderBuilder {
        ReaderBuilder::default()
    }

    /// What this reader did so far.
    pub fn stats(&self) -> &ReadStats {
        &self.stats
    }

    /// The backend that runs.
    pub fn backend(&self) -> BackendKind {
        self.stats.backend
    }

    /// Opens `path` for reading, with or without `O_DIRECT` as configured.
    ///
    /// # Errors
    /// `NotFound`, `IsDirectory`, `NotRegularFile` (as [`Error::Os`]), and
    /// [`Error::DirectUnsupported`] for [`Direct::On`] on a file system that refuses it.
    pub fn open(&mut self, path: impl AsRef<Path>) -> Result<FileId> {
        let opened = gpufeed_os::OpenedFile::open(path)?;
        self.open_opened(&opened)
    }

    /// [`Reader::open`] of a file already opened ([`gpufeed_os::OpenedFile`]: a load that
    /// opened its file once): buffered reads go through a duplicate of its descriptor, and an
    /// `O_DIRECT` descriptor is opened through `/proc/thread-self/fd` ([`gpufeed_os::OpenedFile::reopen`]), so the path is never looked up
    /// again and every read is of the file opened.
    ///
    /// # Errors
    /// As for [`Reader::open`].
    pub fn open_opened(&mut self, opened: &gpufeed_os::OpenedFile) -> Result<FileId> {
        let file = opened.duplicate()?;
        let (file, direct, reason) = self.choose_direct(opened, file)?;
        let inline = self.cfg.inline_memory_files && direct.is_none() && opened.in_memory();
        self.admit(
            opened.path(),
            file,
            opened.len(),
            direct,
            reason,
            true,
            inline,
        )
    }

    /// [`Reader::open`] of a file read once and closed soon after (a batch of small files):
    /// with [`Direct::Off`] its descriptor is the reader's own (no duplicate of another) and
    /// is not registered with the ring, four system calls fewer per file than
    /// [`Reader::open`] (a duplicate and its close, the registration and its removal;
    /// `gpufeed_load::internal::read_parts` opened and closed a file with ten). With O_DIRECT
    /// possible it is [`Reader::open`].
    ///
    /// # Errors
    /// As for [`Reader::open`].
    pub fn open_brief(&mut self, path: impl AsRef<Path>) -> Result<FileId> {
        if self.cfg.direct != Direct::Off {
            return self.open(path);
        }
        let path = path.as_ref();
        let (file, identity, f_type) = gpufeed_os::file::open_regular_on(path, false)?;
        let inline =
            self.cfg.inline_memory_files && f_type.is_some_and(gpufeed_os::file::in_memory_fs);
        self.admit(
            path,
            file,
            identity.size,
            None,
            Some("Direct::Off".into()),
            false,
            inline,
        )
    }

    /// Puts `file` in a free slot (registered with the ring where `register` and the engine
    /// registers files; read on the calling thread where `inline`) and reports it.
    #[allow(
        clippy::too_many_arguments,
        reason = "one private constructor of an OpenFile"
    )]
    fn admit(
        &mut self,
        path: &Path,
        file: File,
        len: u64,
        direct: Option<(u32, u32)>,
        reason: Option<String>,
        register: bool,
        inline: bool,
    ) -> Result<FileId> {
        let slot = match self.files.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                self.files.push(None);
                self.files.len() - 1
            }
        };
        let slot = u32::try_from(slot)
            .map_err(|_| Error::InvalidRequest("more than 2^32 files open".into()))?;
        let fixed = if register {
            self.engine.register_file(slot, file.as_raw_fd())
        } else {
            None
        };
        let generation = self.opened;
        self.opened = self.opened.wrapping_add(1);
        self.stats.files.push(FileReport {
            path: path.into(),
            direct: direct.is_some(),
            reason,
        });
        self.reported.push(slot);
        self.files[slot as usize] = Some(OpenFile {
            file,
            path: path.into(),
            len,
            direct,
            fixed,
            generation,
            inline,
        });
        Ok(FileId { slot, generation })
    }

    /// The size `file` had when this reader opened it (from the open's own `fstat`): a caller
    /// that listed files before can tell one that grew or shrank since, at no cost.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an id this reader did not open or already closed.
    pub fn len_at_open(&self, file: FileId) -> Result<u64> {
        self.files
            .get(file.slot as usize)
            .and_then(Option::as_ref)
            .filter(|f| f.generation == file.generation)
            .map(|f| f.len)
            .ok_or_else(|| Error::InvalidRequest("a file id this reader has not opened".into()))
    }

    /// Closes `file` (and drops the ring's reference to it): a reader kept for many files
    /// (a loader's, reading one file per call) closes each when done. Its id is refused from
    /// now on; its slot goes to the next file opened.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an id this reader did not open or already closed.
    pub fn close(&mut self, file: FileId) -> Result<()> {
        self.file(file)?;
        let open = self.files[file.slot as usize].take();
        if let Some(fixed) = open.as_ref().and_then(|f| f.fixed) {
            self.engine.unregister_file(fixed);
        }
        if let Some(i) = self.reported.iter().position(|&s| s == file.slot) {
            self.reported.remove(i);
            self.stats.files.remove(i);
        }
        Ok(())
    }

    /// The open file in `slot`, which a session validated when it admitted the read (files
    /// cannot close while a session borrows the reader).
    fn open_at(&self, slot: u32) -> &OpenFile {
        self.files[slot as usize]
            .as_ref()
            .expect("a session reads only files it validated, which stay open while it runs")
    }

    /// Decides O_DIRECT for one file: returns the file to read, its (offset, memory)
    /// alignment when direct, and why not when not.
    fn choose_direct(
        &self,
        opened: &gpufeed_os::OpenedFile,
        buffered: File,
    ) -> Result<DirectChoice> {
        let path = opened.path();
        if self.cfg.direct == Direct::Off {
            return Ok((buffered, None, Some("Direct::Off".into())));
        }
        let dio = gpufeed_os::align::dio_alignment(&buffered)?;
        let refuse = |reason: String| -> Result<DirectChoice> {
            Err(Error::DirectUnsupported {
                path: path.into(),
                reason,
            })
        };
        if !dio.supported() {
            let why = "the file system reports no O_DIRECT support (statx DIOALIGN = 0)".to_owned();
            return if self.cfg.direct == Direct::On {
                refuse(why)
            } else {
                Ok((buffered, None, Some(why)))
            };
        }
        if self.cfg.direct == Direct::Auto {
            let r = gpufeed_os::cache::residency_of(&buffered)?;
            if r.fraction() > 0.5 {
                return Ok((
                    buffered,
                    None,
                    Some(format!(
                        "{:.0}% in the page cache: buffered reads serve it from memory",
                        r.fraction() * 100.0
                    )),
                ));
            }
        }
        let opened = if self
            .cfg
            .fault
            .as_ref()
            .is_some_and(|f| f.direct_open_einval)
        {
            Err(io::Error::from_raw_os_error(libc::EINVAL))
        } else {
            opened.reopen(libc::O_DIRECT)
        };
        match opened {
            Ok(direct) => {
                let block = self.cfg.block_bytes;
                if !block.is_multiple_of(dio.offset_align as usize) {
                    return Err(Error::InvalidRequest(format!(
                        "block_bytes {block} is not a multiple of the O_DIRECT alignment {} of {}",
                        dio.offset_align,
                        path.display()
                    )));
                }
                Ok((direct, Some((dio.offset_align, dio.mem_align.max(1))), None))
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let why =
                    "open with O_DIRECT returned EINVAL (the file system refuses it)".to_owned();
                if self.cfg.direct == Direct::On {
                    refuse(why)
                } else {
                    tracing::warn!(path = %path.display(), "{why}; reading buffered");
                    Ok((buffered, None, Some(why)))
                }
            }
            Err(e) => Err(gpufeed_os::Error::open(path, e).into()),
        }
    }

    /// The path `file` was opened by.
    pub fn path(&self, file: FileId) -> Option<&Path> {
        self.file(file).ok().map(|f| f.path.as_path())
    }

    /// Whether `file` is read with `O_DIRECT`.
    pub fn is_direct(&self, file: FileId) -> Option<bool> {
        self.file(file).ok().map(|f| f.direct.is_some())
    }

    /// Starts reading `[offset, offset + len)` of `file` into the page cache without waiting
    /// (`IORING_OP_FADVISE(WILLNEED)` on io_uring, `readahead(2)` on threads).
    pub fn prefetch(&mut self, file: FileId, offset: u64, len: u64) -> Result<()> {
        let f = self.file(file)?;
        let (fd, path) = (f.fd(), f.path.clone());
        self.engine
            .prefetch(fd, offset, len)
            .map_err(|source| Error::Read {
                path,
                offset,
                source,
            })
    }

    fn file(&self, file: FileId) -> Result<&OpenFile> {
        self.files
            .get(file.slot as usize)
            .and_then(Option::as_ref)
            .filter(|f| f.generation == file.generation)
            .ok_or_else(|| {
                Error::InvalidRequest(format!(
                    "{file:?} is not open in this reader (never opened by it, or closed)"
                ))
            })
    }

    /// Reads exactly `buf.len()` bytes of `file` at `offset` into `buf`.
    ///
    /// # Errors
    /// [`Error::UnexpectedEof`] when the file ends first; [`Error::Read`] for a failed read.
    pub fn read_exact_at(&mut self, file: FileId, offset: u64, buf: &mut [u8]) -> Result<()> {
        let op = ReadOp::new(
            file,
            offset,
            Borrowed {
                ptr: buf.as_mut_ptr(),
                len: buf.len(),
            },
        );
        // The session drains every read into `buf` before it is dropped, so `buf` outlives
        // them also when this function unwinds.
        let mut session = Session::new(self, std::iter::once(op));
        let done = session.next().expect("one request gives one completion")?;
        done.result.map(drop)
    }

    /// Reads each `(file, offset, buf)` exactly (all of `buf` from `offset` of `file`), with up
    /// to the queue depth in flight: many small files, or scattered ranges, in one batch.
    ///
    /// # Errors
    /// The first failed read's ([`Error::UnexpectedEof`] naming the file, [`Error::Read`]);
    /// every read was completed or waited for before this returns.
    ///
    /// # Example
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// # let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    /// # std::fs::write(&a, b"first file")?;
    /// # std::fs::write(&b, b"second")?;
    /// let mut reader = gpufeed_uring::Reader::builder().build()?;
    /// let (fa, fb) = (reader.open(&a)?, reader.open(&b)?);
    /// let mut out = [0u8; 16];
    /// let (x, y) = out.split_at_mut(10);
    /// reader.read_exact_many([(fa, 0, x), (fb, 0, &mut y[..6])])?;
    /// assert_eq!(&out, b"first filesecond");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn read_exact_many<'a>(
        &mut self,
        reads: impl IntoIterator<Item = (FileId, u64, &'a mut [u8])>,
    ) -> Result<()> {
        let ops = reads.into_iter().map(|(file, offset, buf)| {
            ReadOp::new(
                file,
                offset,
                Borrowed {
                    ptr: buf.as_mut_ptr(),
                    len: buf.len(),
                },
            )
        });
        // The session drains every read into the borrowed buffers before it is dropped, also
        // when this function returns early or unwinds; the buffers outlive the call.
        let mut first_error = None;
        for done in Session::new(self, ops) {
            if let Err(e) = done.and_then(|c| c.result) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Carries out `ops`, keeping the queue full, and calls `on_complete` for each request as
    /// it completes (in completion order). Per-request failures are in
    /// [`Completion::result`]; the returned error is for a failure of the backend itself.
    pub fn read_all<B, I>(
        &mut self,
        ops: I,
        mut on_complete: impl FnMut(Completion<B>),
    ) -> Result<()>
    where
        B: IoBufMut,
        I: IntoIterator<Item = ReadOp<B>>,
    {
        for done in Session::new(self, ops.into_iter()) {
            on_complete(done?);
        }
        Ok(())
    }

    /// Like [`Reader::read_all`], as an iterator of completions. Dropping the iterator early
    /// waits for the reads in flight (their buffers are dropped after).
    pub fn reads<B, I>(&mut self, ops: I) -> impl Iterator<Item = Result<Completion<B>>>
    where
        B: IoBufMut,
        I: IntoIterator<Item = ReadOp<B>>,
    {
        Session::new(self, ops.into_iter())
    }

    /// Waits for the reads of a session that was leaked (`mem::forget` of [`Reader::reads`])
    /// and drops their results; the buffers were leaked with it, so the kernel wrote only into
    /// memory nobody uses. Its bounce buffers were leaked too: make new ones as needed.
    fn drain_leaked_session(&mut self) -> Result<()> {
        if self.engine.in_flight() == 0 {
            return Ok(());
        }
        tracing::warn!(
            reads = self.engine.in_flight(),
            "a leaked read session left reads in flight; waiting for them"
        );
        let mut raw = Vec::new();
        while self.engine.in_flight() > 0 {
            raw.clear();
            self.engine
                .wait(1, &mut raw)
                .map_err(|source| Error::Backend {
                    op: "wait for the reads of a leaked session",
                    source,
                })?;
        }
        self.bounce_made = self.bounce_free.len();
        Ok(())
    }

    fn take_bounce(&mut self) -> Option<Bounce> {
        if let Some(b) = self.bounce_free.pop() {
            return Some(b);
        }
        if self.bounce_made >= self.engine.capacity() {
            return None;
        }
        let buf = AlignedBuf::new(self.cfg.block_bytes, 4096).ok()?;
        self.bounce_made += 1;
        Some(Bounce { buf, index: None })
    }

    /// Allocates every bounce buffer now and registers them with the ring.
    fn register_bounce_buffers(&mut self) -> Result<()> {
        let count = self.engine.capacity().min(usize::from(u16::MAX));
        let mut bufs = Vec::with_capacity(count);
        for _ in 0..count {
            bufs.push(AlignedBuf::new(self.cfg.block_bytes, 4096)?);
        }
        let raw: Vec<(*mut u8, usize)> =
            bufs.iter_mut().map(|b| (b.as_mut_ptr(), b.len())).collect();
        // SAFETY: the buffers live in `bounce_free` (or in a session's parts, which return them)
        // until the reader drops, and `engine` is the reader's first field, so the ring is
        // closed before any of them is freed.
        let registered = match unsafe { self.engine.register_buffers(&raw) } {
            Ok(true) => true,
            Ok(false) => {
                self.stats.fallbacks.push(Fallback::new(
                    Refused::RingBuffers,
                    "registered buffers need io_uring, and this reader runs on threads",
                    "bounce buffers are ordinary memory",
                ));
                false
            }
            Err(e) => {
                Fallback::new(
                    Refused::RingBuffers,
                    format!("registering {count} bounce buffers with the ring failed: {e}"),
                    "bounce buffers are unregistered (raise `ulimit -l` to register them)",
                )
                .push_once(&mut self.stats.fallbacks);
                false
            }
        };
        self.bounce_made = count;
        self.stats.registered_buffers = if registered { count } else { 0 };
        self.bounce_free = bufs
            .into_iter()
            .enumerate()
            .map(|(i, buf)| Bounce {
                buf,
                index: registered.then_some(i as u16),
            })
            .collect();
        Ok(())
    }
}

/// The file to read, its (offset, memory) alignment when read with O_DIRECT, and why not
/// when not.
type DirectChoice = (File, Option<(u32, u32)>, Option<String>);
