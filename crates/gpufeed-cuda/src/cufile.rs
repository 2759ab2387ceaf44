//! cuFile (GPUDirect Storage), loaded at run time: reads from a file straight into device
//! memory (issue 42). Where the machine has the `nvidia-fs` kernel module (or the kernel's
//! PCI P2PDMA with a supported NVMe), cuFile's reads go peer-to-peer from the storage into GPU
//! memory; elsewhere cuFile runs in its *compatibility mode*: POSIX reads into host memory it
//! owns, then a copy, when `cufile.json` allows it (`properties.allow_compat_mode`, true by
//! default), and refuses every read when not. [`crate::gds::detect`] says which, from the
//! machine; around reads, [`CuFile::count_paths`] asks cuFile's own statistics which path
//! served it.
//!
//! - [`cufile_version`]: the library found and its version (needs no GPU).
//! - [`CuFile::open`]: the driver opened (`cuFileDriverOpen`, once per process: it reads
//!   `cufile.json`, from `CUFILE_ENV_PATH_JSON` or `/etc/cufile.json`, then) and its
//!   properties ([`DriverProperties`]: the nvidia-fs version, compat mode, the file systems
//!   it supports). The driver stays open until the process exits, as KvikIO leaves it.
//! - [`CuFile::register`]: a descriptor opened with `O_DIRECT` registered
//!   (`cuFileHandleRegister`); [`CuFileHandle::read_raw`] reads into device memory
//!   (`cuFileRead`: a short read is read on, the end of the file is an error).
//!   Such destinations are not registered (`cuFileBufRegister`): cuFile then reads through
//!   its own bounce buffers, registered once and bounded by `cufile.json`'s
//!   `properties.max_device_cache_size`. [`BufRegistration`] registers a buffer kept for many
//!   reads, and [`CuFileHandle::read_registered`] reads into it with no bounce (gpufeed-load's
//!   `GdsBuffers::Registered` keeps a bounded pool of them per loader).
//!
//! The library is opened on first use: `GPUFEED_CUFILE_LIBRARY` if set, else
//! `libcufile.so.0`, then `libcufile.so` (the CUDA toolkit's and the `nvidia-cufile` wheel's
//! names; the wheel installs it under `site-packages/nvidia/cu13/lib/`, not on the loader's
//! path: point the variable there). Its absence is [`Error::CufileMissing`] naming what was
//! tried, never a panic; a library without cuFile's entry points is refused the same way.
//! (cudarc's cuFile binding loads the library on first call and panics where it is missing.)

use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// `CUfileOpError` values (cufile.h; 5000 + n), by name, with cuFile's own text.
const STATUS: &[(c_int, &str, &str)] = &[
    (0, "CU_FILE_SUCCESS", "success"),
    (
        5001,
        "CU_FILE_DRIVER_NOT_INITIALIZED",
        "the nvidia-fs driver is not loaded; set allow_compat_mode to true in cufile.json for the compatibility mode",
    ),
    (5002, "CU_FILE_DRIVER_INVALID_PROPS", "invalid property"),
    (
        5003,
        "CU_FILE_DRIVER_UNSUPPORTED_LIMIT",
        "property range error",
    ),
    (
        5004,
        "CU_FILE_DRIVER_VERSION_MISMATCH",
        "nvidia-fs driver version mismatch",
    ),
    (
        5005,
        "CU_FILE_DRIVER_VERSION_READ_ERROR",
        "nvidia-fs driver version read error",
    ),
    (
        5006,
        "CU_FILE_DRIVER_CLOSING",
        "driver shutdown in progress",
    ),
    (
        5007,
        "CU_FILE_PLATFORM_NOT_SUPPORTED",
        "GPUDirect Storage not supported on this platform",
    ),
    (
        5008,
        "CU_FILE_IO_NOT_SUPPORTED",
        "GPUDirect Storage not supported on this file",
    ),
    (
        5009,
        "CU_FILE_DEVICE_NOT_SUPPORTED",
        "GPUDirect Storage not supported on this GPU",
    ),
    (
        5010,
        "CU_FILE_NVFS_DRIVER_ERROR",
        "nvidia-fs driver ioctl error",
    ),
    (5011, "CU_FILE_CUDA_DRIVER_ERROR", "CUDA driver API error"),
    (
        5012,
        "CU_FILE_CUDA_POINTER_INVALID",
        "invalid device pointer",
    ),
    (
        5013,
        "CU_FILE_CUDA_MEMORY_TYPE_INVALID",
        "invalid pointer memory type",
    ),
    (
        5014,
        "CU_FILE_CUDA_POINTER_RANGE_ERROR",
        "pointer range exceeds the allocated address range",
    ),
    (
        5015,
        "CU_FILE_CUDA_CONTEXT_MISMATCH",
        "CUDA context mismatch",
    ),
    (
        5016,
        "CU_FILE_INVALID_MAPPING_SIZE",
        "access beyond the maximum pinned size",
    ),
    (
        5017,
        "CU_FILE_INVALID_MAPPING_RANGE",
        "access beyond the mapped size",
    ),
    (5018, "CU_FILE_INVALID_FILE_TYPE", "unsupported file type"),
    (
        5019,
        "CU_FILE_INVALID_FILE_OPEN_FLAG",
        "unsupported file open flags",
    ),
    (5020, "CU_FILE_DIO_NOT_SET", "the descriptor lacks O_DIRECT"),
    (5022, "CU_FILE_INVALID_VALUE", "invalid arguments"),
    (
        5023,
        "CU_FILE_MEMORY_ALREADY_REGISTERED",
        "device pointer already registered",
    ),
    (
        5024,
        "CU_FILE_MEMORY_NOT_REGISTERED",
        "device pointer lookup failure",
    ),
    (
        5025,
        "CU_FILE_PERMISSION_DENIED",
        "driver or file access error",
    ),
    (
        5026,
        "CU_FILE_DRIVER_ALREADY_OPEN",
        "driver is already open",
    ),
    (
        5027,
        "CU_FILE_HANDLE_NOT_REGISTERED",
        "file descriptor is not registered",
    ),
    (
        5028,
        "CU_FILE_HANDLE_ALREADY_REGISTERED",
        "file descriptor is already registered",
    ),
    (5029, "CU_FILE_DEVICE_NOT_FOUND", "GPU device not found"),
    (5030, "CU_FILE_INTERNAL_ERROR", "internal error"),
    (
        5031,
        "CU_FILE_GETNEWFD_FAILED",
        "failed to obtain a new file descriptor",
    ),
    (
        5033,
        "CU_FILE_NVFS_SETUP_ERROR",
        "nvidia-fs driver initialization error",
    ),
    (
        5034,
        "CU_FILE_IO_DISABLED",
        "GPUDirect Storage disabled by configuration for this file",
    ),
    (
        5035,
        "CU_FILE_BATCH_SUBMIT_FAILED",
        "failed to submit a batch operation",
    ),
    (
        5036,
        "CU_FILE_GPU_MEMORY_PINNING_FAILED",
        "failed to pin GPU memory",
    ),
    (5037, "CU_FILE_BATCH_FULL", "batch queue full"),
    (
        5038,
        "CU_FILE_ASYNC_NOT_SUPPORTED",
        "cuFile stream operation not supported",
    ),
    (
        5039,
        "CU_FILE_INTERNAL_BATCH_SETUP_ERROR",
        "batch setup internal error, retry later",
    ),
    (
        5040,
        "CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR",
        "batch submit internal error, retry later",
    ),
    (
        5041,
        "CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR",
        "batch get-status internal error, retry later",
    ),
    (
        5042,
        "CU_FILE_INTERNAL_BATCH_CANCEL_ERROR",
        "batch cancel internal error, retry later",
    ),
    (5043, "CU_FILE_NOMEM_ERROR", "out of memory, retry later"),
    (5044, "CU_FILE_IO_ERROR", "IO error"),
    (
        5045,
        "CU_FILE_INTERNAL_BUF_REGISTER_ERROR",
        "buffer registration error",
    ),
    (5046, "CU_FILE_HASH_OPR_ERROR", "hash operation error"),
    (
        5047,
        "CU_FILE_INVALID_CONTEXT_ERROR",
        "invalid CUDA context",
    ),
    (
        5048,
        "CU_FILE_NVFS_INTERNAL_DRIVER_ERROR",
        "nvidia-fs internal driver error",
    ),
    (
        5049,
        "CU_FILE_BATCH_NOCOMPAT_ERROR",
        "compatibility mode is off",
    ),
    (5050, "CU_FILE_IO_MAX_ERROR", "GPUDirect Storage max error"),
];

