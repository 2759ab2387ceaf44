//! Shared memory between processes: named POSIX segments and anonymous memfd segments.
//!
//! A named segment is a file in `/dev/shm` (what `shm_open(3)` does), created with
//! `O_CREAT | O_EXCL` and mode 0600, its whole size reserved with `fallocate` so that a full
//! `/dev/shm` fails at [`ShmSegment::create`] with [`Error::ShmNoSpace`] instead of killing the
//! process with `SIGBUS` at first touch (`ftruncate` reserves nothing). [`ShmSegment::open`]
//! refuses segments of other users, with group/other permission bits, or smaller than
//! expected. An anonymous segment ([`ShmSegment::anonymous`]) is a sealed memfd: it has no name
//! to leak, and its fd can be inherited by or sent to another process.
//!
//! A handle removes its segment's name (on drop where it created it, [`ShmSegment::unlink`],
//! after a create that failed halfway) only while the name still names its file (`lstat`'s
//! device and inode against its descriptor's), so a process that resumes after its name was
//! taken over by a new segment leaves that one alone. Linux cannot unlink by descriptor: a
//! replacement made between that `lstat` and the `unlink` is still removed.
//!
//! Memory another process can write is never handed out as a `&[u8]`: use [`ShmSegment::as_ptr`]
//! with atomics or volatile access, or the copying helpers [`ShmSegment::read_at`] and
//! [`ShmSegment::write_at`].
//!
//! Trust model: a segment is shared by processes of one user. Such a peer can still write
//! garbage into it (treat its contents as untrusted input) but cannot shrink it under us
//! without being that same user.
//!
//! Segments whose creator was killed (`SIGKILL`, the OOM killer) outlive it. Unpinned names
//! ([`ShmSegment::create_unique`]) carry the owner's pid, start time and PID namespace, so
//! [`gc`] can remove exactly the segments of dead owners. A segment created in another PID
//! namespace (a container sharing /dev/shm with `--ipc=host`) is never judged by its pid: gc
//! leaves it unless asked otherwise ([`gc_in_with`]). "Ours" is judged by the file's owner
//! ([`uid_is_ours`]); in a user namespace where our uid reads as the overflow uid because we
//! are not mapped (no uid map), owners cannot be told apart and no segment counts as ours.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{FallocateFlags, Mode, OFlags, SealFlags};
use rustix::io::Errno;

use crate::advise::{self, MemAdvice};
use crate::error::{Error, Result};
use crate::lock::{self, LockedRegion};
use crate::page_size;
use crate::process::{Liveness, ProcessIdentity};

/// The prefix of segment names that gpufeed generates.
pub const DEFAULT_PREFIX: &str = "gpufeed";

/// Where POSIX shared memory lives on Linux.
pub const DEFAULT_DIR: &str = "/dev/shm";

/// Longest segment name accepted (`NAME_MAX`).
pub const MAX_NAME_LEN: usize = 255;

/// Checks a segment name: 1 to 255 bytes, no `/`, no NUL, not `.` or `..`.
pub fn validate_name(name: &str) -> Result<()> {
    let reason = if name.is_empty() {
        "it is empty"
    } else if name.len() > MAX_NAME_LEN {
        "it is longer than 255 bytes"
    } else if name.contains('/') {
        "it contains '/'"
    } else if name.contains('\0') {
        "it contains NUL"
    } else if name == "." || name == ".." {
        "'.' and '..' name directories"
    } else {
        return Ok(());
    };
    Err(Error::InvalidShmName {
        name: name.to_owned(),
        reason,
    })
}

/// A requested segment length rounded up to whole pages; zero is refused.
fn segment_len(len: usize) -> Result<usize> {
    if len == 0 {
        return Err(Error::ZeroLength {
            what: "shared-memory segment",
        });
    }
    len.checked_next_multiple_of(page_size())
        .ok_or(Error::OutOfMemory {
            len,
            align: page_size(),
        })
}

