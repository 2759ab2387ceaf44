//! The writer: every backend, O_DIRECT on and off, unaligned sizes, offsets and addresses,
//! bytes verified by reading the file back; a full file system for real.

use gpufeed_os::AlignedBuf;
use gpufeed_uring::{Backend, Direct, Refused, Writer};
use xxhash_rust::xxh3::xxh3_64;

use crate::{backends, random_bytes};

fn empty_file() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("out.bin");
    std::fs::File::create(&path).expect("create");
    (dir, path)
}

#[test]
fn writes_are_byte_exact_on_every_backend_aligned_or_not() {
    let seed = gpufeed_testkit::seed("writes_are_byte_exact");
    for backend in backends() {
        for direct in [Direct::Auto, Direct::Off] {
            for (k, &len) in [0usize, 1, 4095, 4097, (3 << 20) + 5].iter().enumerate() {
                let (_dir, path) = empty_file();
                let mut w = Writer::builder()
                    .backend(backend)
                    .direct(direct)
                    .queue_depth(4)
                    .block_bytes(256 << 10)
                    .open(&path)
                    .expect("open");
                let data = random_bytes(len, seed ^ k as u64);
                // An aligned buffer at an aligned offset (O_DIRECT for the aligned part) ...
                let mut aligned = AlignedBuf::new(len.max(1), 4096).expect("aligned");
                aligned[..len].copy_from_slice(&data);
                w.write_all_at(8192, &aligned[..len])
                    .expect("aligned write");
                // ... and a misaligned one at an odd offset after it (buffered).
                let at = 8192 + len as u64 + 7;
                w.write_all_at(at, &data[..]).expect("unaligned write");
                let back = std::fs::read(&path).expect("read back");
                let what = format!("{backend:?} {direct:?} {len} B");
                if len == 0 {
                    assert!(back.is_empty(), "{what}: writing nothing extends nothing");
                    continue;
                }
                assert_eq!(back.len() as u64, at + len as u64, "{what}");
                assert!(back[..8192].iter().all(|&b| b == 0), "{what}: hole");
                assert_eq!(xxh3_64(&back[8192..8192 + len]), xxh3_64(&data), "{what}");
                assert_eq!(xxh3_64(&back[at as usize..]), xxh3_64(&data), "{what}");
                let st = w.stats();
                assert_eq!(st.bytes, 2 * len as u64, "{what}");
                if direct == Direct::Off || !st.direct {
                    assert_eq!(st.direct_bytes, 0, "{what}");
                } else {
                    // Only whole aligned blocks of the aligned write go O_DIRECT.
                    let file = std::fs::File::open(&path).expect("open");
                    let align = gpufeed_os::align::dio_alignment(&file)
                        .expect("statx")
                        .offset_align as usize;
                    assert_eq!(
                        st.direct_bytes,
                        (len / align * align) as u64,
                        "{what}: {st:?}"
                    );
                    if len > 0 {
                        assert!(
                            st.fallbacks.iter().any(|f| f.refused == Refused::DirectIo),
                            "the unaligned write is recorded: {st:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn direct_auto_writes_directly_on_a_disk_file_system() {
    let (_dir, path) = empty_file();
    let w = Writer::builder()
        .direct(Direct::Auto)
        .open(&path)
        .expect("open");
    let dio = gpufeed_os::align::dio_alignment(&std::fs::File::open(&path).expect("open"))
        .expect("statx");
    assert_eq!(w.stats().direct, dio.supported(), "{:?}", w.stats());
}

#[test]
fn missing_files_and_directories_are_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = Writer::builder()
        .open(dir.path().join("missing.bin"))
        .unwrap_err();
    assert!(
        matches!(
            err,
            gpufeed_uring::Error::Os(gpufeed_os::Error::NotFound { .. })
        ),
        "{err:?}"
    );
    let err = Writer::builder().open(dir.path()).unwrap_err();
    assert!(
        err.to_string().contains(&*dir.path().to_string_lossy()),
        "{err}"
    );
}

#[test]
fn a_full_file_system_is_no_space_on_every_backend() {
    let tiny = match gpufeed_testkit::TestMount::tmpfs("1m") {
        Ok(t) => t,
        Err(why) => {
            gpufeed_testkit::skip_unless_root(
                "a_full_file_system_is_no_space",
                &format!("cannot mount a tmpfs here ({why})"),
            );
            return;
        }
    };
    for backend in [Backend::Threads(2)]
        .into_iter()
        .chain(backends().into_iter().filter(|b| *b == Backend::IoUring))
    {
        let path = tiny.path().join("big.bin");
        std::fs::File::create(&path).expect("create");
        let mut w = Writer::builder()
            .backend(backend)
            .open(&path)
            .expect("open");
        let err = w.write_all_at(0, &vec![1u8; 4 << 20]).unwrap_err();
        assert!(
            matches!(
                err,
                gpufeed_uring::Error::Os(gpufeed_os::Error::NoSpace { .. })
            ),
            "{backend:?}: {err:?}"
        );
        assert!(err.to_string().contains("not enough space"), "{err}");
        std::fs::remove_file(&path).expect("rm");
    }
}

#[test]
fn a_file_system_without_o_direct_is_written_buffered_with_the_reason() {
    let ramfs = match gpufeed_testkit::TestMount::ramfs() {
        Ok(m) => m,
        Err(why) => {
            gpufeed_testkit::skip_unless_root(
                "a_file_system_without_o_direct",
                &format!("cannot mount a ramfs here ({why})"),
            );
            return;
        }
    };
    let path = ramfs.path().join("out.bin");
    std::fs::File::create(&path).expect("create");
    let err = Writer::builder()
        .direct(Direct::On)
        .open(&path)
        .unwrap_err();
    assert!(
        matches!(err, gpufeed_uring::Error::DirectUnsupported { .. }),
        "{err:?}"
    );
    let mut w = Writer::builder()
        .direct(Direct::Auto)
        .open(&path)
        .expect("open");
    assert!(!w.stats().direct);
    assert!(
        w.stats()
            .fallbacks
            .iter()
            .any(|f| f.refused == Refused::DirectIo),
        "{:?}",
        w.stats()
    );
    let mut data = AlignedBuf::new(1 << 20, 4096).expect("aligned");
    data.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    w.write_all_at(0, &data).expect("buffered write");
    assert_eq!(w.stats().direct_bytes, 0);
    assert_eq!(std::fs::read(&path).expect("read"), &data[..]);
}
