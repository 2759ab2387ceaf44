//! # gpufeed-multi — layer 3 of gpufeed: several GPUs at once
//!
//! One host budget shared out between the GPUs, sharded loads (each GPU its own bytes: a share
//! of the files, or its slice of every tensor) and replicated loads (each GPU reads 1/N of a
//! file over its own PCIe link and gets the rest from the other GPUs over their peer links,
//! NVLink where there is one, while it reads) — in one process ([`MultiLoader`]) or one process
//! per GPU as `torchrun` starts them ([`RankLoader`], its replicated loads through staging
//! slots the ranks share, CUDA IPC handles or NCCL: [`Replication`]).
//!
//! | module | what |
//! |---|---|
//! | `plan` | [`ShardPlan`], [`Span`]: what each rank loads |
//! | `multi_loader` | [`MultiLoader`], [`MultiReport`]: several GPUs in one process |
//! | `rank` | [`RankLoader`], [`RankReport`], [`Replication`]: one process per GPU |
//! | `staging`, `ipc`, `nccl` | the three ways a replicated load copies between ranks |
//!
//! Depends on `gpufeed-load` (each GPU's loader), `gpufeed-safetensors` (tensor-parallel
//! checkpoints), `gpufeed-cuda` (peer copies, IPC, NCCL), `gpufeed-ipc` (the ranks'
//! rendezvous) and `gpufeed-os`.
//!
//! The `gpufeed` facade re-exports it as `gpufeed::multi`.
//!
//! # Example
//! ```no_run
//! use gpufeed_multi::{MultiLoader, ShardPlan};
//! let multi = MultiLoader::open(&[0, 1], gpufeed_load::LoadOptions::for_gpus(2))?;
//! // Every GPU gets the whole file; each reads half of it.
//! let (copies, report) = multi.load_replicated("model.bin")?;
//! println!("{} copies in {:.0} ms", copies.len(), report.seconds * 1e3);
//! // Each GPU gets its share of the shards.
//! let plan = ShardPlan::file_per_rank(&["a.bin", "b.bin", "c.bin"], multi.len())?;
//! let (shares, report) = multi.load_sharded(&plan)?;
//! println!("{:.1} GB/s in all", report.read_gbps());
//! # Ok::<(), gpufeed_multi::Error>(())
//! ```

#![deny(unsafe_code)]

mod error;
mod ipc;
mod multi_loader;
mod nccl;
mod plan;
mod rank;
mod staging;

pub use error::{Error, Result};
pub use multi_loader::{MultiLoader, MultiReport};
pub use plan::{ShardPlan, Span};
pub use rank::{RankLoader, RankReport, Replication, SHARED_SLOT_MAX_BYTES};
