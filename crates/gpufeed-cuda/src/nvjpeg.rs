//! nvJPEG, loaded at run time: the library NVIDIA ships for decoding JPEGs on the GPU (with
//! the hardware decoder engines of A100/H100-class GPUs where present). This is the first part
//! of gpufeed's image decoding (issue 40): the library found, checked and described
//! ([`nvjpeg_version`], `gpufeed doctor`), a decoder handle made on a GPU ([`Nvjpeg::open`])
//! with the hardware backend where the GPU has one, what a JPEG is before it is decoded
//! ([`Nvjpeg::image_info`]), and batches decoded into device memory as interleaved RGB
//! ([`Nvjpeg::decode_batch`]): the images the hardware engines take in one
//! `nvjpegDecodeBatched` call, the others (4:1:1, ...) one by one through `nvjpegDecode` on
//! the GPU's cores, each image's outcome its own; progressive ones are refused (for the
//! caller's CPU decoder: nvJPEG decoded one wrongly without an error).
//!
//! The library is opened on first use: `GPUFEED_NVJPEG_LIBRARY` if set, else `libnvjpeg.so.13`,
//! `.12`, `.11`, then `libnvjpeg.so` (the CUDA toolkit's and the `nvidia-nvjpeg` wheel's names;
//! the wheel installs it under `site-packages/nvidia/cu13/lib/`, which is not on the loader's
//! path: point the variable there). Its absence is [`Error::NvjpegMissing`] naming what was
//! tried, never a panic; a library without nvJPEG's entry points is refused the same way.
//! (cudarc has no nvJPEG binding.)

use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaStream, CudaViewMut, DevicePtrMut, sys::CUstream};

use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// `nvjpegStatus_t` values, by name (nvjpeg.h, unchanged from CUDA 11 to 13).
const STATUS: [&str; 11] = [
    "NVJPEG_STATUS_SUCCESS",
    "NVJPEG_STATUS_NOT_INITIALIZED",
    "NVJPEG_STATUS_INVALID_PARAMETER",
    "NVJPEG_STATUS_BAD_JPEG",
    "NVJPEG_STATUS_JPEG_NOT_SUPPORTED",
    "NVJPEG_STATUS_ALLOCATOR_FAILURE",
    "NVJPEG_STATUS_EXECUTION_FAILED",
    "NVJPEG_STATUS_ARCH_MISMATCH",
    "NVJPEG_STATUS_INTERNAL_ERROR",
    "NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED",
    "NVJPEG_STATUS_INCOMPLETE_BITSTREAM",
];

/// The name of `nvjpegStatus_t` `status`.
pub fn status_name(status: c_int) -> &'static str {
    usize::try_from(status)
        .ok()
        .and_then(|i| STATUS.get(i))
        .copied()
        .unwrap_or("an unknown nvjpegStatus_t")
}

/// `nvjpegBackend_t` values used here.
const BACKEND_DEFAULT: c_int = 0;
const BACKEND_GPU_HYBRID: c_int = 2;
const BACKEND_HARDWARE: c_int = 3;

/// `nvjpegOutputFormat_t` NVJPEG_OUTPUT_RGBI: interleaved RGB in `channel[0]`.
const OUTPUT_RGBI: c_int = 5;

type Handle = *mut c_void;
type State = *mut c_void;
type JpegStream = *mut c_void;

/// `nvjpegImage_t`: per channel, a device address and its pitch (only `channel[0]` is used
/// for interleaved output).
#[repr(C)]
#[derive(Clone, Copy)]
struct NvImage {
    channel: [*mut u8; 4],
    pitch: [usize; 4],
}

/// nvJPEG's entry points used here, resolved once.
struct Library {
    _lib: libloading::Library,
    /// Which name or path loaded.
    name: String,
    /// (major, minor, patch).
    version: (c_int, c_int, c_int),
    create_ex: unsafe extern "C" fn(c_int, *mut c_void, *mut c_void, c_uint, *mut Handle) -> c_int,
    destroy: unsafe extern "C" fn(Handle) -> c_int,
    state_create: unsafe extern "C" fn(Handle, *mut State) -> c_int,
    state_destroy: unsafe extern "C" fn(State) -> c_int,
    hardware_info: unsafe extern "C" fn(Handle, *mut c_uint, *mut c_uint) -> c_int,
    image_info: unsafe extern "C" fn(
        Handle,
        *const u8,
        usize,
        *mut c_int,
        *mut c_int,
        *mut c_int,
        *mut c_int,
    ) -> c_int,
    stream_create: unsafe extern "C" fn(Handle, *mut JpegStream) -> c_int,
    stream_destroy: unsafe extern "C" fn(JpegStream) -> c_int,
    parse_header: unsafe extern "C" fn(Handle, *const u8, usize, JpegStream) -> c_int,
    batched_supported: unsafe extern "C" fn(Handle, JpegStream, *mut c_int) -> c_int,
    batched_initialize: unsafe extern "C" fn(Handle, State, c_int, c_int, c_int) -> c_int,
    batched: unsafe extern "C" fn(
        Handle,
        State,
        *const *const u8,
        *const usize,
        *mut NvImage,
        CUstream,
    ) -> c_int,
    decode: unsafe extern "C" fn(
        Handle,
        State,
        *const u8,
        usize,
        c_int,
        *mut NvImage,
        CUstream,
    ) -> c_int,
}

