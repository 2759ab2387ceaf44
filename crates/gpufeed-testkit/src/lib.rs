//! Helpers shared by the integration tests of the gpufeed crates: random data, seeds that a
//! failure prints for replay, GPU skips that turn into failures on the GPU machine, and child
//! processes that re-run the test binary in a role; a real S3 server and a fault-injecting
//! proxy ([`s3`]).

pub mod s3;

use std::process::{Command, Stdio};

/// Deterministic pseudo-random bytes (splitmix64), never long runs of zeros.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut state = seed;
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        c.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    for (i, b) in chunks.into_remainder().iter_mut().enumerate() {
        *b = (seed as u8).wrapping_add(i as u8) | 1;
    }
    out
}

/// A seed that differs between runs (or `GPUFEED_TEST_SEED`), printed so a failure can be
/// replayed.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var("GPUFEED_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("{test}: seed {seed} (replay with GPUFEED_TEST_SEED={seed})");
    seed
}

/// Whether GPU tests must run (`GPUFEED_REQUIRE_GPU=1`, set on the GPU machine).
pub fn gpu_required() -> bool {
    std::env::var("GPUFEED_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// Skips `test` because no GPU is usable (`why`), printing the reason; fails instead when a
/// GPU is required.
pub fn skip_without_gpu(test: &str, why: &dyn std::fmt::Display) {
    assert!(
        !gpu_required(),
        "{test}: GPUFEED_REQUIRE_GPU=1 but no GPU: {why}"
    );
    skip(test, why);
}

/// Prints `SKIP test: why` where the person running `cargo test` sees it: straight to the
/// process's stderr, which libtest does not capture (it captures only `print!`/`eprint!`), so
/// a skipped test is not a silent `ok`.
pub fn skip(test: &str, why: &dyn std::fmt::Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "SKIP {test}: {why}");
}

/// The opened GPU (or context), or None after skipping `test` with the error as the reason
/// (see [`skip_without_gpu`]).
pub fn opened_or_skip<T, E: std::fmt::Display>(test: &str, opened: Result<T, E>) -> Option<T> {
    match opened {
        Ok(gpu) => Some(gpu),
        Err(e) => {
            skip_without_gpu(test, &e);
            None
        }
    }
}

/// The environment variable that tells a re-run test binary which role to play.
pub const CHILD_ROLE: &str = "GPUFEED_IT_CHILD";

/// A command re-running this test binary as a child in `role`: only the test `dispatcher`
/// (a test that returns at once unless [`CHILD_ROLE`] is set) runs, with `vars` set.
pub fn child_command(dispatcher: &str, role: &str, vars: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("the test binary's path"));
    cmd.args([
        dispatcher,
        "--exact",
        "--nocapture",
        "--test-threads=1",
        "-q",
    ])
    .env(CHILD_ROLE, role)
    // Children start without the variables that change gpufeed's choices, whatever the
    // caller's shell holds; a role that needs one passes it in `vars`.
    .env_remove("GPUFEED_IO_BACKEND")
    .env_remove("RANK")
    .env_remove("WORLD_SIZE")
    .stdin(Stdio::null());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd
}

/// A command that runs `inner` under a wrapper program: `wrapper[0]` with the rest of
/// `wrapper` as its first arguments, then `inner`'s program and arguments (`unshare --user --`,
/// `sh -c 'script' sh`, ...), with `inner`'s environment changes (set and removed variables).
/// Standard streams and the rest are left to the caller.
pub fn wrapped(wrapper: &[&str], inner: &Command) -> Command {
    let mut cmd = Command::new(wrapper[0]);
    cmd.args(&wrapper[1..])
        .arg(inner.get_program())
        .args(inner.get_args());
    for (k, v) in inner.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    cmd
}

