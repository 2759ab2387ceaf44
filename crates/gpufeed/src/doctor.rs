//! `doctor`: the source material's troubleshooting guide as checks of this machine, each with
//! what was read and the fix. The CLI prints them (`gpufeed doctor`).

use std::path::Path;

use gpufeed_os::sys::{SystemInfo, ThpMode};

use gpufeed_os::units::show_size;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Fine.
    Ok,
    /// Works, but slower or riskier than it could be.
    Warn,
    /// Broken: gpufeed cannot do this here.
    Fail,
}

/// One check.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// The outcome.
    pub status: Status,
    /// What was read.
    pub observed: String,
    /// What to do about it (a command where there is one).
    pub fix: Option<String>,
}

fn check(name: &str, status: Status, observed: impl Into<String>, fix: Option<&str>) -> Check {
    Check {
        name: name.to_owned(),
        status,
        observed: observed.into(),
        fix: fix.map(str::to_owned),
    }
}

/// Runs every check; `dir` is where data will be read from (for the O_DIRECT check), the
/// current directory by default.
pub fn run(dir: Option<&Path>) -> Vec<Check> {
    let info = SystemInfo::read();
    let mut out = Vec::new();

    // Memory locking: CPU-mode pools and io_uring registered buffers count against it.
    let soft = info.memlock.soft;
    out.push(match (info.cap_ipc_lock, soft) {
        (true, _) => check("memlock limit", Status::Ok, "CAP_IPC_LOCK: no limit applies", None),
        (false, None) => check("memlock limit", Status::Ok, "RLIMIT_MEMLOCK unlimited", None),
        (false, Some(s)) if s < 64 << 20 => check(
            "memlock limit",
            Status::Warn,
            format!("RLIMIT_MEMLOCK {}: locked staging and registered io_uring buffers are capped", show_size(s)),
            Some("ulimit -l unlimited   (Docker: --ulimit memlock=-1; systemd: LimitMEMLOCK=infinity)"),
        ),
        (false, Some(s)) => check("memlock limit", Status::Ok, format!("RLIMIT_MEMLOCK {}", show_size(s)), None),
    });

    out.push(match &info.shm {
        Ok(shm) if shm.total_bytes < 1 << 30 => check(
            "/dev/shm",
            Status::Warn,
            format!(
                "{} total, {} free: too small for shared-memory batches",
                show_size(shm.total_bytes),
                show_size(shm.free_bytes)
            ),
            Some("docker run --shm-size=16g ... (or --ipc=host)"),
        ),
        Ok(shm) if shm.free_bytes < shm.total_bytes / 10 => check(
            "/dev/shm",
            Status::Warn,
            format!(
                "{} free of {}",
                show_size(shm.free_bytes),
                show_size(shm.total_bytes)
            ),
            Some("gpufeed shm gc   (removes segments of dead gpufeed processes)"),
        ),
        Ok(shm) => check(
            "/dev/shm",
            Status::Ok,
            format!(
                "{} free of {}",
                show_size(shm.free_bytes),
                show_size(shm.total_bytes)
            ),
            None,
        ),
        Err(e) => check(
            "/dev/shm",
            Status::Fail,
            e.to_string(),
            Some("mount a tmpfs at /dev/shm"),
        ),
    });

    out.push(match &info.thp_anon {
        Ok(ThpMode::Never) => check(
            "transparent huge pages",
            Status::Warn,
            "never: large buffers pay a TLB miss per 4 KiB",
            Some("echo madvise > /sys/kernel/mm/transparent_hugepage/enabled"),
        ),
        Ok(m) => check("transparent huge pages", Status::Ok, m.to_string(), None),
        Err(e) => check(
            "transparent huge pages",
            Status::Ok,
            format!("unreadable ({e})"),
            None,
        ),
    });

    let topology = gpufeed_numa::Topology::detect().ok();
    let multi_node = topology.as_ref().is_some_and(|t| t.is_numa());
    out.push(match (&info.numa_balancing, multi_node) {
        (Ok(v), true) if *v != 0 => check(
            "NUMA balancing",
            Status::Warn,
            format!("kernel.numa_balancing={v} on a multi-node machine: pages migrate under running copies (unstable throughput)"),
            Some("sysctl -w kernel.numa_balancing=0"),
        ),
        (Ok(v), _) => check("NUMA balancing", Status::Ok, format!("kernel.numa_balancing={v}, {}", if multi_node { "several NUMA nodes" } else { "one NUMA node" }), None),
        (Err(_), _) => check("NUMA balancing", Status::Ok, "not available (kernel without NUMA balancing)", None),
    });

    out.push(match info.swappiness.clone() {
        Ok(v) if v > 60 => check(
            "swappiness",
            Status::Warn,
            format!("vm.swappiness={v}: data-set pages get swapped out under pressure"),
            Some("sysctl -w vm.swappiness=10"),
        ),
        Ok(v) => check("swappiness", Status::Ok, format!("vm.swappiness={v}"), None),
        Err(e) => check("swappiness", Status::Ok, format!("unreadable ({e})"), None),
    });

    let min_free_fix = info
        .mem_total
        .as_ref()
        .map(|t| {
            format!(
                "sysctl -w vm.min_free_kbytes={}",
                (t / 1000 / 1024).max(65536)
            )
        })
        .unwrap_or_default();
    out.push(
        match (info.min_free_kbytes.clone(), info.mem_total.clone()) {
            (Ok(kb), Ok(total)) if kb * 1024 < total / 1000 => check(
                "min_free_kbytes",
                Status::Warn,
                format!(
                    "vm.min_free_kbytes={kb}: little reserve for bursts of page-cache allocation"
                ),
                Some(&min_free_fix),
            ),
            (Ok(kb), _) => check(
                "min_free_kbytes",
                Status::Ok,
                format!("vm.min_free_kbytes={kb}"),
                None,
            ),
            (Err(e), _) => check(
                "min_free_kbytes",
                Status::Ok,
                format!("unreadable ({e})"),
                None,
            ),
        },
    );

    out.push(
        match (
            &info.memory_pressure,
            info.mem_available.clone(),
            info.mem_total.clone(),
        ) {
            (Ok(psi), _, _) if psi.some.avg10 > 10.0 => check(
                "memory pressure",
                Status::Warn,
                format!(
                    "PSI some avg10={:.1}%: tasks are stalling on memory",
                    psi.some.avg10
                ),
                Some("free memory, or reduce the page cache others use (unstable throughput)"),
            ),
            (_, Ok(a), Ok(t)) if a < t / 10 => check(
                "memory pressure",
                Status::Warn,
                format!("MemAvailable {} of {}", show_size(a), show_size(t)),
                Some("free memory before loading large files"),
            ),
            (psi, a, _) => check(
                "memory pressure",
                Status::Ok,
                format!(
                    "MemAvailable {}{}",
                    a.as_ref().map_or("?".into(), |a| show_size(*a)),
                    psi.as_ref().map_or(String::new(), |p| format!(
                        ", PSI some avg10={:.1}%",
                        p.some.avg10
                    ))
                ),
                None,
            ),
        },
    );

    out.push(match gpufeed_uring::Backend::probe().io_uring {
        Ok(()) => check("io_uring", Status::Ok, "works", None),
        Err(why) => check(
            "io_uring",
            Status::Warn,
            format!("unavailable: {why}; reads use the thread pool"),
            Some("allow io_uring (sysctl kernel.io_uring_disabled=0, or a seccomp profile permitting io_uring_setup/enter/register)"),
        ),
    });

    let dir = dir.unwrap_or(Path::new("."));
    out.push(direct_io(dir));
    out.push(gds(dir));

    match gpufeed_cuda::Gpu::list() {
        // The error's own sentence carries the fix; the fix column says it once.
        Err(gpufeed_cuda::Error::NoCudaDriver) => out.push(check(
            "CUDA driver",
            Status::Warn,
            "none: libcuda.so could not be loaded",
            Some(
                "install the NVIDIA driver (in a container: the NVIDIA container toolkit and \
                 --gpus) to use GPUs; the CPU paths work without it",
            ),
        )),
        Err(e) => out.push(check(
            "CUDA driver",
            Status::Warn,
            e.to_string(),
            Some("check the NVIDIA driver with nvidia-smi; the CPU paths work without it"),
        )),
        Ok(gpus) if gpus.is_empty() => out.push(check(
            "CUDA driver",
            Status::Warn,
            "driver present, no GPU visible",
            Some("check CUDA_VISIBLE_DEVICES"),
        )),
        Ok(gpus) => {
            out.push(check(
                "CUDA driver",
                Status::Ok,
                format!("{} GPU(s)", gpus.len()),
                None,
            ));
            for g in &gpus {
                let link = match (g.pcie_gen, g.pcie_width) {
                    (Some(gn), Some(w)) => format!("PCIe Gen{gn} x{w}"),
                    _ => "PCIe link unknown".into(),
                };
                out.push(check(
                    &format!("GPU {}", g.ordinal),
                    Status::Ok,
                    format!(
                        "{} at {}, NUMA node {}, {link}, {}",
                        g.name,
                        g.pci_bus_id,
                        g.numa_node.map_or("unknown".into(), |n| n.to_string()),
                        show_size(g.memory_bytes)
                    ),
                    None,
                ));
            }
            if gpus.len() > 1 {
                out.push(peer_links());
            }
            out.push(nccl(gpus.len()));
            out.push(nvjpeg());
            out.push(gds_probe(dir));
            out.push(pinned_and_registration());
            if let (Some(t), Some(node)) = (&topology, gpus[0].numa_node) {
                let here = t.node_of_cpu(rustix::thread::sched_getcpu() as u32);
                let fix = format!("numactl --cpunodebind={node} --membind={node} <your program>");
                out.push(if t.is_numa() && here != Some(node) {
                    check(
                        "placement",
                        Status::Warn,
                        format!(
                            "this process runs on node {}, GPU 0 on node {node}",
                            here.map_or("unknown".into(), |n| n.to_string())
                        ),
                        Some(&fix),
                    )
                } else {
                    check(
                        "placement",
                        Status::Ok,
                        format!("GPU 0 is on node {node}; so is this process"),
                        None,
                    )
                });
            }
        }
    }

    out.push(
        match gpufeed_os::shm::list(gpufeed_os::shm::DEFAULT_PREFIX) {
            Ok(list) => {
                let stale: Vec<_> = list
                    .iter()
                    .filter(|e| e.owner == gpufeed_os::process::Liveness::Dead)
                    .collect();
                if stale.is_empty() {
                    check(
                        "stale shared memory",
                        Status::Ok,
                        format!("{} gpufeed segment(s), none stale", list.len()),
                        None,
                    )
                } else {
                    let bytes: u64 = stale.iter().map(|e| e.len).sum();
                    check(
                        "stale shared memory",
                        Status::Warn,
                        format!(
                            "{} segment(s) of dead processes hold {}",
                            stale.len(),
                            show_size(bytes)
                        ),
                        Some("gpufeed shm gc"),
                    )
                }
            }
            Err(e) => check(
                "stale shared memory",
                Status::Ok,
                format!("cannot list /dev/shm ({e})"),
                None,
            ),
        },
    );
    out
}

