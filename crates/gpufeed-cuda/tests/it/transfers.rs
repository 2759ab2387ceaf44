//! Byte-exact round trips on a GPU from every source kind, at unaligned sizes, over 1-4
//! streams and chunks from 64 KiB to 256 MiB; staging buffers never reused in flight.

use gpufeed_cuda::{
    FillSource, Gpu, HostDest, HostSource, SourceError, TransferOptions, TransferScheduler,
};
use gpufeed_os::{FileMap, MapMode};
use gpufeed_pinned::{HostRegistration, PinnedBuffer};
use xxhash_rust::xxh3::xxh3_64;

use crate::{gpu_or_skip, measuring_device_memory, random_bytes};

fn config(streams: usize, chunk: usize) -> TransferOptions {
    TransferOptions::default()
        .with_streams(streams)
        .with_chunk_bytes(chunk)
        .with_staging_buffers(4)
        .with_fill_threads(3)
}

/// Downloads `dev` both ways (pinned and pageable) and checks both against `want`.
fn check_on_device(
    gpu: &Gpu,
    sched: &TransferScheduler,
    dev: &cudarc_slice::Slice,
    want: &[u8],
    what: &str,
) {
    let mut back = vec![0u8; want.len()];
    sched
        .download(dev, HostDest::Pageable(&mut back))
        .expect("download pageable");
    assert_eq!(
        xxh3_64(&back),
        xxh3_64(want),
        "{what}: pageable download differs"
    );
    let mut pinned = PinnedBuffer::new(gpu.context(), want.len()).expect("pinned");
    sched
        .download(dev, HostDest::Pinned(&mut pinned))
        .expect("download pinned");
    assert_eq!(
        xxh3_64(&pinned),
        xxh3_64(want),
        "{what}: pinned download differs"
    );
    // And independently of the scheduler, through cudarc.
    assert_eq!(
        xxh3_64(&gpu.to_vec(dev).expect("cudarc copy")),
        xxh3_64(want),
        "{what}: cudarc sees other bytes"
    );
}

mod cudarc_slice {
    pub type Slice = gpufeed_cuda::cudarc::driver::CudaSlice<u8>;
}

#[test]
fn round_trips_from_every_source_kind() {
    let Some(gpu) = gpu_or_skip("round_trips_from_every_source_kind") else {
        return;
    };
    let cases = [
        (1, 64 << 10, 1_000_003usize),
        (2, 1 << 20, 37 * 1024 * 1024 + 5),
        (3, 16 << 20, 50 * 1024 * 1024 + 4097),
        (4, 256 << 20, 300 * 1024 * 1024 + 1),
    ];
    for (i, &(streams, chunk, len)) in cases.iter().enumerate() {
        let sched = TransferScheduler::new(&gpu, config(streams, chunk)).expect("scheduler");
        let data = random_bytes(len, 100 + i as u64);
        let what = format!("{streams} streams, {chunk} B chunks, {len} B");

        // Pageable, through staging; at an unaligned device offset.
        let mut dev = gpu.alloc_zeroed(len + 3).expect("alloc");
        let stats = sched
            .upload(HostSource::Pageable(&data), &mut dev, 3)
            .expect("upload pageable");
        assert_eq!((stats.path, stats.bytes), ("staged", len as u64));
        let all = gpu.to_vec(&dev).expect("copy back");
        assert_eq!(&all[..3], &[0, 0, 0], "{what}: wrote before the offset");
        assert_eq!(
            xxh3_64(&all[3..]),
            xxh3_64(&data),
            "{what}: pageable upload differs"
        );

        // Pinned, direct.
        let mut pinned = PinnedBuffer::new(gpu.context(), len).expect("pinned");
        pinned.copy_from_slice(&data);
        let mut dev = gpu.alloc_zeroed(len).expect("alloc");
        assert_eq!(
            sched
                .upload(HostSource::Pinned(&pinned), &mut dev, 0)
                .expect("upload")
                .path,
            "pinned"
        );
        check_on_device(&gpu, &sched, &dev, &data, &what);

        // A registered read-only file mapping, direct.
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("data.bin");
        std::fs::write(&path, &data).expect("write");
        // SAFETY: the file is private to this test and not truncated while mapped.
        let map = unsafe { FileMap::open(&path, MapMode::ReadOnly) }.expect("map");
        let reg = HostRegistration::file_map(gpu.context(), &map).expect("register");
        let mut dev = gpu.alloc_zeroed(len).expect("alloc");
        assert_eq!(
            sched
                .upload(HostSource::Registered(&reg), &mut dev, 0)
                .expect("upload")
                .path,
            "registered"
        );
        check_on_device(&gpu, &sched, &dev, &data, &what);

        // A fill source producing the bytes on the fill threads.
        struct Pattern(Vec<u8>);
        impl FillSource for Pattern {
            fn fill(&self, offset: u64, dst: &mut [u8]) -> Result<(), SourceError> {
                let o = offset as usize;
                dst.copy_from_slice(&self.0[o..o + dst.len()]);
                Ok(())
            }
        }
        let source = Pattern(data);
        let mut dev = gpu.alloc_zeroed(len).expect("alloc");
        sched
            .upload(
                HostSource::Fill {
                    source: &source,
                    len: len as u64,
                },
                &mut dev,
                0,
            )
            .expect("upload fill");
        check_on_device(&gpu, &sched, &dev, &source.0, &what);
    }
}

