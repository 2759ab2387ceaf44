//! Table 10's cast rows (with table 10, on the GPU machine): a BF16 and an F32 checkpoint of
//! the same bytes (8 GiB, 32 tensors at full scale) loaded to `cuda:0` in another dtype by
//! `gpufeed.load_safetensors(dtype=)` and `gpufeed.load_into` (cast on the GPU on the way),
//! beside the same loads without a cast and a load followed by torch's `.to`. Measured by
//! `benches/peers/casts.py`.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::models::{ModelRow, rows_of};
use crate::util::show_size;

/// The cast rows' figures.
#[derive(Debug, Serialize)]
pub struct CastsBench {
    /// Bytes of each file.
    pub bytes: u64,
    /// Tensors of each file.
    pub tensors: usize,
    /// Method (its file's dtype first), then seconds and GB/s (of the bytes read) in fresh
    /// processes after torch's context and digests of what it made; or why it did not run.
    pub rows: Vec<(String, Result<ModelRow, String>)>,
}

/// Makes the files under `dir` (once) and measures the rows.
pub fn measure(dir: &Path, reps: usize, scale: f64, progress: &mut impl FnMut(&str)) -> CastsBench {
    let bytes = ((8u64 << 30) as f64 * scale) as u64;
    progress("table 10: casts on the way (casts.py)");
    let out = crate::gpu::run_script(
        Path::new("benches/peers/casts.py"),
        &[
            reps.to_string(),
            dir.display().to_string(),
            bytes.max(32 << 20).to_string(),
        ],
    );
    CastsBench {
        bytes: out.get("bytes").and_then(|b| b.as_u64()).unwrap_or(0),
        tensors: out.get("tensors").and_then(|b| b.as_u64()).unwrap_or(0) as usize,
        rows: rows_of(&out, "casts.py"),
    }
}

/// The row a cast row is compared with: the same file's load without a cast (by `load_into`
/// where the file has such a row, the BF16 one).
fn uncast_of(method: &str) -> Option<String> {
    let (file, how) = method.split_once(": ")?;
    let own = if how.starts_with("load_into") && file == "BF16 file" {
        "load_into bfloat16 tensors (no cast)"
    } else {
        "load_safetensors (no cast)"
    };
    Some(format!("{file}: {own}"))
}

/// The cast rows' table: each against its file's load without a cast.
pub fn table(s: &mut String, c: &CastsBench) {
    let _ = writeln!(
        s,
        "\n### Table 10, casts on the way: a BF16 and an F32 file of {} and {} tensors each, \
         to `cuda:0` in another dtype (warm)\n\n\
         Fresh processes that created torch's CUDA context before the clock. GB/s of the \
         bytes read. The digests cover each tensor's bits (a sum and a position-weighted \
         sum): the rows that make one dtype from one file agree where they are equal.\n\n\
         | method | seconds | GB/s | against the load without a cast | digest |\n|---|---|---|---|---|",
        show_size(c.bytes),
        c.tensors
    );
    let find = |name: &str| {
        c.rows
            .iter()
            .find_map(|(n, r)| (n == name).then_some(r.as_ref().ok()).flatten())
    };
    for (method, row) in &c.rows {
        match row {
            Ok(r) => {
                let against = uncast_of(method)
                    .filter(|u| u != method)
                    .and_then(|u| find(&u))
                    .map_or(String::new(), |u| {
                        format!("{:.2}x", r.gbps.median / u.gbps.median)
                    });
                let _ = writeln!(
                    s,
                    "| {method} | {} | {} | {against} | {} |",
                    r.seconds.show(3),
                    r.gbps.show(1),
                    r.digests.join(" ")
                );
            }
            Err(why) => {
                let _ = writeln!(s, "| {method} | did not run: {why} | | | |");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cast_row_is_set_against_its_files_load_without_a_cast() {
        // casts.py's output shape, figures of GPU run 157 (medians' order kept).
        let out = serde_json::json!({
            "bytes": 8589934592u64, "tensors": 32,
            "rows": {
                "BF16 file: load_safetensors (no cast)":
                    {"seconds": [0.19, 0.185, 0.183], "gbps": [44.2, 46.4, 46.9], "digest": ["a"]},
                "BF16 file: load_safetensors dtype=float16":
                    {"seconds": [0.22, 0.21, 0.21], "gbps": [38.1, 41.8, 40.9], "digest": ["b"]},
                "BF16 file: load_into bfloat16 tensors (no cast)":
                    {"seconds": [0.21, 0.21, 0.21], "gbps": [41.0, 40.8, 41.6], "digest": ["a"]},
                "BF16 file: load_into float16 tensors":
                    {"seconds": [0.21, 0.21, 0.21], "gbps": [39.9, 41.3, 40.9], "digest": ["b"]},
                "F32 file: load_into bfloat16 tensors": {"error": "RuntimeError: no GPU"}
            }
        });
        let c = CastsBench {
            bytes: 8 << 30,
            tensors: 32,
            rows: rows_of(&out, "casts.py"),
        };
        let mut s = String::new();
        table(&mut s, &c);
        let line = |start: &str| {
            s.lines()
                .find(|l| l.starts_with(&format!("| {start} |")))
                .unwrap_or_else(|| panic!("no row {start} in {s}"))
                .to_owned()
        };
        // 40.9 / 44.2... medians: 40.9 against 46.4; 40.9 against 41.0.
        assert!(
            line("BF16 file: load_safetensors dtype=float16").contains("| 0.88x |"),
            "{s}"
        );
        assert!(
            line("BF16 file: load_into float16 tensors").contains("| 1.00x |"),
            "{s}"
        );
        assert!(
            line("BF16 file: load_safetensors (no cast)").contains("|  |"),
            "{s}"
        );
        assert!(line("F32 file: load_into bfloat16 tensors").contains("did not run: RuntimeError"));
    }
}
