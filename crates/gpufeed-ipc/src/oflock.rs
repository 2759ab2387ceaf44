//! Liveness that the kernel keeps: a read lock on one byte of a shared file, taken through an
//! open file description of the process's own (`F_OFD_SETLK`) and held for as long as the
//! process uses what the byte stands for. The kernel drops the lock when the last descriptor
//! of that open file description closes: at the latest when the process dies, whatever its
//! PID namespace (the lock belongs to the shared file, not to a pid), and never while it is
//! only stopped. `F_OFD_GETLK` through any other open file description of the file tells
//! whether someone holds the byte, without taking it.
//!
//! So a byte found free proves that its holder is gone, and a byte found held that its holder
//! lives (or is only stopped): a child forked while a lock is held does not keep it, because a
//! `pthread_atfork` child handler (registered with the first lock) closes the descriptor of
//! every lock this process holds in the child — `close` is async-signal-safe; the first thing
//! the child runs — and the child's handles then leave the descriptor alone. Exec closes them
//! too (they are close-on-exec).
//! Only a child made without `fork` and without exec (a raw `clone`) keeps them, and a lock
//! beyond the first [`MAX_TRACKED_LOCKS`] held at once (logged). Every lock is taken through a
//! descriptor opened for it alone (`/proc/thread-self/fd/N` opened again), never through the
//! descriptor the segment is mapped from, so that probing through that one sees every holder,
//! the prober's own other handles included.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};

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
    _fd: LockFd,
}

impl ByteLock {
    /// Takes a read lock on byte `byte` of the file `file` refers to, through a new open file
    /// description of that file; `None` where that cannot be done (no /proc to open the file
    /// again through, a file system without locks), with the reason logged.
    pub(crate) fn take(file: BorrowedFd<'_>, byte: u64) -> Option<ByteLock> {
        let fd = match LockFd::open(file, rustix::fs::OFlags::RDONLY) {
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
    _fd: LockFd,
}

impl ExclusiveLock {
    /// Takes a write lock on byte `byte` of the file `file` refers to, through a new open file
    /// description of it: `Ok(None)` when someone else holds a lock on the byte.
    pub(crate) fn try_take(file: BorrowedFd<'_>, byte: u64) -> std::io::Result<Option<Self>> {
        let fd = LockFd::open(file, rustix::fs::OFlags::RDWR)?;
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

/// The same file as `file` through a new open file description, `access` (`RDONLY` or
/// `RDWR`), checked to be the same inode ([`gpufeed_os::file::reopen`]).
fn reopen_as(file: BorrowedFd<'_>, access: rustix::fs::OFlags) -> std::io::Result<OwnedFd> {
    let write = access.contains(rustix::fs::OFlags::RDWR);
    Ok(gpufeed_os::file::reopen(file, write, 0)?.into())
}

/// How many locks' descriptors the fork handler can close in a child: a lock beyond them (a
/// process attached to that many rings and rendezvous at once) is still taken, but a child
/// forked while it is held keeps it (logged once).
pub(crate) const MAX_TRACKED_LOCKS: usize = 4096;

/// The descriptors of this process's locks (-1: a free place), for the fork child handler.
static LOCK_FDS: [AtomicI32; MAX_TRACKED_LOCKS] = [const { AtomicI32::new(-1) }; MAX_TRACKED_LOCKS];
/// Held (true) while a lock's descriptor is opened and recorded or closed and forgotten, and
/// from the fork's prepare handler to its parent or child handler: so that no fork copies a
/// descriptor that is not recorded yet (or not forgotten yet).
static FD_TABLE_BUSY: AtomicBool = AtomicBool::new(false);
/// Forks since this process began, counted in each child (by the child handler): a lock made
/// before a fork knows by it that it lives in a child, whose handler closed its descriptor.
static FORKS: AtomicU64 = AtomicU64::new(0);

/// `FD_TABLE_BUSY`, held until dropped.
struct TableGuard;

impl TableGuard {
    fn take() -> Self {
        while FD_TABLE_BUSY
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
        TableGuard
    }
}

impl Drop for TableGuard {
    fn drop(&mut self) {
        FD_TABLE_BUSY.store(false, Ordering::Release);
    }
}

extern "C" fn before_fork() {
    // Async-signal-safe: atomics and sched_yield. Waits for a thread that is opening or
    // closing a lock's descriptor (a few system calls).
    while FD_TABLE_BUSY
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        // SAFETY: no preconditions.
        unsafe { libc::sched_yield() };
    }
}

extern "C" fn after_fork_in_parent() {
    FD_TABLE_BUSY.store(false, Ordering::Release);
}

extern "C" fn after_fork_in_child() {
    // Async-signal-safe: atomics and close. The child's only thread; the table is ours (held
    // since before_fork).
    for place in &LOCK_FDS {
        let fd = place.swap(-1, Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: `fd` is a lock's descriptor, inherited from the parent; nothing else in
            // this process uses it (the handle that owns it sees `FORKS` moved and leaves it).
            unsafe { libc::close(fd) };
        }
    }
    FORKS.fetch_add(1, Ordering::Relaxed);
    FD_TABLE_BUSY.store(false, Ordering::Release);
}

/// Registers the fork handlers, once per process.
fn fork_handlers() {
    static REGISTER: std::sync::Once = std::sync::Once::new();
    REGISTER.call_once(|| {
        // SAFETY: the handlers are plain functions valid for the life of the process that
        // only touch statics (atomics) and call async-signal-safe functions.
        let rc = unsafe {
            libc::pthread_atfork(
                Some(before_fork),
                Some(after_fork_in_parent),
                Some(after_fork_in_child),
            )
        };
        if rc != 0 {
            tracing::warn!(
                rc,
                "pthread_atfork failed: a child forked while a lock is held keeps it, so its \
                 holder is not judged dead while the child lives"
            );
        }
    });
}

/// A lock's own descriptor: recorded for the fork child handler, which closes it in a child;
/// closed on drop in the process that opened it (in a child, only if it was not recorded).
#[derive(Debug)]
struct LockFd {
    fd: RawFd,
    /// Its place in `LOCK_FDS`, if it got one.
    place: Option<usize>,
    /// `FORKS` when it was opened.
    forks: u64,
}

impl LockFd {
    /// `file` opened again with `access` (see `reopen_as`), recorded.
    fn open(file: BorrowedFd<'_>, access: rustix::fs::OFlags) -> std::io::Result<Self> {
        fork_handlers();
        let _busy = TableGuard::take();
        let fd = reopen_as(file, access)?.into_raw_fd();
        let place = LOCK_FDS.iter().position(|p| {
            p.compare_exchange(-1, fd, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        });
        if place.is_none() {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                tracing::warn!(
                    "more than {MAX_TRACKED_LOCKS} liveness locks held at once: a child forked \
                     now keeps the ones beyond them"
                );
            });
        }
        Ok(LockFd {
            fd,
            place,
            forks: FORKS.load(Ordering::Relaxed),
        })
    }

    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: `fd` stays open while `self` lives: only `drop` closes it, or the fork child
        // handler in a child, after which `self` is never used for I/O (a handle in a child
        // only drops it; see `Drop`).
        unsafe { BorrowedFd::borrow_raw(self.fd) }
    }
}

impl Drop for LockFd {
    fn drop(&mut self) {
        let _busy = TableGuard::take();
        let in_child = FORKS.load(Ordering::Relaxed) != self.forks;
        if in_child && self.place.is_some() {
            // The child handler closed it (and the number may name another file now).
            return;
        }
        if let Some(place) = self.place {
            LOCK_FDS[place].store(-1, Ordering::Relaxed);
        }
        // SAFETY: our descriptor, open (see above), closed once.
        drop(unsafe { OwnedFd::from_raw_fd(self.fd) });
    }
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
    use std::os::fd::AsFd;

