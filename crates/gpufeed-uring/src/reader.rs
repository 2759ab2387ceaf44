//! The reader: files, read requests, and the one read-exact state machine of every backend.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use gpufeed_os::{AlignedBuf, Fallback, Refused};

use crate::engine::{Engine, RawRead, RawResult};
use crate::error::{Error, Result};
use crate::fault::{FaultEngine, FaultPlan};
use crate::probe::{Backend, BackendKind, Probe};
use crate::split::{PartPlan, split};
use crate::threads::ThreadEngine;
use crate::uring::UringEngine;

/// Whether files are read with `O_DIRECT` (bypassing the page cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Direct {
    /// Always; a file system that refuses it is an error ([`Error::DirectUnsupported`]).
    On,
    /// Never: buffered reads through the page cache.
    Off,
    /// `O_DIRECT` for files mostly absent from the page cache on file systems that accept it;
    /// buffered otherwise, with the reason in [`ReadStats::files`].
    #[default]
    Auto,
}

/// Builds a [`Reader`].
#[derive(Debug, Clone)]
pub struct ReaderBuilder {
    queue_depth: usize,
    block_bytes: usize,
    direct: Direct,
    backend: Backend,
    probe: Option<Probe>,
    fault: Option<FaultPlan>,
    async_buffered: bool,
    register_buffers: bool,
}

impl Default for ReaderBuilder {
    fn default() -> Self {
        ReaderBuilder {
            queue_depth: 32,
            block_bytes: 1 << 20,
            direct: Direct::Auto,
            backend: Backend::Auto,
            probe: None,
            fault: None,
            async_buffered: true,
            register_buffers: false,
        }
    }
}

impl ReaderBuilder {
    /// Reads in flight at once (default 32).
    pub fn queue_depth(mut self, depth: usize) -> Self {
        self.queue_depth = depth.max(1);
        self
    }

    /// Largest single read (default 1 MiB); requests are split into pieces of this size.
    pub fn block_bytes(mut self, bytes: usize) -> Self {
        self.block_bytes = bytes.max(4096);
        self
    }

    /// `O_DIRECT` on, off, or decided per file (default [`Direct::Auto`]).
    pub fn direct(mut self, direct: Direct) -> Self {
        self.direct = direct;
        self
    }

    /// The backend (default [`Backend::Auto`]).
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Uses this probe result instead of probing the kernel (to exercise the fallback path).
    pub fn probe_override(mut self, probe: Probe) -> Self {
        self.probe = Some(probe);
        self
    }

    /// Injects faults into every read (see [`FaultPlan`]); for tests.
    pub fn fault_injection(mut self, plan: FaultPlan) -> Self {
        self.fault = Some(plan);
        self
    }

    /// io_uring only: run buffered reads on the kernel's worker threads (`IOSQE_ASYNC`), so
    /// copies out of the page cache proceed in parallel (default on).
    pub fn async_buffered(mut self, on: bool) -> Self {
        self.async_buffered = on;
        self
    }

    /// io_uring only: allocate the reader's bounce buffers up front and register them with the
    /// ring (`IORING_REGISTER_BUFFERS`), so bounced O_DIRECT reads are `READ_FIXED` (no page
    /// pinning per read). Registered buffers count against `RLIMIT_MEMLOCK` without
    /// `CAP_IPC_LOCK`; where registration is refused the reader works unregistered and says
    /// why in [`ReadStats::fallbacks`]. Default off.
    pub fn register_buffers(mut self, on: bool) -> Self {
        self.register_buffers = on;
        self
    }

