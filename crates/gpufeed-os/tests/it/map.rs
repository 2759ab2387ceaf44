use std::path::Path;

use gpufeed_os::advise::MemAdvice;
use gpufeed_os::{Error, FileMap, FilesMap, MapMode};
use proptest::prelude::*;

use crate::{random_bytes, seed};

fn write_file(dir: &Path, name: &str, data: &[u8]) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, data).expect("write file");
    path
}

// SAFETY (for every `unsafe` map in this file): the files live in a private temporary
// directory and nothing truncates them while they are mapped, except where a test does so on
// purpose without touching the mapping afterwards.

#[test]
fn bad_input_gets_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("missing.bin");
    // SAFETY: see the top of the file.
    let err = unsafe { FileMap::open(&missing, MapMode::ReadOnly) }.unwrap_err();
    assert!(
        matches!(&err, Error::NotFound { path } if path == &missing),
        "{err:?}"
    );
    assert!(err.to_string().contains("check the path"), "{err}");

    // SAFETY: see the top of the file.
    let err = unsafe { FileMap::open(dir.path(), MapMode::ReadOnly) }.unwrap_err();
    assert!(matches!(err, Error::IsDirectory { .. }), "{err:?}");
    assert!(err.to_string().contains("regular file"), "{err}");

    let empty = write_file(dir.path(), "empty.bin", b"");
    // SAFETY: see the top of the file.
    let err = unsafe { FileMap::open(&empty, MapMode::ReadOnly) }.unwrap_err();
    assert!(matches!(err, Error::EmptyFile { .. }), "{err:?}");
    assert!(err.to_string().contains("fully written"), "{err}");

    let small = write_file(dir.path(), "small.bin", &[7u8; 100]);
    for (offset, len) in [(50, 51), (100, 1), (200, 1), (u64::MAX, 2)] {
        // SAFETY: see the top of the file.
        let err =
            unsafe { FileMap::open_range(&small, offset, len, MapMode::ReadOnly) }.unwrap_err();
        assert!(
            matches!(err, Error::RangePastEof { file_len: 100, .. }),
            "[{offset}, +{len}): {err:?}"
        );
        assert!(err.to_string().contains("inside the file"), "{err}");
    }
    // SAFETY: see the top of the file.
    let err = unsafe { FileMap::open_range(&small, 0, 0, MapMode::ReadOnly) }.unwrap_err();
    assert!(matches!(err, Error::ZeroLength { .. }), "{err:?}");
    // SAFETY: see the top of the file.
    let err = unsafe { FileMap::open_range(&small, 100, 5, MapMode::Private) }.unwrap_err();
    assert!(
        matches!(err, Error::RangePastEof { offset: 100, .. }),
        "{err:?}"
    );
    // SAFETY: /dev/null is refused before anything is mapped.
    let err = unsafe { FileMap::open("/dev/null", MapMode::ReadOnly) }.unwrap_err();
    assert!(matches!(err, Error::NotRegularFile { .. }), "{err:?}");
}

fn data_file() -> &'static (tempfile::TempDir, std::path::PathBuf, Vec<u8>) {
    static FILE: std::sync::OnceLock<(tempfile::TempDir, std::path::PathBuf, Vec<u8>)> =
        std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = random_bytes(3 * 1024 * 1024 + 4097, seed("map data file"));
        let path = write_file(dir.path(), "data.bin", &data);
        (dir, path, data)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn mapped_ranges_hold_the_file_bytes(
        offset in 0u64..(3 * 1024 * 1024 + 4096),
        len in 1u64..(1024 * 1024),
        mode in prop_oneof![Just(MapMode::ReadOnly), Just(MapMode::Private)],
    ) {
        let (_, path, data) = data_file();
        let len = len.min(data.len() as u64 - offset);
        prop_assume!(len > 0);
        // SAFETY: see the top of the file.
        let map = unsafe { FileMap::open_range(path, offset, len, mode) }.expect("map");
        prop_assert_eq!(map.len() as u64, len);
        prop_assert_eq!(map.offset(), offset);
        prop_assert!(map[..] == data[offset as usize..(offset + len) as usize]);
    }
}

