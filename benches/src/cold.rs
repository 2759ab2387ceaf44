//! Table 16 (`--only cold`; GPU machine; issue 42): cold loads of one file to the GPU by every
//! route gpufeed has and by KvikIO, in one run. The file is the one tables 4, 6 and 8 load
//! (`gpu-file-<bytes>.bin`, `--gpu-file`, 4 GiB by default); each figure is the median of
//! `--reps` loads, each after the file's pages were dropped from the page cache
//! (`gpufeed_os::cache::evict`). Beside them the disk's own limit measured the same way: the raw
//! `O_DIRECT` read of the file into host memory (table 6's, io_uring at queue depth 32).
//!
//! Rows: `Strategy::Auto` (default `LoadOptions`, with what it chose and why), `Direct`,
//! `Staged`, `Gds` (cuFile; `io_backend` says which path cuFile's statistics saw: peer-to-peer
//! or its compatibility mode) into the destination and through the loader's registered buffers
//! (`GdsBuffers::Registered`), and KvikIO's `CuFile.read` into a CuPy buffer at 16 threads and
//! at its default (`benches/peers/cold.py`). The Auto, Direct and Gds loads' bytes are checked
//! against the file (xxh3) once; a mismatch fails the run. Issue 42's targets close the table:
//! `Auto` no slower than the best of Direct, Staged and cuFile, and `Direct` at least KvikIO.

use std::fmt::Write as _;
use std::io::Read as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use gpufeed::{LoadOptions, Loader, Strategy};
use gpufeed_os::{Refused, cache};
use serde::Serialize;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::report::share;
use crate::util::{Samples, samples_at, show_size};

/// The measuring script of the KvikIO rows, relative to the repository root (where the bench
/// runs).
const SCRIPT: &str = "benches/peers/cold.py";

/// Bytes of the untimed warm-up loads of the `Direct` and `Gds` loaders: at least the size
/// from which a loader's first load takes its memory from `cuMemAlloc` (64 MiB), so that the
/// timed loads all take theirs from the context's pool, like the other routes'.
const WARM_UP_RANGE: u64 = 256 << 20;

/// gpufeed's routes, in the table's order: the id, the strategy asked for, what the row is.
const ROUTES: [(&str, Strategy, &str); 5] = [
    (
        "auto",
        Strategy::Auto,
        "`Strategy::Auto` (default `LoadOptions`)",
    ),
    (
        "direct",
        Strategy::Direct,
        "`Strategy::Direct`: `O_DIRECT` reads into pinned staging, uploaded",
    ),
    (
        "staged",
        Strategy::Staged,
        "`Strategy::Staged`: buffered reads into pinned staging, uploaded",
    ),
    (
        "gds",
        Strategy::Gds,
        "`Strategy::Gds`: cuFile reads into device memory",
    ),
    (
        "gds_registered",
        Strategy::Gds,
        "the same, `GdsBuffers::Registered`: into the loader's registered 8 MiB buffers, copied on the GPU (with nvidia-fs; in compatibility mode into the destination, its fallback says why)",
    ),
];

/// The KvikIO rows of `cold.py`'s output, in the table's order.
const KVIKIO_ROWS: [(&str, &str); 2] = [
    (
        "kvikio_16",
        "KvikIO `CuFile(path, \"r\").read(buf)` into a CuPy buffer, 16 threads",
    ),
    (
        "kvikio_default",
        "the same at KvikIO's default thread count",
    ),
];

/// One of gpufeed's routes.
#[derive(Debug, Serialize)]
pub struct RouteRow {
    pub id: &'static str,
    pub what: &'static str,
    /// GB/s of each cold load (`LoadReport::gbps`), whatever ran.
    pub gbps: Samples,
    /// What ran and why, each distinct `strategy (reason)` of the loads.
    pub ran: Vec<String>,
    /// The loads' `io_backend`s, distinct.
    pub io_backend: Vec<String>,
    /// The loads' fallbacks, distinct (`Fallback`'s text).
    pub fallbacks: Vec<String>,
    /// The page-cache share of the file before each load (`LoadReport::residency_before`).
    pub residency_before: Vec<Option<f64>>,
    /// For `Gds`: why cuFile refused, where a load ran another route instead.
    pub refused: Option<String>,
    /// For Auto, Direct and Gds: the device buffer's xxh3 matched the file's (checked once).
    pub verified: bool,
}

