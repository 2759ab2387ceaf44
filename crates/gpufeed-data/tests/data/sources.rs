//! Training data as it is stored, through the BatchLoader (host batches): a set of shards —
//! fixed records, an `.npy` array, a WebDataset tar — found by a glob, every sample's bytes
//! checked by xxh3 against what was written; corrupt shards named when opened.

use gpufeed_data::{
    BatchData, BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler, ShardSet, shard_paths,
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
        .collect::<gpufeed_data::Result<Vec<_>>>()
        .expect("open");
    assert_eq!(shards[1].npy().map(|n| n.shape.clone()), Some(vec![40, 7]));
    let sample = shards[2].sample(3).expect("a tar sample");
    assert_eq!(sample.key, "train/00003");
    let set = ShardSet::new(shards);
    assert_eq!(set.len(), 120);
    let mut loader = BatchLoader::new(
        set,
        Sampler::new(Order::Shuffled { seed: 4 }),
        BatchLoaderOptions::default().with_batch_size(16),
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
    let opened = within(std::time::Duration::from_secs(5), move || {
        // SAFETY: the test's files are never changed.
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

/// `RecordFile::open_npy` of `bytes` written to a file, a panic caught and returned as `Err`.
fn open_npy_bytes(
    dir: &std::path::Path,
    bytes: &[u8],
) -> std::thread::Result<gpufeed_data::Result<RecordFile>> {
    let path = dir.join("x.npy");
    std::fs::write(&path, bytes).expect("write");
    // SAFETY: the test's file is not changed while it is used.
    std::panic::catch_unwind(|| unsafe { RecordFile::open_npy(&path) })
}

/// Issue 37: an `.npy` of shape (0, 2^33, 2^33) holds no data, so its size matches the file;
/// its row of 2^66 bytes is refused by name when opened, never an overflow (a panic in debug
/// builds).
#[test]
fn an_npy_whose_rows_overflow_is_refused_when_opened() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bytes = gpufeed_testkit::npy_bytes("|u1", false, "(0, 8589934592, 8589934592)", &[]);
    let err = open_npy_bytes(dir.path(), &bytes)
        .expect("no panic")
        .expect_err("a row of 2^66 bytes");
    let text = err.to_string();
    assert!(
        text.contains("x.npy") && text.contains("too large"),
        "{text}"
    );
}

/// Every record of an opened data set, read through a `BatchLoader` epoch (host batches): each
/// as long as `row` bytes, all together `total` bytes.
fn read_all(records: RecordFile, row: Option<usize>, total: usize) -> Result<(), String> {
    let n = records.len();
    let mut loader = BatchLoader::new(
        records,
        Sampler::new(Order::Sequential),
        BatchLoaderOptions::default()
            .with_batch_size(7)
            .with_workers(1),
        None,
    )
    .map_err(|e| e.to_string())?;
    let mut seen = (0, 0);
    for batch in loader.epoch(0).map_err(|e| e.to_string())? {
        let batch = batch.map_err(|e| e.to_string())?;
        for w in batch.offsets.windows(2) {
            if row.is_some_and(|r| w[1] - w[0] != r) {
                return Err(format!(
                    "a record of {} bytes, rows of {row:?}",
                    w[1] - w[0]
                ));
            }
        }
        seen.0 += batch.indices.len();
        seen.1 += batch.bytes();
    }
    if seen != (n, total) {
        return Err(format!("read {seen:?} of ({n}, {total})"));
    }
    Ok(())
}

fn dimension() -> impl proptest::strategy::Strategy<Value = u64> {
    use proptest::prelude::*;
    prop_oneof![
        4 => 0u64..6,
        1 => Just(1u64 << 33),
        1 => Just(1u64 << 62),
        1 => any::<u64>(),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

    /// Any `.npy` header numbers (dimensions up to 2^64, dtypes of 1 to 16 bytes) over data of
    /// the right size, one byte off, or none, written to a file and opened as a data set: an
    /// error naming the file, or records that tile the data exactly and all read back through
    /// the loader; never a panic.
    #[test]
    fn any_npy_header_opens_as_a_data_set_or_is_refused(
        first in proptest::prop_oneof![proptest::prelude::Just(0u64), dimension()],
        rest in proptest::collection::vec(dimension(), 0..4),
        scalar in proptest::prelude::any::<bool>(),
        descr in proptest::sample::select(vec!["|u1", "<u2", "<f4", "<f8", "|V3", "<c16"]),
        off in -1i64..=1,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        // The leading dimension (often 0: no data, whatever the rows), or a 0-d array.
        let dims: Vec<u64> = if scalar && rest.is_empty() {
            Vec::new()
        } else {
            std::iter::once(first).chain(rest).collect()
        };
        let shape = match dims.as_slice() {
            [one] => format!("({one},)"),
            d => format!("({})", d.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")),
        };
        let item: u64 = descr[2..].parse().expect("size");
        let bytes = dims.iter().try_fold(item, |n, &d| n.checked_mul(d));
        let len = bytes.filter(|&b| b <= 4096).map_or(16, |b| (b as i64 + off).max(0) as usize);
        let file = gpufeed_testkit::npy_bytes(descr, false, &shape, &vec![3u8; len]);
        let opened = open_npy_bytes(dir.path(), &file);
        proptest::prop_assert!(opened.is_ok(), "open_npy panicked on shape {} {}", shape, descr);
        match opened.expect("no panic") {
            Err(e) => proptest::prop_assert!(e.to_string().contains("x.npy"), "{}", e),
            Ok(records) => {
                let npy = records.npy().expect("an npy").clone();
                let row = npy.row_bytes();
                proptest::prop_assert_eq!(Some(npy.data_start + len), Some(file.len()));
                let total = if row == 0 { 0 } else { len };
                proptest::prop_assert_eq!(records.len() * row, total);
                let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    read_all(records, Some(row), total)
                }));
                proptest::prop_assert!(read.is_ok(), "reading {} {} panicked", shape, descr);
                let read = read.expect("no panic");
                proptest::prop_assert!(read.is_ok(), "{:?}", read);
            }
        }
    }

    /// Any bytes as a tar shard, or a valid one with a byte changed or cut short, opened as a
    /// data set: an error naming the file, or samples inside it that all read back.
    #[test]
    fn any_tar_opens_as_a_data_set_or_is_refused(
        noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..1600),
        at in 0usize..4096,
        val in proptest::prelude::any::<u8>(),
        cut in 0usize..5000,
        valid in proptest::prelude::any::<bool>(),
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut bytes = if valid {
            let mut t = tar::Builder::new(Vec::new());
            for (name, data) in [("k.a", &[1u8; 600][..]), ("k.b", b"22"), ("j.a", b"3")] {
                let mut h = tar::Header::new_ustar();
                h.set_size(data.len() as u64);
                h.set_mode(0o644);
                t.append_data(&mut h, name, data).expect("append");
            }
            t.into_inner().expect("tar")
        } else {
            noise
        };
        if at < bytes.len() {
            bytes[at] = val;
        }
        bytes.truncate(cut.min(bytes.len()));
        let path = dir.path().join("x.tar");
        std::fs::write(&path, &bytes).expect("write");
        // SAFETY: the test's file is not changed while it is used.
        let opened = std::panic::catch_unwind(|| unsafe { RecordFile::open_tar(&path) });
        proptest::prop_assert!(opened.is_ok(), "open_tar panicked");
        match opened.expect("no panic") {
            Err(e) => proptest::prop_assert!(e.to_string().contains("x.tar"), "{}", e),
            Ok(records) => {
                let total: usize = (0..records.len())
                    .map(|i| records.sample(i).expect("sample").bytes())
                    .sum();
                proptest::prop_assert!(total <= bytes.len());
                let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    read_all(records, None, total)
                }));
                proptest::prop_assert!(read.is_ok(), "reading the tar panicked");
                let read = read.expect("no panic");
                proptest::prop_assert!(read.is_ok(), "{:?}", read);
            }
        }
    }

    /// Any index bytes over a data file, opened as a data set: an error naming the index, or
    /// records inside the data that all read back.
    #[test]
    fn any_record_index_opens_as_a_data_set_or_is_refused(
        offsets in proptest::collection::vec(
            proptest::prop_oneof![0u64..300, proptest::prelude::any::<u64>()], 0..40),
        tail in 0usize..8,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data.bin");
        std::fs::write(&data, random_bytes(256, 9)).expect("write");
        let index = dir.path().join("x.idx");
        let mut raw: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
        raw.extend(std::iter::repeat_n(0u8, tail));
        std::fs::write(&index, &raw).expect("write");
        // SAFETY: the test's files are not changed while they are used.
        let opened = std::panic::catch_unwind(|| unsafe { RecordFile::open_indexed(&data, &index) });
        proptest::prop_assert!(opened.is_ok(), "open_indexed panicked");
        match opened.expect("no panic") {
            Err(e) => proptest::prop_assert!(e.to_string().contains("x.idx"), "{}", e),
            Ok(records) => {
                proptest::prop_assert_eq!(records.len() + 1, offsets.len());
                let total = (offsets[offsets.len() - 1] - offsets[0]) as usize;
                let read = read_all(records, None, total);
                proptest::prop_assert!(read.is_ok(), "{:?}", read);
            }
        }
    }
}