/// The name and cuFile's text of `CUfileOpError` `status` (the sign ignored: reads return it
/// negated).
pub fn status_name(status: i32) -> (&'static str, &'static str) {
    let code = status.saturating_abs();
    STATUS
        .iter()
        .find(|(c, ..)| *c == code)
        .map_or(("an unknown CUfileOpError", ""), |&(_, name, text)| {
            (name, text)
        })
}

/// `CUfileError_t`: cuFile's status and, for `CU_FILE_CUDA_DRIVER_ERROR`, the driver's.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Status {
    err: c_int,
    cu_err: c_int,
}

/// `CUfileDescr_t`'s handle: a descriptor (Linux) or a pointer.
#[repr(C)]
#[derive(Clone, Copy)]
union DescrHandle {
    fd: c_int,
    handle: *mut c_void,
}

/// `CUfileDescr_t`.
#[repr(C)]
struct Descr {
    /// `CU_FILE_HANDLE_TYPE_OPAQUE_FD` (1).
    kind: c_int,
    handle: DescrHandle,
    fs_ops: *const c_void,
}

/// `CUfileDrvProps_t` (cufile.h, unchanged from cuFile 1.4 to 1.20).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RawProps {
    nvfs_major: c_uint,
    nvfs_minor: c_uint,
    poll_thresh_size: usize,
    max_direct_io_size: usize,
    dstatusflags: c_uint,
    dcontrolflags: c_uint,
    fflags: c_uint,
    max_device_cache_size: c_uint,
    per_buffer_cache_size: c_uint,
    max_device_pinned_mem_size: c_uint,
    max_batch_io_size: c_uint,
    max_batch_io_timeout_msecs: c_uint,
}

type CufileHandle = *mut c_void;

/// cuFile's statistics calls (recent cuFile; older libraries have none).
struct StatsCalls {
    get_level: unsafe extern "C" fn(*mut c_int) -> Status,
    set_level: unsafe extern "C" fn(c_int) -> Status,
    start: unsafe extern "C" fn() -> Status,
    get_l3: unsafe extern "C" fn(*mut c_void) -> Status,
}

/// cuFile's entry points used here, resolved once.
struct Library {
    _lib: libloading::Library,
    /// Which name or path loaded.
    name: String,
    /// `cuFileGetVersion`'s answer (1000 major + 10 minor), where the library has it.
    version: Option<c_int>,
    driver_open: unsafe extern "C" fn() -> Status,
    driver_close: unsafe extern "C" fn() -> Status,
    driver_properties: unsafe extern "C" fn(*mut RawProps) -> Status,
    handle_register: unsafe extern "C" fn(*mut CufileHandle, *mut Descr) -> Status,
    handle_deregister: unsafe extern "C" fn(CufileHandle),
    buf_register: unsafe extern "C" fn(*const c_void, usize, c_int) -> Status,
    buf_deregister: unsafe extern "C" fn(*const c_void) -> Status,
    read: unsafe extern "C" fn(CufileHandle, *mut c_void, usize, i64, i64) -> isize,
    stats: Option<StatsCalls>,
}

