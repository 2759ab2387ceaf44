//! Table 7: the dataset BatchLoader on the host (no GPU): shuffled fixed-size records of the data
//! set gathered by worker threads into pooled (locked) batch buffers.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;
use gpufeed::dataset::{BatchLoader, BatchLoaderOptions, Order, Position, RecordFile, Sampler};
use gpufeed_os::cache;
use serde::Serialize;

use crate::limits::Limits;
use crate::report::share;
use crate::util::{Samples, gbps, show_size, timed};

pub const RECORD: usize = 64 << 10;
pub const BATCH: usize = 64;

#[derive(Debug, Serialize)]
pub struct LoaderBench {
    pub record_bytes: usize,
    pub batch_size: usize,
    pub workers: usize,
    pub host_gbps: Samples,
    /// Cores busy during those epochs (CPU seconds over wall seconds).
    pub host_cores_busy: Samples,
    /// Records of the elastic resume measurement (the data set cut into about 10 million).
    pub resume_records: usize,
    /// Milliseconds from `BatchLoader::resume` (rank 3 of 8, mid-epoch) to its first batch.
    pub resume_ms: Samples,
    /// The data set evicted from the page cache before each epoch, read with `O_DIRECT`
    /// (`BatchLoaderOptions::direct`) in blocks of records (`Order::Blocks`), with several block
    /// sizes, numbers of workers and reads in flight.
    pub direct_cold: Vec<DirectCold>,
    /// All the cold rows' limits together ([`DirectCold::limit_gbps`]): GB/s.
    pub direct_limit_gbps: Samples,
    /// The disk's way of reading with the highest median over every cold row's epochs (of
    /// [`disk_way`]): the cold rows' limit ([`DirectCold::way_share`]).
    pub direct_best_way: String,
    /// That way's reads, all rows' together: GB/s.
    pub direct_best_way_gbps: Samples,
}

/// Seconds of CPU this process has used so far (user and system, all threads).
pub fn cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given (zeroed, so initialised either way).
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// Epochs of a loader: GB/s, and the cores busy meanwhile (CPU seconds over wall seconds).
#[derive(Debug, Serialize)]
pub struct Epochs {
    pub gbps: Samples,
    pub cores_busy: Samples,
}

/// `reps` epochs of one `BatchLoader` over `path` as records of `record` bytes (shuffled by
/// `seed`), onto `gpu` or into host batches. The loader is built once, so its pinned pool and
/// streams are allocated before the first epoch, not in every measurement.
pub fn epochs(
    path: &Path,
    record: usize,
    cfg: BatchLoaderOptions,
    seed: u64,
    gpu: Option<&gpufeed::Gpu>,
    reps: usize,
) -> Result<Epochs> {
    // SAFETY: the bench's data files are written once and never changed while mapped.
    let records = unsafe { RecordFile::open_fixed(path, record)? };
    let mut loader = BatchLoader::new(records, Sampler::new(Order::Shuffled { seed }), cfg, gpu)?;
    let (mut runs, mut cores) = (Vec::new(), Vec::new());
    for epoch in 0..=reps as u64 {
        let cpu = cpu_seconds();
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
            cores.push((cpu_seconds() - cpu) / secs);
        }
    }
    Ok(Epochs {
        gbps: Samples::new(runs),
        cores_busy: Samples::new(cores),
    })
}

pub fn measure(dataset: &Path, reps: usize) -> Result<LoaderBench> {
    cache::warm(dataset)?;
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let cfg = BatchLoaderOptions::default()
        .with_batch_size(BATCH)
        .with_drop_last(true)
        .with_prefetch(2 * workers)
        .with_workers(workers);
    let (resume_records, resume_ms) = resume_ms(dataset, reps)?;
    let host = epochs(dataset, RECORD, cfg.clone(), 3, None, reps)?;
    let cold = direct_cold(dataset, &cfg, reps)?;
    Ok(LoaderBench {
        record_bytes: RECORD,
        batch_size: BATCH,
        workers,
        host_gbps: host.gbps,
        host_cores_busy: host.cores_busy,
        resume_records,
        resume_ms,
        direct_cold: cold.rows,
        direct_limit_gbps: cold.limit_gbps,
        direct_best_way: cold.best_way,
        direct_best_way_gbps: cold.best_way_gbps,
    })
}

