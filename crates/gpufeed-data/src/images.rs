//! JPEG decoding on the CPU (issue 40's fallback where no GPU decoder takes an image): headers
//! read without decoding ([`jpeg_header`]), and whole images decoded to interleaved RGB
//! ([`decode_jpeg`], [`decode_jpeg_into`]) by `zune-jpeg` in its strict mode, from untrusted
//! bytes: never a panic, an [`ImageError`] saying what is wrong.
//!
//! What is decoded: 8-bit baseline, extended and progressive Huffman-coded JPEGs of one (gray,
//! expanded to R = G = B) or three components (YCbCr, or RGB), at 4:4:4, 4:2:2, 4:2:0 or 4:4:0,
//! with or without restart markers. What is refused, before any pixel is decoded: bytes of
//! another format (named where recognised: PNG, GIF, WebP, ...), CMYK and YCCK JPEGs, 12-bit,
//! lossless, hierarchical and arithmetic-coded ones, 4:1:1 and other subsampling beyond 2x in
//! a direction, chroma sampled finer than luma, and sequential JPEGs with one scan per
//! component (non-interleaved; zune-jpeg 0.5.15 decodes all of these wrongly, the last seen
//! at 4:2:0 and 4:4:0 and refused at any subsampling), images of more than
//! [`MAX_JPEG_PIXELS`] pixels, files cut short (no end-of-image marker after the image data,
//! or fewer bytes of image data than a bit per 8x8 block: a decompression bomb's shape), and
//! restart markers out of step with the restart interval; while decoding, data the strict
//! decoder finds corrupt.
//!
//! # Against libjpeg-turbo (torchvision's `decode_jpeg`)
//! Pixels are within a few levels of libjpeg-turbo's: both decode with integer IDCTs and
//! "fancy" (triangle-filter) chroma upsampling. Measured against torchvision 0.26 on photo-like
//! images made by `jpeg-encoder` at quality 90: at most 3 levels apart, on average 0.01 (4:4:4,
//! gray) to 0.08 (4:2:0) at 500x375. One difference: where the image's size along a subsampled
//! direction is even (the width of a 4:2:2 or 4:2:0 image, the height of a 4:2:0 or 4:4:0
//! one), zune-jpeg's last column (row) blends in the chroma of the encoder's padding beyond
//! the image, where libjpeg-turbo repeats the last chroma sample: there the two can differ by
//! more, measured up to 9 levels on images 4 pixels across and 32 on images 2 pixels across
//! (at most 3 on the 500x375 images). Images of 4:2:0 under 5 pixels across (odd widths
//! too), or 1 pixel across and 3 or more high, came out 21-33 dB against PIL's decode in a
//! hostile trial, no further from the source than PIL's.
//!
//! # What strict mode does not catch
//! Truncation is caught by the missing end-of-image marker. A file cut inside its image data
//! and given an end-of-image marker (`ff d9`) again is decoded without an error: zune-jpeg
//! takes the marker for the end of the data and decodes the rest of the image from zero bits
//! (flat blocks), as it does for corrupt data whose bytes happen to form that marker. Restart
//! markers are checked against the restart interval before decoding (a file whose DRI segment
//! was removed or changed, or that lost one interval's data, decodes to a wrong image without
//! an error, PIL's too), but only in sequential JPEGs of one interleaved scan: a progressive
//! one's scans are not counted. A frame header that declares more rows than the data holds
//! gives an image padded below the data.

use crate::error::Error;
use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

/// The most pixels (`width * height`) an image may have to be decoded: 2^28, 768 MiB of RGB.
/// A guard against decompression bombs (a small file declaring a huge image); a JPEG's sides
/// are at most 65,535 pixels each by its format.
pub const MAX_JPEG_PIXELS: u64 = 1 << 28;

/// What a JPEG's headers say, read without decoding the image ([`jpeg_header`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JpegHeader {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Components: 1 (gray), 3 (YCbCr or RGB), 4 (CMYK or YCCK, which [`decode_jpeg`] refuses).
    pub components: u8,
    /// Bits per sample: 8 for nearly every JPEG; 12-bit ones are refused by [`decode_jpeg`].
    pub precision: u8,
    /// Whether it is progressive (SOF2) rather than sequential (SOF0 baseline, SOF1 extended).
    pub progressive: bool,
    /// MCUs between restart markers in force at the first scan (its DRI segment), 0 if none.
    pub restart_interval: u16,
}

/// A decoded image: interleaved RGB, 3 bytes a pixel, rows of `3 * width` bytes from the top
/// (HWC `uint8`, as torchvision's `decode_jpeg` gives after `permute(1, 2, 0)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedImage {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// `3 * width * height` bytes: R, G, B of each pixel, row by row.
    pub pixels: Vec<u8>,
}

/// What a loader does with an image that fails to decode (its bytes are no JPEG, truncated,
/// corrupt, or of a kind not decoded: an [`ImageError`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnBadImage {
    /// Stop with an error naming the image ([`Error::Image`]): a data set is expected to be
    /// clean, and a bad file in it is worth knowing about at once.
    #[default]
    Error,
    /// Leave the image out, count it and keep its name and reason ([`SkippedImage`]), and go
    /// on: for scraped data sets where a few bad files are expected.
    Skip,
}

