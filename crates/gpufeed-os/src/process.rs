//! Which process is which, across pid reuse and PID namespaces: the PID namespace, a pid in it
//! and the process's start time.
//!
//! A pid alone is not an identity: after a process dies its pid can be given to a new one, and
//! a pid means nothing outside its PID namespace (a container sharing /dev/shm with
//! `--ipc=host` has its own: its pid 7 is not our pid 7). [`ProcessIdentity`] records the
//! namespace (the inode of `/proc/self/ns/pid`), the pid as the process itself sees it, and
//! its start time (field 22 of `/proc/self/stat`, clock ticks after boot, on the host's boot
//! clock: see below). [`ProcessIdentity::liveness`] judges a process by its pid only when it
//! lives in our namespace; for any other it answers [`Liveness::OtherNamespace`], and callers
//! must use something the process renews (a lease) instead. Shared-memory segment names
//! ([`crate::shm`]) and the batch ring of `gpufeed-ipc` record this identity.
//!
//! A live process is never judged dead. Where /proc cannot show a process's start time, the
//! process is judged by its pidfd (`pidfd_open`, which works in the caller's PID namespace,
//! polled so that an exited one, a zombie included, counts as dead; `kill(pid, 0)` where
//! pidfds are refused), and a pid reused by a new process then reads as alive, the safe
//! direction. That is the case:
//! - in a PID namespace without its own /proc (`unshare --pid --fork` without
//!   `--mount-proc`, a sandbox binding the host's /proc), where `/proc/<pid>` is the host's
//!   process of that number. [`proc_is_ours`] tells (`readlink /proc/self` is our pid); where
//!   it is not, the start time is read through the pid the pidfd has in that /proc (`Pid:` of
//!   `/proc/self/fdinfo/<pidfd>`), and where the process has none there, not at all;
//! - where /proc hides other users' processes (`hidepid=1`/`2`, `hidepid=invisible`) or
//!   `/proc/<pid>/stat` cannot be read for any other reason.
//!
//! In a time namespace (`unshare --time --boottime <s>`) /proc shows start times shifted by
//! the reader's boot-time offset. Start times are therefore recorded and compared on the
//! host's clock: the reading minus our offset (the `boottime` line of
//! `/proc/self/timens_offsets`, 0 where the file is absent), in clock ticks
//! (`sysconf(_SC_CLK_TCK)`). An offset that is not a whole number of ticks makes the two
//! sides round differently, so start times within one tick are the same; a pid reused within
//! one tick (10 ms) of the first process's start is not told apart.
//!
//! What is cached per process (our PID namespace, whether /proc is ours, our boot-time offset;
//! [`crate::shm`]'s uid map) is read again in the child of every `fork` (a `pthread_atfork`
//! handler, registered on first use) and whenever our pid changes (a child made by a raw
//! `clone`): a child forked after `unshare(CLONE_NEWPID)` lives in another namespace, even
//! when it is pid 1 there as its parent was in its own. A process that changes namespace
//! itself (`setns`, `unshare(CLONE_NEWTIME)` applies to children only) keeps its cached
//! answers.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::event::{PollFd, PollFlags};
use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags};

use crate::procfs;

/// A process: its PID namespace, its pid there and its start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProcessIdentity {
    /// Inode of the process's PID namespace (`/proc/self/ns/pid`); 0 where unknown.
    pub pid_ns: u64,
    /// The pid, as seen in that namespace.
    pub pid: u32,
    /// Start time in clock ticks after boot; 0 where /proc could not tell.
    pub start_ticks: u64,
}

/// What can be said about whether a recorded process still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Liveness {
    /// It runs (same namespace, same pid, same start time, not a zombie).
    Alive,
    /// It exited (or its pid now belongs to another process).
    Dead,
    /// It lives (or lived) in another PID namespace, or its namespace is unknown: its pid says
    /// nothing here. Only something it renews (a lease) can tell.
    OtherNamespace,
}

