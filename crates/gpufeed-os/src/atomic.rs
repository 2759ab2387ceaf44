//! Files replaced whole or not at all: [`AtomicFile`] writes under a temporary name in the
//! target's directory, and [`AtomicFile::commit`] syncs the data, renames it over the target and
//! syncs the directory. A process killed at any point leaves the old file or the new one,
//! complete; its temporary file is removed by the next [`AtomicFile::create`] for the same
//! target once its owner is known dead.
//!
//! Temporary names: `.<target name>.gpufeed-tmp-<pid>-<start ticks>-<pid namespace>-<random>`
//! ([`crate::process::ProcessIdentity::unique_tag`]), in the target's directory so that the
//! rename never crosses a file system.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::process::ProcessIdentity;

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
    tmp: PathBuf,
    file: File,
    committed: bool,
    cleaned: Vec<PathBuf>,
}

/// The prefix of `target`'s temporary files in its directory.
fn tmp_prefix(target: &Path) -> Result<String> {
    let name = target
        .file_name()
        .ok_or_else(|| Error::Unsupported {
            what: "a target path without a file name",
            reason: format!("{} names no file", target.display()),
        })?
        .to_string_lossy();
    Ok(format!(".{name}.gpufeed-tmp-"))
}

/// The directory `target` lives in (`.` for a bare name).
fn dir_of(target: &Path) -> &Path {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

impl AtomicFile {
    /// Creates the temporary file for `target` (mode 0644 before the umask), with `len` bytes
    /// of space reserved (`fallocate`) when given, so that a full file system is an error now
    /// ([`Error::NoSpace`]) and not halfway through. First removes temporary files of earlier
    /// writers of the same target that are known dead ([`AtomicFile::cleaned`]).
    ///
    /// # Errors
    /// [`Error::NotFound`] when the directory is missing, [`Error::IsDirectory`] when the
    /// target is one, [`Error::NoSpace`], and I/O errors naming the path.
    pub fn create(target: impl AsRef<Path>, len: Option<u64>) -> Result<Self> {
        let target = target.as_ref();
        if target.is_dir() {
            return Err(Error::IsDirectory {
                path: target.into(),
            });
        }
        let dir = dir_of(target);
        if !dir.is_dir() {
            return Err(Error::NotFound { path: dir.into() });
        }
        let prefix = tmp_prefix(target)?;
        let cleaned = clean_stale(dir, &prefix);
        let tag = ProcessIdentity::current().unique_tag()?;
        let tmp = dir.join(format!("{prefix}{tag}"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(|e| Error::io("create", tmp.clone(), e))?;
        let f = AtomicFile {
            target: target.into(),
            tmp,
            file,
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
            Err(rustix::io::Errno::NOSPC) => Err(Error::NoSpace {
                path: self.target.clone(),
                needed: len,
            }),
            Err(rustix::io::Errno::OPNOTSUPP) => self
                .file
                .set_len(len)
                .map_err(|e| Error::io("ftruncate", self.tmp.clone(), e)),
            Err(e) => Err(Error::io("fallocate", self.tmp.clone(), e)),
        }
    }

    /// The temporary file, open for reading and writing.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The temporary file's path (to open it again, e.g. with `O_DIRECT`).
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// The target it will replace.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Temporary files of dead earlier writers removed by [`AtomicFile::create`].
    pub fn cleaned(&self) -> &[PathBuf] {
        &self.cleaned
    }

    /// Makes the file the target: `fsync` of its data, `rename` over the target, `fsync` of the
    /// directory (so that the rename survives a power loss).
    ///
    /// # Errors
    /// I/O errors naming the path (`ENOSPC` while syncing is [`Error::NoSpace`]); the target is
    /// then left as it was and the temporary file removed.
    pub fn commit(mut self) -> Result<()> {
        let len = self.file.metadata().map(|m| m.len()).unwrap_or(0);
        self.file.sync_all().map_err(|e| match e.raw_os_error() {
            Some(libc::ENOSPC) => Error::NoSpace {
                path: self.target.clone(),
                needed: len,
            },
            _ => Error::io("fsync", self.tmp.clone(), e),
        })?;
        std::fs::rename(&self.tmp, &self.target)
            .map_err(|e| Error::io("rename", self.target.clone(), e))?;
        self.committed = true;
        let dir = dir_of(&self.target);
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| Error::io("fsync the directory", dir.to_path_buf(), e))
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed
            && let Err(e) = std::fs::remove_file(&self.tmp)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.tmp.display(), "could not remove a temporary file: {e}");
        }
    }
}

/// Removes the temporary files in `dir` starting with `prefix` whose writer is known dead;
/// returns their paths. Files of live writers, of other PID namespaces, and names that do not
/// parse are left alone.
fn clean_stale(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut cleaned = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(tag) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let dead = ProcessIdentity::from_tag(tag).is_some_and(|owner| owner.is_dead());
        if dead && std::fs::remove_file(entry.path()).is_ok() {
            tracing::info!(path = %entry.path().display(), "removed a dead writer's temporary file");
            cleaned.push(entry.path());
        }
    }
    cleaned
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporary_names_sit_beside_the_target_and_say_who_wrote_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("w.safetensors");
        let f = AtomicFile::create(&target, Some(10_000)).expect("create");
        let name = f.path().file_name().and_then(|n| n.to_str()).expect("name");
        let tag = name
            .strip_prefix(".w.safetensors.gpufeed-tmp-")
            .expect("prefix");
        assert_eq!(
            ProcessIdentity::from_tag(tag),
            Some(ProcessIdentity::current())
        );
        assert_eq!(f.path().parent(), Some(dir.path()));
        assert_eq!(f.file().metadata().expect("meta").len(), 10_000);
        drop(f);
        assert!(!target.exists(), "never committed: no target");
        assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 0);
    }

    #[test]
    fn only_dead_writers_temporary_files_are_cleaned() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("ckpt.bin");
        let me = ProcessIdentity::current();
        // A pid above any pid_max (2^22) in our namespace: known dead.
        let dead = ProcessIdentity { pid: 1 << 23, ..me };
        let other_ns = ProcessIdentity {
            pid_ns: me.pid_ns.wrapping_add(1),
            pid: 1 << 23,
            ..me
        };
        let names = [
            (
                format!(".ckpt.bin.gpufeed-tmp-{}", dead.unique_tag().expect("tag")),
                true,
            ),
            (
                format!(".ckpt.bin.gpufeed-tmp-{}", me.unique_tag().expect("tag")),
                false,
            ),
            (
                format!(
                    ".ckpt.bin.gpufeed-tmp-{}",
                    other_ns.unique_tag().expect("tag")
                ),
                false,
            ),
            (".ckpt.bin.gpufeed-tmp-not-a-tag".to_owned(), false),
            (
                format!(".other.bin.gpufeed-tmp-{}", dead.unique_tag().expect("tag")),
                false,
            ),
        ];
        for (n, _) in &names {
            std::fs::write(dir.path().join(n), b"partial").expect("write");
        }
        let f = AtomicFile::create(&target, None).expect("create");
        assert_eq!(f.cleaned().len(), 1, "{:?}", f.cleaned());
        for (n, removed) in &names {
            assert_eq!(!dir.path().join(n).exists(), *removed, "{n}");
        }
        f.commit().expect("commit");
        assert!(target.exists());
    }
}
