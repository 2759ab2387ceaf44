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

use std::sync::Arc;

use gpufeed_cuda::cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, result,
};
use gpufeed_cuda::cufile::{BufRegistration, CuFile, CuFileHandle};
use gpufeed_cuda::gds::{GdsRoots, GdsVerdict};
use gpufeed_cuda::{ContextGuard, Gpu};
use gpufeed_os::{Fallback, OpenedFile, Refused};
use parking_lot::Mutex;

use crate::error::Result;
use crate::loader::Loader;
use crate::options::{GdsBuffers, LoadReport, Route};

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
        // Registered buffers only where cuFile reads through nvidia-fs: in its compatibility
        // mode they only add a device copy.
        let peer = driver.properties().nvidia_fs();
        let registered = self.opts.gds_buffers != GdsBuffers::Destination && peer;
        let declined = self.opts.gds_buffers == GdsBuffers::Registered && !peer;
        let bound = if registered {
            registered_bound(threads, driver.properties().max_device_pinned_bytes)
        } else {
            0
        };
        let next = AtomicUsize::new(0);
        let failed: Mutex<Option<String>> = Mutex::new(None);
        let used = std::sync::atomic::AtomicU64::new(0);
        let read = |handle: &CuFileHandle<'_>| {
            if let Err(e) = self.gpu.context().bind_to_thread() {
                failed
                    .lock()
                    .get_or_insert(format!("binding the GPU's context: {e}"));
                return;
            }
            // This thread's registered buffers (none: it reads into the destination).
            let mut lane = match Lane::new(&self.gds_pool, &self.gpu, driver, bound) {
                Ok(lane) => lane,
                Err(e) => {
                    failed.lock().get_or_insert(e);
                    return;
                }
            };
            used.fetch_add(lane.bytes(), Ordering::Relaxed);
            loop {
                if failed.lock().is_some() {
                    break;
                }
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = pieces.get(k) else {
                    break;
                };
                if fault == Some(GdsFault::ReadFailsAt(k)) {
                    failed
                        .lock()
                        .get_or_insert(format!("testing: the read of piece {k} failed"));
                    break;
                }
                // SAFETY: `base .. base + dst.len()` is the destination's device memory, of
                // this loader's GPU (bound above), allocated (its stream synchronized) and
                // borrowed mutably for this call; the pieces are disjoint ranges inside it
                // (`pieces_of`: back to back, `total` bytes, checked equal to its length),
                // each read by one thread.
                if let Err(e) = unsafe { lane.read(handle, base, p) } {
                    failed.lock().get_or_insert(e);
                    break;
                }
            }
            // Its copies landed before the load returns (and before its buffers go back).
            if let Err(e) = lane.finish() {
                failed.lock().get_or_insert(e);
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
        report.gds_registered_bytes = used.into_inner();
        if declined {
            Fallback::new(
                Refused::Gds,
                format!(
                    "registered buffers are read into only where cuFile reads through nvidia-fs; cuFile {} reads through its compatibility mode here, where they would add a device copy",
                    driver.library()
                ),
                "cuFile read into the destination through its own bounce buffers",
            )
            .push_once(&mut report.fallbacks);
        }
        if registered && let Some(why) = self.gds_pool.refused() {
            Fallback::new(
                Refused::Gds,
                why,
                "cuFile read into the destination through its own bounce buffers",
            )
            .push_once(&mut report.fallbacks);
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

impl Loader {
    /// Bytes of device memory this loader holds registered with cuFile for `Strategy::Gds`
    /// loads ([`GdsBuffers`]): 0 until a load reads through registered buffers, then at most
    /// two [`GDS_PIECE_BYTES`] buffers per read thread (and half of cufile.json's
    /// `max_device_pin_mem_size`), kept until the loader is dropped.
    pub fn gds_registered_bytes(&self) -> u64 {
        self.gds_pool.inner.lock().registered
    }
}

/// Registered buffers per read thread: one being read into while the other's device copy
/// runs.
const BUFFERS_PER_THREAD: usize = 2;

/// The most bytes a loader registers for `threads` read threads, where cuFile lets a process
/// pin `pinnable` bytes of device memory (`max_device_pinned_bytes`; 0: not said): two
/// pieces per thread, within half of that, whole pieces.
fn registered_bound(threads: usize, pinnable: u64) -> u64 {
    let piece = GDS_PIECE_BYTES as u64;
    let want = (threads * BUFFERS_PER_THREAD) as u64 * piece;
    let cap = if pinnable == 0 { want } else { pinnable / 2 };
    want.min(cap) / piece * piece
}

/// A loader's registered device buffers ([`GdsBuffers::Registered`]): made and registered
/// with cuFile when first needed, never more than a load's bound, kept for later loads.
#[derive(Default)]
pub(crate) struct GdsPool {
    inner: Mutex<PoolInner>,
}

#[derive(Default)]
struct PoolInner {
    /// Buffers no load holds.
    free: Vec<Registered>,
    /// Bytes registered: free and held.
    registered: u64,
    /// Why cuFile refused a registration: none is tried again.
    refused: Option<String>,
}

/// A device buffer of [`GDS_PIECE_BYTES`] and its registration (deregistered first: fields
/// drop in order).
struct Registered {
    reg: BufRegistration,
    buf: CudaSlice<u8>,
}

impl GdsPool {
    /// A free buffer, or a new one where the pool holds less than `bound` bytes (`None`
    /// beyond it, or once cuFile refused a registration: [`GdsPool::refused`] says why).
    fn take(&self, gpu: &Gpu, driver: &CuFile, bound: u64) -> Option<Registered> {
        let piece = GDS_PIECE_BYTES as u64;
        {
            let mut inner = self.inner.lock();
            if let Some(r) = inner.free.pop() {
                return Some(r);
            }
            if inner.refused.is_some() || inner.registered + piece > bound {
                return None;
            }
            inner.registered += piece;
        }
        match make_registered(gpu, driver) {
            Ok(r) => Some(r),
            Err(e) => {
                let mut inner = self.inner.lock();
                inner.registered -= piece;
                inner.refused.get_or_insert(e);
                None
            }
        }
    }

    /// Buffers back for later loads.
    fn give_back(&self, bufs: impl IntoIterator<Item = Registered>) {
        self.inner.lock().free.extend(bufs);
    }

    /// Why cuFile refused a registration, where it did.
    fn refused(&self) -> Option<String> {
        self.inner.lock().refused.clone()
    }
}

impl Drop for GdsPool {
    /// Deregistered and freed with their context current (cuFile and cudarc act on the
    /// current context), the thread's own put back after.
    fn drop(&mut self) {
        let free = std::mem::take(&mut self.inner.get_mut().free);
        let Some(first) = free.first() else {
            return;
        };
        let _restore = ContextGuard::new();
        if let Err(e) = first.buf.context().bind_to_thread() {
            tracing::warn!(error = %e, "binding a context to free cuFile's registered buffers");
        }
        drop(free);
    }
}

/// A device buffer of [`GDS_PIECE_BYTES`] from `cuMemAlloc`, registered with cuFile.
#[allow(unsafe_code, reason = "device memory cuFile reads into")]
fn make_registered(gpu: &Gpu, driver: &CuFile) -> std::result::Result<Registered, String> {
    // SAFETY: nothing reads the buffer before cuFile wrote the bytes a copy takes from it.
    let buf = unsafe { gpu.alloc_unpooled(GDS_PIECE_BYTES) }
        .map_err(|e| format!("allocating a buffer for cuFile: {e}"))?;
    let (ptr, sync) = buf.device_ptr(buf.stream());
    // SAFETY: the calling thread has the GPU's context bound (the read threads bind it
    // first); `ptr` is a `cuMemAlloc` allocation of `GDS_PIECE_BYTES` of it, which `buf`
    // keeps until after the registration is dropped (`Registered`'s field order).
    let reg = unsafe { BufRegistration::new(driver, ptr, GDS_PIECE_BYTES) }.map_err(|e| {
        format!(
            "cuFile refused to register {} MiB of device memory ({e}); BAR1 space is bounded by cufile.json's max_device_pin_mem_size and the GPU",
            GDS_PIECE_BYTES >> 20
        )
    })?;
    drop(sync);
    Ok(Registered { reg, buf })
}

/// One read thread's registered buffers (none: it reads into the destination), with the
/// device copy out of each still running.
struct Lane<'a> {
    pool: &'a GdsPool,
    stream: Option<Arc<CudaStream>>,
    bufs: Vec<(Registered, Option<CudaEvent>)>,
    next: usize,
}

impl<'a> Lane<'a> {
    /// Up to [`BUFFERS_PER_THREAD`] buffers of `pool` within `bound` and a stream for their
    /// copies; the thread has the GPU's context bound.
    fn new(
        pool: &'a GdsPool,
        gpu: &Gpu,
        driver: &CuFile,
        bound: u64,
    ) -> std::result::Result<Self, String> {
        let mut bufs = Vec::new();
        if bound > 0 {
            while bufs.len() < BUFFERS_PER_THREAD
                && let Some(r) = pool.take(gpu, driver, bound)
            {
                bufs.push((r, None));
            }
        }
        let mut lane = Lane {
            pool,
            stream: None,
            bufs,
            next: 0,
        };
        if !lane.bufs.is_empty() {
            match gpu.context().new_stream() {
                Ok(stream) => lane.stream = Some(stream),
                Err(e) => {
                    // No copy ran: the buffers go back as they are.
                    lane.finish()?;
                    return Err(format!("a stream for cuFile's copies: {e}"));
                }
            }
        }
        Ok(lane)
    }

    /// Bytes of registered buffers this lane reads into.
    fn bytes(&self) -> u64 {
        (self.bufs.len() * GDS_PIECE_BYTES) as u64
    }

    /// Piece `p` of the file into the destination at `base`: into a registered buffer, then
    /// copied on the GPU (asynchronously: [`Lane::finish`] waits), or straight in.
    ///
    /// # Safety
    /// `base + p.dst .. + p.len` is device memory of the bound context that nothing else
    /// touches until [`Lane::finish`] returned.
    #[allow(unsafe_code, reason = "cuFile reads and device copies")]
    unsafe fn read(
        &mut self,
        handle: &CuFileHandle<'_>,
        base: u64,
        p: &Piece,
    ) -> std::result::Result<(), String> {
        // A stream is made exactly where the lane holds buffers.
        let Some(stream) = &self.stream else {
            // SAFETY: the caller's promise.
            return unsafe { handle.read_raw(base, p.dst, p.len, p.file) }
                .map_err(|e| e.to_string());
        };
        let i = self.next % self.bufs.len();
        self.next += 1;
        let (r, pending) = &mut self.bufs[i];
        // The buffer's last copy out must have run before cuFile writes it again.
        if let Some(ev) = pending.take() {
            ev.synchronize()
                .map_err(|e| format!("waiting for a copy out of a registered buffer: {e}"))?;
        }
        // SAFETY: the buffer is this lane's alone and no copy out of it is running (waited
        // above); the context is bound; a piece is at most GDS_PIECE_BYTES (checked by
        // `read_registered`).
        unsafe { handle.read_registered(&r.reg, 0, p.len, p.file) }.map_err(|e| e.to_string())?;
        // SAFETY: the source is the buffer's first `p.len` bytes, just written; the
        // destination range is the caller's, inside its allocation; the stream is this
        // lane's, of the same context.
        unsafe {
            result::memcpy_dtod_async(base + p.dst as u64, r.reg.base(), p.len, stream.cu_stream())
        }
        .map_err(|e| format!("copying a registered buffer into the destination: {e}"))?;
        *pending = Some(
            stream
                .record_event(None)
                .map_err(|e| format!("recording a copy's event: {e}"))?,
        );
        Ok(())
    }

    /// Waits for the copies, then gives the buffers back to the pool.
    fn finish(mut self) -> std::result::Result<(), String> {
        let waited = match &self.stream {
            Some(s) => s
                .synchronize()
                .map_err(|e| format!("waiting for the copies out of registered buffers: {e}")),
            None => Ok(()),
        };
        self.pool
            .give_back(std::mem::take(&mut self.bufs).into_iter().map(|(r, _)| r));
        waited
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
    fn registered_buffers_are_bounded_by_threads_and_cufiles_pinning_budget() {
        let piece = GDS_PIECE_BYTES as u64;
        // Two pieces per thread where cuFile's budget is large (32 GiB, cufile.json's default).
        assert_eq!(registered_bound(3, 32 << 30), 6 * piece);
        assert_eq!(registered_bound(16, 32 << 30), 32 * piece);
        // Half the budget, whole pieces.
        assert_eq!(registered_bound(16, 100 << 20), 6 * piece);
        assert_eq!(registered_bound(4, piece), 0);
        // A budget not said: two per thread.
        assert_eq!(registered_bound(2, 0), 4 * piece);
    }

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
