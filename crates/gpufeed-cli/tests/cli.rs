//! End to end: the `gpufeed` binary's exit codes, JSON and errors.

use assert_cmd::Command;
use serde_json::Value;

fn gpufeed() -> Command {
    Command::cargo_bin("gpufeed").expect("the gpufeed binary")
}

fn json_of(cmd: &mut Command) -> (Value, i32) {
    let out = cmd.arg("--json").output().expect("run gpufeed");
    let v = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("JSON: {e}\n{}", String::from_utf8_lossy(&out.stdout)));
    (v, out.status.code().expect("exit code"))
}

fn one_line_error(out: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("gpufeed: error: "), "{err}");
    err
}

#[test]
fn help_lists_every_command_and_the_exit_codes() {
    let out = gpufeed().arg("--help").output().expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    for cmd in [
        "doctor",
        "advise",
        "load",
        "warm",
        "evict",
        "residency",
        "lock",
        "shm",
        "EXIT CODES",
        "EXAMPLES",
    ] {
        assert!(text.contains(cmd), "--help lacks {cmd}");
    }
}

#[test]
fn doctor_json_has_the_documented_fields_and_exit_code() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let (v, code) = json_of(gpufeed().args(["doctor", "--path"]).arg(dir.path()));
    let checks = v.as_array().expect("a list of checks");
    assert!(checks.len() >= 10, "{v}");
    for c in checks {
        assert!(c["name"].is_string() && c["observed"].is_string(), "{c}");
        assert!(
            ["Ok", "Warn", "Fail"].contains(&c["status"].as_str().expect("status")),
            "{c}"
        );
        if c["status"] != "Ok" {
            assert!(
                c["fix"].is_string(),
                "a check that is not OK says how to fix it: {c}"
            );
        }
    }
    let failed = checks.iter().any(|c| c["status"] == "Fail");
    assert_eq!(code, i32::from(failed), "exit 1 exactly when a check fails");
    for name in [
        "memlock limit",
        "/dev/shm",
        "io_uring",
        "O_DIRECT",
        "CUDA driver",
        "stale shared memory",
    ] {
        assert!(checks.iter().any(|c| c["name"] == name), "no {name} check");
    }
}

#[test]
fn residency_follows_warm_and_evict() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("data.bin");
    std::fs::write(&path, gpufeed_testkit::random_bytes(4 << 20, 1)).expect("write");
    let empty = dir.path().join("empty.bin");
    std::fs::write(&empty, b"").expect("write");
    let (v, code) = json_of(gpufeed().arg("evict").arg(&path));
    assert_eq!(code, 0);
    assert!(
        v["files"][0]["fraction"].as_f64().expect("fraction") < 0.05,
        "{v}"
    );
    let (v, _) = json_of(gpufeed().arg("warm").arg(&path));
    assert_eq!(v["files"][0]["fraction"], 1.0, "{v}");
    let (v, code) = json_of(gpufeed().arg("residency").arg(&path).arg(&empty));
    assert_eq!(code, 0);
    assert_eq!(
        v["files"][0]["resident_pages"],
        v["files"][0]["total_pages"]
    );
    assert_eq!(
        v["files"][1]["total_pages"], 0,
        "an empty file has no pages"
    );
    assert_eq!(v["total_pages"], 1024);
}

#[test]
fn bad_input_is_a_one_line_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = gpufeed()
        .arg("residency")
        .arg(dir.path().join("missing"))
        .output()
        .expect("run");
    assert_eq!(missing.status.code(), Some(3));
    assert!(one_line_error(&missing).contains("check the path"));
    let directory = gpufeed().arg("warm").arg(dir.path()).output().expect("run");
    assert_eq!(directory.status.code(), Some(3));
    assert!(one_line_error(&directory).contains("directory"));
    let size = gpufeed()
        .args(["advise", "--size", "1.5G"])
        .output()
        .expect("run");
    assert_eq!(size.status.code(), Some(2), "clap usage error");
    assert!(
        String::from_utf8_lossy(&size.stderr).contains("1GiB"),
        "the error shows a valid size"
    );
    let nothing = gpufeed().arg("advise").output().expect("run");
    assert!(one_line_error(&nothing).contains("--size"));
    let strategy = gpufeed()
        .args(["load", "/etc/hostname", "--strategy", "fast"])
        .output()
        .expect("run");
    assert!(one_line_error(&strategy).contains("registered, staged"));
}

