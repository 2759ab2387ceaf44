//! What the drop-in `gpufeed.safe_open` (python/gpufeed/_safe_open.py) stands on: a safetensors
//! file opened once with its header checked on that descriptor ([`SafeFile`]), its bytes as a
//! copy-on-write host mapping (CPU tensors), byte ranges loaded to a GPU (slices), and
//! [`NativePrefetch`], ranges loading in the background in chunks (`prefetch`, and the sweeps
//! of `get_tensor` on a GPU).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use gpufeed::safetensors::{HeaderEntry, Piece, Prefetch, PrefetchItem, PrefetchOptions};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::GpufeedError;
use crate::array::{Array, Owner, Storage, cuda, device_address};
use crate::context::KeepContext;
use crate::errors::py_err;
use crate::loads::shared_loader;
use crate::reaper;

/// The safetensors name of a dtype (`F32`, `F8_E4M3`, ...).
fn dtype_name(dtype: gpufeed::safetensors::Dtype) -> String {
    match serde_json::to_value(dtype) {
        Ok(serde_json::Value::String(s)) => s,
        _ => format!("{dtype:?}"),
    }
}

/// One safetensors file, opened once: its header read and checked on the descriptor that
/// every later read (mapping, loads) goes through.
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct SafeFile {
    file: gpufeed::os::OpenedFile,
    data_start: u64,
    metadata: Option<BTreeMap<String, String>>,
    tensors: Vec<HeaderEntry>,
    /// The copy-on-write mapping of the whole file, made on first use.
    host: Mutex<Option<Arc<Owner>>>,
}

/// Opens `path` (a safetensors file, or a sharded checkpoint's `*.index.json`) and checks every
/// header: one [`SafeFile`] per file, in the index's order.
#[pyfunction]
pub(crate) fn open_safetensors(py: Python<'_>, path: PathBuf) -> PyResult<Vec<SafeFile>> {
    let opened = py
        .detach(|| gpufeed::safetensors::inspect_opened(&path))
        .map_err(py_err)?;
    Ok(opened
        .into_iter()
        .map(|(layout, file)| SafeFile {
            file,
            data_start: layout.data_start,
            metadata: layout.metadata,
            tensors: layout.tensors,
            host: Mutex::new(None),
        })
        .collect())
}

/// Tensors as `SafeFile.tensors` lists them.
type Listed<'py> = Vec<(String, String, Bound<'py, PyTuple>, usize, usize)>;

fn listed<'py>(py: Python<'py>, tensors: &[HeaderEntry]) -> PyResult<Listed<'py>> {
    tensors
        .iter()
        .map(|t| {
            Ok((
                t.name.clone(),
                dtype_name(t.dtype),
                PyTuple::new(py, &t.shape)?,
                t.range.start,
                t.range.end,
            ))
        })
        .collect()
}

/// The header of a whole safetensors file held in `data`, checked as a file's is: `(data
/// start, metadata or None, tensors as SafeFile.tensors lists them)`.
#[pyfunction]
#[allow(clippy::type_complexity, reason = "the tuple is the Python shape")]
pub(crate) fn parse_header<'py>(
    py: Python<'py>,
    data: &[u8],
) -> PyResult<(u64, Option<BTreeMap<String, String>>, Listed<'py>)> {
    let (start, tensors, metadata) = gpufeed::safetensors::header_and_metadata(data)
        .map_err(|e| GpufeedError::new_err(format!("not a valid safetensors buffer: {e}")))?;
    Ok((start, metadata, listed(py, &tensors)?))
}

#[pymethods]
impl SafeFile {
    /// The file's path.
    #[getter]
    fn path(&self) -> String {
        self.file.path().to_string_lossy().into_owned()
    }

    /// Where the data section starts (the 8-byte length plus the header).
    #[getter]
    fn data_start(&self) -> u64 {
        self.data_start
    }

    /// The file's length when it was opened.
    #[getter]
    fn len(&self) -> u64 {
        self.file.len()
    }

