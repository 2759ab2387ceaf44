//! Integration tests of the facade. GPU tests skip with a printed reason where no GPU is
//! usable, and fail instead when GPUFEED_REQUIRE_GPU=1 (how they run on the GPU machine).

mod gpu;
mod host;
mod workers;

use gpufeed::Gpu;

/// GPU 0, or None after printing why the calling test is skipped.
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    let require = std::env::var("GPUFEED_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            assert!(!require, "{test}: GPUFEED_REQUIRE_GPU=1 but no GPU: {e}");
            eprintln!("SKIP {test}: {e}");
            None
        }
    }
}

/// Deterministic random bytes (splitmix64).
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut state = seed;
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        c.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    for (i, b) in chunks.into_remainder().iter_mut().enumerate() {
        *b = (seed as u8).wrapping_add(i as u8) | 1;
    }
    out
}
