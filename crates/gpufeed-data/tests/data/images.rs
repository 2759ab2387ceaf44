//! JPEG decoding on the CPU (`decode_jpeg`, `jpeg_header`): JPEGs of every kind `jpeg-encoder`
//! makes (4:4:4, 4:2:2, 4:2:0, 4:4:0, gray, progressive, restart markers) at odd sizes, from
//! photo-like pixels, decoded to what an independent decoder (`jpeg-decoder`) gives and close
//! to the source; the subsamplings zune-jpeg 0.5.15 gets wrong (4:1:1, 4:1:0, 4:2:1, 4:4:1)
//! refused, as are bad bytes (truncated at every length, CMYK, other formats, random); corrupt
//! data never panics; an EXIF orientation is noted and not applied (the pixels as stored, as
//! PIL's `Image.open` and torchvision's `decode_jpeg` give them by default).

use gpufeed_data::{ImageError, JpegHeader, decode_jpeg, decode_jpeg_into, jpeg_header};
use jpeg_encoder::{ColorType, Encoder, SamplingFactor};

use crate::random_bytes;

/// A `width` x `height` photo-like image: smooth gradients and a soft blob, plus a little
/// noise (seeded), as RGB or (`gray`) one byte a pixel.
fn photo(width: u16, height: u16, gray: bool, seed: u64) -> Vec<u8> {
    let (w, h) = (usize::from(width), usize::from(height));
    let noise = random_bytes(w * h * 3, seed);
    let mut pixels = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            let (fx, fy) = (x as f64 / w as f64, y as f64 / h as f64);
            let blob = 90.0 * (-((fx - 0.6).powi(2) + (fy - 0.4).powi(2)) * 12.0).exp();
            let base = [
                40.0 + 150.0 * fx + blob,
                30.0 + 170.0 * fy,
                200.0 - 120.0 * (fx + fy) / 2.0 + blob / 2.0,
            ];
            let rgb: Vec<u8> = base
                .iter()
                .enumerate()
                .map(|(c, v)| {
                    let n = f64::from(noise[(y * w + x) * 3 + c] % 9) - 4.0;
                    (v + n).clamp(0.0, 255.0) as u8
                })
                .collect();
            if gray {
                pixels
                    .push(((u16::from(rgb[0]) + u16::from(rgb[1]) + u16::from(rgb[2])) / 3) as u8);
            } else {
                pixels.extend_from_slice(&rgb);
            }
        }
    }
    pixels
}

/// How a test JPEG is encoded.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kind {
    gray: bool,
    sampling: SamplingFactor,
    progressive: bool,
    restart: u16,
}

impl Kind {
    const fn color(sampling: SamplingFactor) -> Kind {
        Kind {
            gray: false,
            sampling,
            progressive: false,
            restart: 0,
        }
    }
}

/// Every kind decoded: each subsampling jpeg-encoder makes that zune-jpeg 0.5.15 decodes
/// right (4:4:4, 4:2:2, 4:2:0, 4:4:0), gray, progressive, restart intervals, progressive with
/// restarts.
pub(crate) const KINDS: [Kind; 12] = [
    Kind::color(SamplingFactor::R_4_4_4),
    Kind::color(SamplingFactor::R_4_2_2),
    Kind::color(SamplingFactor::R_4_2_0),
    Kind::color(SamplingFactor::R_4_4_0),
    Kind {
        gray: true,
        ..Kind::color(SamplingFactor::R_4_4_4)
    },
    Kind {
        progressive: true,
        ..Kind::color(SamplingFactor::R_4_2_0)
    },
    Kind {
        progressive: true,
        ..Kind::color(SamplingFactor::R_4_4_4)
    },
    Kind {
        gray: true,
        progressive: true,
        ..Kind::color(SamplingFactor::R_4_4_4)
    },
    Kind {
        restart: 1,
        ..Kind::color(SamplingFactor::R_4_2_0)
    },
    Kind {
        restart: 3,
        ..Kind::color(SamplingFactor::R_4_2_2)
    },
    Kind {
        gray: true,
        restart: 5,
        ..Kind::color(SamplingFactor::R_4_4_4)
    },
    Kind {
        progressive: true,
        restart: 2,
        ..Kind::color(SamplingFactor::R_4_2_0)
    },
];

