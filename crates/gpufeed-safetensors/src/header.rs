//! The safetensors header: its length, its JSON, the tensors' places checked to tile the data
//! section, read with `pread` on the descriptor that the load then uses.

use std::ops::Range;
use std::path::Path;

use gpufeed_os::OpenedFile;
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::index::SAVE_ID_KEY;

/// The tensors of one safetensors file, where its data section starts, and which version of
/// the file the header came from.
pub(crate) struct Parsed {
    pub(crate) data_start: u64,
    pub(crate) data_len: u64,
    pub(crate) tensors: Vec<HeaderEntry>,
    /// The save that wrote it ([`SAVE_ID_KEY`] of its `__metadata__`), where one did.
    pub(crate) save_id: Option<String>,
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
    let bad = |reason: String| Error::Safetensors {
        path: path.into(),
        reason,
    };
    let len = identity.size;
    let mut n = [0u8; 8];
    read_exact_at(file, &mut n, 0, len).map_err(bad)?;
    let header_len = header_len(u64::from_le_bytes(n), len).map_err(bad)?;
    // The length field again in front of the header, as `header_of` takes it.
    let mut prefix = vec![0u8; 8 + header_len as usize];
    prefix[..8].copy_from_slice(&n);
    read_exact_at(file, &mut prefix[8..], 8, len).map_err(bad)?;
    let (data_start, tensors, save_id) = header_parts(&prefix, len).map_err(bad)?;
    Ok(Parsed {
        data_start,
        data_len: len - data_start,
        tensors,
        save_id,
        file: opened,
    })
}

pub(crate) fn read_exact_at(
    file: &std::fs::File,
    buf: &mut [u8],
    offset: u64,
    file_len: u64,
) -> std::result::Result<(), String> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, offset).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            format!("the file ends (at {file_len} bytes) inside its header; it is truncated")
        } else {
            format!("reading the header failed: {e}")
        }
    })
}

/// Largest header the `safetensors` crate accepts.
pub(crate) const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Checks the header length `n` read from the first 8 bytes of a file of `file_len` bytes.
pub(crate) fn header_len(n: u64, file_len: u64) -> std::result::Result<u64, String> {
    if file_len < 8 {
        return Err(format!(
            "the file has {file_len} bytes, fewer than the 8 that give the header's length"
        ));
    }
    if n > MAX_HEADER_BYTES {
        return Err(format!(
            "the header claims {n} bytes, more than the {MAX_HEADER_BYTES} a safetensors header may have"
        ));
    }
    if 8 + n > file_len {
        return Err(format!(
            "the header claims {n} bytes but the file has only {} after the length field; it is truncated",
            file_len - 8
        ));
    }
    Ok(n)
}

/// One tensor of a safetensors header: name, dtype, shape, byte range in the data section.
pub type HeaderEntry = (String, Dtype, Vec<usize>, Range<usize>);

/// Validates the header of a whole safetensors file held in `bytes`; see [`header_of`].
pub fn header(bytes: &[u8]) -> std::result::Result<(u64, Vec<HeaderEntry>), String> {
    header_of(bytes, bytes.len() as u64)
}

/// Validates the header of a safetensors file of `file_len` bytes whose first bytes are in
/// `prefix` (at least the 8-byte length and the header): the JSON, dtypes, shapes against
/// sizes (the checks of the `safetensors` crate's `Metadata`, in one pass), that the tensors
/// tile the data section exactly, and that no name is used twice. Returns where the data
/// section starts and the tensors, sorted by name, or a sentence saying what is wrong. Never panics, whatever the bytes (fuzzed:
/// crates/gpufeed/fuzz; property-tested below).
pub fn header_of(
    prefix: &[u8],
    file_len: u64,
) -> std::result::Result<(u64, Vec<HeaderEntry>), String> {
    header_parts(prefix, file_len).map(|(start, tensors, _)| (start, tensors))
}