// SAFETY: cuFile's calls are thread-safe (its documentation: handles and buffers may be used
// from several threads); the function pointers are plain code addresses.
unsafe impl Send for Library {}
// SAFETY: as above.
unsafe impl Sync for Library {}

/// The library names tried, in order (`var`: `GPUFEED_CUFILE_LIBRARY`'s value).
fn candidates(var: Option<std::ffi::OsString>) -> Vec<String> {
    crate::dynlib::candidates(var, &["libcufile.so.0", "libcufile.so"])
}

impl Library {
    fn load(names: &[String]) -> std::result::Result<Self, String> {
        // SAFETY: the names are cuFile's (or the path the user gave for it); loading it runs
        // its initialisers, which only set up its own state.
        unsafe { crate::dynlib::open_first(names, Self::resolve) }
    }

    fn resolve(lib: libloading::Library, name: &str) -> std::result::Result<Self, String> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is cuFile's function of that name, whose C signature the
                // field's type spells out (cufile.h).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("not cuFile ({e})"))?
            };
        }
        macro_rules! optional {
            ($name:literal) => {
                // SAFETY: as for `sym!`.
                unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .ok()
                    .map(|s| *s)
            };
        }
        let get_version: Option<unsafe extern "C" fn(*mut c_int) -> Status> =
            optional!("cuFileGetVersion");
        let version = get_version.and_then(|f| {
            let mut v: c_int = 0;
            // SAFETY: `v` is a writable int.
            let s = unsafe { f(&mut v) };
            (s.err == 0 && v > 0).then_some(v)
        });
        // cuFileDriverClose is `#define`d to `_v2` in newer headers (the plain name stays
        // exported; its presence tells cuFile from another library of the name).
        let plain_close: unsafe extern "C" fn() -> Status = sym!("cuFileDriverClose");
        let driver_close = optional!("cuFileDriverClose_v2").unwrap_or(plain_close);
        let stats = (|| {
            Some(StatsCalls {
                get_level: optional!("cuFileGetStatsLevel")?,
                set_level: optional!("cuFileSetStatsLevel")?,
                start: optional!("cuFileStatsStart")?,
                get_l3: optional!("cuFileGetStatsL3")?,
            })
        })();
        Ok(Library {
            name: name.to_owned(),
            version,
            driver_open: sym!("cuFileDriverOpen"),
            driver_close,
            driver_properties: sym!("cuFileDriverGetProperties"),
            handle_register: sym!("cuFileHandleRegister"),
            handle_deregister: sym!("cuFileHandleDeregister"),
            buf_register: sym!("cuFileBufRegister"),
            buf_deregister: sym!("cuFileBufDeregister"),
            read: sym!("cuFileRead"),
            stats,
            _lib: lib,
        })
    }

    fn describe(&self) -> String {
        match self.version {
            Some(v) => format!("{}.{} ({})", v / 1000, (v % 1000) / 10, self.name),
            None => format!("version unknown ({})", self.name),
        }
    }
}

fn library() -> Result<&'static Library> {
    static LIBRARY: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
    match LIBRARY
        .get_or_init(|| Library::load(&candidates(std::env::var_os("GPUFEED_CUFILE_LIBRARY"))))
    {
        Ok(l) => Ok(l),
        Err(tried) => Err(Error::CufileMissing {
            tried: tried.clone(),
        }),
    }
}

/// An error of cuFile call `op` that returned `status`.
fn failed(op: &'static str, status: Status) -> Error {
    let (name, text) = status_name(status.err);
    Error::Cufile {
        op,
        status: status.err,
        name,
        text,
        cuda: (status.err == 5011).then_some(status.cu_err),
    }
}

fn check(op: &'static str, status: Status) -> Result<()> {
    if status.err == 0 {
        Ok(())
    } else {
        Err(failed(op, status))
    }
}

/// cuFile's version and the library that loaded, as `"1.15 (libcufile.so.0)"`. Needs no GPU
/// and does not open the driver.
///
/// # Errors
/// [`Error::CufileMissing`] saying what was tried and why each failed.
pub fn cufile_version() -> Result<String> {
    Ok(library()?.describe())
}

/// What the opened cuFile driver says of itself (`cuFileDriverGetProperties`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DriverProperties {
    /// The nvidia-fs kernel module's version as the driver reads it (`None`: not loaded, 0.0).
    pub nvfs_version: Option<(u32, u32)>,
    /// Compatibility mode allowed (`properties.allow_compat_mode`).
    pub compat_allowed: bool,
    /// Every IO forced through POSIX (cufile.json's `properties.vanilla_posix_io_mode`).
    pub posix_io_mode: bool,
    /// Poll mode (`properties.use_poll_mode`).
    pub poll_mode: bool,
    /// The file systems and block devices the driver reads peer-to-peer.
    pub supported: Vec<&'static str>,
    /// Whether this cuFile supports the kernel's PCI P2PDMA (feature flag 4: the library's
    /// support, not that this machine's NVMe and kernel allow it).
    pub p2pdma: bool,
    /// Largest IO sent to the kernel at once, bytes.
    pub max_direct_io_bytes: u64,
    /// Device memory for cuFile's bounce buffers, bytes (`max_device_cache_size`).
    pub max_device_cache_bytes: u64,
    /// One bounce buffer, bytes.
    pub per_buffer_cache_bytes: u64,
    /// Device memory cuFile may pin (registered buffers), bytes.
    pub max_device_pinned_bytes: u64,
}

