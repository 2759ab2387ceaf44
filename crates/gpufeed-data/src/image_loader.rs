//! [`ImageLoader`]: training batches of decoded, augmented images from an
//! [`ImageFolder`](crate::ImageFolder) or WebDataset tar shards (issue 40).
//!
//! Two stages, each on threads of its own:
//! 1. a [`BatchLoader`] of host batches (pinned for the GPU, where there is one): its workers
//!    read each batch's files (or copy its tar samples out of their mappings) in the
//!    sampler's order, ahead of use;
//! 2. decode threads, each with its own [`ImageDecoder`] (an nvJPEG handle and a CUDA stream of
//!    its own, so that several batches decode at once on the GPU's hardware engines), take
//!    the host batches in order and turn each into one device buffer of cropped, resized,
//!    mirrored (and normalized) images ([`ImageDecoder::decode_augmented`]). Without a GPU,
//!    the decode threads decode and augment on the CPU (zune-jpeg and the CPU reference of
//!    the resize: [`crate::resize_crop`]), each on its share of the machine's cores, so that
//!    batches overlap; where nvJPEG is missing, each decoder's CPU decodes take that share.
//!
//! Batches come out in the sampler's order whatever the thread counts; each image's crop and
//! mirror are drawn from the seed, the epoch and its record's index alone
//! ([`Augmentation::choose`]), so an elastic run resumed with another world size
//! ([`ImageLoader::resume`]) sees the same images cropped the same way.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpufeed_cuda::Gpu;
use gpufeed_cuda::cudarc::driver::CudaSlice;
use parking_lot::Mutex;

use crate::augment::{Augmentation, Crop, normalize_chw, resize_crop, to_u8};
use crate::decode::{ImageDecoder, Layout, per_image_on_threads};
use crate::epoch::OwnedEpoch;
use crate::error::{Error, Result};
use crate::images::{ImageError, OnBadImage, SkippedImage, decode_jpeg};
use crate::loader::{Batch, BatchData, BatchLoader, BatchLoaderOptions, Position};
use crate::records::Dataset;
use crate::sampler::Sampler;

/// What an [`ImageLoader`] makes of each image: start from the default (224 x 224 training
/// crops of seed 0 as `uint8` HWC, bad images an error, three decode threads) and change what
/// you need (new settings may be added).
///
/// ```
/// use gpufeed_data::{Augmentation, ImageOptions, Layout, OnBadImage};
/// let opts = ImageOptions::default()
///     .with_size(224, 224)
///     .with_augmentation(Augmentation::train(7))
///     .with_layout(Layout::F32Chw { mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225] })
///     .with_on_bad(OnBadImage::Skip);
/// assert_eq!(opts.decoders, 3);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ImageOptions {
    /// Output width in pixels.
    pub width: u32,
    /// Output height in pixels.
    pub height: u32,
    /// The crop and mirror of each image (training draws or the evaluation crop).
    pub augmentation: Augmentation,
    /// `uint8` `[n, h, w, 3]`, or `f32` `[n, 3, h, w]` normalized.
    pub layout: Layout,
    /// What a file that is no decodable JPEG does: stop with an error naming it, or be left
    /// out and listed in its batch's [`ImageBatch::skipped`].
    pub on_bad: OnBadImage,
    /// Decode threads, each with its own nvJPEG handle and stream (default 3; with no GPU, or
    /// where nvJPEG is missing, they decode on the CPU, each on its share of the cores, so
    /// that one batch is decoded while the next is gathered). Each thread may hold two
    /// decoded batches ahead of the consumer: with the default 3, up to 6 batches (host memory
    /// without a GPU: 6 x 154 MB for f32 batches of 256 at 224x224). On the H200 machine (GPU run 170, 8,192 JPEGs of 250-500
    /// px and about 49 KiB, batches of 256 at 224): 1 thread 12.1-12.6k images/s, 2
    /// 16.1-19.7k, 3 20.8-24.6k with 2.6-3.2 cores busy, 4 (and 8 reading workers) 22.4-28.6k
    /// with 3.3-4.0; ImageNet-sized files (106 KiB) at 3 threads: 14.4k (run 173); on an H100
    /// (run 177) 3, 4, 6 and 8 threads all gave 14-15k; since each batch goes to the engines
    /// largest image first (run 190, H100, same call): 3 threads 15.0-16.5k against 14.4-15.1k
    /// in the sampler's order, 4 threads 15.4-17.0k with 3.6-4.1 cores busy.
    pub decoders: usize,
    /// Decode threads beside those that decode on nvJPEG's CUDA decoder (its batched call,
    /// Huffman decoding on the GPU's cores) instead of the hardware engines (default 0; with no
    /// GPU, or nvJPEG missing, none are made); each decodes whole batches, so it pays only
    /// where the CUDA decoder keeps up with the engines for the files. Measured on the H200
    /// (GPU run 180, ImageNet-sized files): one such thread decoded about 700-800 images/s,
    /// and since batches are handed out in order, it held the loader (14.7k images/s
    /// without) to 2.9k; two or three to 2.5-2.9k.
    pub cuda_decoders: usize,
}

