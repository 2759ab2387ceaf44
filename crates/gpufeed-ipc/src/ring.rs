//! The batch ring in a shared-memory segment.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpufeed_os::process::ProcessIdentity;
use gpufeed_os::{ShmOptions, ShmSegment};
use rustix::thread::futex;

use crate::error::{Error, Result};
use crate::layout::{self, Layout, MAX_CONSUMERS, OFF_FREE_WAITERS, OFF_READY_WAITERS};
use crate::state;

/// Longest single futex wait: liveness is re-checked at least this often.
const WAIT_SLICE: Duration = Duration::from_millis(20);

/// A ring of fixed-size slots in shared memory, for batches handed between processes.
///
/// Producers [`claim`](BatchRing::claim) a free slot, write into it, and
/// [`publish`](Claim::publish) it; consumers ([`BatchRing::consumer`]) take published slots in
/// publish order with [`Consumer::next`] and release them by dropping the [`Batch`]. Waits use
/// futexes on the shared words, always with a timeout, re-checking every 20 ms whether the
/// processes holding slots still live: the slot of a producer that died mid-write is reclaimed
/// and never delivered; producers get [`Error::ConsumerGone`] when every registered consumer
/// died.
///
/// The header is validated on [`open`](BatchRing::open) (magic, version, geometry with checked
/// arithmetic); shared words are only touched atomically and slot data only through raw
/// pointers or copies. The segment has mode 0600 (see `gpufeed_os::shm`).
///
/// # Example
/// ```
/// use std::time::Duration;
/// use gpufeed_ipc::BatchRing;
/// let ring = BatchRing::create_unique(4, 1 << 20)?; // 4 slots of 1 MiB, named for other processes
/// let mut claim = ring.claim(Duration::from_secs(1))?;
/// claim.write_at(0, b"batch 0")?;
/// claim.set_len(7)?;
/// claim.publish()?;
/// let consumer = ring.consumer()?;
/// let batch = consumer.next(Duration::from_secs(1))?;
/// assert_eq!(batch.to_vec(), b"batch 0");
/// # Ok::<(), gpufeed_ipc::Error>(())
/// ```
#[derive(Debug)]
pub struct BatchRing {
    seg: ShmSegment,
    layout: Layout,
    me: ProcessIdentity,
    /// Where the next claim starts scanning (spreads producers over the slots).
    cursor: AtomicU32,
}

impl BatchRing {
    /// Creates a ring named `name` in /dev/shm (see `gpufeed_os::shm` for naming rules).
    pub fn create(name: &str, slots: u32, slot_bytes: u64) -> Result<Self> {
        let layout = Layout::new(slots, slot_bytes)?;
        let seg = ShmSegment::create(name, layout.total_len as usize)?;
        Self::init(seg, layout)
    }

    /// Creates a ring with a generated name (`gpufeed-<pid>-<start>-<random>`).
    pub fn create_unique(slots: u32, slot_bytes: u64) -> Result<Self> {
        let layout = Layout::new(slots, slot_bytes)?;
        let seg = ShmSegment::create_unique(layout.total_len as usize)?;
        Self::init(seg, layout)
    }

    /// Creates a ring on an anonymous memfd; hand [`BatchRing::segment`]'s fd to related
    /// processes (inherited, or with [`crate::send_fd`]) and map it with
    /// [`BatchRing::from_fd`].
    pub fn anonymous(slots: u32, slot_bytes: u64) -> Result<Self> {
        let layout = Layout::new(slots, slot_bytes)?;
        let seg = ShmSegment::anonymous(layout.total_len as usize)?;
        Self::init(seg, layout)
    }

    /// Creates a ring in a segment made with other options (directory, prefix, kept name).
    pub fn create_with(
        options: &ShmOptions,
        name: &str,
        slots: u32,
        slot_bytes: u64,
    ) -> Result<Self> {
        let layout = Layout::new(slots, slot_bytes)?;
        let seg = options.create(name, layout.total_len as usize)?;
        Self::init(seg, layout)
    }

