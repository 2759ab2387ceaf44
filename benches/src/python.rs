//! Table 10 (`--only python`, or with `--peers` on the GPU machine): gpufeed's Python package
//! against `safetensors.torch` on a warm checkpoint (16 GiB by default: the size the Python
//! package's targets are stated at) and on the same bytes in 10,000 tensors, with a reused
//! loader and in fresh processes, plus the cost of each tensor (10,000 x 16 KiB against
//! 10 x 16,000 KiB), and tensors loaded one at a time (`gpufeed.safe_open` against
//! safetensors' `safe_open`). Measured by `benches/peers/peers.py --python-checkpoints`; the
//! drop-in rows by `benches/peers/dropin.py`, the model rows by `benches/peers/models.py`
//! ([`crate::models`]).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use gpufeed_os::cache;

use crate::util::{Samples, error_at, samples_at, show_size};

/// Tensors of the "many tensors" checkpoint.
pub const MANY: usize = 10_000;

/// Table 10's figures; `None` where that part could not run (its error in `errors`).
#[derive(Debug, Serialize)]
pub struct PythonBench {
    /// Bytes of each checkpoint.
    pub checkpoint_bytes: u64,
    /// gpufeed `Loader.load_safetensors`, reused loader, 16 tensors: GB/s.
    pub gpufeed_reused_gbps: Option<Samples>,
    /// The same on the same bytes in [`MANY`] tensors.
    pub gpufeed_many_gbps: Option<Samples>,
    /// `safetensors.torch.load_file(device="cuda")` in the measuring process: GB/s.
    pub safetensors_reused_gbps: Option<Samples>,
    /// Fresh processes, after the CUDA context (torch's, which gpufeed shares): GB/s.
    pub gpufeed_fresh_gbps: Option<Samples>,
    pub safetensors_fresh_gbps: Option<Samples>,
    /// Fresh processes, the CUDA context and the load together: GB/s.
    pub gpufeed_fresh_with_context_gbps: Option<Samples>,
    pub safetensors_fresh_with_context_gbps: Option<Samples>,
    /// Seconds to load 10 tensors of 16,000 KiB, and 10,000 of 16 KiB (the same bytes).
    pub few_large_seconds: Option<Samples>,
    pub many_small_seconds: Option<Samples>,
    /// Tensors one at a time, the file opened beforehand: gpufeed's drop-in `safe_open`
    /// and safetensors' `safe_open(framework="pt", device="cuda:0")`, `get_tensor` of
    /// each of the 16 tensors, and of the first 1,000 of the [`MANY`]: GB/s.
    pub gpufeed_on_demand_gbps: Option<Samples>,
    pub safetensors_on_demand_gbps: Option<Samples>,
    pub gpufeed_on_demand_many_gbps: Option<Samples>,
    pub safetensors_on_demand_many_gbps: Option<Samples>,
    /// Seconds `gpufeed.safe_open` of the 16-tensor checkpoint took (headers, registration).
    pub gpufeed_open_seconds: Option<Samples>,
    /// Fresh processes: every tensor of the 16-tensor checkpoint through `safe_open` (the open
    /// included), after the CUDA context and with it: GB/s.
    pub gpufeed_safe_open_fresh_gbps: Option<Samples>,
    pub safetensors_safe_open_fresh_gbps: Option<Samples>,
    pub gpufeed_safe_open_fresh_with_context_gbps: Option<Samples>,
    pub safetensors_safe_open_fresh_with_context_gbps: Option<Samples>,
    /// The drop-in rows (`benches/peers/dropin.py`): per checkpoint, each way a framework
    /// loads it, in fresh processes and loaded again in one.
    pub dropin: Vec<DropinFile>,
    /// The model rows (`benches/peers/models.py`): a sharded Llama-architecture model made
    /// ready by transformers and by gpufeed.
    pub models: crate::models::ModelsBench,
    /// Table 10's cast rows (`benches/peers/casts.py`).
    pub casts: crate::casts::CastsBench,
    /// Parts that did not run, with the reason.
    pub errors: Vec<(String, String)>,
}

