//! safetensors checkpoints as the Python layer takes them: one array per file with its tensors
//! grouped by dtype, which `__init__.py` turns into torch tensors (`load_safetensors_files`).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::GpufeedError;
use crate::array::{Array, Owner, Storage, cuda, device_address, dlpack_dtype};
use crate::context::KeepContext;
use crate::errors::py_err;
use crate::loads::Loader;

/// One file's tensors as the Python layer takes them (see `Loader.load_safetensors_files`).
pub(crate) type FileTensors = (Array, Vec<DtypeGroup>, Vec<OddTensor>);
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
pub(crate) fn checkpoint_files(
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

/// The first load of a checkpoint in object storage on `device`: the objects opened and their
/// headers read on a thread of their own while the GPU's loader opens (one after the other
/// they took 12-15 ms and 26-38 ms, and the load read the headers again: the first byte 57-65
/// ms into the log that starts inside `import gpufeed`, on an H100, GPU run 236; side by side
/// 48-57 ms on an H200, run 237), then read at the versions those headers came from. A bad
/// checkpoint is named first, even on a machine without a GPU.
fn first_object_load(py: Python<'_>, url: String, device: usize) -> PyResult<Vec<FileTensors>> {
    let reading = {
        let to_read = url.clone();
        std::thread::Builder::new()
            .name("gpufeed-headers".into())
            .spawn(move || {
                gpufeed::safetensors::inspect_object_opened(&to_read, &Default::default())
            })
            .map_err(|e| {
                GpufeedError::new_err(format!("starting a thread to read {url}'s headers: {e}"))
            })?
    };
    let loader = crate::loads::shared_object_loader(py, device);
    let opened = py
        .detach(|| reading.join())
        .map_err(|_| GpufeedError::new_err(format!("the thread reading {url}'s headers panicked")))?
        .map_err(py_err)?;
    Loader {
        inner: loader?,
        restore: KeepContext::default(),
    }
    .load_objects_opened(py, url, opened)
}

/// Row-major strides, in elements, of a tensor of `shape`.
fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (1..shape.len()).rev() {
        strides[i - 1] = strides[i].saturating_mul(shape[i].max(1));
    }
    strides
}

/// `load_safetensors_files` with this device's shared loader (headers checked before the GPU
/// is opened).
#[pyfunction]
#[pyo3(signature = (path, device=0))]
#[allow(clippy::type_complexity, reason = "the tuple is the Python shape")]
pub(crate) fn load_safetensors_files(
    py: Python<'_>,
    path: PathBuf,
    device: usize,
) -> PyResult<Vec<FileTensors>> {
    if !crate::loads::has_shared_loader_for(device, &path) {
        if let Some(url) = crate::loads::object_url(&path) {
            return first_object_load(py, url.to_owned(), device);
        }
        // Before the GPU is opened: a bad file is named even on a machine without one.
        py.detach(|| gpufeed::safetensors::inspect(&path))
            .map_err(py_err)?;
    }
    Loader {
        inner: crate::loads::shared_loader_for(py, device, &path)?,
        restore: KeepContext::default(),
    }
    .load_safetensors_files(py, path)
}
