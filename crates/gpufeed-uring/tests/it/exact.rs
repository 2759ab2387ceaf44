//! Byte-exact reads against the file: random ranges and sizes, both backends, direct on and
//! off, one and many files.

use std::sync::OnceLock;

use gpufeed_os::AlignedBuf;
use gpufeed_uring::{Backend, Direct, ReadOp, Refused};
use proptest::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

use crate::{backends, disk_file, reader};

type Fixture = (tempfile::TempDir, std::path::PathBuf, Vec<u8>);

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| disk_file(5 * 1024 * 1024 + 3333, crate::seed("exact fixture")))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_ranges_are_byte_exact(
        offset in 0u64..(5 * 1024 * 1024),
        len in 1usize..(3 * 1024 * 1024),
        buf_offset in 0usize..5000,
        direct in prop_oneof![Just(Direct::On), Just(Direct::Off)],
        uring in any::<bool>(),
        qd in 1usize..16,
    ) {
        let (_, path, data) = fixture();
        let len = len.min(data.len() - offset as usize);
        let backend = if uring { Backend::IoUring } else { Backend::Threads(2) };
        prop_assume!(backend == Backend::Threads(2) || backends().contains(&Backend::IoUring));
        let mut r = reader(backend, direct, qd, 256 * 1024);
        let file = r.open(path).expect("open");
        prop_assert_eq!(r.is_direct(file), Some(direct == Direct::On));
        // Into the middle of a larger buffer, so the destination is misaligned too.
        let mut buf = vec![0u8; buf_offset + len];
        let mut got = None;
        r.read_all([ReadOp::new(file, offset, buf.split_off(0)).at(buf_offset).len(len)], |c| got = Some(c)).expect("read");
        let c = got.expect("one completion");
        prop_assert_eq!(c.result.as_ref().ok().copied(), Some(len), "{:?}", c.result);
        let want = &data[offset as usize..offset as usize + len];
        prop_assert_eq!(xxh3_64(&c.buf[buf_offset..]), xxh3_64(want));
        prop_assert!(c.buf[..buf_offset].iter().all(|&b| b == 0), "wrote before the range");
    }
}

#[test]
fn many_requests_over_many_files_every_backend_and_mode() {
    let files: Vec<Fixture> = (0..3)
        .map(|i| disk_file(1_000_000 + i * 77_777, 100 + i as u64))
        .collect();
    for backend in backends() {
        for direct in [Direct::On, Direct::Off] {
            let mut r = reader(backend, direct, 16, 64 * 1024);
            let ids: Vec<_> = files
                .iter()
                .map(|(_, p, _)| r.open(p).expect("open"))
                .collect();
            // 60 requests of odd sizes at odd offsets, spread over the files, into aligned and
            // unaligned buffers.
            let ops = (0..60u64).map(|i| {
                let f = (i % 3) as usize;
                let len = 1 + (i as usize * 7919) % 200_000;
                let off = (i * 104_729) % (files[f].2.len() - len) as u64;
                let buf = AlignedBuf::new(len + 1, 4096).expect("alloc");
                ReadOp::new(ids[f], off, buf)
                    .len(len)
                    .at(i as usize % 2)
                    .user_data(i)
            });
            let mut seen = 0;
            r.read_all(ops, |c| {
                let i = c.user_data;
                let f = (i % 3) as usize;
                let len = c
                    .result
                    .as_ref()
                    .copied()
                    .unwrap_or_else(|e| panic!("{backend:?} {direct:?} #{i}: {e}"));
                let at = i as usize % 2;
                let want = &files[f].2[c.offset as usize..c.offset as usize + len];
                assert!(
                    c.buf[at..at + len] == *want,
                    "{backend:?} {direct:?} request {i} differs"
                );
                seen += 1;
            })
            .expect("read_all");
            assert_eq!(seen, 60);
            let stats = r.stats();
            assert_eq!(stats.files.len(), 3);
            assert!(
                stats
                    .files
                    .iter()
                    .all(|f| f.direct == (direct == Direct::On)),
                "{stats:?}"
            );
            assert!(stats.bytes > 0 && stats.seconds > 0.0);
        }
    }
}