    use super::*;

    /// Held by the tests that fork and by those that check a lock is released: a fork from
    /// another test thread while a lock is being taken (its descriptor open, not yet in the
    /// table the fork handler closes) would leave the lock held by that child for its life.
    static FORKS: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

    /// A child forked while this process holds a lock does not keep it: once the parent
    /// drops it, it is free while the child still runs. (Before, the child shared the lock's
    /// open file description, and the byte stayed held until the child exited.)
    #[test]
    fn a_forked_child_does_not_keep_a_lock() {
        let _forks = FORKS.lock();
        let file = tempfile::tempfile().expect("temp file");
        file.set_len(4096).expect("size");
        let lock = ByteLock::take(file.as_fd(), 3).expect("lock");
        let excl = ExclusiveLock::try_take(file.as_fd(), 5)
            .expect("lock")
            .expect("free");
        let mut pipe = [0; 2];
        // SAFETY: `pipe` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0, "pipe");
        // SAFETY: the child only calls write, alarm and pause (async-signal-safe) until killed.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork");
        if child == 0 {
            // SAFETY: as above. The fork handlers have run when fork returns here: say so.
            unsafe {
                libc::write(pipe[1], b"r".as_ptr().cast(), 1);
                libc::alarm(30);
                loop {
                    libc::pause();
                }
            }
        }
        let mut ready = [0u8; 1];
        // SAFETY: our pipe's read end and a buffer of one byte; both ends closed after.
        unsafe {
            assert_eq!(libc::read(pipe[0], ready.as_mut_ptr().cast(), 1), 1);
            libc::close(pipe[0]);
            libc::close(pipe[1]);
        }
        assert_eq!(probe(file.as_fd(), 3), Probe::Held, "ours");
        drop(lock);
        drop(excl);
        let freed = (probe(file.as_fd(), 3), probe(file.as_fd(), 5));
        // SAFETY: our child, killed and reaped here.
        let alive = unsafe { libc::kill(child, 0) } == 0;
        // SAFETY: as above.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        assert!(alive, "the child ran while the locks were probed");
        assert_eq!(
            freed,
            (Probe::Free, Probe::Free),
            "the forked child kept them"
        );
        // Locks taken after the fork are tracked as before.
        let again = ByteLock::take(file.as_fd(), 3).expect("lock");
        assert_eq!(probe(file.as_fd(), 3), Probe::Held);
        drop(again);
        assert_eq!(probe(file.as_fd(), 3), Probe::Free);
    }

    #[test]
    fn a_lock_is_seen_through_other_descriptions_and_gone_when_dropped() {
        let _forks = FORKS.lock();
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
