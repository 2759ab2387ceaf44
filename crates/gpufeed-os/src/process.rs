//! Which process is which, across pid reuse and PID namespaces: the PID namespace, a pid in it
//! and the process's start time.
//!
//! A pid alone is not an identity: after a process dies its pid can be given to a new one, and
//! a pid means nothing outside its PID namespace (a container sharing /dev/shm with
//! `--ipc=host` has its own: its pid 7 is not our pid 7). [`ProcessIdentity`] records the
//! namespace (the inode of `/proc/self/ns/pid`), the pid as the process itself sees it, and
//! its start time (field 22 of `/proc/self/stat`, clock ticks after boot).
//! [`ProcessIdentity::liveness`] judges a process by its pid only when it lives in our
//! namespace; for any other it answers [`Liveness::OtherNamespace`], and callers must use
//! something the process renews (a lease) instead. Shared-memory segment names
//! ([`crate::shm`]) and the batch ring of `gpufeed-ipc` record this identity.
//!
//! A PID namespace need not have its own /proc (`unshare --pid --fork` without
//! `--mount-proc`, a sandbox binding the host's /proc): there `/proc/<pid>` is the host's
//! process of that number. [`proc_is_ours`] tells (`readlink /proc/self` is our pid); where it
//! is not, a process is found by `pidfd_open` (which works in the caller's namespace), its
//! start time read through the pid its pidfd has in that /proc (`Pid:` of
//! `/proc/self/fdinfo/<pidfd>`), and where even that cannot tell, the pidfd alone judges. A
//! live process is never judged dead.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

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
            .unwrap_or(0);
        ProcessIdentity {
            pid_ns: current_pid_ns(),
            pid,
            start_ticks,
        }
    }

    /// The process of our namespace that has `pid` now, if any. Its start time is read where
    /// /proc can tell it (see [`proc_is_ours`]; in a namespace without its own /proc, through
    /// the pidfd's pid in that /proc), else 0 (unknown): never another process's.
    pub fn of(pid: u32) -> Option<Self> {
        let pid_ns = current_pid_ns();
        if proc_is_ours() {
            return Some(ProcessIdentity {
                pid_ns,
                pid,
                start_ticks: start_ticks(pid)?,
            });
        }
        let raw = i32::try_from(pid).ok().and_then(Pid::from_raw)?;
        let start_ticks = match rustix::process::pidfd_open(raw, PidfdFlags::empty()) {
            Err(Errno::SRCH) => return None,
            Ok(fd) => {
                let start = start_ticks_of(pid, Some(&fd));
                if has_exited(&fd) {
                    return None;
                }
                start.unwrap_or(0)
            }
            Err(_) => match rustix::process::test_kill_process(raw) {
                Err(Errno::SRCH) => return None,
                _ => 0,
            },
        };
        Some(ProcessIdentity {
            pid_ns,
            pid,
            start_ticks,
        })
    }

    /// Whether this very process still runs, judged only where its pid means something.
    ///
    /// In our namespace: `pidfd_open(pid)` (else `kill(pid, 0)`, where `EPERM` means it exists
    /// under another user), the start time where recorded, and the pidfd polled so that an
    /// exited process not yet waited for (a zombie) counts as dead. The start time is read
    /// from `/proc/<pid>/stat` where /proc is our namespace's ([`proc_is_ours`]); where it is
    /// another's (no `--mount-proc`), from the pid the pidfd has in that /proc
    /// (`/proc/self/fdinfo`), and where that cannot tell, the pidfd alone judges: a live
    /// process is never judged dead. In another namespace, or when either namespace is
    /// unknown: [`Liveness::OtherNamespace`], never `Dead`.
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

/// The inode of our PID namespace (0 where /proc cannot tell). Read once per process and
/// again after a `fork` (the cache is keyed by our pid: a child forked after
/// `unshare(CLONE_NEWPID)` lives in the new namespace).
pub fn current_pid_ns() -> u64 {
    static PID: AtomicU32 = AtomicU32::new(0);
    static NS: AtomicU64 = AtomicU64::new(0);
    let me = getpid();
    if PID.load(Ordering::Acquire) == me {
        return NS.load(Ordering::Relaxed);
    }
    let ns = std::fs::metadata("/proc/self/ns/pid")
        .map(|m| m.ino())
        .unwrap_or(0);
    NS.store(ns, Ordering::Relaxed);
    PID.store(me, Ordering::Release);
    ns
}

/// Whether the /proc we see shows pids of our own PID namespace: `readlink /proc/self` names
/// our pid. Not where the namespace has no /proc of its own (`unshare --pid --fork` without
/// `--mount-proc`, a sandbox binding the host's /proc: there `/proc/<pid>` is the host's
/// process of that number), nor where /proc is missing. Cached per process, keyed by pid so
/// that a forked child asks again.
pub fn proc_is_ours() -> bool {
    // 0: not known; else (pid << 1) | ours.
    static CACHE: AtomicU64 = AtomicU64::new(0);
    let me = getpid();
    let cached = CACHE.load(Ordering::Relaxed);
    if cached != 0 && (cached >> 1) as u32 == me {
        return cached & 1 == 1;
    }
    let ours = std::fs::read_link("/proc/self")
        .ok()
        .and_then(|l| l.to_str().and_then(|s| s.parse::<u32>().ok()))
        == Some(me);
    CACHE.store((u64::from(me) << 1) | u64::from(ours), Ordering::Relaxed);
    ours
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
    if recorded_start != 0 {
        match start_ticks_of(raw, pidfd.as_ref()) {
            Some(now) if now == recorded_start => {}
            // Another process has the pid now.
            Some(_) => return false,
            // Vanished between the checks (our /proc shows every pid of ours).
            None if proc_is_ours() => return false,
            // A /proc of another namespace that cannot show it: the pidfd alone judges.
            None => {}
        }
    }
    match pidfd {
        Some(fd) => !has_exited(&fd),
        None => true,
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

/// The start time of the process `raw` of our namespace, read from /proc where /proc shows
/// it: `/proc/<raw>/stat` where /proc is ours; else through the pidfd, whose
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

/// Field 22 of `/proc/<pid>/stat` in the /proc we see.
fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    procfs::stat_starttime(&stat)
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
        let reused = ProcessIdentity {
            start_ticks: me.start_ticks + 1,
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
