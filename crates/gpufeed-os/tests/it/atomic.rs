//! `AtomicFile` against another user: a team directory (writable by others, no sticky bit)
//! where a process of `nobody` swaps whatever temporary it can see for a symlink to a file
//! outside, while root saves.

use std::io::Write;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use gpufeed_os::AtomicFile;
use xxhash_rust::xxh3::xxh3_64;

use crate::{child, random_bytes};

/// A directory tree for the attack: `<base>/team` (mode 0777, no sticky bit) and
/// `<base>/outside/victim.bin` (root's, 0644), `base` traversable by everyone.
pub struct TeamDir {
    /// Removed on drop.
    _base: tempfile::TempDir,
    pub team: PathBuf,
    pub victim: PathBuf,
    pub victim_bytes: Vec<u8>,
}

impl TeamDir {
    pub fn new(mode: u32) -> Self {
        let base = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod base");
        let team = base.path().join("team");
        std::fs::create_dir(&team).expect("mkdir team");
        std::fs::set_permissions(&team, std::fs::Permissions::from_mode(mode)).expect("chmod");
        let outside = base.path().join("outside");
        std::fs::create_dir(&outside).expect("mkdir outside");
        let victim = outside.join("victim.bin");
        let victim_bytes = random_bytes(10_000, 99);
        std::fs::write(&victim, &victim_bytes).expect("victim");
        TeamDir {
            _base: base,
            team,
            victim,
            victim_bytes,
        }
    }

    /// How many of our names the attacker moved aside.
    pub fn moved_aside(&self) -> usize {
        std::fs::read_dir(&self.team)
            .expect("ls")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().contains(".moved"))
            .count()
    }

    /// Asserts that the file outside the directory was not written.
    pub fn assert_victim_untouched(&self, when: &str) {
        let now = std::fs::read(&self.victim).expect("read the victim");
        assert!(
            now == self.victim_bytes,
            "{when}: root wrote {} bytes into {} outside the directory, through a symlink",
            now.len(),
            self.victim.display()
        );
    }
}

/// The attacker: this test binary as `nobody`, swapping temporaries in `dir` for symlinks to
/// `victim` until dropped (killed). Returns once it runs.
pub fn spawn_swapper(dir: &Path, victim: &Path) -> Attacker {
    let mut cmd = child::command(
        "tmp-swapper",
        &[
            ("GPUFEED_IT_DIR", dir.display().to_string()),
            ("GPUFEED_IT_VICTIM", victim.display().to_string()),
        ],
    );
    // std drops the supplementary groups too when root sets a uid.
    cmd.uid(65534).gid(65534).stdout(Stdio::piped());
    let mut child = Attacker(cmd.spawn().expect("spawn the attacker as nobody"));
    let out = std::io::BufReader::new(child.0.stdout.take().expect("stdout"));
    let ready = std::io::BufRead::lines(out)
        .map_while(Result::ok)
        .any(|l| l.trim() == "READY");
    assert!(ready, "the attacker did not start");
    child
}

/// A child process killed and reaped when dropped (also when a test panics).
pub struct Attacker(pub std::process::Child);

impl Drop for Attacker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The attacker's loop (child role `tmp-swapper`): every name with `gpufeed-tmp-` in it that is
/// not a symlink is renamed aside and replaced by a symlink to the victim.
pub fn swap_temporaries_forever(dir: &Path, victim: &Path) -> ! {
    assert_ne!(
        rustix::process::geteuid().as_raw(),
        0,
        "the attacker runs as root"
    );
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

/// Root saves 1 MiB files into a team directory 100 times while `nobody` swaps the
/// temporaries for symlinks to a file outside: that file is never written, and every save that
/// succeeds leaves the target a regular file with exactly the saved bytes.
#[test]
fn another_user_swapping_the_temporary_for_a_symlink_never_redirects_a_save() {
    const TEST: &str = "atomic::another_user_swapping_the_temporary_for_a_symlink";
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(TEST, &"needs root to run an attacker as nobody");
        return;
    }
    for mode in [0o777, 0o2775] {
        let t = TeamDir::new(mode);
        if mode == 0o2775 {
            // Group-writable for nobody's group, as a team directory would be.
            rustix::fs::chown(&t.team, None, Some(rustix::fs::Gid::from_raw(65534)))
                .expect("chgrp");
            std::fs::set_permissions(&t.team, std::fs::Permissions::from_mode(mode))
                .expect("chmod");
        }
        let target = t.team.join("ckpt.bin");
        let attacker = spawn_swapper(&t.team, &t.victim);
        let (mut ok, mut failed) = (0, 0);
        for i in 0..100u64 {
            let data = random_bytes((1 << 20) + 4096 * (i as usize % 3), i);
            let saved = (|| -> Result<(), String> {
                let f = AtomicFile::create(&target, Some(data.len() as u64))
                    .map_err(|e| format!("create: {e}"))?;
                // Half the saves write through the descriptor, half through a second one
                // opened from `path()` (what a writer that wants O_DIRECT does).
                if i % 2 == 0 {
                    f.file()
                        .write_all_at(&data, 0)
                        .map_err(|e| format!("write: {e}"))?;
                } else {
                    let again = std::fs::OpenOptions::new()
                        .write(true)
                        .open(f.path())
                        .map_err(|e| format!("reopen: {e}"))?;
                    again
                        .write_all_at(&data, 0)
                        .map_err(|e| format!("write: {e}"))?;
                }
                f.commit().map_err(|e| format!("commit: {e}"))
            })();
            t.assert_victim_untouched(&format!("{mode:o}: save {i}"));
            match saved {
                Ok(()) => {
                    ok += 1;
                    let meta = std::fs::symlink_metadata(&target).expect("lstat target");
                    assert!(
                        meta.file_type().is_file(),
                        "{mode:o}: save {i} returned Ok but the target is {:?}",
                        meta.file_type()
                    );
                    let back = std::fs::read(&target).expect("read target");
                    assert_eq!(xxh3_64(&back), xxh3_64(&data), "{mode:o}: save {i}");
                }
                Err(_) => failed += 1,
            }
        }
        drop(attacker);
        let moved = t.moved_aside();
        eprintln!(
            "{mode:o}: {ok} saves succeeded, {failed} failed; the attacker swapped {moved} names"
        );
        assert!(ok > 0, "{mode:o}: no save succeeded: the test did not test");
        assert!(
            moved > 0,
            "{mode:o}: the attacker never swapped a name: the test did not test"
        );
    }
}

