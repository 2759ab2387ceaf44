//! # gpufeed-py — layer 3 of gpufeed: the Python package `gpufeed`
//!
//! Files, safetensors checkpoints and dataset batches on the GPU as zero-copy PyTorch tensors:
//! the native module `gpufeed._gpufeed` hands GPU (or host) memory out as [`Array`]s, which
//! speak the DLPack protocol (`__dlpack__`, `__dlpack_device__`, through the `dlpark` crate);
//! the Python layer (`python/gpufeed/__init__.py`) turns them into `torch.Tensor`s with
//! `torch.from_dlpack`, or leaves them to any DLPack consumer (numpy for host batches).
//!
//! Memory: an array holds its owner (a device buffer, a whole checkpoint, a host batch) through
//! an `Arc`; every exported tensor holds another, released by the DLPack deleter. When the last
//! one goes, device memory is handed to a thread that frees it after the GPU finished the work
//! queued before (it synchronizes the context: a consumer's kernels on its own streams may
//! still read it), so that dropping a tensor never waits for the GPU; a load first waits for
//! what is pending there, so the memory is back before it allocates. Loads
//! return with the bytes on the GPU (the load synchronized its copies), so an export needs no
//! event on the consumer's stream. gpufeed opens each GPU's primary context, the one PyTorch
//! uses, so the pointers are valid in torch's context.
//!
//! Depends on `gpufeed` (the facade) only.
//!
//! # Example
//! ```text
//! pip install ./crates/gpufeed-py
//! python -c 'import gpufeed; t = gpufeed.load_file("data/shard-000.bin"); print(t.shape, t.device)'
//! ```

#![deny(unsafe_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, mpsc};

