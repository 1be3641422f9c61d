//! What the logit-parity tests share (tests/model.rs, deepseek_v3.rs, dsa.rs, k31.rs): reading a fixture
//! folder written by one of the `scripts/make_*_fixtures.py` scripts (`manifest.json`, and per fixture an
//! `expected.safetensors` with the prompt, prefill logits, the tokens fed to decode, decode logits, the
//! cache-less logits and, where the script records them, `generate_step`'s tokens), loading its model, and
//! the relative error and greedy choice the tests compare with.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use mlx_k3::io::Safetensors;
use mlx_k3::model::{KimiK3, LoadOptions};
use mlx_k3::{Array, Dtype};
use serde_json::Value;

/// `tests/fixtures/<name>`.
pub fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The `fixtures` list of `<dir>/manifest.json`.
pub fn manifest(dir: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(dir.join("manifest.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["fixtures"].as_array().unwrap().clone()
}

pub struct Expected {
    pub prompt: Vec<i32>,
    pub prefill: Array,
    pub decode_tokens: Vec<i32>,
    pub decode: Array,
    pub full: Array,
    /// `generate_tokens`, where the fixture script recorded them.
    generate: Option<Vec<i32>>,
}

impl Expected {
    /// The reference's `generate_step` tokens; a fixture without them fails the test that needs them.
    pub fn generate(&self) -> &[i32] {
        self.generate.as_deref().expect("expected.safetensors has no generate_tokens")
    }
}

pub fn expected(dir: &Path) -> Expected {
    let st = Safetensors::load(dir.join("expected.safetensors")).unwrap();
    Expected {
        prompt: st.get("prompt").unwrap().to_vec::<i32>().unwrap(),
        prefill: st.get("prefill_logits").unwrap(),
        decode_tokens: st.get("decode_tokens").unwrap().to_vec::<i32>().unwrap(),
        decode: st.get("decode_logits").unwrap(),
        full: st.get("full_logits").unwrap(),
        generate: st.get("generate_tokens").ok().map(|a| a.to_vec::<i32>().unwrap()),
    }
}

/// One row of token ids, `[1, T]`.
pub fn ids(tokens: &[i32]) -> Array {
    Array::from_slice(tokens, &[1, tokens.len() as i32]).unwrap()
}

/// max |a - b| / max |b|.
pub fn rel_err(got: &Array, want: &Array) -> f32 {
    let g = got.to_vec_f32().unwrap();
    let w = want.to_vec_f32().unwrap();
    assert_eq!(g.len(), w.len(), "logit counts differ");
    let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let diff = g.iter().zip(&w).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

/// The first index of the largest value.
pub fn argmax(row: &[f32]) -> i32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as i32
}

/// The logits of the last position of `[1, T, V]`.
pub fn last_row(logits: &Array) -> Vec<f32> {
    let t = logits.dim(1).unwrap();
    logits.slice_axis(1, t - 1, t).unwrap().to_vec_f32().unwrap()
}

/// A fixture's model with activations in `dtype`, loaded eagerly on one rank.
pub fn load(dir: &Path, dtype: Dtype) -> KimiK3 {
    KimiK3::load(dir, LoadOptions { dtype: Some(dtype), lazy: false, shard: None })
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}
