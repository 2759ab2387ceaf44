//! Kernels gpufeed runs on the GPU, shipped as PTX text inside the library and compiled by the
//! driver's JIT when loaded: no CUDA toolkit and no NVRTC library is needed, only the driver
//! that runs the copies (`cuModuleLoadData`). The PTX targets `sm_52` and ISA 7.0, which every
//! driver since CUDA 11 compiles for its GPU.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::{Error, Gpu, Result};

/// Compiles `ptx` for `gpu` and finds its entry `name` (`what` names the load in errors).
fn load_function(gpu: &Gpu, ptx: &str, name: &str, what: &'static str) -> Result<CudaFunction> {
    gpu.context()
        .load_module(Ptx::from_src(ptx))
        .map_err(|e| Error::cuda(what, e))?
        .load_function(name)
        .map_err(|e| Error::cuda("cuModuleGetFunction", e))
}

/// `rgb8_to_planar_f32(src, dst, pixels)`: one thread per pixel reads its three bytes and
/// writes `byte / 255` (IEEE division, rounded to nearest: the same value as the CPU's
/// `f32::from(b) / 255.0`) into the red, green and blue planes of `dst`. The grid's `y` is the
/// image: image `y`'s pixels start at `src + 3 * pixels * y`, its planes at
/// `dst + 3 * pixels * y` (floats).
const PLANAR_PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry rgb8_to_planar_f32(
    .param .u64 src,
    .param .u64 dst,
    .param .u32 pixels
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<9>;
    .reg .b64 %rd<12>;
    .reg .f32 %f<7>;

    ld.param.u64 %rd1, [src];
    ld.param.u64 %rd2, [dst];
    ld.param.u32 %r1, [pixels];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.u32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    mov.u32 %r2, %ctaid.y;
    mul.wide.u32 %rd5, %r1, 3;
    cvt.u64.u32 %rd6, %r2;
    mul.lo.u64 %rd7, %rd5, %rd6;
    add.s64 %rd1, %rd1, %rd7;
    shl.b64 %rd7, %rd7, 2;
    add.s64 %rd2, %rd2, %rd7;
    cvta.to.global.u64 %rd3, %rd1;
    cvta.to.global.u64 %rd4, %rd2;
    mul.wide.u32 %rd5, %r5, 3;
    add.s64 %rd6, %rd3, %rd5;
    ld.global.u8 %r6, [%rd6];
    ld.global.u8 %r7, [%rd6+1];
    ld.global.u8 %r8, [%rd6+2];
    cvt.rn.f32.u32 %f1, %r6;
    cvt.rn.f32.u32 %f2, %r7;
    cvt.rn.f32.u32 %f3, %r8;
    div.rn.f32 %f4, %f1, 0f437F0000;
    div.rn.f32 %f5, %f2, 0f437F0000;
    div.rn.f32 %f6, %f3, 0f437F0000;
    mul.wide.u32 %rd7, %r5, 4;
    add.s64 %rd8, %rd4, %rd7;
    st.global.f32 [%rd8], %f4;
    mul.wide.u32 %rd9, %r1, 4;
    add.s64 %rd10, %rd8, %rd9;
    st.global.f32 [%rd10], %f5;
    add.s64 %rd11, %rd10, %rd9;
    st.global.f32 [%rd11], %f6;
DONE:
    ret;
}
"#;

/// Threads per block of [`PlanarKernel`].
const BLOCK: u32 = 256;

