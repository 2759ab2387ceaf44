//! Table 4 (GPU machine only): the PCIe limit, the scheduler from each source, the registered
//! file mapping on one thread, and the pool's steady-state `get`.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use gpufeed::Gpu;
use gpufeed_cuda::cudarc::driver::{DevicePtrMut, sys};
use gpufeed_cuda::{GpuInfo, HostSource, TransferOptions, TransferScheduler};
use gpufeed_os::{FileMap, MapMode, cache};
use gpufeed_pinned::{HostRegistration, PinnedBuffer, PinnedPool, PoolMode, PoolOptions};
use serde::Serialize;

use crate::report::share;
use crate::util::{Samples, SplitMix, ensure_random_file, gbps, show_size, timed};

#[derive(Debug, Serialize)]
pub struct GpuBench {
    pub gpu: String,
    pub pci_bus_id: String,
    pub numa_node: Option<u32>,
    pub pcie: String,
    pub bytes: u64,
    /// One stream, 16 MiB cuMemcpyHtoDAsync from pinned memory: the machine's limit.
    pub pinned_limit_gbps: Samples,
    /// cuMemHostAlloc of `bytes`, ms.
    pub pinned_alloc_ms: f64,
    pub sched_pinned_gbps: Samples,
    pub sched_pageable_gbps: Samples,
    /// The staged pageable upload by fill-thread count (staging buffers = 2 x threads).
    pub pageable_by_fill_threads: Vec<(usize, Samples)>,
    pub default_fill_threads: usize,
    /// cuMemcpyHtoD straight from a Vec (what naive code does).
    pub naive_pageable_gbps: Samples,
    pub file_bytes: u64,
    pub register_ms: Samples,
    pub registered_copy_gbps: Samples,
    pub registered_with_register_gbps: Samples,
    pub pool_get_us: Samples,
    pub alloc_64mib_ms: f64,
    pub facade: crate::facade::FacadeBench,
    /// Table 8: saves back to a file.
    pub save: crate::save::SaveBench,
    /// The peers' GB/s (or their errors), from benches/peers/peers.py, same run and files.
    pub peers: Option<serde_json::Value>,
}

const CHUNK: usize = 16 << 20;

/// The seed of the random bytes of the file loaded by tables 4, 6, 8 and 9.
pub const FILE_SEED: u64 = 0xF11E;

pub fn describe(info: &GpuInfo) -> String {
    match (info.pcie_gen, info.pcie_width) {
        (Some(g), Some(w)) => format!("PCIe Gen{g} x{w}"),
        _ => "PCIe link unknown".into(),
    }
}

/// GPU 0, or `None` (said through `progress`) where no GPU is usable.
pub fn open_gpu(progress: &mut impl FnMut(&str)) -> Result<Option<Gpu>> {
    match Gpu::open(0) {
        Ok(g) => Ok(Some(g)),
        Err(e) if e.is_no_gpu() => {
            progress(&format!("no GPU: {e}"));
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// One copy of all of `pinned` into `dev` on `stream` in 16 MiB `cuMemcpyHtoDAsync` calls,
/// synchronized: the link's own GB/s.
pub fn pinned_copy_gbps(
    pinned: &PinnedBuffer,
    dev: &mut gpufeed_cuda::cudarc::driver::CudaSlice<u8>,
    stream: &Arc<gpufeed_cuda::cudarc::driver::CudaStream>,
) -> Result<f64> {
    let len = pinned.len().min(dev.len());
    let (secs, res) = timed(|| copy_pinned(pinned, dev, stream, len));
    res?;
    Ok(gbps(len as u64, secs))
}

/// The first `len` bytes of `pinned` into `dev` on `stream` in 16 MiB `cuMemcpyHtoDAsync`
/// calls, synchronized: the wire alone.
pub fn copy_pinned(
    pinned: &PinnedBuffer,
    dev: &mut gpufeed_cuda::cudarc::driver::CudaSlice<u8>,
    stream: &Arc<gpufeed_cuda::cudarc::driver::CudaStream>,
    len: usize,
) -> Result<()> {
    anyhow::ensure!(
        len <= pinned.len().min(dev.len()),
        "a copy past the buffers"
    );
    let (dptr, guard) = dev.device_ptr_mut(stream);
    for off in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - off);
        // SAFETY: pinned and dev both hold at least len bytes (checked) and outlive the
        // synchronize below.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dptr + off as u64,
                pinned.as_ptr().add(off).cast(),
                n,
                stream.cu_stream(),
            )
        }
        .result()?;
    }
    stream.synchronize()?;
    drop(guard);
    Ok(())
}

