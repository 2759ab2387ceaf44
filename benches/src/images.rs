//! Table 15 (`--only images`, or with `--peers` on the GPU machine; issue 40): training batches
//! of JPEGs decoded on the GPU. A folder of JPEGs in `ImageFolder`'s layout, made by the bench
//! (`benches/peers/images.py --make`: ImageNet-like sizes and bytes per file, 100 classes, PIL
//! quality 90, 4:2:0, seeded; made once and reused; `--images-like issue40`: the set issue
//! 40's peers were measured on, 500x375 at 68 KiB), turned into 224x224 training batches of
//! 256 (RandomResizedCrop, random flip) by `gpufeed.ImageLoader` and by the peers a user would
//! pick instead, in the same run: torchvision's GPU decode with the user's own crops, and
//! PyTorch's `DataLoader` over `ImageFolder` with PIL transforms (8 workers, and one per core;
//! 8 workers with `ToTensor()`, the issue's own peer).
//! Each row: images/s over whole epochs after an untimed one, the CPU cores busy (the process
//! and its workers) and the GPU busy (`nvidia-smi`). Beside them, the limits known here: the
//! decode alone from bytes in memory, and this run's pinned host -> GPU limit against the
//! compressed bytes the pipeline moves. Measured by `benches/peers/images.py --rows all`.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::util::{Samples, samples_at};

/// The measuring script, relative to the repository root (where the bench runs).
const SCRIPT: &str = "benches/peers/images.py";

/// Batch size and crop side of every row (issue 40's setting).
pub const BATCH: usize = 256;
pub const SIZE: u32 = 224;

/// The rows, in the table's order: the script's id, then what the row is.
const ROWS: [(&str, &str); 8] = [
    (
        "gpufeed_uint8",
        "gpufeed `ImageLoader(train=True, device=0)`: uint8 `[256, 224, 224, 3]` on `cuda:0`, reused loader",
    ),
    (
        "gpufeed_float32",
        "the same with `dtype=torch.float32`: normalized `[256, 3, 224, 224]`",
    ),
    (
        "gpufeed_fresh",
        "the same as uint8 in a fresh process: the loader made and its first epoch inside the clock (torch's CUDA context made before)",
    ),
    (
        "gpufeed_cpu",
        "gpufeed `ImageLoader(device=None)`: decoded on the CPU, host tensors (reference)",
    ),
    (
        "torchvision",
        "torchvision, the user's GPU pipeline: `read_file` of each file, `decode_jpeg(list, device=\"cuda\")`, per image `RandomResizedCrop.get_params` + `resized_crop(antialias=True)` + random flip, `torch.stack`",
    ),
    (
        "dataloader_8",
        "PyTorch `DataLoader` + `ImageFolder` + PIL `RandomResizedCrop(224)`, `RandomHorizontalFlip()`, `PILToTensor()` (uint8), 8 workers, `pin_memory=True`, `.to(\"cuda:0\", non_blocking=True)`",
    ),
    (
        "dataloader_all",
        "the same with `num_workers=os.cpu_count()`",
    ),
    (
        "dataloader_8_totensor",
        "`DataLoader` with 8 workers as above, `ToTensor()` (float32 in [0, 1]) for `PILToTensor()`: the peer as issue 40's table wrote it",
    ),
];

/// Which data set table 15 makes (`--images-like`; `images.py --like`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Like {
    /// ImageNet-like: the long side mostly 280-480 px with a tail to 1600, ~106 KiB per file.
    #[default]
    Imagenet,
    /// Issue 40's table of peers: every image 500x375, 68 KiB on average.
    Issue40,
}

impl Like {
    /// The script's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Like::Imagenet => "imagenet",
            Like::Issue40 => "issue40",
        }
    }

    /// What the table says of it.
    fn described(self) -> &'static str {
        match self {
            Like::Imagenet => "ImageNet-like sizes and bytes per file",
            Like::Issue40 => {
                "the set issue 40's table of peers was measured on: every image 500x375, 68 KiB mean"
            }
        }
    }
}

