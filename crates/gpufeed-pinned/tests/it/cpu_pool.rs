//! The pool without CUDA (CPU mode), and the no-driver behaviour.

use gpufeed_pinned::{Error, MAX_CLASS, MIN_CLASS, PinnedPool, PoolMode, PoolOptions};

#[test]
fn without_a_driver_every_cuda_entry_point_says_so() {
    match gpufeed_pinned::driver_available() {
        Ok(()) => eprintln!("a CUDA driver is present here; the no-driver path is not exercised"),
        Err(e) => {
            assert!(matches!(e, Error::NoCudaDriver));
            assert!(e.to_string().contains("install the NVIDIA driver"), "{e}");
            // A pool asked to follow a context without a driver runs in CPU mode, noted.
            let pool =
                PinnedPool::for_context_or_cpu(None, PoolOptions::default()).expect("cpu pool");
            assert!(!pool.is_pinned());
            assert!(pool.notes().iter().any(|n| n.contains("CPU mode")));
        }
    }
}

#[test]
fn size_classes_reuse_and_bad_sizes() {
    let pool = PinnedPool::new(PoolMode::Cpu, PoolOptions::default()).expect("pool");
    let mut a = pool.get(100_000).expect("get");
    assert_eq!((a.len(), a.capacity()), (100_000, 128 << 10));
    assert!(a.iter().all(|&b| b == 0));
    a[..5].copy_from_slice(b"hello");
    let addr = a.as_ptr();
    drop(a);
    let b = pool.get(70_000).expect("get");
    assert_eq!(b.as_ptr(), addr, "the same class is reused");
    assert_eq!(
        &b[..5],
        b"hello",
        "reuse does not clear (callers overwrite)"
    );
    let small = pool.get(1).expect("get");
    assert_eq!(small.capacity(), MIN_CLASS);
    let stats = pool.stats();
    assert_eq!((stats.allocations, stats.reuses), (2, 1));
    assert_eq!(stats.in_use_bytes, (128 << 10) + MIN_CLASS as u64);
    assert!(matches!(
        pool.get(MAX_CLASS + 1),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        pool.get(0),
        Err(Error::Os(gpufeed_os::Error::ZeroLength { .. }))
    ));
}

#[test]
fn the_buffer_given_back_last_is_handed_out_first() {
    // Its pages are the likeliest in the CPU's caches: a loader's small loads reuse one warm
    // buffer instead of rotating through all of its staging (GPU run 193).
    for grow in [false, true] {
        let cfg = PoolOptions::default().with_grow_when_busy(grow);
        let pool = PinnedPool::new(PoolMode::Cpu, cfg).expect("pool");
        let bufs: Vec<_> = (0..4).map(|_| pool.get(1 << 20).expect("get")).collect();
        let addrs: Vec<_> = bufs.iter().map(|b| b.as_ptr()).collect();
        drop(bufs); // given back in order: the last one last
        for _ in 0..3 {
            let again = pool.get(1 << 20).expect("get");
            assert_eq!(again.as_ptr(), addrs[3], "grow {grow}: the last given back");
        }
        let two = (
            pool.get(1 << 20).expect("get"),
            pool.get(1 << 20).expect("get"),
        );
        assert_eq!((two.0.as_ptr(), two.1.as_ptr()), (addrs[3], addrs[2]));
        assert_eq!(
            pool.stats().allocations,
            4,
            "grow {grow}: nothing allocated again"
        );
    }
}

#[test]
fn the_budget_is_kept_by_evicting_cached_buffers_then_refusing() {
    let pool = PinnedPool::new(
        PoolMode::Cpu,
        PoolOptions::default()
            .with_budget_bytes(Some(1 << 20))
            .with_numa_node(None),
    )
    .expect("pool");
    let half = pool.get(512 << 10).expect("512 KiB");
    drop(pool.get(256 << 10).expect("256 KiB, cached after drop"));
    // 512 KiB in use + 256 KiB cached; 512 KiB more only fits if the cached one goes.
    let other = pool.get(512 << 10).expect("fits after eviction");
    assert_eq!(pool.stats().evictions, 1);
    assert_eq!(pool.stats().held_bytes, 1 << 20);
    let err = pool.get(64 << 10).unwrap_err();
    assert!(
        matches!(err, Error::PoolExhausted { budget, .. } if budget == 1 << 20),
        "{err:?}"
    );
    assert!(err.to_string().contains("budget"), "{err}");
    drop((half, other));
    pool.trim();
    assert_eq!(pool.stats().held_bytes, 0);
}

