//! Bad checkpoints give errors that name the file, tensor or field, and lose nothing: no panic, no abort.

use std::path::{Path, PathBuf};

use mlx_k3::io::{save_safetensors, Safetensors};
use mlx_k3::model::{KimiK3, LoadOptions, ModelConfig};
use mlx_k3::{Array, Dtype, Error};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/k3").join(name)
}

/// A writable copy of fixture `name` (config.json and the weights, without the index).
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(name).join(f), tmp.path().join(f)).unwrap();
    }
    tmp
}

/// Rewrites `dir/model.safetensors` after `edit` changes the tensor map.
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Array)>)) {
    let path = dir.join("model.safetensors");
    let st = Safetensors::load(&path).unwrap();
    let mut tensors: Vec<(String, Array)> = st.arrays().unwrap().into_iter().collect();
    for (_, a) in &tensors {
        a.eval().unwrap();
    }
    drop(st);
    edit(&mut tensors);
    let refs: Vec<(&str, &Array)> = tensors.iter().map(|(k, a)| (k.as_str(), a)).collect();
    save_safetensors(&path, &refs, &[("format", "mlx")]).unwrap();
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn load_err(dir: &Path) -> String {
    match KimiK3::load(dir, LoadOptions { dtype: Some(Dtype::F32), lazy: false, shard: None }) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

const BASE: &str = "a_latent_norm_attnres";
const KEY: &str = "language_model.model.layers.1.mlp.switch_mlp.up_proj.weight";

#[test]
fn a_copied_fixture_loads() {
    // The harness itself: an unmodified copy loads (so the failures below are caused by the edits).
    let dir = copy_fixture(BASE);
    KimiK3::load(dir.path(), LoadOptions::default()).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let dir = copy_fixture(BASE);
    edit_weights(dir.path(), |t| t.retain(|(k, _)| k != KEY));
    let e = load_err(dir.path());
    assert!(e.contains("missing tensor") && e.contains("model.layers.1.mlp.switch_mlp.up_proj.weight"), "{e}");
}

#[test]
fn wrong_shape_is_named_with_expected_and_found() {
    let dir = copy_fixture(BASE);
    edit_weights(dir.path(), |t| {
        let (_, a) = t.iter_mut().find(|(k, _)| k == KEY).unwrap();
        *a = a.slice_axis(1, 0, 5).unwrap().contiguous().unwrap();
    });
    let e = load_err(dir.path());
    assert!(e.contains("switch_mlp.up_proj.weight") && e.contains("expected") && e.contains("[8, 5, 32]"), "{e}");
}

#[test]
fn extra_tensor_is_named() {
    let dir = copy_fixture(BASE);
    edit_weights(dir.path(), |t| {
        t.push(("language_model.model.layers.0.mystery.weight".into(), Array::from_slice(&[1.0f32], &[1]).unwrap()))
    });
    let e = load_err(dir.path());
    assert!(e.contains("mystery"), "{e}");
}

#[test]
fn truncated_and_corrupt_files_name_the_file() {
    let dir = copy_fixture(BASE);
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    for cut in [bytes.len() - 100, bytes.len() / 2, 200, 4] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let e = load_err(dir.path());
        assert!(e.contains("model.safetensors") && (e.contains("truncated") || e.contains("corrupt")), "{cut}: {e}");
    }
    let mut garbage = bytes.clone();
    garbage[8..40].copy_from_slice(b"{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{");
    std::fs::write(&path, &garbage).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("model.safetensors") && e.contains("corrupt"), "{e}");
    std::fs::remove_file(&path).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("no model*.safetensors"), "{e}");
}

#[test]
fn a_shard_missing_from_the_index_is_named() {
    let dir = copy_fixture(BASE);
    std::fs::copy(fixture(BASE).join("model.safetensors.index.json"), dir.path().join("model.safetensors.index.json"))
        .unwrap();
    std::fs::rename(dir.path().join("model.safetensors"), dir.path().join("model-00001.safetensors")).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("index.json") && e.contains("model.safetensors") && e.contains("missing"), "{e}");
}

#[test]
fn config_fields_of_the_wrong_type_are_named() {
    let dir = copy_fixture(BASE);
    edit_config(dir.path(), |v| v["text_config"]["rms_norm_eps"] = "tiny".into());
    let e = load_err(dir.path());
    assert!(e.contains("config.json") && e.contains("text_config.rms_norm_eps") && e.contains("invalid type"), "{e}");

    let dir = copy_fixture("b_latent_fullrank_every2"); // flat form
    edit_config(dir.path(), |v| v["linear_attn_config"]["kda_layers"] = serde_json::json!([1, "two"]));
    let e = load_err(dir.path());
    assert!(e.contains("linear_attn_config.kda_layers"), "{e}");

    let dir = copy_fixture(BASE);
    std::fs::write(dir.path().join("config.json"), "{ \"model_type\": \"kimi_k3\", ").unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("config.json") && e.contains("JSON"), "{e}");
}

