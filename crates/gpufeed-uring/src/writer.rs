//! Writes at the disk's speed: [`Writer`] writes byte ranges from caller buffers into a file,
//! many pieces in flight through io_uring (or threads doing `pwrite` where io_uring is refused),
//! with `O_DIRECT` where the file system takes it and the range is aligned, and buffered writes
//! for the rest (an unaligned tail; a file system that refuses `O_DIRECT`, recorded as a
//! [`Fallback`]). Short writes are resubmitted for the rest; `EINTR`/`EAGAIN` are retried;
//! `ENOSPC` is [`gpufeed_os::Error::NoSpace`].
//!
//! A write call returns only when every piece it submitted has completed (also on error), so the
//! caller's buffer is never read by the kernel after the call.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use gpufeed_os::{Fallback, Refused};
use io_uring::{IoUring, opcode, types};

use crate::error::{Error, Result};
use crate::probe::{Backend, BackendKind};
use crate::reader::Direct;

/// Builds a [`Writer`].
#[derive(Debug, Clone)]
pub struct WriterBuilder {
    direct: Direct,
    queue_depth: usize,
    block_bytes: usize,
    backend: Backend,
}

impl Default for WriterBuilder {
    fn default() -> Self {
        WriterBuilder {
            direct: Direct::Auto,
            queue_depth: 16,
            block_bytes: 1 << 20,
            backend: Backend::Auto,
        }
    }
}

impl WriterBuilder {
    /// `O_DIRECT` always ([`Error::DirectUnsupported`] where refused), never, or where the file
    /// system takes it (default [`Direct::Auto`], the refusal recorded as a fallback).
    pub fn direct(mut self, direct: Direct) -> Self {
        self.direct = direct;
        self
    }

    /// Writes in flight at once (default 16).
    pub fn queue_depth(mut self, depth: usize) -> Self {
        self.queue_depth = depth.max(1);
        self
    }

    /// Largest single write (default 1 MiB, a multiple of 4096).
    pub fn block_bytes(mut self, bytes: usize) -> Self {
        self.block_bytes = bytes.max(4096).next_multiple_of(4096);
        self
    }

    /// The backend (default [`Backend::Auto`]; `GPUFEED_IO_BACKEND` is honoured as for reads).
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Opens the existing file `path` for writing (neither created nor truncated: make it with
    /// `gpufeed_os::AtomicFile` or `File::create` first).
    ///
    /// # Errors
    /// The file's errors (missing, a directory, not writable), [`Error::DirectUnsupported`]
    /// for [`Direct::On`] where `O_DIRECT` is refused, [`Error::BackendUnavailable`] for
    /// io_uring asked for where it cannot run.
    pub fn open(self, path: impl AsRef<Path>) -> Result<Writer> {
        let path = path.as_ref();
        let buffered = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| gpufeed_os::Error::open(path, e))?;
        let mut fallbacks = Vec::new();
        let direct = self.open_direct(path, &buffered, &mut fallbacks)?;
        let backend = crate::probe::resolve(self.backend, &mut fallbacks, "writes run on threads");
        let ring = match backend {
            Backend::Threads(_) => None,
            Backend::IoUring | Backend::Auto => match Backend::probe().io_uring {
                Ok(()) => Some(
                    IoUring::new((self.queue_depth as u32).next_power_of_two()).map_err(|e| {
                        Error::BackendUnavailable {
                            backend: "io_uring",
                            reason: format!("ring setup failed after a successful probe: {e}"),
                        }
                    })?,
                ),
                Err(why) if backend == Backend::IoUring => {
                    return Err(Error::BackendUnavailable {
                        backend: "io_uring",
                        reason: why.to_string(),
                    });
                }
                Err(why) => {
                    Fallback::new(
                        Refused::IoUring,
                        why.to_string(),
                        format!("writes run on up to {} threads", self.queue_depth),
                    )
                    .push_once(&mut fallbacks);
                    None
                }
            },
        };
        Ok(Writer {
            path: path.into(),
            stats: WriteStats {
                backend: if ring.is_some() {
                    BackendKind::IoUring
                } else {
                    BackendKind::Threads(self.queue_depth)
                },
                direct: direct.is_some(),
                bytes: 0,
                direct_bytes: 0,
                seconds: 0.0,
                fallbacks,
            },
            buffered,
            direct,
            ring,
            cfg: self,
        })
    }

