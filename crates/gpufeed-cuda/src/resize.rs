//! Crops of a batch of decoded images resized on the GPU (issue 40's augmentation): bilinear
//! with antialiasing, as torch's `interpolate(mode="bilinear", antialias=True,
//! align_corners=False)` computes it ([`resize_weights`]: the filter widened by the scale when
//! shrinking), separable (across into an `f32` buffer, then down), mirrored where asked, out as
//! `uint8` HWC or normalized `f32` CHW. PTX text compiled by the driver's JIT, as the other
//! kernels ([`crate::kernels`]); the weights are computed on the host, per image and output
//! position, so the kernels only gather.

use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::{Error, Gpu, Result};

/// Where each output position of a resize from `input` to `output` samples: its first input
/// index and its weights (summing to 1). torch's antialiased bilinear filter: scale `s =
/// input / output`, support `max(s, 1)`, centre `s * (i + 0.5)`, taps from `trunc(centre -
/// support + 0.5)` (at least 0) to `trunc(centre + support + 0.5)` (at most `input`), weight
/// `max(0, 1 - |(j - centre + 0.5) / max(s, 1)|)`, normalized.
pub fn resize_weights(input: usize, output: usize) -> Vec<(usize, Vec<f32>)> {
    if input == 0 || output == 0 {
        return Vec::new();
    }
    let filter = Filter::new(input, output);
    (0..output)
        .map(|i| {
            let (lo, hi, center) = filter.span(i);
            let mut w: Vec<f64> = (lo..hi).map(|j| filter.weight(j, center)).collect();
            let total: f64 = w.iter().sum();
            if total > 0.0 {
                w.iter_mut().for_each(|v| *v /= total);
            }
            (lo, w.into_iter().map(|v| v as f32).collect())
        })
        .collect()
}

/// torch's antialiased bilinear filter for one axis (see [`resize_weights`]).
struct Filter {
    input: usize,
    scale: f64,
    support: f64,
    invscale: f64,
}

impl Filter {
    fn new(input: usize, output: usize) -> Filter {
        let scale = input as f64 / output as f64;
        let support = scale.max(1.0);
        Filter {
            input,
            scale,
            support,
            invscale: 1.0 / support,
        }
    }

    /// Output `i`'s taps `lo..hi` and its centre.
    fn span(&self, i: usize) -> (usize, usize, f64) {
        let center = self.scale * (i as f64 + 0.5);
        // truncation toward zero, then clamped (torch's int64_t casts)
        let lo = ((center - self.support + 0.5) as i64).max(0) as usize;
        let hi = ((center + self.support + 0.5) as i64).clamp(0, self.input as i64) as usize;
        (lo, hi.max(lo), center)
    }

    /// Input `j`'s weight (before normalization) for an output centred at `center`.
    fn weight(&self, j: usize, center: f64) -> f64 {
        (1.0 - ((j as f64 - center + 0.5) * self.invscale).abs()).max(0.0)
    }
}

const PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

