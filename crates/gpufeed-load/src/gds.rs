//! `Strategy::Gds`: cuFile reads (GPUDirect Storage) from the file straight into the
//! destination, on several threads, pieces of [`GDS_PIECE_BYTES`]. Where cuFile cannot read the
//! file (no library, its driver refused, `O_DIRECT` refused, the handle refused, a read
//! refused) the load is done again by gpufeed's own path (`Direct`, or `Staged` where the file
//! system refuses `O_DIRECT`) and the report's fallbacks say why: nothing cuFile wrote is kept.
//!
//! Whether a machine reads peer-to-peer or through cuFile's compatibility mode is
//! [`gpufeed_cuda::gds::detect`]'s question; which one served a load, cuFile's statistics
//! answer around it ([`gpufeed_cuda::cufile::CuFile::count_paths`], with
//! [`LoadOptions::gds_path_counts`](crate::LoadOptions::gds_path_counts) and for `Auto`'s
//! loads until a file system is confirmed), in [`LoadReport::io_backend`].

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

/// Why cuFile did not load a file ([`LoadReport::gds_refused`]); the load was then done again
/// by gpufeed's own path, every byte rewritten, and the report's fallbacks give cuFile's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum GdsRefusal {
    /// libcufile did not load (`GPUFEED_CUFILE_LIBRARY`, `libcufile.so.0`).
    Library,
    /// cuFile's driver did not open (no nvidia-fs and `allow_compat_mode` false, ...).
    Driver,
    /// The file system refused `O_DIRECT` (`EINVAL`), which cuFile reads through.
    DirectIo,
    /// cuFile refused the file's registration (`cuFileHandleRegister`).
    Registration,
    /// A read failed, or the file or the destination could not be prepared; pieces may have
    /// landed, and were written again.
    Read,
}

/// A refusal and its words.
struct Refusal(GdsRefusal, String);

/// Test hook, not API: a fault `Strategy::Gds` runs into on a machine where cuFile works, to
/// test the fallbacks (`LoadOptions::testing_gds_fault`).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdsFault {
    /// The `O_DIRECT` reopen fails with `EINVAL`, as on a file system without it.
    ReopenEinval,
    /// The read of piece `k` fails, after the pieces before it were read.
    ReadFailsAt(usize),
}

