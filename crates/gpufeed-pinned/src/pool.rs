//! A pool of page-locked buffers in size classes, on one NUMA node, within a byte budget.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys};
use gpufeed_os::{AlignedBuf, LockedRegion, lock};
use parking_lot::Mutex;

use crate::HostRegistration;
use crate::buffer::PinnedBuffer;
use crate::error::{Error, Result};

/// Smallest size class (64 KiB).
pub const MIN_CLASS: usize = 64 << 10;
/// Largest size class (256 MiB).
pub const MAX_CLASS: usize = 256 << 20;

/// Where the pool's memory comes from.
#[derive(Clone)]
#[non_exhaustive]
pub enum PoolMode {
    /// Page-locked memory of this context the GPU copies from at full speed: aligned memory
    /// registered with `cuMemHostRegister` (several times cheaper to set up than
    /// `cuMemHostAlloc`, which is the fallback, noted, where registration is refused).
    Cuda(Arc<CudaContext>),
    /// No CUDA driver: `mlock`ed aligned buffers within `RLIMIT_MEMLOCK` (unlocked past it, with
    /// the reason recorded), so that CPU pipelines run the same code.
    Cpu,
}

impl std::fmt::Debug for PoolMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PoolMode::Cuda(ctx) => write!(f, "Cuda(device {})", ctx.ordinal()),
            PoolMode::Cpu => write!(f, "Cpu"),
        }
    }
}

/// Settings of a [`PinnedPool`]: start from the default and change what you need (new settings
/// may be added).
///
/// ```
/// let cfg = gpufeed_pinned::PoolOptions::default().with_budget_bytes(Some(64 << 20));
/// assert_eq!(cfg.budget_bytes, Some(64 << 20));
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct PoolOptions {
    /// Most bytes the pool holds at once (handed out plus cached). Default: a quarter of RAM.
    pub budget_bytes: Option<u64>,
    /// The NUMA node to place buffers on (the GPU's, from `gpufeed-cuda`'s `GpuInfo`): buffers
    /// are allocated by a thread bound to that node, so their pages land there.
    pub numa_node: Option<u32>,
    /// Where every cached buffer of the size asked for is still read by a copy: allocate
    /// another (within the budget) rather than wait for the oldest copy (default off: wait).
    /// For callers whose copies are in flight while they fill the next buffer and whom the
    /// wait would hold up behind other threads' copies. The batch loader's workers are such
    /// callers, yet measured slower with it (64 KiB records 29-36 GB/s against 40-44
    /// waiting, GPU run 196), so they wait.
    pub grow_when_busy: bool,
}

impl PoolOptions {
    /// These settings with `budget_bytes` (most bytes held at once; `None`: a quarter of RAM).
    pub fn with_budget_bytes(mut self, budget_bytes: Option<u64>) -> Self {
        self.budget_bytes = budget_bytes;
        self
    }

    /// These settings with `numa_node` (the node buffers are placed on).
    pub fn with_numa_node(mut self, numa_node: Option<u32>) -> Self {
        self.numa_node = numa_node;
        self
    }

    /// These settings with `grow_when_busy` (allocate rather than wait for a busy buffer).
    pub fn with_grow_when_busy(mut self, grow: bool) -> Self {
        self.grow_when_busy = grow;
        self
    }
}

/// Counters of a pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers allocated from the driver or the kernel.
    pub allocations: u64,
    /// `get`s served from the cache.
    pub reuses: u64,
    /// Buffers freed to make room for another size class.
    pub evictions: u64,
    /// Bytes held now (handed out plus cached).
    pub held_bytes: u64,
    /// Bytes handed out now.
    pub in_use_bytes: u64,
    /// CPU mode: buffers that could not be locked (memlock limit).
    pub unlocked_buffers: u64,
}

