//! The batch ring in a shared-memory segment.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpufeed_os::process::{Liveness, ProcessIdentity};
use gpufeed_os::{ShmOptions, ShmSegment};
use parking_lot::{Condvar, Mutex};
use rustix::thread::futex;

use crate::error::{Error, Result};
use crate::layout::{
    self, Layout, MAX_CONSUMERS, MAX_PRODUCERS, OFF_FREE_WAITERS, OFF_READY_WAITERS,
};
use crate::members::{self, HolderRef, MAX_PROCESSES};
use crate::oflock::{self, ByteLock, Probe};
use crate::state;

/// Longest single futex wait: liveness is re-checked at least this often.
const WAIT_SLICE: Duration = Duration::from_millis(20);

/// How long a waiting producer (consumer) must see every registered consumer (producer) gone
/// before it answers [`Error::ConsumerGone`] ([`Error::ProducerGone`]): a peer that leaves and
/// comes back (a consumer that runs in rounds, registering for each; a restarted process)
/// re-registers well within it, while a peer that is gone for good still ends the wait in a
/// fraction of a second rather than the caller's timeout. (Without it, a producer spawned for
/// a consumer's next round could fill the ring before that round registered and give up:
/// seen on the 16-core H200 host, GPU run 77.)
const GONE_GRACE: Duration = Duration::from_millis(250);

/// When the peers of a waiter were first seen all gone, for [`GONE_GRACE`].
#[derive(Default)]
struct GoneFor(Option<Instant>);

impl GoneFor {
    /// Whether the peers, `gone` now, have been gone for the whole grace: resets when they
    /// are not.
    fn long_enough(&mut self, gone: bool) -> bool {
        if !gone {
            self.0 = None;
            return false;
        }
        let since = *self.0.get_or_insert_with(Instant::now);
        since.elapsed() >= GONE_GRACE
    }
}

/// The lease of a new ring: how long a holder in another PID namespace may go without renewing
/// before its slots are reclaimed.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// How many leases past its revocation a detached holder that holds no lock, in another PID
/// namespace, keeps its slots quarantined (nothing can prove such a holder dead): 30, 5 minutes
/// at [`DEFAULT_LEASE`].
pub const LOCKLESS_QUARANTINE_LEASES: u32 = 30;

/// How often a reader of the watermark looks again for a copy that no write was in the middle
/// of, before it takes the words as they are.
const WATERMARK_TRIES: u32 = 64;

/// How far a ring's consumer got, published in the ring's header so that producers can hold
/// back instead of running ahead of it: the consumer publishes it
/// ([`Consumer::publish_watermark`], [`Consumer::advance_watermark`]), producers read it
/// ([`BatchRing::watermark`]) or wait on it ([`BatchRing::wait_watermark`], woken by a futex
/// when it moves). Items are numbered within a round (an epoch of batches, say); what the
/// numbers mean is the caller's.
///
/// It is written by another process: a producer uses it only to decide whether to wait, never
/// to address memory, so a garbled or hostile watermark can make producers wait (up to their
/// timeout) or run ahead, nothing else. Its words are published as one unit (seqlock style):
/// a copy never pairs one round with another round's position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Watermark {
    /// How many items past `position` producers may produce: `None` when the consumer does
    /// not pace them (a new ring's watermark).
    pub window: Option<u64>,
    /// The round the consumer reads, or `None` between rounds.
    pub round: Option<u64>,
    /// The item of the round the consumer waits for: it has every item below it. Only rises
    /// within a round ([`Consumer::advance_watermark`]).
    pub position: u64,
}

impl Watermark {
    /// The highest item producers may produce now, `position + window` (saturating), or
    /// `None` when the consumer does not pace producers.
    pub fn limit(&self) -> Option<u64> {
        self.window.map(|w| self.position.saturating_add(w))
    }

    fn from_fields(f: state::WatermarkFields) -> Self {
        Watermark {
            window: (f.flags & state::WM_PACED != 0).then_some(f.window),
            round: (f.flags & state::WM_IN_ROUND != 0).then_some(f.round),
            position: f.position,
        }
    }

    fn fields(&self) -> state::WatermarkFields {
        let flag = |on: bool, f: u32| if on { f } else { 0 };
        state::WatermarkFields {
            flags: flag(self.window.is_some(), state::WM_PACED)
                | flag(self.round.is_some(), state::WM_IN_ROUND),
            round: self.round.unwrap_or(0),
            position: self.position,
            window: self.window.unwrap_or(0),
        }
    }
}

