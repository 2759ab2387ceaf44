//! `ProcessIdentity::liveness` where /proc does not show what a plain reading expects: a time
//! namespace (start times shifted by the reader's boot-time offset), a /proc mounted with
//! `hidepid=2` (other users' processes invisible), and a process that forks into a new PID
//! namespace after its identity was cached. A live process is never judged dead.

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use gpufeed_os::process::{self, Liveness, ProcessIdentity};

use crate::child;

/// `<pid> <start ticks> <pid ns>` of `id`, as the child role `judge-alive` reads it.
fn id_var(id: &ProcessIdentity) -> String {
    format!("{} {} {}", id.pid, id.start_ticks, id.pid_ns)
}

fn parse_id(s: &str) -> ProcessIdentity {
    let f: Vec<u64> = s.split(' ').map(|v| v.parse().expect("a number")).collect();
    ProcessIdentity {
        pid: f[0] as u32,
        start_ticks: f[1],
        pid_ns: f[2],
    }
}

/// The boot-time offset (seconds) of the time namespace of process `pid`.
fn boottime_offset_of(pid: u32) -> i64 {
    std::fs::read_to_string(format!("/proc/{pid}/timens_offsets"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("boottime")?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
        })
        .unwrap_or(0)
}

/// A process in a time namespace whose boot time is 1000 s ahead (`unshare --time --boottime
/// 1000 --fork`) records its start time on its own clock; judged from outside it is alive.
/// And from inside, this (outside) process is alive too.
#[test]
fn a_live_process_of_another_time_namespace_is_alive() {
    const TEST: &str = "liveness::a_live_process_of_another_time_namespace_is_alive";
    let wrapper = [
        "unshare",
        "--time",
        "--boottime",
        "1000",
        "--fork",
        "--kill-child",
        "--",
    ];
    // Outside judges inside.
    let mut cmd = gpufeed_testkit::wrapped(&wrapper, &child::command("identity-wait", &[]));
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut waiter = match cmd.spawn() {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            gpufeed_testkit::skip(TEST, &"no `unshare` program (util-linux)");
            return;
        }
        Err(e) => panic!("{TEST}: spawn unshare: {e}"),
    };
    let mut lines = BufReader::new(waiter.stdout.take().expect("stdout")).lines();
    let Some(line) = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.starts_with("ID="))
    else {
        let out = waiter.wait_with_output().expect("wait");
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !gpufeed_testkit::is_root() && stderr.contains("unshare failed") {
            gpufeed_testkit::skip(TEST, &format_args!("the kernel refused: {}", stderr.trim()));
            return;
        }
        panic!(
            "{TEST}: the child printed nothing ({}): {stderr}",
            out.status
        );
    };
    let recorded = parse_id(line.trim().strip_prefix("ID=").expect("ID="));
    assert_eq!(
        boottime_offset_of(recorded.pid),
        1000,
        "the child is not in the time namespace: the test does not test"
    );
    let judged = recorded.liveness();
    let of = ProcessIdentity::of(recorded.pid);
    drop(waiter.stdin.take());
    waiter.wait().expect("wait");
    assert_eq!(
        judged,
        Liveness::Alive,
        "a live process of a time namespace (recorded {recorded:?}, read now {of:?}) judged dead"
    );

    // Inside judges outside.
    let me = ProcessIdentity::current();
    if let Some(out) = child::run_wrapped(
        TEST,
        &wrapper,
        "judge-alive",
        &[
            ("GPUFEED_IT_ID", id_var(&me)),
            ("GPUFEED_IT_BOOTTIME", "1000".into()),
        ],
    ) {
        assert!(out.contains("ALIVE-OK"), "{out}");
    }
}

/// With /proc mounted `hidepid=2`, `nobody` cannot read `/proc/<pid>/stat` of root's
/// processes; a live one (this test process) is still alive to it, and `of(pid)` finds it.
#[test]
fn a_live_process_hidden_by_hidepid_is_alive() {
    const TEST: &str = "liveness::a_live_process_hidden_by_hidepid_is_alive";
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(TEST, &"needs root to mount /proc and run a child as nobody");
        return;
    }
    let me = ProcessIdentity::current();
    // A private mount namespace with its own /proc (hidepid=2), then nobody.
    let script = "mount -t proc -o hidepid=2 proc /proc && \
                  exec setpriv --reuid=65534 --regid=65534 --clear-groups -- \"$0\" \"$@\"";
    let out = child::run_wrapped(
        TEST,
        &[
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            script,
        ],
        "judge-alive",
        &[
            ("GPUFEED_IT_ID", id_var(&me)),
            ("GPUFEED_IT_HIDDEN", "1".into()),
        ],
    );
    if let Some(out) = out {
        assert!(out.contains("ALIVE-OK"), "{out}");
    }
}

