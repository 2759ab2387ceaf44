//! Table 10's model rows (with table 10, on the GPU machine): a Llama-architecture model saved
//! by transformers in shards (hidden 4096, 16 layers, 6.2 GB in bfloat16, 4 shards at full
//! scale), made ready on `cuda:0` in fresh processes by transformers' `from_pretrained` and by
//! `gpufeed.transformers.from_pretrained`, beside `gpufeed.load_safetensors` of the shards'
//! index and of one file of the same tensors. Measured by `benches/peers/models.py`.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::util::{Samples, error_at, samples_at, show_size};

/// The model rows' figures.
#[derive(Debug, Serialize)]
pub struct ModelsBench {
    /// Bytes of the shards together.
    pub bytes: u64,
    /// Shard files.
    pub shards: usize,
    /// Method, then seconds and GB/s in fresh processes (after torch's context) and the
    /// digests of the models made (the logits of a fixed input and a checksum of each
    /// parameter); or why it did not run.
    pub rows: Vec<(String, Result<ModelRow, String>)>,
}

/// One way of making the model ready, measured.
#[derive(Debug, Serialize)]
pub struct ModelRow {
    pub seconds: Samples,
    pub gbps: Samples,
    pub digests: Vec<String>,
}

/// The suffix of models.py's rows that import the model's module before the clock.
const CODE_IMPORTED: &str = " (model code imported)";

/// The layers of the model at `scale` of the GPU machine's 8 GiB drop-in files (16 at 1.0).
fn layers(scale: f64) -> usize {
    ((16.0 * scale).round() as usize).clamp(1, 16)
}

/// Makes the model under `dir` (once) and measures its rows.
pub fn measure(
    dir: &Path,
    reps: usize,
    scale: f64,
    progress: &mut impl FnMut(&str),
) -> ModelsBench {
    let layers = layers(scale);
    let model_dir = dir.join(format!("llama-{layers}-layers"));
    progress("table 10: a sharded Llama-architecture model, from_pretrained (models.py)");
    let out = crate::gpu::run_script(
        Path::new("benches/peers/models.py"),
        &[
            reps.to_string(),
            model_dir.display().to_string(),
            layers.to_string(),
        ],
    );
    let rows = rows_of(&out, "models.py");
    ModelsBench {
        bytes: out.get("bytes").and_then(|b| b.as_u64()).unwrap_or(0),
        shards: out.get("shards").and_then(|b| b.as_u64()).unwrap_or(0) as usize,
        rows,
    }
}

/// The rows of a script's output `{"rows": {method: {"seconds": [..], "gbps": [..], "digest":
/// [..]} or {"error": ..}}}` (models.py's, casts.py's), in its order; one row saying why where
/// `script` gave none.
pub fn rows_of(out: &serde_json::Value, script: &str) -> Vec<(String, Result<ModelRow, String>)> {
    let mut rows = Vec::new();
    match out.get("rows").and_then(|r| r.as_object()) {
        Some(listed) => {
            for (method, v) in listed {
                let row = match (samples_at(v, "seconds"), samples_at(v, "gbps")) {
                    (Some(seconds), Some(gbps)) => Ok(ModelRow {
                        seconds,
                        gbps,
                        digests: v
                            .get("digest")
                            .and_then(|d| d.as_array())
                            .map(|d| {
                                d.iter()
                                    .filter_map(|x| x.as_str().map(str::to_owned))
                                    .collect()
                            })
                            .unwrap_or_default(),
                    }),
                    _ => Err(error_at(Some(v), "no figure")),
                };
                rows.push((method.clone(), row));
            }
        }
        None => {
            let why = error_at(out.get("peers"), "no rows in the script's output");
            rows.push((script.to_owned(), Err(why)));
        }
    }
    rows
}

/// The model rows' table, against transformers' `from_pretrained` (the rows "model code
/// imported" against its row of that name).
pub fn table(s: &mut String, m: &ModelsBench) {
    let _ = writeln!(
        s,
        "\n### Table 10, a model: Llama architecture, {} in {} shards (save_pretrained), to \
         `cuda:0` (warm)\n\n\
         Fresh processes that created torch's CUDA context before the clock. The digests \
         cover the logits of a fixed input and a checksum of each parameter.\n\n\
         | method | seconds | GB/s | against transformers |\n|---|---|---|---|",
        show_size(m.bytes),
        m.shards
    );
    let peer_of = |method: &str| {
        let name = if method.ends_with(CODE_IMPORTED) {
            format!("transformers from_pretrained{CODE_IMPORTED}")
        } else {
            "transformers from_pretrained".to_owned()
        };
        m.rows
            .iter()
            .find_map(|(n, r)| (*n == name).then_some(r.as_ref().ok()).flatten())
    };
    let (mut digests, mut with_digests) = (std::collections::BTreeSet::new(), 0usize);
    for (method, row) in &m.rows {
        match row {
            Ok(r) => {
                digests.extend(r.digests.iter().cloned());
                with_digests += usize::from(!r.digests.is_empty());
                let _ = writeln!(
                    s,
                    "| {method} | {} | {} | {} |",
                    r.seconds.show(3),
                    r.gbps.show(1),
                    peer_of(method).map_or(String::new(), |p| format!(
                        "{:.2}x faster",
                        p.seconds.median / r.seconds.median
                    )),
                );
            }
            Err(why) => {
                let _ = writeln!(s, "| {method} | did not run: {why} | | |");
            }
        }
    }
    let _ = writeln!(
        s,
        "\nModel digests (the logits' bytes and each parameter's checksum): {}.",
        match (digests.len(), with_digests) {
            (0, _) => "none (no model row ran)".to_owned(),
            (1, 1) => "one model row ran, nothing to compare".to_owned(),
            (1, _) => "equal across the model rows".to_owned(),
            (n, _) => format!("DIFFER ({n} values)"),
        }
    );
}
