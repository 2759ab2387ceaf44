//! `BatchLoaderOptions::gpu_gather`: the GPU gathers each batch's records out of the record
//! file's registered mapping. Refused clearly where it cannot apply; on a GPU, every batch's
//! bytes are checked against the file at record sizes that take the kernel's 16-byte path and
//! its byte path, over several epochs, a smaller last batch, every batch counted as the GPU's;
//! with a transform the workers gather; records of several lengths are refused. A folder's
//! files (mapped side by side) are gathered by the span kernel at every awkward size; a file
//! changed since it was listed is refused by name.

use gpufeed_data::{
    BatchData, BatchLoader, BatchLoaderOptions, ImageFolder, Order, RecordFile, Sampler,
};
use gpufeed_load::Gpu;

use crate::{gpu_or_skip, random_bytes};

/// A file of `count` random records of `size` bytes (`seed`) in a new folder on the disk.
fn file(size: usize, count: usize, seed: u64) -> (tempfile::TempDir, Vec<u8>, RecordFile) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("records.bin");
    let data = random_bytes(size * count, seed);
    std::fs::write(&path, &data).expect("write");
    // SAFETY: the file is private to the test and not changed while mapped.
    let records = unsafe { RecordFile::open_fixed(&path, size) }.expect("records");
    (dir, data, records)
}

fn cfg() -> BatchLoaderOptions {
    BatchLoaderOptions::default()
        .with_batch_size(64)
        .with_workers(3)
        .with_prefetch(4)
        .with_gpu_gather(true)
}

#[test]
fn gpu_gather_without_a_gpu_or_with_direct_reads_is_refused() {
    let (_dir, _, records) = file(512, 100, 1);
    let sampler = || Sampler::new(Order::Sequential);
    let err = BatchLoader::new(records, sampler(), cfg(), None).expect_err("no GPU to gather on");
    assert!(
        err.to_string().contains("gpu_gather") && err.to_string().contains("device batches"),
        "{err}"
    );
    // Batches whose addresses would not fit the address pool: refused, with the most.
    let (_dir, _, records) = file(512, 100, 5);
    let err = BatchLoader::new(records, sampler(), cfg().with_batch_size(1 << 20), None)
        .expect_err("a batch of a million records");
    assert!(
        err.to_string().contains("at most 699050 records a batch"),
        "{err}"
    );
    let (_dir, _, records) = file(512, 100, 2);
    let err = BatchLoader::new(records, sampler(), cfg().with_direct(true), None)
        .expect_err("direct reads and the mapping's registration exclude each other");
    assert!(
        err.to_string().contains("gpu_gather") && err.to_string().contains("direct"),
        "{err}"
    );
}

/// Every batch of `epochs` epochs of a `size`-byte record file gathered by the GPU, checked.
fn batches_are_right(gpu: &Gpu, size: usize, count: usize, epochs: u64) {
    let (_dir, data, records) = file(size, count, size as u64);
    let mut loader = BatchLoader::new(
        records,
        Sampler::new(Order::Shuffled { seed: 9 }),
        cfg(),
        Some(gpu),
    )
    .expect("loader");
    let mut batches = 0;
    for epoch in 0..epochs {
        let mut seen = 0;
        for b in loader.epoch(epoch).expect("epoch") {
            let b = b.expect("batch");
            let BatchData::Device(d) = &b.data else {
                panic!("a GPU loader hands out device batches")
            };
            let want: Vec<u8> = b
                .indices
                .iter()
                .flat_map(|&i| data[i * size..(i + 1) * size].iter().copied())
                .collect();
            assert!(
                gpu.to_vec(d).expect("copy back") == want,
                "{size}-byte records, epoch {epoch}, batch {}: other bytes",
                b.number
            );
            assert_eq!(b.offsets.last().copied(), Some(want.len()));
            seen += b.indices.len();
            batches += 1;
        }
        assert_eq!(seen, count, "every record once an epoch");
    }
    // Every batch came from the kernel (records of one size, no transform), and the consumer
    // waited for each one's event.
    let stats = loader.stats();
    assert_eq!(stats.gpu_gathered_batches, batches, "{stats:?}");
    assert!(stats.copy_waited_s > 0.0, "{stats:?}");
}

