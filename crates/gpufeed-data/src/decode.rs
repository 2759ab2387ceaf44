//! Batches of JPEGs decoded into device memory (issue 40): nvJPEG where it loads (the
//! hardware engines for the images they take, its CUDA decoder for the others), the CPU decoder
//! of [`crate::images`] for what nvJPEG refuses and where nvJPEG is not installed, and the
//! caller's [`OnBadImage`] policy for what neither decodes.
//!
//! Every image of a batch lands in one device allocation as interleaved RGB (HWC `uint8`), at
//! an offset that is a multiple of 256 bytes, rows back to back. [`decode_on_cpu`] does the
//! same on the host, for machines without a GPU.

use std::sync::Arc;

use gpufeed_cuda::cudarc::driver::{CudaSlice, CudaStream};
use gpufeed_cuda::nvjpeg::{Backend, DecodedBy, Nvjpeg, Slot};
pub use gpufeed_cuda::resize::Layout;
use gpufeed_cuda::resize::{ResizeJob, ResizeKernel};
use gpufeed_cuda::{Error as CudaError, Gpu};

use crate::augment::Crop;
use crate::error::{Error, Result};
use crate::images::{DecodedImage, ImageError, OnBadImage, SkippedImage, decode_jpeg, plausible};

/// Which decoder made an image of a [`DecodedBatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodedWith {
    /// nvJPEG on the GPU's hardware decoder engines.
    Hardware,
    /// nvJPEG's CUDA decoder.
    Cuda,
    /// The CPU decoder (zune-jpeg), then uploaded: nvJPEG refused the image, or is not
    /// installed.
    Cpu,
}

/// A batch of images decoded into device memory ([`ImageDecoder::decode`]).
#[derive(Debug)]
pub struct DecodedBatch {
    /// The device memory holding every decoded image (`None` where no image has a byte).
    pub buffer: Option<CudaSlice<u8>>,
    /// Per image given: where it is in `buffer` (offset, pitch `3 * width`, size) and which
    /// decoder made it; `None` for an image skipped ([`OnBadImage::Skip`]).
    pub images: Vec<Option<(Slot, DecodedWith)>>,
    /// The images skipped, with why.
    pub skipped: Vec<SkippedImage>,
}

/// A batch of decoded, cropped, resized (and mirrored) images in device memory
/// ([`ImageDecoder::decode_augmented`]).
#[derive(Debug)]
pub struct AugmentedBatch {
    /// The images back to back in `layout` (`None` where no image was kept).
    pub buffer: Option<CudaSlice<u8>>,
    /// The index (in the batch given) of each image in `buffer`, in order: all of them but
    /// those skipped.
    pub kept: Vec<usize>,
    /// The images skipped, with why ([`OnBadImage::Skip`]).
    pub skipped: Vec<SkippedImage>,
    /// Each image's width.
    pub width: u32,
    /// Each image's height.
    pub height: u32,
    /// The layout of `buffer`.
    pub layout: Layout,
}

/// Decodes batches of JPEGs into device memory of one GPU (see the module), on a stream of
/// its own: several decoders (one per thread) decode at once, and none waits for work queued
/// on the legacy default stream (a training step's, with torch) or holds it up.
#[derive(Debug)]
pub struct ImageDecoder {
    gpu: Gpu,
    stream: Arc<CudaStream>,
    nvjpeg: Option<Nvjpeg>,
    /// Why nvJPEG is not used, where it is not.
    cpu_only: Option<String>,
    /// The crop-and-resize kernels, loaded on first use.
    resize: Option<ResizeKernel>,
    /// Threads for the images decoded on the CPU (every core by default; a share of them where
    /// several decoders run at once: [`ImageDecoder::set_cpu_threads`]).
    cpu_threads: usize,
    /// The nvJPEG backend it was opened for.
    asked: Backend,
}

/// Offsets in a batch's allocation are multiples of this.
const ALIGN: usize = 256;