    /// Builds the reader, choosing the backend once.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when io_uring is asked for (builder or
    /// `GPUFEED_IO_BACKEND=uring`) but cannot run here.
    pub fn build(self) -> Result<Reader> {
        let mut fallbacks = Vec::new();
        let backend = match (self.backend, Backend::from_env()) {
            (Backend::Auto, Some(env)) => {
                if env != Backend::IoUring {
                    fallbacks.push(Fallback::new(
                        Refused::IoUring,
                        format!("{}=threads", crate::probe::BACKEND_ENV),
                        "reads run on a thread pool",
                    ));
                }
                env
            }
            (b, _) => b,
        };
        let default_threads = {
            let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
            self.queue_depth.min(2 * cores).clamp(2, 64)
        };
        let probe = || self.probe.clone().unwrap_or_else(Backend::probe);
        let (engine, kind): (Box<dyn Engine>, BackendKind) = match backend {
            Backend::Threads(n) => {
                let n = if n == 0 { default_threads } else { n };
                (
                    Box::new(ThreadEngine::new(n, self.queue_depth).map_err(threads_failed)?),
                    BackendKind::Threads(n),
                )
            }
            Backend::IoUring => match probe().io_uring {
                Ok(()) => (Box::new(self.uring()?), BackendKind::IoUring),
                Err(why) => {
                    return Err(Error::BackendUnavailable {
                        backend: "io_uring",
                        reason: why.to_string(),
                    });
                }
            },
            Backend::Auto => match probe().io_uring {
                Ok(()) => (Box::new(self.uring()?), BackendKind::IoUring),
                Err(why) => {
                    Fallback::new(
                        Refused::IoUring,
                        why.to_string(),
                        format!("reads run on a pool of {default_threads} threads"),
                    )
                    .push_once(&mut fallbacks);
                    (
                        Box::new(
                            ThreadEngine::new(default_threads, self.queue_depth)
                                .map_err(threads_failed)?,
                        ),
                        BackendKind::Threads(default_threads),
                    )
                }
            },
        };
        let engine: Box<dyn Engine> = match self.fault.clone() {
            Some(plan) => Box::new(FaultEngine::new(engine, plan)),
            None => engine,
        };
        let mut reader = Reader {
            engine,
            files: Vec::new(),
            bounce_free: Vec::new(),
            bounce_made: 0,
            session_gen: 0,
            stats: ReadStats {
                backend: kind,
                bytes: 0,
                seconds: 0.0,
                short_reads: 0,
                retries: 0,
                registered_buffers: 0,
                files: Vec::new(),
                fallbacks,
            },
            cfg: self,
        };
        if reader.cfg.register_buffers {
            reader.register_bounce_buffers()?;
        }
        Ok(reader)
    }

    fn uring(&self) -> Result<UringEngine> {
        UringEngine::new(self.queue_depth, self.async_buffered).map_err(|e| {
            Error::BackendUnavailable {
                backend: "io_uring",
                reason: format!("ring setup failed after a successful probe: {e}"),
            }
        })
    }
}

fn threads_failed(source: io::Error) -> Error {
    Error::Backend {
        op: "start read threads",
        source,
    }
}

/// A file opened by a [`Reader`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId(u32);

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
    /// Every file opened, direct or buffered, and why.
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

/// A buffer the kernel can read into while the caller waits: its memory must not move when
/// the value moves (heap buffers).
///
/// # Safety
/// Implementors guarantee that `io_ptr` returns the same address, valid for `io_len` bytes,
/// for as long as the value lives, however it is moved.
pub unsafe trait IoBufMut: Send + 'static {
    /// Whether the memory belongs to someone else (who gets it back when the value is
    /// dropped or forgotten); only the reader's own internal buffer type sets it.
    #[doc(hidden)]
    const BORROWED: bool = false;
    /// The first byte.
    fn io_ptr(&mut self) -> *mut u8;
    /// The number of bytes.
    fn io_len(&self) -> usize;
}

// SAFETY: a Vec's heap buffer does not move when the Vec does; its length is its bytes.
unsafe impl IoBufMut for Vec<u8> {
    fn io_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as for Vec.
unsafe impl IoBufMut for Box<[u8]> {
    fn io_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: an AlignedBuf owns a heap or mmap allocation that never moves.
unsafe impl IoBufMut for AlignedBuf {
    fn io_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

/// A borrowed buffer, only used by [`Reader::read_exact_at`], which waits for every read into
/// it before returning (also when unwinding).
struct Borrowed {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: see the type's docs; the pointer is only handed to the engine.
unsafe impl Send for Borrowed {}
// SAFETY: read_exact_at keeps the borrowed slice alive and unused until every read completed.
unsafe impl IoBufMut for Borrowed {
    const BORROWED: bool = true;
    fn io_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    fn io_len(&self) -> usize {
        self.len
    }
}

/// A request: read `len` bytes of `file` at `offset` into `buf[buf_offset..]`.
#[derive(Debug)]
pub struct ReadOp<B> {
    file: FileId,
    offset: u64,
    len: usize,
    buf: B,
    buf_offset: usize,
    user_data: u64,
}

impl<B: IoBufMut> ReadOp<B> {
    /// Fills all of `buf` from `file` starting at `offset`.
    pub fn new(file: FileId, offset: u64, buf: B) -> Self {
        let len = buf.io_len();
        ReadOp {
            file,
            offset,
            len,
            buf,
            buf_offset: 0,
            user_data: 0,
        }
    }

