//! End to end: the `gpufeed` binary's exit codes, JSON and errors.

use assert_cmd::Command;
use serde_json::Value;

fn gpufeed() -> Command {
    let mut cmd = Command::cargo_bin("gpufeed").expect("the gpufeed binary");
    // Warnings on stderr at the default level, whatever the caller's shell sets.
    cmd.env_remove("GPUFEED_LOG");
    cmd
}

/// The `--json` output of `cmd`, checked for the shape every command shares (docs/cli.md):
/// one object with `"version": 1` and the command's name, no Rust `Ok`/`Err`/`Some` wrappers
/// and no Rust type names in the values.
fn json_of(cmd: &mut Command) -> (Value, i32) {
    let out = cmd.arg("--json").output().expect("run gpufeed");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("JSON: {e}\n{}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(v["version"], 1, "{v}");
    assert!(v["command"].is_string(), "{v}");
    assert_plain(&v, "$");
    (v, out.status.code().expect("exit code"))
}

/// Fails where `v` shows Rust instead of plain JSON: an enum's `{"Ok": ..}` wrapper, a
/// `Strategy::Staged`, a `Some(3)`, a capitalized variant name as a status or strategy.
fn assert_plain(v: &Value, at: &str) {
    match v {
        Value::Object(map) => {
            for (k, x) in map {
                assert!(
                    !["Ok", "Err", "Some", "None"].contains(&k.as_str()),
                    "{at}.{k}: a Rust wrapper in the JSON"
                );
                if ["status", "strategy", "auto", "method", "owner"].contains(&k.as_str())
                    && let Some(word) = x.as_str()
                {
                    assert_eq!(word, word.to_lowercase(), "{at}.{k}: {word} is a Rust name");
                }
                assert_plain(x, &format!("{at}.{k}"));
            }
        }
        Value::Array(items) => {
            for (i, x) in items.iter().enumerate() {
                assert_plain(x, &format!("{at}[{i}]"));
            }
        }
        Value::String(text) => {
            for rust in ["Strategy::", "Some(", "Ok(", "Err("] {
                assert!(!text.contains(rust), "{at}: {text:?} shows Rust");
            }
        }
        _ => {}
    }
}

/// A file holding `bytes` with permissions `mode`, in a directory anyone may enter, for
/// `gpufeed` run as nobody; `None` after a printed skip where this test is not root.
fn file_for_nobody(
    test: &str,
    bytes: &[u8],
    mode: u32,
) -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    use std::os::unix::fs::PermissionsExt;
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(test, &"needs root to run gpufeed as nobody");
        return None;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = dir.path().join("data.bin");
    std::fs::write(&path, bytes).expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    Some((dir, path))
}

/// The `gpufeed` binary, to run as the user nobody (uid and gid 65534).
fn gpufeed_as_nobody() -> std::process::Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("gpufeed"));
    cmd.uid(65534).gid(65534);
    cmd
}

