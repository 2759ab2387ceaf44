//! Data sets in batches: `BatchLoader` (the data set told by its path: record files, shards,
//! image folders), its epochs (`EpochIter`, iterating the loader's owned epoch) and their
//! `Batch`es.

use std::path::PathBuf;
use std::sync::Arc;

use dlpark::ffi::DLDevice;
use gpufeed::dataset::{
    BatchData, Dataset, ImageFolder, NotStarted, NpyLayout, Order, OwnedEpoch, Position,
    RecordFile, Sampler, ShardSet,
};
use parking_lot::Mutex;
use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;

use crate::GpufeedError;
use crate::array::{Array, Owner, Storage, cuda, device_address, dlpack_dtype};
use crate::context::KeepContext;
use crate::epochs::{Epoch, Slot, position_from};
use crate::errors::py_err;

/// One batch: `data` (an array of the records' bytes back to back; shape `[records,
/// record_bytes]` for fixed-size records), the record `indices`, the byte `offsets` of each
/// record and the end, the `epoch` and its `number`.
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct Batch {
    #[pyo3(get)]
    data: Py<Array>,
    #[pyo3(get)]
    indices: Vec<usize>,
    #[pyo3(get)]
    offsets: Vec<usize>,
    #[pyo3(get)]
    labels: Vec<u32>,
    #[pyo3(get)]
    epoch: u64,
    #[pyo3(get)]
    number: usize,
}

