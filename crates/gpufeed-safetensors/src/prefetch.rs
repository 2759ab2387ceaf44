//! [`Prefetch`]: byte ranges of one file loading to the GPU in the background, in chunks of
//! their own device memory, each range handed out once, in the order asked or as they land.
//!
//! What `safe_open(...).prefetch()` and the sweeps of `get_tensor` stand on: a worker thread
//! takes the next ranges in order (or the one a caller waits for), loads up to
//! [`PrefetchOptions::chunk_bytes`] of them in one transfer into one new allocation, and
//! publishes them; [`Prefetch::take`] waits for one range, [`Prefetch::next_ready`] for the next
//! to land. A chunk's memory is freed when every [`Piece`] of it is dropped (and the prefetch
//! with it, for pieces never taken). With [`PrefetchOptions::ahead_bytes`] the worker stops
//! while that many bytes wait untaken: device memory is then the chunks of the pieces the
//! caller holds (a held piece keeps its whole chunk), plus that bound, plus one chunk.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use gpufeed_cuda::DeviceAlloc;
use gpufeed_load::{DeviceBuffer, Loader, RouteChoice, Strategy};

use crate::error::{Error, Result};
use crate::source::{PrefetchSource, merge_adjacent};

/// One range to load: bytes `span` of the file, placed in device memory at an offset that
/// `align` divides (the element size of the tensor it holds, so that a typed view of the chunk
/// can show it, whatever its offset in the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefetchItem {
    /// Bytes of the file (absolute offsets).
    pub span: Range<u64>,
    /// What the item's offset in its chunk must be a multiple of (1 or more).
    pub align: usize,
}

/// How a [`Prefetch`] loads.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PrefetchOptions {
    /// Bytes loaded in one transfer into one allocation (at least one item each; an item
    /// larger than this is a chunk of its own). Larger chunks pay the start of a transfer
    /// fewer times; smaller ones free memory at a finer grain and hand out the first item
    /// sooner.
    pub chunk_bytes: u64,
    /// Where set, the worker waits while this many bytes are loaded but not taken (a sweep
    /// that takes items as they land holds no more than this ahead of it). A caller waiting
    /// for an item that is not loaded yet has it loaded next, whatever the bound.
    pub ahead_bytes: Option<u64>,
    /// Where set, the worker loads what callers ask for ([`Prefetch::take`]) and, while their
    /// asks follow one another in order, the items after: the first chunk after a jump holds
    /// this many bytes (at least the item asked for), each next one eight times the one before,
    /// up to `chunk_bytes`; a chunk is loaded ahead only once a caller took an item of the one before
    /// (read-ahead as the kernel does it for a file; the chunks of one run, `run_bytes`, load
    /// without a take between them). Unset, it loads every item in order.
    pub follow_from: Option<u64>,
    /// Where more than `chunk_bytes`, chunks of the full size that follow one another (in
    /// order, nobody waiting for another item) load as one transfer of up to this many bytes,
    /// each chunk still an allocation of its own and handed out as soon as it lands
    /// ([`gpufeed_load::Loader::load_parts_to`]): a staged transfer's start and end are paid
    /// once for them all. Loading bytes count against `ahead_bytes` as loaded ones do. A run
    /// stops at the next chunk that lands once the prefetch is closed or a caller waits for an
    /// item outside it (its chunks not landed are loaded later, as they would have been). 0
    /// (the default): each chunk is a transfer of its own. Files only, by a staged route
    /// (`Staged`, `Direct`); other sources and routes load chunk by chunk.
    pub run_bytes: u64,
}

impl Default for PrefetchOptions {
    fn default() -> Self {
        PrefetchOptions {
            chunk_bytes: 512 << 20,
            ahead_bytes: None,
            follow_from: None,
            run_bytes: 0,
        }
    }
}

impl PrefetchOptions {
    /// These options, loading `chunk_bytes` per transfer.
    pub fn with_chunk_bytes(mut self, chunk_bytes: u64) -> Self {
        self.chunk_bytes = chunk_bytes.max(1);
        self
    }

    /// These options, holding at most `ahead_bytes` loaded but untaken.
    pub fn with_ahead_bytes(mut self, ahead_bytes: Option<u64>) -> Self {
        self.ahead_bytes = ahead_bytes;
        self
    }

    /// These options, following the callers' asks from chunks of `follow_from` bytes (see
    /// [`PrefetchOptions::follow_from`]).
    pub fn with_follow_from(mut self, follow_from: Option<u64>) -> Self {
        self.follow_from = follow_from;
        self
    }

    /// These options, loading chunks that follow one another in transfers of up to
    /// `run_bytes` (see [`PrefetchOptions::run_bytes`]; 0: a transfer per chunk).
    pub fn with_run_bytes(mut self, run_bytes: u64) -> Self {
        self.run_bytes = run_bytes;
        self
    }
}

/// An item's bytes in device memory: `len` bytes at `offset` of a chunk's allocation, which
/// lives while any piece of it does.
#[derive(Debug, Clone)]
pub struct Piece {
    /// The chunk's allocation.
    pub buffer: Arc<DeviceBuffer>,
    /// Where the item starts in it (a multiple of its `align`).
    pub offset: usize,
    /// The item's bytes.
    pub len: usize,
    /// How many items the chunk holds (a caller that caches a view of the chunk can drop it
    /// once it has seen that many).
    pub siblings: usize,
}

