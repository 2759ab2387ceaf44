//! Shards streamed to the batch loader ([`StreamedShards`]): each shard brought into memory (or
//! a cache directory's file) when the epoch first needs it (in the order the epoch's batches
//! need them, several at once), held while batches use it, and let go after the last batch
//! that needs it, so that the first batch waits for its own shards only and the shards held
//! stay under a cap.
//!
//! Where the shards come from is behind [`Fetch`]: objects in S3-compatible storage or on
//! HTTP(S) servers with the `object` feature ([`StreamedShards::open`]).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::records::{RecordFile, Records, Source};
use crate::sources::{NpyLayout, TarSample};

/// Brings shards here (called from the fetch threads).
pub(crate) trait Fetch: Send + Sync {
    /// Shard `shard`'s bytes, whole.
    fn fetch(&self, shard: usize) -> Result<Fetched>;
}

/// A fetched shard's bytes.
#[cfg_attr(
    not(feature = "object"),
    allow(dead_code, reason = "made by the object source and the tests")
)]
pub(crate) enum Fetched {
    /// A cache directory's file (this user's, written whole before it was named, never written
    /// again): mapped.
    File(PathBuf),
    /// A local shard, mapped once when the set was opened (not opened again by its path).
    Opened(Arc<RecordFile>),
    /// Memory of this process's (`None`: an empty shard).
    Memory(Option<gpufeed_os::align::AlignedBuf>),
}

/// What is known of a shard before its bytes are here: its name (URL or path), its length, its
/// number of records and (but for a tar shard whose samples a shard index counted) the records
/// themselves: an `.npy` header's rows, a tar's index, fixed records. A tar's index left unset
/// is made from its bytes when it first arrives.
#[derive(Debug)]
pub(crate) struct ShardMeta {
    pub(crate) name: String,
    pub(crate) bytes: u64,
    pub(crate) count: usize,
    pub(crate) records: std::sync::OnceLock<Records>,
}

impl ShardMeta {
    /// A shard whose records are known.
    #[cfg_attr(
        not(feature = "object"),
        allow(dead_code, reason = "made by the object source and the tests")
    )]
    pub(crate) fn known(name: String, bytes: u64, records: Records) -> Self {
        ShardMeta {
            name,
            bytes,
            count: records.len(),
            records: records.into(),
        }
    }

    /// Its records, given its bytes: those known, or its tar index made now (checked to hold
    /// the samples counted).
    fn records_for(&self, bytes: &[u8]) -> Result<Records> {
        if let Some(r) = self.records.get() {
            return Ok(r.clone());
        }
        let bad = |reason: String| Error::Records {
            path: self.name.clone().into(),
            reason,
        };
        let samples = crate::sources::index_tar(bytes).map_err(|e| bad(e.to_string()))?;
        if samples.len() != self.count {
            return Err(index_says(&self.name, self.count, samples.len()));
        }
        Ok(self
            .records
            .get_or_init(|| Records::Samples(samples))
            .clone())
    }
}

/// A shard index that counts `said` records where shard `name` holds `holds`.
fn index_says(name: &str, said: usize, holds: usize) -> Error {
    Error::Records {
        path: name.into(),
        reason: format!(
            "the shard index says {said} samples, the shard holds {holds}: the index is not of \
             this shard's version"
        ),
    }
}

/// Counters of a [`StreamedShards`] since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StreamStats {
    /// Shards brought into local files (the same shard counts once per epoch that needed it).
    pub fetched: u64,
    /// Their bytes.
    pub fetched_bytes: u64,
    /// The most bytes of shards held (fetched or being fetched) at once: at most
    /// [`StreamedShards::cap`].
    pub peak_bytes: u64,
    /// Bytes of shards held now (0 between epochs).
    pub held_bytes: u64,
    /// Seconds the batch workers waited for shards to arrive.
    pub waited_s: f64,
}

/// Shards (of fixed records, `.npy` rows or WebDataset tar samples) read as one data set, each
/// fetched (into memory, or a cache directory's file) only when the epoch needs it: the fetch
/// threads bring the shards in the order the epoch's batches first use them (as many as fit
/// under the cap at once), the batch workers wait for a batch's shards, and a shard is let go
/// (its memory freed) after the last batch of the epoch that uses it. The sampler's order is the same as for
/// local files ([`ShardSet`](crate::ShardSet)): what a batch holds does not depend on where its
/// records were.
///
/// The cap bounds the bytes of shards held at once; it cannot be lower than what one batch
/// position needs: an order that uses every shard at every point of the epoch (a plain shuffle
/// over all records) needs them all at once. The epoch is refused before it starts where the
/// order needs more than the cap (it says how much), never stalled. Orders that stream:
/// [`Order::Shards`](crate::Order::Shards) (shards in a shuffled order, each one's records
/// shuffled: a batch needs the one or two shards it straddles, plus, for an epoch padded at its
/// end, the first shard) and [`Order::Sequential`](crate::Order::Sequential).
/// [`Order::Blocks`](crate::Order::Blocks) streams only where its blocks are whole shards
/// (shards of equal length, a multiple of the block): a block across two shards keeps both
/// needed between its visits.
///
/// Several ranks (each its own loader) each fetch the shards their records are in: an
/// elastic or sharded sampler gives every rank a part of every step's records, so ranks of a
/// node fetch the same shards, each once.
pub struct StreamedShards {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for StreamedShards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedShards")
            .field("shards", &self.inner.meta.len())
            .field("records", &self.len())
            .field("cap", &self.inner.cap)
            .finish()
    }
}

struct Inner {
    meta: Vec<ShardMeta>,
    /// The first record of each shard, then the total.
    starts: Vec<usize>,
    fetch: Box<dyn Fetch>,
    cap: u64,
    fetchers: usize,
    state: Mutex<State>,
    changed: Condvar,
    fetched: AtomicU64,
    fetched_bytes: AtomicU64,
    peak_bytes: AtomicU64,
    waited_ns: AtomicU64,
}

#[derive(Default)]
struct State {
    /// The running epoch's number among this set's epochs: a fetch thread of an epoch that
    /// ended hands its shard back instead of storing it.
    generation: u64,
    slots: Vec<Slot>,
    /// Bytes of shards fetched or being fetched.
    held: u64,
    /// Bytes being fetched by threads of epochs that ended (dropped on arrival): counted
    /// against the cap until then.
    stale: u64,
    /// Shards to fetch, in the order the epoch first needs them.
    queue: VecDeque<usize>,
    /// Batches left (of this epoch) that use each shard.
    uses: Vec<usize>,
    stopped: bool,
}

