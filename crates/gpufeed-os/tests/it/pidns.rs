//! A PID namespace whose /proc is not its own (`unshare --pid --fork` without `--mount-proc`,
//! or a sandbox that binds the host's /proc): /proc/<pid> there names the host's process of
//! that number. Live processes must still be judged alive.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Stdio};

use gpufeed_os::AtomicFile;
use gpufeed_os::process::{Liveness, ProcessIdentity};
use gpufeed_os::shm;

use crate::{child, unique_prefix};

/// Runs the child role `role` of this test binary under `unshare --pid --fork` (its /proc
/// stays the caller's); its stdout, or `None` after printing why `test` is skipped.
fn run_in_pid_namespace_without_proc(
    test: &str,
    role: &str,
    vars: &[(&str, String)],
) -> Option<String> {
    let mut cmd = gpufeed_testkit::wrapped(
        &["unshare", "--pid", "--fork", "--kill-child", "--"],
        &child::command(role, vars),
    );
    cmd.stdin(Stdio::null());
    let out = match cmd.output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            gpufeed_testkit::skip(test, &"no `unshare` program (util-linux)");
            return None;
        }
        Err(e) => panic!("{test}: spawn unshare: {e}"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() && !gpufeed_testkit::is_root() && stderr.contains("unshare failed") {
        gpufeed_testkit::skip(
            test,
            &format_args!("the kernel refused a PID namespace: {}", stderr.trim()),
        );
        return None;
    }
    assert!(
        out.status.success(),
        "{test}: the child in the PID namespace failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    Some(stdout)
}

/// Under `unshare --pid --fork` without its own /proc: a live child (which recorded its own
/// identity) is Alive and `of(pid)` gives its true start time; once killed it is Dead, as a
/// zombie and after the wait. `shm::gc` keeps a live owner's segment (removes it once the
/// owner died), and `AtomicFile::create` keeps a live writer's temporary.
#[test]
fn live_processes_stay_alive_in_a_pid_namespace_without_its_own_proc() {
    let out = run_in_pid_namespace_without_proc(
        "pidns::live_processes_stay_alive_in_a_pid_namespace_without_its_own_proc",
        "pidns-foreign-proc",
        &[("GPUFEED_IT_PREFIX", unique_prefix("pn"))],
    );
    if let Some(out) = out {
        assert!(out.contains("PIDNS-OK"), "{out}");
    }
}

/// A line `KEY=value` from a child's stdout.
fn read_value(child: &mut Child, key: &str) -> String {
    let out = child.stdout.as_mut().expect("piped stdout");
    let mut reader = BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        let n = reader
            .read_line(&mut line)
            .expect("read the child's stdout");
        assert!(n > 0, "the child ended before printing {key}=");
        if let Some(v) = line.trim().strip_prefix(&format!("{key}=")) {
            return v.to_owned();
        }
    }
}

fn spawn(role: &str, vars: &[(&str, String)]) -> Child {
    child::command(role, vars)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn a child")
}

