//! Ranks of one job on one machine meeting through shared memory: [`Rendezvous`].
//!
//! Rank 0 creates the segment `name`; the others open it once rank 0 has initialised it. What
//! the name held before is judged first: a crashed job's leftover (of any world size) is
//! replaced by rank 0 and waited past by the others, a live job's segment is never removed
//! ([`Error::RendezvousInUse`]) and another user's file never touched
//! ([`Error::RendezvousSquatted`]). A rank 0 that holds its lock, or whose pid (with its start
//! time) lives in our PID namespace, is alive however long it has been silent: a stopped job
//! (SIGSTOP, a debugger, `docker pause`) keeps its name, and the other ranks wait until its
//! heartbeat moves before they join it. Only a rank 0 whose liveness nothing else can tell (no
//! lock published — no /proc where it ran — and a pid of another or unknown PID namespace) is
//! judged by its heartbeat: silent for its lease, it counts as a leftover, since a name taken
//! for ever by a dead process would stop every later job. Each rank owns a record: its
//! state, identity (PID namespace, pid, start time), a lock on the record's first byte held
//! through a file description of its own (released by the kernel when the rank dies, in any
//! PID namespace), a heartbeat counter renewed by a thread, the last barrier it reached, and
//! two payload buffers used in turn by [`Rendezvous::exchange`]. A barrier waits
//! until every rank has reached it (asleep on a futex in the segment that every arrival and
//! departure wakes), and fails with the rank's number when a rank never arrives within the join
//! timeout, left (its `Rendezvous` was dropped, as after an error), or died: a rank of our PID
//! namespace is known dead by its pid, any rank by a heartbeat that stood still for a whole
//! lease. Once every rank has joined (or when its handle drops before that), rank 0 removes the
//! name, so the segment is not left in /dev/shm when the job ends, however it ends — only while
//! the name still refers to its own segment, under the lock a replacing rank 0 takes
//! ([`REPLACE_LOCK_BYTE`]), so that a rank 0 that resumes after a new job replaced it never
//! removes the new job's name. A rank that owns something the others hold (GPU
//! memory they map) gives it back only after they let go of it:
//! [`Rendezvous::wait_until_departed`] waits for every other rank's handle to be dropped (or
//! [`Rendezvous::depart`]). [`Rendezvous::share_fd`] passes a file descriptor from every rank
//! to every other over Unix sockets, each in a private directory (0700) in /dev/shm, with the
//! peers' credentials checked, each removed before the call returns (a rank killed inside the
//! call leaves its directory behind: `.gpufeed-fd-*`, which [`remove_stale_sockets`] —
//! `gpufeed shm gc` — removes once it is an hour old).

use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::fd::AsFd;

use gpufeed_os::ShmSegment;
use gpufeed_os::process::{Liveness, ProcessIdentity};
use gpufeed_os::shm::{ForeignSegments, GcReport};
use parking_lot::{Condvar, Mutex};
use rustix::thread::futex;

use crate::error::{Error, Result};
use crate::fdpass::{recv_fd, send_fd};
use crate::oflock::{self, ByteLock, ExclusiveLock, Probe};
use crate::sockdir::{self, SOCKET_PREFIX};
use crate::state::{AtomicU64, Ordering};

/// Most ranks of one rendezvous.
pub const MAX_RANKS: usize = 256;
/// Most bytes a rank passes in one [`Rendezvous::exchange`].
pub const MAX_PAYLOAD: usize = 1024;

/// Layout 2: records of 128 bytes before the payloads, each rank's flags (its lock), rank 0's
/// identity written before the magic, rank 0's lease in the header.
const MAGIC: u64 = u64::from_le_bytes(*b"GFRDV002");
/// Layout 1 (records of 64 bytes before the payloads, no locks): recognised so that a
/// leftover of an older gpufeed is judged, replaced and collected, never joined.
const MAGIC_V1: u64 = u64::from_le_bytes(*b"GFRDV001");
const HEADER: usize = 256;
const OFF_WORLD: usize = 8;
const OFF_NONCE: usize = 16;
/// A futex word bumped by every arrival at a barrier and every departure, and the number of
/// ranks asleep on it (a bump wakes them only when someone sleeps).
const OFF_ARRIVALS: usize = 24;
const OFF_SLEEPERS: usize = 28;
/// A bit per rank, set when it departs ([`Rendezvous::depart`]): `MAX_RANKS` bits.
const OFF_DEPARTED: usize = 32;
/// Rank 0's lease in milliseconds, for judging its silence from outside the job.
const OFF_LEASE_MS: usize = 64;
/// The byte of the segment that rank 0 of a new job, or `gpufeed shm gc`, holds a write lock
/// on while it replaces or removes a leftover (so that two of them never remove each other's
/// new segment).
const REPLACE_LOCK_BYTE: u64 = 0;
/// Longest single sleep in a barrier: the other ranks' liveness is judged at least this often.
const SLICE: Duration = Duration::from_millis(20);
const REC: usize = 128 + 2 * MAX_PAYLOAD;
const REC_V1: usize = 64 + 2 * MAX_PAYLOAD;
const R_STATE: usize = 0;
const R_BEAT: usize = 8;
const R_PID_NS: usize = 16;
const R_PID: usize = 24;
const R_START: usize = 32;
const R_EPOCH: usize = 40;
const R_LEN: usize = 48; // two words: the payload lengths of even and odd exchanges
/// [`FLAG_LOCKED`] when the rank holds a read lock on its record's first byte for as long as
/// it is in the rendezvous (through a file description of its own; see `oflock`).
const R_FLAGS: usize = 64;
const R_PAYLOAD: usize = 128;
const FLAG_LOCKED: u64 = 1;

const EMPTY: u64 = 0;
const PRESENT: u64 = 1;
const LEFT: u64 = 2;

/// How a [`Rendezvous`] waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RendezvousOptions {
    /// How long a rank waits for every other rank to arrive (30 s): a rank that has not joined
    /// by then is named in [`Error::RankNeverArrived`].
    pub join_timeout: Duration,
    /// How long a rank's heartbeat may stand still before the others judge it dead (2 s; it
    /// beats every lease / 8). Barriers otherwise wait as long as every rank lives: a rank
    /// busy loading for minutes is not a dead one.
    pub lease: Duration,
}

impl Default for RendezvousOptions {
    fn default() -> Self {
        RendezvousOptions {
            join_timeout: Duration::from_secs(30),
            lease: Duration::from_secs(2),
        }
    }
}

impl RendezvousOptions {
    /// These options with `join_timeout`.
    pub fn with_join_timeout(mut self, t: Duration) -> Self {
        self.join_timeout = t;
        self
    }

    /// These options with `lease` (at least 50 ms).
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(50));
        self
    }
}

