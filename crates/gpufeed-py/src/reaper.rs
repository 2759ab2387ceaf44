//! The thread that frees device memory let go by Python objects, after the work queued on the
//! device before it (one `cuCtxSynchronize` per device per round, whatever the number of
//! buffers). A round gathers what is let go within [`GATHER`] of its first buffer, so
//! that a loop taking tensors and dropping them pays one synchronization per round, not one
//! per tensor. A load of 64 MiB or more waits for what is pending first
//! ([`wait_idle_before`], which cuts the round's gathering short), so that memory a
//! caller has let go is back before the next load asks for its own.
//!
//! A prefetch chunk let go whole is kept for reuse rather than freed
//! (`Gpu::keep_for_reuse`): the next chunk of its length takes it at no cost, as torch's
//! caching allocator serves its own tensors (a checkpoint loaded again in one process paid
//! 18-21 ms of 200 for the freeing and allocating; docs/benchmarks.md, GPU run 139). What is
//! kept is given back [`keep_for`] after the last buffer was kept (1 s;
//! `GPUFEED_KEEP_FREED_MS`, 0 to free at once), by `gpufeed.empty_cache()`, or by an
//! allocation that finds the device full.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;

use crate::array::Storage;

/// Waits for `gpu`'s queued work; `false` where that failed.
fn synchronize(gpu: &gpufeed::Gpu) -> bool {
    match gpu.context().synchronize() {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "synchronizing before freeing device memory failed");
            false
        }
    }
}

/// Waits for `gpu`'s queued work, then frees `storage`.
fn free_after_queued_work(gpu: &gpufeed::Gpu, storage: Storage) {
    synchronize(gpu);
    drop(storage);
}

/// How long what the reaper kept for reuse stays kept after the last buffer it kept:
/// `GPUFEED_KEEP_FREED_MS` (1000 by default; 0: nothing is kept).
pub(crate) fn keep_for() -> Duration {
    static KEEP: OnceLock<Duration> = OnceLock::new();
    *KEEP.get_or_init(|| {
        let ms = std::env::var("GPUFEED_KEEP_FREED_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(1000);
        // At most an hour: an instant plus it must not overflow.
        Duration::from_millis(ms.min(3_600_000))
    })
}

/// Keeps `storage` for reuse where it is a prefetch chunk nobody else holds (`true`), else
/// frees it; only once the device's work queued before it was let go is done (its tensors'
/// kernels read it by address, unseen by cudarc).
fn keep_or_free(gpu: &gpufeed::Gpu, storage: Storage) -> bool {
    match storage {
        Storage::Chunk(chunk) if !keep_for().is_zero() => match Arc::try_unwrap(chunk) {
            Ok(buf) => gpu.keep_for_reuse(buf),
            Err(_shared) => false,
        },
        other => {
            drop(other);
            false
        }
    }
}

type Item = (gpufeed::Gpu, Storage);

/// What the reaper is told: free this, or free what is pending now (someone waits).
enum Msg {
    Free(Box<Item>),
    Hurry,
}

/// How long a round gathers further buffers after its first: each round's synchronization
/// holds up the loads running meanwhile (a loop taking 430 KB tensors and dropping each
/// paid 16-26 us per tensor over one keeping them with a round per tensor, 10-16 us with
/// rounds gathered; GPU runs 102-103).
pub(super) const GATHER: Duration = Duration::from_micros(500);

struct Reaper {
    tx: Mutex<Sender<Msg>>,
    /// Items handed over and not yet freed.
    pending: Mutex<usize>,
    idle: Condvar,
    /// The GPUs it kept memory of, and when it last kept some.
    kept: Arc<Mutex<Kept>>,
}

#[derive(Default)]
struct Kept {
    on: Vec<gpufeed::Gpu>,
    last: Option<Instant>,
}

impl Kept {
    /// Gives back what the GPUs keep; returns the bytes.
    fn release(&mut self) -> u64 {
        self.last = None;
        let mut bytes = 0;
        for gpu in self.on.drain(..) {
            match gpu.release_kept() {
                Ok(n) => bytes += n,
                Err(e) => tracing::warn!(error = %e, "giving back kept device memory"),
            }
        }
        bytes
    }
}

fn reaper() -> Option<&'static Reaper> {
    static REAPER: OnceLock<Option<Reaper>> = OnceLock::new();
    REAPER
        .get_or_init(|| {
            let (tx, rx) = channel::<Msg>();
            let kept = Arc::new(Mutex::new(Kept::default()));
            let kept_here = Arc::clone(&kept);
            std::thread::Builder::new()
                .name("gpufeed-free".into())
                .spawn(move || run(&rx, &kept_here))
                .ok()
                .map(|_| Reaper {
                    tx: Mutex::new(tx),
                    pending: Mutex::new(0),
                    idle: Condvar::new(),
                    kept,
                })
        })
        .as_ref()
}

