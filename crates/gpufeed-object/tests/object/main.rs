//! gpufeed-object against a real S3 server (SeaweedFS on 127.0.0.1, started per test) and a
//! fault-injecting proxy in front of it. The tests skip with a printed reason where `weed`
//! is not installed, and fail instead where `GPUFEED_REQUIRE_S3=1` (CI).

mod ahead;

use std::time::{Duration, Instant};

use gpufeed_object::{Credentials, Error, Object, ObjectOptions};
use gpufeed_testkit::s3::{self, ACCESS_KEY, BUCKET, FaultProxy, Faults, SECRET_KEY, SeaweedFs};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use xxhash_rust::xxh3::xxh3_64;

/// Writes `bytes` to `key` of the test bucket through the server's S3 API (retried while the
/// fresh server still settles its volumes).
fn put(server: &SeaweedFs, key: &str, bytes: &[u8]) {
    let store = AmazonS3Builder::new()
        .with_endpoint(&server.endpoint)
        .with_allow_http(true)
        .with_bucket_name(BUCKET)
        .with_region("us-east-1")
        .with_access_key_id(ACCESS_KEY)
        .with_secret_access_key(SECRET_KEY)
        .build()
        .expect("store");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let payload = PutPayload::from(bytes.to_vec());
        // The key as it is (`Path::from` would encode a `%` in it once more).
        let path = Path::parse(key).expect("a key");
        match rt.block_on(store.put(&path, payload)) {
            Ok(_) => return,
            Err(e) if Instant::now() < deadline => {
                eprintln!("put {key}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("put {key}: {e}\n{}", server.log()),
        }
    }
}

/// Options for `endpoint` with the test server's credentials (nothing from the environment).
fn opts(endpoint: &str) -> ObjectOptions {
    ObjectOptions::default()
        .with_endpoint(endpoint)
        .with_region("us-east-1")
        .with_credentials(Credentials::new(ACCESS_KEY, SECRET_KEY))
}

fn url(key: &str) -> String {
    format!("s3://{BUCKET}/{key}")
}

#[test]
fn reads_are_byte_exact_at_unaligned_offsets_and_sizes() {
    let test = "reads_are_byte_exact_at_unaligned_offsets_and_sizes";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    let data = gpufeed_testkit::random_bytes((5 << 20) + 12_345, seed);
    put(&server, "dir/data.bin", &data);
    // Requests of an odd size, several in flight: many boundaries inside one read.
    let o = opts(&server.endpoint)
        .with_request_bytes((256 << 10) + 7)
        .with_requests_in_flight(8);
    let obj = Object::open(&url("dir/data.bin"), &o).expect("open");
    assert_eq!(obj.len(), data.len() as u64);
    assert!(obj.etag().is_some(), "SeaweedFS gives ETags");
    let all = obj.read_all().expect("read_all");
    assert_eq!(xxh3_64(&all), xxh3_64(&data));
    let mut state = seed;
    for _ in 0..20 {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let start = (state >> 33) as usize % data.len();
        let len = ((state >> 13) as usize % (3 << 20)).min(data.len() - start);
        let mut buf = vec![0u8; len];
        let stats = obj.read_exact_at(start as u64, &mut buf).expect("range");
        assert_eq!(stats.bytes, len as u64);
        // A GET per aligned block of the object the range touches (cut at the object's
        // multiples of the request size, not the read's).
        let step = (256 << 10) + 7;
        let blocks = if len == 0 {
            0
        } else {
            (start + len - 1) / step - start / step + 1
        };
        assert_eq!(stats.requests, blocks);
        assert!(buf == data[start..start + len], "bytes {start}+{len}");
    }
    // Nothing asked, nothing requested; past the end, a clear error.
    let stats = obj.read_exact_at(7, &mut []).expect("empty read");
    assert_eq!((stats.bytes, stats.requests), (0, 0));
    let e = obj
        .read_exact_at(data.len() as u64 - 3, &mut [0u8; 4])
        .unwrap_err();
    assert!(
        matches!(e, Error::OutOfRange { len, .. } if len == data.len() as u64),
        "{e}"
    );
    // An empty object.
    put(&server, "empty", &[]);
    let empty = Object::open(&url("empty"), &o).expect("open empty");
    assert!(empty.is_empty() && empty.read_all().expect("read empty").is_empty());
}

#[test]
fn plain_http_urls_read_with_ranges() {
    let test = "plain_http_urls_read_with_ranges";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let data = gpufeed_testkit::random_bytes((1 << 20) + 333, gpufeed_testkit::seed(test));
    put(&server, "web/file.bin", &data);
    // The filer serves the bucket's objects over plain HTTP.
    let web = format!("http://{}/buckets/{BUCKET}/web/file.bin", server.filer);
    let obj = Object::open(&web, &ObjectOptions::default().with_request_bytes(100_001))
        .expect("open http");
    assert_eq!(obj.len(), data.len() as u64);
    assert_eq!(xxh3_64(&obj.read_all().expect("read")), xxh3_64(&data));
    let mut part = vec![0u8; 5000];
    obj.read_exact_at(99_999, &mut part).expect("range");
    assert!(part == data[99_999..104_999]);
    let missing = format!("http://{}/buckets/{BUCKET}/web/none", server.filer);
    let e = Object::open(&missing, &ObjectOptions::default()).unwrap_err();
    assert!(e.is_not_found(), "{e}");
}

#[test]
fn missing_keys_buckets_and_wrong_credentials_are_clear_errors() {
    let test = "missing_keys_buckets_and_wrong_credentials_are_clear_errors";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    put(&server, "here", b"x");
    let o = opts(&server.endpoint);
    let e = Object::open(&url("not-here"), &o).unwrap_err();
    assert!(e.is_not_found(), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("not-here") && text.contains(&server.endpoint),
        "{text}"
    );
    let e = Object::open("s3://no-such-bucket/key", &o).unwrap_err();
    assert!(e.is_not_found(), "{e}");
    let wrong = o
        .clone()
        .with_credentials(Credentials::new(ACCESS_KEY, "wrong-secret"));
    let e = Object::open(&url("here"), &wrong).unwrap_err();
    assert!(matches!(e, Error::AccessDenied { .. }), "{e}");
    assert!(e.to_string().contains("AWS_SECRET_ACCESS_KEY"), "{e}");
    // Only the status (a HEAD's answer has no body): the rest can echo the signed request.
    assert!(
        e.to_string().contains("HTTP 403") && !e.to_string().contains('<'),
        "{e}"
    );
    assert!(std::error::Error::source(&e).is_none());
    let e = Object::open("s3://bucket-only/", &o).unwrap_err();
    assert!(matches!(e, Error::InvalidUrl { .. }), "{e}");
}

#[test]
fn an_endpoints_redirect_to_another_host_is_not_followed() {
    let test = "an_endpoints_redirect_to_another_host_is_not_followed";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    put(&server, "moved.bin", b"the bytes");
    // "Another host": a plain proxy in front of the same server, counting its connections.
    let other = FaultProxy::start(server.addr, Faults::default()).expect("proxy");
    let redirecting = FaultProxy::start(
        server.addr,
        Faults {
            redirect: Some(other.endpoint.clone()),
            ..Faults::default()
        },
    )
    .expect("proxy");
    let mut credentials = Credentials::new(ACCESS_KEY, SECRET_KEY);
    credentials.token = Some("a-session-token".into());
    let o = opts(&redirecting.endpoint)
        .with_credentials(credentials)
        .with_retries(1);
    let e = Object::open(&url("moved.bin"), &o).unwrap_err();
    assert!(matches!(e, Error::Answered { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("HTTP 307") && text.contains("redirect") && text.contains("endpoint"),
        "{text}"
    );
    assert!(!text.contains("a-session-token"), "{text}");
    // Nothing went to the other host: neither the request nor its token.
    assert_eq!(
        other.connections.load(std::sync::atomic::Ordering::Acquire),
        0,
        "the redirect was followed"
    );
    assert!(
        redirecting
            .connections
            .load(std::sync::atomic::Ordering::Acquire)
            >= 1
    );
}

#[test]
fn an_object_replaced_after_open_is_never_read_as_a_mix() {
    let test = "an_object_replaced_after_open_is_never_read_as_a_mix";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    let v1 = gpufeed_testkit::random_bytes(3 << 20, seed);
    put(&server, "model.bin", &v1);
    let o = opts(&server.endpoint).with_request_bytes(1 << 20);
    let obj = Object::open(&url("model.bin"), &o).expect("open");
    let mut head = vec![0u8; 1000];
    obj.read_exact_at(0, &mut head).expect("read v1");
    assert!(head == v1[..1000]);
    // Same size, other bytes: only the pinned ETag tells them apart.
    let v2 = gpufeed_testkit::random_bytes(3 << 20, seed ^ 1);
    put(&server, "model.bin", &v2);
    let mut buf = vec![0u8; v1.len()];
    let e = obj.read_exact_at(0, &mut buf).unwrap_err();
    assert!(matches!(e, Error::ObjectChanged { .. }), "{e}");
    assert!(e.to_string().contains("model.bin"), "{e}");
    // Opened again, the new version reads whole.
    let again = Object::open(&url("model.bin"), &o).expect("reopen");
    assert_eq!(xxh3_64(&again.read_all().expect("read v2")), xxh3_64(&v2));
}

#[test]
fn an_object_overwritten_during_a_slow_read_is_an_error() {
    let test = "an_object_overwritten_during_a_slow_read_is_an_error";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    let v1 = gpufeed_testkit::random_bytes(8 << 20, seed);
    put(&server, "slow.bin", &v1);
    // 64 KiB per 50 ms per connection, two requests in flight: about 3 s for the object,
    // against the 0.3 s before the overwrite.
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
    let reader = std::thread::spawn(move || obj.read_all());
    std::thread::sleep(Duration::from_millis(300));
    put(
        &server,
        "slow.bin",
        &gpufeed_testkit::random_bytes(8 << 20, seed ^ 7),
    );
    let e = reader.join().expect("reader").unwrap_err();
    assert!(matches!(e, Error::ObjectChanged { .. }), "{e}");
}

#[test]
fn reads_from_an_unaligned_offset_get_the_objects_aligned_blocks() {
    let test = "reads_from_an_unaligned_offset_get_the_objects_aligned_blocks";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    let data = gpufeed_testkit::random_bytes((3 << 20) + 77, seed);
    put(&server, "serial.bin", &data);
    // One request in flight, so one caller reads every part. What is checked is the bytes and
    // the GETs' cut at the object's multiples of 256 KiB; that only one GET runs at a time is
    // not (a proxy's connection count did not tell the two apart: docs/benchmarks.md).
    let o = opts(&server.endpoint)
        .with_request_bytes(256 << 10)
        .with_requests_in_flight(1);
    let obj = Object::open(&url("serial.bin"), &o).expect("open");
    // From an unaligned offset: nine GETs, the first up to the object's next 256 KiB.
    let mut buf = vec![0u8; 2 << 20];
    let stats = obj.read_exact_at(12_345, &mut buf).expect("read");
    assert_eq!(stats.requests, 9);
    assert!(buf == data[12_345..12_345 + (2 << 20)]);
    // Ending on a boundary: the last part is whole.
    let mut buf = vec![0u8; (1 << 20) - 12_345];
    let stats = obj.read_exact_at(12_345, &mut buf).expect("read");
    assert_eq!(stats.requests, 4);
    assert!(buf == data[12_345..1 << 20]);
}

#[test]
fn unavailable_answers_and_cut_connections_are_retried() {
    let test = "unavailable_answers_and_cut_connections_are_retried";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let data = gpufeed_testkit::random_bytes((4 << 20) + 99, gpufeed_testkit::seed(test));
    put(&server, "flaky.bin", &data);
    // The first 2 connections get 503, the next 3 are cut 100 KB into their answers.
    let proxy = FaultProxy::start(
        server.addr,
        Faults {
            unavailable: 2,
            cut: (3, 100_000),
            ..Faults::default()
        },
    )
    .expect("proxy");
    let o = opts(&proxy.endpoint)
        .with_request_bytes(1 << 20)
        .with_requests_in_flight(2);
    let obj = Object::open(&url("flaky.bin"), &o).expect("open through faults");
    let got = obj.read_all().expect("read through faults");
    assert_eq!(xxh3_64(&got), xxh3_64(&data));
    let connections = proxy.connections.load(std::sync::atomic::Ordering::Acquire);
    assert!(
        connections > 5,
        "{connections} connections: the faults were not all met"
    );
}

#[test]
fn a_connection_cut_every_time_fails_in_bounded_time() {
    let test = "a_connection_cut_every_time_fails_in_bounded_time";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let data = gpufeed_testkit::random_bytes(2 << 20, gpufeed_testkit::seed(test));
    put(&server, "cut.bin", &data);
    let o = opts(&server.endpoint);
    let obj = Object::open(&url("cut.bin"), &o).expect("open");
    let etag = obj.etag().map(str::to_string);
    // Every connection cut 1,000 bytes into the answer: the HEAD's headers pass, no body does.
    let proxy = FaultProxy::start(
        server.addr,
        Faults {
            cut: (usize::MAX, 1_000),
            ..Faults::default()
        },
    )
    .expect("proxy");
    let o = opts(&proxy.endpoint)
        .with_retries(2)
        .with_timeout(Duration::from_secs(10));
    let start = Instant::now();
    let result = Object::open(&url("cut.bin"), &o).and_then(|obj| {
        assert_eq!(obj.etag().map(str::to_string), etag);
        obj.read_all()
    });
    let e = result.unwrap_err();
    assert!(
        matches!(e, Error::Request { .. } | Error::Truncated { .. }),
        "{e}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn a_server_killed_mid_read_fails_in_bounded_time() {
    let test = "a_server_killed_mid_read_fails_in_bounded_time";
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
    let reader = std::thread::spawn(move || obj.read_all());
    std::thread::sleep(Duration::from_millis(300));
    server.kill();
    let e = reader.join().expect("reader").unwrap_err();
    assert!(
        matches!(e, Error::Request { .. } | Error::Truncated { .. }),
        "{e}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn answers_slower_than_the_timeout_are_an_error() {
    let test = "answers_slower_than_the_timeout_are_an_error";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    put(&server, "k", &[1u8; 1000]);
    let proxy = FaultProxy::start(
        server.addr,
        Faults {
            delay: Duration::from_secs(3),
            ..Faults::default()
        },
    )
    .expect("proxy");
    let o = opts(&proxy.endpoint)
        .with_retries(1)
        .with_timeout(Duration::from_millis(500));
    let start = Instant::now();
    let e = Object::open(&url("k"), &o).unwrap_err();
    assert!(matches!(e, Error::Request { .. }), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    assert!(
        e.to_string().contains("timed out") && e.to_string().contains("ObjectOptions::timeout"),
        "{e}"
    );
    // A body that stalls after its headers: the store's message ends at "request or response
    // body error", and the error says that it was the timeout, and which.
    let data = gpufeed_testkit::random_bytes(4 << 20, gpufeed_testkit::seed(test));
    put(&server, "stalls", &data);
    let proxy = FaultProxy::start(
        server.addr,
        Faults {
            delay: Duration::from_millis(700),
            ..Faults::default()
        },
    )
    .expect("proxy");
    let o = opts(&proxy.endpoint)
        .with_retries(1)
        .with_timeout(Duration::from_millis(1500))
        .with_request_bytes(4 << 20)
        .with_requests_in_flight(1);
    let obj = Object::open(&url("stalls"), &o).expect("the HEAD's answer is one read");
    let e = obj.read_all().unwrap_err();
    assert!(matches!(e, Error::Request { .. }), "{e}");
    assert!(
        e.to_string().contains("timed out") && e.to_string().contains("ObjectOptions::timeout"),
        "{e}"
    );
}

#[test]
fn calls_from_inside_async_runtimes_and_forked_children_work() {
    let test = "calls_from_inside_async_runtimes_and_forked_children_work";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let data = gpufeed_testkit::random_bytes(3 << 20, gpufeed_testkit::seed(test));
    put(&server, "rt.bin", &data);
    let o = opts(&server.endpoint).with_request_bytes(1 << 20);
    let read = || Object::open(&url("rt.bin"), &o).and_then(|obj| obj.read_all());
    // A task of a current-thread runtime, and spawn_blocking of a multi-thread one.
    let current = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    assert_eq!(
        xxh3_64(&current.block_on(async { read() }).expect("in a task")),
        xxh3_64(&data)
    );
    let multi = tokio::runtime::Runtime::new().expect("runtime");
    let o2 = o.clone();
    let got = multi
        .block_on(multi.spawn_blocking(move || {
            Object::open(&url("rt.bin"), &o2).and_then(|obj| obj.read_all())
        }))
        .expect("join")
        .expect("in spawn_blocking");
    assert_eq!(xxh3_64(&got), xxh3_64(&data));
    // A child forked after this process used the runtime (a DataLoader worker) makes its own:
    // before, it hung until killed.
    let want = xxh3_64(&data);
    // SAFETY: the child only reads the object and leaves with _exit; malloc is fork-safe in
    // glibc, and the child touches no lock another thread of the parent may hold but the
    // runtime's, which it does not use.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let ok = read().is_ok_and(|b| xxh3_64(&b) == want);
        // SAFETY: ends the child without running the parent's destructors or test harness.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        let mut status = 0;
        // SAFETY: waits for our own child.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if done == pid {
            break status;
        }
        if Instant::now() > deadline {
            // SAFETY: our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            panic!("the forked child hung reading the object");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child: {status}"
    );
}

#[test]
fn options_are_checked_before_any_request() {
    let e = Object::open(
        "s3://bucket/key",
        &ObjectOptions::default().with_requests_in_flight(0),
    )
    .unwrap_err();
    assert!(matches!(e, Error::InvalidSetting(_)), "{e}");
    // Debug never shows a secret.
    let shown = format!("{:?}", opts("http://127.0.0.1:1"));
    assert!(
        shown.contains(ACCESS_KEY) && !shown.contains(SECRET_KEY),
        "{shown}"
    );
}

#[test]
fn objects_written_through_the_filer_read_the_same() {
    let test = "objects_written_through_the_filer_read_the_same";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let data = gpufeed_testkit::random_bytes(777_777, gpufeed_testkit::seed(test));
    server.put("filer/obj.bin", &data).expect("filer put");
    let obj = Object::open(&url("filer/obj.bin"), &opts(&server.endpoint)).expect("open");
    assert_eq!(xxh3_64(&obj.read_all().expect("read")), xxh3_64(&data));
}

#[test]
fn a_pattern_lists_the_matching_keys_of_its_folder_sorted() {
    let test = "a_pattern_lists_the_matching_keys_of_its_folder_sorted";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    for key in [
        "shards/train-0002.tar",
        "shards/train-0000.tar",
        "shards/train-0001.tar",
        "shards/val-0000.tar",
        "shards/train-0003.txt",
        "shards/deeper/train-0009.tar",
        "shards/train 5%.tar",
        "other/train-0004.tar",
    ] {
        put(&server, key, key.as_bytes());
    }
    let o = opts(&server.endpoint);
    let names = |pattern: &str| -> Vec<String> {
        gpufeed_object::list(&url(pattern), &o)
            .expect("list")
            .iter()
            .map(|u| u.key().to_string())
            .collect()
    };
    // `*` stays within a folder; the keys come sorted, whatever order they were written in.
    assert_eq!(
        names("shards/train-*.tar"),
        [
            "shards/train-0000.tar",
            "shards/train-0001.tar",
            "shards/train-0002.tar"
        ]
    );
    assert_eq!(names("shards/train*.tar")[0], "shards/train 5%.tar");
    assert_eq!(
        names("shards/train-000[02].tar"),
        ["shards/train-0000.tar", "shards/train-0002.tar"]
    );
    assert_eq!(
        names("shards/*/train-*.tar"),
        ["shards/deeper/train-0009.tar"]
    );
    // Each listed URL opens and reads its own object (a key with a space and a % among them).
    for u in gpufeed_object::list(&url("shards/train*.tar"), &o).expect("list") {
        let obj = Object::open_url(u.clone(), &o).expect("open");
        assert_eq!(obj.read_all().expect("read"), u.key().as_bytes());
    }
    // No wildcard: the URL itself, unlisted (it need not exist yet).
    assert_eq!(names("shards/none.tar"), ["shards/none.tar"]);
    let err = gpufeed_object::list(&url("shards/test-*.tar"), &o).unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    assert!(err.to_string().contains("no key matches"), "{err}");
    let err = gpufeed_object::list("https://example.com/data/train-*.tar", &o).unwrap_err();
    assert!(
        matches!(err, Error::InvalidUrl { .. }) && err.to_string().contains("only s3:// buckets"),
        "{err}"
    );
    let err = gpufeed_object::list(&url("shards/train-[.tar"), &o).unwrap_err();
    assert!(err.to_string().contains("not a pattern"), "{err}");
}

#[test]
fn objects_of_one_bucket_share_connections_but_never_credentials() {
    let test = "objects_of_one_bucket_share_connections_but_never_credentials";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    let shards: Vec<Vec<u8>> = (0..24u64)
        .map(|i| gpufeed_testkit::random_bytes(4096 + 7 * i as usize, seed + i))
        .collect();
    for (i, bytes) in shards.iter().enumerate() {
        put(&server, &format!("share/{i}.bin"), bytes);
    }
    let proxy = FaultProxy::start(server.addr, Faults::default()).expect("proxy");
    let o = opts(&proxy.endpoint).with_requests_in_flight(1);
    // Opened and read one after another, all held, as a data set's shards are.
    let mut held = Vec::new();
    for (i, bytes) in shards.iter().enumerate() {
        let obj = Object::open(&url(&format!("share/{i}.bin")), &o).expect("open");
        assert_eq!(xxh3_64(&obj.read_all().expect("read")), xxh3_64(bytes));
        held.push(obj);
    }
    let connections = proxy.connections.load(std::sync::atomic::Ordering::Acquire);
    assert!(
        connections < 6,
        "{connections} connections for 24 objects read one after another: each object opened its own"
    );
    // Opened, read and let go one after another (a checkpoint loaded again and again): the
    // store stays among the recent ones, and so do its connections.
    drop(held);
    let before = proxy.connections.load(std::sync::atomic::Ordering::Acquire);
    for (i, bytes) in shards.iter().enumerate().take(6) {
        let obj = Object::open(&url(&format!("share/{i}.bin")), &o).expect("open");
        assert_eq!(xxh3_64(&obj.read_all().expect("read")), xxh3_64(bytes));
    }
    let opened = proxy.connections.load(std::sync::atomic::Ordering::Acquire) - before;
    assert!(
        opened < 3,
        "{opened} new connections for 6 objects each let go before the next: each built a store"
    );
    // Other credentials through the same endpoint get a store of their own, refused.
    let wrong = o
        .clone()
        .with_credentials(Credentials::new(ACCESS_KEY, "wrong-secret"));
    let e = Object::open(&url("share/0.bin"), &wrong).unwrap_err();
    assert!(matches!(e, Error::AccessDenied { .. }), "{e}");
    // And the right ones still read after the refusal.
    let again = Object::open(&url("share/1.bin"), &o).expect("open again");
    assert_eq!(
        xxh3_64(&again.read_all().expect("read")),
        xxh3_64(&shards[1])
    );
}
