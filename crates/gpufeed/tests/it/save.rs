//! Saves on the CPU machine (host memory through the same windows and writer as GPU saves):
//! bytes exact at unaligned sizes, safetensors that load back with the `safetensors` crate,
//! a full file system, and processes SIGKILLed mid-save that never leave a broken target.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use gpufeed::safetensors::{Dtype, SaveTensor, save, save_sharded};
use gpufeed::{Piece, SaveOptions, Saver};
use xxhash_rust::xxh3::xxh3_64;

use crate::random_bytes;

fn saver() -> Saver {
    // Small windows, so that a few MiB take several of them.
    Saver::host(SaveOptions::default().with_window_bytes(1 << 20)).expect("host saver")
}

fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("ls")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".gpufeed-tmp-"))
        .collect()
}

#[test]
fn saved_bytes_are_exact_and_replace_the_old_file() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("blob.bin");
    std::fs::write(&path, b"the old contents").expect("old");
    let saver = saver();
    let seed = gpufeed_testkit::seed("saved_bytes_are_exact");
    for (k, len) in [0usize, 1, 4097, (5 << 20) + 3].into_iter().enumerate() {
        let data = random_bytes(len, seed ^ k as u64);
        let report = saver.save_bytes(&data, &path).expect("save");
        assert_eq!(report.bytes, len as u64);
        let back = std::fs::read(&path).expect("read");
        assert_eq!(xxh3_64(&back), xxh3_64(&data), "{len} B");
        if len >= 1 << 20 && report.fallbacks.is_empty() {
            assert!(report.direct_bytes > 0, "{report:?}");
        }
        assert!(temporaries(dir.path()).is_empty());
    }
}

#[test]
fn safetensors_saved_from_host_memory_load_with_the_safetensors_crate() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let dtypes = [Dtype::U8, Dtype::F16, Dtype::BF16, Dtype::F32, Dtype::I64];
    let data: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = dtypes
        .iter()
        .enumerate()
        .map(|(i, &d)| {
            let shape = vec![3 + i, 1001 + 7 * i];
            let len = shape.iter().product::<usize>() * d.bitsize() / 8;
            (format!("layer{i}.w"), d, shape, random_bytes(len, i as u64))
        })
        .collect();
    let tensors: Vec<SaveTensor<'_>> = data
        .iter()
        .map(|(n, d, s, b)| SaveTensor {
            name: n,
            dtype: *d,
            shape: s,
            data: Piece::Host(b),
        })
        .collect();
    let meta = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    let saver = saver();
    let path = dir.path().join("model.safetensors");
    save(&saver, &tensors, Some(&meta), &path).expect("save");
    let bytes = std::fs::read(&path).expect("read");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8")) as usize;
    assert_eq!(
        (8 + header_len) % 4096,
        0,
        "the data starts on a 4 KiB boundary"
    );
    let (_, parsed_meta) = safetensors::SafeTensors::read_metadata(&bytes).expect("metadata");
    assert_eq!(
        parsed_meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("format")),
        Some(&"pt".to_owned())
    );
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("the safetensors crate reads it");
    for (n, d, s, b) in &data {
        let t = st.tensor(n).expect("tensor");
        assert_eq!((t.dtype(), t.shape()), (*d, &s[..]), "{n}");
        assert_eq!(xxh3_64(t.data()), xxh3_64(b), "{n}");
    }
    // Sharded: each shard and the index are valid, and together hold every tensor.
    let shard_dir = dir.path().join("sharded");
    std::fs::create_dir(&shard_dir).expect("mkdir");
    let reports =
        save_sharded(&saver, &tensors, Some(&meta), &shard_dir, "model", 30_000).expect("sharded");
    assert!(reports.len() > 1, "{} shards", reports.len());
    let index: serde_json::Value = serde_json::from_slice(
        &std::fs::read(shard_dir.join("model.safetensors.index.json")).expect("index"),
    )
    .expect("json");
    for (n, _, _, b) in &data {
        let file = index["weight_map"][n].as_str().expect("mapped");
        let shard = std::fs::read(shard_dir.join(file)).expect("shard");
        let st = safetensors::SafeTensors::deserialize(&shard).expect("shard parses");
        assert_eq!(
            xxh3_64(st.tensor(n).expect("in its shard").data()),
            xxh3_64(b)
        );
    }
    let total: u64 = data.iter().map(|d| d.3.len() as u64).sum();
    assert_eq!(index["metadata"]["total_size"], total);
}