/// RGB8 pixels (interleaved) to planar `f32` in [0, 1] on the GPU — the real-time case study's
/// kernel (`gpufeed::frames`): `dst` gets the red plane, then the green, then the blue.
///
/// # Example
/// ```
/// use gpufeed_cuda::{Gpu, kernels::PlanarKernel};
/// let gpu = match Gpu::open(0) {
///     Ok(gpu) => gpu,
///     Err(e) if e.is_no_gpu() => return Ok(()), // a machine without a GPU
///     Err(e) => return Err(e.into()),
/// };
/// let kernel = PlanarKernel::load(&gpu)?;
/// let stream = gpu.default_stream();
/// let rgb = stream.clone_htod(&[0u8, 51, 255, 255, 0, 102])?;
/// let mut planar = stream.alloc_zeros::<f32>(6)?;
/// kernel.launch(&stream, &rgb, &mut planar, 2)?;
/// let out = stream.clone_dtoh(&planar)?;
/// assert_eq!(out, [0.0, 1.0, 0.2, 0.0, 1.0, 0.4]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct PlanarKernel {
    func: CudaFunction,
}

impl PlanarKernel {
    /// Compiles the kernel for `gpu` (the driver's JIT, a few milliseconds once per process).
    ///
    /// # Errors
    /// [`Error::Cuda`] naming `cuModuleLoadData` where the driver refuses the PTX (a driver
    /// older than CUDA 11).
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let func = load_function(
            gpu,
            PLANAR_PTX,
            "rgb8_to_planar_f32",
            "cuModuleLoadData (the planar kernel's PTX)",
        )?;
        Ok(PlanarKernel { func })
    }

    /// Queues the kernel on `stream`: `src` holds `pixels` RGB8 pixels, `dst` gets `3 *
    /// pixels` values.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when `src` or `dst` is too short; [`Error::Cuda`] for a refused
    /// launch.
    pub fn launch(
        &self,
        stream: &Arc<CudaStream>,
        src: &CudaSlice<u8>,
        dst: &mut CudaSlice<f32>,
        pixels: u32,
    ) -> Result<()> {
        self.launch_images(stream, src, dst, pixels, 1)
    }

    /// [`PlanarKernel::launch`] on `images` images of `pixels` pixels each, back to back in
    /// `src`; `dst` gets each image's three planes after the previous image's (CHW per image,
    /// as a batch of training images). At most 65,535 images per launch.
    ///
    /// # Errors
    /// As [`PlanarKernel::launch`]; [`Error::OutOfBounds`] for more images than a launch
    /// takes.
    pub fn launch_images(
        &self,
        stream: &Arc<CudaStream>,
        src: &CudaSlice<u8>,
        dst: &mut CudaSlice<f32>,
        pixels: u32,
        images: u32,
    ) -> Result<()> {
        if images > 65_535 {
            return Err(Error::OutOfBounds {
                len: u64::from(images),
                offset: 0,
                capacity: 65_535,
            });
        }
        let n = u64::from(pixels) * u64::from(images);
        let short = |len: usize, need: u64| Error::OutOfBounds {
            len: need,
            offset: 0,
            capacity: len as u64,
        };
        if (src.len() as u64) < 3 * n {
            return Err(short(src.len(), 3 * n));
        }
        if (dst.len() as u64) < 3 * n {
            return Err(short(dst.len(), 3 * n));
        }
        if n == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (pixels.div_ceil(BLOCK), images, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&self.func);
        launch.arg(src).arg(dst).arg(&pixels);
        // SAFETY: the arguments are what the PTX entry declares (two device pointers and a
        // u32), and both buffers were checked to hold `images` images of `pixels` pixels; the
        // kernel touches nothing else.
        unsafe { launch.launch(cfg) }
            .map(drop)
            .map_err(|e| Error::cuda("cuLaunchKernel (rgb8_to_planar_f32)", e))
    }
}

