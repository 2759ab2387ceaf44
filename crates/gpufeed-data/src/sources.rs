//! The data set formats training data is stored in, parsed from untrusted bytes (never a panic,
//! a sentence naming the offset): `.npy` headers (one sample per row of the leading dimension)
//! and WebDataset tar shards (samples grouped by key, indexed from the tar headers once), and
//! the sets of shard files a data set is split into (a directory, a glob or a list).

use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use safetensors::Dtype;

/// What an `.npy` file holds: its element type, shape and where the data starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyLayout {
    /// The numpy type string, e.g. `<f4`, `|u1`.
    pub descr: String,
    /// Bytes per element.
    pub item_bytes: usize,
    /// The array's shape; a record is one row of the leading dimension.
    pub shape: Vec<usize>,
    /// Where the data starts (after the header).
    pub data_start: usize,
}

impl NpyLayout {
    /// Rows (records).
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Bytes of one row (a 0-d or 1-d array: one element per row); `usize::MAX` where that
    /// overflows, which a layout from [`parse_npy`] never does (see
    /// [`NpyLayout::checked_row_bytes`]).
    pub fn row_bytes(&self) -> usize {
        self.checked_row_bytes().unwrap_or(usize::MAX)
    }

    /// Bytes of one row, `None` where the product of the dimensions after the first and the
    /// element size overflows a `usize`.
    pub fn checked_row_bytes(&self) -> Option<usize> {
        self.shape
            .iter()
            .skip(1)
            .try_fold(self.item_bytes, |n, &d| n.checked_mul(d))
    }

    /// The element type as a safetensors [`Dtype`], for a little-endian (or byte-wide) bool,
    /// integer or float type; `None` for the others (big-endian, complex, bytes, times).
    pub fn dtype(&self) -> Option<Dtype> {
        let body = self.descr.strip_prefix(['<', '|', '=']);
        let body = match body {
            Some(b) => b,
            // Big-endian: only byte-wide types read the same.
            None => self.descr.strip_prefix('>').filter(|b| b.ends_with('1'))?,
        };
        Some(match body {
            "b1" => Dtype::BOOL,
            "u1" => Dtype::U8,
            "i1" => Dtype::I8,
            "u2" => Dtype::U16,
            "i2" => Dtype::I16,
            "u4" => Dtype::U32,
            "i4" => Dtype::I32,
            "u8" => Dtype::U64,
            "i8" => Dtype::I64,
            "f2" => Dtype::F16,
            "f4" => Dtype::F32,
            "f8" => Dtype::F64,
            _ => return None,
        })
    }
}

/// What is wrong with an `.npy` array or a tar shard ([`parse_npy`], [`index_tar`]). Each
/// variant's `reason` is the sentence shown; the variant says what a caller can do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// The bytes are not this format at all (no `\x93NUMPY` magic; a first tar header whose
    /// checksum does not add up).
    #[error("{reason}")]
    NotThisFormat {
        /// What is wrong.
        reason: String,
    },
    /// The file ends before what it declares: `need` bytes, `len` there.
    #[error("{reason}")]
    Truncated {
        /// The bytes the header or member needs from the start of the file.
        need: u64,
        /// The bytes there are.
        len: u64,
        /// What is wrong.
        reason: String,
    },
    /// The bytes given to [`parse_npy`] end inside its header (the file may be whole): give it
    /// at least `need` bytes.
    #[error("{reason}")]
    Incomplete {
        /// The bytes given.
        have: u64,
        /// The bytes the header needs.
        need: u64,
        /// What is wrong.
        reason: String,
    },
    /// A valid file of a kind gpufeed does not read (Fortran order, structured or object
    /// dtypes, an unknown format version, sparse tar members, a global pax `size`).
    #[error("{reason}")]
    Unsupported {
        /// What it is and what to write instead.
        reason: String,
    },
    /// A damaged or inconsistent file (a field that does not parse, sizes that do not add up,
    /// a name used twice in a sample).
    #[error("{reason}")]
    Malformed {
        /// What is wrong.
        reason: String,
    },
}

/// A [`SourceError::Malformed`].
fn malformed(reason: impl Into<String>) -> SourceError {
    SourceError::Malformed {
        reason: reason.into(),
    }
}

/// A [`SourceError::Unsupported`].
fn unsupported(reason: impl Into<String>) -> SourceError {
    SourceError::Unsupported {
        reason: reason.into(),
    }
}

