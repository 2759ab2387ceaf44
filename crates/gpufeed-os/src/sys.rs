//! What the machine allows: memory, page sizes, limits and the kernel settings that decide how
//! fast data reaches the GPU.
//!
//! [`SystemInfo::read`] never fails and never panics: an item that cannot be read is a
//! [`Reading`] holding the reason (container without /sys, an older kernel, ...).

use std::fmt;
use std::path::Path;

use crate::lock;
use crate::procfs::{self, Psi};

/// Why an item of [`SystemInfo`] could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    /// Where it was looked for.
    pub source: String,
    /// Why it could not be read.
    pub reason: String,
}

impl fmt::Display for Unreadable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.source, self.reason)
    }
}

/// One item of [`SystemInfo`]: the value, or why it could not be read.
pub type Reading<T> = Result<T, Unreadable>;

/// A transparent-huge-page setting (the bracketed word of the sysfs file).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ThpMode {
    /// `always`
    Always,
    /// `madvise` (anonymous memory): only where `MADV_HUGEPAGE` asks.
    Madvise,
    /// `advise` (shmem): only where `MADV_HUGEPAGE` asks.
    Advise,
    /// `within_size` (shmem): when the huge page fits inside the file.
    WithinSize,
    /// `never`
    Never,
    /// `deny` (shmem): never, also overriding mount options.
    Deny,
    /// `force` (shmem): always, also for all mounts.
    Force,
    /// `inherit` (per-size settings)
    Inherit,
    /// A word this version does not know.
    Other(String),
}

impl ThpMode {
    fn parse(text: &str) -> Option<Self> {
        Some(match procfs::bracketed(text)? {
            "always" => ThpMode::Always,
            "madvise" => ThpMode::Madvise,
            "advise" => ThpMode::Advise,
            "within_size" => ThpMode::WithinSize,
            "never" => ThpMode::Never,
            "deny" => ThpMode::Deny,
            "force" => ThpMode::Force,
            "inherit" => ThpMode::Inherit,
            other => ThpMode::Other(other.to_owned()),
        })
    }
}

/// The kernel's word for the mode (`madvise`, `never`, ...).
impl std::fmt::Display for ThpMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ThpMode::Always => "always",
            ThpMode::Madvise => "madvise",
            ThpMode::Advise => "advise",
            ThpMode::WithinSize => "within_size",
            ThpMode::Never => "never",
            ThpMode::Deny => "deny",
            ThpMode::Force => "force",
            ThpMode::Inherit => "inherit",
            ThpMode::Other(word) => word,
        })
    }
}

/// Size and free space of a file system, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsSpace {
    /// Total bytes.
    pub total_bytes: u64,
    /// Bytes an unprivileged process may still use.
    pub free_bytes: u64,
}

/// Memory pressure-stall information (`/proc/pressure/memory`).
pub type MemoryPressure = Psi;
pub use crate::procfs::PsiLine;

/// The settings of this machine that matter for moving data to a GPU.
#[derive(Debug, Clone)]
pub struct SystemInfo {
    /// Base page size in bytes.
    pub page_size: usize,
    /// Default huge page size in bytes (`Hugepagesize` of /proc/meminfo).
    pub huge_page_size: Reading<u64>,
    /// THP for anonymous memory (`/sys/kernel/mm/transparent_hugepage/enabled`).
    pub thp_anon: Reading<ThpMode>,
    /// THP for shmem/tmpfs (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`).
    pub thp_shmem: Reading<ThpMode>,
    /// `vm.swappiness`.
    pub swappiness: Reading<u64>,
    /// `vm.min_free_kbytes`.
    pub min_free_kbytes: Reading<u64>,
    /// `kernel.numa_balancing` (0 off, 1 on, 2 memory tiering).
    pub numa_balancing: Reading<u64>,
    /// `RLIMIT_MEMLOCK` of this process.
    pub memlock: lock::Limit,
    /// Whether this process has `CAP_IPC_LOCK` (no memlock limit applies).
    pub cap_ipc_lock: bool,
    /// Size and free space of `/dev/shm`.
    pub shm: Reading<FsSpace>,
    /// `kernel.io_uring_disabled` (0 allowed, 1 only for the `io_uring_group`, 2 disabled).
    pub io_uring_disabled: Reading<u64>,
    /// `MemTotal` in bytes.
    pub mem_total: Reading<u64>,
    /// `MemAvailable` in bytes: what can be allocated without swapping.
    pub mem_available: Reading<u64>,
    /// Memory pressure.
    pub memory_pressure: Reading<MemoryPressure>,
}

