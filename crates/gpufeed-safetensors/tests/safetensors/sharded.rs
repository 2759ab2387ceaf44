//! Sharded checkpoints as a whole: a save stopped between shards (a full disk, SIGKILL) leaves
//! the old checkpoint, and a set of shards of different saves is refused, never loaded.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpufeed_load::{Piece, SaveOptions, Saver};
use gpufeed_safetensors::Error;
use gpufeed_safetensors::{Dtype, FILE_SIZES_KEY, SAVE_ID_KEY, SaveTensor, inspect, save_sharded};
use xxhash_rust::xxh3::xxh3_64;

fn saver() -> Saver {
    Saver::host(SaveOptions::default().with_window_bytes(1 << 20)).expect("host saver")
}

/// A version of a checkpoint of two tensors, `a` and `b`, of the given sizes: random bytes
/// seeded by the version, at unaligned sizes.
struct Version {
    a: Vec<u8>,
    b: Vec<u8>,
    shapes: [[usize; 1]; 2],
}

impl Version {
    fn new(v: u64, a_bytes: usize, b_bytes: usize) -> Self {
        Version {
            a: crate::random_bytes(a_bytes, 2 * v + 1),
            b: crate::random_bytes(b_bytes, 2 * v + 2),
            shapes: [[a_bytes], [b_bytes]],
        }
    }

    fn tensors(&self) -> [SaveTensor<'_>; 2] {
        [
            SaveTensor {
                name: "a",
                dtype: Dtype::U8,
                shape: &self.shapes[0],
                data: Piece::Host(&self.a),
            },
            SaveTensor {
                name: "b",
                dtype: Dtype::U8,
                shape: &self.shapes[1],
                data: Piece::Host(&self.b),
            },
        ]
    }

    /// Saves it as two shards (one tensor each) of `prefix` "model" in `dir`.
    fn save(&self, saver: &Saver, dir: &Path) -> gpufeed_safetensors::Result<()> {
        let max = self.a.len().max(self.b.len()) as u64;
        save_sharded(saver, &self.tensors(), None, dir, "model", max).map(|r| {
            assert_eq!(r.len(), 2, "one shard per tensor");
        })
    }

    fn hashes(&self) -> BTreeMap<String, u64> {
        BTreeMap::from([
            ("a".to_owned(), xxh3_64(&self.a)),
            ("b".to_owned(), xxh3_64(&self.b)),
        ])
    }
}

fn index_of(dir: &Path) -> PathBuf {
    dir.join("model.safetensors.index.json")
}

/// Every tensor of the checkpoint `index` as read from its files (after the checks of
/// [`inspect`], which every load makes): name -> xxh3 of its bytes.
fn read_checkpoint(index: &Path) -> gpufeed_safetensors::Result<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    for file in inspect(index)? {
        let bytes = std::fs::read(&file.path).expect("read a shard");
        let start = file.data_start as usize;
        for gpufeed_safetensors::HeaderEntry { name, range, .. } in file.tensors.iter() {
            out.insert(
                name.clone(),
                xxh3_64(&bytes[start + range.start..start + range.end]),
            );
        }
    }
    Ok(out)
}

/// Which of `versions` the checkpoint in `dir` holds whole; panics naming the mix otherwise.
fn version_held(dir: &Path, versions: &[&Version]) -> usize {
    let got = read_checkpoint(&index_of(dir)).expect("the checkpoint reads");
    versions
        .iter()
        .position(|v| v.hashes() == got)
        .unwrap_or_else(|| {
            let of = |name: &str| {
                versions
                    .iter()
                    .position(|v| v.hashes().get(name) == got.get(name))
                    .map_or("none".to_owned(), |i| format!("version {i}"))
            };
            panic!(
                "the checkpoint mixes versions: a is of {}, b of {}",
                of("a"),
                of("b")
            )
        })
}

/// The `.safetensors` files in `dir` (not temporaries) with their inodes.
fn shard_files(dir: &Path) -> BTreeMap<String, u64> {
    std::fs::read_dir(dir)
        .expect("ls")
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            (name.ends_with(".safetensors") && !name.starts_with('.'))
                .then(|| Some((name, e.metadata().ok()?.ino())))?
        })
        .collect()
}