/// Where an item is.
enum Status {
    Pending,
    Loading,
    Ready(Piece),
    Taken,
    Failed,
}

struct State {
    status: Vec<Status>,
    /// Items loaded and not taken, in the order they landed (taken ones are skipped).
    ready: VecDeque<usize>,
    /// Where the worker goes on from: the item after the last chunk.
    cursor: usize,
    /// Items callers wait for that are not loaded, in the order asked: the next chunk starts
    /// at the first still pending.
    demand: VecDeque<usize>,
    /// Following (see [`PrefetchOptions::follow_from`]).
    follow: bool,
    /// Bytes loaded and not taken.
    untaken: u64,
    /// Items not handed out (or given up for a failure).
    left: usize,
    closed: bool,
    /// The failure that stopped the worker: handed to the first caller that meets it.
    failure: Option<Error>,
    /// Its text, for the callers after.
    failure_text: Option<String>,
    /// Each item's chunk (a sequence number from 1; 0: none yet).
    chunk_of: Vec<u32>,
    /// The last chunk loaded.
    latest: u32,
    /// Whether a caller took an item of the last chunk (following: the next may load).
    took_latest: bool,
    /// Following: the next chunk's size.
    ramp: u64,
    /// The size the last chunk was cut to (`chunk_bytes` but on a ramp): a run starts only
    /// from a chunk of the full size.
    last_size: u64,
    /// [`PrefetchOptions::ahead_bytes`].
    ahead: Option<u64>,
}

impl State {
    /// `n` items, none loaded.
    fn new(n: usize, opts: &PrefetchOptions) -> Self {
        State {
            status: (0..n).map(|_| Status::Pending).collect(),
            ready: VecDeque::new(),
            cursor: 0,
            demand: VecDeque::new(),
            follow: opts.follow_from.is_some(),
            untaken: 0,
            left: n,
            closed: false,
            failure: None,
            failure_text: None,
            chunk_of: vec![0; n],
            latest: 0,
            took_latest: false,
            ramp: opts.follow_from.unwrap_or(opts.chunk_bytes),
            last_size: 0,
            ahead: opts.ahead_bytes,
        }
    }

    /// Whether item `i` (one of the items) has not started loading.
    fn pending(&self, i: usize) -> bool {
        matches!(self.status[i], Status::Pending)
    }

    /// Whether a caller asked for an item that has not started loading.
    fn asked_pending(&self) -> bool {
        self.demand.iter().any(|&d| self.pending(d))
    }

    /// Whether the worker waits for callers to take what it loaded
    /// ([`PrefetchOptions::ahead_bytes`]).
    fn held(&self) -> bool {
        self.ahead
            .is_some_and(|ahead| self.untaken > 0 && self.untaken >= ahead)
    }

    /// Hands out ready item `i`, waking the others only where that can let one of them on:
    /// the worker held by [`PrefetchOptions::ahead_bytes`] or, following, by a last chunk
    /// nobody took from, and callers of [`Prefetch::next_ready`] once none is left. (A wake-up
    /// per item cost a `futex` call each and, while the worker waited, a round trip through
    /// it: a sweep handing out 10,000 tensors paid it 10,000 times.)
    fn hand_out(&mut self, i: usize, shared: &Shared) -> Piece {
        let Status::Ready(piece) = std::mem::replace(&mut self.status[i], Status::Taken) else {
            unreachable!("called for a ready item")
        };
        let was_held = self.held();
        self.untaken -= piece.len as u64;
        self.left -= 1;
        let mut wake = self.left == 0 || (was_held && !self.held());
        if self.chunk_of[i] == self.latest && !self.took_latest {
            self.took_latest = true;
            wake |= self.follow;
        }
        if wake {
            shared.changed.notify_all();
        }
        piece
    }
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent state (every update is one step).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed
            .wait(guard)
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Byte ranges of one opened file loading to one GPU in the background (see the module).
///
/// # Example
/// ```no_run
/// use gpufeed_safetensors::{Prefetch, PrefetchItem, PrefetchOptions};
/// let loader = std::sync::Arc::new(gpufeed_load::Loader::open(0, Default::default())?);
/// let file = gpufeed_os::OpenedFile::open("data.bin")?;
/// let items = vec![
///     PrefetchItem { span: 0..4096, align: 1 },
///     PrefetchItem { span: 4096..10_000, align: 4 },
/// ];
/// let prefetch = Prefetch::start(loader, file, items, PrefetchOptions::default())?;
/// while let Some((i, piece)) = prefetch.next_ready()? {
///     println!("item {i}: {} bytes at {} of a chunk", piece.len, piece.offset);
/// }
/// # Ok::<(), gpufeed_safetensors::Error>(())
/// ```
pub struct Prefetch {
    shared: Arc<Shared>,
    path: std::path::PathBuf,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Prefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.shared.lock();
        f.debug_struct("Prefetch")
            .field("path", &self.path)
            .field("items", &state.status.len())
            .field("left", &state.left)
            .field("closed", &state.closed)
            .finish()
    }
}

