//! Table 10 (`--only python`, or with `--peers` on the GPU machine): gpufeed's Python package
//! against `safetensors.torch` on a warm checkpoint (16 GiB by default: the size the Python
//! package's targets are stated at) and on the same bytes in 10,000 tensors, with a reused
//! loader and in fresh processes, plus the cost of each tensor (10,000 x 16 KiB against
//! 10 x 16,000 KiB), and tensors loaded one at a time (`gpufeed.safe_open` against
//! safetensors' `safe_open`). Measured by `benches/peers/peers.py --python-checkpoints`.

use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use gpufeed_os::cache;

use crate::util::Samples;

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
    /// Tensors one at a time, the file opened beforehand: gpufeed's `safe_open` (registered
    /// files) and safetensors' `safe_open(framework="pt", device="cuda:0")`, `get_tensor` of
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
    /// Parts that did not run, with the reason.
    pub errors: Vec<(String, String)>,
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
        errors,
    }))
}
