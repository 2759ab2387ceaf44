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

/// `gather_spans`: spans of awkward lengths from a 16-aligned source (vector loads) and from an
/// unaligned one (byte loads), landing at aligned and unaligned offsets, one longer than a
/// block's 64 KiB and one longer than two; the bytes between them left as they were; a span
/// past the destination's end refused before anything runs.
#[test]
fn span_kernel_lands_every_span_at_its_offset() {
    use gpufeed_cuda::cudarc::driver::DevicePtr;
    use gpufeed_cuda::kernels::{GatherKernel, Span};
    let Some(gpu) = gpu_or_skip("span_kernel_lands_every_span_at_its_offset") else {
        return;
    };
    let seed = gpufeed_testkit::seed("span_kernel_lands_every_span_at_its_offset");
    let kernel = GatherKernel::load(&gpu).expect("load the kernel");
    let stream = gpu.default_stream();
    // The source: random bytes, 16 spare at the end (aligned spans may read up to their
    // length rounded up to 16).
    let src_bytes = random_bytes(300_000 + 16, seed);
    let src = stream.clone_htod(&src_bytes).expect("upload");
    let base = src.device_ptr(&stream).0;
    // (source offset, length, destination offset).
    let pieces: [(u64, u64, u64); 10] = [
        (0, 16, 0),
        (16, 1, 16),
        (4096, 4097, 17),
        (3, 100, 4200),             // unaligned source: byte loads
        (8192, 65_537, 4304),       // two blocks, 16-aligned destination
        (7, 70_001, 69_900),        // unaligned source over two blocks
        (81_920, 0, 140_000),       // empty
        (90_000, 150_003, 140_001), // three blocks, unaligned destination
        (31, 15, 290_100),
        (64, 48, 290_200),
    ];
    let spans: Vec<Span> = pieces
        .iter()
        .map(|&(s, len, offset)| Span {
            src: base + s,
            len,
            offset,
        })
        .collect();
    let table_bytes: Vec<u8> = spans.iter().flat_map(|s| s.to_ne_bytes()).collect();
    let table = stream.clone_htod(&table_bytes).expect("upload the table");
    let table_ptr = table.device_ptr(&stream).0 as *const u64;
    let fill = 0xA5u8;
    let mut dst = stream.clone_htod(&vec![fill; 290_300]).expect("alloc");
    // SAFETY: the table and every source are device memory of this context, alive until the
    // stream is synchronized below; aligned sources have 16 readable bytes to spare.
    unsafe { kernel.launch_spans(&stream, table_ptr, &spans, &mut dst) }.expect("launch");
    let got = stream.clone_dtoh(&dst).expect("download");
    let mut want = vec![fill; 290_300];
    for &(s, len, offset) in &pieces {
        let (s, len, offset) = (s as usize, len as usize, offset as usize);
        want[offset..offset + len].copy_from_slice(&src_bytes[s..s + len]);
    }
    for (k, &(_, len, offset)) in pieces.iter().enumerate() {
        let (len, offset) = (len as usize, offset as usize);
        assert!(
            got[offset..offset + len] == want[offset..offset + len],
            "span {k} ({len} bytes at {offset}; seed {seed})"
        );
    }
    assert!(got == want, "bytes outside the spans changed (seed {seed})");
    // Past the end: refused, the destination untouched.
    let past = [Span {
        src: base,
        len: 20,
        offset: 290_290,
    }];
    // SAFETY: refused before any launch (the check is the point of the test).
    let err = unsafe { kernel.launch_spans(&stream, table_ptr, &past, &mut dst) }.unwrap_err();
    assert!(
        matches!(err, gpufeed_cuda::Error::OutOfBounds { .. }),
        "{err:?}"
    );
    assert!(stream.clone_dtoh(&dst).expect("download") == want);
}
