//! Integration tests of gpufeed-uring: real files on disk, both backends, O_DIRECT on and off,
//! injected faults, and io_uring refused for real by a seccomp filter in a child process.

mod child;
mod errors;
mod exact;
mod faults;

use std::path::PathBuf;

use gpufeed_uring::{Backend, Direct, Reader};

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

/// A seed for this run, printed so a failure can be replayed with GPUFEED_TEST_SEED.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var("GPUFEED_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("{test}: seed {seed} (replay with GPUFEED_TEST_SEED={seed})");
    seed
}

/// A file of random bytes on the disk under target/ (O_DIRECT needs a real file system).
pub fn disk_file(len: usize, seed: u64) -> (tempfile::TempDir, PathBuf, Vec<u8>) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("data.bin");
    let data = random_bytes(len, seed);
    std::fs::write(&path, &data).expect("write");
    (dir, path, data)
}

/// The backends to test here: threads always, io_uring where the kernel allows it (the
/// reason is printed where not).
pub fn backends() -> Vec<Backend> {
    let mut list = vec![Backend::Threads(3)];
    match Backend::probe().io_uring {
        Ok(()) => list.push(Backend::IoUring),
        Err(why) => eprintln!("SKIP io_uring backend here: {why}"),
    }
    list
}

/// A reader with the given settings (panics if it cannot be built).
pub fn reader(backend: Backend, direct: Direct, qd: usize, block: usize) -> Reader {
    Reader::builder()
        .backend(backend)
        .direct(direct)
        .queue_depth(qd)
        .block_bytes(block)
        .build()
        .unwrap_or_else(|e| panic!("build {backend:?}: {e}"))
}