/// Parses the header of an `.npy` file of `file_len` bytes from its first bytes `head` (at
/// least the whole header): versions 1 to 3, C order, a simple type (structured and object
/// arrays are refused), and data that fits the file exactly. The header's numbers are
/// multiplied with checked arithmetic: a shape whose dimensions other than 0, times the
/// element size, overflow a `usize` is refused (as numpy refuses it), even one of no data such
/// as `(0, 2^33, 2^33)`.
pub fn parse_npy(head: &[u8], file_len: u64) -> std::result::Result<NpyLayout, SourceError> {
    if head.len() < 10 || &head[..6] != b"\x93NUMPY" {
        return Err(SourceError::NotThisFormat {
            reason: "not an .npy file: it does not start with \\x93NUMPY".into(),
        });
    }
    let (len_bytes, start) = match head[6] {
        1 => (2, 10),
        2 | 3 => (4, 12),
        v => {
            return Err(unsupported(format!(
                "npy format version {v} is not known (1 to 3 are)"
            )));
        }
    };
    if head.len() < start {
        return Err(SourceError::Incomplete {
            have: head.len() as u64,
            need: start as u64,
            reason: "the header is cut short".into(),
        });
    }
    let header_len = if len_bytes == 2 {
        u16::from_le_bytes([head[8], head[9]]) as usize
    } else {
        u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize
    };
    let need = (start + header_len) as u64;
    let Some(text) = head.get(start..start + header_len) else {
        let reason = format!(
            "the header claims {header_len} bytes but the file is shorter: it is truncated"
        );
        return Err(if file_len < need {
            SourceError::Truncated {
                need,
                len: file_len,
                reason,
            }
        } else {
            SourceError::Incomplete {
                have: head.len() as u64,
                need,
                reason: format!(
                    "the {} bytes given end inside the header of {need}",
                    head.len()
                ),
            }
        });
    };
    let text = std::str::from_utf8(text).map_err(|_| malformed("the header is not text"))?;
    let header = NpyHeader::parse(text).map_err(|why| malformed(format!("the header {why}")))?;
    let descr = header
        .descr
        .ok_or_else(|| {
            unsupported("the dtype is structured (a list of fields): only simple types are read")
        })?
        .to_owned();
    let item_bytes = item_bytes(&descr).map_err(unsupported)?;
    if header.fortran_order {
        return Err(unsupported(
            "the array is in Fortran order: its rows are not contiguous",
        ));
    }
    let shape = header.shape;
    let data_start = start + header_len;
    let layout = NpyLayout {
        descr,
        item_bytes,
        shape,
        data_start,
    };
    let (descr, shape) = (&layout.descr, &layout.shape);
    // As numpy: the product of the dimensions that are not 0 must fit, whatever their order
    // (then every partial product does, and a row and the whole are computed safely).
    let too_large = || {
        unsupported(format!(
            "shape {shape:?} of {descr} is too large for this machine"
        ))
    };
    shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(item_bytes, |n, &d| {
            n.checked_mul(d).filter(|&b| b <= isize::MAX as usize)
        })
        .ok_or_else(too_large)?;
    if layout.rows() > 0 && layout.checked_row_bytes() == Some(0) {
        // numpy has that many empty rows; records of no bytes are not read.
        return Err(unsupported(format!(
            "shape {shape:?}: its {} rows hold no bytes, nothing to read",
            layout.rows()
        )));
    }
    let bytes = layout
        .checked_row_bytes()
        .and_then(|row| row.checked_mul(layout.rows()))
        .ok_or_else(too_large)?;
    let data_len = file_len.saturating_sub(data_start as u64);
    if bytes as u64 != data_len {
        return Err(malformed(format!(
            "shape {shape:?} of {descr} needs {bytes} bytes after the header (at {data_start}) \
             but the file has {data_len}: it is truncated or not this array"
        )));
    }
    Ok(layout)
}

/// An `.npy` header's dict, read as numpy's `ast.literal_eval` reads it, for what numpy
/// writes and reads: exactly the keys `descr` (a type string), `fortran_order` (`True` or
/// `False`) and `shape` (a tuple of integers), each once, quoted with `'` or `"`, in any
/// order, a trailing comma allowed. A structured dtype (a list) is refused as unsupported by
/// the caller; anything else is an error saying what: a key given twice (numpy would take
/// the last one; a reader that took the first read other rows), another key, a malformed
/// value.
struct NpyHeader<'a> {
    /// `None` for a structured dtype (a list of fields).
    descr: Option<&'a str>,
    fortran_order: bool,
    shape: Vec<usize>,
}

impl<'a> NpyHeader<'a> {
    fn parse(text: &'a str) -> std::result::Result<Self, String> {
        let mut p = Tokens(text.trim_end_matches([' ', '\n', '\0']).trim_start());
        p.expect('{')?;
        let (mut descr, mut fortran, mut shape) = (None, None, None);
        loop {
            if p.eat('}') {
                break;
            }
            let key = p.string()?;
            p.expect(':')?;
            // Each key once: numpy would take the last of two, a reader of the first another.
            fn once<T>(
                slot: &mut Option<T>,
                value: T,
                key: &str,
            ) -> std::result::Result<(), String> {
                match slot.replace(value) {
                    Some(_) => Err(format!("gives '{key}' twice")),
                    None => Ok(()),
                }
            }
            match key {
                "descr" => {
                    let value = if p.peek() == Some('[') {
                        p.skip_list()?;
                        None
                    } else {
                        Some(p.string()?)
                    };
                    once(&mut descr, value, key)?;
                }
                "fortran_order" => once(&mut fortran, p.boolean()?, key)?,
                "shape" => once(&mut shape, p.tuple()?, key)?,
                other => return Err(format!("has a key '{other}' numpy does not write")),
            }
            if !p.eat(',') {
                p.expect('}')?;
                break;
            }
        }
        if !p.0.is_empty() {
            return Err(format!("has {:?} after its dict", p.0));
        }
        Ok(NpyHeader {
            descr: descr.ok_or("has no 'descr'")?,
            fortran_order: fortran.ok_or("has no 'fortran_order'")?,
            shape: shape.ok_or("has no 'shape'")?,
        })
    }
}

/// What is left of a header's text, read token by token (whitespace between tokens skipped).
struct Tokens<'a>(&'a str);

