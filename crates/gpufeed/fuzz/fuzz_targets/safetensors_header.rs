//! Fuzzes the validation of a safetensors file's header (bytes a downloaded checkpoint
//! controls): `cargo +nightly fuzz run safetensors_header` in crates/gpufeed/fuzz. Any input
//! gives tensors inside the data section or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    if let Ok((data_start, tensors)) = gpufeed::safetensors::header(bytes) {
        let data_len = bytes.len() as u64 - data_start;
        for gpufeed::safetensors::HeaderEntry { range, .. } in tensors {
            assert!(range.start <= range.end && range.end as u64 <= data_len);
        }
    }
});
