//! `ReaderBuilder::inline_memory_files`: reads of files in memory (tmpfs) run on the calling
//! thread, past the backend; files on other file systems still go through it.

use std::path::Path;

use gpufeed_uring::{Direct, Error, FaultPlan, ReadOp, Reader};

use crate::{backends, disk_file, random_bytes, seed};

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
        let ops = (0..100u64).map(|i| {
            let len = 1 + (i as usize * 31_337) % 150_000;
            let off = (i * 77_773) % (data.len() - len) as u64;
            ReadOp::new(file, off, vec![0u8; len]).user_data(i)
        });
        let mut n = 0;
        r.read_all(ops, |c| {
            let len = c.result.as_ref().copied().unwrap_or_else(|e| {
                panic!(
                    "seed {seed} {backend:?}: request {} failed: {e}",
                    c.user_data
                )
            });
            let off = c.offset as usize;
            assert!(
                c.buf[..] == data[off..off + len],
                "seed {seed}: bytes of {} differ",
                c.user_data
            );
            n += 1;
        })
        .expect("read_all");
        assert_eq!(n, 100);
        assert_eq!(
            r.stats().bytes,
            (0..100).map(|i| 1 + (i * 31_337) % 150_000).sum::<u64>()
        );
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

        // Switched off, the same reads go through the backend (which fails them here).
        let mut r = failing_backend(backend, false, seed);
        let file = r.open_brief(&path).expect("open");
        let mut buf = [0u8; 4096];
        let err = r
            .read_exact_many([(file, 5, &mut buf[..])])
            .expect_err("every backend read fails");
        assert!(
            matches!(&err, Error::Read { source, .. } if source.raw_os_error() == Some(libc::EIO)),
            "{err}"
        );
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
        let mut r = failing_backend(backend, true, seed);
        let file = r.open_brief(&path).expect("open");
        let mut buf = [0u8; 4096];
        let err = r
            .read_exact_many([(file, 5, &mut buf[..])])
            .expect_err("a disk file is read through the backend, which fails");
        assert!(
            matches!(&err, Error::Read { source, .. } if source.raw_os_error() == Some(libc::EIO)),
            "{err}"
        );
    }
}
