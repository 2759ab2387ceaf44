//! The one error type of `gpufeed-pinned`.

pub use cudarc::driver::sys::CUresult;

/// Result alias used throughout `gpufeed-pinned`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `gpufeed-pinned`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library (`libcuda.so`) is not installed.
    #[error(
        "no CUDA driver: libcuda.so could not be loaded; install the NVIDIA driver (or, in a \
         container, run with the NVIDIA container toolkit), or use the CPU mode of PinnedPool"
    )]
    NoCudaDriver,

    /// A CUDA driver call failed.
    #[error("{op} failed: {result:?}{}", hint_text(*.result))]
    Cuda {
        /// The driver call.
        op: &'static str,
        /// What the driver returned (`{:?}` prints its name, e.g. `CUDA_ERROR_OUT_OF_MEMORY`).
        result: CUresult,
    },

    /// A driver call reported success but returned no memory.
    #[error("{op} returned a null pointer; the driver is in a bad state: restart the process")]
    NullAllocation {
        /// The driver call.
        op: &'static str,
    },

    /// The range is already page-locked (pinned or registered) in this process.
    #[error(
        "[{ptr:#x}, +{len}) is already pinned or registered with CUDA; copy from it directly \
         instead of registering it again"
    )]
    AlreadyRegistered {
        /// Start of the range.
        ptr: usize,
        /// Its length.
        len: usize,
    },

    /// A file mapping that is writable was given where a read-only one is required.
    #[error(
        "only read-only file mappings can be registered (MapMode::ReadOnly, registered with \
         CU_MEMHOSTREGISTER_READ_ONLY); a writable private mapping would copy every page on write"
    )]
    NotReadOnly,

    /// The pool's byte budget is spent.
    #[error(
        "pinned pool budget exhausted: {requested} bytes asked, {in_use} of {budget} in use; \
         return buffers sooner or raise the budget (PoolOptions::budget_bytes)"
    )]
    PoolExhausted {
        /// Bytes asked for (the size class).
        requested: u64,
        /// Bytes handed out now.
        in_use: u64,
        /// The budget.
        budget: u64,
    },

    /// A request larger than the largest size class.
    #[error(
        "{requested} bytes is larger than the pool's largest buffer ({max} bytes); use several buffers"
    )]
    TooLarge {
        /// Bytes asked for.
        requested: usize,
        /// The largest class.
        max: usize,
    },

    /// An error of the layers below.
    #[error(transparent)]
    Os(#[from] gpufeed_os::Error),
}

impl Error {
    pub(crate) fn cuda(op: &'static str, err: cudarc::driver::DriverError) -> Self {
        Error::Cuda { op, result: err.0 }
    }

    /// The driver's `CUresult`, where a driver call failed.
    pub fn cu_result(&self) -> Option<CUresult> {
        match self {
            Error::Cuda { result, .. } => Some(*result),
            _ => None,
        }
    }
}

fn hint_text(result: CUresult) -> &'static str {
    match result {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            "; page-locked memory is limited (containers, WSL): use fewer or smaller buffers"
        }
        CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => "; the range is registered already",
        CUresult::CUDA_ERROR_NOT_PERMITTED | CUresult::CUDA_ERROR_NOT_SUPPORTED => {
            "; this platform refuses host registration: stage through pinned buffers instead"
        }
        _ => "",
    }
}