enum Memory {
    Pinned(PinnedBuffer),
    /// Page-aligned memory faulted in by the allocating thread and registered with
    /// `cuMemHostRegister`: page-locked like `cuMemHostAlloc` memory, for a fraction of its
    /// cost (on the H200 machine 32 staging buffers of 4 MiB took 70-97 ms from
    /// `cuMemHostAlloc`, which a new loader's first load waited for; docs/benchmarks.md).
    Registered {
        // Dropped before `buf`: unregistered while the memory is still mapped.
        #[allow(dead_code, reason = "held for its Drop, which unregisters the memory")]
        reg: HostRegistration<'static>,
        buf: AlignedBuf,
    },
    Cpu {
        // Dropped before `buf`: munlock while the memory is still mapped.
        lock: Option<LockedRegion<'static>>,
        buf: AlignedBuf,
    },
    /// One size-class piece of a [`HostSlab`] reserved with [`PinnedPool::reserve_slab`]: many
    /// buffers, one registration (or one `mlock`).
    Slab {
        slab: Arc<Slab>,
        offset: usize,
    },
}

/// A reserved slab: page-locked once, shared by the buffers cut from it; unlocked and unmapped
/// when the last of them is freed.
struct Slab {
    // Dropped before `buf`: unregistered (or munlocked) while the memory is still mapped.
    #[allow(dead_code, reason = "held for its Drop, which unregisters the memory")]
    reg: Option<HostRegistration<'static>>,
    lock: Option<LockedRegion<'static>>,
    buf: AlignedBuf,
}

impl Memory {
    fn ptr(&mut self) -> *mut u8 {
        match self {
            Memory::Pinned(p) => p.as_mut_ptr(),
            Memory::Registered { buf, .. } | Memory::Cpu { buf, .. } => buf.as_mut_ptr(),
            // SAFETY: `offset + class <= buf.len()` (cut in reserve_slab).
            Memory::Slab { slab, offset } => unsafe { slab.buf.as_ptr().add(*offset).cast_mut() },
        }
    }

    fn const_ptr(&self) -> *const u8 {
        match self {
            Memory::Pinned(p) => p.as_ptr(),
            Memory::Registered { buf, .. } | Memory::Cpu { buf, .. } => buf.as_ptr(),
            // SAFETY: as in ptr.
            Memory::Slab { slab, offset } => unsafe { slab.buf.as_ptr().add(*offset) },
        }
    }
}

/// Page-aligned host memory faulted in ahead of time (transparent huge pages advised), to be
/// page-locked later as a pool's buffers with [`PinnedPool::reserve_slab`]. Making one needs no
/// CUDA context, so it can run while another thread creates the context: faulting fresh memory
/// in is most of what pinned staging costs (128 MiB took 13-24 ms on the H200 machine, against
/// 2.4-4.5 ms to register it afterwards in one call; docs/benchmarks.md, GPU run 8).
///
/// # Example
/// ```
/// use gpufeed_pinned::{HostSlab, PinnedPool, PoolOptions, PoolMode};
/// let slab = HostSlab::new(8 << 20)?; // faulted in here
/// let pool = PinnedPool::new(PoolMode::Cpu, PoolOptions::default())?;
/// assert_eq!(pool.reserve_slab(slab, 1 << 20)?, 8); // eight 1 MiB buffers, one mlock
/// let buf = pool.get(1 << 20)?; // no allocation
/// assert_eq!(pool.stats().reuses, 1);
/// # drop(buf);
/// # Ok::<(), gpufeed_pinned::Error>(())
/// ```
pub struct HostSlab {
    buf: AlignedBuf,
}

impl std::fmt::Debug for HostSlab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSlab")
            .field("len", &self.buf.len())
            .finish()
    }
}

impl HostSlab {
    /// `len` bytes (rounded up to whole pages), 2 MiB aligned, faulted in by this thread.
    ///
    /// # Errors
    /// [`gpufeed_os::Error::ZeroLength`], [`gpufeed_os::Error::OutOfMemory`].
    pub fn new(len: usize) -> Result<Self> {
        Self::new_widening(len, 1, || false)
    }

