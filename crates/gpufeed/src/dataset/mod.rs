//! The hybrid data loader of the source material: a record file mapped read-only (or an
//! [`ImageFolder`]: one file per sample in class folders), a sampler (sequential, shuffled by
//! seed, sharded by rank; or elastic, whose [`Position`] resumes a run mid-epoch with another
//! world size; or in shuffled blocks of neighbouring records, [`Order::Blocks`]), and a
//! [`BatchLoader`] whose worker threads gather records (out of the mapping, or with
//! `O_DIRECT`: [`LoaderConfig::direct`]) into pinned (or, without a GPU, locked) buffers and
//! issue their uploads, several batches in flight, and which yields the batches in a fixed
//! order once each is on the GPU. Records come from a file of fixed or indexed
//! records, an `.npy` array, a WebDataset tar shard ([`sources`]), or a [`ShardSet`] of them.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpufeed_cuda::{Gpu, TransferConfig, TransferScheduler};
use gpufeed_os::{FileMap, MapMode};
use gpufeed_pinned::{PinnedPool, PoolConfig, PoolMode, PooledBuffer};
use gpufeed_uring::{Direct, Reader};
use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::load::DeviceBuffer;

mod folder;
pub mod ring;
pub mod sources;

pub use folder::ImageFolder;
pub use sources::{NpyLayout, TarSample, shard_paths};

#[derive(Debug)]
enum Records {
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

/// A file of records, mapped read-only: fixed-size records, variable ones delimited by an
/// offsets index (little-endian `u64`s: the start of each record, then the end of the last),
/// the rows of an `.npy` array, or the samples of a WebDataset tar shard.
#[derive(Debug)]
pub struct RecordFile {
    map: FileMap,
    path: PathBuf,
    records: Records,
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
            return Err(Error::InvalidSetting("record_bytes is 0".into()));
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
            map,
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
        let npy = sources::parse_npy(&map, map.len() as u64).map_err(|reason| Error::Records {
            path: path.into(),
            reason,
        })?;
        let size = npy.row_bytes();
        let count = if size == 0 { 0 } else { npy.rows() };
        Ok(RecordFile {
            map,
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
        let samples = sources::index_tar(&map).map_err(|reason| Error::Records {
            path: path.into(),
            reason,
        })?;
        Ok(RecordFile {
            map,
            path: path.into(),
            records: Records::Samples(samples),
        })
    }

    /// An `.npy` file's dtype and shape (`None` for other files).
    pub fn npy(&self) -> Option<&NpyLayout> {
        match &self.records {
            Records::Fixed { npy, .. } => npy.as_ref(),
            _ => None,
        }
    }

    /// A tar shard's sample `i`: its key and members (`None` for other files).
    pub fn sample(&self, i: usize) -> Option<&TarSample> {
        match &self.records {
            Records::Samples(s) => s.get(i),
            _ => None,
        }
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
            map,
            path: path.into(),
            records: Records::Indexed(offsets),
        })
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        match &self.records {
            Records::Fixed { count, .. } => *count,
            Records::Indexed(o) => o.len() - 1,
            Records::Samples(s) => s.len(),
        }
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
fn fixed_range(base: usize, size: usize, count: usize, i: usize) -> Option<std::ops::Range<usize>> {
    if i >= count {
        return None;
    }
    let start = size.checked_mul(i)?.checked_add(base)?;
    Some(start..start.checked_add(size)?)
}

/// What a [`BatchLoader`] reads: a record file, or a folder of one file per sample (both
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
}

impl Dataset {
    /// Samples (records or files).
    pub fn len(&self) -> usize {
        match self {
            Dataset::Records(r) => r.len(),
            Dataset::Folder(f) => f.len(),
            Dataset::Shards(s) => s.len(),
        }
    }

    /// Whether there is no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
/// use gpufeed::dataset::{RecordFile, ShardSet};
/// # let dir = tempfile::tempdir()?;
/// for i in 0..3 {
///     std::fs::write(dir.path().join(format!("part-{i}.bin")), vec![i as u8; 40])?;
/// }
/// let shards = gpufeed::dataset::shard_paths(dir.path())? // sorted: part-0, part-1, part-2
///     .iter()
///     // SAFETY: the files are not changed while they are used.
///     .map(|p| unsafe { RecordFile::open_fixed(p, 10) })
///     .collect::<gpufeed::Result<Vec<_>>>()?;
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
trait Source {
    /// The bytes of record `i` in order.
    fn parts(&self, i: usize) -> Option<Vec<&[u8]>>;
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

/// The order records are visited in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
#[non_exhaustive]
pub enum Order {
    /// 0, 1, 2, ...
    Sequential,
    /// A permutation drawn from `seed` and the epoch: the same seed gives the same order.
    Shuffled {
        /// The seed.
        seed: u64,
    },
    /// A quasi-random order for data read from the disk ([`LoaderConfig::direct`]), as FFCV's
    /// `QUASI_RANDOM`: the records are cut into blocks of `block` consecutive records; the
    /// epoch visits the blocks in a permutation drawn from `seed` and the epoch, and each
    /// block's records in a permutation of their own (a last, shorter block, where `block`
    /// does not divide the number of records, comes last). So a block's records
    /// are always next to each other in the order: with an elastic sampler whose per-rank
    /// batch is a multiple of `block` they always land in the same batch, which reads each
    /// block as one run of the file. Its randomness, stated: the order of the blocks and the
    /// order within each block are uniform; which records share a batch is not (a batch holds
    /// `batch / block` whole blocks, never a record of one block without the others). Like
    /// the others it depends only on the seed, the epoch and the number of records. A `block`
    /// of 0 counts as 1 (then it is a plain shuffle).
    Blocks {
        /// The seed.
        seed: u64,
        /// Records per block.
        block: usize,
    },
}

/// Chooses the records of each epoch for this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampler {
    order: Order,
    rank: usize,
    world_size: usize,
    drop_last: bool,
    /// Records per global batch, for an elastic sampler ([`Sampler::elastic`]).
    global_batch: Option<usize>,
}

impl Sampler {
    /// All records, in `order`, on one rank.
    pub fn new(order: Order) -> Self {
        Sampler {
            order,
            rank: 0,
            world_size: 1,
            drop_last: false,
            global_batch: None,
        }
    }

