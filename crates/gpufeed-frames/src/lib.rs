//! # gpufeed-frames — layer 3 of gpufeed: the source's two case studies, real-time frames and the hybrid training loader
//!
//! - [`frames`]: frames between processes through a shared-memory ring (the real-time case
//!   study: a paced producer, the consumer, the pipe baseline, latency statistics; the GPU
//!   consumer [`frames::GpuFrames`] copies each frame straight from the registered ring while
//!   the previous one is transformed).
//! - [`hybrid`]: the hybrid training loader (the other case study): a `BatchLoader`'s batches
//!   preprocessed on the GPU ([`hybrid::GpuPlanar`]) and kept there, or dealt out to trainer
//!   processes through shared-memory rings ([`hybrid::Fanout`]).
//!
//! Both run as two processes in `examples/frames.rs` and `examples/hybrid.rs`, and are measured
//! by bench tables 12 and 13. The crate's own `unsafe` code is where it reads or writes a
//! claimed ring slot in place.
//!
//! Depends on `gpufeed-load`, `gpufeed-data` (the batch loader and its ring), `gpufeed-ipc`
//! (the rings), `gpufeed-pinned` (the ring registered with CUDA) and `gpufeed-cuda` (the
//! planar kernel).
//!
//! Optional in the `gpufeed` facade (feature `frames`), re-exported there as `gpufeed::frames`
//! and `gpufeed::hybrid`.
//!
//! # Example
//! ```
//! use gpufeed_frames::frames::{FrameFormat, consume, latency_stats, produce};
//! let format = FrameFormat { width: 64, height: 48 };
//! let ring = gpufeed_ipc::BatchRing::anonymous(4, format.slot_bytes())?;
//! let seen = std::thread::scope(|s| {
//!     s.spawn(|| produce(&ring, format, 0.0, 0..20));
//!     consume(&ring, format, 20, std::time::Duration::from_secs(5), |_, _| Ok(()))
//! })?;
//! assert_eq!(latency_stats(&seen, 20, None).frames, 20);
//! # Ok::<(), gpufeed_frames::Error>(())
//! ```

#![deny(unsafe_code)]

mod error;
pub mod frames;
pub mod hybrid;

pub use error::{Error, Result};