impl Loader {
    /// `Strategy::Gds`: cuFile, else gpufeed's `Direct` (or `Staged` where `O_DIRECT` is
    /// refused) with the reason in `report.fallbacks` and `report.gds_refused`; the route
    /// that ran. `auto`: `Auto` chose it.
    pub(crate) fn gds_or_own<D>(
        &self,
        file: &OpenedFile,
        spans: &[Range<u64>],
        dst: &mut D,
        report: &mut LoadReport,
        auto: bool,
    ) -> Result<Route>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        let Refusal(kind, why) = match self.gds(file, spans, dst, report, auto) {
            Ok(()) => return Ok(Route::Gds),
            Err(r) => r,
        };
        if auto {
            // Refused where detection said peer-to-peer: `Auto` does not take it again here.
            forget_gds(file);
        }
        // Staged only where O_DIRECT itself was refused (EINVAL); any other refusal takes
        // gpufeed's O_DIRECT path, which `Auto` takes for a cold file.
        let (route, instead) = if kind == GdsRefusal::DirectIo {
            (
                Route::Staged,
                "gpufeed's buffered reads into pinned staging instead",
            )
        } else {
            (
                Route::Direct,
                "gpufeed's O_DIRECT reads into pinned staging instead",
            )
        };
        report.gds_refused = Some(kind);
        Fallback::new(Refused::Gds, why, instead).push_once(&mut report.fallbacks);
        self.staged(file, spans, dst, route == Route::Direct, report)?;
        Ok(route)
    }

    /// Reads `spans` of `file` into `dst` through cuFile. `auto`: `Auto` chose it (where
    /// cuFile's statistics then show reads through its compatibility mode, `Auto` does not
    /// choose it again for this file system).
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
        auto: bool,
    ) -> std::result::Result<(), Refusal>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        let fault = self.opts.testing_gds_fault;
        let driver = CuFile::open(&self.gpu).map_err(|e| {
            let kind = if matches!(e, gpufeed_cuda::Error::CufileMissing { .. }) {
                GdsRefusal::Library
            } else {
                GdsRefusal::Driver
            };
            Refusal(kind, e.to_string())
        })?;
        let reopened = if fault == Some(GdsFault::ReopenEinval) {
            Err(std::io::Error::from_raw_os_error(libc::EINVAL))
        } else {
            file.reopen(libc::O_DIRECT)
        };
        let direct = reopened.map_err(|e| {
            if e.raw_os_error() == Some(libc::EINVAL) {
                Refusal(
                    GdsRefusal::DirectIo,
                    format!(
                        "cuFile reads a descriptor opened with O_DIRECT, which the file system of {} refuses ({e})",
                        file.path().display()
                    ),
                )
            } else {
                Refusal(
                    GdsRefusal::Read,
                    format!(
                        "opening {} again with O_DIRECT for cuFile: {e}",
                        file.path().display()
                    ),
                )
            }
        })?;
        let handle = driver.register(direct.as_fd()).map_err(|e| {
            // Where detection knows why cuFile cannot take this file, the reason says it.
            let why = gpufeed_cuda::gds::detect(
                Some(file.path()),
                Ok(String::new()),
                &GdsRoots::system(),
            );
            let reason = match (why.verdict, why.fix) {
                (GdsVerdict::Absent, Some(fix)) => format!("{e}: {}; fix: {fix}", why.reason),
                _ => e.to_string(),
            };
            Refusal(GdsRefusal::Registration, reason)
        })?;
        let pieces = pieces_of(spans, GDS_PIECE_BYTES);
        let total: u64 = spans.iter().map(|s| s.end - s.start).sum();
        // The pieces must lie inside the destination: the reads' safety below rests on it.
        if total != dst.len() as u64 {
            return Err(Refusal(
                GdsRefusal::Read,
                format!(
                    "{total} bytes of spans for a destination of {} bytes",
                    dst.len()
                ),
            ));
        }
        let stream = std::sync::Arc::clone(dst.stream());
        let (base, _written) = dst.device_ptr_mut(&stream);
        // A stream-ordered allocation is usable by other engines (cuFile's copies) once its
        // stream reached it.
        stream.synchronize().map_err(|e| {
            Refusal(
                GdsRefusal::Read,
                format!("synchronizing the destination's stream: {e}"),
            )
        })?;
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
                failed
                    .lock()
                    .get_or_insert(format!("binding the GPU's context: {e}"));
                return;
            }
            loop {
                if failed.lock().is_some() {
                    return;
                }
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = pieces.get(k) else {
                    return;
                };
                if fault == Some(GdsFault::ReadFailsAt(k)) {
                    failed
                        .lock()
                        .get_or_insert(format!("testing: the read of piece {k} failed"));
                    return;
                }
                // SAFETY: `base .. base + dst.len()` is the destination's device memory, of
                // this loader's GPU (bound above), allocated (its stream synchronized) and
                // borrowed mutably for this call; the pieces are disjoint ranges inside it
                // (`pieces_of`: back to back, `total` bytes, checked equal to its length),
                // each read by one thread.
                if let Err(e) = unsafe { handle.read_raw(base, p.dst, p.len, p.file) } {
                    failed.lock().get_or_insert(e.to_string());
                    return;
                }
            }
        };
        let read_all = || {
            std::thread::scope(|s| {
                for _ in 1..threads {
                    // A thread that cannot start (a container's pids limit) leaves its pieces
                    // to the others.
                    if std::thread::Builder::new()
                        .name("gpufeed-cufile".into())
                        .spawn_scoped(s, || read(&handle))
                        .is_err()
                    {
                        break;
                    }
                }
                read(&handle);
            });
        };
        // `Auto` chose cuFile for peer-to-peer reads: counted until a load confirms them on
        // this file system (counting serializes counted loads in the process).
        let counts = if self.opts.gds_path_counts || (auto && !gds_confirmed(file)) {
            driver.count_paths(&self.gpu, total, read_all).1
        } else {
            read_all();
            None
        };
        if let Some(why) = failed.into_inner() {
            return Err(Refusal(GdsRefusal::Read, why));
        }
        // Detection said peer-to-peer: where cuFile's statistics show reads through host
        // memory, `Auto` does not take it again on this file system; where they show none, it
        // is confirmed and no longer counted; without an answer, counted again next time.
        if auto && let Some(c) = counts {
            if c.posix == 0 && c.total > 0 {
                confirm_gds(file);
            } else {
                forget_gds(file);
            }
        }
        report.io_backend = Some(match counts {
            Some(c) => {
                format!(
                    "cufile {}: {} ({} reads: {} nvidia-fs, {} P2PDMA, {} POSIX)",
                    driver.library(),
                    c.path(),
                    c.total,
                    c.nvfs,
                    c.p2pdma,
                    c.posix
                )
            }
            None => match driver.properties().nvfs_version {
                Some((a, b)) => format!(
                    "cufile {}: nvidia-fs {a}.{b} loaded (each read's path not counted)",
                    driver.library()
                ),
                None => format!(
                    "cufile {}: nvidia-fs not loaded: P2PDMA where cufile.json configures it, else compatibility mode (POSIX reads into host memory, then a copy); not counted",
                    driver.library()
                ),
            },
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

/// `spans` cut into pieces of at most `piece` bytes (a power of two), the destination's bytes
/// back to back in span order. Pieces end at multiples of `piece` in the file, so that only a
/// span's first and last pieces are unaligned (cuFile reads unaligned ones through its bounce
/// buffers).
fn pieces_of(spans: &[Range<u64>], piece: usize) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut dst = 0usize;
    for s in spans {
        let mut at = s.start;
        while at < s.end {
            let boundary = (at / piece as u64 + 1) * piece as u64;
            let len = (boundary.min(s.end) - at) as usize;
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
    let dev = file.identity().dev;
    if let Some(known) = SEEN.lock().as_ref().and_then(|m| m.get(&dev).copied()) {
        return known != GdsState::Off;
    }
    // The machine first (no library is loaded where there is no peer path at all), then the
    // library and the file's file system.
    let roots = GdsRoots::system();
    let machine = gpufeed_cuda::gds::detect(None, Ok(String::new()), &roots);
    let active = machine.verdict == GdsVerdict::Available && {
        let library = gpufeed_cuda::cufile_version().map_err(|e| e.to_string());
        gpufeed_cuda::gds::detect(Some(file.path()), library, &roots).verdict
            == GdsVerdict::Available
    };
    let state = if active {
        GdsState::Unconfirmed
    } else {
        GdsState::Off
    };
    // A load's verdict meanwhile (forgotten, confirmed) stays.
    let mut seen = SEEN.lock();
    let now = *seen
        .get_or_insert_with(HashMap::new)
        .entry(dev)
        .or_insert(state);
    now != GdsState::Off
}

/// What `Auto` knows of GPUDirect Storage on a file system (device number).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GdsState {
    /// Not taken: detection found no peer path, or a load showed cuFile read through host
    /// memory, or refused.
    Off,
    /// Detection found a peer path; no load has confirmed it yet (loads are counted).
    Unconfirmed,
    /// A counted load read peer-to-peer only.
    Confirmed,
}

/// What [`gds_active`] and the loads found, per device number.
static SEEN: Mutex<Option<HashMap<u64, GdsState>>> = Mutex::new(None);

fn set_state(file: &OpenedFile, state: GdsState) {
    SEEN.lock()
        .get_or_insert_with(HashMap::new)
        .insert(file.identity().dev, state);
}

/// `Auto` takes `Gds` no more for `file`'s file system.
fn forget_gds(file: &OpenedFile) {
    set_state(file, GdsState::Off);
}

/// A load on `file`'s file system read peer-to-peer only: `Auto`'s loads there are no longer
/// counted.
fn confirm_gds(file: &OpenedFile) {
    set_state(file, GdsState::Confirmed);
}

/// Whether `file`'s file system is confirmed peer-to-peer.
fn gds_confirmed(file: &OpenedFile) -> bool {
    SEEN.lock()
        .as_ref()
        .and_then(|m| m.get(&file.identity().dev).copied())
        == Some(GdsState::Confirmed)
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
                (10, 0, 6),
                (16, 6, 8),
                (24, 14, 6),
                (100, 20, 4),
                (104, 24, 1),
                (200, 25, 8),
                (208, 33, 8),
                (216, 41, 5)
            ]
        );
        assert_eq!(p.iter().map(|p| p.len).sum::<usize>(), 20 + 5 + 21);
        assert!(pieces_of(&[], 8).is_empty());
    }
}