/// Child role `identity-wait`: prints `ID=<pid> <start ticks> <pid ns>` of itself and waits
/// until stdin closes.
pub fn print_identity_and_wait() {
    let me = ProcessIdentity::current();
    println!("ID={} {} {}", me.pid, me.start_ticks, me.pid_ns);
    std::io::stdout().flush().expect("flush");
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// Child role `atomic-hold`: creates a temporary for GPUFEED_IT_PATH, prints `READY=1` and
/// waits until stdin closes.
pub fn hold_a_temporary() {
    let path = std::env::var("GPUFEED_IT_PATH").expect("GPUFEED_IT_PATH");
    let f = AtomicFile::create(&path, Some(4096)).expect("create");
    println!("READY=1");
    std::io::stdout().flush().expect("flush");
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    drop(f);
}

/// Sets the modification time of `path` (and what a directory holds) an hour back.
fn age(path: &std::path::Path) {
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let set = |p: &std::path::Path| {
        std::fs::File::open(p)
            .and_then(|f| f.set_modified(old))
            .unwrap_or_else(|e| panic!("set the mtime of {}: {e}", p.display()));
    };
    if path.is_dir() {
        for e in std::fs::read_dir(path).expect("ls").flatten() {
            set(&e.path());
        }
    }
    set(path);
}

/// Child role `pidns-foreign-proc`, run as pid 1 of a new PID namespace whose /proc is the
/// parent's.
pub fn in_pid_namespace_with_foreign_proc() {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let proc_self: i32 = std::fs::read_link("/proc/self")
        .expect("readlink /proc/self")
        .to_string_lossy()
        .parse()
        .expect("a pid");
    assert_ne!(
        proc_self, me,
        "this /proc is our own: the test does not test"
    );

    // A live child that recorded its own identity.
    let mut live = spawn("identity-wait", &[]);
    let id = read_value(&mut live, "ID");
    let f: Vec<u64> = id.split(' ').map(|v| v.parse().expect("number")).collect();
    let recorded = ProcessIdentity {
        pid: f[0] as u32,
        start_ticks: f[1],
        pid_ns: f[2],
    };
    assert_eq!(recorded.pid, live.id());
    assert!(recorded.start_ticks > 0);
    assert_eq!(
        recorded.liveness(),
        Liveness::Alive,
        "a live child judged by the host's /proc"
    );
    let of = ProcessIdentity::of(live.id()).expect("the child runs");
    assert_eq!(of, recorded, "of(pid) is another process's identity");

    // shm gc keeps a live owner's segment.
    let prefix = std::env::var("GPUFEED_IT_PREFIX").expect("prefix");
    let mut owner = spawn("shm-own", &[("GPUFEED_IT_PREFIX", prefix.clone())]);
    let name = read_value(&mut owner, "NAME");
    let listed = shm::list(&prefix).expect("list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].owner, Liveness::Alive, "{listed:?}");
    let report = shm::gc(&prefix).expect("gc");
    assert!(
        report.removed.is_empty(),
        "gc removed a live owner's segment: {report:?}"
    );
    assert_eq!(report.kept, std::slice::from_ref(&name));

    // AtomicFile keeps a live writer's temporary, even an old one.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut writer = spawn(
        "atomic-hold",
        &[(
            "GPUFEED_IT_PATH",
            dir.path().join("a.bin").display().to_string(),
        )],
    );
    read_value(&mut writer, "READY");
    let temporaries = || -> Vec<_> {
        std::fs::read_dir(dir.path())
            .expect("ls")
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.to_string_lossy().contains(".gpufeed-tmp-"))
            .collect()
    };
    let held = temporaries();
    assert_eq!(held.len(), 1, "{held:?}");
    age(&held[0]);
    let other = AtomicFile::create(dir.path().join("b.bin"), None).expect("create");
    assert!(
        other.cleaned().is_empty(),
        "a live writer's temporary removed: {:?}",
        other.cleaned()
    );
    drop(other);
    assert_eq!(temporaries(), held);

    // Killed: dead as a zombie, and after the wait.
    live.kill().expect("kill");
    let t = std::time::Instant::now();
    while recorded.liveness() != Liveness::Dead && t.elapsed().as_secs() < 10 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(
        recorded.liveness(),
        Liveness::Dead,
        "a killed child (a zombie) judged alive"
    );
    live.wait().expect("wait");
    assert_eq!(recorded.liveness(), Liveness::Dead);

    // The segment's owner ends: gc removes it.
    drop(owner.stdin.take());
    assert!(owner.wait().expect("wait").success());
    let report = shm::gc(&prefix).expect("gc");
    assert_eq!(report.removed, [name]);

    drop(writer.stdin.take());
    assert!(writer.wait().expect("wait").success());
    println!("PIDNS-OK");
}
