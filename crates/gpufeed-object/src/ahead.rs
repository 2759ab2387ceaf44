//! Reading ahead: a byte range of an object fetched in order, in blocks of its own, by GETs
//! that stay in flight however the readers take the bytes.
//!
//! [`Object::read_exact_at`] keeps its GETs in flight only for the length of one call: a
//! caller that reads piece by piece (a staging buffer of a few MiB at a time, as the
//! transfer scheduler's fill threads do) waits at every piece for its last GET, and the
//! next piece's GETs start only then. [`Object::read_ahead`] instead fetches the range from
//! a thread of its own, [`ObjectOptions::requests_in_flight`] GETs at once, into blocks of
//! [`ObjectOptions::request_bytes`], and readers copy out of the blocks that have arrived.
//! Host memory is at most [`read_ahead_bytes`] (the window of blocks beyond the lowest one not
//! yet read), whatever the range's length.
//!
//! Measured on the H200 machine (docs/benchmarks.md, GPU run 130): loads to the GPU through it
//! reached 0.69 of the host read against 0.80 with each fill thread's own GETs (run 129), with
//! 316 MiB of host memory against 135, so `gpufeed-load` does not use it; it is here for
//! readers that take a range piece by piece on threads that cannot keep GETs going.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::object::Object;
use crate::options::ObjectOptions;

/// Blocks held at most beyond the lowest one not yet wholly read: the GETs in flight and half
/// as many again arrived ahead of the readers.
fn window_blocks(opts: &ObjectOptions) -> u64 {
    let in_flight = opts.requests_in_flight.max(1) as u64;
    in_flight + in_flight.div_ceil(2)
}

/// The most host memory a read ahead with `opts` holds (its window of blocks of
/// `request_bytes`): 192 MiB with the defaults (16 GETs of 8 MiB in flight, 8 more blocks
/// arrived ahead of the readers).
pub fn read_ahead_bytes(opts: &ObjectOptions) -> u64 {
    window_blocks(opts) * opts.request_bytes as u64
}

/// A range of an object being fetched ahead of its readers ([`Object::read_ahead`]). Shared
/// by any number of threads, each calling [`ReadAhead::read_exact_at`] for its parts; every
/// byte is read once.
pub struct ReadAhead<'a> {
    object: &'a Object,
    range: Range<u64>,
    block: u64,
    blocks: u64,
    window: u64,
    in_flight: usize,
    state: Mutex<State>,
    /// Readers wait here for their blocks.
    arrived: Condvar,
    /// The fetching thread waits here for room in the window, a reader's demand, or stop.
    wake: tokio::sync::Notify,
}

#[derive(Default)]
struct State {
    /// The next block to ask for.
    next: u64,
    /// The lowest block not yet wholly read: blocks below it were read and let go.
    lowest: u64,
    /// One past the highest block a reader waits for (asked for even beyond the window).
    demand: u64,
    /// Blocks asked for and not yet wholly read.
    held: HashMap<u64, Held>,
    /// Buffers of blocks read, for the next blocks.
    spare: Vec<Vec<u8>>,
    failed: Option<Error>,
    stopped: bool,
}

struct Held {
    /// `None` while its GET is in flight.
    bytes: Option<Arc<Vec<u8>>>,
    /// Bytes of it not yet read.
    left: u64,
}

impl Object {
    /// Runs `f` with bytes `range` of the object being read ahead: a thread of its own keeps
    /// [`ObjectOptions::requests_in_flight`] ranged GETs of the pinned version in flight, in
    /// order, into blocks of [`ObjectOptions::request_bytes`] (at most
    /// [`read_ahead_bytes`] of them held), while the threads of `f` copy the bytes out with
    /// [`ReadAhead::read_exact_at`]. When `f` returns the GETs still in flight are dropped.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a range past the end, [`Error::Runtime`] where the fetching
    /// thread cannot start; the GETs' errors reach the readers.
    ///
    /// # Example
    /// ```no_run
    /// let obj = gpufeed_object::Object::open("s3://models/shard-000.bin", &Default::default())?;
    /// let mut out = vec![0u8; obj.len() as usize];
    /// obj.read_ahead(0..obj.len(), |ahead| {
    ///     // Piece by piece, as a loader's staging buffers fill: the GETs keep going between.
    ///     for (i, piece) in out.chunks_mut(4 << 20).enumerate() {
    ///         ahead.read_exact_at((i as u64) << 22, piece)?;
    ///     }
    ///     Ok::<(), gpufeed_object::Error>(())
    /// })??;
    /// # Ok::<(), gpufeed_object::Error>(())
    /// ```
    pub fn read_ahead<T>(
        &self,
        range: Range<u64>,
        f: impl FnOnce(&ReadAhead<'_>) -> T,
    ) -> Result<T> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::OutOfRange {
                url: self.url().to_string(),
                start: range.start,
                end: range.end,
                len: self.len(),
            });
        }
        let opts = self.options();
        let block = opts.request_bytes.max(1) as u64;
        let ahead = ReadAhead {
            object: self,
            blocks: (range.end - range.start).div_ceil(block),
            range,
            block,
            window: window_blocks(opts),
            in_flight: opts.requests_in_flight.max(1),
            state: Mutex::new(State::default()),
            arrived: Condvar::new(),
            wake: tokio::sync::Notify::new(),
        };
        std::thread::scope(|scope| {
            let fetcher = std::thread::Builder::new()
                .name("gpufeed-object-ahead".into())
                .spawn_scoped(scope, || ahead.fetch())
                .map_err(|e| Error::Runtime(e.to_string()))?;
            let out = f(&ahead);
            ahead.stop();
            // Its errors went to the readers (or, where f read nothing, matter to no one).
            let _ = fetcher.join();
            Ok(out)
        })
    }
}

