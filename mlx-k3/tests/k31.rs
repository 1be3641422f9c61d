//! Kimi K3.1 (`kimi_k3` plus the DSA lightning indexer on every MLA layer, no rotation) against the reference
//! `scripts/make_k31_fixtures.py` assembles from mlx-lm 0.32.2's `kimi_k3` model and `deepseek_v32.Indexer`
//! (tests/fixtures/k31: KDA, MLA, MLA; index_topk 4 under a 12-token prompt, so prefill takes the top-k mask
//! and every decode step gathers the kept latents and reads the indexer-key cache, in both MLA layers).
//!
//! Tolerance: as for Kimi K3 and DeepSeek-V3.2 (tests/model.rs, tests/dsa.rs), f32 logits within 1e-4 x
//! max |reference|: both sides run MLX's CPU kernels on the same weights and differ only in op order, about
//! 1e-6 relative, printed below. Greedy tokens must be identical: the fixture's top-1 logit leads by >= 2e-3,
//! every router choice by >= 2e-4 and every indexer top-k boundary by >= 1e-4 of the row's largest score
//! (checked by the script), far above that noise, so both sides keep the same positions.

use std::path::{Path, PathBuf};

use mlx_k3::model::config::Family;
use mlx_k3::model::{KimiK3, ModelConfig};
use mlx_k3::{Array, Dtype};
use serde_json::Value;

mod logit_fixtures;
use logit_fixtures::{argmax, expected, ids, last_row, rel_err};

fn fixtures_dir() -> PathBuf {
    logit_fixtures::dir("k31")
}

fn manifest() -> Vec<Value> {
    logit_fixtures::manifest(&fixtures_dir())
}

const TOL: f32 = 1e-4;

fn load(dir: &Path) -> KimiK3 {
    logit_fixtures::load(dir, Dtype::F32)
}

#[test]
fn every_fixture_matches_the_reference() {
    for f in manifest() {
        let name = f["name"].as_str().unwrap();
        let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
        let exp = expected(&dir);
        let model = load(&dir);
        let t = exp.prompt.len() as i32;

        let logits = model.forward(&ids(&exp.prompt), None).unwrap();
        let e_prefill = rel_err(&logits.reshape(&[t, -1]).unwrap(), &exp.prefill);
        assert!(e_prefill <= TOL, "{name}: prefill logits rel err {e_prefill}");

        // Prefill with a cache, then greedy one-token steps: logits and tokens match the reference's.
        let mut cache = model.make_cache();
        let pre = model.forward(&ids(&exp.prompt), Some(&mut cache)).unwrap();
        let mut tok = argmax(&last_row(&pre));
        let mut worst_decode = 0.0f32;
        let fused_before = mlx_k3::kernels::fused_indexer_steps();
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
        // The decode steps ran the fused CPU indexer step (kernels::indexer_topk), one per MLA layer and token.
        let fused = mlx_k3::kernels::fused_indexer_steps() - fused_before;
        assert!(fused >= exp.decode_tokens.len() as u64, "{name}: {fused} fused indexer steps");

        let all: Vec<i32> = exp.prompt.iter().chain(&exp.decode_tokens).copied().collect();
        let full = model.forward(&ids(&all), None).unwrap();
        let e_full = rel_err(&full.reshape(&[all.len() as i32, -1]).unwrap(), &exp.full);
        assert!(e_full <= TOL, "{name}: full-sequence logits rel err {e_full}");

        // mlx-lm's generate_step on the reference model, greedy, 32 tokens from the prompt.
        let mut cache = model.make_cache();
        let mut out = model.forward(&ids(&exp.prompt), Some(&mut cache)).unwrap();
        let mut generated = Vec::new();
        for _ in 0..exp.generate().len() {
            let tok = argmax(&last_row(&out));
            generated.push(tok);
            out = model.forward(&ids(&[tok]), Some(&mut cache)).unwrap();
        }
        assert_eq!(generated, exp.generate(), "{name}: generated tokens differ from the reference's generate_step");
        println!("{name}: rel err prefill {e_prefill:.2e}, decode {worst_decode:.2e}, full {e_full:.2e}");
    }
}

