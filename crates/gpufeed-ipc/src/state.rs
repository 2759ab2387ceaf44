//! The slot state machine, on one 64-bit control word per slot.
//!
//! ```text
//!   FREE --claim--> CLAIMED --publish--> READY --take--> TAKEN --release--> FREE
//!                      \--abort / owner died--> FREE        \--taker died--> FREE
//! ```
//!
//! The word packs `state` (bits 0-1), a generation (bits 2-31, bumped by every claim) and a
//! reference to the holder's entry in the process table (bits 32-63, 0 when free; see the
//! `members` module: an entry index and generation, never a bare pid). Every transition is one
//! compare-and-swap of the whole word, so the holder is known atomically with the state and a
//! reclaimer acting on a stale reading fails instead of freeing a slot someone else claimed
//! since (no ABA). Producers' writes into the slot happen-before the consumer's reads through
//! the Release of `publish` and the Acquire of `take`, and the consumer's reads happen-before
//! the next producer's writes through `release` / `claim`.
//!
//! This module is also compiled under `--cfg loom`, where the model checker explores every
//! interleaving of these transitions.

#[cfg(all(loom, test))]
pub(crate) use loom::sync::atomic::AtomicU32;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};

/// An acquire fence (loom's under the model checker).
pub(crate) fn fence_acquire() {
    #[cfg(loom)]
    loom::sync::atomic::fence(Ordering::Acquire);
    #[cfg(not(loom))]
    std::sync::atomic::fence(Ordering::Acquire);
}

pub(crate) const FREE: u64 = 0;
pub(crate) const CLAIMED: u64 = 1;
pub(crate) const READY: u64 = 2;
pub(crate) const TAKEN: u64 = 3;

const STATE_MASK: u64 = 0b11;
const GEN_MASK: u64 = 0xFFFF_FFFC;

pub(crate) fn state(word: u64) -> u64 {
    word & STATE_MASK
}

pub(crate) fn holder(word: u64) -> u32 {
    (word >> 32) as u32
}

fn make(state: u64, gen_bits: u64, pid: u32) -> u64 {
    (u64::from(pid) << 32) | (gen_bits & GEN_MASK) | state
}

/// FREE -> CLAIMED by `me`; returns the new word.
pub(crate) fn try_claim(ctl: &AtomicU64, me: u32) -> Option<u64> {
    let cur = ctl.load(Ordering::Relaxed);
    if state(cur) != FREE {
        return None;
    }
    let next = make(CLAIMED, (cur & GEN_MASK).wrapping_add(4), me);
    ctl.compare_exchange(cur, next, Ordering::Acquire, Ordering::Relaxed)
        .ok()
        .map(|_| next)
}

/// CLAIMED -> READY, by the claimer holding `word`.
pub(crate) fn publish(ctl: &AtomicU64, word: u64) -> bool {
    let next = make(READY, word, holder(word));
    ctl.compare_exchange(word, next, Ordering::Release, Ordering::Relaxed)
        .is_ok()
}

/// READY (as read in `seen`) -> TAKEN by `me`; returns the new word.
pub(crate) fn try_take(ctl: &AtomicU64, seen: u64, me: u32) -> Option<u64> {
    if state(seen) != READY {
        return None;
    }
    let next = make(TAKEN, seen, me);
    ctl.compare_exchange(seen, next, Ordering::Acquire, Ordering::Relaxed)
        .ok()
        .map(|_| next)
}

/// CLAIMED or TAKEN (as held in `word`) -> FREE: a consumer releasing, a producer aborting, or
/// a reclaimer freeing the slot of a dead holder.
pub(crate) fn free(ctl: &AtomicU64, word: u64) -> bool {
    let next = make(FREE, word, 0);
    ctl.compare_exchange(word, next, Ordering::Release, Ordering::Relaxed)
        .is_ok()
}