impl ImageDecoder {
    /// A decoder on `gpu`: nvJPEG where it loads (with the hardware backend where the GPU has
    /// decoder engines), else the CPU decoder and an upload ([`ImageDecoder::cpu_only`] says
    /// why).
    ///
    /// # Errors
    /// nvJPEG's errors other than its absence (a library that loads but makes no handle on
    /// this GPU), as [`Error::Load`].
    pub fn open(gpu: &Gpu) -> Result<Self> {
        Self::open_with(gpu, Backend::Hardware)
    }

    /// [`ImageDecoder::open`] with nvJPEG's `backend`: [`Backend::Cuda`] decodes each batch on
    /// the GPU's cores even where the GPU has decoder engines ([`Nvjpeg::open_with`]), so that
    /// decoders of both kinds can work at once.
    ///
    /// # Errors
    /// As [`ImageDecoder::open`].
    pub fn open_with(gpu: &Gpu, backend: Backend) -> Result<Self> {
        let (nvjpeg, cpu_only) = match Nvjpeg::open_with(gpu, backend) {
            Ok(nv) => (Some(nv), None),
            Err(e @ CudaError::NvjpegMissing { .. }) => {
                tracing::info!("JPEGs decode on the CPU: {e}");
                (None, Some(e.to_string()))
            }
            Err(e) => return Err(Error::Load(e.into())),
        };
        let stream = gpu.context().new_stream().map_err(|e| {
            Error::Load(
                CudaError::Cuda {
                    op: "cuStreamCreate",
                    result: e.0,
                }
                .into(),
            )
        })?;
        Ok(ImageDecoder {
            gpu: gpu.clone(),
            stream,
            nvjpeg,
            cpu_only,
            resize: None,
            cpu_threads: cores(),
            asked: backend,
        })
    }

    /// At most `threads` threads (at least 1) decode this decoder's images on the CPU: where
    /// nvJPEG is missing or refuses images and several decoders run at once, each takes a
    /// share of the cores instead of all of them.
    pub fn set_cpu_threads(&mut self, threads: usize) {
        self.cpu_threads = threads.max(1);
    }

    /// The nvJPEG backend it was opened for ([`ImageDecoder::open_with`]; the handle's own may
    /// differ: a GPU without engines gives the CUDA decoder).
    pub fn backend_asked(&self) -> Backend {
        self.asked
    }

    /// Why JPEGs are decoded on the CPU here (nvJPEG could not be loaded), or `None` where
    /// nvJPEG decodes them.
    pub fn cpu_only(&self) -> Option<&str> {
        self.cpu_only.as_deref()
    }

    /// The nvJPEG handle, where nvJPEG loaded.
    pub fn nvjpeg(&self) -> Option<&Nvjpeg> {
        self.nvjpeg.as_ref()
    }