/// `gather_records(addrs, dst, rec, count)`: block `k` (of `count`) copies the `rec` bytes at
/// address `addrs[k]` to `dst + k * rec`, its threads taking 16 bytes each in turn where the
/// source, the destination and `rec` are all 16-byte aligned, single bytes otherwise. The
/// addresses (and `addrs` itself) may be host memory registered with CUDA: the GPU reads it
/// over the bus (unified addressing: the host's address is the device's).
const GATHER_PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry gather_records(
    .param .u64 addrs,
    .param .u64 dst,
    .param .u64 rec,
    .param .u32 count
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<20>;

    ld.param.u64 %rd1, [addrs];
    ld.param.u64 %rd2, [dst];
    ld.param.u64 %rd3, [rec];
    ld.param.u32 %r1, [count];
    mov.u32 %r2, %ctaid.x;
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd1, %rd1;
    mul.wide.u32 %rd4, %r2, 8;
    add.s64 %rd5, %rd1, %rd4;
    ld.global.u64 %rd6, [%rd5];
    cvta.to.global.u64 %rd6, %rd6;
    cvt.u64.u32 %rd7, %r2;
    mul.lo.u64 %rd8, %rd7, %rd3;
    add.s64 %rd9, %rd2, %rd8;
    cvta.to.global.u64 %rd9, %rd9;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ntid.x;
    cvt.u64.u32 %rd10, %r3;
    cvt.u64.u32 %rd11, %r4;
    or.b64 %rd12, %rd6, %rd9;
    or.b64 %rd12, %rd12, %rd3;
    and.b64 %rd12, %rd12, 15;
    setp.ne.u64 %p2, %rd12, 0;
    @%p2 bra BYTES;
    shl.b64 %rd10, %rd10, 4;
    shl.b64 %rd11, %rd11, 4;
VEC:
    setp.ge.u64 %p3, %rd10, %rd3;
    @%p3 bra DONE;
    add.s64 %rd13, %rd6, %rd10;
    add.s64 %rd14, %rd9, %rd10;
    ld.global.v4.u32 {%r5, %r6, %r7, %r8}, [%rd13];
    st.global.v4.u32 [%rd14], {%r5, %r6, %r7, %r8};
    add.s64 %rd10, %rd10, %rd11;
    bra VEC;
BYTES:
    setp.ge.u64 %p3, %rd10, %rd3;
    @%p3 bra DONE;
    add.s64 %rd13, %rd6, %rd10;
    add.s64 %rd14, %rd9, %rd10;
    ld.global.u8 %r5, [%rd13];
    st.global.u8 [%rd14], %r5;
    add.s64 %rd10, %rd10, %rd11;
    bra BYTES;
DONE:
    ret;
}
"#;

