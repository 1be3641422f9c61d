//! Images in chat requests: `image_url` content parts carrying `data:` URLs (base64 PNG, JPEG or WebP).
//! The server fetches nothing: a remote URL is refused with a 400 that says to send the bytes instead.
//! [`extract_images`] takes the images out of the messages' content (each part becomes a bare
//! `{"type": "image_url"}`, which the chat encodings render as the model's image placeholder), checks the
//! limits, and keys each image by the SHA-256 of its bytes (the prompt cache resumes only over the same
//! image).

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::State;
use mlx_k3::generate::ImageInput;

/// The media types an image part may carry (the decoders the server has).
pub const IMAGE_TYPES: [&str; 3] = ["image/png", "image/jpeg", "image/webp"];

/// Limits on the images of one request.
#[derive(Clone, Copy, Debug)]
pub struct ImageLimits {
    /// Most images in one request.
    pub max_images: usize,
    /// Most bytes of one image, decoded from base64 (the encoded file, before the image is decoded).
    pub max_image_bytes: usize,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits { max_images: 8, max_image_bytes: 16 << 20 }
    }
}

/// One image of a request: its file bytes, media type, and content key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestImage {
    /// The file as sent (PNG, JPEG or WebP).
    pub bytes: Vec<u8>,
    /// Its media type, from the data URL.
    pub media_type: String,
    /// The first 8 bytes of the SHA-256 of `bytes`.
    pub key: u64,
}

/// The image of one content part, if it is an image part: `{"type": "image_url", "image_url": {"url": ...}}`
/// (OpenAI's form) or `{"type": "image_url", "image_url": "..."}`. `param` names the part in errors.
fn part_image(part: &Value, param: &str, limits: &ImageLimits) -> Result<Option<RequestImage>, ApiError> {
    if part.get("type").and_then(Value::as_str) != Some("image_url") {
        return Ok(None);
    }
    let url = match part.get("image_url") {
        Some(Value::String(s)) => s.as_str(),
        Some(Value::Object(o)) => match o.get("url").and_then(Value::as_str) {
            Some(u) => u,
            None => return Err(ApiError::bad_param(&format!("{param}.image_url.url"), "an image part needs a url")),
        },
        _ => return Err(ApiError::bad_param(&format!("{param}.image_url"), "an image part needs image_url.url")),
    };
    data_url_image(url, &format!("{param}.image_url.url"), limits).map(Some)
}

/// The image a `data:` URL carries (`param` names it in errors): base64 PNG, JPEG or WebP within `limits`.
pub fn data_url_image(url: &str, param: &str, limits: &ImageLimits) -> Result<RequestImage, ApiError> {
    let param = param.to_string();
    let Some(rest) = url.strip_prefix("data:") else {
        let scheme = url.split(':').next().unwrap_or("");
        return Err(ApiError::bad_param(
            &param,
            format!(
                "the server fetches no URLs ({scheme:?} given): send the image itself as a data URL \
                 (data:image/png;base64,...)"
            ),
        ));
    };
    let Some((header, payload)) = rest.split_once(',') else {
        return Err(ApiError::bad_param(&param, "a data URL needs a ',' before its data"));
    };
    let Some(media_type) = header.strip_suffix(";base64") else {
        return Err(ApiError::bad_param(&param, "image data URLs must be base64 (data:image/png;base64,...)"));
    };
    let media_type = media_type.to_ascii_lowercase();
    if !IMAGE_TYPES.contains(&media_type.as_str()) {
        return Err(ApiError::bad_param(
            &param,
            format!("image type {media_type:?} is not one of {}", IMAGE_TYPES.join(", ")),
        ));
    }
    // Refuse by the encoded length before decoding anything (4 base64 characters per 3 bytes).
    let payload = payload.trim();
    if payload.len() / 4 * 3 > limits.max_image_bytes + 3 {
        return Err(too_large(&param, payload.len() / 4 * 3, limits));
    }
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(payload)
        .map_err(|e| ApiError::bad_param(&param, format!("the image's base64 is invalid: {e}")))?;
    if bytes.len() > limits.max_image_bytes {
        return Err(too_large(&param, bytes.len(), limits));
    }
    if bytes.is_empty() {
        return Err(ApiError::bad_param(&param, "the image is empty"));
    }
    let digest = Sha256::digest(&bytes);
    let key = u64::from_le_bytes(digest[..8].try_into().unwrap_or([0; 8]));
    Ok(RequestImage { bytes, media_type, key })
}

fn too_large(param: &str, n: usize, limits: &ImageLimits) -> ApiError {
    ApiError::bad_param(param, format!("the image has {n} bytes; at most {} are taken", limits.max_image_bytes))
}

/// Takes the images out of messages' `content` values (in order), leaving a bare `{"type": "image_url"}`
/// part in place of each. `param_of(i)` names message `i`'s content in errors.
pub fn extract_images<'a>(
    contents: impl IntoIterator<Item = &'a mut Value>,
    param_of: impl Fn(usize) -> String,
    limits: &ImageLimits,
) -> Result<Vec<RequestImage>, ApiError> {
    let mut images = Vec::new();
    for (i, content) in contents.into_iter().enumerate() {
        let Value::Array(parts) = content else { continue };
        for (j, part) in parts.iter_mut().enumerate() {
            let param = format!("{}[{j}]", param_of(i));
            if let Some(img) = part_image(part, &param, limits)? {
                if images.len() == limits.max_images {
                    return Err(ApiError::bad_param(
                        &param,
                        format!("more than {} images in one request", limits.max_images),
                    ));
                }
                images.push(img);
                *part = json!({"type": "image_url"});
            }
        }
    }
    Ok(images)
}

/// A request's images as the prompt encoder takes them (named `image i (type)` in errors), or a 400 when the
/// loaded model has no vision tower.
pub fn image_inputs(state: &State, images: Vec<RequestImage>) -> Result<Vec<ImageInput>, ApiError> {
    if !images.is_empty() && state.engine.encoder().image_processor.is_none() {
        return Err(ApiError::bad_param("messages", "the loaded model has no vision tower: it takes no images"));
    }
    Ok(images
        .into_iter()
        .enumerate()
        .map(|(i, im)| ImageInput { name: format!("image {i} ({})", im.media_type), bytes: im.bytes })
        .collect())
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
    }

    #[test]
    fn limits_are_enforced() {
        let l = ImageLimits { max_images: 1, max_image_bytes: 100 };
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
