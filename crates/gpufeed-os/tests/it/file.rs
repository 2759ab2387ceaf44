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
