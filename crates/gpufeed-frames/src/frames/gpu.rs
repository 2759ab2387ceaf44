//! The frame pipeline's GPU consumer (the source's §6.2 with its GPU half): each frame is
//! copied from its ring slot — the ring's shared memory registered with CUDA, so the copy is a
//! DMA straight out of the slot — into one of two device buffers, and the planar kernel
//! ([`PlanarKernel`]) runs on it, while the next frame's copy goes on the other buffer's stream
//! (double buffering). A slot goes back to the producer once its frame's kernel completed.
//! Latency runs from capture to the kernel's end as the host sees it (its event completed);
//! the GPU's busy time comes from CUDA events around each copy and kernel (overlaps counted
//! once). Every `check_every`-th frame's result is compared with the CPU's
//! ([`to_planar_f32`](super::to_planar_f32)'s values) on three rows of each plane.

use std::collections::VecDeque;
use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpufeed_cuda::Gpu;
use gpufeed_cuda::cudarc::driver::sys::CUevent_flags;
use gpufeed_cuda::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DriverError};
use gpufeed_cuda::kernels::PlanarKernel;
use gpufeed_ipc::BatchRing;
use gpufeed_pinned::HostRegistration;

use super::{FrameFormat, FrameHeader, Run, RunReport, check_some, frame_in, monotonic_ns};
use crate::error::{Error, Result};

fn cuda(op: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::from(gpufeed_cuda::Error::Cuda { op, result: e.0 })
}

/// One of the two frame buffers: the frame's pixels, its planar result, its stream, and the
/// events around its copy and its kernel.
struct Lane {
    stream: Arc<CudaStream>,
    input: CudaSlice<u8>,
    output: CudaSlice<f32>,
    start: CudaEvent,
    copied: CudaEvent,
    done: CudaEvent,
}

/// A GPU consumer of frames of one format: the kernel, two buffers with their streams.
///
/// # Example
/// ```
/// use gpufeed_frames::frames::{FrameFormat, GpuFrames, produce};
/// let gpu = match gpufeed_load::Gpu::open(0) {
///     Ok(gpu) => gpu,
///     Err(e) if e.is_no_gpu() => return Ok(()), // a machine without a GPU
///     Err(e) => return Err(e.into()),
/// };
/// let format = FrameFormat { width: 64, height: 48 };
/// let ring = gpufeed_ipc::BatchRing::anonymous(4, format.slot_bytes())?;
/// let mut consumer = GpuFrames::new(&gpu, format)?.with_check_every(1);
/// let run = std::thread::scope(|s| {
///     s.spawn(|| produce(&ring, format, 0.0, 0..20));
///     consumer.run_ring(&ring, 20, std::time::Duration::from_secs(5))
/// })?;
/// assert_eq!((run.run.seen.len(), run.checked), (20, 20));
/// # Ok::<(), gpufeed_frames::Error>(())
/// ```
pub struct GpuFrames {
    gpu: Gpu,
    format: FrameFormat,
    pixels: u32,
    kernel: PlanarKernel,
    lanes: [Lane; 2],
    /// Recorded when a run starts: the events' times are taken from it.
    reference: CudaEvent,
    check_every: u64,
}

impl std::fmt::Debug for GpuFrames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuFrames")
            .field("gpu", &self.gpu.info().ordinal)
            .field("format", &self.format)
            .field("check_every", &self.check_every)
            .finish()
    }
}

/// What a GPU consumer's run did.
#[derive(Debug, Clone, Default)]
pub struct GpuRun {
    /// Frames seen with their latency; `busy` is the GPU's busy time (copies and kernels,
    /// overlaps counted once), `wall` the run's.
    pub run: Run,
    /// Each frame's copy, milliseconds (from its events).
    pub copy_ms: Vec<f64>,
    /// Each frame's kernel, milliseconds.
    pub kernel_ms: Vec<f64>,
    /// Frames whose result was compared with the CPU's (all equal, or the run failed).
    pub checked: u64,
    /// Whether the copies came from registered memory (the ring's, registered with CUDA); a
    /// ring that could not be registered is copied through the driver's staging, slower.
    pub registered: bool,
}

/// A [`GpuRun`]'s figures.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GpuReport {
    /// Latency, drops, late frames; the GPU's busy fraction; frames per second.
    #[serde(flatten)]
    pub run: RunReport,
    /// The median frame's copy, milliseconds.
    pub copy_ms: f64,
    /// The median frame's kernel, milliseconds.
    pub kernel_ms: f64,
    /// Frames checked against the CPU.
    pub checked: u64,
    /// Copies from registered memory.
    pub registered: bool,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

impl GpuRun {
    /// The run's figures against frames `0..expected` captured every `interval`.
    pub fn report(&self, expected: u64, interval: Option<Duration>) -> GpuReport {
        GpuReport {
            run: self.run.report(expected, interval),
            copy_ms: median(&self.copy_ms),
            kernel_ms: median(&self.kernel_ms),
            checked: self.checked,
            registered: self.registered,
        }
    }
}

