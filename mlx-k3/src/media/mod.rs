//! Media preprocessing for the vision models: image files -> pixels -> normalized patches, and the prompt
//! side (placeholder expansion).
//!
//! The steps follow the image processors that ship with mlx-vlm 0.7.10 for Kimi K2.5 (`kimi_k25`) and Kimi
//! K3 (`kimi_k3`), which in turn follow the checkpoints' own processors, and they reproduce Pillow's
//! arithmetic where those use Pillow:
//!
//! 1. [`decode`]: PNG, JPEG or WebP bytes -> an [`Image`] in the mode Pillow would open it in (`L`, `LA`,
//!    `RGB`, `RGBA`, or `P` with its palette and transparency), with size limits checked before pixels are
//!    allocated.
//! 2. [`ImageProcessor::process`]: the navit rescale (keep the image under `in_patch_limit` patches and
//!    `patch_limit_on_one_side` patches per side, never upscale, truncate to whole pixels), Pillow's bicubic
//!    resize ([`resize_bicubic`]), K3's transparent-background fill, black padding to a multiple of
//!    `merge_kernel_size * patch_size`, `/255` and mean/std normalization, and patchify into
//!    `[patches, 3, p, p]` in row-major patch order with the grid `(t, h, w)`.
//! 3. [`prompt`]: expanding the chat's image placeholder into the image's tokens.
//!
//! Video is a list of frames ([`decode_video`] samples them from a directory of image files, an animated
//! PNG or WebP, or another video file through FFmpeg; [`decode_frames_dir`] reads a directory whole) cut into
//! chunks of up to [`VIDEO_CHUNK_FRAMES`] ([`ImageProcessor::process_video`]).

mod decode;
mod process;
pub mod prompt;
mod resize;
pub mod video;

pub use decode::{decode, decode_file, decode_frames_dir, Limits};
pub use process::{
    stack, Background, FillStage, ImageProcessor, Processed, ProcessorKind, TimestampMode, VIDEO_CHUNK_FRAMES,
};
pub use video::{decode_video, decode_video_bytes, Video, VideoOptions};

use crate::{Error, Result};

/// Pillow's image modes that the decoders produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// 8-bit grayscale.
    L,
    /// Grayscale with alpha.
    La,
    /// 8-bit RGB.
    Rgb,
    /// RGB with alpha.
    Rgba,
    /// Palette indices into [`Image::palette`].
    P,
}

impl Mode {
    /// Bytes per pixel in [`Image::data`].
    pub fn bands(self) -> usize {
        match self {
            Mode::L | Mode::P => 1,
            Mode::La => 2,
            Mode::Rgb => 3,
            Mode::Rgba => 4,
        }
    }

    /// Pillow's name of the mode.
    pub fn name(self) -> &'static str {
        match self {
            Mode::L => "L",
            Mode::La => "LA",
            Mode::Rgb => "RGB",
            Mode::Rgba => "RGBA",
            Mode::P => "P",
        }
    }
}

/// A transparency that is not an alpha band (Pillow's `info["transparency"]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transparency {
    /// None.
    None,
    /// A palette image's per-entry alphas (in [`Image::palette`]).
    Palette,
    /// A grayscale image's transparent value (PNG `tRNS`, compared with the 8-bit samples as Pillow does).
    Gray(u16),
    /// An RGB image's transparent color (PNG `tRNS`).
    Rgb([u16; 3]),
}

/// A decoded image: `height` rows of `width` pixels of `mode.bands()` bytes each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// The pixel layout.
    pub mode: Mode,
    /// Row-major interleaved samples.
    pub data: Vec<u8>,
    /// For [`Mode::P`]: the palette as RGBA (alpha 255 where the file gives none).
    pub palette: Vec<[u8; 4]>,
    /// Transparency carried outside an alpha band.
    pub transparency: Transparency,
}

