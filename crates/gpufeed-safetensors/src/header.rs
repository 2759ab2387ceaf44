//! The safetensors header: its length, its JSON, the tensors' places checked to tile the data
//! section, read with `pread` on the descriptor that the load then uses.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use gpufeed_os::OpenedFile;
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::index::SAVE_ID_KEY;

/// The tensors of one safetensors file, where its data section starts, and which version of
/// the file the header came from.
pub(crate) struct Parsed {
    pub(crate) data_start: u64,
    pub(crate) data_len: u64,
    /// Sorted by name; shared with every other parse of the same header bytes in this
    /// process ([`parts_of_file`]).
    pub(crate) tensors: Arc<[HeaderEntry]>,
    /// The save that wrote it ([`SAVE_ID_KEY`] of its `__metadata__`), where one did.
    pub(crate) save_id: Option<String>,
    /// Its `__metadata__`, where it has one.
    pub(crate) metadata: Option<BTreeMap<String, String>>,
    /// The file, opened once: the load reads through this descriptor and checks on it
    /// afterwards that this version was not written meanwhile.
    pub(crate) file: OpenedFile,
}

/// Opens `path` once and reads and validates its header with `pread` on that descriptor (never
/// through a mapping: a file truncated meanwhile is an error, not SIGBUS); the load then reads
/// the data through the same descriptor.
pub(crate) fn parse(path: &Path) -> Result<Parsed> {
    let opened = OpenedFile::open(path)?;
    let (file, identity) = (opened.file(), *opened.identity());
    let bad = |reason: HeaderError| Error::Safetensors {
        path: path.into(),
        reason,
    };
    let len = identity.size;
    let mut n = [0u8; 8];
    read_exact_at(file, &mut n, 0, len).map_err(|e| read_failed(e, path))?;
    let header_len = header_len(u64::from_le_bytes(n), len).map_err(bad)?;
    // The length field again in front of the header, as `header_of` takes it.
    let mut prefix = vec![0u8; 8 + header_len as usize];
    prefix[..8].copy_from_slice(&n);
    read_exact_at(file, &mut prefix[8..], 8, len).map_err(|e| read_failed(e, path))?;
    let (data_start, tensors, metadata) = parts_of_file(&prefix, len).map_err(bad)?;
    Ok(Parsed {
        data_start,
        data_len: len - data_start,
        tensors,
        save_id: metadata.as_ref().and_then(|m| m.get(SAVE_ID_KEY).cloned()),
        metadata,
        file: opened,
    })
}

/// The parts of headers parsed before in this process, for the files opened again: a
/// checkpoint loaded twice, a shard that a framework opens for its names and again for its
/// tensors. A file's header is read on every open (through the descriptor the load then uses)
/// and found here only where its bytes, every one, and the file's length are those of a header
/// parsed before: what [`header_parts`] returns is a function of nothing else, so a hit is
/// that parse, whatever happened to the file meanwhile. The most recent [`CACHED_HEADERS`]
/// headers of at most [`CACHED_HEADER_BYTES`] each, [`CACHED_TOTAL_BYTES`] in all, are kept
/// (the parse takes about twice its header's bytes).
struct HeaderCache {
    /// Most recent first.
    headers: VecDeque<CachedHeader>,
}

struct CachedHeader {
    file_len: u64,
    prefix: Box<[u8]>,
    data_start: u64,
    tensors: Arc<[HeaderEntry]>,
    metadata: Option<BTreeMap<String, String>>,
}

/// How many headers [`HeaderCache`] keeps (a checkpoint of 190 shards reopened finds each).
const CACHED_HEADERS: usize = 256;
/// The largest header [`HeaderCache`] keeps (a header of 100,000 tensors is about 10 MB).
const CACHED_HEADER_BYTES: usize = 16 << 20;
/// The header bytes [`HeaderCache`] keeps in all (their parses take about twice as much).
const CACHED_TOTAL_BYTES: usize = 64 << 20;

