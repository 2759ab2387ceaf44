//! NCCL, loaded at run time: a communicator of one job's ranks on this machine
//! ([`NcclComm`]) and broadcasts into a replicated buffer while it is filled
//! ([`NcclBroadcasts`]), every wait bounded by a check of the other ranks.
//!
//! The library is opened on first use (`GPUFEED_NCCL_LIBRARY` if set, else `libnccl.so.2`,
//! the name NCCL's runtime packages — Debian's `libnccl2`, pip's `nvidia-nccl-cu*` as PyTorch
//! loads it — install, else `libnccl.so`): its absence is [`Error::NcclMissing`], never a
//! panic. (cudarc's `nccl` module is not used: its list of names lacks `libnccl.so.2`, and it
//! panics when none loads.) Communicators are non-blocking (`ncclConfig_t::blocking = 0`):
//! every call returns at once and this module polls `ncclCommGetAsyncError`, asking the
//! caller's check between polls whether the other ranks still live; when one is gone, the
//! communicator is aborted (`ncclCommAbort`, which stops its kernels) and the check's error
//! returned, instead of waiting forever for a peer that will never send.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaStream, CudaViewMut, DeviceSlice};

use crate::error::{Error, Result, driver};
use crate::gpu::Gpu;

/// The oldest NCCL this module drives: non-blocking communicators and `ncclCommFinalize`.
const OLDEST: c_int = 21400;
/// `ncclResult_t` values used here.
const NCCL_SUCCESS: c_int = 0;
const NCCL_INVALID_USAGE: c_int = 5;
const NCCL_IN_PROGRESS: c_int = 7;
/// `ncclUint8`.
const NCCL_UINT8: c_int = 1;
/// How long a communicator's teardown may take before it is aborted.
const FINALIZE_WAIT: Duration = Duration::from_secs(10);

/// An NCCL unique id (`ncclUniqueId`): made by one rank ([`NcclId::new`]), passed to the
/// others out of band (a gpufeed-ipc rendezvous), and given by every rank to
/// [`NcclComm::init`].
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct NcclId(pub [u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId(..)")
    }
}

impl NcclId {
    /// A new unique id (`ncclGetUniqueId`).
    ///
    /// # Errors
    /// [`Error::NcclMissing`], [`Error::Nccl`].
    pub fn new() -> Result<Self> {
        let lib = nccl()?;
        let mut id = NcclId([0; 128]);
        // SAFETY: `id` is a writable `ncclUniqueId` (128 bytes, `repr(C)`).
        check(lib, None, "ncclGetUniqueId", unsafe {
            (lib.get_unique_id)(&mut id)
        })?;
        Ok(id)
    }
}

/// The first fields of `ncclConfig_t` (NCCL 2.14's): NCCL copies at most `size` bytes and
/// keeps its defaults for the fields after them.
#[repr(C)]
struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
}

type Comm = *mut c_void;

/// NCCL's entry points used here, resolved once.
struct Nccl {
    _lib: libloading::Library,
    /// Which name or path loaded.
    name: String,
    version: c_int,
    get_unique_id: unsafe extern "C" fn(*mut NcclId) -> c_int,
    init_rank_config: unsafe extern "C" fn(*mut Comm, c_int, NcclId, c_int, *mut Config) -> c_int,
    get_async_error: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    finalize: unsafe extern "C" fn(Comm) -> c_int,
    destroy: unsafe extern "C" fn(Comm) -> c_int,
    abort: unsafe extern "C" fn(Comm) -> c_int,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    last_error: unsafe extern "C" fn(Comm) -> *const c_char,
}

/// The library names tried, in order: `GPUFEED_NCCL_LIBRARY` if set, else the runtime's
/// versioned name, then the development package's.
fn candidates() -> Vec<String> {
    crate::dynlib::candidates(
        std::env::var_os("GPUFEED_NCCL_LIBRARY"),
        &["libnccl.so.2", "libnccl.so"],
    )
}

