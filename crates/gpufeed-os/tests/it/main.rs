//! Integration tests of gpufeed-os: real files, real shared memory, real child processes.

mod advise_cache;
mod align;
mod child;
mod lock;
mod map;
mod shm;
mod sys;

/// Held by every test that locks memory, so that `VmLck` readings are not disturbed by
/// another test locking at the same time.
pub static MLOCK_SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Serialises tests that lock memory (a panicking holder does not poison the others).
pub fn mlock_serial() -> std::sync::MutexGuard<'static, ()> {
    MLOCK_SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Deterministic pseudo-random bytes (splitmix64), never all zeros.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A seed that differs between runs, printed so a failure can be replayed.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var("GPUFEED_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("{test}: seed {seed} (replay with GPUFEED_TEST_SEED={seed})");
    seed
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