// SAFETY: the library's handle is thread-safe (nvJPEG's documentation: one handle may be
// shared by threads); the function pointers are plain code addresses.
unsafe impl Send for Library {}
// SAFETY: as above.
unsafe impl Sync for Library {}

/// The library names tried, in order.
fn candidates() -> Vec<String> {
    crate::dynlib::candidates(std::env::var_os("GPUFEED_NVJPEG_LIBRARY"), &NAMES)
}

/// The names nvJPEG is looked for by, newest first.
const NAMES: [&str; 4] = [
    "libnvjpeg.so.13",
    "libnvjpeg.so.12",
    "libnvjpeg.so.11",
    "libnvjpeg.so",
];

impl Library {
    /// Opens the first of `names` that loads and resolves every entry point; else what was
    /// tried and why each failed.
    fn load(names: &[String]) -> std::result::Result<Self, String> {
        // SAFETY: the names are nvJPEG's (or the path the user gave for it); loading it runs
        // its initialisers, which only set up its own state.
        unsafe { crate::dynlib::open_first(names, Self::resolve) }
    }

    fn resolve(lib: libloading::Library, name: &str) -> std::result::Result<Self, String> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is nvJPEG's function of that name, whose C signature the
                // field's type spells out (nvjpeg.h, the same in CUDA 11, 12 and 13).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("not nvJPEG ({e})"))?
            };
        }
        let get_property: unsafe extern "C" fn(c_int, *mut c_int) -> c_int =
            sym!("nvjpegGetProperty");
        let mut v = [0 as c_int; 3];
        for (i, out) in v.iter_mut().enumerate() {
            // SAFETY: `out` is a writable int; 0, 1, 2 are MAJOR_VERSION, MINOR_VERSION,
            // PATCH_LEVEL (libraryPropertyType).
            let r = unsafe { get_property(i as c_int, out) };
            if r != 0 {
                return Err(format!("nvjpegGetProperty failed: {}", status_name(r)));
            }
        }
        if v[0] < 11 {
            return Err(format!(
                "nvJPEG {}.{}.{} is older than 11 (CUDA 11), which gpufeed drives",
                v[0], v[1], v[2]
            ));
        }
        Ok(Library {
            name: name.to_owned(),
            version: (v[0], v[1], v[2]),
            create_ex: sym!("nvjpegCreateEx"),
            destroy: sym!("nvjpegDestroy"),
            state_create: sym!("nvjpegJpegStateCreate"),
            state_destroy: sym!("nvjpegJpegStateDestroy"),
            hardware_info: sym!("nvjpegGetHardwareDecoderInfo"),
            image_info: sym!("nvjpegGetImageInfo"),
            stream_create: sym!("nvjpegJpegStreamCreate"),
            stream_destroy: sym!("nvjpegJpegStreamDestroy"),
            parse_header: sym!("nvjpegJpegStreamParseHeader"),
            batched_supported: sym!("nvjpegDecodeBatchedSupported"),
            batched_initialize: sym!("nvjpegDecodeBatchedInitialize"),
            batched: sym!("nvjpegDecodeBatched"),
            decode: sym!("nvjpegDecode"),
            _lib: lib,
        })
    }
}

fn library() -> Result<&'static Library> {
    static LIBRARY: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
    match LIBRARY.get_or_init(|| Library::load(&candidates())) {
        Ok(l) => Ok(l),
        Err(tried) => Err(Error::NvjpegMissing {
            tried: tried.clone(),
        }),
    }
}

/// An error of nvJPEG call `op` that returned `status`.
fn failed(op: &'static str, status: c_int) -> Error {
    Error::Nvjpeg {
        op,
        status,
        name: status_name(status),
    }
}

/// nvJPEG's version and the library that loaded, as `"13.3.2 (libnvjpeg.so.13)"`. Needs no
/// GPU.
///
/// # Errors
/// [`Error::NvjpegMissing`] saying what was tried and why each failed.
pub fn nvjpeg_version() -> Result<String> {
    let l = library()?;
    let (a, b, c) = l.version;
    Ok(format!("{a}.{b}.{c} ({})", l.name))
}

/// Which of nvJPEG's decoders a handle drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// The GPU's hardware JPEG decoder engines (A100, H100, H200...): baseline JPEGs only.
    Hardware,
    /// The CUDA decoder (every JPEG nvJPEG decodes, on the GPU's cores and the host's).
    Cuda,
}

/// What a JPEG is, from its headers (`nvjpegGetImageInfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageInfo {
    /// Colour components (1 gray, 3 YCbCr, 4 CMYK/YCCK).
    pub components: u32,
    /// `nvjpegChromaSubsampling_t`: 0 4:4:4, 1 4:2:2, 2 4:2:0, 3 4:4:0, 4 4:1:1, 5 4:1:0, 6
    /// gray, 7 4:1:0 vertical; -1 unknown.
    pub subsampling: i32,
    /// The first component's width and height (the image's).
    pub width: u32,
    /// See `width`.
    pub height: u32,
}

