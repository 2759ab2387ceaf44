//! The one read-exact state machine of every backend: a run of requests over a reader.

use super::{Bounce, Completion, IoBufMut, MAX_RETRIES, ReadOp, Reader};
use std::collections::VecDeque;
use std::io;
use std::time::Instant;

use crate::engine::{RawRead, RawResult};
use crate::error::{Error, Result};
use crate::split::{PartPlan, split};

struct Slot<B> {
    op: ReadOp<B>,
    parts_left: usize,
    error: Option<Error>,
    eof_at: Option<u64>,
}

struct Part {
    slot: usize,
    plan: PartPlan,
    done: usize,
    retries: u32,
    bounce: Option<Bounce>,
}

/// One run of requests over a reader: the read-exact state machine shared by every engine.
pub(super) struct Session<'r, I, B: IoBufMut> {
    reader: &'r mut Reader,
    source: Option<I>,
    slots: Vec<Option<Slot<B>>>,
    free_slots: Vec<usize>,
    parts: Vec<Option<Part>>,
    free_parts: Vec<usize>,
    pending: VecDeque<Part>,
    ready: VecDeque<Completion<B>>,
    raw: Vec<RawResult>,
    started: Option<Instant>,
    broken: bool,
    /// This session's generation (the high half of its tags).
    generation: u32,
    /// An error found before the first request (reads of a leaked session could not be
    /// waited for): reported by the first `next`.
    fatal: Option<Error>,
}

