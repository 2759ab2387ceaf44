//! Training data as it is stored, through the BatchLoader (host batches): a set of shards —
//! fixed records, an `.npy` array, a WebDataset tar — found by a glob, every sample's bytes
//! checked by xxh3 against what was written; corrupt shards named when opened.

use gpufeed::dataset::{
    BatchData, BatchLoader, LoaderConfig, Order, RecordFile, Sampler, ShardSet, shard_paths,
};

use crate::random_bytes;

fn xxh3(b: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(b)
}

/// An `.npy` file of `rows` rows of `cols` little-endian u16.
fn npy_file(rows: usize, cols: usize, data: &[u8]) -> Vec<u8> {
    gpufeed_testkit::npy_bytes("<u2", false, &format!("({rows}, {cols})"), data)
}

#[test]
fn a_set_of_fixed_npy_and_tar_shards_is_one_data_set() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut want: Vec<Vec<u8>> = Vec::new(); // every sample's bytes, in the set's order
    // shard-0: 50 fixed records of 333 bytes.
    let fixed = random_bytes(50 * 333, 1);
    std::fs::write(dir.path().join("shard-0.bin"), &fixed).expect("write");
    want.extend(fixed.chunks(333).map(<[u8]>::to_vec));
    // shard-1: a (40, 7) u16 array: rows of 14 bytes.
    let rows = random_bytes(40 * 14, 2);
    std::fs::write(dir.path().join("shard-1.npy"), npy_file(40, 7, &rows)).expect("write");
    want.extend(rows.chunks(14).map(<[u8]>::to_vec));
    // shard-2: 30 WebDataset samples of a .jpg and a .cls each.
    let mut tar = tar::Builder::new(Vec::new());
    for s in 0..30u64 {
        let jpg = random_bytes(100 + 17 * s as usize, 10 + s);
        let cls = format!("{}", s % 4).into_bytes();
        for (ext, data) in [("jpg", &jpg), ("cls", &cls)] {
            let mut h = tar::Header::new_ustar();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            tar.append_data(&mut h, format!("train/{s:05}.{ext}"), data.as_slice())
                .expect("append");
        }
        want.push([jpg, cls].concat());
    }
    std::fs::write(
        dir.path().join("shard-2.tar"),
        tar.into_inner().expect("tar"),
    )
    .expect("write");

    let paths = shard_paths(dir.path().join("shard-*")).expect("glob");
    assert_eq!(paths.len(), 3);
    let shards = paths
        .iter()
        .map(|p| {
            // SAFETY: the test's files are never changed.
            unsafe {
                match p.extension().and_then(|e| e.to_str()) {
                    Some("npy") => RecordFile::open_npy(p),
                    Some("tar") => RecordFile::open_tar(p),
                    _ => RecordFile::open_fixed(p, 333),
                }
            }
        })
        .collect::<gpufeed::Result<Vec<_>>>()
        .expect("open");
    assert_eq!(shards[1].npy().map(|n| n.shape.clone()), Some(vec![40, 7]));
    let sample = shards[2].sample(3).expect("a tar sample");
    assert_eq!(sample.key, "train/00003");
    let set = ShardSet::new(shards);
    assert_eq!(set.len(), 120);
    let mut loader = BatchLoader::new(
        set,
        Sampler::new(Order::Shuffled { seed: 4 }),
        LoaderConfig::default().with_batch_size(16),
        None,
    )
    .expect("loader");
    let mut seen = vec![0u32; want.len()];
    for batch in loader.epoch(0).expect("epoch") {
        let batch = batch.expect("batch");
        let BatchData::Host(buf) = &batch.data else {
            panic!("host batches without a GPU");
        };
        for (k, &i) in batch.indices.iter().enumerate() {
            let got = &buf[batch.offsets[k]..batch.offsets[k + 1]];
            assert_eq!(xxh3(got), xxh3(&want[i]), "sample {i}");
            seen[i] += 1;
        }
    }
    assert!(seen.iter().all(|&n| n == 1), "every sample once");
}