/// Child role `judge-alive`: the process GPUFEED_IT_ID must be alive, and `of(pid)` must find
/// it. With GPUFEED_IT_HIDDEN=1 its /proc entry must be hidden from us; with
/// GPUFEED_IT_BOOTTIME=<s> our time namespace must have that boot-time offset (so the test
/// tests).
pub fn judge_alive() {
    let id = parse_id(&std::env::var("GPUFEED_IT_ID").expect("GPUFEED_IT_ID"));
    if std::env::var("GPUFEED_IT_HIDDEN").is_ok_and(|v| v == "1") {
        assert_ne!(rustix::process::geteuid().as_raw(), 0, "still root");
        assert!(
            std::fs::read_to_string(format!("/proc/{}/stat", id.pid)).is_err(),
            "/proc/{}/stat is readable: hidepid did not hide it, the test does not test",
            id.pid
        );
    }
    if let Ok(offset) = std::env::var("GPUFEED_IT_BOOTTIME") {
        assert_eq!(
            boottime_offset_of(std::process::id()).to_string(),
            offset,
            "not in the time namespace: the test does not test"
        );
    }
    assert_eq!(
        id.liveness(),
        Liveness::Alive,
        "a live process ({id:?}) judged dead"
    );
    let of = ProcessIdentity::of(id.pid);
    assert!(of.is_some(), "of({}) found no process", id.pid);
    println!("ALIVE-OK");
}

/// A process that is pid 1 of its PID namespace caches its namespace and whether /proc is
/// its own, unshares a new PID namespace and forks: the child (pid 1 again, of the new
/// namespace, whose /proc is the parent's) reads its own namespace and /proc afresh, and
/// judges the parent's recorded identity as of another namespace.
#[test]
fn a_child_forked_into_a_new_pid_namespace_does_not_keep_its_parents_cache() {
    const TEST: &str =
        "liveness::a_child_forked_into_a_new_pid_namespace_does_not_keep_its_parents_cache";
    let mut cmd = child::command("fork-new-pidns", &[]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let Some(child) = gpufeed_testkit::spawn_in_new_pid_namespace(TEST, &mut cmd) else {
        return;
    };
    let out = child.wait_with_output().expect("wait");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("FORKNS-OK"),
        "{TEST} ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Child role `fork-new-pidns` (pid 1 of a PID namespace with its own /proc).
pub fn fork_into_a_new_pid_namespace() {
    assert_eq!(std::process::id(), 1, "not pid 1: the test does not test");
    let ns = process::current_pid_ns();
    assert!(process::proc_is_ours(), "our /proc is our namespace's");
    let me = ProcessIdentity::current();
    assert_eq!(me.liveness(), Liveness::Alive);
    // SAFETY: unshare has no memory-safety preconditions.
    assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWPID) }, 0, "unshare");
    // SAFETY: the child only reads files, prints and calls _exit; glibc's malloc stays usable
    // after fork.
    match unsafe { libc::fork() } {
        0 => {
            use std::os::unix::fs::MetadataExt;
            let real = std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino());
            let mut failures = Vec::new();
            if std::process::id() != 1 {
                failures.push(format!("child pid {} (not 1)", std::process::id()));
            }
            if real == ns {
                failures.push("the new namespace has the old inode".to_owned());
            }
            let cached = process::current_pid_ns();
            if cached != real {
                failures.push(format!(
                    "current_pid_ns() = {cached} (the parent's {ns}), really {real}"
                ));
            }
            if process::proc_is_ours() {
                failures.push(
                    "proc_is_ours() kept the parent's answer: this /proc is the parent \
                     namespace's"
                        .to_owned(),
                );
            }
            let parent = me.liveness();
            if parent != Liveness::OtherNamespace {
                failures.push(format!(
                    "the parent (of the old namespace) judged {parent:?}, not OtherNamespace"
                ));
            }
            for f in &failures {
                eprintln!("FAIL: {f}");
            }
            // SAFETY: _exit ends the forked child without running the parent's destructors.
            unsafe { libc::_exit(i32::from(!failures.is_empty())) }
        }
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        pid => {
            let mut status = 0;
            // SAFETY: waits for our own child.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            assert!(
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                "the forked child failed ({status:#x}); see its stderr"
            );
        }
    }
    println!("FORKNS-OK");
}