#[test]
fn a_failing_source_is_an_error_and_the_scheduler_still_works() {
    let Some(gpu) = gpu_or_skip("a_failing_source_is_an_error_and_the_scheduler_still_works")
    else {
        return;
    };
    struct Failing;
    impl FillSource for Failing {
        fn fill(&self, offset: u64, dst: &mut [u8]) -> Result<(), SourceError> {
            if offset >= 8 << 20 {
                return Err("disk on fire".into());
            }
            dst.fill(1);
            Ok(())
        }
    }
    let sched = TransferScheduler::new(&gpu, config(2, 1 << 20)).expect("scheduler");
    let mut dev = gpu.alloc_zeroed(32 << 20).expect("alloc");
    let err = sched
        .upload(
            HostSource::Fill {
                source: &Failing,
                len: 32 << 20,
            },
            &mut dev,
            0,
        )
        .unwrap_err();
    assert!(
        matches!(&err, gpufeed_cuda::Error::Source { source, .. } if source.to_string().contains("on fire")),
        "{err:?}"
    );
    let data = random_bytes(5 << 20, 7);
    let mut dev = gpu.alloc_zeroed(data.len()).expect("alloc");
    sched
        .upload(HostSource::Pageable(&data), &mut dev, 0)
        .expect("works after a failure");
    assert_eq!(xxh3_64(&gpu.to_vec(&dev).expect("back")), xxh3_64(&data));
    let err = sched
        .upload(HostSource::Pageable(&data), &mut dev, 1)
        .unwrap_err();
    assert!(
        matches!(err, gpufeed_cuda::Error::OutOfBounds { .. }),
        "{err:?}"
    );
}

