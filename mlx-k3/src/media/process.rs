//! The image processors of Kimi K2.5 and Kimi K3: rescale, resize, background fill, pad, normalize,
//! patchify.

use std::path::Path;

use serde_json::Value;

use super::{resize, Image, Mode};
use crate::{Array, Error, Result};

/// Which model family's processor (they differ in defaults, in K3's transparent-background fill, in the
/// floating-point precision of normalization and in the grid's shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessorKind {
    /// Kimi K2.5 / K2.7 (`KimiK25ImageProcessor`).
    K25,
    /// Kimi K3 (`KimiK3ImageProcessor`).
    K3,
}

/// K3's `transparent_bg_config`: what transparent pixels are composited onto.
#[derive(Clone, Debug, PartialEq)]
pub enum Background {
    /// One gray level (`white` 255, `black` 0, `gray` 128).
    Solid(u8),
    /// A checkerboard of `square`-pixel squares of the `white` and `gray` levels (see [`Background::level`]).
    Chessboard {
        /// `chessboard_square_size` (default 16).
        square: usize,
        /// `chessboard_square_on_top_left` (default true).
        on_top_left: bool,
        /// `chessboard_white_value` (default 255).
        white: u8,
        /// `chessboard_gray_value` (default 200).
        gray: u8,
    },
}

impl Background {
    /// The background level at pixel `(x, y)`. The reference paints the gray squares where
    /// `(row block + column block) % 2 == 1` when `on_top_left` is set, so the top-left square is white.
    pub fn level(&self, x: usize, y: usize) -> u8 {
        match *self {
            Background::Solid(v) => v,
            Background::Chessboard { square, on_top_left, white, gray } => {
                let parity = (y / square + x / square) % 2;
                if parity == usize::from(on_top_left) {
                    gray
                } else {
                    white
                }
            }
        }
    }
}

/// `transparent_bg_fill_stage`: composite before the resize (the default) or after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FillStage {
    /// `before_resize`.
    BeforeResize,
    /// Any other value (the reference treats every other string as "after").
    AfterResize,
}

/// The parameters of an image processor (`media_proc_cfg` of the checkpoint's `preprocessor_config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct ImageProcessor {
    /// The family whose rules apply.
    pub kind: ProcessorKind,
    /// Patch side in pixels (default 14).
    pub patch_size: usize,
    /// Per-channel mean (default 0.5).
    pub image_mean: [f64; 3],
    /// Per-channel standard deviation (default 0.5).
    pub image_std: [f64; 3],
    /// The most patches an image may have (`in_patch_limit`; K2.5's default 16384, K3's 65536).
    pub in_patch_limit: usize,
    /// Patches merged into one token, `[h, w]` (default `[2, 2]`).
    pub merge_kernel_size: [usize; 2],
    /// The most patches along one side (default 512).
    pub patch_limit_on_one_side: usize,
    /// K3: the background transparent pixels are composited onto; `None` drops alpha.
    pub transparent_bg: Option<Background>,
    /// K3: when the background is composited.
    pub fill_stage: FillStage,
    /// Video: the most patches a frame may have (`in_patch_limit_each_frame`; `None`: `in_patch_limit`).
    pub in_patch_limit_each_frame: Option<usize>,
    /// Video: a patch budget per video chunk, shared by its frames (`in_patch_limit_video`; `None`: none).
    pub in_patch_limit_video: Option<usize>,
    /// Video: frames sampled per second (`sample_fps`; `None`: the caller's default).
    pub sample_fps: Option<f64>,
    /// Video: the most frames sampled from one video (`max_num_frames_each_video`; `None`: the caller's).
    pub max_num_frames_each_video: Option<usize>,
    /// Video: frames per chunk (`temporal_merge_kernel_size`, default [`VIDEO_CHUNK_FRAMES`]).
    pub temporal_merge_kernel_size: usize,
    /// Video: how a chunk's start time is written in the prompt (`timestamp_mode`).
    pub timestamp_mode: TimestampMode,
}

/// `timestamp_mode` of Kimi's video processor: how a video chunk's start time is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimestampMode {
    /// `hh:mm:ss.fff` (the default).
    HhMmSsFff,
    /// `mm:ss.fff`.
    MmSsFff,
    /// `mm:ss`.
    MmSs,
}

