//! Without a GPU: errors of GPU calls, and byte-exact host pipelines.

use gpufeed::Gpu;
use gpufeed::dataset::Error;
use gpufeed::dataset::{BatchData, BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler};

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
    let cfg = BatchLoaderOptions::default()
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
    let cfg = BatchLoaderOptions::default()
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
        BatchLoaderOptions::default().with_batch_size(4),
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
            BatchLoaderOptions::default()
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
    for (
        gpufeed::safetensors::HeaderEntry {
            name,
            dtype,
            shape,
            range,
        },
        want,
    ) in f.tensors.iter().zip([&a, &b])
    {
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

/// What an epoch yields, batch by batch: the epoch and number, the indices, a hash of the
/// bytes and offsets, and the position after it.
type Seen = Vec<(
    u64,
    usize,
    Vec<usize>,
    u64,
    Option<gpufeed::dataset::Position>,
)>;

fn seen_batch(batch: &host_batch::Batch) -> (u64, usize, Vec<usize>, u64) {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    host_bytes(batch).hash(&mut h);
    batch.offsets.hash(&mut h);
    (batch.epoch, batch.number, batch.indices.clone(), h.finish())
}

/// An elastic host loader of 203 records of 29 bytes (global batch 12, rank 1 of 2), with a
/// transform of either kind (or none).
fn elastic_loader(path: &std::path::Path, transform: u8) -> BatchLoader {
    // SAFETY: the file is private to the test and never changed.
    let records = unsafe { RecordFile::open_fixed(path, 29) }.expect("records");
    let sampler = Sampler::elastic(Order::Shuffled { seed: 5 }, 12, 1, 2, false).expect("elastic");
    let cfg = BatchLoaderOptions::default()
        .with_workers(3)
        .with_prefetch(4);
    let loader = BatchLoader::new(records, sampler, cfg, None).expect("loader");
    match transform {
        1 => loader.with_transform(|i, r, out| {
            out.extend(r.iter().rev());
            out.extend_from_slice(&(i as u32).to_le_bytes());
            Ok(())
        }),
        2 => loader.with_transform_into(33, |i, r, out| {
            let (head, tail) = out.split_at_mut(29);
            head.iter_mut()
                .zip(r.iter().rev())
                .for_each(|(o, b)| *o = *b);
            tail.copy_from_slice(&(i as u32).to_le_bytes());
            Ok(())
        }),
        _ => loader,
    }
}

/// An owned epoch (`BatchLoader::into_epoch`) yields the batches a borrowing one does, byte
/// for byte, with the same positions; it resumes from a position as `resume` does; a refused
/// resume gives the loader back; and a transform writing into the batch's buffer
/// (`with_transform_into`) yields what the appending one does.
#[test]
fn owned_host_epochs_match_borrowed_ones_and_resume() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("records.bin");
    std::fs::write(&path, random_bytes(203 * 29, 17)).expect("write");
    for transform in 0..3u8 {
        let mut borrowed: Seen = Vec::new();
        let mut loader = elastic_loader(&path, transform);
        let mut epoch = loader.epoch(2).expect("epoch");
        while let Some(b) = epoch.next() {
            let (e, n, i, h) = seen_batch(&b.expect("batch"));
            borrowed.push((e, n, i, h, epoch.position()));
        }
        drop(epoch);
        assert_eq!(
            borrowed.len(),
            17,
            "203 records: 17 steps of 12, the last padded"
        );
        let mut owned: Seen = Vec::new();
        let mut epoch = elastic_loader(&path, transform)
            .into_epoch(2)
            .expect("epoch");
        assert_eq!(epoch.epoch(), 2);
        while let Some(b) = epoch.next() {
            let (e, n, i, h) = seen_batch(&b.expect("batch"));
            owned.push((e, n, i, h, epoch.position()));
        }
        assert_eq!(owned, borrowed, "transform kind {transform}");
        let last = owned.last().and_then(|s| s.4).expect("position");
        assert_eq!(
            (last.epoch, last.samples),
            (3, 0),
            "the start of the next epoch"
        );
        assert!(epoch.next().is_none(), "ended");
        let loader = epoch.into_loader();
        assert_eq!(loader.stats().batches, 17);
        assert_eq!(
            loader.stats().copy_waited_s,
            0.0,
            "host batches are not copied"
        );
        // Resumed from the position after step 5: the rest, numbered on.
        let at = owned[4].4.expect("position");
        assert_eq!((at.epoch, at.samples), (2, 60));
        let mut rest = loader.into_resume(&at).expect("resume");
        let mut resumed: Seen = Vec::new();
        while let Some(b) = rest.next() {
            let (e, n, i, h) = seen_batch(&b.expect("batch"));
            resumed.push((e, n, i, h, rest.position()));
        }
        assert_eq!(resumed, owned[5..], "transform kind {transform}");
        let mut loader = rest.into_loader();
        let again: Vec<_> = loader
            .resume(&at)
            .expect("resume")
            .map(|b| seen_batch(&b.expect("batch")))
            .collect();
        let expected: Vec<_> = owned[5..]
            .iter()
            .map(|(e, n, i, h, _)| (*e, *n, i.clone(), *h))
            .collect();
        assert_eq!(again, expected, "the borrowing resume");
        // A refused resume gives the loader back, unchanged.
        let bad = gpufeed::dataset::Position {
            global_batch: 24,
            ..at
        };
        let refused = loader
            .into_resume(&bad)
            .map(|_| ())
            .expect_err("another global batch");
        assert!(
            refused.error.to_string().contains("global batch"),
            "{}",
            refused.error
        );
        let mut loader = *refused.loader;
        assert_eq!(loader.epoch(2).expect("epoch").count(), 17);
        let e: Error = loader
            .into_resume(&bad)
            .map(|_| ())
            .expect_err("refused")
            .into();
        assert!(
            matches!(e, Error::Load(gpufeed::load::Error::InvalidSetting(_))),
            "{e:?}"
        );
    }
    // The fixed-size transform's batches are the appending one's, byte for byte.
    let bytes = |kind| {
        let mut loader = elastic_loader(&path, kind);
        loader
            .epoch(0)
            .expect("epoch")
            .map(|b| seen_batch(&b.expect("batch")))
            .collect::<Vec<_>>()
    };
    assert_eq!(bytes(1), bytes(2));
}

