//! `Prefetch` on a GPU: ranges at odd offsets of random data land byte for byte at their
//! alignment, in readiness order and when taken out of order; each is handed out once; close
//! stops it; following mode loads only what is asked and what follows it.

use std::sync::Arc;

use gpufeed_load::{LoadOptions, Loader};
use gpufeed_os::OpenedFile;
use gpufeed_safetensors::{Error, Prefetch, PrefetchItem, PrefetchOptions};

use crate::{gpu_or_skip, random_bytes};

fn items(len: u64) -> Vec<PrefetchItem> {
    // Odd sizes, odd starts, every alignment, an empty one and one larger than a chunk.
    let mut out = Vec::new();
    let mut at = 13u64;
    for (k, size) in [1u64, 4095, 77, 0, 1 << 20, 3 << 20, 5, 8191]
        .iter()
        .cycle()
        .take(40)
        .enumerate()
    {
        if at + size > len {
            break;
        }
        out.push(PrefetchItem {
            span: at..at + size,
            align: [1usize, 2, 4, 8, 16][k % 5],
        });
        at += size + (k as u64 % 3);
    }
    out
}

fn check(
    gpu: &gpufeed_load::Gpu,
    data: &[u8],
    item: &PrefetchItem,
    piece: &gpufeed_safetensors::Piece,
) {
    assert_eq!(
        piece.offset % item.align,
        0,
        "offset {} for align {}",
        piece.offset,
        item.align
    );
    assert_eq!(piece.len as u64, item.span.end - item.span.start);
    let all = gpu.to_vec(&piece.buffer).expect("copy back");
    let want = &data[item.span.start as usize..item.span.end as usize];
    let got = &all[piece.offset..piece.offset + piece.len];
    assert_eq!(
        xxhash_rust::xxh3::xxh3_64(got),
        xxhash_rust::xxh3::xxh3_64(want),
        "{:?}",
        item.span
    );
}

#[test]
fn ranges_land_byte_for_byte_at_their_alignment_once_each() {
    let Some(gpu) = gpu_or_skip("ranges_land_byte_for_byte_at_their_alignment_once_each") else {
        return;
    };
    // A transfer per chunk, then runs of chunks in one transfer (each chunk handed out as it
    // lands), of up to three and a half chunks.
    for run_bytes in [0, 7 << 20] {
        ranges_land_once_each(&gpu, run_bytes);
    }
}

fn ranges_land_once_each(gpu: &gpufeed_load::Gpu, run_bytes: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("data.bin");
    let data = random_bytes((19 << 20) + 333, 38);
    std::fs::write(&path, &data).expect("write");
    let loader = Arc::new(Loader::new(gpu, LoadOptions::default()).expect("loader"));
    let items = items(data.len() as u64);
    assert!(items.len() > 20, "{} items", items.len());

    // Readiness order, small chunks: every item once.
    let opts = PrefetchOptions::default()
        .with_chunk_bytes(2 << 20)
        .with_run_bytes(run_bytes);
    let p = Prefetch::start(
        Arc::clone(&loader),
        OpenedFile::open(&path).expect("open"),
        items.clone(),
        opts.clone(),
    )
    .expect("start");
    let mut seen = vec![false; items.len()];
    while let Some((i, piece)) = p.next_ready().expect("ready") {
        assert!(!seen[i], "item {i} twice");
        seen[i] = true;
        check(gpu, &data, &items[i], &piece);
    }
    assert!(seen.iter().all(|&s| s), "every item handed out");
    assert!(
        matches!(p.take(0), Err(Error::Prefetch { .. })),
        "taken twice"
    );

    // Out of order by take: the last first; then close mid-stream.
    let p = Prefetch::start(
        Arc::clone(&loader),
        OpenedFile::open(&path).expect("open"),
        items.clone(),
        opts.clone(),
    )
    .expect("start");
    for i in [items.len() - 1, 0, items.len() / 2] {
        let piece = p.take(i).expect("take");
        check(gpu, &data, &items[i], &piece);
    }
    let kept = p.take(1).expect("take");
    p.close();
    let err = p.take(2).expect_err("after close");
    assert!(err.to_string().contains("closed"), "{err}");
    check(gpu, &data, &items[1], &kept);

    // Following: nothing loads until asked; a sweep in order gets each item.
    let follow = opts
        .clone()
        .with_follow_from(Some(64 << 10))
        .with_ahead_bytes(Some(4 << 20));
    let p = Prefetch::start(
        Arc::clone(&loader),
        OpenedFile::open(&path).expect("open"),
        items.clone(),
        follow,
    )
    .expect("start");
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(
        p.try_next_ready().is_none(),
        "following: nothing loaded before an ask"
    );
    for (i, item) in items.iter().enumerate() {
        let piece = p.take(i).expect("take in order");
        check(gpu, &data, item, &piece);
    }
    // Following, drained by next_ready alone (nothing is asked: it asks for the first
    // pending item itself), each item once.
    let follow = opts
        .with_follow_from(Some(64 << 10))
        .with_ahead_bytes(Some(4 << 20));
    let p = Prefetch::start(
        loader,
        OpenedFile::open(&path).expect("open"),
        items.clone(),
        follow,
    )
    .expect("start");
    let mut seen = vec![false; items.len()];
    while let Some((i, piece)) = p.next_ready().expect("ready") {
        assert!(!seen[i], "item {i} twice");
        seen[i] = true;
        check(gpu, &data, &items[i], &piece);
    }
    assert!(
        seen.iter().all(|&s| s),
        "following, next_ready hands out every item"
    );
}

