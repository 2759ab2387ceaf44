//! Batches prepared by worker processes: they gather records into the slots of a
//! [`BatchRing`], the training process takes them in order and uploads them
//! straight from the registered shared memory. Start the workers however your launcher does
//! (each calls [`produce_epoch`] for its share); the consumer is a [`RingLoader`].
//!
//! Slot layout: `"GFBT" | records u32 | epoch u64 | number u64 | data bytes u64 | offsets
//! (records + 1) x u64 | record indices (records) x u64 | data at the next 256-byte boundary`.

use std::collections::BTreeMap;
use std::time::Duration;

use gpufeed_cuda::{DeviceAlloc, Gpu, HostSource, TransferConfig, TransferScheduler};
use gpufeed_ipc::{BatchRing, Consumer};
use gpufeed_pinned::{HostRegistration, PinnedPool, PoolConfig, PoolMode};

use crate::dataset::{Batch, BatchData, LoaderConfig, RecordFile, Sampler, Transform};
use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"GFBT";
const HEADER: usize = 32;

/// The batches (number, record indices) of `epoch`, as [`crate::dataset::BatchLoader`] makes
/// them.
pub fn epoch_batches(
    records: usize,
    sampler: &Sampler,
    cfg: &LoaderConfig,
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
pub(crate) fn data_offset(records: usize) -> usize {
    header_len(records).next_multiple_of(256)
}

/// A slot's header (see the module's layout) for batch `number` of `epoch`: its records'
/// `indices`, their data's `offsets` (one more than the records, from 0 to the data's length).
pub(crate) fn slot_header(
    epoch: u64,
    number: usize,
    indices: &[usize],
    offsets: &[u64],
) -> Vec<u8> {
    let mut header = Vec::with_capacity(data_offset(indices.len()));
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&(indices.len() as u32).to_le_bytes());
    header.extend_from_slice(&epoch.to_le_bytes());
    header.extend_from_slice(&(number as u64).to_le_bytes());
    header.extend_from_slice(&offsets.last().copied().unwrap_or(0).to_le_bytes());
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
    /// Longest wait for a free slot (default 60 s).
    pub timeout: Duration,
}

impl<'a> WorkerShare<'a> {
    /// Worker `worker` of `workers` in `epoch`, records untransformed, 60 s per free slot.
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

    /// This share waiting at most `timeout` for each free slot.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// Writes one worker's share of an epoch's batches — numbers `worker, worker + workers, ...` —
/// into `ring` (from the worker's own process). Returns how many it wrote.
///
/// It does not register the worker as the ring's producer: workers may be started per epoch.
/// A worker that lives for the whole run can hold [`BatchRing::producer`] around its loop, so
/// that the trainer's [`RingLoader`] gets `ProducerGone` at once when every worker is gone.
///
/// # Errors
/// A batch larger than a slot ([`gpufeed_ipc::Error::TooLarge`]: make the slots larger), a
/// failing transform, ring errors (`ConsumerGone` when the trainer died),
/// [`Error::InvalidSetting`] for a worker number not below `workers`.
pub fn produce_epoch(
    ring: &BatchRing,
    records: &RecordFile,
    sampler: &Sampler,
    cfg: &LoaderConfig,
    share: &WorkerShare<'_>,
) -> Result<usize> {
    let WorkerShare {
        epoch,
        worker,
        workers,
        transform,
        timeout,
    } = *share;
    if workers == 0 || worker >= workers {
        return Err(Error::InvalidSetting(format!(
            "worker {worker} of {workers}: workers must be at least 1 and worker below it"
        )));
    }
    let mut written = 0;
    let mut out = Vec::new();
    for (number, indices) in epoch_batches(records.len(), sampler, cfg, epoch)
        .into_iter()
        .skip(worker)
        .step_by(workers)
    {
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
                    let record = crate::dataset::contiguous(&p, &mut joined);
                    crate::dataset::run_transform(f, i, record, &mut out)?;
                }
                None => p.iter().for_each(|m| out.extend_from_slice(m)),
            }
            offsets.push(out.len() as u64);
        }
        let at = data_offset(indices.len());
        let mut claim = ring.claim(timeout)?;
        claim.write_at(0, &slot_header(epoch, number, &indices, &offsets))?;
        claim.write_at(at as u64, &out)?;
        claim.set_len((at + out.len()) as u64)?;
        claim.publish()?;
        written += 1;
    }
    Ok(written)
}

/// A slot's header: epoch, batch number, data offset, record offsets, record indices.
type SlotHeader = (u64, usize, usize, Vec<usize>, Vec<usize>);