/// An image a loader left out under [`OnBadImage::Skip`], and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedImage {
    /// The image's name: its file's path, or its sample's key in a shard.
    pub name: String,
    /// Why it was not decoded.
    pub reason: ImageError,
}

/// Why an image was not decoded. The functions of this module do not know the image's name:
/// [`ImageError::named`] makes the crate's [`Error::Image`] of it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// The bytes are not a JPEG: empty, or of another format (`format`, where recognised from
    /// its first bytes: "PNG", "GIF", "WebP", ...).
    #[error("{}", not_jpeg(*.format, .head))]
    NotJpeg {
        /// The format recognised from the first bytes, if any.
        format: Option<&'static str>,
        /// The first bytes (at most 8).
        head: Vec<u8>,
    },

    /// The file ends before its image does.
    #[error(
        "truncated JPEG: {reason}; the file was cut short (an interrupted download or copy?): \
         fetch or copy it again"
    )]
    Truncated {
        /// What is missing.
        reason: String,
    },

    /// The headers or the image data are malformed.
    #[error("corrupt JPEG: {reason}")]
    Corrupt {
        /// What is wrong (for the image data, the decoder's message).
        reason: String,
    },

    /// A JPEG of four components (CMYK, or YCCK: Adobe's CMYK JPEGs).
    #[error(
        "a CMYK JPEG (4 components): CMYK JPEGs are not decoded: convert them to RGB (e.g. \
         `magick in.jpg -colorspace sRGB out.jpg`)"
    )]
    Cmyk,

    /// A JPEG of other than 8 bits a sample (12-bit JPEGs, of medical or raw-camera origin).
    #[error(
        "a {bits}-bit JPEG: only 8-bit JPEGs are decoded: convert it to 8 bits (e.g. \
         `magick in.jpg -depth 8 out.jpg`)"
    )]
    Precision {
        /// Its bits per sample.
        bits: u8,
    },

    /// A JPEG of a kind not decoded: lossless, hierarchical or arithmetic-coded; 2 or more
    /// than 4 components; a height given by a DNL marker; 4:1:1 and other chroma subsampling
    /// that zune-jpeg 0.5.15 decodes wrongly.
    #[error("a JPEG of a kind not decoded: {reason}")]
    Unsupported {
        /// What it is, and what to convert it to.
        reason: String,
    },

    /// An image of more than [`MAX_JPEG_PIXELS`] pixels (a decompression bomb guard).
    #[error(
        "{width}x{height} pixels is more than the {max_pixels} decoded (a guard against \
         decompression bombs): resize the image"
    )]
    TooLarge {
        /// Its width.
        width: u32,
        /// Its height.
        height: u32,
        /// The limit, [`MAX_JPEG_PIXELS`].
        max_pixels: u64,
    },

    /// The output given to [`decode_jpeg_into`] is not the image's size.
    #[error(
        "the output holds {len} bytes but the {width}x{height} image needs exactly {} \
         (3 * width * height): pass a buffer of that size (jpeg_header gives it)",
        3 * u64::from(*.width) * u64::from(*.height)
    )]
    OutputSize {
        /// The image's width.
        width: u32,
        /// The image's height.
        height: u32,
        /// The output's length in bytes.
        len: usize,
    },

    /// A record that holds no image to decode: a WebDataset sample without a `.jpg` or
    /// `.jpeg` member, or whose `.cls` label is not a number.
    #[error("{reason}")]
    Sample {
        /// What is wrong with the sample.
        reason: String,
    },

    /// The decoder (`zune-jpeg`) panicked on the bytes: a bug of the decoder, caught so that a
    /// bad file does not stop a loader's worker.
    #[error("the JPEG decoder (zune-jpeg) panicked on it: {message}; please report the file")]
    DecoderPanicked {
        /// The panic's message.
        message: String,
    },
}

impl ImageError {
    /// The crate's [`Error::Image`] for the image `name` (its file's path, or its sample's key).
    pub fn named(self, name: impl Into<String>) -> Error {
        Error::Image {
            name: name.into(),
            reason: self,
        }
    }
}

/// The message of an [`ImageError::NotJpeg`].
fn not_jpeg(format: Option<&'static str>, head: &[u8]) -> String {
    match format {
        Some(f) => format!("a {f} file, not a JPEG: decode it with a {f} decoder, or convert it"),
        None if head.is_empty() => "empty (0 bytes), not a JPEG".to_owned(),
        None => {
            let hex: Vec<String> = head.iter().map(|b| format!("{b:02x}")).collect();
            format!(
                "not a JPEG: starts with {} (a JPEG starts with ff d8 ff)",
                hex.join(" ")
            )
        }
    }
}