    /// Reads `len` bytes instead of the whole buffer.
    pub fn len(mut self, len: usize) -> Self {
        self.len = len;
        self
    }

    /// Writes into the buffer starting at `buf_offset`.
    pub fn at(mut self, buf_offset: usize) -> Self {
        self.buf_offset = buf_offset;
        self
    }

    /// A number returned with the completion.
    pub fn user_data(mut self, user_data: u64) -> Self {
        self.user_data = user_data;
        self
    }
}

/// A finished request: the buffer comes back with the outcome.
#[derive(Debug)]
pub struct Completion<B> {
    /// The request's `user_data`.
    pub user_data: u64,
    /// The file read.
    pub file: FileId,
    /// The offset read.
    pub offset: u64,
    /// The buffer, filled on success.
    pub buf: B,
    /// Bytes read (always the requested length), or why the request failed.
    pub result: Result<usize>,
}

#[derive(Debug)]
struct OpenFile {
    file: File,
    path: PathBuf,
    direct: Option<(u32, u32)>,
    fixed: Option<u32>,
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
    files: Vec<OpenFile>,
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
        let path = path.as_ref();
        let (file, _) = gpufeed_os::file::open_regular(path, false)?;
        let (file, direct, reason) = self.choose_direct(path, file)?;
        let index = self.files.len() as u32;
        let fixed = self.engine.register_file(index, file.as_raw_fd());
        self.stats.files.push(FileReport {
            path: path.into(),
            direct: direct.is_some(),
            reason,
        });
        self.files.push(OpenFile {
            file,
            path: path.into(),
            direct,
            fixed,
        });
        Ok(FileId(index))
    }