/// One checkpoint of the drop-in rows.
#[derive(Debug, Serialize)]
pub struct DropinFile {
    pub bytes: u64,
    pub tensors: usize,
    /// Method, then GB/s in fresh processes (after torch's context), GB/s of the third load in
    /// one process, and the checksums of what was loaded (one value where all runs agree); or
    /// why it did not run.
    pub rows: Vec<(String, Result<DropinRow, String>)>,
}

/// One way of loading a checkpoint, measured.
#[derive(Debug, Serialize)]
pub struct DropinRow {
    pub fresh_gbps: Samples,
    pub again_gbps: Samples,
    pub checksums: Vec<u64>,
    /// For the rows that write into preallocated tensors: the device memory a load took
    /// beyond them at its peak (MiB, the most over the processes' second loads; the driver's
    /// free memory sampled every millisecond).
    pub extra_mib: Option<f64>,
}

/// The drop-in checkpoints: 8 GiB in 32 tensors and 4 GiB in 4,096 (the setting), at
/// `scale` of those sizes (1.0 on the GPU machine).
fn dropin(
    dir: &Path,
    reps: usize,
    scale: f64,
    progress: &mut impl FnMut(&str),
) -> Result<Vec<DropinFile>> {
    let mut files = Vec::new();
    for (bytes, tensors) in [(8u64 << 30, 32usize), (4 << 30, 4096)] {
        let bytes = ((bytes as f64 * scale) as u64).max(tensors as u64 * 4096);
        let path = dir.join(format!("dropin-{bytes}-{tensors}.safetensors"));
        crate::facade::ensure_safetensors(&path, bytes, tensors)?;
        cache::warm(&path)?;
        files.push((path, tensors));
    }
    progress("table 10: the drop-in paths against safetensors 0.9 (dropin.py)");
    let mut args = vec![reps.to_string()];
    args.extend(files.iter().map(|(p, _)| p.display().to_string()));
    let out = crate::gpu::run_script(Path::new("benches/peers/dropin.py"), &args);
    let mut result = Vec::new();
    for (path, tensors) in files {
        let entry = out.get(path.display().to_string());
        let mut rows = Vec::new();
        let listed = entry
            .and_then(|e| e.get("rows"))
            .and_then(|r| r.as_object());
        let Some(listed) = listed else {
            let why = error_at(out.get("peers"), "no rows in the script's output");
            rows.push(("dropin.py".to_owned(), Err(why)));
            result.push(DropinFile {
                bytes: std::fs::metadata(&path).map_or(0, |m| m.len()),
                tensors,
                rows,
            });
            continue;
        };
        for (method, v) in listed {
            let row = match (samples_at(v, "fresh"), samples_at(v, "again")) {
                (Some(fresh_gbps), Some(again_gbps)) => Ok(DropinRow {
                    fresh_gbps,
                    again_gbps,
                    checksums: v
                        .get("checksum")
                        .and_then(|c| c.as_array())
                        .map(|c| c.iter().filter_map(|x| x.as_u64()).collect())
                        .unwrap_or_default(),
                    extra_mib: v.get("extra_mib").and_then(|x| x.as_f64()),
                }),
                _ => Err(error_at(Some(v), "no figure")),
            };
            rows.push((method.clone(), row));
        }
        result.push(DropinFile {
            bytes: std::fs::metadata(&path).map_or(0, |m| m.len()),
            tensors,
            rows,
        });
    }
    Ok(result)
}

impl PythonBench {
    /// The cost of one tensor: the 10,000 small tensors' time less the 10 large ones', per
    /// tensor, in microseconds.
    pub fn per_tensor_us(&self) -> Option<f64> {
        let (few, many) = (
            self.few_large_seconds.as_ref()?,
            self.many_small_seconds.as_ref()?,
        );
        Some((many.median - few.median) / (MANY - 10) as f64 * 1e6)
    }
}

