//! The table of processes attached to a ring, and how a holder is named in the shared words.
//!
//! Each attached process owns one entry: a control word (state and generation) and its
//! identity (PID namespace, pid, start time, flags), plus a heartbeat counter it renews. The
//! identity is published as one unit, seqlock style:
//!
//! ```text
//!   FREE(g) --claim (CAS)--> WRITING(g+1) --fields written, CAS Release--> ACTIVE(g+1)
//!   ACTIVE(g) / WRITING(g) --detach, or judged dead (CAS)--> FREE(g)
//!   ACTIVE(g) --judged silent: lease out, maybe only stopped (CAS)--> REVOKED(g)
//!   REVOKED(g) --its process detaches, or is known dead (CAS)--> FREE(g)
//! ```
//!
//! A REVOKED entry tells its process that it was detached (its next call answers
//! `Error::Detached`) while keeping its generation out of reuse: the slots quarantined under
//! it (see the `state` module) stay recognisably its own until it lets go or is known dead.
//!
//! A reader loads the control word (Acquire), reads the fields, and loads the control word
//! again: the fields belong to that generation only if both loads agree, so nobody ever pairs
//! one process's pid with another's start time. Slots and the consumer table name their holder
//! by a [`HolderRef`] (entry index and generation) instead of a pid: when the entry is
//! retired or reused, every reference to the old generation is recognisably stale, and a
//! compare-and-swap on the referencing word settles any race.
//!
//! Compiled under `--cfg loom` too, where the model checker explores the handshake.

use crate::state::{AtomicU64, Ordering};

/// Most processes attached to one ring at once.
pub const MAX_PROCESSES: usize = 128;

pub(crate) const FREE: u64 = 0;
pub(crate) const WRITING: u64 = 1;
pub(crate) const ACTIVE: u64 = 2;
pub(crate) const REVOKED: u64 = 3;

/// A flag of [`Identity::flags`]: the process holds an open-file-description lock on its
/// entry's first byte for as long as it is attached (see `ring::EntryLock`), so that a lock
/// found released means that it is gone, whatever its PID namespace.
pub(crate) const FLAG_LOCKED: u64 = 1;

const STATE_MASK: u64 = 0b11;
const GEN_SHIFT: u32 = 8;
const GEN_MASK: u64 = 0xFF_FFFF;

/// An entry's index and generation packed in 32 bits (never 0: generations start at 1).
pub(crate) type HolderRef = u32;

pub(crate) fn state(ctl: u64) -> u64 {
    ctl & STATE_MASK
}

pub(crate) fn generation(ctl: u64) -> u32 {
    ((ctl >> GEN_SHIFT) & GEN_MASK) as u32
}

fn make(state: u64, generation: u32) -> u64 {
    ((u64::from(generation) & GEN_MASK) << GEN_SHIFT) | state
}

/// The control word of an ACTIVE entry of `generation`.
pub(crate) fn active(generation: u32) -> u64 {
    make(ACTIVE, generation)
}

pub(crate) fn holder_ref(index: usize, generation: u32) -> HolderRef {
    debug_assert!(index < MAX_PROCESSES && generation != 0);
    (generation << 8) | index as u32
}

/// The table word of a consumer or producer that left (its `Consumer` or `Producer` dropped,
/// also while unwinding from a panic): index 255 is past [`MAX_PROCESSES`], so nobody holds
/// through it and it reads as gone, but unlike 0 ("never registered") it tells the other side
/// that a member was there.
pub(crate) const LEFT: HolderRef = u32::MAX;
const _: () = assert!(
    MAX_PROCESSES <= 0xFF,
    "LEFT's index must be past every entry"
);

#[cfg_attr(
    loom,
    allow(dead_code, reason = "used by the ring, which loom does not build")
)]
pub(crate) fn ref_index(r: HolderRef) -> usize {
    (r & 0xFF) as usize
}

pub(crate) fn ref_generation(r: HolderRef) -> u32 {
    r >> 8
}

/// The identity words of one entry (views into shared memory).
pub(crate) struct Entry<'a> {
    pub ctl: &'a AtomicU64,
    pub pid_ns: &'a AtomicU64,
    pub pid: &'a AtomicU64,
    pub start: &'a AtomicU64,
    pub flags: &'a AtomicU64,
}

/// The identity an entry publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Identity {
    pub pid_ns: u64,
    pub pid: u32,
    pub start_ticks: u64,
    /// [`FLAG_LOCKED`] or 0.
    pub flags: u64,
}

