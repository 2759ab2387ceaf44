//! The engines under a [`crate::Reader`]: each carries out single positional reads and reports
//! one raw result per read. Everything above one attempt (short reads, retries, EOF, O_DIRECT
//! bounce buffers) is the reader's, in one place for every engine.

use std::io;
use std::os::fd::RawFd;

/// One read attempt handed to an engine.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawRead {
    pub fd: RawFd,
    /// Index in the engine's registered-file table, where the file is registered.
    pub fixed: Option<u32>,
    pub offset: u64,
    pub ptr: *mut u8,
    pub len: u32,
    /// Offset/length alignment the file needs (1 for buffered files); engines that fake short
    /// reads keep it.
    pub align: u32,
    /// Index of the registered buffer `ptr` lies in (`IORING_OP_READ_FIXED`), if any.
    pub buf_index: Option<u16>,
    pub tag: u64,
}

// SAFETY: a RawRead is a description of a read; the reader guarantees that the memory it
// names stays valid and untouched until the read's completion comes back, on any thread.
unsafe impl Send for RawRead {}

/// A read's raw outcome: bytes read, or the error of that one attempt.
pub(crate) type RawResult = (u64, io::Result<usize>);

pub(crate) trait Engine: Send {
    /// Reads that may be in flight at once.
    fn capacity(&self) -> usize;

    /// Reads pushed and not yet completed.
    fn in_flight(&self) -> usize;

    /// Queues a read. At most `capacity() - in_flight()` reads may be pushed.
    ///
    /// # Safety
    /// 1. `[ptr, ptr + len)` is valid for writes and used by nobody else until the completion
    ///    carrying `tag` has been returned by `wait`.
    /// 2. `fd` stays open until then.
    unsafe fn push(&mut self, read: RawRead) -> io::Result<()>;

    /// Submits what was pushed and waits until at least `min` completions are available
    /// (`min` <= `in_flight()`), appending every available completion to `out`.
    fn wait(&mut self, min: usize, out: &mut Vec<RawResult>) -> io::Result<()>;

    /// Makes `fd` usable as registered file `index`, where the engine supports it.
    fn register_file(&mut self, _index: u32, _fd: RawFd) -> Option<u32> {
        None
    }

    /// Drops registered file `index` (the engine's reference to the file goes with it).
    fn unregister_file(&mut self, _index: u32) {}

    /// Registers buffers for fixed reads (`RawRead::buf_index` = position in `bufs`); `Ok(false)`
    /// where the engine has no such thing.
    ///
    /// # Safety
    /// 1. Every buffer stays allocated until the engine is dropped.
    unsafe fn register_buffers(&mut self, _bufs: &[(*mut u8, usize)]) -> io::Result<bool> {
        Ok(false)
    }

    /// Starts read-ahead of a range (`POSIX_FADV_WILLNEED`) without waiting for the data.
    fn prefetch(&mut self, fd: RawFd, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: the caller passes an fd it holds open for the duration of the call.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        gpufeed_os::advise::readahead(fd, offset, len).map_err(|e| io::Error::other(e.to_string()))
    }
}
