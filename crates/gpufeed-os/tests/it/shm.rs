use std::io::{BufRead, BufReader};
use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;
use std::process::Stdio;

use gpufeed_os::process::Liveness;
use gpufeed_os::shm::{self, ShmOptions, ShmSegment};
use gpufeed_os::{Error, page_size};
use xxhash_rust::xxh3::xxh3_64;

use crate::{child, random_bytes, seed, unique_prefix};

fn read_all(seg: &ShmSegment) -> Vec<u8> {
    let mut buf = vec![0u8; seg.len()];
    seg.read_at(0, &mut buf).expect("read");
    buf
}

#[test]
fn child_writes_named_segment_and_parent_sees_every_byte() {
    let seed = seed("child_writes_named_segment");
    let seg = ShmOptions::new()
        .prefix(unique_prefix("w"))
        .create_unique(5 * 1024 * 1024 + 123)
        .expect("create");
    assert_eq!(
        seg.len(),
        (5 * 1024 * 1024 + 123usize).next_multiple_of(page_size())
    );
    let name = seg.name().expect("named").to_owned();
    child::run(
        "shm-write",
        &[
            ("GPUFEED_IT_NAME", name),
            ("GPUFEED_IT_SEED", seed.to_string()),
        ],
    );
    let expected = random_bytes(seg.len(), seed);
    let got = read_all(&seg);
    assert_eq!(xxh3_64(&got), xxh3_64(&expected));
    assert!(got == expected, "bytes differ");
}

#[test]
fn memfd_inherited_by_child_is_shared() {
    let seed = seed("memfd_inherited_by_child");
    let seg = ShmSegment::anonymous(3 * 1024 * 1024 + 7).expect("memfd");
    assert!(seg.name().is_none());
    // dup() yields a descriptor without FD_CLOEXEC, which the child inherits.
    let inheritable = rustix::io::dup(seg.as_fd()).expect("dup");
    child::run(
        "memfd-write",
        &[
            ("GPUFEED_IT_FD", inheritable.as_raw_fd().to_string()),
            ("GPUFEED_IT_SEED", seed.to_string()),
        ],
    );
    drop(inheritable);
    let expected = random_bytes(seg.len(), seed);
    assert!(
        read_all(&seg) == expected,
        "bytes written by the child differ"
    );
}

#[test]
fn unsealed_memfd_is_refused() {
    let fd = rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
    rustix::fs::ftruncate(&fd, 4096).expect("size");
    let err = ShmSegment::from_fd(fd).unwrap_err();
    assert!(matches!(err, Error::ShmUnsealed), "{err:?}");
    assert!(err.to_string().contains("anonymous"), "{err}");
}

#[test]
fn create_refuses_an_existing_name() {
    let seg = ShmOptions::new()
        .prefix(unique_prefix("e"))
        .create_unique(4096)
        .expect("create");
    let name = seg.name().expect("named");
    let err = ShmSegment::create(name, 4096).unwrap_err();
    assert!(
        matches!(&err, Error::ShmExists { name: n } if n == name),
        "{err:?}"
    );
    assert!(err.to_string().contains("ShmSegment::open"), "{err}");
    // The failed create must not have removed the existing segment.
    assert!(seg.path().expect("path").exists());
}

#[test]
fn open_of_a_missing_segment() {
    let err = ShmSegment::open(&unique_prefix("missing")).unwrap_err();
    assert!(matches!(err, Error::ShmNotFound { .. }), "{err:?}");
    assert!(err.to_string().contains("same name"), "{err}");
}

#[test]
fn invalid_names_and_zero_length() {
    for bad in ["", "a/b", "..", &"n".repeat(300)] {
        let err = ShmSegment::create(bad, 4096).unwrap_err();
        assert!(
            matches!(err, Error::InvalidShmName { .. }),
            "{bad:?}: {err:?}"
        );
        assert!(err.to_string().contains("without '/'"), "{err}");
        assert!(matches!(
            ShmSegment::open(bad),
            Err(Error::InvalidShmName { .. })
        ));
    }
    let err = ShmSegment::create(&unique_prefix("z"), 0).unwrap_err();
    assert!(matches!(err, Error::ZeroLength { .. }), "{err:?}");
    assert!(err.to_string().contains("at least one byte"));
    assert!(matches!(
        ShmSegment::anonymous(0),
        Err(Error::ZeroLength { .. })
    ));
}

