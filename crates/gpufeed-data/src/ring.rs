//! Batches prepared by worker processes: they gather records into the slots of a
//! [`BatchRing`], the training process takes them in order and uploads them
//! straight from the registered shared memory. Start the workers however your launcher does
//! (each calls [`produce_epoch`] for its share); the consumer is a [`RingLoader`].
//!
//! Slot layout: `"GFB2" | records u32 | epoch u64 | number u64 | data bytes u64 | worker u32 |
//! workers u32 | offsets (records + 1) x u64 | record indices (records) x u64 | data at the next
//! 256-byte boundary` (the worker that wrote it and how many share the epoch: batch `number` is
//! worker `number % workers`'s).
//!
//! # Back-pressure
//! The loader publishes in the ring's header ([`gpufeed_ipc::Watermark`]) the epoch it reads,
//! the batch it waits for (`next`) and its window `W` ([`RingLoader::with_window`]); a worker
//! transforms batch `n`, and claims a slot for it, only once `n <= next + W` (between epochs:
//! `n <= W`). So a worker that is faster than another waits for the loader instead of filling
//! the ring with batches it cannot take yet (see [`RingLoader`] for the invariant).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpufeed_cuda::{DeviceAlloc, Gpu, HostSource, TransferOptions, TransferScheduler};
use gpufeed_ipc::{BatchRing, Claim, Consumer, Watermark};
use gpufeed_pinned::{HostRegistration, PinnedPool, PoolMode, PoolOptions};

use crate::error::{Error, Result};
use crate::{Batch, BatchData, BatchLoaderOptions, RecordFile, Sampler, Transform};

const MAGIC: &[u8; 4] = b"GFB2";
const HEADER: usize = 40;

/// The batches (number, record indices) of `epoch`, as [`crate::BatchLoader`] makes
/// them.
pub fn epoch_batches(
    records: usize,
    sampler: &Sampler,
    cfg: &BatchLoaderOptions,
    epoch: u64,
) -> Vec<(usize, Vec<usize>)> {
    // An elastic sampler sets the batch (its per-rank share of a step), as in `BatchLoader`.
    let (batch, drop_last) = sampler.batching(cfg);
    sampler
        .epoch(records, epoch)
        .chunks(batch.max(1))
        .filter(|c| !drop_last || c.len() == batch)
        .map(<[usize]>::to_vec)
        .enumerate()
        .collect()
}

/// Bytes of a slot's header for `records` records (before rounding to the data's alignment).
fn header_len(records: usize) -> usize {
    HEADER + 8 * (2 * records + 1)
}

/// Where a slot's data starts for `records` records: after the header, 256-byte aligned.
pub fn data_offset(records: usize) -> usize {
    header_len(records).next_multiple_of(256)
}

/// A slot's header (see the module's layout) for batch `number` of `epoch` from a ring's only
/// producer (worker 0 of 1): its records' `indices`, their data's `offsets` (one more than the
/// records, from 0 to the data's length).
pub fn slot_header(epoch: u64, number: usize, indices: &[usize], offsets: &[u64]) -> Vec<u8> {
    slot_header_of(epoch, number, (0, 1), indices, offsets)
}

/// [`slot_header`] for worker `worker` of `workers` (`(worker, workers)`).
fn slot_header_of(
    epoch: u64,
    number: usize,
    (worker, workers): (usize, usize),
    indices: &[usize],
    offsets: &[u64],
) -> Vec<u8> {
    let mut header = Vec::with_capacity(data_offset(indices.len()));
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&(indices.len() as u32).to_le_bytes());
    header.extend_from_slice(&epoch.to_le_bytes());
    header.extend_from_slice(&(number as u64).to_le_bytes());
    header.extend_from_slice(&offsets.last().copied().unwrap_or(0).to_le_bytes());
    header.extend_from_slice(&(worker as u32).to_le_bytes());
    header.extend_from_slice(&(workers as u32).to_le_bytes());
    for o in offsets {
        header.extend_from_slice(&o.to_le_bytes());
    }
    for &i in indices {
        header.extend_from_slice(&(i as u64).to_le_bytes());
    }
    header
}

