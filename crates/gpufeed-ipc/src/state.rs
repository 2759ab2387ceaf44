//! The slot state machine, on one 64-bit control word per slot.
//!
//! ```text
//!   FREE --claim--> CLAIMED --publish--> READY --take--> TAKEN --release--> FREE
//!                    |  \--abort / owner dead--> FREE       |  \--taker dead--> FREE
//!                    \--owner silent--> QUARANTINED <--------/ taker silent
//!                                          \--holder let go (its drop) / holder dead--> FREE
//! ```
//!
//! The word packs `state` (bits 0-2), a generation (bits 3-31, bumped by every claim) and a
//! reference to the holder's entry in the process table (bits 32-63, 0 when free; see the
//! `members` module: an entry index and generation, never a bare pid). Every transition is one
//! compare-and-swap of the whole word, so the holder is known atomically with the state and a
//! reclaimer acting on a stale reading fails instead of freeing a slot someone else claimed
//! since (no ABA). Producers' writes into the slot happen-before the consumer's reads through
//! the Release of `publish` and the Acquire of `take`, and the consumer's reads happen-before
//! the next producer's writes through `release` / `claim`.
//!
//! # Quarantine
//! A holder that is *silent* (its lease ran out, but it may only be stopped: SIGSTOP,
//! `docker pause`, a debugger) is not known to be done with its slot: resumed, it finishes the
//! copy it was in the middle of, whatever any check said before it stopped. Its slot therefore
//! goes to QUARANTINED, keeping its generation and holder, and nobody claims or takes a
//! quarantined slot. It becomes FREE only when the holder lets go of it itself (its `Claim` or
//! `Batch` drops, after its last access in program order: the Release of that transition
//! orders the holder's writes and reads before the next claimer's Acquire) or is known dead
//! (its process-table entry moved on, or the lock it holds for its life was released by the
//! kernel). So the bytes of a stopped producer land only in its own quarantined slot, never in
//! another producer's batch, and a stopped consumer's batch is not refilled under it.
//!
//! # The consumer's watermark
//! The header also holds how far the consumer got ([`WatermarkWords`]: flags, round,
//! position, window), written by the consumer and read by producers that pace themselves. The
//! words are published as one unit, seqlock style: the writer makes the sequence odd, writes,
//! and makes it even again; a reader keeps a copy only if the sequence was even and the same
//! before and after it read the words, so it never pairs one round with another round's
//! position. The words are a hint from another process: nothing indexes memory with them.
//!
//! This module is also compiled under `--cfg loom`, where the model checker explores every
//! interleaving of these transitions.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// An acquire fence (loom's under the model checker).
pub(crate) fn fence_acquire() {
    #[cfg(loom)]
    loom::sync::atomic::fence(Ordering::Acquire);
    #[cfg(not(loom))]
    std::sync::atomic::fence(Ordering::Acquire);
}

/// A release fence (loom's under the model checker).
fn fence_release() {
    #[cfg(loom)]
    loom::sync::atomic::fence(Ordering::Release);
    #[cfg(not(loom))]
    std::sync::atomic::fence(Ordering::Release);
}

pub(crate) const FREE: u64 = 0;
pub(crate) const CLAIMED: u64 = 1;
pub(crate) const READY: u64 = 2;
pub(crate) const TAKEN: u64 = 3;
/// Taken away from a silent holder (CLAIMED or TAKEN before): nobody may use it until the
/// holder lets go or is known dead.
pub(crate) const QUARANTINED: u64 = 4;

const STATE_MASK: u64 = 0b111;
const GEN_MASK: u64 = 0xFFFF_FFF8;
/// What a claim adds to the generation bits.
const GEN_STEP: u64 = 8;

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
    let next = make(CLAIMED, (cur & GEN_MASK).wrapping_add(GEN_STEP), me);
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

/// The QUARANTINED word of a CLAIMED or TAKEN `word` (same generation and holder).
pub(crate) fn quarantined(word: u64) -> u64 {
    make(QUARANTINED, word, holder(word))
}

