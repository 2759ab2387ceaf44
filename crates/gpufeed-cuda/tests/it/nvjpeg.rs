//! nvJPEG on the GPU: a handle with the hardware backend where the GPU has decoder engines (an
//! H200 does), and what JPEGs of each kind are before decoding (baseline and progressive,
//! 4:4:4 / 4:2:2 / 4:2:0 / 4:4:0 / gray, restart markers), made by the `jpeg-encoder` crate;
//! bytes that are no JPEG refused with nvJPEG's status. The library itself (found, checked,
//! its version) is tested without a GPU in the crate's unit tests.

use gpufeed_cuda::nvjpeg::{Backend, DecodedBy, Nvjpeg, Slot};
use jpeg_encoder::{ColorType, Encoder, SamplingFactor};

use crate::{gpu_or_skip, random_bytes};

/// nvJPEG on `gpu`, or `None` (the skip printed) on a GPU machine without nvJPEG — a failure
/// where the GPU tests are required (the H200 machine has libnvjpeg.so.13).
fn nvjpeg_or_skip(gpu: &gpufeed_cuda::Gpu, test: &str) -> Option<Nvjpeg> {
    match Nvjpeg::open(gpu) {
        Ok(nv) => Some(nv),
        Err(e @ gpufeed_cuda::Error::NvjpegMissing { .. })
            if std::env::var("GPUFEED_REQUIRE_GPU").as_deref() != Ok("1") =>
        {
            eprintln!("SKIP {test}: {e}");
            None
        }
        Err(e) => panic!("nvJPEG on GPU 0: {e}"),
    }
}

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
    let kind = (gray, sampling, progressive, restart);
    encode(&pixels, width, height, 90, kind)
}

/// `pixels` (gray or RGB) encoded at `quality` as `(gray, sampling, progressive, restart)`.
fn encode(
    pixels: &[u8],
    width: u16,
    height: u16,
    quality: u8,
    (gray, sampling, progressive, restart): (bool, SamplingFactor, bool, u16),
) -> Vec<u8> {
    let mut out = Vec::new();
    let mut enc = Encoder::new(&mut out, quality);
    enc.set_sampling_factor(sampling);
    enc.set_progressive(progressive);
    enc.set_restart_interval(restart);
    let color = if gray {
        ColorType::Luma
    } else {
        ColorType::Rgb
    };
    enc.encode(pixels, width, height, color).expect("encode");
    out
}

#[test]
fn a_handle_says_what_each_kind_of_jpeg_is() {
    let Some(gpu) = gpu_or_skip("a_handle_says_what_each_kind_of_jpeg_is") else {
        return;
    };
    let Some(nv) = nvjpeg_or_skip(&gpu, "a_handle_says_what_each_kind_of_jpeg_is") else {
        return;
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

/// A `width` x `height` photo-like image (smooth gradients, a little noise) as RGB or gray,
/// JPEG-encoded as asked (quality 92), with its pixels.
fn photo(
    width: u16,
    height: u16,
    gray: bool,
    sampling: SamplingFactor,
    progressive: bool,
    restart: u16,
) -> (Vec<u8>, Vec<u8>) {
    let (w, h) = (usize::from(width), usize::from(height));
    let noise = random_bytes(w * h, 41);
    let mut pixels = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            let n = i32::from(noise[y * w + x] % 9) - 4;
            let r = (x * 255 / w.max(1)) as i32 + n;
            let g = (y * 255 / h.max(1)) as i32 + n;
            let b = ((x + y) * 127 / (w + h).max(1)) as i32 + 60 + n;
            let rgb = [r, g, b].map(|v| v.clamp(0, 255) as u8);
            if gray {
                pixels.push(rgb[0] / 2 + rgb[1] / 2);
            } else {
                pixels.extend_from_slice(&rgb);
            }
        }
    }
    let out = encode(
        &pixels,
        width,
        height,
        92,
        (gray, sampling, progressive, restart),
    );
    (out, pixels)
}

/// PSNR of decoded RGB against the source (gray sources expanded to R = G = B).
fn psnr(rgb: &[u8], source: &[u8], gray: bool) -> f64 {
    let mut sum = 0f64;
    for (i, &v) in rgb.iter().enumerate() {
        let want = if gray { source[i / 3] } else { source[i] };
        let d = f64::from(v) - f64::from(want);
        sum += d * d;
    }
    let mse = sum / rgb.len() as f64;
    10.0 * (255.0f64 * 255.0 / mse.max(1e-9)).log10()
}