/// An owned epoch stopped mid-epoch (given back with `into_loader`, or dropped) lets its
/// workers go: no transform runs after it, and the loader runs a whole epoch again.
#[test]
fn an_owned_epoch_stopped_mid_epoch_lets_its_workers_go() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("records.bin");
    std::fs::write(&path, random_bytes(400 * 8, 23)).expect("write");
    let calls = Arc::new(AtomicUsize::new(0));
    let open = |calls: &Arc<AtomicUsize>| {
        let calls = Arc::clone(calls);
        // SAFETY: the file is private to the test and never changed.
        let records = unsafe { RecordFile::open_fixed(&path, 8) }.expect("records");
        let cfg = BatchLoaderOptions::default()
            .with_batch_size(10)
            .with_workers(2)
            .with_prefetch(4);
        BatchLoader::new(records, Sampler::new(Order::Sequential), cfg, None)
            .expect("loader")
            .with_transform_into(8, move |_, r, out| {
                calls.fetch_add(1, SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(2));
                out.copy_from_slice(r);
                Ok(())
            })
    };
    let quiet = |calls: &AtomicUsize| {
        let before = calls.load(SeqCst);
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(
            calls.load(SeqCst),
            before,
            "a transform ran after the epoch stopped"
        );
    };
    let mut epoch = open(&calls).into_epoch(0).expect("epoch");
    for _ in 0..3 {
        epoch.next().expect("a batch").expect("batch");
    }
    let mut loader = epoch.into_loader();
    assert!(
        calls.load(SeqCst) < 400,
        "the workers stopped before the epoch's end"
    );
    quiet(&calls);
    // The loader again: a whole epoch, in order.
    let mut n = 0;
    for (k, b) in loader.epoch(0).expect("epoch").enumerate() {
        let b = b.expect("batch");
        assert_eq!(b.indices, (10 * k..10 * k + 10).collect::<Vec<_>>());
        n += 1;
    }
    assert_eq!(n, 40);
    assert_eq!(loader.stats().batches, 43);
    // Dropped, not given back: the same.
    let mut epoch = loader.into_epoch(1).expect("epoch");
    epoch.next().expect("a batch").expect("batch");
    drop(epoch);
    quiet(&calls);
    // A thread can own the epoch.
    let epoch = open(&calls).into_epoch(0).expect("epoch");
    let count = std::thread::spawn(move || epoch.count())
        .join()
        .expect("thread");
    assert_eq!(count, 40);
}