/// A second save whose second shard does not fit on the file system: the save fails with
/// ENOSPC, and the checkpoint is still the first save, whole (before, the new first shard had
/// replaced the old one under its name and the old index loaded the mix without an error).
#[test]
fn a_sharded_save_that_runs_out_of_space_leaves_the_old_checkpoint() {
    let test = "a_sharded_save_that_runs_out_of_space_leaves_the_old_checkpoint";
    let mount = match gpufeed_testkit::TestMount::tmpfs("12m") {
        Ok(m) => m,
        Err(why) => return gpufeed_testkit::skip_unless_root(test, &why),
    };
    let dir = mount.path();
    let saver = saver();
    const MIB: usize = 1 << 20;
    // 6 MiB of old shards, then two new shards of 5 MiB: the first fits beside them, the
    // second does not.
    let v1 = Version::new(1, 3 * MIB - 7, 3 * MIB - 5);
    let v2 = Version::new(2, 5 * MIB - 3, 5 * MIB - 1);
    v1.save(&saver, dir).expect("the first save fits");
    let before = shard_files(dir);
    let err = v2
        .save(&saver, dir)
        .expect_err("the second save cannot fit");
    assert!(
        matches!(
            err,
            Error::Load(gpufeed_load::Error::Os(gpufeed_os::Error::NoSpace { .. }))
        ),
        "{err:?}"
    );
    assert_eq!(version_held(dir, &[&v1, &v2]), 0, "the old checkpoint");
    assert_eq!(
        shard_files(dir),
        before,
        "the failed save removed the shard it wrote, and only that"
    );
}

/// Child role: saves version `GPUFEED_IT_VERSION` of the checkpoint in `GPUFEED_IT_DIR` again
/// and again until killed.
#[test]
fn sharded_saver_child() {
    if std::env::var(gpufeed_testkit::CHILD_ROLE).as_deref() != Ok("sharded-saver") {
        return;
    }
    let dir = PathBuf::from(std::env::var("GPUFEED_IT_DIR").expect("dir"));
    let v: u64 = std::env::var("GPUFEED_IT_VERSION")
        .expect("version")
        .parse()
        .expect("a number");
    let version = big_version(v);
    let saver = saver();
    loop {
        version.save(&saver, &dir).expect("save");
    }
}

/// A small first shard and a large second one, so that a save spends most of its time on the
/// second.
fn big_version(v: u64) -> Version {
    Version::new(v, (1 << 20) + 13, (64 << 20) + 7)
}