/// Writes (once) and warms the two checkpoints of `bytes` under `dir`, then runs the Python
/// side. `None` without a GPU.
pub fn measure(
    dir: &Path,
    bytes: u64,
    reps: usize,
    mut progress: impl FnMut(&str),
) -> Result<Option<PythonBench>> {
    if crate::gpu::open_gpu(&mut progress)?.is_none() {
        return Ok(None);
    }
    progress(&format!(
        "table 10: checkpoints of {} in 16 and in {MANY} tensors",
        crate::util::show_size(bytes)
    ));
    let few = dir.join(format!("model-{bytes}.safetensors"));
    let many = dir.join(format!("model-{bytes}-{MANY}.safetensors"));
    let checkpoint_bytes = crate::facade::ensure_safetensors(&few, bytes, 16)?;
    crate::facade::ensure_safetensors(&many, bytes, MANY)?;
    cache::warm(&few)?;
    cache::warm(&many)?;
    progress("table 10: the Python package against safetensors.torch (peers.py)");
    let out = crate::gpu::run_peer_script(&[
        "--python-checkpoints".into(),
        few.display().to_string(),
        many.display().to_string(),
        reps.to_string(),
    ]);
    let scale = if bytes >= 8 << 30 {
        1.0
    } else {
        bytes as f64 / (8u64 << 30) as f64
    };
    // A failure here (the disk full while writing the files) is a row, not the end of the
    // figures measured before.
    let dropin = dropin(dir, reps, scale, &mut progress).unwrap_or_else(|e| {
        vec![DropinFile {
            bytes: 0,
            tensors: 0,
            rows: vec![("dropin.py".to_owned(), Err(format!("{e:#}")))],
        }]
    });
    let models = crate::models::measure(dir, reps, scale, &mut progress);
    let casts = crate::casts::measure(dir, reps, scale, &mut progress);
    let mut errors = Vec::new();
    let mut get = |key: &str| -> Option<Samples> {
        let v = out.get(key).or_else(|| out.get("peers"));
        match v.and_then(|v| v.as_array()) {
            Some(runs) => Some(Samples::new(
                runs.iter().filter_map(|x| x.as_f64()).collect(),
            )),
            None => {
                let why = v
                    .and_then(|v| v.get("error"))
                    .and_then(|e| e.as_str())
                    .unwrap_or("no figure in the script's output");
                errors.push((key.to_owned(), why.to_owned()));
                None
            }
        }
    };
    Ok(Some(PythonBench {
        checkpoint_bytes,
        gpufeed_reused_gbps: get("gpufeed reused"),
        gpufeed_many_gbps: get("gpufeed reused, 10000 tensors"),
        safetensors_reused_gbps: get("safetensors reused"),
        gpufeed_fresh_gbps: get("gpufeed fresh"),
        safetensors_fresh_gbps: get("safetensors fresh"),
        gpufeed_fresh_with_context_gbps: get("gpufeed fresh with context"),
        safetensors_fresh_with_context_gbps: get("safetensors fresh with context"),
        few_large_seconds: get("seconds, 10 tensors of 16000 KiB"),
        many_small_seconds: get("seconds, 10000 tensors of 16 KiB"),
        gpufeed_on_demand_gbps: get("gpufeed safe_open, 16 tensors"),
        safetensors_on_demand_gbps: get("safetensors safe_open, 16 tensors"),
        gpufeed_on_demand_many_gbps: get("gpufeed safe_open, 1000 of 10000 tensors"),
        safetensors_on_demand_many_gbps: get("safetensors safe_open, 1000 of 10000 tensors"),
        gpufeed_open_seconds: get("seconds, gpufeed safe_open open"),
        gpufeed_safe_open_fresh_gbps: get("gpufeed safe_open fresh"),
        safetensors_safe_open_fresh_gbps: get("safetensors safe_open fresh"),
        gpufeed_safe_open_fresh_with_context_gbps: get("gpufeed safe_open fresh with context"),
        safetensors_safe_open_fresh_with_context_gbps: get(
            "safetensors safe_open fresh with context",
        ),
        dropin,
        models,
        casts,
        errors,
    }))
}

