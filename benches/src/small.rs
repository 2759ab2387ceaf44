//! Table 9 (GPU machine only): small loads. The size curve — one reused default `Loader`
//! loading warm files of 1 MiB to 16 GiB, and loading them from a `RegisteredFile` made once,
//! against the wire alone (a pinned buffer of the same size copied on one stream) in the same
//! run — and a folder of small files (image-sized:
//! 60-160 KiB, 110 KiB on average), one `load_file` per file against `Loader::load_list` of
//! all of them, warm and cold, the cold one against the disk's own O_DIRECT reads of the same
//! files.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use gpufeed::cuda::cudarc::driver::{DevicePtrMut, sys};
use gpufeed::dataset::{BatchLoader, BatchLoaderOptions, ImageFolder, Order, Sampler};
use gpufeed::os::{AlignedBuf, cache};
use gpufeed::pinned::PinnedBuffer;
use gpufeed::uring::{Direct, Reader};
use gpufeed::{FileList, LoadOptions, Loader};
use serde::Serialize;

use crate::report::share;
use crate::util::{Samples, SplitMix, ensure_random_file, gbps, show_size, timed};

#[derive(Debug, Serialize)]
pub struct SizeRow {
    pub bytes: u64,
    /// Seconds per `Loader::load_file` call (device memory, listing, residency, reads,
    /// copies, synchronization: what a caller waits).
    pub seconds: Samples,
    pub gbps: Samples,
    /// Seconds of the same bytes copied from a pinned buffer on one stream (chunks of up to
    /// 16 MiB), synchronized: the wire alone.
    pub wire_seconds: Samples,
    pub wire_gbps: Samples,
    pub strategy: String,
    /// Seconds per `Loader::load_registered` of the whole file from a `RegisteredFile` made
    /// once (new device memory each time, as `load_file`): one copy out of the page cache.
    pub registered_seconds: Samples,
    pub registered_gbps: Samples,
    /// Milliseconds `RegisteredFile::open` took (mapping and registration, once).
    pub register_ms: f64,
}

/// The `ImageFolder` batch loader with the GPU gathering the files.
#[derive(Debug, Serialize)]
pub struct FolderGathered {
    pub workers: usize,
    pub gbps: Samples,
    pub files_per_s: Samples,
    /// Milliseconds `BatchLoader::new` took (mapping the files and registering them).
    pub made_ms: f64,
}

/// The `ImageFolder` batch loader with one worker per core (logical CPUs).
#[derive(Debug, Serialize)]
pub struct FolderPerCore {
    pub workers: usize,
    pub gbps: Samples,
    pub files_per_s: Samples,
}

#[derive(Debug, Serialize)]
pub struct FilesBench {
    pub files: usize,
    pub bytes: u64,
    pub folder: PathBuf,
    /// One `Loader::load_file` per file, reused loader, warm: GB/s and microseconds per file.
    pub per_file_gbps: Samples,
    pub per_file_us: Samples,
    /// `FileList::new` of the folder (statx of every file), milliseconds.
    pub list_ms: Samples,
    /// `Loader::load_list`, warm.
    pub warm_gbps: Samples,
    pub warm_files_per_s: Samples,
    pub warm_strategy: String,
    /// `Loader::load_list` after every file was evicted from the page cache.
    pub cold_gbps: Samples,
    pub cold_files_per_s: Samples,
    pub cold_strategy: String,
    /// The disk's limit for these files: O_DIRECT reads of all of them into host memory
    /// (gpufeed-uring, batches of 256 files), cold, no GPU; per repetition the best of one
    /// reader at queue depth 64 and one reader per core at 32.
    pub cold_limit_gbps: Samples,
    /// Every limit measurement: (threads, queue depth, GB/s).
    pub cold_limit_ways: Vec<(usize, usize, f64)>,
    /// `BatchLoader` over the folder as an `ImageFolder`: shuffled batches of 256 files, 8
    /// workers, device batches; one epoch per repetition after an untimed one, warm.
    pub batch_loader_gbps: Samples,
    pub batch_loader_files_per_s: Samples,
    /// The same with one worker per core (two batches in flight each), where the machine has
    /// more than 8 cores.
    pub batch_loader_per_core: Option<FolderPerCore>,
    /// The same loader gathered by the GPU (`BatchLoaderOptions::gpu_gather`: the files mapped
    /// side by side and registered, one kernel per batch), with 8 workers and with 2, or why
    /// it did not run (`batch_loader_gpu_gather_error`).
    pub batch_loader_gpu_gather: Vec<FolderGathered>,
    pub batch_loader_gpu_gather_error: Option<String>,
    /// `ImageFolder::open` of the folder, milliseconds.
    pub image_folder_open_ms: f64,
    /// PyTorch's DataLoader over the same folder (benches/peers/peers.py --image-folder), with
    /// `--peers`.
    pub torch_dataloader: Option<serde_json::Value>,
}