use dlpark::ffi::{DLDataType, DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::{DlpackExporter, ExportRequest, export_dlpack};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use gpufeed::cuda::cudarc::driver::DevicePtr;
use gpufeed::dataset::{
    BatchData, Dataset, ImageFolder, Order, Position, RecordFile, Sampler, ShardSet,
};
use gpufeed::safetensors::Dtype;
use pyo3::exceptions::{PyException, PyStopIteration};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

pyo3::create_exception!(
    _gpufeed,
    GpufeedError,
    PyException,
    "An error of gpufeed; the message says what went wrong and what to do."
);
pyo3::create_exception!(
    _gpufeed,
    NoGpuError,
    GpufeedError,
    "No usable GPU (no CUDA driver, no such device): the CPU paths still work."
);

/// A gpufeed error as the Python exception with the same message.
fn py_err(e: gpufeed::Error) -> PyErr {
    if e.is_no_gpu() {
        NoGpuError::new_err(e.to_string())
    } else {
        GpufeedError::new_err(e.to_string())
    }
}

/// What keeps an array's memory alive (held, never read: dropping it frees the memory).
#[allow(dead_code, reason = "each variant is held for its Drop")]
enum Storage {
    /// GPU memory of a load.
    Device(gpufeed::DeviceBuffer),
    /// A checkpoint: one device buffer per file, shared by all its tensors.
    Checkpoint(gpufeed::safetensors::Checkpoint),
    /// A host batch (pinned, or locked in CPU mode).
    Host(gpufeed::pinned::PooledBuffer),
}

/// The owner shared by an array and every tensor exported from it.
struct Owner {
    /// Always `Some` until the drop hands it on.
    storage: Option<Storage>,
    /// The GPU whose queued work must finish before device memory is freed.
    gpu: Option<gpufeed::Gpu>,
}

impl Owner {
    fn new(storage: Storage, gpu: Option<gpufeed::Gpu>) -> Self {
        Owner {
            storage: Some(storage),
            gpu,
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        let Some(storage) = self.storage.take() else {
            return;
        };
        let Some(gpu) = self.gpu.take() else {
            return; // host memory: no device work can still read it
        };
        // A consumer (torch) may still have kernels queued that read this memory, on streams
        // gpufeed does not know: it is freed after the device's queued work, on the reaper's
        // thread, so that the Python thread dropping the last tensor (a training loop moving
        // to its next batch) does not wait for the GPU.
        reaper::free_later(gpu, storage);
    }
}

/// A Python object's last field: its `Drop` stores a [`gpufeed::cuda::ContextGuard`] here
/// before the other fields go (they may bind their GPU's context to the dropping thread:
/// streams, staging, device memory), and the guard, dropped after them, puts back the context
/// that was current (torch's device).
#[derive(Default)]
struct KeepContext(Option<gpufeed::cuda::ContextGuard>);

impl KeepContext {
    fn arm(&mut self) {
        self.0 = Some(gpufeed::cuda::ContextGuard::new());
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.restore.arm();
    }
}

impl Drop for BatchLoader {
    fn drop(&mut self) {
        self.restore.arm();
    }
}

impl Drop for EpochIter {
    fn drop(&mut self) {
        self.restore.arm();
    }
}

/// Waits for `gpu`'s queued work, then frees `storage`.
fn free_after_queued_work(gpu: &gpufeed::Gpu, storage: Storage) {
    if let Err(e) = gpu.context().synchronize() {
        eprintln!("gpufeed: synchronizing before freeing device memory failed: {e}");
    }
    drop(storage);
}

/// The thread that frees device memory let go by Python objects, after the work queued on the
/// device before it (one `cuCtxSynchronize` per device per round, whatever the number of
/// buffers). A round gathers what is let go within [`reaper::GATHER`] of its first buffer, so
/// that a loop taking tensors and dropping them pays one synchronization per round, not one
/// per tensor. A load of 64 MiB or more waits for what is pending first
/// ([`reaper::wait_idle_before`], which cuts the round's gathering short), so that memory a
/// caller has let go is back before the next load asks for its own.
mod reaper {
    use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
    use std::sync::{Condvar, Mutex, OnceLock};
    use std::time::{Duration, Instant};

    use super::{Storage, free_after_queued_work};

    type Item = (gpufeed::Gpu, Storage);

    /// What the reaper is told: free this, or free what is pending now (someone waits).
    enum Msg {
        Free(Box<Item>),
        Hurry,
    }

    /// How long a round gathers further buffers after its first: each round's synchronization
    /// holds up the loads running meanwhile (a loop taking 430 KB tensors and dropping each
    /// paid 16-26 us per tensor over one keeping them with a round per tensor, 10-16 us with
    /// rounds gathered; GPU runs 102-103).
    pub(super) const GATHER: Duration = Duration::from_micros(500);

    struct Reaper {
        tx: Mutex<Sender<Msg>>,
        /// Items handed over and not yet freed.
        pending: Mutex<usize>,
        idle: Condvar,
    }

    fn reaper() -> Option<&'static Reaper> {
        static REAPER: OnceLock<Option<Reaper>> = OnceLock::new();
        REAPER
            .get_or_init(|| {
                let (tx, rx) = channel::<Msg>();
                std::thread::Builder::new()
                    .name("gpufeed-free".into())
                    .spawn(move || run(&rx))
                    .ok()
                    .map(|_| Reaper {
                        tx: Mutex::new(tx),
                        pending: Mutex::new(0),
                        idle: Condvar::new(),
                    })
            })
            .as_ref()
    }

    fn run(rx: &Receiver<Msg>) {
        while let Ok(first) = rx.recv() {
            let Msg::Free(first) = first else {
                continue; // nothing pending to hurry
            };
            let mut round = vec![*first];
            let until = Instant::now() + GATHER;
            loop {
                let left = until.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left) {
                    Ok(Msg::Free(item)) => round.push(*item),
                    Ok(Msg::Hurry) | Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            let n = round.len();
            let mut synced: Vec<usize> = Vec::new();
            for (gpu, storage) in round {
                let ordinal = gpu.info().ordinal;
                if synced.contains(&ordinal) {
                    drop(storage);
                } else {
                    synced.push(ordinal);
                    free_after_queued_work(&gpu, storage);
                }
            }
            if let Some(r) = reaper()
                && let Ok(mut pending) = r.pending.lock()
            {
                *pending = pending.saturating_sub(n);
                r.idle.notify_all();
            }
        }
    }

    /// Frees `storage` after `gpu`'s queued work: on the reaper's thread, or on this one
    /// (waiting) where the thread could not start.
    pub(super) fn free_later(gpu: gpufeed::Gpu, storage: Storage) {
        let Some(r) = reaper() else {
            return free_after_queued_work(&gpu, storage);
        };
        let (Ok(tx), Ok(mut pending)) = (r.tx.lock(), r.pending.lock()) else {
            return free_after_queued_work(&gpu, storage);
        };
        *pending += 1;
        if let Err(back) = tx.send(Msg::Free(Box::new((gpu, storage)))) {
            *pending -= 1;
            drop((tx, pending));
            if let Msg::Free(item) = back.0 {
                let (gpu, storage) = *item;
                free_after_queued_work(&gpu, storage);
            }
        }
    }

    /// Loads of fewer bytes do not wait for the reaper ([`wait_idle_before`]).
    const WAIT_FROM: u64 = 64 << 20;

    /// Before a load of `bytes`: [`wait_idle`] where the load is large enough for the memory
    /// let go to matter (64 MiB and more). A small load does not wait: the hand-off to the
    /// reaper and its context synchronization cost 20-40 us, as much as a registered load of
    /// 1 MiB itself (a loop of `get_tensor` calls over 430 KB tensors ran at 57 us per
    /// tensor while each waited; docs/benchmarks.md, GPU run 76), and what is pending is
    /// freed a moment later anyway.
    pub(super) fn wait_idle_before(bytes: u64) {
        if bytes >= WAIT_FROM {
            wait_idle();
        }
    }

    /// Returns once everything handed over so far is freed (a round still gathering is cut
    /// short).
    pub(super) fn wait_idle() {
        let Some(r) = reaper() else {
            return;
        };
        // Not holding `pending` while taking `tx` (`free_later` takes them the other way).
        if r.pending.lock().is_ok_and(|p| *p > 0)
            && let Ok(tx) = r.tx.lock()
        {
            let _ = tx.send(Msg::Hurry);
        }
        let Ok(mut pending) = r.pending.lock() else {
            return;
        };
        while *pending > 0 {
            match r.idle.wait(pending) {
                Ok(p) => pending = p,
                Err(_) => return,
            }
        }
    }
}

/// A block of memory with a dtype and shape, on the GPU or the host, that any DLPack consumer
/// takes without a copy: `torch.from_dlpack(a)`, `numpy.from_dlpack(a)` (host arrays).
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct Array {
    owner: Arc<Owner>,
    /// Base address of the owner's buffer (device or host).
    base: usize,
    byte_offset: u64,
    nbytes: usize,
    dtype: DLDataType,
    dtype_name: &'static str,
    shape: Vec<i64>,
    device: DLDevice,
}

impl Array {
    fn export<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let mut tensor = Dynamic::compact(self.shape.clone())
            .initialize_as::<M>(Arc::clone(&self.owner))
            .map_err(|e| GpufeedError::new_err(format!("DLPack export: {e}")))?;
        // The offset goes into the pointer: torch refuses a nonzero `byte_offset`.
        tensor
            .set_data((self.base + self.byte_offset as usize) as *mut std::ffi::c_void)
            .set_byte_offset(0)
            .set_dtype(self.dtype)
            .set_device(self.device);
        #[allow(unsafe_code, reason = "the DLPack descriptor's promise")]
        // SAFETY: `base + byte_offset .. + nbytes` lies in the owner's buffer, which the
        // tensor's context (an Arc of the owner) keeps alive until the deleter runs; the shape
        // with compact strides covers exactly `nbytes`; the memory is writable, so no flags.
        Ok(unsafe { tensor.finish() })
    }
}

impl DlpackExporter for Array {
    fn device(&self) -> DLDevice {
        self.device
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        // Loads and batches are complete when handed out (their copies were synchronized):
        // the bytes are ready on every stream.
        Ok(())
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.export()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.export()
    }
}

#[pymethods]
impl Array {
    /// The DLPack protocol: a capsule of this array (zero-copy).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream.as_ref(), max_version, dl_device, copy)?;
        export_dlpack(self, py, request)
    }

    /// The DLPack protocol: `(device type, device id)`; 2 is CUDA, 1 the CPU.
    fn __dlpack_device__(&self) -> (u32, i32) {
        (self.device.device_type.0, self.device.device_id)
    }

    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.shape.clone()
    }

    /// The element type's safetensors name (`U8`, `BF16`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype_name
    }

    /// Bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// `cuda:N` or `cpu`.
    #[getter]
    fn device(&self) -> String {
        if self.device.device_type == DLDeviceType::CUDA {
            format!("cuda:{}", self.device.device_id)
        } else {
            "cpu".into()
        }
    }

    /// Bytes `start..end` of this array as an array of `dtype` (a safetensors name) and
    /// `shape`, sharing its memory.
    fn view_of(&self, start: usize, end: usize, dtype: &str, shape: Vec<i64>) -> PyResult<Array> {
        let bad = |why: String| GpufeedError::new_err(format!("invalid setting: {why}"));
        if start > end || end > self.nbytes {
            return Err(bad(format!(
                "bytes {start}..{end} of an array of {} bytes",
                self.nbytes
            )));
        }
        let parsed: Dtype = serde_json::from_value(serde_json::Value::String(dtype.into()))
            .map_err(|_| bad(format!("unknown dtype {dtype:?}")))?;
        let (dl, name) = dlpack_dtype(parsed).map_err(GpufeedError::new_err)?;
        let elems: i64 = shape.iter().product();
        if shape.iter().any(|&d| d < 0)
            || elems as u128 * u128::from(dl.bits) != (end - start) as u128 * 8
        {
            return Err(bad(format!(
                "shape {shape:?} of {name} does not fill {} bytes",
                end - start
            )));
        }
        Ok(Array {
            owner: Arc::clone(&self.owner),
            base: self.base,
            byte_offset: self.byte_offset + start as u64,
            nbytes: end - start,
            dtype: dl,
            dtype_name: name,
            shape,
            device: self.device,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "gpufeed.Array(shape={:?}, dtype={}, device={})",
            self.shape,
            self.dtype_name,
            self.device()
        )
    }
}

/// The DLPack type of a safetensors dtype, or why torch cannot take it through DLPack.
pub fn dlpack_dtype(dtype: Dtype) -> Result<(DLDataType, &'static str), String> {
    Ok(match dtype {
        Dtype::BOOL => (DLDataType::BOOL, "BOOL"),
        Dtype::U8 => (DLDataType::U8, "U8"),
        Dtype::I8 => (DLDataType::I8, "I8"),
        Dtype::U16 => (DLDataType::U16, "U16"),
        Dtype::I16 => (DLDataType::I16, "I16"),
        Dtype::U32 => (DLDataType::U32, "U32"),
        Dtype::I32 => (DLDataType::I32, "I32"),
        Dtype::U64 => (DLDataType::U64, "U64"),
        Dtype::I64 => (DLDataType::I64, "I64"),
        Dtype::F16 => (DLDataType::F16, "F16"),
        Dtype::BF16 => (DLDataType::BF16, "BF16"),
        Dtype::F32 => (DLDataType::F32, "F32"),
        Dtype::F64 => (DLDataType::F64, "F64"),
        // safetensors' F8_E4M3 is torch.float8_e4m3fn (no infinities), F8_E5M2 the IEEE-like one.
        Dtype::F8_E4M3 => (DLDataType::F8E4M3FN, "F8_E4M3"),
        Dtype::F8_E5M2 => (DLDataType::F8E5M2, "F8_E5M2"),
        other => {
            return Err(format!(
                "dtype {other:?} has no DLPack type that torch imports; load the file with \
                 gpufeed.load_file and reinterpret its bytes"
            ));
        }
    })
}