/// A ring of fixed-size slots in shared memory, for batches handed between processes.
///
/// Producers [`claim`](BatchRing::claim) a free slot, write into it, and
/// [`publish`](Claim::publish) it; consumers ([`BatchRing::consumer`]) take published slots in
/// publish order with [`Consumer::next`] and release them by dropping the [`Batch`]. Waits use
/// futexes on the shared words, always with a timeout, re-checking every 20 ms whether the
/// processes holding slots still live: the slot of a producer that died mid-write is reclaimed
/// and never delivered, the slot of a consumer that died is given back; producers get
/// [`Error::ConsumerGone`] when every consumer that registered died or left (dropped its
/// [`Consumer`]) and no slot is free.
///
/// # Who holds a slot
/// Every `BatchRing` value registers its process in the ring's process table: PID namespace,
/// pid and start time, published as one unit, and a heartbeat that a background thread renews
/// (every quarter of the [lease](BatchRing::set_lease), at least once a second) until the
/// value drops. A holder of our
/// PID namespace is judged by its pid (pidfd, start time, zombies count as dead); a holder of
/// another namespace (a container sharing /dev/shm with `--ipc=host`) by its heartbeat, never
/// because its pid means nothing here. Each value also holds a lock on its entry's byte of the
/// segment through a file description of its own (`F_OFD_SETLK`, released by the kernel when
/// the process dies, in any namespace): a holder whose lock is found released is known dead at
/// once, and one whose lock is held is never judged dead by its pid.
///
/// A holder of another namespace whose heartbeat stood still for a whole lease is *silent*:
/// dead, or only stopped (SIGSTOP, `docker pause`, a debugger). Its registration is revoked
/// and its slots are quarantined (see below), not handed to anyone: a stopped producer resumed
/// may finish a copy it began before it stopped, so its slot must not hold another producer's
/// batch by then, and a stopped consumer may still be reading its batch. A quarantined slot is
/// free again once its holder lets go of it (the [`Claim`] or [`Batch`] drops) or is known
/// dead (its lock released). A holder that could take no lock (no /proc to reopen the segment
/// through) and lives in another namespace can never be known dead: its quarantine ends once
/// its heartbeat has stood still for [`LOCKLESS_QUARANTINE_LEASES`] more leases (5 minutes at
/// the default lease), the one case where a stopped holder resumed after so long could finish
/// one copy it began into a slot that holds another batch by then. The silent process's next call answers [`Error::Detached`]:
/// [`Claim::write_at`] then writes nothing, [`Batch::read_at`] reads nothing, and
/// [`Claim::publish`] publishes nothing; it opens the ring again to go on. What a resumed
/// producer wrote into its quarantined slot is never delivered, and a delivered batch holds
/// only its own producer's bytes.
///
/// A `BatchRing` belongs to the process that attached it: after `fork` the child gets
/// [`Error::Forked`] from every call and its drops leave the parent's slots alone; the child
/// attaches under its own identity with [`BatchRing::open`] or [`BatchRing::from_fd`].
///
/// The header is validated on [`open`](BatchRing::open) (magic, version, geometry with checked
/// arithmetic); shared words are only touched atomically and slot data only through raw
/// pointers or copies. The segment has mode 0600 (see `gpufeed_os::shm`).
///
/// # Example
/// ```
/// use std::time::Duration;
/// use gpufeed_ipc::BatchRing;
/// let ring = BatchRing::create_unique(4, 1 << 20)?; // 4 slots of 1 MiB, named for other processes
/// let mut claim = ring.claim(Duration::from_secs(1))?;
/// claim.write_at(0, b"batch 0")?;
/// claim.set_len(7)?;
/// claim.publish()?;
/// let consumer = ring.consumer()?;
/// let batch = consumer.next(Duration::from_secs(1))?;
/// assert_eq!(batch.to_vec(), b"batch 0");
/// # Ok::<(), gpufeed_ipc::Error>(())
/// ```
#[derive(Debug)]
pub struct BatchRing {
    seg: ShmSegment,
    layout: Layout,
    me: ProcessIdentity,
    /// Our process-table entry, its ACTIVE control word and the reference slots carry.
    entry: usize,
    entry_ctl: u64,
    me_ref: HolderRef,
    /// Where the next claim starts scanning (spreads producers over the slots).
    cursor: AtomicU32,
    /// [`forks`] when this value attached: it differs in a forked child.
    fork_gen: u64,
    /// Heartbeats of other namespaces' holders as this process last saw them change.
    leases: Mutex<Vec<Option<Observed>>>,
    heartbeat: Heartbeat,
    /// The lock on our entry's byte ([`members::FLAG_LOCKED`]), dropped after the entry is
    /// retired; `None` where it could not be taken.
    _lock: Option<ByteLock>,
}

/// What the process holding a slot is, for the one judging it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// It runs, or may, and renews its lease.
    Live,
    /// Its lease ran out but it may only be stopped: its slots are quarantined.
    Silent,
    /// It is gone (dead, or detached): its slots are free for others.
    Dead,
}

/// Forks of this process's ancestry since it started, counted by a `pthread_atfork` child
/// handler (registered on first use): a value recorded at attach differs in a forked child.
/// Cheaper than `getpid`, a system call, on paths taken for every batch.
fn forks() -> u64 {
    static FORKS: AtomicU64 = AtomicU64::new(0);
    static REGISTER: std::sync::Once = std::sync::Once::new();
    extern "C" fn child() {
        // Async-signal-safe: one atomic add.
        FORKS.fetch_add(1, Ordering::Relaxed);
    }
    REGISTER.call_once(|| {
        // SAFETY: `child` is a plain function that stays valid for the life of the process
        // and only touches a static atomic.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(child)) };
        if rc != 0 {
            tracing::warn!(
                rc,
                "pthread_atfork failed: forked children are not detected"
            );
        }
    });
    FORKS.load(Ordering::Relaxed)
}

/// A heartbeat value and when this process first saw it.
#[derive(Debug, Clone, Copy)]
struct Observed {
    ctl: u64,
    beat: u64,
    since: Instant,
}

/// The thread renewing our heartbeat; stopped and joined on drop.
#[derive(Debug)]
struct Heartbeat {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl BatchRing {
    /// Creates a ring named `name` in /dev/shm (see `gpufeed_os::shm` for naming rules).
    pub fn create(name: &str, slots: u32, slot_bytes: u64) -> Result<Self> {
        let layout = Layout::new(slots, slot_bytes)?;
        let seg = ShmSegment::create(name, layout.total_len as usize)?;
        Self::init(seg, layout)
    }

    /// Creates a ring with a generated name (`gpufeed-<pid>-<start>-<pid ns>-<random>`).
    pub fn create_unique(slots: u32, slot_bytes: u64) -> Result<Self> {
        let layout = Layout::new(slots, slot_bytes)?;
        let seg = ShmSegment::create_unique(layout.total_len as usize)?;
        Self::init(seg, layout)
    }

    /// Creates a ring on an anonymous memfd; hand [`BatchRing::segment`]'s fd to related
    /// processes (inherited, or with [`crate::send_fd`]) and map it with
    /// [`BatchRing::from_fd`].
    pub fn anonymous(slots: u32, slot_bytes: u64) -> Result<Self> {
        let layout = Layout::new(slots, slot_bytes)?;
        let seg = ShmSegment::anonymous(layout.total_len as usize)?;
        Self::init(seg, layout)
    }

    /// Creates a ring in a segment made with other options (directory, prefix, kept name).
    pub fn create_with(
        options: &ShmOptions,
        name: &str,
        slots: u32,
        slot_bytes: u64,
    ) -> Result<Self> {
        let layout = Layout::new(slots, slot_bytes)?;
        let seg = options.create(name, layout.total_len as usize)?;
        Self::init(seg, layout)
    }

    fn init(seg: ShmSegment, layout: Layout) -> Result<Self> {
        // The segment is fresh and zeroed (all slots FREE, no processes); write the geometry
        // and the lease, then the magic last with Release so that an opener that sees the
        // magic sees the rest.
        let header = layout.header_bytes();
        seg.write_at(8, &header[8..])?;
        let ring = Self::join(seg, layout)?;
        ring.set_lease(DEFAULT_LEASE);
        ring.u64_at(layout::OFF_MAGIC)
            .store(layout::MAGIC, Ordering::Release);
        Ok(ring)
    }

    /// Opens the ring named `name`, validating its header.
    pub fn open(name: &str) -> Result<Self> {
        let seg = ShmOptions::new().min_len(layout::HEADER_BYTES).open(name)?;
        Self::attach(seg)
    }

    /// Maps a ring from a memfd received from its creator.
    pub fn from_fd(fd: OwnedFd) -> Result<Self> {
        Self::attach(ShmSegment::from_fd(fd)?)
    }

