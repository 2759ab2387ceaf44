//! Without a GPU: errors of GPU calls, and byte-exact host pipelines.

use gpufeed::dataset::{BatchData, BatchLoader, LoaderConfig, Order, RecordFile, Sampler};
use gpufeed::{Error, Gpu};

use crate::random_bytes;

#[test]
fn gpu_calls_without_a_gpu_say_so() {
    if let Err(e) = Gpu::open(0) {
        let e = Error::from(e);
        assert!(e.is_no_gpu(), "{e:?}");
    }
}

fn host_bytes(b: &host_batch::Batch) -> Vec<u8> {
    match &b.data {
        BatchData::Host(buf) => buf.to_vec(),
        BatchData::Device(_) => panic!("a host loader yielded a device batch"),
    }
}

mod host_batch {
    pub use gpufeed::dataset::Batch;
}

#[test]
fn host_batches_are_byte_exact_and_ordered_by_seed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("records.bin");
    let data = random_bytes(1000 * 37, 5);
    std::fs::write(&path, &data).expect("write");
    let open = || {
        // SAFETY: the file is private to this test and never changed.
        unsafe { RecordFile::open_fixed(&path, 37) }.expect("records")
    };
    let cfg = LoaderConfig::default()
        .with_batch_size(64)
        .with_drop_last(false)
        .with_prefetch(3)
        .with_workers(3);
    let sampler = Sampler::new(Order::Shuffled { seed: 42 });
    let mut loader = BatchLoader::new(open(), sampler, cfg.clone(), None).expect("loader");
    assert_eq!(loader.batches_per_epoch(), 16);
    let mut orders = Vec::new();
    for epoch in 0..3 {
        let mut seen = Vec::new();
        for (n, batch) in loader.epoch(epoch).expect("epoch").enumerate() {
            let batch = batch.expect("batch");
            assert_eq!((batch.number, batch.epoch), (n, epoch));
            let bytes = host_bytes(&batch);
            assert_eq!(bytes.len(), batch.bytes());
            for (k, &i) in batch.indices.iter().enumerate() {
                let (a, b) = (batch.offsets[k], batch.offsets[k + 1]);
                assert_eq!(
                    &bytes[a..b],
                    &data[i * 37..(i + 1) * 37],
                    "record {i} of batch {n}"
                );
            }
            seen.extend(batch.indices);
        }
        let mut sorted = seen.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            (0..1000).collect::<Vec<_>>(),
            "every record once per epoch"
        );
        orders.push(seen);
    }
    assert_ne!(orders[0], orders[1], "epochs differ");
    let mut again = BatchLoader::new(open(), sampler, cfg, None).expect("loader");
    let replay: Vec<usize> = again
        .epoch(1)
        .expect("epoch")
        .flat_map(|b| b.expect("batch").indices)
        .collect();
    assert_eq!(replay, orders[1], "same seed, same order");
    assert_eq!(again.stats().batches, 16);
}

#[test]
fn transforms_indexed_records_and_drop_last() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("var.bin");
    let index = dir.path().join("var.idx");
    let lens: Vec<usize> = (0..50).map(|i| 1 + (i * 37) % 200).collect();
    let data = random_bytes(lens.iter().sum(), 9);
    let mut offsets = vec![0u64];
    for l in &lens {
        offsets.push(offsets.last().expect("one") + *l as u64);
    }
    std::fs::write(&path, &data).expect("write");
    std::fs::write(
        &index,
        offsets
            .iter()
            .flat_map(|o| o.to_le_bytes())
            .collect::<Vec<u8>>(),
    )
    .expect("index");
    // SAFETY: private files, never changed.
    let records = unsafe { RecordFile::open_indexed(&path, &index) }.expect("records");
    assert_eq!(records.len(), 50);
    let cfg = LoaderConfig::default()
        .with_batch_size(8)
        .with_drop_last(true)
        .with_prefetch(2)
        .with_workers(2);
    let mut loader = BatchLoader::new(records, Sampler::new(Order::Sequential), cfg, None)
        .expect("loader")
        .with_transform(|i, rec, out| {
            out.extend_from_slice(&(i as u32).to_le_bytes());
            out.extend(rec.iter().rev());
            Ok(())
        });
    let batches: Vec<_> = loader
        .epoch(0)
        .expect("epoch")
        .map(|b| b.expect("batch"))
        .collect();
    assert_eq!(batches.len(), 6, "50 / 8 with drop_last");
    for b in &batches {
        let bytes = host_bytes(b);
        for (k, &i) in b.indices.iter().enumerate() {
            let out = &bytes[b.offsets[k]..b.offsets[k + 1]];
            assert_eq!(&out[..4], &(i as u32).to_le_bytes());
            let rec = &data[offsets[i] as usize..offsets[i + 1] as usize];
            assert!(
                out[4..].iter().eq(rec.iter().rev()),
                "transformed record {i}"
            );
        }
    }
}