/// The data set as `images.py --make` describes it (its manifest).
#[derive(Debug, Serialize, Deserialize)]
pub struct Dataset {
    /// Which set (manifests of runs before the option: ImageNet-like).
    #[serde(default)]
    pub like: Like,
    pub dir: PathBuf,
    pub images: u64,
    pub classes: u64,
    pub bytes: u64,
    pub mean_kib: f64,
    pub mean_width: f64,
    pub mean_height: f64,
    /// Seconds the script took to make it; `None` where an earlier run's folder was reused.
    #[serde(default)]
    pub made_seconds: Option<f64>,
}

/// One row's figures.
#[derive(Debug, Serialize)]
pub struct RowFigures {
    /// Images per second of each timed epoch (of each fresh process for `gpufeed_fresh`).
    pub images_per_s: Samples,
    /// (user + system CPU seconds of the process and its live descendants) / wall seconds,
    /// per timed epoch.
    pub cores_busy: Option<Samples>,
    /// Mean `utilization.gpu` over the timed epochs (nvidia-smi every 100 ms), percent.
    pub gpu_busy_pct: Option<f64>,
    /// Why there is no GPU busy figure.
    pub gpu_busy_why: Option<String>,
    /// dtype, shape and device of a batch, as the row saw it.
    pub batch: Option<String>,
    /// Fresh processes: seconds from the loader's construction to its first batch, and of
    /// torch's CUDA context (before the clock).
    pub first_batch_s: Option<Samples>,
    pub context_s: Option<Samples>,
    /// The loader's `cpu_only` (why it decodes on the CPU), for the gpufeed rows.
    pub cpu_only: Option<String>,
    pub note: Option<String>,
    /// Wall seconds of the whole row: its processes' start (imports), warm-up and timed epochs.
    pub seconds: Option<f64>,
}

/// A row: its id, what it is, and its figures or why it did not run.
#[derive(Debug, Serialize)]
pub struct Row {
    pub id: &'static str,
    pub what: &'static str,
    pub result: Result<RowFigures, String>,
}

/// Table 15's figures.
#[derive(Debug, Serialize)]
pub struct ImagesBench {
    /// Why the table was not measured at all (no GPU, the script cannot make the data set).
    pub not_measured: Option<String>,
    pub batch_size: usize,
    pub size: u32,
    pub dataset: Option<Dataset>,
    /// What the script found: versions of torch, torchvision, PIL, gpufeed; the GPU; cores.
    pub env: Option<serde_json::Value>,
    /// This run's pinned host -> GPU limit (256 MiB copies in 16 MiB pieces), GB/s.
    pub pinned_limit_gbps: Option<Samples>,
    pub rows: Vec<Row>,
    /// The decode alone and the training batch from bytes in memory (the first files of the
    /// data set, `in_memory_images` of them): images/s per pass, or why not measured.
    pub in_memory_images: u64,
    pub in_memory: Vec<(String, Result<Samples, String>)>,
}

impl ImagesBench {
    fn not_measured(why: String) -> Self {
        ImagesBench {
            not_measured: Some(why),
            batch_size: BATCH,
            size: SIZE,
            dataset: None,
            env: None,
            pinned_limit_gbps: None,
            rows: Vec::new(),
            in_memory_images: 0,
            in_memory: Vec::new(),
        }
    }

    fn figures(&self, id: &str) -> Option<&RowFigures> {
        self.rows
            .iter()
            .find(|r| r.id == id)
            .and_then(|r| r.result.as_ref().ok())
    }
}

