//! nvJPEG, loaded at run time: the library NVIDIA ships for decoding JPEGs on the GPU (with
//! the hardware decoder engines of A100/H100-class GPUs where present). This is the first part
//! of gpufeed's image decoding (issue 40): the library found, checked and described
//! ([`nvjpeg_version`], `gpufeed doctor`), a decoder handle made on a GPU ([`Nvjpeg::open`])
//! with the hardware backend where the GPU has one, and what a JPEG is before it is decoded
//! ([`Nvjpeg::image_info`]). Batched decoding comes next.
//!
//! The library is opened on first use: `GPUFEED_NVJPEG_LIBRARY` if set, else `libnvjpeg.so.13`,
//! `.12`, `.11`, then `libnvjpeg.so` (the CUDA toolkit's and the `nvidia-nvjpeg` wheel's names;
//! the wheel installs it under `site-packages/nvidia/cu13/lib/`, which is not on the loader's
//! path: point the variable there). Its absence is [`Error::NvjpegMissing`] naming what was
//! tried, never a panic; a library without nvJPEG's entry points is refused the same way.
//! (cudarc has no nvJPEG binding.)

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

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
const BACKEND_HARDWARE: c_int = 3;

type Handle = *mut c_void;
type State = *mut c_void;

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
}

// SAFETY: the library's handle is thread-safe (nvJPEG's documentation: one handle may be
// shared by threads); the function pointers are plain code addresses.
unsafe impl Send for Library {}
// SAFETY: as above.
unsafe impl Sync for Library {}

/// The library names tried, in order.
fn candidates() -> Vec<String> {
    match std::env::var("GPUFEED_NVJPEG_LIBRARY") {
        Ok(v) if !v.is_empty() => vec![v],
        _ => [
            "libnvjpeg.so.13",
            "libnvjpeg.so.12",
            "libnvjpeg.so.11",
            "libnvjpeg.so",
        ]
        .map(String::from)
        .to_vec(),
    }
}

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
    state: State,
    backend: Backend,
    engines: u32,
    gpu: Gpu,
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
        let l = library()?;
        gpu.context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let mut handle: Handle = std::ptr::null_mut();
        let mut backend = Backend::Hardware;
        // SAFETY: null allocators select nvJPEG's defaults; `handle` is writable.
        let mut r = unsafe {
            (l.create_ex)(
                BACKEND_HARDWARE,
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
        let mut state: State = std::ptr::null_mut();
        // SAFETY: a live handle; `state` is writable.
        let r = unsafe { (l.state_create)(handle, &mut state) };
        if r != 0 {
            // SAFETY: the handle made above, used by nothing else.
            unsafe { (l.destroy)(handle) };
            return Err(failed("nvjpegJpegStateCreate", r));
        }
        Ok(Nvjpeg {
            handle,
            state,
            backend,
            engines,
            gpu: gpu.clone(),
        })
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

impl Drop for Nvjpeg {
    fn drop(&mut self) {
        if let Ok(l) = library() {
            // The context the state and handle were made in, for their device memory.
            let _ = self.gpu.context().bind_to_thread();
            // SAFETY: the state and handle made by `open`, used by nothing after this.
            unsafe {
                (l.state_destroy)(self.state);
                (l.destroy)(self.handle);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let names = given.clone().map_or_else(
            || {
                [
                    "libnvjpeg.so.13",
                    "libnvjpeg.so.12",
                    "libnvjpeg.so.11",
                    "libnvjpeg.so",
                ]
                .map(String::from)
                .to_vec()
            },
            |p| vec![p],
        );
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
