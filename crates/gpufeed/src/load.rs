//! Files to GPU memory: `load_file` and its strategies.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use gpufeed_cuda::cudarc::driver::{DevicePtrMut, DeviceSlice};
use gpufeed_cuda::{
    DeviceAlloc, FillSource, Gpu, HostSource, SourceError, TransferConfig, TransferScheduler,
};
use gpufeed_os::{Fallback, Refused};
use gpufeed_os::{FileMap, MapMode, cache};
use gpufeed_pinned::{HostRegistration, HostSlab};
use gpufeed_uring::{Backend, Direct, Reader};
use parking_lot::Mutex;

use crate::error::{Error, Result};

/// GPU memory as gpufeed hands it out: a cudarc `CudaSlice<u8>`, so cudarc and candle users
/// take it as it is.
pub type DeviceBuffer = gpufeed_cuda::cudarc::driver::CudaSlice<u8>;

/// How a file reaches the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Strategy {
    /// Decide from page-cache residency, file size against available memory and what the
    /// machine allows (`Staged` for cached files, `Direct` for cold ones where `O_DIRECT`
    /// works); the report says what was chosen and why.
    #[default]
    Auto,
    /// Map the file read-only, register the mapping with CUDA in chunks (on a few threads,
    /// ahead of the copies) and copy straight out of the page cache: no host copy at all, the
    /// cheapest path per CPU thread ([`LoadOptions::one_thread`]). With every core filling
    /// staging buffers `Staged` is faster (43.9 against 26.3 GB/s warm on the H200 machine),
    /// so `Auto` does not pick it. The file must not be truncated while it loads.
    Registered,
    /// Read the file (buffered `pread`s, on every fill thread) into pinned staging buffers
    /// that the scheduler uploads, reads overlapped with copies. Safe for files that may
    /// change while loading.
    Staged,
    /// Like `Staged` with `O_DIRECT`: for files not in the page cache, or larger than it.
    Direct,
}

/// The path a load ran: a [`Strategy`] with `Auto` resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    Registered,
    Staged,
    Direct,
}

impl Route {
    pub(crate) fn strategy(self) -> Strategy {
        match self {
            Route::Registered => Strategy::Registered,
            Route::Staged => Strategy::Staged,
            Route::Direct => Strategy::Direct,
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Strategy::Auto => "auto",
            Strategy::Registered => "registered",
            Strategy::Staged => "staged",
            Strategy::Direct => "direct",
        };
        f.write_str(s)
    }
}

impl std::str::FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => Strategy::Auto,
            "registered" => Strategy::Registered,
            "staged" => Strategy::Staged,
            "direct" => Strategy::Direct,
            other => {
                return Err(Error::InvalidSetting(format!(
                    "unknown strategy {other:?}; use auto, registered, staged or direct"
                )));
            }
        })
    }
}

/// Settings of a load. Start from [`LoadOptions::default`] (or [`LoadOptions::one_thread`])
/// and change what you need: the fields are public, and new ones may be added.
///
/// ```
/// use gpufeed::{LoadOptions, Strategy};
/// let mut opts = LoadOptions::default().with_strategy(Strategy::Direct);
/// opts.transfer.fill_threads = 4;
/// assert_eq!(opts.strategy, Strategy::Direct);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LoadOptions {
    /// The strategy (default `Auto`).
    pub strategy: Strategy,
    /// Streams, chunk size, staging buffers and fill (IO) threads of the transfer.
    pub transfer: TransferConfig,
    /// Bytes registered per `cuMemHostRegister` call by `Registered` (64 MiB: shorter driver
    /// calls disturb the concurrent copies less; a sweep on the H200 machine is in
    /// docs/benchmarks.md). At least 1 MiB.
    pub register_chunk_bytes: usize,
    /// Threads registering chunks ahead of the copies for `Registered` (2).
    pub register_threads: usize,
    /// Reads in flight per IO thread for `Direct` (8; `Staged` reads one piece per `pread`).
    /// File lists ([`Loader::load_files`]) use at least 32.
    pub queue_depth: usize,
    /// Test hook, not API: registration fails as a driver refusing it would
    /// (`CUDA_ERROR_NOT_PERMITTED`, as under some container and WSL limits), to test the
    /// fallback to `Staged` on machines whose driver never refuses.
    #[doc(hidden)]
    pub testing_refuse_registration: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        // Tuned on the H200 machine (docs/benchmarks.md, sweeps 3 and 4): for copies out of
        // the page cache, 4 MiB chunks on every core, two staging buffers per fill thread
        // (52 GB/s in lanes, against 26-28 with 16 MiB chunks).
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let fill_threads = cores.clamp(2, 16);
        LoadOptions {
            strategy: Strategy::Auto,
            transfer: TransferConfig::default()
                .with_streams(4)
                .with_chunk_bytes(4 << 20)
                .with_staging_buffers(2 * fill_threads)
                .with_fill_threads(fill_threads),
            register_chunk_bytes: 64 << 20,
            register_threads: 2,
            queue_depth: 8,
            testing_refuse_registration: false,
        }
    }
}

impl LoadOptions {
    /// Options using a single IO thread: `Registered`, one thread registering while the calling
    /// thread issues the copies (the cheapest warm path per CPU thread).
    pub fn one_thread() -> Self {
        LoadOptions {
            strategy: Strategy::Registered,
            transfer: TransferConfig::default()
                .with_fill_threads(1)
                .with_staging_buffers(4),
            register_threads: 1,
            ..Self::default()
        }
    }

    /// The options for one of `gpus` GPUs loading at once from this host ([`crate::multi::
    /// MultiLoader`]): the host's cores shared out, `cores / gpus` fill threads per GPU (2 to
    /// 16), 2 MiB chunks and two staging buffers per thread, so that the staging in flight
    /// stays small. One GPU: [`LoadOptions::default`]. Measured on the two-GPU H200 machine
    /// (32 cores; docs/benchmarks.md, GPU runs 39-40): two GPUs sharded 95-96 GB/s in all with 16
    /// threads and 2 MiB chunks each, against 82.3 with 8 threads and 4 MiB chunks and 68.6
    /// with 16 threads and 4 MiB chunks (the single-GPU default on each).
    ///
    /// ```
    /// let opts = gpufeed::LoadOptions::for_gpus(2);
    /// assert_eq!(opts.transfer.chunk_bytes, 2 << 20);
    /// ```
    pub fn for_gpus(gpus: usize) -> Self {
        if gpus <= 1 {
            return Self::default();
        }
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let threads = (cores / gpus).clamp(2, 16);
        LoadOptions {
            transfer: TransferConfig::default()
                .with_streams(4)
                .with_chunk_bytes(2 << 20)
                .with_staging_buffers(2 * threads)
                .with_fill_threads(threads),
            ..Self::default()
        }
    }