#[test]
fn private_writes_stay_private_and_shared_writes_reach_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = random_bytes(10_000, 3);
    let path = write_file(dir.path(), "f.bin", &data);

    // SAFETY: see the top of the file.
    let mut private = unsafe { FileMap::open(&path, MapMode::Private) }.expect("map");
    private.as_mut_slice().expect("writable")[5000] ^= 0xFF;
    assert_ne!(private[5000], data[5000]);
    assert_eq!(
        std::fs::read(&path).expect("read"),
        data,
        "a private write reached the file"
    );

    // SAFETY: see the top of the file.
    let mut ro = unsafe { FileMap::open(&path, MapMode::ReadOnly) }.expect("map");
    assert!(
        ro.as_mut_slice().is_none(),
        "read-only maps have no mutable view"
    );

    // SAFETY: see the top of the file.
    let mut shared =
        unsafe { FileMap::open_range(&path, 4097, 100, MapMode::Shared) }.expect("map");
    shared.as_mut_slice().expect("writable")[..4].copy_from_slice(b"GPU!");
    shared.flush().expect("msync");
    let on_disk = std::fs::read(&path).expect("read");
    assert_eq!(&on_disk[4097..4101], b"GPU!");
    assert_eq!(
        &ro[4097..4101],
        b"GPU!",
        "the shared page cache shows the write"
    );
}

#[test]
fn changes_to_the_file_are_detected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_file(dir.path(), "f.bin", &random_bytes(8192, 4));
    // SAFETY: see the top of the file; the test only grows the file and rewrites its mtime.
    let map = unsafe { FileMap::open(&path, MapMode::ReadOnly) }.expect("map");
    map.verify_unchanged().expect("nothing changed yet");
    assert_eq!(map.identity().size, 8192);

    let file = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .expect("open");
    use std::io::Write;
    (&file).write_all(b"more").expect("append");
    let err = map.verify_unchanged().unwrap_err();
    assert!(
        matches!(&err, Error::FileChanged { what, .. } if what.contains("8192 -> 8196")),
        "{err:?}"
    );
    assert!(err.to_string().contains("SIGBUS"), "{err}");

    // SAFETY: as above.
    let map = unsafe { FileMap::open(&path, MapMode::ReadOnly) }.expect("map");
    file.set_modified(std::time::SystemTime::UNIX_EPOCH)
        .expect("set mtime");
    let err = map.verify_unchanged().unwrap_err();
    assert!(
        matches!(&err, Error::FileChanged { what, .. } if what.contains("mtime")),
        "{err:?}"
    );
}

#[test]
fn populate_advise_and_lock() {
    let (_, path, data) = data_file();
    // SAFETY: see the top of the file.
    let map = unsafe { FileMap::open_range(path, 1, 1024 * 1024, MapMode::ReadOnly) }.expect("map");
    map.populate().expect("populate");
    for advice in [
        MemAdvice::Sequential,
        MemAdvice::Random,
        MemAdvice::WillNeed,
        MemAdvice::Normal,
    ] {
        map.advise(advice)
            .unwrap_or_else(|e| panic!("{advice:?}: {e}"));
    }
    // SAFETY: see the top of the file.
    let small = unsafe { FileMap::open_range(path, 0, 8192, MapMode::ReadOnly) }.expect("map");
    let _serial = crate::mlock_serial();
    let locked = small.lock().expect("8 KiB fits every memlock limit");
    assert_eq!(locked.len(), 8192);
    assert_eq!(&small[..], &data[..8192]);
}

/// A mapped file that really shrinks: the change is reported (size before and after), and
/// faulting the mapping in through `populate` (MADV_POPULATE_READ) is an error, not the
/// SIGBUS a CPU read of the lost pages would raise.
#[test]
fn a_mapped_file_that_shrinks_is_detected_without_sigbus() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_file(dir.path(), "f.bin", &random_bytes(64 * 1024, 5));
    // SAFETY: this test never reads the mapping's memory with the CPU after the truncation;
    // it only asks the kernel about it.
    let map = unsafe { FileMap::open(&path, MapMode::ReadOnly) }.expect("map");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|f| f.set_len(4096))
        .expect("truncate");
    let err = map.verify_unchanged().unwrap_err();
    assert!(
        matches!(&err, Error::FileChanged { what, .. } if what == "size 65536 -> 4096 bytes"),
        "{err:?}"
    );
    let populated = map.populate();
    assert!(populated.is_err(), "populating lost pages succeeded");
}

