//! [`DeviceBatch`]: a batch's GPU memory, given back to its loader when dropped, so that the
//! next batch of the same length is copied into it instead of new memory.
//!
//! Each batch uploaded into new memory costs, besides its copy, an allocation and a free
//! (stream-ordered), two events cudarc creates and destroys to track the allocation's uses,
//! two stream waits on them at the free, and the event that says the copy ended: about a
//! dozen driver calls, half of them on the consumer's thread, for every batch. For batches of
//! 1 MiB (256 records of 4 KiB) at 15-18 thousand batches a second with the workers half
//! idle, those calls were the lead (read from the code, not measured; docs/architecture.md,
//! the batch loader). Kept memory and kept events leave the copy, its stream's waits for the
//! memory's earlier cudarc uses, and two event records.

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
/// holds them. Dropped, the memory goes back to the [`BatchLoader`](crate::BatchLoader) that
/// made it (while that loader lives), which copies a later batch of the same length into it,
/// on one of its streams after the memory's earlier cudarc uses (their read and write events):
/// GPU work of your own that reads the batch outside cudarc's tracking (a kernel launched
/// through another API, on another stream) must have ended, or been ordered before the
/// loader's next copies, when you drop it, as for any freed memory. The loader keeps at most
/// `2 x max(prefetch, workers)` such buffers, of one length at a time (a batch of another
/// length frees them), until it is dropped. [`DeviceBatch::into_buffer`] keeps the memory for
/// good (freed when that buffer is dropped).
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

impl std::ops::DerefMut for DeviceBatch {
    fn deref_mut(&mut self) -> &mut DeviceBuffer {
        &mut self.buffer
    }
}

// cudarc's traits, by the buffer's: a batch goes wherever a `CudaSlice<u8>` does
// (`Gpu::to_vec(&batch)`, `stream.clone_dtoh(&batch)`, kernels' arguments).
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

/// A loader's idle batch memory and events, kept for its next uploads: at most `cap` of each
/// (the batches in flight and a few held), buffers of one length at a time.
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

    /// A kept buffer of exactly `len` bytes, if there is one (see [`Shelf::take`]).
    pub(crate) fn take(&self, len: usize) -> Option<DeviceBuffer> {
        let buffer = self.buffers.take(len);
        if buffer.is_some() {
            self.reused.fetch_add(1, Ordering::Relaxed);
        }
        buffer
    }

    /// Buffers taken again so far.
    pub(crate) fn reused(&self) -> u64 {
        self.reused.load(Ordering::Relaxed)
    }

    /// Keeps `buffer` for a later batch of its length, or frees it where `cap` are kept.
    pub(crate) fn give_back(&self, buffer: DeviceBuffer) {
        self.buffers.give_back(buffer);
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

/// Idle buffers of one length at a time, at most `cap`.
#[derive(Debug)]
pub(crate) struct Shelf<B> {
    items: Mutex<Vec<B>>,
    cap: usize,
}

impl<B: ByteLen> Shelf<B> {
    pub(crate) fn new(cap: usize) -> Self {
        Shelf {
            items: Mutex::new(Vec::new()),
            cap: cap.max(1),
        }
    }

    /// A kept buffer of exactly `len` bytes (the one given back last), if there is one. A
    /// miss frees the buffers of other lengths: the batches' length changed (a smaller last
    /// batch, files of other sizes), and memory kept for a length no longer asked for would
    /// only be held.
    pub(crate) fn take(&self, len: usize) -> Option<B> {
        let mut items = self.items.lock();
        if let Some(i) = items.iter().rposition(|b| b.bytes() == len) {
            return Some(items.remove(i));
        }
        let stale = std::mem::take(&mut *items);
        drop(items);
        drop(stale); // freed outside the lock
        None
    }

    /// Keeps `item` for a later take of its length, or drops it where `cap` are kept (or it
    /// is empty).
    pub(crate) fn give_back(&self, item: B) {
        if item.bytes() == 0 {
            return;
        }
        let mut items = self.items.lock();
        if items.len() < self.cap {
            items.push(item);
        } else {
            drop(items);
            drop(item);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.items.lock().len()
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

    #[test]
    fn the_buffer_of_the_length_given_back_last_is_taken() {
        let shelf = Shelf::new(4);
        shelf.give_back(Buf(10, 1));
        shelf.give_back(Buf(10, 2));
        assert_eq!(shelf.take(10), Some(Buf(10, 2)));
        assert_eq!(shelf.take(10), Some(Buf(10, 1)));
        assert_eq!(shelf.len(), 0);
    }

    #[test]
    fn a_miss_frees_the_buffers_of_other_lengths() {
        let shelf = Shelf::new(4);
        shelf.give_back(Buf(10, 1));
        shelf.give_back(Buf(10, 2));
        assert_eq!(shelf.take(7), None, "no buffer of 7 bytes");
        assert_eq!(shelf.len(), 0, "the 10-byte buffers are no longer held");
        shelf.give_back(Buf(7, 3));
        shelf.give_back(Buf(10, 4));
        assert_eq!(shelf.take(7), Some(Buf(7, 3)), "a hit keeps the others");
        assert_eq!(shelf.len(), 1);
    }

    #[test]
    fn at_most_cap_are_kept_and_empty_ones_never() {
        let shelf = Shelf::new(2);
        for k in 0..5 {
            shelf.give_back(Buf(10, k));
        }
        shelf.give_back(Buf(0, 9));
        assert_eq!(shelf.len(), 2);
        assert_eq!(shelf.take(10), Some(Buf(10, 1)));
        assert_eq!(shelf.take(10), Some(Buf(10, 0)));
        assert_eq!(shelf.take(10), None);
    }
}