/// Names of `CUfileDriverStatusFlags` bits.
const SUPPORTED: [(u32, &str); 14] = [
    (0, "Lustre"),
    (1, "WekaFS"),
    (2, "NFS"),
    (3, "GPFS"),
    (4, "NVMe"),
    (5, "NVMe-oF"),
    (6, "SCSI"),
    (7, "ScaleFlux CSD"),
    (8, "NVMesh"),
    (9, "BeeGFS"),
    (11, "NVMe P2P"),
    (12, "ScateFS"),
    (13, "VirtioFS"),
    (14, "PanFS"),
];

impl DriverProperties {
    fn from_raw(p: &RawProps) -> Self {
        let kib = |v: c_uint| u64::from(v).saturating_mul(1024);
        DriverProperties {
            nvfs_version: (p.nvfs_major != 0 || p.nvfs_minor != 0)
                .then_some((p.nvfs_major, p.nvfs_minor)),
            compat_allowed: p.dcontrolflags & (1 << 1) != 0,
            posix_io_mode: p.dcontrolflags & (1 << 2) != 0,
            poll_mode: p.dcontrolflags & 1 != 0,
            supported: SUPPORTED
                .iter()
                .filter(|(bit, _)| p.dstatusflags & (1 << bit) != 0)
                .map(|&(_, n)| n)
                .collect(),
            p2pdma: p.fflags & (1 << 4) != 0,
            max_direct_io_bytes: (p.max_direct_io_size as u64).saturating_mul(1024),
            max_device_cache_bytes: kib(p.max_device_cache_size),
            per_buffer_cache_bytes: kib(p.per_buffer_cache_size),
            max_device_pinned_bytes: kib(p.max_device_pinned_mem_size),
        }
    }

    /// Whether the driver reads through nvidia-fs (loaded, its version known, POSIX mode off).
    /// P2PDMA reads ([`DriverProperties::p2pdma`] says only that this cuFile supports them)
    /// cannot be told from the properties: [`CuFile::count_paths`] tells after a read.
    pub fn nvidia_fs(&self) -> bool {
        !self.posix_io_mode && self.nvfs_version.is_some()
    }
}

/// The cuFile driver, opened once per process ([`CuFile::open`]).
#[derive(Debug)]
pub struct CuFile {
    properties: DriverProperties,
    library: String,
}

/// Which path cuFile's statistics say served reads ([`CuFile::count_paths`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct PathCounts {
    /// Reads counted.
    pub total: u64,
    /// Through PCI P2PDMA.
    pub p2pdma: u64,
    /// Through nvidia-fs.
    pub nvfs: u64,
    /// Through POSIX reads into host memory (compatibility mode).
    pub posix: u64,
    /// Bytes read.
    pub bytes: u64,
}

impl PathCounts {
    /// A name for the path: `"nvidia-fs"`, `"p2pdma"`, `"compat (POSIX)"`, `"mixed"`, or
    /// `"none"` where nothing was read.
    pub fn path(&self) -> &'static str {
        match (self.nvfs > 0, self.p2pdma > 0, self.posix > 0) {
            (false, false, false) => "none",
            (true, false, false) => "nvidia-fs",
            (false, true, false) => "p2pdma",
            (false, false, true) => "compat (POSIX)",
            _ => "mixed",
        }
    }
}

impl CuFile {
    /// The cuFile driver for `gpu` (`cuFileDriverOpen` on first call; later calls return the
    /// same driver, whatever the GPU). Leaves `gpu`'s context bound to the calling thread, as
    /// the reads need it.
    ///
    /// # Errors
    /// [`Error::CufileMissing`]; [`Error::Cufile`] where the driver does not open (no
    /// nvidia-fs and `allow_compat_mode` false: `CU_FILE_DRIVER_NOT_INITIALIZED`; no usable
    /// GPU: `CU_FILE_CUDA_DRIVER_ERROR`). The first outcome is kept: a failed open is not
    /// tried again in this process.
    pub fn open(gpu: &Gpu) -> Result<&'static CuFile> {
        static DRIVER: OnceLock<std::result::Result<CuFile, (&'static str, Status)>> =
            OnceLock::new();
        let l = library()?;
        gpu.context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        match DRIVER.get_or_init(|| Self::open_driver(l)) {
            Ok(d) => Ok(d),
            Err((op, status)) => Err(failed(op, *status)),
        }
    }

    fn open_driver(l: &'static Library) -> std::result::Result<CuFile, (&'static str, Status)> {
        // SAFETY: no arguments; a GPU's context is bound to this thread.
        let s = unsafe { (l.driver_open)() };
        if s.err != 0 {
            return Err(("cuFileDriverOpen", s));
        }
        // Closed when the process exits, before the library's own teardown: left open, cuFile
        // 1.15 tore itself down at exit under its still-running IO threads, which then
        // crashed (SIGSEGV on an unmapped page after every test had passed, GPU runs 183-184;
        // closed here, the same tests exited cleanly in run 186).
        // SAFETY: registers a plain `extern "C"` function without arguments.
        if unsafe { libc::atexit(close_driver_at_exit) } != 0 {
            tracing::debug!("atexit refused: cuFile's driver is left to close itself at exit");
        }
        // Room for fields a later cuFile may add at the end.
        let mut raw = [RawProps::default(); 2];
        // SAFETY: `raw` is writable and larger than `CUfileDrvProps_t`.
        let s = unsafe { (l.driver_properties)(raw.as_mut_ptr()) };
        if s.err != 0 {
            return Err(("cuFileDriverGetProperties", s));
        }
        Ok(CuFile {
            properties: DriverProperties::from_raw(&raw[0]),
            library: l.describe(),
        })
    }

