//! [`DeviceBatch`]: a batch's GPU memory, given back to its loader when dropped, so that the
//! next batch of the same length is copied into it instead of new memory.
//!
//! Each batch uploaded into new memory costs, besides its copy, an allocation and a free
//! (stream-ordered), two events cudarc creates and destroys to track the allocation's uses,
//! two stream waits on them at the free, and the event that says the copy ended: about a
//! dozen driver calls, half of them on the consumer's thread, for every batch. For batches of
//! 1 MiB (256 records of 4 KiB) at 15-18 thousand batches a second with the workers half
//! idle, those calls were the lead. Kept memory and kept events leave the copy, its stream's
//! waits for the memory's last cudarc read and write, and two event records: on an H100
//! (docs/benchmarks.md, GPU run 198) such batches went from 16-18 GB/s to 24-28.
//!
//! What is kept is bounded: only while an epoch runs (its end frees it, and batches dropped
//! after it are freed), only buffers of the length the workers asked for last (a batch of
//! another length frees them: a smaller last batch; an image folder's batches, each its own
//! length, keep nothing), at most `prefetch` of them.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use gpufeed_cuda::cudarc::driver::sys::CUdeviceptr;
use gpufeed_cuda::cudarc::driver::{
    CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use gpufeed_load::DeviceBuffer;
use parking_lot::Mutex;

/// A batch's bytes in GPU memory: derefs to the [`DeviceBuffer`] (a `CudaSlice<u8>`) that
/// holds them, and goes wherever one does through cudarc's traits (`Gpu::to_vec(&batch)`,
/// `stream.memcpy_dtoh(&batch, ..)`, a kernel's argument). Dropped while its loader's epoch
/// runs, the memory goes back to the [`BatchLoader`](crate::BatchLoader), which copies a later
/// batch of the same length into it, on one of its streams after the memory's last cudarc read
/// and write (its read and write events), as it would after a free: GPU work of your own that
/// reads the batch outside cudarc's tracking (a kernel launched through another API) must have
/// ended, or been ordered before the loader's next copies, when you drop it, as for any freed
/// memory. The loader keeps at most `prefetch` such buffers, of one length, until the epoch
/// ends; a batch dropped after that is freed. [`DeviceBatch::into_buffer`] keeps the memory
/// for good (freed when that buffer is dropped).
///
/// # Example
/// ```no_run
/// use gpufeed_data::{BatchData, BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler};
/// let gpu = gpufeed_cuda::Gpu::open(0)?;
/// // SAFETY: the file is not changed while it is used.
/// let records = unsafe { RecordFile::open_fixed("records.bin", 4096)? };
/// let sampler = Sampler::new(Order::Shuffled { seed: 7 });
/// let mut loader = BatchLoader::new(records, sampler, BatchLoaderOptions::default(), Some(&gpu))?;
/// for batch in loader.epoch(0)? {
///     let BatchData::Device(bytes) = batch?.data else { unreachable!("a loader with a GPU") };
///     let host = gpu.to_vec(&bytes)?;
///     assert_eq!(host.len(), bytes.len());
/// } // each batch's memory goes back to the loader here
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct DeviceBatch {
    buffer: ManuallyDrop<DeviceBuffer>,
    home: Weak<BatchMemory>,
}

impl DeviceBatch {
    /// `buffer`, given back to `home` when dropped.
    pub(crate) fn kept(buffer: DeviceBuffer, home: &Arc<BatchMemory>) -> Self {
        DeviceBatch {
            buffer: ManuallyDrop::new(buffer),
            home: Arc::downgrade(home),
        }
    }

    /// The memory, no longer given back to the loader: freed when the buffer is dropped.
    #[allow(
        unsafe_code,
        reason = "moves the buffer out of a type with Drop, which never sees it again"
    )]
    pub fn into_buffer(self) -> DeviceBuffer {
        let mut this = ManuallyDrop::new(self);
        drop(std::mem::take(&mut this.home));
        // SAFETY: `this` is never dropped (ManuallyDrop) and its buffer is not used again.
        unsafe { ManuallyDrop::take(&mut this.buffer) }
    }
}

impl From<DeviceBuffer> for DeviceBatch {
    /// Memory of no loader: freed when dropped.
    fn from(buffer: DeviceBuffer) -> Self {
        DeviceBatch {
            buffer: ManuallyDrop::new(buffer),
            home: Weak::new(),
        }
    }
}

impl std::ops::Deref for DeviceBatch {
    type Target = DeviceBuffer;
    fn deref(&self) -> &DeviceBuffer {
        &self.buffer
    }
}