impl Default for ImageOptions {
    fn default() -> Self {
        ImageOptions {
            width: 224,
            height: 224,
            augmentation: Augmentation::train(0),
            layout: Layout::U8Hwc,
            on_bad: OnBadImage::Error,
            decoders: 3,
            cuda_decoders: 0,
        }
    }
}

impl ImageOptions {
    /// These settings with an output of `height` x `width` pixels.
    pub fn with_size(mut self, height: u32, width: u32) -> Self {
        (self.height, self.width) = (height, width);
        self
    }

    /// These settings with `augmentation`.
    pub fn with_augmentation(mut self, augmentation: Augmentation) -> Self {
        self.augmentation = augmentation;
        self
    }

    /// These settings with `layout`.
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// These settings with `on_bad`.
    pub fn with_on_bad(mut self, on_bad: OnBadImage) -> Self {
        self.on_bad = on_bad;
        self
    }

    /// These settings with `decoders` decode threads (at least 1).
    pub fn with_decoders(mut self, decoders: usize) -> Self {
        self.decoders = decoders.max(1);
        self
    }

    /// These settings with `cuda_decoders` more decode threads on nvJPEG's CUDA decoder
    /// ([`ImageOptions::cuda_decoders`]).
    pub fn with_cuda_decoders(mut self, cuda_decoders: usize) -> Self {
        self.cuda_decoders = cuda_decoders;
        self
    }

    /// Whether the settings are usable (a size of 1 to 16384 pixels a side, the
    /// augmentation's ranges, a non-zero `std`).
    fn check(&self) -> Result<()> {
        if !(1..=16384).contains(&self.width) || !(1..=16384).contains(&self.height) {
            return Err(Error::invalid(format!(
                "an output of {}x{} pixels: give 1 to 16384 a side",
                self.width, self.height
            )));
        }
        if let Layout::F32Chw { std, mean } = self.layout
            && (std.iter().any(|s| *s == 0.0 || !s.is_finite())
                || mean.iter().any(|m| !m.is_finite()))
        {
            return Err(Error::invalid(format!(
                "normalization with mean {mean:?} and std {std:?}: give finite values, std not 0"
            )));
        }
        self.augmentation.check()
    }
}

/// Where an [`ImageBatch`]'s images are.
#[derive(Debug)]
pub enum ImageData {
    /// In the GPU's memory (the loader has a GPU).
    Device(CudaSlice<u8>),
    /// In host memory (no GPU: decoded on the CPU).
    Host(Vec<u8>),
}

/// One batch of an [`ImageLoader`]: its images back to back in `layout`, each `width` x
/// `height`, with their records and labels.
#[derive(Debug)]
pub struct ImageBatch {
    /// The epoch.
    pub epoch: u64,
    /// The batch's number in its epoch.
    pub number: usize,
    /// The record of each image in `data`, in order (the batch's records but those skipped).
    pub indices: Vec<usize>,
    /// Each image's label: its class (an image folder's class folder, a WebDataset sample's
    /// `.cls`), `u32::MAX` where the record has none.
    pub labels: Vec<u32>,
    /// Images left out ([`OnBadImage::Skip`]), with why.
    pub skipped: Vec<SkippedImage>,
    /// Each image's width.
    pub width: u32,
    /// Each image's height.
    pub height: u32,
    /// The layout of `data`.
    pub layout: Layout,
    /// The images (`None` when every image of the batch was skipped).
    pub data: Option<ImageData>,
}

impl ImageBatch {
    /// Images in the batch.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// Whether the batch holds no image (all skipped).
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }
}

/// Batches of decoded, augmented images of an [`ImageFolder`](crate::ImageFolder), a
/// WebDataset tar shard or a [`ShardSet`](crate::ShardSet) of them (each sample's `.jpg` or
/// `.jpeg` member, its label from `.cls`), or any record file whose records are JPEGs: see the
/// module. On a GPU with nvJPEG (its hardware engines where it has them); without one, or
/// without nvJPEG, decoded on the CPU (then uploaded where there is a GPU).
///
/// # Example (no GPU: host batches decoded on the CPU)
/// ```
/// use gpufeed_data::{BatchLoaderOptions, ImageFolder, ImageLoader, ImageOptions, ImageData, Order, Sampler};
/// # let dir = tempfile::tempdir()?;
/// # let jpeg = |w: u16, h: u16| {
/// #     let mut out = Vec::new();
/// #     let rgb: Vec<u8> = (0..w as usize * h as usize * 3).map(|i| (i * 7 % 251) as u8).collect();
/// #     jpeg_encoder::Encoder::new(&mut out, 90).encode(&rgb, w, h, jpeg_encoder::ColorType::Rgb).map(|_| out)
/// # };
/// # for (class, n) in [("cat", 3), ("dog", 2)] {
/// #     std::fs::create_dir(dir.path().join(class))?;
/// #     for i in 0..n { std::fs::write(dir.path().join(class).join(format!("{i}.jpg")), jpeg(40 + i, 30)?)?; }
/// # }
/// let folder = ImageFolder::open(dir.path())?;
/// let cfg = BatchLoaderOptions::default().with_batch_size(4);
/// let opts = ImageOptions::default().with_size(16, 16);
/// let mut loader = ImageLoader::new(folder, Sampler::new(Order::Shuffled { seed: 1 }), cfg, opts, None)?;
/// for batch in loader.epoch(0)? {
///     let batch = batch?;
///     let Some(ImageData::Host(pixels)) = &batch.data else { unreachable!("no GPU given") };
///     assert_eq!(pixels.len(), batch.len() * 16 * 16 * 3); // uint8 [n, 16, 16, 3]
///     println!("labels {:?}", batch.labels);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ImageLoader {
    /// The host batches' loader, while no epoch runs.
    inner: Option<BatchLoader>,
    records: Arc<Dataset>,
    sampler: Sampler,
    opts: ImageOptions,
    gpu: Option<Gpu>,
    /// One per decode thread (GPU), while no epoch runs.
    decoders: Vec<ImageDecoder>,
    /// Why images decode on the CPU, where they do.
    cpu_only: Option<String>,
    timeout: Duration,
    batches: usize,
    /// The stage of a run whose host loader a thread left behind still held when the run
    /// stopped: the next epoch takes the loader back from it.
    abandoned: Option<Arc<Stage>>,
}