/// `gather_spans(spans, dst, chunk, count)`: span `k` of `count` (three native-endian `u64`s at
/// `spans + 24 k`: a source address, a length and an offset into `dst`) is copied by the blocks
/// `(k, y)`, block `y` taking its bytes `y * chunk ..` (up to `chunk`, a multiple of 16). A
/// 16-byte-aligned source is read 16 bytes per thread in turn (reading up to its length rounded
/// up to 16: the rest of a mapped file's last page), each vector stored whole where the
/// destination is 16-byte aligned and byte by byte otherwise (the spans land back to back, at
/// any offset); an unaligned source is read byte by byte.
const GATHER_SPANS_PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry gather_spans(
    .param .u64 spans,
    .param .u64 dst,
    .param .u64 chunk,
    .param .u32 count
)
{
    .reg .pred %p<10>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<24>;

    ld.param.u64 %rd1, [spans];
    ld.param.u64 %rd2, [dst];
    ld.param.u64 %rd3, [chunk];
    ld.param.u32 %r1, [count];
    mov.u32 %r2, %ctaid.x;
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd1, %rd1;
    mul.wide.u32 %rd4, %r2, 24;
    add.s64 %rd5, %rd1, %rd4;
    ld.global.u64 %rd6, [%rd5];
    ld.global.u64 %rd7, [%rd5+8];
    ld.global.u64 %rd8, [%rd5+16];
    mov.u32 %r3, %ctaid.y;
    cvt.u64.u32 %rd9, %r3;
    mul.lo.u64 %rd10, %rd9, %rd3;
    setp.ge.u64 %p2, %rd10, %rd7;
    @%p2 bra DONE;
    add.s64 %rd11, %rd10, %rd3;
    min.u64 %rd11, %rd11, %rd7;
    cvta.to.global.u64 %rd6, %rd6;
    add.s64 %rd12, %rd2, %rd8;
    cvta.to.global.u64 %rd12, %rd12;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %ntid.x;
    cvt.u64.u32 %rd13, %r4;
    cvt.u64.u32 %rd14, %r5;
    and.b64 %rd15, %rd6, 15;
    setp.ne.u64 %p8, %rd15, 0;
    @%p8 bra SLOW;
    and.b64 %rd15, %rd12, 15;
    setp.eq.u64 %p3, %rd15, 0;
    shl.b64 %rd13, %rd13, 4;
    shl.b64 %rd14, %rd14, 4;
    add.s64 %rd13, %rd13, %rd10;
LOOP:
    setp.ge.u64 %p4, %rd13, %rd11;
    @%p4 bra DONE;
    add.s64 %rd16, %rd6, %rd13;
    ld.global.v4.u32 {%r6, %r7, %r8, %r9}, [%rd16];
    add.s64 %rd17, %rd12, %rd13;
    add.s64 %rd18, %rd13, 16;
    setp.le.u64 %p5, %rd18, %rd7;
    and.pred %p6, %p5, %p3;
    @!%p6 bra BYTES;
    st.global.v4.u32 [%rd17], {%r6, %r7, %r8, %r9};
    bra NEXT;
BYTES:
    sub.s64 %rd19, %rd7, %rd13;
    setp.gt.u64 %p7, %rd19, 0;
    @%p7 st.global.u8 [%rd17+0], %r6;
    setp.gt.u64 %p7, %rd19, 1;
    shr.b32 %r10, %r6, 8;
    @%p7 st.global.u8 [%rd17+1], %r10;
    setp.gt.u64 %p7, %rd19, 2;
    shr.b32 %r10, %r6, 16;
    @%p7 st.global.u8 [%rd17+2], %r10;
    setp.gt.u64 %p7, %rd19, 3;
    shr.b32 %r10, %r6, 24;
    @%p7 st.global.u8 [%rd17+3], %r10;
    setp.gt.u64 %p7, %rd19, 4;
    @%p7 st.global.u8 [%rd17+4], %r7;
    setp.gt.u64 %p7, %rd19, 5;
    shr.b32 %r10, %r7, 8;
    @%p7 st.global.u8 [%rd17+5], %r10;
    setp.gt.u64 %p7, %rd19, 6;
    shr.b32 %r10, %r7, 16;
    @%p7 st.global.u8 [%rd17+6], %r10;
    setp.gt.u64 %p7, %rd19, 7;
    shr.b32 %r10, %r7, 24;
    @%p7 st.global.u8 [%rd17+7], %r10;
    setp.gt.u64 %p7, %rd19, 8;
    @%p7 st.global.u8 [%rd17+8], %r8;
    setp.gt.u64 %p7, %rd19, 9;
    shr.b32 %r10, %r8, 8;
    @%p7 st.global.u8 [%rd17+9], %r10;
    setp.gt.u64 %p7, %rd19, 10;
    shr.b32 %r10, %r8, 16;
    @%p7 st.global.u8 [%rd17+10], %r10;
    setp.gt.u64 %p7, %rd19, 11;
    shr.b32 %r10, %r8, 24;
    @%p7 st.global.u8 [%rd17+11], %r10;
    setp.gt.u64 %p7, %rd19, 12;
    @%p7 st.global.u8 [%rd17+12], %r9;
    setp.gt.u64 %p7, %rd19, 13;
    shr.b32 %r10, %r9, 8;
    @%p7 st.global.u8 [%rd17+13], %r10;
    setp.gt.u64 %p7, %rd19, 14;
    shr.b32 %r10, %r9, 16;
    @%p7 st.global.u8 [%rd17+14], %r10;
    setp.gt.u64 %p7, %rd19, 15;
    shr.b32 %r10, %r9, 24;
    @%p7 st.global.u8 [%rd17+15], %r10;
NEXT:
    add.s64 %rd13, %rd13, %rd14;
    bra LOOP;
SLOW:
    add.s64 %rd13, %rd13, %rd10;
SLOWLOOP:
    setp.ge.u64 %p9, %rd13, %rd11;
    @%p9 bra DONE;
    add.s64 %rd16, %rd6, %rd13;
    add.s64 %rd17, %rd12, %rd13;
    ld.global.u8 %r6, [%rd16];
    st.global.u8 [%rd17], %r6;
    add.s64 %rd13, %rd13, %rd14;
    bra SLOWLOOP;
DONE:
    ret;
}
"#;

