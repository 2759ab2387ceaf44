//! # gpufeed-load — layer 3 of gpufeed: files into GPU memory, and GPU memory back to files
//!
//! The engine under every capability of gpufeed:
//!
//! - [`load_file`] / [`Loader`]: a file (or a byte range of it) into GPU memory with the
//!   fastest path the machine allows — [`Strategy::Staged`] / [`Strategy::Direct`] (buffered
//!   `pread`s, or `O_DIRECT` io_uring reads, into pinned staging buffers uploaded while the
//!   next ones fill) chosen by [`Strategy::Auto`] from page-cache residency and available
//!   memory, or [`Strategy::Registered`] when asked (the GPU copies straight from the cached
//!   pages, registered read-only in chunks ahead of the copies), or [`Strategy::Gds`] (cuFile:
//!   GPUDirect Storage, peer-to-peer where the machine has it, which `Auto` takes for cold
//!   files there; elsewhere cuFile's compatibility mode, or gpufeed's own path where cuFile
//!   refuses); a [`LoadReport`] says what ran, why, and where the time went. A `Loader` reserves its pinned staging when it is made,
//!   so that its first load runs at the speed of a warm one.
//! - [`Loader::load_files`] / [`FileList`]: many files (a folder of images) into one GPU buffer
//!   in one call, file `i` at [`FileList::range`].
//! - [`RegisteredFile`] / [`Loader::load_registered`]: a file loaded from again and again,
//!   registered once; every later load is one copy by the GPU out of the page cache.
//! - One-shot loads for a process that loads once at start-up: [`load_file_on`] and
//!   [`Loader::open`] take a device ordinal and open the GPU on another thread while this one
//!   checks the file and faults in the staging; a [`OneShotReport`] gives the context's time
//!   and the load's apart.
//! - With the `object` feature, `object::load_object` / `Loader::load_object`: an object in
//!   S3-compatible storage (or on an HTTP(S) server) into GPU memory, by ranged GETs into the
//!   pinned staging (gpufeed-object), its version pinned for the whole load.
//! - [`save_file`] / [`Saver`]: GPU memory back to files (device -> pinned windows ->
//!   `O_DIRECT` writes, overlapped), crash-safe: a temporary file synced and renamed over the
//!   target, so a process killed at any point leaves the old file or the new one, whole.
//!
//! A load opens its file once ([`gpufeed_os::OpenedFile`]): the checks, the residency sample,
//! the route's choice and every read use that descriptor, and the file's identity is checked
//! on it again after the copies ([`Error::FileChangedDuringLoad`]).
//!
//! Without a GPU every GPU call returns an error for which [`Error::is_no_gpu`] is true. Slower
//! paths taken are typed [`Fallback`]s in each [`LoadReport`]. The crate's own `unsafe` code is
//! where it passes on a mapped file's promise (`Strategy::Registered`, [`RegisteredFile`]).
//!
//! Depends on `gpufeed-os`, `gpufeed-numa`, `gpufeed-uring`, `gpufeed-pinned` and
//! `gpufeed-cuda`, and with the `object` feature on `gpufeed-object`.
//!
//! The checkpoint, data, multi-GPU and case-study crates build on it; the `gpufeed` facade
//! re-exports it at its root.
//!
//! # Example
//! ```no_run
//! let gpu = gpufeed_load::Gpu::open(0)?;
//! let (buf, report) =
//!     gpufeed_load::load_file(&gpu, "data/shard-000.bin", gpufeed_load::LoadOptions::default())?;
//! println!("{} bytes: {} ({}), {:.1} GB/s", buf.len(), report.strategy, report.reason, report.gbps());
//! # Ok::<(), gpufeed_load::Error>(())
//! ```

#![deny(unsafe_code)]

mod error;
mod files;
mod gds;
mod loader;
#[cfg(feature = "object")]
pub mod object;
#[cfg(feature = "object")]
mod object_cache;
mod options;
mod registered;
mod route;
mod save;
mod source;
mod via_registration;

pub use error::{Error, Result};
pub use files::{FileList, FilesReport, Skipped};
#[doc(hidden)]
pub use gds::GdsFault;
pub use gds::{GDS_PIECE_BYTES, GdsRefusal};
pub use gpufeed_cuda::{Gpu, GpuInfo};
pub use gpufeed_os::{Fallback, Refused};
pub use loader::{Loader, LoaderSetup, load_file, load_file_on};
pub use options::{
    DeviceBuffer, GdsBuffers, LoadOptions, LoadReport, OneShotReport, RouteChoice, Strategy,
};
pub use registered::RegisteredFile;
pub use save::{Piece, SaveOptions, SaveReport, Saver, save_file};

/// What the capability crates above share with the loader; not API (`#[doc(hidden)]`).
#[doc(hidden)]
pub mod internal {
    pub use crate::files::{Part, read_parts};
    pub use crate::loader::one_shot;
    pub use crate::route::{
        auto_choice, auto_choice_at, check_unchanged, file_len, fits, read_error,
    };
}

/// The layers below, for [`load_error_conversions`]; not API.
#[doc(hidden)]
pub mod layers {
    pub use gpufeed_cuda;
    pub use gpufeed_os;
    pub use gpufeed_pinned;
    pub use gpufeed_uring;
}