impl<'a> Tokens<'a> {
    fn peek(&mut self) -> Option<char> {
        self.0 = self.0.trim_start();
        self.0.chars().next()
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.0 = &self.0[c.len_utf8()..];
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: char) -> std::result::Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!(
                "is not a dict as numpy writes it: '{c}' expected at {:?}",
                self.0
            ))
        }
    }

    /// A string literal in `'` or `"`, without escapes (numpy's keys and type strings have
    /// none).
    fn string(&mut self) -> std::result::Result<&'a str, String> {
        let quote = match self.peek() {
            Some(q @ ('\'' | '"')) => q,
            _ => return Err(format!("has {:?} where a quoted string belongs", self.0)),
        };
        let body = &self.0[1..];
        let end = body
            .find(quote)
            .ok_or_else(|| "has a string that is never closed".to_owned())?;
        let s = &body[..end];
        if s.contains('\\') {
            return Err(format!("has a string with an escape, {s:?}"));
        }
        self.0 = &body[end + 1..];
        Ok(s)
    }

    /// A list (a structured dtype's fields), skipped to its closing bracket.
    fn skip_list(&mut self) -> std::result::Result<(), String> {
        let mut depth = 0usize;
        let mut quote = None;
        for (i, c) in self.0.char_indices() {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '\'' | '"') => quote = Some(c),
                (None, '[' | '(') => depth += 1,
                (None, ']' | ')') => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        self.0 = &self.0[i + 1..];
                        return Ok(());
                    }
                }
                _ => {}
            }
        }
        Err("has a list that is never closed".into())
    }

    fn boolean(&mut self) -> std::result::Result<bool, String> {
        self.peek();
        for (word, value) in [("True", true), ("False", false)] {
            if let Some(rest) = self.0.strip_prefix(word)
                && !rest.starts_with(|c: char| c.is_alphanumeric() || c == '_')
            {
                self.0 = rest;
                return Ok(value);
            }
        }
        Err(format!("has {:?} where True or False belongs", self.0))
    }

    /// A tuple of non-negative decimal integers: `()`, `(3,)`, `(3, 4)`, `(3, 4,)` (Python 2's
    /// `3L` too, as numpy reads old files).
    fn tuple(&mut self) -> std::result::Result<Vec<usize>, String> {
        self.expect('(')?;
        let mut dims = Vec::new();
        loop {
            if self.eat(')') {
                return Ok(dims);
            }
            self.peek();
            let digits = self.0.len()
                - self
                    .0
                    .trim_start_matches(|c: char| c.is_ascii_digit())
                    .len();
            if digits == 0 {
                return Err(format!(
                    "has a shape with {:?} where a dimension belongs",
                    self.0
                ));
            }
            let d: usize = self.0[..digits]
                .parse()
                .map_err(|_| format!("has a dimension {} past this machine", &self.0[..digits]))?;
            self.0 = &self.0[digits..];
            self.0 = self.0.strip_prefix('L').unwrap_or(self.0);
            dims.push(d);
            if !self.eat(',') {
                if dims.len() == 1 {
                    return Err("has a shape of one dimension without its comma: (n,) is a \
                                tuple, (n) is not"
                        .into());
                }
                self.expect(')')?;
                return Ok(dims);
            }
        }
    }
}

/// Bytes per element of a numpy type string (`<f4`, `|u1`, `>i8`, `<c16`, `|b1`, `|V16`).
fn item_bytes(descr: &str) -> std::result::Result<usize, String> {
    let body = descr.trim_start_matches(['<', '>', '|', '=']);
    let kind = body.chars().next().ok_or("an empty dtype")?;
    let bytes: usize = body[kind.len_utf8()..]
        .parse()
        .map_err(|_| format!("dtype {descr} has no size (object and string types are not read)"))?;
    // The sizes numpy has for each kind (`<f3` is no type of numpy's).
    let known = match kind {
        'b' => bytes == 1,
        'i' | 'u' => matches!(bytes, 1 | 2 | 4 | 8),
        'f' => matches!(bytes, 2 | 4 | 8 | 12 | 16),
        'c' => matches!(bytes, 8 | 16 | 24 | 32),
        'V' | 'S' => bytes > 0,
        _ => false,
    };
    if !known {
        return Err(format!(
            "dtype {descr} is not a fixed-size numeric type numpy has"
        ));
    }
    Ok(bytes)
}

/// One WebDataset sample: the tar members sharing a key, in the order stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TarSample {
    /// The key: the member path up to the first dot of its file name.
    pub key: String,
    /// Each member's extension (after that dot) and byte range in the tar file.
    pub members: Vec<(String, Range<usize>)>,
}

impl TarSample {
    /// Bytes of all the members.
    pub fn bytes(&self) -> usize {
        self.members.iter().map(|(_, r)| r.len()).sum()
    }
}

const BLOCK: usize = 512;

/// What the extended headers before a tar member (pax `x`, GNU `L`) say about it.
#[derive(Default)]
struct Extended {
    /// A pax `path` or GNU long name.
    path: Option<String>,
    /// A pax `size`: the member's size, whatever its ustar field says.
    size: Option<u64>,
    /// A pax `GNU.sparse.*` record: the member is stored sparse.
    sparse: bool,
}

