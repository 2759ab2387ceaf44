//! nvJPEG on the GPU: a handle with the hardware backend where the GPU has decoder engines (an
//! H200 does), and what JPEGs of each kind are before decoding (baseline and progressive,
//! 4:4:4 / 4:2:2 / 4:2:0 / 4:4:0 / gray, restart markers), made by the `jpeg-encoder` crate;
//! bytes that are no JPEG refused with nvJPEG's status. The library itself (found, checked,
//! its version) is tested without a GPU in the crate's unit tests.

use gpufeed_cuda::nvjpeg::{Backend, Nvjpeg};
use jpeg_encoder::{ColorType, Encoder, SamplingFactor};

use crate::{gpu_or_skip, random_bytes};

/// A `width` x `height` JPEG of random pixels (or gray ones), encoded as asked.
fn jpeg(
    width: u16,
    height: u16,
    gray: bool,
    sampling: SamplingFactor,
    progressive: bool,
    restart: u16,
) -> Vec<u8> {
    let channels = if gray { 1 } else { 3 };
    let pixels = random_bytes(usize::from(width) * usize::from(height) * channels, 40);
    let mut out = Vec::new();
    let mut enc = Encoder::new(&mut out, 90);
    enc.set_sampling_factor(sampling);
    enc.set_progressive(progressive);
    enc.set_restart_interval(restart);
    let color = if gray {
        ColorType::Luma
    } else {
        ColorType::Rgb
    };
    enc.encode(&pixels, width, height, color).expect("encode");
    out
}

#[test]
fn a_handle_says_what_each_kind_of_jpeg_is() {
    let Some(gpu) = gpu_or_skip("a_handle_says_what_each_kind_of_jpeg_is") else {
        return;
    };
    let nv = match Nvjpeg::open(&gpu) {
        Ok(nv) => nv,
        // A GPU machine without nvJPEG: a failure where the GPU tests are required (the H200
        // machine has libnvjpeg.so.13).
        Err(e @ gpufeed_cuda::Error::NvjpegMissing { .. })
            if std::env::var("GPUFEED_REQUIRE_GPU").as_deref() != Ok("1") =>
        {
            eprintln!("SKIP a_handle_says_what_each_kind_of_jpeg_is: {e}");
            return;
        }
        Err(e) => panic!("nvJPEG on GPU 0: {e}"),
    };
    let cc = gpu.info().compute_capability;
    println!(
        "nvJPEG {} on {} (compute {}.{}): {:?} backend, {} hardware engines",
        gpufeed_cuda::nvjpeg_version().expect("version"),
        gpu.info().name,
        cc.0,
        cc.1,
        nv.backend(),
        nv.hardware_engines()
    );
    if gpu.info().name.contains("H200") || gpu.info().name.contains("H100") {
        assert_eq!(
            nv.backend(),
            Backend::Hardware,
            "an H100/H200 has decoder engines"
        );
        assert!(nv.hardware_engines() > 0);
    }
    // (gray, sampling, progressive, restart interval, nvJPEG's subsampling code)
    let kinds = [
        (false, SamplingFactor::R_4_4_4, false, 0, 0),
        (false, SamplingFactor::R_4_2_2, false, 0, 1),
        (false, SamplingFactor::R_4_2_0, false, 0, 2),
        (false, SamplingFactor::R_4_4_0, false, 0, 3),
        (true, SamplingFactor::R_4_4_4, false, 0, 6),
        (false, SamplingFactor::R_4_2_0, true, 0, 2),
        (false, SamplingFactor::R_4_2_0, false, 4, 2),
    ];
    for (gray, sampling, progressive, restart, code) in kinds {
        let bytes = jpeg(333, 127, gray, sampling, progressive, restart);
        let info = nv.image_info(&bytes).expect("image info");
        let what =
            format!("gray {gray}, {sampling:?}, progressive {progressive}, restart {restart}");
        assert_eq!((info.width, info.height), (333, 127), "{what}");
        assert_eq!(info.components, if gray { 1 } else { 3 }, "{what}");
        assert_eq!(info.subsampling, code, "{what}");
    }
    let err = nv.image_info(b"not a jpeg at all").unwrap_err();
    assert!(
        matches!(
            err,
            gpufeed_cuda::Error::Nvjpeg {
                op: "nvjpegGetImageInfo",
                ..
            }
        ),
        "{err}"
    );
}
