//! Bad input: EOF, a missing file, a directory, a file shrunk between open and read, O_DIRECT
//! refused, io_uring unavailable.

use gpufeed_uring::{Backend, Direct, Error, ReadOp};

use crate::{backends, disk_file, reader};

#[test]
fn reading_past_the_end_is_unexpected_eof() {
    let (_dir, path, _) = disk_file(10_000, 1);
    for backend in backends() {
        for direct in [Direct::On, Direct::Off] {
            let mut r = reader(backend, direct, 4, 4096 * 4);
            let file = r.open(&path).expect("open");
            let mut buf = vec![0u8; 5000];
            let err = r.read_exact_at(file, 8000, &mut buf).unwrap_err();
            match &err {
                Error::UnexpectedEof {
                    offset, got, want, ..
                } => {
                    assert_eq!(
                        (*offset, *got, *want),
                        (8000, 2000, 5000),
                        "{backend:?} {direct:?}"
                    );
                }
                other => panic!("{backend:?} {direct:?}: {other:?}"),
            }
            assert!(err.to_string().contains("shorter than expected"), "{err}");
            let err = r.read_exact_at(file, 20_000, &mut buf).unwrap_err();
            assert!(
                matches!(err, Error::UnexpectedEof { got: 0, .. }),
                "{err:?}"
            );
        }
    }
}

#[test]
fn missing_files_directories_and_fifos() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = dir.path().join("fifo");
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .expect("mkfifo");
    let mut r = reader(Backend::Threads(1), Direct::Off, 1, 4096);
    for brief in [false, true] {
        let mut open = |p: &std::path::Path| {
            if brief { r.open_brief(p) } else { r.open(p) }
        };
        let err = open(&dir.path().join("nope")).unwrap_err();
        assert!(
            matches!(err, Error::Os(gpufeed_os::Error::NotFound { .. })),
            "brief {brief}: {err:?}"
        );
        assert!(err.to_string().contains("check the path"));
        let err = open(dir.path()).unwrap_err();
        assert!(
            matches!(err, Error::Os(gpufeed_os::Error::IsDirectory { .. })),
            "brief {brief}: {err:?}"
        );
        // Refused by type, without blocking on a FIFO no writer opens.
        let err = open(&fifo).unwrap_err();
        assert!(
            matches!(err, Error::Os(gpufeed_os::Error::NotRegularFile { .. })),
            "brief {brief}: {err:?}"
        );
    }
}

#[test]
fn a_file_shrunk_between_open_and_read() {
    let (_dir, path, data) = disk_file(100_000, 2);
    for backend in backends() {
        for direct in [Direct::On, Direct::Off] {
            std::fs::write(&path, &data).expect("restore");
            let mut r = reader(backend, direct, 4, 16_384);
            let file = r.open(&path).expect("open");
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_len(50_000))
                .expect("truncate");
            let mut buf = vec![0u8; 30_000];
            let err = r.read_exact_at(file, 40_000, &mut buf).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::UnexpectedEof {
                        got: 10_000,
                        want: 30_000,
                        ..
                    }
                ),
                "{backend:?} {direct:?}: {err:?}"
            );
        }
    }
}

#[test]
fn requests_that_do_not_fit_their_buffer() {
    let (_dir, path, _) = disk_file(10_000, 3);
    let mut r = reader(Backend::Threads(1), Direct::Off, 2, 4096);
    let file = r.open(&path).expect("open");
    let mut results = Vec::new();
    r.read_all(
        [
            ReadOp::new(file, 0, vec![0u8; 100]).len(101),
            ReadOp::new(file, 0, vec![0u8; 100]).at(50).len(60),
            ReadOp::new(file, 0, vec![0u8; 0]),
        ],
        |c| results.push(c.result),
    )
    .expect("read_all");
    assert!(matches!(results[0], Err(Error::InvalidRequest(_))));
    assert!(matches!(results[1], Err(Error::InvalidRequest(_))));
    assert!(matches!(results[2], Ok(0)));
}

#[test]
fn direct_on_where_the_file_system_refuses_it() {
    // /dev/shm is tmpfs; depending on the kernel it accepts O_DIRECT or not.
    let path =
        std::path::Path::new("/dev/shm").join(format!("gpufeed-uring-test-{}", std::process::id()));
    std::fs::write(&path, vec![5u8; 10_000]).expect("write");
    let file = std::fs::File::open(&path).expect("open");
    let supported = gpufeed_os::align::dio_alignment(&file)
        .expect("dio")
        .supported();
    let mut on = reader(Backend::Threads(1), Direct::On, 2, 1 << 20);
    let mut auto = reader(Backend::Threads(1), Direct::Auto, 2, 1 << 20);
    gpufeed_os::cache::evict(&path).expect("evict (a no-op on tmpfs)");
    let result = on.open(&path);
    let auto_file = auto.open(&path).expect("Auto always opens");
    let _ = std::fs::remove_file(&path);
    if supported {
        eprintln!("tmpfs accepts O_DIRECT on this kernel");
        result.expect("supported");
    } else {
        let err = result.unwrap_err();
        assert!(matches!(err, Error::DirectUnsupported { .. }), "{err:?}");
        assert!(err.to_string().contains("Direct::Auto"), "{err}");
        assert_eq!(auto.is_direct(auto_file), Some(false));
        assert!(auto.stats().files[0].reason.is_some());
    }
    // Either way, tmpfs data is in the page cache: Auto reads it buffered, saying why.
    let mut buf = vec![0u8; 10_000];
    auto.read_exact_at(auto_file, 0, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 5));
}

/// A probe that says io_uring is refused: Auto falls back to threads with the reason, and an
/// explicit IoUring is an error. Run in a child without `GPUFEED_IO_BACKEND`, which would
/// otherwise decide the backend before any probe (so this passes whatever the caller's shell
/// sets).
#[test]
fn probe_override_falls_back_to_threads_with_the_reason() {
    let out = crate::child::run("probe-override");
    assert!(out.contains("CHILD-OK"), "{out}");
}

#[test]
fn io_uring_refused_by_seccomp_in_a_child_process() {
    let out = crate::child::run("seccomp");
    assert!(out.contains("CHILD-OK"), "{out}");
}
