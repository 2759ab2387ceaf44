//! GPU memory to files: [`save_file`] and a [`Saver`] for repeated saves (and
//! `gpufeed_safetensors::save` for checkpoints), crash-safe.
//!
//! The bytes go device -> pinned windows (multi-stream copies) -> the file through a
//! `gpufeed-uring` [`Writer`] (`O_DIRECT` where the file system takes it, a buffered tail), the
//! next window filling while the last is written. The file is written as a temporary in a
//! private directory beside the target and renamed over it only once synced
//! ([`gpufeed_os::AtomicFile`]): a process killed at any point leaves the old file or the new
//! one, complete, and a later save into the same directory removes the dead writer's temporary.
//! The writer reaches the temporary only through the descriptor `AtomicFile` created
//! (`/proc/self/fd/<n>`; both of its descriptors, buffered and `O_DIRECT`, checked by device
//! and inode), so another user who may write the directory cannot redirect the bytes; the
//! saved file keeps the mode (and, as root, the owner) of the file it replaces where that is
//! safe ([`gpufeed_os::atomic`]'s "Mode and owner").

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use gpufeed_cuda::cudarc::driver::CudaView;
use gpufeed_cuda::{Gpu, HostDest, TransferOptions, TransferScheduler};
use gpufeed_os::{AtomicFile, Fallback};
use gpufeed_pinned::{PinnedPool, PoolMode, PoolOptions, PooledBuffer};
use gpufeed_uring::{Direct, Writer};

use crate::error::{Error, Result};
use crate::options::DeviceBuffer;

/// Settings of a [`Saver`]. Start from the default and change what you need (new settings may
/// be added).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SaveOptions {
    /// Bytes per window, filled from the GPU then written (default 128 MiB: each fill pays a
    /// fixed ~0.1 ms, 8% of a 64 MiB window's copy on the H200 machine; 1 to 256 MiB, a
    /// multiple of 1 MiB).
    pub window_bytes: usize,
    /// Windows in flight: one filling while the others are written (default 2).
    pub windows: usize,
    /// `O_DIRECT` for the aligned part of the file (default [`Direct::Auto`]: where the file
    /// system takes it, recorded as a fallback where not).
    pub direct: Direct,
    /// Writes in flight (default 16) of at most `block_bytes` each (default 1 MiB).
    pub queue_depth: usize,
    /// Largest single write.
    pub block_bytes: usize,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            window_bytes: 128 << 20,
            windows: 2,
            direct: Direct::Auto,
            queue_depth: 16,
            block_bytes: 1 << 20,
        }
    }
}

impl SaveOptions {
    /// These options with `direct`.
    pub fn with_direct(mut self, direct: Direct) -> Self {
        self.direct = direct;
        self
    }

    /// These options with windows of `bytes`.
    pub fn with_window_bytes(mut self, bytes: usize) -> Self {
        self.window_bytes = bytes;
        self
    }
}

/// What a save did.
#[derive(Debug, Clone, serde::Serialize)]
#[non_exhaustive]
pub struct SaveReport {
    /// The file written.
    pub path: PathBuf,
    /// Bytes in it.
    pub bytes: u64,
    /// Seconds from the call until the file was in place (synced and renamed).
    pub seconds: f64,
    /// Seconds filling windows (device -> pinned copies, host copies).
    pub fill_seconds: f64,
    /// Seconds in write calls.
    pub write_seconds: f64,
    /// Seconds syncing the file and the directory (`fsync`, `rename`).
    pub sync_seconds: f64,
    /// Bytes written with `O_DIRECT`.
    pub direct_bytes: u64,
    /// The writer's backend.
    pub io_backend: String,
    /// Slower paths taken (O_DIRECT refused, io_uring refused, an unaligned write).
    pub fallbacks: Vec<Fallback>,
    /// Temporaries of dead earlier writers in the target's directory, removed first.
    pub cleaned: Vec<PathBuf>,
}

impl SaveReport {
    /// GB/s from the call until the file was in place.
    pub fn gbps(&self) -> f64 {
        gpufeed_os::gbps(self.bytes, self.seconds)
    }
}

