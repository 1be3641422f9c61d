//! Video input: frame directories, animated PNG and WebP files (written by Pillow from the same frames,
//! `scripts/make_video_fixtures.py`) and other video files through FFmpeg decode to the frames they were
//! made from, pixel for pixel; the sampling rule matches Kimi K2.5's video processor as numpy computes it;
//! bad input is an error naming the file.
//!
//! The FFmpeg cases run where `ffmpeg` and `ffprobe` are installed; CI installs them and sets
//! `K3_REQUIRE_FFMPEG_CHECK=1`, which makes their absence a failure instead of a skip.

use std::path::{Path, PathBuf};
use std::process::Command;

use mlx_k3::media::{self, decode_video, Image, Limits, Mode, VideoOptions};
use serde_json::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/video")
}

fn opts(fps: f64, max_frames: usize) -> VideoOptions {
    VideoOptions { fps, max_frames, ..VideoOptions::default() }
}

/// The fixture's frames as our PNG decoder reads them (checked against Pillow in tests/media.rs).
fn frames(sub: &str) -> Vec<Image> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir().join(sub)).unwrap().map(|e| e.unwrap().path()).collect();
    names.sort();
    names.iter().map(|p| media::decode_file(p, &Limits::default()).unwrap()).collect()
}

fn rgb(im: &Image) -> Image {
    im.to_rgb()
}

#[test]
fn sampling_matches_kimi_k25s_processor() {
    let m: Value = serde_json::from_str(&std::fs::read_to_string(dir().join("sampling.json")).unwrap()).unwrap();
    let cases = m["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for c in cases {
        let total = c["frames"].as_u64().unwrap() as usize;
        let max = c["max_frames"].as_u64().map_or(usize::MAX, |v| v as usize);
        let want: Vec<usize> = serde_json::from_value(c["indices"].clone()).unwrap();
        let got =
            media::video::sample_indices(total, c["source_fps"].as_f64().unwrap(), c["fps"].as_f64().unwrap(), max);
        assert_eq!(got, want, "{c}");
    }
}

#[test]
fn a_frame_directory_gives_its_frames_in_name_order() {
    let want = frames("frames");
    let v = decode_video(&dir().join("frames"), &opts(2.0, 64), &Limits::default()).unwrap();
    assert_eq!(v.decoder, "frame directory");
    assert_eq!(v.frames, want);
    assert_eq!(v.indices, [0, 1, 2, 3, 4, 5]);
    // Frames are taken at the sampling rate: frame 3 starts at 1.5 s.
    assert_eq!(v.time_of(3), 1.5);
    // A cap spreads the frames evenly (numpy's linspace(0, 5, 4) = 0, 1.67, 3.33, 5).
    let v = decode_video(&dir().join("frames"), &opts(2.0, 4), &Limits::default()).unwrap();
    assert_eq!(v.indices, [0, 2, 3, 5]);
    assert_eq!(v.frames, [&want[0], &want[2], &want[3], &want[5]].map(Clone::clone));
}

