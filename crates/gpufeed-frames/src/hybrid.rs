//! The hybrid training loader of the source's case study (§6.1: "mmap the raw image data set
//! read-only, preprocessed batches in shared memory, a memory pool for augmented samples;
//! GPU-accelerated preprocessing"), as a path through gpufeed's parts:
//!
//! 1. a [`RecordFile`](gpufeed_data::RecordFile) of RGB8 images, mapped read-only; a
//!    [`BatchLoader`](gpufeed_data::BatchLoader) gathers shuffled batches into buffers of
//!    its pinned pool and uploads them;
//! 2. [`GpuPlanar`] preprocesses each batch on the GPU: RGB8 to planar `f32` in [0, 1], one
//!    CHW image after another (gpufeed-cuda's planar kernel, compiled by the driver);
//! 3. the result stays on the GPU for a training step in this process, or [`Fanout`] copies
//!    it device -> host straight into a slot of a shared-memory ring (the ring registered with
//!    CUDA: the copy is a DMA, the source's `memcpy_dtoh(shm)`), one ring per training
//!    process, which takes its batches with a [`RingLoader`](gpufeed_data::ring::RingLoader).
//!
//! Without a GPU the same path runs on the CPU: [`planar_transform`] is the loader's
//! transform, and [`Fanout`] writes the host batches. The baseline the example and the bench
//! compare against is the `BatchLoader` with [`planar_transform`] on its workers.
//!
//! # Example (host batches, one training process: this one)
//! ```
//! use gpufeed_data::{BatchLoader, BatchData, BatchLoaderOptions, Order, RecordFile, Sampler};
//! use gpufeed_data::ring::RingLoader;
//! use gpufeed_frames::frames::FrameFormat;
//! use gpufeed_frames::hybrid::{Fanout, Planar, planar_transform};
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("images.bin");
//! let image = FrameFormat { width: 8, height: 4 };
//! std::fs::write(&path, vec![51u8; image.bytes() * 10])?;
//! // SAFETY: the file is not changed while mapped.
//! let records = unsafe { RecordFile::open_fixed(&path, image.bytes())? };
//! let cfg = BatchLoaderOptions::default().with_batch_size(5);
//! let mut loader = BatchLoader::new(records, Sampler::new(Order::Sequential), cfg, None)?
//!     .with_transform(planar_transform(image));
//! let rings = [gpufeed_ipc::BatchRing::anonymous(2, 1 << 20)?];
//! let mut fanout = Fanout::new(&rings, None)?;
//! for batch in loader.epoch(0)? {
//!     let batch = batch?;
//!     let BatchData::Host(bytes) = &batch.data else { unreachable!() };
//!     fanout.publish(0, &batch.indices, Planar::Host(&bytes[..batch.bytes()]))?;
//! }
//! let mut trainer = RingLoader::new(&rings[0], None)?;
//! let first = trainer.epoch(0, 2, std::time::Duration::from_secs(5)).next().unwrap()?;
//! assert_eq!(first.bytes(), 5 * 3 * 32 * 4); // five planar f32 images of 8 x 4
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;
use std::time::Duration;

use gpufeed_cuda::Gpu;
use gpufeed_cuda::cudarc::driver::{CudaSlice, CudaStream, DriverError};
use gpufeed_cuda::kernels::PlanarKernel;
use gpufeed_ipc::BatchRing;
use gpufeed_pinned::HostRegistration;

use crate::error::{Error, Result};
use crate::frames::FrameFormat;
use gpufeed_data::ring::{data_offset, slot_header};
use gpufeed_data::{Batch, BatchData};

fn cuda(op: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::from(gpufeed_cuda::Error::Cuda { op, result: e.0 })
}