#[test]
fn lengths_are_whole_pages() {
    let page = page_size();
    let seg = ShmSegment::create(&unique_prefix("len"), 100).expect("create");
    assert_eq!(seg.len(), page);
    assert_eq!(
        seg.path().expect("path").metadata().expect("stat").len(),
        page as u64
    );
    assert_eq!(
        ShmSegment::anonymous(page + 1).expect("memfd").len(),
        2 * page
    );
}

#[test]
fn segments_are_mode_0600_and_groups_or_others_bits_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let seg = ShmSegment::create(&unique_prefix("mode"), 4096).expect("create");
    let path = seg.path().expect("path");
    assert_eq!(
        path.metadata().expect("stat").permissions().mode() & 0o7777,
        0o600
    );
    for mode in [0o644, 0o660, 0o602] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        let err = ShmSegment::open(seg.name().expect("named")).unwrap_err();
        assert!(
            matches!(err, Error::ShmInsecureMode { mode: m, .. } if m == mode),
            "{err:?}"
        );
        assert!(err.to_string().contains("0600"), "{err}");
    }
}

#[test]
fn segment_of_another_user_is_refused() {
    let name = unique_prefix("foreign");
    let path = Path::new(shm::DEFAULT_DIR).join(&name);
    std::fs::write(&path, vec![1u8; 4096]).expect("create file");
    let _cleanup = RemoveFile(&path);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    if let Err(err) = std::os::unix::fs::chown(&path, Some(65534), None) {
        gpufeed_testkit::skip_unless_root(
            "segment_of_another_user_is_refused",
            &format!("chown refused ({err})"),
        );
        return;
    }
    let err = ShmSegment::open(&name).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ShmForeignOwner {
                owner_uid: 65534,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("same user"), "{err}");
}

