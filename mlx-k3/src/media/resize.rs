//! Pillow's `Image.resize(..., BICUBIC)` for 8-bit images, pixel for pixel.
//!
//! Pillow resizes in two separable passes (horizontal, then vertical), each a convolution with the bicubic
//! kernel (`a = -0.5`, support 2) stretched by the downscale factor so a shrink averages every source pixel.
//! The per-output weights are computed in double precision, normalized to sum to one, then rounded to signed
//! fixed point with 22 fractional bits; each output sample is the integer sum plus one half, shifted down and
//! clamped to 0..=255. Bands with alpha are resized premultiplied (`RGBA` -> `RGBa` -> resize -> `RGBA`, the
//! same for `LA`), with Pillow's integer premultiply/unpremultiply rounding. Every step here follows that
//! arithmetic exactly, so the output is byte-identical to Pillow 13's; `tests/media.rs` checks it against
//! images Pillow resized.

use super::{Image, Mode};

/// Fractional bits of the fixed-point weights (32 bits minus 8 for the sample, minus 2 of headroom).
const PRECISION_BITS: u32 = 32 - 8 - 2;

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// One pass's weights: for each output index, the first source index and its fixed-point weights.
struct Coeffs {
    bounds: Vec<(usize, usize)>,
    ksize: usize,
    weights: Vec<i32>,
}

fn coeffs(in_size: usize, out_size: usize) -> Coeffs {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's `(int)` truncates toward zero; the clamps below make the sign irrelevant.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = xmax.saturating_sub(xmin);
        let mut ww = 0.0;
        for (x, kx) in k.iter_mut().enumerate().take(n) {
            let w = bicubic((x as f64 + xmin as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        for x in 0..n {
            if ww != 0.0 {
                k[x] /= ww;
            }
            let v = k[x] * (1u32 << PRECISION_BITS) as f64;
            weights[xx * ksize + x] = if k[x] < 0.0 { (-0.5 + v) as i32 } else { (0.5 + v) as i32 };
        }
        bounds.push((xmin, n));
    }
    Coeffs { bounds, ksize, weights }
}

fn clip8(v: i32) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resamples `bands` interleaved 8-bit channels of a `w x h` image along x to `out_w`, for rows
/// `y0..y0 + rows`.
fn horizontal(src: &[u8], w: usize, bands: usize, y0: usize, rows: usize, out_w: usize) -> Vec<u8> {
    let c = coeffs(w, out_w);
    let mut out = vec![0u8; out_w * rows * bands];
    for y in 0..rows {
        let row = &src[(y0 + y) * w * bands..(y0 + y + 1) * w * bands];
        for xx in 0..out_w {
            let (xmin, n) = c.bounds[xx];
            let k = &c.weights[xx * c.ksize..xx * c.ksize + n];
            for b in 0..bands {
                let mut ss: i32 = 1 << (PRECISION_BITS - 1);
                for (x, &kx) in k.iter().enumerate() {
                    ss = ss.wrapping_add(i32::from(row[(xmin + x) * bands + b]).wrapping_mul(kx));
                }
                out[(y * out_w + xx) * bands + b] = clip8(ss);
            }
        }
    }
    out
}

fn vertical(src: &[u8], w: usize, bands: usize, c: &Coeffs, row_offset: usize, out_h: usize) -> Vec<u8> {
    let stride = w * bands;
    let mut out = vec![0u8; stride * out_h];
    for yy in 0..out_h {
        let (ymin, n) = c.bounds[yy];
        let k = &c.weights[yy * c.ksize..yy * c.ksize + n];
        for i in 0..stride {
            let mut ss: i32 = 1 << (PRECISION_BITS - 1);
            for (y, &ky) in k.iter().enumerate() {
                ss = ss.wrapping_add(i32::from(src[(ymin - row_offset + y) * stride + i]).wrapping_mul(ky));
            }
            out[yy * stride + i] = clip8(ss);
        }
    }
    out
}

/// Pillow's `ImagingResample` (bicubic, whole-image box) on `bands` interleaved channels.
fn resample(src: &[u8], w: usize, h: usize, bands: usize, out_w: usize, out_h: usize) -> Vec<u8> {
    let vc = coeffs(h, out_h);
    let need_h = out_w != w;
    let need_v = out_h != h;
    let (mut cur, mut cur_w, mut offset) = (None::<Vec<u8>>, w, 0usize);
    if need_h {
        // Only the rows the vertical pass reads are resampled horizontally.
        let first = vc.bounds[0].0;
        let last = vc.bounds[out_h - 1].0 + vc.bounds[out_h - 1].1;
        cur = Some(horizontal(src, w, bands, first, last - first, out_w));
        cur_w = out_w;
        offset = first;
    }
    if need_v {
        let input = cur.as_deref().unwrap_or(src);
        return vertical(input, cur_w, bands, &vc, offset, out_h);
    }
    cur.unwrap_or_else(|| src.to_vec())
}

/// Pillow's `MULDIV255`: `a * b / 255` rounded, in integers.
fn muldiv255(a: u8, b: u8) -> u8 {
    let t = u32::from(a) * u32::from(b) + 128;
    (((t >> 8) + t) >> 8) as u8
}

fn unpremultiply(v: u8, alpha: u8) -> u8 {
    if alpha == 255 || alpha == 0 {
        v
    } else {
        ((255 * u32::from(v)) / u32::from(alpha)).min(255) as u8
    }
}

/// `image.resize((out_w, out_h), Image.BICUBIC)` as Pillow 13 computes it. A palette image must be converted
/// first (Pillow would resize it with nearest-neighbour sampling; no processor path does that).
pub(crate) fn resize_bicubic(image: &Image, out_w: usize, out_h: usize) -> Image {
    if image.width == out_w && image.height == out_h {
        return image.clone();
    }
    let (w, h) = (image.width, image.height);
    let data = match image.mode {
        Mode::L | Mode::Rgb => resample(&image.data, w, h, image.mode.bands(), out_w, out_h),
        Mode::P => unreachable!("palette images are converted before resizing"),
        Mode::La | Mode::Rgba => {
            let bands = image.mode.bands();
            let mut pre = image.data.clone();
            for px in pre.chunks_exact_mut(bands) {
                let a = px[bands - 1];
                for v in &mut px[..bands - 1] {
                    *v = muldiv255(*v, a);
                }
            }
            let mut out = resample(&pre, w, h, bands, out_w, out_h);
            for px in out.chunks_exact_mut(bands) {
                let a = px[bands - 1];
                for v in &mut px[..bands - 1] {
                    *v = unpremultiply(*v, a);
                }
            }
            out
        }
    };
    Image { width: out_w, height: out_h, mode: image.mode, data, palette: Vec::new(), transparency: image.transparency }
}