impl ProcessIdentity {
    /// This process.
    ///
    /// Not cached: after `fork` the child gets its own identity.
    pub fn current() -> Self {
        let pid = getpid();
        // /proc/self, not /proc/<pid>: in a child PID namespace without its own /proc mount
        // `pid` names another process in the /proc we see.
        let start_ticks = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| procfs::stat_starttime(&s))
            .map_or(0, host_ticks);
        ProcessIdentity {
            pid_ns: current_pid_ns(),
            pid,
            start_ticks,
        }
    }

    /// The process of our namespace that has `pid` now, if any. Its start time (on the
    /// host's clock) is read where /proc can tell it (see the module docs; in a namespace
    /// without its own /proc, through the pidfd's pid in that /proc), else 0 (unknown): never
    /// another process's. Where the start time cannot be read, only a process that has not
    /// exited is returned.
    pub fn of(pid: u32) -> Option<Self> {
        let pid_ns = current_pid_ns();
        let raw = i32::try_from(pid).ok().and_then(Pid::from_raw)?;
        let pidfd = match rustix::process::pidfd_open(raw, PidfdFlags::empty()) {
            Err(Errno::SRCH) => return None,
            Ok(fd) => Some(fd),
            Err(_) => None,
        };
        let start = start_ticks_of(pid, pidfd.as_ref());
        let identity = |start_ticks| {
            Some(ProcessIdentity {
                pid_ns,
                pid,
                start_ticks,
            })
        };
        if let Some(start) = start
            && proc_is_ours()
        {
            return identity(start);
        }
        // Read through the pidfd, or not at all: the pid is a live process's only while the
        // pidfd has not exited (checked after the read).
        let gone = match &pidfd {
            Some(fd) => has_exited(fd),
            None => matches!(rustix::process::test_kill_process(raw), Err(Errno::SRCH)),
        };
        if gone {
            return None;
        }
        identity(start.unwrap_or(0))
    }

    /// Whether this very process still runs, judged only where its pid means something.
    ///
    /// In our namespace: `pidfd_open(pid)` (else `kill(pid, 0)`, where `EPERM` means it exists
    /// under another user), the start time where recorded and readable (a different one
    /// means another process has the pid now; within one tick counts as the same, see the
    /// module docs), and the pidfd polled so that an exited process not yet waited for (a
    /// zombie) counts as dead. The start time is read from `/proc/<pid>/stat` where /proc is
    /// our namespace's ([`proc_is_ours`]); where it is another's (no `--mount-proc`), from the
    /// pid the pidfd has in that /proc (`/proc/self/fdinfo`). Where it cannot be read (that
    /// /proc does not show the process, `hidepid`), the pidfd alone judges: a live process is
    /// never judged dead. In another namespace, or when either namespace is unknown:
    /// [`Liveness::OtherNamespace`], never `Dead`.
    pub fn liveness(&self) -> Liveness {
        let ours = current_pid_ns();
        if self.pid_ns == 0 || ours == 0 || self.pid_ns != ours {
            return Liveness::OtherNamespace;
        }
        if pid_alive(self.pid, self.start_ticks) {
            Liveness::Alive
        } else {
            Liveness::Dead
        }
    }

    /// `liveness() == Dead`: known to have exited. A process of another namespace is never
    /// known dead by its pid.
    pub fn is_dead(&self) -> bool {
        self.liveness() == Liveness::Dead
    }

    /// A name part that says which process made it and differs between calls:
    /// `<pid>-<start ticks>-<pid namespace>-<random hex>` (shared-memory segment names, temporary
    /// files of [`crate::atomic::AtomicFile`]); [`ProcessIdentity::from_tag`] reads it back.
    pub fn unique_tag(&self) -> crate::Result<String> {
        let mut random = [0u8; 8];
        rustix::rand::getrandom(&mut random, rustix::rand::GetRandomFlags::empty())
            .map_err(|e| crate::Error::io("getrandom", None, e))?;
        Ok(format!(
            "{}-{}-{}-{:016x}",
            self.pid,
            self.start_ticks,
            self.pid_ns,
            u64::from_ne_bytes(random)
        ))
    }

    /// The process of a [`ProcessIdentity::unique_tag`]. Tags of the earlier form
    /// `<pid>-<start>-<random hex>` read with namespace 0 (unknown: never judged by their pid).
    pub fn from_tag(tag: &str) -> Option<Self> {
        let parts: Vec<&str> = tag.splitn(4, '-').collect();
        let (pid, start, ns, random) = match parts[..] {
            [pid, start, ns, random] => (pid, start, ns.parse().ok()?, random),
            [pid, start, random] => (pid, start, 0, random),
            _ => return None,
        };
        (!random.is_empty() && random.bytes().all(|b| b.is_ascii_hexdigit())).then_some(
            ProcessIdentity {
                pid_ns: ns,
                pid: pid.parse().ok()?,
                start_ticks: start.parse().ok()?,
            },
        )
    }
}

/// A value read once per process: again in the child of a `fork` (an atfork handler) and
/// whenever our pid changes (see the module docs).
pub(crate) struct PerProcess {
    /// `(fork generation << 32) | pid` of the reading; 0: none yet.
    key: AtomicU64,
    value: AtomicU64,
}

