//! Records: a file of fixed or indexed records, an image folder or shards ([`Dataset`],
//! [`RecordFile`], [`ShardSet`]), and the record index format.

use std::path::{Path, PathBuf};

use gpufeed_os::{FileMap, MapMode};

use crate::error::{Error, Result};
use crate::folder::ImageFolder;
use crate::sources::{self, NpyLayout, TarSample};
use crate::stream::StreamedShards;

#[derive(Debug, Clone)]
pub(crate) enum Records {
    /// `count` records of `size` bytes from byte `base` (an `.npy` file: after its header).
    Fixed {
        base: usize,
        size: usize,
        count: usize,
        npy: Option<NpyLayout>,
    },
    Indexed(Vec<u64>),
    /// WebDataset samples: each the tar members sharing a key.
    Samples(Vec<TarSample>),
}

impl Records {
    /// Number of records.
    pub(crate) fn len(&self) -> usize {
        match self {
            Records::Fixed { count, .. } => *count,
            Records::Indexed(o) => o.len().saturating_sub(1),
            Records::Samples(s) => s.len(),
        }
    }

    /// An `.npy` file's layout.
    pub(crate) fn npy(&self) -> Option<&NpyLayout> {
        match self {
            Records::Fixed { npy, .. } => npy.as_ref(),
            _ => None,
        }
    }

    /// A tar shard's sample `i`.
    pub(crate) fn sample(&self, i: usize) -> Option<&TarSample> {
        match self {
            Records::Samples(s) => s.get(i),
            _ => None,
        }
    }
}

/// A file of records, mapped read-only: fixed-size records, variable ones delimited by an
/// offsets index (little-endian `u64`s: the start of each record, then the end of the last),
/// the rows of an `.npy` array, or the samples of a WebDataset tar shard.
#[derive(Debug)]
pub struct RecordFile {
    map: Bytes,
    path: PathBuf,
    records: Records,
}

/// A record file's bytes: a read-only mapping of the file, or (a streamed shard fetched into
/// memory) a buffer of this process's.
#[derive(Debug)]
enum Bytes {
    Map(FileMap),
    Memory(gpufeed_os::align::AlignedBuf),
    Empty,
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Map(m) => m,
            Bytes::Memory(b) => b.as_slice(),
            Bytes::Empty => &[],
        }
    }
}