#[test]
fn corrupt_shards_are_named_when_opened() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad_npy = dir.path().join("bad.npy");
    std::fs::write(&bad_npy, &npy_file(10, 7, &[0u8; 100])[..]).expect("write"); // 140 needed
    // SAFETY: the test's files are never changed.
    let err = unsafe { RecordFile::open_npy(&bad_npy) }.expect_err("short npy");
    let text = err.to_string();
    assert!(
        text.contains("bad.npy") && text.contains("truncated"),
        "{text}"
    );

    let mut tar = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_ustar();
    h.set_size(5000);
    h.set_mode(0o644);
    tar.append_data(&mut h, "a.jpg", &random_bytes(5000, 3)[..])
        .expect("append");
    let bytes = tar.into_inner().expect("tar");
    let cut = dir.path().join("cut.tar");
    std::fs::write(&cut, &bytes[..3000]).expect("write");
    // SAFETY: as above.
    let err = unsafe { RecordFile::open_tar(&cut) }.expect_err("cut tar");
    let text = err.to_string();
    assert!(
        text.contains("cut.tar") && text.contains("offset 0"),
        "{text}"
    );

    let err = shard_paths(dir.path().join("none-*.tar")).expect_err("no match");
    assert!(err.to_string().contains("no shard file"), "{err}");
}

/// `f` run on a thread, waited for at most `limit`: `None` when it did not return in time (the
/// thread is left behind).
fn within<T: Send + 'static>(
    limit: std::time::Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

/// `RecordFile::open_indexed(data, index)`'s error text, run on a thread that may take at most
/// 5 s (an open that blocks fails the test instead of hanging it).
fn indexed_error(data: &std::path::Path, index: &std::path::Path) -> String {
    let (d, i) = (data.to_owned(), index.to_owned());
    // SAFETY: the test's files are never changed.
    let opened = within(std::time::Duration::from_secs(5), move || {
        unsafe { RecordFile::open_indexed(&d, &i) }
            .map(|r| r.len())
            .map_err(|e| e.to_string())
    });
    let Some(result) = opened else {
        if std::fs::symlink_metadata(index).is_ok_and(|m| m.file_type().is_fifo()) {
            // Let the reader left behind go: a writer that opens and closes gives it EOF.
            drop(std::fs::OpenOptions::new().write(true).open(index));
        }
        panic!("open_indexed({}) blocked for 5 s", index.display());
    };
    match result {
        Ok(n) => panic!("{} opened as an index of {n} records", index.display()),
        Err(e) => e,
    }
}

use std::os::unix::fs::FileTypeExt;

/// An index that is a FIFO, or a device, is refused at once like every other input; one with
/// more records than the data has bytes (here: empty records past that, a sparse file of
/// zeros) is refused by its size, before anything is read.
#[test]
fn an_index_that_is_a_fifo_a_device_or_oversized_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data.bin");
    std::fs::write(&data, random_bytes(100, 5)).expect("write");
    let fifo = dir.path().join("index.fifo");
    gpufeed_testkit::mkfifo(&fifo);
    let err = indexed_error(&data, &fifo);
    assert!(
        err.contains("index.fifo") && err.contains("not a regular file"),
        "{err}"
    );
    let err = indexed_error(&data, std::path::Path::new("/dev/zero"));
    assert!(
        err.contains("/dev/zero") && err.contains("not a regular file"),
        "{err}"
    );
    // 100 bytes of data hold at most 100 records: 101 offsets. One more is refused.
    let index = dir.path().join("index.bin");
    let file = std::fs::File::create(&index).expect("create");
    file.set_len(8 * 102).expect("set_len");
    let err = indexed_error(&data, &index);
    assert!(
        err.contains("index.bin") && err.contains("more records than"),
        "{err}"
    );
    // A sparse terabyte: refused by its size, not read into memory.
    file.set_len(1 << 40).expect("set_len");
    let err = indexed_error(&data, &index);
    assert!(
        err.contains("index.bin") && err.contains("more records than"),
        "{err}"
    );
    // At the bound: 100 empty records.
    file.set_len(8 * 101).expect("set_len");
    // SAFETY: the test's files are never changed.
    let records = unsafe { RecordFile::open_indexed(&data, &index) }.expect("100 empty records");
    assert_eq!(records.len(), 100);
    assert_eq!(records.record(99), Some(&[][..]));
}
