//! `gpufeed-bench sweep-small` (hidden): the probe behind the small-load defaults (issue 22).
//! A reused `Loader` per setting (smallest piece, fill threads, how long the kept threads stay
//! awake) loads warm files of 1-256 MiB; beside them the wire at each size and what the fixed
//! steps of a 1 MiB load cost alone. One JSON object per line on stdout, so that a run on the
//! GPU machine can be read back and compared; docs/benchmarks.md keeps the findings.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use gpufeed::cuda::cudarc::driver::{DevicePtrMut, sys};
use gpufeed::os::cache;
use gpufeed::pinned::PinnedBuffer;
use gpufeed::{LoadOptions, Loader};

use crate::util::{Samples, SplitMix, ensure_random_file, gbps, timed};

const SIZES: [u64; 5] = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20];

/// Median seconds of `n` calls of `f` after two unmeasured ones.
fn median_of(n: usize, mut f: impl FnMut() -> Result<()>) -> Result<Samples> {
    f()?;
    f()?;
    let mut all = Vec::with_capacity(n);
    for _ in 0..n {
        let (s, r) = timed(&mut f);
        r?;
        all.push(s);
    }
    Ok(Samples::new(all))
}

fn line(v: serde_json::Value) {
    println!("{v}");
}

pub fn run(dir: &Path, reps: usize) -> Result<()> {
    let gpu = gpufeed::Gpu::open(0)?;
    std::fs::create_dir_all(dir)?;
    let mut files = Vec::new();
    for &size in &SIZES {
        let p = dir.join(format!("size-{size}.bin"));
        ensure_random_file(&p, size, 0x5123 ^ size)?;
        cache::warm(&p)?;
        files.push((size, p));
    }
    // The wire at each size: a pinned buffer, one stream, chunks of up to 16 MiB.
    let ctx = Arc::clone(gpu.context());
    let mut pinned = PinnedBuffer::new(&ctx, 256 << 20)?;
    SplitMix(0x317E).fill(&mut pinned);
    let mut dev = gpu.alloc_zeroed(256 << 20)?;
    let stream = ctx.new_stream()?;
    for &size in &SIZES {
        let s = median_of(reps, || {
            let (dptr, guard) = dev.device_ptr_mut(&stream);
            let mut off = 0usize;
            while (off as u64) < size {
                let n = (16usize << 20).min(size as usize - off);
                // SAFETY: both buffers hold 256 MiB and outlive the synchronize below.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        dptr + off as u64,
                        pinned.as_ptr().add(off).cast(),
                        n,
                        stream.cu_stream(),
                    )
                }
                .result()?;
                off += n;
            }
            stream.synchronize()?;
            drop(guard);
            Ok(())
        })?;
        line(serde_json::json!({"what": "wire", "bytes": size, "us": s.median * 1e6,
            "gbps": gbps(size, s.median)}));
    }
    drop((dev, pinned));

    // The fixed steps of a 1 MiB load, each alone.
    let one = &files[0].1;
    let steps: Vec<(&str, Box<dyn FnMut() -> Result<()>>)> = vec![
        (
            "statx",
            Box::new(|| {
                std::fs::metadata(one)?;
                Ok(())
            }),
        ),
        (
            "open+close",
            Box::new(|| {
                drop(std::fs::File::open(one)?);
                Ok(())
            }),
        ),
        (
            "residency_estimate 1 MiB",
            Box::new(|| {
                cache::residency_estimate(one, 0..1 << 20)?;
                Ok(())
            }),
        ),
        (
            "pool alloc+free 1 MiB",
            Box::new(|| {
                // SAFETY: dropped unread.
                drop(unsafe { gpu.alloc(1 << 20) }?);
                Ok(())
            }),
        ),
        (
            "pread 1 MiB, one thread",
            Box::new({
                let f = std::fs::File::open(one)?;
                let mut buf = vec![0u8; 1 << 20];
                move || {
                    use std::os::unix::fs::FileExt;
                    f.read_exact_at(&mut buf, 0)?;
                    Ok(())
                }
            }),
        ),
    ];
    for (what, mut f) in steps {
        let s = median_of(reps.max(101), &mut f)?;
        line(serde_json::json!({"what": "step", "step": what, "us": s.median * 1e6}));
    }

    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let mut settings = Vec::new();
    for min in [64usize << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20] {
        for spin_us in [0u64, 100] {
            settings.push((min, spin_us, cores.clamp(2, 16)));
        }
    }
    for min in [128usize << 10, 256 << 10] {
        settings.push((min, 100, (cores / 2).clamp(2, 16)));
    }
    for (min, spin_us, threads) in settings {
        let mut opts = LoadOptions::default();
        opts.transfer = opts
            .transfer
            .with_min_chunk_bytes(min)
            .with_idle_spin(Duration::from_micros(spin_us))
            .with_fill_threads(threads)
            .with_staging_buffers(2 * threads);
        let loader = Loader::new(&gpu, opts)?;
        for (size, path) in &files {
            let mut strategy = String::new();
            let s = median_of(reps, || {
                let (buf, report) = loader.load_file(path)?;
                strategy = report.strategy.to_string();
                drop(buf);
                Ok(())
            })?;
            line(serde_json::json!({"what": "load", "min_piece_kib": min >> 10,
                "idle_spin_us": spin_us, "threads": threads, "bytes": size,
                "us": s.median * 1e6, "us_min": s.min * 1e6, "gbps": gbps(*size, s.median),
                "strategy": strategy}));
        }
    }
    Ok(())
}