impl RecordFile {
    /// Records of `record_bytes` each.
    ///
    /// # Safety
    /// 1. The file is not truncated while the `RecordFile` lives (a mapping of a shrunk file
    ///    raises SIGBUS), nor written while records are borrowed.
    ///
    /// # Errors
    /// The file's errors (missing, empty, directory), and [`Error::Records`] when its length
    /// is not a multiple of `record_bytes`.
    #[allow(
        unsafe_code,
        reason = "passes on the mapped-file promise of FileMap::open"
    )]
    pub unsafe fn open_fixed(path: impl AsRef<Path>, record_bytes: usize) -> Result<Self> {
        let path = path.as_ref();
        if record_bytes == 0 {
            return Err(Error::invalid("record_bytes is 0".into()));
        }
        // SAFETY: passed on to the caller.
        let map = unsafe { FileMap::open(path, MapMode::ReadOnly)? };
        if map.len() % record_bytes != 0 {
            return Err(Error::Records {
                path: path.into(),
                reason: format!(
                    "{} bytes are not a whole number of {record_bytes}-byte records ({} bytes left over): the file is truncated or the record size is wrong",
                    map.len(),
                    map.len() % record_bytes
                ),
            });
        }
        let count = map.len() / record_bytes;
        Ok(RecordFile {
            map: Bytes::Map(map),
            path: path.into(),
            records: Records::Fixed {
                base: 0,
                size: record_bytes,
                count,
                npy: None,
            },
        })
    }

    /// The rows of an `.npy` array as records (one per index of the leading dimension; a 0-d
    /// array is one record), its dtype and shape in [`RecordFile::npy`].
    ///
    /// # Safety
    /// As for [`RecordFile::open_fixed`].
    ///
    /// # Errors
    /// The file's errors, and [`Error::Records`] naming the file for a bad header (not `.npy`,
    /// Fortran order, a structured or object dtype, data shorter or longer than the shape).
    #[allow(
        unsafe_code,
        reason = "passes on the mapped-file promise of FileMap::open"
    )]
    pub unsafe fn open_npy(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        // SAFETY: passed on to the caller.
        let map = unsafe { FileMap::open(path, MapMode::ReadOnly)? };
        let npy = sources::parse_npy(&map, map.len() as u64).map_err(|e| Error::Records {
            path: path.into(),
            reason: e.to_string(),
        })?;
        let size = npy.row_bytes();
        let count = if size == 0 { 0 } else { npy.rows() };
        Ok(RecordFile {
            map: Bytes::Map(map),
            path: path.into(),
            records: Records::Fixed {
                base: npy.data_start,
                size,
                count,
                npy: Some(npy),
            },
        })
    }

    /// The samples of a WebDataset tar shard: the members sharing a key (the path up to the
    /// first dot of the file name) are one sample, delivered together, back to back in the
    /// order stored; [`RecordFile::sample`] says which member is where. The index is built
    /// from the tar headers once, here.
    ///
    /// # Safety
    /// As for [`RecordFile::open_fixed`].
    ///
    /// # Errors
    /// The file's errors, and [`Error::Records`] naming the file and the header's offset for a
    /// corrupt or truncated tar (a member's size, from its header or a pax `size` record, past
    /// the end of the file; a pax record that cannot be read), a sparse member, or a sample with
    /// two members of one name ([`sources::index_tar`]).
    #[allow(
        unsafe_code,
        reason = "passes on the mapped-file promise of FileMap::open"
    )]
    pub unsafe fn open_tar(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        // SAFETY: passed on to the caller.
        let map = unsafe { FileMap::open(path, MapMode::ReadOnly)? };
        let samples = sources::index_tar(&map).map_err(|e| Error::Records {
            path: path.into(),
            reason: e.to_string(),
        })?;
        Ok(RecordFile {
            map: Bytes::Map(map),
            path: path.into(),
            records: Records::Samples(samples),
        })
    }

    /// An `.npy` file's dtype and shape (`None` for other files).
    pub fn npy(&self) -> Option<&NpyLayout> {
        self.records.npy()
    }

    /// A tar shard's sample `i`: its key and members (`None` for other files).
    pub fn sample(&self, i: usize) -> Option<&TarSample> {
        self.records.sample(i)
    }

    /// The file `path`, of `bytes` bytes, whose records `records` says given its bytes (a
    /// streamed shard's: known before, or indexed now).
    ///
    /// # Safety
    /// As for [`RecordFile::open_fixed`].
    ///
    /// # Errors
    /// The file's errors, [`Error::Records`] where its length is not `bytes`, and `records`'.
    #[allow(
        unsafe_code,
        reason = "passes on the mapped-file promise of FileMap::open"
    )]
    pub(crate) unsafe fn open_with(
        path: &Path,
        bytes: u64,
        records: impl FnOnce(&[u8]) -> Result<Records>,
    ) -> Result<Self> {
        // SAFETY: passed on to the caller.
        let map = unsafe { FileMap::open(path, MapMode::ReadOnly)? };
        if map.len() as u64 != bytes {
            return Err(Error::Records {
                path: path.into(),
                reason: format!(
                    "{} bytes where the shard had {bytes}: it changed since it was opened",
                    map.len()
                ),
            });
        }
        let records = records(&map)?;
        Ok(RecordFile {
            map: Bytes::Map(map),
            path: path.into(),
            records,
        })
    }

    /// A streamed shard's `bytes`, fetched into memory (`None`: an empty shard), whose records
    /// `records` says; `name` (its URL) stands for its path in errors.
    pub(crate) fn in_memory(
        name: &str,
        records: Records,
        bytes: Option<gpufeed_os::align::AlignedBuf>,
    ) -> Self {
        RecordFile {
            map: bytes.map_or(Bytes::Empty, Bytes::Memory),
            path: name.into(),
            records,
        }
    }

    /// What its records are (an index, a layout).
    #[cfg(feature = "object")]
    pub(crate) fn records(&self) -> &Records {
        &self.records
    }

    /// Bytes mapped (the file's length).
    #[cfg(feature = "object")]
    pub(crate) fn mapped_len(&self) -> usize {
        self.map.len()
    }

    /// Variable records delimited by the offsets in `index`.
    ///
    /// The index is opened like the data (a regular file of a real file system: a FIFO or a
    /// device is refused without blocking) and read whole into memory, so its size is bounded
    /// first: at most one record per byte of data, `8 x (data bytes + 1)` bytes of offsets (an
    /// index of more records than that, which could only be empty ones, is not of this data).
    ///
    /// # Safety
    /// As for [`RecordFile::open_fixed`].
    ///
    /// # Errors
    /// The data file's errors and the index's ([`gpufeed_os::Error::NotRegularFile`] for a
    /// FIFO or device), and [`Error::Records`] naming the index when it is larger than that
    /// bound, its offsets decrease or pass the data's end, or memory for it cannot be had.
    #[allow(
        unsafe_code,
        reason = "passes on the mapped-file promise of FileMap::open"
    )]
    pub unsafe fn open_indexed(path: impl AsRef<Path>, index: impl AsRef<Path>) -> Result<Self> {
        let (path, index) = (path.as_ref(), index.as_ref());
        // SAFETY: passed on to the caller.
        let map = unsafe { FileMap::open(path, MapMode::ReadOnly)? };
        let bad = |reason: String| Error::Records {
            path: index.into(),
            reason,
        };
        let (file, identity) = gpufeed_os::file::open_regular(index, false)?;
        let offsets = read_record_index(file, identity.size, map.len() as u64).map_err(bad)?;
        Ok(RecordFile {
            map: Bytes::Map(map),
            path: path.into(),
            records: Records::Indexed(offsets),
        })
    }

    /// The mapped file's descriptor (a mapped record file only).
    pub(crate) fn mapped_file(&self) -> Option<&std::fs::File> {
        match &self.map {
            Bytes::Map(m) => Some(m.file()),
            _ => None,
        }
    }

    /// The file's mapping (its start and length), where it is mapped and not empty.
    pub(crate) fn mapped(&self) -> Option<(*const u8, usize)> {
        match &self.map {
            Bytes::Map(m) if !m.is_empty() => Some((m.as_ptr(), m.len())),
            _ => None,
        }
    }

    /// The size of its records where they are all of one (a fixed-size record file or an
    /// `.npy` array).
    pub(crate) fn fixed_size(&self) -> Option<usize> {
        match self.records {
            Records::Fixed { size, .. } => Some(size),
            _ => None,
        }
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether there are no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Record `i`, where it is one run of bytes (`None` for a tar sample of several members:
    /// see [`RecordFile::parts`]).
    pub fn record(&self, i: usize) -> Option<&[u8]> {
        let range = match &self.records {
            Records::Fixed {
                base, size, count, ..
            } => fixed_range(*base, *size, *count, i)?,
            Records::Indexed(o) => (*o.get(i)? as usize)..(*o.get(i + 1)? as usize),
            Records::Samples(s) => match s.get(i)?.members.as_slice() {
                [(_, r)] => r.clone(),
                _ => return None,
            },
        };
        self.map.get(range)
    }

    /// Where record `i`'s parts lie in the file (byte ranges, in order).
    fn ranges(&self, i: usize) -> Option<Vec<std::ops::Range<usize>>> {
        let ranges: Vec<std::ops::Range<usize>> = match &self.records {
            Records::Samples(s) => s.get(i)?.members.iter().map(|(_, r)| r.clone()).collect(),
            Records::Fixed {
                base, size, count, ..
            } => vec![fixed_range(*base, *size, *count, i)?],
            Records::Indexed(o) => {
                std::iter::once((*o.get(i)? as usize)..(*o.get(i + 1)? as usize)).collect()
            }
        };
        ranges
            .iter()
            .all(|r| r.start <= r.end && r.end <= self.map.len())
            .then_some(ranges)
    }

    /// The bytes of record `i` in order: one part, or a tar sample's members.
    pub fn parts(&self, i: usize) -> Option<Vec<&[u8]>> {
        match &self.records {
            Records::Samples(s) => s
                .get(i)?
                .members
                .iter()
                .map(|(_, r)| self.map.get(r.clone()))
                .collect(),
            _ => self.record(i).map(|r| vec![r]),
        }
    }

    /// The data file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Where fixed record `i` of `count` records of `size` bytes from byte `base` lies (checked:
/// `None` past the end or where the numbers overflow).
pub(crate) fn fixed_range(
    base: usize,
    size: usize,
    count: usize,
    i: usize,
) -> Option<std::ops::Range<usize>> {
    if i >= count {
        return None;
    }
    let start = size.checked_mul(i)?.checked_add(base)?;
    Some(start..start.checked_add(size)?)
}

/// What a [`BatchLoader`](crate::BatchLoader) reads: a record file, or a folder of one file per sample (both
/// convert with `into()`).
#[derive(Debug)]
#[non_exhaustive]
pub enum Dataset {
    /// Records of a mapped file.
    Records(RecordFile),
    /// Files in class folders.
    Folder(ImageFolder),
    /// Record files read as one data set.
    Shards(ShardSet),
    /// Shards fetched as the epoch needs them (from object storage).
    Streamed(StreamedShards),
}

impl Dataset {
    /// Samples (records or files).
    pub fn len(&self) -> usize {
        match self {
            Dataset::Records(r) => r.len(),
            Dataset::Folder(f) => f.len(),
            Dataset::Shards(s) => s.len(),
            Dataset::Streamed(s) => s.len(),
        }
    }

    /// Whether there is no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first sample of each shard, then the total ([`Order::Shards`](crate::Order::Shards)'
    /// shards): one shard but for a [`ShardSet`] or [`StreamedShards`].
    pub fn shard_starts(&self) -> Vec<usize> {
        match self {
            Dataset::Shards(s) => s.starts.clone(),
            Dataset::Streamed(s) => s.starts().to_vec(),
            Dataset::Records(_) | Dataset::Folder(_) => vec![0, self.len()],
        }
    }
}

impl From<RecordFile> for Dataset {
    fn from(r: RecordFile) -> Self {
        Dataset::Records(r)
    }
}

impl From<ImageFolder> for Dataset {
    fn from(f: ImageFolder) -> Self {
        Dataset::Folder(f)
    }
}

impl From<StreamedShards> for Dataset {
    fn from(s: StreamedShards) -> Self {
        Dataset::Streamed(s)
    }
}

impl From<ShardSet> for Dataset {
    fn from(s: ShardSet) -> Self {
        Dataset::Shards(s)
    }
}

/// Record files (shards) read as one data set: record `i` of the set is record `i - start` of
/// the shard that holds it, shards in the order given. Each shard is any [`RecordFile`]: fixed
/// or indexed records, `.npy` rows, tar samples.
///
/// # Example (host batches)
/// ```
/// use gpufeed_data::{RecordFile, ShardSet};
/// # let dir = tempfile::tempdir()?;
/// for i in 0..3 {
///     std::fs::write(dir.path().join(format!("part-{i}.bin")), vec![i as u8; 40])?;
/// }
/// let shards = gpufeed_data::shard_paths(dir.path())? // sorted: part-0, part-1, part-2
///     .iter()
///     // SAFETY: the files are not changed while they are used.
///     .map(|p| unsafe { RecordFile::open_fixed(p, 10) })
///     .collect::<gpufeed_data::Result<Vec<_>>>()?;
/// let set = ShardSet::new(shards);
/// assert_eq!(set.len(), 12);
/// assert_eq!(set.locate(5), Some((1, 1)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct ShardSet {
    shards: Vec<RecordFile>,
    /// The first record of each shard, then the total.
    starts: Vec<usize>,
}

impl ShardSet {
    /// The shards, in this order.
    pub fn new(shards: Vec<RecordFile>) -> Self {
        let mut starts = Vec::with_capacity(shards.len() + 1);
        starts.push(0);
        for s in &shards {
            starts.push(starts.last().copied().unwrap_or(0) + s.len());
        }
        ShardSet { shards, starts }
    }

    /// Records in all the shards.
    pub fn len(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    /// Whether there is no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shards.
    pub fn shards(&self) -> &[RecordFile] {
        &self.shards
    }

    /// Which shard holds record `i`, and its index there.
    pub fn locate(&self, i: usize) -> Option<(usize, usize)> {
        if i >= self.len() {
            return None;
        }
        let shard = self.starts.partition_point(|&s| s <= i) - 1;
        Some((shard, i - self.starts[shard]))
    }
}

/// Where the worker threads read records from: a record file or a set of them.
pub(crate) trait Source {
    /// The bytes of record `i` in order.
    fn parts(&self, i: usize) -> Option<Vec<&[u8]>>;
    /// Record `i` where it is one run of bytes (`None` for a tar sample of several members or
    /// a record that does not exist).
    fn record(&self, i: usize) -> Option<&[u8]>;
    /// The file holding record `i` (for errors).
    fn path_of(&self, i: usize) -> &Path;
    /// The file holding record `i` (its number among the source's files) and where the
    /// record's parts lie in it.
    fn ranges(&self, i: usize) -> Option<(usize, Vec<std::ops::Range<usize>>)>;
    /// File `f`.
    fn file(&self, f: usize) -> Option<&RecordFile>;
}

impl Source for RecordFile {
    fn parts(&self, i: usize) -> Option<Vec<&[u8]>> {
        RecordFile::parts(self, i)
    }
    fn record(&self, i: usize) -> Option<&[u8]> {
        RecordFile::record(self, i)
    }
    fn path_of(&self, _: usize) -> &Path {
        self.path()
    }
    fn ranges(&self, i: usize) -> Option<(usize, Vec<std::ops::Range<usize>>)> {
        Some((0, RecordFile::ranges(self, i)?))
    }
    fn file(&self, f: usize) -> Option<&RecordFile> {
        (f == 0).then_some(self)
    }
}

impl Source for ShardSet {
    fn parts(&self, i: usize) -> Option<Vec<&[u8]>> {
        let (s, j) = self.locate(i)?;
        self.shards[s].parts(j)
    }
    fn record(&self, i: usize) -> Option<&[u8]> {
        let (s, j) = self.locate(i)?;
        self.shards[s].record(j)
    }
    fn path_of(&self, i: usize) -> &Path {
        match self.locate(i) {
            Some((s, _)) => self.shards[s].path(),
            None => self.shards.last().map_or(Path::new(""), RecordFile::path),
        }
    }
    fn ranges(&self, i: usize) -> Option<(usize, Vec<std::ops::Range<usize>>)> {
        let (s, j) = self.locate(i)?;
        Some((s, self.shards[s].ranges(j)?))
    }
    fn file(&self, f: usize) -> Option<&RecordFile> {
        self.shards.get(f)
    }
}

/// Reads the record index `file` of `size` bytes (its `fstat` size) for data of `data_len`
/// bytes: checks its size ([`check_index_size`]) before reading, reads exactly `size` bytes
/// into offsets (memory reserved fallibly) and checks them ([`check_record_index`]).
pub(crate) fn read_record_index(
    mut file: std::fs::File,
    size: u64,
    data_len: u64,
) -> std::result::Result<Vec<u64>, String> {
    use std::io::Read;
    let count = check_index_size(size, data_len)?;
    let mut offsets: Vec<u64> = Vec::new();
    offsets
        .try_reserve_exact(count)
        .map_err(|_| format!("{size} bytes of offsets do not fit in memory"))?;
    let mut chunk = vec![0u8; 64 << 10];
    let mut left = size;
    while left > 0 {
        // `left` is below the chunk's length here, so it fits a usize.
        let n = chunk.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        file.read_exact(&mut chunk[..n]).map_err(|e| {
            format!(
                "cannot read the index ({} of {size} bytes read): {e}",
                size - left
            )
        })?;
        offsets.extend(
            chunk[..n]
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))),
        );
        left -= n as u64;
    }
    check_record_index(offsets, data_len)
}