/// Indexes a tar file held in `tar` (its mapping) into WebDataset samples: regular members
/// grouped by key, consecutive members of one key being one sample (as `webdataset` groups
/// them). Reads ustar, GNU long names, sizes in GNU base-256, and pax `path` and `size`
/// records (a member of 8 GiB or more, which a ustar size field cannot hold, is written with
/// one of the last two); directories, links, devices and FIFOs are skipped (no data blocks
/// are theirs, as Python's `tarfile` reads them), and so are members whose file name has no
/// dot or starts with one (`add_member`). Every size is checked against
/// the file's length before it is used. Errors name the header's offset: a bad checksum, a
/// member running past the end of the file, a pax record that cannot be read (its `size` not
/// a number), a sparse member (GNU `S`, or pax `GNU.sparse`: its stored bytes are not the
/// file's), a name used twice within a sample.
pub fn index_tar(tar: &[u8]) -> std::result::Result<Vec<TarSample>, SourceError> {
    let mut samples: Vec<TarSample> = Vec::new();
    let mut at = 0usize;
    let mut ext = Extended::default();
    loop {
        let Some(header) = at.checked_add(BLOCK).and_then(|e| tar.get(at..e)) else {
            if at == tar.len() {
                break; // no end-of-archive blocks: accepted, as GNU tar does
            }
            // Shorter than one header: not a tar file at all.
            if at == 0 {
                return Err(SourceError::NotThisFormat {
                    reason: format!(
                        "the file ends inside the header at offset 0 ({} bytes, less than one \
                         {BLOCK}-byte tar header): not a tar file",
                        tar.len()
                    ),
                });
            }
            return Err(SourceError::Truncated {
                need: (at + BLOCK) as u64,
                len: tar.len() as u64,
                reason: format!("the file ends inside the header at offset {at}: it is truncated"),
            });
        };
        if header.iter().all(|&b| b == 0) {
            break; // end of the archive
        }
        check_sum(header).map_err(|why| {
            let reason = format!("the header at offset {at}: {why}");
            // Not even the first header: not a tar file.
            if at == 0 {
                SourceError::NotThisFormat { reason }
            } else {
                malformed(reason)
            }
        })?;
        let kind = header[156];
        // Extended headers have their own size; a pax `size` is the next member's.
        let size = match (kind, ext.size) {
            (b'x' | b'g' | b'L' | b'K', _) | (_, None) => {
                octal(&header[124..136]).ok_or_else(|| {
                    malformed(format!("the header at offset {at} has an unreadable size"))
                })?
            }
            (_, Some(pax)) => pax,
        };
        let data = at + BLOCK;
        let end = usize::try_from(size)
            .ok()
            .and_then(|s| data.checked_add(s))
            .filter(|&e| e <= tar.len())
            .ok_or_else(|| SourceError::Truncated {
                need: (data as u64).saturating_add(size),
                len: tar.len() as u64,
                reason: format!(
                    "the member at offset {at} claims {size} bytes but the file ends at {}: it \
                     is truncated",
                    tar.len()
                ),
            })?;
        // `end` is within the file, so rounding it up to a block cannot overflow. Links,
        // devices, directories and FIFOs own no data blocks whatever their size field says
        // (as Python's `tarfile`, WebDataset's reader, takes them): skipping a size there
        // would hide the members after them. A V7 directory is a plain entry named `.../`.
        let v7_directory = kind == 0 && c_string(&header[..100]).ends_with('/');
        let next = if matches!(kind, b'1'..=b'6') || v7_directory {
            data
        } else {
            data + (end - data).div_ceil(BLOCK) * BLOCK
        };
        let body = &tar[data..end];
        let bad_pax = |why: String| malformed(format!("the pax header at offset {at}: {why}"));
        match kind {
            b'L' => ext.path = Some(c_string(body)),
            b'K' => {} // a long link name: for links, which are skipped
            b'x' => {
                for (key, value) in pax_records(body).map_err(bad_pax)? {
                    match key {
                        b"path" => ext.path = Some(String::from_utf8_lossy(value).into_owned()),
                        b"size" => ext.size = Some(pax_number(value).map_err(bad_pax)?),
                        k if k.starts_with(b"GNU.sparse.") => ext.sparse = true,
                        _ => {}
                    }
                }
            }
            b'g' => {
                if pax_records(body)
                    .map_err(bad_pax)?
                    .iter()
                    .any(|(k, _)| *k == b"size")
                {
                    return Err(unsupported(format!(
                        "the pax header at offset {at}: a global `size` record (every member's \
                         size) is not read"
                    )));
                }
            }
            b'0' | 0 | b'7' | b'S' if !v7_directory => {
                let name = ext.path.take().unwrap_or_else(|| ustar_name(header));
                if kind == b'S' || ext.sparse {
                    return Err(unsupported(format!(
                        "the member at offset {at} ({name}) is stored sparse (GNU sparse): its \
                         stored bytes are not the file's; write the tar without --sparse"
                    )));
                }
                add_member(&mut samples, &name, data..end).map_err(|why| {
                    malformed(format!("the member at offset {at} ({name}): {why}"))
                })?;
                ext = Extended::default();
            }
            _ => ext = Extended::default(), // directories, links, devices: skipped
        }
        at = next;
    }
    Ok(samples)
}