/// The exit code and stderr of a usage error.
fn usage_error(args: &[&str]) -> (i32, String) {
    let out = gpufeed().args(args).output().expect("run");
    (
        out.status.code().expect("exit code"),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
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
    let checks = v["checks"].as_array().expect("a list of checks");
    assert!(checks.len() >= 10, "{v}");
    for c in checks {
        assert!(c["name"].is_string() && c["observed"].is_string(), "{c}");
        assert!(
            ["ok", "warn", "fail"].contains(&c["status"].as_str().expect("status")),
            "{c}"
        );
        if c["status"] != "ok" {
            assert!(
                c["fix"].is_string(),
                "a check that is not OK says how to fix it: {c}"
            );
        }
    }
    let failed = checks.iter().any(|c| c["status"] == "fail");
    assert_eq!(v["failed"], failed, "{v}");
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
    // With a GPU, whether NCCL loads (the GPU machines have it).
    let gpu = checks
        .iter()
        .any(|c| c["name"] == "CUDA driver" && c["status"] == "ok")
        && checks.iter().any(|c| c["name"] == "GPU 0");
    let nccl = checks.iter().find(|c| c["name"] == "NCCL");
    assert_eq!(nccl.is_some(), gpu, "an NCCL check exactly with a GPU: {v}");
    if gpu && gpufeed_testkit::gpu_required() {
        let observed = nccl
            .and_then(|c| c["observed"].as_str())
            .unwrap_or_default();
        assert!(
            observed.contains("libnccl"),
            "NCCL on a GPU machine: {observed}"
        );
    }
    // With a GPU, whether nvJPEG loads, never a failure (the GPU machine has libnvjpeg).
    let nvjpeg = checks.iter().find(|c| c["name"] == "nvJPEG");
    assert_eq!(
        nvjpeg.is_some(),
        gpu,
        "an nvJPEG check exactly with a GPU: {v}"
    );
    if let Some(c) = nvjpeg {
        assert_eq!(c["status"], "ok", "{c}");
        if gpufeed_testkit::gpu_required() {
            let observed = c["observed"].as_str().unwrap_or_default();
            assert!(
                observed.contains("libnvjpeg"),
                "nvJPEG on the GPU machine: {observed}"
            );
        }
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
    let load_dir = gpufeed().arg("load").arg(dir.path()).output().expect("run");
    assert!(
        one_line_error(&load_dir).contains("directory"),
        "the file is checked before the GPU"
    );
}

/// Bad usage exits with 2 (clap's usage errors), whatever part of the command line is wrong;
/// the message says what would be right.
#[test]
fn bad_usage_exits_2_and_says_what_is_right() {
    let cases: [(&[&str], &str); 15] = [
        (&["advise"], "--size"),
        (&["advise", "--size", "1parsec"], "1.5GiB"),
        (&["advise", "--size", "0"], "at least 1 byte"),
        (&["advise", "--size", "18446744073709551615"], "1 EiB"),
        (&["advise", "--size", "1GiB", "--processes", "0"], "1..="),
        (&["advise", "--size", "1GiB", "--measure"], "--path"),
        (
            &["load", "/etc/hostname", "--strategy", "warp"],
            "registered, staged",
        ),
        (&["load", "/etc/hostname", "--replicate"], "--gpus"),
        (
            &["load", "/etc/hostname", "--gpu", "1", "--gpus", "0,1"],
            "--gpus",
        ),
        (&["load", "/etc/hostname", "--gpus", "0,1,0"], "GPU 0 twice"),
        (&["load", "m.safetensors", "--gpus", "0,1"], "--replicate"),
        (&["warm"], "PATHS"),
        (&["evict"], "PATHS"),
        (&["lock", "--seconds", "1"], "PATHS"),
        (&["frobnicate"], "subcommand"),
    ];
    for (args, says) in cases {
        let (code, err) = usage_error(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?} should mention {says}: {err}");
    }
    // Sizes as people write them.
    let (v, code) = json_of(gpufeed().args(["advise", "--size", "1.5GiB"]));
    assert_eq!(code, 0);
    assert_eq!(v["workload"]["size_bytes"], 3u64 << 29, "{v}");
}

/// An error and its causes on one line, each said once (before: "open f: Permission denied
/// (os error 13): Permission denied (os error 13)").
#[test]
fn an_error_says_each_thing_once() {
    let Some((_dir, path)) = file_for_nobody("an_error_says_each_thing_once", &[7u8; 8192], 0o600)
    else {
        return;
    };
    for cmd in ["residency", "warm", "lock"] {
        let out = gpufeed_as_nobody()
            .arg(cmd)
            .arg(&path)
            .output()
            .expect("run as nobody");
        assert_eq!(out.status.code(), Some(3), "{cmd}: {out:?}");
        let err = one_line_error(&out);
        assert_eq!(err.matches("ermission denied").count(), 1, "{cmd}: {err}");
        assert_eq!(
            err.matches(&*path.to_string_lossy()).count(),
            1,
            "{cmd} names the file once: {err}"
        );
    }
}

#[test]
fn load_without_a_gpu_says_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("f.bin");
    std::fs::write(&path, [1u8; 100]).expect("write");
    // --gpus before the path too: it takes one list, not the path as another value.
    for gpus in [&[][..], &["--gpus", "0,1"], &["--gpus", "0", "--replicate"]] {
        let out = gpufeed()
            .arg("load")
            .args(gpus)
            .arg(&path)
            .output()
            .expect("run");
        if out.status.success() {
            eprintln!("a GPU is present: the no-GPU path is not exercised");
            return;
        }
        assert_eq!(out.status.code(), Some(3), "{gpus:?}: {out:?}");
        assert!(one_line_error(&out).contains("NVIDIA driver"), "{gpus:?}");
    }
}

/// `load --gpus`: a file cut into one share per GPU, or replicated onto each, every GPU's
/// bytes checked against the file (on one GPU: the N=1 path).
#[test]
fn load_onto_several_gpus_shares_or_replicates_the_file() {
    let Some(_gpu) = gpufeed_testkit::opened_or_skip(
        "load_onto_several_gpus_shares_or_replicates_the_file",
        gpufeed::Gpu::open(0),
    ) else {
        return;
    };
    let n = gpufeed::Gpu::count().expect("count").min(4);
    let gpus: Vec<String> = (0..n).map(|g| g.to_string()).collect();
    let gpus = gpus.join(",");
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("f.bin");
    let len = (5 << 20) + 4099;
    std::fs::write(&path, gpufeed_testkit::random_bytes(len, 77)).expect("write");
    let (v, code) = json_of(
        gpufeed()
            .args(["load", "--verify", "--gpus", &gpus])
            .arg(&path),
    );
    assert_eq!(code, 0, "{v}");
    assert_eq!(
        (v["mode"].as_str(), v["verified"].as_bool()),
        (Some("sharded"), Some(true)),
        "{v}"
    );
    let each = v["per_gpu"].as_array().expect("per_gpu");
    assert_eq!(each.len(), n, "{v}");
    // The shares cover the file once, in order.
    let mut at = 0;
    for g in each {
        assert_eq!(g["verified"], true, "{v}");
        for r in g["ranges"].as_array().expect("ranges") {
            assert_eq!(r[0], at, "{v}");
            at = r[1].as_u64().expect("end");
        }
    }
    assert_eq!(at, len as u64, "{v}");
    let (v, code) = json_of(
        gpufeed()
            .args(["load", "--verify", "--replicate", "--gpus", &gpus])
            .arg(&path),
    );
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["mode"], "replicated", "{v}");
    for g in v["per_gpu"].as_array().expect("per_gpu") {
        assert_eq!(g["verified"], true, "{v}");
        let got = g["read_bytes"].as_u64().expect("read") + g["peer_bytes"].as_u64().expect("peer");
        assert_eq!(got, len as u64, "{v}");
    }
    assert_eq!(v["verified"], true, "{v}");
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
    assert!(["staged", "direct"].contains(&auto), "{m}");
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
        v["segments"]
            .as_array()
            .expect("rows")
            .iter()
            .find(|r| r["name"] == n)
            .map(|r| r["owner"].clone())
    };
    assert_eq!(owner(&name), Some("dead".into()), "{v}");
    assert_eq!(owner(&foreign), Some("other-ns".into()), "{v}");
    let (v, code) = json_of(gpufeed().args(["shm", "gc", "--prefix", &prefix]));
    assert_eq!(code, 0);
    assert_eq!(v["removed"], serde_json::json!([name]), "{v}");
    assert!(v["removed_sockets"].is_array(), "{v}");
    assert_eq!(v["other_namespace"], serde_json::json!([foreign]), "{v}");
    assert!(!dev_shm.join(&name).exists());
    assert!(dev_shm.join(&foreign).exists());
    let (v, _) = json_of(gpufeed().args(["shm", "gc", "--other-namespaces", "--prefix", &prefix]));
    assert_eq!(v["removed"], serde_json::json!([foreign]), "{v}");
    assert!(!dev_shm.join(&foreign).exists());
}

