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

/// A file deleted, truncated or grown after it was listed is an error naming it, not a wrong
/// byte (a grown one had been read cut to its listed size).
#[test]
fn a_file_that_changes_after_listing_is_named() {
    let (_dir, paths, _) = folder(40, 20_000, 31);
    let list = FileList::new(&paths).expect("list");
    let mut all = vec![0u8; list.total_bytes() as usize];
    let gone = &paths[7];
    std::fs::remove_file(gone).expect("rm");
    let e = list.read_into(&mut all).expect_err("a vanished file");
    assert!(e.to_string().contains(&gone.display().to_string()), "{e}");
    let r7 = list.range(7).expect("file 7");
    // Put back at another size: named with both sizes.
    std::fs::write(gone, vec![1u8; (r7.end - r7.start + 1) as usize]).expect("put back");
    let e = list.read_into(&mut all).expect_err("a grown file");
    assert!(
        matches!(&e, gpufeed::load::Error::FileChangedDuringLoad { path, what } if path == gone && what.contains(&format!("{} bytes when the files were listed", r7.end - r7.start))),
        "{e:?}"
    );
    std::fs::write(gone, vec![1u8; (r7.end - r7.start) as usize]).expect("put back");
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
        matches!(&e, gpufeed::load::Error::FileChangedDuringLoad { path, .. } if path == cut),
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

/// An image folder: classes from sorted subfolder names (nested files included, files in the
/// root left out), batches in the sampler's order (shuffled, then sharded), every sample's
/// bytes and label right, host batches here; on the disk, and in memory (`/dev/shm`, whose
/// files the workers read on their own threads, not through io_uring).
#[test]
fn image_folder_batches_follow_the_sampler_with_labels() {
    image_folder_batches_in(Path::new(env!("CARGO_TARGET_TMPDIR")));
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        image_folder_batches_in(shm);
    } else {
        gpufeed_testkit::skip("an image folder in memory", &"no /dev/shm here");
    }
}

fn image_folder_batches_in(base: &Path) {
    use gpufeed::dataset::{
        BatchData, BatchLoader, BatchLoaderOptions, ImageFolder, Order, Sampler,
    };
    let dir = tempfile::tempdir_in(base).expect("tempdir");
    let root = dir.path();
    std::fs::write(root.join("README.txt"), b"not a sample").expect("write");
    let mut want: Vec<(PathBuf, u32, Vec<u8>)> = Vec::new();
    for (label, class, n) in [(1u32, "cat", 9usize), (2, "zebra", 5), (0, "ant", 12)] {
        let d = root.join(class);
        std::fs::create_dir_all(d.join("deeper")).expect("mkdir");
        for i in 0..n {
            let sub = if i % 4 == 0 {
                d.join("deeper")
            } else {
                d.clone()
            };
            let data = random_bytes(
                1000 + i * 977 + label as usize,
                60 + i as u64 + 100 * label as u64,
            );
            let path = sub.join(format!("{i:03}.raw"));
            std::fs::write(&path, &data).expect("write");
            want.push((path, label, data));
        }
    }
    let folder = ImageFolder::open(root).expect("open");
    assert_eq!(folder.classes(), ["ant", "cat", "zebra"]);
    assert_eq!(folder.len(), 26);
    let by_path = |p: &Path| want.iter().find(|w| w.0 == p).expect("a sample we wrote");
    for (i, p) in folder.files().paths().iter().enumerate() {
        assert_eq!(folder.labels()[i], by_path(p).1, "{}", p.display());
    }
    let paths: Vec<PathBuf> = folder.files().paths().to_vec();
    for (rank, world) in [(0usize, 1usize), (1, 2)] {
        let sampler = Sampler::new(Order::Shuffled { seed: 5 })
            .shard(rank, world, false)
            .expect("shard");
        let order = sampler.epoch(folder.len(), 3);
        let cfg = BatchLoaderOptions::default()
            .with_batch_size(7)
            .with_workers(3);
        let mut loader = BatchLoader::new(folder.clone(), sampler, cfg, None).expect("loader");
        let mut seen = Vec::new();
        for batch in loader.epoch(3).expect("epoch") {
            let batch = batch.expect("batch");
            let BatchData::Host(buf) = &batch.data else {
                panic!("host batches without a GPU");
            };
            assert_eq!(batch.labels.len(), batch.indices.len());
            for (k, &i) in batch.indices.iter().enumerate() {
                let (_, label, data) = by_path(&paths[i]);
                let got = &buf[batch.offsets[k]..batch.offsets[k + 1]];
                assert_eq!(xxh3_64(got), xxh3_64(data), "sample {i}");
                assert_eq!(batch.labels[k], *label, "sample {i}");
            }
            seen.extend(batch.indices);
        }
        assert_eq!(seen, order, "rank {rank} of {world}: the sampler's order");
    }
    // A transform sees each file's bytes.
    let mut loader = BatchLoader::new(
        folder,
        Sampler::new(Order::Sequential),
        BatchLoaderOptions::default().with_batch_size(26),
        None,
    )
    .expect("loader")
    .with_transform(|_, bytes, out| {
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        Ok(())
    });
    let batch = loader
        .epoch(0)
        .expect("epoch")
        .next()
        .expect("one")
        .expect("batch");
    let BatchData::Host(buf) = &batch.data else {
        panic!("host");
    };
    for (k, &i) in batch.indices.iter().enumerate() {
        let len = u32::from_le_bytes(buf[4 * k..4 * k + 4].try_into().unwrap());
        assert_eq!(len as usize, by_path(&paths[i]).2.len());
    }
}