impl<'r, I, B> Session<'r, I, B>
where
    B: IoBufMut,
    I: Iterator<Item = ReadOp<B>>,
{
    pub(super) fn new(reader: &'r mut Reader, source: I) -> Self {
        let fatal = reader.drain_leaked_session().err();
        reader.session_gen = reader.session_gen.wrapping_add(1);
        let generation = reader.session_gen;
        Session {
            generation,
            fatal,
            reader,
            source: Some(source),
            slots: Vec::new(),
            free_slots: Vec::new(),
            parts: Vec::new(),
            free_parts: Vec::new(),
            pending: VecDeque::new(),
            ready: VecDeque::new(),
            raw: Vec::new(),
            started: None,
            broken: false,
        }
    }

    /// Takes the next request from the source and plans its parts; false when none is left.
    fn admit(&mut self) -> bool {
        let Some(mut op) = self.source.as_mut().and_then(Iterator::next) else {
            self.source = None;
            return false;
        };
        let invalid = match self.reader.file(op.file) {
            Err(e) => Some(e),
            Ok(_)
                if op
                    .buf_offset
                    .checked_add(op.len)
                    .is_none_or(|end| end > op.buf.io_len()) =>
            {
                Some(Error::InvalidRequest(format!(
                    "{} bytes at buffer offset {} do not fit a buffer of {} bytes",
                    op.len,
                    op.buf_offset,
                    op.buf.io_len()
                )))
            }
            Ok(_) => None,
        };
        if invalid.is_some() || op.len == 0 {
            self.ready.push_back(Completion {
                user_data: op.user_data,
                file: op.file,
                offset: op.offset,
                result: invalid.map_or(Ok(0), Err),
                buf: op.buf,
            });
            return true;
        }
        let file = self.reader.open_at(op.file.slot);
        let dst = op.buf.io_ptr() as usize + op.buf_offset;
        let plans = split(
            op.offset,
            op.len,
            dst,
            file.direct,
            self.reader.cfg.block_bytes,
        );
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        self.slots[slot] = Some(Slot {
            op,
            parts_left: plans.len(),
            error: None,
            eof_at: None,
        });
        self.pending.extend(plans.into_iter().map(|plan| Part {
            slot,
            plan,
            done: 0,
            retries: 0,
            bounce: None,
        }));
        true
    }

    /// Pushes pending parts (admitting requests as needed) until the engine is full.
    fn fill(&mut self) -> Result<()> {
        // Reads done on this thread (`ReaderBuilder::inline_memory_files`) complete at once: at
        // most a queue's worth of their completions wait to be taken.
        let capacity = self.reader.engine.capacity();
        while self.reader.engine.in_flight() < capacity && self.ready.len() < capacity {
            if self.pending.is_empty() && !self.admit() {
                break;
            }
            let Some(mut part) = self.pending.pop_front() else {
                continue;
            };
            let failed = self.slots[part.slot]
                .as_ref()
                .is_some_and(|s| s.error.is_some());
            if failed {
                self.finish_part(part, None);
                continue;
            }
            if part.plan.dst.is_none() && part.bounce.is_none() {
                match self.reader.take_bounce() {
                    Some(b) => part.bounce = Some(b),
                    None => {
                        self.pending.push_front(part);
                        break; // a bounce buffer frees up when a read completes
                    }
                }
            }
            self.submit(part)?;
        }
        Ok(())
    }

    fn submit(&mut self, mut part: Part) -> Result<()> {
        let file = self
            .reader
            .open_at(self.slots[part.slot].as_ref().map_or(0, |s| s.op.file.slot));
        let buf_index = part.bounce.as_ref().and_then(|b| b.index);
        let base = match (&mut part.bounce, part.plan.dst) {
            (Some(b), _) => b.buf.as_mut_ptr(),
            (None, Some(d)) => d as *mut u8,
            (None, None) => unreachable!("fill gives bounce parts a buffer"),
        };
        let read = RawRead {
            fd: file.fd(),
            fixed: file.fixed,
            offset: part.plan.off + part.done as u64,
            // SAFETY: done < req, and base points to at least req bytes (the request's range
            // in the caller's buffer, or a bounce buffer of block_bytes >= req).
            ptr: unsafe { base.add(part.done) },
            len: u32::try_from(part.plan.req - part.done).unwrap_or(u32::MAX),
            align: file.direct.map_or(1, |(a, _)| a),
            buf_index,
            tag: 0,
        };
        let tag = self.free_parts.pop().unwrap_or_else(|| {
            self.parts.push(None);
            self.parts.len() - 1
        });
        self.parts[tag] = Some(part);
        self.started.get_or_insert_with(Instant::now);
        let tag = u64::from(self.generation) << 32 | tag as u64;
        if file.inline {
            // SAFETY: `read.ptr` holds `read.len` bytes of a request's range (inline files are
            // buffered: no bounce buffer) that this session owns and nothing else touches
            // while the call runs; `pread` writes only there and is done when it returns;
            // `read.fd` is the reader's open file.
            let n = unsafe {
                libc::pread(
                    read.fd,
                    read.ptr.cast(),
                    read.len as usize,
                    read.offset as libc::off_t,
                )
            };
            let result = usize::try_from(n).map_err(|_| io::Error::last_os_error());
            self.process(tag, result);
            return Ok(());
        }
        // SAFETY: the memory belongs to a request (or bounce buffer) this session owns and
        // keeps untouched until the completion of `tag` is processed; the session drains every
        // read before it is dropped (a session leaked with `mem::forget` leaks its owned
        // buffers with it, and the next session waits for its reads first); the file stays
        // open as long as the reader.
        unsafe { self.reader.engine.push(RawRead { tag, ..read }) }.map_err(|source| {
            Error::Backend {
                op: "submit read",
                source,
            }
        })
    }

    fn process(&mut self, tag: u64, result: io::Result<usize>) {
        if (tag >> 32) as u32 != self.generation {
            tracing::error!(tag, "completion of an earlier session's read; ignored");
            return;
        }
        let tag = tag & u64::from(u32::MAX);
        let Some(mut part) = self.parts.get_mut(tag as usize).and_then(Option::take) else {
            tracing::error!(tag, "completion for an unknown read; ignored");
            return;
        };
        self.free_parts.push(tag as usize);
        let Some(file_index) = self.slots[part.slot].as_ref().map(|s| s.op.file.slot) else {
            return;
        };
        let align = self
            .reader
            .open_at(file_index)
            .direct
            .map_or(1, |(a, _)| a as usize);
        match result {
            Ok(n) if n > 0 => {
                part.done += n;
                if part.done >= part.plan.want {
                    self.finish_part(part, None);
                } else if part.done % align != 0 || part.done >= part.plan.req {
                    // O_DIRECT came back short of a block boundary: that is the end of file.
                    let at = part.plan.off + part.done as u64;
                    self.finish_part(part, Some(Failure::Eof(at)));
                } else {
                    self.reader.stats.short_reads += 1;
                    self.pending.push_front(part);
                }
            }
            Ok(_) => {
                let at = part.plan.off + part.done as u64;
                self.finish_part(part, Some(Failure::Eof(at)));
            }
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) && part.retries < MAX_RETRIES =>
            {
                part.retries += 1;
                self.reader.stats.retries += 1;
                self.pending.push_front(part);
            }
            Err(source) => {
                let err = Error::Read {
                    path: self.reader.open_at(file_index).path.clone(),
                    offset: part.plan.off + part.done as u64,
                    source,
                };
                self.finish_part(part, Some(Failure::Error(err)));
            }
        }
    }

    fn finish_part(&mut self, part: Part, failure: Option<Failure>) {
        let Some(slot) = self.slots[part.slot].as_mut() else {
            return;
        };
        if let (None, Some(copy), Some(bounce)) = (&failure, part.plan.copy, &part.bounce)
            && slot.error.is_none()
        {
            // SAFETY: the kernel wrote at least `want` = skip + copy_len bytes of the bounce
            // buffer; user_dst is inside the request's range of the caller's buffer, which
            // this session owns, and does not overlap the bounce buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bounce.buf.as_ptr().add(copy.skip),
                    copy.user_dst as *mut u8,
                    copy.copy_len,
                )
            };
        }
        if let Some(b) = part.bounce {
            self.reader.bounce_free.push(b);
        }
        match failure {
            Some(Failure::Eof(at)) => slot.eof_at = Some(slot.eof_at.map_or(at, |e| e.min(at))),
            Some(Failure::Error(e)) if slot.error.is_none() => slot.error = Some(e),
            _ => {}
        }
        slot.parts_left -= 1;
        if slot.parts_left > 0 {
            return;
        }
        let slot = self.slots[part.slot].take().expect("slot present");
        self.free_slots.push(part.slot);
        let op = slot.op;
        let result = match (slot.error, slot.eof_at) {
            (Some(e), _) => Err(e),
            (None, Some(at)) => Err(Error::UnexpectedEof {
                path: self.reader.open_at(op.file.slot).path.clone(),
                offset: op.offset,
                got: at.saturating_sub(op.offset).min(op.len as u64),
                want: op.len as u64,
            }),
            (None, None) => {
                self.reader.stats.bytes += op.len as u64;
                Ok(op.len)
            }
        };
        self.ready.push_back(Completion {
            user_data: op.user_data,
            file: op.file,
            offset: op.offset,
            buf: op.buf,
            result,
        });
    }
}

