//! The errors of loads and saves: every lower layer's, plus files that changed, settings that
//! cannot work and threads that could not start.

use std::path::PathBuf;

/// Result alias of gpufeed-load.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong in a load or a save.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Shared memory, mappings, files (gpufeed-os).
    #[error(transparent)]
    Os(#[from] gpufeed_os::Error),
    /// Reads (gpufeed-uring).
    #[error(transparent)]
    Read(#[from] gpufeed_uring::Error),
    /// Pinned and registered memory (gpufeed-pinned).
    #[error(transparent)]
    Pinned(#[from] gpufeed_pinned::Error),
    /// GPUs and transfers (gpufeed-cuda), including `NoCudaDriver`.
    #[error(transparent)]
    Cuda(#[from] gpufeed_cuda::Error),
    /// Objects in object storage (gpufeed-object; the `object` feature).
    #[cfg(feature = "object")]
    #[error(transparent)]
    Object(#[from] gpufeed_object::Error),
    /// The file changed (replaced, truncated, written) between reading its header and the
    /// end of the load: the bytes on the GPU may mix two versions, so they were dropped.
    #[error(
        "{} changed while it was being loaded ({what}): a writer replaced or modified it, so \
         what was loaded was dropped; load it again once the writer is done",
        .path.display()
    )]
    FileChangedDuringLoad {
        /// The file.
        path: PathBuf,
        /// What changed.
        what: String,
    },

    /// A [`crate::RegisteredFile`] whose file was replaced, truncated or written since it
    /// was registered: the pages kept may no longer be the file's, so nothing was loaded (or
    /// what was loaded was dropped).
    #[error(
        "{} changed since it was registered ({what}): the page-locked pages may no longer be \
         the file's; drop the RegisteredFile and register the file again",
        .path.display()
    )]
    RegisteredFileChanged {
        /// The file.
        path: PathBuf,
        /// What changed.
        what: String,
    },

    /// A list of files whose sizes add up past 2^64 bytes (a sparse file can claim that much).
    #[error("{}: its {size} bytes bring the list past 2^64 bytes ({before} before it)", .path.display())]
    ListTooLarge {
        /// The file that overflows the list.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The bytes of the files before it.
        before: u64,
    },

    /// A setting that cannot work (an option, a size, `RANK`/`WORLD_SIZE`): the message says
    /// which and what to write instead.
    #[error("invalid setting: {0}")]
    InvalidSetting(String),

    /// A thread gpufeed needs could not be started (the process's thread limit?).
    #[error("could not start {what}: {source}; the process may be at its thread limit (ulimit -u)")]
    ThreadStart {
        /// The thread's job.
        what: &'static str,
        /// The error of `std::thread::Builder::spawn`.
        #[source]
        source: std::io::Error,
    },

    /// A thread of gpufeed panicked (a bug: please report it with the message logged above).
    #[error("{what} panicked; what it was doing was abandoned")]
    ThreadPanicked {
        /// The thread's job.
        what: &'static str,
    },
}

impl Error {
    /// Whether the error means no GPU can be used here (no driver, no device).
    pub fn is_no_gpu(&self) -> bool {
        match self {
            Error::Cuda(e) => e.is_no_gpu(),
            Error::Pinned(gpufeed_pinned::Error::NoCudaDriver) => true,
            _ => false,
        }
    }
}

impl From<gpufeed_os::units::BadSize> for Error {
    fn from(e: gpufeed_os::units::BadSize) -> Self {
        Error::InvalidSetting(e.to_string())
    }
}

/// Gives a capability crate's error (an enum with a `Load(gpufeed_load::Error)` variant,
/// declared without `#[from]`) what `?` needs from every layer below: `From` the errors of
/// gpufeed-os (and its `BadSize`), -uring, -pinned, -cuda and gpufeed-load, and `invalid(why)`
/// for [`Error::InvalidSetting`].
#[doc(hidden)]
#[macro_export]
macro_rules! load_error_conversions {
    ($ty:ident) => {
        impl From<$crate::Error> for $ty {
            fn from(e: $crate::Error) -> Self {
                $ty::Load(e)
            }
        }
        impl From<$crate::layers::gpufeed_os::Error> for $ty {
            fn from(e: $crate::layers::gpufeed_os::Error) -> Self {
                $ty::Load(e.into())
            }
        }
        impl From<$crate::layers::gpufeed_os::units::BadSize> for $ty {
            fn from(e: $crate::layers::gpufeed_os::units::BadSize) -> Self {
                $ty::Load(e.into())
            }
        }
        impl From<$crate::layers::gpufeed_uring::Error> for $ty {
            fn from(e: $crate::layers::gpufeed_uring::Error) -> Self {
                $ty::Load(e.into())
            }
        }
        impl From<$crate::layers::gpufeed_pinned::Error> for $ty {
            fn from(e: $crate::layers::gpufeed_pinned::Error) -> Self {
                $ty::Load(e.into())
            }
        }
        impl From<$crate::layers::gpufeed_cuda::Error> for $ty {
            fn from(e: $crate::layers::gpufeed_cuda::Error) -> Self {
                $ty::Load(e.into())
            }
        }
        impl $ty {
            /// A setting that cannot work ([`gpufeed_load::Error::InvalidSetting`]).
            pub fn invalid(why: String) -> Self {
                $ty::Load($crate::Error::InvalidSetting(why))
            }
        }
    };
}
