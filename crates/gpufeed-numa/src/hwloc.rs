//! The hwloc backend (feature `hwloc`): the same types, filled through `hwlocality`.

use hwlocality::Topology as HwTopology;
use hwlocality::object::TopologyObject;
use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::ObjectType;
use hwlocality::topology::builder::TypeFilter;

use crate::error::{Error, Result};
use crate::parse::PciAddress;
use crate::topology::{Backend, Node, PciDevice, Topology};

fn failed(what: &str, err: impl std::fmt::Display) -> Error {
    Error::Topology {
        path: "hwloc".into(),
        reason: format!("{what}: {err}"),
    }
}

fn cpus_of(obj: &TopologyObject) -> Vec<u32> {
    obj.cpuset()
        .map(|set| set.iter_set().map(|i| usize::from(i) as u32).collect())
        .unwrap_or_default()
}

pub(crate) fn read() -> Result<Topology> {
    let hw = HwTopology::builder()
        .with_io_type_filter(TypeFilter::KeepAll)
        .map_err(|e| failed("keep I/O objects", e))?
        .build()
        .map_err(|e| failed("build the topology", e))?;

    let mut nodes: Vec<Node> = hw
        .objects_with_type(ObjectType::NUMANode)
        .filter_map(|obj| {
            Some(Node {
                id: obj.os_index()? as u32,
                cpus: cpus_of(obj),
                memory_bytes: match obj.attributes() {
                    Some(ObjectAttributes::NUMANode(a)) => a.local_memory().map(|m| m.get()),
                    _ => None,
                },
                distances: Vec::new(),
            })
        })
        .collect();
    nodes.sort_by_key(|n| n.id);

    // Distances: the first NUMA-node matrix hwloc has (from the ACPI SLIT), if any.
    if let Some(matrix) = hw
        .distances_with_type(None, ObjectType::NUMANode)
        .ok()
        .and_then(|mut all| (!all.is_empty()).then(|| all.swap_remove(0)))
    {
        let ids: Vec<Option<u32>> = matrix
            .objects()
            .map(|o| o.and_then(|o| o.os_index()).map(|i| i as u32))
            .collect();
        let n = ids.len();
        let values = matrix.distances();
        for node in &mut nodes {
            let Some(row) = ids.iter().position(|&id| id == Some(node.id)) else {
                continue;
            };
            let by_id: Vec<(u32, u32)> = (0..n)
                .filter_map(|col| Some((ids[col]?, values[row * n + col] as u32)))
                .collect();
            // Order the row like `nodes` (by id).
            let mut ordered = by_id;
            ordered.sort_by_key(|&(id, _)| id);
            node.distances = ordered.into_iter().map(|(_, d)| d).collect();
        }
    }

    let mut pci: Vec<PciDevice> = hw
        .pci_devices()
        .filter_map(|obj| {
            let Some(ObjectAttributes::PCIDevice(attr)) = obj.attributes() else {
                return None;
            };
            let ancestor = obj.first_non_io_ancestor();
            let numa_node = ancestor
                .and_then(|a| a.nodeset())
                .filter(|set| set.weight() == Some(1))
                .and_then(|set| set.first_set())
                .map(|i| usize::from(i) as u32);
            Some(PciDevice {
                address: PciAddress {
                    domain: u32::from(attr.domain()),
                    bus: attr.bus_id(),
                    device: attr.bus_device(),
                    function: attr.function(),
                },
                vendor: u32::from(attr.vendor_id()),
                class: u32::from(attr.class_id()) << 8,
                numa_node,
                local_cpus: ancestor.map(cpus_of).unwrap_or_default(),
            })
        })
        .collect();
    pci.sort_by_key(|d| d.address);
    Ok(Topology {
        nodes,
        pci,
        backend: Backend::Hwloc,
        fallback_reason: None,
    })
}
