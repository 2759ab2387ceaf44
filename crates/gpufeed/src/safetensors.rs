//! safetensors checkpoints to GPU memory (one bulk transfer per file, a named view per tensor;
//! or tensor by tensor on demand, [`OnDemand`]) and back to files ([`save`], [`save_sharded`]:
//! crash-safe, `O_DIRECT` where it works).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use gpufeed_cuda::cudarc::driver::CudaView;
use gpufeed_os::FileIdentity;

pub use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::load::{DeviceBuffer, LoadOptions, LoadReport, Loader};
use crate::registered::RegisteredFile;
use crate::save::{Piece, SaveReport, Saver};

/// Where one tensor lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major).
    pub shape: Vec<usize>,
    /// Which file of the checkpoint (index into [`Checkpoint::files`], or into
    /// [`OnDemand::files`]).
    pub file: usize,
    /// Byte range in that file's device buffer; for [`OnDemand`], in the file itself.
    pub range: Range<usize>,
}

/// A checkpoint in GPU memory: one device buffer per file, a view per tensor.
#[derive(Debug)]
pub struct Checkpoint {
    gpu: gpufeed_cuda::Gpu,
    files: Vec<PathBuf>,
    buffers: Vec<DeviceBuffer>,
    tensors: BTreeMap<String, TensorInfo>,
    reports: Vec<LoadReport>,
}

impl Checkpoint {
    /// The GPU holding it.
    pub fn gpu(&self) -> &gpufeed_cuda::Gpu {
        &self.gpu
    }

    /// The tensor `name`: its facts and a view of its bytes on the GPU.
    pub fn get(&self, name: &str) -> Option<(&TensorInfo, CudaView<'_, u8>)> {
        let info = self.tensors.get(name)?;
        let view = self.buffers[info.file].slice(info.range.clone());
        Some((info, view))
    }

    /// Facts of the tensor `name`.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The files loaded, in order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The device buffer holding file `i`'s data section.
    pub fn buffer(&self, i: usize) -> Option<&DeviceBuffer> {
        self.buffers.get(i)
    }

    /// One load report per file.
    pub fn reports(&self) -> &[LoadReport] {
        &self.reports
    }

    /// Bytes on the GPU.
    pub fn bytes(&self) -> u64 {
        self.buffers.iter().map(|b| b.len() as u64).sum()
    }

    /// A checkpoint of the files `layouts` (of the checkpoint `path`) whose data sections are
    /// `buffers` on `gpu`, in order.
    pub(crate) fn from_layouts(
        path: &Path,
        gpu: gpufeed_cuda::Gpu,
        layouts: &[FileLayout],
        buffers: Vec<DeviceBuffer>,
    ) -> Result<Self> {
        let mut tensors = BTreeMap::new();
        for (i, layout) in layouts.iter().enumerate() {
            for (name, dtype, shape, range) in &layout.tensors {
                let info = TensorInfo {
                    dtype: *dtype,
                    shape: shape.clone(),
                    file: i,
                    range: range.clone(),
                };
                if tensors.insert(name.clone(), info).is_some() {
                    return Err(Error::Index {
                        path: path.into(),
                        reason: format!("tensor {name} appears in two files"),
                    });
                }
            }
        }
        Ok(Checkpoint {
            gpu,
            files: layouts.iter().map(|l| l.path.clone()).collect(),
            buffers,
            tensors,
            reports: Vec::new(),
        })
    }
}

/// The tensors of one safetensors file, where its data section starts, and which version of
/// the file the header came from.
struct Parsed {
    data_start: u64,
    data_len: u64,
    tensors: Vec<HeaderEntry>,
    /// The save that wrote it ([`SAVE_ID_KEY`] of its `__metadata__`), where one did.
    save_id: Option<String>,
    identity: FileIdentity,
    /// Held open until the load was checked: an open file's inode cannot be reused by a file
    /// that replaces it, so an identity match means the same file.
    _file: std::fs::File,
}

/// Reads and validates the header of `path` with `pread` on one descriptor (never through a
/// mapping: a file truncated meanwhile is an error, not SIGBUS), recording the file's identity
/// (dev, ino, size, mtime) so the load can check that its data came from the same version.
fn parse(path: &Path) -> Result<Parsed> {
    let (file, identity) = gpufeed_os::file::open_regular(path, false)?;
    let bad = |reason: String| Error::Safetensors {
        path: path.into(),
        reason,
    };
    let len = identity.size;
    let mut n = [0u8; 8];
    read_exact_at(&file, &mut n, 0, len).map_err(bad)?;
    let header_len = header_len(u64::from_le_bytes(n), len).map_err(bad)?;
    // The length field again in front of the header, as `header_of` takes it.
    let mut prefix = vec![0u8; 8 + header_len as usize];
    prefix[..8].copy_from_slice(&n);
    read_exact_at(&file, &mut prefix[8..], 8, len).map_err(bad)?;
    let (data_start, tensors, save_id) = header_parts(&prefix, len).map_err(bad)?;
    Ok(Parsed {
        data_start,
        data_len: len - data_start,
        tensors,
        save_id,
        identity,
        _file: file,
    })
}

