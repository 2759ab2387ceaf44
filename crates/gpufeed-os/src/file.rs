//! Opening regular files with clear errors, and recording their identity.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result, with_path};

/// What identifies one version of a file: device, inode, size, modification time and status
/// change time.
///
/// Two identities differ when the file was replaced, truncated, extended or written, also
/// by a rewrite that kept its size and set its modification time back (`touch -d`,
/// `utimensat`, `rsync --times`): that changes the status change time (ctime), which no call
/// can set. ctime also changes with the file's metadata (mode, owner, links), which then also
/// counts as a change: a false alarm at worst, never a rewrite missed (within the file
/// system's timestamp granularity).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileIdentity {
    /// Device number of the file system.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Status change time (ctime), nanoseconds since the epoch.
    pub ctime_ns: i128,
}

impl FileIdentity {
    /// The identity of an open file now.
    pub fn of(file: &File) -> Result<Self> {
        let meta = file.metadata().map_err(|e| Error::io("fstat", None, e))?;
        Ok(Self::from_metadata(&meta))
    }

    /// The identity of the file `path` names now (following symlinks), without opening it.
    ///
    /// # Errors
    /// [`Error::NotFound`] where nothing is at `path`; [`Error::Io`] where it cannot be looked up.
    pub fn of_path(path: &Path) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|e| Error::open(path, e))?;
        Ok(Self::from_metadata(&meta))
    }

    pub(crate) fn from_metadata(meta: &std::fs::Metadata) -> Self {
        FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
        }
    }

    /// Describes how `later` differs from `self`, `None` when it does not.
    pub fn difference(&self, later: &FileIdentity) -> Option<String> {
        if (self.dev, self.ino) != (later.dev, later.ino) {
            Some("replaced by another file".to_owned())
        } else if self.size != later.size {
            Some(format!("size {} -> {} bytes", self.size, later.size))
        } else if self.mtime_ns != later.mtime_ns {
            Some("modified (mtime changed)".to_owned())
        } else if self.ctime_ns != later.ctime_ns {
            Some("modified or its metadata changed (ctime changed; size and mtime kept)".to_owned())
        } else {
            None
        }
    }

    /// [`FileIdentity::difference`] without the status change time: how `later` differs in
    /// what tells its contents (the file, its size, its modification time), `None` when it
    /// does not. A change of mode, owner or links (a `chmod`, the file renamed, linked or
    /// unlinked) is no difference here; a rewrite that kept the size and set the
    /// modification time back to the very same instant is missed. For a handle held open
    /// long, whose reads each check their own window with [`FileIdentity::difference`].
    pub fn content_difference(&self, later: &FileIdentity) -> Option<String> {
        self.difference(&FileIdentity {
            ctime_ns: self.ctime_ns,
            ..*later
        })
    }
}

/// Opens `path` for reading (and writing if `write`), refusing anything but a regular file of
/// a real file system.
///
/// The open uses `O_NONBLOCK` so that a FIFO cannot block it (it is then refused by type);
/// the flag is cleared again before the file is returned (io_uring would otherwise answer
/// `EAGAIN` for reads that need the disk).
///
/// # Errors
/// [`Error::NotFound`], [`Error::IsDirectory`], [`Error::NotRegularFile`] (FIFOs, devices,
/// sockets), [`Error::PseudoFile`] (procfs, sysfs, ...), [`Error::Io`].
pub fn open_regular(path: &Path, write: bool) -> Result<(File, FileIdentity)> {
    open_regular_on(path, write).map(|(file, identity, _)| (file, identity))
}

/// [`open_regular`], with the `f_type` of the file system the file is on (`fstatfs`, asked
/// once for both; `None` where it could not be read): see [`in_memory_fs`].
///
/// # Errors
/// As for [`open_regular`].
pub fn open_regular_on(path: &Path, write: bool) -> Result<(File, FileIdentity, Option<i64>)> {
    /// The open's own flags. `F_SETFL 0` below clears every flag F_SETFL can change: none of
    /// them but O_NONBLOCK may be here.
    const OPEN_FLAGS: i32 = libc::O_NONBLOCK;
    const _: () = assert!(
        OPEN_FLAGS & (libc::O_APPEND | libc::O_DIRECT | libc::O_NOATIME | libc::O_ASYNC) == 0
    );
    let file = OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(OPEN_FLAGS)
        .open(path)
        .map_err(|e| Error::open(path, e))?;
    let meta = file
        .metadata()
        .map_err(|e| Error::io("fstat", Some(path.into()), e))?;
    check_regular(path, &meta)?;
    let f_type = fs_type(&file);
    if let Some(fs) = pseudo_fs(f_type) {
        return Err(Error::PseudoFile {
            path: path.into(),
            fs,
        });
    }
    // F_SETFL changes only O_APPEND, O_NONBLOCK, O_DIRECT, O_NOATIME (and O_ASYNC), of which
    // the open set only O_NONBLOCK (checked where OPEN_FLAGS is defined): setting none clears
    // it without reading the flags first.
    rustix::fs::fcntl_setfl(&file, rustix::fs::OFlags::empty())
        .map_err(|e| Error::io("fcntl", Some(path.into()), e))?;
    Ok((file, FileIdentity::from_metadata(&meta), f_type))
}