#[derive(Default)]
enum Slot {
    #[default]
    Absent,
    Fetching,
    Ready(Arc<RecordFile>),
    Failed(String),
}

impl StreamedShards {
    /// Shards `meta` brought by `fetch`, at most `cap` bytes of them held at once (at least
    /// the largest shard), `fetchers` threads fetching.
    #[cfg_attr(
        not(feature = "object"),
        allow(dead_code, reason = "made by the object source and the tests")
    )]
    pub(crate) fn new(
        meta: Vec<ShardMeta>,
        fetch: Box<dyn Fetch>,
        cap: u64,
        fetchers: usize,
    ) -> Self {
        let mut starts = Vec::with_capacity(meta.len() + 1);
        starts.push(0);
        for m in &meta {
            starts.push(starts.last().copied().unwrap_or(0) + m.count);
        }
        let largest = meta.iter().map(|m| m.bytes).max().unwrap_or(0);
        StreamedShards {
            inner: Arc::new(Inner {
                meta,
                starts,
                fetch,
                cap: cap.max(largest),
                fetchers: fetchers.max(1),
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
                fetched: AtomicU64::new(0),
                fetched_bytes: AtomicU64::new(0),
                peak_bytes: AtomicU64::new(0),
                waited_ns: AtomicU64::new(0),
            }),
        }
    }

    /// Records in all the shards.
    pub fn len(&self) -> usize {
        self.inner.starts.last().copied().unwrap_or(0)
    }

    /// The first record of each shard, then the total.
    pub(crate) fn starts(&self) -> &[usize] {
        &self.inner.starts
    }

    /// Whether there is no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shards: each one's name (its URL or path), bytes and records.
    pub fn shards(&self) -> impl ExactSizeIterator<Item = (&str, u64, usize)> + '_ {
        self.inner
            .meta
            .iter()
            .map(|m| (m.name.as_str(), m.bytes, m.count))
    }

    /// The most bytes of shards held at once (the cap asked for, or the largest shard where
    /// that is larger).
    pub fn cap(&self) -> u64 {
        self.inner.cap
    }

    /// Counters so far.
    pub fn stats(&self) -> StreamStats {
        let i = &self.inner;
        StreamStats {
            held_bytes: i.state.lock().held,
            fetched: i.fetched.load(Ordering::Relaxed),
            fetched_bytes: i.fetched_bytes.load(Ordering::Relaxed),
            peak_bytes: i.peak_bytes.load(Ordering::Relaxed),
            waited_s: i.waited_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }

    /// Which shard holds record `i`, and its index there.
    pub fn locate(&self, i: usize) -> Option<(usize, usize)> {
        locate(&self.inner.starts, i)
    }

    /// The first shard's `.npy` layout (`None` where it is not an `.npy` file).
    pub fn npy(&self) -> Option<&NpyLayout> {
        self.inner.meta.first().and_then(|m| m.records.get()?.npy())
    }

    /// Each shard's `.npy` layout (`None` for one that is not an `.npy` file), in order.
    pub fn npys(&self) -> impl ExactSizeIterator<Item = Option<&NpyLayout>> + '_ {
        self.inner.meta.iter().map(|m| m.records.get()?.npy())
    }

    /// Record `i`'s tar sample: its key and members (`None` for other records).
    pub fn sample(&self, i: usize) -> Option<&TarSample> {
        let (s, j) = self.locate(i)?;
        self.inner.meta[s].records.get()?.sample(j)
    }

    /// Record `i`'s shard name (its URL or path), for errors.
    pub fn name_of(&self, i: usize) -> &str {
        match self.locate(i) {
            Some((s, _)) => &self.inner.meta[s].name,
            None => "",
        }
    }

    /// Starts an epoch whose batches are `jobs` (in order): works out which shards it needs
    /// when, refuses it where the order needs more than the cap at once, and starts the fetch
    /// threads. The returned guard stops them (and lets every shard go) when dropped.
    pub(crate) fn begin<'a>(&self, jobs: impl Iterator<Item = &'a [usize]>) -> Result<StreamRun> {
        let inner = &self.inner;
        let n = inner.meta.len();
        // Each shard's first and last batch, and batches using it.
        let mut first = vec![usize::MAX; n];
        let mut last = vec![0usize; n];
        let mut uses = vec![0usize; n];
        let mut seen = Vec::new();
        let mut batches = 0;
        for (b, job) in jobs.enumerate() {
            batches = b + 1;
            seen.clear();
            seen.extend(job.iter().filter_map(|&i| self.locate(i).map(|(s, _)| s)));
            seen.sort_unstable();
            seen.dedup();
            for &s in &seen {
                first[s] = first[s].min(b);
                last[s] = b;
                uses[s] += 1;
            }
        }
        let peak = peak_bytes(&first, &last, &inner.meta, batches);
        if peak > inner.cap {
            return Err(Error::invalid(format!(
                "this epoch's order needs {} of shards held at once (every shard a batch \
                 position still needs), over the cap of {}: raise the cap (spool_bytes), \
                 or stream with an order that uses few shards at a time (Order::Shards, \
                 Python shuffle=\"shards\": shards in a shuffled order; or sequential)",
                gib(peak),
                gib(inner.cap)
            )));
        }
        let mut order: Vec<usize> = (0..n).filter(|&s| uses[s] > 0).collect();
        order.sort_by_key(|&s| (first[s], s));
        let generation = {
            let mut st = inner.state.lock();
            st.generation += 1;
            st.slots = (0..n).map(|_| Slot::Absent).collect();
            st.held = 0;
            st.queue = order.into();
            st.uses = uses;
            st.stopped = false;
            st.generation
        };
        let mut run = StreamRun {
            inner: Arc::clone(inner),
            generation,
        };
        for t in 0..inner.fetchers.min(n.max(1)) {
            let inner = Arc::clone(inner);
            let spawned = std::thread::Builder::new()
                .name(format!("gpufeed-shard-fetch-{t}"))
                .spawn(move || fetch_loop(&inner, generation));
            if let Err(source) = spawned {
                run.stop();
                return Err(gpufeed_load::Error::ThreadStart {
                    what: "a shard fetch thread",
                    source,
                }
                .into());
            }
        }
        Ok(run)
    }

    /// Gathers a batch: waits for the shards of `indices`, then `gather` reads them; the
    /// shards are let go where this was the last batch of the epoch that needs them.
    /// `generation` is the epoch's ([`StreamRun::generation`]): a worker left behind by an
    /// epoch that ended touches nothing of the next.
    pub(crate) fn with_records<T>(
        &self,
        generation: u64,
        indices: &[usize],
        gather: impl FnOnce(&dyn Source) -> Result<T>,
    ) -> Result<T> {
        let mut shards: Vec<usize> = indices
            .iter()
            .filter_map(|&i| self.locate(i).map(|(s, _)| s))
            .collect();
        shards.sort_unstable();
        shards.dedup();
        // Released however the gather ends (a panic included), or the shards would stay held.
        struct Release<'a> {
            set: &'a StreamedShards,
            shards: &'a [usize],
            generation: u64,
        }
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                self.set.release(self.shards, self.generation);
            }
        }
        let _release = Release {
            set: self,
            shards: &shards,
            generation,
        };
        self.acquire(&shards, generation).and_then(|held| {
            gather(&Held {
                set: self,
                held: &held,
            })
        })
    }

    /// The files of `shards` (sorted), once all are here.
    fn acquire(&self, shards: &[usize], generation: u64) -> Result<Vec<(usize, Arc<RecordFile>)>> {
        let inner = &self.inner;
        let t = Instant::now();
        let mut st = inner.state.lock();
        let held = loop {
            if st.generation != generation {
                return Err(Error::WorkersStopped);
            }
            if st.stopped {
                return Err(Error::WorkersStopped);
            }
            let mut ready = Vec::with_capacity(shards.len());
            let mut waiting = false;
            for &s in shards {
                match st.slots.get(s) {
                    Some(Slot::Ready(file)) => ready.push((s, Arc::clone(file))),
                    Some(Slot::Failed(why)) => {
                        return Err(Error::Records {
                            path: inner.meta[s].name.clone().into(),
                            reason: format!("the shard could not be fetched: {why}"),
                        });
                    }
                    _ => waiting = true,
                }
            }
            if !waiting {
                break ready;
            }
            inner.changed.wait(&mut st);
        };
        drop(st);
        let waited = t.elapsed().as_nanos() as u64;
        inner.waited_ns.fetch_add(waited, Ordering::Relaxed);
        Ok(held)
    }

    /// One batch of epoch `generation` using `shards` is done: lets go of each that no later
    /// batch uses (nothing where that epoch has ended: a worker left behind by it).
    fn release(&self, shards: &[usize], generation: u64) {
        let inner = &self.inner;
        let mut gone = Vec::new();
        {
            let mut st = inner.state.lock();
            if st.generation != generation {
                return;
            }
            for &s in shards {
                let Some(left) = st.uses.get_mut(s) else {
                    continue;
                };
                *left = left.saturating_sub(1);
                if *left == 0
                    && let Some(file) = take_ready(&mut st, s, inner.meta[s].bytes)
                {
                    gone.push(file);
                }
            }
        }
        if !gone.is_empty() {
            inner.changed.notify_all();
        }
        // Freed (unmapped) here, outside the lock, where this worker held the last reference.
        drop(gone);
    }
}

