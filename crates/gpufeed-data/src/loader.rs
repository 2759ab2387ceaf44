//! The [`BatchLoader`] and its settings ([`BatchLoaderOptions`]): batches of records assembled by
//! worker threads into pinned buffers and uploaded, several in flight.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::mpsc::{self};
use std::time::Duration;

use gpufeed_cuda::{Gpu, TransferOptions, TransferScheduler};
use gpufeed_pinned::{PinnedPool, PoolMode, PoolOptions, PooledBuffer};
use parking_lot::{Condvar, Mutex};

use crate::device_batch::{BatchMemory, DeviceBatch};
use crate::epoch::{Epoch, NotStarted, OwnedEpoch, Running};
use crate::error::{Error, Result};
use crate::gather::{DirectCounters, Job, Queue, Shared, check_direct, worker};
use crate::records::Dataset;
use crate::sampler::{Order, Sampler};

/// Where an elastic loader is: the epoch and how many samples of its global order all ranks
/// together have consumed. Small and serializable (serde; JSON for a checkpoint beside the
/// model's): a loader resumed from it ([`BatchLoader::resume`]), with the same or another
/// world size that divides the global batch, yields exactly the rest of the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Position {
    /// The epoch.
    pub epoch: u64,
    /// Samples of the epoch's global order consumed (a multiple of `global_batch`).
    pub samples: u64,
    /// Records in the data set (a resume on another data set is refused).
    pub records: u64,
    /// The order (a resume with another seed is refused).
    pub order: Order,
    /// Records per global batch.
    pub global_batch: usize,
}

/// A per-record transform run on the worker threads: gets the record's index and bytes and
/// appends its output to the vector.
pub type Transform =
    Arc<dyn Fn(usize, &[u8], &mut Vec<u8>) -> std::result::Result<(), String> + Send + Sync>;

/// A per-record transform of a fixed output size run on the worker threads
/// ([`BatchLoader::with_transform_into`]): gets the record's index and bytes and fills `out`,
/// the record's place in the batch's pooled (pinned) buffer, so its output is written once.
pub type TransformInto =
    Arc<dyn Fn(usize, &[u8], &mut [u8]) -> std::result::Result<(), String> + Send + Sync>;

/// The loader's transform, of either kind.
#[derive(Clone)]
pub(crate) enum Transformer {
    /// Appends to a vector, copied into the batch's buffer after ([`BatchLoader::with_transform`]).
    Append(Transform),
    /// Writes `bytes` per record straight into the batch's buffer
    /// ([`BatchLoader::with_transform_into`]).
    Into { bytes: usize, f: TransformInto },
}

/// A worker's buffers, kept from batch to batch: a transform's output (before it is copied
/// into the batch), a tar sample's members joined for a transform, and an image folder's files
/// read for a transform (which writes the batch's buffer).
#[derive(Default)]
pub(crate) struct Scratch {
    pub(crate) out: Vec<u8>,
    pub(crate) joined: Vec<u8>,
    pub(crate) files: Vec<u8>,
}