    /// The header's `__metadata__`, or `None`.
    fn metadata(&self) -> Option<BTreeMap<String, String>> {
        self.metadata.clone()
    }

    /// `[(name, dtype, shape, start, end)]` sorted by name; `start..end` in the data section.
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Listed<'py>> {
        listed(py, &self.tensors)
    }

    /// The whole file as a `U8` host array: a private (copy-on-write) mapping of the
    /// descriptor opened, made once and shared by every tensor of this file; writes to it stay
    /// in this process.
    fn host_bytes(&self) -> PyResult<Array> {
        let mut host = self.host.lock();
        let owner = match host.as_ref() {
            Some(owner) => Arc::clone(owner),
            None => {
                #[allow(unsafe_code, reason = "mapping a file")]
                // SAFETY: a private mapping: the process's writes never reach the file. A
                // file truncated by another process meanwhile makes its later pages raise
                // SIGBUS on access, as safetensors' own CPU tensors (an mmap of the file) do;
                // a file renamed over or rewritten through a new inode leaves this one intact.
                let map = unsafe {
                    gpufeed::os::FileMap::of_opened_as(
                        &self.file,
                        0,
                        self.file.len(),
                        gpufeed::os::MapMode::Private,
                    )
                }
                .map_err(py_err)?;
                let owner = Arc::new(Owner::new(Storage::Mapped(map), None));
                *host = Some(Arc::clone(&owner));
                owner
            }
        };
        let (base, len) = owner.host_range().unwrap_or((0, 0));
        Ok(Array::bytes(owner, base, len, crate::array::cpu(), None))
    }

    /// Bytes `spans` (absolute offsets, back to back) on GPU `device`: a `U8` array.
    fn load_spans(&self, py: Python<'_>, device: usize, spans: Vec<(u64, u64)>) -> PyResult<Array> {
        let loader = shared_loader(py, device)?;
        let _context = gpufeed::cuda::ContextGuard::new();
        let spans: Vec<std::ops::Range<u64>> = spans.into_iter().map(|(a, b)| a..b).collect();
        let total: u64 = spans.iter().map(|s| s.end.saturating_sub(s.start)).sum();
        let (buf, _) = py
            .detach(|| {
                reaper::wait_idle_before(total);
                loader.load_spans_of(&self.file, &spans)
            })
            .map_err(py_err)?;
        Ok(crate::array::device_bytes(loader.gpu(), buf))
    }

    /// Starts loading `items` (`(start, end, align)`, absolute offsets) to GPU `device` in the
    /// background, in chunks of `chunk_bytes`; see `gpufeed_safetensors::PrefetchOptions` for
    /// `ahead_bytes` and `follow_from`.
    #[pyo3(signature = (device, items, chunk_bytes, ahead_bytes=None, follow_from=None))]
    fn prefetch(
        &self,
        py: Python<'_>,
        device: usize,
        items: Vec<(u64, u64, usize)>,
        chunk_bytes: u64,
        ahead_bytes: Option<u64>,
        follow_from: Option<u64>,
    ) -> PyResult<NativePrefetch> {
        let loader = shared_loader(py, device)?;
        let _context = gpufeed::cuda::ContextGuard::new();
        let file = self.file.try_clone().map_err(py_err)?;
        let items: Vec<PrefetchItem> = items
            .into_iter()
            .map(|(a, b, align)| PrefetchItem {
                span: a..b,
                align: align.max(1),
            })
            .collect();
        let opts = PrefetchOptions::default()
            .with_chunk_bytes(chunk_bytes)
            .with_ahead_bytes(ahead_bytes)
            .with_follow_from(follow_from);
        let gpu = loader.gpu().clone();
        let total: u64 = items
            .iter()
            .map(|i: &PrefetchItem| i.span.end - i.span.start)
            .sum();
        let inner = py
            .detach(|| {
                // What Python let go is freed first, so that its synchronizations do not stall
                // the transfers and its memory is back for them.
                reaper::wait_idle_before(total);
                Prefetch::start(Arc::clone(&loader), file, items, opts)
            })
            .map_err(py_err)?;
        Ok(NativePrefetch {
            gpu,
            inner: Mutex::new(Some(Arc::new(inner))),
            seen: Mutex::new(HashMap::new()),
            restore: KeepContext::default(),
        })
    }
}