/// Shard `s`'s bytes where they are here: its slot emptied and its bytes no longer counted as
/// held (they are freed when the last batch holding them is done with them).
fn take_ready(st: &mut State, s: usize, bytes: u64) -> Option<Arc<RecordFile>> {
    match std::mem::take(&mut st.slots[s]) {
        Slot::Ready(file) => {
            st.held = st.held.saturating_sub(bytes);
            Some(file)
        }
        other => {
            st.slots[s] = other;
            None
        }
    }
}

/// The most bytes of shards an epoch needs at once: at each batch, every shard that batch or
/// an earlier one used and that it or a later one uses (live there). Under a cap of at least
/// this, fetching never stalls: fetch threads take shards in order of first use, workers take
/// batches in order, and a shard goes after its last use. With f the next shard to fetch and b
/// the earliest unfinished batch: if b comes before f's first use, b needs only shards already
/// taken and finishes; else every held shard was first used no later than f and is still used
/// at or after b, so it and f are all live at f's first use, together within this peak.
fn peak_bytes(first: &[usize], last: &[usize], meta: &[ShardMeta], batches: usize) -> u64 {
    let mut delta = vec![0i128; batches + 1];
    for s in 0..meta.len() {
        if first[s] == usize::MAX {
            continue;
        }
        delta[first[s]] += i128::from(meta[s].bytes);
        delta[last[s] + 1] -= i128::from(meta[s].bytes);
    }
    let (mut now, mut peak) = (0i128, 0i128);
    for d in delta {
        now += d;
        peak = peak.max(now);
    }
    u64::try_from(peak).unwrap_or(u64::MAX)
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn locate(starts: &[usize], i: usize) -> Option<(usize, usize)> {
    if i >= starts.last().copied().unwrap_or(0) {
        return None;
    }
    let shard = starts.partition_point(|&s| s <= i) - 1;
    Some((shard, i - starts[shard]))
}

/// One fetch thread of epoch `generation`: takes the next shard in order of need once it fits
/// under the cap, fetches and maps it.
fn fetch_loop(inner: &Inner, generation: u64) {
    loop {
        let s = {
            let mut st = inner.state.lock();
            loop {
                if st.stopped || st.generation != generation {
                    return;
                }
                match st.queue.front().copied() {
                    None => return,
                    // Every batch that needs it already failed (another shard could not be had).
                    Some(s) if st.uses[s] == 0 => {
                        st.queue.pop_front();
                    }
                    Some(s)
                        if st
                            .held
                            .saturating_add(st.stale)
                            .saturating_add(inner.meta[s].bytes)
                            <= inner.cap =>
                    {
                        st.queue.pop_front();
                        st.slots[s] = Slot::Fetching;
                        st.held = st.held.saturating_add(inner.meta[s].bytes);
                        inner
                            .peak_bytes
                            .fetch_max(st.held.saturating_add(st.stale), Ordering::Relaxed);
                        break s;
                    }
                    Some(_) => inner.changed.wait(&mut st),
                }
            }
        };
        let meta = &inner.meta[s];
        let got = inner.fetch.fetch(s).and_then(|fetched| match fetched {
            Fetched::Opened(file) => Ok(file),
            Fetched::File(path) => {
                // SAFETY: the file is a cache directory's (written whole before it was named,
                // never written again).
                #[allow(unsafe_code, reason = "maps a fetched shard file")]
                let file =
                    unsafe { RecordFile::open_with(&path, meta.bytes, |b| meta.records_for(b)) };
                file.map(Arc::new)
            }
            Fetched::Memory(bytes) => {
                let len = bytes.as_ref().map_or(0, |b| b.len() as u64);
                if len != meta.bytes {
                    return Err(Error::Records {
                        path: meta.name.clone().into(),
                        reason: format!("{len} bytes fetched where the shard had {}", meta.bytes),
                    });
                }
                let tar = bytes
                    .as_ref()
                    .map_or(&[][..], gpufeed_os::align::AlignedBuf::as_slice);
                let records = meta.records_for(tar)?;
                Ok(Arc::new(RecordFile::in_memory(&meta.name, records, bytes)))
            }
        });
        let mut st = inner.state.lock();
        if st.generation != generation {
            // The epoch ended meanwhile: nothing of this fetch is kept.
            st.stale = st.stale.saturating_sub(meta.bytes);
            drop(st);
            drop(got);
            inner.changed.notify_all();
            return;
        }
        match got {
            Ok(file) => {
                inner.fetched.fetch_add(1, Ordering::Relaxed);
                inner.fetched_bytes.fetch_add(meta.bytes, Ordering::Relaxed);
                st.slots[s] = Slot::Ready(file);
                // Every batch that used it already failed (another shard could not be had).
                if st.uses[s] == 0 {
                    let file = take_ready(&mut st, s, meta.bytes);
                    drop(st);
                    drop(file);
                    inner.changed.notify_all();
                    continue;
                }
            }
            Err(e) => {
                st.slots[s] = Slot::Failed(e.to_string());
                st.held = st.held.saturating_sub(meta.bytes);
            }
        }
        drop(st);
        inner.changed.notify_all();
    }
}

/// An epoch's fetching: stopped, and every shard let go, when dropped (or at
/// [`StreamRun::stop`]). Fetch threads in the middle of a fetch are not waited for: they drop
/// their shard when it arrives.
pub(crate) struct StreamRun {
    inner: Arc<Inner>,
    generation: u64,
}

impl StreamRun {
    /// This epoch's number among the set's epochs.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether a shard of this epoch is being fetched now.
    pub(crate) fn fetching(&self) -> bool {
        let st = self.inner.state.lock();
        st.generation == self.generation && st.slots.iter().any(|s| matches!(s, Slot::Fetching))
    }

    /// Stops the fetching and wakes the workers waiting for shards (they get
    /// [`Error::WorkersStopped`]); lets every shard go.
    pub(crate) fn stop(&mut self) {
        let inner = &self.inner;
        let mut gone = Vec::new();
        {
            let mut st = inner.state.lock();
            if st.generation != self.generation || st.stopped {
                return;
            }
            st.stopped = true;
            st.queue.clear();
            for s in 0..st.slots.len() {
                gone.extend(take_ready(&mut st, s, inner.meta[s].bytes));
            }
            // Shards being fetched now count as stale until their threads drop them.
            st.stale = st.stale.saturating_add(st.held);
            st.held = 0;
            // A new generation tells the fetch threads still fetching to drop their shards.
            st.generation += 1;
        }
        inner.changed.notify_all();
        drop(gone);
    }
}

impl Drop for StreamRun {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The shards one batch holds, as the workers' record source.
struct Held<'a> {
    set: &'a StreamedShards,
    held: &'a [(usize, Arc<RecordFile>)],
}

impl Held<'_> {
    fn find(&self, i: usize) -> Option<(&RecordFile, usize)> {
        let (s, j) = self.set.locate(i)?;
        let k = self.held.binary_search_by_key(&s, |(s, _)| *s).ok()?;
        Some((&self.held[k].1, j))
    }
}