    /// Decides O_DIRECT for one file: returns the file to read, its (offset, memory)
    /// alignment when direct, and why not when not.
    fn choose_direct(&self, path: &Path, buffered: File) -> Result<DirectChoice> {
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
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
        };
        match opened {
            Ok(direct) => {
                let block = self.cfg.block_bytes;
                if block % dio.offset_align as usize != 0 {
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
            Err(e) => Err(os_open_error(path, e)),
        }
    }

    /// The path `file` was opened by.
    pub fn path(&self, file: FileId) -> Option<&Path> {
        self.files.get(file.0 as usize).map(|f| f.path.as_path())
    }

    /// Whether `file` is read with `O_DIRECT`.
    pub fn is_direct(&self, file: FileId) -> Option<bool> {
        self.files.get(file.0 as usize).map(|f| f.direct.is_some())
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
            .get(file.0 as usize)
            .ok_or_else(|| Error::InvalidRequest(format!("{file:?} was not opened by this reader")))
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

fn os_open_error(path: &Path, e: io::Error) -> Error {
    match e.kind() {
        io::ErrorKind::NotFound => gpufeed_os::Error::NotFound { path: path.into() }.into(),
        io::ErrorKind::IsADirectory => gpufeed_os::Error::IsDirectory { path: path.into() }.into(),
        _ => Error::Read {
            path: path.into(),
            offset: 0,
            source: e,
        },
    }
}

struct Slot<B> {
    op: ReadOp<B>,
    parts_left: usize,
    error: Option<Error>,
    eof_at: Option<u64>,
}

struct Part {
    slot: usize,
    plan: PartPlan,
    done: usize,
    retries: u32,
    bounce: Option<Bounce>,
}

/// One run of requests over a reader: the read-exact state machine shared by every engine.
struct Session<'r, I, B: IoBufMut> {
    reader: &'r mut Reader,
    source: Option<I>,
    slots: Vec<Option<Slot<B>>>,
    free_slots: Vec<usize>,
    parts: Vec<Option<Part>>,
    free_parts: Vec<usize>,
    pending: VecDeque<Part>,
    ready: VecDeque<Completion<B>>,
    raw: Vec<RawResult>,
    started: Option<Instant>,
    broken: bool,
    /// This session's generation (the high half of its tags).
    generation: u32,
    /// An error found before the first request (reads of a leaked session could not be
    /// waited for): reported by the first `next`.
    fatal: Option<Error>,
}

impl<'r, I, B> Session<'r, I, B>
where
    B: IoBufMut,
    I: Iterator<Item = ReadOp<B>>,
{
    fn new(reader: &'r mut Reader, source: I) -> Self {
        let fatal = reader.drain_leaked_session().err();
        reader.session_gen = reader.session_gen.wrapping_add(1);
        let generation = reader.session_gen;
        Session {
            generation,
            fatal,
            reader,
            source: Some(source),
            slots: Vec::new(),
            free_slots: Vec::new(),
            parts: Vec::new(),
            free_parts: Vec::new(),
            pending: VecDeque::new(),
            ready: VecDeque::new(),
            raw: Vec::new(),
            started: None,
            broken: false,
        }
    }

    /// Takes the next request from the source and plans its parts; false when none is left.
    fn admit(&mut self) -> bool {
        let Some(mut op) = self.source.as_mut().and_then(Iterator::next) else {
            self.source = None;
            return false;
        };
        let invalid = match self.reader.file(op.file) {
            Err(e) => Some(e),
            Ok(_)
                if op
                    .buf_offset
                    .checked_add(op.len)
                    .is_none_or(|end| end > op.buf.io_len()) =>
            {
                Some(Error::InvalidRequest(format!(
                    "{} bytes at buffer offset {} do not fit a buffer of {} bytes",
                    op.len,
                    op.buf_offset,
                    op.buf.io_len()
                )))
            }
            Ok(_) => None,
        };
        if invalid.is_some() || op.len == 0 {
            self.ready.push_back(Completion {
                user_data: op.user_data,
                file: op.file,
                offset: op.offset,
                result: invalid.map_or(Ok(0), Err),
                buf: op.buf,
            });
            return true;
        }
        let file = &self.reader.files[op.file.0 as usize];
        let dst = op.buf.io_ptr() as usize + op.buf_offset;
        let plans = split(
            op.offset,
            op.len,
            dst,
            file.direct,
            self.reader.cfg.block_bytes,
        );
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        self.slots[slot] = Some(Slot {
            op,
            parts_left: plans.len(),
            error: None,
            eof_at: None,
        });
        self.pending.extend(plans.into_iter().map(|plan| Part {
            slot,
            plan,
            done: 0,
            retries: 0,
            bounce: None,
        }));
        true
    }

    /// Pushes pending parts (admitting requests as needed) until the engine is full.
    fn fill(&mut self) -> Result<()> {
        while self.reader.engine.in_flight() < self.reader.engine.capacity() {
            if self.pending.is_empty() && !self.admit() {
                break;
            }
            let Some(mut part) = self.pending.pop_front() else {
                continue;
            };
            let failed = self.slots[part.slot]
                .as_ref()
                .is_some_and(|s| s.error.is_some());
            if failed {
                self.finish_part(part, None);
                continue;
            }
            if part.plan.dst.is_none() && part.bounce.is_none() {
                match self.reader.take_bounce() {
                    Some(b) => part.bounce = Some(b),
                    None => {
                        self.pending.push_front(part);
                        break; // a bounce buffer frees up when a read completes
                    }
                }
            }
            self.submit(part)?;
        }
        Ok(())
    }

    fn submit(&mut self, mut part: Part) -> Result<()> {
        let file = &self.reader.files[self.slots[part.slot]
            .as_ref()
            .map_or(0, |s| s.op.file.0 as usize)];
        let buf_index = part.bounce.as_ref().and_then(|b| b.index);
        let base = match (&mut part.bounce, part.plan.dst) {
            (Some(b), _) => b.buf.as_mut_ptr(),
            (None, Some(d)) => d as *mut u8,
            (None, None) => unreachable!("fill gives bounce parts a buffer"),
        };
        let read = RawRead {
            fd: file.fd(),
            fixed: file.fixed,
            offset: part.plan.off + part.done as u64,
            // SAFETY: done < req, and base points to at least req bytes (the request's range
            // in the caller's buffer, or a bounce buffer of block_bytes >= req).
            ptr: unsafe { base.add(part.done) },
            len: u32::try_from(part.plan.req - part.done).unwrap_or(u32::MAX),
            align: file.direct.map_or(1, |(a, _)| a),
            buf_index,
            tag: 0,
        };
        let tag = self.free_parts.pop().unwrap_or_else(|| {
            self.parts.push(None);
            self.parts.len() - 1
        });
        self.parts[tag] = Some(part);
        self.started.get_or_insert_with(Instant::now);
        // SAFETY: the memory belongs to a request (or bounce buffer) this session owns and
        // keeps untouched until the completion of `tag` is processed; the session drains every
        // read before it is dropped (a session leaked with `mem::forget` leaks its owned
        // buffers with it, and the next session waits for its reads first); the file stays
        // open as long as the reader.
        unsafe {
            self.reader.engine.push(RawRead {
                tag: u64::from(self.generation) << 32 | tag as u64,
                ..read
            })
        }
        .map_err(|source| Error::Backend {
            op: "submit read",
            source,
        })
    }

    fn process(&mut self, tag: u64, result: io::Result<usize>) {
        if (tag >> 32) as u32 != self.generation {
            tracing::error!(tag, "completion of an earlier session's read; ignored");
            return;
        }
        let tag = tag & u64::from(u32::MAX);
        let Some(mut part) = self.parts.get_mut(tag as usize).and_then(Option::take) else {
            tracing::error!(tag, "completion for an unknown read; ignored");
            return;
        };
        self.free_parts.push(tag as usize);
        let Some(file_index) = self.slots[part.slot].as_ref().map(|s| s.op.file.0 as usize) else {
            return;
        };
        let align = self.reader.files[file_index]
            .direct
            .map_or(1, |(a, _)| a as usize);
        match result {
            Ok(n) if n > 0 => {
                part.done += n;
                if part.done >= part.plan.want {
                    self.finish_part(part, None);
                } else if part.done % align != 0 || part.done >= part.plan.req {
                    // O_DIRECT came back short of a block boundary: that is the end of file.
                    let at = part.plan.off + part.done as u64;
                    self.finish_part(part, Some(Failure::Eof(at)));
                } else {
                    self.reader.stats.short_reads += 1;
                    self.pending.push_front(part);
                }
            }
            Ok(_) => {
                let at = part.plan.off + part.done as u64;
                self.finish_part(part, Some(Failure::Eof(at)));
            }
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) && part.retries < MAX_RETRIES =>
            {
                part.retries += 1;
                self.reader.stats.retries += 1;
                self.pending.push_front(part);
            }
            Err(source) => {
                let err = Error::Read {
                    path: self.reader.files[file_index].path.clone(),
                    offset: part.plan.off + part.done as u64,
                    source,
                };
                self.finish_part(part, Some(Failure::Error(err)));
            }
        }
    }

    fn finish_part(&mut self, part: Part, failure: Option<Failure>) {
        let Some(slot) = self.slots[part.slot].as_mut() else {
            return;
        };
        if let (None, Some(copy), Some(bounce)) = (&failure, part.plan.copy, &part.bounce)
            && slot.error.is_none()
        {
            // SAFETY: the kernel wrote at least `want` = skip + copy_len bytes of the bounce
            // buffer; user_dst is inside the request's range of the caller's buffer, which
            // this session owns, and does not overlap the bounce buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bounce.buf.as_ptr().add(copy.skip),
                    copy.user_dst as *mut u8,
                    copy.copy_len,
                )
            };
        }
        if let Some(b) = part.bounce {
            self.reader.bounce_free.push(b);
        }
        match failure {
            Some(Failure::Eof(at)) => slot.eof_at = Some(slot.eof_at.map_or(at, |e| e.min(at))),
            Some(Failure::Error(e)) if slot.error.is_none() => slot.error = Some(e),
            _ => {}
        }
        slot.parts_left -= 1;
        if slot.parts_left > 0 {
            return;
        }
        let slot = self.slots[part.slot].take().expect("slot present");
        self.free_slots.push(part.slot);
        let op = slot.op;
        let result = match (slot.error, slot.eof_at) {
            (Some(e), _) => Err(e),
            (None, Some(at)) => Err(Error::UnexpectedEof {
                path: self.reader.files[op.file.0 as usize].path.clone(),
                offset: op.offset,
                got: at.saturating_sub(op.offset).min(op.len as u64),
                want: op.len as u64,
            }),
            (None, None) => {
                self.reader.stats.bytes += op.len as u64;
                Ok(op.len)
            }
        };
        self.ready.push_back(Completion {
            user_data: op.user_data,
            file: op.file,
            offset: op.offset,
            buf: op.buf,
            result,
        });
    }
}

enum Failure {
    Eof(u64),
    Error(Error),
}

impl<I, B> Iterator for Session<'_, I, B>
where
    B: IoBufMut,
    I: Iterator<Item = ReadOp<B>>,
{
    type Item = Result<Completion<B>>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(e) = self.fatal.take() {
            self.broken = true;
            return Some(Err(e));
        }
        loop {
            if let Some(done) = self.ready.pop_front() {
                return Some(Ok(done));
            }
            if self.broken {
                return None;
            }
            if let Err(e) = self.fill() {
                self.drain();
                self.broken = true;
                return Some(Err(e));
            }
            if let Some(done) = self.ready.pop_front() {
                return Some(Ok(done));
            }
            if self.reader.engine.in_flight() == 0 {
                if self.pending.is_empty() && self.source.is_none() {
                    self.stop_clock();
                    return None;
                }
                if !self.pending.is_empty() {
                    // fill() could not start a pending read with nothing in flight: no bounce
                    // buffer could be allocated.
                    self.broken = true;
                    return Some(Err(Error::Backend {
                        op: "allocate an O_DIRECT bounce buffer",
                        source: io::Error::from_raw_os_error(libc::ENOMEM),
                    }));
                }
                continue;
            }
            self.raw.clear();
            if let Err(source) = self.reader.engine.wait(1, &mut self.raw) {
                self.drain();
                self.broken = true;
                return Some(Err(Error::Backend {
                    op: "wait for reads",
                    source,
                }));
            }
            let mut raw = std::mem::take(&mut self.raw);
            for (tag, result) in raw.drain(..) {
                self.process(tag, result);
            }
            self.raw = raw;
        }
    }
}

impl<I, B: IoBufMut> Session<'_, I, B> {
    /// Waits for every read in flight, discarding results (drop and error paths).
    fn drain(&mut self) {
        while self.reader.engine.in_flight() > 0 {
            self.raw.clear();
            if let Err(err) = self.reader.engine.wait(1, &mut self.raw) {
                // The kernel may still write into these buffers: never free them. A borrowed
                // buffer cannot be kept from its owner by forgetting it: stop the process
                // rather than let the kernel write into memory that is reused.
                if B::BORROWED {
                    eprintln!(
                        "gpufeed-uring: waiting for reads into a borrowed buffer failed ({err}); aborting"
                    );
                    std::process::abort();
                }
                self.broken = true;
                for slot in self.slots.drain(..).flatten() {
                    std::mem::forget(slot.op.buf);
                }
                for part in self.parts.drain(..).flatten() {
                    std::mem::forget(part.bounce);
                }
                return;
            }
        }
        // Every read is over: bounce buffers of abandoned parts go back to the reader.
        let parts = self
            .parts
            .iter_mut()
            .flatten()
            .chain(self.pending.iter_mut());
        let bounces: Vec<Bounce> = parts.filter_map(|p| p.bounce.take()).collect();
        self.reader.bounce_free.extend(bounces);
    }

    fn stop_clock(&mut self) {
        if let Some(t) = self.started.take() {
            self.reader.stats.seconds += t.elapsed().as_secs_f64();
        }
    }
}

impl<I, B: IoBufMut> Drop for Session<'_, I, B> {
    fn drop(&mut self) {
        // Never let a buffer go while the kernel may still write into it.
        self.drain();
        self.stop_clock();
    }
}