    /// What the driver says of itself.
    pub fn properties(&self) -> &DriverProperties {
        &self.properties
    }

    /// The library, as [`cufile_version`] gives it.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// `fd` (opened with `O_DIRECT`, for reading) registered with cuFile
    /// (`cuFileHandleRegister`); deregistered when the handle drops.
    ///
    /// # Errors
    /// [`Error::Cufile`]: `CU_FILE_DIO_NOT_SET` without `O_DIRECT`, `CU_FILE_IO_NOT_SUPPORTED`
    /// for a file cuFile cannot read (compatibility mode off and no peer path for this file
    /// system), ...
    pub fn register<'fd>(&self, fd: BorrowedFd<'fd>) -> Result<CuFileHandle<'fd>> {
        let l = library()?;
        let mut descr = Descr {
            kind: 1,
            handle: DescrHandle {
                handle: std::ptr::null_mut(),
            },
            fs_ops: std::ptr::null(),
        };
        // Zero the union's pointer-sized field first, then set the descriptor in it.
        descr.handle.fd = fd.as_raw_fd();
        let mut raw: CufileHandle = std::ptr::null_mut();
        // SAFETY: `raw` and `descr` are writable and of cufile.h's layout; the descriptor is
        // open for the handle's lifetime ('fd), which deregisters it on drop.
        check("cuFileHandleRegister", unsafe {
            (l.handle_register)(&mut raw, &mut descr)
        })?;
        Ok(CuFileHandle {
            raw,
            _fd: std::marker::PhantomData,
        })
    }

    /// Runs `reads` (reads of `expected_bytes` into `gpu`) and says which path served them,
    /// from cuFile's level-3 statistics: a snapshot before and after (never a reset, so other
    /// users' counters in this process stay as they are), the difference taken at the entry of
    /// `gpu`, found by its UUID, and kept only where its read bytes grew by exactly
    /// `expected_bytes` and its path counters are consistent (some reads, the paths' reads
    /// no more than the total), so that reads by someone else meanwhile, or a statistics
    /// layout other than cuFile 1.20's (whose field order after the UUID this build assumes),
    /// are unlikely to be misread. The statistics level is raised to 3 (started where it was
    /// 0) and left there for the rest of the process: cuFile 1.15 in compatibility mode
    /// crashed (SIGSEGV in its own IO threads, on an unmapped page) in the loads after
    /// counted loads that stopped the statistics and set the level back (bench table 16,
    /// GPU runs 180, 182 and 183; with the level left raised, the five rounds of runs 185 and
    /// 186 ran).
    /// Counted calls are serialized in the process. `None` where this cuFile has no
    /// statistics calls (before 1.14) or the check fails.
    pub fn count_paths<R>(
        &self,
        gpu: &Gpu,
        expected_bytes: u64,
        reads: impl FnOnce() -> R,
    ) -> (R, Option<PathCounts>) {
        static COUNTING: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
        let (Ok(l), Ok(uuid)) = (library(), gpu.uuid()) else {
            return (reads(), None);
        };
        let Some(s) = &l.stats else {
            return (reads(), None);
        };
        let _one = COUNTING.lock();
        let mut level: c_int = 0;
        // SAFETY: `level` is a writable int.
        let known = unsafe { (s.get_level)(&mut level) }.err == 0;
        // Raised once and never lowered or stopped (see above).
        let counting = known
            && (level >= 3 || {
                // SAFETY: plain calls without pointers.
                unsafe { (s.set_level)(3) }.err == 0
                    && (level > 0 || unsafe { (s.start)() }.err == 0)
            });
        let before = if counting { stats_l3(s) } else { None };
        let out = reads();
        let after = before.as_ref().and_then(|_| stats_l3(s));
        let counts = match (before, after) {
            (Some(b), Some(a)) => gpu_counts_delta(&b, &a, &uuid, expected_bytes),
            _ => None,
        };
        (out, counts)
    }
}

/// Closes the cuFile driver opened by [`CuFile::open`] (run once, at exit: see there).
extern "C" fn close_driver_at_exit() {
    if let Ok(l) = library() {
        // SAFETY: no arguments; the driver was opened in this process. The process is
        // exiting: a read still running in another thread may fail, as it would have at the
        // library's own teardown.
        let _ = unsafe { (l.driver_close)() };
    }
}

/// `CUfileStatsLevel3_t` read into a 128 KiB buffer (about 7 KiB in cuFile 1.20; room for
/// later growth), as bytes.
fn stats_l3(s: &StatsCalls) -> Option<Vec<u8>> {
    let mut words = vec![0u64; 16 * 1024];
    // SAFETY: `words` is writable, 128 KiB, far more than the structure.
    if unsafe { (s.get_l3)(words.as_mut_ptr().cast()) }.err != 0 {
        return None;
    }
    Some(bytemuck_u64s(&words).to_vec())
}

/// `words` as bytes.
fn bytemuck_u64s(words: &[u64]) -> &[u8] {
    // SAFETY: u64s are plain bytes; the length in bytes is 8 per word and the alignment of
    // u8 is 1.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), words.len() * 8) }
}

