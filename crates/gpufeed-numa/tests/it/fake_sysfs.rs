//! A temporary directory laid out like the /sys of a 2-socket machine with 4 GPUs, 2 per
//! socket, read through the same code as the real /sys.

use std::path::Path;

use gpufeed_numa::{Error, Topology};

fn write(root: &Path, rel: &str, text: &str) {
    let path = root.join(rel);
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, text).expect("write");
}

fn pci(root: &Path, addr: &str, vendor: &str, class: &str, node: &str, cpus: &str) {
    let dir = format!("bus/pci/devices/{addr}");
    write(root, &format!("{dir}/vendor"), &format!("{vendor}\n"));
    write(root, &format!("{dir}/class"), &format!("{class}\n"));
    write(root, &format!("{dir}/numa_node"), &format!("{node}\n"));
    write(root, &format!("{dir}/local_cpulist"), &format!("{cpus}\n"));
}

/// Two sockets of 8 cores + 8 hyperthreads each, 4 H100-like GPUs, a NIC, and a device whose
/// firmware gives no locality.
fn two_socket_machine() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    write(root, "devices/system/node/online", "0-1\n");
    write(root, "devices/system/node/possible", "0-1\n");
    write(root, "devices/system/node/node0/cpulist", "0-7,16-23\n");
    write(root, "devices/system/node/node1/cpulist", "8-15,24-31\n");
    write(
        root,
        "devices/system/node/node0/meminfo",
        "Node 0 MemTotal:       65536000 kB\nNode 0 MemFree:        60000000 kB\n",
    );
    write(
        root,
        "devices/system/node/node1/meminfo",
        "Node 1 MemTotal:       65536000 kB\nNode 1 MemFree:        61000000 kB\n",
    );
    write(root, "devices/system/node/node0/distance", "10 21\n");
    write(root, "devices/system/node/node1/distance", "21 10\n");
    pci(root, "0000:18:00.0", "0x10de", "0x030200", "0", "0-7,16-23");
    pci(root, "0000:3b:00.0", "0x10de", "0x030200", "0", "0-7,16-23");
    pci(
        root,
        "0000:86:00.0",
        "0x10de",
        "0x030200",
        "1",
        "8-15,24-31",
    );
    pci(
        root,
        "0000:af:00.0",
        "0x10de",
        "0x030200",
        "1",
        "8-15,24-31",
    );
    pci(root, "0000:5e:00.0", "0x15b3", "0x020000", "0", "0-7,16-23"); // a NIC
    pci(
        root,
        "0000:00:1f.0",
        "0x8086",
        "0x060100",
        "-1",
        "8-15,24-31",
    ); // no firmware locality
    pci(root, "0000:00:1f.2", "0x8086", "0x010601", "-1", "0-31"); // spans both sockets
    dir
}

#[test]
fn nodes_cpus_memory_and_distances() {
    let dir = two_socket_machine();
    let topo = Topology::from_sysfs(dir.path()).expect("read fake sysfs");
    assert!(topo.is_numa());
    let ids: Vec<u32> = topo.nodes().iter().map(|n| n.id).collect();
    assert_eq!(ids, vec![0, 1]);
    let n0 = topo.node(0).expect("node 0");
    assert_eq!(n0.cpus, (0..8).chain(16..24).collect::<Vec<u32>>());
    assert_eq!(n0.memory_bytes, Some(65_536_000 * 1024));
    assert_eq!(n0.distances, vec![10, 21]);
    assert_eq!(topo.node(1).expect("node 1").distances, vec![21, 10]);
    assert_eq!(topo.node_of_cpu(17), Some(0));
    assert_eq!(topo.node_of_cpu(30), Some(1));
    assert_eq!(topo.node_of_cpu(99), None);
    assert_eq!(topo.pci_devices().len(), 7);
}