/// A part of the bytes to save, in order: GPU memory or host memory.
#[derive(Debug, Clone, Copy)]
pub enum Piece<'a> {
    /// A view of device memory (of the saver's GPU).
    Device(&'a CudaView<'a, u8>),
    /// Host bytes.
    Host(&'a [u8]),
}

impl Piece<'_> {
    fn len(&self) -> usize {
        match self {
            Piece::Device(v) => v.len(),
            Piece::Host(b) => b.len(),
        }
    }
}

/// Saves GPU memory (and host bytes) to files, keeping its pinned windows and streams between
/// saves.
///
/// # Example
/// ```no_run
/// let gpu = gpufeed_load::Gpu::open(0)?;
/// let (weights, _) = gpufeed_load::load_file(&gpu, "model.bin", gpufeed_load::LoadOptions::default())?;
/// let saver = gpufeed_load::Saver::new(&gpu, gpufeed_load::SaveOptions::default())?;
/// let report = saver.save_file(&weights, "model-copy.bin")?;
/// println!("{} bytes at {:.2} GB/s ({} with O_DIRECT)", report.bytes, report.gbps(), report.direct_bytes);
/// # Ok::<(), gpufeed_load::Error>(())
/// ```
pub struct Saver {
    sched: Option<TransferScheduler>,
    pool: PinnedPool,
    opts: SaveOptions,
}

