//! DeepSeek-V3.2 (`deepseek_v32`: MLA with the DSA lightning indexer) against mlx-lm 0.32.2's
//! `deepseek_v32.py` on the fixtures `scripts/make_deepseek_v32_fixtures.py` made (tests/fixtures/deepseek_v32:
//! index_topk 4 and 6 under a 12-token prompt, so prefill takes the top-k mask and every decode step gathers
//! the kept latents and reads the indexer-key cache; YaRN and plain RoPE, interleaved and split indexer
//! rotation, and an mlx-lm 4-bit quantization that covers the indexer's linears).
//!
//! Tolerance: as for Kimi K3 and DeepSeek-V3 (tests/model.rs, tests/deepseek_v3.rs), f32 logits within
//! 1e-4 x max |reference|: both sides run MLX's CPU kernels on the same weights and differ only in op order,
//! about 1e-6 relative, printed below. Greedy tokens must be identical: every fixture's top-1 logit leads by
//! >= 2e-3, every router choice by >= 2e-4 and every indexer top-k boundary by >= 1e-4 of the row's largest
//! score (checked by the script), far above that noise, so the same positions are kept on both sides.

use std::path::{Path, PathBuf};

use mlx_k3::io::Safetensors;
use mlx_k3::model::config::Family;
use mlx_k3::model::ModelConfig;
use mlx_k3::{Array, Dtype};
use serde_json::Value;

mod logit_fixtures;
use logit_fixtures::{argmax, expected, ids, last_row, load, rel_err};

fn fixtures_dir() -> PathBuf {
    logit_fixtures::dir("deepseek_v32")
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
        let t = exp.prompt.len() as i32;

        let logits = model.forward(&ids(&exp.prompt), None).unwrap();
        let e_prefill = rel_err(&logits.reshape(&[t, -1]).unwrap(), &exp.prefill);
        assert!(e_prefill <= TOL, "{name}: prefill logits rel err {e_prefill}");

        // Prefill with a cache, then greedy one-token steps: logits and tokens match mlx-lm's.
        let mut cache = model.make_cache();
        let pre = model.forward(&ids(&exp.prompt), Some(&mut cache)).unwrap();
        let mut tok = argmax(&last_row(&pre));
        let mut worst_decode = 0.0f32;
        for step in 0..exp.decode_tokens.len() {
            assert_eq!(tok, exp.decode_tokens[step], "{name}: greedy token {step} differs");
            let out = model.forward(&ids(&[tok]), Some(&mut cache)).unwrap();
            let want = exp.decode.slice_axis(0, step as i32, step as i32 + 1).unwrap();
            let e = rel_err(&out.reshape(&[1, -1]).unwrap(), &want);
            worst_decode = worst_decode.max(e);
            assert!(e <= TOL, "{name}: decode step {step} logits rel err {e}");
            tok = argmax(&out.to_vec_f32().unwrap());
        }
        let next = f["checks"]["next_token_after_decode"].as_i64().unwrap() as i32;
        assert_eq!(tok, next, "{name}: the token after the last decode step differs");

        let all: Vec<i32> = exp.prompt.iter().chain(&exp.decode_tokens).copied().collect();
        let full = model.forward(&ids(&all), None).unwrap();
        let e_full = rel_err(&full.reshape(&[all.len() as i32, -1]).unwrap(), &exp.full);
        assert!(e_full <= TOL, "{name}: full-sequence logits rel err {e_full}");

        // mlx-lm's generate_step, greedy, 32 tokens from the prompt.
        let mut cache = model.make_cache();
        let mut out = model.forward(&ids(&exp.prompt), Some(&mut cache)).unwrap();
        let mut generated = Vec::new();
        for _ in 0..exp.generate().len() {
            let tok = argmax(&last_row(&out));
            generated.push(tok);
            out = model.forward(&ids(&[tok]), Some(&mut cache)).unwrap();
        }
        assert_eq!(generated, exp.generate(), "{name}: generated tokens differ from mlx-lm's generate_step");
        println!("{name}: rel err prefill {e_prefill:.2e}, decode {worst_decode:.2e}, full {e_full:.2e}");
    }
}

#[test]
fn chunked_prefill_equals_one_shot() {
    // Chunks of 5, 1 and 7 tokens through one cache: RoPE offsets and the causal mask across chunks.
    for f in manifest().iter().filter(|f| f["quantized"] == false) {
        let name = f["name"].as_str().unwrap();
        let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
        let exp = expected(&dir);
        let model = load(&dir, Dtype::F32);
        let all: Vec<i32> = exp.prompt.iter().chain(&exp.decode_tokens).copied().collect();
        let one_shot = model.forward(&ids(&all), None).unwrap();
        let mut cache = model.make_cache();
        let mut outs = Vec::new();
        let mut start = 0;
        for len in [5usize, 1, 7].iter().cycle() {
            if start >= all.len() {
                break;
            }
            let end = (start + len).min(all.len());
            outs.push(model.forward(&ids(&all[start..end]), Some(&mut cache)).unwrap());
            start = end;
        }
        let refs: Vec<&Array> = outs.iter().collect();
        let chunked = mlx_k3::ops::concatenate(&refs, 1).unwrap();
        let e = rel_err(&chunked, &one_shot);
        assert!(e <= TOL, "{name}: chunked prefill rel err {e}");
    }
}

