//! Holders the reaper cannot judge by pid: producers in another PID namespace (a container
//! sharing /dev/shm with `--ipc=host`), and forked children of an attached process.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use gpufeed_ipc::{BatchRing, Error};
use rustix::process::Signal;
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

/// A producer of another namespace killed while holding a claim: its slot comes back at once,
/// long before its lease runs out (the lock it held on its entry was released by the kernel:
/// it is known dead, not only silent).
#[test]
fn a_dead_producer_in_another_pid_namespace_is_reclaimed_by_its_released_lock() {
    let lease = Duration::from_secs(5);
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
        freed_at < lease / 2,
        "reclaimed after {freed_at:?}: judged by its lease of {lease:?}, not its lock"
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

type Lines = std::io::Lines<BufReader<std::process::ChildStdout>>;

/// Spawns `role` as pid 1 of a new PID namespace in a process group of its own, so that one
/// signal stops (or resumes) it with its waiting parent, as `docker pause` freezes a
/// container; `None` (after printing why) where this machine refuses new namespaces.
fn spawn_pausable(test: &str, role: &str, ring: &str) -> Option<(Child, Lines)> {
    use std::os::unix::process::CommandExt;
    let mut cmd = child::command(role, &[("GPUFEED_IT_RING", ring.to_owned())]);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .process_group(0);
    let mut c = gpufeed_testkit::spawn_in_new_pid_namespace(test, &mut cmd)?;
    let lines = BufReader::new(c.stdout.take().expect("stdout")).lines();
    Some((c, lines))
}

fn signal_group(c: &Child, signal: Signal) {
    let group = rustix::process::Pid::from_raw(c.id() as i32).expect("a pid");
    rustix::process::kill_process_group(group, signal).expect("signal the child's group");
}

/// Keeps reaping for four leases, as peers waiting for slots do.
fn reap_for_leases(ring: &BatchRing) {
    let t = Instant::now();
    while t.elapsed() < ring.lease() * 4 {
        ring.reap();
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A producer of another PID namespace stopped (SIGSTOP, as `docker pause` does) past its
/// lease in the middle of a batch: its slot is quarantined, not given to the next producer;
/// resumed, its `write_at` and `publish` answer `Detached` and write nothing, and the batch the
/// consumer gets is the other producer's, byte for byte. (Before, the next producer got the
/// slot at once and the resumed producer's second half landed in that producer's batch, which
/// was delivered.)
#[test]
fn a_stopped_producer_past_its_lease_never_writes_into_another_producers_batch() {
    let test = "a_stopped_producer_past_its_lease_never_writes_into_another_producers_batch";
    let ring = BatchRing::create_unique(1, 64 * 1024).expect("ring");
    ring.set_lease(Duration::from_millis(200));
    let name = ring.segment().name().expect("named").to_owned();
    let consumer = ring.consumer().expect("consumer");
    let Some((mut paused, mut lines)) = spawn_pausable(test, "ns-stop-produce", &name) else {
        return;
    };
    expect_line(&mut lines, "CLAIMED");
    signal_group(&paused, Signal::STOP);
    reap_for_leases(&ring);
    let theirs = encode(5, 0, &random_bytes(60_000, 5));
    let (stats, write, publish, claim) = std::thread::scope(|s| {
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let (ring, theirs) = (&ring, &theirs);
        let other = s.spawn(move || -> gpufeed_ipc::Result<()> {
            let mut claim = ring.claim(Duration::from_secs(20))?;
            claim.write_at(0, theirs)?;
            claim.set_len(theirs.len() as u64)?;
            // Publish only once the stopped producer has run again.
            let _ = wait.recv();
            claim.publish()
        });
        std::thread::sleep(Duration::from_millis(300));
        let stats = ring.stats();
        signal_group(&paused, Signal::CONT);
        paused
            .stdin
            .as_mut()
            .expect("stdin")
            .write_all(b"go\n")
            .expect("tell it to go on");
        let write = expect_line(&mut lines, "WRITE");
        let publish = expect_line(&mut lines, "PUBLISH");
        let claim = expect_line(&mut lines, "CLAIM");
        go.send(()).expect("the other producer waits");
        other
            .join()
            .expect("the other producer")
            .expect("the other producer publishes its batch");
        (stats, write, publish, claim)
    });
    let batch = consumer.next(Duration::from_secs(5)).expect("a batch");
    let bytes = batch.to_vec();
    let mixed = bytes
        .iter()
        .zip(&theirs)
        .position(|(a, b)| a != b)
        .map_or(String::new(), |at| format!(", differing from byte {at}"));
    assert_eq!(
        (bytes.len(), xxh3_64(&bytes)),
        (theirs.len(), xxh3_64(&theirs)),
        "the delivered batch is not the other producer's alone{mixed}"
    );
    drop(batch);
    assert_eq!(
        (write.as_str(), publish.as_str(), claim.as_str()),
        ("Detached", "Detached", "Detached"),
        "what the resumed producer's write_at, publish and next claim answered"
    );
    assert_eq!(
        (stats.quarantined, stats.claimed),
        (1, 0),
        "while it was stopped its slot was quarantined, not claimed: {stats:?}"
    );
    assert!(
        consumer.try_next().expect("attached").is_none(),
        "the stopped producer's batch was delivered"
    );
    assert!(paused.wait().expect("wait").success());
}

/// A consumer of another PID namespace stopped past its lease while it holds a batch: the slot
/// is quarantined, not refilled while the consumer may still read it; resumed, its `read_at`
/// answers `Detached` (its next take too), and the slot is free again once it let go of the
/// batch. (Before, the slot was freed and refilled under the stopped consumer, which then read
/// the next batch's bytes as its own.)
#[test]
fn a_stopped_consumer_past_its_lease_keeps_its_batch_until_it_lets_go() {
    let test = "a_stopped_consumer_past_its_lease_keeps_its_batch_until_it_lets_go";
    let ring = BatchRing::create_unique(1, 64 * 1024).expect("ring");
    ring.set_lease(Duration::from_millis(200));
    let name = ring.segment().name().expect("named").to_owned();
    // A consumer here too, so that the producer below is not told that consumers are gone.
    let _here = ring.consumer().expect("consumer");
    let ours = encode(1, 0, &random_bytes(40_000, 1));
    let mut c = ring.claim(Duration::from_secs(1)).expect("claim");
    c.write_at(0, &ours).expect("write");
    c.set_len(ours.len() as u64).expect("len");
    c.publish().expect("publish");
    let Some((mut paused, mut lines)) = spawn_pausable(test, "ns-stop-consume", &name) else {
        return;
    };
    expect_line(&mut lines, "TAKEN");
    signal_group(&paused, Signal::STOP);
    reap_for_leases(&ring);
    let stats = ring.stats();
    let refill = ring.claim(Duration::from_millis(300)).map(|mut c| {
        let next = encode(2, 0, &random_bytes(40_000, 2));
        c.write_at(0, &next).expect("write");
        c.set_len(next.len() as u64).expect("len");
        c.publish().expect("publish");
    });
    signal_group(&paused, Signal::CONT);
    paused
        .stdin
        .as_mut()
        .expect("stdin")
        .write_all(b"go\n")
        .expect("tell it to go on");
    let read = expect_line(&mut lines, "READ");
    let next = expect_line(&mut lines, "NEXT");
    assert!(
        read == "Detached" || read == format!("Ok {:016x}", xxh3_64(&ours)),
        "the stopped consumer read another batch's bytes as its own: {read}"
    );
    assert!(
        matches!(refill, Err(Error::Timeout { .. })),
        "the slot was refilled while its stopped consumer held it: {refill:?} ({stats:?})"
    );
    assert_eq!((read.as_str(), next.as_str()), ("Detached", "Detached"));
    assert_eq!(stats.quarantined, 1, "{stats:?}");
    assert!(paused.wait().expect("wait").success());
    ring.claim(Duration::from_secs(5))
        .expect("the slot is free again once the consumer let go of it");
}
