//! One-shot loads (issue 14): what a user who loads once at start-up sees. The harness runs
//! itself again as a fresh process (`one-shot`), which opens the GPU, makes a new `Loader`, and
//! loads the same file twice, timing each step; the parent reports the first load beside the
//! second. (What a first load pays for that a second does not, part by part, was measured in GPU
//! runs 8-13 and is kept in docs/benchmarks.md.)

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use gpufeed::{Gpu, LoadOptions, Loader};
use serde::{Deserialize, Serialize};

use crate::util::{gbps, show_size};

/// What one fresh process measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OneShotRun {
    /// Bytes loaded (the file, or the checkpoint's tensors).
    pub bytes: u64,
    /// `Gpu::open(0)`: driver load and primary context.
    pub open_ms: f64,
    /// `Loader::new`.
    pub loader_ms: f64,
    /// The first load of that loader.
    pub first_ms: f64,
    /// The same loader's second load (its device memory grows the context's pool).
    pub second_ms: f64,
    /// The third: warm (staging and device memory reused), the steady state.
    pub third_ms: f64,
}

impl OneShotRun {
    pub fn first_gbps(&self) -> f64 {
        gbps(self.bytes, self.first_ms / 1e3)
    }
    pub fn second_gbps(&self) -> f64 {
        gbps(self.bytes, self.second_ms / 1e3)
    }
    pub fn third_gbps(&self) -> f64 {
        gbps(self.bytes, self.third_ms / 1e3)
    }
}

/// What a load returned, dropped once the clock has stopped.
#[allow(dead_code, reason = "held for its Drop")]
enum Held {
    Buffer(gpufeed::DeviceBuffer),
    Checkpoint(gpufeed::safetensors::Checkpoint),
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// The child: open, new loader, two loads of `path` (a safetensors checkpoint if `checkpoint`),
/// one JSON line on stdout.
pub fn child(path: &Path, checkpoint: bool) -> Result<()> {
    let t = Instant::now();
    let gpu = Gpu::open(0)?;
    let open_ms = ms_since(t);
    let t = Instant::now();
    let loader = Loader::new(&gpu, LoadOptions::default())?;
    let loader_ms = ms_since(t);
    // Timed until the data is on the GPU; the buffers are freed after the clock stops (a user
    // keeps them).
    let load = || -> Result<(u64, f64)> {
        let t = Instant::now();
        let (bytes, ms, held) = if checkpoint {
            let c = gpufeed::safetensors::load_with(&loader, path)?;
            (c.bytes(), ms_since(t), Held::Checkpoint(c))
        } else {
            let (b, _) = loader.load_file(path)?;
            (b.len() as u64, ms_since(t), Held::Buffer(b))
        };
        drop(held);
        Ok((bytes, ms))
    };
    let (bytes, first_ms) = load()?;
    let (_, second_ms) = load()?;
    let (_, third_ms) = load()?;
    let run = OneShotRun {
        bytes,
        open_ms,
        loader_ms,
        first_ms,
        second_ms,
        third_ms,
    };
    println!("{}", serde_json::to_string(&run)?);
    Ok(())
}

/// What one fresh process measured with the overlapped one-shot API (`load_file_on`,
/// `safetensors::load_on`), and the speed of a warm second load in the same process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OnRun {
    pub bytes: u64,
    /// The context's creation, on its own thread.
    pub context_ms: f64,
    /// From the call until the loader was ready.
    pub ready_ms: f64,
    /// The loads themselves.
    pub load_ms: f64,
    /// From the call to the end (staging released).
    pub total_ms: f64,
    pub staging_bytes: u64,
    /// A warm load of the same bytes (a loader's third, same process): the steady state.
    pub second_ms: f64,
}

impl OnRun {
    /// Time past the context over the time a warm second load takes: issue 14's target is
    /// at most 1.1.
    pub fn past_context_ratio(&self) -> f64 {
        (self.total_ms - self.context_ms) / self.second_ms
    }
    pub fn total_gbps(&self) -> f64 {
        gbps(self.bytes, self.total_ms / 1e3)
    }
}

/// The child of the overlapped one-shot: `load_file_on(0, path)` or `safetensors::load_on`,
/// then a warm second load's time; one JSON line on stdout.
pub fn child_on(path: &Path, checkpoint: bool) -> Result<()> {
    let (gpu, bytes, r) = if checkpoint {
        let (ckpt, r) = gpufeed::safetensors::load_on(0, path)?;
        (ckpt.gpu().clone(), ckpt.bytes(), r)
    } else {
        let (gpu, buf, r) = gpufeed::load_file_on(0, path)?;
        (gpu, buf.len() as u64, r)
    };
    // The same bytes through a warm loader (staging and device memory reused: its third load).
    let loader = Loader::new(&gpu, LoadOptions::default())?;
    let mut second_ms = 0.0;
    for _ in 0..3 {
        let t = Instant::now();
        let held = if checkpoint {
            Held::Checkpoint(gpufeed::safetensors::load_with(&loader, path)?)
        } else {
            Held::Buffer(loader.load_file(path)?.0)
        };
        second_ms = ms_since(t);
        drop(held);
    }
    let run = OnRun {
        bytes,
        context_ms: r.context_seconds * 1e3,
        ready_ms: r.ready_seconds * 1e3,
        load_ms: r.load_seconds * 1e3,
        total_ms: r.total_seconds * 1e3,
        staging_bytes: r.staging_bytes,
        second_ms,
    };
    println!("{}", serde_json::to_string(&run)?);
    Ok(())
}