#[derive(Debug, Serialize)]
pub struct SmallBench {
    pub gpu: String,
    pub curve: Vec<SizeRow>,
    pub files: FilesBench,
}

const WIRE_CHUNK: usize = 16 << 20;

/// Repetitions at `bytes`: many for small loads (cheap, and noisier), `reps` for large ones.
fn reps_for(bytes: u64, reps: usize) -> usize {
    if bytes <= 256 << 20 {
        reps.max(15)
    } else {
        reps
    }
}

pub fn measure(
    dir: &Path,
    curve_max: u64,
    gpu_file: (&Path, u64),
    files: usize,
    reps: usize,
    peers: bool,
    mut progress: impl FnMut(&str),
) -> Result<Option<SmallBench>> {
    let Some(gpu) = crate::gpu::open_gpu(&mut progress)? else {
        return Ok(None);
    };
    let loader = Loader::new(&gpu, LoadOptions::default())?;
    let sizes: Vec<u64> = (0..8)
        .map(|i| (1u64 << 20) << (2 * i))
        .filter(|&s| s <= curve_max)
        .collect();
    let ctx = Arc::clone(gpu.context());
    let pinned_len = (1usize << 30).min(curve_max as usize);
    let mut pinned = PinnedBuffer::new(&ctx, pinned_len)?;
    SplitMix(0x317E).fill(&mut pinned);
    let mut dev = gpu.alloc_zeroed(curve_max as usize)?;
    let stream = ctx.new_stream()?;
    let mut curve = Vec::new();
    for &size in &sizes {
        progress(&format!(
            "size curve: {} warm, reused Loader, and the wire",
            crate::util::show_size(size)
        ));
        let path = if size == gpu_file.1 {
            gpu_file.0.to_path_buf()
        } else {
            let p = dir.join(format!("size-{size}.bin"));
            ensure_random_file(&p, size, 0x5123 ^ size)?;
            p
        };
        cache::warm(&path)?;
        for _ in 0..2 {
            drop(loader.load_file(&path)?);
        }
        let n = reps_for(size, reps);
        let (mut secs, mut strategy) = (Vec::new(), String::new());
        for _ in 0..n {
            let (s, loaded) = timed(|| loader.load_file(&path));
            let (buf, report) = loaded?;
            strategy = report.strategy.to_string();
            secs.push(s);
            drop(buf);
        }
        let file = loader.register_file(&path)?;
        for _ in 0..2 {
            drop(loader.load_registered(&file, 0..size)?);
        }
        let mut registered = Vec::new();
        for _ in 0..n {
            let (s, loaded) = timed(|| loader.load_registered(&file, 0..size));
            drop(loaded?);
            registered.push(s);
        }
        let register_ms = file.seconds() * 1e3;
        drop(file);
        let mut wire = Vec::new();
        for _ in 0..n + 1 {
            let (dptr, guard) = dev.device_ptr_mut(&stream);
            let (s, r) = timed(|| -> Result<()> {
                let mut off = 0usize;
                while (off as u64) < size {
                    let n = WIRE_CHUNK.min(size as usize - off);
                    let from = off % pinned_len;
                    let n = n.min(pinned_len - from);
                    // SAFETY: the pinned buffer holds `pinned_len` bytes and `dev` at least
                    // `size`; both outlive the synchronize below.
                    unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            dptr + off as u64,
                            pinned.as_ptr().add(from).cast(),
                            n,
                            stream.cu_stream(),
                        )
                    }
                    .result()?;
                    off += n;
                }
                stream.synchronize()?;
                Ok(())
            });
            drop(guard);
            r?;
            wire.push(s);
        }
        wire.remove(0); // warm-up
        let seconds = Samples::new(secs);
        let wire_seconds = Samples::new(wire);
        let registered_seconds = Samples::new(registered);
        curve.push(SizeRow {
            registered_gbps: registered_seconds.map(|s| gbps(size, s)),
            registered_seconds,
            register_ms,
            bytes: size,
            gbps: seconds.map(|s| gbps(size, s)),
            seconds,
            wire_gbps: wire_seconds.map(|s| gbps(size, s)),
            wire_seconds,
            strategy,
        });
    }
    drop((dev, pinned));
    let files = measure_files(&loader, dir, files, reps, peers, &mut progress)?;
    Ok(Some(SmallBench {
        gpu: gpu.info().name.clone(),
        curve,
        files,
    }))
}

