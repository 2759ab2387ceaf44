//! `gpufeed-bench sweep-small` (hidden): the probe behind the small-load defaults (issue 22).
//! A scheduler and a reused `Loader` per setting (smallest piece, fewest bytes per lane, fill
//! threads) upload nothing (the pipeline alone), a pageable buffer (the host copy) and warm
//! files of 1-256 MiB into device memory that exists; then `load_file` with the defaults, and
//! loads from a `RegisteredFile` with several copy chunks and streams; beside
//! them the wire at each size and what the fixed steps of a 1 MiB load cost alone. One JSON object per line on stdout, so that a run on the
//! GPU machine can be read back and compared; docs/benchmarks.md keeps the findings.

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use gpufeed::cuda::{FillSource, HostSource, SourceError, TransferScheduler};
use gpufeed::os::cache;
use gpufeed::pinned::PinnedBuffer;
use gpufeed::{LoadOptions, Loader};

/// A fill source that writes nothing: the staged pipeline's own cost.
struct Nothing;

impl FillSource for Nothing {
    fn fill(&self, _offset: u64, _dst: &mut [u8]) -> std::result::Result<(), SourceError> {
        Ok(())
    }
}

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

/// A setting written `MIN_PIECE_KIB:LANE_KIB:FILL_THREADS`.
fn parse_setting(s: &str) -> Result<(usize, usize, usize)> {
    let parts: Vec<usize> = s
        .split(':')
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("setting {s:?}: {e}"))?;
    match parts[..] {
        [min, lane, threads] if threads > 0 => Ok((min << 10, lane << 10, threads)),
        _ => anyhow::bail!("setting {s:?}: write MIN_PIECE_KIB:LANE_KIB:FILL_THREADS"),
    }
}

pub fn run(dir: &Path, reps: usize, only: &[String], max_bytes: u64) -> Result<()> {
    let only = only
        .iter()
        .map(|s| parse_setting(s))
        .collect::<Result<Vec<_>>>()?;
    let gpu = gpufeed::Gpu::open(0)?;
    std::fs::create_dir_all(dir)?;
    let mut files = Vec::new();
    for &size in SIZES.iter().filter(|&&s| s <= max_bytes) {
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
    for &(size, _) in &files {
        let s = median_of(reps, || {
            crate::gpu::copy_pinned(&pinned, &mut dev, &stream, size as usize)
        })?;
        line(
            serde_json::json!({"what": "wire", "bytes": size, "us": s.median * 1e6,
            "gbps": gbps(size, s.median)}),
        );
    }
    drop((dev, pinned));

    // The fixed steps of a 1 MiB load, each alone.
    let one = &files[0].1;
    type Step<'a> = (&'static str, Box<dyn FnMut() -> Result<()> + 'a>);
    let steps: Vec<Step<'_>> = vec![
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
    // (smallest piece, fewest bytes per lane, fill threads): every lane at every size (lane
    // bytes 1) against one lane per 4, 8 and 16 MiB; and fewer threads.
    let mut settings = Vec::new();
    for lane_bytes in [1usize, 4 << 20, 8 << 20, 16 << 20] {
        settings.push((1usize << 20, lane_bytes, cores.clamp(2, 16)));
    }
    settings.push((256 << 10, 8 << 20, cores.clamp(2, 16)));
    settings.push((1 << 20, 8 << 20, (cores / 2).clamp(2, 16)));
    if !only.is_empty() {
        settings = only;
    }
    let mut dev = gpu.alloc_zeroed(256 << 20)?;
    let host = vec![7u8; 256 << 20];
    for (min, lane_bytes, threads) in settings {
        let mut opts = LoadOptions::default();
        opts.transfer = opts
            .transfer
            .with_min_chunk_bytes(min)
            .with_lane_bytes(lane_bytes)
            .with_fill_threads(threads)
            .with_staging_buffers(2 * threads);
        let loader = Loader::new(&gpu, opts.clone())?;
        let sched = TransferScheduler::new(&gpu, opts.transfer)?;
        sched.reserve_staging(None, None)?;
        for (size, path) in &files {
            let size = *size;
            let probe = |what: &str, f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
                let s = median_of(reps, f)?;
                line(serde_json::json!({"what": what, "min_piece_kib": min >> 10,
                    "lane_kib": lane_bytes >> 10, "threads": threads, "bytes": size,
                    "us": s.median * 1e6, "gbps": gbps(size, s.median)}));
                Ok(())
            };
            if size <= 64 << 20 {
                probe("upload nothing", &mut || {
                    sched.upload(
                        HostSource::Fill {
                            source: &Nothing,
                            len: size,
                        },
                        &mut dev,
                        0,
                    )?;
                    Ok(())
                })?;
                probe("upload pageable", &mut || {
                    sched.upload(HostSource::Pageable(&host[..size as usize]), &mut dev, 0)?;
                    Ok(())
                })?;
            }
            probe("load_into", &mut || {
                loader.load_into(path, 0..size, &mut dev, 0)?;
                Ok(())
            })?;
        }
    }
    drop(dev);
    // New device memory per load (the default options), as `load_file` gives.
    let loader = Loader::new(&gpu, LoadOptions::default())?;
    for (size, path) in &files {
        let s = median_of(reps, || {
            drop(loader.load_file(path)?);
            Ok(())
        })?;
        line(
            serde_json::json!({"what": "load_file", "bytes": size, "us": s.median * 1e6,
            "gbps": gbps(*size, s.median)}),
        );
    }
    // From a registered file: copy chunks and streams (the copies are all there is).
    let mut dev = gpu.alloc_zeroed(256 << 20)?;
    for (chunk_mib, streams) in [(4usize, 4usize), (16, 4), (16, 1), (64, 4), (64, 2)] {
        let mut opts = LoadOptions::default();
        opts.transfer = opts
            .transfer
            .with_chunk_bytes(chunk_mib << 20)
            .with_streams(streams);
        let loader = Loader::new(&gpu, opts)?;
        for (size, path) in &files {
            let file = loader.register_file(path)?;
            let s = median_of(reps, || {
                loader.load_registered_into(&file, 0..*size, &mut dev, 0)?;
                Ok(())
            })?;
            line(
                serde_json::json!({"what": "registered into", "chunk_mib": chunk_mib,
                "streams": streams, "bytes": size, "us": s.median * 1e6,
                "gbps": gbps(*size, s.median)}),
            );
        }
    }
    Ok(())
}