/// An image folder whose files' sizes add up past 2^64 bytes (four sparse files of 2^62 on a
/// tmpfs, which allows them): refused by name when listed, never an overflow.
#[test]
fn a_folder_of_files_past_2_64_bytes_is_refused_when_opened() {
    const TEST: &str = "a_folder_of_files_past_2_64_bytes_is_refused_when_opened";
    let mount = match gpufeed_testkit::TestMount::tmpfs("1m") {
        Ok(m) => m,
        Err(why) => return gpufeed_testkit::skip_unless_root(TEST, &why),
    };
    let class = mount.path().join("huge");
    std::fs::create_dir(&class).expect("class folder");
    for i in 0..4 {
        let f = std::fs::File::create(class.join(format!("{i}.bin"))).expect("create");
        f.set_len(1 << 62).expect("a sparse file of 2^62 bytes");
    }
    let opened = std::panic::catch_unwind(|| gpufeed_data::ImageFolder::open(mount.path()));
    let err = opened.expect("no panic").expect_err("2^64 bytes");
    let text = err.to_string();
    assert!(text.contains("3.bin") && text.contains("2^64"), "{text}");
}

/// A ustar header block for `name` with `size` as its 12-byte size field and `kind` as its
/// type flag, checksummed.
fn tar_header(name: &str, size: [u8; 12], kind: u8) -> Vec<u8> {
    let mut h = vec![0u8; 512];
    h[..name.len()].copy_from_slice(name.as_bytes());
    h[100..108].copy_from_slice(b"0000644\0");
    h[108..116].copy_from_slice(b"0000000\0");
    h[116..124].copy_from_slice(b"0000000\0");
    h[124..136].copy_from_slice(&size);
    h[136..148].copy_from_slice(b"00000000000\0");
    h[156] = kind;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    h
}