// One thread per (row entry, output column): the row's taps across, RGB, into tmp.
// rows: 16 bytes each (source row address, tmp offset in floats, image); images: 32 bytes each
// (u32: tmp offset, flip, h starts, h weights, h taps, v starts, v weights, v taps).
.visible .entry aa_rows(
    .param .u64 rows,
    .param .u32 n_rows,
    .param .u32 ow,
    .param .u64 images,
    .param .u64 starts,
    .param .u64 weights,
    .param .u64 tmp
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<24>;
    .reg .b64 %rd<16>;
    .reg .f32 %f<8>;

    ld.param.u64 %rd1, [rows];
    ld.param.u32 %r1, [n_rows];
    ld.param.u32 %r2, [ow];
    ld.param.u64 %rd2, [images];
    ld.param.u64 %rd3, [starts];
    ld.param.u64 %rd4, [weights];
    ld.param.u64 %rd5, [tmp];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    cvta.to.global.u64 %rd3, %rd3;
    cvta.to.global.u64 %rd4, %rd4;
    cvta.to.global.u64 %rd5, %rd5;
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.u32 %r6, %r3, %r4, %r5;
    mul.lo.u32 %r7, %r1, %r2;
    setp.ge.u32 %p1, %r6, %r7;
    @%p1 bra DONE;
    div.u32 %r8, %r6, %r2;
    rem.u32 %r9, %r6, %r2;
    mul.wide.u32 %rd6, %r8, 16;
    add.s64 %rd6, %rd1, %rd6;
    ld.global.u64 %rd7, [%rd6];
    cvta.to.global.u64 %rd7, %rd7;
    ld.global.u32 %r10, [%rd6+8];
    ld.global.u32 %r11, [%rd6+12];
    mul.wide.u32 %rd8, %r11, 32;
    add.s64 %rd8, %rd2, %rd8;
    ld.global.u32 %r12, [%rd8+8];
    ld.global.u32 %r13, [%rd8+12];
    ld.global.u32 %r14, [%rd8+16];
    add.u32 %r15, %r12, %r9;
    mul.wide.u32 %rd9, %r15, 4;
    add.s64 %rd9, %rd3, %rd9;
    ld.global.u32 %r16, [%rd9];
    mul.wide.u32 %rd10, %r16, 3;
    add.s64 %rd10, %rd7, %rd10;
    mad.lo.u32 %r17, %r9, %r14, %r13;
    mul.wide.u32 %rd11, %r17, 4;
    add.s64 %rd11, %rd4, %rd11;
    mov.f32 %f1, 0f00000000;
    mov.f32 %f2, 0f00000000;
    mov.f32 %f3, 0f00000000;
    mov.u32 %r18, 0;
ROWS_LOOP:
    setp.ge.u32 %p2, %r18, %r14;
    @%p2 bra ROWS_END;
    ld.global.f32 %f4, [%rd11];
    ld.global.u8 %r19, [%rd10];
    ld.global.u8 %r20, [%rd10+1];
    ld.global.u8 %r21, [%rd10+2];
    cvt.rn.f32.u32 %f5, %r19;
    cvt.rn.f32.u32 %f6, %r20;
    cvt.rn.f32.u32 %f7, %r21;
    fma.rn.f32 %f1, %f4, %f5, %f1;
    fma.rn.f32 %f2, %f4, %f6, %f2;
    fma.rn.f32 %f3, %f4, %f7, %f3;
    add.s64 %rd11, %rd11, 4;
    add.s64 %rd10, %rd10, 3;
    add.u32 %r18, %r18, 1;
    bra ROWS_LOOP;
ROWS_END:
    mad.lo.u32 %r22, %r9, 3, %r10;
    mul.wide.u32 %rd12, %r22, 4;
    add.s64 %rd12, %rd5, %rd12;
    st.global.f32 [%rd12], %f1;
    st.global.f32 [%rd12+4], %f2;
    st.global.f32 [%rd12+8], %f3;
DONE:
    ret;
}

