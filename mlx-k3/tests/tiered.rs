//! Mixed-format expert stacks end to end: a random K3 checkpoint whose expert stacks are rewritten as tiers
//! (codebook band + MXFP4 + affine experts, or all codebook) loads through config.json and gives the same
//! logits as the same model with every expert dequantized to f32 (the plain-ops reference), within fp32
//! reassociation (1e-4 of the largest logit); greedy tokens are identical.

use std::collections::BTreeMap;
use std::path::Path;

use mlx_k3::codebook;
use mlx_k3::io::save_safetensors;
use mlx_k3::model::{KimiK3, LoadOptions, ModelConfig};
use mlx_k3::quant::QuantSpec;
use mlx_k3::tiered::{self, Tier, TieredExperts};
use mlx_k3::{ops, Array, Dtype};
use serde_json::{json, Value};

fn config() -> Value {
    json!({
        "model_type": "kimi_k3",
        "vocab_size": 300, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 256, "rms_norm_eps": 1e-5,
        "linear_attn_config": {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4, "kda_layers": [1]},
        "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 8, "v_head_dim": 32,
        "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 256,
        "num_shared_experts": 1, "routed_expert_hidden_size": 256, "latent_moe_use_norm": true,
        "first_k_dense_replace": 0, "tie_word_embeddings": true
    })
}

fn write(dir: &Path, cfg: &Value, tensors: &BTreeMap<String, Array>) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(cfg).unwrap()).unwrap();
    let named: Vec<(String, &Array)> = tensors.iter().map(|(k, v)| (format!("language_model.{k}"), v)).collect();
    let refs: Vec<(&str, &Array)> = named.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    save_safetensors(dir.join("model.safetensors"), &refs, &[("format", "mlx")]).unwrap();
}

fn expert_paths(t: &BTreeMap<String, Array>) -> Vec<String> {
    t.keys()
        .filter(|k| k.contains("switch_mlp") && k.ends_with(".weight"))
        .map(|k| k.trim_end_matches(".weight").to_string())
        .collect()
}

fn put_tiered(out: &mut BTreeMap<String, Array>, path: &str, t: &TieredExperts) {
    out.insert(format!("{path}.tier"), t.tier.clone());
    out.insert(format!("{path}.slot"), t.slot.clone());
    if let Some(c) = &t.codebook {
        out.insert(format!("{path}.codebook.codes"), c.codes.clone());
        out.insert(format!("{path}.codebook.qh"), c.qh.clone());
        out.insert(format!("{path}.codebook.scales"), c.scales.clone());
    }
    if let Some(q) = &t.mxfp4 {
        out.insert(format!("{path}.mxfp4.weight"), q.weight.clone());
        out.insert(format!("{path}.mxfp4.scales"), q.scales.clone());
    }
    if let Some((q, _)) = &t.affine {
        out.insert(format!("{path}.affine.weight"), q.weight.clone());
        out.insert(format!("{path}.affine.scales"), q.scales.clone());
        out.insert(format!("{path}.affine.biases"), q.biases.clone().unwrap());
    }
}