#[test]
fn cpu_buffers_are_locked_within_the_limit_and_placed_on_the_node() {
    let pool = PinnedPool::new(
        PoolMode::Cpu,
        PoolOptions::default()
            .with_budget_bytes(None)
            .with_numa_node(Some(0)),
    )
    .expect("pool");
    let buf = pool.get(1 << 20).expect("get");
    let limit = gpufeed_os::lock::memlock_limit().soft;
    if gpufeed_os::lock::has_cap_ipc_lock() || limit.is_none_or(|l| l >= 2 << 20) {
        assert!(
            buf.is_locked(),
            "1 MiB fits the memlock limit here: {:?}",
            pool.notes()
        );
    }
    let placed = gpufeed_numa::placement_of(buf.as_ptr(), buf.capacity()).expect("placement");
    assert_eq!(placed.not_present, 0, "populated at allocation");
    assert_eq!(placed.single_node(), Some(0), "{placed:?}");
}

#[test]
fn past_the_memlock_limit_buffers_are_unlocked_with_a_note() {
    // Lower the limit in a child so the rest of the tests keep theirs.
    run_as_child("cpu_pool::child_low_memlock");
}

/// Runs test `name` of this binary alone in a child process (the testkit's child role set)
/// and checks that it passed and printed CHILD-OK.
fn run_as_child(name: &str) {
    let out = gpufeed_testkit::run_child(name, "child", &[]);
    assert!(out.contains("CHILD-OK"), "{out}");
}

/// Runs only as the child of the test above (a dispatcher otherwise).
#[test]
fn child_low_memlock() {
    if std::env::var(gpufeed_testkit::CHILD_ROLE).is_err() {
        return;
    }
    use rustix::process::{Resource, Rlimit, setrlimit};
    use rustix::thread::{CapabilitySet, capabilities, set_capabilities};
    setrlimit(
        Resource::Memlock,
        Rlimit {
            current: Some(256 << 10),
            maximum: Some(256 << 10),
        },
    )
    .expect("setrlimit");
    let mut caps = capabilities(None).expect("capget");
    caps.effective.remove(CapabilitySet::IPC_LOCK);
    set_capabilities(None, caps).expect("drop CAP_IPC_LOCK");
    let pool = PinnedPool::new(PoolMode::Cpu, PoolOptions::default()).expect("pool");
    let small = pool.get(64 << 10).expect("64 KiB");
    assert!(small.is_locked());
    let big = pool
        .get(1 << 20)
        .expect("1 MiB is handed out even unlocked");
    assert!(!big.is_locked());
    assert_eq!(pool.stats().unlocked_buffers, 1);
    let notes = pool.notes();
    assert!(
        notes
            .iter()
            .any(|n| n.contains("unlocked") && n.contains("ulimit -l")),
        "{notes:?}"
    );
    println!("CHILD-OK");
}

/// Placement asked on a NUMA node this machine does not have: the pool still hands out
/// buffers, unplaced, and says so in its notes (no silent fallback).
#[test]
fn a_missing_numa_node_is_noted_and_buffers_still_work() {
    let missing = gpufeed_numa::Topology::detect()
        .map(|t| t.nodes().iter().map(|n| n.id).max().unwrap_or(0) + 1)
        .expect("topology");
    let pool = PinnedPool::new(
        PoolMode::Cpu,
        PoolOptions::default()
            .with_budget_bytes(Some(64 << 20))
            .with_numa_node(Some(missing)),
    )
    .expect("pool");
    let mut buf = pool.get(100_000).expect("get");
    buf.set_len(100_000);
    let data = crate::random_bytes(100_000, 4);
    buf.copy_from_slice(&data);
    assert!(buf[..] == data[..]);
    assert_eq!(
        pool.notes(),
        vec![format!(
            "NUMA node {missing} does not exist here; buffers are not placed"
        )]
    );
}