/// The subsamplings jpeg-encoder makes that zune-jpeg 0.5.15 decodes wrongly (its generic
/// upsampler), refused.
const REFUSED_SAMPLING: [SamplingFactor; 4] = [
    SamplingFactor::R_4_1_1,
    SamplingFactor::R_4_4_1,
    SamplingFactor::R_4_2_1,
    SamplingFactor::R_4_1_0,
];

/// The sizes tested: one pixel, narrower and shorter than one MCU, odd, a photo's.
const SIZES: [(u16, u16); 4] = [(1, 1), (17, 2), (37, 51), (500, 375)];

/// `pixels` (RGB, or gray for a gray kind) encoded as `kind` at quality 90.
fn encode(pixels: &[u8], width: u16, height: u16, kind: Kind) -> Vec<u8> {
    let mut out = Vec::new();
    let mut enc = Encoder::new(&mut out, 90);
    enc.set_sampling_factor(kind.sampling);
    enc.set_progressive(kind.progressive);
    enc.set_restart_interval(kind.restart);
    let color = if kind.gray {
        ColorType::Luma
    } else {
        ColorType::Rgb
    };
    enc.encode(pixels, width, height, color).expect("encode");
    out
}

/// A photo of `width` x `height` encoded as `kind`: (JPEG, source pixels as RGB).
pub(crate) fn jpeg(width: u16, height: u16, kind: Kind) -> (Vec<u8>, Vec<u8>) {
    let pixels = photo(
        width,
        height,
        kind.gray,
        u64::from(width) * 1000 + u64::from(height),
    );
    let bytes = encode(&pixels, width, height, kind);
    let rgb = if kind.gray {
        pixels.iter().flat_map(|&v| [v, v, v]).collect()
    } else {
        pixels
    };
    (bytes, rgb)
}

/// `jpeg-decoder`'s decode of `bytes` as RGB (gray expanded to R = G = B): (width, height,
/// pixels).
fn reference(bytes: &[u8]) -> (u32, u32, Vec<u8>) {
    let mut dec = jpeg_decoder::Decoder::new(bytes);
    let pixels = dec.decode().expect("jpeg-decoder decodes it");
    let info = dec.info().expect("info after decode");
    let rgb = match info.pixel_format {
        jpeg_decoder::PixelFormat::RGB24 => pixels,
        jpeg_decoder::PixelFormat::L8 => pixels.iter().flat_map(|&v| [v, v, v]).collect(),
        other => panic!("jpeg-decoder gave {other:?}"),
    };
    (u32::from(info.width), u32::from(info.height), rgb)
}

/// (max |a - b|, mean |a - b|) over equal-length byte slices.
fn diff(a: &[u8], b: &[u8]) -> (u8, f64) {
    assert_eq!(a.len(), b.len());
    let mut max = 0u8;
    let mut sum = 0u64;
    for (&x, &y) in a.iter().zip(b) {
        let d = x.abs_diff(y);
        max = max.max(d);
        sum += u64::from(d);
    }
    (max, sum as f64 / a.len().max(1) as f64)
}

/// PSNR of `a` against `b` in dB (infinite where equal).
pub(crate) fn psnr(a: &[u8], b: &[u8]) -> f64 {
    let se: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum();
    let mse = se / a.len().max(1) as f64;
    10.0 * (255.0f64 * 255.0 / mse).log10()
}

