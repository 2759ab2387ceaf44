//! Integration tests of gpufeed-load. GPU tests skip with a printed reason where no GPU is
//! usable, and fail instead when GPUFEED_REQUIRE_GPU=1 (how they run on the GPU machine).

mod gds;
#[cfg(feature = "object")]
mod object;
#[cfg(feature = "object")]
mod object_cache;
mod opened;
mod parts;
mod registered;

use gpufeed_load::Gpu;

/// GPU 0, or None after printing why the calling test is skipped.
#[allow(dead_code, reason = "not every test binary has GPU tests")]
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    gpufeed_testkit::opened_or_skip(test, Gpu::open(0))
}

pub use gpufeed_testkit::random_bytes;
