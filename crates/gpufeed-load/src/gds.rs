//! `Strategy::Gds`: cuFile reads (GPUDirect Storage) from the file straight into the
//! destination, on several threads, pieces of [`GDS_PIECE_BYTES`]. Where cuFile cannot read the
//! file (no library, its driver refused, `O_DIRECT` refused, the handle refused, a read
//! refused) the load is done again by gpufeed's own path (`Direct`, or `Staged` where the file
//! system refuses `O_DIRECT`) and the report's fallbacks say why: nothing cuFile wrote is kept.
//!
//! Whether a machine reads peer-to-peer or through cuFile's compatibility mode is
//! [`gpufeed_cuda::gds::detect`]'s question; which one served a load, cuFile's statistics
//! answer after it ([`gpufeed_cuda::cufile::CuFile::path_counts`]), in
//! [`LoadReport::io_backend`].

use std::collections::HashMap;
use std::ops::Range;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicUsize, Ordering};

use gpufeed_cuda::cudarc::driver::{DevicePtrMut, DeviceSlice};
use gpufeed_cuda::cufile::{CuFile, CuFileHandle};
use gpufeed_cuda::gds::{GdsRoots, GdsVerdict};
use gpufeed_os::{Fallback, OpenedFile, Refused};
use parking_lot::Mutex;

use crate::error::Result;
use crate::loader::Loader;
use crate::options::{LoadReport, Route};

/// Bytes per `cuFileRead` (cuFile's default `max_direct_io_size` is 16 MiB; 8 MiB pieces keep
/// every thread busy on files of a few hundred MiB).
pub const GDS_PIECE_BYTES: usize = 8 << 20;

/// Why cuFile did not load a file: said in the fallback; the load is done again another way.
struct Refusal(String);

impl Loader {
    /// `Strategy::Gds`: cuFile, else gpufeed's `Direct` (or `Staged` where `O_DIRECT` is
    /// refused) with the reason in `report.fallbacks`; the route that ran.
    pub(crate) fn gds_or_own<D>(
        &self,
        file: &OpenedFile,
        spans: &[Range<u64>],
        dst: &mut D,
        report: &mut LoadReport,
    ) -> Result<Route>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        let refusal = match self.gds(file, spans, dst, report) {
            Ok(()) => return Ok(Route::Gds),
            Err(r) => r,
        };
        let dio = gpufeed_os::align::dio_alignment(file.file()).is_ok_and(|d| d.supported());
        let (route, instead) = if dio {
            (
                Route::Direct,
                "gpufeed's O_DIRECT reads into pinned staging instead",
            )
        } else {
            (
                Route::Staged,
                "gpufeed's buffered reads into pinned staging instead (the file system refuses O_DIRECT)",
            )
        };
        Fallback::new(Refused::Gds, refusal.0, instead).push_once(&mut report.fallbacks);
        self.staged(file, spans, dst, route == Route::Direct, report)?;
        Ok(route)
    }

    /// Reads `spans` of `file` into `dst` through cuFile.
    #[allow(
        unsafe_code,
        reason = "cuFile reads into the destination's device memory"
    )]
    fn gds<D>(
        &self,
        file: &OpenedFile,
        spans: &[Range<u64>],
        dst: &mut D,
        report: &mut LoadReport,
    ) -> std::result::Result<(), Refusal>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        let driver = CuFile::open(&self.gpu).map_err(|e| Refusal(e.to_string()))?;
        let direct = file.reopen(libc::O_DIRECT).map_err(|e| {
            Refusal(format!(
                "cuFile reads a descriptor opened with O_DIRECT, which the file system of {} refuses ({e})",
                file.path().display()
            ))
        })?;
        let handle = driver
            .register(direct.as_fd())
            .map_err(|e| Refusal(e.to_string()))?;
        let pieces = pieces_of(spans, GDS_PIECE_BYTES);
        let total: u64 = spans.iter().map(|s| s.end - s.start).sum();
        let counting = driver.start_path_counts();
        let stream = std::sync::Arc::clone(dst.stream());
        let (base, _written) = dst.device_ptr_mut(&stream);
        // A stream-ordered allocation is usable by other engines (cuFile's copies) once its
        // stream reached it.
        stream
            .synchronize()
            .map_err(|e| Refusal(format!("synchronizing the destination's stream: {e}")))?;
        let threads = self
            .opts
            .transfer
            .fill_threads
            .clamp(1, 16)
            .min(pieces.len());
        let next = AtomicUsize::new(0);
        let failed: Mutex<Option<String>> = Mutex::new(None);
        let read = |handle: &CuFileHandle<'_>| {
            if let Err(e) = self.gpu.context().bind_to_thread() {
                *failed.lock() = Some(format!("binding the GPU's context: {e}"));
                return;
            }
            loop {
                if failed.lock().is_some() {
                    return;
                }
                let Some(p) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    return;
                };
                // SAFETY: `base .. base + dst.len()` is the destination's device memory, of
                // this loader's GPU (bound above), allocated (its stream synchronized) and
                // borrowed mutably for this call; the pieces are disjoint ranges inside it
                // (`pieces_of`), each read by one thread.
                if let Err(e) = unsafe { handle.read_raw(base, p.dst, p.len, p.file) } {
                    failed.lock().get_or_insert(e.to_string());
                    return;
                }
            }
        };
        std::thread::scope(|s| {
            for _ in 1..threads {
                s.spawn(|| read(&handle));
            }
            read(&handle);
        });
        if let Some(why) = failed.into_inner() {
            return Err(Refusal(why));
        }
        let counts = counting
            .then(|| driver.path_counts(&self.gpu, total))
            .flatten();
        let props = driver.properties();
        report.io_backend = Some(match counts {
            Some(c) => format!(
                "cufile {}: {} ({} reads: {} nvidia-fs, {} P2PDMA, {} POSIX)",
                driver.library(),
                c.path(),
                c.total,
                c.nvfs,
                c.p2pdma,
                c.posix
            ),
            None if props.peer_to_peer() => format!(
                "cufile {}: peer-to-peer possible ({}; statistics unavailable, the path of each read unknown)",
                driver.library(),
                props
                    .nvfs_version
                    .map_or("P2PDMA".to_owned(), |(a, b)| format!("nvidia-fs {a}.{b}"))
            ),
            None => format!(
                "cufile {}: compat mode (no nvidia-fs or P2PDMA: POSIX reads into host memory, then a copy)",
                driver.library()
            ),
        });
        Ok(())
    }
}