#[test]
fn a_staging_buffer_is_not_handed_out_while_its_copy_runs() {
    let Some(gpu) = gpu_or_skip("a_staging_buffer_is_not_handed_out_while_its_copy_runs") else {
        return;
    };
    let sched = TransferScheduler::new(&gpu, config(1, 256 << 20)).expect("scheduler");
    let pool = sched.pool();
    let stream = gpu.context().new_stream().expect("stream");
    let mut buf = pool.get(256 << 20).expect("staging buffer");
    buf.fill(0xAB);
    let addr = buf.as_ptr();
    let mut dev = gpu.alloc_zeroed(256 << 20).expect("alloc");
    // A long copy from the buffer, then give it back to the pool at once.
    {
        use gpufeed_cuda::cudarc::driver::DevicePtrMut;
        let (dptr, _guard) = dev.device_ptr_mut(&stream);
        for _ in 0..8 {
            // SAFETY: the buffer is pinned and, once returned to the pool, only handed out again
            // after the event recorded below completed; dev outlives the copies (synchronized
            // at the end of the test).
            unsafe {
                gpufeed_cuda::cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                    dptr,
                    buf.as_ptr().cast(),
                    256 << 20,
                    stream.cu_stream(),
                )
            }
            .result()
            .expect("copy");
        }
    }
    // The marker completes with the copies, just before the buffer's own event.
    let marker = stream.record_event(None).expect("marker after the copies");
    buf.record_use(&stream).expect("record");
    let was_busy = buf.is_busy();
    drop(buf);
    let again = pool.get(256 << 20).expect("the same buffer again");
    assert_eq!(again.as_ptr(), addr, "the pool handed out the same buffer");
    assert!(
        marker.is_complete(),
        "handed out while its copy was still running"
    );
    eprintln!(
        "the copy was {} when the buffer went back",
        if was_busy { "running" } else { "already done" }
    );
    stream.synchronize().expect("sync");
}

#[test]
fn staged_uploads_from_several_threads_at_once_are_byte_exact() {
    let Some(gpu) = gpu_or_skip("staged_uploads_from_several_threads_at_once_are_byte_exact")
    else {
        return;
    };
    // The lanes of concurrent uploads share the scheduler's lane streams and staging pool.
    let sched = TransferScheduler::new(&gpu, config(2, 1 << 20)).expect("scheduler");
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (gpu, sched) = (&gpu, &sched);
            s.spawn(move || {
                for round in 0..3u64 {
                    let data = random_bytes((24 << 20) + 13 * (t as usize + 1), 100 * t + round);
                    let mut dev = gpu.alloc_zeroed(data.len()).expect("alloc");
                    let stats = if round % 2 == 0 {
                        sched.upload(HostSource::Pageable(&data), &mut dev, 0)
                    } else {
                        let source = gpufeed_cuda::SliceSource(&data);
                        sched.upload(
                            HostSource::Fill {
                                source: &source,
                                len: data.len() as u64,
                            },
                            &mut dev,
                            0,
                        )
                    }
                    .expect("upload");
                    assert_eq!(stats.path, "staged");
                    assert_eq!(
                        xxh3_64(&gpu.to_vec(&dev).expect("back")),
                        xxh3_64(&data),
                        "thread {t} round {round}: the bytes on the GPU differ"
                    );
                }
            });
        }
    });
}

/// Device memory from `cuMemAlloc` (`Gpu::alloc_unpooled`) holds what is uploaded into it, and
/// dropping it (cudarc's stream-ordered free) returns it to the device without leaving an error
/// on the context.
#[test]
fn device_memory_from_cumemalloc_holds_bytes_and_is_freed_on_drop() {
    use gpufeed_cuda::cudarc::driver::result;
    let Some(gpu) = gpu_or_skip("device_memory_from_cumemalloc_holds_bytes_and_is_freed_on_drop")
    else {
        return;
    };
    // The margins below absorb the allocations of the tests running meanwhile.
    let _measuring = measuring_device_memory();
    let len = (8usize << 30) + 4099;
    gpu.context().bind_to_thread().expect("bind");
    let (free_before, _) = result::mem_get_info().expect("mem info");
    // SAFETY: only the uploaded range is read back.
    let mut dev = unsafe { gpu.alloc_unpooled(len) }.expect("alloc");
    let (free_held, _) = result::mem_get_info().expect("mem info");
    assert!(
        free_before.saturating_sub(free_held) >= 6 << 30,
        "8 GiB taken: {free_before} -> {free_held}"
    );
    let sched = TransferScheduler::new(&gpu, config(2, 1 << 20)).expect("scheduler");
    let data = random_bytes((3 << 20) + 5, 41);
    let at = len - data.len();
    sched
        .upload(HostSource::Pageable(&data), &mut dev, at)
        .expect("upload at the end");
    let back = gpu
        .default_stream()
        .clone_dtoh(&dev.slice(at..))
        .expect("back");
    assert!(back == data, "the tail holds other bytes");
    drop(back);
    drop(dev);
    gpu.default_stream().synchronize().expect("sync");
    gpu.context().check_err().expect("the free left no error");
    let (free_after, _) = result::mem_get_info().expect("mem info");
    assert!(
        free_after.saturating_sub(free_held) >= 6 << 30,
        "8 GiB returned: {free_held} -> {free_after}"
    );
    // The context still works.
    assert_eq!(gpu.alloc_zeroed(4096).expect("alloc").len(), 4096);
}

