//! Table 6 (GPU machine only): the facade on a 4 GiB file and a 4 GiB safetensors checkpoint,
//! warm and cold, against the raw O_DIRECT read of the same disk in the same run.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use gpufeed::{Gpu, LoadOptions, Loader, Strategy};
use gpufeed_os::{AlignedBuf, cache};
use gpufeed_uring::{Backend, Direct, ReadOp, Reader};
use serde::Serialize;

use crate::report::share;
use crate::util::{Samples, SplitMix, gbps, show_size, timed};

#[derive(Debug, Serialize)]
pub struct FacadeBench {
    pub file_bytes: u64,
    pub warm_default_gbps: Samples,
    pub warm_default_strategy: String,
    pub warm_one_thread_gbps: Samples,
    pub warm_staged_gbps: Samples,
    pub warm_registered_gbps: Samples,
    pub safetensors_bytes: u64,
    pub safetensors_gbps: Samples,
    pub cold_default_gbps: Samples,
    pub cold_default_strategy: String,
    pub raw_direct_read_gbps: Samples,
    pub first_load_gbps: f64,
    /// Fresh processes: `Gpu::open`, a new `Loader`, its first and second load of the file.
    pub one_shot_file: Vec<crate::oneshot::OneShotRun>,
    /// The same for the safetensors checkpoint.
    pub one_shot_checkpoint: Vec<crate::oneshot::OneShotRun>,
    /// Fresh processes: `load_file_on(0, file)` (context overlapped), then a warm second load.
    pub one_shot_on_file: Vec<crate::oneshot::OnRun>,
    /// Fresh processes: `safetensors::load_on(0, checkpoint)`, then a warm second load.
    pub one_shot_on_checkpoint: Vec<crate::oneshot::OnRun>,
    /// BatchLoader over the file as 64 KiB records, 256 per batch, 8 workers, device batches.
    pub batch_loader_gbps: Samples,
    /// The cores busy meanwhile.
    pub batch_loader_cores: Samples,
    /// The same as 4 KiB records.
    pub batch_loader_4k: crate::loader::Epochs,
    /// Both again with one worker per core (and two batches in flight per worker), where the
    /// machine has more than 8 cores.
    pub batch_loader_per_core: Option<PerCore>,
    /// Both again gathered by the GPU (`BatchLoaderOptions::gpu_gather`), with 8 workers and
    /// with 2.
    pub batch_loader_gpu_gather: Vec<PerCore>,
}

/// The batch loader's rows with a number of workers: one per core (logical CPU), or the GPU
/// gathering (`gpu_gather`).
#[derive(Debug, Serialize)]
pub struct PerCore {
    pub workers: usize,
    /// 64 KiB records.
    pub kib64: crate::loader::Epochs,
    /// 4 KiB records.
    pub kib4: crate::loader::Epochs,
}

/// Writes a safetensors file of about `bytes` in `tensors` F16 tensors of random bytes (unless
/// it exists); its length.
pub fn ensure_safetensors(path: &Path, bytes: u64, tensors: usize) -> Result<u64> {
    if let Ok(m) = path.metadata() {
        return Ok(m.len());
    }
    let per = (bytes / tensors as u64) as usize / 2 * 2;
    let mut rng = SplitMix(0x5AFE);
    let data: Vec<Vec<u8>> = (0..tensors)
        .map(|_| {
            let mut v = vec![0u8; per];
            rng.fill(&mut v);
            v
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![per / 2], d)
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
            Ok((format!("layers.{i}.weight"), view))
        })
        .collect::<Result<_>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    // On the disk before anything is timed: writeback must not run beside the measurements.
    std::fs::File::open(path)?
        .sync_all()
        .context("fsync the checkpoint")?;
    Ok(path.metadata()?.len())
}

