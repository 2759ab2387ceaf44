//! The cast kernels against their CPU reference, bit for bit: every value of the one- and
//! two-byte types, and for F32 every high half with the low halves where rounding turns
//! (ties, one either side) plus random values; each read at an aligned and at an odd address.

use gpufeed_cuda::cast::{CastKernel, CastType, can_cast, reference};

use crate::{gpu_or_skip, random_bytes};

const TYPES: [CastType; 5] = CastType::ALL;

/// The source values a test of `from` casts: little-endian elements.
fn sources(from: CastType) -> Vec<u8> {
    match from.size() {
        1 => (0..=255u8).collect(),
        2 => (0..=u16::MAX).flat_map(u16::to_le_bytes).collect(),
        _ => {
            // Where F16 and BF16 rounding turns (the low 13 and 16 bits) and around.
            let lows: [u32; 12] = [
                0, 1, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x7fff, 0x8000, 0x8001, 0xf000,
                0xffff,
            ];
            let mut out = Vec::with_capacity((1 << 16) * lows.len() * 4 + (4 << 20));
            for high in 0..=u16::MAX {
                for low in lows {
                    out.extend_from_slice(&((u32::from(high) << 16) | low).to_le_bytes());
                }
            }
            // The F16 subnormal ties are whole high halves (low 0), covered above; random
            // values for the rest.
            out.extend_from_slice(&random_bytes(4 << 20, 156));
            out
        }
    }
}

#[test]
fn every_cast_matches_its_reference_bit_for_bit_at_any_source_address() {
    let Some(gpu) =
        gpu_or_skip("every_cast_matches_its_reference_bit_for_bit_at_any_source_address")
    else {
        return;
    };
    let kernel = CastKernel::load(&gpu).expect("load the cast kernels");
    let stream = gpu.default_stream();
    for from in TYPES {
        let src = sources(from);
        let n = src.len() / from.size();
        // The source at offset 0 and at offset 1 of a buffer (odd: unaligned for 2 and 4).
        let mut padded = vec![0xA5u8; src.len() + 1];
        padded[1..].copy_from_slice(&src);
        let dev = stream.clone_htod(&padded).expect("upload");
        for to in TYPES.into_iter().filter(|&to| can_cast(from, to)) {
            let want = reference(from, to, &src).expect("reference");
            for at in [1usize, 0] {
                let mut out = stream.alloc_zeros::<u8>(n * to.size()).expect("alloc");
                // At 0 the buffer's first byte and the source's first n-1 elements shifted
                // by one byte: compare against the reference of those bytes.
                let input = &padded[at..at + n * from.size()];
                let want_here = if at == 1 {
                    want.clone()
                } else {
                    reference(from, to, input).expect("reference")
                };
                kernel
                    .launch(
                        &stream,
                        from,
                        &dev.slice(at..at + n * from.size()),
                        to,
                        &mut out.slice_mut(..),
                    )
                    .expect("launch");
                let got = stream.clone_dtoh(&out).expect("download");
                if got != want_here {
                    let i = got
                        .chunks(to.size())
                        .zip(want_here.chunks(to.size()))
                        .position(|(g, w)| g != w)
                        .expect("a difference");
                    panic!(
                        "{from} -> {to} (source at offset {at}): element {i} of {n}: {:02x?} gave {:02x?}, the reference {:02x?}",
                        &input[i * from.size()..(i + 1) * from.size()],
                        &got[i * to.size()..(i + 1) * to.size()],
                        &want_here[i * to.size()..(i + 1) * to.size()]
                    );
                }
            }
        }
    }
}