/// The format `bytes` (not a JPEG's) are of, from their first bytes, where recognised.
fn sniff(bytes: &[u8]) -> Option<&'static str> {
    let at = |offset: usize, magic: &[u8]| bytes.get(offset..offset + magic.len()) == Some(magic);
    Some(if at(0, b"\x89PNG\r\n\x1a\n") {
        "PNG"
    } else if at(0, b"GIF87a") || at(0, b"GIF89a") {
        "GIF"
    } else if at(0, b"RIFF") && at(8, b"WEBP") {
        "WebP"
    } else if at(0, b"II*\0") || at(0, b"MM\0*") {
        "TIFF"
    } else if at(0, b"BM") && bytes.len() >= 26 {
        "BMP"
    } else if at(4, b"ftypavif") || at(4, b"ftypavis") {
        "AVIF"
    } else if at(4, b"ftypheic") || at(4, b"ftypheix") || at(4, b"ftypmif1") {
        "HEIF"
    } else if at(0, b"\0\0\0\x0cjP  ") || at(0, b"\xff\x4f\xff\x51") {
        "JPEG 2000"
    } else if at(0, b"\xff\x0a") || at(0, b"\0\0\0\x0cJXL ") {
        "JPEG XL"
    } else if at(0, b"\x93NUMPY") {
        ".npy"
    } else {
        return None;
    })
}

/// A [`ImageError::Truncated`].
fn truncated(reason: impl Into<String>) -> ImageError {
    ImageError::Truncated {
        reason: reason.into(),
    }
}

/// A [`ImageError::Corrupt`].
fn corrupt(reason: impl Into<String>) -> ImageError {
    ImageError::Corrupt {
        reason: reason.into(),
    }
}

/// A [`ImageError::Unsupported`].
fn unsupported(reason: impl Into<String>) -> ImageError {
    ImageError::Unsupported {
        reason: reason.into(),
    }
}

/// The headers and where the first scan's data starts.
pub(crate) struct Headers {
    /// What the frame header (and a DRI before the scan) says.
    pub(crate) header: JpegHeader,
    /// The offset of the first byte after the first SOS segment.
    scan_data: usize,
    /// Each component's sampling factors (horizontal, vertical).
    sampling: Vec<(u8, u8)>,
    /// The components of the first scan (its SOS segment): fewer than the frame's in a
    /// non-interleaved sequential JPEG (one scan per component).
    scan_components: u8,
}

impl Headers {
    /// The largest horizontal and vertical sampling factors of its components (an MCU of an
    /// interleaved scan is that many 8x8 blocks each way).
    fn max_factors(&self) -> (u8, u8) {
        let max = |f: fn(&(u8, u8)) -> u8| self.sampling.iter().map(f).max().unwrap_or(1);
        (max(|s| s.0), max(|s| s.1))
    }
}

/// Reads a JPEG's headers, from its SOI marker to its first SOS segment: the frame header
/// (SOF0, SOF1 or SOF2; the other SOF markers are codings not decoded) and a DRI before the
/// scan; every other segment skipped by its length.
///
/// # Errors
/// Bytes that are no JPEG, headers cut short or malformed, codings not decoded.
pub fn jpeg_header(bytes: &[u8]) -> Result<JpegHeader, ImageError> {
    read_headers(bytes).map(|h| h.header)
}

/// [`jpeg_header`], and where the image data starts.
fn read_headers(bytes: &[u8]) -> Result<Headers, ImageError> {
    if !bytes.starts_with(&[0xFF, 0xD8]) {
        if !bytes.is_empty() && [0xFF, 0xD8].starts_with(bytes) {
            return Err(truncated("it ends after its first byte"));
        }
        return Err(ImageError::NotJpeg {
            format: sniff(bytes),
            head: bytes[..bytes.len().min(8)].to_vec(),
        });
    }
    let mut frame: Option<(JpegHeader, Vec<(u8, u8)>)> = None;
    let mut restart_interval = 0u16;
    let mut i = 2;
    loop {
        let Some(&b) = bytes.get(i) else {
            return Err(truncated(format!(
                "it ends in its headers (at byte {i}), before the image data"
            )));
        };
        if b != 0xFF {
            return Err(corrupt(format!(
                "byte {i} is 0x{b:02x} where a marker (0xff) was expected between header segments"
            )));
        }
        // Fill bytes (0xff) may precede a marker.
        while bytes.get(i) == Some(&0xFF) {
            i += 1;
        }
        let Some(&marker) = bytes.get(i) else {
            return Err(truncated(format!(
                "it ends in its headers (at byte {i}), before the image data"
            )));
        };
        let at = i - 1;
        i += 1;
        match marker {
            // Markers without a segment: TEM and RST0-7 (out of place, and harmless here).
            0x01 | 0xD0..=0xD7 => continue,
            0xD8 => {
                return Err(corrupt(format!(
                    "a second start-of-image marker at byte {at}"
                )));
            }
            0xD9 => {
                return Err(corrupt(format!(
                    "an end-of-image marker at byte {at}, before any image data"
                )));
            }
            0x00 => return Err(corrupt(format!("an invalid marker ff 00 at byte {at}"))),
            _ => {}
        }
        let Some(len) = bytes.get(i..i + 2) else {
            return Err(truncated(format!(
                "it ends in the header of the segment at byte {at} (marker ff {marker:02x})"
            )));
        };
        let len = usize::from(u16::from_be_bytes([len[0], len[1]]));
        if len < 2 {
            return Err(corrupt(format!(
                "the segment at byte {at} (marker ff {marker:02x}) claims a length of {len}"
            )));
        }
        let Some(body) = bytes.get(i + 2..i + len) else {
            return Err(truncated(format!(
                "the segment at byte {at} (marker ff {marker:02x}) claims {len} bytes, and the \
                 file ends first"
            )));
        };
        match marker {
            0xC0..=0xC2 => {
                if frame.is_some() {
                    return Err(corrupt(format!("a second frame header (SOF) at byte {at}")));
                }
                frame = Some(frame_header(body, marker == 0xC2, restart_interval, at)?);
            }
            0xC3 | 0xC5..=0xC7 | 0xC9..=0xCB | 0xCD..=0xCF => {
                let coding = match marker {
                    0xC3 => "lossless",
                    0xC5 => "hierarchical (differential sequential)",
                    0xC6 => "hierarchical (differential progressive)",
                    0xC7 => "hierarchical (differential lossless)",
                    0xC9 => "arithmetic-coded sequential",
                    0xCA => "arithmetic-coded progressive",
                    0xCB => "arithmetic-coded lossless",
                    _ => "arithmetic-coded hierarchical",
                };
                return Err(unsupported(format!(
                    "{coding} (SOF{}): re-encode it as a baseline or progressive JPEG",
                    marker - 0xC0
                )));
            }
            0xDD => {
                let [hi, lo] = body else {
                    return Err(corrupt(format!(
                        "the DRI segment at byte {at} has {} bytes, not 2",
                        body.len()
                    )));
                };
                restart_interval = u16::from_be_bytes([*hi, *lo]);
                if let Some((f, _)) = &mut frame {
                    f.restart_interval = restart_interval;
                }
            }
            0xDA => {
                let Some((header, sampling)) = frame else {
                    return Err(corrupt(format!(
                        "a scan (SOS) at byte {at} before any frame header (SOF)"
                    )));
                };
                let Some(&scan_components) = body.first() else {
                    return Err(corrupt(format!(
                        "the scan header (SOS) at byte {at} is empty"
                    )));
                };
                return Ok(Headers {
                    header,
                    scan_data: i + len,
                    sampling,
                    scan_components,
                });
            }
            _ => {}
        }
        i += len;
    }
}