#[test]
fn read_exact_at_and_the_iterator() {
    let (_, path, data) = fixture();
    for backend in backends() {
        let mut r = reader(backend, Direct::Auto, 8, 128 * 1024);
        let file = r.open(path).expect("open");
        let mut buf = vec![0u8; 777_777];
        r.read_exact_at(file, 12_345, &mut buf).expect("read");
        assert!(buf[..] == data[12_345..12_345 + 777_777]);

        let ops = (0..10u64).map(|i| ReadOp::new(file, i * 4096 + 1, vec![0u8; 5000]).user_data(i));
        let mut n = 0;
        for c in r.reads(ops) {
            let c = c.expect("backend ok");
            let off = c.offset as usize;
            assert_eq!(c.result.expect("read"), 5000);
            assert!(c.buf[..] == data[off..off + 5000]);
            n += 1;
        }
        assert_eq!(n, 10);
        // Dropping an unfinished iterator waits for the reads in flight.
        let ops = (0..50u64).map(|i| ReadOp::new(file, i * 1000, vec![0u8; 100_000]));
        let mut it = r.reads(ops);
        assert!(it.next().expect("first").expect("ok").result.is_ok());
        drop(it);
        // The reader is still usable afterwards.
        r.read_exact_at(file, 0, &mut buf[..10])
            .expect("read after an abandoned iterator");
        assert_eq!(buf[..10], data[..10]);
    }
}

#[test]
fn auto_reads_cached_files_buffered_and_cold_files_direct() {
    let (_dir, path, _) = disk_file(2 << 20, 9);
    gpufeed_os::cache::warm(&path).expect("warm");
    let mut r = reader(Backend::Threads(2), Direct::Auto, 4, 1 << 20);
    let warm = r.open(&path).expect("open");
    assert_eq!(r.is_direct(warm), Some(false));
    let why = r.stats().files[0].reason.clone().expect("reason recorded");
    assert!(why.contains("page cache"), "{why}");
    gpufeed_os::cache::evict(&path).expect("evict");
    let cold = r.open(&path).expect("open");
    assert_eq!(r.is_direct(cold), Some(true), "{:?}", r.stats().files[1]);
}

#[test]
fn prefetch_brings_a_range_into_the_page_cache() {
    let (_dir, path, _) = disk_file(4 << 20, 10);
    for backend in backends() {
        gpufeed_os::cache::evict(&path).expect("evict");
        let mut r = reader(backend, Direct::Off, 4, 1 << 20);
        let file = r.open(&path).expect("open");
        r.prefetch(file, 0, 1 << 20).expect("prefetch");
        let mut resident = 0.0;
        for _ in 0..200 {
            resident = gpufeed_os::cache::residency(&path)
                .expect("residency")
                .fraction();
            if resident >= 0.2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            resident >= 0.2,
            "{backend:?}: only {resident} resident after prefetch of 1 of 4 MiB"
        );
    }
}

#[test]
fn registered_bounce_buffers_read_fixed() {
    let (_, path, data) = fixture();
    if !backends().contains(&Backend::IoUring) {
        gpufeed_testkit::skip("registered_bounce_buffers_read_fixed", &"no io_uring here");
        return;
    }
    for faults in [
        None,
        Some(gpufeed_uring::FaultPlan::recoverable(crate::seed(
            "registered buffers",
        ))),
    ] {
        let mut builder = gpufeed_uring::Reader::builder()
            .backend(Backend::IoUring)
            .direct(Direct::On)
            .queue_depth(8)
            .block_bytes(64 * 1024)
            .register_buffers(true);
        if let Some(plan) = faults.clone() {
            builder = builder.fault_injection(plan);
        }
        let mut r = builder.build().expect("build");
        let registered = r.stats().registered_buffers;
        if registered == 0 {
            // Refused (memlock without CAP_IPC_LOCK): the reason must be recorded.
            assert!(
                r.stats()
                    .fallbacks
                    .iter()
                    .any(|f| f.refused == Refused::RingBuffers
                        && f.reason.contains("bounce buffers")),
                "{:?}",
                r.stats()
            );
        } else {
            assert_eq!(registered, 8);
        }
        let file = r.open(path).expect("open");
        // Unaligned everything: head, tail and a misaligned destination all bounce.
        let ops = (0..30u64).map(|i| {
            let len = 1 + (i as usize * 7777) % 300_000;
            ReadOp::new(file, 1 + i * 99_991, vec![0u8; len + 3])
                .at(3)
                .len(len)
                .user_data(i)
        });
        r.read_all(ops, |c| {
            let n = c
                .result
                .as_ref()
                .copied()
                .unwrap_or_else(|e| panic!("{faults:?}: {e}"));
            let off = c.offset as usize;
            assert!(
                c.buf[3..3 + n] == data[off..off + n],
                "request {} differs",
                c.user_data
            );
        })
        .expect("read_all");
    }
    let t = gpufeed_uring::Reader::builder()
        .backend(Backend::Threads(1))
        .register_buffers(true)
        .build()
        .expect("build");
    assert_eq!(t.stats().registered_buffers, 0);
    assert!(
        t.stats()
            .fallbacks
            .iter()
            .any(|f| f.refused == Refused::RingBuffers && f.reason.contains("need io_uring")),
        "{:?}",
        t.stats()
    );
}