    /// Decodes `jpegs` into one new device allocation (see [`DecodedBatch`]), returning once
    /// every byte is there. An image that no decoder takes follows `policy`: with
    /// [`OnBadImage::Error`] the first such (by index) is [`Error::Image`] named by
    /// `name(index)`; with [`OnBadImage::Skip`] it is left out and listed.
    ///
    /// # Errors
    /// [`Error::Image`] (above); [`Error::Load`] for device memory and CUDA failures.
    pub fn decode(
        &mut self,
        jpegs: &[&[u8]],
        name: &dyn Fn(usize) -> String,
        policy: OnBadImage,
    ) -> Result<DecodedBatch> {
        let mut bad: Vec<(usize, ImageError)> = Vec::new();
        let mut slots: Vec<Option<Slot>> = Vec::with_capacity(jpegs.len());
        let mut total = 0usize;
        for (i, jpeg) in jpegs.iter().enumerate() {
            match checked_header(jpeg) {
                Ok((w, h)) => {
                    let slot = Slot::packed(total, w, h);
                    total = (total + slot.span()).next_multiple_of(ALIGN);
                    slots.push(Some(slot));
                }
                Err(e) => {
                    bad.push((i, e));
                    slots.push(None);
                }
            }
        }
        let stream = Arc::clone(&self.stream);
        let mut buffer = if total == 0 {
            None
        } else {
            // Zeroed (a memset queued on the GPU): a slot whose image failed is never handed
            // out, but nothing of another's memory is in it either.
            Some(
                self.gpu
                    .alloc_zeroed_on(&stream, total)
                    .map_err(|e| Error::Load(e.into()))?,
            )
        };
        let mut with: Vec<Option<DecodedWith>> = vec![None; jpegs.len()];
        let mut on_cpu: Vec<usize> = Vec::new();
        let decoding: Vec<usize> = (0..jpegs.len()).filter(|&i| slots[i].is_some()).collect();
        match (&mut self.nvjpeg, &mut buffer) {
            (Some(nv), Some(buf)) if !decoding.is_empty() => {
                let some: Vec<&[u8]> = decoding.iter().map(|&i| jpegs[i]).collect();
                let places: Vec<Slot> = decoding.iter().filter_map(|&i| slots[i]).collect();
                let outcomes = nv
                    .decode_batch(&some, &mut buf.slice_mut(..), &places, &stream)
                    .map_err(|e| Error::Load(e.into()))?;
                for (&i, outcome) in decoding.iter().zip(outcomes) {
                    match outcome {
                        Ok(DecodedBy::Hardware) => with[i] = Some(DecodedWith::Hardware),
                        Ok(DecodedBy::Cuda) => with[i] = Some(DecodedWith::Cuda),
                        Err(e) => {
                            tracing::debug!(
                                image = i,
                                "nvJPEG refused it ({e}): the CPU decodes it"
                            );
                            on_cpu.push(i);
                        }
                    }
                }
            }
            _ => on_cpu = decoding,
        }
        if !on_cpu.is_empty() {
            let some: Vec<&[u8]> = on_cpu.iter().map(|&i| jpegs[i]).collect();
            let decoded = decode_all(&some, self.cpu_threads);
            for (&i, result) in on_cpu.iter().zip(decoded) {
                match result {
                    Ok(image) => {
                        let (Some(slot), Some(buf)) = (slots[i], buffer.as_mut()) else {
                            continue;
                        };
                        if (image.width, image.height) != (slot.width, slot.height) {
                            bad.push((
                                i,
                                ImageError::Corrupt {
                                    reason: format!(
                                        "its headers say {}x{}, its image is {}x{}",
                                        slot.width, slot.height, image.width, image.height
                                    ),
                                },
                            ));
                            continue;
                        }
                        let mut view = buf.slice_mut(slot.offset..slot.offset + slot.span());
                        stream.memcpy_htod(&image.pixels, &mut view).map_err(|e| {
                            Error::Load(
                                CudaError::Cuda {
                                    op: "cuMemcpyHtoDAsync",
                                    result: e.0,
                                }
                                .into(),
                            )
                        })?;
                        with[i] = Some(DecodedWith::Cpu);
                    }
                    Err(e) => bad.push((i, e)),
                }
            }
            self.gpu
                .wait_asleep(&stream)
                .map_err(|e| Error::Load(e.into()))?;
        }
        let skipped = settle(bad, name, policy)?;
        let images = slots
            .into_iter()
            .zip(with)
            .map(|(slot, with)| slot.zip(with))
            .collect();
        Ok(DecodedBatch {
            buffer,
            images,
            skipped,
        })
    }
}