/// Adds member `name` at `range` to the last sample when it has the same key, else starts one.
/// As WebDataset splits names (`^((?:.*/|)[^.]+)[.]([^/]*)$`): the key is the path up to the
/// first dot of the file name, the rest its extension; a file name with no dot, or one that
/// starts with a dot (macOS's `._x` and `.DS_Store`), is no sample's member and is skipped.
/// Two extensions of one sample that differ only in case are refused (WebDataset lowercases
/// them, and then refuses the second).
fn add_member(
    samples: &mut Vec<TarSample>,
    name: &str,
    range: Range<usize>,
) -> std::result::Result<(), String> {
    let file_start = name.rfind('/').map_or(0, |i| i + 1);
    let (key, ext) = match name[file_start..].find('.') {
        Some(dot) if dot > 0 => (&name[..file_start + dot], &name[file_start + dot + 1..]),
        _ => return Ok(()),
    };
    match samples.last_mut() {
        Some(last) if last.key == key => {
            if let Some((e, _)) = last
                .members
                .iter()
                .find(|(e, _)| e.eq_ignore_ascii_case(ext))
            {
                return Err(if e == ext {
                    format!("sample {key} has two members named .{ext}")
                } else {
                    format!("sample {key} has members .{e} and .{ext}: one extension in two cases")
                });
            }
            last.members.push((ext.to_owned(), range));
        }
        _ => samples.push(TarSample {
            key: key.to_owned(),
            members: vec![(ext.to_owned(), range)],
        }),
    }
    Ok(())
}

/// The checksum of a header: the sum of its bytes with the checksum field as spaces.
fn check_sum(header: &[u8]) -> std::result::Result<(), String> {
    let stored = octal(&header[148..156]).ok_or("an unreadable checksum: not a tar file")?;
    // The sum of the bytes as unsigned chars, and how many are 0x80 or more: old writers
    // summed signed chars (each such byte 256 less), and Python's `tarfile` takes either sum.
    let (sum, high) = header
        .iter()
        .enumerate()
        .map(|(i, &b)| if (148..156).contains(&i) { b' ' } else { b })
        .fold((0u64, 0u64), |(sum, high), b| {
            (sum + u64::from(b), high + u64::from(b >= 0x80))
        });
    let signed = sum.checked_sub(256 * high);
    if sum == stored || signed == Some(stored) {
        Ok(())
    } else {
        Err(format!(
            "checksum {stored} but the bytes sum to {sum}: not a tar file, or corrupt"
        ))
    }
}

/// A tar numeric field: octal digits (space or NUL padded), or GNU base-256 (high bit set;
/// a negative one, `0xff` first, is `None`), checked.
fn octal(field: &[u8]) -> Option<u64> {
    if field.first().is_some_and(|b| b & 0x80 != 0) {
        if field[0] & 0x40 != 0 {
            return None; // negative
        }
        let mut n: u64 = u64::from(field[0] & 0x3f);
        for &b in &field[1..] {
            n = n.checked_mul(256)?.checked_add(u64::from(b))?;
        }
        return Some(n);
    }
    let text = std::str::from_utf8(field).ok()?;
    let digits = text.trim_matches(|c: char| c == ' ' || c == '\0');
    if digits.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(digits, 8).ok()
}

/// A NUL-terminated string (lossy UTF-8).
fn c_string(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// A ustar header's name: `prefix/name` when the prefix field is used.
fn ustar_name(header: &[u8]) -> String {
    let name = c_string(&header[..100]);
    let prefix = if &header[257..262] == b"ustar" {
        c_string(&header[345..500])
    } else {
        String::new()
    };
    if prefix.is_empty() {
        name
    } else {
        format!("{prefix}/{name}")
    }
}

/// A pax record: its key and value.
type PaxRecord<'a> = (&'a [u8], &'a [u8]);

/// The records of a pax extended header (`"<len> <key>=<value>\n"`, `len` counting the
/// whole record), as (key, value); trailing NUL padding is allowed. A record that cannot be
/// read is an error: skipping it could skip a `size`.
fn pax_records(mut rest: &[u8]) -> std::result::Result<Vec<PaxRecord<'_>>, String> {
    let mut records = Vec::new();
    while rest.first().is_some_and(|&b| b != 0) {
        let bad = || "a record that is not `<length> <key>=<value>\n`".to_owned();
        let space = rest
            .iter()
            .take(20)
            .position(|&b| b == b' ')
            .ok_or_else(bad)?;
        let len: usize = std::str::from_utf8(&rest[..space])
            .ok()
            .and_then(|l| l.parse().ok())
            .ok_or_else(bad)?;
        let record = rest
            .get(space + 1..len)
            .and_then(|r| r.strip_suffix(b"\n"))
            .ok_or_else(bad)?;
        let eq = record.iter().position(|&b| b == b'=').ok_or_else(bad)?;
        records.push((&record[..eq], &record[eq + 1..]));
        rest = &rest[len..];
    }
    if rest.iter().any(|&b| b != 0) {
        return Err("bytes after its NUL padding".into());
    }
    Ok(records)
}

/// A pax numeric value (`size`): decimal digits that fit a `u64`.
fn pax_number(value: &[u8]) -> std::result::Result<u64, String> {
    std::str::from_utf8(value)
        .ok()
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            format!(
                "its size {:?} is not a number of bytes",
                String::from_utf8_lossy(value)
            )
        })
}

/// The extension, `"npy"` or `"tar"`, of a file (or object) whose name says it holds its own
/// records (an `.npy` header's rows, a tar's samples), in any case; `None` for other names,
/// whose records a size or an index must cut. A record size given for such a file is refused
/// by the loaders: it would cut the header's bytes into records.
///
/// ```
/// assert_eq!(gpufeed_data::own_layout("s3://b/train-0.TAR"), Some("tar"));
/// assert_eq!(gpufeed_data::own_layout("rows.bin"), None);
/// ```
pub fn own_layout(name: &str) -> Option<&'static str> {
    let file = name.rsplit('/').next().unwrap_or(name).to_ascii_lowercase();
    ["npy", "tar"].into_iter().find(|ext| {
        file.strip_suffix(ext)
            .is_some_and(|stem| stem.ends_with('.'))
    })
}

