//! Table 11 (machines with several GPUs): every GPU's pinned limit alone and all at once, one
//! GPU loading a warm file, then all GPUs: sharded by bytes (one `MultiLoader`, and a default
//! `Loader` per GPU for comparison), replicated, and tensor-parallel rows and columns of a
//! checkpoint of the same size.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Barrier;

use anyhow::{Context, Result};
use gpufeed::multi::{MultiLoader, ShardPlan};
use gpufeed::safetensors::{Split, TensorParallel};
use gpufeed::{Gpu, LoadOptions, Loader};
use gpufeed_os::cache;
use gpufeed_pinned::PinnedBuffer;
use serde::Serialize;

use crate::util::{Samples, SplitMix, ensure_random_file, gbps, show_size, timed};

/// Columns of the checkpoint's 2-D F16 tensors (16 KiB rows: a column split of two GPUs reads
/// 8 KiB spans).
const COLS: usize = 8192;

#[derive(Debug, Serialize)]
pub struct MultiBench {
    pub gpus: usize,
    pub file_bytes: u64,
    pub checkpoint_bytes: u64,
    /// Each GPU's pinned limit alone (1 GiB, 16 MiB copies).
    pub pinned_alone_gbps: Vec<Samples>,
    /// All GPUs copying from pinned memory at once: GB/s in all.
    pub pinned_together_gbps: Samples,
    /// GPU 0 alone, a reused default `Loader`, the whole file.
    pub one_gpu_gbps: Samples,
    pub one_gpu_seconds: Samples,
    /// All GPUs, `MultiLoader::load_sharded` of `ShardPlan::split_bytes` with
    /// `LoadOptions::for_gpus`: GB/s in all.
    pub sharded_gbps: Samples,
    /// All GPUs, a default `Loader` each (each sized for the whole host), the same shares.
    pub separate_loaders_gbps: Samples,
    /// All GPUs, `MultiLoader::load_replicated` of the file.
    pub replicated_seconds: Samples,
    /// One process per GPU (`RankLoader`), sharded by bytes: GB/s in all (the file over the
    /// slowest rank's time).
    pub ranks_sharded_gbps: Option<Samples>,
    /// One process per GPU, replicated through the staging slots the ranks share: seconds of
    /// the slowest rank.
    pub ranks_replicated_seconds: Option<Samples>,
    /// Why the one-process-per-GPU rows did not run.
    pub ranks_error: Option<String>,
    /// One process per GPU, replicated through NCCL broadcasts: seconds of the slowest rank;
    /// or why not.
    pub ranks_nccl_replicated_seconds: std::result::Result<Samples, String>,
    /// The slowest rank's first replicated load (staging slots; NCCL), setup included: what a
    /// job that loads once sees. Not among the samples above.
    pub ranks_first_replicated_seconds: Option<f64>,
    pub ranks_nccl_first_replicated_seconds: Option<f64>,
    /// Tensor-parallel loads of the checkpoint: GB/s in all.
    pub tp_rows_gbps: Samples,
    pub tp_columns_gbps: Samples,
    /// `load_sharded` by fill threads per GPU and chunk bytes (staging: two buffers per
    /// thread): (threads, chunk, GB/s in all).
    pub sharded_sweep: Vec<(usize, usize, Samples)>,
    /// `load_replicated` of 1 GiB rounds with its peer copies skipped (a test hook): the reads
    /// in rounds alone, seconds.
    pub replicated_reads_only_seconds: Samples,
    /// `load_replicated` by round bytes: (round, seconds).
    pub replicated_by_round: Vec<(u64, Samples)>,
    /// `MultiLoader::load_replicated_safetensors` of the checkpoint, seconds.
    pub replicated_checkpoint_seconds: Samples,
    /// The peers (peers.py --multi) on the checkpoint: name -> seconds, or their error.
    pub peers: Option<serde_json::Value>,
    pub links: Vec<String>,
    pub notes: Vec<String>,
}

