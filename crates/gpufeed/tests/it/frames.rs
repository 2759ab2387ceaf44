//! Frames between real processes through a shared-memory ring (`gpufeed::frames`, the CPU half
//! of the real-time case study): a producer process paints frames into the ring, this process
//! takes them in order, checks their pixels and transforms them; a producer killed while it
//! works loses nothing it published, its slot is reclaimed, and a new producer goes on.

use std::time::Duration;

use gpufeed::frames::{self, FrameFormat};
use gpufeed::ipc::BatchRing;

const ROLE: &str = "frames-producer";

/// A producer process over ring `name`: frames `first..first + count` at `fps` (0: as fast as
/// slots free up).
fn producer(name: &str, first: u64, count: u64, fps: f64) -> std::process::Command {
    let mut cmd = gpufeed_testkit::child_command("frames::producer_dispatcher", ROLE, &[]);
    cmd.env("GPUFEED_IT_RING", name)
        .env("GPUFEED_IT_FRAMES", format!("{first} {count} {fps}"));
    cmd
}

const FORMAT: FrameFormat = FrameFormat {
    width: 640,
    height: 360,
};

/// The producer side, run only as a child of the tests below.
#[test]
fn producer_dispatcher() {
    if std::env::var(gpufeed_testkit::CHILD_ROLE).as_deref() != Ok(ROLE) {
        return;
    }
    let name = std::env::var("GPUFEED_IT_RING").expect("ring name");
    let spec = std::env::var("GPUFEED_IT_FRAMES").expect("frames");
    let v: Vec<f64> = spec
        .split(' ')
        .map(|x| x.parse().expect("number"))
        .collect();
    let ring = BatchRing::open(&name).expect("open the ring");
    let (first, count, fps) = (v[0] as u64, v[1] as u64, v[2]);
    let stats = frames::produce(&ring, FORMAT, fps, first..first + count).expect("produce");
    println!("PRODUCED {} {}", stats.sent, stats.dropped);
}

#[test]
fn frames_cross_processes_in_order_with_their_pixels() {
    let ring = BatchRing::create_unique(4, FORMAT.slot_bytes()).expect("ring");
    let name = ring.segment().name().expect("a named ring").to_owned();
    let mut child = producer(&name, 0, 120, 0.0).spawn().expect("producer");
    let mut planar = vec![0f32; FORMAT.bytes()];
    let seen = frames::consume(&ring, FORMAT, 120, Duration::from_secs(20), |h, px| {
        assert!(frames::check(h.seq, FORMAT, px), "frame {}'s pixels", h.seq);
        frames::to_planar_f32(px, FORMAT, &mut planar);
        Ok(())
    })
    .expect("consume");
    assert!(child.wait().expect("wait").success());
    let order: Vec<u64> = seen.iter().map(|&(s, _)| s).collect();
    assert_eq!(order, (0..120).collect::<Vec<_>>(), "every frame, in order");
    let stats = frames::latency_stats(&seen, 120, None);
    assert_eq!(stats.dropped, 0);
    assert!(
        stats.p50_ms > 0.0 && stats.max_ms >= stats.p99_ms,
        "{stats:?}"
    );
}

#[test]
fn a_killed_producer_loses_only_what_it_had_not_published() {
    let ring = BatchRing::create_unique(4, FORMAT.slot_bytes()).expect("ring");
    // A short lease: the dead producer's slot is reclaimed soon after it is gone.
    ring.set_lease(Duration::from_millis(200));
    let name = ring.segment().name().expect("a named ring").to_owned();
    let mut first = producer(&name, 0, 1_000_000, 0.0)
        .spawn()
        .expect("producer");
    let mut seen = Vec::new();
    let consumed = frames::consume(&ring, FORMAT, 40, Duration::from_secs(20), |h, px| {
        assert!(frames::check(h.seq, FORMAT, px), "frame {}", h.seq);
        Ok(())
    })
    .expect("first frames");
    seen.extend(consumed);
    // Killed while it paints or waits for a slot.
    first.kill().expect("kill");
    first.wait().expect("reap");
    // Everything it published still arrives; then nothing more.
    let rest = frames::consume(
        &ring,
        FORMAT,
        u64::MAX,
        Duration::from_millis(500),
        |h, px| {
            assert!(frames::check(h.seq, FORMAT, px), "frame {}", h.seq);
            Ok(())
        },
    )
    .expect("the published rest");
    seen.extend(rest);
    let last = seen.last().map(|&(s, _)| s).expect("frames");
    let order: Vec<u64> = seen.iter().map(|&(s, _)| s).collect();
    assert_eq!(
        order,
        (0..=last).collect::<Vec<_>>(),
        "no published frame lost"
    );
    ring.reap();
    assert_eq!(
        ring.stats().claimed,
        0,
        "the dead producer's slot was reclaimed"
    );
    // A new producer goes on from the next frame number.
    let mut second = producer(&name, last + 1, 30, 0.0)
        .spawn()
        .expect("producer 2");
    let more = frames::consume(
        &ring,
        FORMAT,
        last + 31,
        Duration::from_secs(20),
        |h, px| {
            assert!(frames::check(h.seq, FORMAT, px), "frame {}", h.seq);
            Ok(())
        },
    )
    .expect("the second producer's frames");
    assert!(second.wait().expect("wait").success());
    let order: Vec<u64> = more.iter().map(|&(s, _)| s).collect();
    assert_eq!(order, (last + 1..last + 31).collect::<Vec<_>>());
}
