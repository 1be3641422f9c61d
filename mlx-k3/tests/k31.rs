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
use mlx_k3::Dtype;
use serde_json::Value;

mod logit_fixtures;
use logit_fixtures::{
    check_full_sequence, check_generate, check_prefill_and_decode, chunked_prefill_rel_err, expected, ids, rel_err,
};

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
        // Prefill, then greedy one-token steps through a cache: logits and tokens match the reference's.
        let fused_before = mlx_k3::kernels::fused_indexer_steps();
        let (e_prefill, worst_decode, tok, _) = check_prefill_and_decode(name, &model, &exp, TOL);
        let next = f["checks"]["next_token_after_decode"].as_i64().unwrap() as i32;
        assert_eq!(tok, next, "{name}: the token after the last decode step differs");
        // The decode steps ran the fused CPU indexer step (kernels::indexer_topk), one per MLA layer and token.
        let fused = mlx_k3::kernels::fused_indexer_steps() - fused_before;
        assert!(fused >= exp.decode_tokens.len() as u64, "{name}: {fused} fused indexer steps");

        let e_full = check_full_sequence(name, &model, &exp, TOL);
        // mlx-lm's generate_step on the reference model, greedy, 32 tokens from the prompt.
        check_generate(name, &model, &exp);
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
        let e = chunked_prefill_rel_err(&model, &exp);
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
