//! `gpufeed-bench`: the throughput harness that `cargo xtask bench` builds and runs.
//!
//! It makes its own data set, measures the machine's limits, then the source material's two
//! tables (a batch handed between processes; a data set loaded and read at random), and writes
//! `report.md` and `report.json` into the output directory.

mod access;
mod casts;
mod chart;
mod cold;
mod facade;
mod frames;
mod gpu;
mod handoff;
mod hybrid;
mod images;
mod ipc;
mod limits;
mod loader;
mod models;
mod multi;
mod objects;
mod oneshot;
mod python;
mod reads;
mod report;
mod save;
mod small;
mod sweep;
mod util;

use std::path::PathBuf;

use anyhow::{Context, Result, ensure};
use clap::{Parser, Subcommand};

use crate::util::{parse_size, show_size};

#[derive(Parser)]
#[command(
    version,
    about = "gpufeed's throughput harness (run it through `cargo xtask bench`)"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Internal>,

    /// Directory for the data set and the reports (on the disk to measure, not tmpfs).
    #[arg(long, default_value = "target/gpufeed-bench")]
    dir: PathBuf,

    /// Size of the data set, e.g. 1GiB or 256MiB.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    size: u64,

    /// Size of the batch handed between processes (the source used 512 MB).
    #[arg(long, default_value = "512MiB", value_parser = parse_size)]
    batch: u64,

    /// Repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,

    /// Bytes moved per GPU transfer measurement (GPU machine only).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    gpu_bytes: u64,

    /// Size of the file registered and copied to the GPU, and loaded cold by table 16 (GPU
    /// machine only).
    #[arg(long, default_value = "4GiB", value_parser = parse_size)]
    gpu_file: u64,

    /// The largest file of the size curve of table 9 (1 MiB, 4 MiB, ... up to this; GPU
    /// machine only).
    #[arg(long, default_value = "16GiB", value_parser = parse_size)]
    curve_max: u64,

    /// The checkpoint of table 10, the Python package against safetensors.torch (GPU machine
    /// only; written twice: in 16 tensors and in 10,000).
    #[arg(long, default_value = "16GiB", value_parser = parse_size)]
    checkpoint: u64,

    /// The file (and checkpoint) of table 11, several GPUs at once (machines with several
    /// GPUs only).
    #[arg(long, default_value = "16GiB", value_parser = parse_size)]
    multi_file: u64,

    /// The object of table 14 (objects from a SeaweedFS server started here), and the
    /// checkpoint beside it holding the same bytes as tensors of 64 MiB.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    object_size: u64,

    /// Files in the small-files folder of table 9 (60-160 KiB each; GPU machine only).
    #[arg(long, default_value_t = 10_000)]
    small_files: usize,

    /// Files in the JPEG folder of table 15 (ImageNet-like sizes, made once by
    /// `benches/peers/images.py`; GPU machine only). Default 16,384, 2,048 with --quick.
    #[arg(long)]
    images: Option<usize>,

    /// Which JPEG folder table 15 makes: `imagenet` (ImageNet-like sizes, ~106 KiB per file)
    /// or `issue40` (the set issue 40's peers were measured on: 500x375, 68 KiB mean).
    #[arg(long, value_enum, default_value_t = images::Like::Imagenet)]
    images_like: images::Like,

    /// Also run the peers (PyTorch, kvikio, safetensors, fastsafetensors) on the GPU machine,
    /// with `python3 benches/peers/peers.py` (those not installed report why), and tables 10
    /// and 15.
    #[arg(long)]
    peers: bool,

    /// Small sizes and 2 repetitions: the whole run in well under a minute (CI's smoke test).
    #[arg(long)]
    quick: bool,

    /// Seconds of capture per path of table 12's GPU rows (4K at 60 fps; issue 21's target
    /// run is 60). Default 5, 1 with --quick.
    #[arg(long)]
    frame_seconds: Option<f64>,

    /// Only these parts, comma-separated: limits, handoff, access, reads, ipc, loader, gpu
    /// (tables 4, 6 and 8), small (table 9), python (table 10, which also runs with
    /// `--peers`), multi (table 11, several GPUs), frames (table 12), hybrid (table 13),
    /// object (table 14, objects from a SeaweedFS server started here; needs `weed`), images
    /// (table 15, JPEG training batches against torchvision and DataLoader + PIL; GPU machine;
    /// also runs with `--peers`), cold (table 16, the `--gpu-file` file loaded cold by every
    /// route, Auto, Direct, Staged and cuFile, beside the disk's raw O_DIRECT read and KvikIO;
    /// GPU machine).
    /// Limits are measured whenever a host table is, since ratios need them.
    #[arg(long, value_delimiter = ',')]
    only: Vec<Part>,

    /// Fail at once when no GPU is usable (instead of reporting the GPU tables as not
    /// measured), whichever tables are selected.
    #[arg(long)]
    gpu: bool,

    /// Skip the host-only tables (1-3, 5 and 7, and the limits they need), e.g. to spend the
    /// GPU machine's time on the tables with GPU rows (4, 6, 8-16).
    #[arg(long)]
    gpu_only: bool,

    /// Print the JSON report on stdout instead of the tables.
    #[arg(long)]
    json: bool,
}