pub fn measure(
    dir: &Path,
    bytes: u64,
    file_bytes: u64,
    reps: usize,
    peers: bool,
    mut progress: impl FnMut(&str),
) -> Result<Option<GpuBench>> {
    let Some(gpu) = open_gpu(&mut progress)? else {
        return Ok(None);
    };
    let ctx = Arc::clone(gpu.context());
    let len = bytes as usize;
    let mut data = vec![0u8; len];
    SplitMix(0x6F0).fill(&mut data);

    progress("pinned limit: one stream, 16 MiB chunks");
    let (alloc_s, pinned) = timed(|| PinnedBuffer::new(&ctx, len));
    let mut pinned = pinned?;
    pinned.copy_from_slice(&data);
    let mut dev = gpu.alloc_zeroed(len)?;
    let stream = ctx.new_stream()?;
    let mut limit = Vec::new();
    for _ in 0..reps + 1 {
        limit.push(pinned_copy_gbps(&pinned, &mut dev, &stream)?);
    }
    limit.remove(0); // warm-up

    progress("scheduler: pinned, pageable (staged), naive pageable");
    let sched = TransferScheduler::new(&gpu, TransferOptions::default())?;
    let mut from_pinned = Vec::new();
    let mut from_pageable = Vec::new();
    let mut naive = Vec::new();
    for _ in 0..reps {
        from_pinned.push(
            sched
                .upload(HostSource::Pinned(&pinned), &mut dev, 0)?
                .gbps(),
        );
        from_pageable.push(
            sched
                .upload(HostSource::Pageable(&data), &mut dev, 0)?
                .gbps(),
        );
        let (secs, res) = timed(|| stream.memcpy_htod(&data, &mut dev));
        res?;
        stream.synchronize()?;
        naive.push(gbps(bytes, secs));
    }
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let mut by_threads = Vec::new();
    for threads in [1, 2, 4, 8, 12, 16].into_iter().filter(|&t| t <= cores) {
        let cfg = TransferOptions::default()
            .with_fill_threads(threads)
            .with_staging_buffers(2 * threads);
        let sched = TransferScheduler::new(&gpu, cfg)?;
        let runs = (0..reps)
            .map(|_| {
                sched
                    .upload(HostSource::Pageable(&data), &mut dev, 0)
                    .map(|s| s.gbps())
            })
            .collect::<Result<Vec<f64>, _>>()?;
        by_threads.push((threads, Samples::new(runs)));
    }
    let back = gpu.to_vec(&dev)?;
    anyhow::ensure!(back == data, "the bytes on the GPU differ from the source");
    drop((dev, pinned));

    progress(&format!(
        "registered read-only file mapping of {} GiB, one thread",
        file_bytes >> 30
    ));
    let path = dir.join(format!("gpu-file-{file_bytes}.bin"));
    ensure_random_file(&path, file_bytes, FILE_SEED)?;
    cache::warm(&path)?;
    let mut dev = gpu.alloc_zeroed(file_bytes as usize)?;
    let (mut reg_ms, mut copy, mut both) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        // SAFETY: the bench's file is written once and never changed while mapped.
        let map = unsafe { FileMap::open(&path, MapMode::ReadOnly) }.context("map the file")?;
        let (reg_s, reg) = timed(|| HostRegistration::file_map(&ctx, &map));
        let reg = reg?;
        let stats = sched.upload(HostSource::Registered(&reg), &mut dev, 0)?;
        reg_ms.push(reg_s * 1e3);
        copy.push(stats.gbps());
        both.push(gbps(file_bytes, reg_s + stats.seconds));
    }
    drop(dev);

    progress("pool: steady-state get of a 64 MiB buffer");
    let (alloc64, first) = timed(|| PinnedBuffer::new(&ctx, 64 << 20));
    drop(first?);
    let pool = PinnedPool::new(
        PoolMode::Cuda(Arc::clone(&ctx)),
        PoolOptions::default()
            .with_budget_bytes(None)
            .with_numa_node(gpu.info().numa_node),
    )?;
    drop(pool.get(64 << 20)?);
    let gets = (0..1000)
        .map(|_| {
            let (s, b) = timed(|| pool.get(64 << 20));
            b.map(|b| {
                drop(b);
                s * 1e6
            })
        })
        .collect::<Result<Vec<f64>, _>>()?;

    let facade = crate::facade::measure(&gpu, dir, &path, reps, &mut progress)?;
    progress("table 8: the file saved back from GPU memory, against the disk's O_DIRECT writes");
    let checkpoint = dir.join(format!("model-{file_bytes}.safetensors"));
    let save = crate::save::measure(&gpu, dir, &path, &checkpoint, reps)?;
    let peers = if peers {
        progress("peers: PyTorch, kvikio, safetensors, fastsafetensors (benches/peers/peers.py)");
        let st = dir.join(format!("model-{file_bytes}.safetensors"));
        let mut all = run_peers(&path, &st, reps);
        progress("peers: PyTorch's DataLoader on the batch loader's records");
        let records = run_peer_script(&[
            "--records".into(),
            path.display().to_string(),
            (64 << 10).to_string(),
            "256".into(),
            reps.to_string(),
        ]);
        if let (Some(all), Some(records)) = (all.as_object_mut(), records.as_object()) {
            all.extend(records.clone());
        }
        Some(all)
    } else {
        None
    };
    let info = gpu.info();
    Ok(Some(GpuBench {
        gpu: info.name.clone(),
        pci_bus_id: info.pci_bus_id.clone(),
        numa_node: info.numa_node,
        pcie: describe(info),
        bytes,
        pinned_limit_gbps: Samples::new(limit),
        pinned_alloc_ms: alloc_s * 1e3,
        sched_pinned_gbps: Samples::new(from_pinned),
        sched_pageable_gbps: Samples::new(from_pageable),
        pageable_by_fill_threads: by_threads,
        default_fill_threads: sched.config().fill_threads,
        naive_pageable_gbps: Samples::new(naive),
        file_bytes,
        register_ms: Samples::new(reg_ms),
        registered_copy_gbps: Samples::new(copy),
        registered_with_register_gbps: Samples::new(both),
        pool_get_us: Samples::new(gets),
        alloc_64mib_ms: alloc64 * 1e3,
        facade,
        save,
        peers,
    }))
}