/// Bad entries of an image folder are named, or skipped when asked; an empty or missing root
/// is an error naming it.
#[test]
fn image_folder_bad_entries_are_named_or_skipped() {
    use gpufeed::dataset::ImageFolder;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let root = dir.path();
    let e = ImageFolder::open(root).expect_err("no class folder");
    assert!(e.to_string().contains("no class folder"), "{e}");
    let e = ImageFolder::open(root.join("nope")).expect_err("missing root");
    assert!(e.to_string().contains("nope"), "{e}");
    let class = root.join("a");
    std::fs::create_dir(&class).expect("mkdir");
    let e = ImageFolder::open(root).expect_err("no file");
    assert!(e.to_string().contains("no file"), "{e}");
    for i in 0..3 {
        std::fs::write(class.join(format!("{i}.bin")), vec![i as u8; 100]).expect("write");
    }
    let fifo = class.join("f.fifo");
    gpufeed_testkit::mkfifo(&fifo);
    let e = ImageFolder::open(root).expect_err("a FIFO");
    assert!(e.to_string().contains("f.fifo"), "{e}");
    let looped = class.join("loop");
    std::os::unix::fs::symlink(&class, &looped).expect("symlink");
    let dangling = class.join("dangling.bin");
    std::os::unix::fs::symlink(root.join("gone"), &dangling).expect("symlink");
    let skipping = ImageFolder::open_skipping(root).expect("skipping");
    assert_eq!(skipping.len(), 3, "{:?}", skipping.skipped());
    let named: Vec<&Path> = skipping
        .skipped()
        .iter()
        .map(|s| s.path.as_path())
        .collect();
    for bad in [&fifo, &looped, &dangling] {
        assert!(
            named.contains(&bad.as_path()),
            "{} not in {named:?}",
            bad.display()
        );
    }
    std::fs::remove_file(&fifo).expect("rm");
    std::fs::remove_file(&dangling).expect("rm");
    let e = ImageFolder::open(root).expect_err("a symlink loop");
    assert!(e.to_string().contains("second time"), "{e}");
}

/// Image-folder batches on the GPU: every batch's device bytes are its files', in order.
#[test]
fn image_folder_device_batches_are_byte_exact() {
    use gpufeed::dataset::{
        BatchData, BatchLoader, BatchLoaderOptions, ImageFolder, Order, Sampler,
    };
    let Some(gpu) = gpu_or_skip("image_folder_device_batches_are_byte_exact") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    for class in ["x", "y"] {
        std::fs::create_dir(dir.path().join(class)).expect("mkdir");
        for i in 0..300usize {
            let data = random_bytes(5000 + i * 331, i as u64 + class.len() as u64 * 1000);
            std::fs::write(dir.path().join(class).join(format!("{i}.bin")), data).expect("write");
        }
    }
    let folder = ImageFolder::open(dir.path()).expect("open");
    let paths = folder.files().paths().to_vec();
    let cfg = BatchLoaderOptions::default()
        .with_batch_size(64)
        .with_workers(4);
    let mut loader = BatchLoader::new(
        folder,
        Sampler::new(Order::Shuffled { seed: 9 }),
        cfg,
        Some(&gpu),
    )
    .expect("loader");
    let mut samples = 0;
    for batch in loader.epoch(0).expect("epoch") {
        let batch = batch.expect("batch");
        let BatchData::Device(buf) = &batch.data else {
            panic!("device batches with a GPU");
        };
        let want: Vec<u8> = batch
            .indices
            .iter()
            .flat_map(|&i| std::fs::read(&paths[i]).expect("read"))
            .collect();
        assert_eq!(
            xxh3_64(&gpu.to_vec(buf).expect("back")),
            xxh3_64(&want),
            "batch {}",
            batch.number
        );
        assert!(batch.labels.iter().all(|&l| l < 2));
        samples += batch.indices.len();
    }
    assert_eq!(samples, 600);
}