/// Bumped in the child of every `fork` (see [`fork_generation`]).
static FORK_GENERATION: AtomicU64 = AtomicU64::new(1);

/// The `pthread_atfork` child handler: every [`PerProcess`] value is stale in the child.
extern "C" fn forked_child() {
    // Only an atomic add: async-signal-safe, as a handler run in a forked child must be.
    FORK_GENERATION.fetch_add(1, Ordering::AcqRel);
}

/// How many forks lie between the first process that used this library and us (registers
/// the atfork handler on first use).
fn fork_generation() -> u64 {
    static REGISTER: std::sync::Once = std::sync::Once::new();
    REGISTER.call_once(|| {
        // SAFETY: registers a handler that only does an atomic add, for the whole process;
        // it is never unregistered, and the function lives as long as the program.
        let r = unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
        if r != 0 {
            tracing::warn!("pthread_atfork failed ({r}): cached process facts are re-read only when the pid changes");
        }
    });
    FORK_GENERATION.load(Ordering::Acquire)
}

impl PerProcess {
    pub(crate) const fn new() -> Self {
        PerProcess {
            key: AtomicU64::new(0),
            value: AtomicU64::new(0),
        }
    }

    /// The value `read` gave in this process (since its last fork), reading it now if none.
    pub(crate) fn get(&self, read: impl FnOnce() -> u64) -> u64 {
        let key = ((fork_generation() & 0xffff_ffff) << 32) | u64::from(getpid());
        if self.key.load(Ordering::Acquire) == key {
            return self.value.load(Ordering::Relaxed);
        }
        let value = read();
        self.value.store(value, Ordering::Relaxed);
        self.key.store(key, Ordering::Release);
        value
    }
}

/// The inode of our PID namespace (0 where /proc cannot tell). Read once per process and
/// again in a forked child (see the module docs: a child forked after
/// `unshare(CLONE_NEWPID)` lives in the new namespace).
pub fn current_pid_ns() -> u64 {
    static NS: PerProcess = PerProcess::new();
    NS.get(|| {
        std::fs::metadata("/proc/self/ns/pid")
            .map(|m| m.ino())
            .unwrap_or(0)
    })
}

/// Whether the /proc we see shows pids of our own PID namespace: `readlink /proc/self` names
/// our pid. Not where the namespace has no /proc of its own (`unshare --pid --fork` without
/// `--mount-proc`, a sandbox binding the host's /proc: there `/proc/<pid>` is the host's
/// process of that number), nor where /proc is missing. Read once per process and again in a
/// forked child (see the module docs).
pub fn proc_is_ours() -> bool {
    static OURS: PerProcess = PerProcess::new();
    OURS.get(|| {
        let me = getpid();
        u64::from(
            std::fs::read_link("/proc/self")
                .ok()
                .and_then(|l| l.to_str().and_then(|s| s.parse::<u32>().ok()))
                == Some(me),
        )
    }) == 1
}

/// Our time namespace's boot-time offset in nanoseconds (the `boottime` line of
/// `/proc/self/timens_offsets`: seconds and nanoseconds); 0 where the file is absent (no time
/// namespaces) or unreadable. Read once per process (see the module docs).
fn boottime_offset_ns() -> i64 {
    static OFFSET: PerProcess = PerProcess::new();
    OFFSET.get(|| {
        std::fs::read_to_string("/proc/self/timens_offsets")
            .ok()
            .and_then(|s| procfs::timens_boottime_ns(&s))
            .unwrap_or(0) as u64
    }) as i64
}

/// A start time as /proc shows it to us (clock ticks on our time namespace's boot clock), on
/// the host's boot clock: minus our boot-time offset, in whole ticks (rounded down, as the
/// kernel rounds the shifted time it shows).
fn host_ticks(shown: u64) -> u64 {
    let offset = boottime_offset_ns();
    if offset == 0 {
        return shown;
    }
    let tick_ns = (1_000_000_000 / rustix::param::clock_ticks_per_second().max(1)).max(1) as i64;
    let offset_ticks = offset.div_euclid(tick_ns);
    (i128::from(shown) - i128::from(offset_ticks)).clamp(0, i128::from(u64::MAX)) as u64
}

/// Whether two start times (host clock) are of one process: equal, or one tick apart (the
/// rounding of an offset that is not a whole number of ticks, see the module docs).
fn same_start(a: u64, b: u64) -> bool {
    a.abs_diff(b) <= 1
}

