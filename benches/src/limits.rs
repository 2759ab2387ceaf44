//! The limits of this machine, measured in the same run as everything else.

use std::fmt::Write as _;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use anyhow::{Context, Result};
use gpufeed_os::{AlignedBuf, cache};
use serde::Serialize;

use crate::util::{Samples, gbps, timed};

#[derive(Debug, Serialize)]
pub struct Limits {
    pub memcpy_1_thread_gbps: Samples,
    pub memcpy_threads: usize,
    pub memcpy_n_threads_gbps: Samples,
    /// One `read()` loop into a 1 MiB buffer, the file in the page cache: the "warm read()"
    /// of every table (table 3 compares gpufeed-uring with this same measurement).
    pub read_warm_gbps: Samples,
    /// The ways the disk was read sequentially, each measured `reps` times.
    pub disk: Vec<DiskWay>,
    /// Why a way did not run (no O_DIRECT on this file system, no fio).
    pub disk_notes: Vec<String>,
}

/// One way of reading the data set from the disk.
#[derive(Debug, Serialize)]
pub struct DiskWay {
    pub how: String,
    pub gbps: Samples,
}

/// A limit's samples may spread this much, (max - min) / median, before the report says the
/// limit moved during the run.
pub const MAX_SPREAD: f64 = 0.25;

impl Limits {
    /// What bounds a copy out of memory: the better of memcpy on one thread and on all.
    pub fn memory_gbps(&self) -> f64 {
        self.memcpy_1_thread_gbps
            .median
            .max(self.memcpy_n_threads_gbps.median)
    }

    /// The disk's limit for reads that bypass the page cache: the best median of the
    /// `O_DIRECT` ways (fio's included).
    pub fn direct_limit(&self) -> Option<&DiskWay> {
        self.disk
            .iter()
            .filter(|w| w.gbps.median.is_finite())
            .filter(|w| w.how.contains("O_DIRECT") || w.how.contains("fio"))
            .max_by(|a, b| a.gbps.median.total_cmp(&b.gbps.median))
    }

    /// The disk's sequential read limit: the best median of the ways measured.
    pub fn disk_limit(&self) -> Option<&DiskWay> {
        self.disk
            .iter()
            .filter(|w| w.gbps.median.is_finite())
            .max_by(|a, b| a.gbps.median.total_cmp(&b.gbps.median))
    }
}

/// How far `s` spread, when more than [`MAX_SPREAD`] of its median.
pub fn moved(s: &Samples) -> Option<f64> {
    let spread = (s.max - s.min) / s.median;
    (spread.is_finite() && spread > MAX_SPREAD).then_some(spread)
}

/// The disk's `O_DIRECT` ways: sequential `pread`s of (bytes, on threads).
pub const DIRECT_WAYS: [(usize, usize); 3] = [(READ_CHUNK, 1), (1 << 20, 4), (1 << 20, 16)];

const COPY_BYTES: usize = 256 << 20;
const READ_CHUNK: usize = 8 << 20;
/// The warm read()'s buffer: 1 MiB, as table 3's requests.
const WARM_CHUNK: usize = 1 << 20;

