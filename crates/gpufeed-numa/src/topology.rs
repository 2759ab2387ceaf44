//! The topology: NUMA nodes with their CPUs, memory and distances, and the PCI devices with
//! their locality. Two backends fill the same types: /sys (always) and hwloc (feature `hwloc`).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::parse::PciAddress;

/// PCI vendor id of NVIDIA.
pub const NVIDIA_VENDOR_ID: u32 = 0x10de;

/// Where a [`Topology`] came from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// Read from /sys (`devices/system/node`, `bus/pci/devices`).
    Sysfs {
        /// The sysfs root read (normally `/sys`).
        root: PathBuf,
    },
    /// Read through hwloc.
    Hwloc,
}

/// One NUMA node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// The kernel's node id (`numactl` numbers).
    pub id: u32,
    /// CPUs of the node, sorted.
    pub cpus: Vec<u32>,
    /// Memory of the node in bytes, where known.
    pub memory_bytes: Option<u64>,
    /// Distance to each node of [`Topology::nodes`], in the same order (10 = local); empty
    /// where unknown.
    pub distances: Vec<u32>,
}

/// A PCI device and where it sits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDevice {
    /// Its address.
    pub address: PciAddress,
    /// Vendor id (0x10de for NVIDIA).
    pub vendor: u32,
    /// Class code (0x03xxxx for display controllers, 0x0302 3D controllers such as data-center GPUs).
    pub class: u32,
    /// The NUMA node the firmware attached it to; `None` where it says "no locality" (-1).
    pub numa_node: Option<u32>,
    /// CPUs local to it, where known.
    pub local_cpus: Vec<u32>,
}

impl PciDevice {
    /// Whether this is an NVIDIA display or 3D controller.
    pub fn is_nvidia_gpu(&self) -> bool {
        self.vendor == NVIDIA_VENDOR_ID && self.class >> 16 == 0x03
    }
}

/// The machine's NUMA nodes and PCI devices.
///
/// # Example
/// ```
/// let topo = gpufeed_numa::Topology::detect()?;
/// println!("{} NUMA node(s), from {:?}", topo.nodes().len(), topo.backend());
/// for gpu in topo.gpus() {
///     println!("GPU {} on node {:?}", gpu.address, gpu.numa_node);
/// }
/// # Ok::<(), gpufeed_numa::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Topology {
    pub(crate) nodes: Vec<Node>,
    pub(crate) pci: Vec<PciDevice>,
    pub(crate) backend: Backend,
    pub(crate) fallback_reason: Option<String>,
}

impl Topology {
    /// Reads the topology of this machine: through hwloc when the `hwloc` feature is on (and
    /// falling back to /sys with the reason in [`Topology::fallback_reason`] if hwloc fails),
    /// else from /sys.
    pub fn detect() -> Result<Self> {
        #[cfg(feature = "hwloc")]
        {
            match Self::from_hwloc() {
                Ok(t) => return Ok(t),
                Err(e) => {
                    tracing::warn!(error = %e, "hwloc topology failed; reading /sys instead");
                    let mut t = Self::from_sysfs("/sys")?;
                    t.fallback_reason = Some(format!("hwloc failed: {e}"));
                    return Ok(t);
                }
            }
        }
        #[allow(unreachable_code, reason = "reached only without the hwloc feature")]
        Self::from_sysfs("/sys")
    }

    /// Reads the topology from a sysfs tree rooted at `root` (`/sys` on a live machine; tests
    /// pass a directory laid out the same way). A tree without NUMA information
    /// (`devices/system/node` missing) gives one node holding every online CPU.
    pub fn from_sysfs(root: impl AsRef<Path>) -> Result<Self> {
        crate::sysfs::read(root.as_ref())
    }

    /// Reads the topology through hwloc (feature `hwloc`).
    #[cfg(feature = "hwloc")]
    pub fn from_hwloc() -> Result<Self> {
        crate::hwloc::read()
    }

    /// The nodes, in increasing id order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Whether there is more than one node (when there is one, placement does not matter).
    pub fn is_numa(&self) -> bool {
        self.nodes.len() > 1
    }

    /// Node `id`.
    ///
    /// # Errors
    /// [`Error::NodeOutOfRange`] listing the nodes that exist.
    pub fn node(&self, id: u32) -> Result<&Node> {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .ok_or_else(|| Error::NodeOutOfRange {
                node: id,
                nodes: self.nodes.iter().map(|n| n.id).collect(),
            })
    }

    /// The node whose CPUs include `cpu`.
    pub fn node_of_cpu(&self, cpu: u32) -> Option<u32> {
        self.nodes
            .iter()
            .find(|n| n.cpus.binary_search(&cpu).is_ok())
            .map(|n| n.id)
    }

    /// Every PCI device found.
    pub fn pci_devices(&self) -> &[PciDevice] {
        &self.pci
    }

    /// The NVIDIA GPUs among the PCI devices.
    pub fn gpus(&self) -> impl Iterator<Item = &PciDevice> {
        self.pci.iter().filter(|d| d.is_nvidia_gpu())
    }

    /// The PCI device at `bus_id`, in any form [`PciAddress`] accepts.
    ///
    /// # Errors
    /// [`Error::InvalidBusId`], or [`Error::UnknownPciDevice`] listing the GPUs (or, on a
    /// machine without GPUs, every device).
    pub fn pci_device(&self, bus_id: &str) -> Result<&PciDevice> {
        let address: PciAddress = bus_id.parse()?;
        self.pci
            .iter()
            .find(|d| d.address == address)
            .ok_or_else(|| {
                let gpus: Vec<String> = self.gpus().map(|d| d.address.to_string()).collect();
                let (what, known) = if gpus.is_empty() {
                    (
                        "PCI devices (no NVIDIA GPU found)",
                        self.pci.iter().map(|d| d.address.to_string()).collect(),
                    )
                } else {
                    ("GPUs", gpus)
                };
                Error::UnknownPciDevice {
                    bus_id: address.to_string(),
                    what,
                    known,
                }
            })
    }

    /// The NUMA node of the PCI device at `bus_id` (a GPU, say): `Some(node)`, or `None` where
    /// the firmware gives no locality on a machine of several nodes. On a machine of one node
    /// the answer is that node.
    pub fn node_of_pci(&self, bus_id: &str) -> Result<Option<u32>> {
        let device = self.pci_device(bus_id)?;
        Ok(match (device.numa_node, &self.nodes[..]) {
            (Some(node), _) => Some(node),
            (None, [only]) => Some(only.id),
            // No firmware locality: trust the local CPUs if they all sit on one node.
            (None, _) => {
                let mut nodes = device.local_cpus.iter().map(|&c| self.node_of_cpu(c));
                let first = nodes.next().flatten();
                first.filter(|_| nodes.all(|n| n == first))
            }
        })
    }

    /// Which backend produced this topology.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Why the preferred backend (hwloc) was not used, if it was not.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }
}