/// One rank's handle on a rendezvous of `world` ranks on this machine (the processes of one
/// job, as `torchrun` starts them: `LOCAL_RANK` of `LOCAL_WORLD_SIZE`).
///
/// # Example
/// ```
/// use gpufeed_ipc::{Rendezvous, RendezvousOptions};
/// // A job of one rank (each process of a real job passes its own rank and the same name).
/// let name = format!("gpufeed-doc-{}", std::process::id());
/// let r = Rendezvous::join(&name, 0, 1, RendezvousOptions::default())?;
/// let all = r.exchange(b"my IPC handle")?;
/// assert_eq!(all, vec![b"my IPC handle".to_vec()]);
/// r.barrier()?;
/// # Ok::<(), gpufeed_ipc::Error>(())
/// ```
pub struct Rendezvous {
    seg: ShmSegment,
    rank: usize,
    world: usize,
    opts: RendezvousOptions,
    joined: Instant,
    epoch: std::sync::atomic::AtomicU64,
    heartbeat: Option<std::thread::JoinHandle<()>>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    /// The lock on this rank's record byte, held until the handle drops.
    _lock: Option<ByteLock>,
    /// Whether this handle took its rank's record: only then does dropping it depart (a join
    /// refused with `RankTaken` must leave the holder's record alone).
    claimed: bool,
    /// Whether this handle made the segment under its name and has not removed the name yet
    /// (rank 0 until every rank joined): dropping it removes the name ([`release_name`]).
    named: bool,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

impl Rendezvous {
    /// Joins the rendezvous `name` (a shared-memory name: the same for every rank of a job and
    /// different from any other job's) as `rank` of `world`, and waits until every rank has
    /// joined.
    ///
    /// What is found under the name first: a segment whose rank 0 is dead (its lock released,
    /// or its pid gone), or left — a crashed job's leftover, of whatever world size or layout
    /// — is replaced by rank 0 and waited past by the others; so is one whose rank 0 nothing
    /// but its heartbeat can judge (it took no lock, and its pid is of another PID namespace)
    /// once that stood still for its lease. A segment whose rank 0 lives — its lock held, or
    /// its pid alive here, even if stopped — is never removed: rank 0 fails at once with
    /// [`Error::RendezvousInUse`], the others join it only if its world is theirs and once its
    /// heartbeat moves (a stopped rank 0 is waited for, within the join timeout). A file of
    /// another user is never touched ([`Error::RendezvousSquatted`], at once, for every rank).
    /// Rank 0 removes the name once every rank joined, or when it fails before, only while the
    /// name still refers to its segment.
    ///
    /// # Errors
    /// [`Error::InvalidLayout`] for a rank outside the world, a world of 0 or more than
    /// [`MAX_RANKS`], or a world other than the live rank 0's; [`Error::RendezvousInUse`],
    /// [`Error::RendezvousSquatted`]; [`Error::RankTaken`];
    /// [`Error::RankNeverArrived`], [`Error::RankDied`], [`Error::RankLeft`]; shared-memory
    /// errors.
    pub fn join(name: &str, rank: usize, world: usize, opts: RendezvousOptions) -> Result<Self> {
        if world == 0 || world > MAX_RANKS || rank >= world {
            return Err(Error::InvalidLayout(format!(
                "rank {rank} of a world of {world}: ranks are 0..world, world 1..={MAX_RANKS}"
            )));
        }
        let joined = Instant::now();
        let (seg, lock) = if rank == 0 {
            create(name, world, joined, opts)?
        } else {
            let seg = open(name, world, joined, opts)?;
            let lock = ByteLock::take(seg.as_fd(), (HEADER + rank * REC) as u64);
            (seg, lock)
        };
        let locked = lock.is_some();
        let mut r = Rendezvous {
            seg,
            rank,
            world,
            opts,
            joined,
            epoch: std::sync::atomic::AtomicU64::new(0),
            heartbeat: None,
            stop: Arc::new((Mutex::new(false), Condvar::new())),
            _lock: lock,
            claimed: false,
            named: rank == 0,
        };
        r.claim(locked)?;
        r.claimed = true;
        r.start_heartbeat()?;
        r.barrier()?;
        if rank == 0 {
            // Everyone has it mapped: the name is no longer needed.
            r.named = false;
            release_name(&r.seg)?;
        }
        Ok(r)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Leaves the rendezvous now (as dropping it does): the other ranks' next barrier fails
    /// naming this rank, and this handle's own barriers fail from here on. For a rank that hit
    /// an error in the middle of a collective step, so that the others do not wait for it.
    pub fn leave(&self) {
        self.word(self.rank, R_STATE).store(LEFT, Ordering::Release);
        self.bump();
    }

    /// Departs for good: leaves the rendezvous (as [`Rendezvous::leave`]) and tells the other
    /// ranks that this rank holds nothing of theirs any more, which their
    /// [`Rendezvous::wait_until_departed`] waits for. Dropping the handle departs too.
    pub fn depart(&self) {
        let bit = 1u64 << (self.rank % 64);
        word(&self.seg, OFF_DEPARTED + 8 * (self.rank / 64)).fetch_or(bit, Ordering::AcqRel);
        self.leave();
    }

    /// Waits at most `timeout` until every other rank has departed ([`Rendezvous::depart`],
    /// or its handle dropped) or died; `true` if they all have. The others do not wait for
    /// this rank: for a rank that must not give back what the others hold (memory they map)
    /// before they let go of it, when the ranks end at their own times. A rank that only left
    /// ([`Rendezvous::leave`], as after an error) is still waited for.
    pub fn wait_until_departed(&self, timeout: Duration) -> bool {
        let started = Instant::now();
        let mut seen = self.heartbeats();
        loop {
            let arrivals = self
                .u32_at(OFF_ARRIVALS)
                .load(std::sync::atomic::Ordering::SeqCst);
            let staying = (0..self.world)
                .filter(|&r| r != self.rank)
                .any(|r| !self.departed(r) && self.dead(r, &mut seen[r]).is_none());
            if !staying {
                return true;
            }
            let Some(left) = timeout.checked_sub(started.elapsed()) else {
                return false;
            };
            self.sleep(arrivals, left.min(SLICE));
        }
    }

    /// A watch over the other ranks, for a rank that waits on something other than this
    /// rendezvous (a collective of another library, such as NCCL, that would wait forever for
    /// a rank that is gone): [`RankWatch::check`] fails naming a rank that left or died.
    ///
    /// # Example
    /// ```
    /// use gpufeed_ipc::{Rendezvous, RendezvousOptions};
    /// let name = format!("gpufeed-doc-watch-{}", std::process::id());
    /// let r = Rendezvous::join(&name, 0, 1, RendezvousOptions::default())?;
    /// let mut watch = r.watch();
    /// // ... poll the other library's work, and between polls:
    /// watch.check()?;
    /// # Ok::<(), gpufeed_ipc::Error>(())
    /// ```
    pub fn watch(&self) -> RankWatch<'_> {
        RankWatch {
            rdv: self,
            seen: self.heartbeats(),
        }
    }

    fn departed(&self, r: usize) -> bool {
        let bits = word(&self.seg, OFF_DEPARTED + 8 * (r / 64)).load(Ordering::Acquire);
        bits & (1 << (r % 64)) != 0
    }

    /// Waits until every rank has reached this barrier (each rank's n-th call meets the
    /// others' n-th).
    ///
    /// # Errors
    /// [`Error::RankNeverArrived`] (a rank that never joined, after the join timeout),
    /// [`Error::RankLeft`] (this rank too, after [`Rendezvous::leave`]), [`Error::RankDied`].
    pub fn barrier(&self) -> Result<()> {
        if self.word(self.rank, R_STATE).load(Ordering::Acquire) == LEFT {
            return Err(Error::RankLeft { rank: self.rank });
        }
        let k = self
            .epoch
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        self.word(self.rank, R_EPOCH).store(k, Ordering::Release);
        self.bump();
        self.wait_for(k)
    }

    /// Passes `payload` (at most [`MAX_PAYLOAD`] bytes) to every rank and returns every
    /// rank's, in rank order: a barrier that carries data (CUDA IPC handles, a plan's hash).
    ///
    /// # Errors
    /// [`Error::TooLarge`] for a payload over [`MAX_PAYLOAD`]; [`Rendezvous::barrier`]'s.
    pub fn exchange(&self, payload: &[u8]) -> Result<Vec<Vec<u8>>> {
        if payload.len() > MAX_PAYLOAD {
            return Err(Error::TooLarge {
                len: payload.len() as u64,
                capacity: MAX_PAYLOAD as u64,
            });
        }
        // The exchange's barrier number: its parity picks the buffer. A rank writes buffer p
        // again two exchanges later, after every rank passed the barrier in between, so after
        // every rank read it.
        let k = self.epoch.load(std::sync::atomic::Ordering::Relaxed) + 1;
        let parity = (k % 2) as usize;
        self.seg.write_at(
            self.rec(self.rank) + R_PAYLOAD + parity * MAX_PAYLOAD,
            payload,
        )?;
        self.word(self.rank, R_LEN + 8 * parity)
            .store(payload.len() as u64, Ordering::Relaxed);
        self.barrier()?;
        (0..self.world)
            .map(|r| {
                let len = self.word(r, R_LEN + 8 * parity).load(Ordering::Acquire) as usize;
                if len > MAX_PAYLOAD {
                    return Err(Error::InvalidHeader(format!(
                        "rank {r} passed {len} bytes, more than {MAX_PAYLOAD}"
                    )));
                }
                let mut out = vec![0u8; len];
                self.seg
                    .read_at(self.rec(r) + R_PAYLOAD + parity * MAX_PAYLOAD, &mut out)?;
                Ok(out)
            })
            .collect()
    }

