//! # gpufeed — layer 3 of gpufeed: the facade that feeds NVIDIA GPUs with data as fast as the hardware allows
//!
//! The facade over gpufeed's layers (re-exported whole as [`os`], [`numa`], [`uring`],
//! [`ipc`], [`pinned`], [`cuda`]):
//!
//! - [`load_file`] / [`Loader`]: a file (or a byte range of it) into GPU memory with the
//!   fastest path the machine allows — [`Strategy::Staged`] / [`Strategy::Direct`] (buffered
//!   `pread`s, or `O_DIRECT` io_uring reads, into pinned staging buffers uploaded while the
//!   next ones fill) chosen by [`Strategy::Auto`] from page-cache residency and available memory, or
//!   [`Strategy::Registered`] when asked (the GPU copies straight from the cached pages,
//!   registered read-only in chunks ahead of the copies: the cheapest path per CPU thread); a
//!   [`LoadReport`] says what ran, why, and where the time went. A `Loader` reserves its pinned
//!   staging when it is made and takes its first load's device memory from `cuMemAlloc`, so
//!   that first load runs at the speed of a warm one (its second grows the context's pool).
//! - [`Loader::load_files`] / [`FileList`]: many files (a folder of images) into one GPU buffer
//!   in one call, the fill threads reading pieces of the list in batches of io_uring reads;
//!   file `i` at [`FileList::range`]. Loads of any size share the loader's kept readers and
//!   the scheduler's kept fill threads (awake for a moment after each upload), so a 1 MiB load
//!   costs about 100 us on the H200 machine, not ~0.5 ms.
//! - [`RegisteredFile`] / [`Loader::load_registered`]: a file loaded from again and again
//!   (tensors on demand, ranges of a record file) registered once, its cached pages kept
//!   page-locked; every later load is one copy by the GPU out of the page cache, no host copy.
//! - One-shot loads for a process that loads once at start-up: [`load_file_on`],
//!   [`safetensors::load_on`] and [`Loader::open`] take a device ordinal and open the GPU on
//!   another thread while this one checks the files, reads headers and faults in the staging;
//!   a [`OneShotReport`] gives the context's time and the load's apart.
//! - [`safetensors::load`]: a safetensors file or sharded checkpoint to GPU memory, one bulk
//!   transfer per file, a named view per tensor.
//! - [`save_file`] / [`Saver`] / [`safetensors::save`]: GPU memory back to files (device ->
//!   pinned windows -> `O_DIRECT` writes, overlapped), crash-safe: a temporary file synced and
//!   renamed over the target, so a process killed at any point leaves the old file or the new
//!   one, whole.
//! - [`multi`]: several GPUs — [`multi::MultiLoader`] in one process (a loader per GPU sized
//!   together by [`LoadOptions::for_gpus`], peer access enabled) or [`multi::RankLoader`] in
//!   one process per GPU (ranks meet through a shared-memory rendezvous, copies through CUDA
//!   IPC, or NCCL broadcasts: [`multi::RankLoader::with_nccl`]), with sharded loads ([`multi::ShardPlan`]), tensor-parallel checkpoints
//!   ([`safetensors::TensorParallel`], rows, columns or any dimension) and replicated loads
//!   (each GPU reads 1/N, the rest arrives from the other GPUs over NVLink while it reads).
//! - [`dataset`]: a record file or an image folder ([`dataset::ImageFolder`]: class folders,
//!   labels), a seeded and sharded [`dataset::Sampler`], and a [`dataset::BatchLoader`]
//!   yielding device batches (host batches without a GPU); data larger than the page cache read
//!   with `O_DIRECT` in shuffled blocks ([`dataset::Order::Blocks`]).
//! - [`frames`]: frames between processes through a shared-memory ring (the real-time case
//!   study: a paced producer, the consumer, the pipe baseline, latency statistics; the GPU
//!   consumer [`frames::GpuFrames`] copies each frame straight from the registered ring while
//!   the previous one is transformed).
//! - [`hybrid`]: the hybrid training loader (the other case study): a `BatchLoader`'s batches
//!   preprocessed on the GPU ([`hybrid::GpuPlanar`]) and kept there, or dealt out to trainer
//!   processes through shared-memory rings ([`hybrid::Fanout`]).
//!
//! Without a GPU every GPU call returns an error for which [`Error::is_no_gpu`] is true; the
//! CPU paths (records, samplers, host batches, every lower layer) keep working. Slower paths
//! taken are typed [`Fallback`]s in each [`LoadReport`]. The facade's own `unsafe` code is where it
//! passes on a mapped file's promise (`Strategy::Registered`, `dataset::RecordFile`,
//! `RegisteredFile`) and where it reads or writes a claimed ring slot in place (`frames`,
//! `hybrid`).
//!
//! Depends on every layer below: `gpufeed-os`, `gpufeed-numa`, `gpufeed-uring`, `gpufeed-ipc`,
//! `gpufeed-pinned` and `gpufeed-cuda`.
//!
//! # Stability
//! The layers are re-exported whole ([`os`], [`cuda`], ...), so a breaking change in any layer
//! is a breaking change of `gpufeed`, and the facade's version moves with the highest of them
//! (as gitoxide's `gix` does with its plumbing crates). While the version is 0.x, a minor
//! release may break the API; option structs and enums that will grow are
//! `#[non_exhaustive]` (start from `Default` and use the `with_*` setters), so adding a
//! setting, a strategy or an error is not a breaking change. Items marked `#[doc(hidden)]` are
//! test hooks, not API. A user who wants fewer moving parts depends on one layer alone.
//!
//! # Example
//! ```no_run
//! let gpu = gpufeed::Gpu::open(0)?;
//! let (buf, report) = gpufeed::load_file(&gpu, "data/shard-000.bin", gpufeed::LoadOptions::default())?;
//! println!("{} bytes: {} ({}), {:.1} GB/s", buf.len(), report.strategy, report.reason, report.gbps());
//! # Ok::<(), gpufeed::Error>(())
//! ```

#![deny(unsafe_code)]

pub mod advise;
pub mod dataset;
pub mod doctor;
mod error;
mod files;
pub mod frames;
pub mod hybrid;
mod load;
#[cfg(feature = "stderr-log")]
mod log;
pub mod multi;
mod registered;
pub mod safetensors;
mod save;
pub mod units;

pub use error::{Error, Result};
pub use files::{FileList, FilesReport, Skipped};
pub use gpufeed_cuda::{Gpu, GpuInfo};
pub use gpufeed_os::{Fallback, Refused};
pub use load::{
    DeviceBuffer, LoadOptions, LoadReport, Loader, LoaderSetup, OneShotReport, Strategy, load_file,
    load_file_on,
};
#[cfg(feature = "stderr-log")]
pub use log::{LOG_VAR, log_to_stderr};
pub use registered::RegisteredFile;
pub use save::{Piece, SaveOptions, SaveReport, Saver, save_file};

pub use gpufeed_cuda as cuda;
pub use gpufeed_ipc as ipc;
pub use gpufeed_numa as numa;
pub use gpufeed_os as os;
pub use gpufeed_pinned as pinned;
pub use gpufeed_uring as uring;

/// Compiles the examples of the workspace README, so that they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeExamples;