    fn attach(seg: ShmSegment) -> Result<Self> {
        if (seg.len() as u64) < layout::HEADER_BYTES {
            return Err(Error::InvalidHeader(format!(
                "segment of {} bytes",
                seg.len()
            )));
        }
        // SAFETY: offset 0 is inside the segment (len >= one page) and 8-aligned; the word is
        // only accessed atomically.
        let magic = unsafe { AtomicU64::from_ptr(seg.as_ptr().cast()) }.load(Ordering::Acquire);
        if magic != layout::MAGIC {
            return Err(Error::InvalidHeader(
                "not a gpufeed batch ring (bad magic), or not initialised yet".into(),
            ));
        }
        // Read the header once into private memory, then validate that copy.
        let mut header = [0u8; 64];
        seg.read_at(0, &mut header)?;
        let layout = layout::parse_header(&header, seg.len() as u64)?;
        Self::join(seg, layout)
    }

    /// Registers this process in the process table and starts its heartbeat.
    fn join(seg: ShmSegment, layout: Layout) -> Result<Self> {
        let me = ProcessIdentity::current();
        let mut ring = BatchRing {
            seg,
            layout,
            me,
            entry: 0,
            entry_ctl: 0,
            me_ref: 0,
            cursor: AtomicU32::new(0),
            fork_gen: forks(),
            leases: Mutex::new(vec![None; MAX_PROCESSES]),
            heartbeat: Heartbeat {
                stop: Arc::new((Mutex::new(false), Condvar::new())),
                thread: None,
            },
            _lock: None,
        };
        // The entry is taken (WRITING), then its byte locked, then the identity published
        // (ACTIVE) saying whether the lock is held: nobody reads a lock before it exists.
        let register = |ring: &BatchRing, i: usize| {
            let e = ring.proc_entry(i);
            let generation = members::begin_register(&e)?;
            let lock = ByteLock::take(ring.seg.as_fd(), ring.lock_byte(i));
            let id = members::Identity {
                pid_ns: me.pid_ns,
                pid: me.pid,
                start_ticks: me.start_ticks,
                flags: if lock.is_some() {
                    members::FLAG_LOCKED
                } else {
                    0
                },
            };
            members::finish_register(&e, generation, id).then_some((i, generation, lock))
        };
        let registered = (0..2).find_map(|attempt| {
            if attempt == 1 {
                ring.retire_gone_processes();
            }
            (0..MAX_PROCESSES).find_map(|i| register(&ring, i))
        });
        let Some((entry, generation, lock)) = registered else {
            return Err(Error::TooManyProcesses(MAX_PROCESSES));
        };
        ring._lock = lock;
        ring.entry = entry;
        ring.entry_ctl = members::active(generation);
        ring.me_ref = members::holder_ref(entry, generation);
        let beat_addr = ring.u64_at(layout.proc_offset(entry) + layout::PROC_HEARTBEAT)
            as *const AtomicU64 as usize;
        let lease_addr = ring.u32_at(layout::OFF_LEASE_MS) as *const AtomicU32 as usize;
        let stop = Arc::clone(&ring.heartbeat.stop);
        let thread = std::thread::Builder::new()
            .name("gpufeed-ring-lease".into())
            .spawn(move || {
                // SAFETY: both words lie in the ring's mapping, which `BatchRing::drop` keeps
                // mapped until this thread has been joined; they are only accessed atomically.
                let (beat, lease) = unsafe {
                    (
                        &*(beat_addr as *const AtomicU64),
                        &*(lease_addr as *const AtomicU32),
                    )
                };
                let (lock, cv) = &*stop;
                let mut stopped = lock.lock();
                while !*stopped {
                    beat.fetch_add(1, Ordering::Relaxed);
                    let period = Duration::from_millis(u64::from(lease.load(Ordering::Relaxed)))
                        .div_f64(4.0)
                        .clamp(Duration::from_millis(2), Duration::from_secs(1));
                    cv.wait_for(&mut stopped, period);
                }
            });
        match thread {
            Ok(t) => ring.heartbeat.thread = Some(t),
            Err(source) => {
                members::retire(&ring.proc_entry(entry), ring.entry_ctl);
                return Err(Error::Io {
                    op: "spawn the ring's heartbeat thread",
                    source,
                });
            }
        }
        Ok(ring)
    }

    /// The segment (its fd for passing, its memory for GPU registration).
    pub fn segment(&self) -> &ShmSegment {
        &self.seg
    }

    /// The geometry.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Number of slots.
    pub fn slots(&self) -> u32 {
        self.layout.slots
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.layout.slot_bytes
    }

    /// Sets the lease of the ring (for every process using it): a holder in another PID
    /// namespace whose heartbeat has not moved for this long is judged gone and its slots are
    /// reclaimed. At least 10 ms; [`DEFAULT_LEASE`] for a new ring. Longer leases make
    /// reclaiming a dead container's slots slower; shorter ones make a stopped process lose its
    /// slots sooner.
    pub fn set_lease(&self, lease: Duration) {
        let ms = lease.as_millis().clamp(10, u128::from(u32::MAX)) as u32;
        self.u32_at(layout::OFF_LEASE_MS)
            .store(ms, Ordering::Relaxed);
    }

    /// The ring's lease (see [`BatchRing::set_lease`]).
    pub fn lease(&self) -> Duration {
        Duration::from_millis(u64::from(
            self.u32_at(layout::OFF_LEASE_MS).load(Ordering::Relaxed),
        ))
    }