/// CLAIMED or TAKEN (as read in `word`) -> QUARANTINED: a reclaimer taking the slot away from
/// a silent holder without giving it to anyone.
pub(crate) fn quarantine(ctl: &AtomicU64, word: u64) -> bool {
    let st = state(word);
    (st == CLAIMED || st == TAKEN)
        && ctl
            .compare_exchange(word, quarantined(word), Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
}

/// QUARANTINED (as read in `word`) -> FREE: the holder letting go (it passes the
/// QUARANTINED word of its own CLAIMED or TAKEN word) or a reclaimer once the holder is known
/// dead. Release: the holder's accesses happen-before the next claimer's writes.
pub(crate) fn release_quarantined(ctl: &AtomicU64, word: u64) -> bool {
    state(word) == QUARANTINED && free(ctl, word)
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

/// A flag of the watermark: the consumer paces producers (the window word holds).
pub(crate) const WM_PACED: u32 = 1;
/// A flag of the watermark: the consumer reads a round (the round word holds).
pub(crate) const WM_IN_ROUND: u32 = 2;

/// The watermark's fields, as written or read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct WatermarkFields {
    pub(crate) flags: u32,
    pub(crate) round: u64,
    pub(crate) position: u64,
    pub(crate) window: u64,
}

/// The watermark's words in the ring's header (see the module docs).
pub(crate) struct WatermarkWords<'a> {
    /// Odd while a writer is in the words after it; also the futex word producers wait on.
    pub(crate) seq: &'a AtomicU32,
    pub(crate) flags: &'a AtomicU32,
    pub(crate) round: &'a AtomicU64,
    pub(crate) position: &'a AtomicU64,
    pub(crate) window: &'a AtomicU64,
}