/// Reads a SOF0/1/2 segment's `body` (after its length) at byte `at`: the header and each
/// component's sampling factors.
fn frame_header(
    body: &[u8],
    progressive: bool,
    restart_interval: u16,
    at: usize,
) -> Result<(JpegHeader, Vec<(u8, u8)>), ImageError> {
    let &[precision, h0, h1, w0, w1, components, ref specs @ ..] = body else {
        return Err(corrupt(format!(
            "the frame header at byte {at} has {} bytes, fewer than 6",
            body.len()
        )));
    };
    if specs.len() < 3 * usize::from(components) {
        return Err(corrupt(format!(
            "the frame header at byte {at} declares {components} components but holds {} bytes \
             of them",
            specs.len()
        )));
    }
    let (height, width) = (u16::from_be_bytes([h0, h1]), u16::from_be_bytes([w0, w1]));
    if components == 0 || width == 0 {
        return Err(corrupt(format!(
            "the frame header at byte {at} declares {components} components and a width of \
             {width}"
        )));
    }
    if height == 0 {
        return Err(unsupported(
            "its height is given after the image data (a DNL marker): re-encode it",
        ));
    }
    let sampling: Vec<(u8, u8)> = specs
        .chunks_exact(3)
        .take(usize::from(components))
        .map(|c| (c[1] >> 4, c[1] & 0x0F))
        .collect();
    if let Some((h, v)) = sampling
        .iter()
        .find(|(h, v)| !(1..=4).contains(h) || !(1..=4).contains(v))
    {
        return Err(corrupt(format!(
            "the frame header at byte {at} gives a component the sampling factors {h}x{v} (1 to \
             4 each are valid)"
        )));
    }
    let header = JpegHeader {
        width: u32::from(width),
        height: u32::from(height),
        components,
        precision,
        progressive,
        restart_interval,
    };
    Ok((header, sampling))
}

/// Refuses chroma subsampling that the decoder (zune-jpeg 0.5.15) gets wrong: any component
/// other than at the full resolution, half of it, or half of it in one direction (4:4:4,
/// 4:2:2, 4:2:0, 4:4:0). The others (4:1:1, 4:1:0, 4:2:1, 4:4:1: factors of 4, or a
/// ratio other than 1 or 2) take its generic upsampler, whose output was measured wrong
/// against libjpeg-turbo (torchvision) and jpeg-decoder: colors off by up to 250 levels on
/// every image of 4:1:0, 4:2:1 or 4:4:1, and in the last row of MCUs of 4:1:1 images of
/// some sizes. Gray images (one component) are not subsampled.
///
/// Also refused: a component sampled finer than the first (luma at 1x1 under chroma at
/// 2x2, which zune-jpeg decoded to 9.6 dB against PIL's 37), and a sequential JPEG whose
/// first scan holds fewer components than the frame (non-interleaved: one scan per
/// component, as `cjpeg -scans` and jpegtran can write; zune-jpeg decoded those of 4:2:0 and
/// 4:4:0 to 6 dB, silently).
fn check_sampling(headers: &Headers) -> Result<(), ImageError> {
    let sampling = &headers.sampling;
    if sampling.len() < 2 {
        return Ok(());
    }
    if !headers.header.progressive && usize::from(headers.scan_components) < sampling.len() {
        return Err(unsupported(format!(
            "a sequential JPEG whose first scan holds {} of its {} components (non-interleaved \
             scans) is decoded wrongly by zune-jpeg 0.5.15; re-encode it with interleaved \
             scans (any encoder's default)",
            headers.scan_components,
            sampling.len()
        )));
    }
    let luma = sampling[0];
    if sampling[1..].iter().any(|&(h, v)| h > luma.0 || v > luma.1) {
        let factors: Vec<String> = sampling.iter().map(|(h, v)| format!("{h}x{v}")).collect();
        return Err(unsupported(format!(
            "a component sampled finer than the first (sampling factors {}) is decoded \
             wrongly by zune-jpeg 0.5.15; convert it to 4:2:0 or 4:4:4",
            factors.join(", ")
        )));
    }
    let (h_max, v_max) = headers.max_factors();
    let ratio_ok = |max: u8, f: u8| max.is_multiple_of(f) && max / f <= 2;
    if sampling
        .iter()
        .all(|&(h, v)| ratio_ok(h_max, h) && ratio_ok(v_max, v))
    {
        return Ok(());
    }
    let factors: Vec<String> = sampling.iter().map(|(h, v)| format!("{h}x{v}")).collect();
    Err(unsupported(format!(
        "its chroma subsampling (sampling factors {}: 4:1:1, 4:1:0 or another beyond 2x in a \
         direction) is decoded wrongly by zune-jpeg 0.5.15; convert it to 4:2:0 or 4:4:4",
        factors.join(", ")
    )))
}

