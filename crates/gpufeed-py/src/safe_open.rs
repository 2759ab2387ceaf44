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
use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

use crate::GpufeedError;
use crate::array::{Array, Owner, Storage, cuda, device_address};
use crate::context::KeepContext;
use crate::errors::py_err;
use crate::loads::shared_loader;
use crate::reaper;

/// The safetensors name of a dtype (`F32`, `F8_E4M3`, ...).
pub(crate) fn dtype_name(dtype: gpufeed::safetensors::Dtype) -> String {
    match serde_json::to_value(dtype) {
        Ok(serde_json::Value::String(s)) => s,
        _ => format!("{dtype:?}"),
    }
}

/// What a [`SafeFile`] reads: a file opened once, or an object (`s3://`, `https://`) at the
/// version (ETag) its header came from.
enum Source {
    File(gpufeed::os::OpenedFile),
    Object(Arc<gpufeed::object::Object>),
}

/// One safetensors file (or object), opened once: its header read and checked on the
/// descriptor (or at the object's version) that every later read (mapping, loads) goes through.
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct SafeFile {
    source: Source,
    data_start: u64,
    metadata: Option<BTreeMap<String, String>>,
    /// Shared with the other opens of the same header bytes in this process.
    tensors: Arc<[HeaderEntry]>,
    /// The copy-on-write mapping of the whole file, made on first use (files only).
    host: Mutex<Option<Arc<Owner>>>,
}

/// Opens `path` (a safetensors file, or a sharded checkpoint's `*.index.json`; either as an
/// object URL, `s3://` or `https://`, its shards beside it) and checks every header: one
/// [`SafeFile`] per file, in the index's order.
#[pyfunction]
pub(crate) fn open_safetensors(py: Python<'_>, path: PathBuf) -> PyResult<Vec<SafeFile>> {
    let file = |(layout, source): (gpufeed::safetensors::FileLayout, Source)| SafeFile {
        source,
        data_start: layout.data_start,
        metadata: layout.metadata,
        tensors: layout.tensors,
        host: Mutex::new(None),
    };
    if let Some(url) = crate::loads::object_url(&path) {
        let opened = py
            .detach(|| gpufeed::safetensors::inspect_object_opened(url, &Default::default()))
            .map_err(py_err)?;
        return Ok(opened
            .into_iter()
            .map(|(layout, object)| file((layout, Source::Object(Arc::new(object)))))
            .collect());
    }
    let opened = py
        .detach(|| gpufeed::safetensors::inspect_opened(&path))
        .map_err(py_err)?;
    Ok(opened
        .into_iter()
        .map(|(layout, opened)| file((layout, Source::File(opened))))
        .collect())
}

/// `SafeFile.entries`: names, entries and the byte order of one file's tensors.
type Entries<'py> = (Vec<Bound<'py, PyString>>, Vec<Entry>, Vec<usize>);

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

impl SafeFile {
    /// The owner of the file's private mapping, made on first use.
    fn host_owner(&self, file: &gpufeed::os::OpenedFile) -> PyResult<Arc<Owner>> {
        let mut host = self.host.lock();
        if let Some(owner) = host.as_ref() {
            return Ok(Arc::clone(owner));
        }
        // Its contents as far as size and mtime tell: a handle is held open long, and a
        // chmod, a rename or the file's last link removed meanwhile leave the version opened
        // intact (safetensors reads it too).
        if let Some(what) = file.content_changed().map_err(py_err)? {
            return Err(py_err(gpufeed::os::Error::ChangedSinceOpened {
                path: file.path().into(),
                what,
            }));
        }
        #[allow(unsafe_code, reason = "mapping a file")]
        // SAFETY: a private mapping: the process's writes never reach the file. The file's
        // size was checked unchanged just now; one truncated by another process later makes
        // its lost pages raise SIGBUS on access, as safetensors' own CPU tensors (an mmap of
        // the file) do; a file renamed over or rewritten through a new inode leaves this one
        // intact.
        let map = unsafe {
            gpufeed::os::FileMap::of_opened_as(file, 0, file.len(), gpufeed::os::MapMode::Private)
        }
        .map_err(py_err)?;
        let owner = Arc::new(Owner::new(Storage::Mapped(map), None));
        *host = Some(Arc::clone(&owner));
        Ok(owner)
    }

