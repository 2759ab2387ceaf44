//! The one error type of `gpufeed-uring`.

use std::io;
use std::path::PathBuf;

/// Result alias used throughout `gpufeed-uring`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `gpufeed-uring`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error of the layer below (opening, alignment, ...).
    #[error(transparent)]
    Os(#[from] gpufeed_os::Error),

    /// The file ended before the range asked for.
    #[error(
        "{}: the file ended after {got} of the {want} bytes asked for at offset {offset}; \
         it is shorter than expected (truncated, or still being written)",
        .path.display()
    )]
    UnexpectedEof {
        /// The file.
        path: PathBuf,
        /// Offset of the read.
        offset: u64,
        /// Bytes that were there.
        got: u64,
        /// Bytes asked for.
        want: u64,
    },

    /// A read failed.
    #[error("read of {} at offset {offset} failed: {source}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Offset of the failed piece.
        offset: u64,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },

    /// A write failed.
    #[error("write of {} at offset {offset} failed: {source}", .path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Offset of the failed piece.
        offset: u64,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },

    /// A backend that was asked for explicitly cannot run here.
    #[error("the {backend} backend is unavailable: {reason}")]
    BackendUnavailable {
        /// `"io_uring"`.
        backend: &'static str,
        /// Why, and what to do.
        reason: String,
    },

    /// `Direct::On` for a file whose file system refuses `O_DIRECT`.
    #[error(
        "{}: O_DIRECT is refused here ({reason}); use Direct::Auto to fall back to buffered reads",
        .path.display()
    )]
    DirectUnsupported {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },

    /// A request that cannot be carried out as given.
    #[error("invalid read request: {0}")]
    InvalidRequest(String),

    /// The io_uring instance or a worker failed (not a read error).
    #[error("{op} failed: {source}")]
    Backend {
        /// What failed.
        op: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
}