enum Failure {
    Eof(u64),
    Error(Error),
}

impl<I, B> Iterator for Session<'_, I, B>
where
    B: IoBufMut,
    I: Iterator<Item = ReadOp<B>>,
{
    type Item = Result<Completion<B>>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(e) = self.fatal.take() {
            self.broken = true;
            return Some(Err(e));
        }
        loop {
            if let Some(done) = self.ready.pop_front() {
                return Some(Ok(done));
            }
            if self.broken {
                return None;
            }
            if let Err(e) = self.fill() {
                self.drain();
                self.broken = true;
                return Some(Err(e));
            }
            if let Some(done) = self.ready.pop_front() {
                return Some(Ok(done));
            }
            if self.reader.engine.in_flight() == 0 {
                if self.pending.is_empty() && self.source.is_none() {
                    self.stop_clock();
                    return None;
                }
                if !self.pending.is_empty() {
                    // fill() could not start a pending read with nothing in flight: no bounce
                    // buffer could be allocated.
                    self.broken = true;
                    return Some(Err(Error::Backend {
                        op: "allocate an O_DIRECT bounce buffer",
                        source: io::Error::from_raw_os_error(libc::ENOMEM),
                    }));
                }
                continue;
            }
            self.raw.clear();
            if let Err(source) = self.reader.engine.wait(1, &mut self.raw) {
                self.drain();
                self.broken = true;
                return Some(Err(Error::Backend {
                    op: "wait for reads",
                    source,
                }));
            }
            let mut raw = std::mem::take(&mut self.raw);
            for (tag, result) in raw.drain(..) {
                self.process(tag, result);
            }
            self.raw = raw;
        }
    }
}

impl<I, B: IoBufMut> Session<'_, I, B> {
    /// Waits for every read in flight, discarding results (drop and error paths).
    fn drain(&mut self) {
        while self.reader.engine.in_flight() > 0 {
            self.raw.clear();
            if let Err(err) = self.reader.engine.wait(1, &mut self.raw) {
                // The kernel may still write into these buffers: never free them. A borrowed
                // buffer cannot be kept from its owner by forgetting it: stop the process
                // rather than let the kernel write into memory that is reused.
                if B::BORROWED {
                    eprintln!(
                        "gpufeed-uring: waiting for reads into a borrowed buffer failed ({err}); aborting"
                    );
                    std::process::abort();
                }
                self.broken = true;
                for slot in self.slots.drain(..).flatten() {
                    std::mem::forget(slot.op.buf);
                }
                for part in self.parts.drain(..).flatten() {
                    std::mem::forget(part.bounce);
                }
                return;
            }
        }
        // Every read is over: bounce buffers of abandoned parts go back to the reader.
        let parts = self
            .parts
            .iter_mut()
            .flatten()
            .chain(self.pending.iter_mut());
        let bounces: Vec<Bounce> = parts.filter_map(|p| p.bounce.take()).collect();
        self.reader.bounce_free.extend(bounces);
    }

    fn stop_clock(&mut self) {
        if let Some(t) = self.started.take() {
            self.reader.stats.seconds += t.elapsed().as_secs_f64();
        }
    }
}

impl<I, B: IoBufMut> Drop for Session<'_, I, B> {
    fn drop(&mut self) {
        // Never let a buffer go while the kernel may still write into it.
        self.drain();
        self.stop_clock();
    }
}
