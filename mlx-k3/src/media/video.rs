//! Video files: frames sampled from a directory of images, an animated PNG or WebP (decoded here), or any
//! other video file (decoded by the optional external FFmpeg programs).
//!
//! **Sampling** follows Kimi K2.5's own video processor (`KimiK25VisionProcessor.split_video_chunks` of the
//! checkpoint's code; mlx-vlm 0.7.10 has no video processor for either family): for a source of `N` frames
//! at an average rate `R` frames per second and a sampling rate `f` (`--video-fps`, the checkpoint's
//! `media_proc_cfg.sample_fps`, default 2), `n = max(1, round(N * min(f, R) / R))` frames, at most
//! `max_frames`, at the indices `round(linspace(0, N - 1, n))` (numpy's `linspace`, ties rounded to even as
//! numpy and Python round). A sampled frame's time is `index / R` seconds.
//!
//! **Sources**:
//! - a directory: its `.png`, `.jpg`, `.jpeg` and `.webp` files in byte order of their names, taken as frames
//!   at `f` per second (so all of them are used unless `max_frames` is smaller);
//! - an animated PNG (`png` crate; the frames composited onto the canvas with their offsets, blend and
//!   dispose operations as the APNG specification says) or an animated WebP (`image-webp`, which composites
//!   its frames itself): `N` frames over the sum of their delays `D`, so `R = N / D` (the average rate, as a
//!   video decoder reports it); a frame with a zero delay counts as 100 ms, as browsers show it;
//! - a still PNG, JPEG or WebP: a video of one frame;
//! - anything else is handed to FFmpeg: `ffprobe` counts the first video stream's packets and reads its
//!   average frame rate, then `ffmpeg` decodes the sampled frames (a `select` filter on the frame number,
//!   no frame rate conversion) and writes them as PPM images on a pipe. Both are run directly (no shell)
//!   with explicit arguments; their names are `ffprobe` and `ffmpeg` on the `PATH` unless the environment
//!   variables `K3_FFPROBE` / `K3_FFMPEG` name other programs. Without them such a file is an error that
//!   names it and says what is missing.

