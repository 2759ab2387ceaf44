//! The transfer scheduler: chunked host<->device copies over several streams, with pinned
//! staging buffers filled by worker threads while earlier chunks are on the wire (uploads in
//! lanes, one stream per fill thread; downloads through a shared free list and drain
//! threads).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, sys};
use gpufeed_os::{Fallback, Refused};
use gpufeed_pinned::{HostRegistration, PinnedBuffer, PinnedPool, PoolOptions, PooledBuffer};
use parking_lot::{Condvar, Mutex};

use crate::crew::Crew;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::raw;

/// Errors a [`FillSource`] may return.
pub type SourceError = Box<dyn std::error::Error + Send + Sync>;

/// Something that writes bytes `[offset, offset + dst.len())` of a logical stream into a
/// staging buffer, on a worker thread: a slice (`SliceSource`), a file read (the io_uring
/// reader), a decoder.
pub trait FillSource: Sync {
    /// Fills all of `dst` with the source's bytes starting at `offset`.
    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), SourceError>;

    /// Where the source's byte 0 lies in what it reads, for a source read in aligned blocks
    /// (an object's ranged GETs, which its server serves fastest within one of its chunks or
    /// parts): a staged upload whose pieces are whole chunks
    /// ([`TransferOptions::chunk_bytes`]) then cuts them where `origin + offset` is a
    /// multiple of the chunk (one shorter piece after the ramp where needed), so each piece
    /// is filled from whole blocks. An upload of an object's range from byte 4,104 on fills
    /// 16 MiB pieces at the object's 16 MiB boundaries, not 4,104 bytes past each. `None`
    /// (the default): pieces are cut from the upload's own start, in whole 4 KiB pages, as
    /// sources that read with `O_DIRECT` need.
    fn origin(&self) -> Option<u64> {
        None
    }
}

/// A pageable slice as a [`FillSource`] (a `memcpy` per chunk, spread over the fill threads).
#[derive(Debug, Clone, Copy)]
pub struct SliceSource<'a>(pub &'a [u8]);

impl FillSource for SliceSource<'_> {
    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), SourceError> {
        let start = usize::try_from(offset)?;
        let src = self
            .0
            .get(start..start + dst.len())
            .ok_or("range outside the slice")?;
        dst.copy_from_slice(src);
        Ok(())
    }
}