impl WatermarkWords<'_> {
    fn load_fields(&self) -> WatermarkFields {
        WatermarkFields {
            flags: self.flags.load(Ordering::Relaxed),
            round: self.round.load(Ordering::Relaxed),
            position: self.position.load(Ordering::Relaxed),
            window: self.window.load(Ordering::Relaxed),
        }
    }

    /// Writes between an odd and an even sequence. A sequence left odd by a writer that died
    /// mid-write is taken as it is (made even at the end), so the next writer repairs it.
    /// The closing store is SeqCst: a producer that counted itself a waiter and then read
    /// the old sequence is woken (the caller wakes waiters after this).
    fn write(&self, body: impl FnOnce(&Self)) {
        let odd = self.seq.load(Ordering::Relaxed) | 1;
        self.seq.store(odd, Ordering::Relaxed);
        // Orders the odd sequence before the words: a reader that sees a word of this write
        // sees the sequence move when it looks again.
        fence_release();
        body(self);
        self.seq.store(odd.wrapping_add(1), Ordering::SeqCst);
    }

    /// Publishes all the fields (a round begun or ended, the window set).
    pub(crate) fn publish(&self, f: WatermarkFields) {
        self.write(|w| {
            w.flags.store(f.flags, Ordering::Relaxed);
            w.round.store(f.round, Ordering::Relaxed);
            w.position.store(f.position, Ordering::Relaxed);
            w.window.store(f.window, Ordering::Relaxed);
        });
    }

    /// Moves the position up to `position`, never down.
    pub(crate) fn advance(&self, position: u64) {
        self.write(|w| {
            w.position.fetch_max(position, Ordering::Relaxed);
        });
    }

    /// A copy of the fields that no write was in the middle of, or None (a write was in
    /// progress or came between: look again).
    pub(crate) fn try_read(&self) -> Option<WatermarkFields> {
        let before = self.seq.load(Ordering::Acquire);
        if before & 1 == 1 {
            return None;
        }
        let f = self.load_fields();
        // Orders the reads of the words before the second look at the sequence.
        fence_acquire();
        (self.seq.load(Ordering::Relaxed) == before).then_some(f)
    }

    /// Like [`Self::try_read`], looking again up to `tries` times; then the words as they are
    /// (a writer died mid-write, or a peer scribbles: only a hint either way).
    #[cfg_attr(
        loom,
        allow(dead_code, reason = "used by the ring, which loom does not build")
    )]
    pub(crate) fn read(&self, tries: u32) -> WatermarkFields {
        for _ in 0..tries {
            if let Some(f) = self.try_read() {
                return f;
            }
            std::hint::spin_loop();
        }
        self.load_fields()
    }
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

    #[test]
    fn watermarks_are_written_whole_and_positions_only_rise() {
        let cells: [AtomicU64; 3] = Default::default();
        let (seq, flags) = (AtomicU32::new(0), AtomicU32::new(0));
        let w = WatermarkWords {
            seq: &seq,
            flags: &flags,
            round: &cells[0],
            position: &cells[1],
            window: &cells[2],
        };
        assert_eq!(w.try_read(), Some(WatermarkFields::default()));
        let f = WatermarkFields {
            flags: WM_PACED | WM_IN_ROUND,
            round: 7,
            position: 0,
            window: 4,
        };
        w.publish(f);
        w.advance(5);
        w.advance(3);
        assert_eq!(w.read(1).position, 5, "a position never goes down");
        assert_eq!(seq.load(Ordering::Relaxed) % 2, 0);
        // A writer that died mid-write left the sequence odd: readers get no whole copy, and
        // the next write repairs it.
        seq.store(13, Ordering::Relaxed);
        assert_eq!(w.try_read(), None);
        assert_eq!(w.read(3).round, 7, "the words as they are");
        w.advance(6);
        assert_eq!(seq.load(Ordering::Relaxed), 14);
        assert_eq!(w.try_read().map(|f| f.position), Some(6));
    }

    #[test]
    fn a_quarantined_slot_is_nobodys_until_its_holder_lets_go() {
        let ctl = AtomicU64::new(FREE);
        let w = try_claim(&ctl, 42).expect("free slot");
        assert!(quarantine(&ctl, w));
        assert!(!quarantine(&ctl, w), "quarantined twice");
        assert_eq!(state(ctl.load(Ordering::Acquire)), QUARANTINED);
        assert!(
            try_claim(&ctl, 43).is_none(),
            "a quarantined slot was claimed"
        );
        assert!(!publish(&ctl, w), "the silent holder published");
        assert!(!free(&ctl, w), "freed through the old claim");
        assert!(!release_quarantined(&ctl, w), "not the quarantined word");
        assert!(release_quarantined(&ctl, quarantined(w)));
        let w2 = try_claim(&ctl, 43).expect("free after the holder let go");
        assert!(
            !release_quarantined(&ctl, quarantined(w)),
            "a late release freed the new claim"
        );
        assert!(publish(&ctl, w2));
        let r = ctl.load(Ordering::Acquire);
        assert!(
            !quarantine(&ctl, r),
            "a READY slot has no holder to be silent"
        );
        let t = try_take(&ctl, r, 7).expect("ready");
        assert!(quarantine(&ctl, t));
        assert!(release_quarantined(&ctl, quarantined(t)));
        assert_eq!(state(ctl.load(Ordering::Acquire)), FREE);
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

    /// A producer stopped past its lease while a reaper takes its slot away and another
    /// producer wants a slot. The stopped producer's copy lands after the check it passed
    /// before it stopped (write_at checks, then copies: a stop can fall in between); its next
    /// call sees the claim gone and its drop lets go. In every interleaving the other producer
    /// gets the slot only after that, so its batch holds only its own bytes. (With the reaper
    /// freeing the slot instead of quarantining it, loom finds the late write in the other
    /// producer's batch.)
    #[test]
    fn a_silent_producers_late_write_never_lands_in_another_batch() {
        loom::model(|| {
            let ctl = Arc::new(AtomicU64::new(FREE));
            let data = Arc::new(AtomicU64::new(0));
            let w = try_claim(&ctl, 1).expect("claim");
            let silent = {
                let (ctl, data) = (ctl.clone(), data.clone());
                loom::thread::spawn(move || {
                    data.store(1, Ordering::Relaxed);
                    if ctl.load(Ordering::Acquire) == w && publish(&ctl, w) {
                        return;
                    }
                    // Claim::drop: abort, or let go of the quarantined slot.
                    if !free(&ctl, w) {
                        assert!(release_quarantined(&ctl, quarantined(w)));
                    }
                })
            };
            let reaper = {
                let ctl = ctl.clone();
                loom::thread::spawn(move || quarantine(&ctl, w))
            };
            let other = {
                let (ctl, data) = (ctl.clone(), data.clone());
                loom::thread::spawn(move || {
                    for _ in 0..2 {
                        if let Some(w2) = try_claim(&ctl, 2) {
                            data.store(2, Ordering::Relaxed);
                            assert!(publish(&ctl, w2));
                            return true;
                        }
                        loom::thread::yield_now();
                    }
                    false
                })
            };
            silent.join().expect("silent producer");
            reaper.join().expect("reaper");
            if other.join().expect("other producer") {
                assert_eq!(
                    data.load(Ordering::Relaxed),
                    2,
                    "the silent producer's write landed in the other producer's batch"
                );
            }
        });
    }

    /// A consumer stopped past its lease while it reads its batch: a reaper quarantines the
    /// slot and a producer wants it. The consumer's read, whenever it resumes, sees its own
    /// batch: the slot is claimed again only after the consumer let go of it.
    #[test]
    fn a_silent_consumers_batch_is_not_refilled_under_it() {
        loom::model(|| {
            let ctl = Arc::new(AtomicU64::new(FREE));
            let data = Arc::new(AtomicU64::new(0));
            let w = try_claim(&ctl, 1).expect("claim");
            data.store(100, Ordering::Relaxed);
            assert!(publish(&ctl, w));
            let seen = ctl.load(Ordering::Acquire);
            let t = try_take(&ctl, seen, 9).expect("take");
            let consumer = {
                let (ctl, data) = (ctl.clone(), data.clone());
                loom::thread::spawn(move || {
                    assert_eq!(
                        data.load(Ordering::Relaxed),
                        100,
                        "the batch was refilled under its consumer"
                    );
                    // Batch::drop: release, or let go of the quarantined slot.
                    if !free(&ctl, t) {
                        assert!(release_quarantined(&ctl, quarantined(t)));
                    }
                })
            };
            let reaper = {
                let ctl = ctl.clone();
                loom::thread::spawn(move || quarantine(&ctl, t))
            };
            let producer = {
                let (ctl, data) = (ctl.clone(), data.clone());
                loom::thread::spawn(move || {
                    for _ in 0..2 {
                        if try_claim(&ctl, 2).is_some() {
                            data.store(200, Ordering::Relaxed);
                            return;
                        }
                        loom::thread::yield_now();
                    }
                })
            };
            consumer.join().expect("consumer");
            reaper.join().expect("reaper");
            producer.join().expect("producer");
        });
    }

    /// A consumer begins round 1 (position 0) over round 0's position 9, then advances to 3,
    /// while a producer reads the watermark: in every interleaving a copy it keeps is one the
    /// consumer published (round 0 at 9, round 1 at 0 or at 3), never round 1 with round 0's
    /// position (which would let the producer run 9 items ahead) nor round 0 with a later
    /// position.
    #[test]
    fn a_watermark_is_read_whole_or_not_at_all() {
        loom::model(|| {
            let cells = Arc::new((
                AtomicU32::new(0),
                AtomicU32::new(WM_PACED | WM_IN_ROUND),
                [AtomicU64::new(0), AtomicU64::new(9), AtomicU64::new(4)],
            ));
            let words = |c: &(AtomicU32, AtomicU32, [AtomicU64; 3])| -> (u32, u64, u64) {
                let w = WatermarkWords {
                    seq: &c.0,
                    flags: &c.1,
                    round: &c.2[0],
                    position: &c.2[1],
                    window: &c.2[2],
                };
                match w.try_read() {
                    Some(f) => (1, f.round, f.position),
                    None => (0, 0, 0),
                }
            };
            let consumer = {
                let c = cells.clone();
                loom::thread::spawn(move || {
                    let w = WatermarkWords {
                        seq: &c.0,
                        flags: &c.1,
                        round: &c.2[0],
                        position: &c.2[1],
                        window: &c.2[2],
                    };
                    w.publish(WatermarkFields {
                        flags: WM_PACED | WM_IN_ROUND,
                        round: 1,
                        position: 0,
                        window: 4,
                    });
                    w.advance(3);
                })
            };
            let (whole, round, position) = words(&cells);
            if whole == 1 {
                assert!(
                    matches!((round, position), (0, 9) | (1, 0) | (1, 3)),
                    "a torn watermark: round {round} at {position}"
                );
            }
            consumer.join().expect("consumer");
            assert_eq!(words(&cells), (1, 1, 3), "the last write, once it is done");
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
