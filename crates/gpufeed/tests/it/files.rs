//! Many files in one call: `FileList` on real folders (sizes, offsets, every kind of bad
//! entry named, skipping when asked), read into host memory on any machine and into GPU
//! memory where there is one, byte-exact by xxh3 per file.

use std::path::{Path, PathBuf};

use gpufeed::{FileList, LoadOptions, Loader, Strategy};
use xxhash_rust::xxh3::xxh3_64;

use crate::{gpu_or_skip, random_bytes};

/// `n` files of random bytes and sizes from 0 to `max` bytes (some empty, most unaligned) on
/// the disk under target/ (O_DIRECT needs a real file system).
fn folder(n: usize, max: usize, seed: u64) -> (tempfile::TempDir, Vec<PathBuf>, Vec<Vec<u8>>) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let mut paths = Vec::new();
    let mut contents = Vec::new();
    for i in 0..n {
        let len = if i % 17 == 3 {
            0
        } else {
            (i * 7919 + seed as usize) % max
        };
        let data = random_bytes(len, seed + i as u64);
        let path = dir.path().join(format!("{i:05}.bin"));
        std::fs::write(&path, &data).expect("write");
        paths.push(path);
        contents.push(data);
    }
    (dir, paths, contents)
}

/// Checks every file's bytes at its range of `all`.
fn check(list: &FileList, all: &[u8], contents: &[Vec<u8>], what: &str) {
    assert_eq!(list.len(), contents.len());
    for (i, want) in contents.iter().enumerate() {
        let r = list.range(i).expect("a range per file");
        let got = &all[r.start as usize..r.end as usize];
        assert_eq!(got.len(), want.len(), "{what}: file {i} size");
        assert_eq!(xxh3_64(got), xxh3_64(want), "{what}: file {i} differs");
    }
}

#[test]
fn a_folder_of_small_files_reads_byte_exact_into_host_memory() {
    // More files than the parallel listing threshold, sizes around an image's.
    let (_dir, paths, contents) = folder(700, 150_000, 11);
    let list = FileList::new(&paths).expect("list");
    let total: usize = contents.iter().map(Vec::len).sum();
    assert_eq!(list.total_bytes(), total as u64);
    assert_eq!(list.offsets().len(), 701);
    assert_eq!(list.paths(), paths.as_slice(), "the order given");
    let mut all = vec![0u8; total];
    list.read_into(&mut all).expect("read");
    check(&list, &all, &contents, "host");
    let e = list
        .read_into(&mut all[1..])
        .expect_err("a buffer of another size");
    assert!(e.to_string().contains("exactly"), "{e}");
    // An empty list is fine.
    let none = FileList::new(Vec::<PathBuf>::new()).expect("empty");
    assert_eq!((none.len(), none.total_bytes()), (0, 0));
    none.read_into(&mut []).expect("nothing to read");
}

/// Every bad entry is an error naming it, found without opening anything (a FIFO would block
/// an open); `new_skipping` leaves exactly those out, with their reasons and positions.
#[test]
fn bad_entries_are_named_or_skipped_when_asked() {
    let (dir, mut paths, contents) = folder(6, 5000, 21);
    let d = dir.path();
    let missing = d.join("missing.bin");
    let subdir = d.join("a-directory");
    std::fs::create_dir(&subdir).expect("mkdir");
    let fifo = d.join("a-fifo");
    gpufeed_testkit::mkfifo(&fifo);
    let (loop_a, loop_b) = (d.join("loop-a"), d.join("loop-b"));
    std::os::unix::fs::symlink(&loop_b, &loop_a).expect("symlink");
    std::os::unix::fs::symlink(&loop_a, &loop_b).expect("symlink");
    let bad = [missing, subdir, fifo, loop_a];
    for (k, b) in bad.iter().enumerate() {
        let mut with = paths.clone();
        with.insert(2 + k, b.clone());
        let e = FileList::new(&with).expect_err("a bad entry");
        assert!(
            e.to_string().contains(&b.display().to_string()),
            "{} not named in: {e}",
            b.display()
        );
    }
    // All four at once, skipped.
    let good = paths.len();
    for (k, b) in bad.iter().enumerate() {
        paths.insert(1 + 2 * k, b.clone());
    }
    let list = FileList::new_skipping(&paths).expect("skipping");
    assert_eq!(list.len(), good);
    let skipped: Vec<(usize, &Path)> = list
        .skipped()
        .iter()
        .map(|s| (s.index, s.path.as_path()))
        .collect();
    assert_eq!(
        skipped,
        bad.iter()
            .enumerate()
            .map(|(k, b)| (1 + 2 * k, b.as_path()))
            .collect::<Vec<_>>()
    );
    assert!(list.skipped().iter().all(|s| !s.reason.is_empty()));
    let mut all = vec![0u8; list.total_bytes() as usize];
    list.read_into(&mut all).expect("read the rest");
    check(&list, &all, &contents, "skipping");
}

