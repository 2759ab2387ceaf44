//! The report: markdown for people (stdout and report.md), JSON for scripts (report.json).

use std::fmt::Write as _;

use serde::Serialize;

use crate::access::{AccessRow, RANDOM_BYTES, RANDOM_READS, Temperature};
use crate::gpu::GpuBench;
use crate::handoff::Handoff;
use crate::ipc::IpcBench;
use crate::limits::Limits;
use crate::loader::LoaderBench;
use crate::reads::Reads;
use crate::util::show_size;

#[derive(Debug, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub mem_total_bytes: Option<u64>,
    pub kernel: String,
    pub page_size: usize,
    pub thp_anon: String,
    pub shm_total_bytes: Option<u64>,
    pub dataset_fs: String,
}

impl Machine {
    pub fn read(dataset_dir: &std::path::Path) -> Self {
        let info = gpufeed_os::SystemInfo::read();
        let uname = rustix::system::uname();
        Machine {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            mem_total_bytes: info.mem_total.ok(),
            kernel: uname.release().to_string_lossy().into_owned(),
            page_size: info.page_size,
            thp_anon: info
                .thp_anon
                .map_or_else(|e| format!("unreadable: {e}"), |m| m.to_string()),
            shm_total_bytes: info.shm.ok().map(|s| s.total_bytes),
            dataset_fs: fs_type(dataset_dir),
        }
    }
}

fn fs_type(dir: &std::path::Path) -> String {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return "unknown".into();
    };
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    mounts
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (dev, mnt, fs) = (w.next()?, w.next()?, w.next()?);
            dir.starts_with(mnt)
                .then(|| (mnt.len(), format!("{fs} ({dev} on {mnt})")))
        })
        .max_by_key(|(n, _)| *n)
        .map_or_else(|| "unknown".into(), |(_, s)| s)
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub tool: &'static str,
    pub machine: Machine,
    pub dataset_bytes: u64,
    pub batch_bytes: u64,
    pub reps: usize,
    pub limits: Option<Limits>,
    pub handoff: Option<Vec<Handoff>>,
    pub access: Option<Vec<AccessRow>>,
    pub reads: Option<Reads>,
    pub ipc: Option<IpcBench>,
    pub batch_loader: Option<LoaderBench>,
    pub gpu: Option<GpuBench>,
    /// Table 9: small loads.
    pub small: Option<crate::small::SmallBench>,
    /// Table 10: the Python package's checkpoint loads.
    pub python: Option<crate::python::PythonBench>,
    /// Table 11: several GPUs at once.
    pub multi: Option<crate::multi::MultiBench>,
    /// Table 12: the frame pipeline (CPU form).
    pub frames: Option<crate::frames::FramesBench>,
    /// Table 13: the hybrid training loader.
    pub hybrid: Option<crate::hybrid::HybridBench>,
    /// The tables this run did not select (`--only`, `--gpu-only`; table 10 without `--peers`).
    pub left_out: Vec<&'static str>,
}

impl Report {
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let m = &self.machine;
        let _ = writeln!(s, "# gpufeed bench — host memory and page cache\n");
        let _ = writeln!(
            s,
            "Machine: {} CPUs, {} RAM, Linux {}, page {} B, THP {}, /dev/shm {}; data set on {}.",
            m.cpus,
            m.mem_total_bytes.map_or("?".into(), show_size),
            m.kernel,
            m.page_size,
            m.thp_anon,
            m.shm_total_bytes.map_or("?".into(), show_size),
            m.dataset_fs
        );
        let _ = writeln!(
            s,
            "Every figure: median of {} repetitions (min-max in parentheses), measured in this run.\n",
            self.reps
        );

