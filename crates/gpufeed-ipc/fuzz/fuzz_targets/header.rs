//! Fuzzes the validation of a batch ring header, the bytes another process controls:
//! `cargo +nightly fuzz run header` in crates/gpufeed-ipc/fuzz. Any input must give a
//! consistent layout or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (&[u8], u64)| {
    let (bytes, segment_len) = input;
    if let Ok(layout) = gpufeed_ipc::parse_header(bytes, segment_len) {
        assert!(layout.total_len <= segment_len);
        assert_eq!(layout.slot_bytes % gpufeed_ipc::SLOT_ALIGN, 0);
        assert!(layout.slot_offset(layout.slots - 1) + layout.slot_bytes <= layout.total_len);
    }
});