/// A size field in octal (at most 8 GiB - 1).
fn octal_size(n: u64) -> [u8; 12] {
    format!("{n:011o}\0")
        .as_bytes()
        .try_into()
        .expect("12 bytes")
}

/// A size field in GNU base-256 (any size).
fn base256_size(n: u64) -> [u8; 12] {
    let mut f = [0u8; 12];
    f[0] = 0x80;
    f[4..].copy_from_slice(&n.to_be_bytes());
    f
}

/// `data` padded with zeros to whole 512-byte blocks.
fn blocks(data: &[u8]) -> Vec<u8> {
    let mut d = data.to_vec();
    d.resize(data.len().div_ceil(512) * 512, 0);
    d
}

/// A pax extended header ('x') and its records (`"<len> key=value\n"`), in blocks.
fn pax_header(records: &[(&str, &str)]) -> Vec<u8> {
    let mut body = Vec::new();
    for (k, v) in records {
        let rest = k.len() + v.len() + 3; // space, '=', newline
        let mut len = rest + 1;
        while len != rest + len.to_string().len() {
            len = rest + len.to_string().len();
        }
        body.extend_from_slice(format!("{len} {k}={v}\n").as_bytes());
    }
    let mut out = tar_header("PaxHeaders/x", octal_size(body.len() as u64), b'x');
    out.extend(blocks(&body));
    out
}