// One thread per (image, output row, output column): the column's taps down tmp, RGB, then
// the mirror where the image's flip is set, then uint8 HWC (mode 0: clamped, rounded to
// nearest even) or f32 CHW (mode 1: v * scale[c] + bias[c]).
.visible .entry aa_cols(
    .param .u32 n_images,
    .param .u32 ow,
    .param .u32 oh,
    .param .u64 images,
    .param .u64 starts,
    .param .u64 weights,
    .param .u64 tmp,
    .param .u64 out,
    .param .u32 mode,
    .param .f32 s0,
    .param .f32 s1,
    .param .f32 s2,
    .param .f32 b0,
    .param .f32 b1,
    .param .f32 b2
)
{
    .reg .pred %p<5>;
    .reg .b32 %r<32>;
    .reg .b64 %rd<20>;
    .reg .f32 %f<20>;

    ld.param.u32 %r1, [n_images];
    ld.param.u32 %r2, [ow];
    ld.param.u32 %r3, [oh];
    ld.param.u64 %rd1, [images];
    ld.param.u64 %rd2, [starts];
    ld.param.u64 %rd3, [weights];
    ld.param.u64 %rd4, [tmp];
    ld.param.u64 %rd5, [out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    cvta.to.global.u64 %rd3, %rd3;
    cvta.to.global.u64 %rd4, %rd4;
    cvta.to.global.u64 %rd5, %rd5;
    mov.u32 %r4, %ctaid.x;
    mov.u32 %r5, %ntid.x;
    mov.u32 %r6, %tid.x;
    mad.lo.u32 %r7, %r4, %r5, %r6;
    mul.lo.u32 %r8, %r2, %r3;
    mul.lo.u32 %r9, %r8, %r1;
    setp.ge.u32 %p1, %r7, %r9;
    @%p1 bra DONE;
    div.u32 %r10, %r7, %r8;
    rem.u32 %r11, %r7, %r8;
    div.u32 %r12, %r11, %r2;
    rem.u32 %r13, %r11, %r2;
    mul.wide.u32 %rd6, %r10, 32;
    add.s64 %rd6, %rd1, %rd6;
    ld.global.u32 %r14, [%rd6];
    ld.global.u32 %r15, [%rd6+4];
    ld.global.u32 %r16, [%rd6+20];
    ld.global.u32 %r17, [%rd6+24];
    ld.global.u32 %r18, [%rd6+28];
    add.u32 %r19, %r16, %r12;
    mul.wide.u32 %rd7, %r19, 4;
    add.s64 %rd7, %rd2, %rd7;
    ld.global.u32 %r20, [%rd7];
    mul.lo.u32 %r21, %r2, 3;
    mad.lo.u32 %r22, %r20, %r21, %r14;
    mad.lo.u32 %r22, %r13, 3, %r22;
    mul.wide.u32 %rd8, %r22, 4;
    add.s64 %rd8, %rd4, %rd8;
    mul.wide.u32 %rd9, %r21, 4;
    mad.lo.u32 %r23, %r12, %r18, %r17;
    mul.wide.u32 %rd10, %r23, 4;
    add.s64 %rd10, %rd3, %rd10;
    mov.f32 %f1, 0f00000000;
    mov.f32 %f2, 0f00000000;
    mov.f32 %f3, 0f00000000;
    mov.u32 %r24, 0;
COLS_LOOP:
    setp.ge.u32 %p2, %r24, %r18;
    @%p2 bra COLS_END;
    ld.global.f32 %f4, [%rd10];
    ld.global.f32 %f5, [%rd8];
    ld.global.f32 %f6, [%rd8+4];
    ld.global.f32 %f7, [%rd8+8];
    fma.rn.f32 %f1, %f4, %f5, %f1;
    fma.rn.f32 %f2, %f4, %f6, %f2;
    fma.rn.f32 %f3, %f4, %f7, %f3;
    add.s64 %rd10, %rd10, 4;
    add.s64 %rd8, %rd8, %rd9;
    add.u32 %r24, %r24, 1;
    bra COLS_LOOP;
COLS_END:
    sub.u32 %r25, %r2, 1;
    sub.u32 %r25, %r25, %r13;
    setp.ne.u32 %p3, %r15, 0;
    selp.u32 %r26, %r25, %r13, %p3;
    ld.param.u32 %r27, [mode];
    setp.ne.u32 %p4, %r27, 0;
    @%p4 bra FLOATS;
    mad.lo.u32 %r28, %r10, %r3, %r12;
    mad.lo.u32 %r28, %r28, %r2, %r26;
    mul.wide.u32 %rd11, %r28, 3;
    add.s64 %rd11, %rd5, %rd11;
    max.f32 %f1, %f1, 0f00000000;
    min.f32 %f1, %f1, 0f437F0000;
    max.f32 %f2, %f2, 0f00000000;
    min.f32 %f2, %f2, 0f437F0000;
    max.f32 %f3, %f3, 0f00000000;
    min.f32 %f3, %f3, 0f437F0000;
    cvt.rni.u32.f32 %r29, %f1;
    cvt.rni.u32.f32 %r30, %f2;
    cvt.rni.u32.f32 %r31, %f3;
    st.global.u8 [%rd11], %r29;
    st.global.u8 [%rd11+1], %r30;
    st.global.u8 [%rd11+2], %r31;
    bra DONE;
FLOATS:
    ld.param.f32 %f8, [s0];
    ld.param.f32 %f9, [s1];
    ld.param.f32 %f10, [s2];
    ld.param.f32 %f11, [b0];
    ld.param.f32 %f12, [b1];
    ld.param.f32 %f13, [b2];
    fma.rn.f32 %f14, %f1, %f8, %f11;
    fma.rn.f32 %f15, %f2, %f9, %f12;
    fma.rn.f32 %f16, %f3, %f10, %f13;
    mul.lo.u32 %r28, %r10, 3;
    mad.lo.u32 %r28, %r28, %r3, %r12;
    mad.lo.u32 %r28, %r28, %r2, %r26;
    mul.wide.u32 %rd12, %r28, 4;
    add.s64 %rd12, %rd5, %rd12;
    mul.wide.u32 %rd13, %r8, 4;
    st.global.f32 [%rd12], %f14;
    add.s64 %rd12, %rd12, %rd13;
    st.global.f32 [%rd12], %f15;
    add.s64 %rd12, %rd12, %rd13;
    st.global.f32 [%rd12], %f16;
DONE:
    ret;
}
"#;

/// Threads per block.
const BLOCK: u32 = 256;

/// One image of a batch to crop and resize: its decoded RGB pixels in device memory (`src`,
/// the first row's address; rows `pitch` bytes apart; `width` x `height`), the crop
/// (`x`, `y`, `width`, `height`: inside the image), and whether to mirror it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResizeJob {
    /// Device address of the image's first pixel.
    pub src: u64,
    /// Bytes from one row to the next (at least `3 * width`).
    pub pitch: usize,
    /// The image's width.
    pub width: u32,
    /// The image's height.
    pub height: u32,
    /// The crop: left, top, width, height.
    pub crop: (u32, u32, u32, u32),
    /// Mirror the output left to right.
    pub flip: bool,
}