    /// The shared loader of GPU `device` for this file (or object).
    fn loader(&self, py: Python<'_>, device: usize) -> PyResult<Arc<gpufeed::Loader>> {
        match &self.source {
            Source::File(_) => shared_loader(py, device),
            Source::Object(_) => crate::loads::shared_object_loader(py, device),
        }
    }

    /// Bytes `spans` of the file or object into new GPU memory of `loader`.
    fn load(
        &self,
        loader: &gpufeed::Loader,
        spans: &[std::ops::Range<u64>],
    ) -> gpufeed::load::Result<gpufeed::DeviceBuffer> {
        let total: u64 = spans.iter().map(|s| s.end.saturating_sub(s.start)).sum();
        reaper::wait_idle_before(total);
        let (buf, _) = match &self.source {
            // A duplicate whose identity is taken now, its contents checked against the
            // open's on that same `fstat`: the load's own check after its copies covers its
            // window (a handle is held open long; a chmod or a rename over the path meanwhile
            // left the version opened intact).
            Source::File(file) => loader.load_spans_of(&file.try_clone_as_of_now()?, spans)?,
            Source::Object(object) => loader.load_object_spans(object, spans)?,
        };
        Ok(buf)
    }
}

#[pymethods]
impl SafeFile {
    /// The file's path (or the object's URL).
    #[getter]
    fn path(&self) -> String {
        match &self.source {
            Source::File(file) => file.path().to_string_lossy().into_owned(),
            Source::Object(object) => object.url().to_string(),
        }
    }

    /// Where the data section starts (the 8-byte length plus the header).
    #[getter]
    fn data_start(&self) -> u64 {
        self.data_start
    }

    /// The file's length when it was opened (the object's).
    #[getter]
    fn len(&self) -> u64 {
        match &self.source {
            Source::File(file) => file.len(),
            Source::Object(object) => object.len(),
        }
    }

    /// The header's `__metadata__`, or `None`.
    fn metadata(&self) -> Option<BTreeMap<String, String>> {
        self.metadata.clone()
    }

