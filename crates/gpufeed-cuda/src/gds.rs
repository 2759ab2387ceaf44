//! GPUDirect Storage (GDS) detection: can cuFile read a file straight from storage into GPU
//! memory here, only through its compatibility mode, or not at all?
//!
//! [`detect`] answers with a [`GdsVerdict`], a sentence naming the facts that decided it and
//! what to change. It reads files only, never loads libcufile (`crate::cufile` does that and
//! passes what it learned) and needs no GPU:
//!
//! - `cufile.json` ([`read_cufile_config`]): `CUFILE_ENV_PATH_JSON` or `/etc/cufile.json`,
//!   JSON with `//` and `/* */` comments; `properties.allow_compat_mode`,
//!   `properties.use_pci_p2pdma`, `properties.vanilla_posix_io_mode`,
//!   `properties.force_compat_mode`.
//! - The nvidia-fs kernel module ([`read_nvidia_fs`]): `/proc/modules`,
//!   `/proc/driver/nvidia-fs/version` (`version: 2.28`, written by nvidia-fs's `nvfs-proc.c`),
//!   `/sys/module/nvidia_fs/version` (`2.28.4`, its `MODULE_VERSION`).
//! - The kernel's PCI P2PDMA ([`read_p2pdma`]): `CONFIG_PCI_P2PDMA` in
//!   `/boot/config-<release>`, the release from `/proc/sys/kernel/osrelease`.
//! - The file system holding a path ([`file_system_of`]): `/proc/self/mountinfo` and the block
//!   device behind it in `/sys/dev/block`.
//!
//! Every location comes from [`GdsRoots`], so tests run the same code against fake trees.
//! An unreadable file is a fact, not an error: it counts as "not loaded" or "unknown" and the
//! reason says so where it decided the outcome.

use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::os::unix::ffi::OsStringExt;
use std::path::{Component, Path, PathBuf};

/// Where detection reads: the real system, or a fake tree in tests.
#[derive(Debug, Clone)]
pub struct GdsRoots {
    /// procfs (`/proc`).
    pub proc_dir: PathBuf,
    /// sysfs (`/sys`).
    pub sys_dir: PathBuf,
    /// The kernel configs (`/boot`).
    pub boot_dir: PathBuf,
    /// Where `cufile.json` is by default (`/etc`).
    pub etc_dir: PathBuf,
    /// Device nodes (`/dev`): nvidia-fs's `nvidia-fs0`... must be there for cuFile to use it.
    pub dev_dir: PathBuf,
    /// Run-time state (`/run`): udev's database, `udev/data/b<MAJ:MIN>`, where cuFile looks
    /// up the attributes of a file's volume.
    pub run_dir: PathBuf,
    /// cufile.json's path: None = CUFILE_ENV_PATH_JSON if set (non-empty), else
    /// `<etc_dir>/cufile.json`.
    pub cufile_json: Option<PathBuf>,
    /// `CUFILE_FORCE_COMPAT_MODE`'s value, which overrides cufile.json (read from the
    /// environment by [`GdsRoots::system`]; `None` in [`GdsRoots::under`]).
    pub force_compat_env: Option<String>,
}

impl GdsRoots {
    /// The running system: `/proc`, `/sys`, `/boot`, `/etc`, and `cufile.json` where cuFile
    /// looks for it (`CUFILE_ENV_PATH_JSON`, else `/etc/cufile.json`).
    pub fn system() -> Self {
        GdsRoots {
            force_compat_env: std::env::var("CUFILE_FORCE_COMPAT_MODE").ok(),
            ..Self::under(Path::new("/"))
        }
    }

    /// A tree laid out like the system under `root`: `root/proc`, `root/sys`, `root/boot`,
    /// `root/etc`; `cufile_json` is None (set it to keep `CUFILE_ENV_PATH_JSON` out of a test).
    pub fn under(root: &Path) -> Self {
        GdsRoots {
            proc_dir: root.join("proc"),
            sys_dir: root.join("sys"),
            boot_dir: root.join("boot"),
            etc_dir: root.join("etc"),
            dev_dir: root.join("dev"),
            run_dir: root.join("run"),
            cufile_json: None,
            force_compat_env: None,
        }
    }

    /// The `cufile.json` cuFile reads: [`GdsRoots::cufile_json`] if set, else
    /// `CUFILE_ENV_PATH_JSON` if set and not empty, else `<etc_dir>/cufile.json`.
    pub fn cufile_json_path(&self) -> PathBuf {
        match &self.cufile_json {
            Some(path) => path.clone(),
            None => cufile_json_from_env(std::env::var_os("CUFILE_ENV_PATH_JSON"), &self.etc_dir),
        }
    }
}

/// cuFile's own choice of its configuration file, given `CUFILE_ENV_PATH_JSON`'s value: the
/// variable when set and not empty, else `<etc_dir>/cufile.json`.
fn cufile_json_from_env(var: Option<OsString>, etc_dir: &Path) -> PathBuf {
    match var {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => etc_dir.join("cufile.json"),
    }
}

/// cuFile's configuration as it affects the read path.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CufileConfig {
    /// The file read (or looked for).
    pub path: PathBuf,
    /// Whether the file exists and could be read.
    pub found: bool,
    /// `properties.allow_compat_mode` (default true): when GDS cannot serve a file, cuFile
    /// reads it with POSIX reads into host memory and a copy; when false it refuses the read.
    pub allow_compat_mode: bool,
    /// `properties.use_pci_p2pdma` (default false): read through the kernel's PCI P2PDMA
    /// instead of nvidia-fs.
    pub use_pci_p2pdma: bool,
    /// `properties.vanilla_posix_io_mode` (cuFile 1.20's name; `posix_io_mode` accepted too),
    /// default false: every read is a plain POSIX read, no peer path is tried.
    pub posix_io_mode: bool,
    /// `properties.force_compat_mode` (default false): every read goes through the
    /// compatibility mode.
    pub force_compat_mode: bool,
    /// Unreadable or unparsable file, or a property of the wrong type: the reason; the
    /// defaults then apply to what could not be read.
    pub error: Option<String>,
}

impl CufileConfig {
    fn defaults(path: PathBuf) -> Self {
        CufileConfig {
            path,
            found: false,
            allow_compat_mode: true,
            use_pci_p2pdma: false,
            posix_io_mode: false,
            force_compat_mode: false,
            error: None,
        }
    }
}

/// Reads `cufile.json` ([`GdsRoots::cufile_json_path`]). A missing file gives cuFile's
/// defaults with `found: false`; an unreadable or broken one the defaults with `error` set.
pub fn read_cufile_config(roots: &GdsRoots) -> CufileConfig {
    let path = roots.cufile_json_path();
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return CufileConfig::defaults(path),
        Err(e) => {
            let error = Some(format!("cannot read {}: {e}", path.display()));
            return CufileConfig {
                error,
                ..CufileConfig::defaults(path)
            };
        }
    };
    let mut config = CufileConfig {
        found: true,
        ..CufileConfig::defaults(path)
    };
    let value: serde_json::Value = match serde_json::from_str(&strip_json_comments(&text)) {
        Ok(value) => value,
        Err(e) => {
            config.error = Some(format!(
                "{} is not valid JSON once comments are removed: {e}; cuFile's defaults apply",
                config.path.display()
            ));
            return config;
        }
    };
    let properties = value.get("properties");
    let mut wrong_types = Vec::new();
    let mut flag = |names: &[&str], default: bool| -> bool {
        for name in names {
            match properties.and_then(|p| p.get(*name)) {
                None => continue,
                Some(serde_json::Value::Bool(b)) => return *b,
                Some(other) => {
                    wrong_types.push(format!("properties.{name} is {other}, not true or false"));
                    return default;
                }
            }
        }
        default
    };
    config.allow_compat_mode = flag(&["allow_compat_mode"], true);
    config.use_pci_p2pdma = flag(&["use_pci_p2pdma"], false);
    config.posix_io_mode = flag(&["vanilla_posix_io_mode", "posix_io_mode"], false);
    config.force_compat_mode = flag(&["force_compat_mode"], false);
    if !wrong_types.is_empty() {
        config.error = Some(format!(
            "{}: {} (the default used)",
            config.path.display(),
            wrong_types.join("; ")
        ));
    }
    config
}

/// cufile.json's text as plain JSON: `//` and `/* */` comments removed outside string
/// literals (a `"//"` inside a string stays) and trailing commas before `}` or `]` dropped.
fn strip_json_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let mut in_string = false;
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            match c {
                '\\' => {
                    if let Some(escaped) = chars.next() {
                        out.push(escaped);
                    }
                }
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '/' if chars.peek() == Some(&'/') => {
                // A line comment: up to (not including) the end of the line.
                while chars.peek().is_some_and(|&n| n != '\n') {
                    chars.next();
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut prev = '\0';
                for n in chars.by_ref() {
                    if prev == '*' && n == '/' {
                        break;
                    }
                    prev = n;
                }
                // Keeps tokens on either side apart, as the comment did.
                out.push(' ');
            }
            _ => out.push(c),
        }
    }
    drop_trailing_commas(&out)
}

