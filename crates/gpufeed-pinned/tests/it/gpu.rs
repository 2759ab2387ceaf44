//! On a GPU: pinned buffers, registrations of read-only file maps, the pool in CUDA mode.

use gpufeed_os::{FileMap, MapMode};
use gpufeed_pinned::{Error, HostRegistration, PinnedBuffer, PinnedPool, PoolMode, PoolOptions};

use crate::{gpu_or_skip, random_bytes};

#[test]
fn pinned_buffers_are_zeroed_and_writable() {
    let Some(ctx) = gpu_or_skip("pinned_buffers_are_zeroed_and_writable") else {
        return;
    };
    let mut buf = PinnedBuffer::new(&ctx, 3 * 1024 * 1024 + 7).expect("cuMemHostAlloc");
    assert!(buf.iter().all(|&b| b == 0));
    let data = random_bytes(buf.len(), 1);
    buf.copy_from_slice(&data);
    assert!(buf[..] == data[..]);
    assert!(!buf.flags().write_combined);
}

#[test]
fn read_only_file_maps_register_once() {
    let Some(ctx) = gpu_or_skip("read_only_file_maps_register_once") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("f.bin");
    std::fs::write(&path, random_bytes(5 * 1024 * 1024 + 123, 2)).expect("write");
    // SAFETY: the file is private to this test and not truncated while mapped.
    let map = unsafe { FileMap::open_range(&path, 4097, 4 * 1024 * 1024, MapMode::ReadOnly) }
        .expect("map");
    let reg = HostRegistration::file_map(&ctx, &map).expect("register read-only");
    assert!(reg.is_read_only());
    assert_eq!(reg.len(), 4 * 1024 * 1024);
    // The same pages again: refused with a clear error instead of an obscure driver code.
    let err = HostRegistration::file_map(&ctx, &map).unwrap_err();
    assert!(matches!(err, Error::AlreadyRegistered { .. }), "{err:?}");
    drop(reg);
    HostRegistration::file_map(&ctx, &map).expect("registrable again after drop");

    // SAFETY: as above.
    let private = unsafe { FileMap::open(&path, MapMode::Private) }.expect("map");
    assert!(matches!(
        HostRegistration::file_map(&ctx, &private),
        Err(Error::NotReadOnly)
    ));
}

#[test]
fn pool_in_cuda_mode_reuses_pinned_buffers() {
    let Some(ctx) = gpu_or_skip("pool_in_cuda_mode_reuses_pinned_buffers") else {
        return;
    };
    let pool = PinnedPool::new(PoolMode::Cuda(ctx.clone()), PoolOptions::default()).expect("pool");
    let a = pool.get(5 << 20).expect("get");
    assert!(a.is_pinned() && a.is_locked());
    let addr = a.as_ptr();
    drop(a);
    let t = std::time::Instant::now();
    let b = pool.get(6 << 20).expect("get");
    let took = t.elapsed();
    assert_eq!(b.as_ptr(), addr);
    eprintln!("steady-state get took {took:?}");
    assert_eq!(pool.stats().allocations, 1);
}

/// Writing into a pooled buffer through `DerefMut` while a recorded copy still reads it: the
/// write waits for the copy, so the GPU receives the bytes as they were when the copy was
/// enqueued. The CPU writes the tail, which the copy engine reads last (before, the tail of
/// the device copy could hold the new bytes).
#[test]
fn writing_a_pooled_buffer_waits_for_the_copy_that_reads_it() {
    use cudarc::driver::DevicePtrMut;
    let Some(ctx) = gpu_or_skip("writing_a_pooled_buffer_waits_for_the_copy_that_reads_it") else {
        return;
    };
    let len = (256 << 20) - 4095; // the largest size class, unaligned
    let pool = PinnedPool::new(PoolMode::Cuda(ctx.clone()), PoolOptions::default()).expect("pool");
    let mut buf = pool.get(len).expect("get");
    buf.set_len(len);
    let before = random_bytes(len, 21);
    buf.copy_from_slice(&before);
    let stream = ctx.new_stream().expect("stream");
    let mut dev = stream.alloc_zeros::<u8>(len).expect("device memory");
    stream.synchronize().expect("sync");
    {
        let (dst, _sync) = dev.device_ptr_mut(&stream);
        // SAFETY: `dst` holds `len` bytes; `buf` stays alive and, through `record_use`, is
        // not written before the copy has read it (what this test checks).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst, &buf[..], stream.cu_stream())
                .expect("enqueue the copy");
        }
    }
    buf.record_use(&stream).expect("record");
    // Right away, while the copy runs: overwrite the last MiB.
    let tail = len - (1 << 20);
    buf[tail..].fill(0xEE);
    stream.synchronize().expect("sync");
    let back = stream.clone_dtoh(&dev).expect("copy back");
    assert!(
        back[tail..] == before[tail..],
        "the GPU received bytes written after the copy was enqueued"
    );
    assert!(back == before);
}

/// A slab reserved in CUDA mode: one registration, every piece pinned, served without
/// allocating, and the GPU copies out of a piece byte for byte.
#[test]
fn a_reserved_slab_is_registered_once_and_copies_exactly() {
    let Some(ctx) = gpu_or_skip("a_reserved_slab_is_registered_once_and_copies_exactly") else {
        return;
    };
    let pool = PinnedPool::new(PoolMode::Cuda(ctx.clone()), PoolOptions::default()).expect("pool");
    assert_eq!(pool.reserve((3 << 20) + 1, 4).expect("reserve"), 4);
    let mut bufs: Vec<_> = (0..4).map(|_| pool.get(3 << 20).expect("get")).collect();
    assert_eq!(pool.stats().allocations, 1, "one slab, no buffer allocated");
    assert!(bufs.iter().all(|b| b.is_pinned() && b.is_locked()));
    let data = random_bytes((3 << 20) - 11, 5);
    bufs[2][..data.len()].copy_from_slice(&data);
    let stream = ctx.default_stream();
    let dev = stream
        .clone_htod(&bufs[2][..data.len()])
        .expect("copy from a slab piece");
    let back = stream.clone_dtoh(&dev).expect("copy back");
    assert!(back == data, "the device received other bytes");
}