/// [`header_of`], with the save id ([`SAVE_ID_KEY`]) of the header's `__metadata__`.
pub(crate) fn header_parts(
    prefix: &[u8],
    file_len: u64,
) -> std::result::Result<(u64, Vec<HeaderEntry>, Option<String>), String> {
    let Some(n) = prefix.get(..8) else {
        return Err(format!(
            "the file has {} bytes, fewer than the 8 that give the header's length",
            prefix.len()
        ));
    };
    let n = header_len(u64::from_le_bytes(n.try_into().expect("8 bytes")), file_len)?;
    let Some(json) = prefix.get(8..8 + n as usize) else {
        return Err("the header is cut short".into());
    };
    let json =
        std::str::from_utf8(json).map_err(|e| format!("the header is not UTF-8 text ({e})"))?;
    let Listed(mut tensors, save_id) = serde_json::from_str(json)
        .map_err(|e| format!("the header does not describe valid tensors: {e}"))?;
    let data_len = file_len - 8 - n;
    let covered = tile(&mut tensors)?;
    if covered as u64 != data_len {
        return Err(format!(
            "the tensors cover {covered} bytes but the data section has {data_len}: the file is \
             truncated, extended or not a safetensors file"
        ));
    }
    tensors.sort_unstable_by(|x, y| x.0.cmp(&y.0));
    if let Some(w) = tensors.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(format!("tensor {} appears twice in the header", w[0].0));
    }
    Ok((8 + n, tensors, save_id))
}

/// A header's tensors in the order listed, read in one pass. (The `safetensors` crate's own
/// `Metadata` goes through serde's `flatten`, which buffers the whole header as generic values
/// first: 11 ms for a header of 10,000 tensors on the development machine, against 2-3 ms for
/// this.) Its checks are the crate's (property-tested against it below):
/// `__metadata__` a map of strings, each tensor a dtype, a shape and two offsets. The second
/// field is the metadata's [`SAVE_ID_KEY`], where present.
pub(crate) struct Listed(Vec<HeaderEntry>, Option<String>);

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
                let mut save_id = None;
                while let Some(name) = map.next_key::<String>()? {
                    if name == "__metadata__" {
                        if metadata {
                            return Err(serde::de::Error::duplicate_field("__metadata__"));
                        }
                        metadata = true;
                        save_id = map
                            .next_value::<Option<std::collections::HashMap<String, String>>>()?
                            .and_then(|mut m| m.remove(SAVE_ID_KEY));
                    } else {
                        let info = map.next_value::<safetensors::tensor::TensorInfo>()?;
                        let (a, b) = info.data_offsets;
                        tensors.push((name, info.dtype, info.shape, a..b));
                    }
                }
                Ok(Listed(tensors, save_id))
            }
        }
        d.deserialize_map(Tensors)
    }
}

/// Checks that `tensors`, put in the order of their offsets, tile a data section from byte 0
/// with no gap or overlap, each spanning exactly its dtype and shape's bytes (the crate's
/// `Metadata::validate`); the bytes they cover.
pub(crate) fn tile(tensors: &mut [HeaderEntry]) -> std::result::Result<usize, String> {
    tensors.sort_by_key(|t| (t.3.start, t.3.end));
    let mut end = 0usize;
    for (name, dtype, shape, range) in tensors.iter() {
        if range.start != end || range.end < range.start {
            return Err(format!(
                "tensor {name}'s bytes {}..{} do not start where the tensor before it ends \
                 ({end}): the tensors must tile the data section",
                range.start, range.end
            ));
        }
        end = range.end;
        let too_large = || format!("tensor {name}'s shape {shape:?} is too large");
        let bits = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.bitsize()))
            .ok_or_else(too_large)?;
        if bits % 8 != 0 {
            return Err(format!(
                "tensor {name}'s {shape:?} elements of {dtype:?} do not fill whole bytes"
            ));
        }
        if range.end - range.start != bits / 8 {
            return Err(format!(
                "tensor {name} of {dtype:?} {shape:?} holds {} bytes but its offsets span {}",
                bits / 8,
                range.end - range.start
            ));
        }
    }
    Ok(end)
}
