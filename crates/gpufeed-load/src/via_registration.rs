//! The `Registered` route of a load: the file's pages mapped read-only and registered with
//! CUDA in chunks ahead of the copies, the GPU copying straight out of the page cache; where
//! the platform refuses registration, staged instead (recorded as a fallback).

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use gpufeed_cuda::HostSource;
use gpufeed_cuda::cudarc::driver::{DevicePtrMut, DeviceSlice};
use gpufeed_os::{Fallback, FileMap, OpenedFile, Refused};
use gpufeed_pinned::HostRegistration;

use crate::error::{Error, Result};
use crate::loader::Loader;
use crate::options::{LoadReport, Route};

impl Loader {
    /// `Registered`, falling back to `Staged` (recorded) where the platform refuses
    /// registration; returns the route that ran.
    pub(crate) fn registered_or_staged<D>(
        &self,
        file: &OpenedFile,
        range: Range<u64>,
        dst: &mut D,
        report: &mut LoadReport,
    ) -> Result<Route>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        match self.registered(file, range.clone(), dst, report) {
            Ok(()) => Ok(Route::Registered),
            Err(Error::Pinned(e)) if !matches!(e, gpufeed_pinned::Error::NoCudaDriver) => {
                Fallback::new(
                    Refused::HostRegistration,
                    e.to_string(),
                    "staged through pinned buffers instead",
                )
                .push_once(&mut report.fallbacks);
                self.staged(file, std::slice::from_ref(&range), dst, false, report)?;
                Ok(Route::Staged)
            }
            Err(e) => Err(e),
        }
    }

    /// `Registered`: the one place of the loader with unsafe code — the file's mapping, whose
    /// promise (not truncated while it loads) `Strategy::Registered` documents and the
    /// identity check after the copies backs, and its registration in pieces that outlive this
    /// call on the cleanup thread.
    #[allow(unsafe_code, reason = "maps and registers the file; see above")]
    fn registered<D>(
        &self,
        file: &OpenedFile,
        range: Range<u64>,
        dst: &mut D,
        report: &mut LoadReport,
    ) -> Result<()>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        if self.opts.testing_refuse_registration {
            return Err(Error::Pinned(gpufeed_pinned::Error::Cuda {
                op: "cuMemHostRegister",
                result: gpufeed_cuda::CUresult::CUDA_ERROR_NOT_PERMITTED,
            }));
        }
        let len = (range.end - range.start) as usize;
        // SAFETY: the file must not be truncated while it loads (documented on the strategy);
        // the identity check after the copies reports a file that changed.
        let map = unsafe { FileMap::of_opened(file, range.start, len as u64)? };
        let base = map.as_ptr() as usize;
        let page = gpufeed_os::page_size();
        let chunk = self.opts.register_chunk_bytes.next_multiple_of(page);
        // Chunk boundaries on page boundaries, so registered ranges never share a page.
        let mut bounds = vec![0usize];
        let mut next = (base + chunk).next_multiple_of(page) - base;
        while next < len {
            bounds.push(next);
            next += chunk;
        }
        bounds.push(len);
        let pieces: Vec<(usize, usize)> = bounds.windows(2).map(|w| (w[0], w[1] - w[0])).collect();
        let ctx = self.gpu.context();
        let next_piece = AtomicUsize::new(0);
        let mut copy_waited = 0.0;
        // Registrations outlive this call (see below), so they are 'static: `map` moves along
        // with them and is unmapped only after the last one is unregistered.
        let mut done: Vec<HostRegistration<'static>> = Vec::with_capacity(pieces.len());
        let outcome = std::thread::scope(|scope| -> Result<()> {
            let (reg_tx, reg_rx) =
                mpsc::sync_channel::<(usize, gpufeed_pinned::Result<HostRegistration<'static>>)>(4);
            for _ in 0..self.opts.register_threads.max(1).min(pieces.len()) {
                let (tx, pieces, next_piece) = (reg_tx.clone(), &pieces, &next_piece);
                scope.spawn(move || {
                    loop {
                        let i = next_piece.fetch_add(1, Ordering::Relaxed);
                        let Some(&(off, n)) = pieces.get(i) else {
                            return;
                        };
                        // SAFETY: [base + off, +n) lies in `map`, which is dropped only after
                        // every registration (the cleanup below); it is read-only and
                        // registered read-only.
                        let reg = unsafe {
                            HostRegistration::register(ctx, (base + off) as *const u8, n, true)
                        };
                        let failed = reg.is_err();
                        if tx.send((i, reg)).is_err() || failed {
                            return;
                        }
                    }
                });
            }
            drop(reg_tx);
            for _ in 0..pieces.len() {
                let t = Instant::now();
                let Ok((i, reg)) = reg_rx.recv() else { break };
                copy_waited += t.elapsed().as_secs_f64();
                let reg = match reg {
                    Ok(r) => r,
                    Err(e) => {
                        next_piece.store(usize::MAX / 2, Ordering::Relaxed);
                        return Err(e.into());
                    }
                };
                let copied = self
                    .sched
                    .upload(HostSource::Registered(&reg), dst, pieces[i].0);
                done.push(reg);
                copied?;
            }
            Ok(())
        });
        // Unregistering costs about a third of registering: do it after returning, on a
        // thread of its own that then unmaps the file. Every copy has completed (upload
        // synchronizes), so nothing reads the pages any more.
        let changed = map.verify_unchanged();
        let cleanup = move || {
            drop(done);
            drop(map);
        };
        match std::thread::Builder::new()
            .name("gpufeed-unregister".into())
            .spawn(cleanup)
        {
            Ok(handle) => {
                let mut c = self.cleanup.lock();
                // Reap the ones that ended, so the list stays short without callers waiting.
                let (done, running): (Vec<_>, Vec<_>) =
                    c.running.drain(..).partition(|h| h.is_finished());
                c.finished += done.len();
                c.running = running;
                c.running.push(handle);
            }
            Err(_) => {
                tracing::warn!("could not start the unregister thread; unregistered now");
                self.cleanup.lock().finished += 1;
            }
        }
        outcome?;
        changed?;
        report.copy_waited_s = copy_waited;
        Ok(())
    }
}