/// Settings for creating and opening named segments; [`ShmSegment`]'s constructors use the
/// defaults.
#[derive(Debug, Clone)]
pub struct ShmOptions {
    dir: PathBuf,
    prefix: String,
    unlink_on_drop: bool,
    min_len: u64,
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            dir: PathBuf::from(DEFAULT_DIR),
            prefix: DEFAULT_PREFIX.to_owned(),
            unlink_on_drop: true,
            min_len: 1,
        }
    }
}

impl ShmOptions {
    /// The defaults: `/dev/shm`, prefix `gpufeed`, unlink on drop, any non-empty size.
    pub fn new() -> Self {
        Self::default()
    }

    /// The directory of the shared-memory file system (a tmpfs), `/dev/shm` by default.
    pub fn dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = dir.into();
        self
    }

    /// The prefix of generated names ([`ShmOptions::create_unique`]), `gpufeed` by default.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Whether the creator removes the name when the segment is dropped (default: yes). Set
    /// `false` to let the segment outlive its creator; [`gc`] removes it once the creator died.
    pub fn unlink_on_drop(mut self, unlink: bool) -> Self {
        self.unlink_on_drop = unlink;
        self
    }

    /// The size [`ShmOptions::open`] requires at least; smaller segments are refused with
    /// [`Error::ShmTooSmall`].
    pub fn min_len(mut self, len: u64) -> Self {
        self.min_len = len.max(1);
        self
    }

    /// Creates the segment `name` of at least `len` bytes (rounded up to whole pages).
    ///
    /// # Errors
    /// [`Error::InvalidShmName`], [`Error::ZeroLength`], [`Error::ShmExists`],
    /// [`Error::ShmNoSpace`] (nothing is left behind), [`Error::Io`].
    pub fn create(&self, name: &str, len: usize) -> Result<ShmSegment> {
        validate_name(name)?;
        let len = segment_len(len)?;
        let path = self.dir.join(name);
        let fd = rustix::fs::open(
            &path,
            OFlags::CREATE | OFlags::EXCL | OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::RUSR | Mode::WUSR,
        )
        .map_err(|e| match e {
            Errno::EXIST => Error::ShmExists {
                name: name.to_owned(),
            },
            Errno::NOENT => Error::io(
                "create shared memory (is the shared-memory directory mounted?)",
                Some(path.clone()),
                e,
            ),
            e => Error::io("create shared memory", Some(path.clone()), e),
        })?;
        // From here on, remove the name again if anything fails (while it is still ours).
        let created = RemoveOnError(file_id(&fd).map(|id| (path.as_path(), id)));
        // The umask may only have removed bits, but make the mode exactly 0600.
        rustix::fs::fchmod(&fd, Mode::RUSR | Mode::WUSR)
            .map_err(|e| Error::io("fchmod", Some(path.clone()), e))?;
        reserve(&fd, len as u64, name, &self.dir)?;
        let segment = ShmSegment::map(
            fd,
            len,
            Some(name.to_owned()),
            Some(path.clone()),
            self.unlink_on_drop,
        )?;
        created.disarm();
        Ok(segment)
    }

    /// Creates a segment with a generated name
    /// `<prefix>-<pid>-<start time>-<pid namespace>-<random>`, which [`gc`] recognises once
    /// this process is dead.
    pub fn create_unique(&self, len: usize) -> Result<ShmSegment> {
        let owner = ProcessIdentity::current();
        loop {
            let name = format!("{}-{}", self.prefix, owner.unique_tag()?);
            match self.create(&name, len) {
                Err(Error::ShmExists { .. }) => continue,
                other => return other,
            }
        }
    }

    /// Opens the existing segment `name` after checking that it belongs to us, has no
    /// group/other permission bits, and has at least [`ShmOptions::min_len`] bytes.
    ///
    /// # Errors
    /// [`Error::InvalidShmName`], [`Error::ShmNotFound`], [`Error::ShmForeignOwner`],
    /// [`Error::ShmInsecureMode`], [`Error::ShmTooSmall`], [`Error::Io`].
    pub fn open(&self, name: &str) -> Result<ShmSegment> {
        validate_name(name)?;
        let path = self.dir.join(name);
        let fd = rustix::fs::open(
            &path,
            OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
        )
        .map_err(|e| match e {
            Errno::NOENT => Error::ShmNotFound {
                name: name.to_owned(),
            },
            e => Error::io("open shared memory", Some(path.clone()), e),
        })?;
        let stat = rustix::fs::fstat(&fd).map_err(|e| Error::io("fstat", Some(path.clone()), e))?;
        let our_uid = rustix::process::geteuid().as_raw();
        if stat.st_uid != our_uid {
            return Err(Error::ShmForeignOwner {
                name: name.to_owned(),
                owner_uid: stat.st_uid,
                our_uid,
            });
        }
        let mode = stat.st_mode & 0o7777;
        if mode & 0o077 != 0 {
            return Err(Error::ShmInsecureMode {
                name: name.to_owned(),
                mode,
            });
        }
        if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(Error::NotRegularFile { path });
        }
        let len = u64::try_from(stat.st_size).unwrap_or(0);
        if len < self.min_len {
            return Err(Error::ShmTooSmall {
                name: name.to_owned(),
                len,
                expected: self.min_len,
            });
        }
        let len = usize::try_from(len).map_err(|_| Error::OutOfMemory {
            len: usize::MAX,
            align: 1,
        })?;
        ShmSegment::map(fd, len, Some(name.to_owned()), Some(path), false)
    }
}

