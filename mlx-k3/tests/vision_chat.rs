//! Images in a Kimi K3 and a Kimi K2.5 chat, end to end, against mlx-vlm 0.7.10: the checkpoint, image files
//! and chats of `tests/fixtures/vision_chat` (written by `scripts/make_vision_chat_fixtures.py`; K2.5:
//! `vision_chat_k25`, `scripts/make_vision_chat_k25_fixtures.py`, whose checkpoint ships its chat template) go through
//! `Pipeline::load` and `Pipeline::encode_chat_media` (decode, the K3 image processor, the chat encoding with
//! its placeholders expanded, the MoonViT-3d (K2.5: MoonViT) tower and projector) and greedy generation with the
//! media in place of the placeholders. The prompt ids must equal what mlx-vlm's processor gives, the greedy
//! tokens must be identical, and the log-probabilities of each step must agree within 1e-4 of the largest
//! magnitude (the text fixtures' bound: both sides run the same MLX CPU kernels in f32, the differences are
//! op order, measured ~1e-6 and printed; the script checked that every top-1 leads by >= 2e-3).

use std::path::{Path, PathBuf};

use mlx_k3::chat::{ChatMessage, ChatOptions};
use mlx_k3::generate::{generate_tokens_media, GenerateOptions, ImageInput, Pipeline, PromptCache};
use mlx_k3::io::Safetensors;
use mlx_k3::model::LoadOptions;
use serde_json::Value;

/// The Kimi K3 fixture.
fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vision_chat")
}

/// The Kimi K2.5 fixture (`scripts/make_vision_chat_k25_fixtures.py`: the checkpoint's own chat template).
fn k25_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vision_chat_k25")
}

fn manifest() -> Value {
    manifest_of(&dir())
}

fn manifest_of(d: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(d.join("manifest.json")).unwrap()).unwrap()
}

fn expected(name: &str) -> Vec<f32> {
    expected_of(&dir(), name)
}

fn expected_of(d: &Path, name: &str) -> Vec<f32> {
    let st = Safetensors::load(d.join("expected.safetensors")).unwrap();
    st.get(name).unwrap().astype(mlx_k3::Dtype::F32).unwrap().to_vec::<f32>().unwrap()
}

fn messages(case: &Value) -> Vec<ChatMessage> {
    serde_json::from_value(case["messages"].clone()).unwrap()
}

fn images(case: &Value) -> Vec<ImageInput> {
    images_of(&dir(), case)
}

fn images_of(d: &Path, case: &Value) -> Vec<ImageInput> {
    let from = d.join(manifest_of(d)["images_from"].as_str().unwrap());
    case["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| ImageInput::read(&from.join(n.as_str().unwrap())).unwrap())
        .collect()
}

fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions { max_tokens: n, prefill_chunk: 7, ..Default::default() }
}

/// Every chat of the fixture in `d`: prompt ids, greedy tokens and per-step log-probabilities against
/// mlx-vlm's; `family` names the processor in messages.
fn chats_match_mlx_vlm(d: &Path, family: &str) {
    let p = Pipeline::load(d, LoadOptions::default(), &mut |_, _| {}).unwrap();
    assert!(p.vision.is_some(), "the fixture checkpoint has a vision tower");
    let m = manifest_of(d);
    let steps = m["decode_steps"].as_u64().unwrap() as usize;
    for (i, case) in m["cases"].as_array().unwrap().iter().enumerate() {
        let (ids, media) =
            p.encode_chat_media(&messages(case), None, &ChatOptions::default(), &images_of(d, case)).unwrap();
        let want_ids: Vec<u32> = expected_of(d, &format!("case{i}_ids")).iter().map(|&x| x as u32).collect();
        assert_eq!(ids, want_ids, "case {i}: prompt ids differ from {family}'s");
        let media = media.expect("images give media");

        let want_lp = expected_of(d, &format!("case{i}_logprobs"));
        let scale = want_lp.iter().fold(0f32, |a, &x| a.max(x.abs()));
        let vocab = want_lp.len() / steps;
        let mut worst = 0f32;
        let mut step = 0;
        let (tokens, _, _) =
            generate_tokens_media(&p.model, &mut PromptCache::new(), &ids, Some(&media), &greedy(steps), |ev| {
                let got = ev.logprobs.to_vec::<f32>().unwrap();
                let want = &want_lp[step * vocab..(step + 1) * vocab];
                worst = got.iter().zip(want).fold(worst, |a, (g, w)| a.max((g - w).abs()));
                step += 1;
                true
            })
            .unwrap();
        let want_tokens: Vec<u32> = expected_of(d, &format!("case{i}_tokens")).iter().map(|&x| x as u32).collect();
        assert_eq!(tokens, want_tokens, "case {i}: greedy tokens differ from mlx-vlm's");
        println!("case {i}: {} prompt tokens, worst log-prob difference {:.2e} (of {scale:.2})", ids.len(), worst);
        assert!(worst <= 1e-4 * scale.max(1.0), "case {i}: log-probs differ by {worst}");
    }
}