#[test]
fn animated_png_and_webp_give_the_frames_they_were_made_from() {
    let want = frames("frames");
    for (file, decoder) in [("anim.png", "animated PNG"), ("anim.webp", "animated WebP")] {
        // 6 frames of 100 ms: 10 frames per second; sampling at 10 or more takes every frame.
        let v = decode_video(&dir().join(file), &opts(25.0, 64), &Limits::default()).unwrap();
        assert_eq!(v.decoder, decoder);
        assert_eq!((v.source_frames, v.source_fps), (6, 10.0), "{file}");
        assert_eq!(v.frames.len(), 6, "{file}");
        for (i, (got, want)) in v.frames.iter().zip(&want).enumerate() {
            assert_eq!(got.mode, Mode::Rgb, "{file} frame {i}");
            assert_eq!((got.width, got.height), (want.width, want.height));
            // image-webp 0.2.4 composites a frame that blends onto the canvas with libwebp's integer formula
            // but, unlike libwebp's demuxer (which Pillow uses), also for opaque pixels, where the formula
            // comes out one level low (255 * (2^24 / 255) < 2^24). So a WebP frame after the first may be
            // one level below the source; APNG frames (our compositing) must be exact.
            let tol = if file.ends_with(".webp") && i > 0 { 1 } else { 0 };
            let worst = got.data.iter().zip(&want.data).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
            assert!(worst <= tol, "{file}: frame {i} differs from frames/frame_{i:03}.png by up to {worst}");
        }
        // 5 frames per second: n = round(6 * 5 / 10) = 3 at linspace(0, 5, 3) = 0, 2.5 -> 2, 5.
        let v = decode_video(&dir().join(file), &opts(5.0, 64), &Limits::default()).unwrap();
        assert_eq!(v.indices, [0, 2, 5], "{file}");
        // Which frames were taken: the nearest source frame each (the WebP ones within the level above).
        for (k, src) in [(1usize, 2usize), (2, 5)] {
            let d = v.frames[k].data.iter().zip(&want[src].data).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
            assert!(d <= 1, "{file}: sampled frame {k} is not frame {src}");
        }
        assert_eq!(v.time_of(2), 0.5);
    }
    // RGBA frames (opaque, half and fully transparent areas) keep their alpha.
    let want = frames("rgba");
    let v = decode_video(&dir().join("anim_rgba.png"), &opts(10.0, 64), &Limits::default()).unwrap();
    assert_eq!(v.frames.len(), 3);
    for (i, (got, want)) in v.frames.iter().zip(&want).enumerate() {
        assert_eq!(got.mode, Mode::Rgba);
        assert!(got == want, "anim_rgba.png: frame {i} differs");
    }
}

#[test]
fn a_still_image_is_a_one_frame_video() {
    let v = decode_video(&dir().join("frames/frame_002.png"), &opts(2.0, 64), &Limits::default()).unwrap();
    assert_eq!((v.decoder, v.frames.len(), v.source_frames), ("still image", 1, 1));
    assert!(v.frames[0] == frames("frames")[2]);
}