/// `python3 images.py args...`: its stderr passed on line by line to `progress`, its stdout's
/// JSON; or why there is none.
fn run_script(args: &[String], progress: &impl Fn(&str)) -> Result<serde_json::Value, String> {
    let mut child = Command::new("python3")
        .arg(SCRIPT)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run python3 {SCRIPT}: {e}"))?;
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        stdout.read_to_end(&mut out).map(|_| out)
    });
    let mut last = String::new();
    if let Some(stderr) = child.stderr.take() {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if !line.trim().is_empty() {
                progress(&format!("      {line}"));
                last = line;
            }
        }
    }
    let status = child
        .wait()
        .map_err(|e| format!("waiting for {SCRIPT}: {e}"))?;
    let out = reader
        .join()
        .map_err(|_| "the thread reading the script's output panicked".to_owned())?
        .map_err(|e| format!("reading {SCRIPT}'s output: {e}"))?;
    if !status.success() {
        return Err(format!("{SCRIPT} failed ({status}): {last}"));
    }
    serde_json::from_slice(&out).map_err(|e| format!("{SCRIPT}'s output is not JSON: {e}"))
}

/// This run's pinned host -> GPU limit on `gpu`: 256 MiB copied in 16 MiB pieces on one
/// stream, `reps` times after one not timed.
fn pinned_limit(gpu: &gpufeed::Gpu, reps: usize) -> Result<Samples> {
    let len = 256 << 20;
    let ctx = std::sync::Arc::clone(gpu.context());
    let mut pinned = gpufeed::pinned::PinnedBuffer::new(&ctx, len)?;
    crate::util::SplitMix(0x1A6E).fill(&mut pinned);
    let mut dev = gpu.alloc_zeroed(len)?;
    let stream = ctx.new_stream()?;
    crate::gpu::pinned_copy_gbps(&pinned, &mut dev, &stream)?;
    let runs = (0..reps)
        .map(|_| crate::gpu::pinned_copy_gbps(&pinned, &mut dev, &stream))
        .collect::<Result<Vec<_>>>()?;
    Ok(Samples::new(runs))
}

/// One row of the script's output.
fn row_of(v: Option<&serde_json::Value>) -> Result<RowFigures, String> {
    let Some(v) = v else {
        return Err("not in the script's output".into());
    };
    let Some(images_per_s) = samples_at(v, "images_per_s") else {
        return Err(crate::util::error_at(Some(v), "no figure"));
    };
    let text = |key: &str| v.get(key).and_then(|x| x.as_str()).map(str::to_owned);
    let note = match (text("note"), v.get("workers").and_then(|w| w.as_u64())) {
        (Some(n), Some(w)) => Some(format!("{w} workers; {n}")),
        (Some(n), None) => Some(n),
        (None, Some(w)) => Some(format!("{w} workers")),
        (None, None) => None,
    };
    Ok(RowFigures {
        images_per_s,
        cores_busy: samples_at(v, "cores_busy"),
        gpu_busy_pct: v.get("gpu_busy_pct").and_then(|x| x.as_f64()),
        gpu_busy_why: text("gpu_busy_why"),
        batch: text("batch"),
        first_batch_s: samples_at(v, "first_batch_s"),
        context_s: samples_at(v, "context_s"),
        cpu_only: text("cpu_only"),
        note,
        seconds: v.get("seconds").and_then(|x| x.as_f64()),
    })
}

