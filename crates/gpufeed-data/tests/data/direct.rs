//! Record files read with `O_DIRECT` (`BatchLoaderOptions::direct`) in the quasi-random block order
//! (`Order::Blocks`), host batches: every sample's bytes checked by xxh3 against what was
//! written, across shards of fixed, indexed and tar records; the reads counted (one per block
//! when the batches hold whole blocks); the settings that cannot work refused clearly.

use gpufeed_data::{
    BatchData, BatchLoader, BatchLoaderOptions, ImageFolder, Order, RecordFile, Sampler, ShardSet,
};

use crate::random_bytes;

fn xxh3(b: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(b)
}

/// The samples of one epoch of `loader`, as (index, xxh3 of its bytes), in order.
fn epoch_samples(loader: &mut BatchLoader, epoch: u64) -> Vec<(usize, u64)> {
    let mut out = Vec::new();
    for b in loader.epoch(epoch).expect("epoch") {
        let b = b.expect("batch");
        let BatchData::Host(buf) = &b.data else {
            panic!("host batches without a GPU")
        };
        for (k, &i) in b.indices.iter().enumerate() {
            out.push((i, xxh3(&buf[b.offsets[k]..b.offsets[k + 1]])));
        }
    }
    out
}

/// Writes three shards: 300 fixed records of 4099 bytes (no record on a page boundary), 200
/// indexed records of 0-9000 bytes, 40 tar samples of two members; returns what each sample
/// holds.
fn write_shards(dir: &std::path::Path) -> Vec<Vec<u8>> {
    let mut want = Vec::new();
    let fixed = random_bytes(300 * 4099, 1);
    std::fs::write(dir.join("a.bin"), &fixed).expect("write");
    want.extend(fixed.chunks(4099).map(<[u8]>::to_vec));
    let mut data = Vec::new();
    let mut index = vec![0u64];
    for r in 0..200u64 {
        let rec = random_bytes(((r * 7919) % 9001) as usize, 100 + r);
        data.extend_from_slice(&rec);
        index.push(data.len() as u64);
        want.push(rec);
    }
    std::fs::write(dir.join("b.bin"), &data).expect("write");
    let index: Vec<u8> = index.iter().flat_map(|o| o.to_le_bytes()).collect();
    std::fs::write(dir.join("b.idx"), index).expect("write");
    let mut tar = tar::Builder::new(Vec::new());
    for s in 0..40u64 {
        let img = random_bytes(5000 + 311 * s as usize, 500 + s);
        let cls = format!("{}", s % 3).into_bytes();
        for (ext, d) in [("img", &img), ("cls", &cls)] {
            let mut h = tar::Header::new_ustar();
            h.set_size(d.len() as u64);
            h.set_mode(0o644);
            tar.append_data(&mut h, format!("s/{s:04}.{ext}"), d.as_slice())
                .expect("append");
        }
        want.push([img, cls].concat());
    }
    std::fs::write(dir.join("c.tar"), tar.into_inner().expect("tar")).expect("write");
    want
}

/// The shards `write_shards` wrote, opened.
fn open_shards(dir: &std::path::Path) -> ShardSet {
    // SAFETY: the test's files are never changed once written.
    ShardSet::new(unsafe {
        vec![
            RecordFile::open_fixed(dir.join("a.bin"), 4099).expect("open a"),
            RecordFile::open_indexed(dir.join("b.bin"), dir.join("b.idx")).expect("open b"),
            RecordFile::open_tar(dir.join("c.tar")).expect("open c"),
        ]
    })
}

#[test]
fn direct_reads_give_every_sample_once_with_its_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let want = write_shards(dir.path());
    let n = want.len();
    for order in [
        Order::Blocks { seed: 9, block: 8 },
        Order::Shuffled { seed: 9 },
        Order::Sequential,
    ] {
        // Two ranks of an elastic run, each its own loader; together every sample once. Rank
        // 0 keeps one read in flight per worker, rank 1 sixteen.
        let mut seen = vec![0u32; n];
        for rank in 0..2 {
            let sampler = Sampler::elastic(order, 32, rank, 2, false).expect("sampler");
            let cfg = BatchLoaderOptions::default()
                .with_direct(true)
                .with_direct_depth([1, 16][rank])
                .with_workers(3)
                .with_prefetch(4);
            let mut loader =
                BatchLoader::new(open_shards(dir.path()), sampler, cfg, None).expect("loader");
            for (i, h) in epoch_samples(&mut loader, 1) {
                assert_eq!(h, xxh3(&want[i]), "{order:?}: sample {i}'s bytes");
                seen[i] += 1;
            }
            let stats = loader.stats();
            assert!(stats.direct_reads > 0, "{order:?}: {stats:?}");
            assert!(
                stats.direct_read_bytes >= stats.bytes,
                "{order:?}: read at least what was delivered: {stats:?}"
            );
        }
        // 540 samples in global batches of 32: the last, of 28, splits 14 + 14.
        assert!(seen.iter().all(|&c| c == 1), "{order:?}: every sample once");
    }
}