/// (max, mean) of |a - b| over the pixels of a `w` x `h` RGB image: all of them, and all but
/// the last row and column.
fn diffs(a: &[u8], b: &[u8], w: usize, h: usize) -> ((u8, f64), (u8, f64)) {
    let whole = diff(a, b);
    let (mut max, mut sum, mut n) = (0u8, 0u64, 0usize);
    for y in 0..h.saturating_sub(1) {
        for x in 0..w.saturating_sub(1) {
            for c in 0..3 {
                let i = (y * w + x) * 3 + c;
                let d = a[i].abs_diff(b[i]);
                max = max.max(d);
                sum += u64::from(d);
                n += 1;
            }
        }
    }
    (whole, (max, sum as f64 / n.max(1) as f64))
}

/// Checks one JPEG of `kind` at `w` x `h`; returns its row of the table (max and mean |d|
/// against jpeg-decoder, whole and inside, and PSNR against the source).
fn check_kind(kind: Kind, w: u16, h: u16) -> (String, (u8, f64), (u8, f64), f64) {
    let what = format!("{kind:?} {w}x{h}");
    let (bytes, source) = jpeg(w, h, kind);
    let header = jpeg_header(&bytes).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(
        header,
        JpegHeader {
            width: u32::from(w),
            height: u32::from(h),
            components: if kind.gray { 1 } else { 3 },
            precision: 8,
            progressive: kind.progressive,
            restart_interval: kind.restart,
        },
        "{what}"
    );
    let image = decode_jpeg(&bytes).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!((image.width, image.height), (u32::from(w), u32::from(h)));
    assert_eq!(image.pixels.len(), 3 * usize::from(w) * usize::from(h));
    let (rw, rh, want) = reference(&bytes);
    assert_eq!((rw, rh), (image.width, image.height), "{what}");
    let (whole, inside) = diffs(&image.pixels, &want, usize::from(w), usize::from(h));
    // Inside the last row and column, as close as two integer decoders get.
    assert!(inside.0 <= 4, "{what}: max |d| {} inside", inside.0);
    assert!(inside.1 <= 0.5, "{what}: mean |d| {:.3} inside", inside.1);
    // The last row and column: zune-jpeg upsamples chroma there from the encoder's padding
    // where jpeg-decoder (and libjpeg-turbo) repeat the last sample; it shows on images a few
    // pixels across (see the module's docs), not on the larger ones.
    assert!(whole.0 <= 32, "{what}: max |d| {}", whole.0);
    if w >= 32 && h >= 32 {
        assert!(whole.0 <= 4, "{what}: max |d| {}", whole.0);
        assert!(whole.1 <= 0.5, "{what}: mean |d| {:.3}", whole.1);
    }
    // The image at all: close to the source, where the encoder keeps it so (a subsampled side
    // under 16 pixels loses its chroma to the encoder's padding, in jpeg-decoder's decode too).
    let quality = psnr(&image.pixels, &source);
    let sampled = !kind.gray && !matches!(kind.sampling, SamplingFactor::R_4_4_4);
    if !sampled || (w >= 16 && h >= 16) {
        assert!(
            quality >= 30.0,
            "{what}: PSNR {quality:.1} dB against the source"
        );
    }
    if kind.gray {
        assert!(
            image.pixels.chunks(3).all(|p| p[0] == p[1] && p[1] == p[2]),
            "{what}: gray not expanded to R = G = B"
        );
    }
    // decode_jpeg_into writes every byte of its output, the same ones.
    let mut out = vec![0xA5u8; image.pixels.len()];
    let size = decode_jpeg_into(&bytes, &mut out).unwrap_or_else(|e| panic!("{what}: into: {e}"));
    assert_eq!(size, (image.width, image.height), "{what}");
    assert!(out == image.pixels, "{what}: decode_jpeg_into differs");
    (what, whole, inside, quality)
}