fn direct_io(dir: &Path) -> Check {
    // A random name created with O_CREAT|O_EXCL (never through a planted symlink), removed
    // when `probe` drops.
    let result = tempfile::Builder::new()
        .prefix(".gpufeed-doctor-")
        .tempfile_in(dir)
        .map_err(|e| e.to_string())
        .and_then(|mut probe| {
            use std::io::Write;
            probe.write_all(&[0u8; 4096]).map_err(|e| e.to_string())?;
            gpufeed_os::align::dio_alignment(probe.as_file()).map_err(|e| e.to_string())
        });
    match result {
        Ok(d) if d.supported() => check(
            "O_DIRECT",
            Status::Ok,
            format!(
                "{}: offsets aligned to {} B, memory to {} B (from {})",
                dir.display(),
                d.offset_align,
                d.mem_align,
                d.source
            ),
            None,
        ),
        Ok(_) => check(
            "O_DIRECT",
            Status::Warn,
            format!(
                "{}: the file system refuses O_DIRECT (tmpfs, some network file systems)",
                dir.display()
            ),
            Some(
                "put cold data sets on a local disk file system (ext4, xfs) to read them at the disk's speed",
            ),
        ),
        Err(e) => check(
            "O_DIRECT",
            Status::Warn,
            format!("{}: cannot test ({e})", dir.display()),
            Some("pass --path DIR where data lives"),
        ),
    }
}

