//! `ImageLoader`: batches of decoded, augmented images of an image folder or WebDataset
//! shards (`gpufeed_data::ImageLoader`), and its epochs (`ImageEpochIter`); the Python class
//! `gpufeed.ImageLoader` makes torch tensors of what they yield.

use std::path::PathBuf;
use std::sync::Arc;

use gpufeed::dataset::{
    Augmentation, BatchLoaderOptions, Dataset, ImageData, ImageOptions, Layout, OnBadImage,
    OwnedImageEpoch, Position, Sampler,
};
use parking_lot::Mutex;
use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;

use crate::GpufeedError;
use crate::array::{Array, Owner, Storage, cpu, cuda};
use crate::context::KeepContext;
use crate::data::{open_dataset, streamed_dataset};
use crate::epochs::{Epoch, Slot, position_from};
use crate::errors::py_err;

/// Batches of decoded, cropped, resized (mirrored, normalized) images of an image folder, a
/// WebDataset tar, shards of them (a glob pattern or a list; `s3://` shards streamed),
/// on GPU `device` (nvJPEG) or, with `device=None`, on the CPU. See `gpufeed.ImageLoader`.
#[pyclass(module = "gpufeed._gpufeed")]
pub struct ImageLoader {
    slot: Slot<gpufeed::dataset::ImageLoader>,
    gpu: Option<gpufeed::Gpu>,
    batches: usize,
    /// An image folder's class names, in label order; empty for shards.
    #[pyo3(get)]
    classes: Vec<String>,
    /// Why images decode on the CPU (`None` where nvJPEG decodes them).
    #[pyo3(get)]
    cpu_only: Option<String>,
    /// Output `(height, width)`.
    #[pyo3(get)]
    size: (u32, u32),
    /// Whether batches are normalized `f32` `[n, 3, h, w]` (else `uint8` `[n, h, w, 3]`).
    #[pyo3(get)]
    normalize: bool,
    /// Set when dropped, dropped last: see [`KeepContext`].
    restore: KeepContext,
}

impl Drop for ImageLoader {
    fn drop(&mut self) {
        self.restore.arm();
    }
}

#[pymethods]
impl ImageLoader {
    #[new]
    #[pyo3(signature = (path, batch_size=256, height=224, width=224, train=true, seed=0, shuffle=crate::data::Shuffle::Flag(true), device=None, workers=4, decoders=3, normalize=false, mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225], scale=(0.08, 1.0), ratio=(0.75, 4.0 / 3.0), crop_fraction=0.875, skip=false, drop_last=false, global_batch=None, prefetch=None, cache=None, block=None, spool_bytes=None, cuda_decoders=0), text_signature = "(path, batch_size=256, height=224, width=224, train=True, seed=0, shuffle=True, device=None, workers=4, decoders=3, normalize=False, mean=..., std=..., scale=..., ratio=..., crop_fraction=0.875, skip=False, drop_last=False, global_batch=None, prefetch=None, cache=None, block=None, spool_bytes=None, cuda_decoders=0)")]
    #[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
    fn py_new(
        py: Python<'_>,
        path: Bound<'_, PyAny>,
        batch_size: usize,
        height: u32,
        width: u32,
        train: bool,
        seed: u64,
        shuffle: crate::data::Shuffle,
        device: Option<usize>,
        workers: usize,
        decoders: usize,
        normalize: bool,
        mean: [f32; 3],
        std: [f32; 3],
        scale: (f64, f64),
        ratio: (f64, f64),
        crop_fraction: f64,
        skip: bool,
        drop_last: bool,
        global_batch: Option<usize>,
        prefetch: Option<usize>,
        cache: Option<PathBuf>,
        block: Option<usize>,
        spool_bytes: Option<u64>,
        cuda_decoders: usize,
    ) -> PyResult<Self> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let paths: Vec<PathBuf> = match path.extract::<PathBuf>() {
            Ok(one) => vec![one],
            Err(_) => path.extract().map_err(|_| {
                GpufeedError::new_err(
                    "invalid setting: path is an image folder, a .tar shard, a glob pattern or a \
                     list of shards",
                )
            })?,
        };
        let augmentation = if train {
            Augmentation::Train { seed, scale, ratio }
        } else {
            Augmentation::Eval { crop_fraction }
        };
        let layout = if normalize {
            Layout::F32Chw { mean, std }
        } else {
            Layout::U8Hwc
        };
        let opts = ImageOptions::default()
            .with_size(height, width)
            .with_augmentation(augmentation)
            .with_layout(layout)
            .with_on_bad(if skip {
                OnBadImage::Skip
            } else {
                OnBadImage::Error
            })
            .with_decoders(decoders)
            .with_cuda_decoders(cuda_decoders);
        let made = py.detach(|| -> gpufeed::Result<_> {
            let (records, _) =
                match streamed_dataset(&paths, None, None, cache.as_deref(), spool_bytes)? {
                    Some(s) => s,
                    // A folder's unreadable entries are errors here (the policy is for images).
                    None => open_dataset(&paths, None, None, false)?,
                };
            let classes = match &records {
                Dataset::Folder(f) => f.classes().to_vec(),
                _ => Vec::new(),
            };
            let order = crate::data::order_of(&shuffle, seed, block)?;
            let sampler = match global_batch {
                Some(g) => Sampler::elastic_from_env(order, g, drop_last)?,
                None => Sampler::from_env(order)?,
            };
            let workers = workers.max(1);
            let cfg = BatchLoaderOptions::default()
                .with_batch_size(batch_size)
                .with_drop_last(drop_last)
                .with_workers(workers)
                .with_prefetch(prefetch.unwrap_or(2 * workers).max(1));
            let gpu = device.map(gpufeed::Gpu::open).transpose()?;
            let loader =
                gpufeed::dataset::ImageLoader::new(records, sampler, cfg, opts, gpu.as_ref())?;
            Ok((loader, gpu, classes))
        });
        let (loader, gpu, classes) = made.map_err(py_err)?;
        Ok(ImageLoader {
            batches: loader.batches_per_epoch(),
            cpu_only: loader.cpu_only().map(str::to_owned),
            slot: Arc::new(Mutex::new(Some(loader))),
            gpu,
            classes,
            size: (height, width),
            normalize,
            restore: KeepContext::default(),
        })
    }

    /// Batches in an epoch (this rank's).
    fn __len__(&self) -> usize {
        self.batches
    }

    /// The batches of epoch `epoch`, in the sampler's order; one epoch at a time.
    fn epoch(&self, py: Python<'_>, epoch: u64) -> PyResult<ImageEpochIter> {
        self.run(py, epoch, None)
    }

    /// The rest of an epoch from `position` (a dict from `ImageEpochIter.position()`).
    fn resume(&self, py: Python<'_>, position: Bound<'_, PyAny>) -> PyResult<ImageEpochIter> {
        let at = position_from(py, position)?;
        self.run(py, at.epoch, Some(at))
    }
}

