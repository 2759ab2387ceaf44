use gpufeed_os::lock::{self, memlock_limit};
use gpufeed_os::{AlignedBuf, Error};

use crate::child;

/// The "Max locked memory" line of /proc/self/limits: an independent reading of the limit.
fn limits_file_memlock() -> (Option<u64>, Option<u64>) {
    let text = std::fs::read_to_string("/proc/self/limits").expect("/proc/self/limits");
    let line = text
        .lines()
        .find(|l| l.starts_with("Max locked memory"))
        .expect("memlock line");
    let words: Vec<&str> = line["Max locked memory".len()..]
        .split_whitespace()
        .collect();
    let parse = |w: &str| (w != "unlimited").then(|| w.parse().expect("number"));
    (parse(words[0]), parse(words[1]))
}

#[test]
fn memlock_limit_matches_proc() {
    let limit = memlock_limit();
    assert_eq!((limit.soft, limit.hard), limits_file_memlock());
}

#[test]
fn mlock_locks_and_unlocks() {
    let _serial = crate::mlock_serial();
    let buf = AlignedBuf::new(256 * 1024, 4096).expect("alloc");
    let before = lock::locked_bytes().expect("VmLck readable");
    let locked = lock::mlock(&buf).expect("256 KiB fits the limit");
    assert_eq!(locked.len(), 256 * 1024);
    assert!(lock::locked_bytes().expect("VmLck") >= before + 256 * 1024);
    drop(locked);
    assert_eq!(lock::locked_bytes().expect("VmLck"), before);
}

/// Runs in a child process (see `child.rs`): lowers the limit to 64 KiB, drops CAP_IPC_LOCK,
/// then checks that a larger lock fails with the limit in the error and a small one works.
pub fn in_child_with_low_limit() {
    use rustix::process::{Resource, Rlimit, setrlimit};
    use rustix::thread::{CapabilitySet, capabilities, set_capabilities};
    let limit = 64 * 1024;
    setrlimit(
        Resource::Memlock,
        Rlimit {
            current: Some(limit),
            maximum: Some(limit),
        },
    )
    .expect("lower RLIMIT_MEMLOCK");
    let mut caps = capabilities(None).expect("capget");
    caps.effective.remove(CapabilitySet::IPC_LOCK);
    caps.permitted.remove(CapabilitySet::IPC_LOCK);
    set_capabilities(None, caps).expect("drop CAP_IPC_LOCK");
    assert!(!lock::has_cap_ipc_lock());

    let big = AlignedBuf::new(1 << 20, 4096).expect("alloc");
    let err = lock::mlock(&big).unwrap_err();
    match &err {
        Error::MemlockLimit {
            requested,
            soft,
            hard,
            ..
        } => {
            assert_eq!(*requested, 1 << 20);
            assert_eq!((*soft, *hard), (Some(limit), Some(limit)));
        }
        other => panic!("expected MemlockLimit, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("ulimit -l") && msg.contains("--ulimit memlock=-1"),
        "{msg}"
    );
    assert!(matches!(
        lock::check_budget(1 << 20),
        Err(Error::MemlockLimit { .. })
    ));

    // The kernel agrees: bypassing our check, mlock itself refuses.
    // SAFETY: big stays alive and mapped; mlock does not touch its contents.
    let raw = unsafe { rustix::mm::mlock(big.as_ptr() as *mut _, big.len()) };
    assert!(
        raw.is_err(),
        "the kernel allowed 1 MiB under a 64 KiB limit"
    );

    let small = AlignedBuf::new(16 * 1024, 4096).expect("alloc");
    let locked = lock::mlock(&small).expect("16 KiB fits 64 KiB");
    assert_eq!(locked.len(), 16 * 1024);
    println!("CHILD-OK {msg}");
}

#[test]
fn low_memlock_limit_is_a_clear_error() {
    let out = child::run("memlock", &[]);
    assert!(
        out.contains("CHILD-OK"),
        "child did not finish its checks:\n{out}"
    );
}

/// `check_memory`: more than the machine has available is refused, naming the bytes asked
/// for and what is available; a page is not (whatever the memlock limit, which it leaves
/// aside).
#[test]
fn check_memory_refuses_more_than_is_available() {
    let available = gpufeed_os::sys::mem_available().expect("MemAvailable on Linux");
    let err = lock::check_memory(available + (1 << 30)).unwrap_err();
    match &err {
        Error::NotEnoughMemory {
            requested,
            available: a,
            ..
        } => {
            assert!(*requested > available, "{err:?}");
            assert!(*a > 0, "{err:?}");
        }
        other => panic!("expected NotEnoughMemory, got {other:?}"),
    }
    assert!(err.to_string().contains("MemAvailable"), "{err}");
    lock::check_memory(4096).expect("one page");
}
