//! The scheduler's kept fill threads: a crew of threads that run one job each per call and
//! stay awake (spinning, then yielding) for a short while after it, so that the next call's
//! jobs start within a microsecond instead of after a wake-up.
//!
//! Why not a general pool: on the H200 machine (a VM) waking a sleeping thread took 14-40 us
//! (rayon-core, docs/benchmarks.md GPU runs 22-24), as long as a 1 MiB load should take in
//! all; loads come in bursts (a data loader's batches, a checkpoint's tensors), so threads that
//! spin for [`TransferOptions::idle_spin`](crate::TransferOptions::idle_spin) after each job
//! are already running when the next one is posted. After that they park (a futex wait) and
//! cost nothing.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// A job as a member receives it: the call's closure (its lifetime erased: [`Crew::run`]
/// waits for every job before it returns, so the closure outlives each use), the job's
/// index, and the call's completion count.
struct Posted {
    job: *const (dyn Fn(usize) + Sync + 'static),
    index: usize,
    done: Arc<Done>,
}

// SAFETY: the closure behind `job` is `Sync` (shared by reference between the caller and the
// members) and lives until `Crew::run` has seen every job finish.
unsafe impl Send for Posted {}

/// One call's completion: the jobs still running, whether one panicked, and how to wake the
/// caller when it has gone to sleep waiting.
struct Done {
    remaining: AtomicUsize,
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    waiting: AtomicBool,
    caller: Thread,
}

/// A member's mailbox.
struct Slot {
    /// Bumped by the caller for each job posted.
    posted: AtomicU64,
    job: Mutex<Option<Posted>>,
    /// The member parked (or is about to): the caller must unpark it.
    sleeping: AtomicBool,
    stop: AtomicBool,
}

struct Member {
    slot: Arc<Slot>,
    thread: Option<JoinHandle<()>>,
}

/// Threads kept for a scheduler's staged uploads (see the module docs).
pub(crate) struct Crew {
    members: Vec<Member>,
    spin: Duration,
}

/// Spins, then yields, until `ready()` or `spin` has passed; returns whether it became ready.
fn spin_until(spin: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    let mut rounds = 0u32;
    loop {
        if ready() {
            return true;
        }
        rounds = rounds.wrapping_add(1);
        if rounds.is_multiple_of(64) {
            let spent = start.elapsed();
            if spent >= spin {
                return false;
            }
            // Past the first quarter, give the core to whoever needs it between checks
            // (machines with fewer cores than threads).
            if spent >= spin / 4 {
                thread::yield_now();
            }
        }
        std::hint::spin_loop();
    }
}

impl Crew {
    /// Starts `n` threads named `{name}-{i}`, each running `on_start` first (placement), that
    /// stay awake for `spin` after each job.
    pub(crate) fn start(
        n: usize,
        spin: Duration,
        name: &str,
        on_start: impl Fn() + Send + Sync + 'static,
    ) -> std::io::Result<Crew> {
        let on_start = Arc::new(on_start);
        let mut crew = Crew {
            members: Vec::with_capacity(n),
            spin,
        };
        for i in 0..n {
            let slot = Arc::new(Slot {
                posted: AtomicU64::new(0),
                job: Mutex::new(None),
                sleeping: AtomicBool::new(false),
                stop: AtomicBool::new(false),
            });
            let (theirs, on_start) = (Arc::clone(&slot), Arc::clone(&on_start));
            // On an error the members started so far are stopped by `crew`'s drop.
            let thread = thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    on_start();
                    serve(&theirs, spin);
                })?;
            crew.members.push(Member {
                slot,
                thread: Some(thread),
            });
        }
        Ok(crew)
    }

    /// Runs `job(0)` on the calling thread and `job(1)` .. `job(jobs - 1)` on members at once;
    /// returns when every job has returned. A job that panics has its panic resumed here after
    /// the others finished. `&mut`: one call at a time (callers that upload at once each take
    /// a crew of their own).
    ///
    /// # Panics
    /// When `jobs - 1` is more than the crew's threads (a bug of the caller), or a job panicked.
    pub(crate) fn run(&mut self, jobs: usize, job: &(dyn Fn(usize) + Sync)) {
        assert!(
            jobs <= self.members.len() + 1,
            "{jobs} jobs for a crew of {} threads and the caller",
            self.members.len()
        );
        if jobs <= 1 {
            if jobs == 1 {
                job(0);
            }
            return;
        }
        let done = Arc::new(Done {
            remaining: AtomicUsize::new(jobs - 1),
            panic: Mutex::new(None),
            waiting: AtomicBool::new(false),
            caller: thread::current(),
        });
        // SAFETY: only the lifetime is erased; this function does not return (nor unwind)
        // before `remaining` is 0, i.e. before every member has finished calling `job`.
        let erased: *const (dyn Fn(usize) + Sync + 'static) = unsafe {
            std::mem::transmute::<
                *const (dyn Fn(usize) + Sync + '_),
                *const (dyn Fn(usize) + Sync + 'static),
            >(job)
        };
        for (i, m) in self.members[..jobs - 1].iter().enumerate() {
            *m.slot.job.lock() = Some(Posted {
                job: erased,
                index: i + 1,
                done: Arc::clone(&done),
            });
            m.slot.posted.fetch_add(1, Ordering::SeqCst);
            if m.slot.sleeping.load(Ordering::SeqCst)
                && let Some(t) = &m.thread
            {
                t.thread().unpark();
            }
        }
        let own = catch_unwind(AssertUnwindSafe(|| job(0)));
        let finished = || done.remaining.load(Ordering::SeqCst) == 0;
        if !spin_until(self.spin, finished) {
            done.waiting.store(true, Ordering::SeqCst);
            while !finished() {
                thread::park();
            }
        }
        if let Err(p) = own {
            resume_unwind(p);
        }
        if let Some(p) = done.panic.lock().take() {
            resume_unwind(p);
        }
    }
}

/// A member's life: wait for a job (spinning for `spin` after the last one, then parked), run
/// it, report it done; until stopped.
fn serve(slot: &Slot, spin: Duration) {
    let mut seen = 0u64;
    loop {
        let posted = || slot.posted.load(Ordering::SeqCst) != seen;
        let stopped = || slot.stop.load(Ordering::SeqCst);
        if !spin_until(spin, || posted() || stopped()) {
            // Announce the sleep, then look once more: a caller that posted before seeing
            // `sleeping` is seen here (both sides are SeqCst).
            slot.sleeping.store(true, Ordering::SeqCst);
            while !posted() && !stopped() {
                thread::park();
            }
            slot.sleeping.store(false, Ordering::SeqCst);
        }
        if stopped() {
            return;
        }
        seen = slot.posted.load(Ordering::SeqCst);
        let Some(Posted { job, index, done }) = slot.job.lock().take() else {
            continue;
        };
        // SAFETY: the caller waits in `Crew::run` until `remaining` reaches 0 below.
        let ran = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(index) }));
        if let Err(p) = ran {
            done.panic.lock().get_or_insert(p);
        }
        if done.remaining.fetch_sub(1, Ordering::SeqCst) == 1 && done.waiting.load(Ordering::SeqCst)
        {
            done.caller.unpark();
        }
    }
}