#[test]
fn every_kind_and_size_decodes_to_what_an_independent_decoder_gives() {
    let table: Vec<_> = std::thread::scope(|s| {
        let runs: Vec<_> = KINDS
            .iter()
            .map(|&kind| s.spawn(move || SIZES.map(|(w, h)| check_kind(kind, w, h))))
            .collect();
        runs.into_iter()
            .flat_map(|run| run.join().expect("a kind's checks"))
            .collect()
    });
    // The table for the docs (`cargo test -- --nocapture`).
    for (what, whole, inside, quality) in &table {
        println!(
            "{what}: max |d| {} (inside {}), mean |d| {:.3} (inside {:.3}), PSNR {quality:.1} dB",
            whole.0, inside.0, whole.1, inside.1
        );
    }
    assert_eq!(table.len(), KINDS.len() * SIZES.len());
}

#[test]
fn subsampling_the_decoder_gets_wrong_is_refused() {
    for sampling in REFUSED_SAMPLING {
        for (w, h) in [(37, 51), (64, 64)] {
            let (bytes, _) = jpeg(w, h, Kind::color(sampling));
            let header = jpeg_header(&bytes).expect("its header reads");
            assert_eq!((header.width, header.height), (u32::from(w), u32::from(h)));
            let err = decode_jpeg(&bytes).unwrap_err();
            assert!(
                matches!(err, ImageError::Unsupported { .. }),
                "{sampling:?}: {err}"
            );
            // jpeg-decoder does decode it: the refusal is the decoder's, not the file's.
            assert_eq!(reference(&bytes).0, u32::from(w));
        }
    }
}

/// Layouts zune-jpeg 0.5.15 decodes into a wrong image without an error (found by a hostile
/// trial, made by libjpeg-turbo 2.1.5, 123x77): a baseline JPEG with one scan per component
/// at 4:2:0 (6.1 dB against PIL), and luma at 1x1 under chroma at 2x2 (9.6 dB): refused,
/// though their headers read and jpeg-decoder decodes them.
#[test]
fn layouts_the_decoder_gets_wrong_are_refused() {
    let cases: [(&[u8], &str); 2] = [
        (
            include_bytes!("jpegs/noninterleaved_420.jpg"),
            "non-interleaved",
        ),
        (
            include_bytes!("jpegs/chroma_finer_than_luma.jpg"),
            "finer than the first",
        ),
    ];
    for (bytes, why) in cases {
        let header = jpeg_header(bytes).expect("its header reads");
        assert_eq!((header.width, header.height), (123, 77));
        match decode_jpeg(bytes) {
            Err(ImageError::Unsupported { reason }) => assert!(reason.contains(why), "{reason}"),
            other => panic!("{why}: {:?}", other.map(|i| (i.width, i.height))),
        }
        assert_eq!(reference(bytes).0, 123, "{why}: jpeg-decoder decodes it");
    }
}

/// A restart structure that does not match the data is corrupt, named before decoding
/// (zune-jpeg and PIL both decode such files to a wrong image without an error): the DRI
/// segment removed, its interval changed, one interval's data cut out; the intact file and
/// every kind with restart markers above decode.
#[test]
fn a_restart_structure_that_does_not_match_the_data_is_refused() {
    let kind = Kind {
        restart: 2,
        ..Kind::color(SamplingFactor::R_4_2_0)
    };
    let (intact, _) = jpeg(123, 77, kind);
    decode_jpeg(&intact).expect("the intact file decodes");
    let dri = intact
        .windows(4)
        .position(|w| w == [0xFF, 0xDD, 0, 4])
        .expect("a DRI segment");
    let corrupt_because = |bytes: &[u8], why: &str| match decode_jpeg(bytes) {
        Err(ImageError::Corrupt { reason }) => assert!(reason.contains(why), "{why}: {reason}"),
        other => panic!("{why}: {:?}", other.map(|i| (i.width, i.height))),
    };
    let mut removed = intact.clone();
    removed.drain(dri..dri + 6);
    corrupt_because(&removed, "no restart interval");
    let mut changed = intact.clone();
    changed[dri + 5] = 4;
    corrupt_because(&changed, "more restart markers than");
    // The bytes from the third restart marker up to the fourth (one interval's data) cut out.
    let rst: Vec<usize> = intact
        .windows(2)
        .enumerate()
        .filter(|(_, w)| w[0] == 0xFF && (0xD0..=0xD7).contains(&w[1]))
        .map(|(i, _)| i)
        .collect();
    assert!(rst.len() > 4, "{} restart markers", rst.len());
    let mut lost = intact.clone();
    lost.drain(rst[2]..rst[3]);
    corrupt_because(&lost, "missing or out of order");
}