static HEADERS: Mutex<HeaderCache> = Mutex::new(HeaderCache {
    headers: VecDeque::new(),
});

fn headers() -> std::sync::MutexGuard<'static, HeaderCache> {
    HEADERS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A header's parts shared: where the data section starts, the tensors sorted by name, the
/// `__metadata__`.
pub(crate) type SharedParts = (u64, Arc<[HeaderEntry]>, Option<BTreeMap<String, String>>);

impl HeaderCache {
    /// The parse of `prefix` in a file of `file_len` bytes, made the most recent, if kept.
    fn hit(&mut self, prefix: &[u8], file_len: u64) -> Option<SharedParts> {
        let found = self
            .headers
            .iter()
            .position(|h| h.file_len == file_len && *h.prefix == *prefix)?;
        let hit = self.headers.remove(found)?;
        let parts = (
            hit.data_start,
            Arc::clone(&hit.tensors),
            hit.metadata.clone(),
        );
        self.headers.push_front(hit);
        Some(parts)
    }
}

/// [`header_parts`] of a file's `prefix` (the length field and the header, exactly), from
/// [`HeaderCache`] where the same bytes of a file of the same length were parsed before.
pub(crate) fn parts_of_file(
    prefix: &[u8],
    file_len: u64,
) -> std::result::Result<SharedParts, HeaderError> {
    if let Some(parts) = headers().hit(prefix, file_len) {
        return Ok(parts);
    }
    // Parsed (and the bytes copied) outside the lock: another thread's open does not wait.
    let (data_start, tensors, metadata) = header_parts(prefix, file_len)?;
    let tensors: Arc<[HeaderEntry]> = tensors.into();
    if prefix.len() > CACHED_HEADER_BYTES {
        return Ok((data_start, tensors, metadata));
    }
    let kept = CachedHeader {
        file_len,
        prefix: prefix.into(),
        data_start,
        tensors: Arc::clone(&tensors),
        metadata: metadata.clone(),
    };
    let mut cache = headers();
    // Another thread parsed the same header meanwhile: one parse, theirs.
    if let Some(parts) = cache.hit(prefix, file_len) {
        return Ok(parts);
    }
    cache.headers.push_front(kept);
    let mut total: usize = cache.headers.iter().map(|h| h.prefix.len()).sum();
    while cache.headers.len() > CACHED_HEADERS || total > CACHED_TOTAL_BYTES {
        match cache.headers.pop_back() {
            Some(gone) => total -= gone.prefix.len(),
            None => break,
        }
    }
    Ok((data_start, tensors, metadata))
}

/// Whether `tensors` is a parse this crate keeps now: a file whose header it is, opened
/// again, gets these very tensors (until more recent headers push it out). Every open of a
/// file ([`load`](crate::load), [`inspect`](crate::inspect), ...) reads its header and finds it
/// among the last 256 parsed in the process (up to 16 MiB each, 64 MiB in all) where its
/// bytes and the file's length are the same.
///
/// # Example
/// ```no_run
/// let first = gpufeed_safetensors::inspect("model.safetensors")?;
/// let again = gpufeed_safetensors::inspect("model.safetensors")?;
/// assert!(std::sync::Arc::ptr_eq(&first[0].tensors, &again[0].tensors));
/// assert!(gpufeed_safetensors::parse_is_kept(&first[0].tensors));
/// # Ok::<(), gpufeed_safetensors::Error>(())
/// ```
pub fn parse_is_kept(tensors: &Arc<[HeaderEntry]>) -> bool {
    headers()
        .headers
        .iter()
        .any(|h| Arc::ptr_eq(&h.tensors, tensors))
}

/// Why a read of the header failed.
pub(crate) enum ReadFailed {
    /// What is wrong with the header (the file, as long as when opened, is too short for it;
    /// an IO error).
    Header(HeaderError),
    /// The file ended before the length it had when it was opened: it shrank meanwhile.
    Shrank { below: u64 },
}