fn read_exact_at(
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
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Checks the header length `n` read from the first 8 bytes of a file of `file_len` bytes.
fn header_len(n: u64, file_len: u64) -> std::result::Result<u64, String> {
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
fn header_parts(
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
struct Listed(Vec<HeaderEntry>, Option<String>);

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
fn tile(tensors: &mut [HeaderEntry]) -> std::result::Result<usize, String> {
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

/// Loads a safetensors file, or a sharded checkpoint given by its `*.index.json`, into GPU
/// memory: the header is parsed with the `safetensors` crate, each file's data section moves in
/// one bulk transfer (`load_file`'s machinery), and every tensor is a view into its file's
/// device buffer.
///
/// # Errors
/// [`Error::Safetensors`] for a malformed or hostile header (a sentence saying what is wrong),
/// [`Error::Index`] for a bad index, [`Error::FileChangedDuringLoad`] when a file was replaced
/// or modified between reading its header and the end of its load, and the errors of
/// [`crate::load_file`]. The header is read with `pread` on the descriptor whose identity
/// (dev, ino, size, mtime) the load is checked against; no CPU access goes through a mapping
/// of the file.
///
/// # Example
/// ```no_run
/// let gpu = gpufeed::Gpu::open(0)?;
/// let ckpt = gpufeed::safetensors::load(&gpu, "model.safetensors")?;
/// let (info, view) = ckpt.get("lm_head.weight").expect("tensor");
/// println!("{:?} {:?}: {} bytes on the GPU", info.dtype, info.shape, view.len());
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub fn load(gpu: &gpufeed_cuda::Gpu, path: impl AsRef<Path>) -> Result<Checkpoint> {
    let path = path.as_ref();
    let plan = plan(path)?;
    let loader = Loader::for_bytes(gpu, LoadOptions::default(), plan.largest())?;
    load_planned(&loader, path, plan)
}

/// Like [`load`], with a [`Loader`] of your own (options, reuse of staging buffers).
pub fn load_with(loader: &Loader, path: impl AsRef<Path>) -> Result<Checkpoint> {
    let path = path.as_ref();
    load_planned(loader, path, plan(path)?)
}

/// Loads a checkpoint (a file or an index, as [`load`]) onto GPU `ordinal` in one call: the
/// GPU is opened on another thread while this one reads and checks every header and faults in
/// the pinned staging (bounded: [`staging_bytes_for`] the largest file, 128 MiB at most with
/// the default options on 16 cores), which is unregistered and freed before this returns. For
/// a process that loads its weights once at start-up.
///
/// [`staging_bytes_for`]: gpufeed_cuda::TransferConfig::staging_bytes_for
///
/// # Errors
/// The checkpoint's errors (missing file, malformed header, bad index) before the GPU's (no
/// driver, no such device), then [`load`]'s.
///
/// # Example
/// ```no_run
/// let (ckpt, report) = gpufeed::safetensors::load_on(0, "model.safetensors")?;
/// println!(
///     "{} tensors on {}: context {:.0} ms, then {:.0} ms to load {} bytes",
///     ckpt.len(), ckpt.gpu().info().name, report.context_seconds * 1e3,
///     (report.total_seconds - report.context_seconds) * 1e3, report.bytes
/// );
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub fn load_on(
    ordinal: usize,
    path: impl AsRef<Path>,
) -> Result<(Checkpoint, crate::OneShotReport)> {
    let path = path.as_ref();
    let (_, ckpt, report) = crate::load::one_shot(
        ordinal,
        || {
            let plan = plan(path)?;
            let largest = plan.largest();
            Ok((plan, largest))
        },
        |loader, plan| {
            let ckpt = load_planned(loader, path, plan)?;
            let reports = ckpt.reports.clone();
            Ok((ckpt, reports))
        },
    )?;
    Ok((ckpt, report))
}

/// Along which dimension a tensor-parallel load ([`TensorParallel`]) cuts each tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Split {
    /// The first dimension (row-parallel in the usual row-major layout: each rank gets a
    /// contiguous block of rows, one span of the file per tensor).
    Rows,
    /// The second dimension (each rank gets a block of every row: one span per row).
    Columns,
    /// Any dimension.
    Dim(usize),
}

impl Split {
    /// The dimension cut.
    pub fn dim(self) -> usize {
        match self {
            Split::Rows => 0,
            Split::Columns => 1,
            Split::Dim(d) => d,
        }
    }
}

/// One tensor's share on one rank of a [`TensorParallel`] plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorShare {
    /// The tensor's name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// The whole tensor's shape.
    pub shape: Vec<usize>,
    /// The indices along the split dimension this rank holds (`None`: the tensor has no such
    /// dimension and every rank holds all of it, as biases and norms of a row split do).
    pub indices: Option<Range<usize>>,
    /// The bytes of the file, back to back in this order, that make the share.
    pub spans: Vec<Range<u64>>,
    /// Where the share lands in the rank's buffer for the file.
    pub dst: Range<usize>,
}

impl TensorShare {
    /// The share's shape: the tensor's, with the split dimension cut to [`TensorShare::indices`].
    pub fn share_shape(&self, split: Split) -> Vec<usize> {
        let mut shape = self.shape.clone();
        if let Some(ix) = &self.indices {
            shape[split.dim()] = ix.len();
        }
        shape
    }
}

/// A tensor-parallel plan of a checkpoint: for each of `ranks` GPUs, which bytes of which
/// file make its slice of every tensor, cut along one dimension ([`Split`]). Indices are
/// shared out as `numpy.array_split` does: with `n` indices and `r` ranks, the first `n % r`
/// ranks get `n / r + 1`, the others `n / r`. A tensor without the split dimension goes whole
/// to every rank. Each rank's shares of a file land back to back in one device buffer per
/// file; [`load_shard`] loads one rank's (one process per GPU), `MultiLoader::
/// load_tensor_parallel` every rank's at once.
///
/// # Example
/// ```no_run
/// use gpufeed::safetensors::{Split, TensorParallel};
/// let plan = TensorParallel::plan("model.safetensors", 2, Split::Columns)?;
/// for rank in 0..plan.ranks() {
///     println!("rank {rank}: {} bytes", plan.bytes(rank));
/// }
/// # Ok::<(), gpufeed::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct TensorParallel {
    split: Split,
    files: Vec<PathBuf>,
    identities: Vec<FileIdentity>,
    /// `[rank][file]`: the rank's shares of the file's tensors, in header order.
    shares: Vec<Vec<Vec<TensorShare>>>,
}

impl TensorParallel {
    /// Plans the checkpoint `path` (a file or an index, as [`load`]) for `ranks` GPUs.
    ///
    /// # Errors
    /// [`load`]'s header and index errors; [`Error::InvalidSetting`] for no ranks, or a
    /// sub-byte dtype (F4, F6) whose cut would not fall on a byte boundary.
    pub fn plan(path: impl AsRef<Path>, ranks: usize, split: Split) -> Result<Self> {
        if ranks == 0 {
            return Err(Error::InvalidSetting(
                "a tensor-parallel plan needs at least one rank".into(),
            ));
        }
        let planned = plan(path.as_ref())?;
        let mut files = Vec::new();
        let mut identities = Vec::new();
        let mut shares = vec![Vec::new(); ranks];
        for (file, parsed) in planned.files {
            let mut per_rank = vec![(Vec::new(), 0usize); ranks];
            for (name, dtype, shape, range) in &parsed.tensors {
                let bytes =
                    parsed.data_start + range.start as u64..parsed.data_start + range.end as u64;
                for (rank, (list, at)) in per_rank.iter_mut().enumerate() {
                    let (indices, spans) =
                        cut(name, *dtype, shape, bytes.clone(), split.dim(), rank, ranks)?;
                    let len: u64 = spans.iter().map(|s| s.end - s.start).sum();
                    list.push(TensorShare {
                        name: name.clone(),
                        dtype: *dtype,
                        shape: shape.clone(),
                        indices,
                        spans,
                        dst: *at..*at + len as usize,
                    });
                    *at += len as usize;
                }
            }
            for (rank, (list, _)) in per_rank.into_iter().enumerate() {
                shares[rank].push(list);
            }
            identities.push(parsed.identity);
            files.push(file);
        }
        Ok(TensorParallel {
            split,
            files,
            identities,
            shares,
        })
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.shares.len()
    }

    /// The dimension cut.
    pub fn split(&self) -> Split {
        self.split
    }

    /// The checkpoint's files, in order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Rank `rank`'s shares of file `file`'s tensors (empty for an index past the end).
    pub fn shares(&self, rank: usize, file: usize) -> &[TensorShare] {
        self.shares
            .get(rank)
            .and_then(|r| r.get(file))
            .map_or(&[], Vec::as_slice)
    }

    /// The bytes of file `file` rank `rank` reads, back to back, adjacent spans merged.
    pub fn spans(&self, rank: usize, file: usize) -> Vec<Range<u64>> {
        let mut out: Vec<Range<u64>> = Vec::new();
        for s in self.shares(rank, file).iter().flat_map(|t| &t.spans) {
            match out.last_mut() {
                Some(last) if last.end == s.start => last.end = s.end,
                _ => out.push(s.clone()),
            }
        }
        out
    }

    /// Bytes rank `rank` holds, all files together.
    pub fn bytes(&self, rank: usize) -> u64 {
        (0..self.files.len())
            .flat_map(|f| self.shares(rank, f))
            .map(|t| t.dst.len() as u64)
            .sum()
    }

    /// Checks that no file changed since its header was read.
    fn unchanged(&self) -> Result<()> {
        for (file, identity) in self.files.iter().zip(&self.identities) {
            crate::load::check_unchanged(file, identity)?;
        }
        Ok(())
    }
}

/// A share of a tensor: its indices along the split dimension (`None`: all, no such dimension)
/// and the file's bytes that hold them.
type Share = (Option<Range<usize>>, Vec<Range<u64>>);

/// Rank `rank` of `ranks`'s indices along dimension `dim` of a tensor of `shape`, and the
/// bytes of the file (the tensor's data at `bytes`) that hold them.
fn cut(
    name: &str,
    dtype: Dtype,
    shape: &[usize],
    bytes: Range<u64>,
    dim: usize,
    rank: usize,
    ranks: usize,
) -> Result<Share> {
    let whole = if bytes.is_empty() {
        vec![]
    } else {
        vec![bytes.clone()]
    };
    if dim >= shape.len() {
        return Ok((None, whole));
    }
    let n = shape[dim];
    let (base, extra) = (n / ranks, n % ranks);
    let lo = rank * base + rank.min(extra);
    let count = base + usize::from(rank < extra);
    if count == n {
        // One rank, or a dimension of one index given to this rank: the tensor in one span.
        return Ok((Some(0..n), whole));
    }
    if count == 0 {
        return Ok((Some(lo..lo), vec![]));
    }
    let outer: u64 = shape[..dim].iter().map(|&d| d as u64).product();
    let inner_bits =
        shape[dim + 1..].iter().map(|&d| d as u64).product::<u64>() * dtype.bitsize() as u64;
    if !inner_bits.is_multiple_of(8) {
        return Err(Error::InvalidSetting(format!(
            "tensor {name} ({dtype:?}, shape {shape:?}) cannot be cut along dimension {dim}: \
             its slices would not start on a byte boundary; cut another dimension"
        )));
    }
    let inner = inner_bits / 8;
    let row = n as u64 * inner;
    let (from, len) = (lo as u64 * inner, count as u64 * inner);
    let spans = (0..outer)
        .map(|o| bytes.start + o * row + from..bytes.start + o * row + from + len)
        .filter(|s| !s.is_empty())
        .collect();
    Ok((Some(lo..lo + count), spans))
}

/// Loads rank `rank`'s shares of a [`TensorParallel`] plan with `loader` (one process per
/// GPU, each loading its own rank): one device buffer per file of the checkpoint, the shares
/// back to back, each tensor named as in the checkpoint with its share's shape
/// ([`TensorShare::share_shape`]).
///
/// # Errors
/// [`Error::InvalidSetting`] for a rank outside the plan; [`load`]'s errors, and
/// [`Error::FileChangedDuringLoad`] when a file changed after the plan read its header.
///
/// # Example
/// ```no_run
/// use gpufeed::safetensors::{Split, TensorParallel, load_shard};
/// let rank: usize = std::env::var("LOCAL_RANK").map_or(0, |r| r.parse().unwrap_or(0));
/// let plan = TensorParallel::plan("model.safetensors", 2, Split::Rows)?;
/// let loader = gpufeed::Loader::open(rank, gpufeed::LoadOptions::default())?;
/// let shard = load_shard(&loader, &plan, rank)?;
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub fn load_shard(loader: &Loader, plan: &TensorParallel, rank: usize) -> Result<Checkpoint> {
    if rank >= plan.ranks() {
        return Err(Error::InvalidSetting(format!(
            "rank {rank} of a plan for {} ranks; use 0..{}",
            plan.ranks(),
            plan.ranks()
        )));
    }
    let mut ckpt = Checkpoint {
        gpu: loader.gpu().clone(),
        files: plan.files.clone(),
        buffers: Vec::new(),
        tensors: BTreeMap::new(),
        reports: Vec::new(),
    };
    for (i, file) in plan.files.iter().enumerate() {
        let spans = plan.spans(rank, i);
        let (buffer, report) = loader.load_spans(file, &spans)?;
        for share in plan.shares(rank, i) {
            ckpt.tensors.insert(
                share.name.clone(),
                TensorInfo {
                    dtype: share.dtype,
                    shape: share.share_shape(plan.split),
                    file: i,
                    range: share.dst.clone(),
                },
            );
        }
        ckpt.buffers.push(buffer);
        ckpt.reports.push(report);
    }
    plan.unchanged()?;
    Ok(ckpt)
}

/// One file of a checkpoint as its header describes it ([`inspect`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileLayout {
    /// The file.
    pub path: PathBuf,
    /// Where its data section starts: the 8-byte length plus the header.
    pub data_start: u64,
    /// Bytes of its data section (what a load moves).
    pub data_bytes: u64,
    /// Its tensors, sorted by name: name, dtype, shape, byte range in the data section.
    pub tensors: Vec<HeaderEntry>,
}