/// Which share of which epoch one worker process produces ([`produce_epoch`]).
#[derive(Clone)]
#[non_exhaustive]
pub struct WorkerShare<'a> {
    /// The epoch.
    pub epoch: u64,
    /// This worker's number, below `workers`.
    pub worker: usize,
    /// Worker processes in all.
    pub workers: usize,
    /// Applied to every record (none: records as they are).
    pub transform: Option<&'a Transform>,
    /// Longest wait for a free slot, and for the trainer's loader to come within its window
    /// of a batch (each wait; default 60 s).
    pub timeout: Duration,
}

impl<'a> WorkerShare<'a> {
    /// Worker `worker` of `workers` in `epoch`, records untransformed, 60 s per wait.
    pub fn new(epoch: u64, worker: usize, workers: usize) -> Self {
        WorkerShare {
            epoch,
            worker,
            workers,
            transform: None,
            timeout: Duration::from_secs(60),
        }
    }

    /// This share with `transform` applied to every record.
    pub fn with_transform(mut self, transform: &'a Transform) -> Self {
        self.transform = Some(transform);
        self
    }

    /// This share waiting at most `timeout` for each free slot, and for the loader to come
    /// within its window of each batch.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// Writes one worker's share of an epoch's batches — numbers `worker, worker + workers, ...` —
/// into `ring` (from the worker's own process). Returns how many it wrote.
///
/// Before transforming a batch, and again once it has a slot for it, the worker waits until
/// the trainer's [`RingLoader`] is within its window of the batch (the watermark it publishes
/// in the ring: see the module's back-pressure section); a ring that no `RingLoader` paces
/// is not waited on.
///
/// It does not register the worker as the ring's producer: workers may be started per epoch.
/// A worker that lives for the whole run can hold [`BatchRing::producer`] around its loop, so
/// that the trainer's [`RingLoader`] gets `ProducerGone` at once when every worker is gone.
///
/// # Errors
/// A batch larger than a slot ([`gpufeed_ipc::Error::TooLarge`]: make the slots larger), a
/// failing transform, ring errors (`ConsumerGone` when the trainer died or dropped its loader,
/// also while the worker waits for its turn), [`Error::RingWorkerHeldBack`] when the loader did
/// not come within its window of a batch within the timeout or ended the epoch first,
/// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for a worker number not below `workers`.
pub fn produce_epoch(
    ring: &BatchRing,
    records: &RecordFile,
    sampler: &Sampler,
    cfg: &BatchLoaderOptions,
    share: &WorkerShare<'_>,
) -> Result<usize> {
    let WorkerShare {
        epoch,
        worker,
        workers,
        transform,
        timeout,
    } = *share;
    if workers == 0 || worker >= workers || u32::try_from(workers).is_err() {
        return Err(Error::invalid(format!(
            "worker {worker} of {workers}: workers must be at least 1 (and fit a u32), and \
             worker below it"
        )));
    }
    let mut written = 0;
    let mut out = Vec::new();
    let mut turn = Turn {
        epoch,
        worker,
        number: 0,
        seen: false,
    };
    for (number, indices) in epoch_batches(records.len(), sampler, cfg, epoch)
        .into_iter()
        .skip(worker)
        .step_by(workers)
    {
        turn.number = number;
        // Before transforming: a batch past the loader's window costs no memory or work yet.
        turn.wait(ring, timeout)?;
        let parts = |i: usize| {
            records.parts(i).ok_or_else(|| Error::Records {
                path: records.path().into(),
                reason: format!("record {i} does not exist"),
            })
        };
        // Offsets first (transform output sizes are known only after transforming).
        out.clear();
        let mut offsets = Vec::with_capacity(indices.len() + 1);
        offsets.push(0u64);
        let mut joined = Vec::new();
        for &i in &indices {
            let p = parts(i)?;
            match transform {
                Some(f) => {
                    let record = crate::gather::contiguous(&p, &mut joined);
                    crate::gather::run_transform(f, i, record, &mut out)?;
                }
                None => p.iter().for_each(|m| out.extend_from_slice(m)),
            }
            offsets.push(out.len() as u64);
        }
        let at = data_offset(indices.len());
        let mut claim = turn.claim(ring, timeout)?;
        let header = slot_header_of(epoch, number, (worker, workers), &indices, &offsets);
        claim.write_at(0, &header)?;
        claim.write_at(at as u64, &out)?;
        claim.set_len((at + out.len()) as u64)?;
        claim.publish()?;
        written += 1;
    }
    Ok(written)
}

/// What a worker may do with its batch under the loader's watermark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pace {
    /// Produce it: within the window, or nobody paces the ring.
    Go,
    /// Wait for the loader to come nearer (or to begin this epoch).
    Wait,
    /// The loader ended this epoch, or went on to another, after the worker saw it read it.
    Ended,
}