/// The CPU form of the preprocessing, as a [`BatchLoader`](gpufeed_data::BatchLoader)
/// transform (wrap it in an `Arc` for a `WorkerShare`): a record holding one RGB8 image of `image`'s size becomes its planar `f32`
/// values in [0, 1] (little-endian bytes: the red plane, the green, the blue) — the same
/// values as [`GpuPlanar`] makes, bit for bit.
pub fn planar_transform(
    image: FrameFormat,
) -> impl Fn(usize, &[u8], &mut Vec<u8>) -> std::result::Result<(), String> + Send + Sync + 'static
{
    move |_, rec: &[u8], out: &mut Vec<u8>| {
        if rec.len() != image.bytes() {
            return Err(format!(
                "a record of {} bytes is not a {}x{} RGB8 image ({} bytes)",
                rec.len(),
                image.width,
                image.height,
                image.bytes()
            ));
        }
        let n = rec.len() / 3;
        let start = out.len();
        out.resize(start + 12 * n, 0);
        let dst = &mut out[start..];
        for (p, px) in rec.chunks_exact(3).enumerate() {
            for (c, &b) in px.iter().enumerate() {
                let at = 4 * (c * n + p);
                dst[at..at + 4].copy_from_slice(&(f32::from(b) / 255.0).to_le_bytes());
            }
        }
        Ok(())
    }
}

/// The preprocessing on the GPU: a batch of RGB8 images (records of one image each, uploaded
/// by a `BatchLoader` with a GPU) to planar `f32`, one CHW image after another.
#[derive(Debug, Clone)]
pub struct GpuPlanar {
    kernel: PlanarKernel,
    stream: Arc<CudaStream>,
    image: FrameFormat,
}

impl GpuPlanar {
    /// Loads the kernel for `gpu`, for images of `image`'s size, on a stream of its own.
    ///
    /// # Errors
    /// The driver's.
    pub fn new(gpu: &Gpu, image: FrameFormat) -> Result<Self> {
        Ok(GpuPlanar {
            kernel: PlanarKernel::load(gpu)?,
            stream: gpu.context().new_stream().map_err(cuda("cuStreamCreate"))?,
            image,
        })
    }

    /// The stream its kernels run on (wait for it, or use the result on it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `batch`'s images as planar `f32` in new device memory (queued on [`GpuPlanar::stream`]:
    /// cudarc orders later uses of the result after it).
    ///
    /// # Errors
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for a batch on the host (give the loader a GPU), with a
    /// record that is not one image, or of more than 65,535 images; the driver's.
    pub fn apply(&self, batch: &Batch) -> Result<CudaSlice<f32>> {
        let BatchData::Device(src) = &batch.data else {
            return Err(Error::invalid(
                "GpuPlanar preprocesses batches on the GPU: make the BatchLoader with a GPU".into(),
            ));
        };
        let bytes = self.image.bytes();
        if let Some(k) = batch.offsets.windows(2).position(|w| w[1] - w[0] != bytes) {
            return Err(Error::invalid(format!(
                "record {} of batch {} is {} bytes, not a {}x{} RGB8 image ({bytes} bytes)",
                batch.indices[k],
                batch.number,
                batch.offsets[k + 1] - batch.offsets[k],
                self.image.width,
                self.image.height
            )));
        }
        let images = batch.indices.len();
        if images > 65_535 {
            return Err(Error::invalid(format!(
                "a batch of {images} images: GpuPlanar takes at most 65,535 per batch"
            )));
        }
        let pixels = u32::try_from(bytes / 3)
            .map_err(|_| Error::invalid("images of 2^32 pixels or more".into()))?;
        let mut dst = self
            .stream
            .alloc_zeros::<f32>(3 * (bytes / 3) * images)
            .map_err(cuda("cuMemAlloc (a planar batch)"))?;
        // One launch (the grid's y is the image).
        self.kernel
            .launch_images(&self.stream, src, &mut dst, pixels, images as u32)?;
        Ok(dst)
    }
}

/// Preprocessed batch data to publish: on the GPU (copied device -> host into the slot) or on
/// the host (copied in).
#[derive(Debug, Clone, Copy)]
pub enum Planar<'a> {
    /// A [`GpuPlanar::apply`] result, with the stream it was made on.
    Device(&'a CudaSlice<f32>, &'a Arc<CudaStream>),
    /// Bytes on the host (a `BatchLoader`'s host batch with [`planar_transform`]).
    Host(&'a [u8]),
}