pub(crate) fn read_exact_at(
    file: &std::fs::File,
    buf: &mut [u8],
    offset: u64,
    file_len: u64,
) -> std::result::Result<(), ReadFailed> {
    use std::os::unix::fs::FileExt;
    let need = offset + buf.len() as u64;
    file.read_exact_at(buf, offset).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof if need <= file_len => ReadFailed::Shrank { below: need },
        std::io::ErrorKind::UnexpectedEof => {
            ReadFailed::Header(HeaderError::Truncated { file_len, need })
        }
        _ => ReadFailed::Header(HeaderError::Unreadable {
            reason: e.to_string(),
        }),
    })
}

/// The error of a failed header read of `path`.
fn read_failed(e: ReadFailed, path: &Path) -> Error {
    match e {
        ReadFailed::Header(reason) => Error::Safetensors {
            path: path.into(),
            reason,
        },
        ReadFailed::Shrank { below } => gpufeed_load::Error::FileChangedDuringLoad {
            path: path.into(),
            what: format!("it shrank below {below} bytes while its header was read"),
        }
        .into(),
    }
}

/// What is wrong with a safetensors header ([`header_of`], and the `reason` of
/// [`Error::Safetensors`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderError {
    /// The file ends before its header does: it has `file_len` bytes, the header needs `need`.
    #[error(
        "the file has {file_len} bytes but its header needs {need}{}; it is truncated",
        if *.need == 8 { " (the 8 that give the header's length)" } else { "" }
    )]
    Truncated {
        /// The file's length.
        file_len: u64,
        /// The bytes the length field and the header take.
        need: u64,
    },
    /// The bytes given to [`header_of`] stop before the header does (the file itself may be
    /// whole): read `need` bytes from its start and try again.
    #[error("the {have} bytes given end inside the header, which needs {need}")]
    Incomplete {
        /// The bytes given.
        have: u64,
        /// The bytes the length field and the header take.
        need: u64,
    },
    /// The length field claims more than a safetensors header may have
    /// ([`MAX_HEADER_BYTES`]).
    #[error(
        "the header claims {claimed} bytes, more than the {MAX_HEADER_BYTES} a safetensors \
         header may have"
    )]
    TooLarge {
        /// What the length field says.
        claimed: u64,
    },
    /// The header is not UTF-8 JSON describing tensors (the `safetensors` crate's own checks:
    /// `__metadata__` a map of strings, each tensor a dtype, a shape and two offsets).
    #[error("the header does not describe valid tensors: {reason}")]
    NotTensors {
        /// The parser's message.
        reason: String,
    },
    /// A tensor whose bytes do not fit its place: a gap or an overlap with the tensor before
    /// it, a size other than its dtype and shape's, or a shape too large.
    #[error("tensor {tensor}: {reason}")]
    BadTensor {
        /// The tensor's name.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The tensors cover other than the data section's bytes: the file is truncated, extended
    /// or not a safetensors file.
    #[error(
        "the tensors cover {covered} bytes but the data section has {data_len}: the file is \
         truncated, extended or not a safetensors file"
    )]
    DataSize {
        /// Bytes the tensors cover.
        covered: u64,
        /// Bytes after the header.
        data_len: u64,
    },
    /// Two tensors of one name.
    #[error("tensor {tensor} appears twice in the header")]
    Duplicate {
        /// The name.
        tensor: String,
    },
    /// Reading the header failed (an IO error other than the file's end).
    #[error("reading the header failed: {reason}")]
    Unreadable {
        /// The system's message.
        reason: String,
    },
}

