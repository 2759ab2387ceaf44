//! Files replaced whole or not at all: [`AtomicFile`] writes a temporary file in a private
//! directory beside the target, and [`AtomicFile::commit`] syncs the data, renames it over the
//! target and syncs the directory. A process killed at any point leaves the old file or the new
//! one, complete; its temporary is removed by a later [`AtomicFile::create`] in the same
//! directory once it is known stale (see below).
//!
//! # Layout and naming
//! `create` opens the target's directory once (`O_DIRECTORY`) and makes in it a private
//! directory `.gpufeed-tmp-<boot id>-<pid>-<start ticks>-<pid namespace>-<random>` (the boot id
//! of `/proc/sys/kernel/random/boot_id` as 32 hex digits, zeros where unreadable, then
//! [`crate::process::ProcessIdentity::unique_tag`]) with `mkdirat(.., 0700)`, and opens it by
//! that name (`O_DIRECTORY | O_NOFOLLOW`). Another user who may write the target's directory
//! can exchange the name for another directory (`renameat2(RENAME_EXCHANGE)`) between the two
//! calls, so what was opened is checked before anything is done in it: ours (our uid), no
//! mode bit a new directory of ours lacks that would let others in (write for group or
//! others, sticky, set-user-id; set-group-id only where the target's directory has it), no
//! subdirectory (`nlink` at most 2) and empty; anything else is [`Error::UnsafeTemporary`],
//! and nothing in it is changed. `mkdir` gives 0700 less the umask; a file system that shows
//! every directory with one mode (a CIFS `dir_mode`) is taken as it shows where that mode
//! lets nobody else write. Only where the umask took bits from 0700 (the mode is exactly
//! what it left) is the verified directory then `fchmod`ed to 0700. The temporary file is created
//! inside it with `openat` (`O_EXCL | O_NOFOLLOW`, mode 0600) under the target's own name, so
//! the name in the shared directory does not grow with the target's (a 255-byte target name
//! works). The commit is `renameat(private dir, name, target dir, name)`: descriptor-relative,
//! it never follows a symlink planted at the target (the symlink is replaced), and no name
//! another user can change is ever resolved again. The private directory is then removed by
//! name only while that name is still it (device and inode). The bytes go only to the
//! descriptor `create` made: [`AtomicFile::file`], or [`AtomicFile::reopen`] /
//! [`AtomicFile::path`] (`/proc/self/fd/<n>`, which the kernel resolves to the open file, not
//! by name) for a second descriptor with other flags (`O_DIRECT`), checked by
//! [`AtomicFile::check_same_file`].
//!
//! # Stale temporaries
//! A directory on a network file system (NFS, Lustre) is shared by hosts whose pids mean
//! nothing to each other, and whose init PID namespaces have the same inode. And in a
//! directory others may write without the sticky bit (a team directory, 0777 or 2775), anyone
//! can rename any entry, our own directories included, to a temporary's name. So `create`
//! removes a private directory only when all of these hold:
//! - its name carries this boot's id (this host, since its last boot; a name without a boot
//!   id, as earlier versions wrote, is never judged, and is left for a person to remove);
//! - its writer is known dead ([`ProcessIdentity::is_dead`]: of our PID namespace, gone or its
//!   pid reused);
//! - it has exactly a temporary's shape: a directory (not followed if a symlink) of our uid,
//!   mode 0700 (set-group-id allowed), no subdirectory (`nlink` at most 2), holding nothing or
//!   one regular file of our uid with one link;
//! - when it holds that file, it was not renamed since the file was created in it: its ctime
//!   equals its mtime (every rename sets the ctime of what it moves, and nobody can set a
//!   ctime back). An old directory of ours that another user renamed to such a name therefore
//!   keeps its file. (Timestamps are coarse, one clock tick: a rename within a tick of the
//!   file's creation is not told apart.) On a file system whose directories' ctime and mtime
//!   differ after a create, temporaries are never removed (the safe direction);
//! - neither the file (or, for an empty directory, the directory) was modified for
//!   [`STALE_AFTER`] (15 minutes).
//!
//! Removal goes through descriptors: the directory opened with `O_NOFOLLOW` and checked by
//! `fstat`, the file unlinked with `unlinkat` on that descriptor after its device and inode
//! were checked again, then the directory removed by name while the name is still it. What
//! remains: between that last check and the `rmdir` another user who may write the directory
//! can put another empty directory of ours under the name, which is then removed (an empty
//! directory such a user could remove anyway).
//!
//! # Mode and owner
//! Before the rename the new file gets, from the entry it replaces (`fstatat` on the
//! directory's descriptor, not following symlinks):
//! - a regular file of ours: its permission bits (0777; set-id bits are dropped) and, where
//!   permitted, its group;
//! - a regular file of another user who could not have planted it (it has one link, and the
//!   target's directory is not writable by group or others, or belongs to that user): its
//!   permission bits and, where permitted (as root; `EPERM` is ignored), its owner and group;
//!   where the owner could not be given (not root), the bits less the umask;
//! - a regular file another user could have planted (a sticky or team directory, or a hard
//!   link to another file): our uid and group, and its permission bits less the umask (a
//!   squatter's 0777 becomes 0755 under umask 022), so that nobody else can rewrite our save;
//! - anything else (a symlink, a FIFO, ...): 0600, since its target's mode is unknown.
//!
//! A new target gets `0666 & ~umask`, as a plain create would (the umask read from
//! `/proc/self/status`, 022 assumed where it cannot be). ACLs and extended attributes are not
//! copied.