#[test]
fn a_batch_of_every_kind_decodes_into_its_slots_and_bad_ones_are_refused_alone() {
    let Some(gpu) = gpu_or_skip("a_batch_of_every_kind_decodes_into_its_slots") else {
        return;
    };
    let Some(nv) = nvjpeg_or_skip(&gpu, "a_batch_of_every_kind_decodes_into_its_slots") else {
        return;
    };
    every_kind(&gpu, nv);
}

/// The same batch through a handle opened for nvJPEG's CUDA decoder (batched, Huffman decoding
/// on the GPU) on a GPU that has engines: every image it takes is decoded by it.
#[test]
fn the_cuda_decoder_decodes_a_batch_of_every_kind_beside_the_engines() {
    let test = "the_cuda_decoder_decodes_a_batch_of_every_kind_beside_the_engines";
    let Some(gpu) = gpu_or_skip(test) else {
        return;
    };
    if nvjpeg_or_skip(&gpu, test).is_none() {
        return;
    }
    let nv = Nvjpeg::open_with(&gpu, Backend::Cuda).expect("a CUDA decoder handle");
    assert_eq!(nv.backend(), Backend::Cuda);
    assert_eq!(nv.hardware_engines(), 0);
    every_kind(&gpu, nv);
}

/// Baseline, progressive, every subsampling, restart markers, gray and bad ones in one batch
/// through `nv`, each image checked in its slot and alone.
fn every_kind(gpu: &gpufeed_cuda::Gpu, mut nv: Nvjpeg) {
    // (size, gray, sampling, progressive, restart)
    let kinds = [
        ((500, 375), false, SamplingFactor::R_4_2_0, false, 0),
        ((333, 127), false, SamplingFactor::R_4_4_4, false, 0),
        ((37, 51), false, SamplingFactor::R_4_2_2, false, 0),
        ((64, 48), false, SamplingFactor::R_4_4_0, false, 0),
        ((129, 65), true, SamplingFactor::R_4_4_4, false, 0),
        ((200, 150), false, SamplingFactor::R_4_2_0, true, 0),
        ((211, 99), false, SamplingFactor::R_4_2_0, false, 3),
        ((96, 80), false, SamplingFactor::R_4_1_1, false, 0),
        ((1, 1), false, SamplingFactor::R_4_2_0, false, 0),
    ];
    let mut jpegs: Vec<Vec<u8>> = Vec::new();
    let mut sources = Vec::new();
    for &((w, h), gray, sampling, progressive, restart) in &kinds {
        let (bytes, pixels) = photo(w, h, gray, sampling, progressive, restart);
        jpegs.push(bytes);
        sources.push((pixels, gray));
    }
    // Bad ones among them: bytes that are no JPEG, a truncated JPEG, a CMYK JPEG.
    let mut truncated = jpegs[0].clone();
    truncated.truncate(truncated.len() / 3);
    let cmyk = {
        let mut out = Vec::new();
        let pixels = random_bytes(16 * 16 * 4, 42);
        Encoder::new(&mut out, 90)
            .encode(&pixels, 16, 16, ColorType::Cmyk)
            .expect("encode CMYK");
        out
    };
    let bad: [(&[u8], &str); 3] = [
        (b"\x89PNG\r\n\x1a\n not a jpeg", "no JPEG"),
        (&truncated, "truncated"),
        (&cmyk, "CMYK"),
    ];
    // Slots back to back with 7 bytes between (odd offsets), pitch of a row plus 5 bytes.
    let mut slots = Vec::new();
    let mut at = 7usize;
    let all: Vec<&[u8]> = jpegs
        .iter()
        .map(Vec::as_slice)
        .chain(bad.iter().map(|(b, _)| *b))
        .collect();
    for jpeg in &all {
        let (w, h) = match nv.image_info(jpeg) {
            Ok(info) => (info.width, info.height),
            Err(_) => (1, 1), // no size: a slot of one pixel, never written
        };
        let slot = Slot {
            offset: at,
            pitch: 3 * w as usize + 5,
            width: w,
            height: h,
        };
        at += slot.span() + 7;
        slots.push(slot);
    }
    let stream = gpu.default_stream();
    let fill = vec![0x5Au8; at];
    let mut dst = stream.clone_htod(&fill).expect("upload");
    let outcomes = nv
        .decode_batch(&all, &mut dst.slice_mut(..), &slots, &stream)
        .expect("the batch");
    let got = stream.clone_dtoh(&dst).expect("download");
    let cc = gpu.info().compute_capability;
    println!(
        "{} (compute {}.{}), {:?} backend",
        gpu.info().name,
        cc.0,
        cc.1,
        nv.backend()
    );
    for (i, &((w, h), gray, sampling, progressive, restart)) in kinds.iter().enumerate() {
        let what =
            format!("{w}x{h} gray {gray} {sampling:?} progressive {progressive} restart {restart}");
        let slot = slots[i];
        if progressive {
            // Refused, for the caller's CPU decoder (run 164), its slot untouched.
            assert!(
                matches!(&outcomes[i], Err(gpufeed_cuda::Error::JpegRefused { reason }) if reason.starts_with("progressive")),
                "{what}: {:?}",
                outcomes[i]
            );
            assert!(
                got[slot.offset..slot.offset + slot.span()]
                    .iter()
                    .all(|&b| b == 0x5A),
                "{what}: its slot was written"
            );
            continue;
        }
        let by = outcomes[i]
            .as_ref()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let mut rgb = Vec::new();
        for row in 0..slot.height as usize {
            let start = slot.offset + row * slot.pitch;
            rgb.extend_from_slice(&got[start..start + 3 * slot.width as usize]);
            // the pitch's padding untouched
            assert!(
                got[start + 3 * slot.width as usize..start + slot.pitch]
                    .iter()
                    .all(|&b| b == 0x5A),
                "{what}: row {row}'s padding written"
            );
        }
        let (source, gray_source) = &sources[i];
        let quality = psnr(&rgb, source, *gray_source);
        println!("{what}: {by:?}, PSNR {quality:.1} dB");
        if (w, h) != (1, 1) {
            assert!(quality >= 30.0, "{what}: PSNR {quality:.1} dB");
        }
        if *gray_source {
            assert!(
                rgb.chunks(3).all(|p| p[0] == p[1] && p[1] == p[2]),
                "{what}: gray not R = G = B"
            );
        }
        // The same image alone decodes to the same bytes.
        let alone = Slot::packed(0, slot.width, slot.height);
        let mut one = stream.alloc_zeros::<u8>(alone.span()).expect("alloc");
        let single = nv
            .decode_batch(&[all[i]], &mut one.slice_mut(..), &[alone], &stream)
            .expect("alone");
        assert_eq!(single[0].as_ref().ok(), Some(by), "{what}: alone");
        assert_eq!(
            stream.clone_dtoh(&one).expect("download"),
            rgb,
            "{what}: alone"
        );
        if nv.backend() == Backend::Hardware && !progressive && sampling != SamplingFactor::R_4_1_1
        {
            assert_eq!(*by, DecodedBy::Hardware, "{what}");
        }
        if nv.backend() == Backend::Cuda {
            assert_eq!(*by, DecodedBy::Cuda, "{what}");
        }
    }
    for (k, (_, what)) in bad.iter().enumerate() {
        let i = kinds.len() + k;
        assert!(outcomes[i].is_err(), "{what}: decoded");
        println!("{what}: {}", outcomes[i].as_ref().unwrap_err());
        let slot = slots[i];
        assert!(
            got[slot.offset..slot.offset + slot.span()]
                .iter()
                .all(|&b| b == 0x5A),
            "{what}: its slot was written"
        );
    }
    assert!(matches!(
        outcomes[kinds.len() + 2],
        Err(gpufeed_cuda::Error::JpegRefused { .. })
    ));
    // Between the slots nothing was written.
    let mut covered = vec![false; at];
    for s in &slots {
        covered[s.offset..s.offset + s.span()].fill(true);
    }
    assert!(
        got.iter().zip(&covered).all(|(&b, &c)| c || b == 0x5A),
        "bytes outside every slot written"
    );
    // A slot of another size than the image: that image's refusal (the batch decodes on).
    let info = nv.image_info(&jpegs[1]).expect("info");
    let outcomes = nv
        .decode_batch(
            &[&jpegs[1]],
            &mut dst.slice_mut(..),
            &[Slot::packed(0, info.width + 1, info.height)],
            &stream,
        )
        .expect("a per-image refusal, not the batch's");
    assert!(
        matches!(&outcomes[..], [Err(gpufeed_cuda::Error::JpegRefused { reason })] if reason.contains("slot")),
        "{outcomes:?}"
    );
    // One past the end, a short pitch: the batch refused before decoding.
    let wrong = [
        Slot::packed(at, info.width, info.height),
        Slot {
            pitch: 3 * info.width as usize - 1,
            ..Slot::packed(0, info.width, info.height)
        },
    ];
    for slot in wrong {
        let err = nv
            .decode_batch(&[&jpegs[1]], &mut dst.slice_mut(..), &[slot], &stream)
            .unwrap_err();
        assert!(
            matches!(err, gpufeed_cuda::Error::JpegSlot { index: 0, .. }),
            "{slot:?}: {err}"
        );
    }
    let err = nv
        .decode_batch(&[&jpegs[1]], &mut dst.slice_mut(..), &[], &stream)
        .unwrap_err();
    assert!(matches!(err, gpufeed_cuda::Error::JpegSlot { .. }), "{err}");
}