/// Settings of a [`BatchLoader`]: start from the default and change what you need (new
/// settings may be added).
///
/// ```
/// let cfg = gpufeed_data::BatchLoaderOptions::default().with_batch_size(256).with_workers(8);
/// assert_eq!((cfg.batch_size, cfg.workers, cfg.prefetch), (256, 8, 2));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BatchLoaderOptions {
    /// Records per batch.
    pub batch_size: usize,
    /// Drop a last batch smaller than `batch_size`.
    pub drop_last: bool,
    /// Batches prepared ahead of the one being consumed (default 2: double buffering). Each
    /// is gathered (and, with a GPU, uploaded) by one worker: below `workers`, some workers
    /// wait; the bench's rows use two per worker.
    pub prefetch: usize,
    /// Worker threads gathering records (default 2).
    pub workers: usize,
    /// Longest wait for one batch before [`Error::BatchTimeout`] ends the epoch (default 60 s).
    pub batch_timeout: Duration,
    /// Read the records with `O_DIRECT` instead of copying them out of the file's mapping
    /// (default off): for record files and shard sets larger than the page cache, which would
    /// otherwise be read a page fault at a time and push everything else out of the cache.
    /// Each worker reads its batch's records in runs: records next to each other in the file
    /// are read together (an order that keeps them together, [`Order::Blocks`], makes each
    /// block one read), up to [`BatchLoaderOptions::direct_depth`] of them in flight. Not for an
    /// [`ImageFolder`](crate::ImageFolder) (whose files are read whole already). A file system that refuses
    /// `O_DIRECT` is an error when the loader is made.
    pub direct: bool,
    /// With `direct`: reads each worker keeps in flight (default 4; at least 1). The disk sees
    /// `workers * direct_depth` reads at once: local NVMe drives want deep queues, while
    /// network and cloud volumes often read fastest at a few (bench table 7 measures it).
    pub direct_depth: usize,
    /// Records of one record file, or the files of an [`ImageFolder`](crate::ImageFolder),
    /// are gathered by the GPU itself (default off): the file's mapping (or the folder's
    /// files, mapped side by side in one range: [`gpufeed_os::FilesMap`]) is registered with
    /// CUDA when the loader is made (page-locked: every byte stays in RAM while the loader
    /// lives; about 100 ms per 4 GiB of one file, 130-310 ms for 10,000 files of 60-160 KiB),
    /// and each batch is one kernel that reads its records over the bus straight into the
    /// batch's device memory, with no copy by the CPU. For a GPU loader of one
    /// [`RecordFile`](crate::RecordFile) of fixed-size records (or an `.npy` array) or of an
    /// `ImageFolder`, read through the page cache (not with `direct`), on a GPU that reads
    /// registered memory at the host's addresses; anything else is refused when the loader is
    /// made. A folder takes one mapping per file: a folder whose files would leave the process
    /// fewer than 8,192 (or a tenth) of the mappings `vm.max_map_count` allows (65,530 by
    /// default) is refused with the counts ([`gpufeed_os::map::MAP_COUNT_MARGIN`]), and the
    /// files must keep the sizes they were listed with (one that changed before the loader
    /// is made is refused by name; the GPU reads the pages registered then, so a file
    /// rewritten later may be delivered old or mixed). A data set larger than the memory
    /// available (`MemAvailable` less a tenth, at least 256 MiB; files on tmpfs count as in
    /// memory already) is refused before it is registered. A loader given a transform
    /// ([`BatchLoader::with_transform`]) gathers on its workers, which run it, and gives the
    /// registration back; [`LoaderStats::gpu_gathered_batches`] counts the batches the GPU
    /// gathered.
    pub gpu_gather: bool,
}

impl Default for BatchLoaderOptions {
    fn default() -> Self {
        BatchLoaderOptions {
            batch_size: 32,
            drop_last: false,
            prefetch: 2,
            workers: 2,
            batch_timeout: Duration::from_secs(60),
            direct: false,
            direct_depth: 4,
            gpu_gather: false,
        }
    }
}

impl BatchLoaderOptions {
    /// These settings with `gpu_gather` (the GPU gathers each batch's records).
    pub fn with_gpu_gather(mut self, gpu_gather: bool) -> Self {
        self.gpu_gather = gpu_gather;
        self
    }

    /// These settings with `direct` (read records with `O_DIRECT`).
    pub fn with_direct(mut self, direct: bool) -> Self {
        self.direct = direct;
        self
    }

    /// These settings with `direct_depth` (`O_DIRECT` reads in flight per worker; at least 1).
    pub fn with_direct_depth(mut self, depth: usize) -> Self {
        self.direct_depth = depth.max(1);
        self
    }

    /// These settings with `batch_size` (records per batch).
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// These settings with `drop_last` (drop a last, smaller batch).
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// These settings with `prefetch` (batches prepared ahead).
    pub fn with_prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// These settings with `workers` (worker threads).
    pub fn with_workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// These settings with `batch_timeout` (longest wait for one batch).
    pub fn with_batch_timeout(mut self, batch_timeout: Duration) -> Self {
        self.batch_timeout = batch_timeout;
        self
    }
}

/// Where a batch's bytes are: on the GPU, or on the host without one (exhaustive: match both).
#[derive(Debug)]
pub enum BatchData {
    /// In GPU memory, given back to the loader for a later batch when dropped while the
    /// epoch runs ([`DeviceBatch`]).
    Device(DeviceBatch),
    /// In a pooled host buffer (no GPU): pinned, or locked in CPU mode.
    Host(PooledBuffer),
}

/// One batch: the records' bytes back to back, with their indices and offsets.
#[derive(Debug)]
pub struct Batch {
    /// The epoch.
    pub epoch: u64,
    /// The batch's number in its epoch.
    pub number: usize,
    /// The record indices, in order.
    pub indices: Vec<usize>,
    /// Start of each record's bytes in the batch, then the end of the last.
    pub offsets: Vec<usize>,
    /// Each sample's label, for an [`ImageFolder`](crate::ImageFolder) (its class); empty for record files.
    /// Host memory: a few bytes per sample, copied where the caller needs them.
    pub labels: Vec<u32>,
    /// The bytes.
    pub data: BatchData,
}

impl Batch {
    /// Bytes in the batch.
    pub fn bytes(&self) -> usize {
        *self.offsets.last().unwrap_or(&0)
    }
}