/// Reads and checks the headers of a safetensors file or of the shards of an index, exactly as
/// [`load`] does before a byte moves, without a GPU: for tools that describe or verify a
/// checkpoint, and to find a bad file before opening a GPU.
///
/// # Errors
/// [`load`]'s header and index errors.
///
/// # Example
/// ```no_run
/// for file in gpufeed::safetensors::inspect("model.safetensors.index.json")? {
///     println!("{}: {} tensors, {} bytes", file.path.display(), file.tensors.len(), file.data_bytes);
/// }
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub fn inspect(path: impl AsRef<Path>) -> Result<Vec<FileLayout>> {
    Ok(plan(path.as_ref())?
        .files
        .into_iter()
        .map(|(path, parsed)| FileLayout {
            path,
            data_start: parsed.data_start,
            data_bytes: parsed.data_len,
            tensors: parsed.tensors,
        })
        .collect())
}

/// A checkpoint whose tensors are loaded one at a time, when asked, as safetensors'
/// `safe_open(...).get_tensor(name)` does: every file registered once ([`RegisteredFile`]),
/// each tensor then one copy by the GPU out of the page cache into memory of its own — for
/// weights streamed in on demand (experts of a mixture of experts, layers offloaded between
/// uses). Opening reads and checks every header as [`load`] does and registers the files
/// (about 40 ms per GiB on the H200 machine, reading what is not cached); the files' pages
/// stay page-locked until the value is dropped.
///
/// # Example
/// ```no_run
/// let loader = gpufeed::Loader::open(0, gpufeed::LoadOptions::default())?;
/// let ckpt = gpufeed::safetensors::OnDemand::open(&loader, "model.safetensors.index.json")?;
/// let (bytes, info) = ckpt.load(&loader, "model.layers.0.mlp.experts.3.w1.weight")?;
/// println!("{:?} {:?}: {} bytes on the GPU", info.dtype, info.shape, bytes.len());
/// # Ok::<(), gpufeed::Error>(())
/// ```
#[derive(Debug)]
pub struct OnDemand {
    files: Vec<RegisteredFile>,
    /// Per tensor: dtype, shape, the file, and the byte range in that file.
    tensors: BTreeMap<String, TensorInfo>,
}

