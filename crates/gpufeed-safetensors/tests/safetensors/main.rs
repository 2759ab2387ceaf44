//! Integration tests of gpufeed-safetensors. GPU tests skip with a printed reason where no GPU is
//! usable, and fail instead when GPUFEED_REQUIRE_GPU=1 (how they run on the GPU machine).

mod into;
#[cfg(feature = "object")]
mod object;
mod prefetch;
mod sharded;

use gpufeed_load::Gpu;

/// GPU 0, or None after printing why the calling test is skipped.
#[allow(dead_code, reason = "not every test binary has GPU tests")]
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    gpufeed_testkit::opened_or_skip(test, Gpu::open(0))
}

pub use gpufeed_testkit::random_bytes;

use std::collections::HashMap;

use gpufeed_safetensors::SAVE_ID_KEY;
use safetensors::{Dtype, tensor::TensorView};

/// A safetensors file of `tensors` (name, dtype, shape; random bytes from `seed`), with a
/// save id where given; returns its bytes and each tensor's bytes.
pub fn file(
    tensors: &[(&str, Dtype, Vec<usize>)],
    seed: u64,
    save: Option<&str>,
) -> (Vec<u8>, HashMap<String, Vec<u8>>) {
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .enumerate()
        .map(|(i, (_, d, shape))| {
            random_bytes(
                shape.iter().product::<usize>() * d.bitsize() / 8,
                seed + i as u64,
            )
        })
        .collect();
    let views = tensors
        .iter()
        .zip(&data)
        .map(|((name, dtype, shape), bytes)| {
            (
                name.to_string(),
                TensorView::new(*dtype, shape.clone(), bytes).expect("view"),
            )
        });
    let metadata = save.map(|id| HashMap::from([(SAVE_ID_KEY.to_string(), id.to_string())]));
    let bytes = safetensors::serialize(views, metadata).expect("serialize");
    let by_name = tensors
        .iter()
        .zip(data)
        .map(|((n, _, _), d)| (n.to_string(), d))
        .collect();
    (bytes, by_name)
}
