//! Integration tests of gpufeed-ipc: a VecDeque model, real producer and consumer processes,
//! producers SIGKILLed mid-write, dead consumers, fd passing, hostile headers, the consumer's
//! watermark across processes.

mod child;
mod lockholders;
mod lockless_ring;
mod model;
mod namespaces;
mod processes;
mod rendezvous;
mod stopped_rank0;
mod watermark;

use xxhash_rust::xxh3::xxh3_64;

/// A numbered batch: `producer u32 | index u32 | payload xxh3 u64 | payload`.
pub fn encode(producer: u32, index: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + payload.len());
    v.extend_from_slice(&producer.to_le_bytes());
    v.extend_from_slice(&index.to_le_bytes());
    v.extend_from_slice(&xxh3_64(payload).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// Checks a batch made by [`encode`]; returns (producer, index) or why it is torn.
pub fn decode(batch: &[u8]) -> Result<(u32, u32), String> {
    if batch.len() < 16 {
        return Err(format!("{} bytes, shorter than the header", batch.len()));
    }
    let producer = u32::from_le_bytes(batch[0..4].try_into().expect("4"));
    let index = u32::from_le_bytes(batch[4..8].try_into().expect("4"));
    let hash = u64::from_le_bytes(batch[8..16].try_into().expect("8"));
    if xxh3_64(&batch[16..]) != hash {
        return Err(format!("torn batch {producer}/{index}: hash mismatch"));
    }
    Ok((producer, index))
}

pub use gpufeed_testkit::random_bytes;
