//! Table 12 (any machine): the real-time frame pipeline of the source's case study (§6.2), in
//! its CPU form (`gpufeed::frames`). A producer process of this program paints 1080p RGB8 frames
//! at 60 fps into a shared-memory ring; this process takes them in order and transforms each to
//! planar f32 on the CPU; the same frames go through a pipe into a pageable buffer (the naive
//! baseline); then the ring with frames as fast as the consumer takes them (the rate it
//! sustains). The GPU consumer is not built yet.

use std::io::BufWriter;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use gpufeed::frames::{self, FrameFormat, RunReport};
use gpufeed::ipc::BatchRing;
use serde::Serialize;

const FORMAT: FrameFormat = FrameFormat::FHD;
const FPS: f64 = 60.0;

#[derive(Debug, Serialize)]
pub struct FramesBench {
    pub format: FrameFormat,
    pub fps: f64,
    pub frames: u64,
    pub ring: RunReport,
    /// Frames the ring's producer dropped at capture (no free slot).
    pub ring_producer_dropped: u64,
    pub pipe: RunReport,
    pub sustained: RunReport,
}

/// The producer process: `frames` frames at `fps` (0: as fast as slots free up) into ring
/// `ring`, or to stdout without one; prints its stats (ring) as JSON.
pub fn child(ring: Option<&str>, fps: f64, frames: u64) -> Result<()> {
    match ring {
        Some(name) => {
            let ring = BatchRing::open(name)?;
            let stats = frames::produce(&ring, FORMAT, fps, 0..frames)?;
            println!("{}", serde_json::to_string(&stats)?);
        }
        None => {
            let mut out = BufWriter::with_capacity(1 << 20, std::io::stdout().lock());
            frames::produce_pipe(&mut out, FORMAT, fps, frames)?;
        }
    }
    Ok(())
}

fn producer(exe: &std::path::Path, ring: Option<&str>, fps: f64, frames: u64) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args(["frames-producer", "--fps", &fps.to_string()])
        .args(["--frames", &frames.to_string()])
        .stdout(Stdio::piped());
    if let Some(name) = ring {
        cmd.args(["--ring", name]);
    }
    cmd
}

fn through_ring(exe: &std::path::Path, fps: f64, frames: u64) -> Result<(RunReport, u64)> {
    let ring = BatchRing::create_unique(4, FORMAT.slot_bytes())?;
    let name = ring.segment().name().context("a named ring")?.to_owned();
    let child = producer(exe, Some(&name), fps, frames).spawn()?;
    let run = frames::run_ring(
        &ring,
        FORMAT,
        frames,
        Duration::from_secs(10),
        frames::cpu_transform(FORMAT),
    )?;
    let out = child.wait_with_output()?;
    anyhow::ensure!(out.status.success(), "the frame producer failed");
    let stats: frames::ProducerStats = serde_json::from_slice(&out.stdout)?;
    Ok((run.report(frames, Some(interval())), stats.dropped))
}

fn interval() -> Duration {
    Duration::from_secs_f64(1.0 / FPS)
}

pub fn measure(exe: &std::path::Path, seconds: f64) -> Result<FramesBench> {
    let frames = (FPS * seconds).round().max(1.0) as u64;
    let (ring, dropped) = through_ring(exe, FPS, frames)?;
    let mut child = producer(exe, None, FPS, frames).spawn()?;
    let mut pipe = child.stdout.take().context("the producer's pipe")?;
    let run = frames::run_pipe(&mut pipe, FORMAT, frames::cpu_transform(FORMAT))?;
    anyhow::ensure!(child.wait()?.success(), "the pipe's frame producer failed");
    let (sustained, _) = through_ring(exe, 0.0, frames)?;
    Ok(FramesBench {
        format: FORMAT,
        fps: FPS,
        frames,
        ring,
        ring_producer_dropped: dropped,
        pipe: run.report(frames, Some(interval())),
        sustained,
    })
}

pub fn table(s: &mut String, b: &FramesBench) {
    use std::fmt::Write;
    let _ = writeln!(
        s,
        "\n## Table 12 — the real-time frame pipeline (case study 6.2), CPU form\n\n\
         {}x{} RGB8 frames captured at {} fps by a producer process, {} per path, each \
         transformed to planar f32 on the CPU. Latency runs from capture (the producer's \
         `CLOCK_MONOTONIC`) to the transform's end; late: more than one frame interval.\n\n\
         | path | p50 ms | p99 ms | max ms | dropped | late | busy | frames/s |\n\
         |---|---|---|---|---|---|---|---|",
        b.format.width, b.format.height, b.fps, b.frames
    );
    for (path, r) in [
        (
            "shared-memory ring (`gpufeed::frames`, zero-copy slots)",
            &b.ring,
        ),
        ("pipe into a pageable buffer (baseline)", &b.pipe),
        (
            "the ring, frames as fast as the consumer takes them (sustained rate)",
            &b.sustained,
        ),
    ] {
        let l = &r.latency;
        let _ = writeln!(
            s,
            "| {path} | {:.2} | {:.2} | {:.2} | {} | {} | {:.0}% | {:.1} |",
            l.p50_ms,
            l.p99_ms,
            l.max_ms,
            l.dropped,
            l.late,
            100.0 * r.busy_fraction,
            r.frames_per_s
        );
    }
    let _ = writeln!(
        s,
        "\nThe GPU consumer (uploads from the registered ring, double buffered, a kernel) is not \
         built yet (issue 21)."
    );
}
