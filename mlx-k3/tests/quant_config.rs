//! `config.json`'s `quantization` read as mlx-lm reads it: a per-path entry is passed to MLX's
//! `to_quantized(**entry)`, so one without a `mode` is affine whatever the top-level mode (mlx-lm's MXFP4
//! conversion of Kimi K3 keeps the router at `{"group_size": 64, "bits": 8}`, affine with biases).

use std::path::Path;

use mlx_k3::model::config::PathQuant;
use mlx_k3::model::ModelConfig;
use mlx_k3::quant::{QuantMode, QuantSpec};
use serde_json::json;

fn parse(quantization: serde_json::Value) -> ModelConfig {
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano/config.json")).unwrap(),
    )
    .unwrap();
    cfg["quantization"] = quantization;
    ModelConfig::parse(&cfg.to_string(), Path::new("config.json")).unwrap()
}

#[test]
fn a_per_path_entry_without_a_mode_is_affine() {
    let c = parse(json!({
        "group_size": 32, "bits": 4, "mode": "mxfp4",
        "language_model.model.layers.1.mlp.gate": {"group_size": 64, "bits": 8},
        "language_model.model.layers.2.mlp.gate": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
    }));
    let q = &c.quantization;
    assert_eq!(q.default, Some(QuantSpec { group_size: 32, bits: 4, mode: QuantMode::Mxfp4 }));
    assert_eq!(
        q.for_path("model.layers.1.mlp.gate"),
        Some(PathQuant::Quantized(QuantSpec { group_size: 64, bits: 8, mode: QuantMode::Affine }))
    );
    assert_eq!(
        q.for_path("model.layers.2.mlp.gate"),
        Some(PathQuant::Quantized(QuantSpec { group_size: 32, bits: 4, mode: QuantMode::Mxfp4 }))
    );
}