impl std::fmt::Debug for ImageLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageLoader")
            .field("records", &self.records.len())
            .field("opts", &self.opts)
            .field("gpu", &self.gpu.is_some())
            .field("cpu_only", &self.cpu_only)
            .finish()
    }
}

impl ImageLoader {
    /// A loader of the images of `records` in `sampler`'s order, batched by `cfg` (its workers
    /// read the files), decoded and augmented as `opts` says on `gpu` (or on the CPU with
    /// `None`).
    ///
    /// # Errors
    /// Settings that are not usable (an empty size, bad ranges, a zero `std`), the
    /// [`BatchLoader`]'s errors, and nvJPEG's other than its absence (which leaves the
    /// decoding to the CPU: [`ImageLoader::cpu_only`]).
    pub fn new(
        records: impl Into<Dataset>,
        sampler: Sampler,
        cfg: BatchLoaderOptions,
        opts: ImageOptions,
        gpu: Option<&Gpu>,
    ) -> Result<Self> {
        opts.check()?;
        let timeout = cfg.batch_timeout;
        // Host batches pinned for the GPU: nvJPEG copies the files' bytes from them at the
        // link's speed (from pageable memory the driver stages them, at a fraction of it).
        let inner = match gpu {
            Some(g) => BatchLoader::new_pinned_host(records, sampler, cfg, g)?,
            None => BatchLoader::new(records, sampler, cfg, None)?,
        };
        let mut loader = ImageLoader {
            records: Arc::clone(&inner.records),
            batches: inner.batches_per_epoch(),
            inner: Some(inner),
            sampler,
            opts,
            gpu: gpu.cloned(),
            decoders: Vec::new(),
            cpu_only: gpu.is_none().then(|| "no GPU was given".to_owned()),
            timeout,
            abandoned: None,
        };
        loader.open_decoders()?;
        Ok(loader)
    }

    /// Opens decoders up to one per decode thread (after a thread lost its own to a panic, a
    /// new one).
    fn open_decoders(&mut self) -> Result<()> {
        let Some(gpu) = &self.gpu else { return Ok(()) };
        let hardware = self.opts.decoders.max(1);
        let wanted = hardware + self.opts.cuda_decoders;
        while self.decoders.len() < wanted {
            // `decoders` on the engines (where the GPU has them), the rest on the CUDA decoder
            // (counted from those kept: a thread lost to a panic is replaced by its kind).
            let on_engines = self
                .decoders
                .iter()
                .filter(|d| d.backend_asked() == gpufeed_cuda::nvjpeg::Backend::Hardware)
                .count();
            let backend = if on_engines < hardware {
                gpufeed_cuda::nvjpeg::Backend::Hardware
            } else {
                gpufeed_cuda::nvjpeg::Backend::Cuda
            };
            let mut decoder = ImageDecoder::open_with(gpu, backend)?;
            // The decode threads share the cores for what they decode on the CPU (every image
            // where nvJPEG is missing), rather than each taking all of them.
            decoder.set_cpu_threads(crate::decode::cores() / wanted);
            if let Some(why) = decoder.cpu_only() {
                self.cpu_only = Some(why.to_owned());
            }
            self.decoders.push(decoder);
        }
        Ok(())
    }

    /// Why images are decoded on the CPU here (no GPU, nvJPEG not installed), or `None` where
    /// nvJPEG decodes them (and the CPU only what it refuses).
    pub fn cpu_only(&self) -> Option<&str> {
        self.cpu_only.as_deref()
    }

    /// Batches in an epoch (this rank's).
    pub fn batches_per_epoch(&self) -> usize {
        self.batches
    }

    /// The data set.
    pub fn dataset(&self) -> &Dataset {
        &self.records
    }

    /// The settings of the images.
    pub fn options(&self) -> &ImageOptions {
        &self.opts
    }