impl OnDemand {
    /// Reads and checks the headers of `path` (a file, or the shards of an index) and registers
    /// each file with `loader`'s context (portable: any loader may load from it after).
    ///
    /// # Errors
    /// [`load`]'s header and index errors, before anything is registered; then
    /// [`RegisteredFile::open`]'s; [`Error::FileChangedDuringLoad`] where a file changed
    /// between its header and its registration.
    pub fn open(loader: &Loader, path: impl AsRef<Path>) -> Result<Self> {
        let plan = plan(path.as_ref())?;
        let mut files = Vec::with_capacity(plan.files.len());
        let mut tensors = BTreeMap::new();
        for (i, (path, parsed)) in plan.files.into_iter().enumerate() {
            let file = RegisteredFile::open(loader, &path)?;
            if let Some(what) = file
                .identity()
                .and_then(|now| parsed.identity.difference(&now))
            {
                return Err(Error::FileChangedDuringLoad { path, what });
            }
            for (name, dtype, shape, range) in parsed.tensors {
                let start = parsed.data_start as usize;
                let info = TensorInfo {
                    dtype,
                    shape,
                    file: i,
                    range: start + range.start..start + range.end,
                };
                tensors.insert(name, info);
            }
            files.push(file);
        }
        Ok(OnDemand { files, tensors })
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Facts of the tensor `name`; its `range` is the tensor's bytes in its file.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// How many tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether it holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The files, in the order [`TensorInfo::file`] counts them.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(RegisteredFile::path)
    }