    /// [`HostSlab::new`], faulted in by this thread alone until `widen()` says otherwise
    /// (asked before each 4 MiB piece), then by up to `threads` threads together (this one
    /// included): a loader faults its staging in alone while another thread creates the
    /// GPU's context, whose `mmap` calls the faults would hold off, and on all hands once the
    /// context is there (at once where the process had it already: 128 MiB took 19-29 ms on
    /// one thread of the H200 machine). A thread that cannot be started leaves its share to
    /// the others.
    ///
    /// # Errors
    /// As [`HostSlab::new`].
    pub fn new_widening(len: usize, threads: usize, widen: impl Fn() -> bool) -> Result<Self> {
        let len = len.next_multiple_of(gpufeed_os::page_size());
        let buf = AlignedBuf::new(len, 2 << 20)?;
        // In pieces: MADV_POPULATE_WRITE holds the address space's lock while it runs, which
        // would hold off the mmap calls of a thread creating a CUDA context meanwhile. A
        // failure (an old kernel without it) only leaves the faulting to the first writer or
        // to the registration.
        const PIECE: usize = 4 << 20;
        let base = buf.as_ptr() as usize;
        let pieces = len.div_ceil(PIECE);
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        // Faults piece after piece until none is left (or one failed); `alone` stops after
        // one piece.
        let fault = |alone: bool| {
            while !failed.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= pieces {
                    return;
                }
                let at = i * PIECE;
                let n = PIECE.min(len - at);
                // `at < len`: inside the buffer, which outlives every faulting thread.
                if gpufeed_os::advise::madvise(
                    (base + at) as *const u8,
                    n,
                    gpufeed_os::advise::MemAdvice::PopulateWrite,
                )
                .is_err()
                {
                    failed.store(true, Ordering::Relaxed);
                }
                if alone {
                    return;
                }
            }
        };
        while next.load(Ordering::Relaxed) < pieces && !failed.load(Ordering::Relaxed) {
            if threads > 1 && widen() {
                std::thread::scope(|s| {
                    let left = pieces.saturating_sub(next.load(Ordering::Relaxed));
                    for _ in 1..threads.min(left) {
                        let spawned = std::thread::Builder::new()
                            .name("gpufeed-fault".into())
                            .spawn_scoped(s, || fault(false));
                        if spawned.is_err() {
                            break;
                        }
                    }
                    fault(false);
                });
                break;
            }
            fault(true);
        }
        Ok(HostSlab { buf })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Always false (a slab has at least one page).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

struct Entry {
    mem: Memory,
    class: usize,
    /// Recorded after the last copy that used the buffer; waited for before reuse.
    pending: Option<CudaEvent>,
    pending_recorded: bool,
}

impl Entry {
    /// Whether a copy recorded on the buffer may still run (an event that fails its query
    /// counts as done: `wait_idle` reports its error). A copy found complete is forgotten, so
    /// that `wait_idle` does not ask the driver again.
    fn busy(&mut self) -> bool {
        let Some(ev) = self.pending.as_ref().filter(|_| self.pending_recorded) else {
            return false;
        };
        match ev.try_is_complete() {
            Ok(false) => true,
            Ok(true) => {
                self.pending_recorded = false;
                false
            }
            Err(_) => false,
        }
    }