    /// Passes `fd` to every other rank and returns theirs in rank order (`None` in this rank's
    /// place): a collective call like [`Rendezvous::exchange`], for what only a descriptor can
    /// carry (a CUDA memory pool exported as a POSIX file descriptor, a memfd). Each rank
    /// listens on a Unix socket in a private directory of its own in /dev/shm (the directory
    /// the rendezvous already shares; mode 0700, a random name that the ranks learn through
    /// the rendezvous; removed before the call returns) and connects to every other rank's;
    /// descriptors travel as `SCM_RIGHTS`, so ranks in other PID or network namespaces that
    /// share /dev/shm are reached too.
    ///
    /// Who is at the other end is checked (`SO_PEERCRED`) before anything is sent or
    /// trusted: a connection of another user is refused (logged, given nothing; the call goes
    /// on), and a process of our user that claims a rank whose pid (in our PID namespace) it
    /// does not have, or a rank served twice, or a listener that is not the rank it should be,
    /// fails the call with [`Error::FdImpostor`] naming it.
    ///
    /// # Example
    /// ```
    /// use std::os::fd::AsFd;
    /// use gpufeed_ipc::{Rendezvous, RendezvousOptions};
    /// let name = format!("gpufeed-doc-fd-{}", std::process::id());
    /// let r = Rendezvous::join(&name, 0, 1, RendezvousOptions::default())?;
    /// let file = std::fs::File::open("/dev/null").expect("open");
    /// let theirs = r.share_fd(file.as_fd())?;
    /// assert!(theirs[0].is_none()); // a world of one: nobody else's
    /// # Ok::<(), gpufeed_ipc::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Rendezvous::barrier`]'s (a rank that died, left or never arrived, named);
    /// [`Error::FdPass`] naming a rank whose socket refused or closed the connection;
    /// [`Error::FdImpostor`]; [`Error::Timeout`] when a live rank did not connect within the
    /// join timeout.
    pub fn share_fd(&self, fd: BorrowedFd<'_>) -> Result<Vec<Option<OwnedFd>>> {
        use std::io::{Read, Write};
        let (me, world) = (self.rank, self.world);
        let mut out: Vec<Option<OwnedFd>> = (0..world).map(|_| None).collect();
        if world == 1 {
            return Ok(out);
        }
        // The barrier this call is about to take, and the job's nonce: a name no other call or
        // job uses (the directory adds a random part).
        let k = self.epoch.load(std::sync::atomic::Ordering::Relaxed) + 1;
        let nonce = word(&self.seg, OFF_NONCE).load(Ordering::Relaxed);
        let stem = |r: usize| format!("{SOCKET_PREFIX}{nonce:016x}-{k}-{r}");
        let shm = std::path::Path::new(gpufeed_os::shm::DEFAULT_DIR);
        let mine = sockdir::PrivateDir::create(shm, &stem(me))?;
        let listener = sockdir::listen_at(&mine.socket_path(), MAX_RANKS)?;
        // Every rank learns where the others listen, once all of them do.
        let dirs = self.exchange(mine.name().as_bytes())?;
        let fail = |rank: usize| move |source: std::io::Error| Error::FdPass { rank, source };
        let mut inbound = Vec::with_capacity(world - 1);
        for r in (0..world).filter(|&r| r != me) {
            let name = std::str::from_utf8(&dirs[r])
                .ok()
                .filter(|n| n.starts_with(&format!("{}-", stem(r))) && !n.contains('/'))
                .ok_or_else(|| {
                    Error::InvalidHeader(format!(
                        "rank {r} named its descriptor socket {:?}",
                        String::from_utf8_lossy(&dirs[r])
                    ))
                })?;
            let mut s = UnixStream::connect(sockdir::socket_in(shm, name)).map_err(fail(r))?;
            // The listener's credentials are those it had when it listened.
            let cred = sockdir::peer_cred(&s).map_err(fail(r))?;
            if let Some(why) = self.not_rank(r, cred) {
                return Err(impostor(
                    r,
                    cred,
                    format!("listened in rank {r}'s place ({why})"),
                ));
            }
            s.write_all(&(me as u32).to_le_bytes()).map_err(fail(r))?;
            s.set_nonblocking(true).map_err(fail(r))?;
            inbound.push((r, s));
        }
        let mut served = vec![false; world];
        served[me] = true;
        let mut seen = self.heartbeats();
        let started = Instant::now();
        let mut nap = Duration::from_micros(50);
        let mut pending: Vec<usize> = (0..world).filter(|&r| r != me).collect();
        loop {
            // The ranks still owed or owing are judged before this round's accepts and reads,
            // and their verdicts count only for those still pending after them: a rank whose
            // part is done (it sent its descriptor, got ours) may leave at once, and the
            // descriptor it sent before it left is read here rather than called lost.
            let mut verdicts: Vec<Option<Error>> = (0..world).map(|_| None).collect();
            for &r in &pending {
                verdicts[r] = self.judge(r, &mut seen[r]).err();
            }
            // Answer every rank that connected with this rank's descriptor.
            loop {
                let mut s = match listener.accept() {
                    Ok((s, _)) => s,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(source) => {
                        return Err(Error::Io {
                            op: "accept a rank's connection",
                            source,
                        });
                    }
                };
                let Ok(cred) = sockdir::peer_cred(&s) else {
                    tracing::warn!(
                        "refused a connection to rank {me}'s descriptor socket whose credentials cannot be read"
                    );
                    continue;
                };
                if cred.uid != our_uid() {
                    // Our private directory keeps other users out; one that got in anyway
                    // (root, for a job of another user) is given nothing.
                    tracing::warn!(
                        pid = cred.pid,
                        uid = cred.uid,
                        "refused a connection of another user to rank {me}'s descriptor socket"
                    );
                    continue;
                }
                // The rank wrote its number before this accept could see it; a connection
                // that says nothing (its process died at once) is judged below by its rank's
                // liveness.
                let mut who = [0u8; 4];
                let said = s
                    .set_nonblocking(false)
                    .and_then(|()| s.set_read_timeout(Some(self.opts.lease)))
                    .and_then(|()| s.read_exact(&mut who));
                let r = u32::from_le_bytes(who) as usize;
                if said.is_err() || r >= world || r == me {
                    tracing::warn!(
                        pid = cred.pid,
                        "ignored a connection to rank {me}'s descriptor socket that named no other rank"
                    );
                    continue;
                }
                if served[r] {
                    return Err(impostor(
                        r,
                        cred,
                        format!(
                            "asked for rank {me}'s descriptor as rank {r}, which was given it already"
                        ),
                    ));
                }
                if let Some(why) = self.not_rank(r, cred) {
                    return Err(impostor(
                        r,
                        cred,
                        format!("asked for rank {me}'s descriptor as rank {r} ({why})"),
                    ));
                }
                send_fd(&s, fd).map_err(|e| match e {
                    Error::Io { source, .. } => Error::FdPass { rank: r, source },
                    other => other,
                })?;
                served[r] = true;
            }
            for (r, s) in &inbound {
                if out[*r].is_some() {
                    continue;
                }
                match recv_fd(s) {
                    Ok(theirs) => out[*r] = Some(theirs),
                    Err(Error::Io { source, .. })
                        if source.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(Error::Io { source, .. }) => {
                        return Err(Error::FdPass { rank: *r, source });
                    }
                    Err(e) => return Err(e),
                }
            }
            pending.retain(|&r| !served[r] || out[r].is_none());
            if pending.is_empty() {
                return Ok(out);
            }
            if let Some(e) = pending.iter().find_map(|&r| verdicts[r].take()) {
                return Err(e);
            }
            if started.elapsed() > self.opts.join_timeout {
                return Err(Error::Timeout {
                    what: "the other ranks' descriptors",
                    ms: started.elapsed().as_millis(),
                });
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
        }
    }

    /// Why a peer with credentials `cred` is not rank `r`, if it is not: another user, or
    /// (where rank `r` lives in our PID namespace, so that its pid means something here)
    /// another pid than the one rank `r` joined with.
    fn not_rank(&self, r: usize, cred: sockdir::PeerCred) -> Option<String> {
        if cred.uid != our_uid() {
            return Some(format!("uid {} is not ours, {}", cred.uid, our_uid()));
        }
        let id = self.identity(r);
        let ours = gpufeed_os::process::current_pid_ns();
        (id.pid != 0 && ours != 0 && id.pid_ns == ours && cred.pid != id.pid)
            .then(|| format!("rank {r} is pid {}", id.pid))
    }

    fn rec(&self, rank: usize) -> usize {
        HEADER + rank * REC
    }

    fn word(&self, rank: usize, field: usize) -> &AtomicU64 {
        word(&self.seg, self.rec(rank) + field)
    }

    /// Takes this rank's record (EMPTY -> PRESENT), or fails naming the live holder.
    fn claim(&self, locked: bool) -> Result<()> {
        let me = ProcessIdentity::current();
        let state = self.word(self.rank, R_STATE);
        if let Err(now) =
            state.compare_exchange(EMPTY, PRESENT, Ordering::AcqRel, Ordering::Acquire)
        {
            let holder = self.identity(self.rank);
            return Err(Error::RankTaken {
                rank: self.rank,
                pid: holder.pid,
                left: now == LEFT,
            });
        }
        publish_identity(&self.seg, self.rec(self.rank), &me, locked);
        Ok(())
    }

    fn identity(&self, rank: usize) -> ProcessIdentity {
        ProcessIdentity {
            pid_ns: self.word(rank, R_PID_NS).load(Ordering::Acquire),
            pid: self.word(rank, R_PID).load(Ordering::Acquire) as u32,
            start_ticks: self.word(rank, R_START).load(Ordering::Acquire),
        }
    }

    fn start_heartbeat(&mut self) -> Result<()> {
        let beat = self.word(self.rank, R_BEAT) as *const AtomicU64 as usize;
        let period = (self.opts.lease / 8).max(Duration::from_millis(5));
        let stop = Arc::clone(&self.stop);
        let thread = std::thread::Builder::new()
            .name("gpufeed-rendezvous".into())
            .spawn(move || {
                // SAFETY: the word lies in the segment's mapping, which `Rendezvous::drop`
                // keeps mapped until this thread has been joined; it is only accessed
                // atomically.
                let beat = unsafe { &*(beat as *const AtomicU64) };
                let (lock, cv) = &*stop;
                let mut stopped = lock.lock();
                while !*stopped {
                    beat.fetch_add(1, Ordering::Relaxed);
                    cv.wait_for(&mut stopped, period);
                }
            })
            .map_err(|source| Error::Io {
                op: "spawn the rendezvous heartbeat thread",
                source,
            })?;
        self.heartbeat = Some(thread);
        Ok(())
    }

    /// Waits until every rank's barrier count is at least `k`: asleep on the arrivals futex,
    /// which every arrival and departure bumps, judging the ranks still missing at least every
    /// [`SLICE`]. (Naps of up to 2 ms, before, woke a rank a millisecond after the last
    /// arrival at the median; the futex, 4 us: bench table 5 on the 2-core dev VM.)
    fn wait_for(&self, k: u64) -> Result<()> {
        let mut seen = self.heartbeats();
        loop {
            // Read before looking, so that an arrival after the look moves it and the sleep
            // below returns at once.
            let arrivals = self
                .u32_at(OFF_ARRIVALS)
                .load(std::sync::atomic::Ordering::SeqCst);
            let mut waiting = false;
            for (r, seen) in seen.iter_mut().enumerate() {
                if self.word(r, R_EPOCH).load(Ordering::Acquire) >= k {
                    continue;
                }
                if let Err(e) = self.judge(r, seen) {
                    // Arrived and left (its part done) between the look above and the verdict:
                    // its epoch was stored before it left, so the verdict's read sees it.
                    if self.word(r, R_EPOCH).load(Ordering::Acquire) >= k {
                        continue;
                    }
                    return Err(e);
                }
                waiting = true;
            }
            if !waiting {
                return Ok(());
            }
            self.sleep(arrivals, SLICE);
        }
    }

    /// Moves the arrivals futex and wakes the ranks asleep on it.
    fn bump(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        let arrivals = self.u32_at(OFF_ARRIVALS);
        arrivals.fetch_add(1, SeqCst);
        if self.u32_at(OFF_SLEEPERS).load(SeqCst) > 0 {
            let _ = futex::wake(arrivals, futex::Flags::empty(), i32::MAX as u32);
        }
    }

    /// Sleeps until the arrivals futex moves past `seen`, or for `slice` (at most a second).
    fn sleep(&self, seen: u32, slice: Duration) {
        use std::sync::atomic::Ordering::SeqCst;
        let sleepers = self.u32_at(OFF_SLEEPERS);
        sleepers.fetch_add(1, SeqCst);
        let ts = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: slice.min(Duration::from_millis(999)).as_nanos() as i64,
        };
        // EAGAIN (moved already), ETIMEDOUT and EINTR all mean: look again.
        let _ = futex::wait(
            self.u32_at(OFF_ARRIVALS),
            futex::Flags::empty(),
            seen,
            Some(&ts),
        );
        sleepers.fetch_sub(1, SeqCst);
    }

