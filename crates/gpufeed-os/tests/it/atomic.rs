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

/// A child process killed and reaped when dropped.
pub use gpufeed_testkit::KillOnDrop as Attacker;

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
/// neither written nor its mode taken: the saved file is 0600 (it may hold what the symlink's
/// target held, whose mode we do not know).
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
    assert_eq!(
        mode_of(&target),
        0o600,
        "a symlink at the target (to a 0600 file) left the saved file more open than 0600"
    );
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

/// This boot's id as a temporary's name has it (32 hex digits, no dashes).
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .expect("boot_id")
        .trim()
        .replace('-', "")
}

/// Sets the modification time of `path` an hour back.
fn set_mtime_an_hour_back(path: &Path) {
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    std::fs::File::open(path)
        .and_then(|f| f.set_modified(old))
        .unwrap_or_else(|e| panic!("mtime of {}: {e}", path.display()));
}

/// Runs `mv -T from to` as `nobody`.
fn rename_as_nobody(from: &Path, to: &Path) {
    use std::os::unix::process::CommandExt;
    let st = std::process::Command::new("mv")
        .arg("-T")
        .arg(from)
        .arg(to)
        .uid(65534)
        .gid(65534)
        .status()
        .expect("spawn mv as nobody");
    assert!(st.success(), "nobody could not rename {}", from.display());
}

/// In a team directory (0777, no sticky bit) `nobody` renames root's old directories to the
/// names of dead writers' temporaries of this boot: two of a temporary's exact shape (0700,
/// one regular file) and one not (0755, two files). Root's next `AtomicFile::create` there
/// leaves them and their files alone, while a real leftover of a killed writer (its file an
/// hour old) is still removed.
#[test]
fn a_directory_renamed_to_a_temporarys_name_is_never_cleaned() {
    use std::os::unix::fs::MetadataExt;
    const TEST: &str = "atomic::a_directory_renamed_to_a_temporarys_name_is_never_cleaned";
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(TEST, &"needs root to rename as nobody");
        return;
    }
    let t = TeamDir::new(0o777);
    let ns = std::fs::metadata("/proc/self/ns/pid")
        .expect("pid ns")
        .ino();
    let boot = boot_id();
    let mut victims = Vec::new();
    // (name, mode, files, whether the directory's own mtime is set back too)
    for (k, (dir, mode, files, dir_old)) in [
        ("results", 0o700, &["data.bin"][..], true),
        ("latest", 0o700, &["data.bin"][..], false),
        ("runs", 0o755, &["a.bin", "b.bin"][..], true),
    ]
    .into_iter()
    .enumerate()
    {
        let d = t.team.join(dir);
        std::fs::create_dir(&d).expect("mkdir");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode)).expect("chmod");
        let mut contents = Vec::new();
        for (i, f) in files.iter().enumerate() {
            let bytes = random_bytes(3000 + i, k as u64 * 10 + i as u64);
            std::fs::write(d.join(f), &bytes).expect("write");
            std::fs::set_permissions(d.join(f), std::fs::Permissions::from_mode(0o600))
                .expect("chmod");
            set_mtime_an_hour_back(&d.join(f));
            contents.push((f.to_string(), bytes));
        }
        // A directory left alone for an hour has an old mtime and its ctime equal to it; a
        // test can set the mtime back (`results`, `runs`: which moves the ctime to now) or
        // leave the directory as its last entry's creation left it (`latest`: ctime equal to
        // mtime, as after an hour, only recent).
        if dir_old {
            set_mtime_an_hour_back(&d);
        }
        // Timestamps are coarse: the rename comes a clock tick later, as it would.
        std::thread::sleep(std::time::Duration::from_millis(30));
        // A pid above any pid_max (2^22): its writer reads as dead.
        let fake = t.team.join(format!(
            ".gpufeed-tmp-{boot}-8388608-1-{ns}-0123456789abcde{k}"
        ));
        rename_as_nobody(&d, &fake);
        victims.push((fake, contents));
    }
    // A real leftover: a writer killed while it held its temporary.
    let mut writer = child::command(
        "atomic-hold",
        &[(
            "GPUFEED_IT_PATH",
            t.team.join("w.bin").display().to_string(),
        )],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .spawn()
    .expect("spawn a writer");
    let ready = std::io::BufRead::lines(std::io::BufReader::new(
        writer.stdout.take().expect("stdout"),
    ))
    .map_while(Result::ok)
    .any(|l| l.trim() == "READY=1");
    assert!(ready, "the writer did not start");
    writer.kill().expect("SIGKILL");
    writer.wait().expect("reap");
    let leftover: Vec<PathBuf> = std::fs::read_dir(&t.team)
        .expect("ls")
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(".gpufeed-tmp-"))
                && !victims.iter().any(|(v, _)| v == p)
        })
        .collect();
    assert_eq!(leftover.len(), 1, "{leftover:?}");
    set_mtime_an_hour_back(&leftover[0].join("w.bin"));

    let f = AtomicFile::create(t.team.join("ckpt.bin"), None).expect("create");
    for (dir, contents) in &victims {
        for (name, bytes) in contents {
            let now = std::fs::read(dir.join(name));
            assert!(
                now.as_ref().is_ok_and(|b| b == bytes),
                "root's {} (renamed by nobody to {}) was deleted or changed by the cleanup: \
                 {:?}",
                name,
                dir.display(),
                now.err()
            );
        }
    }
    assert_eq!(f.cleaned(), &leftover[..], "the killed writer's leftover");
    drop(f);
}

