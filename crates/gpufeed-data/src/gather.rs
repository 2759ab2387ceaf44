//! The worker threads of a [`BatchLoader`]: each gathers a batch's records (out of the mapping,
//! with `O_DIRECT` reads, or file by file), transforms them and issues the upload.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{self};
use std::time::Instant;

use gpufeed_cuda::TransferScheduler;
use gpufeed_cuda::cudarc::driver::CudaEvent;
use gpufeed_pinned::{PinnedPool, PooledBuffer};
use gpufeed_uring::{Direct, Reader};
use parking_lot::{Condvar, Mutex};

use crate::device_batch::{BatchMemory, DeviceBatch};
use crate::error::{Error, Result};
use crate::folder::ImageFolder;
use crate::loader::{
    BatchData, GatherFrom, GpuGather, Scratch, Transform, TransformInto, Transformer,
};
use crate::records::{Dataset, RecordFile, Source};

pub(crate) struct Queue {
    pub(crate) jobs: VecDeque<(usize, Vec<usize>)>,
    pub(crate) stop: bool,
}

pub(crate) struct Shared {
    pub(crate) queue: Mutex<Queue>,
    pub(crate) ready: Condvar,
}

/// A prepared batch: record indices, offsets, the bytes (on the GPU where there is one), the
/// seconds issuing its upload took, and the event that completes when its bytes are on the
/// GPU.
pub(crate) type Gathered = (
    Vec<usize>,
    Vec<usize>,
    BatchData,
    f64,
    Option<gpufeed_cuda::cudarc::driver::CudaEvent>,
);
pub(crate) type Prepared = (usize, Result<Gathered>);

/// What a worker thread prepares batches from.
pub(crate) struct Job<'a> {
    pub(crate) records: &'a Dataset,
    pub(crate) pool: &'a PinnedPool,
    pub(crate) transform: Option<&'a Transformer>,
    /// Where there is a GPU: each worker uploads the batch it gathered, so that the uploads
    /// of several batches overlap each other and the gathering of the next ones.
    pub(crate) sched: Option<&'a TransferScheduler>,
    /// Device memory and events of batches dropped, for the next uploads.
    pub(crate) memory: &'a Arc<BatchMemory>,
    /// With [`BatchLoaderOptions::direct`]: records are read with `O_DIRECT`, counted here, this
    /// many in flight ([`BatchLoaderOptions::direct_depth`]).
    pub(crate) direct: Option<(&'a DirectCounters, usize)>,
    /// Streamed shards' epoch ([`StreamRun::generation`](crate::stream::StreamRun)).
    pub(crate) generation: u64,
    /// With [`BatchLoaderOptions::gpu_gather`](crate::BatchLoaderOptions): the record file's
    /// registered mapping and the kernel that gathers batches out of it.
    pub(crate) gpu_gather: Option<&'a GpuGather>,
}