impl ImageLoader {
    fn run(&self, py: Python<'_>, epoch: u64, at: Option<Position>) -> PyResult<ImageEpochIter> {
        let run = Epoch::start(py, &self.slot, |loader: gpufeed::dataset::ImageLoader| {
            loader.into_epoch(epoch, at.as_ref())
        })?;
        Ok(ImageEpochIter {
            run,
            gpu: self.gpu.clone(),
            restore: KeepContext::default(),
        })
    }
}

/// What `ImageEpochIter.__next__` gives: the images (`None` when every image of the batch was
/// skipped), each image's record index and label (`u32::MAX`: none), the images skipped as
/// `(name, reason)`.
type NextBatch = (
    Option<Py<Array>>,
    Vec<usize>,
    Vec<u32>,
    Vec<(String, String)>,
);

/// The batches of one epoch of an `ImageLoader`; at its end, or when dropped, the loader is
/// free for the next.
#[pyclass(module = "gpufeed._gpufeed")]
pub struct ImageEpochIter {
    run: Epoch<OwnedImageEpoch>,
    gpu: Option<gpufeed::Gpu>,
    /// Set when dropped, dropped last: see [`KeepContext`].
    restore: KeepContext,
}

impl Drop for ImageEpochIter {
    fn drop(&mut self) {
        self.restore.arm();
        self.run.end();
    }
}

#[pymethods]
impl ImageEpochIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// Where the run is after the batches handed out so far (an elastic loader's), as a dict.
    fn position<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.run.position(py, "ImageLoader")
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<NextBatch> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let Some(batch) = self.run.next(py) else {
            return Err(PyStopIteration::new_err(()));
        };
        let b = batch.map_err(py_err)?;
        let (n, w, h) = (b.len(), b.width as usize, b.height as usize);
        let (dtype, shape) = match b.layout {
            Layout::F32Chw { .. } => (gpufeed::safetensors::Dtype::F32, [n, 3, h, w]),
            _ => (gpufeed::safetensors::Dtype::U8, [n, h, w, 3]),
        };
        let array = match b.data {
            None => None,
            Some(ImageData::Device(buf)) => {
                let gpu = self
                    .gpu
                    .clone()
                    .ok_or_else(|| GpufeedError::new_err("a device batch without a GPU"))?;
                let base = crate::array::device_address(&gpu, &buf);
                let nbytes = buf.len();
                let device = cuda(gpu.info().ordinal);
                let owner = Arc::new(Owner::new(Storage::Device(buf), Some(gpu)));
                Some(Array::typed(owner, base, nbytes, device, dtype, &shape))
            }
            Some(ImageData::Host(pixels)) => {
                let (base, nbytes) = (pixels.as_ptr() as usize, pixels.len());
                let owner = Arc::new(Owner::new(Storage::Bytes(pixels), None));
                Some(Array::typed(owner, base, nbytes, cpu(), dtype, &shape))
            }
        };
        let array = array.map(|a| Py::new(py, a)).transpose()?;
        let skipped = b
            .skipped
            .into_iter()
            .map(|s| (s.name, s.reason.to_string()))
            .collect();
        Ok((array, b.indices, b.labels, skipped))
    }
}