pub fn measure(
    exe: &Path,
    dir: &Path,
    file_bytes: u64,
    reps: usize,
    peers: bool,
    mut progress: impl FnMut(&str),
) -> Result<Option<MultiBench>> {
    let count = match Gpu::count() {
        Ok(n) => n,
        Err(e) if e.is_no_gpu() => {
            progress(&format!("no GPU: {e}"));
            return Ok(None);
        }
        Err(e) => return Err(e.into()),
    };
    if count < 2 {
        progress(&format!(
            "table 11: {count} GPU(s): several GPUs are needed (the two-GPU machine)"
        ));
        return Ok(None);
    }
    let file = dir.join(format!("gpu-file-{file_bytes}.bin"));
    progress(&format!(
        "table 11: {} file and checkpoint on {count} GPUs",
        show_size(file_bytes)
    ));
    ensure_random_file(&file, file_bytes, crate::gpu::FILE_SEED)?;
    let ckpt = dir.join(format!("tp-{file_bytes}.safetensors"));
    let checkpoint_bytes = ensure_checkpoint(&ckpt, file_bytes)?;
    cache::warm(&file)?;
    cache::warm(&ckpt)?;
    let ordinals: Vec<usize> = (0..count).collect();
    let gpus = ordinals
        .iter()
        .map(|&o| Gpu::open(o))
        .collect::<Result<Vec<_>, _>>()?;

    progress("table 11: pinned limits, alone and together");
    let pin_len = 1usize << 30;
    let mut data = vec![0u8; pin_len];
    SplitMix(0x6F1).fill(&mut data);
    let mut setups = Vec::new();
    for gpu in &gpus {
        let mut pinned = PinnedBuffer::new(gpu.context(), pin_len)?;
        pinned.copy_from_slice(&data);
        let dev = gpu.alloc_zeroed(pin_len)?;
        let stream = gpu.context().new_stream()?;
        setups.push((pinned, dev, stream));
    }
    drop(data);
    let mut alone = Vec::new();
    for (pinned, dev, stream) in &mut setups {
        alone.push(warm(reps, || {
            crate::gpu::pinned_copy_gbps(pinned, dev, stream)
        })?);
    }
    let pinned_together_gbps = warm(reps, || {
        let secs = together(&mut setups, |_, (p, d, st)| {
            crate::gpu::pinned_copy_gbps(p, d, st).map(drop)
        })?;
        Ok(gbps(pin_len as u64 * count as u64, secs))
    })?;
    drop(setups);

    progress("table 11: one GPU, then all GPUs sharded with one MultiLoader");
    let one = Loader::new(&gpus[0], LoadOptions::default())?;
    let one_gpu_seconds = warm(reps, || Ok(timed(|| one.load_file(&file).map(drop)).0))?;
    drop(one);
    let multi = MultiLoader::new(&gpus, LoadOptions::for_gpus(count))?;
    let plan = ShardPlan::split_bytes(&[&file], count)?;
    let sharded_gbps = warm(reps, || Ok(multi.load_sharded(&plan)?.1.read_gbps()))?;

    progress("table 11: a default Loader per GPU, the same shares");
    let mut separate: Vec<Loader> = gpus
        .iter()
        .map(|g| Loader::new(g, LoadOptions::default()))
        .collect::<Result<_, _>>()?;
    let separate_loaders_gbps = warm(reps, || {
        let secs = together(&mut separate, |r, l| {
            let span = &plan.spans(r)[0];
            l.load_range(&file, span.range.clone())
                .map(drop)
                .map_err(Into::into)
        })?;
        Ok(gbps(file_bytes, secs))
    })?;
    drop(separate);

    progress("table 11: replicated, then tensor-parallel rows and columns");
    let replicated_seconds = warm(reps, || Ok(multi.load_replicated(&file)?.1.seconds))?;
    let tp = |split: Split| -> Result<Samples> {
        let plan = TensorParallel::plan(&ckpt, count, split)?;
        warm(reps, || {
            Ok(multi.load_tensor_parallel(&plan)?.1.read_gbps())
        })
    };
    let replicated_checkpoint_seconds = warm(reps, || {
        Ok(multi.load_replicated_safetensors(&ckpt)?.1.seconds)
    })?;
    let tp_rows_gbps = tp(Split::Rows)?;
    let tp_columns_gbps = tp(Split::Columns)?;
    let links = multi
        .links()
        .iter()
        .map(|l| format!("GPU {} -> GPU {}: {}", l.from, l.to, l.kind()))
        .collect();
    let notes = multi.notes().to_vec();

    progress("table 11: replicated by round size");
    let mut replicated_by_round = Vec::new();
    let mut multi = multi;
    for round in [64u64 << 20, 256 << 20, 4 << 30] {
        multi = multi.with_round_bytes(round);
        let secs = warm(reps, || Ok(multi.load_replicated(&file)?.1.seconds))?;
        replicated_by_round.push((round, secs));
    }
    multi = multi
        .with_round_bytes(1 << 30)
        .testing_skip_peer_copies(true);
    let replicated_reads_only_seconds = warm(reps, || Ok(multi.load_replicated(&file)?.1.seconds))?;
    drop(multi);

    progress("table 11: one process per GPU (RankLoader), sharded and replicated");
    let mut ranks_first_replicated_seconds = None;
    let (ranks_sharded_gbps, ranks_replicated_seconds, ranks_error) =
        match ranks(exe, &file, count, reps, Via::Staging, None) {
            Ok((s, r, first)) => {
                ranks_first_replicated_seconds = slowest_first(&first);
                (Some(s.map(|t| gbps(file_bytes, t))), Some(r), None)
            }
            Err(e) => (None, None, Some(format!("{e:#}"))),
        };
    progress("table 11: one process per GPU, replicated through NCCL");
    let mut ranks_nccl_first_replicated_seconds = None;
    let ranks_nccl_replicated_seconds = match gpufeed::cuda::nccl_version() {
        Ok(_) => ranks(exe, &file, count, reps, Via::Nccl, None)
            .map(|(_, r, first)| {
                ranks_nccl_first_replicated_seconds = slowest_first(&first);
                r
            })
            .map_err(|e| format!("{e:#}")),
        Err(e) => Err(e.to_string()),
    };

    let peers = peers.then(|| {
        progress("table 11: the peers on the checkpoint (peers.py --multi)");
        crate::gpu::run_peer_script(&[
            "--multi".into(),
            ckpt.display().to_string(),
            count.to_string(),
            reps.to_string(),
        ])
    });

    progress("table 11: sharded by fill threads and chunk size");
    let mut sharded_sweep = Vec::new();
    for threads in [4usize, 8, 12, 16] {
        for chunk in [1usize << 20, 2 << 20, 4 << 20] {
            let mut opts = LoadOptions::default();
            opts.transfer = opts
                .transfer
                .with_fill_threads(threads)
                .with_staging_buffers(2 * threads)
                .with_chunk_bytes(chunk);
            let m = MultiLoader::new(&gpus, opts)?;
            let x = warm(reps, || Ok(m.load_sharded(&plan)?.1.read_gbps()))?;
            sharded_sweep.push((threads, chunk, x));
        }
    }
    Ok(Some(MultiBench {
        gpus: count,
        file_bytes,
        checkpoint_bytes,
        pinned_alone_gbps: alone,
        pinned_together_gbps,
        one_gpu_gbps: one_gpu_seconds.map(|s| gbps(file_bytes, s)),
        one_gpu_seconds,
        sharded_gbps,
        separate_loaders_gbps,
        replicated_seconds,
        tp_rows_gbps,
        tp_columns_gbps,
        sharded_sweep,
        replicated_by_round,
        replicated_reads_only_seconds,
        replicated_checkpoint_seconds,
        peers,
        ranks_sharded_gbps,
        ranks_replicated_seconds,
        ranks_error,
        ranks_nccl_replicated_seconds,
        ranks_first_replicated_seconds,
        ranks_nccl_first_replicated_seconds,
        links,
        notes,
    }))
}

