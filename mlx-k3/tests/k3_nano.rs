//! k3-nano, the trained tiny model: held-out perplexity computed by the Rust engine equals mlx-lm's
//! (models/k3-nano/eval_reference.safetensors, made by scripts/k3_nano/eval_ppl.py), and its tokenizer
//! encodes exactly as Python tiktoken does (tests/fixtures/tokenizer/k3_nano_ids.json, made by
//! scripts/make_tokenizer_fixtures.py).
//!
//! Tolerance for losses: both sides run f32 forward passes of the same weights through MLX's CPU kernels;
//! per-window mean losses agree to ~1e-6 relative, checked at 1e-4.

use std::path::{Path, PathBuf};

use mlx_k3::io::Safetensors;
use mlx_k3::model::{KimiK3, LoadOptions};
use mlx_k3::quality;
use mlx_k3::tokenizer::{StreamDecoder, Tokenizer};
use mlx_k3::Dtype;

fn nano() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano")
}

#[test]
fn heldout_losses_match_mlx_lm() {
    let model = KimiK3::load(&nano(), LoadOptions { dtype: Some(Dtype::F32), lazy: false, shard: None }).unwrap();
    let st = Safetensors::load(nano().join("eval_reference.safetensors")).unwrap();
    let tokens = st.get("tokens").unwrap();
    let want = st.get("window_loss").unwrap().to_vec::<f32>().unwrap();
    let n_windows = tokens.dim(0).unwrap() as usize;
    let w = tokens.dim(1).unwrap() as usize;
    let all: Vec<u32> = tokens.to_vec::<i32>().unwrap().into_iter().map(|t| t as u32).collect();
    // Every 16th window keeps the test short while covering the whole held-out split.
    let picked: Vec<usize> = (0..n_windows).step_by(16).collect();
    let windows: Vec<Vec<u32>> = picked.iter().map(|&i| all[i * w..(i + 1) * w].to_vec()).collect();
    let (_, per_window) = quality::perplexity(&model, &windows).unwrap();
    let mut worst = 0f64;
    for (j, &i) in picked.iter().enumerate() {
        let rel = (per_window[j] - want[i] as f64).abs() / want[i] as f64;
        worst = worst.max(rel);
        assert!(rel < 1e-4, "window {i}: rust {} vs mlx-lm {}", per_window[j], want[i]);
    }
    // Per-token losses of the first window too.
    let tok = st.get("token_loss").unwrap().slice_axis(0, 0, 1).unwrap().to_vec::<f32>().unwrap();
    let got = quality::token_losses(&model, &all[..w]).unwrap();
    let tok_worst = got.iter().zip(&tok).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(tok_worst < 1e-3, "per-token loss differs by {tok_worst}");
    println!("k3-nano held-out: {} windows, worst relative window-loss difference {worst:e}", picked.len());
}

fn fixture_ids() -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/k3_nano_ids.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn tokenizer_matches_python_tiktoken() {
    let (tok, cfg) = Tokenizer::load(&nano()).unwrap();
    assert_eq!(cfg.eos_token_ids, [2047, 2048]);
    let cases = fixture_ids();
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let want_ordinary: Vec<u32> =
            c["ordinary_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(tok.encode(text, true).unwrap(), want, "{text:?} (special tokens allowed)");
        assert_eq!(tok.encode(text, false).unwrap(), want_ordinary, "{text:?} (as ordinary text)");
        assert_eq!(tok.decode(&want).unwrap(), text, "round trip of {text:?}");
        // Streaming the ids one at a time reproduces the text exactly.
        let mut d = StreamDecoder::new();
        let mut s: String = want.iter().map(|&id| d.push(&tok.token_bytes(id).unwrap())).collect();
        s.push_str(&d.finish());
        assert_eq!(s, text);
    }
}