/// Table 10: the Python package against safetensors.torch.
pub fn table(s: &mut String, v: &PythonBench) {
    let _ = writeln!(
        s,
        "\n## Table 10 — the Python package: a {} safetensors checkpoint into a dict of torch \
         tensors (warm)\n\n\
         Time from the call until every tensor is on `cuda:0`, synchronized. *Fresh process*: a \
         new Python process that has imported torch and created the CUDA context (timed apart), \
         then loads once. The 10,000-tensor checkpoint holds the same bytes as the 16-tensor \
         one.\n\n| load | GB/s | against |\n|---|---|---|",
        show_size(v.checkpoint_bytes)
    );
    let gbps = |x: &Option<crate::util::Samples>| {
        x.as_ref().map_or("did not run".to_owned(), |x| x.show(1))
    };
    let times =
        |a: &Option<crate::util::Samples>, b: &Option<crate::util::Samples>, what: &str| match (
            a, b,
        ) {
            (Some(a), Some(b)) => format!("{:.1}x {what}", a.median / b.median),
            _ => "-".to_owned(),
        };
    let st = "safetensors.torch";
    let rows = [
        (
            "gpufeed `Loader.load_safetensors`, reused loader, 16 tensors",
            &v.gpufeed_reused_gbps,
            times(&v.gpufeed_reused_gbps, &v.safetensors_reused_gbps, st),
        ),
        (
            "the same, the same bytes in 10,000 tensors",
            &v.gpufeed_many_gbps,
            match (&v.gpufeed_reused_gbps, &v.gpufeed_many_gbps) {
                (Some(few), Some(many)) => format!(
                    "takes {:.2}x the 16 tensors' time",
                    few.median / many.median
                ),
                _ => "-".to_owned(),
            },
        ),
        (
            "`safetensors.torch.load_file(device=\"cuda\")`, same process",
            &v.safetensors_reused_gbps,
            String::new(),
        ),
        (
            "fresh process, after the context: gpufeed `load_safetensors`",
            &v.gpufeed_fresh_gbps,
            times(&v.gpufeed_fresh_gbps, &v.safetensors_fresh_gbps, st),
        ),
        (
            "fresh process, after the context: `safetensors.torch.load_file`",
            &v.safetensors_fresh_gbps,
            String::new(),
        ),
        (
            "fresh process, context + load: gpufeed",
            &v.gpufeed_fresh_with_context_gbps,
            times(
                &v.gpufeed_fresh_with_context_gbps,
                &v.safetensors_fresh_with_context_gbps,
                st,
            ),
        ),
        (
            "fresh process, context + load: safetensors.torch",
            &v.safetensors_fresh_with_context_gbps,
            String::new(),
        ),
        (
            "tensors on demand: `gpufeed.safe_open(...).get_tensor` of each of the 16, file opened before",
            &v.gpufeed_on_demand_gbps,
            times(
                &v.gpufeed_on_demand_gbps,
                &v.safetensors_on_demand_gbps,
                "safetensors' safe_open",
            ),
        ),
        (
            "tensors on demand: safetensors `safe_open(framework=\"pt\", device=\"cuda:0\").get_tensor`, the 16",
            &v.safetensors_on_demand_gbps,
            String::new(),
        ),
        (
            "tensors on demand: `gpufeed.safe_open`, the first 1,000 of the 10,000 tensors",
            &v.gpufeed_on_demand_many_gbps,
            times(
                &v.gpufeed_on_demand_many_gbps,
                &v.safetensors_on_demand_many_gbps,
                "safetensors' safe_open",
            ),
        ),
        (
            "tensors on demand: safetensors `safe_open`, the first 1,000 of the 10,000 tensors",
            &v.safetensors_on_demand_many_gbps,
            String::new(),
        ),
        (
            "fresh process, after the context: every tensor through `gpufeed.safe_open` (the open included)",
            &v.gpufeed_safe_open_fresh_gbps,
            times(
                &v.gpufeed_safe_open_fresh_gbps,
                &v.safetensors_safe_open_fresh_gbps,
                "safetensors' safe_open",
            ),
        ),
        (
            "fresh process, after the context: every tensor through safetensors' `safe_open`",
            &v.safetensors_safe_open_fresh_gbps,
            String::new(),
        ),
        (
            "fresh process, context + every tensor through `gpufeed.safe_open`",
            &v.gpufeed_safe_open_fresh_with_context_gbps,
            times(
                &v.gpufeed_safe_open_fresh_with_context_gbps,
                &v.safetensors_safe_open_fresh_with_context_gbps,
                "safetensors' safe_open",
            ),
        ),
        (
            "fresh process, context + every tensor through safetensors' `safe_open`",
            &v.safetensors_safe_open_fresh_with_context_gbps,
            String::new(),
        ),
    ];
    for (what, x, against) in rows {
        let _ = writeln!(s, "| {what} | {} | {against} |", gbps(x));
    }
    if let (Some(us), Some(few), Some(many)) = (
        v.per_tensor_us(),
        &v.few_large_seconds,
        &v.many_small_seconds,
    ) {
        let _ = writeln!(
            s,
            "\nPer tensor: 10,000 tensors of 16 KiB load in {:.1} ms, the same bytes in 10 \
             tensors in {:.1} ms: {us:.2} us per tensor (medians of {}).",
            many.median * 1e3,
            few.median * 1e3,
            many.all.len()
        );
    }
    if let Some(open) = &v.gpufeed_open_seconds {
        let _ = writeln!(
            s,
            "\n`gpufeed.safe_open` of the 16-tensor checkpoint (its header read and checked; \
             paid once per open, not in the on-demand rows) took {:.2} ms.",
            open.median * 1e3
        );
    }
    for (what, why) in &v.errors {
        let _ = writeln!(s, "\n{what}: did not run: {why}");
    }
    dropin_table(s, &v.dropin);
    crate::models::table(s, &v.models);
    crate::casts::table(s, &v.casts);
}