    fn u32_at(&self, off: usize) -> &std::sync::atomic::AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= HEADER);
        // SAFETY: the offsets used are fixed fields of the header, 4-aligned in a page-aligned
        // mapping that lives as long as the borrow; shared words are only accessed
        // atomically, by every process.
        unsafe { std::sync::atomic::AtomicU32::from_ptr(self.seg.as_ptr().add(off).cast()) }
    }

    /// Per rank: the heartbeat seen now, and now (what [`Rendezvous::judge`] compares with).
    fn heartbeats(&self) -> Vec<(u64, Instant)> {
        (0..self.world)
            .map(|r| (self.word(r, R_BEAT).load(Ordering::Relaxed), Instant::now()))
            .collect()
    }

    /// Fails naming rank `r` when it left, never joined within the join timeout, or died (its
    /// pid is gone, or its heartbeat stood still for a lease since `seen`, which is updated).
    fn judge(&self, r: usize, seen: &mut (u64, Instant)) -> Result<()> {
        match self.word(r, R_STATE).load(Ordering::Acquire) {
            LEFT => Err(Error::RankLeft { rank: r }),
            EMPTY => {
                let waited = self.joined.elapsed();
                if waited > self.opts.join_timeout {
                    return Err(Error::RankNeverArrived {
                        rank: r,
                        world: self.world,
                        waited_ms: waited.as_millis(),
                    });
                }
                Ok(())
            }
            _ => match self.dead(r, seen) {
                Some((pid, silent_ms)) => Err(Error::RankDied {
                    rank: r,
                    pid,
                    silent_ms,
                }),
                None => Ok(()),
            },
        }
    }

    /// Rank `r`'s pid and how long its heartbeat stood still, if it is dead: its pid is gone,
    /// or its heartbeat stood still for a lease since `seen` (which is updated).
    fn dead(&self, r: usize, seen: &mut (u64, Instant)) -> Option<(u32, u128)> {
        let beat = self.word(r, R_BEAT).load(Ordering::Relaxed);
        if beat != seen.0 {
            *seen = (beat, Instant::now());
        }
        let who = self.identity(r);
        let still = seen.1.elapsed();
        // pid 0: the rank has claimed its record but not yet published who it is (its
        // heartbeat still judges it).
        ((who.pid != 0 && who.is_dead()) || still > self.opts.lease)
            .then_some((who.pid, still.as_millis()))
    }
}