#[test]
fn an_output_of_another_size_is_refused_before_decoding() {
    let (bytes, _) = jpeg(37, 51, Kind::color(SamplingFactor::R_4_2_0));
    let need = 3 * 37 * 51;
    for len in [0, 1, need - 1, need + 1, 2 * need] {
        let mut out = vec![0x5Au8; len];
        let err = decode_jpeg_into(&bytes, &mut out).unwrap_err();
        assert_eq!(
            err,
            ImageError::OutputSize {
                width: 37,
                height: 51,
                len
            }
        );
        assert!(out.iter().all(|&b| b == 0x5A), "{len}: output written");
    }
}

/// Sample JPEGs for the refusal tests: baseline 4:2:0, progressive, restarts, gray.
fn samples() -> Vec<(String, Vec<u8>)> {
    // 4:2:0, progressive, restarts, gray progressive, progressive with restarts.
    let kinds = [KINDS[2], KINDS[5], KINDS[8], KINDS[7], KINDS[11]];
    let mut out = Vec::new();
    for kind in kinds {
        for (w, h) in [(37, 51), (200, 150)] {
            out.push((format!("{kind:?} {w}x{h}"), jpeg(w, h, kind).0));
        }
    }
    out
}

#[test]
fn every_truncation_is_refused() {
    for (what, bytes) in samples() {
        let n = bytes.len();
        // A small one at every length; a larger one at cut points through the file.
        let cuts: Vec<usize> = if n < 4000 {
            (0..n).collect()
        } else {
            let mut c: Vec<usize> = [1, 5, 10, 25, 50, 75, 90, 99]
                .iter()
                .map(|p| n * p / 100)
                .collect();
            c.extend([n - 3, n - 2, n - 1]);
            c
        };
        for cut in cuts {
            let err = decode_jpeg(&bytes[..cut])
                .err()
                .unwrap_or_else(|| panic!("{what}: cut to {cut} of {n} bytes decoded"));
            if cut >= 2 {
                assert!(
                    matches!(err, ImageError::Truncated { .. }),
                    "{what}: cut to {cut} of {n}: {err}"
                );
            }
            let mut out = vec![0u8; 3 * 37 * 51];
            assert!(decode_jpeg_into(&bytes[..cut], &mut out).is_err());
        }
    }
}

#[test]
fn cut_data_with_an_end_marker_put_back_never_panics() {
    // A file cut inside its data whose end marker was put back passes the end-of-image check;
    // zune-jpeg's strict mode takes the marker for the end of the data and decodes the rest
    // from zero bits (see the module's docs), or refuses it. Never a panic, never another
    // size.
    let (mut refused, mut decoded) = (0, 0);
    for (what, bytes) in samples() {
        let header = jpeg_header(&bytes).expect("header");
        for p in [30, 60, 95] {
            let mut cut = bytes[..bytes.len() * p / 100].to_vec();
            cut.extend_from_slice(&[0xFF, 0xD9]);
            match decode_jpeg(&cut) {
                Ok(image) => {
                    decoded += 1;
                    assert_eq!((image.width, image.height), (header.width, header.height));
                }
                Err(e) => {
                    refused += 1;
                    assert!(
                        matches!(e, ImageError::Corrupt { .. } | ImageError::Truncated { .. }),
                        "{what} cut at {p}%: {e:?}"
                    );
                }
            }
        }
    }
    println!("cut with an end marker put back: {decoded} decoded, {refused} refused");
}

