//! Table 13 (any machine; its GPU rows on the GPU machine): the hybrid training loader of the
//! source's case study (§6.1, `gpufeed::hybrid`). 224x224 RGB8 images in one record file,
//! mapped read-only, in shuffled batches of 128, made planar `f32` three ways on the same
//! records in the same repetitions:
//! - the baseline: the `BatchLoader` with the CPU transform (`planar_transform`) on its
//!   workers, the `f32` batches uploaded (host batches without a GPU);
//! - preprocessed on the GPU, kept there: the `BatchLoader`'s raw batches uploaded, then
//!   `GpuPlanar` (GPU only);
//! - to training processes: the same batches (preprocessed on the GPU where there is one, on
//!   the CPU otherwise) dealt out by a `Fanout` over two shared-memory rings (device -> host
//!   into the registered slots), each taken by a trainer process of this program with a
//!   `RingLoader` — to GPU 0 where there is one (host -> device from its registered ring), as
//!   a training process does — which checks the first record of every batch against the CPU.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use gpufeed::Gpu;
use gpufeed::dataset::ring::RingLoader;
use gpufeed::dataset::{BatchData, BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler};
use gpufeed::frames::FrameFormat;
use gpufeed::hybrid::{Fanout, GpuPlanar, Planar, batches_for, planar_transform};
use gpufeed::ipc::BatchRing;
use serde::Serialize;

use crate::util::{Samples, ensure_random_file};

const IMAGE: FrameFormat = FrameFormat {
    width: 224,
    height: 224,
};
const BATCH: usize = 128;
const TRAINERS: usize = 2;

#[derive(Debug, Serialize)]
pub struct HybridBench {
    pub image: FrameFormat,
    pub images: usize,
    pub batch: usize,
    pub workers: usize,
    /// Each path's GB/s of images (RGB8 bytes) per epoch; batches per second follow.
    pub baseline_gbps: Samples,
    /// Whether the baseline's batches went to the GPU.
    pub baseline_on_gpu: bool,
    pub gpu_gbps: Option<Samples>,
    pub trainers: usize,
    pub trainers_gbps: Samples,
    /// Whether the trainers' batches were preprocessed on the GPU.
    pub trainers_from_gpu: bool,
}

/// The trainer process: takes `batches` batches of each of epochs `0..epochs` from ring
/// `ring` (a training process lives for the run) — to GPU 0 with `gpu`, as a training process
/// does, into host memory otherwise — checks each batch's first record against the CPU's
/// planar values of `records`, prints how many it took.
pub fn trainer_child(
    ring: &str,
    records: &Path,
    epochs: u64,
    batches: usize,
    gpu: bool,
) -> Result<()> {
    let ring = BatchRing::open(ring)?;
    // SAFETY: the bench's data files are written once and never changed while mapped.
    let records = unsafe { RecordFile::open_fixed(records, IMAGE.bytes())? };
    let reference = planar_transform(IMAGE);
    let gpu = if gpu { Some(Gpu::open(0)?) } else { None };
    let mut loader = RingLoader::new(&ring, gpu.as_ref())?;
    let (mut want, mut first) = (Vec::new(), Vec::new());
    let mut taken = 0;
    for e in 0..epochs {
        for batch in loader.epoch(e, batches, Duration::from_secs(60)) {
            let batch = batch?;
            let n = batch.offsets[1];
            let got: &[u8] = match (&batch.data, gpu.as_ref()) {
                (BatchData::Host(bytes), _) => &bytes[..n],
                (BatchData::Device(buf), Some(g)) => {
                    // The first record only: what a check needs, not a second full copy.
                    first.resize(n, 0);
                    g.default_stream()
                        .memcpy_dtoh(&buf.slice(..n), &mut first)?;
                    &first
                }
                (BatchData::Device(_), None) => anyhow::bail!("a device batch without a GPU"),
            };
            let i = *batch.indices.first().context("an empty batch")?;
            want.clear();
            reference(i, records.record(i).context("the record")?, &mut want)
                .map_err(anyhow::Error::msg)?;
            anyhow::ensure!(got == want, "record {i} arrived with other planar values");
            taken += 1;
        }
    }
    println!("TRAINED {taken}");
    Ok(())
}