/// A KvikIO row of `cold.py`, or why it did not run.
#[derive(Debug, Serialize)]
pub struct PeerRow {
    pub id: &'static str,
    pub what: &'static str,
    pub result: Result<PeerFigures, String>,
}

#[derive(Debug, Serialize)]
pub struct PeerFigures {
    pub threads: Option<u64>,
    pub gbps: Samples,
    /// Bytes per KvikIO backend over the timed reads (`GDS`: through cuFile; `POSIX`: KvikIO's
    /// own compatibility mode), where its statistics say.
    pub backends: Option<serde_json::Value>,
    pub verified: Option<String>,
    pub max_resident_after_evict: Option<f64>,
}

/// Table 16's figures.
#[derive(Debug, Serialize)]
pub struct ColdBench {
    /// Why the table was not measured (no GPU).
    pub not_measured: Option<String>,
    pub path: PathBuf,
    pub file_bytes: u64,
    pub gpu: Option<String>,
    /// The disk's limit: the raw `O_DIRECT` read of the file to host memory, after each
    /// eviction.
    pub raw_direct_gbps: Option<Samples>,
    pub routes: Vec<RouteRow>,
    /// The most of the file left in the page cache after an eviction of this process's.
    pub max_resident_after_evict: Option<f64>,
    /// What `cold.py` found: KvikIO's version, compat mode, libcufile; or its error.
    pub kvikio_env: Option<serde_json::Value>,
    pub kvikio: Vec<PeerRow>,
    /// Issue 42's targets: Auto against the best route, Direct against KvikIO.
    pub auto_verdict: String,
    pub direct_verdict: String,
    pub notes: Vec<String>,
}

impl ColdBench {
    fn not_measured(path: PathBuf, file_bytes: u64, why: String) -> Self {
        ColdBench {
            not_measured: Some(why),
            path,
            file_bytes,
            gpu: None,
            raw_direct_gbps: None,
            routes: Vec::new(),
            max_resident_after_evict: None,
            kvikio_env: None,
            kvikio: Vec::new(),
            auto_verdict: String::new(),
            direct_verdict: String::new(),
            notes: Vec::new(),
        }
    }

    fn route(&self, id: &str) -> Option<&RouteRow> {
        self.routes.iter().find(|r| r.id == id)
    }
}

/// The xxh3 of the whole file, read in 8 MiB pieces.
fn file_hash(path: &Path) -> Result<u64> {
    let mut file = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut hasher = Xxh3::new();
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("read {}", path.display()))?;
        if n == 0 {
            return Ok(hasher.digest());
        }
        hasher.update(&buf[..n]);
    }
}

/// `cache::evict(path)`, keeping the most of the file it left behind in `max_left`.
fn evict(path: &Path, max_left: &mut f64) -> Result<()> {
    let left = cache::evict(path).with_context(|| format!("evict {}", path.display()))?;
    *max_left = max_left.max(left.fraction());
    Ok(())
}

/// Pushes `item` onto `list` unless it is there.
fn push_distinct(list: &mut Vec<String>, item: String) {
    if !list.contains(&item) {
        list.push(item);
    }
}