/// Where an upload reads from.
#[non_exhaustive]
pub enum HostSource<'a> {
    /// Pinned memory: copied directly, chunk by chunk over the streams.
    Pinned(&'a PinnedBuffer),
    /// A pooled buffer (pinned in CUDA mode): copied directly.
    Pooled(&'a PooledBuffer),
    /// Registered memory (a file mapping in the page cache, a segment): copied directly.
    Registered(&'a HostRegistration<'a>),
    /// `len` bytes at `offset` inside registered memory (a batch slot of a registered
    /// shared-memory ring): copied directly.
    RegisteredRange {
        /// The registration.
        registration: &'a HostRegistration<'a>,
        /// Offset of the first byte in it.
        offset: usize,
        /// Bytes to copy.
        len: usize,
    },
    /// Ordinary memory: copied into pinned staging buffers by the fill threads first.
    Pageable(&'a [u8]),
    /// `len` bytes produced by a [`FillSource`] into staging buffers on the fill threads.
    Fill {
        /// The source.
        source: &'a dyn FillSource,
        /// Bytes to produce.
        len: u64,
    },
}

impl HostSource<'_> {
    /// Bytes it provides.
    pub fn len(&self) -> u64 {
        match self {
            HostSource::Pinned(b) => b.len() as u64,
            HostSource::Pooled(b) => b.len() as u64,
            HostSource::Registered(r) => r.len() as u64,
            HostSource::RegisteredRange { len, .. } => *len as u64,
            HostSource::Pageable(s) => s.len() as u64,
            HostSource::Fill { len, .. } => *len,
        }
    }

    /// Whether it provides no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a download writes to.
#[non_exhaustive]
pub enum HostDest<'a> {
    /// Pinned memory: copied directly.
    Pinned(&'a mut PinnedBuffer),
    /// Ordinary memory: through pinned staging buffers, copied out by the fill threads.
    Pageable(&'a mut [u8]),
    /// Bytes `[offset, offset + len)` of a pooled buffer (pinned in CUDA mode), `len` the
    /// source's length: copied directly; several downloads fill one buffer piece by piece.
    PooledAt {
        /// The buffer.
        buffer: &'a mut PooledBuffer,
        /// Where in it the bytes go.
        offset: usize,
    },
}

/// The smallest chunk of a direct copy (from pinned or registered memory): 16 MiB. On the
/// H200 machine a registered file copied in 16 MiB chunks ran at the wire from 16 MiB up
/// (53.3 GB/s against the wire's 54.1), in 4 MiB chunks at 50.9 (docs/benchmarks.md, GPU run
/// 74).
pub const DIRECT_CHUNK_BYTES: usize = 16 << 20;

/// Settings of a [`TransferScheduler`]: start from the default and change what you need (new
/// settings may be added).
///
/// ```
/// let cfg = gpufeed_cuda::TransferOptions::default().with_fill_threads(4).with_staging_buffers(8);
/// assert_eq!((cfg.fill_threads, cfg.staging_buffers), (4, 8));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransferOptions {
    /// Streams the chunks of direct copies and staged downloads are spread over (default 4);
    /// staged uploads use one stream per fill thread.
    pub streams: usize,
    /// Bytes per copy of a staged transfer, the largest of a staged upload's (default 16 MiB,
    /// where the pinned ceiling is reached): the size of its staging buffers. Direct copies
    /// (from pinned or registered memory, which need no staging) go in chunks of this size
    /// or [`DIRECT_CHUNK_BYTES`], whichever is larger.
    pub chunk_bytes: usize,
    /// The smallest copy of a staged upload (default 1 MiB): uploads too small to give every
    /// fill thread two chunks are cut into pieces down to this size, so that more threads
    /// share them, and every upload starts with pieces of this size that double each round up
    /// to a chunk, so that the link starts while the threads fill their first buffers. (On the
    /// H200 machine 1 MiB beat 64 and 256 KiB from 1 MiB to 256 MiB: docs/benchmarks.md, GPU
    /// run 24.)
    pub min_chunk_bytes: usize,
    /// Staging buffers in flight for pageable and fill transfers (default: twice the fill
    /// threads). Staged uploads give each fill thread `staging_buffers / fill_threads` of them
    /// (at least 2); staged downloads share them.
    pub staging_buffers: usize,
    /// The fewest bytes of a staged upload per lane (default 8 MiB): an upload smaller than
    /// `fill_threads` times this runs on fewer lanes (one per `lane_bytes`, at least four or
    /// all the fill threads where there are fewer), so that a few lanes keep the link busy
    /// instead of every thread copying at once and then waiting for the link. On the H200
    /// machine 16 MiB loaded best on 4 threads (592 against 676 us on 16) and 64 MiB on 8
    /// (1.58 against 1.78 ms) in GPU run 51; in run 52 this setting against every lane gave
    /// 639-653 against 659 us at 16 MiB (docs/benchmarks.md).
    pub lane_bytes: usize,
    /// How long the kept fill threads stay awake after a staged upload, waiting for the next
    /// (default 100 us): spinning, then yielding the core between checks, then parked. An
    /// upload posted while they are awake starts on every thread within a microsecond; a
    /// parked thread takes 14-40 us to wake on the H200 machine, as long as a 1 MiB load
    /// takes in all. Zero parks them at once.
    pub idle_spin: Duration,
    /// Threads filling (or draining) staging buffers (default: half the cores, 2 to 8).
    pub fill_threads: usize,
}

impl TransferOptions {
    /// These settings with `streams` (streams of direct copies and staged downloads).
    pub fn with_streams(mut self, streams: usize) -> Self {
        self.streams = streams;
        self
    }

    /// These settings with `chunk_bytes` (bytes per copy).
    pub fn with_chunk_bytes(mut self, chunk_bytes: usize) -> Self {
        self.chunk_bytes = chunk_bytes;
        self
    }

    /// These settings with `min_chunk_bytes` (the smallest piece a small staged upload is cut
    /// into).
    pub fn with_min_chunk_bytes(mut self, min_chunk_bytes: usize) -> Self {
        self.min_chunk_bytes = min_chunk_bytes;
        self
    }

    /// These settings with `staging_buffers` (staging buffers in flight).
    pub fn with_staging_buffers(mut self, staging_buffers: usize) -> Self {
        self.staging_buffers = staging_buffers;
        self
    }

    /// These settings with `lane_bytes` (the fewest bytes of a staged upload per lane).
    pub fn with_lane_bytes(mut self, lane_bytes: usize) -> Self {
        self.lane_bytes = lane_bytes;
        self
    }

    /// These settings with `idle_spin` (how long the kept fill threads stay awake after an
    /// upload).
    pub fn with_idle_spin(mut self, idle_spin: Duration) -> Self {
        self.idle_spin = idle_spin;
        self
    }

    /// These settings with `fill_threads` (threads filling or draining staging).
    pub fn with_fill_threads(mut self, fill_threads: usize) -> Self {
        self.fill_threads = fill_threads;
        self
    }

    /// The settings a scheduler actually uses: at least one stream and fill thread, two
    /// staging buffers, chunks from 4 KiB to 256 MiB, pieces of small uploads from 4 KiB to a
    /// chunk, in whole 4 KiB pages (so that `O_DIRECT` reads of a piece stay aligned).
    pub fn normalized(self) -> Self {
        let chunk_bytes = self.chunk_bytes.clamp(4096, gpufeed_pinned::MAX_CLASS);
        TransferOptions {
            streams: self.streams.max(1),
            chunk_bytes,
            min_chunk_bytes: self
                .min_chunk_bytes
                .next_multiple_of(4096)
                .clamp(4096, chunk_bytes),
            staging_buffers: self.staging_buffers.max(2),
            lane_bytes: self.lane_bytes.max(1),
            idle_spin: self.idle_spin,
            fill_threads: self.fill_threads.max(1),
        }
    }

    /// The lanes (fill threads, each with its stream) a staged upload of `len` bytes runs on:
    /// one per [`TransferOptions::lane_bytes`], at least four (or every fill thread, where
    /// there are fewer), at most `fill_threads`.
    ///
    /// ```
    /// let cfg = gpufeed_cuda::TransferOptions::default().with_fill_threads(16);
    /// assert_eq!(cfg.lanes_for(16 << 20), 4);
    /// assert_eq!(cfg.lanes_for(64 << 20), 8);
    /// assert_eq!(cfg.lanes_for(1 << 30), 16);
    /// ```
    pub fn lanes_for(&self, len: u64) -> usize {
        let cfg = self.normalized();
        let wanted = usize::try_from(len.div_ceil(cfg.lane_bytes as u64)).unwrap_or(usize::MAX);
        wanted.clamp(cfg.fill_threads.min(4), cfg.fill_threads)
    }

    /// The largest copy of a staged upload of `len` bytes: `chunk_bytes`, or for an upload
    /// smaller than two chunks per lane ([`TransferOptions::lanes_for`]), an even share of two
    /// pieces per lane in whole 64 KiB (at least `min_chunk_bytes`). The first copies are
    /// smaller still: each lane starts with a `min_chunk_bytes` piece and doubles it every
    /// round up to this size, so that the link starts working while the lanes fill their
    /// first buffers.
    pub fn piece_bytes_for(&self, len: u64) -> usize {
        let cfg = self.normalized();
        let even = len
            .div_ceil(2 * cfg.lanes_for(len) as u64)
            .next_multiple_of(64 << 10);
        (even.min(cfg.chunk_bytes as u64) as usize).max(cfg.min_chunk_bytes)
    }

    /// Copies a staged upload of `len` bytes is cut into (see
    /// [`TransferOptions::piece_bytes_for`]), from a source without an origin
    /// ([`FillSource::origin`]; one with one may take one more).
    pub fn pieces_for(&self, len: u64) -> usize {
        PiecePlan::new(self, len).count
    }

    /// Staging buffers a staged upload of `len` bytes uses at most (`None`: of any length):
    /// `staging_buffers / fill_threads` (at least 2) per fill thread, and no more than the
    /// upload has pieces ([`TransferOptions::piece_bytes_for`]; from a source with an origin,
    /// which may add one).
    pub fn staging_buffers_for(&self, len: Option<u64>) -> usize {
        let cfg = self.normalized();
        let per_lane = (cfg.staging_buffers / cfg.fill_threads).max(2);
        let most = per_lane * cfg.fill_threads;
        match len {
            // Origin 1: the most pieces any origin gives.
            Some(len) => most.min(PiecePlan::new_at(&cfg, len, Some(1)).count),
            None => most,
        }
    }

    /// Bytes of [`TransferOptions::staging_buffers_for`] buffers of the chunk's size class:
    /// the bound on the pinned staging memory of a staged upload (128 MiB with the facade's
    /// defaults on 16 cores: 16 fill threads, 2 buffers each, 4 MiB chunks).
    pub fn staging_bytes_for(&self, len: Option<u64>) -> usize {
        let chunk = self
            .normalized()
            .chunk_bytes
            .next_power_of_two()
            .max(gpufeed_pinned::MIN_CLASS);
        self.staging_buffers_for(len) * chunk
    }
}

impl Default for TransferOptions {
    fn default() -> Self {
        let fill_threads =
            (std::thread::available_parallelism().map_or(4, |n| n.get()) / 2).clamp(2, 8);
        TransferOptions {
            streams: 4,
            chunk_bytes: 16 << 20,
            min_chunk_bytes: 1 << 20,
            staging_buffers: 2 * fill_threads,
            lane_bytes: 8 << 20,
            idle_spin: Duration::from_micros(100),
            fill_threads,
        }
    }
}

/// What a transfer did.
#[derive(Debug, Clone, PartialEq)]
pub struct TransferStats {
    /// `"pinned"`, `"registered"` or `"staged"`.
    pub path: &'static str,
    /// Bytes moved.
    pub bytes: u64,
    /// Wall seconds from the first copy enqueued to the last completed.
    pub seconds: f64,
    /// Copies issued.
    pub chunks: u64,
    /// Seconds the copies waited for the source. Staged uploads: the mean time a fill thread
    /// spent producing bytes (reading, copying); staged downloads: the time the copy side
    /// waited for a free staging buffer. 0 for direct copies.
    pub copy_waited_s: f64,
    /// Seconds the source waited for the link. Staged uploads: the mean time a fill thread
    /// waited for a staging buffer's previous copy to finish; staged downloads: the time the
    /// drain threads waited for copies. 0 for direct copies.
    pub source_waited_s: f64,
}

impl TransferStats {
    /// GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        gpufeed_os::gbps(self.bytes, self.seconds)
    }
}

/// Chunked, multi-stream copies between host and one GPU.
///
/// # Example
/// ```no_run
/// use gpufeed_cuda::{Gpu, HostSource, TransferOptions, TransferScheduler};
/// let gpu = Gpu::open(0)?;
/// let sched = TransferScheduler::new(&gpu, TransferOptions::default())?;
/// let data = vec![7u8; 100 << 20];
/// let mut dev = gpu.alloc_zeroed(data.len())?;
/// let stats = sched.upload(HostSource::Pageable(&data), &mut dev, 0)?;
/// println!("{:.1} GB/s", stats.gbps());
/// # Ok::<(), gpufeed_cuda::Error>(())
/// ```
pub struct TransferScheduler {
    gpu: Gpu,
    /// Streams of direct copies and staged downloads.
    streams: Vec<Arc<CudaStream>>,
    /// One stream per fill thread of staged uploads.
    lane_streams: Vec<Arc<CudaStream>>,
    pool: PinnedPool,
    cfg: TransferOptions,
    /// The GPU's node on a machine of several, where fill and drain threads run.
    placement: Option<(gpufeed_numa::Topology, u32)>,
    /// Idle crews of fill threads for staged uploads (`fill_threads - 1` each: the calling
    /// thread fills too), the first started by the first upload that needs one and kept
    /// (awake for `idle_spin` after each upload): starting threads per upload cost tens of
    /// microseconds each, and a scheduler that never stages (a batch loader's, a saver's)
    /// starts none. An upload takes a crew for its duration; threads uploading at once
    /// through one scheduler each get one (started when none is idle).
    crews: Mutex<Vec<Crew>>,
    /// The stream of the next [`TransferScheduler::upload_pooled_async`] (in turns).
    next_stream: AtomicUsize,
    fallbacks: Arc<Mutex<Vec<Fallback>>>,
}

impl std::fmt::Debug for TransferScheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferScheduler")
            .field("cfg", &self.cfg)
            .field("pool", &self.pool)
            .finish()
    }
}

/// A raw pointer that may cross threads: each user touches a disjoint range.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: see the type's docs; the scheduler hands each thread its own chunk.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// A crew taken by one upload; back among the idle ones when dropped.
struct CrewLease<'a> {
    crews: &'a Mutex<Vec<Crew>>,
    crew: Option<Crew>,
}

impl CrewLease<'_> {
    fn run(&mut self, jobs: usize, job: &(dyn Fn(usize) + Sync)) {
        if let Some(crew) = &mut self.crew {
            crew.run(jobs, job);
        }
    }
}

impl Drop for CrewLease<'_> {
    fn drop(&mut self) {
        if let Some(crew) = self.crew.take() {
            self.crews.lock().push(crew);
        }
    }
}

/// Where a staged upload's bytes land.
#[derive(Clone, Copy)]
enum Dest<'a> {
    /// One device range from this address.
    At(sys::CUdeviceptr),
    /// Parts of their own, back to back ([`TransferScheduler::upload_parts`]).
    Parts(&'a Parts<'a>),
}

/// The device buffers of [`TransferScheduler::upload_parts`], back to back in the source's
/// bytes, and what is left to land of each.
struct Parts<'a> {
    /// Where each part starts in the source's bytes, then where the last ends.
    starts: Vec<u64>,
    ptrs: Vec<sys::CUdeviceptr>,
    /// Bytes of each part whose copies are not known to be complete.
    left: Vec<AtomicU64>,
    landed: &'a (dyn Fn(usize) -> bool + Sync),
    /// Parts reported landed.
    reported: AtomicUsize,
    /// Set once a report answered `false`: the lanes take no further piece.
    stopped: AtomicBool,
}

