//! Integration tests of gpufeed-uring: real files on disk, both backends, O_DIRECT on and off,
//! injected faults, io_uring refused for real by a seccomp filter in a child process, and the
//! writer (a full tmpfs for ENOSPC).

mod child;
mod errors;
mod exact;
mod faults;
mod inline;
mod write;

use std::path::PathBuf;

use gpufeed_uring::{Backend, Direct, FileId, ReadOp, Reader};

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
        Err(why) => gpufeed_testkit::skip("the io_uring backend's runs", &why),
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

/// Reads `count` requests of `file` through `r`, request `i` of `min_len + (i * 31,337) mod
/// 150,000` bytes at an odd offset, with every byte checked against `data` (the file's);
/// panics naming `what` where one fails. Returns the bytes read.
pub fn read_odd_requests(
    r: &mut Reader,
    file: FileId,
    data: &[u8],
    min_len: usize,
    count: u64,
    what: &str,
) -> u64 {
    let ops = (0..count).map(|i| {
        let len = min_len + (i as usize * 31_337) % 150_000;
        let off = (i * 77_773) % (data.len() - len) as u64;
        ReadOp::new(file, off, vec![0u8; len]).user_data(i)
    });
    let (mut n, mut bytes) = (0, 0);
    r.read_all(ops, |c| {
        let len = c
            .result
            .as_ref()
            .copied()
            .unwrap_or_else(|e| panic!("{what}: request {} failed: {e}", c.user_data));
        let off = c.offset as usize;
        assert!(
            c.buf[..] == data[off..off + len],
            "{what}: bytes of {} differ",
            c.user_data
        );
        n += 1;
        bytes += len as u64;
    })
    .expect("read_all");
    assert_eq!(n, count, "{what}");
    bytes
}

pub use gpufeed_testkit::{random_bytes, seed};