/// Loads the GPU file (`dir/gpu-file-<file_bytes>.bin`, made if missing) cold, `reps` times by
/// each route, with the raw `O_DIRECT` read beside them, then runs KvikIO on it
/// (`benches/peers/cold.py`). "Not measured" without a GPU.
pub fn measure(
    dir: &Path,
    file_bytes: u64,
    reps: usize,
    progress: impl Fn(&str),
) -> Result<ColdBench> {
    let path = dir.join(format!("gpu-file-{file_bytes}.bin"));
    let mut no_gpu = String::new();
    let gpu = crate::gpu::open_gpu(&mut |what| {
        progress(what);
        no_gpu = what.to_owned();
    })?;
    let Some(gpu) = gpu else {
        return Ok(ColdBench::not_measured(
            path,
            file_bytes,
            format!("{no_gpu} (table 16 runs on the GPU machine: docs/benchmarks.md)"),
        ));
    };
    progress(&format!(
        "table 16: {} of random bytes at {}, and its xxh3",
        show_size(file_bytes),
        path.display()
    ));
    crate::util::ensure_random_file(&path, file_bytes, crate::gpu::FILE_SEED)?;
    let want = file_hash(&path)?;

    let loaders = ROUTES
        .iter()
        .map(|&(id, strategy, _)| {
            let mut opts = LoadOptions::default().with_strategy(strategy);
            // The Gds rows name the path cuFile's statistics say served their reads (counting
            // raises cuFile's statistics level once for the process and serializes counted
            // loads; the loads here run one at a time, so the lock costs nothing).
            opts.gds_path_counts = strategy == Strategy::Gds;
            opts.gds_buffers = match id {
                "gds_registered" => gpufeed::GdsBuffers::Registered,
                _ => gpufeed::GdsBuffers::Destination,
            };
            Loader::new(&gpu, opts)
        })
        .collect::<Result<Vec<_>, _>>()?;
    progress("table 16: untimed warm-up loads (device memory pool, readers, the cuFile driver)");
    // A loader's first load of 64 MiB or more takes its memory from cuMemAlloc, later ones
    // from the context's pool (one pool for all loaders): Auto loads the warm file twice (the
    // second grows the pool to the file's size), Staged once; Direct and Gds, which read
    // around the page cache, load a range (their first load, the cuFile driver opened).
    cache::warm(&path)?;
    for (i, loader) in loaders.iter().enumerate() {
        let (loads, range) = match ROUTES[i].1 {
            Strategy::Auto => (2, None),
            Strategy::Staged => (1, None),
            _ => (1, Some(0..WARM_UP_RANGE.min(file_bytes))),
        };
        for _ in 0..loads {
            let (buf, _) = match &range {
                Some(r) => loader.load_range(&path, r.clone())?,
                None => loader.load_file(&path)?,
            };
            drop(buf);
            loader.wait_for_cleanup();
        }
    }

    let mut raw = Vec::new();
    let mut runs: Vec<Vec<gpufeed::LoadReport>> = ROUTES.iter().map(|_| Vec::new()).collect();
    let mut verified = [false; ROUTES.len()];
    let mut max_left = 0.0f64;
    for rep in 0..reps {
        progress(&format!(
            "table 16: cold loads {}/{reps}: the raw O_DIRECT read, then Auto, Direct, Staged, Gds \
             (in turn, starting one later each repetition), each after an eviction",
            rep + 1
        ));
        evict(&path, &mut max_left)?;
        raw.push(crate::facade::raw_direct(&path)?);
        // Each repetition starts at another route: none always runs first (or last) after the
        // raw read.
        for k in 0..ROUTES.len() {
            let i = (rep + k) % ROUTES.len();
            let loader = &loaders[i];
            evict(&path, &mut max_left)?;
            let (buf, report) = loader.load_file(&path)?;
            if !verified[i] && ROUTES[i].1 != Strategy::Staged {
                let back = gpu.to_vec(&buf)?;
                ensure!(
                    xxh3_64(&back) == want,
                    "table 16: the bytes on the GPU after the {} load ({} ran) differ from {}",
                    ROUTES[i].0,
                    report.strategy,
                    path.display()
                );
                verified[i] = true;
            }
            drop(buf);
            loader.wait_for_cleanup();
            if rep == 0 {
                progress(&format!(
                    "table 16: {}: {} ({}) at {:.2} GB/s; io: {}{}",
                    ROUTES[i].0,
                    report.strategy,
                    report.reason,
                    report.gbps(),
                    report.io_backend.as_deref().unwrap_or("-"),
                    report
                        .fallbacks
                        .iter()
                        .map(|f| format!("; fallback: {f}"))
                        .collect::<String>()
                ));
            }
            runs[i].push(report);
        }
    }
    let routes: Vec<RouteRow> = ROUTES
        .iter()
        .zip(runs)
        .zip(verified)
        .map(|((&(id, strategy, what), reports), verified)| {
            let (mut ran, mut io_backend, mut fallbacks) = (Vec::new(), Vec::new(), Vec::new());
            let mut refused = None;
            for r in &reports {
                push_distinct(&mut ran, format!("{} ({})", r.strategy, r.reason));
                if let Some(b) = &r.io_backend {
                    push_distinct(&mut io_backend, b.clone());
                }
                for f in &r.fallbacks {
                    push_distinct(&mut fallbacks, f.to_string());
                }
                if strategy == Strategy::Gds && r.strategy != Strategy::Gds && refused.is_none() {
                    refused = Some(
                        r.fallbacks
                            .iter()
                            .find(|f| f.refused == Refused::Gds)
                            .map_or_else(
                                || format!("{} ran, no fallback said why", r.strategy),
                                |f| format!("{} ({} ran instead)", f.reason, r.strategy),
                            ),
                    );
                }
            }
            RouteRow {
                id,
                what,
                gbps: Samples::new(reports.iter().map(|r| r.gbps()).collect()),
                ran,
                io_backend,
                fallbacks,
                residency_before: reports.iter().map(|r| r.residency_before).collect(),
                refused,
                verified,
            }
        })
        .collect();
    let gpu_name = gpu.info().name.clone();
    // KvikIO's process makes its own context and buffers; this one holds nothing meanwhile.
    drop(loaders);
    drop(gpu);

    progress(&format!(
        "table 16: KvikIO, 16 threads and its default, {reps} cold reads each ({SCRIPT})"
    ));
    let out = crate::gpu::run_script(
        Path::new(SCRIPT),
        &[path.display().to_string(), reps.to_string()],
    );
    let (kvikio_env, kvikio) = peers_of(&out);
    let mut bench = ColdBench {
        not_measured: None,
        path,
        file_bytes,
        gpu: Some(gpu_name),
        raw_direct_gbps: Some(Samples::new(raw)),
        routes,
        max_resident_after_evict: Some(max_left),
        kvikio_env,
        kvikio,
        auto_verdict: String::new(),
        direct_verdict: String::new(),
        notes: Vec::new(),
    };
    if max_left > 0.01 {
        bench.notes.push(format!(
            "An eviction left up to {:.0}% of the file in the page cache (pages mapped or \
             dirty elsewhere): those loads were not wholly cold.",
            100.0 * max_left
        ));
    }
    bench.auto_verdict = auto_verdict(&bench);
    bench.direct_verdict = direct_verdict(&bench);
    Ok(bench)
}