/// One setting of the cold `O_DIRECT` rows.
#[derive(Debug, Serialize)]
pub struct DirectCold {
    /// Records per block (`Order::Blocks`).
    pub block: usize,
    /// Records per batch.
    pub batch: usize,
    pub workers: usize,
    /// `BatchLoaderOptions::direct_depth`: reads in flight per worker.
    pub depth: usize,
    pub gbps: Samples,
    /// The fastest of the disk's own `O_DIRECT` reads of the file next to each of this row's
    /// epochs (the limits table's ways, `limits::DIRECT_WAYS`, and io_uring at queue depth
    /// [`DISK_QUEUE`]), GB/s: the limit of [`DirectCold::share`].
    pub limit_gbps: Samples,
    /// The disk's own `O_DIRECT` reads of the file's blocks in a random order, through
    /// io_uring at queue depth [`DISK_QUEUE`], next to each epoch: what this order costs the
    /// disk with no loader around it, GB/s.
    pub shuffled_gbps: Samples,
    /// Each epoch's GB/s over its own limit's (the pairs taken together cancel the disk's
    /// drift over the run, which moves it by a third and more on the GPU machine). The
    /// fastest of several noisy reads is biased high (the maximum of samples that move by a
    /// third): [`DirectCold::way_share`] is the unbiased comparison.
    pub share: Samples,
    /// Each epoch's GB/s over the read next to it of the run's best way
    /// ([`LoaderBench::direct_best_way`]): one sample against one sample.
    pub way_share: Samples,
    /// Mean bytes per `O_DIRECT` read.
    pub read_bytes: f64,
}

/// The (records per block, records per batch, workers, reads in flight per worker) of the
/// cold rows: 1 MiB and 4 MiB blocks in batches of [`BATCH`] (4 MiB), 8 MiB blocks in batches
/// of 256 (16 MiB), and 32 MiB blocks each a batch of its own — the H200 machine's disk reads
/// random 1 MiB requests at 0.6-0.85 of sequential ones and comes closer with every doubling
/// of the block (bench runs 60-64, 69).
const DIRECT_ROWS: [(usize, usize, usize, usize); 6] = [
    (16, BATCH, 4, 4),
    (64, BATCH, 4, 4),
    (128, 256, 4, 1),
    (128, 256, 8, 1),
    (512, 512, 4, 1),
    (512, 512, 4, 2),
];

/// The queue depth of the io_uring way of a cold row's limit: as many 1 MiB reads in flight
/// as the rows' 4 workers with 4 each.
pub const DISK_QUEUE: usize = 16;

/// The disk's ways of reading the file next to each cold epoch: 1 MiB reads through io_uring
/// at queue depth [`DISK_QUEUE`], then `limits::DIRECT_WAYS`; way `w`'s name.
fn disk_way(w: usize) -> String {
    match w.checked_sub(1).map(|i| crate::limits::DIRECT_WAYS[i]) {
        None => format!("1 MiB reads through io_uring at queue depth {DISK_QUEUE}"),
        Some((chunk, 1)) => format!("sequential `pread`s of {} MiB on 1 thread", chunk >> 20),
        Some((chunk, t)) => format!("sequential `pread`s of {} MiB on {t} threads", chunk >> 20),
    }
}