/// Counters of a [`BatchLoader`].
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct LoaderStats {
    /// Batches yielded.
    pub batches: u64,
    /// Bytes yielded.
    pub bytes: u64,
    /// Seconds the workers spent issuing uploads, summed (a worker does not wait for its copy:
    /// it gathers the next batch while the copy runs).
    pub upload_s: f64,
    /// Seconds the consumer waited for workers and for batches' copies to end.
    pub waited_s: f64,
    /// The part of `waited_s` spent waiting for batches' copies to the GPU (or, with
    /// [`BatchLoaderOptions::gpu_gather`], their gathering kernels) to end; the rest waited
    /// for the workers to prepare them: where it is most of `waited_s`, the uploads are what
    /// the consumer waits for, not the workers.
    pub copy_waited_s: f64,
    /// With [`BatchLoaderOptions::direct`]: `O_DIRECT` reads issued (one per run of records next to
    /// each other in a file, per batch) and the bytes they read (from the 4 KiB page holding
    /// each run's first byte; against `bytes`, what alignment and records read twice cost).
    pub direct_reads: u64,
    /// See `direct_reads`.
    pub direct_read_bytes: u64,
    /// Uploads into the memory of a batch dropped before (kept by the loader while an epoch
    /// runs, see [`DeviceBatch`]) rather than into new memory, in the loader's life; counted
    /// as the workers take it (a batch prepared and never handed out counts too), read when a
    /// batch is handed out.
    pub kept_memory_batches: u64,
    /// With [`BatchLoaderOptions::gpu_gather`]: batches the GPU gathered (a loader with a
    /// transform has its workers gather and transform them instead), in the loader's life.
    pub gpu_gathered_batches: u64,
}

/// Yields batches of a [`RecordFile`](crate::RecordFile) or an [`ImageFolder`](crate::ImageFolder) in the [`Sampler`]'s order, on the GPU (or, without one,
/// in host memory), with workers preparing the next batches while the current ones upload.
///
/// # Example (runs without a GPU: host batches)
/// ```
/// use gpufeed_data::{BatchData, BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler};
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("records.bin");
/// std::fs::write(&path, (0..100u8).collect::<Vec<_>>())?;
/// // SAFETY: the file is not changed while it is used.
/// let records = unsafe { RecordFile::open_fixed(&path, 10)? }; // 10 records of 10 bytes
/// let sampler = Sampler::new(Order::Shuffled { seed: 7 });
/// let cfg = BatchLoaderOptions::default().with_batch_size(4);
/// let mut loader = BatchLoader::new(records, sampler, cfg, None)?;
/// let sizes: Vec<usize> = loader.epoch(0)?.map(|b| b.map(|b| b.indices.len())).collect::<Result<_, _>>()?;
/// assert_eq!(sizes, [4, 4, 2]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct BatchLoader {
    pub(crate) records: Arc<Dataset>,
    pub(crate) sampler: Sampler,
    pub(crate) cfg: BatchLoaderOptions,
    pub(crate) transform: Option<Transformer>,
    pub(crate) pool: PinnedPool,
    /// The GPU and the scheduler the workers upload their batches through.
    pub(crate) gpu: Option<(Gpu, Arc<TransferScheduler>)>,
    pub(crate) stats: LoaderStats,
    /// The workers' `O_DIRECT` reads ([`BatchLoaderOptions::direct`]).
    pub(crate) direct: Arc<DirectCounters>,
    /// Device memory and events of batches handed out and dropped, for the next uploads.
    pub(crate) memory: Arc<BatchMemory>,
    /// With [`BatchLoaderOptions::gpu_gather`]: the registered file and the kernel.
    pub(crate) gpu_gather: Option<Arc<GpuGather>>,
}

/// The data set's bytes registered with CUDA and the kernel that gathers batches out of them
/// ([`BatchLoaderOptions::gpu_gather`]): a record file's mapping, or a folder's files mapped
/// side by side.
pub(crate) struct GpuGather {
    pub(crate) kernel: gpufeed_cuda::kernels::GatherKernel,
    /// The pooled buffers the batches' record addresses (or a folder's spans) go into, grown
    /// while every one is still read by a kernel (the loader's own pool waits for the oldest
    /// instead, which kept a couple of kernels in flight at most).
    pub(crate) addresses: PinnedPool,
    /// Batches the GPU gathered (`LoaderStats::gpu_gathered_batches`).
    pub(crate) gathered: std::sync::atomic::AtomicU64,
    /// The scheduler whose streams the kernels run on.
    sched: Arc<TransferScheduler>,
    // Dropped before `of` and `records`: unregistered while the bytes are still mapped.
    #[allow(dead_code, reason = "held for its Drop, which unregisters the mapping")]
    registration: gpufeed_pinned::HostRegistration<'static>,
    /// What is registered: a record file's records (mapped by `records`), or a folder's files
    /// mapped side by side.
    pub(crate) of: GatherFrom,
    #[allow(dead_code, reason = "keeps the registered mapping alive")]
    records: Arc<Dataset>,
}

