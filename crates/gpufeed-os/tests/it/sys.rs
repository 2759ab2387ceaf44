use std::path::Path;

use gpufeed_os::sys::SystemInfo;

#[test]
fn system_info_reads_what_this_machine_has() {
    let info = SystemInfo::read();
    eprintln!("{info:#?}");
    assert!(info.page_size.is_power_of_two() && info.page_size >= 4096);
    let total = *info.mem_total.as_ref().expect("MemTotal");
    let available = *info.mem_available.as_ref().expect("MemAvailable");
    assert!(
        available > 0 && available <= total,
        "{available} of {total}"
    );

    // An item is readable exactly when its file exists.
    let exists = |p: &str| Path::new(p).exists();
    assert_eq!(
        info.thp_anon.is_ok(),
        exists("/sys/kernel/mm/transparent_hugepage/enabled")
    );
    assert_eq!(
        info.thp_shmem.is_ok(),
        exists("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    );
    assert_eq!(
        info.io_uring_disabled.is_ok(),
        exists("/proc/sys/kernel/io_uring_disabled")
    );
    assert_eq!(
        info.numa_balancing.is_ok(),
        exists("/proc/sys/kernel/numa_balancing")
    );
    assert_eq!(
        info.memory_pressure.is_ok(),
        exists("/proc/pressure/memory")
    );
    if let Ok(s) = info.swappiness {
        assert!(s <= 200, "swappiness {s}");
    }
    if let Err(why) = &info.io_uring_disabled {
        assert!(why.reason.contains("6.6"), "{why}");
    }
    let shm = info.shm.as_ref().expect("/dev/shm");
    assert!(shm.free_bytes <= shm.total_bytes);
    if let Ok(huge) = info.huge_page_size {
        assert!(huge.is_power_of_two() && huge > info.page_size as u64);
    }
}