#[test]
fn load_without_a_gpu_says_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("f.bin");
    std::fs::write(&path, [1u8; 100]).expect("write");
    let out = gpufeed().arg("load").arg(&path).output().expect("run");
    if out.status.success() {
        eprintln!("a GPU is present: the no-GPU path is not exercised");
        return;
    }
    assert_eq!(out.status.code(), Some(3));
    assert!(one_line_error(&out).contains("NVIDIA driver"));
}

#[test]
fn advise_follows_the_tree() {
    let (v, code) = json_of(gpufeed().args([
        "advise",
        "--persistent",
        "--processes",
        "4",
        "--size",
        "1GiB",
    ]));
    assert_eq!(code, 0);
    assert_eq!(v["recommendation"]["storage"], "mmap(MAP_SHARED)");
    assert_eq!(
        v["recommendation"]["scores"][0]["option"],
        "mmap(MAP_SHARED)"
    );
    let (v, _) = json_of(gpufeed().args(["advise", "--size", "1MiB", "--processes", "2"]));
    assert_eq!(
        v["recommendation"]["storage"],
        "shared memory + synchronization"
    );
}

#[test]
fn advise_measure_ranks_trials() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("data.bin");
    std::fs::write(&path, gpufeed_testkit::random_bytes(8 << 20, 2)).expect("write");
    let (v, code) = json_of(gpufeed().args(["advise", "--measure", "--path"]).arg(&path));
    assert_eq!(code, 0);
    let m = &v["trials"];
    let trials = m["trials"].as_array().expect("trials");
    assert!(trials.len() >= 3, "{v}");
    let rates: Vec<f64> = trials.iter().filter_map(|t| t["gbps"].as_f64()).collect();
    assert!(!rates.is_empty(), "{v}");
    assert!(
        rates.windows(2).all(|w| w[0] >= w[1]),
        "best first: {rates:?}"
    );
    assert_eq!(m["bytes"], 8 << 20, "{m}");
    // What Auto picks for the same bytes is named, with whether the best trial agrees (no GPU
    // here: host reads, no verdict; on a GPU a boolean).
    let auto = m["auto"].as_str().expect("auto");
    assert!(["Staged", "Direct"].contains(&auto), "{m}");
    assert!(!m["verdict"].as_str().expect("verdict").is_empty());
    if trials.iter().any(|t| !t["strategy"].is_null()) {
        assert!(m["agrees"].is_boolean(), "{m}");
    } else {
        assert!(m["agrees"].is_null(), "{m}");
    }
}

#[test]
fn shm_gc_removes_a_dead_process_segment() {
    // A pid that existed and exited.
    let mut child = std::process::Command::new("true").spawn().expect("spawn");
    let pid = child.id();
    child.wait().expect("reap");
    let prefix = format!("gpufeedcli{}", std::process::id());
    let ns = gpufeed::os::process::current_pid_ns();
    let name = format!("{prefix}-{pid}-1-{ns}-00ab");
    // A name without a namespace (an older gpufeed, or unknown): never judged by its pid.
    let foreign = format!("{prefix}-{pid}-1-00cd");
    let dev_shm = std::path::Path::new("/dev/shm");
    for n in [&name, &foreign] {
        std::fs::write(dev_shm.join(n), [0u8; 4096]).expect("segment");
    }
    let (v, _) = json_of(gpufeed().args(["shm", "ls", "--prefix", &prefix]));
    let owner = |n: &str| {
        v.as_array()
            .expect("rows")
            .iter()
            .find(|r| r["name"] == n)
            .map(|r| r["owner"].clone())
    };
    assert_eq!(owner(&name), Some("DEAD".into()), "{v}");
    assert_eq!(owner(&foreign), Some("other-ns".into()), "{v}");
    let (v, code) = json_of(gpufeed().args(["shm", "gc", "--prefix", &prefix]));
    assert_eq!(code, 0);
    assert_eq!(v["removed"], serde_json::json!([name]), "{v}");
    assert_eq!(v["other_namespace"], serde_json::json!([foreign]), "{v}");
    assert!(!dev_shm.join(&name).exists());
    assert!(dev_shm.join(&foreign).exists());
    let (v, _) = json_of(gpufeed().args(["shm", "gc", "--other-namespaces", "--prefix", &prefix]));
    assert_eq!(v["removed"], serde_json::json!([foreign]), "{v}");
    assert!(!dev_shm.join(&foreign).exists());
}

