//! What a load is asked and what it reports: the strategies, [`LoadOptions`], [`LoadReport`],
//! [`OneShotReport`].

use std::fmt;
use std::path::PathBuf;

use gpufeed_cuda::TransferOptions;
use gpufeed_os::Fallback;

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
    /// cuFile (GPUDirect Storage): reads from the file straight into the destination, on
    /// several threads. Peer-to-peer (storage -> GPU, no host memory) where the machine has
    /// nvidia-fs or PCI P2PDMA and the file system supports it; elsewhere cuFile's
    /// compatibility mode (POSIX reads into host memory, then a copy), which is slower than
    /// `Direct`. Where cuFile refuses the file, the load runs `Direct` (or `Staged`) and the
    /// report's fallbacks say why. `Auto` takes it only for files not in the page cache on
    /// a file system [`gpufeed_cuda::gds::detect`] finds peer-to-peer capable.
    /// [`LoadReport::io_backend`] names the path: the one cuFile's statistics say served the
    /// reads with [`LoadOptions::gds_path_counts`], else what cuFile's driver says.
    Gds,
}

/// The path a load ran: a [`Strategy`] with `Auto` resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    Registered,
    Staged,
    Direct,
    Gds,
}

impl Route {
    pub(crate) fn strategy(self) -> Strategy {
        match self {
            Route::Registered => Strategy::Registered,
            Route::Staged => Strategy::Staged,
            Route::Direct => Strategy::Direct,
            Route::Gds => Strategy::Gds,
        }
    }
}

/// The route of a load chosen once ([`crate::Loader::choose_route`]) for a file loaded in
/// several calls (rounds of a replicated load), so that every call takes it and none samples
/// the page cache again. It is of the file and loader it was chosen for: given for another
/// file, it is taken as it is (a `Direct` choice on a file system without `O_DIRECT` fails).
#[derive(Debug, Clone)]
pub struct RouteChoice {
    pub(crate) route: Route,
    pub(crate) reason: String,
    pub(crate) residency: Option<f64>,
}

impl RouteChoice {
    /// The strategy that will run (`Auto` resolved).
    pub fn strategy(&self) -> Strategy {
        self.route.strategy()
    }

    /// Why.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The share of the range in the page cache when it was chosen (`None`: not sampled).
    pub fn residency(&self) -> Option<f64> {
        self.residency
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Strategy::Auto => "auto",
            Strategy::Registered => "registered",
            Strategy::Staged => "staged",
            Strategy::Direct => "direct",
            Strategy::Gds => "gds",
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
            "gds" => Strategy::Gds,
            other => {
                return Err(Error::InvalidSetting(format!(
                    "unknown strategy {other:?}; use auto, registered, staged, direct or gds"
                )));
            }
        })
    }
}

/// Settings of a load. Start from [`LoadOptions::default`] (or [`LoadOptions::one_thread`])
/// and change what you need: the fields are public, and new ones may be added.
///
/// ```
/// use gpufeed_load::{LoadOptions, Strategy};
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
    pub transfer: TransferOptions,
    /// Bytes registered per `cuMemHostRegister` call by `Registered` (64 MiB: shorter driver
    /// calls disturb the concurrent copies less; a sweep on the H200 machine is in
    /// docs/benchmarks.md). At least 1 MiB.
    pub register_chunk_bytes: usize,
    /// Threads registering chunks ahead of the copies for `Registered` (2).
    pub register_threads: usize,
    /// Reads in flight per IO thread for `Direct` (8; `Staged` reads one piece per `pread`).
    /// File lists ([`Loader::load_files`](crate::Loader::load_files)) use at least 32.
    pub queue_depth: usize,
    /// Test hook, not API: registration fails as a driver refusing it would
    /// (`CUDA_ERROR_NOT_PERMITTED`, as under some container and WSL limits), to test the
    /// fallback to `Staged` on machines whose driver never refuses.
    #[doc(hidden)]
    pub testing_refuse_registration: bool,
    /// `Strategy::Gds`: count which path cuFile's statistics say served each load's reads
    /// (nvidia-fs, P2PDMA or its compatibility mode) into [`LoadReport::io_backend`] (false).
    /// Counting raises cuFile's statistics to level 3 for the rest of the process (runs that
    /// lowered it again after each load saw cuFile 1.15's IO threads crash in later loads; see
    /// `CuFile::count_paths`) and serializes
    /// counted loads in the process; `gpufeed doctor`'s probe and bench table 16 count.
    /// `Auto`'s `Gds` loads are counted until one confirms peer-to-peer reads on their file
    /// system.
    pub gds_path_counts: bool,
    /// `Strategy::Gds`: where cuFile reads into ([`GdsBuffers::Auto`]: the loader's registered
    /// buffers where cuFile's driver reads through nvidia-fs, else the destination).
    pub gds_buffers: GdsBuffers,
    /// Test hook, not API: a fault `Strategy::Gds` runs into, to test its fallbacks on
    /// machines where cuFile works.
    #[doc(hidden)]
    pub testing_gds_fault: Option<crate::gds::GdsFault>,
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
            transfer: TransferOptions::default()
                .with_streams(4)
                .with_chunk_bytes(4 << 20)
                .with_staging_buffers(2 * fill_threads)
                .with_fill_threads(fill_threads),
            register_chunk_bytes: 64 << 20,
            register_threads: 2,
            queue_depth: 8,
            testing_refuse_registration: false,
            gds_path_counts: false,
            gds_buffers: GdsBuffers::Auto,
            testing_gds_fault: None,
        }
    }
}

