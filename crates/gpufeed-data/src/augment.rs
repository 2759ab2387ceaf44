//! The training images' crops, resize, flip and normalization, on the CPU: the reference the
//! GPU kernels of issue 40 are to match, and the path where there is no GPU.
//!
//! - [`random_resized_crop`]: torchvision's `RandomResizedCrop.get_params` (an area of
//!   `scale` of the image's, a width-to-height ratio of `ratio`, log-uniform; ten tries, then
//!   the central crop of the closest ratio), drawn from a generator seeded by the run's seed,
//!   the epoch and the record's index, so the same record gets the same crop in an epoch
//!   whatever the worker count or world size (the elastic order's promise).
//! - [`center_crop`]: the central square a `Resize(s)` + `CenterCrop(c)` evaluation keeps.
//! - [`resize_crop`]: a crop resized by bilinear interpolation with antialiasing (the filter
//!   widened by the scale when shrinking), as torch's `interpolate(mode="bilinear",
//!   antialias=True, align_corners=False)` and torchvision's `resize(antialias=True)` compute
//!   it, in `f32`, then flipped where asked.
//! - [`to_u8`], [`normalize_chw`]: the output as `uint8` HWC, or `f32` CHW normalized.

use crate::error::{Error, Result};
use gpufeed_cuda::resize::resize_weights as weights;

use crate::sampler::splitmix64;

/// A rectangle of an image, in pixels: its left and top, width and height.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Crop {
    /// Left column.
    pub x: u32,
    /// Top row.
    pub y: u32,
    /// Columns.
    pub width: u32,
    /// Rows.
    pub height: u32,
}

/// How each image of a batch is cropped and mirrored before its resize: a training draw
/// (torchvision's `RandomResizedCrop(scale, ratio)` and `RandomHorizontalFlip()`, from the
/// seed, the epoch and the record's index alone: [`random_resized_crop`], [`random_flip`]) or
/// the evaluation crop ([`center_crop`] of `crop_fraction`, never mirrored).
///
/// ```
/// use gpufeed_data::Augmentation;
/// let train = Augmentation::train(7);
/// train.check()?;
/// let (crop, flip) = train.choose(0, 42, 500, 375);
/// assert_eq!((crop, flip), train.choose(0, 42, 500, 375)); // the same record, the same draw
/// let (crop, flip) = Augmentation::Eval { crop_fraction: 0.875 }.choose(0, 42, 500, 375);
/// assert_eq!((crop.width, crop.height, flip), (328, 328, false));
/// # Ok::<(), gpufeed_data::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Augmentation {
    /// Training: a random resized crop and a coin for the mirror.
    Train {
        /// The run's seed.
        seed: u64,
        /// The crop's share of the image's area, `(low, high)`.
        scale: (f64, f64),
        /// The crop's width over its height, `(low, high)`.
        ratio: (f64, f64),
    },
    /// Evaluation: the central square of `crop_fraction` of the shorter side.
    Eval {
        /// In `(0, 1]`: 224 / 256 for the usual `Resize(256)` + `CenterCrop(224)`.
        crop_fraction: f64,
    },
}

impl Augmentation {
    /// Training draws of `seed` with torchvision's default ranges (`scale` `(0.08, 1.0)`,
    /// `ratio` `(3/4, 4/3)`).
    pub fn train(seed: u64) -> Self {
        Augmentation::Train {
            seed,
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
        }
    }

    /// Whether the settings are usable: ranges positive, finite and `(low, high)`; a crop
    /// fraction in `(0, 1]`.
    ///
    /// # Errors
    /// [`Error::invalid`] saying which.
    pub fn check(&self) -> Result<()> {
        match *self {
            Augmentation::Train { scale, ratio, .. } => {
                random_resized_crop(2, 2, scale, ratio, 0, 0, 0).map(|_| ())
            }
            Augmentation::Eval { crop_fraction } if crop_fraction > 0.0 && crop_fraction <= 1.0 => {
                Ok(())
            }
            Augmentation::Eval { crop_fraction } => Err(Error::invalid(format!(
                "crop fraction {crop_fraction} is not in (0, 1]"
            ))),
        }
    }