    /// This rank's share of `world_size` ranks. Without `drop_last` every rank gets the same
    /// number of records, the last ones wrapping around to the start (as PyTorch's
    /// `DistributedSampler` does); with it the remainder is dropped.
    pub fn shard(mut self, rank: usize, world_size: usize, drop_last: bool) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidSetting(format!(
                "rank {rank} of world size {world_size}"
            )));
        }
        self.rank = rank;
        self.world_size = world_size;
        self.drop_last = drop_last;
        Ok(self)
    }

    /// Sharded by `RANK` and `WORLD_SIZE` as torchrun sets them (one rank when unset).
    pub fn from_env(order: Order) -> Result<Self> {
        let (rank, world) = rank_from_env()?;
        Self::new(order).shard(rank, world, false)
    }

    /// An order that survives the cluster changing size (elastic training): the epoch's global
    /// order depends only on `order`, the epoch and the number of records; each step takes the
    /// next `global_batch` records of it and cuts them into `world_size` contiguous per-rank
    /// batches of `global_batch / world_size`, so the records of step k are the same for every
    /// world size that divides `global_batch`. The loader's batch size is then that per-rank
    /// size. The last, partial global batch is dropped with `drop_last`; otherwise it is split
    /// evenly, ranks short of records taking them again from the start of the order (as
    /// PyTorch's `DistributedSampler` pads). Its position ([`Position`]) resumes a run with
    /// the same or another world size ([`BatchLoader::resume`]).
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] when `rank >= world_size` or `world_size` does not divide
    /// `global_batch`.
    pub fn elastic(
        order: Order,
        global_batch: usize,
        rank: usize,
        world_size: usize,
        drop_last: bool,
    ) -> Result<Self> {
        if global_batch == 0 || world_size == 0 || !global_batch.is_multiple_of(world_size) {
            return Err(Error::InvalidSetting(format!(
                "a global batch of {global_batch} records cannot be split between {world_size} \
                 ranks: use a world size that divides it"
            )));
        }
        let mut s = Self::new(order).shard(rank, world_size, drop_last)?;
        s.global_batch = Some(global_batch);
        Ok(s)
    }

    /// [`Sampler::elastic`] with this process's `RANK` and `WORLD_SIZE` (one rank when unset).
    pub fn elastic_from_env(order: Order, global_batch: usize, drop_last: bool) -> Result<Self> {
        let (rank, world) = rank_from_env()?;
        Self::elastic(order, global_batch, rank, world, drop_last)
    }

    /// Records per rank per step, for an elastic sampler.
    pub fn rank_batch(&self) -> Option<usize> {
        self.global_batch.map(|g| g / self.world_size)
    }

    /// Where a run over `records` records stands after `steps` steps of `epoch` begun at sample
    /// `start` (an elastic sampler's [`Position`]; `None` for others): after the epoch's last
    /// step, the start of the next epoch. What [`Epoch::position`] says; for a caller that
    /// counts the batches it consumed itself (one fed by a thread that runs ahead).
    pub fn position_after(
        &self,
        records: usize,
        epoch: u64,
        start: u64,
        steps: usize,
    ) -> Option<Position> {
        let global = self.global_batch?;
        let left = records.saturating_sub(start as usize);
        let total = if self.drop_last {
            left / global
        } else {
            left.div_ceil(global)
        };
        let (epoch, samples) = if steps >= total {
            // A position read back from a checkpoint may say any epoch: no overflow.
            (epoch.saturating_add(1), 0)
        } else {
            (epoch, start + (steps * global) as u64)
        };
        Some(Position {
            epoch,
            samples,
            records: records as u64,
            order: self.order,
            global_batch: global,
        })
    }

    /// The batch size and `drop_last` a loader uses with this sampler: an elastic sampler's
    /// own, else `cfg`'s.
    pub(crate) fn batching(&self, cfg: &LoaderConfig) -> (usize, bool) {
        match self.rank_batch() {
            Some(b) => (b, self.drop_last),
            None => (cfg.batch_size, cfg.drop_last),
        }
    }

    /// The record indices of `epoch` for this rank, out of `n` records.
    pub fn epoch(&self, n: usize, epoch: u64) -> Vec<usize> {
        self.epoch_from(n, epoch, 0)
    }

    /// The record indices of `epoch` for this rank from sample `start` of the epoch's global
    /// order on (an elastic sampler's resume point: a multiple of the global batch; other
    /// samplers always start at 0).
    pub fn epoch_from(&self, n: usize, epoch: u64, start: u64) -> Vec<usize> {
        let all = permutation(n, self.order, epoch);
        if let Some(g) = self.global_batch {
            return self.elastic_share(&all, g, start as usize);
        }
        if self.world_size == 1 || n == 0 {
            return all;
        }
        let total = if self.drop_last {
            n / self.world_size * self.world_size
        } else {
            n.div_ceil(self.world_size) * self.world_size
        };
        (0..total)
            .skip(self.rank)
            .step_by(self.world_size)
            .map(|i| all[i % n])
            .collect()
    }

    /// This rank's records of the global `order` from `start`, step by step.
    fn elastic_share(&self, order: &[usize], global: usize, start: usize) -> Vec<usize> {
        let (n, w, r) = (order.len(), self.world_size, self.rank);
        let b = global / w;
        let mut out = Vec::with_capacity(n.saturating_sub(start) / w + b);
        let mut s = start;
        while s < n {
            let m = global.min(n - s);
            if m == global {
                out.extend_from_slice(&order[s + r * b..s + (r + 1) * b]);
            } else if self.drop_last {
                break;
            } else {
                let per = m.div_ceil(w);
                out.extend((0..per).map(|j| {
                    let k = r * per + j;
                    if k < m {
                        order[s + k]
                    } else {
                        order[(k - m) % n]
                    }
                }));
            }
            s += global;
        }
        out
    }
}

/// `RANK` and `WORLD_SIZE` as torchrun sets them; `(0, 1)` when neither is set.
fn rank_from_env() -> Result<(usize, usize)> {
    let var = |name: &str| -> Result<Option<usize>> {
        match std::env::var(name) {
            Err(_) => Ok(None),
            Ok(v) => v
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| Error::InvalidSetting(format!("{name}={v:?} is not a number"))),
        }
    };
    match (var("RANK")?, var("WORLD_SIZE")?) {
        (Some(rank), Some(world)) => Ok((rank, world)),
        (None, None) => Ok((0, 1)),
        _ => Err(Error::InvalidSetting(
            "RANK and WORLD_SIZE must be set together".into(),
        )),
    }
}

/// The records `0..n` in `order` for `epoch` (seeded Fisher-Yates shuffles).
fn permutation(n: usize, order: Order, epoch: u64) -> Vec<usize> {
    match order {
        Order::Sequential => (0..n).collect(),
        Order::Shuffled { seed } => {
            let mut all: Vec<usize> = (0..n).collect();
            shuffle(&mut all, seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            all
        }
        Order::Blocks { seed, block } => {
            let block = block.max(1);
            // The whole blocks shuffled, a last shorter one after them (so that every whole
            // block starts at a multiple of `block` in the order).
            let mut blocks: Vec<usize> = (0..n / block).collect();
            let state = seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            shuffle(&mut blocks, state);
            if !n.is_multiple_of(block) {
                blocks.push(n / block);
            }
            let mut all = Vec::with_capacity(n);
            for b in blocks {
                let first = all.len();
                all.extend(b * block..((b + 1) * block).min(n));
                // Each block's own stream, from the epoch's and the block's number.
                shuffle(
                    &mut all[first..],
                    state ^ (b as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03),
                );
            }
            all
        }
    }
}

/// A seeded Fisher-Yates shuffle of `items` (splitmix64 steps from `state`).
fn shuffle(items: &mut [usize], mut state: u64) {
    for i in (1..items.len()).rev() {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        items.swap(i, ((z ^ (z >> 31)) % (i as u64 + 1)) as usize);
    }
}

/// Where an elastic loader is: the epoch and how many samples of its global order all ranks
/// together have consumed. Small and serializable (serde; JSON for a checkpoint beside the
/// model's): a loader resumed from it ([`BatchLoader::resume`]), with the same or another
/// world size that divides the global batch, yields exactly the rest of the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Position {
    /// The epoch.
    pub epoch: u64,
    /// Samples of the epoch's global order consumed (a multiple of `global_batch`).
    pub samples: u64,
    /// Records in the data set (a resume on another data set is refused).
    pub records: u64,
    /// The order (a resume with another seed is refused).
    pub order: Order,
    /// Records per global batch.
    pub global_batch: usize,
}

/// A per-record transform run on the worker threads: gets the record's index and bytes and
/// appends its output to the vector.
pub type Transform =
    Arc<dyn Fn(usize, &[u8], &mut Vec<u8>) -> std::result::Result<(), String> + Send + Sync>;

/// A per-record transform of a fixed output size run on the worker threads
/// ([`BatchLoader::with_transform_into`]): gets the record's index and bytes and fills `out`,
/// the record's place in the batch's pooled (pinned) buffer, so its output is written once.
pub type TransformInto =
    Arc<dyn Fn(usize, &[u8], &mut [u8]) -> std::result::Result<(), String> + Send + Sync>;

/// The loader's transform, of either kind.
#[derive(Clone)]
enum Transformer {
    /// Appends to a vector, copied into the batch's buffer after ([`BatchLoader::with_transform`]).
    Append(Transform),
    /// Writes `bytes` per record straight into the batch's buffer
    /// ([`BatchLoader::with_transform_into`]).
    Into { bytes: usize, f: TransformInto },
}

/// A worker's buffers, kept from batch to batch: a transform's output (before it is copied
/// into the batch), a tar sample's members joined for a transform, and an image folder's files
/// read for a transform (which writes the batch's buffer).
#[derive(Default)]
struct Scratch {
    out: Vec<u8>,
    joined: Vec<u8>,
    files: Vec<u8>,
}

/// Settings of a [`BatchLoader`]: start from the default and change what you need (new
/// settings may be added).
///
/// ```
/// let cfg = gpufeed::dataset::LoaderConfig::default().with_batch_size(256).with_workers(8);
/// assert_eq!((cfg.batch_size, cfg.workers, cfg.prefetch), (256, 8, 2));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LoaderConfig {
    /// Records per batch.
    pub batch_size: usize,
    /// Drop a last batch smaller than `batch_size`.
    pub drop_last: bool,
    /// Batches prepared ahead of the one being consumed (default 2: double buffering). Each
    /// is gathered (and, with a GPU, uploaded) by one worker: below `workers`, some workers
    /// wait; the bench's rows use two per worker.
    pub prefetch: usize,
    /// Worker threads gathering records (default 2).
    pub workers: usize,
    /// Longest wait for one batch before [`Error::BatchTimeout`] ends the epoch (default 60 s).
    pub batch_timeout: Duration,
    /// Read the records with `O_DIRECT` instead of copying them out of the file's mapping
    /// (default off): for record files and shard sets larger than the page cache, which would
    /// otherwise be read a page fault at a time and push everything else out of the cache.
    /// Each worker reads its batch's records in runs: records next to each other in the file
    /// are read together (an order that keeps them together, [`Order::Blocks`], makes each
    /// block one read), up to [`LoaderConfig::direct_depth`] of them in flight. Not for an
    /// [`ImageFolder`] (whose files are read whole already). A file system that refuses
    /// `O_DIRECT` is an error when the loader is made.
    pub direct: bool,
    /// With `direct`: reads each worker keeps in flight (default 4; at least 1). The disk sees
    /// `workers * direct_depth` reads at once: local NVMe drives want deep queues, while
    /// network and cloud volumes often read fastest at a few (bench table 7 measures it).
    pub direct_depth: usize,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            batch_size: 32,
            drop_last: false,
            prefetch: 2,
            workers: 2,
            batch_timeout: Duration::from_secs(60),
            direct: false,
            direct_depth: 4,
        }
    }
}

