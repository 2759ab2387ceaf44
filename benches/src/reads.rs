//! Table 3: gpufeed-uring against the disk's and the machine's own limits and against fio.
//!
//! - Cold: O_DIRECT sequential reads (no page cache involved) of the data set in 1 MiB blocks at queue depth 1, 8, 32
//!   and 64, through io_uring, and `fio` (ioengine io_uring, direct=1) with the same settings.
//! - Warm: the data set in the page cache read by io_uring and by the thread pool (the report
//!   compares them with the limits' warm `read()` loop, one 1 MiB buffer).

use std::cell::RefCell;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use gpufeed_os::{AlignedBuf, cache};
use gpufeed_uring::{Backend, Direct, ReadOp, Reader};
use serde::Serialize;

use crate::limits::Limits;
use crate::report::share;
use crate::util::{Samples, gbps, show_size, timed};

pub const BLOCK: usize = 1 << 20;
pub const DEPTHS: [usize; 4] = [1, 8, 32, 64];

#[derive(Debug, Serialize)]
pub struct DirectRow {
    pub queue_depth: usize,
    pub uring_gbps: Samples,
    /// The thread-pool backend with as many threads as the queue depth.
    pub threads_gbps: Samples,
    /// `None` when fio is not installed (see `fio_note`).
    pub fio_gbps: Option<Samples>,
}

#[derive(Debug, Serialize)]
pub struct Reads {
    pub direct: Vec<DirectRow>,
    pub fio_note: String,
    pub warm_uring_gbps: Samples,
    pub warm_threads: usize,
    pub warm_queue_depth: usize,
    pub warm_threads_gbps: Samples,
}

/// `count` buffers of `size` bytes, touched once so that no measurement pays their page faults
/// (a real pipeline reuses its staging buffers the same way).
fn buffer_pool(count: usize, size: usize) -> Result<RefCell<Vec<AlignedBuf>>> {
    let mut pool = Vec::with_capacity(count);
    for _ in 0..count {
        let mut buf = AlignedBuf::new(size, 4096)?;
        buf.fill(1);
        pool.push(buf);
    }
    Ok(RefCell::new(pool))
}

/// An io_uring `O_DIRECT` reader, `qd` reads of up to `block` bytes in flight.
fn direct_uring(qd: usize, block: usize) -> Result<Reader> {
    Ok(Reader::builder()
        .backend(Backend::IoUring)
        .direct(Direct::On)
        .queue_depth(qd)
        .block_bytes(block)
        .build()?)
}

/// All of `path` read with `O_DIRECT` through io_uring in 1 MiB requests, `qd` in flight:
/// GB/s (a way of the disk's limit for the batch loader's cold rows, whose reads are queued).
pub fn uring_direct(path: &Path, qd: usize) -> Result<f64> {
    let pool = buffer_pool(qd, BLOCK)?;
    read_whole(&mut direct_uring(qd, BLOCK)?, path, &pool)
}