/// Makes (or reuses) the data set of `images` JPEGs under `dir` and measures the rows, `reps`
/// timed epochs each (fewer for the slow rows: the script's `REPS_CAP`). "Not measured" with
/// the reason without a GPU or where the data set cannot be made.
pub fn measure(
    dir: &Path,
    images: usize,
    like: Like,
    reps: usize,
    progress: impl Fn(&str),
) -> Result<ImagesBench> {
    let mut no_gpu = String::new();
    let gpu = crate::gpu::open_gpu(&mut |what| {
        progress(&format!("      {what}"));
        no_gpu = what.to_owned();
    })?;
    let Some(gpu) = gpu else {
        return Ok(ImagesBench::not_measured(format!(
            "{no_gpu} (table 15 runs on the GPU machine: docs/benchmarks.md)"
        )));
    };
    progress("      table 15: the pinned host -> GPU limit (256 MiB)");
    let pinned_limit_gbps = Some(pinned_limit(&gpu, reps)?);
    // The script's processes make their own contexts; this one holds nothing meanwhile.
    drop(gpu);

    let folder = match like {
        Like::Imagenet => dir.join(format!("images-{images}")),
        Like::Issue40 => dir.join(format!("images-issue40-{images}")),
    };
    progress(&format!(
        "      table 15: a folder of {images} JPEGs at {} (made once, by {SCRIPT})",
        folder.display()
    ));
    let made = run_script(
        &[
            "--dir".into(),
            folder.display().to_string(),
            "--make".into(),
            images.to_string(),
            "--like".into(),
            like.name().into(),
        ],
        &progress,
    );
    let dataset = match made.and_then(|v| {
        serde_json::from_value::<Dataset>(v)
            .map_err(|e| format!("{SCRIPT} --make gave no manifest: {e}"))
    }) {
        Ok(d) => d,
        Err(why) => {
            let mut bench = ImagesBench::not_measured(why);
            bench.pinned_limit_gbps = pinned_limit_gbps;
            return Ok(bench);
        }
    };
    progress("      table 15: gpufeed.ImageLoader against torchvision and DataLoader + PIL");
    let out = match run_script(
        &[
            "--dir".into(),
            folder.display().to_string(),
            "--rows".into(),
            "all".into(),
            "--reps".into(),
            reps.to_string(),
            "--batch".into(),
            BATCH.to_string(),
            "--size".into(),
            SIZE.to_string(),
        ],
        &progress,
    ) {
        Ok(v) => v,
        Err(why) => serde_json::json!({ "error": why }),
    };
    Ok(from_output(dataset, pinned_limit_gbps, &out))
}

/// The table from the script's `--rows` output.
fn from_output(
    dataset: Dataset,
    pinned_limit_gbps: Option<Samples>,
    out: &serde_json::Value,
) -> ImagesBench {
    let rows_json = out.get("rows");
    let rows = ROWS
        .iter()
        .map(|&(id, what)| Row {
            id,
            what,
            result: match rows_json {
                Some(r) => row_of(r.get(id)),
                None => Err(crate::util::error_at(Some(out), "no rows in the output")),
            },
        })
        .collect();
    let memory = rows_json.and_then(|r| r.get("in_memory"));
    // In the script's order where it says it (a JSON object's keys come back sorted).
    let order: Vec<&str> = memory
        .and_then(|m| m.get("order"))
        .and_then(|o| o.as_array())
        .map_or_else(Vec::new, |o| o.iter().filter_map(|x| x.as_str()).collect());
    let mut in_memory: Vec<(String, Result<Samples, String>)> = match memory
        .and_then(|m| m.get("images_per_s"))
        .and_then(|m| m.as_object())
    {
        Some(listed) => listed
            .iter()
            .map(|(name, v)| {
                let runs = v
                    .as_array()
                    .map(|runs| Samples::new(runs.iter().filter_map(|x| x.as_f64()).collect()));
                (
                    name.clone(),
                    runs.ok_or_else(|| crate::util::error_at(Some(v), "no figure")),
                )
            })
            .collect(),
        None => vec![(
            "the decode alone (in memory)".to_owned(),
            Err(crate::util::error_at(memory, "not in the script's output")),
        )],
    };
    in_memory.sort_by_key(|(name, _)| order.iter().position(|o| o == name));
    ImagesBench {
        not_measured: None,
        batch_size: BATCH,
        size: SIZE,
        dataset: Some(dataset),
        env: out.get("env").cloned(),
        pinned_limit_gbps,
        rows,
        in_memory_images: memory
            .and_then(|m| m.get("images"))
            .and_then(|x| x.as_u64())
            .unwrap_or(0),
        in_memory,
    }
}