/// The script's environment and KvikIO rows; a script that failed as a whole gives every row
/// its error.
fn peers_of(out: &serde_json::Value) -> (Option<serde_json::Value>, Vec<PeerRow>) {
    // `run_script` says a failure as {"peers": {"error": ...}}; the script itself as
    // {"error": ...}.
    let whole = out
        .get("error")
        .or_else(|| out.get("peers").and_then(|p| p.get("error")))
        .and_then(|e| e.as_str())
        .map(str::to_owned);
    let env = out.get("env").cloned();
    let default_threads = env
        .as_ref()
        .and_then(|e| e.get("default_num_threads"))
        .and_then(|t| t.as_u64());
    let rows = KVIKIO_ROWS
        .iter()
        .map(|&(id, what)| {
            let v = out.get("rows").and_then(|r| r.get(id));
            let result = match (&whole, v) {
                (Some(why), _) => Err(why.clone()),
                (None, None) if id == "kvikio_default" && default_threads == Some(16) => {
                    Err("KvikIO's default is 16 threads: the row above".to_owned())
                }
                (None, None) => Err("not in the script's output".to_owned()),
                (None, Some(v)) => match samples_at(v, "gbps") {
                    Some(gbps) => Ok(PeerFigures {
                        threads: v.get("threads").and_then(|t| t.as_u64()),
                        gbps,
                        backends: v.get("backends").cloned(),
                        verified: v
                            .get("verified")
                            .and_then(|x| x.as_str())
                            .map(str::to_owned),
                        max_resident_after_evict: v
                            .get("max_resident_after_evict")
                            .and_then(|x| x.as_f64()),
                    }),
                    None => Err(crate::util::error_at(Some(v), "no figure")),
                },
            };
            PeerRow { id, what, result }
        })
        .collect();
    (env, rows)
}