/// Drops a `,` followed only by whitespace and then `}` or `]` (outside strings).
fn drop_trailing_commas(json: &str) -> String {
    let chars: Vec<char> = json.chars().collect();
    let mut out = String::with_capacity(json.len());
    let mut in_string = false;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if in_string {
            out.push(c);
            if c == '\\' {
                if let Some(&escaped) = chars.get(i + 1) {
                    out.push(escaped);
                    i += 1;
                }
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
            out.push(c);
        } else if c == ',' {
            let next = chars[i + 1..].iter().find(|n| !n.is_whitespace());
            if !matches!(next, Some('}') | Some(']')) {
                out.push(c);
            }
        } else {
            out.push(c);
        }
        i += 1;
    }
    out
}

/// The nvidia-fs kernel module (NVIDIA's GDS driver) as procfs and sysfs show it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NvidiaFs {
    /// Listed in `<proc>/modules` (or its `<proc>/driver/nvidia-fs` or `<sys>/module/nvidia_fs`
    /// exists).
    pub loaded: bool,
    /// Its version: `<proc>/driver/nvidia-fs/version`'s `version: 2.28` line, else
    /// `<sys>/module/nvidia_fs/version` (`2.28.4`).
    pub version: Option<String>,
    /// Why `<proc>/modules` could not be read (then `loaded` rests on the other two places
    /// only, and false means unknown).
    pub modules_error: Option<String>,
    /// Its device nodes (`<dev>/nvidia-fs0`, ...) are there: a container given the host's
    /// module but not its devices reads in compatibility mode.
    pub device_nodes: bool,
}

/// Reads whether nvidia-fs is loaded and its version.
pub fn read_nvidia_fs(roots: &GdsRoots) -> NvidiaFs {
    let modules = roots.proc_dir.join("modules");
    let (listed, modules_error) = match fs::read_to_string(&modules) {
        Ok(text) => (text.lines().any(|l| l.starts_with("nvidia_fs ")), None),
        Err(e) => (
            false,
            Some(format!("cannot read {}: {e}", modules.display())),
        ),
    };
    let proc_driver = roots.proc_dir.join("driver/nvidia-fs");
    let sys_module = roots.sys_dir.join("module/nvidia_fs");
    let version = fs::read_to_string(proc_driver.join("version"))
        .ok()
        .and_then(|text| {
            text.lines().find_map(|l| {
                l.strip_prefix("version:")
                    .map(|v| v.trim().to_owned())
                    .filter(|v| !v.is_empty())
            })
        })
        .or_else(|| {
            fs::read_to_string(sys_module.join("version"))
                .ok()
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        });
    let device_nodes = fs::read_dir(&roots.dev_dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("nvidia-fs"))
    });
    NvidiaFs {
        loaded: listed || proc_driver.is_dir() || sys_module.is_dir(),
        version,
        modules_error,
        device_nodes,
    }
}

/// The kernel's PCI peer-to-peer DMA, which cuFile can use instead of nvidia-fs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct P2pdma {
    /// `CONFIG_PCI_P2PDMA=y` in `<boot>/config-<release>` (release from
    /// `<proc>/sys/kernel/osrelease`): Some(true); `=m`, `is not set` or absent: Some(false);
    /// None: unknown (no config file read; `<proc>/config.gz` is not read, being compressed).
    pub kernel_config: Option<bool>,
    /// The kernel release (`uname -r`), when readable.
    pub kernel_release: Option<String>,
    /// The config file read.
    pub config_file: Option<PathBuf>,
    /// Why `kernel_config` is unknown.
    pub error: Option<String>,
}

/// Reads whether the kernel was built with `CONFIG_PCI_P2PDMA`.
pub fn read_p2pdma(roots: &GdsRoots) -> P2pdma {
    let osrelease = roots.proc_dir.join("sys/kernel/osrelease");
    let release = match fs::read_to_string(&osrelease) {
        Ok(r) if !r.trim().is_empty() => r.trim().to_owned(),
        Ok(_) | Err(_) => {
            return P2pdma {
                kernel_config: None,
                kernel_release: None,
                config_file: None,
                error: Some(format!(
                    "cannot read the kernel release from {}",
                    osrelease.display()
                )),
            };
        }
    };
    let config_file = roots.boot_dir.join(format!("config-{release}"));
    match fs::read_to_string(&config_file) {
        Ok(text) => {
            let value = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("CONFIG_PCI_P2PDMA="));
            P2pdma {
                kernel_config: Some(value == Some("y")),
                kernel_release: Some(release),
                config_file: Some(config_file),
                error: None,
            }
        }
        Err(e) => {
            let gz = roots.proc_dir.join("config.gz");
            let also = if gz.exists() {
                format!(" ({} exists but is compressed and not read)", gz.display())
            } else {
                String::new()
            };
            P2pdma {
                kernel_config: None,
                kernel_release: Some(release),
                config_file: None,
                error: Some(format!("cannot read {}: {e}{also}", config_file.display())),
            }
        }
    }
}

/// The mounted file system that holds a path.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FileSystemOf {
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Its type (`ext4`, `xfs`, `tmpfs`, `nfs4`, ...).
    pub fs_type: String,
    /// What is mounted (`/dev/nvme0n1p1`, `server:/export`, `tmpfs`).
    pub source: String,
    /// The mount's `MAJ:MIN` (`259:1`; major 0 for file systems without a block device).
    pub dev: String,
    /// The file system's own options from mountinfo (`rw,vers=4.2,proto=rdma,...`).
    pub super_options: String,
    /// The block device's name under `<sys>/dev/block/MAJ:MIN` (the symlink's target's last
    /// component, e.g. "nvme0n1p1"), None for non-block (tmpfs, nfs, overlay)
    pub block_device: Option<String>,
    /// Whether that device is NVMe (name starts "nvme", or an md/dm device whose
    /// `<sys>/dev/block/M:m/slaves/*` are all nvme)
    pub nvme: bool,
    /// Whether the device is stacked over others (md RAID, dm, LVM: it has `slaves`).
    pub stacked: bool,
    /// udev's record of the block device, `<run>/udev/data/b<MAJ:MIN>` (None without a block
    /// device): cuFile reads the volume's attributes (`ID_FS_USAGE`, ...) from it.
    pub udev_record: Option<PathBuf>,
    /// Whether that record exists.
    pub udev_record_present: bool,
}

/// The mount holding `path` from `<proc>/self/mountinfo`: the longest mount point that is a
/// prefix of the path by components (of equal ones, the later mount, which hides the
/// earlier), with its `MAJ:MIN`, type, source and options; the block device from `<sys>`.
///
/// `path` is canonicalized as far as it exists on this machine (symlinks resolved), the rest
/// taken as written; a relative path is taken from the current directory.
///
/// # Errors
/// The reason, when mountinfo cannot be read or no mount holds the path.
pub fn file_system_of(path: &Path, roots: &GdsRoots) -> Result<FileSystemOf, String> {
    let resolved = resolve(path)?;
    let mountinfo = roots.proc_dir.join("self/mountinfo");
    let text = fs::read_to_string(&mountinfo)
        .map_err(|e| format!("cannot read {}: {e}", mountinfo.display()))?;
    let mut best: Option<(usize, MountLine)> = None;
    for line in text.lines() {
        let Some(mount) = MountLine::parse(line) else {
            continue;
        };
        if !resolved.starts_with(&mount.mount_point) {
            continue;
        }
        let depth = mount.mount_point.components().count();
        if best.as_ref().is_none_or(|(d, _)| depth >= *d) {
            best = Some((depth, mount));
        }
    }
    let Some((_, mount)) = best else {
        return Err(format!(
            "no mount in {} holds {}",
            mountinfo.display(),
            resolved.display()
        ));
    };
    let (block_device, nvme, stacked) = block_device_of(&mount.dev, &roots.sys_dir);
    let udev_record = (!mount.dev.starts_with("0:"))
        .then(|| roots.run_dir.join(format!("udev/data/b{}", mount.dev)));
    let udev_record_present = udev_record.as_ref().is_some_and(|p| p.exists());
    Ok(FileSystemOf {
        mount_point: mount.mount_point,
        fs_type: mount.fs_type,
        source: mount.source,
        dev: mount.dev,
        super_options: mount.super_options,
        block_device,
        nvme,
        stacked,
        udev_record,
        udev_record_present,
    })
}

/// `path` absolute, canonicalized as far as it exists: its longest existing ancestor
/// resolved, the rest appended; `.` and `..` taken lexically where nothing exists.
fn resolve(path: &Path) -> Result<PathBuf, String> {
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| {
                format!(
                    "cannot resolve {}: no current directory: {e}",
                    path.display()
                )
            })?
            .join(path)
    };
    if let Ok(canonical) = fs::canonicalize(&absolute) {
        return Ok(canonical);
    }
    let lexical = normalize(&absolute);
    let mut existing = lexical.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(canonical) = fs::canonicalize(existing) {
            let mut resolved = canonical;
            for name in rest.iter().rev() {
                resolved.push(name);
            }
            return Ok(resolved);
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                existing = parent;
            }
            _ => return Ok(lexical),
        }
    }
}