use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::error::{Error, Result};
use crate::process::ProcessIdentity;
use crate::procfs;

/// The prefix of the private directories that hold temporary files.
const TMP_PREFIX: &str = ".gpufeed-tmp-";

/// How long a dead writer's temporary must have gone unmodified before [`AtomicFile::create`]
/// removes it: a guard for what the boot id and the pid cannot tell (a host cloned with its
/// boot id), long enough for any writer to have touched its file.
pub const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// This boot's id (`/proc/sys/kernel/random/boot_id`, dashes removed, 32 lower-case hex
/// digits); `None` where unreadable.
fn boot_id() -> Option<&'static str> {
    static ID: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let hex: String = text.trim().chars().filter(|&c| c != '-').collect();
        let hex = hex.to_ascii_lowercase();
        (hex.len() == 32
            && hex.bytes().all(|b| b.is_ascii_hexdigit())
            && hex.bytes().any(|b| b != b'0'))
        .then_some(hex)
    })
    .as_deref()
}

/// The name of a private directory for `owner` (see the module docs).
fn temporary_name(owner: &ProcessIdentity) -> Result<String> {
    Ok(format!(
        "{TMP_PREFIX}{}-{}",
        boot_id().unwrap_or("00000000000000000000000000000000"),
        owner.unique_tag()?
    ))
}

/// The boot id and writer a temporary's name records: `(None, writer)` for names without a boot
/// id (written by earlier versions: `.gpufeed-tmp-<tag>`, or `.<target>.gpufeed-tmp-<tag>`
/// beside the target); `None` for names that are no temporary's.
fn temporary_owner(name: &str) -> Option<(Option<&str>, ProcessIdentity)> {
    if let Some(rest) = name.strip_prefix(TMP_PREFIX)
        && let Some((boot, tag)) = rest.split_once('-')
        && boot.len() == 32
        && boot.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return Some((Some(boot), ProcessIdentity::from_tag(tag)?));
    }
    let (_, tag) = name.split_once(TMP_PREFIX)?;
    Some((None, ProcessIdentity::from_tag(tag)?))
}

/// A file being written under a temporary name, to replace its target in one step.
///
/// Dropped without [`AtomicFile::commit`], it removes its temporary file and the target stays
/// as it was.
///
/// # Example
/// ```
/// use std::io::Write;
/// # let dir = tempfile::tempdir()?;
/// let target = dir.path().join("model.bin");
/// std::fs::write(&target, b"old")?;
/// let mut f = gpufeed_os::AtomicFile::create(&target, None)?;
/// f.file().write_all(b"new contents")?;
/// assert_eq!(std::fs::read(&target)?, b"old"); // not replaced until the commit
/// f.commit()?;
/// assert_eq!(std::fs::read(&target)?, b"new contents");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct AtomicFile {
    target: PathBuf,
    /// The target's directory, opened once.
    dir: OwnedFd,
    /// The target's name in `dir`, also the temporary's name in `private`.
    name: OsString,
    private: PrivateDir,
    file: File,
    /// `/proc/self/fd/<file>`.
    fd_path: PathBuf,
    /// Our umask (022 where /proc does not say).
    umask: u32,
    committed: bool,
    cleaned: Vec<PathBuf>,
}

/// The private directory a temporary lives in.
#[derive(Debug)]
struct PrivateDir {
    fd: OwnedFd,
    /// Its name in the target's directory.
    name: OsString,
    /// Its device and inode, to remove it by name only while the name is still it.
    id: (u64, u64),
    /// Its path, for messages.
    path: PathBuf,
}