/// Preprocessed batches handed to training processes: one shared-memory ring per process,
/// batches dealt out in turns (from the first ring at each epoch's start), each ring's
/// batches of an epoch numbered 0, 1, ... in its own order (what its
/// [`RingLoader`](gpufeed_data::ring::RingLoader) expects; [`batches_for`] says how many).
/// With a GPU, each ring is registered with CUDA so that the device -> host copy lands in the
/// slot directly. While it lives, the fanout is each ring's registered producer
/// ([`BatchRing::producer`]): a trainer waiting for a batch once the fanout is dropped, or its
/// process died, gets [`gpufeed_ipc::Error::ProducerGone`] at once, not after its timeout.
pub struct Fanout<'r> {
    rings: &'r [BatchRing],
    _producers: Vec<gpufeed_ipc::Producer<'r>>,
    registrations: Vec<Option<HostRegistration<'r>>>,
    numbers: Vec<usize>,
    next: usize,
    /// The epoch being published: a new one starts every ring's numbering and the turns over.
    epoch: Option<u64>,
    timeout: Duration,
}

impl std::fmt::Debug for Fanout<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fanout")
            .field("rings", &self.rings.len())
            .field("published", &self.numbers)
            .finish()
    }
}

/// Batches training process `trainer` of `trainers` gets from a [`Fanout`] of `batches`.
pub fn batches_for(batches: usize, trainers: usize, trainer: usize) -> usize {
    if trainer >= trainers {
        return 0;
    }
    (batches + trainers - 1 - trainer) / trainers
}

impl<'r> Fanout<'r> {
    /// Deals batches out over `rings` (one per training process); registers them with `gpu`'s
    /// context where given (a ring that cannot be registered is copied into through the
    /// driver's staging, and logged).
    ///
    /// # Errors
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for no ring; the ring's when it cannot take another producer
    /// (16 live ones registered) or was attached before a fork.
    pub fn new(rings: &'r [BatchRing], gpu: Option<&Gpu>) -> Result<Self> {
        if rings.is_empty() {
            return Err(Error::invalid(
                "a Fanout needs at least one ring (one per training process)".into(),
            ));
        }
        let producers = rings
            .iter()
            .map(BatchRing::producer)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let registrations = rings
            .iter()
            .map(|r| {
                gpu.and_then(|g| match HostRegistration::shm(g.context(), r.segment()) {
                    Ok(reg) => Some(reg),
                    Err(e) => {
                        tracing::warn!("a trainer's ring could not be registered ({e}): copies into it are staged");
                        None
                    }
                })
            })
            .collect();
        Ok(Fanout {
            rings,
            _producers: producers,
            registrations,
            numbers: vec![0; rings.len()],
            next: 0,
            epoch: None,
            timeout: Duration::from_secs(60),
        })
    }

    /// This fanout waiting at most `timeout` for a free slot (default 60 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Whether ring `i` is registered with CUDA.
    pub fn registered(&self, i: usize) -> bool {
        self.registrations.get(i).is_some_and(Option::is_some)
    }

