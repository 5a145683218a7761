//! Images as PNG: the shape checks of an image summary and the encoder.

use crate::error::ImageError;

/// Checks an image's shape; on success returns `(width, height)` as the `i32`s the
/// `Image` message holds.
///
/// The one image rule: the binding checks queued images with it, the encoder again.
pub fn check_image_shape(
    width: u64,
    height: u64,
    channels: u64,
    len: usize,
) -> std::result::Result<(i32, i32), ImageError> {
    if !(1..=4).contains(&channels) {
        return Err(ImageError::UnsupportedChannels { channels });
    }
    if width == 0 || height == 0 {
        return Err(ImageError::Empty { width, height });
    }
    let (Ok(w), Ok(h)) = (i32::try_from(width), i32::try_from(height)) else {
        return Err(ImageError::TooLarge { width, height });
    };
    // width * height * channels can reach 2^72; in u128 no overflow lets a wrong length pass.
    let expected = u128::from(width) * u128::from(height) * u128::from(channels);
    if u128::try_from(len).ok() != Some(expected) {
        return Err(ImageError::PixelCountMismatch {
            width,
            height,
            channels,
            len,
        });
    }
    Ok((w, h))
}

/// Checks the shape of an image as `put_image` takes it: `(C, H, W)` with C in 1..=4 and
/// H, W positive (the same rule `check_image_shape` applies to the pixels later).
pub fn check_chw(shape: &[i64]) -> std::result::Result<(u64, u64, u64), ImageError> {
    let [c, h, w] = shape else {
        return Err(ImageError::NotChw {
            shape: shape.to_vec(),
        });
    };
    let (c, h, w) = (
        u64::try_from(*c).unwrap_or(0),
        u64::try_from(*h).unwrap_or(0),
        u64::try_from(*w).unwrap_or(0),
    );
    if !(1..=4).contains(&c) {
        return Err(ImageError::UnsupportedChannels { channels: c });
    }
    if h == 0 || w == 0 {
        return Err(ImageError::Empty {
            width: w,
            height: h,
        });
    }
    if i32::try_from(w).is_err() || i32::try_from(h).is_err() {
        return Err(ImageError::TooLarge {
            width: w,
            height: h,
        });
    }
    Ok((c, h, w))
}

/// Encodes row-major HWC uint8 `pixels` (1 to 4 channels) as an 8-bit PNG file.
pub fn encode_png(
    width: u32,
    height: u32,
    channels: u8,
    pixels: &[u8],
) -> std::result::Result<Vec<u8>, ImageError> {
    check_image_shape(
        u64::from(width),
        u64::from(height),
        u64::from(channels),
        pixels.len(),
    )?;
    let color = match channels {
        1 => png::ColorType::Grayscale,
        2 => png::ColorType::GrayscaleAlpha,
        3 => png::ColorType::Rgb,
        _ => png::ColorType::Rgba,
    };
    let mut png_bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut png_bytes, width, height);
    encoder.set_color(color);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(pixels)?;
    // finish() writes IEND; without it the file is truncated.
    writer.finish()?;
    Ok(png_bytes)
}