fn cuda(ordinal: usize) -> DLDevice {
    DLDevice {
        device_type: DLDeviceType::CUDA,
        device_id: i32::try_from(ordinal).unwrap_or(i32::MAX),
    }
}

/// One file's tensors as the Python layer takes them (see `Loader.load_safetensors_files`).
type FileTensors = (Array, Vec<DtypeGroup>, Vec<OddTensor>);
/// `(dtype, element size, names, shapes, strides, element offsets)` of one dtype's tensors;
/// shapes and strides are tuples (a tuple of ints is untracked by Python's garbage collector,
/// a list is not).
type DtypeGroup = (
    &'static str,
    usize,
    Vec<String>,
    Vec<Py<PyTuple>>,
    Vec<Py<PyTuple>>,
    Vec<usize>,
);
/// `(name, dtype, shape, start, end)` of a tensor at an offset its element size does not divide.
type OddTensor = (String, &'static str, Vec<usize>, usize, usize);

/// A loaded checkpoint as `Loader.load_safetensors_files` hands it to Python: per file
/// `(array, groups, odd)` (see there). A dtype torch cannot take is refused before any tensor
/// is handed out.
fn checkpoint_files(
    py: Python<'_>,
    ckpt: gpufeed::safetensors::Checkpoint,
) -> PyResult<Vec<FileTensors>> {
    let gpu = ckpt.gpu().clone();
    let device = cuda(gpu.info().ordinal);
    let files: Vec<(usize, usize)> = (0..ckpt.files().len())
        .map(|i| {
            ckpt.buffer(i)
                .map_or((0, 0), |b| (device_address(&gpu, b), b.len()))
        })
        .collect();
    let mut groups: Vec<Vec<DtypeGroup>> = files.iter().map(|_| Vec::new()).collect();
    let mut odd: Vec<Vec<OddTensor>> = vec![Vec::new(); files.len()];
    for name in ckpt.names() {
        let Some(info) = ckpt.info(name) else {
            continue;
        };
        let (_, dtype_name) = dlpack_dtype(info.dtype).map_err(|why| {
            GpufeedError::new_err(format!(
                "{}: tensor {name}: {why}",
                ckpt.files()[info.file].display()
            ))
        })?;
        // Every dtype `dlpack_dtype` takes is whole bytes wide.
        let size = (info.dtype.bitsize() / 8).max(1);
        if info.range.start % size != 0 {
            odd[info.file].push((
                name.to_owned(),
                dtype_name,
                info.shape.clone(),
                info.range.start,
                info.range.end,
            ));
            continue;
        }
        let file = &mut groups[info.file];
        let at = match file.iter().position(|g| g.0 == dtype_name) {
            Some(at) => at,
            None => {
                file.push((dtype_name, size, vec![], vec![], vec![], vec![]));
                file.len() - 1
            }
        };
        let g = &mut file[at];
        g.2.push(name.to_owned());
        g.3.push(PyTuple::new(py, &info.shape)?.unbind());
        g.4.push(PyTuple::new(py, contiguous_strides(&info.shape))?.unbind());
        g.5.push(info.range.start / size);
    }
    let owner = Arc::new(Owner::new(Storage::Checkpoint(ckpt), Some(gpu)));
    Ok(files
        .into_iter()
        .zip(groups.into_iter().zip(odd))
        .map(|((base, nbytes), (groups, odd))| {
            (
                Array::bytes(Arc::clone(&owner), base, nbytes, device, None),
                groups,
                odd,
            )
        })
        .collect())
}

/// Row-major strides, in elements, of a tensor of `shape`.
fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (1..shape.len()).rev() {
        strides[i - 1] = strides[i].saturating_mul(shape[i].max(1));
    }
    strides
}

/// The device address of `buf` (cudarc's guard, which orders later work on the stream, is
/// dropped at once: the buffer's copies are complete).
fn device_address(gpu: &gpufeed::Gpu, buf: &gpufeed::DeviceBuffer) -> usize {
    let stream = gpu.default_stream();
    let (ptr, _guard) = buf.device_ptr(&stream);
    ptr as usize
}

impl Array {
    /// `nbytes` bytes at `base` of `owner` as a `U8` array of `shape` (1-D where `None`).
    fn bytes(
        owner: Arc<Owner>,
        base: usize,
        nbytes: usize,
        device: DLDevice,
        shape: Option<Vec<i64>>,
    ) -> Array {
        Array {
            owner,
            base,
            byte_offset: 0,
            nbytes,
            dtype: DLDataType::U8,
            dtype_name: "U8",
            shape: shape.unwrap_or_else(|| vec![nbytes as i64]),
            device,
        }
    }
}

/// Bytes on the GPU as a 1-D `U8` array.
fn device_bytes(gpu: &gpufeed::Gpu, buf: gpufeed::DeviceBuffer) -> Array {
    let base = device_address(gpu, &buf);
    let nbytes = buf.len();
    let owner = Arc::new(Owner::new(Storage::Device(buf), Some(gpu.clone())));
    Array::bytes(owner, base, nbytes, cuda(gpu.info().ordinal), None)
}

fn strategy(name: &str) -> PyResult<gpufeed::Strategy> {
    name.parse().map_err(py_err)
}

/// A reusable loader of one GPU: its pinned staging and threads serve every load.
///
/// `gpufeed.load_file` and `gpufeed.load_safetensors` keep one per device; make one yourself
/// for other options.
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct Loader {
    inner: Arc<gpufeed::Loader>,
    /// Set when dropped, dropped last: see [`KeepContext`].
    restore: KeepContext,
}

impl Loader {
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
    /// A loader of GPU `device` with a strategy: `auto`, `registered`, `staged` or `direct`.
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
    fn load_safetensors_files(&self, py: Python<'_>, path: PathBuf) -> PyResult<Vec<FileTensors>> {
        let _context = gpufeed::cuda::ContextGuard::new();
        // The headers are read once, by the load (a second parse would cost 0.2-0.3 us per
        // tensor); a dtype torch cannot take is refused after it, before any tensor is handed
        // out.
        let inner = Arc::clone(&self.inner);
        let ckpt = py
            .detach(move || {
                reaper::wait_idle();
                gpufeed::safetensors::load_with(&inner, &path)
            })
            .map_err(py_err)?;
        checkpoint_files(py, ckpt)
    }

