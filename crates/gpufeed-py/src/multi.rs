//! Several GPUs: one process loading onto several (`load_replicated`, `load_sharded`, whole and
//! tensor-parallel checkpoints) and one rank of a `torchrun` job (the `*_rank` functions).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::array::{Array, device_bytes};
use crate::checkpoints::{FileTensors, checkpoint_files};
use crate::errors::py_err;
use crate::loads::kept;
use crate::reaper;

/// One multi-GPU loader per list of devices for `load_replicated` and `load_sharded`.
fn shared_multi(py: Python<'_>, devices: Vec<usize>) -> PyResult<Arc<gpufeed::multi::MultiLoader>> {
    static MULTI: OnceLock<Mutex<HashMap<Vec<usize>, Arc<gpufeed::multi::MultiLoader>>>> =
        OnceLock::new();
    let opts = gpufeed::LoadOptions::for_gpus(devices.len());
    let key = devices.clone();
    kept(py, MULTI.get_or_init(Mutex::default), key, move || {
        Ok(gpufeed::multi::MultiLoader::open(&devices, opts)?)
    })
}

/// All of `path` on every GPU of `devices` (each reads its share, the GPUs' peer links bring
/// the rest): one 1-D `U8` array per device, in order.
#[pyfunction]
pub(crate) fn load_replicated(
    py: Python<'_>,
    path: PathBuf,
    devices: Vec<usize>,
) -> PyResult<Vec<Array>> {
    let multi = shared_multi(py, devices)?;
    let _context = gpufeed::cuda::ContextGuard::new();
    let m = Arc::clone(&multi);
    let bufs = py
        .detach(move || {
            reaper::wait_idle();
            m.load_replicated(&path).map(|(bufs, _)| bufs)
        })
        .map_err(py_err)?;
    Ok(bufs
        .into_iter()
        .zip(multi.loaders())
        .map(|(buf, l)| device_bytes(l.gpu(), buf))
        .collect())
}

/// The files `paths` read as one stream and cut into one share per device (4 KiB-aligned,
/// nearly equal): one 1-D `U8` array per device, in order, and each share's `(file index,
/// start, end)` pieces.
#[pyfunction]
#[allow(clippy::type_complexity, reason = "the tuple is the Python shape")]
pub(crate) fn load_sharded(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    devices: Vec<usize>,
) -> PyResult<(Vec<Array>, Vec<Vec<(usize, u64, u64)>>)> {
    let plan = gpufeed::multi::ShardPlan::split_bytes(&paths, devices.len()).map_err(py_err)?;
    let multi = shared_multi(py, devices)?;
    let _context = gpufeed::cuda::ContextGuard::new();
    let (m, p) = (Arc::clone(&multi), plan.clone());
    let bufs = py
        .detach(move || {
            reaper::wait_idle();
            m.load_sharded(&p).map(|(bufs, _)| bufs)
        })
        .map_err(py_err)?;
    let pieces = (0..plan.ranks())
        .map(|r| {
            plan.spans(r)
                .iter()
                .map(|s| (s.file, s.range.start, s.range.end))
                .collect()
        })
        .collect();
    let arrays = bufs
        .into_iter()
        .zip(multi.loaders())
        .map(|(buf, l)| device_bytes(l.gpu(), buf))
        .collect();
    Ok((arrays, pieces))
}

/// This process's rank of a `torchrun` job on this machine (`LOCAL_RANK` of
/// `LOCAL_WORLD_SIZE`), joined once per process.
///
/// The lock is taken with the GIL released: a thread waiting for it never holds the GIL that
/// the thread joining needs to return (two threads calling a rank function at once deadlocked
/// when the lock was taken first).
fn rank_loader(py: Python<'_>) -> PyResult<Arc<gpufeed::multi::RankLoader>> {
    static RANK: OnceLock<Mutex<Option<Arc<gpufeed::multi::RankLoader>>>> = OnceLock::new();
    let cell = RANK.get_or_init(Mutex::default);
    let _context = gpufeed::cuda::ContextGuard::new();
    py.detach(|| {
        let mut held = cell.lock();
        if let Some(r) = held.as_ref() {
            return Ok::<_, gpufeed::multi::Error>(Arc::clone(r));
        }
        let made = Arc::new(gpufeed::multi::RankLoader::from_env()?);
        *held = Some(Arc::clone(&made));
        Ok(made)
    })
    .map_err(py_err)
}

