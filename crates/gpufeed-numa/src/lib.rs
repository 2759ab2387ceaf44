//! # gpufeed-numa — layer 1 of gpufeed: NUMA topology and placement
//!
//! On a machine of two or more sockets, each GPU hangs off the PCIe root of one socket. Pinned
//! staging memory on the *other* socket makes every host-to-device copy cross the socket
//! interconnect, which is slower than the socket's own memory, and IO threads there add
//! cross-socket traffic of their own. This crate answers "which NUMA node is this GPU on"
//! ([`Topology::node_of_pci`]) and puts threads ([`Topology::bind_thread`]) and memory
//! ([`Topology::bind_memory`]) there, then checks where pages really are ([`placement_of`]).
//!
//! | gpufeed-numa | numactl |
//! |---|---|
//! | `topo.bind_thread(n)` | `numactl --cpunodebind=n` (for one thread, until the guard drops) |
//! | `topo.bind_memory(p, len, n, MemPolicy::Bind)` | `numactl --membind=n` (for one range) |
//! | `topo.bind_memory(p, len, n, MemPolicy::Preferred)` | `numactl --preferred=n` |
//! | `Topology::detect()` | `numactl --hardware` |
//!
//! Depends on `gpufeed-os` only (and, with the feature `hwloc`, on `hwlocality`, which links the
//! hwloc C library).
//!
//! Used by `gpufeed-pinned` (pool buffers first touched on the GPU's node), `gpufeed-cuda` (fill
//! and drain threads bound to that node), `gpufeed-load` (one-shot staging placed after the
//! context on machines of several nodes) and the facade's `doctor`.
//!
//! ## Backends
//! - `/sys` (default, no C library): `devices/system/node/node*/{cpulist,meminfo,distance}` and
//!   `bus/pci/devices/*/{numa_node,local_cpulist,class,vendor}`.
//!   [`Topology::from_sysfs`] reads any directory laid out that way, which is how the tests
//!   fake a two-socket machine.
//! - hwloc (feature **`hwloc`**, off by default): [`Topology::detect`] asks hwloc first (with
//!   I/O objects kept, so PCI locality works) and falls back to /sys with the reason in
//!   [`Topology::fallback_reason`].
//!
//! A machine without NUMA information is one node holding every CPU.
//!
//! # Example
//! ```
//! use gpufeed_numa::Topology;
//! let topo = Topology::detect()?;
//! let node = topo.nodes()[0].id;
//! {
//!     let _bound = topo.bind_thread(node)?; // this thread runs on node 0's CPUs until here
//! }
//! # Ok::<(), gpufeed_numa::Error>(())
//! ```

mod bind;
mod error;
#[cfg(feature = "hwloc")]
mod hwloc;
mod parse;
mod sysfs;
mod topology;

pub use bind::{MemPolicy, Placement, ThreadBinding, placement_of};
pub use error::{Error, Result};
pub use parse::{PciAddress, format_list, parse_list};
pub use topology::{Backend, NVIDIA_VENDOR_ID, Node, PciDevice, Topology};
