//! # gpufeed-cuda — layer 2 of gpufeed: GPUs and the transfer scheduler
//!
//! - [`Gpu::list`] / [`Gpu::open`]: devices with their name, memory, PCI bus id, NUMA node
//!   (from `gpufeed-numa`) and PCIe link. Never panics on a machine without a driver: every
//!   entry point checks for libcuda first and returns [`Error::NoCudaDriver`].
//! - Device buffers are cudarc [`CudaSlice<u8>`](cudarc::driver::CudaSlice), so cudarc and
//!   candle users take them as they are: from the context's stream-ordered pool
//!   ([`Gpu::alloc`]: reuse is free, growth is not: measured in docs/benchmarks.md, GPU run 8)
//!   or from `cuMemAlloc`
//!   ([`Gpu::alloc_unpooled`]: cheap to get, for memory kept, as a one-shot load's).
//! - [`TransferScheduler`]: host -> device (and back) in chunks spread over several streams.
//!   Pinned and registered memory is copied directly; pageable memory and [`FillSource`]s
//!   (a file reader, a decoder) go through pinned staging buffers from a
//!   [`gpufeed_pinned::PinnedPool`]. Uploads run in lanes ([`TransferOptions::lanes_for`]: one
//!   per 8 MiB, at least four, at most the fill threads): each lane owns a stream and
//!   a few staging buffers, fills one, issues its copy and fills the next while the first is
//!   on the wire (no single submitting thread to funnel through); the calling thread runs the
//!   first lane and fill threads started by the first upload that needs them (and kept, awake
//!   for [`TransferOptions::idle_spin`] after each upload so that the next one starts at once)
//!   run the others. Each upload
//!   starts with [`TransferOptions::min_chunk_bytes`] pieces doubling up to a chunk, and small
//!   uploads are shared out in smaller pieces ([`TransferOptions::piece_bytes_for`]). A staging
//!   buffer is reused only after the event of its last copy completed (the pool's guard owns
//!   the event).
//!   [`TransferScheduler::reserve_staging`] sets the lanes' buffers up front from one slab
//!   registered in one call (bounded by [`TransferOptions::staging_bytes_for`]).
//!   [`TransferStats`] says where time went.
//!
//! - New device memory filled before it is returned, without `unsafe` or a memset:
//!   [`Gpu::alloc_filled`] and [`TransferScheduler::upload_new`]; or filled without waiting
//!   ([`TransferScheduler::upload_pooled_async`]: a pooled buffer's copy issued on a stream in
//!   turns, an event to wait for; [`TransferScheduler::gather_pooled_reusing`] and
//!   [`TransferScheduler::gather_spans_pooled_reusing`]: records or spans of registered host
//!   memory gathered by a kernel the same way).
//! - Several GPUs: [`Gpu::peer_links`] (peer access and the link between each pair, from the
//!   driver), [`Gpu::enable_peer_access`], and [`split_mut`] to cut a device buffer into
//!   disjoint parts that different threads fill at once, and [`PeerFanout`]: one GPU's part of a
//!   replicated buffer sent to the other GPUs over their peer links while it is filled, in this
//!   process or, through CUDA IPC ([`IpcHandle`], [`IpcMemory`]), in other processes; or
//!   gathered the other way ([`PeerGather`]) out of slots of a pool other processes map
//!   ([`SharedPool`], [`ImportedPool`], at most [`SHARED_MAP_MAX_BYTES`] per allocation).
//!   Or through NCCL, loaded at run time ([`nccl_version`]; missing: [`Error::NcclMissing`]):
//!   a non-blocking communicator ([`NcclComm`], its [`NcclId`] passed out of band) and rounds
//!   of in-place broadcasts into a buffer while it is filled ([`NcclBroadcasts`]), every wait
//!   calling the caller's check of the other ranks and aborting the communicator when it
//!   fails.
//! - [`kernels::PlanarKernel`]: RGB8 -> planar `f32` on the GPU (the frame pipeline's
//!   kernel), PTX inside the library compiled by the driver's JIT (no toolkit, no NVRTC); the
//!   same way, [`cast::CastKernel`]: BF16, F16, F32 to one another and FP8 to each, bit for
//!   bit as torch's `.to` on the GPU, and [`kernels::GatherKernel`]: records at host
//!   addresses (registered memory) gathered into device memory, a block per record, or
//!   [`kernels::Span`]s of any length to any offset (a folder's files, back to back).
//! - [`copy`]: device-to-device copies by address, plain and pitched.
//! - [`nvjpeg`]: nvJPEG loaded at run time ([`nvjpeg_version`]; missing:
//!   [`Error::NvjpegMissing`]), a decoder handle on a GPU, a JPEG's header facts, batches
//!   decoded into device memory ([`nvjpeg::Nvjpeg::decode_batch`]).
//! - [`cufile`]: cuFile (GPUDirect Storage) loaded at run time ([`cufile_version`]; missing:
//!   [`Error::CufileMissing`]): the driver and its properties, files registered, reads into
//!   device memory, which path served them; [`gds`]: whether this machine and a file's file
//!   system would read peer-to-peer, through cuFile's compatibility mode, or not at all.
//! - [`resize`]: crops of decoded images resized (antialiased bilinear), mirrored and
//!   normalized on the GPU ([`resize::ResizeKernel`]).
//! - Errors keep the driver's [`CUresult`] ([`Error::cu_result`]); slower paths taken are
//!   [`Fallback`]s ([`TransferScheduler::fallbacks`]).
//!
//! Depends on `cudarc` (driver API, dynamic loading; its `nvrtc` feature only for loading PTX),
//! `libloading` (NCCL, nvJPEG, cuFile),
//! `gpufeed-pinned` (within layer 2: the staging pool), `gpufeed-numa` and `gpufeed-os`. Raw driver calls live in one private module
//! of thin `unsafe fn`s returning `Result`.
//!
//! # Example
//! ```
//! use gpufeed_cuda::{DeviceAlloc, Gpu, HostSource, TransferOptions, TransferScheduler};
//! let gpu = match Gpu::open(0) {
//!     Ok(gpu) => gpu,
//!     Err(e) if e.is_no_gpu() => return Ok(()), // a machine without a GPU
//!     Err(e) => return Err(e),
//! };
//! let sched = TransferScheduler::new(&gpu, TransferOptions::default())?;
//! let data = vec![42u8; (8 << 20) + 3];
//! let (dev, stats) = sched.upload_new(HostSource::Pageable(&data), DeviceAlloc::Pool)?;
//! assert_eq!(gpu.to_vec(&dev)?, data);
//! println!("{:.1} GB/s over {} chunks", stats.gbps(), stats.chunks);
//! # Ok::<(), gpufeed_cuda::Error>(())
//! ```