// cudarc's traits, by the buffer's: a batch goes wherever a `CudaSlice<u8>` does
// (`Gpu::to_vec(&batch)`, `stream.clone_dtoh(&batch)`, kernels' arguments). No `DerefMut`:
// the buffer inside cannot be swapped for another (which would then be given back to the
// loader); writes go through `DevicePtrMut`.
impl DeviceSlice<u8> for DeviceBatch {
    fn len(&self) -> usize {
        self.buffer.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.buffer.stream()
    }
}

impl DevicePtr<u8> for DeviceBatch {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        self.buffer.device_ptr(stream)
    }
}

impl DevicePtrMut<u8> for DeviceBatch {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        self.buffer.device_ptr_mut(stream)
    }
}

impl Drop for DeviceBatch {
    #[allow(unsafe_code, reason = "moves the buffer out in Drop, which runs once")]
    fn drop(&mut self) {
        // SAFETY: Drop runs once, and nothing uses `self.buffer` after it.
        let buffer = unsafe { ManuallyDrop::take(&mut self.buffer) };
        match self.home.upgrade() {
            Some(home) => home.give_back(buffer),
            None => drop(buffer),
        }
    }
}

/// A loader's idle batch memory and events, kept for its next uploads while an epoch runs
/// ([`BatchMemory::open`] to [`BatchMemory::close`]): at most `cap` of each, buffers of one
/// length.
#[derive(Debug)]
pub(crate) struct BatchMemory {
    buffers: Shelf<DeviceBuffer>,
    events: Mutex<Vec<CudaEvent>>,
    cap: usize,
    /// Buffers taken again.
    reused: AtomicU64,
}

impl BatchMemory {
    pub(crate) fn new(cap: usize) -> Arc<Self> {
        let cap = cap.max(1);
        Arc::new(BatchMemory {
            buffers: Shelf::new(cap),
            events: Mutex::new(Vec::new()),
            cap,
            reused: AtomicU64::new(0),
        })
    }

    /// An epoch starts: buffers given back are kept from now on.
    pub(crate) fn open(&self) {
        self.buffers.open();
    }

    /// The epoch ended: what is kept is freed, and buffers given back from now on are freed.
    pub(crate) fn close(&self) {
        self.buffers.close();
    }

    /// A kept buffer of exactly `len` bytes, if there is one (see [`Shelf::take`]).
    pub(crate) fn take(&self, len: usize) -> Option<DeviceBuffer> {
        let buffer = self.buffers.take(len);
        if buffer.is_some() {
            self.reused.fetch_add(1, Ordering::Relaxed);
        }
        buffer
    }

    /// Keeps `buffer` for a later batch of its length, or frees it (see [`Shelf::give_back`]).
    pub(crate) fn give_back(&self, buffer: DeviceBuffer) {
        self.buffers.give_back(buffer);
    }

    /// Buffers taken again so far.
    pub(crate) fn reused(&self) -> u64 {
        self.reused.load(Ordering::Relaxed)
    }

    /// A kept event (completed: its batch was handed out), if there is one.
    pub(crate) fn event(&self) -> Option<CudaEvent> {
        self.events.lock().pop()
    }

    /// Keeps `event` (its last record completed) for a later upload.
    pub(crate) fn event_back(&self, event: CudaEvent) {
        let mut events = self.events.lock();
        if events.len() < self.cap {
            events.push(event);
        }
    }
}

/// Something with a length in bytes.
pub(crate) trait ByteLen {
    fn bytes(&self) -> usize;
}

impl ByteLen for DeviceBuffer {
    fn bytes(&self) -> usize {
        self.len()
    }
}

/// Idle buffers of the length asked for last, at most `cap`, kept only while open.
#[derive(Debug)]
pub(crate) struct Shelf<B> {
    state: Mutex<ShelfState<B>>,
    cap: usize,
}

#[derive(Debug)]
struct ShelfState<B> {
    items: Vec<B>,
    /// The length asked for last: the only one kept.
    want: Option<usize>,
    open: bool,
}

impl<B: ByteLen> Shelf<B> {
    pub(crate) fn new(cap: usize) -> Self {
        Shelf {
            state: Mutex::new(ShelfState {
                items: Vec::new(),
                want: None,
                open: false,
            }),
            cap: cap.max(1),
        }
    }

    /// Keeps what is given back from now on.
    pub(crate) fn open(&self) {
        self.state.lock().open = true;
    }

    /// Frees what is kept, and what is given back from now on.
    pub(crate) fn close(&self) {
        let mut state = self.state.lock();
        state.open = false;
        state.want = None;
        let kept = std::mem::take(&mut state.items);
        drop(state);
        drop(kept); // freed outside the lock
    }