fn mode_of(path: &Path) -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).expect("lstat").mode() & 0o7777
}

fn save(target: &Path, data: &[u8]) {
    let f = AtomicFile::create(target, None).expect("create");
    f.file().write_all_at(data, 0).expect("write");
    f.commit().expect("commit");
}

/// A save keeps the permission bits of the file it replaces (0600 stays 0600, 0640 stays
/// 0640), and as root its owner and group.
#[test]
fn a_save_keeps_the_mode_and_owner_of_the_file_it_replaces() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().expect("tempdir");
    for mode in [0o600, 0o640, 0o604, 0o755] {
        let target = dir.path().join(format!("m{mode:o}.bin"));
        std::fs::write(&target, b"old").expect("old");
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode)).expect("chmod");
        save(&target, b"new");
        assert_eq!(mode_of(&target), mode, "saved over a {mode:o} file");
        assert_eq!(std::fs::read(&target).expect("read"), b"new");
    }
    // Set-id bits are not carried over.
    let target = dir.path().join("setuid.bin");
    std::fs::write(&target, b"old").expect("old");
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o4750)).expect("chmod");
    save(&target, b"new");
    assert_eq!(mode_of(&target), 0o750);
    if gpufeed_testkit::is_root() {
        let target = dir.path().join("nobodys.bin");
        std::fs::write(&target, b"old").expect("old");
        rustix::fs::chown(
            &target,
            Some(rustix::fs::Uid::from_raw(65534)),
            Some(rustix::fs::Gid::from_raw(65534)),
        )
        .expect("chown");
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        save(&target, b"new");
        let meta = std::fs::symlink_metadata(&target).expect("lstat");
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o777),
            (65534, 65534, 0o600)
        );
    } else {
        gpufeed_testkit::skip(
            "atomic::a_save_keeps_the_mode_and_owner (owner part)",
            &"only root may give a file to another user",
        );
    }
}

/// A new target gets `0666 & ~umask`, like a plain create (umask set in a child process, since
/// it is shared by every thread of this one); a symlink at the target is replaced, its target
/// neither written nor its mode taken.
#[test]
fn a_new_file_gets_the_umasks_mode_and_a_symlink_at_the_target_is_replaced() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (umask, expected) in [
        (0o022, 0o644),
        (0o027, 0o640),
        (0o077, 0o600),
        (0o002, 0o664),
    ] {
        let target = dir.path().join(format!("u{umask:o}.bin"));
        child::run(
            "atomic-save",
            &[
                ("GPUFEED_IT_PATH", target.display().to_string()),
                ("GPUFEED_IT_UMASK", format!("{umask:o}")),
            ],
        );
        assert_eq!(mode_of(&target), expected, "umask {umask:03o}");
        assert_eq!(std::fs::read(&target).expect("read"), b"saved by a child");
    }
    let outside = dir.path().join("outside.bin");
    std::fs::write(&outside, b"outside").expect("outside");
    std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let target = dir.path().join("link.bin");
    std::os::unix::fs::symlink(&outside, &target).expect("symlink");
    child::run(
        "atomic-save",
        &[
            ("GPUFEED_IT_PATH", target.display().to_string()),
            ("GPUFEED_IT_UMASK", "022".into()),
        ],
    );
    assert!(std::fs::symlink_metadata(&target).expect("lstat").is_file());
    assert_eq!(mode_of(&target), 0o644, "a symlink's target lends no mode");
    assert_eq!(std::fs::read(&outside).expect("read"), b"outside");
}

/// Child role `atomic-save`: sets the umask GPUFEED_IT_UMASK (octal) and saves
/// "saved by a child" to GPUFEED_IT_PATH.
pub fn save_with_umask(target: &Path, umask: u32) {
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(umask));
    save(target, b"saved by a child");
}

/// A target name of 255 bytes (NAME_MAX) saves, and so does one of 200: the names in the
/// directory do not grow with the target's.
#[test]
fn a_target_name_of_255_bytes_saves() {
    let dir = tempfile::tempdir().expect("tempdir");
    for len in [200, 255] {
        let target = dir.path().join("n".repeat(len));
        std::fs::write(&target, b"old").expect("a name of NAME_MAX bytes is valid");
        save(&target, b"new contents");
        assert_eq!(std::fs::read(&target).expect("read"), b"new contents");
    }
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ls")
        .flatten()
        .map(|e| e.file_name().len())
        .collect();
    assert_eq!(names.len(), 2, "temporaries left: {names:?}");
}