fn getpid() -> u32 {
    rustix::process::getpid().as_raw_nonzero().get() as u32
}

/// Whether the process `raw` of our namespace runs and, where `recorded_start` is known and
/// /proc can tell, started then. Never false for a process that runs.
fn pid_alive(raw: u32, recorded_start: u64) -> bool {
    let Some(pid) = i32::try_from(raw).ok().and_then(Pid::from_raw) else {
        return false;
    };
    let pidfd = match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
        Err(Errno::SRCH) => return false,
        Ok(fd) => Some(fd),
        // Old kernel or seccomp: fall back to kill(pid, 0).
        Err(_) => match rustix::process::test_kill_process(pid) {
            Err(Errno::SRCH) => return false,
            _ => None,
        },
    };
    if recorded_start != 0
        && let Some(now) = start_ticks_of(raw, pidfd.as_ref())
        && !same_start(now, recorded_start)
    {
        // Another process has the pid now.
        return false;
    }
    // The start time matched, or could not be read (a /proc that does not show the process:
    // of another namespace, hidepid; or it vanished meanwhile): the pidfd judges.
    match pidfd {
        Some(fd) => !has_exited(&fd),
        None => !matches!(rustix::process::test_kill_process(pid), Err(Errno::SRCH)),
    }
}

/// Whether the process of `pidfd` has exited: the pidfd polls readable (also while it is a
/// zombie).
fn has_exited(pidfd: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
}

/// The start time (host clock, see [`host_ticks`]) of the process `raw` of our namespace,
/// read from /proc where /proc shows it: `/proc/<raw>/stat` where /proc is ours; else
/// through the pidfd, whose
/// `/proc/self/fdinfo` line `Pid:` gives its pid in the namespace of this /proc (0 where it is
/// not visible there, -1 once it exited). The caller polls the pidfd afterwards: a process
/// that had not exited then still had the translated pid while it was read.
fn start_ticks_of(raw: u32, pidfd: Option<&OwnedFd>) -> Option<u64> {
    if proc_is_ours() {
        return start_ticks(raw);
    }
    let fdinfo =
        std::fs::read_to_string(format!("/proc/self/fdinfo/{}", pidfd?.as_raw_fd())).ok()?;
    let here = procfs::fdinfo_pid(&fdinfo).filter(|&p| p > 0)?;
    start_ticks(u32::try_from(here).ok()?)
}

/// Field 22 of `/proc/<pid>/stat` in the /proc we see, on the host's clock.
fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    procfs::stat_starttime(&stat).map(host_ticks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_reused_pid_is_not() {
        let me = ProcessIdentity::current();
        assert!(me.start_ticks > 0, "/proc/self/stat readable here");
        assert!(me.pid_ns > 0, "/proc/self/ns/pid readable here");
        assert_eq!(me.liveness(), Liveness::Alive);
        assert_eq!(ProcessIdentity::of(me.pid), Some(me));
        // One tick apart is the same (rounding of a time namespace's offset); two is not.
        let rounded = ProcessIdentity {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert_eq!(rounded.liveness(), Liveness::Alive);
        let reused = ProcessIdentity {
            start_ticks: me.start_ticks + 2,
            ..me
        };
        assert_eq!(
            reused.liveness(),
            Liveness::Dead,
            "same pid, other start time: a different process"
        );
        let none = ProcessIdentity {
            pid: u32::MAX / 2,
            ..me
        };
        assert!(none.is_dead());
    }

    #[test]
    fn a_pid_of_another_namespace_is_never_judged_dead() {
        let me = ProcessIdentity::current();
        for pid_ns in [0, me.pid_ns + 1] {
            let foreign = ProcessIdentity {
                pid_ns,
                pid: u32::MAX / 2, // no such pid here
                start_ticks: 1,
            };
            assert_eq!(foreign.liveness(), Liveness::OtherNamespace);
            assert!(!foreign.is_dead());
        }
    }

    #[test]
    fn an_exited_child_not_yet_waited_for_is_dead() {
        let mut child = std::process::Command::new("sleep")
            .arg("0.1")
            .spawn()
            .expect("spawn");
        let id = ProcessIdentity::of(child.id()).expect("the child runs");
        assert_eq!(id.liveness(), Liveness::Alive);
        // It exits and stays a zombie until waited for.
        std::thread::sleep(std::time::Duration::from_millis(400));
        assert_eq!(id.liveness(), Liveness::Dead, "a zombie counted as alive");
        child.wait().expect("wait");
    }
}