#[test]
fn tensors_that_do_not_match_their_shape_are_refused_and_nothing_is_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.safetensors");
    let b = vec![0u8; 10];
    let saver = saver();
    let cases = [
        (
            SaveTensor {
                name: "a",
                dtype: Dtype::F32,
                shape: &[3],
                data: Piece::Host(&b),
            },
            "12 bytes",
        ),
        (
            SaveTensor {
                name: "",
                dtype: Dtype::U8,
                shape: &[10],
                data: Piece::Host(&b),
            },
            "needs a name",
        ),
    ];
    for (t, why) in cases {
        let err = save(&saver, &[t], None, &path).unwrap_err();
        assert!(
            matches!(
                err,
                gpufeed::safetensors::Error::Load(gpufeed::load::Error::InvalidSetting(_))
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains(why), "{err}");
    }
    let t = SaveTensor {
        name: "a",
        dtype: Dtype::U8,
        shape: &[10],
        data: Piece::Host(&b),
    };
    let err = save(&saver, &[t, t], None, &path).unwrap_err();
    assert!(err.to_string().contains("twice"), "{err}");
    assert!(!path.exists());
    assert!(temporaries(dir.path()).is_empty());
    let err = saver
        .save_bytes(b"x", dir.path().join("missing/f.bin"))
        .unwrap_err();
    assert!(
        matches!(
            err,
            gpufeed::load::Error::Os(gpufeed::os::Error::NotFound { .. })
        ),
        "{err:?}"
    );
    let err = saver.save_bytes(b"x", dir.path()).unwrap_err();
    assert!(
        matches!(
            err,
            gpufeed::load::Error::Os(gpufeed::os::Error::IsDirectory { .. })
        ),
        "{err:?}"
    );
}

#[test]
fn a_full_file_system_is_a_clear_error_and_the_old_file_stays() {
    let tiny = match gpufeed_testkit::TestMount::tmpfs("2m") {
        Ok(t) => t,
        Err(why) => {
            gpufeed_testkit::skip_unless_root(
                "a_full_file_system_is_a_clear_error",
                &format!("cannot mount a tmpfs here ({why})"),
            );
            return;
        }
    };
    let path = tiny.path().join("ckpt.bin");
    let old = random_bytes(100_000, 1);
    std::fs::write(&path, &old).expect("old");
    let err = saver().save_bytes(&vec![7u8; 4 << 20], &path).unwrap_err();
    assert!(
        matches!(
            err,
            gpufeed::load::Error::Os(gpufeed::os::Error::NoSpace { .. })
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("left as it was"), "{err}");
    assert_eq!(std::fs::read(&path).expect("old"), old);
    assert!(
        temporaries(tiny.path()).is_empty(),
        "{:?}",
        temporaries(tiny.path())
    );
}

/// The version a crash-test checkpoint holds, from its metadata, with its data checked.
fn saved_version(path: &Path) -> Result<u64, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("read: {e}"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| format!("parse: {e:?}"))?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| format!("{e:?}"))?;
    let v: u64 = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("version"))
        .and_then(|v| v.parse().ok())
        .ok_or("no version")?;
    let data = st.tensor("data").map_err(|e| format!("{e:?}"))?;
    if data.data() != &version_data(v)[..] {
        return Err(format!("version {v}: data differs"));
    }
    Ok(v)
}

/// The crash test's tensor bytes for version `v` (sizes differ between versions).
fn version_data(v: u64) -> Vec<u8> {
    random_bytes((2 << 20) + 4096 * (v as usize % 5) + 13, v)
}