impl std::fmt::Debug for Saver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Saver")
            .field("gpu", &self.sched.is_some())
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl Saver {
    /// A saver for `gpu`'s memory: pinned windows from a pool on the GPU's NUMA node.
    pub fn new(gpu: &Gpu, opts: SaveOptions) -> Result<Self> {
        let sched = TransferScheduler::new(gpu, TransferOptions::default())?;
        let pool = PinnedPool::new(
            PoolMode::Cuda(std::sync::Arc::clone(gpu.context())),
            PoolOptions::default().with_numa_node(gpu.info().numa_node),
        )?;
        Ok(Saver {
            sched: Some(sched),
            pool,
            opts,
        })
    }

    /// A saver of host bytes only (no GPU: the same windows and writer, in locked host
    /// memory).
    pub fn host(opts: SaveOptions) -> Result<Self> {
        let pool = PinnedPool::new(PoolMode::Cpu, PoolOptions::default())?;
        Ok(Saver {
            sched: None,
            pool,
            opts,
        })
    }

    /// Writes all of `src` (device memory) to `path`, replacing it whole.
    ///
    /// # Errors
    /// The directory missing, the target a directory, [`gpufeed_os::Error::NoSpace`] (the old
    /// file is left as it was), write and CUDA errors.
    pub fn save_file(&self, src: &DeviceBuffer, path: impl AsRef<Path>) -> Result<SaveReport> {
        let view = src.slice(..);
        self.save_pieces(&[], &[Piece::Device(&view)], path.as_ref())
    }

    /// Writes `bytes` (host memory) to `path`, replacing it whole.
    pub fn save_bytes(&self, bytes: &[u8], path: impl AsRef<Path>) -> Result<SaveReport> {
        self.save_pieces(&[], &[Piece::Host(bytes)], path.as_ref())
    }

    /// Writes `head`, then every piece in order, to `path` as one file.
    pub fn save_pieces(
        &self,
        head: &[u8],
        pieces: &[Piece<'_>],
        path: &Path,
    ) -> Result<SaveReport> {
        let started = Instant::now();
        let total = head.len() + pieces.iter().map(Piece::len).sum::<usize>();
        if self.sched.is_none() && pieces.iter().any(|p| matches!(p, Piece::Device(_))) {
            return Err(Error::InvalidSetting(
                "a host-only Saver (Saver::host) was given device memory: make it with Saver::new"
                    .into(),
            ));
        }
        let file = AtomicFile::create(path, Some(total as u64))?;
        // `path()` is /proc/self/fd/<n>: the writer's descriptors (buffered and O_DIRECT) are
        // the temporary itself, whatever happens to names in the directory.
        let mut writer = Writer::builder()
            .direct(self.opts.direct)
            .queue_depth(self.opts.queue_depth)
            .block_bytes(self.opts.block_bytes)
            .open(file.path())?;
        // Both were opened by path: where /proc/self/fd is not procfs each could reach
        // another file.
        file.check_same_file(std::os::fd::AsFd::as_fd(&writer))?;
        if let Some(direct) = writer.direct_fd() {
            file.check_same_file(direct).map_err(|e| match e {
                gpufeed_os::Error::UnsafeTemporary { path, reason } => {
                    gpufeed_os::Error::UnsafeTemporary {
                        path,
                        reason: format!("the writer's O_DIRECT descriptor: {reason}"),
                    }
                }
                e => e,
            })?;
        }
        let window = self
            .opts
            .window_bytes
            .clamp(1 << 20, gpufeed_pinned::MAX_CLASS)
            .next_multiple_of(1 << 20);
        let windows = total.div_ceil(window);
        let mut fill_s = 0.0;
        let written = std::thread::scope(|s| -> Result<gpufeed_uring::WriteStats> {
            let (tx, rx) = mpsc::sync_channel::<(u64, PooledBuffer)>(self.opts.windows.max(2) - 1);
            let writing = s.spawn(move || -> Result<gpufeed_uring::WriteStats> {
                for (at, buf) in rx {
                    writer.write_all_at(at, &buf)?;
                }
                Ok(writer.stats().clone())
            });
            let filled = (|| -> Result<()> {
                for w in 0..windows {
                    let at = w * window;
                    let len = window.min(total - at);
                    let t = Instant::now();
                    let mut buf = self.pool.get(len)?;
                    buf.set_len(len);
                    self.fill(&mut buf, at, head, pieces)?;
                    fill_s += t.elapsed().as_secs_f64();
                    if tx.send((at as u64, buf)).is_err() {
                        break; // the writer stopped: its error is returned below
                    }
                }
                Ok(())
            })();
            drop(tx);
            let wrote = writing.join().map_err(|_| Error::ThreadPanicked {
                what: "the save's write thread",
            })?;
            // A fill error first (the writer then stopped for want of windows), else the
            // writer's.
            filled?;
            wrote
        });
        // On an error the temporary file is removed (the AtomicFile drops) and the target stays.
        let stats = written?;
        let t = Instant::now();
        let cleaned = file.cleaned().to_vec();
        file.commit()?;
        let sync_s = t.elapsed().as_secs_f64();
        Ok(SaveReport {
            path: path.into(),
            bytes: total as u64,
            seconds: started.elapsed().as_secs_f64(),
            fill_seconds: fill_s,
            write_seconds: stats.seconds,
            sync_seconds: sync_s,
            direct_bytes: stats.direct_bytes,
            io_backend: stats.backend.to_string(),
            fallbacks: stats.fallbacks,
            cleaned,
        })
    }

    /// Fills `buf` with bytes `[at, at + buf.len())` of the stream `head` + `pieces`.
    fn fill(
        &self,
        buf: &mut PooledBuffer,
        at: usize,
        head: &[u8],
        pieces: &[Piece<'_>],
    ) -> Result<()> {
        let end = at + buf.len();
        let mut start = 0; // of the current part in the stream
        for part in std::iter::once(Piece::Host(head)).chain(pieces.iter().copied()) {
            let part_end = start + part.len();
            let (lo, hi) = (at.max(start), end.min(part_end));
            if lo < hi {
                let (src_range, dst_off) = (lo - start..hi - start, lo - at);
                match part {
                    Piece::Host(bytes) => {
                        buf[dst_off..dst_off + (hi - lo)].copy_from_slice(&bytes[src_range]);
                    }
                    Piece::Device(view) => {
                        let sched = self.sched.as_ref().ok_or(Error::InvalidSetting(
                            "device memory given to a host-only Saver".into(),
                        ))?;
                        sched.download(
                            &view.slice(src_range),
                            HostDest::PooledAt {
                                buffer: buf,
                                offset: dst_off,
                            },
                        )?;
                    }
                }
            }
            start = part_end;
            if start >= end {
                break;
            }
        }
        Ok(())
    }
}

/// Writes all of `src` (device memory of `gpu`) to `path`, replacing it whole (crash-safe).
/// For repeated saves keep a [`Saver`].
pub fn save_file(gpu: &Gpu, src: &DeviceBuffer, path: impl AsRef<Path>) -> Result<SaveReport> {
    Saver::new(gpu, SaveOptions::default())?.save_file(src, path)
}
