//! Integration tests of the facade. GPU tests skip with a printed reason where no GPU is
//! usable, and fail instead when GPUFEED_REQUIRE_GPU=1 (how they run on the GPU machine).

mod gpu;
mod host;
mod workers;

use gpufeed::Gpu;

/// GPU 0, or None after printing why the calling test is skipped.
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(gpu) => Some(gpu),
        Err(e) => {
            gpufeed_testkit::skip_without_gpu(test, &e);
            None
        }
    }
}

pub use gpufeed_testkit::random_bytes;
