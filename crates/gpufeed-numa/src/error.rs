//! The one error type of `gpufeed-numa`.

use std::path::PathBuf;

/// Result alias used throughout `gpufeed-numa`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `gpufeed-numa`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A PCI bus id could not be parsed.
    #[error(
        "{bus_id:?} is not a PCI bus id; use the form 0000:3b:00.0 (as in /sys and lspci -D), \
         00000000:3B:00.0 (nvidia-smi) or 3b:00.0"
    )]
    InvalidBusId {
        /// The text given.
        bus_id: String,
    },

    /// No PCI device has that bus id.
    #[error("no PCI device {bus_id} on this machine; known {what}: {}", if known.is_empty() { "none".to_owned() } else { known.join(", ") })]
    UnknownPciDevice {
        /// The bus id asked for, in canonical form.
        bus_id: String,
        /// What `known` lists ("GPUs" or "PCI devices").
        what: &'static str,
        /// Bus ids that do exist.
        known: Vec<String>,
    },

    /// A node id beyond the topology.
    #[error("NUMA node {node} does not exist; this machine has node(s) {}", nodes.iter().map(u32::to_string).collect::<Vec<_>>().join(", "))]
    NodeOutOfRange {
        /// The node asked for.
        node: u32,
        /// The nodes that exist.
        nodes: Vec<u32>,
    },

    /// The kernel refused a binding.
    #[error("{what} on NUMA node {node} refused: {source}; {hint}")]
    BindRefused {
        /// `"bind thread"` or `"bind memory"`.
        what: &'static str,
        /// The node.
        node: u32,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
        /// What it likely means and what to do.
        hint: &'static str,
    },

    /// A /sys (or hwloc) item could not be read or parsed.
    #[error("cannot read the NUMA topology from {}: {reason}", .path.display())]
    Topology {
        /// Where it was read from.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },

    /// The operation is not available on this kernel.
    #[error("{what} is not supported here: {reason}")]
    Unsupported {
        /// The operation.
        what: &'static str,
        /// Why, in words.
        reason: String,
    },
}