    fn wait_idle(&mut self) -> Result<()> {
        if let (Some(ev), true) = (&self.pending, self.pending_recorded) {
            ev.synchronize()
                .map_err(|e| Error::cuda("cuEventSynchronize", e))?;
            self.pending_recorded = false;
        }
        Ok(())
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        // Never free memory a copy may still read or write.
        if let Err(e) = self.wait_idle() {
            tracing::warn!(error = %e, "waiting for a pooled buffer's last copy failed");
        }
    }
}

struct State {
    free: BTreeMap<usize, Vec<Entry>>,
    stats: PoolStats,
}

struct Inner {
    mode: PoolMode,
    budget: u64,
    grow_when_busy: bool,
    node: Option<u32>,
    topology: Option<gpufeed_numa::Topology>,
    state: Mutex<State>,
    notes: Mutex<Vec<String>>,
}

/// Page-locked buffers in power-of-two size classes from 64 KiB to 256 MiB, reused through
/// [`PooledBuffer`] guards, within a byte budget, placed on one NUMA node.
///
/// A buffer comes back to the pool when its guard drops; if a copy was recorded on it
/// ([`PooledBuffer::record_use`]), the next `get` of it first waits for that copy, so a buffer is
/// never handed out while the GPU still reads it.
///
/// # Example (CPU mode, runs anywhere)
/// ```
/// use gpufeed_pinned::{PinnedPool, PoolOptions, PoolMode};
/// let pool = PinnedPool::new(PoolMode::Cpu, PoolOptions::default())?;
/// let mut buf = pool.get(100_000)?; // a 128 KiB class buffer, 100 000 bytes visible
/// buf[0] = 1;
/// drop(buf); // back to the pool
/// let again = pool.get(70_000)?; // the same buffer, no allocation
/// assert_eq!(pool.stats().allocations, 1);
/// # Ok::<(), gpufeed_pinned::Error>(())
/// ```
#[derive(Clone)]
pub struct PinnedPool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPool")
            .field("mode", &self.inner.mode)
            .field("budget", &self.inner.budget)
            .field("node", &self.inner.node)
            .field("stats", &self.stats())
            .finish()
    }
}

impl PinnedPool {
    /// A pool in `mode` with `config`.
    ///
    /// # Errors
    /// [`Error::NoCudaDriver`] for [`PoolMode::Cuda`] without a driver.
    pub fn new(mode: PoolMode, config: PoolOptions) -> Result<Self> {
        if matches!(mode, PoolMode::Cuda(_)) {
            crate::driver_available()?;
        }
        let mut notes = Vec::new();
        let budget = config.budget_bytes.unwrap_or_else(|| {
            gpufeed_os::SystemInfo::read()
                .mem_total
                .map(|t| t / 4)
                .unwrap_or(4 << 30)
        });
        let topology = match config.numa_node {
            None => None,
            Some(node) => match gpufeed_numa::Topology::detect() {
                Ok(t) if t.node(node).is_ok() => Some(t),
                Ok(_) => {
                    notes.push(format!(
                        "NUMA node {node} does not exist here; buffers are not placed"
                    ));
                    None
                }
                Err(e) => {
                    notes.push(format!(
                        "NUMA topology unreadable ({e}); buffers are not placed"
                    ));
                    None
                }
            },
        };
        Ok(PinnedPool {
            inner: Arc::new(Inner {
                mode,
                budget,
                grow_when_busy: config.grow_when_busy,
                node: config.numa_node,
                topology,
                state: Mutex::new(State {
                    free: BTreeMap::new(),
                    stats: PoolStats::default(),
                }),
                notes: Mutex::new(notes),
            }),
        })
    }

    /// A pool on the GPU's context if a CUDA driver is present, else a CPU-mode pool; the
    /// choice is recorded in [`PinnedPool::notes`].
    pub fn for_context_or_cpu(ctx: Option<&Arc<CudaContext>>, config: PoolOptions) -> Result<Self> {
        match ctx {
            Some(ctx) if crate::driver_available().is_ok() => {
                Self::new(PoolMode::Cuda(Arc::clone(ctx)), config)
            }
            _ => {
                let pool = Self::new(PoolMode::Cpu, config)?;
                pool.note(
                    "no CUDA context: CPU mode (mlocked buffers, not pinned by the driver)".into(),
                );
                Ok(pool)
            }
        }
    }

