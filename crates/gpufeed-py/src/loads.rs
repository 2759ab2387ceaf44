//! Loads onto one GPU: `Loader` (files, byte ranges, registered files), `RegisteredFile`, and
//! the loaders the module-level functions keep, one per device (`load_file`, `load_range`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::array::{Array, device_bytes};
use crate::checkpoints::{FileTensors, checkpoint_files};
use crate::context::KeepContext;
use crate::errors::py_err;
use crate::{GpufeedError, reaper};

fn strategy(name: &str) -> PyResult<gpufeed::Strategy> {
    name.parse().map_err(py_err)
}

/// A reusable loader of one GPU: its pinned staging and threads serve every load.
///
/// `gpufeed.load_file` and `gpufeed.load_safetensors` keep one per device; make one yourself
/// for other options.
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct Loader {
    pub(crate) inner: Arc<gpufeed::Loader>,
    /// Set when dropped, dropped last: see [`KeepContext`].
    pub(crate) restore: KeepContext,
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.restore.arm();
    }
}

impl Loader {
    /// The checkpoint at `url` whose objects `opened` holds (opened and their headers read by
    /// `inspect_object_opened`), as `load_safetensors_files` hands it over.
    pub(crate) fn load_objects_opened(
        &self,
        py: Python<'_>,
        url: String,
        opened: Vec<(gpufeed::safetensors::FileLayout, gpufeed::object::Object)>,
    ) -> PyResult<Vec<FileTensors>> {
        self.checkpoint_by(py, move |inner| {
            gpufeed::safetensors::load_objects_opened(inner, &url, opened)
        })
    }

    /// The checkpoint `load` loads with this loader (without the GIL, after the reaper's
    /// frees), as `load_safetensors_files` hands it over.
    fn checkpoint_by(
        &self,
        py: Python<'_>,
        load: impl FnOnce(
            &gpufeed::Loader,
        ) -> gpufeed::safetensors::Result<gpufeed::safetensors::Checkpoint>
        + Send,
    ) -> PyResult<Vec<FileTensors>> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let inner = Arc::clone(&self.inner);
        let ckpt = py
            .detach(move || {
                reaper::wait_idle();
                load(&inner)
            })
            .map_err(py_err)?;
        checkpoint_files(py, ckpt)
    }

    fn load_range_array(
        &self,
        py: Python<'_>,
        path: PathBuf,
        start: u64,
        end: Option<u64>,
    ) -> PyResult<Array> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let inner = Arc::clone(&self.inner);
        let buf = py.detach(move || {
            if let Some(url) = object_url(&path) {
                // An object: its version pinned by the open, read by ranged GETs.
                let object = gpufeed::object::Object::open(url, &Default::default())
                    .map_err(gpufeed::load::Error::Object)?;
                let end = end.unwrap_or(object.len());
                reaper::wait_idle_before(end.saturating_sub(start));
                return inner
                    .load_object_range(&object, start..end)
                    .map(|(buf, _report)| buf);
            }
            let end = match end {
                Some(e) => e,
                None => gpufeed::os::file::stat_regular(&path)?.size,
            };
            reaper::wait_idle_before(end.saturating_sub(start));
            inner
                .load_range(&path, start..end)
                .map(|(buf, _report)| buf)
        });
        Ok(device_bytes(self.inner.gpu(), buf.map_err(py_err)?))
    }
}

#[pymethods]
impl Loader {
    /// A loader of GPU `device` with a strategy: `auto`, `registered`, `staged`, `direct` or `gds` (cuFile).
    #[new]
    #[pyo3(signature = (device=0, strategy="auto"))]
    fn py_new(py: Python<'_>, device: usize, strategy: &str) -> PyResult<Self> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let opts = gpufeed::LoadOptions::default().with_strategy(self::strategy(strategy)?);
        let inner = py
            .detach(|| gpufeed::Loader::open(device, opts))
            .map_err(py_err)?;
        Ok(Loader {
            inner: Arc::new(inner),
            restore: KeepContext::default(),
        })
    }

    /// All of `path` on the GPU: a 1-D `U8` array.
    fn load_file(&self, py: Python<'_>, path: PathBuf) -> PyResult<Array> {
        self.load_range_array(py, path, 0, None)
    }

    /// Bytes `start..end` of `path` on the GPU: a 1-D `U8` array.
    fn load_range(&self, py: Python<'_>, path: PathBuf, start: u64, end: u64) -> PyResult<Array> {
        if end < start {
            return Err(GpufeedError::new_err(format!(
                "invalid setting: the range {start}..{end} ends before it starts"
            )));
        }
        self.load_range_array(py, path, start, Some(end))
    }