/// The next message; while memory is kept, what is kept is given back once [`keep_for`]
/// passed since it last kept some. `None`: the channel closed.
fn next(rx: &Receiver<Msg>, kept: &Mutex<Kept>) -> Option<Msg> {
    loop {
        let last = kept.lock().last;
        let Some(last) = last else {
            return rx.recv().ok();
        };
        // Past the deadline, what is kept goes back first: a steady stream of frees must not
        // put it off for ever (a receive with no time left still takes a queued message).
        let left = (last + keep_for()).saturating_duration_since(Instant::now());
        if !left.is_zero() {
            match rx.recv_timeout(left) {
                Ok(msg) => return Some(msg),
                Err(RecvTimeoutError::Disconnected) => return None,
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
        let mut kept = kept.lock();
        // `empty_cache` may have given it all back meanwhile (`last` is then None).
        if kept.last.is_some_and(|l| l + keep_for() <= Instant::now()) {
            let bytes = kept.release();
            tracing::debug!(bytes, "kept device memory given back");
        }
    }
}

fn run(rx: &Receiver<Msg>, kept: &Mutex<Kept>) {
    while let Some(first) = next(rx, kept) {
        let Msg::Free(first) = first else {
            continue; // nothing pending to hurry
        };
        let mut round = vec![*first];
        let until = Instant::now() + GATHER;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(Msg::Free(item)) => round.push(*item),
                Ok(Msg::Hurry) | Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let n = round.len();
        let began = Instant::now();
        // Each GPU's queued work once per round (`Some(done)` once tried).
        let mut synced: Vec<(usize, bool)> = Vec::new();
        let mut kept_any = false;
        for (gpu, storage) in round {
            let ordinal = gpu.info().ordinal;
            let done = match synced.iter().find(|(o, _)| *o == ordinal) {
                Some(&(_, done)) => done,
                None => {
                    let done = synchronize(&gpu);
                    synced.push((ordinal, done));
                    done
                }
            };
            if !done {
                drop(storage);
                continue;
            }
            // The work queued before it was let go is done (synchronized above, after it was
            // handed over).
            if keep_or_free(&gpu, storage) {
                kept_any = true;
                let mut k = kept.lock();
                k.last = Some(Instant::now());
                if !k.on.iter().any(|g| g.info().ordinal == ordinal) {
                    k.on.push(gpu);
                }
            }
        }
        tracing::debug!(
            buffers = n,
            kept = kept_any,
            ms = began.elapsed().as_secs_f64() * 1e3,
            "device memory freed"
        );
        if let Some(r) = reaper() {
            let mut pending = r.pending.lock();
            *pending = pending.saturating_sub(n);
            r.idle.notify_all();
        }
    }
}

/// Frees `storage` after `gpu`'s queued work: on the reaper's thread, or on this one
/// (waiting) where the thread could not start.
pub(super) fn free_later(gpu: gpufeed::Gpu, storage: Storage) {
    let Some(r) = reaper() else {
        return free_after_queued_work(&gpu, storage);
    };
    let (tx, mut pending) = (r.tx.lock(), r.pending.lock());
    *pending += 1;
    if let Err(back) = tx.send(Msg::Free(Box::new((gpu, storage)))) {
        *pending -= 1;
        drop((tx, pending));
        if let Msg::Free(item) = back.0 {
            let (gpu, storage) = *item;
            free_after_queued_work(&gpu, storage);
        }
    }
}

/// Loads of fewer bytes do not wait for the reaper ([`wait_idle_before`]).
const WAIT_FROM: u64 = 64 << 20;

/// Before a load of `bytes`: [`wait_idle`] where the load is large enough for the memory
/// let go to matter (64 MiB and more). A small load does not wait: the hand-off to the
/// reaper and its context synchronization cost 20-40 us, as much as a registered load of
/// 1 MiB itself (a loop of `get_tensor` calls over 430 KB tensors ran at 57 us per
/// tensor while each waited; docs/benchmarks.md, GPU run 76), and what is pending is
/// freed a moment later anyway.
pub(super) fn wait_idle_before(bytes: u64) {
    if bytes >= WAIT_FROM {
        wait_idle();
    }
}

/// Returns once everything handed over so far is freed (a round still gathering is cut
/// short).
pub(super) fn wait_idle() {
    let Some(r) = reaper() else {
        return;
    };
    // Not holding `pending` while taking `tx` (`free_later` takes them the other way).
    let busy = *r.pending.lock() > 0;
    if busy {
        let _ = r.tx.lock().send(Msg::Hurry);
    }
    let mut pending = r.pending.lock();
    while *pending > 0 {
        r.idle.wait(&mut pending);
    }
}

/// Waits until device memory let go by dropped arrays and tensors is freed (it is freed on a
/// thread after the work queued on the device; loads of 64 MiB and more wait for it
/// themselves) or kept for reuse.
#[pyfunction]
pub(crate) fn _wait_for_frees(py: Python<'_>) {
    py.detach(wait_idle);
}

/// Gives the device memory that gpufeed keeps for reuse back to the devices now (what
/// `torch.cuda.empty_cache()` does for torch's): after waiting for what was let go, the
/// prefetch chunks kept since. Returns the bytes given back.
#[pyfunction]
pub(crate) fn empty_cache(py: Python<'_>) -> u64 {
    py.detach(|| {
        wait_idle();
        reaper().map_or(0, |r| r.kept.lock().release())
    })
}
