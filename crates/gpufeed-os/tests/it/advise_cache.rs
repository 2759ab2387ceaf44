use std::path::PathBuf;

use gpufeed_os::advise::{self, FileAdvice, MemAdvice};
use gpufeed_os::cache::{self, ResidencyMethod};
use gpufeed_os::{AlignedBuf, Error};

use crate::random_bytes;

/// A file on a disk file system (the page cache of tmpfs cannot be evicted).
fn disk_file(len: usize, seed: u64) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("data.bin");
    std::fs::write(&path, random_bytes(len, seed)).expect("write");
    (dir, path)
}

#[test]
fn every_file_advice_is_accepted() {
    let (_dir, path) = disk_file(100_000, 1);
    let file = std::fs::File::open(&path).expect("open");
    for advice in [
        FileAdvice::Normal,
        FileAdvice::Sequential,
        FileAdvice::Random,
        FileAdvice::WillNeed,
        FileAdvice::DontNeed,
        FileAdvice::NoReuse,
    ] {
        advise::fadvise(&file, 1, 5000, advice).unwrap_or_else(|e| panic!("{advice:?}: {e}"));
    }
    advise::readahead(&file, 4097, 50_000).expect("readahead");
    let dir = std::fs::File::open(_dir.path()).expect("open dir");
    assert!(
        advise::readahead(&dir, 0, 10).is_err(),
        "readahead of a directory is EINVAL"
    );
}

#[test]
fn memory_advice_on_mapped_and_unmapped_memory() {
    let buf = AlignedBuf::new(4 << 20, 2 << 20).expect("alloc");
    for advice in [
        MemAdvice::Normal,
        MemAdvice::Sequential,
        MemAdvice::Random,
        MemAdvice::WillNeed,
        MemAdvice::HugePage,
        MemAdvice::NoHugePage,
        MemAdvice::PopulateRead,
        MemAdvice::PopulateWrite,
        MemAdvice::Cold,
    ] {
        advise::madvise(buf.as_ptr(), buf.len(), advice)
            .unwrap_or_else(|e| panic!("{advice:?}: {e}"));
    }
    assert!(
        buf.iter().all(|&b| b == 0),
        "advice changed memory contents"
    );
    // An address range that is not mapped: an error, not a crash.
    let freed = AlignedBuf::new(1 << 20, 4096).expect("alloc");
    let ptr = freed.as_ptr();
    drop(freed);
    let err = advise::madvise(ptr, 1 << 20, MemAdvice::WillNeed).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOMEM), "{err}");
}

#[test]
fn residency_follows_warm_and_evict() {
    let (_dir, path) = disk_file(8 * 1024 * 1024 + 100, 2);
    let evicted = cache::evict(&path).expect("evict");
    assert_eq!(
        evicted.total_pages,
        (8 * 1024 * 1024 + 100u64).div_ceil(evicted.page_size)
    );
    assert!(evicted.fraction() < 0.05, "after evict: {evicted:?}");

    let mut calls = 0;
    let mut last = (0, 0);
    let warmed = cache::warm_with_progress(&path, |done, total| {
        calls += 1;
        last = (done, total);
    })
    .expect("warm");
    assert_eq!(
        warmed.resident_pages, warmed.total_pages,
        "after warm: {warmed:?}"
    );
    assert_eq!(last, (8 * 1024 * 1024 + 100, 8 * 1024 * 1024 + 100));
    assert!(calls >= 2, "progress reported {calls} times");
    assert_eq!(warmed.resident_bytes(), 8 * 1024 * 1024 + 100);

    // Both methods agree (where the kernel has cachestat).
    let file = std::fs::File::open(&path).expect("open");
    let by_mincore = cache::residency_with(&file, ResidencyMethod::Mincore).expect("mincore");
    assert_eq!(by_mincore.resident_pages, warmed.resident_pages);
    assert!(!by_mincore.approximate, "we own the file");
    match cache::residency_with(&file, ResidencyMethod::Cachestat) {
        Ok(exact) => {
            assert_eq!(exact.resident_pages, by_mincore.resident_pages);
            assert_eq!(warmed.method, ResidencyMethod::Cachestat);
        }
        Err(Error::Unsupported { reason, .. }) => {
            eprintln!("cachestat unavailable here ({reason}); mincore used");
            assert_eq!(warmed.method, ResidencyMethod::Mincore);
        }
        Err(other) => panic!("cachestat: {other}"),
    }
    let evicted = cache::evict(&path).expect("evict");
    let by_mincore = cache::residency_with(&file, ResidencyMethod::Mincore).expect("mincore");
    assert!(evicted.fraction() < 0.05 && by_mincore.fraction() < 0.05);
}

