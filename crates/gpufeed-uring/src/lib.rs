//! # gpufeed-uring — layer 1 of gpufeed: reads and writes at the disk's speed
//!
//! A [`Reader`] reads byte ranges of files into buffers the caller owns, many at once, through
//! io_uring or — where io_uring is refused (old kernels, Docker's default seccomp profile,
//! `kernel.io_uring_disabled`) — a pool of threads doing `pread`. [`Backend::probe`] says which
//! works here and why not; `GPUFEED_IO_BACKEND=uring|threads` forces one.
//!
//! One read-exact state machine serves every backend: a short read is resubmitted for the rest,
//! `EINTR`/`EAGAIN`/`EBUSY` are retried, a read that returns 0 before the end is
//! [`Error::UnexpectedEof`]. Under `O_DIRECT` (alignment from
//! `gpufeed_os::align::dio_alignment`) an unaligned head and tail, or a misaligned destination,
//! go through bounce buffers, so callers may ask for any range into any memory. A file system
//! that refuses `O_DIRECT` is read buffered under [`Direct::Auto`], with the reason in
//! [`ReadStats::files`].
//!
//! Buffers are safe by construction: a request owns its buffer ([`IoBufMut`]) until its
//! [`Completion`] hands it back, and a reader never drops a buffer the kernel may still write
//! (dropping an unfinished iterator waits for the reads in flight). [`Reader::read_exact_at`]
//! and [`Reader::read_exact_many`] (many files or ranges in one batch) read into borrowed
//! slices and return when every read is done. A reader is worth keeping (setting one up costs
//! a ring): [`Reader::close`] closes a file it is done with, so one reader serves any number
//! of files.
//!
//! A [`Writer`] is the way back: byte ranges from caller buffers into a file, many pieces in
//! flight (io_uring, else threads doing `pwrite`), `O_DIRECT` for the aligned part where the file
//! system takes it and buffered writes for an unaligned tail, each call returning only when the
//! kernel is done with the buffer. Fallbacks of both are [`Fallback`]s.
//!
//! Depends on `gpufeed-os` and `io-uring`.
//!
//! Used by `gpufeed-load`'s `Staged` and `Direct` loads (one kept reader per fill thread, as a
//! `gpufeed-cuda` fill source), its many-file loads and its saves (a writer); by `gpufeed-data`'s
//! image folders and `O_DIRECT` batch reads; and by the facade's `doctor` and `advise`.
//!
//! # Example
//! ```
//! use gpufeed_uring::{Direct, Reader};
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("weights.bin");
//! # std::fs::write(&path, vec![1u8; 100_000])?;
//! let mut reader = Reader::builder().queue_depth(32).direct(Direct::Auto).build()?;
//! let file = reader.open(&path)?;
//! let mut head = vec![0u8; 1000];
//! reader.read_exact_at(file, 12_345, &mut head)?; // any offset, any length
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod engine;
mod error;
mod fault;
mod probe;
mod reader;
mod split;
mod threads;
mod uring;
mod writer;

pub use error::{Error, Result};
#[doc(hidden)]
pub use fault::FaultPlan;
/// The fallback type of every layer (defined in gpufeed-os).
pub use gpufeed_os::{Fallback, Refused};
pub use probe::{BACKEND_ENV, Backend, BackendKind, Probe, UringUnavailable};
pub use reader::{
    Completion, Direct, FileId, FileReport, IoBufMut, ReadOp, ReadStats, Reader, ReaderBuilder,
};
pub use writer::{WriteStats, Writer, WriterBuilder};
