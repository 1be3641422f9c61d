//! PNG, JPEG and WebP decoding into the modes Pillow opens them in.
//!
//! PNG (`png` crate, no transformations, so palette and low-bit samples are unpacked here as Pillow unpacks
//! them): gray 1/2/4/8-bit -> `L` (low depths scaled by 255, 85 or 17), gray+alpha -> `LA`, RGB -> `RGB`,
//! RGBA -> `RGBA`, palette -> `P` with `tRNS` alphas, and a gray or RGB `tRNS` color kept as Pillow's
//! `info["transparency"]`; 16-bit RGB/RGBA/LA samples keep their high byte as Pillow does. 16-bit grayscale
//! (Pillow's `I;16`) is refused. JPEG (`zune-jpeg`): gray -> `L`, color -> `RGB`; CMYK is refused. WebP
//! (`image-webp`): `RGBA` when the file has alpha, else `RGB`; the first frame of an animation.

use std::io::Cursor;
use std::path::Path;

use super::{Image, Mode, Transparency};
use crate::{Error, Result};

/// Size limits checked before a file's pixels are decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The largest accepted file, in bytes.
    pub max_file_bytes: usize,
    /// The largest accepted `width * height` (Pillow's decompression-bomb limit is 89,478,485 pixels).
    pub max_pixels: usize,
}

impl Default for Limits {
    /// 64 MiB files and Pillow's 89,478,485-pixel decompression-bomb threshold.
    fn default() -> Self {
        Limits { max_file_bytes: 64 << 20, max_pixels: 89_478_485 }
    }
}

fn bad(name: &str, message: impl std::fmt::Display) -> Error {
    Error::Format { path: name.into(), message: message.to_string() }
}

/// Reads and decodes the image file at `path` (see [`decode`]).
pub fn decode_file(path: &Path, limits: &Limits) -> Result<Image> {
    let meta = std::fs::metadata(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    if meta.len() > limits.max_file_bytes as u64 {
        return Err(bad(
            &path.display().to_string(),
            format!("the file has {} bytes, more than the limit of {}", meta.len(), limits.max_file_bytes),
        ));
    }
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    decode(&bytes, &path.display().to_string(), limits)
}

/// Decodes PNG, JPEG or WebP `bytes` (the format is recognized from the signature). `name` names the input
/// in errors (a path, or e.g. `image 2 of the request`). Files over `limits`, unknown formats and corrupt or
/// truncated data are errors naming the input.
pub fn decode(bytes: &[u8], name: &str, limits: &Limits) -> Result<Image> {
    if bytes.len() > limits.max_file_bytes {
        return Err(bad(name, format!("{} bytes, more than the limit of {}", bytes.len(), limits.max_file_bytes)));
    }
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        decode_png(bytes, name, limits)
    } else if bytes.starts_with(&[0xff, 0xd8, 0xff]) {
        decode_jpeg(bytes, name, limits)
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        decode_webp(bytes, name, limits)
    } else {
        Err(bad(name, "not a PNG, JPEG or WebP image"))
    }
}

fn check_size(name: &str, w: usize, h: usize, limits: &Limits) -> Result<()> {
    if w == 0 || h == 0 {
        return Err(bad(name, format!("the image is {w}x{h} pixels")));
    }
    if w.saturating_mul(h) > limits.max_pixels {
        return Err(bad(
            name,
            format!("the image is {w}x{h} = {} pixels, more than the limit of {}", w * h, limits.max_pixels),
        ));
    }
    Ok(())
}