/// The `f_type` of the file system `file` is on (`fstatfs`; `None` where it could not be
/// read): see [`in_memory_fs`].
pub fn fs_type(file: &File) -> Option<i64> {
    rustix::fs::fstatfs(file).ok().map(|s| s.f_type)
}

/// Whether `f_type` (`statfs`) is a file system whose files are in memory: tmpfs (such as
/// `/dev/shm`) or ramfs.
pub fn in_memory_fs(f_type: i64) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    matches!(f_type, TMPFS_MAGIC | RAMFS_MAGIC)
}

/// A regular file opened once for a whole load: the descriptor, the path it was opened by (for
/// messages) and its identity then. Every check, residency sample, alignment query and read of
/// the load uses this descriptor, so the bytes read are all of the version opened, even if
/// another file is renamed over the path meanwhile; [`OpenedFile::changed`] asks the
/// descriptor afterwards whether that version was written, truncated or extended meanwhile,
/// or lost its name (its ctime changes when its last link goes).
///
/// # Example
/// ```
/// let dir = tempfile::tempdir()?;
/// let path = dir.path().join("data.bin");
/// std::fs::write(&path, b"hello")?;
/// let f = gpufeed_os::OpenedFile::open(&path)?;
/// assert_eq!((f.len(), f.changed()?), (5, None));
/// // Another file renamed over the path: reads still see the version opened ...
/// std::fs::write(dir.path().join("other"), b"other!")?;
/// std::fs::rename(dir.path().join("other"), &path)?;
/// let mut buf = [0u8; 5];
/// std::os::unix::fs::FileExt::read_exact_at(f.file(), &mut buf, 0)?;
/// assert_eq!(&buf, b"hello");
/// // ... and `changed` tells that it is no longer the file at the path.
/// assert!(f.changed()?.is_some());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct OpenedFile {
    file: File,
    path: PathBuf,
    identity: FileIdentity,
    /// Its file system's `f_type` (the open's `fstatfs`), where it could be read.
    f_type: Option<i64>,
}