    fn init(seg: ShmSegment, layout: Layout) -> Result<Self> {
        // The segment is fresh and zeroed (all slots FREE); write the geometry, then the magic
        // last with Release so that an opener that sees the magic sees the rest.
        let header = layout.header_bytes();
        seg.write_at(8, &header[8..])?;
        let ring = BatchRing {
            seg,
            layout,
            me: ProcessIdentity::current(),
            cursor: AtomicU32::new(0),
        };
        ring.u64_at(layout::OFF_MAGIC)
            .store(layout::MAGIC, Ordering::Release);
        Ok(ring)
    }

    /// Opens the ring named `name`, validating its header.
    pub fn open(name: &str) -> Result<Self> {
        let seg = ShmOptions::new().min_len(layout::HEADER_BYTES).open(name)?;
        Self::attach(seg)
    }

    /// Maps a ring from a memfd received from its creator.
    pub fn from_fd(fd: OwnedFd) -> Result<Self> {
        Self::attach(ShmSegment::from_fd(fd)?)
    }

    fn attach(seg: ShmSegment) -> Result<Self> {
        if (seg.len() as u64) < layout::HEADER_BYTES {
            return Err(Error::InvalidHeader(format!(
                "segment of {} bytes",
                seg.len()
            )));
        }
        // SAFETY: offset 0 is inside the segment (len >= one page) and 8-aligned; the word is
        // only accessed atomically.
        let magic = unsafe { AtomicU64::from_ptr(seg.as_ptr().cast()) }.load(Ordering::Acquire);
        if magic != layout::MAGIC {
            return Err(Error::InvalidHeader(
                "not a gpufeed batch ring (bad magic), or not initialised yet".into(),
            ));
        }
        // Read the header once into private memory, then validate that copy.
        let mut header = [0u8; 64];
        seg.read_at(0, &mut header)?;
        let layout = layout::parse_header(&header, seg.len() as u64)?;
        Ok(BatchRing {
            seg,
            layout,
            me: ProcessIdentity::current(),
            cursor: AtomicU32::new(0),
        })
    }

    /// The segment (its fd for passing, its memory for GPU registration).
    pub fn segment(&self) -> &ShmSegment {
        &self.seg
    }

