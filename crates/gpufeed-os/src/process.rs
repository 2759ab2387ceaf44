//! Which process is which, across pid reuse: a pid plus the process's start time.
//!
//! A pid alone is not an identity: after a process dies its pid can be given to a new one.
//! The start time (field 22 of `/proc/<pid>/stat`, clock ticks after boot) tells them apart.
//! Shared-memory segment names ([`crate::shm`]) and the batch ring of `gpufeed-ipc` record
//! this pair to decide whether the process that owns something still runs.

use rustix::io::Errno;

use crate::procfs;

/// A process: pid and start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProcessIdentity {
    /// The pid.
    pub pid: u32,
    /// Start time in clock ticks after boot; 0 where /proc could not tell.
    pub start_ticks: u64,
}

impl ProcessIdentity {
    /// This process.
    pub fn current() -> Self {
        let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
        ProcessIdentity {
            pid,
            start_ticks: start_ticks(pid).unwrap_or(0),
        }
    }

    /// The process that has `pid` now, if any.
    pub fn of(pid: u32) -> Option<Self> {
        Some(ProcessIdentity {
            pid,
            start_ticks: start_ticks(pid)?,
        })
    }

    /// Whether this very process still runs: the pid exists (`kill(pid, 0)`, where `EPERM`
    /// means it exists under another user) and, where recorded, has the same start time.
    pub fn is_alive(&self) -> bool {
        let Some(pid) = rustix::process::Pid::from_raw(self.pid as i32) else {
            return false;
        };
        match rustix::process::test_kill_process(pid) {
            Err(Errno::SRCH) => false,
            _ => match (self.start_ticks, start_ticks(self.pid)) {
                (0, _) => true,
                (recorded, Some(now)) => recorded == now,
                // It vanished between the two checks.
                (_, None) => false,
            },
        }
    }
}

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
        assert!(me.is_alive());
        assert_eq!(ProcessIdentity::of(me.pid), Some(me));
        let reused = ProcessIdentity {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert!(
            !reused.is_alive(),
            "same pid, other start time: a different process"
        );
        let none = ProcessIdentity {
            pid: u32::MAX / 2,
            start_ticks: 1,
        };
        assert!(!none.is_alive());
    }
}