impl PrivateDir {
    /// Makes a fresh private directory in `dir` and opens it, checked (see the module docs:
    /// a directory exchanged for ours between the `mkdirat` and the `openat` is refused,
    /// untouched).
    fn create(dir: &OwnedFd, dir_path: &Path, needed: u64, umask: u32) -> Result<Self> {
        let owner = ProcessIdentity::current();
        let euid = rustix::process::geteuid().as_raw();
        let parent =
            rustix::fs::fstat(dir).map_err(|e| Error::io("fstat", dir_path.to_path_buf(), e))?;
        let setgid = parent.st_mode & 0o2000;
        // What mkdir(0700) gives here: the umask only takes bits.
        let made_bits = 0o700 & !umask;
        loop {
            let name = OsString::from(temporary_name(&owner)?);
            let path = dir_path.join(&name);
            match rustix::fs::mkdirat(dir, name.as_os_str(), Mode::RWXU) {
                Ok(()) => {}
                Err(Errno::EXIST) => continue,
                Err(Errno::NOSPC) => {
                    return Err(Error::NoSpace {
                        path: dir_path.into(),
                        needed,
                    });
                }
                Err(e) => return Err(Error::io("mkdir", path, e)),
            }
            let unsafe_dir = |reason: String| Error::UnsafeTemporary {
                path: path.clone(),
                reason,
            };
            let fd = rustix::fs::openat(
                dir,
                name.as_os_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| {
                unsafe_dir(format!(
                    "the private directory just made was moved or replaced before it could be \
                     opened ({e})"
                ))
            })?;
            let st = rustix::fs::fstat(&fd).map_err(|e| Error::io("fstat", path.clone(), e))?;
            let mode = st.st_mode & 0o7777;
            if st.st_uid != euid {
                return Err(unsafe_dir(format!(
                    "the directory opened under the name just made belongs to uid {}, not to us \
                     (uid {euid}): another user replaced it",
                    st.st_uid
                )));
            }
            // mkdir(0700) gives `made_bits`: no bit for group or others, no sticky or set-user-id
            // bit, set-group-id only where inherited from the parent (some file systems do not
            // pass it on: `grpid`). A file system that shows every directory with one mode (a
            // CIFS `dir_mode`, vfat's `dmask`) is taken as it shows, unless that lets others
            // write: a directory of ours that others may not write, empty, is no way in (who
            // can exchange it for ours can remove it anyway).
            if mode & 0o5022 != 0 || (mode & 0o2000 != 0 && setgid == 0) {
                return Err(unsafe_dir(format!(
                    "the directory opened under the name just made has mode {mode:04o}, not the \
                     {:04o} of a new one: another user replaced it",
                    made_bits | setgid
                )));
            }
            if st.st_nlink > 2 || !is_empty_dir(&fd) {
                return Err(unsafe_dir(
                    "the directory opened under the name just made is not empty: another user \
                     replaced it"
                        .into(),
                ));
            }
            if made_bits != 0o700 && mode & 0o777 == made_bits {
                // Verified ours, new and empty: give back what the umask took.
                rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o700 | (mode & 0o2000)))
                    .map_err(|e| Error::io("fchmod", path.clone(), e))?;
            }
            return Ok(PrivateDir {
                fd,
                name,
                id: (st.st_dev, st.st_ino),
                path,
            });
        }
    }

    /// Removes the (emptied) directory from `dir`, if its name still names it.
    fn remove(&self, dir: &OwnedFd) {
        if !same_entry(dir, &self.name, self.id) {
            tracing::warn!(path = %self.path.display(), "a temporary's private directory was moved or replaced; left where it is");
            return;
        }
        if let Err(e) = rustix::fs::unlinkat(dir, self.name.as_os_str(), AtFlags::REMOVEDIR) {
            tracing::warn!(path = %self.path.display(), "could not remove a temporary's private directory: {e}");
        }
    }
}

/// Whether the directory `fd` holds nothing but `.` and `..` (false where unreadable).
fn is_empty_dir(fd: &OwnedFd) -> bool {
    rustix::fs::Dir::read_from(fd).is_ok_and(|entries| {
        entries
            .into_iter()
            .all(|e| e.is_ok_and(|e| matches!(e.file_name().to_bytes(), b"." | b"..")))
    })
}

/// Whether `name` in `dir` is (without following symlinks) the file `id` (device, inode).
fn same_entry(dir: &OwnedFd, name: &OsStr, id: (u64, u64)) -> bool {
    rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
        .is_ok_and(|st| (st.st_dev, st.st_ino) == id)
}