/// A table note: the first replicated load's seconds, where known.
fn first_load(seconds: Option<f64>) -> String {
    seconds.map_or(String::new(), |t| {
        format!("; the first load (its setup included) {t:.3} s")
    })
}

/// The slowest rank's seconds of its first replicated load, from `ranks`' reports.
fn slowest_first(first: &[serde_json::Value]) -> Option<f64> {
    first
        .iter()
        .map(|v| v["seconds"].as_f64())
        .collect::<Option<Vec<f64>>>()
        .and_then(|all| all.into_iter().reduce(f64::max))
}

/// How a `RankLoader`'s replicated loads copy between the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// Staging slots the ranks share (the default).
    Staging,
    /// CUDA IPC handles of new `cuMemAlloc` memory (`with_shared_staging(false)`).
    Ipc,
    /// NCCL broadcasts (`with_nccl(true)`).
    Nccl,
}

/// `count` rank processes (this program's `rank` command) over `file`: per repetition, the
/// slowest rank's seconds of a sharded and of a replicated load (copied `via`; in rounds of
/// `round_mib` MiB where given); and each rank's first replicated load (which sets up the
/// staging slots or the NCCL communicator: seconds and parts), not among the repetitions.
pub fn ranks(
    exe: &Path,
    file: &Path,
    count: usize,
    reps: usize,
    via: Via,
    round_mib: Option<u64>,
) -> Result<(Samples, Samples, Vec<serde_json::Value>)> {
    let job = format!("bench-{}", std::process::id());
    let children = (0..count)
        .map(|r| {
            std::process::Command::new(exe)
                .args(["rank", "--path"])
                .arg(file)
                .args(["--reps", &reps.to_string()])
                .args([
                    "--via",
                    clap::ValueEnum::to_possible_value(&via)
                        .expect("a value")
                        .get_name(),
                ])
                .args(round_mib.map(|m| format!("--round-mib={m}")))
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", count.to_string())
                .env("GPUFEED_JOB", &job)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .context("start a rank process")
        })
        .collect::<Result<Vec<_>>>()?;
    let mut per_rank = Vec::new();
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output()?;
        anyhow::ensure!(out.status.success(), "rank {r} failed ({})", out.status);
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).with_context(|| format!("rank {r}'s report"))?;
        per_rank.push(v);
    }
    let slowest = |key: &str| -> Samples {
        Samples::new(
            (0..reps)
                .map(|i| {
                    per_rank
                        .iter()
                        .filter_map(|v| v[key][i].as_f64())
                        .fold(0.0, f64::max)
                })
                .collect(),
        )
    };
    let first = per_rank
        .iter()
        .map(|v| v["first_replicated"].clone())
        .collect();
    Ok((slowest("sharded"), slowest("replicated"), first))
}