/// What a [`GpuGather`] gathers from.
#[derive(Debug)]
pub(crate) enum GatherFrom {
    /// One record file's records, all of this size.
    Records(usize),
    /// An `ImageFolder`'s files, mapped side by side.
    Files(gpufeed_os::FilesMap),
}

impl GpuGather {
    /// Registers the bytes of `records` (one record file's mapping, or a folder's files mapped
    /// side by side) with `gpu`'s context and loads the kernel.
    #[allow(
        unsafe_code,
        reason = "registers mappings this struct keeps alive for as long as they are registered"
    )]
    fn new(gpu: &Gpu, sched: &Arc<TransferScheduler>, records: &Arc<Dataset>) -> Result<Self> {
        // What to register, and how much of it is on tmpfs (`/dev/shm`): in memory already,
        // and left out of `MemAvailable`.
        let (of, ptr, len, in_memory, what) = match &**records {
            Dataset::Records(file) => match (file.fixed_size(), file.mapped()) {
                (Some(record_bytes), Some((ptr, len))) => {
                    let on_tmpfs = file
                        .mapped_file()
                        .and_then(gpufeed_os::file::fs_type)
                        .is_some_and(gpufeed_os::file::in_memory_fs);
                    (
                        GatherFrom::Records(record_bytes),
                        ptr,
                        len,
                        if on_tmpfs { len as u64 } else { 0 },
                        file.path().display().to_string(),
                    )
                }
                _ => {
                    return Err(Error::invalid(
                        "BatchLoaderOptions::gpu_gather needs a record file of fixed-size records (RecordFile::open_fixed or an .npy array), mapped and not empty".into(),
                    ));
                }
            },
            Dataset::Folder(folder) => {
                let list = folder.files();
                let listed = list.paths().iter().enumerate().map(|(i, p)| {
                    let len = list.range(i).map_or(0, |r| r.end - r.start);
                    (p.as_path(), len)
                });
                // SAFETY: the folder's files are not truncated or written while the loader
                // lives (`ImageFolder`'s promise, as for the record file's mapping); the CPU
                // never reads this map, only the GPU through its registration.
                let files = unsafe { gpufeed_os::FilesMap::open(listed) }.map_err(|e| {
                    Error::invalid(format!(
                        "BatchLoaderOptions::gpu_gather: the files of {} could not be mapped ({e}); leave gpu_gather off to read them on the CPU",
                        folder.root().display()
                    ))
                })?;
                if files.is_empty() {
                    return Err(Error::invalid(format!(
                        "BatchLoaderOptions::gpu_gather: {} holds no bytes to gather",
                        folder.root().display()
                    )));
                }
                let (ptr, len, in_memory) = (files.as_ptr(), files.len(), files.in_memory_bytes());
                (
                    GatherFrom::Files(files),
                    ptr,
                    len,
                    in_memory,
                    format!("the {} files of {}", list.len(), folder.root().display()),
                )
            }
            _ => {
                return Err(Error::invalid(
                    "BatchLoaderOptions::gpu_gather gathers the records of one record file (RecordFile) or the files of an ImageFolder; leave it off for shards and streamed data".into(),
                ));
            }
        };
        // Page-locking more than the machine can spare would leave the rest of the system to
        // the OOM killer (and first read every byte from the disk): refused up front.
        gpufeed_os::lock::check_memory((len as u64).saturating_sub(in_memory)).map_err(|e| {
            Error::invalid(format!(
                "BatchLoaderOptions::gpu_gather page-locks {what} ({e}); leave gpu_gather off to gather on the CPU"
            ))
        })?;
        // The kernel reads the mapping at the host's addresses: the device must take them.
        let same = gpu
            .context()
            .attribute(gpufeed_cuda::cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM)
            .map_err(|e| gpufeed_cuda::Error::Cuda {
                op: "cuDeviceGetAttribute",
                result: e.0,
            })?;
        if same != 1 {
            return Err(Error::invalid(
                "BatchLoaderOptions::gpu_gather: this GPU cannot read registered host memory at the host's addresses (CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is 0); leave gpu_gather off".into(),
            ));
        }
        // SAFETY: the mapping is read-only and lives as long as `records` (or the folder's map
        // in `of`), which this struct holds and drops after the registration (field order);
        // the GPU only reads it.
        let registration = unsafe {
            gpufeed_pinned::HostRegistration::register(gpu.context(), ptr, len, true)
        }
        .map_err(|e| {
            Error::invalid(format!(
                "BatchLoaderOptions::gpu_gather: {what} could not be registered with CUDA ({e}); leave gpu_gather off to gather on the CPU",
            ))
        })?;
        let addresses = PinnedPool::new(
            PoolMode::Cuda(gpu.context().clone()),
            PoolOptions::default()
                .with_budget_bytes(Some(ADDRESS_POOL_BYTES))
                .with_grow_when_busy(true),
        )?;
        Ok(GpuGather {
            kernel: gpufeed_cuda::kernels::GatherKernel::load(gpu)?,
            addresses,
            gathered: std::sync::atomic::AtomicU64::new(0),
            sched: Arc::clone(sched),
            registration,
            of,
            records: Arc::clone(records),
        })
    }
}