impl ImageDecoder {
    /// [`ImageDecoder::decode`], then each image kept cropped and mirrored as `choose(index,
    /// width, height)` says, resized to `width` x `height` (bilinear, antialiased:
    /// [`gpufeed_cuda::resize`]) into one buffer in `layout`; returns once it is there. The
    /// decoded images are freed after.
    ///
    /// # Errors
    /// As [`ImageDecoder::decode`]; [`Error::Load`] for a crop outside its image (a `choose`
    /// that ignores the size it is given), an empty output, and CUDA failures.
    #[allow(
        clippy::too_many_arguments,
        reason = "the decode's and the augmentation's settings"
    )]
    pub fn decode_augmented(
        &mut self,
        jpegs: &[&[u8]],
        name: &dyn Fn(usize) -> String,
        policy: OnBadImage,
        choose: &mut dyn FnMut(usize, u32, u32) -> (Crop, bool),
        width: u32,
        height: u32,
        layout: Layout,
    ) -> Result<AugmentedBatch> {
        let decoded = self.decode(jpegs, name, policy)?;
        let load = |e: CudaError| Error::Load(e.into());
        if self.resize.is_none() {
            self.resize = Some(ResizeKernel::load(&self.gpu).map_err(load)?);
        }
        let stream = Arc::clone(&self.stream);
        let mut kept = Vec::new();
        let mut jobs = Vec::new();
        if decoded.buffer.is_some() {
            for (i, image) in decoded.images.iter().enumerate() {
                let Some((slot, _)) = image else { continue };
                let (crop, flip) = choose(i, slot.width, slot.height);
                kept.push(i);
                jobs.push(ResizeJob {
                    src: slot.offset as u64,
                    pitch: slot.pitch,
                    width: slot.width,
                    height: slot.height,
                    crop: (crop.x, crop.y, crop.width, crop.height),
                    flip,
                });
            }
        }
        let bytes = layout.image_bytes(width, height) * jobs.len();
        let mut buffer = None;
        if let (true, Some(src)) = (bytes > 0, decoded.buffer.as_ref()) {
            let mut out = self.gpu.alloc_zeroed_on(&stream, bytes).map_err(load)?;
            let kernel = self
                .resize
                .as_ref()
                .ok_or_else(|| Error::invalid("the resize kernels did not load".into()))?;
            kernel
                .launch(&stream, src, &jobs, width, height, &mut out, layout)
                .map_err(load)?;
            self.gpu.wait_asleep(&stream).map_err(load)?;
            buffer = Some(out);
        }
        drop(decoded.buffer);
        Ok(AugmentedBatch {
            buffer,
            kept,
            skipped: decoded.skipped,
            width,
            height,
            layout,
        })
    }
}

/// Decodes `jpegs` on the CPU (the threads of the machine, a share of the images each); an
/// image that does not decode follows `policy` (as in [`ImageDecoder::decode`]): `None` in
/// its place where skipped.
///
/// # Errors
/// [`Error::Image`] with [`OnBadImage::Error`].
pub fn decode_on_cpu(
    jpegs: &[&[u8]],
    name: &dyn Fn(usize) -> String,
    policy: OnBadImage,
) -> Result<(Vec<Option<DecodedImage>>, Vec<SkippedImage>)> {
    let mut bad = Vec::new();
    let mut out = Vec::with_capacity(jpegs.len());
    for (i, result) in decode_all(jpegs, cores()).into_iter().enumerate() {
        match result {
            Ok(image) => out.push(Some(image)),
            Err(e) => {
                bad.push((i, e));
                out.push(None);
            }
        }
    }
    let skipped = settle(bad, name, policy)?;
    Ok((out, skipped))
}

/// The size of `jpeg` from its headers, or why it is not decoded: the checks every decoder
/// needs before memory is sized from the headers ([`crate::images`]' `plausible`: components,
/// precision, pixels, a byte floor for the declared size, the end marker).
fn checked_header(jpeg: &[u8]) -> std::result::Result<(u32, u32), ImageError> {
    let header = plausible(jpeg)?.header;
    Ok((header.width, header.height))
}

/// Each of `jpegs` decoded on the CPU, by at most `threads` threads.
fn decode_all(
    jpegs: &[&[u8]],
    threads: usize,
) -> Vec<std::result::Result<DecodedImage, ImageError>> {
    per_image_on_threads(jpegs.len(), threads, |i| decode_jpeg(jpegs[i]))
}