/// FREE -> WRITING; returns the new generation. The caller then publishes its identity with
/// [`finish_register`] (or gives the entry back with [`retire`]).
pub(crate) fn begin_register(e: &Entry<'_>) -> Option<u32> {
    let cur = e.ctl.load(Ordering::Relaxed);
    if state(cur) != FREE {
        return None;
    }
    let mut generation = (generation(cur) + 1) & GEN_MASK as u32;
    if generation == 0 {
        generation = 1;
    }
    e.ctl
        .compare_exchange(
            cur,
            make(WRITING, generation),
            Ordering::Acquire,
            Ordering::Relaxed,
        )
        .ok()?;
    Some(generation)
}

/// WRITING(`generation`) -> ACTIVE with `id`; false if a peer retired the entry meanwhile (this
/// process was stopped in the middle of registering for a whole lease): the entry is not ours.
pub(crate) fn finish_register(e: &Entry<'_>, generation: u32, id: Identity) -> bool {
    e.pid_ns.store(id.pid_ns, Ordering::Relaxed);
    e.pid.store(u64::from(id.pid), Ordering::Relaxed);
    e.start.store(id.start_ticks, Ordering::Relaxed);
    e.flags.store(id.flags, Ordering::Relaxed);
    e.ctl
        .compare_exchange(
            make(WRITING, generation),
            make(ACTIVE, generation),
            Ordering::Release,
            Ordering::Relaxed,
        )
        .is_ok()
}

/// FREE -> WRITING -> ACTIVE with `id`; returns the new generation.
#[cfg(test)]
pub(crate) fn try_register(e: &Entry<'_>, id: Identity) -> Option<u32> {
    let generation = begin_register(e)?;
    finish_register(e, generation, id).then_some(generation)
}

/// What a reference's entry says now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// The entry was retired or reused since: the holder is gone.
    Gone,
    /// The entry is being written (its process died mid-registration, or is in it now).
    Writing(u64),
    /// The entry's published identity, and the control word it was read under.
    Active(Identity, u64),
    /// The entry was revoked (its process judged silent) and keeps its identity: the control
    /// word it was read under.
    Revoked(Identity, u64),
}

/// Reads the entry that `generation` refers to (seqlock read: a torn read retries).
pub(crate) fn lookup(e: &Entry<'_>, generation_wanted: u32) -> Lookup {
    loop {
        let c1 = e.ctl.load(Ordering::Acquire);
        if generation(c1) != generation_wanted || state(c1) == FREE {
            return Lookup::Gone;
        }
        if state(c1) == WRITING {
            return Lookup::Writing(c1);
        }
        let id = Identity {
            pid_ns: e.pid_ns.load(Ordering::Relaxed),
            pid: e.pid.load(Ordering::Relaxed) as u32,
            start_ticks: e.start.load(Ordering::Relaxed),
            flags: e.flags.load(Ordering::Relaxed),
        };
        // Orders the field loads before the second control load (a writer that began since
        // changed the control word first).
        crate::state::fence_acquire();
        if e.ctl.load(Ordering::Relaxed) == c1 {
            return if state(c1) == REVOKED {
                Lookup::Revoked(id, c1)
            } else {
                Lookup::Active(id, c1)
            };
        }
    }
}

/// ACTIVE `ctl` -> REVOKED of the same generation (a stale `ctl` fails).
pub(crate) fn revoke(e: &Entry<'_>, ctl: u64) -> bool {
    state(ctl) == ACTIVE
        && e.ctl
            .compare_exchange(
                ctl,
                make(REVOKED, generation(ctl)),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
}

/// The REVOKED control word of an ACTIVE `ctl`.
#[cfg_attr(
    loom,
    allow(dead_code, reason = "used by the ring, which loom does not build")
)]
pub(crate) fn revoked(ctl: u64) -> u64 {
    make(REVOKED, generation(ctl))
}

/// ACTIVE/WRITING/REVOKED `ctl` -> FREE of the same generation (a stale `ctl` fails).
pub(crate) fn retire(e: &Entry<'_>, ctl: u64) -> bool {
    e.ctl
        .compare_exchange(
            ctl,
            make(FREE, generation(ctl)),
            Ordering::AcqRel,
            Ordering::Relaxed,
        )
        .is_ok()
}

/// The five words of an entry, in private memory, for the tests.
#[cfg(test)]
mod tests_support {
    use super::*;