use std::io::{Cursor, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::{decode, decode_file, Image, Limits, Mode};
use crate::{Error, Result};

/// How frames are taken from a video.
#[derive(Clone, Debug, PartialEq)]
pub struct VideoOptions {
    /// Frames per second to sample (never more than the source has).
    pub fps: f64,
    /// The most frames taken from one video.
    pub max_frames: usize,
    /// The `ffprobe` program run for files the crates do not decode.
    pub ffprobe: String,
    /// The `ffmpeg` program run for files the crates do not decode.
    pub ffmpeg: String,
}

impl Default for VideoOptions {
    /// 2 frames per second (Kimi K2.5's `sample_fps`), at most 64 frames (16 chunks of 4); the programs named
    /// by `K3_FFPROBE` and `K3_FFMPEG`, else `ffprobe` and `ffmpeg` on the `PATH`.
    fn default() -> Self {
        VideoOptions {
            fps: 2.0,
            max_frames: 64,
            ffprobe: program("K3_FFPROBE", "ffprobe"),
            ffmpeg: program("K3_FFMPEG", "ffmpeg"),
        }
    }
}

impl VideoOptions {
    /// Checks the values: a positive finite rate and at least one frame.
    pub fn validate(&self) -> Result<()> {
        if !(self.fps.is_finite() && self.fps > 0.0) {
            return Err(Error::invalid("media", format!("a video sampling rate of {} frames per second", self.fps)));
        }
        if self.max_frames == 0 {
            return Err(Error::invalid("media", "at most 0 frames per video"));
        }
        Ok(())
    }
}

/// Frames sampled from a video file or directory.
#[derive(Clone, Debug, PartialEq)]
pub struct Video {
    /// The file or directory, for messages.
    pub name: String,
    /// The sampled frames, in order.
    pub frames: Vec<Image>,
    /// Each sampled frame's index among the source's frames.
    pub indices: Vec<usize>,
    /// Frames in the source.
    pub source_frames: usize,
    /// The source's average frame rate (frames per second).
    pub source_fps: f64,
    /// What decoded it: `frame directory`, `animated PNG`, `animated WebP`, `still image` or `ffmpeg`.
    pub decoder: &'static str,
}

impl Video {
    /// Seconds from the start of the source to sampled frame `i`.
    pub fn time_of(&self, i: usize) -> f64 {
        self.indices[i] as f64 / self.source_fps
    }
}

fn bad(name: &str, message: impl std::fmt::Display) -> Error {
    Error::Format { path: name.into(), message: message.to_string() }
}

/// The sampled frame indices for a source of `total` frames at `source_fps` (see the module docs): Kimi
/// K2.5's `split_video_chunks`, with the count capped at `max_frames`.
pub fn sample_indices(total: usize, source_fps: f64, fps: f64, max_frames: usize) -> Vec<usize> {
    if total == 0 || max_frames == 0 {
        return Vec::new();
    }
    let rate = fps.min(source_fps);
    let n = ((total as f64 * rate / source_fps).round_ties_even() as usize).clamp(1, total).min(max_frames);
    if n == 1 {
        return vec![0];
    }
    let step = (total - 1) as f64 / (n - 1) as f64;
    let mut out: Vec<usize> = (0..n).map(|i| (i as f64 * step).round_ties_even() as usize).collect();
    out[n - 1] = total - 1;
    out
}

/// Decodes the video at `path` and samples its frames (see the module docs). Errors name the path: a
/// missing file, a directory without frames, a corrupt file, a format that needs FFmpeg when FFmpeg is not
/// there, a video without frames.
pub fn decode_video(path: &Path, opts: &VideoOptions, limits: &Limits) -> Result<Video> {
    opts.validate()?;
    let name = path.display().to_string();
    let meta = std::fs::metadata(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    if meta.is_dir() {
        return frames_dir(path, opts, limits);
    }
    if meta.len() > limits.max_file_bytes as u64 {
        return Err(bad(
            &name,
            format!("the file has {} bytes, more than the limit of {}", meta.len(), limits.max_file_bytes),
        ));
    }
    let mut head = [0u8; 16];
    let got = std::fs::File::open(path)
        .and_then(|mut f| f.read(&mut head))
        .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let Some(format) = format_of(&head[..got]) else {
        return ffmpeg_video(path, &name, opts, limits);
    };
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    decode_in_memory(&bytes, &name, format, opts, limits)
}

/// [`decode_video`] for a file held in memory (a video sent in a request), named `name` in errors. PNG,
/// WebP and JPEG are decoded here; anything else goes to FFmpeg through a temporary file (`tempfile`: created
/// new, readable only by this user, removed when done), since `ffprobe` counts frames by reading the whole
/// file and MP4's index may come at its end.
pub fn decode_video_bytes(bytes: &[u8], name: &str, opts: &VideoOptions, limits: &Limits) -> Result<Video> {
    opts.validate()?;
    if bytes.len() > limits.max_file_bytes {
        return Err(bad(
            name,
            format!("the video has {} bytes, more than the limit of {}", bytes.len(), limits.max_file_bytes),
        ));
    }
    if bytes.is_empty() {
        return Err(bad(name, "the video is empty"));
    }
    if let Some(format) = format_of(bytes) {
        return decode_in_memory(bytes, name, format, opts, limits);
    }
    // Created new, readable by this user only, removed when dropped.
    let write = || -> std::io::Result<tempfile::NamedTempFile> {
        let mut f = tempfile::Builder::new().prefix(&format!("mlx-k3-video-{}-", std::process::id())).tempfile()?;
        std::io::Write::write_all(&mut f, bytes)?;
        Ok(f)
    };
    let tmp = write().map_err(|e| bad(name, format!("writing it to a temporary file for FFmpeg: {e}")))?;
    ffmpeg_video(tmp.path(), name, opts, limits)
}

/// The formats the crates decode (the rest goes to FFmpeg).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Png,
    Webp,
    Jpeg,
}

/// The format of a file starting with `head`, if the crates decode it.
fn format_of(head: &[u8]) -> Option<Format> {
    if head.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some(Format::Png)
    } else if head.len() >= 12 && &head[..4] == b"RIFF" && &head[8..12] == b"WEBP" {
        Some(Format::Webp)
    } else if head.starts_with(&[0xff, 0xd8, 0xff]) {
        Some(Format::Jpeg)
    } else {
        None
    }
}

