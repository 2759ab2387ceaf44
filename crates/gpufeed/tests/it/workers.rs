//! Batch workers in other processes, through a shared-memory ring: the consumer gets the same
//! batches, in the same order, as the in-process loader.

use std::process::Stdio;
use std::time::Duration;

use gpufeed::dataset::ring::{RingLoader, WorkerShare, epoch_batches, produce_epoch};
use gpufeed::dataset::{BatchData, BatchLoader, LoaderConfig, Order, RecordFile, Sampler};
use gpufeed::ipc::BatchRing;

use crate::random_bytes;

const RECORD: usize = 37;

fn cfg() -> LoaderConfig {
    LoaderConfig::default()
        .with_batch_size(50)
        .with_drop_last(false)
        .with_prefetch(2)
        .with_workers(2)
}

fn sampler() -> Sampler {
    Sampler::new(Order::Shuffled { seed: 99 })
}

/// Runs in a child process: worker `GPUFEED_IT_WORKER` of 3 writes its share of epoch 1.
#[test]
fn worker_entry() {
    let Ok(worker) = std::env::var("GPUFEED_IT_WORKER") else {
        return;
    };
    let ring =
        BatchRing::open(&std::env::var("GPUFEED_IT_RING").expect("ring")).expect("open ring");
    // SAFETY: the test's record file is never changed.
    let records = unsafe {
        RecordFile::open_fixed(
            std::env::var("GPUFEED_IT_RECORDS").expect("records"),
            RECORD,
        )
    }
    .expect("records");
    let share = WorkerShare::new(1, worker.parse().expect("number"), 3)
        .with_timeout(Duration::from_secs(30));
    let n = produce_epoch(&ring, &records, &sampler(), &cfg(), &share).expect("produce");
    assert!(n > 0);
}

/// Starts 3 worker processes on `ring` and checks what `loader` yields against the in-process
/// loader.
pub fn check_ring_loader(gpu: Option<&gpufeed::Gpu>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("records.bin");
    let data = random_bytes(2000 * RECORD, 12);
    std::fs::write(&path, &data).expect("write");
    let ring = BatchRing::create_unique(6, 64 * 1024).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    let mut loader = RingLoader::new(&ring, gpu).expect("ring loader");
    let children: Vec<_> = (0..3)
        .map(|w| {
            let vars = [
                ("GPUFEED_IT_WORKER", w.to_string()),
                ("GPUFEED_IT_RING", name.clone()),
                ("GPUFEED_IT_RECORDS", path.display().to_string()),
            ];
            gpufeed_testkit::child_command("workers::worker_entry", "worker", &vars)
                .stdout(Stdio::null())
                .spawn()
                .expect("spawn worker")
        })
        .collect();
    let want = epoch_batches(2000, &sampler(), &cfg(), 1);
    // SAFETY: as above.
    let records = unsafe { RecordFile::open_fixed(&path, RECORD) }.expect("records");
    let mut local = BatchLoader::new(records, sampler(), cfg(), None).expect("loader");
    let local: Vec<_> = local
        .epoch(1)
        .expect("epoch")
        .map(|b| b.expect("batch").indices)
        .collect();
    let mut count = 0;
    for (n, batch) in loader
        .epoch(1, want.len(), Duration::from_secs(30))
        .enumerate()
    {
        let batch = batch.expect("batch");
        assert_eq!(batch.number, n, "batch order");
        assert_eq!(batch.indices, want[n].1);
        assert_eq!(
            batch.indices, local[n],
            "same batches as the in-process loader"
        );
        let bytes = match &batch.data {
            BatchData::Host(b) => b.to_vec(),
            BatchData::Device(d) => gpu
                .expect("device batch on a GPU")
                .to_vec(d)
                .expect("copy back"),
        };
        let expect: Vec<u8> = batch
            .indices
            .iter()
            .flat_map(|&i| data[i * RECORD..(i + 1) * RECORD].iter().copied())
            .collect();
        assert!(bytes == expect, "batch {n} bytes differ");
        count += 1;
    }
    assert_eq!(count, want.len());
    for mut c in children {
        assert!(c.wait().expect("wait").success(), "a worker failed");
    }
    assert!(
        loader.notes.is_empty() || gpu.is_some(),
        "{:?}",
        loader.notes
    );
}

#[test]
fn worker_processes_feed_host_batches() {
    check_ring_loader(None);
}

/// Records of the hung-worker test: 4800 of 16 bytes, batches of 8 (600 batches).
const HANG_RECORD: usize = 16;
const HANG_RECORDS: usize = 4800;
const HANG_BATCH: usize = 8;

fn hang_cfg() -> LoaderConfig {
    LoaderConfig::default().with_batch_size(HANG_BATCH)
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by the parent"))
}

