//! Route choice and the checks of a load: what `Strategy::Auto` picks and why, sizes, spans, identity.

use std::ops::Range;
use std::path::Path;

use gpufeed_cuda::TransferOptions;
use gpufeed_os::OpenedFile;
use gpufeed_os::cache;
use gpufeed_uring::Backend;

use crate::error::{Error, Result};
use crate::options::{Route, Strategy};

/// A staged load's error with the file source's own error typed again: the reader's
/// ([`Error::Read`]: a file that ended early, a failed read) rather than the scheduler's
/// wrapper around it.
pub fn read_error(e: gpufeed_cuda::Error) -> Error {
    let gpufeed_cuda::Error::Source { offset, source } = e else {
        return e.into();
    };
    #[cfg(feature = "object")]
    let source = match source.downcast::<gpufeed_object::Error>() {
        Ok(object) => return Error::Object(*object),
        Err(source) => source,
    };
    match source.downcast::<gpufeed_uring::Error>() {
        Ok(read) => Error::Read(*read),
        Err(source) => match source.downcast::<Error>() {
            Ok(facade) => *facade,
            Err(source) => gpufeed_cuda::Error::Source { offset, source }.into(),
        },
    }
}

/// What `Strategy::Auto` picks for bytes `range` of `path` (a file of `file_len` bytes) now,
/// and why: the same residency estimate and rule as a load.
pub fn auto_choice(file: &OpenedFile, range: Range<u64>) -> (Strategy, String) {
    let (route, why) = choose(file, residency_of(file, range));
    (route.strategy(), why)
}

/// What `Strategy::Auto` picks for `file` with `residency` of it cached, and why (the rule a
/// load applies to its sample).
pub fn auto_choice_at(file: &OpenedFile, residency: Option<f64>) -> (Strategy, String) {
    let (route, why) = choose(file, residency);
    (route.strategy(), why)
}

/// The share of `range` in the page cache, estimated from samples (an exact count walks every
/// page of the range, which costs a noticeable share of a warm load of a large file); `None`
/// where the kernel does not tell.
pub(crate) fn residency_of(file: &OpenedFile, range: Range<u64>) -> Option<f64> {
    cache::residency_estimate_of(file.file(), range)
        .ok()
        .map(|r| r.fraction())
}

/// Picks a strategy for `file`, `residency` of it cached.
pub(crate) fn choose(file: &OpenedFile, residency: Option<f64>) -> (Route, String) {
    let file_len = file.len();
    let resident = residency.unwrap_or(0.0);
    if resident >= 0.9 {
        return (
            Route::Staged,
            format!(
                "{:.0}% of the file is in the page cache: copies out of the cache into pinned staging on every core, overlapped with the uploads",
                resident * 100.0
            ),
        );
    }
    let available = gpufeed_os::sys::mem_available().unwrap_or(u64::MAX);
    // Probing sets up a ring: once per process is enough (the answer does not change).
    static URING: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let uring = *URING.get_or_init(|| Backend::probe().io_uring.is_ok());
    let dio = gpufeed_os::align::dio_alignment(file.file()).is_ok_and(|d| d.supported());
    if resident < 0.1 || file_len > available / 2 {
        // Real GPUDirect Storage (peer-to-peer, never cuFile's compatibility mode, which is
        // slower than gpufeed's own O_DIRECT path) for data not in the page cache.
        if resident < 0.1 && dio && crate::gds::gds_active(file) {
            return (
                Route::Gds,
                format!(
                    "{:.0}% cached, and cuFile reads this file system peer-to-peer (GPUDirect Storage): storage -> GPU without host memory",
                    resident * 100.0
                ),
            );
        }
        if dio {
            return (
                Route::Direct,
                format!(
                    "{:.0}% cached{}: O_DIRECT reads{} into pinned staging, no page-cache copy",
                    resident * 100.0,
                    if file_len > available / 2 {
                        ", larger than half the available memory"
                    } else {
                        ""
                    },
                    if uring {
                        " through io_uring"
                    } else {
                        " (thread pool: io_uring unavailable)"
                    }
                ),
            );
        }
        return (
            Route::Staged,
            format!(
                "{:.0}% cached, and the file system refuses O_DIRECT: buffered reads into pinned staging",
                resident * 100.0
            ),
        );
    }
    (
        Route::Staged,
        format!(
            "{:.0}% cached: buffered reads serve the cached part from memory and read the rest",
            resident * 100.0
        ),
    )
}

