//! Frames between real processes through a shared-memory ring (`gpufeed_load::frames`, the CPU half
//! of the real-time case study): a producer process paints frames into the ring, this process
//! takes them in order, checks their pixels and transforms them; a producer killed while it
//! works loses nothing it published, its slot is reclaimed, and a new producer goes on.

use std::time::Duration;

use gpufeed_frames::frames::{self, FrameFormat};
use gpufeed_ipc::BatchRing;

const ROLE: &str = "frames-producer";

/// A producer process over ring `name`: frames `first..first + count` at `fps` (0: as fast as
/// slots free up), each painted whole.
fn producer(name: &str, first: u64, count: u64, fps: f64) -> std::process::Command {
    producer_painting(name, first, count, fps, false)
}

/// [`producer`], painting only the rows the checks read when `sparse`.
fn producer_painting(
    name: &str,
    first: u64,
    count: u64,
    fps: f64,
    sparse: bool,
) -> std::process::Command {
    let mut cmd = gpufeed_testkit::child_command("frames::producer_dispatcher", ROLE, &[]);
    cmd.env("GPUFEED_IT_RING", name).env(
        "GPUFEED_IT_FRAMES",
        format!("{first} {count} {fps} {}", u8::from(sparse)),
    );
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
    let paint = if v[3] == 1.0 {
        frames::Paint::Checked
    } else {
        frames::Paint::Full
    };
    let stats =
        frames::produce_with(&ring, FORMAT, fps, first..first + count, paint).expect("produce");
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

/// The GPU consumer: frames from real producer processes (painted whole, then only the rows
/// the checks read, as fast as they go) arrive in order, every one's result equal to the CPU's
/// on its checked rows, copied from the registered ring; a producer killed mid-run loses only
/// what it had not published and a new one goes on; the baseline's GPU form (a pipe) too.
#[test]
fn frames_transformed_on_the_gpu_equal_the_cpu_and_survive_a_killed_producer() {
    let Some(gpu) = crate::gpu_or_skip(
        "frames_transformed_on_the_gpu_equal_the_cpu_and_survive_a_killed_producer",
    ) else {
        return;
    };
    let mut consumer = frames::GpuFrames::new(&gpu, FORMAT)
        .expect("GPU consumer")
        .with_check_every(1);
    let ring = BatchRing::create_unique(4, FORMAT.slot_bytes()).expect("ring");
    ring.set_lease(Duration::from_millis(200));
    let name = ring.segment().name().expect("a named ring").to_owned();
    let order = |run: &frames::GpuRun| run.run.seen.iter().map(|&(s, _)| s).collect::<Vec<_>>();
    for (first, sparse) in [(0, false), (100, true)] {
        let mut child = producer_painting(&name, first, 100, 0.0, sparse)
            .spawn()
            .expect("producer");
        let run = consumer
            .run_ring(&ring, first + 100, Duration::from_secs(20))
            .expect("GPU run");
        assert!(child.wait().expect("wait").success());
        assert_eq!(
            order(&run),
            (first..first + 100).collect::<Vec<_>>(),
            "sparse {sparse}"
        );
        assert_eq!(run.checked, 100, "every frame checked against the CPU");
        assert!(run.registered, "copies straight from the registered ring");
        assert_eq!(run.copy_ms.len(), 100);
        assert!(run.copy_ms.iter().chain(&run.kernel_ms).all(|&ms| ms > 0.0));
        let busy = run.run.busy.as_secs_f64();
        assert!(busy > 0.0 && busy <= run.run.wall.as_secs_f64(), "{run:?}");
    }
    // Killed mid-run: what it published arrives, then the run ends (idle); a new producer
    // goes on from the next frame.
    let mut doomed = producer(&name, 200, 1_000_000, 0.0)
        .spawn()
        .expect("producer");
    let mut seen = order(
        &consumer
            .run_ring(&ring, 240, Duration::from_secs(20))
            .expect("first frames"),
    );
    doomed.kill().expect("kill");
    doomed.wait().expect("reap");
    seen.extend(order(
        &consumer
            .run_ring(&ring, u64::MAX, Duration::from_millis(500))
            .expect("the published rest"),
    ));
    let last = *seen.last().expect("frames");
    assert_eq!(
        seen,
        (200..=last).collect::<Vec<_>>(),
        "no published frame lost"
    );
    ring.reap();
    assert_eq!(
        ring.stats().claimed,
        0,
        "the dead producer's slot was reclaimed"
    );
    let mut next = producer(&name, last + 1, 20, 0.0)
        .spawn()
        .expect("producer");
    let more = consumer
        .run_ring(&ring, last + 21, Duration::from_secs(20))
        .expect("the new producer's frames");
    assert!(next.wait().expect("wait").success());
    assert_eq!(order(&more), (last + 1..last + 21).collect::<Vec<_>>());

    // The baseline's GPU form: frames through a byte stream into a pageable buffer.
    let mut stream = Vec::new();
    frames::produce_pipe(&mut stream, FORMAT, 0.0, 10).expect("frames into a buffer");
    let run = consumer
        .run_pipe(&mut std::io::Cursor::new(stream))
        .expect("pipe run");
    assert_eq!(order(&run), (0..10).collect::<Vec<_>>());
    assert_eq!((run.checked, run.registered), (10, false));
}
