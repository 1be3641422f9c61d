//! The DeepSeek-V3 family (deepseek_v3, kimi_k25) against mlx-lm 0.32.2's `deepseek_v3.py` / `kimi_k25.py`
//! on the fixtures `scripts/make_deepseek_v3_fixtures.py` made (tests/fixtures/deepseek_v3: YaRN and plain
//! RoPE, q_lora_rank set and null, grouped and ungrouped routing, shared experts, dense first layers,
//! moe_layer_freq 2, a nested kimi_k25 config, and three mlx-lm quantizations: affine 4/8-bit, mixed
//! per-layer bits, MXFP4 experts).
//!
//! Tolerance: as for Kimi K3 (tests/model.rs), f32 logits within 1e-4 x max |reference|: both sides run
//! MLX's CPU kernels on the same weights and differ only in op order (mlx-lm compiles SwiGLU and the router),
//! about 1e-6 relative, printed below. Greedy tokens must be identical: every fixture's top-1 logit leads
//! by >= 2e-3 and every router choice by >= 2e-4 (checked by the script), far above that noise.

use std::path::{Path, PathBuf};

use mlx_k3::io::Safetensors;
use mlx_k3::model::config::Family;
use mlx_k3::model::{KimiK3, LoadOptions, ModelConfig};
use mlx_k3::{Array, Dtype};
use serde_json::Value;

mod logit_fixtures;
use logit_fixtures::{
    argmax, check_full_sequence, check_generate, check_prefill_and_decode, chunked_prefill_rel_err, expected, ids,
    last_row, load, rel_err,
};

fn fixtures_dir() -> PathBuf {
    logit_fixtures::dir("deepseek_v3")
}

fn manifest() -> Vec<Value> {
    logit_fixtures::manifest(&fixtures_dir())
}

const TOL: f32 = 1e-4;

#[test]
fn the_fixtures_cover_every_variant() {
    let m = manifest();
    let has = |pred: &dyn Fn(&Value) -> bool| m.iter().any(pred);
    assert!(has(&|f| f["features"]["model_type"] == "kimi_k25"));
    assert!(has(&|f| f["features"]["q_lora_rank"].is_null()));
    assert!(has(&|f| f["features"]["rope"] == "yarn"));
    assert!(has(&|f| f["features"]["n_group"].as_i64() > Some(1)));
    assert!(has(&|f| f["features"]["moe_layer_freq"].as_i64() > Some(1)));
    assert!(has(&|f| f["name"].as_str().unwrap().ends_with("_mxfp4")));
    assert!(has(&|f| f["name"].as_str().unwrap().ends_with("_mixed")));
    for f in &m {
        let cfg = ModelConfig::load(&fixtures_dir().join(f["dir"].as_str().unwrap())).unwrap();
        assert_eq!(cfg.text.family, Family::DeepseekV3);
    }
}