/// One worker's batch and what it saw of the loader's watermark.
struct Turn {
    epoch: u64,
    worker: usize,
    number: usize,
    /// Whether the loader was seen reading this epoch.
    seen: bool,
}

impl Turn {
    /// What the worker may do with its batch under `w` (a hint from the trainer's process:
    /// it decides waits, nothing else). Unpaced (no `RingLoader` published a window): go.
    /// Reading this epoch: go once `number <= position + window`. Between epochs (as at its
    /// start, position 0): the same bound, unless this epoch was seen and so has ended.
    /// Reading another epoch: wait for this one, or, seen before, it has ended.
    fn pace(&mut self, w: &Watermark) -> Pace {
        let Some(limit) = w.limit() else {
            return Pace::Go;
        };
        let within = if self.number as u64 <= limit {
            Pace::Go
        } else {
            Pace::Wait
        };
        match w.round {
            Some(r) if r == self.epoch => {
                self.seen = true;
                within
            }
            _ if self.seen => Pace::Ended,
            None => within,
            Some(_) => Pace::Wait,
        }
    }

    /// Waits until the worker may produce its batch, up to `timeout`.
    fn wait(&mut self, ring: &BatchRing, timeout: Duration) -> Result<()> {
        let since = Instant::now();
        let (mut last, mut pace) = (Watermark::default(), Pace::Wait);
        let waited = ring.wait_watermark(
            |w| {
                (last, pace) = (*w, self.pace(w));
                pace != Pace::Wait
            },
            timeout,
        );
        let held_back = |ended| Error::RingWorkerHeldBack {
            epoch: self.epoch,
            batch: self.number,
            worker: self.worker,
            reading: last.round,
            position: last.position,
            window: last.window.unwrap_or(0),
            ms: since.elapsed().as_millis(),
            ended,
        };
        match waited {
            Ok(_) if pace == Pace::Ended => Err(held_back(true)),
            Ok(_) => Ok(()),
            Err(gpufeed_ipc::Error::Timeout { .. }) => Err(held_back(false)),
            Err(e) => Err(e.into()),
        }
    }

    /// Claims a slot for the batch, each wait up to `timeout`, once the worker may produce
    /// it: looked at again after the claim, since the loader may have begun pacing the ring
    /// (or narrowed its window) while the worker transformed or waited for the slot; then
    /// the slot is given back and the worker waits for its turn first.
    fn claim<'r>(&mut self, ring: &'r BatchRing, timeout: Duration) -> Result<Claim<'r>> {
        loop {
            let claim = ring.claim(timeout)?;
            if self.pace(&ring.watermark()) == Pace::Go {
                return Ok(claim);
            }
            drop(claim);
            self.wait(ring, timeout)?;
        }
    }
}

/// A slot's header, read and checked.
#[derive(Debug)]
struct SlotHeader {
    epoch: u64,
    number: usize,
    /// The worker that wrote it, and how many share the epoch.
    worker: usize,
    workers: usize,
    /// Where the data starts in the slot.
    at: usize,
    /// Each record's start in the data, then the end of the last.
    offsets: Vec<usize>,
    indices: Vec<usize>,
}