fn loader(
    path: &Path,
    workers: usize,
    gpu: Option<&Gpu>,
    cpu_transform: bool,
) -> Result<BatchLoader> {
    // SAFETY: as above.
    let records = unsafe { RecordFile::open_fixed(path, IMAGE.bytes())? };
    let cfg = BatchLoaderOptions::default()
        .with_batch_size(BATCH)
        .with_workers(workers)
        .with_prefetch(2 * workers)
        .with_drop_last(true);
    let l = BatchLoader::new(
        records,
        Sampler::new(Order::Shuffled { seed: 13 }),
        cfg,
        gpu,
    )?;
    Ok(if cpu_transform {
        l.with_transform(planar_transform(IMAGE))
    } else {
        l
    })
}

/// Seconds for one epoch of `loader`, `each` called on every batch.
fn epoch(
    loader: &mut BatchLoader,
    e: u64,
    mut each: impl FnMut(&gpufeed::dataset::Batch) -> Result<()>,
) -> Result<f64> {
    let t = Instant::now();
    for b in loader.epoch(e)? {
        each(&b?)?;
    }
    Ok(t.elapsed().as_secs_f64())
}

pub fn measure(
    exe: &Path,
    dir: &Path,
    gpu: Option<&Gpu>,
    reps: usize,
    quick: bool,
) -> Result<HybridBench> {
    let images = if quick { 512 } else { 4096 };
    let path = dir.join(format!("images-224-{images}.bin"));
    ensure_random_file(&path, (images * IMAGE.bytes()) as u64, 17)?;
    gpufeed::os::cache::warm(&path)?;
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
    let batches = images / BATCH;
    let bytes = (batches * BATCH * IMAGE.bytes()) as f64;
    let gbps = |secs: f64| bytes / secs / 1e9;

    let mut baseline = loader(&path, workers, gpu, true)?;
    let mut raw = gpu
        .map(|g| loader(&path, workers, Some(g), false))
        .transpose()?;
    let planar = gpu.map(|g| GpuPlanar::new(g, IMAGE)).transpose()?;
    // The trainers' source: raw batches preprocessed on the GPU, or the CPU transform.
    let mut dealt = loader(&path, workers, gpu, gpu.is_none())?;
    let slot = (BATCH * IMAGE.bytes() * 4 + (64 << 10)) as u64;
    let (mut base, mut on_gpu, mut to_trainers) = (Vec::new(), Vec::new(), Vec::new());
    // The trainer processes live for the run, as training processes do.
    let rings = (0..TRAINERS)
        .map(|_| BatchRing::create_unique(3, slot))
        .collect::<Result<Vec<_>, _>>()?;
    let children = rings
        .iter()
        .enumerate()
        .map(|(t, r)| -> Result<std::process::Child> {
            Ok(Command::new(exe)
                .args([
                    "hybrid-trainer",
                    "--ring",
                    r.segment().name().context("named")?,
                ])
                .args(["--records".as_ref(), path.as_os_str()])
                .args(["--epochs", &(reps + 1).to_string()])
                .args(["--batches", &batches_for(batches, TRAINERS, t).to_string()])
                .args(gpu.map(|_| "--gpu"))
                .stdout(Stdio::piped())
                .spawn()?)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut fanout = Fanout::new(&rings, gpu)?;
    // Epoch 0 of each is a warm-up (pools, kernels, the page cache, the trainers' mappings).
    for e in 0..=reps as u64 {
        let s = epoch(&mut baseline, e, |_| Ok(()))?;
        if e > 0 {
            base.push(gbps(s));
        }
        if let (Some(l), Some(p)) = (raw.as_mut(), planar.as_ref()) {
            let s = epoch(l, e, |b| {
                let out = p.apply(b)?;
                p.stream().synchronize()?;
                drop(out);
                Ok(())
            })?;
            if e > 0 {
                on_gpu.push(gbps(s));
            }
        }
        let t = Instant::now();
        epoch(&mut dealt, e, |b| {
            match (&b.data, planar.as_ref()) {
                (BatchData::Device(_), Some(p)) => {
                    let out = p.apply(b)?;
                    fanout.publish(e, &b.indices, Planar::Device(&out, p.stream()))?;
                }
                (BatchData::Host(h), _) => {
                    fanout.publish(e, &b.indices, Planar::Host(&h[..b.bytes()]))?;
                }
                _ => anyhow::bail!("a device batch without the GPU preprocessing"),
            }
            Ok(())
        })?;
        // Timed to the last batch published: with three slots per ring, the trainers are at
        // most three batches behind.
        if e > 0 {
            to_trainers.push(gbps(t.elapsed().as_secs_f64()));
        }
    }
    drop(fanout);
    let mut taken = 0;
    for child in children {
        let out = child.wait_with_output()?;
        anyhow::ensure!(out.status.success(), "a trainer process failed");
        let text = String::from_utf8_lossy(&out.stdout);
        taken += text
            .lines()
            .find_map(|l| l.strip_prefix("TRAINED "))
            .context("the trainer's count")?
            .trim()
            .parse::<usize>()?;
    }
    let want = batches * (reps + 1);
    anyhow::ensure!(taken == want, "the trainers took {taken} of {want} batches");
    Ok(HybridBench {
        image: IMAGE,
        images,
        batch: BATCH,
        workers,
        baseline_gbps: Samples::new(base),
        baseline_on_gpu: gpu.is_some(),
        gpu_gbps: gpu.map(|_| Samples::new(on_gpu)),
        trainers: TRAINERS,
        trainers_gbps: Samples::new(to_trainers),
        trainers_from_gpu: gpu.is_some(),
    })
}

pub fn table(s: &mut String, b: &HybridBench) {
    use std::fmt::Write;
    let per_batch = (b.batch * b.image.bytes()) as f64 / 1e9;
    let _ = writeln!(
        s,
        "\n## Table 13 — the hybrid training loader (case study 6.1)\n\n\
         {} RGB8 images of {}x{} in one record file (mapped read-only, in the page cache), \
         shuffled batches of {}, {} loader workers, each image made planar f32 in [0, 1]; one \
         epoch per repetition after a warm-up epoch. GB/s of images in (RGB8 bytes; the \
         f32 out is 4x).\n\n\
         | path | GB/s | batches/s |\n|---|---|---|",
        b.images, b.image.width, b.image.height, b.batch, b.workers
    );
    let mut row = |path: &str, g: &Samples| {
        let _ = writeln!(
            s,
            "| {path} | {} | {:.0} |",
            g.show(2),
            g.median / per_batch
        );
    };
    row(
        if b.baseline_on_gpu {
            "`BatchLoader`, the CPU transform on its workers, f32 batches uploaded (baseline)"
        } else {
            "`BatchLoader`, the CPU transform on its workers, host batches (baseline)"
        },
        &b.baseline_gbps,
    );
    if let Some(g) = &b.gpu_gbps {
        row(
            "`BatchLoader` raw batches uploaded, `GpuPlanar` on the GPU, kept there",
            g,
        );
    }
    row(
        &format!(
            "to {} trainer processes: {} `Fanout` over shared-memory rings, each trainer's `RingLoader` {}",
            b.trainers,
            if b.trainers_from_gpu {
                "preprocessed on the GPU, device -> host into the registered slots,"
            } else {
                "preprocessed on the CPU,"
            },
            if b.trainers_from_gpu {
                "taking its batches to the GPU (host -> device from its registered ring)"
            } else {
                "taking host batches"
            }
        ),
        &b.trainers_gbps,
    );
}