/// Largest header the `safetensors` crate accepts.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Checks the header length `n` read from the first 8 bytes of a file of `file_len` bytes.
pub(crate) fn header_len(n: u64, file_len: u64) -> std::result::Result<u64, HeaderError> {
    if file_len < 8 {
        return Err(HeaderError::Truncated { file_len, need: 8 });
    }
    if n > MAX_HEADER_BYTES {
        return Err(HeaderError::TooLarge { claimed: n });
    }
    if 8 + n > file_len {
        return Err(HeaderError::Truncated {
            file_len,
            need: 8 + n,
        });
    }
    Ok(n)
}

/// One tensor of a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderEntry {
    /// Its name.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape (row-major).
    pub shape: Vec<usize>,
    /// Its bytes in the data section (from the data section's start).
    pub range: Range<usize>,
}

/// Validates the header of a whole safetensors file held in `bytes`; see [`header_of`].
pub fn header(bytes: &[u8]) -> std::result::Result<(u64, Vec<HeaderEntry>), HeaderError> {
    header_of(bytes, bytes.len() as u64)
}

/// Validates the header of a safetensors file of `file_len` bytes whose first bytes are in
/// `prefix` (at least the 8-byte length and the header): the JSON, dtypes, shapes against
/// sizes (the checks of the `safetensors` crate's `Metadata`, in one pass), that the tensors
/// tile the data section exactly, and that no name is used twice. Returns where the data
/// section starts and the tensors, sorted by name, or what is wrong ([`HeaderError`];
/// [`HeaderError::Incomplete`] where `prefix` is too short: read that many bytes). Never
/// panics, whatever the bytes (fuzzed: crates/gpufeed/fuzz; property-tested in this crate).
///
/// # Example
/// ```
/// let bytes = safetensors::serialize(
///     [("w", safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &[0u8; 8]).unwrap())],
///     None,
/// )?;
/// let (data_start, tensors) = gpufeed_safetensors::header(&bytes)?;
/// assert_eq!((tensors[0].name.as_str(), tensors[0].range.clone()), ("w", 0..8));
/// assert_eq!(data_start as usize, bytes.len() - 8);
/// let cut = gpufeed_safetensors::header_of(&bytes[..12], bytes.len() as u64).unwrap_err();
/// assert!(matches!(cut, gpufeed_safetensors::HeaderError::Incomplete { have: 12, .. }));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn header_of(
    prefix: &[u8],
    file_len: u64,
) -> std::result::Result<(u64, Vec<HeaderEntry>), HeaderError> {
    header_parts(prefix, file_len).map(|(start, tensors, _)| (start, tensors))
}

/// [`header`] of a whole file in `bytes`, with the header's `__metadata__` (where it has one):
/// `(data start, tensors sorted by name, metadata)`.
///
/// # Errors
/// As for [`header_of`].
pub fn header_and_metadata(bytes: &[u8]) -> std::result::Result<HeaderParts, HeaderError> {
    header_parts(bytes, bytes.len() as u64)
}

/// A header's parts: where the data section starts, the tensors (sorted by name) and the
/// `__metadata__` (where it has one).
pub type HeaderParts = (u64, Vec<HeaderEntry>, Option<BTreeMap<String, String>>);

/// [`header_of`], with the header's `__metadata__` (where it has one).
pub(crate) fn header_parts(
    prefix: &[u8],
    file_len: u64,
) -> std::result::Result<HeaderParts, HeaderError> {
    let Some(n) = prefix.get(..8) else {
        let have = prefix.len() as u64;
        return Err(if file_len < 8 {
            HeaderError::Truncated { file_len, need: 8 }
        } else {
            HeaderError::Incomplete { have, need: 8 }
        });
    };
    let mut len = [0u8; 8];
    len.copy_from_slice(n);
    let n = header_len(u64::from_le_bytes(len), file_len)?;
    let Some(json) = prefix.get(8..8 + n as usize) else {
        return Err(HeaderError::Incomplete {
            have: prefix.len() as u64,
            need: 8 + n,
        });
    };
    let json = std::str::from_utf8(json).map_err(|e| HeaderError::NotTensors {
        reason: format!("not UTF-8 text ({e})"),
    })?;
    let Listed(mut tensors, metadata) =
        serde_json::from_str(json).map_err(|e| HeaderError::NotTensors {
            reason: e.to_string(),
        })?;
    let data_len = file_len - 8 - n;
    let covered = tile(&mut tensors)? as u64;
    if covered != data_len {
        return Err(HeaderError::DataSize { covered, data_len });
    }
    tensors.sort_unstable_by(|x, y| x.name.cmp(&y.name));
    if let Some(w) = tensors.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(HeaderError::Duplicate {
            tensor: w[0].name.clone(),
        });
    }
    Ok((8 + n, tensors, metadata))
}