impl Source for Held<'_> {
    fn parts(&self, i: usize) -> Option<Vec<&[u8]>> {
        let (f, j) = self.find(i)?;
        f.parts(j)
    }
    fn record(&self, i: usize) -> Option<&[u8]> {
        let (f, j) = self.find(i)?;
        f.record(j)
    }
    fn path_of(&self, i: usize) -> &Path {
        Path::new(self.set.name_of(i))
    }
    fn ranges(&self, _: usize) -> Option<(usize, Vec<std::ops::Range<usize>>)> {
        None // never read with O_DIRECT (refused at the loader's start)
    }
    fn file(&self, _: usize) -> Option<&RecordFile> {
        None
    }
}

#[cfg(feature = "object")]
pub use objects::StreamOptions;

#[cfg(feature = "object")]
mod objects {
    //! Shards in object storage (and local shard files among them).

    use std::path::PathBuf;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use gpufeed_load::object::{Object, ObjectCache, ObjectOptions, ObjectUrl};
    use gpufeed_os::align::AlignedBuf;
    use parking_lot::{Condvar, Mutex};

    use super::{Fetch, Fetched, ShardMeta, StreamedShards};
    use crate::error::{Error, Result};
    use crate::records::{RecordFile, Records};
    use crate::sources::{self, SourceError};

    /// How [`StreamedShards::open`] reads shards in object storage.
    #[derive(Debug, Clone)]
    #[non_exhaustive]
    pub struct StreamOptions {
        /// The size of each record of a shard whose name ends in neither `.npy` nor `.tar`
        /// (those say their own layout); such a shard without it is refused.
        pub record_bytes: Option<usize>,
        /// A cache directory ([`ObjectCache`]: this user's, private): shards are fetched into
        /// files there, which stay, so a later epoch or run finds them without fetching (and
        /// nothing bounds the directory). `None` (the default): shards are fetched into this
        /// process's memory, at most `spool_bytes` at once, and freed after the last batch of
        /// the epoch that uses them.
        pub cache: Option<PathBuf>,
        /// The most bytes of shards held at once (at least the largest shard). Default: a
        /// quarter of the memory available when the shards are opened, at most 16 GiB (4 GiB
        /// where that cannot be read); unbounded with a cache directory.
        pub spool_bytes: Option<u64>,
        /// Shards fetched at once (default 4; each with the object options' requests in
        /// flight).
        pub fetchers: usize,
        /// Credentials, endpoint, requests in flight, retries, timeouts.
        pub object: ObjectOptions,
    }

    impl Default for StreamOptions {
        fn default() -> Self {
            StreamOptions {
                record_bytes: None,
                cache: None,
                spool_bytes: None,
                fetchers: 4,
                object: ObjectOptions::default(),
            }
        }
    }