/// The drop-in rows: each way a framework loads a checkpoint to `cuda:0`, in one table per
/// checkpoint, against safetensors 0.9's `prefetch(threads=16)`.
fn dropin_table(s: &mut String, files: &[DropinFile]) {
    for f in files {
        let _ = writeln!(
            s,
            "\n### Table 10, drop-in paths: {} in {} tensors to `cuda:0` (warm)\n\n\
             *Fresh*: a new process that created torch's CUDA context before the clock, the \
             open included; *again*: the third load in that process. Checksums of the bytes \
             loaded are compared across methods.\n\n\
             | method | fresh GB/s | against prefetch(16) | again GB/s | against prefetch(16) |\n\
             |---|---|---|---|---|",
            show_size(f.bytes),
            f.tensors
        );
        let peer = f.rows.iter().find_map(|(m, r)| {
            (m == "safetensors prefetch threads=16")
                .then_some(r.as_ref().ok())
                .flatten()
        });
        let mut sums = std::collections::BTreeSet::new();
        for (method, row) in &f.rows {
            match row {
                Ok(r) => {
                    sums.extend(r.checksums.iter().copied());
                    let x = |a: &Samples, b: Option<&Samples>| {
                        b.map_or(String::new(), |b| format!("{:.2}x", a.median / b.median))
                    };
                    let _ = writeln!(
                        s,
                        "| {method} | {} | {} | {} | {} |",
                        r.fresh_gbps.show(1),
                        x(&r.fresh_gbps, peer.map(|p| &p.fresh_gbps)),
                        r.again_gbps.show(1),
                        x(&r.again_gbps, peer.map(|p| &p.again_gbps)),
                    );
                }
                Err(why) => {
                    let _ = writeln!(s, "| {method} | did not run: {why} | | | |");
                }
            }
        }
        for (method, row) in &f.rows {
            if let Ok(DropinRow {
                extra_mib: Some(mib),
                ..
            }) = row
            {
                let _ = writeln!(
                    s,
                    "\n{method}: into tensors allocated before the clock; device memory taken \
                     beyond them during a load, at its peak: {mib:.0} MiB."
                );
            }
        }
        let _ = writeln!(
            s,
            "\nChecksums: {}.",
            if sums.len() <= 1 {
                "equal across every method that ran".to_owned()
            } else {
                format!("DIFFER ({} values)", sums.len())
            }
        );
    }
}