/// `.` dropped and `..` taken off the path before it, without looking at the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// One line of `/proc/<pid>/mountinfo` (proc(5)): `36 35 98:0 /root /mnt/point opts
/// [optional fields] - fstype source super_options`.
struct MountLine {
    dev: String,
    mount_point: PathBuf,
    fs_type: String,
    source: String,
    super_options: String,
}

impl MountLine {
    fn parse(line: &str) -> Option<Self> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // The separator comes after the six fixed fields and any optional ones.
        let separator = fields.iter().skip(6).position(|f| *f == "-")? + 6;
        let dev = (*fields.get(2)?).to_owned();
        let mount_point = PathBuf::from(OsString::from_vec(unescape(fields.get(4)?)));
        let fs_type = (*fields.get(separator + 1)?).to_owned();
        let source = fields
            .get(separator + 2)
            .map(|s| String::from_utf8_lossy(&unescape(s)).into_owned())
            .unwrap_or_default();
        let super_options = fields.get(separator + 3).copied().unwrap_or("").to_owned();
        Some(MountLine {
            dev,
            mount_point,
            fs_type,
            source,
            super_options,
        })
    }
}

/// mountinfo's octal escapes (`\040` space, `\011` tab, `\012` newline, `\134` backslash)
/// turned back into bytes.
fn unescape(field: &str) -> Vec<u8> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(byte) = u8::try_from(value) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

/// The block device behind `MAJ:MIN` (None for major 0, a file system without one, or a
/// number sysfs does not list), whether it is NVMe, and whether it is stacked (md, dm).
fn block_device_of(dev: &str, sys_dir: &Path) -> (Option<String>, bool, bool) {
    if dev.is_empty() || dev.starts_with("0:") {
        return (None, false, false);
    }
    let link = sys_dir.join("dev/block").join(dev);
    let Some(name) = fs::read_link(&link)
        .ok()
        .and_then(|target| target.file_name().map(|n| n.to_string_lossy().into_owned()))
    else {
        return (None, false, false);
    };
    if name.starts_with("nvme") {
        return (Some(name), true, false);
    }
    let slaves = slave_names(&link);
    let stacked = !slaves.is_empty();
    let nvme = stacked && all_nvme(&link, 0);
    (Some(name), nvme, stacked)
}

/// The `slaves` directory of a block device's sysfs directory; a partition's are its
/// disk's (the parent directory).
fn slaves_dir(device_dir: &Path) -> PathBuf {
    let own = device_dir.join("slaves");
    if !own.is_dir() && device_dir.join("partition").exists() {
        // The kernel resolves `..` after following the device's symlink: the whole disk.
        return device_dir.join("../slaves");
    }
    own
}

fn slave_names(device_dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(entries) = fs::read_dir(slaves_dir(device_dir)) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect()
}

/// Whether every device under `device_dir`'s slaves is NVMe, looking through stacked
/// devices (dm over md over nvme) up to a few levels.
fn all_nvme(device_dir: &Path, depth: u32) -> bool {
    let slaves = slave_names(device_dir);
    !slaves.is_empty()
        && slaves.iter().all(|(name, path)| {
            name.starts_with("nvme") || (depth < 4 && all_nvme(path, depth + 1))
        })
}

/// A peer path's test of a file system: Ok, or why it is not read peer-to-peer.
type FsCheck = fn(&FileSystemOf) -> Result<(), String>;

/// Whether a file system can be read peer-to-peer through nvidia-fs: Ok, or why not.
fn nvidia_fs_supports(fs: &FileSystemOf) -> Result<(), String> {
    match fs.fs_type.as_str() {
        "ext4" | "xfs" => local_nvme(fs),
        "lustre" | "wekafs" | "gpfs" | "beegfs" => Ok(()),
        "nfs" | "nfs4" => {
            if fs
                .super_options
                .split(',')
                .any(|o| o == "proto=rdma" || o == "proto=rdma6")
            {
                Ok(())
            } else {
                Err("is mounted without proto=rdma (GDS reads NFS only over RDMA)".to_owned())
            }
        }
        _ => Err(
            "is not one GDS reads peer-to-peer, which are ext4 or xfs on NVMe, Lustre, \
             WekaFS, GPFS, BeeGFS and NFS over RDMA"
                .to_owned(),
        ),
    }
}

/// Whether a file system can be read through the kernel's PCI P2PDMA: Ok, or why not.
fn p2pdma_supports(fs: &FileSystemOf) -> Result<(), String> {
    match fs.fs_type.as_str() {
        "ext4" | "xfs" if fs.stacked => Err(
            "is on an md/dm device: gpufeed counts the P2PDMA path only for a plain NVMe \
             device (cuFile's RAID P2PDMA is off by default)"
                .to_owned(),
        ),
        "ext4" | "xfs" => local_nvme(fs),
        _ => Err(
            "is not ext4 or xfs on NVMe, the only file systems cuFile's P2PDMA path reads"
                .to_owned(),
        ),
    }
}

/// ext4 (in its default data=ordered mode) or xfs on an NVMe device.
fn local_nvme(fs: &FileSystemOf) -> Result<(), String> {
    if !fs.nvme {
        let device = fs.block_device.as_deref().unwrap_or("no block device");
        return Err(format!("is not on an NVMe device ({device})"));
    }
    let data_mode = fs
        .super_options
        .split(',')
        .find_map(|o| o.strip_prefix("data="));
    match data_mode {
        Some(mode) if fs.fs_type == "ext4" && mode != "ordered" => Err(format!(
            "is mounted with data={mode} (GDS reads ext4 only in data=ordered mode)"
        )),
        _ => Ok(()),
    }
}

/// What GDS can do for reads here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GdsVerdict {
    /// reads can go storage -> GPU peer-to-peer
    Available,
    /// cuFile works but through its compatibility mode (POSIX reads into host memory, then a
    /// copy)
    CompatOnly,
    /// cuFile cannot read here at all
    Absent,
}

impl fmt::Display for GdsVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GdsVerdict::Available => "available",
            GdsVerdict::CompatOnly => "compat only",
            GdsVerdict::Absent => "absent",
        })
    }
}

/// Which peer-to-peer path a verdict of [`GdsVerdict::Available`] counted on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerPath {
    /// NVIDIA's nvidia-fs kernel module.
    NvidiaFs,
    /// The kernel's PCI P2PDMA (`properties.use_pci_p2pdma`).
    PciP2pdma,
}

/// The verdict, why, what to change, and every fact read.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GdsDetection {
    /// What GDS can do.
    pub verdict: GdsVerdict,
    /// A sentence naming the facts that decided the verdict.
    pub reason: String,
    /// What to change for a better verdict (None when available).
    pub fix: Option<String>,
    /// The loaded libcufile as given (e.g. "libcufile.so.0 1.15"); None when it did not load.
    pub library: Option<String>,
    /// The nvidia-fs module.
    pub nvidia_fs: NvidiaFs,
    /// The kernel's PCI P2PDMA.
    pub p2pdma: P2pdma,
    /// `cufile.json`.
    pub config: CufileConfig,
    /// The file system of the path asked about (None: no path, or not found out).
    pub file_system: Option<FileSystemOf>,
    /// Why the file system of the path asked about is unknown.
    pub file_system_error: Option<String>,
    /// The peer path counted on when available.
    pub peer_path: Option<PeerPath>,
}

