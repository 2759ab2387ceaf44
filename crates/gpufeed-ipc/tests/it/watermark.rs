//! The consumer's watermark: published by the consumer, waited on by producers in other
//! processes (futex-woken), a hint that hostile words cannot turn into a panic.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use gpufeed_ipc::{BatchRing, Error, Watermark};

use crate::child;

/// Byte offsets of the watermark's words in the header (layout version 4).
const WORDS: std::ops::Range<usize> = 92..128;

/// A producer process of item 10 of round 5 waits while the consumer's watermark does not
/// reach it (a window of 2: position 8 at least), through one advance that is not enough, and
/// returns soon after the one that is (a futex wake, not its 10 s timeout).
#[test]
fn a_producer_process_waits_until_the_watermark_reaches_its_item() {
    let ring = BatchRing::create_unique(2, 4096).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    let consumer = ring.consumer().expect("consumer");
    assert_eq!(
        ring.watermark(),
        Watermark::default(),
        "a new ring: unpaced"
    );
    consumer
        .publish_watermark(Watermark {
            window: Some(2),
            round: Some(5),
            position: 0,
        })
        .expect("publish");
    let mut child = child::command(
        "wait-watermark",
        &[
            ("GPUFEED_IT_RING", name),
            ("GPUFEED_IT_ROUND", "5".into()),
            ("GPUFEED_IT_ITEM", "10".into()),
        ],
    )
    .stdout(Stdio::piped())
    .spawn()
    .expect("spawn");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    // The test harness prints its own lines around the child's.
    let mut line = |prefix: &str| {
        lines
            .by_ref()
            .map(|l| l.expect("child output"))
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("the child exited before printing {prefix}"))
    };
    line("WAITING");
    std::thread::sleep(Duration::from_millis(200));
    consumer.advance_watermark(7).expect("advance");
    consumer.advance_watermark(3).expect("never down");
    assert_eq!(ring.watermark().position, 7);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().expect("try_wait").is_none(),
        "the producer went on at position 7, window 2, for item 10"
    );
    let t = Instant::now();
    consumer.advance_watermark(8).expect("advance");
    assert_eq!(line("ALLOWED"), "ALLOWED at 8");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "woken after {:?}",
        t.elapsed()
    );
    assert!(child.wait().expect("wait").success());
}

/// A producer waiting on the watermark: a round other than its own keeps it waiting; it gets
/// `Timeout` when the consumer is there but does not come near, and `ConsumerGone` soon after
/// the consumer leaves (not at its timeout).
#[test]
fn a_waiting_producer_times_out_or_learns_that_the_consumer_left() {
    let ring = BatchRing::anonymous(2, 4096).expect("ring");
    let consumer = ring.consumer().expect("consumer");
    consumer
        .publish_watermark(Watermark {
            window: Some(1),
            round: Some(4),
            position: 100,
        })
        .expect("publish");
    let round_3 = |w: &Watermark| w.round == Some(3) && w.limit().is_some_and(|l| l >= 1);
    let t = Instant::now();
    let err = ring
        .wait_watermark(round_3, Duration::from_millis(100))
        .unwrap_err();
    assert!(
        matches!(err, Error::Timeout { .. }) && t.elapsed() >= Duration::from_millis(100),
        "{err:?} after {:?}",
        t.elapsed()
    );
    assert!(err.to_string().contains("watermark"), "{err}");
    std::thread::scope(|s| {
        let ring = &ring;
        let waiter = s.spawn(move || {
            let t = Instant::now();
            (
                ring.wait_watermark(|_| false, Duration::from_secs(10)),
                t.elapsed(),
            )
        });
        std::thread::sleep(Duration::from_millis(100));
        drop(consumer);
        let (result, waited) = waiter.join().expect("waiter");
        assert!(
            matches!(result, Err(Error::ConsumerGone)),
            "{result:?} after {waited:?}"
        );
        assert!(waited < Duration::from_secs(3), "after {waited:?}");
    });
}

/// A ring of layout version 3 (made by a build whose consumers never advance a watermark, so
/// that this build's producers would wait on it in vain) is refused by name.
#[test]
fn a_ring_of_the_previous_layout_is_refused() {
    let ring = BatchRing::create_unique(2, 4096).expect("ring");
    let name = ring.segment().name().expect("named").to_owned();
    ring.segment()
        .write_at(8, &3u32.to_le_bytes())
        .expect("the version of the previous layout");
    let err = BatchRing::open(&name).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidHeader(why) if why.contains("version 3") && why.contains("reads 4")),
        "{err}"
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Whatever another process wrote into the watermark's words (a sequence left odd, a
    /// window and position that overflow when added, unknown flags, a waiter count that
    /// wraps), reading and waiting give a watermark or an error, never a panic; and the next
    /// publish makes it whole again.
    #[test]
    fn hostile_watermark_words_never_panic(
        bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), WORDS.len()),
    ) {
        let ring = BatchRing::anonymous(1, 4096).expect("ring");
        ring.segment().write_at(WORDS.start, &bytes).expect("scribble");
        let w = ring.watermark();
        let _ = w.limit();
        let seen = ring
            .wait_watermark(
                |w| {
                    let _ = w.limit();
                    true
                },
                Duration::from_millis(1),
            )
            .expect("accepted at once");
        let _ = seen.limit();
        let _ = ring.wait_watermark(|w| w.limit() == Some(u64::MAX - 1), Duration::from_millis(1));
        let consumer = ring.consumer().expect("consumer");
        let good = Watermark { window: Some(3), round: Some(u64::MAX), position: u64::MAX };
        consumer.publish_watermark(good).expect("publish");
        proptest::prop_assert_eq!(ring.watermark(), good);
        proptest::prop_assert_eq!(good.limit(), Some(u64::MAX), "saturates");
        consumer.advance_watermark(0).expect("advance");
        proptest::prop_assert_eq!(ring.watermark().position, u64::MAX);
    }
}