        let _ = writeln!(
            s,
            "Columns headed *source* repeat what the source material (the article gpufeed's design \
             starts from) printed for its own machine and sizes (a 512 MB batch, a 1 GB data set), \
             for comparison; they were not measured here. *x* = times the other figure of the \
             same run; *share of a limit* = a figure divided by one of this machine's limits \
             below.\n"
        );
        let memcpy = self
            .limits
            .as_ref()
            .map_or(f64::NAN, |l| l.memcpy_1_thread_gbps.median);
        if let Some(l) = &self.limits {
            self.limits_table(&mut s, l);
        }
        if let Some(h) = &self.handoff {
            self.handoff_table(&mut s, memcpy, h);
        }
        if let Some(a) = &self.access {
            self.access_table(&mut s, a);
        }
        if let Some(r) = &self.reads {
            self.reads_table(&mut s, r);
        }
        // The GPU tables (4, 6, 8, 9) need the GPU machine; the host tables (1-3, 5, 7) run
        // everywhere. Printed in their numbers' order.
        let gpu_ran = self.gpu.is_some() || self.small.is_some() || self.python.is_some();
        let gpu_selected = !self.left_out.contains(&crate::Part::Gpu.tables())
            || !self.left_out.contains(&crate::Part::Small.tables());
        match &self.gpu {
            Some(g) => gpu_table(&mut s, g),
            None if !gpu_ran && gpu_selected => {
                let _ = writeln!(
                    s,
                    "\n## Tables 4, 6, 8 and 9 — GPU\n\nNot measured: no GPU on this machine \
                     (they run on the GPU machine: docs/benchmarks.md)."
                );
            }
            None => {}
        }
        if let Some(i) = &self.ipc {
            ipc_table(&mut s, i, memcpy);
        }
        if let Some(g) = &self.gpu {
            facade_table(&mut s, g);
        }
        if let Some(b) = &self.batch_loader {
            let memory = self.limits.as_ref().map_or(f64::NAN, Limits::memory_gbps);
            let _ = writeln!(
                s,
                "\n## Table 7 — dataset BatchLoader, host batches (no GPU)\n\n| records | batch | workers | GB/s | share of a limit | cores busy |\n|---|---|---|---|---|---|\n| {} shuffled | {} records | {} | {} | {} | {:.1} |",
                show_size(b.record_bytes as u64),
                b.batch_size,
                b.workers,
                b.host_gbps.show(2),
                share(b.host_gbps.median, memory, "memcpy"),
                b.host_cores_busy.median
            );
            for d in &b.direct_cold {
                let _ = writeln!(
                    s,
                    "| {} in blocks of {} (`Order::Blocks`), cold, read with `O_DIRECT` (`LoaderConfig::direct`; {} per read, {} in flight per worker) | {} records | {} | {} | {} (per epoch {}-{}%); {} ({} GB/s); the disk reading such blocks in a random order: {} GB/s | |",
                    show_size(b.record_bytes as u64),
                    d.block,
                    show_size(d.read_bytes as u64),
                    d.depth,
                    d.batch,
                    d.workers,
                    d.gbps.show(2),
                    share(
                        d.way_share.median,
                        1.0,
                        "the disk's best way next to each epoch"
                    ),
                    (100.0 * d.way_share.min).round(),
                    (100.0 * d.way_share.max).round(),
                    share(
                        d.share.median,
                        1.0,
                        "the fastest of the disk's ways at each epoch"
                    ),
                    d.limit_gbps.show(2),
                    d.shuffled_gbps.show(2),
                );
            }
            let _ = writeln!(
                s,
                "\nThe cold rows' limit: next to each epoch (before it and after it in turns), the disk's own `O_DIRECT` reads of the same file \
                 (sequential `pread`s of 8 MiB on 1 thread, of 1 MiB on 4 and on 16 threads, and 1 MiB reads through io_uring at queue depth {}). \
                 A row's share is the median of its epochs' shares of the read next to them of the way with the highest median over the run, {} ({} GB/s); \
                 the fastest of the four at each epoch ({} GB/s, all rows') is biased high, the most of four samples of a disk that moves by a third, and is shown second. \
                 The best `O_DIRECT` way of the limits table: {}.",
                crate::loader::DISK_QUEUE,
                b.direct_best_way,
                b.direct_best_way_gbps.show(2),
                b.direct_limit_gbps.show(2),
                self.limits.as_ref().and_then(Limits::direct_limit).map_or(
                    "-".to_owned(),
                    |d| format!("{} GB/s ({})", d.gbps.show(2), d.how)
                ),
            );
            let _ = writeln!(
                s,
                "\nAn elastic loader (`Sampler::elastic`, global batch {}) over {} records resumed \
                 mid-epoch as rank 3 of 8 (`BatchLoader::resume`): {} ms to its first batch.",
                8 * crate::loader::BATCH,
                b.resume_records,
                b.resume_ms.show(0)
            );
        }
        if let Some(g) = &self.gpu {
            save_table(&mut s, &g.save);
            peers_table(&mut s, g);
        }
        if let Some(v) = &self.small {
            small_table(&mut s, v);
        }
        if let Some(v) = &self.python {
            python_table(&mut s, v);
        }
        if let Some(v) = &self.multi {
            crate::multi::table(&mut s, v);
        }
        if let Some(v) = &self.frames {
            crate::frames::table(&mut s, v);
        }
        if let Some(v) = &self.hybrid {
            crate::hybrid::table(&mut s, v);
        }
        if !self.left_out.is_empty() {
            let _ = writeln!(
                s,
                "\nLeft out of this run (not selected: `--only`, `--gpu-only`; table 10 runs with \
                 `--only python` or `--peers`): {}.",
                self.left_out.join(", ")
            );
        }
        s
    }

    fn limits_table(&self, s: &mut String, l: &Limits) {
        let _ = writeln!(s, "## Limits of this machine (same run)\n");
        let _ = writeln!(
            s,
            "What this machine does at best, measured in this run with plain code that is not \
             gpufeed's: every *share of a limit* in the tables divides by one of these. Nothing \
             measured here can truly pass its limit, so a share above 100% is printed with \
             \"suspect\": the limit was measured low (a disk whose speed moved during the run, \
             a limit measured one way while the figure used another).\n"
        );
        let _ = writeln!(s, "| limit | how | GB/s |\n|---|---|---|");
        let _ = writeln!(
            s,
            "| memcpy | 1 thread, 256 MiB | {} |",
            l.memcpy_1_thread_gbps.show(1)
        );
        let _ = writeln!(
            s,
            "| memcpy | {} threads started together, 256 MiB split among them, copied 8 times | {} |",
            l.memcpy_threads,
            l.memcpy_n_threads_gbps.show(1)
        );
        let _ = writeln!(
            s,
            "| warm read() | one read() loop, 1 MiB buffer, the file in the page cache | {} |",
            l.read_warm_gbps.show(2)
        );
        for w in &l.disk {
            let _ = writeln!(s, "| the disk, one way | {} | {} |", w.how, w.gbps.show(2));
        }
        match l.disk_limit() {
            Some(best) => {
                let _ = writeln!(
                    s,
                    "| **the disk** | the best of the ways above: {} | **{}** |",
                    best.how,
                    best.gbps.show(2)
                );
            }
            None => {
                let _ = writeln!(s, "| the disk | not measured | - |");
            }
        }
        for note in &l.disk_notes {
            let _ = writeln!(s, "\nThe disk: {note}.");
        }
        let mut moved = Vec::new();
        let named = [
            ("memcpy, 1 thread", Some(&l.memcpy_1_thread_gbps)),
            ("memcpy, all threads", Some(&l.memcpy_n_threads_gbps)),
            ("warm read()", Some(&l.read_warm_gbps)),
            ("the disk", l.disk_limit().map(|d| &d.gbps)),
        ];
        for (name, samples) in named {
            if let Some(v) = samples.and_then(crate::limits::moved) {
                moved.push(format!("{name} ({:.0}%)", v * 100.0));
            }
        }
        if moved.is_empty() {
            let _ = writeln!(
                s,
                "\nEvery limit's repetitions stayed within {:.0}% of its median.",
                crate::limits::MAX_SPREAD * 100.0
            );
        } else {
            let _ = writeln!(
                s,
                "\n**Limits that moved during this run** (repetitions spread more than {:.0}% of \
                 the median): {}. Shares of these are unreliable in this run; run again on a \
                 quieter machine.",
                crate::limits::MAX_SPREAD * 100.0,
                moved.join(", ")
            );
        }
    }

    fn handoff_table(&self, s: &mut String, memcpy: f64, handoff: &[Handoff]) {
        let _ = writeln!(
            s,
            "\n## Table 1 — a {} batch handed from a producer process to a consumer process\n",
            show_size(self.batch_bytes)
        );
        let _ = writeln!(
            s,
            "| path | latency ms | GB/s | vs 1-thread memcpy | source: latency ms / GB/s (512 MB) |\n|---|---|---|---|---|"
        );
        for (h, src) in handoff.iter().zip(["120.5 / 4.2", "18.7 / 27.4"]) {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.2}x | {} |",
                h.mode,
                h.latency_ms.show(1),
                h.gbps.show(2),
                h.gbps.median / memcpy,
                src
            );
        }
        if let [file, shm] = handoff {
            let _ = writeln!(
                s,
                "\nShared memory is {:.1}x faster than the file here (the source material measured 6.4x). Latency runs from the \
                 producer starting the hand-over until the consumer holds every byte; the consumer \
                 checked the xxh3 of every batch ({} + {} verified). Creating and populating the \
                 segment took {:.0} ms once, outside the timing.",
                file.latency_ms.median / shm.latency_ms.median,
                file.verified_reps,
                shm.verified_reps,
                shm.setup_ms
            );
        }
    }

    fn access_table(&self, s: &mut String, access: &[AccessRow]) {
        let _ = writeln!(
            s,
            "\n## Table 2 — a {} data set: load and {} random {} KiB reads\n",
            show_size(self.dataset_bytes),
            RANDOM_READS,
            RANDOM_BYTES / 1024
        );
        let _ = writeln!(
            s,
            "| access | cache | first load ms | full pass ms (GB/s) | full pass, share of a limit | {RANDOM_READS} random reads ms | source: first load / random ms (1 GB) |\n|---|---|---|---|---|---|---|"
        );
        for r in access {
            let (src_load, src_rand) = r.access.source();
            let pass_gbps = self.dataset_bytes as f64 / (r.full_pass_ms.median / 1e3) / 1e9;
            // Cold passes are bound by the disk, a warm read() by the warm read() loop; a warm
            // mapping's pass copies nothing (it touches each page), so no limit bounds it.
            let of = match (
                &self.limits,
                r.temperature,
                r.access.label().starts_with("mmap"),
            ) {
                (Some(l), Temperature::Cold, _) => share(
                    pass_gbps,
                    l.disk_limit().map_or(f64::NAN, |d| d.gbps.median),
                    "the disk",
                ),
                (Some(l), Temperature::Warm, false) => {
                    share(pass_gbps, l.read_warm_gbps.median, "warm read()")
                }
                _ => "-".to_owned(),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} ({:.2}) | {of} | {} | {} / {} |",
                r.access.label(),
                match r.temperature {
                    Temperature::Cold => "cold",
                    Temperature::Warm => "warm",
                },
                r.first_load_ms.show(3),
                r.full_pass_ms.show(1),
                pass_gbps,
                r.random_ms.show(2),
                src_load,
                src_rand
            );
        }
        let cold_max = access
            .iter()
            .map(|r| r.cold_residency_max)
            .fold(0.0, f64::max);
        let _ = writeln!(
            s,
            "\nWhat the columns measure: *first load* = what makes the data addressable (the whole \
             read() for file IO; only the mmap() call for the mappings — the source's 5.2 ms is \
             this, not a read); *full pass* = until every byte was available once (read(), or \
             mmap + touching every page); *random* = {RANDOM_READS} reads of {} KiB at random \
             aligned offsets, copied into a buffer (mmap call included); *share of a limit*: cold \
             passes of the disk's limit, the warm read() of the warm read() limit, warm mappings \
             none (touching each page copies nothing, so no limit of this machine bounds them). \
             *source* = the source material's figures for a 1 GB file. Cold = the file's pages \
             dropped with fdatasync + POSIX_FADV_DONTNEED before each measurement (at most \
             {:.2}% stayed resident); warm = read into the page cache first.",
            RANDOM_BYTES / 1024,
            cold_max * 100.0
        );
    }

    fn reads_table(&self, s: &mut String, r: &Reads) {
        let _ = writeln!(
            s,
            "\n## Table 3 — gpufeed-uring: {} read sequentially in 1 MiB requests\n",
            show_size(self.dataset_bytes)
        );
        let _ = writeln!(
            s,
            "| O_DIRECT, queue depth | gpufeed-uring io_uring GB/s | threads (one per request) GB/s | fio GB/s | io_uring / fio | io_uring, share of a limit |\n|---|---|---|---|---|---|"
        );
        let disk = self
            .limits
            .as_ref()
            .and_then(Limits::disk_limit)
            .map_or(f64::NAN, |d| d.gbps.median);
        let memory = self.limits.as_ref().map_or(f64::NAN, Limits::memory_gbps);
        let warm_read = self
            .limits
            .as_ref()
            .map_or(f64::NAN, |l| l.read_warm_gbps.median);
        for row in &r.direct {
            let (fio, ratio) = match &row.fio_gbps {
                Some(f) => (
                    f.show(2),
                    format!("{:.2}x", row.uring_gbps.median / f.median),
                ),
                None => ("-".into(), "-".into()),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                row.queue_depth,
                row.uring_gbps.show(2),
                row.threads_gbps.show(2),
                fio,
                ratio,
                share(row.uring_gbps.median, disk, "the disk")
            );
        }
        let _ = writeln!(s, "\nfio: {}.\n", r.fio_note);
        let _ = writeln!(
            s,
            "| page cache warm | GB/s | vs the warm read() limit | share of a limit |\n|---|---|---|---|"
        );
        let _ = writeln!(
            s,
            "| one read() loop, 1 MiB buffer (the limits' warm read(), same measurement) | {} | 1.00x | {} |",
            self.limits
                .as_ref()
                .map_or("-".into(), |l| l.read_warm_gbps.show(2)),
            share(warm_read, memory, "memcpy")
        );
        let _ = writeln!(
            s,
            "| gpufeed-uring io_uring (qd {}, IOSQE_ASYNC) | {} | {:.2}x | {} |",
            r.warm_queue_depth,
            r.warm_uring_gbps.show(2),
            r.warm_uring_gbps.median / warm_read,
            share(r.warm_uring_gbps.median, memory, "memcpy")
        );
        let _ = writeln!(
            s,
            "| gpufeed-uring threads({}), qd {} | {} | {:.2}x | {} |",
            r.warm_threads,
            r.warm_queue_depth,
            r.warm_threads_gbps.show(2),
            r.warm_threads_gbps.median / warm_read,
            share(r.warm_threads_gbps.median, memory, "memcpy")
        );
        let _ = writeln!(
            s,
            "\nA warm read copies out of the page cache, so memcpy (the better of 1 and all threads) \
             bounds it."
        );
    }
}