#[test]
fn the_gpu_gathers_byte_exact_batches_at_every_record_size() {
    let Some(gpu) = gpu_or_skip("the_gpu_gathers_byte_exact_batches_at_every_record_size") else {
        return;
    };
    // 4096 and 48: 16-byte copies; 4093, 24 and 1: single bytes (the length is not a multiple
    // of 16). 1,000 records of 64 a batch: a last batch of 40.
    batches_are_right(&gpu, 4096, 1000, 3);
    for size in [4093, 48, 24, 1] {
        batches_are_right(&gpu, size, 1000, 1);
    }
}

#[test]
fn with_a_transform_the_gpu_does_not_gather() {
    let Some(gpu) = gpu_or_skip("with_a_transform_the_gpu_does_not_gather") else {
        return;
    };
    // A transform runs on the workers: they gather, and the batches hold its output.
    let (_dir, data, records) = file(100, 300, 3);
    let mut loader = BatchLoader::new(records, Sampler::new(Order::Sequential), cfg(), Some(&gpu))
        .expect("loader")
        .with_transform(|_, r, out| {
            out.extend(r.iter().rev());
            Ok(())
        });
    for b in loader.epoch(0).expect("epoch") {
        let b = b.expect("batch");
        let BatchData::Device(d) = &b.data else {
            panic!("device batches")
        };
        let want: Vec<u8> = b
            .indices
            .iter()
            .flat_map(|&i| data[i * 100..(i + 1) * 100].iter().rev().copied())
            .collect();
        assert!(gpu.to_vec(d).expect("back") == want, "batch {}", b.number);
    }
    assert_eq!(
        loader.stats().gpu_gathered_batches,
        0,
        "the workers ran the transform"
    );
    // Records of several lengths (an offsets index): refused when the loader is made.
    let (dir, _, _) = file(100, 10, 4);
    let index: Vec<u8> = [0u64, 10, 250, 1000]
        .iter()
        .flat_map(|o| o.to_le_bytes())
        .collect();
    std::fs::write(dir.path().join("records.idx"), index).expect("index");
    // SAFETY: private to the test, not changed while mapped.
    let indexed = unsafe {
        RecordFile::open_indexed(
            dir.path().join("records.bin"),
            dir.path().join("records.idx"),
        )
    }
    .expect("indexed records");
    let err = BatchLoader::new(indexed, Sampler::new(Order::Sequential), cfg(), Some(&gpu))
        .expect_err("records of several lengths are not gathered by the GPU");
    assert!(err.to_string().contains("fixed-size records"), "{err}");
}

/// A folder of class folders holding files of every awkward size (empty, 1 byte, just under
/// and over 16 bytes and a page, larger than one block's 64 KiB) in `dir`; its bytes by path.
fn folder_of_odd_sizes(dir: &std::path::Path, seed: u64) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let sizes = [
        0usize, 1, 15, 16, 17, 4095, 4096, 4097, 65_535, 65_536, 65_537, 200_003, 31,
    ];
    let mut made = Vec::new();
    for class in 0..3 {
        let cdir = dir.join(format!("class{class}"));
        std::fs::create_dir_all(&cdir).expect("mkdir");
        for (i, &n) in sizes.iter().enumerate() {
            let data = random_bytes(n, seed ^ ((class * 100 + i) as u64));
            let path = cdir.join(format!("{i:03}.jpg"));
            std::fs::write(&path, &data).expect("write");
            made.push((path, data));
        }
    }
    made
}

