//! Real processes: several producers, producers killed mid-write, a dead consumer, fd passing.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use gpufeed_ipc::{BatchRing, Error};
use gpufeed_os::ShmSegment;

use crate::{child, decode};

#[test]
fn producer_processes_deliver_every_batch_exactly_once() {
    let ring = BatchRing::create_unique(8, 64 * 1024).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    let consumer = ring.consumer().expect("consumer");
    let (producers, count) = (3u32, 150u32);
    let mut children: Vec<_> = (0..producers)
        .map(|p| {
            child::command(
                "produce",
                &[
                    ("GPUFEED_IT_RING", name.clone()),
                    ("GPUFEED_IT_PRODUCER", p.to_string()),
                    ("GPUFEED_IT_COUNT", count.to_string()),
                ],
            )
            .spawn()
            .expect("spawn producer")
        })
        .collect();
    let mut seen = HashSet::new();
    let mut next_index = vec![0u32; producers as usize];
    while seen.len() < (producers * count) as usize {
        let batch = consumer
            .next(Duration::from_secs(30))
            .expect("a batch within 30 s");
        let (p, i) = decode(&batch.to_vec()).expect("intact batch");
        assert!(seen.insert((p, i)), "batch {p}/{i} delivered twice");
        assert_eq!(
            i, next_index[p as usize],
            "producer {p}'s batches out of order"
        );
        next_index[p as usize] += 1;
    }
    for c in &mut children {
        assert!(c.wait().expect("wait").success(), "a producer failed");
    }
    assert!(
        consumer.try_next().expect("attached").is_none(),
        "more batches than produced"
    );
}

/// Producers SIGKILLed at random moments, many times: no batch is torn, lost or delivered twice.
/// Each producer numbers its batches and, after each publish returns, stores how many it
/// published in a counter segment; the consumer must then have received exactly 0..n of that
/// producer, in order, where n is the counter or the counter + 1 (killed between publishing and
/// counting). Only the batch being written when the kill landed is never delivered.
#[test]
fn producers_killed_mid_write_never_deliver_torn_lost_or_duplicate_batches() {
    let iterations: u32 = std::env::var("GPUFEED_CRASH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let ring = BatchRing::create_unique(4, 256 * 1024).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    let counter = ShmSegment::create_unique(4096).expect("counter segment");
    let counter_name = counter.name().expect("named").to_owned();
    let consumer = ring.consumer().expect("consumer");
    let mut delivered = 0u64;
    let mut killed_mid_write = 0u32;
    let mut seed = 0x5EED_u64;
    for iteration in 0..iterations {
        counter.write_at(0, &0u64.to_le_bytes()).expect("reset");
        let mut producer = child::command(
            "produce-forever",
            &[
                ("GPUFEED_IT_RING", name.clone()),
                ("GPUFEED_IT_COUNTER", counter_name.clone()),
                ("GPUFEED_IT_PRODUCER", iteration.to_string()),
            ],
        )
        .spawn()
        .expect("spawn");
        // Consume for a pseudo-random while (0-4 ms after the first batch), then SIGKILL.
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let run_for = Duration::from_micros((seed >> 33) % 4000);
        let first = consumer.next(Duration::from_secs(20));
        let deadline = Instant::now() + run_for;
        let mut next_index = 0u32;
        let mut check = |batch: gpufeed_ipc::Batch<'_>| {
            let (p, i) =
                decode(&batch.to_vec()).unwrap_or_else(|e| panic!("iteration {iteration}: {e}"));
            assert_eq!(p, iteration, "a batch of an earlier producer");
            assert_eq!(
                i, next_index,
                "iteration {iteration}: batch {i} after {next_index} (lost or duplicated)"
            );
            next_index += 1;
            delivered += 1;
        };
        check(first.expect("the producer starts producing"));
        while Instant::now() < deadline {
            if let Some(b) = consumer.try_next().expect("attached") {
                check(b);
            }
        }
        producer.kill().expect("SIGKILL");
        producer.wait().expect("reap");
        if ring.stats().claimed > 0 {
            killed_mid_write += 1;
        }
        // Drain: published batches are intact; the slot the producer was writing is reclaimed.
        loop {
            match consumer.next(Duration::from_millis(30)) {
                Ok(b) => check(b),
                Err(Error::Timeout { .. }) => break,
                Err(e) => panic!("iteration {iteration}: {e}"),
            }
        }
        let mut count = [0u8; 8];
        counter.read_at(0, &mut count).expect("read counter");
        let published = u64::from_le_bytes(count);
        let got = u64::from(next_index);
        assert!(
            got == published || got == published + 1,
            "iteration {iteration}: {published} batches published, {got} delivered"
        );
        let stats = ring.stats();
        assert_eq!(
            (stats.claimed, stats.ready, stats.taken),
            (0, 0, 0),
            "iteration {iteration}: {stats:?}"
        );
    }
    eprintln!(
        "{iterations} producers killed ({killed_mid_write} while holding a claimed slot); {delivered} batches delivered, all intact, none lost or twice"
    );
    assert!(delivered >= u64::from(iterations));
    assert!(
        killed_mid_write > 0,
        "no kill landed mid-write: the test did not test reclamation"
    );
}