/// Removes a half-created segment's name unless disarmed, if the name is still that file
/// (device, inode).
struct RemoveOnError<'a>(Option<(&'a Path, (u64, u64))>);

impl RemoveOnError<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for RemoveOnError<'_> {
    fn drop(&mut self) {
        if let Some((path, id)) = self.0 {
            let _ = unlink_if_same(path, id);
        }
    }
}

/// The device and inode of `fd`; `None` where `fstat` fails.
fn file_id(fd: impl AsFd) -> Option<(u64, u64)> {
    rustix::fs::fstat(fd).ok().map(|st| (st.st_dev, st.st_ino))
}

/// Removes `path` only while it names (without following symlinks) the file `id` (device,
/// inode): `Ok(true)` when removed, `Ok(false)` when the name is gone or names another file
/// (another process removed ours and made a new one of that name). Linux cannot unlink by
/// descriptor, so a replacement made between the `lstat` and the `unlink` is still removed:
/// in `/dev/shm` (sticky) only a process of the file's owner, or root, can do that.
fn unlink_if_same(path: &Path, id: (u64, u64)) -> std::result::Result<bool, Errno> {
    match rustix::fs::lstat(path) {
        Ok(st) if (st.st_dev, st.st_ino) == id => {}
        Ok(_) | Err(Errno::NOENT) => return Ok(false),
        Err(e) => return Err(e),
    }
    match rustix::fs::unlink(path) {
        Ok(()) => Ok(true),
        Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Reserves `len` bytes of `fd` with `fallocate`, so that a full file system fails now.
fn reserve(fd: &OwnedFd, len: u64, name: &str, dir: &Path) -> Result<()> {
    let no_space = |dir: &Path| {
        let available = rustix::fs::fstatvfs(fd)
            .map(|s| s.f_bavail.saturating_mul(s.f_frsize))
            .unwrap_or(0);
        Error::ShmNoSpace {
            name: name.to_owned(),
            dir: dir.to_path_buf(),
            needed: len,
            available,
        }
    };
    match rustix::fs::fallocate(fd, FallocateFlags::empty(), 0, len) {
        Ok(()) => Ok(()),
        Err(Errno::NOSPC) => Err(no_space(dir)),
        Err(Errno::OPNOTSUPP) => {
            // Not a tmpfs (fallocate unsupported): size it with ftruncate after checking
            // the free space, and say so, since the reservation is now only a check.
            let vfs =
                rustix::fs::fstatvfs(fd).map_err(|e| Error::io("fstatvfs", Some(dir.into()), e))?;
            if vfs.f_bavail.saturating_mul(vfs.f_frsize) < len {
                return Err(no_space(dir));
            }
            tracing::warn!(dir = %dir.display(), "fallocate unsupported here; shared memory sized with ftruncate, so a later shortage of space would raise SIGBUS");
            rustix::fs::ftruncate(fd, len).map_err(|e| Error::io("ftruncate", Some(dir.into()), e))
        }
        Err(e) => Err(Error::io("fallocate", Some(dir.join(name)), e)),
    }
}

/// A mapped shared-memory segment, named (POSIX, in `/dev/shm`) or anonymous (memfd).
///
/// # Example
/// ```
/// use gpufeed_os::shm::ShmSegment;
/// let seg = ShmSegment::create_unique(1 << 20)?; // gpufeed-<pid>-<start>-<pid ns>-<random>
/// seg.write_at(0, b"batch 0")?;
/// let other = ShmSegment::open(seg.name().unwrap())?; // what another process would do
/// let mut buf = [0u8; 7];
/// other.read_at(0, &mut buf)?;
/// assert_eq!(&buf, b"batch 0");
/// # Ok::<(), gpufeed_os::Error>(())
/// ```
#[derive(Debug)]
pub struct ShmSegment {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
    name: Option<String>,
    path: Option<PathBuf>,
    unlink_on_drop: bool,
}

// SAFETY: the segment's memory is mapped in the whole process and every access goes through
// raw pointers or copies that the caller synchronises; no reference into it is handed out.
unsafe impl Send for ShmSegment {}
// SAFETY: as above.
unsafe impl Sync for ShmSegment {}

impl ShmSegment {
    /// Creates the named segment `name` with the default [`ShmOptions`]; see
    /// [`ShmOptions::create`].
    pub fn create(name: &str, len: usize) -> Result<Self> {
        ShmOptions::new().create(name, len)
    }

    /// Creates a segment with a generated name; see [`ShmOptions::create_unique`].
    pub fn create_unique(len: usize) -> Result<Self> {
        ShmOptions::new().create_unique(len)
    }

    /// Opens the named segment `name` with the default [`ShmOptions`]; see
    /// [`ShmOptions::open`].
    pub fn open(name: &str) -> Result<Self> {
        ShmOptions::new().open(name)
    }

    /// Creates an anonymous segment on a memfd, sealed against growing and shrinking, so it can
    /// be handed to another process ([`ShmSegment::as_fd`], inherited or sent with
    /// `SCM_RIGHTS`) and mapped there with [`ShmSegment::from_fd`].
    pub fn anonymous(len: usize) -> Result<Self> {
        let len = segment_len(len)?;
        let fd = rustix::fs::memfd_create(
            "gpufeed-anon",
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| Error::io("memfd_create", None, e))?;
        match rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len as u64) {
            Ok(()) => {}
            Err(Errno::NOSPC) | Err(Errno::NOMEM) => {
                return Err(Error::OutOfMemory {
                    len,
                    align: page_size(),
                });
            }
            Err(e) => return Err(Error::io("fallocate", None, e)),
        }
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| Error::io("fcntl(F_ADD_SEALS)", None, e))?;
        Self::map(fd, len, None, None, false)
    }

    /// Maps a memfd received from another process (inherited, or over a Unix socket).
    ///
    /// # Errors
    /// [`Error::ShmUnsealed`] when the fd is not sealed against shrinking (its sender could
    /// then raise SIGBUS in us); [`Error::ShmTooSmall`] when it is empty.
    pub fn from_fd(fd: OwnedFd) -> Result<Self> {
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|e| Error::io("fcntl(F_GET_SEALS)", None, e))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(Error::ShmUnsealed);
        }
        let stat = rustix::fs::fstat(&fd).map_err(|e| Error::io("fstat", None, e))?;
        let len = usize::try_from(stat.st_size).unwrap_or(0);
        if len == 0 {
            return Err(Error::ShmTooSmall {
                name: "<memfd>".to_owned(),
                len: 0,
                expected: 1,
            });
        }
        Self::map(fd, len, None, None, false)
    }

    fn map(
        fd: OwnedFd,
        len: usize,
        name: Option<String>,
        path: Option<PathBuf>,
        unlink_on_drop: bool,
    ) -> Result<Self> {
        // SAFETY: a fresh shared mapping of a file we hold; it aliases no Rust memory.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| Error::io("mmap", path.clone(), e))?;
        Ok(ShmSegment {
            ptr: ptr.cast(),
            len,
            fd,
            name,
            path,
            unlink_on_drop,
        })
    }

    /// The first byte of the mapping (page-aligned). Other processes may write this memory at
    /// any time: access it with atomics, volatile reads or copies, never through a reference.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Mapped length in bytes (a whole number of pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty segments are refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The segment's name; `None` for an anonymous segment.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The segment's file (`/dev/shm/<name>`); `None` for an anonymous segment.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Whether dropping this handle removes the name.
    pub fn unlinks_on_drop(&self) -> bool {
        self.unlink_on_drop
    }

    /// Chooses whether dropping this handle removes the name (only the creator does by
    /// default).
    pub fn set_unlink_on_drop(&mut self, unlink: bool) {
        self.unlink_on_drop = unlink;
    }

    /// Removes the segment's name now: no new process can open it, while every process that
    /// has it mapped keeps using it. Only while the name is still this segment (device and
    /// inode of its descriptor): where another process removed it and made a new segment of
    /// that name meanwhile (a new job, while this one was stopped), the new one is left alone.
    /// A no-op for anonymous segments.
    ///
    /// # Errors
    /// [`Error::Io`] where the name cannot be examined or removed (`EPERM`, `EACCES`).
    pub fn unlink(&mut self) -> Result<()> {
        self.unlink_on_drop = false;
        let Some(path) = &self.path else {
            return Ok(());
        };
        let id = rustix::fs::fstat(&self.fd)
            .map(|st| (st.st_dev, st.st_ino))
            .map_err(|e| Error::io("fstat", Some(path.clone()), e))?;
        match unlink_if_same(path, id) {
            Ok(true) => Ok(()),
            Ok(false) => {
                tracing::debug!(path = %path.display(), "the segment's name now names another file (or none); left alone");
                Ok(())
            }
            Err(e) => Err(Error::io("unlink shared memory", Some(path.clone()), e)),
        }
    }

    /// Copies `dst.len()` bytes from the segment, starting at `offset`, into `dst`.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        // SAFETY: the range is inside the mapping (checked); dst is private memory, which
        // cannot overlap a shared mapping.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the segment at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        // SAFETY: as in read_at, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) };
        Ok(())
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                capacity: self.len,
            }),
        }
    }

    /// Faults every page in writable now (`MADV_POPULATE_WRITE`), so that the first pass over
    /// the segment takes no page faults.
    pub fn populate(&self) -> Result<()> {
        advise::madvise(self.ptr, self.len, MemAdvice::PopulateWrite)
    }

    /// Advises the kernel how the segment will be accessed; see [`advise::madvise`].
    pub fn advise(&self, advice: MemAdvice) -> Result<()> {
        advise::madvise(self.ptr, self.len, advice)
    }

    /// Locks the segment into RAM for as long as the guard lives; see [`lock::mlock`].
    pub fn lock(&self) -> Result<LockedRegion<'_>> {
        // SAFETY: the mapping lives as long as `self`, which the guard borrows.
        let locked = unsafe { lock::mlock_raw(self.ptr, self.len)? };
        Ok(locked)
    }
}

