//! The real-time frame pipeline of the source's case study (§6.2), CPU half: a camera-like
//! producer process paints frames into a shared-memory ring; this process takes them in order,
//! transforms each (RGB8 -> planar f32, on the CPU) and measures capture-to-result latency;
//! then the naive baseline, the same frames through a pipe into a pageable buffer.
//!
//! ```text
//! cargo run --release -p gpufeed --example frames -- --width 1920 --height 1080 --fps 60 --seconds 5
//! ```
//!
//! The GPU consumer (uploads from the registered ring, double buffered, a kernel) is not built
//! yet: both paths here transform on the CPU.

use std::io::BufWriter;
use std::process::{Command, Stdio};
use std::time::Duration;

use clap::{Parser, Subcommand};
use gpufeed::frames::{self, FrameFormat};
use gpufeed::ipc::BatchRing;

#[derive(Parser)]
#[command(
    about = "The real-time frame pipeline (case study 6.2): a shared-memory ring against a pipe"
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    /// Frame width in pixels (RGB8).
    #[arg(long, default_value_t = 1920)]
    width: u32,
    /// Frame height.
    #[arg(long, default_value_t = 1080)]
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
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    let format = FrameFormat {
        width: cli.width,
        height: cli.height,
    };
    match cli.role {
        Some(Role::Produce { ring, frames }) => {
            let ring = BatchRing::open(&ring)?;
            let stats = frames::produce(&ring, format, cli.fps, 0..frames)?;
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
    let ring = ring_path(&cli, format, frames, interval, cli.fps)?;
    let pipe = pipe_path(&cli, format, frames, interval)?;
    // The most this consumer sustains: the producer paints as fast as slots free up.
    let fastest = ring_path(&cli, format, frames, interval, 0.0)?;
    if cli.json {
        println!(
            "{}",
            serde_json::json!({"format": format, "fps": cli.fps, "frames": frames,
                "transform": "cpu", "paths": [ring, pipe], "sustained": fastest})
        );
        return Ok(());
    }
    println!(
        "{}x{} RGB8 at {} fps, {} frames per path; each frame transformed to planar f32 on the CPU\n",
        format.width, format.height, cli.fps, frames
    );
    println!("| path | p50 ms | p99 ms | max ms | dropped | late | busy | frames/s |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in [&ring, &pipe, &fastest] {
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {} | {} | {:.0}% | {:.1} |",
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
    let child = cmd
        .args(["produce", "--ring", &name, "--frames", &frames.to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    let run = frames::run_ring(
        &ring,
        format,
        frames,
        Duration::from_secs(5),
        frames::cpu_transform(format),
    )?;
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
    })
}

fn pipe_path(
    cli: &Cli,
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
    let run = frames::run_pipe(&mut pipe, format, frames::cpu_transform(format))?;
    child.wait()?;
    Ok(PathReport {
        path: "pipe into a pageable buffer (baseline)",
        run: run.report(frames, Some(interval)),
        producer_dropped: 0,
    })
}