pub fn measure(dataset: &Path, reps: usize) -> Result<Limits> {
    let src = AlignedBuf::new(COPY_BYTES, 4096)?;
    let mut dst = AlignedBuf::new(COPY_BYTES, 4096)?;
    dst.copy_from_slice(&src); // fault both in before timing
    let one = (0..reps)
        .map(|_| gbps(COPY_BYTES as u64, timed(|| dst.copy_from_slice(&src)).0))
        .collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let many = (0..reps)
        .map(|_| copy_on_threads(&src, &mut dst, threads))
        .collect();

    let len = dataset.metadata()?.len();
    let read_all = |temp_cold: bool, chunk: usize| -> Result<f64> {
        let mut buf = vec![0u8; chunk];
        if temp_cold {
            cache::evict(dataset)?;
        } else {
            cache::warm(dataset)?;
        }
        let mut file = File::open(dataset)?;
        let (secs, res) = timed(|| -> std::io::Result<()> {
            while file.read(&mut buf)? > 0 {}
            Ok(())
        });
        res?;
        Ok(gbps(len, secs))
    };
    let warm = (0..reps)
        .map(|_| read_all(false, WARM_CHUNK))
        .collect::<Result<_>>()?;
    // The disk: the best of several ways, each repeated, in turns so that a slow spell of a
    // shared disk does not fall on one way only.
    let mut ways: Vec<(String, Vec<f64>)> = Vec::new();
    let mut notes = Vec::new();
    let direct_ok = match direct_setup(dataset) {
        Ok(()) => true,
        Err(e) => {
            notes.push(format!("O_DIRECT unavailable: {e:#}"));
            false
        }
    };
    let fio_ok = crate::reads::fio_available();
    if !fio_ok {
        notes.push("fio not installed (`apt-get install fio` adds it as a way)".into());
    }
    for _ in 0..reps {
        let mut add = |how: &str, v: f64| match ways.iter_mut().find(|w| w.0 == how) {
            Some(w) => w.1.push(v),
            None => ways.push((how.to_owned(), vec![v])),
        };
        add(
            "read(), 8 MiB buffer, page cache evicted",
            read_all(true, READ_CHUNK)?,
        );
        if direct_ok {
            for (chunk, t) in DIRECT_WAYS {
                let (mib, s) = (chunk >> 20, if t == 1 { "" } else { "s" });
                let how = format!("O_DIRECT pread, {mib} MiB, {t} thread{s}");
                add(&how, direct_read(dataset, len, chunk, t)?);
            }
        }
        if fio_ok {
            cache::evict(dataset)?;
            add(
                "fio, io_uring O_DIRECT, 1 MiB, queue depth 32",
                crate::reads::fio(dataset, 32, len)?,
            );
        }
    }
    Ok(Limits {
        memcpy_1_thread_gbps: Samples::new(one),
        memcpy_threads: threads,
        memcpy_n_threads_gbps: Samples::new(many),
        read_warm_gbps: Samples::new(warm),
        disk: ways
            .into_iter()
            .map(|(how, v)| DiskWay {
                how,
                gbps: Samples::new(v),
            })
            .collect(),
        disk_notes: notes,
    })
}

/// memcpy of `src` into `dst` on `threads` threads, each copying its share `PASSES` times
/// after they all started (a barrier): the threads' start-up is outside the time, which
/// otherwise makes a 5 ms copy look a fifth slower than the memory bus is.
fn copy_on_threads(src: &[u8], dst: &mut [u8], threads: usize) -> f64 {
    const PASSES: usize = 8;
    let chunk = src.len().div_ceil(threads);
    // One thread per piece: rounding can leave fewer pieces than threads.
    let barrier = std::sync::Barrier::new(src.len().div_ceil(chunk) + 1);
    let start = std::thread::scope(|s| {
        for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
            let barrier = &barrier;
            s.spawn(move || {
                barrier.wait();
                for _ in 0..PASSES {
                    d.copy_from_slice(c);
                    std::hint::black_box(&mut *d);
                }
            });
        }
        barrier.wait();
        std::time::Instant::now()
    });
    gbps((PASSES * src.len()) as u64, start.elapsed().as_secs_f64())
}

fn direct_setup(dataset: &Path) -> Result<()> {
    let file = open_direct(dataset)?;
    let dio = gpufeed_os::align::dio_alignment(&file)?;
    anyhow::ensure!(
        dio.supported(),
        "the file system reports no O_DIRECT support"
    );
    Ok(())
}

fn open_direct(dataset: &Path) -> Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dataset)
        .context("open with O_DIRECT")
}