/// `v` as a share of the limit `limit` called `of`: "87% of the disk". Above 100% the cell
/// says the limit is suspect: nothing can pass a true limit, so the limit was measured low.
fn share(v: f64, limit: f64, of: &str) -> String {
    let p = 100.0 * v / limit;
    if !p.is_finite() {
        "-".to_owned()
    } else if p > 100.0 {
        format!("{p:.0}% of {of}: above 100%, so {of}'s figure is suspect (measured low)")
    } else {
        format!("{p:.0}% of {of}")
    }
}

fn facade_table(s: &mut String, g: &GpuBench) {
    let f = &g.facade;
    let limit = g.pinned_limit_gbps.median;
    let _ = writeln!(
        s,
        "\n## Table 6 — gpufeed facade: a {} file and a {} safetensors checkpoint to the GPU\n",
        show_size(f.file_bytes),
        show_size(f.safetensors_bytes)
    );
    let _ = writeln!(s, "| load | GB/s | against |\n|---|---|---|");
    let _ = writeln!(
        s,
        "| warm, default options: {} | {} | {} |",
        f.warm_default_strategy,
        f.warm_default_gbps.show(1),
        share(f.warm_default_gbps.median, limit, "the pinned limit")
    );
    let _ = writeln!(
        s,
        "| warm, one IO thread (LoadOptions::one_thread: registered, one registering thread) | {} | {}; target 30 |",
        f.warm_one_thread_gbps.show(1),
        share(f.warm_one_thread_gbps.median, limit, "the pinned limit")
    );
    let _ = writeln!(
        s,
        "| warm, Strategy::Registered (two registering threads) | {} | {} |",
        f.warm_registered_gbps.show(1),
        share(f.warm_registered_gbps.median, limit, "the pinned limit")
    );
    let _ = writeln!(
        s,
        "| warm, Strategy::Staged right after a registered load (whose unregistration still runs in the background and holds off copies) | {} | {} |",
        f.warm_staged_gbps.show(1),
        share(f.warm_staged_gbps.median, limit, "the pinned limit")
    );
    let _ = writeln!(
        s,
        "| warm, safetensors::load (one bulk transfer) | {} | {}; target 45 |",
        f.safetensors_gbps.show(1),
        share(f.safetensors_gbps.median, limit, "the pinned limit")
    );
    let _ = writeln!(
        s,
        "| cold, default options: {} | {} | {} |",
        f.cold_default_strategy,
        f.cold_default_gbps.show(2),
        share(
            f.cold_default_gbps.median,
            f.raw_direct_read_gbps.median,
            "the raw O_DIRECT read"
        )
    );
    let _ = writeln!(
        s,
        "| raw O_DIRECT read of the same file (io_uring, qd 32, 1 MiB, to host memory) | {} | the disk's limit |",
        f.raw_direct_read_gbps.show(2)
    );
    let _ = writeln!(
        s,
        "| BatchLoader: 64 KiB records in shuffled batches of 256, 8 workers, device batches | {} | {}; {:.1} cores busy, {:.1} GB/s per core |",
        f.batch_loader_gbps.show(1),
        share(f.batch_loader_gbps.median, limit, "the pinned limit"),
        f.batch_loader_cores.median,
        f.batch_loader_gbps.median / f.batch_loader_cores.median
    );
    let _ = writeln!(
        s,
        "| BatchLoader: the same as 4 KiB records | {} | {}; {:.1} cores busy |",
        f.batch_loader_4k.gbps.show(1),
        share(f.batch_loader_4k.gbps.median, limit, "the pinned limit"),
        f.batch_loader_4k.cores_busy.median
    );
    let _ = writeln!(
        s,
        "\n`gpufeed::load_file` (a new `Loader`: its staging reserved, then its first load) moved the warm file at {:.1} GB/s; \
         the rows above reuse one `Loader` per setting.",
        f.first_load_gbps
    );
    one_shot_table(s, f);
}