/// The disk's own limit: O_DIRECT sequential read through io_uring, queue depth 32, 1 MiB.
pub(crate) fn raw_direct(path: &Path) -> Result<f64> {
    let mut reader = Reader::builder()
        .backend(Backend::Auto)
        .direct(Direct::On)
        .queue_depth(32)
        .build()?;
    let file = reader.open(path)?;
    let len = path.metadata()?.len();
    let pool = RefCell::new(Vec::<AlignedBuf>::new());
    let ops = (0..len.div_ceil(1 << 20)).map(|i| {
        let off = i << 20;
        let buf = pool
            .borrow_mut()
            .pop()
            .map_or_else(|| AlignedBuf::new(1 << 20, 4096), Ok)
            .expect("buffer");
        ReadOp::new(file, off, buf).len((len - off).min(1 << 20) as usize)
    });
    let (secs, res) = timed(|| reader.read_all(ops, |c| pool.borrow_mut().push(c.buf)));
    res?;
    Ok(gbps(len, secs))
}

pub fn measure(
    gpu: &Gpu,
    dir: &Path,
    file: &Path,
    reps: usize,
    mut progress: impl FnMut(&str),
) -> Result<FacadeBench> {
    let len = file.metadata()?.len();
    let default = Loader::new(gpu, LoadOptions::default())?;
    let one = Loader::new(gpu, LoadOptions::one_thread())?;
    let with = |strategy| Loader::new(gpu, LoadOptions::default().with_strategy(strategy));
    let (staged, registered) = (with(Strategy::Staged)?, with(Strategy::Registered)?);

    progress(
        "gpufeed::load_file: a new Loader (its staging reserved) and its first load, warm file",
    );
    cache::warm(file)?;
    let (first_s, first) = timed(|| gpufeed::load_file(gpu, file, LoadOptions::default()));
    drop(first?);
    let first_load_gbps = gbps(len, first_s);

    progress(
        "one-shot: fresh processes open the GPU and load the file, then the checkpoint, twice",
    );
    let st_path = dir.join(format!("model-{len}.safetensors"));
    let st_bytes = ensure_safetensors(&st_path, len, 16)?;
    cache::warm(file)?;
    cache::warm(&st_path)?;
    let one_shot_file = crate::oneshot::measure(file, false, reps)?;
    let one_shot_checkpoint = crate::oneshot::measure(&st_path, true, reps)?;
    let one_shot_on_file = crate::oneshot::measure_on(file, false, reps)?;
    let one_shot_on_checkpoint = crate::oneshot::measure_on(&st_path, true, reps)?;

    progress("warm 4 GiB file: default options, one IO thread, staged");
    // Two untimed loads per loader, so that the rows below time loaders in use: a loader's
    // first load takes its device memory from cuMemAlloc, its second grows the context's pool
    // (the one-shot table shows both), later ones reuse what the pool kept.
    cache::warm(file)?;
    for loader in [&default, &one, &staged, &registered] {
        for _ in 0..2 {
            drop(loader.load_file(file)?);
            loader.wait_for_cleanup();
        }
    }
    let (mut d, mut o, mut s, mut g) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut strategy = String::new();
    for _ in 0..reps {
        cache::warm(file)?;
        // The default row times a load on its own: the previous repetition's registered
        // loads finish unregistering first (the Staged row below shows what happens if not).
        one.wait_for_cleanup();
        registered.wait_for_cleanup();
        let (buf, r) = default.load_file(file)?;
        strategy = format!("{} ({})", r.strategy, r.reason);
        d.push(r.gbps());
        drop(buf);
        let (buf, r) = one.load_file(file)?;
        o.push(r.gbps());
        drop(buf);
        let (buf, r) = staged.load_file(file)?;
        s.push(r.gbps());
        drop(buf);
        let (buf, r) = registered.load_file(file)?;
        g.push(r.gbps());
        drop(buf);
    }

    progress("safetensors checkpoint of 4 GiB, warm");
    cache::warm(&st_path)?;
    let mut st = Vec::new();
    one.wait_for_cleanup();
    registered.wait_for_cleanup();
    for _ in 0..reps {
        let (secs, ckpt) = timed(|| gpufeed::safetensors::load_with(&default, &st_path));
        let ckpt = ckpt.context("load the checkpoint")?;
        st.push(gbps(ckpt.bytes(), secs));
    }

    progress("cold: default options against the raw O_DIRECT read of the same file");
    let (mut c, mut raw) = (Vec::new(), Vec::new());
    let mut cold_strategy = String::new();
    for _ in 0..reps {
        cache::evict(file)?;
        raw.push(raw_direct(file)?);
        cache::evict(file)?;
        let (buf, r) = default.load_file(file)?;
        cold_strategy = format!("{} ({})", r.strategy, r.reason);
        c.push(r.gbps());
        drop(buf);
    }
    progress(
        "batch loader: the file as 64 KiB and 4 KiB records, 256 per batch, 8 workers, to the GPU",
    );
    cache::warm(file)?;
    // Each worker gathers and uploads its batch: two batches in flight per worker.
    let cfg = gpufeed::dataset::BatchLoaderOptions::default()
        .with_batch_size(256)
        .with_drop_last(true)
        .with_prefetch(16)
        .with_workers(8);
    let batch_loader = crate::loader::epochs(file, 64 << 10, cfg.clone(), 1, Some(gpu), reps)?;
    let batch_loader_4k = crate::loader::epochs(file, 4 << 10, cfg.clone(), 1, Some(gpu), reps)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let batch_loader_per_core = if cores > 8 {
        progress(&format!(
            "batch loader: the same with {cores} workers (one per core)"
        ));
        let cfg = cfg.clone().with_workers(cores).with_prefetch(2 * cores);
        Some(PerCore {
            workers: cores,
            kib64: crate::loader::epochs(file, 64 << 10, cfg.clone(), 1, Some(gpu), reps)?,
            kib4: crate::loader::epochs(file, 4 << 10, cfg, 1, Some(gpu), reps)?,
        })
    } else {
        None
    };
    progress("batch loader: the same gathered by the GPU (gpu_gather), 8 and 2 workers");
    let batch_loader_gpu_gather = [8, 2]
        .into_iter()
        .map(|workers| -> Result<PerCore> {
            let cfg = cfg
                .clone()
                .with_workers(workers)
                .with_prefetch(2 * workers)
                .with_gpu_gather(true);
            Ok(PerCore {
                workers,
                kib64: crate::loader::epochs(file, 64 << 10, cfg.clone(), 1, Some(gpu), reps)?,
                kib4: crate::loader::epochs(file, 4 << 10, cfg, 1, Some(gpu), reps)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(FacadeBench {
        file_bytes: len,
        warm_default_gbps: Samples::new(d),
        warm_default_strategy: strategy,
        warm_one_thread_gbps: Samples::new(o),
        warm_staged_gbps: Samples::new(s),
        warm_registered_gbps: Samples::new(g),
        safetensors_bytes: st_bytes,
        safetensors_gbps: Samples::new(st),
        cold_default_gbps: Samples::new(c),
        cold_default_strategy: cold_strategy,
        raw_direct_read_gbps: Samples::new(raw),
        first_load_gbps,
        one_shot_file,
        one_shot_checkpoint,
        one_shot_on_file,
        one_shot_on_checkpoint,
        batch_loader_gbps: batch_loader.gbps,
        batch_loader_cores: batch_loader.cores_busy,
        batch_loader_4k,
        batch_loader_per_core,
        batch_loader_gpu_gather,
    })
}

/// Table 6: the facade's loads, against the pinned limit `limit` (GB/s) of table 4.
pub fn table(s: &mut String, f: &FacadeBench, limit: f64) {
    let _ = writeln!(
        s,
        "\n## Table 6 — gpufeed facade: a {} file and a {} safetensors checkpoint to the GPU\n",
        show_size(f.file_bytes),
        show_size(f.safetensors_bytes)
    );
    let _ = writeln!(s, "| load | GB/s | against |\n|---|---|---|");
    let _ = writeln!(
        s,
        "| warm, default options: {} | {} | {} |",
        f.warm_default_strategy,
        f.warm_default_gbps.show(1),
        share(f.warm_default_gbps.median, limit, "the pinned limit")
    );
    let _ = writeln!(
        s,
        "| warm, one IO thread (LoadOptions::one_thread: registered, one registering thread) | {} | {}; target 30 |",
        f.warm_one_thread_gbps.show(1),
        share(f.warm_one_thread_gbps.median, limit, "the pinned limit")
    );
    let _ = writeln!(
        s,
        "| warm, Strategy::Registered (two registering threads) | {} | {} |",
        f.warm_registered_gbps.show(1),
        share(f.warm_registered_gbps.median, limit, "the pinned limit")
    );
    let _ = writeln!(
        s,
        "| warm, Strategy::Staged right after a registered load (whose unregistration still runs in the background and holds off copies) | {} | {} |",
        f.warm_staged_gbps.show(1),
        share(f.warm_staged_gbps.median, limit, "the pinned limit")
    );
    let _ = writeln!(
        s,
        "| warm, safetensors::load (one bulk transfer) | {} | {}; target 45 |",
        f.safetensors_gbps.show(1),
        share(f.safetensors_gbps.median, limit, "the pinned limit")
    );
    let _ = writeln!(
        s,
        "| cold, default options: {} | {} | {} |",
        f.cold_default_strategy,
        f.cold_default_gbps.show(2),
        share(
            f.cold_default_gbps.median,
            f.raw_direct_read_gbps.median,
            "the raw O_DIRECT read"
        )
    );
    let _ = writeln!(
        s,
        "| raw O_DIRECT read of the same file (io_uring, qd 32, 1 MiB, to host memory) | {} | the disk's limit |",
        f.raw_direct_read_gbps.show(2)
    );
    let _ = writeln!(
        s,
        "| BatchLoader: 64 KiB records in shuffled batches of 256, 8 workers, device batches | {} | {}; {:.1} cores busy, {:.1} GB/s per core |",
        f.batch_loader_gbps.show(1),
        share(f.batch_loader_gbps.median, limit, "the pinned limit"),
        f.batch_loader_cores.median,
        f.batch_loader_gbps.median / f.batch_loader_cores.median
    );
    let _ = writeln!(
        s,
        "| BatchLoader: the same as 4 KiB records | {} | {}; {:.1} cores busy |",
        f.batch_loader_4k.gbps.show(1),
        share(f.batch_loader_4k.gbps.median, limit, "the pinned limit"),
        f.batch_loader_4k.cores_busy.median
    );
    if let Some(p) = &f.batch_loader_per_core {
        for (what, e) in [("64 KiB", &p.kib64), ("4 KiB", &p.kib4)] {
            let _ = writeln!(
                s,
                "| BatchLoader: {what} records, {} workers (one per logical CPU), {} batches in flight | {} | {}; {:.1} cores busy |",
                p.workers,
                2 * p.workers,
                e.gbps.show(1),
                share(e.gbps.median, limit, "the pinned limit"),
                e.cores_busy.median
            );
        }
    }
    for p in &f.batch_loader_gpu_gather {
        for (what, e) in [("64 KiB", &p.kib64), ("4 KiB", &p.kib4)] {
            let _ = writeln!(
                s,
                "| BatchLoader: {what} records gathered by the GPU (gpu_gather: the file's mapping registered, a kernel per batch), {} workers | {} | {}; {:.1} cores busy |",
                p.workers,
                e.gbps.show(1),
                share(e.gbps.median, limit, "the pinned limit"),
                e.cores_busy.median
            );
        }
    }
    let _ = writeln!(
        s,
        "\n`gpufeed::load_file` (a new `Loader`: its staging reserved, then its first load) moved the warm file at {:.1} GB/s; \
         the rows above reuse one `Loader` per setting.",
        f.first_load_gbps
    );
    crate::oneshot::table(s, f);
}
