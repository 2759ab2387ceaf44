//! Table 12 (any machine; its GPU rows on the GPU machine): the real-time frame pipeline of
//! the source's case study (§6.2, `gpufeed::frames`). A producer process of this program
//! paints RGB8 frames at 60 fps into a shared-memory ring; this process takes them in order
//! and transforms each to planar f32; the same frames go through a pipe into a pageable buffer
//! (the naive baseline); then the ring with frames as fast as the consumer takes them (the
//! rate it sustains). On the CPU: 1080p frames, transformed on the CPU. On a GPU: 4K frames
//! (the case study's), each copied from its slot of the registered ring while the previous one
//! is transformed by the planar kernel (`GpuFrames`), the baseline's copies from its pageable
//! buffer, against the link's own pinned rate (the most frames per second the wire carries).

use std::io::BufWriter;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use gpufeed::Gpu;
use gpufeed::frames::{self, FrameFormat, GpuReport, RunReport};
use gpufeed::ipc::BatchRing;
use serde::Serialize;

const FORMAT: FrameFormat = FrameFormat::FHD;
const GPU_FORMAT: FrameFormat = FrameFormat::UHD;
const FPS: f64 = 60.0;
/// Frames between checks of the GPU's result against the CPU's: once a second.
const CHECK_EVERY: u64 = 60;

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
    /// The same on GPU 0, where there is one.
    pub gpu: Option<GpuFrames>,
}

/// Table 12's GPU rows.
#[derive(Debug, Serialize)]
pub struct GpuFrames {
    pub format: FrameFormat,
    pub fps: f64,
    pub frames: u64,
    pub ring: GpuReport,
    pub ring_producer_dropped: u64,
    pub pipe: GpuReport,
    pub sustained_frames: u64,
    pub sustained: GpuReport,
    /// The link's own rate: 256 MiB from pinned memory in 16 MiB copies, GB/s.
    pub wire_gbps: crate::util::Samples,
}

/// The producer process: `frames` frames of `format` at `fps` (0: as fast as slots free up)
/// into ring `ring` (painting only the checked rows when `sparse`), or to stdout without one;
/// prints its stats (ring) as JSON.
pub fn child(
    ring: Option<&str>,
    format: FrameFormat,
    fps: f64,
    frames: u64,
    sparse: bool,
) -> Result<()> {
    match ring {
        Some(name) => {
            let ring = BatchRing::open(name)?;
            let paint = if sparse {
                frames::Paint::Checked
            } else {
                frames::Paint::Full
            };
            let stats = frames::produce_with(&ring, format, fps, 0..frames, paint)?;
            println!("{}", serde_json::to_string(&stats)?);
        }
        None => {
            let mut out = BufWriter::with_capacity(1 << 20, std::io::stdout().lock());
            frames::produce_pipe(&mut out, format, fps, frames)?;
        }
    }
    Ok(())
}

/// What a producer process paints.
struct Producer {
    format: FrameFormat,
    fps: f64,
    frames: u64,
    sparse: bool,
}

impl Producer {
    fn command(&self, exe: &std::path::Path, ring: Option<&str>) -> Command {
        let mut cmd = Command::new(exe);
        cmd.args(["frames-producer", "--fps", &self.fps.to_string()])
            .args(["--frames", &self.frames.to_string()])
            .args(["--width", &self.format.width.to_string()])
            .args(["--height", &self.format.height.to_string()])
            .stdout(Stdio::piped());
        if let Some(name) = ring {
            cmd.args(["--ring", name]);
        }
        if self.sparse {
            cmd.arg("--sparse");
        }
        cmd
    }

    /// Frames through a 4-slot ring into `consume`; also the frames the producer dropped.
    fn through_ring<R>(
        &self,
        exe: &std::path::Path,
        consume: impl FnOnce(&BatchRing) -> Result<R>,
    ) -> Result<(R, u64)> {
        let ring = BatchRing::create_unique(4, self.format.slot_bytes())?;
        let name = ring.segment().name().context("a named ring")?.to_owned();
        let child = self.command(exe, Some(&name)).spawn()?;
        let run = consume(&ring)?;
        let out = child.wait_with_output()?;
        anyhow::ensure!(out.status.success(), "the frame producer failed");
        let stats: frames::ProducerStats = serde_json::from_slice(&out.stdout)?;
        Ok((run, stats.dropped))
    }