pub(crate) fn worker(shared: &Shared, tx: &mpsc::Sender<Prepared>, job: &Job<'_>) {
    let Job {
        records,
        pool,
        transform,
        sched,
        memory,
        direct,
        generation,
        gpu_gather,
    } = *job;
    // A folder's files are read with one io_uring reader per worker, kept for the epoch; so
    // are the O_DIRECT reader and its open files.
    let mut reader = None;
    let mut direct_reader = None;
    let mut scratch = Scratch::default();
    loop {
        let (number, indices) = {
            let mut q = shared.queue.lock();
            loop {
                if q.stop {
                    return;
                }
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                shared.ready.wait(&mut q);
            }
        };
        // The GPU gathers the batch where it can (a loader given a transform has dropped its
        // `GpuGather`: `BatchLoader::with_transform`).
        if let (Some(g), Some(sched)) = (gpu_gather, sched)
            && let Some(result) = gather_on_gpu(records, g, sched, memory, &indices)
        {
            let result = result.map(|(offsets, data, upload_s, done)| {
                (indices, offsets, data, upload_s, Some(done))
            });
            if tx.send((number, result)).is_err() {
                return;
            }
            continue;
        }
        let out = Out {
            pool,
            transform,
            scratch: &mut scratch,
            to_device: sched.is_some(),
        };
        let result = match (records, direct) {
            (Dataset::Records(r), Some(d)) => {
                gather_direct(r, &mut direct_reader, d, out, &indices)
            }
            (Dataset::Shards(s), Some(d)) => gather_direct(s, &mut direct_reader, d, out, &indices),
            (Dataset::Records(r), None) => gather(r, out, &indices),
            (Dataset::Shards(s), None) => gather(s, out, &indices),
            (Dataset::Folder(f), _) => gather_files(f, &mut reader, out, &indices),
            (Dataset::Streamed(s), _) => {
                s.with_records(generation, &indices, |src| gather(src, out, &indices))
            }
        }
        .and_then(|(offsets, mut buf)| {
            let Some(sched) = sched else {
                return Ok((indices, offsets, BatchData::Host(buf), 0.0, None));
            };
            // Issued, not waited for: the worker gathers its next batch while the copy runs;
            // the consumer waits for the event before it hands the batch out, and the pool
            // for the copy before it hands `buf` out again. Into the memory of a batch of this
            // length dropped before, with an event used before, where there are.
            let t = Instant::now();
            let reuse = memory.take(buf.len());
            let (d, done) = sched.upload_pooled_reusing(&mut buf, reuse, memory.event())?;
            Ok((
                indices,
                offsets,
                BatchData::Device(DeviceBatch::kept(d, memory)),
                t.elapsed().as_secs_f64(),
                Some(done),
            ))
        });
        if tx.send((number, result)).is_err() {
            return;
        }
    }
}

/// A batch the GPU gathers: its offsets, data, the seconds issuing it took and the event that
/// completes when its bytes are on the GPU.
type OnGpu = (Vec<usize>, BatchData, f64, CudaEvent);

/// Gathers the records `indices` of `records` on the GPU ([`GpuGather`]): for a record file,
/// their addresses in the registered mapping written into a buffer of its address pool, one
/// kernel copying them into the batch's device memory; for a folder, each file's span (its
/// address in the files' registered map, its size, its offset in the batch) likewise. `None`
/// where a record does not exist (the worker's own gather reports it); else the batch's
/// offsets, data, the seconds issuing it took and the event that completes when its bytes are
/// on the GPU.
#[allow(
    unsafe_code,
    reason = "the kernel reads the registered mapping the addresses point into"
)]
fn gather_on_gpu(
    records: &Dataset,
    gpu: &GpuGather,
    sched: &TransferScheduler,
    memory: &Arc<BatchMemory>,
    indices: &[usize],
) -> Option<Result<OnGpu>> {
    let t = Instant::now();
    let issued = match (records, &gpu.of) {
        (Dataset::Records(records), &GatherFrom::Records(rec)) => {
            let runs = indices
                .iter()
                .map(|&i| records.record(i))
                .collect::<Option<Vec<&[u8]>>>()?;
            let count = u32::try_from(runs.len()).ok()?;
            (|| {
                let mut addrs = gpu.addresses.get(8 * runs.len())?;
                addrs.set_len(8 * runs.len());
                for (slot, r) in addrs.chunks_exact_mut(8).zip(&runs) {
                    slot.copy_from_slice(&(r.as_ptr() as u64).to_ne_bytes());
                }
                let reuse = memory.take(rec * runs.len());
                // SAFETY: every address is the start of a record of `rec` bytes (the file's
                // fixed size) of `records`' mapping, which `gpu` registered read-only and
                // keeps registered and mapped (it holds the data set) until the work on the
                // scheduler's streams, where the kernel runs, has ended; the file is not
                // changed while the loader lives (`RecordFile`'s open promise).
                let (d, done) = unsafe {
                    sched.gather_pooled_reusing(
                        &gpu.kernel,
                        &mut addrs,
                        count,
                        rec as u64,
                        reuse,
                        memory.event(),
                    )
                }?;
                Ok::<_, Error>((sized_offsets(rec, runs.len()), d, done))
            })()
        }
        (Dataset::Folder(folder), GatherFrom::Files(files)) => {
            let mut offsets = Vec::with_capacity(indices.len() + 1);
            let mut spans = Vec::with_capacity(indices.len());
            let mut at = 0usize;
            offsets.push(0);
            for &i in indices {
                let len = folder.sample_len(i)?;
                let start = files.offset_of(i)?;
                spans.push(gpufeed_cuda::kernels::Span {
                    src: files.as_ptr() as u64 + start as u64,
                    len: len as u64,
                    offset: at as u64,
                });
                at = at.checked_add(len)?;
                offsets.push(at);
            }
            (|| {
                let mut table = gpu
                    .addresses
                    .get(spans.len() * gpufeed_cuda::kernels::Span::BYTES)?;
                let reuse = memory.take(at);
                // SAFETY: each span is a whole file of the folder's map (its listed size from
                // its page-aligned start; the rest of its last page mapped too), which `gpu`
                // registered read-only and keeps registered and mapped until the work on the
                // scheduler's streams has ended; the files are not changed while the loader
                // lives (`ImageFolder`'s promise).
                let (d, done) = unsafe {
                    sched.gather_spans_pooled_reusing(
                        &gpu.kernel,
                        &mut table,
                        &spans,
                        at,
                        reuse,
                        memory.event(),
                    )
                }?;
                Ok::<_, Error>((offsets, d, done))
            })()
        }
        _ => return None,
    };
    Some(issued.map(|(offsets, d, done)| {
        gpu.gathered
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (
            offsets,
            BatchData::Device(DeviceBatch::kept(d, memory)),
            t.elapsed().as_secs_f64(),
            done,
        )
    }))
}

