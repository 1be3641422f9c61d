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

/// Parses `text` as config.json on another thread and fails if that takes longer than 20 s (a config that
/// makes validation loop 10^12 times must fail this test, not hang it).
fn parse_within(text: String) -> Result<ModelConfig, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(ModelConfig::parse(&text, Path::new("/ckpt/config.json")).map_err(|e| e.to_string()));
    });
    rx.recv_timeout(std::time::Duration::from_secs(20)).expect("config validation did not finish in 20 s")
}

#[test]
fn impossible_config_values_are_refused_naming_file_and_field() {
    // Issue 41, item 5: each of these loaded (or hung); now each is an error naming config.json and the field.
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(BASE).join("config.json")).unwrap()).unwrap();
    for (field, value, expect) in [
        ("num_hidden_layers", serde_json::json!(1_000_000_000_000u64), "num_hidden_layers"),
        ("num_hidden_layers", serde_json::json!(70_000), "num_hidden_layers"),
        ("num_expert_group", serde_json::json!(0), "num_expert_group"),
        ("topk_group", serde_json::json!(0), "topk_group"),
        ("topk_group", serde_json::json!(5), "topk_group"),
        ("num_key_value_heads", serde_json::json!(0), "num_key_value_heads"),
        ("rms_norm_eps", serde_json::json!(0.0), "rms_norm_eps"),
        ("rms_norm_eps", serde_json::json!(-1e-5), "rms_norm_eps"),
        ("max_position_embeddings", serde_json::json!(0), "max_position_embeddings"),
        // 2^32 + 64 would wrap to the fixture's 64 in an int32 shape and match its tensors.
        ("hidden_size", serde_json::json!(4_294_967_360u64), "hidden_size"),
        ("num_attention_heads", serde_json::json!(1u64 << 40), "num_attention_heads"),
        ("moe_intermediate_size", serde_json::json!(1u64 << 62), "moe_intermediate_size"),
        ("routed_scaling_factor", serde_json::json!(1e39), "routed_scaling_factor"),
    ] {
        let mut v = base.clone();
        v["text_config"][field] = value.clone();
        let e = parse_within(v.to_string()).map(|_| ()).unwrap_err();
        assert!(e.contains("/ckpt/config.json") && e.contains(expect), "{field} = {value}: {e}");
    }
    // The bounds accept every config in the repository and mlx-lm's defaults (Kimi K3's sizes: 93 layers,
    // 896 experts, top-16, vocabulary 163,840, a context of 2^20).
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(fixture("")).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano"));
    for d in dirs {
        ModelConfig::load(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
    }
    let k3 = serde_json::json!({"model_type": "kimi_k3", "linear_attn_config": {"num_heads": 64, "head_dim": 128,
        "short_conv_kernel_size": 4, "kda_layers": (1..=93).filter(|l| l % 4 != 0).collect::<Vec<_>>()},
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "num_experts": 896, "moe_intermediate_size": 3072, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "num_expert_group": 8, "topk_group": 4});
    let k3 = parse_within(k3.to_string()).unwrap();
    assert_eq!((k3.text.num_hidden_layers, k3.text.num_experts, k3.text.num_experts_per_token), (93, Some(896), 16));
}

