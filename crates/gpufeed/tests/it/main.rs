//! Integration tests of the facade: loads, checkpoints and batches together, through the
//! paths a user of `gpufeed` takes (each capability crate has its own tests as well). GPU tests skip with a printed reason where no GPU is
//! usable, and fail instead when GPUFEED_REQUIRE_GPU=1 (how they run on the GPU machine).

mod files;
mod gpu;
mod host;
mod oneshot;
mod save;

use gpufeed::Gpu;

/// GPU 0, or None after printing why the calling test is skipped.
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    gpufeed_testkit::opened_or_skip(test, Gpu::open(0))
}

pub use gpufeed_testkit::random_bytes;
