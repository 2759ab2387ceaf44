//! [`Fallback`]: a slower path taken because a faster one was refused — one type for every
//! layer that degrades instead of failing (the reader, the transfer scheduler, a load's report).

use std::fmt;

/// What was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Refused {
    /// io_uring (an old kernel, seccomp, `kernel.io_uring_disabled`, or
    /// `GPUFEED_IO_BACKEND=threads`): reads ran on a thread pool.
    IoUring,
    /// Registering a reader's bounce buffers with the ring (`IORING_REGISTER_BUFFERS`, which
    /// counts against `RLIMIT_MEMLOCK`).
    RingBuffers,
    /// `O_DIRECT` on this file system.
    DirectIo,
    /// Page-locking a file mapping with CUDA (`cuMemHostRegister`), as some containers, WSL
    /// and drivers refuse.
    HostRegistration,
    /// Reserving pinned staging memory up front (a memlock or page-locked limit, a failed
    /// allocation): staging is then allocated on the way.
    StagingReservation,
    /// Placing threads or memory on the GPU's NUMA node.
    NumaPlacement,
    /// cuFile (GPUDirect Storage): its library, its driver, the file's registration or a
    /// read refused.
    Gds,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Refused::IoUring => "io_uring",
            Refused::RingBuffers => "registered ring buffers",
            Refused::DirectIo => "O_DIRECT",
            Refused::HostRegistration => "host registration (cuMemHostRegister)",
            Refused::StagingReservation => "pinned staging reservation",
            Refused::NumaPlacement => "NUMA placement",
            Refused::Gds => "cuFile (GPUDirect Storage)",
        })
    }
}

/// A slower path taken because a faster one was refused: what was refused, why, and what ran
/// instead. Match on [`Fallback::refused`]; the texts are for people.
///
/// ```
/// use gpufeed_os::{Fallback, Refused};
/// let f = Fallback::new(Refused::IoUring, "seccomp returned EPERM", "reads ran on 8 threads");
/// assert_eq!(f.refused, Refused::IoUring);
/// assert_eq!(f.to_string(), "io_uring refused (seccomp returned EPERM); reads ran on 8 threads");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
pub struct Fallback {
    /// What was refused.
    pub refused: Refused,
    /// Why (the error or the setting that refused it).
    pub reason: String,
    /// What ran instead.
    pub instead: String,
}

impl Fallback {
    /// A fallback from `refused` for `reason`, running `instead`.
    pub fn new(refused: Refused, reason: impl Into<String>, instead: impl Into<String>) -> Self {
        Fallback {
            refused,
            reason: reason.into(),
            instead: instead.into(),
        }
    }

    /// Appends `self` to `list` unless an equal one is there (a load hears of the same refusal
    /// from every reader), and logs it the first time.
    pub fn push_once(self, list: &mut Vec<Fallback>) {
        if !list.contains(&self) {
            tracing::warn!("{self}");
            list.push(self);
        }
    }
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} refused ({}); {}",
            self.refused, self.reason, self.instead
        )
    }
}