#[test]
fn every_fixture_matches_mlx_lm() {
    for f in manifest() {
        let name = f["name"].as_str().unwrap();
        let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
        let exp = expected(&dir);
        let model = load(&dir, Dtype::F32);
        // Prefill, then greedy one-token steps through a cache: logits and tokens match mlx-lm's.
        let (e_prefill, worst_decode, tok, _) = check_prefill_and_decode(name, &model, &exp, TOL);
        let next = f["checks"]["next_token_after_decode"].as_i64().unwrap() as i32;
        assert_eq!(tok, next, "{name}: the token after the last decode step differs");

        let e_full = check_full_sequence(name, &model, &exp, TOL);
        // mlx-lm's generate_step, greedy, 32 tokens from the prompt.
        check_generate(name, &model, &exp);
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
        let e = chunked_prefill_rel_err(&model, &exp);
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
    assert_eq!(checked, 3, "expected bf16 references in the three quantized fixtures");
}

#[test]
fn bad_deepseek_v3_configs_name_the_field() {
    let cases: [(&str, Value, &str); 6] = [
        ("topk_method", serde_json::json!({"model_type": "deepseek_v3", "topk_method": "greedy"}), "topk_method"),
        (
            "rope type",
            serde_json::json!({"model_type": "deepseek_v3", "rope_scaling": {"type": "longrope", "factor": 2}}),
            "rope_scaling.type",
        ),
        (
            "yarn factor",
            serde_json::json!({"model_type": "deepseek_v3", "rope_scaling": {"type": "yarn"}}),
            "rope_scaling.factor",
        ),
        ("kimi_k25 without text_config", serde_json::json!({"model_type": "kimi_k25"}), "text_config"),
        (
            "nested field type",
            serde_json::json!({"model_type": "kimi_k25", "text_config": {"kv_lora_rank": "big"}}),
            "text_config.kv_lora_rank",
        ),
        (
            "groups",
            serde_json::json!({"model_type": "deepseek_v3", "n_routed_experts": 8, "n_group": 3, "topk_group": 1}),
            "num_expert_group",
        ),
    ];
    for (what, cfg, field) in cases {
        let e = ModelConfig::parse(&cfg.to_string(), Path::new("x/config.json")).unwrap_err().to_string();
        assert!(e.contains(field) && e.contains("x/config.json"), "{what}: {e}");
    }
    let e = ModelConfig::parse(r#"{"model_type": "llama"}"#, Path::new("c.json")).unwrap_err().to_string();
    assert!(e.contains("deepseek_v3") && e.contains("llama"), "{e}");
}

#[test]
fn kimi_k2_config_parses_with_mlx_lm_defaults() {
    // Kimi K2's published text config (abridged): q_lora_rank 1536, YaRN factor 32, 384 experts, no groups.
    let cfg = serde_json::json!({
        "model_type": "deepseek_v3", "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
        "n_shared_experts": 1, "n_routed_experts": 384, "routed_scaling_factor": 2.827, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "rope_theta": 50000.0, "hidden_act": "silu",
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
        "num_nextn_predict_layers": 0
    });
    let c = ModelConfig::parse(&cfg.to_string(), Path::new("config.json")).unwrap();
    let t = &c.text;
    assert_eq!(t.family, Family::DeepseekV3);
    assert_eq!((t.num_experts, t.num_experts_per_token, t.num_shared_experts), (Some(384), 8, 1));
    assert!(!t.is_moe(0) && t.is_moe(1) && t.is_moe(60));
    assert!((0..61).all(|i| !t.is_kda(i)));
    assert_eq!(t.mla().unwrap().q_lora_rank, Some(1536));
    // Absent: mlx-lm's defaults (q_lora_rank 1536, rms_norm_eps 1e-6); null q_lora_rank: a direct q_proj.
    let c = ModelConfig::parse(r#"{"model_type": "deepseek_v3", "q_lora_rank": null}"#, Path::new("c")).unwrap();
    assert_eq!(c.text.q_lora_rank, None);
    assert_eq!(c.text.rms_norm_eps, 1e-6);
    let c = ModelConfig::parse(r#"{"model_type": "deepseek_v3"}"#, Path::new("c")).unwrap();
    assert_eq!(c.text.q_lora_rank, Some(1536));
}

#[test]
fn hugging_face_names_and_mtp_layer_load_to_identical_logits() {
    // c_kimi_k25_hf: per-expert tensors, kv_b_proj, a vision-tower tensor and an MTP layer
    // (model.layers.{num_hidden_layers}.*), which the loader drops as mlx-lm's sanitize does.
    let m = manifest();
    let hf = m.iter().find(|f| f["names"] == "hf").expect("a Hugging Face-named fixture");
    let hf_dir = fixtures_dir().join(hf["dir"].as_str().unwrap());
    let base_dir = fixtures_dir().join(hf["derived_from"].as_str().unwrap());
    let cfg = ModelConfig::load(&hf_dir).unwrap();
    let n = cfg.text.num_hidden_layers;
    let keys = Safetensors::load(hf_dir.join("model.safetensors")).unwrap().keys();
    let has = |needle: &str| keys.iter().any(|k| k.contains(needle));
    assert!(has(&format!("model.layers.{n}.eh_proj")) && has(".experts.0.gate_proj") && has("kv_b_proj"));
    assert!(has("vision_tower."));
    let a = load(&hf_dir, Dtype::F32);
    let b = load(&base_dir, Dtype::F32);
    let exp = expected(&base_dir);
    let la = a.forward(&ids(&exp.prompt), None).unwrap().to_vec::<f32>().unwrap();
    let lb = b.forward(&ids(&exp.prompt), None).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(la, lb, "Hugging Face-named and mlx-lm-saved checkpoints must give identical logits");
    assert!(a.tensor_records().iter().all(|r| !r.path.contains(&format!("layers.{n}."))));
}

#[test]
fn fp8_block_scales_are_refused_with_a_hint() {
    // DeepSeek's original fp8 release stores `weight_scale_inv` beside each weight (mlx-lm dequantizes it in
    // sanitize); mlx-k3 does not read it and must say what to do instead of loading a wrong model.
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures_dir().join("b_direct_q_plain_rope");
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).unwrap();
    let st = Safetensors::load(src.join("model.safetensors")).unwrap();
    let mut tensors: Vec<(String, Array)> = st.keys().into_iter().map(|k| (k.clone(), st.get(&k).unwrap())).collect();
    let scale = Array::from_slice(&[1.0f32], &[1, 1]).unwrap();
    tensors.push(("model.layers.0.self_attn.o_proj.weight_scale_inv".into(), scale));
    let refs: Vec<(&str, &Array)> = tensors.iter().map(|(k, a)| (k.as_str(), a)).collect();
    mlx_k3::io::save_safetensors(tmp.path().join("model.safetensors"), &refs, &[]).unwrap();
    let e = KimiK3::load(tmp.path(), LoadOptions { dtype: Some(Dtype::F32), lazy: true, shard: None })
        .unwrap_err()
        .to_string();
    assert!(e.contains("o_proj.weight_scale_inv") && e.contains("mlx_lm.convert"), "{e}");
}

/// The routed-expert stacks of a fixture rewritten as codebook stacks (`k3_codebook`) or tiered stacks
/// (`k3_tiered`: codebook, MXFP4 and affine experts in one stack), loaded through config.json, against the same
/// model with each stack replaced by its dequantization in f32 (the plain-ops reference): the same logits
/// within f32 reassociation (1e-4 of the largest logit, as tests/tiered.rs for Kimi K3) and greedy tokens
/// over a prompt plus decode steps with a cache (DeepSeek-V3.2's fixture takes the fused indexer path there).
#[test]
fn codebook_and_tiered_expert_stacks_match_their_dequantized_reference() {
    use mlx_k3::codebook;
    use mlx_k3::io::save_safetensors;
    use mlx_k3::quant::QuantSpec;
    use mlx_k3::tiered::{self, Tier};
    use serde_json::json;
    let tmp = tempfile::tempdir().unwrap();
    let fixtures = [fixtures_dir().join("a_yarn_grouped"), logit_fixtures::dir("deepseek_v32").join("a_yarn_topk4")];
    for src in fixtures {
        let float = Safetensors::load(src.join("model.safetensors")).unwrap().arrays().unwrap();
        let cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
        let exp = expected(&src);
        let paths: Vec<String> = float
            .keys()
            .filter(|k| k.contains("switch_mlp") && k.ends_with(".weight"))
            .map(|k| k.trim_end_matches(".weight").to_string())
            .collect();
        assert!(!paths.is_empty());
        for mode in ["codebook", "tiered"] {
            let (mut packed, mut reference) = (float.clone(), float.clone());
            let mut qcfg = serde_json::Map::new();
            for path in &paths {
                let w = packed.remove(&format!("{path}.weight")).unwrap();
                let (e, n, k) = (w.dim(0).unwrap() as usize, w.dim(1).unwrap() as usize, w.dim(2).unwrap() as usize);
                if mode == "codebook" {
                    let host = w.to_vec::<f32>().unwrap();
                    let parts: Vec<codebook::Codebook> = (0..e)
                        .map(|i| {
                            codebook::quantize(&host[i * n * k..(i + 1) * n * k], n, k, None)
                                .unwrap()
                                .0
                                .to_arrays()
                                .unwrap()
                        })
                        .collect();
                    let st = |f: &dyn Fn(&codebook::Codebook) -> &Array| {
                        mlx_k3::ops::stack(&parts.iter().map(f).collect::<Vec<_>>(), 0).unwrap()
                    };
                    let cb =
                        codebook::Codebook { codes: st(&|c| &c.codes), qh: st(&|c| &c.qh), scales: st(&|c| &c.scales) };
                    reference.insert(format!("{path}.weight"), codebook::dequantize_reference(&cb).unwrap());
                    packed.insert(format!("{path}.codes"), cb.codes);
                    packed.insert(format!("{path}.qh"), cb.qh);
                    packed.insert(format!("{path}.scales"), cb.scales);
                    qcfg.insert(path.clone(), json!({"mode": "k3_codebook"}));
                } else {
                    // Experts 0-3 codebook, 4-5 MXFP4, 6-7 affine 4-bit (group 32: the fixtures' K is 32).
                    let tiers: Vec<Tier> = (0..e)
                        .map(|i| match i {
                            0..=3 => Tier::Codebook,
                            4 | 5 => Tier::Mxfp4,
                            _ => Tier::Affine,
                        })
                        .collect();
                    let (t, _) = tiered::build_tiered(&w, &tiers, QuantSpec::affine(32, 4), None).unwrap();
                    reference.insert(format!("{path}.weight"), tiered::dequantize_tiered(&t).unwrap());
                    packed.insert(format!("{path}.tier"), t.tier.clone());
                    packed.insert(format!("{path}.slot"), t.slot.clone());
                    let c = t.codebook.as_ref().unwrap();
                    packed.insert(format!("{path}.codebook.codes"), c.codes.clone());
                    packed.insert(format!("{path}.codebook.qh"), c.qh.clone());
                    packed.insert(format!("{path}.codebook.scales"), c.scales.clone());
                    let q = t.mxfp4.as_ref().unwrap();
                    packed.insert(format!("{path}.mxfp4.weight"), q.weight.clone());
                    packed.insert(format!("{path}.mxfp4.scales"), q.scales.clone());
                    let (q, _) = t.affine.as_ref().unwrap();
                    packed.insert(format!("{path}.affine.weight"), q.weight.clone());
                    packed.insert(format!("{path}.affine.scales"), q.scales.clone());
                    packed.insert(format!("{path}.affine.biases"), q.biases.clone().unwrap());
                    qcfg.insert(path.clone(), json!({"mode": "k3_tiered", "affine": {"group_size": 32, "bits": 4}}));
                }
            }
            let write = |dir: &Path, cfg: &Value, t: &std::collections::BTreeMap<String, Array>| {
                std::fs::create_dir_all(dir).unwrap();
                std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
                let refs: Vec<(&str, &Array)> = t.iter().map(|(k, v)| (k.as_str(), v)).collect();
                save_safetensors(dir.join("model.safetensors"), &refs, &[("format", "mlx")]).unwrap();
            };
            let name = format!("{}_{mode}", src.file_name().unwrap().to_string_lossy());
            let (pdir, rdir) = (tmp.path().join(&name), tmp.path().join(format!("{name}_ref")));
            let mut pcfg = cfg.clone();
            pcfg["quantization"] = Value::Object(qcfg);
            write(&pdir, &pcfg, &packed);
            write(&rdir, &cfg, &reference);
            let (pm, rm) = (load(&pdir, Dtype::F32), load(&rdir, Dtype::F32));
            let t = exp.prompt.len() as i32;
            let (a, b) = (pm.forward(&ids(&exp.prompt), None).unwrap(), rm.forward(&ids(&exp.prompt), None).unwrap());
            let e = rel_err(&a.reshape(&[t, -1]).unwrap(), &b.reshape(&[t, -1]).unwrap());
            println!("{name}: prefill logits rel err vs dequantized reference {e:.2e}");
            assert!(e <= TOL, "{name}: prefill rel err {e}");
            let (mut pc, mut rc) = (pm.make_cache(), rm.make_cache());
            let (mut pa, mut rb) = (
                pm.forward(&ids(&exp.prompt), Some(&mut pc)).unwrap(),
                rm.forward(&ids(&exp.prompt), Some(&mut rc)).unwrap(),
            );
            for step in 0..6 {
                let (ta, tb) = (argmax(&last_row(&pa)), argmax(&last_row(&rb)));
                assert_eq!(ta, tb, "{name}: greedy token {step}");
                pa = pm.forward(&ids(&[ta]), Some(&mut pc)).unwrap();
                rb = rm.forward(&ids(&[tb]), Some(&mut rc)).unwrap();
                let e = rel_err(&pa, &rb);
                assert!(e <= TOL, "{name}: decode step {step} rel err {e}");
            }
        }
    }
}
