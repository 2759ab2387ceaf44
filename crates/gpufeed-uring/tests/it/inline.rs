//! `ReaderBuilder::inline_memory_files`: reads of files in memory (tmpfs) run on the calling
//! thread, past the backend; files on other file systems still go through it.

use std::path::Path;

use gpufeed_uring::{Direct, Error, FaultPlan, Reader};

use crate::{backends, disk_file, random_bytes, read_odd_requests, seed};

/// A reader whose backend fails every read with EIO: only reads that bypass it can succeed.
fn failing_backend(backend: gpufeed_uring::Backend, inline: bool, seed: u64) -> Reader {
    Reader::builder()
        .backend(backend)
        .direct(Direct::Off)
        .queue_depth(8)
        .block_bytes(64 * 1024)
        .inline_memory_files(inline)
        .fault_injection(FaultPlan {
            eio: 1.0,
            ..FaultPlan::none(seed)
        })
        .build()
        .expect("build")
}

/// A read of `path` through `r` (whose backend fails every read) fails with the backend's EIO.
fn read_fails_with_eio(r: &mut Reader, path: &Path) {
    let file = r.open_brief(path).expect("open");
    let mut buf = [0u8; 4096];
    let err = r
        .read_exact_many([(file, 5, &mut buf[..])])
        .expect_err("read through the backend, which fails every read");
    assert!(
        matches!(&err, Error::Read { source, .. } if source.raw_os_error() == Some(libc::EIO)),
        "{err}"
    );
}

/// Whether `path` is on a file system in memory (`statfs`).
fn in_memory(path: &Path) -> bool {
    rustix::fs::statfs(path).is_ok_and(|s| gpufeed_os::file::in_memory_fs(s.f_type))
}

#[test]
fn files_in_memory_are_read_on_the_calling_thread_byte_exact() {
    let shm = Path::new("/dev/shm");
    if !in_memory(shm) {
        gpufeed_testkit::skip(
            "inline reads of tmpfs files",
            &"/dev/shm is not a tmpfs here",
        );
        return;
    }
    let seed = seed("inline tmpfs");
    let dir = tempfile::tempdir_in(shm).expect("tempdir in /dev/shm");
    let data = random_bytes(3 * 1024 * 1024 + 17, seed);
    let path = dir.path().join("mem.bin");
    std::fs::write(&path, &data).expect("write");
    for backend in backends() {
        let mut r = failing_backend(backend, true, seed);
        let file = r.open_brief(&path).expect("open");
        // More requests than the queue holds, at odd offsets and lengths, some larger than a
        // block (split into parts).
        let what = format!("seed {seed} {backend:?}");
        let bytes = read_odd_requests(&mut r, file, &data, 1, 100, &what);
        assert_eq!(r.stats().bytes, bytes);
        // Past the end: the same error as through the backend, naming the file.
        let mut tail = [0u8; 100];
        let err = r
            .read_exact_many([(file, data.len() as u64 - 40, &mut tail[..])])
            .expect_err("40 bytes are there, not 100");
        match err {
            Error::UnexpectedEof {
                path: p, got, want, ..
            } => {
                assert_eq!((p.as_path(), got, want), (path.as_path(), 40, 100));
            }
            other => panic!("seed {seed}: unexpected {other}"),
        }
        assert!(tail[..40] == data[data.len() - 40..]);
        r.close(file).expect("close");
        // Opened by `open` (a file opened once for a load) rather than `open_brief`: the same.
        let file = r.open(&path).expect("open");
        read_odd_requests(&mut r, file, &data, 1, 10, &what);
        r.close(file).expect("close");

        // Switched off, the same reads go through the backend (which fails them here).
        read_fails_with_eio(&mut failing_backend(backend, false, seed), &path);
    }
}

#[test]
fn files_on_disk_still_go_through_the_backend() {
    let seed = seed("inline disk");
    let (dir, path, _data) = disk_file(100_000, seed);
    if in_memory(dir.path()) {
        gpufeed_testkit::skip(
            "the backend's reads of disk files with inline reads on",
            &"the target directory is on tmpfs here",
        );
        return;
    }
    for backend in backends() {
        read_fails_with_eio(&mut failing_backend(backend, true, seed), &path);
    }
}