    /// Registers `path` for repeated loads (see `RegisteredFile`).
    fn register_file(&self, py: Python<'_>, path: PathBuf) -> PyResult<RegisteredFile> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let inner = Arc::clone(&self.inner);
        let file = py
            .detach(move || inner.register_file(&path))
            .map_err(py_err)?;
        Ok(RegisteredFile {
            inner: std::sync::RwLock::new(Some(file)),
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
        let held = file.held()?;
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
fn close_registered<T: Send + Sync>(
    py: Python<'_>,
    held: &std::sync::RwLock<Option<T>>,
) -> PyResult<()> {
    let _context = gpufeed::cuda::ContextGuard::new();
    py.detach(|| {
        let taken = held
            .write()
            .map_err(|_| GpufeedError::new_err("a load panicked"))?
            .take();
        drop(taken);
        Ok(())
    })
}

/// A file registered once for repeated loads (`Loader.register_file`): its cached pages stay
/// page-locked until `close` (or until the object goes), and every `Loader.load_registered`
/// is one copy by the GPU out of the page cache.
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct RegisteredFile {
    /// `None` once closed.
    inner: std::sync::RwLock<Option<gpufeed::RegisteredFile>>,
    /// Set when dropped, dropped last: see [`KeepContext`].
    restore: KeepContext,
}

impl Drop for RegisteredFile {
    fn drop(&mut self) {
        self.restore.arm();
    }
}

impl RegisteredFile {
    fn held(&self) -> PyResult<std::sync::RwLockReadGuard<'_, Option<gpufeed::RegisteredFile>>> {
        self.inner
            .read()
            .map_err(|_| GpufeedError::new_err("a load panicked"))
    }
}

#[pymethods]
impl RegisteredFile {
    /// Its length in bytes when registered.
    fn __len__(&self) -> PyResult<usize> {
        Ok(self.held()?.as_ref().map_or(0, |f| f.len() as usize))
    }

    /// The file's path (a `pathlib.Path`; `None` once closed).
    #[getter]
    fn path(&self) -> PyResult<Option<PathBuf>> {
        Ok(self.held()?.as_ref().map(|f| f.path().to_path_buf()))
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
fn has_shared_loader(device: usize) -> bool {
    loaders().lock().is_ok_and(|m| m.contains_key(&device))
}

/// The value kept in `map` under `key`, or a new one from `make` (run without the GIL and
/// without the lock, since opening GPUs takes a while) kept there.
fn kept<K: std::hash::Hash + Eq, V: Send + Sync>(
    py: Python<'_>,
    map: &Mutex<HashMap<K, Arc<V>>>,
    key: K,
    make: impl FnOnce() -> gpufeed::Result<V> + Send,
) -> PyResult<Arc<V>> {
    let _context = gpufeed::cuda::ContextGuard::new();
    let locked = || {
        map.lock()
            .map_err(|_| GpufeedError::new_err("a loader panicked"))
    };
    if let Some(v) = locked()?.get(&key) {
        return Ok(Arc::clone(v));
    }
    let made = Arc::new(py.detach(make).map_err(py_err)?);
    Ok(Arc::clone(locked()?.entry(key).or_insert(made)))
}

/// One loader per device for the module-level functions.
fn shared_loader(py: Python<'_>, device: usize) -> PyResult<Arc<gpufeed::Loader>> {
    kept(py, loaders(), device, || {
        gpufeed::Loader::open(device, gpufeed::LoadOptions::default())
    })
}

/// One multi-GPU loader per list of devices for `load_replicated` and `load_sharded`.
fn shared_multi(py: Python<'_>, devices: Vec<usize>) -> PyResult<Arc<gpufeed::multi::MultiLoader>> {
    static MULTI: OnceLock<Mutex<HashMap<Vec<usize>, Arc<gpufeed::multi::MultiLoader>>>> =
        OnceLock::new();
    let opts = gpufeed::LoadOptions::for_gpus(devices.len());
    let key = devices.clone();
    kept(py, MULTI.get_or_init(Mutex::default), key, move || {
        gpufeed::multi::MultiLoader::open(&devices, opts)
    })
}

/// All of `path` on every GPU of `devices` (each reads its share, the GPUs' peer links bring
/// the rest): one 1-D `U8` array per device, in order.
#[pyfunction]
fn load_replicated(py: Python<'_>, path: PathBuf, devices: Vec<usize>) -> PyResult<Vec<Array>> {
    let multi = shared_multi(py, devices)?;
    let _context = gpufeed::cuda::ContextGuard::new();
    let m = Arc::clone(&multi);
    let bufs = py
        .detach(move || {
            reaper::wait_idle();
            m.load_replicated(&path).map(|(bufs, _)| bufs)
        })
        .map_err(py_err)?;
    Ok(bufs
        .into_iter()
        .zip(multi.loaders())
        .map(|(buf, l)| device_bytes(l.gpu(), buf))
        .collect())
}

/// The files `paths` read as one stream and cut into one share per device (4 KiB-aligned,
/// nearly equal): one 1-D `U8` array per device, in order, and each share's `(file index,
/// start, end)` pieces.
#[pyfunction]
#[allow(clippy::type_complexity, reason = "the tuple is the Python shape")]
fn load_sharded(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    devices: Vec<usize>,
) -> PyResult<(Vec<Array>, Vec<Vec<(usize, u64, u64)>>)> {
    let plan = gpufeed::multi::ShardPlan::split_bytes(&paths, devices.len()).map_err(py_err)?;
    let multi = shared_multi(py, devices)?;
    let _context = gpufeed::cuda::ContextGuard::new();
    let (m, p) = (Arc::clone(&multi), plan.clone());
    let bufs = py
        .detach(move || {
            reaper::wait_idle();
            m.load_sharded(&p).map(|(bufs, _)| bufs)
        })
        .map_err(py_err)?;
    let pieces = (0..plan.ranks())
        .map(|r| {
            plan.spans(r)
                .iter()
                .map(|s| (s.file, s.range.start, s.range.end))
                .collect()
        })
        .collect();
    let arrays = bufs
        .into_iter()
        .zip(multi.loaders())
        .map(|(buf, l)| device_bytes(l.gpu(), buf))
        .collect();
    Ok((arrays, pieces))
}

/// This process's rank of a `torchrun` job on this machine (`LOCAL_RANK` of
/// `LOCAL_WORLD_SIZE`), joined once per process.
fn rank_loader(py: Python<'_>) -> PyResult<Arc<gpufeed::multi::RankLoader>> {
    static RANK: OnceLock<Mutex<Option<Arc<gpufeed::multi::RankLoader>>>> = OnceLock::new();
    let cell = RANK.get_or_init(Mutex::default);
    let mut held = cell
        .lock()
        .map_err(|_| GpufeedError::new_err("a loader panicked"))?;
    if let Some(r) = held.as_ref() {
        return Ok(Arc::clone(r));
    }
    let _context = gpufeed::cuda::ContextGuard::new();
    let made = Arc::new(
        py.detach(gpufeed::multi::RankLoader::from_env)
            .map_err(py_err)?,
    );
    *held = Some(Arc::clone(&made));
    Ok(made)
}

/// All of `path` on this rank's GPU, each rank of the job reading its share, which the other
/// ranks copy out of staging slots they all map (CUDA IPC), or receive through NCCL
/// (`GPUFEED_REPLICATE=nccl`: `RankLoader::from_env`): `(array, rank, world)`.
/// Collective: every rank calls it with the same file.
#[pyfunction]
fn load_replicated_rank(py: Python<'_>, path: PathBuf) -> PyResult<(Array, usize, usize)> {
    let rank = rank_loader(py)?;
    let _context = gpufeed::cuda::ContextGuard::new();
    let r = Arc::clone(&rank);
    let buf = py
        .detach(move || {
            reaper::wait_idle();
            r.load_replicated(&path).map(|(buf, _)| buf)
        })
        .map_err(py_err)?;
    Ok((
        device_bytes(rank.loader().gpu(), buf),
        rank.rank(),
        rank.world(),
    ))
}

/// The tensor-parallel cut of dimension `dim`: 0 is rows, 1 columns.
fn split_of(dim: usize) -> gpufeed::safetensors::Split {
    use gpufeed::safetensors::Split;
    match dim {
        0 => Split::Rows,
        1 => Split::Columns,
        d => Split::Dim(d),
    }
}

/// A safetensors checkpoint (file or index) cut for tensor parallelism along `dim` over
/// `devices`: per device, its share as `load_safetensors_files` hands a checkpoint over.
/// Headers are checked and the plan made before any GPU is opened.
#[pyfunction]
#[allow(clippy::type_complexity, reason = "the tuple is the Python shape")]
fn load_tensor_parallel_files(
    py: Python<'_>,
    path: PathBuf,
    devices: Vec<usize>,
    dim: usize,
) -> PyResult<Vec<Vec<FileTensors>>> {
    let ranks = devices.len();
    let plan = py
        .detach(|| gpufeed::safetensors::TensorParallel::plan(&path, ranks, split_of(dim)))
        .map_err(py_err)?;
    multi_checkpoints(py, devices, move |m| {
        m.load_tensor_parallel(&plan).map(|(c, _)| c)
    })
}

/// The checkpoints `load` puts on the GPUs of `devices` (their kept multi-GPU loader), each
/// as `load_safetensors_files` hands one over.
fn multi_checkpoints(
    py: Python<'_>,
    devices: Vec<usize>,
    load: impl FnOnce(
        &gpufeed::multi::MultiLoader,
    ) -> gpufeed::Result<Vec<gpufeed::safetensors::Checkpoint>>
    + Send,
) -> PyResult<Vec<Vec<FileTensors>>> {
    let multi = shared_multi(py, devices)?;
    let _context = gpufeed::cuda::ContextGuard::new();
    let ckpts = py
        .detach(|| {
            reaper::wait_idle();
            load(&multi)
        })
        .map_err(py_err)?;
    ckpts.into_iter().map(|c| checkpoint_files(py, c)).collect()
}

/// A whole safetensors checkpoint on every GPU of `devices` (each reads its share of every
/// file, the peer links bring the rest): per device, as `load_safetensors_files`.
#[pyfunction]
#[allow(clippy::type_complexity, reason = "the tuple is the Python shape")]
fn load_replicated_safetensors_files(
    py: Python<'_>,
    path: PathBuf,
    devices: Vec<usize>,
) -> PyResult<Vec<Vec<FileTensors>>> {
    // Before the GPUs are opened: a bad file is named even on a machine without one.
    py.detach(|| gpufeed::safetensors::inspect(&path))
        .map_err(py_err)?;
    multi_checkpoints(py, devices, move |m| {
        m.load_replicated_safetensors(&path).map(|(c, _)| c)
    })
}

/// This rank's tensor-parallel share (along `dim`) of a safetensors checkpoint, in a job
/// `torchrun` started: `(files, rank, world)`. Collective: every rank calls it with the same
/// checkpoint and dimension (a rank given another plan is named in every rank's error).
#[pyfunction]
#[allow(clippy::type_complexity, reason = "the tuple is the Python shape")]
fn load_tensor_parallel_rank_files(
    py: Python<'_>,
    path: PathBuf,
    dim: usize,
) -> PyResult<(Vec<FileTensors>, usize, usize)> {
    // Before joining the job: a bad file is named on every rank alike, none waits for another.
    py.detach(|| gpufeed::safetensors::inspect(&path))
        .map_err(py_err)?;
    let rank = rank_loader(py)?;
    let world = rank.world();
    let plan = py
        .detach(|| gpufeed::safetensors::TensorParallel::plan(&path, world, split_of(dim)))
        .map_err(py_err)?;
    let _context = gpufeed::cuda::ContextGuard::new();
    let r = Arc::clone(&rank);
    let ckpt = py
        .detach(move || {
            reaper::wait_idle();
            r.load_tensor_parallel(&plan).map(|(c, _)| c)
        })
        .map_err(py_err)?;
    Ok((checkpoint_files(py, ckpt)?, rank.rank(), world))
}

/// `gpufeed.load_file` with this device's shared loader.
#[pyfunction]
#[pyo3(signature = (path, device=0))]
fn load_file(py: Python<'_>, path: PathBuf, device: usize) -> PyResult<Array> {
    Loader {
        inner: shared_loader(py, device)?,
        restore: KeepContext::default(),
    }
    .load_file(py, path)
}

/// `gpufeed.load_range` with this device's shared loader.
#[pyfunction]
#[pyo3(signature = (path, start, end, device=0))]
fn load_range(
    py: Python<'_>,
    path: PathBuf,
    start: u64,
    end: u64,
    device: usize,
) -> PyResult<Array> {
    Loader {
        inner: shared_loader(py, device)?,
        restore: KeepContext::default(),
    }
    .load_range(py, path, start, end)
}

/// `load_safetensors_files` with this device's shared loader (headers checked before the GPU
/// is opened).
#[pyfunction]
#[pyo3(signature = (path, device=0))]
#[allow(clippy::type_complexity, reason = "the tuple is the Python shape")]
fn load_safetensors_files(
    py: Python<'_>,
    path: PathBuf,
    device: usize,
) -> PyResult<Vec<FileTensors>> {
    if !has_shared_loader(device) {
        // Before the GPU is opened: a bad file is named even on a machine without one.
        py.detach(|| gpufeed::safetensors::inspect(&path))
            .map_err(py_err)?;
    }
    Loader {
        inner: shared_loader(py, device)?,
        restore: KeepContext::default(),
    }
    .load_safetensors_files(py, path)
}

/// A safetensors file or index whose tensors load one at a time, when asked (what
/// `gpufeed.safe_open` wraps): every file registered once, each tensor one copy by the GPU out
/// of the page cache into memory of its own.
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct OnDemand {
    loader: Arc<gpufeed::Loader>,
    /// `None` once closed (the files' registrations undone).
    inner: std::sync::RwLock<Option<gpufeed::safetensors::OnDemand>>,
    /// Set when dropped, dropped last: see [`KeepContext`].
    restore: KeepContext,
}

impl Drop for OnDemand {
    fn drop(&mut self) {
        self.restore.arm();
    }
}

#[pymethods]
impl OnDemand {
    /// Checks the headers of `path` (before a GPU is opened, so a bad file is named on any
    /// machine) and registers its files for GPU `device`'s shared loader.
    #[new]
    #[pyo3(signature = (path, device=0))]
    fn py_new(py: Python<'_>, path: PathBuf, device: usize) -> PyResult<Self> {
        if !has_shared_loader(device) {
            py.detach(|| gpufeed::safetensors::inspect(&path))
                .map_err(py_err)?;
        }
        let loader = shared_loader(py, device)?;
        let _context = gpufeed::cuda::ContextGuard::new();
        let l = Arc::clone(&loader);
        let inner = py
            .detach(move || gpufeed::safetensors::OnDemand::open(&l, &path))
            .map_err(py_err)?;
        Ok(OnDemand {
            loader,
            inner: std::sync::RwLock::new(Some(inner)),
            restore: KeepContext::default(),
        })
    }

    /// Tensor names, sorted.
    fn keys(&self) -> PyResult<Vec<String>> {
        self.with(|c| Ok(c.names().map(str::to_owned).collect()))
    }

    /// Whether the checkpoint has a tensor `name`.
    fn __contains__(&self, name: &str) -> PyResult<bool> {
        self.with(|c| Ok(c.info(name).is_some()))
    }

    fn __len__(&self) -> PyResult<usize> {
        self.with(|c| Ok(c.len()))
    }

    /// The tensor `name` on the GPU, in memory of its own: an array of its dtype and shape.
    fn get(&self, py: Python<'_>, name: &str) -> PyResult<Array> {
        let _context = gpufeed::cuda::ContextGuard::new();
        self.with(|c| {
            let info = c.info(name).ok_or_else(|| {
                GpufeedError::new_err(format!("no tensor named {name:?} in the checkpoint"))
            })?;
            // A dtype torch cannot take is refused before anything moves.
            let (_, dtype) = dlpack_dtype(info.dtype)
                .map_err(|why| GpufeedError::new_err(format!("tensor {name}: {why}")))?;
            let loader = &self.loader;
            let (buf, info) = py
                .detach(|| {
                    reaper::wait_idle_before((info.range.end - info.range.start) as u64);
                    c.load(loader, name)
                })
                .map_err(py_err)?;
            let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
            let nbytes = buf.len();
            device_bytes(loader.gpu(), buf).view_of(0, nbytes, dtype, shape)
        })
    }

    /// Undoes the files' registrations (their pages become reclaimable again); later calls
    /// raise `GpufeedError`. Tensors already loaded stay valid.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        close_registered(py, &self.inner)
    }
}

impl OnDemand {
    /// `f` on the open checkpoint, or an error once closed.
    fn with<T>(
        &self,
        f: impl FnOnce(&gpufeed::safetensors::OnDemand) -> PyResult<T>,
    ) -> PyResult<T> {
        let held = self
            .inner
            .read()
            .map_err(|_| GpufeedError::new_err("a load panicked"))?;
        match held.as_ref() {
            Some(c) => f(c),
            None => Err(GpufeedError::new_err(
                "the checkpoint was closed: open it again with gpufeed.safe_open",
            )),
        }
    }
}

/// Waits until device memory let go by dropped arrays and tensors is freed (it is freed on a
/// thread after the work queued on the device; loads of 64 MiB and more wait for it
/// themselves).
#[pyfunction]
fn _wait_for_frees(py: Python<'_>) {
    py.detach(reaper::wait_idle);
}

/// A JSON text as Python objects.
fn from_json<'py>(py: Python<'py>, value: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?
        .call_method1("loads", (value.to_string(),))
}

/// The machine's checks (`gpufeed doctor`): a list of dicts `{name, status, observed, fix}`.
#[pyfunction]
#[pyo3(signature = (path=None))]
fn doctor(py: Python<'_>, path: Option<PathBuf>) -> PyResult<Bound<'_, PyAny>> {
    let _context = gpufeed::cuda::ContextGuard::new();
    let checks = py.detach(|| gpufeed::doctor::run(path.as_deref()));
    let value = serde_json::to_value(&checks).map_err(|e| GpufeedError::new_err(e.to_string()))?;
    from_json(py, &value)
}

/// Where data should live and how it should reach the GPU (`gpufeed advise`), as a dict
/// `{workload, recommendation, trials}`; `measure=True` runs short trials on `path`.
#[pyfunction]
#[pyo3(signature = (size=None, path=None, persistent=false, processes=1, measure=false))]
fn advise(
    py: Python<'_>,
    size: Option<u64>,
    path: Option<PathBuf>,
    persistent: bool,
    processes: usize,
    measure: bool,
) -> PyResult<Bound<'_, PyAny>> {
    let _context = gpufeed::cuda::ContextGuard::new();
    let result = py.detach(|| -> gpufeed::Result<serde_json::Value> {
        let workload = match (size, &path) {
            (Some(size_bytes), _) => gpufeed::advise::Workload {
                persistent,
                processes: processes.max(1),
                size_bytes,
                resident: None,
            },
            (None, Some(p)) => gpufeed::advise::Workload::of_file(p, persistent, processes)?,
            (None, None) => {
                return Err(gpufeed::Error::InvalidSetting(
                    "say how large the data is: size=4 << 30 or path=FILE".into(),
                ));
            }
        };
        let rec = gpufeed::advise::advise(&workload);
        let trials = match (measure, &path) {
            (true, Some(p)) => Some(gpufeed::advise::measure(p, 1 << 30)?),
            (true, None) => {
                return Err(gpufeed::Error::InvalidSetting(
                    "measure=True runs trials on a file: give it with path=FILE".into(),
                ));
            }
            (false, _) => None,
        };
        Ok(serde_json::json!({ "workload": workload, "recommendation": rec, "trials": trials }))
    });
    from_json(py, &result.map_err(py_err)?)
}

/// One batch: `data` (an array of the records' bytes back to back; shape `[records,
/// record_bytes]` for fixed-size records), the record `indices`, the byte `offsets` of each
/// record and the end, the `epoch` and its `number`.
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct Batch {
    #[pyo3(get)]
    data: Py<Array>,
    #[pyo3(get)]
    indices: Vec<usize>,
    #[pyo3(get)]
    offsets: Vec<usize>,
    #[pyo3(get)]
    labels: Vec<u32>,
    #[pyo3(get)]
    epoch: u64,
    #[pyo3(get)]
    number: usize,
}

/// How the records of a data set come out as arrays: fixed-size records as `[records,
/// record_bytes]` bytes, `.npy` rows as `[records, *row shape]` of their dtype; others 1-D.
#[derive(Clone, Default)]
struct RowLayout {
    record_bytes: usize,
    /// `.npy` rows: the dtype (safetensors name) and the shape of a row.
    typed: Option<(&'static str, Vec<i64>)>,
}

/// Opens one record file: `.npy` rows, a WebDataset `.tar`, an offsets-indexed file, or
/// fixed-size records.
fn open_record_file(
    path: &std::path::Path,
    record_bytes: Option<usize>,
    index: Option<&std::path::Path>,
) -> gpufeed::Result<RecordFile> {
    let ext = path.extension().and_then(|e| e.to_str());
    #[allow(unsafe_code, reason = "the mapped-file promise, passed on")]
    let records = match (ext, record_bytes, index) {
        // SAFETY: the class's documentation passes the promise on to the caller: the
        // record file is not truncated or rewritten while the loader maps it.
        (Some("npy"), None, None) => unsafe { RecordFile::open_npy(path)? },
        // SAFETY: as above.
        (Some("tar"), None, None) => unsafe { RecordFile::open_tar(path)? },
        // SAFETY: as above.
        (_, None, Some(index)) => unsafe { RecordFile::open_indexed(path, index)? },
        // SAFETY: as above.
        (_, Some(n), None) => unsafe { RecordFile::open_fixed(path, n)? },
        (_, Some(_), Some(_)) => {
            return Err(gpufeed::Error::InvalidSetting(
                "give record_bytes (fixed-size records) or index (variable ones), not both".into(),
            ));
        }
        (_, None, None) => {
            return Err(gpufeed::Error::InvalidSetting(format!(
                "{} is a record file: say how its records are cut, record_bytes=N or \
                 index=OFFSETS_FILE (.npy and .tar files need neither)",
                path.display()
            )));
        }
    };
    Ok(records)
}

/// The rows' layout of record files: typed where every file is an `.npy` of one dtype and
/// row shape, bytes of `record_bytes` for fixed records, 1-D otherwise.
fn row_layout(files: &[&RecordFile], record_bytes: Option<usize>) -> RowLayout {
    let npys: Option<Vec<_>> = files.iter().map(|f| f.npy()).collect();
    if let Some(npys) = npys
        && let Some(first) = npys.first()
        && npys
            .iter()
            .all(|n| n.descr == first.descr && n.shape.get(1..) == first.shape.get(1..))
    {
        let typed = first
            .dtype()
            .and_then(|d| dlpack_dtype(d).ok())
            .map(|(_, name)| {
                let row: Vec<i64> = first.shape.iter().skip(1).map(|&x| x as i64).collect();
                (name, row)
            });
        return RowLayout {
            record_bytes: first.row_bytes(),
            typed,
        };
    }
    RowLayout {
        record_bytes: record_bytes.unwrap_or(0),
        typed: None,
    }
}

/// The data set `BatchLoader` reads: shards (`paths` a list, or one path with a glob pattern),
/// an image folder (a directory), or one record file; and how its rows come out.
fn open_dataset(
    paths: &[PathBuf],
    record_bytes: Option<usize>,
    index: Option<&std::path::Path>,
    skip_bad: bool,
) -> gpufeed::Result<(Dataset, RowLayout)> {
    let one = match paths {
        [one] => Some(one),
        _ => None,
    };
    if let Some(path) = one
        && path.is_dir()
    {
        if record_bytes.is_some() || index.is_some() {
            return Err(gpufeed::Error::InvalidSetting(format!(
                "{} is a folder, read as an image folder: record_bytes and index are for \
                 record files (shards in a folder: give \"{}/*\")",
                path.display(),
                path.display()
            )));
        }
        let folder = if skip_bad {
            ImageFolder::open_skipping(path)?
        } else {
            ImageFolder::open(path)?
        };
        return Ok((Dataset::Folder(folder), RowLayout::default()));
    }
    let is_glob = one.is_some_and(|p| p.to_string_lossy().contains(['*', '?', '[']));
    if let Some(path) = one
        && !is_glob
    {
        let file = open_record_file(path, record_bytes, index)?;
        let layout = row_layout(&[&file], record_bytes);
        return Ok((Dataset::Records(file), layout));
    }
    if index.is_some() {
        return Err(gpufeed::Error::InvalidSetting(
            "index= is for one record file; shards are fixed records, .npy or .tar files".into(),
        ));
    }
    let paths = match one {
        Some(pattern) => gpufeed::dataset::shard_paths(pattern)?,
        None => paths.to_vec(),
    };
    if paths.is_empty() {
        return Err(gpufeed::Error::InvalidSetting(
            "an empty list of shards".into(),
        ));
    }
    let files = paths
        .iter()
        .map(|p| open_record_file(p, record_bytes, None))
        .collect::<gpufeed::Result<Vec<_>>>()?;
    let layout = row_layout(&files.iter().collect::<Vec<_>>(), record_bytes);
    Ok((Dataset::Shards(ShardSet::new(files)), layout))
}

/// Batches of a data set, shuffled with a seed and sharded by `RANK`/`WORLD_SIZE`, on GPU
/// `device` (or host batches with `device=None`). Iterate `loader.epoch(n)`. The data set is
/// a record file of fixed-size records (`record_bytes=N`: batches `[records, N]`), a record
/// file with an offsets index (`index=PATH`: little-endian u64 starts, then the last end;
/// batches of bytes with `offsets`), an `.npy` array (a record per row: batches `[records,
/// *row shape]` of its dtype), a WebDataset `.tar` (a record per sample: its members back to
/// back), shards of those (a list of paths, or a glob pattern such as `"train-*.tar"`: one
/// data set, in the order given or sorted), or a folder of class folders, PyTorch `ImageFolder`'s
/// layout (`path` a directory: each file's raw bytes, `offsets` and `labels`; `classes` names
/// them; `skip_bad=True` leaves out unreadable entries instead of failing, counted in
/// `skipped`).
///
/// `workers` threads gather batches (default: one per core, up to 8) and `prefetch` batches are
/// prepared ahead (default: two per worker: each worker gathers and uploads its own).
/// `global_batch=G` makes it elastic: each step's G records are the same whatever
/// `WORLD_SIZE` (one that divides G; each rank gets G / WORLD_SIZE, `batch_size` is ignored),
/// `EpochIter.position()` says where the run is (a dict, JSON-ready) and `resume(position)`
/// goes on from there with the same or another world size.
///
/// For data sets larger than the page cache: `block=K` shuffles blocks of K consecutive
/// records (and the records within each block) instead of single records — a block's records
/// always share a batch when K divides the batch — and `direct=True` reads the records with
/// `O_DIRECT`, records next to each other in a file (a block) in one read, `direct_depth`
/// reads in flight per worker (default 4: fewer suit network volumes, more local NVMe). Large
/// blocks keep the reads large: on the H200 machine's cloud disk, blocks of 8 MiB with 4
/// workers and `direct_depth=1` came to 0.97-1.1 of the disk's own sequential reads (bench
/// table 7), blocks of 1 MiB mostly to 0.65-0.86.
///
/// A record file must not be truncated or rewritten while the loader reads it (it is mapped).
#[pyclass(module = "gpufeed._gpufeed")]
pub struct BatchLoader {
    /// The loader, while no epoch runs; an epoch's thread holds it and puts it back.
    slot: Arc<Mutex<Option<gpufeed::dataset::BatchLoader>>>,
    gpu: Option<gpufeed::Gpu>,
    /// How records come out as arrays.
    rows: RowLayout,
    batches: usize,
    /// An image folder's class names, in label order; empty for record files.
    #[pyo3(get)]
    classes: Vec<String>,
    /// Entries an image folder left out (`skip_bad=True`).
    #[pyo3(get)]
    skipped: usize,
    /// The sampler and the number of records, for positions (`EpochIter.position`).
    sampler: Sampler,
    records: usize,
    /// Set when dropped, dropped last: see [`KeepContext`].
    restore: KeepContext,
}

#[pymethods]
impl BatchLoader {
    #[new]
    #[pyo3(signature = (path, record_bytes=None, batch_size=256, shuffle=true, seed=0, device=None, workers=None, drop_last=false, index=None, skip_bad=false, global_batch=None, prefetch=None, block=None, direct=false, direct_depth=None))]
    #[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
    fn py_new(
        py: Python<'_>,
        path: Bound<'_, PyAny>,
        record_bytes: Option<usize>,
        batch_size: usize,
        shuffle: bool,
        seed: u64,
        device: Option<usize>,
        workers: Option<usize>,
        drop_last: bool,
        index: Option<PathBuf>,
        skip_bad: bool,
        global_batch: Option<usize>,
        prefetch: Option<usize>,
        block: Option<usize>,
        direct: bool,
        direct_depth: Option<usize>,
    ) -> PyResult<Self> {
        let _context = gpufeed::cuda::ContextGuard::new();
        // One path (a file, a folder or a glob pattern), or a list of shard paths.
        let paths: Vec<PathBuf> = match path.extract::<PathBuf>() {
            Ok(one) => vec![one],
            Err(_) => path.extract().map_err(|_| {
                GpufeedError::new_err(
                    "invalid setting: path is a file, a folder, a glob pattern or a list of shards",
                )
            })?,
        };
        let made = py.detach(|| -> gpufeed::Result<_> {
            let (records, layout) = open_dataset(&paths, record_bytes, index.as_deref(), skip_bad)?;
            let (classes, skipped) = match &records {
                Dataset::Folder(f) => (f.classes().to_vec(), f.skipped().len()),
                _ => (Vec::new(), 0),
            };
            let order = match (shuffle, block) {
                (true, Some(block)) => Order::Blocks { seed, block },
                (true, None) => Order::Shuffled { seed },
                (false, _) => Order::Sequential,
            };
            let sampler = match global_batch {
                Some(g) => Sampler::elastic_from_env(order, g, drop_last)?,
                None => Sampler::from_env(order)?,
            };
            let n = records.len();
            // An elastic sampler sets the batch size itself (BatchLoader::new).
            let mut cfg = gpufeed::dataset::LoaderConfig::default().with_batch_size(batch_size);
            cfg.drop_last = drop_last;
            // Default: a worker per core, up to 8 (what the bench's BatchLoader rows use).
            cfg.workers = workers.unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(2, |n| n.get().min(8))
            });
            // Each worker gathers and uploads a batch: two in flight per worker.
            cfg.prefetch = prefetch.unwrap_or(2 * cfg.workers).max(1);
            cfg.direct = direct;
            if let Some(depth) = direct_depth {
                cfg = cfg.with_direct_depth(depth);
            }
            let gpu = device.map(gpufeed::Gpu::open).transpose()?;
            let loader = gpufeed::dataset::BatchLoader::new(records, sampler, cfg, gpu.as_ref())?;
            Ok((loader, gpu, classes, skipped, sampler, n, layout))
        });
        let (loader, gpu, classes, skipped, sampler, records, layout) = made.map_err(py_err)?;
        let batches = loader.batches_per_epoch();
        Ok(BatchLoader {
            slot: Arc::new(Mutex::new(Some(loader))),
            gpu,
            rows: layout,
            batches,
            classes,
            skipped,
            sampler,
            records,
            restore: KeepContext::default(),
        })
    }

    /// Batches in an epoch (this rank's).
    fn __len__(&self) -> usize {
        self.batches
    }

    /// The batches of epoch `epoch`, in the sampler's order; one epoch at a time.
    fn epoch(&self, epoch: u64) -> PyResult<EpochIter> {
        self.run(epoch, None)
    }

    /// The rest of an epoch from `position` (a dict from `EpochIter.position()`, maybe saved
    /// by a run with another `WORLD_SIZE`): the samples that run had not consumed, this rank's
    /// share. Needs `global_batch=` (an elastic loader) with the same seed and global batch,
    /// over the same data set.
    fn resume(&self, py: Python<'_>, position: Bound<'_, PyAny>) -> PyResult<EpochIter> {
        let text: String = py
            .import("json")?
            .call_method1("dumps", (position,))?
            .extract()?;
        let at: Position = serde_json::from_str(&text).map_err(|e| {
            GpufeedError::new_err(format!(
                "invalid setting: not a position (a dict from EpochIter.position()): {e}"
            ))
        })?;
        self.run(at.epoch, Some(at))
    }
}

impl BatchLoader {
    /// Runs epoch `epoch` (from `at` when resuming) on a thread feeding the returned iterator.
    fn run(&self, epoch: u64, at: Option<Position>) -> PyResult<EpochIter> {
        let start = at.map_or(0, |a| a.samples);
        let loader = self
            .slot
            .lock()
            .map_err(|_| GpufeedError::new_err("a previous epoch panicked"))?
            .take()
            .ok_or_else(|| {
                GpufeedError::new_err(
                    "an epoch is already running: iterate it to the end (or drop it) first",
                )
            })?;
        let (tx, rx) = mpsc::sync_channel(2);
        let slot = Arc::clone(&self.slot);
        std::thread::Builder::new()
            .name("gpufeed-epoch".into())
            .spawn(move || {
                let mut loader = loader;
                match match &at {
                    Some(at) => loader.resume(at),
                    None => loader.epoch(epoch),
                } {
                    Ok(batches) => {
                        for b in batches {
                            // The iterator was dropped: stop reading, give the loader back.
                            if tx.send(b).is_err() {
                                break;
                            }
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
                if let Ok(mut s) = slot.lock() {
                    *s = Some(loader);
                }
            })
            .map_err(|e| GpufeedError::new_err(format!("cannot start the epoch's thread: {e}")))?;
        Ok(EpochIter {
            rx: Mutex::new(rx),
            gpu: self.gpu.clone(),
            rows: self.rows.clone(),
            sampler: self.sampler,
            records: self.records,
            epoch,
            start,
            handed: Mutex::new(0),
            restore: KeepContext::default(),
        })
    }
}

/// The batches of one epoch (see `BatchLoader.epoch`).
#[pyclass(module = "gpufeed._gpufeed")]
pub struct EpochIter {
    rx: Mutex<mpsc::Receiver<gpufeed::Result<gpufeed::dataset::Batch>>>,
    gpu: Option<gpufeed::Gpu>,
    rows: RowLayout,
    /// The loader's sampler and records, the epoch and the sample it started from: what a
    /// position is made of.
    sampler: Sampler,
    records: usize,
    epoch: u64,
    start: u64,
    /// Batches handed to Python (the thread may have prepared more).
    handed: Mutex<usize>,
    /// Set when dropped, dropped last: see [`KeepContext`].
    restore: KeepContext,
}

#[pymethods]
impl EpochIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// Where the run is after the batches handed out so far, as a dict to save beside the
    /// model's checkpoint (JSON) and give to `BatchLoader.resume`; after the epoch's last batch,
    /// the start of the next epoch. Only for an elastic loader (`global_batch=`).
    fn position<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let handed = *self
            .handed
            .lock()
            .map_err(|_| GpufeedError::new_err("the epoch panicked"))?;
        let at = self
            .sampler
            .position_after(self.records, self.epoch, self.start, handed)
            .ok_or_else(|| {
                GpufeedError::new_err(
                    "invalid setting: positions are for elastic loaders: BatchLoader(..., \
                     global_batch=N)",
                )
            })?;
        let value = serde_json::to_value(at).map_err(|e| GpufeedError::new_err(e.to_string()))?;
        from_json(py, &value)
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Batch> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let next = py.detach(|| {
            self.rx
                .lock()
                .map_err(|_| GpufeedError::new_err("the epoch panicked"))
                .map(|rx| rx.recv().ok())
        })?;
        let Some(batch) = next else {
            return Err(PyStopIteration::new_err(()));
        };
        let b = batch.map_err(py_err)?;
        if let Ok(mut handed) = self.handed.lock() {
            *handed += 1;
        }
        let records = b.indices.len();
        let nbytes = b.bytes();
        let (base, device, owner) = match b.data {
            BatchData::Device(buf) => {
                let gpu = self
                    .gpu
                    .clone()
                    .ok_or_else(|| GpufeedError::new_err("a device batch without a GPU"))?;
                let base = device_address(&gpu, &buf);
                let device = cuda(gpu.info().ordinal);
                (base, device, Owner::new(Storage::Device(buf), Some(gpu)))
            }
            BatchData::Host(buf) => (
                buf.as_ptr() as usize,
                DLDevice::CPU,
                Owner::new(Storage::Host(buf), None),
            ),
        };
        let rows = &self.rows;
        let whole = rows.record_bytes > 0 && records * rows.record_bytes == nbytes;
        let shape = if whole {
            vec![records as i64, rows.record_bytes as i64]
        } else {
            vec![nbytes as i64]
        };
        let mut data = Array::bytes(Arc::new(owner), base, nbytes, device, Some(shape));
        if whole && let Some((dtype, row)) = &rows.typed {
            let shape: Vec<i64> = std::iter::once(records as i64)
                .chain(row.iter().copied())
                .collect();
            data = data.view_of(0, nbytes, dtype, shape)?;
        }
        Ok(Batch {
            data: Py::new(py, data)?,
            indices: b.indices,
            offsets: b.offsets,
            labels: b.labels,
            epoch: b.epoch,
            number: b.number,
        })
    }
}

/// The native module `gpufeed._gpufeed`.
#[pymodule]
fn _gpufeed(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("GpufeedError", py.get_type::<GpufeedError>())?;
    m.add("NoGpuError", py.get_type::<NoGpuError>())?;
    m.add_class::<Array>()?;
    m.add_class::<Loader>()?;
    m.add_class::<Batch>()?;
    m.add_class::<BatchLoader>()?;
    m.add_class::<EpochIter>()?;
    m.add_class::<OnDemand>()?;
    m.add_class::<RegisteredFile>()?;
    m.add_function(wrap_pyfunction!(load_file, m)?)?;
    m.add_function(wrap_pyfunction!(load_range, m)?)?;
    m.add_function(wrap_pyfunction!(load_replicated, m)?)?;
    m.add_function(wrap_pyfunction!(load_sharded, m)?)?;
    m.add_function(wrap_pyfunction!(load_replicated_rank, m)?)?;
    m.add_function(wrap_pyfunction!(load_tensor_parallel_files, m)?)?;
    m.add_function(wrap_pyfunction!(load_replicated_safetensors_files, m)?)?;
    m.add_function(wrap_pyfunction!(load_tensor_parallel_rank_files, m)?)?;
    m.add_function(wrap_pyfunction!(load_safetensors_files, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_for_frees, m)?)?;
    m.add_function(wrap_pyfunction!(doctor, m)?)?;
    m.add_function(wrap_pyfunction!(advise, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_torch_imports_has_a_dlpack_type() {
        for (d, bits) in [
            (Dtype::BOOL, 8),
            (Dtype::U8, 8),
            (Dtype::I8, 8),
            (Dtype::F8_E4M3, 8),
            (Dtype::F8_E5M2, 8),
            (Dtype::I16, 16),
            (Dtype::U16, 16),
            (Dtype::F16, 16),
            (Dtype::BF16, 16),
            (Dtype::I32, 32),
            (Dtype::U32, 32),
            (Dtype::F32, 32),
            (Dtype::I64, 64),
            (Dtype::U64, 64),
            (Dtype::F64, 64),
        ] {
            let (t, name) = dlpack_dtype(d).expect("mapped");
            assert_eq!(usize::from(t.bits), d.bitsize(), "{name}");
            assert_eq!(usize::from(t.bits), bits, "{name}");
            assert_eq!(t.lanes, 1);
        }
        let err = dlpack_dtype(Dtype::F4).expect_err("no torch dtype");
        assert!(err.contains("F4"), "{err}");
    }
}
