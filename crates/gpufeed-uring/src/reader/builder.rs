//! The reader's settings: [`ReaderBuilder`] and [`Direct`].

use super::{ReadStats, Reader};
use std::io;

use gpufeed_os::{Fallback, Refused};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::fault::{FaultEngine, FaultPlan};
use crate::probe::{Backend, BackendKind, Probe};
use crate::threads::ThreadEngine;
use crate::uring::UringEngine;

/// Whether files are read with `O_DIRECT` (bypassing the page cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Direct {
    /// Always; a file system that refuses it is an error ([`Error::DirectUnsupported`]).
    On,
    /// Never: buffered reads through the page cache.
    Off,
    /// `O_DIRECT` for files mostly absent from the page cache on file systems that accept it;
    /// buffered otherwise, with the reason in [`ReadStats::files`].
    #[default]
    Auto,
}

/// Builds a [`Reader`].
#[derive(Debug, Clone)]
pub struct ReaderBuilder {
    pub(super) queue_depth: usize,
    pub(super) block_bytes: usize,
    pub(super) direct: Direct,
    pub(super) backend: Backend,
    pub(super) probe: Option<Probe>,
    pub(super) fault: Option<FaultPlan>,
    pub(super) async_buffered: bool,
    pub(super) register_buffers: bool,
    pub(super) inline_memory_files: bool,
}

impl Default for ReaderBuilder {
    fn default() -> Self {
        ReaderBuilder {
            queue_depth: 32,
            block_bytes: 1 << 20,
            direct: Direct::Auto,
            backend: Backend::Auto,
            probe: None,
            fault: None,
            async_buffered: true,
            register_buffers: false,
            inline_memory_files: false,
        }
    }
}

impl ReaderBuilder {
    /// Reads in flight at once (default 32).
    pub fn queue_depth(mut self, depth: usize) -> Self {
        self.queue_depth = depth.max(1);
        self
    }

    /// Largest single read (default 1 MiB); requests are split into pieces of this size.
    pub fn block_bytes(mut self, bytes: usize) -> Self {
        self.block_bytes = bytes.max(4096);
        self
    }

    /// `O_DIRECT` on, off, or decided per file (default [`Direct::Auto`]).
    pub fn direct(mut self, direct: Direct) -> Self {
        self.direct = direct;
        self
    }

    /// The backend (default [`Backend::Auto`]).
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Test hook, not API: uses this probe result instead of probing the kernel (to exercise
    /// the fallback path on a machine where io_uring works).
    #[doc(hidden)]
    pub fn probe_override(mut self, probe: Probe) -> Self {
        self.probe = Some(probe);
        self
    }

    /// Test hook, not API: injects faults into every read (see `FaultPlan`).
    #[doc(hidden)]
    pub fn fault_injection(mut self, plan: FaultPlan) -> Self {
        self.fault = Some(plan);
        self
    }

    /// io_uring only: run buffered reads on the kernel's worker threads (`IOSQE_ASYNC`), so
    /// copies out of the page cache proceed in parallel (default on).
    pub fn async_buffered(mut self, on: bool) -> Self {
        self.async_buffered = on;
        self
    }

    /// Reads of files in memory (on tmpfs, such as `/dev/shm`, or ramfs), opened buffered,
    /// run on the calling thread (`pread`) instead of through the backend (default off).
    /// io_uring cannot try such a read without blocking (these file systems refuse
    /// `RWF_NOWAIT`), so it hands every one to a kernel worker thread and wakes the caller when
    /// it is done: for a caller that has threads of its own reading many small files (a batch
    /// loader's workers, each with a reader), those hand-offs cost more than the copies. On the
    /// development VM a worker read a tmpfs folder of 106 KiB files at 2.5-2.9 GB/s through
    /// io_uring, 1.1-1.2 cores busy; on the calling thread at 3.7-3.9 GB/s on one core
    /// (`examples/batch_rate.rs` of gpufeed-data). Leave it off for a thread that relies on
    /// the backend to copy several large reads at once.
    pub fn inline_memory_files(mut self, on: bool) -> Self {
        self.inline_memory_files = on;
        self
    }

    /// io_uring only: allocate the reader's bounce buffers up front and register them with the
    /// ring (`IORING_REGISTER_BUFFERS`), so bounced O_DIRECT reads are `READ_FIXED` (no page
    /// pinning per read). Registered buffers count against `RLIMIT_MEMLOCK` without
    /// `CAP_IPC_LOCK`; where registration is refused the reader works unregistered and says
    /// why in [`ReadStats::fallbacks`]. Default off.
    pub fn register_buffers(mut self, on: bool) -> Self {
        self.register_buffers = on;
        self
    }

    /// Builds the reader, choosing the backend once.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when io_uring is asked for (builder or
    /// `GPUFEED_IO_BACKEND=uring`) but cannot run here.
    pub fn build(self) -> Result<Reader> {
        let mut fallbacks = Vec::new();
        let backend =
            crate::probe::resolve(self.backend, &mut fallbacks, "reads run on a thread pool");
        let default_threads = {
            let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
            self.queue_depth.min(2 * cores).clamp(2, 64)
        };
        let probe = || self.probe.clone().unwrap_or_else(Backend::probe);
        let (engine, kind): (Box<dyn Engine>, BackendKind) = match backend {
            Backend::Threads(n) => {
                let n = if n == 0 { default_threads } else { n };
                (
                    Box::new(ThreadEngine::new(n, self.queue_depth).map_err(threads_failed)?),
                    BackendKind::Threads(n),
                )
            }
            Backend::IoUring => match probe().io_uring {
                Ok(()) => (Box::new(self.uring()?), BackendKind::IoUring),
                Err(why) => {
                    return Err(Error::BackendUnavailable {
                        backend: "io_uring",
                        reason: why.to_string(),
                    });
                }
            },
            Backend::Auto => match probe().io_uring {
                Ok(()) => (Box::new(self.uring()?), BackendKind::IoUring),
                Err(why) => {
                    Fallback::new(
                        Refused::IoUring,
                        why.to_string(),
                        format!("reads run on a pool of {default_threads} threads"),
                    )
                    .push_once(&mut fallbacks);
                    (
                        Box::new(
                            ThreadEngine::new(default_threads, self.queue_depth)
                                .map_err(threads_failed)?,
                        ),
                        BackendKind::Threads(default_threads),
                    )
                }
            },
        };
        let engine: Box<dyn Engine> = match self.fault.clone() {
            Some(plan) => Box::new(FaultEngine::new(engine, plan)),
            None => engine,
        };
        let mut reader = Reader {
            engine,
            files: Vec::new(),
            reported: Vec::new(),
            opened: 0,
            bounce_free: Vec::new(),
            bounce_made: 0,
            session_gen: 0,
            stats: ReadStats {
                backend: kind,
                bytes: 0,
                seconds: 0.0,
                short_reads: 0,
                retries: 0,
                registered_buffers: 0,
                files: Vec::new(),
                fallbacks,
            },
            cfg: self,
        };
        if reader.cfg.register_buffers {
            reader.register_bounce_buffers()?;
        }
        Ok(reader)
    }

    fn uring(&self) -> Result<UringEngine> {
        UringEngine::new(self.queue_depth, self.async_buffered).map_err(|e| {
            Error::BackendUnavailable {
                backend: "io_uring",
                reason: format!("ring setup failed after a successful probe: {e}"),
            }
        })
    }
}

fn threads_failed(source: io::Error) -> Error {
    Error::Backend {
        op: "start read threads",
        source,
    }
}
