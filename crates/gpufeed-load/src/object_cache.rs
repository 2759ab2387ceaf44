//! A local cache directory of objects (the `object` feature): each object's bytes fetched once
//! into a file named by its store, key and version, so that later loads read a local file (from the
//! page cache, once read) and the batch loader can map shards that live in a bucket.

use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use gpufeed_object::Object;
use gpufeed_os::AtomicFile;

use crate::error::{Error, Result};

/// Bytes read from the object per piece while fetching: two pieces in memory (one being
/// read by ranged GETs, one being written), so a fetch's host memory stays bounded.
const PIECE: usize = 64 << 20;

/// A directory of this user's that holds fetched objects, one file per object version:
/// `<hash of store, key, ETag and size>-<the key's last part>`. An object whose version is already
/// there is not fetched again; a replaced object (another ETag or size) is fetched into a
/// file of its own. The directory is made (mode 0700) where missing and refused where another
/// user owns it or may write in it (they could plant files in it under the names it looks
/// for); cached files are opened without following links and checked to be this user's
/// regular files of the object's size.
///
/// An object without an ETag cannot be told from a replaced one of the same size: it is
/// fetched again by every [`ObjectCache::fetch`].
///
/// # Example
/// ```no_run
/// use gpufeed_load::object::{Object, ObjectCache};
/// let cache = ObjectCache::open("/var/cache/gpufeed")?;
/// let object = Object::open("s3://data/train-0000.tar", &Default::default())?;
/// let local = cache.fetch(&object)?;
/// println!("{} ({})", local.path.display(), if local.fetched { "fetched" } else { "cached" });
/// # Ok::<(), gpufeed_load::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ObjectCache {
    dir: PathBuf,
}

/// An object's bytes in the cache ([`ObjectCache::fetch`]).
#[derive(Debug, Clone, PartialEq)]
pub struct CachedObject {
    /// The local file.
    pub path: PathBuf,
    /// Whether this call fetched it (`false`: it was there).
    pub fetched: bool,
    /// Its length.
    pub bytes: u64,
    /// Seconds this call took.
    pub seconds: f64,
}

impl ObjectCache {
    /// The cache at `dir`, made where missing: its missing parents as `mkdir -p` makes them
    /// (the umask's mode), then `dir` itself with mode 0700.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] where `dir` is not a directory (a link to one included),
    /// another user owns it, or its group or others may write in it; I/O errors making it
    /// ([`Error::Os`]).
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        if std::fs::symlink_metadata(&dir).is_err() {
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(|e| io_error("mkdir -p", parent, e))?;
            }
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                // Made meanwhile by another process: checked below like any other.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                other => other.map_err(|e| io_error("mkdir", &dir, e))?,
            }
        }
        let meta = std::fs::symlink_metadata(&dir)
            .map_err(|e| cache_error(&dir, format!("cannot stat it: {e}")))?;
        if !meta.is_dir() {
            return Err(cache_error(
                &dir,
                "not a directory (a link is refused too: give the directory itself)".into(),
            ));
        }
        let me = rustix_euid();
        if meta.uid() != me {
            return Err(cache_error(
                &dir,
                format!(
                    "owned by uid {}, not by this user ({me}): another user's files could be \
                     taken for objects; use a directory of your own",
                    meta.uid()
                ),
            ));
        }
        if meta.mode() & 0o022 != 0 {
            return Err(cache_error(
                &dir,
                format!(
                    "mode {:o}: its group or others may write in it and plant files under \
                     the names it looks for; chmod go-w it, or use a private directory",
                    meta.mode() & 0o7777
                ),
            ));
        }
        Ok(ObjectCache { dir })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where `object`'s version is (or would be) cached: named by its store, key, ETag and
    /// size.
    pub fn path_of(&self, object: &Object) -> PathBuf {
        let url = object.url();
        let key = format!(
            "{:?}\0{}\0{}\0{}\0{}",
            url.scheme(),
            url.bucket(),
            url.key(),
            object.etag().unwrap_or("(no ETag)"),
            object.len()
        );
        let hash = xxhash_rust::xxh3::xxh3_128(key.as_bytes());
        // The key's last part, for people reading the directory: what a file name may hold.
        let tail: String = url
            .key()
            .rsplit('/')
            .next()
            .unwrap_or("")
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                    c
                } else {
                    '_'
                }
            })
            .take(100)
            .collect();
        let tail = tail.trim_start_matches('.');
        self.dir.join(format!("{hash:032x}-{tail}"))
    }

    /// `object`'s bytes as a local file: the cached one where this version is there (this
    /// user's regular file of its size), else fetched now by ranged GETs of the version
    /// opened into a new file that replaces the name whole once its bytes are synced (a
    /// fetch cut short leaves nothing under the name).
    ///
    /// # Errors
    /// The object's read errors ([`Error::Object`]: replaced since it was opened, a request
    /// that failed after its retries); the file's ([`Error::Os`]: no space, I/O);
    /// [`Error::InvalidSetting`] where the name is taken by something that is not this user's
    /// regular file.
    pub fn fetch(&self, object: &Object) -> Result<CachedObject> {
        let started = Instant::now();
        let path = self.path_of(object);
        let cached = |fetched| CachedObject {
            path: path.clone(),
            fetched,
            bytes: object.len(),
            seconds: started.elapsed().as_secs_f64(),
        };
        if object.etag().is_some() && self.holds(&path, object.len())? {
            return Ok(cached(false));
        }
        let file = AtomicFile::create(&path, (!object.is_empty()).then_some(object.len()))?;
        write_object(object, file.file(), &path)?;
        // The commit gives a new file the umask's mode, which may let the group write (umask
        // 002), and `holds` refuses such a file: take those bits away, on the descriptor.
        let written = file
            .file()
            .try_clone()
            .map_err(|e| io_error("dup", &path, e))?;
        file.commit()?;
        let mode = written
            .metadata()
            .map_err(|e| io_error("fstat", &path, e))?
            .permissions()
            .mode();
        written
            .set_permissions(std::fs::Permissions::from_mode(mode & 0o755))
            .map_err(|e| io_error("fchmod", &path, e))?;
        Ok(cached(true))
    }

    /// Whether `path` is this user's regular file of `len` bytes (`false` where nothing is
    /// there or it has another size: fetched again).
    fn holds(&self, path: &Path, len: u64) -> Result<bool> {
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc_o_nofollow())
            .open(path);
        let file = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => {
                return Err(cache_error(
                    path,
                    format!("the cached name cannot be opened as a file ({e}); remove it"),
                ));
            }
        };
        let meta = file
            .metadata()
            .map_err(|e| cache_error(path, format!("cannot stat it: {e}")))?;
        if !meta.is_file() || meta.uid() != rustix_euid() {
            return Err(cache_error(
                path,
                "the cached name is not this user's regular file; remove it".into(),
            ));
        }
        // Read-only for the group and others is fine; writable by them it is not ours alone.
        if meta.permissions().mode() & 0o022 != 0 {
            return Err(cache_error(
                path,
                "the cached file may be written by others; remove it".into(),
            ));
        }
        Ok(meta.len() == len)
    }
}