/// A read iterator leaked with `mem::forget` while its reads are in flight: the next session
/// waits for those reads first and never takes one of their completions for one of its own
/// (before, tags restarted at 0 and a stale completion finished a new read early, while the
/// kernel still wrote its buffer). Run cold, with O_DIRECT and without, on every backend.
#[test]
fn a_leaked_read_iterator_cannot_corrupt_the_next_session() {
    let (_, path, data) = fixture();
    for backend in backends() {
        for direct in [Direct::On, Direct::Off] {
            let mut r = reader(backend, direct, 16, 128 * 1024);
            let file = r.open(path).expect("open");
            gpufeed_os::cache::evict(path).expect("evict");
            // A small read (cached, without O_DIRECT) usually completes first; the parts
            // (tags 1..) of a large cold read are then still in flight when the iterator is
            // leaked. Which completes first is the kernel's (and a loaded machine's) choice:
            // either way the iterator is leaked with the other read issued.
            let mut head = vec![0u8; 4096];
            r.read_exact_at(file, 0, &mut head).expect("cache the head");
            let ops = [
                ReadOp::new(file, 0, vec![0u8; 4096]),
                ReadOp::new(file, 1 << 20, vec![0u8; 2 << 20]),
            ];
            let mut it = r.reads(ops);
            let first = it.next().expect("first").expect("ok");
            assert!(
                [0, 1 << 20].contains(&first.offset),
                "a completion of neither read: {}",
                first.offset
            );
            std::mem::forget(it);
            // The new session's parts have the same size as the leaked ones (one block each),
            // so a stale completion would finish one of them before its data arrived.
            let ops = (0..40u64)
                .map(|i| ReadOp::new(file, i * 100_003 + 7, vec![0u8; 128 * 1024]).user_data(i));
            let mut seen = [false; 40];
            for c in r.reads(ops) {
                let c = c.unwrap_or_else(|e| panic!("{backend:?} {direct:?}: {e}"));
                let off = c.offset as usize;
                assert_eq!(c.result.expect("read"), 128 * 1024);
                assert!(
                    c.buf[..] == data[off..off + 128 * 1024],
                    "{backend:?} {direct:?}: bytes of read {} differ",
                    c.user_data
                );
                assert!(!std::mem::replace(&mut seen[c.user_data as usize], true));
            }
            assert!(
                seen.iter().all(|&s| s),
                "{backend:?} {direct:?}: reads missing"
            );
            let mut buf = vec![0u8; 333_333];
            r.read_exact_at(file, 4_000_000, &mut buf)
                .expect("read after a leaked iterator");
            assert!(buf[..] == data[4_000_000..4_333_333]);
        }
    }
}

