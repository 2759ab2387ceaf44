//! Batches prepared by worker processes: they gather records into the slots of a
//! [`BatchRing`](gpufeed_ipc::BatchRing), the training process takes them in order and uploads them
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

use crate::error::{Error, Result};
use crate::{BatchLoaderOptions, Sampler};

mod consume;
mod produce;

pub use consume::{RingEpoch, RingLoader};
pub use produce::{WorkerShare, produce_epoch};

pub(crate) const MAGIC: &[u8; 4] = b"GFB2";
pub(crate) const HEADER: usize = 40;

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
pub(crate) fn header_len(records: usize) -> usize {
    HEADER + 8 * (2 * records + 1)
}

/// Where a slot's data starts for `records` records: after the header, 256-byte aligned.
#[doc(hidden)]
pub fn data_offset(records: usize) -> usize {
    header_len(records).next_multiple_of(256)
}

/// A slot's header (see the module's layout) for batch `number` of `epoch` from a ring's only
/// producer (worker 0 of 1): its records' `indices`, their data's `offsets` (one more than the
/// records, from 0 to the data's length).
#[doc(hidden)]
pub fn slot_header(epoch: u64, number: usize, indices: &[usize], offsets: &[u64]) -> Vec<u8> {
    slot_header_of(epoch, number, (0, 1), indices, offsets)
}

/// [`slot_header`] for worker `worker` of `workers` (`(worker, workers)`).
pub(crate) fn slot_header_of(
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

/// A slot's header, read and checked.
#[derive(Debug)]
pub(crate) struct SlotHeader {
    pub(crate) epoch: u64,
    pub(crate) number: usize,
    /// The worker that wrote it, and how many share the epoch.
    pub(crate) worker: usize,
    pub(crate) workers: usize,
    /// Where the data starts in the slot.
    pub(crate) at: usize,
    /// Each record's start in the data, then the end of the last.
    pub(crate) offsets: Vec<usize>,
    pub(crate) indices: Vec<usize>,
}

/// Reads a slot's header, treating the bytes as untrusted (another process wrote them).
pub(crate) fn parse_slot(head: &[u8], slot_len: u64) -> Result<SlotHeader> {
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