    /// A kept buffer of exactly `len` bytes (the one given back last), if there is one; `len`
    /// becomes the length kept. A miss frees what is kept: it is of another length (a smaller
    /// last batch, files of other sizes), no longer asked for.
    pub(crate) fn take(&self, len: usize) -> Option<B> {
        let mut state = self.state.lock();
        state.want = Some(len);
        if let Some(i) = state.items.iter().rposition(|b| b.bytes() == len) {
            return Some(state.items.remove(i));
        }
        let stale = std::mem::take(&mut state.items);
        drop(state);
        drop(stale); // freed outside the lock
        None
    }

    /// Keeps `item` for a later take of its length where the shelf is open, its length is
    /// the one asked for last, and fewer than `cap` are kept; else drops it (as it does an
    /// empty one).
    pub(crate) fn give_back(&self, item: B) {
        let len = item.bytes();
        let mut state = self.state.lock();
        if state.open && len > 0 && state.want == Some(len) && state.items.len() < self.cap {
            state.items.push(item);
        } else {
            drop(state);
            drop(item);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.state.lock().items.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in buffer: its length and a serial number.
    #[derive(Debug, PartialEq)]
    struct Buf(usize, u32);

    impl ByteLen for Buf {
        fn bytes(&self) -> usize {
            self.0
        }
    }

    /// An open shelf that asked for `len` once (as a worker's first take does).
    fn shelf(cap: usize, len: usize) -> Shelf<Buf> {
        let shelf = Shelf::new(cap);
        shelf.open();
        assert_eq!(shelf.take(len), None, "nothing kept yet");
        shelf
    }

    #[test]
    fn the_buffer_of_the_length_given_back_last_is_taken() {
        let shelf = shelf(4, 10);
        shelf.give_back(Buf(10, 1));
        shelf.give_back(Buf(10, 2));
        assert_eq!(shelf.take(10), Some(Buf(10, 2)));
        assert_eq!(shelf.take(10), Some(Buf(10, 1)));
        assert_eq!(shelf.len(), 0);
    }

    #[test]
    fn only_the_length_asked_for_last_is_kept() {
        let shelf = shelf(4, 10);
        shelf.give_back(Buf(10, 1));
        shelf.give_back(Buf(10, 2));
        assert_eq!(shelf.take(7), None, "no buffer of 7 bytes");
        assert_eq!(shelf.len(), 0, "the 10-byte buffers are no longer held");
        shelf.give_back(Buf(10, 3));
        assert_eq!(shelf.len(), 0, "10 bytes are no longer asked for: freed");
        shelf.give_back(Buf(7, 4));
        assert_eq!(shelf.take(7), Some(Buf(7, 4)));
        // Every length different (an image folder's batches, taken by workers in turn, given
        // back by the consumer after): nothing stays.
        for (k, len) in [11, 12, 13, 14].into_iter().enumerate() {
            assert_eq!(shelf.take(len), None);
            if k > 0 {
                shelf.give_back(Buf(len - 1, k as u32));
            }
            assert_eq!(shelf.len(), 0);
        }
    }

    #[test]
    fn at_most_cap_are_kept_and_empty_ones_never() {
        let shelf = shelf(2, 10);
        for k in 0..5 {
            shelf.give_back(Buf(10, k));
        }
        assert_eq!(shelf.len(), 2);
        assert_eq!(shelf.take(10), Some(Buf(10, 1)));
        assert_eq!(shelf.take(10), Some(Buf(10, 0)));
        assert_eq!(shelf.take(10), None);
        assert_eq!(shelf.take(0), None);
        shelf.give_back(Buf(0, 9));
        assert_eq!(shelf.len(), 0);
    }

    #[test]
    fn nothing_is_kept_outside_an_epoch() {
        let shelf = Shelf::new(4);
        shelf.give_back(Buf(10, 1));
        assert_eq!(shelf.len(), 0, "not open yet");
        shelf.open();
        assert_eq!(shelf.take(10), None);
        shelf.give_back(Buf(10, 2));
        assert_eq!(shelf.len(), 1);
        shelf.close();
        assert_eq!(shelf.len(), 0, "the epoch's end frees what is kept");
        shelf.give_back(Buf(10, 3));
        assert_eq!(shelf.len(), 0, "a batch dropped after the epoch is freed");
        shelf.open();
        assert_eq!(
            shelf.take(10),
            None,
            "the length asked for is forgotten at the end"
        );
    }
}
