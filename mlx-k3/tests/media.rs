//! Media preprocessing against the Kimi K2.5 / K3 image processors of mlx-vlm 0.7.10 (with Pillow 13):
//! decoding, Pillow's bicubic resize, the transparent-background fill, padding, normalization and
//! patchify, on the images and processor configurations `scripts/make_vision_preprocess_fixtures.py`
//! wrote; and the errors for bad input.

use std::path::{Path, PathBuf};

use mlx_k3::media::{self, Image, ImageProcessor, Limits, Mode, ProcessorKind};
use serde_json::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vision_preprocess")
}

fn manifest() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("manifest.json")).unwrap()).unwrap()
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn mode(name: &str) -> Mode {
    match name {
        "L" => Mode::L,
        "LA" => Mode::La,
        "RGB" => Mode::Rgb,
        "RGBA" => Mode::Rgba,
        "P" => Mode::P,
        other => panic!("mode {other}"),
    }
}

/// Files our decoder does not reproduce bit for bit: JPEG (libjpeg-turbo in Pillow, zune-jpeg here). Lossy
/// WebP decodes exactly as libwebp does (image-webp follows its upsampling and YUV->RGB rounding), so it is
/// checked exactly with the lossless files.
fn lossy(file: &str) -> bool {
    file.ends_with(".jpg")
}