/// The attacker (child role `tmp-exchanger`, run as another user): on every private directory
/// made in `dir` (inotify, polled in a spin), exchanges it with `victim` (`renameat2(RENAME_EXCHANGE)`), and
/// after a millisecond back.
pub fn exchange_private_dirs_forever(dir: &Path, victim: &str) -> ! {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    assert_ne!(
        rustix::process::geteuid().as_raw(),
        0,
        "the attacker runs as root"
    );
    let cdir = CString::new(dir.as_os_str().as_bytes()).expect("path");
    let cvictim = CString::new(victim).expect("name");
    // SAFETY: plain system calls on valid C strings and our own buffers.
    unsafe {
        // Non-blocking, polled in a spin: a read that blocks wakes tens of microseconds after
        // the mkdir, and on 16 idle cores the saver's mkdir -> open is shorter than that (GPU
        // run 132: 3,224 creates, no race won in 60 s).
        let inotify = libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK);
        assert!(inotify >= 0, "inotify_init1");
        assert!(libc::inotify_add_watch(inotify, cdir.as_ptr(), libc::IN_CREATE) >= 0);
        let dirfd = libc::open(cdir.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY);
        assert!(dirfd >= 0, "open dir");
        println!("READY");
        std::io::stdout().flush().expect("flush");
        let mut buf = [0u8; 8192];
        loop {
            let n = libc::read(inotify, buf.as_mut_ptr().cast(), buf.len());
            if n <= 0 {
                std::hint::spin_loop();
                continue;
            }
            let mut at = 0usize;
            while at + std::mem::size_of::<libc::inotify_event>() <= n as usize {
                let ev = buf
                    .as_ptr()
                    .add(at)
                    .cast::<libc::inotify_event>()
                    .read_unaligned();
                let name_at = at + std::mem::size_of::<libc::inotify_event>();
                at = name_at + ev.len as usize;
                if ev.len == 0 || ev.mask & libc::IN_ISDIR == 0 {
                    continue;
                }
                let name = std::ffi::CStr::from_ptr(buf.as_ptr().add(name_at).cast());
                if !name.to_bytes().starts_with(b".gpufeed-tmp-") {
                    continue;
                }
                let swap = || {
                    libc::syscall(
                        libc::SYS_renameat2,
                        dirfd,
                        name.as_ptr(),
                        dirfd,
                        cvictim.as_ptr(),
                        libc::RENAME_EXCHANGE,
                    ) == 0
                };
                if swap() {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    swap();
                }
            }
        }
    }
}