fn save_version(saver: &Saver, path: &Path, v: u64) {
    let data = version_data(v);
    let shape = [data.len()];
    let t = SaveTensor {
        name: "data",
        dtype: Dtype::U8,
        shape: &shape,
        data: Piece::Host(&data),
    };
    let meta = BTreeMap::from([("version".to_owned(), v.to_string())]);
    save(saver, &[t], Some(&meta), path).expect("save");
}

/// Child role: saves versions `GPUFEED_IT_FROM`, +1, ... of the checkpoint until killed.
#[test]
fn crash_saver_child() {
    if std::env::var(gpufeed_testkit::CHILD_ROLE).as_deref() != Ok("crash-saver") {
        return;
    }
    let path = std::path::PathBuf::from(std::env::var("GPUFEED_IT_PATH").expect("path"));
    let from: u64 = std::env::var("GPUFEED_IT_FROM")
        .expect("from")
        .parse()
        .expect("number");
    let saver = saver();
    std::fs::write(std::env::var("GPUFEED_IT_MARK").expect("mark"), b"").expect("mark");
    for v in from.. {
        save_version(&saver, &path, v);
    }
}

/// 60 saver processes killed with SIGKILL at random points of their saves: the target is
/// always a complete checkpoint of one saved version, and a later save removes every
/// temporary the killed ones left once it is old enough (`gpufeed_os::atomic::STALE_AFTER`).
#[test]
fn processes_killed_mid_save_never_leave_a_broken_checkpoint() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("ckpt.safetensors");
    let saver = saver();
    let t = std::time::Instant::now();
    save_version(&saver, &path, 0);
    // Kills land from the child's first save to about three saves later.
    let span_us = (3 * t.elapsed().as_micros() as u64).max(4_000);
    let mark = dir.path().join("started");
    let seed = gpufeed_testkit::seed("processes_killed_mid_save");
    let mut rng = seed;
    let mut last = 0;
    let mut mid_save = 0;
    let mut advanced = 0;
    for round in 0..60u64 {
        let from = 1000 * (round + 1);
        let mut child = gpufeed_testkit::child_command(
            "save::crash_saver_child",
            "crash-saver",
            &[
                ("GPUFEED_IT_PATH", path.display().to_string()),
                ("GPUFEED_IT_FROM", from.to_string()),
                ("GPUFEED_IT_MARK", mark.display().to_string()),
            ],
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // Wait until the child is about to save (its start-up varies with the machine's load).
        let waited = std::time::Instant::now();
        while !mark.exists() && waited.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_micros(200));
        }
        std::thread::sleep(Duration::from_micros((rng >> 33) % span_us));
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");
        let _ = std::fs::remove_file(&mark);
        let v = saved_version(&path).unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert!(
            v == last || v >= from,
            "round {round}: version {v} after {last}"
        );
        advanced += usize::from(v != last);
        last = v;
        mid_save += usize::from(!temporaries(dir.path()).is_empty());
    }
    eprintln!("{mid_save} of 60 kills left a temporary file behind; {advanced} saved a version");
    assert!(
        mid_save > 0,
        "no kill landed mid-save: the test did not test"
    );
    assert!(
        advanced > 0,
        "no child completed a save: the test did not test"
    );
    // Fresh temporaries of dead writers are kept (a writer on another host, or a slow one,
    // might still be at it): the next save removes them only once they are STALE_AFTER
    // old, here set an hour back: the file a private directory holds, or the directory where
    // it holds none (setting a directory's time changes its ctime, which reads as a rename).
    let left = temporaries(dir.path());
    let report = saver.save_bytes(b"again", &path).expect("save");
    assert!(report.cleaned.is_empty(), "{report:?}");
    assert_eq!(temporaries(dir.path()), left, "fresh temporaries removed");
    let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    for t in &left {
        let private = dir.path().join(t);
        let inside: Vec<_> = std::fs::read_dir(&private)
            .expect("ls")
            .flatten()
            .map(|e| e.path())
            .collect();
        for p in if inside.is_empty() {
            vec![private]
        } else {
            inside
        } {
            std::fs::File::open(&p)
                .and_then(|f| f.set_modified(hour_ago))
                .expect("mtime");
        }
    }
    let report = saver.save_bytes(b"final", &path).expect("final save");
    assert_eq!(report.cleaned.len(), left.len(), "{report:?}");
    assert!(
        temporaries(dir.path()).is_empty(),
        "{:?}",
        temporaries(dir.path())
    );
    assert_eq!(std::fs::read(&path).expect("read"), b"final");
}