    /// The batches of `epoch`, in order.
    ///
    /// # Errors
    /// [`BatchLoader::epoch`]'s; [`Error::invalid`] where an epoch of this loader still runs
    /// (one left behind by a panic).
    pub fn epoch(&mut self, epoch: u64) -> Result<ImageEpoch<'_>> {
        let run = self.start(epoch, None)?;
        Ok(ImageEpoch { run, loader: self })
    }

    /// The rest of the epoch at `at` (an elastic sampler's [`Position`], maybe saved by a run
    /// with another world size), as [`BatchLoader::resume`] says.
    ///
    /// # Errors
    /// [`BatchLoader::resume`]'s.
    pub fn resume(&mut self, at: &Position) -> Result<ImageEpoch<'_>> {
        let run = self.start(at.epoch, Some(at))?;
        Ok(ImageEpoch { run, loader: self })
    }

    /// The batches of `epoch` (or the rest of the epoch at `at`) in an epoch that owns the
    /// loader ([`OwnedImageEpoch::into_loader`] gives it back).
    ///
    /// # Errors
    /// As [`ImageLoader::epoch`] and [`ImageLoader::resume`], with the loader.
    pub fn into_epoch(
        mut self,
        epoch: u64,
        at: Option<&Position>,
    ) -> std::result::Result<OwnedImageEpoch, Box<(Error, ImageLoader)>> {
        match self.start(at.map_or(epoch, |a| a.epoch), at) {
            Ok(run) => Ok(OwnedImageEpoch { run, loader: self }),
            Err(e) => Err(Box::new((e, self))),
        }
    }

    /// Starts the host batches' epoch and the decode threads.
    fn start(&mut self, epoch: u64, at: Option<&Position>) -> Result<Run> {
        self.open_decoders()?;
        if self.inner.is_none()
            && let Some(stage) = self.abandoned.take()
        {
            // A thread of the last run held the host loader when it stopped; its wait for a
            // host batch ends within the host loader's timeout.
            self.inner = reclaim(&stage, self.timeout);
            if self.inner.is_none() {
                self.abandoned = Some(stage);
            }
        }
        let inner = self.inner.take().ok_or_else(|| {
            Error::invalid(format!(
                "the last epoch's decode threads still hold this image loader ({} ms after it \
                 stopped: a read or a decode that does not return?); try again, or make a new \
                 loader",
                self.timeout.saturating_mul(3).as_millis()
            ))
        })?;
        let started = match at {
            Some(at) => inner.into_resume(at),
            None => inner.into_epoch(epoch),
        };
        let feed = match started {
            Ok(feed) => feed,
            Err(not) => {
                self.inner = Some(*not.loader);
                return Err(not.error);
            }
        };
        let start = at.map_or(0, |a| a.samples);
        let total = feed.size_hint().1.unwrap_or(0);
        let decoders: Vec<Option<ImageDecoder>> = match self.gpu {
            Some(_) => std::mem::take(&mut self.decoders)
                .into_iter()
                .map(Some)
                .collect(),
            // On the CPU: as many decode threads, each on its share of the cores.
            None => (0..self.opts.decoders.max(1)).map(|_| None).collect(),
        };
        // At least one each (set_cpu_threads and per_image_on_threads take at least one).
        let cpu_threads = (crate::decode::cores() / decoders.len().max(1)).max(1);
        let stage = Arc::new(Stage {
            feed: Mutex::new(Feed {
                epoch: Some(feed),
                seq: 0,
            }),
            stop: AtomicBool::new(false),
            allowed: std::sync::atomic::AtomicUsize::new(window(decoders.len())),
            gate: Mutex::new(()),
            moved: parking_lot::Condvar::new(),
        });
        let work = Arc::new(Work {
            records: Arc::clone(&self.records),
            opts: self.opts.clone(),
            epoch,
            cpu_threads,
        });
        // Batches decoded ahead of the consumer are bounded by the stage's window (`admit`);
        // the channel only hands them over.
        let (tx, rx) = mpsc::sync_channel(decoders.len());
        let mut threads = Vec::with_capacity(decoders.len());
        for (i, decoder) in decoders.into_iter().enumerate() {
            let (shared, work, tx) = (Arc::clone(&stage), Arc::clone(&work), tx.clone());
            let gpu = self.gpu.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("gpufeed-decode-{i}"))
                .spawn(move || decode_thread(&shared, &work, &tx, decoder, gpu.as_ref()));
            match spawned {
                Ok(t) => threads.push(t),
                Err(source) => {
                    let mut run = Run::new(epoch, start, total, rx, stage, threads, self.timeout);
                    self.finish(&mut run);
                    return Err(Error::from(gpufeed_load::Error::ThreadStart {
                        what: "an image decode thread",
                        source,
                    }));
                }
            }
        }
        Ok(Run::new(
            epoch,
            start,
            total,
            rx,
            stage,
            threads,
            self.timeout,
        ))
    }

    /// Stops `run`'s threads and takes back the host loader and the decoders.
    fn finish(&mut self, run: &mut Run) {
        let (inner, decoders) = run.stop();
        match inner {
            Some(inner) => self.inner = Some(inner),
            None if self.inner.is_none() => self.abandoned = Some(Arc::clone(&run.stage)),
            None => {}
        }
        self.decoders.extend(decoders);
    }

    fn position(&self, run: &Run) -> Option<Position> {
        self.sampler
            .position_after(self.records.len(), run.epoch, run.start, run.handed)
    }
}