    impl StreamOptions {
        /// These options with records of `bytes` for shards that are neither `.npy` nor
        /// `.tar`.
        pub fn with_record_bytes(mut self, bytes: usize) -> Self {
            self.record_bytes = Some(bytes);
            self
        }
        /// These options with a cache directory.
        pub fn with_cache(mut self, dir: impl Into<PathBuf>) -> Self {
            self.cache = Some(dir.into());
            self
        }
        /// These options with at most `bytes` of shards held at once.
        pub fn with_spool_bytes(mut self, bytes: u64) -> Self {
            self.spool_bytes = Some(bytes);
            self
        }
        /// These options with `n` shards fetched at once.
        pub fn with_fetchers(mut self, n: usize) -> Self {
            self.fetchers = n;
            self
        }
        /// These options with `object` for the requests.
        pub fn with_object_options(mut self, object: ObjectOptions) -> Self {
            self.object = object;
            self
        }
    }

    /// The default cap without a cache directory: a quarter of the memory available, at most
    /// 16 GiB (4 GiB where it cannot be read).
    fn default_spool_bytes() -> u64 {
        gpufeed_os::sys::mem_available().map_or(4 << 30, |a| (a / 4).min(16 << 30))
    }

    /// A shard opened before the first epoch: where it comes from and what it holds.
    type Opened = Result<(Origin, ShardMeta)>;

    enum Origin {
        Local(Arc<RecordFile>),
        Object(Box<Object>),
    }

    /// Objects fetched into memory or a cache directory; local files used where they are.
    struct ObjectFetch {
        origins: Vec<Origin>,
        cache: Option<ObjectCache>,
    }

    impl Fetch for ObjectFetch {
        fn fetch(&self, shard: usize) -> Result<Fetched> {
            match (&self.origins[shard], &self.cache) {
                (Origin::Local(f), _) => Ok(Fetched::Opened(Arc::clone(f))),
                (Origin::Object(o), Some(cache)) => Ok(Fetched::File(cache.fetch(o)?.path)),
                (Origin::Object(o), None) => Ok(Fetched::Memory(read_whole(o)?)),
            }
        }
    }

    /// All of `object` in memory of its own (`None` for an empty one): ranged GETs straight
    /// into it, the object options' requests in flight.
    fn read_whole(object: &Object) -> Result<Option<AlignedBuf>> {
        let len = usize::try_from(object.len()).map_err(|_| {
            Error::invalid(format!(
                "{}: larger than this machine's memory",
                object.url()
            ))
        })?;
        if len == 0 {
            return Ok(None);
        }
        let mut buf = AlignedBuf::new(len, 4096).map_err(gpufeed_load::Error::from)?;
        object
            .read_exact_at(0, buf.as_mut_slice())
            .map_err(gpufeed_load::Error::Object)?;
        Ok(Some(buf))
    }

    /// Bytes that may be in memory at once while tar shards are read to count their samples.
    struct Budget {
        left: Mutex<u64>,
        freed: Condvar,
    }

    impl Budget {
        /// Waits until `bytes` fit (or nothing else is taken), takes them.
        fn take(&self, bytes: u64, cap: u64) {
            let mut left = self.left.lock();
            while *left < bytes && *left < cap {
                self.freed.wait(&mut left);
            }
            *left = left.saturating_sub(bytes);
        }
        fn give(&self, bytes: u64, cap: u64) {
            let mut left = self.left.lock();
            *left = (*left + bytes).min(cap);
            self.freed.notify_all();
        }
    }

    impl StreamedShards {
        /// Shards named by `paths`, in this order: `s3://` and `https://` URLs (an `s3://`
        /// URL with a wildcard, such as `s3://data/train-*.tar`, stands for the keys it
        /// matches, sorted) and local files; a name ending in `.json` is a shard index
        /// (webdataset's wids format: `{"shardlist": [{"url": "train-000.tar", "nsamples":
        /// 10000}, ...]}`, URLs relative to its `base_path` or its own folder), which stands
        /// for the shards it lists. Each shard is `.npy` rows, WebDataset tar samples (by its
        /// name's ending) or records of `opts.record_bytes`.
        ///
        /// Here, before the first epoch, each object's version is pinned (one `HEAD`: every
        /// later request asks for that version, and a shard replaced since is an error naming
        /// it) and its records counted: fixed records from its length, `.npy` rows from its
        /// header (one ranged read), a tar's samples from a shard index where one lists it
        /// (nothing read: the tar is indexed when the epoch first fetches it, and an index
        /// whose count is not the tar's is an error naming it then), else from its headers,
        /// for which a tar shard is read whole once here (into the cache directory, where
        /// there is one, where it then stays; otherwise into memory, under the cap, and dropped
        /// once indexed: the epoch fetches it again).
        ///
        /// # Example
        /// ```no_run
        /// use gpufeed_data::{BatchLoader, BatchLoaderOptions, Order, Sampler, StreamOptions, StreamedShards};
        /// let opts = StreamOptions::default().with_record_bytes(4096).with_spool_bytes(8 << 30);
        /// let shards = StreamedShards::open(&["s3://data/train-*.bin"], &opts)?;
        /// // Shards in a shuffled order, each one's records shuffled.
        /// let sampler = Sampler::new(Order::Shards { seed: 1 });
        /// let mut loader = BatchLoader::new(shards, sampler, BatchLoaderOptions::default(), None)?;
        /// for batch in loader.epoch(0)? {
        ///     let batch = batch?;
        /// }
        /// # Ok::<(), Box<dyn std::error::Error>>(())
        /// ```
        ///
        /// # Errors
        /// An object's errors ([`gpufeed_load::Error::Object`]: a missing bucket or key,
        /// refused credentials, an unreachable server); [`Error::Records`] naming the shard
        /// whose layout is wrong (a length that is not a whole number of records, no
        /// `record_bytes` for a shard that needs it, a bad `.npy` header or tar);
        /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for an empty list, a
        /// pattern that matches nothing, or a cache directory that is not private.
        pub fn open(paths: &[impl AsRef<str>], opts: &StreamOptions) -> Result<StreamedShards> {
            // Each shard's name, and its samples where a shard index counts them.
            let mut names: Vec<(String, Option<usize>)> = Vec::new();
            for p in paths {
                let p = p.as_ref();
                if without_query(p).to_ascii_lowercase().ends_with(".json") {
                    names.extend(shard_index(p, &opts.object)?);
                } else if ObjectUrl::is_url(p) {
                    let listed = gpufeed_load::object::list(p, &opts.object)
                        .map_err(gpufeed_load::Error::Object)?;
                    names.extend(listed.into_iter().map(|u| (u.as_str().to_owned(), None)));
                } else {
                    names.push((p.to_owned(), None));
                }
            }
            if names.is_empty() {
                return Err(Error::invalid("an empty list of shards".into()));
            }
            let cache = opts.cache.as_ref().map(ObjectCache::open).transpose()?;
            let cap = match (opts.spool_bytes, &cache) {
                (Some(cap), _) => cap,
                (None, Some(_)) => u64::MAX,
                (None, None) => default_spool_bytes(),
            };
            let budget = Budget {
                left: Mutex::new(cap),
                freed: Condvar::new(),
            };
            // Opened (and counted) several at once: a HEAD each, a ranged read per .npy
            // header, a whole read per tar.
            // The first failure stops the others taking more.
            let next = AtomicUsize::new(0);
            let failed = std::sync::atomic::AtomicBool::new(false);
            let slots: Vec<Mutex<Option<Opened>>> =
                names.iter().map(|_| Mutex::new(None)).collect();
            std::thread::scope(|scope| {
                for _ in 0..opts.fetchers.clamp(1, 16).min(names.len()) {
                    scope.spawn(|| {
                        while !failed.load(Ordering::Relaxed) {
                            let k = next.fetch_add(1, Ordering::Relaxed);
                            let Some((name, counted)) = names.get(k) else {
                                return;
                            };
                            let opened =
                                open_one(name, *counted, opts, cache.as_ref(), &budget, cap);
                            if opened.is_err() {
                                failed.store(true, Ordering::Relaxed);
                            }
                            *slots[k].lock() = Some(opened);
                        }
                    });
                }
            });
            let mut opened: Vec<Option<Opened>> =
                slots.into_iter().map(Mutex::into_inner).collect();
            // The first shard in order that failed is the error.
            if let Some(k) = opened.iter().position(|o| matches!(o, Some(Err(_))))
                && let Some(Err(e)) = opened.swap_remove(k)
            {
                return Err(e);
            }
            let mut fetch = ObjectFetch {
                origins: Vec::with_capacity(names.len()),
                cache,
            };
            let mut meta = Vec::with_capacity(names.len());
            for o in opened {
                let (origin, m) =
                    o.unwrap_or_else(|| Err(Error::invalid("a shard was not opened".into())))?;
                fetch.origins.push(origin);
                meta.push(m);
            }
            Ok(StreamedShards::new(
                meta,
                Box::new(fetch),
                cap,
                opts.fetchers,
            ))
        }
    }

