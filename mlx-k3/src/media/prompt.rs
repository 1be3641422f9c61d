//! Placeholder expansion: the prompt gets one media token per merged patch of each image, so the tower's
//! embeddings replace them one for one ([`crate::model::vision::merge_features`]).
//!
//! Kimi K3 (`KimiK3Processor.__call__` and `build_chat_segments(image_prompts=...)` of mlx-vlm 0.7.10): every
//! `<|kimi_image_placeholder|>` in the rendered chat, in order, becomes
//! `<|media_begin|>image {W}x{H}<|media_content|>` + `<|media_pad|>` x tokens + `<|media_end|>`, where `W x H`
//! is the image's original size. Like the reference, a placeholder string inside message text counts too
//! (the text around it stays ordinary text); the expansion itself is encoded with special tokens allowed.
//!
//! Kimi K2.5 (`KimiK25Processor.__call__`): the prompt is tokenized first and each `<|media_pad|>` token, in
//! order, is repeated to the image's token count ([`k25_prompt`], on ids). A chat goes through
//! [`k25_media_prompt`], which does the same on the rendered template's segments (the template writes one
//! `<|media_pad|>` per image) and also puts each video's chunk prompts in place of the template's
//! [`K25_VIDEO_PLACEHOLDER`] (Kimi K2.5's own processor does; mlx-vlm 0.7.10 takes no K2.5 video).
//!
//! Where the reference would go on with a count mismatch (more placeholders than images raises in K3's
//! segment path, fewer leaves images unused; K2.5 leaves extra pads single), these are errors naming both
//! counts: the merge would fail on such a prompt anyway.

use super::Processed;
use crate::chat::{RenderedPrompt, Segment};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// What a Kimi K3 image part renders as before expansion.
pub const IMAGE_PLACEHOLDER: &str = crate::chat::k3::IMAGE_PLACEHOLDER;
/// The media token the tower's embeddings replace (both families).
pub const MEDIA_PAD: &str = "<|media_pad|>";

/// K3's `make_image_prompt`: the text one image expands to.
pub fn k3_image_prompt(width: usize, height: usize, tokens: usize) -> String {
    format!("<|media_begin|>image {width}x{height}<|media_content|>{}<|media_end|>", MEDIA_PAD.repeat(tokens))
}

fn count_err(placeholders: usize, images: usize) -> Error {
    Error::invalid("media", format!("the prompt has {placeholders} image placeholders for {images} images"))
}

/// K3: the segments with every image placeholder replaced by its image's prompt (a special segment).
pub fn expand_k3_segments(segments: &[Segment], images: &[Processed]) -> Result<Vec<Segment>> {
    let media: Vec<Medium> = images.iter().map(Medium::Image).collect();
    expand_k3_media(segments, &media)
}

/// What a Kimi K3 video part renders as before expansion (this project's marker: the reference encoding
/// has no video part).
pub const VIDEO_PLACEHOLDER: &str = crate::chat::k3::VIDEO_PLACEHOLDER;

/// A medium of a prompt, in the order of its placeholder: an image, or a video as its chunks (each a
/// [`Processed`] with `t` frames) and each chunk's start time as the prompt writes it.
#[derive(Clone, Copy, Debug)]
pub enum Medium<'a> {
    /// One image.
    Image(&'a Processed),
    /// A video's chunks and their timestamps (one each).
    Video(&'a [Processed], &'a [String]),
}

impl Medium<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Medium::Image(_) => "image",
            Medium::Video(..) => "video",
        }
    }
}

/// Kimi's video chunk prompt (`make_chunk_prompt` of Kimi K2.5's video processor, which SGLang's Kimi K3
/// processor writes too): the chunk's start time, then `<|media_begin|>video<|media_content|>`, one
/// `<|media_pad|>` per token and `<|media_end|>`.
pub fn video_chunk_prompt(timestamp: &str, tokens: usize) -> String {
    format!("{timestamp}<|media_begin|>video<|media_content|>{}<|media_end|>", MEDIA_PAD.repeat(tokens))
}

/// K3: the segments with every image placeholder replaced by its image's prompt and every video
/// placeholder by its chunks' prompts, one after another (special segments). The placeholders must match
/// `media` in number and kind, in order.
pub fn expand_k3_media(segments: &[Segment], media: &[Medium]) -> Result<Vec<Segment>> {
    expand_media(segments, media, Family::K3)
}

