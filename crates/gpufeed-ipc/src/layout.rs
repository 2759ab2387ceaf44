//! The ring's layout in the segment, and validation of a header read from memory that another
//! process wrote (untrusted input: checked arithmetic, every field bounded).
//!
//! ```text
//! 0      header (64 bytes of fixed fields, then counters, the lease, the consumer's
//!        watermark and the consumer and producer tables)
//! 4096   process table: 128 entries of 64 bytes (control word, PID namespace, pid, start
//!        time, heartbeat, flags), see the `members` module
//! 12288  slot table: 64 bytes per slot (control word, sequence, length)
//! D      data: `slots` x `slot_bytes`, D page-aligned, each slot 256-byte aligned
//! ```

use crate::error::{Error, Result};

/// `GPUFRNG1`
pub const MAGIC: u64 = u64::from_le_bytes(*b"GPUFRNG1");
/// Layout version (2: holders named by process-table entries, leases; 3: slots quarantined
/// from silent holders, a state of 3 bits, entry locks; 4: the consumer's watermark, which
/// producers of this version wait on, so a ring of version 3 (whose consumers never advance
/// it) is refused rather than stalling them).
pub const VERSION: u32 = 4;
/// Alignment of each slot (CUDA copies and 256-byte frames).
pub const SLOT_ALIGN: u64 = 256;
/// Bytes of the header page.
pub const HEADER_BYTES: u64 = 4096;
/// Bytes of one process-table entry.
pub(crate) const PROC_ENTRY_BYTES: u64 = 64;
/// Bytes of the process table.
pub(crate) const PROC_TABLE_BYTES: u64 = crate::members::MAX_PROCESSES as u64 * PROC_ENTRY_BYTES;
/// Bytes of slot metadata per slot.
pub const SLOT_META_BYTES: u64 = 64;
/// Most slots a ring may have.
pub const MAX_SLOTS: u32 = 4096;
/// Largest slot.
pub const MAX_SLOT_BYTES: u64 = 1 << 40;
/// Consumers that can be registered at once.
pub const MAX_CONSUMERS: usize = 16;
/// Producers that can be registered at once ([`crate::BatchRing::producer`]).
pub const MAX_PRODUCERS: usize = 16;

// Byte offsets of header fields.
pub(crate) const OFF_MAGIC: usize = 0;
pub(crate) const OFF_VERSION: usize = 8;
pub(crate) const OFF_SLOTS: usize = 12;
pub(crate) const OFF_SLOT_BYTES: usize = 16;
pub(crate) const OFF_DATA: usize = 24;
pub(crate) const OFF_TOTAL: usize = 32;
/// Futex word bumped whenever a slot becomes free.
pub(crate) const OFF_FREE_SEQ: usize = 64;
/// Futex word bumped whenever a slot is published.
pub(crate) const OFF_READY_SEQ: usize = 68;
/// Publish order counter.
pub(crate) const OFF_PUBLISH: usize = 72;
/// Waiters on the free and ready futex words (wake only when someone sleeps).
pub(crate) const OFF_FREE_WAITERS: usize = 80;
pub(crate) const OFF_READY_WAITERS: usize = 84;
/// The lease of holders in other PID namespaces, in milliseconds.
pub(crate) const OFF_LEASE_MS: usize = 88;
/// The consumer's watermark ([`crate::Watermark`]), a seqlock: its sequence (odd while a
/// consumer writes the words after it; also the futex word producers wait on), the position,
/// the round, the window, flags (paced, in a round), and the number of producers waiting.
pub(crate) const OFF_WM_SEQ: usize = 92;
pub(crate) const OFF_WM_POSITION: usize = 96;
pub(crate) const OFF_WM_ROUND: usize = 104;
pub(crate) const OFF_WM_WINDOW: usize = 112;
pub(crate) const OFF_WM_FLAGS: usize = 120;
pub(crate) const OFF_WM_WAITERS: usize = 124;
/// Consumer table: MAX_CONSUMERS words of a holder reference (u32; 0 = empty).
pub(crate) const OFF_CONSUMERS: usize = 128;
/// Producer table, the same.
pub(crate) const OFF_PRODUCERS: usize = OFF_CONSUMERS + 4 * MAX_CONSUMERS;
const _: () = assert!(OFF_PRODUCERS + 4 * MAX_PRODUCERS <= HEADER_BYTES as usize);
const _: () = assert!(OFF_LEASE_MS + 4 <= OFF_WM_SEQ && OFF_WM_WAITERS + 4 <= OFF_CONSUMERS);
const _: () = assert!(OFF_WM_POSITION.is_multiple_of(8) && OFF_WM_WINDOW.is_multiple_of(8));