impl AsFd for ShmSegment {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        // SAFETY: ptr/len is our mapping; no reference into it exists (only raw pointers were
        // handed out, whose users must not outlive the segment).
        if let Err(err) = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) } {
            tracing::warn!(%err, "munmap of shared memory failed");
        }
        if !self.unlink_on_drop {
            return;
        }
        let Some(path) = &self.path else { return };
        // Remove the name only if it still refers to our file: someone may have unlinked it
        // and created another segment of the same name since (see `unlink_if_same`).
        if let Some(id) = file_id(&self.fd)
            && let Err(err) = unlink_if_same(path, id)
        {
            tracing::warn!(%err, path = %path.display(), "could not remove shared memory");
        }
    }
}

/// A segment found by [`list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmEntry {
    /// Its name.
    pub name: String,
    /// Its size in bytes.
    pub len: u64,
    /// The creator's pid (in its own PID namespace).
    pub owner_pid: u32,
    /// The creator's PID namespace (inode; 0 for names that do not record it).
    pub owner_pid_ns: u64,
    /// Whether the creator still runs; [`Liveness::OtherNamespace`] for a creator in another
    /// PID namespace (a container sharing /dev/shm), whose pid says nothing here.
    pub owner: Liveness,
}

/// Whether a file whose owner reads as `uid` here belongs to us (our effective uid).
///
/// In a user namespace that does not map every uid (`unshare --user` without a uid map, a
/// rootless container), the owner of every file of an unmapped user reads as the overflow uid
/// (`/proc/sys/kernel/overflowuid`, 65534). Where our own uid reads as that too because we
/// are not mapped ourselves (`/proc/self/uid_map` does not cover our effective uid), a file's
/// uid cannot tell ours from others': nothing is ours by uid. Where we are mapped, our uid is
/// ours, the overflow uid too (a job really running as 65534, `unshare --user
/// --map-user=65534`); there a file of an unmapped user also reads as 65534 and so as ours
/// (the kernel still refuses to let us remove or open it as its owner: gc records it as
/// skipped). The map is read once per process (again after a `fork`).
pub fn uid_is_ours(uid: u32) -> bool {
    let euid = rustix::process::geteuid().as_raw();
    uid == euid && (euid != overflow_uid() || euid_is_mapped(euid))
}

