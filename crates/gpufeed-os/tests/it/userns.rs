//! `shm::list` and `shm::gc` where uids cannot be told apart (an unmapped user namespace) and
//! where a dead owner's segment cannot be removed.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;

use gpufeed_os::process::ProcessIdentity;
use gpufeed_os::shm;

use crate::{child, unique_prefix};

/// A segment file `<dir>/<prefix>-<tag of a dead owner>` (mode 0600) owned by `uid`.
fn dead_owners_segment(dir: &Path, prefix: &str, uid: u32) -> std::path::PathBuf {
    // A pid above any pid_max (2^22) in our namespace: known dead.
    let dead = ProcessIdentity {
        pid: 1 << 23,
        ..ProcessIdentity::current()
    };
    let path = dir.join(format!("{prefix}-{}", dead.unique_tag().expect("tag")));
    std::fs::write(&path, vec![7u8; 8192]).expect("segment file");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    rustix::fs::chown(
        &path,
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(uid)),
    )
    .expect("chown");
    path
}

/// Removes the files when dropped.
struct Cleanup(Vec<std::path::PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Under `unshare --user` without a uid map our uid reads as the overflow uid, and so does the
/// owner of every file of an unmapped user: `shm::list` claims none of root's or another
/// user's dead-owner segments, and `shm::gc` finishes without error, removing nothing.
#[test]
fn in_an_unmapped_user_namespace_no_segment_is_ours() {
    const TEST: &str = "userns::in_an_unmapped_user_namespace_no_segment_is_ours";
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(
            TEST,
            &"needs root to make segments of root and of another user",
        );
        return;
    }
    let prefix = unique_prefix("un");
    let dir = Path::new(shm::DEFAULT_DIR);
    let files = Cleanup(vec![
        dead_owners_segment(dir, &prefix, 0),
        dead_owners_segment(dir, &prefix, 12345),
    ]);
    let inner = child::command("userns-list-gc", &[("GPUFEED_IT_PREFIX", prefix.clone())]);
    let mut cmd = gpufeed_testkit::wrapped(&["unshare", "--user", "--"], &inner);
    cmd.stdin(Stdio::null());
    let out = match cmd.output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            gpufeed_testkit::skip(TEST, &"no `unshare` program (util-linux)");
            return;
        }
        Err(e) => panic!("{TEST}: spawn unshare: {e}"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("unshare failed") {
        // user.max_user_namespaces = 0, or a seccomp filter: the kernel refuses.
        gpufeed_testkit::skip(
            TEST,
            &format_args!("the kernel refused a user namespace: {}", stderr.trim()),
        );
        return;
    }
    assert!(
        out.status.success() && stdout.contains("USERNS-OK"),
        "{TEST}: the child failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    for f in &files.0 {
        assert!(
            f.exists(),
            "{} removed from inside the namespace",
            f.display()
        );
    }
}

/// Child role `userns-list-gc`: in an unmapped user namespace, lists and gcs GPUFEED_IT_PREFIX.
pub fn list_and_gc_unmapped() {
    let prefix = std::env::var("GPUFEED_IT_PREFIX").expect("prefix");
    let euid = rustix::process::geteuid().as_raw();
    let overflow: u32 = std::fs::read_to_string("/proc/sys/kernel/overflowuid")
        .expect("overflowuid")
        .trim()
        .parse()
        .expect("a number");
    assert_eq!(
        euid, overflow,
        "our uid is mapped here: the test does not test"
    );
    let listed = shm::list(&prefix).expect("list");
    assert!(
        listed.is_empty(),
        "other users' segments listed as ours: {listed:?}"
    );
    let report = shm::gc(&prefix).expect("gc finishes");
    assert!(report.removed.is_empty(), "{report:?}");
    println!("USERNS-OK");
}