    /// The geometry.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Number of slots.
    pub fn slots(&self) -> u32 {
        self.layout.slots
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.layout.slot_bytes
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off % 4 == 0 && off + 4 <= self.seg.len());
        // SAFETY: every offset used is a fixed field inside the validated layout, 4-aligned in a
        // page-aligned mapping that lives as long as self; shared words are only accessed
        // atomically, by every process.
        unsafe { AtomicU32::from_ptr(self.seg.as_ptr().add(off).cast()) }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= self.seg.len());
        // SAFETY: as in u32_at, 8-aligned.
        unsafe { AtomicU64::from_ptr(self.seg.as_ptr().add(off).cast()) }
    }

    fn ctl(&self, slot: u32) -> &state::AtomicU64 {
        self.u64_at(self.layout.meta_offset(slot) + layout::SLOT_CTL)
    }

    fn slot_u64(&self, slot: u32, field: usize) -> &AtomicU64 {
        self.u64_at(self.layout.meta_offset(slot) + field)
    }

    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        // SAFETY: slot < slots, so its data lies inside the validated total length.
        unsafe {
            self.seg
                .as_ptr()
                .add(self.layout.slot_offset(slot) as usize)
        }
    }

    fn bump(&self, seq_off: usize, waiters_off: usize) {
        self.u32_at(seq_off).fetch_add(1, Ordering::SeqCst);
        if self.u32_at(waiters_off).load(Ordering::SeqCst) > 0 {
            let _ = futex::wake(self.u32_at(seq_off), futex::Flags::empty(), i32::MAX as u32);
        }
    }

    /// Sleeps until the futex word at `seq_off` moves past `seen` or `slice` passes.
    fn wait(&self, seq_off: usize, waiters_off: usize, seen: u32, slice: Duration) {
        let ts = rustix::time::Timespec {
            tv_sec: slice.as_secs() as i64,
            tv_nsec: i64::from(slice.subsec_nanos()),
        };
        // EAGAIN (moved already), ETIMEDOUT and EINTR all mean: look again.
        let _ = futex::wait(self.u32_at(seq_off), futex::Flags::empty(), seen, Some(&ts));
        self.u32_at(waiters_off).fetch_sub(1, Ordering::SeqCst);
    }

    /// Frees the slot held in `word` by this process, marking its start time unknown first.
    ///
    /// Every holder clears the slot's start time before it lets go (here, and in `publish`):
    /// the next holder records its own only after its compare-and-swap, and a reaper that
    /// reads the new holder's pid in between must find 0 ("unknown": judged by the pid alone),
    /// never the previous holder's start time, which would make a live process look dead and
    /// free a slot it is writing or reading.
    fn free_slot(&self, slot: u32, word: u64) -> bool {
        self.slot_u64(slot, layout::SLOT_START)
            .store(0, Ordering::Relaxed);
        self.free_word(slot, word)
    }

    /// CLAIMED/TAKEN `word` -> FREE, waking claimers.
    fn free_word(&self, slot: u32, word: u64) -> bool {
        let freed = state::free(self.ctl(slot), word);
        if freed {
            self.bump(layout::OFF_FREE_SEQ, OFF_FREE_WAITERS);
        }
        freed
    }

    /// Claims a free slot without waiting.
    pub fn try_claim(&self) -> Result<Option<Claim<'_>>> {
        let n = self.layout.slots;
        let start = self.cursor.fetch_add(1, Ordering::Relaxed) % n;
        for k in 0..n {
            let slot = (start + k) % n;
            if let Some(word) = state::try_claim(self.ctl(slot), self.me.pid) {
                self.slot_u64(slot, layout::SLOT_START)
                    .store(self.me.start_ticks, Ordering::Relaxed);
                return Ok(Some(Claim {
                    ring: self,
                    slot,
                    word,
                    len: 0,
                    done: false,
                }));
            }
        }
        Ok(None)
    }

    /// Claims a free slot, waiting up to `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`Error::ConsumerGone`] when every registered consumer died.
    pub fn claim(&self, timeout: Duration) -> Result<Claim<'_>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(c) = self.try_claim()? {
                return Ok(c);
            }
            self.reap();
            if self.consumers_all_dead() {
                return Err(Error::ConsumerGone);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: "a free slot",
                    ms: timeout.as_millis(),
                });
            }
            self.u32_at(OFF_FREE_WAITERS).fetch_add(1, Ordering::SeqCst);
            let seen = self.u32_at(layout::OFF_FREE_SEQ).load(Ordering::SeqCst);
            if let Some(c) = self.try_claim()? {
                self.u32_at(OFF_FREE_WAITERS).fetch_sub(1, Ordering::SeqCst);
                return Ok(c);
            }
            self.wait(
                layout::OFF_FREE_SEQ,
                OFF_FREE_WAITERS,
                seen,
                (deadline - now).min(WAIT_SLICE),
            );
        }
    }

    /// Registers this process as a consumer (so producers can tell when consumers die).
    ///
    /// # Errors
    /// [`Error::TooManyConsumers`] when 16 live consumers are registered.
    pub fn consumer(&self) -> Result<Consumer<'_>> {
        for i in 0..MAX_CONSUMERS {
            let pid = self.u64_at(layout::OFF_CONSUMERS + 16 * i);
            let start = self.u64_at(layout::OFF_CONSUMERS + 16 * i + 8);
            let cur = pid.load(Ordering::Acquire);
            let reusable = cur == 0
                || !ProcessIdentity {
                    pid: cur as u32,
                    start_ticks: start.load(Ordering::Relaxed),
                }
                .is_alive();
            if reusable
                && pid
                    .compare_exchange(
                        cur,
                        u64::from(self.me.pid),
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                start.store(self.me.start_ticks, Ordering::Release);
                return Ok(Consumer {
                    ring: self,
                    entry: i,
                });
            }
        }
        Err(Error::TooManyConsumers(MAX_CONSUMERS))
    }

    /// Whether consumers registered and all of them have died.
    fn consumers_all_dead(&self) -> bool {
        let mut any = false;
        for i in 0..MAX_CONSUMERS {
            let pid = self
                .u64_at(layout::OFF_CONSUMERS + 16 * i)
                .load(Ordering::Acquire);
            if pid == 0 {
                continue;
            }
            any = true;
            let start = self
                .u64_at(layout::OFF_CONSUMERS + 16 * i + 8)
                .load(Ordering::Acquire);
            if (ProcessIdentity {
                pid: pid as u32,
                start_ticks: start,
            })
            .is_alive()
            {
                return false;
            }
        }
        any
    }

    /// Frees the slots held by processes that died (a producer's unfinished batch is dropped,
    /// never delivered; a consumer's taken batch is freed). Returns how many were freed.
    pub fn reap(&self) -> usize {
        let mut freed = 0;
        for slot in 0..self.layout.slots {
            let word = self.ctl(slot).load(Ordering::Acquire);
            let st = state::state(word);
            if st != state::CLAIMED && st != state::TAKEN {
                continue;
            }
            let pid = state::holder(word);
            if pid == self.me.pid {
                continue;
            }
            // Acquire of `word` above: the 0 stored by the previous holder before it let go is
            // visible, so this reads 0 or a start time recorded since (see `free_slot`).
            let start = self.slot_u64(slot, layout::SLOT_START);
            let start_ticks = start.load(Ordering::Relaxed);
            let holder = ProcessIdentity { pid, start_ticks };
            // Clear the start time only if it is still the dead holder's (a reading taken
            // after the slot moved on fails the second compare-and-swap anyway).
            if !holder.is_alive()
                && start
                    .compare_exchange(start_ticks, 0, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                && self.free_word(slot, word)
            {
                tracing::warn!(slot, pid, "freed a slot held by a dead process");
                freed += 1;
            }
        }
        freed
    }

    /// How many slots are in each state now.
    pub fn stats(&self) -> RingStats {
        let mut s = RingStats::default();
        for slot in 0..self.layout.slots {
            match state::state(self.ctl(slot).load(Ordering::Relaxed)) {
                state::FREE => s.free += 1,
                state::CLAIMED => s.claimed += 1,
                state::READY => s.ready += 1,
                _ => s.taken += 1,
            }
        }
        s
    }
}