/// A part of the run, for `--only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Part {
    Limits,
    Handoff,
    Access,
    Reads,
    Ipc,
    Loader,
    Gpu,
    Small,
    Python,
    Multi,
    Frames,
    Hybrid,
    Object,
    Images,
    Cold,
}

impl Part {
    const ALL: [Part; 15] = [
        Part::Limits,
        Part::Handoff,
        Part::Access,
        Part::Reads,
        Part::Ipc,
        Part::Loader,
        Part::Gpu,
        Part::Small,
        Part::Python,
        Part::Multi,
        Part::Frames,
        Part::Hybrid,
        Part::Object,
        Part::Images,
        Part::Cold,
    ];

    /// A part without GPU rows (skipped by `--gpu-only`).
    fn host_only(self) -> bool {
        matches!(
            self,
            Part::Limits | Part::Handoff | Part::Access | Part::Reads | Part::Ipc | Part::Loader
        )
    }

    /// The tables it renders, for the report's list of what a run left out.
    pub(crate) fn tables(self) -> &'static str {
        match self {
            Part::Limits => "the machine's limits",
            Part::Handoff => "table 1 (handoff)",
            Part::Access => "table 2 (access)",
            Part::Reads => "table 3 (reads)",
            Part::Ipc => "table 5 (ipc)",
            Part::Loader => "table 7 (loader)",
            Part::Gpu => "tables 4, 6 and 8 (gpu)",
            Part::Small => "table 9 (small)",
            Part::Python => "table 10 (python)",
            Part::Multi => "table 11 (multi)",
            Part::Frames => "table 12 (frames)",
            Part::Hybrid => "table 13 (hybrid)",
            Part::Object => "table 14 (object)",
            Part::Images => "table 15 (images)",
            Part::Cold => "table 16 (cold)",
        }
    }
}