/// Reads a slot's header, treating the bytes as untrusted (another process wrote them).
fn parse_slot(head: &[u8], slot_len: u64) -> Result<SlotHeader> {
    let bad = |why: &str| Error::MalformedBatch {
        reason: format!("its slot is malformed: {why}"),
    };
    if head.len() < HEADER || &head[..4] != MAGIC {
        return Err(bad(
            "bad magic (not a batch, or one written by another version of gpufeed)",
        ));
    }
    let u64_at = |o: usize| u64::from_le_bytes(head[o..o + 8].try_into().expect("8 bytes"));
    let u32_at = |o: usize| u32::from_le_bytes(head[o..o + 4].try_into().expect("4 bytes"));
    let count = u32_at(4) as usize;
    if head.len() < header_len(count) {
        return Err(bad("header shorter than its record count"));
    }
    let (epoch, number, data_len) = (u64_at(8), u64_at(16), u64_at(24));
    let (worker, workers) = (u32_at(32) as usize, u32_at(36) as usize);
    let number = usize::try_from(number).map_err(|_| bad("a batch number past usize"))?;
    if workers == 0 || number % workers != worker {
        return Err(bad(&format!(
            "batch {number} says it is worker {worker}'s of {workers}, whose batches are those \
             of numbers {worker} mod {workers}"
        )));
    }
    let at = data_offset(count);
    if (at as u64)
        .checked_add(data_len)
        .is_none_or(|end| end > slot_len)
    {
        return Err(bad("lengths exceed the slot"));
    }
    // Each offset is at most `data_len`, which fits the slot (checked above), so a usize.
    let offsets: Vec<u64> = (0..=count).map(|k| u64_at(HEADER + 8 * k)).collect();
    if offsets[0] != 0 || offsets.windows(2).any(|w| w[1] < w[0]) || offsets[count] != data_len {
        return Err(bad("offsets out of order"));
    }
    let offsets = offsets.into_iter().map(|o| o as usize).collect();
    let indices = (0..count)
        .map(|k| u64_at(HEADER + 8 * (count + 1 + k)) as usize)
        .collect();
    Ok(SlotHeader {
        epoch,
        number,
        worker,
        workers,
        at,
        offsets,
        indices,
    })
}

/// The training side of worker processes: takes their batches from the ring in batch order
/// and uploads each from the registered shared memory (no staging copy), or hands out host
/// copies without a GPU.
///
/// # Back-pressure and the window
/// The loader publishes in the ring which epoch it reads, the batch it waits for (`next`, from
/// the epoch's start and after each batch it hands out) and its window `W`
/// ([`RingLoader::window`]); [`produce_epoch`] transforms batch `n`, and claims a slot for it,
/// only once `n <= next + W`. The invariant: every batch that a worker produced so, in the
/// ring or held by the loader, other than `next` itself, lies in `next + 1 ..= next + W` (it
/// was below an earlier `next + W`, and batches below `next` were handed out): at most `W`,
/// so the loader holds at most `W` batches ahead of their turn, each moved out of the ring
/// (to the GPU, or a pooled host buffer: at most a slot's bytes each) as soon as it is taken,
/// and never has to leave one in its slot: the slots keep going back to the workers, and
/// the worker of `next` always gets one. So a worker that is slower than the others holds
/// them back (they wait for the loader) and the epoch completes; a window below the ring's
/// slots leaves slots unused (0: workers produce only the batch the loader waits for).
///
/// A hung or stopped worker holds the others at `W` batches ahead (they transform nothing
/// past it), the loader waits the epoch's timeout for its batch and ends the epoch with
/// [`Error::RingBatchMissing`] naming it and its worker; the workers waiting for their turn
/// then stop with [`Error::RingWorkerHeldBack`] (the epoch ended).
///
/// Batches that come before their turn without having waited — workers that checked before
/// the loader existed or published its window, or producers that do not pace themselves —
/// are handled as before: at most `W` moved out, the others left in their ring slots, taking
/// no more memory, until their turn; once every slot holds a later batch, no worker can
/// publish the one needed and the epoch ends at once with [`Error::RingBatchMissing`]
/// (stalled).
pub struct RingLoader<'r> {
    ring: &'r BatchRing,
    consumer: Consumer<'r>,
    gpu: Option<(Gpu, TransferScheduler)>,
    registration: Option<HostRegistration<'r>>,
    pool: PinnedPool,
    window: usize,
    /// Slower paths taken, with reasons.
    pub notes: Vec<String>,
}

impl std::fmt::Debug for RingLoader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingLoader")
            .field("slots", &self.ring.slots())
            .field("window", &self.window)
            .field("gpu", &self.gpu.is_some())
            .field("registered", &self.registration.is_some())
            .finish()
    }
}

/// The default window of a [`RingLoader`], in rings' worth of batches.
const WINDOW_RINGS: usize = 4;

/// The watermark of a loader of window `window` reading `round` (`None`: between epochs)
/// and waiting for batch `position` (0 between epochs).
fn watermark(window: usize, round: Option<u64>, position: usize) -> Watermark {
    Watermark {
        window: Some(window as u64),
        round,
        position: position as u64,
    }
}