/// One-shot loads: a fresh process per run (medians over the runs, min-max in parentheses).
fn one_shot_table(s: &mut String, f: &crate::facade::FacadeBench) {
    use crate::oneshot::OneShotRun;
    let _ = writeln!(
        s,
        "\n### One-shot: a fresh process opens the GPU, makes a `Loader` and loads three times (warm page cache)\n\n\
         | what | `Gpu::open` ms | `Loader::new` ms (staging reserved) | first load GB/s | second load GB/s (device pool grows) | third load GB/s (warm) | first / third |\n\
         |---|---|---|---|---|---|---|"
    );
    for (what, runs) in [
        ("file (`Loader::load_file`)", &f.one_shot_file),
        (
            "safetensors checkpoint (`safetensors::load_with`)",
            &f.one_shot_checkpoint,
        ),
    ] {
        if runs.is_empty() {
            continue;
        }
        let col =
            |g: fn(&OneShotRun) -> f64| crate::util::Samples::new(runs.iter().map(g).collect());
        let (first, second, third) = (
            col(OneShotRun::first_gbps),
            col(OneShotRun::second_gbps),
            col(OneShotRun::third_gbps),
        );
        let _ = writeln!(
            s,
            "| {what}, {} | {} | {} | {} | {} | {} | {:.2} |",
            show_size(runs[0].bytes),
            col(|r| r.open_ms).show(0),
            col(|r| r.loader_ms).show(1),
            first.show(1),
            second.show(1),
            third.show(1),
            first.median / third.median
        );
    }
    use crate::oneshot::OnRun;
    let _ = writeln!(
        s,
        "\n### One-shot in one call: `load_file_on(0, path)` / `safetensors::load_on(0, path)` in a fresh process \
         (the context created on another thread while the staging is faulted in and headers read)\n\n\
         | what | context ms | ready ms | loads ms | total ms | GB/s from the call | warm load ms (same process) | (total - context) / warm (target <= 1.1) | staging |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    for (what, runs) in [
        ("file (`load_file_on`)", &f.one_shot_on_file),
        (
            "safetensors checkpoint (`safetensors::load_on`)",
            &f.one_shot_on_checkpoint,
        ),
    ] {
        if runs.is_empty() {
            continue;
        }
        let col = |g: fn(&OnRun) -> f64| crate::util::Samples::new(runs.iter().map(g).collect());
        let _ = writeln!(
            s,
            "| {what}, {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            show_size(runs[0].bytes),
            col(|r| r.context_ms).show(0),
            col(|r| r.ready_ms).show(0),
            col(|r| r.load_ms).show(1),
            col(|r| r.total_ms).show(0),
            col(OnRun::total_gbps).show(1),
            col(|r| r.second_ms).show(1),
            col(OnRun::past_context_ratio).show(2),
            show_size(runs[0].staging_bytes)
        );
    }
}

