//! Images and videos in chat requests: `image_url` content parts carrying `data:` URLs (base64 PNG, JPEG or
//! WebP) and `video_url` parts carrying `data:` URLs of a video file (MP4, WebM, QuickTime, Matroska or GIF,
//! decoded by the optional FFmpeg programs; animated PNG or WebP, decoded here). The server fetches nothing: a
//! remote URL is refused with a 400 that says to send the bytes instead. [`extract_images`] takes the media
//! out of the messages' content (each part becomes a bare `{"type": "image_url"}` or `{"type":
//! "video_url"}`, which the chat encodings render as the model's placeholder), checks the limits, and keys
//! each image by the SHA-256 of its bytes (the prompt cache resumes only over the same image; a video's
//! chunks are keyed by their decoded frames).

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::State;
use mlx_k3::generate::ImageInput;

/// The media types an image part may carry (the decoders the server has).
pub const IMAGE_TYPES: [&str; 3] = ["image/png", "image/jpeg", "image/webp"];

/// The media types a video part may carry: animated PNG and WebP are decoded here, the others by FFmpeg
/// (`ffprobe` and `ffmpeg`, or the programs `K3_FFPROBE` / `K3_FFMPEG` name, on the server's machine).
pub const VIDEO_TYPES: [&str; 8] = [
    "video/mp4",
    "video/webm",
    "video/quicktime",
    "video/x-matroska",
    "image/gif",
    "image/apng",
    "image/png",
    "image/webp",
];

/// Limits on the images and videos of one request.
#[derive(Clone, Copy, Debug)]
pub struct ImageLimits {
    /// Most images in one request.
    pub max_images: usize,
    /// Most bytes of one image, decoded from base64 (the encoded file, before the image is decoded).
    pub max_image_bytes: usize,
    /// Most videos in one request.
    pub max_videos: usize,
    /// Most bytes of one video file, decoded from base64.
    pub max_video_bytes: usize,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits { max_images: 8, max_image_bytes: 16 << 20, max_videos: 2, max_video_bytes: 64 << 20 }
    }
}

/// One image or video of a request: its file bytes, media type, and content key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestImage {
    /// The file as sent.
    pub bytes: Vec<u8>,
    /// Its media type, from the data URL.
    pub media_type: String,
    /// The first 8 bytes of the SHA-256 of `bytes`.
    pub key: u64,
    /// A video (`video_url` part) rather than an image.
    pub video: bool,
}

/// The image or video of one content part, if it is a media part: `{"type": "image_url", "image_url":
/// {"url": ...}}` (OpenAI's form) or `{"type": "image_url", "image_url": "..."}`, and the same with
/// `video_url` (vLLM's form for videos). `param` names the part in errors.
fn part_image(part: &Value, param: &str, limits: &ImageLimits) -> Result<Option<RequestImage>, ApiError> {
    let field = match part.get("type").and_then(Value::as_str) {
        Some("image_url") => "image_url",
        Some("video_url") => "video_url",
        _ => return Ok(None),
    };
    let what = if field == "image_url" { "an image part" } else { "a video part" };
    let url = match part.get(field) {
        Some(Value::String(s)) => s.as_str(),
        Some(Value::Object(o)) => match o.get("url").and_then(Value::as_str) {
            Some(u) => u,
            None => return Err(ApiError::bad_param(&format!("{param}.{field}.url"), format!("{what} needs a url"))),
        },
        _ => return Err(ApiError::bad_param(&format!("{param}.{field}"), format!("{what} needs {field}.url"))),
    };
    let param = format!("{param}.{field}.url");
    if field == "image_url" {
        data_url_image(url, &param, limits).map(Some)
    } else {
        data_url_file(url, &param, limits, true).map(Some)
    }
}

/// The image a `data:` URL carries (`param` names it in errors): base64 PNG, JPEG or WebP within `limits`.
pub fn data_url_image(url: &str, param: &str, limits: &ImageLimits) -> Result<RequestImage, ApiError> {
    data_url_file(url, param, limits, false)
}

