//! The umbrella error: every capability crate's error, so that `?` from any of them goes into
//! one type.

/// Result alias of the facade.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in gpufeed. Each capability crate's error converts into it
/// (`?` works across them); a load's error inside a capability's is always [`Error::Load`]
/// (a missing file is `Error::Load(gpufeed_load::Error::Os(..))` whichever crate met it).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Loads and saves, and every layer below: files, reads, pinned memory, the GPU, settings
    /// ([`gpufeed_load::Error`]).
    #[error(transparent)]
    Load(gpufeed_load::Error),

    /// Shared-memory rings and rendezvous (gpufeed-ipc).
    #[error(transparent)]
    Ipc(#[from] gpufeed_ipc::Error),

    /// Checkpoints: headers, indexes, mixed saves ([`gpufeed_safetensors::Error`]).
    #[cfg(feature = "safetensors")]
    #[error(transparent)]
    Safetensors(gpufeed_safetensors::Error),

    /// The batch loader: records, batches, workers ([`gpufeed_data::Error`]).
    #[cfg(feature = "data")]
    #[error(transparent)]
    Data(gpufeed_data::Error),

    /// Several GPUs: ranks that failed or disagree ([`gpufeed_multi::Error`]).
    #[cfg(feature = "multi")]
    #[error(transparent)]
    Multi(gpufeed_multi::Error),

    /// The case studies ([`gpufeed_frames::Error`]).
    #[cfg(feature = "frames")]
    #[error(transparent)]
    Frames(gpufeed_frames::Error),
}

gpufeed_load::load_error_conversions!(Error);

#[cfg(feature = "safetensors")]
impl From<gpufeed_safetensors::Error> for Error {
    fn from(e: gpufeed_safetensors::Error) -> Self {
        match e {
            gpufeed_safetensors::Error::Load(e) => Error::Load(e),
            other => Error::Safetensors(other),
        }
    }
}

#[cfg(feature = "data")]
impl From<gpufeed_data::Error> for Error {
    fn from(e: gpufeed_data::Error) -> Self {
        match e {
            gpufeed_data::Error::Load(e) => Error::Load(e),
            gpufeed_data::Error::Ipc(e) => Error::Ipc(e),
            other => Error::Data(other),
        }
    }
}

#[cfg(feature = "multi")]
impl From<gpufeed_multi::Error> for Error {
    fn from(e: gpufeed_multi::Error) -> Self {
        match e {
            gpufeed_multi::Error::Load(e) => Error::Load(e),
            gpufeed_multi::Error::Ipc(e) => Error::Ipc(e),
            gpufeed_multi::Error::Safetensors(e) => e.into(),
            other => Error::Multi(other),
        }
    }
}

#[cfg(feature = "frames")]
impl From<gpufeed_frames::Error> for Error {
    fn from(e: gpufeed_frames::Error) -> Self {
        match e {
            gpufeed_frames::Error::Load(e) => Error::Load(e),
            gpufeed_frames::Error::Ipc(e) => Error::Ipc(e),
            gpufeed_frames::Error::Data(e) => e.into(),
            other => Error::Frames(other),
        }
    }
}

impl Error {
    /// Whether the error means no GPU can be used here (no driver, no device).
    pub fn is_no_gpu(&self) -> bool {
        matches!(self, Error::Load(e) if e.is_no_gpu())
    }

    /// The load's error, where it is one ([`Error::Load`]): the files, reads, pinned memory,
    /// GPU and settings errors of every capability.
    pub fn as_load(&self) -> Option<&gpufeed_load::Error> {
        match self {
            Error::Load(e) => Some(e),
            _ => None,
        }
    }
}
