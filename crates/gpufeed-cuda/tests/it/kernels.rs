//! The planar kernel against its CPU form, on random pixels of an odd count, one image and
//! a batch of them.

use gpufeed_cuda::kernels::PlanarKernel;

use crate::{gpu_or_skip, random_bytes};

#[test]
fn planar_kernel_matches_the_cpu_bit_for_bit() {
    let Some(gpu) = gpu_or_skip("planar_kernel_matches_the_cpu_bit_for_bit") else {
        return;
    };
    let kernel = PlanarKernel::load(&gpu).expect("load the kernel");
    let stream = gpu.default_stream();
    // 1001 x 333 pixels: not a multiple of the block, bytes not a multiple of 4.
    let pixels = 1001 * 333;
    let rgb = random_bytes(3 * pixels, 21);
    let src = stream.clone_htod(&rgb).expect("upload");
    let mut dst = stream.alloc_zeros::<f32>(3 * pixels).expect("alloc");
    kernel
        .launch(&stream, &src, &mut dst, pixels as u32)
        .expect("launch");
    let got = stream.clone_dtoh(&dst).expect("download");
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        for (c, &b) in px.iter().enumerate() {
            let want = f32::from(b) / 255.0;
            assert_eq!(
                got[c * pixels + i].to_bits(),
                want.to_bits(),
                "pixel {i} channel {c}"
            );
        }
    }
    // Three images of 37 x 5 pixels in one launch: each image's planes after the previous's.
    let (per, images) = (37 * 5, 3);
    let rgb = random_bytes(3 * per * images, 22);
    let src_b = stream.clone_htod(&rgb).expect("upload");
    let mut dst_b = stream.alloc_zeros::<f32>(3 * per * images).expect("alloc");
    kernel
        .launch_images(&stream, &src_b, &mut dst_b, per as u32, images as u32)
        .expect("launch images");
    let got = stream.clone_dtoh(&dst_b).expect("download");
    for img in 0..images {
        for p in 0..per {
            for c in 0..3 {
                let want = f32::from(rgb[3 * per * img + 3 * p + c]) / 255.0;
                assert_eq!(
                    got[3 * per * img + c * per + p].to_bits(),
                    want.to_bits(),
                    "image {img} pixel {p} channel {c}"
                );
            }
        }
    }
    // Too short a destination is an error, not a write past its end.
    let mut small = stream.alloc_zeros::<f32>(10).expect("alloc");
    let err = kernel
        .launch(&stream, &src, &mut small, pixels as u32)
        .unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
}