    /// The `O_DIRECT` descriptor and its (offset, memory) alignment, where used.
    fn open_direct(
        &self,
        path: &Path,
        buffered: &File,
        fallbacks: &mut Vec<Fallback>,
    ) -> Result<Option<(File, u64, usize)>> {
        if self.direct == Direct::Off {
            return Ok(None);
        }
        let refused = |why: String, fallbacks: &mut Vec<Fallback>| {
            if self.direct == Direct::On {
                Err(Error::DirectUnsupported {
                    path: path.into(),
                    reason: why,
                })
            } else {
                Fallback::new(Refused::DirectIo, why, "buffered writes").push_once(fallbacks);
                Ok(None)
            }
        };
        let dio = gpufeed_os::align::dio_alignment(buffered)?;
        if !dio.supported() {
            return refused(
                "the file system reports no O_DIRECT support (statx DIOALIGN = 0)".into(),
                fallbacks,
            );
        }
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(f) => Ok(Some((
                f,
                u64::from(dio.offset_align.max(1)),
                dio.mem_align.max(1) as usize,
            ))),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => refused(
                "open with O_DIRECT returned EINVAL (the file system refuses it)".into(),
                fallbacks,
            ),
            Err(e) => Err(gpufeed_os::Error::open(path, e).into()),
        }
    }
}

/// What a [`Writer`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct WriteStats {
    /// The backend that ran.
    pub backend: BackendKind,
    /// Whether `O_DIRECT` is used for aligned ranges.
    pub direct: bool,
    /// Bytes written.
    pub bytes: u64,
    /// Of those, bytes written with `O_DIRECT`.
    pub direct_bytes: u64,
    /// Seconds spent in write calls.
    pub seconds: f64,
    /// Slower paths taken: what was refused, why, and what ran instead.
    pub fallbacks: Vec<Fallback>,
}

impl WriteStats {
    /// GB/s (10^9 bytes per second) over the write calls.
    pub fn gbps(&self) -> f64 {
        gpufeed_os::gbps(self.bytes, self.seconds)
    }
}

/// Writes byte ranges of one file (see the module docs).
///
/// # Example
/// ```
/// use gpufeed_uring::Writer;
/// # let dir = tempfile::tempdir()?;
/// let path = dir.path().join("out.bin");
/// std::fs::File::create(&path)?;
/// let data = vec![7u8; (3 << 20) + 5]; // any length; the unaligned tail is written buffered
/// let mut w = Writer::builder().open(&path)?;
/// w.write_all_at(0, &data)?;
/// assert_eq!(std::fs::read(&path)?, data);
/// println!("{:.2} GB/s, {} bytes with O_DIRECT", w.stats().gbps(), w.stats().direct_bytes);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Writer {
    path: PathBuf,
    buffered: File,
    direct: Option<(File, u64, usize)>,
    ring: Option<IoUring>,
    cfg: WriterBuilder,
    stats: WriteStats,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("path", &self.path)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// Retries of one write after EINTR/EAGAIN before giving up.
const MAX_RETRIES: u32 = 1000;

impl Writer {
    /// A builder: `Direct::Auto`, queue depth 16, 1 MiB writes, `Backend::Auto`.
    pub fn builder() -> WriterBuilder {
        WriterBuilder::default()
    }

    /// What it did so far.
    pub fn stats(&self) -> &WriteStats {
        &self.stats
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `O_DIRECT` descriptor, where one is used ([`WriteStats::direct`]); the buffered one
    /// is [`AsFd::as_fd`]. Both were opened from the path, so a caller that must know they are
    /// one file (`gpufeed_os::AtomicFile::check_same_file`) checks both.
    pub fn direct_fd(&self) -> Option<BorrowedFd<'_>> {
        self.direct.as_ref().map(|(f, _, _)| f.as_fd())
    }