/// A header's tensors in the order listed, read in one pass. (The `safetensors` crate's own
/// `Metadata` goes through serde's `flatten`, which buffers the whole header as generic values
/// first: 11 ms for a header of 10,000 tensors on the development machine, against 2-3 ms for
/// this.) Its checks are the crate's (property-tested against it below):
/// `__metadata__` a map of strings, each tensor a dtype, a shape and two offsets. The second
/// field is the `__metadata__`, where present.
pub(crate) struct Listed(Vec<HeaderEntry>, Option<BTreeMap<String, String>>);

impl<'de> serde::Deserialize<'de> for Listed {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Tensors;
        impl<'de> serde::de::Visitor<'de> for Tensors {
            type Value = Listed;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object of tensors")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Listed, A::Error> {
                let mut tensors = Vec::with_capacity(map.size_hint().unwrap_or(0).min(1 << 16));
                let mut metadata = false;
                let mut listed_metadata = None;
                while let Some(name) = map.next_key::<String>()? {
                    if name == "__metadata__" {
                        if metadata {
                            return Err(serde::de::Error::duplicate_field("__metadata__"));
                        }
                        metadata = true;
                        listed_metadata = map.next_value::<Option<BTreeMap<String, String>>>()?;
                    } else {
                        let info = map.next_value::<safetensors::tensor::TensorInfo>()?;
                        let (a, b) = info.data_offsets;
                        tensors.push(HeaderEntry {
                            name,
                            dtype: info.dtype,
                            shape: info.shape,
                            range: a..b,
                        });
                    }
                }
                Ok(Listed(tensors, listed_metadata))
            }
        }
        d.deserialize_map(Tensors)
    }
}

/// Checks that `tensors`, put in the order of their offsets, tile a data section from byte 0
/// with no gap or overlap, each spanning exactly its dtype and shape's bytes (the crate's
/// `Metadata::validate`); the bytes they cover.
pub(crate) fn tile(tensors: &mut [HeaderEntry]) -> std::result::Result<usize, HeaderError> {
    tensors.sort_by_key(|t| (t.range.start, t.range.end));
    let mut end = 0usize;
    for HeaderEntry {
        name,
        dtype,
        shape,
        range,
    } in tensors.iter()
    {
        let bad = |reason: String| HeaderError::BadTensor {
            tensor: name.clone(),
            reason,
        };
        if range.start != end || range.end < range.start {
            return Err(bad(format!(
                "its bytes {}..{} do not start where the tensor before it ends ({end}): the \
                 tensors must tile the data section",
                range.start, range.end
            )));
        }
        end = range.end;
        let bits = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.bitsize()))
            .ok_or_else(|| bad(format!("its shape {shape:?} is too large")))?;
        if bits % 8 != 0 {
            return Err(bad(format!(
                "its {shape:?} elements of {dtype:?} do not fill whole bytes"
            )));
        }
        if range.end - range.start != bits / 8 {
            return Err(bad(format!(
                "of {dtype:?} {shape:?} it holds {} bytes but its offsets span {}",
                bits / 8,
                range.end - range.start
            )));
        }
    }
    Ok(end)
}