/// The image (or with `video`, the video file) a `data:` URL carries, within `limits`.
fn data_url_file(url: &str, param: &str, limits: &ImageLimits, video: bool) -> Result<RequestImage, ApiError> {
    let param = param.to_string();
    let (what, types, max) = if video {
        ("video", &VIDEO_TYPES[..], limits.max_video_bytes)
    } else {
        ("image", &IMAGE_TYPES[..], limits.max_image_bytes)
    };
    let example = if video { "data:video/mp4;base64,..." } else { "data:image/png;base64,..." };
    let Some(rest) = url.strip_prefix("data:") else {
        let scheme = url.split(':').next().unwrap_or("");
        return Err(ApiError::bad_param(
            &param,
            format!("the server fetches no URLs ({scheme:?} given): send the {what} itself as a data URL ({example})"),
        ));
    };
    let Some((header, payload)) = rest.split_once(',') else {
        return Err(ApiError::bad_param(&param, "a data URL needs a ',' before its data"));
    };
    let Some(media_type) = header.strip_suffix(";base64") else {
        return Err(ApiError::bad_param(&param, format!("{what} data URLs must be base64 ({example})")));
    };
    let media_type = media_type.to_ascii_lowercase();
    if !types.contains(&media_type.as_str()) {
        return Err(ApiError::bad_param(
            &param,
            format!("{what} type {media_type:?} is not one of {}", types.join(", ")),
        ));
    }
    // Refuse by the encoded length before decoding anything (4 base64 characters per 3 bytes).
    let payload = payload.trim();
    if payload.len() / 4 * 3 > max + 3 {
        return Err(too_large(&param, what, payload.len() / 4 * 3, max));
    }
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(payload)
        .map_err(|e| ApiError::bad_param(&param, format!("the {what}'s base64 is invalid: {e}")))?;
    if bytes.len() > max {
        return Err(too_large(&param, what, bytes.len(), max));
    }
    if bytes.is_empty() {
        return Err(ApiError::bad_param(&param, format!("the {what} is empty")));
    }
    let digest = Sha256::digest(&bytes);
    let key = u64::from_le_bytes(digest[..8].try_into().unwrap_or([0; 8]));
    Ok(RequestImage { bytes, media_type, key, video })
}

fn too_large(param: &str, what: &str, n: usize, max: usize) -> ApiError {
    ApiError::bad_param(param, format!("the {what} has {n} bytes; at most {max} are taken"))
}

/// Takes the images and videos out of messages' `content` values (in order), leaving a bare
/// `{"type": "image_url"}` or `{"type": "video_url"}` part in place of each. `param_of(i)` names message `i`'s
/// content in errors.
pub fn extract_images<'a>(
    contents: impl IntoIterator<Item = &'a mut Value>,
    param_of: impl Fn(usize) -> String,
    limits: &ImageLimits,
) -> Result<Vec<RequestImage>, ApiError> {
    let mut media: Vec<RequestImage> = Vec::new();
    for (i, content) in contents.into_iter().enumerate() {
        let Value::Array(parts) = content else { continue };
        for (j, part) in parts.iter_mut().enumerate() {
            let param = format!("{}[{j}]", param_of(i));
            if let Some(m) = part_image(part, &param, limits)? {
                let (n, max, what) = if m.video {
                    (media.iter().filter(|x| x.video).count(), limits.max_videos, "videos")
                } else {
                    (media.iter().filter(|x| !x.video).count(), limits.max_images, "images")
                };
                if n == max {
                    return Err(ApiError::bad_param(&param, format!("more than {max} {what} in one request")));
                }
                *part = json!({ "type": if m.video { "video_url" } else { "image_url" } });
                media.push(m);
            }
        }
    }
    Ok(media)
}

/// A request's images and videos as the prompt encoder takes them (named `image i (type)` and `video i
/// (type)` in errors; videos are decoded later, off the engine thread), or a 400 when the loaded model has
/// no vision tower.
pub fn image_inputs(state: &State, media: Vec<RequestImage>) -> Result<Vec<RequestMedium>, ApiError> {
    if !media.is_empty() && state.engine.encoder().image_processor.is_none() {
        let what = if media.iter().any(|m| m.video) { "images or videos" } else { "images" };
        return Err(ApiError::bad_param(
            "messages",
            format!("the loaded model has no vision tower: it takes no {what}"),
        ));
    }
    let (mut images, mut videos) = (0, 0);
    Ok(media
        .into_iter()
        .map(|m| {
            if m.video {
                videos += 1;
                RequestMedium::Video { name: format!("video {} ({})", videos - 1, m.media_type), bytes: m.bytes }
            } else {
                images += 1;
                RequestMedium::Image(ImageInput {
                    name: format!("image {} ({})", images - 1, m.media_type),
                    bytes: m.bytes,
                })
            }
        })
        .collect())
}

