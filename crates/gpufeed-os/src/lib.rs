//! # gpufeed-os — layer 0 of gpufeed
//!
//! The operating-system primitives that every other gpufeed crate stands on: shared memory
//! between processes, file mappings, page locking, page-cache hints and residency, aligned
//! buffers and the limits of the machine, and the [`Fallback`] type every layer reports.
//!
//! Depends on no other gpufeed crate, and only on `rustix`, `memmap2`, `libc`, `thiserror`,
//! `tracing` and `serde`: no CUDA, no hwloc, no io_uring (those live in the crates above it).
//!
//! | module | what |
//! |---|---|
//! | [`shm`] | [`ShmSegment`]: POSIX shm (reserved with `fallocate`, mode 0600, checked on open), memfd; [`shm::gc`] for segments of dead processes |
//! | [`file`](mod@file) | [`file::open_regular`] / [`file::stat_regular`] / [`OpenedFile`] (one descriptor for a whole load): regular files only (FIFOs refused without blocking, procfs/sysfs refused), [`FileIdentity`] |
//! | [`atomic`] | [`AtomicFile`]: a file replaced whole or not at all (a temporary in a private 0700 directory, checked after it is opened, written through its descriptor, `fsync`, `renameat`, directory `fsync`; the replaced file's mode kept, its owner where it could not have been planted); dead writers' temporaries of a temporary's exact shape cleaned |
//! | [`map`] | [`FileMap`]: read-only, shared and private file mappings, `populate`, `advise`, change detection; [`FilesMap`]: many files side by side in one range (one registration with CUDA covers them) |
//! | [`lock`] | [`lock::mlock`] as a [`LockedRegion`] guard, [`lock::memlock_limit`] |
//! | [`advise`] | [`advise::fadvise`], [`advise::readahead`], [`advise::madvise`] |
//! | [`cache`] | [`cache::residency`] (cachestat, else mincore), [`cache::residency_estimate`] / [`cache::residency_estimate_of`] (sampled), [`cache::evict`], [`cache::warm`] |
//! | [`align`] | [`AlignedBuf`], [`align::dio_alignment`] (statx DIOALIGN) |
//! | [`process`] | [`process::ProcessIdentity`]: PID namespace + pid + start time; alive, dead, or of another namespace (never judged by its pid) |
//! | [`fallback`] | [`Fallback`]: what was refused ([`Refused`]), why, and what ran instead — reported by every layer that degrades instead of failing |
//! | [`sys`] | [`SystemInfo::read`]: page sizes, THP, swappiness, memlock, /dev/shm, io_uring, memory |
//! | [`units`] | [`units::parse_size`] / [`units::show_size`]: `1.5GiB` and back |
//!
//! Sibling crates: `gpufeed-numa` (placement), `gpufeed-uring` (reads), `gpufeed-ipc` (a batch
//! ring in a [`ShmSegment`]), `gpufeed-pinned` (registers [`FileMap`]s and segments with CUDA).
//!
//! Unsafe code is confined to the modules that talk to the kernel; each constructor whose
//! safety depends on other processes (mapping a file that could be truncated) is `unsafe` and
//! says what the caller promises.
//!
//! # Example
//! ```
//! use gpufeed_os::{cache, shm::ShmSegment, sys::SystemInfo};
//!
//! let info = SystemInfo::read();
//! println!("memlock soft limit: {:?}, /dev/shm: {:?}", info.memlock.soft, info.shm);
//!
//! // A segment other processes open by name; removed when `seg` drops.
//! let seg = ShmSegment::create_unique(4 << 20)?;
//! seg.write_at(0, &[1, 2, 3])?;
//!
//! let r = cache::residency("/proc/self/exe")?;
//! println!("{:.0}% of our binary is in the page cache", r.fraction() * 100.0);
//! # Ok::<(), gpufeed_os::Error>(())
//! ```

pub mod advise;
pub mod align;
pub mod atomic;
pub mod cache;
mod error;
pub mod fallback;
pub mod file;
pub mod lock;
pub mod map;
pub mod process;
mod procfs;
pub mod shm;
pub mod sys;
pub mod units;

pub use align::AlignedBuf;
pub use atomic::AtomicFile;
pub use error::{Error, Result};
pub use fallback::{Fallback, Refused};
pub use file::{FileIdentity, OpenedFile};
pub use lock::LockedRegion;
pub use map::{FileMap, FilesMap, MapMode};
pub use shm::{ShmOptions, ShmSegment};
pub use sys::SystemInfo;

/// Throughput in GB/s (10^9 bytes per second) of `bytes` moved in `seconds`; 0 for no time.
/// Every report of every layer computes its rate with this.
///
/// ```
/// assert_eq!(gpufeed_os::gbps(3_000_000_000, 2.0), 1.5);
/// assert_eq!(gpufeed_os::gbps(1, 0.0), 0.0);
/// ```
pub fn gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

/// The base page size of this machine in bytes.
pub fn page_size() -> usize {
    rustix::param::page_size()
}