fn decoded(file: &str) -> Image {
    media::decode(&read(file), file, &Limits::default()).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// The input each processor case starts from: our decoder's image where it is bit-exact with Pillow's
/// (checked in `lossless_decoders_match_pillow`), Pillow's pixels where the decoders differ.
fn input(entry: &Value) -> Image {
    let file = entry["file"].as_str().unwrap();
    if !lossy(file) {
        return decoded(file);
    }
    let size = &entry["size"];
    let (w, h) = (size[0].as_u64().unwrap() as usize, size[1].as_u64().unwrap() as usize);
    Image::from_raw(w, h, mode(entry["mode"].as_str().unwrap()), read(&format!("{file}.decoded.bin"))).unwrap()
}

fn processor(m: &Value, name: &str) -> ImageProcessor {
    let p = &m["processors"][name];
    let kind = match p["kind"].as_str().unwrap() {
        "k25" => ProcessorKind::K25,
        _ => ProcessorKind::K3,
    };
    ImageProcessor::from_preprocessor_config(kind, &p["preprocessor_config"], name).unwrap()
}

#[test]
fn lossless_decoders_match_pillow() {
    let m = manifest();
    let mut checked = 0;
    for entry in m["images"].as_array().unwrap() {
        let file = entry["file"].as_str().unwrap();
        if lossy(file) {
            continue;
        }
        let im = decoded(file);
        assert_eq!(im.mode, mode(entry["mode"].as_str().unwrap()), "{file}: mode");
        assert_eq!(
            [im.width as u64, im.height as u64],
            [entry["size"][0].as_u64().unwrap(), entry["size"][1].as_u64().unwrap()],
            "{file}"
        );
        assert!(im.data == read(&format!("{file}.decoded.bin")), "{file}: samples differ from Pillow's");
        // convert("RGBA") pins the palette, its transparency and a gray transparent value.
        assert!(im.to_rgba().data == read(&format!("{file}.rgba.bin")), "{file}: RGBA conversion differs");
        checked += 1;
    }
    assert_eq!(checked, 16);
}

/// JPEG: zune-jpeg is not bit-exact with libjpeg-turbo (different IDCT and chroma-upsampling rounding).
/// Measured on these fixtures: the color JPEG (4:2:0) at most 3 levels off, 75% of samples exact, mean 0.35;
/// the gray one at most 1 off. The bound is that worst case plus 2 levels, tight enough that a wrong color
/// conversion or a missing upsampling step (errors of tens of levels) fails; the mean bound likewise.
#[test]
fn lossy_decoders_are_close_to_pillow() {
    let m = manifest();
    for entry in m["images"].as_array().unwrap() {
        let file = entry["file"].as_str().unwrap();
        if !lossy(file) {
            continue;
        }
        let ours = decoded(file);
        let pil = read(&format!("{file}.decoded.bin"));
        assert_eq!(ours.mode, mode(entry["mode"].as_str().unwrap()), "{file}");
        assert_eq!(ours.data.len(), pil.len(), "{file}");
        let diffs: Vec<i32> = ours.data.iter().zip(&pil).map(|(&a, &b)| (i32::from(a) - i32::from(b)).abs()).collect();
        let max = diffs.iter().copied().max().unwrap();
        let mean = diffs.iter().map(|&d| f64::from(d)).sum::<f64>() / diffs.len() as f64;
        let exact = diffs.iter().filter(|&&d| d == 0).count() as f64 / diffs.len() as f64;
        eprintln!("{file}: max |diff| {max}, mean {mean:.4}, {:.1}% exact", exact * 100.0);
        assert!(max <= MAX_LOSSY_DIFF, "{file}: max |diff| {max} against Pillow");
        assert!(mean <= 0.6, "{file}: mean |diff| {mean} against Pillow");
    }
}

const MAX_LOSSY_DIFF: i32 = 5;

#[test]
fn processors_match_mlx_vlm_pixel_for_pixel() {
    let m = manifest();
    let images: Vec<&Value> = m["images"].as_array().unwrap().iter().collect();
    let mut full = 0;
    for (n, case) in m["cases"].as_array().unwrap().iter().enumerate() {
        let pname = case["processor"].as_str().unwrap();
        let file = case["image"].as_str().unwrap();
        let what = format!("case {n} ({pname}, {file})");
        let proc = processor(&m, pname);
        let entry = images.iter().find(|e| e["file"] == case["image"]).unwrap();
        let out = proc.process(&input(entry)).unwrap_or_else(|e| panic!("{what}: {e}"));
        let size = &case["rescaled_size"];
        assert_eq!(
            [out.rgb.width as u64, out.rgb.height as u64],
            [size[0].as_u64().unwrap(), size[1].as_u64().unwrap()],
            "{what}: padded size"
        );
        let want = read(&format!("case_{n}.rgb.bin"));
        let bad = out.rgb.data.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert!(bad == 0 && out.rgb.data.len() == want.len(), "{what}: {bad} of {} samples differ", want.len());
        let grid: Vec<usize> = case["grid"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        assert_eq!(out.grid.to_vec(), grid, "{what}: grid");
        assert_eq!(out.tokens as u64, case["tokens"].as_u64().unwrap(), "{what}: tokens");
        let shape: Vec<usize> =
            case["pixel_values_shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        assert_eq!(out.pixel_values.len(), shape.iter().product::<usize>(), "{what}: pixel_values size");
        if let Some(f) = case["pixel_values"].as_str() {
            let want: Vec<f32> =
                read(f).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            // Exact: the same float32/float64 operations in the same order as the reference.
            let bad = out.pixel_values.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(bad, 0, "{what}: {bad} of {} pixel values differ", want.len());
            full += 1;
        }
    }
    assert_eq!(full, 4);
}

/// The lossy files through our own decoders: the processed pixels stay within the decoder tolerance (the
/// resize averages, so it does not amplify per-sample differences).
#[test]
fn lossy_files_through_our_decoders_stay_close() {
    let m = manifest();
    for (n, case) in m["cases"].as_array().unwrap().iter().enumerate() {
        let file = case["image"].as_str().unwrap();
        if !lossy(file) {
            continue;
        }
        let proc = processor(&m, case["processor"].as_str().unwrap());
        let out = proc.process(&decoded(file)).unwrap();
        let want = read(&format!("case_{n}.rgb.bin"));
        assert_eq!(out.rgb.data.len(), want.len());
        let max = out.rgb.data.iter().zip(&want).map(|(&a, &b)| (i32::from(a) - i32::from(b)).abs()).max().unwrap();
        assert!(max <= MAX_LOSSY_DIFF, "case {n} ({file}): max |diff| {max}");
    }
}

#[test]
fn pixel_values_stack_into_the_tower_input() {
    let m = manifest();
    let proc = processor(&m, "k3_chess");
    let a = proc.process(&decoded("rgb.png")).unwrap();
    let b = proc.process(&decoded("tiny.png")).unwrap();
    let (arr, grids) = media::stack(&[a.clone(), b.clone()], proc.patch_size).unwrap();
    let n = (a.grid[1] * a.grid[2] + b.grid[1] * b.grid[2]) as i32;
    assert_eq!(arr.shape(), vec![n, 3, 4, 4]);
    assert_eq!(grids, vec![a.grid, b.grid]);
    let flat = arr.to_vec::<f32>().unwrap();
    assert_eq!(&flat[..a.pixel_values.len()], &a.pixel_values[..]);
}

fn err(bytes: &[u8], limits: &Limits) -> String {
    media::decode(bytes, "upload.bin", limits).unwrap_err().to_string()
}

#[test]
fn corrupt_truncated_and_oversized_inputs_are_errors_naming_the_input() {
    let l = Limits::default();
    for file in ["rgb.png", "palette.png", "photo.jpg", "lossless.webp", "lossy.webp"] {
        let bytes = read(file);
        // Every truncation point in the first 64 bytes and a few later ones: an error, never a panic.
        let cuts: Vec<usize> =
            (1..64.min(bytes.len())).chain([bytes.len() / 2, bytes.len() - 9, bytes.len() - 1]).collect();
        for cut in cuts {
            if let Err(e) = media::decode(&bytes[..cut], "upload.bin", &l) {
                assert!(e.to_string().contains("upload.bin"), "{file} cut at {cut}: {e}");
            }
        }
        // Flipped bytes in the middle: an error or some image, never a panic.
        let mut garbled = bytes.clone();
        for i in (bytes.len() / 3..bytes.len() * 2 / 3).step_by(7) {
            garbled[i] ^= 0x5a;
        }
        let _ = media::decode(&garbled, "upload.bin", &l);
    }
    // The PNG's pixel data cut short must be an error (not a partly black image).
    let png = read("rgb.png");
    assert!(err(&png[..png.len() / 2], &l).contains("corrupt PNG"));
    let e = err(b"GIF89a....", &l);
    assert!(e.contains("upload.bin") && e.contains("not a PNG, JPEG or WebP"), "{e}");
    assert!(err(&[], &l).contains("not a PNG"));
    let small = Limits { max_file_bytes: 100, ..Limits::default() };
    let e = err(&png, &small);
    assert!(e.contains("more than the limit of 100"), "{e}");
    let few = Limits { max_pixels: 1000, ..Limits::default() };
    for file in ["rgb.png", "photo.jpg", "lossless.webp"] {
        let e = media::decode(&read(file), file, &few).unwrap_err().to_string();
        assert!(e.contains(file) && e.contains("more than the limit of 1000"), "{e}");
    }
    let e = media::decode_file(&dir().join("missing.png"), &l).unwrap_err().to_string();
    assert!(e.contains("missing.png"), "{e}");
}

#[test]
fn bad_processor_configs_name_the_field() {
    let cases = [
        (r#"{"media_proc_cfg": {"patch_size": 0}}"#, "patch_size"),
        (r#"{"media_proc_cfg": {"image_mean": [0.5, 0.5]}}"#, "image_mean"),
        (r#"{"media_proc_cfg": {"image_std": [0.5, 0, 0.5]}}"#, "image_std"),
        (r#"{"media_proc_cfg": {"merge_kernel_size": [2, 2, 2]}}"#, "merge_kernel_size"),
        (r#"{"media_proc_cfg": {"transparent_bg_config": {"pattern": "plaid"}}}"#, "plaid"),
        (r#"{"media_proc_cfg": []}"#, "media_proc_cfg"),
    ];
    for (text, field) in cases {
        let json: Value = serde_json::from_str(text).unwrap();
        let e = ImageProcessor::from_preprocessor_config(ProcessorKind::K3, &json, "ckpt/preprocessor_config.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains(field) && e.contains("ckpt/preprocessor_config.json"), "{text}: {e}");
    }
    // No preprocessor_config.json: the defaults (K2.5 and K3 differ in the patch limit).
    let none = Path::new("/nonexistent-checkpoint");
    assert_eq!(ImageProcessor::from_dir(ProcessorKind::K25, none).unwrap().in_patch_limit, 16384);
    assert_eq!(ImageProcessor::from_dir(ProcessorKind::K3, none).unwrap().in_patch_limit, 65536);
}

fn prompts() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("prompts.json")).unwrap()).unwrap()
}

fn processed(m: &Value, case: &Value) -> (ImageProcessor, Vec<media::Processed>) {
    let proc = processor(m, case["processor"].as_str().unwrap());
    let images = case["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| proc.process(&decoded(f.as_str().unwrap())).unwrap())
        .collect();
    (proc, images)
}

/// Kimi K3: the chat encoder's prompt with the placeholders expanded gives the ids of the processor's
/// `__call__` (which expands the rendered text and tokenizes it).
#[test]
fn k3_placeholders_expand_as_the_processor_does() {
    use mlx_k3::chat::{ChatEncoder, ChatOptions};
    use mlx_k3::tokenizer::Tokenizer;
    let (tok, cfg) = Tokenizer::load(&dir().join("tokenizer")).unwrap();
    let enc = ChatEncoder::new(&tok, cfg.chat_template.as_deref(), cfg.bos_token, cfg.eos_token).unwrap();
    let m = manifest();
    let cases = prompts();
    for (n, case) in cases["k3"].as_array().unwrap().iter().enumerate() {
        let (_, images) = processed(&m, case);
        let messages = case["messages"].as_array().unwrap();
        let rendered = enc.prompt(messages, None, &ChatOptions::default()).unwrap();
        let got = media::prompt::k3_prompt(&tok, &rendered, &images).unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(got.ids, want, "k3 case {n}");
        assert_eq!(got.placeholder_ids, vec![case["image_token_id"].as_u64().unwrap() as u32]);
        // One image too few or too many: an error naming both counts.
        let e = media::prompt::k3_prompt(&tok, &rendered, &images[..1]).unwrap_err().to_string();
        assert!(e.contains("2 image placeholders for 1 images"), "{e}");
    }
}

/// Kimi K2.5: each `<|media_pad|>` token repeated to its image's token count, as `KimiK25Processor.__call__`.
#[test]
fn k25_media_pads_repeat_as_the_processor_does() {
    use mlx_k3::tokenizer::Tokenizer;
    let (tok, _) = Tokenizer::load(&dir().join("tokenizer")).unwrap();
    let m = manifest();
    for case in prompts()["k25"].as_array().unwrap() {
        let (_, images) = processed(&m, case);
        let ids = tok.encode(case["text"].as_str().unwrap(), true).unwrap();
        let got = media::prompt::k25_prompt(&tok, &ids, &images).unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(got.ids, want);
        let e = media::prompt::k25_prompt(&tok, &ids, &images[..1]).unwrap_err().to_string();
        assert!(e.contains("2 image placeholders for 1 images"), "{e}");
    }
    // A tokenizer without media tokens says so.
    let (plain, _) = Tokenizer::load(&dir().join("../chat/k3_tokenizer")).unwrap();
    let e = media::prompt::media_pad_id(&plain).unwrap_err().to_string();
    assert!(e.contains("<|media_pad|>"), "{e}");
}

/// Video: frames in chunks of up to 4; a chunk's pixel values are its frames' image patches in frame order,
/// its grid `(t, h, w)`, its tokens one frame's (the towers pool over `t`).
#[test]
fn video_frames_become_chunks_of_image_patches() {
    let m = manifest();
    let proc = processor(&m, "k3_chess");
    let dir = tempfile::tempdir().unwrap();
    // Five frames: the same picture shifted by a column each time, written as PNG files out of order.
    let base = decoded("rgb.png");
    let mut frames = Vec::new();
    for i in 0..5usize {
        let mut data = base.data.clone();
        data.rotate_left(3 * i);
        frames.push(Image::from_raw(base.width, base.height, Mode::Rgb, data).unwrap());
    }
    for i in [3usize, 0, 4, 1, 2] {
        write_png(&frames[i], &dir.path().join(format!("frame_{i:03}.png")));
    }
    std::fs::write(dir.path().join("notes.txt"), "not a frame").unwrap();
    let loaded = media::decode_frames_dir(dir.path(), &Limits::default(), 100).unwrap();
    assert_eq!(loaded, frames);
    let chunks = proc.process_video(&loaded, media::VIDEO_CHUNK_FRAMES).unwrap();
    assert_eq!(chunks.len(), 2);
    let one = proc.process(&frames[0]).unwrap();
    assert_eq!(chunks[0].grid, [4, one.grid[1], one.grid[2]]);
    assert_eq!(chunks[1].grid, [1, one.grid[1], one.grid[2]]);
    assert_eq!(chunks[0].tokens, one.tokens);
    let mut want = Vec::new();
    for f in &frames[..4] {
        want.extend(proc.process(f).unwrap().pixel_values);
    }
    assert!(chunks[0].pixel_values == want);
    assert!(chunks[1].pixel_values == proc.process(&frames[4]).unwrap().pixel_values);
    // Frames of different sizes, no frames, too many frames: errors.
    let e = proc.process_video(&[frames[0].clone(), decoded("tiny.png")], 4).unwrap_err().to_string();
    assert!(e.contains("video frame 1 is 3x2"), "{e}");
    assert!(proc.process_video(&[], 4).is_err());
    let e = media::decode_frames_dir(dir.path(), &Limits::default(), 4).unwrap_err().to_string();
    assert!(e.contains("5 frames, more than the limit of 4"), "{e}");
    let empty = tempfile::tempdir().unwrap();
    let e = media::decode_frames_dir(empty.path(), &Limits::default(), 4).unwrap_err().to_string();
    assert!(e.contains("no .png"), "{e}");
}

fn write_png(im: &Image, path: &Path) {
    let file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut enc = png::Encoder::new(file, im.width as u32, im.height as u32);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header().unwrap().write_image_data(&im.data).unwrap();
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xedb8_8320 ^ (c >> 1) } else { c >> 1 };
        }
    }
    !c
}

/// Headers that claim huge images are refused from the header, before any pixel buffer is allocated (a
/// 60000 x 60000 RGB image would need 10 GB).
#[test]
fn huge_dimensions_are_refused_from_the_header() {
    let l = Limits::default();
    // PNG: IHDR's width and height (bytes 16..24), with the chunk's CRC recomputed.
    let mut png = read("rgb.png");
    png[16..20].copy_from_slice(&60000u32.to_be_bytes());
    png[20..24].copy_from_slice(&60000u32.to_be_bytes());
    let crc = crc32(&png[12..29]);
    png[29..33].copy_from_slice(&crc.to_be_bytes());
    let e = err(&png, &l);
    assert!(e.contains("60000x60000") && e.contains("more than the limit"), "{e}");
    // JPEG: the SOF0 segment's height and width.
    let mut jpg = read("photo.jpg");
    let sof = jpg.windows(2).position(|w| w == [0xff, 0xc0]).unwrap();
    jpg[sof + 5..sof + 7].copy_from_slice(&60000u16.to_be_bytes());
    jpg[sof + 7..sof + 9].copy_from_slice(&60000u16.to_be_bytes());
    let e = err(&jpg, &l);
    assert!(e.contains("60000x60000") && e.contains("more than the limit"), "{e}");
    // Lossless WebP: the VP8L header's 14-bit width-1 and height-1 (bytes 21..25 of the file). (image-webp
    // 0.2.4 reads 16384, the largest the field holds, as 0, which is refused too.)
    let mut webp = read("lossless.webp");
    assert_eq!(&webp[12..16], b"VP8L");
    let bits = u32::from_le_bytes([webp[21], webp[22], webp[23], webp[24]]);
    let bits = (bits & !((1 << 28) - 1)) | 11999 | (11999 << 14);
    webp[21..25].copy_from_slice(&bits.to_le_bytes());
    let e = err(&webp, &l);
    assert!(e.contains("12000x12000") && e.contains("more than the limit"), "{e}");
}

/// Random byte changes to every fixture file (a fixed seed, 300 mutants per file): each decodes to a
/// consistent image, which the K3 processor then processes, or is an error naming the input; never a panic.
#[test]
fn mutated_files_decode_or_fail_cleanly() {
    let m = manifest();
    let mut proc = ImageProcessor::new(ProcessorKind::K3);
    proc.patch_size = 4;
    proc.in_patch_limit = 64;
    proc.transparent_bg = Some(media::Background::Solid(255));
    let limits = Limits { max_pixels: 1 << 16, ..Limits::default() };
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut ok, mut failed) = (0, 0);
    for entry in m["images"].as_array().unwrap() {
        let original = read(entry["file"].as_str().unwrap());
        for _ in 0..300 {
            let mut bytes = original.clone();
            for _ in 0..1 + next() % 4 {
                let i = (next() % bytes.len() as u64) as usize;
                bytes[i] = next() as u8;
            }
            match media::decode(&bytes, "mutant", &limits) {
                Ok(im) => {
                    assert_eq!(im.data.len(), im.width * im.height * im.mode.bands());
                    let out = proc.process(&im).unwrap();
                    assert_eq!(out.pixel_values.len(), out.grid[1] * out.grid[2] * 3 * 16);
                    ok += 1;
                }
                Err(e) => {
                    assert!(e.to_string().starts_with("mutant: "), "{e}");
                    failed += 1;
                }
            }
        }
    }
    eprintln!("{ok} mutants decoded, {failed} refused");
    assert!(ok > 0 && failed > 0);
}
