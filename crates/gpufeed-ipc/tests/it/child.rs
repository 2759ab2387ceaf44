//! Child processes: the test binary re-runs itself with `GPUFEED_IT_CHILD=<role>` and only the
//! `child::entry` test; without the variable `entry` returns at once (a dispatcher).

use std::process::{Command, Stdio};
use std::time::Duration;

use gpufeed_ipc::BatchRing;

use crate::{encode, random_bytes};

const ROLE: &str = gpufeed_testkit::CHILD_ROLE;

pub fn command(role: &str, vars: &[(&str, String)]) -> Command {
    let mut cmd = gpufeed_testkit::child_command("child::entry", role, vars);
    cmd.stdout(Stdio::null());
    cmd
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("child needs {name}"))
}

fn num(name: &str) -> u64 {
    var(name).parse().expect("number")
}

/// Produces `count` numbered batches of random lengths into `ring`.
pub fn produce(ring: &BatchRing, producer: u32, count: u32, slow: bool) {
    let cap = ring.slot_bytes() as usize - 16;
    for index in 0..count {
        let len = (u64::from(producer) * 7919 + u64::from(index) * 104_729) as usize % cap;
        let payload = random_bytes(len, u64::from(producer) << 32 | u64::from(index));
        let batch = encode(producer, index, &payload);
        let mut claim = ring.claim(Duration::from_secs(20)).expect("claim");
        if slow {
            // Write in pieces so that a kill lands mid-write.
            for (i, piece) in batch.chunks(4096).enumerate() {
                claim.write_at((i * 4096) as u64, piece).expect("write");
                std::thread::yield_now();
            }
        } else {
            claim.write_at(0, &batch).expect("write");
        }
        claim.set_len(batch.len() as u64).expect("len");
        claim.publish().expect("publish");
    }
}

#[test]
fn entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        "produce" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            produce(
                &ring,
                num("GPUFEED_IT_PRODUCER") as u32,
                num("GPUFEED_IT_COUNT") as u32,
                false,
            );
        }
        "produce-forever" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            produce(&ring, num("GPUFEED_IT_PRODUCER") as u32, u32::MAX, true);
        }
        "consume-and-die" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let consumer = ring.consumer().expect("register");
            std::mem::forget(consumer);
            // Exit without unregistering, as a killed consumer would.
            std::process::exit(0);
        }
        "fd-producer" => {
            let sock =
                std::os::unix::net::UnixStream::connect(var("GPUFEED_IT_SOCKET")).expect("connect");
            let fd = gpufeed_ipc::recv_fd(&sock).expect("receive the ring's fd");
            let ring = BatchRing::from_fd(fd).expect("map the ring");
            produce(&ring, 7, num("GPUFEED_IT_COUNT") as u32, false);
        }
        other => panic!("unknown role {other}"),
    }
}