impl TimestampMode {
    /// `seconds` as Kimi's `timestamp_as_str` writes it: whole seconds as a UTC clock (hours modulo 24),
    /// milliseconds truncated.
    pub fn format(self, seconds: f64) -> String {
        let s = if seconds.is_finite() { seconds.max(0.0) } else { 0.0 };
        let whole = s.floor() as u64;
        let ms = (((s - s.floor()) * 1000.0) as u64).min(999);
        let (h, m, sec) = ((whole / 3600) % 24, (whole / 60) % 60, whole % 60);
        match self {
            TimestampMode::HhMmSsFff => format!("{h:02}:{m:02}:{sec:02}.{ms:03}"),
            TimestampMode::MmSsFff => format!("{m:02}:{sec:02}.{ms:03}"),
            TimestampMode::MmSs => format!("{m:02}:{sec:02}"),
        }
    }
}

/// One processed image.
#[derive(Clone, Debug, PartialEq)]
pub struct Processed {
    /// `[patches, 3, p, p]` row-major, normalized.
    pub pixel_values: Vec<f32>,
    /// The patch grid `(t, h, w)`; `t` is 1 for an image, the chunk's frame count for video.
    pub grid: [usize; 3],
    /// The image as the model sees it before normalization: resized, filled and padded RGB (a video chunk's
    /// first frame).
    pub rgb: Image,
    /// The original size `(width, height)` (K3's prompt names it).
    pub original_size: (usize, usize),
    /// Tokens the image becomes after patch merging: `h * w / (merge_h * merge_w)` (a video chunk's `t`
    /// frames are pooled into one set).
    pub tokens: usize,
}

fn cfg_err(path: &str, message: impl std::fmt::Display) -> Error {
    Error::Format { path: path.into(), message: message.to_string() }
}

impl ImageProcessor {
    /// The video sampling the checkpoint asks for: its `sample_fps` and `max_num_frames_each_video`, else
    /// [`super::VideoOptions`]'s defaults (2 frames/s, 64 frames).
    pub fn video_options(&self) -> super::VideoOptions {
        let d = super::VideoOptions::default();
        super::VideoOptions {
            fps: self.sample_fps.unwrap_or(d.fps),
            max_frames: self.max_num_frames_each_video.unwrap_or(d.max_frames),
            ..d
        }
    }

    /// The processor's defaults for `kind`.
    pub fn new(kind: ProcessorKind) -> ImageProcessor {
        ImageProcessor {
            kind,
            patch_size: 14,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            in_patch_limit: match kind {
                ProcessorKind::K25 => 16384,
                ProcessorKind::K3 => 65536,
            },
            merge_kernel_size: [2, 2],
            patch_limit_on_one_side: 512,
            transparent_bg: None,
            fill_stage: FillStage::BeforeResize,
            in_patch_limit_each_frame: None,
            in_patch_limit_video: None,
            sample_fps: None,
            max_num_frames_each_video: None,
            temporal_merge_kernel_size: VIDEO_CHUNK_FRAMES,
            timestamp_mode: TimestampMode::HhMmSsFff,
        }
    }