/// `/proc/sys/kernel/overflowuid` (65534 where unreadable).
fn overflow_uid() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/overflowuid")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65534)
}

/// Whether `/proc/self/uid_map` maps our effective uid `euid` (a line `inside outside count`
/// with `inside <= euid < inside + count`); false where it cannot be read. Cached per process
/// together with the uid it was asked about.
fn euid_is_mapped(euid: u32) -> bool {
    static MAPPED: crate::process::PerProcess = crate::process::PerProcess::new();
    let read = || (u64::from(euid) << 1) | u64::from(uid_map_covers(euid));
    let mut cached = MAPPED.get(read);
    if (cached >> 1) as u32 != euid {
        // Our uid changed since (setuid): ask again, without caching.
        cached = read();
    }
    cached & 1 == 1
}

/// Whether `/proc/self/uid_map` covers `uid` (false where unreadable).
fn uid_map_covers(uid: u32) -> bool {
    std::fs::read_to_string("/proc/self/uid_map").is_ok_and(|map| {
        map.lines().any(|l| {
            let n: Vec<u64> = l
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            matches!(n[..], [inside, _, count] if inside <= u64::from(uid) && u64::from(uid) < inside + count)
        })
    })
}

/// The segments in [`DEFAULT_DIR`] whose names were generated with `prefix`
/// (`<prefix>-<pid>-<start>-<pid namespace>-<random>`) and which belong to our user
/// ([`uid_is_ours`]: none where we are unmapped in a user namespace, our uid the overflow
/// uid).
pub fn list(prefix: &str) -> Result<Vec<ShmEntry>> {
    list_in(Path::new(DEFAULT_DIR), prefix)
}