/// Decides whether cuFile can read `path` (or, with None, anything on this machine) peer to
/// peer, only in compatibility mode, or not at all.
///
/// `library`: Ok(description of the loaded libcufile) or Err(why it did not load: names
/// tried). `path`: a file or folder whose file system matters (None: the machine only).
///
/// The rules, in order:
/// 1. libcufile did not load: [`GdsVerdict::Absent`] ("libcufile is not loadable: ..."); fix:
///    install it (`pip install nvidia-cufile`, or the CUDA toolkit's `libcufile.so.0`) and/or
///    point `GPUFEED_CUFILE_LIBRARY` at it.
///
///    A path whose volume cuFile cannot look up: [`GdsVerdict::Absent`] for it, in any mode.
///    cuFile reads each file's volume attributes from udev (`<run>/udev/data/b<MAJ:MIN>`)
///    and refuses the handle where it finds none (`cuFileHandleRegister`:
///    `CU_FILE_HANDLE_NOT_REGISTERED`, 5027; cuFile 1.15 on the GPU machine, whose container
///    has no udev database, refused every file until the record was there): a block device
///    without a record (fix: mount the host's `/run/udev` into the container), and tmpfs or
///    ramfs, which have no block device (fix: a disk file system).
/// 2. cufile.json sets `properties.vanilla_posix_io_mode` (or `posix_io_mode`) or
///    `properties.force_compat_mode`: [`GdsVerdict::CompatOnly`], cuFile reads every file
///    through POSIX.
/// 3. A peer path exists when nvidia-fs is loaded, or when the kernel has
///    `CONFIG_PCI_P2PDMA=y` and cufile.json sets `properties.use_pci_p2pdma`. nvidia-fs reads
///    ext4 (data=ordered) or xfs on NVMe (local, NVMe-oF, or md/dm over NVMe only), Lustre,
///    WekaFS, GPFS, BeeGFS, and NFS mounted with `proto=rdma`; P2PDMA reads ext4 or xfs on a
///    plain NVMe device. Anything else (tmpfs, overlay, btrfs, zfs, fuse, ...) or a file
///    system that could not be found out is read in compatibility mode.
/// 4. A peer path, and no path asked about or its file system supported by that path:
///    [`GdsVerdict::Available`], naming nvidia-fs's version or P2PDMA, and the file system.
/// 5. Else, with `allow_compat_mode` (the default): [`GdsVerdict::CompatOnly`], naming what is
///    missing (nvidia-fs not in `<proc>/modules`, P2PDMA not configured, or the file system)
///    and the fix (`modprobe nvidia-fs`; `use_pci_p2pdma`; ext4/xfs on a local NVMe).
/// 6. Else: [`GdsVerdict::Absent`]: no peer path and cufile.json sets `allow_compat_mode`
///    false, so cuFile refuses reads; fix: set it true, or provide a peer path.
///
/// Unreadable `/proc` or `/sys` files count as "not loaded" or "unknown", and the reason says
/// so where that decided the outcome.
pub fn detect(
    path: Option<&Path>,
    library: Result<String, String>,
    roots: &GdsRoots,
) -> GdsDetection {
    let config = read_cufile_config(roots);
    let nvidia_fs = read_nvidia_fs(roots);
    let p2pdma = read_p2pdma(roots);
    let (file_system, file_system_error) = match path {
        Some(p) => match file_system_of(p, roots) {
            Ok(fs) => (Some(fs), None),
            Err(e) => (None, Some(e)),
        },
        None => (None, None),
    };
    let facts = Facts {
        path,
        roots,
        config: &config,
        nvidia_fs: &nvidia_fs,
        p2pdma: &p2pdma,
        file_system: file_system.as_ref(),
        file_system_error: file_system_error.as_deref(),
    };
    let decision = decide(&facts, library.as_deref().map_err(String::as_str));
    GdsDetection {
        verdict: decision.verdict,
        reason: decision.reason,
        fix: decision.fix,
        library: library.ok(),
        nvidia_fs,
        p2pdma,
        config,
        file_system,
        file_system_error,
        peer_path: decision.peer_path,
    }
}

/// What [`detect`] read, borrowed for [`decide`].
struct Facts<'a> {
    path: Option<&'a Path>,
    roots: &'a GdsRoots,
    config: &'a CufileConfig,
    nvidia_fs: &'a NvidiaFs,
    p2pdma: &'a P2pdma,
    file_system: Option<&'a FileSystemOf>,
    file_system_error: Option<&'a str>,
}

struct Decision {
    verdict: GdsVerdict,
    reason: String,
    fix: Option<String>,
    peer_path: Option<PeerPath>,
}

const INSTALL_CUFILE: &str = "install libcufile: `pip install nvidia-cufile` (it puts \
    libcufile.so.0 in site-packages/nvidia/cu13/lib) or the CUDA toolkit's GDS libraries \
    (libcufile.so.0), and point GPUFEED_CUFILE_LIBRARY at the file if the loader does not find it";

const LOCAL_NVME: &str = "put the data on ext4 or xfs on a local NVMe drive";

fn decide(facts: &Facts<'_>, library: Result<&str, &str>) -> Decision {
    let config = facts.config;
    let json = config.path.display();
    if let Err(why) = library {
        return Decision {
            verdict: GdsVerdict::Absent,
            reason: format!("libcufile is not loadable: {why}"),
            fix: Some(INSTALL_CUFILE.to_owned()),
            peer_path: None,
        };
    }
    if let Some(absent) = unreadable_volume(facts) {
        return absent;
    }
    if facts
        .roots
        .force_compat_env
        .as_deref()
        .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
    {
        return Decision {
            verdict: GdsVerdict::CompatOnly,
            reason: "CUFILE_FORCE_COMPAT_MODE is set true in the environment: cuFile reads \
                     every file in compatibility mode (POSIX reads into host memory, then a copy)"
                .to_owned(),
            fix: Some("unset CUFILE_FORCE_COMPAT_MODE".to_owned()),
            peer_path: None,
        };
    }
    if config.posix_io_mode || config.force_compat_mode {
        let property = if config.posix_io_mode {
            "vanilla_posix_io_mode"
        } else {
            "force_compat_mode"
        };
        return Decision {
            verdict: GdsVerdict::CompatOnly,
            reason: format!(
                "cufile.json ({json}) sets properties.{property} true: cuFile reads every file \
                 with POSIX reads into host memory, then a copy"
            ),
            fix: Some(format!(
                "set \"{property}\": false under \"properties\" in {json}"
            )),
            peer_path: None,
        };
    }

    let nvfs = facts.nvidia_fs.loaded && facts.nvidia_fs.device_nodes;
    let p2p = facts.p2pdma.kernel_config == Some(true) && config.use_pci_p2pdma;
    // Each peer path that exists, with whether it reads the file system asked about.
    let mut candidates = Vec::new();
    if nvfs {
        candidates.push((
            PeerPath::NvidiaFs,
            facts.file_system.map(nvidia_fs_supports),
        ));
    }
    if p2p {
        candidates.push((PeerPath::PciP2pdma, facts.file_system.map(p2pdma_supports)));
    }
    for (peer, support) in &candidates {
        let fs_ok = match (facts.path, support) {
            (None, _) => true,
            (Some(_), Some(Ok(()))) => true,
            (Some(_), _) => false,
        };
        if fs_ok {
            return Decision {
                verdict: GdsVerdict::Available,
                reason: available_reason(facts, *peer),
                fix: None,
                peer_path: Some(*peer),
            };
        }
    }

    // No peer path for this file: what is missing, and how to get one.
    let fs_why = |check: FsCheck| -> Option<String> {
        let path = facts.path?;
        Some(match facts.file_system {
            Some(fs) => format!("{} {}", describe_fs(fs), check(fs).err()?),
            None => format!(
                "the file system of {} is unknown ({})",
                path.display(),
                facts.file_system_error.unwrap_or("not found out")
            ),
        })
    };
    let (missing, peer_fix) = if candidates.is_empty() {
        let (missing, fix) = (no_peer_path(facts), peer_path_fix(facts));
        match fs_why(nvidia_fs_supports) {
            Some(why) => (
                format!("{missing}; and even with one, {why}"),
                format!("{fix}; and {LOCAL_NVME}"),
            ),
            None => (missing, fix),
        }
    } else {
        // Every peer path there is refused this file system (so a path was asked about).
        let (check, fix): (FsCheck, String) = if nvfs {
            (
                nvidia_fs_supports,
                format!(
                    "{LOCAL_NVME} (or a GDS-capable one: Lustre, WekaFS, GPFS, BeeGFS, NFS \
                     over RDMA)"
                ),
            )
        } else {
            (
                p2pdma_supports,
                format!("{LOCAL_NVME} (a plain NVMe device, for the P2PDMA path)"),
            )
        };
        let why = fs_why(check).unwrap_or_else(|| "the file system is not supported".to_owned());
        (why, fix)
    };
    let it = if facts.path.is_some() { " it" } else { "" };
    if config.allow_compat_mode {
        Decision {
            verdict: GdsVerdict::CompatOnly,
            reason: format!(
                "{missing}: cuFile reads{it} in compatibility mode (POSIX reads into host \
                 memory, then a copy)"
            ),
            fix: Some(peer_fix),
            peer_path: None,
        }
    } else {
        Decision {
            verdict: GdsVerdict::Absent,
            reason: format!(
                "no peer path ({missing}) and cufile.json ({json}) sets allow_compat_mode \
                 false: cuFile refuses reads"
            ),
            fix: Some(format!(
                "set \"allow_compat_mode\": true under \"properties\" in {json}, or {peer_fix}"
            )),
            peer_path: None,
        }
    }
}

/// Rule 1's second half: the path's volume is one cuFile cannot look up.
fn unreadable_volume(facts: &Facts<'_>) -> Option<Decision> {
    let fs = facts.file_system?;
    let refused = "cuFile refuses every file there (cuFileHandleRegister: \
                   CU_FILE_HANDLE_NOT_REGISTERED, 5027), in compatibility mode too";
    let (reason, fix) = if matches!(fs.fs_type.as_str(), "tmpfs" | "ramfs") {
        (
            format!(
                "{}: cuFile looks up a file's volume through udev by its block device, and \
                 {} has none; {refused}",
                describe_fs(fs),
                fs.fs_type
            ),
            format!("put the file on a disk file system ({LOCAL_NVME} for peer-to-peer reads)"),
        )
    } else {
        let record = fs.udev_record.as_ref()?;
        if fs.udev_record_present {
            return None;
        }
        (
            format!(
                "{}: udev has no record of its device ({} is missing: a container without \
                 the host's udev database?), so {refused}",
                describe_fs(fs),
                record.display()
            ),
            "run where udev's database is visible: in a container, mount the host's one \
             read-only (`docker run -v /run/udev:/run/udev:ro ...`)"
                .to_owned(),
        )
    };
    Some(Decision {
        verdict: GdsVerdict::Absent,
        reason,
        fix: Some(fix),
        peer_path: None,
    })
}

