//! # gpufeed-pinned — layer 2 of gpufeed: host memory the GPU copies from at full speed
//!
//! Copies between host and GPU run at the PCIe ceiling only from page-locked memory; from an
//! ordinary `Vec` they run at a fraction of it (measured in docs/benchmarks.md, bench table 4).
//! This crate provides that memory three ways:
//!
//! - [`PinnedBuffer`]: `cuMemHostAlloc` (portable; write-combined only when asked, since the
//!   CPU reads such memory very slowly). Expensive to allocate: pool it.
//! - [`HostRegistration`]: `cuMemHostRegister` over memory that already exists — a read-only
//!   [`gpufeed_os::FileMap`] (registered `READ_ONLY`, so the GPU reads the page cache with no
//!   host copy), a [`gpufeed_os::ShmSegment`], or a slice; registered in chunks of at most 64
//!   GiB; a range that is already registered is refused up front.
//! - [`PinnedPool`]: aligned buffers registered with `cuMemHostRegister` (set up faster than
//!   with `cuMemHostAlloc`, the noted fallback: measured in docs/benchmarks.md, GPU run 7) in
//!   power-of-two size classes from 64 KiB
//!   to 256 MiB, a byte budget (default a
//!   quarter of RAM), buffers allocated on the GPU's NUMA node, reuse through [`PooledBuffer`]
//!   guards that carry the event of their last copy; [`PinnedPool::reserve`] (or
//!   [`PinnedPool::reserve_slab`] with a [`HostSlab`] faulted in ahead, e.g. while a context is
//!   created) fills the cache with buffers cut from one slab page-locked in one call. Without a
//!   CUDA driver
//!   ([`PoolMode::Cpu`]) it hands out `mlock`ed aligned buffers within `RLIMIT_MEMLOCK` (and
//!   unlocked ones past it, noted in [`PinnedPool::notes`]) so CPU pipelines run unchanged.
//!
//! Depends on `gpufeed-os`, `gpufeed-numa` and `cudarc` (driver API, loaded dynamically).
//!
//! Only this crate and `gpufeed-cuda` use `cudarc`. On a machine without libcuda every CUDA
//! entry point returns [`Error::NoCudaDriver`] instead of panicking ([`driver_available`]); raw
//! driver calls live in one private module of thin `unsafe fn`s returning `Result`.
//!
//! # Example
//! ```
//! use gpufeed_pinned::{PinnedPool, PoolOptions, PoolMode};
//! // With a GPU: PoolMode::Cuda(context); without one, mlocked memory (runs anywhere).
//! let pool = PinnedPool::new(PoolMode::Cpu, PoolOptions::default().with_budget_bytes(Some(64 << 20)))?;
//! let mut buf = pool.get(100_000)?; // a 128 KiB class buffer, 100 000 bytes visible
//! buf[..5].copy_from_slice(b"bytes");
//! drop(buf); // back to the pool, reused by the next get of its class
//! assert_eq!(pool.get(70_000)?.len(), 70_000);
//! assert_eq!(pool.stats().allocations, 1);
//! # Ok::<(), gpufeed_pinned::Error>(())
//! ```

mod buffer;
mod driver;
mod error;
mod pool;
mod register;

pub use buffer::{PinnedBuffer, PinnedFlags};
pub use driver::driver_available;
pub use error::{CUresult, Error, Result};
pub use pool::{
    HostSlab, MAX_CLASS, MIN_CLASS, PinnedPool, PoolMode, PoolOptions, PoolStats, PooledBuffer,
};

/// The old name of [`PoolOptions`] (renamed: gpufeed's settings structs end in `Options`).
#[deprecated(note = "renamed PoolOptions")]
pub type PoolConfig = PoolOptions;
pub use register::{HostRegistration, MAX_REGISTER_CHUNK};

/// The cudarc crate, as this crate uses it (driver API).
pub use cudarc;