    /// The processor of a checkpoint directory: the defaults, overridden by `media_proc_cfg` in
    /// `preprocessor_config.json` when the file exists.
    pub fn from_dir(kind: ProcessorKind, dir: &Path) -> Result<ImageProcessor> {
        let path = dir.join("preprocessor_config.json");
        if !path.exists() {
            return Ok(ImageProcessor::new(kind));
        }
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| Error::Format { path: path.clone(), message: format!("not JSON: {e}") })?;
        ImageProcessor::from_preprocessor_config(kind, &json, &path.display().to_string())
    }

    /// The processor described by a parsed `preprocessor_config.json` (`name` names it in errors). The
    /// fields the reference reads from `media_proc_cfg`: `patch_size`, `in_patch_limit`, `image_mean`,
    /// `image_std`, `merge_kernel_size` (an int or `[h, w]`), `patch_limit_on_one_side`, and for K3
    /// `transparent_bg_config` and `transparent_bg_fill_stage`. A field of the wrong type is an error
    /// naming it (the reference silently falls back to every default instead).
    pub fn from_preprocessor_config(kind: ProcessorKind, json: &Value, name: &str) -> Result<ImageProcessor> {
        let mut p = ImageProcessor::new(kind);
        let Some(cfg) = json.get("media_proc_cfg") else { return Ok(p) };
        let cfg = cfg.as_object().ok_or_else(|| cfg_err(name, "media_proc_cfg is not an object"))?;
        let uint =
            |key: &str| -> Result<Option<usize>> {
                match cfg.get(key) {
                    None => Ok(None),
                    Some(v) => v.as_u64().filter(|&n| n > 0).map(|n| Some(n as usize)).ok_or_else(|| {
                        cfg_err(name, format!("media_proc_cfg.{key} must be a positive integer, got {v}"))
                    }),
                }
            };
        let triple = |key: &str| -> Result<Option<[f64; 3]>> {
            match cfg.get(key) {
                None => Ok(None),
                Some(v) => {
                    let xs: Option<Vec<f64>> = v.as_array().map(|a| a.iter().filter_map(Value::as_f64).collect());
                    match xs {
                        Some(xs) if xs.len() == 3 && v.as_array().is_some_and(|a| a.len() == 3) => {
                            Ok(Some([xs[0], xs[1], xs[2]]))
                        }
                        _ => Err(cfg_err(name, format!("media_proc_cfg.{key} must be three numbers, got {v}"))),
                    }
                }
            }
        };
        if let Some(v) = uint("patch_size")? {
            p.patch_size = v;
        }
        if let Some(v) = uint("in_patch_limit")? {
            p.in_patch_limit = v;
        }
        if let Some(v) = uint("patch_limit_on_one_side")? {
            p.patch_limit_on_one_side = v;
        }
        if let Some(v) = triple("image_mean")? {
            p.image_mean = v;
        }
        if let Some(v) = triple("image_std")? {
            if v.contains(&0.0) {
                return Err(cfg_err(name, "media_proc_cfg.image_std has a zero"));
            }
            p.image_std = v;
        }
        if let Some(v) = cfg.get("merge_kernel_size") {
            let bad =
                || cfg_err(name, format!("media_proc_cfg.merge_kernel_size must be an integer or [h, w], got {v}"));
            p.merge_kernel_size = match v {
                Value::Number(n) => {
                    let n = n.as_u64().filter(|&n| n > 0).ok_or_else(bad)? as usize;
                    [n, n]
                }
                Value::Array(a) if a.len() == 2 => {
                    let h = a[0].as_u64().filter(|&n| n > 0).ok_or_else(bad)? as usize;
                    let w = a[1].as_u64().filter(|&n| n > 0).ok_or_else(bad)? as usize;
                    [h, w]
                }
                _ => return Err(bad()),
            };
        }
        // The video fields; `null` (as the K2.5 release writes unused ones) means unset.
        let opt_uint = |key: &str| -> Result<Option<usize>> {
            match cfg.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(_) => uint(key),
            }
        };
        p.in_patch_limit_each_frame = opt_uint("in_patch_limit_each_frame")?;
        p.in_patch_limit_video = opt_uint("in_patch_limit_video")?;
        p.max_num_frames_each_video = opt_uint("max_num_frames_each_video")?;
        if let Some(t) = opt_uint("temporal_merge_kernel_size")? {
            p.temporal_merge_kernel_size = t;
        }
        match cfg.get("sample_fps") {
            None | Some(Value::Null) => {}
            Some(v) => {
                let f = v.as_f64().filter(|f| f.is_finite() && *f > 0.0).ok_or_else(|| {
                    cfg_err(name, format!("media_proc_cfg.sample_fps must be a positive number, got {v}"))
                })?;
                p.sample_fps = Some(f);
            }
        }
        match cfg.get("timestamp_mode") {
            None | Some(Value::Null) => {}
            Some(Value::String(m)) if m == "hh:mm:ss.fff" => p.timestamp_mode = TimestampMode::HhMmSsFff,
            Some(Value::String(m)) if m == "mm:ss.fff" => p.timestamp_mode = TimestampMode::MmSsFff,
            Some(Value::String(m)) if m == "mm:ss" => p.timestamp_mode = TimestampMode::MmSs,
            Some(v) => {
                return Err(cfg_err(
                    name,
                    format!("media_proc_cfg.timestamp_mode must be hh:mm:ss.fff, mm:ss.fff or mm:ss, got {v}"),
                ))
            }
        }
        if kind == ProcessorKind::K3 {
            match cfg.get("transparent_bg_config") {
                None | Some(Value::Null) => {}
                Some(Value::Object(bg)) => p.transparent_bg = Some(background(bg, name)?),
                Some(v) => return Err(cfg_err(name, format!("media_proc_cfg.transparent_bg_config is {v}"))),
            }
            match cfg.get("transparent_bg_fill_stage") {
                None => {}
                Some(Value::String(s)) if s == "before_resize" => p.fill_stage = FillStage::BeforeResize,
                Some(Value::String(_)) => p.fill_stage = FillStage::AfterResize,
                Some(v) => return Err(cfg_err(name, format!("media_proc_cfg.transparent_bg_fill_stage is {v}"))),
            }
        }
        Ok(p)
    }

    /// The resized size before padding: navit's `scale = min(1, sqrt(limit / patches), side limits)`,
    /// truncated to whole pixels, at least 1, at most the side limit.
    pub fn target_size(&self, width: usize, height: usize) -> (usize, usize) {
        let p = self.patch_size;
        let patches = ((width / p) as f64).max(1.0) * ((height / p) as f64).max(1.0);
        let s1 = (self.in_patch_limit as f64 / patches).sqrt();
        let side = (self.patch_limit_on_one_side * p) as f64;
        let s2 = side / width as f64;
        let s3 = side / height as f64;
        let scale = 1.0f64.min(s1).min(s2).min(s3);
        let cap = self.patch_limit_on_one_side * p;
        let new_w = ((width as f64 * scale) as usize).max(1).min(cap);
        let new_h = ((height as f64 * scale) as usize).max(1).min(cap);
        (new_w, new_h)
    }

    /// K3's `_fill_transparent_bg`.
    fn fill(&self, image: Image) -> Image {
        let Some(bg) = &self.transparent_bg else { return image.to_rgb() };
        if image.mode == Mode::Rgb {
            return image;
        }
        if !image.has_transparency() {
            return image.to_rgb();
        }
        let rgba = image.to_rgba();
        let mut out = Vec::with_capacity(rgba.width * rgba.height * 3);
        for (i, px) in rgba.data.chunks_exact(4).enumerate() {
            let b = f32::from(bg.level(i % rgba.width, i / rgba.width));
            // The reference's numpy float32 arithmetic: alpha = a / 255, alpha * c + (1 - alpha) * bg, then a
            // truncating cast to uint8.
            let alpha = f32::from(px[3]) / 255.0f32;
            for &c in &px[..3] {
                let v = alpha * f32::from(c) + (1.0f32 - alpha) * b;
                out.push(v as u8);
            }
        }
        Image {
            width: rgba.width,
            height: rgba.height,
            mode: Mode::Rgb,
            data: out,
            palette: Vec::new(),
            transparency: super::Transparency::None,
        }
    }

    /// Rescales, resizes, fills and pads `image` into the RGB image the patches are cut from.
    pub fn rescale(&self, image: &Image) -> Result<Image> {
        let (new_w, new_h) = self.target_size(image.width, image.height);
        let resized = match self.kind {
            ProcessorKind::K25 => resize::resize_bicubic(&image.to_rgb(), new_w, new_h),
            ProcessorKind::K3 => {
                let staged = match self.fill_stage {
                    FillStage::BeforeResize => self.fill(image.clone()),
                    FillStage::AfterResize if image.mode == Mode::P => image.to_rgba(),
                    FillStage::AfterResize => image.clone(),
                };
                self.fill(resize::resize_bicubic(&staged, new_w, new_h))
            }
        };
        let fw = self.merge_kernel_size[1] * self.patch_size;
        let fh = self.merge_kernel_size[0] * self.patch_size;
        let (pw, ph) = (new_w.div_ceil(fw) * fw, new_h.div_ceil(fh) * fh);
        if (pw, ph) == (new_w, new_h) {
            return Ok(resized);
        }
        let mut data = vec![0u8; pw * ph * 3];
        for y in 0..new_h {
            data[y * pw * 3..(y * pw + new_w) * 3].copy_from_slice(&resized.data[y * new_w * 3..(y + 1) * new_w * 3]);
        }
        Image::from_raw(pw, ph, Mode::Rgb, data)
    }

    /// The whole pipeline for one image.
    pub fn process(&self, image: &Image) -> Result<Processed> {
        if image.width == 0 || image.height == 0 {
            return Err(Error::invalid("media", format!("a {}x{} image", image.width, image.height)));
        }
        let rgb = self.rescale(image)?;
        let pixel_values = self.normalize_patchify(&rgb);
        let p = self.patch_size;
        let grid = [1, rgb.height / p, rgb.width / p];
        let tokens = grid[0] * grid[1] * grid[2] / (self.merge_kernel_size[0] * self.merge_kernel_size[1]);
        Ok(Processed { pixel_values, grid, rgb, original_size: (image.width, image.height), tokens })
    }

    /// `/255`, `(x - mean) / std` and the patch layout `[gh, gw, 3, p, p]`. K2.5 normalizes in float32
    /// (MLX arrays, the mean and std rounded to float32); K3 divides by 255 in float32 and normalizes in
    /// float64 (numpy promotes against the float64 mean), rounding to float32 at the end.
    pub fn normalize_patchify(&self, rgb: &Image) -> Vec<f32> {
        let p = self.patch_size;
        let (gh, gw) = (rgb.height / p, rgb.width / p);
        let mean32 = self.image_mean.map(|m| m as f32);
        let std32 = self.image_std.map(|s| s as f32);
        let norm = |c: usize, v: u8| -> f32 {
            let x = f32::from(v) / 255.0f32;
            match self.kind {
                ProcessorKind::K25 => (x - mean32[c]) / std32[c],
                ProcessorKind::K3 => ((f64::from(x) - self.image_mean[c]) / self.image_std[c]) as f32,
            }
        };
        let mut out = Vec::with_capacity(gh * gw * 3 * p * p);
        for by in 0..gh {
            for bx in 0..gw {
                for c in 0..3 {
                    for py in 0..p {
                        let row = (by * p + py) * rgb.width;
                        for px in 0..p {
                            out.push(norm(c, rgb.data[(row + bx * p + px) * 3 + c]));
                        }
                    }
                }
            }
        }
        out
    }
}