#[test]
fn a_save_where_o_direct_is_refused_is_buffered_and_says_why() {
    let ramfs = match gpufeed_testkit::TestMount::ramfs() {
        Ok(m) => m,
        Err(why) => {
            gpufeed_testkit::skip_unless_root(
                "a_save_where_o_direct_is_refused",
                &format!("cannot mount a ramfs here ({why})"),
            );
            return;
        }
    };
    let data = random_bytes((3 << 20) + 11, 4);
    let path = ramfs.path().join("ckpt.bin");
    let report = saver().save_bytes(&data, &path).expect("save");
    assert_eq!(report.direct_bytes, 0);
    assert!(
        report
            .fallbacks
            .iter()
            .any(|f| f.refused == gpufeed::Refused::DirectIo),
        "{report:?}"
    );
    assert_eq!(
        xxh3_64(&std::fs::read(&path).expect("read")),
        xxh3_64(&data)
    );
}

/// Child role `tmp-swapper` (run as `nobody`): every name with `gpufeed-tmp-` in it in
/// GPUFEED_IT_DIR that is not a symlink is renamed aside and replaced by a symlink to
/// GPUFEED_IT_VICTIM, until killed.
#[test]
fn tmp_swapper_child() {
    if std::env::var(gpufeed_testkit::CHILD_ROLE).as_deref() != Ok("tmp-swapper") {
        return;
    }
    let dir = std::path::PathBuf::from(std::env::var("GPUFEED_IT_DIR").expect("dir"));
    let victim = std::path::PathBuf::from(std::env::var("GPUFEED_IT_VICTIM").expect("victim"));
    gpufeed_testkit::swap_temporaries_forever(&dir, &victim)
}

/// Root saves 2 MiB checkpoints (O_DIRECT where the file system takes it) 60 times into a
/// team directory (0777 and 2775, no sticky bit) while `nobody` swaps whatever temporary it
/// sees for a symlink to a file outside: that file is never written, and every save that
/// returns `Ok` leaves the target a regular file with exactly the saved bytes.
#[test]
fn another_user_swapping_the_temporary_never_redirects_a_save() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    const TEST: &str = "save::another_user_swapping_the_temporary_never_redirects_a_save";
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(TEST, &"needs root to run an attacker as nobody");
        return;
    }
    let saver = saver();
    for mode in [0o777, 0o2775] {
        let base = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
        std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let team = base.path().join("team");
        std::fs::create_dir(&team).expect("mkdir");
        rustix::fs::chown(&team, None, Some(rustix::fs::Gid::from_raw(65534))).expect("chgrp");
        std::fs::set_permissions(&team, std::fs::Permissions::from_mode(mode)).expect("chmod");
        let victim = base.path().join("victim.bin");
        let victim_bytes = random_bytes(20_000, 5);
        std::fs::write(&victim, &victim_bytes).expect("victim");
        let mut cmd = gpufeed_testkit::child_command(
            "save::tmp_swapper_child",
            "tmp-swapper",
            &[
                ("GPUFEED_IT_DIR", team.display().to_string()),
                ("GPUFEED_IT_VICTIM", victim.display().to_string()),
            ],
        );
        cmd.uid(65534)
            .gid(65534)
            .stdout(std::process::Stdio::piped());
        let mut attacker = gpufeed_testkit::KillOnDrop(cmd.spawn().expect("spawn the attacker"));
        let out = std::io::BufReader::new(attacker.0.stdout.take().expect("stdout"));
        assert!(
            std::io::BufRead::lines(out)
                .map_while(Result::ok)
                .any(|l| l.trim() == "READY"),
            "the attacker did not start"
        );
        let target = team.join("ckpt.bin");
        let (mut ok, mut direct) = (0, 0);
        for i in 0..60u64 {
            let data = random_bytes((2 << 20) + 4096 * (i as usize % 3) + 7, i);
            let saved = saver.save_bytes(&data, &target);
            assert!(
                std::fs::read(&victim).expect("victim") == victim_bytes,
                "{mode:o}: save {i} wrote into the file outside the directory"
            );
            if let Err(e) = &saved {
                eprintln!("{mode:o}: save {i} failed (allowed): {e}");
            }
            if let Ok(report) = saved {
                ok += 1;
                direct += usize::from(report.direct_bytes > 0);
                let meta = std::fs::symlink_metadata(&target).expect("lstat");
                assert!(
                    meta.file_type().is_file(),
                    "{mode:o}: save {i} returned Ok but the target is {:?}",
                    meta.file_type()
                );
                let back = std::fs::read(&target).expect("read");
                assert_eq!(xxh3_64(&back), xxh3_64(&data), "{mode:o}: save {i}");
            }
        }
        drop(attacker);
        let moved = std::fs::read_dir(&team)
            .expect("ls")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().contains(".moved"))
            .count();
        eprintln!(
            "{mode:o}: {ok} of 60 saves succeeded ({direct} with O_DIRECT); {moved} names swapped"
        );
        assert!(ok > 0, "{mode:o}: no save succeeded: the test did not test");
        assert!(
            moved > 0,
            "{mode:o}: the attacker swapped nothing: the test did not test"
        );
    }
}