    /// The crop of record `index`'s `width` x `height` image in `epoch`, and whether it is
    /// mirrored. Settings that fail [`Augmentation::check`] give the whole image.
    pub fn choose(&self, epoch: u64, index: u64, width: u32, height: u32) -> (Crop, bool) {
        match *self {
            Augmentation::Train { seed, scale, ratio } => {
                let crop = random_resized_crop(width, height, scale, ratio, seed, epoch, index)
                    .unwrap_or_else(|_| center_crop(width, height, 1.0));
                (crop, random_flip(seed, epoch, index))
            }
            Augmentation::Eval { crop_fraction } => {
                (center_crop(width, height, crop_fraction), false)
            }
        }
    }
}

/// A uniform `f64` in `[0, 1)` from `state`.
fn uniform(state: &mut u64) -> f64 {
    (splitmix64(state) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The crop torchvision's `RandomResizedCrop(scale, ratio)` takes of a `width` x `height`
/// image (see the module), drawn from `seed`, `epoch` and `index` alone. `scale` is the
/// crop's share of the image's area, `ratio` its width over height (torchvision's defaults:
/// `(0.08, 1.0)`, `(3/4, 4/3)`).
///
/// # Errors
/// [`Error::invalid`] for an empty image or ranges that are empty, reversed or not positive.
///
/// # Example
/// ```
/// let crop = gpufeed_data::random_resized_crop(500, 375, (0.08, 1.0), (0.75, 4.0 / 3.0), 7, 0, 42)?;
/// assert!(crop.x + crop.width <= 500 && crop.y + crop.height <= 375);
/// // the same record, epoch and seed: the same crop
/// assert_eq!(crop, gpufeed_data::random_resized_crop(500, 375, (0.08, 1.0), (0.75, 4.0 / 3.0), 7, 0, 42)?);
/// # Ok::<(), gpufeed_data::Error>(())
/// ```
pub fn random_resized_crop(
    width: u32,
    height: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
    seed: u64,
    epoch: u64,
    index: u64,
) -> Result<Crop> {
    if width == 0 || height == 0 {
        return Err(Error::invalid(format!(
            "a {width}x{height} image has nothing to crop"
        )));
    }
    let ranges_ok = scale.0 > 0.0
        && scale.0 <= scale.1
        && ratio.0 > 0.0
        && ratio.0 <= ratio.1
        && scale.1.is_finite()
        && ratio.1.is_finite();
    if !ranges_ok {
        return Err(Error::invalid(format!(
            "RandomResizedCrop's scale {scale:?} and ratio {ratio:?} must be positive, finite \
             and (low, high)"
        )));
    }
    let mut state = seed
        ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03);
    // Mixed once more, so that neighbouring indices do not start from neighbouring states.
    state = splitmix64(&mut state);
    let (w_img, h_img) = (f64::from(width), f64::from(height));
    let area = w_img * h_img;
    let (log_lo, log_hi) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target = area * (scale.0 + (scale.1 - scale.0) * uniform(&mut state));
        let aspect = (log_lo + (log_hi - log_lo) * uniform(&mut state)).exp();
        let w = (target * aspect).sqrt().round_ties_even();
        let h = (target / aspect).sqrt().round_ties_even();
        if w > 0.0 && w <= w_img && h > 0.0 && h <= h_img {
            let (w, h) = (w as u32, h as u32);
            let y = (uniform(&mut state) * f64::from(height - h + 1)) as u32;
            let x = (uniform(&mut state) * f64::from(width - w + 1)) as u32;
            return Ok(Crop {
                x: x.min(width - w),
                y: y.min(height - h),
                width: w,
                height: h,
            });
        }
    }
    // torchvision's fallback: the central crop of the ratio nearest the image's.
    let in_ratio = w_img / h_img;
    let (w, h) = if in_ratio < ratio.0 {
        (
            width,
            ((w_img / ratio.0).round_ties_even() as u32).clamp(1, height),
        )
    } else if in_ratio > ratio.1 {
        (
            ((h_img * ratio.1).round_ties_even() as u32).clamp(1, width),
            height,
        )
    } else {
        (width, height)
    };
    Ok(Crop {
        x: (width - w) / 2,
        y: (height - h) / 2,
        width: w,
        height: h,
    })
}

