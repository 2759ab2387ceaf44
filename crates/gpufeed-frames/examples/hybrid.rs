//! The hybrid training loader of the source's case study (§6.1): RGB8 images in one record
//! file, mapped read-only; shuffled batches gathered into pinned buffers and uploaded;
//! preprocessed on the GPU (planar f32, `gpufeed_frames::hybrid::GpuPlanar`); then copied device ->
//! host straight into the shared-memory rings of training processes (`Fanout`), each taking
//! its batches with a `RingLoader` (to the same GPU, host -> device from its registered ring)
//! and checking the first record of each. Against it, the baseline on the same records: the
//! `BatchLoader` with the CPU transform on its workers.
//!
//! ```text
//! cargo run --release -p gpufeed --example hybrid -- --images 4096 --trainers 2
//! cargo run --release -p gpufeed --example hybrid -- --gpu 0 --images 4096 --trainers 2
//! ```
//!
//! Without `--gpu` the preprocessing runs on the loader's workers and the trainers take host
//! batches (the CPU path).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use gpufeed_data::ring::RingLoader;
use gpufeed_data::{BatchData, BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler};
use gpufeed_frames::frames::FrameFormat;
use gpufeed_frames::hybrid::{Fanout, GpuPlanar, Planar, batches_for, planar_transform};
use gpufeed_ipc::BatchRing;

#[derive(Parser)]
#[command(
    about = "The hybrid training loader (case study 6.1): GPU preprocessing, batches to trainer processes through shared memory"
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    /// Preprocess on this GPU (default: on the CPU).
    #[arg(long)]
    gpu: Option<usize>,
    /// Images in the record file (made in a temporary folder).
    #[arg(long, default_value_t = 2048)]
    images: usize,
    /// Image width and height (square, RGB8).
    #[arg(long, default_value_t = 224)]
    size: u32,
    /// Images per batch.
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Training processes.
    #[arg(long, default_value_t = 2)]
    trainers: usize,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum Role {
    /// A training process (started by `hybrid` itself).
    #[command(hide = true)]
    Train {
        #[arg(long)]
        ring: String,
        #[arg(long)]
        records: std::path::PathBuf,
        #[arg(long)]
        batches: usize,
    },
}

type Error = Box<dyn std::error::Error>;