/// What a batch's resize writes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ResizeOutput {
    /// `uint8` HWC images back to back at this device address (`3 * out_w * out_h` bytes
    /// each): the values rounded to nearest (halves to even), clamped to 0..=255.
    U8Hwc(u64),
    /// `f32` CHW images back to back at this device address (`3 * out_w * out_h` floats
    /// each), `(v / 255 - mean[c]) / std[c]` (computed as one multiply-add).
    F32Chw {
        /// The destination's device address.
        dst: u64,
        /// Per channel mean (of values in 0..=1).
        mean: [f32; 3],
        /// Per channel standard deviation (not 0).
        std: [f32; 3],
    },
}

/// The layout [`ResizeKernel::launch`] writes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Layout {
    /// `uint8`, `[images, height, width, 3]` ([`ResizeOutput::U8Hwc`]).
    U8Hwc,
    /// `f32`, `[images, 3, height, width]`, `(v / 255 - mean[c]) / std[c]`
    /// ([`ResizeOutput::F32Chw`]).
    F32Chw {
        /// Per channel mean (of values in 0..=1).
        mean: [f32; 3],
        /// Per channel standard deviation (not 0).
        std: [f32; 3],
    },
}

impl Layout {
    /// Bytes of one `width` x `height` image in this layout.
    pub fn image_bytes(&self, width: u32, height: u32) -> usize {
        let values = 3 * width as usize * height as usize;
        match self {
            Layout::U8Hwc => values,
            Layout::F32Chw { .. } => 4 * values,
        }
    }
}

/// The crop-and-resize kernels, loaded on one GPU (see the module).
#[derive(Debug)]
pub struct ResizeKernel {
    rows: CudaFunction,
    cols: CudaFunction,
}