    #[derive(Clone, Copy)]
    enum Kind {
        Fixed(usize),
        Npy,
        Tar,
    }

    /// `name` without a URL's query or fragment (`https://host/x.tar?sig=...`).
    fn without_query(name: &str) -> &str {
        if ObjectUrl::is_url(name) {
            name.split(['?', '#']).next().unwrap_or(name)
        } else {
            name
        }
    }

    /// The most bytes of a shard index read.
    const MAX_INDEX_BYTES: u64 = 64 << 20;

    /// The shards a shard index lists, with their samples: webdataset's wids format, a JSON
    /// object whose `shardlist` holds `{"url": ..., "nsamples": N}` entries (other fields
    /// ignored), each `url` absolute or relative to the optional `base_path`, else to the
    /// index's own folder.
    fn shard_index(index: &str, opts: &ObjectOptions) -> Result<Vec<(String, Option<usize>)>> {
        #[derive(serde::Deserialize)]
        struct Index {
            shardlist: Vec<Entry>,
            #[serde(default)]
            base_path: Option<String>,
        }
        #[derive(serde::Deserialize)]
        struct Entry {
            url: String,
            nsamples: usize,
        }
        let bad = |reason: String| Error::Records {
            path: index.into(),
            reason,
        };
        let too_big = |len: u64| {
            bad(format!(
                "{len} bytes: larger than a shard index can be ({MAX_INDEX_BYTES} bytes at most)"
            ))
        };
        let text = if ObjectUrl::is_url(index) {
            let object = Object::open(index, opts).map_err(gpufeed_load::Error::Object)?;
            if object.len() > MAX_INDEX_BYTES {
                return Err(too_big(object.len()));
            }
            object.read_all().map_err(gpufeed_load::Error::Object)?
        } else {
            use std::io::Read;
            let (file, identity) =
                gpufeed_os::file::open_regular(std::path::Path::new(index), false)
                    .map_err(gpufeed_load::Error::from)?;
            if identity.size > MAX_INDEX_BYTES {
                return Err(too_big(identity.size));
            }
            let mut text = Vec::new();
            file.take(MAX_INDEX_BYTES)
                .read_to_end(&mut text)
                .map_err(|e| bad(format!("cannot read it: {e}")))?;
            text
        };
        let parsed: Index = serde_json::from_slice(&text).map_err(|e| {
            bad(format!(
                "not a shard index (webdataset's wids format: {{\"shardlist\": [{{\"url\": \
                 ..., \"nsamples\": N}}, ...]}}): {e}"
            ))
        })?;
        if parsed.shardlist.is_empty() {
            return Err(bad("its shardlist is empty".into()));
        }
        // The folder relative URLs are in: base_path (itself relative to the index's folder
        // where it is relative), else the index's folder.
        let folder = |of: &str| -> String {
            let of = without_query(of);
            match of.rfind('/') {
                Some(i) => of[..=i].to_owned(),
                None => String::new(),
            }
        };
        let absolute = |u: &str| ObjectUrl::is_url(u) || u.starts_with('/');
        let here = folder(index);
        let base = match &parsed.base_path {
            Some(b) if absolute(b) => b.clone(),
            Some(b) => format!("{here}{b}"),
            None => here,
        };
        let base = if base.is_empty() || base.ends_with('/') {
            base
        } else {
            format!("{base}/")
        };
        // An index in object storage lists objects only: a local path there (absolute, or
        // under a local base_path) would have another machine's file read into the batches.
        let remote = ObjectUrl::is_url(index);
        parsed
            .shardlist
            .into_iter()
            .map(|e| {
                let url = if absolute(&e.url) {
                    e.url
                } else {
                    format!("{base}{}", e.url)
                };
                if remote && !ObjectUrl::is_url(&url) {
                    return Err(bad(format!(
                        "it is in object storage and lists the local path {url:?}: an index in \
                         a bucket may list only objects (relative names, or s3:// / https:// \
                         URLs)"
                    )));
                }
                Ok((url, Some(e.nsamples)))
            })
            .collect()
    }

