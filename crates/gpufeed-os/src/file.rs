//! Opening regular files with clear errors, and recording their identity.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::{Error, Result};

/// What identifies one version of a file: device, inode, size and modification time.
///
/// Two identities differ when the file was replaced, truncated, extended or written.
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
}

impl FileIdentity {
    /// The identity of an open file now.
    pub fn of(file: &File) -> Result<Self> {
        let meta = file.metadata().map_err(|e| Error::io("fstat", None, e))?;
        Ok(Self::from_metadata(&meta))
    }

    pub(crate) fn from_metadata(meta: &std::fs::Metadata) -> Self {
        FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
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
        } else {
            None
        }
    }
}

/// Opens `path` for reading (and writing if `write`), refusing anything but a regular file.
pub(crate) fn open_regular(path: &Path, write: bool) -> Result<(File, FileIdentity)> {
    let file = OpenOptions::new()
        .read(true)
        .write(write)
        .open(path)
        .map_err(|e| Error::open(path, e))?;
    let meta = file
        .metadata()
        .map_err(|e| Error::io("fstat", Some(path.into()), e))?;
    if meta.is_dir() {
        return Err(Error::IsDirectory { path: path.into() });
    }
    if !meta.is_file() {
        return Err(Error::NotRegularFile { path: path.into() });
    }
    Ok((file, FileIdentity::from_metadata(&meta)))
}
