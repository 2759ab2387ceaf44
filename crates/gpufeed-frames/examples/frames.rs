//! The real-time frame pipeline of the source's case study (§6.2): a camera-like producer
//! process paints frames into a shared-memory ring; this process takes them in order,
//! transforms each (RGB8 -> planar f32) and measures capture-to-result latency; then the naive
//! baseline, the same frames through a pipe into a pageable buffer; then the ring with frames
//! as fast as this process takes them (the rate it sustains).
//!
//! ```text
//! cargo run --release -p gpufeed --example frames -- --gpu 0 --seconds 60
//! cargo run --release -p gpufeed --example frames -- --width 1920 --height 1080 --seconds 5
//! ```
//!
//! Without `--gpu` the transform runs on the CPU. With `--gpu N` each frame is copied from its
//! slot of the registered ring into GPU N while the previous one is transformed there (double
//! buffering, `gpufeed_frames::frames::GpuFrames`), the baseline copies from its pageable buffer, and
//! every `--check-every`-th frame's result is compared with the CPU's. For the sustained rate
//! on the GPU the producer paints only the rows the checks read, so that painting 4K frames
//! does not bound it.

use std::io::BufWriter;
use std::process::{Command, Stdio};
use std::time::Duration;

use clap::{Parser, Subcommand};
use gpufeed_frames::frames::{self, FrameFormat};
use gpufeed_ipc::BatchRing;

#[derive(Parser)]
#[command(
    about = "The real-time frame pipeline (case study 6.2): a shared-memory ring against a pipe"
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    /// Frame width in pixels (RGB8).
    #[arg(long, default_value_t = 3840)]
    width: u32,
    /// Frame height.
    #[arg(long, default_value_t = 2160)]
    height: u32,
    /// Frames per second the producer captures at.
    #[arg(long, default_value_t = 60.0)]
    fps: f64,
    /// Seconds of capture per path.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Ring slots (frames in flight).
    #[arg(long, default_value_t = 4)]
    slots: u32,
    /// Transform on this GPU instead of the CPU.
    #[arg(long)]
    gpu: Option<usize>,
    /// With --gpu: compare every N-th frame's result with the CPU's (0: never).
    #[arg(long, default_value_t = 60)]
    check_every: u64,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum Role {
    /// The producer over a ring (started by `frames` itself).
    #[command(hide = true)]
    Produce {
        #[arg(long)]
        ring: String,
        #[arg(long)]
        frames: u64,
        /// Paint only the rows the consumer's checks read.
        #[arg(long)]
        sparse: bool,
    },
    /// The baseline's producer, frames to stdout (started by `frames` itself).
    #[command(hide = true)]
    ProducePipe {
        #[arg(long)]
        frames: u64,
    },
}

/// One path's figures.
#[derive(serde::Serialize)]
struct PathReport {
    path: &'static str,
    #[serde(flatten)]
    run: frames::RunReport,
    /// Frames the producer dropped at capture (no free slot).
    producer_dropped: u64,
    /// With --gpu: the median copy and kernel, frames checked, copies from registered memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu: Option<GpuFigures>,
}

#[derive(serde::Serialize)]
struct GpuFigures {
    copy_ms: f64,
    kernel_ms: f64,
    checked: u64,
    registered: bool,
}

/// How a path transforms: on the CPU, or on a GPU.
enum Consumer {
    Cpu,
    Gpu(Box<frames::GpuFrames>),
}

impl Consumer {
    fn ring(
        &mut self,
        ring: &BatchRing,
        format: FrameFormat,
        frames: u64,
    ) -> Result<(frames::Run, Option<GpuFigures>), gpufeed_frames::Error> {
        let idle = Duration::from_secs(5);
        match self {
            Consumer::Cpu => Ok((
                frames::run_ring(ring, format, frames, idle, frames::cpu_transform(format))?,
                None,
            )),
            Consumer::Gpu(g) => Ok(split(g.run_ring(ring, frames, idle)?, frames)),
        }
    }

    fn pipe(
        &mut self,
        r: &mut impl std::io::Read,
        format: FrameFormat,
        frames: u64,
    ) -> Result<(frames::Run, Option<GpuFigures>), gpufeed_frames::Error> {
        match self {
            Consumer::Cpu => Ok((
                frames::run_pipe(r, format, frames::cpu_transform(format))?,
                None,
            )),
            Consumer::Gpu(g) => Ok(split(g.run_pipe(r)?, frames)),
        }
    }
}