/// Items of one file loading to a GPU in the background (`gpufeed_safetensors::Prefetch`),
/// handed to Python as `(chunk key, offset, chunk array or None, last)`: the chunk's array
/// comes with the first item of the chunk handed out, `last` with the last one (the caller
/// caches the chunk's tensor in between).
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct NativePrefetch {
    gpu: gpufeed::Gpu,
    /// Taken out (and closed) by `close`; callers clone it out, so that none waits holding
    /// the lock.
    inner: Mutex<Option<Arc<Prefetch>>>,
    /// Items handed out per chunk (by the allocation's address), until its last.
    seen: Mutex<HashMap<usize, usize>>,
    restore: KeepContext,
}

impl Drop for NativePrefetch {
    fn drop(&mut self) {
        self.restore.arm();
    }
}

type Handed = (usize, usize, Option<Array>, bool);

impl NativePrefetch {
    fn hand(&self, piece: Piece) -> Handed {
        let key = Arc::as_ptr(&piece.buffer) as usize;
        let mut seen = self.seen.lock();
        let count = seen.entry(key).or_insert(0);
        *count += 1;
        let first = *count == 1;
        let last = *count >= piece.siblings;
        if last {
            seen.remove(&key);
        }
        let array = first.then(|| {
            let base = device_address(&self.gpu, &piece.buffer);
            let nbytes = piece.buffer.len();
            let owner = Arc::new(Owner::new(
                Storage::Chunk(Arc::clone(&piece.buffer)),
                Some(self.gpu.clone()),
            ));
            Array::bytes(owner, base, nbytes, cuda(self.gpu.info().ordinal), None)
        });
        (key, piece.offset, array, last)
    }

    /// The prefetch, or an error once closed.
    fn open(&self) -> PyResult<Arc<Prefetch>> {
        self.inner
            .lock()
            .clone()
            .ok_or_else(|| GpufeedError::new_err("the prefetch was closed"))
    }
}

#[pymethods]
impl NativePrefetch {
    fn __len__(&self) -> PyResult<usize> {
        Ok(self.open()?.len())
    }

    /// Item `i`, waiting for it: `(chunk key, offset, chunk array or None, last)`.
    fn take(&self, py: Python<'_>, i: usize) -> PyResult<Handed> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let p = self.open()?;
        let piece = py.detach(|| p.take(i)).map_err(py_err)?;
        Ok(self.hand(piece))
    }

    /// Every item that has landed and nobody took, waiting for one: `[(i, key, offset,
    /// array or None, last)]`; empty once every item was handed out.
    fn ready(&self, py: Python<'_>) -> PyResult<Vec<(usize, Handed)>> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let Some(p) = self.inner.lock().clone() else {
            return Ok(Vec::new());
        };
        let Some(first) = py.detach(|| p.next_ready()).map_err(py_err)? else {
            return Ok(Vec::new());
        };
        let mut out = vec![first];
        while let Some(next) = p.try_next_ready() {
            out.push(next);
        }
        Ok(out
            .into_iter()
            .map(|(i, piece)| (i, self.hand(piece)))
            .collect())
    }

    /// Whether item `i` was handed out (a second ask would fail).
    fn is_taken(&self, i: usize) -> bool {
        self.inner.lock().as_ref().is_none_or(|p| p.is_taken(i))
    }

    /// Stops the background load and drops what was not taken.
    fn close(&self, py: Python<'_>) {
        let taken = self.inner.lock().take();
        if let Some(p) = taken {
            let _context = gpufeed::cuda::ContextGuard::new();
            py.detach(move || p.close());
        }
        self.seen.lock().clear();
    }
}
