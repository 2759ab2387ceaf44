//! NCCL on a real GPU: a communicator of one rank broadcasts in place and tears down; a
//! communicator whose other rank never comes is given up after its timeout, or as soon as the
//! caller's check of the other ranks fails; bad parts are refused before NCCL sees them.

use std::time::{Duration, Instant};

use gpufeed_cuda::{Error, Gpu, NcclComm, NcclId};
use xxhash_rust::xxh3::xxh3_64;

use crate::{gpu_or_skip, random_bytes};

/// GPU 0 and NCCL, or None after printing why the test is skipped (a GPU machine,
/// `GPUFEED_REQUIRE_GPU=1`, must have NCCL).
fn ready(test: &str) -> Option<Gpu> {
    let gpu = gpu_or_skip(test)?;
    match gpufeed_cuda::nccl_version() {
        Ok(_) => Some(gpu),
        Err(e) => {
            assert!(!gpufeed_testkit::gpu_required(), "{test}: {e}");
            gpufeed_testkit::skip(test, &e);
            None
        }
    }
}

#[test]
fn a_communicator_of_one_broadcasts_in_place_and_refuses_bad_parts() {
    let Some(gpu) = ready("a_communicator_of_one_broadcasts_in_place_and_refuses_bad_parts") else {
        return;
    };
    let data = random_bytes((5 << 20) + 13, 91);
    let mut buf = gpu.default_stream().clone_htod(&data).expect("upload");
    let id = NcclId::new().expect("an id");
    let mut comm = NcclComm::init(&gpu, &id, 0, 1, Duration::from_secs(30), || {
        Ok::<(), Error>(())
    })
    .expect("a communicator of one");
    assert_eq!((comm.rank(), comm.world()), (0, 1));
    {
        let mut bc = comm.broadcasts(buf.as_view_mut()).expect("broadcasts");
        let len = data.len();
        let bad = bc.round(&[(0, 0..len + 1)], || Ok::<(), Error>(()));
        assert!(matches!(bad, Err(Error::OutOfBounds { .. })), "{bad:?}");
        let bad = bc.round(&[(1, 0..len)], || Ok::<(), Error>(()));
        assert!(
            matches!(bad, Err(Error::OutOfBounds { .. })),
            "a root that is no rank: {bad:?}"
        );
        bc.round(&[(0, 0..len / 2)], || Ok::<(), Error>(()))
            .expect("round 1");
        bc.round(&[(0, len / 2..len)], || Ok::<(), Error>(()))
            .expect("round 2");
        bc.wait(|| Ok::<(), Error>(())).expect("wait");
    }
    assert!(!comm.is_broken());
    drop(comm);
    let back = gpu.to_vec(&buf).expect("download");
    assert_eq!(xxh3_64(&back), xxh3_64(&data), "in place: the bytes stay");

    // Started without waiting: rounds given while it comes up are queued, `wait` issues them.
    let id = NcclId::new().expect("an id");
    let t = Instant::now();
    let mut comm = NcclComm::start(&gpu, &id, 0, 1, Duration::from_secs(30)).expect("started");
    {
        let mut bc = comm.broadcasts(buf.as_view_mut()).expect("broadcasts");
        let len = data.len();
        for k in 0..4 {
            bc.round(&[(0, k * len / 4..(k + 1) * len / 4)], || {
                Ok::<(), Error>(())
            })
            .expect("a round, queued or issued");
        }
        bc.wait(|| Ok::<(), Error>(())).expect("wait");
    }
    assert!(comm.is_up() && !comm.is_broken());
    assert!(
        comm.setup_waited() <= t.elapsed(),
        "{:?}",
        comm.setup_waited()
    );
    drop(comm);
    let back = gpu.to_vec(&buf).expect("download");
    assert_eq!(xxh3_64(&back), xxh3_64(&data), "started: the bytes stay");
}

#[test]
fn a_communicator_whose_other_rank_never_comes_is_given_up() {
    let Some(gpu) = ready("a_communicator_whose_other_rank_never_comes_is_given_up") else {
        return;
    };
    // The timeout, with every rank (as far as the check knows) alive.
    let id = NcclId::new().expect("an id");
    let t = Instant::now();
    let e = NcclComm::init(&gpu, &id, 0, 2, Duration::from_secs(2), || {
        Ok::<(), Error>(())
    })
    .expect_err("rank 1 never joins");
    let waited = t.elapsed();
    assert!(
        matches!(&e, Error::Nccl { message, .. } if message.contains("not done after")),
        "{e}"
    );
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(20),
        "{waited:?}"
    );
    // The same through `start`: a round is queued, `wait` gives up after the timeout.
    let id = NcclId::new().expect("an id");
    let mut comm = NcclComm::start(&gpu, &id, 0, 2, Duration::from_secs(2)).expect("started");
    let mut buf = gpu
        .default_stream()
        .clone_htod(&[7u8; 4096])
        .expect("upload");
    let t = Instant::now();
    {
        let mut bc = comm.broadcasts(buf.as_view_mut()).expect("broadcasts");
        bc.round(&[(0, 0..2048), (1, 2048..4096)], || Ok::<(), Error>(()))
            .expect("queued");
        let e = bc
            .wait(|| Ok::<(), Error>(()))
            .expect_err("rank 1 never joins");
        assert!(
            matches!(&e, Error::Nccl { message, .. } if message.contains("not done after")),
            "{e}"
        );
    }
    assert!(comm.is_broken());
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    drop(comm);
    // The caller's check fails (another rank died): given up at once, with its error.
    let id = NcclId::new().expect("an id");
    let t = Instant::now();
    let e = NcclComm::init(&gpu, &id, 0, 2, Duration::from_secs(60), || {
        match t.elapsed() > Duration::from_millis(300) {
            true => Err(Error::OutOfBounds {
                len: 1,
                offset: 2,
                capacity: 3,
            }),
            false => Ok(()),
        }
    })
    .expect_err("the check fails");
    assert!(matches!(e, Error::OutOfBounds { offset: 2, .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    // The GPU still works.
    let data = random_bytes(1 << 20, 92);
    let buf = gpu.default_stream().clone_htod(&data).expect("upload");
    assert_eq!(gpu.to_vec(&buf).expect("download"), data);
}