/// Like [`list`], in another directory.
pub fn list_in(dir: &Path, prefix: &str) -> Result<Vec<ShmEntry>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("read_dir", Some(dir.into()), e))?;
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let Some(owner) = name
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix('-'))
            .and_then(ProcessIdentity::from_tag)
        else {
            continue;
        };
        let Ok(stat) = rustix::fs::lstat(dir.join(&name)) else {
            continue;
        };
        let regular =
            rustix::fs::FileType::from_raw_mode(stat.st_mode) == rustix::fs::FileType::RegularFile;
        if !regular || !uid_is_ours(stat.st_uid) {
            continue;
        }
        found.push(ShmEntry {
            name,
            len: u64::try_from(stat.st_size).unwrap_or(0),
            owner_pid: owner.pid,
            owner_pid_ns: owner.pid_ns,
            owner: owner.liveness(),
        });
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(found)
}

/// What [`gc`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Names removed (their owner was dead, or of another namespace when asked to).
    pub removed: Vec<String>,
    /// Bytes those segments held.
    pub removed_bytes: u64,
    /// Names kept because their owner still runs.
    pub kept: Vec<String>,
    /// Names kept because their owner lives in another PID namespace (or its namespace is not
    /// recorded), where its pid cannot tell whether it runs.
    pub other_namespace: Vec<String>,
    /// Segments of dead owners that could not be removed (`EPERM`, `EACCES`, ...), with why;
    /// gc went on with the others.
    pub skipped: Vec<GcSkipped>,
}