    /// The tensor `name` in new GPU memory of its own, loaded by `loader` (of any GPU), with
    /// its facts.
    ///
    /// # Errors
    /// [`Error::Safetensors`] for a name the checkpoint lacks;
    /// [`Loader::load_registered`]'s ([`Error::RegisteredFileChanged`] where the file
    /// changed since it was opened).
    pub fn load(&self, loader: &Loader, name: &str) -> Result<(DeviceBuffer, &TensorInfo)> {
        let info = self.tensors.get(name).ok_or_else(|| Error::Safetensors {
            path: self
                .files
                .first()
                .map(|f| f.path().into())
                .unwrap_or_default(),
            reason: format!("no tensor named {name:?} in the checkpoint"),
        })?;
        let range = info.range.start as u64..info.range.end as u64;
        let (buf, _) = loader.load_registered(&self.files[info.file], range)?;
        Ok((buf, info))
    }
}

/// Whether `path` names a safetensors checkpoint by its name: `*.safetensors`, or an index
/// `*.safetensors.index.json`.
pub fn is_checkpoint_name(path: impl AsRef<Path>) -> bool {
    let name = path.as_ref().to_string_lossy();
    name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json")
}

/// The files of a checkpoint with their parsed headers, before any byte moves.
struct Plan {
    files: Vec<(PathBuf, Parsed)>,
}

impl Plan {
    /// The largest data section: the most one load moves.
    fn largest(&self) -> u64 {
        self.files.iter().map(|f| f.1.data_len).max().unwrap_or(0)
    }
}

/// Reads and checks the headers of `path` (a file, or the shards of an index).
fn plan(path: &Path) -> Result<Plan> {
    let index = if path.to_string_lossy().ends_with(".json") {
        shards(path)?
    } else {
        Index {
            files: vec![(path.to_path_buf(), None)],
            save: None,
        }
    };
    let is_index = index.files.iter().any(|f| f.1.is_some());
    let mut planned = Vec::with_capacity(index.files.len());
    for (file, expected) in index.files {
        let parsed = parse(&file)?;
        if let Some(expected) = &expected {
            for name in expected {
                if !parsed.tensors.iter().any(|t| &t.0 == name) {
                    return Err(Error::Index {
                        path: path.into(),
                        reason: format!(
                            "{name} is mapped to {} but that file does not hold it",
                            file.display()
                        ),
                    });
                }
            }
        }
        planned.push((file, parsed));
    }
    if is_index {
        check_one_save(path, index.save.as_ref(), &planned)?;
    }
    Ok(Plan { files: planned })
}

/// Checks that the shards of the index `index` are all of one save: of the save the index
/// records (its id in each shard's header, each shard's size as recorded), or, for an index
/// that records none (one not written by gpufeed), that the shards that carry a save id all
/// carry the same one.
fn check_one_save(
    index: &Path,
    save: Option<&IndexSave>,
    files: &[(PathBuf, Parsed)],
) -> Result<()> {
    let (index_save, mut wrong) = match save {
        Some(save) => {
            let mut wrong = Vec::new();
            for (file, parsed) in files {
                let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
                let why = match (
                    &parsed.save_id,
                    name.and_then(|n| save.sizes.get(&n).copied()),
                ) {
                    (Some(id), _) if *id != save.id => Some(format!("written by save {id}")),
                    (None, _) => Some("written by no recorded save".to_owned()),
                    (_, Some(size)) if size != parsed.identity.size => Some(format!(
                        "{} bytes where the index records {size}",
                        parsed.identity.size
                    )),
                    _ => None,
                };
                wrong.extend(why.map(|w| (file.clone(), w)));
            }
            (save.id.clone(), wrong)
        }
        None => {
            let mut ids = files
                .iter()
                .filter_map(|(f, p)| Some((f, p.save_id.as_ref()?)));
            let Some((_, first)) = ids.next() else {
                return Ok(());
            };
            let wrong: Vec<_> = files
                .iter()
                .filter_map(|(f, p)| {
                    let id = p.save_id.as_ref()?;
                    (id != first).then(|| (f.clone(), format!("written by save {id}")))
                })
                .collect();
            if wrong.is_empty() {
                return Ok(());
            }
            (format!("none recorded; {first} by the first shard"), wrong)
        }
    };
    if wrong.is_empty() {
        return Ok(());
    }
    wrong.sort();
    Err(Error::MixedCheckpoint {
        index: index.into(),
        index_save,
        files: wrong,
    })
}