/// Runs the peers' script on the same files; any failure becomes an error entry.
fn run_peers(file: &Path, safetensors: &Path, reps: usize) -> serde_json::Value {
    run_peer_script(&[
        file.display().to_string(),
        safetensors.display().to_string(),
        reps.to_string(),
    ])
}

/// Runs `python3 benches/peers/peers.py args...`; its JSON, or an error entry.
pub fn run_peer_script(args: &[String]) -> serde_json::Value {
    run_script(Path::new("benches/peers/peers.py"), args)
}

/// `python3 script args...`'s JSON output, or `{"peers": {"error": ...}}`.
pub fn run_script(script: &Path, args: &[String]) -> serde_json::Value {
    let out = std::process::Command::new("python3")
        .arg(script)
        .args(args)
        .output();
    match out {
        Ok(o) if o.status.success() => serde_json::from_slice(&o.stdout).unwrap_or_else(
            |e| serde_json::json!({ "peers": { "error": format!("unreadable output: {e}") } }),
        ),
        Ok(o) => {
            serde_json::json!({ "peers": { "error": String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("failed").to_owned() } })
        }
        Err(e) => {
            serde_json::json!({ "peers": { "error": format!("cannot run python3 {}: {e}", script.display()) } })
        }
    }
}

/// Table 4: host -> GPU transfers.
pub fn table(s: &mut String, g: &GpuBench) {
    let limit = g.pinned_limit_gbps.median;
    let _ = writeln!(
        s,
        "\n## Table 4 — {} ({}, {}, NUMA node {}): host -> GPU, {} per transfer\n",
        g.gpu,
        g.pci_bus_id,
        g.pcie,
        g.numa_node.map_or("unknown".into(), |n| n.to_string()),
        show_size(g.bytes)
    );
    let _ = writeln!(s, "| path | GB/s | share of a limit |\n|---|---|---|");
    let _ = writeln!(
        s,
        "| the pinned limit: pinned memory, 1 stream, 16 MiB cuMemcpyHtoDAsync | {} | the limit |",
        g.pinned_limit_gbps.show(1)
    );
    for (name, v) in [
        (
            "TransferScheduler from pinned (4 streams, 16 MiB)",
            &g.sched_pinned_gbps,
        ),
        (
            "TransferScheduler from a pageable Vec (staged, default fill threads)",
            &g.sched_pageable_gbps,
        ),
        (
            "naive cuMemcpyHtoD from a pageable Vec",
            &g.naive_pageable_gbps,
        ),
    ] {
        let _ = writeln!(
            s,
            "| {name} | {} | {} |",
            v.show(1),
            share(v.median, limit, "the pinned limit")
        );
    }
    let _ = writeln!(
        s,
        "| {} registered read-only file mapping (page cache), copies from one thread | {} | {} |",
        show_size(g.file_bytes),
        g.registered_copy_gbps.show(1),
        share(g.registered_copy_gbps.median, limit, "the pinned limit")
    );
    let _ = writeln!(
        s,
        "| same, including cuMemHostRegister ({} ms) | {} | {} |",
        g.register_ms.show(0),
        g.registered_with_register_gbps.show(1),
        share(
            g.registered_with_register_gbps.median,
            limit,
            "the pinned limit"
        )
    );
    let sweep: Vec<String> = g
        .pageable_by_fill_threads
        .iter()
        .map(|(t, v)| format!("{t}: {:.1}", v.median))
        .collect();
    let _ = writeln!(
        s,
        "\nStaged pageable upload by fill threads (GB/s, median): {}; the default here is {} threads.",
        sweep.join(", "),
        g.default_fill_threads
    );
    let _ = writeln!(
        s,
        "\nPool: steady-state `get` of a 64 MiB pinned buffer {} us (median, min-max of 1000) against \
         {:.1} ms for cuMemHostAlloc of 64 MiB; cuMemHostAlloc of {} took {:.0} ms.",
        g.pool_get_us.show(2),
        g.alloc_64mib_ms,
        show_size(g.bytes),
        g.pinned_alloc_ms
    );
}

/// The peers' rows of the GPU run (`--peers`), after table 8.
pub fn peers_table(s: &mut String, g: &GpuBench) {
    if let Some(peers) = g.peers.as_ref().and_then(|p| p.as_object()) {
        let _ = writeln!(
            s,
            "\n## Peers — same run, same files (warm)\n\n| peer | GB/s |\n|---|---|"
        );
        for (name, v) in peers {
            let cell = match v.as_array() {
                Some(runs) => {
                    let samples =
                        crate::util::Samples::new(runs.iter().filter_map(|x| x.as_f64()).collect());
                    samples.show(1)
                }
                None => format!(
                    "did not run: {}",
                    v.get("error").and_then(|e| e.as_str()).unwrap_or("?")
                ),
            };
            let _ = writeln!(s, "| {name} | {cell} |");
        }
    }
}