/// Files of unaligned sizes (empty ones among them) mapped side by side: each file's bytes at
/// its page-aligned offset, equal to the file by hash; the tail of each file's last page reads
/// as zero; nothing else of the range is a file's.
#[test]
fn files_side_by_side_each_start_at_a_page_and_read_back_exactly() {
    let seed = seed("files_side_by_side_each_start_at_a_page_and_read_back_exactly");
    let dir = tempfile::tempdir().expect("tempdir");
    let page = gpufeed_os::page_size();
    let sizes = [1usize, 4095, 0, 4096, 4097, 70_001, 0, 13];
    let made: Vec<(std::path::PathBuf, Vec<u8>)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let data = random_bytes(n, seed ^ i as u64);
            (write_file(dir.path(), &format!("f{i}"), &data), data)
        })
        .collect();
    // SAFETY: see the top of the file.
    let map = unsafe { FilesMap::open(made.iter().map(|(p, d)| (p.as_path(), d.len() as u64))) }
        .expect("map the files");
    assert_eq!(map.files(), sizes.len());
    let pages: usize = sizes.iter().map(|n| n.div_ceil(page)).sum();
    assert_eq!(map.len(), pages * page);
    assert_eq!(map.as_ptr() as usize % page, 0);
    let mut at = 0;
    for (i, (_, data)) in made.iter().enumerate() {
        assert_eq!(map.offset_of(i), Some(at), "file {i}");
        let got = map.file(i).expect("a file of the map");
        assert_eq!(
            xxhash_rust::xxh3::xxh3_64(got),
            xxhash_rust::xxh3::xxh3_64(data),
            "file {i} ({} bytes, seed {seed})",
            data.len()
        );
        if !data.is_empty() {
            // The rest of its last page: zeros, readable.
            let end = at + data.len().next_multiple_of(page);
            // SAFETY: `at..end` lies in the map's range, every page of it mapped from file
            // `i`, which nobody truncates.
            let tail = unsafe {
                std::slice::from_raw_parts(map.as_ptr().add(at + data.len()), end - at - data.len())
            };
            assert!(tail.iter().all(|&b| b == 0), "file {i}'s last page");
            at = end;
        }
    }
    assert_eq!(map.file(sizes.len()), None);
    assert_eq!(map.offset_of(sizes.len()), None);
}

/// A file whose size differs from the listed one, a missing file and a directory are errors
/// naming the file; no files at all (or only empty ones) map nothing.
#[test]
fn files_that_are_not_as_listed_are_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = write_file(dir.path(), "a", b"twelve bytes");
    let missing = dir.path().join("missing");
    // SAFETY: see the top of the file.
    let err = unsafe { FilesMap::open([(a.as_path(), 12), (a.as_path(), 11)]) }.unwrap_err();
    assert!(
        matches!(&err, Error::FileChanged { path, what } if path == &a && what.contains("size 11 when listed, 12 now")),
        "{err:?}"
    );
    // SAFETY: see the top of the file.
    let err = unsafe { FilesMap::open([(a.as_path(), 12), (missing.as_path(), 3)]) }.unwrap_err();
    assert!(
        matches!(&err, Error::NotFound { path } if path == &missing),
        "{err:?}"
    );
    // SAFETY: see the top of the file.
    let err = unsafe { FilesMap::open([(dir.path(), 1)]) }.unwrap_err();
    assert!(matches!(&err, Error::IsDirectory { .. }), "{err:?}");
    let empty = write_file(dir.path(), "empty", b"");
    // SAFETY: see the top of the file.
    let none = unsafe { FilesMap::open([(empty.as_path(), 0)]) }.expect("an empty file");
    assert!(none.is_empty());
    assert_eq!(none.file(0), Some(&[][..]));
    // SAFETY: nothing is mapped.
    let nothing = unsafe { FilesMap::open(std::iter::empty()) }.expect("no files");
    assert_eq!((nothing.files(), nothing.len()), (0, 0));
}

/// Files on tmpfs (`/dev/shm` where it is one) are counted as in memory already (page-locking
/// them takes no new memory); files on a disk are not. Each folder's expectation comes from
/// its own file system's type, not from this machine's mounts.
#[test]
fn files_in_memory_are_counted_as_such() {
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    for dir in [std::path::Path::new("/dev/shm"), disk.path()] {
        if !dir.is_dir() {
            println!("SKIP {}: not here", dir.display());
            continue;
        }
        let d = tempfile::tempdir_in(dir).expect("tempdir");
        let a = write_file(d.path(), "a", &random_bytes(5000, 1));
        let b = write_file(d.path(), "b", &random_bytes(123, 2));
        let (_, _, f_type) = gpufeed_os::file::open_regular_on(&a, false).expect("open");
        let in_memory = f_type.is_some_and(gpufeed_os::file::in_memory_fs);
        // SAFETY: see the top of the file.
        let map =
            unsafe { FilesMap::open([(a.as_path(), 5000), (b.as_path(), 123)]) }.expect("map");
        assert_eq!(
            map.in_memory_bytes(),
            if in_memory { 5123 } else { 0 },
            "{} (f_type {f_type:?})",
            dir.display()
        );
    }
}
