//! # gpufeed-cli — layer 3 of gpufeed: the `gpufeed` binary
//!
//! Checks a machine, advises where data should live, loads files to the GPU, and manages the
//! page cache and gpufeed's shared memory; every command takes `--json` for scripts and
//! `--help` for its options.
//!
//! Depends on `gpufeed` (the facade) only.
//!
//! # Example
//! ```text
//! $ gpufeed doctor
//! $ gpufeed advise data/shard-000.bin --measure
//! $ gpufeed load model.safetensors --verify --json
//! ```

#![deny(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use gpufeed::cuda::DeviceAlloc;
use gpufeed::doctor::Status;
use gpufeed::os::cache;
use gpufeed::units::{parse_size, show_size};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

const EXIT_CODES: &str = "EXIT CODES:
  0  success
  1  doctor found a failing check, or load --verify found different bytes
  2  bad usage (unknown option, bad size string, ...)
  3  the operation failed (the one-line message on stderr says what to do)";

#[derive(Parser)]
#[command(
    name = "gpufeed",
    version,
    about = "Feed NVIDIA GPUs with data as fast as the hardware allows",
    after_help = format!("EXAMPLES:
  gpufeed doctor --path /data          check this machine for the data under /data
  gpufeed advise --persistent --processes 8 --path /data/train.bin --measure
  gpufeed load model.safetensors --verify
  gpufeed warm /data/*.bin             read files into the page cache
  gpufeed residency /data/*.bin --json how much of each file is cached
  gpufeed shm gc                       remove shared memory of dead gpufeed processes

{EXIT_CODES}")
)]
struct Cli {
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check this machine: limits, /dev/shm, THP, NUMA, io_uring, O_DIRECT, GPUs, pinned memory.
    Doctor {
        /// Directory the data lives in (for the O_DIRECT check).
        #[arg(long)]
        path: Option<PathBuf>,
    },
    /// Where data should live (the selection tree, with reasons) and how it should reach the GPU.
    Advise {
        /// The data must outlive the processes.
        #[arg(long)]
        persistent: bool,
        /// Processes reading it at once.
        #[arg(long, default_value_t = 1)]
        processes: usize,
        /// Its size (e.g. 4GiB).
        #[arg(long, value_parser = size_arg, conflicts_with = "path")]
        size: Option<u64>,
        /// A file holding it (size and page-cache residency are read from it).
        #[arg(long)]
        path: Option<PathBuf>,
        /// Also run short trials on this machine and rank the ways by measured GB/s.
        #[arg(long, requires = "path")]
        measure: bool,
    },
    /// Load a file into GPU memory and report how.
    Load {
        path: PathBuf,
        /// The GPU's CUDA ordinal.
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// auto, registered, staged or direct.
        #[arg(long, default_value = "auto")]
        strategy: String,
        /// Copy the bytes back and compare their xxh3 with the file's.
        #[arg(long)]
        verify: bool,
    },
    /// Read files into the page cache.
    Warm { paths: Vec<PathBuf> },
    /// Drop files from the page cache.
    Evict { paths: Vec<PathBuf> },
    /// How much of each file is in the page cache (like fincore / vmtouch).
    Residency { paths: Vec<PathBuf> },
    /// Keep files resident with mlock until interrupted (within the memlock limit).
    Lock {
        paths: Vec<PathBuf>,
        /// Release after this many seconds instead of waiting for Ctrl-C.
        #[arg(long)]
        seconds: Option<u64>,
    },
    /// gpufeed's shared-memory segments in /dev/shm.
    #[command(subcommand)]
    Shm(ShmCommand),
}

#[derive(Subcommand)]
enum ShmCommand {
    /// List segments, with their owners and whether they still run.
    Ls {
        #[arg(long, default_value = gpufeed::os::shm::DEFAULT_PREFIX)]
        prefix: String,
    },
    /// Remove the segments whose owner process died. Segments made in another PID namespace
    /// (a container sharing /dev/shm) are kept: their owner's pid says nothing here.
    Gc {
        #[arg(long, default_value = gpufeed::os::shm::DEFAULT_PREFIX)]
        prefix: String,
        /// Also remove segments of other PID namespaces (only when no container uses them).
        #[arg(long)]
        other_namespaces: bool,
    },
}

fn size_arg(text: &str) -> Result<u64, String> {
    parse_size(text).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("gpufeed: error: {msg}");
            ExitCode::from(3)
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    let json = cli.json;
    match cli.command {
        Command::Doctor { path } => doctor(path.as_deref(), json),
        Command::Advise {
            persistent,
            processes,
            size,
            path,
            measure,
        } => advise(persistent, processes, size, path.as_deref(), measure, json),
        Command::Load {
            path,
            gpu,
            strategy,
            verify,
        } => load(&path, gpu, &strategy, verify, json),
        Command::Warm { paths } => cache_op(&paths, json, "warm"),
        Command::Evict { paths } => cache_op(&paths, json, "evict"),
        Command::Residency { paths } => cache_op(&paths, json, "residency"),
        Command::Lock { paths, seconds } => lock(&paths, seconds, json),
        Command::Shm(ShmCommand::Ls { prefix }) => shm_ls(&prefix, json),
        Command::Shm(ShmCommand::Gc {
            prefix,
            other_namespaces,
        }) => shm_gc(&prefix, other_namespaces, json),
    }
}

fn print_json(v: &serde_json::Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn doctor(path: Option<&Path>, json: bool) -> Result<ExitCode> {
    let checks = gpufeed::doctor::run(path);
    if json {
        print_json(&serde_json::to_value(&checks)?)?;
    } else {
        for c in &checks {
            let tag = match c.status {
                Status::Ok => "OK  ",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
            };
            println!("{tag}  {:<24} {}", c.name, c.observed);
            if let Some(fix) = &c.fix
                && c.status != Status::Ok
            {
                println!("      {:<24} fix: {fix}", "");
            }
        }
    }
    Ok(if gpufeed::doctor::any_failed(&checks) {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn advise(
    persistent: bool,
    processes: usize,
    size: Option<u64>,
    path: Option<&Path>,
    measure: bool,
    json: bool,
) -> Result<ExitCode> {
    let (size_bytes, resident) = match (size, path) {
        (Some(s), _) => (s, None),
        (None, Some(p)) => match cache::residency(p) {
            Ok(r) => (r.file_bytes, Some(r.fraction())),
            // Advice without the cache's state rather than advice from a wrong figure.
            Err(gpufeed::os::Error::ResidencyUnknown { .. }) => {
                let id = gpufeed::os::file::stat_regular(p)
                    .with_context(|| format!("read {}", p.display()))?;
                (id.size, None)
            }
            Err(e) => return Err(e).with_context(|| format!("read {}", p.display())),
        },
        (None, None) => bail!("say how large the data is: --size 4GiB or --path FILE"),
    };
    let workload = gpufeed::advise::Workload {
        persistent,
        processes: processes.max(1),
        size_bytes,
        resident,
    };
    let rec = gpufeed::advise::advise(&workload);
    let trials = match (measure, path) {
        (true, Some(p)) => Some(gpufeed::advise::measure(p, 1 << 30)?),
        _ => None,
    };
    if json {
        return print_json(
            &json!({ "workload": workload, "recommendation": rec, "trials": trials }),
        )
        .map(|()| ExitCode::SUCCESS);
    }
    println!("Store the data as: {}", rec.storage);
    for r in &rec.reasons {
        println!("  because {r}");
    }
    println!("Scores (volatility 40%, sharing 30%, size 20%, complexity 10%):");
    for s in &rec.scores {
        println!("  {:.2}  {}", s.score, s.option);
    }
    println!("To the GPU: {}", rec.transfer);
    for s in &rec.settings {
        println!("  - {s}");
    }
    if let Some(m) = trials {
        println!(
            "Measured here on the first {} (median of {} loads after a warm-up; best first):",
            show_size(m.bytes),
            m.loads_per_trial.saturating_sub(1).max(1)
        );
        for t in &m.trials {
            match (t.gbps, &t.error) {
                (Some(g), _) => println!("  {g:>7.2} GB/s  {}", t.name),
                (None, e) => println!(
                    "     -         {} ({})",
                    t.name,
                    e.as_deref().unwrap_or("did not run")
                ),
            }
        }
        println!("Auto picks {} ({})", m.auto, m.auto_reason);
        println!("{}", m.verdict);
    }
    Ok(ExitCode::SUCCESS)
}

fn bar(len: u64, what: &str, json: bool) -> ProgressBar {
    if json {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    pb.set_message(what.to_owned());
    pb
}

fn load(path: &Path, ordinal: usize, strategy: &str, verify: bool, json: bool) -> Result<ExitCode> {
    let strategy: gpufeed::Strategy = strategy.parse()?;
    // The file first (missing, a directory, a FIFO, a procfs file), then the GPU.
    let len = gpufeed::os::file::stat_regular(path)?.size;
    // The GPU's context is created on another thread while this one prepares the staging.
    let loader = gpufeed::Loader::open(
        ordinal,
        gpufeed::LoadOptions::default().with_strategy(strategy),
    )?;
    let gpu = loader.gpu().clone();
    let setup = loader.setup().clone();
    // Loaded in pieces so that the bar moves on large files; each piece is one load_into, and
    // pays a load's fixed costs: 4 GiB pieces (80 ms at 50 GB/s) keep those small.
    const PIECE: u64 = 4 << 30;
    let pb = bar(len, &format!("load {}", path.display()), json);
    let t = std::time::Instant::now();
    // Loaded once: cuMemAlloc, not a growth of the context's pool on the load's path.
    let (dst, reports) = gpu.alloc_filled(len as usize, DeviceAlloc::Unpooled, |dst| {
        let mut reports = Vec::new();
        let mut at = 0;
        while at < len {
            let end = (at + PIECE).min(len);
            reports.push(loader.load_into(path, at..end, dst, at as usize)?);
            pb.set_position(end);
            at = end;
        }
        Ok::<_, gpufeed::Error>(reports)
    })?;
    pb.finish_and_clear();
    let secs = t.elapsed().as_secs_f64();
    let gbps = gpufeed::os::gbps(len, secs);
    let verified = if verify {
        let back = gpu.to_vec(&dst)?;
        let file =
            std::fs::read(path).with_context(|| format!("read {} to verify", path.display()))?;
        Some(xxhash_rust::xxh3::xxh3_64(&back) == xxhash_rust::xxh3::xxh3_64(&file))
    } else {
        None
    };
    let mut fallbacks = Vec::new();
    for f in setup
        .fallbacks
        .iter()
        .chain(reports.iter().flat_map(|r| &r.fallbacks))
    {
        if !fallbacks.contains(f) {
            fallbacks.push(f.clone());
        }
    }
    let first = reports.first();
    if json {
        print_json(&json!({
            "path": path, "bytes": len, "seconds": secs, "gbps": gbps,
            "context_seconds": setup.context_seconds, "ready_seconds": setup.total_seconds,
            "staging_bytes": setup.staging_bytes,
            "strategy": first.map(|r| r.strategy.to_string()),
            "reason": first.map(|r| r.reason.clone()),
            "fallbacks": fallbacks, "verified": verified, "pieces": reports,
        }))?;
    } else {
        println!(
            "{}: {} in {:.3} s = {gbps:.2} GB/s to GPU {ordinal} ({})",
            path.display(),
            show_size(len),
            secs,
            gpu.info().name
        );
        println!(
            "before it: the GPU's context took {:.0} ms; the loader was ready after {:.0} ms \
             ({} of pinned staging prepared meanwhile)",
            setup.context_seconds.unwrap_or(0.0) * 1e3,
            setup.total_seconds * 1e3,
            show_size(setup.staging_bytes)
        );
        if let Some(r) = first {
            println!("strategy: {} ({})", r.strategy, r.reason);
        }
        for f in &fallbacks {
            println!("fallback: {f}");
        }
        match verified {
            Some(true) => println!("verified: the bytes on the GPU match the file (xxh3)"),
            Some(false) => println!("VERIFY FAILED: the bytes on the GPU differ from the file"),
            None => {}
        }
    }
    Ok(if verified == Some(false) {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn cache_op(paths: &[PathBuf], json: bool, op: &str) -> Result<ExitCode> {
    if paths.is_empty() {
        bail!("name at least one file");
    }
    let (mut resident, mut total) = (0u64, 0u64);
    let mut rows = Vec::new();
    for p in paths {
        let r = match op {
            "warm" => {
                let len = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
                let pb = bar(len, &format!("warm {}", p.display()), json);
                let r = cache::warm_with_progress(p, |done, _| pb.set_position(done));
                pb.finish_and_clear();
                r
            }
            "evict" => cache::evict(p),
            _ => cache::residency(p),
        };
        let r = match r {
            Ok(r) => r,
            // The operation was done (warm, evict), only its measurement was refused: no
            // figure rather than a wrong one.
            Err(gpufeed::os::Error::ResidencyUnknown { reason, .. }) => {
                rows.push(json!({ "path": p, "fraction": null, "unknown": reason }));
                if !json {
                    println!("{:>7}  {}  (unknown: {reason})", "?", p.display());
                }
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("{op} {}", p.display())),
        };
        resident += r.resident_pages;
        total += r.total_pages;
        rows.push(json!({
            "path": p, "resident_pages": r.resident_pages, "total_pages": r.total_pages,
            "page_size": r.page_size, "bytes": r.file_bytes, "fraction": r.fraction(),
            "method": format!("{:?}", r.method), "approximate": r.approximate,
        }));
        if !json {
            println!(
                "{:>6.1}%  {:>10} / {:<10} pages  {:>10}  {}",
                r.fraction() * 100.0,
                r.resident_pages,
                r.total_pages,
                show_size(r.file_bytes),
                p.display(),
            );
        }
    }
    if json {
        print_json(&json!({ "files": rows, "resident_pages": resident, "total_pages": total }))?;
    } else if paths.len() > 1 {
        let f = if total == 0 {
            1.0
        } else {
            resident as f64 / total as f64
        };
        println!(
            "{:>6.1}%  {resident:>10} / {total:<10} pages  total",
            f * 100.0
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn lock(paths: &[PathBuf], seconds: Option<u64>, json: bool) -> Result<ExitCode> {
    if paths.is_empty() {
        bail!("name at least one file");
    }
    let mut maps = Vec::new();
    for p in paths {
        #[allow(unsafe_code, reason = "the mapped-file promise, passed on")]
        // SAFETY: the files are only read, page by page, while locked; a file truncated
        // meanwhile would raise SIGBUS, which `gpufeed lock` documents by being a read-only
        // tool for data sets that are not being rewritten.
        let map = unsafe { gpufeed::os::FileMap::open(p, gpufeed::os::MapMode::ReadOnly) }
            .with_context(|| format!("map {}", p.display()))?;
        maps.push(map);
    }
    let locks = maps
        .iter()
        .map(|m| {
            m.lock()
                .with_context(|| format!("lock {}", m.path().display()))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes: usize = locks.iter().map(|l| l.len()).sum();
    if json {
        print_json(&json!({ "locked_bytes": bytes, "files": paths }))?;
    } else {
        println!(
            "{} locked in RAM across {} file(s); Ctrl-C releases them",
            show_size(bytes as u64),
            paths.len()
        );
    }
    match seconds {
        Some(s) => std::thread::sleep(Duration::from_secs(s)),
        None => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
    }
    Ok(ExitCode::SUCCESS)
}

fn shm_ls(prefix: &str, json: bool) -> Result<ExitCode> {
    let list = gpufeed::os::shm::list(prefix)?;
    if json {
        let rows: Vec<_> = list
            .iter()
            .map(|e| json!({ "name": e.name, "bytes": e.len, "owner_pid": e.owner_pid, "owner_pid_ns": e.owner_pid_ns, "owner": liveness_word(e.owner) }))
            .collect();
        print_json(&json!(rows))?;
    } else if list.is_empty() {
        println!("no {prefix}-* segments in /dev/shm");
    } else {
        for e in &list {
            println!(
                "{:<10} pid {:<8} {:<5} {}",
                show_size(e.len),
                e.owner_pid,
                liveness_word(e.owner),
                e.name
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn liveness_word(l: gpufeed::os::process::Liveness) -> &'static str {
    use gpufeed::os::process::Liveness;
    match l {
        Liveness::Alive => "live",
        Liveness::Dead => "DEAD",
        Liveness::OtherNamespace => "other-ns",
    }
}

fn shm_gc(prefix: &str, other_namespaces: bool, json: bool) -> Result<ExitCode> {
    use gpufeed::os::shm::{self, ForeignSegments};
    let foreign = if other_namespaces {
        ForeignSegments::Remove
    } else {
        ForeignSegments::Keep
    };
    let report = shm::gc_in_with(std::path::Path::new(shm::DEFAULT_DIR), prefix, foreign)?;
    if json {
        print_json(
            &json!({ "removed": report.removed, "removed_bytes": report.removed_bytes, "kept": report.kept, "other_namespace": report.other_namespace }),
        )?;
    } else {
        println!(
            "removed {} segment(s) ({}); kept {} of live processes, {} of other PID namespaces{}",
            report.removed.len(),
            show_size(report.removed_bytes),
            report.kept.len(),
            report.other_namespace.len(),
            if report.other_namespace.is_empty() || other_namespaces {
                ""
            } else {
                " (their owners may be alive in another container; --other-namespaces removes them)"
            }
        );
        for n in &report.removed {
            println!("  removed {n}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