/// `a / b` of two rows' medians as "2.3x name", or "".
fn ratio(a: &RowFigures, b: Option<&RowFigures>, name: &str) -> Option<String> {
    b.map(|b| {
        format!(
            "{:.1}x {name}",
            a.images_per_s.median / b.images_per_s.median
        )
    })
}

/// Table 15: decoded, augmented training batches of JPEGs.
pub fn table(s: &mut String, b: &ImagesBench) {
    let _ = write!(
        s,
        "\n## Table 15 — images: a folder of JPEGs -> decoded {0}x{0} training batches of {1} \
         (warm)\n\n",
        b.size, b.batch_size
    );
    if let Some(why) = &b.not_measured {
        let _ = writeln!(s, "Not measured: {why}.");
        return;
    }
    // "12 batches": images.py's WARM_BATCHES.
    if let Some(d) = &b.dataset {
        let _ = writeln!(
            s,
            "{} JPEGs in {} class folders at {} ({:.2} GB; mean {:.0}x{:.0} px, {:.0} KiB: \
             {}; PIL quality 90, 4:2:0, seeded; {}), in the page cache. \
             RandomResizedCrop(scale 0.08-1, ratio 3/4-4/3) and a random horizontal flip per \
             image, shuffled, labels with the batch. *images/s*: per timed whole epoch, in a \
             process of the row's own after an untimed warm-up (a whole epoch for the gpufeed \
             GPU rows, the first 12 batches of one for the others), median (min-max). *cores \
             busy*: user + system CPU seconds of the process, its threads and its worker processes over the \
             epoch's wall seconds. *GPU busy*: the mean of `nvidia-smi`'s `utilization.gpu` \
             (share of time a kernel ran) every 100 ms over the timed epochs.",
            d.images,
            d.classes,
            d.dir.display(),
            d.bytes as f64 / 1e9,
            d.mean_width,
            d.mean_height,
            d.mean_kib,
            d.like.described(),
            d.made_seconds
                .map_or("made by an earlier run".to_owned(), |s| {
                    format!("made by this run in {s:.0} s")
                })
        );
    }
    if let Some(env) = &b.env {
        let get = |k: &str| {
            env.get(k).map_or("?".to_owned(), |v| {
                v.as_str().map_or(v.to_string(), str::to_owned)
            })
        };
        let _ = writeln!(
            s,
            "\ntorch {}, torchvision {}, PIL {}, gpufeed {}; GPU {}; {} cores.",
            get("torch"),
            get("torchvision"),
            get("PIL"),
            get("gpufeed"),
            if env.get("gpu").is_some() {
                get("gpu")
            } else {
                "none visible to torch".to_owned()
            },
            get("cpus")
        );
    }
    let _ = writeln!(
        s,
        "\n| pipeline | images/s | cores busy | GPU busy | against |\n|---|---|---|---|---|"
    );
    let tv = b.figures("torchvision");
    let dl8 = b.figures("dataloader_8");
    let dl_all = b.figures("dataloader_all");
    let dl8_float = b.figures("dataloader_8_totensor");
    for row in &b.rows {
        match &row.result {
            Ok(f) => {
                let against = if row.id.starts_with("gpufeed") {
                    [
                        ratio(f, tv, "torchvision"),
                        ratio(f, dl8, "DataLoader(8)"),
                        ratio(f, dl_all, "DataLoader(all cores)"),
                        ratio(f, dl8_float, "DataLoader(8, ToTensor)"),
                    ]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join(", ")
                } else {
                    String::new()
                };
                let busy = match (f.gpu_busy_pct, &f.gpu_busy_why) {
                    (Some(p), _) => format!("{p:.0}%"),
                    (None, Some(why)) => format!("- ({why})"),
                    (None, None) => "-".to_owned(),
                };
                // A note the row's description already says (its worker count) is left out.
                let note = f
                    .note
                    .as_ref()
                    .filter(|n| !row.what.contains(n.as_str()))
                    .map_or(String::new(), |n| format!(" ({n})"));
                let _ = writeln!(
                    s,
                    "| {}{note} | {} | {} | {busy} | {against} |",
                    row.what,
                    f.images_per_s.show(0),
                    f.cores_busy.as_ref().map_or("-".to_owned(), |c| c.show(1)),
                );
            }
            Err(why) => {
                let _ = writeln!(s, "| {} | not measured: {why} | | | |", row.what);
            }
        }
    }
    if let Some(f) = b.figures("gpufeed_fresh")
        && let (Some(first), Some(context)) = (&f.first_batch_s, &f.context_s)
    {
        let _ = writeln!(
            s,
            "\nFresh process: the first batch {:.2} s after the loader's construction began \
             (median of {}); torch's CUDA context before it took {:.2} s.",
            first.median,
            first.all.len(),
            context.median
        );
    }
    // What each row made (its batch as it saw it), and where a gpufeed row decoded on the CPU.
    let made: Vec<String> = b
        .rows
        .iter()
        .filter_map(|row| {
            let f = row.result.as_ref().ok()?;
            let mut what = f.batch.clone()?;
            if let Some(c) = &f.cpu_only {
                what.push_str(&format!(" (decoded on the CPU: {c})"));
            }
            Some(format!("`{}` {what}", row.id))
        })
        .collect();
    if !made.is_empty() {
        let _ = writeln!(s, "\nBatches made: {}.", made.join("; "));
    }
    let walls: Vec<String> = b
        .rows
        .iter()
        .filter_map(|row| {
            let secs = row.result.as_ref().ok()?.seconds?;
            Some(format!("`{}` {secs:.0} s", row.id))
        })
        .collect();
    if !walls.is_empty() {
        let _ = writeln!(
            s,
            "\nWall time of each row (its processes' start, warm-up and timed epochs): {}.",
            walls.join(", ")
        );
    }
    limits(s, b);
    targets(s, b, tv, dl8, dl8_float);
    in_memory_table(s, b);
}