/// The directory `target` lives in (`.` for a bare name).
fn dir_of(target: &Path) -> &Path {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// This process's umask, from `/proc/self/status`; `None` where it does not say.
fn umask() -> Option<u32> {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| procfs::status_umask(&s))
}

impl AtomicFile {
    /// Creates the temporary file for `target` (mode 0600, in a private directory beside it;
    /// see the module docs), with `len` bytes of space reserved (`fallocate`) when given, so
    /// that a full file system is an error now ([`Error::NoSpace`]) and not halfway through.
    /// First removes stale temporaries in the directory: of this boot's writers known dead,
    /// of a temporary's exact shape and ours, not renamed since, unmodified for
    /// [`STALE_AFTER`] ([`AtomicFile::cleaned`]; see the module docs).
    ///
    /// # Errors
    /// [`Error::NotFound`] when the directory is missing, [`Error::IsDirectory`] when the
    /// target is one, [`Error::NoSpace`], [`Error::UnsafeTemporary`] when the private
    /// directory just made was replaced before it was opened (another user who writes the
    /// directory exchanged it: what was opened is not ours, writable by others, sticky or
    /// set-id, or not empty; nothing in it was changed), and I/O errors
    /// naming the path.
    pub fn create(target: impl AsRef<Path>, len: Option<u64>) -> Result<Self> {
        let target = target.as_ref();
        let name = target
            .file_name()
            .ok_or_else(|| Error::Unsupported {
                what: "a target path without a file name",
                reason: format!("{} names no file", target.display()),
            })?
            .to_owned();
        let dir_path = dir_of(target);
        let dir = rustix::fs::open(
            dir_path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            Errno::NOENT | Errno::NOTDIR => Error::NotFound {
                path: dir_path.into(),
            },
            e => Error::io("open the directory", dir_path.to_path_buf(), e),
        })?;
        if let Ok(st) = rustix::fs::statat(&dir, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW)
            && FileType::from_raw_mode(st.st_mode) == FileType::Directory
        {
            return Err(Error::IsDirectory {
                path: target.into(),
            });
        }
        // Without /proc: the common default umask 022.
        let umask = umask().unwrap_or(0o022);
        let cleaned = clean_stale(&dir, dir_path);
        let private = PrivateDir::create(&dir, dir_path, len.unwrap_or(0), umask)?;
        // From here on, an error drops `f` (or removes the directory), leaving nothing behind.
        let file = match rustix::fs::openat(
            &private.fd,
            name.as_os_str(),
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::RUSR | Mode::WUSR,
        ) {
            Ok(fd) => File::from(fd),
            Err(e) => {
                private.remove(&dir);
                return Err(match e {
                    Errno::NOSPC => Error::NoSpace {
                        path: target.into(),
                        needed: len.unwrap_or(0),
                    },
                    e => Error::io("create", private.path.join(&name), e),
                });
            }
        };
        let fd_path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        let f = AtomicFile {
            target: target.into(),
            dir,
            name,
            private,
            file,
            fd_path,
            umask,
            committed: false,
            cleaned,
        };
        if let Some(len) = len.filter(|&l| l > 0) {
            f.reserve(len)?;
        }
        Ok(f)
    }

    /// Reserves `len` bytes (the file's size becomes `len`); file systems without `fallocate`
    /// get the size only.
    fn reserve(&self, len: u64) -> Result<()> {
        match rustix::fs::fallocate(&self.file, rustix::fs::FallocateFlags::empty(), 0, len) {
            Ok(()) => Ok(()),
            Err(Errno::NOSPC) => Err(Error::NoSpace {
                path: self.target.clone(),
                needed: len,
            }),
            Err(Errno::OPNOTSUPP) => self
                .file
                .set_len(len)
                .map_err(|e| Error::io("ftruncate", self.tmp_path(), e)),
            Err(e) => Err(Error::io("fallocate", self.tmp_path(), e)),
        }
    }

    /// Where the temporary file lives, for messages (never opened by this path).
    fn tmp_path(&self) -> PathBuf {
        self.private.path.join(&self.name)
    }

    /// The temporary file, open for reading and writing.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// A path that opens the temporary file itself: `/proc/self/fd/<n>` of [`AtomicFile::file`],
    /// which the kernel resolves to the open file, not by name, so no rename or symlink in the
    /// directory can redirect it. For APIs that take a path (a writer that opens it again with
    /// `O_DIRECT`); valid while this value lives; fails to open where /proc is not mounted.
    /// [`AtomicFile::reopen`] also checks that the result is the same file.
    pub fn path(&self) -> &Path {
        &self.fd_path
    }

    /// Opens the temporary file again, for reading and writing with `custom_flags` added (e.g.
    /// `libc::O_DIRECT`), through [`AtomicFile::path`], and checks that the new descriptor is
    /// the same file (device and inode).
    ///
    /// # Errors
    /// The open's error (`EINVAL` where the file system refuses `O_DIRECT`; `ENOENT` without
    /// /proc), [`Error::UnsafeTemporary`] where the path led to another file.
    pub fn reopen(&self, custom_flags: i32) -> Result<File> {
        let again = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(custom_flags | libc::O_CLOEXEC)
            .open(&self.fd_path)
            .map_err(|e| Error::io("reopen", self.fd_path.clone(), e))?;
        self.check_same_file(again.as_fd())?;
        Ok(again)
    }

    /// Checks that `fd` is the temporary file (device and inode), e.g. a descriptor another
    /// API opened from [`AtomicFile::path`].
    ///
    /// # Errors
    /// [`Error::UnsafeTemporary`] where it is another file.
    pub fn check_same_file(&self, fd: BorrowedFd<'_>) -> Result<()> {
        let ours = self
            .file
            .metadata()
            .map_err(|e| Error::io("fstat", self.tmp_path(), e))?;
        let theirs = rustix::fs::fstat(fd).map_err(|e| Error::io("fstat", None, e))?;
        if (theirs.st_dev, theirs.st_ino) != (ours.dev(), ours.ino()) {
            return Err(Error::UnsafeTemporary {
                path: self.fd_path.clone(),
                reason: "a descriptor opened from it is another file (is /proc procfs?)".into(),
            });
        }
        Ok(())
    }

    /// The target it will replace.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Temporaries (private directories) of dead earlier writers in the target's directory,
    /// removed by [`AtomicFile::create`]: of this boot, of a temporary's exact shape and ours,
    /// not renamed since, unmodified for [`STALE_AFTER`]
    /// (see the module docs).
    pub fn cleaned(&self) -> &[PathBuf] {
        &self.cleaned
    }

    /// Makes the file the target: the old target's mode and owner (see the module docs),
    /// `fsync` of its data, `renameat` over the target, `fsync` of the directory (so that the
    /// rename survives a power loss).
    ///
    /// # Errors
    /// I/O errors naming the path (`ENOSPC` while syncing is [`Error::NoSpace`]); the target is
    /// then left as it was and the temporary file removed.
    pub fn commit(mut self) -> Result<()> {
        self.take_mode_of_target()?;
        let len = self.file.metadata().map(|m| m.len()).unwrap_or(0);
        self.file.sync_all().map_err(|e| match e.raw_os_error() {
            Some(libc::ENOSPC) => Error::NoSpace {
                path: self.target.clone(),
                needed: len,
            },
            _ => Error::io("fsync", self.tmp_path(), e),
        })?;
        rustix::fs::renameat(
            &self.private.fd,
            self.name.as_os_str(),
            &self.dir,
            self.name.as_os_str(),
        )
        .map_err(|e| Error::io("rename", self.target.clone(), e))?;
        self.committed = true;
        self.private.remove(&self.dir);
        rustix::fs::fsync(&self.dir)
            .map_err(|e| Error::io("fsync the directory", dir_of(&self.target).to_path_buf(), e))
    }

    /// Gives the temporary the mode, and where the rules of the module docs allow and the
    /// kernel permits the owner and group, of the entry at the target now; `0666 & ~umask`
    /// where there is none.
    fn take_mode_of_target(&self) -> Result<()> {
        let mode =
            match rustix::fs::statat(&self.dir, self.name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) {
                Err(_) => 0o666 & !self.umask,
                Ok(st) if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile => 0o600,
                Ok(st) => self.take_owner_of(&st)?,
            };
        rustix::fs::fchmod(&self.file, Mode::from_raw_mode(mode))
            .map_err(|e| Error::io("fchmod", self.tmp_path(), e))
    }

    /// Gives the temporary the owner and group of the regular file `old` where it is ours or
    /// its owner could not have planted it, and permitted; the permission bits the temporary
    /// gets then (see the module docs).
    fn take_owner_of(&self, old: &rustix::fs::Stat) -> Result<u32> {
        let bits = old.st_mode & 0o777;
        let ours =
            rustix::fs::fstat(&self.file).map_err(|e| Error::io("fstat", self.tmp_path(), e))?;
        let gid = rustix::fs::Gid::from_raw(old.st_gid);
        if old.st_uid == ours.st_uid {
            if old.st_gid != ours.st_gid {
                // Where permitted (a group of ours, or root).
                let _ = rustix::fs::fchown(&self.file, None, Some(gid));
            }
            return Ok(bits);
        }
        let dir = rustix::fs::fstat(&self.dir)
            .map_err(|e| Error::io("fstat", dir_of(&self.target).to_path_buf(), e))?;
        let could_plant =
            old.st_nlink != 1 || (dir.st_mode & 0o022 != 0 && dir.st_uid != old.st_uid);
        if could_plant {
            // Another user's file, maybe planted for us to save into (a sticky or team
            // directory, a hard link): ours, and not writable by anyone a plain create would
            // not let write it.
            return Ok(bits & !self.umask);
        }
        let uid = rustix::fs::Uid::from_raw(old.st_uid);
        // Where not permitted (not root, or ids unmapped here): the group alone, else ours.
        if rustix::fs::fchown(&self.file, Some(uid), Some(gid)).is_ok() {
            return Ok(bits);
        }
        if old.st_gid != ours.st_gid {
            let _ = rustix::fs::fchown(&self.file, None, Some(gid));
        }
        Ok(bits & !self.umask)
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        match rustix::fs::unlinkat(&self.private.fd, self.name.as_os_str(), AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => self.private.remove(&self.dir),
            Err(e) => {
                tracing::warn!(path = %self.tmp_path().display(), "could not remove a temporary file: {e}");
            }
        }
    }
}