/// Each sample's members (extension, byte range) of the tar `bytes` opened from a file.
fn tar_members(bytes: &[u8]) -> Result<Vec<(String, std::ops::Range<usize>)>, String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("x.tar");
    std::fs::write(&path, bytes).expect("write");
    // SAFETY: the test's file is not changed while it is used.
    let records = unsafe { RecordFile::open_tar(&path) }.map_err(|e| e.to_string())?;
    Ok((0..records.len())
        .flat_map(|i| records.sample(i).expect("sample").members.clone())
        .collect())
}

/// A pax `size` record is the member's size, not the ustar field (here 10 while the member
/// holds 1000 bytes): the member and the one after it are where the records say. A `size`
/// past the archive's end, or not a number, is refused.
#[test]
fn a_pax_size_record_sets_the_member_size() {
    let data = random_bytes(1000, 8);
    let mut tar = pax_header(&[("size", "1000"), ("path", "s0.bin")]);
    tar.extend(tar_header("ignored.bin", octal_size(10), b'0'));
    let at = tar.len();
    tar.extend(blocks(&data));
    tar.extend(tar_header("s0.cls", octal_size(3), b'0'));
    let cls = tar.len();
    tar.extend(blocks(b"cat"));
    tar.extend([0u8; 1024]);
    let members = tar_members(&tar).expect("a valid pax tar");
    assert_eq!(
        members,
        [
            ("bin".to_owned(), at..at + 1000),
            ("cls".to_owned(), cls..cls + 3)
        ]
    );
    assert_eq!(&tar[at..at + 1000], &data[..]);

    // A size past the end of the archive: refused, not indexed from the ustar field.
    let mut big = pax_header(&[("size", "1000000")]);
    big.extend(tar_header("a.bin", octal_size(10), b'0'));
    big.extend(blocks(&random_bytes(10, 1)));
    big.extend([0u8; 1024]);
    let err = tar_members(&big).expect_err("a size past the end");
    assert!(err.contains("x.tar") && err.contains("1000000"), "{err}");
    let mut bad = pax_header(&[("size", "12a")]);
    bad.extend(tar_header("a.bin", octal_size(10), b'0'));
    bad.extend(blocks(&random_bytes(10, 1)));
    let err = tar_members(&bad).expect_err("a size that is not a number");
    assert!(err.contains("size"), "{err}");
}

/// A member of 8 GiB + 5 bytes (more than a ustar size field holds) in a sparse tar file: its
/// size from a pax `size` record, or from a GNU base-256 size field, puts it and the next
/// member where they are.
#[test]
fn a_member_past_8_gib_is_indexed_from_pax_or_base_256_sizes() {
    use std::io::{Seek, SeekFrom, Write};
    const BIG: u64 = (8 << 30) + 5;
    for pax in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("big.tar");
        let mut file = std::fs::File::create(&path).expect("create");
        let mut head = Vec::new();
        if pax {
            head.extend(pax_header(&[("size", &BIG.to_string())]));
            head.extend(tar_header("k.bin", octal_size(0), b'0'));
        } else {
            head.extend(tar_header("k.bin", base256_size(BIG), b'0'));
        }
        file.write_all(&head).expect("write");
        let at = head.len() as u64;
        let next = at + BIG.next_multiple_of(512);
        file.seek(SeekFrom::Start(next)).expect("seek");
        let mut tail = tar_header("k.cls", octal_size(1), b'0');
        tail.extend(blocks(b"7"));
        tail.extend([0u8; 1024]);
        file.write_all(&tail).expect("write");
        drop(file);
        // SAFETY: the test's file is not changed while it is used.
        let records = unsafe { RecordFile::open_tar(&path) }.expect("a tar of a big member");
        let sample = records.sample(0).expect("one sample");
        let (at, next) = (at as usize, next as usize);
        assert_eq!(
            sample.members,
            [
                ("bin".to_owned(), at..at + BIG as usize),
                ("cls".to_owned(), next + 512..next + 513)
            ],
            "pax {pax}"
        );
        assert_eq!(records.parts(0).expect("parts")[1], b"7");
    }
}