/// How the records of a data set come out as arrays: fixed-size records as `[records,
/// record_bytes]` bytes, `.npy` rows as `[records, *row shape]` of their dtype; others 1-D.
#[derive(Clone, Default)]
pub(crate) struct RowLayout {
    record_bytes: usize,
    /// `.npy` rows: the dtype (safetensors name) and the shape of a row.
    typed: Option<(&'static str, Vec<i64>)>,
}

/// Opens one record file: `.npy` rows, a WebDataset `.tar`, an offsets-indexed file, or
/// fixed-size records.
fn open_record_file(
    path: &std::path::Path,
    record_bytes: Option<usize>,
    index: Option<&std::path::Path>,
) -> gpufeed::Result<RecordFile> {
    // As streamed shards are told apart: by the name's ending, in any case.
    let own = gpufeed::dataset::own_layout(&path.to_string_lossy());
    if let Some(own) = own
        && (record_bytes.is_some() || index.is_some())
    {
        // Its records would be cut from the raw bytes, header and all.
        return Err(gpufeed::Error::invalid(format!(
            "{} is a .{own} file, which says its own records (the .npy header's rows, the \
             tar's samples): leave record_bytes and index out",
            path.display()
        )));
    }
    #[allow(unsafe_code, reason = "the mapped-file promise, passed on")]
    let records = match (own, record_bytes, index) {
        // SAFETY: the class's documentation passes the promise on to the caller: the
        // record file is not truncated or rewritten while the loader maps it.
        (Some("npy"), None, None) => unsafe { RecordFile::open_npy(path)? },
        // SAFETY: as above.
        (Some("tar"), None, None) => unsafe { RecordFile::open_tar(path)? },
        // SAFETY: as above.
        (_, None, Some(index)) => unsafe { RecordFile::open_indexed(path, index)? },
        // SAFETY: as above.
        (_, Some(n), None) => unsafe { RecordFile::open_fixed(path, n)? },
        (_, Some(_), Some(_)) => {
            return Err(gpufeed::Error::invalid(
                "give record_bytes (fixed-size records) or index (variable ones), not both".into(),
            ));
        }
        (_, None, None) => {
            return Err(gpufeed::Error::invalid(format!(
                "{} is a record file: say how its records are cut, record_bytes=N or \
                 index=OFFSETS_FILE (.npy and .tar files need neither)",
                path.display()
            )));
        }
    };
    Ok(records)
}

/// The rows' layout of record files: typed where every file is an `.npy` of one dtype and
/// row shape, bytes of `record_bytes` for fixed records, 1-D otherwise.
fn row_layout(npys: &[Option<&NpyLayout>], record_bytes: Option<usize>) -> RowLayout {
    let npys: Option<Vec<_>> = npys.iter().copied().collect();
    if let Some(npys) = npys
        && let Some(first) = npys.first()
        && npys
            .iter()
            .all(|n| n.descr == first.descr && n.shape.get(1..) == first.shape.get(1..))
    {
        let typed = first
            .dtype()
            .and_then(|d| dlpack_dtype(d).ok())
            .map(|(_, name)| {
                let row: Vec<i64> = first.shape.iter().skip(1).map(|&x| x as i64).collect();
                (name, row)
            });
        return RowLayout {
            record_bytes: first.row_bytes(),
            typed,
        };
    }
    RowLayout {
        record_bytes: record_bytes.unwrap_or(0),
        typed: None,
    }
}

/// Shards in object storage (any `s3://` or `https://` URL among `paths`; an `s3://` URL
/// with a wildcard stands for the keys it matches, listed and sorted; a `.json` shard index,
/// webdataset's wids format, for the shards it lists), streamed: each fetched
/// when the epoch first needs it (into `cache` where given, where it then stays; else into
/// memory, at most `spool_bytes` held at once), local shards among them read in place.
/// `None` where no path is a URL.
pub(crate) fn streamed_dataset(
    paths: &[PathBuf],
    record_bytes: Option<usize>,
    index: Option<&std::path::Path>,
    cache: Option<&std::path::Path>,
    spool_bytes: Option<u64>,
) -> gpufeed::Result<Option<(Dataset, RowLayout)>> {
    let is_index = |p: &PathBuf| {
        p.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"))
    };
    if !paths
        .iter()
        .any(|p| crate::loads::object_url(p).is_some() || is_index(p))
    {
        return Ok(None);
    }
    if index.is_some() {
        return Err(gpufeed::Error::invalid(
            "index= is for one local record file; shards in object storage are fixed records \
             (record_bytes=), .npy or .tar objects"
                .into(),
        ));
    }
    let names = paths
        .iter()
        .map(|p| {
            p.to_str().map(str::to_owned).ok_or_else(|| {
                gpufeed::Error::invalid(format!("{}: not a UTF-8 path", p.display()))
            })
        })
        .collect::<gpufeed::Result<Vec<_>>>()?;
    let mut opts = gpufeed::dataset::StreamOptions::default();
    opts.record_bytes = record_bytes;
    opts.cache = cache.map(PathBuf::from);
    opts.spool_bytes = spool_bytes;
    let shards = gpufeed::dataset::StreamedShards::open(&names, &opts)?;
    let npys: Vec<_> = shards.npys().collect();
    let layout = row_layout(&npys, record_bytes);
    Ok(Some((Dataset::Streamed(shards), layout)))
}

/// A loader's `shuffle=`: `True`, `False`, or `"shards"` (shards in a shuffled order, each
/// one's records shuffled: the order that streams shards from object storage).
#[derive(FromPyObject)]
pub(crate) enum Shuffle {
    Flag(bool),
    Named(String),
}

/// The order `shuffle`, `seed` and `block` make.
pub(crate) fn order_of(
    shuffle: &Shuffle,
    seed: u64,
    block: Option<usize>,
) -> gpufeed::Result<Order> {
    Ok(match (shuffle, block) {
        (Shuffle::Named(s), None) if s == "shards" => Order::Shards { seed },
        (Shuffle::Named(s), Some(_)) if s == "shards" => {
            return Err(gpufeed::Error::invalid(
                "shuffle=\"shards\" visits whole shards: leave block unset".into(),
            ));
        }
        (Shuffle::Named(s), _) => {
            return Err(gpufeed::Error::invalid(format!(
                "shuffle={s:?}: give True, False or \"shards\""
            )));
        }
        (Shuffle::Flag(true), Some(block)) => Order::Blocks { seed, block },
        (Shuffle::Flag(true), None) => Order::Shuffled { seed },
        (Shuffle::Flag(false), _) => Order::Sequential,
    })
}

/// The data set `BatchLoader` reads: shards (`paths` a list, or one path with a glob pattern),
/// an image folder (a directory), or one record file; and how its rows come out.
pub(crate) fn open_dataset(
    paths: &[PathBuf],
    record_bytes: Option<usize>,
    index: Option<&std::path::Path>,
    skip_bad: bool,
) -> gpufeed::Result<(Dataset, RowLayout)> {
    let one = match paths {
        [one] => Some(one),
        _ => None,
    };
    if let Some(path) = one
        && path.is_dir()
    {
        if record_bytes.is_some() || index.is_some() {
            return Err(gpufeed::Error::invalid(format!(
                "{} is a folder, read as an image folder: record_bytes and index are for \
                 record files (shards in a folder: give \"{}/*\")",
                path.display(),
                path.display()
            )));
        }
        let folder = if skip_bad {
            ImageFolder::open_skipping(path)?
        } else {
            ImageFolder::open(path)?
        };
        return Ok((Dataset::Folder(folder), RowLayout::default()));
    }
    let is_glob = one.is_some_and(|p| p.to_string_lossy().contains(['*', '?', '[']));
    if let Some(path) = one
        && !is_glob
    {
        let file = open_record_file(path, record_bytes, index)?;
        let layout = row_layout(&[file.npy()], record_bytes);
        return Ok((Dataset::Records(file), layout));
    }
    if index.is_some() {
        return Err(gpufeed::Error::invalid(
            "index= is for one record file; shards are fixed records, .npy or .tar files".into(),
        ));
    }
    let paths = match one {
        Some(pattern) => gpufeed::dataset::shard_paths(pattern)?,
        None => paths.to_vec(),
    };
    if paths.is_empty() {
        return Err(gpufeed::Error::invalid("an empty list of shards".into()));
    }
    let files = paths
        .iter()
        .map(|p| open_record_file(p, record_bytes, None))
        .collect::<gpufeed::Result<Vec<_>>>()?;
    let layout = row_layout(
        &files.iter().map(RecordFile::npy).collect::<Vec<_>>(),
        record_bytes,
    );
    Ok((Dataset::Shards(ShardSet::new(files)), layout))
}

/// Batches of a data set, shuffled with a seed and sharded by `RANK`/`WORLD_SIZE`, on GPU
/// `device` (or host batches with `device=None`). Iterate `loader.epoch(n)`. The data set is
/// a record file of fixed-size records (`record_bytes=N`: batches `[records, N]`), a record
/// file with an offsets index (`index=PATH`: little-endian u64 starts, then the last end;
/// batches of bytes with `offsets`), an `.npy` array (a record per row: batches `[records,
/// *row shape]` of its dtype), a WebDataset `.tar` (a record per sample: its members back to
/// back), shards of those (a list of paths, or a glob pattern such as `"train-*.tar"`: one
/// data set, in the order given or sorted), or a folder of class folders, PyTorch `ImageFolder`'s
/// layout (`path` a directory: each file's raw bytes, `offsets` and `labels`; `classes` names
/// them; `skip_bad=True` leaves out unreadable entries instead of failing, counted in
/// `skipped`).
///
/// `workers` threads gather batches (default: one per core, up to 8) and `prefetch` batches are
/// prepared ahead (default: two per worker: each worker gathers and uploads its own).
/// `global_batch=G` makes it elastic: each step's G records are the same whatever
/// `WORLD_SIZE` (one that divides G; each rank gets G / WORLD_SIZE, `batch_size` is ignored),
/// `EpochIter.position()` says where the run is (a dict, JSON-ready) and `resume(position)`
/// goes on from there with the same or another world size.
///
/// For data sets larger than the page cache: `block=K` shuffles blocks of K consecutive
/// records (and the records within each block) instead of single records — a block's records
/// always share a batch when K divides the batch — and `direct=True` reads the records with
/// `O_DIRECT`, records next to each other in a file (a block) in one read, `direct_depth`
/// reads in flight per worker (default 4: fewer suit network volumes, more local NVMe). Large
/// blocks keep the reads large: on the H200 machine's cloud disk, blocks of 8 MiB with 4
/// workers and `direct_depth=1` came to 0.97-1.1 of the disk's own sequential reads (bench
/// table 7), blocks of 1 MiB mostly to 0.65-0.86.
///
/// Shards in object storage (`s3://`, `https://` URLs in `path`, one by one, or an `s3://`
/// pattern such as `s3://bucket/train-*.tar`, listed; or a `.json` shard index in webdataset's
/// wids format, `{"shardlist": [{"url": ..., "nsamples": N}, ...]}`, for the shards it lists;
/// `record_bytes=N` for shards that are neither `.npy` nor `.tar`) are streamed: each object's
/// version is pinned when the loader is made (a tar shard that no shard index counts is read
/// once then, to count its samples), and during an epoch each shard
/// is fetched when the epoch first needs it, several at once, and let go after the last batch
/// that needs it. Fetched into `cache` where given (made private where missing; a version
/// already there is not fetched again, so a second run reads local files), else into memory,
/// at most `spool_bytes` at once (default: a quarter of the available memory, at most 16 GiB;
/// at least the largest shard). An epoch whose order needs more shards at once than that is refused when
/// it starts (a plain shuffle needs them all): `shuffle="shards"` visits the shards in a
/// shuffled order, each one's records shuffled (WebDataset's shard shuffle), and streams them
/// under a cap of a few shards (a batch's one or two, and the first one where the epoch's last
/// step is padded). Several ranks each fetch the shards their records are in: with an elastic
/// or sharded sampler every rank of a node fetches the same shards.
///
/// `gpu_gather=True` (one record file of fixed-size records, an `.npy` array, or an image
/// folder, on a GPU): the GPU gathers each batch's records itself, reading them over the bus
/// out of the file's mapping (a folder's files are mapped side by side, one mapping each),
/// which is registered with CUDA when the loader is made (about 100 ms per 4 GiB; every byte
/// stays in RAM, page-locked, while the loader lives): no copy by the CPU. On
/// one H100, epochs after a first untimed one of a loader made once, 4 KiB records came at
/// 40-42 GB/s with one to eight workers (1.5-2.5 cores busy) against 27-31 gathered by 8 CPU
/// workers, and 64 KiB records at 50-51 with one worker and about one core busy
/// (docs/benchmarks.md, GPU runs 211 and 213); a folder of 10,000 files of 60-160 KiB at 46.5
/// against 13.5 gathered by 8 CPU workers (GPU run 217).
///
/// A record file must not be truncated or rewritten while the loader reads it (it is mapped);
/// with `gpu_gather` neither may a folder's files (one whose size changed since it was listed
/// is refused by name when the loader is made).
#[pyclass(module = "gpufeed._gpufeed")]
pub struct BatchLoader {
    /// The loader, while no epoch runs; a running epoch owns it and its `EpochIter` puts it
    /// back at the epoch's end or when dropped.
    slot: Slot<gpufeed::dataset::BatchLoader>,
    gpu: Option<gpufeed::Gpu>,
    /// How records come out as arrays.
    rows: RowLayout,
    batches: usize,
    /// An image folder's class names, in label order; empty for record files.
    #[pyo3(get)]
    classes: Vec<String>,
    /// Entries an image folder left out (`skip_bad=True`).
    #[pyo3(get)]
    skipped: usize,
    /// Set when dropped, dropped last: see [`KeepContext`].
    restore: KeepContext,
}

impl Drop for BatchLoader {
    fn drop(&mut self) {
        self.restore.arm();
    }
}

#[pymethods]
impl BatchLoader {
    #[new]
    #[pyo3(signature = (path, record_bytes=None, batch_size=256, shuffle=Shuffle::Flag(true), seed=0, device=None, workers=None, drop_last=false, index=None, skip_bad=false, global_batch=None, prefetch=None, block=None, direct=false, direct_depth=None, cache=None, spool_bytes=None, gpu_gather=false), text_signature = "(path, record_bytes=None, batch_size=256, shuffle=True, seed=0, device=None, workers=None, drop_last=False, index=None, skip_bad=False, global_batch=None, prefetch=None, block=None, direct=False, direct_depth=None, cache=None, spool_bytes=None, gpu_gather=False)")]
    #[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
    fn py_new(
        py: Python<'_>,
        path: Bound<'_, PyAny>,
        record_bytes: Option<usize>,
        batch_size: usize,
        shuffle: Shuffle,
        seed: u64,
        device: Option<usize>,
        workers: Option<usize>,
        drop_last: bool,
        index: Option<PathBuf>,
        skip_bad: bool,
        global_batch: Option<usize>,
        prefetch: Option<usize>,
        block: Option<usize>,
        direct: bool,
        direct_depth: Option<usize>,
        cache: Option<PathBuf>,
        spool_bytes: Option<u64>,
        gpu_gather: bool,
    ) -> PyResult<Self> {
        let _context = gpufeed::cuda::ContextGuard::new();
        // One path (a file, a folder or a glob pattern), or a list of shard paths.
        let paths: Vec<PathBuf> = match path.extract::<PathBuf>() {
            Ok(one) => vec![one],
            Err(_) => path.extract().map_err(|_| {
                GpufeedError::new_err(
                    "invalid setting: path is a file, a folder, a glob pattern or a list of shards",
                )
            })?,
        };
        let made = py.detach(|| -> gpufeed::Result<_> {
            let streamed = streamed_dataset(
                &paths,
                record_bytes,
                index.as_deref(),
                cache.as_deref(),
                spool_bytes,
            )?;
            let (records, layout) = match streamed {
                Some(s) => s,
                None => open_dataset(&paths, record_bytes, index.as_deref(), skip_bad)?,
            };
            let (classes, skipped) = match &records {
                Dataset::Folder(f) => (f.classes().to_vec(), f.skipped().len()),
                _ => (Vec::new(), 0),
            };
            let order = order_of(&shuffle, seed, block)?;
            let sampler = match global_batch {
                Some(g) => Sampler::elastic_from_env(order, g, drop_last)?,
                None => Sampler::from_env(order)?,
            };
            // An elastic sampler sets the batch size itself (BatchLoader::new).
            let mut cfg =
                gpufeed::dataset::BatchLoaderOptions::default().with_batch_size(batch_size);
            cfg.drop_last = drop_last;
            // Default: a worker per core, up to 8 (what the bench's BatchLoader rows use).
            cfg.workers = workers.unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(2, |n| n.get().min(8))
            });
            // Each worker gathers and uploads a batch: two in flight per worker.
            cfg.prefetch = prefetch.unwrap_or(2 * cfg.workers).max(1);
            cfg.direct = direct;
            cfg.gpu_gather = gpu_gather;
            if let Some(depth) = direct_depth {
                cfg = cfg.with_direct_depth(depth);
            }
            let gpu = device.map(gpufeed::Gpu::open).transpose()?;
            let loader = gpufeed::dataset::BatchLoader::new(records, sampler, cfg, gpu.as_ref())?;
            Ok((loader, gpu, classes, skipped, layout))
        });
        let (loader, gpu, classes, skipped, layout) = made.map_err(py_err)?;
        let batches = loader.batches_per_epoch();
        Ok(BatchLoader {
            slot: Arc::new(Mutex::new(Some(loader))),
            gpu,
            rows: layout,
            batches,
            classes,
            skipped,
            restore: KeepContext::default(),
        })
    }

    /// Batches in an epoch (this rank's).
    fn __len__(&self) -> usize {
        self.batches
    }

    /// The batches of epoch `epoch`, in the sampler's order; one epoch at a time (the next
    /// once this one has ended or its iterator is dropped).
    fn epoch(&self, py: Python<'_>, epoch: u64) -> PyResult<EpochIter> {
        self.run(py, epoch, None)
    }

    /// The rest of an epoch from `position` (a dict from `EpochIter.position()`, maybe saved
    /// by a run with another `WORLD_SIZE`): the samples that run had not consumed, this rank's
    /// share. Needs `global_batch=` (an elastic loader) with the same seed and global batch,
    /// over the same data set. A position that does not fit raises here.
    fn resume(&self, py: Python<'_>, position: Bound<'_, PyAny>) -> PyResult<EpochIter> {
        let at = position_from(py, position)?;
        self.run(py, at.epoch, Some(at))
    }
}