/// An nvJPEG handle and decoding state made on one GPU (used from one thread at a time: the
/// state is per thread in nvJPEG's rules).
#[derive(Debug)]
pub struct Nvjpeg {
    handle: Handle,
    /// The batched decoder's state.
    state: State,
    /// The one-image decoder's state (`nvjpegDecode`).
    single: State,
    /// For the hardware check of each image (`nvjpegJpegStreamParseHeader`).
    stream: JpegStream,
    /// The batch size `nvjpegDecodeBatchedInitialize` last set (None: not set, or a batched
    /// call failed and it must be set again).
    batch: Option<c_int>,
    backend: Backend,
    /// A CUDA handle asked for ([`Nvjpeg::open_with`]): its batches go in one
    /// `nvjpegDecodeBatched` call too (Huffman decoding on the GPU, `NVJPEG_BACKEND_GPU_HYBRID`).
    batched_cuda: bool,
    engines: u32,
    gpu: Gpu,
}

/// Where image `i` of a batch goes in the destination: interleaved RGB (3 bytes a pixel,
/// `width * 3` bytes a row), from `offset` on, rows `pitch` bytes apart; `width` and
/// `height` the image's own ([`Nvjpeg::image_info`]: a slot of another size is refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Byte offset of the first row in the destination.
    pub offset: usize,
    /// Bytes from one row to the next (at least `3 * width`).
    pub pitch: usize,
    /// The image's width.
    pub width: u32,
    /// The image's height.
    pub height: u32,
}

impl Slot {
    /// A slot of a `width` x `height` image at `offset`, rows back to back.
    pub fn packed(offset: usize, width: u32, height: u32) -> Slot {
        Slot {
            offset,
            pitch: 3 * width as usize,
            width,
            height,
        }
    }

    /// The bytes from `offset` to the end of the last row (saturating at `usize::MAX`, which
    /// no destination holds).
    pub fn span(&self) -> usize {
        if self.height == 0 {
            return 0;
        }
        self.pitch
            .checked_mul(self.height as usize - 1)
            .and_then(|rows| rows.checked_add(3 * self.width as usize))
            .unwrap_or(usize::MAX)
    }
}

/// Which decoder decoded an image of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodedBy {
    /// The hardware engines (`nvjpegDecodeBatched` on a hardware handle).
    Hardware,
    /// The CUDA decoder: `nvjpegDecode` (Huffman decoding on the host, the rest on the GPU),
    /// or the batched call of a handle opened for [`Backend::Cuda`] (all on the GPU).
    Cuda,
}

// SAFETY: the handle and state are nvJPEG's, tied to the GPU's context (bound again by each
// call here), and usable from any thread as long as one thread at a time uses the state,
// which `&mut self` on every call that touches it guarantees.
unsafe impl Send for Nvjpeg {}

impl Nvjpeg {
    /// A handle on `gpu` with the hardware backend where the GPU has decoder engines, else
    /// the CUDA backend (`nvjpegCreateEx`; [`Nvjpeg::backend`] says which).
    ///
    /// # Errors
    /// [`Error::NvjpegMissing`]; [`Error::Nvjpeg`] where no backend makes a handle (no GPU
    /// the library can use); CUDA errors binding the GPU's context.
    pub fn open(gpu: &Gpu) -> Result<Self> {
        Self::open_with(gpu, Backend::Hardware)
    }

    /// A handle on `gpu` driving `want`: [`Backend::Hardware`] as [`Nvjpeg::open`];
    /// [`Backend::Cuda`] the CUDA decoder even where the GPU has engines, with its Huffman
    /// decoding on the GPU (`NVJPEG_BACKEND_GPU_HYBRID`, else nvJPEG's default), each batch in
    /// one `nvjpegDecodeBatched` call: a decoder beside the engines' own, on the GPU's cores,
    /// which the engines leave mostly idle.
    ///
    /// # Errors
    /// As [`Nvjpeg::open`].
    pub fn open_with(gpu: &Gpu, want: Backend) -> Result<Self> {
        let l = library()?;
        gpu.context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let mut handle: Handle = std::ptr::null_mut();
        let mut backend = want;
        let first = match want {
            Backend::Hardware => BACKEND_HARDWARE,
            Backend::Cuda => BACKEND_GPU_HYBRID,
        };
        // SAFETY: null allocators select nvJPEG's defaults; `handle` is writable.
        let mut r = unsafe {
            (l.create_ex)(
                first,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                &mut handle,
            )
        };
        if r != 0 {
            // No hardware decoder here (JPEG_NOT_SUPPORTED, ARCH_MISMATCH...): the CUDA one.
            backend = Backend::Cuda;
            handle = std::ptr::null_mut();
            // SAFETY: as above.
            r = unsafe {
                (l.create_ex)(
                    BACKEND_DEFAULT,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                    &mut handle,
                )
            };
        }
        if r != 0 {
            return Err(failed("nvjpegCreateEx", r));
        }
        let (mut engines, mut cores) = (0, 0);
        if backend == Backend::Hardware {
            // SAFETY: a live handle; two writable uints.
            let r = unsafe { (l.hardware_info)(handle, &mut engines, &mut cores) };
            if r != 0 {
                engines = 0;
            }
        }
        // The handle first, so that Drop frees whatever was made when a later step fails.
        let mut nv = Nvjpeg {
            handle,
            state: std::ptr::null_mut(),
            single: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
            batch: None,
            backend,
            batched_cuda: want == Backend::Cuda,
            engines,
            gpu: gpu.clone(),
        };
        // SAFETY: a live handle; the outputs are writable.
        let r = unsafe { (l.state_create)(handle, &mut nv.state) };
        if r != 0 {
            return Err(failed("nvjpegJpegStateCreate", r));
        }
        // SAFETY: as above.
        let r = unsafe { (l.state_create)(handle, &mut nv.single) };
        if r != 0 {
            return Err(failed("nvjpegJpegStateCreate", r));
        }
        // SAFETY: as above.
        let r = unsafe { (l.stream_create)(handle, &mut nv.stream) };
        if r != 0 {
            return Err(failed("nvjpegJpegStreamCreate", r));
        }
        Ok(nv)
    }