/// The other ranks of a [`Rendezvous`], watched while this rank waits on something else
/// ([`Rendezvous::watch`]).
#[derive(Debug)]
pub struct RankWatch<'a> {
    rdv: &'a Rendezvous,
    seen: Vec<(u64, Instant)>,
}

impl RankWatch<'_> {
    /// Fails naming another rank that left the rendezvous (as after an error) or died (its
    /// pid is gone, or its heartbeat stood still for a lease since the watch began or its
    /// last move was seen). Cheap: a few atomic loads per rank.
    ///
    /// # Errors
    /// [`Error::RankLeft`], [`Error::RankDied`].
    pub fn check(&mut self) -> Result<()> {
        let rdv = self.rdv;
        for (r, seen) in self.seen.iter_mut().enumerate() {
            if r != rdv.rank {
                rdv.judge(r, seen)?;
            }
        }
        Ok(())
    }
}

/// How old a `.gpufeed-fd-*` socket directory must be before `gpufeed shm gc` removes it (an
/// hour): a live [`Rendezvous::share_fd`] removes its own within its join timeout (30 s by
/// default), so one this old belongs to a rank killed inside the call.
pub const STALE_SOCKET_AGE: Duration = Duration::from_secs(3600);

/// Removes what ranks killed inside [`Rendezvous::share_fd`] left in `dir` (`/dev/shm` for a
/// job's ranks): the private socket directories `.gpufeed-fd-*` of this user with the socket
/// in each (and sockets of that name, which earlier versions made in `dir` itself) last
/// changed more than `older_than` ago (their names say nothing of their owner, so age is the
/// test; see [`STALE_SOCKET_AGE`]). Other files are left alone; one that cannot be removed
/// (`EPERM`, `EACCES`) is skipped with a warning and the others are still removed. Returns the
/// names removed.
///
/// # Errors
/// [`Error::Io`] when `dir` cannot be read.
pub fn remove_stale_sockets(dir: &std::path::Path, older_than: Duration) -> Result<Vec<String>> {
    Ok(gc_stale_sockets(dir, older_than)?.removed)
}

/// [`remove_stale_sockets`], saying also what it could not remove: the names removed in
/// [`GcReport::removed`], those that stay in [`GcReport::skipped`] with why.
///
/// # Errors
/// [`Error::Io`] when `dir` cannot be read.
pub fn gc_stale_sockets(dir: &std::path::Path, older_than: Duration) -> Result<GcReport> {
    sockdir::remove_stale(dir, older_than)
}

fn our_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

fn impostor(rank: usize, cred: sockdir::PeerCred, why: String) -> Error {
    tracing::warn!(rank, pid = cred.pid, uid = cred.uid, "{why}");
    Error::FdImpostor {
        rank,
        pid: cred.pid,
        uid: cred.uid,
        why,
    }
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        if self.named {
            // Before departing: a departed rank 0 is a leftover to a new job's rank 0.
            self.named = false;
            if let Err(e) = release_name(&self.seg) {
                tracing::warn!(%e, "could not remove the rendezvous name");
            }
        }
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
        if let Some(t) = self.heartbeat.take() {
            let _ = t.join();
        }
        if self.claimed {
            self.depart();
        }
    }
}

fn word(seg: &ShmSegment, off: usize) -> &AtomicU64 {
    debug_assert!(off.is_multiple_of(8) && off + 8 <= seg.len());
    // SAFETY: every offset used is a fixed field inside the segment (checked against its
    // length when it was opened), 8-aligned in a page-aligned mapping that lives as long as
    // the borrow; shared words are only accessed atomically, by every process.
    unsafe { AtomicU64::from_ptr(seg.as_ptr().add(off).cast()) }
}

fn segment_len(world: usize) -> usize {
    HEADER + world * REC
}

/// Writes `me` and its flags into the record at `rec` (the start time last, with Release).
fn publish_identity(seg: &ShmSegment, rec: usize, me: &ProcessIdentity, locked: bool) {
    let flags = if locked { FLAG_LOCKED } else { 0 };
    word(seg, rec + R_FLAGS).store(flags, Ordering::Relaxed);
    word(seg, rec + R_PID_NS).store(me.pid_ns, Ordering::Relaxed);
    word(seg, rec + R_PID).store(u64::from(me.pid), Ordering::Relaxed);
    word(seg, rec + R_START).store(me.start_ticks, Ordering::Release);
}