/// Reads a slot's header, treating the bytes as untrusted (another process wrote them).
fn parse_slot(head: &[u8], slot_len: u64) -> Result<SlotHeader> {
    let bad = |why: &str| Error::MalformedBatch {
        reason: format!("its slot is malformed: {why}"),
    };
    if head.len() < HEADER || &head[..4] != MAGIC {
        return Err(bad("bad magic"));
    }
    let u64_at = |o: usize| u64::from_le_bytes(head[o..o + 8].try_into().expect("8 bytes"));
    let count = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes")) as usize;
    if head.len() < header_len(count) {
        return Err(bad("header shorter than its record count"));
    }
    let (epoch, number, data_len) = (u64_at(8), u64_at(16) as usize, u64_at(24));
    let at = data_offset(count);
    if (at as u64)
        .checked_add(data_len)
        .is_none_or(|end| end > slot_len)
    {
        return Err(bad("lengths exceed the slot"));
    }
    let offsets: Vec<usize> = (0..=count)
        .map(|k| u64_at(HEADER + 8 * k) as usize)
        .collect();
    if offsets[0] != 0
        || offsets.windows(2).any(|w| w[1] < w[0])
        || offsets[count] as u64 != data_len
    {
        return Err(bad("offsets out of order"));
    }
    let indices = (0..count)
        .map(|k| u64_at(HEADER + 8 * (count + 1 + k)) as usize)
        .collect();
    Ok((epoch, number, at, offsets, indices))
}

/// The training side of worker processes: takes their batches from the ring in batch order
/// and uploads each from the registered shared memory (no staging copy), or hands out host
/// copies without a GPU.
pub struct RingLoader<'r> {
    ring: &'r BatchRing,
    consumer: Consumer<'r>,
    gpu: Option<(Gpu, TransferScheduler)>,
    registration: Option<HostRegistration<'r>>,
    pool: PinnedPool,
    /// Slower paths taken, with reasons.
    pub notes: Vec<String>,
}

impl std::fmt::Debug for RingLoader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingLoader")
            .field("slots", &self.ring.slots())
            .field("gpu", &self.gpu.is_some())
            .field("registered", &self.registration.is_some())
            .finish()
    }
}

impl<'r> RingLoader<'r> {
    /// Registers as the ring's consumer and, with a GPU, registers the ring's memory with CUDA.
    pub fn new(ring: &'r BatchRing, gpu: Option<&Gpu>) -> Result<Self> {
        let consumer = ring.consumer()?;
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
                    PinnedPool::new(PoolMode::Cuda(g.context().clone()), PoolConfig::default())?;
                (
                    Some((
                        g.clone(),
                        TransferScheduler::new(g, TransferConfig::default())?,
                    )),
                    registration,
                    pool,
                )
            }
            None => (
                None,
                None,
                PinnedPool::new(PoolMode::Cpu, PoolConfig::default())?,
            ),
        };
        Ok(RingLoader {
            ring,
            consumer,
            gpu,
            registration,
            pool,
            notes,
        })
    }

    /// The `batches` batches of `epoch`, in batch order, each waited for up to `timeout`.
    ///
    /// An item is an error for a batch not there within `timeout`, or at once
    /// ([`gpufeed_ipc::Error::ProducerGone`]) when the ring's registered producer (a
    /// [`crate::hybrid::Fanout`]) is gone with nothing left to take; a slot that is not a
    /// batch of this layout; or the upload's.
    pub fn epoch(
        &mut self,
        epoch: u64,
        batches: usize,
        timeout: Duration,
    ) -> impl Iterator<Item = Result<Batch>> + '_ {
        let mut held: BTreeMap<usize, Batch> = BTreeMap::new();
        let mut next = 0;
        std::iter::from_fn(move || {
            if next >= batches {
                return None;
            }
            loop {
                if let Some(b) = held.remove(&next) {
                    next += 1;
                    return Some(Ok(b));
                }
                match self.take(epoch, timeout) {
                    Ok(b) if b.number >= batches => {
                        next = batches;
                        return Some(Err(Error::MalformedBatch {
                            reason: format!(
                                "batch number {} beyond the epoch's {batches}",
                                b.number
                            ),
                        }));
                    }
                    Ok(b) => {
                        held.insert(b.number, b);
                    }
                    Err(e) => {
                        next = batches;
                        return Some(Err(e));
                    }
                }
            }
        })
    }

    /// Takes one batch from the ring and moves it out of its slot (to the GPU, or a pooled host
    /// buffer), releasing the slot.
    fn take(&mut self, epoch: u64, timeout: Duration) -> Result<Batch> {
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
        let (got_epoch, number, at, offsets, indices) = parse_slot(&head, slot.len())?;
        if got_epoch != epoch {
            return Err(Error::MalformedBatch {
                reason: format!("a worker produced epoch {got_epoch} while epoch {epoch} is read"),
            });
        }
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
            if let Ok((_, _, at, offsets, indices)) = parse_slot(&head, slot_len) {
                let data_len = *offsets.last().expect("count + 1 offsets") as u64;
                proptest::prop_assert!(at as u64 + data_len <= slot_len);
                proptest::prop_assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
                proptest::prop_assert_eq!(offsets.len(), indices.len() + 1);
            }
        }
    }
}