impl<'r> RingLoader<'r> {
    /// Registers as the ring's consumer and, with a GPU, registers the ring's memory with CUDA.
    /// Its window is four times the ring's slots ([`RingLoader::with_window`]), published in
    /// the ring at once (between epochs: workers may produce batches 0 to the window).
    pub fn new(ring: &'r BatchRing, gpu: Option<&Gpu>) -> Result<Self> {
        let consumer = ring.consumer()?;
        let window = WINDOW_RINGS * ring.slots() as usize;
        consumer.publish_watermark(watermark(window, None, 0))?;
        let mut notes = Vec::new();
        let (gpu, registration, pool) = match gpu {
            Some(g) => {
                let registration = match HostRegistration::shm(g.context(), ring.segment()) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        notes.push(format!(
                            "the ring could not be registered with CUDA ({e}); batches are staged"
                        ));
                        None
                    }
                };
                let pool =
                    PinnedPool::new(PoolMode::Cuda(g.context().clone()), PoolOptions::default())?;
                (
                    Some((
                        g.clone(),
                        TransferScheduler::new(g, TransferOptions::default())?,
                    )),
                    registration,
                    pool,
                )
            }
            None => (
                None,
                None,
                PinnedPool::new(PoolMode::Cpu, PoolOptions::default())?,
            ),
        };
        Ok(RingLoader {
            ring,
            consumer,
            gpu,
            registration,
            pool,
            window,
            notes,
        })
    }

    /// This loader letting workers run at most `batches` batches ahead of the one it waits
    /// for, and holding (moving out of the ring) at most that many ahead of their turn (0:
    /// workers produce only the batch it waits for). Set it between epochs: it is published
    /// in the ring at once. A larger window lets workers differ more in speed before the fast
    /// ones wait for the slow one, at up to a slot's bytes of memory (GPU memory with a GPU)
    /// per batch; one below the ring's slots leaves slots unused.
    pub fn with_window(mut self, batches: usize) -> Self {
        self.window = batches;
        // An error here (this process forked or detached) is the next take's too.
        let _ = self.consumer.publish_watermark(watermark(batches, None, 0));
        self
    }

    /// How far ahead of the batch it waits for workers may run, and the most batches held
    /// ahead of their turn (default: four times the ring's slots).
    pub fn window(&self) -> usize {
        self.window
    }

    /// The `batches` batches of `epoch`, in batch order, each waited for up to `timeout`.
    ///
    /// An item is an error for a batch not there within `timeout`, or once every slot of the
    /// ring holds a later batch so that it cannot come ([`Error::RingBatchMissing`], naming the
    /// batch and its worker); at once ([`gpufeed_ipc::Error::ProducerGone`]) when the ring's
    /// registered producer (a `gpufeed_frames::hybrid::Fanout`) is gone with nothing left to take; a
    /// slot that is not a batch of this layout and epoch, or a batch number that comes twice
    /// ([`Error::MalformedBatch`]); or the upload's. An error ends the epoch and releases the
    /// batches held.
    ///
    /// The epoch, and then each batch it waits for, is published in the ring for the workers
    /// (see the back-pressure section above); once it ends (its last batch handed out, an
    /// error, or the iterator dropped) the ring says "between epochs" again, and workers still
    /// waiting for a turn in it stop.
    pub fn epoch(&mut self, epoch: u64, batches: usize, timeout: Duration) -> RingEpoch<'_, 'r> {
        let begun = self
            .consumer
            .publish_watermark(watermark(self.window, Some(epoch), 0));
        RingEpoch {
            loader: self,
            epoch,
            batches,
            timeout,
            next: 0,
            held: BTreeMap::new(),
            parked: BTreeMap::new(),
            workers: None,
            failed: begun.err().map(Error::from),
            closed: false,
        }
    }

    /// Takes one slot from the ring and reads its header (the slot stays taken).
    fn take_slot(
        &self,
        epoch: u64,
        timeout: Duration,
    ) -> Result<(gpufeed_ipc::Batch<'r>, SlotHeader)> {
        let slot = self.consumer.next(timeout)?;
        let mut fixed = [0u8; HEADER];
        if slot.len() < HEADER as u64 {
            return Err(Error::MalformedBatch {
                reason: "its slot is shorter than its header".into(),
            });
        }
        slot.read_at(0, &mut fixed)?;
        let count = u32::from_le_bytes(fixed[4..8].try_into().expect("4 bytes")) as usize;
        let need = header_len(count);
        if need as u64 > slot.len() {
            return Err(Error::MalformedBatch {
                reason: "its header exceeds the slot".into(),
            });
        }
        let mut head = vec![0u8; need];
        slot.read_at(0, &mut head)?;
        let header = parse_slot(&head, slot.len())?;
        if header.epoch != epoch {
            return Err(Error::MalformedBatch {
                reason: format!(
                    "a worker produced epoch {} while epoch {epoch} is read",
                    header.epoch
                ),
            });
        }
        Ok((slot, header))
    }

    /// Moves a taken slot's batch out (to the GPU, or a pooled host buffer), releasing the
    /// slot.
    fn move_out(&self, slot: gpufeed_ipc::Batch<'r>, header: SlotHeader) -> Result<Batch> {
        let SlotHeader {
            epoch,
            number,
            at,
            offsets,
            indices,
            ..
        } = header;
        let len = *offsets.last().expect("count + 1 offsets");
        let data = match (&self.gpu, &self.registration) {
            (Some((gpu, sched)), Some(reg)) if len > 0 => {
                let src = HostSource::RegisteredRange {
                    registration: reg,
                    offset: slot.offset_in_segment() as usize + at,
                    len,
                };
                BatchData::Device(sched.upload_new(src, DeviceAlloc::Pool)?.0)
            }
            _ => {
                let mut buf = self.pool.get(len.max(1))?;
                buf.set_len(len);
                slot.read_at(at as u64, &mut buf)?;
                match &self.gpu {
                    Some((_, sched)) if len > 0 => BatchData::Device(
                        sched
                            .upload_new(HostSource::Pooled(&buf), DeviceAlloc::Pool)?
                            .0,
                    ),
                    _ => BatchData::Host(buf),
                }
            }
        };
        drop(slot); // the slot goes back to the workers
        Ok(Batch {
            epoch,
            number,
            indices,
            offsets,
            labels: Vec::new(),
            data,
        })
    }
}

