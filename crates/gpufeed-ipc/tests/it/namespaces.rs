//! Holders the reaper cannot judge by pid: producers in another PID namespace (a container
//! sharing /dev/shm with `--ipc=host`), and forked children of an attached process.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use gpufeed_ipc::BatchRing;
use xxhash_rust::xxh3::xxh3_64;

use crate::{child, decode, encode, random_bytes};

/// Spawns `ns-hold` as pid 1 of a new PID namespace; returns it with its output lines, or
/// `None` (after printing why) where this machine refuses new namespaces.
fn spawn_in_namespace(
    test: &str,
    ring: &str,
) -> Option<(Child, std::io::Lines<BufReader<std::process::ChildStdout>>)> {
    let mut cmd = child::command("ns-hold", &[("GPUFEED_IT_RING", ring.to_owned())]);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut c = gpufeed_testkit::spawn_in_new_pid_namespace(test, &mut cmd)?;
    let lines = BufReader::new(c.stdout.take().expect("stdout")).lines();
    Some((c, lines))
}

/// Reads lines until one starts with `prefix`; returns the rest of it.
fn expect_line(lines: &mut impl Iterator<Item = std::io::Result<String>>, prefix: &str) -> String {
    for line in lines.by_ref() {
        let line = line.expect("child output");
        if let Some(rest) = line.strip_prefix(prefix) {
            return rest.trim().to_owned();
        }
    }
    panic!("the child exited before printing {prefix}");
}

/// A live producer in another PID namespace holds its claimed slot however often we reap and
/// however long it takes (longer than several leases, since it renews its heartbeat); a local
/// producer cannot take the slot, and its batch then arrives whole. Before holders were judged
/// by namespace, its pid (1 in its namespace) named another process here: the slot was freed
/// and overwritten.
#[test]
fn a_live_producer_in_another_pid_namespace_keeps_its_slot() {
    let ring = BatchRing::create_unique(1, 64 * 1024).expect("ring");
    ring.set_lease(Duration::from_millis(200));
    let name = ring.segment().name().expect("named").to_owned();
    let consumer = ring.consumer().expect("consumer");
    let Some((mut producer, mut lines)) = spawn_in_namespace("a_live_producer", &name) else {
        return;
    };
    let ids = expect_line(&mut lines, "CLAIMED");
    let (ns, pid) = ids.split_once(' ').expect("ns and pid");
    let ns: u64 = ns.parse().expect("ns");
    assert_ne!(
        ns,
        ring.identity().pid_ns,
        "the child is in our PID namespace"
    );
    assert_eq!(pid, "1", "the child is pid 1 of its namespace");

    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        assert_eq!(
            ring.reap(),
            0,
            "a live holder of another namespace was reaped"
        );
        assert!(
            ring.try_claim().expect("attached").is_none(),
            "a local producer got the slot the other namespace's producer is writing"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    producer
        .stdin
        .as_mut()
        .expect("stdin")
        .write_all(b"go\n")
        .expect("tell the producer to finish");
    let batch = consumer
        .next(Duration::from_secs(20))
        .expect("the batch arrives");
    let bytes = batch.to_vec();
    assert_eq!(decode(&bytes), Ok((9, 0)), "torn batch");
    assert_eq!(
        xxh3_64(&bytes),
        xxh3_64(&encode(9, 0, &random_bytes(60_000, 9))),
        "the batch differs from what the producer wrote"
    );
    expect_line(&mut lines, "PUBLISHED");
    assert!(producer.wait().expect("wait").success());
}

/// A producer of another namespace killed while holding a claim: its slot comes back once its
/// heartbeat has stood still for a lease, not before.
#[test]
fn a_dead_producer_in_another_pid_namespace_is_reclaimed_after_its_lease() {
    let lease = Duration::from_millis(300);
    let ring = BatchRing::create_unique(1, 64 * 1024).expect("ring");
    ring.set_lease(lease);
    let name = ring.segment().name().expect("named").to_owned();
    let _consumer = ring.consumer().expect("consumer");
    let Some((mut producer, mut lines)) = spawn_in_namespace("a_dead_producer", &name) else {
        return;
    };
    expect_line(&mut lines, "CLAIMED");
    // Keep its stdin open (`wait` would close it, and the producer could finish before the
    // kill reaches it).
    let _stdin = producer.stdin.take();
    producer.kill().expect("SIGKILL");
    producer.wait().expect("wait");
    let killed = Instant::now();
    let mut freed_at = None;
    while killed.elapsed() < Duration::from_secs(10) {
        if ring.reap() == 1 {
            freed_at = Some(killed.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let freed_at = freed_at.unwrap_or_else(|| {
        panic!(
            "the dead producer's slot was never reclaimed: {:?}",
            ring.stats()
        )
    });
    assert!(
        freed_at >= lease,
        "reclaimed after {freed_at:?}, before its lease of {lease:?} ran out"
    );
    ring.try_claim()
        .expect("attached")
        .expect("the slot is free again");
}

/// A child forked after attaching is refused the parent's ring (its slots would be claimed
/// under the parent's identity and leak when the child dies); it attaches on its own, and when
/// it is SIGKILLed holding a claim, the slot is reclaimed although its parent still runs.
#[test]
fn a_forked_child_uses_its_own_identity_and_its_slots_come_back() {
    let ring = BatchRing::create_unique(2, 4096).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    let _consumer = ring.consumer().expect("consumer");
    let mut parent = child::command("fork-claim", &[("GPUFEED_IT_RING", name)])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(parent.stdout.take().expect("stdout")).lines();
    let child_line = expect_line(&mut lines, "CHILD");
    let mut words = child_line.split(' ');
    let child_pid: i32 = words.next().expect("pid").parse().expect("pid");
    assert_eq!(
        words.next(),
        Some("true"),
        "the forked child was not refused its parent's ring"
    );
    assert_eq!(ring.stats().claimed, 1);
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(child_pid).expect("pid"),
        rustix::process::Signal::KILL,
    )
    .expect("SIGKILL the forked child");
    // It stays a zombie (its parent does not wait for it): dead all the same.
    let killed = Instant::now();
    while ring.reap() == 0 {
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "the killed child's slot was never reclaimed"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(ring.stats().claimed, 0);
    drop(parent.stdin.take());
    assert_eq!(
        expect_line(&mut lines, "PARENT"),
        "true",
        "the parent lost its ring"
    );
    assert!(parent.wait().expect("wait").success());
}