    /// These options with `strategy`.
    pub fn with_strategy(mut self, strategy: Strategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// These options with `transfer`.
    pub fn with_transfer(mut self, transfer: TransferConfig) -> Self {
        self.transfer = transfer;
        self
    }
}

/// What a load did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LoadReport {
    /// The file.
    pub path: PathBuf,
    /// The strategy that ran: never `Auto` once bytes moved (`Auto` resolved, and `Staged`
    /// where `Registered` was refused: see `fallbacks`); for an empty load, the one asked for.
    pub strategy: Strategy,
    /// Why that strategy.
    pub reason: String,
    /// Bytes loaded.
    pub bytes: u64,
    /// Wall seconds of the whole load (registration and reads included).
    pub seconds: f64,
    /// Share of the loaded range in the page cache before the load, estimated from 32
    /// windows of 1 MiB (`gpufeed_os::cache::residency_estimate`; exact up to 32 MiB).
    /// `None` where the kernel does not tell, and for `Auto` loads under 8 MiB, which are
    /// staged without looking (the answer could not change the strategy enough to pay for
    /// the question).
    pub residency_before: Option<f64>,
    /// Slower paths taken: what was refused, why, and what ran instead.
    pub fallbacks: Vec<Fallback>,
    /// Seconds the copies waited for the source (reads or registration).
    pub copy_waited_s: f64,
    /// Seconds the source waited for free staging buffers.
    pub source_waited_s: f64,
    /// How the file was read: `"pread"` for buffered (`Staged`) loads, the io_uring reader's
    /// backend for `Direct` ones; `None` for `Registered`.
    pub io_backend: Option<String>,
}

impl LoadReport {
    /// GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        gpufeed_os::gbps(self.bytes, self.seconds)
    }
}

/// Loads files into GPU memory, keeping its streams and pinned staging buffers between loads
/// (allocating pinned memory is expensive: keep one `Loader` for repeated loads).
///
/// # Example
/// ```no_run
/// use gpufeed::{Gpu, LoadOptions, Loader};
/// let gpu = Gpu::open(0)?;
/// let loader = Loader::new(&gpu, LoadOptions::default())?;
/// let (weights, report) = loader.load_file("model.bin")?;
/// println!("{} bytes by {} ({}) at {:.1} GB/s", weights.len(), report.strategy, report.reason, report.gbps());
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub struct Loader {
    pub(crate) gpu: Gpu,
    pub(crate) sched: TransferScheduler,
    pub(crate) opts: LoadOptions,
    cleanup: Mutex<Cleanup>,
    setup: LoaderSetup,
    /// Whether the next load's device memory comes from `cuMemAlloc` (the first load; every
    /// load of a one-shot) rather than the pool.
    unpooled: AtomicBool,
    /// Every load's device memory from `cuMemAlloc` (one-shot loaders).
    pub(crate) always_unpooled: bool,
    /// io_uring readers kept between loads (building one sets up a ring: ~100 us): `O_DIRECT`
    /// ones for `Direct` loads, buffered ones for file lists; a load opens its files in the
    /// readers it takes and closes them after.
    pub(crate) readers: Readers,
}

/// A loader's idle readers.
#[derive(Default)]
pub(crate) struct Readers {
    buffered: Mutex<Vec<Reader>>,
    direct: Mutex<Vec<Reader>>,
}

impl Readers {
    fn idle(&self, direct: Direct) -> &Mutex<Vec<Reader>> {
        match direct {
            Direct::On => &self.direct,
            _ => &self.buffered,
        }
    }

    /// An idle reader of that kind, or a new one.
    pub(crate) fn take(&self, direct: Direct, queue_depth: usize) -> Result<Reader> {
        let idle = self.idle(direct).lock().pop();
        match idle {
            Some(r) => Ok(r),
            None => Ok(Reader::builder()
                .direct(direct)
                .queue_depth(queue_depth)
                .block_bytes(1 << 20)
                // Buffered reads complete inline in the fill thread, which then uploads what
                // it copied (faster on the H200 machine than the kernel's workers:
                // benchmarks.md).
                .async_buffered(false)
                .build()?),
        }
    }

    /// Gives back a reader that has no file open (files left open stay open in it: close
    /// them first).
    pub(crate) fn give_back(&self, direct: Direct, reader: Reader) {
        self.idle(direct).lock().push(reader);
    }
}

/// How a [`Loader`] was set up: what it reserved and what that took.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LoaderSetup {
    /// Seconds opening the GPU (`cuInit`, the primary context) on its own thread, for
    /// [`Loader::open`]; `None` for [`Loader::new`], which is given an open GPU.
    pub context_seconds: Option<f64>,
    /// Seconds making the staging: faulting its memory in (in [`Loader::open`], while the
    /// context was being created) and registering it.
    pub staging_seconds: f64,
    /// Seconds from the call until the loader was ready.
    pub total_seconds: f64,
    /// Bytes of pinned staging reserved for the loads (0 for `Registered`, which stages
    /// nothing, or where the reservation was refused: see `fallbacks`).
    pub staging_bytes: u64,
    /// Slower paths taken: a refused staging reservation (loads then allocate staging on the
    /// way), staging that could not be faulted in ahead.
    pub fallbacks: Vec<Fallback>,
    /// What else went otherwise than usual (staging placed after the context on a machine of
    /// several NUMA nodes).
    pub notes: Vec<String>,
}

/// Loads from this size take a loader's first device memory from `cuMemAlloc`, where the gain
/// was measured (4 and 16 GiB). Smaller first loads keep the pool: which is faster for them is
/// not measured (a context's first pool allocation, even of 1 MiB, took 7-10 ms on the H200
/// machine; a first `cuMemAlloc` was not timed alone).
pub(crate) const UNPOOLED_FROM: usize = 64 << 20;

/// `Auto` samples the page-cache residency of loads from this size to choose between `Staged`
/// and `Direct`; smaller loads are staged without looking: buffered reads serve what is cached
/// from memory, and for what is not, `O_DIRECT` would save one copy of a few MiB against a
/// disk read many times longer.
pub(crate) const SAMPLE_FROM: u64 = 8 << 20;

/// Background unregistrations of earlier registered loads.
#[derive(Default)]
struct Cleanup {
    running: Vec<std::thread::JoinHandle<()>>,
    /// Finished since the last `wait_for_cleanup`.
    finished: usize,
}