/// With batches of whole blocks of records that sit next to each other, each block is one
/// read at most (two blocks next to each other in the file and in one batch are one read): a
/// 64-record batch of 8-record blocks is 8 reads or fewer, and the bytes read are the
/// records' own plus at most a page per read.
#[test]
fn a_block_is_one_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (record, count) = (65536 + 100, 512usize);
    let data = random_bytes(record * count, 7);
    let path = dir.path().join("records.bin");
    std::fs::write(&path, &data).expect("write");
    let order = Order::Blocks { seed: 3, block: 8 };
    // SAFETY: the test's file is never changed.
    let records = unsafe { RecordFile::open_fixed(&path, record) }.expect("open");
    let sampler = Sampler::elastic(order, 64, 0, 1, true).expect("sampler");
    let cfg = BatchLoaderOptions::default()
        .with_direct(true)
        .with_workers(2);
    let mut loader = BatchLoader::new(records, sampler, cfg, None).expect("loader");
    let samples = epoch_samples(&mut loader, 0);
    assert_eq!(samples.len(), count);
    for (i, h) in samples {
        assert_eq!(h, xxh3(&data[i * record..(i + 1) * record]), "record {i}");
    }
    let stats = loader.stats().clone();
    assert!(stats.direct_reads <= (count / 8) as u64, "{stats:?}");
    assert!(stats.direct_read_bytes >= stats.bytes, "{stats:?}");
    assert!(
        stats.direct_read_bytes <= stats.bytes + stats.direct_reads * 4096,
        "{stats:?}"
    );
    // A plain shuffle of the same records reads them one by one.
    // SAFETY: as above.
    let records = unsafe { RecordFile::open_fixed(&path, record) }.expect("open");
    let sampler = Sampler::elastic(Order::Shuffled { seed: 3 }, 64, 0, 1, true).expect("s");
    let cfg = BatchLoaderOptions::default().with_direct(true);
    let mut loader = BatchLoader::new(records, sampler, cfg, None).expect("loader");
    assert_eq!(epoch_samples(&mut loader, 0).len(), count);
    assert!(loader.stats().direct_reads > (count / 2) as u64);
}

#[test]
fn direct_reads_of_a_folder_or_a_file_that_shrank_are_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let class = dir.path().join("folder/cat");
    std::fs::create_dir_all(&class).expect("mkdir");
    std::fs::write(class.join("a.jpg"), b"abc").expect("write");
    let folder = ImageFolder::open(dir.path().join("folder")).expect("folder");
    let err = BatchLoader::new(
        folder,
        Sampler::new(Order::Sequential),
        BatchLoaderOptions::default().with_direct(true),
        None,
    )
    .expect_err("a folder is not read with O_DIRECT");
    assert!(err.to_string().contains("ImageFolder"), "{err}");

    // A file cut short after it was opened: the batch that reaches past its end fails,
    // naming the file; nothing panics.
    let path = dir.path().join("short.bin");
    std::fs::write(&path, random_bytes(100 * 5000, 2)).expect("write");
    // SAFETY: the file shrinks below, but the loader reads it with O_DIRECT only and never
    // touches the mapping's pages past the new end (records are located from the index of
    // sizes fixed at open).
    let records = unsafe { RecordFile::open_fixed(&path, 5000) }.expect("open");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|f| f.set_len(50 * 5000))
        .expect("truncate");
    let cfg = BatchLoaderOptions::default()
        .with_direct(true)
        .with_batch_size(10);
    let mut loader =
        BatchLoader::new(records, Sampler::new(Order::Sequential), cfg, None).expect("loader");
    let results: Vec<_> = loader.epoch(0).expect("epoch").collect();
    assert!(
        results[..5].iter().all(Result::is_ok),
        "the first half is there"
    );
    let err = results[5].as_ref().expect_err("past the end");
    assert!(err.to_string().contains("short.bin"), "{err}");
}