impl LoadOptions {
    /// Options using a single IO thread: `Registered`, one thread registering while the calling
    /// thread issues the copies (the cheapest warm path per CPU thread).
    pub fn one_thread() -> Self {
        LoadOptions {
            strategy: Strategy::Registered,
            transfer: TransferOptions::default()
                .with_fill_threads(1)
                .with_staging_buffers(4),
            register_threads: 1,
            ..Self::default()
        }
    }

    /// The options for loads from object storage (`Loader::load_object`, with the `object` feature, and the checkpoint
    /// loads of buckets): half the cores as fill threads (2 to 8), each staging pieces of 16
    /// MiB, which it fills with two ranged GETs of the default 8 MiB in flight, two buffers
    /// per thread (256 MiB of pinned staging on 16 cores). The network wants many large
    /// requests in flight; the page cache wants every core copying small pieces. On the H200
    /// machine (docs/benchmarks.md, GPU run 131; a local SeaweedFS server) an object loaded to
    /// the GPU at 5.83 GB/s with these, 0.98 of the same object read to the host, against
    /// 4.84 with [`LoadOptions::default`] (16 threads of 4 MiB pieces: one 4 MiB GET each).
    ///
    /// ```
    /// let opts = gpufeed_load::LoadOptions::for_objects();
    /// assert_eq!(opts.transfer.chunk_bytes, 16 << 20);
    /// assert_eq!(opts.transfer.staging_buffers, 2 * opts.transfer.fill_threads);
    /// ```
    pub fn for_objects() -> Self {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let threads = (cores / 2).clamp(2, 8);
        LoadOptions {
            transfer: TransferOptions::default()
                .with_streams(4)
                .with_chunk_bytes(16 << 20)
                .with_staging_buffers(2 * threads)
                .with_fill_threads(threads),
            ..Self::default()
        }
    }

    /// The options for one of `gpus` GPUs loading at once from this host
    /// (`gpufeed_multi::MultiLoader`): the host's cores shared out, `cores / gpus` fill threads per GPU (2 to
    /// 16), 2 MiB chunks and two staging buffers per thread, so that the staging in flight
    /// stays small. One GPU: [`LoadOptions::default`]. Measured on the two-GPU H200 machine
    /// (32 cores; docs/benchmarks.md, GPU runs 39-40): two GPUs sharded 95-96 GB/s in all with 16
    /// threads and 2 MiB chunks each, against 82.3 with 8 threads and 4 MiB chunks and 68.6
    /// with 16 threads and 4 MiB chunks (the single-GPU default on each).
    ///
    /// ```
    /// let opts = gpufeed_load::LoadOptions::for_gpus(2);
    /// assert_eq!(opts.transfer.chunk_bytes, 2 << 20);
    /// ```
    pub fn for_gpus(gpus: usize) -> Self {
        if gpus <= 1 {
            return Self::default();
        }
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let threads = (cores / gpus).clamp(2, 16);
        LoadOptions {
            transfer: TransferOptions::default()
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

    /// These options with `gds_buffers` ([`LoadOptions::gds_buffers`]).
    pub fn with_gds_buffers(mut self, gds_buffers: GdsBuffers) -> Self {
        self.gds_buffers = gds_buffers;
        self
    }

    /// These options with `transfer`.
    pub fn with_transfer(mut self, transfer: TransferOptions) -> Self {
        self.transfer = transfer;
        self
    }
}

/// Where `Strategy::Gds`'s cuFile reads land ([`LoadOptions::gds_buffers`]).
///
/// cuFile reads peer-to-peer (nvidia-fs) only into device memory registered with it
/// (`cuFileBufRegister`); into other memory it reads through bounce buffers of its own
/// (`cufile.json`'s `per_buffer_cache_size`, 1 MiB by default, out of `max_device_cache_size`)
/// and copies. Registering a destination per load costs a registration per load and pins
/// GPU BAR1 space for as long as the destination lives; a loader instead keeps a few device
/// buffers of [`GDS_PIECE_BYTES`](crate::gds::GDS_PIECE_BYTES), registered once when first
/// needed and bounded (two per read thread, at most half of cufile.json's
/// `max_device_pin_mem_size`; [`Loader::gds_registered_bytes`](crate::Loader::gds_registered_bytes)),
/// reads whole pieces into them and copies each piece into the destination on the GPU. Only
/// where cuFile's driver reads through nvidia-fs: in its compatibility mode cuFile reads into
/// host memory and copies either way (a registered buffer adds a device copy).
///
/// ```
/// use gpufeed_load::{GdsBuffers, LoadOptions, Strategy};
/// let mut opts = LoadOptions::default().with_strategy(Strategy::Gds);
/// opts.gds_buffers = GdsBuffers::Registered;
/// assert_eq!(GdsBuffers::default(), GdsBuffers::Auto);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum GdsBuffers {
    /// `Registered` where cuFile's driver reads through nvidia-fs
    /// ([`DriverProperties::nvidia_fs`](gpufeed_cuda::cufile::DriverProperties::nvidia_fs)),
    /// `Destination` elsewhere.
    #[default]
    Auto,
    /// The loader's registered buffers, then a device copy into the destination, where the
    /// driver reads through nvidia-fs; elsewhere the destination, with a `Refused::Gds`
    /// fallback saying why. Where cuFile refuses a registration (the BAR1 budget), the
    /// threads without a buffer read into the destination, and the report's fallbacks say
    /// why.
    Registered,
    /// Straight into the destination, not registered (cuFile's own bounce buffers).
    Destination,
}

impl fmt::Display for GdsBuffers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GdsBuffers::Auto => "auto",
            GdsBuffers::Registered => "registered",
            GdsBuffers::Destination => "destination",
        })
    }
}