impl fmt::Debug for Loader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Loader")
            .field("gpu", &self.gpu.info().name)
            .field("opts", &self.opts)
            .finish()
    }
}

/// Loads all of `path` into new GPU memory. For repeated loads keep a [`Loader`].
pub fn load_file(
    gpu: &Gpu,
    path: impl AsRef<Path>,
    opts: LoadOptions,
) -> Result<(DeviceBuffer, LoadReport)> {
    let path = path.as_ref();
    let len = file_len(path)?;
    Loader::for_bytes(gpu, opts, len)?.load_range(path, 0..len)
}

/// What a one-shot load ([`load_file_on`], [`crate::safetensors::load_on`]) spent its time on.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OneShotReport {
    /// Seconds opening the GPU on its own thread (`cuInit`, the primary context).
    pub context_seconds: f64,
    /// Seconds of the work on the calling thread: checking the files, reading headers and
    /// faulting in the staging while the context is created, then registering the staging
    /// once it is there.
    pub host_seconds: f64,
    /// Seconds from the call until the loader was ready (the context, then the staging's
    /// registration and the streams).
    pub ready_seconds: f64,
    /// Seconds of the loads themselves (device memory, copies).
    pub load_seconds: f64,
    /// Seconds from the call to the end, staging released.
    pub total_seconds: f64,
    /// Bytes moved to the GPU.
    pub bytes: u64,
    /// Pinned staging used (bounded: [`TransferConfig::staging_bytes_for`] of the largest
    /// file), registered for the call only.
    pub staging_bytes: u64,
    /// One report per file loaded.
    pub loads: Vec<LoadReport>,
    /// Slower paths taken while setting up ([`LoaderSetup::fallbacks`]).
    pub fallbacks: Vec<Fallback>,
    /// What else went otherwise than usual while setting up ([`LoaderSetup::notes`]).
    pub notes: Vec<String>,
}

impl OneShotReport {
    /// GB/s from the call to the end (context included).
    pub fn gbps(&self) -> f64 {
        gpufeed_os::gbps(self.bytes, self.total_seconds)
    }
}

/// Runs a one-shot: opens GPU `ordinal` while `host` prepares (returning what it found and the
/// bytes of the largest single load), then `load` with the ready loader; the loader and its
/// pinned staging are released before this returns.
pub(crate) fn one_shot<P, T>(
    ordinal: usize,
    host: impl FnOnce() -> Result<(P, u64)>,
    load: impl FnOnce(&Loader, P) -> Result<(T, Vec<LoadReport>)>,
) -> Result<(Gpu, T, OneShotReport)> {
    let started = Instant::now();
    let mut host_s = 0.0;
    let (mut loader, prepared) = Loader::open_with(ordinal, LoadOptions::default(), || {
        let t = Instant::now();
        let r = host().map(|(p, bytes)| (p, Some(bytes)));
        host_s = t.elapsed().as_secs_f64();
        r
    })?;
    // Loaded once and kept: every buffer from cuMemAlloc (see load_range).
    loader.always_unpooled = true;
    let setup = loader.setup().clone();
    let ready_s = started.elapsed().as_secs_f64();
    let t = Instant::now();
    let (value, loads) = load(&loader, prepared)?;
    let load_seconds = t.elapsed().as_secs_f64();
    let gpu = loader.gpu().clone();
    drop(loader);
    Ok((
        gpu,
        value,
        OneShotReport {
            context_seconds: setup.context_seconds.unwrap_or(0.0),
            host_seconds: host_s + setup.staging_seconds,
            ready_seconds: ready_s,
            load_seconds,
            total_seconds: started.elapsed().as_secs_f64(),
            bytes: loads.iter().map(|r| r.bytes).sum(),
            staging_bytes: setup.staging_bytes,
            loads,
            fallbacks: setup.fallbacks,
            notes: setup.notes,
        },
    ))
}

/// Loads all of `path` onto GPU `ordinal` in one call, opening the GPU on another thread while
/// this one checks the file and faults in the pinned staging (bounded:
/// [`TransferConfig::staging_bytes_for`] the file, 128 MiB at most with the default options on
/// 16 cores), which is unregistered and freed before this returns. For a process that loads
/// once at start-up; keep a [`Loader`] for more.
///
/// # Errors
/// The file's errors (missing, a directory, unreadable) before the GPU's (no driver, no such
/// device), then [`Loader::load_file`]'s.
///
/// # Example
/// ```no_run
/// let (gpu, weights, report) = gpufeed::load_file_on(0, "model.bin")?;
/// println!(
///     "{} bytes on {}: context {:.0} ms, load {:.0} ms",
///     weights.len(), gpu.info().name, report.context_seconds * 1e3, report.load_seconds * 1e3
/// );
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub fn load_file_on(
    ordinal: usize,
    path: impl AsRef<Path>,
) -> Result<(Gpu, DeviceBuffer, OneShotReport)> {
    let path = path.as_ref();
    one_shot(
        ordinal,
        || file_len(path).map(|len| (len, len)),
        |loader, len| {
            let (buf, report) = loader.load_range(path, 0..len)?;
            Ok((buf, vec![report]))
        },
    )
}

impl Loader {
    /// A loader for `gpu`, with its pinned staging reserved now, from one slab registered
    /// with one call (at most [`TransferConfig::staging_bytes_for`]: 128 MiB with the default
    /// options on 16 cores; none for `Strategy::Registered`), so that its first load runs
    /// at the speed of a warm one (its device memory comes from `cuMemAlloc`; the second load
    /// grows the context's pool, later ones reuse it). Reserving took 22-31 ms on the H200
    /// machine (docs/benchmarks.md, GPU runs 10-13), most of it faulting the memory in;
    /// [`Loader::open`] does that while the GPU's context is created. A refused reservation is noted in [`Loader::setup`] and loads allocate their
    /// staging on the way, as a pool does.
    pub fn new(gpu: &Gpu, opts: LoadOptions) -> Result<Self> {
        Self::with_staging(gpu, opts, None, None, Instant::now())
    }

    /// A loader whose staging is sized for loads of at most `bytes` (the convenience functions
    /// that load one file know its size).
    pub(crate) fn for_bytes(gpu: &Gpu, opts: LoadOptions, bytes: u64) -> Result<Self> {
        Self::with_staging(gpu, opts, Some(bytes), None, Instant::now())
    }