/// What the rendered Kimi K2.5 chat template writes for a video part (its processor replaces it with the
/// video's chunk prompts; vLLM's `KimiK25ForConditionalGeneration` and SGLang name the same string).
pub const K25_VIDEO_PLACEHOLDER: &str = "<|kimi_k25_video_placeholder|>";

/// K2.5: the segments of a rendered chat template with the `<|media_pad|>` of each image marker repeated to
/// the image's token count (as `KimiK25Processor.__call__` repeats the token) and each
/// [`K25_VIDEO_PLACEHOLDER`] replaced by the video's chunk prompts. Only the template's own text (special
/// segments) is searched: message text stays text, so a user cannot forge a marker.
pub fn expand_k25_media(segments: &[Segment], media: &[Medium]) -> Result<Vec<Segment>> {
    expand_media(segments, media, Family::K25)
}

/// The two ways of marking media in a rendered chat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// Kimi K3: its encoding's placeholders, found in any segment (as the reference does).
    K3,
    /// Kimi K2.5: the template's pad token and video placeholder, found in special segments only.
    K25,
}

impl Family {
    fn marks(self) -> (&'static str, &'static str) {
        match self {
            Family::K3 => (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER),
            Family::K25 => (MEDIA_PAD, K25_VIDEO_PLACEHOLDER),
        }
    }

    fn searches(self, s: &Segment) -> bool {
        self == Family::K3 || s.special
    }

    fn image_prompt(self, im: &Processed) -> String {
        match self {
            Family::K3 => k3_image_prompt(im.original_size.0, im.original_size.1, im.tokens),
            Family::K25 => MEDIA_PAD.repeat(im.tokens),
        }
    }
}

fn expand_media(segments: &[Segment], media: &[Medium], family: Family) -> Result<Vec<Segment>> {
    let (image_mark, video_mark) = family.marks();
    let next_placeholder = |text: &str| -> Option<(usize, &'static str)> {
        let i = text.find(image_mark).map(|i| (i, image_mark));
        let v = text.find(video_mark).map(|i| (i, video_mark));
        match (i, v) {
            (Some(a), Some(b)) => Some(if a.0 < b.0 { a } else { b }),
            (a, b) => a.or(b),
        }
    };
    let mut found = Vec::new();
    for s in segments.iter().filter(|s| family.searches(s)) {
        let mut rest = s.text.as_str();
        while let Some((at, ph)) = next_placeholder(rest) {
            found.push(if ph == image_mark { "image" } else { "video" });
            rest = &rest[at + ph.len()..];
        }
    }
    let want: Vec<&str> = media.iter().map(Medium::kind).collect();
    if found != want {
        let images = want.iter().filter(|k| **k == "image").count();
        let videos = want.len() - images;
        let found_images = found.iter().filter(|k| **k == "image").count();
        if videos == 0 && found.len() == found_images {
            return Err(count_err(found.len(), media.len()));
        }
        return Err(Error::invalid(
            "media",
            format!(
                "the prompt's media placeholders are [{}] where the media given are [{}]",
                found.join(", "),
                want.join(", ")
            ),
        ));
    }
    let mut next = media.iter();
    let mut out = Vec::with_capacity(segments.len() + 2 * media.len());
    for s in segments {
        if !family.searches(s) || next_placeholder(&s.text).is_none() {
            out.push(s.clone());
            continue;
        }
        let mut rest = s.text.as_str();
        while let Some((at, ph)) = next_placeholder(rest) {
            if at > 0 {
                out.push(Segment { text: rest[..at].to_string(), special: s.special });
            }
            let text = match next.next().expect("counted above") {
                Medium::Image(im) => family.image_prompt(im),
                Medium::Video(chunks, stamps) => {
                    chunks.iter().zip(stamps.iter()).map(|(c, t)| video_chunk_prompt(t, c.tokens)).collect()
                }
            };
            out.push(Segment { text, special: true });
            rest = &rest[at + ph.len()..];
        }
        if !rest.is_empty() {
            out.push(Segment { text: rest.to_string(), special: s.special });
        }
    }
    Ok(out)
}

/// A prompt ready for the model: its token ids and the ids whose rows the media embeddings replace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MediaPrompt {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// The placeholder token ids for [`crate::model::vision::merge_features`] (`<|media_pad|>`).
    pub placeholder_ids: Vec<u32>,
}

/// The id of `<|media_pad|>` in `tok`, or an error saying the tokenizer has no media tokens.
pub fn media_pad_id(tok: &Tokenizer) -> Result<u32> {
    tok.token_to_id(MEDIA_PAD).ok_or_else(|| {
        Error::invalid("media", format!("the tokenizer has no {MEDIA_PAD} token (not a vision checkpoint?)"))
    })
}

