//! [`Array`]: memory on the GPU or the host with a dtype and shape, which any DLPack consumer
//! takes without a copy; what keeps that memory alive ([`Owner`]) and the DLPack types of the
//! safetensors dtypes.

use std::sync::Arc;

use dlpark::ffi::{DLDataType, DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::{DlpackExporter, ExportRequest, export_dlpack};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use gpufeed::cuda::cudarc::driver::DevicePtr;
use gpufeed::safetensors::Dtype;
use pyo3::prelude::*;

use crate::{GpufeedError, reaper};

/// What keeps an array's memory alive (held, never read: dropping it frees the memory).
#[allow(dead_code, reason = "each variant is held for its Drop")]
pub(crate) enum Storage {
    /// GPU memory of a load.
    Device(gpufeed::DeviceBuffer),
    /// A checkpoint: one device buffer per file, shared by all its tensors.
    Checkpoint(gpufeed::safetensors::Checkpoint),
    /// A device batch of a `BatchLoader`: freed (after the device's queued work, as all
    /// device memory here), its memory goes back to the loader for a later batch.
    Batch(gpufeed::dataset::DeviceBatch),
    /// A host batch (pinned, or locked in CPU mode).
    Host(gpufeed::pinned::PooledBuffer),
    /// A file's private (copy-on-write) mapping: `safe_open`'s CPU tensors.
    Mapped(gpufeed::os::FileMap),
    /// A chunk of a prefetch, shared by the tensors it holds.
    Chunk(Arc<gpufeed::DeviceBuffer>),
    /// Bytes read into host memory: `safe_open`'s CPU tensors of an object.
    Bytes(Vec<u8>),
}

/// The owner shared by an array and every tensor exported from it.
pub(crate) struct Owner {
    /// Always `Some` until the drop hands it on.
    storage: Option<Storage>,
    /// The GPU whose queued work must finish before device memory is freed.
    gpu: Option<gpufeed::Gpu>,
}

impl Owner {
    pub(crate) fn new(storage: Storage, gpu: Option<gpufeed::Gpu>) -> Self {
        Owner {
            storage: Some(storage),
            gpu,
        }
    }
}

impl Owner {
    /// The address and length of a host mapping's bytes (`None` for other storage).
    pub(crate) fn host_range(&self) -> Option<(usize, usize)> {
        match self.storage.as_ref()? {
            Storage::Mapped(map) => Some((map.as_ptr() as usize, map.len())),
            _ => None,
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
    pub(crate) fn view_of(
        &self,
        start: usize,
        end: usize,
        dtype: &str,
        shape: Vec<i64>,
    ) -> PyResult<Array> {
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

/// The host, as DLPack names it.
pub(crate) fn cpu() -> DLDevice {
    DLDevice {
        device_type: DLDeviceType::CPU,
        device_id: 0,
    }
}

pub(crate) fn cuda(ordinal: usize) -> DLDevice {
    DLDevice {
        device_type: DLDeviceType::CUDA,
        device_id: i32::try_from(ordinal).unwrap_or(i32::MAX),
    }
}

/// The device address of `buf` (cudarc's guard, which orders later work on the stream, is
/// dropped at once: the buffer's copies are complete).
pub(crate) fn device_address(gpu: &gpufeed::Gpu, buf: &gpufeed::DeviceBuffer) -> usize {
    let stream = gpu.default_stream();
    let (ptr, _guard) = buf.device_ptr(&stream);
    ptr as usize
}

impl Array {
    /// `nbytes` bytes at `base` of `owner` as a `U8` array of `shape` (1-D where `None`).
    pub(crate) fn bytes(
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

    /// `nbytes` bytes at `base` of `owner` as one tensor of `dtype` and `shape` where DLPack
    /// carries that dtype and the shape fills the bytes; else as `U8` bytes (the caller views
    /// them as the dtype: F4, F8_E8M0, the FNUZ types, C64).
    pub(crate) fn typed(
        owner: Arc<Owner>,
        base: usize,
        nbytes: usize,
        device: DLDevice,
        dtype: Dtype,
        shape: &[usize],
    ) -> Array {
        let elems = shape
            .iter()
            .try_fold(1u128, |n, &d| n.checked_mul(d as u128));
        match dlpack_dtype(dtype) {
            Ok((dl, name))
                if elems.and_then(|n| n.checked_mul(u128::from(dl.bits)))
                    == Some(nbytes as u128 * 8) =>
            {
                Array {
                    owner,
                    base,
                    byte_offset: 0,
                    nbytes,
                    dtype: dl,
                    dtype_name: name,
                    shape: shape.iter().map(|&d| d as i64).collect(),
                    device,
                }
            }
            _ => Array::bytes(owner, base, nbytes, device, None),
        }
    }
}

impl Array {
    /// Whether this array carries `dtype` itself (rather than its bytes as `U8`).
    pub(crate) fn carries(&self, dtype: Dtype) -> bool {
        dlpack_dtype(dtype).is_ok_and(|(_, name)| name == self.dtype_name)
    }

    /// This array for Python: `importer(capsule)` (a DLPack capsule of it, the legacy kind
    /// every consumer takes: `torch._C._from_dlpack`, `torch.from_dlpack`) where `importer`
    /// is given and the array carries `dtype`; else the array itself, for the caller to view
    /// as `dtype`. One call from here per tensor instead of a Python function taking the
    /// array, asking its dtype and its `__dlpack__`: about 1.3 us per tensor less on the H200
    /// machine.
    pub(crate) fn handed(
        self,
        py: Python<'_>,
        dtype: Dtype,
        importer: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        match importer {
            Some(importer) if self.carries(dtype) => {
                let capsule =
                    export_dlpack(&self, py, ExportRequest::parse(None, None, None, None)?)?;
                Ok(importer.call1((capsule,))?.unbind())
            }
            _ => Ok(Py::new(py, self)?.into_any()),
        }
    }
}

/// Bytes on the GPU as a 1-D `U8` array.
pub(crate) fn device_bytes(gpu: &gpufeed::Gpu, buf: gpufeed::DeviceBuffer) -> Array {
    let base = device_address(gpu, &buf);
    let nbytes = buf.len();
    let owner = Arc::new(Owner::new(Storage::Device(buf), Some(gpu.clone())));
    Array::bytes(owner, base, nbytes, cuda(gpu.info().ordinal), None)
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

    #[test]
    fn a_typed_array_carries_its_dtype_only_where_its_shape_fills_its_bytes() {
        let owner = Arc::new(Owner {
            storage: None,
            gpu: None,
        });
        let typed = |dtype, shape: &[usize], nbytes| {
            Array::typed(Arc::clone(&owner), 0x1000, nbytes, cpu(), dtype, shape)
        };
        let a = typed(Dtype::F32, &[3, 5], 60);
        assert_eq!((a.dtype_name, a.shape.clone()), ("F32", vec![3, 5]));
        let z = typed(Dtype::BF16, &[], 2);
        assert_eq!((z.dtype_name, z.shape.clone()), ("BF16", vec![]));
        let e = typed(Dtype::I64, &[4, 0], 0);
        assert_eq!((e.dtype_name, e.shape.clone()), ("I64", vec![4, 0]));
        // A shape that does not fill the bytes, and dtypes DLPack does not carry for torch:
        // the bytes as U8, for the caller to view.
        for (dtype, shape, nbytes) in [
            (Dtype::F32, vec![3, 5], 61),
            (Dtype::F4, vec![2, 4], 4),
            (Dtype::F8_E8M0, vec![7], 7),
            (Dtype::C64, vec![2], 16),
        ] {
            let b = typed(dtype, &shape, nbytes);
            assert_eq!(
                (b.dtype_name, b.shape.clone()),
                ("U8", vec![nbytes as i64]),
                "{dtype:?}"
            );
            assert_eq!(b.nbytes, nbytes);
        }
    }
}
