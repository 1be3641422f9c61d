//! Prompts with media (images) in generation: the placeholder tokens take the rows of the media features
//! in every prefill chunking, and the prompt cache resumes only where the media it holds are the prompt's
//! own (equal placeholder tokens of another image are another prompt).
//!
//! The features here are random rows standing in for a vision tower's output: what is checked is how
//! generation feeds them to the text model, against the model's own one-shot forward over the merged
//! embeddings. Prefill runs with one-token chunks where outputs are compared across caches, so a resumed
//! run performs exactly the operations of a fresh one and the tokens must be identical.

use std::path::{Path, PathBuf};

use mlx_k3::generate::{generate_tokens, generate_tokens_media, GenerateOptions, MediaItem, PromptCache, PromptMedia};
use mlx_k3::model::{vision::merge_features, KimiK3, LoadOptions};
use mlx_k3::{random, Array, Dtype};

fn nano() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano")
}

/// The placeholder id used here (any id works for the text model: its embedding row is replaced).
const PAD: u32 = 7;

fn features(model: &KimiK3, n: i32, seed: u64) -> Array {
    let d = model.config().hidden_size as i32;
    // Standard-normal rows: any rows unlike the placeholder's embedding change what follows them.
    let key = random::key(seed).unwrap();
    random::normal(&[n, d], Dtype::F32, 0.0, 1.0, Some(&key)).unwrap()
}

fn media(model: &KimiK3, n: i32, seed: u64) -> PromptMedia {
    let items = vec![MediaItem { key: seed, tokens: n as usize }];
    PromptMedia { features: features(model, n, seed), placeholders: vec![PAD], items }
}

/// A prompt of text, `n` placeholders, then text.
fn prompt(n: usize) -> Vec<u32> {
    let mut p = vec![1, 120, 240, 360];
    p.extend(std::iter::repeat_n(PAD, n));
    p.extend([480, 600, 720, 840, 960]);
    p
}

fn greedy(max_tokens: usize, chunk: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, prefill_chunk: chunk, ..Default::default() }
}

fn run(model: &KimiK3, pc: &mut PromptCache, p: &[u32], m: &PromptMedia, n: usize, chunk: usize) -> (Vec<u32>, usize) {
    let (out, _, stats) = generate_tokens_media(model, pc, p, Some(m), &greedy(n, chunk), |_| true).unwrap();
    (out, stats.prompt_tokens - stats.prefilled_tokens)
}

#[test]
fn placeholder_rows_are_the_features_in_every_chunking() {
    let model = KimiK3::load(&nano(), LoadOptions::default()).unwrap();
    let p = prompt(6);
    let m = media(&model, 6, 11);
    // The reference: one forward over the merged embeddings, no cache; its last row's argmax is the first
    // generated token.
    let ids: Vec<i32> = p.iter().map(|&t| t as i32).collect();
    let h = model.embed_tokens(&Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap()).unwrap();
    let merged = merge_features(&h, &ids, &[PAD as i32], &m.features).unwrap();
    let logits = model.forward_embeddings(&merged, None).unwrap();
    let last = logits.slice_axis(1, ids.len() as i32 - 1, ids.len() as i32).unwrap();
    let want_first = last.argmax(-1, false).unwrap().item::<u32>().unwrap();

    let mut outs = Vec::new();
    for chunk in [1, 3, 512] {
        let (out, cached) = run(&model, &mut PromptCache::new(), &p, &m, 12, chunk);
        assert_eq!(cached, 0);
        assert_eq!(out[0], want_first, "chunk {chunk}: first token");
        outs.push(out);
    }
    assert!(outs.windows(2).all(|w| w[0] == w[1]), "prefill chunking changed the tokens: {outs:?}");

    // The features matter: the same prompt as plain text (placeholder embeddings) gives other logits.
    let plain = model.forward(&Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap(), None).unwrap();
    let diff = plain.subtract(&logits).unwrap().abs().unwrap().max_all(false).unwrap().item::<f32>().unwrap();
    assert!(diff > 1e-2, "the media rows did not change the logits ({diff})");
}