/// A shareable pool (`SharedPool`, where one-process-per-GPU replicated loads stage their
/// rounds) hands out memory filled byte for byte or zeroed, shares it only as its own and only
/// up to the size another process can map, keeps what is dropped for the next allocation, and
/// gives it back to the device when dropped.
#[test]
fn a_shared_pool_fills_shares_and_keeps_its_memory_until_dropped() {
    use gpufeed_cuda::cudarc::driver::{DevicePtr, result};
    use gpufeed_cuda::{Error, SharedPool};
    let test = "a_shared_pool_fills_shares_and_keeps_its_memory_until_dropped";
    let Some(gpu) = gpu_or_skip(test) else {
        return;
    };
    let free = || {
        gpu.default_stream().synchronize().expect("sync");
        gpu.context().bind_to_thread().expect("bind");
        result::mem_get_info().expect("mem info").0
    };
    let _measuring = measuring_device_memory();
    let free_start = free();
    let pool = SharedPool::new(&gpu).expect("a GPU machine's driver shares pools");
    let fd = pool.export().expect("export");
    assert!(
        std::fs::File::from(fd).metadata().is_ok(),
        "a live descriptor"
    );
    let sched = TransferScheduler::new(&gpu, config(2, 1 << 20)).expect("scheduler");
    let data = random_bytes((3 << 30) + 4097, 43);
    let address = |b: &gpufeed_cuda::cudarc::driver::CudaSlice<u8>| {
        let (ptr, guard) = b.device_ptr(b.stream());
        drop(guard);
        ptr
    };
    let (buf, _) = pool
        .alloc_filled(data.len(), |dst| {
            sched.upload(HostSource::Pageable(&data), dst, 0)
        })
        .expect("filled");
    let back = gpu.to_vec(&buf).expect("back");
    assert_eq!(xxh3_64(&back), xxh3_64(&data));
    drop(back);
    let shared = pool.share(&buf).expect("share");
    assert_ne!(shared.0, [0; 64]);
    // SAFETY: never read.
    let other = unsafe { gpu.alloc_unpooled(1 << 20) }.expect("alloc");
    assert!(
        matches!(pool.share(&other), Err(Error::Cuda { .. })),
        "memory of another pool is refused"
    );
    drop(other);
    let first = address(&buf);
    drop(buf);
    // A fill that fails frees its memory unread; the next allocation gets the same memory.
    let failed: Result<_, Error> = pool.alloc_filled(data.len(), |_| {
        Err::<(), _>(Error::OutOfBounds {
            len: 1,
            offset: 0,
            capacity: 0,
        })
    });
    assert!(failed.is_err());
    let again = pool.alloc_zeroed(data.len()).expect("zeroed");
    assert_eq!(address(&again), first, "dropped memory is kept and reused");
    let back = gpu.to_vec(&again).expect("back");
    assert!(back.iter().all(|&b| b == 0), "zeroed");
    drop(back);
    drop(again);
    // More than another process can map: refused here, never handed to the driver.
    let big = pool
        .alloc_zeroed(gpufeed_cuda::SHARED_MAP_MAX_BYTES + 4096)
        .expect("big");
    assert!(
        matches!(pool.share(&big), Err(Error::TooLargeToShare { .. })),
        "an allocation over the limit is refused"
    );
    drop(big);
    let free_kept = free();
    drop(pool);
    let free_dropped = free();
    // The margins absorb the allocations of the tests running meanwhile.
    assert!(
        free_start.saturating_sub(free_kept) >= 2 << 30
            && free_dropped.saturating_sub(free_kept) >= 2 << 30,
        "3 GiB kept while the pool lives, given back when it goes: {free_start} at the start, \
         {free_kept} kept, {free_dropped} after the drop"
    );
    gpu.context()
        .check_err()
        .expect("no error left on the context");
}