/// The video's chunks are the frames' image patches in chunks of 4, and the prompt expansion writes one
/// timestamped video prompt per chunk.
#[test]
fn video_chunks_and_their_prompt() {
    let proc = media::ImageProcessor::new(media::ProcessorKind::K3);
    let v = decode_video(&dir().join("frames"), &opts(2.0, 64), &Limits::default()).unwrap();
    let chunks = proc.process_video(&v.frames, proc.temporal_merge_kernel_size).unwrap();
    assert_eq!(chunks.iter().map(|c| c.grid[0]).collect::<Vec<_>>(), [4, 2]);
    let one = proc.process(&v.frames[0]).unwrap();
    assert_eq!(chunks[0].tokens, one.tokens);
    let stamps: Vec<String> = [0, 4].iter().map(|&i| proc.timestamp_mode.format(v.time_of(i))).collect();
    assert_eq!(stamps, ["00:00:00.000", "00:00:02.000"]);
    let segs = [mlx_k3::chat::Segment { text: media::prompt::VIDEO_PLACEHOLDER.into(), special: true }];
    let out = media::prompt::expand_k3_media(&segs, &[media::prompt::Medium::Video(&chunks, &stamps)]).unwrap();
    let pads = "<|media_pad|>".repeat(one.tokens);
    assert_eq!(out.len(), 1);
    assert_eq!(
        out[0].text,
        format!(
            "00:00:00.000<|media_begin|>video<|media_content|>{pads}<|media_end|>\
             00:00:02.000<|media_begin|>video<|media_content|>{pads}<|media_end|>"
        )
    );
    // An image placeholder where a video is given: an error naming both.
    let segs = [mlx_k3::chat::Segment { text: media::prompt::IMAGE_PLACEHOLDER.into(), special: true }];
    let e = media::prompt::expand_k3_media(&segs, &[media::prompt::Medium::Video(&chunks, &stamps)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("[image]") && e.contains("[video]"), "{e}");
    // The per-frame patch limit of a chunk: in_patch_limit_each_frame, and in_patch_limit_video shared by
    // the chunk's frames (round(10 / 4) = 2, ties to even).
    let mut p = proc.clone();
    p.in_patch_limit_each_frame = Some(3);
    assert_eq!(p.frame_patch_limit(4), 3);
    p.in_patch_limit_video = Some(10);
    assert_eq!(p.frame_patch_limit(4), 2);
    assert_eq!(p.frame_patch_limit(1), 3);
}

#[test]
fn bad_videos_are_errors_that_name_them() {
    let tmp = tempfile::tempdir().unwrap();
    let o = opts(2.0, 64);
    let l = Limits::default();
    // Missing.
    let missing = tmp.path().join("nothing.mp4");
    let e = decode_video(&missing, &o, &l).unwrap_err().to_string();
    assert!(e.contains("nothing.mp4"), "{e}");
    // A directory without frames.
    std::fs::write(tmp.path().join("notes.txt"), "x").unwrap();
    let e = decode_video(tmp.path(), &o, &l).unwrap_err().to_string();
    assert!(e.contains(&tmp.path().display().to_string()) && e.contains("no .png"), "{e}");
    // A truncated animated PNG and WebP.
    for file in ["anim.png", "anim.webp"] {
        let bytes = std::fs::read(dir().join(file)).unwrap();
        let cut = tmp.path().join(format!("cut_{file}"));
        std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
        let e = decode_video(&cut, &o, &l).unwrap_err().to_string();
        assert!(e.contains(&format!("cut_{file}")) && e.contains("corrupt"), "{e}");
    }
    // Bad options.
    assert!(decode_video(&dir().join("frames"), &opts(0.0, 4), &l).is_err());
    assert!(decode_video(&dir().join("frames"), &opts(2.0, 0), &l).is_err());
    // Another format without FFmpeg: the error names the file and the missing program.
    let clip = tmp.path().join("clip.mp4");
    std::fs::write(&clip, b"\x00\x00\x00\x18ftypmp42 not really a video").unwrap();
    let none =
        VideoOptions { ffprobe: "/nonexistent/ffprobe".into(), ffmpeg: "/nonexistent/ffmpeg".into(), ..opts(2.0, 64) };
    let e = decode_video(&clip, &none, &l).unwrap_err().to_string();
    assert!(e.contains("clip.mp4") && e.contains("/nonexistent/ffprobe") && e.contains("not found"), "{e}");
}

/// Whether FFmpeg is here; with `K3_REQUIRE_FFMPEG_CHECK=1` (CI) its absence fails the test.
/// The temporary files `decode_video_bytes` writes for FFmpeg, of this process.
fn temp_videos() -> Vec<PathBuf> {
    let prefix = format!("mlx-k3-video-{}-", std::process::id());
    let mut v: Vec<PathBuf> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&prefix)))
        .collect();
    v.sort();
    v
}

/// Animated PNG and WebP from memory give what the files give, named as the caller says; an empty or
/// oversized buffer is an error naming it.
#[test]
fn videos_in_memory_decode_as_their_files() {
    let l = Limits::default();
    for f in ["anim.png", "anim.webp"] {
        let path = dir().join(f);
        let want = decode_video(&path, &opts(5.0, 64), &l).unwrap();
        let got = media::decode_video_bytes(&std::fs::read(&path).unwrap(), "sent", &opts(5.0, 64), &l).unwrap();
        assert_eq!((got.name.as_str(), got.decoder), ("sent", want.decoder));
        assert_eq!(
            (got.indices, got.source_frames, got.source_fps),
            (want.indices, want.source_frames, want.source_fps)
        );
        assert!(got.frames == want.frames, "{f}");
    }
    let e = media::decode_video_bytes(b"", "nothing", &opts(2.0, 64), &l).unwrap_err().to_string();
    assert!(e.contains("nothing") && e.contains("empty"), "{e}");
    let small = Limits { max_file_bytes: 10, ..Limits::default() };
    let e = media::decode_video_bytes(&[0u8; 11], "big", &opts(2.0, 64), &small).unwrap_err().to_string();
    assert!(e.contains("big") && e.contains("11 bytes"), "{e}");
}