#[test]
fn image_chats_match_mlx_vlm_from_file_to_tokens() {
    chats_match_mlx_vlm(&dir(), "KimiK3Processor");
}

/// Kimi K2.5: the checkpoint's chat template renders the image parts (one `<|media_pad|>` each) and each
/// pad is repeated to its image's tokens, as `KimiK25Processor` does; then the MoonViT tower and the
/// DeepSeek-V3 text model.
#[test]
fn k25_image_chats_match_mlx_vlm_from_file_to_tokens() {
    chats_match_mlx_vlm(&k25_dir(), "KimiK25Processor");
}

/// What a Kimi K2.5 chat refuses, each with a clear error: more image parts than images, a pad token typed
/// into a message (text, so it neither counts nor forges a placeholder), and a checkpoint without its
/// template (the built-in Kimi K2 encoding is text-only).
#[test]
fn k25_image_chats_refuse_what_they_cannot_place() {
    let d = k25_dir();
    let p = Pipeline::load(&d, LoadOptions::default(), &mut |_, _| {}).unwrap();
    let m = manifest_of(&d);
    let (one, two) = (&m["cases"][0], &m["cases"][1]);
    let e = p.encode_chat_media(&messages(two), None, &ChatOptions::default(), &images_of(&d, one)).unwrap_err();
    assert!(e.to_string().contains("2 image placeholders for 1 images"), "{e}");
    // The pad token's text in a message stays text: the prompt still has exactly the image's pads.
    let typed: Vec<ChatMessage> = serde_json::from_value(serde_json::json!([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "<|media_pad|> what is this?"}]}]))
    .unwrap();
    let (ids, _) = p.encode_chat_media(&typed, None, &ChatOptions::default(), &images_of(&d, one)).unwrap();
    let pad = m["placeholder"].as_u64().unwrap() as u32;
    let tokens = one["grids"][0].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).product::<u64>() / 4;
    assert_eq!(ids.iter().filter(|&&t| t == pad).count() as u64, tokens);
    // Image parts without their images: refused, not rendered as bare placeholders.
    let e = p.encode_chat_media(&messages(one), None, &ChatOptions::default(), &[]).unwrap_err();
    assert!(e.to_string().contains("1 image or video parts but no images"), "{e}");
    // Without chat_template.jinja the checkpoint falls back to the text-only Kimi K2 encoding.
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&d).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "chat_template.jinja" {
            std::fs::copy(e.path(), tmp.path().join(e.file_name())).unwrap();
        }
    }
    let p = Pipeline::load(tmp.path(), LoadOptions::default(), &mut |_, _| {}).unwrap();
    let e = p.encode_chat_media(&messages(one), None, &ChatOptions::default(), &images_of(&d, one)).unwrap_err();
    assert!(e.to_string().contains("chat template"), "{e}");
}

/// A second turn about the same image in a Kimi K2.5 chat reuses the first turn's cache.
#[test]
fn k25_second_turn_about_the_same_image_reuses_the_cache() {
    second_turn_reuses_the_cache(&k25_dir());
}

#[test]
fn a_second_turn_about_the_same_image_reuses_the_cache() {
    second_turn_reuses_the_cache(&dir());
}

fn second_turn_reuses_the_cache(d: &Path) {
    let p = Pipeline::load(d, LoadOptions::default(), &mut |_, _| {}).unwrap();
    let case = &manifest_of(d)["cases"][0];
    let imgs = images_of(d, case);
    let mut msgs = messages(case);
    let (ids, media) = p.encode_chat_media(&msgs, None, &ChatOptions::default(), &imgs).unwrap();
    let mut pc = PromptCache::new();
    let first = p.generate_media(&mut pc, &ids, media.as_ref(), &greedy(6), |_| true).unwrap();
    msgs.push(ChatMessage::new("assistant", &first.text));
    msgs.push(ChatMessage::new("user", "And the colors?"));
    let (ids2, media2) = p.encode_chat_media(&msgs, None, &ChatOptions::default(), &imgs).unwrap();
    assert_eq!(ids2[..ids.len() - 1], ids[..ids.len() - 1], "the second turn extends the first prompt");
    let second = p.generate_media(&mut pc, &ids2, media2.as_ref(), &greedy(6), |_| true).unwrap();
    let cached = second.stats.prompt_tokens - second.stats.prefilled_tokens;
    assert!(cached >= ids.len() - 1, "only {cached} of the first turn's {} tokens were reused", ids.len());
    // And the reused state is the right one: a fresh cache gives the same reply.
    let fresh = p.generate_media(&mut PromptCache::new(), &ids2, media2.as_ref(), &greedy(6), |_| true).unwrap();
    assert_eq!(second.tokens, fresh.tokens);
}