#[test]
fn a_file_written_during_a_prefetch_is_an_error_naming_it() {
    let Some(gpu) = gpu_or_skip("a_file_written_during_a_prefetch_is_an_error_naming_it") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("data.bin");
    let data = random_bytes(8 << 20, 39);
    std::fs::write(&path, &data).expect("write");
    let loader = Arc::new(Loader::new(&gpu, LoadOptions::default()).expect("loader"));
    let items: Vec<PrefetchItem> = (0..8)
        .map(|k| PrefetchItem {
            span: k << 20..(k + 1) << 20,
            align: 1,
        })
        .collect();
    // A transfer per chunk (1 MiB ahead at most), then runs of up to four chunks.
    for (run_bytes, ahead) in [(0, 1 << 20), (4 << 20, 8 << 20)] {
        std::fs::write(&path, &data).expect("write");
        written_during(&gpu, &loader, &path, &data, &items, run_bytes, ahead);
    }
}

fn written_during(
    gpu: &gpufeed_load::Gpu,
    loader: &Arc<Loader>,
    path: &std::path::Path,
    data: &[u8],
    items: &[PrefetchItem],
    run_bytes: u64,
    ahead: u64,
) {
    let opts = PrefetchOptions::default()
        .with_chunk_bytes(1 << 20)
        .with_follow_from(Some(1 << 20))
        .with_ahead_bytes(Some(ahead))
        .with_run_bytes(run_bytes);
    let p = Prefetch::start(
        Arc::clone(loader),
        OpenedFile::open(path).expect("open"),
        items.to_vec(),
        opts,
    )
    .expect("start");
    check(gpu, data, &items[0], &p.take(0).expect("first"));
    // Written in place (same inode): the next transfer sees the change on its descriptor.
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .expect("reopen")
        .write_all_at_end();
    let mut failed = None;
    for (i, item) in items.iter().enumerate().skip(1) {
        match p.take(i) {
            Ok(piece) => check(gpu, data, item, &piece),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let e = failed.expect("a transfer after the write fails");
    assert!(
        e.to_string().contains(&*path.to_string_lossy()),
        "run_bytes {run_bytes}: {e}"
    );
}

trait AppendByte {
    fn write_all_at_end(self);
}

impl AppendByte for std::fs::File {
    fn write_all_at_end(mut self) {
        use std::io::Write;
        self.write_all(b"x").expect("append");
    }
}

/// Runs `body` on a thread of its own and fails where it does not end within a minute (a
/// missed wake-up would otherwise hang the test binary).
fn within_a_minute(what: &str, body: impl FnOnce() + Send + 'static) {
    let (done, finished) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        body();
        let _ = done.send(());
    });
    match finished.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(()) => worker.join().expect("joined"),
        // The body panicked: its panic is the failure.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(panic) = worker.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: still waiting after 60 s (a wake-up was missed)")
        }
    }
}

#[test]
fn hand_outs_wake_a_held_worker_and_a_waiting_reader() {
    let Some(gpu) = gpu_or_skip("hand_outs_wake_a_held_worker_and_a_waiting_reader") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("data.bin");
    let data = Arc::new(random_bytes((19 << 20) + 333, 40));
    std::fs::write(&path, &*data).expect("write");
    let loader = Arc::new(Loader::new(&gpu, LoadOptions::default()).expect("loader"));
    let items = Arc::new(items(data.len() as u64));

    // Not following, at most 1 MiB waiting untaken, chunks of 2 MiB: the worker stops after
    // each chunk until takes bring the untaken bytes under the bound; each take that does so
    // must wake it, or the next take waits for ever.
    for ahead in [0u64, 1, 1 << 20] {
        let opts = PrefetchOptions::default()
            .with_chunk_bytes(2 << 20)
            .with_ahead_bytes(Some(ahead));
        let p = Prefetch::start(
            Arc::clone(&loader),
            OpenedFile::open(&path).expect("open"),
            items.to_vec(),
            opts,
        )
        .expect("start");
        let (gpu, data, items) = (gpu.clone(), Arc::clone(&data), Arc::clone(&items));
        within_a_minute("takes past a held worker", move || {
            for (i, item) in items.iter().enumerate() {
                check(&gpu, &data, item, &p.take(i).expect("take"));
            }
        });
    }

    // A reader waiting in next_ready on one thread while this one takes items by index: each
    // item goes to exactly one of them, and the reader returns once none is left, whoever
    // took the last (that take must wake it).
    for follow in [None, Some(64 << 10)] {
        let opts = PrefetchOptions::default()
            .with_chunk_bytes(1 << 20)
            .with_follow_from(follow)
            .with_ahead_bytes(Some(2 << 20));
        let p = Arc::new(
            Prefetch::start(
                Arc::clone(&loader),
                OpenedFile::open(&path).expect("open"),
                items.to_vec(),
                opts,
            )
            .expect("start"),
        );
        let (gpu, data, items) = (gpu.clone(), Arc::clone(&data), Arc::clone(&items));
        within_a_minute("a reader beside takes", move || {
            let reader = {
                let p = Arc::clone(&p);
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    while let Some((i, piece)) = p.next_ready().expect("ready") {
                        got.push((i, piece));
                    }
                    got
                })
            };
            let mut mine = Vec::new();
            for (i, item) in items.iter().enumerate() {
                if let Some(piece) = p.take_if_untaken(i).expect("take") {
                    check(&gpu, &data, item, &piece);
                    mine.push(i);
                }
            }
            let theirs = reader.join().expect("reader");
            let mut all: Vec<usize> = mine;
            for (i, piece) in &theirs {
                check(&gpu, &data, &items[*i], piece);
                all.push(*i);
            }
            all.sort_unstable();
            assert_eq!(
                all,
                (0..items.len()).collect::<Vec<_>>(),
                "follow {follow:?}: every item exactly once"
            );
        });
    }
}