/// Loads the data sections of a planned checkpoint, one bulk transfer per file.
fn load_planned(loader: &Loader, path: &Path, plan: Plan) -> Result<Checkpoint> {
    let (mut layouts, mut buffers, mut reports) = (Vec::new(), Vec::new(), Vec::new());
    for (file, parsed) in plan.files {
        let (buffer, report) = loader.load_range(
            &file,
            parsed.data_start..parsed.data_start + parsed.data_len,
        )?;
        // The data must come from the version of the file whose header we read: a writer
        // replacing or rewriting it meanwhile would pair one file's header with another's bytes.
        crate::load::check_unchanged(&file, &parsed.identity)?;
        layouts.push(FileLayout {
            path: file,
            data_start: parsed.data_start,
            data_bytes: parsed.data_len,
            tensors: parsed.tensors,
        });
        buffers.push(buffer);
        reports.push(report);
    }
    let mut ckpt = Checkpoint::from_layouts(path, loader.gpu().clone(), &layouts, buffers)?;
    ckpt.reports = reports;
    Ok(ckpt)
}

/// The metadata key, in each shard's header and in the index, of the save that wrote a sharded
/// checkpoint ([`save_sharded`]): a random id per save.
pub const SAVE_ID_KEY: &str = "gpufeed_save_id";

/// The index metadata key of the shard files' sizes (`{"file": bytes}`), written by
/// [`save_sharded`].
pub const FILE_SIZES_KEY: &str = "gpufeed_file_sizes";

/// What an index says of its shards.
struct Index {
    /// Each shard file, with the tensors the index maps to it.
    files: Vec<(PathBuf, Option<Vec<String>>)>,
    /// The save that wrote the shards, where the index records one.
    save: Option<IndexSave>,
}

/// The save an index records ([`SAVE_ID_KEY`], [`FILE_SIZES_KEY`]).
struct IndexSave {
    id: String,
    sizes: BTreeMap<String, u64>,
}

/// The shard files of an index (`{"weight_map": {"tensor": "file", ...}}`), each with the
/// tensors the index maps to it, and the save it records.
fn shards(index: &Path) -> Result<Index> {
    let bad = |reason: String| Error::Index {
        path: index.into(),
        reason,
    };
    // Missing, a directory, a FIFO, unreadable: the one helper's clear errors.
    let (mut file, _) = gpufeed_os::file::open_regular(index, false)?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut file, &mut text)
        .map_err(|e| bad(format!("cannot be read as text: {e}")))?;
    shards_of(&text, index)
}

/// [`shards`] of an index's text (untrusted: property-tested).
fn shards_of(text: &str, index: &Path) -> Result<Index> {
    let bad = |reason: String| Error::Index {
        path: index.into(),
        reason,
    };
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("{tensor}: file name is not a string")))?;
        // One plain file name: no directories, no "." or "..", nothing empty.
        let mut parts = Path::new(file).components();
        let plain = matches!(
            (parts.next(), parts.next()),
            (Some(std::path::Component::Normal(n)), None) if n == file
        );
        if !plain {
            return Err(bad(format!(
                "{tensor}: shard name {file:?} leaves the checkpoint's directory"
            )));
        }
        by_file
            .entry(file.to_owned())
            .or_default()
            .push(tensor.clone());
    }
    if by_file.is_empty() {
        return Err(bad("the weight map is empty".into()));
    }
    let metadata = json.get("metadata");
    let save = match metadata.and_then(|m| m.get(SAVE_ID_KEY)) {
        None => None,
        Some(id) => {
            let id = id
                .as_str()
                .ok_or_else(|| bad(format!("metadata.{SAVE_ID_KEY} is not a string")))?;
            let mut sizes = BTreeMap::new();
            if let Some(recorded) = metadata.and_then(|m| m.get(FILE_SIZES_KEY)) {
                let recorded = recorded
                    .as_object()
                    .ok_or_else(|| bad(format!("metadata.{FILE_SIZES_KEY} is not an object")))?;
                for (file, size) in recorded {
                    let size = size.as_u64().ok_or_else(|| {
                        bad(format!(
                            "metadata.{FILE_SIZES_KEY}.{file} is not a byte count"
                        ))
                    })?;
                    sizes.insert(file.clone(), size);
                }
            }
            Some(IndexSave {
                id: id.to_owned(),
                sizes,
            })
        }
    };
    Ok(Index {
        files: by_file
            .into_iter()
            .map(|(f, names)| (dir.join(f), Some(names)))
            .collect(),
        save,
    })
}

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
fn tensor_bytes(t: &SaveTensor<'_>) -> Result<usize> {
    let bad = |why: String| Error::InvalidSetting(format!("tensor {:?}: {why}", t.name));
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
fn save_head(
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
            return Err(Error::InvalidSetting(format!(
                "tensor {:?} is given twice",
                t.name
            )));
        }
        offset += len;
    }
    let mut json = serde_json::to_vec(&map)
        .map_err(|e| Error::InvalidSetting(format!("the header cannot be written: {e}")))?;
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
/// [`Error::InvalidSetting`] for a tensor whose bytes do not match its dtype and shape, a
/// duplicate or reserved name; then [`Saver::save_file`]'s.
///
/// # Example
/// ```
/// use gpufeed::safetensors::{Dtype, SaveTensor, save};
/// use gpufeed::{Piece, SaveOptions, Saver};
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
    saver.save_pieces(&head, &pieces, path.as_ref())
}