fn pinned_and_registration() -> Check {
    let run = || -> crate::Result<()> {
        let gpu = gpufeed_cuda::Gpu::open(0)?;
        let _pinned = gpufeed_pinned::PinnedBuffer::new(gpu.context(), 1 << 20)?;
        let data = vec![1u8; 1 << 20];
        let _reg = gpufeed_pinned::HostRegistration::slice(gpu.context(), &data)?;
        Ok(())
    };
    match run() {
        Ok(()) => check(
            "pinned memory",
            Status::Ok,
            "cuMemHostAlloc and cuMemHostRegister of 1 MiB work",
            None,
        ),
        Err(e) => check(
            "pinned memory",
            Status::Fail,
            e.to_string(),
            Some("page-locked memory is refused: raise the container's limits (WSL/Docker caps)"),
        ),
    }
}

/// Which GPUs reach which as peers, and over what (several GPUs only): a pair without peer
/// access makes replicated loads copy through host memory.
fn peer_links() -> Check {
    match gpufeed_cuda::Gpu::peer_links() {
        Ok(links) => {
            let described: Vec<String> = links
                .iter()
                .map(|l| {
                    format!(
                        "{}->{} {}{}",
                        l.from,
                        l.to,
                        l.kind(),
                        l.performance_rank
                            .map_or(String::new(), |r| format!(" (rank {r})"))
                    )
                })
                .collect();
            if links.iter().all(|l| l.access) {
                check("GPU peers", Status::Ok, described.join(", "), None)
            } else {
                check(
                    "GPU peers",
                    Status::Warn,
                    described.join(", "),
                    Some(
                        "GPUs without peer access copy through host memory: replicated loads \
                         (MultiLoader::load_replicated) run slower; check `nvidia-smi topo -m` \
                         and the IOMMU/ACS settings",
                    ),
                )
            }
        }
        Err(e) => check("GPU peers", Status::Warn, e.to_string(), None),
    }
}

