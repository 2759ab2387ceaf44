//! The one error type of `gpufeed-os`.

use std::io;
use std::path::{Path, PathBuf};

/// Result alias used throughout `gpufeed-os`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `gpufeed-os`.
///
/// Each message says what happened and what to do about it. OS errors keep the
/// [`io::Error`] together with the operation and the path they concern.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A system call failed for a reason that has no variant of its own.
    #[error("{op} {}: {source}", path_or_dash(.path))]
    Io {
        /// The operation, e.g. `"fallocate"`.
        op: &'static str,
        /// The file or segment the operation concerned, where there is one.
        path: Option<PathBuf>,
        /// The error the kernel returned.
        #[source]
        source: io::Error,
    },

    /// The file does not exist.
    #[error("{}: no such file; check the path", .path.display())]
    NotFound {
        /// The missing path.
        path: PathBuf,
    },

    /// The file system has no room for a file being written.
    #[error(
        "{}: not enough space on its file system ({needed} bytes needed); the existing file was \
         left as it was: free space or write elsewhere",
        .path.display()
    )]
    NoSpace {
        /// The file that was to be written.
        path: PathBuf,
        /// Bytes it needed.
        needed: u64,
    },

    /// A directory was given where a regular file is needed.
    #[error("{} is a directory; pass a regular file inside it", .path.display())]
    IsDirectory {
        /// The directory.
        path: PathBuf,
    },

    /// The private directory or the temporary file of an [`crate::AtomicFile`] is not what
    /// gpufeed created: replaced by another user's, or not reachable through its descriptor.
    #[error(
        "{}: {reason}; gpufeed writes a temporary file only through the descriptor it created: \
         if other users can write this directory, save into one only you can write, else retry",
        .path.display()
    )]
    UnsafeTemporary {
        /// The temporary's directory or file.
        path: PathBuf,
        /// What did not match.
        reason: String,
    },

    /// A device, FIFO or socket was given where a regular file is needed.
    #[error("{} is not a regular file; gpufeed maps and caches regular files only", .path.display())]
    NotRegularFile {
        /// The offending path.
        path: PathBuf,
    },

    /// A file of a pseudo file system (procfs, sysfs, ...): it looks regular but has no true
    /// size (its text is generated on each read, its size says 0 or 4096).
    #[error(
        "{} is a file of {fs}, which has no fixed size (its contents are generated when read); \
         copy it to a regular file first",
        .path.display()
    )]
    PseudoFile {
        /// The offending path.
        path: PathBuf,
        /// The file system's name.
        fs: &'static str,
    },

    /// The kernel does not show this user the file's page-cache state: `cachestat(2)` and
    /// `mincore(2)` answer only for files the caller owns or may write (mincore would report
    /// every page resident). No figure is better than a wrong one.
    #[error(
        "page-cache residency of {} is unknown: {reason}; run as the file's owner or root to measure it",
        .path.as_deref().map_or_else(|| "the file".to_owned(), |p| p.display().to_string())
    )]
    ResidencyUnknown {
        /// The file.
        path: Option<PathBuf>,
        /// Why.
        reason: String,
    },

    /// The file is empty, so there is nothing to map.
    #[error("{} is empty (0 bytes): there is nothing to map; check that the file was fully written", .path.display())]
    EmptyFile {
        /// The empty file.
        path: PathBuf,
    },

    /// A byte range reaches beyond the end of the file.
    #[error(
        "{}: range [{offset}, {offset}+{len}) reaches past the end of the file ({file_len} bytes); \
         ask for a range inside the file, or check that the file is complete",
        .path.display()
    )]
    RangePastEof {
        /// The file.
        path: PathBuf,
        /// First byte asked for.
        offset: u64,
        /// Number of bytes asked for.
        len: u64,
        /// The file's length.
        file_len: u64,
    },

    /// A length of zero was asked for where it makes no sense.
    #[error("{what}: length is 0; ask for at least one byte")]
    ZeroLength {
        /// What was being created or mapped.
        what: &'static str,
    },

    /// An access to a buffer or segment reaches past its end.
    #[error("access [{offset}, {offset}+{len}) is out of bounds of a region of {capacity} bytes")]
    OutOfBounds {
        /// First byte of the access.
        offset: usize,
        /// Length of the access.
        len: usize,
        /// Size of the region.
        capacity: usize,
    },

    /// A shared-memory name is not usable.
    #[error(
        "invalid shared-memory name {name:?}: {reason}; use 1 to 255 characters without '/' or NUL"
    )]
    InvalidShmName {
        /// The name given.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },

    /// `create` found a segment of that name already there.
    #[error(
        "shared-memory segment {name:?} already exists: open it with ShmSegment::open, choose \
         another name, or remove it if its owner is gone (`gpufeed shm gc`)"
    )]
    ShmExists {
        /// The segment's name.
        name: String,
    },

    /// `open` found no segment of that name.
    #[error(
        "shared-memory segment {name:?} does not exist; is its creator running, and did it use the same name?"
    )]
    ShmNotFound {
        /// The segment's name.
        name: String,
    },

    /// The shared-memory file system has too little free space for the segment.
    #[error(
        "shared-memory segment {name:?} needs {needed} bytes but {dir} has only {available} bytes \
         free; in Docker give the container more with `--shm-size=<bytes>` (e.g. --shm-size=16g) \
         or share the host's with `--ipc=host`; in Kubernetes mount an emptyDir with medium: Memory \
         at /dev/shm; or remove stale segments (`gpufeed shm gc`)"
    )]
    ShmNoSpace {
        /// The segment's name.
        name: String,
        /// The directory holding the segments (normally `/dev/shm`).
        dir: PathBuf,
        /// Bytes the segment needs.
        needed: u64,
        /// Bytes free on that file system when the reservation failed.
        available: u64,
    },

    /// The segment belongs to another user.
    #[error(
        "shared-memory segment {name:?} belongs to uid {owner_uid}, not to us (uid {our_uid}); \
         refusing to map memory another user controls: run both processes as the same user"
    )]
    ShmForeignOwner {
        /// The segment's name.
        name: String,
        /// Its owner.
        owner_uid: u32,
        /// Our effective uid.
        our_uid: u32,
    },

    /// The segment is readable or writable by group or others.
    #[error(
        "shared-memory segment {name:?} has mode {mode:04o}, open to group or others; refusing \
         it because another user could have written it: recreate it with mode 0600"
    )]
    ShmInsecureMode {
        /// The segment's name.
        name: String,
        /// Its permission bits.
        mode: u32,
    },

    /// The segment is smaller than the caller expected.
    #[error(
        "shared-memory segment {name:?} is {len} bytes, smaller than the {expected} expected; \
         its creator may still be setting it up, or it is a different segment of the same name"
    )]
    ShmTooSmall {
        /// The segment's name.
        name: String,
        /// Its size.
        len: u64,
        /// The size expected.
        expected: u64,
    },

    /// A memfd received from another process is not sealed against shrinking.
    #[error(
        "the shared-memory fd is not sealed against shrinking (F_SEAL_SHRINK), so its sender could \
         truncate it under us (SIGBUS); create it with ShmSegment::anonymous, which seals it"
    )]
    ShmUnsealed,

    /// Locking the memory would exceed `RLIMIT_MEMLOCK`.
    #[error(
        "locking {requested} bytes would exceed the memlock limit (soft {}, hard {}, {locked} bytes \
         already locked by this process); raise it with `ulimit -l unlimited` (Docker: \
         `--ulimit memlock=-1`, systemd: LimitMEMLOCK=infinity, or /etc/security/limits.conf), \
         or lock less",
        limit_text(*.soft),
        limit_text(*.hard)
    )]
    MemlockLimit {
        /// Bytes asked for (rounded to whole pages).
        requested: u64,
        /// Bytes this process had locked already.
        locked: u64,
        /// Soft limit in bytes, `None` for unlimited.
        soft: Option<u64>,
        /// Hard limit in bytes, `None` for unlimited.
        hard: Option<u64>,
    },

    /// Locking this much would leave the machine too little memory (the kernel would OOM-kill
    /// a process, likely this one, instead of refusing).
    #[error(
        "locking {requested} bytes would leave the machine too little memory: {available} bytes \
         are available (MemAvailable) and {margin} must stay free; lock less (a smaller file or \
         range) or free memory first"
    )]
    NotEnoughMemory {
        /// Bytes asked for (rounded to whole pages).
        requested: u64,
        /// `MemAvailable` now.
        available: u64,
        /// Bytes that must stay available.
        margin: u64,
    },

    /// A file to be read into the page cache is larger than the machine's memory.
    #[error(
        "{} is {size} bytes, more than this machine's memory ({mem_total} bytes, MemTotal): it \
         can never be in the page cache whole, and reading it through would only push everything \
         else out; warm the files (or a smaller file) you need next, or read it with a loader",
        .path.display()
    )]
    FileLargerThanMemory {
        /// The file.
        path: PathBuf,
        /// Its size in bytes.
        size: u64,
        /// `MemTotal` in bytes.
        mem_total: u64,
    },

    /// The file changed since it was mapped.
    #[error(
        "{} changed while mapped ({what}): a file that shrinks under a mapping raises SIGBUS; \
         map files that are no longer written, or read them with a reader instead",
        .path.display()
    )]
    FileChanged {
        /// The file.
        path: PathBuf,
        /// What changed, e.g. `"size 100 -> 50"`.
        what: String,
    },

    /// An opened file's contents changed since it was opened (its size or modification time,
    /// or it is another file: [`FileIdentity::content_difference`](crate::FileIdentity::content_difference)).
    #[error("{} changed since it was opened ({what}): open it again", .path.display())]
    ChangedSinceOpened {
        /// The file.
        path: PathBuf,
        /// What changed, e.g. `"size 100 -> 50 bytes"`.
        what: String,
    },

    /// An alignment is not a power of two.
    #[error("alignment {align} is not a power of two; use 64, 256, 4096, 2 MiB, ...")]
    InvalidAlignment {
        /// The alignment given.
        align: usize,
    },

    /// The operation is not supported by this kernel or file system.
    #[error("{what} is not supported here: {reason}")]
    Unsupported {
        /// The operation.
        what: &'static str,
        /// Why, in words.
        reason: String,
    },

    /// Memory could not be allocated.
    #[error("could not allocate {len} bytes aligned to {align}: out of memory")]
    OutOfMemory {
        /// Bytes asked for.
        len: usize,
        /// Alignment asked for.
        align: usize,
    },
}