/// What the uint8 row is set beside: the decode alone (bytes in memory, one call at a time: a
/// scale, not a limit, since the loader overlaps its decoders), and the compressed bytes the
/// row moves against this run's pinned host -> GPU limit.
fn limits(s: &mut String, b: &ImagesBench) {
    let Some(f) = b.figures("gpufeed_uint8") else {
        return;
    };
    let rate = f.images_per_s.median;
    let decode = b
        .in_memory
        .iter()
        .filter(|(name, _)| name.contains("decode_jpeg") && !name.contains("crop"))
        .filter_map(|(name, r)| r.as_ref().ok().map(|r| (name, r.median)))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    if let Some((name, best)) = decode {
        let _ = writeln!(
            s,
            "\nThe decode alone, for scale (bytes already in memory, one decode call per batch \
             of 256 at a time, no crop; the table below): {best:.0} images/s by {name}; the \
             uint8 row, files read and crops made, runs at {:.0}% of it.",
            100.0 * rate / best
        );
    }
    if let (Some(d), Some(limit)) = (&b.dataset, &b.pinned_limit_gbps) {
        let gbps = rate * d.bytes as f64 / d.images.max(1) as f64 / 1e9;
        let _ = writeln!(
            s,
            "\nThe uint8 row reads {gbps:.2} GB/s of JPEG bytes: {} (this run's limit: {} GB/s, \
             256 MiB from pinned memory in 16 MiB copies).",
            crate::report::share(gbps, limit.median, "the pinned host -> GPU limit"),
            limit.show(1)
        );
    }
}

