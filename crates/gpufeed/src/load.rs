//! Files to GPU memory: `load_file` and its strategies.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use gpufeed_cuda::{FillSource, Gpu, HostSource, SourceError, TransferConfig, TransferScheduler};
use gpufeed_os::{FileMap, MapMode, cache};
use gpufeed_pinned::HostRegistration;
use gpufeed_uring::{Backend, Direct, Reader};
use parking_lot::Mutex;

use crate::error::{Error, Result};

/// GPU memory as gpufeed hands it out: a cudarc `CudaSlice<u8>`, so cudarc and candle users
/// take it as it is.
pub type DeviceBuffer = gpufeed_cuda::cudarc::driver::CudaSlice<u8>;

/// How a file reaches the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum Strategy {
    /// Decide from page-cache residency, file size against available memory and what the
    /// machine allows; the report says what was chosen and why.
    #[default]
    Auto,
    /// Map the file read-only, register the mapping with CUDA in chunks (on a few threads,
    /// ahead of the copies) and copy straight out of the page cache: no host copy at all. The
    /// fastest path for files in the page cache.
    Registered,
    /// Read the file (io_uring, buffered) into pinned staging buffers that the scheduler
    /// uploads, reads overlapped with copies. Safe for files that may change while loading.
    Staged,
    /// Like `Staged` with `O_DIRECT`: for files not in the page cache, or larger than it.
    Direct,
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
                return Err(Error::Config(format!(
                    "unknown strategy {other:?}; use auto, registered, staged or direct"
                )));
            }
        })
    }
}

/// Settings of a load.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The strategy (default `Auto`).
    pub strategy: Strategy,
    /// Streams, chunk size, staging buffers and fill (IO) threads of the transfer.
    pub transfer: TransferConfig,
    /// Bytes registered per `cuMemHostRegister` call of the `Registered` strategy (256 MiB).
    pub register_chunk_bytes: usize,
    /// Threads registering chunks ahead of the copies (2).
    pub register_threads: usize,
    /// Reads in flight per IO thread for `Staged`/`Direct` (8).
    pub queue_depth: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            strategy: Strategy::Auto,
            transfer: TransferConfig::default(),
            register_chunk_bytes: 256 << 20,
            register_threads: 2,
            queue_depth: 8,
        }
    }
}

impl LoadOptions {
    /// Options using a single IO thread (one filler, one registrar).
    pub fn one_thread() -> Self {
        LoadOptions {
            transfer: TransferConfig {
                fill_threads: 1,
                staging_buffers: 4,
                ..TransferConfig::default()
            },
            register_threads: 1,
            ..Self::default()
        }
    }
}

/// What a load did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LoadReport {
    /// The file.
    pub path: PathBuf,
    /// The strategy that ran.
    pub strategy: Strategy,
    /// Why that strategy.
    pub reason: String,
    /// Bytes loaded.
    pub bytes: u64,
    /// Wall seconds of the whole load (registration and reads included).
    pub seconds: f64,
    /// Share of the file in the page cache before the load.
    pub residency_before: Option<f64>,
    /// Slower paths taken, with reasons.
    pub fallbacks: Vec<String>,
    /// Seconds the copies waited for the source (reads or registration).
    pub copy_waited_s: f64,
    /// Seconds the source waited for free staging buffers.
    pub source_waited_s: f64,
    /// The IO backend of `Staged`/`Direct` loads.
    pub io_backend: Option<String>,
}

impl LoadReport {
    /// GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds / 1e9
        } else {
            0.0
        }
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
    gpu: Gpu,
    sched: TransferScheduler,
    opts: LoadOptions,
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
    Loader::new(gpu, opts)?.load_file(path)
}

impl Loader {
    /// A loader for `gpu`.
    pub fn new(gpu: &Gpu, opts: LoadOptions) -> Result<Self> {
        if opts.register_chunk_bytes < 1 << 20 {
            return Err(Error::Config("register_chunk_bytes below 1 MiB".into()));
        }
        Ok(Loader {
            gpu: gpu.clone(),
            sched: TransferScheduler::new(gpu, opts.transfer)?,
            opts,
        })
    }