/// f32 activations on every device (the CPU's default; on a GPU, where the default is bf16, this keeps the
/// 1e-4 comparison meaningful: scripts/gpu_check.sh runs this test there).
fn logits(dir: &Path, ids: &[i32]) -> Vec<f32> {
    let m = KimiK3::load(dir, LoadOptions { dtype: Some(Dtype::F32), ..LoadOptions::default() }).unwrap();
    let x = Array::from_slice(ids, &[1, ids.len() as i32]).unwrap();
    m.forward(&x, None).unwrap().to_vec::<f32>().unwrap()
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn tiered_and_codebook_checkpoints_match_their_dequantized_reference() {
    let cfg = config();
    let text = ModelConfig::parse(&cfg.to_string(), Path::new("config.json")).unwrap().text;
    let (_, float) = KimiK3::random(&text, 7).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let ids: Vec<i32> = (0..24).map(|i| (i * 37 + 11) % 300).collect();
    let tiers_of: Vec<Tier> = (0..8)
        .map(|e| {
            if e < 5 {
                Tier::Codebook
            } else if e < 7 {
                Tier::Mxfp4
            } else {
                Tier::Affine
            }
        })
        .collect();
    for (name, all_codebook) in [("tiered", false), ("codebook", true)] {
        let mut packed = float.clone();
        let mut reference = float.clone();
        let mut qcfg = serde_json::Map::new();
        for path in expert_paths(&float) {
            let w = packed.remove(&format!("{path}.weight")).unwrap();
            reference.remove(&format!("{path}.weight"));
            let full = format!("language_model.{path}");
            if all_codebook {
                let (e, n, k) = (w.dim(0).unwrap(), w.dim(1).unwrap() as usize, w.dim(2).unwrap() as usize);
                let host = w.to_vec::<f32>().unwrap();
                let parts: Vec<codebook::Codebook> = (0..e as usize)
                    .map(|i| {
                        codebook::quantize(&host[i * n * k..(i + 1) * n * k], n, k, None)
                            .unwrap()
                            .0
                            .to_arrays()
                            .unwrap()
                    })
                    .collect();
                let st = |f: &dyn Fn(&codebook::Codebook) -> &Array| {
                    ops::stack(&parts.iter().map(f).collect::<Vec<_>>(), 0).unwrap()
                };
                let cb =
                    codebook::Codebook { codes: st(&|c| &c.codes), qh: st(&|c| &c.qh), scales: st(&|c| &c.scales) };
                reference.insert(format!("{path}.weight"), codebook::dequantize_reference(&cb).unwrap());
                packed.insert(format!("{path}.codes"), cb.codes);
                packed.insert(format!("{path}.qh"), cb.qh);
                packed.insert(format!("{path}.scales"), cb.scales);
                qcfg.insert(full, json!({"mode": "k3_codebook"}));
            } else {
                let (t, report) = tiered::build_tiered(&w, &tiers_of, QuantSpec::affine(64, 4), None).unwrap();
                assert!(report.plain_rel_err > 0.0 && report.plain_rel_err < 0.5, "{report:?}");
                reference.insert(format!("{path}.weight"), tiered::dequantize_tiered(&t).unwrap());
                put_tiered(&mut packed, &path, &t);
                qcfg.insert(full, json!({"mode": "k3_tiered", "affine": {"group_size": 64, "bits": 4}}));
            }
        }
        let mut pcfg = cfg.clone();
        pcfg["quantization"] = Value::Object(qcfg);
        let pdir = tmp.path().join(name);
        let rdir = tmp.path().join(format!("{name}_reference"));
        write(&pdir, &pcfg, &packed);
        write(&rdir, &cfg, &reference);
        let (a, b) = (logits(&pdir, &ids), logits(&rdir, &ids));
        let e = rel(&a, &b);
        println!("{name}: logits rel err vs dequantized reference {e:e}");
        assert!(e <= 1e-4, "{name}: {e}");
        let argmax = |v: &[f32]| -> Vec<usize> {
            v.chunks(300).map(|r| r.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).unwrap().0).collect()
        };
        assert_eq!(argmax(&a), argmax(&b), "{name}: greedy tokens");
        // inspect reads the tiered stacks' bits per weight from the records.
        let m = KimiK3::load(&pdir, LoadOptions { dtype: Some(Dtype::F32), lazy: true, shard: None }).unwrap();
        let experts: Vec<_> = m.tensor_records().iter().filter(|r| r.path.contains("switch_mlp")).collect();
        let bpw = experts.iter().map(|r| r.bytes * 8).sum::<u64>() as f64
            / experts.iter().map(|r| r.params).sum::<u64>() as f64;
        println!("{name}: expert bits per weight {bpw:.3}");
        if all_codebook {
            assert!((bpw - 1.5625).abs() < 1e-9, "{bpw}");
        } else {
            // 5 codebook (1.5625) + 2 mxfp4 (4.25) + 1 affine-4/g64 (4 + 2 x 32 / 64 = 5) over 8 (plus 5 bytes of
            // tier/slot tables per stack, negligible).
            let want = (5.0 * 1.5625 + 2.0 * 4.25 + 5.0) / 8.0;
            assert!((bpw - want).abs() < 0.01, "{bpw} vs {want}");
        }
        // The ternary execution layout (`--codebook-layout ternary`): the same logits within the kernels'
        // reassociation (the compact run's 1e-4 bound), the same greedy tokens; the records count the trits as
        // resident bytes and the stored planes as stored bytes.
        codebook::set_load_layout(Some(codebook::CodebookLayout::Ternary));
        let t = logits(&pdir, &ids);
        let m = KimiK3::load(&pdir, LoadOptions { dtype: Some(Dtype::F32), lazy: true, shard: None }).unwrap();
        codebook::set_load_layout(None);
        let e = rel(&t, &a);
        println!("{name}: ternary layout logits rel err vs compact {e:e}");
        assert!(e <= 1e-4, "{name} ternary: {e}");
        assert_eq!(argmax(&t), argmax(&a), "{name} ternary: greedy tokens");
        let experts: Vec<_> = m.tensor_records().iter().filter(|r| r.path.contains("switch_mlp")).collect();
        let stored: u64 = experts.iter().map(|r| r.stored_bytes).sum();
        let resident: u64 = experts.iter().map(|r| r.bytes).sum();
        let bits = experts.iter().map(|r| r.bytes * 8).sum::<u64>() as f64;
        assert_eq!(stored * 8, (bpw * experts.iter().map(|r| r.params).sum::<u64>() as f64).round() as u64);
        assert!(resident > stored, "{name}: resident {resident} stored {stored}");
        println!(
            "{name}: ternary layout resident bits per weight {:.3}",
            bits / experts.iter().map(|r| r.params).sum::<u64>() as f64
        );
    }
}

#[test]
fn broken_tier_tables_are_named_errors() {
    let cfg = config();
    let text = ModelConfig::parse(&cfg.to_string(), Path::new("config.json")).unwrap().text;
    let (_, float) = KimiK3::random(&text, 3).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let tiers_of = vec![Tier::Mxfp4; 8];
    for (case, tier_byte, slot_val) in [("unknown_tier", 7u8, 0u32), ("bad_slot", 1, 99)] {
        let mut packed = float.clone();
        let path = expert_paths(&float)[0].clone();
        let w = packed.remove(&format!("{path}.weight")).unwrap();
        let (mut t, _) = tiered::build_tiered(&w, &tiers_of, QuantSpec::affine(64, 4), None).unwrap();
        let mut tb = vec![1u8; 8];
        let mut sl: Vec<u32> = (0..8).collect();
        tb[3] = tier_byte;
        sl[3] = slot_val;
        t.tier = Array::from_slice(&tb, &[8]).unwrap();
        t.slot = Array::from_slice(&sl, &[8]).unwrap();
        put_tiered(&mut packed, &path, &t);
        let dir = tmp.path().join(case);
        write(&dir, &cfg, &packed);
        let e = KimiK3::load(&dir, LoadOptions::default()).unwrap_err().to_string();
        assert!(e.contains(&path) && e.contains("expert 3"), "{case}: {e}");
    }
}