    /// Builds the loader and reserves its staging (`slab` when made ahead).
    fn with_staging(
        gpu: &Gpu,
        mut opts: LoadOptions,
        bytes: Option<u64>,
        slab: Option<(HostSlab, f64)>,
        started: Instant,
    ) -> Result<Self> {
        if opts.register_chunk_bytes < 1 << 20 {
            return Err(Error::InvalidSetting(format!(
                "register_chunk_bytes is {} B; use at least 1 MiB",
                opts.register_chunk_bytes
            )));
        }
        opts.transfer = sized_for(opts.transfer, bytes);
        let sched = TransferScheduler::new(gpu, opts.transfer)?;
        let mut setup = LoaderSetup::default();
        if stages(opts.strategy) {
            let t = Instant::now();
            let (slab, made_s) = match slab {
                Some((slab, s)) => (Some(slab), s),
                None => (None, 0.0),
            };
            match sched.reserve_staging(bytes, slab) {
                Ok(reserved) => setup.staging_bytes = reserved as u64,
                Err(e) => Fallback::new(
                    Refused::StagingReservation,
                    e.to_string(),
                    "loads allocate their staging on the way",
                )
                .push_once(&mut setup.fallbacks),
            }
            setup.staging_seconds = made_s + t.elapsed().as_secs_f64();
        }
        setup.total_seconds = started.elapsed().as_secs_f64();
        Ok(Loader {
            gpu: gpu.clone(),
            sched,
            opts,
            cleanup: Mutex::new(Cleanup::default()),
            setup,
            unpooled: AtomicBool::new(true),
            always_unpooled: false,
            readers: Readers::default(),
        })
    }

    /// Opens GPU `ordinal` and makes a loader for it, doing on this thread, while another
    /// creates the GPU's context (120-580 ms on the H200 machine), what needs no GPU: faulting
    /// in the loader's pinned staging. A failure on either side is returned (the thread is
    /// always joined first: nothing is left running). On the H200 machine, a VM, faulting
    /// memory in slowed the context's creation by about as much as it saved (docs/benchmarks.md,
    /// GPU runs 8-13); where first touches run in parallel it saves the staging's ~20 ms.
    ///
    /// # Errors
    /// [`Loader::new`]'s and [`Gpu::open`]'s (no driver, no such device).
    ///
    /// # Example
    /// ```no_run
    /// let loader = gpufeed::Loader::open(0, gpufeed::LoadOptions::default())?;
    /// let setup = loader.setup();
    /// println!("context {:.0} ms, ready after {:.0} ms", setup.context_seconds.unwrap_or(0.0) * 1e3, setup.total_seconds * 1e3);
    /// let (weights, report) = loader.load_file("model.bin")?;
    /// # Ok::<(), gpufeed::Error>(())
    /// ```
    pub fn open(ordinal: usize, opts: LoadOptions) -> Result<Self> {
        Self::open_with(ordinal, opts, || Ok(((), None))).map(|(l, ())| l)
    }

    /// [`Loader::open`] that also runs `host` on this thread while the context is created;
    /// `host` says how many bytes the loads will move at most (to size the staging), and its
    /// error, if any, is returned first (a missing file before a missing GPU).
    pub(crate) fn open_with<T>(
        ordinal: usize,
        opts: LoadOptions,
        host: impl FnOnce() -> Result<(T, Option<u64>)>,
    ) -> Result<(Self, T)> {
        let started = Instant::now();
        let opener = std::thread::Builder::new()
            .name("gpufeed-open".into())
            .spawn(move || {
                let t = Instant::now();
                Gpu::open(ordinal).map(|gpu| (gpu, t.elapsed().as_secs_f64()))
            })
            .map_err(|source| Error::ThreadStart {
                what: "a thread to open the GPU",
                source,
            })?;
        let (mut notes, mut fallbacks) = (Vec::new(), Vec::new());
        let hosted = host();
        let slab = match &hosted {
            Ok((_, bytes)) if stages(opts.strategy) => {
                // Pages faulted in before the GPU's NUMA node is known land on this thread's
                // node: on a machine of several, fault them in afterwards, placed.
                if gpufeed_numa::Topology::detect().is_ok_and(|t| t.is_numa()) {
                    notes.push(
                        "several NUMA nodes: staging faulted in after the context, on the GPU's node"
                            .to_owned(),
                    );
                    None
                } else {
                    let t = Instant::now();
                    let len = sized_for(opts.transfer, *bytes).staging_bytes_for(*bytes);
                    if len == 0 {
                        None
                    } else {
                        HostSlab::new(len)
                            .inspect_err(|e| {
                                Fallback::new(
                                    Refused::StagingReservation,
                                    format!("faulting in the staging ahead failed: {e}"),
                                    "staging made after the context",
                                )
                                .push_once(&mut fallbacks);
                            })
                            .ok()
                            .map(|slab| (slab, t.elapsed().as_secs_f64()))
                    }
                }
            }
            _ => None,
        };
        let opened = opener.join().map_err(|_| Error::ThreadPanicked {
            what: "the thread opening the GPU",
        });
        let (value, bytes) = hosted?;
        let (gpu, context_s) = opened??;
        let mut loader = Self::with_staging(&gpu, opts, bytes, slab, started)?;
        loader.setup.context_seconds = Some(context_s);
        loader.setup.notes.splice(0..0, notes);
        loader.setup.fallbacks.splice(0..0, fallbacks);
        Ok((loader, value))
    }

    /// What setting the loader up reserved and took.
    pub fn setup(&self) -> &LoaderSetup {
        &self.setup
    }

    /// The options it loads with.
    pub fn options(&self) -> &LoadOptions {
        &self.opts
    }

    /// Waits until the registrations of earlier `Registered` loads of this
    /// loader are undone; returns how many loads' cleanups ended since the last call.
    ///
    /// A registered load returns as soon as its copies are done and unregisters the file's
    /// pages on a background thread (about a third of the registration's cost). While that
    /// runs the CUDA driver holds off copies that other threads issue, so a load started right
    /// after a registered one runs slower (on the H200 machine a staged load ran at 33-35
    /// GB/s instead of 48-51). Call this first where the next load must run at full speed.
    pub fn wait_for_cleanup(&self) -> usize {
        let (running, finished) = {
            let mut c = self.cleanup.lock();
            (
                std::mem::take(&mut c.running),
                std::mem::take(&mut c.finished),
            )
        };
        let n = running.len();
        for h in running {
            if h.join().is_err() {
                tracing::warn!("an unregister thread panicked");
            }
        }
        finished + n
    }

    /// The GPU it loads to.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Loads all of `path` into new GPU memory.
    pub fn load_file(&self, path: impl AsRef<Path>) -> Result<(DeviceBuffer, LoadReport)> {
        let (path, started) = (path.as_ref(), Instant::now());
        let len = file_len(path)?;
        self.load_new(path, std::slice::from_ref(&(0..len)), len, len, started)
    }