/// A member stored sparse (GNU `S`, or pax `GNU.sparse` records) is refused by name: its
/// stored bytes are a map and the data, not the file.
#[test]
fn a_sparse_tar_member_is_refused_not_misread() {
    let mut gnu = tar_header("s0.bin", octal_size(512), b'S');
    gnu.extend(blocks(&random_bytes(512, 2)));
    gnu.extend([0u8; 1024]);
    let mut pax = pax_header(&[("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0")]);
    pax.extend(tar_header("s0.bin", octal_size(512), b'0'));
    pax.extend(blocks(&random_bytes(512, 2)));
    pax.extend([0u8; 1024]);
    for (what, tar) in [("GNU S", gnu), ("pax GNU.sparse", pax)] {
        let err = tar_members(&tar).expect_err(what);
        assert!(
            err.contains("s0.bin") && err.contains("sparse"),
            "{what}: {err}"
        );
    }
}

/// A batch of files whose bytes are more than one pinned batch buffer holds (256 MiB: 64
/// camera-sized JPEGs of 4.2 MB) is an error saying so, naming its largest file and what to
/// do (before: the pool's "larger than the pool's largest buffer", naming nothing); a smaller
/// batch size loads the same files. The files are sparse: nothing is written to disk.
#[test]
fn a_batch_past_the_batch_buffer_is_an_error_naming_its_largest_file() {
    use gpufeed_data::ImageFolder;
    let dir = tempfile::tempdir().expect("tempdir");
    let class = dir.path().join("cls");
    std::fs::create_dir_all(&class).expect("mkdir");
    for i in 0..9 {
        let f = std::fs::File::create(class.join(format!("{i}.jpg"))).expect("create");
        // 30 MiB each, the sixth 1 KiB more: nine are 270 MiB.
        f.set_len((30 << 20) + if i == 5 { 1024 } else { 0 })
            .expect("sparse");
    }
    let folder = || ImageFolder::open(dir.path()).expect("folder");
    let cfg = BatchLoaderOptions::default().with_batch_size(9);
    let mut loader =
        BatchLoader::new(folder(), Sampler::new(Order::Sequential), cfg, None).expect("loader");
    let err = loader
        .epoch(0)
        .expect("epoch")
        .next()
        .expect("a batch")
        .expect_err("270 MiB in one batch");
    let text = err.to_string();
    assert!(
        text.contains("a batch of 9 records")
            && text.contains("5.jpg")
            && text.contains("use a smaller batch_size"),
        "{text}"
    );
    let cfg = BatchLoaderOptions::default().with_batch_size(8);
    let mut loader =
        BatchLoader::new(folder(), Sampler::new(Order::Sequential), cfg, None).expect("loader");
    let sizes: Vec<usize> = loader
        .epoch(0)
        .expect("epoch")
        .map(|b| b.expect("batch").indices.len())
        .collect();
    assert_eq!(sizes, [8, 1]);

    // One file alone over the buffer: no batch size helps, and the error says so.
    let big = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(big.path().join("cls")).expect("mkdir");
    std::fs::File::create(big.path().join("cls/huge.jpg"))
        .and_then(|f| f.set_len((256 << 20) + 1))
        .expect("sparse");
    let cfg = BatchLoaderOptions::default().with_batch_size(1);
    let folder = ImageFolder::open(big.path()).expect("folder");
    let mut loader =
        BatchLoader::new(folder, Sampler::new(Order::Sequential), cfg, None).expect("loader");
    let err = loader
        .epoch(0)
        .expect("epoch")
        .next()
        .expect("a batch")
        .expect_err("one file over 256 MiB");
    let text = err.to_string();
    assert!(
        text.contains("huge.jpg alone") && text.contains("leave it out"),
        "{text}"
    );
}