/// The batches of one epoch of an [`ImageLoader`], in order, borrowing it; dropping it stops
/// its threads.
pub struct ImageEpoch<'l> {
    run: Run,
    loader: &'l mut ImageLoader,
}

/// The batches of one epoch of an [`ImageLoader`], in order, owning it
/// ([`ImageLoader::into_epoch`]); `Send`. Dropping it stops its threads.
pub struct OwnedImageEpoch {
    run: Run,
    loader: ImageLoader,
}

// Held by a Python iterator (a pyclass is Send).
const _: () = {
    const fn send<T: Send>() {}
    send::<OwnedImageEpoch>();
    send::<ImageLoader>();
};

impl ImageEpoch<'_> {
    /// Where the run is after the batches yielded so far (an elastic sampler's [`Position`];
    /// `None` for others): save it once the step that used the last batch is done.
    pub fn position(&self) -> Option<Position> {
        self.loader.position(&self.run)
    }
}

impl OwnedImageEpoch {
    /// Where the run is after the batches yielded so far, as [`ImageEpoch::position`] says.
    pub fn position(&self) -> Option<Position> {
        self.loader.position(&self.run)
    }

    /// The loader back, for the next epoch (the threads stop first).
    pub fn into_loader(mut self) -> ImageLoader {
        self.loader.finish(&mut self.run);
        self.loader
    }

    /// The loader.
    pub fn loader(&self) -> &ImageLoader {
        &self.loader
    }
}

impl Drop for ImageEpoch<'_> {
    fn drop(&mut self) {
        self.loader.finish(&mut self.run);
    }
}

impl Iterator for ImageEpoch<'_> {
    type Item = Result<ImageBatch>;

    fn next(&mut self) -> Option<Result<ImageBatch>> {
        self.run.next()
    }
}

impl Iterator for OwnedImageEpoch {
    type Item = Result<ImageBatch>;

    fn next(&mut self) -> Option<Result<ImageBatch>> {
        self.run.next()
    }
}

/// The host batches' epoch, shared by the decode threads: the one holding the lock takes the
/// next batch and its sequence number.
struct Feed {
    epoch: Option<OwnedEpoch>,
    seq: usize,
}

struct Stage {
    feed: Mutex<Feed>,
    stop: AtomicBool,
    /// Sequence numbers below this may be taken: the consumer's next batch plus the window
    /// ([`window`]); a thread waits at the gate for the consumer to move it.
    allowed: std::sync::atomic::AtomicUsize,
    gate: Mutex<()>,
    moved: parking_lot::Condvar,
}

impl Stage {
    /// Waits until sequence number `seq` may be taken (the consumer is within the window of
    /// it), or the run stops: whether it may.
    fn admit(&self, seq: usize) -> bool {
        let mut gate = self.gate.lock();
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return false;
            }
            if seq < self.allowed.load(Ordering::Acquire) {
                return true;
            }
            // Timed: a wake-up lost between the check and the wait costs a few ms at most.
            self.moved.wait_for(&mut gate, Duration::from_millis(5));
        }
    }

    /// The consumer has taken the batches before `next`: up to `next + window` may be taken.
    fn advance(&self, next: usize, window: usize) {
        self.allowed.store(next + window, Ordering::Release);
        let _gate = self.gate.lock();
        self.moved.notify_all();
    }
}

/// Batches decoded ahead of the consumer's at most (being decoded, or done and waiting):
/// two per decode thread, so that each has one in hand and one ready while the consumer works.
fn window(threads: usize) -> usize {
    2 * threads.max(1)
}

/// What a decode thread needs besides its decoder.
struct Work {
    records: Arc<Dataset>,
    opts: ImageOptions,
    epoch: u64,
    /// Threads each decode thread decodes on where it decodes on the CPU (its share of the
    /// cores).
    cpu_threads: usize,
}

type Staged = (usize, Result<ImageBatch>);

/// Whether `e` ends the epoch: the host batches stopped coming (a timeout, stopped workers)
/// or a decode thread panicked. Such an error is not a batch handed out (the position does
/// not count it: a resume reads that batch again).
fn ends_the_epoch(e: &Error) -> bool {
    matches!(
        e,
        Error::BatchTimeout { .. } | Error::WorkersStopped | Error::DecodePanicked { .. }
    )
}

/// A running epoch: the decode threads and the batches they finished out of order.
struct Run {
    epoch: u64,
    start: u64,
    /// Batches handed out (each a batch or its own error), for the position; an error that
    /// ends the epoch hands nothing out.
    handed: usize,
    next: usize,
    total: usize,
    rx: Option<Receiver<Staged>>,
    done: BTreeMap<usize, Result<ImageBatch>>,
    stage: Arc<Stage>,
    threads: Vec<JoinHandle<Option<ImageDecoder>>>,
    timeout: Duration,
}