    /// The backend the handle drives.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The hardware decoder engines (0 with the CUDA backend).
    pub fn hardware_engines(&self) -> u32 {
        self.engines
    }

    /// The GPU the handle was made on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// What `jpeg` is, from its headers; nothing is decoded.
    ///
    /// # Errors
    /// [`Error::Nvjpeg`] (`NVJPEG_STATUS_BAD_JPEG` for bytes that are no JPEG,
    /// `JPEG_NOT_SUPPORTED`...).
    pub fn image_info(&self, jpeg: &[u8]) -> Result<ImageInfo> {
        let l = library()?;
        let (mut components, mut subsampling) = (0, 0);
        let (mut widths, mut heights) = ([0 as c_int; 4], [0 as c_int; 4]);
        // SAFETY: a live handle (nvjpegGetImageInfo is thread-safe); `jpeg` is readable for
        // its length; the outputs are an int, an enum (int) and two int[NVJPEG_MAX_COMPONENT].
        let r = unsafe {
            (l.image_info)(
                self.handle,
                jpeg.as_ptr(),
                jpeg.len(),
                &mut components,
                &mut subsampling,
                widths.as_mut_ptr(),
                heights.as_mut_ptr(),
            )
        };
        if r != 0 {
            return Err(failed("nvjpegGetImageInfo", r));
        }
        Ok(ImageInfo {
            components: components.max(0) as u32,
            subsampling,
            width: widths[0].max(0) as u32,
            height: heights[0].max(0) as u32,
        })
    }
}