#[test]
fn casts_refuse_what_they_cannot_do_before_launching() {
    let Some(gpu) = gpu_or_skip("casts_refuse_what_they_cannot_do_before_launching") else {
        return;
    };
    let kernel = CastKernel::load(&gpu).expect("load the cast kernels");
    let stream = gpu.default_stream();
    let src = stream.clone_htod(&[0u8; 12]).expect("upload");
    let mut dst = stream.alloc_zeros::<u8>(12).expect("alloc");
    // A pair outside the table, the same type, a destination of the wrong length.
    for (from, to, len) in [
        (CastType::F32, CastType::F8E4M3, 3),
        (CastType::BF16, CastType::BF16, 12),
        (CastType::F32, CastType::F16, 5),
    ] {
        let err = kernel
            .launch(&stream, from, &src.slice(..), to, &mut dst.slice_mut(..len))
            .unwrap_err();
        assert!(
            matches!(
                err,
                gpufeed_cuda::Error::CastUnsupported { .. }
                    | gpufeed_cuda::Error::OutOfBounds { .. }
            ),
            "{from} -> {to}: {err}"
        );
    }
    // An odd destination for two-byte elements.
    let (base, _rec) =
        gpufeed_cuda::cudarc::driver::DevicePtrMut::device_ptr_mut(&mut dst, &stream);
    // SAFETY: the launch is refused before any work is queued (the destination is odd).
    let err =
        unsafe { kernel.launch_raw(&stream, CastType::F32, base, CastType::BF16, base + 1, 2) }
            .unwrap_err();
    assert!(err.to_string().contains("not aligned"), "{err}");
}

#[test]
fn pitched_casts_read_runs_and_write_them_back_to_back() {
    let Some(gpu) = gpu_or_skip("pitched_casts_read_runs_and_write_them_back_to_back") else {
        return;
    };
    let kernel = CastKernel::load(&gpu).expect("load the cast kernels");
    let stream = gpu.default_stream();
    // 37 runs of 11 elements every 29 elements' bytes + 3, from an odd address.
    let (runs, width) = (37usize, 11usize);
    for from in TYPES {
        let pitch = 29 * from.size() + 3;
        let bytes = random_bytes(1 + runs * pitch, 158 + from.size() as u64);
        let dev = stream.clone_htod(&bytes).expect("upload");
        let src: Vec<u8> = (0..runs)
            .flat_map(|r| bytes[1 + r * pitch..1 + r * pitch + width * from.size()].to_vec())
            .collect();
        for to in TYPES.into_iter().filter(|&to| can_cast(from, to)) {
            let want = reference(from, to, &src).expect("reference");
            let mut out = stream.alloc_zeros::<u8>(want.len()).expect("alloc");
            let (s, _r) = gpufeed_cuda::cudarc::driver::DevicePtr::device_ptr(&dev, &stream);
            let (d, _w) =
                gpufeed_cuda::cudarc::driver::DevicePtrMut::device_ptr_mut(&mut out, &stream);
            // SAFETY: the runs lie within `dev` (1 + runs * pitch bytes), the destination is
            // `out`, both held until the download below waits for the stream.
            unsafe {
                kernel.launch_pitched_raw(
                    &stream,
                    from,
                    s + 1,
                    pitch as u64,
                    to,
                    d,
                    runs as u64,
                    width as u64,
                )
            }
            .expect("launch");
            drop((_r, _w));
            assert_eq!(
                stream.clone_dtoh(&out).expect("download"),
                want,
                "{from} -> {to}"
            );
        }
    }
}

#[test]
fn a_cast_of_more_elements_than_one_grid_holds_loops_over_them_all() {
    let Some(gpu) = gpu_or_skip("a_cast_of_more_elements_than_one_grid_holds_loops_over_them_all")
    else {
        return;
    };
    let kernel = CastKernel::load(&gpu).expect("load the cast kernels");
    let stream = gpu.default_stream();
    // 5,000,003 F32 values: more than 8,192 blocks of 256 threads take in one pass.
    let src = random_bytes(4 * 5_000_003, 159);
    let dev = stream.clone_htod(&src).expect("upload");
    let mut out = stream.alloc_zeros::<u8>(2 * 5_000_003).expect("alloc");
    kernel
        .launch(
            &stream,
            CastType::F32,
            &dev.slice(..),
            CastType::BF16,
            &mut out.slice_mut(..),
        )
        .expect("launch");
    let want = reference(CastType::F32, CastType::BF16, &src).expect("reference");
    assert!(
        stream.clone_dtoh(&out).expect("download") == want,
        "some element differs"
    );
}
