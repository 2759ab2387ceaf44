//! An epoch of batches: [`Epoch`] (borrowing its loader) and [`OwnedEpoch`] (owning it), the
//! batches in a fixed order as each arrives on the GPU.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::gather::{Gathered, Prepared, Shared};
use crate::loader::{Batch, BatchLoader, Position};
use crate::records::Dataset;

/// The batches of one epoch, in order, borrowing its loader; see [`BatchLoader::epoch`]
/// ([`OwnedEpoch`] owns it instead). Dropping it stops its workers.
pub struct Epoch<'l> {
    pub(crate) run: Running,
    pub(crate) loader: &'l mut BatchLoader,
}

/// The batches of one epoch, in order, owning its loader ([`BatchLoader::into_epoch`]): what
/// a caller that cannot hold a borrow keeps (a Python iterator, a struct of its own); `Send`.
/// It yields what the borrowing [`Epoch`] yields, its position included;
/// [`OwnedEpoch::into_loader`] (or dropping it) stops its workers as dropping an [`Epoch`]
/// does, and gives the loader back for the next epoch, its counters kept.
///
/// # Example (host batches)
/// ```
/// use gpufeed_data::{BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler};
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("records.bin");
/// std::fs::write(&path, (0..100u8).collect::<Vec<_>>())?;
/// // SAFETY: the file is not changed while it is used.
/// let records = unsafe { RecordFile::open_fixed(&path, 10)? };
/// let cfg = BatchLoaderOptions::default().with_batch_size(4);
/// let loader = BatchLoader::new(records, Sampler::new(Order::Sequential), cfg, None)?;
/// let mut epoch = loader.into_epoch(0)?; // moved: it can be stored or sent to a thread
/// assert_eq!(epoch.next().transpose()?.map(|b| b.indices), Some(vec![0, 1, 2, 3]));
/// let mut loader = epoch.into_loader(); // mid-epoch: the workers stop
/// assert_eq!(loader.stats().batches, 1);
/// assert_eq!(loader.epoch(1)?.count(), 3);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct OwnedEpoch {
    // Stopped (dropped) before the loader goes.
    pub(crate) run: Running,
    pub(crate) loader: BatchLoader,
}

/// Why [`BatchLoader::into_epoch`] or [`BatchLoader::into_resume`] started no epoch, with the
/// loader given back unchanged; `?` turns it into its [`Error`] (dropping the loader).
#[derive(Debug)]
pub struct NotStarted {
    /// What went wrong: [`BatchLoader::epoch`]'s or [`BatchLoader::resume`]'s error.
    pub error: Error,
    /// The loader.
    pub loader: Box<BatchLoader>,
}

impl std::fmt::Display for NotStarted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for NotStarted {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}

impl From<NotStarted> for Error {
    fn from(n: NotStarted) -> Self {
        n.error
    }
}

// Held by a Python iterator (a pyclass is Send) and moved between threads.
const _: () = {
    const fn send<T: Send>() {}
    send::<OwnedEpoch>();
    send::<NotStarted>();
};

/// A running epoch apart from its loader (borrowed by [`Epoch`], owned by [`OwnedEpoch`]):
/// its jobs, the batches prepared out of order, the workers. Dropping it stops them.
pub(crate) struct Running {
    pub(crate) epoch: u64,
    /// Samples of the global order before this epoch's first batch (a resume point).
    pub(crate) start: u64,
    /// Batches handed out (each a batch or its own error), for [`Epoch::position`]; an error
    /// that ends the epoch early (a timeout, stopped workers) hands nothing out.
    pub(crate) handed: usize,
    pub(crate) next: usize,
    pub(crate) total: usize,
    pub(crate) pending: VecDeque<(usize, Vec<usize>)>,
    pub(crate) done: BTreeMap<usize, Result<Gathered>>,
    pub(crate) rx: Receiver<Prepared>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) workers: Vec<JoinHandle<()>>,
    /// The loader's batch timeout (its settings do not change while an epoch runs).
    pub(crate) timeout: Duration,
    /// Streamed shards' fetching for this epoch.
    pub(crate) stream: Option<crate::stream::StreamRun>,
    /// The loader's kept batch memory: open while this epoch runs.
    pub(crate) memory: Arc<crate::device_batch::BatchMemory>,
}