    /// A safetensors file or index as one `U8` array per file with its tensors, what the Python
    /// layer turns into torch tensors with one `torch.from_dlpack` per file and one
    /// `as_strided` per tensor: per file `(array, groups, odd)`, where each group holds the
    /// tensors of one dtype at offsets its element size divides, as `(dtype, element size,
    /// names, shapes, strides, element offsets)`, and `odd` the others as `(name, dtype, shape,
    /// start, end)` in bytes.
    pub(crate) fn load_safetensors_files(
        &self,
        py: Python<'_>,
        path: PathBuf,
    ) -> PyResult<Vec<FileTensors>> {
        // The headers are read once, by the load (a second parse would cost 0.2-0.3 us per
        // tensor); a dtype torch cannot take is refused after it, before any tensor is handed
        // out.
        self.checkpoint_by(py, move |inner| match object_url(&path) {
            Some(url) => gpufeed::safetensors::load_object(inner, url, &Default::default()),
            None => gpufeed::safetensors::load_with(inner, &path),
        })
    }

    /// Registers `path` for repeated loads (see `RegisteredFile`).
    fn register_file(&self, py: Python<'_>, path: PathBuf) -> PyResult<RegisteredFile> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let inner = Arc::clone(&self.inner);
        let file = py
            .detach(move || inner.register_file(&path))
            .map_err(py_err)?;
        Ok(RegisteredFile {
            inner: RwLock::new(Some(file)),
            restore: KeepContext::default(),
        })
    }

    /// Bytes `start..end` (`end` None: to the end) of a registered file on this loader's GPU:
    /// a 1-D `U8` array, one copy out of the page cache.
    #[pyo3(signature = (file, start=0, end=None))]
    fn load_registered(
        &self,
        py: Python<'_>,
        file: &RegisteredFile,
        start: u64,
        end: Option<u64>,
    ) -> PyResult<Array> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let held = file.held();
        let Some(f) = held.as_ref() else {
            return Err(GpufeedError::new_err(
                "the registered file was closed: register it again",
            ));
        };
        let end = end.unwrap_or(f.len());
        if end < start {
            return Err(GpufeedError::new_err(format!(
                "invalid setting: the range {start}..{end} ends before it starts"
            )));
        }
        let inner = &self.inner;
        let buf = py
            .detach(|| {
                reaper::wait_idle_before(end - start);
                inner.load_registered(f, start..end).map(|(buf, _)| buf)
            })
            .map_err(py_err)?;
        Ok(device_bytes(self.inner.gpu(), buf))
    }

    /// The GPU's CUDA ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.inner.gpu().info().ordinal
    }
}

/// Takes what `held` holds (a registered file, an on-demand checkpoint) and drops it, putting
/// back the caller's current CUDA context after: the registrations are undone; later calls
/// find `None`. The lock is taken without the GIL: a load on another thread holds the read
/// side while it runs without the GIL and needs the GIL back before it lets go, so waiting
/// for the write side with the GIL held would deadlock.
pub(crate) fn close_registered<T: Send + Sync>(
    py: Python<'_>,
    held: &RwLock<Option<T>>,
) -> PyResult<()> {
    let _context = gpufeed::cuda::ContextGuard::new();
    py.detach(|| {
        let taken = held.write().take();
        drop(taken);
    });
    Ok(())
}

/// A file registered once for repeated loads (`Loader.register_file`): its cached pages stay
/// page-locked until `close` (or until the object goes), and every `Loader.load_registered`
/// is one copy by the GPU out of the page cache.
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct RegisteredFile {
    /// `None` once closed.
    inner: RwLock<Option<gpufeed::RegisteredFile>>,
    /// Set when dropped, dropped last: see [`KeepContext`].
    restore: KeepContext,
}

impl Drop for RegisteredFile {
    fn drop(&mut self) {
        self.restore.arm();
    }
}

impl RegisteredFile {
    fn held(&self) -> RwLockReadGuard<'_, Option<gpufeed::RegisteredFile>> {
        self.inner.read()
    }
}

#[pymethods]
impl RegisteredFile {
    /// Its length in bytes when registered.
    fn __len__(&self) -> usize {
        self.held().as_ref().map_or(0, |f| f.len() as usize)
    }