impl Error {
    /// An [`Error::Io`] for `op` on `path`.
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<Option<PathBuf>>,
        source: impl Into<io::Error>,
    ) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source: source.into(),
        }
    }

    /// Maps the usual errors of opening `path` to their own variants (`NotFound`,
    /// `IsDirectory`, else `Io` naming the open): for crates above that open files themselves.
    pub fn open(path: &std::path::Path, source: io::Error) -> Self {
        match source.kind() {
            io::ErrorKind::NotFound => Error::NotFound { path: path.into() },
            io::ErrorKind::IsADirectory => Error::IsDirectory { path: path.into() },
            _ => Error::io("open", Some(path.into()), source),
        }
    }

    /// The raw OS error number, where the error came from the kernel.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

fn path_or_dash(path: &Option<PathBuf>) -> String {
    path.as_ref()
        .map_or_else(|| "-".to_owned(), |p| p.display().to_string())
}

/// Formats an rlimit value, `None` meaning unlimited.
pub(crate) fn limit_text(limit: Option<u64>) -> String {
    match limit {
        None => "unlimited".to_owned(),
        Some(bytes) => format!("{bytes} bytes"),
    }
}

/// Puts `path` into an error that lacks one (an `Io`, `ResidencyUnknown` or `RangePastEof`
/// raised on a descriptor).
pub(crate) fn with_path(err: Error, path: &Path) -> Error {
    match err {
        Error::ResidencyUnknown { path: None, reason } => Error::ResidencyUnknown {
            path: Some(path.into()),
            reason,
        },
        Error::Io {
            op,
            path: None,
            source,
        } => Error::Io {
            op,
            path: Some(path.into()),
            source,
        },
        Error::RangePastEof {
            path: p,
            offset,
            len,
            file_len,
        } if p.as_os_str().is_empty() => Error::RangePastEof {
            path: path.into(),
            offset,
            len,
            file_len,
        },
        other => other,
    }
}
