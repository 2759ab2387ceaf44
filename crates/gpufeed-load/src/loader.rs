//! The [`Loader`]: files to GPU memory through pinned staging, `load_file` and the one-shot
//! loads.

use std::fmt;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use gpufeed_cuda::cudarc::driver::{CudaSlice, DevicePtrMut, DeviceSlice};
use gpufeed_cuda::{
    DeviceAlloc, FillSource, Gpu, HostSource, SliceSource, TransferScheduler, TransferStats,
};
use gpufeed_os::OpenedFile;
use gpufeed_os::{Fallback, Refused};
use gpufeed_pinned::HostSlab;
use gpufeed_uring::{Direct, Reader};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::options::{
    DeviceBuffer, LoadOptions, LoadReport, OneShotReport, Route, RouteChoice, Strategy,
};
use crate::route::{
    check_spans, check_unchanged, choose, fits, hull_of, read_error, residency_of, sized_for,
    stages,
};
use crate::source::FileSource;

/// Loads files into GPU memory, keeping its streams and pinned staging buffers between loads
/// (allocating pinned memory is expensive: keep one `Loader` for repeated loads).
///
/// # Example
/// ```no_run
/// use gpufeed_load::{Gpu, LoadOptions, Loader};
/// let gpu = Gpu::open(0)?;
/// let loader = Loader::new(&gpu, LoadOptions::default())?;
/// let (weights, report) = loader.load_file("model.bin")?;
/// println!("{} bytes by {} ({}) at {:.1} GB/s", weights.len(), report.strategy, report.reason, report.gbps());
/// # Ok::<(), gpufeed_load::Error>(())
/// ```
pub struct Loader {
    pub(crate) gpu: Gpu,
    pub(crate) sched: TransferScheduler,
    pub(crate) opts: LoadOptions,
    pub(crate) cleanup: Mutex<Cleanup>,
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
    /// Device buffers registered with cuFile for `Strategy::Gds` loads (made when first
    /// needed, kept until the loader goes).
    pub(crate) gds_pool: crate::gds::GdsPool,
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

/// Threads at most that fault a loader's staging in once its GPU's context is there
/// ([`HostSlab::new_widening`]).
const FAULT_THREADS: usize = 8;

/// `Auto` samples the page-cache residency of loads from this size to choose between `Staged`
/// and `Direct`; smaller loads are staged without looking: buffered reads serve what is cached
/// from memory, and for what is not, `O_DIRECT` would save one copy of a few MiB against a
/// disk read many times longer.
pub(crate) const SAMPLE_FROM: u64 = 8 << 20;

/// Background unregistrations of earlier registered loads.
#[derive(Default)]
pub(crate) struct Cleanup {
    pub(crate) running: Vec<std::thread::JoinHandle<()>>,
    /// Finished since the last `wait_for_cleanup`.
    pub(crate) finished: usize,
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
    let started = Instant::now();
    let file = OpenedFile::open(path)?;
    let len = file.len();
    Loader::for_bytes(gpu, opts, len)?.load_new(&file, std::slice::from_ref(&(0..len)), started)
}

/// Runs a one-shot: opens GPU `ordinal` while `host` prepares (returning what it found and the
/// bytes of the largest single load), then `load` with the ready loader; the loader and its
/// pinned staging are released before this returns (used by the checkpoint crate's one-shot).
pub fn one_shot<P, T, E: From<Error>>(
    ordinal: usize,
    host: impl FnOnce() -> std::result::Result<(P, u64), E>,
    load: impl FnOnce(&Loader, P) -> std::result::Result<(T, Vec<LoadReport>), E>,
) -> std::result::Result<(Gpu, T, OneShotReport), E> {
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
/// [`TransferOptions::staging_bytes_for`](gpufeed_cuda::TransferOptions::staging_bytes_for) the file, 128 MiB at most with the default options on
/// 16 cores), which is unregistered and freed before this returns. For a process that loads
/// once at start-up; keep a [`Loader`] for more.
///
/// # Errors
/// The file's errors (missing, a directory, unreadable) before the GPU's (no driver, no such
/// device), then [`Loader::load_file`]'s.
///
/// # Example
/// ```no_run
/// let (gpu, weights, report) = gpufeed_load::load_file_on(0, "model.bin")?;
/// println!(
///     "{} bytes on {}: context {:.0} ms, load {:.0} ms",
///     weights.len(), gpu.info().name, report.context_seconds * 1e3, report.load_seconds * 1e3
/// );
/// # Ok::<(), gpufeed_load::Error>(())
/// ```
pub fn load_file_on(
    ordinal: usize,
    path: impl AsRef<Path>,
) -> Result<(Gpu, DeviceBuffer, OneShotReport)> {
    one_shot(
        ordinal,
        || {
            let file = OpenedFile::open(path)?;
            let len = file.len();
            Ok((file, len))
        },
        |loader, file| {
            let (buf, report) =
                loader.load_spans_of(&file, std::slice::from_ref(&(0..file.len())))?;
            Ok((buf, vec![report]))
        },
    )
}

impl Loader {
    /// A loader for `gpu`, with its pinned staging reserved now, from one slab registered
    /// with one call (at most [`TransferOptions::staging_bytes_for`](gpufeed_cuda::TransferOptions::staging_bytes_for): 128 MiB with the default
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
    pub fn for_bytes(gpu: &Gpu, opts: LoadOptions, bytes: u64) -> Result<Self> {
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
            tracing::debug!(
                fault_ms = made_s * 1e3,
                reserve_ms = t.elapsed().as_secs_f64() * 1e3,
                "staging reserved"
            );
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
            gds_pool: crate::gds::GdsPool::default(),
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
    /// let loader = gpufeed_load::Loader::open(0, gpufeed_load::LoadOptions::default())?;
    /// let setup = loader.setup();
    /// println!("context {:.0} ms, ready after {:.0} ms", setup.context_seconds.unwrap_or(0.0) * 1e3, setup.total_seconds * 1e3);
    /// let (weights, report) = loader.load_file("model.bin")?;
    /// # Ok::<(), gpufeed_load::Error>(())
    /// ```
    pub fn open(ordinal: usize, opts: LoadOptions) -> Result<Self> {
        Self::open_with(ordinal, opts, || Ok::<_, Error>(((), None))).map(|(l, ())| l)
    }

    /// [`Loader::open`] that also runs `host` on this thread while the context is created;
    /// `host` says how many bytes the loads will move at most (to size the staging), and its
    /// error, if any, is returned first (a missing file before a missing GPU).
    pub(crate) fn open_with<T, E: From<Error>>(
        ordinal: usize,
        opts: LoadOptions,
        host: impl FnOnce() -> std::result::Result<(T, Option<u64>), E>,
    ) -> std::result::Result<(Self, T), E> {
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
                        let threads = std::thread::available_parallelism()
                            .map_or(1, |n| n.get())
                            .min(FAULT_THREADS);
                        HostSlab::new_widening(len, threads, || opener.is_finished())
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
        let (gpu, context_s) = opened?.map_err(Error::from)?;
        let mut loader = Self::with_staging(&gpu, opts, bytes, slab, started)?;
        loader.setup.context_seconds = Some(context_s);
        loader.setup.notes.splice(0..0, notes);
        loader.setup.fallbacks.splice(0..0, fallbacks);
        tracing::debug!(
            ordinal,
            context_ms = context_s * 1e3,
            staging_ms = loader.setup.staging_seconds * 1e3,
            staging_mib = loader.setup.staging_bytes >> 20,
            total_ms = loader.setup.total_seconds * 1e3,
            "loader opened"
        );
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
    ///
    /// # Errors
    /// [`Loader::load_into`]'s.
    pub fn load_file(&self, path: impl AsRef<Path>) -> Result<(DeviceBuffer, LoadReport)> {
        let started = Instant::now();
        let file = OpenedFile::open(path)?;
        self.load_new(&file, std::slice::from_ref(&(0..file.len())), started)
    }

    /// Loads bytes `range` of `path` into new GPU memory.
    ///
    /// # Errors
    /// [`Loader::load_into`]'s.
    pub fn load_range(
        &self,
        path: impl AsRef<Path>,
        range: Range<u64>,
    ) -> Result<(DeviceBuffer, LoadReport)> {
        let started = Instant::now();
        let file = OpenedFile::open(path)?;
        self.load_new(&file, std::slice::from_ref(&range), started)
    }

    /// `spans` of `file` into new device memory.
    fn load_new(
        &self,
        file: &OpenedFile,
        spans: &[Range<u64>],
        started: Instant,
    ) -> Result<(DeviceBuffer, LoadReport)> {
        let len = check_spans(file, spans)? as usize;
        self.gpu.alloc_filled(len, self.device_alloc(len), |dst| {
            self.load_checked(file, spans, dst, None, started)
        })
    }

    /// Where a load of `len` bytes takes its device memory from. A loader's first load (the
    /// only one, for most users) takes it from cuMemAlloc: growing the context's pool would
    /// cost it 2-3 ms per GiB up front (docs/benchmarks.md, GPU run 8). Later loads use the
    /// pool, which gives back what earlier loads' buffers freed at no cost.
    ///
    /// It consumes the loader's first-load state: call it only for a load it then does (the
    /// capability crates' own loads), not to ask.
    #[doc(hidden)]
    pub fn device_alloc(&self, len: usize) -> DeviceAlloc {
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
    /// destination too small, read and CUDA errors; [`Error::FileChangedDuringLoad`] where the
    /// file opened was written, truncated, extended or lost its name (renamed over, removed)
    /// before the copies ended — on every route, and also for a file that only grows past the
    /// range loaded (its size, mtime and ctime change: what was loaded may mix versions).
    pub fn load_into(
        &self,
        path: impl AsRef<Path>,
        range: Range<u64>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
    ) -> Result<LoadReport> {
        let started = Instant::now();
        let file = OpenedFile::open(path)?;
        let spans = std::slice::from_ref(&range);
        let len = check_spans(&file, spans)?;
        // Nothing to load needs no room (an empty load at any offset succeeds, as it did).
        let at = if len == 0 { 0 } else { dst_offset };
        fits(len, at, dst.len())?;
        let mut view = dst.slice_mut(at..at + len as usize);
        self.load_checked(&file, spans, &mut view, None, started)
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
    /// let loader = gpufeed_load::Loader::open(0, gpufeed_load::LoadOptions::default())?;
    /// // The first and the third MiB of the file, 2 MiB on the GPU.
    /// let (buf, report) = loader.load_spans("data.bin", &[0..1 << 20, 2 << 20..3 << 20])?;
    /// assert_eq!(buf.len(), 2 << 20);
    /// # Ok::<(), gpufeed_load::Error>(())
    /// ```
    pub fn load_spans(
        &self,
        path: impl AsRef<Path>,
        spans: &[Range<u64>],
    ) -> Result<(DeviceBuffer, LoadReport)> {
        let started = Instant::now();
        let file = OpenedFile::open(path)?;
        self.load_new(&file, spans, started)
    }

    /// [`Loader::load_spans`] of a file opened once ([`OpenedFile`]: a caller that read its
    /// header, or loads it in several calls, through the same descriptor).
    ///
    /// # Errors
    /// [`Loader::load_spans`]'s.
    pub fn load_spans_of(
        &self,
        file: &OpenedFile,
        spans: &[Range<u64>],
    ) -> Result<(DeviceBuffer, LoadReport)> {
        self.load_new(file, spans, Instant::now())
    }

    /// The route `Strategy::Auto` (or the loader's strategy) takes for bytes `hull` of `file`
    /// now, to pass to several [`Loader::load_spans_to`] calls of one load (a load in rounds),
    /// so that all of them take one route, sampled once.
    pub fn choose_route(&self, file: &OpenedFile, hull: Range<u64>) -> RouteChoice {
        let len = hull.end.saturating_sub(hull.start);
        self.route_of(file, hull, len, 1)
    }

    /// The route for `len` bytes in `spans` spans within `hull` of `file`, sampled now.
    fn route_of(&self, file: &OpenedFile, hull: Range<u64>, len: u64, spans: usize) -> RouteChoice {
        let residency = if self.opts.strategy == Strategy::Auto && len < SAMPLE_FROM {
            None
        } else {
            residency_of(file, hull)
        };
        let (route, reason) = self.route_for(file, len, spans, residency);
        RouteChoice {
            route,
            reason,
            residency,
        }
    }

    /// [`Loader::load_spans_of`] into `dst`, a device buffer or view exactly as long as the
    /// spans together (checked), by the route `choice` where one is given (else chosen here).
    ///
    /// # Errors
    /// [`Loader::load_spans`]'s, and [`gpufeed_cuda::Error::OutOfBounds`] where `dst` is not
    /// as long as the spans.
    pub fn load_spans_to<D>(
        &self,
        file: &OpenedFile,
        spans: &[Range<u64>],
        dst: &mut D,
        choice: Option<&RouteChoice>,
    ) -> Result<LoadReport>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        let started = Instant::now();
        crate::route::exactly(check_spans(file, spans)?, dst.len())?;
        self.load_checked(file, spans, dst, choice, started)
    }

    /// One round of a load in rounds: bytes `span` of `file` into `dst` (exactly as long), by
    /// the route chosen once for the whole load ([`Loader::choose_route`]).
    ///
    /// # Errors
    /// [`Loader::load_spans_to`]'s.
    pub fn load_round<D>(
        &self,
        file: &OpenedFile,
        span: Range<u64>,
        dst: &mut D,
        choice: &RouteChoice,
    ) -> Result<LoadReport>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        self.load_spans_to(file, std::slice::from_ref(&span), dst, Some(choice))
    }

    /// Loads `spans` (checked against the file's length) of `file` into `dst`, exactly as
    /// long, by the route `choice` (else chosen now); checks on the descriptor afterwards that
    /// the file was not written meanwhile.
    fn load_checked<D>(
        &self,
        file: &OpenedFile,
        spans: &[Range<u64>],
        dst: &mut D,
        choice: Option<&RouteChoice>,
        started: Instant,
    ) -> Result<LoadReport>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        let len = dst.len() as u64;
        let chosen;
        let choice = match choice {
            Some(c) => c,
            None => {
                chosen = self.route_of(file, hull_of(spans), len, spans.len());
                &chosen
            }
        };
        let mut report = self.new_report(file, len, choice);
        if len == 0 {
            report.reason = "nothing to load".into();
            return Ok(report);
        }
        // A route chosen for one span cannot map several (registration maps one range).
        let (route, reason) = if choice.route == Route::Registered && spans.len() > 1 {
            self.route_for(file, len, spans.len(), choice.residency)
        } else {
            (choice.route, choice.reason.clone())
        };
        report.reason = reason;
        let ran = match route {
            Route::Registered => {
                self.registered_or_staged(file, spans[0].clone(), dst, &mut report)?
            }
            Route::Staged | Route::Direct => {
                self.staged(file, spans, dst, route == Route::Direct, &mut report)?;
                route
            }
            Route::Gds => self.gds_or_own(
                file,
                spans,
                dst,
                &mut report,
                self.opts.strategy == Strategy::Auto,
            )?,
        };
        self.finished(file, report, ran, started)
    }

    /// A load's end: the file checked on its descriptor (not written meanwhile), the route
    /// that ran, the scheduler's fallbacks and the time.
    fn finished(
        &self,
        file: &OpenedFile,
        mut report: LoadReport,
        ran: Route,
        started: Instant,
    ) -> Result<LoadReport> {
        check_unchanged(file)?;
        report.strategy = ran.strategy();
        for f in self.sched.fallbacks() {
            f.push_once(&mut report.fallbacks);
        }
        report.seconds = started.elapsed().as_secs_f64();
        Ok(report)
    }

    /// A load's report before it runs: `len` bytes of `file` by `choice`.
    fn new_report(&self, file: &OpenedFile, len: u64, choice: &RouteChoice) -> LoadReport {
        LoadReport::before(
            file.path().into(),
            self.opts.strategy,
            len,
            choice.residency,
        )
    }

    /// Loads `spans[k]` of `file` into `parts[k]`, each part exactly as long as its spans
    /// together, for every k, in one staged upload
    /// ([`gpufeed_cuda::TransferScheduler::upload_parts`]): its pieces run on from one part
    /// into the next, so that the parts pay one start and one end of a transfer between them,
    /// not one each, and `landed(k)` is called (on a fill thread, once per part; empty parts
    /// first) as soon as part k's bytes are on the GPU, so that a caller hands part k out
    /// while the later ones load; its answer `false` stops the load
    /// (`gpufeed_cuda::Error::Stopped`). The route is `choice`'s (else chosen here) where it
    /// stages (`Staged`, `Direct`), else `Staged`. Like every load, it compares the file with
    /// its descriptor's identity at the end; a caller that hands a part out before then checks
    /// that itself when the part landed (`gpufeed_os::OpenedFile::changed`).
    ///
    /// # Safety
    /// As [`gpufeed_cuda::TransferScheduler::upload_parts`]: distinct allocations, no GPU work
    /// still using them, nothing reading or writing part k before `landed(k)`.
    ///
    /// # Errors
    /// [`Loader::load_spans_to`]'s, `gpufeed_cuda::Error::Stopped`; parts not reported landed
    /// hold what a failed load left.
    ///
    /// # Example
    /// ```no_run
    /// let loader = gpufeed_load::Loader::open(0, Default::default())?;
    /// let file = gpufeed_os::OpenedFile::open("model.bin")?;
    /// let gpu = loader.gpu();
    /// // SAFETY: written by the load before anything reads them.
    /// let parts = unsafe { [gpu.alloc_unpooled(1 << 20)?, gpu.alloc_unpooled(4096)?] };
    /// let spans: [&[std::ops::Range<u64>]; 2] = [&[0..1 << 20], &[(1 << 20)..(1 << 20) + 4096]];
    /// let landed = |k: usize| {
    ///     println!("part {k} is on the GPU");
    ///     true // go on
    /// };
    /// // SAFETY: two new allocations, not read or written while they load.
    /// unsafe { loader.load_parts_to(&file, &spans, &[&parts[0], &parts[1]], None, &landed) }?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[allow(unsafe_code, reason = "passes upload_parts' promise on to the caller")]
    pub unsafe fn load_parts_to(
        &self,
        file: &OpenedFile,
        spans: &[&[Range<u64>]],
        parts: &[&CudaSlice<u8>],
        choice: Option<&RouteChoice>,
        landed: &(dyn Fn(usize) -> bool + Sync),
    ) -> Result<LoadReport> {
        let started = Instant::now();
        if spans.len() != parts.len() {
            return Err(Error::InvalidSetting(format!(
                "{} parts for {} lists of spans: give one list per part",
                parts.len(),
                spans.len()
            )));
        }
        for (s, p) in spans.iter().zip(parts) {
            crate::route::exactly(check_spans(file, s)?, p.len())?;
        }
        let all: Vec<Range<u64>> = spans.iter().flat_map(|s| s.iter().cloned()).collect();
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let chosen;
        let choice = match choice {
            Some(c) => c,
            None => {
                chosen = self.route_of(file, hull_of(&all), len, all.len());
                &chosen
            }
        };
        let mut report = self.new_report(file, len, choice);
        if len == 0 {
            // Nothing to read: the scheduler reports the (empty) parts.
            // SAFETY: the caller's promise (see Safety).
            unsafe { self.sched.upload_parts(&SliceSource(&[]), 0, parts, landed) }?;
            report.reason = "nothing to load".into();
            return Ok(report);
        }
        let route = match choice.route {
            Route::Staged | Route::Direct => {
                report.reason = choice.reason.clone();
                choice.route
            }
            other => {
                report.reason = format!(
                    "parts in one upload are staged (the route chosen was {})",
                    other.strategy()
                );
                Route::Staged
            }
        };
        self.staged_with(
            file,
            &all,
            route == Route::Direct,
            &mut report,
            |source, len| {
                // SAFETY: the caller's promise (see Safety).
                unsafe { self.sched.upload_parts(source, len, parts, landed) }
            },
        )?;
        self.finished(file, report, route, started)
    }

    /// The route for `len` bytes in `spans` spans of `file`, `residency` of them cached, and why.
    fn route_for(
        &self,
        file: &OpenedFile,
        len: u64,
        spans: usize,
        residency: Option<f64>,
    ) -> (Route, String) {
        match self.opts.strategy {
            Strategy::Auto if len < SAMPLE_FROM => (
                Route::Staged,
                format!(
                    "a small load (under {} MiB): buffered reads into pinned staging, cached pages copied from memory and the rest read from the disk (residency not sampled: O_DIRECT would save little here)",
                    SAMPLE_FROM >> 20
                ),
            ),
            Strategy::Auto => choose(file, residency),
            Strategy::Registered if spans > 1 => (
                Route::Staged,
                "registration maps one range of a file; several spans are staged".to_owned(),
            ),
            Strategy::Registered => (Route::Registered, "asked for".to_owned()),
            Strategy::Staged => (Route::Staged, "asked for".to_owned()),
            Strategy::Direct => (Route::Direct, "asked for".to_owned()),
            Strategy::Gds => (Route::Gds, "asked for".to_owned()),
        }
    }

    pub(crate) fn staged<D>(
        &self,
        file: &OpenedFile,
        spans: &[Range<u64>],
        dst: &mut D,
        direct: bool,
        report: &mut LoadReport,
    ) -> Result<()>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        self.staged_with(file, spans, direct, report, |source, len| {
            self.sched.upload(HostSource::Fill { source, len }, dst, 0)
        })
    }

    /// A staged (or, `direct`, O_DIRECT) load of `spans` of `file`, whose bytes `upload`
    /// puts on the GPU from the file's fill source; the readers' fallbacks and the waits go
    /// into `report`.
    fn staged_with(
        &self,
        file: &OpenedFile,
        spans: &[Range<u64>],
        direct: bool,
        report: &mut LoadReport,
        upload: impl FnOnce(&dyn FillSource, u64) -> gpufeed_cuda::Result<TransferStats>,
    ) -> Result<()> {
        let source = FileSource::new(file, spans, direct, self.opts.queue_depth, &self.readers);
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
        let uploaded = first.and_then(|()| upload(&source, len).map_err(read_error));
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