#[test]
fn trailing_bytes_and_a_thumbnail_end_marker_do_not_fool_the_end_check() {
    let pixels = photo(64, 48, false, 3);
    let mut enc_out = Vec::new();
    let mut enc = Encoder::new(&mut enc_out, 90);
    // An APP1 holding an end-of-image marker, as an EXIF thumbnail does.
    enc.add_app_segment(1, b"Exif\0\0\xff\xd8\xff\xd9 thumbnail".to_vec())
        .expect("app segment");
    enc.encode(&pixels, 64, 48, ColorType::Rgb).expect("encode");
    let whole = decode_jpeg(&enc_out).expect("with a thumbnail marker");
    // Bytes after the end marker (some writers leave padding) are allowed.
    let mut trailing = enc_out.clone();
    trailing.extend_from_slice(&[0u8; 100]);
    assert_eq!(decode_jpeg(&trailing).expect("trailing bytes"), whole);
    // Cut short: the thumbnail's end marker does not count.
    let err = decode_jpeg(&enc_out[..enc_out.len() * 9 / 10]).unwrap_err();
    assert!(matches!(err, ImageError::Truncated { .. }), "{err}");
}

/// A JPEG whose EXIF says "rotate 90 degrees clockwise to display" (orientation 6) decodes to
/// the pixels as stored, at the stored size: the same image as without the EXIF segment.
#[test]
fn an_exif_orientation_is_not_applied() {
    let pixels = photo(64, 48, false, 8);
    let encode_with = |app1: Option<Vec<u8>>| {
        let mut out = Vec::new();
        let mut enc = Encoder::new(&mut out, 90);
        if let Some(app1) = app1 {
            enc.add_app_segment(1, app1).expect("app segment");
        }
        enc.encode(&pixels, 64, 48, ColorType::Rgb).expect("encode");
        out
    };
    // Exif, a little-endian TIFF header, one IFD entry: Orientation (0x0112), SHORT, 1, 6.
    let mut exif = b"Exif\0\0II*\0\x08\0\0\0\x01\0".to_vec();
    exif.extend_from_slice(&[0x12, 0x01, 3, 0, 1, 0, 0, 0, 6, 0, 0, 0]);
    exif.extend_from_slice(&[0, 0, 0, 0]);
    let rotated = encode_with(Some(exif));
    let plain = encode_with(None);
    assert_ne!(rotated, plain, "the EXIF segment is in the file");
    let header = jpeg_header(&rotated).expect("header");
    assert_eq!((header.width, header.height), (64, 48), "the stored size");
    let (a, b) = (
        decode_jpeg(&rotated).expect("decodes"),
        decode_jpeg(&plain).expect("decodes"),
    );
    assert_eq!((a.width, a.height), (64, 48));
    assert_eq!(a, b, "the pixels as stored");
}

#[test]
fn flipped_data_bytes_never_panic() {
    for (what, bytes) in samples() {
        let start = bytes
            .windows(2)
            .position(|w| w == [0xFF, 0xDA])
            .expect("a scan")
            + 20;
        let (mut decoded, mut refused) = (0, 0);
        for k in 0..40 {
            let mut bad = bytes.clone();
            let at = start + (bytes.len() - start - 2) * k / 40;
            bad[at] ^= 0x5A;
            match decode_jpeg(&bad) {
                Ok(image) => {
                    decoded += 1;
                    assert_eq!(
                        image.pixels.len(),
                        3 * image.width as usize * image.height as usize
                    );
                }
                Err(e) => {
                    refused += 1;
                    assert!(
                        !matches!(e, ImageError::DecoderPanicked { .. }),
                        "{what}: byte {at} flipped: {e}"
                    );
                }
            }
        }
        println!("{what}: 40 flipped bytes: {decoded} decoded, {refused} refused");
    }
}

