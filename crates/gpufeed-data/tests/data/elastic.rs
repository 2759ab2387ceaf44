//! An elastic training run killed mid-epoch and resumed with another world size: a real child
//! process runs two ranks' loaders in lockstep, checks every record's bytes against the file,
//! logs each step's records and saves its `Position` (JSON, renamed into place) after each
//! step; the test kills it with SIGKILL, then resumes the epoch here with three ranks and
//! four. Together the steps the saved position counts and the resumed ones hold every record
//! of the epoch once.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use gpufeed_data::{
    BatchData, BatchLoader, BatchLoaderOptions, Order, Position, RecordFile, Sampler,
};

use crate::random_bytes;

const DISPATCHER: &str = "elastic::child_dispatcher";
const RECORD: usize = 1009;
const RECORDS: usize = 2400;
const GLOBAL: usize = 24;
const ORDER: Order = Order::Shuffled { seed: 5 };

fn loader(path: &Path, rank: usize, world: usize) -> BatchLoader {
    // SAFETY: the test's record file is never changed.
    let records = unsafe { RecordFile::open_fixed(path, RECORD) }.expect("records");
    let sampler = Sampler::elastic(ORDER, GLOBAL, rank, world, true).expect("sampler");
    BatchLoader::new(
        records,
        sampler,
        BatchLoaderOptions::default().with_workers(2),
        None,
    )
    .expect("loader")
}

/// The records of a batch, each checked against the file's bytes (read apart from the
/// loader's mapping).
fn checked(batch: &gpufeed_data::Batch, file: &[u8]) -> Vec<usize> {
    let BatchData::Host(buf) = &batch.data else {
        panic!("host batches without a GPU");
    };
    for (k, &i) in batch.indices.iter().enumerate() {
        let got = &buf[batch.offsets[k]..batch.offsets[k + 1]];
        let want = &file[i * RECORD..(i + 1) * RECORD];
        assert_eq!(
            xxhash_rust::xxh3::xxh3_64(got),
            xxhash_rust::xxh3::xxh3_64(want),
            "record {i}"
        );
    }
    batch.indices.clone()
}

#[test]
fn a_killed_run_resumes_with_another_world_size() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("records.bin");
    let file = random_bytes(RECORDS * RECORD, 31);
    std::fs::write(&path, &file).expect("write");
    let mut child = gpufeed_testkit::child_command(
        DISPATCHER,
        "elastic-train",
        &[("GPUFEED_IT_DIR", dir.path().display().to_string())],
    )
    .spawn()
    .expect("spawn the training process");
    // Kill it once it has saved a few positions, well before the epoch's 100 steps end.
    let pos_path = dir.path().join("position.json");
    let deadline = Instant::now() + Duration::from_secs(60);
    let saved = loop {
        assert!(
            Instant::now() < deadline,
            "the child saved no position in 60 s"
        );
        if let Ok(text) = std::fs::read_to_string(&pos_path) {
            let at: Position = serde_json::from_str(&text).expect("a whole position");
            if at.samples >= 10 * GLOBAL as u64 {
                break at;
            }
        }
        assert!(
            child.try_wait().expect("wait").is_none(),
            "the child ended early"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
    // What the killed run consumed: the steps its last saved position counts (a step logged
    // after it, not yet saved, is done again, as a training run restarted from its
    // checkpoint does).
    let at: Position = serde_json::from_str(&std::fs::read_to_string(&pos_path).expect("read"))
        .expect("a whole position");
    assert!(at.samples >= saved.samples && at.epoch == 0, "{at:?}");
    assert!(
        at.samples < (RECORDS / GLOBAL * GLOBAL) as u64,
        "killed mid-epoch: {at:?}"
    );
    let steps = (at.samples / GLOBAL as u64) as usize;
    let log = std::fs::read_to_string(dir.path().join("steps.log")).expect("log");
    let before: Vec<usize> = log
        .lines()
        .take(steps)
        .flat_map(|l| l.split(' ').map(|x| x.parse::<usize>().expect("index")))
        .collect();
    assert_eq!(
        before.len(),
        steps * GLOBAL,
        "the log holds every saved step"
    );

    for world in [3, 4] {
        let mut rest = Vec::new();
        for rank in 0..world {
            let mut l = loader(&path, rank, world);
            let mut epoch = l.resume(&at).expect("resume");
            let mut first = None;
            for b in epoch.by_ref() {
                let b = b.expect("batch");
                first.get_or_insert(b.number);
                assert_eq!(b.indices.len(), GLOBAL / world);
                rest.extend(checked(&b, &file));
            }
            assert_eq!(first, Some(steps), "numbering goes on from the saved step");
            assert_eq!(
                epoch.position().expect("elastic"),
                Position {
                    epoch: 1,
                    samples: 0,
                    ..at
                },
                "after the last batch: the next epoch"
            );
        }
        let mut all = before.clone();
        all.extend(&rest);
        let len = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), len, "world {world}: a record seen twice");
        assert_eq!(
            len,
            RECORDS / GLOBAL * GLOBAL,
            "world {world}: records missing"
        );
    }
    // A position of another data set or seed is refused, saying why.
    let mut l = loader(&path, 0, 2);
    let err = l
        .resume(&Position { records: 7, ..at })
        .map(|_| ())
        .unwrap_err();
    assert!(err.to_string().contains("7 records"), "{err}");
    let err = l
        .resume(&Position {
            order: Order::Shuffled { seed: 6 },
            ..at
        })
        .map(|_| ())
        .unwrap_err();
    assert!(err.to_string().contains("order"), "{err}");
}

/// Runs only as the child of the test above (returns at once otherwise): a training loop of
/// two ranks in lockstep that logs and saves its position after every step, slowly.
#[test]
fn child_dispatcher() {
    if std::env::var(gpufeed_testkit::CHILD_ROLE).as_deref() != Ok("elastic-train") {
        return;
    }
    let dir = std::path::PathBuf::from(std::env::var("GPUFEED_IT_DIR").expect("dir"));
    let path = dir.join("records.bin");
    let file = std::fs::read(&path).expect("read");
    let mut log = std::fs::File::create(dir.join("steps.log")).expect("log");
    let (mut l0, mut l1) = (loader(&path, 0, 2), loader(&path, 1, 2));
    let (mut e0, mut e1) = (l0.epoch(0).expect("epoch"), l1.epoch(0).expect("epoch"));
    while let (Some(a), Some(b)) = (e0.next(), e1.next()) {
        let mut step = checked(&a.expect("batch"), &file);
        step.extend(checked(&b.expect("batch"), &file));
        let line: Vec<String> = step.iter().map(ToString::to_string).collect();
        writeln!(log, "{}", line.join(" ")).expect("log");
        log.sync_data().expect("sync");
        let at = e0.position().expect("elastic");
        assert_eq!(Some(at), e1.position(), "the ranks agree");
        let tmp = dir.join("position.json.tmp");
        std::fs::write(&tmp, serde_json::to_string(&at).expect("json")).expect("write");
        std::fs::rename(&tmp, dir.join("position.json")).expect("rename");
        // Slow enough (100 steps: 4 s) that the parent kills it mid-epoch on a loaded machine.
        std::thread::sleep(Duration::from_millis(40));
    }
    panic!("the epoch ended before the test killed this process");
}
