//! Integration tests of gpufeed-pinned. GPU tests skip with a printed reason where no CUDA
//! driver or device exists, and fail instead when GPUFEED_REQUIRE_GPU=1 (the GPU machine).

mod cpu_pool;
mod gpu;

use std::sync::Arc;

use gpufeed_pinned::cudarc::driver::CudaContext;

/// The context of GPU 0, or None after printing why the calling test is skipped.
pub fn gpu_or_skip(test: &str) -> Option<Arc<CudaContext>> {
    let require = std::env::var("GPUFEED_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let why = match gpufeed_pinned::driver_available() {
        Err(e) => e.to_string(),
        Ok(()) => match CudaContext::device_count() {
            Ok(n) if n > 0 => match CudaContext::new(0) {
                Ok(ctx) => return Some(ctx),
                Err(e) => format!("cannot open GPU 0: {e:?}"),
            },
            Ok(_) => "the driver reports no CUDA device".into(),
            Err(e) => format!("cuDeviceGetCount: {e:?}"),
        },
    };
    assert!(!require, "{test}: GPUFEED_REQUIRE_GPU=1 but no GPU: {why}");
    eprintln!("SKIP {test}: {why}");
    None
}

/// Deterministic random bytes (splitmix64).
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