/// Issue 40's targets, each against this run's figures.
fn targets(
    s: &mut String,
    b: &ImagesBench,
    tv: Option<&RowFigures>,
    dl8: Option<&RowFigures>,
    dl8_float: Option<&RowFigures>,
) {
    let Some(f) = b.figures("gpufeed_uint8") else {
        return;
    };
    let met = |ok: bool| if ok { "met" } else { "not met" };
    let rate = f.images_per_s.median;
    let mut parts = vec![format!(
        ">= 20,000 images/s: {rate:.0} ({})",
        met(rate >= 20_000.0)
    )];
    if let Some(tv) = tv {
        let x = rate / tv.images_per_s.median;
        parts.push(format!(">= 2x torchvision: {x:.1}x ({})", met(x >= 2.0)));
    }
    if let Some(dl) = dl8 {
        let x = rate / dl.images_per_s.median;
        parts.push(format!(
            ">= 12x DataLoader(8): {x:.1}x ({})",
            met(x >= 12.0)
        ));
    }
    if let Some(dl) = dl8_float {
        let x = rate / dl.images_per_s.median;
        parts.push(format!(
            ">= 12x DataLoader(8) with the issue's `ToTensor()`: {x:.1}x ({})",
            met(x >= 12.0)
        ));
    }
    if let Some(c) = &f.cores_busy {
        parts.push(format!(
            "<= 4 cores busy: {:.1} ({})",
            c.median,
            met(c.median <= 4.0)
        ));
    }
    let _ = writeln!(
        s,
        "\nIssue 40's targets (H200, uint8 row, medians of this run): {}.",
        parts.join("; ")
    );
}