/// A reserved slab: one lock for all its buffers, cut into distinct size-class pieces that
/// `get` hands out without allocating, counted in the budget, and unlocked (VmLck back where
/// it was) once the pool and its buffers are gone. Runs in a child process: VmLck is the
/// process's, and the other tests lock memory too.
#[test]
fn a_reserved_slab_serves_gets_and_is_unlocked_when_the_pool_goes() {
    use gpufeed_pinned::HostSlab;
    const ME: &str = "cpu_pool::a_reserved_slab_serves_gets_and_is_unlocked_when_the_pool_goes";
    if std::env::var(gpufeed_testkit::CHILD_ROLE).is_err() {
        run_as_child(ME);
        return;
    }
    let before = gpufeed_os::lock::locked_bytes().expect("VmLck readable");
    let pool = PinnedPool::new(
        PoolMode::Cpu,
        PoolOptions::default()
            .with_budget_bytes(Some(8 << 20))
            .with_numa_node(None),
    )
    .expect("pool");
    let slab = HostSlab::new((4 << 20) + 5).expect("slab");
    assert_eq!(slab.len(), (4 << 20) + 4096, "whole pages");
    assert_eq!(pool.reserve_slab(slab, 1 << 20).expect("reserve"), 4);
    assert_eq!(pool.stats().held_bytes, 4 << 20);
    assert_eq!(pool.stats().allocations, 1);
    let mut bufs: Vec<_> = (0..4).map(|_| pool.get(1 << 20).expect("get")).collect();
    assert_eq!(pool.stats().reuses, 4, "all four from the slab");
    assert_eq!(pool.stats().allocations, 1, "nothing allocated");
    let mut starts: Vec<usize> = bufs.iter().map(|b| b.as_ptr() as usize).collect();
    starts.sort_unstable();
    assert!(
        starts.windows(2).all(|w| w[1] - w[0] >= 1 << 20),
        "distinct pieces: {starts:x?}"
    );
    // Where the memlock limit leaves no room for the slab, it is handed out unlocked, noted.
    let fits = gpufeed_os::lock::has_cap_ipc_lock()
        || gpufeed_os::lock::memlock_limit()
            .soft
            .is_none_or(|l| l >= before + (5 << 20));
    for (i, b) in bufs.iter_mut().enumerate() {
        b.fill(i as u8 + 1);
        assert_eq!(b.is_locked(), fits, "{:?}", pool.notes());
    }
    for (i, b) in bufs.iter().enumerate() {
        assert!(
            b.iter().all(|&x| x == i as u8 + 1),
            "buffer {i} overwritten"
        );
    }
    let locked = gpufeed_os::lock::locked_bytes().expect("VmLck");
    if fits {
        assert!(
            locked >= before + (4 << 20),
            "one lock of the slab: {before} -> {locked}"
        );
    } else {
        assert_eq!(pool.stats().unlocked_buffers, 4);
        assert!(
            pool.notes().iter().any(|n| n.contains("left unlocked")),
            "{:?}",
            pool.notes()
        );
    }
    // A second slab would pass the 8 MiB budget with the first still held.
    let err = pool
        .reserve_slab(HostSlab::new(8 << 20).expect("slab"), 1 << 20)
        .unwrap_err();
    assert!(matches!(err, Error::PoolExhausted { .. }), "{err:?}");
    assert_eq!(pool.stats().held_bytes, 4 << 20, "the refusal kept nothing");
    // 64 KiB requests are a class of their own: served by a new allocation.
    drop(pool.get(60 << 10).expect("small"));
    assert_eq!(pool.stats().allocations, 2);
    drop(bufs);
    drop(pool);
    assert_eq!(
        gpufeed_os::lock::locked_bytes().expect("VmLck"),
        before,
        "the slab is unlocked with its last buffer"
    );
    println!("CHILD-OK");
}

/// The resident memory of this process, from /proc/self/status.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb << 10
}

/// A slab faulted in alone asks `widen` before every piece, and once widened faults the rest
/// on several threads: every byte is resident when it returns, and zero. In a child process
/// of its own, so that no other test changes the resident memory meanwhile.
#[test]
fn a_slab_is_faulted_in_whole_alone_or_widened() {
    use gpufeed_pinned::HostSlab;
    use std::sync::atomic::{AtomicUsize, Ordering};
    const ME: &str = "cpu_pool::a_slab_is_faulted_in_whole_alone_or_widened";
    if std::env::var(gpufeed_testkit::CHILD_ROLE).is_err() {
        let out = gpufeed_testkit::run_child(ME, "slab", &[]);
        assert!(out.contains("CHILD-OK"), "{out}");
        return;
    }
    let len = (48 << 20) + 5; // 13 pieces of 4 MiB, the last one short
    let asks = AtomicUsize::new(0);
    let before = rss_bytes();
    let alone = HostSlab::new_widening(len, 4, || {
        asks.fetch_add(1, Ordering::Relaxed);
        false
    })
    .expect("slab");
    let grown = rss_bytes() - before;
    assert_eq!(alone.len(), (48 << 20) + 4096, "whole pages");
    assert_eq!(
        asks.load(Ordering::Relaxed),
        13,
        "asked before each of 13 pieces"
    );
    assert!(grown >= 48 << 20, "faulted in alone: RSS grew by {grown} B");

    let asks = AtomicUsize::new(0);
    let before = rss_bytes();
    let widened =
        HostSlab::new_widening(len, 4, || asks.fetch_add(1, Ordering::Relaxed) >= 2).expect("slab");
    let grown = rss_bytes() - before;
    assert_eq!(
        asks.load(Ordering::Relaxed),
        3,
        "two pieces alone, then widened"
    );
    assert!(
        grown >= 48 << 20,
        "faulted in widened: RSS grew by {grown} B"
    );
    // The memory is usable as a pool's (zeroed) buffers, all 12 whole MiB-classes of 4 MiB.
    let pool = PinnedPool::new(
        PoolMode::Cpu,
        PoolOptions::default()
            .with_budget_bytes(Some(64 << 20))
            .with_numa_node(None),
    )
    .expect("pool");
    assert_eq!(pool.reserve_slab(widened, 4 << 20).expect("reserve"), 12);
    let buf = pool.get(4 << 20).expect("get");
    assert!(buf.iter().all(|&b| b == 0), "fresh memory reads zero");
    drop((buf, alone));
    println!("CHILD-OK");
}