/// The per-GPU entries of a `CUfileStatsLevel3_t` (`before` and `after` it) that start with
/// `uuid` (16 bytes, at a multiple of 8): the first whose `read_bytes` grew by exactly
/// `expected_bytes`, its counters' growth (`n_total_reads`, `n_p2p_reads`, `n_nvfs_reads`,
/// `n_posix_reads` are its 5th to 8th counters, `CUfilePerGpuStats_t`).
fn gpu_counts_delta(
    before: &[u8],
    after: &[u8],
    uuid: &[u8; 16],
    expected_bytes: u64,
) -> Option<PathCounts> {
    let word = |stats: &[u8], at: usize| -> Option<u64> {
        stats
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_ne_bytes)
    };
    let grew = |at: usize| -> Option<u64> { word(after, at)?.checked_sub(word(before, at)?) };
    (0..after.len().saturating_sub(16 + 8 * 8))
        .step_by(8)
        .filter(|&at| after.get(at..at + 16) == Some(&uuid[..]))
        .find_map(|at| {
            let c = at + 16;
            let counts = PathCounts {
                bytes: grew(c)?,
                total: grew(c + 32)?,
                p2pdma: grew(c + 40)?,
                nvfs: grew(c + 48)?,
                posix: grew(c + 56)?,
            };
            let paths = counts
                .p2pdma
                .checked_add(counts.nvfs)
                .and_then(|n| n.checked_add(counts.posix));
            (counts.bytes == expected_bytes
                && counts.total > 0
                && paths.is_some_and(|n| n > 0 && n <= counts.total))
            .then_some(counts)
        })
}

/// A file registered with cuFile ([`CuFile::register`]); deregistered on drop.
#[derive(Debug)]
pub struct CuFileHandle<'fd> {
    raw: CufileHandle,
    _fd: std::marker::PhantomData<BorrowedFd<'fd>>,
}

// SAFETY: a cuFile handle may be used by several threads at once (cuFile's documentation:
// reads through one handle from many threads are how it is meant to be driven).
unsafe impl Send for CuFileHandle<'_> {}
// SAFETY: as above.
unsafe impl Sync for CuFileHandle<'_> {}

impl CuFileHandle<'_> {
    /// `cuFileRead`: `len` bytes at `file_offset` of the file into device memory at
    /// `dst + dst_offset`, read on after a short read; returns once the bytes are in device
    /// memory.
    ///
    /// # Safety
    /// 1. The destination's context is bound to the calling thread.
    /// 2. `dst .. dst + dst_offset + len` is device memory of that context, allocated (its
    ///    allocation complete: a stream-ordered allocation's stream synchronized).
    /// 3. No other work reads or writes those bytes until this returns.
    ///
    /// # Errors
    /// [`Error::CufileRead`] where the read fails (`errno`, or cuFile's status) or the file
    /// ends first.
    pub unsafe fn read_raw(
        &self,
        dst: u64,
        dst_offset: usize,
        len: usize,
        file_offset: u64,
    ) -> Result<()> {
        // SAFETY: the caller's promises. Not registered: the destination's address itself,
        // buffer offset 0 (KvikIO's way for buffers cuFile does not know).
        unsafe { self.read_loop(dst, dst_offset, len, file_offset, false) }
    }

    /// `cuFileRead` into a registered buffer: `len` bytes at `file_offset` of the file into
    /// `buf` at `buf_offset`, read on after a short read; returns once the bytes are in device
    /// memory. Where cuFile reads peer-to-peer (nvidia-fs), it reads straight into the buffer,
    /// with no bounce buffer of its own, in requests of up to `max_direct_io_size`. In its
    /// compatibility mode it reads into host memory and copies either way, so a registered
    /// buffer only adds a device copy: gpufeed-load reads into them only where the driver
    /// reads through nvidia-fs.
    ///
    /// # Safety
    /// 1. The buffer's context is bound to the calling thread.
    /// 2. No other work reads or writes `buf_offset .. buf_offset + len` of it until this
    ///    returns.
    ///
    /// # Errors
    /// [`Error::CufileRead`] as [`CuFileHandle::read_raw`]'s, and where the range is not
    /// inside the buffer.
    pub unsafe fn read_registered(
        &self,
        buf: &BufRegistration,
        buf_offset: usize,
        len: usize,
        file_offset: u64,
    ) -> Result<()> {
        if buf_offset.checked_add(len).is_none_or(|end| end > buf.len) {
            return Err(Error::CufileRead {
                offset: file_offset,
                len,
                reason: format!(
                    "{len} bytes at {buf_offset} of a registered buffer of {} bytes",
                    buf.len
                ),
            });
        }
        // SAFETY: the caller's promises; the range lies inside the registration (checked).
        // Registered: its base and an offset into it, so cuFile finds the registration.
        unsafe { self.read_loop(buf.base, buf_offset, len, file_offset, true) }
    }

    /// The reads of [`CuFileHandle::read_raw`] (`registered` false: the address `dst + at`,
    /// offset 0) and [`CuFileHandle::read_registered`] (true: base `dst`, offset `at`).
    ///
    /// # Safety
    /// As theirs.
    unsafe fn read_loop(
        &self,
        dst: u64,
        dst_offset: usize,
        len: usize,
        file_offset: u64,
        registered: bool,
    ) -> Result<()> {
        let l = library()?;
        let mut done = 0usize;
        while done < len {
            let (at, into) = (file_offset + done as u64, dst_offset + done);
            let (Ok(at_i), Some(_), Ok(into_i)) = (
                i64::try_from(at),
                (dst as usize).checked_add(into),
                i64::try_from(into),
            ) else {
                return Err(Error::CufileRead {
                    offset: at,
                    len: len - done,
                    reason: "offset past what off_t or the address space holds".into(),
                });
            };
            let (base, offset) = if registered {
                (dst as usize, into_i)
            } else {
                (dst as usize + into, 0)
            };
            // SAFETY: the caller's promises: the destination range is device memory of the
            // bound context and nothing else touches it; the handle is registered.
            let n = unsafe { (l.read)(self.raw, base as *mut c_void, len - done, at_i, offset) };
            match n {
                n if n > 0 => done += n as usize,
                0 => {
                    return Err(Error::CufileRead {
                        offset: at,
                        len: len - done,
                        reason: "the file ended first (truncated while loading?)".into(),
                    });
                }
                -1 => {
                    return Err(Error::CufileRead {
                        offset: at,
                        len: len - done,
                        reason: std::io::Error::last_os_error().to_string(),
                    });
                }
                n => {
                    let status = i32::try_from(n).unwrap_or(i32::MIN);
                    let (name, text) = status_name(status);
                    // cuFile returns -errno for some file-system errors, -CUfileOpError for
                    // its own.
                    let reason = if status.saturating_abs() < 5000 {
                        std::io::Error::from_raw_os_error(status.saturating_abs()).to_string()
                    } else {
                        format!("{name}: {text}")
                    };
                    return Err(Error::CufileRead {
                        offset: at,
                        len: len - done,
                        reason,
                    });
                }
            }
        }
        Ok(())
    }
}

