//! Batches of JPEGs decoded: on the CPU (`decode_on_cpu`, every machine) and into device
//! memory (`ImageDecoder`: nvJPEG, the CPU decoder for what it refuses) against the CPU's
//! decode of the same bytes; bad images by policy, with their names.

use gpufeed_data::{
    DecodedWith, Error, ImageDecoder, ImageError, OnBadImage, decode_jpeg, decode_on_cpu,
};

use crate::gpu_or_skip;
use crate::images::{KINDS, jpeg, psnr};

/// A batch of every kind at two sizes, and bad images among them: (bytes, bad or not).
fn batch() -> Vec<(Vec<u8>, bool)> {
    let mut out = Vec::new();
    for (k, kind) in KINDS.iter().enumerate() {
        let (w, h) = if k % 2 == 0 { (500, 375) } else { (37, 51) };
        out.push((jpeg(w, h, *kind).0, false));
    }
    let good = out[0].0.clone();
    out.insert(3, (good[..good.len() / 2].to_vec(), true)); // truncated
    out.insert(7, (b"\x89PNG\r\n\x1a\nnot a jpeg".to_vec(), true));
    out.push((Vec::new(), true));
    out
}

fn name(i: usize) -> String {
    format!("image-{i}.jpg")
}

#[test]
fn a_batch_decodes_on_the_cpu_image_by_image_and_bad_ones_follow_the_policy() {
    let all = batch();
    let jpegs: Vec<&[u8]> = all.iter().map(|(b, _)| b.as_slice()).collect();
    let err = decode_on_cpu(&jpegs, &name, OnBadImage::Error).unwrap_err();
    match &err {
        Error::Image {
            name,
            reason: ImageError::Truncated { .. },
        } => assert_eq!(name, "image-3.jpg"),
        other => panic!("the first bad image, by index: {other}"),
    }
    assert!(
        err.to_string().starts_with("image-3.jpg: truncated JPEG"),
        "{err}"
    );
    let (images, skipped) = decode_on_cpu(&jpegs, &name, OnBadImage::Skip).expect("skip");
    let skipped_names: Vec<&str> = skipped.iter().map(|s| s.name.as_str()).collect();
    let bad: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, (_, bad))| *bad)
        .map(|(i, _)| name(i))
        .collect();
    assert_eq!(skipped_names, bad);
    assert!(matches!(
        skipped[1].reason,
        ImageError::NotJpeg {
            format: Some("PNG"),
            ..
        }
    ));
    for (i, ((bytes, is_bad), image)) in all.iter().zip(&images).enumerate() {
        match image {
            None => assert!(is_bad, "image {i} skipped"),
            Some(image) => {
                assert!(!is_bad, "image {i} decoded");
                assert_eq!(image, &decode_jpeg(bytes).expect("alone"), "image {i}");
            }
        }
    }
    let (none, skipped) = decode_on_cpu(&[], &name, OnBadImage::Error).expect("empty");
    assert!(none.is_empty() && skipped.is_empty());
}

#[test]
fn a_batch_decodes_into_device_memory_as_the_cpu_decodes_it() {
    let Some(gpu) = gpu_or_skip("a_batch_decodes_into_device_memory_as_the_cpu_decodes_it") else {
        return;
    };
    let mut decoder = ImageDecoder::open(&gpu).expect("a decoder");
    if std::env::var("GPUFEED_REQUIRE_GPU").as_deref() == Ok("1") {
        assert!(decoder.cpu_only().is_none(), "{:?}", decoder.cpu_only());
    }
    let all = batch();
    let jpegs: Vec<&[u8]> = all.iter().map(|(b, _)| b.as_slice()).collect();
    let err = decoder
        .decode(&jpegs, &name, OnBadImage::Error)
        .unwrap_err();
    assert!(
        err.to_string().starts_with("image-3.jpg: truncated JPEG"),
        "{err}"
    );
    let got = decoder
        .decode(&jpegs, &name, OnBadImage::Skip)
        .expect("skip");
    assert_eq!(got.skipped.len(), all.iter().filter(|(_, b)| *b).count());
    let stream = gpu.default_stream();
    let host = stream
        .clone_dtoh(got.buffer.as_ref().expect("a buffer"))
        .expect("download");
    let mut with = std::collections::BTreeMap::new();
    for (i, ((bytes, is_bad), image)) in all.iter().zip(&got.images).enumerate() {
        let Some((slot, by)) = image else {
            assert!(is_bad, "image {i} skipped");
            continue;
        };
        assert!(!is_bad, "image {i} decoded");
        assert_eq!(slot.offset % 256, 0, "image {i}: offset {}", slot.offset);
        *with.entry(format!("{by:?}")).or_insert(0) += 1;
        let cpu = decode_jpeg(bytes).expect("the CPU's");
        assert_eq!(
            (slot.width, slot.height),
            (cpu.width, cpu.height),
            "image {i}"
        );
        let mine = &host[slot.offset..slot.offset + slot.span()];
        let quality = psnr(mine, &cpu.pixels);
        assert!(
            quality >= 40.0,
            "image {i} ({by:?}): {quality:.1} dB against the CPU's"
        );
        if *by == DecodedWith::Cpu {
            assert_eq!(
                mine,
                cpu.pixels.as_slice(),
                "image {i}: the CPU's decode uploaded"
            );
        }
    }
    println!("decoded with {with:?}; skipped {:?}", got.skipped);
    if decoder.cpu_only().is_none() {
        // nvJPEG decodes every kind here but the progressive ones, which it refuses (run 164).
        for (i, image) in got.images.iter().enumerate() {
            if let Some((_, by)) = image {
                let progressive = gpufeed_cuda::nvjpeg::is_progressive(&all[i].0);
                assert_eq!(*by == DecodedWith::Cpu, progressive, "image {i}: {by:?}");
            }
        }
    }
}