/// Consumer processes SIGKILLed while they hold a taken batch: the slot comes back, and the
/// producer (this process) keeps going without ever seeing a full ring for good.
#[test]
fn consumers_killed_holding_a_batch_give_the_slot_back() {
    let ring = BatchRing::create_unique(2, 4096).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    let mut seed = 0xC0FFEE_u64;
    let mut killed_holding = 0;
    for iteration in 0..20 {
        let mut consumer = child::command("consume-forever", &[("GPUFEED_IT_RING", name.clone())])
            .spawn()
            .expect("spawn");
        // Produce until the consumer has taken a few batches, then kill it at a random moment.
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let deadline = Instant::now() + Duration::from_micros(2000 + (seed >> 33) % 5000);
        while Instant::now() < deadline {
            if let Ok(mut c) = ring.claim(Duration::from_millis(5)) {
                c.write_at(0, &[iteration as u8; 64]).expect("write");
                c.set_len(64).expect("len");
                c.publish().expect("publish");
            }
        }
        consumer.kill().expect("SIGKILL");
        consumer.wait().expect("reap");
        if ring.stats().taken > 0 {
            killed_holding += 1;
        }
        ring.reap();
        let stats = ring.stats();
        assert_eq!(
            stats.taken, 0,
            "iteration {iteration}: a dead consumer's slot stays taken: {stats:?}"
        );
        // Take what is left ourselves, so that the next iteration starts with a free ring.
        let me = ring.consumer().expect("consumer");
        while me.try_next().expect("attached").is_some() {}
        drop(me);
        assert_eq!(ring.stats().free, 2, "iteration {iteration}");
    }
    eprintln!("20 consumers killed, {killed_holding} while holding a batch");
    assert!(
        killed_holding > 0,
        "no kill landed while a consumer held a batch: the test did not test reclamation"
    );
}

#[test]
fn producers_learn_that_every_consumer_died() {
    let ring = BatchRing::create_unique(2, 4096).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    let status = child::command("consume-and-die", &[("GPUFEED_IT_RING", name)])
        .status()
        .expect("run consumer");
    assert!(status.success());
    assert_producer_learns_consumers_are_gone(&ring, 2);
    // A new consumer revives the ring.
    let consumer = ring.consumer().expect("consumer");
    assert_eq!(
        consumer.try_next().expect("attached").expect("batch").len(),
        1
    );
    ring.claim(Duration::from_secs(1)).expect("a slot again");
}

/// Fills the ring's `slots` slots and asserts that the next claim fails with `ConsumerGone`
/// at once, not after its 10 s timeout.
fn assert_producer_learns_consumers_are_gone(ring: &BatchRing, slots: usize) {
    for _ in 0..slots {
        let mut c = ring.claim(Duration::from_secs(1)).expect("free slot");
        c.set_len(1).expect("len");
        c.publish().expect("publish");
    }
    let t = Instant::now();
    let err = ring.claim(Duration::from_secs(10)).unwrap_err();
    assert!(matches!(err, Error::ConsumerGone), "{err:?}");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "noticed only after {:?}",
        t.elapsed()
    );
    assert!(err.to_string().contains("start a consumer"), "{err}");
}