/// Slot counts by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingStats {
    /// Free.
    pub free: u32,
    /// Being written by a producer.
    pub claimed: u32,
    /// Published, waiting for a consumer.
    pub ready: u32,
    /// Being read by a consumer.
    pub taken: u32,
}

/// A slot claimed by this producer. Write into it, set the length, and
/// [`publish`](Claim::publish); dropping it unpublished gives the slot back.
#[derive(Debug)]
pub struct Claim<'r> {
    ring: &'r BatchRing,
    slot: u32,
    word: u64,
    len: u64,
    done: bool,
}

impl Claim<'_> {
    /// The slot's index.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Bytes the slot holds.
    pub fn capacity(&self) -> u64 {
        self.ring.layout.slot_bytes
    }

    /// The slot's first byte (256-byte aligned), for writing `capacity()` bytes.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ring.slot_ptr(self.slot)
    }

    /// The slot as a mutable slice.
    ///
    /// # Safety
    /// 1. No other process writes this slot while the slice lives (true for cooperating
    ///    processes: the slot is this claim's until published or dropped).
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        let cap = self.capacity() as usize;
        // SAFETY: the slot's memory is inside the mapping; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), cap) }
    }

    /// Copies `data` into the slot at `offset`.
    pub fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let end = offset.checked_add(data.len() as u64);
        if end.is_none_or(|e| e > self.capacity()) {
            return Err(Error::TooLarge {
                len: offset.saturating_add(data.len() as u64),
                capacity: self.capacity(),
            });
        }
        // SAFETY: in bounds (checked); the slot is ours; data is private memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.as_mut_ptr().add(offset as usize),
                data.len(),
            )
        };
        Ok(())
    }

    /// Sets the batch's length (bytes a consumer will see).
    pub fn set_len(&mut self, len: u64) -> Result<()> {
        if len > self.capacity() {
            return Err(Error::TooLarge {
                len,
                capacity: self.capacity(),
            });
        }
        self.len = len;
        Ok(())
    }

    /// Hands the batch to the consumers.
    ///
    /// # Errors
    /// [`Error::SlotLost`] if another process freed the slot meanwhile (misuse).
    pub fn publish(mut self) -> Result<()> {
        let ring = self.ring;
        ring.slot_u64(self.slot, layout::SLOT_LEN)
            .store(self.len, Ordering::Relaxed);
        let seq = ring
            .u64_at(layout::OFF_PUBLISH)
            .fetch_add(1, Ordering::Relaxed);
        ring.slot_u64(self.slot, layout::SLOT_SEQ)
            .store(seq, Ordering::Relaxed);
        // The taker records its start time after its own compare-and-swap (see free_slot).
        ring.slot_u64(self.slot, layout::SLOT_START)
            .store(0, Ordering::Relaxed);
        self.done = true;
        if !state::publish(ring.ctl(self.slot), self.word) {
            return Err(Error::SlotLost { slot: self.slot });
        }
        ring.bump(layout::OFF_READY_SEQ, OFF_READY_WAITERS);
        Ok(())
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.ring.free_slot(self.slot, self.word);
        }
    }
}

