//! The limits of this machine, measured in the same run as everything else.

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
    pub read_warm_gbps: Samples,
    pub read_cold_gbps: Samples,
    /// `None` when the file system refuses O_DIRECT (the reason is in `direct_note`).
    pub read_direct_gbps: Option<Samples>,
    pub direct_note: String,
}

const COPY_BYTES: usize = 256 << 20;
const READ_CHUNK: usize = 8 << 20;

pub fn measure(dataset: &Path, reps: usize) -> Result<Limits> {
    let src = AlignedBuf::new(COPY_BYTES, 4096)?;
    let mut dst = AlignedBuf::new(COPY_BYTES, 4096)?;
    dst.copy_from_slice(&src); // fault both in before timing
    let one = (0..reps)
        .map(|_| gbps(COPY_BYTES as u64, timed(|| dst.copy_from_slice(&src)).0))
        .collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let many = (0..reps)
        .map(|_| {
            let chunk = COPY_BYTES.div_ceil(threads);
            let (secs, ()) = timed(|| {
                std::thread::scope(|s| {
                    for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                        s.spawn(move || d.copy_from_slice(c));
                    }
                })
            });
            gbps(COPY_BYTES as u64, secs)
        })
        .collect();

    let len = dataset.metadata()?.len();
    let mut buf = vec![0u8; READ_CHUNK];
    let mut read_all = |temp_cold: bool| -> Result<f64> {
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
    let warm = (0..reps).map(|_| read_all(false)).collect::<Result<_>>()?;
    let cold = (0..reps).map(|_| read_all(true)).collect::<Result<_>>()?;
    let (direct, direct_note) = match direct_read(dataset, len, reps) {
        Ok(s) => (Some(s), "O_DIRECT, 8 MiB reads, queue depth 1".to_owned()),
        Err(e) => (None, format!("O_DIRECT unavailable: {e:#}")),
    };
    Ok(Limits {
        memcpy_1_thread_gbps: Samples::new(one),
        memcpy_threads: threads,
        memcpy_n_threads_gbps: Samples::new(many),
        read_warm_gbps: Samples::new(warm),
        read_cold_gbps: Samples::new(cold),
        read_direct_gbps: direct,
        direct_note,
    })
}

fn direct_read(dataset: &Path, len: u64, reps: usize) -> Result<Samples> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dataset)
        .context("open with O_DIRECT")?;
    let dio = gpufeed_os::align::dio_alignment(&file)?;
    anyhow::ensure!(
        dio.supported(),
        "the file system reports no O_DIRECT support"
    );
    let mut buf = AlignedBuf::new(READ_CHUNK, dio.mem_align.max(4096) as usize)?;
    let aligned_len = len / dio.offset_align as u64 * dio.offset_align as u64;
    let mut samples = Vec::new();
    for _ in 0..reps {
        let (secs, res) = timed(|| -> std::io::Result<()> {
            let mut off = 0;
            while off < aligned_len {
                let n = (aligned_len - off).min(READ_CHUNK as u64) as usize;
                file.read_exact_at(&mut buf[..n], off)?;
                off += n as u64;
            }
            Ok(())
        });
        res.context("O_DIRECT read")?;
        samples.push(gbps(aligned_len, secs));
    }
    Ok(Samples::new(samples))
}