/// An image folder's files through either kind of transform (read into the worker's scratch
/// buffer, the output into the batch's): the same batches, each file's bytes seen whole.
#[test]
fn host_folder_transforms_of_both_kinds_agree() {
    use gpufeed::dataset::ImageFolder;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut files = Vec::new();
    for (c, class) in ["cat", "dog"].iter().enumerate() {
        std::fs::create_dir(dir.path().join(class)).expect("mkdir");
        for k in 0..23 {
            let bytes = random_bytes(1 + (k * 131 + c * 7) % 900, (c * 100 + k) as u64);
            std::fs::write(dir.path().join(class).join(format!("{k:02}.bin")), &bytes)
                .expect("write");
            files.push(bytes);
        }
    }
    let digest = |r: &[u8]| -> [u8; 8] {
        let sum: u32 = r.iter().map(|&b| u32::from(b)).sum();
        let mut out = [0u8; 8];
        out[..4].copy_from_slice(&(r.len() as u32).to_le_bytes());
        out[4..].copy_from_slice(&sum.to_le_bytes());
        out
    };
    let run = |into: bool| {
        let folder = ImageFolder::open(dir.path()).expect("folder");
        let cfg = BatchLoaderOptions::default()
            .with_batch_size(8)
            .with_workers(2);
        let sampler = Sampler::new(Order::Shuffled { seed: 4 });
        let loader = BatchLoader::new(folder, sampler, cfg, None).expect("loader");
        let loader = if into {
            loader.with_transform_into(8, move |_, r, out| {
                out.copy_from_slice(&digest(r));
                Ok(())
            })
        } else {
            loader.with_transform(move |_, r, out| {
                out.extend_from_slice(&digest(r));
                Ok(())
            })
        };
        let mut epoch = loader.into_epoch(0).expect("epoch");
        let mut seen = Vec::new();
        for b in &mut epoch {
            let b = b.expect("batch");
            let bytes = host_bytes(&b);
            assert_eq!(
                b.offsets,
                (0..=b.indices.len()).map(|k| 8 * k).collect::<Vec<_>>()
            );
            seen.push((b.indices, b.labels, bytes));
        }
        seen
    };
    let (a, b) = (run(false), run(true));
    assert_eq!(a, b);
    assert_eq!(a.iter().map(|s| s.0.len()).sum::<usize>(), 46);
    // Files are listed by class, then name: file i is `files[i]`.
    for (indices, _, bytes) in &a {
        for (k, &i) in indices.iter().enumerate() {
            assert_eq!(&bytes[8 * k..8 * k + 8], &digest(&files[i]), "file {i}");
        }
    }
}

/// The split kept every public path of the facade: the old names of the moved items and the
/// renamed settings still resolve, and every capability crate's error goes into
/// `gpufeed::Error` with `?`, a load's error inside it always as `Error::Load`.
#[test]
#[allow(deprecated, reason = "the old names are what is tested")]
fn the_facades_old_paths_keep_working_and_errors_flatten() {
    let cfg: gpufeed::dataset::LoaderConfig = gpufeed::dataset::BatchLoaderOptions::default();
    assert_eq!(
        cfg.batch_size,
        gpufeed::dataset::BatchLoaderOptions::default().batch_size
    );
    let _: gpufeed::cuda::TransferConfig = gpufeed::cuda::TransferOptions::default();
    let _: gpufeed::pinned::PoolConfig = gpufeed::pinned::PoolOptions::default();
    assert_eq!(gpufeed::units::parse_size("1.5GiB").expect("size"), 3 << 29);
    assert_eq!(gpufeed::units::show_size(1 << 20), "1 MiB");
    let _: fn(&gpufeed::Gpu, &str) -> gpufeed::safetensors::Result<_> =
        |g, p| gpufeed::safetensors::load(g, p);
    let _: Option<gpufeed::Strategy> = "staged".parse().ok();

    fn into_umbrella<E>(e: E) -> gpufeed::Result<()>
    where
        gpufeed::Error: From<E>,
    {
        Err(e)?
    }
    let invalid = || gpufeed::load::Error::InvalidSetting("x".into());
    for e in [
        into_umbrella(invalid()),
        into_umbrella(gpufeed::safetensors::Error::Load(invalid())),
        into_umbrella(gpufeed::dataset::Error::Load(invalid())),
        into_umbrella(gpufeed::multi::Error::Load(invalid())),
        into_umbrella(gpufeed::multi::Error::Safetensors(
            gpufeed::safetensors::Error::Load(invalid()),
        )),
    ] {
        assert!(
            matches!(
                e,
                Err(gpufeed::Error::Load(gpufeed::load::Error::InvalidSetting(
                    _
                )))
            ),
            "{e:?}"
        );
    }
    assert!(matches!(
        into_umbrella(gpufeed::dataset::Error::WorkersStopped),
        Err(gpufeed::Error::Data(
            gpufeed::dataset::Error::WorkersStopped
        ))
    ));
    assert!(matches!(
        into_umbrella(gpufeed::multi::Error::RankFailed { rank: 3 }),
        Err(gpufeed::Error::Multi(gpufeed::multi::Error::RankFailed {
            rank: 3
        }))
    ));
    let no_gpu = into_umbrella(gpufeed::safetensors::Error::from(
        gpufeed::pinned::Error::NoCudaDriver,
    ))
    .unwrap_err();
    assert!(no_gpu.is_no_gpu(), "{no_gpu:?}");
    assert!(no_gpu.as_load().is_some());
    // A bad size is a setting that cannot work, in every crate's error.
    let bad = gpufeed::units::parse_size("3 parsecs").unwrap_err();
    assert!(matches!(
        gpufeed::dataset::Error::from(bad.clone()),
        gpufeed::dataset::Error::Load(gpufeed::load::Error::InvalidSetting(m)) if m.contains("parsecs")
    ));
    assert_eq!(bad.why, "unknown unit");
}