impl Running {
    fn next(&mut self, loader: &mut BatchLoader) -> Option<Result<Batch>> {
        if self.next >= self.total {
            return None;
        }
        let t = Instant::now();
        let timeout = self.timeout;
        // The timeout counts from here, or from the last time streamed shards were still
        // arriving: a slow fetch is not a stuck worker (its requests have timeouts of their
        // own, and a fetch that fails fails its batches).
        let mut since = t;
        let prepared = loop {
            if let Some(p) = self.done.remove(&self.next) {
                break p;
            }
            match self
                .rx
                .recv_timeout(timeout.saturating_sub(since.elapsed()))
            {
                Ok((n, r)) => {
                    self.done.insert(n, r);
                }
                Err(mpsc::RecvTimeoutError::Timeout)
                    if self.stream.as_ref().is_some_and(|s| s.fetching()) =>
                {
                    since = Instant::now();
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let batch = self.next;
                    self.next = self.total;
                    return Some(Err(Error::BatchTimeout {
                        batch,
                        ms: timeout.as_millis(),
                    }));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    self.next = self.total;
                    return Some(Err(Error::WorkersStopped));
                }
            }
        };
        // Keep `prefetch` batches in preparation.
        if let Some(job) = self.pending.pop_front() {
            self.shared.queue.lock().jobs.push_back(job);
            self.shared.ready.notify_one();
        }
        let number = self.next;
        self.next += 1;
        // A batch is handed out once its bytes are on the GPU.
        let prepared = prepared.and_then(|(indices, offsets, data, upload_s, done)| {
            if let Some(ev) = done {
                let copy = Instant::now();
                let synced = ev.synchronize();
                loader.stats.copy_waited_s += copy.elapsed().as_secs_f64();
                synced.map_err(|e| gpufeed_cuda::Error::Cuda {
                    op: "cuEventSynchronize",
                    result: e.0,
                })?;
                loader.memory.event_back(ev);
            }
            Ok((indices, offsets, data, upload_s))
        });
        loader.stats.waited_s += t.elapsed().as_secs_f64();
        let (indices, offsets, data, upload_s) = match prepared {
            Ok(p) => p,
            Err(e) => {
                if matches!(e, Error::Transform { panicked: true, .. }) {
                    // A panic is a bug in user code: the epoch ends here.
                    self.next = self.total;
                } else {
                    self.handed = number + 1;
                }
                return Some(Err(e));
            }
        };
        let bytes = *offsets.last().unwrap_or(&0);
        loader.stats.upload_s += upload_s;
        loader.stats.direct_reads = loader.direct.reads.load(Ordering::Relaxed);
        loader.stats.direct_read_bytes = loader.direct.bytes.load(Ordering::Relaxed);
        if let Some(g) = &loader.gpu_gather {
            loader.stats.gpu_gathered_batches = g.gathered.load(Ordering::Relaxed);
        }
        loader.stats.kept_memory_batches = loader.memory.reused();
        loader.stats.batches += 1;
        loader.stats.bytes += bytes as u64;
        let labels = match &*loader.records {
            Dataset::Folder(f) => indices
                .iter()
                .map(|&i| f.labels().get(i).copied().unwrap_or(u32::MAX))
                .collect(),
            Dataset::Records(_) | Dataset::Shards(_) | Dataset::Streamed(_) => Vec::new(),
        };
        self.handed = number + 1;
        Some(Ok(Batch {
            epoch: self.epoch,
            number: number + self.first_number(loader),
            indices,
            offsets,
            labels,
            data,
        }))
    }

    /// The number of this epoch's first batch: the steps a resumed epoch skipped.
    fn first_number(&self, loader: &BatchLoader) -> usize {
        match loader.sampler.global_batch {
            Some(g) => (self.start / g as u64) as usize,
            None => 0,
        }
    }

    fn position(&self, loader: &BatchLoader) -> Option<Position> {
        loader
            .sampler
            .position_after(loader.records.len(), self.epoch, self.start, self.handed)
    }

    /// Batches left to yield (a batch or its error each), at most.
    fn left(&self) -> usize {
        self.total - self.next
    }
}

impl Iterator for Epoch<'_> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        self.run.next(self.loader)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.run.left()))
    }
}

impl Iterator for OwnedEpoch {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        self.run.next(&mut self.loader)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.run.left()))
    }
}

impl Epoch<'_> {
    /// Where the run is after the batches yielded so far (an elastic sampler's; `None` for
    /// others): save it once the step that used the last batch is done, resume from it with
    /// [`BatchLoader::resume`]. After the epoch's last batch it is the start of the next epoch.
    pub fn position(&self) -> Option<Position> {
        self.run.position(self.loader)
    }
}

impl OwnedEpoch {
    /// Where the run is after the batches yielded so far, as [`Epoch::position`] says.
    pub fn position(&self) -> Option<Position> {
        self.run.position(&self.loader)
    }

    /// The epoch's number.
    pub fn epoch(&self) -> u64 {
        self.run.epoch
    }

    /// The loader (its counters so far, its batches per epoch).
    pub fn loader(&self) -> &BatchLoader {
        &self.loader
    }

    /// The loader back, for the next epoch: the workers stop first, as when an [`Epoch`] is
    /// dropped (those still busy finish their batch; one stuck past the batch timeout is left
    /// behind).
    pub fn into_loader(self) -> BatchLoader {
        let OwnedEpoch { run, loader } = self;
        drop(run);
        loader
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.shared.queue.lock().stop = true;
        self.shared.ready.notify_all();
        // Wakes the workers waiting for shards.
        if let Some(stream) = &mut self.stream {
            stream.stop();
        }
        // Workers finish the batch in hand; one stuck in a transform that never returns is
        // left behind after the batch timeout (it owns everything it uses) rather than
        // blocking the caller forever.
        let deadline = Instant::now() + self.timeout;
        // Polled from 20 us up to 1 ms: workers between batches stop within microseconds, and
        // an epoch's end should not cost a whole millisecond.
        let mut nap = Duration::from_micros(20);
        while self.workers.iter().any(|w| !w.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
        for w in self.workers.drain(..) {
            if w.is_finished() {
                let _ = w.join();
            } else {
                tracing::warn!("a batch worker is still busy after the batch timeout; left behind");
            }
        }
        // The kept batch memory is freed; batches dropped from now on (the ones prepared and
        // not handed out, with this state; the caller's) are freed too.
        self.memory.close();
    }
}