#[test]
fn segment_smaller_than_expected_is_refused() {
    let seg = ShmSegment::create(&unique_prefix("small"), 1 << 20).expect("create");
    let name = seg.name().expect("named");
    let err = ShmOptions::new().min_len(2 << 20).open(name).unwrap_err();
    assert!(
        matches!(err, Error::ShmTooSmall { len, expected, .. } if len == 1 << 20 && expected == 2 << 20),
        "{err:?}"
    );
    assert!(ShmOptions::new().min_len(1 << 20).open(name).is_ok());

    // An empty file, as left by a creator that died between open and fallocate.
    let empty = unique_prefix("empty");
    let path = Path::new(shm::DEFAULT_DIR).join(&empty);
    std::fs::write(&path, b"").expect("create");
    let _cleanup = RemoveFile(&path);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let err = ShmSegment::open(&empty).unwrap_err();
    assert!(matches!(err, Error::ShmTooSmall { len: 0, .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("creator may still be setting it up")
    );
}

#[test]
fn creator_unlinks_on_drop_unless_told_to_keep() {
    let seg = ShmSegment::create(&unique_prefix("drop"), 4096).expect("create");
    let path = seg.path().expect("path").to_owned();
    let opener = ShmSegment::open(seg.name().expect("named")).expect("open");
    drop(opener);
    assert!(path.exists(), "an opener must not remove the name");
    drop(seg);
    assert!(!path.exists(), "the creator removes the name");

    let kept = ShmOptions::new()
        .unlink_on_drop(false)
        .create(&unique_prefix("keep"), 4096)
        .expect("create");
    let path = kept.path().expect("path").to_owned();
    drop(kept);
    assert!(path.exists(), "a kept segment outlives its handle");
    let mut reopened =
        ShmSegment::open(path.file_name().and_then(|n| n.to_str()).expect("name")).expect("open");
    reopened.unlink().expect("unlink");
    assert!(!path.exists());
    // The mapping stays usable after unlink.
    reopened
        .write_at(0, b"still mapped")
        .expect("write after unlink");
}

#[test]
fn drop_leaves_a_replacement_of_the_same_name_alone() {
    let name = unique_prefix("replaced");
    let first = ShmSegment::create(&name, 4096).expect("create");
    std::fs::remove_file(first.path().expect("path")).expect("remove");
    let second = ShmOptions::new()
        .unlink_on_drop(false)
        .create(&name, 4096)
        .expect("recreate");
    drop(first);
    assert!(
        second.path().expect("path").exists(),
        "first's drop removed second's name"
    );
    let mut second = second;
    second.unlink().expect("cleanup");
}

#[test]
fn accesses_out_of_bounds_are_errors() {
    let seg = ShmSegment::anonymous(4096).expect("memfd");
    assert!(matches!(
        seg.write_at(4090, &[0; 7]),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        seg.read_at(usize::MAX, &mut [0; 2]),
        Err(Error::OutOfBounds { .. })
    ));
    seg.write_at(4089, &[9; 7]).expect("last bytes");
    seg.populate().expect("populate");
    let _serial = crate::mlock_serial();
    let locked = seg.lock().expect("4 KiB fits any memlock limit");
    assert_eq!(locked.len(), 4096);
}

#[test]
fn full_shm_fails_at_create_with_the_fix_in_the_message() {
    let tiny = match gpufeed_testkit::TestMount::tmpfs("1m") {
        Ok(t) => t,
        Err(why) => {
            gpufeed_testkit::skip_unless_root(
                "full_shm_fails_at_create",
                &format!("cannot mount a tmpfs here ({why})"),
            );
            return;
        }
    };
    let options = ShmOptions::new().dir(tiny.path());
    let err = options.create("big", 4 << 20).unwrap_err();
    match &err {
        Error::ShmNoSpace {
            name,
            needed,
            available,
            ..
        } => {
            assert_eq!(name, "big");
            assert_eq!(*needed, 4 << 20);
            assert!(*available <= 1 << 20, "available {available}");
        }
        other => panic!("expected ShmNoSpace, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("--shm-size") && msg.contains("--ipc=host"),
        "{msg}"
    );
    assert_eq!(
        std::fs::read_dir(tiny.path()).expect("list").count(),
        0,
        "the failed create left a file behind"
    );
    // What fits still works, and is really backed: every byte can be written.
    let seg = options
        .create("fits", 512 * 1024)
        .expect("create within the size");
    seg.write_at(0, &vec![0xA5; seg.len()]).expect("write all");
}

#[test]
fn gc_removes_segments_of_dead_owners_only() {
    let prefix = unique_prefix("gc");
    let spawn_owner = || {
        let mut child = child::command("shm-own", &[("GPUFEED_IT_PREFIX", prefix.clone())])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn");
        // Read on until the child exits, so that its later output never meets a closed pipe.
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let name = lines
            .by_ref()
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix("NAME=").map(str::to_owned))
            .expect("child printed its segment name");
        std::thread::spawn(move || lines.for_each(drop));
        (child, name)
    };
    let (mut doomed, doomed_name) = spawn_owner();
    let (mut live, live_name) = spawn_owner();
    // A name with our prefix but not of the generated form, which gc must not touch.
    let odd = Path::new(shm::DEFAULT_DIR).join(format!("{prefix}-notapid"));
    std::fs::write(&odd, b"x").expect("odd file");
    let _cleanup = RemoveFile(&odd);

    doomed.kill().expect("SIGKILL");
    doomed.wait().expect("reap");
    let entries = shm::list(&prefix).expect("list");
    assert_eq!(entries.len(), 2, "{entries:?}");
    assert!(
        entries
            .iter()
            .any(|e| e.name == doomed_name && e.owner == Liveness::Dead)
    );
    assert!(
        entries
            .iter()
            .any(|e| e.name == live_name && e.owner == Liveness::Alive)
    );

    let report = shm::gc(&prefix).expect("gc");
    assert_eq!(report.removed, vec![doomed_name.clone()]);
    assert_eq!(report.kept, vec![live_name.clone()]);
    assert_eq!(report.removed_bytes, 64 * 1024);
    assert!(!Path::new(shm::DEFAULT_DIR).join(&doomed_name).exists());
    assert!(Path::new(shm::DEFAULT_DIR).join(&live_name).exists());
    assert!(odd.exists(), "gc removed a name it did not generate");

    drop(live.stdin.take()); // the owner exits normally, keeping its segment
    live.wait().expect("reap");
    let report = shm::gc(&prefix).expect("gc");
    assert_eq!(report.removed, vec![live_name.clone()]);
    assert!(shm::list(&prefix).expect("list").is_empty());
}

struct RemoveFile<'a>(&'a Path);

impl Drop for RemoveFile<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

/// A segment created by a process in another PID namespace (a container sharing /dev/shm
/// with `--ipc=host`): its pid means nothing here, so `list` says so and `gc` keeps it while
/// the process runs and after it exits, unless told to remove other namespaces' segments.
/// Before namespaces were recorded, the creator (pid 1 of its namespace) was judged by our
/// pid 1 and its live segment removed.
#[test]
fn gc_leaves_segments_of_other_pid_namespaces_alone() {
    let test = "gc_leaves_segments_of_other_pid_namespaces_alone";
    let prefix = unique_prefix("gcns");
    let mut cmd = child::command("shm-own", &[("GPUFEED_IT_PREFIX", prefix.clone())]);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
    let Some(mut owner) = gpufeed_testkit::spawn_in_new_pid_namespace(test, &mut cmd) else {
        return;
    };
    let mut lines = BufReader::new(owner.stdout.take().expect("stdout")).lines();
    let name = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("NAME=").map(str::to_owned))
        .expect("child printed its segment name");
    let path = Path::new(shm::DEFAULT_DIR).join(&name);
    let _cleanup = RemoveFile(&path);

    let entries = shm::list(&prefix).expect("list");
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0].owner, Liveness::OtherNamespace);
    assert_eq!(entries[0].owner_pid, 1, "pid 1 of its own namespace");
    assert_ne!(
        entries[0].owner_pid_ns,
        gpufeed_os::process::current_pid_ns()
    );

    let report = shm::gc(&prefix).expect("gc");
    assert!(report.removed.is_empty(), "{report:?}");
    assert_eq!(report.other_namespace, vec![name.clone()]);
    assert!(
        path.exists(),
        "gc removed a live segment of another namespace"
    );

    drop(owner.stdin.take());
    owner.wait().expect("wait");
    let report = shm::gc(&prefix).expect("gc");
    assert!(
        path.exists(),
        "gc judged another namespace's owner by its pid"
    );
    assert_eq!(report.other_namespace, vec![name.clone()]);

    let report = shm::gc_in_with(
        Path::new(shm::DEFAULT_DIR),
        &prefix,
        shm::ForeignSegments::Remove,
    )
    .expect("gc other namespaces");
    assert_eq!(report.removed, vec![name]);
    assert!(!path.exists());
}