/// A segment [`gc`] would have removed but could not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GcSkipped {
    /// Its name.
    pub name: String,
    /// Why, in words (the kernel's error).
    pub reason: String,
}

/// What [`gc_in_with`] does with segments whose creator lives in another PID namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForeignSegments {
    /// Leave them: their owner may be alive (the default).
    #[default]
    Keep,
    /// Remove them too, for a user who knows that no container still uses them.
    Remove,
}

/// Removes the segments in `/dev/shm` named `<prefix>-<pid>-<start>-<ns>-<random>` that belong
/// to our user ([`uid_is_ours`]) and whose creator, of our PID namespace, is dead, and only
/// those. Segments whose creator runs, whose creator lives in another PID namespace, of other
/// users and names of any other form are left alone. A segment that cannot be removed
/// (`EPERM`) is recorded in [`GcReport::skipped`] and gc goes on.
///
/// # Errors
/// [`Error::Io`] only where the directory cannot be read.
pub fn gc(prefix: &str) -> Result<GcReport> {
    gc_in(Path::new(DEFAULT_DIR), prefix)
}

/// Like [`gc`], in another directory.
pub fn gc_in(dir: &Path, prefix: &str) -> Result<GcReport> {
    gc_in_with(dir, prefix, ForeignSegments::Keep)
}

/// Like [`gc_in`], saying what to do with segments of other PID namespaces.
pub fn gc_in_with(dir: &Path, prefix: &str, foreign: ForeignSegments) -> Result<GcReport> {
    let mut report = GcReport::default();
    for entry in list_in(dir, prefix)? {
        match (entry.owner, foreign) {
            (Liveness::Alive, _) => {
                report.kept.push(entry.name);
                continue;
            }
            (Liveness::OtherNamespace, ForeignSegments::Keep) => {
                report.other_namespace.push(entry.name);
                continue;
            }
            _ => {}
        }
        match rustix::fs::unlink(dir.join(&entry.name)) {
            Ok(()) => {
                report.removed_bytes += entry.len;
                report.removed.push(entry.name);
            }
            Err(Errno::NOENT) => {} // removed by someone else meanwhile
            Err(e) => {
                tracing::warn!(name = %entry.name, "gc could not remove a dead owner's segment: {e}");
                report.skipped.push(GcSkipped {
                    name: entry.name,
                    reason: format!("unlink: {e}"),
                });
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        for bad in ["", "a/b", "/x", ".", "..", "nul\0"] {
            assert!(
                matches!(validate_name(bad), Err(Error::InvalidShmName { .. })),
                "{bad:?} accepted"
            );
        }
        assert!(validate_name(&"x".repeat(256)).is_err());
        assert!(validate_name(&"x".repeat(255)).is_ok());
        assert!(validate_name("gpufeed-1-2-ab").is_ok());
    }

    #[test]
    fn owner_tags_parse() {
        assert_eq!(
            ProcessIdentity::from_tag("123-456-00ff"),
            Some(ProcessIdentity {
                pid_ns: 0,
                pid: 123,
                start_ticks: 456
            })
        );
        assert_eq!(
            ProcessIdentity::from_tag("123-456-4026531836-00ff"),
            Some(ProcessIdentity {
                pid_ns: 4026531836,
                pid: 123,
                start_ticks: 456
            })
        );
        assert_eq!(ProcessIdentity::from_tag("123-456-ns-00ff"), None);
        assert_eq!(ProcessIdentity::from_tag("123-456-"), None);
        assert_eq!(ProcessIdentity::from_tag("123-456-xyz"), None);
        assert_eq!(ProcessIdentity::from_tag("abc-456-00"), None);
        assert_eq!(ProcessIdentity::from_tag("123"), None);
    }
}