    /// The GPU it loads to.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Loads all of `path` into new GPU memory.
    pub fn load_file(&self, path: impl AsRef<Path>) -> Result<(DeviceBuffer, LoadReport)> {
        let path = path.as_ref();
        let len = file_len(path)?;
        self.load_range(path, 0..len)
    }

    /// Loads bytes `range` of `path` into new GPU memory.
    pub fn load_range(
        &self,
        path: impl AsRef<Path>,
        range: Range<u64>,
    ) -> Result<(DeviceBuffer, LoadReport)> {
        let len = range.end.saturating_sub(range.start) as usize;
        let mut dst = if len == 0 {
            self.gpu.default_stream().null::<u8>().map_err(|e| {
                Error::Cuda(gpufeed_cuda::Error::Cuda {
                    op: "allocate an empty buffer",
                    result: format!("{:?}", e.0),
                })
            })?
        } else {
            // SAFETY: every byte is written by the load below before the buffer is returned;
            // on error the buffer is dropped unread.
            unsafe { self.gpu.alloc(len)? }
        };
        let report = self.load_into(path, range, &mut dst, 0)?;
        Ok((dst, report))
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
        let file_len = file_len(path)?;
        if range.start > range.end || range.end > file_len {
            return Err(gpufeed_os::Error::RangePastEof {
                path: path.into(),
                offset: range.start,
                len: range.end.saturating_sub(range.start),
                file_len,
            }
            .into());
        }
        let len = range.end - range.start;
        let residency = cache::residency(path).ok().map(|r| r.fraction());
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
        let (strategy, reason) = match self.opts.strategy {
            Strategy::Auto => choose(path, file_len, residency),
            s => (s, "asked for".to_owned()),
        };
        report.strategy = strategy;
        report.reason = reason;
        if strategy == Strategy::Registered {
            match self.registered(path, range.clone(), dst, dst_offset, &mut report) {
                Ok(()) => {
                    report.seconds = started.elapsed().as_secs_f64();
                    return Ok(report);
                }
                Err(Error::Pinned(e)) if !matches!(e, gpufeed_pinned::Error::NoCudaDriver) => {
                    let why = format!("registration refused ({e}); staged instead");
                    tracing::warn!(path = %path.display(), "{why}");
                    report.fallbacks.push(why);
                    report.strategy = Strategy::Staged;
                }
                Err(e) => return Err(e),
            }
        }
        let direct = report.strategy == Strategy::Direct;
        self.staged(path, range, dst, dst_offset, direct, &mut report)?;
        report.seconds = started.elapsed().as_secs_f64();
        Ok(report)
    }