/// `shm::gc` as `nobody` in a directory nobody may not write, holding two dead owners'
/// segments of nobody's: both are reported as skipped (EACCES) and gc returns `Ok`.
#[test]
fn gc_skips_segments_it_cannot_remove_and_goes_on() {
    const TEST: &str = "userns::gc_skips_segments_it_cannot_remove_and_goes_on";
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(TEST, &"needs root to run a child as nobody");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let prefix = unique_prefix("sk");
    let a = dead_owners_segment(dir.path(), &prefix, 65534);
    let b = dead_owners_segment(dir.path(), &prefix, 65534);
    let mut cmd = child::command(
        "shm-gc-dir",
        &[
            ("GPUFEED_IT_DIR", dir.path().display().to_string()),
            ("GPUFEED_IT_PREFIX", prefix),
        ],
    );
    cmd.uid(65534).gid(65534);
    let out = cmd.output().expect("spawn as nobody");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("SKIPPED=2"),
        "{TEST}: ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(a.exists() && b.exists());
}

/// Child role `shm-gc-dir`: gc of GPUFEED_IT_DIR, which must succeed; prints `SKIPPED=<n>`.
pub fn gc_dir() {
    let dir = std::env::var("GPUFEED_IT_DIR").expect("dir");
    let prefix = std::env::var("GPUFEED_IT_PREFIX").expect("prefix");
    let report = shm::gc_in(Path::new(&dir), &prefix).expect("gc goes on past EACCES");
    assert!(report.removed.is_empty(), "{report:?}");
    for s in &report.skipped {
        assert!(s.reason.contains("denied"), "{s:?}");
    }
    println!("SKIPPED={}", report.skipped.len());
}

/// Under `unshare --user --map-user=65534 --map-group=65534` a job really runs as uid 65534
/// (mapped: `/proc/self/uid_map` covers it), which is also the overflow uid: its own segment
/// is its own (`uid_is_ours`), and `shm::list` lists it.
#[test]
fn as_uid_65534_mapped_in_a_user_namespace_our_own_segments_are_ours() {
    const TEST: &str = "userns::as_uid_65534_mapped_in_a_user_namespace_our_own_segments_are_ours";
    let out = child::run_wrapped(
        TEST,
        &[
            "unshare",
            "--user",
            "--map-user=65534",
            "--map-group=65534",
            "--",
        ],
        "userns-mapped-own",
        &[("GPUFEED_IT_PREFIX", unique_prefix("um"))],
    );
    if let Some(out) = out {
        assert!(out.contains("MAPPED-OK"), "{out}");
    }
}

/// Child role `userns-mapped-own`: as uid 65534, mapped; creates a segment of
/// GPUFEED_IT_PREFIX and finds it listed as ours.
pub fn own_segments_as_mapped_overflow_uid() {
    use std::os::unix::fs::MetadataExt;
    let prefix = std::env::var("GPUFEED_IT_PREFIX").expect("prefix");
    let euid = rustix::process::geteuid().as_raw();
    let overflow: u32 = std::fs::read_to_string("/proc/sys/kernel/overflowuid")
        .expect("overflowuid")
        .trim()
        .parse()
        .expect("a number");
    assert_eq!(
        euid, overflow,
        "not the overflow uid: the test does not test"
    );
    let map = std::fs::read_to_string("/proc/self/uid_map").expect("uid_map");
    assert!(
        map.split_whitespace().next() == Some(&euid.to_string()),
        "our uid is not mapped ({map:?}): the test does not test"
    );
    let seg = shm::ShmOptions::new()
        .prefix(&prefix)
        .create_unique(8192)
        .expect("create");
    let uid = std::fs::metadata(seg.path().expect("named"))
        .expect("stat")
        .uid();
    assert_eq!(uid, euid);
    assert!(
        shm::uid_is_ours(uid),
        "our own segment (uid {uid}, mapped) judged not ours"
    );
    let listed = shm::list(&prefix).expect("list");
    assert_eq!(listed.len(), 1, "our own segment not listed: {listed:?}");
    println!("MAPPED-OK");
}