    /// Writes all of `buf` at `offset`: the largest aligned part with `O_DIRECT` where the
    /// offset and the buffer's address are aligned, the rest buffered. Returns when every byte
    /// was handed to the kernel (not synced: `fsync` the file, or commit an
    /// `AtomicFile`).
    ///
    /// # Errors
    /// [`gpufeed_os::Error::NoSpace`] when the file system is full, [`Error::Write`] for other
    /// failures; bytes before the failure may have been written.
    pub fn write_all_at(&mut self, offset: u64, buf: &[u8]) -> Result<()> {
        let started = Instant::now();
        let mut direct_len = 0;
        if let Some((_, off_align, mem_align)) = &self.direct {
            if offset.is_multiple_of(*off_align)
                && (buf.as_ptr() as usize).is_multiple_of(*mem_align)
            {
                direct_len = buf.len() / *off_align as usize * *off_align as usize;
            } else if !buf.is_empty() {
                Fallback::new(
                    Refused::DirectIo,
                    format!(
                        "a write at offset {offset} from address {:#x} is not aligned to {off_align} / {mem_align}",
                        buf.as_ptr() as usize
                    ),
                    "that write went through the page cache",
                )
                .push_once(&mut self.stats.fallbacks);
            }
        }
        let result = (|| -> Result<()> {
            if direct_len > 0 {
                let fd = self.direct.as_ref().map_or(-1, |(f, ..)| f.as_raw_fd());
                self.pieces(fd, offset, &buf[..direct_len])?;
            }
            if direct_len < buf.len() {
                let fd = self.buffered.as_raw_fd();
                self.pieces(fd, offset + direct_len as u64, &buf[direct_len..])?;
            }
            Ok(())
        })();
        self.stats.seconds += started.elapsed().as_secs_f64();
        result?;
        self.stats.bytes += buf.len() as u64;
        self.stats.direct_bytes += direct_len as u64;
        Ok(())
    }

    /// Writes `buf` at `offset` of `fd` in pieces of at most `block_bytes`, up to
    /// `queue_depth` at once.
    fn pieces(&mut self, fd: RawFd, offset: u64, buf: &[u8]) -> Result<()> {
        let block = self.cfg.block_bytes;
        let pieces: Vec<(usize, usize)> = (0..buf.len())
            .step_by(block)
            .map(|at| (at, block.min(buf.len() - at)))
            .collect();
        let path = &self.path;
        let fail = |at: usize, e: io::Error| write_error(path, offset + at as u64, buf.len(), e);
        match &mut self.ring {
            Some(ring) => uring_pieces(ring, fd, offset, buf, &pieces, self.cfg.queue_depth)
                .map_err(|(at, e)| fail(at, e)),
            None => {
                // SAFETY: `fd` is one of this writer's open files, alive for the whole call.
                let fd = unsafe { BorrowedFd::borrow_raw(fd) };
                thread_pieces(fd, offset, buf, &pieces, self.cfg.queue_depth)
                    .map_err(|(at, e)| fail(at, e))
            }
        }
    }
}