/// Frames per video chunk unless a caller says otherwise: the Kimi cards group video frames into chunks of
/// up to 4, and K3's tower has temporal position embeddings for `init_pos_emb_time` = 4 frames.
pub const VIDEO_CHUNK_FRAMES: usize = 4;

impl ImageProcessor {
    /// A video given as its frames, in order, into chunks of up to `chunk` frames (the last may be shorter),
    /// one [`Processed`] per chunk. No reference processor handles video for these models (mlx-vlm 0.7.10's
    /// K3 processor refuses it), so the rule is taken from the towers: their `sd2_tpool` merge reads a chunk
    /// `(t, h, w)` as `t` frames of `h x w` patches, frame-major, and mean-pools over `t` before the spatial
    /// merge, so a chunk yields `h * w / (merge_h * merge_w)` tokens whatever `t` is. Each frame goes through
    /// the image pipeline unchanged (the same rescale, resize, fill, pad and normalization), so a chunk's
    /// `pixel_values` are its frames' image patches concatenated. All frames must have one size.
    ///
    /// A frame's patch limit is Kimi K2.5's video rule (`navit_resize_video` for a chunk):
    /// `in_patch_limit_each_frame` (else `in_patch_limit`), and with `in_patch_limit_video` at most
    /// `round(in_patch_limit_video / frames in the chunk)`.
    pub fn process_video(&self, frames: &[Image], chunk: usize) -> Result<Vec<Processed>> {
        if frames.is_empty() {
            return Err(Error::invalid("media", "a video without frames"));
        }
        if chunk == 0 {
            return Err(Error::invalid("media", "video chunks of 0 frames"));
        }
        let (w, h) = (frames[0].width, frames[0].height);
        if let Some((i, f)) = frames.iter().enumerate().find(|(_, f)| (f.width, f.height) != (w, h)) {
            return Err(Error::invalid(
                "media",
                format!(
                    "video frame {i} is {}x{}, frame 0 is {w}x{h}: all frames must have one size",
                    f.width, f.height
                ),
            ));
        }
        let mut out = Vec::with_capacity(frames.len().div_ceil(chunk));
        for group in frames.chunks(chunk) {
            let mut frame_proc = self.clone();
            frame_proc.in_patch_limit = self.frame_patch_limit(group.len());
            let mut pixel_values = Vec::new();
            let mut first = None;
            for f in group {
                let p = frame_proc.process(f)?;
                pixel_values.extend_from_slice(&p.pixel_values);
                first.get_or_insert(p);
            }
            let first = first.expect("chunks are not empty");
            let grid = [group.len(), first.grid[1], first.grid[2]];
            let tokens = grid[1] * grid[2] / (self.merge_kernel_size[0] * self.merge_kernel_size[1]);
            out.push(Processed { pixel_values, grid, rgb: first.rgb, original_size: (w, h), tokens });
        }
        Ok(out)
    }
}