/// The batches of one epoch from a [`RingLoader`], in batch order ([`RingLoader::epoch`]).
pub struct RingEpoch<'l, 'r> {
    loader: &'l mut RingLoader<'r>,
    epoch: u64,
    batches: usize,
    timeout: Duration,
    /// The batch handed out next.
    next: usize,
    /// Later batches moved out of the ring (at most the loader's window).
    held: BTreeMap<usize, Batch>,
    /// Later batches left in their ring slots, past the window.
    parked: BTreeMap<usize, (gpufeed_ipc::Batch<'r>, SlotHeader)>,
    /// Workers sharing the epoch, as the first slot said.
    workers: Option<usize>,
    /// An error of moving a parked batch out or of publishing the watermark, for the next
    /// call.
    failed: Option<Error>,
    /// Whether the ring says "between epochs" again.
    closed: bool,
}

impl std::fmt::Debug for RingEpoch<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingEpoch")
            .field("epoch", &self.epoch)
            .field("next", &self.next)
            .field("batches", &self.batches)
            .field("held", &self.held.len())
            .field("parked", &self.parked.len())
            .finish()
    }
}

impl RingEpoch<'_, '_> {
    /// Batches that came ahead of their turn and wait in the loader: moved out of the ring (at
    /// most its window) or in their slots.
    pub fn held(&self) -> usize {
        self.held.len() + self.parked.len()
    }

    /// Bytes of the batches moved out of the ring ahead of their turn (host or GPU memory).
    pub fn held_bytes(&self) -> usize {
        self.held.values().map(Batch::bytes).sum()
    }

    /// Ends the epoch at `e`, releasing what it holds.
    fn end(&mut self, e: Error) -> Error {
        self.next = self.batches;
        self.held.clear();
        self.parked.clear();
        self.close();
        e
    }

    /// Publishes "between epochs" (once): the workers of this epoch still waiting stop.
    fn close(&mut self) {
        if !self.closed {
            self.closed = true;
            let window = self.loader.window;
            // An error here (this process forked or detached) leaves nothing to close.
            let _ = self
                .loader
                .consumer
                .publish_watermark(watermark(window, None, 0));
        }
    }

    /// The error for batch `want`, waited for since `since`.
    fn missing(&self, want: usize, since: Instant, stalled: bool) -> Error {
        Error::RingBatchMissing {
            batch: want,
            worker: self.workers.map(|n| want % n),
            workers: self.workers,
            held: self.held(),
            ms: since.elapsed().as_millis(),
            stalled,
        }
    }