/// A consumer that drops its `Consumer` (its loop ended, or it panicked and unwound) must not
/// look like one that never came: producers waiting for its slots would wait out their timeout.
#[test]
fn producers_learn_that_every_consumer_left_or_panicked() {
    let ring = BatchRing::create_unique(2, 4096).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    let out = child::command("consume-and-panic", &[("GPUFEED_IT_RING", name)])
        .output()
        .expect("run consumer");
    assert!(!out.status.success(), "the consumer panicked");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("a trainer's bug")
            || String::from_utf8_lossy(&out.stderr).contains("a trainer's bug"),
        "the child ran the panicking role"
    );
    assert_producer_learns_consumers_are_gone(&ring, 2);

    // In this process: a consumer that leaves cleanly, after taking its batches.
    let ring = BatchRing::anonymous(2, 4096).expect("ring");
    {
        let consumer = ring.consumer().expect("consumer");
        let mut c = ring.claim(Duration::from_secs(1)).expect("free slot");
        c.set_len(1).expect("len");
        c.publish().expect("publish");
        drop(consumer.next(Duration::from_secs(1)).expect("the batch"));
    }
    assert_producer_learns_consumers_are_gone(&ring, 2);
    // Its entry is free again: a new consumer registers and takes what was published.
    let consumer = ring.consumer().expect("a consumer again");
    assert!(consumer.try_next().expect("attached").is_some());
    ring.claim(Duration::from_secs(1)).expect("a slot again");
}

/// A consumer that runs in rounds leaves between them: a producer that fills the ring in that
/// gap waits for the next round's registration instead of giving up (`ConsumerGone` only once
/// every consumer has been gone for a quarter of a second).
#[test]
fn a_consumer_between_rounds_is_not_taken_for_gone() {
    let ring = BatchRing::anonymous(2, 4096).expect("ring");
    drop(ring.consumer().expect("the first round's consumer"));
    for _ in 0..2 {
        let mut c = ring.claim(Duration::from_secs(1)).expect("free slot");
        c.set_len(1).expect("len");
        c.publish().expect("publish");
    }
    std::thread::scope(|s| {
        let (registered_tx, registered_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let ring = &ring;
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let consumer = ring.consumer().expect("the next round's consumer");
            drop(consumer.next(Duration::from_secs(1)).expect("a batch"));
            registered_tx.send(()).expect("send");
            // The round lasts until the producer got its slot.
            let _ = done_rx.recv();
        });
        let t = Instant::now();
        let claim = ring.claim(Duration::from_secs(5));
        done_tx.send(()).ok();
        assert!(claim.is_ok(), "{:?} after {:?}", claim.err(), t.elapsed());
        registered_rx.recv().expect("the round ran");
    });
    // Gone for good: the error still comes, within the grace and a wait slice.
    let t = Instant::now();
    let mut c = ring
        .claim(Duration::from_secs(1))
        .expect("the slot the round freed");
    c.set_len(1).expect("len");
    c.publish().expect("publish");
    let err = ring.claim(Duration::from_secs(10)).unwrap_err();
    assert!(matches!(err, Error::ConsumerGone), "{err:?}");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "after {:?}",
        t.elapsed()
    );
}

/// The consumer's next wait fails with `ProducerGone` at once, not after its 10 s timeout.
fn assert_consumer_learns_producers_are_gone(consumer: &gpufeed_ipc::Consumer<'_>) {
    let t = Instant::now();
    let err = consumer.next(Duration::from_secs(10)).unwrap_err();
    assert!(matches!(err, Error::ProducerGone), "{err:?}");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "after {:?}",
        t.elapsed()
    );
    assert!(err.to_string().contains("producer"), "{err}");
}