fn have_ffmpeg() -> bool {
    let ok = |p: &str| Command::new(p).arg("-version").output().is_ok_and(|o| o.status.success());
    let here = ok("ffmpeg") && ok("ffprobe");
    if !here {
        assert!(
            std::env::var("K3_REQUIRE_FFMPEG_CHECK").as_deref() != Ok("1"),
            "K3_REQUIRE_FFMPEG_CHECK=1 but ffmpeg/ffprobe are not installed"
        );
        eprintln!("SKIPPED: ffmpeg or ffprobe not installed");
    }
    here
}

#[test]
fn ffmpeg_decodes_other_video_files_to_the_same_frames() {
    if !have_ffmpeg() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // A lossless 10 fps video of the fixture's frames (FFV1, RGB), made by ffmpeg itself.
    let clip = tmp.path().join("clip.mkv");
    let st = Command::new("ffmpeg")
        .args(["-nostdin", "-v", "error", "-framerate", "10", "-i"])
        .arg(dir().join("frames/frame_%03d.png"))
        .args(["-c:v", "ffv1", "-pix_fmt", "bgr0"])
        .arg(&clip)
        .status()
        .unwrap();
    assert!(st.success());
    let want = frames("frames");
    let l = Limits::default();
    let v = decode_video(&clip, &opts(25.0, 64), &l).unwrap();
    assert_eq!((v.decoder, v.source_frames, v.source_fps), ("ffmpeg", 6, 10.0));
    assert_eq!(v.frames.len(), 6);
    for (i, (got, w)) in v.frames.iter().zip(&want).enumerate() {
        assert!(rgb(got) == rgb(w), "clip.mkv: frame {i} differs");
    }
    // Sampled: the same indices as the animated files (the rule depends on the count and rate only).
    let v = decode_video(&clip, &opts(5.0, 64), &l).unwrap();
    assert_eq!(v.indices, [0, 2, 5]);
    assert!(v.frames[1] == want[2] && v.frames[2] == want[5]);
    // The same file from memory (as a server gets it): the same frames, named as the caller says, and the
    // temporary file FFmpeg read is gone afterwards.
    let before = temp_videos();
    let bytes = std::fs::read(&clip).unwrap();
    let m = media::decode_video_bytes(&bytes, "video 0 (video/x-matroska)", &opts(5.0, 64), &l).unwrap();
    assert_eq!(
        (m.name.as_str(), m.decoder, m.indices.as_slice()),
        ("video 0 (video/x-matroska)", "ffmpeg", &[0, 2, 5][..])
    );
    assert!(m.frames == v.frames);
    let e = media::decode_video_bytes(b"\x00\x00\x00\x18ftypmp42 junk", "video 1 (video/mp4)", &opts(2.0, 64), &l)
        .unwrap_err()
        .to_string();
    assert!(e.contains("video 1 (video/mp4)") && e.contains("ffprobe"), "{e}");
    assert_eq!(temp_videos(), before, "a temporary video file was left behind");
    // A file FFmpeg cannot read: its error, naming the file.
    let junk = tmp.path().join("junk.mp4");
    std::fs::write(&junk, b"\x00\x00\x00\x18ftypmp42 not really a video").unwrap();
    let e = decode_video(&junk, &opts(2.0, 64), &l).unwrap_err().to_string();
    assert!(e.contains("junk.mp4") && e.contains("ffprobe"), "{e}");
}