/// Whether NCCL loads (only `RankLoader::with_nccl`, `GPUFEED_REPLICATE=nccl`, needs it): a
/// warning where it is missing on a machine of several GPUs.
fn nccl(gpus: usize) -> Check {
    match gpufeed_cuda::nccl_version() {
        Ok(v) => check("NCCL", Status::Ok, v, None),
        Err(e) if gpus > 1 => check(
            "NCCL",
            Status::Warn,
            e.to_string(),
            Some(
                "only replicated loads through NCCL need it (RankLoader::with_nccl, \
                 GPUFEED_REPLICATE=nccl): install libnccl2 or point GPUFEED_NCCL_LIBRARY at \
                 libnccl.so.2",
            ),
        ),
        Err(e) => check(
            "NCCL",
            Status::Ok,
            format!("not loaded, one GPU: {e}"),
            None,
        ),
    }
}

/// GPUDirect Storage for files in `dir`: available (peer-to-peer), compat only (cuFile's
/// POSIX reads through host memory), or absent, from the machine ([`gpufeed_cuda::gds::detect`]:
/// the library, nvidia-fs, P2PDMA, cufile.json, the file system of `dir`), with the reason
/// and the fix. Never a warning: gpufeed's own `O_DIRECT` path needs no cuFile.
fn gds(dir: &Path) -> Check {
    let library = gpufeed_cuda::cufile_version().map_err(|e| e.to_string());
    let d = gpufeed_cuda::gds::detect(Some(dir), library, &gpufeed_cuda::gds::GdsRoots::system());
    check(
        "GPUDirect Storage",
        Status::Ok,
        format!("{}: {}", d.verdict, d.reason),
        d.fix.as_deref(),
    )
}