fn describe_fs(fs: &FileSystemOf) -> String {
    format!(
        "{} on {} at {}",
        fs.fs_type,
        fs.source,
        fs.mount_point.display()
    )
}

fn available_reason(facts: &Facts<'_>, peer: PeerPath) -> String {
    let via = match peer {
        PeerPath::NvidiaFs => match &facts.nvidia_fs.version {
            Some(v) => format!("nvidia-fs {v} is loaded"),
            None => "nvidia-fs is loaded (version unknown)".to_owned(),
        },
        PeerPath::PciP2pdma => format!(
            "the kernel has CONFIG_PCI_P2PDMA and cufile.json ({}) sets use_pci_p2pdma",
            facts.config.path.display()
        ),
    };
    match facts.file_system {
        Some(fs) => format!(
            "{via} and {} is read peer-to-peer: reads go storage -> GPU directly",
            describe_fs(fs)
        ),
        None => format!("{via}: reads of supported file systems go storage -> GPU directly"),
    }
}

/// Why neither nvidia-fs nor P2PDMA is there, naming the files read.
fn no_peer_path(facts: &Facts<'_>) -> String {
    let modules = facts.roots.proc_dir.join("modules");
    let nvfs = match &facts.nvidia_fs.modules_error {
        _ if facts.nvidia_fs.loaded => format!(
            "nvidia-fs is loaded but its devices are not here (no nvidia-fs* in {}: a container \
             given the host's module without its devices)",
            facts.roots.dev_dir.display()
        ),
        Some(e) => format!("nvidia-fs is not known to be loaded ({e}; counted as not loaded)"),
        None => format!(
            "nvidia-fs is not loaded (no nvidia_fs in {})",
            modules.display()
        ),
    };
    let json = facts.config.path.display();
    let p2p = match (facts.p2pdma.kernel_config, facts.config.use_pci_p2pdma) {
        (Some(true), false) => format!(
            "the kernel has CONFIG_PCI_P2PDMA but cufile.json ({json}) does not set \
             use_pci_p2pdma"
        ),
        (Some(false), _) => format!(
            "the kernel lacks CONFIG_PCI_P2PDMA=y ({})",
            facts
                .p2pdma
                .config_file
                .as_deref()
                .map_or_else(String::new, |p| p.display().to_string())
        ),
        (None, _) => format!(
            "whether the kernel has CONFIG_PCI_P2PDMA is unknown ({})",
            facts.p2pdma.error.as_deref().unwrap_or("not read")
        ),
        // Cannot happen here: a P2PDMA path would exist.
        (Some(true), true) => "P2PDMA is configured".to_owned(),
    };
    format!("{nvfs}, and {p2p}")
}