/// The headers of a JPEG [`decode_jpeg`] decodes, checked before decoding: 8 bits, 1 or 3
/// components, at most [`MAX_JPEG_PIXELS`] pixels, enough bytes for its size, and an
/// end-of-image marker after its image data.
fn decodable(bytes: &[u8]) -> Result<JpegHeader, ImageError> {
    let headers = plausible(bytes)?;
    check_sampling(&headers)?;
    Ok(headers.header)
}

/// The checks of [`decodable`] every decoder needs (the GPU's too, before it sizes memory from
/// the headers): 8 bits, 1 or 3 components, at most [`MAX_JPEG_PIXELS`] pixels, enough bytes
/// for its size, an end-of-image marker. Returns the headers read.
pub(crate) fn plausible(bytes: &[u8]) -> Result<Headers, ImageError> {
    let headers = read_headers(bytes)?;
    let Headers {
        header, scan_data, ..
    } = headers;
    match header.components {
        1 | 3 => {}
        4 => return Err(ImageError::Cmyk),
        n => {
            return Err(unsupported(format!(
                "{n} components (1 or 3 are decoded): convert it to RGB"
            )));
        }
    }
    if header.precision != 8 {
        return Err(ImageError::Precision {
            bits: header.precision,
        });
    }
    let pixels = u64::from(header.width) * u64::from(header.height);
    if pixels > MAX_JPEG_PIXELS {
        return Err(ImageError::TooLarge {
            width: header.width,
            height: header.height,
            max_pixels: MAX_JPEG_PIXELS,
        });
    }
    // Every 8x8 block of a full-resolution component takes at least one bit of Huffman code
    // (a baseline block two; a progressive image's first DC scan one), so a complete image of
    // `pixels` has at least `pixels / 512` bytes of image data: one with less is refused
    // before a buffer of the size it declares is allocated (a decompression bomb: 262 KB
    // declaring 16384x16384 passed the half of this bound that was checked before, and
    // decoded to 768 MB in 50 s of CPU).
    let data = (bytes.len() - scan_data) as u64;
    if pixels / 512 > data + 64 {
        return Err(truncated(format!(
            "{}x{} pixels need at least {} bytes of image data, and it has {data}",
            header.width,
            header.height,
            pixels / 512
        )));
    }
    // An end-of-image marker after the image data (the check nvJPEG's path makes too).
    if !gpufeed_cuda::nvjpeg::has_end(bytes) {
        return Err(truncated(
            "no end-of-image marker (ff d9) after its image data",
        ));
    }
    check_restarts(bytes, &headers)?;
    Ok(headers)
}