    /// The identity this ring value registered under (PID namespace, pid, start time).
    pub fn identity(&self) -> ProcessIdentity {
        self.me
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= self.seg.len());
        // SAFETY: every offset used is a fixed field inside the validated layout, 4-aligned in a
        // page-aligned mapping that lives as long as self; shared words are only accessed
        // atomically, by every process.
        unsafe { AtomicU32::from_ptr(self.seg.as_ptr().add(off).cast()) }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.seg.len());
        // SAFETY: as in u32_at, 8-aligned.
        unsafe { AtomicU64::from_ptr(self.seg.as_ptr().add(off).cast()) }
    }

    /// The watermark's words in the header.
    fn wm_words(&self) -> state::WatermarkWords<'_> {
        state::WatermarkWords {
            seq: self.u32_at(layout::OFF_WM_SEQ),
            flags: self.u32_at(layout::OFF_WM_FLAGS),
            round: self.u64_at(layout::OFF_WM_ROUND),
            position: self.u64_at(layout::OFF_WM_POSITION),
            window: self.u64_at(layout::OFF_WM_WINDOW),
        }
    }

    /// Wakes producers waiting on the watermark, after a write.
    fn wake_watermark_waiters(&self) {
        if self.u32_at(layout::OFF_WM_WAITERS).load(Ordering::SeqCst) > 0 {
            let _ = futex::wake(
                self.u32_at(layout::OFF_WM_SEQ),
                futex::Flags::empty(),
                i32::MAX as u32,
            );
        }
    }

    /// The consumer's watermark as last published ([`Watermark`]: a hint from another
    /// process). A consumer that died in the middle of publishing leaves the words as they
    /// are until the next one publishes.
    pub fn watermark(&self) -> Watermark {
        Watermark::from_fields(self.wm_words().read(WATERMARK_TRIES))
    }

    /// Waits until `ready` accepts the consumer's watermark, up to `timeout`, and returns
    /// the watermark it accepted. It is looked at again whenever a consumer publishes (a
    /// futex wake), and at least every 20 ms.
    ///
    /// ```
    /// # use std::time::Duration;
    /// use gpufeed_ipc::{BatchRing, Watermark};
    /// let ring = BatchRing::anonymous(2, 4096)?;
    /// let consumer = ring.consumer()?;
    /// consumer.publish_watermark(Watermark { window: Some(4), round: Some(0), position: 0 })?;
    /// // A producer of item 6 of round 0 waits until the consumer is within 4 items of it.
    /// let allows_6 = |w: &Watermark| w.round == Some(0) && w.limit().is_some_and(|l| l >= 6);
    /// assert!(!allows_6(&ring.watermark()));
    /// consumer.advance_watermark(2)?;
    /// assert_eq!(ring.wait_watermark(allows_6, Duration::from_secs(1))?.position, 2);
    /// # Ok::<(), gpufeed_ipc::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`Error::ConsumerGone`] when every consumer that registered died
    /// or left and stayed so for a quarter of a second (as for [`BatchRing::claim`]);
    /// [`Error::Forked`], [`Error::Detached`].
    pub fn wait_watermark(
        &self,
        mut ready: impl FnMut(&Watermark) -> bool,
        timeout: Duration,
    ) -> Result<Watermark> {
        let deadline = Instant::now() + timeout;
        let mut gone = GoneFor::default();
        let waiters = self.u32_at(layout::OFF_WM_WAITERS);
        loop {
            self.check_attached()?;
            let w = self.watermark();
            if ready(&w) {
                return Ok(w);
            }
            if gone.long_enough(self.all_gone(Role::Consumer)) {
                return Err(Error::ConsumerGone);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: "the consumer's watermark to come within reach",
                    ms: timeout.as_millis(),
                });
            }
            // Counted as a waiter before reading the sequence: a consumer that publishes
            // after this read sees the count and wakes us (both SeqCst).
            waiters.fetch_add(1, Ordering::SeqCst);
            let seen = self.u32_at(layout::OFF_WM_SEQ).load(Ordering::SeqCst);
            let w = self.watermark();
            if ready(&w) {
                waiters.fetch_sub(1, Ordering::SeqCst);
                return Ok(w);
            }
            self.wait(
                layout::OFF_WM_SEQ,
                layout::OFF_WM_WAITERS,
                seen,
                (deadline - now).min(WAIT_SLICE),
            );
        }
    }

    fn ctl(&self, slot: u32) -> &state::AtomicU64 {
        self.u64_at(self.layout.meta_offset(slot) + layout::SLOT_CTL)
    }

    fn slot_u64(&self, slot: u32, field: usize) -> &AtomicU64 {
        self.u64_at(self.layout.meta_offset(slot) + field)
    }

    fn proc_entry(&self, i: usize) -> members::Entry<'_> {
        let base = self.layout.proc_offset(i);
        members::Entry {
            ctl: self.u64_at(base + layout::PROC_CTL),
            pid_ns: self.u64_at(base + layout::PROC_NS),
            pid: self.u64_at(base + layout::PROC_PID),
            start: self.u64_at(base + layout::PROC_START),
            flags: self.u64_at(base + layout::PROC_FLAGS),
        }
    }

    /// The byte of the segment that the process of entry `i` holds locked: the entry's first.
    fn lock_byte(&self, i: usize) -> u64 {
        self.layout.proc_offset(i) as u64
    }

    /// Word `i` of `role`'s table: a holder reference, 0 (never registered) or
    /// [`members::LEFT`].
    fn role_word(&self, role: Role, i: usize) -> &AtomicU32 {
        self.u32_at(role.table() + 4 * i)
    }

    /// Registers this process in `role`'s table: the entry taken, or None when it is full of
    /// live members.
    fn register(&self, role: Role) -> Result<Option<usize>> {
        self.check_attached()?;
        for i in 0..role.max() {
            let word = self.role_word(role, i);
            let cur = word.load(Ordering::Acquire);
            // One word names the member (its process-table entry and generation), so there
            // is no moment in which a new member is half registered.
            if (cur == 0 || self.judge(cur) != Holder::Live)
                && word
                    .compare_exchange(cur, self.me_ref, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    /// Marks this process's entry `i` of `role` LEFT, not 0: a member that was there and left
    /// (a trainer whose loop ended or panicked) must end the other side's waits as a dead one
    /// does, not look like one that has not come yet. A forked child leaves the parent's
    /// entry alone.
    fn leave(&self, role: Role, i: usize) {
        if self.in_owner() {
            let _ = self.role_word(role, i).compare_exchange(
                self.me_ref,
                members::LEFT,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }

    /// Whether members of `role` registered and all of them are gone (dead or
    /// [`members::LEFT`]).
    fn all_gone(&self, role: Role) -> bool {
        let mut any = false;
        for i in 0..role.max() {
            let r = self.role_word(role, i).load(Ordering::Acquire);
            if r == 0 {
                continue;
            }
            any = true;
            if self.judge(r) == Holder::Live {
                return false;
            }
        }
        any
    }

    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        // SAFETY: slot < slots, so its data lies inside the validated total length.
        unsafe {
            self.seg
                .as_ptr()
                .add(self.layout.slot_offset(slot) as usize)
        }
    }

    /// Whether this value is used by the process that attached it (not a forked child). On
    /// every claim, write, publish and take, so no system call: a fork handler counts forks.
    fn in_owner(&self) -> bool {
        forks() == self.fork_gen
    }

    /// [`Error::Forked`] in a forked child, [`Error::Detached`] when a peer reclaimed our entry.
    fn check_attached(&self) -> Result<()> {
        if !self.in_owner() {
            return Err(Error::Forked {
                attached_pid: self.me.pid,
                pid: rustix::process::getpid().as_raw_nonzero().get() as u32,
            });
        }
        if self.proc_entry(self.entry).ctl.load(Ordering::Acquire) != self.entry_ctl {
            return Err(self.detached());
        }
        Ok(())
    }

    fn detached(&self) -> Error {
        Error::Detached {
            lease_ms: self.lease().as_millis(),
        }
    }

    /// What the holder `r` is: [`Holder::Dead`] when its entry was retired or reused, its
    /// lock is released, or its process (of our namespace, holding no lock we can see) died;
    /// [`Holder::Silent`] when it is of another namespace (or its pid was judged dead while it
    /// holds its lock) and its heartbeat stood still for a whole lease; [`Holder::Live`]
    /// otherwise. Judging acts on the entry: a dead holder's is retired, a silent one's
    /// revoked (before any of its slots is quarantined, so that a holder that finds its slot
    /// quarantined finds itself detached).
    fn judge(&self, r: HolderRef) -> Holder {
        use members::Lookup;
        let index = members::ref_index(r);
        if index >= MAX_PROCESSES {
            return Holder::Dead; // garbage from a peer: nobody can hold through it
        }
        let entry = self.proc_entry(index);
        match members::lookup(&entry, members::ref_generation(r)) {
            Lookup::Gone => Holder::Dead,
            // Mid-registration: it holds no slot yet, only the entry.
            Lookup::Writing(ctl) => {
                if !self.lease_expired(index, ctl) {
                    return Holder::Live;
                }
                if members::retire(&entry, ctl) {
                    tracing::warn!(entry = index, "a process died registering in the ring");
                }
                Holder::Dead
            }
            Lookup::Active(id, ctl) => {
                let verdict = self.verdict(index, id, ctl);
                match verdict {
                    Holder::Dead if members::retire(&entry, ctl) => {
                        tracing::warn!(entry = index, "a process attached to the ring is gone");
                    }
                    Holder::Silent if members::revoke(&entry, ctl) => {
                        tracing::warn!(
                            entry = index,
                            pid = id.pid,
                            pid_ns = id.pid_ns,
                            "a process attached to the ring was silent for a whole lease: \
                             detached, its slots quarantined until it lets go or is known dead"
                        );
                    }
                    _ => {}
                }
                verdict
            }
            Lookup::Revoked(id, ctl) => {
                let dead = match self.lock_probe(index, &id) {
                    Probe::Free => true,
                    Probe::Held => false,
                    Probe::Unknown => match identity(&id).liveness() {
                        Liveness::Dead => true,
                        Liveness::Alive => false,
                        // No lock and a pid that means nothing here: nothing can ever prove it
                        // dead. Its slots come back once it has been silent for a bound.
                        Liveness::OtherNamespace => {
                            let silent = self.silent_for(index, ctl);
                            let gone = silent > self.lease() * LOCKLESS_QUARANTINE_LEASES;
                            if gone {
                                tracing::warn!(
                                    entry = index,
                                    pid = id.pid,
                                    pid_ns = id.pid_ns,
                                    silent_s = silent.as_secs_f64(),
                                    "a detached process of another PID namespace that holds no \
                                     lock stayed silent past the quarantine bound: its slots \
                                     are freed"
                                );
                            }
                            gone
                        }
                    },
                };
                if !dead {
                    return Holder::Silent;
                }
                if members::retire(&entry, ctl) {
                    tracing::warn!(entry = index, "a detached process of the ring is gone");
                }
                Holder::Dead
            }
        }
    }

    /// The verdict on an ACTIVE entry `index` (identity `id`, read under `ctl`).
    fn verdict(&self, index: usize, id: members::Identity, ctl: u64) -> Holder {
        let lock = self.lock_probe(index, &id);
        if lock == Probe::Free {
            return Holder::Dead;
        }
        match (identity(&id).liveness(), lock) {
            (Liveness::Alive, _) => Holder::Live,
            (Liveness::Dead, Probe::Unknown) => Holder::Dead,
            // Another namespace, or a pid that reads as dead while its lock is held (a /proc
            // that is not ours): only the heartbeat can tell, and it tells silence, not death.
            _ if self.lease_expired(index, ctl) => Holder::Silent,
            _ => Holder::Live,
        }
    }

    /// The lock of entry `index`, if its process published that it holds one.
    fn lock_probe(&self, index: usize, id: &members::Identity) -> Probe {
        if id.flags & members::FLAG_LOCKED == 0 {
            return Probe::Unknown;
        }
        // Through the mapped segment's descriptor, which never holds a lock itself.
        oflock::probe(self.seg.as_fd(), self.lock_byte(index))
    }

    /// Whether entry `index` (read under `ctl`) has not renewed its heartbeat for a lease,
    /// as seen by this process's clock since it first saw the current heartbeat value.
    fn lease_expired(&self, index: usize, ctl: u64) -> bool {
        self.silent_for(index, ctl) > self.lease()
    }

    /// How long entry `index` (read under `ctl`) has not renewed its heartbeat, as seen by this
    /// process's clock since it first saw the current heartbeat value (zero at the first look,
    /// and again whenever the heartbeat or the entry changes).
    fn silent_for(&self, index: usize, ctl: u64) -> Duration {
        let beat = self
            .u64_at(self.layout.proc_offset(index) + layout::PROC_HEARTBEAT)
            .load(Ordering::Relaxed);
        let now = Instant::now();
        let mut leases = self.leases.lock();
        match &mut leases[index] {
            Some(seen) if seen.ctl == ctl && seen.beat == beat => now.duration_since(seen.since),
            other => {
                *other = Some(Observed {
                    ctl,
                    beat,
                    since: now,
                });
                Duration::ZERO
            }
        }
    }

    /// Retires the process-table entries of processes that are gone (when the table is full).
    fn retire_gone_processes(&self) {
        for i in 0..MAX_PROCESSES {
            let ctl = self.proc_entry(i).ctl.load(Ordering::Acquire);
            if members::state(ctl) != members::FREE {
                self.judge(members::holder_ref(i, members::generation(ctl).max(1)));
            }
        }
    }

    fn bump(&self, seq_off: usize, waiters_off: usize) {
        self.u32_at(seq_off).fetch_add(1, Ordering::SeqCst);
        if self.u32_at(waiters_off).load(Ordering::SeqCst) > 0 {
            let _ = futex::wake(self.u32_at(seq_off), futex::Flags::empty(), i32::MAX as u32);
        }
    }

    /// Sleeps until the futex word at `seq_off` moves past `seen` or `slice` passes.
    fn wait(&self, seq_off: usize, waiters_off: usize, seen: u32, slice: Duration) {
        let ts = rustix::time::Timespec {
            tv_sec: slice.as_secs() as i64,
            tv_nsec: i64::from(slice.subsec_nanos()),
        };
        // EAGAIN (moved already), ETIMEDOUT and EINTR all mean: look again.
        let _ = futex::wait(self.u32_at(seq_off), futex::Flags::empty(), seen, Some(&ts));
        self.u32_at(waiters_off).fetch_sub(1, Ordering::SeqCst);
    }

    /// CLAIMED/TAKEN/QUARANTINED `word` -> FREE, waking claimers.
    fn free_word(&self, slot: u32, word: u64) -> bool {
        let freed = state::free(self.ctl(slot), word);
        if freed {
            self.bump(layout::OFF_FREE_SEQ, OFF_FREE_WAITERS);
        }
        freed
    }

    /// The holder of CLAIMED/TAKEN `word` lets go of its slot: frees it, or, when a peer
    /// quarantined it meanwhile, ends the quarantine (this process is done with it now).
    fn let_go(&self, slot: u32, word: u64) {
        if !self.free_word(slot, word)
            && state::release_quarantined(self.ctl(slot), state::quarantined(word))
        {
            self.bump(layout::OFF_FREE_SEQ, OFF_FREE_WAITERS);
        }
    }

    /// Whether this process is still attached (a peer has not revoked or retired its entry)
    /// and slot `slot` still holds the word `word` it claimed or took the slot under.
    fn holds(&self, slot: u32, word: u64) -> bool {
        self.proc_entry(self.entry).ctl.load(Ordering::Relaxed) == self.entry_ctl
            && self.ctl(slot).load(Ordering::Relaxed) == word
    }

    /// Claims a free slot without waiting.
    ///
    /// # Errors
    /// [`Error::Forked`], [`Error::Detached`].
    pub fn try_claim(&self) -> Result<Option<Claim<'_>>> {
        self.check_attached()?;
        let n = self.layout.slots;
        let start = self.cursor.fetch_add(1, Ordering::Relaxed) % n;
        for k in 0..n {
            let slot = (start + k) % n;
            if let Some(word) = state::try_claim(self.ctl(slot), self.me_ref) {
                return Ok(Some(Claim {
                    ring: self,
                    slot,
                    word,
                    len: 0,
                    done: false,
                }));
            }
        }
        Ok(None)
    }

    /// Claims a free slot, waiting up to `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`Error::ConsumerGone`] when every consumer that registered died or
    /// left, stayed so for a quarter of a second (a consumer coming back registers within
    /// it), and no slot is free;
    /// [`Error::Forked`], [`Error::Detached`].
    pub fn claim(&self, timeout: Duration) -> Result<Claim<'_>> {
        let deadline = Instant::now() + timeout;
        let mut gone = GoneFor::default();
        loop {
            if let Some(c) = self.try_claim()? {
                return Ok(c);
            }
            self.reap();
            if gone.long_enough(self.all_gone(Role::Consumer)) {
                return Err(Error::ConsumerGone);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: "a free slot",
                    ms: timeout.as_millis(),
                });
            }
            self.u32_at(OFF_FREE_WAITERS).fetch_add(1, Ordering::SeqCst);
            let seen = self.u32_at(layout::OFF_FREE_SEQ).load(Ordering::SeqCst);
            if let Some(c) = self.try_claim()? {
                self.u32_at(OFF_FREE_WAITERS).fetch_sub(1, Ordering::SeqCst);
                return Ok(c);
            }
            self.wait(
                layout::OFF_FREE_SEQ,
                OFF_FREE_WAITERS,
                seen,
                (deadline - now).min(WAIT_SLICE),
            );
        }
    }

    /// Registers this process as a consumer (so producers can tell when consumers die).
    ///
    /// # Errors
    /// [`Error::TooManyConsumers`] when 16 live consumers are registered; [`Error::Forked`],
    /// [`Error::Detached`].
    pub fn consumer(&self) -> Result<Consumer<'_>> {
        match self.register(Role::Consumer)? {
            Some(entry) => Ok(Consumer { ring: self, entry }),
            None => Err(Error::TooManyConsumers(MAX_CONSUMERS)),
        }
    }

    /// Registers this process as a producer for as long as the value lives, so that consumers
    /// can tell when producers are gone: once every registered producer died or dropped its
    /// `Producer` and no published batch is left, [`Consumer::next`] answers
    /// [`Error::ProducerGone`] a quarter of a second later instead of waiting out its
    /// timeout. Claiming needs no registration; register a producer that feeds the ring for
    /// the whole stream (not one of a series started one after another with gaps: after a
    /// gap of more than a quarter of a second, consumers would be told that producers are
    /// gone).
    ///
    /// ```
    /// # use std::time::Duration;
    /// let ring = gpufeed_ipc::BatchRing::anonymous(2, 4096)?;
    /// let consumer = ring.consumer()?;
    /// let producer = ring.producer()?;
    /// let mut claim = ring.claim(Duration::from_secs(1))?;
    /// claim.write_at(0, b"the last batch")?;
    /// claim.set_len(14)?;
    /// claim.publish()?;
    /// drop(producer);
    /// // What was published is still delivered; then the ring says nobody feeds it.
    /// assert_eq!(consumer.next(Duration::from_secs(1))?.to_vec(), b"the last batch");
    /// assert!(matches!(
    ///     consumer.next(Duration::from_secs(10)),
    ///     Err(gpufeed_ipc::Error::ProducerGone)
    /// ));
    /// # Ok::<(), gpufeed_ipc::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::TooManyProducers`] when 16 live producers are registered; [`Error::Forked`],
    /// [`Error::Detached`].
    pub fn producer(&self) -> Result<Producer<'_>> {
        match self.register(Role::Producer)? {
            Some(entry) => Ok(Producer { ring: self, entry }),
            None => Err(Error::TooManyProducers(MAX_PRODUCERS)),
        }
    }

    /// Frees the slots held by processes that are gone (a producer's unfinished batch is
    /// dropped, never delivered; a consumer's taken batch is dropped too), and quarantines
    /// those of silent ones (see [`BatchRing`]: freed once they let go or are known dead).
    /// Returns how many were freed. A holder of another PID namespace is silent once its lease
    /// expired, dead once its lock is released.
    pub fn reap(&self) -> usize {
        let mut freed = 0;
        for slot in 0..self.layout.slots {
            let word = self.ctl(slot).load(Ordering::Acquire);
            let st = state::state(word);
            if st != state::CLAIMED && st != state::TAKEN && st != state::QUARANTINED {
                continue;
            }
            let holder = state::holder(word);
            if holder == self.me_ref {
                continue;
            }
            // The compare-and-swaps fail if the slot moved on since `word` was read, so a
            // judgement of an old holder never frees or quarantines a new holder's slot.
            match self.judge(holder) {
                Holder::Dead if self.free_word(slot, word) => {
                    tracing::warn!(slot, "freed a slot held by a process that is gone");
                    freed += 1;
                }
                Holder::Silent
                    if st != state::QUARANTINED && state::quarantine(self.ctl(slot), word) =>
                {
                    tracing::warn!(
                        slot,
                        "quarantined a slot of a silent process: nobody uses it until that \
                         process lets go of it or is known dead"
                    );
                }
                _ => {}
            }
        }
        freed
    }

    /// How many slots are in each state now.
    pub fn stats(&self) -> RingStats {
        let mut s = RingStats::default();
        for slot in 0..self.layout.slots {
            match state::state(self.ctl(slot).load(Ordering::Relaxed)) {
                state::FREE => s.free += 1,
                state::CLAIMED => s.claimed += 1,
                state::READY => s.ready += 1,
                state::TAKEN => s.taken += 1,
                _ => s.quarantined += 1,
            }
        }
        s
    }
}