/// One rank: `RankLoader::from_env` (replicated loads copied `via`; in rounds of `round_mib`
/// MiB where given), then a warm-up and `reps` sharded and replicated loads of `path`; prints
/// their seconds as JSON.
pub fn rank_child(path: &Path, reps: usize, via: Via, round_mib: Option<u64>) -> Result<()> {
    let mut rank = gpufeed::multi::RankLoader::from_env()?
        .with_shared_staging(via == Via::Staging)
        .with_nccl(via == Via::Nccl);
    if let Some(mib) = round_mib {
        rank = rank.with_round_bytes(mib << 20);
    }
    let plan = ShardPlan::split_bytes(&[path], rank.world())?;
    // All sharded loads, then all replicated ones: as in the rows of one process above, a
    // kind of load never follows the other's (large) frees. Every load starts after a barrier,
    // as the rows of one process start their threads together: without it a rank's time
    // included waiting for the others to free the last load's memory (runs up to 48).
    let mut sharded = Vec::new();
    for i in 0..reps + 1 {
        rank.barrier()?;
        let (buf, r) = rank.load_sharded(&plan)?;
        drop(buf);
        if i > 0 {
            sharded.push(r.seconds);
        }
    }
    let (mut replicated, mut parts, mut first) = (Vec::new(), Vec::new(), None);
    for i in 0..reps + 1 {
        rank.barrier()?;
        let (buf, r) = rank.load_replicated(path)?;
        drop(buf);
        let part = serde_json::json!({"seconds": r.seconds, "exchange": r.exchange_seconds,
            "alloc": r.alloc_seconds, "peer_open": r.peer_open_seconds,
            "peer_close": r.peer_close_seconds});
        match i {
            // The first replicated load makes the staging slots or the NCCL communicator.
            0 => first = Some(part),
            _ => {
                replicated.push(r.seconds);
                parts.push(part);
            }
        }
    }
    println!(
        "{}",
        serde_json::json!({"sharded": sharded, "replicated": replicated,
            "replicated_parts": parts, "first_replicated": first,
            "shared_staging": rank.shares_staging()})
    );
    Ok(())
}

/// `f` once to warm up, then `reps` times: the samples of those.
fn warm(reps: usize, mut f: impl FnMut() -> Result<f64>) -> Result<Samples> {
    f()?;
    (0..reps)
        .map(|_| f())
        .collect::<Result<_>>()
        .map(Samples::new)
}