impl Drop for CuFileHandle<'_> {
    fn drop(&mut self) {
        if let Ok(l) = library() {
            // SAFETY: the handle was registered and is deregistered once.
            unsafe { (l.handle_deregister)(self.raw) };
        }
    }
}

/// Device memory registered with cuFile (`cuFileBufRegister`) for the lifetime of this
/// value: reads into it skip cuFile's bounce buffers (with nvidia-fs: DMA straight into it).
/// Registration pins GPU BAR1 space (bounded by [`DriverProperties::max_device_pinned_bytes`]):
/// register buffers kept for many reads, not each destination.
#[derive(Debug)]
pub struct BufRegistration {
    base: u64,
    len: usize,
}

impl BufRegistration {
    /// Registers `len` bytes of device memory at `base`.
    ///
    /// # Safety
    /// 1. The allocation's context is bound to the calling thread.
    /// 2. `base .. base + len` is a device allocation of that context that outlives this
    ///    value (drop it on a thread with the context bound: deregistration needs it).
    ///
    /// # Errors
    /// [`Error::Cufile`] (`CU_FILE_GPU_MEMORY_PINNING_FAILED` past the BAR1 budget, ...).
    pub unsafe fn new(_driver: &CuFile, base: u64, len: usize) -> Result<Self> {
        let l = library()?;
        // SAFETY: the caller's promise.
        check("cuFileBufRegister", unsafe {
            (l.buf_register)(base as usize as *const c_void, len, 0)
        })?;
        Ok(BufRegistration { base, len })
    }