/// Small staged uploads are cut into pieces shared by the kept fill threads (the calling
/// thread filling too): byte-exact at unaligned sizes and offsets, as many copies as
/// `pieces_for` says, and a panicking source is an error after which the threads still
/// work.
#[test]
fn small_uploads_are_shared_by_the_fill_threads() {
    let Some(gpu) = gpu_or_skip("small_uploads_are_shared_by_the_fill_threads") else {
        return;
    };
    let cfg = TransferOptions::default()
        .with_chunk_bytes(4 << 20)
        .with_min_chunk_bytes(64 << 10)
        .with_fill_threads(8)
        .with_staging_buffers(16);
    let sched = TransferScheduler::new(&gpu, cfg).expect("scheduler");
    for (i, len) in [
        1usize,
        4095,
        (64 << 10) + 1,
        (1 << 20) + 3,
        (3 << 20) + 7,
        (17 << 20) + 1,
    ]
    .into_iter()
    .enumerate()
    {
        let data = random_bytes(len, 900 + i as u64);
        let mut dev = gpu.alloc_zeroed(len + 5).expect("alloc");
        let stats = sched
            .upload(HostSource::Pageable(&data), &mut dev, 5)
            .expect("upload");
        let pieces = cfg.pieces_for(len as u64) as u64;
        assert_eq!(stats.chunks, pieces, "{len} B in {pieces} pieces");
        assert!(
            len < 1 << 20 || pieces > 1,
            "{len} B is shared by several threads"
        );
        let back = gpu.to_vec(&dev).expect("back");
        assert_eq!(xxh3_64(&back[5..]), xxh3_64(&data), "{len} B differ");
    }
    struct Panicking;
    impl FillSource for Panicking {
        fn fill(&self, offset: u64, dst: &mut [u8]) -> Result<(), SourceError> {
            assert!(offset < 1 << 20, "a source bug at {offset}");
            dst.fill(2);
            Ok(())
        }
    }
    let mut dev = gpu.alloc_zeroed(4 << 20).expect("alloc");
    let err = sched
        .upload(
            HostSource::Fill {
                source: &Panicking,
                len: 4 << 20,
            },
            &mut dev,
            0,
        )
        .unwrap_err();
    assert!(
        matches!(err, gpufeed_cuda::Error::ThreadPanicked { what: "fill" }),
        "{err:?}"
    );
    let data = random_bytes(2 << 20, 77);
    sched
        .upload(HostSource::Pageable(&data), &mut dev, 0)
        .expect("works after a panic");
    assert_eq!(
        xxh3_64(&gpu.to_vec(&dev).expect("back")[..2 << 20]),
        xxh3_64(&data)
    );
}

/// Work on a GPU inside a `ContextGuard` leaves the thread's current context as it was: none
/// on a fresh thread; GPU 0's while GPU 1 (where there is one) is opened and written.
#[test]
fn a_context_guard_puts_the_current_context_back() {
    let Some(gpu) = crate::gpu_or_skip("a_context_guard_puts_the_current_context_back") else {
        return;
    };
    use gpufeed_cuda::cudarc::driver::result::ctx::get_current;
    std::thread::spawn(move || {
        assert_eq!(
            get_current().expect("cuCtxGetCurrent"),
            None,
            "a fresh thread"
        );
        {
            let _guard = gpufeed_cuda::ContextGuard::new();
            let dev = gpu.alloc_zeroed(4096).expect("alloc");
            assert!(
                get_current().expect("current").is_some(),
                "the work bound GPU 0"
            );
            drop(dev);
        }
        assert_eq!(get_current().expect("current"), None, "unbound again");
        gpu.context().bind_to_thread().expect("bind GPU 0");
        let mine = get_current().expect("current");
        let other = gpufeed_cuda::Gpu::keeping_current_context(|| {
            let g1 = gpufeed_cuda::Gpu::open(usize::from(
                gpufeed_cuda::Gpu::count().expect("count") > 1,
            ))
            .expect("open");
            drop(g1.alloc_zeroed(4096).expect("alloc"));
            g1.info().ordinal
        });
        assert_eq!(
            get_current().expect("current"),
            mine,
            "GPU {other}'s work left GPU 0 current"
        );
    })
    .join()
    .expect("the thread");
}