/// The restart markers of a sequential JPEG's one interleaved scan against its restart
/// interval: RST0-7 in turn, one between each two intervals of `restart_interval` MCUs (a
/// trailing one tolerated), none without an interval. Neither decoder checks this, and a file
/// whose DRI segment was removed or changed, or that lost an interval's data, decodes to a
/// wrong image without an error (8-15 dB against the source in a hostile trial). Progressive
/// and non-interleaved scans (several scans, each with its own count) are not checked.
fn check_restarts(bytes: &[u8], headers: &Headers) -> Result<(), ImageError> {
    let Headers {
        header, sampling, ..
    } = headers;
    if header.progressive || usize::from(headers.scan_components) != sampling.len() {
        return Ok(());
    }
    // The MCU: one 8x8 block of a single component, else the largest factors' 8x8 blocks.
    let (h_max, v_max) = if sampling.len() == 1 {
        (1, 1)
    } else {
        let (h, v) = headers.max_factors();
        (u32::from(h), u32::from(v))
    };
    let mcus =
        u64::from(header.width.div_ceil(8 * h_max)) * u64::from(header.height.div_ceil(8 * v_max));
    let interval = u64::from(header.restart_interval);
    let want = if interval == 0 {
        0
    } else {
        mcus.div_ceil(interval) - 1
    };
    // Walk the entropy-coded data: ff 00 is a data byte, ff ff fill, ff d0-d7 a restart
    // marker; any other marker ends the scan.
    let (mut seen, mut i) = (0u64, headers.scan_data);
    while let Some(at) = bytes.get(i..).and_then(|b| memchr::memchr(0xFF, b)) {
        i += at + 1;
        while bytes.get(i) == Some(&0xFF) {
            i += 1;
        }
        match bytes.get(i) {
            Some(0x00) => i += 1,
            Some(&m @ 0xD0..=0xD7) => {
                if interval == 0 {
                    return Err(corrupt(format!(
                        "a restart marker (ff {m:02x}) at byte {} with no restart interval \
                         (DRI) set",
                        i - 1
                    )));
                }
                if seen > want {
                    return Err(corrupt(format!(
                        "more restart markers than its {mcus} MCUs in intervals of {interval} \
                         have (ff {m:02x} at byte {}): its restart structure (DRI) does not \
                         match its data",
                        i - 1
                    )));
                }
                let expected = 0xD0 + (seen % 8) as u8;
                if m != expected {
                    return Err(corrupt(format!(
                        "restart marker ff {m:02x} at byte {} where ff {expected:02x} was due: \
                         data of its restart intervals is missing or out of order",
                        i - 1
                    )));
                }
                seen += 1;
                i += 1;
            }
            _ => break,
        }
    }
    if seen != want && seen != want + 1 {
        return Err(corrupt(format!(
            "{seen} restart markers where its {mcus} MCUs in intervals of {interval} need {want}: \
             its restart structure (DRI) does not match its data"
        )));
    }
    Ok(())
}

/// Decodes a JPEG into interleaved RGB (gray ones with R = G = B), checked as the module says.
///
/// # Errors
/// An [`ImageError`] for bytes that are not a JPEG, truncated or corrupt ones, CMYK, 12-bit,
/// lossless or arithmetic-coded ones, images of more than [`MAX_JPEG_PIXELS`] pixels.
///
/// # Example
/// ```no_run
/// let bytes = std::fs::read("cat.jpg")?;
/// let image = gpufeed_data::decode_jpeg(&bytes).map_err(|e| e.named("cat.jpg"))?;
/// assert_eq!(image.pixels.len(), 3 * image.width as usize * image.height as usize);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn decode_jpeg(bytes: &[u8]) -> Result<DecodedImage, ImageError> {
    let header = decodable(bytes)?;
    let mut pixels = vec![0u8; rgb_len(&header)];
    decode_checked(bytes, &header, &mut pixels)?;
    Ok(DecodedImage {
        width: header.width,
        height: header.height,
        pixels,
    })
}

/// [`decode_jpeg`] into `out`, which must be exactly `3 * width * height` bytes (the sizes of
/// [`jpeg_header`]); returns `(width, height)`. On an error `out` may hold part of the image.
///
/// # Errors
/// As [`decode_jpeg`]; [`ImageError::OutputSize`] for an `out` of another size, before
/// decoding.
pub fn decode_jpeg_into(bytes: &[u8], out: &mut [u8]) -> Result<(u32, u32), ImageError> {
    let header = decodable(bytes)?;
    if out.len() != rgb_len(&header) {
        return Err(ImageError::OutputSize {
            width: header.width,
            height: header.height,
            len: out.len(),
        });
    }
    decode_checked(bytes, &header, out)?;
    Ok((header.width, header.height))
}

/// `3 * width * height` of an image of at most [`MAX_JPEG_PIXELS`] pixels.
fn rgb_len(header: &JpegHeader) -> usize {
    3 * header.width as usize * header.height as usize
}

/// Decodes the JPEG `bytes`, whose checked headers are `header`, into `out` (its RGB size)
/// with zune-jpeg in strict mode, a panic of the decoder caught.
fn decode_checked(bytes: &[u8], header: &JpegHeader, out: &mut [u8]) -> Result<(), ImageError> {
    let options = DecoderOptions::default()
        .set_strict_mode(true)
        .jpeg_set_out_colorspace(ColorSpace::RGB)
        .set_max_width(usize::from(u16::MAX))
        .set_max_height(usize::from(u16::MAX));
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut decoder = JpegDecoder::new_with_options(ZCursor::new(bytes), options);
        decoder.decode_headers().map_err(zune_error)?;
        // The decoder's reading of the headers agrees with ours (which checked them).
        let size = decoder.dimensions();
        let want = (header.width as usize, header.height as usize);
        if size != Some(want) || decoder.output_colorspace() != Some(ColorSpace::RGB) {
            return Err(corrupt(format!(
                "the decoder reads its headers as {size:?} pixels of {:?} output, not {}x{} RGB",
                decoder.output_colorspace(),
                header.width,
                header.height
            )));
        }
        decoder.decode_into(out).map_err(zune_error)
    }));
    run.unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".to_owned());
        Err(ImageError::DecoderPanicked { message })
    })
}