    /// The registered memory's address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no bytes are registered (never: cuFile refuses an empty registration).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for BufRegistration {
    fn drop(&mut self) {
        if let Ok(l) = library() {
            // SAFETY: registered in `new`, deregistered once.
            let _ = unsafe { (l.buf_deregister)(self.base as usize as *const c_void) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_names_the_only_library_tried() {
        assert_eq!(
            candidates(Some("/opt/x/libcufile.so.0".into())),
            ["/opt/x/libcufile.so.0"]
        );
        assert_eq!(
            candidates(Some("".into())),
            ["libcufile.so.0", "libcufile.so"]
        );
        assert_eq!(candidates(None), ["libcufile.so.0", "libcufile.so"]);
    }

    /// The real library (CI points `GPUFEED_TEST_CUFILE` at the `nvidia-cufile` wheel's; the
    /// GPU machine has it installed) loads without a GPU and says its version; a path that is
    /// not there, or a library that is not cuFile, is refused saying so.
    #[test]
    fn the_real_library_loads_and_others_are_refused() {
        let given = std::env::var("GPUFEED_TEST_CUFILE")
            .ok()
            .filter(|p| !p.is_empty());
        let required =
            given.is_some() || std::env::var("GPUFEED_REQUIRE_GPU").as_deref() == Ok("1");
        match Library::load(&candidates(given.map(Into::into))) {
            Ok(l) => {
                let v = l.version.expect("cuFile >= 1.6 says its version");
                assert!((1000..2000).contains(&v), "{v}");
                assert!(l.describe().starts_with("1."), "{}", l.describe());
                println!(
                    "cuFile {} (statistics: {})",
                    l.describe(),
                    l.stats.is_some()
                );
            }
            Err(why) if !required => {
                eprintln!("SKIP the_real_library_loads_and_others_are_refused: {why}");
            }
            Err(why) => panic!("cuFile did not load: {why}"),
        }
        let missing = "/nonexistent/gpufeed/libcufile.so.0".to_owned();
        let why = Library::load(std::slice::from_ref(&missing))
            .err()
            .expect("refused");
        assert!(why.starts_with(&missing), "{why}");
        // A library that loads but is not cuFile (the C library every process has).
        let why = Library::load(&["libc.so.6".to_owned()])
            .err()
            .expect("refused");
        assert!(why.contains("not cuFile"), "{why}");
        let e = Error::CufileMissing { tried: why };
        assert!(e.to_string().contains("GPUFEED_CUFILE_LIBRARY"), "{e}");
    }

    #[test]
    fn statuses_are_named_with_cufiles_text() {
        assert_eq!(status_name(5020).0, "CU_FILE_DIO_NOT_SET");
        assert_eq!(status_name(-5008).0, "CU_FILE_IO_NOT_SUPPORTED");
        assert_eq!(status_name(5001).0, "CU_FILE_DRIVER_NOT_INITIALIZED");
        assert!(status_name(5001).1.contains("allow_compat_mode"));
        assert_eq!(status_name(4242).0, "an unknown CUfileOpError");
    }

    #[test]
    fn properties_are_read_from_the_drivers_flags() {
        let raw = RawProps {
            nvfs_major: 2,
            nvfs_minor: 20,
            dstatusflags: (1 << 4) | (1 << 5),
            dcontrolflags: 1 << 1,
            fflags: 1 << 4,
            max_direct_io_size: 16384,
            max_device_cache_size: 131072,
            per_buffer_cache_size: 1024,
            ..RawProps::default()
        };
        let p = DriverProperties::from_raw(&raw);
        assert_eq!(p.nvfs_version, Some((2, 20)));
        assert!(p.compat_allowed && !p.posix_io_mode && !p.poll_mode && p.p2pdma);
        assert_eq!(p.supported, ["NVMe", "NVMe-oF"]);
        assert_eq!(p.max_direct_io_bytes, 16 << 20);
        assert_eq!(p.per_buffer_cache_bytes, 1 << 20);
        assert!(p.nvidia_fs());
        let compat = DriverProperties::from_raw(&RawProps {
            dcontrolflags: 1 << 1,
            ..RawProps::default()
        });
        assert_eq!(compat.nvfs_version, None);
        assert!(!compat.nvidia_fs());
        assert!(
            !DriverProperties::from_raw(&RawProps {
                nvfs_major: 2,
                dcontrolflags: 1 << 2,
                ..RawProps::default()
            })
            .nvidia_fs(),
            "POSIX mode"
        );
    }

    /// The per-GPU statistics entry is found by the GPU's UUID and kept only where its bytes
    /// read grew by what the load read; a UUID elsewhere (a decoy) or a growth that does not
    /// match is not taken.
    #[test]
    fn a_gpus_statistics_are_found_by_uuid_and_checked() {
        let uuid = *b"0123456789abcdef";
        let put = |words: &mut [u64], at_word: usize, bytes: u64, posix: u64, nvfs: u64| {
            let b: &mut [u8] = unsafe_bytes(words);
            b[at_word * 8..at_word * 8 + 16].copy_from_slice(&uuid);
            let c = at_word * 8 + 16;
            b[c..c + 8].copy_from_slice(&bytes.to_ne_bytes());
            b[c + 32..c + 40].copy_from_slice(&(posix + nvfs).to_ne_bytes());
            b[c + 48..c + 56].copy_from_slice(&nvfs.to_ne_bytes());
            b[c + 56..c + 64].copy_from_slice(&posix.to_ne_bytes());
        };
        let (mut before, mut after) = (vec![0u64; 512], vec![0u64; 512]);
        // A decoy whose count did not grow, and the real entry with earlier reads counted.
        put(&mut before, 10, 999, 1, 0);
        put(&mut after, 10, 999, 1, 0);
        put(&mut before, 100, 1 << 20, 2, 0);
        put(&mut after, 100, (1 << 20) + 4096 * 3 + 7, 6, 0);
        let (b, a) = (bytemuck_u64s(&before), bytemuck_u64s(&after));
        let counts = gpu_counts_delta(b, a, &uuid, 4096 * 3 + 7).expect("found");
        assert_eq!((counts.total, counts.posix, counts.nvfs), (4, 4, 0));
        assert_eq!(counts.path(), "compat (POSIX)");
        assert!(gpu_counts_delta(b, a, &uuid, 5).is_none());
        assert!(gpu_counts_delta(b, a, b"fedcba9876543210", 4096 * 3 + 7).is_none());
        // Counters that went down (a reset by someone else meanwhile) are not a difference.
        assert!(gpu_counts_delta(a, b, &uuid, 4096 * 3 + 7).is_none());
        // Path counters that add up to more than the total (a layout read wrongly): refused.
        put(&mut after, 100, (1 << 20) + 4096 * 3 + 7, 6, 9);
        unsafe_bytes(&mut after)[100 * 8 + 16 + 32..100 * 8 + 16 + 40]
            .copy_from_slice(&3u64.to_ne_bytes());
        let a = bytemuck_u64s(&after);
        assert!(gpu_counts_delta(b, a, &uuid, 4096 * 3 + 7).is_none());
    }

    /// The structures passed to cuFile have cufile.h's sizes (x86-64).
    #[test]
    fn structures_have_cufiles_layout() {
        assert_eq!(std::mem::size_of::<Status>(), 8);
        assert_eq!(std::mem::size_of::<RawProps>(), 56);
        assert_eq!(std::mem::offset_of!(RawProps, fflags), 32);
        assert_eq!(
            std::mem::offset_of!(RawProps, max_batch_io_timeout_msecs),
            52
        );
        assert_eq!(std::mem::size_of::<Descr>(), 24);
        assert_eq!(std::mem::offset_of!(Descr, handle), 8);
        assert_eq!(std::mem::offset_of!(Descr, fs_ops), 16);
    }

    fn unsafe_bytes(words: &mut [u64]) -> &mut [u8] {
        // SAFETY: u64s are plain bytes, 8 per word.
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), words.len() * 8) }
    }

    #[test]
    fn path_names() {
        let c = |p2pdma, nvfs, posix| PathCounts {
            total: p2pdma + nvfs + posix,
            p2pdma,
            nvfs,
            posix,
            bytes: 1,
        };
        assert_eq!(c(0, 0, 0).path(), "none");
        assert_eq!(c(0, 3, 0).path(), "nvidia-fs");
        assert_eq!(c(2, 0, 0).path(), "p2pdma");
        assert_eq!(c(0, 1, 1).path(), "mixed");
    }
}
