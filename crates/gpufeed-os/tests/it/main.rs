//! Integration tests of gpufeed-os: real files, real shared memory, real child processes.

mod advise_cache;
mod align;
mod atomic;
mod child;
mod file;
mod liveness;
mod lock;
mod map;
mod pidns;
mod shm;
mod sys;
mod userns;

/// Held by every test that locks memory, so that `VmLck` readings are not disturbed by
/// another test locking at the same time.
pub static MLOCK_SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Serialises tests that lock memory (a panicking holder does not poison the others).
pub fn mlock_serial() -> std::sync::MutexGuard<'static, ()> {
    MLOCK_SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A name prefix unique to this test run, for segments in the real /dev/shm.
pub fn unique_prefix(tag: &str) -> String {
    let mut r = [0u8; 4];
    rustix::rand::getrandom(&mut r, rustix::rand::GetRandomFlags::empty()).expect("getrandom");
    format!(
        "gpufeedit{tag}{}x{:08x}",
        std::process::id(),
        u32::from_ne_bytes(r)
    )
}

pub use gpufeed_testkit::{random_bytes, seed};
