//! The hybrid training loader (`gpufeed_load::hybrid`) with real training processes: a loader
//! preprocesses shuffled batches of RGB8 images (on the CPU, and on the GPU where there is
//! one) and deals them out over two shared-memory rings; each trainer process takes its
//! batches with a `RingLoader` and checks every record against the CPU's planar values of the
//! record file it maps itself. Together they see every record once.

use std::time::Duration;

use gpufeed_data::ring::RingLoader;
use gpufeed_data::{BatchData, BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler};
use gpufeed_frames::frames::FrameFormat;
use gpufeed_frames::hybrid::{Fanout, GpuPlanar, Planar, batches_for, planar_transform};
use gpufeed_ipc::BatchRing;

const ROLE: &str = "hybrid-trainer";
const IMAGE: FrameFormat = FrameFormat {
    width: 17,
    height: 9,
};
const RECORDS: usize = 300;
const BATCH: usize = 32;
/// Epochs each run publishes (a trainer process lives across them).
const EPOCHS: u64 = 2;

/// A trainer process over ring `name`, taking `batches` batches of epoch 0.
fn trainer(name: &str, records: &std::path::Path, batches: usize) -> std::process::Command {
    let mut cmd = gpufeed_testkit::child_command("hybrid::trainer_dispatcher", ROLE, &[]);
    cmd.env("GPUFEED_IT_RING", name)
        .env("GPUFEED_IT_RECORDS", records)
        .env("GPUFEED_IT_BATCHES", batches.to_string())
        .stdout(std::process::Stdio::piped());
    cmd
}

/// The trainer side, run only as a child of the tests below: prints the records it saw.
#[test]
fn trainer_dispatcher() {
    if std::env::var(gpufeed_testkit::CHILD_ROLE).as_deref() != Ok(ROLE) {
        return;
    }
    let ring = BatchRing::open(&std::env::var("GPUFEED_IT_RING").expect("ring")).expect("open");
    let path = std::env::var("GPUFEED_IT_RECORDS").expect("records");
    let batches: usize = std::env::var("GPUFEED_IT_BATCHES")
        .expect("batches")
        .parse()
        .expect("a number");
    // SAFETY: the test's record file is never changed.
    let records = unsafe { RecordFile::open_fixed(&path, IMAGE.bytes()) }.expect("records");
    let reference = planar_transform(IMAGE);
    let mut loader = RingLoader::new(&ring, None).expect("ring loader");
    let mut seen = Vec::new();
    let mut want = Vec::new();
    for batch in (0..EPOCHS).flat_map(|e| {
        loader
            .epoch(e, batches, Duration::from_secs(30))
            .collect::<Vec<_>>()
    }) {
        let batch = batch.expect("batch");
        if std::env::var_os("GPUFEED_IT_PANIC").is_some() {
            panic!("a trainer's bug, at its first batch");
        }
        let BatchData::Host(bytes) = &batch.data else {
            panic!("host batches without a GPU")
        };
        for (k, &i) in batch.indices.iter().enumerate() {
            want.clear();
            reference(i, records.record(i).expect("record"), &mut want).expect("reference");
            assert_eq!(
                &bytes[batch.offsets[k]..batch.offsets[k + 1]],
                &want[..],
                "record {i}'s planar values"
            );
            seen.push(i);
        }
    }
    println!(
        "TRAINED {}",
        seen.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    );
}

/// A record file of random images (from `seed`), a loader over it in `order` (with the CPU
/// transform where there is no GPU), and two rings of three slots that fit a planar batch.
struct Setup {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    loader: BatchLoader,
    rings: [BatchRing; 2],
}

fn setup(seed: u64, order: Order, gpu: Option<&gpufeed_load::Gpu>) -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("images.bin");
    std::fs::write(
        &path,
        gpufeed_testkit::random_bytes(RECORDS * IMAGE.bytes(), seed),
    )
    .expect("write");
    // SAFETY: the test's record file is never changed.
    let records = unsafe { RecordFile::open_fixed(&path, IMAGE.bytes()) }.expect("records");
    let cfg = BatchLoaderOptions::default()
        .with_batch_size(BATCH)
        .with_workers(2);
    let mut loader = BatchLoader::new(records, Sampler::new(order), cfg, gpu).expect("loader");
    if gpu.is_none() {
        loader = loader.with_transform(planar_transform(IMAGE));
    }
    let slot = (BATCH * IMAGE.bytes() * 4 + 4096) as u64;
    let rings = [
        BatchRing::create_unique(3, slot).expect("ring"),
        BatchRing::create_unique(3, slot).expect("ring"),
    ];
    Setup {
        _dir: dir,
        path,
        loader,
        rings,
    }
}