/// Reads the data set with O_DIRECT in `chunk`-byte reads on `threads` threads (thread `t`
/// reads chunks t, t + threads, ...); returns GB/s.
pub fn direct_read(dataset: &Path, len: u64, chunk: usize, threads: usize) -> Result<f64> {
    let file = open_direct(dataset)?;
    let dio = gpufeed_os::align::dio_alignment(&file)?;
    let aligned_len = len / dio.offset_align as u64 * dio.offset_align as u64;
    let chunks = aligned_len.div_ceil(chunk as u64);
    let mut bufs = (0..threads)
        .map(|_| AlignedBuf::new(chunk, dio.mem_align.max(4096) as usize))
        .collect::<Result<Vec<_>, _>>()?;
    let (secs, res) = timed(|| {
        std::thread::scope(|s| {
            let running: Vec<_> = bufs
                .iter_mut()
                .enumerate()
                .map(|(t, buf)| {
                    let file = &file;
                    s.spawn(move || -> std::io::Result<()> {
                        let mut i = t as u64;
                        while i < chunks {
                            let off = i * chunk as u64;
                            let n = (aligned_len - off).min(chunk as u64) as usize;
                            file.read_exact_at(&mut buf[..n], off)?;
                            i += threads as u64;
                        }
                        Ok(())
                    })
                })
                .collect();
            running.into_iter().try_for_each(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("panicked")))
            })
        })
    });
    res.context("O_DIRECT read")?;
    Ok(gbps(aligned_len, secs))
}

/// The limits table: what this machine does at best, the figure every share divides by.
pub fn table(s: &mut String, l: &Limits) {
    let _ = writeln!(s, "## Limits of this machine (same run)\n");
    let _ = writeln!(
        s,
        "What this machine does at best, measured in this run with plain code that is not \
         gpufeed's: every *share of a limit* in the tables divides by one of these. Nothing \
         measured here can truly pass its limit, so a share above 100% is printed with \
         \"suspect\": the limit was measured low (a disk whose speed moved during the run, \
         a limit measured one way while the figure used another).\n"
    );
    let _ = writeln!(s, "| limit | how | GB/s |\n|---|---|---|");
    let _ = writeln!(
        s,
        "| memcpy | 1 thread, 256 MiB | {} |",
        l.memcpy_1_thread_gbps.show(1)
    );
    let _ = writeln!(
        s,
        "| memcpy | {} threads started together, 256 MiB split among them, copied 8 times | {} |",
        l.memcpy_threads,
        l.memcpy_n_threads_gbps.show(1)
    );
    let _ = writeln!(
        s,
        "| warm read() | one read() loop, 1 MiB buffer, the file in the page cache | {} |",
        l.read_warm_gbps.show(2)
    );
    for w in &l.disk {
        let _ = writeln!(s, "| the disk, one way | {} | {} |", w.how, w.gbps.show(2));
    }
    match l.disk_limit() {
        Some(best) => {
            let _ = writeln!(
                s,
                "| **the disk** | the best of the ways above: {} | **{}** |",
                best.how,
                best.gbps.show(2)
            );
        }
        None => {
            let _ = writeln!(s, "| the disk | not measured | - |");
        }
    }
    for note in &l.disk_notes {
        let _ = writeln!(s, "\nThe disk: {note}.");
    }
    let mut moved = Vec::new();
    let named = [
        ("memcpy, 1 thread", Some(&l.memcpy_1_thread_gbps)),
        ("memcpy, all threads", Some(&l.memcpy_n_threads_gbps)),
        ("warm read()", Some(&l.read_warm_gbps)),
        ("the disk", l.disk_limit().map(|d| &d.gbps)),
    ];
    for (name, samples) in named {
        if let Some(v) = samples.and_then(self::moved) {
            moved.push(format!("{name} ({:.0}%)", v * 100.0));
        }
    }
    if moved.is_empty() {
        let _ = writeln!(
            s,
            "\nEvery limit's repetitions stayed within {:.0}% of its median.",
            MAX_SPREAD * 100.0
        );
    } else {
        let _ = writeln!(
            s,
            "\n**Limits that moved during this run** (repetitions spread more than {:.0}% of \
             the median): {}. Shares of these are unreliable in this run; run again on a \
             quieter machine.",
            MAX_SPREAD * 100.0,
            moved.join(", ")
        );
    }
}