/// A save keeps the mode of the file it replaces (0600 stays 0600, 0640 stays 0640).
#[test]
fn a_save_keeps_the_mode_of_the_file_it_replaces() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let saver = saver();
    for mode in [0o600, 0o640] {
        let path = dir.path().join(format!("m{mode:o}.bin"));
        std::fs::write(&path, b"old").expect("old");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        saver
            .save_bytes(&random_bytes(5000, 1), &path)
            .expect("save");
        let got = std::fs::metadata(&path).expect("stat").mode() & 0o7777;
        assert_eq!(got, mode, "saved over a {mode:o} file");
    }
    // A name of NAME_MAX bytes saves too (the temporary's name does not grow with it).
    let path = dir.path().join("x".repeat(255));
    saver
        .save_bytes(b"long name", &path)
        .expect("a 255-byte name");
    assert_eq!(std::fs::read(&path).expect("read"), b"long name");
}

/// The writer opens the temporary twice through `AtomicFile::path()` (`/proc/self/fd/<n>`):
/// buffered, then with `O_DIRECT`. Where `/proc/self/fd` is not procfs (here a tmpfs mounted
/// over it in a private mount namespace, whose entries flip between a link to the real
/// descriptor and a file outside) the second open can reach another file than the first: the
/// save checks both descriptors, so the file outside is never written, and a save that
/// returns `Ok` holds exactly its bytes.
#[test]
fn a_writer_descriptor_that_is_another_file_is_refused() {
    const TEST: &str = "save::a_writer_descriptor_that_is_another_file_is_refused";
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(TEST, &"needs root to mount a tmpfs over /proc/self/fd");
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let inner = gpufeed_testkit::child_command(
        "save::direct_swap_child",
        "direct-swap",
        &[("GPUFEED_IT_DIR", dir.path().display().to_string())],
    );
    // The shell mounts the tmpfs over its own /proc/<pid>/fd, then execs the child, which
    // keeps the pid.
    let mut cmd = gpufeed_testkit::wrapped(
        &[
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            "mount -t tmpfs fds /proc/$$/fd && exec \"$0\" \"$@\"",
        ],
        &inner,
    );
    let out = cmd.output().expect("spawn unshare");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if let Some(why) = stdout.lines().find_map(|l| l.strip_prefix("NO-DIRECT ")) {
        gpufeed_testkit::skip(TEST, &why);
        return;
    }
    assert!(
        out.status.success() && stdout.contains("DIRECT-SWAP-OK"),
        "{TEST} ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
}

/// Child role `direct-swap`: run with a tmpfs over its /proc/<pid>/fd; saves into
/// GPUFEED_IT_DIR while a thread flips each entry `<n>` of that tmpfs between a link to
/// `/proc/<pid>/task/<pid>/fd/<n>` (the real descriptor) and a link to a file outside.
#[test]
fn direct_swap_child() {
    use gpufeed::load::Error;
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    if std::env::var(gpufeed_testkit::CHILD_ROLE).as_deref() != Ok("direct-swap") {
        return;
    }
    let dir = std::path::PathBuf::from(std::env::var("GPUFEED_IT_DIR").expect("dir"));
    let pid = std::process::id();
    let fds = std::path::PathBuf::from(format!("/proc/{pid}/fd"));
    assert!(
        std::fs::read_link(fds.join("0")).is_err(),
        "/proc/self/fd is procfs: the test does not test"
    );
    let victim = dir.join("victim.bin");
    let victim_bytes = random_bytes(4 << 20, 77);
    std::fs::write(&victim, &victim_bytes).expect("victim");
    let target = dir.join("ckpt.bin");
    let saver = Saver::host(SaveOptions::default().with_window_bytes(4 << 20)).expect("saver");
    // A save uses the lowest free descriptors: a few from here.
    let low = std::fs::File::open("/dev/null").expect("open").as_raw_fd();
    let range = low..low + 10;
    for n in range.clone() {
        std::os::unix::fs::symlink(
            format!("/proc/{pid}/task/{pid}/fd/{n}"),
            fds.join(n.to_string()),
        )
        .expect("symlink");
        std::os::unix::fs::symlink(&victim, fds.join(format!("{n}.alt"))).expect("symlink");
    }
    // A first save with every entry linked to the real descriptor: does O_DIRECT run here?
    let first = saver.save_bytes(&random_bytes((2 << 20) + 7, 1), &target);
    match &first {
        Ok(r) if r.direct_bytes > 0 => {}
        Ok(r) => {
            println!("NO-DIRECT O_DIRECT not used here: {:?}", r.fallbacks);
            return;
        }
        Err(e) => panic!("the first save (no flips yet) failed: {e}"),
    }
    let stop = AtomicBool::new(false);
    let (mut ok, mut direct_refused, mut other) = (0, 0, 0);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                for n in range.clone() {
                    let _ = rustix::fs::renameat_with(
                        rustix::fs::CWD,
                        fds.join(n.to_string()),
                        rustix::fs::CWD,
                        fds.join(format!("{n}.alt")),
                        rustix::fs::RenameFlags::EXCHANGE,
                    );
                }
            }
        });
        let started = std::time::Instant::now();
        let mut i = 0u64;
        while direct_refused < 3 && started.elapsed() < Duration::from_secs(60) {
            i += 1;
            let data = random_bytes((2 << 20) + 7, 100 + i);
            let saved = saver.save_bytes(&data, &target);
            let now = std::fs::read(&victim).expect("read the victim");
            if now != victim_bytes {
                stop.store(true, Ordering::Relaxed);
                panic!(
                    "save {i} ({:?}) wrote into the file outside through its O_DIRECT \
                     descriptor",
                    saved.as_ref().map(|r| r.direct_bytes)
                );
            }
            match saved {
                Ok(_) => {
                    ok += 1;
                    let back = std::fs::read(&target).expect("read");
                    assert!(back == data, "save {i} returned Ok with other bytes");
                }
                Err(Error::Os(gpufeed::os::Error::UnsafeTemporary { reason, .. }))
                    if reason.contains("O_DIRECT") =>
                {
                    direct_refused += 1;
                }
                Err(_) => other += 1,
            }
        }
        stop.store(true, Ordering::Relaxed);
        eprintln!(
            "{i} saves: {ok} ok, {direct_refused} refused for the O_DIRECT descriptor, \
             {other} failed otherwise"
        );
    });
    assert!(
        direct_refused > 0,
        "the flips never split the two opens: the test did not test"
    );
    println!("DIRECT-SWAP-OK");
}