#[test]
fn overlapping_tensor_bytes_are_refused_naming_both_tensors() {
    // Point one tensor of a real checkpoint at the bytes of another of the same size.
    let dir = copy_fixture(BASE);
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let a = "language_model.model.layers.0.input_layernorm.weight";
    let b = "language_model.model.layers.1.input_layernorm.weight";
    assert_eq!(header[a]["shape"], header[b]["shape"]);
    let mut offs = header[a]["data_offsets"].clone();
    offs[0] = (offs[0].as_u64().unwrap() + 4).into();
    offs[1] = (offs[1].as_u64().unwrap() + 4).into();
    header[b]["data_offsets"] = offs;
    let h = serde_json::to_vec(&header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(&h);
    out.extend(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("model.safetensors") && e.contains("overlap") && e.contains(a) && e.contains(b), "{e}");
}

/// A safetensors file: `header` (JSON) and `data` bytes.
fn safetensors_bytes(header: serde_json::Value, data: usize) -> Vec<u8> {
    let h = header.to_string().into_bytes();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.resize(out.len() + data, 0);
    out
}

#[test]
fn crafted_safetensors_headers_are_errors_not_wraps() {
    use mlx_k3::model::loader::parse_safetensors_header;
    let p = Path::new("/x/crafted.safetensors");
    let parse = |header: serde_json::Value, data: usize| {
        let b = safetensors_bytes(header, data);
        parse_safetensors_header(&b, b.len() as u64, p).map(|l| l.len()).map_err(|e| e.to_string())
    };
    let ok = serde_json::json!({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}, "__metadata__": {"format": "pt"}});
    assert_eq!(parse(ok, 32), Ok(2));
    for (header, expect) in [
        // 2^62 x 2^2 x 4 bytes wraps to 0 in 64 bits; so does the first product in 2^31 x 2^31 x 2^2.
        (
            serde_json::json!({"a": {"dtype": "F32", "shape": [1u64 << 31, 1u64 << 31, 4], "data_offsets": [0, 0]}}),
            "larger than",
        ),
        (
            serde_json::json!({"a": {"dtype": "F32", "shape": [65536, 65536, 65536, 65536], "data_offsets": [0, 0]}}),
            "overflows",
        ),
        (serde_json::json!({"a": {"dtype": "F32", "shape": [-1, 2], "data_offsets": [0, 8]}}), "bad shape"),
        (serde_json::json!({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}}), "bad shape"),
        (serde_json::json!({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, -8]}}), "data_offsets"),
        (serde_json::json!({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}), "data_offsets"),
        (serde_json::json!({"a": {"dtype": "F32", "shape": [2], "data_offsets": [u64::MAX - 3, 4]}}), "data_offsets"),
        (
            serde_json::json!({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}}),
            "overlap",
        ),
        (serde_json::json!({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}), "truncated"),
        (serde_json::json!({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}), "unsupported dtype"),
        (serde_json::json!({"a": 1}), "unsupported dtype"),
        (serde_json::json!([1, 2]), "not a JSON object"),
    ] {
        let e = parse(header.clone(), 12).unwrap_err();
        assert!(e.contains("crafted.safetensors") && e.contains(expect), "{header}: {e}");
    }
    // A header length past the file, or past 100 MiB, and files too short to have one.
    let mut b = safetensors_bytes(serde_json::json!({}), 0);
    b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(parse_safetensors_header(&b, b.len() as u64, p).unwrap_err().to_string().contains("header of"));
    for len in 0..8 {
        assert!(parse_safetensors_header(&b[..len], len as u64, p).is_err());
    }
}

#[test]
fn inspect_check_finds_nan_and_inf() {
    use mlx_k3::model::loader::{scan_non_finite, NonFinite};
    let dir = copy_fixture(BASE);
    let (bad, scanned) = scan_non_finite(dir.path(), &mut |_, _| {}).unwrap();
    assert!(bad.is_empty() && scanned > 10, "{bad:?}");
    // Two NaN and one -Inf in one tensor, one +Inf in another (bf16, a float dtype with its own bits).
    let key = "language_model.model.layers.0.input_layernorm.weight";
    let key2 = "language_model.model.norm.weight";
    edit_weights(dir.path(), |t| {
        let (_, a) = t.iter_mut().find(|(k, _)| k == key).unwrap();
        let mut v = a.to_vec::<f32>().unwrap();
        (v[0], v[3], v[5]) = (f32::NAN, -f32::NAN, f32::NEG_INFINITY);
        *a = Array::from_slice(&v, &a.shape()).unwrap();
        let (_, b) = t.iter_mut().find(|(k, _)| k == key2).unwrap();
        let mut v = b.to_vec::<f32>().unwrap();
        v[1] = f32::INFINITY;
        *b = Array::from_slice(&v, &b.shape()).unwrap().astype(Dtype::BF16).unwrap();
    });
    let (bad, _) = scan_non_finite(dir.path(), &mut |_, _| {}).unwrap();
    let got: Vec<(&str, NonFinite)> = bad.iter().map(|(_, n, c)| (n.as_str(), *c)).collect();
    assert_eq!(got, [(key, NonFinite { nan: 2, inf: 1 }), (key2, NonFinite { nan: 0, inf: 1 })]);
    // Each float format's bit patterns: f16 0x7c00 = Inf, 0x7e00 = NaN, 0x7bff = the largest finite.
    let f16: Vec<u8> = [0x7c00u16, 0xfe00, 0x7bff, 0x0001].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(NonFinite::count(&f16, Dtype::F16), Some(NonFinite { nan: 1, inf: 1 }));
    let f64s: Vec<u8> = [f64::NAN, f64::INFINITY, f64::MAX, 0.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(NonFinite::count(&f64s, Dtype::F64), Some(NonFinite { nan: 1, inf: 1 }));
    assert_eq!(NonFinite::count(&f16, Dtype::U32), None);
}