/// This process as a registered consumer of a ring; unregistered when dropped.
#[derive(Debug)]
pub struct Consumer<'r> {
    ring: &'r BatchRing,
    entry: usize,
}

impl<'r> Consumer<'r> {
    /// Takes the oldest published batch without waiting.
    pub fn try_next(&self) -> Option<Batch<'r>> {
        let ring = self.ring;
        loop {
            let mut best: Option<(u64, u32, u64)> = None;
            for slot in 0..ring.layout.slots {
                let word = ring.ctl(slot).load(Ordering::Acquire);
                if state::state(word) != state::READY {
                    continue;
                }
                let seq = ring
                    .slot_u64(slot, layout::SLOT_SEQ)
                    .load(Ordering::Relaxed);
                if best.is_none_or(|(s, _, _)| seq < s) {
                    best = Some((seq, slot, word));
                }
            }
            let (_, slot, seen) = best?;
            let Some(word) = state::try_take(ring.ctl(slot), seen, ring.me.pid) else {
                continue; // another consumer took it; look again
            };
            ring.slot_u64(slot, layout::SLOT_START)
                .store(ring.me.start_ticks, Ordering::Relaxed);
            let len = ring
                .slot_u64(slot, layout::SLOT_LEN)
                .load(Ordering::Relaxed);
            if len > ring.layout.slot_bytes {
                tracing::warn!(slot, len, "dropping a batch whose length exceeds its slot");
                ring.free_slot(slot, word);
                continue;
            }
            return Some(Batch {
                ring,
                slot,
                word,
                len,
            });
        }
    }

    /// Takes the oldest published batch, waiting up to `timeout`; slots of producers that died
    /// are freed while waiting.
    pub fn next(&self, timeout: Duration) -> Result<Batch<'r>> {
        let ring = self.ring;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(b) = self.try_next() {
                return Ok(b);
            }
            ring.reap();
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: "a batch",
                    ms: timeout.as_millis(),
                });
            }
            ring.u32_at(OFF_READY_WAITERS)
                .fetch_add(1, Ordering::SeqCst);
            let seen = ring.u32_at(layout::OFF_READY_SEQ).load(Ordering::SeqCst);
            if let Some(b) = self.try_next() {
                ring.u32_at(OFF_READY_WAITERS)
                    .fetch_sub(1, Ordering::SeqCst);
                return Ok(b);
            }
            ring.wait(
                layout::OFF_READY_SEQ,
                OFF_READY_WAITERS,
                seen,
                (deadline - now).min(WAIT_SLICE),
            );
        }
    }
}