#[test]
fn bad_record_files_and_failing_transforms() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("r.bin");
    std::fs::write(&path, vec![1u8; 100]).expect("write");
    // SAFETY: private file, never changed.
    let err = unsafe { RecordFile::open_fixed(&path, 30) }.unwrap_err();
    assert!(
        matches!(err, Error::Records { .. }) && err.to_string().contains("left over"),
        "{err}"
    );
    let index = dir.path().join("r.idx");
    std::fs::write(
        &index,
        [0u64, 50, 40]
            .iter()
            .flat_map(|o| o.to_le_bytes())
            .collect::<Vec<u8>>(),
    )
    .expect("index");
    // SAFETY: as above.
    let err = unsafe { RecordFile::open_indexed(&path, &index) }.unwrap_err();
    assert!(err.to_string().contains("decrease"), "{err}");
    std::fs::write(
        &index,
        [0u64, 500]
            .iter()
            .flat_map(|o| o.to_le_bytes())
            .collect::<Vec<u8>>(),
    )
    .expect("index");
    // SAFETY: as above.
    let err = unsafe { RecordFile::open_indexed(&path, &index) }.unwrap_err();
    assert!(err.to_string().contains("past the data file"), "{err}");

    // SAFETY: as above.
    let records = unsafe { RecordFile::open_fixed(&path, 10) }.expect("records");
    let mut loader = BatchLoader::new(
        records,
        Sampler::new(Order::Sequential),
        LoaderConfig::default().with_batch_size(4),
        None,
    )
    .expect("loader")
    .with_transform(|i, _, _| {
        if i == 5 {
            Err("bad pixel".into())
        } else {
            Ok(())
        }
    });
    let results: Vec<_> = loader.epoch(0).expect("epoch").collect();
    assert!(results[0].is_ok());
    assert!(
        matches!(&results[1], Err(Error::Transform { record: 5, message, panicked: false }) if message == "bad pixel")
    );
    assert!(
        results[2].is_ok(),
        "one failed batch does not stop the epoch"
    );
}

#[test]
fn sampler_from_torchrun_environment() {
    // Only this test sets these variables, in a child process so others are unaffected.
    if std::env::var(gpufeed_testkit::CHILD_ROLE).is_err() {
        gpufeed_testkit::run_child(
            "host::sampler_from_torchrun_environment",
            "torchrun-env",
            &[("RANK", "1".into()), ("WORLD_SIZE", "4".into())],
        );
        return;
    }
    let s = Sampler::from_env(Order::Sequential).expect("sampler");
    assert_eq!(s.epoch(10, 0), vec![1, 5, 9]);
}

/// `doctor` probes O_DIRECT with a file in the directory it is given, often as root: a
/// symlink planted at the name the old code used (`.gpufeed-doctor-<pid>`) must neither be
/// followed nor removed, and no probe file may stay behind.
#[test]
fn doctor_probe_files_never_follow_planted_symlinks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("precious");
    let precious = random_bytes(10_000, 3);
    std::fs::write(&target, &precious).expect("write target");
    let planted = dir
        .path()
        .join(format!(".gpufeed-doctor-{}", std::process::id()));
    std::os::unix::fs::symlink(&target, &planted).expect("plant symlink");
    let checks = gpufeed::doctor::run(Some(dir.path()));
    assert!(
        checks.iter().any(|c| c.name == "O_DIRECT"),
        "the O_DIRECT probe ran"
    );
    assert_eq!(
        std::fs::read(&target).expect("read target"),
        precious,
        "the probe wrote through the planted symlink"
    );
    assert!(
        std::fs::symlink_metadata(&planted)
            .expect("the symlink is still there")
            .file_type()
            .is_symlink()
    );
    let mut names: Vec<_> = std::fs::read_dir(dir.path())
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            planted
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned(),
            "precious".to_owned()
        ],
        "a probe file stayed behind"
    );
}