/// Whether record `index` is mirrored in `epoch` (torchvision's `RandomHorizontalFlip(0.5)`),
/// drawn from `seed`, `epoch` and `index` alone (a generator of its own: independent of the
/// crop's).
pub fn random_flip(seed: u64, epoch: u64, index: u64) -> bool {
    let mut state = seed.rotate_left(17)
        ^ epoch.wrapping_mul(0xD6E8_FEB8_6659_FD93)
        ^ index.wrapping_mul(0xA076_1D64_78BD_642F);
    splitmix64(&mut state) >> 63 == 1
}

/// The central square of side `fraction` of the shorter side (at least one pixel) of a
/// `width` x `height` image: what `Resize(s)` then `CenterCrop(c)` keeps, for `fraction = c /
/// s` (224 / 256 for the usual evaluation), before the resize.
pub fn center_crop(width: u32, height: u32, fraction: f64) -> Crop {
    let side = (f64::from(width.min(height)) * fraction.clamp(0.0, 1.0))
        .round_ties_even()
        .max(1.0) as u32;
    let side = side.min(width.max(1)).min(height.max(1));
    // torchvision's CenterCrop: the offsets rounded (halves to even, as Python's `round`).
    let half = |room: u32| (f64::from(room) / 2.0).round_ties_even() as u32;
    Crop {
        x: half(width.saturating_sub(side)),
        y: half(height.saturating_sub(side)),
        width: side,
        height: side,
    }
}

/// `crop` of the RGB image `pixels` (`width` x `height`, HWC, 3 bytes a pixel) resized to
/// `out_width` x `out_height` (see the module), mirrored left to right where `flip`: HWC `f32`
/// values in 0..=255, not rounded.
///
/// # Errors
/// [`Error::invalid`] where `pixels` is not `3 * width * height` bytes, the crop is empty or
/// leaves the image, or the output is empty.
pub fn resize_crop(
    pixels: &[u8],
    width: u32,
    height: u32,
    crop: Crop,
    out_width: u32,
    out_height: u32,
    flip: bool,
) -> Result<Vec<f32>> {
    let (w, h) = (width as usize, height as usize);
    if pixels.len() != 3 * w * h {
        return Err(Error::invalid(format!(
            "{} bytes are not a {width}x{height} RGB image ({} bytes)",
            pixels.len(),
            3 * w * h
        )));
    }
    let inside = crop.width > 0
        && crop.height > 0
        && u64::from(crop.x) + u64::from(crop.width) <= u64::from(width)
        && u64::from(crop.y) + u64::from(crop.height) <= u64::from(height);
    if !inside || out_width == 0 || out_height == 0 {
        return Err(Error::invalid(format!(
            "crop {crop:?} of a {width}x{height} image to {out_width}x{out_height}: the crop \
             must lie inside the image and both be non-empty"
        )));
    }
    let (cw, ch) = (crop.width as usize, crop.height as usize);
    let (ow, oh) = (out_width as usize, out_height as usize);
    let (cx, cy) = (crop.x as usize, crop.y as usize);
    // Across first (the crop's rows to `ow` columns), then down.
    let across = weights(cw, ow);
    let mut rows = vec![0f32; ch * ow * 3];
    for r in 0..ch {
        let src = &pixels[((cy + r) * w + cx) * 3..((cy + r) * w + cx + cw) * 3];
        for (o, (lo, ws)) in across.iter().enumerate() {
            let mut acc = [0f32; 3];
            for (k, &wt) in ws.iter().enumerate() {
                let p = &src[(lo + k) * 3..(lo + k) * 3 + 3];
                for c in 0..3 {
                    acc[c] += wt * f32::from(p[c]);
                }
            }
            rows[(r * ow + o) * 3..(r * ow + o) * 3 + 3].copy_from_slice(&acc);
        }
    }
    let down = weights(ch, oh);
    let mut out = vec![0f32; oh * ow * 3];
    for (o, (lo, ws)) in down.iter().enumerate() {
        for x in 0..ow {
            let mut acc = [0f32; 3];
            for (k, &wt) in ws.iter().enumerate() {
                let p = &rows[((lo + k) * ow + x) * 3..((lo + k) * ow + x) * 3 + 3];
                for c in 0..3 {
                    acc[c] += wt * p[c];
                }
            }
            let to = if flip { ow - 1 - x } else { x };
            out[(o * ow + to) * 3..(o * ow + to) * 3 + 3].copy_from_slice(&acc);
        }
    }
    Ok(out)
}

