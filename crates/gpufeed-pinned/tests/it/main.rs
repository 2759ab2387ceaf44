//! Integration tests of gpufeed-pinned. GPU tests skip with a printed reason where no CUDA
//! driver or device exists, and fail instead when GPUFEED_REQUIRE_GPU=1 (the GPU machine).

mod cpu_pool;
mod gpu;

use std::sync::Arc;

use gpufeed_pinned::cudarc::driver::CudaContext;

/// The context of GPU 0, or None after printing why the calling test is skipped.
pub fn gpu_or_skip(test: &str) -> Option<Arc<CudaContext>> {
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
    gpufeed_testkit::skip_without_gpu(test, &why);
    None
}

pub use gpufeed_testkit::random_bytes;