/// `upload_pooled_async` from several threads at once, each reusing its staging buffers at
/// once (the pool waits for the copy): every device copy, after its event, equals what its
/// buffer held when it was issued.
#[test]
fn pooled_uploads_not_waited_for_arrive_byte_for_byte() {
    let Some(gpu) = gpu_or_skip("pooled_uploads_not_waited_for_arrive_byte_for_byte") else {
        return;
    };
    let sched = TransferScheduler::new(&gpu, config(3, 4 << 20)).expect("scheduler");
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (gpu, sched) = (&gpu, &sched);
            s.spawn(move || {
                let mut issued = Vec::new();
                for round in 0..12u64 {
                    let len = [0usize, 1, 4095, (3 << 20) + 17, 9 << 20][(round % 5) as usize];
                    let data = random_bytes(len, 7000 + 100 * t + round);
                    let mut buf = sched.pool().get(len.max(1)).expect("staging");
                    buf.set_len(len);
                    buf.copy_from_slice(&data);
                    let (dev, done) = sched.upload_pooled_async(&mut buf).expect("upload");
                    assert_eq!(dev.len(), len);
                    drop(buf); // back to the pool while the copy may still run
                    issued.push((dev, done, xxh3_64(&data)));
                }
                for (k, (dev, done, want)) in issued.into_iter().enumerate() {
                    done.synchronize().expect("event");
                    let back = if dev.is_empty() {
                        Vec::new()
                    } else {
                        gpu.to_vec(&dev).expect("back")
                    };
                    assert_eq!(xxh3_64(&back), want, "thread {t}, upload {k}");
                }
            });
        }
    });
}

/// Memory let go with `keep_for_reuse` comes back to the next unpooled allocation of its exact
/// length (the same address, filled anew byte for byte), not to one of another length; kept
/// memory stays taken from the device until `release_kept` gives it back.
#[test]
fn kept_memory_serves_the_next_allocation_of_its_length_and_is_given_back() {
    use gpufeed_cuda::DeviceAlloc;
    use gpufeed_cuda::cudarc::driver::{DevicePtr, result};
    let test = "kept_memory_serves_the_next_allocation_of_its_length_and_is_given_back";
    let Some(gpu) = gpu_or_skip(test) else {
        return;
    };
    let free = || {
        gpu.context().synchronize().expect("sync");
        gpu.context().bind_to_thread().expect("bind");
        result::mem_get_info().expect("mem info").0
    };
    let address = |b: &gpufeed_cuda::cudarc::driver::CudaSlice<u8>| {
        let (ptr, guard) = b.device_ptr(b.stream());
        drop(guard);
        ptr
    };
    let sched = TransferScheduler::new(&gpu, config(2, 1 << 20)).expect("scheduler");
    let len = (3usize << 30) + 4099;
    let first = random_bytes(len, 44);
    let _measuring = measuring_device_memory();
    let free_start = free();
    let (buf, _) = gpu
        .alloc_filled(len, DeviceAlloc::Unpooled, |dst| {
            sched.upload(HostSource::Pageable(&first), dst, 0)
        })
        .expect("load");
    let at = address(&buf);
    free();
    assert!(gpu.keep_for_reuse(buf), "3 GiB of a large device kept");
    assert!(
        !gpu.keep_for_reuse(gpu.alloc_zeroed(0).expect("empty")),
        "an empty buffer is not kept"
    );
    assert_eq!(gpu.kept_bytes(), len as u64);
    let free_kept = free();
    assert!(
        free_start.saturating_sub(free_kept) >= 2 << 30,
        "kept memory stays taken: {free_start} -> {free_kept}"
    );
    // Another length does not take it.
    let (other, _) = gpu
        .alloc_filled(len - 1, DeviceAlloc::Unpooled, |dst| {
            sched.upload(HostSource::Pageable(&first[1..]), dst, 0)
        })
        .expect("load");
    assert_ne!(address(&other), at, "a buffer of another length reused");
    assert_eq!(gpu.kept_bytes(), len as u64);
    drop(other);
    // Its length does, and holds the new bytes.
    let second = random_bytes(len, 45);
    let (again, _) = gpu
        .alloc_filled(len, DeviceAlloc::Unpooled, |dst| {
            sched.upload(HostSource::Pageable(&second), dst, 0)
        })
        .expect("load");
    assert_eq!(address(&again), at, "the kept buffer was not reused");
    assert_eq!(gpu.kept_bytes(), 0);
    check_on_device(&gpu, &sched, &again, &second, "a kept buffer filled again");
    // Kept again and given back: the device has it.
    assert!(gpu.keep_for_reuse(again));
    assert_eq!(gpu.release_kept().expect("release"), len as u64);
    assert_eq!(gpu.kept_bytes(), 0);
    let free_end = free();
    assert!(
        free_end.saturating_sub(free_kept) >= 2 << 30,
        "given back: {free_kept} -> {free_end}"
    );
    assert_eq!(gpu.release_kept().expect("release"), 0, "nothing left");
}