#[test]
fn a_corrupt_image_is_an_error_naming_it() {
    let p = Pipeline::load(&dir(), LoadOptions::default(), &mut |_, _| {}).unwrap();
    let case = &manifest()["cases"][0];
    let mut imgs = images(case);
    imgs[0].bytes.truncate(40);
    imgs[0].name = "cut.png".into();
    let e = p.encode_chat_media(&messages(case), None, &ChatOptions::default(), &imgs).err().unwrap().to_string();
    assert!(e.contains("cut.png"), "{e}");
    // One image for a chat with two image parts.
    let two = &manifest()["cases"][1];
    let e =
        p.encode_chat_media(&messages(two), None, &ChatOptions::default(), &images(case)).err().unwrap().to_string();
    assert!(e.contains("2 image placeholders for 1 images"), "{e}");
}

#[test]
fn a_text_only_conversion_loads_without_a_tower_and_refuses_images() {
    // config.json keeps its vision_config, the weights lost the tower (what a text-only conversion writes):
    // the text model loads and generates; images get an error saying there is no tower.
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "preprocessor_config.json", "tiktoken.model", "tokenizer_config.json"] {
        std::fs::copy(dir().join(f), tmp.path().join(f)).unwrap();
    }
    let st = Safetensors::load(dir().join("model.safetensors")).unwrap();
    let text: Vec<(String, mlx_k3::Array)> = st
        .keys()
        .into_iter()
        .filter(|k| !k.starts_with("vision_tower.") && !k.starts_with("mm_projector."))
        .map(|k| {
            let a = st.get(&k).unwrap();
            (k, a)
        })
        .collect();
    assert!(text.len() < st.keys().len(), "the fixture has vision tensors to drop");
    let refs: Vec<(&str, &mlx_k3::Array)> = text.iter().map(|(k, a)| (k.as_str(), a)).collect();
    mlx_k3::io::save_safetensors(tmp.path().join("model.safetensors"), &refs, &[]).unwrap();
    let p = Pipeline::load(tmp.path(), LoadOptions::default(), &mut |_, _| {}).unwrap();
    assert!(p.vision.is_none());
    let case = &manifest()["cases"][0];
    let e = p.encode_chat_media(&messages(case), None, &ChatOptions::default(), &images(case)).err().unwrap();
    assert!(e.to_string().contains("no vision tower"), "{e}");
    let ids = p.encode_chat(&[ChatMessage::new("user", "hello")], None, &ChatOptions::default()).unwrap();
    let r = p.generate(&mut PromptCache::new(), &ids, &greedy(3), |_| true).unwrap();
    assert_eq!(r.stats.prompt_tokens, ids.len());
    assert!(r.tokens.len() == 3 || r.finish_reason == mlx_k3::generate::FinishReason::Stop, "{:?}", r.tokens);
}

#[test]
fn a_converted_checkpoint_keeps_the_image_settings() {
    // `convert` copies preprocessor_config.json: the converted checkpoint shrinks wide.png as the source does
    // (the fixture's in_patch_limit is 4; the default, 65536, would give it 2 x 8 patches and one more pad), so
    // the two-image prompt is still KimiK3Processor's, id for id.
    use mlx_k3::compress::convert::{convert, ConvertJob, Selection, CHUNK_PARAMS};
    use mlx_k3::compress::{Recipe, Silent};

    let tmp = tempfile::tempdir().unwrap();
    let recipe_path = tmp.path().join("recipe.toml");
    std::fs::write(&recipe_path, "dtype = \"float32\"\n").unwrap();
    let recipe = Recipe::load(&recipe_path).unwrap();
    let out = tmp.path().join("out");
    let job = ConvertJob {
        from: &dir(),
        to: &out,
        recipe: &recipe,
        calib: None,
        profile: None,
        selection: Selection::Budget,
        overwrite: false,
        progress: &Silent,
        chunk_params: CHUNK_PARAMS,
        tool: "convert",
    };
    convert(&job).unwrap();
    let name = "preprocessor_config.json";
    assert_eq!(std::fs::read(out.join(name)).unwrap(), std::fs::read(dir().join(name)).unwrap());

    let p = Pipeline::load(&out, LoadOptions::default(), &mut |_, _| {}).unwrap();
    let m = manifest();
    let (i, case) = (2, &m["cases"][2]); // two adjacent images, wide.png shrunk to 2 x 6 patches
    assert_eq!(case["grids"][1], serde_json::json!([1, 2, 6]));
    let (ids, _) = p.encode_chat_media(&messages(case), None, &ChatOptions::default(), &images(case)).unwrap();
    let want: Vec<u32> = expected(&format!("case{i}_ids")).iter().map(|&x| x as u32).collect();
    assert_eq!(ids, want, "case {i}: the converted checkpoint's prompt differs from KimiK3Processor's");
}
