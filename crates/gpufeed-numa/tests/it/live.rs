//! This machine, for real: its topology, binding a thread and memory, and where pages are.

use gpufeed_numa::{MemPolicy, Topology, placement_of};
use gpufeed_os::AlignedBuf;

fn online_cpus() -> Vec<u32> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").expect("cpu/online");
    gpufeed_numa::parse_list(&text).expect("cpu list")
}

#[test]
fn topology_covers_every_online_cpu_once() {
    let topo = Topology::detect().expect("detect");
    eprintln!(
        "backend {:?}, {} node(s)",
        topo.backend(),
        topo.nodes().len()
    );
    let mut cpus: Vec<u32> = topo
        .nodes()
        .iter()
        .flat_map(|n| n.cpus.iter().copied())
        .collect();
    cpus.sort_unstable();
    assert_eq!(cpus, online_cpus());
    for node in topo.nodes() {
        if !node.distances.is_empty() {
            assert_eq!(node.distances.len(), topo.nodes().len());
            let own = topo
                .nodes()
                .iter()
                .position(|n| n.id == node.id)
                .expect("index");
            assert_eq!(node.distances[own], 10, "local distance");
        }
    }
    // Every PCI device of this machine resolves to a node (one node here: always that one).
    for dev in topo.pci_devices() {
        let node = topo
            .node_of_pci(&dev.address.to_string())
            .expect("known device");
        if !topo.is_numa() {
            assert_eq!(node, Some(topo.nodes()[0].id));
        }
    }
}

#[test]
fn bind_thread_restricts_and_restores_affinity() {
    let topo = Topology::detect().expect("detect");
    let before = rustix::thread::sched_getaffinity(None).expect("affinity");
    let node = topo.nodes().last().expect("a node");
    {
        let binding = topo
            .bind_thread(node.id)
            .expect("bind to a node of this machine");
        assert_eq!(binding.node(), node.id);
        let now = rustix::thread::sched_getaffinity(None).expect("affinity");
        for cpu in 0..1024usize {
            assert_eq!(
                now.is_set(cpu),
                node.cpus.contains(&(cpu as u32)),
                "cpu {cpu}"
            );
        }
        let running_on = rustix::thread::sched_getcpu() as u32;
        assert_eq!(topo.node_of_cpu(running_on), Some(node.id));
    }
    assert_eq!(
        rustix::thread::sched_getaffinity(None).expect("affinity"),
        before,
        "restored"
    );
    assert!(topo.bind_thread(9999).is_err());
}

#[test]
fn bound_memory_lands_on_its_node() {
    let topo = Topology::detect().expect("detect");
    let node = topo.nodes()[0].id;
    let mut buf = AlignedBuf::new(8 << 20, 4096).expect("alloc");
    let untouched = placement_of(buf.as_ptr(), buf.len()).expect("placement");
    assert_eq!(
        untouched.total_pages,
        (8 << 20) / gpufeed_os::page_size() as u64
    );
    for policy in [MemPolicy::Preferred, MemPolicy::Bind] {
        topo.bind_memory(buf.as_ptr(), buf.len(), node, policy)
            .expect("mbind");
    }
    buf.fill(0x5A); // first touch after binding
    let placed = placement_of(buf.as_ptr(), buf.len()).expect("placement");
    assert_eq!(placed.not_present, 0, "{placed:?}");
    assert_eq!(placed.single_node(), Some(node), "{placed:?}");
    assert_eq!(placed.pages_per_node[&node], placed.total_pages);
    assert!(buf.iter().all(|&b| b == 0x5A), "binding changed contents");
    assert!(
        topo.bind_memory(buf.as_ptr(), buf.len(), 9999, MemPolicy::Bind)
            .is_err()
    );
}

#[cfg(feature = "hwloc")]
#[test]
fn hwloc_and_sysfs_agree_on_this_machine() {
    let hw = Topology::from_hwloc().expect("hwloc topology");
    let sys = Topology::from_sysfs("/sys").expect("sysfs topology");
    assert_eq!(hw.backend(), &gpufeed_numa::Backend::Hwloc);
    let shape = |t: &Topology| {
        t.nodes()
            .iter()
            .map(|n| (n.id, n.cpus.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(shape(&hw), shape(&sys));
    for (a, b) in hw.nodes().iter().zip(sys.nodes()) {
        if let (Some(x), Some(y)) = (a.memory_bytes, b.memory_bytes) {
            let diff = x.abs_diff(y) as f64 / y as f64;
            assert!(diff < 0.05, "node {} memory: hwloc {x}, sysfs {y}", a.id);
        }
        if !a.distances.is_empty() && !b.distances.is_empty() {
            assert_eq!(a.distances, b.distances, "node {}", a.id);
        }
    }
    // Every device hwloc keeps is in /sys, on the same node.
    assert!(!hw.pci_devices().is_empty() || sys.pci_devices().is_empty());
    for dev in hw.pci_devices() {
        let id = dev.address.to_string();
        assert_eq!(
            hw.node_of_pci(&id).expect("hwloc"),
            sys.node_of_pci(&id).expect("sysfs"),
            "{id}"
        );
        let s = sys.pci_device(&id).expect("in sysfs");
        assert_eq!(
            (dev.vendor, dev.class >> 8),
            (s.vendor, s.class >> 8),
            "{id}"
        );
    }
}