impl LoaderConfig {
    /// These settings with `direct` (read records with `O_DIRECT`).
    pub fn with_direct(mut self, direct: bool) -> Self {
        self.direct = direct;
        self
    }

    /// These settings with `direct_depth` (`O_DIRECT` reads in flight per worker; at least 1).
    pub fn with_direct_depth(mut self, depth: usize) -> Self {
        self.direct_depth = depth.max(1);
        self
    }

    /// These settings with `batch_size` (records per batch).
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// These settings with `drop_last` (drop a last, smaller batch).
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// These settings with `prefetch` (batches prepared ahead).
    pub fn with_prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// These settings with `workers` (worker threads).
    pub fn with_workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// These settings with `batch_timeout` (longest wait for one batch).
    pub fn with_batch_timeout(mut self, batch_timeout: Duration) -> Self {
        self.batch_timeout = batch_timeout;
        self
    }
}

/// Where a batch's bytes are: on the GPU, or on the host without one (exhaustive: match both).
#[derive(Debug)]
pub enum BatchData {
    /// In GPU memory.
    Device(DeviceBuffer),
    /// In a pooled host buffer (no GPU): pinned, or locked in CPU mode.
    Host(PooledBuffer),
}

/// One batch: the records' bytes back to back, with their indices and offsets.
#[derive(Debug)]
pub struct Batch {
    /// The epoch.
    pub epoch: u64,
    /// The batch's number in its epoch.
    pub number: usize,
    /// The record indices, in order.
    pub indices: Vec<usize>,
    /// Start of each record's bytes in the batch, then the end of the last.
    pub offsets: Vec<usize>,
    /// Each sample's label, for an [`ImageFolder`] (its class); empty for record files.
    /// Host memory: a few bytes per sample, copied where the caller needs them.
    pub labels: Vec<u32>,
    /// The bytes.
    pub data: BatchData,
}

impl Batch {
    /// Bytes in the batch.
    pub fn bytes(&self) -> usize {
        *self.offsets.last().unwrap_or(&0)
    }
}

/// Counters of a [`BatchLoader`].
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LoaderStats {
    /// Batches yielded.
    pub batches: u64,
    /// Bytes yielded.
    pub bytes: u64,
    /// Seconds the workers spent issuing uploads, summed (a worker does not wait for its copy:
    /// it gathers the next batch while the copy runs).
    pub upload_s: f64,
    /// Seconds the consumer waited for workers and for batches' copies to end.
    pub waited_s: f64,
    /// With [`LoaderConfig::direct`]: `O_DIRECT` reads issued (one per run of records next to
    /// each other in a file, per batch) and the bytes they read (from the 4 KiB page holding
    /// each run's first byte; against `bytes`, what alignment and records read twice cost).
    pub direct_reads: u64,
    /// See `direct_reads`.
    pub direct_read_bytes: u64,
}

/// Yields batches of a [`RecordFile`] or an [`ImageFolder`] in the [`Sampler`]'s order, on the GPU (or, without one,
/// in host memory), with workers preparing the next batches while the current ones upload.
///
/// # Example (runs without a GPU: host batches)
/// ```
/// use gpufeed::dataset::{BatchData, BatchLoader, LoaderConfig, Order, RecordFile, Sampler};
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("records.bin");
/// std::fs::write(&path, (0..100u8).collect::<Vec<_>>())?;
/// // SAFETY: the file is not changed while it is used.
/// let records = unsafe { RecordFile::open_fixed(&path, 10)? }; // 10 records of 10 bytes
/// let sampler = Sampler::new(Order::Shuffled { seed: 7 });
/// let cfg = LoaderConfig::default().with_batch_size(4);
/// let mut loader = BatchLoader::new(records, sampler, cfg, None)?;
/// let sizes: Vec<usize> = loader.epoch(0)?.map(|b| b.map(|b| b.indices.len())).collect::<Result<_, _>>()?;
/// assert_eq!(sizes, [4, 4, 2]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct BatchLoader {
    records: Arc<Dataset>,
    sampler: Sampler,
    cfg: LoaderConfig,
    transform: Option<Transformer>,
    pool: PinnedPool,
    /// The GPU and the scheduler the workers upload their batches through.
    gpu: Option<(Gpu, Arc<TransferScheduler>)>,
    stats: LoaderStats,
    /// The workers' `O_DIRECT` reads ([`LoaderConfig::direct`]).
    direct: Arc<DirectCounters>,
}

impl std::fmt::Debug for BatchLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchLoader")
            .field("records", &self.records.len())
            .field("cfg", &self.cfg)
            .field("gpu", &self.gpu.is_some())
            .finish()
    }
}

impl BatchLoader {
    /// A loader of `records` (a [`RecordFile`] or an [`ImageFolder`]) onto `gpu` (or host
    /// batches with `None`).
    ///
    /// With an elastic sampler ([`Sampler::elastic`]) the batch size is the sampler's per-rank
    /// batch and `drop_last` the sampler's (`cfg`'s are replaced).
    pub fn new(
        records: impl Into<Dataset>,
        sampler: Sampler,
        mut cfg: LoaderConfig,
        gpu: Option<&Gpu>,
    ) -> Result<Self> {
        (cfg.batch_size, cfg.drop_last) = sampler.batching(&cfg);
        if cfg.batch_size == 0 || cfg.workers == 0 || cfg.prefetch == 0 {
            return Err(Error::InvalidSetting(
                "batch_size, workers and prefetch must be at least 1".into(),
            ));
        }
        let records = records.into();
        if cfg.direct {
            check_direct(&records)?;
        }
        let node = gpu.and_then(|g| g.info().numa_node);
        let pool_cfg = PoolConfig::default()
            .with_budget_bytes(None)
            .with_numa_node(node);
        let (pool, gpu) = match gpu {
            Some(g) => {
                let sched = TransferScheduler::new(g, TransferConfig::default())?;
                (
                    PinnedPool::new(PoolMode::Cuda(g.context().clone()), pool_cfg)?,
                    Some((g.clone(), Arc::new(sched))),
                )
            }
            None => (PinnedPool::new(PoolMode::Cpu, pool_cfg)?, None),
        };
        Ok(BatchLoader {
            records: Arc::new(records),
            sampler,
            cfg,
            transform: None,
            pool,
            gpu,
            stats: LoaderStats::default(),
            direct: Arc::new(DirectCounters::default()),
        })
    }

    /// Applies `f` to every record on the worker threads: it appends the record's output to
    /// the vector, which is then copied into the batch's pooled buffer (a transform of a fixed
    /// output size writes that buffer itself: [`BatchLoader::with_transform_into`]). Replaces
    /// a transform set before.
    pub fn with_transform(
        mut self,
        f: impl Fn(usize, &[u8], &mut Vec<u8>) -> std::result::Result<(), String>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.transform = Some(Transformer::Append(Arc::new(f)));
        self
    }