/// Whether a line of gpufeed's log begins with the seconds since the log began
/// ("   0.001234567s ...", `GPUFEED_LOG=debug`).
fn timed_line(line: &str) -> bool {
    line.trim_start()
        .split_once("s ")
        .and_then(|(t, _)| t.split_once('.'))
        .is_some_and(|(s, ns)| {
            s.bytes().all(|b| b.is_ascii_digit())
                && ns.len() == 9
                && ns.bytes().all(|b| b.is_ascii_digit())
        })
}

/// A dead owner's segment that cannot be removed (immutable: EPERM even for root) is reported
/// under `skipped` with the kernel's reason, gc goes on with the others and exits 0 (before,
/// gc stopped at the first EPERM with an error).
#[test]
fn shm_gc_reports_what_it_cannot_remove_and_goes_on() {
    const TEST: &str = "shm_gc_reports_what_it_cannot_remove_and_goes_on";
    let mut child = std::process::Command::new("true").spawn().expect("spawn");
    let pid = child.id();
    child.wait().expect("reap");
    let prefix = format!("gpufeedclisk{}", std::process::id());
    let ns = gpufeed::os::process::current_pid_ns();
    let dev_shm = std::path::Path::new("/dev/shm");
    let (stuck, gone) = (
        format!("{prefix}-{pid}-1-{ns}-00aa"),
        format!("{prefix}-{pid}-1-{ns}-00bb"),
    );
    for n in [&stuck, &gone] {
        std::fs::write(dev_shm.join(n), [0u8; 4096]).expect("segment");
    }
    let chattr = |flag: &str| {
        std::process::Command::new("chattr")
            .arg(flag)
            .arg(dev_shm.join(&stuck))
            .output()
    };
    match chattr("+i") {
        Ok(o) if o.status.success() => {}
        refused => {
            let _ = std::fs::remove_file(dev_shm.join(&stuck));
            let _ = std::fs::remove_file(dev_shm.join(&gone));
            let why = match refused {
                Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_owned(),
                Err(e) => format!("chattr: {e}"),
            };
            return gpufeed_testkit::skip_unless_root(
                TEST,
                &format!("chattr +i on /dev/shm: {why}"),
            );
        }
    }
    let (v, code) = json_of(gpufeed().args(["shm", "gc", "--prefix", &prefix]));
    let text = gpufeed()
        .args(["shm", "gc", "--prefix", &prefix])
        .output()
        .expect("run");
    let quiet = gpufeed()
        .args(["shm", "gc", "--prefix", &prefix])
        .env("GPUFEED_LOG", "off")
        .output()
        .expect("run");
    let timed = gpufeed()
        .args(["shm", "gc", "--prefix", &prefix])
        .env("GPUFEED_LOG", "debug")
        .output()
        .expect("run");
    let _ = chattr("-i");
    let _ = std::fs::remove_file(dev_shm.join(&stuck));
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["removed"], serde_json::json!([gone]), "{v}");
    let skipped = v["skipped"].as_array().expect("skipped");
    assert_eq!(skipped.len(), 1, "{v}");
    assert_eq!(skipped[0]["name"], stuck.as_str(), "{v}");
    assert!(
        !skipped[0]["reason"].as_str().unwrap_or("").is_empty(),
        "{v}"
    );
    // The library's warning reaches stderr (gpufeed::log_to_stderr); GPUFEED_LOG=off silences
    // it.
    let warned = "gc could not remove a dead owner's segment";
    let stderr = String::from_utf8_lossy(&text.stderr);
    assert!(
        stderr.contains(warned) && stderr.contains(&stuck),
        "{stderr}"
    );
    assert!(
        !String::from_utf8_lossy(&quiet.stderr).contains(warned),
        "GPUFEED_LOG=off: {}",
        String::from_utf8_lossy(&quiet.stderr)
    );
    // At debug each event begins with the seconds since the log began, and at warn with none.
    let timed = String::from_utf8_lossy(&timed.stderr);
    let line = timed.lines().find(|l| l.contains(warned)).unwrap_or("");
    assert!(timed_line(line), "GPUFEED_LOG=debug: {timed}");
    let line = stderr.lines().find(|l| l.contains(warned)).unwrap_or("");
    assert!(!timed_line(line), "GPUFEED_LOG unset: {stderr}");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("could not remove 1 segment(s) or socket(s)") && text.contains(&stuck),
        "{text}"
    );
}