    /// A buffer of at least `len` bytes (its size class), showing exactly `len` bytes.
    ///
    /// # Errors
    /// [`Error::TooLarge`] past 256 MiB, [`Error::PoolExhausted`] when the budget is spent,
    /// allocation errors.
    pub fn get(&self, len: usize) -> Result<PooledBuffer> {
        let class = Self::class_of(len)?;
        let cached = {
            let mut st = self.inner.state.lock();
            // The idle buffer given back last (its pages the likeliest still in the CPU's
            // caches: taking the oldest instead rotated a loader's small loads through all its
            // staging, and 1 MiB loads took 171-256 us against 102-141, GPU runs 193-194);
            // where every one is still read by a copy, the oldest (its copy began first) — or,
            // growing, none, unless another buffer would not fit the budget without evicting
            // one.
            let grow = self.inner.grow_when_busy
                && st.stats.held_bytes + class as u64 <= self.inner.budget;
            let cached = st.free.get_mut(&class).and_then(|free| {
                match free.iter_mut().rposition(|e| !e.busy()) {
                    Some(i) => Some(free.remove(i)),
                    None if grow || free.is_empty() => None,
                    None => Some(free.remove(0)),
                }
            });
            if cached.is_some() {
                st.stats.reuses += 1;
            } else {
                self.make_room(&mut st, class as u64)?;
                st.stats.held_bytes += class as u64;
            }
            st.stats.in_use_bytes += class as u64;
            cached
        };
        let entry = match cached {
            Some(mut e) => match e.wait_idle() {
                Ok(()) => e,
                Err(err) => {
                    // Last in line (the others are tried first), not first as a buffer given
                    // back after use would be.
                    self.inner.give_back(e, true);
                    return Err(err);
                }
            },
            None => match self.allocate(class) {
                Ok(e) => e,
                Err(err) => {
                    let mut st = self.inner.state.lock();
                    st.stats.held_bytes -= class as u64;
                    st.stats.in_use_bytes -= class as u64;
                    return Err(err);
                }
            },
        };
        Ok(PooledBuffer {
            entry: Some(entry),
            len,
            pool: Arc::clone(&self.inner),
        })
    }

    /// Frees cached buffers of other classes until `class` more bytes fit the budget.
    fn make_room(&self, st: &mut State, class: u64) -> Result<()> {
        while st.stats.held_bytes + class > self.inner.budget {
            // The oldest of a class: the coldest in the CPU's caches, the likeliest idle.
            let victim = st
                .free
                .iter_mut()
                .rev()
                .find_map(|(_, v)| (!v.is_empty()).then(|| v.remove(0)));
            match victim {
                Some(e) => {
                    st.stats.held_bytes -= e.class as u64;
                    st.stats.evictions += 1;
                    drop(e);
                }
                None => {
                    return Err(Error::PoolExhausted {
                        requested: class,
                        in_use: st.stats.in_use_bytes,
                        budget: self.inner.budget,
                    });
                }
            }
        }
        Ok(())
    }

    fn allocate(&self, class: usize) -> Result<Entry> {
        let _bound = self.bind_to_node();
        let mem = match &self.inner.mode {
            PoolMode::Cuda(ctx) => match registered(ctx, class) {
                Ok(m) => m,
                Err(e) => {
                    self.note(format!(
                        "staging memory could not be registered ({e}); cuMemHostAlloc instead"
                    ));
                    Memory::Pinned(PinnedBuffer::new(ctx, class)?)
                }
            },
            PoolMode::Cpu => {
                let buf = AlignedBuf::new(class, 4096)?;
                // First touch here, on the bound thread, puts the pages on its node.
                let _ = gpufeed_os::advise::madvise(
                    buf.as_ptr(),
                    class,
                    gpufeed_os::advise::MemAdvice::PopulateWrite,
                );
                // SAFETY: `buf` is stored next to the lock in `Memory::Cpu`, declared after it,
                // so it stays mapped until the lock has been dropped.
                let lock = match unsafe { lock::mlock_raw(buf.as_ptr(), class) } {
                    Ok(l) => Some(l),
                    Err(e) => {
                        self.note(format!("buffer of {class} bytes left unlocked: {e}"));
                        self.inner.state.lock().stats.unlocked_buffers += 1;
                        None
                    }
                };
                Memory::Cpu { lock, buf }
            }
        };
        self.inner.state.lock().stats.allocations += 1;
        Ok(Entry {
            mem,
            class,
            pending: None,
            pending_recorded: false,
        })
    }