/// A buffer given back while copies still read it: a pool that grows hands out another buffer
/// at once (the copies untouched), one that does not waits and hands out the same; once the
/// copies are done, the idle buffer is reused.
#[test]
fn a_busy_buffer_is_waited_for_or_passed_over_when_the_pool_grows() {
    use cudarc::driver::DevicePtrMut;
    let Some(ctx) = gpu_or_skip("a_busy_buffer_is_waited_for_or_passed_over_when_the_pool_grows")
    else {
        return;
    };
    let len = (64 << 20) - 3;
    let stream = ctx.new_stream().expect("stream");
    let mut dev = stream.alloc_zeros::<u8>(len).expect("device memory");
    let data = random_bytes(len, 33);
    for grow in [true, false] {
        let cfg = PoolOptions::default().with_grow_when_busy(grow);
        let pool = PinnedPool::new(PoolMode::Cuda(ctx.clone()), cfg).expect("pool");
        let mut buf = pool.get(len).expect("get");
        buf.set_len(len);
        buf.copy_from_slice(&data);
        let addr = buf.as_ptr();
        stream.synchronize().expect("sync");
        {
            let (dst, _sync) = dev.device_ptr_mut(&stream);
            // About 1.3 GB of copies (tens of ms): still running when `get` asks.
            for _ in 0..20 {
                // SAFETY: `dst` holds `len` bytes; `buf`'s memory is not written or freed
                // before the copies end (recorded below; the pool waits for them).
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(dst, &buf[..], stream.cu_stream())
                        .expect("enqueue");
                }
            }
        }
        buf.record_use(&stream).expect("record");
        drop(buf);
        let next = pool.get(len).expect("get while busy");
        if grow {
            assert_ne!(next.as_ptr(), addr, "growing: not the busy buffer");
            assert_eq!(pool.stats().allocations, 2);
        } else {
            assert_eq!(
                next.as_ptr(),
                addr,
                "waiting: the same buffer, after its copies"
            );
            assert_eq!(pool.stats().allocations, 1);
        }
        drop(next);
        stream.synchronize().expect("sync");
        let again = pool.get(len).expect("get when idle");
        assert_eq!(
            pool.stats().allocations,
            if grow { 2 } else { 1 },
            "idle: reused"
        );
        drop(again);
        let back = stream.clone_dtoh(&dev).expect("copy back");
        assert!(back == data, "the copies read the bytes as they were");
    }
}

/// The newest buffer given back is preferred (its pages are the warmest), but not while copies
/// still read it: `get` passes over it to an older idle one, without waiting and without
/// allocating; once its copies are done it is the one handed out again.
#[test]
fn get_passes_over_a_busy_newest_buffer_to_an_idle_older_one() {
    use cudarc::driver::DevicePtrMut;
    let Some(ctx) = gpu_or_skip("get_passes_over_a_busy_newest_buffer_to_an_idle_older_one") else {
        return;
    };
    let len = (64 << 20) - 5;
    let stream = ctx.new_stream().expect("stream");
    let mut dev = stream.alloc_zeros::<u8>(len).expect("device memory");
    let data = random_bytes(len, 34);
    let pool = PinnedPool::new(PoolMode::Cuda(ctx.clone()), PoolOptions::default()).expect("pool");
    let older = pool.get(len).expect("get");
    let mut newest = pool.get(len).expect("get");
    let (older_addr, newest_addr) = (older.as_ptr(), newest.as_ptr());
    newest.set_len(len);
    newest.copy_from_slice(&data);
    stream.synchronize().expect("sync");
    {
        let (dst, _sync) = dev.device_ptr_mut(&stream);
        // About 2.7 GB of copies (tens of ms): still running when `get` asks.
        for _ in 0..40 {
            // SAFETY: `dst` holds `len` bytes; `newest`'s memory is not written or freed
            // before the copies end (recorded below; the pool waits for them).
            unsafe {
                cudarc::driver::result::memcpy_htod_async(dst, &newest[..], stream.cu_stream())
                    .expect("enqueue");
            }
        }
    }
    newest.record_use(&stream).expect("record");
    let copies_done = ctx.new_event(None).expect("event");
    copies_done.record(&stream).expect("record");
    drop(older); // idle, given back first
    drop(newest); // busy, given back last
    let next = pool.get(len).expect("get while the newest is busy");
    let still_copying = !copies_done.is_complete();
    assert_eq!(
        next.as_ptr(),
        older_addr,
        "the idle older buffer, not the busy newest"
    );
    assert_eq!(pool.stats().allocations, 2, "nothing allocated");
    // 2.7 GB take about 50 ms at the link's 55 GB/s; `get` returns in microseconds unless
    // it waited for them.
    assert!(still_copying, "get waited for the busy buffer's copies");
    drop(next);
    stream.synchronize().expect("sync");
    let again = pool.get(len).expect("get when idle");
    assert_eq!(
        again.as_ptr(),
        older_addr,
        "idle again: the buffer given back last (the older one, given back after its use)"
    );
    let other = pool.get(len).expect("get the second");
    assert_eq!(other.as_ptr(), newest_addr);
    assert_eq!(pool.stats().allocations, 2, "both reused");
    let back = stream.clone_dtoh(&dev).expect("copy back");
    assert!(back == data, "the copies read the bytes as they were");
}
