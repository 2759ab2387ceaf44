//! Table 8 (GPU machine only): checkpoints out. The warm 4 GiB file is loaded to the GPU and
//! saved back with a `Saver` (device -> pinned windows -> O_DIRECT writes, synced and renamed),
//! against the disk's own O_DIRECT write limit (gpufeed-uring's `Writer` from one aligned host
//! buffer, and `fio` where installed) and the device -> pinned limit, in the same run.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use gpufeed::cuda::{HostDest, TransferOptions, TransferScheduler};
use gpufeed::pinned::PinnedBuffer;
use gpufeed::{Gpu, LoadOptions, Loader, SaveOptions, Saver};
use gpufeed_os::{AlignedBuf, AtomicFile};
use gpufeed_uring::{Direct, Writer};
use serde::Serialize;

use crate::report::share;
use crate::util::{Samples, gbps, show_size, timed};

#[derive(Debug, Serialize)]
pub struct SaveBench {
    pub bytes: u64,
    /// `Saver::save_file` of the device buffer, from the call until the file is synced and in
    /// place.
    pub save_gbps: Samples,
    /// `gpufeed::save_file`: a new `Saver` per call (its pinned windows allocated on the way),
    /// what a script that saves once sees.
    pub one_shot_save_gbps: Samples,
    /// The same saves' device -> pinned part (window fills) alone.
    pub save_fill_gbps: Samples,
    /// Bytes of each save written with O_DIRECT.
    pub save_direct_bytes: u64,
    pub save_fallbacks: Vec<String>,
    /// O_DIRECT writes of one aligned host buffer (Writer, qd 16, 1 MiB), synced: the disk.
    pub raw_direct_write_gbps: Samples,
    /// fio --rw=write --direct=1 --ioengine=io_uring --iodepth=16 --bs=1M --end_fsync=1.
    pub fio_write_gbps: Option<Samples>,
    pub fio_note: String,
    /// TransferScheduler::download of 1 GiB into pinned memory (4 streams, 16 MiB): device ->
    /// host's limit.
    pub d2h_limit_gbps: Samples,
    /// `safetensors::save` of the table-6 checkpoint loaded to the GPU (every tensor a device
    /// view), synced and renamed.
    pub checkpoint_bytes: u64,
    pub checkpoint_save_gbps: Samples,
    /// Where that save is left, for checking it with other readers.
    pub checkpoint_saved: PathBuf,
}

fn out_path(dir: &Path, what: &str) -> PathBuf {
    dir.join(format!("save-{what}.bin"))
}

/// Writes `len` bytes from one aligned buffer with O_DIRECT, synced; GB/s.
fn raw_direct_write(dir: &Path, len: u64) -> Result<f64> {
    let path = out_path(dir, "raw");
    let chunk = 64usize << 20;
    let mut buf = AlignedBuf::new(chunk, 1 << 20)?;
    buf.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    let (s, r) = timed(|| -> Result<()> {
        let file = AtomicFile::create(&path, Some(len))?;
        let mut w = Writer::builder()
            .direct(Direct::On)
            .queue_depth(16)
            .open(file.path())?;
        let mut at = 0u64;
        while at < len {
            let n = chunk.min((len - at) as usize);
            w.write_all_at(at, &buf[..n])?;
            at += n as u64;
        }
        drop(w);
        file.commit()?;
        Ok(())
    });
    r?;
    Ok(gbps(len, s))
}

fn fio_write(dir: &Path, len: u64) -> Result<f64> {
    let path = out_path(dir, "fio");
    let out = Command::new("fio")
        .args([
            "--name=w",
            "--rw=write",
            "--bs=1M",
            "--iodepth=16",
            "--ioengine=io_uring",
            "--direct=1",
            "--end_fsync=1",
            "--output-format=json",
        ])
        .arg(format!("--size={len}"))
        .arg(format!("--filename={}", path.display()))
        .output()
        .context("run fio")?;
    let _ = std::fs::remove_file(&path);
    if !out.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).context("fio JSON")?;
    let bw = json["jobs"][0]["write"]["bw_bytes"]
        .as_f64()
        .context("fio JSON has no jobs[0].write.bw_bytes")?;
    Ok(bw / 1e9)
}