impl Nvjpeg {
    /// Decodes `jpegs` into `dst` (device memory of this handle's GPU) as interleaved RGB,
    /// image `i` into `slots[i]`, on `stream`, and returns once every image is decoded (the
    /// bytes are in `dst` for work queued on any stream after). Gray JPEGs come out with R = G
    /// = B.
    ///
    /// Each image's outcome is its own: which decoder made it, or why it was not decoded (bytes
    /// that are no JPEG or a corrupt one: [`Error::Nvjpeg`]; four components, or no
    /// end-of-image marker (truncated): [`Error::JpegRefused`]); its slot is then left as it
    /// was. With the hardware
    /// backend, the images its engines take go in one `nvjpegDecodeBatched` call (largest
    /// first, which measured faster: see `engine_order`; a CUDA handle's batched call takes
    /// its images in the same order), the others
    /// (4:1:1, 4:1:0, ...) one by one through `nvjpegDecode`; progressive JPEGs are refused
    /// ([`Error::JpegRefused`]: nvJPEG's CUDA decoder gave wrong pixels for one without an
    /// error on an H200, docs/benchmarks.md run 164); should the batched
    /// call fail, its images go through `nvjpegDecode` too. Before the hardware call the host
    /// waits for the work already queued on `stream`: on H100-class GPUs the engines write
    /// their output when called, not in `stream`'s order (torchcodec's issue 1634).
    ///
    /// # Errors
    /// [`Error::JpegSlot`] where `slots` and `jpegs` differ in length or a slot does not fit
    /// `dst` or its pitch its rows, before anything is decoded (a slot whose size is not the
    /// image's, as nvJPEG reads it, is that image's [`Error::JpegRefused`]); CUDA errors of
    /// the waits.
    ///
    /// # Example
    /// ```no_run
    /// # fn main() -> gpufeed_cuda::Result<()> {
    /// use gpufeed_cuda::nvjpeg::{Nvjpeg, Slot};
    /// let gpu = gpufeed_cuda::Gpu::open(0)?;
    /// let mut nv = Nvjpeg::open(&gpu)?;
    /// let jpeg = std::fs::read("cat.jpg").expect("a JPEG");
    /// let info = nv.image_info(&jpeg)?;
    /// let slot = Slot::packed(0, info.width, info.height);
    /// let stream = gpu.default_stream();
    /// let mut rgb = stream.alloc_zeros::<u8>(slot.span()).expect("device memory");
    /// let outcomes = nv.decode_batch(&[&jpeg[..]], &mut rgb.slice_mut(..), &[slot], &stream)?;
    /// outcomes[0].as_ref().expect("decoded");
    /// # Ok(()) }
    /// ```
    pub fn decode_batch(
        &mut self,
        jpegs: &[&[u8]],
        dst: &mut CudaViewMut<'_, u8>,
        slots: &[Slot],
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<Result<DecodedBy>>> {
        let len = dst.len();
        let (base, _write) = dst.device_ptr_mut(stream);
        // SAFETY: `base .. base + len` is `dst`'s memory, of `stream`'s context, which cudarc
        // records as written by `stream`'s work; `decode_batch_raw` waits for it.
        unsafe { self.decode_batch_raw(jpegs, base, len, slots, stream) }
    }

    /// [`Nvjpeg::decode_batch`] into device memory at `dst` (`dst_len` bytes).
    ///
    /// # Safety
    /// `dst .. dst + dst_len` must be device memory of this handle's GPU, written or read by
    /// no other work until this returns.
    ///
    /// # Errors
    /// As [`Nvjpeg::decode_batch`].
    pub unsafe fn decode_batch_raw(
        &mut self,
        jpegs: &[&[u8]],
        dst: u64,
        dst_len: usize,
        slots: &[Slot],
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<Result<DecodedBy>>> {
        let l = library()?;
        if jpegs.len() != slots.len() {
            return Err(Error::JpegSlot {
                index: jpegs.len().min(slots.len()),
                reason: format!("{} JPEGs and {} slots", jpegs.len(), slots.len()),
            });
        }
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let mut outcomes: Vec<Result<DecodedBy>> = Vec::with_capacity(jpegs.len());
        // The images of the one batched call: those the engines take, or all on a CUDA handle.
        let mut batched = Vec::new();
        let mut cuda = Vec::new();
        // Each image's place in the batched call's order (see `engine_order`).
        let mut keys: Vec<(u32, u64)> = vec![(0, 0); jpegs.len()];
        for (i, (jpeg, slot)) in jpegs.iter().zip(slots).enumerate() {
            let info = match self.image_info(jpeg) {
                Ok(info) => info,
                Err(e) => {
                    outcomes.push(Err(e));
                    continue;
                }
            };
            if !has_end(jpeg) {
                outcomes.push(Err(Error::JpegRefused {
                    reason: "truncated: no end-of-image marker (FF D9) after its data".into(),
                }));
                continue;
            }
            if is_progressive(jpeg) {
                // nvJPEG's CUDA decoder (the engines take baseline only) gave wrong pixels,
                // without an error, for a progressive 37x51 4:2:0 JPEG on the H200 (GPU run
                // 164; torchvision's decode of some progressive files fails there too): a
                // wrong image must not pass silently, so these go to the caller's CPU decoder.
                outcomes.push(Err(Error::JpegRefused {
                    reason: "progressive: nvJPEG's CUDA decoder is not trusted with them \
                             (wrong pixels without an error seen on an H200): decode it on \
                             the CPU"
                        .into(),
                }));
                continue;
            }
            if info.components == 4 || info.components == 2 || info.subsampling < 0 {
                outcomes.push(Err(Error::JpegRefused {
                    reason: format!(
                        "{} components, subsampling code {} (CMYK/YCCK or unknown): convert it \
                         to RGB, or decode it on the CPU",
                        info.components, info.subsampling
                    ),
                }));
                continue;
            }
            if (slot.width, slot.height) != (info.width, info.height) {
                // The caller's header parse and nvJPEG's disagree (a first component that is
                // itself subsampled, ...): this image only, for the caller's CPU decoder.
                outcomes.push(Err(Error::JpegRefused {
                    reason: format!(
                        "nvJPEG reads it as {}x{}, its slot is {}x{}",
                        info.width, info.height, slot.width, slot.height
                    ),
                }));
                continue;
            }
            check_slot(i, slot, dst_len)?;
            keys[i] = engine_order(&info);
            outcomes.push(Ok(DecodedBy::Cuda));
            if self.batched_cuda || (self.backend == Backend::Hardware && self.takes(l, jpeg)) {
                batched.push(i);
            } else {
                cuda.push(i);
            }
        }
        let image = |i: usize| {
            let slot = slots[i];
            NvImage {
                channel: [
                    (dst + slot.offset as u64) as *mut u8,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                ],
                pitch: [slot.pitch, 0, 0, 0],
            }
        };
        let cu = stream.cu_stream();
        order_for_engines(&mut batched, &keys);
        if !batched.is_empty() {
            // The engines write when called (see above): the work queued before goes first
            // (waited for asleep: a spinning wait would keep a core busy per decode thread).
            self.gpu.wait_asleep(stream)?;
            let n = batched.len() as c_int;
            let mut r = 0;
            if self.batch != Some(n) {
                // SAFETY: live handle and state; the batch size and format are plain values
                // (the thread count is unused by nvJPEG 11.1 on).
                r = unsafe { (l.batched_initialize)(self.handle, self.state, n, 1, OUTPUT_RGBI) };
                self.batch = (r == 0).then_some(n);
            }
            if r == 0 {
                let data: Vec<*const u8> = batched.iter().map(|&i| jpegs[i].as_ptr()).collect();
                let lengths: Vec<usize> = batched.iter().map(|&i| jpegs[i].len()).collect();
                let mut images: Vec<NvImage> = batched.iter().map(|&i| image(i)).collect();
                // SAFETY: `n` readable JPEGs with their lengths, `n` destinations each inside
                // `dst` (checked by `check_slot`) and written by nothing else (the caller's
                // promise); the inputs outlive the call and the synchronization below.
                r = unsafe {
                    (l.batched)(
                        self.handle,
                        self.state,
                        data.as_ptr(),
                        lengths.as_ptr(),
                        images.as_mut_ptr(),
                        cu,
                    )
                };
                if r == 0 {
                    let by = match self.backend {
                        Backend::Hardware => DecodedBy::Hardware,
                        Backend::Cuda => DecodedBy::Cuda,
                    };
                    for &i in &batched {
                        outcomes[i] = Ok(by);
                    }
                }
            }
            if r != 0 {
                // Set up again before the next batched call (nvJPEG's rule after a failure);
                // these images one by one instead.
                tracing::debug!(
                    status = status_name(r),
                    images = batched.len(),
                    "nvJPEG's batched decode failed; decoding them one by one"
                );
                self.batch = None;
                cuda.extend(&batched);
            }
        }
        for &i in &cuda {
            let mut img = image(i);
            // SAFETY: a readable JPEG, a destination inside `dst` (checked) written by nothing
            // else; the one-image state is this handle's own.
            let r = unsafe {
                (l.decode)(
                    self.handle,
                    self.single,
                    jpegs[i].as_ptr(),
                    jpegs[i].len(),
                    OUTPUT_RGBI,
                    &mut img,
                    cu,
                )
            };
            outcomes[i] = if r == 0 {
                Ok(DecodedBy::Cuda)
            } else {
                Err(failed("nvjpegDecode", r))
            };
        }
        // The inputs are the caller's to free after this; the outputs ready for any stream.
        self.gpu.wait_asleep(stream)?;
        Ok(outcomes)
    }

    /// Whether the hardware engines take `jpeg` (`nvjpegDecodeBatchedSupported`, whose 0
    /// means yes).
    fn takes(&self, l: &Library, jpeg: &[u8]) -> bool {
        // SAFETY: live handle and stream; `jpeg` readable for its length during the call.
        let r = unsafe { (l.parse_header)(self.handle, jpeg.as_ptr(), jpeg.len(), self.stream) };
        if r != 0 {
            return false;
        }
        let mut no = 1;
        // SAFETY: the stream just parsed; `no` writable.
        let r = unsafe { (l.batched_supported)(self.handle, self.stream, &mut no) };
        r == 0 && no == 0
    }
}

/// Where an image goes in the batched call: the batch is ordered by this key, largest first
/// (chroma subsampling, 4:4:4 first, then area), as NVIDIA's nvImageCodec orders its
/// hardware decoder's batches. Measured on an H100's seven engines (GPU run 189, 2,048
/// ImageNet-sized JPEGs, batches of 256 decoded by three threads at once, same call): 18.7k
/// images/s ordered against 13.4k in the sampler's order. Why nvJPEG does not balance the
/// engines itself is not documented; the likely reason is that it deals the images out in
/// the order given, so a large one near the end keeps one engine busy while the rest idle.
fn engine_order(info: &ImageInfo) -> (u32, u64) {
    // nvjpegChromaSubsampling_t: 0 4:4:4, 1 4:2:2, 2 4:2:0, 3 4:4:0, 4 4:1:1, 5 4:1:0, 6 gray;
    // 7 (4:1:0 vertical) and unknown last.
    let score = match info.subsampling {
        s @ 0..=6 => 8 - s as u32,
        _ => 1,
    };
    (score, u64::from(info.width) * u64::from(info.height))
}

/// Orders `batched` (indices into `keys`) for the batched call: largest key first, ties in
/// the batch's order.
fn order_for_engines(batched: &mut [usize], keys: &[(u32, u64)]) {
    batched.sort_by_key(|&i| std::cmp::Reverse(keys[i]));
}

/// Whether `jpeg` has an end-of-image marker after its image data: `FF D9` ending the file
/// (nearly every JPEG), or else found by a walk from its first scan through the entropy-coded
/// data (where a byte `FF` is followed by `00`, a restart marker's `D0`-`D7` or fill) and the
/// segments between scans, up to the first end marker — so that bytes after the marker (a
/// video appended by a phone's motion photo, ...) whatever they hold do not count. A file cut
/// short has none; a thumbnail's marker inside a header segment is skipped with its segment.
pub fn has_end(jpeg: &[u8]) -> bool {
    let Some(mut at) = first_scan(jpeg) else {
        return false;
    };
    if jpeg.ends_with(&[0xFF, 0xD9]) {
        return true;
    }
    loop {
        let Some(ff) = jpeg[at.min(jpeg.len())..].iter().position(|&b| b == 0xFF) else {
            return false;
        };
        let p = at + ff;
        match jpeg.get(p + 1) {
            None => return false,
            Some(0xD9) => return true,
            Some(0x00 | 0xD0..=0xD7 | 0x01) => at = p + 2,
            Some(0xFF) => at = p + 1, // fill: the next FF starts the marker
            Some(_) => {
                // A segment between scans (DHT, SOS, DRI, ...): skipped by its length.
                let Some(len) = jpeg.get(p + 2..p + 4) else {
                    return false;
                };
                at = p + 2 + usize::from(u16::from_be_bytes([len[0], len[1]]));
            }
        }
    }
}

/// The offset of the first byte after `jpeg`'s first start-of-scan segment; `None` for bytes
/// that are no JPEG or end before a scan.
fn first_scan(jpeg: &[u8]) -> Option<usize> {
    walk_headers(jpeg).map(|(scan, _)| scan)
}

/// A walk of `jpeg`'s header segments from its start-of-image marker to its first
/// start-of-scan segment: the offset of the first byte after that segment, and whether a
/// progressive frame header (`FF C2`, or the arithmetic-coded `FF CA`) came before it. `None`
/// for bytes that are no JPEG or end before a scan.
fn walk_headers(jpeg: &[u8]) -> Option<(usize, bool)> {
    if !jpeg.starts_with(&[0xFF, 0xD8]) {
        return None;
    }
    let (mut at, mut progressive) = (2, false);
    while at + 4 <= jpeg.len() {
        if jpeg[at] != 0xFF {
            return None;
        }
        match jpeg[at + 1] {
            0xFF => at += 1,               // fill byte
            0x01 | 0xD0..=0xD7 => at += 2, // markers without a length
            0xD9 => return None,
            marker => {
                progressive |= matches!(marker, 0xC2 | 0xCA);
                let len = usize::from(u16::from_be_bytes([jpeg[at + 2], jpeg[at + 3]]));
                at += 2 + len;
                if marker == 0xDA {
                    return (at <= jpeg.len()).then_some((at, progressive));
                }
            }
        }
    }
    None
}

/// Whether `jpeg`'s frame is progressive (a start-of-frame marker `FF C2`, or the
/// arithmetic-coded `FF CA`, before its first scan), by a walk of its header segments; `false`
/// for bytes that are no JPEG or have no scan.
pub fn is_progressive(jpeg: &[u8]) -> bool {
    walk_headers(jpeg).is_some_and(|(_, progressive)| progressive)
}

/// Refuses a slot that does not fit `len` bytes, or rows its pitch.
fn check_slot(index: usize, slot: &Slot, len: usize) -> Result<()> {
    let refuse = |reason: String| Err(Error::JpegSlot { index, reason });
    if slot.pitch < 3 * slot.width as usize {
        return refuse(format!(
            "a pitch of {} bytes is less than a row of {} pixels (3 bytes each)",
            slot.pitch, slot.width
        ));
    }
    match slot.offset.checked_add(slot.span()) {
        Some(end) if end <= len => Ok(()),
        _ => refuse(format!(
            "{} bytes from offset {} do not fit the destination's {len}",
            slot.span(),
            slot.offset
        )),
    }
}

impl Drop for Nvjpeg {
    fn drop(&mut self) {
        if let Ok(l) = library() {
            // The context the state and handle were made in, for their device memory.
            let _ = self.gpu.context().bind_to_thread();
            // SAFETY: the objects made by `open` (null where not made), used by nothing after
            // this; the handle last.
            unsafe {
                if !self.stream.is_null() {
                    (l.stream_destroy)(self.stream);
                }
                for state in [self.state, self.single] {
                    if !state.is_null() {
                        (l.state_destroy)(state);
                    }
                }
                (l.destroy)(self.handle);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engines_take_a_batch_largest_first_with_full_chroma_ahead() {
        let info = |subsampling, width, height| ImageInfo {
            components: if subsampling == 6 { 1 } else { 3 },
            subsampling,
            width,
            height,
        };
        // (subsampling, width, height) in the batch's order; every nvjpegChromaSubsampling_t.
        let batch = [
            (2, 500, 375),
            (2, 1600, 1200),
            (0, 64, 48),
            (6, 800, 600),
            (2, 375, 500),
            (7, 4000, 4000),
            (1, 333, 127),
            (2, 32, 32),
            (3, 10, 10),
            (4, 2000, 20),
            (5, 20, 20),
        ];
        let keys: Vec<_> = batch
            .iter()
            .map(|&(s, w, h)| engine_order(&info(s, w, h)))
            .collect();
        // A batch the engines take some of: only those are ordered.
        let mut order: Vec<usize> = (0..batch.len()).collect();
        order_for_engines(&mut order, &keys);
        // 4:4:4, 4:2:2, then 4:2:0 by area (the two of equal area in the batch's order),
        // 4:4:0, 4:1:1, 4:1:0, gray, 4:1:0 vertical last whatever its size.
        assert_eq!(order, [2, 6, 1, 0, 4, 7, 8, 9, 10, 3, 5]);
        let mut some = vec![7, 0, 2];
        order_for_engines(&mut some, &keys);
        assert_eq!(some, [2, 0, 7]);
        // An unknown subsampling code ranks with the last.
        assert_eq!(
            engine_order(&info(-1, 9, 9)).0,
            engine_order(&info(7, 9, 9)).0
        );
    }

    #[test]
    fn only_a_jpeg_with_its_end_marker_after_its_last_scan_has_an_end() {
        // SOI, SOS (length 4: 2 bytes of header), data with a stuffed FF, a restart marker,
        // a second scan's header, more data, EOI.
        let whole = [
            0xFF, 0xD8, 0xFF, 0xDA, 0, 4, 1, 2, 7, 0xFF, 0x00, 3, 0xFF, 0xD0, 4, 0xFF, 0xDA, 0, 4,
            7, 8, 5, 6, 0xFF, 0xD9,
        ];
        assert!(has_end(&whole));
        for cut in 0..whole.len() - 1 {
            assert!(!has_end(&whole[..cut]), "cut at {cut}");
        }
        // Bytes after the end marker, markers among them (a motion photo's video): still whole.
        let mut trailing = whole.to_vec();
        trailing.extend_from_slice(&[0xFF, 0xDA, 0x12, 0xFF, 0xD8, 9, 9]);
        assert!(has_end(&trailing));
        // A thumbnail's end marker inside an APP1 segment does not end a file cut in its scan.
        let thumb_then_cut = [
            0xFF, 0xD8, 0xFF, 0xE1, 0, 6, 0xFF, 0xD9, 0xFF, 0xD9, 0xFF, 0xDA, 0, 2, 1, 2, 3,
        ];
        assert!(!has_end(&thumb_then_cut));
        let mut thumb_whole = thumb_then_cut.to_vec();
        thumb_whole.extend_from_slice(&[0xFF, 0xD9, 0x00]);
        assert!(has_end(&thumb_whole));
        assert!(!has_end(b"not a jpeg \xff\xd9"));
    }

    #[test]
    fn progressive_frames_are_told_from_baseline_ones_by_their_headers() {
        // SOI, an APP0 of 4 bytes, a frame header, then a scan.
        let frame = |sof: u8| {
            let mut j = vec![0xFF, 0xD8, 0xFF, 0xE0, 0, 4, 0xC2, 0xC2];
            j.extend_from_slice(&[0xFF, sof, 0, 11, 8, 0, 1, 0, 1, 1, 1, 0x11, 0]);
            j.extend_from_slice(&[0xFF, 0xDA, 0, 8, 1, 1, 0, 0, 63, 0, 0xFF, 0xD9]);
            j
        };
        assert!(is_progressive(&frame(0xC2)));
        assert!(is_progressive(&frame(0xCA)));
        // APP0's payload holds C2 bytes: only markers count
        assert!(!is_progressive(&frame(0xC0)));
        assert!(!is_progressive(&frame(0xC1)));
        assert!(!is_progressive(b"not a jpeg"));
        assert!(!is_progressive(&frame(0xC2)[..7]));
    }

    #[test]
    fn statuses_are_named_and_unknown_ones_said_so() {
        assert_eq!(status_name(0), "NVJPEG_STATUS_SUCCESS");
        assert_eq!(status_name(3), "NVJPEG_STATUS_BAD_JPEG");
        assert_eq!(status_name(10), "NVJPEG_STATUS_INCOMPLETE_BITSTREAM");
        assert_eq!(status_name(11), "an unknown nvjpegStatus_t");
        assert_eq!(status_name(-1), "an unknown nvjpegStatus_t");
    }

    /// The real library (CI points `GPUFEED_TEST_NVJPEG` at the `nvidia-nvjpeg` wheel's; the
    /// GPU machine has it installed) loads without a GPU and says its version.
    #[test]
    fn the_real_library_loads_and_says_its_version() {
        let given = std::env::var("GPUFEED_TEST_NVJPEG")
            .ok()
            .filter(|p| !p.is_empty());
        let names = crate::dynlib::candidates(given.clone().map(Into::into), &NAMES);
        let required =
            given.is_some() || std::env::var("GPUFEED_REQUIRE_GPU").as_deref() == Ok("1");
        match Library::load(&names) {
            Ok(l) => {
                assert!(l.version.0 >= 11, "{:?}", l.version);
                println!("nvJPEG {:?} from {}", l.version, l.name);
            }
            Err(why) if !required => {
                eprintln!("SKIP the_real_library_loads_and_says_its_version: {why}");
            }
            Err(why) => panic!("nvJPEG did not load: {why}"),
        }
    }

    #[test]
    fn a_missing_library_and_one_that_is_not_nvjpeg_say_what_was_tried() {
        let why = Library::load(&["/nonexistent/libnvjpeg.so.13".into()])
            .err()
            .expect("no such file");
        assert!(why.contains("/nonexistent/libnvjpeg.so.13"), "{why}");
        // The C library loads but has no nvJPEG entry points.
        let why = Library::load(&["libc.so.6".into()])
            .err()
            .expect("not nvJPEG");
        assert!(why.contains("libc.so.6: not nvJPEG"), "{why}");
    }
}
