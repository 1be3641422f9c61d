//! The Kimi K3 graph against mlx-lm's `kimi_k3.py` on the fixtures `scripts/make_k3_fixtures.py` made
//! (tests/fixtures/k3: tiny configurations covering every feature, two quantized by mlx-lm itself, one
//! with the original release names).
//!
//! Tolerance: f32 logits within 1e-4 x max |reference| (the bound). Both sides run the same MLX
//! CPU kernels on the same weights; differences come from op order (mlx-lm compiles and fuses some
//! elementwise chains, the KDA recurrence reassociates nothing) and stay around 1e-6 relative, measured
//! below and printed. Greedy tokens must be identical: the fixtures were chosen so that every top-1 logit
//! leads by >= 2e-3 and every router choice by >= 2e-4, far above that noise.

use std::path::PathBuf;

use mlx_k3::io::Safetensors;
use mlx_k3::Dtype;
use serde_json::Value;

mod logit_fixtures;
use logit_fixtures::{
    check_full_sequence, check_prefill_and_decode, chunked_prefill_rel_err, expected, ids, load, rel_err,
};

fn fixtures_dir() -> PathBuf {
    logit_fixtures::dir("k3")
}

fn manifest() -> Vec<Value> {
    logit_fixtures::manifest(&fixtures_dir())
}

const TOL: f32 = 1e-4;

#[test]
fn every_fixture_matches_mlx_lm() {
    for f in manifest() {
        let name = f["name"].as_str().unwrap();
        let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
        let exp = expected(&dir);
        let model = load(&dir, Dtype::F32);
        // One forward over the prompt, no cache; then a cached prefill and 16 greedy steps, each step's logits
        // and the greedy token matching.
        let (e_prefill, worst_decode, tok, cache) = check_prefill_and_decode(name, &model, &exp, TOL);
        let next = f["checks"]["next_token_after_decode"].as_i64().unwrap() as i32;
        assert_eq!(tok, next, "{name}: the token after the last decode step differs");
        assert_eq!(cache.offset(), exp.prompt.len() + exp.decode_tokens.len());

        // One forward over prompt + generated tokens (no cache) equals the incremental logits.
        let e_full = check_full_sequence(name, &model, &exp, TOL);
        println!("{name}: rel err prefill {e_prefill:.2e}, decode {worst_decode:.2e}, full {e_full:.2e}");
    }
}

#[test]
fn chunked_prefill_equals_one_shot() {
    for f in manifest().iter().filter(|f| f["names"] == "mlx").take(4) {
        let name = f["name"].as_str().unwrap();
        let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
        let exp = expected(&dir);
        let model = load(&dir, Dtype::F32);
        // Chunks of 5, 1 and 7 tokens through one cache (crosses KDA conv windows and MLA offsets).
        let e = chunked_prefill_rel_err(&model, &exp);
        assert!(e <= TOL, "{name}: chunked prefill rel err {e}");
    }
}

#[test]
fn release_names_load_to_identical_logits() {
    let m = manifest();
    let rel = m.iter().find(|f| f["names"] == "release").expect("a release-named fixture");
    let base = rel["derived_from"].as_str().unwrap();
    let a = load(&fixtures_dir().join(rel["dir"].as_str().unwrap()), Dtype::F32);
    let b = load(&fixtures_dir().join(base), Dtype::F32);
    let exp = expected(&fixtures_dir().join(base));
    let la = a.forward(&ids(&exp.prompt), None).unwrap().to_vec::<f32>().unwrap();
    let lb = b.forward(&ids(&exp.prompt), None).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(la, lb, "release-named and sanitized checkpoints must give identical logits");
}

#[test]
fn bf16_activations_match_mlx_lm_in_bf16() {
    // mlx-lm cast to bf16 (quantized fixtures only: MLX's CPU gather_mm is f32-only, so mlx-lm cannot run
    // the float fixtures' dense expert stacks in bf16 on a CPU). Same kernels on both sides, so bf16 results
    // should agree to a few bf16 ulps of the largest logit; tolerance 2e-2 relative (~2.5 ulp at 2^-7).
    // bf16 against the f32 reference is printed for information: on these tiny random models it is ~0.2-0.3
    // for mlx-lm itself, because bf16 rounding flips expert choices.
    let mut checked = 0;
    for f in manifest() {
        let name = f["name"].as_str().unwrap();
        let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
        let st = Safetensors::load(dir.join("expected.safetensors")).unwrap();
        let exp = expected(&dir);
        let t = exp.prompt.len() as i32;
        let model = load(&dir, Dtype::BF16);
        let logits = model.forward(&ids(&exp.prompt), None).unwrap();
        assert_eq!(logits.dtype(), Dtype::BF16);
        let logits = logits.reshape(&[t, -1]).unwrap();
        let vs_f32 = rel_err(&logits, &exp.prefill);
        match st.get("prefill_logits_bf16") {
            Ok(reference) => {
                let e = rel_err(&logits, &reference);
                println!("{name}: bf16 vs mlx-lm bf16 rel err {e:.3e} (bf16 vs f32 reference {vs_f32:.3e})");
                assert!(e <= 2e-2, "{name}: bf16 rel err {e}");
                checked += 1;
            }
            Err(_) => println!("{name}: bf16 vs f32 reference {vs_f32:.3e} (no bf16 reference)"),
        }
    }
    assert!(checked >= 2, "expected bf16 references in the quantized fixtures");
}

#[test]
fn embeddings_and_tapped_forwards_equal_the_token_forward() {
    // The multimodal entry (embeddings in) and the drafter's entry (hidden states out) run the same
    // layers as `forward`: identical logits, and each tap equals the layer-by-layer chain's state.
    let f = manifest().into_iter().find(|f| f["names"] == "mlx").expect("an mlx-named fixture");
    let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
    let exp = expected(&dir);
    let model = load(&dir, Dtype::F32);
    let prompt = ids(&exp.prompt);
    let base = model.forward(&prompt, None).unwrap().to_vec::<f32>().unwrap();
    let h = model.embed_tokens(&prompt).unwrap();
    let via_embeddings = model.forward_embeddings(&h, None).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(base, via_embeddings);
    let n = model.config().num_hidden_layers;
    let taps = [n - 1, 0, n / 2];
    let (logits, tapped) = model.forward_with_taps(&prompt, None, &taps).unwrap();
    assert_eq!(base, logits.to_vec::<f32>().unwrap());
    let mut state = model.embed_state(&prompt).unwrap();
    let mut chain = Vec::new();
    for i in 0..n {
        state = model.layer_forward(i, None, &state).unwrap();
        chain.push(state.h.to_vec::<f32>().unwrap());
    }
    for (t, got) in taps.iter().zip(&tapped) {
        assert_eq!(got.to_vec::<f32>().unwrap(), chain[*t], "tap {t}");
    }
    assert!(model.forward_with_taps(&prompt, None, &[n]).is_err(), "a tap past the last layer is refused");
    let wrong = mlx_k3::ops::zeros(&[1, 3, 7], Dtype::F32).unwrap();
    assert!(model.forward_embeddings(&wrong, None).is_err(), "embeddings of the wrong width are refused");
}
