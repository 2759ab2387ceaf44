//! The Unix sockets of [`crate::Rendezvous::share_fd`]: each in a private directory (mode
//! 0700, ours, a random name in the shared-memory directory) so that no other user can even
//! reach it, with the peer's credentials (`SO_PEERCRED`) checked on both ends, and the removal
//! of what ranks killed inside the call left behind.

use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpufeed_os::shm::{GcReport, GcSkipped};
use rustix::fs::Mode;

use crate::error::{Error, Result};

/// The name prefix of the socket directories (and, before, of the sockets themselves).
pub(crate) const SOCKET_PREFIX: &str = ".gpufeed-fd-";

/// The socket's name inside its directory.
const SOCKET_NAME: &str = "s";

fn io(op: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |source| Error::Io { op, source }
}

fn errno(op: &'static str) -> impl Fn(rustix::io::Errno) -> Error {
    move |e| Error::Io {
        op,
        source: e.into(),
    }
}

/// A directory of ours, mode 0700, removed with the socket in it when this drops.
#[derive(Debug)]
pub(crate) struct PrivateDir {
    name: String,
    path: PathBuf,
}

impl PrivateDir {
    /// Makes `<parent>/<stem>-<16 random hex digits>` with mode exactly 0700 (whatever the
    /// umask) and checks that it is a directory of ours with that mode: in a sticky directory
    /// such as /dev/shm nobody else can rename or replace it after that.
    pub(crate) fn create(parent: &Path, stem: &str) -> Result<Self> {
        let mut random = [0u8; 8];
        rustix::rand::getrandom(&mut random, rustix::rand::GetRandomFlags::empty())
            .map_err(errno("getrandom"))?;
        let name = format!("{stem}-{:016x}", u64::from_ne_bytes(random));
        let path = parent.join(&name);
        rustix::fs::mkdir(&path, Mode::RWXU).map_err(errno("create a private socket directory"))?;
        let dir = PrivateDir { name, path };
        // The umask may have taken bits away (never added any): make it exactly 0700.
        rustix::fs::chmod(&dir.path, Mode::RWXU)
            .map_err(errno("chmod a private socket directory"))?;
        let st = rustix::fs::lstat(&dir.path).map_err(errno("stat a private socket directory"))?;
        let ours = rustix::process::geteuid().as_raw();
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Directory
            || st.st_uid != ours
            || st.st_mode & 0o777 != 0o700
        {
            return Err(Error::Io {
                op: "create a private socket directory",
                source: std::io::Error::other(format!(
                    "{} is not a directory of uid {ours} with mode 0700 (uid {}, mode {:o})",
                    dir.path.display(),
                    st.st_uid,
                    st.st_mode & 0o7777
                )),
            });
        }
        Ok(dir)
    }

    /// Its name in the parent directory.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Where its socket is.
    pub(crate) fn socket_path(&self) -> PathBuf {
        self.path.join(SOCKET_NAME)
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.socket_path());
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// Where the socket of the private directory `name` in `parent` is.
pub(crate) fn socket_in(parent: &Path, name: &str) -> PathBuf {
    parent.join(name).join(SOCKET_NAME)
}

/// A non-blocking Unix socket listening at `path`, with room for every rank's connection at
/// once (so that no rank's `connect` waits for an `accept`).
pub(crate) fn listen_at(path: &Path, backlog: usize) -> Result<UnixListener> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(errno("create a Unix socket"))?;
    let addr = SocketAddrUnix::new(path).map_err(errno("name a Unix socket"))?;
    rustix::net::bind(&sock, &addr).map_err(errno("bind a Unix socket in /dev/shm"))?;
    rustix::net::listen(&sock, backlog as i32).map_err(errno("listen on a Unix socket"))?;
    Ok(UnixListener::from(sock))
}

/// The credentials of a connected Unix socket's peer (`SO_PEERCRED`): its pid as seen in our
/// PID namespace (0 where it is not visible here) and its uid, as they were when it connected
/// (or, for a listener, when it listened).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PeerCred {
    pub pid: u32,
    pub uid: u32,
}

/// `getsockopt(fd, SOL_SOCKET, SO_PEERCRED)` — the peer's credentials (`socket(7)`).
pub(crate) fn peer_cred(socket: impl AsFd) -> std::io::Result<PeerCred> {
    // SAFETY: `ucred` is a plain C struct for which all zeroes is valid.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the descriptor is open for the borrow; `cred` and `len` are valid, exclusively
    // borrowed, and `len` says how large `cred` is.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(PeerCred {
        pid: u32::try_from(cred.pid).unwrap_or(0),
        uid: cred.uid,
    })
}

