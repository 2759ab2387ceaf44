//! Table 7: the dataset BatchLoader on the host (no GPU): shuffled fixed-size records of the data
//! set gathered by worker threads into pooled (locked) batch buffers.

use std::path::Path;

use anyhow::Result;
use gpufeed::dataset::{BatchLoader, LoaderConfig, Order, RecordFile, Sampler};
use gpufeed_os::cache;
use serde::Serialize;

use crate::util::{Samples, gbps, timed};

pub const RECORD: usize = 64 << 10;
pub const BATCH: usize = 64;

#[derive(Debug, Serialize)]
pub struct LoaderBench {
    pub record_bytes: usize,
    pub batch_size: usize,
    pub workers: usize,
    pub host_gbps: Samples,
}

/// GB/s of `reps` epochs of one `BatchLoader` over `path` as records of `record` bytes
/// (shuffled by `seed`), onto `gpu` or into host batches. The loader is built once, so its
/// pinned pool and streams are allocated before the first epoch, not in every measurement.
pub fn epochs_gbps(
    path: &Path,
    record: usize,
    cfg: LoaderConfig,
    seed: u64,
    gpu: Option<&gpufeed::Gpu>,
    reps: usize,
) -> Result<Samples> {
    // SAFETY: the bench's data files are written once and never changed while mapped.
    let records = unsafe { RecordFile::open_fixed(path, record)? };
    let mut loader = BatchLoader::new(records, Sampler::new(Order::Shuffled { seed }), cfg, gpu)?;
    let mut runs = Vec::new();
    for epoch in 0..=reps as u64 {
        let (secs, bytes) = timed(|| -> Result<u64> {
            let mut bytes = 0;
            for b in loader.epoch(epoch)? {
                bytes += b?.bytes() as u64;
            }
            Ok(bytes)
        });
        let rate = gbps(bytes?, secs);
        if epoch > 0 {
            runs.push(rate); // epoch 0 warms the pool
        }
    }
    Ok(Samples::new(runs))
}

pub fn measure(dataset: &Path, reps: usize) -> Result<LoaderBench> {
    cache::warm(dataset)?;
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let cfg = LoaderConfig::default()
        .with_batch_size(BATCH)
        .with_drop_last(true)
        .with_prefetch(2 * workers)
        .with_workers(workers);
    Ok(LoaderBench {
        record_bytes: RECORD,
        batch_size: BATCH,
        workers,
        host_gbps: epochs_gbps(dataset, RECORD, cfg, 3, None, reps)?,
    })
}