// Offsets inside one process-table entry.
pub(crate) const PROC_CTL: usize = 0;
pub(crate) const PROC_NS: usize = 8;
pub(crate) const PROC_PID: usize = 16;
pub(crate) const PROC_START: usize = 24;
pub(crate) const PROC_HEARTBEAT: usize = 32;
pub(crate) const PROC_FLAGS: usize = 40;

// Offsets inside one slot's metadata.
pub(crate) const SLOT_CTL: usize = 0;
pub(crate) const SLOT_SEQ: usize = 8;
pub(crate) const SLOT_LEN: usize = 16;

/// The validated geometry of a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Number of slots.
    pub slots: u32,
    /// Bytes per slot (a multiple of 256).
    pub slot_bytes: u64,
    /// Offset of slot 0's data.
    pub data_offset: u64,
    /// Bytes the ring spans.
    pub total_len: u64,
}

impl Layout {
    /// The layout for `slots` slots of at least `slot_bytes` bytes (rounded up to 256).
    pub fn new(slots: u32, slot_bytes: u64) -> Result<Self> {
        if slots == 0 || slots > MAX_SLOTS {
            return Err(Error::InvalidLayout(format!(
                "{slots} slots; use 1 to {MAX_SLOTS}"
            )));
        }
        if slot_bytes == 0 || slot_bytes > MAX_SLOT_BYTES {
            return Err(Error::InvalidLayout(format!(
                "slot size {slot_bytes}; use 1 byte to {MAX_SLOT_BYTES}"
            )));
        }
        let slot_bytes = slot_bytes.div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        Self::compute(slots, slot_bytes).ok_or_else(|| {
            Error::InvalidLayout(format!("{slots} slots of {slot_bytes} bytes overflow"))
        })
    }

    fn compute(slots: u32, slot_bytes: u64) -> Option<Self> {
        let meta_end = (HEADER_BYTES + PROC_TABLE_BYTES)
            .checked_add(u64::from(slots).checked_mul(SLOT_META_BYTES)?)?;
        let data_offset = meta_end.checked_next_multiple_of(4096)?;
        let total_len = data_offset.checked_add(u64::from(slots).checked_mul(slot_bytes)?)?;
        Some(Layout {
            slots,
            slot_bytes,
            data_offset,
            total_len,
        })
    }

    /// Offset of slot `i`'s metadata.
    pub(crate) fn meta_offset(&self, i: u32) -> usize {
        (HEADER_BYTES + PROC_TABLE_BYTES + u64::from(i) * SLOT_META_BYTES) as usize
    }

    /// Offset of process-table entry `i`.
    pub(crate) fn proc_offset(&self, i: usize) -> usize {
        (HEADER_BYTES + i as u64 * PROC_ENTRY_BYTES) as usize
    }

    /// Offset of slot `i`'s data in the segment.
    pub fn slot_offset(&self, i: u32) -> u64 {
        self.data_offset + u64::from(i) * self.slot_bytes
    }

    /// The 64 fixed header bytes describing this layout.
    pub fn header_bytes(&self) -> [u8; 64] {
        let mut h = [0u8; 64];
        h[OFF_MAGIC..OFF_MAGIC + 8].copy_from_slice(&MAGIC.to_le_bytes());
        h[OFF_VERSION..OFF_VERSION + 4].copy_from_slice(&VERSION.to_le_bytes());
        h[OFF_SLOTS..OFF_SLOTS + 4].copy_from_slice(&self.slots.to_le_bytes());
        h[OFF_SLOT_BYTES..OFF_SLOT_BYTES + 8].copy_from_slice(&self.slot_bytes.to_le_bytes());
        h[OFF_DATA..OFF_DATA + 8].copy_from_slice(&self.data_offset.to_le_bytes());
        h[OFF_TOTAL..OFF_TOTAL + 8].copy_from_slice(&self.total_len.to_le_bytes());
        h
    }
}

fn u32_at(h: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(h[off..off + 4].try_into().expect("4 bytes"))
}

fn u64_at(h: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(h[off..off + 8].try_into().expect("8 bytes"))
}