/// A folder's files gathered by the GPU from their registered map: every batch of two
/// shuffled epochs equal to the files' bytes by hash, the offsets their sizes, every batch
/// the kernel's.
#[test]
fn the_gpu_gathers_a_folders_files_of_every_size() {
    let Some(gpu) = gpu_or_skip("the_gpu_gathers_a_folders_files_of_every_size") else {
        return;
    };
    let seed = gpufeed_testkit::seed("the_gpu_gathers_a_folders_files_of_every_size");
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let made = folder_of_odd_sizes(dir.path(), seed);
    let folder = ImageFolder::open(dir.path()).expect("folder");
    let bytes: std::collections::HashMap<std::path::PathBuf, Vec<u8>> = made.into_iter().collect();
    let want_of = |i: usize| &bytes[&folder.files().paths()[i]];
    let wanted: Vec<Vec<u8>> = (0..folder.len()).map(|i| want_of(i).clone()).collect();
    let mut loader = BatchLoader::new(
        folder,
        Sampler::new(Order::Shuffled { seed: 5 }),
        cfg().with_batch_size(7),
        Some(&gpu),
    )
    .expect("a loader gathering a folder on the GPU");
    let mut batches = 0;
    for epoch in 0..2 {
        let mut seen = 0;
        for b in loader.epoch(epoch).expect("epoch") {
            let b = b.expect("batch");
            let BatchData::Device(d) = &b.data else {
                panic!("a GPU loader hands out device batches")
            };
            let got = gpu.to_vec(d).expect("copy back");
            let mut at = 0;
            for (k, &i) in b.indices.iter().enumerate() {
                let want = &wanted[i];
                assert_eq!(b.offsets[k], at, "epoch {epoch}, batch {}", b.number);
                let part = &got[at..at + want.len()];
                assert_eq!(
                    xxhash_rust::xxh3::xxh3_64(part),
                    xxhash_rust::xxh3::xxh3_64(want),
                    "epoch {epoch}, batch {}, sample {i} ({} bytes, seed {seed})",
                    b.number,
                    want.len()
                );
                at += want.len();
            }
            assert_eq!((b.offsets.last().copied(), got.len()), (Some(at), at));
            seen += b.indices.len();
            batches += 1;
        }
        assert_eq!(seen, wanted.len(), "every file once an epoch");
    }
    assert_eq!(loader.stats().gpu_gathered_batches, batches);
}

/// A file of the folder whose size changed after it was listed: the loader is refused, naming
/// the file.
#[test]
fn a_folder_file_changed_since_listed_is_refused_by_name() {
    let Some(gpu) = gpu_or_skip("a_folder_file_changed_since_listed_is_refused_by_name") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let made = folder_of_odd_sizes(dir.path(), 7);
    let folder = ImageFolder::open(dir.path()).expect("folder");
    let grown = &made[5].0;
    std::fs::write(grown, b"other bytes, another size").expect("rewrite");
    let err = BatchLoader::new(folder, Sampler::new(Order::Sequential), cfg(), Some(&gpu))
        .expect_err("a file of another size than listed");
    let text = err.to_string();
    assert!(
        text.contains("gpu_gather") && text.contains(&grown.display().to_string()),
        "{text}"
    );
}

/// A data set larger than the machine's available memory (sparse files: nothing is read) is
/// refused when the loader is made, saying what page-locking it would take, before anything is
/// registered: a record file and a folder.
#[test]
fn gathering_more_than_memory_is_refused_up_front() {
    let Some(gpu) = gpu_or_skip("gathering_more_than_memory_is_refused_up_front") else {
        return;
    };
    let available = gpufeed_os::sys::mem_available().expect("MemAvailable");
    let huge = (available + (64 << 30)).next_multiple_of(1 << 20);
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("records.bin");
    let sparse = std::fs::File::create(&path).expect("create");
    // On tmpfs the file would count as in memory already (and its pages would be memory):
    // the test needs a disk.
    if gpufeed_os::file::fs_type(&sparse).is_some_and(gpufeed_os::file::in_memory_fs) {
        panic!(
            "{} is on tmpfs: build with the target directory on a disk to run this test",
            dir.path().display()
        );
    }
    sparse.set_len(huge).expect("a sparse file");
    drop(sparse);
    // SAFETY: private to the test, not changed while mapped (and never read: refused first).
    let records = unsafe { RecordFile::open_fixed(&path, 1 << 20) }.expect("records");
    let t = std::time::Instant::now();
    let err = BatchLoader::new(records, Sampler::new(Order::Sequential), cfg(), Some(&gpu))
        .expect_err("more than the machine's memory");
    let text = err.to_string();
    assert!(
        text.contains("gpu_gather") && text.contains("MemAvailable"),
        "{text}"
    );
    let folder_dir = dir.path().join("folder");
    std::fs::create_dir_all(folder_dir.join("class")).expect("mkdir");
    std::fs::rename(&path, folder_dir.join("class/huge.jpg")).expect("move");
    let folder = ImageFolder::open(&folder_dir).expect("folder");
    let err = BatchLoader::new(folder, Sampler::new(Order::Sequential), cfg(), Some(&gpu))
        .expect_err("more than the machine's memory");
    let text = err.to_string();
    assert!(
        text.contains("gpu_gather") && text.contains("MemAvailable") && text.contains("files of"),
        "{text}"
    );
    // Refused before any page was read or registered.
    assert!(
        t.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        t.elapsed()
    );
}