/// The most bytes of record addresses or folder spans [`GpuGather`] keeps page-locked: 256
/// buffers of the pool's smallest class, far more than the kernels a loader keeps in flight.
const ADDRESS_POOL_BYTES: u64 = 16 << 20;

impl Drop for GpuGather {
    fn drop(&mut self) {
        // Kernels of batches prepared and never handed out may still read the mapping: they
        // run on the scheduler's streams, whose work ends before it is unregistered (the
        // context's other work is not waited for).
        if let Err(e) = self.sched.synchronize() {
            tracing::warn!("synchronizing before unregistering the gathered file: {e}");
        }
    }
}

impl std::fmt::Debug for BatchLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchLoader")
            .field("records", &self.records.len())
            .field("cfg", &self.cfg)
            .field("gpu", &self.gpu.is_some())
            .finish()
    }
}

impl BatchLoader {
    /// A loader of `records` (a [`RecordFile`](crate::RecordFile) or an [`ImageFolder`](crate::ImageFolder)) onto `gpu` (or host
    /// batches with `None`).
    ///
    /// With an elastic sampler ([`Sampler::elastic`]) the batch size is the sampler's per-rank
    /// batch and `drop_last` the sampler's (`cfg`'s are replaced).
    pub fn new(
        records: impl Into<Dataset>,
        sampler: Sampler,
        cfg: BatchLoaderOptions,
        gpu: Option<&Gpu>,
    ) -> Result<Self> {
        Self::build(records.into(), sampler, cfg, gpu, true)
    }

    /// A loader of host batches in memory pinned for `gpu` (its context's page-locked
    /// memory), not uploaded: for a consumer that copies from them itself, such as the
    /// [`ImageLoader`](crate::ImageLoader)'s decoder (nvJPEG reads pageable memory through the
    /// driver's staging, at a fraction of the speed).
    pub(crate) fn new_pinned_host(
        records: impl Into<Dataset>,
        sampler: Sampler,
        cfg: BatchLoaderOptions,
        gpu: &Gpu,
    ) -> Result<Self> {
        Self::build(records.into(), sampler, cfg, Some(gpu), false)
    }

