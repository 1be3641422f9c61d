//! What the logit-parity tests share (tests/model.rs, deepseek_v3.rs, dsa.rs, k31.rs): reading a fixture
//! folder written by one of the `scripts/make_*_fixtures.py` scripts (`manifest.json`, and per fixture an
//! `expected.safetensors` with the prompt, prefill logits, the tokens fed to decode, decode logits, the
//! cache-less logits and, where the script records them, `generate_step`'s tokens), loading its model, and
//! the relative error and greedy choice the tests compare with.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use mlx_k3::io::Safetensors;
use mlx_k3::model::{KimiK3, LoadOptions, ModelCache};
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

/// The cache-less prompt logits, then a cached prefill and one greedy step per fixture decode token, each
/// within `tol` (relative) of the reference and every greedy token equal to the reference's. Returns the
/// prompt's error, the worst step's error, the token chosen after the last step and the cache.
pub fn check_prefill_and_decode(name: &str, model: &KimiK3, exp: &Expected, tol: f32) -> (f32, f32, i32, ModelCache) {
    let t = exp.prompt.len() as i32;
    let logits = model.forward(&ids(&exp.prompt), None).unwrap();
    let e_prefill = rel_err(&logits.reshape(&[t, -1]).unwrap(), &exp.prefill);
    assert!(e_prefill <= tol, "{name}: prefill logits rel err {e_prefill}");

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
        assert!(e <= tol, "{name}: decode step {step} logits rel err {e}");
        tok = argmax(&out.to_vec_f32().unwrap());
    }
    (e_prefill, worst_decode, tok, cache)
}

/// The prompt and decode tokens in one cache-less forward, within `tol` of the reference; returns the error.
pub fn check_full_sequence(name: &str, model: &KimiK3, exp: &Expected, tol: f32) -> f32 {
    let all = prompt_and_decode(exp);
    let full = model.forward(&ids(&all), None).unwrap();
    let e_full = rel_err(&full.reshape(&[all.len() as i32, -1]).unwrap(), &exp.full);
    assert!(e_full <= tol, "{name}: full-sequence logits rel err {e_full}");
    e_full
}

/// Greedy decoding from the prompt gives the reference's `generate_step` tokens.
pub fn check_generate(name: &str, model: &KimiK3, exp: &Expected) {
    let mut cache = model.make_cache();
    let mut out = model.forward(&ids(&exp.prompt), Some(&mut cache)).unwrap();
    let mut generated = Vec::new();
    for _ in 0..exp.generate().len() {
        let tok = argmax(&last_row(&out));
        generated.push(tok);
        out = model.forward(&ids(&[tok]), Some(&mut cache)).unwrap();
    }
    assert_eq!(generated, exp.generate(), "{name}: generated tokens differ from the reference's generate_step");
}

/// The fixture's prompt followed by its decode tokens.
pub fn prompt_and_decode(exp: &Expected) -> Vec<i32> {
    exp.prompt.iter().chain(&exp.decode_tokens).copied().collect()
}

/// The relative error between one cache-less forward over the prompt and decode tokens and the same tokens
/// fed through one cache in chunks of 5, 1 and 7.
pub fn chunked_prefill_rel_err(model: &KimiK3, exp: &Expected) -> f32 {
    let all = prompt_and_decode(exp);
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
    rel_err(&mlx_k3::ops::concatenate(&refs, 1).unwrap(), &one_shot)
}