fn peer_path_fix(facts: &Facts<'_>) -> String {
    let json = facts.config.path.display();
    if facts.nvidia_fs.loaded && !facts.nvidia_fs.device_nodes {
        return format!(
            "give the container the host's /dev/nvidia-fs* devices (docker run --device \
             /dev/nvidia-fs0 ..., or the NVIDIA container toolkit's GDS support), or set \
             \"use_pci_p2pdma\": true under \"properties\" in {json} (P2PDMA)"
        );
    }
    format!(
        "load nvidia-fs (`modprobe nvidia-fs`, from NVIDIA's `nvidia-gds` package), or on a \
         kernel >= 6.2 with CONFIG_PCI_P2PDMA and NVIDIA's open GPU kernel modules set \
         \"use_pci_p2pdma\": true under \"properties\" in {json}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use tempfile::TempDir;

    /// A mountinfo with the cases that matter: nested and prefix-sharing mount points, a
    /// space escaped as \040, optional fields, NFS with and without RDMA, md devices.
    const MOUNTINFO: &str = "\
22 1 8:2 / / rw,relatime shared:1 - ext4 /dev/sda2 rw,errors=remount-ro
23 22 259:1 / /data rw,relatime shared:2 - ext4 /dev/nvme0n1p1 rw,data=ordered
24 22 0:23 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,size=1024k
25 22 259:1 /sub /mnt/my\\040data rw,relatime - ext4 /dev/nvme0n1p1 rw
26 22 0:50 / /mnt/nfs rw,relatime - nfs4 10.0.0.1:/export rw,vers=4.2,rsize=1048576,proto=rdma,port=20049
27 22 0:51 / /mnt/nfstcp rw,relatime - nfs4 10.0.0.1:/export rw,vers=4.2,proto=tcp,port=0
28 22 9:0 / /raid rw,relatime - xfs /dev/md0 rw,attr2
29 22 9:1 / /mixed rw,relatime - xfs /dev/md1 rw
30 22 0:60 / /ovl rw,relatime - overlay overlay rw,lowerdir=/a,upperdir=/b,workdir=/c
31 22 8:17 / /sata rw,relatime - ext4 /dev/sdb1 rw
32 22 0:70 / /lustre rw - lustre 10.0.0.2@o2ib:/fs rw,flock
33 22 259:2 / /journal rw - ext4 /dev/nvme1n1 rw,data=journal
34 22 259:5 / /raidpart rw - ext4 /dev/md0p1 rw
35 22 253:0 / /lvm rw - xfs /dev/mapper/vg-lv rw
";

    /// Shaped like the cufile.json NVIDIA ships in /etc (abridged): `//` comments between
    /// keys, commented-out keys, a comment holding a quoted path, tabs, `"/..."` strings, a
    /// block comment, and nested file-system sections.
    const NVIDIA_STYLE: &str = r#"{
    // NOTE : Application can override custom configuration via export CUFILE_ENV_PATH_JSON=<filepath>
    // e.g : export CUFILE_ENV_PATH_JSON="/home/<xxx>/cufile.json"

            "logging": {
                            // log directory, if not enabled will create log file under current working directory
                            //"dir": "/home/<xxxx>",

                            // NOTICE|ERROR|WARN|INFO|DEBUG|TRACE (in decreasing order of severity)
                            "level": "ERROR"
            },
            "execution" : {
                    // max number of workitems in the queue;
                    "max_io_queue_depth": 128,
		    // maximum parallelism for a single request
		    "max_request_parallelism" : 4
            },
            "properties": {
                            "max_direct_io_size_kb" : 16384,
                            "use_poll_mode" : false,
                            "use_pci_p2pdma": false,
                            // allow compat mode, this will enable use of cuFile posix read/writes
                            "allow_compat_mode": true,
                            "rdma_dev_addr_list": [ ],
			    //"rdma_dc_key": "0xffeeddcc",
                            /* policy order for cross root port transfers */
                            "rdma_dynamic_routing_order": [ "GPU_MEM_NVLINKS", "GPU_MEM", "SYS_MEM", "P2P" ]
            },
            "fs": {
                    "generic": { "posix_unaligned_writes" : false },
                    "lustre": {
                            "posix_gds_min_kb" : 0
                            // if using multiple lustre mounts, provide ip addresses used by respective mount here
                            //"mount_table" : {
                            //                    "/lustre/ai200_01/client" : {
                            //                                    "rdma_dev_addr_list" : ["172.172.1.40", "172.172.1.42"]
                            //                    }
                            //}
                    },
                    "nfs": { "use_pci_p2pdma": false }
            },
            "block": { "nvme": { "use_pci_p2pdma": false } },
            "denylist": { "drivers": [ ], "devices": [ ], "mounts": [ ], "filesystems": [ ] },
            "miscellaneous": {
                            "api_check_aggressive": false,
                            "static_routing_filepath": "/etc/topology.json"
            }
}
"#;

    struct Tree {
        dir: TempDir,
    }

    impl Tree {
        /// A machine with everything GDS could want except nvidia-fs: the mounts above,
        /// their block devices, a P2PDMA kernel, no cufile.json.
        fn new() -> Tree {
            let tree = Tree {
                dir: TempDir::new().expect("temp dir"),
            };
            tree.write("proc/self/mountinfo", MOUNTINFO);
            tree.write(
                "proc/modules",
                "nvme 61440 4 - Live 0xffffffffc0400000\next4 1003520 2 - Live 0x0\n",
            );
            tree.write("proc/sys/kernel/osrelease", "6.8.0-test\n");
            tree.write(
                "boot/config-6.8.0-test",
                "CONFIG_PCI=y\nCONFIG_PCI_P2PDMA=y\nCONFIG_NVME_CORE=m\n",
            );
            let pci = "../../devices/pci0000:00/0000:00:01.0/0000:01:00.0/nvme/nvme0";
            tree.link("sys/dev/block/259:1", &format!("{pci}/nvme0n1/nvme0n1p1"));
            tree.link("sys/dev/block/259:2", &format!("{pci}/nvme1n1"));
            tree.link(
                "sys/dev/block/8:17",
                "../../devices/pci0000:00/0000:00:17.0/ata1/host0/block/sdb/sdb1",
            );
            // md0 over two NVMe drives, md1 over an NVMe drive and a SATA one.
            tree.link("sys/dev/block/9:0", "../../devices/virtual/block/md0");
            tree.mkdir("sys/devices/virtual/block/md0/slaves/nvme2n1");
            tree.mkdir("sys/devices/virtual/block/md0/slaves/nvme3n1");
            tree.link("sys/dev/block/9:1", "../../devices/virtual/block/md1");
            tree.mkdir("sys/devices/virtual/block/md1/slaves/nvme4n1");
            tree.mkdir("sys/devices/virtual/block/md1/slaves/sda");
            // A partition of md0, and LVM (dm-0) over md0.
            tree.link(
                "sys/dev/block/259:5",
                "../../devices/virtual/block/md0/md0p1",
            );
            tree.write("sys/devices/virtual/block/md0/md0p1/partition", "1\n");
            tree.link("sys/dev/block/253:0", "../../devices/virtual/block/dm-0");
            tree.link("sys/devices/virtual/block/dm-0/slaves/md0", "../../md0");
            // udev's records of every block device mounted.
            for dev in [
                "8:2", "259:1", "259:2", "8:17", "9:0", "9:1", "259:5", "253:0",
            ] {
                tree.write(
                    &format!("run/udev/data/b{dev}"),
                    "E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=ext4\n",
                );
            }
            tree
        }

        fn path(&self, rel: &str) -> PathBuf {
            self.dir.path().join(rel)
        }

        fn write(&self, rel: &str, text: &str) {
            let path = self.path(rel);
            fs::create_dir_all(path.parent().expect("has a parent")).expect("mkdir");
            fs::write(path, text).expect("write");
        }

        fn mkdir(&self, rel: &str) {
            fs::create_dir_all(self.path(rel)).expect("mkdir");
        }

        fn link(&self, rel: &str, target: &str) {
            let path = self.path(rel);
            fs::create_dir_all(path.parent().expect("has a parent")).expect("mkdir");
            symlink(target, path).expect("symlink");
        }

        fn load_nvidia_fs(&self) {
            self.write(
                "proc/modules",
                "nvidia_fs 262144 0 - Live 0xffffffffc0a00000 (OE)\nnvme 61440 4 - Live 0x0\n",
            );
            self.write("proc/driver/nvidia-fs/version", "version: 2.28\n");
            self.write("sys/module/nvidia_fs/version", "2.28.4\n");
            self.write("dev/nvidia-fs0", "");
        }

        /// Roots with cufile.json at `<root>/etc/cufile.json`, whatever the environment says.
        fn roots(&self) -> GdsRoots {
            GdsRoots {
                cufile_json: Some(self.path("etc/cufile.json")),
                ..GdsRoots::under(self.dir.path())
            }
        }

        fn cufile_json(&self, text: &str) {
            self.write("etc/cufile.json", text);
        }

        fn detect(&self, path: Option<&str>) -> GdsDetection {
            detect(
                path.map(Path::new),
                Ok("libcufile.so.0 1.15".to_owned()),
                &self.roots(),
            )
        }
    }

    /// `CUFILE_FORCE_COMPAT_MODE=true` in the environment overrides a machine with a peer
    /// path: compatibility mode, saying so.
    #[test]
    fn the_force_compat_variable_overrides_a_peer_path() {
        let t = Tree::new();
        t.load_nvidia_fs();
        t.cufile_json("{}");
        let roots = GdsRoots {
            force_compat_env: Some("true".into()),
            ..t.roots()
        };
        let d = detect(None, Ok("libcufile.so.0 1.15".into()), &roots);
        assert_eq!(d.verdict, GdsVerdict::CompatOnly, "{}", d.reason);
        assert!(
            d.reason.contains("CUFILE_FORCE_COMPAT_MODE"),
            "{}",
            d.reason
        );
        let roots = GdsRoots {
            force_compat_env: Some("false".into()),
            ..t.roots()
        };
        let d = detect(None, Ok("libcufile.so.0 1.15".into()), &roots);
        assert_eq!(d.verdict, GdsVerdict::Available, "{}", d.reason);
    }

    /// nvidia-fs loaded on the host (its module listed) but without its device nodes here (a
    /// container): compatibility mode, saying so, and the fix names the devices.
    #[test]
    fn nvidia_fs_without_its_devices_is_compat_only() {
        let t = Tree::new();
        t.load_nvidia_fs();
        fs::remove_file(t.path("dev/nvidia-fs0")).expect("rm");
        t.cufile_json("{}");
        let d = t.detect(None);
        assert_eq!(d.verdict, GdsVerdict::CompatOnly, "{}", d.reason);
        assert!(d.nvidia_fs.loaded && !d.nvidia_fs.device_nodes);
        assert!(d.reason.contains("devices are not here"), "{}", d.reason);
        assert!(
            d.fix.as_deref().unwrap_or("").contains("--device"),
            "{:?}",
            d.fix
        );
        t.write("dev/nvidia-fs0", "");
        assert_eq!(t.detect(None).verdict, GdsVerdict::Available);
    }

    const P2PDMA_ON: &str = r#"{ "properties": { "use_pci_p2pdma": true } }"#;

    #[test]
    fn env_lookup_prefers_a_non_empty_variable() {
        let etc = Path::new("/fake/etc");
        assert_eq!(
            cufile_json_from_env(Some("/x/c.json".into()), etc),
            PathBuf::from("/x/c.json")
        );
        assert_eq!(
            cufile_json_from_env(Some(OsString::new()), etc),
            PathBuf::from("/fake/etc/cufile.json")
        );
        assert_eq!(
            cufile_json_from_env(None, etc),
            PathBuf::from("/fake/etc/cufile.json")
        );
        let explicit = GdsRoots {
            cufile_json: Some("/given.json".into()),
            ..GdsRoots::system()
        };
        assert_eq!(explicit.cufile_json_path(), PathBuf::from("/given.json"));
        let system = GdsRoots::system();
        assert_eq!(system.proc_dir, PathBuf::from("/proc"));
        assert_eq!(system.etc_dir, PathBuf::from("/etc"));
        assert!(system.cufile_json.is_none());
    }

    #[test]
    fn comments_are_stripped_outside_strings_only() {
        let text = r#"{ "a": "http://x//y", /* gone "b": 1 */ "c": "q\"//still", // gone
            "d": [1, 2,], "e": "/* kept */", }"#;
        let value: serde_json::Value =
            serde_json::from_str(&strip_json_comments(text)).expect("parses");
        assert_eq!(value["a"], "http://x//y");
        assert_eq!(value["c"], "q\"//still");
        assert_eq!(value["d"], serde_json::json!([1, 2]));
        assert_eq!(value["e"], "/* kept */");
        assert!(value.get("b").is_none());
    }

    #[test]
    fn nvidia_style_config_parses() {
        let tree = Tree::new();
        tree.cufile_json(NVIDIA_STYLE);
        let config = read_cufile_config(&tree.roots());
        assert!(config.found);
        assert_eq!(config.error, None);
        assert!(config.allow_compat_mode);
        assert!(!config.use_pci_p2pdma);
        assert!(!config.posix_io_mode);
        // A version with the two settings flipped reads them flipped: the parse reached them.
        tree.cufile_json(
            &NVIDIA_STYLE
                .replace(
                    r#""allow_compat_mode": true"#,
                    r#""allow_compat_mode": false"#,
                )
                .replace(r#""use_pci_p2pdma": false,"#, r#""use_pci_p2pdma": true,"#),
        );
        let config = read_cufile_config(&tree.roots());
        assert_eq!(config.error, None);
        assert!(!config.allow_compat_mode);
        assert!(config.use_pci_p2pdma);
    }

    #[test]
    fn double_slash_inside_a_string_does_not_hide_what_follows() {
        let tree = Tree::new();
        tree.cufile_json(
            r#"{ "logging": { "dir": "/var/log//gds" },
                 "properties": { "rdma_dc_key": "a//b", "allow_compat_mode": false } }"#,
        );
        let config = read_cufile_config(&tree.roots());
        assert_eq!(config.error, None);
        assert!(!config.allow_compat_mode);
    }

    #[test]
    fn broken_config_records_the_error_and_uses_defaults() {
        let tree = Tree::new();
        tree.cufile_json(r#"{ "properties": { "allow_compat_mode": false "#);
        let config = read_cufile_config(&tree.roots());
        assert!(config.found);
        let error = config.error.expect("an error");
        assert!(error.contains("cufile.json"), "{error}");
        assert!(config.allow_compat_mode, "the default applies");
        assert!(!config.use_pci_p2pdma);

        tree.cufile_json(r#"{ "properties": { "allow_compat_mode": "no" } }"#);
        let config = read_cufile_config(&tree.roots());
        assert!(config.allow_compat_mode);
        assert!(
            config
                .error
                .expect("an error")
                .contains("allow_compat_mode")
        );
    }

    #[test]
    fn missing_config_gives_defaults_without_error() {
        let tree = Tree::new();
        let config = read_cufile_config(&tree.roots());
        assert!(!config.found);
        assert_eq!(config.error, None);
        assert!(config.allow_compat_mode);
        assert_eq!(config.path, tree.path("etc/cufile.json"));
    }

    #[test]
    fn nvidia_fs_from_proc_and_sys() {
        let tree = Tree::new();
        let nvfs = read_nvidia_fs(&tree.roots());
        assert!(!nvfs.loaded);
        assert_eq!(nvfs.version, None);
        assert_eq!(nvfs.modules_error, None);

        tree.load_nvidia_fs();
        let nvfs = read_nvidia_fs(&tree.roots());
        assert!(nvfs.loaded);
        assert_eq!(nvfs.version.as_deref(), Some("2.28"));

        // Without procfs's version file, sysfs's module version.
        fs::remove_file(tree.path("proc/driver/nvidia-fs/version")).expect("rm");
        assert_eq!(
            read_nvidia_fs(&tree.roots()).version.as_deref(),
            Some("2.28.4")
        );
    }

    #[test]
    fn unreadable_modules_is_not_an_error() {
        let tree = Tree::new();
        fs::remove_file(tree.path("proc/modules")).expect("rm");
        let nvfs = read_nvidia_fs(&tree.roots());
        assert!(!nvfs.loaded);
        assert!(nvfs.modules_error.is_some());
        let d = tree.detect(Some("/data/x"));
        assert_eq!(d.verdict, GdsVerdict::CompatOnly);
        assert!(d.reason.contains("not known to be loaded"), "{}", d.reason);
        assert!(d.reason.contains("modules"), "{}", d.reason);
    }

    #[test]
    fn kernel_p2pdma_config() {
        let tree = Tree::new();
        let p2p = read_p2pdma(&tree.roots());
        assert_eq!(p2p.kernel_config, Some(true));
        assert_eq!(p2p.kernel_release.as_deref(), Some("6.8.0-test"));
        assert_eq!(p2p.config_file, Some(tree.path("boot/config-6.8.0-test")));

        tree.write(
            "boot/config-6.8.0-test",
            "CONFIG_PCI=y\n# CONFIG_PCI_P2PDMA is not set\n",
        );
        assert_eq!(read_p2pdma(&tree.roots()).kernel_config, Some(false));

        fs::remove_file(tree.path("boot/config-6.8.0-test")).expect("rm");
        tree.write("proc/config.gz", "\x1f\u{8b}");
        let p2p = read_p2pdma(&tree.roots());
        assert_eq!(p2p.kernel_config, None);
        assert!(p2p.error.expect("why unknown").contains("compressed"));
    }

    #[test]
    fn file_system_of_takes_the_longest_mount_by_components() {
        let tree = Tree::new();
        let roots = tree.roots();
        let of = |p: &str| file_system_of(Path::new(p), &roots).expect("a mount");

        let data = of("/data/x/y.bin");
        assert_eq!(data.mount_point, PathBuf::from("/data"));
        assert_eq!(data.fs_type, "ext4");
        assert_eq!(data.source, "/dev/nvme0n1p1");
        assert_eq!(data.dev, "259:1");
        assert_eq!(data.block_device.as_deref(), Some("nvme0n1p1"));
        assert!(data.nvme);
        assert!(!data.stacked);

        let database = of("/database/x");
        assert_eq!(database.mount_point, PathBuf::from("/"));
        assert_eq!(database.source, "/dev/sda2");
        assert_eq!(database.block_device, None, "8:2 is not in the fake sysfs");
        assert!(!database.nvme);

        assert_eq!(of("/data").mount_point, PathBuf::from("/data"));
        assert_eq!(of("/data/../database").mount_point, PathBuf::from("/"));

        let spaced = of("/mnt/my data/file");
        assert_eq!(spaced.mount_point, PathBuf::from("/mnt/my data"));
        assert!(spaced.nvme);

        let shm = of("/dev/shm/segment");
        assert_eq!(shm.fs_type, "tmpfs");
        assert_eq!(shm.block_device, None);
        assert!(!shm.nvme);

        let raid = of("/raid/f");
        assert_eq!(raid.block_device.as_deref(), Some("md0"));
        assert!(raid.nvme && raid.stacked);
        let mixed = of("/mixed/f");
        assert!(!mixed.nvme && mixed.stacked);
        let part = of("/raidpart/f");
        assert_eq!(part.block_device.as_deref(), Some("md0p1"));
        assert!(
            part.nvme && part.stacked,
            "a partition's slaves are its disk's"
        );
        let lvm = of("/lvm/f");
        assert_eq!(lvm.block_device.as_deref(), Some("dm-0"));
        assert!(lvm.nvme && lvm.stacked, "dm over md over NVMe");

        let sata = of("/sata/f");
        assert_eq!(sata.block_device.as_deref(), Some("sdb1"));
        assert!(!sata.nvme);

        let nfs = of("/mnt/nfs/a");
        assert_eq!(nfs.fs_type, "nfs4");
        assert_eq!(nfs.source, "10.0.0.1:/export");
        assert!(nfs.super_options.contains("proto=rdma"));
    }

    #[test]
    fn later_mount_on_the_same_point_wins_and_unescape_handles_octal() {
        let tree = Tree::new();
        tree.write(
            "proc/self/mountinfo",
            &format!("{MOUNTINFO}40 24 0:80 / /data rw - xfs /dev/nvme9n1 rw\n"),
        );
        let fs = file_system_of(Path::new("/data/x"), &tree.roots()).expect("a mount");
        assert_eq!(fs.fs_type, "xfs");
        assert_eq!(unescape(r"a\040b\134c\011d"), b"a b\\c\td".to_vec());
        assert_eq!(unescape(r"trailing\04"), b"trailing\\04".to_vec());
    }

    #[test]
    fn file_system_of_reports_unreadable_mountinfo() {
        let tree = Tree::new();
        fs::remove_file(tree.path("proc/self/mountinfo")).expect("rm");
        let err = file_system_of(Path::new("/data"), &tree.roots()).expect_err("no mountinfo");
        assert!(err.contains("mountinfo"), "{err}");
    }

    #[test]
    fn library_missing_is_absent() {
        let tree = Tree::new();
        tree.load_nvidia_fs();
        let d = detect(
            Some(Path::new("/data/x")),
            Err("libcufile.so.0: not found; libcufile.so: not found".to_owned()),
            &tree.roots(),
        );
        assert_eq!(d.verdict, GdsVerdict::Absent);
        assert!(
            d.reason
                .starts_with("libcufile is not loadable: libcufile.so.0")
        );
        let fix = d.fix.expect("a fix");
        assert!(fix.contains("pip install nvidia-cufile"), "{fix}");
        assert!(fix.contains("GPUFEED_CUFILE_LIBRARY"), "{fix}");
        assert_eq!(d.library, None);
        assert!(d.nvidia_fs.loaded, "facts are still read");
    }

    #[test]
    fn nvidia_fs_and_nvme_ext4_is_available() {
        let tree = Tree::new();
        tree.load_nvidia_fs();
        let d = tree.detect(Some("/data/x"));
        assert_eq!(d.verdict, GdsVerdict::Available, "{}", d.reason);
        assert_eq!(d.peer_path, Some(PeerPath::NvidiaFs));
        assert!(d.reason.contains("nvidia-fs 2.28"), "{}", d.reason);
        assert!(d.reason.contains("ext4 on /dev/nvme0n1p1"), "{}", d.reason);
        assert_eq!(d.fix, None);
        assert_eq!(d.library.as_deref(), Some("libcufile.so.0 1.15"));

        // The machine only: available too.
        let d = tree.detect(None);
        assert_eq!(d.verdict, GdsVerdict::Available);
        assert!(d.file_system.is_none());

        // md over NVMe, Lustre, NFS over RDMA: available; md over NVMe + SATA is not.
        for path in ["/raid/f", "/lustre/f", "/mnt/nfs/f"] {
            assert_eq!(
                tree.detect(Some(path)).verdict,
                GdsVerdict::Available,
                "{path}"
            );
        }
        let mixed = tree.detect(Some("/mixed/f"));
        assert_eq!(mixed.verdict, GdsVerdict::CompatOnly);
        assert!(mixed.reason.contains("md1"), "{}", mixed.reason);
    }

    #[test]
    fn unsupported_file_systems_are_compat_only() {
        let tree = Tree::new();
        tree.load_nvidia_fs();
        let tcp = tree.detect(Some("/mnt/nfstcp/x"));
        assert_eq!(tcp.verdict, GdsVerdict::CompatOnly);
        assert!(tcp.reason.contains("proto=rdma"), "{}", tcp.reason);

        let ovl = tree.detect(Some("/ovl/x"));
        assert_eq!(ovl.verdict, GdsVerdict::CompatOnly);
        assert!(ovl.reason.starts_with("overlay"), "{}", ovl.reason);

        let sata = tree.detect(Some("/sata/x"));
        assert!(
            sata.reason.contains("not on an NVMe device (sdb1)"),
            "{}",
            sata.reason
        );

        let journal = tree.detect(Some("/journal/x"));
        assert_eq!(journal.verdict, GdsVerdict::CompatOnly);
        assert!(
            journal.reason.contains("data=journal"),
            "{}",
            journal.reason
        );
    }

    /// cuFile 1.15 refused every handle on the GPU machine (5027) until udev's record of the
    /// volume's device was there, and refuses tmpfs files always: absent for such a path
    /// whatever else the machine has, compat mode or nvidia-fs.
    #[test]
    fn volumes_cufile_cannot_look_up_are_absent() {
        let tree = Tree::new();
        assert_eq!(tree.detect(Some("/data/x")).verdict, GdsVerdict::CompatOnly);
        fs::remove_file(tree.path("run/udev/data/b259:1")).expect("remove the record");
        for nvidia_fs in [false, true] {
            if nvidia_fs {
                tree.load_nvidia_fs();
            }
            let d = tree.detect(Some("/data/x"));
            assert_eq!(d.verdict, GdsVerdict::Absent, "{}", d.reason);
            assert!(
                d.reason.contains("run/udev/data/b259:1 is missing")
                    && d.reason.contains("5027")
                    && d.reason.starts_with("ext4 on /dev/nvme0n1p1 at /data"),
                "{}",
                d.reason
            );
            assert!(
                d.fix
                    .as_deref()
                    .is_some_and(|f| f.contains("/run/udev:/run/udev:ro")),
                "{:?}",
                d.fix
            );
            let fs = d.file_system.expect("the file system");
            assert_eq!(fs.udev_record, Some(tree.path("run/udev/data/b259:1")));
            assert!(!fs.udev_record_present);
            // Another device of the same machine keeps its verdict.
            assert_ne!(tree.detect(Some("/raid/x")).verdict, GdsVerdict::Absent);
            let shm = tree.detect(Some("/dev/shm/x"));
            assert_eq!(shm.verdict, GdsVerdict::Absent);
            assert!(
                shm.reason.starts_with("tmpfs on tmpfs at /dev/shm: ")
                    && shm.reason.contains("tmpfs has none"),
                "{}",
                shm.reason
            );
            assert!(shm.fix.expect("a fix").contains("disk file system"));
            let shm = tree.detect(Some("/dev/shm/x")).file_system.expect("tmpfs");
            assert_eq!(shm.udev_record, None);
        }
        // Forced compatibility mode does not help either: cuFile refuses the handle first.
        let mut roots = tree.roots();
        roots.force_compat_env = Some("true".into());
        let d = detect(Some(Path::new("/data/x")), Ok("1.15".into()), &roots);
        assert_eq!(d.verdict, GdsVerdict::Absent, "{}", d.reason);
        // The machine alone (no path) is not judged by one volume.
        assert_ne!(tree.detect(None).verdict, GdsVerdict::Absent);
    }

    #[test]
    fn p2pdma_path_needs_kernel_config_and_cufile_json() {
        let tree = Tree::new();
        // Kernel has it, cufile.json does not ask for it.
        let d = tree.detect(Some("/data/x"));
        assert_eq!(d.verdict, GdsVerdict::CompatOnly);
        assert!(d.reason.contains("no nvidia_fs in"), "{}", d.reason);
        assert!(
            d.reason.contains("does not set use_pci_p2pdma"),
            "{}",
            d.reason
        );
        let fix = d.fix.expect("a fix");
        assert!(fix.contains("modprobe nvidia-fs"), "{fix}");
        assert!(fix.contains("use_pci_p2pdma"), "{fix}");

        tree.cufile_json(P2PDMA_ON);
        let d = tree.detect(Some("/data/x"));
        assert_eq!(d.verdict, GdsVerdict::Available, "{}", d.reason);
        assert_eq!(d.peer_path, Some(PeerPath::PciP2pdma));
        assert!(d.reason.contains("CONFIG_PCI_P2PDMA"), "{}", d.reason);

        // P2PDMA reads only ext4/xfs on a plain NVMe device.
        for path in ["/mnt/nfs/x", "/raid/x", "/ovl/x"] {
            let d = tree.detect(Some(path));
            assert_eq!(d.verdict, GdsVerdict::CompatOnly, "{path}");
            assert!(d.fix.expect("a fix").contains("plain NVMe"), "{path}");
        }

        // Neither path, on overlay: both what is missing and the file system are named.
        tree.cufile_json("{}");
        let d = tree.detect(Some("/ovl/x"));
        assert_eq!(d.verdict, GdsVerdict::CompatOnly);
        assert!(
            d.reason.contains("; and even with one, overlay"),
            "{}",
            d.reason
        );
        assert!(d.fix.expect("a fix").contains("local NVMe"));
        let d = tree.detect(None);
        assert!(
            d.reason.contains("cuFile reads in compatibility mode"),
            "{}",
            d.reason
        );

        // cufile.json asks, the kernel lacks it.
        tree.cufile_json(P2PDMA_ON);
        tree.write("boot/config-6.8.0-test", "# CONFIG_PCI_P2PDMA is not set\n");
        let d = tree.detect(Some("/data/x"));
        assert_eq!(d.verdict, GdsVerdict::CompatOnly);
        assert!(d.reason.contains("lacks CONFIG_PCI_P2PDMA"), "{}", d.reason);
    }

    #[test]
    fn no_peer_path_and_no_compat_mode_is_absent() {
        let tree = Tree::new();
        tree.cufile_json(&NVIDIA_STYLE.replace(
            r#""allow_compat_mode": true"#,
            r#""allow_compat_mode": false"#,
        ));
        let d = tree.detect(Some("/data/x"));
        assert_eq!(d.verdict, GdsVerdict::Absent);
        assert!(
            d.reason
                .starts_with("no peer path (nvidia-fs is not loaded"),
            "{}",
            d.reason
        );
        assert!(d.reason.contains("allow_compat_mode false"), "{}", d.reason);
        assert!(d.reason.contains("cuFile refuses reads"), "{}", d.reason);
        assert!(
            d.fix
                .expect("a fix")
                .contains(r#""allow_compat_mode": true"#)
        );

        // With nvidia-fs, an unsupported file system is refused too.
        tree.load_nvidia_fs();
        let d = tree.detect(Some("/dev/shm/x"));
        assert_eq!(d.verdict, GdsVerdict::Absent);
        assert!(d.reason.contains("tmpfs"), "{}", d.reason);
        assert_eq!(tree.detect(Some("/data/x")).verdict, GdsVerdict::Available);
    }

    #[test]
    fn posix_io_mode_forces_compat() {
        let tree = Tree::new();
        tree.load_nvidia_fs();
        tree.cufile_json(r#"{ "properties": { "vanilla_posix_io_mode": true } }"#);
        let d = tree.detect(Some("/data/x"));
        assert_eq!(d.verdict, GdsVerdict::CompatOnly);
        assert!(d.reason.contains("vanilla_posix_io_mode"), "{}", d.reason);

        tree.cufile_json(r#"{ "properties": { "posix_io_mode": true } }"#);
        assert!(read_cufile_config(&tree.roots()).posix_io_mode);

        tree.cufile_json(r#"{ "properties": { "force_compat_mode": true } }"#);
        let d = tree.detect(Some("/data/x"));
        assert_eq!(d.verdict, GdsVerdict::CompatOnly);
        assert!(d.reason.contains("force_compat_mode"), "{}", d.reason);
    }

    #[test]
    fn unknown_file_system_is_not_counted_as_supported() {
        let tree = Tree::new();
        tree.load_nvidia_fs();
        fs::remove_file(tree.path("proc/self/mountinfo")).expect("rm");
        let d = tree.detect(Some("/data/x"));
        assert_eq!(d.verdict, GdsVerdict::CompatOnly);
        assert!(d.file_system_error.is_some());
        assert!(d.reason.contains("unknown"), "{}", d.reason);
    }

    #[test]
    fn verdicts_display_and_serialize() {
        assert_eq!(GdsVerdict::Available.to_string(), "available");
        assert_eq!(GdsVerdict::CompatOnly.to_string(), "compat only");
        assert_eq!(GdsVerdict::Absent.to_string(), "absent");
        let tree = Tree::new();
        let json = serde_json::to_value(tree.detect(Some("/data/x"))).expect("serializes");
        assert_eq!(json["verdict"], "compat_only");
        assert_eq!(json["file_system"]["block_device"], "nvme0n1p1");
    }

    #[test]
    fn real_machine_does_not_panic() {
        let roots = GdsRoots::system();
        let d = detect(
            Some(Path::new("/dev/shm")),
            Err("libcufile.so.0: not tried in this test".to_owned()),
            &roots,
        );
        assert_eq!(d.verdict, GdsVerdict::Absent);
        assert!(d.reason.contains("not tried in this test"));
        let shm = file_system_of(Path::new("/dev/shm"), &roots).expect("/dev/shm is mounted");
        assert_eq!(shm.fs_type, "tmpfs");
        assert_eq!(shm.mount_point, PathBuf::from("/dev/shm"));
        assert_eq!(shm.block_device, None);
    }
}