impl ReadAhead<'_> {
    /// The range being read ahead.
    pub fn range(&self) -> Range<u64> {
        self.range.clone()
    }

    /// Copies the object's bytes from `offset` (an offset in the object, within
    /// [`ReadAhead::range`]) into `dst`, waiting for the blocks that have not arrived.
    ///
    /// # Errors
    /// The failed GET's error (every reader gets it), [`Error::OutOfRange`] outside the
    /// range, and [`Error::InvalidSetting`] for bytes read before (each is read once: its
    /// block is let go once wholly read).
    pub fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(dst.len() as u64);
        if offset < self.range.start || end.is_none_or(|e| e > self.range.end) {
            return Err(Error::OutOfRange {
                url: self.object.url().to_string(),
                start: offset,
                end: end.unwrap_or(u64::MAX),
                len: self.range.end,
            });
        }
        let mut done = 0usize;
        while done < dst.len() {
            let at = offset + done as u64 - self.range.start;
            let (i, within) = (at / self.block, at % self.block);
            let n = ((self.block_len(i) - within) as usize).min(dst.len() - done);
            let bytes = self.wait_for(i)?;
            dst[done..done + n].copy_from_slice(&bytes[within as usize..within as usize + n]);
            drop(bytes);
            self.consumed(i, n as u64);
            done += n;
        }
        Ok(())
    }

    /// Bytes in block `i`.
    fn block_len(&self, i: u64) -> u64 {
        let len = self.range.end - self.range.start;
        (len - i * self.block).min(self.block)
    }

    /// Block `i`'s bytes, once they arrived.
    fn wait_for(&self, i: u64) -> Result<Arc<Vec<u8>>> {
        let mut st = self.state.lock();
        loop {
            if let Some(e) = &st.failed {
                return Err(e.shared_copy());
            }
            if st.stopped {
                return Err(Error::Runtime("the read ahead was stopped".into()));
            }
            match st.held.get(&i) {
                Some(Held {
                    bytes: Some(bytes), ..
                }) => return Ok(Arc::clone(bytes)),
                Some(_) => {}
                None if i < st.next => {
                    return Err(Error::InvalidSetting(format!(
                        "{}: bytes {}..{} of the read ahead were read before (each byte is \
                         read once)",
                        self.object.url(),
                        self.range.start + i * self.block,
                        self.range.start + i * self.block + self.block_len(i)
                    )));
                }
                None => {
                    if st.demand <= i {
                        st.demand = i + 1;
                        self.wake.notify_one();
                    }
                }
            }
            self.arrived.wait(&mut st);
        }
    }

    /// `n` bytes of block `i` were read: a block wholly read is let go (its buffer kept for
    /// a later block) and the window moves on.
    fn consumed(&self, i: u64, n: u64) {
        let mut st = self.state.lock();
        let Some(held) = st.held.get_mut(&i) else {
            return;
        };
        held.left = held.left.saturating_sub(n);
        if held.left > 0 {
            return;
        }
        if let Some(Ok(buf)) = st
            .held
            .remove(&i)
            .and_then(|h| h.bytes)
            .map(Arc::try_unwrap)
        {
            st.spare.push(buf);
        }
        while st.lowest < st.next && !st.held.contains_key(&st.lowest) {
            st.lowest += 1;
        }
        drop(st);
        self.wake.notify_one();
    }

    /// Stops the fetching thread and wakes every reader.
    fn stop(&self) {
        self.state.lock().stopped = true;
        self.arrived.notify_all();
        self.wake.notify_one();
    }

    /// The fetching thread: GETs in order, `in_flight` at once, within the window (or up to
    /// what a reader waits for), until every block arrived, one failed, or `stop`.
    fn fetch(&self) {
        let ran = crate::object::block_on(|| async {
            let mut pending = FuturesUnordered::new();
            loop {
                {
                    let mut st = self.state.lock();
                    if st.stopped || st.failed.is_some() {
                        return;
                    }
                    while pending.len() < self.in_flight
                        && st.next < self.blocks
                        && (st.next < st.lowest + self.window || st.next < st.demand)
                    {
                        let i = st.next;
                        st.next += 1;
                        let len = self.block_len(i);
                        let mut buf = st.spare.pop().unwrap_or_default();
                        buf.resize(len as usize, 0);
                        st.held.insert(
                            i,
                            Held {
                                bytes: None,
                                left: len,
                            },
                        );
                        let at = self.range.start + i * self.block;
                        pending.push(async move {
                            let got = self.object.get_into(at, &mut buf).await;
                            (i, buf, got)
                        });
                    }
                    if pending.is_empty() && st.next >= self.blocks {
                        return;
                    }
                }
                if pending.is_empty() {
                    // The window is full and no reader waits beyond it: wait for one.
                    self.wake.notified().await;
                    continue;
                }
                let woken = std::pin::pin!(self.wake.notified());
                match futures_util::future::select(pending.next(), woken).await {
                    futures_util::future::Either::Left((Some((i, buf, got)), _)) => {
                        let mut st = self.state.lock();
                        match got {
                            Ok(()) => {
                                if let Some(held) = st.held.get_mut(&i) {
                                    held.bytes = Some(Arc::new(buf));
                                }
                            }
                            Err(e) => st.failed = Some(e),
                        }
                        drop(st);
                        self.arrived.notify_all();
                    }
                    futures_util::future::Either::Left((None, _))
                    | futures_util::future::Either::Right(_) => {}
                }
            }
        });
        if let Err(e) = ran {
            self.state.lock().failed = Some(e);
            self.arrived.notify_all();
        }
    }
}
