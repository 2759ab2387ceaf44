//! Integration tests of gpufeed-ipc: a VecDeque model, real producer and consumer processes,
//! producers SIGKILLed mid-write, dead consumers, fd passing, hostile headers.

mod child;
mod model;
mod processes;

use xxhash_rust::xxh3::xxh3_64;

/// Deterministic random bytes (splitmix64).
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

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