#[test]
fn lock_holds_files_for_the_time_asked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("f.bin");
    std::fs::write(&path, [3u8; 64 * 1024]).expect("write");
    let (v, code) = json_of(gpufeed().args(["lock", "--seconds", "0"]).arg(&path));
    assert_eq!(code, 0);
    assert_eq!(v["locked_bytes"], 64 * 1024);
}

/// A FIFO named where a file is expected: every command that opens files refuses it at once
/// (before, `warm`, `evict`, `residency`, `lock` and `advise --path` waited forever for a
/// writer).
#[test]
fn a_fifo_is_refused_at_once_by_every_command() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let fifo = dir.path().join("fifo");
    gpufeed_testkit::mkfifo(&fifo);
    let commands: [&[&str]; 5] = [
        &["warm"],
        &["evict"],
        &["residency"],
        &["lock", "--seconds", "0"],
        &["advise", "--path"],
    ];
    for args in commands {
        let out = gpufeed()
            .args(args)
            .arg(&fifo)
            .timeout(std::time::Duration::from_secs(20))
            .output()
            .expect("run");
        assert_eq!(
            out.status.code(),
            Some(3),
            "{args:?} did not fail (or hung)"
        );
        let err = one_line_error(&out);
        assert!(err.contains("not a regular file"), "{args:?}: {err}");
    }
}

/// `residency` for a user who may not write the file: the kernel shows such users no
/// page-cache state (mincore reports every page resident, cachestat answers EPERM), so the
/// answer is "unknown" with the reason, or a figure that agrees with root's. Before, a file
/// with 0% cached showed as 100.0% (also right after `evict`).
#[test]
fn residency_for_a_user_who_cannot_write_the_file_is_unknown_or_right() {
    if !gpufeed_testkit::is_root() {
        eprintln!(
            "SKIP residency_for_a_user_who_cannot_write_the_file: needs root to run as nobody"
        );
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = dir.path().join("data.bin");
    std::fs::write(&path, gpufeed_testkit::random_bytes(8 << 20, 9)).expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let as_nobody = |cmd: &str| -> Value {
        let out = std::process::Command::new(assert_cmd::cargo::cargo_bin("gpufeed"))
            .uid(65534)
            .gid(65534)
            .args([cmd, "--json"])
            .arg(&path)
            .output()
            .expect("run as nobody");
        assert!(
            out.status.success(),
            "{cmd} as nobody: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).expect("JSON")["files"][0].clone()
    };
    let check = |row: &Value, truth: f64, when: &str| match row["fraction"].as_f64() {
        None => assert!(
            row["unknown"].as_str().is_some_and(|r| !r.is_empty()),
            "{when}: neither a figure nor a reason: {row}"
        ),
        Some(f) => assert!(
            (f - truth).abs() < 0.05,
            "{when}: nobody sees {f}, root {truth}: {row}"
        ),
    };
    let (root, _) = json_of(gpufeed().arg("evict").arg(&path));
    let truth = root["files"][0]["fraction"]
        .as_f64()
        .expect("root measures");
    assert!(truth < 0.05, "evict as root left {truth}");
    check(&as_nobody("residency"), truth, "after evict");
    let (root, _) = json_of(gpufeed().arg("warm").arg(&path));
    let truth = root["files"][0]["fraction"]
        .as_f64()
        .expect("root measures");
    check(&as_nobody("residency"), truth, "after warm");
    check(&as_nobody("evict"), 0.0, "evict as nobody");
}

/// `lock` of a file larger than the machine's memory, as root (no memlock limit applies):
/// a clear error, not an OOM kill (before: exit 137 with no output).
#[test]
fn lock_refuses_more_than_the_machine_can_spare() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("sparse.bin");
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(1 << 40))
        .expect("a sparse 1 TiB file");
    let out = gpufeed()
        .args(["lock", "--seconds", "0"])
        .arg(&path)
        .timeout(std::time::Duration::from_secs(60))
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let err = one_line_error(&out);
    assert!(err.contains("too little memory"), "{err}");
}