fn gpu_table(s: &mut String, g: &GpuBench) {
    let limit = g.pinned_limit_gbps.median;
    let _ = writeln!(
        s,
        "\n## Table 4 — {} ({}, {}, NUMA node {}): host -> GPU, {} per transfer\n",
        g.gpu,
        g.pci_bus_id,
        g.pcie,
        g.numa_node.map_or("unknown".into(), |n| n.to_string()),
        show_size(g.bytes)
    );
    let _ = writeln!(s, "| path | GB/s | share of a limit |\n|---|---|---|");
    let _ = writeln!(
        s,
        "| the pinned limit: pinned memory, 1 stream, 16 MiB cuMemcpyHtoDAsync | {} | the limit |",
        g.pinned_limit_gbps.show(1)
    );
    for (name, v) in [
        (
            "TransferScheduler from pinned (4 streams, 16 MiB)",
            &g.sched_pinned_gbps,
        ),
        (
            "TransferScheduler from a pageable Vec (staged, default fill threads)",
            &g.sched_pageable_gbps,
        ),
        (
            "naive cuMemcpyHtoD from a pageable Vec",
            &g.naive_pageable_gbps,
        ),
    ] {
        let _ = writeln!(
            s,
            "| {name} | {} | {} |",
            v.show(1),
            share(v.median, limit, "the pinned limit")
        );
    }
    let _ = writeln!(
        s,
        "| {} registered read-only file mapping (page cache), copies from one thread | {} | {} |",
        show_size(g.file_bytes),
        g.registered_copy_gbps.show(1),
        share(g.registered_copy_gbps.median, limit, "the pinned limit")
    );
    let _ = writeln!(
        s,
        "| same, including cuMemHostRegister ({} ms) | {} | {} |",
        g.register_ms.show(0),
        g.registered_with_register_gbps.show(1),
        share(
            g.registered_with_register_gbps.median,
            limit,
            "the pinned limit"
        )
    );
    let sweep: Vec<String> = g
        .pageable_by_fill_threads
        .iter()
        .map(|(t, v)| format!("{t}: {:.1}", v.median))
        .collect();
    let _ = writeln!(
        s,
        "\nStaged pageable upload by fill threads (GB/s, median): {}; the default here is {} threads.",
        sweep.join(", "),
        g.default_fill_threads
    );
    let _ = writeln!(
        s,
        "\nPool: steady-state `get` of a 64 MiB pinned buffer {} us (median, min-max of 1000) against \
         {:.1} ms for cuMemHostAlloc of 64 MiB; cuMemHostAlloc of {} took {:.0} ms.",
        g.pool_get_us.show(2),
        g.alloc_64mib_ms,
        show_size(g.bytes),
        g.pinned_alloc_ms
    );
}