fn decode_png(bytes: &[u8], name: &str, limits: &Limits) -> Result<Image> {
    use png::{BitDepth, ColorType};
    let mut decoder = png::Decoder::new(Cursor::new(bytes));
    decoder.set_transformations(png::Transformations::IDENTITY);
    // The decoder's own allocation cap: the largest image the pixel limit admits, 16-bit RGBA, plus slack.
    decoder.set_limits(png::Limits { bytes: limits.max_pixels.saturating_mul(8).saturating_add(1 << 20) });
    let png_err = |e: png::DecodingError| bad(name, format!("corrupt PNG: {e}"));
    let mut reader = decoder.read_info().map_err(png_err)?;
    let info = reader.info();
    let (w, h) = (info.width as usize, info.height as usize);
    check_size(name, w, h, limits)?;
    let (color, depth) = (info.color_type, info.bit_depth);
    let trns = info.trns.as_ref().map(|t| t.to_vec());
    let plte = info.palette.as_ref().map(|p| p.to_vec());
    let size = reader.output_buffer_size().ok_or_else(|| bad(name, "the PNG image is too large"))?;
    let mut buf = vec![0u8; size];
    let frame = reader.next_frame(&mut buf).map_err(png_err)?;
    let line = frame.line_size;
    let bits = depth as usize;
    let row = |y: usize| &buf[y * line..(y + 1) * line];
    // Low bit depths: samples packed most significant first.
    let unpack = |y: usize, x: usize| -> u8 {
        let r = row(y);
        let per = 8 / bits;
        let byte = r[x / per];
        let shift = 8 - bits * (x % per + 1);
        (byte >> shift) & ((1u16 << bits) - 1) as u8
    };
    let sixteen = depth == BitDepth::Sixteen;
    let take = |y: usize, channels: usize| -> Vec<u8> {
        let r = row(y);
        if sixteen {
            r.chunks_exact(2).take(w * channels).map(|c| c[0]).collect()
        } else {
            r[..w * channels].to_vec()
        }
    };
    let key16 = |t: &[u8], i: usize| -> u16 { u16::from_be_bytes([t[2 * i], t[2 * i + 1]]) };
    let mut image = match color {
        ColorType::Grayscale => {
            if sixteen {
                return Err(bad(name, "16-bit grayscale PNG is not supported"));
            }
            let scale: u8 = match bits {
                1 => 255,
                2 => 0x55,
                4 => 0x11,
                _ => 1,
            };
            let mut data = Vec::with_capacity(w * h);
            for y in 0..h {
                if bits == 8 {
                    data.extend_from_slice(&row(y)[..w]);
                } else {
                    data.extend((0..w).map(|x| unpack(y, x) * scale));
                }
            }
            let mut im = Image::from_raw(w, h, Mode::L, data)?;
            // The png crate keeps an 8-bit-or-less key's low byte only; Pillow compares low bytes too.
            match trns.as_deref() {
                Some([k]) => im.transparency = Transparency::Gray(u16::from(*k)),
                Some(t) if t.len() >= 2 => im.transparency = Transparency::Gray(key16(t, 0)),
                _ => {}
            }
            im
        }
        ColorType::GrayscaleAlpha => {
            let data = (0..h).flat_map(|y| take(y, 2)).collect();
            Image::from_raw(w, h, Mode::La, data)?
        }
        ColorType::Rgb => {
            let data = (0..h).flat_map(|y| take(y, 3)).collect();
            let mut im = Image::from_raw(w, h, Mode::Rgb, data)?;
            match trns.as_deref() {
                Some([r, g, b]) => im.transparency = Transparency::Rgb([(*r).into(), (*g).into(), (*b).into()]),
                Some(t) if t.len() >= 6 => im.transparency = Transparency::Rgb([key16(t, 0), key16(t, 1), key16(t, 2)]),
                _ => {}
            }
            im
        }
        ColorType::Rgba => {
            let data = (0..h).flat_map(|y| take(y, 4)).collect();
            Image::from_raw(w, h, Mode::Rgba, data)?
        }
        ColorType::Indexed => {
            let plte = plte.ok_or_else(|| bad(name, "a palette PNG without a PLTE chunk"))?;
            let mut palette: Vec<[u8; 4]> = plte.chunks_exact(3).map(|c| [c[0], c[1], c[2], 255]).collect();
            let mut transparency = Transparency::None;
            if let Some(t) = trns.as_deref() {
                transparency = Transparency::Palette;
                for (i, &a) in t.iter().enumerate() {
                    if i < palette.len() {
                        palette[i][3] = a;
                    }
                }
            }
            let mut data = Vec::with_capacity(w * h);
            for y in 0..h {
                if bits == 8 {
                    data.extend_from_slice(&row(y)[..w]);
                } else {
                    data.extend((0..w).map(|x| unpack(y, x)));
                }
            }
            Image { width: w, height: h, mode: Mode::P, data, palette, transparency }
        }
    };
    if image.mode != Mode::P {
        image.palette.clear();
    }
    Ok(image)
}

