//! Tensor parallelism: each rank's share of every tensor ([`TensorParallel`], cut along any
//! dimension) and [`load_shard`], which reads only that share.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpufeed_load::Loader;
use safetensors::Dtype;

use crate::checkpoint::{Checkpoint, TensorInfo};
use crate::error::{Error, Result};
use crate::header::HeaderEntry;
use crate::index::plan;
use crate::source::{PrefetchSource, merge_adjacent};

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
/// A plan keeps the checkpoint's files open (the descriptors its headers were read on, which
/// every rank's load reads through, shared by its clones): drop it once the loads are done.
///
/// # Example
/// ```no_run
/// use gpufeed_safetensors::{Split, TensorParallel};
/// let plan = TensorParallel::plan("model.safetensors", 2, Split::Columns)?;
/// for rank in 0..plan.ranks() {
///     println!("rank {rank}: {} bytes", plan.bytes(rank));
/// }
/// # Ok::<(), gpufeed_safetensors::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct TensorParallel {
    pub(crate) split: Split,
    pub(crate) files: Vec<PathBuf>,
    /// The files as opened when their headers were read (every rank's load reads through
    /// these descriptors), or the objects at the versions their headers came from.
    pub(crate) opened: Vec<Arc<PrefetchSource>>,
    /// `[rank][file]`: the rank's shares of the file's tensors, in header order.
    pub(crate) shares: Vec<Vec<Vec<TensorShare>>>,
}

impl TensorParallel {
    /// Plans the checkpoint `path` (a file or an index, as [`load`](crate::load)) for `ranks` GPUs.
    ///
    /// # Errors
    /// [`load`](crate::load)'s header and index errors; [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for no ranks, or a
    /// sub-byte dtype (F4, F6) whose cut would not fall on a byte boundary.
    pub fn plan(path: impl AsRef<Path>, ranks: usize, split: Split) -> Result<Self> {
        check_ranks(ranks)?;
        let planned = plan(path.as_ref())?;
        let mut files = Vec::new();
        let mut opened = Vec::new();
        let mut shares = vec![Vec::new(); ranks];
        for (file, parsed) in planned.files {
            for (rank, list) in shares_of(&parsed.tensors, parsed.data_start, split, ranks)?
                .into_iter()
                .enumerate()
            {
                shares[rank].push(list);
            }
            opened.push(Arc::new(PrefetchSource::File(parsed.file)));
            files.push(file);
        }
        Ok(TensorParallel {
            split,
            files,
            opened,
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
        merge_adjacent(
            self.shares(rank, file)
                .iter()
                .flat_map(|t| t.spans.iter().cloned()),
        )
    }

    /// Bytes rank `rank` holds, all files together.
    pub fn bytes(&self, rank: usize) -> u64 {
        (0..self.files.len())
            .flat_map(|f| self.shares(rank, f))
            .map(|t| t.dst.len() as u64)
            .sum()
    }
}

/// A plan needs at least one rank.
pub(crate) fn check_ranks(ranks: usize) -> Result<()> {
    if ranks == 0 {
        return Err(Error::invalid(
            "a tensor-parallel plan needs at least one rank".into(),
        ));
    }
    Ok(())
}

/// Every rank's shares (`[rank]`) of one file's `tensors`, its data section at `data_start`,
/// each rank's shares back to back in header order.
pub(crate) fn shares_of(
    tensors: &[HeaderEntry],
    data_start: u64,
    split: Split,
    ranks: usize,
) -> Result<Vec<Vec<TensorShare>>> {
    let mut per_rank = vec![(Vec::new(), 0usize); ranks];
    for HeaderEntry {
        name,
        dtype,
        shape,
        range,
    } in tensors
    {
        let bytes = data_start + range.start as u64..data_start + range.end as u64;
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
    Ok(per_rank.into_iter().map(|(list, _)| list).collect())
}

/// A share of a tensor: its indices along the split dimension (`None`: all, no such dimension)
/// and the file's bytes that hold them.
pub(crate) type Share = (Option<Range<usize>>, Vec<Range<u64>>);

/// Rank `rank` of `ranks`'s indices along dimension `dim` of a tensor of `shape`, and the
/// bytes of the file (the tensor's data at `bytes`) that hold them.
pub(crate) fn cut(
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
        return Err(Error::invalid(format!(
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
/// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for a rank outside the plan; [`load`](crate::load)'s errors, and
/// [`Error::FileChangedDuringLoad`](gpufeed_load::Error::FileChangedDuringLoad) when a file changed after the plan read its header; for a plan of
/// a bucket (`TensorParallel::plan_object`, the `object` feature) the objects' errors (`gpufeed_load::Error::Object`:
/// an object replaced since the plan read its header, a request that failed).
///
/// # Example
/// ```no_run
/// use gpufeed_safetensors::{Split, TensorParallel, load_shard};
/// let rank: usize = std::env::var("LOCAL_RANK").map_or(0, |r| r.parse().unwrap_or(0));
/// let plan = TensorParallel::plan("model.safetensors", 2, Split::Rows)?;
/// let loader = gpufeed_load::Loader::open(rank, gpufeed_load::LoadOptions::default())?;
/// let shard = load_shard(&loader, &plan, rank)?;
/// # Ok::<(), gpufeed_safetensors::Error>(())
/// ```
pub fn load_shard(loader: &Loader, plan: &TensorParallel, rank: usize) -> Result<Checkpoint> {
    if rank >= plan.ranks() {
        return Err(Error::invalid(format!(
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
    for i in 0..plan.files.len() {
        let spans = plan.spans(rank, i);
        let (buffer, report) = plan.opened[i].load_spans(loader, &spans)?;
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
    Ok(ckpt)
}