/// K3: expands a rendered chat's image placeholders for `images` and encodes it as the K3 encoder does
/// (each segment on its own; special tokens only in special segments). The pad-token count of the result is
/// checked against the images' token total.
pub fn k3_prompt(tok: &Tokenizer, rendered: &RenderedPrompt, images: &[Processed]) -> Result<MediaPrompt> {
    let media: Vec<Medium> = images.iter().map(Medium::Image).collect();
    k3_media_prompt(tok, rendered, &media)
}

/// K3: [`k3_prompt`] for images and videos ([`expand_k3_media`]).
pub fn k3_media_prompt(tok: &Tokenizer, rendered: &RenderedPrompt, media: &[Medium]) -> Result<MediaPrompt> {
    media_prompt(tok, rendered, media, Family::K3)
}

/// K2.5: a rendered chat template's prompt with its images and videos ([`expand_k25_media`]), encoded as
/// the chat encoder encodes it; the pad-token count of the result is checked against the media's tokens.
pub fn k25_media_prompt(tok: &Tokenizer, rendered: &RenderedPrompt, media: &[Medium]) -> Result<MediaPrompt> {
    media_prompt(tok, rendered, media, Family::K25)
}

fn media_prompt(tok: &Tokenizer, rendered: &RenderedPrompt, media: &[Medium], family: Family) -> Result<MediaPrompt> {
    let pad = media_pad_id(tok)?;
    let mut expanded = rendered.clone();
    expanded.segments = expand_media(&rendered.segments, media, family)?;
    let ids = expanded.encode(tok)?;
    let all: Vec<&Processed> = media
        .iter()
        .flat_map(|m| match m {
            Medium::Image(p) => std::slice::from_ref(*p).iter(),
            Medium::Video(chunks, _) => chunks.iter(),
        })
        .collect();
    check_pads(&ids, pad, all.into_iter())?;
    Ok(MediaPrompt { ids, placeholder_ids: vec![pad] })
}

/// K2.5: repeats each `<|media_pad|>` token of the encoded prompt `ids` to its image's token count.
pub fn k25_prompt(tok: &Tokenizer, ids: &[u32], images: &[Processed]) -> Result<MediaPrompt> {
    let pad = media_pad_id(tok)?;
    let found = ids.iter().filter(|&&t| t == pad).count();
    if found != images.len() {
        return Err(count_err(found, images.len()));
    }
    let total: usize = images.iter().map(|i| i.tokens).sum();
    let mut out = Vec::with_capacity(ids.len() + total);
    let mut next = images.iter();
    for &t in ids {
        if t == pad {
            let n = next.next().expect("counted above").tokens;
            out.extend(std::iter::repeat_n(pad, n));
        } else {
            out.push(t);
        }
    }
    Ok(MediaPrompt { ids: out, placeholder_ids: vec![pad] })
}

fn check_pads<'a>(ids: &[u32], pad: u32, images: impl Iterator<Item = &'a Processed>) -> Result<()> {
    let want: usize = images.map(|i| i.tokens).sum();
    let got = ids.iter().filter(|&&t| t == pad).count();
    if got != want {
        // A message that itself contains the pad token's text as a special segment would do this.
        return Err(Error::invalid(
            "media",
            format!("the expanded prompt has {got} {MEDIA_PAD} tokens where the images need {want}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::media::{Image, ImageProcessor, Mode, ProcessorKind};

    #[test]
    fn a_placeholder_inside_text_splits_it_and_the_text_stays_text() {
        let p = ImageProcessor::new(ProcessorKind::K3);
        let im = p.process(&Image::from_raw(30, 20, Mode::Rgb, vec![7; 30 * 20 * 3]).unwrap()).unwrap();
        assert_eq!(im.tokens, 2); // 30x20 pads to 56x28: 4 x 2 patches, merged 2x2
        let segs = [Segment { text: format!("a{IMAGE_PLACEHOLDER}b"), special: false }];
        let out = expand_k3_segments(&segs, &[im]).unwrap();
        let want = [
            Segment { text: "a".into(), special: false },
            Segment {
                text: "<|media_begin|>image 30x20<|media_content|><|media_pad|><|media_pad|><|media_end|>".into(),
                special: true,
            },
            Segment { text: "b".into(), special: false },
        ];
        assert_eq!(out, want);
    }
}
