//! File identity: a rewrite that keeps the size and sets the modification time back is still a
//! change.

use std::io::Write;

use gpufeed_os::FileIdentity;

use crate::random_bytes;

/// A file rewritten in place with other bytes of the same size, its mtime then set back to
/// the old one (what `touch -d` or `rsync --times` do): its identity differs (ctime).
#[test]
fn a_rewrite_that_keeps_size_and_mtime_is_a_change() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("data.bin");
    std::fs::write(&path, random_bytes(100_000, 1)).expect("write");
    let before = FileIdentity::of_path(&path).expect("identity");
    let mtime = std::fs::metadata(&path)
        .expect("stat")
        .modified()
        .expect("mtime");
    // Past the coarse timestamp tick of kernels without fine-grained ctime.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    f.write_all(&random_bytes(100_000, 2)).expect("rewrite");
    f.set_modified(mtime).expect("set the mtime back");
    drop(f);
    let after = FileIdentity::of_path(&path).expect("identity");
    assert_eq!(
        (after.dev, after.ino, after.size),
        (before.dev, before.ino, before.size)
    );
    assert_eq!(after.mtime_ns, before.mtime_ns, "the mtime was set back");
    assert_ne!(
        after, before,
        "a same-size rewrite with the old mtime went unseen"
    );
    let why = before.difference(&after).expect("a difference");
    assert!(why.contains("ctime"), "{why}");
    assert_eq!(before.difference(&before), None);
}

/// [`gpufeed_os::OpenedFile`]: what a load opens once. Its second descriptor (for `O_DIRECT`)
/// and its mapping are of the version opened even after another file is renamed over the
/// path; a write into the opened version, in place and with its size and mtime restored, is
/// still seen by `changed` (ctime), and a file that is not regular is refused as
/// `open_regular` refuses it.
#[test]
fn an_opened_file_stays_the_version_opened_and_tells_when_it_changed() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("v.bin");
    let old = gpufeed_testkit::random_bytes(100_003, 7);
    std::fs::write(&path, &old).expect("write");
    let opened = gpufeed_os::OpenedFile::open(&path).expect("open");
    assert_eq!(
        (opened.len(), opened.path()),
        (old.len() as u64, path.as_path())
    );
    assert_eq!(opened.changed().expect("fstat"), None);
    let tmp = dir.path().join("next");
    std::fs::write(&tmp, gpufeed_testkit::random_bytes(50_000, 8)).expect("write");
    std::fs::rename(&tmp, &path).expect("rename over");
    // A second description of the same inode, O_DIRECT where the file system has it.
    let second = match opened.reopen(libc::O_DIRECT) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => opened.reopen(0).expect("reopen"),
        Err(e) => panic!("reopen: {e}"),
    };
    let mut head = vec![0u8; 4096];
    match second.read_exact_at(&mut head, 0) {
        Ok(()) => assert_eq!(
            head,
            old[..4096],
            "the reopened descriptor reads the version opened"
        ),
        // An O_DIRECT read into an unaligned Vec may be refused; the identity says enough.
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}"),
    }
    let meta = second.metadata().expect("fstat");
    assert_eq!(
        (std::os::unix::fs::MetadataExt::ino(&meta), meta.len()),
        (opened.identity().ino, old.len() as u64)
    );
    // SAFETY: the opened version is no longer reachable by name: nobody truncates it.
    let map = unsafe { gpufeed_os::FileMap::of_opened(&opened, 17, 60_000) }.expect("map");
    assert_eq!(
        map.as_slice(),
        &old[17..60_017],
        "the mapping is of the version opened"
    );
    assert!(
        opened.changed().expect("fstat").is_some(),
        "a version that lost its name has changed"
    );
    // ... but not in its contents (a handle held long reads it on), and a duplicate taken as
    // of now starts from its identity now.
    assert_eq!(opened.content_changed().expect("fstat"), None);
    let now = opened.try_clone_as_of_now().expect("clone as of now");
    assert_eq!(now.changed().expect("fstat"), None);
    assert_eq!(
        (now.identity().ino, now.len()),
        (opened.identity().ino, opened.len())
    );
    assert_ne!(now.identity().ctime_ns, opened.identity().ctime_ns);

    // In place: written through another descriptor, size and mtime put back.
    let path = dir.path().join("w.bin");
    std::fs::write(&path, &old).expect("write");
    let opened = gpufeed_os::OpenedFile::open(&path).expect("open");
    let mtime = std::fs::metadata(&path)
        .expect("stat")
        .modified()
        .expect("mtime");
    std::thread::sleep(std::time::Duration::from_millis(20));
    let w = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open rw");
    w.write_all_at(b"XX", 10).expect("write in place");
    w.set_modified(mtime).expect("mtime back");
    let what = opened.changed().expect("fstat").expect("a rewrite is seen");
    assert!(what.contains("ctime"), "{what}");
    // The contents' check misses only this (the mtime set back to the very instant); a size
    // or mtime change it sees.
    assert_eq!(opened.content_changed().expect("fstat"), None);
    w.write_all_at(b"YY", old.len() as u64).expect("append");
    let what = opened
        .content_changed()
        .expect("fstat")
        .expect("a longer file is seen");
    assert!(what.contains("size"), "{what}");
    let err = opened
        .try_clone_as_of_now()
        .expect_err("a longer file is not cloned as of now");
    assert!(
        matches!(err, gpufeed_os::Error::ChangedSinceOpened { .. }),
        "{err:?}"
    );

    let err = gpufeed_os::OpenedFile::open(dir.path()).expect_err("a directory");
    assert!(
        matches!(err, gpufeed_os::Error::IsDirectory { .. }),
        "{err:?}"
    );
}

/// Where `/proc` is not mounted, [`gpufeed_os::OpenedFile::reopen`] (the `O_DIRECT` descriptor
/// of every direct read) opens the path and keeps it only if it is the file opened: a file
/// renamed over the path meanwhile is refused, the same file reads as it is. A child in a mount
/// namespace of its own with `/proc` lazily unmounted (root, or a user namespace the kernel
/// allows; skipped with the reason otherwise).
#[test]
fn an_opened_file_reopens_by_its_path_where_proc_is_not_mounted() {
    let test = "an_opened_file_reopens_by_its_path_where_proc_is_not_mounted";
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("f.bin");
    let other = dir.path().join("other.bin");
    std::fs::write(&path, random_bytes(10_007, 1)).expect("write");
    std::fs::write(&other, random_bytes(20_011, 2)).expect("write");
    let vars = [
        ("GPUFEED_IT_PATH", path.display().to_string()),
        ("GPUFEED_IT_OTHER", other.display().to_string()),
        ("GPUFEED_IT_SEED", "2".to_owned()),
    ];
    let wrapper = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        "umount -l /proc && exec \"$@\"",
        "sh",
    ];
    if let Some(out) = crate::child::run_wrapped(test, &wrapper, "reopen-without-proc", &vars) {
        assert!(out.contains("REOPENED 20011"), "{out}");
    }
}