fn decode_jpeg(bytes: &[u8], name: &str, limits: &Limits) -> Result<Image> {
    use zune_jpeg::zune_core::bytestream::ZCursor;
    use zune_jpeg::zune_core::colorspace::ColorSpace;
    use zune_jpeg::zune_core::options::DecoderOptions;
    let jpeg_err = |e: zune_jpeg::errors::DecodeErrors| bad(name, format!("corrupt JPEG: {e}"));
    let opts = DecoderOptions::default().set_max_width(1 << 16).set_max_height(1 << 16);
    let mut dec = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), opts);
    dec.decode_headers().map_err(jpeg_err)?;
    let info = dec.info().ok_or_else(|| bad(name, "corrupt JPEG: no frame header"))?;
    let (w, h) = (usize::from(info.width), usize::from(info.height));
    check_size(name, w, h, limits)?;
    let (mode, out) = match dec.input_colorspace() {
        Some(ColorSpace::Luma) => (Mode::L, ColorSpace::Luma),
        Some(ColorSpace::YCbCr) | Some(ColorSpace::RGB) => (Mode::Rgb, ColorSpace::RGB),
        other => return Err(bad(name, format!("JPEG color space {other:?} is not supported (only gray and color)"))),
    };
    let opts = DecoderOptions::default().set_max_width(1 << 16).set_max_height(1 << 16).jpeg_set_out_colorspace(out);
    let mut dec = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), opts);
    let data = dec.decode().map_err(jpeg_err)?;
    if data.len() != w * h * mode.bands() {
        return Err(bad(name, format!("corrupt JPEG: {} bytes decoded for {w}x{h}", data.len())));
    }
    Image::from_raw(w, h, mode, data)
}

fn decode_webp(bytes: &[u8], name: &str, limits: &Limits) -> Result<Image> {
    let webp_err = |e: image_webp::DecodingError| bad(name, format!("corrupt WebP: {e}"));
    let mut dec = image_webp::WebPDecoder::new(Cursor::new(bytes)).map_err(webp_err)?;
    let (w, h) = dec.dimensions();
    let (w, h) = (w as usize, h as usize);
    check_size(name, w, h, limits)?;
    dec.set_memory_limit(limits.max_pixels.saturating_mul(4).saturating_add(1 << 20));
    let mode = if dec.has_alpha() { Mode::Rgba } else { Mode::Rgb };
    let size = dec.output_buffer_size().ok_or_else(|| bad(name, "the WebP image is too large"))?;
    if size != w * h * mode.bands() {
        return Err(bad(name, format!("corrupt WebP: {size} output bytes for {w}x{h}")));
    }
    let mut data = vec![0u8; size];
    dec.read_image(&mut data).map_err(webp_err)?;
    Image::from_raw(w, h, mode, data)
}

/// The frames of a video stored as a directory of image files: every `.png`, `.jpg`, `.jpeg` and `.webp`
/// file (case-insensitive), in byte order of their names (`frame_0001.png`, ...), each decoded with
/// `limits`. Other files are ignored; a directory with no frames, or more than `max_frames`, is an error
/// naming it.
pub fn decode_frames_dir(dir: &Path, limits: &Limits, max_frames: usize) -> Result<Vec<Image>> {
    let io = |source| Error::Io { path: dir.to_path_buf(), source };
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
        if path.is_file() && matches!(ext.as_deref(), Some("png" | "jpg" | "jpeg" | "webp")) {
            names.push(path);
        }
    }
    if names.is_empty() {
        return Err(bad(&dir.display().to_string(), "no .png, .jpg or .webp frames in the directory"));
    }
    if names.len() > max_frames {
        return Err(bad(
            &dir.display().to_string(),
            format!("{} frames, more than the limit of {max_frames}", names.len()),
        ));
    }
    names.sort();
    names.iter().map(|p| decode_file(p, limits)).collect()
}