/// All of `path` read with `O_DIRECT` through io_uring in `block`-byte requests, `qd` in
/// flight, the blocks in a seeded random order: GB/s. What the disk gives the batch loader's
/// cold rows' order (`Order::Blocks`) with no loader around it.
pub fn uring_direct_shuffled(path: &Path, qd: usize, block: usize, seed: u64) -> Result<f64> {
    let len = path.metadata()?.len() / 4096 * 4096;
    let mut order: Vec<u64> = (0..len.div_ceil(block as u64)).collect();
    // Fisher-Yates with a xorshift64*: the order only has to be fixed and far from sequential.
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for i in (1..order.len()).rev() {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let j = (x.wrapping_mul(0x2545_F491_4F6C_DD1D) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let pool = buffer_pool(qd, block)?;
    read_blocks(
        &mut direct_uring(qd, block)?,
        path,
        len,
        &pool,
        block,
        order,
    )
}

/// Reads all of `path` with `reader` in 1 MiB requests, taking buffers from `pool` and
/// returning them as requests complete; returns GB/s.
fn read_whole(reader: &mut Reader, path: &Path, pool: &RefCell<Vec<AlignedBuf>>) -> Result<f64> {
    let len = path.metadata()?.len();
    read_blocks(
        reader,
        path,
        len,
        pool,
        BLOCK,
        0..len.div_ceil(BLOCK as u64),
    )
}

/// Reads the first `len` bytes of `path` with `reader` in `block`-byte requests, block by
/// block in `order`, taking buffers from `pool` (of `block` bytes) and returning them as
/// requests complete; returns GB/s of the bytes read.
fn read_blocks(
    reader: &mut Reader,
    path: &Path,
    len: u64,
    pool: &RefCell<Vec<AlignedBuf>>,
    block: usize,
    order: impl IntoIterator<Item = u64>,
) -> Result<f64> {
    let file = reader.open(path)?;
    let failure = RefCell::new(None);
    let ops = order.into_iter().map_while(|i| {
        let off = i * block as u64;
        let n = (len - off).min(block as u64) as usize;
        let buf = pool
            .borrow_mut()
            .pop()
            .map_or_else(|| AlignedBuf::new(block, 4096), Ok);
        buf.map(|b| ReadOp::new(file, off, b).len(n))
            .map_err(|e| failure.borrow_mut().get_or_insert(e.to_string()).clone())
            .ok()
    });
    let before = reader.stats().bytes;
    let (secs, res) = timed(|| {
        reader.read_all(ops, |c| {
            if let Err(e) = &c.result {
                failure.borrow_mut().get_or_insert_with(|| e.to_string());
            }
            pool.borrow_mut().push(c.buf);
        })
    });
    res?;
    if let Some(e) = failure.into_inner() {
        bail!("read failed: {e}");
    }
    let bytes = reader.stats().bytes - before;
    Ok(gbps(bytes, secs))
}

pub fn fio(path: &Path, depth: usize, size: u64) -> Result<f64> {
    let out = Command::new("fio")
        .args([
            "--name=gpufeed",
            "--rw=read",
            "--bs=1M",
            "--ioengine=io_uring",
            "--direct=1",
            "--numjobs=1",
            "--output-format=json",
        ])
        .arg(format!("--iodepth={depth}"))
        .arg(format!("--size={size}"))
        .arg(format!("--filename={}", path.display()))
        .output()
        .context("run fio")?;
    if !out.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).context("fio JSON")?;
    let bw = json["jobs"][0]["read"]["bw_bytes"]
        .as_f64()
        .context("fio JSON has no jobs[0].read.bw_bytes")?;
    Ok(bw / 1e9)
}

pub fn fio_available() -> bool {
    Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

pub fn measure(dataset: &Path, reps: usize, mut progress: impl FnMut(&str)) -> Result<Reads> {
    let size = dataset.metadata()?.len();
    let have_fio = fio_available();
    let fio_note = if have_fio {
        "fio --rw=read --bs=1M --ioengine=io_uring --direct=1, same file, same run".to_owned()
    } else {
        "fio not installed: skipped (install it with `apt-get install fio` to compare)".to_owned()
    };
    let pool = buffer_pool(*DEPTHS.iter().max().unwrap_or(&1), BLOCK)?;
    let mut direct = Vec::new();
    for qd in DEPTHS {
        progress(&format!("O_DIRECT, queue depth {qd}"));
        let mut uring = Vec::new();
        let mut threads = Vec::new();
        let mut fio_runs = Vec::new();
        for rep in 0..reps {
            // The virtual disk here serves bursts faster than sustained reads: alternate who
            // goes first so that neither side always gets the burst.
            if have_fio && rep % 2 == 1 {
                fio_runs.push(fio(dataset, qd, size)?);
            }
            let mut reader = Reader::builder()
                .backend(Backend::IoUring)
                .direct(Direct::On)
                .queue_depth(qd)
                .block_bytes(BLOCK)
                .build()?;
            uring.push(read_whole(&mut reader, dataset, &pool)?);
            let mut reader = Reader::builder()
                .backend(Backend::Threads(qd))
                .direct(Direct::On)
                .queue_depth(qd)
                .block_bytes(BLOCK)
                .build()?;
            threads.push(read_whole(&mut reader, dataset, &pool)?);
            if have_fio && rep % 2 == 0 {
                fio_runs.push(fio(dataset, qd, size)?);
            }
        }
        direct.push(DirectRow {
            queue_depth: qd,
            uring_gbps: Samples::new(uring),
            threads_gbps: Samples::new(threads),
            fio_gbps: have_fio.then(|| Samples::new(fio_runs)),
        });
    }

    progress("warm page cache: io_uring, threads");
    cache::warm(dataset)?;
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    // Two requests per core: enough to keep every core copying, few enough that the buffers
    // stay in the CPU caches (deeper queues only add cache misses out of the page cache).
    let warm_qd = 2 * threads;
    let (mut u, mut t) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let mut reader = Reader::builder()
            .backend(Backend::IoUring)
            .direct(Direct::Off)
            .queue_depth(warm_qd)
            .build()?;
        u.push(read_whole(&mut reader, dataset, &pool)?);
        let mut reader = Reader::builder()
            .backend(Backend::Threads(threads))
            .direct(Direct::Off)
            .queue_depth(warm_qd)
            .build()?;
        t.push(read_whole(&mut reader, dataset, &pool)?);
    }
    Ok(Reads {
        direct,
        fio_note,
        warm_uring_gbps: Samples::new(u),
        warm_threads: threads,
        warm_queue_depth: warm_qd,
        warm_threads_gbps: Samples::new(t),
    })
}

/// Table 3: gpufeed-uring's sequential reads, cold and warm.
pub fn table(s: &mut String, dataset_bytes: u64, limits: Option<&Limits>, r: &Reads) {
    let _ = writeln!(
        s,
        "\n## Table 3 — gpufeed-uring: {} read sequentially in 1 MiB requests\n",
        show_size(dataset_bytes)
    );
    let _ = writeln!(
        s,
        "| O_DIRECT, queue depth | gpufeed-uring io_uring GB/s | threads (one per request) GB/s | fio GB/s | io_uring / fio | io_uring, share of a limit |\n|---|---|---|---|---|---|"
    );
    let disk = limits
        .and_then(Limits::disk_limit)
        .map_or(f64::NAN, |d| d.gbps.median);
    let memory = limits.map_or(f64::NAN, Limits::memory_gbps);
    let warm_read = limits.map_or(f64::NAN, |l| l.read_warm_gbps.median);
    for row in &r.direct {
        let (fio, ratio) = match &row.fio_gbps {
            Some(f) => (
                f.show(2),
                format!("{:.2}x", row.uring_gbps.median / f.median),
            ),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} |",
            row.queue_depth,
            row.uring_gbps.show(2),
            row.threads_gbps.show(2),
            fio,
            ratio,
            share(row.uring_gbps.median, disk, "the disk")
        );
    }
    let _ = writeln!(s, "\nfio: {}.\n", r.fio_note);
    let _ = writeln!(
        s,
        "| page cache warm | GB/s | vs the warm read() limit | share of a limit |\n|---|---|---|---|"
    );
    let _ = writeln!(
        s,
        "| one read() loop, 1 MiB buffer (the limits' warm read(), same measurement) | {} | 1.00x | {} |",
        limits.map_or("-".into(), |l| l.read_warm_gbps.show(2)),
        share(warm_read, memory, "memcpy")
    );
    let _ = writeln!(
        s,
        "| gpufeed-uring io_uring (qd {}, IOSQE_ASYNC) | {} | {:.2}x | {} |",
        r.warm_queue_depth,
        r.warm_uring_gbps.show(2),
        r.warm_uring_gbps.median / warm_read,
        share(r.warm_uring_gbps.median, memory, "memcpy")
    );
    let _ = writeln!(
        s,
        "| gpufeed-uring threads({}), qd {} | {} | {:.2}x | {} |",
        r.warm_threads,
        r.warm_queue_depth,
        r.warm_threads_gbps.show(2),
        r.warm_threads_gbps.median / warm_read,
        share(r.warm_threads_gbps.median, memory, "memcpy")
    );
    let _ = writeln!(
        s,
        "\nA warm read copies out of the page cache, so memcpy (the better of 1 and all threads) \
         bounds it."
    );
}
