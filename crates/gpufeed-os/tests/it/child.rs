//! Child processes for the multi-process tests: the test binary re-runs itself with
//! `GPUFEED_IT_CHILD=<role>` and only the `child::entry` test, which then acts out the role.
//! Without that variable `entry` returns at once: it is a dispatcher, not a test.

use std::os::fd::{FromRawFd, OwnedFd};
use std::process::Command;

use gpufeed_os::shm::{ShmOptions, ShmSegment};

const ROLE: &str = gpufeed_testkit::CHILD_ROLE;

/// A command that runs this test binary as a child in `role`, with `vars` set.
pub fn command(role: &str, vars: &[(&str, String)]) -> Command {
    gpufeed_testkit::child_command("child::entry", role, vars)
}

/// Runs a child to completion and panics with its output if it failed.
pub fn run(role: &str, vars: &[(&str, String)]) -> String {
    gpufeed_testkit::run_child("child::entry", role, vars)
}

/// Runs the child role `role` under the wrapper command `wrapper` (e.g. `unshare --time
/// --fork`), which gets the child's program and arguments after its own; its stdout, or `None`
/// after printing why `test` is skipped (the program is missing, or we are not root and the
/// kernel refused what the wrapper asked for).
pub fn run_wrapped(
    test: &str,
    wrapper: &[&str],
    role: &str,
    vars: &[(&str, String)],
) -> Option<String> {
    let mut cmd = gpufeed_testkit::wrapped(wrapper, &command(role, vars));
    cmd.stdin(std::process::Stdio::null());
    let out = match cmd.output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            gpufeed_testkit::skip(test, &format_args!("no `{}` program", wrapper[0]));
            return None;
        }
        Err(e) => panic!("{test}: spawn {}: {e}", wrapper[0]),
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() && !gpufeed_testkit::is_root() && stderr.contains("unshare failed") {
        gpufeed_testkit::skip(
            test,
            &format_args!("the kernel refused a namespace: {}", stderr.trim()),
        );
        return None;
    }
    assert!(
        out.status.success(),
        "{test}: the child failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    Some(stdout)
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("child needs {name}"))
}

fn num(name: &str) -> u64 {
    var(name)
        .parse()
        .unwrap_or_else(|_| panic!("{name} is not a number"))
}

#[test]
fn entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        // With /proc unmounted (run under a wrapper that does it): opens GPUFEED_IT_PATH, renames
        // GPUFEED_IT_OTHER over it, and checks that a reopen of the opened file refuses the file
        // now at the path; then opens the path again and reopens it: its bytes, GPUFEED_IT_SEED's.
        "reopen-without-proc" => {
            assert!(
                !std::path::Path::new("/proc/self").exists(),
                "the wrapper left /proc mounted"
            );
            let path = std::path::PathBuf::from(var("GPUFEED_IT_PATH"));
            let first = gpufeed_os::OpenedFile::open(&path).expect("open");
            std::fs::rename(var("GPUFEED_IT_OTHER"), &path).expect("rename over");
            let err = first.reopen(0).expect_err("another file at the path");
            assert_eq!(err.kind(), std::io::ErrorKind::Other, "{err}");
            assert!(err.to_string().contains("another file"), "{err}");
            let again = gpufeed_os::OpenedFile::open(&path).expect("open the new one");
            let file = again.reopen(0).expect("reopened by the path");
            let mut got = vec![0u8; again.len() as usize];
            std::os::unix::fs::FileExt::read_exact_at(&file, &mut got, 0).expect("read");
            assert_eq!(got, crate::random_bytes(got.len(), num("GPUFEED_IT_SEED")));
            println!("REOPENED {}", got.len());
        }
        // Opens a named segment and fills it with the pattern of GPUFEED_IT_SEED.
        "shm-write" => {
            let seg = ShmSegment::open(&var("GPUFEED_IT_NAME")).expect("open by name");
            let data = crate::random_bytes(seg.len(), num("GPUFEED_IT_SEED"));
            seg.write_at(0, &data).expect("write");
        }
        // Maps an inherited memfd and fills it with the pattern of GPUFEED_IT_SEED.
        "memfd-write" => {
            // SAFETY: the parent passed us this descriptor number, open and ours alone.
            let fd = unsafe { OwnedFd::from_raw_fd(num("GPUFEED_IT_FD") as i32) };
            let seg = ShmSegment::from_fd(fd).expect("map inherited memfd");
            let data = crate::random_bytes(seg.len(), num("GPUFEED_IT_SEED"));
            seg.write_at(0, &data).expect("write");
        }
        // Creates a segment that outlives it, prints its name, and waits until stdin closes.
        "shm-own" => {
            let seg = ShmOptions::new()
                .prefix(var("GPUFEED_IT_PREFIX"))
                .unlink_on_drop(false)
                .create_unique(64 * 1024)
                .expect("create");
            println!("NAME={}", seg.name().expect("named"));
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
        }
        // As another user: swaps temporaries in GPUFEED_IT_DIR for symlinks to
        // GPUFEED_IT_VICTIM until killed.
        "tmp-swapper" => gpufeed_testkit::swap_temporaries_forever(
            std::path::Path::new(&var("GPUFEED_IT_DIR")),
            std::path::Path::new(&var("GPUFEED_IT_VICTIM")),
        ),
        // Saves a file with the umask GPUFEED_IT_UMASK (octal).
        "atomic-save" => crate::atomic::save_with_umask(
            std::path::Path::new(&var("GPUFEED_IT_PATH")),
            u32::from_str_radix(&var("GPUFEED_IT_UMASK"), 8).expect("an octal umask"),
        ),
        // Prints its own identity and waits until stdin closes.
        "identity-wait" => crate::pidns::print_identity_and_wait(),
        // Holds an AtomicFile's temporary until stdin closes.
        "atomic-hold" => crate::pidns::hold_a_temporary(),
        // In a PID namespace whose /proc is the parent's: judges live and dead processes.
        "pidns-foreign-proc" => crate::pidns::in_pid_namespace_with_foreign_proc(),
        // In an unmapped user namespace: lists and gcs segments of GPUFEED_IT_PREFIX.
        "userns-list-gc" => crate::userns::list_and_gc_unmapped(),
        // gc of GPUFEED_IT_DIR (run as a user who cannot remove what it finds).
        "shm-gc-dir" => crate::userns::gc_dir(),
        // Lowers RLIMIT_MEMLOCK, drops CAP_IPC_LOCK, and checks what mlock says.
        "memlock" => crate::lock::in_child_with_low_limit(),
        // As another user: exchanges every private directory made in GPUFEED_IT_DIR with
        // GPUFEED_IT_VICTIM (a name in that directory) and back, until killed.
        "tmp-exchanger" => crate::atomic::exchange_private_dirs_forever(
            std::path::Path::new(&var("GPUFEED_IT_DIR")),
            &var("GPUFEED_IT_VICTIM"),
        ),
        // Judges the process GPUFEED_IT_ID (`<pid> <start ticks> <pid ns>`): must be alive.
        "judge-alive" => crate::liveness::judge_alive(),
        // Pid 1 of a PID namespace: caches its identity, unshares a new PID namespace, forks.
        "fork-new-pidns" => crate::liveness::fork_into_a_new_pid_namespace(),
        // As uid 65534 mapped in a user namespace: its own segments are its own.
        "userns-mapped-own" => crate::userns::own_segments_as_mapped_overflow_uid(),
        // Removes the segment GPUFEED_IT_NAME and creates a new one of that name (kept).
        "shm-replace" => crate::shm::replace_segment(),
        other => panic!("unknown child role {other}"),
    }
}
