//! The trainer's side of the ring: [`RingLoader`] and its [`RingEpoch`], the batches taken in
//! order (at most a window out of order), each uploaded from its slot or copied out.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpufeed_cuda::{DeviceAlloc, Gpu, HostSource, TransferOptions, TransferScheduler};
use gpufeed_ipc::{BatchRing, Consumer, Watermark};
use gpufeed_pinned::{HostRegistration, PinnedPool, PoolMode, PoolOptions};

use super::{HEADER, SlotHeader, header_len, parse_slot};
use crate::error::{Error, Result};
use crate::{Batch, BatchData};

/// The training side of worker processes: takes their batches from the ring in batch order
/// and uploads each from the registered shared memory (no staging copy), or hands out host
/// copies without a GPU.
///
/// # Back-pressure and the window
/// The loader publishes in the ring which epoch it reads, the batch it waits for (`next`, from
/// the epoch's start and after each batch it hands out) and its window `W`
/// ([`RingLoader::window`]); [`produce_epoch`](super::produce_epoch) transforms batch `n`, and claims a slot for it,
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
pub(crate) const WINDOW_RINGS: usize = 4;

/// The watermark of a loader of window `window` reading `round` (`None`: between epochs)
/// and waiting for batch `position` (0 between epochs).
pub(crate) fn watermark(window: usize, round: Option<u64>, position: usize) -> Watermark {
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
                BatchData::Device(sched.upload_new(src, DeviceAlloc::Pool)?.0.into())
            }
            _ => {
                let mut buf = self.pool.get(len.max(1))?;
                buf.set_len(len);
                slot.read_at(at as u64, &mut buf)?;
                match &self.gpu {
                    Some((_, sched)) if len > 0 => BatchData::Device(
                        sched
                            .upload_new(HostSource::Pooled(&buf), DeviceAlloc::Pool)?
                            .0
                            .into(),
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