impl OpenedFile {
    /// Opens `path` for reading with [`open_regular`]'s checks.
    ///
    /// # Errors
    /// As for [`open_regular`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let (file, identity, f_type) = open_regular_on(path, false)?;
        Ok(OpenedFile {
            file,
            path: path.into(),
            identity,
            f_type,
        })
    }

    /// The descriptor.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The path it was opened by.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its identity when it was opened.
    pub fn identity(&self) -> &FileIdentity {
        &self.identity
    }

    /// Whether it is on a file system in memory (tmpfs, ramfs: [`in_memory_fs`]), as its
    /// open found.
    pub fn in_memory(&self) -> bool {
        self.f_type.is_some_and(in_memory_fs)
    }

    /// Its length when it was opened.
    pub fn len(&self) -> u64 {
        self.identity.size
    }

    /// Whether it was empty when it was opened.
    pub fn is_empty(&self) -> bool {
        self.identity.size == 0
    }

    /// How the opened file differs now from when it was opened (written, truncated, extended:
    /// [`FileIdentity::difference`], asked of the descriptor), `None` when it does not.
    ///
    /// # Errors
    /// [`Error::Io`] where `fstat` fails.
    pub fn changed(&self) -> Result<Option<String>> {
        let now = FileIdentity::of(&self.file).map_err(|e| with_path(e, &self.path))?;
        Ok(self.identity.difference(&now))
    }

    /// How the opened file's contents differ now from when it was opened, as far as its
    /// size and modification time tell ([`FileIdentity::content_difference`]: a `chmod`, a
    /// rename or the file's last link removed are no change here), `None` when they do not.
    ///
    /// # Errors
    /// [`Error::Io`] where `fstat` fails.
    pub fn content_changed(&self) -> Result<Option<String>> {
        let now = FileIdentity::of(&self.file).map_err(|e| with_path(e, &self.path))?;
        Ok(self.identity.content_difference(&now))
    }

    /// This opened file again through a duplicate of its descriptor, with its identity now
    /// (not the one it had when opened), once that same `fstat` shows its contents are still
    /// the version opened ([`FileIdentity::content_difference`]): for a handle held open long,
    /// whose each load then checks with [`OpenedFile::changed`] its own window only.
    ///
    /// # Errors
    /// [`Error::ChangedSinceOpened`] where its size or modification time changed; as for
    /// [`OpenedFile::duplicate`]; [`Error::Io`] where `fstat` fails.
    pub fn try_clone_as_of_now(&self) -> Result<OpenedFile> {
        let file = self.duplicate()?;
        let identity = FileIdentity::of(&file).map_err(|e| with_path(e, &self.path))?;
        if let Some(what) = self.identity.content_difference(&identity) {
            return Err(Error::ChangedSinceOpened {
                path: self.path.clone(),
                what,
            });
        }
        Ok(OpenedFile {
            file,
            path: self.path.clone(),
            identity,
            f_type: self.f_type,
        })
    }

    /// This opened file again through a duplicate of its descriptor, with the identity it
    /// had when opened (a second owner of the same version, for another thread's loads).
    ///
    /// # Errors
    /// As for [`OpenedFile::duplicate`].
    pub fn try_clone(&self) -> Result<OpenedFile> {
        Ok(OpenedFile {
            file: self.duplicate()?,
            path: self.path.clone(),
            identity: self.identity,
            f_type: self.f_type,
        })
    }

    /// A duplicate of the descriptor (`dup`: the same file description, offset and flags).
    ///
    /// # Errors
    /// [`Error::Io`] where the process is out of descriptors.
    pub fn duplicate(&self) -> Result<File> {
        self.file
            .try_clone()
            .map_err(|e| Error::io("dup", Some(self.path.clone()), e))
    }

    /// A second, independent descriptor of the same file (its own file description, so flags
    /// such as `O_DIRECT` in `extra_flags` do not touch this one), opened through
    /// `/proc/thread-self/fd` (the calling thread's descriptor table), not the path: a file
    /// renamed over the path since is not the one opened. Where `/proc` is not mounted (a
    /// chroot, some sandboxes) it opens the path instead and keeps the result only if it is
    /// the same file (device and inode).
    ///
    /// # Errors
    /// The open's own error (`EINVAL` for `O_DIRECT` on a file system without it), or an error
    /// of kind `Other` where what was opened is not the file opened first (without `/proc`,
    /// another file now at the path).
    pub fn reopen(&self, extra_flags: i32) -> std::io::Result<File> {
        match reopen(self.file.as_fd(), false, extra_flags) {
            Ok(f) => Ok(f),
            // The flags refused by the file system: the same answer by the path.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Err(e),
            // No /proc here: the path, kept only if it is the same file.
            Err(_) => {
                let file = OpenOptions::new()
                    .read(true)
                    .custom_flags(extra_flags)
                    .open(&self.path)?;
                if same_file(&file, &self.identity)? {
                    Ok(file)
                } else {
                    Err(std::io::Error::other(format!(
                        "{} is not the file opened (another file is there now)",
                        self.path.display()
                    )))
                }
            }
        }
    }
}

/// `file` opened again through `/proc/thread-self/fd/N` (the calling thread's descriptor
/// table), for reading (and writing if `write`) with `extra_flags` (`O_DIRECT`, ...): a new
/// open file description of the same inode (checked), so its flags, offset and `fcntl` locks
/// are its own. Never the path: a file renamed over it is not the one reopened.
///
/// # Errors
/// The open's own error (`ENOENT` without `/proc`, `EINVAL` for flags the file system
/// refuses), or an error of kind `Other` where `/proc` names another file (a `/proc` of
/// another PID namespace mounted here).
pub fn reopen(file: BorrowedFd<'_>, write: bool, extra_flags: i32) -> std::io::Result<File> {
    let link = format!("/proc/thread-self/fd/{}", file.as_raw_fd());
    let opened = OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(extra_flags)
        .open(&link)?;
    let (a, b) = (rustix::fs::fstat(file)?, rustix::fs::fstat(&opened)?);
    if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) {
        Ok(opened)
    } else {
        Err(std::io::Error::other(format!(
            "{link} names another file (a /proc of another PID namespace?)"
        )))
    }
}

/// Whether `file` is the file (device and inode) that `identity` identifies.
fn same_file(file: &File, identity: &FileIdentity) -> std::io::Result<bool> {
    let meta = file.metadata()?;
    Ok((meta.dev(), meta.ino()) == (identity.dev, identity.ino))
}

/// The identity of the regular file at `path`, read without opening it (so a FIFO cannot
/// block), refusing what [`open_regular`] refuses.
///
/// # Errors
/// As for [`open_regular`].
pub fn stat_regular(path: &Path) -> Result<FileIdentity> {
    let meta = std::fs::metadata(path).map_err(|e| Error::open(path, e))?;
    check_regular(path, &meta)?;
    if let Some(fs) = pseudo_fs(rustix::fs::statfs(path).ok().map(|s| s.f_type)) {
        return Err(Error::PseudoFile {
            path: path.into(),
            fs,
        });
    }
    Ok(FileIdentity::from_metadata(&meta))
}

