//! What a read request carries: buffers the kernel writes into ([`IoBufMut`]), requests
//! ([`ReadOp`]) and their completions.

use super::FileId;

use gpufeed_os::AlignedBuf;

use crate::error::Result;

/// A buffer the kernel can read into while the caller waits: its memory must not move when
/// the value moves (heap buffers).
///
/// # Safety
/// Implementors guarantee that `io_ptr` returns the same address, valid for `io_len` bytes,
/// for as long as the value lives, however it is moved.
pub unsafe trait IoBufMut: Send + 'static {
    /// Whether the memory belongs to someone else (who gets it back when the value is
    /// dropped or forgotten); only the reader's own internal buffer type sets it.
    #[doc(hidden)]
    const BORROWED: bool = false;
    /// The first byte.
    fn io_ptr(&mut self) -> *mut u8;
    /// The number of bytes.
    fn io_len(&self) -> usize;
}

// SAFETY: a Vec's heap buffer does not move when the Vec does; its length is its bytes.
unsafe impl IoBufMut for Vec<u8> {
    fn io_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as for Vec.
unsafe impl IoBufMut for Box<[u8]> {
    fn io_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: an AlignedBuf owns a heap or mmap allocation that never moves.
unsafe impl IoBufMut for AlignedBuf {
    fn io_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

/// A borrowed buffer, only used by [`Reader::read_exact_at`], which waits for every read into
/// it before returning (also when unwinding).
pub(super) struct Borrowed {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

// SAFETY: see the type's docs; the pointer is only handed to the engine.
unsafe impl Send for Borrowed {}
// SAFETY: read_exact_at keeps the borrowed slice alive and unused until every read completed.
unsafe impl IoBufMut for Borrowed {
    const BORROWED: bool = true;
    fn io_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    fn io_len(&self) -> usize {
        self.len
    }
}

/// A request: read `len` bytes of `file` at `offset` into `buf[buf_offset..]`.
#[derive(Debug)]
pub struct ReadOp<B> {
    pub(super) file: FileId,
    pub(super) offset: u64,
    pub(super) len: usize,
    pub(super) buf: B,
    pub(super) buf_offset: usize,
    pub(super) user_data: u64,
}

impl<B: IoBufMut> ReadOp<B> {
    /// Fills all of `buf` from `file` starting at `offset`.
    pub fn new(file: FileId, offset: u64, buf: B) -> Self {
        let len = buf.io_len();
        ReadOp {
            file,
            offset,
            len,
            buf,
            buf_offset: 0,
            user_data: 0,
        }
    }

    /// Reads `len` bytes instead of the whole buffer.
    pub fn len(mut self, len: usize) -> Self {
        self.len = len;
        self
    }

    /// Writes into the buffer starting at `buf_offset`.
    pub fn at(mut self, buf_offset: usize) -> Self {
        self.buf_offset = buf_offset;
        self
    }

    /// A number returned with the completion.
    pub fn user_data(mut self, user_data: u64) -> Self {
        self.user_data = user_data;
        self
    }
}

/// A finished request: the buffer comes back with the outcome.
#[derive(Debug)]
pub struct Completion<B> {
    /// The request's `user_data`.
    pub user_data: u64,
    /// The file read.
    pub file: FileId,
    /// The offset read.
    pub offset: u64,
    /// The buffer, filled on success.
    pub buf: B,
    /// Bytes read (always the requested length), or why the request failed.
    pub result: Result<usize>,
}
