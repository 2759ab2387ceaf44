//! Child processes: the test binary re-runs itself with `GPUFEED_IT_CHILD=<role>` and only the
//! `child::entry` test; without the variable `entry` returns at once (a dispatcher).

use std::process::{Command, Stdio};
use std::time::Duration;

use gpufeed_ipc::BatchRing;
use gpufeed_os::ShmSegment;

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

/// Produces `count` numbered batches of random lengths into `ring`; after each publish
/// returns, stores how many were published in the first 8 bytes of `published` (if given).
pub fn produce(
    ring: &BatchRing,
    producer: u32,
    count: u32,
    slow: bool,
    published: Option<&ShmSegment>,
) {
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
        if let Some(seg) = published {
            seg.write_at(0, &u64::from(index + 1).to_le_bytes())
                .expect("count");
        }
    }
}

/// What a call answered, in a word for the test to match.
fn outcome(r: gpufeed_ipc::Result<()>) -> String {
    match r {
        Ok(()) => "Ok".into(),
        Err(gpufeed_ipc::Error::Detached { .. }) => "Detached".into(),
        Err(gpufeed_ipc::Error::SlotLost { .. }) => "SlotLost".into(),
        Err(e) => format!("other: {e}"),
    }
}

#[test]
fn entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        // With GPUFEED_IT_REGISTER: as a registered producer, which leaves when done.
        "produce" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let _me =
                std::env::var_os("GPUFEED_IT_REGISTER").map(|_| ring.producer().expect("register"));
            produce(
                &ring,
                num("GPUFEED_IT_PRODUCER") as u32,
                num("GPUFEED_IT_COUNT") as u32,
                false,
                None,
            );
        }
        // A producer of item GPUFEED_IT_ITEM of round GPUFEED_IT_ROUND: says it waits, waits
        // until the consumer's watermark allows it (10 s at most), and prints what it saw (the
        // position, or the error).
        "wait-watermark" => {
            use std::io::Write;
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let (round, item) = (num("GPUFEED_IT_ROUND"), num("GPUFEED_IT_ITEM"));
            println!("WAITING");
            std::io::stdout().flush().expect("flush");
            let allows = |w: &gpufeed_ipc::Watermark| {
                w.round == Some(round) && w.limit().is_some_and(|l| l >= item)
            };
            match ring.wait_watermark(allows, Duration::from_secs(10)) {
                Ok(w) => println!("ALLOWED at {}", w.position),
                Err(e) => println!("ERROR {e}"),
            }
        }
        // A registered producer that says so and then publishes nothing until killed.
        "producer-idle" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let _me = ring.producer().expect("register");
            println!("REGISTERED");
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        "produce-forever" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let counter = ShmSegment::open(&var("GPUFEED_IT_COUNTER")).expect("counter");
            produce(
                &ring,
                num("GPUFEED_IT_PRODUCER") as u32,
                u32::MAX,
                true,
                Some(&counter),
            );
        }
        // Takes batches and holds each for a while, until killed.
        "consume-forever" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let consumer = ring.consumer().expect("register");
            loop {
                if let Ok(batch) = consumer.next(Duration::from_secs(20)) {
                    let _ = batch.to_vec();
                    std::thread::sleep(Duration::from_micros(500));
                }
            }
        }
        // In another PID namespace: claims the ring's slot, writes half a batch, says so, and
        // finishes and publishes it when stdin says `go` (or never, if killed first).
        "ns-hold" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let me = ring.identity();
            let batch = encode(9, 0, &random_bytes(60_000, 9));
            let mut claim = ring.claim(Duration::from_secs(20)).expect("claim");
            claim.write_at(0, &batch[..30_000]).expect("write");
            println!("CLAIMED {} {}", me.pid_ns, me.pid);
            let mut line = String::new();
            if std::io::stdin().read_line(&mut line).expect("stdin") == 0 {
                std::process::exit(3); // the test went away: never publish
            }
            claim.write_at(30_000, &batch[30_000..]).expect("write");
            claim.set_len(batch.len() as u64).expect("len");
            claim.publish().expect("publish");
            println!("PUBLISHED");
        }
        // In another PID namespace: claims a slot, writes the first half of a batch, says so,
        // and when stdin says `go` (after the test stopped and resumed it) writes the second
        // half and publishes, printing what each call answered.
        "ns-stop-produce" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let batch = encode(9, 0, &random_bytes(60_000, 9));
            let mut claim = ring.claim(Duration::from_secs(20)).expect("claim");
            claim.write_at(0, &batch[..30_000]).expect("write");
            println!("CLAIMED");
            let mut line = String::new();
            if std::io::stdin().read_line(&mut line).expect("stdin") == 0 {
                std::process::exit(3);
            }
            println!(
                "WRITE {}",
                outcome(claim.write_at(30_000, &batch[30_000..]))
            );
            claim.set_len(batch.len() as u64).expect("len");
            println!("PUBLISH {}", outcome(claim.publish()));
            println!("CLAIM {}", outcome(ring.try_claim().map(|_| ())));
        }
        // In another PID namespace: takes a batch, says so, and when stdin says `go` reads it,
        // printing what the read answered (and the bytes' hash), then what the next take does.
        "ns-stop-consume" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let consumer = ring.consumer().expect("register");
            let batch = consumer.next(Duration::from_secs(20)).expect("a batch");
            println!("TAKEN {}", batch.len());
            let mut line = String::new();
            if std::io::stdin().read_line(&mut line).expect("stdin") == 0 {
                std::process::exit(3);
            }
            let mut bytes = vec![0u8; batch.len() as usize];
            match batch.read_at(0, &mut bytes) {
                Ok(()) => println!("READ Ok {:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)),
                Err(e) => println!("READ {}", outcome(Err(e))),
            }
            drop(batch);
            println!("NEXT {}", outcome(consumer.try_next().map(|_| ())));
        }
        // Forks after attaching; the child must be refused the parent's ring, attaches on its
        // own, claims a slot and holds it until killed. The parent waits for stdin to close.
        "fork-claim" => {
            let name = var("GPUFEED_IT_RING");
            let ring = BatchRing::open(&name).expect("open ring");
            // SAFETY: the child only makes system calls and allocations (glibc's fork resets
            // the allocator's locks), prints, and never returns into the test harness.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                let refused = match ring.try_claim() {
                    Err(gpufeed_ipc::Error::Forked { .. }) => {
                        matches!(ring.consumer(), Err(gpufeed_ipc::Error::Forked { .. }))
                    }
                    _ => false,
                };
                // Dropping the parent's ring here must neither hang (its heartbeat thread is
                // not in this process) nor detach the parent.
                drop(ring);
                let own = BatchRing::open(&name).expect("open in the child");
                let claim = own.try_claim().expect("attached").expect("a free slot");
                println!("CHILD {} {refused} {}", own.identity().pid, claim.slot());
                loop {
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).expect("stdin");
            // The parent is still attached, its registration intact.
            let c = ring.try_claim().expect("parent attached");
            println!("PARENT {}", c.is_some());
        }
        "consume-and-die" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let consumer = ring.consumer().expect("register");
            std::mem::forget(consumer);
            // Exit without unregistering, as a killed consumer would.
            std::process::exit(0);
        }
        // Registers, then panics: unwinding drops the consumer (it leaves, it is not killed).
        "consume-and-panic" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let _consumer = ring.consumer().expect("register");
            panic!("a trainer's bug");
        }
        "fd-producer" => {
            let sock =
                std::os::unix::net::UnixStream::connect(var("GPUFEED_IT_SOCKET")).expect("connect");
            let fd = gpufeed_ipc::recv_fd(&sock).expect("receive the ring's fd");
            let ring = BatchRing::from_fd(fd).expect("map the ring");
            produce(&ring, 7, num("GPUFEED_IT_COUNT") as u32, false, None);
        }
        "fd-intruder" => {
            let got = crate::rendezvous::intrude(
                num("GPUFEED_IT_OWNER") as u32,
                num("GPUFEED_IT_CLAIM") as u32,
                Duration::from_millis(num("GPUFEED_IT_FOR_MS")),
            );
            println!("INTRUSION {got:?} ");
        }
        "rendezvous" => crate::rendezvous::child(
            &var("GPUFEED_IT_RDV"),
            num("GPUFEED_IT_RANK") as usize,
            num("GPUFEED_IT_WORLD") as usize,
            &var("GPUFEED_IT_RDV_MODE"),
        ),
        other => panic!("unknown role {other}"),
    }
}