/// `values` (0..=255) rounded to the nearest `u8` (halves to even), clamped.
pub fn to_u8(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .map(|v| v.round_ties_even().clamp(0.0, 255.0) as u8)
        .collect()
}

/// HWC `values` (0..=255) of a `width` x `height` image as CHW `f32`, each channel `c` as
/// `(v / 255 - mean[c]) / std[c]` (torchvision's `ToTensor` then `Normalize(mean, std)`).
///
/// # Errors
/// [`Error::invalid`] where `values` is not `3 * width * height` long or a `std` is 0.
pub fn normalize_chw(
    values: &[f32],
    width: u32,
    height: u32,
    mean: [f32; 3],
    std: [f32; 3],
) -> Result<Vec<f32>> {
    let n = width as usize * height as usize;
    if values.len() != 3 * n || std.contains(&0.0) {
        return Err(Error::invalid(format!(
            "{} values for a {width}x{height} RGB image ({}), std {std:?}: give 3 values a \
             pixel and a non-zero std",
            values.len(),
            3 * n
        )));
    }
    let mut out = vec![0f32; 3 * n];
    for (i, p) in values.chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * n + i] = (p[c] / 255.0 - mean[c]) / std[c];
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_output_positions_weights_sum_to_one_and_lie_inside_the_input() {
        for (input, output) in [
            (500, 224),
            (224, 500),
            (7, 3),
            (3, 7),
            (1, 5),
            (5, 1),
            (224, 224),
        ] {
            for (i, (lo, ws)) in weights(input, output).iter().enumerate() {
                let sum: f32 = ws.iter().sum();
                assert!((sum - 1.0).abs() < 1e-5, "{input}->{output} at {i}: {sum}");
                assert!(lo + ws.len() <= input, "{input}->{output} at {i}");
            }
        }
        // the same size: each output the input pixel itself
        for (i, (lo, ws)) in weights(9, 9).iter().enumerate() {
            let at: Vec<usize> = (0..ws.len())
                .filter(|&k| ws[k] > 0.0)
                .map(|k| lo + k)
                .collect();
            assert_eq!(at, vec![i]);
        }
    }

    #[test]
    fn crops_are_inside_repeatable_and_within_the_ranges() {
        let (scale, ratio) = ((0.08, 1.0), (0.75, 4.0 / 3.0));
        let mut different = 0;
        for index in 0..2000u64 {
            let (w, h) = (100 + (index % 400) as u32, 60 + (index % 313) as u32);
            let c = random_resized_crop(w, h, scale, ratio, 3, 1, index).expect("crop");
            assert_eq!(
                c,
                random_resized_crop(w, h, scale, ratio, 3, 1, index).expect("again")
            );
            assert!(c.width >= 1 && c.height >= 1, "{c:?}");
            assert!(
                c.x + c.width <= w && c.y + c.height <= h,
                "{c:?} of {w}x{h}"
            );
            let share = f64::from(c.width * c.height) / f64::from(w * h);
            assert!(
                (0.05..=1.0 + 1e-9).contains(&share),
                "{c:?} of {w}x{h}: {share}"
            );
            if c != random_resized_crop(w, h, scale, ratio, 3, 2, index).expect("next epoch") {
                different += 1;
            }
        }
        assert!(
            different > 1900,
            "another epoch gives another crop: {different} of 2000"
        );
        let flips = (0..2000u64).filter(|&i| random_flip(3, 1, i)).count();
        assert!((900..1100).contains(&flips), "{flips} of 2000 flipped");
        assert!((0..100u64).all(|i| random_flip(3, 1, i) == random_flip(3, 1, i)));
        assert!(random_resized_crop(0, 5, scale, ratio, 0, 0, 0).is_err());
        assert!(random_resized_crop(5, 5, (0.5, 0.1), ratio, 0, 0, 0).is_err());
        assert!(random_resized_crop(5, 5, scale, (0.0, 1.0), 0, 0, 0).is_err());
        // an image far wider than any ratio allows: the fallback, a central crop of ratio 4/3
        let c = random_resized_crop(1000, 10, (0.99, 1.0), ratio, 0, 0, 0).expect("fallback");
        assert_eq!(
            c,
            Crop {
                x: 493,
                y: 0,
                width: 13,
                height: 10
            }
        );
    }

    #[test]
    fn a_resize_to_the_same_size_is_the_crop_and_a_flip_mirrors_it() {
        let (w, h) = (7u32, 5u32);
        let pixels: Vec<u8> = (0..3 * w * h).map(|i| (i * 37 % 251) as u8).collect();
        let crop = Crop {
            x: 2,
            y: 1,
            width: 4,
            height: 3,
        };
        let same = resize_crop(&pixels, w, h, crop, 4, 3, false).expect("resize");
        let flipped = resize_crop(&pixels, w, h, crop, 4, 3, true).expect("flip");
        for y in 0..3usize {
            for x in 0..4usize {
                for c in 0..3usize {
                    let src = pixels[((1 + y) * 7 + 2 + x) * 3 + c];
                    assert_eq!(same[(y * 4 + x) * 3 + c], f32::from(src));
                    assert_eq!(flipped[(y * 4 + 3 - x) * 3 + c], f32::from(src));
                }
            }
        }
        assert_eq!(to_u8(&same), {
            let mut v = Vec::new();
            for y in 1..4usize {
                v.extend_from_slice(&pixels[(y * 7 + 2) * 3..(y * 7 + 6) * 3]);
            }
            v
        });
        let outside = Crop { x: 5, ..crop };
        assert!(resize_crop(&pixels, w, h, outside, 4, 3, false).is_err());
        assert!(resize_crop(&pixels[1..], w, h, crop, 4, 3, false).is_err());
        assert!(resize_crop(&pixels, w, h, crop, 0, 3, false).is_err());
    }

    #[test]
    fn normalizing_gives_chw_planes() {
        let hwc = [255.0, 0.0, 127.5, 0.0, 255.0, 127.5];
        let chw = normalize_chw(&hwc, 2, 1, [0.5; 3], [0.5; 3]).expect("normalize");
        assert_eq!(chw, vec![1.0, -1.0, -1.0, 1.0, 0.0, 0.0]);
        assert!(normalize_chw(&hwc, 2, 1, [0.5; 3], [0.0, 1.0, 1.0]).is_err());
        assert!(normalize_chw(&hwc[1..], 2, 1, [0.5; 3], [1.0; 3]).is_err());
    }

    #[test]
    fn a_centre_crop_is_the_middle_square() {
        assert_eq!(
            center_crop(500, 375, 224.0 / 256.0),
            Crop {
                x: 86,
                y: 24,
                width: 328,
                height: 328
            }
        );
        assert_eq!(
            center_crop(1, 1, 0.875),
            Crop {
                x: 0,
                y: 0,
                width: 1,
                height: 1
            }
        );
    }
}