impl BatchLoader {
    /// Starts epoch `epoch` (from `at` when resuming): the loader moves into the returned
    /// iterator's epoch, which puts it back when it ends or is dropped.
    fn run(&self, py: Python<'_>, epoch: u64, at: Option<Position>) -> PyResult<EpochIter> {
        let run = Epoch::start(py, &self.slot, |loader: gpufeed::dataset::BatchLoader| {
            match &at {
                Some(at) => loader.into_resume(at),
                None => loader.into_epoch(epoch),
            }
            .map_err(|NotStarted { error, loader }| Box::new((error, *loader)))
        })?;
        Ok(EpochIter {
            run,
            gpu: self.gpu.clone(),
            rows: self.rows.clone(),
            restore: KeepContext::default(),
        })
    }
}

/// The batches of one epoch (see `BatchLoader.epoch`), straight from the loader's epoch; at
/// its end, or when dropped, the loader is free for the next.
#[pyclass(module = "gpufeed._gpufeed")]
pub struct EpochIter {
    run: Epoch<OwnedEpoch>,
    gpu: Option<gpufeed::Gpu>,
    rows: RowLayout,
    /// Set when dropped, dropped last: see [`KeepContext`].
    restore: KeepContext,
}

impl Drop for EpochIter {
    fn drop(&mut self) {
        self.restore.arm();
        // Mid-epoch: the workers finish the batch in hand, without the GIL held meanwhile.
        self.run.end();
    }
}

