//! `decode_jpegs`: a batch of JPEGs decoded into device memory (nvJPEG, with the CPU decoder
//! for what it refuses: `gpufeed_data::ImageDecoder`, one per device, kept) or on the host
//! (`gpufeed_data::decode_on_cpu`), each image an `[height, width, 3]` `U8` array.

use std::collections::HashMap;
use std::sync::Arc;

use gpufeed::dataset::{DecodedWith, ImageDecoder, OnBadImage, decode_on_cpu};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::GpufeedError;
use crate::array::{Array, Owner, Storage, cpu, cuda};
use crate::errors::py_err;
use crate::loads::shared_loader;

/// One decoder per device (an nvJPEG handle takes tens of ms to make), used by one call at a
/// time.
fn decoders() -> &'static Mutex<HashMap<usize, ImageDecoder>> {
    static DECODERS: std::sync::OnceLock<Mutex<HashMap<usize, ImageDecoder>>> =
        std::sync::OnceLock::new();
    DECODERS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// `f` with this device's decoder (made on first use), which no other call uses meanwhile.
fn with_decoder<T>(
    gpu: &gpufeed::Gpu,
    f: impl FnOnce(&mut ImageDecoder) -> gpufeed::dataset::Result<T>,
) -> gpufeed::dataset::Result<T> {
    let mut all = decoders().lock();
    let decoder = match all.entry(gpu.info().ordinal) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(ImageDecoder::open(gpu)?),
    };
    f(decoder)
}

/// What `decode_jpegs` gives back: per image an array (`None` where skipped), the images
/// skipped as `(name, reason)`, and per image the decoder that made it.
type Decoded = (
    Vec<Option<Py<Array>>>,
    Vec<(String, String)>,
    Vec<Option<&'static str>>,
);

/// Decodes `blobs` (JPEG files' bytes) as interleaved RGB: on GPU `device` where given (nvJPEG;
/// the CPU decoder and an upload for what it refuses, or where it is not installed), else on
/// the host's threads. An image no decoder takes raises naming it (`image N`), or with `skip`
/// is `None` and listed.
#[pyfunction]
#[pyo3(signature = (blobs, device=None, skip=false))]
pub fn decode_jpegs(
    py: Python<'_>,
    blobs: Vec<Bound<'_, PyBytes>>,
    device: Option<usize>,
    skip: bool,
) -> PyResult<Decoded> {
    let policy = if skip {
        OnBadImage::Skip
    } else {
        OnBadImage::Error
    };
    let name = |i: usize| format!("image {i}");
    let jpegs: Vec<&[u8]> = blobs.iter().map(|b| b.as_bytes()).collect();
    let Some(ordinal) = device else {
        let (images, skipped) = py
            .detach(|| decode_on_cpu(&jpegs, &name, policy))
            .map_err(py_err)?;
        let arrays = images
            .into_iter()
            .map(|image| {
                image
                    .map(|image| {
                        let (w, h) = (image.width as usize, image.height as usize);
                        let nbytes = image.pixels.len();
                        let base = image.pixels.as_ptr() as usize;
                        let owner = Arc::new(Owner::new(Storage::Bytes(image.pixels), None));
                        Py::new(py, typed(owner, base, nbytes, cpu(), h, w))
                    })
                    .transpose()
            })
            .collect::<PyResult<Vec<_>>>()?;
        let with = arrays.iter().map(|a| a.as_ref().map(|_| "cpu")).collect();
        return Ok((arrays, reasons(skipped), with));
    };
    let loader = shared_loader(py, ordinal)?;
    let gpu = loader.gpu().clone();
    let _context = gpufeed::cuda::ContextGuard::new();
    let batch = py
        .detach(|| with_decoder(&gpu, |decoder| decoder.decode(&jpegs, &name, policy)))
        .map_err(py_err)?;
    let mut arrays = Vec::with_capacity(batch.images.len());
    let mut with = Vec::with_capacity(batch.images.len());
    let owner = batch.buffer.map(|buf| {
        let base = crate::array::device_address(&gpu, &buf);
        (
            base,
            Arc::new(Owner::new(Storage::Device(buf), Some(gpu.clone()))),
        )
    });
    for image in batch.images {
        match (image, &owner) {
            (Some((slot, by)), Some((base, owner))) => {
                let array = typed(
                    Arc::clone(owner),
                    base + slot.offset,
                    slot.span(),
                    cuda(ordinal),
                    slot.height as usize,
                    slot.width as usize,
                );
                arrays.push(Some(Py::new(py, array)?));
                with.push(Some(match by {
                    DecodedWith::Hardware => "hardware",
                    DecodedWith::Cuda => "cuda",
                    DecodedWith::Cpu => "cpu",
                }));
            }
            _ => {
                arrays.push(None);
                with.push(None);
            }
        }
    }
    Ok((arrays, reasons(batch.skipped), with))
}

/// `nbytes` at `base` of `owner` as a `[h, w, 3]` `U8` array.
fn typed(
    owner: Arc<Owner>,
    base: usize,
    nbytes: usize,
    device: dlpark::ffi::DLDevice,
    h: usize,
    w: usize,
) -> Array {
    Array::typed(
        owner,
        base,
        nbytes,
        device,
        gpufeed::safetensors::Dtype::U8,
        &[h, w, 3],
    )
}

fn reasons(skipped: Vec<gpufeed::dataset::SkippedImage>) -> Vec<(String, String)> {
    skipped
        .into_iter()
        .map(|s| (s.name, s.reason.to_string()))
        .collect()
}