#[derive(Subcommand)]
enum Internal {
    /// The consumer side of table 1 (started by the harness itself).
    #[command(hide = true)]
    Consumer {
        #[arg(long, value_enum)]
        mode: handoff::Mode,
        #[arg(long)]
        target: String,
        #[arg(long)]
        len: usize,
    },
    /// A one-shot load in a fresh process (started by the harness itself).
    #[command(hide = true)]
    OneShot {
        #[arg(long)]
        path: std::path::PathBuf,
        /// The file is a safetensors checkpoint.
        #[arg(long)]
        checkpoint: bool,
        /// Use the overlapped one-shot API (`load_file_on`, `safetensors::load_on`).
        #[arg(long)]
        on: bool,
    },
    /// Table 11's one-process-per-GPU loads by hand: `world` rank processes (`rank`; more
    /// ranks than GPUs share them) over `path`, sharded and replicated; prints the slowest
    /// rank's seconds per repetition as JSON (GPU machine).
    #[command(hide = true)]
    Ranks {
        #[arg(long)]
        path: std::path::PathBuf,
        #[arg(long)]
        world: usize,
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// As `rank --via`.
        #[arg(long, value_enum, default_value = "staging")]
        via: multi::Via,
        /// As `rank --round-mib`.
        #[arg(long)]
        round_mib: Option<u64>,
    },
    /// One rank of table 11's one-process-per-GPU rows (started by the harness itself).
    #[command(hide = true)]
    Rank {
        #[arg(long)]
        path: std::path::PathBuf,
        #[arg(long)]
        reps: usize,
        /// How replicated loads copy between the ranks: the staging slots they share, CUDA IPC
        /// handles of new `cuMemAlloc` memory (`RankLoader::with_shared_staging(false)`), or
        /// NCCL broadcasts (`RankLoader::with_nccl(true)`).
        #[arg(long, value_enum, default_value = "staging")]
        via: multi::Via,
        /// Replicated loads in rounds of this many MiB (`RankLoader::with_round_bytes`).
        #[arg(long)]
        round_mib: Option<u64>,
    },
    /// The probe behind the small-load defaults: loads of 1-256 MiB under several settings,
    /// the wire and a 1 MiB load's fixed steps; one JSON object per line (GPU machine).
    #[command(hide = true)]
    SweepSmall {
        #[arg(long, default_value = "/tmp/gpufeed-sweep")]
        dir: std::path::PathBuf,
        #[arg(long, default_value_t = 21)]
        reps: usize,
        /// Only these settings, each `MIN_PIECE_KIB:LANE_KIB:FILL_THREADS` (comma separated),
        /// instead of the built-in grid.
        #[arg(long, value_delimiter = ',')]
        settings: Vec<String>,
        /// Only sizes up to this many MiB (1, 4, 16, 64, 256).
        #[arg(long, default_value_t = 256)]
        max_mib: u64,
    },
    /// The frame producer of table 12 (started by the harness itself).
    #[command(hide = true)]
    FramesProducer {
        #[arg(long)]
        ring: Option<String>,
        #[arg(long)]
        fps: f64,
        #[arg(long)]
        frames: u64,
        #[arg(long)]
        width: u32,
        #[arg(long)]
        height: u32,
        #[arg(long)]
        sparse: bool,
    },
    /// A trainer process of table 13 (started by the harness itself).
    #[command(hide = true)]
    HybridTrainer {
        #[arg(long)]
        ring: String,
        #[arg(long)]
        records: PathBuf,
        #[arg(long)]
        epochs: u64,
        #[arg(long)]
        batches: usize,
        /// Take the batches to GPU 0 (the harness has a GPU), as a training process does.
        #[arg(long)]
        gpu: bool,
    },
    /// The producer side of table 5 (started by the harness itself).
    #[command(hide = true)]
    IpcChild {
        #[arg(long, value_enum)]
        role: ipc::Role,
        #[arg(long)]
        target: String,
        #[arg(long)]
        count: usize,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Internal::Consumer { mode, target, len }) => {
            return handoff::consumer(mode, &target, len);
        }
        Some(Internal::IpcChild {
            role,
            target,
            count,
        }) => return ipc::child(role, &target, count),
        Some(Internal::Ranks {
            path,
            world,
            reps,
            via,
            round_mib,
        }) => {
            let exe = std::env::current_exe()?;
            let (sharded, replicated, first) =
                multi::ranks(&exe, &path, world, reps, via, round_mib)?;
            let json = serde_json::json!({"world": world, "via": via,
                "round_mib": round_mib, "sharded_seconds": sharded,
                "replicated_seconds": replicated, "first_replicated": first});
            println!("{json}");
            return Ok(());
        }
        Some(Internal::Rank {
            path,
            reps,
            via,
            round_mib,
        }) => return multi::rank_child(&path, reps, via, round_mib),
        Some(Internal::FramesProducer {
            ring,
            fps,
            frames,
            width,
            height,
            sparse,
        }) => {
            let format = gpufeed::frames::FrameFormat { width, height };
            return frames::child(ring.as_deref(), format, fps, frames, sparse);
        }
        Some(Internal::SweepSmall {
            dir,
            reps,
            settings,
            max_mib,
        }) => return sweep::run(&dir, reps, &settings, max_mib << 20),
        Some(Internal::HybridTrainer {
            ring,
            records,
            epochs,
            batches,
            gpu,
        }) => return hybrid::trainer_child(&ring, &records, epochs, batches, gpu),
        Some(Internal::OneShot {
            path,
            checkpoint,
            on,
        }) => {
            return if on {
                oneshot::child_on(&path, checkpoint)
            } else {
                oneshot::child(&path, checkpoint)
            };
        }
        None => {}
    }
    let mut cli = cli;
    if cli.quick {
        cli.size = 64 << 20;
        cli.batch = 32 << 20;
        cli.reps = 2;
        cli.gpu_bytes = 256 << 20;
        cli.gpu_file = 256 << 20;
        cli.curve_max = 256 << 20;
        cli.small_files = 1000;
        cli.checkpoint = 256 << 20;
        cli.multi_file = 256 << 20;
        cli.object_size = 64 << 20;
        cli.images.get_or_insert(2048);
    }
    let wanted = |p: Part| {
        (cli.only.is_empty() || cli.only.contains(&p)) && !(cli.gpu_only && p.host_only())
    };
    // Tables 10 and 15 need the Python peers: asked for by name, or with --peers.
    let peer_table = |p: Part| cli.only.contains(&p) || (cli.only.is_empty() && cli.peers);
    // What this run leaves out, said in the report (a table not selected is not "not measured").
    let left_out: Vec<&'static str> = Part::ALL
        .into_iter()
        .filter(|&p| match p {
            // Limits run whenever a host table does.
            Part::Limits => false,
            Part::Python | Part::Images => !peer_table(p),
            p => !wanted(p),
        })
        .map(Part::tables)
        .collect();
    ensure!(
        left_out.len() < Part::ALL.len() - 1 || cli.only.contains(&Part::Limits) && !cli.gpu_only,
        "no table is selected: --only {} with{} --gpu-only leaves nothing to run",
        cli.only
            .iter()
            .map(|p| format!("{p:?}").to_lowercase())
            .collect::<Vec<_>>()
            .join(","),
        if cli.gpu_only { "" } else { "out" }
    );
    if cli.gpu {
        // The GPU itself, not whether a table with GPU rows happened to run.
        ensure!(
            gpu::open_gpu(&mut |what| eprintln!("{what}"))?.is_some(),
            "--gpu: no GPU is usable here (see `gpufeed doctor`)"
        );
    }
    let any_host = Part::ALL.into_iter().filter(|p| p.host_only()).any(wanted);
    ensure!(cli.reps > 0, "--reps must be at least 1");
    ensure!(cli.size >= 1 << 20, "--size must be at least 1 MiB");
    ensure!(cli.batch >= 4096, "--batch must be at least 4 KiB");
    std::fs::create_dir_all(&cli.dir).with_context(|| format!("create {}", cli.dir.display()))?;
    let exe = std::env::current_exe().context("path of this program")?;
    let progress = Progress::new();
    let step = |n: usize, what: &str| progress.line(&format!("[{n}/9] {what}"));

    let (mut limits, mut handoff, mut access, mut reads, mut ipc, mut batch_loader) =
        (None, None, None, None, None, None);
    if any_host {
        let dataset = cli.dir.join(format!("dataset-{}.bin", cli.size));
        step(
            1,
            &format!(
                "data set: {} of random bytes at {}",
                show_size(cli.size),
                dataset.display()
            ),
        );
        util::ensure_random_file(&dataset, cli.size, 0x5EED)?;

        step(
            2,
            "limits: memcpy, the warm read(), the disk (read(), O_DIRECT on 1/4/16 threads, fio)",
        );
        limits = Some(limits::measure(&dataset, cli.reps)?);

        step(
            3,
            &format!(
                "table 1: {} batch, producer process -> consumer process",
                show_size(cli.batch)
            ),
        );
        if wanted(Part::Handoff) {
            handoff = Some(handoff::measure(
                &exe,
                &cli.dir,
                cli.batch as usize,
                cli.reps,
            )?);
        }

        step(4, "table 2: load and random reads, cold and warm");
        if wanted(Part::Access) {
            access = Some(access::measure(&dataset, cli.reps, |what| {
                progress.line(&format!("      {what}"))
            })?);
        }

        step(
            5,
            "table 3: gpufeed-uring reads, O_DIRECT by queue depth (with fio) and warm",
        );
        if wanted(Part::Reads) {
            reads = Some(reads::measure(&dataset, cli.reps, |what| {
                progress.line(&format!("      {what}"))
            })?);
        }

        step(
            6,
            "table 5: gpufeed-ipc batch ring between processes (1 MiB batches, 64-byte wake-ups)",
        );
        if wanted(Part::Ipc) {
            ipc = Some(ipc::measure(&exe, &cli.dir, 4 * cli.batch, cli.reps)?);
        }
        if wanted(Part::Loader) {
            step(
                7,
                "table 7: the dataset BatchLoader on the host (64 KiB records, shuffled)",
            );
            batch_loader = Some(loader::measure(&dataset, cli.reps)?);
        }
    }
    step(
        8,
        "tables 4, 6 and 8: GPU transfers, loads and saves (GPU machine only)",
    );
    let gpu = if wanted(Part::Gpu) {
        gpu::measure(
            &cli.dir,
            cli.gpu_bytes,
            cli.gpu_file,
            cli.reps,
            cli.peers,
            |what| progress.line(&format!("      {what}")),
        )?
    } else {
        None
    };
    step(
        9,
        "table 9: small loads, the size curve and a folder of small files (GPU machine only)",
    );
    let small = if wanted(Part::Small) {
        let gpu_file = cli.dir.join(format!("gpu-file-{}.bin", cli.gpu_file));
        util::ensure_random_file(&gpu_file, cli.gpu_file, gpu::FILE_SEED)?;
        small::measure(
            &cli.dir,
            cli.curve_max,
            (&gpu_file, cli.gpu_file),
            cli.small_files,
            cli.reps,
            cli.peers,
            |what| progress.line(&format!("      {what}")),
        )?
    } else {
        None
    };
    let python = if peer_table(Part::Python) {
        python::measure(&cli.dir, cli.checkpoint, cli.reps, |what| {
            progress.line(&format!("      {what}"))
        })?
    } else {
        None
    };
    let multi = if wanted(Part::Multi) {
        multi::measure(
            &exe,
            &cli.dir,
            cli.multi_file,
            cli.reps,
            cli.peers,
            |what| progress.line(&format!("      {what}")),
        )?
    } else {
        None
    };
    let frames = if wanted(Part::Frames) {
        progress.line("      table 12: frames through a shared-memory ring and through a pipe");
        let seconds = if cli.quick { 1.0 } else { 5.0 };
        let gpu = gpu::open_gpu(&mut |what| progress.line(&format!("      {what}")))?;
        Some(frames::measure(
            &exe,
            seconds,
            gpu.as_ref(),
            cli.frame_seconds.unwrap_or(seconds),
            cli.reps,
        )?)
    } else {
        None
    };
    let hybrid = if wanted(Part::Hybrid) {
        progress.line("      table 13: the hybrid training loader");
        let gpu = gpu::open_gpu(&mut |what| progress.line(&format!("      {what}")))?;
        Some(hybrid::measure(
            &exe,
            &cli.dir,
            gpu.as_ref(),
            cli.reps,
            cli.quick,
        )?)
    } else {
        None
    };
    let objects = if wanted(Part::Object) {
        let gpu = gpu::open_gpu(&mut |what| progress.line(&format!("      {what}")))?;
        Some(objects::measure(
            cli.object_size,
            cli.reps,
            gpu.as_ref(),
            cli.peers,
            |what| progress.line(&format!("      {what}")),
        )?)
    } else {
        None
    };

    let images = if peer_table(Part::Images) {
        Some(images::measure(
            &cli.dir,
            cli.images.unwrap_or(16_384),
            cli.images_like,
            cli.reps,
            |what| progress.line(what),
        )?)
    } else {
        None
    };

    let cold = if wanted(Part::Cold) {
        Some(cold::measure(&cli.dir, cli.gpu_file, cli.reps, |what| {
            progress.line(&format!("      {what}"))
        })?)
    } else {
        None
    };

    let report = report::Report {
        tool: concat!("gpufeed-bench ", env!("CARGO_PKG_VERSION")),
        machine: report::Machine::read(&cli.dir),
        dataset_bytes: cli.size,
        batch_bytes: cli.batch,
        reps: cli.reps,
        limits,
        handoff,
        access,
        reads,
        ipc,
        batch_loader,
        gpu,
        small,
        python,
        multi,
        frames,
        hybrid,
        objects,
        images,
        cold,
        left_out,
    };
    progress.finish();
    let json = serde_json::to_string_pretty(&report)?;
    let markdown = report.markdown();
    std::fs::write(cli.dir.join("report.json"), &json)?;
    std::fs::write(cli.dir.join("report.md"), &markdown)?;
    std::fs::write(cli.dir.join("report.svg"), report.svg())?;
    if cli.json {
        println!("{json}");
    } else {
        println!("{markdown}");
        eprintln!(
            "wrote {0}/report.md, {0}/report.json and {0}/report.svg",
            cli.dir.display()
        );
    }
    Ok(())
}

/// A live display of the step in progress (a spinner with the elapsed time) on a terminal;
/// plain lines elsewhere (CI logs, pipes).
struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    fn new() -> Self {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let pb = indicatif::ProgressBar::new_spinner();
            pb.set_style(
                indicatif::ProgressStyle::with_template("{spinner} {elapsed_precise} {msg}")
                    .expect("a valid template"),
            );
            pb.enable_steady_tick(std::time::Duration::from_millis(120));
            pb
        });
        Progress { bar }
    }

    fn line(&self, text: &str) {
        match &self.bar {
            Some(pb) => {
                pb.println(text);
                pb.set_message(text.trim().to_owned());
            }
            None => eprintln!("{text}"),
        }
    }

    fn finish(&self) {
        if let Some(pb) = &self.bar {
            pb.finish_and_clear();
        }
    }
}
