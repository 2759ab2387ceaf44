//! The thread that frees device memory let go by Python objects, after the work queued on the
//! device before it (one `cuCtxSynchronize` per device per round, whatever the number of
//! buffers). A round gathers what is let go within [`GATHER`] of its first buffer, so
//! that a loop taking tensors and dropping them pays one synchronization per round, not one
//! per tensor. A load of 64 MiB or more waits for what is pending first
//! ([`wait_idle_before`], which cuts the round's gathering short), so that memory a
//! caller has let go is back before the next load asks for its own.

use std::sync::OnceLock;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;

use crate::array::Storage;

/// Waits for `gpu`'s queued work, then frees `storage`.
fn free_after_queued_work(gpu: &gpufeed::Gpu, storage: Storage) {
    if let Err(e) = gpu.context().synchronize() {
        tracing::warn!(error = %e, "synchronizing before freeing device memory failed");
    }
    drop(storage);
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
}

fn reaper() -> Option<&'static Reaper> {
    static REAPER: OnceLock<Option<Reaper>> = OnceLock::new();
    REAPER
        .get_or_init(|| {
            let (tx, rx) = channel::<Msg>();
            std::thread::Builder::new()
                .name("gpufeed-free".into())
                .spawn(move || run(&rx))
                .ok()
                .map(|_| Reaper {
                    tx: Mutex::new(tx),
                    pending: Mutex::new(0),
                    idle: Condvar::new(),
                })
        })
        .as_ref()
}

fn run(rx: &Receiver<Msg>) {
    while let Ok(first) = rx.recv() {
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
        let mut synced: Vec<usize> = Vec::new();
        for (gpu, storage) in round {
            let ordinal = gpu.info().ordinal;
            if synced.contains(&ordinal) {
                drop(storage);
            } else {
                synced.push(ordinal);
                free_after_queued_work(&gpu, storage);
            }
        }
        tracing::debug!(
            buffers = n,
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
/// themselves).
#[pyfunction]
pub(crate) fn _wait_for_frees(py: Python<'_>) {
    py.detach(wait_idle);
}
