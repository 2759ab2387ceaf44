//! # gpufeed-cli — layer 3 of gpufeed: the `gpufeed` binary
//!
//! Checks a machine, advises where data should live, loads files to the GPU, and manages the
//! page cache and gpufeed's shared memory; every command takes `--json` for scripts and
//! `--help` for its options.
//!
//! Depends on `gpufeed` (the facade) only.
//!
//! Every `--json` output is one object with `"version": 1` and `"command"`; the fields of each
//! command are listed in docs/cli.md.
//!
//! # Example
//! ```text
//! $ gpufeed doctor
//! $ gpufeed advise --path data/shard-000.bin --measure
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
  2  bad usage (unknown option or value, a missing argument, a bad size string, ...)
  3  the operation failed (the one-line message on stderr says what to do)";

/// The version of every `--json` output's shape (docs/cli.md); raised when a field changes
/// meaning or goes away, not when one is added.
const JSON_VERSION: u32 = 1;

/// The largest size `--size` takes: 1 EiB, more than any file system holds today.
const MAX_SIZE: u64 = 1 << 60;

#[derive(Parser)]
#[command(
    name = "gpufeed",
    version,
    about = "Feed NVIDIA GPUs with data as fast as the hardware allows",
    after_help = format!("EXAMPLES:
  gpufeed doctor --path /data          check this machine for the data under /data
  gpufeed advise --persistent --processes 8 --path /data/train.bin --measure
  gpufeed load model.safetensors --verify  a checkpoint: each tensor checked (xxh3)
  gpufeed load data/shard-000.bin           any file: its bytes as they are
  gpufeed load model.bin --gpus 0,1 --replicate --verify  all of it on both GPUs
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
    #[command(group(clap::ArgGroup::new("data").required(true).args(["size", "path"])))]
    Advise {
        /// The data must outlive the processes.
        #[arg(long)]
        persistent: bool,
        /// Processes reading it at once.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
        processes: u64,
        /// Its size (e.g. 4GiB, 1.5TiB).
        #[arg(long, value_parser = size_arg, conflicts_with = "path")]
        size: Option<u64>,
        /// A file holding it (size and page-cache residency are read from it).
        #[arg(long)]
        path: Option<PathBuf>,
        /// Also run short trials on this machine (the first GiB of --path) and rank the ways by
        /// measured GB/s.
        #[arg(long, requires = "path")]
        measure: bool,
    },
    /// Load a file, or an object (s3://bucket/key, https://host/path), into GPU memory and
    /// report how. An object is read by ranged GETs into the pinned staging, its version
    /// pinned at the first request; credentials and endpoint come from AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL or AWS_PROFILE. A `.safetensors` file or a
    /// `.safetensors.index.json` is loaded as a checkpoint: its headers are checked and each
    /// tensor placed (--raw loads the bytes as they are). With --gpus, onto several GPUs at
    /// once: the file cut into one contiguous share per GPU, or with --replicate all of it on
    /// every GPU (each reads a share, the rest arrives from the others over NVLink).
    Load {
        path: PathBuf,
        /// The GPU's CUDA ordinal.
        #[arg(long, default_value_t = 0, conflicts_with = "gpus")]
        gpu: usize,
        /// Several GPUs' ordinals, comma-separated (0,1): a share of the file on each, sized
        /// together from one host budget.
        #[arg(long, value_delimiter = ',')]
        gpus: Vec<usize>,
        /// With --gpus: all of the file (or checkpoint) on every GPU.
        #[arg(long, requires = "gpus")]
        replicate: bool,
        /// auto, registered, staged, direct or gds (cuFile: GPUDirect Storage).
        #[arg(long, default_value = "auto", value_parser = strategy_arg)]
        strategy: gpufeed::Strategy,
        /// With --strategy gds: where cuFile reads into. auto: device buffers registered once
        /// (then a copy on the GPU) where cuFile reads through nvidia-fs, else the destination;
        /// registered: the same, saying why where it reads into the destination;
        /// destination: straight in.
        #[arg(long, default_value = "auto", value_parser = gds_buffers_arg)]
        gds_buffers: gpufeed::GdsBuffers,
        /// Copy the bytes back and compare their xxh3 with the file's (for a checkpoint: each
        /// tensor's).
        #[arg(long)]
        verify: bool,
        /// Load a checkpoint's file as plain bytes, header included.
        #[arg(long)]
        raw: bool,
    },
    /// Read files into the page cache.
    Warm {
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Drop files from the page cache.
    Evict {
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// How much of each file is in the page cache (like fincore / vmtouch).
    Residency {
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Keep files resident with mlock until interrupted or --seconds pass (within the memlock
    /// limit).
    Lock {
        #[arg(required = true)]
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
    /// List segments, with their owners and whether they still run, and rendezvous segments
    /// (`<prefix>-rdv-*`: jobs whose ranks are still meeting, or crashed jobs' leftovers) with
    /// rank 0's pid and whether a rank may still use them.
    Ls {
        #[arg(long, default_value = gpufeed::os::shm::DEFAULT_PREFIX)]
        prefix: String,
    },
    /// Remove the segments whose owner process died, rendezvous segments whose ranks all died
    /// (crashed jobs'), and the descriptor sockets (`.gpufeed-fd-*`) that ranks killed while
    /// passing descriptors left, once an hour old. Segments made in another PID namespace (a
    /// container sharing /dev/shm) are kept: their owner's pid says nothing here.
    Gc {
        #[arg(long, default_value = gpufeed::os::shm::DEFAULT_PREFIX)]
        prefix: String,
        /// Also remove segments of other PID namespaces (only when no container uses them).
        #[arg(long)]
        other_namespaces: bool,
    },
}

fn size_arg(text: &str) -> Result<u64, String> {
    match parse_size(text).map_err(|e| e.to_string())? {
        0 => Err("the size must be at least 1 byte".into()),
        n if n > MAX_SIZE => Err(format!(
            "{} is larger than 1 EiB, more than any file system holds; check the number",
            show_size(n)
        )),
        n => Ok(n),
    }
}

fn gds_buffers_arg(text: &str) -> Result<gpufeed::GdsBuffers, String> {
    text.parse()
        .map_err(|e: gpufeed::load::Error| e.to_string())
}

fn strategy_arg(text: &str) -> Result<gpufeed::Strategy, String> {
    text.parse()
        .map_err(|e: gpufeed::load::Error| e.to_string())
}

fn main() -> ExitCode {
    gpufeed::log_to_stderr();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpufeed: error: {}", one_line(&e));
            ExitCode::from(3)
        }
    }
}

/// The error and its causes on one line, each said once: a cause whose text its parent
/// already includes (`open x: Permission denied` above `Permission denied`) is left out.
fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out.replace('\n', " ")
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
        } => {
            if measure && path.is_none() {
                // clap's `requires` does not hold a flag to it; the same usage error by hand.
                use clap::CommandFactory;
                Cli::command()
                    .error(
                        clap::error::ErrorKind::MissingRequiredArgument,
                        "--measure runs trials on a file: give it with --path FILE (--size alone has nothing to read)",
                    )
                    .exit();
            }
            advise(persistent, processes, size, path.as_deref(), measure, json)
        }
        Command::Load {
            path,
            gpu,
            gpus,
            replicate,
            strategy,
            gds_buffers,
            verify,
            raw,
        } => {
            if let Some(url) = path
                .to_str()
                .filter(|p| gpufeed::object::ObjectUrl::is_url(p))
            {
                if !gpus.is_empty() {
                    use clap::CommandFactory;
                    Cli::command()
                        .error(
                            clap::error::ErrorKind::ArgumentConflict,
                            "an object loads onto one GPU here: drop --gpus",
                        )
                        .exit();
                }
                // Fewer fill threads with larger pieces, twice the bytes in flight (for_objects).
                let opts = gpufeed::LoadOptions::for_objects()
                    .with_strategy(strategy)
                    .with_gds_buffers(gds_buffers);
                if !raw && gpufeed::safetensors::is_checkpoint_name(&path) {
                    return load_checkpoint(&path, gpu, opts, verify, json);
                }
                return load_object(url, gpu, opts, verify, json);
            }
            let checkpoint = !raw && gpufeed::safetensors::is_checkpoint_name(&path);
            if !gpus.is_empty() {
                use clap::CommandFactory;
                if let Some(g) = gpus
                    .iter()
                    .find(|&&g| gpus.iter().filter(|&&o| o == g).count() > 1)
                {
                    Cli::command()
                        .error(
                            clap::error::ErrorKind::ValueValidation,
                            format!("--gpus names GPU {g} twice: give each GPU once"),
                        )
                        .exit();
                }
                if checkpoint && !replicate {
                    Cli::command()
                        .error(
                            clap::error::ErrorKind::ArgumentConflict,
                            "a checkpoint onto several GPUs: --replicate puts all of it on each \
                             (--raw cuts the file's bytes into shares; tensor-parallel cuts \
                             are gpufeed::safetensors::TensorParallel in the library)",
                        )
                        .exit();
                }
                let opts = gpufeed::LoadOptions::for_gpus(gpus.len())
                    .with_strategy(strategy)
                    .with_gds_buffers(gds_buffers);
                return load_multi(&path, &gpus, replicate, checkpoint, opts, verify, json);
            }
            let opts = gpufeed::LoadOptions::default()
                .with_strategy(strategy)
                .with_gds_buffers(gds_buffers);
            if checkpoint {
                load_checkpoint(&path, gpu, opts, verify, json)
            } else {
                load(&path, gpu, opts, verify, json)
            }
        }
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

/// Prints `fields` (an object) as the JSON output of `command`, with the schema's version.
fn print_json(command: &str, fields: serde_json::Value) -> Result<()> {
    let mut out = json!({ "version": JSON_VERSION, "command": command });
    if let (Some(out), serde_json::Value::Object(fields)) = (out.as_object_mut(), fields) {
        out.extend(fields);
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

fn doctor(path: Option<&Path>, json: bool) -> Result<ExitCode> {
    let checks = gpufeed::doctor::run(path);
    let failed = gpufeed::doctor::any_failed(&checks);
    if json {
        print_json("doctor", json!({ "checks": checks, "failed": failed }))?;
    } else {
        for c in &checks {
            let tag = match c.status {
                Status::Ok => "OK  ",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
            };
            println!("{tag}  {:<24} {}", c.name, c.observed);
            // An OK check may carry a fix too: an optional path it could take (GPUDirect
            // Storage in compatibility mode).
            if let Some(fix) = &c.fix {
                println!("      {:<24} fix: {fix}", "");
            }
        }
    }
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn advise(
    persistent: bool,
    processes: u64,
    size: Option<u64>,
    path: Option<&Path>,
    measure: bool,
    json: bool,
) -> Result<ExitCode> {
    let processes = usize::try_from(processes).unwrap_or(usize::MAX);
    let workload = match (size, path) {
        (Some(size_bytes), _) => gpufeed::advise::Workload {
            persistent,
            processes,
            size_bytes,
            resident: None,
        },
        (None, Some(p)) => gpufeed::advise::Workload::of_file(p, persistent, processes)?,
        // clap's group requires one of them.
        (None, None) => bail!("say how large the data is: --size 4GiB or --path FILE"),
    };
    let size_bytes = workload.size_bytes;
    let rec = gpufeed::advise::advise(&workload);
    let trials = match (measure, path) {
        (true, Some(p)) => {
            let pb = spinner(
                &format!(
                    "measuring: trials on the first {} of {}",
                    show_size(size_bytes.min(1 << 30)),
                    p.display()
                ),
                json,
            );
            let m = gpufeed::advise::measure(p, 1 << 30);
            pb.finish_and_clear();
            Some(m?)
        }
        _ => None,
    };
    if json {
        print_json(
            "advise",
            json!({ "workload": workload, "recommendation": rec, "trials": trials }),
        )?;
        return Ok(ExitCode::SUCCESS);
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
        let loads = m.loads_per_trial.saturating_sub(1).max(1);
        println!(
            "Measured here on the first {} ({} after a warm-up; best first):",
            show_size(m.bytes),
            if loads == 1 {
                "one load".to_owned()
            } else {
                format!("median of {loads} loads")
            }
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

/// A bar of `len` bytes on stderr; hidden with `--json` and when stderr is not a terminal
/// (indicatif draws nothing there).
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

/// A spinner with the elapsed time, for work without a byte count; hidden like [`bar`].
fn spinner(what: &str, json: bool) -> ProgressBar {
    if json {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("a valid template"),
    );
    pb.set_message(what.to_owned());
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// The distinct fallbacks of a loader's setup and of its loads, in order.
fn fallbacks_of<'a>(
    setup: &'a gpufeed::LoaderSetup,
    reports: impl IntoIterator<Item = &'a gpufeed::LoadReport>,
) -> Vec<gpufeed::Fallback> {
    let mut out: Vec<gpufeed::Fallback> = Vec::new();
    for f in setup
        .fallbacks
        .iter()
        .chain(reports.into_iter().flat_map(|r| &r.fallbacks))
    {
        if !out.contains(f) {
            out.push(f.clone());
        }
    }
    out
}

/// What `load` prints for any file: the time, the loader's setup, the strategy, fallbacks.
fn print_load_summary(
    what: &str,
    bytes: u64,
    secs: f64,
    loader: &gpufeed::Loader,
    fallbacks: &[gpufeed::Fallback],
) {
    let setup = loader.setup();
    println!(
        "{what}: {} in {:.3} s = {:.2} GB/s to GPU {} ({})",
        show_size(bytes),
        secs,
        gpufeed::os::gbps(bytes, secs),
        loader.gpu().info().ordinal,
        loader.gpu().info().name
    );
    println!(
        "before it: the GPU's context took {:.0} ms; the loader was ready after {:.0} ms \
         ({} of pinned staging prepared meanwhile)",
        setup.context_seconds.unwrap_or(0.0) * 1e3,
        setup.total_seconds * 1e3,
        show_size(setup.staging_bytes)
    );
    for f in fallbacks {
        println!("fallback: {f}");
    }
}

fn print_verified(verified: Option<bool>, what: &str) {
    match verified {
        Some(true) => println!("verified: {what} on the GPU match the source (xxh3)"),
        Some(false) => println!("VERIFY FAILED: {what} on the GPU differ from the source"),
        None => {}
    }
}

fn verify_code(verified: Option<bool>) -> ExitCode {
    if verified == Some(false) {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// `len` bytes loaded into new device memory in pieces so that the bar moves on large loads:
/// each piece is one `load(range, dst)` and pays a load's fixed costs, which 4 GiB pieces (80
/// ms at 50 GB/s) keep small. Loaded once: cuMemAlloc, not a growth of the context's pool on
/// the load's path.
fn load_in_pieces(
    gpu: &gpufeed::Gpu,
    len: u64,
    pb: &ProgressBar,
    mut load: impl FnMut(
        &std::ops::Range<u64>,
        &mut gpufeed::DeviceBuffer,
    ) -> gpufeed::load::Result<gpufeed::LoadReport>,
) -> Result<(gpufeed::DeviceBuffer, Vec<gpufeed::LoadReport>)> {
    const PIECE: u64 = 4 << 30;
    let (dst, reports) = gpu.alloc_filled(len as usize, DeviceAlloc::Unpooled, |dst| {
        let mut reports = Vec::new();
        let mut at = 0;
        while at < len {
            let end = (at + PIECE).min(len);
            reports.push(load(&(at..end), dst)?);
            pb.set_position(end);
            at = end;
        }
        Ok::<_, gpufeed::Error>(reports)
    })?;
    Ok((dst, reports))
}

/// `gpufeed load s3://...`: an object into GPU memory, in 4 GiB pieces for the bar.
fn load_object(
    url: &str,
    ordinal: usize,
    opts: gpufeed::LoadOptions,
    verify: bool,
    json: bool,
) -> Result<ExitCode> {
    use gpufeed::object::{Object, ObjectOptions};
    // The object first (not found, access denied), then the GPU.
    let object = Object::open(url, &ObjectOptions::default())?;
    let len = object.len();
    let loader = gpufeed::Loader::open(ordinal, opts)?;
    let gpu = loader.gpu().clone();
    let pb = bar(len, &format!("load {url}"), json);
    let t = std::time::Instant::now();
    let (dst, reports) = load_in_pieces(&gpu, len, &pb, |range, dst| {
        loader.load_object_into(&object, range.clone(), dst, range.start as usize)
    })?;
    pb.finish_and_clear();
    let secs = t.elapsed().as_secs_f64();
    let verified = if verify {
        let back = gpu.to_vec(&dst)?;
        let host = object
            .read_all()
            .with_context(|| format!("read {url} again to verify"))?;
        Some(xxhash_rust::xxh3::xxh3_64(&back) == xxhash_rust::xxh3::xxh3_64(&host))
    } else {
        None
    };
    let fallbacks = fallbacks_of(loader.setup(), &reports);
    let setup = loader.setup();
    if json {
        print_json(
            "load",
            json!({
                "kind": "object", "url": url, "etag": object.etag(), "gpu": ordinal,
                "bytes": len, "seconds": secs, "gbps": gpufeed::os::gbps(len, secs),
                "context_seconds": setup.context_seconds, "ready_seconds": setup.total_seconds,
                "staging_bytes": setup.staging_bytes,
                "reason": reports.first().map(|r| r.reason.clone()),
                "fallbacks": fallbacks, "verified": verified, "pieces": reports,
            }),
        )?;
    } else {
        print_load_summary(url, len, secs, &loader, &fallbacks);
        if let Some(r) = reports.first() {
            println!("route: {}", r.reason);
        }
        print_verified(verified, "the bytes");
    }
    Ok(verify_code(verified))
}

fn load(
    path: &Path,
    ordinal: usize,
    opts: gpufeed::LoadOptions,
    verify: bool,
    json: bool,
) -> Result<ExitCode> {
    // The file first (missing, a directory, a FIFO, a procfs file), then the GPU.
    let len = gpufeed::os::file::stat_regular(path)?.size;
    // The GPU's context is created on another thread while this one prepares the staging.
    let loader = gpufeed::Loader::open(ordinal, opts)?;
    let gpu = loader.gpu().clone();
    let pb = bar(len, &format!("load {}", path.display()), json);
    let t = std::time::Instant::now();
    let (dst, reports) = load_in_pieces(&gpu, len, &pb, |range, dst| {
        loader.load_into(path, range.clone(), dst, range.start as usize)
    })?;
    pb.finish_and_clear();
    let secs = t.elapsed().as_secs_f64();
    let verified = if verify {
        let back = gpu.to_vec(&dst)?;
        let file =
            std::fs::read(path).with_context(|| format!("read {} to verify", path.display()))?;
        Some(xxhash_rust::xxh3::xxh3_64(&back) == xxhash_rust::xxh3::xxh3_64(&file))
    } else {
        None
    };
    let fallbacks = fallbacks_of(loader.setup(), &reports);
    let first = reports.first();
    let setup = loader.setup();
    if json {
        print_json(
            "load",
            json!({
                "kind": "file", "path": path, "gpu": ordinal, "bytes": len, "seconds": secs,
                "gbps": gpufeed::os::gbps(len, secs),
                "context_seconds": setup.context_seconds, "ready_seconds": setup.total_seconds,
                "staging_bytes": setup.staging_bytes,
                "strategy": first.map(|r| r.strategy),
                "reason": first.map(|r| r.reason.clone()),
                "fallbacks": fallbacks, "verified": verified, "pieces": reports,
            }),
        )?;
    } else {
        print_load_summary(&path.display().to_string(), len, secs, &loader, &fallbacks);
        if let Some(r) = first {
            println!("strategy: {} ({})", r.strategy, r.reason);
            if let Some(io) = &r.io_backend {
                println!("read by: {io}");
            }
        }
        let registered = loader.gds_registered_bytes();
        if registered > 0 {
            println!(
                "cuFile read into {} of device buffers registered once (then copied on the GPU)",
                show_size(registered)
            );
        }
        print_verified(verified, "the bytes");
    }
    Ok(verify_code(verified))
}

/// What one GPU of `load --gpus` holds: the file's byte ranges (none for a checkpoint, held
/// whole), whether they match the file (`None` without --verify), a checkpoint's tensors that
/// differ.
struct GpuHolds(Vec<std::ops::Range<u64>>, Option<bool>, Vec<String>);

/// `load --gpus`: the file cut into one share per GPU, or (`replicate`) all of it, or of the
/// checkpoint, on every GPU; `verify` compares each GPU's bytes with the file's.
fn load_multi(
    path: &Path,
    gpus: &[usize],
    replicate: bool,
    checkpoint: bool,
    opts: gpufeed::LoadOptions,
    verify: bool,
    json: bool,
) -> Result<ExitCode> {
    use gpufeed::multi::{MultiLoader, ShardPlan};
    // The file (and a checkpoint's headers) first, then the GPUs.
    let layout = match checkpoint {
        true => Some(gpufeed::safetensors::inspect(path)?),
        false => None,
    };
    // The bytes every GPU holds when replicated: a checkpoint's data sections, else the file.
    let len = match &layout {
        Some(layout) => layout.iter().map(|f| f.data_bytes).sum(),
        None => gpufeed::os::file::stat_regular(path)?.size,
    };
    let multi = MultiLoader::open(gpus, opts)?;
    let how = if replicate { "replicated" } else { "sharded" };
    let pb = spinner(
        &format!("load {} onto GPUs {gpus:?}, {how}", path.display()),
        json,
    );
    // Each GPU's result: the bytes it should hold (their ranges of the file; none for a
    // checkpoint, held whole) and whether it does (`None` without --verify); for a checkpoint
    // the tensors that differ.
    let mut per_gpu: Vec<GpuHolds> = Vec::new();
    let report = if let Some(layout) = &layout {
        let out = multi.load_replicated_safetensors(path);
        pb.finish_and_clear();
        let (ckpts, report) = out?;
        for ckpt in &ckpts {
            let bad = match verify {
                true => Some(mismatched_tensors(ckpt, layout)?),
                false => None,
            };
            let ok = bad.as_ref().map(Vec::is_empty);
            per_gpu.push(GpuHolds(Vec::new(), ok, bad.unwrap_or_default()));
        }
        report
    } else {
        let plan = ShardPlan::split_bytes(&[path], gpus.len())?;
        let out = match replicate {
            true => multi.load_replicated(path),
            false => multi.load_sharded(&plan),
        };
        pb.finish_and_clear();
        let (bufs, report) = out?;
        let file = match verify {
            true => Some(
                std::fs::read(path)
                    .with_context(|| format!("read {} to verify", path.display()))?,
            ),
            false => None,
        };
        // The xxh3 of the file's `ranges`, in order, without copying them out.
        let expected = |file: &[u8], ranges: &[std::ops::Range<u64>]| {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            for r in ranges {
                h.update(&file[r.start as usize..r.end as usize]);
            }
            h.digest()
        };
        // Replicated: every GPU holds the whole file, hashed once.
        let whole = match (&file, replicate) {
            (Some(file), true) => Some(xxhash_rust::xxh3::xxh3_64(file)),
            _ => None,
        };
        for (g, (buf, loader)) in bufs.iter().zip(multi.loaders()).enumerate() {
            let all = 0..len;
            let ranges: Vec<std::ops::Range<u64>> = match replicate {
                true => vec![all],
                false => plan.spans(g).iter().map(|s| s.range.clone()).collect(),
            };
            let ok = match &file {
                Some(file) => {
                    let want = whole.unwrap_or_else(|| expected(file, &ranges));
                    let back = loader.gpu().to_vec(buf)?;
                    Some(xxhash_rust::xxh3::xxh3_64(&back) == want)
                }
                None => None,
            };
            per_gpu.push(GpuHolds(ranges, ok, Vec::new()));
        }
        report
    };
    let verified = verify.then(|| per_gpu.iter().all(|g| g.1 == Some(true)));
    let delivered: u64 = report.read_bytes.iter().chain(&report.peer_bytes).sum();
    if json {
        let each: Vec<_> = per_gpu
            .iter()
            .enumerate()
            .map(|(g, GpuHolds(ranges, ok, bad))| {
                let ranges: Vec<[u64; 2]> = ranges.iter().map(|r| [r.start, r.end]).collect();
                json!({
                    "gpu": report.gpus[g], "ranges": ranges,
                    "read_bytes": report.read_bytes[g], "peer_bytes": report.peer_bytes[g],
                    "seconds": report.gpu_seconds[g], "verified": ok,
                    "mismatched_tensors": bad,
                })
            })
            .collect();
        print_json(
            "load",
            json!({
                "kind": if checkpoint { "safetensors" } else { "file" }, "path": path,
                "gpus": report.gpus, "mode": how, "bytes": len,
                "seconds": report.seconds, "delivered_bytes": delivered,
                "gbps": gpufeed::os::gbps(delivered, report.seconds),
                "read_gbps": report.read_gbps(), "links": multi.links(),
                "notes": multi.notes(), "per_gpu": each, "verified": verified,
            }),
        )?;
    } else {
        println!(
            "{}: {} {how} onto GPUs {:?} in {:.3} s = {:.2} GB/s arriving on the GPUs ({:.2} GB/s read from the host)",
            path.display(),
            show_size(len),
            report.gpus,
            report.seconds,
            gpufeed::os::gbps(delivered, report.seconds),
            report.read_gbps(),
        );
        for (g, GpuHolds(ranges, ok, bad)) in per_gpu.iter().enumerate() {
            let held: u64 = match checkpoint {
                true => len,
                false => ranges.iter().map(|r| r.end - r.start).sum(),
            };
            let check = match ok {
                Some(true) => ", verified",
                Some(false) => ", DIFFERS",
                None => "",
            };
            println!(
                "  GPU {}: {} ({} read, {} from the other GPUs) in {:.3} s{check}",
                report.gpus[g],
                show_size(held),
                show_size(report.read_bytes[g]),
                show_size(report.peer_bytes[g]),
                report.gpu_seconds[g],
            );
            for name in bad.iter().take(20) {
                println!("    differs: {name}");
            }
        }
        for link in multi.links().iter().filter(|l| l.from < l.to) {
            println!(
                "  GPUs {} and {}: {}",
                link.from,
                link.to,
                if link.access {
                    link.kind()
                } else {
                    "no peer access (copies go through host memory)"
                }
            );
        }
        for note in multi.notes() {
            println!("  note: {note}");
        }
        print_verified(verified, "every GPU's bytes");
    }
    Ok(verify_code(verified))
}

/// `load` of a safetensors file or index: every header checked before the GPU is opened, one
/// load per file, each tensor's bytes compared with the file's under `--verify`.
fn load_checkpoint(
    path: &Path,
    ordinal: usize,
    opts: gpufeed::LoadOptions,
    verify: bool,
    json: bool,
) -> Result<ExitCode> {
    // A checkpoint in object storage: its headers by ranged GETs, its data sections by
    // object loads.
    let url = path
        .to_str()
        .filter(|p| gpufeed::object::ObjectUrl::is_url(p));
    let object_opts = gpufeed::object::ObjectOptions::default();
    // A bad header or index fails here, before the GPU is opened.
    let layout = match url {
        Some(url) => gpufeed::safetensors::inspect_object(url, &object_opts)?,
        None => gpufeed::safetensors::inspect(path)?,
    };
    let bytes: u64 = layout.iter().map(|f| f.data_bytes).sum();
    let tensors: usize = layout.iter().map(|f| f.tensors.len()).sum();
    let loader = gpufeed::Loader::open(ordinal, opts)?;
    let pb = spinner(
        &format!(
            "load {}: {tensors} tensors, {} in {} file(s)",
            path.display(),
            show_size(bytes),
            layout.len()
        ),
        json,
    );
    let t = std::time::Instant::now();
    let ckpt = match url {
        Some(url) => gpufeed::safetensors::load_object(&loader, url, &object_opts),
        None => gpufeed::safetensors::load_with(&loader, path),
    };
    pb.finish_and_clear();
    let ckpt = ckpt?;
    let secs = t.elapsed().as_secs_f64();
    let mismatched = if verify {
        let pb = spinner(
            "verify: copying each file back and hashing each tensor",
            json,
        );
        let m = mismatched_tensors(&ckpt, &layout);
        pb.finish_and_clear();
        Some(m?)
    } else {
        None
    };
    let verified = mismatched.as_ref().map(Vec::is_empty);
    let mut dtypes: std::collections::BTreeMap<String, (usize, u64)> = Default::default();
    for f in &layout {
        for gpufeed::safetensors::HeaderEntry { dtype, range, .. } in f.tensors.iter() {
            let e = dtypes.entry(format!("{dtype:?}")).or_default();
            e.0 += 1;
            e.1 += range.len() as u64;
        }
    }
    let fallbacks = fallbacks_of(loader.setup(), ckpt.reports());
    if json {
        let files: Vec<_> = layout
            .iter()
            .zip(ckpt.reports())
            .map(|(f, r)| {
                json!({
                    "path": f.path, "tensors": f.tensors.len(), "bytes": f.data_bytes,
                    "strategy": r.strategy, "reason": r.reason, "seconds": r.seconds,
                })
            })
            .collect();
        let dtypes: serde_json::Map<_, _> = dtypes
            .iter()
            .map(|(d, (n, b))| (d.clone(), json!({ "tensors": n, "bytes": b })))
            .collect();
        print_json(
            "load",
            json!({
                "kind": "safetensors", "path": path, "gpu": ordinal, "bytes": bytes,
                "tensors": tensors, "seconds": secs, "gbps": gpufeed::os::gbps(bytes, secs),
                "context_seconds": loader.setup().context_seconds,
                "ready_seconds": loader.setup().total_seconds,
                "staging_bytes": loader.setup().staging_bytes,
                "dtypes": dtypes, "files": files, "fallbacks": fallbacks,
                "verified": verified, "mismatched_tensors": mismatched,
            }),
        )?;
    } else {
        print_load_summary(
            &format!("{} ({tensors} tensors)", path.display()),
            bytes,
            secs,
            &loader,
            &fallbacks,
        );
        let list: Vec<_> = dtypes
            .iter()
            .map(|(d, (n, b))| format!("{d} {n} ({})", show_size(*b)))
            .collect();
        println!("dtypes: {}", list.join(", "));
        for (f, r) in layout.iter().zip(ckpt.reports()) {
            println!(
                "  {}: {} tensors, {}, {} ({})",
                f.path.display(),
                f.tensors.len(),
                show_size(f.data_bytes),
                r.strategy,
                r.reason
            );
        }
        print_verified(verified, &format!("all {tensors} tensors"));
        for name in mismatched.iter().flatten().take(20) {
            println!("  differs: {name}");
        }
    }
    Ok(verify_code(verified))
}

/// The tensors whose bytes on the GPU differ from the file's (xxh3 of each).
fn mismatched_tensors(
    ckpt: &gpufeed::safetensors::Checkpoint,
    layout: &[gpufeed::safetensors::FileLayout],
) -> Result<Vec<String>> {
    use std::os::unix::fs::FileExt;
    let mut bad = Vec::new();
    for (i, f) in layout.iter().enumerate() {
        let buffer = ckpt
            .buffer(i)
            .with_context(|| format!("{} was not loaded", f.path.display()))?;
        let back = ckpt.gpu().to_vec(buffer)?;
        let mut data = vec![0u8; f.data_bytes as usize];
        match f
            .path
            .to_str()
            .filter(|p| gpufeed::object::ObjectUrl::is_url(p))
        {
            Some(url) => {
                let object = gpufeed::object::Object::open(url, &Default::default())?;
                object
                    .read_exact_at(f.data_start, &mut data)
                    .with_context(|| format!("read {url} to verify"))?;
            }
            None => {
                let file = std::fs::File::open(&f.path)
                    .with_context(|| format!("open {} to verify", f.path.display()))?;
                file.read_exact_at(&mut data, f.data_start)
                    .with_context(|| format!("read {} to verify", f.path.display()))?;
            }
        }
        for gpufeed::safetensors::HeaderEntry { name, range, .. } in f.tensors.iter() {
            let on_gpu = back.get(range.clone());
            let in_file = data.get(range.clone());
            let same = on_gpu.zip(in_file).is_some_and(|(g, d)| {
                xxhash_rust::xxh3::xxh3_64(g) == xxhash_rust::xxh3::xxh3_64(d)
            });
            if !same {
                bad.push(name.clone());
            }
        }
    }
    Ok(bad)
}

fn cache_op(paths: &[PathBuf], json: bool, op: &str) -> Result<ExitCode> {
    let (mut resident, mut total) = (0u64, 0u64);
    let mut rows = Vec::new();
    let mut warnings = Vec::new();
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
            // gpufeed-os errors name the file.
            Err(e) => return Err(e.into()),
        };
        resident += r.resident_pages;
        total += r.total_pages;
        rows.push(json!({
            "path": p, "resident_pages": r.resident_pages, "total_pages": r.total_pages,
            "page_size": r.page_size, "bytes": r.file_bytes, "fraction": r.fraction(),
            "method": r.method.to_string(), "approximate": r.approximate,
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
        if op == "warm"
            && let Some(w) = warm_shortfall(p, &r)
        {
            warnings.push(w);
        }
    }
    if !json && paths.len() > 1 {
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
    if json {
        print_json(
            op,
            json!({
                "files": rows, "resident_pages": resident, "total_pages": total,
                "warnings": warnings,
            }),
        )?;
    } else {
        for w in &warnings {
            eprintln!("gpufeed: warning: {w}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A sentence when a warmed file did not stay in the page cache, saying why where the RAM
/// explains it.
fn warm_shortfall(path: &Path, r: &cache::Residency) -> Option<String> {
    if r.fraction() >= 0.99 {
        return None;
    }
    let info = gpufeed::os::SystemInfo::read();
    let why = match (info.mem_total.ok(), info.mem_available.ok()) {
        (Some(total), _) if r.file_bytes > total => format!(
            "the file ({}) is larger than the RAM ({}): it cannot all be cached at once",
            show_size(r.file_bytes),
            show_size(total)
        ),
        (_, Some(avail)) if r.file_bytes > avail => format!(
            "the file ({}) is larger than the memory available ({}); the kernel evicted its \
             first pages to read the last",
            show_size(r.file_bytes),
            show_size(avail)
        ),
        _ => "the kernel evicted pages under memory pressure (or a cgroup's memory limit)".into(),
    };
    Some(format!(
        "{}: only {:.1}% stayed in the page cache: {why}",
        path.display(),
        r.fraction() * 100.0
    ))
}

fn lock(paths: &[PathBuf], seconds: Option<u64>, json: bool) -> Result<ExitCode> {
    let mut maps = Vec::new();
    for p in paths {
        #[allow(unsafe_code, reason = "the mapped-file promise, passed on")]
        // SAFETY: the files are only read, page by page, while locked; a file truncated
        // meanwhile would raise SIGBUS, which `gpufeed lock` documents by being a read-only
        // tool for data sets that are not being rewritten.
        let map = unsafe { gpufeed::os::FileMap::open(p, gpufeed::os::MapMode::ReadOnly) }?;
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
        print_json(
            "lock",
            json!({ "locked_bytes": bytes, "files": paths, "seconds": seconds }),
        )?;
    } else {
        let until = match seconds {
            Some(s) => format!("released after {s} s (or at Ctrl-C)"),
            None => "Ctrl-C releases them".into(),
        };
        println!(
            "{} locked in RAM across {} file(s); {until}",
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
    let dir = std::path::Path::new(gpufeed::os::shm::DEFAULT_DIR);
    let rendezvous = gpufeed::ipc::list_rendezvous(dir, prefix)?;
    if json {
        let rows: Vec<_> = list
            .iter()
            .map(|e| json!({ "name": e.name, "bytes": e.len, "owner_pid": e.owner_pid, "owner_pid_ns": e.owner_pid_ns, "owner": liveness_word(e.owner) }))
            .collect();
        let meetings: Vec<_> = rendezvous
            .iter()
            .map(|r| json!({ "name": r.name, "bytes": r.bytes, "world": r.world, "joined": r.joined, "rank0_pid": r.rank0.pid, "rank0_pid_ns": r.rank0.pid_ns, "ranks": liveness_word(r.ranks) }))
            .collect();
        print_json(
            "shm ls",
            json!({ "prefix": prefix, "segments": rows, "rendezvous": meetings }),
        )?;
    } else if list.is_empty() && rendezvous.is_empty() {
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
        for r in &rendezvous {
            println!(
                "{:<10} pid {:<8} {:<5} {} (rendezvous: {} of {} ranks joined; pid is rank 0's)",
                show_size(r.bytes),
                r.rank0.pid,
                liveness_word(r.ranks),
                r.name,
                r.joined,
                r.world
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn liveness_word(l: gpufeed::os::process::Liveness) -> &'static str {
    use gpufeed::os::process::Liveness;
    match l {
        Liveness::Alive => "live",
        Liveness::Dead => "dead",
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
    let dir = std::path::Path::new(shm::DEFAULT_DIR);
    let report = shm::gc_in_with(dir, prefix, foreign)?;
    let rendezvous = gpufeed::ipc::gc_rendezvous(dir, prefix, foreign)?;
    let sockets = gpufeed::ipc::gc_stale_sockets(dir, gpufeed::ipc::STALE_SOCKET_AGE)?;
    // Segments gc would have removed but could not (EPERM, ...): shown, never fatal.
    let skipped: Vec<(&str, &str)> = report
        .skipped
        .iter()
        .chain(&rendezvous.skipped)
        .chain(&sockets.skipped)
        .map(|k| (k.name.as_str(), k.reason.as_str()))
        .collect();
    if json {
        let listed = |list: &[gpufeed::os::shm::GcSkipped]| -> Vec<serde_json::Value> {
            list.iter()
                .map(|k| json!({ "name": k.name, "reason": k.reason }))
                .collect()
        };
        let meetings = json!({ "removed": rendezvous.removed, "removed_bytes": rendezvous.removed_bytes, "kept": rendezvous.kept, "other_namespace": rendezvous.other_namespace, "skipped": listed(&rendezvous.skipped) });
        print_json(
            "shm gc",
            json!({ "removed": report.removed, "removed_bytes": report.removed_bytes, "kept": report.kept, "other_namespace": report.other_namespace, "skipped": listed(&report.skipped), "rendezvous": meetings, "removed_sockets": sockets.removed, "skipped_sockets": listed(&sockets.skipped) }),
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
        let r = &rendezvous;
        if !(r.removed.is_empty() && r.kept.is_empty() && r.other_namespace.is_empty()) {
            println!(
                "removed {} rendezvous segment(s) of crashed jobs ({}); kept {} that a rank may still use, {} of other PID namespaces",
                r.removed.len(),
                show_size(r.removed_bytes),
                r.kept.len(),
                r.other_namespace.len()
            );
            for n in &r.removed {
                println!("  removed {n}");
            }
        }
        if !sockets.removed.is_empty() {
            println!(
                "removed {} descriptor socket(s) left by ranks killed while passing descriptors",
                sockets.removed.len()
            );
        }
        if !skipped.is_empty() {
            println!(
                "could not remove {} segment(s) or socket(s) of dead owners (they stay; remove them as their owner or root):",
                skipped.len()
            );
            for (name, reason) in &skipped {
                println!("  {name}: {reason}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn residency(file_bytes: u64, fraction: f64) -> cache::Residency {
        let total_pages = file_bytes.div_ceil(4096);
        cache::Residency {
            resident_pages: (total_pages as f64 * fraction) as u64,
            total_pages,
            dirty_pages: None,
            page_size: 4096,
            file_bytes,
            method: cache::ResidencyMethod::Cachestat,
            approximate: false,
        }
    }

    #[test]
    fn a_warm_that_did_not_stay_says_why() {
        let path = Path::new("big.bin");
        assert_eq!(warm_shortfall(path, &residency(1 << 30, 1.0)), None);
        let ram = gpufeed::os::SystemInfo::read().mem_total.expect("MemTotal");
        let w = warm_shortfall(path, &residency(2 * ram, 0.45)).expect("a warning");
        assert!(
            w.contains("45.0%") && w.contains("larger than the RAM"),
            "{w}"
        );
        let w = warm_shortfall(path, &residency(1 << 20, 0.5)).expect("a warning");
        assert!(w.contains("evicted"), "{w}");
    }

    #[test]
    fn an_error_chain_is_one_line_without_repeats() {
        let io = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        let e = anyhow::Error::new(io).context(format!(
            "open x: {}",
            std::io::Error::from(std::io::ErrorKind::PermissionDenied)
        ));
        assert_eq!(one_line(&e), "open x: permission denied");
        let e = anyhow::anyhow!("two\nlines").context("outer");
        assert_eq!(one_line(&e), "outer: two lines");
    }
}