/// A record's parts as one slice: the part itself, or the parts copied into `scratch` (a tar
/// sample's members, for a transform that takes one slice).
pub(crate) fn contiguous<'a>(parts: &[&'a [u8]], scratch: &'a mut Vec<u8>) -> &'a [u8] {
    match parts {
        [one] => one,
        many => {
            scratch.clear();
            many.iter().for_each(|m| scratch.extend_from_slice(m));
            scratch
        }
    }
}

/// Runs the user's transform on record `i`: its error, or its panic, becomes
/// [`Error::Transform`] (a panic must not kill the worker, which would leave the epoch waiting
/// for a batch that nobody makes).
pub(crate) fn run_transform(f: &Transform, i: usize, r: &[u8], out: &mut Vec<u8>) -> Result<()> {
    caught(i, || f(i, r, out))
}

/// Runs the user's fixed-size transform on record `i` into `out`, as [`run_transform`].
pub(crate) fn run_transform_into(
    f: &TransformInto,
    i: usize,
    r: &[u8],
    out: &mut [u8],
) -> Result<()> {
    caught(i, || f(i, r, out))
}

/// Runs a transform of record `i`: its error, or its panic, becomes [`Error::Transform`].
pub(crate) fn caught(
    i: usize,
    call: impl FnOnce() -> std::result::Result<(), String>,
) -> Result<()> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(message)) => Err(Error::Transform {
            record: i,
            message,
            panicked: false,
        }),
        Err(payload) => Err(Error::Transform {
            record: i,
            message: format!("it panicked: {}", panic_message(&*payload)),
            panicked: true,
        }),
    }
}

/// The text of a panic's payload (`&str` or `String`; anything else unnamed).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Where a worker puts a batch: a buffer of its pool, through the loader's transform, with
/// the worker's scratch buffers.
pub(crate) struct Out<'a> {
    pub(crate) pool: &'a PinnedPool,
    pub(crate) transform: Option<&'a Transformer>,
    pub(crate) scratch: &'a mut Scratch,
    /// The batch is uploaded (read by the GPU's copy engine, not by this CPU): a small one is
    /// written with non-temporal stores ([`Stores::for_batch`]).
    pub(crate) to_device: bool,
}

/// The largest batch (bytes) whose untransformed records are written with non-temporal
/// stores when it is uploaded: one that fits in a core's L2 cache (2 MiB on the GPU
/// machines' Xeons) would otherwise still be there, modified, when the copy engine reads it,
/// and every line read would wait for the core to hand it over. On an H100 machine (GPU run
/// 206, docs/benchmarks.md) shuffled batches of 256 records of 4 KiB went from 27.1-28.1 GB/s
/// to 32.8-35.5 with 16 workers and from 23.3-25.5 to 26.2-28.4 with 8; batches of 16 MiB
/// (64 KiB records) were slower streamed (8 workers 31.6-34.0 against 39.4-43.4): by the
/// time they are uploaded most of their lines have left L2, and the stores cost the CPU more.
const STREAMING_MAX_BYTES: usize = 2 << 20;