/// A reader kept for many files (as a loader keeps one per fill thread) opens and closes one
/// file per call: more files than the ring has registered slots, each read byte-exact, no file
/// descriptor left behind, closed ids refused even after their slot went to another file; by
/// `open` and by `open_brief` (its own descriptor, not registered with the ring).
#[test]
fn a_reader_kept_for_many_files_closes_each() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let files: Vec<(std::path::PathBuf, Vec<u8>)> = (0..4u64)
        .map(|i| {
            let data = crate::random_bytes(70_000 + i as usize * 4097, crate::seed("close") + i);
            let path = dir.path().join(format!("f{i}.bin"));
            std::fs::write(&path, &data).expect("write");
            (path, data)
        })
        .collect();
    // Descriptors of this process open on the test's files (other tests run alongside).
    let fds = || {
        std::fs::read_dir("/proc/self/fd")
            .expect("/proc/self/fd")
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| target.starts_with(dir.path()))
            .count()
    };
    for (backend, direct, brief) in backends().into_iter().flat_map(|b| {
        [Direct::Off, Direct::On]
            .into_iter()
            .flat_map(move |d| [(b, d, false), (b, d, true)])
    }) {
        let mut r = reader(backend, direct, 4, 64 * 1024);
        let mut stale = Vec::new();
        for round in 0..300 {
            let (path, data) = &files[round % files.len()];
            let file = if brief {
                r.open_brief(path).expect("open_brief")
            } else {
                r.open(path).expect("open")
            };
            assert_eq!(r.is_direct(file), Some(direct == Direct::On));
            let mut got = vec![0u8; data.len() - 1];
            r.read_exact_at(file, 1, &mut got).expect("read");
            assert!(
                got == data[1..],
                "{backend:?} {direct:?} brief {brief} round {round} differs"
            );
            assert_eq!(r.stats().files.len(), 1, "only the open file is listed");
            r.close(file).expect("close");
            stale.push(file);
        }
        assert!(r.stats().files.is_empty());
        assert_eq!(
            fds(),
            0,
            "{backend:?} {direct:?} brief {brief}: descriptors left open"
        );
        let live = r.open(&files[0].0).expect("open");
        for old in &stale[stale.len() - 5..] {
            let mut b = [0u8; 8];
            let e = r.read_exact_at(*old, 0, &mut b).expect_err("a closed file");
            assert!(e.to_string().contains("closed"), "{e}");
            assert!(r.close(*old).is_err(), "closing twice");
        }
        let mut b = vec![0u8; 100];
        r.read_exact_at(live, 0, &mut b).expect("the live file");
        assert_eq!(b, files[0].1[..100]);
    }
}

/// Many small files read in one batch into one buffer, byte-exact on both backends with and
/// without O_DIRECT; a file shorter than asked is an `UnexpectedEof` naming it.
#[test]
fn many_small_files_in_one_batch() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let files: Vec<(std::path::PathBuf, Vec<u8>)> = (0..97u64)
        .map(|i| {
            let len = (i as usize * 7919) % 150_000;
            let data = crate::random_bytes(len, crate::seed("many") + i);
            let path = dir.path().join(format!("s{i}.bin"));
            std::fs::write(&path, &data).expect("write");
            (path, data)
        })
        .collect();
    let total: usize = files.iter().map(|f| f.1.len()).sum();
    for backend in backends() {
        for direct in [Direct::Off, Direct::On] {
            let mut r = reader(backend, direct, 16, 64 * 1024);
            let ids: Vec<_> = files
                .iter()
                .map(|(p, _)| r.open(p).expect("open"))
                .collect();
            let mut out = vec![0u8; total];
            let mut rest = out.as_mut_slice();
            let mut reads = Vec::new();
            for (id, (_, data)) in ids.iter().zip(&files) {
                let (head, tail) = rest.split_at_mut(data.len());
                reads.push((*id, 0, head));
                rest = tail;
            }
            r.read_exact_many(reads).expect("read");
            let want: Vec<u8> = files.iter().flat_map(|f| f.1.iter().copied()).collect();
            assert!(out == want, "{backend:?} {direct:?}: bytes differ");
            let short = files.iter().position(|f| f.1.len() > 1000).expect("a file");
            let mut big = vec![0u8; files[short].1.len() + 1];
            let mut small = [0u8; 10];
            let e = r
                .read_exact_many([(ids[0], 0, &mut small[..0]), (ids[short], 0, &mut big[..])])
                .expect_err("past the end");
            assert!(
                matches!(&e, gpufeed_uring::Error::UnexpectedEof { path, .. } if *path == files[short].0),
                "{e:?}"
            );
        }
    }
}