impl std::str::FromStr for GdsBuffers {
    type Err = Error;
    /// `auto`, `registered` or `destination` (as `Display` writes them).
    ///
    /// ```
    /// use gpufeed_load::GdsBuffers;
    /// assert_eq!("registered".parse::<GdsBuffers>()?, GdsBuffers::Registered);
    /// assert_eq!(GdsBuffers::Destination.to_string(), "destination");
    /// assert!("bounce".parse::<GdsBuffers>().is_err());
    /// # Ok::<(), gpufeed_load::Error>(())
    /// ```
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => GdsBuffers::Auto,
            "registered" => GdsBuffers::Registered,
            "destination" => GdsBuffers::Destination,
            other => {
                return Err(Error::InvalidSetting(format!(
                    "unknown GDS buffers {other:?}; use auto, registered or destination"
                )));
            }
        })
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
    /// backend for `Direct` ones, `"cufile <version>: <path>"` for `Gds` ones (the path
    /// cuFile's statistics say served the reads: `nvidia-fs`, `p2pdma`, `compat (POSIX)`);
    /// `None` for `Registered`.
    pub io_backend: Option<String>,
    /// Why cuFile did not load the file, where `Strategy::Gds` was asked for (or chosen) and
    /// gpufeed's own path ran instead (its words are in `fallbacks`).
    pub gds_refused: Option<crate::gds::GdsRefusal>,
    /// `Strategy::Gds` loads: bytes of the loader's registered device buffers cuFile read
    /// into ([`GdsBuffers`]); 0 where it read straight into the destination.
    pub gds_registered_bytes: u64,
}

impl LoadReport {
    /// The report of a load of `bytes` of `path` before it runs: `strategy` asked for,
    /// `residency` sampled, nothing else known yet.
    pub(crate) fn before(
        path: std::path::PathBuf,
        strategy: Strategy,
        bytes: u64,
        residency: Option<f64>,
    ) -> Self {
        LoadReport {
            path,
            strategy,
            reason: String::new(),
            bytes,
            seconds: 0.0,
            residency_before: residency,
            fallbacks: Vec::new(),
            copy_waited_s: 0.0,
            source_waited_s: 0.0,
            io_backend: None,
            gds_refused: None,
            gds_registered_bytes: 0,
        }
    }

    /// GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        gpufeed_os::gbps(self.bytes, self.seconds)
    }
}

/// What a one-shot load ([`load_file_on`](crate::load_file_on), `gpufeed_safetensors::load_on`) spent its time on.
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
    /// Pinned staging used (bounded: [`TransferOptions::staging_bytes_for`] of the largest
    /// file), registered for the call only.
    pub staging_bytes: u64,
    /// One report per file loaded.
    pub loads: Vec<LoadReport>,
    /// Slower paths taken while setting up ([`LoaderSetup::fallbacks`](crate::LoaderSetup::fallbacks)).
    pub fallbacks: Vec<Fallback>,
    /// What else went otherwise than usual while setting up ([`LoaderSetup::notes`](crate::LoaderSetup::notes)).
    pub notes: Vec<String>,
}

impl OneShotReport {
    /// GB/s from the call to the end (context included).
    pub fn gbps(&self) -> f64 {
        gpufeed_os::gbps(self.bytes, self.total_seconds)
    }
}