/// The peers' rows of the GPU run (`--peers`), after table 8.
fn peers_table(s: &mut String, g: &GpuBench) {
    if let Some(peers) = g.peers.as_ref().and_then(|p| p.as_object()) {
        let _ = writeln!(
            s,
            "\n## Peers — same run, same files (warm)\n\n| peer | GB/s |\n|---|---|"
        );
        for (name, v) in peers {
            let cell = match v.as_array() {
                Some(runs) => {
                    let samples =
                        crate::util::Samples::new(runs.iter().filter_map(|x| x.as_f64()).collect());
                    samples.show(1)
                }
                None => format!(
                    "did not run: {}",
                    v.get("error").and_then(|e| e.as_str()).unwrap_or("?")
                ),
            };
            let _ = writeln!(s, "| {name} | {cell} |");
        }
    }
}

fn save_table(s: &mut String, v: &crate::save::SaveBench) {
    let disk = v.raw_direct_write_gbps.median;
    let pct = |x: f64| share(x, disk, "the disk's O_DIRECT write");
    let _ = writeln!(
        s,
        "\n## Table 8 — checkpoints out: the {} file saved back from GPU memory\n\n\
         Each save writes a temporary file beside the target and renames it over the target once \
         synced (crash-safe); the time runs from the call until the file is in place.\n\n\
         | what | GB/s | against |\n|---|---|---|",
        show_size(v.bytes)
    );
    let _ = writeln!(
        s,
        "| `Saver::save_file`: device -> pinned windows -> O_DIRECT writes, synced and renamed | {} | {} |",
        v.save_gbps.show(2),
        pct(v.save_gbps.median)
    );
    let _ = writeln!(
        s,
        "| `gpufeed::save_file`: a new `Saver` per call (pinned windows allocated on the way) | {} | {} |",
        v.one_shot_save_gbps.show(2),
        pct(v.one_shot_save_gbps.median)
    );
    let _ = writeln!(
        s,
        "| `safetensors::save` of the {} checkpoint of table 6, every tensor from its device view | {} | {} |",
        show_size(v.checkpoint_bytes),
        v.checkpoint_save_gbps.show(2),
        pct(v.checkpoint_save_gbps.median)
    );
    let _ = writeln!(
        s,
        "| the disk's limit: O_DIRECT writes of one aligned host buffer (gpufeed-uring `Writer`, qd 16, 1 MiB), synced | {} | the limit |",
        v.raw_direct_write_gbps.show(2)
    );
    match &v.fio_write_gbps {
        Some(f) => {
            let _ = writeln!(
                s,
                "| fio: {} | {} | {} |",
                v.fio_note,
                f.show(2),
                pct(f.median)
            );
        }
        None => {
            let _ = writeln!(s, "| fio | {} | |", v.fio_note);
        }
    }
    let _ = writeln!(
        s,
        "| the saves' device -> pinned part (window fills) | {} | {} |",
        v.save_fill_gbps.show(1),
        share(
            v.save_fill_gbps.median,
            v.d2h_limit_gbps.median,
            "the device -> host limit"
        )
    );
    let _ = writeln!(
        s,
        "| device -> host limit: `TransferScheduler::download` of 1 GiB into pinned memory | {} | |",
        v.d2h_limit_gbps.show(1)
    );
    let _ = writeln!(
        s,
        "\n{} of {} bytes written with O_DIRECT{}. The saved checkpoint stays at {} for checks \
         with other readers.",
        v.save_direct_bytes,
        v.bytes,
        if v.save_fallbacks.is_empty() {
            String::new()
        } else {
            format!("; fallbacks: {}", v.save_fallbacks.join("; "))
        },
        v.checkpoint_saved.display()
    );
}