#[test]
fn crops_resized_on_the_gpu_equal_the_cpu_reference() {
    use gpufeed_cuda::resize::{ResizeJob, ResizeKernel, ResizeOutput};
    use gpufeed_data::{Crop, normalize_chw, random_resized_crop, resize_crop, to_u8};

    let Some(gpu) = gpu_or_skip("crops_resized_on_the_gpu_equal_the_cpu_reference") else {
        return;
    };
    let kernel = ResizeKernel::load(&gpu).expect("the resize kernels");
    let stream = gpu.default_stream();
    // Images of several sizes (a 1x1 and a 3-wide among them), back to back with a pitch of a
    // row plus 5 bytes, random pixels.
    let sizes = [
        (500u32, 375u32),
        (37, 51),
        (3, 200),
        (1, 1),
        (224, 224),
        (640, 480),
    ];
    let mut host = Vec::new();
    let mut placed = Vec::new();
    for (k, &(w, h)) in sizes.iter().enumerate() {
        let pitch = 3 * w as usize + 5;
        let pixels = crate::random_bytes(3 * (w * h) as usize, 50 + k as u64);
        placed.push((host.len(), pitch, pixels.clone()));
        for row in pixels.chunks(3 * w as usize) {
            host.extend_from_slice(row);
            host.extend_from_slice(&[0xEE; 5]);
        }
    }
    let src = stream.clone_htod(&host).expect("upload");
    let (base, _read) = gpufeed_cuda::cudarc::driver::DevicePtr::device_ptr(&src, &stream);
    let (ow, oh) = (224u32, 160u32);
    let mut jobs = Vec::new();
    let mut want_u8 = Vec::new();
    let mut want_f32 = Vec::new();
    let (mean, std) = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
    for (k, (&(w, h), (at, pitch, pixels))) in sizes.iter().zip(&placed).enumerate() {
        let crop = if k % 2 == 0 {
            random_resized_crop(w, h, (0.08, 1.0), (0.75, 4.0 / 3.0), 5, 0, k as u64).expect("crop")
        } else {
            Crop {
                x: 0,
                y: 0,
                width: w,
                height: h,
            }
        };
        let flip = k % 3 == 1;
        jobs.push(ResizeJob {
            src: base + *at as u64,
            pitch: *pitch,
            width: w,
            height: h,
            crop: (crop.x, crop.y, crop.width, crop.height),
            flip,
        });
        let values = resize_crop(pixels, w, h, crop, ow, oh, flip).expect("reference");
        want_u8.extend(to_u8(&values));
        want_f32.extend(normalize_chw(&values, ow, oh, mean, std).expect("normalize"));
    }
    let n = jobs.len() * (3 * ow * oh) as usize;
    let mut out_u8 = stream.alloc_zeros::<u8>(n).expect("alloc");
    let mut out_f32 = stream.alloc_zeros::<f32>(n).expect("alloc");
    {
        let (d8, _w8) =
            gpufeed_cuda::cudarc::driver::DevicePtrMut::device_ptr_mut(&mut out_u8, &stream);
        let (d32, _w32) =
            gpufeed_cuda::cudarc::driver::DevicePtrMut::device_ptr_mut(&mut out_f32, &stream);
        // SAFETY: the jobs' pixels are `src`'s (alive past the synchronization below), the
        // outputs hold every image.
        unsafe {
            kernel
                .launch_raw(&stream, &jobs, ow, oh, ResizeOutput::U8Hwc(d8))
                .expect("u8");
            kernel
                .launch_raw(
                    &stream,
                    &jobs,
                    ow,
                    oh,
                    ResizeOutput::F32Chw {
                        dst: d32,
                        mean,
                        std,
                    },
                )
                .expect("f32");
        }
    }
    let got_u8 = stream.clone_dtoh(&out_u8).expect("download");
    let got_f32 = stream.clone_dtoh(&out_f32).expect("download");
    let per = (3 * ow * oh) as usize;
    for k in 0..jobs.len() {
        let (g, w) = (
            &got_u8[k * per..(k + 1) * per],
            &want_u8[k * per..(k + 1) * per],
        );
        let worst = g
            .iter()
            .zip(w)
            .map(|(&a, &b)| a.abs_diff(b))
            .max()
            .unwrap_or(0);
        let off = g.iter().zip(w).filter(|(a, b)| a != b).count();
        println!(
            "image {k} {:?}: u8 max {worst}, {off} of {per} differ",
            jobs[k].crop
        );
        assert!(worst <= 1, "image {k}: u8 values {worst} apart");
        assert!(off * 100 <= per, "image {k}: {off} of {per} differ");
        let (g, w) = (
            &got_f32[k * per..(k + 1) * per],
            &want_f32[k * per..(k + 1) * per],
        );
        let worst = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-3, "image {k}: f32 values {worst} apart");
    }
    // A crop outside its image is refused before anything is queued.
    let mut bad = jobs[0];
    bad.crop = (490, 0, 20, 10);
    // SAFETY: refused before any launch.
    let err = unsafe { kernel.launch_raw(&stream, &[bad], ow, oh, ResizeOutput::U8Hwc(0)) };
    assert!(err.is_err());
}
