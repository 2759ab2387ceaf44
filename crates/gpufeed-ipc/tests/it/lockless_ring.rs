//! A ring holder that could take no lock: its quarantine is bounded.

use std::time::{Duration, Instant};

use gpufeed_ipc::BatchRing;

use crate::lockholders::{Proc, command};

/// A producer without /proc (no lock, PID namespace unknown: judged only by its heartbeat)
/// claims a slot and is SIGKILLed. After a lease it is silent, detached, its slot
/// quarantined; nothing can prove it dead, so the slot must be freed after a bound (here
/// expected within 40 leases). Failed before the bound: quarantined for ever.
#[test]
fn a_dead_lockless_holder_frees_its_quarantined_slot_after_a_bound() {
    let lease = Duration::from_millis(50);
    let ring = BatchRing::create_unique(1, 4096).expect("ring");
    ring.set_lease(lease);
    let _consumer = ring.consumer().expect("consumer");
    let name = ring.segment().name().expect("named").to_owned();
    let mut cmd = command("ring-claim-hold", &[("GPUFEED_IT_RING", name)]);
    crate::stopped_rank0::without_proc(&mut cmd);
    let mut holder = Proc::spawn(&mut cmd).expect("spawn");
    assert_eq!(holder.line(), "CLAIMED 0");
    holder.child.kill().expect("SIGKILL");
    holder.child.wait().expect("reap");
    let t = Instant::now();
    let got = ring.claim(40 * lease);
    let e = got
        .map(|c| c.slot())
        .map_err(|e| format!("{e}; {:?}", ring.stats()));
    assert!(e.is_ok(), "after {:?}: {e:?}", t.elapsed());
}
