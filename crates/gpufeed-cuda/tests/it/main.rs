//! Integration tests of gpufeed-cuda. GPU tests skip with a printed reason where no GPU is
//! usable, and fail instead when GPUFEED_REQUIRE_GPU=1 (how they run on the GPU machine).

mod cast;
mod kernels;
mod nccl;
mod no_gpu;
mod nvjpeg;
mod transfers;

use gpufeed_cuda::Gpu;

/// GPU 0, or None after printing why the calling test is skipped.
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    gpufeed_testkit::opened_or_skip(test, Gpu::open(0))
}

pub use gpufeed_testkit::random_bytes;

/// Held by the tests that measure the device's free memory, so that none of them allocates
/// gigabytes while another measures (the others' allocations are within their margins).
pub static DEVICE_MEMORY: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// [`DEVICE_MEMORY`], whatever a test that held it before did.
pub fn measuring_device_memory() -> std::sync::MutexGuard<'static, ()> {
    DEVICE_MEMORY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