/// `reps` fresh processes of the overlapped one-shot for `path`.
pub fn measure_on(path: &Path, checkpoint: bool, reps: usize) -> Result<Vec<OnRun>> {
    children(path, checkpoint, true, reps)
}

/// Runs this binary again with `args`; its stdout.
fn run_self(args: &[std::ffi::OsString]) -> Result<String> {
    let exe = std::env::current_exe()?;
    let out = std::process::Command::new(&exe)
        .args(args)
        .output()
        .context("run the one-shot child")?;
    anyhow::ensure!(
        out.status.success(),
        "one-shot child failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The parent: `reps` fresh processes for `path`.
pub fn measure(path: &Path, checkpoint: bool, reps: usize) -> Result<Vec<OneShotRun>> {
    children(path, checkpoint, false, reps)
}

/// `reps` fresh `one-shot` children for `path` (`--on`: the overlapped API), each one JSON line.
fn children<T: serde::de::DeserializeOwned>(
    path: &Path,
    checkpoint: bool,
    on: bool,
    reps: usize,
) -> Result<Vec<T>> {
    (0..reps)
        .map(|_| {
            let mut args: Vec<std::ffi::OsString> =
                vec!["one-shot".into(), "--path".into(), path.into()];
            if checkpoint {
                args.push("--checkpoint".into());
            }
            if on {
                args.push("--on".into());
            }
            let line = run_self(&args)?;
            serde_json::from_str(line.trim()).context("the one-shot child's JSON")
        })
        .collect()
}

/// One-shot loads: a fresh process per run (medians over the runs, min-max in parentheses).
pub fn table(s: &mut String, f: &crate::facade::FacadeBench) {
    let _ = writeln!(
        s,
        "\n### One-shot: a fresh process opens the GPU, makes a `Loader` and loads three times (warm page cache)\n\n\
         | what | `Gpu::open` ms | `Loader::new` ms (staging reserved) | first load GB/s | second load GB/s (device pool grows) | third load GB/s (warm) | first / third |\n\
         |---|---|---|---|---|---|---|"
    );
    for (what, runs) in [
        ("file (`Loader::load_file`)", &f.one_shot_file),
        (
            "safetensors checkpoint (`safetensors::load_with`)",
            &f.one_shot_checkpoint,
        ),
    ] {
        if runs.is_empty() {
            continue;
        }
        let col =
            |g: fn(&OneShotRun) -> f64| crate::util::Samples::new(runs.iter().map(g).collect());
        let (first, second, third) = (
            col(OneShotRun::first_gbps),
            col(OneShotRun::second_gbps),
            col(OneShotRun::third_gbps),
        );
        let _ = writeln!(
            s,
            "| {what}, {} | {} | {} | {} | {} | {} | {:.2} |",
            show_size(runs[0].bytes),
            col(|r| r.open_ms).show(0),
            col(|r| r.loader_ms).show(1),
            first.show(1),
            second.show(1),
            third.show(1),
            first.median / third.median
        );
    }
    let _ = writeln!(
        s,
        "\n### One-shot in one call: `load_file_on(0, path)` / `safetensors::load_on(0, path)` in a fresh process \
         (the context created on another thread while the staging is faulted in and headers read)\n\n\
         | what | context ms | ready ms | loads ms | total ms | GB/s from the call | warm load ms (same process) | (total - context) / warm (target <= 1.1) | staging |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    for (what, runs) in [
        ("file (`load_file_on`)", &f.one_shot_on_file),
        (
            "safetensors checkpoint (`safetensors::load_on`)",
            &f.one_shot_on_checkpoint,
        ),
    ] {
        if runs.is_empty() {
            continue;
        }
        let col = |g: fn(&OnRun) -> f64| crate::util::Samples::new(runs.iter().map(g).collect());
        let _ = writeln!(
            s,
            "| {what}, {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            show_size(runs[0].bytes),
            col(|r| r.context_ms).show(0),
            col(|r| r.ready_ms).show(0),
            col(|r| r.load_ms).show(1),
            col(|r| r.total_ms).show(0),
            col(OnRun::total_gbps).show(1),
            col(|r| r.second_ms).show(1),
            col(OnRun::past_context_ratio).show(2),
            show_size(runs[0].staging_bytes)
        );
    }
}