    /// Applies `f`, whose output is `out_bytes` for every record (a decode to a fixed shape, a
    /// conversion of fixed records), to every record on the worker threads: it writes the
    /// record's output straight into `out`, the record's `out_bytes` of the batch's pooled
    /// (pinned) buffer, and must fill them (they hold what the buffer last held). Each batch
    /// is then `out_bytes` per record, its offsets multiples of it; errors and panics are as
    /// for [`BatchLoader::with_transform`]. Replaces a transform set before.
    ///
    /// ```
    /// use gpufeed::dataset::{BatchData, BatchLoader, LoaderConfig, Order, RecordFile, Sampler};
    /// # let dir = tempfile::tempdir()?;
    /// # let path = dir.path().join("records.bin");
    /// std::fs::write(&path, (0..12u8).collect::<Vec<_>>())?;
    /// // SAFETY: the file is not changed while it is used.
    /// let records = unsafe { RecordFile::open_fixed(&path, 3)? }; // 4 records of 3 bytes
    /// let cfg = LoaderConfig::default().with_batch_size(4);
    /// let mut loader = BatchLoader::new(records, Sampler::new(Order::Sequential), cfg, None)?
    ///     // Each record's bytes summed into one little-endian u16.
    ///     .with_transform_into(2, |_, r, out| {
    ///         let sum: u16 = r.iter().map(|&b| u16::from(b)).sum();
    ///         out.copy_from_slice(&sum.to_le_bytes());
    ///         Ok(())
    ///     });
    /// let batch = loader.epoch(0)?.next().transpose()?.expect("a batch");
    /// let BatchData::Host(buf) = &batch.data else { unreachable!("no GPU given") };
    /// assert_eq!(&buf[..], &[3, 0, 12, 0, 21, 0, 30, 0]);
    /// assert_eq!(batch.offsets, [0, 2, 4, 6, 8]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_transform_into(
        mut self,
        out_bytes: usize,
        f: impl Fn(usize, &[u8], &mut [u8]) -> std::result::Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.transform = Some(Transformer::Into {
            bytes: out_bytes,
            f: Arc::new(f),
        });
        self
    }

    /// Counters so far.
    pub fn stats(&self) -> &LoaderStats {
        &self.stats
    }

    /// Number of batches in an epoch.
    pub fn batches_per_epoch(&self) -> usize {
        let n = self.sampler.epoch(self.records.len(), 0).len();
        if self.cfg.drop_last {
            n / self.cfg.batch_size
        } else {
            n.div_ceil(self.cfg.batch_size)
        }
    }

    /// The batches of `epoch`, in order.
    pub fn epoch(&mut self, epoch: u64) -> Result<Epoch<'_>> {
        let run = self.start(epoch, 0)?;
        Ok(Epoch { run, loader: self })
    }

    /// The batches of `epoch`, in order, as [`BatchLoader::epoch`] yields them, in an epoch
    /// that owns the loader ([`OwnedEpoch::into_loader`] gives it back).
    ///
    /// # Errors
    /// [`BatchLoader::epoch`]'s, with the loader ([`NotStarted`]).
    pub fn into_epoch(mut self, epoch: u64) -> std::result::Result<OwnedEpoch, NotStarted> {
        match self.start(epoch, 0) {
            Ok(run) => Ok(OwnedEpoch { run, loader: self }),
            Err(error) => Err(NotStarted {
                error,
                loader: Box::new(self),
            }),
        }
    }

    /// The rest of the epoch at `at`, as [`BatchLoader::resume`] yields it, in an epoch that
    /// owns the loader.
    ///
    /// # Errors
    /// [`BatchLoader::resume`]'s, with the loader ([`NotStarted`]).
    pub fn into_resume(mut self, at: &Position) -> std::result::Result<OwnedEpoch, NotStarted> {
        match self
            .check_resume(at)
            .and_then(|()| self.start(at.epoch, at.samples))
        {
            Ok(run) => Ok(OwnedEpoch { run, loader: self }),
            Err(error) => Err(NotStarted {
                error,
                loader: Box::new(self),
            }),
        }
    }

    /// The rest of the epoch at `at` (saved by [`Epoch::position`], maybe by a run with
    /// another world size): this rank's share of the samples after `at.samples`, none that
    /// the run before consumed. Needs an elastic sampler with the same order and global batch,
    /// over the same number of records.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] when the sampler is not elastic or `at` does not match it
    /// or the data set (it says which), then [`BatchLoader::epoch`]'s.
    ///
    /// # Example (host batches)
    /// ```
    /// use gpufeed::dataset::{BatchLoader, LoaderConfig, Order, Position, RecordFile, Sampler};
    /// # let dir = tempfile::tempdir()?;
    /// # let path = dir.path().join("records.bin");
    /// std::fs::write(&path, vec![7u8; 1000])?;
    /// let open = |rank, world| -> gpufeed::Result<BatchLoader> {
    ///     // SAFETY: the file is not changed while it is used.
    ///     let records = unsafe { RecordFile::open_fixed(&path, 10)? }; // 100 records
    ///     let sampler = Sampler::elastic(Order::Shuffled { seed: 1 }, 8, rank, world, true)?;
    ///     BatchLoader::new(records, sampler, LoaderConfig::default(), None)
    /// };
    /// // One rank of a world of two runs three steps, then stops: its position is saved.
    /// let mut loader = open(0, 2)?;
    /// let mut epoch = loader.epoch(0)?;
    /// for _ in 0..3 { epoch.next().transpose()?; }
    /// let json = serde_json::to_string(&epoch.position().expect("elastic"))?;
    /// drop(epoch);
    /// // Resumed by a world of four: each rank gets 2 records per step, 9 more steps.
    /// let at: Position = serde_json::from_str(&json)?;
    /// let mut loader = open(3, 4)?;
    /// let rest: Vec<usize> = loader.resume(&at)?.map(|b| b.map(|b| b.indices.len())).collect::<Result<_, _>>()?;
    /// assert_eq!(rest, vec![2; 9]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn resume(&mut self, at: &Position) -> Result<Epoch<'_>> {
        self.check_resume(at)?;
        let run = self.start(at.epoch, at.samples)?;
        Ok(Epoch { run, loader: self })
    }

    /// Whether this loader can resume from `at` ([`BatchLoader::resume`]'s checks).
    fn check_resume(&self, at: &Position) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidSetting(format!("cannot resume: {why}")));
        let Some(global) = self.sampler.global_batch else {
            return bad("the sampler is not elastic (Sampler::elastic)".into());
        };
        let n = self.records.len() as u64;
        if at.records != n {
            return bad(format!(
                "the position is of a data set of {} records, this one has {n}",
                at.records
            ));
        }
        if at.order != self.sampler.order {
            return bad(format!(
                "the position's order is {:?}, this sampler's {:?}",
                at.order, self.sampler.order
            ));
        }
        if at.global_batch != global {
            return bad(format!(
                "the position's global batch is {}, this sampler's {global}",
                at.global_batch
            ));
        }
        if !at.samples.is_multiple_of(global as u64) {
            return bad(format!(
                "{} samples is not a whole number of global batches of {global}",
                at.samples
            ));
        }
        Ok(())
    }

    /// Starts the workers of `epoch` from sample `start` of its global order.
    fn start(&mut self, epoch: u64, start: u64) -> Result<Running> {
        let indices = self.sampler.epoch_from(self.records.len(), epoch, start);
        let mut jobs: VecDeque<(usize, Vec<usize>)> = indices
            .chunks(self.cfg.batch_size)
            .filter(|c| !self.cfg.drop_last || c.len() == self.cfg.batch_size)
            .map(<[usize]>::to_vec)
            .enumerate()
            .collect();
        let total = jobs.len();
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                stop: false,
            }),
            ready: Condvar::new(),
        });
        // Hand out the first `prefetch` jobs; one more per batch consumed.
        {
            let mut q = shared.queue.lock();
            for _ in 0..self.cfg.prefetch {
                if let Some(j) = jobs.pop_front() {
                    q.jobs.push_back(j);
                }
            }
        }
        let (tx, rx) = mpsc::channel();
        let workers = (0..self.cfg.workers.min(total.max(1)))
            .map(|i| {
                let (shared, tx) = (Arc::clone(&shared), tx.clone());
                let (records, pool, transform) = (
                    Arc::clone(&self.records),
                    self.pool.clone(),
                    self.transform.clone(),
                );
                let sched = self.gpu.as_ref().map(|(_, s)| Arc::clone(s));
                let counters = self.cfg.direct.then(|| Arc::clone(&self.direct));
                let depth = self.cfg.direct_depth.max(1);
                std::thread::Builder::new()
                    .name(format!("gpufeed-batch-{i}"))
                    .spawn(move || {
                        let job = Job {
                            records: &records,
                            pool: &pool,
                            transform: transform.as_ref(),
                            sched: sched.as_deref(),
                            direct: counters.as_deref().map(|c| (c, depth)),
                        };
                        worker(&shared, &tx, &job);
                    })
                    .map_err(|source| Error::ThreadStart {
                        what: "a batch worker thread",
                        source,
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Running {
            epoch,
            start,
            handed: 0,
            next: 0,
            total,
            pending: jobs,
            done: BTreeMap::new(),
            rx,
            shared,
            workers,
            timeout: self.cfg.batch_timeout,
        })
    }
}

struct Queue {
    jobs: VecDeque<(usize, Vec<usize>)>,
    stop: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
}

/// A prepared batch: record indices, offsets, the bytes (on the GPU where there is one), the
/// seconds issuing its upload took, and the event that completes when its bytes are on the
/// GPU.
type Gathered = (
    Vec<usize>,
    Vec<usize>,
    BatchData,
    f64,
    Option<gpufeed_cuda::cudarc::driver::CudaEvent>,
);
type Prepared = (usize, Result<Gathered>);

/// What a worker thread prepares batches from.
struct Job<'a> {
    records: &'a Dataset,
    pool: &'a PinnedPool,
    transform: Option<&'a Transformer>,
    /// Where there is a GPU: each worker uploads the batch it gathered, so that the uploads
    /// of several batches overlap each other and the gathering of the next ones.
    sched: Option<&'a TransferScheduler>,
    /// With [`LoaderConfig::direct`]: records are read with `O_DIRECT`, counted here, this
    /// many in flight ([`LoaderConfig::direct_depth`]).
    direct: Option<(&'a DirectCounters, usize)>,
}

fn worker(shared: &Shared, tx: &mpsc::Sender<Prepared>, job: &Job<'_>) {
    let Job {
        records,
        pool,
        transform,
        sched,
        direct,
    } = *job;
    // A folder's files are read with one io_uring reader per worker, kept for the epoch; so
    // are the O_DIRECT reader and its open files.
    let mut reader = None;
    let mut direct_reader = None;
    let mut scratch = Scratch::default();
    loop {
        let (number, indices) = {
            let mut q = shared.queue.lock();
            loop {
                if q.stop {
                    return;
                }
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                shared.ready.wait(&mut q);
            }
        };
        let out = Out {
            pool,
            transform,
            scratch: &mut scratch,
        };
        let result = match (records, direct) {
            (Dataset::Records(r), Some(d)) => {
                gather_direct(r, &mut direct_reader, d, out, &indices)
            }
            (Dataset::Shards(s), Some(d)) => gather_direct(s, &mut direct_reader, d, out, &indices),
            (Dataset::Records(r), None) => gather(r, out, &indices),
            (Dataset::Shards(s), None) => gather(s, out, &indices),
            (Dataset::Folder(f), _) => gather_files(f, &mut reader, out, &indices),
        }
        .and_then(|(offsets, mut buf)| {
            let Some(sched) = sched else {
                return Ok((indices, offsets, BatchData::Host(buf), 0.0, None));
            };
            // Issued, not waited for: the worker gathers its next batch while the copy runs;
            // the consumer waits for the event before it hands the batch out, and the pool
            // for the copy before it hands `buf` out again.
            let t = Instant::now();
            let (d, done) = sched.upload_pooled_async(&mut buf)?;
            Ok((
                indices,
                offsets,
                BatchData::Device(d),
                t.elapsed().as_secs_f64(),
                Some(done),
            ))
        });
        if tx.send((number, result)).is_err() {
            return;
        }
    }
}

/// A record's parts as one slice: the part itself, or the parts copied into `scratch` (a tar
/// sample's members, for a transform that takes one slice).
pub(crate) fn contiguous<'a>(parts: &[&'a [u8]], scratch: &'a mut Vec<u8>) -> &'a [u8] {
    match parts {
        [one] => one,
        many => {
            scratch.clear();
            many.iter().for_each(|m| scratch.extend_from_slice(m));
            scratch
        }
    }
}

