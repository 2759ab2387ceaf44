//! The workers' side of the ring: [`WorkerShare`] and [`produce_epoch`], each worker process
//! gathering its share of an epoch's batches into slots, held back by the loader's watermark.

use std::time::{Duration, Instant};

use gpufeed_ipc::{BatchRing, Claim, Watermark};

use super::{data_offset, epoch_batches, slot_header_of};
use crate::error::{Error, Result};
use crate::{BatchLoaderOptions, RecordFile, Sampler, Transform};

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
/// the trainer's [`RingLoader`](super::RingLoader) is within its window of the batch (the watermark it publishes
/// in the ring: see the module's back-pressure section); a ring that no `RingLoader` paces
/// is not waited on.
///
/// It does not register the worker as the ring's producer: workers may be started per epoch.
/// A worker that lives for the whole run can hold [`BatchRing::producer`] around its loop, so
/// that the trainer's [`RingLoader`](super::RingLoader) gets `ProducerGone` at once when every worker is gone.
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
pub(crate) enum Pace {
    /// Produce it: within the window, or nobody paces the ring.
    Go,
    /// Wait for the loader to come nearer (or to begin this epoch).
    Wait,
    /// The loader ended this epoch, or went on to another, after the worker saw it read it.
    Ended,
}

/// One worker's batch and what it saw of the loader's watermark.
pub(crate) struct Turn {
    pub(crate) epoch: u64,
    pub(crate) worker: usize,
    pub(crate) number: usize,
    /// Whether the loader was seen reading this epoch.
    pub(crate) seen: bool,
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