#[test]
fn gpus_map_to_their_socket_in_every_bus_id_form() {
    let dir = two_socket_machine();
    let topo = Topology::from_sysfs(dir.path()).expect("read fake sysfs");
    let gpus: Vec<String> = topo.gpus().map(|g| g.address.to_string()).collect();
    assert_eq!(
        gpus,
        [
            "0000:18:00.0",
            "0000:3b:00.0",
            "0000:86:00.0",
            "0000:af:00.0"
        ]
    );
    for (bus_id, node) in [
        ("0000:18:00.0", 0),
        ("00000000:3B:00.0", 0), // nvidia-smi
        ("0000:86:00.0", 1),
        ("0000:AF:00.0", 1), // CUDA's cuDeviceGetPCIBusId
        ("af:00.0", 1),      // lspci
    ] {
        assert_eq!(
            topo.node_of_pci(bus_id).expect(bus_id),
            Some(node),
            "{bus_id}"
        );
    }
    // No firmware locality: the local CPUs decide when they sit on one node...
    assert_eq!(topo.node_of_pci("0000:00:1f.0").expect("device"), Some(1));
    // ...and nothing is claimed when they span nodes.
    assert_eq!(topo.node_of_pci("0000:00:1f.2").expect("device"), None);
}

#[test]
fn unknown_and_malformed_bus_ids() {
    let dir = two_socket_machine();
    let topo = Topology::from_sysfs(dir.path()).expect("read fake sysfs");
    let err = topo.node_of_pci("0000:99:00.0").unwrap_err();
    assert!(
        matches!(&err, Error::UnknownPciDevice { known, .. } if known.len() == 4),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("0000:3b:00.0") && msg.contains("GPUs"),
        "the message lists the GPUs: {msg}"
    );
    let err = topo.node_of_pci("GPU-1234").unwrap_err();
    assert!(matches!(err, Error::InvalidBusId { .. }), "{err:?}");
    assert!(err.to_string().contains("nvidia-smi"));
    let err = topo.node(7).unwrap_err();
    assert!(
        matches!(&err, Error::NodeOutOfRange { node: 7, nodes } if nodes == &[0, 1]),
        "{err:?}"
    );
    assert!(err.to_string().contains("0, 1"));
}

#[test]
fn a_tree_without_numa_is_one_node_of_every_cpu() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(dir.path(), "devices/system/cpu/online", "0-5\n");
    let topo = Topology::from_sysfs(dir.path()).expect("read");
    assert!(!topo.is_numa());
    assert_eq!(topo.nodes().len(), 1);
    assert_eq!(topo.nodes()[0].cpus, vec![0, 1, 2, 3, 4, 5]);
    assert!(topo.pci_devices().is_empty());
    // Bus ids are still checked, and the error says there are no GPUs.
    let err = topo.node_of_pci("0000:3b:00.0").unwrap_err();
    assert!(err.to_string().contains("no NVIDIA GPU"), "{err}");
}

#[test]
fn garbage_in_sysfs_is_an_error_not_a_panic() {
    let dir = two_socket_machine();
    write(dir.path(), "devices/system/node/node1/cpulist", "8-x\n");
    let err = Topology::from_sysfs(dir.path()).unwrap_err();
    assert!(
        matches!(&err, Error::Topology { path, .. } if path.ends_with("node1/cpulist")),
        "{err:?}"
    );
    let dir = two_socket_machine();
    write(
        dir.path(),
        "devices/system/node/node0/distance",
        "10 twenty\n",
    );
    assert!(matches!(
        Topology::from_sysfs(dir.path()),
        Err(Error::Topology { .. })
    ));
}

#[test]
fn refused_bindings_say_why() {
    // A node whose CPUs and memory this kernel does not have: the real syscalls refuse.
    let dir = tempfile::tempdir().expect("tempdir");
    write(dir.path(), "devices/system/node/online", "63\n");
    write(
        dir.path(),
        "devices/system/node/node63/cpulist",
        "1000-1001\n",
    );
    let topo = Topology::from_sysfs(dir.path()).expect("read");
    let before = rustix::thread::sched_getaffinity(None).expect("affinity");
    let err = topo.bind_thread(63).unwrap_err();
    assert!(
        matches!(
            err,
            Error::BindRefused {
                what: "bind thread",
                node: 63,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("cpuset"), "{err}");
    assert_eq!(
        rustix::thread::sched_getaffinity(None).expect("affinity"),
        before
    );

    let buf = gpufeed_os::AlignedBuf::new(1 << 20, 4096).expect("alloc");
    let err = topo
        .bind_memory(buf.as_ptr(), buf.len(), 63, gpufeed_numa::MemPolicy::Bind)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::BindRefused {
                what: "bind memory",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("cpuset.mems"), "{err}");
}
