//! Liveness that the kernel keeps: a read lock on one byte of a shared file, taken through an
//! open file description of the process's own (`F_OFD_SETLK`) and held for as long as the
//! process uses what the byte stands for. The kernel drops the lock when the last descriptor
//! of that open file description closes: at the latest when the process dies, whatever its
//! PID namespace (the lock belongs to the shared file, not to a pid), and never while it is
//! only stopped. `F_OFD_GETLK` through any other open file description of the file tells
//! whether someone holds the byte, without taking it.
//!
//! So a byte found free proves that its holder is gone; a byte found held proves only that a
//! process may still use it: a child forked while the lock was held shares the open file
//! description until it exits or execs (the descriptor is close-on-exec). Every lock is taken
//! through a descriptor opened for it alone (`/proc/self/fd/N` opened again), never through
//! the descriptor the segment is mapped from, so that probing through that one sees every
//! holder, the prober's own other handles included.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

/// What a probe of a byte found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// Some open file description holds the byte: its process may live.
    Held,
    /// Nobody holds it: whoever took it is gone.
    Free,
    /// The probe failed (a file system without locks).
    Unknown,
}

/// A read lock on one byte of a file, released when this drops (or the process dies).
#[derive(Debug)]
pub(crate) struct ByteLock {
    _fd: OwnedFd,
}

impl ByteLock {
    /// Takes a read lock on byte `byte` of the file `file` refers to, through a new open file
    /// description of that file; `None` where that cannot be done (no /proc to open the file
    /// again through, a file system without locks), with the reason logged.
    pub(crate) fn take(file: BorrowedFd<'_>, byte: u64) -> Option<ByteLock> {
        let fd = match reopen(file) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::debug!(%e, "no lock on a shared segment: cannot open it again");
                return None;
            }
        };
        match fcntl_lock(
            fd.as_fd(),
            libc::F_OFD_SETLK,
            libc::F_RDLCK as libc::c_short,
            byte,
        ) {
            Ok(_) => Some(ByteLock { _fd: fd }),
            Err(e) => {
                tracing::debug!(%e, "no lock on a shared segment: F_OFD_SETLK failed");
                None
            }
        }
    }
}

/// A write lock on one byte of a file, exclusive of every other lock on it, released when
/// this drops (or the process dies).
#[derive(Debug)]
pub(crate) struct ExclusiveLock {
    _fd: OwnedFd,
}

impl ExclusiveLock {
    /// Takes a write lock on byte `byte` of the file `file` refers to, through a new open file
    /// description of it: `Ok(None)` when someone else holds a lock on the byte.
    pub(crate) fn try_take(file: BorrowedFd<'_>, byte: u64) -> std::io::Result<Option<Self>> {
        let fd = reopen_as(file, rustix::fs::OFlags::RDWR)?;
        match fcntl_lock(
            fd.as_fd(),
            libc::F_OFD_SETLK,
            libc::F_WRLCK as libc::c_short,
            byte,
        ) {
            Ok(_) => Ok(Some(ExclusiveLock { _fd: fd })),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Whether anyone holds byte `byte` of `file`, asked through `file`'s own open file
/// description (which must not hold it).
pub(crate) fn probe(file: BorrowedFd<'_>, byte: u64) -> Probe {
    match fcntl_lock(
        file,
        libc::F_OFD_GETLK,
        libc::F_WRLCK as libc::c_short,
        byte,
    ) {
        Ok(l_type) if l_type == libc::F_UNLCK as libc::c_short => Probe::Free,
        Ok(_) => Probe::Held,
        Err(_) => Probe::Unknown,
    }
}

/// The same file through a new open file description (read-only: read locks need no more),
/// checked to be the same inode.
fn reopen(file: BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    reopen_as(file, rustix::fs::OFlags::RDONLY)
}

fn reopen_as(file: BorrowedFd<'_>, access: rustix::fs::OFlags) -> std::io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let fd = rustix::fs::open(path.as_str(), access | OFlags::CLOEXEC, Mode::empty())?;
    let (a, b) = (rustix::fs::fstat(file)?, rustix::fs::fstat(&fd)?);
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) {
        return Err(std::io::Error::other(
            "/proc/self/fd names another file (a /proc of another PID namespace?)",
        ));
    }
    Ok(fd)
}

/// `fcntl(fd, cmd, &flock { l_type, SEEK_SET, byte, 1 })`; returns the `l_type` the kernel
/// left (for `F_OFD_GETLK`: `F_UNLCK` where nothing conflicts).
fn fcntl_lock(
    fd: BorrowedFd<'_>,
    cmd: libc::c_int,
    l_type: libc::c_short,
    byte: u64,
) -> std::io::Result<libc::c_short> {
    // SAFETY: `flock` is a plain C struct for which all zeroes is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = l_type;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = libc::off_t::try_from(byte).map_err(|_| std::io::Error::other("offset"))?;
    fl.l_len = 1;
    // l_pid must be 0 for the OFD commands (it is, zeroed).
    // SAFETY: `fd` is an open descriptor for the borrow; `fl` is a valid, exclusively borrowed
    // `struct flock` that the kernel reads and (for GETLK) writes.
    let rc = unsafe { libc::fcntl(fd.as_raw_fd(), cmd, &mut fl as *mut libc::flock) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fl.l_type)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_is_seen_through_other_descriptions_and_gone_when_dropped() {
        let file = tempfile::tempfile().expect("temp file");
        file.set_len(4096).expect("size");
        assert_eq!(probe(file.as_fd(), 7), Probe::Free);
        let lock = ByteLock::take(file.as_fd(), 7).expect("lock");
        assert_eq!(probe(file.as_fd(), 7), Probe::Held);
        assert_eq!(probe(file.as_fd(), 8), Probe::Free, "only the one byte");
        let again = ByteLock::take(file.as_fd(), 7).expect("read locks share");
        drop(lock);
        assert_eq!(probe(file.as_fd(), 7), Probe::Held, "the second holder");
        drop(again);
        assert_eq!(probe(file.as_fd(), 7), Probe::Free);
        let excl = ExclusiveLock::try_take(file.as_fd(), 0)
            .expect("lock")
            .expect("free");
        let second = ExclusiveLock::try_take(file.as_fd(), 0).expect("lock");
        assert!(second.is_none(), "taken twice");
        assert_eq!(probe(file.as_fd(), 0), Probe::Held);
        drop(excl);
        assert!(
            ExclusiveLock::try_take(file.as_fd(), 0)
                .expect("lock")
                .is_some()
        );
    }
}