/// A saver process SIGKILLed as soon as its first new shard is in place, while the second is
/// being written: the checkpoint is always one version, whole; the next save removes what the
/// killed one left.
#[test]
fn a_sharded_save_killed_between_shards_leaves_one_version() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let saver = saver();
    let versions: Vec<Version> = (0..4).map(big_version).collect();
    let all: Vec<&Version> = versions.iter().collect();
    versions[0].save(&saver, dir.path()).expect("first save");
    let mut held = 0;
    let mut killed_mid_save = 0;
    for (round, v) in (1..versions.len()).enumerate() {
        let before = shard_files(dir.path());
        let mut child = gpufeed_testkit::child_command(
            "sharded::sharded_saver_child",
            "sharded-saver",
            &[
                ("GPUFEED_IT_DIR", dir.path().display().to_string()),
                ("GPUFEED_IT_VERSION", v.to_string()),
            ],
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
        // The first new shard appears whole (by rename) under a name of its own or over an old
        // one (a new inode): kill the saver then, while it writes the second.
        let waited = Instant::now();
        loop {
            let now = shard_files(dir.path());
            if now.iter().any(|(name, ino)| before.get(name) != Some(ino)) {
                break;
            }
            assert!(
                waited.elapsed() < Duration::from_secs(60),
                "round {round}: the saver wrote no shard in 60 s"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");
        let now = version_held(dir.path(), &all);
        killed_mid_save += usize::from(now == held);
        assert!(
            now == held || now == v,
            "round {round}: version {now} after {held}"
        );
        held = now;
    }
    assert!(
        killed_mid_save > 0,
        "no kill landed between the shards: the test did not test"
    );
    // A completed save removes the killed saves' shards: only its own two remain.
    versions[0].save(&saver, dir.path()).expect("save again");
    assert_eq!(version_held(dir.path(), &all), 0);
    assert_eq!(
        shard_files(dir.path()).len(),
        2,
        "{:?}",
        shard_files(dir.path())
    );
}

/// Shards of two saves under one index (a file copied over from another save of the same
/// shapes) are refused naming the file, with or without the save's id in the index; the old
/// shards of a save that is replaced are removed.
#[test]
fn shards_of_different_saves_are_refused_naming_the_files() {
    let saver = saver();
    let (one, two) = (
        tempfile::tempdir().expect("tmp"),
        tempfile::tempdir().expect("tmp"),
    );
    let (v1, v2) = (Version::new(1, 4099, 8191), Version::new(2, 4099, 8191));
    v1.save(&saver, one.path()).expect("save");
    v2.save(&saver, two.path()).expect("save");
    let files = shard_files(one.path());
    assert_eq!(
        files,
        {
            let mut names = shard_files(two.path());
            names
                .values_mut()
                .zip(files.values())
                .for_each(|(a, b)| *a = *b);
            names
        },
        "fresh directories: the same plain shard names"
    );
    let second = files.keys().nth(1).expect("two shards").clone();
    std::fs::copy(two.path().join(&second), one.path().join(&second)).expect("copy");
    let index = index_of(one.path());
    match read_checkpoint(&index) {
        Err(Error::MixedCheckpoint {
            index: i, files, ..
        }) => {
            assert_eq!(i, index);
            assert_eq!(files.len(), 1, "{files:?}");
            assert_eq!(files[0].0, one.path().join(&second));
        }
        other => panic!("a mixed checkpoint was not refused: {other:?}"),
    }
    // An index without gpufeed's record (as another tool writes it): the shards' own ids still
    // disagree.
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index).expect("read")).expect("json");
    let meta = json["metadata"].as_object_mut().expect("metadata");
    assert!(meta.remove(SAVE_ID_KEY).is_some() && meta.remove(FILE_SIZES_KEY).is_some());
    std::fs::write(&index, serde_json::to_vec(&json).expect("json")).expect("write");
    assert!(
        matches!(read_checkpoint(&index), Err(Error::MixedCheckpoint { .. })),
        "shards of two saves under an index of another tool"
    );
    // The next save of the checkpoint replaces it whole and removes the shards it replaced.
    v2.save(&saver, one.path()).expect("save over it");
    assert_eq!(version_held(one.path(), &[&v1, &v2]), 1);
    let after = shard_files(one.path());
    assert_eq!(after.len(), 2, "{after:?}");
    assert!(
        after.keys().all(|n| !files.contains_key(n)),
        "new names, the old shards removed: {after:?}"
    );
}

/// A save removes the shards the old index named and what stopped saves of its own prefix
/// left, nothing else: not another checkpoint whose prefix looks like `<prefix>-<id>`, not a
/// shard-named file that gpufeed did not write, not a file that is no shard named by the old
/// index.
#[test]
fn a_save_removes_only_what_earlier_saves_of_its_prefix_left() {
    let saver = saver();
    let dir = tempfile::tempdir().expect("tmp");
    let v = |n| Version::new(n, 4096 + 3, 4096 + 5);
    let (v1, v2, other) = (v(1), v(2), v(3));
    let max = 4096 + 5;
    save_sharded(
        &saver,
        &other.tensors(),
        None,
        dir.path(),
        "model-0123456789abcdef",
        max,
    )
    .expect("another checkpoint");
    // A file named like a shard that no save of "model" wrote (no save id in its header).
    let plain = safetensors::serialize(
        [(
            "x",
            safetensors::tensor::TensorView::new(Dtype::U8, vec![3], &[1, 2, 3]).expect("view"),
        )],
        None,
    )
    .expect("serialize");
    let unwritten = dir.path().join("model-00008-of-00009.safetensors");
    std::fs::write(&unwritten, plain).expect("write");
    // An index (written by anyone who may write the directory) naming a file that is no
    // safetensors shard: the save replaces the index but never removes that file.
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, b"not a shard").expect("write");
    std::fs::write(
        index_of(dir.path()),
        br#"{"metadata": {}, "weight_map": {"x": "notes.txt"}}"#,
    )
    .expect("write");
    let others_before = shard_files(dir.path());
    v1.save(&saver, dir.path()).expect("save");
    assert!(
        notes.exists(),
        "a file the old index named but no shard was removed"
    );
    v2.save(&saver, dir.path()).expect("save");
    let now = shard_files(dir.path());
    assert_eq!(version_held(dir.path(), &[&v1, &v2]), 1);
    for name in others_before.keys() {
        assert!(now.contains_key(name), "{name} was removed: {now:?}");
    }
    assert_eq!(now.len(), others_before.len() + 2, "{now:?}");
}