/// Child processes of these tests: this binary re-run with `GPUFEED_IT_CHILD` set runs only
/// this test (`gpufeed_testkit::child_command`); without the variable it returns at once.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(gpufeed_testkit::CHILD_ROLE) else {
        return;
    };
    match role.as_str() {
        // Rank 0 of a rendezvous of 2, waiting up to a minute for a rank 1 that never comes.
        "rendezvous-rank0" => {
            let name = std::env::var("GPUFEED_IT_RDV").expect("GPUFEED_IT_RDV");
            let opts = gpufeed::ipc::RendezvousOptions::default()
                .with_join_timeout(std::time::Duration::from_secs(60));
            let _ = gpufeed::ipc::Rendezvous::join(&name, 0, 2, opts);
        }
        other => panic!("unknown role {other}"),
    }
}

/// Waits up to 20 s for `done`.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !done() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "never: {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A job whose rank 0 was SIGKILLed while it waited for the others leaves its rendezvous
/// segment: `shm ls` lists it (rank 0's pid, its ranks dead) beside a live job's, and `shm gc`
/// removes it and keeps the live one, until that one's rank 0 dies too. (Before, rendezvous
/// segments were invisible to both and never removed.)
#[test]
fn shm_gc_removes_a_crashed_jobs_rendezvous_and_keeps_a_live_one() {
    let prefix = format!("gpufeedclirdv{}", std::process::id());
    let dev_shm = std::path::Path::new("/dev/shm");
    let (crashed, live) = (format!("{prefix}-crashed"), format!("{prefix}-live"));
    let rank0 = |name: &str| {
        gpufeed_testkit::child_command(
            "child_entry",
            "rendezvous-rank0",
            &[("GPUFEED_IT_RDV", name.to_owned())],
        )
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn a rank 0")
    };
    let ls = || json_of(gpufeed().args(["shm", "ls", "--prefix", &prefix])).0;
    let row = |v: &Value, name: &str| {
        v["rendezvous"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["name"] == name).cloned())
    };
    let joined = |v: &Value, name: &str| row(v, name).is_some_and(|r| r["joined"] == 1);
    let mut dead = rank0(&crashed);
    let dead_pid = dead.id();
    wait_until("the crashed job's rank 0 is listed", || {
        joined(&ls(), &crashed)
    });
    dead.kill().expect("SIGKILL");
    dead.wait().expect("reap");
    let mut alive = rank0(&live);
    wait_until("the live job's rank 0 is listed", || joined(&ls(), &live));
    let v = ls();
    let (c, l) = (
        row(&v, &crashed).expect("listed"),
        row(&v, &live).expect("listed"),
    );
    assert_eq!(
        (&c["ranks"], &c["rank0_pid"], &c["world"]),
        (&"dead".into(), &dead_pid.into(), &2.into()),
        "{v}"
    );
    assert_eq!(
        (&l["ranks"], &l["rank0_pid"], &l["world"]),
        (&"live".into(), &alive.id().into(), &2.into()),
        "{v}"
    );
    let (v, code) = json_of(gpufeed().args(["shm", "gc", "--prefix", &prefix]));
    assert_eq!(code, 0);
    assert_eq!(
        v["rendezvous"]["removed"],
        serde_json::json!([crashed]),
        "{v}"
    );
    assert_eq!(v["rendezvous"]["kept"], serde_json::json!([live]), "{v}");
    assert!(!dev_shm.join(&crashed).exists() && dev_shm.join(&live).exists());
    alive.kill().expect("SIGKILL");
    alive.wait().expect("reap");
    let (v, _) = json_of(gpufeed().args(["shm", "gc", "--prefix", &prefix]));
    assert_eq!(v["rendezvous"]["removed"], serde_json::json!([live]), "{v}");
    assert!(!dev_shm.join(&live).exists());
}