/// Intervals' total length, overlaps counted once.
fn union_ms(mut spans: Vec<(f64, f64)>) -> f64 {
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut open: Option<(f64, f64)> = None;
    for (a, b) in spans {
        match &mut open {
            Some((_, end)) if a <= *end => *end = end.max(b),
            _ => {
                if let Some((s, e)) = open {
                    total += e - s;
                }
                open = Some((a, b));
            }
        }
    }
    total + open.map_or(0.0, |(s, e)| e - s)
}

/// Synchronizes the streams when dropped: a run that fails with copies in flight waits for
/// them before their slots go back to the producer and the ring is unregistered.
struct Drain([Arc<CudaStream>; 2]);

impl Drop for Drain {
    fn drop(&mut self) {
        for s in &self.0 {
            if let Err(e) = s.synchronize() {
                tracing::warn!("a frame stream failed to synchronize: {e}");
            }
        }
    }
}

impl GpuFrames {
    /// Loads the kernel and sets up two buffers of `format` on `gpu` (each frame's pixels and
    /// its planar result: 15 bytes a pixel, twice).
    ///
    /// # Errors
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for frames of no pixels or of 2^32 or more; the driver's
    /// (kernel, memory, streams, events).
    pub fn new(gpu: &Gpu, format: FrameFormat) -> Result<Self> {
        let pixels = u32::try_from(u64::from(format.width) * u64::from(format.height))
            .map_err(|_| Error::invalid("frames of 2^32 pixels or more".into()))?;
        if pixels == 0 {
            return Err(Error::invalid(format!(
                "frames of {}x{} pixels: width and height must be at least 1",
                format.width, format.height
            )));
        }
        let kernel = PlanarKernel::load(gpu)?;
        let ctx = gpu.context();
        let event = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(cuda("cuEventCreate"))
        };
        let lane = || -> Result<Lane> {
            let stream = ctx.new_stream().map_err(cuda("cuStreamCreate"))?;
            let input = stream
                .alloc_zeros::<u8>(format.bytes())
                .map_err(cuda("cuMemAlloc (a frame)"))?;
            let output = stream
                .alloc_zeros::<f32>(3 * pixels as usize)
                .map_err(cuda("cuMemAlloc (a planar frame)"))?;
            Ok(Lane {
                stream,
                input,
                output,
                start: event()?,
                copied: event()?,
                done: event()?,
            })
        };
        Ok(GpuFrames {
            gpu: gpu.clone(),
            format,
            pixels,
            kernel,
            lanes: [lane()?, lane()?],
            reference: event()?,
            check_every: 60,
        })
    }

    /// Compares every `n`-th frame's result with the CPU's (default 60: once a second at 60
    /// fps; 0: never).
    pub fn with_check_every(mut self, n: u64) -> Self {
        self.check_every = n;
        self
    }

    /// Takes frames from `ring` in order until frame `frames - 1` went by or none came for
    /// `idle`: each copied from its slot and transformed on the GPU, two in flight.
    ///
    /// # Errors
    /// A slot that holds no frame of this format; a frame whose pixels are not what the
    /// producer paints ([`check_some`]); [`Error::ResultMismatch`]; the ring's and the
    /// driver's.
    #[allow(
        unsafe_code,
        reason = "copies each frame from where it lies in its taken slot"
    )]
    pub fn run_ring(&mut self, ring: &BatchRing, frames: u64, idle: Duration) -> Result<GpuRun> {
        let consumer = ring.consumer()?;
        let registration = HostRegistration::shm(self.gpu.context(), ring.segment());
        if let Err(e) = &registration {
            tracing::warn!(
                "the frame ring could not be registered with CUDA ({e}): copies are staged"
            );
        }
        let mut out = GpuRun {
            registered: registration.is_ok(),
            ..GpuRun::default()
        };
        let mut spans = Vec::new();
        let mut flight = VecDeque::with_capacity(2);
        // Declared after the batches: dropped first, so a failed run's copies end before the
        // slots are given back.
        let _drain = Drain([
            Arc::clone(&self.lanes[0].stream),
            Arc::clone(&self.lanes[1].stream),
        ]);
        self.reference
            .record(&self.lanes[0].stream)
            .map_err(cuda("cuEventRecord"))?;
        let start = Instant::now();
        let (mut next, mut more) = (0, true);
        loop {
            // A new frame goes on the free buffer; wait for one only when none is in flight.
            if more && flight.len() < 2 {
                let got = if flight.is_empty() {
                    match consumer.next(idle) {
                        Ok(b) => Some(b),
                        Err(gpufeed_ipc::Error::Timeout { .. }) => {
                            more = false;
                            None
                        }
                        Err(e) => return Err(e.into()),
                    }
                } else {
                    consumer.try_next()?
                };
                if let Some(batch) = got {
                    // SAFETY: the slot is this consumer's until the batch drops, which is
                    // after its frame's kernel completed (below) or the streams drained.
                    let (header, pixels) = frame_in(unsafe { batch.as_slice() }, self.format)?;
                    self.issue(next, pixels)?;
                    more = header.seq + 1 < frames;
                    flight.push_back((batch, header, next));
                    next ^= 1;
                    continue;
                }
            }
            let Some((batch, header, k)) = flight.pop_front() else {
                break;
            };
            // SAFETY: as above.
            let (_, pixels) = frame_in(unsafe { batch.as_slice() }, self.format)?;
            self.finish(k, &header, pixels, &mut out, &mut spans)?;
            drop(batch);
        }
        out.run.wall = start.elapsed();
        out.run.busy = Duration::from_secs_f64(union_ms(spans) / 1000.0);
        Ok(out)
    }

    /// The naive baseline on the GPU: frames read from `r` (a pipe) into a pageable buffer,
    /// each copied from there (the driver stages pageable memory: the call returns when the
    /// bytes are staged) and transformed, one at a time, until the stream ends.
    ///
    /// # Errors
    /// The stream's ([`read_frame`](super::read_frame)); as [`GpuFrames::run_ring`].
    pub fn run_pipe(&mut self, r: &mut impl Read) -> Result<GpuRun> {
        let mut pixels = vec![0u8; self.format.bytes()];
        let mut out = GpuRun::default();
        let mut spans = Vec::new();
        self.reference
            .record(&self.lanes[0].stream)
            .map_err(cuda("cuEventRecord"))?;
        let start = Instant::now();
        while let Some(h) = super::read_frame(r, self.format, &mut pixels)? {
            self.issue(0, &pixels)?;
            self.finish(0, &h, &pixels, &mut out, &mut spans)?;
        }
        out.run.wall = start.elapsed();
        out.run.busy = Duration::from_secs_f64(union_ms(spans) / 1000.0);
        Ok(out)
    }

    /// Queues frame `pixels`' copy and kernel on lane `k`, between its events.
    fn issue(&mut self, k: usize, pixels: &[u8]) -> Result<()> {
        let GpuFrames { kernel, lanes, .. } = self;
        let lane = &mut lanes[k];
        let s = &lane.stream;
        lane.start.record(s).map_err(cuda("cuEventRecord"))?;
        s.memcpy_htod(pixels, &mut lane.input)
            .map_err(cuda("cuMemcpyHtoDAsync (a frame)"))?;
        lane.copied.record(s).map_err(cuda("cuEventRecord"))?;
        kernel.launch(s, &lane.input, &mut lane.output, self.pixels)?;
        lane.done.record(s).map_err(cuda("cuEventRecord"))
    }

    /// Waits for lane `k`'s frame, records its latency and GPU times, checks it.
    fn finish(
        &self,
        k: usize,
        header: &FrameHeader,
        pixels: &[u8],
        out: &mut GpuRun,
        spans: &mut Vec<(f64, f64)>,
    ) -> Result<()> {
        let lane = &self.lanes[k];
        lane.done
            .synchronize()
            .map_err(cuda("cuEventSynchronize"))?;
        out.run
            .seen
            .push((header.seq, monotonic_ns().saturating_sub(header.capture_ns)));
        let at = |e: &CudaEvent| {
            self.reference
                .elapsed_ms(e)
                .map(f64::from)
                .map_err(cuda("cuEventElapsedTime"))
        };
        let (a, b, c) = (at(&lane.start)?, at(&lane.copied)?, at(&lane.done)?);
        spans.push((a, c));
        out.copy_ms.push(b - a);
        out.kernel_ms.push(c - b);
        check_some(header, pixels)?;
        if self.check_every > 0 && header.seq.is_multiple_of(self.check_every) {
            self.verify(lane, header.seq, pixels)?;
            out.checked += 1;
        }
        Ok(())
    }

    /// Lane `lane`'s result against the CPU's on the first, middle and last rows of each
    /// plane, bit for bit.
    fn verify(&self, lane: &Lane, seq: u64, pixels: &[u8]) -> Result<()> {
        let (w, h) = (self.format.width as usize, self.format.height as usize);
        let n = w * h;
        for row in [0, h / 2, h.saturating_sub(1)] {
            for plane in 0..3 {
                let at = plane * n + row * w;
                let got = lane
                    .stream
                    .clone_dtoh(&lane.output.slice(at..at + w))
                    .map_err(cuda("cuMemcpyDtoH (a checked row)"))?;
                lane.stream
                    .synchronize()
                    .map_err(cuda("cuStreamSynchronize"))?;
                for (x, g) in got.iter().enumerate() {
                    let want = f32::from(pixels[(row * w + x) * 3 + plane]) / 255.0;
                    if g.to_bits() != want.to_bits() {
                        return Err(Error::ResultMismatch {
                            what: format!(
                                "frame {seq}, plane {plane}, row {row}, pixel {x}: {g} on the GPU, {want} on the CPU"
                            ),
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::union_ms;

    #[test]
    fn overlapping_spans_count_once() {
        assert_eq!(union_ms(vec![]), 0.0);
        assert_eq!(union_ms(vec![(0.0, 1.0), (2.0, 3.0)]), 2.0);
        assert_eq!(union_ms(vec![(2.0, 4.0), (0.0, 3.0), (5.0, 6.0)]), 5.0);
        assert_eq!(union_ms(vec![(0.0, 10.0), (1.0, 2.0)]), 10.0);
    }
}