/// One piece for [`GatherKernel::launch_spans`]: `len` bytes at `src` (an address the GPU
/// can read) land at byte `offset` of the destination. Laid out as the kernel reads it
/// (three native-endian `u64`s; [`Span::to_ne_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The source address.
    pub src: u64,
    /// Bytes.
    pub len: u64,
    /// Where they land in the destination.
    pub offset: u64,
}

impl Span {
    /// Bytes of one span in the kernel's table.
    pub const BYTES: usize = 24;

    /// The span as the kernel reads it.
    pub fn to_ne_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..8].copy_from_slice(&self.src.to_ne_bytes());
        out[8..16].copy_from_slice(&self.len.to_ne_bytes());
        out[16..].copy_from_slice(&self.offset.to_ne_bytes());
        out
    }
}

/// Bytes of a span one block of `gather_spans` copies (at least).
const SPAN_CHUNK: u64 = 64 << 10;
/// The most blocks a grid's `y` dimension takes.
const MAX_GRID_Y: u32 = 65_535;

/// Records gathered on the GPU: one launch copies a batch of records of one length from
/// anywhere the GPU can read (a record file's mapping registered with CUDA, read over the
/// bus) into device memory, back to back — instead of the CPU copying them into a staging
/// buffer for the copy engine.
#[derive(Debug)]
pub struct GatherKernel {
    func: CudaFunction,
    /// `gather_spans`: pieces of any lengths, at any offsets of the destination.
    spans: CudaFunction,
}