/// A PNG (animated or still), WebP (animated or still) or JPEG file's frames, sampled.
fn decode_in_memory(bytes: &[u8], name: &str, format: Format, opts: &VideoOptions, limits: &Limits) -> Result<Video> {
    let animation = match format {
        Format::Png => png_animation(bytes, name, limits)?,
        Format::Webp => webp_animation(bytes, name, limits)?,
        Format::Jpeg => None,
    };
    let (all, delays_ms, decoder) = match animation {
        Some((frames, delays, decoder)) => (frames, delays, decoder),
        None => (vec![decode(bytes, name, limits)?], vec![], "still image"),
    };
    let total = all.len();
    // A still image: one frame, at the sampling rate (its time is 0 either way).
    let source_fps =
        if delays_ms.is_empty() { opts.fps } else { total as f64 * 1000.0 / delays_ms.iter().sum::<f64>() };
    let indices = sample_indices(total, source_fps, opts.fps, opts.max_frames);
    let mut all: Vec<Option<Image>> = all.into_iter().map(Some).collect();
    let frames = indices.iter().map(|&i| all[i].take().unwrap_or_else(|| unreachable!("indices rise"))).collect();
    Ok(Video { name: name.to_string(), frames, indices, source_frames: total, source_fps, decoder })
}

fn frames_dir(dir: &Path, opts: &VideoOptions, limits: &Limits) -> Result<Video> {
    let io = |source| Error::Io { path: dir.to_path_buf(), source };
    let mut names: Vec<PathBuf> = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
        if path.is_file() && matches!(ext.as_deref(), Some("png" | "jpg" | "jpeg" | "webp")) {
            names.push(path);
        }
    }
    let name = dir.display().to_string();
    if names.is_empty() {
        return Err(bad(&name, "no .png, .jpg or .webp frames in the directory"));
    }
    names.sort();
    let indices = sample_indices(names.len(), opts.fps, opts.fps, opts.max_frames);
    let frames = indices.iter().map(|&i| decode_file(&names[i], limits)).collect::<Result<Vec<_>>>()?;
    Ok(Video { name, frames, indices, source_frames: names.len(), source_fps: opts.fps, decoder: "frame directory" })
}

/// A zero delay is shown for 100 ms (browsers' rule for GIF and APNG).
fn delay_ms(ms: f64) -> f64 {
    if ms > 0.0 {
        ms
    } else {
        100.0
    }
}