fn python_table(s: &mut String, v: &crate::python::PythonBench) {
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
            "\n`gpufeed.safe_open` of the 16-tensor checkpoint (headers read, every file \
             registered: paid once per open, not in the on-demand rows) took {:.0} ms.",
            open.median * 1e3
        );
    }
    for (what, why) in &v.errors {
        let _ = writeln!(s, "\n{what}: did not run: {why}");
    }
}

fn small_table(s: &mut String, v: &crate::small::SmallBench) {
    let _ = writeln!(
        s,
        "\n## Table 9 — small loads on {}: the size curve and a folder of small files\n\n\
         One reused `Loader` with default options loads warm files of each size; a load's time \
         runs from the call until the bytes are on the GPU (device memory, checks, reads, \
         copies). \"The wire\" copies the same number of bytes from a pinned buffer on one \
         stream (chunks of up to 16 MiB), synchronized: what the link alone takes. \
         \"Registered\" loads the same file with `Loader::load_registered` from a \
         `RegisteredFile` opened once (its mapping and registration, paid once, in the last \
         column): one copy by the GPU out of the page cache, new device memory each time. \
         Median of 15 repetitions up to 256 MiB, of the run's repetitions above.\n\n\
         | size | gpufeed GB/s | time per load | registered GB/s | registered, time per load | the wire GB/s | the wire's time | gpufeed / registered, share of the wire | registering once |\n\
         |---|---|---|---|---|---|---|---|---|",
        v.gpu
    );
    let time = |secs: f64| {
        if secs < 1e-3 {
            format!("{:.0} us", secs * 1e6)
        } else {
            format!("{:.2} ms", secs * 1e3)
        }
    };
    for r in &v.curve {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {:.0}% / {:.0}% | {:.1} ms |",
            show_size(r.bytes),
            r.gbps.show(1),
            time(r.seconds.median),
            r.registered_gbps.show(1),
            time(r.registered_seconds.median),
            r.wire_gbps.show(1),
            time(r.wire_seconds.median),
            100.0 * r.gbps.median / r.wire_gbps.median,
            100.0 * r.registered_gbps.median / r.wire_gbps.median,
            r.register_ms
        );
    }
    let f = &v.files;
    let _ = writeln!(
        s,
        "\n{} files of 60-160 KiB ({} in all, in ten class folders under {}); listing them \
         (`FileList::new`, statx of each) took {} ms.\n\n\
         | how | GB/s | files per second | against |\n|---|---|---|---|",
        f.files,
        show_size(f.bytes),
        f.folder.display(),
        f.list_ms.show(1)
    );
    let _ = writeln!(
        s,
        "| one `Loader::load_file` per file, warm | {} | {:.0} ({:.0} us per file) | |",
        f.per_file_gbps.show(2),
        f.files as f64 / (f.bytes as f64 / 1e9 / f.per_file_gbps.median),
        f.per_file_us.median
    );
    let _ = writeln!(
        s,
        "| `Loader::load_list` of all of them, warm: {} | {} | {:.0} | {:.1}x one load per file |",
        f.warm_strategy,
        f.warm_gbps.show(1),
        f.warm_files_per_s.median,
        f.warm_gbps.median / f.per_file_gbps.median
    );
    let _ = writeln!(
        s,
        "| `Loader::load_list`, cold: {} | {} | {:.0} | {} |",
        f.cold_strategy,
        f.cold_gbps.show(2),
        f.cold_files_per_s.median,
        share(
            f.cold_gbps.median,
            f.cold_limit_gbps.median,
            "the disk's limit"
        )
    );
    let _ = writeln!(
        s,
        "| the disk's limit: O_DIRECT reads of the same files into host memory (gpufeed-uring, 256 files per batch; the best of 1 thread at queue depth 64 and 1 per core at 32), cold | {} | | the limit |",
        f.cold_limit_gbps.show(2)
    );
    let _ = writeln!(
        s,
        "| `dataset::BatchLoader` over the folder as an `ImageFolder` (listed in {:.0} ms): shuffled batches of 256 files with labels, 8 workers, to the GPU, warm; one epoch | {} | {:.0} | |",
        f.image_folder_open_ms,
        f.batch_loader_gbps.show(1),
        f.batch_loader_files_per_s.median
    );
    if let Some(peers) = f.torch_dataloader.as_ref().and_then(|p| p.as_object()) {
        for (name, v) in peers {
            match v.as_array() {
                Some(runs) => {
                    let g =
                        crate::util::Samples::new(runs.iter().filter_map(|x| x.as_f64()).collect());
                    let _ = writeln!(
                        s,
                        "| peer: {name}, same folder, one epoch | {} | {:.0} | gpufeed's BatchLoader {:.1}x |",
                        g.show(2),
                        g.median * 1e9 * f.files as f64 / f.bytes as f64,
                        f.batch_loader_gbps.median / g.median
                    );
                }
                None => {
                    let _ = writeln!(
                        s,
                        "| peer: {name} | did not run: {} | | |",
                        v.get("error").and_then(|e| e.as_str()).unwrap_or("?")
                    );
                }
            }
        }
    }
}