    fn registered(
        &self,
        path: &Path,
        range: Range<u64>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
        report: &mut LoadReport,
    ) -> Result<()> {
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
        std::thread::scope(|scope| -> Result<()> {
            let (reg_tx, reg_rx) =
                mpsc::sync_channel::<(usize, gpufeed_pinned::Result<HostRegistration<'_>>)>(4);
            for _ in 0..self.opts.register_threads.max(1).min(pieces.len()) {
                let (tx, pieces, next_piece) = (reg_tx.clone(), &pieces, &next_piece);
                scope.spawn(move || {
                    loop {
                        let i = next_piece.fetch_add(1, Ordering::Relaxed);
                        let Some(&(off, n)) = pieces.get(i) else {
                            return;
                        };
                        // SAFETY: [base + off, +n) lies in `map`, which outlives this scope;
                        // the mapping is read-only and registered read-only.
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
            // Unregistering runs on its own thread, off the copy path.
            let (done_tx, done_rx) = mpsc::channel::<HostRegistration<'_>>();
            scope.spawn(move || done_rx.into_iter().for_each(drop));
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
                self.sched
                    .upload(HostSource::Registered(&reg), dst, dst_offset + pieces[i].0)?;
                let _ = done_tx.send(reg);
            }
            Ok(())
        })?;
        report.copy_waited_s = copy_waited;
        map.verify_unchanged()?;
        Ok(())
    }

    fn staged(
        &self,
        path: &Path,
        range: Range<u64>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
        direct: bool,
        report: &mut LoadReport,
    ) -> Result<()> {
        let source = FileSource {
            path: path.into(),
            start: range.start,
            direct: if direct { Direct::On } else { Direct::Off },
            queue_depth: self.opts.queue_depth,
            readers: Mutex::new(Vec::new()),
        };
        // Build one reader up front so that open errors surface as such.
        let first = source.reader()?;
        report.io_backend = Some(first.0.backend().to_string());
        source.readers.lock().push(first);
        let stats = self.sched.upload(
            HostSource::Fill {
                source: &source,
                len: range.end - range.start,
            },
            dst,
            dst_offset,
        )?;
        report.copy_waited_s = stats.copy_waited_s;
        report.source_waited_s = stats.source_waited_s;
        for r in source.readers.into_inner() {
            for f in
                r.0.stats()
                    .fallbacks
                    .iter()
                    .chain(r.0.stats().files.iter().filter_map(|f| f.reason.as_ref()))
            {
                if !report.fallbacks.contains(f) && (direct || !f.contains("Direct::Off")) {
                    report.fallbacks.push(f.clone());
                }
            }
        }
        Ok(())
    }
}

/// Picks a strategy for a file of `file_len` bytes, `residency` of it cached.
fn choose(path: &Path, file_len: u64, residency: Option<f64>) -> (Strategy, String) {
    let resident = residency.unwrap_or(0.0);
    if resident >= 0.9 {
        return (
            Strategy::Registered,
            format!(
                "{:.0}% of the file is in the page cache: register the cached pages and copy straight from them",
                resident * 100.0
            ),
        );
    }
    let available = gpufeed_os::SystemInfo::read()
        .mem_available
        .unwrap_or(u64::MAX);
    let uring = Backend::probe().io_uring.is_ok();
    let dio = std::fs::File::open(path)
        .ok()
        .and_then(|f| gpufeed_os::align::dio_alignment(&f).ok())
        .is_some_and(|d| d.supported());
    if resident < 0.1 || file_len > available / 2 {
        if dio {
            return (
                Strategy::Direct,
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
            Strategy::Staged,
            format!(
                "{:.0}% cached, and the file system refuses O_DIRECT: buffered reads into pinned staging",
                resident * 100.0
            ),
        );
    }
    (
        Strategy::Staged,
        format!(
            "{:.0}% cached: buffered reads serve the cached part from memory and read the rest",
            resident * 100.0
        ),
    )
}

fn file_len(path: &Path) -> Result<u64> {
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => gpufeed_os::Error::NotFound { path: path.into() },
        _ => gpufeed_os::Error::Io {
            op: "stat",
            path: Some(path.into()),
            source: e,
        },
    })?;
    if meta.is_dir() {
        return Err(gpufeed_os::Error::IsDirectory { path: path.into() }.into());
    }
    if !meta.is_file() {
        return Err(gpufeed_os::Error::NotRegularFile { path: path.into() }.into());
    }
    Ok(meta.len())
}

/// A file range as a fill source: each fill thread reads with its own io_uring reader.
struct FileSource {
    path: PathBuf,
    start: u64,
    direct: Direct,
    queue_depth: usize,
    readers: Mutex<Vec<(Reader, gpufeed_uring::FileId)>>,
}

impl FileSource {
    fn reader(&self) -> Result<(Reader, gpufeed_uring::FileId)> {
        let mut reader = Reader::builder()
            .direct(self.direct)
            .queue_depth(self.queue_depth)
            .block_bytes(1 << 20)
            .build()?;
        let file = reader.open(&self.path)?;
        Ok((reader, file))
    }
}

impl FillSource for FileSource {
    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), SourceError> {
        let pooled = self.readers.lock().pop();
        let (mut reader, file) = match pooled {
            Some(r) => r,
            None => self.reader()?,
        };
        let result = reader.read_exact_at(file, self.start + offset, dst);
        self.readers.lock().push((reader, file));
        result.map_err(Into::into)
    }
}