/// `pieces` of `buf` through the ring, at most `depth` in flight; every submitted piece has
/// completed when this returns. An error names the piece's start in `buf`.
fn uring_pieces(
    ring: &mut IoUring,
    fd: RawFd,
    offset: u64,
    buf: &[u8],
    pieces: &[(usize, usize)],
    depth: usize,
) -> std::result::Result<(), (usize, io::Error)> {
    let depth = depth.min(ring.params().sq_entries() as usize).max(1);
    // Per piece: bytes done and retries; the queue of pieces (start, len) still to submit.
    let mut done = vec![0usize; pieces.len()];
    let mut retries = vec![0u32; pieces.len()];
    let mut todo: std::collections::VecDeque<usize> = (0..pieces.len()).collect();
    let mut in_flight = 0usize;
    let mut failed: Option<(usize, io::Error)> = None;
    loop {
        while failed.is_none() && in_flight < depth {
            let Some(i) = todo.pop_front() else { break };
            let (at, len) = pieces[i];
            let start = at + done[i];
            let entry =
                opcode::Write::new(types::Fd(fd), buf[start..].as_ptr(), (len - done[i]) as u32)
                    .offset(offset + start as u64)
                    .build()
                    .user_data(i as u64);
            // SAFETY: `buf` is borrowed for this whole call, which does not return before every
            // submitted write completed; `fd` stays open as long.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                todo.push_front(i);
                break;
            }
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => {
                // io_uring_enter itself failed: stop submitting, and reap what is in flight
                // before returning (the kernel reads `buf` until then) as far as the ring lets.
                failed.get_or_insert((0, e));
                while in_flight > 0 {
                    match ring.submit_and_wait(1) {
                        Ok(_) => in_flight -= ring.completion().count(),
                        Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                        Err(_) => break,
                    }
                }
                break;
            }
        }
        let completed: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (i, res) in completed {
            in_flight -= 1;
            let (at, len) = pieces[i];
            match res {
                n if n > 0 => {
                    done[i] += n as usize;
                    if done[i] < len {
                        todo.push_front(i); // short: the rest
                    }
                }
                0 => {
                    failed.get_or_insert((at, io::Error::from(io::ErrorKind::WriteZero)));
                }
                e if (-e == libc::EINTR || -e == libc::EAGAIN) && retries[i] < MAX_RETRIES => {
                    retries[i] += 1;
                    todo.push_front(i);
                }
                e => {
                    failed.get_or_insert((at, io::Error::from_raw_os_error(-e)));
                }
            }
        }
    }
    failed.map_or(Ok(()), Err)
}

/// `pieces` of `buf` with `pwrite` on up to `threads` threads.
fn thread_pieces(
    fd: BorrowedFd<'_>,
    offset: u64,
    buf: &[u8],
    pieces: &[(usize, usize)],
    threads: usize,
) -> std::result::Result<(), (usize, io::Error)> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let write_piece = |at: usize, len: usize| -> std::result::Result<(), (usize, io::Error)> {
        let mut done = 0;
        let mut retries = 0;
        while done < len {
            match rustix::io::pwrite(fd, &buf[at + done..at + len], offset + (at + done) as u64) {
                Ok(0) => return Err((at, io::Error::from(io::ErrorKind::WriteZero))),
                Ok(n) => done += n,
                Err(e)
                    if (e == rustix::io::Errno::INTR || e == rustix::io::Errno::AGAIN)
                        && retries < MAX_RETRIES =>
                {
                    retries += 1;
                }
                Err(e) => return Err((at, e.into())),
            }
        }
        Ok(())
    };
    let worker = || -> std::result::Result<(), (usize, io::Error)> {
        use std::sync::atomic::Ordering;
        while !stop.load(Ordering::Relaxed) {
            let Some(&(at, len)) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) else {
                return Ok(());
            };
            if let Err(e) = write_piece(at, len) {
                stop.store(true, Ordering::Relaxed);
                return Err(e);
            }
        }
        Ok(())
    };
    let threads = threads.min(pieces.len()).max(1);
    if threads == 1 {
        return worker();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = (1..threads).map(|_| s.spawn(worker)).collect();
        let mut result = worker();
        for h in handles {
            let r = h
                .join()
                .unwrap_or_else(|_| Err((0, io::Error::other("a write thread panicked"))));
            if result.is_ok() {
                result = r;
            }
        }
        result
    })
}

fn write_error(path: &Path, offset: u64, len: usize, e: io::Error) -> Error {
    if e.raw_os_error() == Some(libc::ENOSPC) {
        return gpufeed_os::Error::NoSpace {
            path: path.into(),
            needed: len as u64,
        }
        .into();
    }
    Error::Write {
        path: path.into(),
        offset,
        source: e,
    }
}

impl AsFd for Writer {
    /// The buffered descriptor (for `fsync`, `ftruncate`).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.buffered.as_fd()
    }
}