/// A registered producer that published its batches and left, or that was killed: the
/// consumer gets every published batch, then `ProducerGone` at once rather than its timeout;
/// while one registered producer lives, an empty ring is only a wait.
#[test]
fn consumers_learn_that_every_registered_producer_is_gone() {
    use std::io::BufRead;
    let ring = BatchRing::create_unique(4, 64 * 1024).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    let consumer = ring.consumer().expect("consumer");
    let status = child::command(
        "produce",
        &[
            ("GPUFEED_IT_RING", name.clone()),
            ("GPUFEED_IT_PRODUCER", "3".into()),
            ("GPUFEED_IT_COUNT", "3".into()),
            ("GPUFEED_IT_REGISTER", "1".into()),
        ],
    )
    .status()
    .expect("producer");
    assert!(status.success());
    for want in 0..3 {
        let batch = consumer.next(Duration::from_secs(5)).expect("a batch");
        assert_eq!(
            decode(&batch.to_vec()),
            Ok((3, want)),
            "published, then left"
        );
    }
    assert_consumer_learns_producers_are_gone(&consumer);

    // One registered producer alive (idle) beside the one that left: only a timeout.
    let mut idle = child::command("producer-idle", &[("GPUFEED_IT_RING", name)])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("idle producer");
    // The test harness prints its own lines first; the reader stays open until the end.
    let mut out = std::io::BufReader::new(idle.stdout.take().expect("stdout"));
    let mut line = String::new();
    while line.trim() != "REGISTERED" {
        line.clear();
        assert!(out.read_line(&mut line).expect("its line") > 0, "it ended");
    }
    let err = consumer.next(Duration::from_millis(300)).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    // Killed, it is gone too.
    idle.kill().expect("kill");
    assert_consumer_learns_producers_are_gone(&consumer);
    let _ = idle.wait();
    // A new producer revives the ring.
    let _me = ring.producer().expect("a producer again");
    let err = consumer.next(Duration::from_millis(100)).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
}

#[test]
fn timeouts_and_bounds() {
    let ring = BatchRing::anonymous(1, 1000).expect("ring");
    assert_eq!(ring.slot_bytes(), 1024, "rounded to 256");
    let consumer = ring.consumer().expect("consumer");
    let t = Instant::now();
    assert!(matches!(
        consumer.next(Duration::from_millis(50)),
        Err(Error::Timeout {
            what: "a batch",
            ..
        })
    ));
    assert!(t.elapsed() >= Duration::from_millis(50));
    let mut claim = ring.claim(Duration::from_millis(10)).expect("claim");
    assert!(matches!(
        claim.write_at(1000, &[0; 25]),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(claim.set_len(1025), Err(Error::TooLarge { .. })));
    assert!(matches!(
        ring.claim(Duration::from_millis(20)),
        Err(Error::Timeout {
            what: "a free slot",
            ..
        })
    ));
    drop(claim);
    ring.claim(Duration::from_millis(10))
        .expect("the aborted claim's slot is free again");
}

#[test]
fn memfd_ring_passed_over_a_unix_socket() {
    let ring = BatchRing::anonymous(4, 32 * 1024).expect("ring");
    let dir = std::env::temp_dir().join(format!("gpufeed-ipc-it-{}", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    let listener = std::os::unix::net::UnixListener::bind(&dir).expect("bind");
    let mut child = child::command(
        "fd-producer",
        &[
            ("GPUFEED_IT_SOCKET", dir.display().to_string()),
            ("GPUFEED_IT_COUNT", "40".into()),
        ],
    )
    .spawn()
    .expect("spawn");
    let (sock, _) = listener.accept().expect("accept");
    gpufeed_ipc::send_fd(&sock, std::os::fd::AsFd::as_fd(ring.segment())).expect("send fd");
    let consumer = ring.consumer().expect("consumer");
    for i in 0..40 {
        let b = consumer.next(Duration::from_secs(20)).expect("batch");
        assert_eq!(decode(&b.to_vec()).expect("intact"), (7, i));
    }
    assert!(child.wait().expect("wait").success());
    let _ = std::fs::remove_file(&dir);
}

#[test]
fn segments_that_are_not_rings_are_refused() {
    let seg = ShmSegment::create_unique(64 * 1024).expect("segment");
    seg.write_at(0, &crate::random_bytes(4096, 1))
        .expect("garbage");
    let err = BatchRing::open(seg.name().expect("named")).unwrap_err();
    assert!(matches!(err, Error::InvalidHeader(_)), "{err:?}");

    // A real ring whose header a peer damaged.
    let ring = BatchRing::create_unique(4, 4096).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    ring.segment()
        .write_at(12, &9999u32.to_le_bytes())
        .expect("damage the slot count");
    let err = BatchRing::open(&name).unwrap_err();
    assert!(matches!(err, Error::InvalidHeader(_)), "{err:?}");
    assert!(err.to_string().contains("same version"));
    assert!(matches!(
        BatchRing::open("gpufeed-no-such-ring"),
        Err(Error::Os(gpufeed_os::Error::ShmNotFound { .. }))
    ));
}
