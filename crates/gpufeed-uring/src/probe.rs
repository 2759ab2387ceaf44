//! Which backends work here, and why not.

use std::fmt;

/// The backend a [`crate::Reader`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Backend {
    /// io_uring where it works, else the thread pool (the reason is recorded in the stats). The
    /// environment variable `GPUFEED_IO_BACKEND=uring|threads` overrides it. Decided once, when
    /// the reader is built: a reader never switches backends mid-run.
    #[default]
    Auto,
    /// io_uring, or an error saying why it cannot run.
    IoUring,
    /// `pread` on this many threads.
    Threads(usize),
}

/// What the backend that runs is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendKind {
    /// io_uring.
    IoUring,
    /// The thread pool, with its thread count.
    Threads(usize),
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendKind::IoUring => write!(f, "io_uring"),
            BackendKind::Threads(n) => write!(f, "threads({n})"),
        }
    }
}

/// Why io_uring cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum UringUnavailable {
    /// `ENOSYS`: the kernel has no io_uring (before 5.1, or built without it).
    NoKernelSupport,
    /// `kernel.io_uring_disabled` is 1 (only the `io_uring_group` may) or 2 (nobody may).
    DisabledBySysctl(u32),
    /// `EPERM`/`EACCES` while the sysctl allows it: a seccomp filter refuses `io_uring_setup`
    /// (Docker's and containerd's default profiles do).
    Seccomp(i32),
    /// `ENOMEM`: the ring could not be allocated (kernels before 5.12 charge it to
    /// `RLIMIT_MEMLOCK`).
    Memlock,
    /// The kernel lacks `IORING_OP_READ` (before 5.6).
    NoReadOpcode,
    /// Turned off on purpose (`GPUFEED_IO_BACKEND=threads`, or a test's probe override).
    Forced(String),
    /// Anything else.
    Other(String),
}

impl fmt::Display for UringUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UringUnavailable::NoKernelSupport => write!(
                f,
                "io_uring_setup returned ENOSYS: the kernel has no io_uring (needs Linux 5.6+ built with CONFIG_IO_URING)"
            ),
            UringUnavailable::DisabledBySysctl(v) => write!(
                f,
                "disabled by sysctl kernel.io_uring_disabled={v}; set it to 0 (`sysctl -w kernel.io_uring_disabled=0`){}",
                if *v == 1 {
                    " or add this user to the io_uring_group"
                } else {
                    ""
                }
            ),
            UringUnavailable::Seccomp(errno) => write!(
                f,
                "io_uring_setup refused with {} although kernel.io_uring_disabled allows it: a seccomp filter blocks it (Docker's default profile does; run with a profile that allows io_uring_setup/io_uring_enter/io_uring_register)",
                std::io::Error::from_raw_os_error(*errno)
            ),
            UringUnavailable::Memlock => write!(
                f,
                "io_uring_setup returned ENOMEM: the ring could not be allocated; on kernels before 5.12 raise `ulimit -l`"
            ),
            UringUnavailable::NoReadOpcode => {
                write!(f, "the kernel lacks IORING_OP_READ (needs Linux 5.6+)")
            }
            UringUnavailable::Forced(why) => write!(f, "turned off: {why}"),
            UringUnavailable::Other(why) => write!(f, "{why}"),
        }
    }
}

/// What [`Backend::probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Whether io_uring works, and if not, why.
    pub io_uring: Result<(), UringUnavailable>,
}

impl Probe {
    /// A probe result that says io_uring is unavailable for `why` (tests and callers that want
    /// the fallback path without the kernel refusing).
    pub fn uring_unavailable(why: impl Into<String>) -> Self {
        Probe {
            io_uring: Err(UringUnavailable::Forced(why.into())),
        }
    }
}

/// The environment variable that forces a backend.
pub const BACKEND_ENV: &str = "GPUFEED_IO_BACKEND";

impl Backend {
    /// Tries io_uring here: sets up a small ring and checks that it can read.
    ///
    /// # Example
    /// ```
    /// match gpufeed_uring::Backend::probe().io_uring {
    ///     Ok(()) => println!("io_uring works"),
    ///     Err(why) => println!("threads only: {why}"),
    /// }
    /// ```
    pub fn probe() -> Probe {
        Probe {
            io_uring: probe_uring(),
        }
    }

    /// The backend `GPUFEED_IO_BACKEND` asks for, if set: `uring` or `threads`.
    pub fn from_env() -> Option<Backend> {
        match std::env::var(BACKEND_ENV).ok()?.trim() {
            "uring" | "io_uring" => Some(Backend::IoUring),
            "threads" => Some(Backend::Threads(0)),
            other => {
                tracing::warn!(
                    value = other,
                    "ignoring {BACKEND_ENV}: use `uring` or `threads`"
                );
                None
            }
        }
    }
}

/// The backend to use for `asked`: `Auto` gives way to `GPUFEED_IO_BACKEND` when set, and a
/// forced thread pool is recorded in `fallbacks` (`instead` says what then runs on threads).
pub(crate) fn resolve(
    asked: Backend,
    fallbacks: &mut Vec<gpufeed_os::Fallback>,
    instead: &str,
) -> Backend {
    match (asked, Backend::from_env()) {
        (Backend::Auto, Some(env)) => {
            if env != Backend::IoUring {
                fallbacks.push(gpufeed_os::Fallback::new(
                    gpufeed_os::Refused::IoUring,
                    format!("{BACKEND_ENV}=threads"),
                    instead,
                ));
            }
            env
        }
        (b, _) => b,
    }
}

fn probe_uring() -> Result<(), UringUnavailable> {
    let ring = match io_uring::IoUring::new(2) {
        Ok(ring) => ring,
        Err(e) => {
            let errno = e.raw_os_error().unwrap_or(0);
            return Err(match errno {
                libc::ENOSYS => UringUnavailable::NoKernelSupport,
                libc::EPERM | libc::EACCES => match sysctl_disabled() {
                    Some(v) if v > 0 => UringUnavailable::DisabledBySysctl(v),
                    _ => UringUnavailable::Seccomp(errno),
                },
                libc::ENOMEM => UringUnavailable::Memlock,
                _ => UringUnavailable::Other(format!("io_uring_setup failed: {e}")),
            });
        }
    };
    let mut probe = io_uring::Probe::new();
    if ring.submitter().register_probe(&mut probe).is_ok()
        && !probe.is_supported(io_uring::opcode::Read::CODE)
    {
        return Err(UringUnavailable::NoReadOpcode);
    }
    Ok(())
}

fn sysctl_disabled() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()?
        .trim()
        .parse()
        .ok()
}