/// Validates the fixed header bytes of a ring found in a segment of `segment_len` bytes.
///
/// The bytes must have been copied out of shared memory once (a peer could change them
/// between two reads); every field is checked and the geometry recomputed with checked
/// arithmetic, so a hostile header yields an error, never a panic or an out-of-bounds access.
pub fn parse_header(header: &[u8], segment_len: u64) -> Result<Layout> {
    let bad = |why: String| Err(Error::InvalidHeader(why));
    if header.len() < 64 {
        return bad(format!("{} header bytes, need 64", header.len()));
    }
    if u64_at(header, OFF_MAGIC) != MAGIC {
        return bad("not a gpufeed batch ring (bad magic)".into());
    }
    let version = u32_at(header, OFF_VERSION);
    if version != VERSION {
        return bad(format!(
            "layout version {version}, this build reads {VERSION}"
        ));
    }
    let slots = u32_at(header, OFF_SLOTS);
    let slot_bytes = u64_at(header, OFF_SLOT_BYTES);
    if slots == 0 || slots > MAX_SLOTS {
        return bad(format!("{slots} slots"));
    }
    if slot_bytes == 0 || slot_bytes > MAX_SLOT_BYTES || !slot_bytes.is_multiple_of(SLOT_ALIGN) {
        return bad(format!("slot size {slot_bytes}"));
    }
    let Some(layout) = Layout::compute(slots, slot_bytes) else {
        return bad("geometry overflows".into());
    };
    if u64_at(header, OFF_DATA) != layout.data_offset
        || u64_at(header, OFF_TOTAL) != layout.total_len
    {
        return bad("offsets do not match the geometry".into());
    }
    if layout.total_len > segment_len {
        return bad(format!(
            "ring spans {} bytes, segment has {segment_len}",
            layout.total_len
        ));
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layouts_round_trip_and_align() {
        let l = Layout::new(8, 1000).expect("layout");
        assert_eq!(l.slot_bytes, 1024);
        assert_eq!(l.data_offset % 4096, 0);
        for i in 0..8 {
            assert_eq!(l.slot_offset(i) % SLOT_ALIGN, 0);
        }
        assert_eq!(
            parse_header(&l.header_bytes(), l.total_len).expect("parse"),
            l
        );
        assert!(
            parse_header(&l.header_bytes(), l.total_len - 1).is_err(),
            "segment too small"
        );
        assert!(Layout::new(0, 10).is_err());
        assert!(Layout::new(MAX_SLOTS + 1, 10).is_err());
        assert!(Layout::new(1, 0).is_err());
    }

    #[test]
    fn hostile_fields_are_refused() {
        let l = Layout::new(4, 4096).expect("layout");
        let good = l.header_bytes();
        let cases: [(usize, &[u8]); 7] = [
            (OFF_MAGIC, b"NOTARING"),
            (OFF_VERSION, &(VERSION + 1).to_le_bytes()),
            // A ring of the previous layout: no watermark, which producers would wait on.
            (OFF_VERSION, &3u32.to_le_bytes()),
            (OFF_SLOTS, &u32::MAX.to_le_bytes()),
            (OFF_SLOT_BYTES, &u64::MAX.to_le_bytes()),
            (OFF_SLOT_BYTES, &4097u64.to_le_bytes()),
            (OFF_TOTAL, &1u64.to_le_bytes()),
        ];
        for (off, bytes) in cases {
            let mut h = good;
            h[off..off + bytes.len()].copy_from_slice(bytes);
            let err = parse_header(&h, u64::MAX).unwrap_err();
            assert!(matches!(err, Error::InvalidHeader(_)), "{err:?}");
        }
        assert!(parse_header(&good[..10], u64::MAX).is_err());
    }

    proptest! {
        /// The fuzz property: any bytes give Ok with a consistent layout or an error.
        #[test]
        fn arbitrary_headers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..80), len in any::<u64>()) {
            if let Ok(l) = parse_header(&bytes, len) {
                prop_assert!(l.total_len <= len);
                prop_assert_eq!(l.slot_bytes % SLOT_ALIGN, 0);
            }
        }

        #[test]
        fn mutated_valid_headers_never_panic(slots in 1u32..64, size in 1u64..100_000, at in 0usize..64, val in any::<u8>()) {
            let l = Layout::new(slots, size).expect("layout");
            let mut h = l.header_bytes();
            h[at] = val;
            if let Ok(p) = parse_header(&h, l.total_len) {
                prop_assert!(p.total_len <= l.total_len);
            }
        }
    }
}