    /// Loads bytes `range` of `path` into new GPU memory.
    pub fn load_range(
        &self,
        path: impl AsRef<Path>,
        range: Range<u64>,
    ) -> Result<(DeviceBuffer, LoadReport)> {
        let (path, started) = (path.as_ref(), Instant::now());
        let spans = std::slice::from_ref(&range);
        let (file_len, len) = check_spans(path, spans)?;
        self.load_new(path, spans, file_len, len, started)
    }

    /// `spans` of `path` (checked: a file of `file_len` bytes, `len` bytes in the spans) into
    /// new device memory.
    fn load_new(
        &self,
        path: &Path,
        spans: &[Range<u64>],
        file_len: u64,
        len: u64,
        started: Instant,
    ) -> Result<(DeviceBuffer, LoadReport)> {
        let len = len as usize;
        self.gpu.alloc_filled(len, self.device_alloc(len), |dst| {
            self.load_checked(path, spans, file_len, dst, started)
        })
    }

    /// Where a load of `len` bytes takes its device memory from. A loader's first load (the
    /// only one, for most users) takes it from cuMemAlloc: growing the context's pool would
    /// cost it 2-3 ms per GiB up front (docs/benchmarks.md, GPU run 8). Later loads use the
    /// pool, which gives back what earlier loads' buffers freed at no cost.
    pub(crate) fn device_alloc(&self, len: usize) -> DeviceAlloc {
        let unpooled = len >= UNPOOLED_FROM
            && (self.always_unpooled || self.unpooled.swap(false, Ordering::Relaxed));
        if unpooled {
            DeviceAlloc::Unpooled
        } else {
            DeviceAlloc::Pool
        }
    }

    /// Loads bytes `range` of `path` into `dst` starting at `dst_offset`.
    ///
    /// # Errors
    /// Missing file, directory, range past the end of the file (`gpufeed_os::Error`), a
    /// destination too small, the file changing during a registered load, read and CUDA errors.
    pub fn load_into(
        &self,
        path: impl AsRef<Path>,
        range: Range<u64>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
    ) -> Result<LoadReport> {
        let path = path.as_ref();
        let started = Instant::now();
        let spans = std::slice::from_ref(&range);
        let (file_len, len) = check_spans(path, spans)?;
        // Nothing to load needs no room (an empty load at any offset succeeds, as it did).
        let at = if len == 0 { 0 } else { dst_offset };
        fits(len, at, dst.len())?;
        let mut view = dst.slice_mut(at..at + len as usize);
        self.load_checked(path, spans, file_len, &mut view, started)
    }

    /// Loads byte ranges `spans` of `path`, back to back in that order, into new GPU memory:
    /// the pieces of one file a GPU needs (a tensor-parallel slice of each tensor, a rank's
    /// share of a file) in one transfer, the fill threads reading the spans into staging
    /// buffers uploaded in large copies. Spans may be empty, repeat or overlap.
    ///
    /// # Errors
    /// [`Loader::load_into`]'s, for any span past the end of the file.
    ///
    /// # Example
    /// ```no_run
    /// let loader = gpufeed::Loader::open(0, gpufeed::LoadOptions::default())?;
    /// // The first and the third MiB of the file, 2 MiB on the GPU.
    /// let (buf, report) = loader.load_spans("data.bin", &[0..1 << 20, 2 << 20..3 << 20])?;
    /// assert_eq!(buf.len(), 2 << 20);
    /// # Ok::<(), gpufeed::Error>(())
    /// ```
    pub fn load_spans(
        &self,
        path: impl AsRef<Path>,
        spans: &[Range<u64>],
    ) -> Result<(DeviceBuffer, LoadReport)> {
        let (path, started) = (path.as_ref(), Instant::now());
        let (file_len, len) = check_spans(path, spans)?;
        self.load_new(path, spans, file_len, len, started)
    }