#[test]
fn cmyk_jpegs_are_refused_naming_cmyk() {
    let pixels = random_bytes(24 * 16 * 4, 7);
    for color in [ColorType::Cmyk, ColorType::CmykAsYcck] {
        let mut bytes = Vec::new();
        Encoder::new(&mut bytes, 90)
            .encode(&pixels, 24, 16, color)
            .expect("encode");
        let header = jpeg_header(&bytes).expect("a CMYK JPEG's header");
        assert_eq!(
            (header.width, header.height, header.components),
            (24, 16, 4)
        );
        let err = decode_jpeg(&bytes).unwrap_err();
        assert_eq!(err, ImageError::Cmyk, "{color:?}");
        assert!(
            err.to_string()
                .contains("CMYK JPEGs are not decoded: convert them to RGB"),
            "{err}"
        );
        let mut out = vec![0u8; 24 * 16 * 3];
        assert_eq!(decode_jpeg_into(&bytes, &mut out), Err(ImageError::Cmyk));
    }
}

#[test]
fn other_formats_empty_and_random_bytes_are_refused() {
    let png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x01\0\0\0\x01\x08\x02\0\0\0";
    let err = decode_jpeg(png).unwrap_err();
    assert_eq!(
        err,
        ImageError::NotJpeg {
            format: Some("PNG"),
            head: png[..8].to_vec()
        }
    );
    assert!(
        err.to_string().starts_with("a PNG file, not a JPEG"),
        "{err}"
    );
    assert_eq!(
        decode_jpeg(&[]).unwrap_err(),
        ImageError::NotJpeg {
            format: None,
            head: vec![]
        }
    );
    assert!(jpeg_header(&[]).is_err());
    for seed in 0..50 {
        let mut bytes = random_bytes(1000, seed);
        if bytes.starts_with(&[0xFF, 0xD8]) {
            bytes[0] = 0;
        }
        let err = decode_jpeg(&bytes).unwrap_err();
        assert!(
            matches!(err, ImageError::NotJpeg { format: None, .. }),
            "{err}"
        );
        assert!(
            err.to_string().starts_with("not a JPEG: starts with"),
            "{err}"
        );
        // The same after a JPEG's start marker: refused, no panic.
        bytes[..2].copy_from_slice(&[0xFF, 0xD8]);
        assert!(decode_jpeg(&bytes).is_err());
    }
}

/// A small real JPEG for the property test to mutate.
fn small_jpeg(progressive: bool) -> Vec<u8> {
    let kind = Kind {
        progressive,
        restart: if progressive { 0 } else { 2 },
        ..Kind::color(SamplingFactor::R_4_2_0)
    };
    jpeg(24, 17, kind).0
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// Arbitrary bytes, and real JPEGs with arbitrary bytes written over them or cut: an
    /// error or an image of its header's size, never a panic (of ours, or the decoder's).
    #[test]
    fn arbitrary_bytes_never_panic(
        raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
        edits in proptest::collection::vec(
            (proptest::prelude::any::<proptest::sample::Index>(), proptest::prelude::any::<u8>()),
            0..8,
        ),
        cut in proptest::prelude::any::<proptest::sample::Index>(),
        progressive in proptest::prelude::any::<bool>(),
    ) {
        for bytes in [raw.clone(), {
            let mut j = small_jpeg(progressive);
            for (at, value) in &edits {
                let i = at.index(j.len());
                j[i] = *value;
            }
            if edits.len() % 2 == 1 {
                j.truncate(cut.index(j.len() + 1));
            }
            j
        }] {
            let header = jpeg_header(&bytes);
            match decode_jpeg(&bytes) {
                Ok(image) => {
                    let header = header.expect("a decoded image has a header");
                    proptest::prop_assert_eq!((image.width, image.height), (header.width, header.height));
                    proptest::prop_assert_eq!(image.pixels.len(), 3 * image.width as usize * image.height as usize);
                }
                Err(e) => {
                    proptest::prop_assert!(!matches!(e, ImageError::DecoderPanicked { .. }), "{}", e);
                }
            }
        }
    }
}