    /// Puts `count` buffers of `len`'s size class into the pool's cache, cut from one slab
    /// faulted in on the pool's NUMA node (by this thread there; elsewhere by up to 8 threads)
    /// and page-locked with one call: later `get`s of that
    /// class are served without allocating. One registration of the whole slab costs a
    /// fraction of one per buffer (each `cuMemHostRegister` call costs about 1 ms on the H200
    /// machine, whatever its size, and holds off copies that other threads issue meanwhile).
    ///
    /// # Errors
    /// As [`PinnedPool::reserve_slab`].
    pub fn reserve(&self, len: usize, count: usize) -> Result<usize> {
        let class = Self::class_of(len)?;
        let bytes = class.checked_mul(count).ok_or(Error::TooLarge {
            requested: usize::MAX,
            max: MAX_CLASS,
        })?;
        if bytes == 0 {
            return Ok(0);
        }
        let bound = self.bind_to_node();
        // Placed on a node: faulted by this (bound) thread alone, so every page lands there.
        let threads = if bound.is_some() {
            1
        } else {
            std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
        };
        self.reserve_slab(HostSlab::new_widening(bytes, threads, || true)?, len)
    }

    /// Cuts `slab` into buffers of `len`'s size class, page-locks it with one call (registered
    /// read-write with CUDA in [`PoolMode::Cuda`]; `mlock`ed, or left unlocked and noted past
    /// `RLIMIT_MEMLOCK`, in [`PoolMode::Cpu`]) and caches them; returns how many. The slab is
    /// freed when the last of its buffers is (trimmed or evicted, or the pool dropped).
    ///
    /// # Errors
    /// [`Error::TooLarge`] past 256 MiB, [`Error::PoolExhausted`] when the slab does not fit
    /// the budget, [`Error::Cuda`] when the driver refuses the registration (nothing is kept).
    pub fn reserve_slab(&self, slab: HostSlab, len: usize) -> Result<usize> {
        let class = Self::class_of(len)?;
        let count = slab.len() / class;
        if count == 0 {
            return Ok(0);
        }
        let bytes = (class * count) as u64;
        {
            let mut st = self.inner.state.lock();
            self.make_room(&mut st, bytes)?;
            st.stats.held_bytes += bytes;
        }
        let locked = match &self.inner.mode {
            PoolMode::Cuda(ctx) => {
                // SAFETY: the slab's buffer is stored after the registration in `Slab`, so it
                // stays mapped until the registration has been dropped; read-write, since the
                // GPU may copy into pooled buffers (downloads).
                let reg = unsafe {
                    HostRegistration::register(ctx, slab.buf.as_ptr(), slab.len(), false)
                };
                reg.map(|reg| (Some(reg), None))
            }
            PoolMode::Cpu => {
                // SAFETY: as above, for the lock.
                match unsafe { lock::mlock_raw(slab.buf.as_ptr(), slab.len()) } {
                    Ok(l) => Ok((None, Some(l))),
                    Err(e) => {
                        self.note(format!(
                            "a reserved slab of {} bytes left unlocked: {e}",
                            slab.len()
                        ));
                        self.inner.state.lock().stats.unlocked_buffers += count as u64;
                        Ok((None, None))
                    }
                }
            }
        };
        let (reg, lock) = match locked {
            Ok(l) => l,
            Err(e) => {
                self.inner.state.lock().stats.held_bytes -= bytes;
                return Err(e);
            }
        };
        let slab = Arc::new(Slab {
            reg,
            lock,
            buf: slab.buf,
        });
        let mut st = self.inner.state.lock();
        st.stats.allocations += 1;
        let free = st.free.entry(class).or_default();
        for i in 0..count {
            free.push(Entry {
                mem: Memory::Slab {
                    slab: Arc::clone(&slab),
                    offset: i * class,
                },
                class,
                pending: None,
                pending_recorded: false,
            });
        }
        Ok(count)
    }