fn ipc_table(s: &mut String, i: &IpcBench, memcpy: f64) {
    let _ = writeln!(
        s,
        "\n## Table 5 — gpufeed-ipc: {} batches of 1 MiB, producer process -> consumer process\n",
        i.batches
    );
    let _ = writeln!(
        s,
        "| path | GB/s | vs 1-thread memcpy ({memcpy:.1} GB/s, same run) |\n|---|---|---|"
    );
    let _ = writeln!(
        s,
        "| BatchRing (copy into the slot, zero-copy take) | {} | {:.2}x |",
        i.ring_gbps.show(2),
        i.ring_gbps.median / memcpy
    );
    let _ = writeln!(
        s,
        "| Unix socket (write + read) | {} | {:.2}x |",
        i.socket_gbps.show(2),
        i.socket_gbps.median / memcpy
    );
    let _ = writeln!(
        s,
        "\n64-byte messages, consumer asleep in `next`: wake-up latency p50 {:.1} us, p99 {:.1} us \
         ({} messages; target p50 <= 5 us).",
        i.latency_p50_us,
        i.latency_p99_us,
        i.latency_us.all.len()
    );
    let _ = writeln!(
        s,
        "\nThe rendezvous of one process per GPU (`gpufeed_ipc::Rendezvous`, two ranks), one rank \
         waiting {} ms for the other at each meeting: from the late rank's arrival until the \
         waiting rank's `exchange` returns, p50 {:.1} us, p99 {:.1} us ({} meetings).",
        crate::ipc::BARRIER_LAG.as_millis(),
        i.barrier_p50_us,
        i.barrier_p99_us,
        i.barrier_us.all.len()
    );
}

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn a_share_above_100_percent_says_the_limit_is_suspect() {
        assert_eq!(share(8.7, 10.0, "the disk"), "87% of the disk");
        let above = share(11.3, 10.0, "the disk");
        assert!(
            above.starts_with("113% of the disk") && above.contains("suspect"),
            "{above}"
        );
        assert_eq!(share(1.0, f64::NAN, "the disk"), "-");
        assert_eq!(share(1.0, 0.0, "the disk"), "-");
    }
}