    /// [`Loader::load_spans`] into `dst`, a device buffer or view exactly as long as the spans
    /// together (checked).
    pub(crate) fn load_spans_to<D>(
        &self,
        path: &Path,
        spans: &[Range<u64>],
        dst: &mut D,
    ) -> Result<LoadReport>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        let started = Instant::now();
        let (file_len, len) = check_spans(path, spans)?;
        if len != dst.len() as u64 {
            return Err(gpufeed_cuda::Error::OutOfBounds {
                len,
                offset: 0,
                capacity: dst.len() as u64,
            }
            .into());
        }
        self.load_checked(path, spans, file_len, dst, started)
    }

    /// Loads `spans` (checked against the file's length `file_len`) into `dst`, exactly as long.
    fn load_checked<D>(
        &self,
        path: &Path,
        spans: &[Range<u64>],
        file_len: u64,
        dst: &mut D,
        started: Instant,
    ) -> Result<LoadReport>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        let len = dst.len() as u64;
        let hull = match (
            spans.iter().map(|s| s.start).min(),
            spans.iter().map(|s| s.end).max(),
        ) {
            (Some(a), Some(b)) => a..b,
            _ => 0..0,
        };
        let residency = if self.opts.strategy == Strategy::Auto && len < SAMPLE_FROM {
            None
        } else {
            residency_of(path, hull)
        };
        let mut report = LoadReport {
            path: path.into(),
            strategy: self.opts.strategy,
            reason: String::new(),
            bytes: len,
            seconds: 0.0,
            residency_before: residency,
            fallbacks: Vec::new(),
            copy_waited_s: 0.0,
            source_waited_s: 0.0,
            io_backend: None,
        };
        if len == 0 {
            report.reason = "nothing to load".into();
            return Ok(report);
        }
        let (route, reason) = match self.opts.strategy {
            Strategy::Auto if len < SAMPLE_FROM => (
                Route::Staged,
                format!(
                    "a small load (under {} MiB): buffered reads into pinned staging, cached pages copied from memory and the rest read from the disk (residency not sampled: O_DIRECT would save little here)",
                    SAMPLE_FROM >> 20
                ),
            ),
            Strategy::Auto => choose(path, file_len, residency),
            Strategy::Registered if spans.len() > 1 => (
                Route::Staged,
                "registration maps one range of a file; several spans are staged".to_owned(),
            ),
            Strategy::Registered => (Route::Registered, "asked for".to_owned()),
            Strategy::Staged => (Route::Staged, "asked for".to_owned()),
            Strategy::Direct => (Route::Direct, "asked for".to_owned()),
        };
        report.reason = reason;
        let ran = match route {
            Route::Registered => {
                self.registered_or_staged(path, spans[0].clone(), dst, &mut report)?
            }
            Route::Staged | Route::Direct => {
                self.staged(path, spans, dst, route == Route::Direct, &mut report)?;
                route
            }
        };
        report.strategy = ran.strategy();
        for f in self.sched.fallbacks() {
            f.push_once(&mut report.fallbacks);
        }
        report.seconds = started.elapsed().as_secs_f64();
        Ok(report)
    }

    /// `Registered`, falling back to `Staged` (recorded) where the platform refuses
    /// registration; returns the route that ran.
    fn registered_or_staged<D>(
        &self,
        path: &Path,
        range: Range<u64>,
        dst: &mut D,
        report: &mut LoadReport,
    ) -> Result<Route>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        match self.registered(path, range.clone(), dst, report) {
            Ok(()) => Ok(Route::Registered),
            Err(Error::Pinned(e)) if !matches!(e, gpufeed_pinned::Error::NoCudaDriver) => {
                Fallback::new(
                    Refused::HostRegistration,
                    e.to_string(),
                    "staged through pinned buffers instead",
                )
                .push_once(&mut report.fallbacks);
                self.staged(path, std::slice::from_ref(&range), dst, false, report)?;
                Ok(Route::Staged)
            }
            Err(e) => Err(e),
        }
    }

    /// `Registered`: the one place of the facade with unsafe code — the file's mapping, whose
    /// promise (not truncated while it loads) `Strategy::Registered` documents and the
    /// identity check after the copies backs, and its registration in pieces that outlive this
    /// call on the cleanup thread.
    #[allow(unsafe_code, reason = "maps and registers the file; see above")]
    fn registered<D>(
        &self,
        path: &Path,
        range: Range<u64>,
        dst: &mut D,
        report: &mut LoadReport,
    ) -> Result<()>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        if self.opts.testing_refuse_registration {
            return Err(Error::Pinned(gpufeed_pinned::Error::Cuda {
                op: "cuMemHostRegister",
                result: gpufeed_cuda::CUresult::CUDA_ERROR_NOT_PERMITTED,
            }));
        }
        let len = (range.end - range.start) as usize;
        // SAFETY: the file must not be truncated while it loads (documented on the strategy);
        // the identity check after the copies reports a file that changed.
        let map = unsafe { FileMap::open_range(path, range.start, len as u64, MapMode::ReadOnly)? };
        let base = map.as_ptr() as usize;
        let page = gpufeed_os::page_size();
        let chunk = self.opts.register_chunk_bytes.next_multiple_of(page);
        // Chunk boundaries on page boundaries, so registered ranges never share a page.
        let mut bounds = vec![0usize];
        let mut next = (base + chunk).next_multiple_of(page) - base;
        while next < len {
            bounds.push(next);
            next += chunk;
        }
        bounds.push(len);
        let pieces: Vec<(usize, usize)> = bounds.windows(2).map(|w| (w[0], w[1] - w[0])).collect();
        let ctx = self.gpu.context();
        let next_piece = AtomicUsize::new(0);
        let mut copy_waited = 0.0;
        // Registrations outlive this call (see below), so they are 'static: `map` moves along
        // with them and is unmapped only after the last one is unregistered.
        let mut done: Vec<HostRegistration<'static>> = Vec::with_capacity(pieces.len());
        let outcome = std::thread::scope(|scope| -> Result<()> {
            let (reg_tx, reg_rx) =
                mpsc::sync_channel::<(usize, gpufeed_pinned::Result<HostRegistration<'static>>)>(4);
            for _ in 0..self.opts.register_threads.max(1).min(pieces.len()) {
                let (tx, pieces, next_piece) = (reg_tx.clone(), &pieces, &next_piece);
                scope.spawn(move || {
                    loop {
                        let i = next_piece.fetch_add(1, Ordering::Relaxed);
                        let Some(&(off, n)) = pieces.get(i) else {
                            return;
                        };
                        // SAFETY: [base + off, +n) lies in `map`, which is dropped only after
                        // every registration (the cleanup below); it is read-only and
                        // registered read-only.
                        let reg = unsafe {
                            HostRegistration::register(ctx, (base + off) as *const u8, n, true)
                        };
                        let failed = reg.is_err();
                        if tx.send((i, reg)).is_err() || failed {
                            return;
                        }
                    }
                });
            }
            drop(reg_tx);
            for _ in 0..pieces.len() {
                let t = Instant::now();
                let Ok((i, reg)) = reg_rx.recv() else { break };
                copy_waited += t.elapsed().as_secs_f64();
                let reg = match reg {
                    Ok(r) => r,
                    Err(e) => {
                        next_piece.store(usize::MAX / 2, Ordering::Relaxed);
                        return Err(e.into());
                    }
                };
                let copied = self
                    .sched
                    .upload(HostSource::Registered(&reg), dst, pieces[i].0);
                done.push(reg);
                copied?;
            }
            Ok(())
        });
        // Unregistering costs about a third of registering: do it after returning, on a
        // thread of its own that then unmaps the file. Every copy has completed (upload
        // synchronizes), so nothing reads the pages any more.
        let changed = map.verify_unchanged();
        let cleanup = move || {
            drop(done);
            drop(map);
        };
        match std::thread::Builder::new()
            .name("gpufeed-unregister".into())
            .spawn(cleanup)
        {
            Ok(handle) => {
                let mut c = self.cleanup.lock();
                // Reap the ones that ended, so the list stays short without callers waiting.
                let (done, running): (Vec<_>, Vec<_>) =
                    c.running.drain(..).partition(|h| h.is_finished());
                c.finished += done.len();
                c.running = running;
                c.running.push(handle);
            }
            Err(_) => {
                tracing::warn!("could not start the unregister thread; unregistered now");
                self.cleanup.lock().finished += 1;
            }
        }
        outcome?;
        changed?;
        report.copy_waited_s = copy_waited;
        Ok(())
    }

    fn staged<D>(
        &self,
        path: &Path,
        spans: &[Range<u64>],
        dst: &mut D,
        direct: bool,
        report: &mut LoadReport,
    ) -> Result<()>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        let buffered = if direct {
            None
        } else {
            Some(gpufeed_os::file::open_regular(path, false)?.0)
        };
        let source = FileSource::new(path, spans, buffered, self.opts.queue_depth, &self.readers);
        let len = source.len();
        if len == 0 {
            return Ok(());
        }
        // Open the file in one reader up front, so that open errors surface as such.
        let first = if direct {
            source.take().map(|first| {
                report.io_backend = Some(first.reader.backend().to_string());
                source.open.lock().push(first);
            })
        } else {
            report.io_backend = Some("pread".to_owned());
            Ok(())
        };
        let uploaded = first.and_then(|()| {
            self.sched
                .upload(
                    HostSource::Fill {
                        source: &source,
                        len,
                    },
                    dst,
                    0,
                )
                .map_err(read_error)
        });
        // Files are opened with Direct::On or Direct::Off, never Auto: a refused O_DIRECT is
        // an error, not a fallback, so only the readers' own fallbacks (io_uring) are news.
        for f in source.finish() {
            f.push_once(&mut report.fallbacks);
        }
        let stats = uploaded?;
        report.copy_waited_s = stats.copy_waited_s;
        report.source_waited_s = stats.source_waited_s;
        Ok(())
    }
}

