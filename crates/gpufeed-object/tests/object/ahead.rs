//! `Object::read_ahead` against the real server: the readers' pieces byte-exact whatever
//! their order across threads, and the GETs' failures reaching every reader in bounded time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use gpufeed_object::{Error, Object, read_ahead_bytes};
use gpufeed_testkit::s3::{self, FaultProxy, Faults};
use xxhash_rust::xxh3::xxh3_64;

use super::{opts, put, url};

/// Pieces of `range` as the loader's fill threads take them: sizes ramping from 64 KiB + 3
/// up to `top`, handed out in order by a shared counter to `threads` threads.
fn pieces(range: std::ops::Range<u64>, top: u64) -> Vec<(u64, usize)> {
    let (mut at, mut size, mut out) = (range.start, (64 << 10) + 3, Vec::new());
    while at < range.end {
        let n = size.min(range.end - at);
        out.push((at, n as usize));
        at += n;
        size = (size * 2).min(top);
    }
    out
}

#[test]
fn read_ahead_pieces_from_several_threads_are_byte_exact() {
    let test = "read_ahead_pieces_from_several_threads_are_byte_exact";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let data = gpufeed_testkit::random_bytes((6 << 20) + 4_321, gpufeed_testkit::seed(test));
    put(&server, "ahead.bin", &data);
    // Blocks of an odd size, few in flight: pieces straddle blocks, readers wait for them.
    let o = opts(&server.endpoint)
        .with_request_bytes((384 << 10) + 11)
        .with_requests_in_flight(3);
    assert_eq!(read_ahead_bytes(&o), 5 * ((384 << 10) + 11));
    let obj = Object::open(&url("ahead.bin"), &o).expect("open");
    for range in [0..obj.len(), 1_001..obj.len() - 777, 5..5] {
        let plan = pieces(range.clone(), (1 << 20) + 5);
        let next = AtomicUsize::new(0);
        let mut out = vec![0u8; (range.end - range.start) as usize];
        let base = range.start;
        let parts: Vec<Vec<(u64, Vec<u8>)>> = obj
            .read_ahead(range.clone(), |ahead| {
                assert_eq!(ahead.range(), range);
                std::thread::scope(|scope| {
                    let readers: Vec<_> = (0..4)
                        .map(|_| {
                            scope.spawn(|| {
                                let mut got = Vec::new();
                                while let Some(&(at, n)) =
                                    plan.get(next.fetch_add(1, Ordering::Relaxed))
                                {
                                    let mut buf = vec![0u8; n];
                                    ahead.read_exact_at(at, &mut buf).expect("piece");
                                    got.push((at, buf));
                                }
                                got
                            })
                        })
                        .collect();
                    readers
                        .into_iter()
                        .map(|r| r.join().expect("reader"))
                        .collect()
                })
            })
            .expect("read ahead");
        for (at, buf) in parts.into_iter().flatten() {
            let from = (at - base) as usize;
            out[from..from + buf.len()].copy_from_slice(&buf);
        }
        assert_eq!(
            xxh3_64(&out),
            xxh3_64(&data[range.start as usize..range.end as usize]),
            "range {range:?}"
        );
    }
    // Bytes read twice, outside the range, and a range past the end: clear errors.
    obj.read_ahead(100..200_000, |ahead| {
        let mut buf = vec![0u8; 1_000];
        ahead.read_exact_at(100, &mut buf).expect("first");
        assert!(buf == data[100..1_100]);
        let e = ahead.read_exact_at(50, &mut buf).unwrap_err();
        assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
        let e = ahead.read_exact_at(199_500, &mut buf).unwrap_err();
        assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
        let mut rest = vec![0u8; 200_000 - 1_100];
        ahead.read_exact_at(1_100, &mut rest).expect("rest");
        assert!(rest == data[1_100..200_000]);
        let e = ahead.read_exact_at(100, &mut buf).unwrap_err();
        assert!(
            matches!(e, Error::InvalidSetting(ref m) if m.contains("read before")),
            "{e}"
        );
    })
    .expect("read ahead");
    let e = obj.read_ahead(0..obj.len() + 1, |_| ()).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
}

#[test]
fn a_read_ahead_whose_server_dies_fails_every_reader_in_bounded_time() {
    let test = "a_read_ahead_whose_server_dies_fails_every_reader_in_bounded_time";
    let Some(mut server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let data = gpufeed_testkit::random_bytes(8 << 20, gpufeed_testkit::seed(test));
    put(&server, "big.bin", &data);
    let proxy = FaultProxy::start(
        server.addr,
        Faults {
            delay: Duration::from_millis(20),
            ..Faults::default()
        },
    )
    .expect("proxy");
    let o = opts(&proxy.endpoint)
        .with_request_bytes(512 << 10)
        .with_requests_in_flight(2)
        .with_retries(2)
        .with_timeout(Duration::from_secs(5))
        .with_connect_timeout(Duration::from_secs(1));
    let obj = Object::open(&url("big.bin"), &o).expect("open");
    let start = Instant::now();
    let plan = pieces(0..obj.len(), 1 << 20);
    let next = AtomicUsize::new(0);
    let errors: Vec<Error> = obj
        .read_ahead(0..obj.len(), |ahead| {
            std::thread::scope(|scope| {
                let readers: Vec<_> = (0..3)
                    .map(|_| {
                        scope.spawn(|| {
                            while let Some(&(at, n)) =
                                plan.get(next.fetch_add(1, Ordering::Relaxed))
                            {
                                let mut buf = vec![0u8; n];
                                if let Err(e) = ahead.read_exact_at(at, &mut buf) {
                                    return Some(e);
                                }
                            }
                            None
                        })
                    })
                    .collect();
                std::thread::sleep(Duration::from_millis(300));
                server.kill();
                readers
                    .into_iter()
                    .filter_map(|r| r.join().expect("reader"))
                    .collect()
            })
        })
        .expect("read ahead");
    assert!(!errors.is_empty(), "the reads outlived the server");
    for e in &errors {
        assert!(
            matches!(e, Error::Request { .. } | Error::Truncated { .. }),
            "{e}"
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn an_object_replaced_during_a_read_ahead_is_an_error() {
    let test = "an_object_replaced_during_a_read_ahead_is_an_error";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    put(
        &server,
        "slow.bin",
        &gpufeed_testkit::random_bytes(8 << 20, seed),
    );
    let proxy = FaultProxy::start(
        server.addr,
        Faults {
            delay: Duration::from_millis(50),
            ..Faults::default()
        },
    )
    .expect("proxy");
    let o = opts(&proxy.endpoint)
        .with_request_bytes(512 << 10)
        .with_requests_in_flight(2);
    let obj = Object::open(&url("slow.bin"), &o).expect("open");
    let got = obj
        .read_ahead(0..obj.len(), |ahead| {
            std::thread::scope(|scope| {
                let reader = scope.spawn(|| {
                    let mut buf = vec![0u8; 1 << 20];
                    (0..8).try_for_each(|i| ahead.read_exact_at(i << 20, &mut buf))
                });
                std::thread::sleep(Duration::from_millis(300));
                put(
                    &server,
                    "slow.bin",
                    &gpufeed_testkit::random_bytes(8 << 20, seed ^ 7),
                );
                reader.join().expect("reader")
            })
        })
        .expect("read ahead");
    let e = got.unwrap_err();
    assert!(matches!(e, Error::ObjectChanged { .. }), "{e}");
}
