//! # gpufeed-py — layer 3 of gpufeed: the Python package `gpufeed`
//!
//! Files, safetensors checkpoints and dataset batches on the GPU as zero-copy PyTorch tensors:
//! the native module `gpufeed._gpufeed` hands GPU (or host) memory out as [`Array`]s, which
//! speak the DLPack protocol (`__dlpack__`, `__dlpack_device__`, through the `dlpark` crate);
//! the Python layer (`python/gpufeed/__init__.py`) turns them into `torch.Tensor`s with
//! `torch.from_dlpack`, or leaves them to any DLPack consumer (numpy for host batches).
//!
//! Memory: an array holds its owner (a device buffer, a whole checkpoint, a host batch) through
//! an `Arc`; every exported tensor holds another, released by the DLPack deleter. When the last
//! one goes, device memory is handed to a thread that frees it after the GPU finished the work
//! queued before (it synchronizes the context: a consumer's kernels on its own streams may
//! still read it), so that dropping a tensor never waits for the GPU; a load first waits for
//! what is pending there, so the memory is back before it allocates. Loads
//! return with the bytes on the GPU (the load synchronized its copies), so an export needs no
//! event on the consumer's stream. gpufeed opens each GPU's primary context, the one PyTorch
//! uses, so the pointers are valid in torch's context.
//!
//! One module per domain; this file declares them, the exceptions and the module's names:
//! `array` (DLPack export, dtypes, what keeps memory alive), `reaper` (frees device memory after
//! the work queued before), `loads` (`Loader`, `RegisteredFile`, the loaders kept per device),
//! `checkpoints` (safetensors checkpoints as the Python layer takes them), `on_demand`
//! (`OnDemand`: tensors one at a time out of registered files), `safe_open` (what the drop-in
//! `safe_open` stands on: files opened once, host mappings, slices, prefetches), `multi` (several GPUs, `torchrun` ranks), `data` (`BatchLoader`, data
//! set detection, epochs), `epochs` (what the epochs' iterators share), `images` (`decode_jpegs`, `decode_batch`'s native half), `image_loader`
//! (`ImageLoader`: decoded, augmented batches of image folders and shards), `machine` (`doctor`, `advise`), `errors` and `context`.
//!
//! Depends on `gpufeed` (the facade) only.
//!
//! # Example
//! ```text
//! pip install ./crates/gpufeed-py
//! python -c 'import gpufeed; t = gpufeed.load_file("data/shard-000.bin"); print(t.shape, t.device)'
//! ```

#![deny(unsafe_code)]

mod array;
mod checkpoints;
mod context;
mod data;
mod epochs;
mod errors;
mod image_loader;
mod images;
mod into;
mod loads;
mod machine;
mod multi;
mod on_demand;
mod reaper;
mod safe_open;

use pyo3::exceptions::PyException;
use pyo3::prelude::*;

pub use array::{Array, dlpack_dtype};
pub use data::{Batch, BatchLoader, EpochIter};
pub use image_loader::{ImageEpochIter, ImageLoader};
pub use loads::{Loader, RegisteredFile};
pub use on_demand::OnDemand;
pub use safe_open::{NativePrefetch, PrefetchIter, SafeFile};

pyo3::create_exception!(
    _gpufeed,
    GpufeedError,
    PyException,
    "An error of gpufeed; the message says what went wrong and what to do."
);
pyo3::create_exception!(
    _gpufeed,
    NoGpuError,
    GpufeedError,
    "No usable GPU (no CUDA driver, no such device): the CPU paths still work."
);

/// The native module `gpufeed._gpufeed`.
#[pymodule]
fn _gpufeed(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // gpufeed's warnings (fallbacks, the reaper's failures) on stderr; GPUFEED_LOG=off silences.
    gpufeed::log_to_stderr();
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("GpufeedError", py.get_type::<GpufeedError>())?;
    m.add("NoGpuError", py.get_type::<NoGpuError>())?;
    m.add_class::<Array>()?;
    m.add_class::<Loader>()?;
    m.add_class::<Batch>()?;
    m.add_class::<BatchLoader>()?;
    m.add_class::<EpochIter>()?;
    m.add_class::<ImageLoader>()?;
    m.add_class::<ImageEpochIter>()?;
    m.add_class::<OnDemand>()?;
    m.add_class::<RegisteredFile>()?;
    m.add_class::<SafeFile>()?;
    m.add_class::<NativePrefetch>()?;
    m.add_class::<PrefetchIter>()?;
    m.add_class::<safe_open::Entry>()?;
    m.add_class::<safe_open::HeaderKey>()?;
    m.add_function(wrap_pyfunction!(safe_open::open_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(safe_open::parse_header, m)?)?;
    m.add_function(wrap_pyfunction!(loads::load_file, m)?)?;
    m.add_function(wrap_pyfunction!(images::decode_jpegs, m)?)?;
    m.add_function(wrap_pyfunction!(images::resize_crop, m)?)?;
    m.add_function(wrap_pyfunction!(images::decode_augmented, m)?)?;
    m.add_function(wrap_pyfunction!(images::random_flip, m)?)?;
    m.add_function(wrap_pyfunction!(images::random_resized_crop, m)?)?;
    m.add_function(wrap_pyfunction!(loads::load_range, m)?)?;
    m.add_function(wrap_pyfunction!(loads::read_object, m)?)?;
    m.add_function(wrap_pyfunction!(loads::fetch_objects, m)?)?;
    m.add_function(wrap_pyfunction!(multi::load_replicated, m)?)?;
    m.add_function(wrap_pyfunction!(multi::load_sharded, m)?)?;
    m.add_function(wrap_pyfunction!(multi::load_replicated_rank, m)?)?;
    m.add_function(wrap_pyfunction!(multi::load_tensor_parallel_files, m)?)?;
    m.add_function(wrap_pyfunction!(
        multi::load_replicated_safetensors_files,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(multi::load_tensor_parallel_rank_files, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoints::load_safetensors_files, m)?)?;
    m.add_function(wrap_pyfunction!(into::load_into, m)?)?;
    m.add_function(wrap_pyfunction!(reaper::_wait_for_frees, m)?)?;
    m.add_function(wrap_pyfunction!(reaper::empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(machine::doctor, m)?)?;
    m.add_function(wrap_pyfunction!(machine::advise, m)?)?;
    Ok(())
}
