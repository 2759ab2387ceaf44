//! The errors of loads on several GPUs: the loader's, the checkpoint's, the rendezvous's, plus
//! ranks that failed or disagree.

/// Result alias of gpufeed-multi.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong in a load on several GPUs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The loads (and every layer below: files, reads, pinned memory, the GPU).
    #[error(transparent)]
    Load(gpufeed_load::Error),

    /// A checkpoint (tensor-parallel loads).
    #[error(transparent)]
    Safetensors(gpufeed_safetensors::Error),

    /// The ranks' rendezvous (gpufeed-ipc): a rank that never arrived, died or left.
    #[error(transparent)]
    Ipc(#[from] gpufeed_ipc::Error),

    /// Another rank of a job failed its part of a collective load ([`crate::RankLoader`]);
    /// its own process says why.
    #[error("rank {rank} failed its part of the load (its own output says why); nothing was kept")]
    RankFailed {
        /// The rank.
        rank: usize,
    },

    /// The ranks of a job were given different inputs for one collective load.
    #[error(
        "rank {rank} was given another {what} than rank 0: every rank must pass the same one, \
         in the same order of calls"
    )]
    RanksDisagree {
        /// The first rank that differs.
        rank: usize,
        /// What differs.
        what: &'static str,
    },
}

gpufeed_load::load_error_conversions!(Error);

impl From<gpufeed_safetensors::Error> for Error {
    /// A checkpoint's error; the loader's inside it stays the loader's (`Error::Load`).
    fn from(e: gpufeed_safetensors::Error) -> Self {
        match e {
            gpufeed_safetensors::Error::Load(e) => Error::Load(e),
            other => Error::Safetensors(other),
        }
    }
}

impl Error {
    /// Whether the error means no GPU can be used here (no driver, no device).
    pub fn is_no_gpu(&self) -> bool {
        match self {
            Error::Load(e) => e.is_no_gpu(),
            Error::Safetensors(e) => e.is_no_gpu(),
            _ => false,
        }
    }
}