/// In a team directory (0777) `nobody` exchanges each private directory root makes, right
/// after the `mkdir`, with a directory of root's: the sticky `shared/` (1777) and `data/`
/// (0755), each holding a file. Root never changes such a directory's mode, never puts a
/// file in it and never removes it; a create that opened the exchanged directory fails with
/// `UnsafeTemporary`, every save that succeeds leaves the saved bytes, and once the attacker
/// is gone saves succeed again. (An empty directory exchanged in between the last check and
/// the `rmdir` of a private directory is removed, as the module docs say: one the attacker
/// could remove itself. The spinning attacker hit that window on the 2-core CI machine, so
/// both victims hold a file, which `rmdir` refuses to remove.)
#[test]
fn a_private_directory_exchanged_for_another_is_refused_and_never_changed() {
    use std::os::unix::fs::MetadataExt;
    const TEST: &str = "atomic::a_private_directory_exchanged_for_another_is_refused";
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(TEST, &"needs root to run an attacker as nobody");
        return;
    }
    for (victim, mode, file) in [("shared", 0o1777, "notes.txt"), ("data", 0o755, "kept.bin")] {
        let t = TeamDir::new(0o777);
        let victim_dir = t.team.join(victim);
        std::fs::create_dir(&victim_dir).expect("mkdir");
        std::fs::write(victim_dir.join(file), b"root's").expect("write");
        std::fs::set_permissions(&victim_dir, std::fs::Permissions::from_mode(mode))
            .expect("chmod");
        let victim_ino = std::fs::metadata(&victim_dir).expect("stat").ino();
        let expected: Vec<std::ffi::OsString> = vec![file.into()];
        let mut cmd = child::command(
            "tmp-exchanger",
            &[
                ("GPUFEED_IT_DIR", t.team.display().to_string()),
                ("GPUFEED_IT_VICTIM", victim.into()),
            ],
        );
        {
            use std::os::unix::process::CommandExt;
            cmd.uid(65534).gid(65534).stdout(Stdio::piped());
        }
        let mut attacker = Attacker(cmd.spawn().expect("spawn the attacker as nobody"));
        let out = std::io::BufReader::new(attacker.0.stdout.take().expect("stdout"));
        assert!(
            std::io::BufRead::lines(out)
                .map_while(Result::ok)
                .any(|l| l.trim() == "READY"),
            "the attacker did not start"
        );
        let target = t.team.join("ckpt.bin");
        let started = std::time::Instant::now();
        let (mut ok, mut refused, mut other) = (0, 0, 0);
        let mut i = 0u64;
        while refused < 3 && started.elapsed() < std::time::Duration::from_secs(60) {
            i += 1;
            let data = random_bytes(4096 + (i as usize % 7), i);
            match AtomicFile::create(&target, None) {
                Ok(f) => {
                    f.file().write_all_at(&data, 0).expect("write");
                    match f.commit() {
                        Ok(()) => {
                            ok += 1;
                            assert_eq!(std::fs::read(&target).expect("read"), data, "save {i}");
                        }
                        Err(_) => other += 1,
                    }
                }
                Err(gpufeed_os::Error::UnsafeTemporary { .. }) => refused += 1,
                Err(_) => other += 1,
            }
            // The attacker swaps back after a millisecond: wait for it before looking.
            let waited = std::time::Instant::now();
            let meta = loop {
                let meta = std::fs::symlink_metadata(&victim_dir);
                if meta.as_ref().is_ok_and(|m| m.ino() == victim_ino)
                    || waited.elapsed() > std::time::Duration::from_secs(2)
                {
                    break meta;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            };
            let meta = meta.unwrap_or_else(|e| panic!("{victim}: save {i}: it is gone ({e})"));
            assert_eq!(
                meta.ino(),
                victim_ino,
                "{victim}: save {i}: root removed it (the attacker could not swap it back)"
            );
            assert_eq!(
                meta.mode() & 0o7777,
                mode,
                "{victim}: save {i}: root changed its mode"
            );
            let inside: Vec<_> = std::fs::read_dir(&victim_dir)
                .expect("ls")
                .flatten()
                .map(|e| e.file_name())
                .collect();
            assert_eq!(
                inside, expected,
                "{victim}: save {i}: root changed what it holds"
            );
        }
        drop(attacker);
        eprintln!(
            "{TEST}: {victim}: {i} creates: {ok} saved, {refused} refused (UnsafeTemporary), \
             {other} failed"
        );
        assert!(
            refused > 0,
            "{victim}: the attacker never won the race between mkdir and open: the test did \
             not test"
        );
        // Without the attacker a save goes through.
        save(&target, b"after the attack");
        assert_eq!(std::fs::read(&target).expect("read"), b"after the attack");
    }
}