    /// Publishes one preprocessed batch — the records `indices` of `epoch`, equal shares of
    /// `data` — to the next training process's ring; returns that ring's number. Publish an
    /// epoch's batches in order, and epochs one after another.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for data that does not split into the records, or a batch
    /// larger than a slot; the ring's (a trainer gone, no free slot within the timeout); the
    /// driver's.
    #[allow(
        unsafe_code,
        reason = "copies device memory straight into the claimed slot"
    )]
    pub fn publish(&mut self, epoch: u64, indices: &[usize], data: Planar<'_>) -> Result<usize> {
        let len = match data {
            Planar::Device(d, _) => d.len() * 4,
            Planar::Host(b) => b.len(),
        };
        if indices.is_empty() || !len.is_multiple_of(indices.len()) {
            return Err(Error::invalid(format!(
                "{len} bytes do not split into {} records",
                indices.len()
            )));
        }
        if self.epoch != Some(epoch) {
            self.epoch = Some(epoch);
            self.numbers.fill(0);
            self.next = 0;
        }
        let per = (len / indices.len()) as u64;
        let offsets: Vec<u64> = (0..=indices.len() as u64).map(|k| k * per).collect();
        let r = self.next;
        let ring = &self.rings[r];
        let at = data_offset(indices.len());
        if (at + len) as u64 > ring.slot_bytes() {
            return Err(Error::invalid(format!(
                "a batch of {} bytes does not fit the ring's slots of {}: make them at least {} bytes",
                at + len,
                ring.slot_bytes(),
                at + len
            )));
        }
        let mut claim = ring.claim(self.timeout)?;
        claim.write_at(0, &slot_header(epoch, self.numbers[r], indices, &offsets))?;
        match data {
            Planar::Host(bytes) => claim.write_at(at as u64, bytes)?,
            Planar::Device(d, stream) => {
                // SAFETY: the slot is this claim's until it is published, and the copy is
                // waited for below, before that.
                let slot = unsafe { claim.as_mut_slice() };
                // SAFETY: f32s read as their bytes: every bit pattern is a valid u8.
                let bytes = unsafe { d.transmute::<u8>(len) }.ok_or_else(|| {
                    Error::invalid("a planar batch shorter than its length".into())
                })?;
                stream
                    .memcpy_dtoh(&bytes, &mut slot[at..at + len])
                    .map_err(cuda("cuMemcpyDtoHAsync (into a shared-memory slot)"))?;
                stream.synchronize().map_err(cuda("cuStreamSynchronize"))?;
            }
        }
        claim.set_len((at + len) as u64)?;
        claim.publish()?;
        self.numbers[r] += 1;
        self.next = (r + 1) % self.rings.len();
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_transform_makes_planar_floats_and_refuses_other_sizes() {
        let f = planar_transform(FrameFormat {
            width: 2,
            height: 1,
        });
        let mut out = Vec::new();
        f(0, &[0, 51, 102, 255, 153, 204], &mut out).expect("transform");
        let got: Vec<f32> = out
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4")))
            .collect();
        assert_eq!(got, [0.0, 1.0, 0.2, 0.6, 0.4, 0.8]);
        assert!(
            f(0, &[1, 2, 3], &mut out)
                .unwrap_err()
                .contains("not a 2x1")
        );
    }

    #[test]
    fn a_batch_that_does_not_fit_or_split_is_refused_before_a_slot_is_claimed() {
        let rings = [BatchRing::anonymous(2, 4096).expect("ring")];
        let mut fanout = Fanout::new(&rings, None).expect("fanout");
        let err = fanout
            .publish(0, &[1, 2], Planar::Host(&[0u8; 8000]))
            .unwrap_err();
        assert!(err.to_string().contains("make them at least"), "{err}");
        let err = fanout
            .publish(0, &[1, 2, 3], Planar::Host(&[0u8; 100]))
            .unwrap_err();
        assert!(err.to_string().contains("do not split"), "{err}");
        assert_eq!(rings[0].stats().claimed, 0, "no slot was claimed");
        assert!(Fanout::new(&[], None).is_err(), "no ring");
        // What fits goes out, numbered from 0 in each epoch.
        fanout
            .publish(0, &[1, 2], Planar::Host(&[7u8; 64]))
            .expect("publish");
        assert_eq!(fanout.numbers, [1]);
        fanout
            .publish(1, &[3, 4], Planar::Host(&[7u8; 64]))
            .expect("publish");
        assert_eq!(fanout.numbers, [1], "epoch 1 starts again from 0");
    }

    #[test]
    fn batches_are_dealt_out_in_turns() {
        assert_eq!(
            (0..3).map(|t| batches_for(10, 3, t)).collect::<Vec<_>>(),
            [4, 3, 3]
        );
        assert_eq!(batches_for(10, 3, 3), 0);
    }
}