    /// Checks a taken slot's batch against the epoch: a number in range, not seen before, of
    /// as many workers as the others.
    fn check(&mut self, h: &SlotHeader) -> Result<()> {
        let bad = |reason: String| Err(Error::MalformedBatch { reason });
        if h.number >= self.batches {
            return bad(format!(
                "batch number {} beyond the epoch's {}",
                h.number, self.batches
            ));
        }
        if h.number < self.next
            || self.held.contains_key(&h.number)
            || self.parked.contains_key(&h.number)
        {
            return bad(format!("batch {} came twice", h.number));
        }
        match self.workers {
            Some(n) if n != h.workers => bad(format!(
                "batch {} is of worker {} of {}, others of this epoch of {n} workers",
                h.number, h.worker, h.workers
            )),
            _ => {
                self.workers = Some(h.workers);
                Ok(())
            }
        }
    }

    /// Moves parked batches out of the ring (lowest numbers first) while the window has room,
    /// so that their slots go back to the workers.
    fn unpark(&mut self) {
        while self.held.len() < self.loader.window && self.failed.is_none() {
            let Some((_, (slot, header))) = self.parked.pop_first() else {
                return;
            };
            match self.loader.move_out(slot, header) {
                Ok(b) => {
                    self.held.insert(b.number, b);
                }
                Err(e) => self.failed = Some(e),
            }
        }
    }

    /// Batch `want`: held, parked, or taken from the ring, waiting up to the timeout.
    fn wait_for(&mut self, want: usize) -> Result<Batch> {
        let since = Instant::now();
        loop {
            if let Some(b) = self.held.remove(&want) {
                return Ok(b);
            }
            if let Some((slot, header)) = self.parked.remove(&want) {
                return self.loader.move_out(slot, header);
            }
            if self.parked.len() >= self.loader.ring.slots() as usize {
                // Every slot holds a later batch: no worker can publish this one.
                return Err(self.missing(want, since, true));
            }
            let left = self.timeout.saturating_sub(since.elapsed());
            let (slot, header) = match self.loader.take_slot(self.epoch, left) {
                Err(Error::Ipc(gpufeed_ipc::Error::Timeout { .. })) => {
                    return Err(self.missing(want, since, false));
                }
                taken => taken?,
            };
            self.check(&header)?;
            if header.number == want {
                return self.loader.move_out(slot, header);
            }
            if self.held.len() < self.loader.window {
                let b = self.loader.move_out(slot, header)?;
                self.held.insert(b.number, b);
            } else {
                self.parked.insert(header.number, (slot, header));
            }
        }
    }
}

impl Iterator for RingEpoch<'_, '_> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if self.next >= self.batches {
            return None;
        }
        if let Some(e) = self.failed.take() {
            return Some(Err(self.end(e)));
        }
        match self.wait_for(self.next) {
            Ok(b) => {
                self.next += 1;
                if self.next == self.batches {
                    self.close();
                } else if let Err(e) = self.loader.consumer.advance_watermark(self.next as u64) {
                    self.failed = Some(e.into());
                }
                self.unpark();
                Some(Ok(b))
            }
            Err(e) => Some(Err(self.end(e))),
        }
    }
}

impl Drop for RingEpoch<'_, '_> {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// A slot header written by another process, whatever its bytes: offsets that never
        /// decrease and data inside the slot, or an error; never a panic.
        #[test]
        fn arbitrary_slot_headers_never_panic(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
            count in 0u32..20,
            magic in proptest::prelude::any::<bool>(),
            slot_len in proptest::prelude::any::<u64>(),
        ) {
            let mut head = Vec::new();
            if magic {
                head.extend_from_slice(MAGIC);
                head.extend_from_slice(&count.to_le_bytes());
            }
            head.extend_from_slice(&body);
            if let Ok(h) = parse_slot(&head, slot_len) {
                let data_len = *h.offsets.last().expect("count + 1 offsets") as u64;
                proptest::prop_assert!(h.at as u64 + data_len <= slot_len);
                proptest::prop_assert!(h.offsets.windows(2).all(|w| w[0] <= w[1]));
                proptest::prop_assert_eq!(h.offsets.len(), h.indices.len() + 1);
                proptest::prop_assert_eq!(h.number % h.workers, h.worker);
            }
        }
    }
}