/// The CPU reference of the training crops' resize (`gpufeed_data::resize_crop`): `crop`
/// (`(x, y, width, height)`) of the RGB image `pixels` resized to `out_width` x `out_height`
/// with antialiasing, mirrored where `flip`; HWC `f32` values as little-endian bytes.
#[pyfunction]
#[pyo3(signature = (pixels, width, height, crop, out_width, out_height, flip=false))]
#[allow(
    clippy::too_many_arguments,
    reason = "the resize's parameters, as Python passes them"
)]
pub fn resize_crop<'py>(
    py: Python<'py>,
    pixels: Bound<'py, PyBytes>,
    width: u32,
    height: u32,
    crop: (u32, u32, u32, u32),
    out_width: u32,
    out_height: u32,
    flip: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let (x, y, w, h) = crop;
    let crop = gpufeed::dataset::Crop {
        x,
        y,
        width: w,
        height: h,
    };
    let src = pixels.as_bytes();
    let values = py
        .detach(|| {
            gpufeed::dataset::resize_crop(src, width, height, crop, out_width, out_height, flip)
        })
        .map_err(py_err)?;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    Ok(PyBytes::new(py, &bytes))
}

/// `gpufeed_data::random_resized_crop`: torchvision's `RandomResizedCrop` crop of a `width` x
/// `height` image for `seed`, `epoch` and `index`, as `(x, y, width, height)`.
#[pyfunction]
#[pyo3(signature = (width, height, seed, epoch, index, scale=(0.08, 1.0), ratio=(0.75, 4.0 / 3.0)))]
pub fn random_resized_crop(
    width: u32,
    height: u32,
    seed: u64,
    epoch: u64,
    index: u64,
    scale: (f64, f64),
    ratio: (f64, f64),
) -> PyResult<(u32, u32, u32, u32)> {
    let c = gpufeed::dataset::random_resized_crop(width, height, scale, ratio, seed, epoch, index)
        .map_err(py_err)?;
    Ok((c.x, c.y, c.width, c.height))
}

/// What `decode_augmented` gives back: the batch (`None` where no image was kept), the index
/// of each image in it, the images skipped as `(name, reason)`.
type Augmented = (Option<Py<Array>>, Vec<usize>, Vec<(String, String)>);

/// A batch of JPEGs decoded on GPU `device`, each cropped (train: torchvision's
/// `RandomResizedCrop(scale, ratio)` and a coin for the mirror, drawn from `seed`, `epoch` and
/// the image's entry of `indices`; else the central square of `fraction` of the shorter side),
/// resized to `width` x `height` with antialiasing, as one array: `uint8` `[n, height, width,
/// 3]`, or with `normalize` `f32` `[n, 3, height, width]` of `(v / 255 - mean) / std`.
#[pyfunction]
#[pyo3(signature = (blobs, device, skip, train, seed, epoch, indices, width, height, normalize, mean, std, scale, ratio, fraction))]
#[allow(
    clippy::too_many_arguments,
    reason = "the decode's and the augmentation's settings, as Python passes them"
)]
pub fn decode_augmented(
    py: Python<'_>,
    blobs: Vec<Bound<'_, PyBytes>>,
    device: usize,
    skip: bool,
    train: bool,
    seed: u64,
    epoch: u64,
    indices: Vec<u64>,
    width: u32,
    height: u32,
    normalize: bool,
    mean: [f32; 3],
    std: [f32; 3],
    scale: (f64, f64),
    ratio: (f64, f64),
    fraction: f64,
) -> PyResult<Augmented> {
    use gpufeed::dataset::{Augmentation, Layout};

    if indices.len() != blobs.len() {
        return Err(GpufeedError::new_err(format!(
            "{} images and {} indices: give each image its record's index",
            blobs.len(),
            indices.len()
        )));
    }
    let augmentation = if train {
        Augmentation::Train { seed, scale, ratio }
    } else {
        Augmentation::Eval {
            crop_fraction: fraction,
        }
    };
    augmentation.check().map_err(py_err)?;
    let policy = if skip {
        OnBadImage::Skip
    } else {
        OnBadImage::Error
    };
    let layout = if normalize {
        Layout::F32Chw { mean, std }
    } else {
        Layout::U8Hwc
    };
    let name = |i: usize| format!("image {i}");
    let jpegs: Vec<&[u8]> = blobs.iter().map(|b| b.as_bytes()).collect();
    let loader = shared_loader(py, device)?;
    let gpu = loader.gpu().clone();
    let _context = gpufeed::cuda::ContextGuard::new();
    let mut choose = |i: usize, w: u32, h: u32| augmentation.choose(epoch, indices[i], w, h);
    let batch = py
        .detach(|| {
            with_decoder(&gpu, |decoder| {
                decoder.decode_augmented(&jpegs, &name, policy, &mut choose, width, height, layout)
            })
        })
        .map_err(py_err)?;
    let n = batch.kept.len();
    let array = match batch.buffer {
        None => None,
        Some(buf) => {
            let base = crate::array::device_address(&gpu, &buf);
            let nbytes = buf.len();
            let owner = Arc::new(Owner::new(Storage::Device(buf), Some(gpu.clone())));
            let (w, h) = (width as usize, height as usize);
            let (dtype, shape) = if normalize {
                (gpufeed::safetensors::Dtype::F32, [n, 3, h, w])
            } else {
                (gpufeed::safetensors::Dtype::U8, [n, h, w, 3])
            };
            let array = Array::typed(owner, base, nbytes, cuda(device), dtype, &shape);
            Some(Py::new(py, array)?)
        }
    };
    Ok((array, batch.kept, reasons(batch.skipped)))
}

/// `gpufeed_data::random_flip`: whether `decode_augmented` mirrors record `index` in `epoch`.
#[pyfunction]
pub fn random_flip(seed: u64, epoch: u64, index: u64) -> bool {
    gpufeed::dataset::random_flip(seed, epoch, index)
}