/// A file opened once ([`gpufeed_os::OpenedFile`]) and then replaced at its path by a rename:
/// a reader given the opened file reads the version opened, whole, buffered and with
/// `O_DIRECT` (reopened through `/proc/thread-self/fd`, not the path), on both backends; opened by
/// the path it reads the new one. Unaligned length, random bytes.
#[test]
fn a_reader_of_an_opened_file_reads_that_version_after_a_rename_over_its_path() {
    let (dir, path, old) = crate::disk_file((3 << 20) + 12345, 41);
    let opened = gpufeed_os::OpenedFile::open(&path).expect("open");
    let new = crate::random_bytes(old.len() + 7, 42);
    let tmp = dir.path().join("next.bin");
    std::fs::write(&tmp, &new).expect("write the next version");
    std::fs::rename(&tmp, &path).expect("rename over");
    for backend in crate::backends() {
        for direct in [Direct::On, Direct::Off] {
            let mut r = crate::reader(backend, direct, 4, 1 << 20);
            let file = r.open_opened(&opened).expect("open the opened file");
            assert_eq!(r.is_direct(file), Some(direct == Direct::On), "{backend:?}");
            let mut got = vec![0u8; old.len()];
            r.read_exact_at(file, 0, &mut got).expect("read");
            assert_eq!(
                xxhash_rust::xxh3::xxh3_64(&got),
                xxhash_rust::xxh3::xxh3_64(&old),
                "{backend:?} {direct:?}: the opened version"
            );
            let by_path = r.open(&path).expect("open by path");
            let mut got = vec![0u8; new.len()];
            r.read_exact_at(by_path, 0, &mut got).expect("read");
            assert_eq!(
                got, new,
                "{backend:?} {direct:?}: the path names the new one"
            );
        }
    }
    assert!(
        opened.changed().expect("fstat").is_some(),
        "the opened version lost its name"
    );
}

/// Files opened by `open` (registered with the ring) and by `open_brief` (not) side by side in
/// one batch of reads, their slots reused by files of the other kind from round to round,
/// some kept open across rounds: every file reads its own bytes, on both backends, with and
/// without recoverable faults (short reads, EINTR, EAGAIN).
#[test]
fn registered_and_brief_files_share_a_batch_and_their_slots() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let files: Vec<(std::path::PathBuf, Vec<u8>)> = (0..300u64)
        .map(|i| {
            let data = crate::random_bytes(1000 + i as usize * 37, crate::seed("mixed") + i);
            let path = dir.path().join(format!("m{i}.bin"));
            std::fs::write(&path, &data).expect("write");
            (path, data)
        })
        .collect();
    for backend in backends() {
        for faults in [false, true] {
            let mut builder = gpufeed_uring::Reader::builder()
                .backend(backend)
                .direct(Direct::Off)
                .queue_depth(8)
                .block_bytes(4096);
            if faults {
                builder = builder.fault_injection(gpufeed_uring::FaultPlan::recoverable(
                    crate::seed("mixed faults"),
                ));
            }
            let mut r = builder.build().expect("reader");
            let mut kept = Vec::new();
            for round in 0..20 {
                let ids: Vec<_> = (0..40)
                    .map(|k| {
                        let i = (round * 13 + k) % files.len();
                        let path = &files[i].0;
                        let id = if (k + round) % 3 == 0 {
                            r.open(path).expect("open")
                        } else {
                            r.open_brief(path).expect("open_brief")
                        };
                        (id, i)
                    })
                    .collect();
                let mut bufs: Vec<Vec<u8>> = ids
                    .iter()
                    .map(|&(_, i)| vec![0u8; files[i].1.len()])
                    .collect();
                r.read_exact_many(
                    ids.iter()
                        .zip(bufs.iter_mut())
                        .map(|(&(id, _), b)| (id, 0, b.as_mut_slice())),
                )
                .expect("read");
                for (&(_, i), b) in ids.iter().zip(&bufs) {
                    assert!(
                        *b == files[i].1,
                        "{backend:?} faults {faults} round {round}: file {i} differs"
                    );
                }
                for (n, (id, i)) in ids.into_iter().enumerate() {
                    if n % 7 == 0 {
                        kept.push((id, i));
                    } else {
                        r.close(id).expect("close");
                    }
                }
            }
            for &(id, i) in &kept {
                let mut b = vec![0u8; files[i].1.len()];
                r.read_exact_at(id, 0, &mut b).expect("a file kept open");
                assert!(
                    b == files[i].1,
                    "{backend:?} faults {faults}: kept file {i}"
                );
            }
        }
    }
}