/// In a sticky directory anyone may write (1777, like /tmp) `nobody` plants `ckpt.bin`
/// (0777), and a hard link to a file of its own: root's saves over them give the files to
/// root, with no write bit for others, and nobody's own file stays as it was. Where the old
/// owner could not have planted the file (a directory only root writes) the owner is kept.
#[test]
fn a_save_over_a_file_another_user_planted_stays_ours() {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    const TEST: &str = "atomic::a_save_over_a_file_another_user_planted_stays_ours";
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(TEST, &"needs root to plant files as nobody");
        return;
    }
    let t = TeamDir::new(0o1777);
    let nobodys_dir = t.victim.parent().expect("base").with_file_name("nobodys");
    std::fs::create_dir(&nobodys_dir).expect("mkdir");
    rustix::fs::chown(
        &nobodys_dir,
        Some(rustix::fs::Uid::from_raw(65534)),
        Some(rustix::fs::Gid::from_raw(65534)),
    )
    .expect("chown");
    let as_nobody = |script: &str| {
        let st = std::process::Command::new("sh")
            .args(["-c", script])
            .current_dir(&t.team)
            .uid(65534)
            .gid(65534)
            .status()
            .expect("sh as nobody");
        assert!(st.success(), "as nobody: {script}");
    };
    let own = nobodys_dir.join("own.bin");
    as_nobody("umask 0; echo squatted > ckpt.bin && chmod 0777 ckpt.bin");
    as_nobody(&format!(
        "umask 0; echo nobodys > {0} && chmod 0666 {0} && ln {0} link.bin",
        own.display()
    ));
    for (name, expected) in [("ckpt.bin", 0o755), ("link.bin", 0o644)] {
        let target = t.team.join(name);
        child::run(
            "atomic-save",
            &[
                ("GPUFEED_IT_PATH", target.display().to_string()),
                ("GPUFEED_IT_UMASK", "022".into()),
            ],
        );
        let meta = std::fs::symlink_metadata(&target).expect("lstat");
        assert_eq!(
            (meta.uid(), meta.mode() & 0o7777),
            (0, expected),
            "root's save over {name} planted by nobody (uid, mode)"
        );
        assert_eq!(std::fs::read(&target).expect("read"), b"saved by a child");
    }
    assert_eq!(std::fs::read(&own).expect("read"), b"nobodys\n");
    // nobody's own directory: the file's owner is the directory's, so it stays nobody's.
    let theirs = nobodys_dir.join("theirs.bin");
    std::fs::write(&theirs, b"old").expect("write");
    rustix::fs::chown(
        &theirs,
        Some(rustix::fs::Uid::from_raw(65534)),
        Some(rustix::fs::Gid::from_raw(65534)),
    )
    .expect("chown");
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o640)).expect("chmod");
    save(&theirs, b"new");
    let meta = std::fs::symlink_metadata(&theirs).expect("lstat");
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o7777),
        (65534, 65534, 0o640)
    );
}