/// Runs a child to completion; panics with its output if it failed; returns its stdout.
pub fn run_child(dispatcher: &str, role: &str, vars: &[(&str, String)]) -> String {
    let out = child_command(dispatcher, role, vars)
        .output()
        .expect("spawn the child");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child {role} failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Makes `cmd` run as pid 1 of a new PID namespace that has its own /proc, the way a container
/// started with `--ipc=host` sees the machine: same /dev/shm, its own pids.
///
/// Before `exec` the spawned process calls `unshare(CLONE_NEWPID | CLONE_NEWNS)` and forks:
/// the grandchild (pid 1 of the new namespace, killed when its parent dies) mounts a private
/// /proc and execs `cmd`'s program; the child waits for it and exits with its status, so
/// `Child::kill` and `Child::wait` work on the pair. Spawning fails with the `unshare` error
/// (EPERM without `CAP_SYS_ADMIN`): callers skip with that reason.
pub fn in_new_pid_namespace(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and calls only async-signal-safe
    // functions (unshare, fork, prctl, mount, waitpid, _exit); it allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            if libc::unshare(libc::CLONE_NEWPID | libc::CLONE_NEWNS) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let pid = libc::fork();
            if pid < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if pid > 0 {
                // The waiting parent: mirror the grandchild's end. It keeps only stdio: the
                // channel on which `spawn` learns that exec succeeded must close when the
                // grandchild execs, not when this process exits.
                libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
                let mut status = 0;
                loop {
                    let r = libc::waitpid(pid, &mut status, 0);
                    if r == pid {
                        break;
                    }
                    if r < 0 && *libc::__errno_location() != libc::EINTR {
                        libc::_exit(127);
                    }
                }
                let code = if libc::WIFEXITED(status) {
                    libc::WEXITSTATUS(status)
                } else {
                    128 + libc::WTERMSIG(status)
                };
                libc::_exit(code);
            }
            // Pid 1 of the new namespace: die with the waiting parent, see our own pids.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            let root = c"/".as_ptr();
            let proc_ = c"/proc".as_ptr();
            if libc::mount(
                std::ptr::null(),
                root,
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
                || libc::mount(
                    c"proc".as_ptr(),
                    proc_,
                    c"proc".as_ptr(),
                    libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                    std::ptr::null(),
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// Spawns `cmd` as pid 1 of a new PID namespace ([`in_new_pid_namespace`]), or returns `None`
/// after printing why `test` is skipped: only where we are not root and the kernel refused
/// (`EPERM`). As root (CI) a refusal is a failure.
pub fn spawn_in_new_pid_namespace(test: &str, cmd: &mut Command) -> Option<std::process::Child> {
    in_new_pid_namespace(cmd);
    match cmd.spawn() {
        Ok(child) => Some(child),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) && !is_root() => {
            eprintln!("SKIP {test}: creating a PID namespace needs CAP_SYS_ADMIN: {e}");
            None
        }
        Err(e) => panic!("{test}: spawning a child in a new PID namespace failed: {e}"),
    }
}

/// Whether this process runs as root (CI does: tests that need root must not skip there).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// For a test that needs a privilege: as root, `why` it could not run is a failure; otherwise
/// the test is skipped with `why` printed.
pub fn skip_unless_root(test: &str, why: &dyn std::fmt::Display) {
    assert!(
        !is_root(),
        "{test}: {why} (running as root, so this is a failure, not a skip)"
    );
    skip(test, &format_args!("{why}; needs root"));
}

/// Makes a FIFO at `path` (mode 0600): a path that blocks an `open` for reading until a
/// writer comes, for tests that such paths are refused without blocking.
pub fn mkfifo(path: &std::path::Path) {
    let c =
        std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("a path without NUL");
    // SAFETY: a valid NUL-terminated path.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(
        rc,
        0,
        "mkfifo {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

/// A file system mounted in a temporary directory (unmounted on drop), as root: a small tmpfs
/// that fills up for real (`ENOSPC`), or a ramfs, which refuses `O_DIRECT`.
pub struct TestMount {
    dir: tempfile::TempDir,
}

impl TestMount {
    /// A tmpfs of `size` (`mount -o size=...`, e.g. `"1m"`); the reason where it cannot be
    /// mounted (not root, no `mount`): callers skip with it via [`skip_unless_root`].
    pub fn tmpfs(size: &str) -> Result<Self, String> {
        Self::mount("tmpfs", &format!("size={size},mode=0700"))
    }

    /// A ramfs (no `O_DIRECT`, no size limit: write little to it).
    pub fn ramfs() -> Result<Self, String> {
        Self::mount("ramfs", "mode=0700")
    }

    fn mount(fstype: &str, options: &str) -> Result<Self, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", fstype, "-o", options, fstype])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
        }
        Ok(TestMount { dir })
    }

    /// The mount point.
    pub fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for TestMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

/// The bytes of an `.npy` file as numpy writes them (format 1.0, the header padded with spaces
/// to a multiple of 64 bytes): `descr` such as `<u2`, `shape` such as `(40, 7)`, then `data`.
pub fn npy_bytes(descr: &str, fortran: bool, shape: &str, data: &[u8]) -> Vec<u8> {
    let mut header = format!(
        "{{'descr': '{descr}', 'fortran_order': {}, 'shape': {shape}, }}",
        if fortran { "True" } else { "False" }
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// A child process killed and reaped when dropped (also when a test panics).
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The loop of an attacker who may write `dir` (a child run as another user): every name with
/// `gpufeed-tmp-` in it that is not a symlink is renamed aside (`<name>.moved<n>`) and replaced
/// by a symlink to `victim`, for ever. Prints `READY` first. Panics when run as root (the
/// attacker must be another user).
pub fn swap_temporaries_forever(dir: &std::path::Path, victim: &std::path::Path) -> ! {
    use std::io::Write;
    // SAFETY: geteuid has no preconditions and cannot fail.
    assert_ne!(unsafe { libc::geteuid() }, 0, "the attacker runs as root");
    println!("READY");
    std::io::stdout().flush().expect("flush");
    let mut n = 0u64;
    loop {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.contains("gpufeed-tmp-") || name.contains(".moved") {
                continue;
            }
            if e.file_type().map_or(true, |t| t.is_symlink()) {
                continue;
            }
            n += 1;
            let from = dir.join(&name);
            if std::fs::rename(&from, dir.join(format!("{name}.moved{n}"))).is_ok() {
                let _ = std::os::unix::fs::symlink(victim, &from);
            }
        }
    }
}