#[test]
fn bf16_activations_match_mlx_lm_in_bf16() {
    // As tests/model.rs: mlx-lm cast to bf16 (quantized fixtures only, MLX's CPU gather_mm is f32-only);
    // same kernels on both sides, within 2e-2 relative (~2.5 bf16 ulp of the largest logit).
    let mut checked = 0;
    for f in manifest() {
        let name = f["name"].as_str().unwrap();
        let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
        let st = Safetensors::load(dir.join("expected.safetensors")).unwrap();
        let Ok(reference) = st.get("prefill_logits_bf16") else { continue };
        let exp = expected(&dir);
        let t = exp.prompt.len() as i32;
        let model = load(&dir, Dtype::BF16);
        let logits = model.forward(&ids(&exp.prompt), None).unwrap();
        assert_eq!(logits.dtype(), Dtype::BF16);
        let e = rel_err(&logits.reshape(&[t, -1]).unwrap(), &reference);
        println!("{name}: bf16 vs mlx-lm bf16 rel err {e:.3e}");
        assert!(e <= 2e-2, "{name}: bf16 rel err {e}");
        checked += 1;
    }
    assert_eq!(checked, 1, "expected a bf16 reference in the quantized fixture");
}

#[test]
fn the_fixtures_exercise_the_sparse_path() {
    // The indexer selects (more positions than index_topk) in prefill and at every decode step.
    let m = manifest();
    assert!(m.iter().any(|f| f["quantized"] == true));
    assert!(m.iter().any(|f| f["features"]["indexer_rope_interleave"] == true));
    assert!(m.iter().any(|f| f["features"]["rope"] == "yarn"));
    for f in &m {
        let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
        let cfg = ModelConfig::load(&dir).unwrap();
        assert_eq!(cfg.text.family, Family::DeepseekV3);
        let ix = cfg.text.indexer.as_ref().expect("deepseek_v32 has an indexer");
        assert_eq!(ix.topk as i64, f["features"]["index_topk"].as_i64().unwrap());
        assert!(ix.topk < expected(&dir).prompt.len(), "{}: index_topk must be below the prompt length", f["name"]);
        assert!(f["checks"]["sparse_indexer_calls"].as_i64() > Some(0));
    }
}

#[test]
fn the_indexer_changes_the_output() {
    // A check that could not fail would pass with the indexer ignored: with index_topk raised past the
    // sequence (dense attention), the logits move far beyond the tolerance.
    let f = &manifest()[0];
    let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
    let exp = expected(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["index_topk"] = serde_json::json!(1024);
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    for name in ["model.safetensors", "model.safetensors.index.json"] {
        std::fs::copy(dir.join(name), tmp.path().join(name)).unwrap();
    }
    let dense = load(tmp.path(), Dtype::F32);
    let all: Vec<i32> = exp.prompt.iter().chain(&exp.decode_tokens).copied().collect();
    let got = dense.forward(&ids(&all), None).unwrap();
    let e = rel_err(&got.reshape(&[all.len() as i32, -1]).unwrap(), &exp.full);
    assert!(e > 100.0 * TOL, "dense attention should differ from the sparse reference (rel err {e})");
}

#[test]
fn bad_deepseek_v32_configs_name_the_field() {
    let cases: [(Value, &str); 3] = [
        (serde_json::json!({"model_type": "deepseek_v32", "q_lora_rank": null}), "q_lora_rank"),
        (serde_json::json!({"model_type": "deepseek_v32", "index_topk": 0}), "index_topk"),
        (serde_json::json!({"model_type": "deepseek_v32", "index_head_dim": 32}), "index_head_dim"),
    ];
    for (cfg, field) in cases {
        let e = ModelConfig::parse(&cfg.to_string(), Path::new("x/config.json")).unwrap_err().to_string();
        assert!(e.contains(field) && e.contains("x/config.json"), "{field}: {e}");
    }
    let c = ModelConfig::parse(r#"{"model_type": "deepseek_v32"}"#, Path::new("c")).unwrap();
    let ix = c.text.indexer.unwrap();
    assert_eq!((ix.heads, ix.head_dim, ix.topk), (64, 128, 2048), "mlx-lm's defaults");
    assert!(ModelConfig::parse(r#"{"model_type": "deepseek_v3"}"#, Path::new("c")).unwrap().text.indexer.is_none());
}

#[test]
fn trimming_the_cache_rewinds_the_indexer_keys() {
    // The indexer keys share the latents' offset: after trimming three decoded positions, decoding the same
    // tokens again must give the same logits (stale or misplaced indexer keys would change the selection).
    // Same graph and inputs on both runs, so equal up to MLX's evaluation being deterministic: 1e-6 relative.
    let f = &manifest()[0];
    let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
    let exp = expected(&dir);
    let model = load(&dir, Dtype::F32);
    let mut cache = model.make_cache();
    model.forward(&ids(&exp.prompt), Some(&mut cache)).unwrap();
    let steps = &exp.decode_tokens[..3];
    let first: Vec<Array> = steps.iter().map(|&t| model.forward(&ids(&[t]), Some(&mut cache)).unwrap()).collect();
    assert!(cache.nbytes() > 0);
    assert_eq!(cache.trim(3).unwrap(), 3);
    for (i, &t) in steps.iter().enumerate() {
        let again = model.forward(&ids(&[t]), Some(&mut cache)).unwrap();
        let e = rel_err(&again, &first[i]);
        assert!(e <= 1e-6, "step {i} after trim: rel err {e}");
    }
}