/// The files of a data set split into shards: `spec` a directory (its regular files, sorted
/// by name), a glob pattern (`data/train-*.tar`; its matches sorted), or one file.
///
/// # Errors
/// [`Error::Records`] naming `spec` when nothing matches, a match that cannot be read, or a
/// bad pattern.
pub fn shard_paths(spec: impl AsRef<Path>) -> Result<Vec<PathBuf>> {
    let spec = spec.as_ref();
    let bad = |reason: String| Error::Records {
        path: spec.into(),
        reason,
    };
    let text = spec.to_string_lossy();
    let mut paths: Vec<PathBuf> = if spec.is_dir() {
        std::fs::read_dir(spec)
            .map_err(|e| bad(format!("cannot list the folder: {e}")))?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| bad(format!("cannot list the folder: {e}")))?
            .into_iter()
            .filter(|p| p.is_file())
            .collect()
    } else if text.contains(['*', '?', '[']) {
        glob::glob(&text)
            .map_err(|e| bad(format!("not a usable pattern: {e}")))?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| bad(format!("a match cannot be read: {e}")))?
    } else {
        vec![spec.to_path_buf()]
    };
    paths.sort();
    if paths.is_empty() {
        return Err(bad("no shard file is there".into()));
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    use gpufeed_testkit::npy_bytes as npy;

    #[test]
    fn npy_headers_give_rows_or_say_what_is_wrong() {
        let f = npy("<f4", false, "(3, 2, 5)", &[0u8; 120]);
        let l = parse_npy(&f, f.len() as u64).expect("parse");
        assert_eq!(
            (l.rows(), l.row_bytes(), l.data_start),
            (3, 40, f.len() - 120)
        );
        assert_eq!(l.data_start % 64, 0, "numpy pads the header to 64 bytes");
        assert_eq!(l.descr, "<f4");
        assert_eq!(l.dtype(), Some(Dtype::F32));
        let f = npy("|u1", false, "(7,)", &[1u8; 7]);
        let l = parse_npy(&f, f.len() as u64).expect("parse");
        assert_eq!((l.rows(), l.row_bytes()), (7, 1));
        assert_eq!(l.dtype(), Some(Dtype::U8));
        let f = npy(">f4", false, "(2,)", &[0u8; 8]);
        let l = parse_npy(&f, f.len() as u64).expect("big-endian parses");
        assert_eq!(
            l.dtype(),
            None,
            "no little-endian type for big-endian floats"
        );
        let f = npy("<i8", false, "()", &[1u8; 8]);
        let l = parse_npy(&f, f.len() as u64).expect("a 0-d array");
        assert_eq!((l.rows(), l.row_bytes()), (1, 8));
        let unsupported = |e: &SourceError| matches!(e, SourceError::Unsupported { .. });
        let malformed = |e: &SourceError| matches!(e, SourceError::Malformed { .. });
        let not_npy = |e: &SourceError| matches!(e, SourceError::NotThisFormat { .. });
        type Kind = fn(&SourceError) -> bool;
        for (what, bytes, says, kind) in [
            (
                "fortran",
                npy("<f4", true, "(2, 2)", &[0; 16]),
                "Fortran",
                &unsupported as &dyn Fn(&SourceError) -> bool,
            ),
            (
                "truncated",
                npy("<f4", false, "(3, 2)", &[0; 20]),
                "truncated",
                &malformed,
            ),
            (
                "object",
                npy("|O", false, "(2,)", &[0; 16]),
                "object",
                &unsupported,
            ),
            (
                "not npy",
                b"PK\x03\x04 a zip file".to_vec(),
                "NUMPY",
                &not_npy,
            ),
        ] {
            let err = parse_npy(&bytes, bytes.len() as u64).expect_err(what);
            assert!(kind(&err), "{what}: {err:?}");
            assert!(err.to_string().contains(says), "{what}: {err}");
        }
        let _: Option<Kind> = None;
        let header = "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }\n";
        let mut structured = b"\x93NUMPY\x01\x00".to_vec();
        structured.extend_from_slice(&(header.len() as u16).to_le_bytes());
        structured.extend_from_slice(header.as_bytes());
        let err = parse_npy(&structured, structured.len() as u64 + 4).expect_err("structured");
        assert!(unsupported(&err), "{err:?}");
        assert!(err.to_string().contains("structured"), "{err}");
        // A head that stops inside the header of a whole file: read more; a file that stops
        // there: truncated.
        let f = npy("<f4", false, "(2,)", &[0; 8]);
        assert!(matches!(
            parse_npy(&f[..20], f.len() as u64),
            Err(SourceError::Incomplete { have: 20, .. })
        ));
        assert!(matches!(
            parse_npy(&f[..20], 20),
            Err(SourceError::Truncated { len: 20, .. })
        ));
    }

    /// An `.npy` of version 1 with header text `header` (padded as numpy pads it) and `data`.
    fn npy_raw(header: &str, data: &[u8]) -> Vec<u8> {
        let mut h = header.as_bytes().to_vec();
        while !(10 + h.len() + 1).is_multiple_of(64) {
            h.push(b' ');
        }
        h.push(b'\n');
        let mut f = b"\x93NUMPY\x01\x00".to_vec();
        f.extend_from_slice(&(h.len() as u16).to_le_bytes());
        f.extend_from_slice(&h);
        f.extend_from_slice(data);
        f
    }

    #[test]
    fn npy_headers_are_read_as_numpy_reads_them_or_refused() {
        let parse = |header: &str, data: &[u8]| {
            let f = npy_raw(header, data);
            parse_npy(&f, f.len() as u64)
        };
        // Read as numpy reads them: either quote, any key order, no trailing comma, `3L`.
        for header in [
            r#"{"descr": "<u2", "fortran_order": False, "shape": (2, 2)}"#,
            "{'shape': (2, 2), 'fortran_order': False, 'descr': '<u2'}",
            "{'descr':'<u2','fortran_order':False,'shape':(2L,2L,),}",
        ] {
            let l = parse(header, &[0; 8]).expect(header);
            assert_eq!(
                (l.descr.as_str(), l.shape.as_slice()),
                ("<u2", &[2, 2][..]),
                "{header}"
            );
        }
        // Each had been read another way than numpy's, or accepted where numpy refuses.
        for (header, data, says) in [
            (
                "{'descr': '|u1', 'fortran_order': False, 'fortran_order': True, 'shape': (2, 3), }",
                &[0u8; 6][..],
                "twice",
            ),
            (
                "{'descr': '|u1', 'fortran_order': False, 'shape': (4,), 'shape': (2, 2), }",
                &[0; 4],
                "twice",
            ),
            (
                "{'descr': '<u2', 'descr': '<i2', 'fortran_order': False, 'shape': (2,), }",
                &[0; 4],
                "twice",
            ),
            (
                r#"{'descr': [("'descr': '<u2', 'fortran_order': False, 'shape': (2,), ", 'u1')], 'fortran_order': False, 'shape': (4,), }"#,
                &[0; 4],
                "structured",
            ),
            (
                "{'descr': '|u1', 'fortran_order': False, 'shape': (,), }",
                &[0; 1],
                "dimension",
            ),
            (
                "{'descr': '|u1', 'fortran_order': False, 'shape': (2,,2), }",
                &[0; 4],
                "dimension",
            ),
            (
                "{'descr': '|u1', 'fortran_order': False, 'shape': (3), }",
                &[0; 3],
                "comma",
            ),
            (
                "{'descr': '<f3', 'fortran_order': False, 'shape': (2,), }",
                &[0; 6],
                "numpy has",
            ),
            (
                "{'descr': '|u1', 'fortran_order': False, 'shape': (2,), 'extra': 1, }",
                &[0; 2],
                "'extra'",
            ),
            (
                "{'descr': '|u1', 'fortran_order': False, 'shape': (5, 0), }",
                &[],
                "no bytes",
            ),
            (
                "{'descr': '<f8', 'fortran_order': False, 'shape': (1152921504606846976, 0), }",
                &[],
                "too large",
            ),
            (
                "{'descr': '|u1', 'fortran_order': false, 'shape': (2,), }",
                &[0; 2],
                "True or False",
            ),
            (
                "{'descr': '|u1', 'fortran_order': False, 'shape': (2,), } x",
                &[0; 2],
                "after its dict",
            ),
        ] {
            let err = parse(header, data).expect_err(header);
            assert!(err.to_string().contains(says), "{header}: {err}");
        }
    }

    /// A tar of `members` (name, bytes) written by the `tar` crate, GNU headers (long names
    /// as `L` entries).
    fn tar_of(members: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data) in members {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, name, *data).expect("append");
        }
        b.into_inner().expect("finish")
    }

    #[test]
    fn tar_members_group_into_samples_by_key() {
        let long = format!("{}/s2.jpg", "d".repeat(120));
        let tar = tar_of(&[
            ("train/s0.jpg", b"jpeg0"),
            ("train/s0.cls", b"3"),
            ("train/s0.meta.json", b"{}"),
            ("train/s1.jpg", b"jpeg-one"),
            (&long, b"x"),
        ]);
        let samples = index_tar(&tar).expect("index");
        let keys: Vec<&str> = samples.iter().map(|s| s.key.as_str()).collect();
        assert_eq!(keys, ["train/s0", "train/s1", &long[..long.len() - 4]]);
        let exts: Vec<&str> = samples[0].members.iter().map(|(e, _)| e.as_str()).collect();
        assert_eq!(exts, ["jpg", "cls", "meta.json"]);
        assert_eq!(&tar[samples[0].members[1].1.clone()], b"3");
        assert_eq!(&tar[samples[1].members[0].1.clone()], b"jpeg-one");
        assert_eq!(samples[0].bytes(), 8);
    }

    #[test]
    fn bad_tars_name_the_offset() {
        let tar = tar_of(&[("a.jpg", &[7u8; 2000]), ("b.jpg", b"b")]);
        // Cut inside the first member's data.
        let err = index_tar(&tar[..1200]).expect_err("truncated");
        assert!(
            matches!(
                err,
                SourceError::Truncated {
                    need: 2512,
                    len: 1200,
                    ..
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("offset 0") && msg.contains("truncated"),
            "{msg}"
        );
        // Cut inside the second header.
        let err = index_tar(&tar[..2560 + 100]).expect_err("truncated header");
        assert!(matches!(err, SourceError::Truncated { .. }), "{err:?}");
        assert!(err.to_string().contains("offset 2560"), "{err}");
        // A flipped byte in the second header: a damaged tar, not another format.
        let mut bad = tar.clone();
        bad[2560 + 3] ^= 1;
        let err = index_tar(&bad).expect_err("checksum");
        assert!(matches!(err, SourceError::Malformed { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("offset 2560") && msg.contains("checksum"),
            "{msg}"
        );
        let err = index_tar(&tar_of(&[("a.jpg", b"1"), ("a.jpg", b"2")])).expect_err("twice");
        assert!(matches!(err, SourceError::Malformed { .. }), "{err:?}");
        assert!(err.to_string().contains("two members"), "{err}");
        let err =
            index_tar(b"not a tar at all, just text that is long enough........").unwrap_err();
        assert!(matches!(err, SourceError::NotThisFormat { .. }), "{err:?}");
        assert!(err.to_string().contains("offset 0"), "{err}");
    }

    #[test]
    fn tar_names_split_as_webdataset_splits_them() {
        // macOS's AppleDouble and Finder files and a name without a dot belong to no sample:
        // the image keeps its label (they had split it in two).
        let tar = tar_of(&[
            ("./._k.jpg", b"MACX"),
            ("./k.jpg", b"jpeg"),
            ("./._k.cls", b"MACY"),
            ("./k.cls", b"5"),
            ("./.DS_Store", b"x"),
            ("README", b"read me"),
        ]);
        let samples = index_tar(&tar).expect("index");
        assert_eq!(samples.len(), 1, "{samples:?}");
        assert_eq!(samples[0].key, "k"); // the tar crate writes "./k.jpg" as "k.jpg"
        let exts: Vec<&str> = samples[0].members.iter().map(|(e, _)| e.as_str()).collect();
        assert_eq!(exts, ["jpg", "cls"]);
        assert_eq!(&tar[samples[0].members[1].1.clone()], b"5");
        // One extension in two cases: refused, as WebDataset refuses it once lowercased.
        let err = index_tar(&tar_of(&[("k.cls", b"1"), ("k.CLS", b"2")])).expect_err("cases");
        assert!(err.to_string().contains(".cls and .CLS"), "{err}");
    }

    #[test]
    fn entries_without_data_hide_no_member_and_old_checksums_read() {
        // A directory whose size field is not 0 owns no data (Python's tarfile): the member
        // after it is read, not skipped as its data.
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_path("d/").expect("path");
        h.set_size(512);
        h.set_mode(0o755);
        h.set_cksum();
        b.append(&h, std::io::empty()).expect("dir");
        for (name, data) in [("h.jpg", &b"h"[..]), ("a.jpg", b"a")] {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            b.append_data(&mut h, name, data).expect("append");
        }
        let tar = b.into_inner().expect("finish");
        let keys: Vec<String> = index_tar(&tar)
            .expect("index")
            .into_iter()
            .map(|s| s.key)
            .collect();
        assert_eq!(keys, ["h", "a"]);
        // A header's checksum written again, summing its bytes as unsigned or signed chars.
        let resum = |header: &mut [u8], signed: bool| {
            let sum: i64 = header[..512]
                .iter()
                .enumerate()
                .map(|(i, &x)| match (148..156).contains(&i) {
                    true => 32,
                    false if signed => i64::from(x as i8),
                    false => i64::from(x),
                })
                .sum();
            header[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        };
        // A V7 directory: a plain entry (type NUL) named with a trailing slash.
        let mut v7 = tar_of(&[("v7dir/", b""), ("b.jpg", b"b")]);
        v7[156] = 0;
        resum(&mut v7, false);
        let keys: Vec<String> = index_tar(&v7)
            .expect("v7")
            .into_iter()
            .map(|s| s.key)
            .collect();
        assert_eq!(keys, ["b"]);
        // A checksum summed over signed bytes (old writers; a byte >= 0x80 in the name).
        let mut old = tar_of(&[("\u{e9}t\u{e9}.jpg", b"e")]);
        resum(&mut old, true);
        assert_eq!(index_tar(&old).expect("signed checksum").len(), 1);
    }

    proptest::proptest! {
        /// Any bytes: samples inside the file, or a sentence; never a panic.
        #[test]
        fn arbitrary_tars_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2048)) {
            if let Ok(samples) = index_tar(&bytes) {
                for s in samples {
                    for (_, r) in s.members {
                        proptest::prop_assert!(r.end <= bytes.len());
                    }
                }
            }
        }

        /// A valid tar with one byte changed, or cut anywhere: never a panic.
        #[test]
        fn damaged_tars_never_panic(at in 0usize..3072, val in proptest::prelude::any::<u8>(), cut in 0usize..3100) {
            let mut tar = tar_of(&[("k.a", &[1u8; 600]), ("k.b", b"22"), ("j.a", b"3")]);
            if at < tar.len() {
                tar[at] = val;
            }
            tar.truncate(cut.min(tar.len()));
            let _ = index_tar(&tar);
        }

        /// Any bytes as an `.npy` file: a layout whose data fits the file, or a sentence.
        #[test]
        fn arbitrary_npy_never_panics(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            shape in "\\([0-9, ]{0,12}\\)",
        ) {
            let f = npy("<u2", false, &shape, &bytes);
            for head in [&bytes[..], &f[..]] {
                if let Ok(l) = parse_npy(head, head.len() as u64) {
                    proptest::prop_assert!(l.data_start + l.rows() * l.row_bytes() <= head.len());
                }
            }
        }
    }
}