    /// [`BatchLoader::new`]; with `upload` false and a GPU, host batches pinned for it.
    fn build(
        records: Dataset,
        sampler: Sampler,
        mut cfg: BatchLoaderOptions,
        gpu: Option<&Gpu>,
        upload: bool,
    ) -> Result<Self> {
        (cfg.batch_size, cfg.drop_last) = sampler.batching(&cfg);
        if cfg.batch_size == 0 || cfg.workers == 0 || cfg.prefetch == 0 {
            return Err(Error::invalid(
                "batch_size, workers and prefetch must be at least 1".into(),
            ));
        }
        if cfg.direct && cfg.gpu_gather {
            return Err(Error::invalid(
                "BatchLoaderOptions::gpu_gather reads the file's mapping (the page cache) and direct reads around it: set one of them".into(),
            ));
        }
        if cfg.direct {
            check_direct(&records)?;
        }
        if cfg.prefetch < cfg.workers {
            tracing::info!(
                prefetch = cfg.prefetch,
                workers = cfg.workers,
                "fewer batches in flight than workers: only {} of the workers ever gather",
                cfg.prefetch
            );
        }
        let node = gpu.and_then(|g| g.info().numa_node);
        // Workers drop their buffer once its upload is issued and take an idle one (the one
        // given back last) for the next batch, or wait for the oldest copy where every buffer
        // is still read. Growing the pool instead (`PoolOptions::grow_when_busy`) was measured
        // slower: 64 KiB records 29-36 GB/s against 40-44 waiting (GPU run 196, an H100,
        // three rounds), likely because more buffers take turns and fewer stay in the CPU's
        // caches.
        let pool_cfg = PoolOptions::default()
            .with_budget_bytes(None)
            .with_numa_node(node);
        let (pool, gpu) = match gpu {
            Some(g) if upload => {
                let sched = TransferScheduler::new(g, TransferOptions::default())?;
                (
                    PinnedPool::new(PoolMode::Cuda(g.context().clone()), pool_cfg)?,
                    Some((g.clone(), Arc::new(sched))),
                )
            }
            Some(g) => (
                PinnedPool::new(PoolMode::Cuda(g.context().clone()), pool_cfg)?,
                None,
            ),
            None => (PinnedPool::new(PoolMode::Cpu, pool_cfg)?, None),
        };
        // As many as the batches in flight: what the consumer can drop before the workers
        // take again.
        let memory = BatchMemory::new(cfg.prefetch);
        let records = Arc::new(records);
        // A batch's record addresses (8 bytes each) or a folder's spans (24) must fit the
        // address pool's budget, or every batch would fail: one bound for both, the spans'
        // (a record file could take three times as many; nobody batches 699,050 records).
        if cfg.gpu_gather
            && (cfg.batch_size as u64).saturating_mul(gpufeed_cuda::kernels::Span::BYTES as u64)
                > ADDRESS_POOL_BYTES
        {
            return Err(Error::invalid(format!(
                "BatchLoaderOptions::gpu_gather gathers at most {} records a batch; batch_size is {}",
                ADDRESS_POOL_BYTES / gpufeed_cuda::kernels::Span::BYTES as u64,
                cfg.batch_size
            )));
        }
        let gpu_gather = match (&gpu, cfg.gpu_gather) {
            (_, false) => None,
            (Some((g, sched)), true) => Some(Arc::new(GpuGather::new(g, sched, &records)?)),
            (None, true) => {
                return Err(Error::invalid(
                    "BatchLoaderOptions::gpu_gather needs device batches: a loader with a GPU (Rust: BatchLoader::new with Some(gpu); Python: device=N)".into(),
                ));
            }
        };
        Ok(BatchLoader {
            records,
            gpu_gather,
            sampler,
            cfg,
            transform: None,
            pool,
            gpu,
            stats: LoaderStats::default(),
            direct: Arc::new(DirectCounters::default()),
            memory,
        })
    }

    /// Applies `f` to every record on the worker threads: it appends the record's output to
    /// the vector, which is then copied into the batch's pooled buffer (a transform of a fixed
    /// output size writes that buffer itself: [`BatchLoader::with_transform_into`]). Replaces
    /// a transform set before.
    pub fn with_transform(
        mut self,
        f: impl Fn(usize, &[u8], &mut Vec<u8>) -> std::result::Result<(), String>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.transform = Some(Transformer::Append(Arc::new(f)));
        self.gather_on_workers();
        self
    }