    /// The file's path (a `pathlib.Path`; `None` once closed).
    #[getter]
    fn path(&self) -> Option<PathBuf> {
        self.held().as_ref().map(|f| f.path().to_path_buf())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    /// Undoes the registration; arrays already loaded stay valid.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        close_registered(py, &self.inner)
    }
}

type Loaders = Mutex<HashMap<usize, Arc<gpufeed::Loader>>>;

/// The module-level functions' loaders, one per device.
fn loaders() -> &'static Loaders {
    static LOADERS: OnceLock<Loaders> = OnceLock::new();
    LOADERS.get_or_init(Default::default)
}

/// Whether the module-level functions made a loader for `device` (and so opened its GPU).
pub(crate) fn has_shared_loader(device: usize) -> bool {
    loaders().lock().contains_key(&device)
}

/// The value kept in `map` under `key`, or a new one from `make` (run without the GIL and
/// without the lock, since opening GPUs takes a while) kept there.
pub(crate) fn kept<K: std::hash::Hash + Eq, V: Send + Sync>(
    py: Python<'_>,
    map: &Mutex<HashMap<K, Arc<V>>>,
    key: K,
    make: impl FnOnce() -> gpufeed::Result<V> + Send,
) -> PyResult<Arc<V>> {
    let _context = gpufeed::cuda::ContextGuard::new();
    if let Some(v) = map.lock().get(&key) {
        return Ok(Arc::clone(v));
    }
    let made = Arc::new(py.detach(make).map_err(py_err)?);
    Ok(Arc::clone(map.lock().entry(key).or_insert(made)))
}

/// One loader per device for the module-level functions.
pub(crate) fn shared_loader(py: Python<'_>, device: usize) -> PyResult<Arc<gpufeed::Loader>> {
    kept(py, loaders(), device, || {
        Ok(gpufeed::Loader::open(
            device,
            gpufeed::LoadOptions::default(),
        )?)
    })
}

/// One loader per device for the module-level functions' loads of objects
/// (`LoadOptions::for_objects`: fewer fill threads, larger pieces, twice the bytes in flight).
pub(crate) fn shared_object_loader(
    py: Python<'_>,
    device: usize,
) -> PyResult<Arc<gpufeed::Loader>> {
    kept(py, object_loaders(), device, || {
        Ok(gpufeed::Loader::open(
            device,
            gpufeed::LoadOptions::for_objects(),
        )?)
    })
}

/// Whether the module-level functions made the loader `shared_loader_for(device, path)`
/// gives (and so opened the GPU and read no header twice).
pub(crate) fn has_shared_loader_for(device: usize, path: &std::path::Path) -> bool {
    if object_url(path).is_some() {
        object_loaders().lock().contains_key(&device)
    } else {
        has_shared_loader(device)
    }
}

fn object_loaders() -> &'static Loaders {
    static LOADERS: OnceLock<Loaders> = OnceLock::new();
    LOADERS.get_or_init(Default::default)
}

/// The shared loader of `device` for `path`: the objects' for an object URL, else the files'.
pub(crate) fn shared_loader_for(
    py: Python<'_>,
    device: usize,
    path: &std::path::Path,
) -> PyResult<Arc<gpufeed::Loader>> {
    if object_url(path).is_some() {
        shared_object_loader(py, device)
    } else {
        shared_loader(py, device)
    }
}

/// `gpufeed.load_file` with this device's shared loader.
#[pyfunction]
#[pyo3(signature = (path, device=0))]
pub(crate) fn load_file(py: Python<'_>, path: PathBuf, device: usize) -> PyResult<Array> {
    Loader {
        inner: shared_loader_for(py, device, &path)?,
        restore: KeepContext::default(),
    }
    .load_file(py, path)
}

/// `gpufeed.load_range` with this device's shared loader.
#[pyfunction]
#[pyo3(signature = (path, start, end, device=0))]
pub(crate) fn load_range(
    py: Python<'_>,
    path: PathBuf,
    start: u64,
    end: u64,
    device: usize,
) -> PyResult<Array> {
    Loader {
        inner: shared_loader_for(py, device, &path)?,
        restore: KeepContext::default(),
    }
    .load_range(py, path, start, end)
}

/// `path` as an object URL (`s3://`, `http(s)://`), where it is one.
pub(crate) fn object_url(path: &std::path::Path) -> Option<&str> {
    path.to_str()
        .filter(|p| gpufeed::object::ObjectUrl::is_url(p))
}

