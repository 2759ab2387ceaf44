//! A checkpoint in GPU memory: [`load`] (a file or an index's shards, one bulk transfer per
//! file), the one-shot [`load_on`], [`Checkpoint`]'s named views, and [`inspect`].

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpufeed_cuda::cudarc::driver::CudaView;
use gpufeed_load::{DeviceBuffer, LoadOptions, LoadReport, Loader, OneShotReport};
use gpufeed_os::OpenedFile;

pub use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::header::HeaderEntry;
use crate::index::{load_planned, plan};

/// Where one tensor lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major).
    pub shape: Vec<usize>,
    /// Which file of the checkpoint (index into [`Checkpoint::files`], or into
    /// [`OnDemand::files`](crate::OnDemand::files)).
    pub file: usize,
    /// Byte range in that file's device buffer; for [`OnDemand`](crate::OnDemand), in the file itself.
    pub range: Range<usize>,
}

/// A checkpoint in GPU memory: one device buffer per file, a view per tensor.
#[derive(Debug)]
pub struct Checkpoint {
    pub(crate) gpu: gpufeed_cuda::Gpu,
    pub(crate) files: Vec<PathBuf>,
    pub(crate) buffers: Vec<DeviceBuffer>,
    pub(crate) tensors: BTreeMap<String, TensorInfo>,
    pub(crate) reports: Vec<LoadReport>,
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
    pub fn from_layouts(
        path: &Path,
        gpu: gpufeed_cuda::Gpu,
        layouts: &[FileLayout],
        buffers: Vec<DeviceBuffer>,
    ) -> Result<Self> {
        if buffers.len() != layouts.len() {
            return Err(Error::invalid(format!(
                "{} device buffers for {} files: one buffer per file's data section",
                buffers.len(),
                layouts.len()
            )));
        }
        for (layout, buffer) in layouts.iter().zip(&buffers) {
            if buffer.len() as u64 != layout.data_bytes {
                return Err(Error::invalid(format!(
                    "{}: a device buffer of {} bytes for a data section of {}",
                    layout.path.display(),
                    buffer.len(),
                    layout.data_bytes
                )));
            }
        }
        let mut tensors = BTreeMap::new();
        for (i, layout) in layouts.iter().enumerate() {
            for HeaderEntry {
                name,
                dtype,
                shape,
                range,
            } in layout.tensors.iter()
            {
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

/// Loads a safetensors file, or a sharded checkpoint given by its `*.index.json`, into GPU
/// memory: the header is parsed with the `safetensors` crate, each file's data section moves in
/// one bulk transfer (`load_file`'s machinery), and every tensor is a view into its file's
/// device buffer.
///
/// # Errors
/// [`Error::Safetensors`] for a malformed or hostile header (a sentence saying what is wrong),
/// [`Error::Index`] for a bad index, [`Error::FileChangedDuringLoad`](gpufeed_load::Error::FileChangedDuringLoad) when a file was replaced
/// or modified between reading its header and the end of its load, and the errors of
/// [`gpufeed_load::load_file`]. The header is read with `pread` on the descriptor whose identity
/// (dev, ino, size, mtime, ctime) the load is checked against; no CPU access goes through a mapping
/// of the file.
///
/// # Example
/// ```no_run
/// let gpu = gpufeed_load::Gpu::open(0)?;
/// let ckpt = gpufeed_safetensors::load(&gpu, "model.safetensors")?;
/// let (info, view) = ckpt.get("lm_head.weight").expect("tensor");
/// println!("{:?} {:?}: {} bytes on the GPU", info.dtype, info.shape, view.len());
/// # Ok::<(), gpufeed_safetensors::Error>(())
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
/// [`staging_bytes_for`]: gpufeed_cuda::TransferOptions::staging_bytes_for
///
/// # Errors
/// The checkpoint's errors (missing file, malformed header, bad index) before the GPU's (no
/// driver, no such device), then [`load`]'s.
///
/// # Example
/// ```no_run
/// let (ckpt, report) = gpufeed_safetensors::load_on(0, "model.safetensors")?;
/// println!(
///     "{} tensors on {}: context {:.0} ms, then {:.0} ms to load {} bytes",
///     ckpt.len(), ckpt.gpu().info().name, report.context_seconds * 1e3,
///     (report.total_seconds - report.context_seconds) * 1e3, report.bytes
/// );
/// # Ok::<(), gpufeed_safetensors::Error>(())
/// ```
pub fn load_on(ordinal: usize, path: impl AsRef<Path>) -> Result<(Checkpoint, OneShotReport)> {
    let path = path.as_ref();
    let (_, ckpt, report) = gpufeed_load::internal::one_shot(
        ordinal,
        || {
            let plan = plan(path)?;
            let largest = plan.largest();
            Ok::<_, Error>((plan, largest))
        },
        |loader, plan| {
            let ckpt = load_planned(loader, path, plan)?;
            let reports = ckpt.reports.clone();
            Ok((ckpt, reports))
        },
    )?;
    Ok((ckpt, report))
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
    /// Its tensors, sorted by name: name, dtype, shape, byte range in the data section
    /// (shared with the other opens of the same header in this process).
    pub tensors: Arc<[HeaderEntry]>,
    /// Its header's `__metadata__` (free-form strings), where it has one.
    pub metadata: Option<BTreeMap<String, String>>,
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
/// for file in gpufeed_safetensors::inspect("model.safetensors.index.json")? {
///     println!("{}: {} tensors, {} bytes", file.path.display(), file.tensors.len(), file.data_bytes);
/// }
/// # Ok::<(), gpufeed_safetensors::Error>(())
/// ```
pub fn inspect(path: impl AsRef<Path>) -> Result<Vec<FileLayout>> {
    Ok(inspect_opened(path)?.into_iter().map(|(l, _)| l).collect())
}

/// [`inspect`], with each file as it was opened to read its header: a caller that loads the
/// data sections itself (replicated loads on several GPUs) reads them through these
/// descriptors, so the bytes are of the version whose header was checked.
///
/// # Errors
/// As for [`inspect`].
pub fn inspect_opened(path: impl AsRef<Path>) -> Result<Vec<(FileLayout, OpenedFile)>> {
    Ok(plan(path.as_ref())?
        .files
        .into_iter()
        .map(|(path, parsed)| {
            (
                FileLayout {
                    path,
                    data_start: parsed.data_start,
                    data_bytes: parsed.data_len,
                    tensors: parsed.tensors,
                    metadata: parsed.metadata,
                },
                parsed.file,
            )
        })
        .collect())
}