impl SystemInfo {
    /// Reads everything from this machine's /proc, /sys and system calls.
    ///
    /// # Example
    /// ```
    /// let info = gpufeed_os::sys::SystemInfo::read();
    /// assert!(info.page_size.is_power_of_two());
    /// match &info.mem_available {
    ///     Ok(bytes) => println!("{bytes} bytes available"),
    ///     Err(why) => println!("MemAvailable unreadable: {why}"),
    /// }
    /// ```
    pub fn read() -> Self {
        let meminfo = read_text("/proc/meminfo");
        let meminfo_item = |key: &str| {
            let text = meminfo.as_ref().map_err(Clone::clone)?;
            procfs::meminfo_bytes(text, key).ok_or_else(|| Unreadable {
                source: "/proc/meminfo".to_owned(),
                reason: format!("no {key} line"),
            })
        };
        SystemInfo {
            page_size: crate::page_size(),
            huge_page_size: meminfo_item("Hugepagesize"),
            thp_anon: parse_file("/sys/kernel/mm/transparent_hugepage/enabled", ThpMode::parse),
            thp_shmem: parse_file("/sys/kernel/mm/transparent_hugepage/shmem_enabled", ThpMode::parse),
            swappiness: parse_file("/proc/sys/vm/swappiness", procfs::single_u64),
            min_free_kbytes: parse_file("/proc/sys/vm/min_free_kbytes", procfs::single_u64),
            numa_balancing: parse_file("/proc/sys/kernel/numa_balancing", procfs::single_u64),
            memlock: lock::memlock_limit(),
            cap_ipc_lock: lock::has_cap_ipc_lock(),
            shm: fs_space(Path::new(crate::shm::DEFAULT_DIR)),
            io_uring_disabled: parse_file("/proc/sys/kernel/io_uring_disabled", procfs::single_u64)
                .map_err(|mut e| {
                    e.reason.push_str(" (absent before Linux 6.6, where io_uring is allowed unless seccomp refuses it)");
                    e
                }),
            mem_total: meminfo_item("MemTotal"),
            mem_available: meminfo_item("MemAvailable"),
            memory_pressure: parse_file("/proc/pressure/memory", procfs::psi).map_err(|mut e| {
                e.reason.push_str(" (needs Linux 4.20+ with CONFIG_PSI and psi not disabled at boot)");
                e
            }),
        }
    }
}

/// `MemAvailable` alone (one read of /proc/meminfo), for callers on a hot path that need only
/// it rather than all of [`SystemInfo::read`].
pub fn mem_available() -> Reading<u64> {
    let text = read_text("/proc/meminfo")?;
    procfs::meminfo_bytes(&text, "MemAvailable").ok_or_else(|| Unreadable {
        source: "/proc/meminfo".to_owned(),
        reason: "no MemAvailable line".to_owned(),
    })
}

fn read_text(path: &str) -> Reading<String> {
    std::fs::read_to_string(path).map_err(|e| Unreadable {
        source: path.to_owned(),
        reason: e.to_string(),
    })
}

fn parse_file<T>(path: &str, parse: impl FnOnce(&str) -> Option<T>) -> Reading<T> {
    let text = read_text(path)?;
    parse(&text).ok_or_else(|| Unreadable {
        source: path.to_owned(),
        reason: format!("unexpected contents {:?}", text.trim()),
    })
}

/// Size and free space of the file system holding `dir`.
pub fn fs_space(dir: &Path) -> Reading<FsSpace> {
    let vfs = rustix::fs::statvfs(dir).map_err(|e| Unreadable {
        source: dir.display().to_string(),
        reason: format!("statvfs: {e}"),
    })?;
    Ok(FsSpace {
        total_bytes: vfs.f_blocks.saturating_mul(vfs.f_frsize),
        free_bytes: vfs.f_bavail.saturating_mul(vfs.f_frsize),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thp_words() {
        assert_eq!(
            ThpMode::parse("always [madvise] never\n"),
            Some(ThpMode::Madvise)
        );
        assert_eq!(
            ThpMode::parse("always within_size advise [never] deny force\n"),
            Some(ThpMode::Never)
        );
        assert_eq!(
            ThpMode::parse("[always] within_size advise never deny force\n"),
            Some(ThpMode::Always)
        );
        assert_eq!(
            ThpMode::parse("[sometimes] never"),
            Some(ThpMode::Other("sometimes".into()))
        );
        assert_eq!(ThpMode::Madvise.to_string(), "madvise");
        assert_eq!(ThpMode::WithinSize.to_string(), "within_size");
        assert_eq!(ThpMode::parse("always never"), None);
    }

    #[test]
    fn unreadable_items_carry_the_reason() {
        let err = parse_file("/nonexistent/gpufeed/item", procfs::single_u64).unwrap_err();
        assert_eq!(err.source, "/nonexistent/gpufeed/item");
        assert!(err.reason.contains("No such file"), "{err}");
        let err = fs_space(Path::new("/nonexistent/gpufeed")).unwrap_err();
        assert!(err.reason.starts_with("statvfs"), "{err}");
    }
}