/// The frames of an animated PNG, composited, with their delays in ms; None for a still PNG.
#[allow(clippy::type_complexity)]
fn png_animation(bytes: &[u8], name: &str, limits: &Limits) -> Result<Option<(Vec<Image>, Vec<f64>, &'static str)>> {
    use png::{BlendOp, DisposeOp, Transformations};
    let png_err = |e: png::DecodingError| bad(name, format!("corrupt PNG: {e}"));
    let mut decoder = png::Decoder::new(Cursor::new(bytes));
    // 8-bit samples (16-bit ones keep their high byte, low bit depths are scaled, as `decode` does), the
    // palette and a tRNS color made RGB(A), gray kept gray, plus an alpha channel for compositing.
    decoder.set_transformations(Transformations::EXPAND | Transformations::STRIP_16 | Transformations::ALPHA);
    decoder.set_limits(png::Limits { bytes: limits.max_pixels.saturating_mul(8).saturating_add(1 << 20) });
    let mut reader = decoder.read_info().map_err(png_err)?;
    let info = reader.info();
    let Some(actl) = info.animation_control else { return Ok(None) };
    let (w, h) = (info.width as usize, info.height as usize);
    if w == 0 || h == 0 || w.saturating_mul(h) > limits.max_pixels {
        return Err(bad(name, format!("the image is {w}x{h} pixels (limit {} pixels)", limits.max_pixels)));
    }
    let frames_total = actl.num_frames as usize;
    if frames_total == 0 {
        return Err(bad(name, "an animated PNG with 0 frames"));
    }
    // Every canvas is kept until sampling: bound their total like one image's pixels.
    if frames_total.saturating_mul(w * h) > limits.max_pixels.saturating_mul(4) {
        return Err(bad(name, format!("{frames_total} frames of {w}x{h} pixels are more than the decoding limit")));
    }
    let opaque_source =
        !matches!(info.color_type, png::ColorType::Rgba | png::ColorType::GrayscaleAlpha) && info.trns.is_none();
    let default_is_frame = info.frame_control.is_some();
    let size = reader.output_buffer_size().ok_or_else(|| bad(name, "the PNG image is too large"))?;
    let mut buf = vec![0u8; size];
    if !default_is_frame {
        // The default image is not part of the animation.
        reader.next_frame(&mut buf).map_err(png_err)?;
    }
    let mut canvas = vec![0u8; w * h * 4];
    let mut frames = Vec::with_capacity(frames_total);
    let mut delays = Vec::with_capacity(frames_total);
    for i in 0..frames_total {
        let out = reader.next_frame(&mut buf).map_err(png_err)?;
        let fc = *reader.info().frame_control.as_ref().ok_or_else(|| bad(name, format!("frame {i} has no fcTL")))?;
        let (fx, fy, fw, fh) = (fc.x_offset as usize, fc.y_offset as usize, fc.width as usize, fc.height as usize);
        if fx + fw > w || fy + fh > h || (out.width as usize, out.height as usize) != (fw, fh) {
            return Err(bad(name, format!("frame {i} ({fw}x{fh} at {fx},{fy}) lies outside the {w}x{h} canvas")));
        }
        let gray = matches!(out.color_type, png::ColorType::GrayscaleAlpha);
        let bands = if gray { 2 } else { 4 };
        let saved = (fc.dispose_op == DisposeOp::Previous && i > 0).then(|| canvas.clone());
        for y in 0..fh {
            let row = &buf[y * out.line_size..y * out.line_size + fw * bands];
            for x in 0..fw {
                let s = &row[x * bands..(x + 1) * bands];
                let src = if gray { [s[0], s[0], s[0], s[1]] } else { [s[0], s[1], s[2], s[3]] };
                let d = &mut canvas[((fy + y) * w + fx + x) * 4..][..4];
                match fc.blend_op {
                    BlendOp::Source => d.copy_from_slice(&src),
                    BlendOp::Over => blend_over(d, src),
                }
            }
        }
        let mut data = canvas.clone();
        let mode = if opaque_source {
            data = data.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect();
            Mode::Rgb
        } else {
            Mode::Rgba
        };
        frames.push(Image::from_raw(w, h, mode, data)?);
        let den = if fc.delay_den == 0 { 100.0 } else { f64::from(fc.delay_den) };
        delays.push(delay_ms(f64::from(fc.delay_num) * 1000.0 / den));
        // Dispose of the region before the next frame (the first frame's "previous" is "background").
        match (fc.dispose_op, saved) {
            (DisposeOp::Previous, Some(prev)) => canvas = prev,
            (DisposeOp::None, _) => {}
            _ => {
                for y in 0..fh {
                    canvas[((fy + y) * w + fx) * 4..((fy + y) * w + fx + fw) * 4].fill(0);
                }
            }
        }
    }
    Ok(Some((frames, delays, "animated PNG")))
}

/// APNG's `APNG_BLEND_OP_OVER` on 8-bit RGBA: source over destination, rounded to the nearest level.
fn blend_over(d: &mut [u8], s: [u8; 4]) {
    let sa = u32::from(s[3]);
    if sa == 255 {
        d.copy_from_slice(&s);
        return;
    }
    if sa == 0 {
        return;
    }
    let da = u32::from(d[3]);
    // Output alpha and colors in units of 1/255^2, then divided back with rounding.
    let oa = sa * 255 + da * (255 - sa);
    for c in 0..3 {
        let v = u32::from(s[c]) * sa * 255 + u32::from(d[c]) * da * (255 - sa);
        d[c] = ((v + oa / 2) / oa) as u8;
    }
    d[3] = ((oa + 127) / 255) as u8;
}