    fn kind_of(name: &str, record_bytes: Option<usize>) -> Result<Kind> {
        if let Some(own) = crate::sources::own_layout(without_query(name)) {
            if record_bytes.is_some() {
                // Its records would not be cut by it: say so rather than ignore it.
                return Err(Error::Records {
                    path: name.into(),
                    reason: format!(
                        "a .{own} shard says its own records (the .npy header's rows, the \
                         tar's samples): leave record_bytes out"
                    ),
                });
            }
            return Ok(if own == "npy" { Kind::Npy } else { Kind::Tar });
        }
        match record_bytes {
            Some(0) => Err(Error::invalid("record_bytes is 0".into())),
            Some(n) => Ok(Kind::Fixed(n)),
            None => Err(Error::Records {
                path: name.into(),
                reason: "records of which size? give record_bytes (a name ending in .npy or \
                         .tar says its own layout)"
                    .into(),
            }),
        }
    }

    /// Shard `name`: where it comes from and what it holds.
    fn open_one(
        name: &str,
        counted: Option<usize>,
        opts: &StreamOptions,
        cache: Option<&ObjectCache>,
        budget: &Budget,
        cap: u64,
    ) -> Opened {
        let (origin, meta) = open_counting(name, counted, opts, cache, budget, cap)?;
        if let Some(n) = counted
            && n != meta.count
        {
            return Err(super::index_says(name, n, meta.count));
        }
        Ok((origin, meta))
    }

    /// Shard `name` opened, its records counted (but a tar's where a shard index counted
    /// them: `counted`).
    fn open_counting(
        name: &str,
        counted: Option<usize>,
        opts: &StreamOptions,
        cache: Option<&ObjectCache>,
        budget: &Budget,
        cap: u64,
    ) -> Opened {
        let kind = kind_of(name, opts.record_bytes)?;
        if !ObjectUrl::is_url(name) {
            // SAFETY: the caller's promise for local shards, as for `ShardSet`.
            #[allow(unsafe_code, reason = "maps a local shard to count its records")]
            let file = unsafe {
                match kind {
                    Kind::Fixed(n) => RecordFile::open_fixed(name, n),
                    Kind::Npy => RecordFile::open_npy(name),
                    Kind::Tar => RecordFile::open_tar(name),
                }
            }?;
            let meta = ShardMeta::known(
                name.to_owned(),
                file.mapped_len() as u64,
                file.records().clone(),
            );
            return Ok((Origin::Local(Arc::new(file)), meta));
        }
        let object = Object::open(name, &opts.object).map_err(gpufeed_load::Error::Object)?;
        let len = object.len();
        let bad = |reason: String| Error::Records {
            path: name.into(),
            reason,
        };
        if let (Kind::Tar, Some(n)) = (kind, counted) {
            // Indexed when its bytes first arrive (and checked to hold `n` samples then).
            let meta = ShardMeta {
                name: name.to_owned(),
                bytes: len,
                count: n,
                records: std::sync::OnceLock::new(),
            };
            return Ok((Origin::Object(Box::new(object)), meta));
        }
        let records = match kind {
            Kind::Fixed(size) => {
                if len % size as u64 != 0 {
                    return Err(bad(format!(
                        "{len} bytes are not a whole number of {size}-byte records ({} bytes \
                         left over): the object is truncated or the record size is wrong",
                        len % size as u64
                    )));
                }
                let count = usize::try_from(len / size as u64)
                    .map_err(|_| bad("more records than this machine can count".into()))?;
                Records::Fixed {
                    base: 0,
                    size,
                    count,
                    npy: None,
                }
            }
            Kind::Npy => {
                let npy = npy_header(&object, len).map_err(|e| match e {
                    HeaderError::Source(e) => bad(e.to_string()),
                    HeaderError::Read(e) => e,
                })?;
                let size = npy.row_bytes();
                let count = if size == 0 { 0 } else { npy.rows() };
                Records::Fixed {
                    base: npy.data_start,
                    size,
                    count,
                    npy: Some(npy),
                }
            }
            Kind::Tar => {
                let indexed = match cache {
                    Some(cache) => {
                        let local = cache.fetch(&object)?.path;
                        // SAFETY: a cache directory's file, written whole before it was named.
                        #[allow(unsafe_code, reason = "maps a fetched tar to index it")]
                        let file = unsafe { RecordFile::open_tar(&local) };
                        file.map(|f| f.records().clone())
                    }
                    None => {
                        budget.take(len, cap);
                        let read = read_whole(&object);
                        let indexed = read.and_then(|bytes| {
                            let tar = bytes.as_ref().map_or(&[][..], AlignedBuf::as_slice);
                            sources::index_tar(tar)
                                .map(Records::Samples)
                                .map_err(|e| bad(e.to_string()))
                        });
                        budget.give(len, cap);
                        indexed
                    }
                };
                indexed.map_err(|e| match e {
                    Error::Records { reason, .. } => bad(reason),
                    other => other,
                })?
            }
        };
        Ok((
            Origin::Object(Box::new(object)),
            ShardMeta::known(name.to_owned(), len, records),
        ))
    }

    enum HeaderError {
        Source(SourceError),
        Read(Error),
    }

    /// An `.npy` object's header: its first 4 KiB (or all of a shorter object), more where the
    /// header is longer.
    fn npy_header(
        object: &Object,
        len: u64,
    ) -> std::result::Result<sources::NpyLayout, HeaderError> {
        let mut want = len.min(4096);
        loop {
            let mut head = vec![0u8; want as usize];
            object
                .read_exact_at(0, &mut head)
                .map_err(|e| HeaderError::Read(gpufeed_load::Error::Object(e).into()))?;
            match sources::parse_npy(&head, len) {
                Err(SourceError::Incomplete { need, .. }) if need > want && need <= len => {
                    want = need;
                }
                other => return other.map_err(HeaderError::Source),
            }
        }
    }

