//! Saves: [`save`] (one file) and [`save_sharded`] (shards + index, crash-safe as a whole:
//! new shards under unused names, the index written last, a directory lock held throughout).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpufeed_load::{Piece, SaveReport, Saver};
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::header::parse;
use crate::index::{FILE_SIZES_KEY, SAVE_ID_KEY, shards};

/// A tensor to save: its name, element type, shape, and bytes (on the GPU or the host).
#[derive(Debug, Clone, Copy)]
pub struct SaveTensor<'a> {
    /// The name (unique in the checkpoint; not `__metadata__`).
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major).
    pub shape: &'a [usize],
    /// The bytes: exactly the shape's element count times the dtype's size.
    pub data: Piece<'a>,
}

/// The data bytes of `t`, checked against its dtype and shape.
pub(crate) fn tensor_bytes(t: &SaveTensor<'_>) -> Result<usize> {
    let bad = |why: String| Error::invalid(format!("tensor {:?}: {why}", t.name));
    if t.name.is_empty() || t.name == "__metadata__" {
        return Err(bad(
            "a tensor needs a name other than \"\" and __metadata__".into(),
        ));
    }
    let bits = t
        .shape
        .iter()
        .try_fold(t.dtype.bitsize(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {:?} overflows", t.shape)))?;
    if bits % 8 != 0 {
        return Err(bad(format!(
            "{} elements of {} do not fill whole bytes",
            t.shape.iter().product::<usize>(),
            t.dtype
        )));
    }
    let len = match t.data {
        Piece::Device(v) => v.len(),
        Piece::Host(b) => b.len(),
    };
    if len != bits / 8 {
        return Err(bad(format!(
            "{} {:?} is {} bytes, but {len} bytes were given",
            t.dtype,
            t.shape,
            bits / 8
        )));
    }
    Ok(len)
}

/// The file's head: the header's length (u64 LE) and its JSON, padded with spaces so that the
/// data starts on a 4 KiB boundary (written with `O_DIRECT` like the rest).
pub(crate) fn save_head(
    tensors: &[SaveTensor<'_>],
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut map = serde_json::Map::new();
    if let Some(m) = metadata {
        map.insert("__metadata__".into(), serde_json::json!(m));
    }
    let mut offset = 0usize;
    for t in tensors {
        let len = tensor_bytes(t)?;
        let entry = serde_json::json!({
            "dtype": t.dtype,
            "shape": t.shape,
            "data_offsets": [offset, offset + len],
        });
        if map.insert(t.name.to_owned(), entry).is_some() {
            return Err(Error::invalid(format!(
                "tensor {:?} is given twice",
                t.name
            )));
        }
        offset += len;
    }
    let mut json = serde_json::to_vec(&map)
        .map_err(|e| Error::invalid(format!("the header cannot be written: {e}")))?;
    let padded = (8 + json.len()).next_multiple_of(4096) - 8;
    json.resize(padded, b' ');
    let mut head = (padded as u64).to_le_bytes().to_vec();
    head.extend_from_slice(&json);
    Ok(head)
}

/// Saves `tensors` (GPU or host memory) with optional `metadata` as one safetensors file at
/// `path`, replacing it whole (crash-safe, see [`Saver`]). The header is padded so that the data
/// starts on a 4 KiB boundary; the file loads with gpufeed, the `safetensors` crate and
/// `safetensors.torch.load_file`.
///
/// # Errors
/// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for a tensor whose bytes do not match its dtype and shape, a
/// duplicate or reserved name; then [`Saver::save_file`]'s.
///
/// # Example
/// ```
/// use gpufeed_safetensors::{Dtype, SaveTensor, save};
/// use gpufeed_load::{Piece, SaveOptions, Saver};
/// # let dir = tempfile::tempdir()?;
/// let saver = Saver::host(SaveOptions::default())?; // Saver::new(&gpu, ..) for GPU memory
/// let w = vec![0u8; 4 * 6];
/// let t = SaveTensor { name: "w", dtype: Dtype::F32, shape: &[2, 3], data: Piece::Host(&w) };
/// let report = save(&saver, &[t], None, dir.path().join("model.safetensors"))?;
/// assert_eq!(report.bytes, 4096 + 24);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn save(
    saver: &Saver,
    tensors: &[SaveTensor<'_>],
    metadata: Option<&BTreeMap<String, String>>,
    path: impl AsRef<Path>,
) -> Result<SaveReport> {
    let head = save_head(tensors, metadata)?;
    let pieces: Vec<Piece<'_>> = tensors.iter().map(|t| t.data).collect();
    Ok(saver.save_pieces(&head, &pieces, path.as_ref())?)
}

/// Saves `tensors` as shards of at most `max_shard_bytes` of data each (a tensor larger than
/// that gets a shard of its own) in `dir`, and the index `<prefix>.safetensors.index.json`
/// (`metadata.total_size`, `weight_map`) last. Returns one report per shard; load it back with
/// [`load`](crate::load) on the index.
///
/// Crash-safe as a whole, not only file by file: the index on disk always names shards of one
/// save. The new shards go under names that no file in `dir` has yet
/// (`<prefix>-00001-of-0000N.safetensors` where those are free, else
/// `<prefix>-<save id>-00001-of-0000N.safetensors`), so the old index keeps naming the old,
/// untouched shards until the new index replaces it in one rename ([`Saver::save_bytes`]).
/// Only then are the safetensors files the old index named removed (and shards that earlier
/// stopped saves of this prefix wrote and no index names: gpufeed's names with a save id in the
/// header). Saves into one directory hold an exclusive `flock` on it throughout, so that
/// overlapping saves (several ranks saving without a rank-0 guard) run one after the other. A save that fails or is killed midway leaves the old
/// checkpoint as it was (a failed save removes the shards it wrote; a killed one leaves them
/// for the next save of the prefix to remove). Each shard's header metadata and the index record
/// the save's random id ([`SAVE_ID_KEY`]) and the index each shard's size ([`FILE_SIZES_KEY`]):
/// [`load`](crate::load), [`inspect`](crate::inspect) and the other readers of an index refuse a set of files of different
/// saves with [`Error::MixedCheckpoint`] naming the files.
///
/// # Example
/// ```
/// use gpufeed_safetensors::{Dtype, SaveTensor, inspect, save_sharded};
/// use gpufeed_load::{Piece, SaveOptions, Saver};
/// # let dir = tempfile::tempdir()?;
/// let saver = Saver::host(SaveOptions::default())?;
/// let (a, b) = (vec![1u8; 4096], vec![2u8; 4096]);
/// let tensors = [
///     SaveTensor { name: "a", dtype: Dtype::U8, shape: &[4096], data: Piece::Host(&a) },
///     SaveTensor { name: "b", dtype: Dtype::U8, shape: &[4096], data: Piece::Host(&b) },
/// ];
/// let reports = save_sharded(&saver, &tensors, None, dir.path(), "model", 4096)?;
/// assert_eq!(reports.len(), 2);
/// let files = inspect(dir.path().join("model.safetensors.index.json"))?;
/// assert_eq!(files.len(), 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`save`]'s for each shard and [`Saver::save_bytes`]' for the index; the old checkpoint is
/// then left as it was.
pub fn save_sharded(
    saver: &Saver,
    tensors: &[SaveTensor<'_>],
    metadata: Option<&BTreeMap<String, String>>,
    dir: impl AsRef<Path>,
    prefix: &str,
    max_shard_bytes: u64,
) -> Result<Vec<SaveReport>> {
    let dir = dir.as_ref();
    let mut groups: Vec<Vec<SaveTensor<'_>>> = vec![Vec::new()];
    let (mut in_shard, mut total) = (0u64, 0u64);
    for t in tensors {
        let len = tensor_bytes(t)? as u64;
        total += len;
        let last = groups.last_mut().expect("one shard at least");
        if !last.is_empty() && in_shard + len > max_shard_bytes {
            groups.push(Vec::new());
            in_shard = 0;
        }
        groups.last_mut().expect("one shard at least").push(*t);
        in_shard += len;
    }
    let index_path = dir.join(format!("{prefix}.safetensors.index.json"));
    // One sharded save in the directory at a time: the cleanup below must never take another
    // save's new shards for leftovers.
    let _lock = DirLock::acquire(dir)?;
    // What the index on disk names now: removed once the new index replaces it (the
    // safetensors files among them: an index is no licence to remove anything else).
    let previous = shards(&index_path)
        .map(|i| i.files.into_iter().map(|f| f.0).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with(".safetensors") && parse(p).is_ok())
        .collect::<Vec<_>>();
    let save_id = new_save_id();
    let names = shard_names(dir, prefix, groups.len(), &save_id);
    let mut shard_metadata = metadata.cloned().unwrap_or_default();
    shard_metadata.insert(SAVE_ID_KEY.to_owned(), save_id.clone());

    let mut weight_map = BTreeMap::new();
    let mut sizes = BTreeMap::new();
    let mut reports = Vec::with_capacity(groups.len());
    let mut written = Vec::with_capacity(groups.len());
    let outcome = (|| -> Result<SaveReport> {
        for (shard, name) in groups.iter().zip(&names) {
            for t in shard {
                weight_map.insert(t.name.to_owned(), name.clone());
            }
            let path = dir.join(name);
            let report = save(saver, shard, Some(&shard_metadata), &path)?;
            written.push(path);
            sizes.insert(name.clone(), report.bytes);
            reports.push(report);
        }
        let index = serde_json::json!({
            "metadata": {
                "total_size": total,
                SAVE_ID_KEY: save_id,
                FILE_SIZES_KEY: sizes,
            },
            "weight_map": weight_map,
        });
        let text = serde_json::to_vec_pretty(&index)
            .map_err(|e| Error::invalid(format!("the index cannot be written: {e}")))?;
        // The one switch from the old save to the new.
        Ok(saver.save_bytes(&text, &index_path)?)
    })();
    if let Err(e) = outcome {
        // The old index still names the old shards; the new ones are of no index.
        for path in &written {
            remove_shard(path);
        }
        return Err(e);
    }
    let new: Vec<PathBuf> = names.iter().map(|n| dir.join(n)).collect();
    for path in previous.iter().chain(&unnamed_shards(dir, prefix)) {
        if !new.contains(path) {
            remove_shard(path);
        }
    }
    Ok(reports)
}

/// An exclusive `flock` on a directory, held for the whole of a [`save_sharded`] into it: saves
/// into one directory (several ranks saving without a rank-0 guard, an asynchronous checkpoint
/// overlapping the one before) run one after the other. A file system without `flock` on
/// directories saves without it (said once with `tracing` at warn).
pub(crate) struct DirLock {
    /// Held open: the lock lives as long as the descriptor.
    pub(crate) _dir: std::fs::File,
}

impl DirLock {
    fn acquire(dir: &Path) -> Result<Self> {
        use rustix::fs::FlockOperation;
        let file =
            std::fs::File::open(dir).map_err(|e| Error::from(gpufeed_os::Error::open(dir, e)))?;
        let mut waited = std::time::Instant::now();
        loop {
            match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(DirLock { _dir: file }),
                Err(rustix::io::Errno::WOULDBLOCK) => {
                    if waited.elapsed() >= std::time::Duration::from_secs(30) {
                        tracing::warn!(
                            dir = %dir.display(),
                            "still waiting for another sharded save into this directory to end"
                        );
                        waited = std::time::Instant::now();
                    }
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => {
                    static ONCE: std::sync::Once = std::sync::Once::new();
                    ONCE.call_once(|| {
                        tracing::warn!(
                            dir = %dir.display(),
                            "cannot lock the directory ({e}): sharded saves into it are not \
                             kept apart"
                        )
                    });
                    return Ok(DirLock { _dir: file });
                }
            }
        }
    }
}

/// A random id for one [`save_sharded`]: 16 hex digits (std's randomly keyed hasher over the
/// pid and the time).
pub(crate) fn new_save_id() -> String {
    use std::hash::BuildHasher;
    let random = std::collections::hash_map::RandomState::new()
        .hash_one((std::process::id(), std::time::SystemTime::now()));
    format!("{random:016x}")
}

/// The shard names of a save of `n` shards: `<prefix>-0000i-of-0000N.safetensors` where no
/// file of any of those names is in `dir`, else with the save's id after the prefix (names no
/// earlier save used).
pub(crate) fn shard_names(dir: &Path, prefix: &str, n: usize, save_id: &str) -> Vec<String> {
    let plain: Vec<String> = (1..=n)
        .map(|i| format!("{prefix}-{i:05}-of-{n:05}.safetensors"))
        .collect();
    if plain
        .iter()
        .all(|name| std::fs::symlink_metadata(dir.join(name)).is_err())
    {
        return plain;
    }
    (1..=n)
        .map(|i| format!("{prefix}-{save_id}-{i:05}-of-{n:05}.safetensors"))
        .collect()
}

/// Files in `dir` that a sharded save of `prefix` wrote ([`shard_names`]'s names, a save id in
/// the header, and for a name with an id, that id): after a new index is in place, those it
/// does not name are left by saves that stopped. Files of other tools, and shards of a
/// checkpoint whose prefix only looks like `<prefix>-<id>`, are not among them.
pub(crate) fn unnamed_shards(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let Some(named_id) = name
                .to_str()
                .and_then(|n| n.strip_prefix(prefix)?.strip_prefix('-'))
                .and_then(shard_suffix_id)
            else {
                return false;
            };
            parse(&e.path()).is_ok_and(|p| match (named_id, p.save_id) {
                (Some(named), Some(id)) => named == id,
                (None, id) => id.is_some(),
                (Some(_), None) => false,
            })
        })
        .map(|e| e.path())
        .collect()
}

/// For `00001-of-00004.safetensors`, `Some(None)`; for `<16 hex>-00001-of-00004.safetensors`,
/// `Some(Some(id))`; else `None`.
pub(crate) fn shard_suffix_id(rest: &str) -> Option<Option<&str>> {
    let rest = rest.strip_suffix(".safetensors")?;
    let digits = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit());
    let count = |s: &str| {
        s.split_once("-of-")
            .is_some_and(|(i, n)| digits(i, 5) && digits(n, 5))
    };
    match rest.split_once('-') {
        Some((id, tail)) if id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()) => {
            count(tail).then_some(Some(id))
        }
        _ => count(rest).then_some(None),
    }
}

/// Removes a shard file no index names; a failure is only logged (the file is of no index).
pub(crate) fn remove_shard(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(
            path = %path.display(),
            "could not remove a shard no index names: {e}"
        ),
    }
}