/// The READY slot holding the lowest publish sequence number, as `(seq, slot, word)`, of
/// `slots` slots whose control words `ctl` and sequence numbers `seq` give.
///
/// One pass over the slots is no snapshot: while it runs, a producer may publish a batch in
/// a slot the pass has already looked at and then a newer one in a slot the pass has not
/// reached, and the pass would pick the newer. Every READY word is loaded with Acquire, so
/// whatever its producer published before the chosen batch is visible to the next pass: look
/// again until a pass finds nothing older. A producer's batches are thus taken in the order
/// it published them.
pub(crate) fn oldest_ready<'a>(
    slots: u32,
    ctl: impl Fn(u32) -> &'a AtomicU64,
    seq: impl Fn(u32) -> u64,
) -> Option<(u64, u32, u64)> {
    let pass = || {
        let mut best: Option<(u64, u32, u64)> = None;
        for slot in 0..slots {
            let word = ctl(slot).load(Ordering::Acquire);
            if state(word) != READY {
                continue;
            }
            let s = seq(slot);
            if best.is_none_or(|(b, _, _)| s < b) {
                best = Some((s, slot, word));
            }
        }
        best
    };
    let mut best = pass()?;
    // Terminates: each round lowers the sequence number.
    while let Some(older) = pass().filter(|o| o.0 < best.0) {
        best = older;
    }
    Some(best)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn transitions() {
        let ctl = AtomicU64::new(FREE);
        let w = try_claim(&ctl, 42).expect("free slot");
        assert_eq!((state(w), holder(w)), (CLAIMED, 42));
        assert!(try_claim(&ctl, 43).is_none(), "claimed twice");
        assert!(try_take(&ctl, w, 7).is_none(), "not ready");
        assert!(publish(&ctl, w));
        let r = ctl.load(Ordering::Acquire);
        let t = try_take(&ctl, r, 7).expect("ready");
        assert_eq!((state(t), holder(t)), (TAKEN, 7));
        assert!(try_take(&ctl, r, 8).is_none(), "taken twice");
        assert!(!free(&ctl, w), "a stale word cannot free the slot");
        assert!(free(&ctl, t));
        let w2 = try_claim(&ctl, 42).expect("free again");
        assert_ne!(
            w2 & GEN_MASK,
            w & GEN_MASK,
            "each claim is a new generation"
        );
        assert!(
            !publish(&ctl, w),
            "the old claim cannot publish the new one"
        );
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// Two producers and a consumer over two slots, every interleaving: each payload is
    /// taken exactly once, and a consumer sees the bytes its producer wrote before publishing.
    /// (Bounded attempts, no spinning, so that the model stays finite.)
    #[test]
    fn claim_publish_take_release() {
        loom::model(|| {
            let ctls = Arc::new([AtomicU64::new(FREE), AtomicU64::new(FREE)]);
            let data = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
            let take = |ctls: &[AtomicU64; 2], data: &[AtomicU64; 2], slot: usize| -> Option<u64> {
                let seen = ctls[slot].load(Ordering::Relaxed);
                let t = try_take(&ctls[slot], seen, 9)?;
                let v = data[slot].load(Ordering::Relaxed);
                assert_eq!(
                    v,
                    u64::from(holder(seen)) * 100,
                    "read before the producer's write"
                );
                assert!(free(&ctls[slot], t));
                Some(v)
            };
            let producers: Vec<_> = (1..=2u32)
                .map(|p| {
                    let (ctls, data) = (ctls.clone(), data.clone());
                    loom::thread::spawn(move || {
                        for slot in 0..2 {
                            if let Some(w) = try_claim(&ctls[slot], p) {
                                data[slot].store(u64::from(p) * 100, Ordering::Relaxed);
                                assert!(publish(&ctls[slot], w));
                                return;
                            }
                        }
                        panic!("producer {p} found no free slot among two");
                    })
                })
                .collect();
            let consumer = {
                let (ctls, data) = (ctls.clone(), data.clone());
                loom::thread::spawn(move || {
                    (0..2)
                        .filter_map(|slot| take(&ctls, &data, slot))
                        .collect::<Vec<_>>()
                })
            };
            for p in producers {
                p.join().expect("producer");
            }
            let mut got = consumer.join().expect("consumer");
            got.extend((0..2).filter_map(|slot| take(&ctls, &data, slot)));
            got.sort_unstable();
            assert_eq!(got, vec![100, 200], "each payload exactly once");
        });
    }

    /// One producer publishes twice, into slot 0 and then slot 1, while a consumer looks for
    /// the oldest batch: every interleaving finds the first batch (a single pass could find
    /// slot 0 not yet ready, then slot 1 ready, and deliver the second batch first).
    #[test]
    fn the_oldest_batch_is_found_whatever_the_interleaving() {
        loom::model(|| {
            let ctls = Arc::new([AtomicU64::new(FREE), AtomicU64::new(FREE)]);
            let seqs = Arc::new([AtomicU64::new(u64::MAX), AtomicU64::new(u64::MAX)]);
            let consumer = {
                let (ctls, seqs) = (ctls.clone(), seqs.clone());
                loom::thread::spawn(move || {
                    oldest_ready(
                        2,
                        |s| &ctls[s as usize],
                        |s| seqs[s as usize].load(Ordering::Relaxed),
                    )
                })
            };
            for slot in 0..2 {
                let w = try_claim(&ctls[slot], 1).expect("free slot");
                seqs[slot].store(slot as u64, Ordering::Relaxed);
                assert!(publish(&ctls[slot], w));
            }
            let found = consumer.join().expect("consumer");
            if let Some((seq, slot, _)) = found {
                assert_eq!(
                    (seq, slot),
                    (0, 0),
                    "the second batch found before the first"
                );
            }
        });
    }

    /// A reclaimer holding a stale reading never frees a slot claimed after it read.
    #[test]
    fn stale_reclaim_fails() {
        loom::model(|| {
            let ctl = Arc::new(AtomicU64::new(FREE));
            let first = try_claim(&ctl, 1).expect("claim");
            let ctl2 = ctl.clone();
            let reclaimer = loom::thread::spawn(move || free(&ctl2, first));
            let freed_by_reclaimer = reclaimer.join().expect("reclaimer");
            if freed_by_reclaimer {
                let again = try_claim(&ctl, 2).expect("claim after reclaim");
                assert!(!free(&ctl, first), "stale word freed a new claim");
                assert!(publish(&ctl, again));
            } else {
                assert!(publish(&ctl, first));
            }
        });
    }
}