/// A trainer process on each ring, its share of an epoch of `batches` each, its stderr
/// `stderr()`.
fn spawn_trainers(
    rings: &[BatchRing],
    records: &std::path::Path,
    batches: usize,
    stderr: fn() -> std::process::Stdio,
) -> Vec<std::process::Child> {
    rings
        .iter()
        .enumerate()
        .map(|(t, r)| {
            trainer(
                r.segment().name().expect("named"),
                records,
                batches_for(batches, rings.len(), t),
            )
            .stderr(stderr())
            .spawn()
            .expect("trainer")
        })
        .collect()
}

/// The records file, the loader over it, two rings with a trainer process on each; runs
/// `publish` on every batch of [`EPOCHS`] epochs (with the epoch) and checks that the
/// trainers saw every record once per epoch.
fn with_trainers(
    gpu: Option<&gpufeed_load::Gpu>,
    mut publish: impl FnMut(&mut Fanout<'_>, u64, &gpufeed_data::Batch),
) {
    let Setup {
        _dir,
        path,
        mut loader,
        rings,
    } = setup(31, Order::Shuffled { seed: 4 }, gpu);
    let batches = loader.batches_per_epoch();
    let children = spawn_trainers(&rings, &path, batches, std::process::Stdio::inherit);
    let mut fanout = Fanout::new(&rings, gpu).expect("fanout");
    assert_eq!(fanout.registered(0), gpu.is_some());
    for e in 0..EPOCHS {
        for batch in loader.epoch(e).expect("epoch") {
            publish(&mut fanout, e, &batch.expect("batch"));
        }
    }
    every_record_once_per_epoch(children);
}

/// Waits for the trainer processes and checks that together they saw every record once per
/// epoch.
fn every_record_once_per_epoch(children: Vec<std::process::Child>) {
    let mut seen = vec![0u32; RECORDS];
    for child in children {
        let out = child.wait_with_output().expect("trainer");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "trainer failed: {text}");
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("TRAINED"))
            .expect("the trainer's records");
        for i in line.split_whitespace() {
            seen[i.parse::<usize>().expect("index")] += 1;
        }
    }
    assert!(
        seen.iter().all(|&c| c == EPOCHS as u32),
        "every record once per epoch: {seen:?}"
    );
}

/// Batches on the GPU to one trainer through one ring of two slots (the trainer holds one,
/// the fanout writes the other): every record arrives once per epoch, nothing waits out a
/// timeout.
#[test]
fn gpu_batches_through_one_small_ring_reach_their_trainer() {
    let Some(gpu) = crate::gpu_or_skip("gpu_batches_through_one_small_ring_reach_their_trainer")
    else {
        return;
    };
    let Setup {
        _dir,
        path,
        mut loader,
        ..
    } = setup(37, Order::Shuffled { seed: 5 }, Some(&gpu));
    let slot = (BATCH * IMAGE.bytes() * 4 + 4096) as u64;
    let rings = [BatchRing::create_unique(2, slot).expect("ring")];
    let batches = loader.batches_per_epoch();
    let children = spawn_trainers(&rings, &path, batches, std::process::Stdio::inherit);
    let planar = GpuPlanar::new(&gpu, IMAGE).expect("kernel");
    let mut fanout = Fanout::new(&rings, Some(&gpu))
        .expect("fanout")
        .with_timeout(Duration::from_secs(20));
    for e in 0..EPOCHS {
        for batch in loader.epoch(e).expect("epoch") {
            let batch = batch.expect("batch");
            let out = planar.apply(&batch).expect("preprocess");
            fanout
                .publish(e, &batch.indices, Planar::Device(&out, planar.stream()))
                .expect("publish");
        }
    }
    every_record_once_per_epoch(children);
}

#[test]
fn preprocessed_batches_reach_trainer_processes_on_the_cpu() {
    with_trainers(None, |fanout, e, batch| {
        let BatchData::Host(bytes) = &batch.data else {
            panic!("host batches without a GPU")
        };
        fanout
            .publish(e, &batch.indices, Planar::Host(&bytes[..batch.bytes()]))
            .expect("publish");
    });
}