/// A staged load's error with the file source's own error typed again: the reader's
/// ([`Error::Read`]: a file that ended early, a failed read) rather than the scheduler's
/// wrapper around it.
pub(crate) fn read_error(e: gpufeed_cuda::Error) -> Error {
    let gpufeed_cuda::Error::Source { offset, source } = e else {
        return e.into();
    };
    match source.downcast::<gpufeed_uring::Error>() {
        Ok(read) => Error::Read(*read),
        Err(source) => match source.downcast::<Error>() {
            Ok(facade) => *facade,
            Err(source) => gpufeed_cuda::Error::Source { offset, source }.into(),
        },
    }
}

/// What `Strategy::Auto` picks for bytes `range` of `path` (a file of `file_len` bytes) now,
/// and why: the same residency estimate and rule as a load.
pub(crate) fn auto_choice(path: &Path, file_len: u64, range: Range<u64>) -> (Strategy, String) {
    let (route, why) = choose(path, file_len, residency_of(path, range));
    (route.strategy(), why)
}

/// The share of `range` in the page cache, estimated from samples (an exact count walks every
/// page of the range, which costs a noticeable share of a warm load of a large file); `None`
/// where the kernel does not tell.
fn residency_of(path: &Path, range: Range<u64>) -> Option<f64> {
    cache::residency_estimate(path, range)
        .ok()
        .map(|r| r.fraction())
}

/// Picks a strategy for a file of `file_len` bytes, `residency` of it cached.
pub(crate) fn choose(path: &Path, file_len: u64, residency: Option<f64>) -> (Route, String) {
    let resident = residency.unwrap_or(0.0);
    if resident >= 0.9 {
        return (
            Route::Staged,
            format!(
                "{:.0}% of the file is in the page cache: copies out of the cache into pinned staging on every core, overlapped with the uploads",
                resident * 100.0
            ),
        );
    }
    let available = gpufeed_os::sys::mem_available().unwrap_or(u64::MAX);
    // Probing sets up a ring: once per process is enough (the answer does not change).
    static URING: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let uring = *URING.get_or_init(|| Backend::probe().io_uring.is_ok());
    let dio = std::fs::File::open(path)
        .ok()
        .and_then(|f| gpufeed_os::align::dio_alignment(&f).ok())
        .is_some_and(|d| d.supported());
    if resident < 0.1 || file_len > available / 2 {
        if dio {
            return (
                Route::Direct,
                format!(
                    "{:.0}% cached{}: O_DIRECT reads{} into pinned staging, no page-cache copy",
                    resident * 100.0,
                    if file_len > available / 2 {
                        ", larger than half the available memory"
                    } else {
                        ""
                    },
                    if uring {
                        " through io_uring"
                    } else {
                        " (thread pool: io_uring unavailable)"
                    }
                ),
            );
        }
        return (
            Route::Staged,
            format!(
                "{:.0}% cached, and the file system refuses O_DIRECT: buffered reads into pinned staging",
                resident * 100.0
            ),
        );
    }
    (
        Route::Staged,
        format!(
            "{:.0}% cached: buffered reads serve the cached part from memory and read the rest",
            resident * 100.0
        ),
    )
}

/// Checks that `len` bytes at `offset` fit a destination of `capacity` bytes.
pub(crate) fn fits(len: u64, offset: usize, capacity: usize) -> Result<()> {
    if (offset as u64)
        .checked_add(len)
        .is_none_or(|end| end > capacity as u64)
    {
        return Err(gpufeed_cuda::Error::OutOfBounds {
            len,
            offset: offset as u64,
            capacity: capacity as u64,
        }
        .into());
    }
    Ok(())
}

/// Checks that every span lies inside `path` (a regular file); returns the file's length and
/// the spans' bytes together.
fn check_spans(path: &Path, spans: &[Range<u64>]) -> Result<(u64, u64)> {
    let file_len = file_len(path)?;
    let mut total = 0u64;
    for s in spans {
        if s.start > s.end || s.end > file_len {
            return Err(gpufeed_os::Error::RangePastEof {
                path: path.into(),
                offset: s.start,
                len: s.end.saturating_sub(s.start),
                file_len,
            }
            .into());
        }
        total += s.end - s.start;
    }
    Ok((file_len, total))
}

/// [`Error::FileChangedDuringLoad`] when `path` is no longer the file `before` identified
/// (replaced, truncated, written since).
pub(crate) fn check_unchanged(path: &Path, before: &gpufeed_os::FileIdentity) -> Result<()> {
    let now = gpufeed_os::file::stat_regular(path)?;
    match before.difference(&now) {
        Some(what) => Err(Error::FileChangedDuringLoad {
            path: path.into(),
            what,
        }),
        None => Ok(()),
    }
}

pub(crate) fn file_len(path: &Path) -> Result<u64> {
    Ok(gpufeed_os::file::stat_regular(path)?.size)
}

/// Transfer settings for loads of at most `bytes`: where those are small, chunks no larger
/// than their pieces ([`TransferConfig::piece_bytes_for`]), so that the staging reserved is
/// about the size of the load (5 MiB for a 5 MiB file, not 20 buffers of 4 MiB).
fn sized_for(cfg: TransferConfig, bytes: Option<u64>) -> TransferConfig {
    match bytes {
        Some(b) => {
            let piece = cfg.piece_bytes_for(b);
            cfg.with_chunk_bytes(piece.min(cfg.chunk_bytes))
        }
        None => cfg,
    }
}

/// Whether loads with `strategy` go through pinned staging (all but `Registered`, which stages
/// only where registration is refused).
fn stages(strategy: Strategy) -> bool {
    strategy != Strategy::Registered
}