impl Run {
    fn new(
        epoch: u64,
        start: u64,
        total: usize,
        rx: Receiver<Staged>,
        stage: Arc<Stage>,
        threads: Vec<JoinHandle<Option<ImageDecoder>>>,
        timeout: Duration,
    ) -> Self {
        Run {
            epoch,
            start,
            handed: 0,
            next: 0,
            total,
            rx: Some(rx),
            done: BTreeMap::new(),
            stage,
            threads,
            timeout,
        }
    }

    fn next(&mut self) -> Option<Result<ImageBatch>> {
        if self.next >= self.total {
            return None;
        }
        let rx = self.rx.as_ref()?;
        let t = Instant::now();
        // The host batch's own wait is bounded by the host loader's timeout; its decode by
        // this one.
        let bound = self.timeout.saturating_mul(2);
        let found = loop {
            if let Some(b) = self.done.remove(&self.next) {
                break b;
            }
            match rx.recv_timeout(bound.saturating_sub(t.elapsed())) {
                Ok((seq, b)) => {
                    self.done.insert(seq, b);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let batch = self.next;
                    self.next = self.total;
                    return Some(Err(Error::BatchTimeout {
                        batch,
                        ms: bound.as_millis(),
                    }));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // Every thread ended before this batch came (an epoch-ending error
                    // was handed out already, which set `next` to the end).
                    self.next = self.total;
                    return Some(Err(Error::WorkersStopped));
                }
            }
        };
        match &found {
            Err(e) if ends_the_epoch(e) => self.next = self.total,
            _ => {
                self.next += 1;
                self.handed = self.next;
                self.stage.advance(self.next, window(self.threads.len()));
            }
        }
        Some(found)
    }

    /// Stops the threads (each finishes the batch in hand; one stuck past twice the batch
    /// timeout is left behind) and gives back the host loader (where no thread holds it
    /// still: `None`, and the stage keeps it) and the decoders (once: a second call finds
    /// nothing).
    fn stop(&mut self) -> (Option<BatchLoader>, Vec<ImageDecoder>) {
        self.next = self.total;
        self.stage.stop.store(true, Ordering::Relaxed);
        self.stage.advance(0, 0);
        // A thread blocked sending sees the channel closed.
        drop(self.rx.take());
        self.done.clear();
        let deadline = Instant::now() + self.timeout.saturating_mul(2);
        let mut nap = Duration::from_micros(20);
        while self.threads.iter().any(|t| !t.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
        let mut decoders = Vec::new();
        for t in self.threads.drain(..) {
            if !t.is_finished() {
                tracing::warn!(
                    "an image decode thread is still busy after the timeout; left behind"
                );
                continue;
            }
            match t.join() {
                Ok(Some(d)) => decoders.push(d),
                Ok(None) => {}
                Err(_) => tracing::warn!("an image decode thread panicked: its decoder is lost"),
            }
        }
        (reclaim(&self.stage, Duration::from_millis(100)), decoders)
    }
}

/// The host loader out of `stage`, waiting at most `wait` for a thread left behind that holds
/// it (its wait for a host batch is bounded by the host loader's timeout).
fn reclaim(stage: &Stage, wait: Duration) -> Option<BatchLoader> {
    stage
        .feed
        .try_lock_for(wait)
        .and_then(|mut f| f.epoch.take())
        .map(OwnedEpoch::into_loader)
}

impl Drop for Run {
    fn drop(&mut self) {
        // What `ImageLoader::finish` did not take back is dropped here.
        drop(self.stop());
    }
}

/// A decode thread: takes the next host batch in order (within the consumer's window),
/// decodes and augments it, sends it; ends with the epoch, when stopped, or after a panic
/// (its decoder, which the unwind may have left half-updated, is dropped; the epoch ends),
/// giving its decoder back otherwise.
fn decode_thread(
    stage: &Stage,
    work: &Work,
    tx: &SyncSender<Staged>,
    mut decoder: Option<ImageDecoder>,
    gpu: Option<&Gpu>,
) -> Option<ImageDecoder> {
    if let Some(gpu) = gpu
        && let Err(e) = gpu.context().bind_to_thread()
    {
        tracing::warn!("an image decode thread could not use the GPU's context: {e:?}");
    }
    loop {
        let (seq, host) = {
            let mut feed = stage.feed.lock();
            if !stage.admit(feed.seq) {
                break;
            }
            let Some(epoch) = feed.epoch.as_mut() else {
                break;
            };
            let Some(host) = epoch.next() else { break };
            let seq = feed.seq;
            feed.seq += 1;
            (seq, host)
        };
        if stage.stop.load(Ordering::Relaxed) {
            break;
        }
        let mut panicked = false;
        let made = host.and_then(|b| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                images_of_batch(work, &b, decoder.as_mut())
            }))
            .unwrap_or_else(|p| {
                panicked = true;
                Err(Error::DecodePanicked {
                    batch: b.number,
                    message: crate::gather::panic_message(&*p),
                })
            })
        });
        if tx.send((seq, made)).is_err() || panicked {
            return (!panicked).then_some(decoder).flatten();
        }
    }
    decoder
}