/// Two sharded saves of one prefix at once (ranks saving without a rank-0 guard, an
/// asynchronous checkpoint overlapping the last): they run one after the other and the
/// checkpoint is one of them, whole (before, each save's cleanup removed the other's new
/// shards: both returned `Ok` and the index named files that were gone).
#[test]
fn overlapping_sharded_saves_of_one_prefix_leave_one_whole_checkpoint() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let saver = saver();
    let first = Version::new(0, 4099, 4101);
    first.save(&saver, dir.path()).expect("first save");
    // B: many shards, slow; A: two small shards, started while B writes.
    let b_tensors: Vec<Vec<u8>> = (0..12)
        .map(|i| crate::random_bytes((8 << 20) + i, 100 + i as u64))
        .collect();
    let b_shapes: Vec<[usize; 1]> = b_tensors.iter().map(|t| [t.len()]).collect();
    let names: Vec<String> = (0..12).map(|i| format!("t{i:02}")).collect();
    let a = Version::new(1, 4099, 4101);
    let b_hashes: BTreeMap<String, u64> = names
        .iter()
        .zip(&b_tensors)
        .map(|(n, t)| (n.clone(), xxh3_64(t)))
        .collect();
    std::thread::scope(|scope| {
        let b = scope.spawn(|| {
            let tensors: Vec<SaveTensor<'_>> = names
                .iter()
                .zip(&b_tensors)
                .zip(&b_shapes)
                .map(|((n, t), s)| SaveTensor {
                    name: n,
                    dtype: Dtype::U8,
                    shape: s,
                    data: Piece::Host(t),
                })
                .collect();
            save_sharded(&saver, &tensors, None, dir.path(), "model", 8 << 20).map(|_| ())
        });
        std::thread::sleep(Duration::from_millis(30));
        let a_done = a.save(&saver, dir.path());
        b.join().expect("B's thread").expect("save B");
        a_done.expect("save A");
    });
    let got = read_checkpoint(&index_of(dir.path())).expect("the checkpoint reads whole");
    assert!(
        got == a.hashes() || got == b_hashes,
        "neither save whole: {:?}",
        got.keys().collect::<Vec<_>>()
    );
    // Only the last save's shards remain.
    assert_eq!(
        shard_files(dir.path()).len(),
        got.len(),
        "{:?}",
        shard_files(dir.path())
    );
}

/// A tensor in two shards of an index (which maps it to one of them) is refused, naming both
/// shards: neither copy is taken for the other.
#[test]
fn a_tensor_in_two_shards_is_refused_naming_both() {
    let dir = tempfile::tempdir().expect("tmp");
    let (one, _) = crate::file(&[("a", safetensors::Dtype::F32, vec![5])], 1, None);
    let (two, _) = crate::file(
        &[
            ("b", safetensors::Dtype::F32, vec![3]),
            ("a", safetensors::Dtype::F32, vec![5]),
        ],
        2,
        None,
    );
    std::fs::write(dir.path().join("s1.safetensors"), one).expect("write");
    std::fs::write(dir.path().join("s2.safetensors"), two).expect("write");
    let index = dir.path().join("m.safetensors.index.json");
    let map = serde_json::json!({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}});
    std::fs::write(&index, map.to_string()).expect("write");
    match inspect(&index) {
        Err(Error::Index { reason, .. }) => assert!(
            reason.contains("tensor a is in two shards")
                && reason.contains("s1.safetensors")
                && reason.contains("s2.safetensors"),
            "{reason}"
        ),
        other => panic!("a tensor in two shards was not refused: {other:?}"),
    }
    // Without the second copy the same index opens.
    let (two, _) = crate::file(&[("b", safetensors::Dtype::F32, vec![3])], 2, None);
    std::fs::write(dir.path().join("s2.safetensors"), two).expect("write");
    assert_eq!(inspect(&index).expect("one copy each").len(), 2);
}
