//! # gpufeed — layer 3 of gpufeed: the facade that feeds NVIDIA GPUs with data as fast as the hardware allows
//!
//! One dependency for all of gpufeed: the capability crates of layer 3 re-exported where a
//! user looks for them, one error type that `?` from any of them goes into ([`Error`]), and
//! the machine's advice ([`advise`], [`doctor`]). Each capability crate also stands alone.
//!
//! | path | crate | what | feature |
//! |---|---|---|---|
//! | [`load_file`], [`Loader`], [`Saver`], [`RegisteredFile`], [`FileList`] | `gpufeed-load` | files (ranges, many files) into GPU memory and back | always |
//! | [`safetensors`] | `gpufeed-safetensors` | checkpoints: bulk loads, tensor parallel, on demand, crash-safe saves | `safetensors` (default) |
//! | [`dataset`] | `gpufeed-data` | the batch loader: records, image folders, npy and tar shards, the elastic sampler, worker processes | `data` (default) |
//! | [`multi`] | `gpufeed-multi` | several GPUs: `MultiLoader`, `RankLoader` (staging, IPC, NCCL) | `multi` (default) |
//! | `frames`, `hybrid` | `gpufeed-frames` | the source's two case studies | `frames` |
//! | [`advise`], [`doctor`] | this crate | what to set on this machine, and what is wrong with it | always |
//! | [`os`], [`numa`], [`uring`], [`ipc`], [`pinned`], [`cuda`] | layers 0-2 | re-exported whole | always |
//!
//! Without a GPU every GPU call returns an error for which [`Error::is_no_gpu`] is true; the
//! CPU paths (records, samplers, host batches, every lower layer) keep working. Slower paths
//! taken are typed [`Fallback`]s in each [`LoadReport`].
//!
//! Depends on `gpufeed-load`, `gpufeed-os`, `gpufeed-numa`, `gpufeed-uring`, `gpufeed-ipc`,
//! `gpufeed-pinned`, `gpufeed-cuda`, and, by feature, `gpufeed-safetensors`, `gpufeed-data`,
//! `gpufeed-multi` and `gpufeed-frames`.
//!
//! # Stability
//! The layers are re-exported whole ([`os`], [`cuda`], ...), so a breaking change in any layer
//! is a breaking change of `gpufeed`, and the facade's version moves with the highest of them
//! (as gitoxide's `gix` does with its plumbing crates). While the version is 0.x, a minor
//! release may break the API; option structs and enums that will grow are
//! `#[non_exhaustive]` (start from `Default` and use the `with_*` setters), so adding a
//! setting, a strategy or an error is not a breaking change. Items marked `#[doc(hidden)]` are
//! test hooks, not API. A user who wants fewer moving parts depends on one crate alone.
//!
//! # Example
//! ```no_run
//! let gpu = gpufeed::Gpu::open(0)?;
//! let (buf, report) = gpufeed::load_file(&gpu, "data/shard-000.bin", gpufeed::LoadOptions::default())?;
//! println!("{} bytes: {} ({}), {:.1} GB/s", buf.len(), report.strategy, report.reason, report.gbps());
//! let ckpt = gpufeed::safetensors::load(&gpu, "model.safetensors")?;
//! println!("{} tensors", ckpt.names().count());
//! # Ok::<(), gpufeed::Error>(())
//! ```

#![deny(unsafe_code)]

pub mod advise;
pub mod doctor;
mod error;
#[cfg(feature = "stderr-log")]
mod log;

pub use error::{Error, Result};
pub use gpufeed_load::{
    DeviceBuffer, Fallback, FileList, FilesReport, GdsBuffers, Gpu, GpuInfo, LoadOptions,
    LoadReport, Loader, LoaderSetup, OneShotReport, Piece, Refused, RegisteredFile, RouteChoice,
    SaveOptions, SaveReport, Saver, Skipped, Strategy, load_file, load_file_on, save_file,
};
#[cfg(feature = "stderr-log")]
pub use log::{LOG_VAR, log_to_stderr};

/// The batch loader ([`gpufeed_data`]).
#[cfg(feature = "data")]
pub use gpufeed_data as dataset;
/// The real-time frames case study ([`gpufeed_frames::frames`]).
#[cfg(feature = "frames")]
pub use gpufeed_frames::frames;
/// The hybrid training loader case study ([`gpufeed_frames::hybrid`]).
#[cfg(feature = "frames")]
pub use gpufeed_frames::hybrid;
/// Objects in S3-compatible storage and on HTTP(S) servers ([`gpufeed_load::object`]).
#[cfg(feature = "object")]
pub use gpufeed_load::object;
/// Several GPUs ([`gpufeed_multi`]).
#[cfg(feature = "multi")]
pub use gpufeed_multi as multi;
/// Byte sizes as people write them ([`gpufeed_os::units`]).
pub use gpufeed_os::units;
/// Checkpoints ([`gpufeed_safetensors`]).
#[cfg(feature = "safetensors")]
pub use gpufeed_safetensors as safetensors;

pub use gpufeed_cuda as cuda;
pub use gpufeed_ipc as ipc;
/// Loads and saves ([`gpufeed_load`]), whose items are also at this crate's root.
pub use gpufeed_load as load;
pub use gpufeed_numa as numa;
pub use gpufeed_os as os;
pub use gpufeed_pinned as pinned;
pub use gpufeed_uring as uring;

/// Compiles the examples of the workspace README, so that they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeExamples;