#[test]
fn the_cache_resumes_only_over_the_same_media() {
    let model = KimiK3::load(&nano(), LoadOptions::default()).unwrap();
    let p1 = prompt(5);
    let a = media(&model, 5, 21);
    let mut pc = PromptCache::new();
    let (out1, _) = run(&model, &mut pc, &p1, &a, 6, 1);

    // Second turn about the same image: everything held is reused.
    let mut p2 = p1.clone();
    p2.extend(&out1[..5]);
    p2.extend([100, 200, 300]);
    let (out2, cached) = run(&model, &mut pc, &p2, &a, 6, 1);
    assert_eq!(cached, p1.len() + 5, "the second turn should resume after the first turn's tokens");
    let (fresh2, _) = run(&model, &mut PromptCache::new(), &p2, &a, 6, 1);
    assert_eq!(out2, fresh2);

    // The same tokens with another image: the cache may only keep the text before the image.
    let b = media(&model, 5, 22);
    let (out3, cached) = run(&model, &mut pc, &p2, &b, 6, 1);
    assert!(cached <= 4, "resumed past the image start with other media ({cached} tokens)");
    let (fresh3, _) = run(&model, &mut PromptCache::new(), &p2, &b, 6, 1);
    assert_eq!(out3, fresh3);

    // And the same tokens as plain text after that: not the image's state either.
    let (out4, _, stats) = generate_tokens(&model, &mut pc, &p2, &greedy(6, 1), |_| true).unwrap();
    assert!(stats.prompt_tokens - stats.prefilled_tokens <= 4);
    let (fresh4, _, _) = generate_tokens(&model, &mut PromptCache::new(), &p2, &greedy(6, 1), |_| true).unwrap();
    assert_eq!(out4, fresh4);
}

#[test]
fn mismatched_media_are_errors() {
    let model = KimiK3::load(&nano(), LoadOptions::default()).unwrap();
    let p = prompt(4);
    let too_few = media(&model, 3, 1);
    let e = generate_tokens_media(&model, &mut PromptCache::new(), &p, Some(&too_few), &greedy(2, 8), |_| true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("4 media placeholder tokens for 1 media of 3 tokens"), "{e}");
    let items = vec![MediaItem { key: 1, tokens: 2 }, MediaItem { key: 2, tokens: 3 }];
    let wrong_counts = PromptMedia { items, ..media(&model, 4, 1) };
    let e = generate_tokens_media(&model, &mut PromptCache::new(), &p, Some(&wrong_counts), &greedy(2, 8), |_| true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("4 media placeholder tokens for 2 media of 5 tokens"), "{e}");
    let ends_in_image = p[..8].to_vec(); // text, then the four placeholders
    let m = media(&model, 4, 1);
    let e = generate_tokens_media(&model, &mut PromptCache::new(), &ends_in_image, Some(&m), &greedy(2, 8), |_| true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("ends inside a medium"), "{e}");
}

#[test]
fn adjacent_images_are_keyed_apart() {
    // Two images whose placeholder runs touch: the token counts, not the runs, say where each one ends, so
    // a prompt whose second image changed resumes no further than the start of that image (k3-nano's KDA
    // state cannot be rewound, so here it resumes from the nearest snapshot at or before that point).
    let model = KimiK3::load(&nano(), LoadOptions::default()).unwrap();
    let p = prompt(8);
    let two = |k1: u64, k2: u64| {
        let a = features(&model, 4, k1);
        let b = features(&model, 4, k2);
        let features = mlx_k3::ops::concatenate(&[&a, &b], 0).unwrap();
        let items = vec![MediaItem { key: k1, tokens: 4 }, MediaItem { key: k2, tokens: 4 }];
        PromptMedia { features, placeholders: vec![PAD], items }
    };
    let mut pc = PromptCache::new();
    run(&model, &mut pc, &p, &two(31, 32), 4, 1);
    let (out, cached) = run(&model, &mut pc, &p, &two(31, 33), 4, 1);
    assert!(cached <= 4 + 4, "resumed past the changed second image ({cached} tokens)");
    let (fresh, _) = run(&model, &mut PromptCache::new(), &p, &two(31, 33), 4, 1);
    assert_eq!(out, fresh);
}