/// How a batch's records are written into its pooled buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stores {
    /// Plain copies: the bytes stay in this core's caches (for the CPU that reads them next).
    Cached,
    /// Non-temporal stores (x86_64; plain copies elsewhere), then a store fence
    /// ([`Stores::finish`]) before the upload is issued.
    Streaming,
}

impl Stores {
    /// The stores for a batch of `bytes` going to the GPU (`to_device`) or staying on the host.
    pub(crate) fn for_batch(to_device: bool, bytes: usize) -> Self {
        if to_device && bytes <= STREAMING_MAX_BYTES {
            Stores::Streaming
        } else {
            Stores::Cached
        }
    }

    /// Copies `src` into `dst` (of the same length).
    #[inline]
    pub(crate) fn copy(self, dst: &mut [u8], src: &[u8]) {
        match self {
            Stores::Cached => dst.copy_from_slice(src),
            Stores::Streaming => copy_streaming(dst, src),
        }
    }

    /// Makes the batch's streaming stores visible to the copy engine: called once after its
    /// last copy, before its upload is issued.
    pub(crate) fn finish(self) {
        #[cfg(target_arch = "x86_64")]
        if self == Stores::Streaming {
            store_fence();
        }
    }
}

/// Copies `src` into `dst` (of the same length) with non-temporal 16-byte stores from the
/// first 16-byte aligned byte of `dst` on (plain copies of the unaligned head and the tail):
/// the lines go to memory instead of this core's caches.
#[allow(
    unsafe_code,
    reason = "SSE2's streaming store, on 16 bytes of the destination slice"
)]
fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        let (dst_head, dst) = dst.split_at_mut(head);
        let (src_head, src) = src.split_at(head);
        dst_head.copy_from_slice(src_head);
        let body = dst.len() / 16 * 16;
        let (dst_body, dst_tail) = dst.split_at_mut(body);
        let (src_body, src_tail) = src.split_at(body);
        for (d, s) in dst_body.chunks_exact_mut(16).zip(src_body.chunks_exact(16)) {
            // SAFETY: `d` is 16 bytes of `dst` starting at a 16-byte aligned address (the
            // head above ends at the first one) and `s` 16 readable bytes of `src`
            // (`loadu`: any alignment); SSE2 is part of x86_64's baseline.
            unsafe {
                _mm_stream_si128(
                    d.as_mut_ptr().cast::<__m128i>(),
                    _mm_loadu_si128(s.as_ptr().cast::<__m128i>()),
                );
            }
        }
        dst_tail.copy_from_slice(src_tail);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// `sfence`: the streaming stores before it are globally visible before any store after it
/// (the upload's doorbell).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, reason = "SSE's store fence")]
fn store_fence() {
    // SAFETY: a fence has no operands; SSE is part of x86_64's baseline.
    unsafe { std::arch::x86_64::_mm_sfence() }
}

/// How many records ahead of the one being copied [`gather`] asks for a record's first bytes.
const PREFETCH_AHEAD: usize = 3;

/// Asks the CPU to start loading the first two cache lines of `record`, and so to translate
/// its address, while earlier records are copied. A batch's records lie anywhere in the
/// mapping, each on pages of its own for small records; without the hint each copy first
/// waited for its page's translation and first lines. On the development VM (shuffled 4 KiB
/// records, one core) a bare copy loop went from 4.9-5.1 GB/s to 6.6-7.4 with it (1 to 16
/// lines, 2 to 6 records ahead alike), the loader's host batches from 5.0-5.2 to 6.8-7.0;
/// 64 KiB records copied at 8.5-9.0 either way (docs/benchmarks.md, 2026-12-06).
#[inline]
#[allow(
    unsafe_code,
    reason = "a prefetch is a hint: it reads nothing into the program and never faults"
)]
fn prefetch(record: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in record.chunks(64).take(2) {
        // SAFETY: `_mm_prefetch` only hints the cache (it cannot fault, even on an address
        // that is not mapped), and SSE, its target feature, is part of x86_64's baseline.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    if let Some(&first) = record.first() {
        // A load of the first byte, kept: the translation and the first line start early.
        std::hint::black_box(first);
    }
}