fn check_regular(path: &Path, meta: &std::fs::Metadata) -> Result<()> {
    if meta.is_dir() {
        return Err(Error::IsDirectory { path: path.into() });
    }
    if !meta.is_file() {
        return Err(Error::NotRegularFile { path: path.into() });
    }
    Ok(())
}

/// The name of a pseudo file system whose files have no true size, from `statfs`'s `f_type`.
fn pseudo_fs(f_type: Option<i64>) -> Option<&'static str> {
    Some(match f_type? {
        0x9fa0 => "procfs",
        0x6265_6572 => "sysfs",
        0x6462_6720 => "debugfs",
        0x7472_6163 => "tracefs",
        0x7363_6673 => "securityfs",
        0x0027_e0eb => "cgroupfs",
        0x6367_7270 => "cgroup2",
        0x6265_6570 => "configfs",
        0xcafe_4a11 => "bpffs",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pseudo_files_and_fifos_are_refused_without_blocking() {
        for p in [
            "/proc/self/status",
            "/sys/kernel/mm/transparent_hugepage/enabled",
        ] {
            let path = Path::new(p);
            if !path.exists() {
                continue;
            }
            assert!(
                matches!(stat_regular(path), Err(Error::PseudoFile { .. })),
                "{p}: {:?}",
                stat_regular(path)
            );
            let err = open_regular(path, false).unwrap_err();
            assert!(matches!(err, Error::PseudoFile { .. }), "{p}: {err:?}");
            assert!(err.to_string().contains("copy it to a regular file"));
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let fifo = dir.path().join("fifo");
        gpufeed_testkit::mkfifo(&fifo);
        // Without O_NONBLOCK this open would wait forever for a writer.
        let err = open_regular(&fifo, false).unwrap_err();
        assert!(matches!(err, Error::NotRegularFile { .. }), "{err:?}");
        assert!(matches!(
            stat_regular(&fifo),
            Err(Error::NotRegularFile { .. })
        ));
        for dev in ["/dev/null", "/dev/zero"] {
            assert!(matches!(
                open_regular(Path::new(dev), false),
                Err(Error::NotRegularFile { .. })
            ));
        }
        let file = dir.path().join("f");
        std::fs::write(&file, b"data").expect("write");
        let (f, id) = open_regular(&file, false).expect("a regular file opens");
        assert_eq!(id.size, 4);
        let flags = rustix::fs::fcntl_getfl(&f).expect("flags");
        assert!(
            !flags.contains(rustix::fs::OFlags::NONBLOCK),
            "O_NONBLOCK left set"
        );
        assert_eq!(stat_regular(&file).expect("stat"), id);
        // Opened to write as well: the access mode kept, O_NONBLOCK cleared, writes land.
        let (f, _) = open_regular(&file, true).expect("opens to write");
        let flags = rustix::fs::fcntl_getfl(&f).expect("flags");
        assert!(flags.contains(rustix::fs::OFlags::RDWR), "{flags:?}");
        assert!(!flags.contains(rustix::fs::OFlags::NONBLOCK), "{flags:?}");
        std::os::unix::fs::FileExt::write_all_at(&f, b"DA", 0).expect("write");
        assert_eq!(std::fs::read(&file).expect("read"), b"DAta");
    }

    #[test]
    fn the_file_system_type_comes_with_the_open() {
        let shm = Path::new("/dev/shm");
        match rustix::fs::statfs(shm) {
            Ok(s) if in_memory_fs(s.f_type) => {
                let dir = tempfile::tempdir_in(shm).expect("tempdir in /dev/shm");
                let file = dir.path().join("f");
                std::fs::write(&file, b"data").expect("write");
                let (_, id, f_type) = open_regular_on(&file, false).expect("opens");
                assert_eq!(id.size, 4);
                assert!(f_type.is_some_and(in_memory_fs), "{f_type:x?}");
                assert!(OpenedFile::open(&file).expect("opens").in_memory());
            }
            _ => eprintln!("SKIP a file in memory: /dev/shm is not a tmpfs here"),
        }
        // A pseudo file system is still refused, and ext4/xfs/btrfs are not in memory.
        assert!(matches!(
            open_regular_on(Path::new("/proc/self/status"), false),
            Err(Error::PseudoFile { .. })
        ));
        for disk in [0xef53_i64, 0x5846_5342, 0x9123_683e] {
            assert!(!in_memory_fs(disk));
        }
    }
}