/// A symlink planted at a segment's name (another process of ours, or root's /dev/shm): open
/// refuses to follow it (O_NOFOLLOW), create refuses the taken name (O_EXCL), and the target
/// is untouched.
#[test]
fn symlinks_at_segment_names_are_never_followed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("target");
    let precious = random_bytes(8192, 11);
    std::fs::write(&target, &precious).expect("target");
    let name = unique_prefix("symlink");
    let link = Path::new(shm::DEFAULT_DIR).join(&name);
    std::os::unix::fs::symlink(&target, &link).expect("plant");
    let _cleanup = RemoveFile(&link);
    let err = ShmSegment::open(&name).unwrap_err();
    assert!(
        matches!(&err, Error::Io { source, .. } if source.raw_os_error() == Some(libc::ELOOP)),
        "{err:?}"
    );
    let err = ShmSegment::create(&name, 4096).unwrap_err();
    assert!(matches!(err, Error::ShmExists { .. }), "{err:?}");
    assert_eq!(std::fs::read(&target).expect("read"), precious);
    assert!(
        std::fs::symlink_metadata(&link)
            .expect("still there")
            .file_type()
            .is_symlink()
    );
}

/// A handle's `unlink` removes the name only while it is still its segment: a process that
/// resumes (it was stopped) after another job of this user replaced the name with a new
/// segment leaves the new one alone.
#[test]
fn unlink_leaves_a_replacement_of_the_same_name_alone() {
    use std::os::unix::fs::MetadataExt;
    let mut first = ShmOptions::new()
        .prefix(unique_prefix("ur"))
        .create_unique(4096)
        .expect("create");
    let name = first.name().expect("named").to_owned();
    let path = first.path().expect("path").to_owned();
    let old_ino = std::fs::metadata(&path).expect("stat").ino();
    // Another process removes the name and makes a new segment under it.
    child::run("shm-replace", &[("GPUFEED_IT_NAME", name.clone())]);
    let new_ino = std::fs::metadata(&path).expect("the new segment").ino();
    assert_ne!(new_ino, old_ino, "not replaced: the test does not test");
    first.unlink().expect("unlink");
    let after = std::fs::metadata(&path).map(|m| m.ino());
    // Clean up the new segment whatever happened.
    let _ = std::fs::remove_file(&path);
    assert_eq!(
        after.ok(),
        Some(new_ino),
        "unlink removed the segment that replaced ours"
    );
}

/// Child role `shm-replace`: removes the segment GPUFEED_IT_NAME and creates a new one of
/// that name, which it keeps.
pub fn replace_segment() {
    let name = std::env::var("GPUFEED_IT_NAME").expect("name");
    std::fs::remove_file(Path::new(shm::DEFAULT_DIR).join(&name)).expect("remove");
    ShmOptions::new()
        .unlink_on_drop(false)
        .create(&name, 8192)
        .expect("recreate");
}