    pub(super) fn entry(words: &[AtomicU64; 5]) -> Entry<'_> {
        Entry {
            ctl: &words[0],
            pid_ns: &words[1],
            pid: &words[2],
            start: &words[3],
            flags: &words[4],
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    use super::tests_support::entry;

    #[test]
    fn register_lookup_retire() {
        let words = [0u64; 5].map(AtomicU64::new);
        let e = entry(&words);
        let id = Identity {
            pid_ns: 7,
            pid: 42,
            start_ticks: 99,
            flags: FLAG_LOCKED,
        };
        let g = try_register(&e, id).expect("free entry");
        assert_eq!(try_register(&e, id), None, "registered twice");
        let r = holder_ref(5, g);
        assert_eq!((ref_index(r), ref_generation(r)), (5, g));
        let Lookup::Active(got, ctl) = lookup(&e, g) else {
            panic!("not active")
        };
        assert_eq!(got, id);
        assert_eq!(lookup(&e, g + 1), Lookup::Gone, "another generation");
        assert!(retire(&e, ctl));
        assert!(!retire(&e, ctl), "retired twice");
        assert_eq!(lookup(&e, g), Lookup::Gone);
        let g2 = try_register(&e, id).expect("free again");
        assert_ne!(g2, g);
        assert!(!retire(&e, ctl), "a stale word retired a new registration");
    }

    #[test]
    fn a_revoked_entry_keeps_its_generation_until_retired() {
        let words = [0u64; 5].map(AtomicU64::new);
        let e = entry(&words);
        let id = Identity {
            pid_ns: 7,
            pid: 42,
            start_ticks: 99,
            flags: FLAG_LOCKED,
        };
        let g = try_register(&e, id).expect("free entry");
        let Lookup::Active(_, ctl) = lookup(&e, g) else {
            panic!("not active")
        };
        assert!(revoke(&e, ctl));
        assert!(!revoke(&e, ctl), "revoked twice");
        assert_eq!(lookup(&e, g), Lookup::Revoked(id, revoked(ctl)));
        assert_eq!(try_register(&e, id), None, "a revoked entry was reused");
        assert!(!retire(&e, ctl), "retired through its ACTIVE word");
        assert!(retire(&e, revoked(ctl)));
        assert_eq!(lookup(&e, g), Lookup::Gone);
        let g2 = begin_register(&e).expect("free");
        assert!(
            retire(&e, make(WRITING, g2)),
            "a stopped registration retired"
        );
        assert!(
            !finish_register(&e, g2, id),
            "a retired registration was published"
        );
        assert_eq!(lookup(&e, g2), Lookup::Gone);
    }

    #[test]
    fn generations_wrap_without_zero() {
        let words = [make(FREE, GEN_MASK as u32), 0, 0, 0, 0].map(AtomicU64::new);
        let e = entry(&words);
        let g = try_register(
            &e,
            Identity {
                pid_ns: 1,
                pid: 1,
                start_ticks: 1,
                flags: 0,
            },
        )
        .expect("free");
        assert_eq!(g, 1);
        assert_ne!(holder_ref(0, g), 0);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    use super::tests_support::entry;

    fn id(p: u32) -> Identity {
        Identity {
            pid_ns: u64::from(p) * 1000,
            pid: p,
            start_ticks: u64::from(p) * 10,
            flags: u64::from(p) & FLAG_LOCKED,
        }
    }

    /// A process retires its entry and another registers in it while a reader looks the old
    /// reference up: the reader sees the old identity whole, or learns that it is gone; never
    /// one process's pid with another's start time or namespace.
    #[test]
    fn identities_are_published_whole() {
        loom::model(|| {
            let words = Arc::new([0u64; 5].map(AtomicU64::new));
            let g1 = try_register(&entry(&words), id(1)).expect("free");
            let writer = {
                let words = words.clone();
                loom::thread::spawn(move || {
                    let e = entry(&words);
                    let Lookup::Active(_, ctl) = lookup(&e, g1) else {
                        panic!("own entry")
                    };
                    assert!(retire(&e, ctl));
                    try_register(&e, id(2)).expect("free after retire")
                })
            };
            match lookup(&entry(&words), g1) {
                Lookup::Active(got, _) => assert_eq!(got, id(1), "torn identity"),
                Lookup::Gone => {}
                Lookup::Writing(_) => panic!("generation 1 is never WRITING after publish"),
                Lookup::Revoked(..) => panic!("nobody revoked it"),
            }
            let g2 = writer.join().expect("writer");
            assert_ne!(g2, g1);
            match lookup(&entry(&words), g2) {
                Lookup::Active(got, _) => assert_eq!(got, id(2)),
                other => panic!("{other:?}"),
            }
        });
    }

    /// A reaper judges a slot's holder by its reference while the holder lets the slot go and
    /// retires, and a new process registers in the same entry and claims the slot: the reaper
    /// frees the slot only if the word it judged is still there, so the new holder's claim
    /// is never freed.
    #[test]
    fn a_reaper_never_frees_a_new_holders_slot() {
        use crate::state;
        loom::model(|| {
            let words = Arc::new([0u64; 5].map(AtomicU64::new));
            let slot = Arc::new(AtomicU64::new(state::FREE));
            let g1 = try_register(&entry(&words), id(1)).expect("free");
            let old = state::try_claim(&slot, holder_ref(0, g1)).expect("claim");
            let holder = {
                let (words, slot) = (words.clone(), slot.clone());
                loom::thread::spawn(move || {
                    // The old holder lets go and detaches; a new process takes the entry and
                    // claims the slot.
                    assert!(state::free(&slot, old));
                    let e = entry(&words);
                    let Lookup::Active(_, ctl) = lookup(&e, g1) else {
                        panic!("own entry")
                    };
                    assert!(retire(&e, ctl));
                    let g2 = try_register(&e, id(2)).expect("free");
                    state::try_claim(&slot, holder_ref(0, g2))
                })
            };
            // The reaper: it read the old word and judges the old reference.
            let seen = old;
            let r = state::holder(seen);
            let gone = matches!(lookup(&entry(&words), ref_generation(r)), Lookup::Gone);
            let freed = gone && state::free(&slot, seen);
            assert!(!freed, "a stale word freed the slot");
            let new_claim = holder.join().expect("holder");
            if let Some(w) = new_claim {
                assert_eq!(
                    slot.load(Ordering::Acquire),
                    w,
                    "the new holder's claim was freed"
                );
            }
        });
    }

    /// A reaper revokes a silent holder's entry and then quarantines its slot while the holder
    /// resumes: a holder that finds its slot quarantined also finds its entry revoked (its
    /// calls answer `Detached`), whatever the interleaving.
    #[test]
    fn a_holder_that_finds_its_slot_quarantined_finds_itself_revoked() {
        use crate::state;
        loom::model(|| {
            let words = Arc::new([0u64; 5].map(AtomicU64::new));
            let slot = Arc::new(AtomicU64::new(state::FREE));
            let g = try_register(&entry(&words), id(1)).expect("free");
            let ctl = active(g);
            let w = state::try_claim(&slot, holder_ref(0, g)).expect("claim");
            let reaper = {
                let (words, slot) = (words.clone(), slot.clone());
                loom::thread::spawn(move || {
                    revoke(&entry(&words), ctl) && state::quarantine(&slot, w)
                })
            };
            let now = slot.load(Ordering::Acquire);
            if now != w {
                assert_eq!(state::state(now), state::QUARANTINED);
                assert_ne!(
                    words[0].load(Ordering::Relaxed),
                    ctl,
                    "the slot was quarantined while its holder was still attached"
                );
            }
            assert!(reaper.join().expect("reaper"));
            assert!(state::release_quarantined(&slot, state::quarantined(w)));
        });
    }

    /// The consumer table: two processes reuse the entry of a consumer judged gone while the
    /// gone consumer's own (late) unregistration runs: each entry is one word set and cleared
    /// by compare-and-swap, so exactly one newcomer holds it and the late unregistration never
    /// clears a newcomer's registration.
    #[test]
    fn consumer_entries_change_hands_whole() {
        use crate::state::AtomicU32;
        loom::model(|| {
            let (gone, a, b) = (holder_ref(1, 1), holder_ref(2, 1), holder_ref(3, 1));
            let word = Arc::new(AtomicU32::new(gone));
            let racers: Vec<_> = [a, b]
                .into_iter()
                .map(|me| {
                    let word = word.clone();
                    loom::thread::spawn(move || {
                        word.compare_exchange(gone, me, Ordering::AcqRel, Ordering::Relaxed)
                            .is_ok()
                    })
                })
                .collect();
            // The gone consumer's drop, late: marks only its own registration LEFT.
            let cleared = word
                .compare_exchange(gone, LEFT, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok();
            let won: Vec<bool> = racers
                .into_iter()
                .map(|r| r.join().expect("racer"))
                .collect();
            let winners = won.iter().filter(|&&w| w).count();
            let now = word.load(Ordering::Acquire);
            if cleared {
                assert_eq!(winners, 0);
                assert_eq!(now, LEFT);
            } else {
                assert_eq!(winners, 1, "one newcomer holds the entry");
                assert_eq!(now, if won[0] { a } else { b });
            }
        });
    }
}