impl Drop for Consumer<'_> {
    fn drop(&mut self) {
        let pid = self.ring.u64_at(layout::OFF_CONSUMERS + 16 * self.entry);
        let _ = pid.compare_exchange(
            u64::from(self.ring.me.pid),
            0,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

/// A published batch taken by this consumer; the slot is released when it drops.
#[derive(Debug)]
pub struct Batch<'r> {
    ring: &'r BatchRing,
    slot: u32,
    word: u64,
    len: u64,
}

impl Batch<'_> {
    /// The slot's index.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The batch's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Offset of the batch's first byte in the segment (for a copy from a registered segment).
    pub fn offset_in_segment(&self) -> u64 {
        self.ring.layout.slot_offset(self.slot)
    }

    /// The batch's first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.ring.slot_ptr(self.slot)
    }

    /// The batch as a slice.
    ///
    /// # Safety
    /// 1. No other process writes this slot while the slice lives (true for cooperating
    ///    processes: the slot is this consumer's until the batch drops).
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: inside the mapping; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len as usize) }
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the batch.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(dst.len() as u64);
        if end.is_none_or(|e| e > self.len) {
            return Err(Error::TooLarge {
                len: offset.saturating_add(dst.len() as u64),
                capacity: self.len,
            });
        }
        // SAFETY: in bounds of the batch (checked); dst is private memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.as_ptr().add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// The batch copied into a `Vec`.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len as usize];
        self.read_at(0, &mut v)
            .expect("the whole batch is in bounds");
        v
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        self.ring.free_slot(self.slot, self.word);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A live process of another pid that holds a slot must never be reaped, also in the
    /// moment between its compare-and-swap and recording its start time. Before the fix the
    /// slot still carried the previous holder's start time then, the reaper judged the new
    /// holder dead and freed a slot it was using (seen on the H200 machine as a batch whose
    /// bytes were overwritten by the next producer).
    #[test]
    fn a_new_holder_is_not_reaped_before_it_records_its_start_time() {
        // Start times count clock ticks (10 ms): make the other process's differ from ours.
        std::thread::sleep(Duration::from_millis(50));
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let other_pid = other.id();
        let ring = BatchRing::create_unique(1, 4096).expect("ring");
        let consumer = ring.consumer().expect("consumer");

        // This process publishes; another (live) process takes the batch but has not yet
        // recorded its start time.
        let mut claim = ring.try_claim().expect("claim").expect("free slot");
        claim.write_at(0, b"batch").expect("write");
        claim.set_len(5).expect("len");
        claim.publish().expect("publish");
        let seen = ring.ctl(0).load(Ordering::Acquire);
        let taken = state::try_take(ring.ctl(0), seen, other_pid).expect("take");
        assert_eq!(ring.reap(), 0, "a live taker's slot was freed");
        assert_eq!(ring.ctl(0).load(Ordering::Acquire), taken);

        // The taker lets go; another live process claims and has not recorded its start yet.
        assert!(ring.free_slot(0, taken));
        let claimed = state::try_claim(ring.ctl(0), other_pid).expect("claim");
        assert_eq!(ring.reap(), 0, "a live claimer's slot was freed");
        assert_eq!(ring.ctl(0).load(Ordering::Acquire), claimed);

        // Once the holder is dead the slot is reaped.
        other.kill().expect("kill");
        other.wait().expect("wait");
        assert_eq!(ring.reap(), 1, "a dead holder's slot stays taken");
        drop(consumer);
    }
}
