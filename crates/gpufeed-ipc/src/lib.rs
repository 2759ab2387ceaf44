//! # gpufeed-ipc — layer 1 of gpufeed: a batch ring between processes
//!
//! Shared memory lets preprocessing processes hand batches to the GPU process without copies,
//! but it has no synchronization of its own. [`BatchRing`] is that pairing: fixed slots
//! (256-byte aligned) in a [`gpufeed_os::ShmSegment`], multi-producer multi-consumer, futex
//! waits with timeouts, and crash safety — a slot claimed by a producer that died is reclaimed
//! and never delivered torn, producers learn when every consumer died or left
//! ([`Error::ConsumerGone`]) instead of blocking forever, and consumers when every registered
//! producer did ([`Error::ProducerGone`], [`BatchRing::producer`]). A consumer can publish
//! how far it got and how far ahead of it producers may run ([`Watermark`], in the ring's
//! header), so that producers of numbered items wait ([`BatchRing::wait_watermark`]) instead
//! of filling the ring with items it cannot take yet.
//!
//! Create a named ring ([`BatchRing::create`]) and [`BatchRing::open`] it elsewhere, or create
//! an anonymous one ([`BatchRing::anonymous`]) and pass its memfd to related processes by
//! inheritance or with [`send_fd`] / [`recv_fd`]. To move a batch to the GPU with no staging
//! copy, register [`BatchRing::segment`] with `gpufeed-pinned` (`HostRegistration::shm`) and
//! copy from [`Batch::offset_in_segment`].
//!
//! [`Rendezvous`]: the processes of one job on one machine (one per GPU, as `torchrun` starts
//! them) meet in a named segment, pass each other small payloads ([`Rendezvous::exchange`]:
//! CUDA IPC handles, a plan's hash) and file descriptors ([`Rendezvous::share_fd`]: an exported
//! CUDA memory pool, over sockets in private directories with the peers' credentials checked),
//! and wait at barriers; a rank that never arrives, left or died makes the others fail with an
//! error naming it, within the join timeout or one lease. A crashed job's leftover segment is
//! replaced by the next job's rank 0 (whatever its world size) and collectable by
//! [`gc_rendezvous`] (`gpufeed shm gc`); a live job's is never removed, another user's file
//! under the name never touched.
//!
//! Holders are named by their entry in the ring's process table (PID namespace, pid, start
//! time, heartbeat) and hold a lock on a byte of the segment that the kernel releases when they
//! die: a holder whose lock is released is dead, one of our PID namespace is judged by its pid,
//! one of another namespace (a container sharing /dev/shm) by the lease it renews
//! ([`BatchRing::set_lease`]). A holder of another namespace silent for a whole lease (maybe
//! only stopped: `docker pause`) is detached and its slots quarantined, handed to nobody until
//! it lets go of them or is known dead, so that a stopped producer resumed never writes into
//! another producer's batch nor a stopped consumer's batch is refilled under it; its next call
//! answers [`Error::Detached`]. A forked child gets [`Error::Forked`] and attaches on its own.
//!
//! The slot state machine ([`state`](self) module docs) and the process table's identity
//! handshake are checked with `loom`
//! (`RUSTFLAGS="--cfg loom" cargo test -p gpufeed-ipc --lib`) and against a `VecDeque` model
//! with `proptest`; header parsing ([`parse_header`]) treats the segment as untrusted input.
//!
//! Depends on `gpufeed-os`, `rustix`, `parking_lot` (the heartbeat thread's stop signal) and
//! `libc` (`pthread_atfork`, to notice forked children without a system call per batch).
//!
//! # Example
//! ```
//! use std::time::Duration;
//! use gpufeed_ipc::BatchRing;
//! // 4 slots of 1 MiB, named so that other processes can `BatchRing::open` it.
//! let ring = BatchRing::create_unique(4, 1 << 20)?;
//! let mut claim = ring.claim(Duration::from_secs(1))?; // a producer's side
//! claim.write_at(0, b"batch 0")?;
//! claim.set_len(7)?;
//! claim.publish()?;
//! let batch = ring.consumer()?.next(Duration::from_secs(1))?; // a consumer's side
//! assert_eq!(batch.to_vec(), b"batch 0");
//! # Ok::<(), gpufeed_ipc::Error>(())
//! ```

#[cfg(not(loom))]
mod error;
#[cfg(not(loom))]
mod fdpass;
#[cfg(not(loom))]
mod layout;
mod members;
#[cfg(not(loom))]
mod oflock;
#[cfg(not(loom))]
mod rendezvous;
#[cfg(not(loom))]
mod ring;
#[cfg(not(loom))]
mod sockdir;
mod state;

#[cfg(not(loom))]
pub use error::{Error, Result};
#[cfg(not(loom))]
pub use fdpass::{recv_fd, send_fd};
#[cfg(not(loom))]
pub use layout::{Layout, MAX_CONSUMERS, MAX_PRODUCERS, MAX_SLOTS, SLOT_ALIGN, parse_header};
#[cfg(not(loom))]
pub use members::MAX_PROCESSES;
#[cfg(not(loom))]
pub use rendezvous::{
    MAX_PAYLOAD, MAX_RANKS, RankWatch, Rendezvous, RendezvousOptions, RendezvousSegment,
    STALE_SOCKET_AGE, gc_rendezvous, gc_stale_sockets, list_rendezvous, remove_stale_sockets,
};
#[cfg(not(loom))]
pub use ring::{
    Batch, BatchRing, Claim, Consumer, DEFAULT_LEASE, LOCKLESS_QUARANTINE_LEASES, Producer,
    RingStats, Watermark,
};