impl Nccl {
    /// Opens the first of `names` that loads and resolves every entry point; else what was
    /// tried and why each failed.
    fn load(names: &[String]) -> std::result::Result<Self, String> {
        // SAFETY: the names are NCCL's (or the path the user gave for it); loading it runs
        // its initialisers, which only set up its own state.
        unsafe { crate::dynlib::open_first(names, Self::resolve) }
    }

    fn resolve(lib: libloading::Library, name: &str) -> std::result::Result<Self, String> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is NCCL's function of that name, whose C signature the
                // field's type spells out (nccl.h, stable since 2.14).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("not NCCL ({e})"))?
            };
        }
        let get_version: unsafe extern "C" fn(*mut c_int) -> c_int = sym!("ncclGetVersion");
        let mut version = 0;
        // SAFETY: `version` is a writable int.
        let r = unsafe { get_version(&mut version) };
        if r != NCCL_SUCCESS || version < OLDEST {
            return Err(format!(
                "NCCL {} is older than 2.14, which non-blocking communicators need",
                version_text(version)
            ));
        }
        Ok(Nccl {
            name: name.to_owned(),
            version,
            get_unique_id: sym!("ncclGetUniqueId"),
            init_rank_config: sym!("ncclCommInitRankConfig"),
            get_async_error: sym!("ncclCommGetAsyncError"),
            finalize: sym!("ncclCommFinalize"),
            destroy: sym!("ncclCommDestroy"),
            abort: sym!("ncclCommAbort"),
            broadcast: sym!("ncclBroadcast"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
            error_string: sym!("ncclGetErrorString"),
            last_error: sym!("ncclGetLastError"),
            _lib: lib,
        })
    }
}

/// `21805` as `2.18.5`.
fn version_text(v: c_int) -> String {
    format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
}

fn nccl() -> Result<&'static Nccl> {
    static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    match NCCL.get_or_init(|| Nccl::load(&candidates())) {
        Ok(n) => Ok(n),
        Err(tried) => Err(Error::NcclMissing {
            tried: tried.clone(),
        }),
    }
}

/// NCCL's version and the library that loaded, as `"2.28.3 (libnccl.so.2)"`.
///
/// # Errors
/// [`Error::NcclMissing`] saying what was tried and why each failed.
pub fn nccl_version() -> Result<String> {
    let lib = nccl()?;
    Ok(format!("{} ({})", version_text(lib.version), lib.name))
}