fn main() -> std::process::ExitCode {
    // The error's message (what to do), not its debug form.
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Error> {
    let image = FrameFormat {
        width: cli.size,
        height: cli.size,
    };
    if let Some(Role::Train {
        ring,
        records,
        batches,
    }) = &cli.role
    {
        return train(ring, records, *batches, image, cli.gpu);
    }
    // The GPU first: a missing one is said before any work.
    let gpu = cli.gpu.map(gpufeed_load::Gpu::open).transpose()?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("images.bin");
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let bytes: Vec<u8> = (0..cli.images * image.bytes())
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    std::fs::write(&path, bytes)?;
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
    let open = |transform: bool| -> Result<BatchLoader, Error> {
        // SAFETY: the example's record file is not changed while mapped.
        let records = unsafe { RecordFile::open_fixed(&path, image.bytes())? };
        let cfg = BatchLoaderOptions::default()
            .with_batch_size(cli.batch)
            .with_workers(workers)
            .with_prefetch(2 * workers);
        let l = BatchLoader::new(
            records,
            Sampler::new(Order::Shuffled { seed: 7 }),
            cfg,
            gpu.as_ref(),
        )?;
        Ok(if transform {
            l.with_transform(planar_transform(image))
        } else {
            l
        })
    };
    let gb = |secs: f64| (cli.images * image.bytes()) as f64 / secs / 1e9;

    // The baseline: the CPU transform on the loader's workers (uploaded where there is a GPU).
    let mut baseline = open(true)?;
    let t = Instant::now();
    let batches = baseline
        .epoch(0)?
        .map(|b| b.map(drop))
        .collect::<Result<Vec<()>, _>>()?
        .len();
    let baseline_s = t.elapsed().as_secs_f64();

    // The hybrid loader: raw batches preprocessed on the GPU (or the CPU transform without
    // one), dealt out to the trainers' rings.
    let planar = gpu.as_ref().map(|g| GpuPlanar::new(g, image)).transpose()?;
    let mut loader = open(planar.is_none())?;
    let slot = (cli.batch * image.bytes() * 4 + (64 << 10)) as u64;
    let rings = (0..cli.trainers)
        .map(|_| BatchRing::create_unique(3, slot))
        .collect::<Result<Vec<_>, _>>()?;
    let exe = std::env::current_exe()?;
    let children = rings
        .iter()
        .enumerate()
        .map(|(t, r)| -> Result<std::process::Child, Error> {
            Ok(Command::new(&exe)
                .args(["--size", &cli.size.to_string()])
                // A trainer takes its batches to the same GPU, as a training process does.
                .args(
                    cli.gpu
                        .iter()
                        .flat_map(|g| ["--gpu".to_owned(), g.to_string()]),
                )
                .arg("train")
                .args(["--ring", r.segment().name().ok_or("the ring has no name")?])
                .args(["--records".as_ref(), path.as_os_str()])
                .args([
                    "--batches",
                    &batches_for(batches, cli.trainers, t).to_string(),
                ])
                .stdout(Stdio::piped())
                .spawn()?)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut fanout = Fanout::new(&rings, gpu.as_ref())?;
    let t = Instant::now();
    for b in loader.epoch(0)? {
        let b = b?;
        match (&b.data, planar.as_ref()) {
            (BatchData::Device(_), Some(p)) => {
                let out = p.apply(&b)?;
                fanout.publish(0, &b.indices, Planar::Device(&out, p.stream()))?;
            }
            (BatchData::Host(h), _) => {
                fanout.publish(0, &b.indices, Planar::Host(&h[..b.bytes()]))?;
            }
            _ => return Err("a device batch without the GPU preprocessing".into()),
        }
    }
    for child in children {
        let out = child.wait_with_output()?;
        if !out.status.success() {
            return Err("a training process failed".into());
        }
    }
    let hybrid_s = t.elapsed().as_secs_f64();
    let on = if gpu.is_some() { "the GPU" } else { "the CPU" };
    if cli.json {
        println!(
            "{}",
            serde_json::json!({"images": cli.images, "size": cli.size, "batch": cli.batch,
                "batches": batches, "preprocessed_on": on, "trainers": cli.trainers,
                "baseline_gbps": gb(baseline_s), "hybrid_gbps": gb(hybrid_s),
                "baseline_batches_per_s": batches as f64 / baseline_s,
                "hybrid_batches_per_s": batches as f64 / hybrid_s})
        );
        return Ok(());
    }
    println!(
        "{} images of {}x{} RGB8, batches of {}, made planar f32; GB/s of images in\n",
        cli.images, cli.size, cli.size, cli.batch
    );
    println!("| path | GB/s | batches/s |\n|---|---|---|");
    println!(
        "| `BatchLoader` with the CPU transform (baseline) | {:.2} | {:.0} |",
        gb(baseline_s),
        batches as f64 / baseline_s
    );
    println!(
        "| preprocessed on {on}, to {} training processes through shared memory | {:.2} | {:.0} |",
        cli.trainers,
        gb(hybrid_s),
        batches as f64 / hybrid_s
    );
    Ok(())
}

/// A training process: takes its batches from ring `ring` (to GPU `gpu`, or into host
/// memory without one) and checks the first record of each against the CPU's planar values of
/// the record file, mapped read-only here too.
fn train(
    ring: &str,
    records: &std::path::Path,
    batches: usize,
    image: FrameFormat,
    gpu: Option<usize>,
) -> Result<(), Error> {
    let ring = BatchRing::open(ring)?;
    // SAFETY: the record file is not changed while mapped.
    let records = unsafe { RecordFile::open_fixed(records, image.bytes())? };
    let reference = planar_transform(image);
    let gpu = gpu.map(gpufeed_load::Gpu::open).transpose()?;
    let mut loader = RingLoader::new(&ring, gpu.as_ref())?;
    let (mut want, mut first) = (Vec::new(), Vec::new());
    for batch in loader.epoch(0, batches, Duration::from_secs(60)) {
        let batch = batch?;
        // The first record of each batch (the CPU reference costs what the baseline does).
        let n = batch.offsets[1];
        let got: &[u8] = match (&batch.data, gpu.as_ref()) {
            (BatchData::Host(bytes), _) => &bytes[..n],
            (BatchData::Device(buf), Some(g)) => {
                first.resize(n, 0);
                g.default_stream()
                    .memcpy_dtoh(&buf.slice(..n), &mut first)?;
                &first
            }
            (BatchData::Device(_), None) => return Err("a device batch without a GPU".into()),
        };
        let i = *batch.indices.first().ok_or("an empty batch")?;
        want.clear();
        reference(i, records.record(i).ok_or("no such record")?, &mut want)?;
        if got != want {
            return Err(format!("record {i} arrived with other values").into());
        }
    }
    Ok(())
}