/// The best KvikIO row: its what and median GB/s.
fn best_kvikio(b: &ColdBench) -> Option<(&PeerRow, f64)> {
    b.kvikio
        .iter()
        .filter_map(|p| p.result.as_ref().ok().map(|f| (p, f.gbps.median)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

/// "met", "within the spread" or "not met": `a` (GB/s, median) against `best` (the median and
/// the slowest run of the best).
fn judge(a: f64, best: f64, best_min: f64) -> &'static str {
    if a >= best {
        "met"
    } else if a >= best_min {
        "not met by the medians, within the best's spread (min-max)"
    } else {
        "not met"
    }
}

/// Issue 42: `Auto` is never slower than the best of Direct, Staged and cuFile (where cuFile
/// ran: a refused Gds row has no figure of its own).
fn auto_verdict(b: &ColdBench) -> String {
    let Some(auto) = b.route("auto") else {
        return "not measured".to_owned();
    };
    let best = b
        .routes
        .iter()
        .filter(|r| r.id != "auto" && r.refused.is_none())
        .max_by(|x, y| x.gbps.median.total_cmp(&y.gbps.median));
    let Some(best) = best else {
        return "no other route measured".to_owned();
    };
    let cufile = match b.route("gds").and_then(|g| g.refused.as_ref()) {
        Some(_) => " (cuFile refused: not among them)",
        None => "",
    };
    format!(
        "{}: Auto {:.2} GB/s, {:.2}x {} {:.2} GB/s, the best of direct, staged, cuFile{cufile}",
        judge(auto.gbps.median, best.gbps.median, best.gbps.min),
        auto.gbps.median,
        auto.gbps.median / best.gbps.median,
        best.id,
        best.gbps.median,
    )
}

/// Issue 42: gpufeed's Direct at least KvikIO's throughput (through cuFile's compatibility mode
/// or KvikIO's own POSIX reads, whichever it took).
fn direct_verdict(b: &ColdBench) -> String {
    let Some(direct) = b.route("direct") else {
        return "not measured".to_owned();
    };
    let Some((peer, kvikio)) = best_kvikio(b) else {
        let why = b
            .kvikio
            .iter()
            .find_map(|p| p.result.as_ref().err())
            .map_or("no row", String::as_str);
        return format!("not measured: KvikIO did not run ({why})");
    };
    let figures = peer.result.as_ref().expect("the best row has figures");
    let threads = figures
        .threads
        .map_or("?".to_owned(), |t| format!("{t} threads"));
    let through = kvikio_path(b, figures);
    format!(
        "{}: Direct {:.2} GB/s, {:.2}x KvikIO {:.2} GB/s ({threads}; {through})",
        judge(direct.gbps.median, kvikio, figures.gbps.min),
        direct.gbps.median,
        direct.gbps.median / kvikio,
        kvikio,
    )
}

/// How KvikIO read: through cuFile or its own POSIX path, from its statistics where it kept
/// them, else from what it said it prefers.
fn kvikio_path(b: &ColdBench, f: &PeerFigures) -> String {
    if let Some(backends) = f.backends.as_ref().and_then(|v| v.as_object())
        && !backends.is_empty()
    {
        let parts: Vec<String> = backends
            .iter()
            .map(|(name, bytes)| {
                let name = match name.as_str() {
                    "GDS" => "cuFile",
                    "POSIX" => "its own POSIX reads (KvikIO compat mode)",
                    other => other,
                };
                format!(
                    "{name}: {}",
                    bytes.as_u64().map_or("?".to_owned(), show_size)
                )
            })
            .collect();
        return format!("read through {}", parts.join(", "));
    }
    match b
        .kvikio_env
        .as_ref()
        .and_then(|e| e.get("compat_mode_preferred"))
        .and_then(|x| x.as_bool())
    {
        Some(true) => "KvikIO compat mode: its own POSIX reads, not cuFile".to_owned(),
        Some(false) => "through cuFile".to_owned(),
        None => "path unknown".to_owned(),
    }
}

/// Table 16: cold loads of the GPU file by every route and KvikIO.
pub fn table(s: &mut String, b: &ColdBench) {
    let _ = write!(
        s,
        "\n## Table 16 — cold loads of a file to the GPU: every route and KvikIO in one run\n\n"
    );
    if let Some(why) = &b.not_measured {
        let _ = writeln!(s, "Not measured: {why}.");
        return;
    }
    let _ = writeln!(
        s,
        "{} of random bytes ({}) to {}; each figure the median (min-max) of {} loads, each \
         after the file's pages were dropped from the page cache (fsync + \
         `POSIX_FADV_DONTNEED`; at most {:.1}% of it stayed). The routes take turns, each \
         repetition starting at the next; each loader loaded once untimed before. GB/s = the \
         file's bytes over the load's wall time (`LoadReport::gbps`: opening the file included).",
        show_size(b.file_bytes),
        b.path.display(),
        b.gpu.as_deref().unwrap_or("the GPU"),
        b.raw_direct_gbps.as_ref().map_or(0, |r| r.all.len()),
        100.0 * b.max_resident_after_evict.unwrap_or(0.0)
    );
    let raw = b.raw_direct_gbps.as_ref().map_or(f64::NAN, |r| r.median);
    let _ = writeln!(
        s,
        "\n| route | GB/s | share of the raw O_DIRECT read | what ran |\n|---|---|---|---|"
    );
    if let Some(r) = &b.raw_direct_gbps {
        let _ = writeln!(
            s,
            "| raw `O_DIRECT` read of the file to host memory (io_uring, qd 32, 1 MiB) | {} | \
             the disk's limit | - |",
            r.show(2)
        );
    }
    for r in &b.routes {
        let checked = if r.verified {
            "; bytes checked (xxh3)"
        } else {
            ""
        };
        let backend = if r.io_backend.is_empty() {
            String::new()
        } else {
            format!("; io: {}", r.io_backend.join(" / "))
        };
        match &r.refused {
            Some(why) => {
                let _ = writeln!(
                    s,
                    "| {} | cuFile refused: {why} | - | {}{checked} |",
                    r.what,
                    r.ran.join("; ")
                );
            }
            None => {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {}{backend}{checked} |",
                    r.what,
                    r.gbps.show(2),
                    share(r.gbps.median, raw, "the raw O_DIRECT read"),
                    r.ran.join("; ")
                );
            }
        }
    }
    for p in &b.kvikio {
        match &p.result {
            Ok(f) => {
                let threads = f
                    .threads
                    .map_or(String::new(), |t| format!("{t} threads; "));
                let mut verified = f
                    .verified
                    .as_deref()
                    .map_or(String::new(), |v| format!("; {v}"));
                if let Some(left) = f.max_resident_after_evict.filter(|&l| l > 0.01) {
                    let _ = write!(
                        verified,
                        "; up to {:.0}% of the file stayed cached after its evictions",
                        100.0 * left
                    );
                }
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {threads}{}{verified} |",
                    p.what,
                    f.gbps.show(2),
                    share(f.gbps.median, raw, "the raw O_DIRECT read"),
                    kvikio_path(b, f)
                );
            }
            Err(why) => {
                let _ = writeln!(s, "| {} | did not run: {why} | - | - |", p.what);
            }
        }
    }
    if let Some(env) = b.kvikio_env.as_ref().and_then(|e| e.as_object()) {
        let get = |k: &str| {
            env.get(k).map_or("?".to_owned(), |v| {
                v.as_str().map_or(v.to_string(), str::to_owned)
            })
        };
        let _ = writeln!(
            s,
            "\nKvikIO {} (CuPy {}): compat_mode {}, compat mode preferred (its own POSIX reads, \
             no cuFile): {}; default threads {}, task size {}, GDS threshold {}; libcufile {}, \
             cuFile driver: GDS available {}, compat mode allowed {}.",
            get("kvikio"),
            get("cupy"),
            get("compat_mode"),
            get("compat_mode_preferred"),
            get("default_num_threads"),
            get("task_size"),
            get("gds_threshold"),
            get("libcufile"),
            get("is_gds_available"),
            get("allow_compat_mode")
        );
    }
    let _ = writeln!(
        s,
        "\nAuto vs the best of direct, staged, cuFile: {}.\n\nDirect vs KvikIO (cuFile's compatibility mode or KvikIO's own POSIX reads, as its backend row says): {}.",
        b.auto_verdict, b.direct_verdict
    );
    for f in b.routes.iter().flat_map(|r| &r.fallbacks) {
        let _ = writeln!(s, "\nFallback: {f}.");
    }
    for n in &b.notes {
        let _ = writeln!(s, "\n{n}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(id: &'static str, runs: Vec<f64>, refused: Option<&str>) -> RouteRow {
        RouteRow {
            id,
            what: id,
            gbps: Samples::new(runs),
            ran: vec![format!("{id} (asked for)")],
            io_backend: Vec::new(),
            fallbacks: Vec::new(),
            residency_before: Vec::new(),
            refused: refused.map(str::to_owned),
            verified: true,
        }
    }

    fn bench(routes: Vec<RouteRow>, out: &serde_json::Value) -> ColdBench {
        let mut b = ColdBench::not_measured(PathBuf::from("/f"), 4 << 30, String::new());
        b.not_measured = None;
        b.raw_direct_gbps = Some(Samples::new(vec![1.5, 1.5, 1.5]));
        b.max_resident_after_evict = Some(0.0);
        b.routes = routes;
        (b.kvikio_env, b.kvikio) = peers_of(out);
        b.auto_verdict = auto_verdict(&b);
        b.direct_verdict = direct_verdict(&b);
        b
    }

    #[test]
    fn verdicts_compare_auto_with_the_best_route_and_direct_with_kvikio() {
        let out = serde_json::json!({
            "env": {"kvikio": "26.10.00", "compat_mode_preferred": false, "default_num_threads": 1},
            "rows": {
                "kvikio_16": {"threads": 16, "gbps": [1.40, 1.42, 1.41], "backends": {"GDS": 123}},
                "kvikio_default": {"threads": 1, "error": "RuntimeError: no"},
            }
        });
        let b = bench(
            vec![
                route("auto", vec![1.48, 1.49, 1.50], None),
                route("direct", vec![1.47, 1.49, 1.50], None),
                route("staged", vec![1.20, 1.21, 1.22], None),
                route("gds", vec![1.30, 1.31, 1.32], None),
            ],
            &out,
        );
        assert!(
            b.auto_verdict
                .starts_with("met: Auto 1.49 GB/s, 1.00x direct 1.49"),
            "{}",
            b.auto_verdict
        );
        assert!(
            b.direct_verdict
                .starts_with("met: Direct 1.49 GB/s, 1.06x KvikIO 1.41"),
            "{}",
            b.direct_verdict
        );
        assert!(
            b.direct_verdict.contains("16 threads; read through cuFile"),
            "{}",
            b.direct_verdict
        );
        let mut md = String::new();
        table(&mut md, &b);
        assert!(md.contains("## Table 16"), "{md}");
        assert!(md.contains("did not run: RuntimeError: no"), "{md}");
        assert!(
            md.contains("Auto vs the best of direct, staged, cuFile: met"),
            "{md}"
        );
    }

    #[test]
    fn a_refused_cufile_row_has_no_figure_and_is_not_the_best() {
        let out = serde_json::json!({"peers": {"error": "No module named 'kvikio'"}});
        let b = bench(
            vec![
                route("auto", vec![1.40, 1.41, 1.42], None),
                route("direct", vec![1.45, 1.46, 1.47], None),
                route("staged", vec![1.20, 1.21, 1.22], None),
                route(
                    "gds",
                    vec![9.0, 9.0, 9.0],
                    Some("no libcufile (direct ran instead)"),
                ),
            ],
            &out,
        );
        assert!(b.auto_verdict.starts_with("not met:"), "{}", b.auto_verdict);
        assert!(b.auto_verdict.contains("direct 1.46"), "{}", b.auto_verdict);
        assert!(
            b.auto_verdict.contains("cuFile refused"),
            "{}",
            b.auto_verdict
        );
        assert!(
            b.direct_verdict.contains("No module named 'kvikio'"),
            "{}",
            b.direct_verdict
        );
        let mut md = String::new();
        table(&mut md, &b);
        assert!(md.contains("cuFile refused: no libcufile"), "{md}");
        assert!(!md.contains("9.00"), "a refused row shows no figure: {md}");
    }

    #[test]
    fn auto_within_the_spread_is_said_so() {
        assert_eq!(judge(1.50, 1.50, 1.45), "met");
        assert!(judge(1.48, 1.50, 1.45).contains("within"));
        assert_eq!(judge(1.40, 1.50, 1.45), "not met");
    }
}