/// All of `object` into `file`, in pieces: one read by ranged GETs while the one before is
/// written.
fn write_object(object: &Object, file: &std::fs::File, path: &Path) -> Result<()> {
    let len = object.len();
    let pieces: Vec<(u64, usize)> = (0..len)
        .step_by(PIECE)
        .map(|at| (at, (len - at).min(PIECE as u64) as usize))
        .collect();
    let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<(u64, Vec<u8>)>(1);
    let (empty_tx, empty_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    for _ in 0..2 {
        let _ = empty_tx.send(Vec::new());
    }
    std::thread::scope(|scope| {
        let reader = std::thread::Builder::new()
            .name("gpufeed-fetch".into())
            .spawn_scoped(scope, move || -> Result<()> {
                for &(at, n) in &pieces {
                    let Ok(mut buf) = empty_rx.recv() else {
                        return Ok(()); // the writer stopped on an error of its own
                    };
                    buf.resize(n, 0);
                    object.read_exact_at(at, &mut buf)?;
                    if full_tx.send((at, buf)).is_err() {
                        return Ok(());
                    }
                }
                Ok(())
            })
            .map_err(|source| Error::ThreadStart {
                what: "a thread to fetch an object",
                source,
            })?;
        let mut written = Ok(());
        for (at, buf) in full_rx.iter() {
            if let Err(e) = file.write_all_at(&buf, at) {
                written = Err(if e.raw_os_error() == Some(28) {
                    // ENOSPC
                    gpufeed_os::Error::NoSpace {
                        path: path.into(),
                        needed: len,
                    }
                    .into()
                } else {
                    io_error("write", path, e)
                });
                break;
            }
            let _ = empty_tx.send(buf);
        }
        drop(empty_tx);
        // Unblocks a reader waiting to hand over a piece after a failed write.
        drop(full_rx);
        let read = reader.join().unwrap_or_else(|_| {
            Err(Error::ThreadPanicked {
                what: "the thread fetching an object",
            })
        });
        read.and(written)
    })
}

fn io_error(op: &'static str, path: &Path, source: std::io::Error) -> Error {
    gpufeed_os::Error::Io {
        op,
        path: Some(path.into()),
        source,
    }
    .into()
}

fn cache_error(path: &Path, reason: String) -> Error {
    Error::InvalidSetting(format!("object cache {}: {reason}", path.display()))
}

/// This process's effective user id.
fn rustix_euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// `O_NOFOLLOW`: a link in the cache is refused, not followed.
fn libc_o_nofollow() -> i32 {
    rustix::fs::OFlags::NOFOLLOW.bits() as i32
}