/// The images of host batch `b`, decoded and augmented (on the GPU with `decoder`, else on
/// the CPU).
fn images_of_batch(
    work: &Work,
    b: &Batch,
    decoder: Option<&mut ImageDecoder>,
) -> Result<ImageBatch> {
    let BatchData::Host(buf) = &b.data else {
        return Err(Error::invalid(
            "an image loader's host batch is on the GPU".into(),
        ));
    };
    let opts = &work.opts;
    let ds = &*work.records;
    // Each record's JPEG and label, or why it has none.
    let mut jpegs: Vec<&[u8]> = Vec::with_capacity(b.indices.len());
    let mut from: Vec<usize> = Vec::with_capacity(b.indices.len());
    let mut labels_of: Vec<u32> = Vec::with_capacity(b.indices.len());
    let mut bad: Vec<(usize, ImageError)> = Vec::new();
    for (k, &i) in b.indices.iter().enumerate() {
        let bytes = match (b.offsets.get(k), b.offsets.get(k + 1)) {
            (Some(&lo), Some(&hi)) => buf.get(lo..hi).unwrap_or(&[]),
            _ => &[],
        };
        match image_of(ds, i, bytes) {
            Ok((jpeg, label)) => {
                jpegs.push(jpeg);
                from.push(k);
                labels_of.push(b.labels.get(k).copied().or(label).unwrap_or(u32::MAX));
            }
            Err(e) => bad.push((k, e)),
        }
    }
    let name_of = |k: usize| record_name(ds, b.indices[k]);
    // Where there are records without an image, the decode skips what it cannot decode, so
    // that the policy applies to the first bad record of the batch, whichever step found it.
    let policy = if bad.is_empty() {
        opts.on_bad
    } else {
        OnBadImage::Skip
    };
    let name = |j: usize| name_of(from[j]);
    let record = |j: usize| b.indices[from[j]] as u64;
    let augmentation = opts.augmentation;
    let epoch = work.epoch;
    let choose = |j: usize, w: u32, h: u32| augmentation.choose(epoch, record(j), w, h);
    let (data, kept, skipped) = match decoder {
        Some(decoder) => {
            let mut choose = choose;
            let out = decoder.decode_augmented(
                &jpegs,
                &name,
                policy,
                &mut choose,
                opts.width,
                opts.height,
                opts.layout,
            )?;
            (out.buffer.map(ImageData::Device), out.kept, out.skipped)
        }
        None => {
            let (pixels, kept, skipped) = augment_on_cpu(
                &jpegs,
                &name,
                policy,
                &choose,
                (opts.width, opts.height),
                opts.layout,
                work.cpu_threads,
            )?;
            let data = (!kept.is_empty()).then_some(ImageData::Host(pixels));
            (data, kept, skipped)
        }
    };
    let skipped = if bad.is_empty() {
        skipped
    } else {
        // The decode's skipped images are those it did not keep, in order.
        let mut not_kept = (0..jpegs.len()).filter(|j| kept.binary_search(j).is_err());
        let mut all: Vec<(usize, SkippedImage)> = skipped
            .into_iter()
            .filter_map(|s| not_kept.next().map(|j| (from[j], s)))
            .chain(bad.into_iter().map(|(k, reason)| {
                let name = name_of(k);
                (k, SkippedImage { name, reason })
            }))
            .collect();
        all.sort_by_key(|(k, _)| *k);
        let mut all = all.into_iter().map(|(_, s)| s);
        if opts.on_bad == OnBadImage::Error
            && let Some(first) = all.next()
        {
            return Err(first.reason.named(first.name));
        }
        all.collect()
    };
    Ok(ImageBatch {
        epoch: b.epoch,
        number: b.number,
        indices: kept.iter().map(|&j| b.indices[from[j]]).collect(),
        labels: kept.iter().map(|&j| labels_of[j]).collect(),
        skipped,
        width: opts.width,
        height: opts.height,
        layout: opts.layout,
        data,
    })
}

