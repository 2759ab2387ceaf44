//! The io_uring engine.
//!
//! The ring has `capacity` submission entries and twice as many completion entries, and the
//! reader never has more than `capacity` reads in flight, so the completion queue cannot
//! overflow. Buffered reads are flagged `IOSQE_ASYNC` (when asked) so that copies out of the
//! page cache run on several io-wq workers instead of inline in the submitting thread.

use std::io;
use std::os::fd::RawFd;

use io_uring::{IoUring, opcode, squeue, types};

use crate::engine::{Engine, RawRead, RawResult};

pub(crate) struct UringEngine {
    ring: IoUring,
    capacity: usize,
    in_flight: usize,
    pending: usize,
    files_registered: bool,
    async_buffered: bool,
}

/// Registered-file slots reserved at setup.
const FILE_SLOTS: u32 = 256;

impl UringEngine {
    pub(crate) fn new(capacity: usize, async_buffered: bool) -> io::Result<Self> {
        let entries = (capacity.max(1) as u32).next_power_of_two();
        let ring = IoUring::builder()
            .setup_cqsize(entries * 2)
            .build(entries)?;
        let files_registered = ring.submitter().register_files_sparse(FILE_SLOTS).is_ok();
        Ok(UringEngine {
            ring,
            capacity: entries as usize,
            in_flight: 0,
            pending: 0,
            files_registered,
            async_buffered,
        })
    }

    fn push_entry(&mut self, entry: squeue::Entry) -> io::Result<()> {
        // SAFETY: the caller of `Engine::push` keeps the entry's buffer and fd valid until its
        // completion is reaped (the entry itself is copied into the ring here).
        let pushed = unsafe { self.ring.submission().push(&entry) };
        if pushed.is_err() {
            // The queue is full of unsubmitted entries: hand them to the kernel and retry.
            self.ring.submit()?;
            self.pending = 0;
            // SAFETY: as above.
            unsafe { self.ring.submission().push(&entry) }
                .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        self.pending += 1;
        Ok(())
    }
}

impl Engine for UringEngine {
    fn capacity(&self) -> usize {
        self.capacity
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    unsafe fn push(&mut self, read: RawRead) -> io::Result<()> {
        let entry = match (read.fixed, read.buf_index) {
            (Some(i), Some(b)) => opcode::ReadFixed::new(types::Fixed(i), read.ptr, read.len, b)
                .offset(read.offset)
                .build(),
            (None, Some(b)) => opcode::ReadFixed::new(types::Fd(read.fd), read.ptr, read.len, b)
                .offset(read.offset)
                .build(),
            (Some(i), None) => opcode::Read::new(types::Fixed(i), read.ptr, read.len)
                .offset(read.offset)
                .build(),
            (None, None) => opcode::Read::new(types::Fd(read.fd), read.ptr, read.len)
                .offset(read.offset)
                .build(),
        }
        .user_data(read.tag);
        let entry = if self.async_buffered && read.align == 1 {
            entry.flags(squeue::Flags::ASYNC)
        } else {
            entry
        };
        self.push_entry(entry)?;
        self.in_flight += 1;
        Ok(())
    }

    fn wait(&mut self, min: usize, out: &mut Vec<RawResult>) -> io::Result<()> {
        let mut got = 0;
        loop {
            let want = min.saturating_sub(got);
            if self.pending > 0 || want > 0 {
                match self.ring.submit_and_wait(want) {
                    Ok(_) => self.pending = 0,
                    Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && got > 0 => {}
                    Err(e) => return Err(e),
                }
            }
            for cqe in self.ring.completion() {
                let res = cqe.result();
                let result = if res < 0 {
                    Err(io::Error::from_raw_os_error(-res))
                } else {
                    Ok(res as usize)
                };
                out.push((cqe.user_data(), result));
                got += 1;
            }
            if got >= min {
                break;
            }
        }
        self.in_flight -= got;
        Ok(())
    }

    unsafe fn register_buffers(&mut self, bufs: &[(*mut u8, usize)]) -> io::Result<bool> {
        let iovecs: Vec<libc::iovec> = bufs
            .iter()
            .map(|&(ptr, len)| libc::iovec {
                iov_base: ptr.cast(),
                iov_len: len,
            })
            .collect();
        // SAFETY: the caller keeps every buffer allocated until the ring is dropped.
        unsafe { self.ring.submitter().register_buffers(&iovecs) }?;
        Ok(true)
    }

    fn register_file(&mut self, index: u32, fd: RawFd) -> Option<u32> {
        if !self.files_registered || index >= FILE_SLOTS {
            return None;
        }
        self.ring
            .submitter()
            .register_files_update(index, &[fd])
            .ok()
            .map(|_| index)
    }

    fn unregister_file(&mut self, index: u32) {
        // -1 empties the slot; a failure leaves the ring's reference until the slot is reused.
        if let Err(e) = self.ring.submitter().register_files_update(index, &[-1]) {
            tracing::debug!(index, "unregistering a file failed: {e}");
        }
    }

    fn prefetch(&mut self, fd: RawFd, offset: u64, len: u64) -> io::Result<()> {
        // Through the ring, as everything else; the reader calls this with nothing in flight.
        let entry =
            opcode::Fadvise::new(types::Fd(fd), len as libc::off_t, libc::POSIX_FADV_WILLNEED)
                .offset(offset)
                .build()
                .user_data(u64::MAX);
        self.push_entry(entry)?;
        self.ring.submit_and_wait(1)?;
        self.pending = 0;
        let res = self
            .ring
            .completion()
            .next()
            .map(|c| c.result())
            .unwrap_or(-libc::EIO);
        if res < 0 {
            return Err(io::Error::from_raw_os_error(-res));
        }
        Ok(())
    }
}