/// Rank 0: a fresh segment, and the lock on rank 0's record. What the name holds first: a
/// leftover nobody uses (see [`inspect`]) is removed (under [`REPLACE_LOCK_BYTE`], and only
/// if the name still refers to the file judged), a live rendezvous or another user's file is
/// an error, a segment not initialised yet is given a lease to become one.
fn create(
    name: &str,
    world: usize,
    joined: Instant,
    opts: RendezvousOptions,
) -> Result<(ShmSegment, Option<ByteLock>)> {
    gpufeed_os::shm::validate_name(name)?;
    let shm = std::path::Path::new(gpufeed_os::shm::DEFAULT_DIR);
    let mut unready_since: Option<Instant> = None;
    loop {
        if joined.elapsed() > opts.join_timeout {
            return Err(Error::Timeout {
                what: "the rendezvous name to be free of another rank 0's segment",
                ms: joined.elapsed().as_millis(),
            });
        }
        // Held (where taken) until the new segment exists under the name.
        let mut _replacing = None;
        match inspect(shm, name, opts.lease, Watch::UnknownOnly)? {
            Found::Nothing => {}
            Found::Live(live) => {
                return Err(Error::RendezvousInUse {
                    name: name.to_owned(),
                    pid: live.rank0_pid,
                    world: live.world,
                });
            }
            Found::Unready(_)
                if unready_since.get_or_insert_with(Instant::now).elapsed() < opts.lease =>
            {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            // Never initialised within a lease (its maker died in between), or a leftover.
            found @ (Found::Unready(_) | Found::Leftover(_)) => {
                let fd = match &found {
                    Found::Unready(fd) => fd.as_fd(),
                    Found::Leftover(seg) => seg.as_fd(),
                    _ => unreachable!("matched above"),
                };
                match remove_leftover(shm, name, fd)? {
                    Some(replacing) => _replacing = Some(replacing),
                    None => {
                        // Another process is replacing or removing it: look again.
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                }
            }
        }
        match ShmSegment::create(name, segment_len(world)) {
            Ok(seg) => return init(seg, world, opts),
            Err(gpufeed_os::Error::ShmExists { .. }) => {
                // Another rank 0 was faster: judge its segment.
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Initialises a fresh segment: geometry, nonce, lease, rank 0's identity and lock, then the
/// magic (Release), so that whoever sees the magic can judge rank 0.
fn init(
    mut seg: ShmSegment,
    world: usize,
    opts: RendezvousOptions,
) -> Result<(ShmSegment, Option<ByteLock>)> {
    // Until every rank has joined, a failure must not leave the name behind: the handle's drop
    // removes it (`release_name`, under the replace lock), never the segment's own drop, which
    // would not take that lock.
    seg.set_unlink_on_drop(false);
    word(&seg, OFF_WORLD).store(world as u64, Ordering::Relaxed);
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id());
    word(&seg, OFF_NONCE).store(nonce, Ordering::Relaxed);
    word(&seg, OFF_LEASE_MS).store(opts.lease.as_millis() as u64, Ordering::Relaxed);
    let lock = ByteLock::take(seg.as_fd(), HEADER as u64);
    publish_identity(&seg, HEADER, &ProcessIdentity::current(), lock.is_some());
    word(&seg, 0).store(MAGIC, Ordering::Release);
    Ok((seg, lock))
}

/// A rank other than 0: opens the segment once rank 0 has made it, waiting past a leftover
/// whose rank 0 is dead, left or silent (whatever its world size).
fn open(name: &str, world: usize, joined: Instant, opts: RendezvousOptions) -> Result<ShmSegment> {
    gpufeed_os::shm::validate_name(name)?;
    let shm = std::path::Path::new(gpufeed_os::shm::DEFAULT_DIR);
    loop {
        if let Some(seg) = try_open(shm, name, world, opts.lease)? {
            return Ok(seg);
        }
        if joined.elapsed() > opts.join_timeout {
            return Err(Error::RankNeverArrived {
                rank: 0,
                world,
                waited_ms: joined.elapsed().as_millis(),
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The segment if it is a live rendezvous for `world` ranks; `None` to try again later.
fn try_open(
    shm: &std::path::Path,
    name: &str,
    world: usize,
    lease: Duration,
) -> Result<Option<ShmSegment>> {
    let live = match inspect(shm, name, lease, Watch::Always)? {
        Found::Live(live) if live.beating => live,
        // Its rank 0 lives but its heartbeat stood still for its lease: stopped (or starved).
        // Joining would only fail naming it; look again until it moves (or the join timeout).
        Found::Live(_) => return Ok(None),
        // Not made yet, or a leftover that our rank 0 will replace.
        Found::Nothing | Found::Unready(_) | Found::Leftover(_) => return Ok(None),
    };
    if live.version != MAGIC {
        return Err(Error::InvalidHeader(format!(
            "rendezvous {name} was made by another gpufeed version (rank 0 is pid {}): give \
             every rank the same gpufeed",
            live.rank0_pid
        )));
    }
    if live.world != world {
        return Err(Error::InvalidLayout(format!(
            "rendezvous {name} was made by rank 0 (pid {}) for {} ranks, and this rank was told \
             {world}: give every rank the same world size (LOCAL_WORLD_SIZE)",
            live.rank0_pid, live.world
        )));
    }
    if live.seg.len() < segment_len(world) {
        return Err(Error::InvalidHeader(format!(
            "rendezvous {name}: segment of {} bytes for {world} ranks",
            live.seg.len()
        )));
    }
    Ok(Some(live.seg))
}

/// What a rendezvous name holds.
enum Found {
    /// No file.
    Nothing,
    /// A rendezvous whose rank 0 lives.
    Live(LiveRendezvous),
    /// A file of ours that is not (yet) a rendezvous: being made, or a crash's leftover.
    Unready(OwnedFd),
    /// A rendezvous nobody uses: its rank 0 died, left, or was silent for its lease.
    Leftover(ShmSegment),
}

struct LiveRendezvous {
    seg: ShmSegment,
    /// Its magic (its layout).
    version: u64,
    world: usize,
    rank0_pid: u32,
    /// Whether rank 0's heartbeat was seen to move (false: not watched, or still for a lease).
    beating: bool,
}

/// Whose heartbeat [`inspect`] watches (for up to a lease).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watch {
    /// Only a rank 0 that nothing else can judge (rank 0 of a new job deciding whether to
    /// replace: a rank 0 known alive keeps its name whether it beats or not).
    UnknownOnly,
    /// Every rank 0 not known gone (a rank about to join it).
    Always,
}

/// Looks at what the name `name` in `shm` holds. Another user's file is
/// [`Error::RendezvousSquatted`], never opened; rank 0 of a rendezvous is judged by its lock
/// (released: dead; held: alive, in any PID namespace), its pid (in our namespace), whether it
/// left, and, as `watch` says, its heartbeat, watched for up to its lease (`default_lease` for a
/// segment that does not record one). See [`rank0_lives`].
fn inspect(
    shm: &std::path::Path,
    name: &str,
    default_lease: Duration,
    watch: Watch,
) -> Result<Found> {
    let path = shm.join(name);
    let st = match rustix::fs::lstat(&path) {
        Ok(st) => st,
        Err(rustix::io::Errno::NOENT) => return Ok(Found::Nothing),
        Err(e) => {
            return Err(Error::Io {
                op: "look at the rendezvous name in /dev/shm",
                source: e.into(),
            });
        }
    };
    // Not ours, or not known to be ours (an unmapped user namespace, where every other
    // user's file reads as our overflow uid): never opened, never removed.
    if !gpufeed_os::shm::uid_is_ours(st.st_uid) {
        return Err(squatted(name, st.st_uid));
    }
    let seg = match gpufeed_os::shm::ShmOptions::new().dir(shm).open(name) {
        Ok(seg) => seg,
        Err(gpufeed_os::Error::ShmNotFound { .. }) => return Ok(Found::Nothing),
        Err(gpufeed_os::Error::ShmTooSmall { .. }) => {
            // Empty: just made, not sized yet (or never).
            return match open_unmapped(&path) {
                Ok(fd) => Ok(Found::Unready(fd)),
                Err(rustix::io::Errno::NOENT) => Ok(Found::Nothing),
                Err(e) => Err(Error::Io {
                    op: "open the rendezvous name in /dev/shm",
                    source: e.into(),
                }),
            };
        }
        Err(gpufeed_os::Error::ShmForeignOwner { owner_uid, .. }) => {
            return Err(squatted(name, owner_uid));
        }
        Err(e) => return Err(e.into()),
    };
    let magic = if seg.len() >= HEADER + 64 {
        word(&seg, 0).load(Ordering::Acquire)
    } else {
        0
    };
    if magic != MAGIC && magic != MAGIC_V1 {
        let fd = rustix::io::fcntl_dupfd_cloexec(&seg, 0).map_err(|e| Error::Io {
            op: "dup",
            source: e.into(),
        })?;
        return Ok(Found::Unready(fd));
    }
    let lease = match word(&seg, OFF_LEASE_MS).load(Ordering::Relaxed) {
        ms if magic == MAGIC && ms > 0 => Duration::from_millis(ms.min(3_600_000)),
        _ => default_lease,
    };
    let world = word(&seg, OFF_WORLD).load(Ordering::Relaxed) as usize;
    match rank0_lives(&seg, magic, lease, watch) {
        Rank0::Lives { pid, beating } => Ok(Found::Live(LiveRendezvous {
            seg,
            version: magic,
            world,
            rank0_pid: pid,
            beating,
        })),
        Rank0::Gone => Ok(Found::Leftover(seg)),
    }
}

/// A descriptor of the file at `path` (ours: checked by the caller), not following a link and
/// not blocking on a FIFO.
fn open_unmapped(path: &std::path::Path) -> rustix::io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

fn squatted(name: &str, owner_uid: u32) -> Error {
    Error::RendezvousSquatted {
        name: name.to_owned(),
        owner_uid,
        our_uid: rustix::process::geteuid().as_raw(),
    }
}

/// What rank 0 of a rendezvous segment is ([`rank0_lives`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rank0 {
    /// Its segment is a leftover: rank 0 is known gone (left, departed, its lock released, its
    /// pid dead), or nothing but its heartbeat can judge it and that stood still for a lease.
    Gone,
    /// It lives, or may: `pid` (in its own PID namespace); `beating` when its heartbeat was
    /// seen to move.
    Lives { pid: u32, beating: bool },
}

/// Judges rank 0 of `seg`. Known alive — its lock held (it lives or is only stopped, in any
/// PID namespace: the kernel drops the lock when it dies, and a child it forked does not keep
/// it) and its pid not dead here, or, without a lock, its pid alive in our namespace with the
/// start time it recorded — it lives whether its heartbeat moves or not: a stopped job keeps
/// its name. Known gone: left, departed, its lock released, or, without a lock, its pid dead.
/// Otherwise (it published no lock — it could take none, having no /proc — and its pid is of
/// another or unknown namespace, or recorded no start time; or its lock is held while its pid
/// is dead here: by a child forked a moment before it died, or through a /proc not ours) only
/// its heartbeat can tell, and a heartbeat that stood still for `lease` makes it gone: it may only
/// be stopped, but a name kept for ever by a dead process would stop every later job (and the
/// resumed rank 0 removes the name only while it is still its own segment's: see
/// [`release_name`]). `watch` says whether the heartbeat of a rank 0 known alive is watched too
/// (for `beating`).
fn rank0_lives(seg: &ShmSegment, magic: u64, lease: Duration, watch: Watch) -> Rank0 {
    let Some(rank) = RankRecord::read(seg, magic, 0) else {
        return Rank0::Gone;
    };
    let pid = rank.id.pid;
    if rank.state == LEFT || rank.departed(seg) {
        return Rank0::Gone;
    }
    let by_pid = if pid == 0 {
        Liveness::OtherNamespace
    } else {
        rank.id.liveness()
    };
    let known_alive = match (rank.lock(seg), by_pid) {
        (Probe::Free, _) | (Probe::Unknown, Liveness::Dead) => return Rank0::Gone,
        // Held while its pid, here, is dead: by a child that has not yet run its fork handler
        // (or one made without fork), or through a /proc that is not ours: let the heartbeat
        // tell.
        (Probe::Held, Liveness::Dead) => false,
        (Probe::Held, _) => true,
        (Probe::Unknown, Liveness::Alive) => rank.id.start_ticks != 0,
        (Probe::Unknown, Liveness::OtherNamespace) => false,
    };
    if known_alive && watch == Watch::UnknownOnly {
        return Rank0::Lives {
            pid,
            beating: false,
        };
    }
    let beat = word(seg, HEADER + R_BEAT).load(Ordering::Relaxed);
    let t = Instant::now();
    while word(seg, HEADER + R_BEAT).load(Ordering::Relaxed) == beat {
        if t.elapsed() > lease {
            return if known_alive {
                Rank0::Lives {
                    pid,
                    beating: false,
                }
            } else {
                Rank0::Gone
            };
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Rank0::Lives { pid, beating: true }
}

/// One rank's record as read from a segment of layout `magic` (untrusted: bounds checked).
struct RankRecord {
    rank: usize,
    rec: usize,
    state: u64,
    id: ProcessIdentity,
    flags: u64,
}

impl RankRecord {
    fn read(seg: &ShmSegment, magic: u64, rank: usize) -> Option<Self> {
        let (rec_len, fields) = if magic == MAGIC {
            (REC, R_FLAGS + 8)
        } else {
            (REC_V1, R_LEN + 16)
        };
        let rec = HEADER.checked_add(rank.checked_mul(rec_len)?)?;
        if rank >= MAX_RANKS || rec.checked_add(fields)? > seg.len() {
            return None;
        }
        let flags = if magic == MAGIC {
            word(seg, rec + R_FLAGS).load(Ordering::Acquire)
        } else {
            0
        };
        Some(RankRecord {
            rank,
            rec,
            state: word(seg, rec + R_STATE).load(Ordering::Acquire),
            id: ProcessIdentity {
                pid_ns: word(seg, rec + R_PID_NS).load(Ordering::Acquire),
                pid: word(seg, rec + R_PID).load(Ordering::Acquire) as u32,
                start_ticks: word(seg, rec + R_START).load(Ordering::Acquire),
            },
            flags,
        })
    }

    /// Whether the rank never came: no state, no identity.
    fn never_came(&self) -> bool {
        self.state == EMPTY && self.id.pid == 0
    }

    fn departed(&self, seg: &ShmSegment) -> bool {
        let bits = word(seg, OFF_DEPARTED + 8 * (self.rank / 64)).load(Ordering::Acquire);
        bits & (1 << (self.rank % 64)) != 0
    }

    /// What can be said without waiting: gone (left, departed, its lock released, or its pid
    /// of our namespace dead while it holds no lock we can see), alive (its lock held, or its
    /// pid alive here), or unknown (of another namespace, no lock).
    fn liveness(&self, seg: &ShmSegment) -> Liveness {
        if self.state == LEFT || self.departed(seg) {
            return Liveness::Dead;
        }
        match self.lock(seg) {
            Probe::Free => Liveness::Dead,
            Probe::Held => Liveness::Alive,
            Probe::Unknown if self.id.pid == 0 => Liveness::OtherNamespace,
            Probe::Unknown => self.id.liveness(),
        }
    }

    /// The rank's lock, if it published that it holds one.
    fn lock(&self, seg: &ShmSegment) -> Probe {
        if self.flags & FLAG_LOCKED != 0 {
            oflock::probe(seg.as_fd(), self.rec as u64)
        } else {
            Probe::Unknown
        }
    }
}

/// A leftover removed (or found replaced already) under its replacement lock.
struct Replacing {
    /// The write lock on the old file's [`REPLACE_LOCK_BYTE`]: hold it until the replacement
    /// exists. `None` where no lock could be taken (no /proc).
    _lock: Option<ExclusiveLock>,
    /// Whether this call removed the name (false: it referred to another file by then).
    removed: bool,
}

/// Removes the leftover `seg` (a descriptor of it) under `name` in `shm` if the name still
/// refers to it, holding a write lock on its [`REPLACE_LOCK_BYTE`]. `None` when someone else
/// holds that lock (replacing or removing it now).
fn remove_leftover(
    shm: &std::path::Path,
    name: &str,
    seg: BorrowedFd<'_>,
) -> Result<Option<Replacing>> {
    let lock = match ExclusiveLock::try_take(seg, REPLACE_LOCK_BYTE) {
        Ok(Some(lock)) => Some(lock),
        Ok(None) => return Ok(None),
        // No lock to be had here (no /proc): go on with the inode check alone.
        Err(e) => {
            tracing::debug!(%e, "removing a leftover rendezvous without a lock");
            None
        }
    };
    let removed = unlink_if_same(&shm.join(name), seg).map_err(|e| Error::Io {
        op: "remove a leftover rendezvous segment",
        source: e.into(),
    })?;
    if removed {
        tracing::info!("removed the leftover rendezvous {name} of a job that is gone");
    }
    Ok(Some(Replacing {
        _lock: lock,
        removed,
    }))
}

/// Removes `path` if it still refers (not following a link) to the file `fd` is open on:
/// `Ok(true)` when removed, `Ok(false)` when the name is gone or names another file. Call it
/// holding the file's [`REPLACE_LOCK_BYTE`] lock, which every remover of a rendezvous name
/// takes on the file it removes, so that the name cannot be replaced between the check and the
/// unlink.
fn unlink_if_same(path: &std::path::Path, fd: BorrowedFd<'_>) -> rustix::io::Result<bool> {
    let ours = rustix::fs::fstat(fd)?;
    match rustix::fs::lstat(path) {
        Ok(st) if (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino) => {}
        Ok(_) | Err(rustix::io::Errno::NOENT) => return Ok(false),
        Err(e) => return Err(e),
    }
    match rustix::fs::unlink(path) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::NOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Rank 0 removes its segment's name (all ranks joined, or its handle dropped before): only
/// while the name still refers to its segment, and holding the segment's
/// [`REPLACE_LOCK_BYTE`] lock, as a rank 0 replacing a leftover or `gc_rendezvous` does —
/// so a rank 0 that resumes after a new job judged it gone and replaced its segment leaves the
/// new job's name alone, even when the new job replaces it at that very moment. Where another
/// process holds that lock it is removing this segment's name itself (if still this one's),
/// and this call leaves it to it; where no lock can be taken (no /proc), the name is checked
/// and removed without it.
fn release_name(seg: &ShmSegment) -> Result<()> {
    let Some(path) = seg.path() else {
        return Ok(());
    };
    let _lock = match ExclusiveLock::try_take(seg.as_fd(), REPLACE_LOCK_BYTE) {
        Ok(Some(lock)) => Some(lock),
        Ok(None) => {
            tracing::debug!(path = %path.display(), "another process is removing the rendezvous name");
            return Ok(());
        }
        Err(e) => {
            tracing::debug!(%e, "removing the rendezvous name without a lock");
            None
        }
    };
    match unlink_if_same(path, seg.as_fd()) {
        Ok(true) => Ok(()),
        Ok(false) => {
            tracing::info!(
                path = %path.display(),
                "the rendezvous name refers to another job's segment now (this rank 0 was \
                 judged gone while stopped?): left alone"
            );
            Ok(())
        }
        Err(e) => Err(Error::Io {
            op: "remove the rendezvous name",
            source: e.into(),
        }),
    }
}

/// A rendezvous segment in a shared-memory directory ([`list_rendezvous`]): a job whose ranks
/// have not all met yet (once they have, rank 0 removes the name), or a crashed job's
/// leftover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousSegment {
    /// Its name.
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// The number of ranks rank 0 made it for.
    pub world: usize,
    /// Rank 0's identity (rank 0 makes the segment); pid 0 where none was recorded.
    pub rank0: ProcessIdentity,
    /// How many ranks had joined.
    pub joined: usize,
    /// Whether a rank may still use it: [`Liveness::Alive`] when one may (its lock is held,
    /// or its pid lives here), [`Liveness::Dead`] when every rank that came is known gone
    /// (left, its lock released, its pid dead), [`Liveness::OtherNamespace`] when none is
    /// known alive but some can only be judged from their own PID namespace.
    pub ranks: Liveness,
}

/// The rendezvous segments of this user ([`gpufeed_os::shm::uid_is_ours`]) in `dir`
/// (`/dev/shm` for [`Rendezvous`]) whose names
/// start with `<prefix>-` (`gpufeed-rdv-<job>` for `RankLoader` with the prefix `gpufeed`),
/// recognised by their header, with what their ranks are; sorted by name. Other files are
/// left unopened or unmapped.
///
/// # Errors
/// [`Error::Io`] when `dir` cannot be read.
pub fn list_rendezvous(dir: &std::path::Path, prefix: &str) -> Result<Vec<RendezvousSegment>> {
    let mut found: Vec<RendezvousSegment> = rendezvous_in(dir, prefix)?
        .into_iter()
        .map(|(entry, _)| entry)
        .collect();
    found.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(found)
}

/// Removes the rendezvous segments of this user ([`gpufeed_os::shm::uid_is_ours`]) in `dir`
/// whose names start with `<prefix>-` and whose ranks are all known gone ([`Liveness::Dead`]
/// in [`list_rendezvous`]): crashed jobs' leftovers. One whose rank may live is kept; one
/// whose ranks can only be judged from another PID namespace is kept unless `foreign` says
/// [`ForeignSegments::Remove`]. A segment is removed only if its name still refers to the file
/// judged, under the lock rank 0 of a new job takes to replace a leftover, so that a new job's
/// segment is never removed; one that cannot be removed (`EPERM`) is recorded in
/// [`GcReport::skipped`] and gc goes on.
///
/// # Errors
/// [`Error::Io`] when `dir` cannot be read.
pub fn gc_rendezvous(
    dir: &std::path::Path,
    prefix: &str,
    foreign: ForeignSegments,
) -> Result<GcReport> {
    let mut report = GcReport::default();
    let mut found = rendezvous_in(dir, prefix)?;
    found.sort_by(|a, b| a.0.name.cmp(&b.0.name));
    for (entry, seg) in found {
        match (entry.ranks, foreign) {
            (Liveness::Alive, _) => report.kept.push(entry.name),
            (Liveness::OtherNamespace, ForeignSegments::Keep) => {
                report.other_namespace.push(entry.name)
            }
            // Removed if we got the lock and the name still was this file; a locked one is
            // being replaced right now.
            _ => match remove_leftover(dir, &entry.name, seg.as_fd()) {
                Ok(Some(Replacing { removed: true, .. })) => {
                    report.removed_bytes += entry.bytes;
                    report.removed.push(entry.name);
                }
                Ok(_) => {}
                Err(Error::Io { source, .. }) => {
                    tracing::warn!(name = %entry.name, "gc could not remove a crashed job's rendezvous: {source}");
                    report.skipped.push(gpufeed_os::shm::GcSkipped {
                        name: entry.name,
                        reason: format!("unlink: {source}"),
                    });
                }
                Err(e) => return Err(e),
            },
        }
    }
    Ok(report)
}

/// How long a rendezvous file without any rank's identity may be (its rank 0 between making it
/// and writing its identity, in layout 1) before it counts as a leftover.
const NOBODY_GRACE: Duration = Duration::from_secs(60);

/// The rendezvous segments in `dir` named `<prefix>-*`, judged, with the mapping judged.
fn rendezvous_in(
    dir: &std::path::Path,
    prefix: &str,
) -> Result<Vec<(RendezvousSegment, ShmSegment)>> {
    let io = |source: std::io::Error| Error::Io {
        op: "read the shared-memory directory",
        source,
    };
    let stem = format!("{prefix}-");
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if !name.starts_with(&stem) {
            continue;
        }
        let Ok(st) = rustix::fs::lstat(entry.path()) else {
            continue; // gone meanwhile
        };
        let regular =
            rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile;
        if !regular
            || !gpufeed_os::shm::uid_is_ours(st.st_uid)
            || (st.st_size as u64) < (HEADER + 64) as u64
        {
            continue;
        }
        // The magic first, through a descriptor: other segments (rings, GBs) stay unmapped.
        let Ok(fd) = open_unmapped(&entry.path()) else {
            continue;
        };
        let mut magic = [0u8; 8];
        if !matches!(rustix::io::pread(&fd, &mut magic, 0), Ok(8)) {
            continue;
        }
        let magic = u64::from_le_bytes(magic);
        if magic != MAGIC && magic != MAGIC_V1 {
            continue;
        }
        let Ok(seg) = gpufeed_os::shm::ShmOptions::new().dir(dir).open(&name) else {
            continue;
        };
        let age = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .ok()
            .and_then(|now| now.checked_sub(Duration::new(st.st_mtime as u64, 0)));
        found.push((judge_segment(&seg, magic, name, age), seg));
    }
    Ok(found)
}

/// What a rendezvous segment's ranks are, from its records alone (no waiting).
fn judge_segment(
    seg: &ShmSegment,
    magic: u64,
    name: String,
    age: Option<Duration>,
) -> RendezvousSegment {
    let world = word(seg, OFF_WORLD).load(Ordering::Relaxed) as usize;
    let (mut joined, mut alive, mut unknown, mut anyone) = (0, false, false, false);
    let mut rank0 = ProcessIdentity {
        pid_ns: 0,
        pid: 0,
        start_ticks: 0,
    };
    for r in 0..world.min(MAX_RANKS) {
        let Some(rec) = RankRecord::read(seg, magic, r) else {
            break; // the segment ends (a hostile or torn world size)
        };
        if r == 0 {
            rank0 = rec.id;
        }
        if rec.never_came() {
            continue;
        }
        anyone = true;
        joined += usize::from(rec.state != EMPTY);
        match rec.liveness(seg) {
            Liveness::Alive => alive = true,
            Liveness::OtherNamespace => unknown = true,
            Liveness::Dead => {}
        }
    }
    let ranks = if alive || (!anyone && age.is_none_or(|a| a < NOBODY_GRACE)) {
        Liveness::Alive
    } else if unknown {
        Liveness::OtherNamespace
    } else {
        Liveness::Dead
    };
    RendezvousSegment {
        name,
        bytes: seg.len() as u64,
        world,
        rank0,
        joined,
        ranks,
    }
}