/// An error of NCCL call `op` that returned `r`, with NCCL's last message for `comm`.
fn nccl_error(lib: &Nccl, comm: Option<Comm>, op: &'static str, r: c_int) -> Error {
    let text = |p: *const c_char| {
        // SAFETY: NCCL returns NUL-terminated static or per-thread strings, or null.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    // SAFETY: takes any value (an unknown result gives a generic string).
    let name = text(unsafe { (lib.error_string)(r) }).unwrap_or_default();
    // SAFETY: a live communicator or null (NCCL reads the thread's last error either way).
    let last = text(unsafe { (lib.last_error)(comm.unwrap_or(std::ptr::null_mut())) })
        .filter(|s| !s.is_empty());
    Error::Nccl {
        op,
        result: r,
        message: match last {
            Some(last) => format!("{name}: {last}"),
            None => name,
        },
    }
}

/// `Ok` for success and in-progress (a non-blocking call that goes on), else the error.
fn check(lib: &Nccl, comm: Option<Comm>, op: &'static str, r: c_int) -> Result<()> {
    match r {
        NCCL_SUCCESS | NCCL_IN_PROGRESS => Ok(()),
        r => Err(nccl_error(lib, comm, op, r)),
    }
}

/// One rank's NCCL communicator (non-blocking) with a stream of its own for its collectives.
/// Dropping it finalizes and destroys it (aborting it if that takes over 10 s); after a failed
/// or abandoned collective it is aborted instead, and every later call fails.
pub struct NcclComm {
    lib: &'static Nccl,
    comm: Comm,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    broken: bool,
    /// Whether its setup has finished ([`NcclComm::start`] returns before).
    up: bool,
    /// When its setup must have finished.
    setup_deadline: Instant,
    /// How long callers blocked waiting for the setup.
    setup_waited: Duration,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time (`&mut self` for
// every call that uses it).
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("broken", &self.broken)
            .field("up", &self.up)
            .finish()
    }
}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world` on `gpu` (collective: every rank calls
    /// it with the same id). While it connects, `alive` is called every millisecond or so and
    /// its error returned (the communicator aborted) as soon as it gives one: pass a check
    /// that fails when another rank left or died (gpufeed-ipc's `Rendezvous::watch`). A
    /// communicator not up within `timeout` while every rank lives (ranks that cannot reach
    /// each other through NCCL's bootstrap sockets) is aborted too.
    ///
    /// # Errors
    /// [`Error::NcclMissing`]; [`Error::Nccl`] (two ranks on one GPU: `ncclInvalidUsage`; the
    /// timeout); `alive`'s.
    pub fn init<E: From<Error>>(
        gpu: &Gpu,
        id: &NcclId,
        rank: usize,
        world: usize,
        timeout: Duration,
        alive: impl FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<Self, E> {
        let mut me = Self::start(gpu, id, rank, world, timeout)?;
        me.until_up(alive)?;
        Ok(me)
    }

    /// [`NcclComm::init`] without waiting for the communicator to come up (its setup, 0.4-0.5
    /// s on the H200 machine, runs on NCCL's threads): broadcasts issued meanwhile are queued
    /// until it is up ([`NcclBroadcasts::round`]), and [`NcclBroadcasts::wait`] (or
    /// [`NcclComm::until_up`]) waits for it, watching the other ranks, at most until
    /// `timeout` from now.
    ///
    /// # Errors
    /// [`Error::NcclMissing`]; [`Error::Nccl`].
    pub fn start(
        gpu: &Gpu,
        id: &NcclId,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self> {
        driver()?;
        let lib = nccl()?;
        let ctx = gpu.context();
        ctx.bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| Error::cuda("cuStreamCreate", e))?;
        let mut config = Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: OLDEST as u32,
            blocking: 0,
        };
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are valid for the call; NCCL copies `config` and the id;
        // the GPU's context is current, so NCCL takes its device.
        let r = unsafe {
            (lib.init_rank_config)(&mut comm, world as c_int, *id, rank as c_int, &mut config)
        };
        if comm.is_null() {
            check(lib, None, "ncclCommInitRankConfig", r)?;
            return Err(Error::Nccl {
                op: "ncclCommInitRankConfig",
                result: r,
                message: "no communicator returned".into(),
            });
        }
        let mut me = NcclComm {
            lib,
            comm,
            stream,
            rank,
            world,
            broken: false,
            up: false,
            setup_deadline: Instant::now() + timeout,
            setup_waited: Duration::ZERO,
        };
        if let Err(e) = check(lib, Some(comm), "ncclCommInitRankConfig", r) {
            return Err(me.abort_with(e));
        }
        Ok(me)
    }

    /// Waits until the communicator is up (at once if it is), calling `alive` between polls.
    ///
    /// # Errors
    /// [`Error::Nccl`] (its setup failed, or did not finish within the timeout given to
    /// [`NcclComm::start`]); `alive`'s; the communicator is aborted.
    pub fn until_up<E: From<Error>>(
        &mut self,
        alive: impl FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if self.up {
            return Ok(());
        }
        self.usable()?;
        let t = Instant::now();
        let settled = self.settle("ncclCommInitRankConfig", alive, Some(self.setup_deadline));
        self.setup_waited += t.elapsed();
        settled?;
        self.up = true;
        Ok(())
    }

    /// Whether the communicator is up, without waiting.
    ///
    /// # Errors
    /// [`Error::Nccl`]: its setup failed (the communicator is aborted).
    fn poll_up(&mut self) -> Result<bool> {
        if !self.up {
            self.usable()?;
            match self.state("ncclCommInitRankConfig") {
                Ok(up) => self.up = up,
                Err(e) => return Err(self.abort_with(e)),
            }
        }
        Ok(self.up)
    }

    /// Whether the communicator's setup has finished (as far as the last call that looked
    /// knows).
    pub fn is_up(&self) -> bool {
        self.up
    }

    /// How long callers have blocked waiting for the communicator to come up (the part of
    /// its setup that nothing else overlapped).
    pub fn setup_waited(&self) -> Duration {
        self.setup_waited
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Whether the communicator was aborted (after a failed or abandoned collective): every
    /// later call fails; make a new one.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Broadcasts into `dst` (this rank's copy of a replicated buffer), round by round while
    /// it is filled. Waits for the work already enqueued on `dst`'s stream (its allocation).
    ///
    /// # Errors
    /// [`Error::Nccl`] for a broken communicator; [`Error::Cuda`].
    pub fn broadcasts<'a>(&'a mut self, dst: CudaViewMut<'a, u8>) -> Result<NcclBroadcasts<'a>> {
        self.usable()?;
        dst.stream()
            .synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
        Ok(NcclBroadcasts {
            comm: self,
            dst,
            pending: false,
            queued: Vec::new(),
        })
    }

    fn usable(&self) -> Result<()> {
        match self.broken {
            true => Err(Error::Nccl {
                op: "a collective",
                result: NCCL_INVALID_USAGE,
                message: "the communicator was aborted after an earlier failure; make a new one"
                    .into(),
            }),
            false => Ok(()),
        }
    }

    /// Polls until the communicator's last call has finished (`ncclCommGetAsyncError` no
    /// longer in progress), calling `alive` between polls, at most until `deadline`; aborts
    /// on any error.
    fn settle<E: From<Error>>(
        &mut self,
        op: &'static str,
        mut alive: impl FnMut() -> std::result::Result<(), E>,
        deadline: Option<Instant>,
    ) -> std::result::Result<(), E> {
        let started = Instant::now();
        let mut nap = Duration::from_micros(20);
        loop {
            match self.state(op) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.abort_with(e.into())),
            }
            if let Err(e) = alive() {
                return Err(self.abort_with(e));
            }
            if deadline.is_some_and(|d| Instant::now() > d) {
                let e = Error::Nccl {
                    op,
                    result: NCCL_IN_PROGRESS,
                    message: format!(
                        "not done after {:.1} s while every rank lives: the ranks cannot reach \
                         each other through NCCL's bootstrap sockets (separate network \
                         namespaces? NCCL_SOCKET_IFNAME); replicate without NCCL (shared \
                         staging needs only a shared /dev/shm)",
                        started.elapsed().as_secs_f64()
                    ),
                };
                return Err(self.abort_with(e.into()));
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }

    /// `true` once the last call finished, `false` while in progress.
    fn state(&self, op: &'static str) -> Result<bool> {
        let mut state = NCCL_IN_PROGRESS;
        // SAFETY: a live communicator and a writable result.
        let r = unsafe { (self.lib.get_async_error)(self.comm, &mut state) };
        check(self.lib, Some(self.comm), "ncclCommGetAsyncError", r)?;
        match state {
            NCCL_SUCCESS => Ok(true),
            NCCL_IN_PROGRESS => Ok(false),
            s => Err(nccl_error(self.lib, Some(self.comm), op, s)),
        }
    }

    /// Aborts the communicator (its kernels stop) and waits for its stream, then returns `e`.
    fn abort_with<E>(&mut self, e: E) -> E {
        self.abort();
        e
    }

    fn abort(&mut self) {
        if self.broken {
            return;
        }
        self.broken = true;
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: a live communicator, not used again after this (`broken`).
        let r = unsafe { (self.lib.abort)(self.comm) };
        if r != NCCL_SUCCESS {
            tracing::warn!("ncclCommAbort returned {r}");
        }
        // Nothing of the aborted collectives runs on after this.
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!("waiting for an aborted NCCL stream: {e}");
        }
        self.comm = std::ptr::null_mut();
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.broken || self.comm.is_null() {
            return;
        }
        // Still coming up (or never seen up): nothing of it is worth finalizing.
        if !self.up && !self.poll_up().unwrap_or(false) {
            self.abort();
            return;
        }
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: a live communicator with nothing in flight (every collective was waited for
        // or aborted), not used after this.
        let r = unsafe { (self.lib.finalize)(self.comm) };
        let started = Instant::now();
        let finalized = check(self.lib, Some(self.comm), "ncclCommFinalize", r).and_then(|()| {
            while !self.state("ncclCommFinalize")? {
                if started.elapsed() > FINALIZE_WAIT {
                    return Err(Error::Nccl {
                        op: "ncclCommFinalize",
                        result: NCCL_IN_PROGRESS,
                        message: format!("not done after {} s", FINALIZE_WAIT.as_secs()),
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(())
        });
        match finalized {
            Ok(()) => {
                // SAFETY: finalized; destroyed once.
                let r = unsafe { (self.lib.destroy)(self.comm) };
                if r != NCCL_SUCCESS {
                    tracing::warn!("ncclCommDestroy returned {r}");
                }
            }
            Err(e) => {
                tracing::warn!("aborting an NCCL communicator that did not finalize: {e}");
                self.abort();
            }
        }
    }
}

/// Broadcasts between the ranks into one buffer (each rank's copy of a replicated buffer)
/// while parts of it are filled: [`NcclBroadcasts::dst_mut`] for this rank's own parts,
/// [`NcclBroadcasts::round`] to send each rank's part of a round to every other rank (one
/// NCCL group of broadcasts, each rank the root of its own part, in place). Rounds run on the
/// communicator's stream in order while the caller fills the next one. The buffer stays
/// borrowed until [`NcclBroadcasts::wait`] has seen every round complete; dropping it with
/// rounds in flight aborts the communicator (nothing writes into the buffer after the drop).
pub struct NcclBroadcasts<'a> {
    comm: &'a mut NcclComm,
    dst: CudaViewMut<'a, u8>,
    pending: bool,
    /// Rounds given before the communicator was up, in order.
    queued: Vec<Vec<(usize, std::ops::Range<usize>)>>,
}

impl std::fmt::Debug for NcclBroadcasts<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBroadcasts")
            .field("len", &self.dst.len())
            .field("pending", &self.pending)
            .field("queued", &self.queued.len())
            .finish()
    }
}

impl NcclBroadcasts<'_> {
    /// `range` of the buffer, to fill (this rank's part of a round) before its round.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn dst_mut(&mut self, range: std::ops::Range<usize>) -> Result<CudaViewMut<'_, u8>> {
        crate::peer::part_mut(&mut self.dst, range)
    }

    /// One round: for every `(root, range)` of `parts`, rank `root`'s bytes at `range` of its
    /// buffer are sent into `range` of every other rank's (every rank passes the same parts,
    /// and its own are in its buffer by now). Returns once the round is enqueued, calling
    /// `alive` while NCCL connects (the first round) or is otherwise busy; or, while the
    /// communicator is still coming up ([`NcclComm::start`]), at once with the round queued
    /// (issued, in order, by the first call that finds it up, or by `wait`).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for a part outside the buffer or a root that is no rank;
    /// [`Error::Nccl`] (the communicator aborted); `alive`'s (aborted too).
    pub fn round<E: From<Error>>(
        &mut self,
        parts: &[(usize, std::ops::Range<usize>)],
        mut alive: impl FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        self.comm.usable()?;
        let (len, world) = (self.dst.len(), self.comm.world);
        for (root, range) in parts {
            if *root >= world || range.start > range.end || range.end > len {
                return Err(Error::OutOfBounds {
                    len: range.end.saturating_sub(range.start) as u64,
                    offset: range.start as u64,
                    capacity: len as u64,
                }
                .into());
            }
        }
        self.pending = true;
        self.queued.push(parts.to_vec());
        if self.comm.poll_up()? {
            self.flush(&mut alive)?;
        }
        Ok(())
    }

    /// Issues the queued rounds, in order (the communicator is up).
    fn flush<E: From<Error>>(
        &mut self,
        mut alive: impl FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        for parts in std::mem::take(&mut self.queued) {
            self.issue(&parts, &mut alive)?;
        }
        Ok(())
    }

    /// One round's group of broadcasts, enqueued on the communicator's stream.
    fn issue<E: From<Error>>(
        &mut self,
        parts: &[(usize, std::ops::Range<usize>)],
        alive: impl FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        use cudarc::driver::DevicePtrMut;
        let comm = &mut *self.comm;
        let lib = comm.lib;
        comm.stream
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // A raw pointer, as `PeerGather` takes it: the buffer's events would order every fill
        // of its other parts after these broadcasts.
        let stream = Arc::clone(&comm.stream);
        let (base, guard) = self.dst.device_ptr_mut(&stream);
        std::mem::forget(guard);
        // SAFETY: no arguments.
        let mut result = check(lib, Some(comm.comm), "ncclGroupStart", unsafe {
            (lib.group_start)()
        });
        for (root, range) in parts.iter().filter(|(_, r)| !r.is_empty()) {
            if result.is_err() {
                break;
            }
            let at = (base + range.start as u64) as *mut c_void;
            // SAFETY: `range` lies inside the buffer (checked above), which `self` borrows
            // until `wait` has seen this round complete (or the drop aborted it); in place:
            // the root sends from and every rank receives into the same bytes.
            result = check(lib, Some(comm.comm), "ncclBroadcast", unsafe {
                (lib.broadcast)(
                    at,
                    at,
                    range.len(),
                    NCCL_UINT8,
                    *root as c_int,
                    comm.comm,
                    comm.stream.cu_stream().cast(),
                )
            });
        }
        // Every group started is ended, whatever happened inside it.
        // SAFETY: no arguments.
        let ended = check(lib, Some(comm.comm), "ncclGroupEnd", unsafe {
            (lib.group_end)()
        });
        if let Err(e) = result.and(ended) {
            return Err(comm.abort_with(e.into()));
        }
        comm.settle("ncclBroadcast", alive, None)
    }

    /// Waits until every round has completed on this GPU (its parts sent, the others'
    /// received), calling `alive` between polls: first for the communicator to come up and
    /// the queued rounds to be issued, then for its stream.
    ///
    /// # Errors
    /// [`Error::Nccl`], [`Error::Cuda`] (the communicator aborted); `alive`'s (aborted too).
    pub fn wait<E: From<Error>>(
        &mut self,
        mut alive: impl FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if !self.pending {
            return Ok(());
        }
        self.comm.until_up(&mut alive)?;
        self.flush(&mut alive)?;
        let mut nap = Duration::from_micros(20);
        loop {
            let comm = &mut *self.comm;
            // SAFETY: the communicator's own live stream; its context is current (bound by
            // `round`, on this thread).
            match unsafe { crate::raw::stream_done(comm.stream.cu_stream()) } {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => return Err(comm.abort_with(e.into())),
            }
            if let Err(e) = comm.state("ncclBroadcast") {
                return Err(comm.abort_with(e.into()));
            }
            if let Err(e) = alive() {
                return Err(comm.abort_with(e));
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_micros(500));
        }
        self.pending = false;
        Ok(())
    }
}

impl Drop for NcclBroadcasts<'_> {
    fn drop(&mut self) {
        if self.pending && !self.comm.broken {
            tracing::warn!("NCCL broadcasts dropped before they were waited for: aborting them");
            self.comm.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_that_is_missing_or_not_nccl_is_a_clear_error() {
        let names = vec![
            "/nonexistent/libnccl.so.2".to_owned(),
            "libc.so.6".to_owned(), // loads, but has no NCCL in it
        ];
        let tried = Nccl::load(&names).err().expect("neither is NCCL");
        let text = Error::NcclMissing { tried }.to_string();
        assert!(text.contains("/nonexistent/libnccl.so.2"), "{text}");
        assert!(text.contains("libc.so.6: not NCCL"), "{text}");
        assert!(
            text.contains("GPUFEED_NCCL_LIBRARY"),
            "says what to do: {text}"
        );
    }

    #[test]
    fn versions_read_as_nccl_writes_them() {
        assert_eq!(version_text(22803), "2.28.3");
        assert_eq!(version_text(21400), "2.14.0");
    }
}