/// Epochs of the data set read cold with `O_DIRECT` in blocks of records (evicted before
/// each) as [`DIRECT_ROWS`] say, each next to the disk's own `O_DIRECT` reads of the file in
/// every way of [`disk_way`], before it and after it in turns (a disk that serves bursts or
/// has slow spells favours neither); each epoch is judged against the read next to it of the
/// way with the best median over the run, and (second) against the fastest way next to it.
fn direct_cold(dataset: &Path, cfg: &BatchLoaderOptions, reps: usize) -> Result<DirectColdRows> {
    type Row = (
        (usize, usize, usize, usize),
        BatchLoader,
        Vec<f64>,
        Vec<Vec<f64>>,
        Vec<f64>,
    );
    let mut loaders = DIRECT_ROWS
        .into_iter()
        .map(|(block, batch, workers, depth)| -> Result<Row> {
            let order = Order::Blocks { seed: 5, block };
            // SAFETY: the bench's data files are written once and never changed while mapped.
            let records = unsafe { RecordFile::open_fixed(dataset, RECORD)? };
            let cfg = cfg
                .clone()
                .with_direct(true)
                .with_direct_depth(depth)
                .with_batch_size(batch)
                .with_workers(workers)
                .with_prefetch(2 * workers);
            Ok((
                (block, batch, workers, depth),
                BatchLoader::new(records, Sampler::new(order), cfg, None)?,
                Vec::new(),
                Vec::new(),
                Vec::new(),
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let len = dataset.metadata()?.len();
    // Every way's GB/s, in `disk_way` order.
    let disk = || -> Result<Vec<f64>> {
        let mut ways = vec![crate::reads::uring_direct(dataset, DISK_QUEUE)?];
        for &(chunk, threads) in &crate::limits::DIRECT_WAYS {
            ways.push(crate::limits::direct_read(dataset, len, chunk, threads)?);
        }
        Ok(ways)
    };
    for epoch in 0..reps as u64 {
        for (row, ((block, ..), loader, runs, limit, shuffled)) in loaders.iter_mut().enumerate() {
            let first = (epoch as usize + row).is_multiple_of(2);
            if first {
                limit.push(disk()?);
            }
            let bytes = *block * RECORD;
            shuffled.push(crate::reads::uring_direct_shuffled(
                dataset, DISK_QUEUE, bytes, epoch,
            )?);
            cache::evict(dataset)?;
            let (secs, bytes) = timed(|| -> Result<u64> {
                let mut bytes = 0;
                for b in loader.epoch(epoch)? {
                    bytes += b?.bytes() as u64;
                }
                Ok(bytes)
            });
            runs.push(gbps(bytes?, secs));
            if !first {
                limit.push(disk()?);
            }
        }
    }
    // The way with the highest median over the whole run.
    let way = |w: usize| -> Vec<f64> {
        let all = loaders.iter().flat_map(|l| l.3.iter());
        all.map(|ways| ways[w]).collect()
    };
    let best = (0..=crate::limits::DIRECT_WAYS.len())
        .max_by(|&a, &b| {
            Samples::new(way(a))
                .median
                .total_cmp(&Samples::new(way(b)).median)
        })
        .unwrap_or(0);
    let best_way_gbps = Samples::new(way(best));
    let fastest = |ways: &Vec<f64>| ways.iter().copied().fold(0.0, f64::max);
    let all = loaders
        .iter()
        .flat_map(|l| l.3.iter().map(fastest))
        .collect();
    // Before `Samples` sorts them: each epoch with its own limit.
    let shares = |runs: &[f64], limit: &[f64]| runs.iter().zip(limit).map(|(r, l)| r / l).collect();
    let rows = loaders
        .into_iter()
        .map(
            |((block, batch, workers, depth), loader, runs, ways, shuffled)| {
                let st = loader.stats();
                let limit: Vec<f64> = ways.iter().map(fastest).collect();
                let theirs: Vec<f64> = ways.iter().map(|w| w[best]).collect();
                DirectCold {
                    block,
                    batch,
                    workers,
                    depth,
                    share: Samples::new(shares(&runs, &limit)),
                    way_share: Samples::new(shares(&runs, &theirs)),
                    gbps: Samples::new(runs),
                    limit_gbps: Samples::new(limit),
                    shuffled_gbps: Samples::new(shuffled),
                    read_bytes: st.direct_read_bytes as f64 / st.direct_reads.max(1) as f64,
                }
            },
        )
        .collect();
    Ok(DirectColdRows {
        rows,
        limit_gbps: Samples::new(all),
        best_way: disk_way(best),
        best_way_gbps,
    })
}

/// [`direct_cold`]'s rows and their limits.
struct DirectColdRows {
    rows: Vec<DirectCold>,
    limit_gbps: Samples,
    best_way: String,
    best_way_gbps: Samples,
}

/// An elastic loader over 10 million records or more (the data set cut into records of the
/// largest power of two that divides its length and leaves that many) resumed mid-epoch as
/// rank 3 of 8: milliseconds until its first batch.
fn resume_ms(dataset: &Path, reps: usize) -> Result<(usize, Samples)> {
    let len = dataset.metadata()?.len() as usize;
    let mut record = 1;
    while len.is_multiple_of(record * 2) && len / (record * 2) >= 10_000_000 {
        record *= 2;
    }
    let global = 8 * BATCH;
    let mut runs = Vec::new();
    let mut records = 0;
    for rep in 0..reps as u64 {
        // SAFETY: the bench's data files are written once and never changed while mapped.
        let file = unsafe { RecordFile::open_fixed(dataset, record)? };
        records = file.len();
        let order = Order::Shuffled { seed: rep };
        let sampler = Sampler::elastic(order, global, 3, 8, true)?;
        let mut loader = BatchLoader::new(file, sampler, BatchLoaderOptions::default(), None)?;
        let at = Position {
            epoch: rep,
            samples: (records / global / 2 * global) as u64,
            records: records as u64,
            order,
            global_batch: global,
        };
        let (secs, first) = timed(|| -> Result<usize> {
            let mut epoch = loader.resume(&at)?;
            Ok(epoch.next().transpose()?.map_or(0, |b| b.indices.len()))
        });
        anyhow::ensure!(first? == BATCH, "the resumed epoch's first batch");
        runs.push(secs * 1e3);
    }
    Ok((records, Samples::new(runs)))
}

/// Table 7: the dataset BatchLoader on the host.
pub fn table(s: &mut String, b: &LoaderBench, limits: Option<&Limits>) {
    let memory = limits.map_or(f64::NAN, Limits::memory_gbps);
    let _ = writeln!(
        s,
        "\n## Table 7 — dataset BatchLoader, host batches (no GPU)\n\n| records | batch | workers | GB/s | share of a limit | cores busy |\n|---|---|---|---|---|---|\n| {} shuffled | {} records | {} | {} | {} | {:.1} |",
        show_size(b.record_bytes as u64),
        b.batch_size,
        b.workers,
        b.host_gbps.show(2),
        share(b.host_gbps.median, memory, "memcpy"),
        b.host_cores_busy.median
    );
    for d in &b.direct_cold {
        let _ = writeln!(
            s,
            "| {} in blocks of {} (`Order::Blocks`), cold, read with `O_DIRECT` (`BatchLoaderOptions::direct`; {} per read, {} in flight per worker) | {} records | {} | {} | {} (per epoch {}-{}%); {} ({} GB/s); the disk reading such blocks in a random order: {} GB/s | |",
            show_size(b.record_bytes as u64),
            d.block,
            show_size(d.read_bytes as u64),
            d.depth,
            d.batch,
            d.workers,
            d.gbps.show(2),
            share(
                d.way_share.median,
                1.0,
                "the disk's best way next to each epoch"
            ),
            (100.0 * d.way_share.min).round(),
            (100.0 * d.way_share.max).round(),
            share(
                d.share.median,
                1.0,
                "the fastest of the disk's ways at each epoch"
            ),
            d.limit_gbps.show(2),
            d.shuffled_gbps.show(2),
        );
    }
    let _ = writeln!(
        s,
        "\nThe cold rows' limit: next to each epoch (before it and after it in turns), the disk's own `O_DIRECT` reads of the same file \
             (sequential `pread`s of 8 MiB on 1 thread, of 1 MiB on 4 and on 16 threads, and 1 MiB reads through io_uring at queue depth {}). \
             A row's share is the median of its epochs' shares of the read next to them of the way with the highest median over the run, {} ({} GB/s); \
             the fastest of the four at each epoch ({} GB/s, all rows') is biased high, the most of four samples of a disk that moves by a third, and is shown second. \
             The best `O_DIRECT` way of the limits table: {}.",
        DISK_QUEUE,
        b.direct_best_way,
        b.direct_best_way_gbps.show(2),
        b.direct_limit_gbps.show(2),
        limits
            .and_then(Limits::direct_limit)
            .map_or("-".to_owned(), |d| format!(
                "{} GB/s ({})",
                d.gbps.show(2),
                d.how
            )),
    );
    let _ = writeln!(
        s,
        "\nAn elastic loader (`Sampler::elastic`, global batch {}) over {} records resumed \
             mid-epoch as rank 3 of 8 (`BatchLoader::resume`): {} ms to its first batch.",
        8 * BATCH,
        b.resume_records,
        b.resume_ms.show(0)
    );
}