/// CPU seconds of the calling thread so far.
fn thread_cpu_s() -> f64 {
    // SAFETY: a zeroed rusage is valid; getrusage writes it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_THREAD of this thread into `u`.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) }, 0);
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

#[test]
fn a_sleeping_wait_waits_for_the_work_without_a_busy_core() {
    let test = "a_sleeping_wait_waits_for_the_work_without_a_busy_core";
    let Some(gpu) = crate::gpu_or_skip(test) else {
        return;
    };
    let stream = gpu.default_stream();
    let n = 256 << 20;
    let src_bytes = random_bytes(n, gpufeed_testkit::seed(test));
    let src = stream.clone_htod(&src_bytes).expect("upload");
    let mut dst = stream.alloc_zeros::<u8>(n).expect("alloc");
    stream.synchronize().expect("sync");
    // Copies queued for well over 50 ms of the GPU's time, the last one the check.
    let queue = |dst: &mut gpufeed_cuda::cudarc::driver::CudaSlice<u8>| {
        for _ in 0..400 {
            stream.memcpy_dtod(&src, dst).expect("copy");
        }
    };
    // Spinning, for the record (not asserted: the driver's scheduling decides).
    queue(&mut dst);
    let (c0, t0) = (thread_cpu_s(), std::time::Instant::now());
    stream.synchronize().expect("sync");
    let (spin_cpu, spin_wall) = (thread_cpu_s() - c0, t0.elapsed().as_secs_f64());
    queue(&mut dst);
    let (c0, t0) = (thread_cpu_s(), std::time::Instant::now());
    gpu.wait_asleep(&stream).expect("wait");
    let (cpu, wall) = (thread_cpu_s() - c0, t0.elapsed().as_secs_f64());
    eprintln!(
        "{test}: cuStreamSynchronize {spin_cpu:.3} CPU s over {spin_wall:.3} s; \
         wait_asleep {cpu:.3} CPU s over {wall:.3} s"
    );
    assert!(
        wall > 0.02,
        "the queued copies took {wall:.3} s: too little to tell"
    );
    assert!(
        cpu < 0.25 * wall,
        "wait_asleep used {cpu:.3} CPU s over {wall:.3} s: it spun"
    );
    // The work is done when it returns.
    let got = stream.clone_dtoh(&dst).expect("download");
    assert!(got == src_bytes, "the copies' bytes differ");
}