/// The machine's cores (as the process may use them).
pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `one(i)` for each image `i` of `n`, on at most `threads` threads (a share of the images
/// each), in order. A thread that panics (not the decoder: `decode_jpeg` catches its panics)
/// has its images reported as [`ImageError::DecoderPanicked`].
pub(crate) fn per_image_on_threads<T: Send>(
    n: usize,
    threads: usize,
    one: impl Fn(usize) -> std::result::Result<T, ImageError> + Sync,
) -> Vec<std::result::Result<T, ImageError>> {
    let threads = threads.max(1).min(n);
    if threads <= 1 {
        // On this thread, each image's panic caught as a thread's would be (its own image
        // reported, not the caller's thread unwound).
        return (0..n)
            .map(|i| {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| one(i))).unwrap_or_else(
                    |_| {
                        Err(ImageError::DecoderPanicked {
                            message: "a decoding thread panicked".into(),
                        })
                    },
                )
            })
            .collect();
    }
    let per = n.div_ceil(threads);
    let one = &one;
    std::thread::scope(|scope| {
        let parts: Vec<_> = (0..n)
            .step_by(per)
            .map(|lo| scope.spawn(move || (lo..(lo + per).min(n)).map(one).collect::<Vec<_>>()))
            .collect();
        parts
            .into_iter()
            .zip((0..n).step_by(per))
            .flat_map(|(p, lo)| {
                p.join().unwrap_or_else(|_| {
                    (lo..(lo + per).min(n))
                        .map(|_| {
                            Err(ImageError::DecoderPanicked {
                                message: "a decoding thread panicked".into(),
                            })
                        })
                        .collect()
                })
            })
            .collect()
    })
}

/// Applies `policy` to the images that were not decoded: the first as an error, or the list
/// of those skipped.
fn settle(
    mut bad: Vec<(usize, ImageError)>,
    name: &dyn Fn(usize) -> String,
    policy: OnBadImage,
) -> Result<Vec<SkippedImage>> {
    bad.sort_by_key(|(i, _)| *i);
    match policy {
        OnBadImage::Error => match bad.into_iter().next() {
            Some((i, e)) => Err(e.named(name(i))),
            None => Ok(Vec::new()),
        },
        OnBadImage::Skip => Ok(bad
            .into_iter()
            .map(|(i, reason)| SkippedImage {
                name: name(i),
                reason,
            })
            .collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// At most the threads asked for run at once (several decoders share the cores), every
    /// image's result comes back in order, and a thread's panic fails only its own images.
    #[test]
    fn images_run_on_at_most_the_threads_given_in_order() {
        for threads in [1, 2, 3, 8] {
            let (running, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
            let out = per_image_on_threads(23, threads, |i| {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(3));
                running.fetch_sub(1, Ordering::SeqCst);
                Ok(i * 2)
            });
            let got: Vec<usize> = out.into_iter().map(|r| r.expect("ok")).collect();
            assert_eq!(got, (0..23).map(|i| i * 2).collect::<Vec<_>>());
            let most = most.load(Ordering::SeqCst);
            assert!(most <= threads, "{most} ran at once with {threads} threads");
            if threads > 1 {
                assert!(
                    most > 1,
                    "the images ran on one thread with {threads} given"
                );
            }
        }
        let out = per_image_on_threads(6, 3, |i| {
            assert!(i / 2 != 1, "a bug in the closure");
            Ok(i)
        });
        let failed: Vec<bool> = out.iter().map(Result::is_err).collect();
        assert_eq!(failed, [false, false, true, true, false, false]);
        // On one thread: the panicking image alone fails, the caller's thread goes on.
        let out = per_image_on_threads(4, 1, |i| {
            assert!(i != 2, "a bug in the closure");
            Ok(i)
        });
        let failed: Vec<bool> = out.iter().map(Result::is_err).collect();
        assert_eq!(failed, [false, false, true, false]);
    }
}