impl Drop for BatchRing {
    fn drop(&mut self) {
        let thread = self.heartbeat.thread.take();
        if !self.in_owner() {
            // A forked child: the heartbeat thread and the entry are the parent's. Joining a
            // thread that does not exist in this process would wait forever.
            std::mem::forget(thread);
            return;
        }
        *self.heartbeat.stop.0.lock() = true;
        self.heartbeat.stop.1.notify_all();
        if let Some(t) = thread {
            let _ = t.join();
        }
        // ACTIVE, or REVOKED by a peer that judged us silent: either way we are done with the
        // entry (no claim or batch outlives the ring value). The lock goes after.
        let entry = self.proc_entry(self.entry);
        if !members::retire(&entry, self.entry_ctl) {
            members::retire(&entry, members::revoked(self.entry_ctl));
        }
    }
}

/// The identity an entry published, as `gpufeed-os` judges it.
fn identity(id: &members::Identity) -> ProcessIdentity {
    ProcessIdentity {
        pid_ns: id.pid_ns,
        pid: id.pid,
        start_ticks: id.start_ticks,
    }
}

/// Slot counts by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingStats {
    /// Free.
    pub free: u32,
    /// Being written by a producer.
    pub claimed: u32,
    /// Published, waiting for a consumer.
    pub ready: u32,
    /// Being read by a consumer.
    pub taken: u32,
    /// Taken away from a silent holder (stopped longer than the lease?) and used by nobody
    /// until it lets go or is known dead.
    pub quarantined: u32,
}

