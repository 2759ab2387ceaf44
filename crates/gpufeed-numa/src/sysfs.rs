//! The /sys backend.

use std::path::Path;

use crate::error::{Error, Result};
use crate::parse::{self, PciAddress};
use crate::topology::{Backend, Node, PciDevice, Topology};

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::Topology {
        path: path.into(),
        reason: e.to_string(),
    })
}

fn bad(path: &Path, text: &str) -> Error {
    Error::Topology {
        path: path.into(),
        reason: format!("unexpected contents {:?}", text.trim()),
    }
}

fn read_list(path: &Path) -> Result<Vec<u32>> {
    let text = read_text(path)?;
    parse::parse_list(&text).ok_or_else(|| bad(path, &text))
}

pub(crate) fn read(root: &Path) -> Result<Topology> {
    let node_dir = root.join("devices/system/node");
    let nodes = if node_dir.is_dir() {
        read_nodes(&node_dir)?
    } else {
        // No NUMA support compiled into the kernel, or /sys hidden: one node of every CPU.
        let cpus = read_list(&root.join("devices/system/cpu/online")).unwrap_or_else(|_| {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
            (0..n).collect()
        });
        vec![Node {
            id: 0,
            cpus,
            memory_bytes: None,
            distances: vec![10],
        }]
    };
    let pci = read_pci(&root.join("bus/pci/devices"))?;
    Ok(Topology {
        nodes,
        pci,
        backend: Backend::Sysfs { root: root.into() },
        fallback_reason: None,
    })
}

fn read_nodes(node_dir: &Path) -> Result<Vec<Node>> {
    let online = node_dir.join("online");
    let ids = if online.exists() {
        read_list(&online)?
    } else {
        let mut ids: Vec<u32> = std::fs::read_dir(node_dir)
            .map_err(|e| Error::Topology {
                path: node_dir.into(),
                reason: e.to_string(),
            })?
            .filter_map(|e| {
                e.ok()?
                    .file_name()
                    .to_str()?
                    .strip_prefix("node")?
                    .parse()
                    .ok()
            })
            .collect();
        ids.sort_unstable();
        ids
    };
    if ids.is_empty() {
        return Err(bad(&online, ""));
    }
    ids.iter()
        .map(|&id| {
            let dir = node_dir.join(format!("node{id}"));
            let cpus = read_list(&dir.join("cpulist"))?;
            let memory_bytes = read_text(&dir.join("meminfo"))
                .ok()
                .and_then(|t| parse::node_mem_total(&t));
            let distances = match read_text(&dir.join("distance")) {
                Ok(text) => text
                    .split_whitespace()
                    .map(|w| w.parse::<u32>())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|_| bad(&dir.join("distance"), &text))?,
                Err(_) => Vec::new(),
            };
            Ok(Node {
                id,
                cpus,
                memory_bytes,
                distances,
            })
        })
        .collect()
}

fn read_pci(dir: &Path) -> Result<Vec<PciDevice>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(Vec::new()); // no PCI bus (some VMs, containers without /sys/bus)
    };
    let mut devices = Vec::new();
    for entry in entries.flatten() {
        let Some(address) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<PciAddress>().ok())
        else {
            continue;
        };
        let path = entry.path();
        let attr = |name: &str| std::fs::read_to_string(path.join(name)).ok();
        let numa_node = attr("numa_node")
            .and_then(|t| t.trim().parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok());
        devices.push(PciDevice {
            address,
            vendor: attr("vendor").and_then(|t| parse::hex_u32(&t)).unwrap_or(0),
            class: attr("class").and_then(|t| parse::hex_u32(&t)).unwrap_or(0),
            numa_node,
            local_cpus: attr("local_cpulist")
                .and_then(|t| parse::parse_list(&t))
                .unwrap_or_default(),
        });
    }
    devices.sort_by_key(|d| d.address);
    Ok(devices)
}