#[test]
fn batches_preprocessed_on_the_gpu_reach_trainer_processes() {
    let Some(gpu) = crate::gpu_or_skip("batches_preprocessed_on_the_gpu_reach_trainer_processes")
    else {
        return;
    };
    let planar = GpuPlanar::new(&gpu, IMAGE).expect("kernel");
    let reference = planar_transform(IMAGE);
    let mut first = true;
    with_trainers(Some(&gpu), |fanout, e, batch| {
        let out = planar.apply(batch).expect("preprocess");
        if first {
            // In this process too: the result on the GPU equals the CPU's.
            first = false;
            let got = planar.stream().clone_dtoh(&out).expect("download");
            let BatchData::Device(raw) = &batch.data else {
                panic!("device batches with a GPU")
            };
            let raw = planar.stream().clone_dtoh(raw).expect("raw");
            let mut want = Vec::new();
            for (k, &i) in batch.indices.iter().enumerate() {
                reference(
                    i,
                    &raw[k * IMAGE.bytes()..(k + 1) * IMAGE.bytes()],
                    &mut want,
                )
                .expect("reference");
            }
            let got: Vec<u8> = got.iter().flat_map(|v| v.to_le_bytes()).collect();
            assert_eq!(got, want, "the GPU's planar batch");
        }
        fanout
            .publish(e, &batch.indices, Planar::Device(&out, planar.stream()))
            .expect("publish");
    });
}

/// A trainer that panics (its loader unwinds and leaves the ring) ends the loader's
/// `publish` with an error once that trainer's ring is full, not after the fanout's timeout.
#[test]
fn a_trainer_that_panics_ends_publishing_with_an_error_not_a_wait() {
    let Setup {
        _dir,
        path,
        mut loader,
        rings,
    } = setup(32, Order::Sequential, None);
    let batches = loader.batches_per_epoch();
    let mut panicking = trainer(rings[0].segment().name().expect("named"), &path, batches);
    let panicking = panicking
        .env("GPUFEED_IT_PANIC", "1")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("trainer");
    // The other trainer takes its batches as usual; it is stopped at the end.
    let mut other = trainer(rings[1].segment().name().expect("named"), &path, batches)
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("trainer");
    let mut fanout = Fanout::new(&rings, None)
        .expect("fanout")
        .with_timeout(Duration::from_secs(60));
    let started = std::time::Instant::now();
    let mut failed = None;
    // Epochs until it fails: however many batches the trainer took before it panicked, its
    // ring of 3 slots is full within a few.
    'epochs: for e in 0..4 {
        for batch in loader.epoch(e).expect("epoch") {
            let batch = batch.expect("batch");
            let BatchData::Host(bytes) = &batch.data else {
                panic!("host batches without a GPU")
            };
            if let Err(err) =
                fanout.publish(e, &batch.indices, Planar::Host(&bytes[..batch.bytes()]))
            {
                failed = Some(err);
                break 'epochs;
            }
        }
    }
    let _ = other.kill();
    let _ = other.wait();
    let out = panicking.wait_with_output().expect("trainer");
    assert!(!out.status.success(), "the trainer panicked");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("a trainer's bug"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = failed.expect("publishing to the panicked trainer's full ring fails");
    assert!(
        err.to_string().contains("exited or left"),
        "the error says the trainer is gone: {err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the loader learned after {:?} (its timeout is 60 s)",
        started.elapsed()
    );
}

/// A loader that stops publishing (its fanout dropped, as when its process ends or dies)
/// ends its trainers' waits with an error at once, not after their 30 s timeout.
#[test]
fn trainers_learn_at_once_that_their_loader_stopped() {
    let Setup {
        _dir,
        path,
        mut loader,
        rings,
    } = setup(33, Order::Sequential, None);
    let batches = loader.batches_per_epoch();
    let mut fanout = Fanout::new(&rings, None).expect("fanout");
    let trainers = spawn_trainers(&rings, &path, batches, std::process::Stdio::piped);
    // One batch for each trainer, then the loader stops.
    for batch in loader.epoch(0).expect("epoch").take(2) {
        let batch = batch.expect("batch");
        let BatchData::Host(bytes) = &batch.data else {
            panic!("host batches without a GPU")
        };
        fanout
            .publish(0, &batch.indices, Planar::Host(&bytes[..batch.bytes()]))
            .expect("publish");
    }
    let stopped = std::time::Instant::now();
    drop(fanout);
    for child in trainers {
        let out = child.wait_with_output().expect("trainer");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "the trainer got fewer batches than it wanted"
        );
        assert!(
            err.contains("ProducerGone"),
            "the trainer was told its loader stopped (its `expect` prints the error's Debug): {err}"
        );
    }
    assert!(
        stopped.elapsed() < Duration::from_secs(15),
        "trainers learned after {:?} (their timeout is 30 s)",
        stopped.elapsed()
    );
}