/// The in-memory rows: the decode alone and the training batch from bytes in memory.
fn in_memory_table(s: &mut String, b: &ImagesBench) {
    if b.in_memory.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "\n### Table 15, from bytes in memory: the first {} JPEGs of the folder, batches of 256 \
         (no file reads)\n\n| path | images/s |\n|---|---|",
        b.in_memory_images
    );
    for (name, r) in &b.in_memory {
        match r {
            Ok(x) => {
                let _ = writeln!(s, "| {name} | {} |", x.show(0));
            }
            Err(why) => {
                let _ = writeln!(s, "| {name} | not measured: {why} |");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The script's JSON for a row becomes its figures; an error row becomes its reason.
    #[test]
    fn rows_of_the_script() {
        let ok = serde_json::json!({"images_per_s": [100.0, 300.0, 200.0],
            "cores_busy": [3.0, 3.5, 4.0], "gpu_busy_pct": 61.5, "batch": "uint8 [256, 224, 224, 3] cuda:0",
            "workers": 8});
        let f = row_of(Some(&ok)).expect("figures");
        assert_eq!(f.images_per_s.median, 200.0);
        assert_eq!(f.cores_busy.expect("cores").median, 3.5);
        assert_eq!(f.gpu_busy_pct, Some(61.5));
        assert_eq!(f.note.as_deref(), Some("8 workers"));
        let bad = serde_json::json!({"error": "RuntimeError: no CUDA device"});
        assert_eq!(
            row_of(Some(&bad)).err().as_deref(),
            Some("RuntimeError: no CUDA device")
        );
        assert!(row_of(None).is_err());
    }

    /// A whole output of `images.py --rows all` (the shape the script prints) renders every
    /// row, the ratios against the peers, the limits and the targets.
    #[test]
    fn a_measured_table() {
        let out = serde_json::json!({
            "env": {"torch": "2.9.0", "torchvision": "0.24.0", "PIL": "11.0.0",
                    "gpufeed": "0.1.0", "gpu": "NVIDIA H200", "cpus": 16},
            "rows": {
                "gpufeed_uint8": {"images_per_s": [20000.0, 21000.0, 22000.0], "seconds": 9.4,
                    "cores_busy": [3.0, 3.2, 3.4], "gpu_busy_pct": 80.0,
                    "batch": "uint8 [256, 224, 224, 3] cuda:0", "cpu_only": null},
                "gpufeed_float32": {"error": "RuntimeError: something"},
                "gpufeed_fresh": {"images_per_s": [15000.0], "cores_busy": [3.0],
                    "first_batch_s": [0.2], "context_s": [0.4], "gpu_busy_pct": 50.0},
                "gpufeed_cpu": {"images_per_s": [3000.0, 3100.0], "cores_busy": [15.0, 15.5],
                    "batch": "uint8 [256, 224, 224, 3] cpu",
                    "gpu_busy_why": "this row does not use the GPU",
                    "cpu_only": "no GPU was given"},
                "torchvision": {"images_per_s": [7000.0, 7000.0], "cores_busy": [1.0, 1.0],
                    "gpu_busy_pct": 40.0},
                "dataloader_8": {"images_per_s": [1750.0, 1750.0], "cores_busy": [8.0, 8.0],
                    "gpu_busy_pct": null, "gpu_busy_why": "nvidia-smi is not on the PATH",
                    "workers": 8},
                "dataloader_8_totensor": {"images_per_s": [1500.0, 1500.0],
                    "cores_busy": [8.0, 8.0], "gpu_busy_pct": 1.0, "workers": 8},
                "in_memory": {"images": 4096, "images_per_s": {
                    "gpufeed.decode_jpegs(device=0)": [24000.0, 25000.0, 26000.0],
                    "torchvision decode_jpeg(list, device='cuda')": [27000.0],
                    "torchvision decode_jpeg + resized_crop(antialias) + flip + stack": [4000.0],
                    "PIL, one thread": {"error": "no PIL"}},
                    "order": ["gpufeed.decode_jpegs(device=0)",
                        "torchvision decode_jpeg(list, device='cuda')",
                        "torchvision decode_jpeg + resized_crop(antialias) + flip + stack",
                        "PIL, one thread"]}
            }
        });
        let dataset = Dataset {
            like: Like::Imagenet,
            dir: "/tmp/images-16384".into(),
            images: 16_384,
            classes: 100,
            bytes: 16_384 * 110_000,
            mean_kib: 107.4,
            mean_width: 407.0,
            mean_height: 352.0,
            made_seconds: Some(12.0),
        };
        let b = from_output(dataset, Some(Samples::new(vec![54.0, 55.0])), &out);
        let mut s = String::new();
        table(&mut s, &b);
        for want in [
            "| 21000 (20000-22000) | 3.2 (3.0-3.4) | 80% | 3.0x torchvision, 12.0x DataLoader(8), 14.0x DataLoader(8, ToTensor) |",
            "`ToTensor()` (float32 in [0, 1]) for `PILToTensor()`: the peer as issue 40's table wrote it | 1500",
            "| not measured: RuntimeError: something |",
            "- (nvidia-smi is not on the PATH)",
            "`.to(\"cuda:0\", non_blocking=True)` | 1750",
            "| the same with `num_workers=os.cpu_count()` | not measured: not in the script's output |",
            "27000 images/s by torchvision decode_jpeg(list, device='cuda'); the uint8 row, files read and crops made, runs at 78%",
            "of the pinned host -> GPU limit",
            "107 KiB: ImageNet-like sizes and bytes per file; PIL quality 90",
            ">= 20,000 images/s: 21000 (met); >= 2x torchvision: 3.0x (met); >= 12x DataLoader(8): 12.0x (met); >= 12x DataLoader(8) with the issue's `ToTensor()`: 14.0x (met); <= 4 cores busy: 3.2 (met)",
            "the first batch 0.20 s",
            "Wall time of each row (its processes' start, warm-up and timed epochs): `gpufeed_uint8` 9 s.",
            "| PIL, one thread | not measured: no PIL |",
            "Batches made: `gpufeed_uint8` uint8 [256, 224, 224, 3] cuda:0; `gpufeed_cpu` uint8 [256, 224, 224, 3] cpu (decoded on the CPU: no GPU was given).",
        ] {
            assert!(s.contains(want), "{want:?} not in:\n{s}");
        }
    }

    #[test]
    fn a_table_not_measured_says_why() {
        let mut s = String::new();
        table(
            &mut s,
            &ImagesBench::not_measured("no GPU: none here".into()),
        );
        assert!(s.contains("## Table 15") && s.contains("Not measured: no GPU: none here."));
    }
}