/// Objects `urls` fetched into the cache directory `cache` (made private where missing; see
/// `gpufeed_load::object::ObjectCache`), in order: each one's local path, a version already
/// there not fetched again.
pub(crate) fn fetch_to_cache(
    urls: &[String],
    cache: &std::path::Path,
) -> gpufeed::Result<Vec<PathBuf>> {
    let cache = gpufeed::object::ObjectCache::open(cache)?;
    urls.iter()
        .map(|url| {
            let object = gpufeed::object::Object::open(url, &Default::default())
                .map_err(gpufeed::load::Error::Object)?;
            Ok(cache.fetch(&object)?.path)
        })
        .collect()
}

/// `gpufeed.fetch_objects`: objects into a local cache directory, their local paths.
#[pyfunction]
pub(crate) fn fetch_objects(
    py: Python<'_>,
    urls: Vec<String>,
    cache: PathBuf,
) -> PyResult<Vec<PathBuf>> {
    py.detach(|| fetch_to_cache(&urls, &cache)).map_err(py_err)
}

/// `gpufeed.read_object`: bytes `start..end` of an object (`end` None: to its end) into a new
/// `bytes`, written in place by ranged GETs in parallel.
#[pyfunction]
#[pyo3(signature = (url, start=0, end=None))]
pub(crate) fn read_object<'py>(
    py: Python<'py>,
    url: &str,
    start: u64,
    end: Option<u64>,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let object_err = |e| py_err(gpufeed::load::Error::Object(e));
    let object = py
        .detach(|| gpufeed::object::Object::open(url, &Default::default()))
        .map_err(object_err)?;
    let end = end.unwrap_or(object.len());
    if end < start || end > object.len() {
        return Err(GpufeedError::new_err(format!(
            "{url}: bytes {start}..{end} asked for, but the object has {} bytes",
            object.len()
        )));
    }
    let len = isize::try_from(end - start)
        .map_err(|_| GpufeedError::new_err(format!("{url}: too large for memory")))?;
    // A new `bytes` zeroed by several threads, then filled by the GETs in place
    // (`PyBytes::new_with` zeroes it on this thread with the GIL held: at 4 GiB that took
    // longer than the GETs, GPU run 133).
    #[allow(
        unsafe_code,
        reason = "a new bytes object, zeroed, then filled before it is shared"
    )]
    // SAFETY: `PyBytes_FromStringAndSize(NULL, len)` returns a new bytes object of `len`
    // uninitialized bytes (or NULL with an exception set, which `from_owned_ptr_or_err`
    // returns), owned here alone: no other Python code can reach it until this function
    // returns it (or drops it unshared on an error). Its buffer (`PyBytes_AsString`) stays put
    // while the object lives, and the object lives in `bytes` across the GIL-free work. The
    // buffer is written through raw pointers only (`write_bytes` on disjoint parts) until
    // every byte is initialized; only then is a slice made of it.
    unsafe {
        let ptr = pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), len);
        let bytes = Bound::from_owned_ptr_or_err(py, ptr)
            .map_err(|e| {
                if e.is_instance_of::<pyo3::exceptions::PyMemoryError>(py) {
                    GpufeedError::new_err(format!(
                        "{url}: {len} bytes do not fit in this process's memory: read a range \
                         of it (start=, end=)"
                    ))
                } else {
                    e
                }
            })?
            .cast_into_unchecked::<pyo3::types::PyBytes>();
        let data = pyo3::ffi::PyBytes_AsString(ptr).cast::<u8>();
        if data.is_null() {
            return Err(PyErr::fetch(py));
        }
        let len = len as usize;
        let addr = data as usize;
        py.detach(|| {
            let threads = std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .clamp(1, 16);
            let part = len.div_ceil(threads).next_multiple_of(1 << 16).max(1 << 16);
            std::thread::scope(|scope| {
                for at in (0..len).step_by(part) {
                    let n = part.min(len - at);
                    // A part of the new buffer that no other thread writes.
                    let zero = move || std::ptr::write_bytes((addr + at) as *mut u8, 0, n);
                    let spawned = std::thread::Builder::new()
                        .name("gpufeed-zero".into())
                        .spawn_scoped(scope, zero);
                    if spawned.is_err() {
                        zero(); // no thread to be had: this one does it
                    }
                }
            });
            // Every byte is initialized now, and nothing else refers to the buffer.
            let buf = std::slice::from_raw_parts_mut(addr as *mut u8, len);
            object.read_exact_at(start, buf)
        })
        .map_err(object_err)?;
        Ok(bytes)
    }
}