impl ImageProcessor {
    /// The patch limit of each frame of a video chunk of `frames` frames (see [`ImageProcessor::process_video`]).
    pub fn frame_patch_limit(&self, frames: usize) -> usize {
        let each = self.in_patch_limit_each_frame.unwrap_or(self.in_patch_limit);
        match self.in_patch_limit_video {
            // Python's round: ties to even.
            Some(total) => each.min((total as f64 / frames.max(1) as f64).round_ties_even().max(1.0) as usize),
            None => each,
        }
    }
}

fn background(bg: &serde_json::Map<String, Value>, name: &str) -> Result<Background> {
    let pattern = match bg.get("pattern") {
        None => "black",
        Some(Value::String(s)) => s.as_str(),
        Some(v) => return Err(cfg_err(name, format!("transparent_bg_config.pattern is {v}"))),
    };
    let level = |key: &str, default: u8| -> Result<u8> {
        match bg.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .filter(|&n| n <= 255)
                .map(|n| n as u8)
                .ok_or_else(|| cfg_err(name, format!("transparent_bg_config.{key} must be 0..=255, got {v}"))),
        }
    };
    Ok(match pattern {
        "white" => Background::Solid(255),
        "black" => Background::Solid(0),
        "gray" => Background::Solid(128),
        "chessboard" => {
            let square = match bg.get("chessboard_square_size") {
                None => 16,
                Some(v) => v.as_u64().filter(|&n| n > 0).ok_or_else(|| {
                    cfg_err(name, format!("transparent_bg_config.chessboard_square_size must be positive, got {v}"))
                })? as usize,
            };
            let on_top_left = match bg.get("chessboard_square_on_top_left") {
                None => true,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(cfg_err(name, format!("transparent_bg_config.chessboard_square_on_top_left is {v}")))
                }
            };
            Background::Chessboard {
                square,
                on_top_left,
                white: level("chessboard_white_value", 255)?,
                gray: level("chessboard_gray_value", 200)?,
            }
        }
        other => {
            return Err(cfg_err(
                name,
                format!("transparent_bg_config.pattern {other:?} is not one of white, black, gray, chessboard"),
            ))
        }
    })
}

/// Stacks processed images into the tower's inputs: `pixel_values` `[N, 3, p, p]` (f32) and the grids.
pub fn stack(images: &[Processed], patch_size: usize) -> Result<(Array, Vec<[usize; 3]>)> {
    let total: usize = images.iter().map(|i| i.pixel_values.len()).sum();
    let mut all = Vec::with_capacity(total);
    for i in images {
        all.extend_from_slice(&i.pixel_values);
    }
    let n = total / (3 * patch_size * patch_size);
    let p = patch_size as i32;
    let arr = Array::from_vec(all, &[n as i32, 3, p, p])?;
    Ok((arr, images.iter().map(|i| i.grid).collect()))
}