impl Prefetch {
    /// Starts loading `items` of `file` (each checked against the file's length) to
    /// `loader`'s GPU on a worker thread. `file` is an [`OpenedFile`](gpufeed_os::OpenedFile) or (the `object`
    /// feature) an `Arc<Object>` ([`PrefetchSource`]).
    ///
    /// # Errors
    /// [`Error::Prefetch`] for an item past the end of the file or with `align` 0, or where the
    /// thread could not start.
    pub fn start(
        loader: Arc<Loader>,
        file: impl Into<PrefetchSource>,
        items: Vec<PrefetchItem>,
        opts: PrefetchOptions,
    ) -> Result<Self> {
        let file = file.into();
        let len = file.len();
        let path = file.path();
        for (i, item) in items.iter().enumerate() {
            if item.span.start > item.span.end || item.span.end > len || item.align == 0 {
                return Err(Error::Prefetch {
                    path,
                    reason: format!(
                        "item {i}: bytes {}..{} aligned to {} do not fit a file of {len} bytes",
                        item.span.start, item.span.end, item.align
                    ),
                });
            }
        }
        let n = items.len();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new(n, &opts)),
            changed: Condvar::new(),
        });
        let worker = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("gpufeed-prefetch".into())
                .spawn(move || work(&shared, &loader, &file, &items, &opts))
                .map_err(|e| Error::Prefetch {
                    path: path.clone(),
                    reason: format!("its thread could not start: {e}"),
                })?
        };
        Ok(Prefetch {
            shared,
            path,
            worker: Mutex::new(Some(worker)),
        })
    }

    /// The number of items.
    pub fn len(&self) -> usize {
        self.shared.lock().status.len()
    }

    /// Whether there are no items.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Item `i`'s bytes, waiting for them to land (an item not loaded yet is loaded next).
    ///
    /// # Errors
    /// [`Error::Prefetch`] for an item taken before, out of range, or after [`Prefetch::close`];
    /// the load's own error where it failed (the first caller gets it, later ones its text).
    pub fn take(&self, i: usize) -> Result<Piece> {
        self.take_if_untaken(i)?
            .ok_or_else(|| self.refused(i, "it was taken before: each is handed out once"))
    }

    /// [`Prefetch::take`], but `None` for an item taken before (a caller that then loads
    /// its own copy tells that apart from a failure without parsing an error).
    ///
    /// # Errors
    /// As [`Prefetch::take`], except for an item taken before.
    pub fn take_if_untaken(&self, i: usize) -> Result<Option<Piece>> {
        // A take that waits answers only once the item landed, was taken or failed.
        self.take_inner(i, true)
            .unwrap_or_else(|| Err(self.refused(i, "it has not landed")))
    }

    /// [`Prefetch::take_if_untaken`] without waiting: `None` where item `i` has not landed
    /// yet (a caller that must give something up before it waits, a lock or Python's GIL,
    /// does that only then).
    ///
    /// # Errors
    /// As [`Prefetch::take_if_untaken`].
    pub fn try_take_if_untaken(&self, i: usize) -> Option<Result<Option<Piece>>> {
        self.take_inner(i, false)
    }

    fn take_inner(&self, i: usize, wait: bool) -> Option<Result<Option<Piece>>> {
        let mut state = self.shared.lock();
        loop {
            if state.closed {
                return Some(Err(self.refused(i, "the prefetch was closed")));
            }
            match state.status.get(i) {
                None => return Some(Err(self.refused(i, "no such item"))),
                Some(Status::Taken) => return Some(Ok(None)),
                Some(Status::Failed) => return Some(Err(self.failure(&mut state))),
                Some(Status::Ready(_)) => return Some(Ok(Some(state.hand_out(i, &self.shared)))),
                Some(Status::Pending | Status::Loading) if !wait => return None,
                Some(Status::Pending) => {
                    // Once per item: waiters on different items must not wake each other.
                    if !state.demand.contains(&i) {
                        state.demand.push_back(i);
                        self.shared.changed.notify_all();
                    }
                }
                Some(Status::Loading) => {}
            }
            state = self.shared.wait(state);
        }
    }

    /// The next item to land that nobody took, waiting for one; `None` once every item was
    /// handed out (or the prefetch was closed).
    ///
    /// # Errors
    /// The load's error where it failed.
    pub fn next_ready(&self) -> Result<Option<(usize, Piece)>> {
        let mut state = self.shared.lock();
        loop {
            if state.closed {
                return Ok(None);
            }
            while let Some(i) = state.ready.pop_front() {
                if matches!(state.status[i], Status::Ready(_)) {
                    return Ok(Some((i, state.hand_out(i, &self.shared))));
                }
            }
            if state.failure.is_some() || state.failure_text.is_some() {
                if state.left == 0 {
                    return Ok(None);
                }
                return Err(self.failure(&mut state));
            }
            if state.left == 0 {
                return Ok(None);
            }
            // Following, nothing loads unasked: ask for the first item still pending (once;
            // an ask for an item that has loaded since does not count).
            if state.follow
                && !state.asked_pending()
                && !state.status.iter().any(|s| matches!(s, Status::Loading))
                && let Some(first) = state
                    .status
                    .iter()
                    .position(|s| matches!(s, Status::Pending))
            {
                state.demand.push_back(first);
                self.shared.changed.notify_all();
            }
            state = self.shared.wait(state);
        }
    }

    /// The next item that landed and nobody took, without waiting: `None` where none is
    /// ready now.
    pub fn try_next_ready(&self) -> Option<(usize, Piece)> {
        let mut state = self.shared.lock();
        if state.closed {
            return None;
        }
        while let Some(i) = state.ready.pop_front() {
            if matches!(state.status[i], Status::Ready(_)) {
                return Some((i, state.hand_out(i, &self.shared)));
            }
        }
        None
    }

    /// Stops the worker (after the transfer it is in) and drops every piece not taken: their
    /// chunks' memory is freed once the pieces handed out are dropped too. Later asks fail;
    /// callers waiting in [`Prefetch::take`] are woken with that error.
    pub fn close(&self) {
        {
            let mut state = self.shared.lock();
            state.closed = true;
            state.ready.clear();
            for s in state.status.iter_mut() {
                if matches!(s, Status::Ready(_)) {
                    *s = Status::Failed;
                }
            }
            state.untaken = 0;
            self.shared.changed.notify_all();
        }
        let worker = self
            .worker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(worker) = worker {
            // The worker only ever returns (a panic in it is caught by the join: nothing to do).
            let _ = worker.join();
        }
    }

    fn refused(&self, i: usize, why: &str) -> Error {
        Error::Prefetch {
            path: self.path.clone(),
            reason: format!("item {i}: {why}"),
        }
    }

    /// The failure: the error itself to the first caller, its text to later ones.
    fn failure(&self, state: &mut State) -> Error {
        if let Some(e) = state.failure.take() {
            return e;
        }
        Error::Prefetch {
            path: self.path.clone(),
            reason: format!(
                "an earlier transfer failed: {}",
                state.failure_text.as_deref().unwrap_or("(unknown)")
            ),
        }
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.close();
    }
}