#[test]
fn unsupported_config_values_name_the_field() {
    for (field, value, expect) in [
        ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
        ("moe_router_activation_func", serde_json::json!("softmax"), "moe_router_activation_func"),
        ("mla_use_nope", serde_json::json!(false), "mla_use_nope"),
        ("num_experts_per_token", serde_json::json!(99), "num_experts_per_token"),
    ] {
        let dir = copy_fixture(BASE);
        edit_config(dir.path(), |v| v["text_config"][field] = value.clone());
        let e = load_err(dir.path());
        assert!(e.contains(expect), "{field}: {e}");
    }
    let dir = copy_fixture(BASE);
    edit_config(dir.path(), |v| v["model_type"] = "llama".into());
    assert!(load_err(dir.path()).contains("model_type"));
}

#[test]
fn quantization_records_that_contradict_the_weights_are_errors() {
    let dir = copy_fixture("a_latent_norm_attnres_q4");
    edit_config(dir.path(), |v| v["quantization"]["language_model.model.layers.1.mlp.gate"] = false.into());
    let e = load_err(dir.path());
    assert!(e.contains("model.layers.1.mlp.gate") && e.contains("unquantized"), "{e}");
    let dir = copy_fixture(BASE);
    edit_config(dir.path(), |v| {
        v["quantization"] = serde_json::json!({"group_size": 32, "bits": 4,
            "language_model.model.layers.0.mlp.up_proj": {"group_size": 32, "bits": 4}})
    });
    let e = load_err(dir.path());
    assert!(e.contains("model.layers.0.mlp.up_proj") && e.contains("scales"), "{e}");
}

#[test]
fn forward_rejects_bad_inputs() {
    let model = KimiK3::load(&fixture(BASE), LoadOptions::default()).unwrap();
    let other = KimiK3::load(&fixture("d_latent_norm_attnres_untied"), LoadOptions::default()).unwrap();
    let ids = Array::from_slice(&[1i32, 2, 3], &[3]).unwrap();
    assert!(matches!(model.forward(&ids, None), Err(Error::InvalidArgument { .. })));
    let ids = ids.reshape(&[1, 3]).unwrap();
    let mut wrong = other.make_cache();
    assert!(model.forward(&ids, Some(&mut wrong)).is_err());
    // A model with KDA layers cannot rewind its cache: that is an error, not a silent wrong state.
    let mut cache = model.make_cache();
    model.forward(&ids, Some(&mut cache)).unwrap();
    assert!(!cache.is_trimmable() && cache.trim(1).is_err());
    let snap = cache.snapshot();
    model.forward(&Array::from_slice(&[4i32], &[1, 1]).unwrap(), Some(&mut cache)).unwrap();
    assert_eq!(cache.offset(), 4);
    cache.restore(&snap);
    assert_eq!(cache.offset(), 3);
}

#[test]
fn config_parses_both_forms_with_mlx_lm_defaults() {
    let flat = ModelConfig::load(&fixture("b_latent_fullrank_every2")).unwrap();
    // Defaults from mlx-lm's TextArgs where the minimal flat config is silent.
    assert_eq!(flat.text.num_experts_per_token, 2);
    assert!(flat.text.moe_renormalize && flat.text.mla_use_nope && !flat.text.tie_word_embeddings);
    assert_eq!(flat.text.situ_beta(), 1.0);
    let nested = ModelConfig::load(&fixture("a_latent_norm_attnres_q4")).unwrap();
    assert!(nested.text.tie_word_embeddings);
    let q = nested.quantization;
    assert_eq!(q.default.map(|s| (s.group_size, s.bits)), Some((32, 4)));
    assert!(q.for_path("model.layers.1.mlp.gate").is_some(), "per-path overrides keep their path");
}

#[test]
fn malformed_release_mxfp4_experts_are_named() {
    // The release layout (compressed-tensors MXFP4 experts, per expert): a stack whose experts disagree, or
    // whose scales imply another packing than the declared mxfp4-pack-quantized, is an error naming the
    // release tensor, not another format (mlx-lm would take groups of 16 for nvfp4).
    let name = "a_latent_norm_attnres_bf16_mxfp4_release";
    let scale = |e: usize| format!("language_model.model.layers.1.block_sparse_moe.experts.{e}.w3.weight_scale");
    let dir = copy_fixture(name);
    edit_weights(dir.path(), |t| {
        let (_, a) = t.iter_mut().find(|(k, _)| *k == scale(2)).unwrap();
        *a = a.astype(Dtype::F32).unwrap();
    });
    let e = load_err(dir.path());
    assert!(e.contains("'model.layers.1.block_sparse_moe.experts.2.w3.weight_scale' is float32 [32, 1]"), "{e}");
    let dir = copy_fixture(name);
    edit_weights(dir.path(), |t| {
        for (_, a) in t.iter_mut().filter(|(k, _)| k.ends_with("w3.weight_scale") && k.contains("layers.1.")) {
            *a = mlx_k3::ops::concatenate(&[&*a, &*a], 1).unwrap();
        }
    });
    let e = load_err(dir.path());
    assert!(e.contains("'model.layers.1.mlp.switch_mlp.up_proj'") && e.contains("declares mxfp4"), "{e}");
}