/// A transform that panics on one record: that batch is an error naming the record and the
/// panic, the epoch ends, nothing hangs; a transform that never returns ends the epoch with
/// `BatchTimeout` after the configured bound.
#[test]
fn a_panicking_or_stuck_transform_ends_the_epoch_with_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("records.bin");
    std::fs::write(&path, random_bytes(64 * 10, 8)).expect("write");
    type RecordFn = fn(usize, &[u8], &mut Vec<u8>) -> Result<(), String>;
    let loader_with = |transform: RecordFn, timeout_ms: u64| {
        // SAFETY: the file is private to this test and never changed.
        let records = unsafe { RecordFile::open_fixed(&path, 10) }.expect("records");
        BatchLoader::new(
            records,
            Sampler::new(Order::Sequential),
            LoaderConfig::default()
                .with_batch_size(4)
                .with_workers(2)
                .with_batch_timeout(std::time::Duration::from_millis(timeout_ms)),
            None,
        )
        .expect("loader")
        .with_transform(transform)
    };
    // A generous bound here: the panic's backtrace (where RUST_BACKTRACE is set) is symbolized on the
    // worker before the batch fails, which took longer than 500 ms on a loaded 2-core machine.
    let mut loader = loader_with(
        |i, r, out| {
            assert!(i != 9, "corrupt record {i}");
            out.extend_from_slice(r);
            Ok(())
        },
        20_000,
    );
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let results: Vec<_> = loader.epoch(0).expect("epoch").collect();
        let _ = tx.send(
            results
                .into_iter()
                .map(|r| r.map(|b| b.number))
                .collect::<Vec<_>>(),
        );
    });
    let results = rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("the epoch ended (a panicking transform used to hang it)");
    assert!(results[0].is_ok() && results[1].is_ok(), "{results:?}");
    match &results[2] {
        Err(Error::Transform {
            record: 9,
            message,
            panicked: true,
        }) => assert!(message.contains("corrupt record 9"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        results.len(),
        3,
        "the epoch ends after a panic: {results:?}"
    );

    let mut stuck = loader_with(
        |i, r, out| {
            if i == 4 {
                std::thread::sleep(std::time::Duration::from_secs(3));
            }
            out.extend_from_slice(r);
            Ok(())
        },
        500,
    );
    let t = std::time::Instant::now();
    let results: Vec<_> = stuck
        .epoch(0)
        .expect("epoch")
        .map(|r| r.map(|b| b.number))
        .collect();
    assert!(results[0].is_ok(), "{results:?}");
    assert!(
        matches!(results[1], Err(Error::BatchTimeout { batch: 1, ms: 500 })),
        "{results:?}"
    );
    assert_eq!(results.len(), 2, "{results:?}");
    // The timeout, then at most one more bound while the epoch lets its workers go: not the
    // stuck transform's 3 s.
    assert!(
        t.elapsed() < std::time::Duration::from_millis(2500),
        "{:?}",
        t.elapsed()
    );
}

/// `safetensors::inspect` reads a checkpoint's layout without a GPU: each tensor's bytes are
/// at `data_start + range` of its file; a shard that does not hold what the index maps to it
/// is refused.
#[test]
fn a_checkpoint_is_inspected_without_a_gpu() {
    use safetensors::{Dtype, tensor::TensorView};
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let a = gpufeed_testkit::random_bytes(4 * 333, 61);
    let b = gpufeed_testkit::random_bytes(2 * 5 * 17, 62);
    let views = [
        (
            "x",
            TensorView::new(Dtype::F32, vec![333], &a).expect("view"),
        ),
        (
            "y",
            TensorView::new(Dtype::F16, vec![5, 17], &b).expect("view"),
        ),
    ];
    let path = dir.path().join("m.safetensors");
    safetensors::serialize_to_file(views, None, &path).expect("serialize");
    assert!(gpufeed::safetensors::is_checkpoint_name(&path));
    let layout = gpufeed::safetensors::inspect(&path).expect("inspect");
    assert_eq!(layout.len(), 1);
    let file = std::fs::read(&path).expect("read");
    let f = &layout[0];
    assert_eq!(f.data_start + f.data_bytes, file.len() as u64);
    for ((name, dtype, shape, range), want) in f.tensors.iter().zip([&a, &b]) {
        let at = f.data_start as usize;
        assert_eq!(&file[at + range.start..at + range.end], &want[..], "{name}");
        assert_eq!(*dtype, if name == "x" { Dtype::F32 } else { Dtype::F16 });
        assert_eq!(
            shape.iter().product::<usize>() * dtype.bitsize() / 8,
            range.len()
        );
    }
    let index = dir.path().join("m.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"weight_map": {"x": "m.safetensors", "z": "m.safetensors"}}"#,
    )
    .expect("index");
    let err = gpufeed::safetensors::inspect(&index).expect_err("z is not in the shard");
    assert!(err.to_string().contains("does not hold"), "{err}");
}