#[pymethods]
impl EpochIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// Where the run is after the batches handed out so far, as a dict to save beside the
    /// model's checkpoint (JSON) and give to `BatchLoader.resume`; after the epoch's last batch,
    /// the start of the next epoch. Only for an elastic loader (`global_batch=`).
    fn position<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.run.position(py, "BatchLoader")
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Batch> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let Some(batch) = self.run.next(py) else {
            return Err(PyStopIteration::new_err(()));
        };
        let b = batch.map_err(py_err)?;
        let records = b.indices.len();
        let nbytes = b.bytes();
        let (base, device, owner) = match b.data {
            BatchData::Device(buf) => {
                let gpu = self
                    .gpu
                    .clone()
                    .ok_or_else(|| GpufeedError::new_err("a device batch without a GPU"))?;
                let base = device_address(&gpu, &buf);
                let device = cuda(gpu.info().ordinal);
                (base, device, Owner::new(Storage::Batch(buf), Some(gpu)))
            }
            BatchData::Host(buf) => (
                buf.as_ptr() as usize,
                DLDevice::CPU,
                Owner::new(Storage::Host(buf), None),
            ),
        };
        let rows = &self.rows;
        let whole = rows.record_bytes > 0 && records * rows.record_bytes == nbytes;
        let shape = if whole {
            vec![records as i64, rows.record_bytes as i64]
        } else {
            vec![nbytes as i64]
        };
        let mut data = Array::bytes(Arc::new(owner), base, nbytes, device, Some(shape));
        if whole && let Some((dtype, row)) = &rows.typed {
            let shape: Vec<i64> = std::iter::once(records as i64)
                .chain(row.iter().copied())
                .collect();
            data = data.view_of(0, nbytes, dtype, shape)?;
        }
        Ok(Batch {
            data: Py::new(py, data)?,
            indices: b.indices,
            offsets: b.offsets,
            labels: b.labels,
            epoch: b.epoch,
            number: b.number,
        })
    }
}
