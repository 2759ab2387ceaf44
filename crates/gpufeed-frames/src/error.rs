//! The errors of the case studies: the loader's, the batch loader's and the ring's, plus a GPU
//! result that differs from the CPU's.

/// Result alias of gpufeed-frames.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong in the frame pipeline or the hybrid loader.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The loads (and every layer below: files, reads, pinned memory, the GPU).
    #[error(transparent)]
    Load(gpufeed_load::Error),

    /// The batch loader (the hybrid loader's batches).
    #[error(transparent)]
    Data(gpufeed_data::Error),

    /// The shared-memory ring (gpufeed-ipc).
    #[error(transparent)]
    Ipc(#[from] gpufeed_ipc::Error),

    /// A result computed on the GPU differs from the CPU's reference for the same input (a
    /// sampled check of the frame pipeline's kernel): a bug or a faulty GPU, never input.
    #[error("the GPU's result differs from the CPU's reference: {what}")]
    ResultMismatch {
        /// Where: the frame, plane, row and pixel.
        what: String,
    },
}

gpufeed_load::load_error_conversions!(Error);

impl From<gpufeed_data::Error> for Error {
    /// The batch loader's error; the loader's and the ring's inside it stay theirs.
    fn from(e: gpufeed_data::Error) -> Self {
        match e {
            gpufeed_data::Error::Load(e) => Error::Load(e),
            gpufeed_data::Error::Ipc(e) => Error::Ipc(e),
            other => Error::Data(other),
        }
    }
}

impl Error {
    /// Whether the error means no GPU can be used here (no driver, no device).
    pub fn is_no_gpu(&self) -> bool {
        match self {
            Error::Load(e) => e.is_no_gpu(),
            Error::Data(e) => e.is_no_gpu(),
            _ => false,
        }
    }
}