/// The frames of an animated WebP with their delays in ms; None for a still WebP.
#[allow(clippy::type_complexity)]
fn webp_animation(bytes: &[u8], name: &str, limits: &Limits) -> Result<Option<(Vec<Image>, Vec<f64>, &'static str)>> {
    let webp_err = |e: image_webp::DecodingError| bad(name, format!("corrupt WebP: {e}"));
    let mut dec = image_webp::WebPDecoder::new(Cursor::new(bytes)).map_err(webp_err)?;
    if !dec.is_animated() {
        return Ok(None);
    }
    let (w, h) = dec.dimensions();
    let (w, h) = (w as usize, h as usize);
    if w == 0 || h == 0 || w.saturating_mul(h) > limits.max_pixels {
        return Err(bad(name, format!("the image is {w}x{h} pixels (limit {} pixels)", limits.max_pixels)));
    }
    let n = dec.num_frames() as usize;
    if n == 0 {
        return Err(bad(name, "an animated WebP with 0 frames"));
    }
    if n.saturating_mul(w * h) > limits.max_pixels.saturating_mul(4) {
        return Err(bad(name, format!("{n} frames of {w}x{h} pixels are more than the decoding limit")));
    }
    dec.set_memory_limit(limits.max_pixels.saturating_mul(4).saturating_add(1 << 20));
    let mode = if dec.has_alpha() { Mode::Rgba } else { Mode::Rgb };
    let size = dec.output_buffer_size().ok_or_else(|| bad(name, "the WebP image is too large"))?;
    let mut frames = Vec::with_capacity(n);
    let mut delays = Vec::with_capacity(n);
    for _ in 0..n {
        let mut data = vec![0u8; size];
        let ms = dec.read_frame(&mut data).map_err(webp_err)?;
        frames.push(Image::from_raw(w, h, mode, data)?);
        delays.push(delay_ms(f64::from(ms)));
    }
    Ok(Some((frames, delays, "animated WebP")))
}

/// The program named by the environment variable `var`, else `default` (looked up on the `PATH`).
fn program(var: &str, default: &str) -> String {
    std::env::var(var).ok().filter(|v| !v.is_empty()).unwrap_or_else(|| default.to_string())
}

fn run_tool(name: &str, cmd: &mut Command) -> Result<std::process::Output> {
    let prog = cmd.get_program().to_string_lossy().into_owned();
    cmd.stdin(Stdio::null()).output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            bad(
                name,
                format!(
                    "not a frame directory or a PNG, JPEG or WebP image, and FFmpeg's '{prog}' program, which \
                     decodes other video files, was not found (install FFmpeg, or name the program in K3_FFPROBE)"
                ),
            )
        } else {
            bad(name, format!("could not run '{prog}': {e}"))
        }
    })
}

fn last_line(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message").trim().to_string()
}

fn ffmpeg_video(path: &Path, name: &str, opts: &VideoOptions, limits: &Limits) -> Result<Video> {
    let name = name.to_string();
    let probe = run_tool(
        &name,
        Command::new(&opts.ffprobe)
            .args(["-v", "error", "-select_streams", "v:0", "-count_packets"])
            .args(["-show_entries", "stream=avg_frame_rate,r_frame_rate,nb_read_packets", "-of", "json"])
            .arg(path),
    )?;
    if !probe.status.success() {
        return Err(bad(&name, format!("ffprobe cannot read it as a video: {}", last_line(&probe.stderr))));
    }
    let json: serde_json::Value =
        serde_json::from_slice(&probe.stdout).map_err(|e| bad(&name, format!("ffprobe's answer is not JSON: {e}")))?;
    let Some(stream) = json.get("streams").and_then(|s| s.get(0)) else {
        return Err(bad(&name, "the file has no video stream"));
    };
    let total: usize = stream
        .get("nb_read_packets")
        .and_then(|v| v.as_str())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| bad(&name, "ffprobe did not count the video's frames"))?;
    if total == 0 {
        return Err(bad(&name, "the video has no frames"));
    }
    let rate = |key: &str| -> Option<f64> {
        let s = stream.get(key)?.as_str()?;
        let (a, b) = s.split_once('/').unwrap_or((s, "1"));
        let (a, b): (f64, f64) = (a.parse().ok()?, b.parse().ok()?);
        (a > 0.0 && b > 0.0).then_some(a / b)
    };
    let source_fps = rate("avg_frame_rate")
        .or_else(|| rate("r_frame_rate"))
        .ok_or_else(|| bad(&name, "ffprobe gives the video no frame rate"))?;
    let indices = sample_indices(total, source_fps, opts.fps, opts.max_frames);
    let select: Vec<String> = indices.iter().map(|i| format!("eq(n\\,{i})")).collect();
    let ffmpeg = &opts.ffmpeg;
    let mut child = Command::new(&ffmpeg)
        .args(["-nostdin", "-v", "error", "-i"])
        .arg(path)
        .args(["-map", "0:v:0", "-vf", &format!("select={}", select.join("+")), "-fps_mode", "passthrough"])
        .args(["-f", "image2pipe", "-c:v", "ppm", "-pix_fmt", "rgb24", "pipe:1"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                bad(&name, format!("FFmpeg's '{ffmpeg}' program, which decodes this video, was not found (install FFmpeg, or name the program in K3_FFMPEG)"))
            } else {
                bad(&name, format!("could not run '{ffmpeg}': {e}"))
            }
        })?;
    // stderr is drained on its own thread so a chatty ffmpeg cannot block on a full pipe.
    let mut err_pipe = child.stderr.take().expect("piped");
    let err_thread = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err_pipe.read_to_end(&mut v);
        v
    });
    let mut out = std::io::BufReader::new(child.stdout.take().expect("piped"));
    let mut frames = Vec::with_capacity(indices.len());
    let read = (|| -> Result<()> {
        while frames.len() < indices.len() {
            match read_ppm(&mut out, &name, limits)? {
                Some(im) => frames.push(im),
                None => break,
            }
        }
        Ok(())
    })();
    if read.is_err() {
        let _ = child.kill();
    }
    let status = child.wait().map_err(|e| bad(&name, format!("waiting for ffmpeg: {e}")))?;
    let stderr = err_thread.join().unwrap_or_default();
    read?;
    if !status.success() {
        return Err(bad(&name, format!("ffmpeg failed to decode it: {}", last_line(&stderr))));
    }
    if frames.len() != indices.len() {
        return Err(bad(
            &name,
            format!(
                "ffmpeg gave {} of the {} sampled frames (of {total} counted by ffprobe)",
                frames.len(),
                indices.len()
            ),
        ));
    }
    Ok(Video { name, frames, indices, source_frames: total, source_fps, decoder: "ffmpeg" })
}