    /// Frames through a pipe into `consume`.
    fn through_pipe<R>(
        &self,
        exe: &std::path::Path,
        consume: impl FnOnce(&mut std::process::ChildStdout) -> Result<R>,
    ) -> Result<R> {
        let mut child = self.command(exe, None).spawn()?;
        let mut pipe = child.stdout.take().context("the producer's pipe")?;
        let run = consume(&mut pipe)?;
        anyhow::ensure!(child.wait()?.success(), "the pipe's frame producer failed");
        Ok(run)
    }
}

fn interval() -> Duration {
    Duration::from_secs_f64(1.0 / FPS)
}

const IDLE: Duration = Duration::from_secs(10);

/// The CPU rows for `seconds` per path; the GPU rows on `gpu` for `gpu_seconds`.
pub fn measure(
    exe: &std::path::Path,
    seconds: f64,
    gpu: Option<&Gpu>,
    gpu_seconds: f64,
    reps: usize,
) -> Result<FramesBench> {
    let frames = (FPS * seconds).round().max(1.0) as u64;
    let paced = Producer {
        format: FORMAT,
        fps: FPS,
        frames,
        sparse: false,
    };
    let cpu_ring = |ring: &BatchRing| -> Result<RunReport> {
        let run = frames::run_ring(ring, FORMAT, frames, IDLE, frames::cpu_transform(FORMAT))?;
        Ok(run.report(frames, Some(interval())))
    };
    let (ring, dropped) = paced.through_ring(exe, cpu_ring)?;
    let pipe = paced.through_pipe(exe, |pipe| {
        let run = frames::run_pipe(pipe, FORMAT, frames::cpu_transform(FORMAT))?;
        Ok(run.report(frames, Some(interval())))
    })?;
    let fast = Producer { fps: 0.0, ..paced };
    let (sustained, _) = fast.through_ring(exe, cpu_ring)?;
    Ok(FramesBench {
        format: FORMAT,
        fps: FPS,
        frames,
        ring,
        ring_producer_dropped: dropped,
        pipe,
        sustained,
        gpu: gpu
            .map(|g| measure_gpu(exe, g, gpu_seconds, reps))
            .transpose()?,
    })
}

fn measure_gpu(exe: &std::path::Path, gpu: &Gpu, seconds: f64, reps: usize) -> Result<GpuFrames> {
    let frames = (FPS * seconds).round().max(1.0) as u64;
    let mut consumer = frames::GpuFrames::new(gpu, GPU_FORMAT)?.with_check_every(CHECK_EVERY);
    let paced = Producer {
        format: GPU_FORMAT,
        fps: FPS,
        frames,
        sparse: false,
    };
    let (ring, dropped) = paced.through_ring(exe, |ring| {
        Ok(consumer
            .run_ring(ring, frames, IDLE)?
            .report(frames, Some(interval())))
    })?;
    let pipe = paced.through_pipe(exe, |pipe| {
        Ok(consumer.run_pipe(pipe)?.report(frames, Some(interval())))
    })?;
    // As fast as the consumer takes them, painting only the checked rows (whole 4K frames
    // would make the producer the bound): at least 10 s worth of frames at 60 fps.
    let sustained_frames = frames.max(600);
    let fast = Producer {
        fps: 0.0,
        frames: sustained_frames,
        sparse: true,
        ..paced
    };
    let (sustained, _) = fast.through_ring(exe, |ring| {
        Ok(consumer
            .run_ring(ring, sustained_frames, IDLE)?
            .report(sustained_frames, None))
    })?;
    let wire = wire_gbps(gpu, reps)?;
    Ok(GpuFrames {
        format: GPU_FORMAT,
        fps: FPS,
        frames,
        ring,
        ring_producer_dropped: dropped,
        pipe,
        sustained_frames,
        sustained,
        wire_gbps: wire,
    })
}

/// The link's pinned rate, as table 4 measures it.
fn wire_gbps(gpu: &Gpu, reps: usize) -> Result<crate::util::Samples> {
    let len = 256 << 20;
    let pinned = gpufeed_pinned::PinnedBuffer::new(gpu.context(), len)?;
    let stream = gpu.default_stream();
    // SAFETY: every byte is written by the copies before anything reads it.
    let mut dev = unsafe { gpu.alloc(len)? };
    crate::gpu::pinned_copy_gbps(&pinned, &mut dev, &stream)?; // warm-up
    let runs = (0..reps.max(3))
        .map(|_| crate::gpu::pinned_copy_gbps(&pinned, &mut dev, &stream))
        .collect::<Result<Vec<_>>>()?;
    Ok(crate::util::Samples::new(runs))
}

