//! `OnDemand`, what `gpufeed.safe_open` wraps: a checkpoint's tensors loaded one at a time, when
//! asked.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::RwLock;
use pyo3::prelude::*;

use crate::array::{Array, device_bytes, dlpack_dtype};
use crate::context::KeepContext;
use crate::errors::py_err;
use crate::loads::{close_registered, has_shared_loader, shared_loader};
use crate::{GpufeedError, reaper};

/// A safetensors file or index whose tensors load one at a time, when asked (what
/// `gpufeed.safe_open` wraps): every file registered once, each tensor one copy by the GPU out
/// of the page cache into memory of its own.
#[pyclass(frozen, module = "gpufeed._gpufeed")]
pub struct OnDemand {
    loader: Arc<gpufeed::Loader>,
    /// `None` once closed (the files' registrations undone).
    inner: RwLock<Option<gpufeed::safetensors::OnDemand>>,
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
            inner: RwLock::new(Some(inner)),
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
        let held = self.inner.read();
        match held.as_ref() {
            Some(c) => f(c),
            None => Err(GpufeedError::new_err(
                "the checkpoint was closed: open it again with gpufeed.safe_open",
            )),
        }
    }
}