/// Copies (and transforms) the records of one batch out of the file's mapping into a pooled
/// buffer.
pub(crate) fn gather(
    records: &dyn Source,
    out: Out<'_>,
    indices: &[usize],
) -> Result<(Vec<usize>, PooledBuffer)> {
    if out.transform.is_none()
        && let Some(runs) = indices
            .iter()
            .map(|&i| records.record(i))
            .collect::<Option<Vec<&[u8]>>>()
    {
        // Records of one run each, untransformed: copied straight, without a vector of parts
        // per record (for small records the allocations cost a share of the copy).
        let total = runs.iter().map(|r| r.len()).sum::<usize>();
        let mut buf = batch_buffer(out.pool, total, indices.len(), None)?;
        buf.set_len(total);
        let stores = Stores::for_batch(out.to_device, total);
        let mut offsets = Vec::with_capacity(runs.len() + 1);
        offsets.push(0);
        let mut at = 0;
        for (k, r) in runs.iter().enumerate() {
            if let Some(ahead) = runs.get(k + PREFETCH_AHEAD) {
                prefetch(ahead);
            }
            stores.copy(&mut buf[at..at + r.len()], r);
            at += r.len();
            offsets.push(at);
        }
        stores.finish();
        return Ok((offsets, buf));
    }
    let parts = indices
        .iter()
        .map(|&i| {
            records.parts(i).ok_or_else(|| Error::Records {
                path: records.path_of(i).into(),
                reason: format!("record {i} does not exist"),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    assemble(parts, out, indices)
}

/// Copies (and transforms) the records `indices`, whose parts `parts` holds (one entry per
/// index, in order), into a pooled buffer; returns each record's start in it, then the end of
/// the last.
pub(crate) fn assemble(
    parts: Vec<Vec<&[u8]>>,
    out: Out<'_>,
    indices: &[usize],
) -> Result<(Vec<usize>, PooledBuffer)> {
    let Out {
        pool,
        transform,
        scratch,
        to_device,
    } = out;
    let mut offsets = Vec::with_capacity(indices.len() + 1);
    offsets.push(0);
    match transform {
        None => {
            let total = parts.iter().flatten().map(|p| p.len()).sum::<usize>();
            let mut buf = batch_buffer(pool, total, indices.len(), None)?;
            buf.set_len(total);
            let stores = Stores::for_batch(to_device, total);
            let mut at = 0;
            for p in parts {
                for r in p {
                    stores.copy(&mut buf[at..at + r.len()], r);
                    at += r.len();
                }
                offsets.push(at);
            }
            stores.finish();
            Ok((offsets, buf))
        }
        Some(Transformer::Append(f)) => {
            let Scratch { out, joined, .. } = scratch;
            out.clear();
            for (&i, p) in indices.iter().zip(&parts) {
                run_transform(f, i, contiguous(p, joined), out)?;
                offsets.push(out.len());
            }
            let mut buf = batch_buffer(pool, out.len(), indices.len(), None)?;
            buf.set_len(out.len());
            buf.copy_from_slice(out);
            Ok((offsets, buf))
        }
        Some(Transformer::Into { bytes, f }) => {
            let mut buf = sized_buffer(pool, *bytes, indices.len())?;
            let joined = &mut scratch.joined;
            for (k, (&i, p)) in indices.iter().zip(&parts).enumerate() {
                let out = &mut buf[k * bytes..(k + 1) * bytes];
                run_transform_into(f, i, contiguous(p, joined), out)?;
            }
            Ok((sized_offsets(*bytes, indices.len()), buf))
        }
    }
}

/// A pooled buffer of `bytes` for one batch of `records` records; a batch past the pool's
/// largest buffer is [`Error::BatchTooLarge`] (naming its `largest` record where given).
fn batch_buffer(
    pool: &PinnedPool,
    bytes: usize,
    records: usize,
    largest: Option<(String, usize)>,
) -> Result<PooledBuffer> {
    if bytes > gpufeed_pinned::MAX_CLASS {
        return Err(Error::BatchTooLarge {
            bytes,
            records,
            max: gpufeed_pinned::MAX_CLASS,
            largest,
        });
    }
    Ok(pool.get(bytes.max(1))?)
}

/// A pooled buffer for `records` outputs of `bytes` each ([`Transformer::Into`]).
pub(crate) fn sized_buffer(
    pool: &PinnedPool,
    bytes: usize,
    records: usize,
) -> Result<PooledBuffer> {
    let total = bytes.checked_mul(records).ok_or_else(|| {
        Error::invalid(format!(
            "{records} records of {bytes} bytes out of the transform do not fit in memory"
        ))
    })?;
    let mut buf = batch_buffer(pool, total, records, None)?;
    buf.set_len(total);
    Ok(buf)
}

/// The offsets of `records` outputs of `bytes` each, back to back.
pub(crate) fn sized_offsets(bytes: usize, records: usize) -> Vec<usize> {
    (0..=records).map(|k| k * bytes).collect()
}

/// A worker's `O_DIRECT` reader ([`BatchLoaderOptions::direct`]) with the files it opened, by
/// their number in the source, and the aligned buffer its batches' runs are read into (kept
/// from batch to batch: a fresh one would be faulted in and zeroed for every batch).
pub(crate) struct DirectReader {
    pub(crate) reader: Reader,
    pub(crate) open: std::collections::HashMap<usize, gpufeed_uring::FileId>,
    pub(crate) scratch: gpufeed_os::AlignedBuf,
}

/// The `O_DIRECT` reads of a loader's workers, counted.
#[derive(Debug, Default)]
pub(crate) struct DirectCounters {
    pub(crate) reads: std::sync::atomic::AtomicU64,
    pub(crate) bytes: std::sync::atomic::AtomicU64,
}

/// The largest single `O_DIRECT` read of a batch's runs: a longer run is split.
pub(crate) const DIRECT_MAX_READ: usize = 8 << 20;

/// The page size `O_DIRECT` reads are aligned to.
pub(crate) const DIRECT_ALIGN: usize = 4096;

/// Checks that `records` can be read with `O_DIRECT` ([`BatchLoaderOptions::direct`]): record files
/// on file systems that allow it.
pub(crate) fn check_direct(records: &Dataset) -> Result<()> {
    let files: Vec<&RecordFile> = match records {
        Dataset::Records(r) => vec![r],
        Dataset::Shards(s) => s.shards().iter().collect(),
        Dataset::Folder(_) => {
            return Err(Error::invalid(
                "BatchLoaderOptions::direct reads record files; an ImageFolder's files are read whole already (leave direct off)".into(),
            ));
        }
        Dataset::Streamed(_) => {
            return Err(Error::invalid(
                "BatchLoaderOptions::direct reads record files on a local disk; streamed shards are fetched into memory (or a cache directory) as the epoch needs them (leave direct off)".into(),
            ));
        }
    };
    for f in files {
        let (file, _) = gpufeed_os::file::open_regular(f.path(), false)?;
        if !gpufeed_os::align::dio_alignment(&file)?.supported() {
            return Err(Error::from(gpufeed_uring::Error::DirectUnsupported {
                path: f.path().into(),
                reason: "the file system reports no O_DIRECT support (statx DIOALIGN = 0): leave BatchLoaderOptions::direct off".into(),
            }));
        }
    }
    Ok(())
}

/// Reads the records of one batch with `O_DIRECT` ([`BatchLoaderOptions::direct`]): their byte
/// ranges sorted by file and offset, ranges within a page of each other merged into runs,
/// every run read (from the page holding its first byte) into an aligned buffer at once; then copied (and
/// transformed) into a pooled buffer as [`gather`] does.
pub(crate) fn gather_direct(
    records: &dyn Source,
    direct: &mut Option<DirectReader>,
    (counters, depth): (&DirectCounters, usize),
    out: Out<'_>,
    indices: &[usize],
) -> Result<(Vec<usize>, PooledBuffer)> {
    use std::sync::atomic::Ordering::Relaxed;
    let missing = |i: usize| Error::Records {
        path: records.path_of(i).into(),
        reason: format!("record {i} does not exist"),
    };
    // Each record's file and byte ranges, in the batch's order (located once, read below).
    let located = indices
        .iter()
        .map(|&i| records.ranges(i).ok_or_else(|| missing(i)))
        .collect::<Result<Vec<_>>>()?;
    let mut spans: Vec<(usize, usize, usize)> = located
        .iter()
        .flat_map(|(f, ranges)| ranges.iter().map(move |r| (*f, r.start, r.end)))
        .collect();
    spans.sort_unstable();
    // Runs: (file, start, end), records within a page of each other read together.
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for (f, a, b) in spans {
        match runs.last_mut() {
            Some(last) if last.0 == f && a <= last.2 + DIRECT_ALIGN => last.2 = last.2.max(b),
            _ => runs.push((f, a, b)),
        }
    }
    let dr = match direct {
        Some(d) => d,
        None => direct.insert(DirectReader {
            reader: Reader::builder()
                .direct(Direct::On)
                .queue_depth(depth)
                .block_bytes(DIRECT_MAX_READ)
                .build()?,
            open: std::collections::HashMap::new(),
            scratch: gpufeed_os::AlignedBuf::new(DIRECT_ALIGN, DIRECT_ALIGN)?,
        }),
    };
    // (file, offset of the run's first byte read, its place in the scratch buffer, bytes
    // read): from the page holding the run's first byte (read straight into the buffer) to
    // the run's last byte (the reader reads a last partial page through its own buffer).
    let mut placed = Vec::with_capacity(runs.len());
    let mut total = 0;
    for &(f, a, b) in &runs {
        let file = records.file(f).ok_or_else(|| Error::Records {
            path: PathBuf::new(),
            reason: format!("file {f} of the data set does not exist"),
        })?;
        if let std::collections::hash_map::Entry::Vacant(e) = dr.open.entry(f) {
            e.insert(dr.reader.open(file.path())?);
        }
        let start = a / DIRECT_ALIGN * DIRECT_ALIGN;
        placed.push((f, start, total, b - start));
        total += (b - start).next_multiple_of(DIRECT_ALIGN);
    }
    if dr.scratch.len() < total {
        // The old buffer goes first: two batches' worth at once is not needed.
        dr.scratch = gpufeed_os::AlignedBuf::new(DIRECT_ALIGN, DIRECT_ALIGN)?;
        dr.scratch = gpufeed_os::AlignedBuf::new(total, DIRECT_ALIGN)?;
    }
    let mut rest = &mut dr.scratch[..total];
    let mut reads = Vec::with_capacity(placed.len());
    for &(f, start, _, len) in &placed {
        let (this, tail) =
            std::mem::take(&mut rest).split_at_mut(len.next_multiple_of(DIRECT_ALIGN));
        rest = tail;
        if len > 0 {
            reads.push((dr.open[&f], start as u64, &mut this[..len]));
        }
    }
    dr.reader.read_exact_many(reads)?;
    counters.reads.fetch_add(placed.len() as u64, Relaxed);
    counters
        .bytes
        .fetch_add(placed.iter().map(|p| p.3 as u64).sum(), Relaxed);
    let scratch = &dr.scratch[..total];
    let placed = &placed;
    let parts = indices
        .iter()
        .zip(&located)
        .map(|(&i, (f, ranges))| {
            ranges
                .iter()
                .map(|r| {
                    if r.is_empty() {
                        return Ok(&[][..]);
                    }
                    // The run holding it: the last run of file `f` starting at or before it.
                    let k = placed.partition_point(|(pf, ps, ..)| (*pf, *ps) <= (*f, r.start));
                    k.checked_sub(1)
                        .map(|k| placed[k])
                        .filter(|&(pf, ps, _, len)| pf == *f && r.end <= ps + len)
                        .map(|(_, ps, at, _)| &scratch[at + r.start - ps..at + r.end - ps])
                        .ok_or_else(|| missing(i))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    assemble(parts, out, indices)
}

/// Reads (and transforms) the files of one batch into a pooled buffer: straight into it
/// without a transform; with one into the worker's scratch buffer, which the transform reads.
pub(crate) fn gather_files(
    folder: &ImageFolder,
    reader: &mut Option<Reader>,
    out: Out<'_>,
    indices: &[usize],
) -> Result<(Vec<usize>, PooledBuffer)> {
    let Out {
        pool,
        transform,
        scratch,
        to_device: _,
    } = out;
    let reader = match reader {
        Some(r) => r,
        None => reader.insert(
            Reader::builder()
                .direct(Direct::Off)
                .queue_depth(32)
                .async_buffered(false)
                // Each worker has its reader: files in memory (a folder in /dev/shm) are read
                // on the worker's thread rather than handed to the kernel's.
                .inline_memory_files(true)
                .build()?,
        ),
    };
    let size = |i: usize| {
        folder.sample_len(i).ok_or_else(|| Error::Records {
            path: folder.root().into(),
            reason: format!("sample {i} does not exist ({} samples)", folder.len()),
        })
    };
    let mut offsets = Vec::with_capacity(indices.len() + 1);
    offsets.push(0);
    let mut at = 0usize;
    for &i in indices {
        at = at.checked_add(size(i)?).ok_or_else(|| Error::Records {
            path: folder.root().into(),
            reason: "a batch of its files is larger than this machine's memory".into(),
        })?;
        offsets.push(at);
    }
    let largest = || {
        let i = indices
            .iter()
            .copied()
            .max_by_key(|&i| size(i).unwrap_or(0))?;
        let path = folder.files().paths().get(i)?;
        Some((path.display().to_string(), size(i).ok()?))
    };
    let largest = (at > gpufeed_pinned::MAX_CLASS).then(largest).flatten();
    let Some(transform) = transform else {
        let mut buf = batch_buffer(pool, at, indices.len(), largest)?;
        buf.set_len(at);
        folder.read_samples(reader, indices, &mut buf)?;
        return Ok((offsets, buf));
    };
    // Grown to the largest batch, never cleared: every byte used is read over.
    if scratch.files.len() < at {
        scratch.files.resize(at, 0);
    }
    let files = &mut scratch.files[..at];
    folder.read_samples(reader, indices, files)?;
    let file = |k: usize| &files[offsets[k]..offsets[k + 1]];
    match transform {
        Transformer::Append(f) => {
            let out = &mut scratch.out;
            out.clear();
            let mut ends = vec![0];
            for (k, &i) in indices.iter().enumerate() {
                run_transform(f, i, file(k), out)?;
                ends.push(out.len());
            }
            let mut buf = batch_buffer(pool, out.len(), indices.len(), None)?;
            buf.set_len(out.len());
            buf.copy_from_slice(out);
            Ok((ends, buf))
        }
        Transformer::Into { bytes, f } => {
            let mut buf = sized_buffer(pool, *bytes, indices.len())?;
            for (k, &i) in indices.iter().enumerate() {
                run_transform_into(f, i, file(k), &mut buf[k * bytes..(k + 1) * bytes])?;
            }
            Ok((sized_offsets(*bytes, indices.len()), buf))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_copies_equal_plain_ones_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..300u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for dst_at in 0..17 {
            for src_at in 0..17 {
                for len in (0..70).chain([127, 128, 129, 255]) {
                    let mut streamed = vec![0xAAu8; 300];
                    let mut plain = streamed.clone();
                    let from = &src[src_at..src_at + len];
                    Stores::Streaming.copy(&mut streamed[dst_at..dst_at + len], from);
                    Stores::Streaming.finish();
                    Stores::Cached.copy(&mut plain[dst_at..dst_at + len], from);
                    assert_eq!(
                        streamed, plain,
                        "dst at {dst_at}, src at {src_at}, {len} bytes"
                    );
                }
            }
        }
    }

    #[test]
    fn only_small_uploaded_batches_are_streamed() {
        assert_eq!(Stores::for_batch(true, 1 << 20), Stores::Streaming);
        assert_eq!(
            Stores::for_batch(true, STREAMING_MAX_BYTES),
            Stores::Streaming
        );
        assert_eq!(
            Stores::for_batch(true, STREAMING_MAX_BYTES + 1),
            Stores::Cached
        );
        // Host batches are read by the CPU next: kept in its caches.
        assert_eq!(Stores::for_batch(false, 4096), Stores::Cached);
    }
}