impl ResizeKernel {
    /// Compiles the kernels for `gpu` (the driver's JIT, once per process).
    ///
    /// # Errors
    /// [`Error::Cuda`] naming `cuModuleLoadData` where the driver refuses the PTX.
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let module = gpu
            .context()
            .load_module(Ptx::from_src(PTX))
            .map_err(|e| Error::cuda("cuModuleLoadData (the resize kernels' PTX)", e))?;
        let get = |name| {
            module
                .load_function(name)
                .map_err(|e| Error::cuda("cuModuleGetFunction", e))
        };
        Ok(ResizeKernel {
            rows: get("aa_rows")?,
            cols: get("aa_cols")?,
        })
    }

    /// [`ResizeKernel::launch_raw`] within buffers: each job's `src` is a byte offset into
    /// `src`, the images go to `out` in `layout`, back to back. Checked: every job's rows
    /// inside `src`, `out` large enough.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for a job or an output that does not fit; as
    /// [`ResizeKernel::launch_raw`].
    #[allow(
        clippy::too_many_arguments,
        reason = "the resize's buffers and settings"
    )]
    pub fn launch(
        &self,
        stream: &Arc<CudaStream>,
        src: &CudaSlice<u8>,
        jobs: &[ResizeJob],
        out_width: u32,
        out_height: u32,
        out: &mut CudaSlice<u8>,
        layout: Layout,
    ) -> Result<()> {
        for job in jobs {
            let rows = (job.pitch as u64)
                .checked_mul(u64::from(job.height.saturating_sub(1)))
                .and_then(|r| r.checked_add(3 * u64::from(job.width)))
                .unwrap_or(u64::MAX);
            if job.src.saturating_add(rows) > src.len() as u64 {
                return Err(Error::OutOfBounds {
                    len: rows,
                    offset: job.src,
                    capacity: src.len() as u64,
                });
            }
        }
        let need = (layout.image_bytes(out_width, out_height) * jobs.len()) as u64;
        if need > out.len() as u64 {
            return Err(Error::OutOfBounds {
                len: need,
                offset: 0,
                capacity: out.len() as u64,
            });
        }
        let (base, _read) = src.device_ptr(stream);
        let (dst, _write) = out.device_ptr_mut(stream);
        let raw: Vec<ResizeJob> = jobs
            .iter()
            .map(|j| ResizeJob {
                src: base + j.src,
                ..*j
            })
            .collect();
        let output = match layout {
            Layout::U8Hwc => ResizeOutput::U8Hwc(dst),
            Layout::F32Chw { mean, std } => ResizeOutput::F32Chw { dst, mean, std },
        };
        // SAFETY: every job's rows lie in `src` and the outputs in `out` (checked above); both
        // are recorded by cudarc as used by `stream`'s work.
        unsafe { self.launch_raw(stream, &raw, out_width, out_height, output) }
    }

    /// Queues the crops of `jobs` resized to `out_width` x `out_height` into `out` on
    /// `stream` (two kernels; their tables and the intermediate rows are allocated here and
    /// freed in `stream`'s order).
    ///
    /// # Safety
    /// Every job's pixels must be device memory of `stream`'s context, readable until the
    /// work queued now has run; `out` must hold `jobs.len()` images of the output's size,
    /// written by nothing else meanwhile.
    ///
    /// # Errors
    /// [`Error::JpegSlot`] for a job whose crop leaves its image, a pitch shorter than a
    /// row, an empty output or a zero `std`; CUDA errors of the uploads and launches.
    pub unsafe fn launch_raw(
        &self,
        stream: &Arc<CudaStream>,
        jobs: &[ResizeJob],
        out_width: u32,
        out_height: u32,
        out: ResizeOutput,
    ) -> Result<()> {
        let refuse = |index: usize, reason: String| Err(Error::JpegSlot { index, reason });
        if jobs.is_empty() {
            return Ok(());
        }
        if out_width == 0 || out_height == 0 {
            return refuse(0, format!("an output of {out_width}x{out_height}"));
        }
        let (ow, oh) = (out_width as usize, out_height as usize);
        let mut rows: Vec<u8> = Vec::new(); // 16 bytes a row entry
        let mut images: Vec<u32> = Vec::with_capacity(jobs.len() * 8);
        let mut starts: Vec<u32> = Vec::new();
        let mut weights: Vec<f32> = Vec::new();
        let mut tmp_floats = 0usize;
        for (i, job) in jobs.iter().enumerate() {
            let (x, y, cw, ch) = job.crop;
            let inside = cw > 0
                && ch > 0
                && u64::from(x) + u64::from(cw) <= u64::from(job.width)
                && u64::from(y) + u64::from(ch) <= u64::from(job.height);
            if !inside || job.pitch < 3 * job.width as usize {
                return refuse(
                    i,
                    format!(
                        "crop {:?} of a {}x{} image (pitch {}): the crop must be non-empty and \
                         inside the image, the pitch at least a row",
                        job.crop, job.width, job.height, job.pitch
                    ),
                );
            }
            let image_tmp = u32::try_from(tmp_floats).map_err(|_| Error::JpegSlot {
                index: i,
                reason: "the batch's intermediate rows exceed 2^32 floats: resize fewer at once"
                    .into(),
            })?;
            for r in 0..ch as usize {
                let src = job.src + ((y as usize + r) * job.pitch + x as usize * 3) as u64;
                rows.extend_from_slice(&src.to_le_bytes());
                rows.extend_from_slice(&((tmp_floats + r * ow * 3) as u32).to_le_bytes());
                rows.extend_from_slice(&(i as u32).to_le_bytes());
            }
            tmp_floats += ch as usize * ow * 3;
            let (h_start, h_weights, h_taps) = pad(cw as usize, ow, &mut starts, &mut weights);
            let (v_start, v_weights, v_taps) = pad(ch as usize, oh, &mut starts, &mut weights);
            images.extend_from_slice(&[
                image_tmp,
                u32::from(job.flip),
                h_start,
                h_weights,
                h_taps,
                v_start,
                v_weights,
                v_taps,
            ]);
        }
        let (mode, scale, bias, dst) = match out {
            ResizeOutput::U8Hwc(dst) => (0u32, [0f32; 3], [0f32; 3], dst),
            ResizeOutput::F32Chw { dst, mean, std } => {
                if std.contains(&0.0) {
                    return refuse(0, format!("std {std:?} has a 0"));
                }
                let scale = std.map(|s| 1.0 / (255.0 * s));
                let bias = [0, 1, 2].map(|c| -mean[c] / std[c]);
                (1u32, scale, bias, dst)
            }
        };
        // Checked before anything is uploaded or allocated.
        let across = (rows.len() / 16) as u64 * u64::from(out_width);
        let down = jobs.len() as u64 * ow as u64 * oh as u64;
        // The kernels index in u32: every row's floats, every output value (three planes of
        // them for CHW), the tables.
        let values = if matches!(out, ResizeOutput::F32Chw { .. }) {
            3 * down
        } else {
            down
        };
        let limit = u64::from(u32::MAX);
        if across > limit
            || values > limit
            || tmp_floats as u64 > limit
            || starts.len() as u64 > limit
            || weights.len() as u64 > limit
        {
            return refuse(
                0,
                "more output values than one launch indexes: resize fewer".into(),
            );
        }
        let n_rows = (rows.len() / 16) as u32; // at most `across`: checked above
        let ow32 = out_width;
        let cuda = |op| move |e| Error::cuda(op, e);
        let rows_dev = stream
            .clone_htod(&rows)
            .map_err(cuda("cuMemcpyHtoDAsync"))?;
        let images_dev = stream
            .clone_htod(&images)
            .map_err(cuda("cuMemcpyHtoDAsync"))?;
        let starts_dev = stream
            .clone_htod(&starts)
            .map_err(cuda("cuMemcpyHtoDAsync"))?;
        let weights_dev = stream
            .clone_htod(&weights)
            .map_err(cuda("cuMemcpyHtoDAsync"))?;
        // SAFETY: not read before written: `aa_rows` writes every value of every crop row, and
        // `aa_cols` reads only those rows.
        let mut tmp =
            unsafe { stream.alloc::<f32>(tmp_floats.max(1)) }.map_err(cuda("cuMemAllocAsync"))?;
        let (rows_p, _g1) = rows_dev.device_ptr(stream);
        let (images_p, _g2) = images_dev.device_ptr(stream);
        let (starts_p, _g3) = starts_dev.device_ptr(stream);
        let (weights_p, _g4) = weights_dev.device_ptr(stream);
        let (tmp_p, _g5) = tmp.device_ptr_mut(stream);
        let grid = |n: u64| LaunchConfig {
            grid_dim: (n.div_ceil(u64::from(BLOCK)) as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = stream.launch_builder(&self.rows);
        a.arg(&rows_p)
            .arg(&n_rows)
            .arg(&ow32)
            .arg(&images_p)
            .arg(&starts_p)
            .arg(&weights_p)
            .arg(&tmp_p);
        // SAFETY: the arguments are the entry's (four addresses of tables made above, sized
        // for `n_rows` rows of `ow` outputs with each image's taps inside its crop, and
        // `tmp` of every row's `3 * ow` floats); the sources are the caller's promise.
        unsafe { a.launch(grid(across)) }.map_err(cuda("cuLaunchKernel (aa_rows)"))?;
        let n_images = jobs.len() as u32;
        let mut b = stream.launch_builder(&self.cols);
        b.arg(&n_images)
            .arg(&ow32)
            .arg(&out_height)
            .arg(&images_p)
            .arg(&starts_p)
            .arg(&weights_p)
            .arg(&tmp_p)
            .arg(&dst)
            .arg(&mode)
            .arg(&scale[0])
            .arg(&scale[1])
            .arg(&scale[2])
            .arg(&bias[0])
            .arg(&bias[1])
            .arg(&bias[2]);
        // SAFETY: as above; `dst` holds `n_images` outputs (the caller's promise).
        unsafe { b.launch(grid(down)) }.map_err(cuda("cuLaunchKernel (aa_cols)"))?;
        Ok(())
    }
}

/// Appends one resize pass of an `input`-long axis to `output` positions to `starts` and
/// `weights` (the same values as [`resize_weights`]), each output position padded to the
/// pass's most taps with zero weights and its start moved so that every tap lies inside the
/// axis: (the start index, the weight index, the taps). No allocation per position (this runs
/// for every image of every batch).
fn pad(
    input: usize,
    output: usize,
    starts: &mut Vec<u32>,
    weights: &mut Vec<f32>,
) -> (u32, u32, u32) {
    let at = (starts.len() as u32, weights.len() as u32);
    if input == 0 || output == 0 {
        return (at.0, at.1, 0);
    }
    let filter = Filter::new(input, output);
    let k = (0..output)
        .map(|i| {
            let (lo, hi, _) = filter.span(i);
            hi - lo
        })
        .max()
        .unwrap_or(0)
        .min(input);
    let mut row = vec![0f64; k];
    for i in 0..output {
        let (lo, hi, center) = filter.span(i);
        let start = lo.min(input - k);
        row.iter_mut().for_each(|v| *v = 0.0);
        for j in lo..hi {
            row[j - start] = filter.weight(j, center);
        }
        let total: f64 = row.iter().sum();
        starts.push(start as u32);
        weights.extend(
            row.iter()
                .map(|&v| if total > 0.0 { (v / total) as f32 } else { 0.0 }),
        );
    }
    (at.0, at.1, k as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_taps_stay_inside_the_axis_and_keep_their_weights() {
        for (input, output) in [(500, 224), (3, 224), (224, 224), (1, 7), (37, 5)] {
            let taps = resize_weights(input, output);
            let (mut starts, mut weights) = (Vec::new(), Vec::new());
            let (_, _, k) = pad(input, output, &mut starts, &mut weights);
            let k = k as usize;
            for (o, (lo, w)) in taps.iter().enumerate() {
                let start = starts[o] as usize;
                assert!(start + k <= input, "{input}->{output} at {o}");
                // the same weight on the same input index
                for (j, &v) in w.iter().enumerate() {
                    assert_eq!(
                        weights[o * k + (lo + j - start)],
                        v,
                        "{input}->{output} at {o}"
                    );
                }
                let sum: f32 = weights[o * k..(o + 1) * k].iter().sum();
                assert!((sum - 1.0).abs() < 1e-5, "{input}->{output} at {o}: {sum}");
            }
        }
    }
}