pub mod cast;
pub mod copy;
mod crew;
pub mod cufile;
mod dynlib;
mod error;
pub mod gds;
mod gpu;
mod kept;
pub mod kernels;
mod nccl;
pub mod nvjpeg;
mod peer;
mod raw;
pub mod resize;
mod transfer;

pub use cufile::cufile_version;
pub use error::{CUresult, Error, Result};
pub use gpu::{ContextGuard, DeviceAlloc, Gpu, GpuInfo};
/// The fallback type of every layer (defined in gpufeed-os).
pub use gpufeed_os::{Fallback, Refused};
pub use nccl::{NcclBroadcasts, NcclComm, NcclId, nccl_version};
pub use nvjpeg::nvjpeg_version;
pub use peer::{
    ImportedPool, IpcHandle, IpcMemory, PeerFanout, PeerGather, PeerLink, SHARED_MAP_MAX_BYTES,
    SharedPointer, SharedPool, split_mut,
};
pub use transfer::{
    DIRECT_CHUNK_BYTES, FillSource, HostDest, HostSource, SliceSource, SourceError,
    TransferOptions, TransferScheduler, TransferStats,
};

/// The old name of [`TransferOptions`] (renamed: gpufeed's settings structs end in `Options`).
#[deprecated(note = "renamed TransferOptions")]
pub type TransferConfig = TransferOptions;

/// The cudarc crate, as this crate uses it.
pub use cudarc;