/// Gives up, when the worker ends, every item it left pending or loading (a panic in a
/// transfer, a bug): their waiters are woken with an error instead of waiting for ever.
struct GiveUpOnExit<'a>(&'a Shared);

impl Drop for GiveUpOnExit<'_> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        let mut left_behind = false;
        for s in state.status.iter_mut() {
            if matches!(s, Status::Pending | Status::Loading) {
                *s = Status::Failed;
                left_behind = true;
            }
        }
        if left_behind && state.failure.is_none() && state.failure_text.is_none() {
            state.failure_text = Some(if std::thread::panicking() {
                "the prefetch thread panicked".into()
            } else {
                "the prefetch thread stopped".into()
            });
        }
        self.0.changed.notify_all();
    }
}

/// The worker: chunk after chunk (or run after run of chunks) until every item is loaded,
/// the prefetch is closed or a transfer fails.
fn work(
    shared: &Shared,
    loader: &Loader,
    file: &PrefetchSource,
    items: &[PrefetchItem],
    opts: &PrefetchOptions,
) {
    let _give_up = GiveUpOnExit(shared);
    let hull = items
        .iter()
        .fold(None::<Range<u64>>, |h, it| match h {
            None => Some(it.span.clone()),
            Some(h) => Some(h.start.min(it.span.start)..h.end.max(it.span.end)),
        })
        .unwrap_or(0..0);
    let mut route: Option<RouteChoice> = None;
    let started = std::time::Instant::now();
    let mut idle_from = started;
    loop {
        // Runs only where they can be one staged transfer: a file by a staged route.
        let runs = opts.run_bytes > opts.chunk_bytes
            && match file {
                PrefetchSource::File(file) => {
                    let route =
                        route.get_or_insert_with(|| loader.choose_route(file, hull.clone()));
                    matches!(route.strategy(), Strategy::Staged | Strategy::Direct)
                }
                #[cfg(feature = "object")]
                PrefetchSource::Object(_) => false,
            };
        let run = {
            let mut state = shared.lock();
            loop {
                if state.closed {
                    return;
                }
                let waiting = state.asked_pending();
                let held = state.held();
                // Following, a chunk loads ahead only once a caller took from the last one.
                let unasked =
                    opts.follow_from.is_some() && (state.latest == 0 || !state.took_latest);
                if !waiting && (held || unasked) {
                    state = shared.wait(state);
                    continue;
                }
                match next_chunk(&mut state, items, opts) {
                    Next::Chunk(chunk) if runs => break run_on(&mut state, items, opts, chunk),
                    Next::Chunk(chunk) => break vec![chunk],
                    Next::Idle => state = shared.wait(state),
                    Next::Done => return,
                }
            }
        };
        let layouts: Vec<Layout> = run.iter().map(|c| Layout::of(c, items)).collect();
        let began = std::time::Instant::now();
        // Every chunk from cuMemAlloc: growing the context's pool chunk by chunk would cost
        // 2-3 ms per GiB (docs/benchmarks.md, GPU run 8), and its first allocation in a
        // context 7-10 ms whatever the size (a sweep's first pooled chunk, of 16 MiB, loaded
        // in 10.6 ms, the unpooled one before it, of 8 MiB, in 2.3; GPU run 136); chunks live
        // as long as their tensors, and are freed after the device's queued work anyway.
        let from = DeviceAlloc::Unpooled;
        let mut filling = began;
        // A chunk loaded as a transfer of its own.
        let mut load_one = |chunk: &[usize], layout: &Layout| {
            loader
                .gpu()
                .alloc_filled(layout.len, from, |dst| {
                    filling = std::time::Instant::now();
                    match file {
                        PrefetchSource::File(file) => {
                            let route = route
                                .get_or_insert_with(|| loader.choose_route(file, hull.clone()));
                            // Each chunk is a load of its own: its contents checked against
                            // the prefetch's start (size, mtime), then its window in full
                            // (ctime too), so a chmod or a rename over the path between
                            // chunks does not end it.
                            let now = file.try_clone_as_of_now()?;
                            loader.load_spans_to(&now, &layout.spans, dst, Some(route))
                        }
                        #[cfg(feature = "object")]
                        PrefetchSource::Object(object) => {
                            loader.load_object_spans_to(object, &layout.spans, dst)
                        }
                    }
                })
                .map(|(buffer, _report)| {
                    let mut state = shared.lock();
                    publish(&mut state, chunk, &layout.offsets, Arc::new(buffer), items);
                })
        };
        let loaded = match file {
            PrefetchSource::File(file) if run.len() > 1 => {
                let route = route
                    .clone()
                    .unwrap_or_else(|| loader.choose_route(file, hull.clone()));
                load_run(
                    shared,
                    loader,
                    file,
                    items,
                    &run,
                    &layouts,
                    &route,
                    &mut filling,
                )
            }
            _ => run
                .iter()
                .zip(&layouts)
                .try_for_each(|(chunk, layout)| load_one(chunk, layout)),
        };
        tracing::debug!(
            chunks = run.len(),
            items = run.iter().map(Vec::len).sum::<usize>(),
            mib = layouts.iter().map(|l| l.len).sum::<usize>() as f64 / f64::from(1 << 20),
            at_ms = (began - started).as_secs_f64() * 1e3,
            idle_ms = (began - idle_from).as_secs_f64() * 1e3,
            alloc_ms = (filling - began).as_secs_f64() * 1e3,
            load_ms = began.elapsed().as_secs_f64() * 1e3,
            "prefetch chunk"
        );
        idle_from = std::time::Instant::now();
        if let Err(e) = loaded {
            let mut state = shared.lock();
            state.failure_text = Some(e.to_string());
            state.failure = Some(e.into());
            for s in state.status.iter_mut() {
                if matches!(s, Status::Pending | Status::Loading) {
                    *s = Status::Failed;
                }
            }
            shared.changed.notify_all();
            return;
        }
        shared.changed.notify_all();
    }
}