#[test]
fn chunked_prefill_equals_one_shot() {
    // Chunks of 5, 1 and 7 tokens through one cache: the indexer-key cache and the causal mask across chunks.
    for f in manifest() {
        let name = f["name"].as_str().unwrap();
        let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
        let exp = expected(&dir);
        let model = load(&dir);
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
fn the_fixtures_exercise_the_sparse_path() {
    // A kimi_k3 config with the index fields gets a rotation-free indexer, selecting (more positions than
    // index_topk) in prefill and at every decode step.
    for f in &manifest() {
        let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
        let cfg = ModelConfig::load(&dir).unwrap();
        assert_eq!(cfg.text.family, Family::KimiK3);
        assert!(cfg.text.linear_attn_config.is_some(), "the fixture has KDA layers");
        let ix = cfg.text.indexer.as_ref().expect("a K3.1 config has an indexer");
        assert!(ix.rope.is_none(), "K3.1's indexer has no rotation");
        assert_eq!(ix.topk as i64, f["features"]["index_topk"].as_i64().unwrap());
        assert_eq!(ix.heads as i64, f["features"]["index_n_heads"].as_i64().unwrap());
        assert_eq!(ix.head_dim as i64, f["features"]["index_head_dim"].as_i64().unwrap());
        assert!(ix.topk < expected(&dir).prompt.len(), "{}: index_topk must be below the prompt length", f["name"]);
        assert!(f["features"]["mla_layers"].as_array().unwrap().len() >= 2);
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
    cfg["text_config"]["index_topk"] = serde_json::json!(1024);
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    for name in ["model.safetensors", "model.safetensors.index.json"] {
        std::fs::copy(dir.join(name), tmp.path().join(name)).unwrap();
    }
    let dense = load(tmp.path());
    let all: Vec<i32> = exp.prompt.iter().chain(&exp.decode_tokens).copied().collect();
    let got = dense.forward(&ids(&all), None).unwrap();
    let e = rel_err(&got.reshape(&[all.len() as i32, -1]).unwrap(), &exp.full);
    println!("dense control: rel err {e:.3e}");
    assert!(e > 100.0 * TOL, "dense attention should differ from the sparse reference (rel err {e})");
}

#[test]
fn bad_k31_configs_name_the_field() {
    let base = |extra: Value| {
        let mut c = serde_json::json!({
            "model_type": "kimi_k3", "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 1, "intermediate_size": 8, "q_lora_rank": 8, "kv_lora_rank": 8,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 2, "v_head_dim": 8,
            "linear_attn_config": {"num_heads": 1, "head_dim": 8, "short_conv_kernel_size": 4,
                                   "kda_layers": [1], "full_attn_layers": [2]},
            "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4
        });
        for (k, v) in extra.as_object().unwrap() {
            if v.is_null() {
                c.as_object_mut().unwrap().remove(k);
            } else {
                c[k] = v.clone();
            }
        }
        c.to_string()
    };
    let ok = ModelConfig::parse(&base(serde_json::json!({})), Path::new("c")).unwrap();
    let ix = ok.text.indexer.unwrap();
    assert_eq!((ix.heads, ix.head_dim, ix.topk, ix.rope), (2, 8, 4, None));
    let none = serde_json::json!({"index_n_heads": null, "index_head_dim": null, "index_topk": null});
    assert!(ModelConfig::parse(&base(none), Path::new("c")).unwrap().text.indexer.is_none(), "plain K3: dense");
    let cases = [
        (serde_json::json!({"index_topk": null}), "index_topk"),
        (serde_json::json!({"index_n_heads": 0}), "index_n_heads"),
        (serde_json::json!({"index_head_dim": "wide"}), "index_head_dim"),
        (serde_json::json!({"q_lora_rank": null}), "q_lora_rank"),
    ];
    for (extra, field) in cases {
        let e = ModelConfig::parse(&base(extra), Path::new("x/config.json")).unwrap_err().to_string();
        assert!(e.contains(field) && e.contains("x/config.json"), "{field}: {e}");
    }
}