impl Parts<'_> {
    /// `f(part, offset in the part, offset in the piece, bytes)` for each part that bytes
    /// `off..off + size` of the source fall in.
    fn each(&self, off: u64, size: usize, mut f: impl FnMut(usize, u64, usize, usize)) {
        let end = off + size as u64;
        // The last part starting at or before `off` (empty parts are skipped over).
        let mut k = self.starts.partition_point(|&s| s <= off).saturating_sub(1);
        while k + 1 < self.starts.len() && self.starts[k] < end {
            let (lo, hi) = (self.starts[k].max(off), self.starts[k + 1].min(end));
            if lo < hi {
                f(
                    k,
                    lo - self.starts[k],
                    (lo - off) as usize,
                    (hi - lo) as usize,
                );
            }
            k += 1;
        }
    }

    /// Notes that the copies of bytes `off..off + size` completed: a part whose bytes all
    /// did is reported landed (once: its count reaches zero once).
    fn completed(&self, off: u64, size: usize) {
        self.each(off, size, |k, _, _, n| {
            if self.left[k].fetch_sub(n as u64, Ordering::AcqRel) == n as u64 {
                self.report(k);
            }
        });
    }

    /// Reports part k landed; a `false` answer stops the upload.
    fn report(&self, k: usize) {
        self.reported.fetch_add(1, Ordering::AcqRel);
        if !(self.landed)(k) {
            self.stopped.store(true, Ordering::Release);
        }
    }
}

/// What the lanes of one staged upload share.
struct LaneWork<'a> {
    source: &'a dyn FillSource,
    dest: Dest<'a>,
    /// The upload's pieces.
    plan: PiecePlan,
    per_lane: usize,
    /// The next chunk to take.
    next: AtomicUsize,
    /// Set by a failing lane: the others stop taking chunks.
    abort: AtomicBool,
}

/// How a staged upload is cut into copies: a ramp of rounds (one piece per lane each)
/// from `min_chunk_bytes` doubling up to the cap ([`TransferOptions::piece_bytes_for`]), then
/// pieces of the cap to the end. Offsets stay in whole 4 KiB pages, but for a source with an
/// origin ([`FillSource::origin`]): one piece of any length then brings the cap's pieces to
/// its multiples of the chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PiecePlan {
    /// The ramp's pieces: (offset, bytes).
    ramp: Vec<(u64, usize)>,
    /// Where the pieces of the cap's size start.
    tail_from: u64,
    cap: usize,
    len: u64,
    /// Pieces in all.
    pub(crate) count: usize,
}

impl PiecePlan {
    pub(crate) fn new(cfg: &TransferOptions, len: u64) -> Self {
        Self::new_at(cfg, len, None)
    }

    /// The pieces of an upload from a source whose byte 0 is at `origin`
    /// ([`FillSource::origin`]): where the cap is the whole chunk, one shorter piece after the
    /// ramp where needed, so that the pieces of the cap's size start at multiples of it in the
    /// source's offsets (smaller caps, an even share of a small upload, fit no block size).
    pub(crate) fn new_at(cfg: &TransferOptions, len: u64, origin: Option<u64>) -> Self {
        let cfg = cfg.normalized();
        let cap = cfg.piece_bytes_for(len);
        let mut ramp = Vec::new();
        let mut off = 0u64;
        let mut size = cfg.min_chunk_bytes.min(cap);
        while size < cap && off < len {
            for _ in 0..cfg.lanes_for(len) {
                if off >= len {
                    break;
                }
                let n = (size as u64).min(len - off);
                ramp.push((off, n as usize));
                off += n;
            }
            size *= 2;
        }
        let past = origin
            .filter(|_| cap == cfg.chunk_bytes)
            .map_or(0, |o| (o % cap as u64 + off % cap as u64) % cap as u64);
        if past != 0 && off < len {
            let n = (cap as u64 - past).min(len - off);
            ramp.push((off, n as usize));
            off += n;
        }
        let count = ramp.len() + (len - off).div_ceil(cap as u64) as usize;
        PiecePlan {
            ramp,
            tail_from: off,
            cap,
            len,
            count,
        }
    }

    /// Piece `i`: (offset, bytes).
    pub(crate) fn get(&self, i: usize) -> Option<(u64, usize)> {
        if let Some(&p) = self.ramp.get(i) {
            return Some(p);
        }
        let k = (i - self.ramp.len()) as u64;
        let off = self
            .tail_from
            .checked_add(k.checked_mul(self.cap as u64)?)?;
        (off < self.len).then(|| (off, (self.len - off).min(self.cap as u64) as usize))
    }
}

/// Free staging buffers shared by the copy side and the drain threads of a staged download.
struct FreeList {
    bufs: Mutex<Vec<PooledBuffer>>,
    ready: Condvar,
    abort: AtomicBool,
}

impl FreeList {
    fn put(&self, buf: PooledBuffer) {
        self.bufs.lock().push(buf);
        self.ready.notify_one();
    }

    /// A free buffer, or None once aborted.
    fn take(&self) -> Option<PooledBuffer> {
        let mut bufs = self.bufs.lock();
        loop {
            if self.abort.load(Ordering::Acquire) {
                return None;
            }
            if let Some(b) = bufs.pop() {
                return Some(b);
            }
            self.ready.wait_for(&mut bufs, Duration::from_millis(50));
        }
    }

    fn stop(&self) {
        self.abort.store(true, Ordering::Release);
        self.ready.notify_all();
    }
}