#[test]
fn lock_holds_files_for_the_time_asked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("f.bin");
    std::fs::write(&path, [3u8; 64 * 1024]).expect("write");
    let (v, code) = json_of(gpufeed().args(["lock", "--seconds", "0"]).arg(&path));
    assert_eq!(code, 0);
    assert_eq!(v["locked_bytes"], 64 * 1024);
    let out = gpufeed()
        .args(["lock", "--seconds", "0"])
        .arg(&path)
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("released after 0 s") && !text.contains("Ctrl-C releases"),
        "with --seconds the time releases them: {text}"
    );
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
    let Some((_dir, path)) = file_for_nobody(
        "residency_for_a_user_who_cannot_write_the_file",
        &gpufeed_testkit::random_bytes(8 << 20, 9),
        0o644,
    ) else {
        return;
    };
    let as_nobody = |cmd: &str| -> Value {
        let out = gpufeed_as_nobody()
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

/// A safetensors checkpoint (a file, or an index of shards) that `load` reads as tensors: a
/// bad header is named before any GPU is opened; on a GPU, `--verify` checks every tensor.
#[test]
fn load_reads_a_checkpoint_as_tensors() {
    use safetensors::{Dtype, tensor::TensorView};
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let bad = dir.path().join("bad.safetensors");
    std::fs::write(&bad, [0xffu8; 64]).expect("write");
    let out = gpufeed().arg("load").arg(&bad).output().expect("run");
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(
        one_line_error(&out).contains("not a valid safetensors file"),
        "the header is checked first, GPU or not"
    );
    // Unaligned sizes, random bytes, two shards and an index.
    let tensors = [
        ("a.weight", Dtype::F32, vec![3usize, 1001]),
        ("b.bias", Dtype::BF16, vec![777]),
        ("c.table", Dtype::U8, vec![65_537]),
    ];
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .enumerate()
        .map(|(i, (_, d, shape))| {
            let elems: usize = shape.iter().product();
            gpufeed_testkit::random_bytes(elems * d.bitsize() / 8, 40 + i as u64)
        })
        .collect();
    let write = |file: &str, which: &[usize]| {
        let views = which.iter().map(|&i| {
            let (name, dtype, shape) = &tensors[i];
            let view = TensorView::new(*dtype, shape.clone(), &data[i]).expect("view");
            (name.to_string(), view)
        });
        safetensors::serialize_to_file(views, None, &dir.path().join(file)).expect("serialize");
    };
    write("m-1.safetensors", &[0, 1]);
    write("m-2.safetensors", &[2]);
    let index = dir.path().join("m.safetensors.index.json");
    let map = serde_json::json!({ "weight_map": {
        "a.weight": "m-1.safetensors", "b.bias": "m-1.safetensors", "c.table": "m-2.safetensors",
    }});
    std::fs::write(&index, map.to_string()).expect("index");
    let Some(_gpu) = gpufeed_testkit::opened_or_skip(
        "load_reads_a_checkpoint_as_tensors (on a GPU)",
        gpufeed::Gpu::open(0),
    ) else {
        return;
    };
    let (v, code) = json_of(gpufeed().args(["load", "--verify"]).arg(&index));
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["kind"], "safetensors", "{v}");
    assert_eq!(v["tensors"], 3, "{v}");
    assert_eq!(v["verified"], true, "{v}");
    assert_eq!(v["mismatched_tensors"], serde_json::json!([]), "{v}");
    let total: usize = data.iter().map(Vec::len).sum();
    assert_eq!(v["bytes"], total, "{v}");
    assert_eq!(v["files"].as_array().map(Vec::len), Some(2), "{v}");
    assert_eq!(v["dtypes"]["BF16"]["tensors"], 1, "{v}");
    assert_eq!(v["dtypes"]["F32"]["bytes"], 3 * 1001 * 4, "{v}");
    // --raw: the file's bytes as they are, header included.
    let one = dir.path().join("m-1.safetensors");
    let (v, code) = json_of(gpufeed().args(["load", "--raw", "--verify"]).arg(&one));
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["kind"], "file", "{v}");
    assert_eq!(
        v["bytes"],
        std::fs::metadata(&one).expect("stat").len(),
        "{v}"
    );
    assert_eq!(v["verified"], true, "{v}");
    // The checkpoint on every GPU (--replicate), every tensor checked on each.
    let n = gpufeed::Gpu::count().expect("count").min(4);
    let gpus: Vec<String> = (0..n).map(|g| g.to_string()).collect();
    let (v, code) = json_of(
        gpufeed()
            .args(["load", "--verify", "--replicate", "--gpus", &gpus.join(",")])
            .arg(&index),
    );
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["kind"], "safetensors", "{v}");
    assert_eq!(v["per_gpu"].as_array().map(Vec::len), Some(n), "{v}");
    assert_eq!(v["verified"], true, "{v}");
}