/// Record `i`'s JPEG within its bytes `bytes` (as a batch holds them: a tar sample's members
/// back to back in the order stored) and its label where the record carries one (a sample's
/// `.cls`); or why it has no image.
fn image_of<'b>(
    ds: &Dataset,
    i: usize,
    bytes: &'b [u8],
) -> std::result::Result<(&'b [u8], Option<u32>), ImageError> {
    let sample = match ds {
        Dataset::Records(r) => r.sample(i),
        Dataset::Shards(s) => s
            .locate(i)
            .and_then(|(f, j)| s.shards().get(f).and_then(|r| r.sample(j))),
        Dataset::Streamed(s) => s.sample(i),
        Dataset::Folder(_) => None,
    };
    let Some(sample) = sample else {
        return Ok((bytes, None));
    };
    let mut at = 0usize;
    // The image: the member named `.jpg`/`.jpeg`, else the one member whose last suffix is
    // (`left.jpg`, or `001.jpg` of a key with dots, as webdataset decodes by the last
    // suffix); the label likewise from `.cls`, else the one member whose last suffix is.
    let (mut exact, mut suffixed) = (None, Vec::new());
    let (mut exact_cls, mut suffixed_cls) = (None, Vec::new());
    for (ext, range) in &sample.members {
        let member = bytes.get(at..at + range.len()).unwrap_or(&[]);
        at += range.len();
        let ext = ext.to_ascii_lowercase();
        let last = ext.rsplit('.').next().unwrap_or("");
        match (ext.as_str(), last) {
            ("jpg" | "jpeg", _) => exact = Some(member),
            (_, "jpg" | "jpeg") => suffixed.push(member),
            ("cls", _) => exact_cls = Some(member),
            (_, "cls") => suffixed_cls.push(member),
            _ => {}
        }
    }
    let members = || {
        sample
            .members
            .iter()
            .map(|(e, _)| format!(".{e}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let cls = match (exact_cls, suffixed_cls.as_slice()) {
        (Some(member), _) | (None, &[member]) => Some(member),
        (None, []) => None,
        (None, _) => {
            return Err(ImageError::Sample {
                reason: format!(
                    "the sample has several class members and none named .cls (its members: \
                     {}): keep one",
                    members()
                ),
            });
        }
    };
    let label = match cls {
        Some(member) => {
            let text = std::str::from_utf8(member).unwrap_or("").trim();
            // u32::MAX is the loader's "no label".
            let parsed = text.parse::<u32>().ok().filter(|&l| l != u32::MAX);
            Some(parsed.ok_or_else(|| ImageError::Sample {
                reason: format!(
                    "its .cls member is not a class number (0 to {}): {:?}",
                    u32::MAX - 1,
                    String::from_utf8_lossy(&member[..member.len().min(32)])
                ),
            })?)
        }
        None => None,
    };
    let image = match (exact, suffixed.as_slice()) {
        (Some(image), _) => image,
        (None, [one]) => one,
        (None, []) => {
            return Err(ImageError::Sample {
                reason: format!(
                    "the sample has no .jpg or .jpeg member (its members: {})",
                    members()
                ),
            });
        }
        (None, _) => {
            return Err(ImageError::Sample {
                reason: format!(
                    "the sample has several JPEG members and none named .jpg or .jpeg (its \
                     members: {})",
                    members()
                ),
            });
        }
    };
    Ok((image, label))
}

/// Record `i`'s name in errors: its file's path, or its tar shard and sample key.
fn record_name(ds: &Dataset, i: usize) -> String {
    let file_record = |r: &crate::RecordFile, j: usize| match r.sample(j) {
        Some(s) => format!("{}:{}", r.path().display(), s.key),
        None => format!("{} record {j}", r.path().display()),
    };
    match ds {
        Dataset::Folder(f) => f
            .files()
            .paths()
            .get(i)
            .map_or_else(|| format!("sample {i}"), |p| p.display().to_string()),
        Dataset::Records(r) => file_record(r, i),
        Dataset::Shards(s) => match s.locate(i).and_then(|(f, j)| Some((s.shards().get(f)?, j))) {
            Some((file, j)) => file_record(file, j),
            None => format!("record {i}"),
        },
        Dataset::Streamed(s) => match (s.locate(i), s.sample(i)) {
            (Some(_), Some(sample)) => format!("{}:{}", s.name_of(i), sample.key),
            (Some((_, j)), None) => format!("{} record {j}", s.name_of(i)),
            (None, _) => format!("record {i}"),
        },
    }
}

/// The host path of [`ImageDecoder::decode_augmented`]: each of `jpegs` decoded on the CPU,
/// cropped and mirrored as `choose(index, width, height)` says, resized to `size` (width,
/// height) by the CPU reference ([`resize_crop`]) and laid out as `layout`, on at most
/// `threads` threads; returns the images back to back, the index of each kept, those skipped.
pub(crate) fn augment_on_cpu(
    jpegs: &[&[u8]],
    name: &(dyn Fn(usize) -> String + Sync),
    policy: OnBadImage,
    choose: &(dyn Fn(usize, u32, u32) -> (Crop, bool) + Sync),
    size: (u32, u32),
    layout: Layout,
    threads: usize,
) -> Result<(Vec<u8>, Vec<usize>, Vec<SkippedImage>)> {
    let (width, height) = size;
    let one = |i: usize| -> std::result::Result<Vec<u8>, ImageError> {
        let image = decode_jpeg(jpegs[i])?;
        let (crop, flip) = choose(i, image.width, image.height);
        let values = resize_crop(
            &image.pixels,
            image.width,
            image.height,
            crop,
            width,
            height,
            flip,
        )
        .map_err(|e| ImageError::Corrupt {
            reason: e.to_string(),
        })?;
        Ok(match layout {
            Layout::U8Hwc => to_u8(&values),
            Layout::F32Chw { mean, std } => normalize_chw(&values, width, height, mean, std)
                .map_err(|e| ImageError::Corrupt {
                    reason: e.to_string(),
                })?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        })
    };
    let results = per_image_on_threads(jpegs.len(), threads, one);
    let mut pixels = Vec::with_capacity(layout.image_bytes(width, height) * jpegs.len());
    let (mut kept, mut skipped) = (Vec::new(), Vec::new());
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(p) => {
                pixels.extend_from_slice(&p);
                kept.push(i);
            }
            Err(e) => match policy {
                OnBadImage::Error => return Err(e.named(name(i))),
                OnBadImage::Skip => skipped.push(SkippedImage {
                    name: name(i),
                    reason: e,
                }),
            },
        }
    }
    Ok((pixels, kept, skipped))
}