/// Loads `file` (warm) to the GPU and saves it back `reps` times with one `Saver` (after a
/// discarded warm-up save) and `reps` times with a new one per call; the limits in between.
pub fn measure(
    gpu: &Gpu,
    dir: &Path,
    file: &Path,
    checkpoint: &Path,
    reps: usize,
) -> Result<SaveBench> {
    let loader = Loader::new(gpu, LoadOptions::default())?;
    let (buf, _) = loader.load_file(file)?;
    drop(loader);
    let bytes = buf.len() as u64;
    let saver = Saver::new(gpu, SaveOptions::default())?;
    let target = out_path(dir, "saver");
    drop(saver.save_file(&buf, &target)?); // warm-up: pinned windows, the writer's ring
    let (mut save, mut fill, mut raw, mut fio) = (vec![], vec![], vec![], vec![]);
    let mut last = None;
    let have_fio = crate::reads::fio_available();
    for _ in 0..reps {
        let r = saver.save_file(&buf, &target)?;
        save.push(r.gbps());
        fill.push(gbps(r.bytes, r.fill_seconds));
        last = Some(r);
        raw.push(raw_direct_write(dir, bytes)?);
        if have_fio {
            fio.push(fio_write(dir, bytes)?);
        }
    }
    let one_shot = (0..reps)
        .map(|_| gpufeed::save_file(gpu, &buf, &target).map(|r| r.gbps()))
        .collect::<Result<Vec<_>, _>>()?;
    // The saved file equals the source (a check, not a timing).
    let same = std::fs::metadata(&target)?.len() == bytes;
    anyhow::ensure!(same, "the saved file's size differs from the source's");
    let _ = std::fs::remove_file(&target);
    let _ = std::fs::remove_file(out_path(dir, "raw"));
    // Device -> pinned limit: 1 GiB downloads into pinned memory.
    let sched = TransferScheduler::new(gpu, TransferOptions::default())?;
    let len = (1usize << 30).min(buf.len());
    let mut pinned = PinnedBuffer::new(gpu.context(), len)?;
    let view = buf.slice(..len);
    let d2h = (0..reps.max(3))
        .map(|_| {
            sched
                .download(&view, HostDest::Pinned(&mut pinned))
                .map(|s| s.gbps())
        })
        .collect::<Result<Vec<_>, _>>()?;
    drop(buf);
    // A checkpoint: loaded to the GPU, every tensor saved back from its device view.
    let loader = Loader::new(gpu, LoadOptions::default())?;
    let ckpt = gpufeed::safetensors::load_with(&loader, checkpoint)?;
    drop(loader);
    let names: Vec<String> = ckpt.names().map(str::to_owned).collect();
    let entries: Vec<_> = names
        .iter()
        .map(|n| ckpt.get(n).context("a listed tensor"))
        .collect::<Result<_>>()?;
    let tensors: Vec<gpufeed::safetensors::SaveTensor<'_>> = names
        .iter()
        .zip(&entries)
        .map(|(n, (info, view))| gpufeed::safetensors::SaveTensor {
            name: n,
            dtype: info.dtype,
            shape: &info.shape,
            data: gpufeed::Piece::Device(view),
        })
        .collect();
    let saved = dir.join("saved-model.safetensors");
    let mut ckpt_runs = Vec::new();
    for _ in 0..reps {
        let r = gpufeed::safetensors::save(&saver, &tensors, None, &saved)?;
        ckpt_runs.push(r.gbps());
    }
    let last = last.context("no repetition ran")?;
    Ok(SaveBench {
        bytes,
        save_gbps: Samples::new(save),
        one_shot_save_gbps: Samples::new(one_shot),
        save_fill_gbps: Samples::new(fill),
        save_direct_bytes: last.direct_bytes,
        save_fallbacks: last.fallbacks.iter().map(ToString::to_string).collect(),
        raw_direct_write_gbps: Samples::new(raw),
        fio_write_gbps: have_fio.then(|| Samples::new(fio)),
        fio_note: if have_fio {
            "fio --rw=write --bs=1M --iodepth=16 --ioengine=io_uring --direct=1 --end_fsync=1, same size, same run".into()
        } else {
            "fio not installed: skipped (apt-get install fio to compare)".into()
        },
        d2h_limit_gbps: Samples::new(d2h),
        checkpoint_bytes: ckpt.bytes(),
        checkpoint_save_gbps: Samples::new(ckpt_runs),
        checkpoint_saved: saved,
    })
}

/// Table 8: checkpoints saved from GPU memory.
pub fn table(s: &mut String, v: &SaveBench) {
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