/// The number of offsets in an index of `size` bytes for data of `data_len` bytes, or why
/// it cannot be one: a whole number of little-endian `u64`s, at least two, and at most one
/// record per byte of data (`data_len + 1` offsets), checked before anything is read.
pub(crate) fn check_index_size(size: u64, data_len: u64) -> std::result::Result<usize, String> {
    if !size.is_multiple_of(8) || size < 16 {
        return Err(format!(
            "{size} bytes: an index is at least two little-endian u64 offsets"
        ));
    }
    let count = size / 8;
    let most = data_len.saturating_add(1);
    if count > most {
        return Err(format!(
            "{size} bytes hold {} records, more records than the {data_len} bytes of data \
             can hold (one per byte at most): not an index of this data file",
            count - 1
        ));
    }
    usize::try_from(count).map_err(|_| format!("{count} offsets do not fit in memory"))
}

/// Parses a record index (little-endian u64 offsets, at least two, not decreasing, the last
/// within `data_len`, at most one record per byte of data): a file another program wrote, so
/// untrusted. Property-tested below (`open_indexed` reads the file in chunks instead).
#[cfg(test)]
pub(crate) fn parse_record_index(
    raw: &[u8],
    data_len: u64,
) -> std::result::Result<Vec<u64>, String> {
    check_index_size(raw.len() as u64, data_len)?;
    let offsets: Vec<u64> = raw
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    check_record_index(offsets, data_len)
}

/// Checks a record index's offsets (at least two, not decreasing, the last within
/// `data_len`).
pub(crate) fn check_record_index(
    offsets: Vec<u64>,
    data_len: u64,
) -> std::result::Result<Vec<u64>, String> {
    if offsets.len() < 2 {
        return Err("an index is at least two offsets".into());
    }
    if let Some(w) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(format!("offsets decrease at record {w}"));
    }
    let end = *offsets.last().expect("two or more");
    if end > data_len {
        return Err(format!(
            "records end at {end}, past the data file's {data_len} bytes"
        ));
    }
    Ok(offsets)
}