impl Image {
    /// An image from raw samples (`data.len()` must be `width * height * mode.bands()`; not for palettes).
    pub fn from_raw(width: usize, height: usize, mode: Mode, data: Vec<u8>) -> Result<Image> {
        if mode == Mode::P || data.len() != width * height * mode.bands() {
            return Err(Error::invalid(
                "media",
                format!("{} bytes for a {width}x{height} {} image", data.len(), mode.name()),
            ));
        }
        Ok(Image { width, height, mode, data, palette: Vec::new(), transparency: Transparency::None })
    }

    /// Whether Pillow would see transparency: an alpha band or `info["transparency"]`.
    pub fn has_transparency(&self) -> bool {
        matches!(self.mode, Mode::La | Mode::Rgba) || self.transparency != Transparency::None
    }

    fn palette_entry(&self, i: u8) -> [u8; 4] {
        // Pillow fills a short palette with black; indices past it read zeros too.
        self.palette.get(usize::from(i)).copied().unwrap_or([0, 0, 0, 255])
    }

    /// `image.convert("RGB")`: gray replicated, alpha and transparency dropped, palette looked up.
    pub fn to_rgb(&self) -> Image {
        let n = self.width * self.height;
        let mut out = Vec::with_capacity(n * 3);
        match self.mode {
            Mode::Rgb => out.extend_from_slice(&self.data),
            Mode::Rgba => self.data.chunks_exact(4).for_each(|p| out.extend_from_slice(&p[..3])),
            Mode::L => self.data.iter().for_each(|&v| out.extend_from_slice(&[v, v, v])),
            Mode::La => self.data.chunks_exact(2).for_each(|p| out.extend_from_slice(&[p[0], p[0], p[0]])),
            Mode::P => self.data.iter().for_each(|&i| out.extend_from_slice(&self.palette_entry(i)[..3])),
        }
        Image {
            width: self.width,
            height: self.height,
            mode: Mode::Rgb,
            data: out,
            palette: Vec::new(),
            transparency: Transparency::None,
        }
    }

    /// `image.convert("RGBA")`: palette alphas applied, a gray or RGB transparent color made alpha 0.
    pub fn to_rgba(&self) -> Image {
        let n = self.width * self.height;
        let mut out = Vec::with_capacity(n * 4);
        match self.mode {
            Mode::Rgba => out.extend_from_slice(&self.data),
            Mode::Rgb => self.data.chunks_exact(3).for_each(|p| out.extend_from_slice(&[p[0], p[1], p[2], 255])),
            Mode::L => self.data.iter().for_each(|&v| out.extend_from_slice(&[v, v, v, 255])),
            Mode::La => self.data.chunks_exact(2).for_each(|p| out.extend_from_slice(&[p[0], p[0], p[0], p[1]])),
            Mode::P => self.data.iter().for_each(|&i| out.extend_from_slice(&self.palette_entry(i))),
        }
        // Pillow's convert_transparent: a pixel whose converted color equals the key (each channel's low
        // byte) loses its alpha.
        let key = match (self.mode, self.transparency) {
            (Mode::L, Transparency::Gray(g)) => Some([g as u8; 3]),
            (Mode::Rgb, Transparency::Rgb(c)) => Some([c[0] as u8, c[1] as u8, c[2] as u8]),
            _ => None,
        };
        if let Some(k) = key {
            for p in out.chunks_exact_mut(4) {
                if p[..3] == k {
                    p[3] = 0;
                }
            }
        }
        Image {
            width: self.width,
            height: self.height,
            mode: Mode::Rgba,
            data: out,
            palette: Vec::new(),
            transparency: Transparency::None,
        }
    }
}

/// `image.resize((width, height), Image.Resampling.BICUBIC)`, byte-identical to Pillow 13 for `L`, `LA`,
/// `RGB` and `RGBA` images (a palette image is converted to RGBA first).
pub fn resize_bicubic(image: &Image, width: usize, height: usize) -> Result<Image> {
    if width == 0 || height == 0 {
        return Err(Error::invalid("media", format!("cannot resize to {width}x{height}")));
    }
    if image.mode == Mode::P {
        return Ok(resize::resize_bicubic(&image.to_rgba(), width, height));
    }
    Ok(resize::resize_bicubic(image, width, height))
}