/// Checks that a destination of `capacity` bytes is exactly as long as the `len` bytes it
/// is to hold.
pub fn exactly(len: u64, capacity: usize) -> Result<()> {
    if len != capacity as u64 {
        return Err(gpufeed_cuda::Error::OutOfBounds {
            len,
            offset: 0,
            capacity: capacity as u64,
        }
        .into());
    }
    Ok(())
}

/// Checks that `len` bytes at `offset` fit a destination of `capacity` bytes.
pub fn fits(len: u64, offset: usize, capacity: usize) -> Result<()> {
    if (offset as u64)
        .checked_add(len)
        .is_none_or(|end| end > capacity as u64)
    {
        return Err(gpufeed_cuda::Error::OutOfBounds {
            len,
            offset: offset as u64,
            capacity: capacity as u64,
        }
        .into());
    }
    Ok(())
}

/// The range from the first span's start to the last one's end (`0..0` for none).
pub(crate) fn hull_of(spans: &[Range<u64>]) -> Range<u64> {
    match (
        spans.iter().map(|s| s.start).min(),
        spans.iter().map(|s| s.end).max(),
    ) {
        (Some(a), Some(b)) => a..b,
        _ => 0..0,
    }
}

/// Checks that every span lies inside `file` (as opened); returns the spans' bytes together.
pub(crate) fn check_spans(file: &OpenedFile, spans: &[Range<u64>]) -> Result<u64> {
    let (path, file_len) = (file.path(), file.len());
    let mut total = 0u64;
    for s in spans {
        if s.start > s.end || s.end > file_len {
            return Err(gpufeed_os::Error::RangePastEof {
                path: path.into(),
                offset: s.start,
                len: s.end.saturating_sub(s.start),
                file_len,
            }
            .into());
        }
        total += s.end - s.start;
    }
    Ok(total)
}

/// [`Error::FileChangedDuringLoad`] when `file` was written, truncated or extended since it
/// was opened (asked of its descriptor: a file renamed over its path is not this one).
pub fn check_unchanged(file: &OpenedFile) -> Result<()> {
    match file.changed()? {
        Some(what) => Err(Error::FileChangedDuringLoad {
            path: file.path().into(),
            what,
        }),
        None => Ok(()),
    }
}

/// The length of the regular file at `path` (stat, no open).
pub fn file_len(path: &Path) -> Result<u64> {
    Ok(gpufeed_os::file::stat_regular(path)?.size)
}

/// Transfer settings for loads of at most `bytes`: where those are small, chunks no larger
/// than their pieces ([`TransferOptions::piece_bytes_for`]), so that the staging reserved is
/// about the size of the load (5 MiB for a 5 MiB file, not 20 buffers of 4 MiB).
pub(crate) fn sized_for(cfg: TransferOptions, bytes: Option<u64>) -> TransferOptions {
    match bytes {
        Some(b) => {
            let piece = cfg.piece_bytes_for(b);
            cfg.with_chunk_bytes(piece.min(cfg.chunk_bytes))
        }
        None => cfg,
    }
}

/// Whether loads with `strategy` go through pinned staging (all but `Registered`, which stages
/// only where registration is refused).
pub(crate) fn stages(strategy: Strategy) -> bool {
    strategy != Strategy::Registered
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A staged load whose file ends early reports the reader's typed error, not the
    /// scheduler's wrapper; other sources' errors keep the wrapper and their chain.
    #[test]
    fn a_fill_sources_read_error_is_typed_again() {
        let eof = gpufeed_uring::Error::UnexpectedEof {
            path: "f.bin".into(),
            offset: 4096,
            got: 10,
            want: 4096,
        };
        let wrapped = gpufeed_cuda::Error::Source {
            offset: 4096,
            source: Box::new(eof),
        };
        assert!(
            matches!(
                read_error(wrapped),
                Error::Read(gpufeed_uring::Error::UnexpectedEof { got: 10, .. })
            ),
            "the reader's error"
        );
        let facade = gpufeed_cuda::Error::Source {
            offset: 0,
            source: Box::new(Error::InvalidSetting("x".into())),
        };
        assert!(matches!(read_error(facade), Error::InvalidSetting(_)));
        let other = gpufeed_cuda::Error::Source {
            offset: 7,
            source: "a decoder failed".into(),
        };
        let e = read_error(other);
        assert!(
            matches!(
                &e,
                Error::Cuda(gpufeed_cuda::Error::Source { offset: 7, .. })
            ),
            "{e:?}"
        );
        // `Error::Cuda` is transparent: its source is the wrapper's, the decoder's error.
        let chain = std::error::Error::source(&e).map(ToString::to_string);
        assert_eq!(chain.as_deref(), Some("a decoder failed"));
    }
}