/// A zune-jpeg error as an [`ImageError::Corrupt`] (the headers were checked before, so what
/// it finds is in the data).
fn zune_error(e: zune_jpeg::errors::DecodeErrors) -> ImageError {
    corrupt(e.to_string().trim_matches('"').to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A JPEG's headers by hand: SOI, a frame header `sof` of `components` at `precision`, a
    /// DRI of `restart`, a SOS, one data byte and EOI.
    fn headers(sof: u8, precision: u8, w: u16, h: u16, components: u8, restart: u16) -> Vec<u8> {
        let mut b = vec![0xFF, 0xD8];
        b.extend_from_slice(&[0xFF, 0xE0, 0, 4, 0xAB, 0xCD]); // an APP0 skipped
        b.extend_from_slice(&[0xFF, sof]);
        b.extend_from_slice(&(8 + 3 * u16::from(components)).to_be_bytes());
        b.push(precision);
        b.extend_from_slice(&h.to_be_bytes());
        b.extend_from_slice(&w.to_be_bytes());
        b.push(components);
        for c in 0..components {
            b.extend_from_slice(&[c + 1, 0x11, 0]);
        }
        if restart > 0 {
            b.extend_from_slice(&[0xFF, 0xDD, 0, 4]);
            b.extend_from_slice(&restart.to_be_bytes());
        }
        b.extend_from_slice(&[0xFF, 0xDA, 0, 8, 1, 1, 0, 0, 63, 0, 0x55, 0xFF, 0xD9]);
        b
    }

    /// A file declaring a huge image with fewer bytes of image data than its blocks' Huffman
    /// codes take at the least (a bit per 8x8 block of a full-resolution component) is
    /// refused before anything of the declared size is allocated; one with that many gets
    /// past the check.
    #[test]
    fn a_small_file_declaring_a_huge_image_is_refused_before_decoding() {
        let with_data = |bytes: usize| {
            let mut b = headers(0xC2, 8, 16384, 16384, 3, 0);
            let end = b.len() - 2; // before the EOI
            b.splice(end..end, std::iter::repeat_n(0x55, bytes));
            b
        };
        let least = 16384 * 16384 / 512;
        let e = plausible(&with_data(least / 2)).err().expect("refused");
        assert!(
            matches!(e, ImageError::Truncated { ref reason } if reason.contains("524288 bytes")),
            "{e:?}"
        );
        plausible(&with_data(least - 64)).expect("as many bytes as the blocks need");
    }

    #[test]
    fn headers_are_read_by_their_markers() {
        let h = jpeg_header(&headers(0xC2, 8, 300, 200, 3, 7)).expect("header");
        assert_eq!(
            h,
            JpegHeader {
                width: 300,
                height: 200,
                components: 3,
                precision: 8,
                progressive: true,
                restart_interval: 7,
            }
        );
        let h = jpeg_header(&headers(0xC1, 12, 1, 65535, 1, 0)).expect("header");
        assert_eq!((h.width, h.height, h.precision), (1, 65535, 12));
        assert!(!h.progressive);
        // Fill bytes before a marker are allowed.
        let mut filled = headers(0xC0, 8, 5, 5, 3, 0);
        filled.splice(2..2, [0xFF, 0xFF]);
        assert_eq!(jpeg_header(&filled).expect("fill bytes").width, 5);
    }

    #[test]
    fn codings_not_decoded_are_named_and_checks_refuse_before_decoding() {
        for sof in [0xC3, 0xC5, 0xC9, 0xCA] {
            let err = jpeg_header(&headers(sof, 8, 8, 8, 3, 0)).unwrap_err();
            assert!(
                matches!(err, ImageError::Unsupported { .. }),
                "{sof:x}: {err}"
            );
        }
        assert_eq!(
            decode_jpeg(&headers(0xC1, 12, 8, 8, 3, 0)).unwrap_err(),
            ImageError::Precision { bits: 12 }
        );
        assert_eq!(
            decode_jpeg(&headers(0xC0, 8, 8, 8, 4, 0)).unwrap_err(),
            ImageError::Cmyk
        );
        assert!(matches!(
            decode_jpeg(&headers(0xC0, 8, 8, 8, 2, 0)).unwrap_err(),
            ImageError::Unsupported { .. }
        ));
        assert_eq!(
            decode_jpeg(&headers(0xC0, 8, 65535, 65535, 3, 0)).unwrap_err(),
            ImageError::TooLarge {
                width: 65535,
                height: 65535,
                max_pixels: MAX_JPEG_PIXELS
            }
        );
        // 16000 x 16000 is under the limit, but 1 byte of data cannot be that image: refused
        // before its 768 MB are allocated.
        let err = decode_jpeg(&headers(0xC0, 8, 16000, 16000, 3, 0)).unwrap_err();
        assert!(matches!(err, ImageError::Truncated { .. }), "{err}");
        // Height 0 (a DNL marker), width 0, a SOS before a SOF, a bad DRI.
        assert!(matches!(
            jpeg_header(&headers(0xC0, 8, 8, 0, 3, 0)).unwrap_err(),
            ImageError::Unsupported { .. }
        ));
        assert!(matches!(
            jpeg_header(&headers(0xC0, 8, 0, 8, 3, 0)).unwrap_err(),
            ImageError::Corrupt { .. }
        ));
        let no_sof = [0xFF, 0xD8, 0xFF, 0xDA, 0, 2, 0xFF, 0xD9];
        assert!(matches!(
            jpeg_header(&no_sof).unwrap_err(),
            ImageError::Corrupt { .. }
        ));
        let mut bad_dri = headers(0xC0, 8, 8, 8, 3, 5);
        let dri = bad_dri
            .windows(2)
            .position(|w| w == [0xFF, 0xDD])
            .expect("DRI");
        bad_dri[dri + 3] = 5;
        assert!(jpeg_header(&bad_dri).is_err());
    }

    #[test]
    fn only_subsampling_of_at_most_2x_each_way_is_decoded() {
        let interleaved = |sampling: Vec<(u8, u8)>| Headers {
            header: JpegHeader {
                width: 8,
                height: 8,
                components: sampling.len() as u8,
                precision: 8,
                progressive: false,
                restart_interval: 0,
            },
            scan_data: 0,
            scan_components: sampling.len() as u8,
            sampling,
        };
        let check_sampling = |s: &Vec<(u8, u8)>| check_sampling(&interleaved(s.clone()));
        let ok = [
            vec![(1, 1), (1, 1), (1, 1)],
            vec![(2, 1), (1, 1), (1, 1)],
            vec![(1, 2), (1, 1), (1, 1)],
            vec![(2, 2), (1, 1), (1, 1)],
            vec![(2, 2), (1, 1), (2, 2)],
            vec![(4, 4), (2, 2), (2, 2)],
            vec![(4, 1)], // gray: one component, not subsampled against another
        ];
        for s in ok {
            assert_eq!(check_sampling(&s), Ok(()), "{s:?}");
        }
        let refused = [
            vec![(4, 1), (1, 1), (1, 1)],
            vec![(1, 4), (1, 1), (1, 1)],
            vec![(2, 4), (1, 1), (1, 1)],
            vec![(4, 2), (1, 1), (1, 1)],
            vec![(3, 1), (1, 1), (1, 1)],
            vec![(3, 1), (2, 1), (1, 1)],
            // chroma finer than luma
            vec![(1, 1), (2, 2), (2, 2)],
            vec![(1, 1), (2, 2), (1, 1)],
            vec![(2, 1), (1, 2), (1, 1)],
        ];
        for s in refused {
            assert!(
                matches!(check_sampling(&s), Err(ImageError::Unsupported { .. })),
                "{s:?}"
            );
        }
        // A sequential JPEG whose first scan holds one of three components (non-interleaved)
        // is refused; a progressive one's first scans may hold one each; a gray one has one.
        let mut one_scan = interleaved(vec![(2, 2), (1, 1), (1, 1)]);
        one_scan.scan_components = 1;
        let e = super::check_sampling(&one_scan).unwrap_err();
        assert!(
            matches!(e, ImageError::Unsupported { ref reason } if reason.contains("non-interleaved")),
            "{e:?}"
        );
        one_scan.header.progressive = true;
        assert_eq!(super::check_sampling(&one_scan), Ok(()));
        let mut gray = interleaved(vec![(1, 1)]);
        gray.scan_components = 1;
        assert_eq!(super::check_sampling(&gray), Ok(()));
        // A factor of 0 or over 4 is corrupt.
        let mut zero = headers(0xC0, 8, 8, 8, 3, 0);
        let sof = zero
            .windows(2)
            .position(|w| w == [0xFF, 0xC0])
            .expect("SOF");
        zero[sof + 11] = 0x01; // the first component's factors: 0x1
        assert!(matches!(
            jpeg_header(&zero).unwrap_err(),
            ImageError::Corrupt { .. }
        ));
    }

    #[test]
    fn other_formats_are_named() {
        let cases: [(&[u8], Option<&str>); 7] = [
            (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", Some("PNG")),
            (b"GIF89a\x01\0\x01\0", Some("GIF")),
            (b"RIFF\x10\0\0\0WEBPVP8 ", Some("WebP")),
            (b"II*\0\x08\0\0\0", Some("TIFF")),
            (b"\0\0\0\x1cftypavif\0\0\0\0", Some("AVIF")),
            (b"<html>", None),
            (b"", None),
        ];
        for (bytes, format) in cases {
            let err = jpeg_header(bytes).unwrap_err();
            let ImageError::NotJpeg { format: got, head } = &err else {
                panic!("{bytes:?}: {err}");
            };
            assert_eq!(*got, format, "{bytes:?}");
            assert_eq!(head.as_slice(), &bytes[..bytes.len().min(8)]);
        }
        let png = jpeg_header(b"\x89PNG\r\n\x1a\n").unwrap_err().to_string();
        assert!(png.starts_with("a PNG file, not a JPEG"), "{png}");
        let html = jpeg_header(b"<html>").unwrap_err().to_string();
        assert!(
            html.starts_with("not a JPEG: starts with 3c 68 74 6d"),
            "{html}"
        );
        // One byte of a JPEG's start: cut short, not another format.
        assert!(matches!(
            jpeg_header(&[0xFF]).unwrap_err(),
            ImageError::Truncated { .. }
        ));
    }

    #[test]
    fn a_named_error_says_the_name_first() {
        let e = ImageError::Cmyk.named("train/cat/1.jpg");
        assert!(
            matches!(&e, Error::Image { name, reason: ImageError::Cmyk } if name == "train/cat/1.jpg")
        );
        assert!(
            e.to_string()
                .starts_with("train/cat/1.jpg: a CMYK JPEG (4 components)"),
            "{e}"
        );
        assert_eq!(OnBadImage::default(), OnBadImage::Error);
    }
}