/// One binary PPM (`P6`, maxval 255) from `r`; None at the end of the stream.
fn read_ppm(r: &mut impl std::io::BufRead, name: &str, limits: &Limits) -> Result<Option<Image>> {
    let io = |e: std::io::Error| bad(name, format!("reading ffmpeg's output: {e}"));
    if r.fill_buf().map_err(io)?.is_empty() {
        return Ok(None);
    }
    let mut fields = Vec::with_capacity(4);
    while fields.len() < 4 {
        let mut tok = Vec::new();
        let mut byte = [0u8; 1];
        loop {
            r.read_exact(&mut byte).map_err(io)?;
            if byte[0].is_ascii_whitespace() {
                if tok.is_empty() {
                    continue;
                }
                break;
            }
            tok.push(byte[0]);
            if tok.len() > 16 {
                return Err(bad(name, "ffmpeg's output is not PPM"));
            }
        }
        fields.push(String::from_utf8_lossy(&tok).into_owned());
    }
    let num = |s: &str| s.parse::<usize>().map_err(|_| bad(name, "ffmpeg's output is not PPM"));
    if fields[0] != "P6" || num(&fields[3])? != 255 {
        return Err(bad(name, "ffmpeg's output is not 8-bit PPM"));
    }
    let (w, h) = (num(&fields[1])?, num(&fields[2])?);
    if w == 0 || h == 0 || w.saturating_mul(h) > limits.max_pixels {
        return Err(bad(name, format!("a {w}x{h} frame (limit {} pixels)", limits.max_pixels)));
    }
    let mut data = vec![0u8; w * h * 3];
    r.read_exact(&mut data).map_err(io)?;
    Ok(Some(Image::from_raw(w, h, Mode::Rgb, data)?))
}

#[cfg(test)]
mod tests {
    use super::super::TimestampMode;

    #[test]
    fn timestamps_as_kimi_writes_them() {
        assert_eq!(TimestampMode::HhMmSsFff.format(0.0), "00:00:00.000");
        assert_eq!(TimestampMode::HhMmSsFff.format(3661.5), "01:01:01.500");
        assert_eq!(TimestampMode::HhMmSsFff.format(2.0 / 3.0), "00:00:00.666");
        assert_eq!(TimestampMode::MmSsFff.format(3661.5), "01:01.500");
        assert_eq!(TimestampMode::MmSs.format(61.9), "01:01");
    }
}