    /// Applies `f`, whose output is `out_bytes` for every record (a decode to a fixed shape, a
    /// conversion of fixed records), to every record on the worker threads: it writes the
    /// record's output straight into `out`, the record's `out_bytes` of the batch's pooled
    /// (pinned) buffer, and must fill them (they hold what the buffer last held). Each batch
    /// is then `out_bytes` per record, its offsets multiples of it; errors and panics are as
    /// for [`BatchLoader::with_transform`]. Replaces a transform set before.
    ///
    /// ```
    /// use gpufeed_data::{BatchData, BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler};
    /// # let dir = tempfile::tempdir()?;
    /// # let path = dir.path().join("records.bin");
    /// std::fs::write(&path, (0..12u8).collect::<Vec<_>>())?;
    /// // SAFETY: the file is not changed while it is used.
    /// let records = unsafe { RecordFile::open_fixed(&path, 3)? }; // 4 records of 3 bytes
    /// let cfg = BatchLoaderOptions::default().with_batch_size(4);
    /// let mut loader = BatchLoader::new(records, Sampler::new(Order::Sequential), cfg, None)?
    ///     // Each record's bytes summed into one little-endian u16.
    ///     .with_transform_into(2, |_, r, out| {
    ///         let sum: u16 = r.iter().map(|&b| u16::from(b)).sum();
    ///         out.copy_from_slice(&sum.to_le_bytes());
    ///         Ok(())
    ///     });
    /// let batch = loader.epoch(0)?.next().transpose()?.expect("a batch");
    /// let BatchData::Host(buf) = &batch.data else { unreachable!("no GPU given") };
    /// assert_eq!(&buf[..], &[3, 0, 12, 0, 21, 0, 30, 0]);
    /// assert_eq!(batch.offsets, [0, 2, 4, 6, 8]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_transform_into(
        mut self,
        out_bytes: usize,
        f: impl Fn(usize, &[u8], &mut [u8]) -> std::result::Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.transform = Some(Transformer::Into {
            bytes: out_bytes,
            f: Arc::new(f),
        });
        self.gather_on_workers();
        self
    }

    /// A transform runs on the workers, which then gather the records themselves: the file
    /// registered for [`BatchLoaderOptions::gpu_gather`] is given back (its pages no longer
    /// held in RAM) rather than kept for kernels that will not run. No epoch is running (the
    /// transform is set on the loader itself), and dropping [`GpuGather`] waits for the
    /// kernels of earlier epochs.
    fn gather_on_workers(&mut self) {
        if let Some(g) = self.gpu_gather.take() {
            // Batches gathered and never handed out (an epoch left early) count too.
            self.stats.gpu_gathered_batches = g.gathered.load(std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> &LoaderStats {
        &self.stats
    }

    /// What it reads ([`StreamedShards::stats`](crate::StreamedShards::stats) for streamed
    /// shards' counters).
    pub fn dataset(&self) -> &Dataset {
        &self.records
    }

    /// Number of batches in an epoch.
    pub fn batches_per_epoch(&self) -> usize {
        let n = self.sampler.epoch(self.records.len(), 0).len();
        if self.cfg.drop_last {
            n / self.cfg.batch_size
        } else {
            n.div_ceil(self.cfg.batch_size)
        }
    }

    /// The batches of `epoch`, in order.
    pub fn epoch(&mut self, epoch: u64) -> Result<Epoch<'_>> {
        let run = self.start(epoch, 0)?;
        Ok(Epoch { run, loader: self })
    }

    /// The batches of `epoch`, in order, as [`BatchLoader::epoch`] yields them, in an epoch
    /// that owns the loader ([`OwnedEpoch::into_loader`] gives it back).
    ///
    /// # Errors
    /// [`BatchLoader::epoch`]'s, with the loader ([`NotStarted`]).
    pub fn into_epoch(mut self, epoch: u64) -> std::result::Result<OwnedEpoch, NotStarted> {
        match self.start(epoch, 0) {
            Ok(run) => Ok(OwnedEpoch { run, loader: self }),
            Err(error) => Err(NotStarted {
                error,
                loader: Box::new(self),
            }),
        }
    }

    /// The rest of the epoch at `at`, as [`BatchLoader::resume`] yields it, in an epoch that
    /// owns the loader.
    ///
    /// # Errors
    /// [`BatchLoader::resume`]'s, with the loader ([`NotStarted`]).
    pub fn into_resume(mut self, at: &Position) -> std::result::Result<OwnedEpoch, NotStarted> {
        match self
            .check_resume(at)
            .and_then(|()| self.start(at.epoch, at.samples))
        {
            Ok(run) => Ok(OwnedEpoch { run, loader: self }),
            Err(error) => Err(NotStarted {
                error,
                loader: Box::new(self),
            }),
        }
    }

    /// The rest of the epoch at `at` (saved by [`Epoch::position`], maybe by a run with
    /// another world size): this rank's share of the samples after `at.samples`, none that
    /// the run before consumed. Needs an elastic sampler with the same order and global batch,
    /// over the same number of records.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) when the sampler is not elastic or `at` does not match it
    /// or the data set (it says which), then [`BatchLoader::epoch`]'s.
    ///
    /// # Example (host batches)
    /// ```
    /// use gpufeed_data::{BatchLoader, BatchLoaderOptions, Order, Position, RecordFile, Sampler};
    /// # let dir = tempfile::tempdir()?;
    /// # let path = dir.path().join("records.bin");
    /// std::fs::write(&path, vec![7u8; 1000])?;
    /// let open = |rank, world| -> gpufeed_data::Result<BatchLoader> {
    ///     // SAFETY: the file is not changed while it is used.
    ///     let records = unsafe { RecordFile::open_fixed(&path, 10)? }; // 100 records
    ///     let sampler = Sampler::elastic(Order::Shuffled { seed: 1 }, 8, rank, world, true)?;
    ///     BatchLoader::new(records, sampler, BatchLoaderOptions::default(), None)
    /// };
    /// // One rank of a world of two runs three steps, then stops: its position is saved.
    /// let mut loader = open(0, 2)?;
    /// let mut epoch = loader.epoch(0)?;
    /// for _ in 0..3 { epoch.next().transpose()?; }
    /// let json = serde_json::to_string(&epoch.position().expect("elastic"))?;
    /// drop(epoch);
    /// // Resumed by a world of four: each rank gets 2 records per step, 9 more steps.
    /// let at: Position = serde_json::from_str(&json)?;
    /// let mut loader = open(3, 4)?;
    /// let rest: Vec<usize> = loader.resume(&at)?.map(|b| b.map(|b| b.indices.len())).collect::<Result<_, _>>()?;
    /// assert_eq!(rest, vec![2; 9]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn resume(&mut self, at: &Position) -> Result<Epoch<'_>> {
        self.check_resume(at)?;
        let run = self.start(at.epoch, at.samples)?;
        Ok(Epoch { run, loader: self })
    }

    /// Whether this loader can resume from `at` ([`BatchLoader::resume`]'s checks).
    fn check_resume(&self, at: &Position) -> Result<()> {
        let bad = |why: String| Err(Error::invalid(format!("cannot resume: {why}")));
        let Some(global) = self.sampler.global_batch else {
            return bad("the sampler is not elastic (Sampler::elastic)".into());
        };
        let n = self.records.len() as u64;
        if at.records != n {
            return bad(format!(
                "the position is of a data set of {} records, this one has {n}",
                at.records
            ));
        }
        if at.order != self.sampler.order {
            return bad(format!(
                "the position's order is {:?}, this sampler's {:?}",
                at.order, self.sampler.order
            ));
        }
        if at.global_batch != global {
            return bad(format!(
                "the position's global batch is {}, this sampler's {global}",
                at.global_batch
            ));
        }
        if !at.samples.is_multiple_of(global as u64) {
            return bad(format!(
                "{} samples is not a whole number of global batches of {global}",
                at.samples
            ));
        }
        // The end of an epoch is a position (its last batch may be partial); past it is not.
        let end = n.div_ceil(global as u64).saturating_mul(global as u64);
        if at.samples > end {
            return bad(format!(
                "{} samples is past the end of an epoch of {n} records ({end} with the last \
                 global batch whole)",
                at.samples
            ));
        }
        Ok(())
    }

    /// Starts the workers of `epoch` from sample `start` of its global order.
    fn start(&mut self, epoch: u64, start: u64) -> Result<Running> {
        let indices = self
            .sampler
            .epoch_of_shards(&self.records.shard_starts(), epoch, start);
        let mut jobs: VecDeque<(usize, Vec<usize>)> = indices
            .chunks(self.cfg.batch_size)
            .filter(|c| !self.cfg.drop_last || c.len() == self.cfg.batch_size)
            .map(<[usize]>::to_vec)
            .enumerate()
            .collect();
        let total = jobs.len();
        // Streamed shards: fetched in the order these batches need them (refused here where
        // the order needs more of them at once than the cap).
        let stream = match &*self.records {
            Dataset::Streamed(s) => Some(s.begin(jobs.iter().map(|(_, j)| j.as_slice()))?),
            _ => None,
        };
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                stop: false,
            }),
            ready: Condvar::new(),
        });
        // Hand out the first `prefetch` jobs; one more per batch consumed.
        {
            let mut q = shared.queue.lock();
            let first = self.cfg.prefetch.min(jobs.len());
            q.jobs.extend(jobs.drain(..first));
        }
        let (tx, rx) = mpsc::channel();
        let generation = stream
            .as_ref()
            .map_or(0, crate::stream::StreamRun::generation);
        let workers = (0..self.cfg.workers.min(total.max(1)))
            .map(|i| {
                let (shared, tx) = (Arc::clone(&shared), tx.clone());
                let (records, pool, transform) = (
                    Arc::clone(&self.records),
                    self.pool.clone(),
                    self.transform.clone(),
                );
                let sched = self.gpu.as_ref().map(|(_, s)| Arc::clone(s));
                let memory = Arc::clone(&self.memory);
                let gpu_gather = self.gpu_gather.clone();
                let counters = self.cfg.direct.then(|| Arc::clone(&self.direct));
                let depth = self.cfg.direct_depth.max(1);
                std::thread::Builder::new()
                    .name(format!("gpufeed-batch-{i}"))
                    .spawn(move || {
                        let job = Job {
                            records: &records,
                            pool: &pool,
                            transform: transform.as_ref(),
                            sched: sched.as_deref(),
                            memory: &memory,
                            direct: counters.as_deref().map(|c| (c, depth)),
                            generation,
                            gpu_gather: gpu_gather.as_deref(),
                        };
                        worker(&shared, &tx, &job);
                    })
                    .map_err(|source| {
                        Error::from(gpufeed_load::Error::ThreadStart {
                            what: "a batch worker thread",
                            source,
                        })
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        self.memory.open();
        Ok(Running {
            memory: Arc::clone(&self.memory),
            epoch,
            start,
            handed: 0,
            next: 0,
            total,
            pending: jobs,
            done: BTreeMap::new(),
            rx,
            shared,
            workers,
            timeout: self.cfg.batch_timeout,
            stream,
        })
    }
}
