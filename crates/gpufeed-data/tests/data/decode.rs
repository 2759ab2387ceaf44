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
