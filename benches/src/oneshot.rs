//! One-shot loads (issue 14): what a user who loads once at start-up sees. The harness runs
//! itself again as a fresh process (`one-shot`), which opens the GPU, makes a new `Loader`, and
//! loads the same file twice, timing each step; the parent reports the first load beside the
//! second. With `GPUFEED_BENCH_ONESHOT_PARTS=1` the child also times the pieces a first load
//! pays for that a second does not (printed to stderr).

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use gpufeed::{Gpu, LoadOptions, Loader};
use serde::{Deserialize, Serialize};

use crate::util::gbps;

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
    /// The same loader's second load.
    pub second_ms: f64,
}

impl OneShotRun {
    pub fn first_gbps(&self) -> f64 {
        gbps(self.bytes, self.first_ms / 1e3)
    }
    pub fn second_gbps(&self) -> f64 {
        gbps(self.bytes, self.second_ms / 1e3)
    }
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
    if std::env::var_os("GPUFEED_BENCH_ONESHOT_PARTS").is_some() {
        parts(&gpu, path.metadata()?.len())?;
    }
    let t = Instant::now();
    let loader = Loader::new(&gpu, LoadOptions::default())?;
    let loader_ms = ms_since(t);
    let load = || -> Result<(u64, f64)> {
        let t = Instant::now();
        let bytes = if checkpoint {
            gpufeed::safetensors::load_with(&loader, path)?.bytes()
        } else {
            loader.load_file(path)?.0.len() as u64
        };
        Ok((bytes, ms_since(t)))
    };
    let (bytes, first_ms) = load()?;
    let (_, second_ms) = load()?;
    let run = OneShotRun {
        bytes,
        open_ms,
        loader_ms,
        first_ms,
        second_ms,
    };
    println!("{}", serde_json::to_string(&run)?);
    Ok(())
}

/// Times, in this fresh context, what a first load pays for: device memory of the file's size
/// (first and second time), 32 pinned staging buffers of 4 MiB from `cuMemHostAlloc` (first
/// and second time, through a pool), and the same 128 MiB registered with `cuMemHostRegister`.
fn parts(gpu: &Gpu, len: u64) -> Result<()> {
    use gpufeed::pinned::{HostRegistration, PinnedPool, PoolConfig, PoolMode};
    for round in ["first", "second"] {
        let t = Instant::now();
        let dev = gpu.alloc_zeroed(len as usize)?;
        eprintln!(
            "PARTS {round} device alloc of {len} B: {:.1} ms",
            ms_since(t)
        );
        drop(dev);
    }
    let pool = PinnedPool::new(PoolMode::Cuda(gpu.context().clone()), PoolConfig::default())?;
    for round in ["first", "second"] {
        let t = Instant::now();
        let bufs = (0..32)
            .map(|_| pool.get(4 << 20))
            .collect::<gpufeed::pinned::Result<Vec<_>>>()?;
        eprintln!(
            "PARTS {round} 32 x 4 MiB staging from the pool: {:.1} ms",
            ms_since(t)
        );
        drop(bufs);
    }
    let host = gpufeed::os::AlignedBuf::new(128 << 20, 2 << 20)?;
    let t = Instant::now();
    let reg = HostRegistration::slice(gpu.context(), &host)?;
    eprintln!(
        "PARTS cuMemHostRegister of 128 MiB of fresh aligned memory: {:.1} ms",
        ms_since(t)
    );
    drop(reg);
    Ok(())
}

/// The parent: `reps` fresh processes for `path`.
pub fn measure(path: &Path, checkpoint: bool, reps: usize) -> Result<Vec<OneShotRun>> {
    let exe = std::env::current_exe()?;
    (0..reps)
        .map(|_| {
            let mut cmd = std::process::Command::new(&exe);
            cmd.arg("one-shot").arg("--path").arg(path);
            if checkpoint {
                cmd.arg("--checkpoint");
            }
            let out = cmd.output().context("run the one-shot child")?;
            anyhow::ensure!(
                out.status.success(),
                "one-shot child failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let stderr = String::from_utf8_lossy(&out.stderr);
            for line in stderr.lines().filter(|l| l.starts_with("PARTS")) {
                eprintln!("{line}");
            }
            let line = String::from_utf8_lossy(&out.stdout);
            serde_json::from_str(line.trim()).context("the one-shot child's JSON")
        })
        .collect()
}