impl TransferScheduler {
    /// A scheduler on `gpu` with its own streams and a staging pool on the GPU's NUMA node.
    pub fn new(gpu: &Gpu, cfg: TransferOptions) -> Result<Self> {
        let cfg = cfg.normalized();
        let ctx = Arc::clone(gpu.context());
        let new_streams = |n: usize| {
            (0..n)
                .map(|_| {
                    ctx.new_stream()
                        .map_err(|e| Error::cuda("cuStreamCreate", e))
                })
                .collect::<Result<Vec<_>>>()
        };
        let streams = new_streams(cfg.streams)?;
        let lane_streams = new_streams(cfg.fill_threads)?;
        let pool = PinnedPool::new(
            gpufeed_pinned::PoolMode::Cuda(Arc::clone(&ctx)),
            PoolOptions::default().with_numa_node(gpu.info().numa_node),
        )?;
        let placement = gpu.info().numa_node.and_then(|node| {
            gpufeed_numa::Topology::detect()
                .ok()
                .filter(|t| t.is_numa())
                .map(|t| (t, node))
        });
        Ok(TransferScheduler {
            gpu: gpu.clone(),
            streams,
            lane_streams,
            pool,
            cfg,
            placement,
            crews: Mutex::new(Vec::new()),
            next_stream: AtomicUsize::new(0),
            fallbacks: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// An idle crew of kept fill threads (`fill_threads - 1` of them, each placed on the
    /// GPU's node for good where there are several), or a new one; given back when the lease
    /// is dropped.
    fn crew(&self) -> Result<CrewLease<'_>> {
        let idle = self.crews.lock().pop();
        let crew = match idle {
            Some(c) => c,
            None => {
                let (placement, fallbacks) = (self.placement.clone(), Arc::clone(&self.fallbacks));
                Self::start_workers(
                    self.cfg.fill_threads - 1,
                    self.cfg.idle_spin,
                    placement,
                    fallbacks,
                )
                .map_err(|reason| Error::ThreadStart {
                    what: "the fill threads",
                    reason,
                })?
            }
        };
        Ok(CrewLease {
            crews: &self.crews,
            crew: Some(crew),
        })
    }

    fn start_workers(
        n: usize,
        idle_spin: Duration,
        placement: Option<(gpufeed_numa::Topology, u32)>,
        fallbacks: Arc<Mutex<Vec<Fallback>>>,
    ) -> std::result::Result<Crew, String> {
        Crew::start(n, idle_spin, "gpufeed-fill", move || {
            let Some((topology, node)) = &placement else {
                return;
            };
            match topology.bind_thread(*node) {
                // The thread keeps its place for its whole life.
                Ok(binding) => std::mem::forget(binding),
                Err(e) => Fallback::new(
                    Refused::NumaPlacement,
                    e.to_string(),
                    "IO threads run unbound",
                )
                .push_once(&mut fallbacks.lock()),
            }
        })
        .map_err(|e| e.to_string())
    }

    /// Binds the calling (fill or drain) thread to the GPU's NUMA node on machines of several
    /// nodes; a refusal is noted once and the thread runs unbound.
    fn bind_worker(&self) -> Option<gpufeed_numa::ThreadBinding> {
        let (topology, node) = self.placement.as_ref()?;
        match topology.bind_thread(*node) {
            Ok(b) => Some(b),
            Err(e) => {
                Fallback::new(
                    Refused::NumaPlacement,
                    e.to_string(),
                    "IO threads run unbound",
                )
                .push_once(&mut self.fallbacks.lock());
                None
            }
        }
    }

    /// Slower paths taken (IO threads that could not be placed on the GPU's node).
    pub fn fallbacks(&self) -> Vec<Fallback> {
        self.fallbacks.lock().clone()
    }

    /// The settings in use.
    pub fn config(&self) -> TransferOptions {
        self.cfg
    }

    /// The staging pool (its stats, or buffers for callers that stage themselves).
    pub fn pool(&self) -> &PinnedPool {
        &self.pool
    }

    /// Bytes of the staging a staged upload of `len` bytes uses at most (`None`: of any
    /// length); see [`TransferOptions::staging_bytes_for`].
    pub fn staging_bytes_for(&self, len: Option<u64>) -> usize {
        self.cfg.staging_bytes_for(len)
    }

    /// Reserves the staging buffers of a staged upload of `len` bytes (`None`: of any length)
    /// in the pool now, from one slab registered with one call, so that the upload does not
    /// allocate them on its way (a new scheduler's first upload otherwise registers each buffer
    /// as its lane first needs it: on the H200 machine 32 calls of about 1 ms each, serialized
    /// by the driver and holding off the other lanes' copies). With `slab`, that memory (made
    /// ahead, e.g. while the context was created) is used instead of new memory; it must hold
    /// [`TransferScheduler::staging_bytes_for`] bytes. Returns the bytes reserved.
    ///
    /// # Errors
    /// The pool's: a budget too small, a refused registration (then nothing is reserved and
    /// uploads allocate their buffers as before).
    pub fn reserve_staging(
        &self,
        len: Option<u64>,
        slab: Option<gpufeed_pinned::HostSlab>,
    ) -> Result<usize> {
        let chunk = self.cfg.chunk_bytes;
        let count = self.cfg.staging_buffers_for(len);
        if count == 0 {
            return Ok(0);
        }
        let reserved = match slab {
            Some(slab) => self.pool.reserve_slab(slab, chunk)?,
            None => self.pool.reserve(chunk, count)?,
        };
        Ok(reserved * self.cfg.staging_bytes_for(Some(1)))
    }

    /// Copies the pooled (pinned) buffer `src` into new device memory from the context's pool
    /// without waiting for the copy: it runs on one of the scheduler's streams, taken in
    /// turns so that uploads from several threads run side by side and none waits for the
    /// others', and the returned event completes when the bytes are on the GPU. `src`
    /// records the copy, so that the pool does not hand it out again before the copy ended.
    /// cudarc users of the memory are ordered after the copy (its write event); anyone else
    /// waits for the event first. A batch loader's workers gather the next batch meanwhile.
    ///
    /// # Errors
    /// [`Error::Cuda`] (allocation, copy, events).
    pub fn upload_pooled_async(
        &self,
        src: &mut PooledBuffer,
    ) -> Result<(CudaSlice<u8>, cudarc::driver::CudaEvent)> {
        self.upload_pooled_reusing(src, None, None)
    }

    /// [`TransferScheduler::upload_pooled_async`] into `reuse` where it is exactly as long as
    /// `src`, of this GPU's context, and cudarc tracks its uses (else new memory; `reuse` is
    /// then freed as any buffer is), recording `done` where given (else a new event): a caller
    /// that keeps its device buffers and events from one upload to the next saves the
    /// allocation, the free and the creation and destruction of three events per upload
    /// (cudarc tracks each allocation with two). Before the copy, its stream waits for
    /// `reuse`'s last cudarc read and last write (its read and write events), as a free
    /// would; work on the memory outside cudarc's tracking must have ended (or been ordered
    /// before) when the caller hands it back. Where the context's event tracking is off
    /// (cudarc's `disable_event_tracking`) nothing would order the copy after the memory's
    /// last use, so `reuse` is freed instead.
    ///
    /// # Errors
    /// [`Error::Cuda`] (allocation, copy, events).
    pub fn upload_pooled_reusing(
        &self,
        src: &mut PooledBuffer,
        reuse: Option<CudaSlice<u8>>,
        done: Option<cudarc::driver::CudaEvent>,
    ) -> Result<(CudaSlice<u8>, cudarc::driver::CudaEvent)> {
        let len = src.len();
        self.fill_batch_memory(len, reuse, done, |stream, dst| {
            let (dptr, guard) = dst.device_ptr_mut(stream);
            // SAFETY: `src` is pinned and holds `len` bytes; it is not written again before
            // the event recorded after this completed (the pool waits for it before handing
            // the buffer out again); `dst` holds `len` bytes, and this stream waited (in
            // `device_ptr_mut`) for its last cudarc read and write (a reused buffer is taken
            // only where cudarc tracks them).
            unsafe { raw::memcpy_htod_async(dptr, src.as_ptr(), len, stream.cu_stream()) }?;
            drop(guard);
            Ok(src.record_use(stream)?)
        })
    }

    /// What [`TransferScheduler::upload_pooled_reusing`] and
    /// [`TransferScheduler::gather_pooled_reusing`] share: binds the context, takes the next
    /// stream, `reuse` where it is exactly `len` bytes of this context and cudarc tracks its
    /// uses (else new memory of `len`), has `fill` write it on the stream (unless `len` is 0),
    /// then records `done` (or a new event) there.
    fn fill_batch_memory(
        &self,
        len: usize,
        reuse: Option<CudaSlice<u8>>,
        done: Option<cudarc::driver::CudaEvent>,
        fill: impl FnOnce(&Arc<CudaStream>, &mut CudaSlice<u8>) -> Result<()>,
    ) -> Result<(CudaSlice<u8>, cudarc::driver::CudaEvent)> {
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let k = self.next_stream.fetch_add(1, Ordering::Relaxed) % self.streams.len();
        let stream = &self.streams[k];
        let ctx = self.gpu.context();
        let mut dst = match reuse {
            Some(d)
                if d.len() == len
                    && d.stream().context() == ctx
                    && ctx.is_managing_stream_synchronization() =>
            {
                Ok(d)
            }
            _ if len == 0 => stream.null::<u8>(),
            // SAFETY: written by `fill` before anything reads it: cudarc users wait for its
            // write event, others for the event returned.
            _ => unsafe { stream.alloc::<u8>(len) },
        }
        .map_err(|e| Error::cuda("cuMemAllocAsync", e))?;
        if len > 0 {
            fill(stream, &mut dst)?;
        }
        let done = match done {
            Some(ev) => {
                ev.record(stream)
                    .map_err(|e| Error::cuda("cuEventRecord", e))?;
                ev
            }
            None => stream
                .record_event(None)
                .map_err(|e| Error::cuda("cuEventRecord", e))?,
        };
        Ok((dst, done))
    }

    /// Waits for everything queued on the scheduler's own streams (copies, gathers) to end;
    /// other work of the context is not waited for.
    ///
    /// # Errors
    /// [`Error::Cuda`] naming `cuStreamSynchronize`.
    pub fn synchronize(&self) -> Result<()> {
        for s in self.streams.iter().chain(&self.lane_streams) {
            s.synchronize()
                .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        }
        Ok(())
    }

    /// Gathers `count` records of `rec_bytes` bytes each on the GPU ([`GatherKernel`](crate::kernels::GatherKernel)) into
    /// device memory, back to back, without waiting: the kernel runs on one of the
    /// scheduler's streams taken in turns, as [`TransferScheduler::upload_pooled_reusing`]'s
    /// copy does, into `reuse` where it fits as there, recording `done` (or a new event) after
    /// it; `addrs` (a pooled buffer holding the records' addresses, `count` native-endian
    /// `u64`s) records the kernel, so that the pool does not hand it out again before it
    /// ended.
    ///
    /// # Safety
    /// Each address in `addrs` starts `rec_bytes` bytes the GPU can read (host memory
    /// registered with CUDA, such as a record file's mapping, or device memory), not written,
    /// unmapped or unregistered before the returned event completed.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when `addrs` holds fewer than `count` addresses;
    /// [`Error::Cuda`] (allocation, launch, events).
    pub unsafe fn gather_pooled_reusing(
        &self,
        kernel: &crate::kernels::GatherKernel,
        addrs: &mut PooledBuffer,
        count: u32,
        rec_bytes: u64,
        reuse: Option<CudaSlice<u8>>,
        done: Option<cudarc::driver::CudaEvent>,
    ) -> Result<(CudaSlice<u8>, cudarc::driver::CudaEvent)> {
        let short = |capacity: u64| Error::OutOfBounds {
            len: u64::from(count) * 8,
            offset: 0,
            capacity,
        };
        if (addrs.len() as u64) < u64::from(count) * 8 {
            return Err(short(addrs.len() as u64));
        }
        let len =
            usize::try_from(u64::from(count).saturating_mul(rec_bytes)).map_err(|_| short(0))?;
        self.fill_batch_memory(len, reuse, done, |stream, dst| {
            // SAFETY: `addrs` is pooled page-locked memory holding `count` addresses (checked
            // above), not handed out again before the event `record_use` records completed;
            // what the addresses point to the caller vouches for.
            unsafe { kernel.launch(stream, addrs.as_ptr().cast(), count, rec_bytes, dst) }?;
            Ok(addrs.record_use(stream)?)
        })
    }

    /// Gathers `spans` on the GPU ([`GatherKernel::launch_spans`](crate::kernels::GatherKernel::launch_spans))
    /// into device memory of `len` bytes, without waiting, as
    /// [`TransferScheduler::gather_pooled_reusing`] does: one of the scheduler's streams in
    /// turn, `reuse` where it is `len` bytes, `done` (or a new event) recorded after the
    /// kernel. The spans are written into `table` (a pooled buffer of at least
    /// `spans.len() * Span::BYTES` bytes), which records the kernel so that the pool does not
    /// hand it out again before it ended.
    ///
    /// # Safety
    /// `table` is page-locked memory of this scheduler's context (a pool in CUDA mode). Each
    /// span's source is memory the GPU can read for its length (and, where 16-byte aligned, up
    /// to its length rounded up to 16 bytes), not written, unmapped or unregistered before the
    /// returned event completed.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when `table` is too small or a span lies past `len`;
    /// [`Error::Cuda`] (allocation, launch, events).
    pub unsafe fn gather_spans_pooled_reusing(
        &self,
        kernel: &crate::kernels::GatherKernel,
        table: &mut PooledBuffer,
        spans: &[crate::kernels::Span],
        len: usize,
        reuse: Option<CudaSlice<u8>>,
        done: Option<cudarc::driver::CudaEvent>,
    ) -> Result<(CudaSlice<u8>, cudarc::driver::CudaEvent)> {
        let need = spans.len().saturating_mul(crate::kernels::Span::BYTES);
        if table.capacity() < need {
            return Err(Error::OutOfBounds {
                len: need as u64,
                offset: 0,
                capacity: table.capacity() as u64,
            });
        }
        // Checked here too (the kernel's launch checks again): with `len` 0 nothing launches.
        if let Some(s) = spans.iter().find(|s| {
            s.offset
                .checked_add(s.len)
                .is_none_or(|end| end > len as u64)
        }) {
            return Err(Error::OutOfBounds {
                len: s.len,
                offset: s.offset,
                capacity: len as u64,
            });
        }
        table.set_len(need);
        for (slot, s) in table
            .chunks_exact_mut(crate::kernels::Span::BYTES)
            .zip(spans)
        {
            slot.copy_from_slice(&s.to_ne_bytes());
        }
        self.fill_batch_memory(len, reuse, done, |stream, dst| {
            // SAFETY: `table` is pooled page-locked memory holding `spans` as the kernel reads
            // them (written above), not handed out again before the event `record_use`
            // records completed; what the spans' sources are the caller vouches for.
            unsafe { kernel.launch_spans(stream, table.as_ptr().cast(), spans, dst) }?;
            Ok(table.record_use(stream)?)
        })
    }

    /// Copies `src` into new device memory of its length from `from` (see
    /// [`Gpu::alloc_filled`]); returns when the bytes are on the GPU.
    ///
    /// # Errors
    /// [`TransferScheduler::upload`]'s, and the allocation's.
    pub fn upload_new(
        &self,
        src: HostSource<'_>,
        from: crate::DeviceAlloc,
    ) -> Result<(CudaSlice<u8>, TransferStats)> {
        let len = src.len() as usize;
        self.gpu
            .alloc_filled(len, from, |dst| self.upload(src, dst, 0))
    }

    /// Copies the `len` bytes of `source` into `parts`, device buffers that take them back to
    /// back (part 0 its first bytes, part 1 the ones after, ...; `len` must be their lengths'
    /// sum), in one staged upload: the lanes run from the first part's bytes to the last
    /// part's without the start and end of a transfer between them, and `landed(k)` is
    /// called (on a fill thread, or this one for an empty part, once per part, in about the
    /// order of the parts) as soon as part k's bytes are all on the GPU, so that a caller can
    /// hand part k out while the later ones load. Empty parts are reported first. `landed`
    /// answers whether to go on: `false` stops the upload (the lanes take no further piece;
    /// [`Error::Stopped`]). Returns when every part landed.
    ///
    /// # Safety
    /// The parts are written through shared references: they must be distinct allocations
    /// (no two overlapping), no GPU work may still use any of them when this is called, and
    /// nothing may read or write part k before `landed(k)` (after it, this call neither reads
    /// nor writes part k).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] where `len` is not the parts' length; [`Error::Stopped`] where a
    /// report answered `false`; as [`Self::upload`] (parts not reported landed by then hold
    /// what the failed copies left).
    ///
    /// # Example
    /// ```no_run
    /// use gpufeed_cuda::{Gpu, SliceSource, TransferOptions, TransferScheduler};
    /// let gpu = Gpu::open(0)?;
    /// let sched = TransferScheduler::new(&gpu, TransferOptions::default())?;
    /// let data = vec![7u8; 3 << 20];
    /// // SAFETY: written by the upload below before they are read.
    /// let parts = unsafe { [gpu.alloc(1 << 20)?, gpu.alloc(2 << 20)?] };
    /// let landed = |k: usize| {
    ///     println!("part {k} landed");
    ///     true // go on
    /// };
    /// // SAFETY: two new allocations, not read or written while they load.
    /// unsafe { sched.upload_parts(&SliceSource(&data), 3 << 20, &[&parts[0], &parts[1]], &landed) }?;
    /// assert_eq!(gpu.to_vec(&parts[1])?, vec![7u8; 2 << 20]);
    /// # Ok::<(), gpufeed_cuda::Error>(())
    /// ```
    pub unsafe fn upload_parts(
        &self,
        source: &dyn FillSource,
        len: u64,
        parts: &[&CudaSlice<u8>],
        landed: &(dyn Fn(usize) -> bool + Sync),
    ) -> Result<TransferStats> {
        let mut starts = Vec::with_capacity(parts.len() + 1);
        let mut total = 0u64;
        for p in parts.iter() {
            starts.push(total);
            total += p.len() as u64;
        }
        starts.push(total);
        if total != len {
            return Err(Error::OutOfBounds {
                len,
                offset: 0,
                capacity: total,
            });
        }
        let nothing = || TransferStats {
            path: "staged",
            bytes: 0,
            seconds: 0.0,
            chunks: 0,
            copy_waited_s: 0.0,
            source_waited_s: 0.0,
        };
        let Some(first) = parts.first() else {
            return Ok(nothing());
        };
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let main = Arc::clone(first.stream());
        let mut ptrs = Vec::with_capacity(parts.len());
        let mut guards = Vec::with_capacity(parts.len());
        for p in parts {
            // A read guard (the address, ordered after the part's earlier uses on `main`):
            // the writes through it are the caller's promise (see Safety).
            let (ptr, guard) = p.device_ptr(&main);
            ptrs.push(ptr);
            guards.push(guard);
        }
        let left: Vec<AtomicU64> = starts
            .windows(2)
            .map(|w| AtomicU64::new(w[1] - w[0]))
            .collect();
        let dest = Parts {
            starts,
            ptrs,
            left,
            landed,
            reported: AtomicUsize::new(0),
            stopped: AtomicBool::new(false),
        };
        for (k, l) in dest.left.iter().enumerate() {
            if l.load(Ordering::Relaxed) == 0 && !dest.stopped.load(Ordering::Acquire) {
                dest.report(k);
            }
        }
        let start = Instant::now();
        let mut stats = if len == 0 || dest.stopped.load(Ordering::Acquire) {
            nothing()
        } else {
            self.upload_staged(&main, source, len, Dest::Parts(&dest))?
        };
        drop(guards);
        if dest.stopped.load(Ordering::Acquire) {
            main.synchronize()
                .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
            return Err(Error::Stopped {
                landed: dest.reported.load(Ordering::Acquire),
            });
        }
        main.synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        stats.seconds = start.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// Copies `src` into `dst` (a `CudaSlice<u8>` or a `CudaViewMut<u8>` of one) starting at
    /// byte `dst_offset`; returns when the bytes are on the GPU. Several threads may upload
    /// through one scheduler at once (into disjoint destinations).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::Cuda`], [`Error::Source`].
    pub fn upload<D>(
        &self,
        src: HostSource<'_>,
        dst: &mut D,
        dst_offset: usize,
    ) -> Result<TransferStats>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        let len = src.len();
        if (dst_offset as u64)
            .checked_add(len)
            .is_none_or(|end| end > dst.len() as u64)
        {
            return Err(Error::OutOfBounds {
                len,
                offset: dst_offset as u64,
                capacity: dst.len() as u64,
            });
        }
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let main = Arc::clone(dst.stream());
        let (dptr, write_guard) = dst.device_ptr_mut(&main);
        let dptr = dptr + dst_offset as u64;
        let start = Instant::now();
        let mut stats = match src {
            HostSource::Pinned(b) => {
                self.copy_direct(&main, b.as_ptr(), b.len(), dptr, "pinned")?
            }
            HostSource::Pooled(b) => {
                self.copy_direct(&main, b.as_ptr(), b.len(), dptr, "pinned")?
            }
            HostSource::Registered(r) => {
                self.copy_direct(&main, r.as_ptr(), r.len(), dptr, "registered")?
            }
            HostSource::RegisteredRange {
                registration,
                offset,
                len,
            } => {
                if offset
                    .checked_add(len)
                    .is_none_or(|end| end > registration.len())
                {
                    return Err(Error::OutOfBounds {
                        len: len as u64,
                        offset: offset as u64,
                        capacity: registration.len() as u64,
                    });
                }
                // SAFETY: the range was just checked to lie inside the registration.
                let src = unsafe { registration.as_ptr().add(offset) };
                self.copy_direct(&main, src, len, dptr, "registered")?
            }
            HostSource::Pageable(s) => {
                self.upload_staged(&main, &SliceSource(s), s.len() as u64, Dest::At(dptr))?
            }
            HostSource::Fill { source, len } => {
                self.upload_staged(&main, source, len, Dest::At(dptr))?
            }
        };
        drop(write_guard);
        main.synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        stats.seconds = start.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// Copies all of `src` (a `CudaSlice<u8>` or a view of one) into `dst` (which must be as
    /// long); returns when the bytes are in host memory.
    pub fn download<S>(&self, src: &S, dst: HostDest<'_>) -> Result<TransferStats>
    where
        S: DevicePtr<u8> + DeviceSlice<u8>,
    {
        let (dst_len, offset) = match &dst {
            HostDest::Pinned(b) => (b.len(), 0),
            HostDest::Pageable(s) => (s.len(), 0),
            HostDest::PooledAt { buffer, offset } => (buffer.len(), *offset),
        };
        let fits = match dst {
            HostDest::PooledAt { .. } => offset
                .checked_add(src.len())
                .is_some_and(|end| end <= dst_len),
            _ => dst_len == src.len(),
        };
        if !fits {
            return Err(Error::OutOfBounds {
                len: src.len() as u64,
                offset: offset as u64,
                capacity: dst_len as u64,
            });
        }
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let main = Arc::clone(src.stream());
        let (dptr, read_guard) = src.device_ptr(&main);
        Self::streams_after(&self.streams, &main)?;
        let start = Instant::now();
        let mut stats = match dst {
            HostDest::Pinned(b) => self.download_direct(dptr, b.as_mut_ptr(), b.len())?,
            HostDest::Pageable(s) => self.download_staged(dptr, s)?,
            HostDest::PooledAt { buffer, offset } => {
                // SAFETY: `offset + src.len() <= buffer.len()` was checked above.
                let at = unsafe { buffer.as_mut_ptr().add(offset) };
                self.download_direct(dptr, at, src.len())?
            }
        };
        Self::main_after_streams(&self.streams, &main)?;
        drop(read_guard);
        main.synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        stats.seconds = start.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// Makes the worker `streams` wait for the work queued so far on `main`.
    fn streams_after(streams: &[Arc<CudaStream>], main: &CudaStream) -> Result<()> {
        let ev = main
            .record_event(None)
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        for s in streams {
            s.wait(&ev)
                .map_err(|e| Error::cuda("cuStreamWaitEvent", e))?;
        }
        Ok(())
    }

    /// Makes `main` wait for everything queued on the worker `streams`.
    fn main_after_streams(streams: &[Arc<CudaStream>], main: &CudaStream) -> Result<()> {
        for s in streams {
            main.join(s)
                .map_err(|e| Error::cuda("cuStreamWaitEvent", e))?;
        }
        Ok(())
    }

    /// Bytes per copy of a direct transfer: `chunk_bytes`, at least [`DIRECT_CHUNK_BYTES`].
    fn direct_chunk(&self) -> u64 {
        self.cfg.chunk_bytes.max(DIRECT_CHUNK_BYTES) as u64
    }

    /// The streams a direct copy of `len` bytes uses: one per chunk, up to all of them.
    fn streams_for(&self, len: u64) -> &[Arc<CudaStream>] {
        let chunks = len.div_ceil(self.direct_chunk()).max(1) as usize;
        &self.streams[..self.streams.len().min(chunks)]
    }

    /// `(index, offset, size)` of each `chunk`-byte piece of `len` bytes.
    fn chunks(len: u64, chunk: u64) -> impl Iterator<Item = (usize, u64, usize)> {
        (0..len.div_ceil(chunk))
            .map(move |i| (i as usize, i * chunk, (len - i * chunk).min(chunk) as usize))
    }

    /// Issues `copy(offset, size, stream)` for every chunk of `len` bytes, chunk i on stream
    /// i mod N, then waits for all of them — also after a failed enqueue, so that no copy still
    /// reads or writes host memory when this returns.
    fn copy_chunks(
        &self,
        len: usize,
        path: &'static str,
        mut copy: impl FnMut(u64, usize, sys::CUstream) -> Result<()>,
    ) -> Result<TransferStats> {
        let mut n = 0;
        let mut issued = Ok(());
        for (i, off, size) in Self::chunks(len as u64, self.direct_chunk()) {
            let stream = &self.streams[i % self.streams.len()];
            if let Err(e) = copy(off, size, stream.cu_stream()) {
                issued = Err(e);
                break;
            }
            n += 1;
        }
        let synced = Self::sync_streams(self.streams_for(len as u64));
        issued?;
        synced?;
        Ok(TransferStats {
            path,
            bytes: len as u64,
            seconds: 0.0,
            chunks: n,
            copy_waited_s: 0.0,
            source_waited_s: 0.0,
        })
    }

    /// Copies page-locked `src` straight to the device over the streams, after the work
    /// queued on `main` (the destination's allocation).
    fn copy_direct(
        &self,
        main: &CudaStream,
        src: *const u8,
        len: usize,
        dptr: sys::CUdeviceptr,
        path: &'static str,
    ) -> Result<TransferStats> {
        Self::streams_after(self.streams_for(len as u64), main)?;
        self.copy_chunks(len, path, |off, size, stream| {
            // SAFETY: [src + off, +size) lies in page-locked memory borrowed by the caller for
            // the whole call, and copy_chunks waits for the copy; the device range was bounds
            // checked by upload().
            unsafe { raw::memcpy_htod_async(dptr + off, src.add(off as usize), size, stream) }
        })
    }

    fn download_direct(
        &self,
        dptr: sys::CUdeviceptr,
        dst: *mut u8,
        len: usize,
    ) -> Result<TransferStats> {
        self.copy_chunks(len, "pinned", |off, size, stream| {
            // SAFETY: the destination is pinned memory borrowed mutably for the whole call, and
            // copy_chunks waits for the copy.
            unsafe { raw::memcpy_dtoh_async(dst.add(off as usize), dptr + off, size, stream) }
        })
    }

    /// Ends a staged transfer: whatever happened, every copy issued must finish before the
    /// staging buffers (back in the pool, each with its event) can be reused or freed.
    fn finish_staged(
        streams: &[Arc<CudaStream>],
        outcome: Result<()>,
        bytes: u64,
        chunks: usize,
        copy_waited: Duration,
        other_waited: Duration,
    ) -> Result<TransferStats> {
        let synced = Self::sync_streams(streams);
        outcome?;
        synced?;
        Ok(TransferStats {
            path: "staged",
            bytes,
            seconds: 0.0,
            chunks: chunks as u64,
            copy_waited_s: copy_waited.as_secs_f64(),
            source_waited_s: other_waited.as_secs_f64(),
        })
    }

    fn sync_streams(streams: &[Arc<CudaStream>]) -> Result<()> {
        for s in streams {
            s.synchronize()
                .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        }
        Ok(())
    }

    fn staging(&self, len: u64) -> Result<FreeList> {
        let count = self
            .cfg
            .staging_buffers
            .min(len.div_ceil(self.cfg.chunk_bytes as u64) as usize)
            .max(1);
        let bufs = (0..count)
            .map(|_| self.pool.get(self.cfg.chunk_bytes))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(FreeList {
            bufs: Mutex::new(bufs),
            ready: Condvar::new(),
            abort: AtomicBool::new(false),
        })
    }

    /// A staged upload in lanes: each fill thread owns a stream and a few staging buffers,
    /// fills a buffer, issues its copy on its own stream and moves on to the next buffer,
    /// waiting only for that buffer's previous copy. Nothing funnels through one submitting
    /// thread: on the H200 machine lanes moved cached file pages at 52 GB/s where one thread
    /// handing filled buffers to the copies managed 40-47 (docs/benchmarks.md, sweep 4).
    ///
    /// The calling thread runs the first lane; the others run on the scheduler's kept fill
    /// threads. Small uploads are cut into smaller pieces ([`TransferOptions::piece_bytes_for`])
    /// so that several lanes share them, and only the lanes with work are woken and waited for.
    fn upload_staged(
        &self,
        main: &CudaStream,
        source: &dyn FillSource,
        len: u64,
        dest: Dest<'_>,
    ) -> Result<TransferStats> {
        let plan = PiecePlan::new_at(&self.cfg, len, source.origin());
        let chunks = plan.count;
        let lanes = self.cfg.lanes_for(len).min(chunks).max(1);
        let lanes = &self.lane_streams[..self.lane_streams.len().min(lanes)];
        // Each lane orders its stream after this event itself (the waits in parallel).
        let after = main
            .record_event(None)
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        let per_lane = (self.cfg.staging_buffers / self.cfg.fill_threads).max(2);
        let work = LaneWork {
            source,
            dest,
            plan,
            per_lane,
            next: AtomicUsize::new(0),
            abort: AtomicBool::new(false),
        };
        // One outcome per lane: its result and its (filling, waiting) times.
        type Outcome = (Result<()>, (Duration, Duration));
        let outcomes: Vec<Mutex<Option<Outcome>>> =
            lanes.iter().map(|_| Mutex::new(None)).collect();
        let lane = |i: usize| {
            let mut timers = (Duration::ZERO, Duration::ZERO);
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.run_lane(&work, &lanes[i], &after, &mut timers)
            }))
            .unwrap_or(Err(Error::ThreadPanicked { what: "fill" }));
            if result.is_err() {
                work.abort.store(true, Ordering::Release);
            }
            *outcomes[i].lock() = Some((result, timers));
        };
        let _placed = self.bind_worker();
        if lanes.len() > 1 {
            // More than one lane means more than one fill thread: a crew has members.
            self.crew()?.run(lanes.len(), &lane);
        } else {
            lane(0);
        }
        let (mut filling, mut waiting) = (Duration::ZERO, Duration::ZERO);
        let mut outcome = Ok(());
        // A lane that succeeded synchronized its stream; the others may still have copies
        // in flight from their staging buffers.
        let mut unsynced = Vec::new();
        for (slot, stream) in outcomes.into_iter().zip(lanes) {
            let (result, (filled, waited)) = slot.into_inner().unwrap_or((
                Err(Error::ThreadPanicked { what: "fill" }),
                Default::default(),
            ));
            filling += filled;
            waiting += waited;
            if result.is_err() {
                unsynced.push(Arc::clone(stream));
            }
            if outcome.is_ok() {
                outcome = result;
            }
        }
        let n = lanes.len() as u32;
        Self::finish_staged(&unsynced, outcome, len, chunks, filling / n, waiting / n)
    }

    /// One lane of a staged upload: orders its stream after `after` (the destination's
    /// allocation), takes pieces until none are left (or another lane failed), and waits for
    /// its copies. `timers` gathers the seconds spent filling and waiting for a buffer's copy.
    fn run_lane(
        &self,
        work: &LaneWork<'_>,
        stream: &CudaStream,
        after: &cudarc::driver::CudaEvent,
        timers: &mut (Duration, Duration),
    ) -> Result<()> {
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        stream
            .wait(after)
            .map_err(|e| Error::cuda("cuStreamWaitEvent", e))?;
        // Buffers of the chunk's size class, whatever the piece: the ones reserved for the
        // scheduler. They go back to the pool on return carrying the events of their last
        // copies; finish_staged waits for the lanes' streams before the upload returns.
        let mut bufs: Vec<PooledBuffer> = Vec::with_capacity(work.per_lane);
        // Uploads in parts: the piece each buffer's last copy carried, until it is known
        // complete (the buffer idle again), so that a part is reported once it landed.
        let parts = match work.dest {
            Dest::Parts(p) => Some(p),
            Dest::At(_) => None,
        };
        let mut carried: Vec<Option<(u64, usize)>> = match parts {
            Some(_) => vec![None; work.per_lane],
            None => Vec::new(),
        };
        let mut copied = false;
        for k in 0.. {
            if work.abort.load(Ordering::Acquire)
                || parts.is_some_and(|p| p.stopped.load(Ordering::Acquire))
            {
                break;
            }
            let i = work.next.fetch_add(1, Ordering::Relaxed);
            let Some((off, size)) = work.plan.get(i) else {
                break;
            };
            let slot = k % work.per_lane;
            if slot == bufs.len() {
                bufs.push(self.pool.get(self.cfg.chunk_bytes)?);
            }
            let buf = &mut bufs[slot];
            let t = Instant::now();
            buf.wait_idle()?;
            timers.1 += t.elapsed();
            if let Some(p) = parts
                && let Some((o, n)) = carried[slot].take()
            {
                p.completed(o, n);
            }
            buf.set_len(size);
            let t = Instant::now();
            work.source
                .fill(off, &mut buf[..size])
                .map_err(|source| Error::Source {
                    offset: off,
                    source,
                })?;
            timers.0 += t.elapsed();
            // The staging buffer is pinned and is not written again before the event recorded
            // right after this copy completed (wait_idle above, or the pool's own wait before
            // it hands the buffer out again); the device range was bounds checked by upload()
            // (or upload_parts: the parts' lengths are the upload's).
            match work.dest {
                // SAFETY: see above.
                Dest::At(dptr) => unsafe {
                    raw::memcpy_htod_async(dptr + off, buf.as_ptr(), size, stream.cu_stream())
                }?,
                Dest::Parts(p) => {
                    let mut issued = Ok(());
                    p.each(off, size, |k, at, from, n| {
                        if issued.is_ok() {
                            // SAFETY: as above; [at, at + n) lies in part k (Parts::each).
                            issued = unsafe {
                                raw::memcpy_htod_async(
                                    p.ptrs[k] + at,
                                    buf.as_ptr().add(from),
                                    n,
                                    stream.cu_stream(),
                                )
                            };
                        }
                    });
                    issued?;
                }
            }
            buf.record_use(stream)?;
            copied = true;
            if let Some(p) = parts {
                carried[slot] = Some((off, size));
                // The lane's other buffers whose copies completed meanwhile (a query each,
                // no wait): their parts may have landed.
                for (c, b) in carried.iter_mut().zip(&bufs) {
                    if c.is_some() && !b.is_busy() {
                        let (o, n) = c.take().unwrap_or_default();
                        p.completed(o, n);
                    }
                }
            }
        }
        if copied {
            stream
                .synchronize()
                .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
            if let Some(p) = parts {
                for (o, n) in carried.into_iter().flatten() {
                    p.completed(o, n);
                }
            }
        }
        Ok(())
    }

    fn download_staged(&self, dptr: sys::CUdeviceptr, dst: &mut [u8]) -> Result<TransferStats> {
        let len = dst.len() as u64;
        let free = self.staging(len)?;
        let out = SendPtr(dst.as_mut_ptr());
        let chunks: Vec<(usize, u64, usize)> =
            Self::chunks(len, self.cfg.chunk_bytes as u64).collect();
        let (work_tx, work_rx) = mpsc::channel::<(usize, PooledBuffer)>();
        let work_rx = Mutex::new(work_rx);
        let drain_waited = Mutex::new(Duration::ZERO);
        let mut copy_waited = Duration::ZERO;
        let outcome = std::thread::scope(|scope| -> Result<()> {
            let mut drains = Vec::new();
            for _ in 0..self.cfg.fill_threads.min(chunks.len()) {
                let (free, work_rx, chunks, drain_waited) =
                    (&free, &work_rx, &chunks, &drain_waited);
                drains.push(scope.spawn(move || -> Result<()> {
                    let _placed = self.bind_worker();
                    let out = out;
                    loop {
                        let Ok((idx, mut buf)) = work_rx.lock().recv() else {
                            return Ok(());
                        };
                        let (_, off, size) = chunks[idx];
                        let t = Instant::now();
                        let waited = buf.wait_idle();
                        *drain_waited.lock() += t.elapsed();
                        if let Err(e) = waited {
                            free.stop();
                            return Err(e.into());
                        }
                        // SAFETY: chunk `idx` is this thread's alone; [off, off + size) lies in
                        // dst, which the caller lends mutably for the whole call.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                buf.as_ptr(),
                                out.0.add(off as usize),
                                size,
                            )
                        };
                        free.put(buf);
                    }
                }));
            }
            let issued = self.issue_downloads(&chunks, &free, &work_tx, dptr, &mut copy_waited);
            drop(work_tx);
            // A drain thread's failure stops the copies above; report it rather than a short
            // download.
            for d in drains {
                d.join()
                    .map_err(|_| Error::ThreadPanicked { what: "drain" })??;
            }
            issued
        });
        Self::finish_staged(
            &self.streams,
            outcome,
            len,
            chunks.len(),
            copy_waited,
            drain_waited.into_inner(),
        )
    }