/// Runs in a child: worker `GPUFEED_IT_HANG_WORKER` of 3 writes its share of epoch 0. Worker 1's
/// transform never returns (it sleeps until killed) on the first record of its first batch,
/// batch 1; the others append one byte per record to `GPUFEED_IT_PROGRESS`, so the parent
/// sees how far they got.
#[test]
fn hanging_worker_entry() {
    use std::io::Write;
    let Ok(worker) = std::env::var("GPUFEED_IT_HANG_WORKER") else {
        return;
    };
    let worker: usize = worker.parse().expect("number");
    let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
    // SAFETY: the test's record file is never changed.
    let records =
        unsafe { RecordFile::open_fixed(var("GPUFEED_IT_RECORDS"), HANG_RECORD) }.expect("records");
    let progress = std::fs::OpenOptions::new()
        .append(true)
        .open(var("GPUFEED_IT_PROGRESS"))
        .expect("progress file");
    let transform: gpufeed::dataset::Transform = std::sync::Arc::new(move |_, r, out| {
        if worker == 1 {
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        (&progress).write_all(&[1]).map_err(|e| e.to_string())?;
        out.extend_from_slice(r);
        Ok(())
    });
    let share = WorkerShare::new(0, worker, 3)
        .with_transform(&transform)
        .with_timeout(Duration::from_secs(20));
    // The trainer gives up and leaves: the others end with ConsumerGone (or a timeout).
    let result = produce_epoch(&ring, &records, &sampler(), &hang_cfg(), &share);
    println!("worker {worker}: {result:?}");
}

/// Child processes, killed (and reaped) when dropped, also when an assertion fails.
struct Children(Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What [`hung_epoch`] saw.
struct Hung {
    err: gpufeed::Error,
    /// From the call for batch 1 to its error.
    waited: Duration,
    /// Records the two live workers transformed by then.
    written: usize,
}

const HANG_SLOTS: u32 = 4;

/// Three worker processes write epoch 0 (600 batches) into a ring of 4 slots; worker 1 hangs in
/// its transform on its first batch, batch 1. The trainer's `RingLoader` (with `window`, or
/// the default) takes batch 0, then waits for batch 1 up to `timeout`.
fn hung_epoch(window: Option<usize>, timeout: Duration) -> Hung {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("records.bin");
    std::fs::write(&path, random_bytes(HANG_RECORDS * HANG_RECORD, 37)).expect("write");
    let progress = dir.path().join("progress");
    std::fs::write(&progress, b"").expect("progress file");
    let ring = BatchRing::create_unique(HANG_SLOTS, 4096).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    let mut loader = RingLoader::new(&ring, None).expect("ring loader");
    assert_eq!(loader.window(), 4 * HANG_SLOTS as usize, "the default");
    if let Some(w) = window {
        loader = loader.with_window(w);
    }
    let _children = Children(
        (0..3)
            .map(|w| {
                let vars = [
                    ("GPUFEED_IT_HANG_WORKER", w.to_string()),
                    ("GPUFEED_IT_RING", name.clone()),
                    ("GPUFEED_IT_RECORDS", path.display().to_string()),
                    ("GPUFEED_IT_PROGRESS", progress.display().to_string()),
                ];
                gpufeed_testkit::child_command("workers::hanging_worker_entry", "worker", &vars)
                    .stdout(Stdio::null())
                    .spawn()
                    .expect("spawn worker")
            })
            .collect(),
    );
    let total = epoch_batches(HANG_RECORDS, &sampler(), &hang_cfg(), 0).len();
    assert_eq!(total, 600);
    let mut epoch = loader.epoch(0, total, timeout);
    let first = epoch
        .next()
        .expect("batch 0")
        .expect("batch 0 from worker 0");
    assert_eq!(first.number, 0);
    let t = std::time::Instant::now();
    let err = epoch
        .next()
        .expect("an item for batch 1")
        .expect_err("batch 1 never comes");
    let waited = t.elapsed();
    let written = std::fs::metadata(&progress).expect("progress").len() as usize;
    eprintln!("after {waited:?}, {written} records written by the live workers: {err}");
    let text = err.to_string();
    assert!(
        text.contains("batch 1 ") && text.contains("worker 1 of 3"),
        "the error names the batch and its worker: {text}"
    );
    assert!(
        waited < timeout + Duration::from_secs(5),
        "failed after {waited:?}, the timeout is {timeout:?}"
    );
    assert_eq!(epoch.held(), 0, "released at the error");
    assert!(epoch.next().is_none(), "the epoch ended at the error");
    Hung {
        err,
        waited,
        written,
    }
}

/// One of three worker processes hangs in its transform on its first batch (batch 1): the
/// trainer's `RingLoader` does not buffer the rest of the epoch from the two others. It holds
/// at most its window of batches out of order, plus the ring's slots (the two others are held
/// back: they transformed at most those, the batch handed out, the ring's slots again once
/// the error released them and one batch each in hand), and ends the epoch at once, since no
/// slot is left for batch 1, with an error naming batch 1 and worker 1.
#[test]
fn a_hung_worker_ends_the_epoch_naming_it_with_bounded_memory() {
    let window = 4 * HANG_SLOTS as usize;
    let slots = HANG_SLOTS as usize;
    let hung = hung_epoch(None, Duration::from_secs(3));
    let bound = (1 + window + 2 * slots + 2) * HANG_BATCH;
    assert!(
        hung.written <= bound,
        "the two live workers transformed {} records, more than the {bound} that the window, \
         the ring and a batch in hand each allow: the trainer buffered them",
        hung.written
    );
    match hung.err {
        gpufeed::Error::RingBatchMissing {
            batch: 1,
            worker: Some(1),
            workers: Some(3),
            held,
            stalled: true,
            ..
        } => assert_eq!(
            held,
            window + slots,
            "the window moved out, every slot parked"
        ),
        other => panic!("not the missing batch, stalled: {other:?}"),
    }
}

/// With a window larger than the epoch the loader holds every batch of the two live workers
/// (the memory the caller allowed) and gives up on batch 1 after its timeout, not before.
#[test]
fn a_hung_worker_past_a_large_window_fails_after_the_timeout() {
    let timeout = Duration::from_secs(4); // time for the others to write all of theirs
    let hung = hung_epoch(Some(1000), timeout);
    assert!(hung.waited >= timeout, "gave up after {:?}", hung.waited);
    assert_eq!(
        hung.written,
        400 * HANG_BATCH,
        "the live workers wrote all of theirs"
    );
    match hung.err {
        gpufeed::Error::RingBatchMissing {
            batch: 1,
            worker: Some(1),
            workers: Some(3),
            held: 399,
            stalled: false,
            ms,
        } => assert!(ms >= timeout.as_millis(), "{ms} ms"),
        other => panic!("not the missing batch after the timeout: {other:?}"),
    }
}

/// Nine batches of three workers published out of turn into a ring of 9 slots (worker 2's,
/// then worker 1's, then worker 0's: 2 5 8 1 4 7 0 3 6) and read by a `RingLoader` whose
/// window is 2: batches past the window wait in their slots and are moved out (uploaded, with
/// a GPU: from the registered ring) when their turn or room comes. Every batch comes in order
/// with its bytes; a batch that comes twice is an error.
fn check_parked_batches(gpu: Option<&gpufeed::Gpu>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("records.bin");
    let data = random_bytes(90 * RECORD, 41);
    std::fs::write(&path, &data).expect("write");
    // SAFETY: the test's record file is never changed.
    let records = unsafe { RecordFile::open_fixed(&path, RECORD) }.expect("records");
    let cfg = LoaderConfig::default().with_batch_size(10);
    let want = epoch_batches(90, &sampler(), &cfg, 4);
    assert_eq!(want.len(), 9);
    let ring = BatchRing::anonymous(9, 4096).expect("ring");
    let mut loader = RingLoader::new(&ring, gpu)
        .expect("ring loader")
        .with_window(2);
    for w in [2, 1, 0] {
        let share = WorkerShare::new(4, w, 3).with_timeout(Duration::from_secs(5));
        assert_eq!(
            produce_epoch(&ring, &records, &sampler(), &cfg, &share).expect("produce"),
            3
        );
    }
    let mut epoch = loader.epoch(4, 9, Duration::from_secs(5));
    let mut most = 0;
    for (n, (_, indices)) in want.iter().enumerate() {
        let batch = epoch.next().expect("a batch").expect("in order");
        most = most.max(epoch.held());
        assert!(
            epoch.held_bytes() <= 2 * 10 * RECORD,
            "the window: two batches moved out"
        );
        assert_eq!(batch.number, n);
        assert_eq!(&batch.indices, indices);
        let bytes = match &batch.data {
            BatchData::Host(b) => b.to_vec(),
            BatchData::Device(d) => gpu.expect("a GPU").to_vec(d).expect("copy back"),
        };
        let expect: Vec<u8> = batch
            .indices
            .iter()
            .flat_map(|&i| data[i * RECORD..(i + 1) * RECORD].iter().copied())
            .collect();
        assert!(bytes == expect, "batch {n} bytes differ");
    }
    assert!(epoch.next().is_none());
    assert_eq!(
        most, 6,
        "after batch 0: 2 and 5 moved out, 8 1 4 7 left in their slots"
    );
    drop(epoch);
    // Worker 0's share twice: its batch 0 again, once batch 0 was handed out.
    let share = WorkerShare::new(5, 0, 3).with_timeout(Duration::from_secs(5));
    for _ in 0..2 {
        produce_epoch(&ring, &records, &sampler(), &cfg, &share).expect("produce");
    }
    let err = loader
        .epoch(5, 9, Duration::from_secs(5))
        .find_map(Result::err)
        .expect("an error");
    assert!(
        matches!(&err, gpufeed::Error::MalformedBatch { reason } if reason.contains("batch 0 came twice")),
        "{err}"
    );
}

#[test]
fn batches_past_the_window_wait_in_their_slots_and_come_in_order() {
    check_parked_batches(None);
}

#[test]
fn device_batches_past_the_window_wait_in_their_slots_and_come_in_order() {
    let Some(gpu) =
        crate::gpu_or_skip("device_batches_past_the_window_wait_in_their_slots_and_come_in_order")
    else {
        return;
    };
    check_parked_batches(Some(&gpu));
}