/// Runs the user's transform on record `i`: its error, or its panic, becomes
/// [`Error::Transform`] (a panic must not kill the worker, which would leave the epoch waiting
/// for a batch that nobody makes).
pub(crate) fn run_transform(f: &Transform, i: usize, r: &[u8], out: &mut Vec<u8>) -> Result<()> {
    caught(i, || f(i, r, out))
}

/// Runs the user's fixed-size transform on record `i` into `out`, as [`run_transform`].
fn run_transform_into(f: &TransformInto, i: usize, r: &[u8], out: &mut [u8]) -> Result<()> {
    caught(i, || f(i, r, out))
}

/// Runs a transform of record `i`: its error, or its panic, becomes [`Error::Transform`].
fn caught(i: usize, call: impl FnOnce() -> std::result::Result<(), String>) -> Result<()> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(message)) => Err(Error::Transform {
            record: i,
            message,
            panicked: false,
        }),
        Err(payload) => Err(Error::Transform {
            record: i,
            message: format!("it panicked: {}", panic_message(&*payload)),
            panicked: true,
        }),
    }
}

/// Reads the record index `file` of `size` bytes (its `fstat` size) for data of `data_len`
/// bytes: checks its size ([`check_index_size`]) before reading, reads exactly `size` bytes
/// into offsets (memory reserved fallibly) and checks them ([`check_record_index`]).
fn read_record_index(
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
fn check_index_size(size: u64, data_len: u64) -> std::result::Result<usize, String> {
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
fn parse_record_index(raw: &[u8], data_len: u64) -> std::result::Result<Vec<u64>, String> {
    check_index_size(raw.len() as u64, data_len)?;
    let offsets: Vec<u64> = raw
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    check_record_index(offsets, data_len)
}

/// Checks a record index's offsets (at least two, not decreasing, the last within
/// `data_len`).
fn check_record_index(offsets: Vec<u64>, data_len: u64) -> std::result::Result<Vec<u64>, String> {
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

/// The text of a panic's payload (`&str` or `String`; anything else unnamed).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Where a worker puts a batch: a buffer of its pool, through the loader's transform, with
/// the worker's scratch buffers.
struct Out<'a> {
    pool: &'a PinnedPool,
    transform: Option<&'a Transformer>,
    scratch: &'a mut Scratch,
}

/// Copies (and transforms) the records of one batch out of the file's mapping into a pooled
/// buffer.
fn gather(
    records: &dyn Source,
    out: Out<'_>,
    indices: &[usize],
) -> Result<(Vec<usize>, PooledBuffer)> {
    let parts = indices
        .iter()
        .map(|&i| {
            records.parts(i).ok_or_else(|| Error::Records {
                path: records.path_of(i).into(),
                reason: format!("record {i} does not exist"),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    assemble(parts, out, indices)
}

/// Copies (and transforms) the records `indices`, whose parts `parts` holds (one entry per
/// index, in order), into a pooled buffer; returns each record's start in it, then the end of
/// the last.
fn assemble(
    parts: Vec<Vec<&[u8]>>,
    out: Out<'_>,
    indices: &[usize],
) -> Result<(Vec<usize>, PooledBuffer)> {
    let Out {
        pool,
        transform,
        scratch,
    } = out;
    let mut offsets = Vec::with_capacity(indices.len() + 1);
    offsets.push(0);
    match transform {
        None => {
            let total = parts.iter().flatten().map(|p| p.len()).sum::<usize>();
            let mut buf = pool.get(total.max(1))?;
            buf.set_len(total);
            let mut at = 0;
            for p in parts {
                for r in p {
                    buf[at..at + r.len()].copy_from_slice(r);
                    at += r.len();
                }
                offsets.push(at);
            }
            Ok((offsets, buf))
        }
        Some(Transformer::Append(f)) => {
            let Scratch { out, joined, .. } = scratch;
            out.clear();
            for (&i, p) in indices.iter().zip(&parts) {
                run_transform(f, i, contiguous(p, joined), out)?;
                offsets.push(out.len());
            }
            let mut buf = pool.get(out.len().max(1))?;
            buf.set_len(out.len());
            buf.copy_from_slice(out);
            Ok((offsets, buf))
        }
        Some(Transformer::Into { bytes, f }) => {
            let mut buf = sized_buffer(pool, *bytes, indices.len())?;
            let joined = &mut scratch.joined;
            for (k, (&i, p)) in indices.iter().zip(&parts).enumerate() {
                let out = &mut buf[k * bytes..(k + 1) * bytes];
                run_transform_into(f, i, contiguous(p, joined), out)?;
            }
            Ok((sized_offsets(*bytes, indices.len()), buf))
        }
    }
}

/// A pooled buffer for `records` outputs of `bytes` each ([`Transformer::Into`]).
fn sized_buffer(pool: &PinnedPool, bytes: usize, records: usize) -> Result<PooledBuffer> {
    let total = bytes.checked_mul(records).ok_or_else(|| {
        Error::InvalidSetting(format!(
            "{records} records of {bytes} bytes out of the transform do not fit in memory"
        ))
    })?;
    let mut buf = pool.get(total.max(1))?;
    buf.set_len(total);
    Ok(buf)
}

/// The offsets of `records` outputs of `bytes` each, back to back.
fn sized_offsets(bytes: usize, records: usize) -> Vec<usize> {
    (0..=records).map(|k| k * bytes).collect()
}

/// A worker's `O_DIRECT` reader ([`LoaderConfig::direct`]) with the files it opened, by
/// their number in the source, and the aligned buffer its batches' runs are read into (kept
/// from batch to batch: a fresh one would be faulted in and zeroed for every batch).
struct DirectReader {
    reader: Reader,
    open: std::collections::HashMap<usize, gpufeed_uring::FileId>,
    scratch: gpufeed_os::AlignedBuf,
}

/// The `O_DIRECT` reads of a loader's workers, counted.
#[derive(Debug, Default)]
struct DirectCounters {
    reads: std::sync::atomic::AtomicU64,
    bytes: std::sync::atomic::AtomicU64,
}

/// The largest single `O_DIRECT` read of a batch's runs: a longer run is split.
const DIRECT_MAX_READ: usize = 8 << 20;

/// The page size `O_DIRECT` reads are aligned to.
const DIRECT_ALIGN: usize = 4096;

/// Checks that `records` can be read with `O_DIRECT` ([`LoaderConfig::direct`]): record files
/// on file systems that allow it.
fn check_direct(records: &Dataset) -> Result<()> {
    let files: Vec<&RecordFile> = match records {
        Dataset::Records(r) => vec![r],
        Dataset::Shards(s) => s.shards().iter().collect(),
        Dataset::Folder(_) => {
            return Err(Error::InvalidSetting(
                "LoaderConfig::direct reads record files; an ImageFolder's files are read whole already (leave direct off)".into(),
            ));
        }
    };
    for f in files {
        let (file, _) = gpufeed_os::file::open_regular(f.path(), false)?;
        if !gpufeed_os::align::dio_alignment(&file)?.supported() {
            return Err(Error::Read(gpufeed_uring::Error::DirectUnsupported {
                path: f.path().into(),
                reason: "the file system reports no O_DIRECT support (statx DIOALIGN = 0): leave LoaderConfig::direct off".into(),
            }));
        }
    }
    Ok(())
}

/// Reads the records of one batch with `O_DIRECT` ([`LoaderConfig::direct`]): their byte
/// ranges sorted by file and offset, ranges within a page of each other merged into runs,
/// every run read (from the page holding its first byte) into an aligned buffer at once; then copied (and
/// transformed) into a pooled buffer as [`gather`] does.
fn gather_direct(
    records: &dyn Source,
    direct: &mut Option<DirectReader>,
    (counters, depth): (&DirectCounters, usize),
    out: Out<'_>,
    indices: &[usize],
) -> Result<(Vec<usize>, PooledBuffer)> {
    use std::sync::atomic::Ordering::Relaxed;
    let missing = |i: usize| Error::Records {
        path: records.path_of(i).into(),
        reason: format!("record {i} does not exist"),
    };
    // Each record's file and byte ranges, in the batch's order (located once, read below).
    let located = indices
        .iter()
        .map(|&i| records.ranges(i).ok_or_else(|| missing(i)))
        .collect::<Result<Vec<_>>>()?;
    let mut spans: Vec<(usize, usize, usize)> = located
        .iter()
        .flat_map(|(f, ranges)| ranges.iter().map(move |r| (*f, r.start, r.end)))
        .collect();
    spans.sort_unstable();
    // Runs: (file, start, end), records within a page of each other read together.
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for (f, a, b) in spans {
        match runs.last_mut() {
            Some(last) if last.0 == f && a <= last.2 + DIRECT_ALIGN => last.2 = last.2.max(b),
            _ => runs.push((f, a, b)),
        }
    }
    let dr = match direct {
        Some(d) => d,
        None => direct.insert(DirectReader {
            reader: Reader::builder()
                .direct(Direct::On)
                .queue_depth(depth)
                .block_bytes(DIRECT_MAX_READ)
                .build()?,
            open: std::collections::HashMap::new(),
            scratch: gpufeed_os::AlignedBuf::new(DIRECT_ALIGN, DIRECT_ALIGN)?,
        }),
    };
    // (file, offset of the run's first byte read, its place in the scratch buffer, bytes
    // read): from the page holding the run's first byte (read straight into the buffer) to
    // the run's last byte (the reader reads a last partial page through its own buffer).
    let mut placed = Vec::with_capacity(runs.len());
    let mut total = 0;
    for &(f, a, b) in &runs {
        let file = records.file(f).ok_or_else(|| Error::Records {
            path: PathBuf::new(),
            reason: format!("file {f} of the data set does not exist"),
        })?;
        if let std::collections::hash_map::Entry::Vacant(e) = dr.open.entry(f) {
            e.insert(dr.reader.open(file.path())?);
        }
        let start = a / DIRECT_ALIGN * DIRECT_ALIGN;
        placed.push((f, start, total, b - start));
        total += (b - start).next_multiple_of(DIRECT_ALIGN);
    }
    if dr.scratch.len() < total {
        // The old buffer goes first: two batches' worth at once is not needed.
        dr.scratch = gpufeed_os::AlignedBuf::new(DIRECT_ALIGN, DIRECT_ALIGN)?;
        dr.scratch = gpufeed_os::AlignedBuf::new(total, DIRECT_ALIGN)?;
    }
    let mut rest = &mut dr.scratch[..total];
    let mut reads = Vec::with_capacity(placed.len());
    for &(f, start, _, len) in &placed {
        let (this, tail) =
            std::mem::take(&mut rest).split_at_mut(len.next_multiple_of(DIRECT_ALIGN));
        rest = tail;
        if len > 0 {
            reads.push((dr.open[&f], start as u64, &mut this[..len]));
        }
    }
    dr.reader.read_exact_many(reads)?;
    counters.reads.fetch_add(placed.len() as u64, Relaxed);
    counters
        .bytes
        .fetch_add(placed.iter().map(|p| p.3 as u64).sum(), Relaxed);
    let scratch = &dr.scratch[..total];
    let placed = &placed;
    let parts = indices
        .iter()
        .zip(&located)
        .map(|(&i, (f, ranges))| {
            ranges
                .iter()
                .map(|r| {
                    if r.is_empty() {
                        return Ok(&[][..]);
                    }
                    // The run holding it: the last run of file `f` starting at or before it.
                    let k = placed.partition_point(|(pf, ps, ..)| (*pf, *ps) <= (*f, r.start));
                    k.checked_sub(1)
                        .map(|k| placed[k])
                        .filter(|&(pf, ps, _, len)| pf == *f && r.end <= ps + len)
                        .map(|(_, ps, at, _)| &scratch[at + r.start - ps..at + r.end - ps])
                        .ok_or_else(|| missing(i))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    assemble(parts, out, indices)
}

/// Reads (and transforms) the files of one batch into a pooled buffer: straight into it
/// without a transform; with one into the worker's scratch buffer, which the transform reads.
fn gather_files(
    folder: &ImageFolder,
    reader: &mut Option<Reader>,
    out: Out<'_>,
    indices: &[usize],
) -> Result<(Vec<usize>, PooledBuffer)> {
    let Out {
        pool,
        transform,
        scratch,
    } = out;
    let reader = match reader {
        Some(r) => r,
        None => reader.insert(
            Reader::builder()
                .direct(Direct::Off)
                .queue_depth(32)
                .async_buffered(false)
                .build()?,
        ),
    };
    let size = |i: usize| {
        folder.sample_len(i).ok_or_else(|| Error::Records {
            path: folder.root().into(),
            reason: format!("sample {i} does not exist ({} samples)", folder.len()),
        })
    };
    let mut offsets = Vec::with_capacity(indices.len() + 1);
    offsets.push(0);
    let mut at = 0usize;
    for &i in indices {
        at = at.checked_add(size(i)?).ok_or_else(|| Error::Records {
            path: folder.root().into(),
            reason: "a batch of its files is larger than this machine's memory".into(),
        })?;
        offsets.push(at);
    }
    let Some(transform) = transform else {
        let mut buf = pool.get(at.max(1))?;
        buf.set_len(at);
        folder.read_samples(reader, indices, &mut buf)?;
        return Ok((offsets, buf));
    };
    // Grown to the largest batch, never cleared: every byte used is read over.
    if scratch.files.len() < at {
        scratch.files.resize(at, 0);
    }
    let files = &mut scratch.files[..at];
    folder.read_samples(reader, indices, files)?;
    let file = |k: usize| &files[offsets[k]..offsets[k + 1]];
    match transform {
        Transformer::Append(f) => {
            let out = &mut scratch.out;
            out.clear();
            let mut ends = vec![0];
            for (k, &i) in indices.iter().enumerate() {
                run_transform(f, i, file(k), out)?;
                ends.push(out.len());
            }
            let mut buf = pool.get(out.len().max(1))?;
            buf.set_len(out.len());
            buf.copy_from_slice(out);
            Ok((ends, buf))
        }
        Transformer::Into { bytes, f } => {
            let mut buf = sized_buffer(pool, *bytes, indices.len())?;
            for (k, &i) in indices.iter().enumerate() {
                run_transform_into(f, i, file(k), &mut buf[k * bytes..(k + 1) * bytes])?;
            }
            Ok((sized_offsets(*bytes, indices.len()), buf))
        }
    }
}

/// The batches of one epoch, in order, borrowing its loader; see [`BatchLoader::epoch`]
/// ([`OwnedEpoch`] owns it instead). Dropping it stops its workers.
pub struct Epoch<'l> {
    run: Running,
    loader: &'l mut BatchLoader,
}

/// The batches of one epoch, in order, owning its loader ([`BatchLoader::into_epoch`]): what
/// a caller that cannot hold a borrow keeps (a Python iterator, a struct of its own); `Send`.
/// It yields what the borrowing [`Epoch`] yields, its position included;
/// [`OwnedEpoch::into_loader`] (or dropping it) stops its workers as dropping an [`Epoch`]
/// does, and gives the loader back for the next epoch, its counters kept.
///
/// # Example (host batches)
/// ```
/// use gpufeed::dataset::{BatchLoader, LoaderConfig, Order, RecordFile, Sampler};
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("records.bin");
/// std::fs::write(&path, (0..100u8).collect::<Vec<_>>())?;
/// // SAFETY: the file is not changed while it is used.
/// let records = unsafe { RecordFile::open_fixed(&path, 10)? };
/// let cfg = LoaderConfig::default().with_batch_size(4);
/// let loader = BatchLoader::new(records, Sampler::new(Order::Sequential), cfg, None)?;
/// let mut epoch = loader.into_epoch(0)?; // moved: it can be stored or sent to a thread
/// assert_eq!(epoch.next().transpose()?.map(|b| b.indices), Some(vec![0, 1, 2, 3]));
/// let mut loader = epoch.into_loader(); // mid-epoch: the workers stop
/// assert_eq!(loader.stats().batches, 1);
/// assert_eq!(loader.epoch(1)?.count(), 3);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct OwnedEpoch {
    // Stopped (dropped) before the loader goes.
    run: Running,
    loader: BatchLoader,
}

/// Why [`BatchLoader::into_epoch`] or [`BatchLoader::into_resume`] started no epoch, with the
/// loader given back unchanged; `?` turns it into its [`Error`] (dropping the loader).
#[derive(Debug)]
pub struct NotStarted {
    /// What went wrong: [`BatchLoader::epoch`]'s or [`BatchLoader::resume`]'s error.
    pub error: Error,
    /// The loader.
    pub loader: Box<BatchLoader>,
}

impl std::fmt::Display for NotStarted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for NotStarted {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}

impl From<NotStarted> for Error {
    fn from(n: NotStarted) -> Self {
        n.error
    }
}

// Held by a Python iterator (a pyclass is Send) and moved between threads.
const _: () = {
    const fn send<T: Send>() {}
    send::<OwnedEpoch>();
    send::<NotStarted>();
};

/// A running epoch apart from its loader (borrowed by [`Epoch`], owned by [`OwnedEpoch`]):
/// its jobs, the batches prepared out of order, the workers. Dropping it stops them.
struct Running {
    epoch: u64,
    /// Samples of the global order before this epoch's first batch (a resume point).
    start: u64,
    /// Batches handed out (each a batch or its own error), for [`Epoch::position`]; an error
    /// that ends the epoch early (a timeout, stopped workers) hands nothing out.
    handed: usize,
    next: usize,
    total: usize,
    pending: VecDeque<(usize, Vec<usize>)>,
    done: BTreeMap<usize, Result<Gathered>>,
    rx: Receiver<Prepared>,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// The loader's batch timeout (its settings do not change while an epoch runs).
    timeout: Duration,
}

impl Running {
    fn next(&mut self, loader: &mut BatchLoader) -> Option<Result<Batch>> {
        if self.next >= self.total {
            return None;
        }
        let t = Instant::now();
        let timeout = self.timeout;
        let prepared = loop {
            if let Some(p) = self.done.remove(&self.next) {
                break p;
            }
            match self.rx.recv_timeout(timeout.saturating_sub(t.elapsed())) {
                Ok((n, r)) => {
                    self.done.insert(n, r);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let batch = self.next;
                    self.next = self.total;
                    return Some(Err(Error::BatchTimeout {
                        batch,
                        ms: timeout.as_millis(),
                    }));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    self.next = self.total;
                    return Some(Err(Error::WorkersStopped));
                }
            }
        };
        // Keep `prefetch` batches in preparation.
        if let Some(job) = self.pending.pop_front() {
            self.shared.queue.lock().jobs.push_back(job);
            self.shared.ready.notify_one();
        }
        let number = self.next;
        self.next += 1;
        // A batch is handed out once its bytes are on the GPU.
        let prepared = prepared.and_then(|(indices, offsets, data, upload_s, done)| {
            if let Some(ev) = done {
                ev.synchronize().map_err(|e| gpufeed_cuda::Error::Cuda {
                    op: "cuEventSynchronize",
                    result: e.0,
                })?;
            }
            Ok((indices, offsets, data, upload_s))
        });
        loader.stats.waited_s += t.elapsed().as_secs_f64();
        let (indices, offsets, data, upload_s) = match prepared {
            Ok(p) => p,
            Err(e) => {
                if matches!(e, Error::Transform { panicked: true, .. }) {
                    // A panic is a bug in user code: the epoch ends here.
                    self.next = self.total;
                } else {
                    self.handed = number + 1;
                }
                return Some(Err(e));
            }
        };
        let bytes = *offsets.last().unwrap_or(&0);
        loader.stats.upload_s += upload_s;
        loader.stats.direct_reads = loader.direct.reads.load(Ordering::Relaxed);
        loader.stats.direct_read_bytes = loader.direct.bytes.load(Ordering::Relaxed);
        loader.stats.batches += 1;
        loader.stats.bytes += bytes as u64;
        let labels = match &*loader.records {
            Dataset::Folder(f) => indices
                .iter()
                .map(|&i| f.labels().get(i).copied().unwrap_or(u32::MAX))
                .collect(),
            Dataset::Records(_) | Dataset::Shards(_) => Vec::new(),
        };
        self.handed = number + 1;
        Some(Ok(Batch {
            epoch: self.epoch,
            number: number + self.first_number(loader),
            indices,
            offsets,
            labels,
            data,
        }))
    }

    /// The number of this epoch's first batch: the steps a resumed epoch skipped.
    fn first_number(&self, loader: &BatchLoader) -> usize {
        match loader.sampler.global_batch {
            Some(g) => (self.start / g as u64) as usize,
            None => 0,
        }
    }

    fn position(&self, loader: &BatchLoader) -> Option<Position> {
        loader
            .sampler
            .position_after(loader.records.len(), self.epoch, self.start, self.handed)
    }

    /// Batches left to yield (a batch or its error each), at most.
    fn left(&self) -> usize {
        self.total - self.next
    }
}

impl Iterator for Epoch<'_> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        self.run.next(self.loader)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.run.left()))
    }
}

impl Iterator for OwnedEpoch {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        self.run.next(&mut self.loader)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.run.left()))
    }
}

impl Epoch<'_> {
    /// Where the run is after the batches yielded so far (an elastic sampler's; `None` for
    /// others): save it once the step that used the last batch is done, resume from it with
    /// [`BatchLoader::resume`]. After the epoch's last batch it is the start of the next epoch.
    pub fn position(&self) -> Option<Position> {
        self.run.position(self.loader)
    }
}

impl OwnedEpoch {
    /// Where the run is after the batches yielded so far, as [`Epoch::position`] says.
    pub fn position(&self) -> Option<Position> {
        self.run.position(&self.loader)
    }

    /// The epoch's number.
    pub fn epoch(&self) -> u64 {
        self.run.epoch
    }

    /// The loader (its counters so far, its batches per epoch).
    pub fn loader(&self) -> &BatchLoader {
        &self.loader
    }

    /// The loader back, for the next epoch: the workers stop first, as when an [`Epoch`] is
    /// dropped (those still busy finish their batch; one stuck past the batch timeout is left
    /// behind).
    pub fn into_loader(self) -> BatchLoader {
        let OwnedEpoch { run, loader } = self;
        drop(run);
        loader
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.shared.queue.lock().stop = true;
        self.shared.ready.notify_all();
        // Workers finish the batch in hand; one stuck in a transform that never returns is
        // left behind after the batch timeout (it owns everything it uses) rather than
        // blocking the caller forever.
        let deadline = Instant::now() + self.timeout;
        while self.workers.iter().any(|w| !w.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        for w in self.workers.drain(..) {
            if w.is_finished() {
                let _ = w.join();
            } else {
                tracing::warn!("a batch worker is still busy after the batch timeout; left behind");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Any index bytes and data length: offsets that never decrease and end inside the
        /// data, or an error; never a panic.
        #[test]
        fn arbitrary_record_indexes_never_panic(
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
            data_len in proptest::prelude::any::<u64>(),
        ) {
            if let Ok(offsets) = parse_record_index(&raw, data_len) {
                proptest::prop_assert!(offsets.len() >= 2);
                proptest::prop_assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
                proptest::prop_assert!(*offsets.last().expect("two") <= data_len);
                proptest::prop_assert!(offsets.len() as u64 - 1 <= data_len, "a record per byte at most");
            }
        }

        /// Valid indexes (at most a record per byte of data) are accepted as they are.
        #[test]
        fn valid_record_indexes_round_trip(mut lens in proptest::collection::vec(0u64..1000, 1..50)) {
            let mut offsets = vec![0u64];
            for l in lens.drain(..) {
                offsets.push(offsets.last().expect("one") + l);
            }
            let raw: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
            let end = *offsets.last().expect("one");
            let data_len = end.max(offsets.len() as u64 - 1);
            proptest::prop_assert_eq!(parse_record_index(&raw, data_len), Ok(offsets));
        }
    }

    /// Each step's records, the union of every rank's batch of that step (sorted), for an
    /// elastic sampler of `world` ranks from sample `start`.
    fn steps(
        n: usize,
        global: usize,
        world: usize,
        start: usize,
        drop_last: bool,
    ) -> Vec<Vec<usize>> {
        let order = Order::Shuffled { seed: 11 };
        let per_rank: Vec<Vec<usize>> = (0..world)
            .map(|r| {
                Sampler::elastic(order, global, r, world, drop_last)
                    .expect("elastic")
                    .epoch_from(n, 2, start as u64)
            })
            .collect();
        let b = global / world;
        let count = per_rank[0].len().div_ceil(b);
        (0..count)
            .map(|k| {
                let mut step: Vec<usize> = per_rank
                    .iter()
                    .flat_map(|p| p.chunks(b).nth(k).unwrap_or(&[]).iter().copied())
                    .collect();
                step.sort_unstable();
                step
            })
            .collect()
    }

    fn divisors(n: usize) -> Vec<usize> {
        (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
    }

    proptest::proptest! {
        /// The records of each step are the same whatever the world size (one that divides the
        /// global batch); every rank gets as many as the others.
        #[test]
        fn elastic_steps_do_not_depend_on_the_world_size(
            n in 0usize..400,
            global in proptest::sample::select(vec![1usize, 6, 12, 24, 60]),
            pick in (0usize..100, 0usize..100),
        ) {
            let d = divisors(global);
            let (w1, w2) = (d[pick.0 % d.len()], d[pick.1 % d.len()]);
            let (a, b) = (steps(n, global, w1, 0, true), steps(n, global, w2, 0, true));
            proptest::prop_assert_eq!(&a, &b);
            proptest::prop_assert_eq!(a.len(), n / global);
            // Without drop_last the last step differs only in the padding taken from the
            // order's start; every record of the epoch is in some step.
            let full = steps(n, global, w1, 0, false);
            let mut seen: Vec<usize> = full.concat();
            seen.sort_unstable();
            seen.dedup();
            proptest::prop_assert_eq!(seen, (0..n).collect::<Vec<_>>());
            for r in 0..w1 {
                let len = Sampler::elastic(Order::Sequential, global, r, w1, false)
                    .expect("elastic")
                    .epoch(n, 0)
                    .len();
                // Full steps of global / w1 each, then an even share of the partial one.
                proptest::prop_assert_eq!(len, n / global * (global / w1) + (n % global).div_ceil(w1));
            }
        }

        /// `Order::Blocks` is a permutation of whole blocks, each starting at a multiple of
        /// `block`, a shorter last block at the end; an elastic rank's batches whose size
        /// `block` divides hold whole blocks only.
        #[test]
        fn block_orders_keep_blocks_together(
            n in 0usize..500,
            block in 1usize..20,
            seed in 0u64..1000,
            epoch in 0u64..4,
        ) {
            let order = Order::Blocks { seed, block };
            let all = permutation(n, order, epoch);
            let mut sorted = all.clone();
            sorted.sort_unstable();
            proptest::prop_assert_eq!(sorted, (0..n).collect::<Vec<_>>());
            for chunk in all.chunks(block) {
                let first = chunk.iter().min().copied().unwrap_or(0);
                proptest::prop_assert_eq!(first % block, 0, "{:?}", chunk);
                proptest::prop_assert!(chunk.iter().all(|&i| i / block == first / block), "{:?}", chunk);
            }
            // The same seed and epoch give the same order; another epoch, another (mostly).
            proptest::prop_assert_eq!(&all, &permutation(n, order, epoch));
            let (world, per) = (2usize, 2 * block);
            for r in 0..world {
                let mine = Sampler::elastic(order, per * world, r, world, true)
                    .expect("elastic")
                    .epoch(n, epoch);
                for batch in mine.chunks(per) {
                    let mut b = batch.to_vec();
                    b.sort_unstable();
                    for whole in b.chunks(block) {
                        proptest::prop_assert_eq!(whole[0] % block, 0);
                        proptest::prop_assert_eq!(whole[whole.len() - 1], whole[0] + block - 1);
                    }
                }
            }
        }

        /// A run stopped after any step and resumed with another world size sees every
        /// remaining record of the epoch once, and none it saw before.
        #[test]
        fn an_elastic_resume_yields_exactly_the_rest(
            n in 0usize..400,
            global in proptest::sample::select(vec![6usize, 12, 24]),
            pick in (0usize..100, 0usize..100),
            cut in 0usize..80,
        ) {
            let d = divisors(global);
            let (w1, w2) = (d[pick.0 % d.len()], d[pick.1 % d.len()]);
            let before = steps(n, global, w1, 0, true);
            let cut = cut.min(before.len());
            let after = steps(n, global, w2, cut * global, true);
            let mut all: Vec<usize> = before[..cut].concat();
            all.extend(after.concat());
            let len = all.len();
            all.sort_unstable();
            all.dedup();
            proptest::prop_assert_eq!(all.len(), len, "a record seen twice");
            proptest::prop_assert_eq!(len, n / global * global);
        }
    }

    /// Worker processes (`ring::epoch_batches`) cut an elastic epoch as the in-process loader
    /// does: the sampler's per-rank batch, whatever the config says.
    #[test]
    fn ring_batches_follow_an_elastic_sampler() {
        let sampler =
            Sampler::elastic(Order::Shuffled { seed: 3 }, 24, 1, 2, true).expect("elastic");
        let cfg = LoaderConfig::default().with_batch_size(50);
        let batches = ring::epoch_batches(250, &sampler, &cfg, 0);
        assert_eq!(batches.len(), 10, "250 records: 10 full steps of 24");
        assert!(batches.iter().all(|(_, b)| b.len() == 12));
        let flat: Vec<usize> = batches.into_iter().flat_map(|(_, b)| b).collect();
        assert_eq!(flat, sampler.epoch(250, 0));
    }

    #[test]
    fn samplers_shuffle_by_seed_and_shard_evenly() {
        let seq = Sampler::new(Order::Sequential);
        assert_eq!(seq.epoch(5, 0), vec![0, 1, 2, 3, 4]);
        let a = Sampler::new(Order::Shuffled { seed: 1 });
        assert_eq!(
            a.epoch(100, 3),
            a.epoch(100, 3),
            "same seed and epoch, same order"
        );
        assert_ne!(
            a.epoch(100, 3),
            a.epoch(100, 4),
            "another epoch, another order"
        );
        let mut sorted = a.epoch(100, 3);
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>(), "a permutation");
        // 10 records over 3 ranks: 4 each, wrapping around; all records covered.
        let shards: Vec<Vec<usize>> = (0..3)
            .map(|r| seq.shard(r, 3, false).expect("shard").epoch(10, 0))
            .collect();
        assert!(shards.iter().all(|s| s.len() == 4));
        let mut all: Vec<usize> = shards.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 10);
        let dropped: Vec<usize> = (0..3)
            .map(|r| seq.shard(r, 3, true).expect("shard").epoch(10, 0).len())
            .collect();
        assert_eq!(dropped, vec![3, 3, 3]);
        assert!(seq.shard(3, 3, false).is_err());
    }
}
