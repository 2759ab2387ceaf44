//! Fuzzes the parsers of data set files (bytes a downloaded data set controls): `cargo +nightly
//! fuzz run dataset_sources` in crates/gpufeed/fuzz. Any input, as an `.npy` header or a tar
//! shard, gives a layout or samples inside the input, or an error; never a panic or an
//! overflow.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    use gpufeed::dataset::sources::{index_tar, parse_npy};
    if let Ok(l) = parse_npy(bytes, bytes.len() as u64) {
        let row = l.checked_row_bytes().expect("a parsed layout's row fits");
        let data = row.checked_mul(l.rows()).expect("and so does its data");
        assert!(l.data_start + data <= bytes.len());
    }
    if let Ok(samples) = index_tar(bytes) {
        for s in samples {
            for (_, r) in s.members {
                assert!(r.start <= r.end && r.end <= bytes.len());
            }
        }
    }
});