/// `load s3://...` against a real S3 server: a missing object is a one-line error before any
/// GPU is touched; on a GPU the object loads and verifies.
#[test]
fn load_reads_an_object_from_s3() {
    use gpufeed_testkit::s3;
    let test = "load_reads_an_object_from_s3";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let data = gpufeed_testkit::random_bytes((3 << 20) + 17, gpufeed_testkit::seed(test));
    server.put("cli/obj.bin", &data).expect("put");
    let with_env = |cmd: &mut Command| {
        for var in [
            "AWS_PROFILE",
            "AWS_SESSION_TOKEN",
            "AWS_ENDPOINT_URL_S3",
            "AWS_ENDPOINT",
            "AWS_DEFAULT_REGION",
        ] {
            cmd.env_remove(var);
        }
        cmd.env("AWS_ACCESS_KEY_ID", s3::ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", s3::SECRET_KEY)
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ENDPOINT_URL", &server.endpoint);
    };
    let mut missing = gpufeed();
    with_env(&mut missing);
    let out = missing
        .args(["load", &format!("s3://{}/cli/none.bin", s3::BUCKET)])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let line = one_line_error(&out);
    assert!(
        line.contains("not found") && line.contains("none.bin"),
        "{line}"
    );
    // A checkpoint object's header is checked before any GPU is touched.
    server
        .put("cli/bad.safetensors", &[0xffu8; 64])
        .expect("put");
    let mut header = gpufeed();
    with_env(&mut header);
    let out = header
        .args(["load", &format!("s3://{}/cli/bad.safetensors", s3::BUCKET)])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(one_line_error(&out).contains("not a valid safetensors file"));
    // No credentials anywhere: said so (where the metadata service gives none), not a request
    // error about 169.254.169.254.
    let home = tempfile::tempdir().expect("tempdir");
    let mut none = gpufeed();
    with_env(&mut none);
    let out = none
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env("HOME", home.path())
        .args(["load", &format!("s3://{}/cli/obj.bin", s3::BUCKET)])
        .output()
        .expect("run");
    let line = one_line_error(&out);
    assert!(
        line.contains("no credentials found") || line.contains("access denied"),
        "{line}"
    );
    // GPUFEED_LOG=debug: the object's open on the timeline (seconds since the log began, the
    // open's own ms), and nothing of the HTTP client's debug events (other crates stay at
    // warn). With or without a GPU: the object is opened first.
    let mut debug = gpufeed();
    with_env(&mut debug);
    let out = debug
        .env("GPUFEED_LOG", "debug")
        .args(["load", &format!("s3://{}/cli/obj.bin", s3::BUCKET)])
        .output()
        .expect("run");
    let log = String::from_utf8_lossy(&out.stderr);
    let opened = log
        .lines()
        .find(|l| l.contains("object opened"))
        .unwrap_or("");
    assert!(
        timed_line(opened) && opened.contains("gpufeed_object") && opened.contains(" ms="),
        "{log}"
    );
    assert!(
        !log.lines()
            .any(|l| l.contains("DEBUG") && !l.contains(" gpufeed")),
        "debug events of crates under gpufeed: {log}"
    );
    let mut bad = gpufeed();
    with_env(&mut bad);
    let out = bad
        .args([
            "load",
            "--gpus",
            "0,1",
            &format!("s3://{}/cli/obj.bin", s3::BUCKET),
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let Some(_gpu) =
        gpufeed_testkit::opened_or_skip(&format!("{test} (on a GPU)"), gpufeed::Gpu::open(0))
    else {
        return;
    };
    let mut load = gpufeed();
    with_env(&mut load);
    let (v, code) = json_of(load.args([
        "load",
        "--verify",
        &format!("s3://{}/cli/obj.bin", s3::BUCKET),
    ]));
    assert_eq!(code, 0, "{v}");
    assert_eq!(
        (v["kind"].as_str(), v["bytes"].as_u64()),
        (Some("object"), Some(data.len() as u64))
    );
    assert_eq!(v["verified"], true, "{v}");
}