    /// The size class of a `len`-byte request.
    fn class_of(len: usize) -> Result<usize> {
        if len == 0 {
            return Err(gpufeed_os::Error::ZeroLength {
                what: "pooled buffer",
            }
            .into());
        }
        if len > MAX_CLASS {
            return Err(Error::TooLarge {
                requested: len,
                max: MAX_CLASS,
            });
        }
        Ok(len.next_power_of_two().max(MIN_CLASS))
    }

    /// Binds the calling thread to the pool's NUMA node while the guard lives (so the pages it
    /// faults in land there); a refusal is noted and the thread stays unbound.
    fn bind_to_node(&self) -> Option<gpufeed_numa::ThreadBinding> {
        match (&self.inner.topology, self.inner.node) {
            (Some(t), Some(node)) => match t.bind_thread(node) {
                Ok(b) => Some(b),
                Err(e) => {
                    self.note(format!("could not allocate on NUMA node {node}: {e}"));
                    None
                }
            },
            _ => None,
        }
    }
}

/// `class` bytes of page-aligned memory, faulted in here (on the bound thread, so on its NUMA
/// node) and registered with CUDA read-write.
fn registered(ctx: &Arc<CudaContext>, class: usize) -> Result<Memory> {
    let buf = AlignedBuf::new(class, 4096)?;
    // Faulting the pages in here is cheaper than letting the driver fault them one by one
    // while it registers them; a failure only leaves that work to the driver.
    let _ = gpufeed_os::advise::madvise(
        buf.as_ptr(),
        class,
        gpufeed_os::advise::MemAdvice::PopulateWrite,
    );
    // SAFETY: `buf` is stored next to the registration in `Memory::Registered`, declared after
    // it, so it stays mapped until the registration has been dropped; the GPU may write into
    // it (downloads), so it is registered read-write.
    let reg = unsafe { HostRegistration::register(ctx, buf.as_ptr(), class, false)? };
    Ok(Memory::Registered { reg, buf })
}

impl PinnedPool {
    fn note(&self, note: String) {
        let mut notes = self.inner.notes.lock();
        if !notes.contains(&note) {
            tracing::warn!("{note}");
            notes.push(note);
        }
    }

    /// Counters.
    pub fn stats(&self) -> PoolStats {
        self.inner.state.lock().stats.clone()
    }

    /// Slower paths taken and why (CPU mode, unlocked buffers, failed placement).
    pub fn notes(&self) -> Vec<String> {
        self.inner.notes.lock().clone()
    }

    /// The byte budget.
    pub fn budget_bytes(&self) -> u64 {
        self.inner.budget
    }

    /// Whether buffers are pinned by the CUDA driver (else CPU mode).
    pub fn is_pinned(&self) -> bool {
        matches!(self.inner.mode, PoolMode::Cuda(_))
    }

    /// Frees every cached buffer (those handed out stay).
    pub fn trim(&self) {
        let drained: Vec<Entry> = {
            let mut st = self.inner.state.lock();
            let all: Vec<Entry> = std::mem::take(&mut st.free)
                .into_values()
                .flatten()
                .collect();
            st.stats.held_bytes -= all.iter().map(|e| e.class as u64).sum::<u64>();
            all
        };
        drop(drained);
    }
}

impl Inner {
    /// Caches `entry` again: as the newest of its class (the first `get` tries), or, `behind`,
    /// as the oldest (the last it tries).
    fn give_back(&self, entry: Entry, behind: bool) {
        let mut st = self.state.lock();
        st.stats.in_use_bytes -= entry.class as u64;
        let free = st.free.entry(entry.class).or_default();
        if behind {
            free.insert(0, entry);
        } else {
            free.push(entry);
        }
    }
}