/// Loads the chunks of `run` (their `layouts`) of `file` as one staged transfer, each chunk
/// an allocation of its own handed out as soon as it landed and the file was found unchanged
/// then (as a chunk's own load checks it at its end).
#[allow(clippy::too_many_arguments, reason = "the worker's state, passed on")]
#[allow(
    unsafe_code,
    reason = "the chunks are handed out as they land (its SAFETY note)"
)]
fn load_run(
    shared: &Shared,
    loader: &Loader,
    file: &gpufeed_os::OpenedFile,
    items: &[PrefetchItem],
    run: &[Vec<usize>],
    layouts: &[Layout],
    route: &RouteChoice,
    filling: &mut std::time::Instant,
) -> std::result::Result<(), gpufeed_load::Error> {
    let mut buffers = Vec::with_capacity(run.len());
    for layout in layouts {
        // Written by the load below before any of it is handed out (`landed`).
        let (buffer, ()) = loader
            .gpu()
            .alloc_filled(layout.len, DeviceAlloc::Unpooled, |_| {
                Ok::<(), gpufeed_load::Error>(())
            })?;
        buffers.push(Arc::new(buffer));
    }
    *filling = std::time::Instant::now();
    // As a chunk's own load: its contents checked against the prefetch's start, then its
    // window in full.
    let now = file.try_clone_as_of_now()?;
    let spans: Vec<&[Range<u64>]> = layouts.iter().map(|l| &l.spans[..]).collect();
    let parts: Vec<&DeviceBuffer> = buffers.iter().map(|b| &**b).collect();
    // The first change seen when a chunk landed: later chunks are not handed out.
    let changed: Mutex<Option<gpufeed_load::Error>> = Mutex::new(None);
    // Each chunk's report answers whether the run goes on: not once the file changed, the
    // prefetch closed, or a caller waits for an item outside the run (its chunks not landed
    // then go back to pending below).
    let landed = |k: usize| -> bool {
        let mut seen = changed.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.is_some() {
            return false;
        }
        if let Err(e) = gpufeed_load::internal::check_unchanged(&now) {
            *seen = Some(e);
            return false;
        }
        drop(seen);
        let mut state = shared.lock();
        publish(
            &mut state,
            &run[k],
            &layouts[k].offsets,
            Arc::clone(&buffers[k]),
            items,
        );
        shared.changed.notify_all();
        !state.closed && !state.asked_pending()
    };
    // SAFETY: the buffers are new allocations, no GPU work uses them, and no one but `landed`
    // has them (their `Arc`s are this function's until a chunk's pieces are handed out
    // there, after its bytes landed; the load touches a chunk no more once it reported it).
    let loaded = unsafe { loader.load_parts_to(&now, &spans, &parts, Some(route), &landed) };
    if let Some(e) = changed.into_inner().unwrap_or_else(PoisonError::into_inner) {
        return Err(e);
    }
    match loaded {
        Ok(_report) => Ok(()),
        Err(gpufeed_load::Error::Cuda(gpufeed_cuda::Error::Stopped { .. })) => {
            // Closed (the worker ends) or asked elsewhere: the chunks that did not land are
            // pending again, and the worker goes on from the first of them.
            let mut state = shared.lock();
            let mut first = None;
            for &i in run.iter().flatten() {
                if matches!(state.status[i], Status::Loading) {
                    state.status[i] = Status::Pending;
                    first = first.or(Some(i));
                }
            }
            if let Some(i) = first {
                state.cursor = i;
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Marks `chunk`'s items ready at `offsets` of `buffer` (failed where the prefetch closed
/// meanwhile).
fn publish(
    state: &mut State,
    chunk: &[usize],
    offsets: &[usize],
    buffer: Arc<DeviceBuffer>,
    items: &[PrefetchItem],
) {
    state.latest += 1;
    state.took_latest = false;
    let seq = state.latest;
    for (&i, &offset) in chunk.iter().zip(offsets) {
        state.chunk_of[i] = seq;
        let len = (items[i].span.end - items[i].span.start) as usize;
        if state.closed {
            state.status[i] = Status::Failed;
            continue;
        }
        state.status[i] = Status::Ready(Piece {
            buffer: Arc::clone(&buffer),
            offset,
            len,
            siblings: chunk.len(),
        });
        state.untaken += len as u64;
        state.ready.push_back(i);
    }
}

/// `first` and the chunks after it that load with it as one transfer
/// ([`PrefetchOptions::run_bytes`]): where `first` was cut at the full size (following: the
/// ramp reached `chunk_bytes`), while nobody waits for another item and the items go on in
/// order from the cursor, within `run_bytes` and, with the loaded and untaken bytes, within
/// `ahead_bytes`.
fn run_on(
    state: &mut State,
    items: &[PrefetchItem],
    opts: &PrefetchOptions,
    first: Vec<usize>,
) -> Vec<Vec<usize>> {
    let bytes = |c: &[usize]| {
        c.iter()
            .map(|&i| items[i].span.end - items[i].span.start)
            .sum::<u64>()
    };
    let mut total = bytes(&first);
    let mut run = vec![first];
    // Following, the ramp's chunks (and the first after a jump) stay transfers of their own.
    if state.last_size < opts.chunk_bytes {
        return run;
    }
    loop {
        if state.asked_pending() {
            break;
        }
        // Following, an item at the cursor that is not pending (taken on its own) is a jump
        // for `next_chunk` (the ramp starts again): the run ends there.
        if opts.follow_from.is_some() && state.cursor < items.len() && !state.pending(state.cursor)
        {
            break;
        }
        // The next chunk's bytes at most: what `next_chunk` would cut from the cursor.
        let (_, next) = cut(state, items, state.cursor, opts.chunk_bytes);
        let ahead_ok = opts
            .ahead_bytes
            .is_none_or(|a| state.untaken + total + next <= a);
        if next == 0 || total + next > opts.run_bytes || !ahead_ok {
            break;
        }
        match next_chunk(state, items, opts) {
            Next::Chunk(c) => {
                total += bytes(&c);
                run.push(c);
            }
            Next::Idle | Next::Done => break,
        }
    }
    run
}

/// How much larger each chunk of a sweep that follows its callers is than the one before
/// ([`PrefetchOptions::follow_from`]). Eight: from 8 MiB the get_tensor sweep reaches 1 GiB
/// chunks in three steps (8, 64, 512) instead of seven, each small chunk a transfer of its own;
/// GPU run 218 (an H100, 4 GiB in 4,096 tensors, two rounds): loaded again 44.8 and 45.1 GB/s
/// against 43.1 and 41.4 doubling, fresh 33.8 against 32.5 and 32.4.
const FOLLOW_GROWTH: u64 = 8;

/// What the worker does next.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    /// Load these items (marked loading).
    Chunk(Vec<usize>),
    /// Wait: following, nothing ahead of the cursor is pending.
    Idle,
    /// Every item is loaded (or given up).
    Done,
}

/// The next chunk: from the item a caller waits for, else from the cursor on (then, unless
/// following, from the start), the pending items in order up to the chunk's size.
fn next_chunk(state: &mut State, items: &[PrefetchItem], opts: &PrefetchOptions) -> Next {
    let n = items.len();
    let mut demanded = None;
    while let Some(d) = state.demand.pop_front() {
        if state.pending(d) {
            demanded = Some(d);
            break;
        }
    }
    let start = match demanded {
        Some(d) => d,
        None => match (state.cursor..n).find(|&i| state.pending(i)) {
            Some(i) => i,
            None if opts.follow_from.is_some() => {
                return if (0..n).any(|i| state.pending(i)) {
                    Next::Idle
                } else {
                    Next::Done
                };
            }
            None => match (0..n).find(|&i| state.pending(i)) {
                Some(i) => i,
                None => return Next::Done,
            },
        },
    };
    // Following: a jump starts the ramp again, each chunk in order grows it (`FOLLOW_GROWTH`).
    let size = match opts.follow_from {
        None => opts.chunk_bytes,
        Some(from) => {
            if start != state.cursor {
                state.ramp = from;
            }
            let size = state.ramp.clamp(1, opts.chunk_bytes);
            state.ramp = size.saturating_mul(FOLLOW_GROWTH);
            size
        }
    };
    state.last_size = size;
    let room = opts
        .ahead_bytes
        .map_or(u64::MAX, |ahead| ahead.saturating_sub(state.untaken))
        .min(size)
        .max(1);
    let (chunk, bytes) = cut(state, items, start, room);
    for &i in &chunk {
        state.status[i] = Status::Loading;
    }
    state.cursor = chunk.last().map_or(start, |&last| last + 1);
    if opts.follow_from.is_some() {
        // The next chunk grows from this one, however much larger than the ramp an item made it.
        state.ramp = state.ramp.max(bytes.saturating_mul(FOLLOW_GROWTH));
    }
    Next::Chunk(chunk)
}

/// The items of a chunk of at most `room` bytes (at least one item) from item `start` on:
/// the pending ones in order; and their bytes.
fn cut(state: &State, items: &[PrefetchItem], start: usize, room: u64) -> (Vec<usize>, u64) {
    let mut chunk = Vec::new();
    let mut bytes = 0u64;
    for (i, item) in items.iter().enumerate().skip(start) {
        if !state.pending(i) {
            continue;
        }
        let len = item.span.end - item.span.start;
        if !chunk.is_empty() && bytes + len > room {
            break;
        }
        chunk.push(i);
        bytes += len;
    }
    (chunk, bytes)
}

/// Where a chunk's items go in its allocation, and the file spans that put them there.
struct Layout {
    /// Each item's offset in the allocation.
    offsets: Vec<usize>,
    /// The spans to load, back to back: each item's, started earlier where its offset needs
    /// padding (the padding is the file's bytes before it), merged where contiguous.
    spans: Vec<Range<u64>>,
    /// The allocation's length.
    len: usize,
}

impl Layout {
    fn of(chunk: &[usize], items: &[PrefetchItem]) -> Layout {
        let mut offsets = Vec::with_capacity(chunk.len());
        let mut spans = Vec::with_capacity(chunk.len());
        let mut at = 0usize;
        for &i in chunk {
            let PrefetchItem { span, align } = &items[i];
            // Padding up to the alignment, taken from the bytes before the item in the file
            // (any bytes do; the file has them: a span never starts before byte 8 of a
            // safetensors file, and the padding is less than the element size). Where the file
            // has too few bytes before it, the item goes unpadded (a caller checks offsets).
            let pad = (align - at % align) % align;
            let pad = if pad as u64 <= span.start { pad } else { 0 };
            spans.push(span.start - pad as u64..span.end);
            offsets.push(at + pad);
            at += pad + (span.end - span.start) as usize;
        }
        Layout {
            offsets,
            spans: merge_adjacent(spans),
            len: at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(spans: &[(u64, u64, usize)]) -> Vec<PrefetchItem> {
        spans
            .iter()
            .map(|&(a, b, align)| PrefetchItem { span: a..b, align })
            .collect()
    }

    #[test]
    fn contiguous_aligned_items_load_as_one_span() {
        let it = items(&[(16, 32, 4), (32, 48, 4), (48, 50, 2)]);
        let l = Layout::of(&[0, 1, 2], &it);
        assert_eq!(l.spans, vec![16..50]);
        assert_eq!(l.offsets, vec![0, 16, 32]);
        assert_eq!(l.len, 34);
    }

    #[test]
    fn a_misaligned_item_is_padded_with_the_bytes_before_it() {
        // A 3-byte tensor, then an F32 at file offset 19: in the chunk it goes to 4.
        let it = items(&[(16, 19, 1), (19, 27, 4), (27, 35, 8)]);
        let l = Layout::of(&[0, 1, 2], &it);
        assert_eq!(l.offsets, vec![0, 4, 16]);
        assert!(l.offsets.iter().zip(&it).all(|(o, i)| o % i.align == 0));
        // Every item's bytes are where its offset says, in the spans loaded back to back.
        let mut at = 0u64;
        let placed: Vec<(u64, u64)> = l
            .spans
            .iter()
            .map(|s| {
                let p = (at, s.start);
                at += s.end - s.start;
                p
            })
            .collect();
        for (k, &i) in [0usize, 1, 2].iter().enumerate() {
            let file_at = it[i].span.start;
            let (dst, src) = placed
                .iter()
                .rev()
                .find(|(dst, _)| *dst <= l.offsets[k] as u64)
                .copied()
                .expect("a span");
            assert_eq!(src + (l.offsets[k] as u64 - dst), file_at, "item {i}");
        }
        assert_eq!(at as usize, l.len);
    }

    #[test]
    fn chunks_follow_demand_then_the_cursor_and_respect_the_room() {
        let it = items(&[(0, 10, 1), (10, 20, 1), (20, 30, 1), (30, 40, 1)]);
        let opts = PrefetchOptions::default().with_chunk_bytes(20);
        let mut state = State::new(4, &opts);
        state.demand.push_back(2);
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Chunk(vec![2, 3]));
        // Then from the start: the cursor wraps.
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Chunk(vec![0, 1]));
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Done);
        // A bound on what waits untaken shrinks the chunk (to one item at least).
        let opts = PrefetchOptions::default()
            .with_chunk_bytes(40)
            .with_ahead_bytes(Some(15));
        state.status = (0..4).map(|_| Status::Pending).collect();
        (state.cursor, state.untaken) = (0, 0);
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Chunk(vec![0]));
        state.untaken = 10;
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Chunk(vec![1]));
    }

    #[test]
    fn following_ramps_up_in_order_restarts_at_a_jump_and_never_wraps() {
        let it = items(
            &(0..24)
                .map(|i| (i * 10, i * 10 + 10, 1))
                .collect::<Vec<_>>(),
        );
        let opts = PrefetchOptions::default()
            .with_chunk_bytes(100)
            .with_follow_from(Some(10));
        let mut state = State::new(24, &opts);
        state.demand.push_back(0);
        // 10 bytes, then eight times that, then the cap.
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Chunk(vec![0]));
        assert_eq!(
            next_chunk(&mut state, &it, &opts),
            Next::Chunk((1..9).collect())
        );
        assert_eq!(
            next_chunk(&mut state, &it, &opts),
            Next::Chunk((9..19).collect())
        );
        // A jump to item 21 starts small again.
        state.demand.push_back(21);
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Chunk(vec![21]));
        assert_eq!(
            next_chunk(&mut state, &it, &opts),
            Next::Chunk(vec![22, 23])
        );
        // Nothing ahead of the cursor: items 19-20 wait for a caller.
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Idle);
        state.demand.push_back(19);
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Chunk(vec![19]));
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Chunk(vec![20]));
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Done);
    }

    /// A run takes the chunks after its first while they follow in order, stays within
    /// `run_bytes` and, with what waits untaken, within `ahead_bytes`; following, only once
    /// the ramp reached the chunk size; a caller waiting for another item ends it.
    #[test]
    fn runs_take_the_chunks_that_follow_within_their_bounds() {
        let it = items(
            &(0..20)
                .map(|i| (i * 10, i * 10 + 10, 1))
                .collect::<Vec<_>>(),
        );
        let take = |state: &mut State, opts: &PrefetchOptions| match next_chunk(state, &it, opts) {
            Next::Chunk(c) => run_on(state, &it, opts, c),
            other => panic!("{other:?}"),
        };
        // Not following: chunks of 30 bytes, runs of 100: three chunks and the 10 bytes after
        // them fit; the last run is what is left.
        let opts = PrefetchOptions::default()
            .with_chunk_bytes(30)
            .with_run_bytes(100);
        let mut state = State::new(20, &opts);
        // Three chunks: a fourth (30 more) would pass the 100.
        assert_eq!(
            take(&mut state, &opts),
            vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7, 8]]
        );
        assert_eq!(state.cursor, 9);
        // A caller waiting for item 15: the run starts there and goes on to the end.
        state.demand.push_back(15);
        assert_eq!(
            take(&mut state, &opts),
            vec![vec![15, 16, 17], vec![18, 19]]
        );
        // Then from the first item left (the cursor wraps), on to the items loaded already.
        assert_eq!(
            take(&mut state, &opts),
            vec![vec![9, 10, 11], vec![12, 13, 14]]
        );
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Done);
        // With 40 bytes waiting untaken and 100 ahead at most: one more chunk of 30 fits.
        let opts = opts.with_ahead_bytes(Some(100));
        let mut state = State::new(20, &opts);
        state.untaken = 40;
        assert_eq!(take(&mut state, &opts), vec![vec![0, 1, 2], vec![3, 4, 5]]);
        // Following from 10 bytes with a cap of 80 (growth 8): the ramp's 10 alone, then 80
        // at the cap and the chunks after it within the run's 200 (80 + 80 + 30).
        let opts = PrefetchOptions::default()
            .with_chunk_bytes(80)
            .with_follow_from(Some(10))
            .with_run_bytes(200);
        let mut state = State::new(20, &opts);
        state.demand.push_back(0);
        assert_eq!(take(&mut state, &opts), vec![vec![0]]);
        assert_eq!(
            take(&mut state, &opts),
            vec![
                (1..9).collect::<Vec<_>>(),
                (9..17).collect(),
                vec![17, 18, 19]
            ]
        );
        // A jump: the first chunk after it is on the ramp again, alone.
        let mut state = State::new(20, &opts);
        state.demand.push_back(0);
        let _ = take(&mut state, &opts);
        state.demand.push_back(12);
        assert_eq!(take(&mut state, &opts), vec![vec![12]]);
        assert_eq!(take(&mut state, &opts), vec![(13..20).collect::<Vec<_>>()]);
        // Every item once across the runs; what is left waits for a caller.
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Idle);
        // Following, an item at the cursor that was taken on its own (a hole, which
        // `next_chunk` takes for a jump): the run ends before it.
        let mut state = State::new(20, &opts);
        state.demand.push_back(0);
        let _ = take(&mut state, &opts);
        state.status[9] = Status::Taken;
        assert_eq!(take(&mut state, &opts), vec![(1..9).collect::<Vec<_>>()]);
    }

    /// An item larger than the ramp makes its chunk large: the next one grows from that chunk,
    /// not from the ramp (items of 30 bytes followed from 10: 30, then up to 240 under a cap
    /// of 120, not the ramp's 80).
    #[test]
    fn following_grows_the_chunk_an_item_made_large() {
        let it = items(&(0..6).map(|i| (i * 30, i * 30 + 30, 1)).collect::<Vec<_>>());
        let opts = PrefetchOptions::default()
            .with_chunk_bytes(120)
            .with_follow_from(Some(10));
        let mut state = State::new(6, &opts);
        state.demand.push_back(0);
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Chunk(vec![0]));
        assert_eq!(
            next_chunk(&mut state, &it, &opts),
            Next::Chunk(vec![1, 2, 3, 4])
        );
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Chunk(vec![5]));
        assert_eq!(next_chunk(&mut state, &it, &opts), Next::Done);
    }
}