/// `f(i, item)` for every item on a thread each, started together; the seconds until the last
/// one ended.
fn together<I: Send>(
    items: &mut [I],
    f: impl Fn(usize, &mut I) -> Result<()> + Sync,
) -> Result<f64> {
    let barrier = Barrier::new(items.len());
    let (secs, res) = timed(|| {
        std::thread::scope(|s| {
            let hs: Vec<_> = items
                .iter_mut()
                .enumerate()
                .map(|(i, item)| {
                    let (barrier, f) = (&barrier, &f);
                    s.spawn(move || {
                        barrier.wait();
                        f(i, item)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .map_err(|_| anyhow::anyhow!("a bench thread panicked"))?
                })
                .collect::<Result<Vec<()>>>()
        })
    });
    res?;
    Ok(secs)
}

/// A safetensors checkpoint of about `bytes` in 2-D F16 tensors of `COLS` columns (256 MiB
/// each, fewer rows for the last), its header written by hand and its data streamed, synced.
fn ensure_checkpoint(path: &PathBuf, bytes: u64) -> Result<u64> {
    if let Ok(m) = path.metadata() {
        return Ok(m.len());
    }
    let row = (COLS * 2) as u64;
    let per = (256u64 << 20).min(bytes) / row;
    let rows_total = (bytes / row).max(1);
    let mut header = serde_json::Map::new();
    let (mut at, mut left, mut i) = (0u64, rows_total, 0usize);
    while left > 0 {
        let rows = per.min(left);
        header.insert(
            format!("layers.{i}.weight"),
            serde_json::json!({"dtype": "F16", "shape": [rows, COLS], "data_offsets": [at, at + rows * row]}),
        );
        at += rows * row;
        left -= rows;
        i += 1;
    }
    let mut text = serde_json::to_vec(&header)?;
    text.resize(text.len().next_multiple_of(8), b' ');
    let tmp = path.with_extension("tmp");
    let mut f = std::io::BufWriter::with_capacity(
        16 << 20,
        std::fs::File::create(&tmp).with_context(|| format!("create {}", tmp.display()))?,
    );
    f.write_all(&(text.len() as u64).to_le_bytes())?;
    f.write_all(&text)?;
    let mut rng = SplitMix(0x7E45);
    let mut buf = vec![0u8; 16 << 20];
    let mut left = at;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        rng.fill(&mut buf[..n]);
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    let f = f.into_inner().map_err(|e| e.into_error())?;
    f.sync_all().context("fsync the checkpoint")?;
    std::fs::rename(&tmp, path)?;
    Ok(path.metadata()?.len())
}

pub fn table(s: &mut String, v: &MultiBench) {
    let n = v.gpus;
    let alone: f64 = v.pinned_alone_gbps.iter().map(|x| x.median).sum();
    let _ = writeln!(
        s,
        "\n## Table 11 — {n} GPUs at once: a {} file (warm), sharded and replicated, and a {} \
         checkpoint cut tensor-parallel\n\n\
         *Pinned limit*: 1 GiB from pinned memory in 16 MiB copies, each GPU alone and all at \
         once. GB/s of the sharded rows: bytes read from the host by all GPUs over the time \
         until the last one holds its share.\n\n| what | GB/s | seconds | against |\n|---|---|---|---|",
        show_size(v.file_bytes),
        show_size(v.checkpoint_bytes)
    );
    for (g, x) in v.pinned_alone_gbps.iter().enumerate() {
        let _ = writeln!(s, "| pinned limit, GPU {g} alone | {} | | |", x.show(1));
    }
    let _ = writeln!(
        s,
        "| pinned limit, {n} GPUs at once | {} | | {:.2} of the sum alone |",
        v.pinned_together_gbps.show(1),
        v.pinned_together_gbps.median / alone
    );
    let _ = writeln!(
        s,
        "| one GPU, a reused default `Loader` | {} | {} | |",
        v.one_gpu_gbps.show(1),
        v.one_gpu_seconds.show(3)
    );
    let two_pinned = v.pinned_together_gbps.median;
    let _ = writeln!(
        s,
        "| {n} GPUs sharded by bytes, one `MultiLoader` (`LoadOptions::for_gpus`) | {} | | {:.2} of {n} GPUs' pinned limit at once, {:.2} of the sum alone |",
        v.sharded_gbps.show(1),
        v.sharded_gbps.median / two_pinned,
        v.sharded_gbps.median / alone
    );
    let _ = writeln!(
        s,
        "| {n} GPUs, a default `Loader` each, same shares | {} | | {:.2}x the `MultiLoader` |",
        v.separate_loaders_gbps.show(1),
        v.separate_loaders_gbps.median / v.sharded_gbps.median
    );
    let _ = writeln!(
        s,
        "| {n} GPUs replicated, rounds of 1 GiB (each reads 1/{n}, peers send the rest) | {} | {} | {:.2}x one GPU's time |",
        v.replicated_seconds.map(|t| gbps(v.file_bytes, t)).show(1),
        v.replicated_seconds.show(3),
        v.replicated_seconds.median / v.one_gpu_seconds.median
    );
    let _ = writeln!(
        s,
        "| {n} GPUs tensor-parallel, rows | {} | | |\n| {n} GPUs tensor-parallel, columns ({} B spans) | {} | | |",
        v.tp_rows_gbps.show(1),
        COLS * 2 / n,
        v.tp_columns_gbps.show(1)
    );
    let _ = writeln!(
        s,
        "| {n} GPUs replicated, rounds of 1 GiB, peer copies skipped (the reads alone; diagnostic) | | {} | {:.2}x one GPU's time |",
        v.replicated_reads_only_seconds.show(3),
        v.replicated_reads_only_seconds.median / v.one_gpu_seconds.median
    );
    let ck = v.replicated_checkpoint_seconds.median;
    let _ = writeln!(
        s,
        "| {n} GPUs replicated, the checkpoint (`load_replicated_safetensors`) | {} | {} | |",
        v.replicated_checkpoint_seconds
            .map(|t| gbps(v.checkpoint_bytes, t))
            .show(1),
        v.replicated_checkpoint_seconds.show(3)
    );
    if let Some(p) = &v.peers {
        for (name, runs) in p.as_object().into_iter().flatten() {
            match runs.as_array() {
                Some(runs) => {
                    let secs = Samples::new(runs.iter().filter_map(|x| x.as_f64()).collect());
                    let _ = writeln!(
                        s,
                        "| peer, the checkpoint on {n} GPUs: {name} | {} | {} | gpufeed {:.1}x faster |",
                        secs.map(|t| gbps(v.checkpoint_bytes, t)).show(1),
                        secs.show(3),
                        secs.median / ck
                    );
                }
                None => {
                    let why = runs
                        .get("error")
                        .and_then(|e| e.as_str())
                        .unwrap_or("no figure");
                    let _ = writeln!(s, "| peer: {name} | did not run: {why} | | |");
                }
            }
        }
    }
    // A one-process-per-GPU replicated row: warm medians, then the first load.
    let replicated_row = |s: &mut String, way: &str, rep: &Samples, first: Option<f64>| {
        let _ = writeln!(
            s,
            "| one process per GPU, replicated ({way}) | {} | {} | {:.2}x one GPU's time{} |",
            rep.map(|t| gbps(v.file_bytes, t)).show(1),
            rep.show(3),
            rep.median / v.one_gpu_seconds.median,
            first_load(first)
        );
    };
    match (
        &v.ranks_sharded_gbps,
        &v.ranks_replicated_seconds,
        &v.ranks_error,
    ) {
        (Some(sh), Some(rep), _) => {
            let _ = writeln!(
                s,
                "| one process per GPU (`RankLoader`), sharded by bytes | {} | | {:.2} of {n} GPUs' pinned limit at once |",
                sh.show(1),
                sh.median / two_pinned
            );
            replicated_row(
                s,
                "staging slots the ranks share",
                rep,
                v.ranks_first_replicated_seconds,
            );
        }
        (_, _, Some(e)) => {
            let _ = writeln!(s, "| one process per GPU | did not run: {e} | | |");
        }
        _ => {}
    }
    match &v.ranks_nccl_replicated_seconds {
        Ok(rep) => replicated_row(
            s,
            "NCCL broadcasts",
            rep,
            v.ranks_nccl_first_replicated_seconds,
        ),
        Err(e) => {
            let _ = writeln!(
                s,
                "| one process per GPU, replicated through NCCL | did not run: {e} | | |"
            );
        }
    }
    for (round, secs) in &v.replicated_by_round {
        let _ = writeln!(
            s,
            "| {n} GPUs replicated, rounds of {} | {} | {} | {:.2}x one GPU's time |",
            show_size(*round),
            secs.map(|t| gbps(v.file_bytes, t)).show(1),
            secs.show(3),
            secs.median / v.one_gpu_seconds.median
        );
    }
    for (threads, chunk, x) in &v.sharded_sweep {
        let _ = writeln!(
            s,
            "| {n} GPUs sharded, {threads} fill threads per GPU, {} chunks | {} | | {:.2} of {n} GPUs' pinned limit at once |",
            show_size(*chunk as u64),
            x.show(1),
            x.median / two_pinned
        );
    }
    let _ = writeln!(
        s,
        "\nReplicated GB/s: the file's bytes over the time until every GPU holds all of it (the \
         call's own report, device memory included, freeing it afterwards not). \
         Links: {}.{}",
        v.links.join("; "),
        if v.notes.is_empty() {
            String::new()
        } else {
            format!(" Notes: {}.", v.notes.join("; "))
        }
    );
}