    /// Issues the device-to-host copies of a staged download, handing each filled staging
    /// buffer to the drain threads.
    fn issue_downloads(
        &self,
        chunks: &[(usize, u64, usize)],
        free: &FreeList,
        work_tx: &mpsc::Sender<(usize, PooledBuffer)>,
        dptr: sys::CUdeviceptr,
        copy_waited: &mut Duration,
    ) -> Result<()> {
        {
            for &(idx, off, size) in chunks {
                let t = Instant::now();
                let Some(mut buf) = free.take() else { break };
                *copy_waited += t.elapsed();
                buf.wait_idle()?;
                let stream = &self.streams[idx % self.streams.len()];
                // SAFETY: the staging buffer is ours until the drain thread that receives it
                // waited for the event recorded right after this copy.
                unsafe {
                    raw::memcpy_dtoh_async(buf.as_mut_ptr(), dptr + off, size, stream.cu_stream())
                }?;
                buf.record_use(stream)?;
                if work_tx.send((idx, buf)).is_err() {
                    break;
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Parts, PiecePlan, TransferOptions};
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

    /// Pieces cut over parts of an upload in parts: each byte goes to the one part it belongs
    /// to (empty parts skipped), at its offset there; a part is reported landed once, when its
    /// last bytes complete, whatever the order of the pieces.
    #[test]
    fn pieces_over_parts_land_each_part_once() {
        let lens = [5u64, 0, 1, 10, 0, 4];
        let mut starts = vec![0u64];
        for l in lens {
            starts.push(starts.last().unwrap() + l);
        }
        let landed = parking_lot::Mutex::new(Vec::new());
        let report = |k: usize| {
            landed.lock().push(k);
            k != 3 // the report of part 3 asks to stop
        };
        let parts = Parts {
            starts: starts.clone(),
            ptrs: (0..lens.len() as u64).map(|k| 1000 * k).collect(),
            left: lens.iter().map(|&l| AtomicU64::new(l)).collect(),
            landed: &report,
            reported: AtomicUsize::new(0),
            stopped: AtomicBool::new(false),
        };
        let mut cut = Vec::new();
        parts.each(3, 12, |k, at, from, n| cut.push((k, at, from, n)));
        // Bytes 3..15: 3..5 of part 0, 5..6 (part 2), 6..15 of part 3 (0..9 of its 10).
        assert_eq!(cut, vec![(0, 3, 0, 2), (2, 0, 2, 1), (3, 0, 3, 9)]);
        let mut whole = Vec::new();
        parts.each(0, 20, |k, at, from, n| whole.push((k, at, from, n)));
        assert_eq!(
            whole,
            vec![(0, 0, 0, 5), (2, 0, 5, 1), (3, 0, 6, 10), (5, 0, 16, 4)]
        );
        // Pieces complete out of order.
        for (off, n) in [(16u64, 4usize), (3, 12), (15, 1), (0, 3)] {
            assert!(!parts.stopped.load(Ordering::Relaxed) || off == 0);
            parts.completed(off, n);
        }
        assert!(
            parts.stopped.load(Ordering::Relaxed),
            "part 3's answer stops it"
        );
        assert_eq!(parts.reported.load(Ordering::Relaxed), 4);
        let mut got = landed.into_inner();
        assert_eq!(
            got,
            vec![5, 2, 3, 0],
            "in the order their last bytes completed"
        );
        got.sort_unstable();
        got.dedup();
        assert_eq!(got.len(), 4, "once each");
    }

    /// Small uploads are cut into two pieces per fill thread, in whole 64 KiB, never below the
    /// minimum nor above a chunk; the staging they need follows the pieces.
    #[test]
    fn pieces_of_small_uploads() {
        assert_eq!(TransferOptions::default().min_chunk_bytes, 1 << 20);
        let cfg = TransferOptions::default()
            .with_chunk_bytes(4 << 20)
            .with_min_chunk_bytes(256 << 10)
            .with_fill_threads(16)
            .with_staging_buffers(32);
        let piece = |len: u64| cfg.piece_bytes_for(len);
        assert_eq!(piece(1), 256 << 10, "never below the minimum");
        assert_eq!(piece(1 << 20), 256 << 10, "1 MiB: four pieces");
        assert_eq!(cfg.lanes_for(1 << 20), 4, "at least four lanes");
        assert_eq!(cfg.lanes_for(16 << 20), 4);
        assert_eq!(cfg.lanes_for(64 << 20), 8, "one lane per 8 MiB");
        assert_eq!(cfg.lanes_for(1 << 30), 16, "at most the fill threads");
        assert_eq!(
            cfg.with_fill_threads(2).lanes_for(1),
            2,
            "fewer threads than four"
        );
        assert_eq!(
            piece(16 << 20),
            2 << 20,
            "16 MiB: two pieces per lane on four lanes"
        );
        assert_eq!(piece(64 << 20), 4 << 20);
        assert_eq!(piece(256 << 20), 4 << 20, "never above a chunk");
        assert_eq!(piece(u64::MAX / 2), 4 << 20);
        assert_eq!(piece((10 << 20) + 1) % (64 << 10), 0, "whole 64 KiB");
        assert_eq!(cfg.staging_buffers_for(Some(1 << 20)), 4);
        // 16 MiB: 4 x 256 KiB, 4 x 512 KiB, 4 x 1 MiB, then 2 MiB pieces.
        assert_eq!(cfg.staging_buffers_for(Some(16 << 20)), 17);
        assert_eq!(cfg.staging_buffers_for(Some(5 << 20)), 12);
        assert_eq!(cfg.staging_buffers_for(Some(1 << 30)), 32);
        assert_eq!(cfg.staging_buffers_for(None), 32);
        // An odd minimum is rounded to whole pages, and capped at the chunk.
        let odd = cfg.with_min_chunk_bytes(5000).normalized();
        assert_eq!(odd.min_chunk_bytes, 8192);
        assert_eq!(
            cfg.with_min_chunk_bytes(1 << 30).piece_bytes_for(1),
            4 << 20
        );
    }

    /// The pieces of an upload cover it exactly once, in order, in whole pages, never above
    /// the cap; the ramp doubles per round of one piece per fill thread.
    #[test]
    fn piece_plans_cover_the_upload() {
        let cfg = TransferOptions::default()
            .with_chunk_bytes(4 << 20)
            .with_min_chunk_bytes(256 << 10)
            .with_fill_threads(16)
            .with_staging_buffers(32);
        for len in [
            1u64,
            4096,
            (1 << 20) + 3,
            5 << 20,
            64 << 20,
            (300 << 20) + 7,
            (4 << 30) + 1,
        ] {
            let plan = PiecePlan::new(&cfg, len);
            let cap = cfg.piece_bytes_for(len);
            let mut at = 0u64;
            for i in 0..plan.count {
                let (off, n) = plan.get(i).expect("a piece");
                assert_eq!(off, at, "{len}: piece {i} starts where the last ended");
                assert!(n > 0 && n <= cap, "{len}: piece {i} of {n}");
                assert_eq!(off % 4096, 0, "{len}: piece {i} page-aligned");
                at += n as u64;
            }
            assert_eq!(at, len, "{len}: covered");
            assert_eq!(plan.get(plan.count), None);
            assert_eq!(cfg.pieces_for(len), plan.count);
        }
        let plan = PiecePlan::new(&cfg, 64 << 20);
        let sizes: Vec<usize> = (0..plan.count).map(|i| plan.get(i).unwrap().1).collect();
        // 256 KiB, 512 KiB, 1 MiB and 2 MiB rounds of 8 lanes, then the 4 MiB cap (the last
        // piece what is left: 2 MiB).
        assert!(sizes[..8].iter().all(|&n| n == 256 << 10), "{sizes:?}");
        assert!(sizes[8..16].iter().all(|&n| n == 512 << 10), "{sizes:?}");
        assert!(sizes[16..24].iter().all(|&n| n == 1 << 20), "{sizes:?}");
        assert!(sizes[24..32].iter().all(|&n| n == 2 << 20), "{sizes:?}");
        assert!(sizes[32..40].iter().all(|&n| n == 4 << 20), "{sizes:?}");
        assert_eq!(
            sizes[32..],
            [4 << 20; 8]
                .iter()
                .copied()
                .chain([2 << 20])
                .collect::<Vec<_>>()
        );
        // No ramp where the minimum is the chunk.
        let flat = PiecePlan::new(&cfg.with_min_chunk_bytes(4 << 20), 64 << 20);
        assert_eq!(flat.count, 16);
    }

    #[test]
    fn pieces_of_the_caps_size_start_at_the_sources_multiples_of_it() {
        let cfg = TransferOptions::default()
            .with_chunk_bytes(16 << 20)
            .with_min_chunk_bytes(1 << 20)
            .with_fill_threads(8)
            .with_staging_buffers(16);
        for origin in [0u64, 1, 4104, (16 << 20) - 1, 16 << 20, (3 << 30) + 12_345] {
            for len in [1u64, 4096, (20 << 20) + 3, 300 << 20, (4 << 30) + 1] {
                let plan = PiecePlan::new_at(&cfg, len, Some(origin));
                let cap = cfg.piece_bytes_for(len);
                let aligned = PiecePlan::new(&cfg, len);
                let mut at = 0u64;
                for i in 0..plan.count {
                    let (off, n) = plan.get(i).expect("a piece");
                    assert_eq!(
                        off, at,
                        "{origin} {len}: piece {i} starts where the last ended"
                    );
                    assert!(n > 0 && n <= cap, "{origin} {len}: piece {i} of {n}");
                    // Whole chunks after whole chunks start at the source's multiples of the
                    // chunk; an even share of a small upload is cut from its start.
                    if n == 16 << 20 && i > 0 && plan.get(i - 1).is_some_and(|(_, m)| m == n) {
                        assert_eq!((origin + off) % cap as u64, 0, "{origin} {len}: piece {i}");
                    }
                    if cap < 16 << 20 {
                        assert_eq!(plan.get(i), aligned.get(i), "{origin} {len}: piece {i}");
                    }
                    at += n as u64;
                }
                assert_eq!(at, len, "{origin} {len}: covered");
                assert_eq!(plan.get(plan.count), None);
                // At most one piece more than without an origin (the shorter one), and the
                // staging sized for it.
                assert!(plan.count <= aligned.count + 1, "{origin} {len}");
                let most = cfg.staging_buffers_for(None);
                assert!(
                    cfg.staging_buffers_for(Some(len)) >= plan.count.min(most),
                    "{origin} {len}"
                );
            }
        }
        // From byte 4,104: the ramp (8 lanes of 1, 2, 4 and 8 MiB: 120 MiB), then 8 MiB less
        // 4,104 bytes to reach the object's next 16 MiB boundary, then 16 MiB pieces there.
        let plan = PiecePlan::new_at(&cfg, 1 << 30, Some(4104));
        assert_eq!(plan.get(32), Some((120 << 20, (8 << 20) - 4104)));
        assert_eq!(plan.get(33), Some(((128 << 20) - 4104, 16 << 20)));
    }
}
