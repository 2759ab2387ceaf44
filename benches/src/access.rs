//! Table 2: a data set on disk accessed three ways, cold and warm.
//!
//! Columns, per row:
//! - `first load`: what makes the data addressable by the program: reading the whole file into
//!   memory for `read()`, the `mmap` call alone for the mappings (the source's 5.2 ms is this);
//! - `full pass`: from nothing to every byte having been available once: the read for
//!   `read()` (same as first load), mmap plus touching every page for the mappings;
//! - `random`: 1000 reads of 4 KiB at random 4 KiB-aligned offsets (`pread` into a buffer, or a
//!   copy out of the mapping), including the `mmap` call for the mappings.
//!
//! Cold: the file's pages are dropped from the page cache before each measurement
//! (`fdatasync` + `POSIX_FADV_DONTNEED`, checked with `cachestat`); warm: the file is read
//! into the page cache first.

use std::fmt::Write as _;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Result, ensure};
use gpufeed_os::advise::MemAdvice;
use gpufeed_os::{FileMap, MapMode, cache};
use serde::Serialize;

use crate::limits::Limits;
use crate::report::share;
use crate::util::{Samples, SplitMix, show_size, timed};

pub const RANDOM_READS: usize = 1000;
pub const RANDOM_BYTES: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Temperature {
    Cold,
    Warm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Access {
    /// `std::fs::read` / `pread`.
    StandardFileIo,
    /// Read-only mapping advised `MADV_SEQUENTIAL`.
    MmapSequential,
    /// Read-only mapping advised `MADV_RANDOM`.
    MmapRandom,
}

impl Access {
    pub fn label(self) -> &'static str {
        match self {
            Access::StandardFileIo => "standard file IO (read / pread)",
            Access::MmapSequential => "mmap, MADV_SEQUENTIAL",
            Access::MmapRandom => "mmap, MADV_RANDOM",
        }
    }

    /// The source material's numbers: first load ms, random access ms.
    pub fn source(self) -> (f64, f64) {
        match self {
            Access::StandardFileIo => (2100.0, 12.5),
            Access::MmapSequential => (5.2, 5.3),
            Access::MmapRandom => (5.2, 8.1),
        }
    }

    fn advice(self) -> Option<MemAdvice> {
        match self {
            Access::StandardFileIo => None,
            Access::MmapSequential => Some(MemAdvice::Sequential),
            Access::MmapRandom => Some(MemAdvice::Random),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct AccessRow {
    pub access: Access,
    pub temperature: Temperature,
    pub first_load_ms: Samples,
    pub full_pass_ms: Samples,
    pub random_ms: Samples,
    /// Largest resident share seen right after a cold preparation (should be ~0).
    pub cold_residency_max: f64,
}

pub fn measure(
    dataset: &Path,
    reps: usize,
    mut progress: impl FnMut(&str),
) -> Result<Vec<AccessRow>> {
    let len = dataset.metadata()?.len();
    ensure!(len >= RANDOM_BYTES as u64, "data set smaller than one read");
    let mut rng = SplitMix(0xACCE55);
    let offsets: Vec<u64> = (0..RANDOM_READS)
        .map(|_| rng.below(len / RANDOM_BYTES as u64) * RANDOM_BYTES as u64)
        .collect();
    let mut rows = Vec::new();
    for temperature in [Temperature::Cold, Temperature::Warm] {
        for access in [
            Access::StandardFileIo,
            Access::MmapSequential,
            Access::MmapRandom,
        ] {
            progress(&format!("{temperature:?} {}", access.label()));
            let mut row = AccessRow {
                access,
                temperature,
                first_load_ms: Samples::new(vec![]),
                full_pass_ms: Samples::new(vec![]),
                random_ms: Samples::new(vec![]),
                cold_residency_max: 0.0,
            };
            let (mut load, mut pass, mut random) = (vec![], vec![], vec![]);
            for _ in 0..reps {
                row.cold_residency_max = row.cold_residency_max.max(prepare(dataset, temperature)?);
                let (l, p) = load_and_pass(dataset, access)?;
                load.push(l * 1e3);
                pass.push(p * 1e3);
                row.cold_residency_max = row.cold_residency_max.max(prepare(dataset, temperature)?);
                random.push(random_reads(dataset, access, &offsets)? * 1e3);
            }
            row.first_load_ms = Samples::new(load);
            row.full_pass_ms = Samples::new(pass);
            row.random_ms = Samples::new(random);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Evicts (cold) or warms the file; returns the resident share after a cold preparation.
fn prepare(dataset: &Path, temperature: Temperature) -> Result<f64> {
    Ok(match temperature {
        Temperature::Cold => cache::evict(dataset)?.fraction(),
        Temperature::Warm => {
            let r = cache::warm(dataset)?;
            ensure!(
                r.fraction() > 0.99,
                "could not warm the data set: {:.0}% resident",
                r.fraction() * 100.0
            );
            0.0
        }
    })
}

/// Seconds for (first load, full pass).
fn load_and_pass(dataset: &Path, access: Access) -> Result<(f64, f64)> {
    let Some(advice) = access.advice() else {
        let (secs, data) = timed(|| std::fs::read(dataset));
        std::hint::black_box(data?);
        return Ok((secs, secs));
    };
    let start = std::time::Instant::now();
    // SAFETY: the bench's data set is written once before the measurements and never changed.
    let map = unsafe { FileMap::open(dataset, MapMode::ReadOnly)? };
    map.advise(advice)?;
    let mapped = start.elapsed().as_secs_f64();
    let page = gpufeed_os::page_size();
    let mut sum = 0u8;
    for i in (0..map.len()).step_by(page) {
        sum ^= map[i];
    }
    std::hint::black_box(sum);
    Ok((mapped, start.elapsed().as_secs_f64()))
}

/// Seconds for the random reads, each copying 4 KiB into a buffer.
fn random_reads(dataset: &Path, access: Access, offsets: &[u64]) -> Result<f64> {
    let mut buf = vec![0u8; RANDOM_BYTES];
    let Some(advice) = access.advice() else {
        let file = File::open(dataset)?;
        let (secs, res) = timed(|| -> std::io::Result<()> {
            for &off in offsets {
                file.read_exact_at(&mut buf, off)?;
                std::hint::black_box(&buf);
            }
            Ok(())
        });
        res?;
        return Ok(secs);
    };
    let (secs, res) = timed(|| -> Result<()> {
        // SAFETY: as in load_and_pass.
        let map = unsafe { FileMap::open(dataset, MapMode::ReadOnly)? };
        map.advise(advice)?;
        for &off in offsets {
            let off = off as usize;
            buf.copy_from_slice(&map[off..off + RANDOM_BYTES]);
            std::hint::black_box(&buf);
        }
        Ok(())
    });
    res?;
    Ok(secs)
}

/// Table 2: the data set loaded and read at random.
pub fn table(s: &mut String, dataset_bytes: u64, limits: Option<&Limits>, access: &[AccessRow]) {
    let _ = writeln!(
        s,
        "\n## Table 2 — a {} data set: load and {} random {} KiB reads\n",
        show_size(dataset_bytes),
        RANDOM_READS,
        RANDOM_BYTES / 1024
    );
    let _ = writeln!(
        s,
        "| access | cache | first load ms | full pass ms (GB/s) | full pass, share of a limit | {RANDOM_READS} random reads ms | source: first load / random ms (1 GB) |\n|---|---|---|---|---|---|---|"
    );
    for r in access {
        let (src_load, src_rand) = r.access.source();
        let pass_gbps = dataset_bytes as f64 / (r.full_pass_ms.median / 1e3) / 1e9;
        // Cold passes are bound by the disk, a warm read() by the warm read() loop; a warm
        // mapping's pass copies nothing (it touches each page), so no limit bounds it.
        let of = match (limits, r.temperature, r.access.label().starts_with("mmap")) {
            (Some(l), Temperature::Cold, _) => share(
                pass_gbps,
                l.disk_limit().map_or(f64::NAN, |d| d.gbps.median),
                "the disk",
            ),
            (Some(l), Temperature::Warm, false) => {
                share(pass_gbps, l.read_warm_gbps.median, "warm read()")
            }
            _ => "-".to_owned(),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} ({:.2}) | {of} | {} | {} / {} |",
            r.access.label(),
            match r.temperature {
                Temperature::Cold => "cold",
                Temperature::Warm => "warm",
            },
            r.first_load_ms.show(3),
            r.full_pass_ms.show(1),
            pass_gbps,
            r.random_ms.show(2),
            src_load,
            src_rand
        );
    }
    let cold_max = access
        .iter()
        .map(|r| r.cold_residency_max)
        .fold(0.0, f64::max);
    let _ = writeln!(
        s,
        "\nWhat the columns measure: *first load* = what makes the data addressable (the whole \
         read() for file IO; only the mmap() call for the mappings — the source's 5.2 ms is \
         this, not a read); *full pass* = until every byte was available once (read(), or \
         mmap + touching every page); *random* = {RANDOM_READS} reads of {} KiB at random \
         aligned offsets, copied into a buffer (mmap call included); *share of a limit*: cold \
         passes of the disk's limit, the warm read() of the warm read() limit, warm mappings \
         none (touching each page copies nothing, so no limit of this machine bounds them). \
         *source* = the source material's figures for a 1 GB file. Cold = the file's pages \
         dropped with fdatasync + POSIX_FADV_DONTNEED before each measurement (at most \
         {:.2}% stayed resident); warm = read into the page cache first.",
        RANDOM_BYTES / 1024,
        cold_max * 100.0
    );
}