#[test]
fn residency_of_bad_paths_and_empty_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    assert!(matches!(
        cache::residency(dir.path().join("nope")),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        cache::residency(dir.path()),
        Err(Error::IsDirectory { .. })
    ));
    assert!(matches!(
        cache::warm(dir.path()),
        Err(Error::IsDirectory { .. })
    ));
    assert!(matches!(
        cache::evict(dir.path().join("nope")),
        Err(Error::NotFound { .. })
    ));
    let empty = dir.path().join("empty");
    std::fs::write(&empty, b"").expect("write");
    let r = cache::warm(&empty).expect("warm of an empty file");
    assert_eq!((r.total_pages, r.fraction()), (0, 1.0));
}

#[test]
fn residency_estimates_follow_what_was_read() {
    use std::os::unix::fs::FileExt;
    const MIB: u64 = 1 << 20;
    let len = 96 * MIB + 4097;
    let (_dir, path) = disk_file(len as usize, 3);
    cache::evict(&path).expect("evict");
    // Read the first 48 MiB: that half is cached, the last 40 MiB (past any readahead) not.
    let file = std::fs::File::open(&path).expect("open");
    let mut buf = vec![0u8; MIB as usize];
    for off in (0..48 * MIB).step_by(MIB as usize) {
        file.read_exact_at(&mut buf, off).expect("read");
    }
    let methods = match cache::residency_with(&file, ResidencyMethod::Cachestat) {
        Ok(_) => vec![ResidencyMethod::Cachestat, ResidencyMethod::Mincore],
        Err(e) => {
            eprintln!("cachestat unavailable here ({e}); mincore only");
            vec![ResidencyMethod::Mincore]
        }
    };
    for method in methods {
        let est = |r: std::ops::Range<u64>| {
            cache::residency_estimate_with(&file, r, method).expect("estimate")
        };
        let whole = est(0..len);
        assert!(whole.approximate);
        assert_eq!(whole.method, method);
        assert_eq!(
            whole.total_pages,
            32 * MIB / whole.page_size,
            "32 windows of 1 MiB"
        );
        assert!(
            (0.4..=0.6).contains(&whole.fraction()),
            "{method:?}: half read, estimated {whole:?}"
        );
        assert!(
            est(0..48 * MIB).fraction() >= 0.95,
            "{method:?}: the read half"
        );
        assert!(
            est(56 * MIB..len).fraction() <= 0.05,
            "{method:?}: the unread part"
        );
        // Small ranges are counted exactly, also unaligned ones.
        let small = est(4097..4097 + 3 * MIB);
        assert_eq!(small.total_pages, 3 * MIB / small.page_size + 1);
        assert_eq!(small.resident_pages, small.total_pages);
        assert!(matches!(
            cache::residency_estimate_with(&file, 0..len + 1, method),
            Err(Error::RangePastEof { .. })
        ));
    }
    let by_path = cache::residency_estimate(&path, 0..len).expect("estimate by path");
    assert!((0.4..=0.6).contains(&by_path.fraction()), "{by_path:?}");
    assert!(matches!(
        cache::residency_estimate(path.with_extension("missing"), 0..1),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        cache::residency_estimate(&path, 0..len + 1),
        Err(Error::RangePastEof { .. })
    ));
}

/// A sparse file twice the size of the machine's memory is refused before a byte is read
/// (reading it through would take long and evict everything else), with what to do.
#[test]
fn warming_a_file_larger_than_memory_is_refused_before_reading() {
    let mem_total = std::fs::read_to_string("/proc/meminfo")
        .expect("meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .expect("MemTotal")
        * 1024;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("sparse.bin");
    let f = std::fs::File::create(&path).expect("create");
    f.set_len(2 * mem_total)
        .expect("a sparse file of twice the memory");
    drop(f);
    let r = cache::warm_with_progress(&path, |done, _| {
        assert!(
            done <= 64 << 20,
            "warm read {done} bytes of a file larger than memory"
        );
    });
    match r {
        Err(Error::FileLargerThanMemory {
            size, mem_total: m, ..
        }) => {
            assert_eq!((size, m), (2 * mem_total, mem_total));
        }
        other => panic!("{other:?}"),
    }
    let err = cache::warm(&path).unwrap_err();
    assert!(err.to_string().contains("MemTotal"), "{err}");
}