    /// `[(name, dtype, shape, start, end)]` sorted by name; `start..end` in the data section.
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Listed<'py>> {
        listed(py, &self.tensors)
    }

    /// Tensors `indices` (of `tensors()`) as host arrays, each its own view of a private
    /// (copy-on-write) mapping of the descriptor opened, made once and shared by every tensor
    /// of this file: writes to them stay in this process. Each array has the tensor's dtype
    /// and shape where DLPack carries the dtype, else its bytes as `U8`. Of an object: the
    /// bytes from the first tensor's to the last one's, read by ranged GETs (in parallel)
    /// into new host memory that these arrays share.
    ///
    /// # Errors
    /// The file's contents changed since it was opened (its size or mtime, asked of the
    /// descriptor): mapping a truncated file would raise SIGBUS where its tensors are
    /// touched. An object's read errors (replaced since it was opened, a failed request).
    fn host_tensors(&self, py: Python<'_>, indices: Vec<usize>) -> PyResult<Vec<Array>> {
        let tensors = indices
            .into_iter()
            .map(|i| {
                self.tensors.get(i).ok_or_else(|| {
                    GpufeedError::new_err(format!("no tensor {i} in {}", self.path()))
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let start = self.data_start as usize;
        let (owner, base) = match &self.source {
            Source::File(file) => {
                let owner = self.host_owner(file)?;
                let (base, _) = owner.host_range().unwrap_or((0, 0));
                (owner, base + start)
            }
            Source::Object(object) => {
                let lo = tensors.iter().map(|t| t.range.start).min().unwrap_or(0);
                let hi = tensors.iter().map(|t| t.range.end).max().unwrap_or(lo);
                // From the 64-byte boundary of the object at or before the first tensor, into
                // memory aligned to 64: each tensor's address keeps the alignment its offset
                // has in the object, as in a mapping of a file.
                let from = (start + lo) / 64 * 64;
                let n = start + hi - from;
                let mut bytes = vec![0u8; n + 63];
                let pad = bytes.as_ptr().align_offset(64).min(63);
                py.detach(|| object.read_exact_at(from as u64, &mut bytes[pad..pad + n]))
                    .map_err(|e| py_err(gpufeed::load::Error::Object(e)))?;
                // Taken before the Vec moves into its owner (its heap buffer does not move):
                // the tensors may be written through it, as safetensors' CPU tensors may.
                let at = bytes.as_mut_ptr() as usize + pad;
                let owner = Arc::new(Owner::new(Storage::Bytes(bytes), None));
                (owner, at.wrapping_add(start).wrapping_sub(from))
            }
        };
        Ok(tensors
            .into_iter()
            .map(|t| {
                Array::typed(
                    Arc::clone(&owner),
                    base.wrapping_add(t.range.start),
                    t.range.end - t.range.start,
                    crate::array::cpu(),
                    t.dtype,
                    &t.shape,
                )
            })
            .collect())
    }

    /// Every tensor of the file on GPU `device`, one transfer of the data section into one
    /// allocation, read through the descriptor opened (an object: by ranged GETs of the
    /// version opened): one array per tensor of `tensors()`, in that order (dtype and shape
    /// as for `host_tensors`); the allocation is freed when the last of them goes.
    ///
    /// With `importer` (`torch._C._from_dlpack`, `torch.from_dlpack`), each tensor that DLPack
    /// carries comes back as `importer(capsule)`; the others as their arrays.
    #[pyo3(signature = (device, importer=None))]
    fn load_tensors(
        &self,
        py: Python<'_>,
        device: usize,
        importer: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let loader = self.loader(py, device)?;
        let _context = gpufeed::cuda::ContextGuard::new();
        let span = self.data_start..self.len();
        let buf = py
            .detach(|| self.load(&loader, std::slice::from_ref(&span)))
            .map_err(py_err)?;
        let gpu = loader.gpu();
        let base = device_address(gpu, &buf);
        let owner = Arc::new(Owner::new(Storage::Device(buf), Some(gpu.clone())));
        let dev = cuda(gpu.info().ordinal);
        self.tensors
            .iter()
            .map(|t| {
                Array::typed(
                    Arc::clone(&owner),
                    base + t.range.start,
                    t.range.end - t.range.start,
                    dev,
                    t.dtype,
                    &t.shape,
                )
                .handed(py, t.dtype, importer.as_ref())
            })
            .collect()
    }

    /// Bytes `spans` (absolute offsets, back to back) on GPU `device`: a `U8` array.
    fn load_spans(&self, py: Python<'_>, device: usize, spans: Vec<(u64, u64)>) -> PyResult<Array> {
        let loader = self.loader(py, device)?;
        let _context = gpufeed::cuda::ContextGuard::new();
        let spans: Vec<std::ops::Range<u64>> = spans.into_iter().map(|(a, b)| a..b).collect();
        let buf = py.detach(|| self.load(&loader, &spans)).map_err(py_err)?;
        Ok(crate::array::device_bytes(loader.gpu(), buf))
    }

    /// Starts loading `items` (`(start, end, align, tensor, shape)`: absolute offsets, the
    /// element size they are placed at, the index in `tensors()` of the tensor they hold and
    /// that part's shape) to GPU `device` in the background, in chunks of `chunk_bytes`; see
    /// `gpufeed_safetensors::PrefetchOptions` for `ahead_bytes`, `follow_from` and
    /// `run_bytes`.
    #[pyo3(signature = (device, items, chunk_bytes, ahead_bytes=None, follow_from=None, run_bytes=0))]
    #[allow(clippy::type_complexity, reason = "the tuple is the Python shape")]
    #[allow(clippy::too_many_arguments, reason = "Python's arguments")]
    fn prefetch(
        &self,
        py: Python<'_>,
        device: usize,
        items: Vec<(u64, u64, usize, usize, Vec<usize>)>,
        chunk_bytes: u64,
        ahead_bytes: Option<u64>,
        follow_from: Option<u64>,
        run_bytes: u64,
    ) -> PyResult<NativePrefetch> {
        let mut views = Vec::with_capacity(items.len());
        let mut spans = Vec::with_capacity(items.len());
        for (start, end, align, tensor, shape) in items {
            let t = self.tensor(tensor)?;
            views.push((t.dtype, shape));
            spans.push((start, end, align));
        }
        self.start_prefetch(
            py,
            device,
            views,
            spans,
            chunk_bytes,
            ahead_bytes,
            follow_from,
            run_bytes,
        )
    }

    /// `prefetch` of whole tensors: `tensors` are indices in `tensors()`, each loaded whole,
    /// placed at a multiple of its element size (a byte for packed types).
    #[pyo3(signature = (device, tensors, chunk_bytes, ahead_bytes=None, follow_from=None, run_bytes=0))]
    #[allow(clippy::too_many_arguments, reason = "Python's arguments")]
    fn prefetch_tensors(
        &self,
        py: Python<'_>,
        device: usize,
        tensors: Vec<usize>,
        chunk_bytes: u64,
        ahead_bytes: Option<u64>,
        follow_from: Option<u64>,
        run_bytes: u64,
    ) -> PyResult<NativePrefetch> {
        let mut views = Vec::with_capacity(tensors.len());
        let mut spans = Vec::with_capacity(tensors.len());
        for i in tensors {
            let t = self.tensor(i)?;
            views.push((t.dtype, t.shape.clone()));
            let base = self.data_start;
            spans.push((
                base + t.range.start as u64,
                base + t.range.end as u64,
                (t.dtype.bitsize() / 8).max(1),
            ));
        }
        self.start_prefetch(
            py,
            device,
            views,
            spans,
            chunk_bytes,
            ahead_bytes,
            follow_from,
            run_bytes,
        )
    }

    /// The parse this file's tensors came from, as a key (see [`HeaderKey`]); `None` for an
    /// object, whose header is parsed anew on every open.
    fn header_key(&self) -> Option<HeaderKey> {
        match self.source {
            Source::File(_) => Some(HeaderKey(Arc::clone(&self.tensors))),
            Source::Object(_) => None,
        }
    }

    /// The drop-in's view of every tensor, made here rather than by Python per tensor: `(names,
    /// entries, order)`, names and entries as `tensors()` lists them (sorted by name), each an
    /// `Entry` of file `file` (its index in the handle), and `order` the indices of the
    /// tensors in the order of their bytes.
    fn entries<'py>(&self, py: Python<'py>, file: usize) -> PyResult<Entries<'py>> {
        let base = self.data_start;
        // A file holds few dtypes: each one's Python string made once, found by a scan (no
        // string made per tensor to look it up).
        let mut dtypes: Vec<(gpufeed::safetensors::Dtype, Py<PyString>)> = Vec::new();
        let mut names = Vec::with_capacity(self.tensors.len());
        let mut entries = Vec::with_capacity(self.tensors.len());
        for (index, t) in self.tensors.iter().enumerate() {
            let dtype = match dtypes.iter().find(|(d, _)| *d == t.dtype) {
                Some((_, s)) => s.clone_ref(py),
                None => {
                    let s = PyString::new(py, &t.dtype.to_string()).unbind();
                    dtypes.push((t.dtype, s.clone_ref(py)));
                    s
                }
            };
            names.push(PyString::new(py, &t.name));
            entries.push(Entry {
                file,
                index,
                dtype,
                shape: PyTuple::new(py, &t.shape)?.unbind(),
                start: base + t.range.start as u64,
                end: base + t.range.end as u64,
                rel: (t.range.start as u64, t.range.end as u64),
            });
        }
        let mut order: Vec<usize> = (0..self.tensors.len()).collect();
        order.sort_by_key(|&i| (self.tensors[i].range.start, self.tensors[i].range.end));
        Ok((names, entries, order))
    }
}

impl SafeFile {
    /// Tensor `i` of `tensors()`.
    fn tensor(&self, i: usize) -> PyResult<&HeaderEntry> {
        self.tensors
            .get(i)
            .ok_or_else(|| GpufeedError::new_err(format!("no tensor {i} in {}", self.path())))
    }

    /// Starts a prefetch of `items` (`(start, end, align)`, absolute) shown as `views`.
    #[allow(clippy::too_many_arguments, reason = "prefetch's arguments, passed on")]
    fn start_prefetch(
        &self,
        py: Python<'_>,
        device: usize,
        views: Vec<(gpufeed::safetensors::Dtype, Vec<usize>)>,
        items: Vec<(u64, u64, usize)>,
        chunk_bytes: u64,
        ahead_bytes: Option<u64>,
        follow_from: Option<u64>,
        run_bytes: u64,
    ) -> PyResult<NativePrefetch> {
        let loader = self.loader(py, device)?;
        let _context = gpufeed::cuda::ContextGuard::new();
        let file: gpufeed::safetensors::PrefetchSource = match &self.source {
            // As for `load`: the prefetch's chunks each check their window from here.
            Source::File(file) => file.try_clone_as_of_now().map_err(py_err)?.into(),
            Source::Object(object) => Arc::clone(object).into(),
        };
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
            .with_follow_from(follow_from)
            .with_run_bytes(run_bytes);
        let gpu = loader.gpu().clone();
        let total: u64 = items
            .iter()
            .map(|i: &PrefetchItem| i.span.end - i.span.start)
            .sum();
        let inner = py
            .detach(|| {
                // What Python let go is freed first, so that its synchronizations do not stall
                // the transfers and its memory is back for them.
                let waited = std::time::Instant::now();
                reaper::wait_idle_before(total);
                tracing::debug!(
                    waited_ms = waited.elapsed().as_secs_f64() * 1e3,
                    "prefetch starts after the frees"
                );
                Prefetch::start(Arc::clone(&loader), file, items, opts)
            })
            .map_err(py_err)?;
        Ok(NativePrefetch {
            gpu,
            inner: Mutex::new(Some(Arc::new(inner))),
            views,
            seen: Mutex::new(HashMap::new()),
            restore: KeepContext::default(),
        })
    }
}

/// The parse of a header (`SafeFile.header_key()`): files whose tensors came from one parse
/// (their headers the same bytes in files of the same length: `gpufeed_safetensors` parses
/// such a header once per process) have keys of one `id`, and while a key lives no other
/// parse has its `id` (the key keeps its parse alive). The drop-in keeps its Python view of
/// a file's tensors with the key, by `id`, so that a file opened again makes none of it again.
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct HeaderKey(Arc<[HeaderEntry]>);

#[pymethods]
impl HeaderKey {
    /// The parse's address: one per parse among the keys alive.
    #[getter]
    fn id(&self) -> usize {
        Arc::as_ptr(&self.0).cast::<u8>() as usize
    }

    /// How many tensors the header lists.
    fn __len__(&self) -> usize {
        self.0.len()
    }

    /// Whether `gpufeed_safetensors` keeps this parse now (a file of this header opened again
    /// gets it): what is worth keeping a view of.
    #[getter]
    fn kept(&self) -> bool {
        gpufeed::safetensors::parse_is_kept(&self.0)
    }
}

/// One tensor of a [`SafeFile`] as the drop-in keeps it (`SafeFile.entries`): the file it
/// is in (its index in the handle), its index in `tensors()`, dtype (a safetensors name),
/// shape, bytes in the file (`start..end`, absolute) and in the data section (`rel`).
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct Entry {
    #[pyo3(get)]
    file: usize,
    #[pyo3(get)]
    index: usize,
    #[pyo3(get)]
    dtype: Py<PyString>,
    #[pyo3(get)]
    shape: Py<PyTuple>,
    #[pyo3(get)]
    start: u64,
    #[pyo3(get)]
    end: u64,
    #[pyo3(get)]
    rel: (u64, u64),
}

/// Items of one file loading to a GPU in the background (`gpufeed_safetensors::Prefetch`),
/// each handed to Python as an array of its own (its dtype and shape where DLPack carries the
/// dtype, else `U8` bytes) sharing its chunk's allocation, which is freed when the last array
/// of the chunk goes (and the prefetch, for items never handed out).
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct NativePrefetch {
    gpu: gpufeed::Gpu,
    /// Taken out (and closed) by `close`; callers clone it out, so that none waits holding
    /// the lock.
    inner: Mutex<Option<Arc<Prefetch>>>,
    /// Each item's dtype and shape.
    views: Vec<(gpufeed::safetensors::Dtype, Vec<usize>)>,
    /// Per chunk (by the allocation's address) being handed out, until its last item.
    seen: Mutex<HashMap<usize, Handing>>,
    restore: KeepContext,
}

/// A chunk of a [`NativePrefetch`] being handed out: its owner, how many of its items were
/// handed out, and its device address.
struct Handing {
    owner: Arc<Owner>,
    handed: usize,
    base: usize,
}

impl Drop for NativePrefetch {
    fn drop(&mut self) {
        self.restore.arm();
    }
}

impl NativePrefetch {
    fn hand(&self, i: usize, piece: Piece) -> Array {
        let key = Arc::as_ptr(&piece.buffer) as usize;
        let (owner, base) = {
            let mut seen = self.seen.lock();
            let entry = seen.entry(key).or_insert_with(|| {
                // Once per chunk, not per tensor: cudarc's `device_ptr` makes its stream wait
                // for the buffer's last write and records a read event (two driver calls).
                let base = device_address(&self.gpu, &piece.buffer);
                let owner = Owner::new(
                    Storage::Chunk(Arc::clone(&piece.buffer)),
                    Some(self.gpu.clone()),
                );
                Handing {
                    owner: Arc::new(owner),
                    handed: 0,
                    base,
                }
            });
            entry.handed += 1;
            let handed = (Arc::clone(&entry.owner), entry.base);
            if entry.handed >= piece.siblings {
                seen.remove(&key);
            }
            handed
        };
        let (dtype, shape) = &self.views[i];
        Array::typed(
            owner,
            base + piece.offset,
            piece.len,
            cuda(self.gpu.info().ordinal),
            *dtype,
            shape,
        )
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

    /// Item `i`, waiting for it (`importer` as for `SafeFile.load_tensors`).
    #[pyo3(signature = (i, importer=None))]
    fn take(
        &self,
        py: Python<'_>,
        i: usize,
        importer: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let p = self.open()?;
        let piece = match p.try_take_if_untaken(i) {
            Some(Ok(Some(piece))) => Ok(piece),
            Some(Err(e)) => Err(e),
            // Not landed (waits), or taken before (`take` says so).
            Some(Ok(None)) | None => py.detach(|| p.take(i)),
        }
        .map_err(py_err)?;
        self.hand(i, piece)
            .handed(py, self.views[i].0, importer.as_ref())
    }

    /// Item `i`, waiting for it, or `None` where it was taken before (`importer` as for
    /// `SafeFile.load_tensors`).
    #[pyo3(signature = (i, importer=None))]
    fn take_once(
        &self,
        py: Python<'_>,
        i: usize,
        importer: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Option<Py<PyAny>>> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let p = self.open()?;
        // The GIL is given up only to wait: a sweep's items have mostly landed when asked.
        let taken = match p.try_take_if_untaken(i) {
            Some(taken) => taken,
            None => py.detach(|| p.take_if_untaken(i)),
        };
        match taken.map_err(py_err)? {
            Some(piece) => Ok(Some(self.hand(i, piece).handed(
                py,
                self.views[i].0,
                importer.as_ref(),
            )?)),
            None => Ok(None),
        }
    }

    /// An iterator of `(names[i], item i)` for the items as they land, each handed out once
    /// (an item taken before is skipped); it ends once every item was handed out or the
    /// prefetch was closed. `importer` as for `SafeFile.load_tensors`; `convert(name, array)`,
    /// where given, makes what the iterator yields of an item DLPack does not carry the dtype
    /// of. One native step per item: no Python code between the tensors of a loader iterated.
    #[pyo3(signature = (names, importer=None, convert=None))]
    fn iterate(
        slf: Py<Self>,
        names: Vec<Py<PyString>>,
        importer: Option<Py<PyAny>>,
        convert: Option<Py<PyAny>>,
    ) -> PrefetchIter {
        PrefetchIter {
            prefetch: slf,
            names,
            importer,
            convert,
        }
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

/// `NativePrefetch.iterate`: the items of a prefetch as they land, named.
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct PrefetchIter {
    prefetch: Py<NativePrefetch>,
    names: Vec<Py<PyString>>,
    importer: Option<Py<PyAny>>,
    convert: Option<Py<PyAny>>,
}

#[pymethods]
impl PrefetchIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<(Py<PyString>, Py<PyAny>)> {
        let native = self.prefetch.get();
        let _context = gpufeed::cuda::ContextGuard::new();
        let Some(p) = native.inner.lock().clone() else {
            return Err(PyStopIteration::new_err(()));
        };
        let next = match p.try_next_ready() {
            Some(next) => Some(next),
            None => py.detach(|| p.next_ready()).map_err(py_err)?,
        };
        let Some((i, piece)) = next else {
            return Err(PyStopIteration::new_err(()));
        };
        let name = self.names.get(i).ok_or_else(|| {
            GpufeedError::new_err(format!(
                "prefetch item {i} has no name ({} names given)",
                self.names.len()
            ))
        })?;
        let dtype = native.views[i].0;
        let array = native.hand(i, piece);
        let carried = self.importer.is_some() && array.carries(dtype);
        let importer = self.importer.as_ref().map(|f| f.bind(py));
        let mut got = array.handed(py, dtype, importer)?;
        if !carried && let Some(convert) = &self.convert {
            got = convert.call1(py, (name.clone_ref(py), got))?;
        }
        Ok((name.clone_ref(py), got))
    }
}
