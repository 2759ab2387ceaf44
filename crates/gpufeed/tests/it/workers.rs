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