/// One `cuFileRead`: `len` bytes at `file` into the destination at `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    file: u64,
    dst: usize,
    len: usize,
}

/// `spans` cut into pieces of at most `piece` bytes, the destination's bytes back to back in
/// span order.
fn pieces_of(spans: &[Range<u64>], piece: usize) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut dst = 0usize;
    for s in spans {
        let mut at = s.start;
        while at < s.end {
            let len = ((s.end - at) as usize).min(piece);
            out.push(Piece { file: at, dst, len });
            at += len as u64;
            dst += len;
        }
    }
    out
}

/// Whether real GPUDirect Storage reads (peer-to-peer, not the compatibility mode) are
/// available for `file`'s file system: [`gpufeed_cuda::gds::detect`], once per file system
/// (device) in a process.
pub(crate) fn gds_active(file: &OpenedFile) -> bool {
    static SEEN: Mutex<Option<HashMap<u64, bool>>> = Mutex::new(None);
    let dev = file.identity().dev;
    if let Some(&known) = SEEN.lock().as_ref().and_then(|m| m.get(&dev)) {
        return known;
    }
    let library = gpufeed_cuda::cufile_version().map_err(|e| e.to_string());
    let verdict = gpufeed_cuda::gds::detect(Some(file.path()), library, &GdsRoots::system());
    let active = verdict.verdict == GdsVerdict::Available;
    SEEN.lock()
        .get_or_insert_with(HashMap::new)
        .insert(dev, active);
    active
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_cut_into_pieces_back_to_back() {
        let p = pieces_of(&[10..30, 100..105, 7..7, 200..221], 8);
        let dsts: Vec<_> = p.iter().map(|p| (p.file, p.dst, p.len)).collect();
        assert_eq!(
            dsts,
            [
                (10, 0, 8),
                (18, 8, 8),
                (26, 16, 4),
                (100, 20, 5),
                (200, 25, 8),
                (208, 33, 8),
                (216, 41, 5)
            ]
        );
        assert_eq!(p.iter().map(|p| p.len).sum::<usize>(), 20 + 5 + 21);
        assert!(pieces_of(&[], 8).is_empty());
    }
}
