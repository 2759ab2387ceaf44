//! The one error type of `gpufeed-cuda`.

pub use cudarc::driver::sys::CUresult;

/// Result alias used throughout `gpufeed-cuda`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `gpufeed-cuda`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library is not installed.
    #[error(
        "no CUDA driver: libcuda.so could not be loaded; install the NVIDIA driver (in a \
         container: the NVIDIA container toolkit and --gpus), or run the CPU paths"
    )]
    NoCudaDriver,

    /// No GPU has that ordinal.
    #[error(
        "no CUDA device {ordinal}: this machine has {count} (ordinals 0..{count}); check CUDA_VISIBLE_DEVICES"
    )]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices visible.
        count: usize,
    },

    /// A CUDA driver call failed.
    #[error("{op} failed: {result:?}{}", if *.result == CUresult::CUDA_ERROR_OUT_OF_MEMORY { "; free device memory or transfer less at once" } else { "" })]
    Cuda {
        /// The call.
        op: &'static str,
        /// What the driver returned (`{:?}` prints its name, e.g. `CUDA_ERROR_OUT_OF_MEMORY`).
        result: CUresult,
    },

    /// A transfer range does not fit its source or destination.
    #[error("transfer of {len} bytes at offset {offset} does not fit a buffer of {capacity} bytes")]
    OutOfBounds {
        /// Bytes to move.
        len: u64,
        /// Offset in the buffer.
        offset: u64,
        /// The buffer's size.
        capacity: u64,
    },

    /// An allocation of a [`crate::SharedPool`] too large for another process to map safely
    /// ([`crate::SHARED_MAP_MAX_BYTES`]).
    #[error(
        "{len} bytes cannot be shared with another process: mapping a pool allocation of more \
         than {max} bytes crashes the driver; share it in parts of at most that size"
    )]
    TooLargeToShare {
        /// The allocation's size.
        len: u64,
        /// The most that can be shared.
        max: u64,
    },

    /// NCCL could not be loaded (replicated loads through NCCL need it).
    #[error(
        "NCCL could not be loaded ({tried}): install NCCL 2.14 or later (Debian's libnccl2, or \
         pip's nvidia-nccl-cu12 with its lib folder on LD_LIBRARY_PATH), or point \
         GPUFEED_NCCL_LIBRARY at libnccl.so.2; or copy without NCCL (gpufeed's default)"
    )]
    NcclMissing {
        /// Each library name tried and why it did not load.
        tried: String,
    },

    /// An NCCL call failed (the communicator is aborted).
    #[error("{op} failed: {message} (ncclResult_t {result})")]
    Nccl {
        /// The call.
        op: &'static str,
        /// What NCCL returned (`ncclResult_t`).
        result: i32,
        /// NCCL's name for it and its last message.
        message: String,
    },

    /// A fill source failed to produce its bytes.
    #[error("fill source failed at offset {offset}: {source}")]
    Source {
        /// Where in the source.
        offset: u64,
        /// Its error, as the source returned it (downcast it to the source's own error type).
        #[source]
        source: crate::SourceError,
    },

    /// A fill or drain thread of the scheduler panicked (a panicking `FillSource`, or a bug);
    /// the transfer was abandoned after every copy issued had completed.
    #[error("a {what} thread panicked; the transfer was abandoned")]
    ThreadPanicked {
        /// `"fill"` or `"drain"`.
        what: &'static str,
    },

    /// An upload in parts was stopped by its caller (a part's report asked for it:
    /// [`crate::TransferScheduler::upload_parts`]); the parts not reported landed hold what the
    /// copies left.
    #[error("the upload was stopped by its caller after {landed} of its parts landed")]
    Stopped {
        /// Parts reported landed before it stopped.
        landed: usize,
    },

    /// The scheduler's fill threads could not be started (the process is out of threads or
    /// memory for their stacks).
    #[error(
        "could not start {what}: {reason}; lower TransferOptions::fill_threads or the process's thread count"
    )]
    ThreadStart {
        /// What was being started.
        what: &'static str,
        /// The system's reason.
        reason: String,
    },

    /// An error of pinned memory.
    #[error(transparent)]
    Pinned(#[from] gpufeed_pinned::Error),

    /// nvJPEG could not be loaded (see [`crate::nvjpeg`]).
    #[error(
        "nvJPEG could not be loaded ({tried}); install the CUDA toolkit's libnvjpeg, or pip's \
         nvidia-nvjpeg and point GPUFEED_NVJPEG_LIBRARY at its libnvjpeg.so.13 \
         (site-packages/nvidia/cu13/lib/); or decode on the CPU"
    )]
    NvjpegMissing {
        /// Each library name tried and why it did not load.
        tried: String,
    },

    /// An nvJPEG call failed.
    #[error("{op} failed: {name} (nvjpegStatus_t {status})")]
    Nvjpeg {
        /// The call.
        op: &'static str,
        /// Its `nvjpegStatus_t`.
        status: i32,
        /// The status's name.
        name: &'static str,
    },

    /// A JPEG nvJPEG is not asked to decode ([`crate::nvjpeg::Nvjpeg::decode_batch`]): four
    /// components (CMYK, YCCK), a subsampling it cannot name, or no end-of-image marker
    /// (truncated: nvJPEG would decode the part there is).
    #[error("JPEG not decoded: {reason}")]
    JpegRefused {
        /// What the JPEG is, and what to do.
        reason: String,
    },

    /// A batch's place for image `index` does not hold it ([`crate::nvjpeg::Slot`]): a
    /// caller's mistake, found before anything is decoded.
    #[error("image {index} of the batch: {reason}")]
    JpegSlot {
        /// The image's index in the batch.
        index: usize,
        /// What does not fit.
        reason: String,
    },

    /// cuFile could not be loaded (see [`crate::cufile`]).
    #[error(
        "cuFile (GPUDirect Storage) could not be loaded ({tried}); install the CUDA toolkit's \
         libcufile, or pip's nvidia-cufile (CUDA 13: site-packages/nvidia/cu13/lib/) or \
         nvidia-cufile-cu12 (site-packages/nvidia/cufile/lib/) and point \
         GPUFEED_CUFILE_LIBRARY at its libcufile.so.0; or load with the direct strategy \
         (gpufeed's own O_DIRECT path), which needs no cuFile"
    )]
    CufileMissing {
        /// Each library name tried and why it did not load.
        tried: String,
    },

    /// A cuFile call failed.
    #[error("{op} failed: {name} ({status}): {text}{}", cuda.map_or(String::new(), |c| format!(" (CUresult {c})")))]
    Cufile {
        /// The call.
        op: &'static str,
        /// Its `CUfileOpError`.
        status: i32,
        /// The status's name.
        name: &'static str,
        /// cuFile's text for it.
        text: &'static str,
        /// The CUDA driver's `CUresult` where cuFile says the driver failed.
        cuda: Option<i32>,
    },

    /// A `cuFileRead` failed or the file ended before the bytes asked for.
    #[error("cuFileRead of {len} bytes at offset {offset} failed: {reason}")]
    CufileRead {
        /// Where in the file.
        offset: u64,
        /// Bytes still to read.
        len: usize,
        /// `errno`'s text, cuFile's status, or the file's end.
        reason: String,
    },

    /// A cast the GPU kernels do not do ([`crate::cast`]), or a GPU they cannot run on.
    #[error("cannot cast {from} to {to} on the GPU: {reason}")]
    CastUnsupported {
        /// The source type (safetensors' name).
        from: String,
        /// The destination type.
        to: String,
        /// Why, and what to do instead.
        reason: String,
    },
}

impl Error {
    pub(crate) fn cuda(op: &'static str, err: cudarc::driver::DriverError) -> Self {
        Error::Cuda { op, result: err.0 }
    }

    /// Whether the error means that no GPU can be used here at all.
    pub fn is_no_gpu(&self) -> bool {
        matches!(
            self,
            Error::NoCudaDriver
                | Error::NoDevice { .. }
                | Error::Pinned(gpufeed_pinned::Error::NoCudaDriver)
        ) || self.cu_result() == Some(CUresult::CUDA_ERROR_NO_DEVICE)
    }

    /// The driver's `CUresult`, where a driver call failed (here or in gpufeed-pinned).
    pub fn cu_result(&self) -> Option<CUresult> {
        match self {
            Error::Cuda { result, .. } => Some(*result),
            Error::Pinned(e) => e.cu_result(),
            _ => None,
        }
    }
}

pub(crate) fn driver() -> Result<()> {
    gpufeed_pinned::driver_available().map_err(|_| Error::NoCudaDriver)
}