fn row(s: &mut String, path: &str, r: &RunReport, gpu: Option<&GpuReport>) {
    use std::fmt::Write;
    let l = &r.latency;
    let extra = gpu.map_or(String::new(), |g| {
        format!(" {:.3} | {:.3} | {} |", g.copy_ms, g.kernel_ms, g.checked)
    });
    let _ = writeln!(
        s,
        "| {path} | {:.2} | {:.2} | {:.2} | {} | {} | {:.0}% | {:.1} |{extra}",
        l.p50_ms,
        l.p99_ms,
        l.max_ms,
        l.dropped,
        l.late,
        100.0 * r.busy_fraction,
        r.frames_per_s
    );
}

pub fn table(s: &mut String, b: &FramesBench) {
    use std::fmt::Write;
    let _ = writeln!(
        s,
        "\n## Table 12 — the real-time frame pipeline (case study 6.2)\n\n\
         On the CPU: {}x{} RGB8 frames captured at {} fps by a producer process, {} per path, each \
         transformed to planar f32 on the CPU. Latency runs from capture (the producer's \
         `CLOCK_MONOTONIC`) to the transform's end; late: more than one frame interval; busy: \
         the transform's time over the run's.\n\n\
         | path | p50 ms | p99 ms | max ms | dropped | late | busy | frames/s |\n\
         |---|---|---|---|---|---|---|---|",
        b.format.width, b.format.height, b.fps, b.frames
    );
    row(
        s,
        "shared-memory ring (`gpufeed::frames`, zero-copy slots)",
        &b.ring,
        None,
    );
    row(s, "pipe into a pageable buffer (baseline)", &b.pipe, None);
    row(
        s,
        "the ring, frames as fast as the consumer takes them (sustained rate)",
        &b.sustained,
        None,
    );
    let Some(g) = &b.gpu else {
        let _ = writeln!(s, "\nThe GPU rows: not measured (no GPU here).");
        return;
    };
    let frame = g.format.bytes() as f64;
    let wire_fps = g.wire_gbps.median * 1e9 / frame;
    let _ = writeln!(
        s,
        "\nOn GPU 0: {}x{} RGB8 frames ({:.1} MB) at {} fps, {} per path; each copied to the GPU and \
         transformed there by the planar kernel (`GpuFrames`: copies from the registered ring, \
         two frames in flight); latency to the kernel's end; busy: the GPU's copies and kernels \
         (CUDA events, overlaps once) over the run's time; every {}th frame's result checked \
         against the CPU's. Targets (issue 21): none dropped, p99 <= 2 ms, sustained >= 0.9 of \
         the frames per second the link carries.\n\n\
         | path | p50 ms | p99 ms | max ms | dropped | late | busy | frames/s | copy ms | kernel ms | checked |\n\
         |---|---|---|---|---|---|---|---|---|---|---|",
        g.format.width,
        g.format.height,
        frame / 1e6,
        g.fps,
        g.frames,
        CHECK_EVERY
    );
    row(
        s,
        &format!(
            "registered ring, double buffered (producer dropped {})",
            g.ring_producer_dropped
        ),
        &g.ring.run,
        Some(&g.ring),
    );
    row(
        s,
        "pipe into a pageable buffer, staged copy (baseline)",
        &g.pipe.run,
        Some(&g.pipe),
    );
    row(
        s,
        &format!(
            "the ring, {} frames as fast as the consumer takes them (the producer paints the checked rows)",
            g.sustained_frames
        ),
        &g.sustained.run,
        Some(&g.sustained),
    );
    let _ = writeln!(
        s,
        "\nThe link: {} GB/s from pinned memory, {:.0} frames per second of this size; sustained \
         {:.0} = {:.0}% of it. Copies from registered memory: {}.",
        g.wire_gbps.show(1),
        wire_fps,
        g.sustained.run.frames_per_s,
        100.0 * g.sustained.run.frames_per_s / wire_fps,
        g.ring.registered
    );
}