    #[cfg(test)]
    #[test]
    fn a_shard_that_says_its_own_records_refuses_a_record_size() {
        assert!(matches!(kind_of("s3://b/x.NPY?v=1", None), Ok(Kind::Npy)));
        assert!(matches!(kind_of("s3://b/x.tar", None), Ok(Kind::Tar)));
        assert!(matches!(
            kind_of("s3://b/x.bin", Some(8)),
            Ok(Kind::Fixed(8))
        ));
        for name in ["s3://b/x.npy", "https://h/d/x.TAR"] {
            let Err(e) = kind_of(name, Some(8)) else {
                panic!("{name}: a record size taken");
            };
            assert!(
                e.to_string().contains("leave record_bytes out"),
                "{name}: {e}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shards of fixed records "fetched" from files of a directory: the odd ones into memory,
    /// the even ones mapped where they are; shard `fail` cannot be had.
    struct CopyFetch {
        from: Vec<PathBuf>,
        fail: Option<usize>,
    }

    impl Fetch for CopyFetch {
        fn fetch(&self, shard: usize) -> Result<Fetched> {
            if self.fail == Some(shard) {
                return Err(Error::invalid(format!("shard {shard} is unreachable")));
            }
            if shard.is_multiple_of(2) {
                return Ok(Fetched::File(self.from[shard].clone()));
            }
            let bytes = std::fs::read(&self.from[shard]).expect("read");
            let mut buf = gpufeed_os::align::AlignedBuf::new(bytes.len(), 4096).expect("memory");
            buf.as_mut_slice().copy_from_slice(&bytes);
            Ok(Fetched::Memory(Some(buf)))
        }
    }

    fn shards(
        dir: &Path,
        n: usize,
        records: usize,
        size: usize,
        cap: u64,
        fail: Option<usize>,
    ) -> (StreamedShards, Vec<Vec<u8>>) {
        let mut from = Vec::new();
        let mut bytes = Vec::new();
        let mut meta = Vec::new();
        for s in 0..n {
            let data: Vec<u8> = (0..records * size)
                .map(|i| (i * 31 + s * 7 + i / 251) as u8)
                .collect();
            let p = dir.join(format!("shard-{s}"));
            std::fs::write(&p, &data).expect("write");
            from.push(p);
            meta.push(ShardMeta::known(
                format!("mem://shard-{s}"),
                data.len() as u64,
                Records::Fixed {
                    base: 0,
                    size,
                    count: records,
                    npy: None,
                },
            ));
            bytes.push(data);
        }
        let fetch = CopyFetch { from, fail };
        (StreamedShards::new(meta, Box::new(fetch), cap, 2), bytes)
    }

    #[test]
    fn peak_counts_every_shard_a_batch_position_still_needs() {
        let meta = |b| ShardMeta::known(String::new(), b, Records::Indexed(vec![0, 1]));
        let m = [meta(10), meta(20), meta(40)];
        // Shard 0 in batches 0-1, shard 1 in 1-3, shard 2 in 3.
        assert_eq!(peak_bytes(&[0, 1, 3], &[1, 3, 3], &m, 4), 60);
        // Every shard from the first batch to the last.
        assert_eq!(peak_bytes(&[0, 0, 0], &[3, 3, 3], &m, 4), 70);
        // An unused shard counts for nothing.
        assert_eq!(peak_bytes(&[0, usize::MAX, 1], &[0, 0, 1], &m, 2), 40);
    }

    #[test]
    fn a_sequential_epoch_holds_two_shards_at_most_and_lets_each_go() {
        let dir = tempfile::tempdir().expect("dir");
        let (set, bytes) = shards(dir.path(), 6, 10, 7, 2 * 70, None);
        let jobs: Vec<Vec<usize>> = (0..60)
            .collect::<Vec<_>>()
            .chunks(8)
            .map(<[usize]>::to_vec)
            .collect();
        let run = set.begin(jobs.iter().map(Vec::as_slice)).expect("fits");
        for job in &jobs {
            let got = set
                .with_records(run.generation(), job, |src| {
                    Ok(job
                        .iter()
                        .map(|&i| src.record(i).expect("held").to_vec())
                        .collect::<Vec<_>>())
                })
                .expect("gathered");
            for (&i, r) in job.iter().zip(got) {
                let (s, j) = (i / 10, i % 10);
                assert_eq!(r, bytes[s][j * 7..(j + 1) * 7]);
            }
        }
        drop(run);
        let stats = set.stats();
        assert_eq!(stats.fetched, 6);
        assert!(stats.peak_bytes <= 140, "{stats:?}");
        // Every shard let go.
        assert_eq!(stats.held_bytes, 0, "{stats:?}");
    }

    #[test]
    fn an_order_that_needs_more_than_the_cap_is_refused_before_it_starts() {
        let dir = tempfile::tempdir().expect("dir");
        let (set, _) = shards(dir.path(), 4, 10, 5, 100, None);
        // Each batch takes a record of every shard: all four (200 bytes) needed throughout.
        let jobs: Vec<Vec<usize>> = (0..10).map(|k| vec![k, 10 + k, 20 + k, 30 + k]).collect();
        let err = set
            .begin(jobs.iter().map(Vec::as_slice))
            .err()
            .expect("refused");
        let text = err.to_string();
        assert!(
            text.contains("over the cap") && text.contains("spool_bytes"),
            "{text}"
        );
    }

    #[test]
    fn a_shard_that_cannot_be_fetched_fails_its_batches_naming_it_and_the_others_go_on() {
        let dir = tempfile::tempdir().expect("dir");
        let (set, _) = shards(dir.path(), 3, 4, 3, 1000, Some(1));
        let jobs: Vec<Vec<usize>> = vec![vec![0, 1], vec![4, 5], vec![8, 9]];
        let run = set.begin(jobs.iter().map(Vec::as_slice)).expect("fits");
        let read = |job: &Vec<usize>| {
            set.with_records(run.generation(), job, |src| {
                Ok(src.record(job[0]).map(<[u8]>::to_vec))
            })
        };
        assert!(read(&jobs[0]).expect("shard 0").is_some());
        let err = read(&jobs[1]).expect_err("shard 1 failed").to_string();
        assert!(
            err.contains("mem://shard-1") && err.contains("unreachable"),
            "{err}"
        );
        assert!(read(&jobs[2]).expect("shard 2").is_some());
    }

    #[test]
    fn a_worker_waiting_for_a_shard_is_woken_when_the_epoch_stops() {
        let dir = tempfile::tempdir().expect("dir");
        // A cap of one shard and a batch that needs two that nothing else releases: the
        // second batch's shard waits behind the first.
        let (set, _) = shards(dir.path(), 2, 4, 3, 12, None);
        let jobs: Vec<Vec<usize>> = vec![vec![0], vec![4]];
        let mut run = set.begin(jobs.iter().map(Vec::as_slice)).expect("fits");
        std::thread::scope(|s| {
            let generation = run.generation();
            let waiter = s.spawn(move || set.with_records(generation, &[4], |_| Ok(())));
            std::thread::sleep(std::time::Duration::from_millis(100));
            run.stop();
            let got = waiter.join().expect("no panic");
            assert!(matches!(got, Err(Error::WorkersStopped)), "{got:?}");
        });
    }
}