/// A slot claimed by this producer. Write into it, set the length, and
/// [`publish`](Claim::publish); dropping it unpublished gives the slot back.
#[derive(Debug)]
pub struct Claim<'r> {
    ring: &'r BatchRing,
    slot: u32,
    word: u64,
    len: u64,
    done: bool,
}

impl Claim<'_> {
    /// The slot's index.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Bytes the slot holds.
    pub fn capacity(&self) -> u64 {
        self.ring.layout.slot_bytes
    }

    /// The slot's first byte (256-byte aligned), for writing `capacity()` bytes. Writes through
    /// it must be done before the claim's next call ([`Claim::publish`]) or its drop: a claim
    /// taken away from this process meanwhile is quarantined until then, so that such writes
    /// land in no other producer's batch; after that the slot may be anyone's.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ring.slot_ptr(self.slot)
    }

    /// The slot as a mutable slice.
    ///
    /// # Safety
    /// 1. No other process writes this slot while the slice lives (true for cooperating
    ///    processes: the slot is this claim's until published or dropped, and quarantined
    ///    while this process may still write it).
    /// 2. The slice is not used after the claim is published or dropped (see
    ///    [`Claim::as_mut_ptr`]).
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        let cap = self.capacity() as usize;
        // SAFETY: the slot's memory is inside the mapping; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), cap) }
    }

    /// Copies `data` into the slot at `offset`.
    ///
    /// # Errors
    /// [`Error::TooLarge`] past the slot's end; [`Error::Detached`] (nothing written) when a
    /// peer detached this process or took the claim away (it was silent for a whole lease);
    /// [`Error::Forked`].
    /// A copy that began before this process was stopped ends in its own quarantined slot,
    /// which nobody uses until this claim drops.
    pub fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        if !self.ring.in_owner() {
            return self.ring.check_attached();
        }
        let end = offset.checked_add(data.len() as u64);
        if end.is_none_or(|e| e > self.capacity()) {
            return Err(Error::TooLarge {
                len: offset.saturating_add(data.len() as u64),
                capacity: self.capacity(),
            });
        }
        if !self.ring.holds(self.slot, self.word) {
            return Err(self.ring.detached());
        }
        // SAFETY: in bounds (checked); the slot is ours, or quarantined from us (nobody else's
        // until this claim drops); data is private memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.as_mut_ptr().add(offset as usize),
                data.len(),
            )
        };
        Ok(())
    }

    /// Sets the batch's length (bytes a consumer will see).
    pub fn set_len(&mut self, len: u64) -> Result<()> {
        if len > self.capacity() {
            return Err(Error::TooLarge {
                len,
                capacity: self.capacity(),
            });
        }
        self.len = len;
        Ok(())
    }

    /// Hands the batch to the consumers.
    ///
    /// # Errors
    /// [`Error::Detached`] (nothing published) when a peer took the claim away (this process
    /// was silent for a whole lease: stopped?); [`Error::SlotLost`] if that happened within
    /// this call; [`Error::Forked`]. A claim that fails lets go of its slot.
    pub fn publish(mut self) -> Result<()> {
        let ring = self.ring;
        ring.check_attached()?;
        if !ring.holds(self.slot, self.word) {
            return Err(ring.detached());
        }
        // Into our slot, or (stopped right here) our quarantined one, which nobody else uses.
        ring.slot_u64(self.slot, layout::SLOT_LEN)
            .store(self.len, Ordering::Relaxed);
        let seq = ring
            .u64_at(layout::OFF_PUBLISH)
            .fetch_add(1, Ordering::Relaxed);
        ring.slot_u64(self.slot, layout::SLOT_SEQ)
            .store(seq, Ordering::Relaxed);
        if !state::publish(ring.ctl(self.slot), self.word) {
            // Dropping `self` lets go of the quarantined slot.
            return Err(ring
                .check_attached()
                .err()
                .unwrap_or(Error::SlotLost { slot: self.slot }));
        }
        self.done = true;
        ring.bump(layout::OFF_READY_SEQ, OFF_READY_WAITERS);
        Ok(())
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        // In a forked child the claim is the parent's: leave it.
        if !self.done && self.ring.in_owner() {
            self.ring.let_go(self.slot, self.word);
        }
    }
}

