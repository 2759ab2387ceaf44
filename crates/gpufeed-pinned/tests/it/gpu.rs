//! On a GPU: pinned buffers, registrations of read-only file maps, the pool in CUDA mode.

use gpufeed_os::{FileMap, MapMode};
use gpufeed_pinned::{Error, HostRegistration, PinnedBuffer, PinnedPool, PoolConfig, PoolMode};

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
    let pool = PinnedPool::new(PoolMode::Cuda(ctx.clone()), PoolConfig::default()).expect("pool");
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