/// A file deleted or truncated after it was listed is an error naming it, not a wrong byte.
#[test]
fn a_file_that_changes_after_listing_is_named() {
    let (_dir, paths, _) = folder(40, 20_000, 31);
    let list = FileList::new(&paths).expect("list");
    let mut all = vec![0u8; list.total_bytes() as usize];
    let gone = &paths[7];
    std::fs::remove_file(gone).expect("rm");
    let e = list.read_into(&mut all).expect_err("a vanished file");
    assert!(e.to_string().contains(&gone.display().to_string()), "{e}");
    std::fs::write(gone, vec![1u8; list.range(7).unwrap().end as usize]).expect("put back");
    let cut = &paths[21];
    let r = list.range(21).expect("file 21");
    assert!(r.end - r.start > 2, "a file to truncate");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(cut)
        .expect("open");
    f.set_len((r.end - r.start) / 2).expect("truncate");
    let e = list.read_into(&mut all).expect_err("a truncated file");
    assert!(
        matches!(&e, gpufeed::Error::Read(gpufeed::uring::Error::UnexpectedEof { path, .. }) if path == cut),
        "{e:?}"
    );
}

/// Into GPU memory: buffered and O_DIRECT, into a new buffer and at an offset of a caller's,
/// one per-file check each; a vanished file is named and the loader goes on working.
#[test]
fn a_folder_of_small_files_loads_byte_exact_into_gpu_memory() {
    let Some(gpu) = gpu_or_skip("a_folder_of_small_files_loads_byte_exact_into_gpu_memory") else {
        return;
    };
    let (_dir, paths, contents) = folder(1500, 200_000, 41);
    for strategy in [Strategy::Auto, Strategy::Staged, Strategy::Direct] {
        let loader =
            Loader::new(&gpu, LoadOptions::default().with_strategy(strategy)).expect("loader");
        let (buf, list, report) = loader.load_files(&paths).expect("load");
        assert_eq!(report.files, 1500);
        assert_eq!(report.bytes, list.total_bytes());
        if strategy != Strategy::Auto {
            assert_eq!(report.strategy, strategy);
        }
        check(
            &list,
            &gpu.to_vec(&buf).expect("back"),
            &contents,
            &format!("{strategy}"),
        );
        let mut big = gpu
            .alloc_zeroed(list.total_bytes() as usize + 4099)
            .expect("alloc");
        loader.load_list_into(&list, &mut big, 4099).expect("into");
        let back = gpu.to_vec(&big).expect("back");
        check(
            &list,
            &back[4099..],
            &contents,
            &format!("{strategy} at 4099"),
        );
        assert!(
            back[..4099].iter().all(|&b| b == 0),
            "bytes before the offset untouched"
        );
    }
    let loader = Loader::new(&gpu, LoadOptions::default()).expect("loader");
    let list = FileList::new(&paths).expect("list");
    std::fs::remove_file(&paths[999]).expect("rm");
    let e = loader.load_list(&list).expect_err("a vanished file");
    assert!(
        e.to_string().contains(&paths[999].display().to_string()),
        "{e}"
    );
    let (buf, report) = loader
        .load_list(&FileList::new(&paths[..999]).expect("list"))
        .expect("after");
    assert_eq!(report.files, 999);
    check(
        &FileList::new(&paths[..999]).expect("list"),
        &gpu.to_vec(&buf).expect("back"),
        &contents[..999],
        "after an error",
    );
}