/// This process as a registered consumer of a ring; marked as left when dropped (producers
/// then count it gone; its entry is free for a new consumer).
#[derive(Debug)]
pub struct Consumer<'r> {
    ring: &'r BatchRing,
    entry: usize,
}

impl<'r> Consumer<'r> {
    /// Takes the oldest published batch without waiting.
    ///
    /// # Errors
    /// [`Error::Forked`], [`Error::Detached`].
    pub fn try_next(&self) -> Result<Option<Batch<'r>>> {
        let ring = self.ring;
        ring.check_attached()?;
        loop {
            let oldest = state::oldest_ready(
                ring.layout.slots,
                |slot| ring.ctl(slot),
                |slot| {
                    ring.slot_u64(slot, layout::SLOT_SEQ)
                        .load(Ordering::Relaxed)
                },
            );
            let Some((_, slot, seen)) = oldest else {
                return Ok(None);
            };
            let Some(word) = state::try_take(ring.ctl(slot), seen, ring.me_ref) else {
                continue; // another consumer took it; look again
            };
            let len = ring
                .slot_u64(slot, layout::SLOT_LEN)
                .load(Ordering::Relaxed);
            if len > ring.layout.slot_bytes {
                tracing::warn!(slot, len, "dropping a batch whose length exceeds its slot");
                ring.free_word(slot, word);
                continue;
            }
            return Ok(Some(Batch {
                ring,
                slot,
                word,
                len,
            }));
        }
    }

    /// Takes the oldest published batch, waiting up to `timeout`; slots of producers that are
    /// gone are freed while waiting.
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`Error::ProducerGone`] when producers registered
    /// ([`BatchRing::producer`]), every one of them died or left and stayed so for a quarter
    /// of a second, and no batch is left;
    /// [`Error::Forked`], [`Error::Detached`].
    pub fn next(&self, timeout: Duration) -> Result<Batch<'r>> {
        let ring = self.ring;
        let deadline = Instant::now() + timeout;
        let mut gone = GoneFor::default();
        loop {
            if let Some(b) = self.try_next()? {
                return Ok(b);
            }
            ring.reap();
            if gone.long_enough(ring.all_gone(Role::Producer)) {
                // A producer publishes before it leaves: seen gone, anything it published is
                // visible now.
                return match self.try_next()? {
                    Some(b) => Ok(b),
                    None => Err(Error::ProducerGone),
                };
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: "a batch",
                    ms: timeout.as_millis(),
                });
            }
            ring.u32_at(OFF_READY_WAITERS)
                .fetch_add(1, Ordering::SeqCst);
            let seen = ring.u32_at(layout::OFF_READY_SEQ).load(Ordering::SeqCst);
            if let Some(b) = self.try_next()? {
                ring.u32_at(OFF_READY_WAITERS)
                    .fetch_sub(1, Ordering::SeqCst);
                return Ok(b);
            }
            ring.wait(
                layout::OFF_READY_SEQ,
                OFF_READY_WAITERS,
                seen,
                (deadline - now).min(WAIT_SLICE),
            );
        }
    }
}