/// Removes what ranks killed inside `share_fd` left in `dir`: the private directories
/// `.gpufeed-fd-*` of this user with their sockets, and sockets of that name of the earlier
/// form, last changed more than `older_than` ago. One that cannot be removed (`EPERM` of an
/// immutable directory, `EACCES`, ...) is recorded in [`GcReport::skipped`] with why, and the
/// others are still removed. Returns the names removed ([`GcReport::removed`], sorted) and
/// those skipped.
///
/// # Errors
/// [`Error::Io`] only when `dir` itself cannot be read.
pub(crate) fn remove_stale(dir: &Path, older_than: Duration) -> Result<GcReport> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let me = rustix::process::geteuid().as_raw();
    let now = std::time::SystemTime::now();
    let mut report = GcReport::default();
    for entry in std::fs::read_dir(dir).map_err(io("read the shared-memory directory"))? {
        let entry = entry.map_err(io("read the shared-memory directory"))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(SOCKET_PREFIX) {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(entry.path()) else {
            continue; // gone meanwhile
        };
        let old = meta
            .modified()
            .ok()
            .and_then(|m| now.duration_since(m).ok())
            .is_some_and(|age| age > older_than);
        if meta.uid() != me || !old {
            continue;
        }
        let gone = if meta.file_type().is_socket() {
            std::fs::remove_file(entry.path())
        } else if meta.file_type().is_dir() {
            remove_socket_dir(&entry.path())
        } else {
            continue;
        };
        match gone {
            Ok(()) => report.removed.push(name),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(%name, "could not remove a stale descriptor socket: {e}");
                report.skipped.push(GcSkipped {
                    name,
                    reason: format!("remove: {e}"),
                });
            }
        }
    }
    report.removed.sort();
    report.skipped.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(report)
}

/// Empties and removes a socket directory of ours: opened without following links, its
/// entries (none of them directories) removed relative to it, then itself.
fn remove_socket_dir(path: &Path) -> std::io::Result<()> {
    use rustix::fs::{AtFlags, OFlags};
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    for entry in rustix::fs::Dir::read_from(&fd)? {
        let entry = entry?;
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        match rustix::fs::unlinkat(&fd, name, AtFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(e.into()),
        }
    }
    std::fs::remove_dir(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `FS_IMMUTABLE_FL` (`chattr +i`), from linux/fs.h.
    const FS_IMMUTABLE_FL: libc::c_int = 0x10;

    /// Sets or clears the immutable flag of the directory `path`.
    fn set_immutable(path: &Path, on: bool) -> std::io::Result<()> {
        use rustix::fs::OFlags;
        let fd = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let mut flags: libc::c_int = 0;
        // SAFETY: `fd` is open; FS_IOC_GETFLAGS and FS_IOC_SETFLAGS read or write one int
        // through the pointer, which is valid and exclusively borrowed.
        unsafe {
            if libc::ioctl(fd.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            flags = if on {
                flags | FS_IMMUTABLE_FL
            } else {
                flags & !FS_IMMUTABLE_FL
            };
            if libc::ioctl(fd.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// A stale socket directory that cannot be emptied (immutable: `EPERM`, even for root) is
    /// reported as skipped, and gc goes on: another stale one is removed. (Before, the first
    /// error ended the whole `gpufeed shm gc` with it, leaving the other directory too.)
    #[test]
    fn a_stale_socket_directory_that_cannot_be_removed_is_skipped_and_gc_goes_on() {
        let test = "a_stale_socket_directory_that_cannot_be_removed_is_skipped_and_gc_goes_on";
        let dir = tempfile::tempdir().expect("tempdir");
        let stuck = dir.path().join(".gpufeed-fd-00aa-2-1-0123456789abcdef");
        let stale = dir.path().join(".gpufeed-fd-00aa-2-0-0123456789abcdef");
        for d in [&stuck, &stale] {
            std::fs::create_dir(d).expect("mkdir");
            drop(std::os::unix::net::UnixListener::bind(d.join(SOCKET_NAME)).expect("bind"));
        }
        if let Err(e) = set_immutable(&stuck, true) {
            assert!(
                !matches!(e.raw_os_error(), Some(libc::EPERM))
                    || rustix::process::geteuid().as_raw() != 0,
                "{test}: chattr +i as root failed: {e}"
            );
            eprintln!("SKIP {test}: cannot make a directory immutable here: {e}");
            return;
        }
        // Stale at once (older than nothing).
        std::thread::sleep(Duration::from_millis(20));
        let report = remove_stale(dir.path(), Duration::from_millis(1));
        set_immutable(&stuck, false).expect("chattr -i");
        let report = report.expect("gc goes on past what it cannot remove");
        assert_eq!(
            report.removed,
            vec![".gpufeed-fd-00aa-2-0-0123456789abcdef".to_owned()]
        );
        assert_eq!(report.skipped.len(), 1, "{report:?}");
        assert_eq!(
            report.skipped[0].name,
            ".gpufeed-fd-00aa-2-1-0123456789abcdef"
        );
        assert!(
            report.skipped[0].reason.contains("not permitted"),
            "{report:?}"
        );
        assert!(stuck.join(SOCKET_NAME).exists() && !stale.exists());
    }
}