/// All of `path` on this rank's GPU, each rank of the job reading its share, which the other
/// ranks copy out of staging slots they all map (CUDA IPC), or receive through NCCL
/// (`GPUFEED_REPLICATE=nccl`: `RankLoader::from_env`): `(array, rank, world)`.
/// Collective: every rank calls it with the same file.
#[pyfunction]
pub(crate) fn load_replicated_rank(
    py: Python<'_>,
    path: PathBuf,
) -> PyResult<(Array, usize, usize)> {
    let rank = rank_loader(py)?;
    let _context = gpufeed::cuda::ContextGuard::new();
    let r = Arc::clone(&rank);
    let buf = py
        .detach(move || {
            reaper::wait_idle();
            r.load_replicated(&path).map(|(buf, _)| buf)
        })
        .map_err(py_err)?;
    Ok((
        device_bytes(rank.loader().gpu(), buf),
        rank.rank(),
        rank.world(),
    ))
}

/// The tensor-parallel cut of dimension `dim`: 0 is rows, 1 columns.
fn split_of(dim: usize) -> gpufeed::safetensors::Split {
    use gpufeed::safetensors::Split;
    match dim {
        0 => Split::Rows,
        1 => Split::Columns,
        d => Split::Dim(d),
    }
}

/// A safetensors checkpoint (file or index) cut for tensor parallelism along `dim` over
/// `devices`: per device, its share as `load_safetensors_files` hands a checkpoint over.
/// Headers are checked and the plan made before any GPU is opened.
#[pyfunction]
#[allow(clippy::type_complexity, reason = "the tuple is the Python shape")]
pub(crate) fn load_tensor_parallel_files(
    py: Python<'_>,
    path: PathBuf,
    devices: Vec<usize>,
    dim: usize,
) -> PyResult<Vec<Vec<FileTensors>>> {
    let ranks = devices.len();
    let plan = py
        .detach(|| gpufeed::safetensors::TensorParallel::plan(&path, ranks, split_of(dim)))
        .map_err(py_err)?;
    multi_checkpoints(py, devices, move |m| {
        Ok(m.load_tensor_parallel(&plan).map(|(c, _)| c)?)
    })
}

/// The checkpoints `load` puts on the GPUs of `devices` (their kept multi-GPU loader), each
/// as `load_safetensors_files` hands one over.
fn multi_checkpoints(
    py: Python<'_>,
    devices: Vec<usize>,
    load: impl FnOnce(
        &gpufeed::multi::MultiLoader,
    ) -> gpufeed::Result<Vec<gpufeed::safetensors::Checkpoint>>
    + Send,
) -> PyResult<Vec<Vec<FileTensors>>> {
    let multi = shared_multi(py, devices)?;
    let _context = gpufeed::cuda::ContextGuard::new();
    let ckpts = py
        .detach(|| {
            reaper::wait_idle();
            load(&multi)
        })
        .map_err(py_err)?;
    ckpts.into_iter().map(|c| checkpoint_files(py, c)).collect()
}

/// A whole safetensors checkpoint on every GPU of `devices` (each reads its share of every
/// file, the peer links bring the rest): per device, as `load_safetensors_files`.
#[pyfunction]
#[allow(clippy::type_complexity, reason = "the tuple is the Python shape")]
pub(crate) fn load_replicated_safetensors_files(
    py: Python<'_>,
    path: PathBuf,
    devices: Vec<usize>,
) -> PyResult<Vec<Vec<FileTensors>>> {
    // Before the GPUs are opened: a bad file is named even on a machine without one.
    py.detach(|| gpufeed::safetensors::inspect(&path))
        .map_err(py_err)?;
    multi_checkpoints(py, devices, move |m| {
        Ok(m.load_replicated_safetensors(&path).map(|(c, _)| c)?)
    })
}

/// This rank's tensor-parallel share (along `dim`) of a safetensors checkpoint, in a job
/// `torchrun` started: `(files, rank, world)`. Collective: every rank calls it with the same
/// checkpoint and dimension (a rank given another plan is named in every rank's error).
#[pyfunction]
#[allow(clippy::type_complexity, reason = "the tuple is the Python shape")]
pub(crate) fn load_tensor_parallel_rank_files(
    py: Python<'_>,
    path: PathBuf,
    dim: usize,
) -> PyResult<(Vec<FileTensors>, usize, usize)> {
    // Before joining the job: a bad file is named on every rank alike, none waits for another.
    py.detach(|| gpufeed::safetensors::inspect(&path))
        .map_err(py_err)?;
    let rank = rank_loader(py)?;
    let world = rank.world();
    let plan = py
        .detach(|| gpufeed::safetensors::TensorParallel::plan(&path, world, split_of(dim)))
        .map_err(py_err)?;
    let _context = gpufeed::cuda::ContextGuard::new();
    let r = Arc::clone(&rank);
    let ckpt = py
        .detach(move || {
            reaper::wait_idle();
            r.load_tensor_parallel(&plan).map(|(c, _)| c)
        })
        .map_err(py_err)?;
    Ok((checkpoint_files(py, ckpt)?, rank.rank(), world))
}