/// A file range as a fill source. Buffered (`Staged`): every fill thread `pread`s from one
/// descriptor opened once per load — a read of cached pages completes inside the call, so
/// io_uring adds nothing, and opening the file in a ring per thread cost each thread a few
/// system calls before its first byte. `O_DIRECT` (`Direct`): each fill thread reads with its
/// own io_uring reader (several reads in flight), taken from the loader's idle readers (or
/// built) with the file opened in it, and given back with the file closed by
/// [`FileSource::finish`].
struct FileSource<'a> {
    path: &'a Path,
    /// The file's ranges, back to back in the stream the scheduler uploads.
    spans: &'a [Range<u64>],
    /// Where each span ends in that stream.
    ends: Vec<u64>,
    /// The file, opened once, for buffered loads; `None`: O_DIRECT through readers.
    buffered: Option<std::fs::File>,
    queue_depth: usize,
    readers: &'a Readers,
    /// Readers with the file open, not in use by a fill thread right now.
    open: Mutex<Vec<OpenReader>>,
}

/// A reader with the load's file open in it.
struct OpenReader {
    reader: Reader,
    file: gpufeed_uring::FileId,
}

impl<'a> FileSource<'a> {
    fn new(
        path: &'a Path,
        spans: &'a [Range<u64>],
        buffered: Option<std::fs::File>,
        queue_depth: usize,
        readers: &'a Readers,
    ) -> Self {
        let ends = spans
            .iter()
            .scan(0u64, |end, s| {
                *end += s.end.saturating_sub(s.start);
                Some(*end)
            })
            .collect();
        FileSource {
            path,
            spans,
            ends,
            buffered,
            queue_depth,
            readers,
            open: Mutex::new(Vec::new()),
        }
    }

    /// Bytes of all spans together.
    fn len(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    /// An idle reader (or a new one) with the file opened in it.
    fn take(&self) -> Result<OpenReader> {
        // Readers serve the O_DIRECT loads only (buffered ones pread `buffered`).
        let mut reader = self.readers.take(Direct::On, self.queue_depth)?;
        match reader.open(self.path) {
            Ok(file) => Ok(OpenReader { reader, file }),
            Err(e) => {
                self.readers.give_back(Direct::On, reader);
                Err(e.into())
            }
        }
    }

    /// Closes the file in every reader, gives them back, and returns their fallbacks.
    fn finish(self) -> Vec<Fallback> {
        let mut fallbacks = Vec::new();
        for OpenReader { mut reader, file } in self.open.into_inner() {
            for f in &reader.stats().fallbacks {
                f.clone().push_once(&mut fallbacks);
            }
            // Cannot fail: `file` was opened by this reader and not closed.
            if reader.close(file).is_ok() {
                self.readers.give_back(Direct::On, reader);
            }
        }
        fallbacks
    }
}

impl FileSource<'_> {
    /// Reads `[offset, offset + dst.len())` of the stream: the spans it covers, one by one,
    /// each with `read(file offset, bytes)`.
    fn read_spans(
        &self,
        offset: u64,
        dst: &mut [u8],
        mut read: impl FnMut(u64, &mut [u8]) -> std::result::Result<(), SourceError>,
    ) -> std::result::Result<(), SourceError> {
        let (mut at, mut done) = (offset, 0usize);
        let mut i = self.ends.partition_point(|&end| end <= offset);
        while done < dst.len() {
            let (Some(span), Some(&end)) = (self.spans.get(i), self.ends.get(i)) else {
                return Err(SourceError::from("a fill past the end of the spans"));
            };
            let span_start = end - (span.end - span.start);
            let n = ((end - at) as usize).min(dst.len() - done);
            read(span.start + (at - span_start), &mut dst[done..done + n])?;
            done += n;
            at += n as u64;
            i += 1;
        }
        Ok(())
    }
}

impl FillSource for FileSource<'_> {
    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), SourceError> {
        if let Some(file) = &self.buffered {
            return self.read_spans(offset, dst, |at, buf| {
                pread_exact(file, self.path, at, buf).map_err(Into::into)
            });
        }
        let ready = self.open.lock().pop();
        let mut open = match ready {
            Some(r) => r,
            None => self.take()?,
        };
        let result = self.read_spans(offset, dst, |at, buf| {
            open.reader
                .read_exact_at(open.file, at, buf)
                .map_err(Into::into)
        });
        self.open.lock().push(open);
        result
    }
}

/// Reads all of `buf` from `file` (at `path`) at `offset` with `pread`, with the errors an
/// io_uring reader gives: [`gpufeed_uring::Error::UnexpectedEof`] where the file ends first,
/// [`gpufeed_uring::Error::Read`] for a failed read.
fn pread_exact(
    file: &std::fs::File,
    path: &Path,
    offset: u64,
    buf: &mut [u8],
) -> std::result::Result<(), gpufeed_uring::Error> {
    use std::os::unix::fs::FileExt;
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                return Err(gpufeed_uring::Error::UnexpectedEof {
                    path: path.into(),
                    offset,
                    got: done as u64,
                    want: buf.len() as u64,
                });
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(gpufeed_uring::Error::Read {
                    path: path.into(),
                    offset: offset + done as u64,
                    source,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A staged load whose file ends early reports the reader's typed error, not the
    /// scheduler's wrapper; other sources' errors keep the wrapper and their chain.
    #[test]
    fn a_fill_sources_read_error_is_typed_again() {
        let eof = gpufeed_uring::Error::UnexpectedEof {
            path: "f.bin".into(),
            offset: 4096,
            got: 10,
            want: 4096,
        };
        let wrapped = gpufeed_cuda::Error::Source {
            offset: 4096,
            source: Box::new(eof),
        };
        assert!(
            matches!(
                read_error(wrapped),
                Error::Read(gpufeed_uring::Error::UnexpectedEof { got: 10, .. })
            ),
            "the reader's error"
        );
        let facade = gpufeed_cuda::Error::Source {
            offset: 0,
            source: Box::new(Error::InvalidSetting("x".into())),
        };
        assert!(matches!(read_error(facade), Error::InvalidSetting(_)));
        let other = gpufeed_cuda::Error::Source {
            offset: 7,
            source: "a decoder failed".into(),
        };
        let e = read_error(other);
        assert!(
            matches!(
                &e,
                Error::Cuda(gpufeed_cuda::Error::Source { offset: 7, .. })
            ),
            "{e:?}"
        );
        // `Error::Cuda` is transparent: its source is the wrapper's, the decoder's error.
        let chain = std::error::Error::source(&e).map(ToString::to_string);
        assert_eq!(chain.as_deref(), Some("a decoder failed"));
    }
}