fn split(run: frames::GpuRun, frames: u64) -> (frames::Run, Option<GpuFigures>) {
    let r = run.report(frames, None);
    let figures = GpuFigures {
        copy_ms: r.copy_ms,
        kernel_ms: r.kernel_ms,
        checked: r.checked,
        registered: r.registered,
    };
    (run.run, Some(figures))
}

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

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let format = FrameFormat {
        width: cli.width,
        height: cli.height,
    };
    match cli.role {
        Some(Role::Produce {
            ring,
            frames,
            sparse,
        }) => {
            let ring = BatchRing::open(&ring)?;
            let paint = if sparse {
                frames::Paint::Checked
            } else {
                frames::Paint::Full
            };
            let stats = frames::produce_with(&ring, format, cli.fps, 0..frames, paint)?;
            println!("{}", serde_json::to_string(&stats)?);
            return Ok(());
        }
        Some(Role::ProducePipe { frames }) => {
            let mut out = BufWriter::with_capacity(1 << 20, std::io::stdout().lock());
            frames::produce_pipe(&mut out, format, cli.fps, frames)?;
            return Ok(());
        }
        None => {}
    }
    let frames = (cli.fps * cli.seconds).round().max(1.0) as u64;
    let interval = Duration::from_secs_f64(1.0 / cli.fps);
    let mut consumer = match cli.gpu {
        Some(n) => Consumer::Gpu(Box::new(
            frames::GpuFrames::new(&gpufeed_load::Gpu::open(n)?, format)?
                .with_check_every(cli.check_every),
        )),
        None => Consumer::Cpu,
    };
    let on = if cli.gpu.is_some() {
        "the GPU"
    } else {
        "the CPU"
    };
    let ring = ring_path(&cli, &mut consumer, format, frames, interval, cli.fps)?;
    let pipe = pipe_path(&cli, &mut consumer, format, frames, interval)?;
    // The most this consumer sustains: the producer paints as fast as slots free up.
    let fastest = ring_path(&cli, &mut consumer, format, frames, interval, 0.0)?;
    if cli.json {
        println!(
            "{}",
            serde_json::json!({"format": format, "fps": cli.fps, "frames": frames,
                "transform": if cli.gpu.is_some() { "gpu" } else { "cpu" },
                "paths": [ring, pipe], "sustained": fastest})
        );
        return Ok(());
    }
    println!(
        "{}x{} RGB8 at {} fps, {} frames per path; each frame transformed to planar f32 on {on}\n",
        format.width, format.height, cli.fps, frames
    );
    println!(
        "| path | p50 ms | p99 ms | max ms | dropped | late | busy | frames/s | copy ms | kernel ms | checked |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in [&ring, &pipe, &fastest] {
        let (copy, kernel, checked) =
            r.gpu
                .as_ref()
                .map_or(("-".to_owned(), "-".to_owned(), "-".to_owned()), |g| {
                    (
                        format!("{:.3}", g.copy_ms),
                        format!("{:.3}", g.kernel_ms),
                        g.checked.to_string(),
                    )
                });
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {} | {} | {:.0}% | {:.1} | {copy} | {kernel} | {checked} |",
            r.path,
            r.run.latency.p50_ms,
            r.run.latency.p99_ms,
            r.run.latency.max_ms,
            r.run.latency.dropped,
            r.run.latency.late,
            100.0 * r.run.busy_fraction,
            r.run.frames_per_s
        );
    }
    if let Some(g) = fastest.gpu.as_ref() {
        println!(
            "\nThe copy alone: {:.1} GB/s ({:.0} frames/s); sustained {:.0} frames/s.",
            format.bytes() as f64 / g.copy_ms / 1e6,
            1000.0 / g.copy_ms,
            fastest.run.frames_per_s
        );
    }
    Ok(())
}

/// This program again, as a producer.
fn me() -> Result<Command, Box<dyn std::error::Error>> {
    Ok(Command::new(std::env::current_exe()?))
}

fn common_args(cmd: &mut Command, cli: &Cli, fps: f64) {
    cmd.args(["--width", &cli.width.to_string()])
        .args(["--height", &cli.height.to_string()])
        .args(["--fps", &fps.to_string()]);
}

fn ring_path(
    cli: &Cli,
    consumer: &mut Consumer,
    format: FrameFormat,
    frames: u64,
    interval: Duration,
    fps: f64,
) -> Result<PathReport, Box<dyn std::error::Error>> {
    let ring = BatchRing::create_unique(cli.slots, format.slot_bytes())?;
    let name = ring
        .segment()
        .name()
        .ok_or("the ring has no name")?
        .to_owned();
    let mut cmd = me()?;
    common_args(&mut cmd, cli, fps);
    cmd.args(["produce", "--ring", &name, "--frames", &frames.to_string()]);
    if fps == 0.0 && matches!(consumer, Consumer::Gpu(_)) {
        cmd.arg("--sparse");
    }
    let child = cmd.stdout(Stdio::piped()).spawn()?;
    let (run, gpu) = consumer.ring(&ring, format, frames)?;
    let out = child.wait_with_output()?;
    // A producer that died (killed mid-frame) loses the frame it was painting; what it
    // published arrived. Say so and report what was seen.
    let stats: frames::ProducerStats = match serde_json::from_slice(&out.stdout) {
        Ok(s) if out.status.success() => s,
        _ => {
            let last = run.seen.last().map_or(-1, |&(s, _)| s as i64);
            eprintln!(
                "the producer ended early ({}) after frame {last}: the frames after it are counted as dropped",
                out.status
            );
            frames::ProducerStats::default()
        }
    };
    Ok(PathReport {
        path: if fps > 0.0 {
            "shared-memory ring (zero-copy slots)"
        } else {
            "the ring, frames as fast as the consumer takes them (sustained rate)"
        },
        run: run.report(frames, Some(interval)),
        producer_dropped: stats.dropped,
        gpu,
    })
}

fn pipe_path(
    cli: &Cli,
    consumer: &mut Consumer,
    format: FrameFormat,
    frames: u64,
    interval: Duration,
) -> Result<PathReport, Box<dyn std::error::Error>> {
    let mut cmd = me()?;
    common_args(&mut cmd, cli, cli.fps);
    let mut child = cmd
        .args(["produce-pipe", "--frames", &frames.to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut pipe = child.stdout.take().ok_or("no pipe")?;
    let (run, gpu) = consumer.pipe(&mut pipe, format, frames)?;
    child.wait()?;
    Ok(PathReport {
        path: "pipe into a pageable buffer (baseline)",
        run: run.report(frames, Some(interval)),
        producer_dropped: 0,
        gpu,
    })
}