/// A probe load through cuFile (`Strategy::Gds`, its paths counted) of a file written in `dir`
/// (4 MiB and a few bytes of a pattern, removed after, checked on the way back): which path
/// cuFile's statistics say served it, or why cuFile refused it and gpufeed's own path ran.
fn gds_probe(dir: &Path) -> Check {
    const NAME: &str = "cuFile probe read";
    /// Why the probe gave no report: wrong bytes (a failure), or anything else.
    enum Failed {
        WrongBytes(String),
        Other(String),
    }
    let run = || -> Result<crate::LoadReport, Failed> {
        use std::io::Write;
        let data: Vec<u8> = (0..(4u32 << 20) + 4093)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        let mut probe = tempfile::Builder::new()
            .prefix(".gpufeed-doctor-gds-")
            .tempfile_in(dir)
            .map_err(|e| Failed::Other(format!("creating a probe file: {e}")))?;
        probe
            .write_all(&data)
            .and_then(|()| probe.as_file().sync_all())
            .map_err(|e| Failed::Other(format!("writing the probe file: {e}")))?;
        let gpu = gpufeed_cuda::Gpu::open(0).map_err(|e| Failed::Other(e.to_string()))?;
        let mut opts = crate::LoadOptions::default().with_strategy(crate::Strategy::Gds);
        opts.gds_path_counts = true;
        let (buf, report) =
            crate::load_file(&gpu, probe.path(), opts).map_err(|e| Failed::Other(e.to_string()))?;
        if gpu.to_vec(&buf).map_err(|e| Failed::Other(e.to_string()))? != data {
            return Err(Failed::WrongBytes(format!(
                "the bytes read back by {} ({}) differ from the file's",
                report.strategy,
                report.io_backend.unwrap_or_default()
            )));
        }
        Ok(report)
    };
    match run() {
        Ok(r) if r.strategy == crate::Strategy::Gds => check(
            NAME,
            Status::Ok,
            format!("{}: {}", dir.display(), r.io_backend.unwrap_or_default()),
            None,
        ),
        Ok(r) => check(
            NAME,
            Status::Ok,
            format!(
                "{}: not read by cuFile ({}); {} ran",
                dir.display(),
                r.fallbacks
                    .iter()
                    .filter(|f| f.refused == crate::Refused::Gds)
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
                r.strategy
            ),
            None,
        ),
        Err(Failed::WrongBytes(e)) => check(
            NAME,
            Status::Fail,
            format!("{}: {e}", dir.display()),
            Some("report this with `gpufeed doctor --json`: a load returned wrong bytes"),
        ),
        Err(Failed::Other(e)) => check(NAME, Status::Ok, format!("{}: {e}", dir.display()), None),
    }
}

/// Whether nvJPEG loads (the image loader decodes on the GPU with it; without it, on the
/// CPU): its version and library, or why not, never a warning.
fn nvjpeg() -> Check {
    match gpufeed_cuda::nvjpeg_version() {
        Ok(v) => check("nvJPEG", Status::Ok, v, None),
        Err(e) => check("nvJPEG", Status::Ok, format!("not loaded: {e}"), None),
    }
}

/// Whether any check failed (the CLI exits 1 then).
pub fn any_failed(checks: &[Check]) -> bool {
    checks.iter().any(|c| c.status == Status::Fail)
}