impl Consumer<'_> {
    /// Publishes `watermark` as the ring's (all of it: the window, a round begun or ended,
    /// its position), so that producers can pace themselves ([`Watermark`]), and wakes the
    /// producers waiting on it. One consumer of a ring should publish: two that publish
    /// at once leave producers a watermark that may be either's (still only a hint).
    ///
    /// # Errors
    /// [`Error::Forked`], [`Error::Detached`] (nothing published).
    pub fn publish_watermark(&self, watermark: Watermark) -> Result<()> {
        self.ring.check_attached()?;
        self.ring.wm_words().publish(watermark.fields());
        self.ring.wake_watermark_waiters();
        Ok(())
    }

    /// Moves the watermark's position up to `position` (never down: a maximum, as
    /// `fetch_max`), keeping its round and window, and wakes the producers waiting on it.
    ///
    /// # Errors
    /// [`Error::Forked`], [`Error::Detached`] (nothing published).
    pub fn advance_watermark(&self, position: u64) -> Result<()> {
        self.ring.check_attached()?;
        self.ring.wm_words().advance(position);
        self.ring.wake_watermark_waiters();
        Ok(())
    }
}

impl Drop for Consumer<'_> {
    fn drop(&mut self) {
        self.ring.leave(Role::Consumer, self.entry);
    }
}

/// This process as a registered producer of a ring ([`BatchRing::producer`]); marked as
/// left when dropped.
#[derive(Debug)]
pub struct Producer<'r> {
    ring: &'r BatchRing,
    entry: usize,
}

impl Drop for Producer<'_> {
    fn drop(&mut self) {
        self.ring.leave(Role::Producer, self.entry);
    }
}

/// The two tables of registered members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Consumer,
    Producer,
}

impl Role {
    fn table(self) -> usize {
        match self {
            Role::Consumer => layout::OFF_CONSUMERS,
            Role::Producer => layout::OFF_PRODUCERS,
        }
    }

    fn max(self) -> usize {
        match self {
            Role::Consumer => MAX_CONSUMERS,
            Role::Producer => MAX_PRODUCERS,
        }
    }
}

/// A published batch taken by this consumer; the slot is released when it drops.
#[derive(Debug)]
pub struct Batch<'r> {
    ring: &'r BatchRing,
    slot: u32,
    word: u64,
    len: u64,
}

impl Batch<'_> {
    /// The slot's index.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The batch's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Offset of the batch's first byte in the segment (for a copy from a registered segment).
    pub fn offset_in_segment(&self) -> u64 {
        self.ring.layout.slot_offset(self.slot)
    }

    /// The batch's first byte. Its bytes stay this batch's until the `Batch` drops, also when
    /// a peer took it away from this process meanwhile (quarantined: see [`BatchRing`]).
    pub fn as_ptr(&self) -> *const u8 {
        self.ring.slot_ptr(self.slot)
    }

    /// The batch as a slice.
    ///
    /// # Safety
    /// 1. No other process writes this slot while the slice lives (true for cooperating
    ///    processes: the slot is this consumer's until the batch drops, quarantined while
    ///    this process may still read it).
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: inside the mapping; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len as usize) }
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the batch.
    ///
    /// # Errors
    /// [`Error::TooLarge`] past the batch's end; [`Error::Detached`] (nothing read) when a
    /// peer detached this process or took the batch away (it was silent for a whole lease:
    /// stopped?).
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(dst.len() as u64);
        if end.is_none_or(|e| e > self.len) {
            return Err(Error::TooLarge {
                len: offset.saturating_add(dst.len() as u64),
                capacity: self.len,
            });
        }
        if !self.ring.holds(self.slot, self.word) {
            return Err(self.ring.detached());
        }
        self.copy_out(offset, dst);
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` (in bounds: checked by the callers).
    fn copy_out(&self, offset: u64, dst: &mut [u8]) {
        debug_assert!(offset + dst.len() as u64 <= self.len);
        // SAFETY: in bounds of the batch (the callers check); the slot is this batch's, or
        // quarantined from it (refilled by nobody until this batch drops); dst is private
        // memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.as_ptr().add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
    }

    /// The batch copied into a `Vec`: this batch's bytes, also after a peer took it away
    /// (quarantined, so never refilled under this copy; [`Batch::read_at`] says
    /// [`Error::Detached`] then).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len as usize];
        self.copy_out(0, &mut v);
        v
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        // In a forked child the batch is the parent's: leave it.
        if self.ring.in_owner() {
            self.ring.let_go(self.slot, self.word);
        }
    }
}