impl GatherKernel {
    /// Compiles the kernel for `gpu` (the driver's JIT, once per loader).
    ///
    /// # Errors
    /// [`Error::Cuda`] naming `cuModuleLoadData` where the driver refuses the PTX.
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let func = load_function(
            gpu,
            GATHER_PTX,
            "gather_records",
            "cuModuleLoadData (the gather kernel's PTX)",
        )?;
        let spans = load_function(
            gpu,
            GATHER_SPANS_PTX,
            "gather_spans",
            "cuModuleLoadData (the span gather kernel's PTX)",
        )?;
        Ok(GatherKernel { func, spans })
    }

    /// Queues the kernel on `stream`: record `k` of `count`, the `rec_bytes` bytes at
    /// `addrs[k]`, lands at `dst[k * rec_bytes..]`.
    ///
    /// # Safety
    /// `addrs` points to `count` addresses in memory the GPU can read (page-locked host
    /// memory registered with or allocated by CUDA, or device memory), each the start of
    /// `rec_bytes` bytes the GPU can read; none of it is written, unmapped or unregistered
    /// before the kernel has completed (an event recorded on `stream` after it).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when `dst` holds fewer than `count * rec_bytes` bytes;
    /// [`Error::Cuda`] for a refused launch.
    pub unsafe fn launch(
        &self,
        stream: &Arc<CudaStream>,
        addrs: *const u64,
        count: u32,
        rec_bytes: u64,
        dst: &mut CudaSlice<u8>,
    ) -> Result<()> {
        let need = u64::from(count).saturating_mul(rec_bytes);
        if (dst.len() as u64) < need || count > i32::MAX as u32 {
            return Err(Error::OutOfBounds {
                len: need,
                offset: 0,
                capacity: dst.len() as u64,
            });
        }
        if need == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (count, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let addrs = addrs as u64;
        let mut launch = stream.launch_builder(&self.func);
        launch.arg(&addrs).arg(dst).arg(&rec_bytes).arg(&count);
        // SAFETY: the arguments are what the PTX entry declares (a u64 address, a device
        // pointer, a u64 and a u32); `dst` was checked to hold `count` records, and what the
        // kernel reads the caller vouches for.
        unsafe { launch.launch(cfg) }
            .map(drop)
            .map_err(|e| Error::cuda("cuLaunchKernel (gather_records)", e))
    }

    /// Queues the span kernel on `stream`: span `k` of `spans` (source address, length,
    /// offset into `dst`) lands at `dst[offset..offset + length]`, whatever the lengths and
    /// offsets. Spans may not overlap in `dst` (their bytes would race).
    ///
    /// The spans are checked here (each inside `dst`) before anything is queued: `spans` is
    /// read on the host, and `table` is where the kernel reads the same spans from.
    ///
    /// # Safety
    /// `table` points to `spans.len()` spans (three native-endian `u64`s each, as in `spans`)
    /// the GPU can read (page-locked host memory or device memory), equal to `spans`; each
    /// source the GPU can read for its length, and where the source is 16-byte aligned, up to
    /// its length rounded up to 16 bytes (a file mapping's last page is); nothing of it
    /// written, unmapped or unregistered before the kernel has completed (an event recorded
    /// on `stream` after it).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for a span past the end of `dst`, or more spans than a launch
    /// takes; [`Error::Cuda`] for a refused launch.
    pub unsafe fn launch_spans(
        &self,
        stream: &Arc<CudaStream>,
        table: *const u64,
        spans: &[Span],
        dst: &mut CudaSlice<u8>,
    ) -> Result<()> {
        let mut longest = 0u64;
        for s in spans {
            match s.offset.checked_add(s.len) {
                Some(end) if end <= dst.len() as u64 => longest = longest.max(s.len),
                _ => {
                    return Err(Error::OutOfBounds {
                        len: s.len,
                        offset: s.offset,
                        capacity: dst.len() as u64,
                    });
                }
            }
        }
        let count = u32::try_from(spans.len())
            .ok()
            .filter(|&c| c <= i32::MAX as u32)
            .ok_or(Error::OutOfBounds {
                len: spans.len() as u64,
                offset: 0,
                capacity: i32::MAX as u64,
            })?;
        if longest == 0 {
            return Ok(());
        }
        // 64 KiB per block (one block per record in `gather_records` reached the link's rate
        // for 64 KiB records), more where a span would need more blocks than a grid's `y`
        // takes.
        let chunk = longest
            .div_ceil(u64::from(MAX_GRID_Y))
            .max(SPAN_CHUNK)
            .next_multiple_of(16);
        let blocks_y = u32::try_from(longest.div_ceil(chunk)).map_err(|_| Error::OutOfBounds {
            len: longest,
            offset: 0,
            capacity: chunk.saturating_mul(u64::from(MAX_GRID_Y)),
        })?;
        let cfg = LaunchConfig {
            grid_dim: (count, blocks_y, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let table = table as u64;
        let mut launch = stream.launch_builder(&self.spans);
        launch.arg(&table).arg(dst).arg(&chunk).arg(&count);
        // SAFETY: the arguments are what the PTX entry declares (a u64 address, a device
        // pointer, a u64 and a u32); every span was checked to lie inside `dst`, and what the
        // kernel reads the caller vouches for.
        unsafe { launch.launch(cfg) }
            .map(drop)
            .map_err(|e| Error::cuda("cuLaunchKernel (gather_spans)", e))
    }
}