/// Removes the stale private directories in `dir` (at `dir_path`), with what they hold; returns
/// their paths. Stale (see the module docs): this boot's, the writer known dead, a
/// temporary's exact shape, not renamed since, unmodified for [`STALE_AFTER`]. Those of other
/// boots (other hosts), of live writers, of other PID namespaces, of other users, recent ones,
/// names without a boot id and anything of another shape are left alone.
fn clean_stale(dir: &OwnedFd, dir_path: &Path) -> Vec<PathBuf> {
    let Some(boot) = boot_id() else {
        return Vec::new();
    };
    let Ok(entries) = rustix::fs::Dir::read_from(dir) else {
        return Vec::new();
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let mut cleaned = Vec::new();
    for entry in entries.flatten() {
        let name = OsStr::from_bytes(entry.file_name().to_bytes());
        let Some((Some(theirs), owner)) = name.to_str().and_then(temporary_owner) else {
            continue;
        };
        if theirs.eq_ignore_ascii_case(boot) && owner.is_dead() && remove_stale_dir(dir, name, now)
        {
            let path = dir_path.join(name);
            tracing::info!(path = %path.display(), "removed a dead writer's temporary file");
            cleaned.push(path);
        }
    }
    cleaned
}

/// Removes the directory `name` of `dir` and the file in it, through descriptors (a symlink
/// is not followed), if it has a temporary's exact shape, was not renamed since its file was
/// made, and was not modified for [`STALE_AFTER`] before `now` (seconds since the epoch);
/// whether it is gone.
fn remove_stale_dir(dir: &OwnedFd, name: &OsStr, now: i64) -> bool {
    let Ok(sub) = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return false;
    };
    let Ok(st) = rustix::fs::fstat(&sub) else {
        return false;
    };
    let euid = rustix::process::geteuid().as_raw();
    if st.st_uid != euid || st.st_mode & 0o7777 & !0o2000 != 0o700 || st.st_nlink > 2 {
        return false;
    }
    let Ok(entries) = rustix::fs::Dir::read_from(&sub) else {
        return false;
    };
    let mut inside = Vec::new();
    for e in entries {
        let Ok(e) = e else {
            return false;
        };
        let n = e.file_name().to_bytes();
        if n != b"." && n != b".." {
            inside.push(OsStr::from_bytes(n).to_owned());
        }
    }
    let (newest, file) = match &inside[..] {
        [] => (st.st_mtime, None),
        [n] => {
            let Ok(fst) = rustix::fs::statat(&sub, n.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) else {
                return false;
            };
            let regular = FileType::from_raw_mode(fst.st_mode) == FileType::RegularFile;
            // Renamed since its file was made: a rename sets the ctime of what it moves.
            let renamed = (st.st_ctime, st.st_ctime_nsec) != (st.st_mtime, st.st_mtime_nsec);
            if !regular || fst.st_uid != euid || fst.st_nlink != 1 || renamed {
                return false;
            }
            (fst.st_mtime, Some((n, (fst.st_dev, fst.st_ino))))
        }
        _ => return false,
    };
    if now.saturating_sub(newest) < STALE_AFTER.as_secs() as i64 {
        return false;
    }
    if let Some((n, id)) = file {
        // Only we may write a 0700 directory of ours; checked again all the same.
        let still = rustix::fs::statat(&sub, n.as_os_str(), AtFlags::SYMLINK_NOFOLLOW)
            .is_ok_and(|s| (s.st_dev, s.st_ino) == id);
        if !still || rustix::fs::unlinkat(&sub, n.as_os_str(), AtFlags::empty()).is_err() {
            return false;
        }
    }
    same_entry(dir, name, (st.st_dev, st.st_ino))
        && rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn entries(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .expect("ls")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn temporaries_sit_in_a_private_directory_that_says_who_wrote_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("w.safetensors");
        let f = AtomicFile::create(&target, Some(10_000)).expect("create");
        let names = entries(dir.path());
        assert_eq!(names.len(), 1, "{names:?}");
        assert_eq!(
            temporary_owner(&names[0]),
            Some((boot_id(), ProcessIdentity::current()))
        );
        let private = dir.path().join(&names[0]);
        let meta = std::fs::symlink_metadata(&private).expect("lstat");
        assert!(meta.is_dir());
        assert_eq!(meta.mode() & 0o7777, 0o700);
        let inner = private.join("w.safetensors");
        let inner_meta = std::fs::symlink_metadata(&inner).expect("inner");
        assert_eq!(inner_meta.mode() & 0o777, 0o600);
        assert_eq!(inner_meta.len(), 10_000);
        assert_eq!(f.file().metadata().expect("meta").len(), 10_000);
        let again = f.reopen(0).expect("reopen");
        assert_eq!(again.metadata().expect("meta").ino(), inner_meta.ino());
        drop(f);
        assert!(!target.exists(), "never committed: no target");
        assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));
    }

    /// Sets the modification time of what the private directory `path` holds an hour back
    /// (the directory's own only where it is empty: setting it would change its ctime, which
    /// then reads as a rename).
    fn age(path: &Path) {
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        let mut empty = true;
        for e in std::fs::read_dir(path).expect("ls").flatten() {
            empty = false;
            File::open(e.path())
                .and_then(|f| f.set_modified(old))
                .expect("mtime");
        }
        if empty {
            File::open(path)
                .and_then(|f| f.set_modified(old))
                .expect("mtime");
        }
    }

    /// Makes a private directory `d` as `create` does (0700), holding `ckpt.bin`.
    fn make_private(d: &Path) {
        std::fs::create_dir(d).expect("mkdir");
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        std::fs::write(d.join("ckpt.bin"), b"partial").expect("write");
    }

    #[test]
    fn only_stale_temporaries_of_this_boot_ours_and_of_dead_writers_are_cleaned() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("ckpt.bin");
        let me = ProcessIdentity::current();
        let boot = boot_id().expect("/proc/sys/kernel/random/boot_id readable here");
        // A pid above any pid_max (2^22) in our namespace: known dead.
        let dead = ProcessIdentity { pid: 1 << 23, ..me };
        let other_ns = ProcessIdentity {
            pid_ns: me.pid_ns.wrapping_add(1),
            ..dead
        };
        let this_boot = |p: ProcessIdentity| temporary_name(&p).expect("name");
        let other_boot = |p: ProcessIdentity| {
            let other = if boot.starts_with('0') { "1" } else { "0" };
            format!(
                "{TMP_PREFIX}{other}{}-{}",
                &boot[1..],
                p.unique_tag().expect("tag")
            )
        };
        let no_boot = |p: ProcessIdentity| format!("{TMP_PREFIX}{}", p.unique_tag().expect("tag"));
        // (name, made an hour old, removed)
        let mut dirs = vec![
            (this_boot(dead), true, true),
            (this_boot(dead), false, false), // fresh: a writer might still be at it
            (other_boot(dead), true, false), // another host's (NFS): its pid means nothing here
            (no_boot(dead), true, false),    // an earlier version's name: never judged
            (this_boot(me), true, false),    // alive
            (this_boot(other_ns), true, false),
            (format!("{TMP_PREFIX}{boot}-not-a-tag"), true, false),
        ];
        let root = gpufeed_testkit::is_root();
        if root {
            dirs.push((this_boot(dead), true, false)); // nobody's (chowned below)
        }
        for (n, old, _) in &dirs {
            let d = dir.path().join(n);
            make_private(&d);
            if *old {
                age(&d);
            }
        }
        if root {
            let nobodys = dir.path().join(&dirs.last().expect("pushed").0);
            rustix::fs::chown(
                nobodys.join("ckpt.bin"),
                Some(rustix::fs::Uid::from_raw(65534)),
                None,
            )
            .expect("chown");
        } else {
            gpufeed_testkit::skip(
                "atomic::tests::only_stale_temporaries (another user's part)",
                &"only root can give a directory to another user",
            );
        }
        // Of this boot, the writer dead, old, but not a temporary's exact shape: left alone.
        let mut shapes = Vec::new();
        let mut shape = |why: &'static str, make: &dyn Fn(&Path)| {
            let n = this_boot(dead);
            let d = dir.path().join(&n);
            make_private(&d);
            make(&d);
            age(&d);
            shapes.push((n, why));
        };
        shape("mode 0755", &|d| {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).expect("chmod")
        });
        shape("two files", &|d| {
            std::fs::write(d.join("b.bin"), b"b").expect("write")
        });
        shape("a subdirectory", &|d| {
            std::fs::remove_file(d.join("ckpt.bin")).expect("rm");
            std::fs::create_dir(d.join("sub")).expect("mkdir");
        });
        shape("a file with two links", &|d| {
            std::fs::hard_link(d.join("ckpt.bin"), dir.path().join("linked.bin")).expect("ln")
        });
        shape("renamed since its file was made", &|d| {
            // Timestamps are coarse (a clock tick): rename a tick later, as any rename of an
            // old directory is.
            std::thread::sleep(std::time::Duration::from_millis(30));
            let aside = d.with_extension("aside");
            std::fs::rename(d, &aside).expect("rename");
            std::fs::rename(&aside, d).expect("rename back");
        });
        // An empty one (its writer died after the rename, before the rmdir): removed.
        let empty = this_boot(dead);
        let d = dir.path().join(&empty);
        make_private(&d);
        std::fs::remove_file(d.join("ckpt.bin")).expect("rm");
        age(&d);
        // A temporary of the format of versions before the private directories: a file
        // beside the target, without a boot id.
        let beside = format!(".ckpt.bin.gpufeed-tmp-{}", dead.unique_tag().expect("tag"));
        std::fs::write(dir.path().join(&beside), b"x").expect("file");
        // This boot's dead writer's name on a plain file, and on a symlink: left alone.
        let file = this_boot(dead);
        std::fs::write(dir.path().join(&file), b"x").expect("file");
        let link = this_boot(dead);
        std::os::unix::fs::symlink(dir.path().join(&dirs[0].0), dir.path().join(&link))
            .expect("symlink");
        let f = AtomicFile::create(&target, None).expect("create");
        for (n, old, removed) in &dirs {
            assert_eq!(
                !dir.path().join(n).exists(),
                *removed,
                "{n} (old: {old}): {:?}",
                f.cleaned()
            );
        }
        for (n, why) in &shapes {
            assert!(dir.path().join(n).exists(), "{why}: removed");
        }
        let mut cleaned = f.cleaned().to_vec();
        cleaned.sort();
        let mut expected = vec![dir.path().join(&dirs[0].0), dir.path().join(&empty)];
        expected.sort();
        assert_eq!(cleaned, expected);
        for n in [&beside, &file] {
            assert!(dir.path().join(n).exists(), "{n}");
        }
        assert!(std::fs::symlink_metadata(dir.path().join(&link)).is_ok());
        f.commit().expect("commit");
        assert!(target.exists());
    }

    #[test]
    fn temporary_names_parse_back() {
        let me = ProcessIdentity::current();
        let name = temporary_name(&me).expect("name");
        let (boot, owner) = temporary_owner(&name).expect("parses");
        assert_eq!(boot, boot_id());
        assert_eq!(owner, me);
        let old = format!("{TMP_PREFIX}{}", me.unique_tag().expect("tag"));
        assert_eq!(temporary_owner(&old), Some((None, me)));
        let beside = format!(".x.bin.gpufeed-tmp-{}", me.unique_tag().expect("tag"));
        assert_eq!(temporary_owner(&beside), Some((None, me)));
        assert_eq!(temporary_owner("x.bin"), None);
        assert_eq!(temporary_owner(&format!("{TMP_PREFIX}zz")), None);
        // 13 + 32 + 1 + at most 10 + 1 + 20 + 1 + 20 + 1 + 16 bytes: far below NAME_MAX.
        assert!(name.len() < 120, "{name}");
    }
}