impl Drop for Crew {
    fn drop(&mut self) {
        for m in &self.members {
            m.slot.stop.store(true, Ordering::SeqCst);
            if let Some(t) = &m.thread {
                t.thread().unpark();
            }
        }
        for m in &mut self.members {
            if let Some(t) = m.thread.take()
                && t.join().is_err()
            {
                tracing::warn!("a fill thread panicked outside a job");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every job runs once per call, on the caller and the members, whether the members
    /// are still spinning (back-to-back calls) or parked (a zero spin, and calls after a
    /// pause).
    #[test]
    fn every_job_runs_once_per_call() {
        for spin in [
            Duration::ZERO,
            Duration::from_micros(50),
            Duration::from_millis(5),
        ] {
            let mut crew = Crew::start(3, spin, "test-crew", || {}).unwrap();
            for call in 0..400 {
                let jobs = call % 5;
                let counts: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
                crew.run(jobs, &|i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
                for (i, c) in counts.iter().enumerate() {
                    assert_eq!(
                        c.load(Ordering::Relaxed),
                        usize::from(i < jobs),
                        "spin {spin:?}, call {call}, job {i}"
                    );
                }
                if call % 97 == 0 {
                    thread::sleep(Duration::from_millis(2));
                }
            }
        }
    }

    /// A panicking job (a member's or the caller's) is resumed on the caller after the others
    /// finished, and the crew serves the next call.
    #[test]
    fn a_panicking_job_is_resumed_and_the_crew_goes_on() {
        let mut crew = Crew::start(2, Duration::from_micros(20), "test-crew", || {}).unwrap();
        for bad in 0..3 {
            let finished = AtomicUsize::new(0);
            let r = catch_unwind(AssertUnwindSafe(|| {
                crew.run(3, &|i| {
                    if i == bad {
                        panic!("job {i} fails");
                    }
                    thread::sleep(Duration::from_millis(1));
                    finished.fetch_add(1, Ordering::SeqCst);
                })
            }));
            let msg = r.expect_err("the panic comes back");
            assert_eq!(
                msg.downcast_ref::<String>().map(String::as_str),
                Some(format!("job {bad} fails").as_str())
            );
            assert_eq!(
                finished.load(Ordering::SeqCst),
                2,
                "the others ran to the end"
            );
        }
        let n = AtomicUsize::new(0);
        crew.run(3, &|_| {
            n.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(n.load(Ordering::SeqCst), 3);
    }

    /// Members run `on_start` first, and a dropped crew's threads end (parked or spinning).
    #[test]
    fn members_start_placed_and_stop_when_dropped() {
        let started = Arc::new(AtomicUsize::new(0));
        let s = Arc::clone(&started);
        let mut crew = Crew::start(4, Duration::from_secs(10), "test-crew", move || {
            s.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        crew.run(5, &|_| {});
        assert_eq!(started.load(Ordering::SeqCst), 4);
        let t = Instant::now();
        drop(crew);
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "stopped without waiting out the spin"
        );
    }
}