/// A folder of `n` files of 60-160 KiB of random bytes in ten class subfolders (an image
/// folder's layout), made once.
pub fn ensure_folder(dir: &Path, n: usize) -> Result<(PathBuf, Vec<PathBuf>)> {
    let folder = dir.join(format!("small-files-{n}"));
    let mut rng = SplitMix(0xF01D);
    let mut paths = Vec::with_capacity(n);
    let mut buf = vec![0u8; 160 << 10];
    for i in 0..n {
        let class = folder.join(format!("class-{}", i % 10));
        if i < 10 {
            std::fs::create_dir_all(&class)
                .with_context(|| format!("mkdir {}", class.display()))?;
        }
        let len = (60 << 10) + rng.below(100 << 10) as usize;
        let path = class.join(format!("{i:07}.bin"));
        if path
            .metadata()
            .map(|m| m.len() != len as u64)
            .unwrap_or(true)
        {
            rng.fill(&mut buf[..len]);
            std::fs::write(&path, &buf[..len])
                .with_context(|| format!("write {}", path.display()))?;
        } else {
            // Keep the generator where writing would have left it.
            rng.fill(&mut buf[..len]);
        }
        paths.push(path);
    }
    Ok((folder, paths))
}

/// O_DIRECT reads of every file into host memory, in batches of 256 files per reader, on
/// `threads` threads (each its own reader, its own share of the files, queue depth `qd`);
/// GB/s. The files must be cold.
fn raw_direct_files(list: &FileList, threads: usize, qd: usize) -> Result<f64> {
    let n = list.len();
    let per = n.div_ceil(threads.max(1)).max(1);
    let (s, r) = timed(|| -> Result<()> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..n)
                .step_by(per)
                .map(|first| {
                    scope.spawn(move || -> Result<()> {
                        let last = (first + per).min(n);
                        let mut reader = Reader::builder()
                            .direct(Direct::On)
                            .queue_depth(qd)
                            .block_bytes(1 << 20)
                            .build()?;
                        let (start, end) = (list.offsets()[first], list.offsets()[last]);
                        let mut buf = AlignedBuf::new((end - start).max(1) as usize, 4096)?;
                        let mut rest: &mut [u8] = &mut buf;
                        for batch in (first..last).collect::<Vec<_>>().chunks(256) {
                            let mut ids = Vec::new();
                            let mut reads = Vec::new();
                            for &i in batch {
                                let id = reader.open(&list.paths()[i])?;
                                let r = list.range(i).context("a range per file")?;
                                let (head, tail) = std::mem::take(&mut rest)
                                    .split_at_mut((r.end - r.start) as usize);
                                ids.push(id);
                                reads.push((id, 0, head));
                                rest = tail;
                            }
                            reader.read_exact_many(reads)?;
                            for id in ids {
                                reader.close(id)?;
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            for h in handles {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a reading thread panicked"))??;
            }
            Ok(())
        })
    });
    r?;
    Ok(gbps(list.total_bytes(), s))
}

fn evict_all(paths: &[PathBuf]) -> Result<()> {
    for p in paths {
        cache::evict(p)?;
    }
    Ok(())
}

fn measure_files(
    loader: &Loader,
    dir: &Path,
    n: usize,
    reps: usize,
    peers: bool,
    progress: &mut impl FnMut(&str),
) -> Result<FilesBench> {
    progress(&format!("small files: a folder of {n} files of 60-160 KiB"));
    let (folder, paths) = ensure_folder(dir, n)?;
    let mut list_ms = Vec::new();
    let mut list = FileList::default();
    for _ in 0..reps {
        let (s, l) = timed(|| FileList::new(&paths));
        list = l?;
        list_ms.push(s * 1e3);
    }
    let bytes = list.total_bytes();
    for p in &paths {
        cache::warm(p)?;
    }
    progress("small files: one load_file per file, warm");
    let mut per_file = Vec::new();
    for _ in 0..reps {
        let (s, r) = timed(|| -> Result<()> {
            for p in &paths {
                drop(loader.load_file(p)?);
            }
            Ok(())
        });
        r?;
        per_file.push(s);
    }
    progress("small files: Loader::load_list of all of them, warm then cold");
    drop(loader.load_list(&list)?);
    let (mut warm, mut warm_strategy) = (Vec::new(), String::new());
    for _ in 0..reps {
        let (buf, r) = loader.load_list(&list)?;
        warm_strategy = format!("{} ({})", r.strategy, r.reason);
        warm.push(r.seconds);
        drop(buf);
    }
    // The bytes on the GPU are the files' (a check, not a timing).
    let (buf, _) = loader.load_list(&list)?;
    let back = loader.gpu().to_vec(&buf)?;
    drop(buf);
    let mut host = vec![0u8; bytes as usize];
    list.read_into(&mut host)?;
    anyhow::ensure!(back == host, "the files on the GPU differ from the files");
    drop((back, host));
    let (mut cold, mut limit, mut cold_strategy) = (Vec::new(), Vec::new(), String::new());
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let mut limit_ways = Vec::new();
    for _ in 0..reps {
        // The disk's limit: the best of one reader at queue depth 64 and one per core at 32.
        let mut best = 0.0f64;
        for (threads, qd) in [(1, 64), (cores, 32)] {
            evict_all(&paths)?;
            let g = raw_direct_files(&list, threads, qd)?;
            limit_ways.push((threads, qd, g));
            best = best.max(g);
        }
        limit.push(best);
        evict_all(&paths)?;
        let (buf, r) = loader.load_list(&list)?;
        cold_strategy = format!("{} ({})", r.strategy, r.reason);
        cold.push(r.seconds);
        drop(buf);
    }
    progress("small files: the dataset BatchLoader over the folder as an ImageFolder");
    for p in &paths {
        cache::warm(p)?;
    }
    let (open_s, folder_set) = timed(|| ImageFolder::open(&folder));
    let folder_set = folder_set?;
    let cfg = BatchLoaderOptions::default()
        .with_batch_size(256)
        .with_workers(8)
        // Two batches per worker, as the other BatchLoader rows: with fewer than the workers,
        // some never run.
        .with_prefetch(16);
    // Seconds of one epoch per repetition (after an untimed one) of a loader of the folder,
    // and the seconds making the loader took.
    let folder_epochs_made = |cfg: BatchLoaderOptions| -> Result<(Vec<f64>, f64)> {
        let (made_s, batches) = timed(|| {
            BatchLoader::new(
                folder_set.clone(),
                Sampler::new(Order::Shuffled { seed: 3 }),
                cfg,
                Some(loader.gpu()),
            )
        });
        let mut batches = batches?;
        let mut epochs = Vec::new();
        for epoch in 0..=reps as u64 {
            let (s, r) = timed(|| -> Result<u64> {
                let mut moved = 0;
                for b in batches.epoch(epoch)? {
                    moved += b?.bytes() as u64;
                }
                Ok(moved)
            });
            anyhow::ensure!(r? == bytes, "an epoch moved other bytes than the folder's");
            if epoch > 0 {
                epochs.push(s);
            }
        }
        Ok((epochs, made_s))
    };
    let folder_epochs = |cfg| folder_epochs_made(cfg).map(|(epochs, _)| epochs);
    let epochs = folder_epochs(cfg.clone())?;
    progress(
        "small files: the ImageFolder BatchLoader gathered by the GPU (gpu_gather), 8 and 2 workers",
    );
    let gathered = [8, 2]
        .into_iter()
        .map(|workers| {
            let cfg = cfg
                .clone()
                .with_workers(workers)
                .with_prefetch(2 * workers)
                .with_gpu_gather(true);
            let (secs, made_s) = folder_epochs_made(cfg)?;
            let secs = Samples::new(secs);
            Ok(FolderGathered {
                workers,
                gbps: secs.map(|s| gbps(bytes, s)),
                files_per_s: secs.map(|s| n as f64 / s),
                made_ms: made_s * 1e3,
            })
        })
        .collect::<Result<Vec<_>>>()
        .map_err(|e| format!("{e:#}"));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_core = if cores > 8 {
        progress(&format!(
            "small files: the ImageFolder BatchLoader with {cores} workers (one per core)"
        ));
        let secs = Samples::new(folder_epochs(
            cfg.with_workers(cores).with_prefetch(2 * cores),
        )?);
        Some(FolderPerCore {
            workers: cores,
            gbps: secs.map(|s| gbps(bytes, s)),
            files_per_s: secs.map(|s| n as f64 / s),
        })
    } else {
        None
    };
    let torch_dataloader = peers.then(|| {
        progress("small files: PyTorch's DataLoader over the same folder (peers.py)");
        crate::gpu::run_peer_script(&[
            "--image-folder".into(),
            folder.display().to_string(),
            reps.to_string(),
        ])
    });
    let epochs = Samples::new(epochs);
    let warm = Samples::new(warm);
    let cold = Samples::new(cold);
    let per_file = Samples::new(per_file);
    Ok(FilesBench {
        files: n,
        bytes,
        folder,
        per_file_gbps: per_file.map(|s| gbps(bytes, s)),
        per_file_us: per_file.map(|s| s * 1e6 / n as f64),
        list_ms: Samples::new(list_ms),
        warm_gbps: warm.map(|s| gbps(bytes, s)),
        warm_files_per_s: warm.map(|s| n as f64 / s),
        warm_strategy,
        cold_gbps: cold.map(|s| gbps(bytes, s)),
        cold_files_per_s: cold.map(|s| n as f64 / s),
        cold_strategy,
        cold_limit_gbps: Samples::new(limit),
        cold_limit_ways: limit_ways,
        batch_loader_gbps: epochs.map(|s| gbps(bytes, s)),
        batch_loader_files_per_s: epochs.map(|s| n as f64 / s),
        batch_loader_per_core: per_core,
        batch_loader_gpu_gather_error: gathered.as_ref().err().cloned(),
        batch_loader_gpu_gather: gathered.unwrap_or_default(),
        image_folder_open_ms: open_s * 1e3,
        torch_dataloader,
    })
}

/// Table 9: small loads, the size curve and a folder of small files.
pub fn table(s: &mut String, v: &SmallBench) {
    let _ = writeln!(
        s,
        "\n## Table 9 — small loads on {}: the size curve and a folder of small files\n\n\
         One reused `Loader` with default options loads warm files of each size; a load's time \
         runs from the call until the bytes are on the GPU (device memory, checks, reads, \
         copies). \"The wire\" copies the same number of bytes from a pinned buffer on one \
         stream (chunks of up to 16 MiB), synchronized: what the link alone takes. \
         \"Registered\" loads the same file with `Loader::load_registered` from a \
         `RegisteredFile` opened once (its mapping and registration, paid once, in the last \
         column): one copy by the GPU out of the page cache, new device memory each time. \
         Median of 15 repetitions up to 256 MiB, of the run's repetitions above.\n\n\
         | size | gpufeed GB/s | time per load | registered GB/s | registered, time per load | the wire GB/s | the wire's time | gpufeed / registered, share of the wire | registering once |\n\
         |---|---|---|---|---|---|---|---|---|",
        v.gpu
    );
    let time = |secs: f64| {
        if secs < 1e-3 {
            format!("{:.0} us", secs * 1e6)
        } else {
            format!("{:.2} ms", secs * 1e3)
        }
    };
    for r in &v.curve {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {:.0}% / {:.0}% | {:.1} ms |",
            show_size(r.bytes),
            r.gbps.show(1),
            time(r.seconds.median),
            r.registered_gbps.show(1),
            time(r.registered_seconds.median),
            r.wire_gbps.show(1),
            time(r.wire_seconds.median),
            100.0 * r.gbps.median / r.wire_gbps.median,
            100.0 * r.registered_gbps.median / r.wire_gbps.median,
            r.register_ms
        );
    }
    let f = &v.files;
    let _ = writeln!(
        s,
        "\n{} files of 60-160 KiB ({} in all, in ten class folders under {}); listing them \
         (`FileList::new`, statx of each) took {} ms.\n\n\
         | how | GB/s | files per second | against |\n|---|---|---|---|",
        f.files,
        show_size(f.bytes),
        f.folder.display(),
        f.list_ms.show(1)
    );
    let _ = writeln!(
        s,
        "| one `Loader::load_file` per file, warm | {} | {:.0} ({:.0} us per file) | |",
        f.per_file_gbps.show(2),
        f.files as f64 / (f.bytes as f64 / 1e9 / f.per_file_gbps.median),
        f.per_file_us.median
    );
    let _ = writeln!(
        s,
        "| `Loader::load_list` of all of them, warm: {} | {} | {:.0} | {:.1}x one load per file |",
        f.warm_strategy,
        f.warm_gbps.show(1),
        f.warm_files_per_s.median,
        f.warm_gbps.median / f.per_file_gbps.median
    );
    let _ = writeln!(
        s,
        "| `Loader::load_list`, cold: {} | {} | {:.0} | {} |",
        f.cold_strategy,
        f.cold_gbps.show(2),
        f.cold_files_per_s.median,
        share(
            f.cold_gbps.median,
            f.cold_limit_gbps.median,
            "the disk's limit"
        )
    );
    let _ = writeln!(
        s,
        "| the disk's limit: O_DIRECT reads of the same files into host memory (gpufeed-uring, 256 files per batch; the best of 1 thread at queue depth 64 and 1 per core at 32), cold | {} | | the limit |",
        f.cold_limit_gbps.show(2)
    );
    let _ = writeln!(
        s,
        "| `dataset::BatchLoader` over the folder as an `ImageFolder` (listed in {:.0} ms): shuffled batches of 256 files with labels, 8 workers, to the GPU, warm; one epoch | {} | {:.0} | |",
        f.image_folder_open_ms,
        f.batch_loader_gbps.show(1),
        f.batch_loader_files_per_s.median
    );
    match &f.batch_loader_gpu_gather_error {
        None => {
            for g in &f.batch_loader_gpu_gather {
                let _ = writeln!(
                    s,
                    "| the same, {} workers, gathered by the GPU (`gpu_gather`: the files mapped side by side and registered in {:.0} ms, one kernel per batch) | {} | {:.0} | {} |",
                    g.workers,
                    g.made_ms,
                    g.gbps.show(1),
                    g.files_per_s.median,
                    if f.batch_loader_gbps.median > 0.0 {
                        format!(
                            "{:.1}x gathered by the CPU",
                            g.gbps.median / f.batch_loader_gbps.median
                        )
                    } else {
                        String::new()
                    }
                );
            }
        }
        Some(e) => {
            let _ = writeln!(
                s,
                "| the same gathered by the GPU (`gpu_gather`) | did not run: {e} | | |"
            );
        }
    }
    if let Some(p) = &f.batch_loader_per_core {
        let _ = writeln!(
            s,
            "| the same with {} workers (one per logical CPU), {} batches in flight | {} | {:.0} | |",
            p.workers,
            2 * p.workers,
            p.gbps.show(1),
            p.files_per_s.median
        );
    }
    if let Some(peers) = f.torch_dataloader.as_ref().and_then(|p| p.as_object()) {
        for (name, v) in peers {
            match v.as_array() {
                Some(runs) => {
                    let g =
                        crate::util::Samples::new(runs.iter().filter_map(|x| x.as_f64()).collect());
                    let _ = writeln!(
                        s,
                        "| peer: {name}, same folder, one epoch | {} | {:.0} | gpufeed's BatchLoader {:.1}x |",
                        g.show(2),
                        g.median * 1e9 * f.files as f64 / f.bytes as f64,
                        f.batch_loader_gbps.median / g.median
                    );
                }
                None => {
                    let _ = writeln!(
                        s,
                        "| peer: {name} | did not run: {} | | |",
                        v.get("error").and_then(|e| e.as_str()).unwrap_or("?")
                    );
                }
            }
        }
    }
}