/// An image ready for the prompt encoder, or a video file still to be decoded (into frames, with the
/// checkpoint's sampling) where the prompt is encoded.
#[derive(Clone, Debug)]
pub enum RequestMedium {
    /// An image.
    Image(ImageInput),
    /// A video file and its name in errors.
    Video {
        /// The name in errors (`video i (type)`).
        name: String,
        /// The file.
        bytes: Vec<u8>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;

    fn data_url(ty: &str, bytes: &[u8]) -> String {
        format!("data:{ty};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
    }

    fn one(part: Value, limits: &ImageLimits) -> Result<Vec<RequestImage>, ApiError> {
        let mut content = json!([{"type": "text", "text": "what is this?"}, part]);
        extract_images([&mut content], |i| format!("messages[{i}].content"), limits)
    }

    #[test]
    fn data_urls_become_images_and_bare_parts() {
        let png = b"\x89PNG\r\n\x1a\nfake".to_vec();
        let mut a = json!([{"type": "image_url", "image_url": {"url": data_url("image/png", &png)}},
                           {"type": "text", "text": "and"}]);
        let mut b = json!("no images");
        let mut c = json!([{"type": "image_url", "image_url": data_url("image/JPEG", b"jpg")}]);
        let images =
            extract_images([&mut a, &mut b, &mut c], |i| format!("messages[{i}].content"), &ImageLimits::default())
                .unwrap();
        assert_eq!(images.len(), 2);
        assert_eq!((images[0].bytes.as_slice(), images[0].media_type.as_str()), (png.as_slice(), "image/png"));
        assert_eq!(images[1].media_type, "image/jpeg");
        // The key is the SHA-256's first 8 bytes, little-endian (independent: sha2 over the same bytes).
        let d = Sha256::digest(&png);
        assert_eq!(images[0].key, u64::from_le_bytes(d[..8].try_into().unwrap()));
        assert_ne!(images[0].key, images[1].key);
        assert_eq!(a[0], json!({"type": "image_url"}));
        assert_eq!(a[1]["text"], "and");
        assert_eq!(b, json!("no images"));
    }

    #[test]
    fn remote_urls_and_bad_data_are_400s_naming_the_part() {
        let l = ImageLimits::default();
        let e = one(json!({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}), &l).unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.param.as_deref(), Some("messages[0].content[1].image_url.url"));
        assert!(e.message.contains("fetches no URLs"), "{}", e.message);
        for (url, says) in [
            ("data:image/png;base64", "','"),
            ("data:image/png,rawbytes", "base64"),
            ("data:image/gif;base64,R0lG", "not one of"),
            ("data:image/png;base64,@@@@", "invalid"),
            ("data:image/png;base64,", "empty"),
        ] {
            let e = one(json!({"type": "image_url", "image_url": {"url": url}}), &l).unwrap_err();
            assert!(e.message.contains(says), "{url}: {}", e.message);
        }
        let e = one(json!({"type": "image_url"}), &l).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[1].image_url"));
        // The same for video parts, with the video types.
        let e = one(json!({"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}), &l).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[1].video_url.url"));
        assert!(e.message.contains("fetches no URLs") && e.message.contains("data:video/mp4"), "{}", e.message);
        let e = one(json!({"type": "video_url", "video_url": {"url": "data:image/jpeg;base64,AAAA"}}), &l).unwrap_err();
        assert!(e.message.contains("video type \"image/jpeg\" is not one of"), "{}", e.message);
        let e = one(json!({"type": "video_url"}), &l).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[1].video_url"));
    }

    #[test]
    fn video_parts_become_videos_and_bare_parts() {
        let mut a = json!([{"type": "video_url", "video_url": {"url": data_url("video/MP4", b"mp4 bytes")}},
                           {"type": "image_url", "image_url": data_url("image/png", b"png")},
                           {"type": "video_url", "video_url": data_url("image/apng", b"apng")}]);
        let media = extract_images([&mut a], |i| format!("messages[{i}].content"), &ImageLimits::default()).unwrap();
        let kinds: Vec<(bool, &str)> = media.iter().map(|m| (m.video, m.media_type.as_str())).collect();
        assert_eq!(kinds, [(true, "video/mp4"), (false, "image/png"), (true, "image/apng")]);
        assert_eq!(a, json!([{"type": "video_url"}, {"type": "image_url"}, {"type": "video_url"}]));
        // Videos are counted apart from images.
        let l = ImageLimits { max_videos: 1, max_video_bytes: 8, ..ImageLimits::default() };
        let v = json!({"type": "video_url", "video_url": {"url": data_url("video/webm", b"webm")}});
        let mut two = json!([v.clone(), {"type": "image_url", "image_url": data_url("image/png", b"png")}, v]);
        let e = extract_images([&mut two], |_| "messages[0].content".into(), &l).unwrap_err();
        assert!(e.message.contains("more than 1 videos"), "{}", e.message);
        assert_eq!(e.param.as_deref(), Some("messages[0].content[2]"));
        let big = json!({"type": "video_url", "video_url": {"url": data_url("video/webm", &[1u8; 9])}});
        assert!(one(big, &l).unwrap_err().message.contains("the video has 9 bytes; at most 8"));
    }

    #[test]
    fn limits_are_enforced() {
        let l = ImageLimits { max_images: 1, max_image_bytes: 100, ..ImageLimits::default() };
        let ok = json!({"type": "image_url", "image_url": {"url": data_url("image/webp", &[7u8; 100])}});
        assert_eq!(one(ok.clone(), &l).unwrap().len(), 1);
        let big = json!({"type": "image_url", "image_url": {"url": data_url("image/webp", &[7u8; 101])}});
        assert!(one(big, &l).unwrap_err().message.contains("101 bytes"));
        let huge = json!({"type": "image_url", "image_url": {"url": data_url("image/webp", &[7u8; 10_000])}});
        assert!(one(huge, &l).unwrap_err().message.contains("at most 100"));
        let mut two = json!([ok.clone(), ok]);
        let e = extract_images([&mut two], |_| "messages[0].content".into(), &l).unwrap_err();
        assert!(e.message.contains("more than 1 images"), "{}", e.message);
    }
}