/// A buffer on loan from a [`PinnedPool`]; returns to it when dropped.
pub struct PooledBuffer {
    entry: Option<Entry>,
    len: usize,
    pool: Arc<Inner>,
}

impl std::fmt::Debug for PooledBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledBuffer")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("pinned", &self.is_pinned())
            .finish()
    }
}

impl PooledBuffer {
    fn entry(&self) -> &Entry {
        self.entry.as_ref().expect("present until drop")
    }

    fn entry_mut(&mut self) -> &mut Entry {
        self.entry.as_mut().expect("present until drop")
    }

    /// The bytes visible (as asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size class: bytes actually held.
    pub fn capacity(&self) -> usize {
        self.entry().class
    }

    /// Shows `len` bytes (at most the capacity).
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(self.capacity());
    }

    /// Whether the memory is pinned by the CUDA driver.
    pub fn is_pinned(&self) -> bool {
        match &self.entry().mem {
            Memory::Pinned(_) | Memory::Registered { .. } => true,
            Memory::Slab { slab, .. } => slab.reg.is_some(),
            Memory::Cpu { .. } => false,
        }
    }

    /// Whether the memory is page-locked (pinned, or mlocked in CPU mode).
    pub fn is_locked(&self) -> bool {
        match &self.entry().mem {
            Memory::Pinned(_) | Memory::Registered { .. } => true,
            Memory::Cpu { lock, .. } => lock.is_some(),
            Memory::Slab { slab, .. } => slab.reg.is_some() || slab.lock.is_some(),
        }
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.entry().mem.const_ptr()
    }

    /// The first byte, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.entry_mut().mem.ptr()
    }

    /// Records, on `stream`, the point after which the GPU no longer uses this buffer: every
    /// later reuse (this guard's [`PooledBuffer::wait_idle`], or a `get` after it returned to
    /// the pool) waits for it. Call it right after enqueueing a copy from or to the buffer.
    pub fn record_use(&mut self, stream: &CudaStream) -> Result<()> {
        let entry = self.entry_mut();
        if entry.pending.is_none() {
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
            entry.pending = Some(
                stream
                    .context()
                    .new_event(Some(flags))
                    .map_err(|e| Error::cuda("cuEventCreate", e))?,
            );
        }
        entry
            .pending
            .as_ref()
            .expect("just created")
            .record(stream)
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        entry.pending_recorded = true;
        Ok(())
    }

    /// Waits until the last use recorded with [`PooledBuffer::record_use`] completed.
    pub fn wait_idle(&mut self) -> Result<()> {
        self.entry_mut().wait_idle()
    }

    /// Whether a recorded use is still running on the GPU.
    pub fn is_busy(&self) -> bool {
        let e = self.entry();
        e.pending_recorded && e.pending.as_ref().is_some_and(|ev| !ev.is_complete())
    }
}

impl std::ops::Deref for PooledBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the buffer holds `capacity >= len` initialised bytes (pinned buffers are
        // zeroed at allocation, CPU buffers are zeroed mmap memory).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for PooledBuffer {
    /// The bytes, for writing: waits first for the last GPU use recorded with
    /// [`PooledBuffer::record_use`] (free when there is none or it has completed), so the CPU
    /// never writes while a copy still reads the buffer.
    fn deref_mut(&mut self) -> &mut [u8] {
        if let Err(e) = self.wait_idle() {
            // The context is broken (a sticky CUDA error): its queued copies will not run.
            tracing::error!(error = %e, "waiting for a pooled buffer's last copy failed");
        }
        let len = self.len;
        // SAFETY: as in deref; exclusive through &mut self, and no recorded GPU use is still
        // running (waited for above).
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), len) }
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(entry) = self.entry.take() {
            self.pool.give_back(entry, false);
        }
    }
}