/// Saves `tensors` as shards of at most `max_shard_bytes` of data each (a tensor larger than
/// that gets a shard of its own) in `dir`, and the index `<prefix>.safetensors.index.json`
/// (`metadata.total_size`, `weight_map`) last. Returns one report per shard; load it back with
/// [`load`] on the index.
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
/// [`load`], [`inspect`] and the other readers of an index refuse a set of files of different
/// saves with [`Error::MixedCheckpoint`] naming the files.
///
/// # Example
/// ```
/// use gpufeed::safetensors::{Dtype, SaveTensor, inspect, save_sharded};
/// use gpufeed::{Piece, SaveOptions, Saver};
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
    let outcome = (|| {
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
            .map_err(|e| Error::InvalidSetting(format!("the index cannot be written: {e}")))?;
        // The one switch from the old save to the new.
        saver.save_bytes(&text, &index_path)
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
struct DirLock {
    /// Held open: the lock lives as long as the descriptor.
    _dir: std::fs::File,
}

impl DirLock {
    fn acquire(dir: &Path) -> Result<Self> {
        use rustix::fs::FlockOperation;
        let file =
            std::fs::File::open(dir).map_err(|e| Error::Os(gpufeed_os::Error::open(dir, e)))?;
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
fn new_save_id() -> String {
    use std::hash::BuildHasher;
    let random = std::collections::hash_map::RandomState::new()
        .hash_one((std::process::id(), std::time::SystemTime::now()));
    format!("{random:016x}")
}

/// The shard names of a save of `n` shards: `<prefix>-0000i-of-0000N.safetensors` where no
/// file of any of those names is in `dir`, else with the save's id after the prefix (names no
/// earlier save used).
fn shard_names(dir: &Path, prefix: &str, n: usize, save_id: &str) -> Vec<String> {
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
fn unnamed_shards(dir: &Path, prefix: &str) -> Vec<PathBuf> {
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
fn shard_suffix_id(rest: &str) -> Option<Option<&str>> {
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
fn remove_shard(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(
            path = %path.display(),
            "could not remove a shard no index names: {e}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_headers_are_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cases: [(&str, Vec<u8>); 5] = [
            ("short", vec![1, 2, 3]),
            ("huge length", u64::MAX.to_le_bytes().to_vec()),
            (
                "past the end",
                [100u64.to_le_bytes().to_vec(), b"{}".to_vec()].concat(),
            ),
            (
                "not json",
                [4u64.to_le_bytes().to_vec(), b"{{{{".to_vec()].concat(),
            ),
            ("offsets outside", {
                let h = br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,1000]}}"#;
                [
                    (h.len() as u64).to_le_bytes().to_vec(),
                    h.to_vec(),
                    vec![0u8; 16],
                ]
                .concat()
            }),
        ];
        for (what, bytes) in cases {
            let p = dir.path().join(format!("{what}.safetensors"));
            std::fs::write(&p, &bytes).expect("write");
            let err = parse(&p)
                .err()
                .unwrap_or_else(|| panic!("{what}: accepted"));
            assert!(matches!(err, Error::Safetensors { .. }), "{what}: {err:?}");
            // A sentence, not the crate's Debug output.
            let msg = err.to_string();
            for debug in [
                "HeaderTooLarge",
                "HeaderTooSmall",
                "InvalidHeaderLength",
                "MetadataIncompleteBuffer",
                "InvalidOffset(",
                "TensorInvalidInfo",
            ] {
                assert!(!msg.contains(debug), "{what}: {msg}");
            }
            assert!(
                msg.contains(&*p.to_string_lossy()),
                "{what}: names the file: {msg}"
            );
        }
        // Files that are not regular files are refused before any read.
        assert!(matches!(
            parse(Path::new("/proc/self/status")),
            Err(Error::Os(gpufeed_os::Error::PseudoFile { .. }))
        ));
        assert!(matches!(
            parse(dir.path()),
            Err(Error::Os(gpufeed_os::Error::IsDirectory { .. }))
        ));
    }

    /// The header is parsed from a prefix and the file's length: what follows the header is
    /// never read, so a file whose data section is missing is refused by length, and the
    /// same bytes with the right length parse.
    #[test]
    fn headers_parse_from_a_prefix_and_the_file_length() {
        let h = br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
        let prefix = [(h.len() as u64).to_le_bytes().to_vec(), h.to_vec()].concat();
        let full_len = prefix.len() as u64 + 16;
        let (start, tensors) = header_of(&prefix, full_len).expect("parse");
        assert_eq!(start, prefix.len() as u64);
        assert_eq!(tensors[0].3, 0..16);
        let err = header_of(&prefix, full_len - 1).unwrap_err();
        assert!(
            err.contains("cover 16 bytes but the data section has 15"),
            "{err}"
        );
        let err = header_of(&prefix[..20], full_len).unwrap_err();
        assert!(err.contains("cut short"), "{err}");
    }

    proptest::proptest! {
        /// Any bytes and any claimed file length: tensors inside the data section, or a
        /// sentence; never a panic (the CI form of the fuzz target).
        #[test]
        fn arbitrary_headers_never_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            extra in 0u64..1000,
        ) {
            let file_len = bytes.len() as u64 + extra;
            if let Ok((start, tensors)) = header_of(&bytes, file_len) {
                for (_, _, _, r) in tensors {
                    proptest::prop_assert!(r.start <= r.end && start + r.end as u64 <= file_len);
                }
            }
        }

        /// Any index text, and weight maps of arbitrary names: shard files inside the index's
        /// directory, or an error; never a panic.
        #[test]
        fn arbitrary_indexes_never_panic(
            text in ".{0,200}",
            names in proptest::collection::vec(("[a-z.]{1,8}", "[a-z./]{0,12}"), 0..6),
        ) {
            let dir = Path::new("/ckpt");
            let index = dir.join("model.safetensors.index.json");
            let map: serde_json::Map<String, serde_json::Value> = names
                .into_iter()
                .map(|(t, f)| (t, serde_json::Value::String(f)))
                .collect();
            let structured = serde_json::json!({ "weight_map": map }).to_string();
            for t in [text.as_str(), structured.as_str()] {
                if let Ok(parsed) = shards_of(t, &index) {
                    proptest::prop_assert!(!parsed.files.is_empty());
                    for (f, _) in parsed.files {
                        proptest::prop_assert_eq!(f.parent(), Some(dir));
                    }
                }
            }
        }

        /// The one-pass parser accepts exactly the headers the `safetensors` crate's `Metadata`
        /// accepts (data sections of the length the tensors cover), with the same tensors;
        /// headers that name a tensor twice, which the crate reads as the last one, it refuses.
        #[test]
        fn the_parser_agrees_with_the_safetensors_crate(
            tensors in proptest::collection::vec(
                ("[ab]{1,3}", 0usize..5, proptest::collection::vec(0usize..4, 0..3), 0u8..8),
                0..7,
            ),
            metadata in proptest::prelude::any::<bool>(),
            bad_metadata in proptest::prelude::any::<bool>(),
        ) {
            let dtypes = ["BOOL", "U8", "F16", "F32", "F64", "F4", "NOPE"];
            let mut at = 0usize;
            let mut fields = Vec::new();
            if metadata {
                fields.push(if bad_metadata {
                    r#""__metadata__":{"k":1}"#.to_owned()
                } else {
                    r#""__metadata__":{"format":"pt"}"#.to_owned()
                });
            }
            for (name, dtype, shape, skew) in &tensors {
                let dtype = dtypes[*dtype % dtypes.len()];
                let bits: usize = shape.iter().product::<usize>()
                    * match dtype { "F16" => 16, "F32" => 32, "F64" => 64, "F4" => 4, _ => 8 };
                // skew 0..=5 tiles exactly; 6 and 7 leave a gap or a short span.
                let len = bits.div_ceil(8) + usize::from(*skew == 7);
                let start = at + usize::from(*skew == 6);
                fields.push(format!(
                    r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{start},{}]}}"#,
                    start + len
                ));
                at = start + len;
            }
            let json = format!("{{{}}}", fields.join(","));
            let prefix = [(json.len() as u64).to_le_bytes().to_vec(), json.clone().into_bytes()].concat();
            let file_len = prefix.len() as u64 + at as u64;
            let ours = header_of(&prefix, file_len);
            let names: std::collections::BTreeSet<&String> = tensors.iter().map(|t| &t.0).collect();
            if names.len() < tensors.len() {
                proptest::prop_assert!(ours.is_err(), "a repeated name was accepted: {}", json);
            } else {
                let theirs = serde_json::from_str::<safetensors::tensor::Metadata>(&json)
                    .ok()
                    .filter(|m| m.data_len() == at);
                match (ours, theirs) {
                    (Ok((_, ours)), Some(m)) => {
                        let mut want: Vec<HeaderEntry> = m
                            .tensors()
                            .into_iter()
                            .map(|(n, i)| (n, i.dtype, i.shape.clone(), i.data_offsets.0..i.data_offsets.1))
                            .collect();
                        want.sort_by(|x, y| x.0.cmp(&y.0));
                        proptest::prop_assert_eq!(ours, want);
                    }
                    (Err(_), None) => {}
                    (ours, theirs) => proptest::prop_assert!(
                        false, "{}: ours {:?}, the crate's {}", json, ours, theirs.is_some()
                    ),
                }
            }
        }

        /// Valid headers with one byte changed, or a JSON value spliced in.
        #[test]
        fn mutated_headers_never_panic(at in 0usize..80, val in proptest::prelude::any::<u8>(), n in 1usize..6) {
            let json = format!(
                r#"{{"t":{{"dtype":"F16","shape":[{n},2],"data_offsets":[0,{}]}}}}"#,
                n * 4
            );
            let mut bytes = [(json.len() as u64).to_le_bytes().to_vec(), json.into_bytes()].concat();
            let file_len = bytes.len() as u64 + (n as u64) * 4;
            if at < bytes.len() {
                bytes[at] = val;
            }
            let _ = header_of(&bytes, file_len);
        }
    }

    #[test]
    fn headers_written_by_the_crate_parse() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("ok.safetensors");
        let a = vec![1u8; 12];
        let b = vec![2u8; 6];
        let views = [
            (
                "a",
                safetensors::tensor::TensorView::new(Dtype::F32, vec![3], &a).expect("view"),
            ),
            (
                "b",
                safetensors::tensor::TensorView::new(Dtype::I16, vec![3], &b).expect("view"),
            ),
        ];
        safetensors::serialize_to_file(views, None, &p).expect("serialize");
        let parsed = parse(&p).expect("parse");
        assert_eq!(parsed.tensors.len(), 2);
        assert_eq!(parsed.data_len, 18);
        assert_eq!(parsed.tensors[1].0, "b");
        assert_eq!(parsed.tensors[1].2, vec![3]);
    }

    #[test]
    fn bad_indexes() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (what, text) in [
            ("not json", "{"),
            ("no map", "{}"),
            ("escape", r#"{"weight_map":{"a":"../x.safetensors"}}"#),
            ("the directory itself", r#"{"weight_map":{"a":"."}}"#),
            (
                "a subdirectory",
                r#"{"weight_map":{"a":"sub/x.safetensors"}}"#,
            ),
            ("empty", r#"{"weight_map":{}}"#),
            ("number", r#"{"weight_map":{"a":3}}"#),
        ] {
            let p = dir.path().join("model.safetensors.index.json");
            std::fs::write(&p, text).expect("write");
            assert!(matches!(shards(&p), Err(Error::Index { .. })), "{what}");
        }
    }
}
