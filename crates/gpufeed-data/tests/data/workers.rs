//! Batch workers in other processes, through a shared-memory ring: the consumer gets the same
//! batches, in the same order, as the in-process loader.

use std::process::Stdio;
use std::time::Duration;

use gpufeed_data::ring::{RingLoader, WorkerShare, epoch_batches, produce_epoch};
use gpufeed_data::{BatchData, BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler};
use gpufeed_ipc::BatchRing;

use crate::random_bytes;

const RECORD: usize = 37;

fn cfg() -> BatchLoaderOptions {
    BatchLoaderOptions::default()
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
pub fn check_ring_loader(gpu: Option<&gpufeed_load::Gpu>) {
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

fn hang_cfg() -> BatchLoaderOptions {
    BatchLoaderOptions::default().with_batch_size(HANG_BATCH)
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
    let transform: gpufeed_data::Transform = std::sync::Arc::new(move |_, r, out| {
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
    // The trainer gives up on batch 1 and ends the epoch: the others, waiting for their turn,
    // end with RingWorkerHeldBack (the epoch ended), or Ok with a window past the epoch.
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
    err: gpufeed_data::Error,
    /// From the call for batch 1 to its error.
    waited: Duration,
    /// Records the two live workers transformed by then.
    written: usize,
    /// What the two live workers (0 and 2) printed: `produce_epoch`'s result.
    results: Vec<String>,
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
    let out = |w: usize| dir.path().join(format!("worker-{w}.out"));
    let mut children = Children(
        (0..3)
            .map(|w| {
                let vars = [
                    ("GPUFEED_IT_HANG_WORKER", w.to_string()),
                    ("GPUFEED_IT_RING", name.clone()),
                    ("GPUFEED_IT_RECORDS", path.display().to_string()),
                    ("GPUFEED_IT_PROGRESS", progress.display().to_string()),
                ];
                let stdout = std::fs::File::create(out(w)).expect("worker output");
                gpufeed_testkit::child_command("workers::hanging_worker_entry", "worker", &vars)
                    .stdout(stdout)
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
    // The live workers end soon (the epoch ended, or they were done), with the ring and its
    // consumer still there: not at their own 20 s timeout.
    let t = std::time::Instant::now();
    for w in [0, 2] {
        while children.0[w].try_wait().expect("try_wait").is_none() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "worker {w} still runs {:?} after the epoch ended",
                t.elapsed()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let results = [0, 2]
        .map(|w| std::fs::read_to_string(out(w)).expect("worker output"))
        .to_vec();
    eprintln!(
        "the live workers ended after {:?}: {results:?}",
        t.elapsed()
    );
    Hung {
        err,
        waited,
        written,
        results,
    }
}

/// One of three worker processes hangs in its transform on its first batch (batch 1): the
/// trainer's `RingLoader` does not buffer the rest of the epoch from the two others. They are
/// held back at its window (16) past batch 1: they transform batch 0 and their 11 batches
/// numbered 2 to 17, nothing more; the loader holds those 11 (moved out of the ring, none left
/// in a slot), waits its timeout for batch 1 and ends the epoch with an error naming batch 1
/// and worker 1; the two others, waiting for their turn, then stop at once with
/// `RingWorkerHeldBack` (the epoch ended). Before the loader published its position the two
/// others ran on until every slot held a later batch (the window moved out, the ring's slots
/// parked) and the epoch failed at once, stalled; the same premise, now held back instead.
#[test]
fn a_hung_worker_ends_the_epoch_naming_it_with_bounded_memory() {
    let window = 4 * HANG_SLOTS as usize;
    let timeout = Duration::from_secs(3);
    let hung = hung_epoch(None, timeout);
    // Batches 0 to 1 + window, less worker 1's (1, 4, ..., 16): batch 0 and 11 held.
    let theirs = (0..=1 + window).filter(|n| n % 3 != 1).count();
    assert_eq!(theirs, 12);
    assert_eq!(
        hung.written,
        theirs * HANG_BATCH,
        "the two live workers transformed other than the batches within the window: the \
         trainer buffered them, or did not let them run ahead"
    );
    assert!(hung.waited >= timeout, "gave up after {:?}", hung.waited);
    match hung.err {
        gpufeed_data::Error::RingBatchMissing {
            batch: 1,
            worker: Some(1),
            workers: Some(3),
            held,
            stalled: false,
            ..
        } => assert_eq!(held, theirs - 1, "the window's batches, moved out"),
        other => panic!("not the missing batch after the timeout: {other:?}"),
    }
    for r in &hung.results {
        assert!(
            r.contains("RingWorkerHeldBack") && r.contains("ended: true"),
            "a live worker did not end because the epoch ended: {r}"
        );
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
        gpufeed_data::Error::RingBatchMissing {
            batch: 1,
            worker: Some(1),
            workers: Some(3),
            held: 399,
            stalled: false,
            ms,
        } => assert!(ms >= timeout.as_millis(), "{ms} ms"),
        other => panic!("not the missing batch after the timeout: {other:?}"),
    }
    for r in &hung.results {
        assert!(r.contains("Ok(200)"), "a live worker: {r}");
    }
}

/// Nine batches of three workers published out of turn into a ring of 9 slots (worker 2's,
/// then worker 1's, then worker 0's: 2 5 8 1 4 7 0 3 6) and read by a `RingLoader` whose
/// window is 2: batches past the window wait in their slots and are moved out (uploaded, with
/// a GPU: from the registered ring) when their turn or room comes. Every batch comes in order
/// with its bytes; a batch that comes twice is an error.
///
/// The workers run before the loader exists, so nothing paces them (workers held back by a
/// loader's window never get past it: this is the path for batches that did not wait, e.g.
/// produced before the trainer started reading); the duplicate part runs with the loader's
/// window at 9, so that the worker's share of 3 batches, twice, is within it.
fn check_parked_batches(gpu: Option<&gpufeed_load::Gpu>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("records.bin");
    let data = random_bytes(90 * RECORD, 41);
    std::fs::write(&path, &data).expect("write");
    // SAFETY: the test's record file is never changed.
    let records = unsafe { RecordFile::open_fixed(&path, RECORD) }.expect("records");
    let cfg = BatchLoaderOptions::default().with_batch_size(10);
    let want = epoch_batches(90, &sampler(), &cfg, 4);
    assert_eq!(want.len(), 9);
    let ring = BatchRing::anonymous(9, 4096).expect("ring");
    assert_eq!(ring.watermark().window, None, "a ring nobody paces");
    for w in [2, 1, 0] {
        let share = WorkerShare::new(4, w, 3).with_timeout(Duration::from_secs(5));
        assert_eq!(
            produce_epoch(&ring, &records, &sampler(), &cfg, &share).expect("produce"),
            3
        );
    }
    let mut loader = RingLoader::new(&ring, gpu)
        .expect("ring loader")
        .with_window(2);
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
    let mut loader = loader.with_window(9);
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
        matches!(&err, gpufeed_data::Error::MalformedBatch { reason } if reason.contains("batch 0 came twice")),
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

/// The slow-worker test: 800 records of 16 bytes in batches of 4 (200 batches), three workers
/// on a ring of 3 slots read with a window of 4: the epoch is 20 times the window and the
/// ring together.
const SLOW_RECORD: usize = 16;
const SLOW_RECORDS: usize = 800;
const SLOW_BATCH: usize = 4;
const SLOW_SLOTS: u32 = 3;
const SLOW_WINDOW: usize = 4;
const SLOW_EPOCH: u64 = 2;

fn slow_cfg() -> BatchLoaderOptions {
    BatchLoaderOptions::default().with_batch_size(SLOW_BATCH)
}

/// Runs in a child: worker `GPUFEED_IT_SLOW_WORKER` of 3 writes its share of epoch 2. Worker
/// 1's transform sleeps 3 ms per record (12 ms a batch), the others' do not sleep: worker 1 is
/// slower, never hung.
#[test]
fn slow_worker_entry() {
    let Ok(worker) = std::env::var("GPUFEED_IT_SLOW_WORKER") else {
        return;
    };
    let worker: usize = worker.parse().expect("number");
    let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
    // SAFETY: the test's record file is never changed.
    let records =
        unsafe { RecordFile::open_fixed(var("GPUFEED_IT_RECORDS"), SLOW_RECORD) }.expect("records");
    let transform: gpufeed_data::Transform = std::sync::Arc::new(move |_, r, out| {
        if worker == 1 {
            std::thread::sleep(Duration::from_millis(3));
        }
        out.extend_from_slice(r);
        Ok(())
    });
    let share = WorkerShare::new(SLOW_EPOCH, worker, 3)
        .with_transform(&transform)
        .with_timeout(Duration::from_secs(20));
    let n = produce_epoch(&ring, &records, &sampler(), &slow_cfg(), &share).expect("produce");
    println!("worker {worker}: {n} batches");
}

/// One of three worker processes is slower than the others (it sleeps 3 ms per record in its
/// transform; the others do not sleep), over an epoch of 200 batches through a ring of 3 slots
/// read with a window of 4. The fast workers are held back by the loader's position (they
/// wait before transforming a batch more than the window ahead of it), so they never fill
/// the ring with later batches: the epoch completes, every batch in order with its records'
/// bytes, and the loader never holds more than its window. (Before the back-pressure, the
/// fast workers ran window + slots batches ahead and the epoch failed with
/// `RingBatchMissing`, stalled.)
#[test]
fn a_slower_worker_holds_the_others_back_and_the_epoch_completes() {
    use xxhash_rust::xxh3::xxh3_64;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("records.bin");
    let data = random_bytes(SLOW_RECORDS * SLOW_RECORD, 53);
    std::fs::write(&path, &data).expect("write");
    let ring = BatchRing::create_unique(SLOW_SLOTS, 4096).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    let mut loader = RingLoader::new(&ring, None)
        .expect("ring loader")
        .with_window(SLOW_WINDOW);
    let mut children = Children(
        (0..3)
            .map(|w| {
                let vars = [
                    ("GPUFEED_IT_SLOW_WORKER", w.to_string()),
                    ("GPUFEED_IT_RING", name.clone()),
                    ("GPUFEED_IT_RECORDS", path.display().to_string()),
                ];
                gpufeed_testkit::child_command("workers::slow_worker_entry", "worker", &vars)
                    .stdout(Stdio::null())
                    .spawn()
                    .expect("spawn worker")
            })
            .collect(),
    );
    let want = epoch_batches(SLOW_RECORDS, &sampler(), &slow_cfg(), SLOW_EPOCH);
    assert_eq!(want.len(), 200);
    let t = std::time::Instant::now();
    let mut epoch = loader.epoch(SLOW_EPOCH, want.len(), Duration::from_secs(20));
    let mut most = 0;
    for (n, (_, indices)) in want.iter().enumerate() {
        let batch = epoch
            .next()
            .expect("a batch")
            .unwrap_or_else(|e| panic!("batch {n}: {e}"));
        most = most.max(epoch.held());
        assert!(
            epoch.held() <= SLOW_WINDOW,
            "after batch {n} the loader holds {} batches, past its window of {SLOW_WINDOW}",
            epoch.held()
        );
        assert!(epoch.held_bytes() <= SLOW_WINDOW * SLOW_BATCH * SLOW_RECORD);
        assert_eq!(batch.number, n, "batch order");
        assert_eq!(&batch.indices, indices);
        let BatchData::Host(bytes) = &batch.data else {
            panic!("a host batch without a GPU");
        };
        let expect: Vec<u8> = indices
            .iter()
            .flat_map(|&i| data[i * SLOW_RECORD..(i + 1) * SLOW_RECORD].iter().copied())
            .collect();
        assert_eq!(xxh3_64(bytes), xxh3_64(&expect), "batch {n} bytes differ");
    }
    assert!(epoch.next().is_none(), "200 batches, no more");
    drop(epoch);
    eprintln!(
        "200 batches in {:?}, at most {most} held ahead of their turn",
        t.elapsed()
    );
    assert!(
        most > 0,
        "the fast workers never ran ahead: the test tested nothing"
    );
    for (w, c) in children.0.iter_mut().enumerate() {
        assert!(c.wait().expect("wait").success(), "worker {w} failed");
    }
}

/// The GPU form of the ring test: worker processes feed a loader on the GPU.
#[test]
fn worker_processes_feed_device_batches() {
    let Some(gpu) = crate::gpu_or_skip("worker_processes_feed_device_batches") else {
        return;
    };
    check_ring_loader(Some(&gpu));
}
