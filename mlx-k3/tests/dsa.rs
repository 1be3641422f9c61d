//! DeepSeek-V3.2 (`deepseek_v32`: MLA with the DSA lightning indexer) against mlx-lm 0.32.2's
//! `deepseek_v32.py` on the fixtures `scripts/make_deepseek_v32_fixtures.py` made (tests/fixtures/deepseek_v32:
//! index_topk 4 and 6 under a 12-token prompt, so prefill takes the top-k mask and every decode step gathers
//! the kept latents and reads the indexer-key cache; YaRN and plain RoPE, interleaved and split indexer
//! rotation, and an mlx-lm 4-bit quantization that covers the indexer's linears).
//!
//! Tolerance: as for Kimi K3 and DeepSeek-V3 (tests/model.rs, tests/deepseek_v3.rs), f32 logits within
//! 1e-4 x max |reference|: both sides run MLX's CPU kernels on the same weights and differ only in op order,
//! about 1e-6 relative, printed below. Greedy tokens must be identical: every fixture's top-1 logit leads by
//! >= 2e-3, every router choice by >= 2e-4 and every indexer top-k boundary by >= 1e-4 of the row's largest
//! score (checked by the script), far above that noise, so the same positions are kept on both sides.

use std::path::{Path, PathBuf};

use mlx_k3::io::Safetensors;
use mlx_k3::model::config::Family;
use mlx_k3::model::ModelConfig;
use mlx_k3::{Array, Device, Dtype};
use serde_json::Value;

mod logit_fixtures;
use logit_fixtures::{
    check_full_sequence, check_generate, check_prefill_and_decode, chunked_prefill_rel_err, expected, ids, load,
    rel_err,
};

fn fixtures_dir() -> PathBuf {
    logit_fixtures::dir("deepseek_v32")
}

fn manifest() -> Vec<Value> {
    logit_fixtures::manifest(&fixtures_dir())
}

const TOL: f32 = 1e-4;

#[test]
fn every_fixture_matches_mlx_lm() {
    for f in manifest() {
        let name = f["name"].as_str().unwrap();
        let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
        let exp = expected(&dir);
        let model = load(&dir, Dtype::F32);
        // Prefill, then greedy one-token steps through a cache: logits and tokens match mlx-lm's.
        let fused_before = mlx_k3::kernels::fused_indexer_steps();
        let (e_prefill, worst_decode, tok, _) = check_prefill_and_decode(name, &model, &exp, TOL);
        let next = f["checks"]["next_token_after_decode"].as_i64().unwrap() as i32;
        assert_eq!(tok, next, "{name}: the token after the last decode step differs");
        // The decode steps ran the fused CPU indexer step (kernels::indexer_topk), one per MLA layer and token.
        let fused = mlx_k3::kernels::fused_indexer_steps() - fused_before;
        assert!(fused >= exp.decode_tokens.len() as u64, "{name}: {fused} fused indexer steps");

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
    assert_eq!(checked, 1, "expected a bf16 reference in the quantized fixture");
}

#[test]
fn the_fixtures_exercise_the_sparse_path() {
    // The indexer selects (more positions than index_topk) in prefill and at every decode step.
    let m = manifest();
    assert!(m.iter().any(|f| f["quantized"] == true));
    assert!(m.iter().any(|f| f["features"]["indexer_rope_interleave"] == true));
    assert!(m.iter().any(|f| f["features"]["rope"] == "yarn"));
    for f in &m {
        let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
        let cfg = ModelConfig::load(&dir).unwrap();
        assert_eq!(cfg.text.family, Family::DeepseekV3);
        let ix = cfg.text.indexer.as_ref().expect("deepseek_v32 has an indexer");
        assert_eq!(ix.topk as i64, f["features"]["index_topk"].as_i64().unwrap());
        assert!(ix.topk < expected(&dir).prompt.len(), "{}: index_topk must be below the prompt length", f["name"]);
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
    cfg["index_topk"] = serde_json::json!(1024);
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    for name in ["model.safetensors", "model.safetensors.index.json"] {
        std::fs::copy(dir.join(name), tmp.path().join(name)).unwrap();
    }
    let dense = load(tmp.path(), Dtype::F32);
    let all: Vec<i32> = exp.prompt.iter().chain(&exp.decode_tokens).copied().collect();
    let got = dense.forward(&ids(&all), None).unwrap();
    let e = rel_err(&got.reshape(&[all.len() as i32, -1]).unwrap(), &exp.full);
    assert!(e > 100.0 * TOL, "dense attention should differ from the sparse reference (rel err {e})");
}

#[test]
fn bad_deepseek_v32_configs_name_the_field() {
    let cases: [(Value, &str); 3] = [
        (serde_json::json!({"model_type": "deepseek_v32", "q_lora_rank": null}), "q_lora_rank"),
        (serde_json::json!({"model_type": "deepseek_v32", "index_topk": 0}), "index_topk"),
        (serde_json::json!({"model_type": "deepseek_v32", "index_head_dim": 32}), "index_head_dim"),
    ];
    for (cfg, field) in cases {
        let e = ModelConfig::parse(&cfg.to_string(), Path::new("x/config.json")).unwrap_err().to_string();
        assert!(e.contains(field) && e.contains("x/config.json"), "{field}: {e}");
    }
    let c = ModelConfig::parse(r#"{"model_type": "deepseek_v32"}"#, Path::new("c")).unwrap();
    let ix = c.text.indexer.unwrap();
    assert_eq!((ix.heads, ix.head_dim, ix.topk), (64, 128, 2048), "mlx-lm's defaults");
    assert!(ModelConfig::parse(r#"{"model_type": "deepseek_v3"}"#, Path::new("c")).unwrap().text.indexer.is_none());
}

#[test]
fn trimming_the_cache_rewinds_the_indexer_keys() {
    // The indexer keys share the latents' offset: after trimming three decoded positions, decoding the same
    // tokens again must give the same logits (stale or misplaced indexer keys would change the selection).
    // Same graph and inputs on both runs, so equal up to MLX's evaluation being deterministic: 1e-6 relative.
    let f = &manifest()[0];
    let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
    let exp = expected(&dir);
    let model = load(&dir, Dtype::F32);
    let mut cache = model.make_cache();
    model.forward(&ids(&exp.prompt), Some(&mut cache)).unwrap();
    let steps = &exp.decode_tokens[..3];
    let first: Vec<Array> = steps.iter().map(|&t| model.forward(&ids(&[t]), Some(&mut cache)).unwrap()).collect();
    assert!(cache.nbytes() > 0);
    assert_eq!(cache.trim(3).unwrap(), 3);
    for (i, &t) in steps.iter().enumerate() {
        let again = model.forward(&ids(&[t]), Some(&mut cache)).unwrap();
        let e = rel_err(&again, &first[i]);
        assert!(e <= 1e-6, "step {i} after trim: rel err {e}");
    }
}

// ---- the fused CPU decode step (kernels::indexer_topk) against MLX's ops ------------------------------------

fn randn(shape: &[i32], seed: u64) -> Array {
    mlx_k3::random::normal(shape, Dtype::F32, 0.0, 1.0, Some(&mlx_k3::random::key(seed).unwrap())).unwrap()
}

/// Checks `got` (the fused op's `[B, k]`) against MLX's ops on the same values in f32: per row, `k` distinct
/// ascending positions, and the same set as the reference's argpartition except for positions whose reference
/// score lies within `tol` of the row's threshold (the k-th largest score), where rounding decides.
/// `tol`: both sides form the same products and sum them in different orders (MLX's SGEMM blocks over d, the
/// kernel runs one FMA chain per head, then both sum over heads), so each score is within the recursive-
/// summation bound (d + H) * eps * sum_h |w_h| sum_j |q_hj k_sj| of the exact one; twice that separates the two.
fn check_against_ops(q: &Array, w: &Array, keys: &Array, got: &Array, topk: i32, what: &str) {
    let (qf, wf, kf) = (q.astype(Dtype::F32).unwrap(), w.astype(Dtype::F32).unwrap(), keys.astype(Dtype::F32).unwrap());
    let (b, h, d) = (q.dim(0).unwrap(), q.dim(1).unwrap(), q.dim(2).unwrap());
    let scores = mlx_k3::kernels::indexer_scores_reference(&qf, &wf, &kf).unwrap();
    let s = scores.dim(1).unwrap();
    let reference = mlx_k3::kernels::indexer_topk_reference(&qf, &wf, &kf, topk).unwrap();
    let mag = mlx_k3::kernels::indexer_scores_reference(&qf.abs().unwrap(), &wf.abs().unwrap(), &kf.abs().unwrap())
        .unwrap()
        .max_all(false)
        .unwrap()
        .item::<f32>()
        .unwrap();
    let tol = 2.0 * (d + h) as f32 * f32::EPSILON * mag;
    let k = topk.min(s) as usize;
    assert_eq!(got.shape(), vec![b, k as i32], "{what}: shape");
    assert_eq!(got.dtype(), Dtype::U32, "{what}: dtype");
    let (g, r, sc) = (got.to_vec::<u32>().unwrap(), reference.to_vec::<u32>().unwrap(), scores.to_vec_f32().unwrap());
    let mut boundary = 0;
    for row in 0..b as usize {
        let gr = &g[row * k..(row + 1) * k];
        assert!(gr.windows(2).all(|p| p[0] < p[1]), "{what}: row {row} not strictly ascending");
        assert!(gr.iter().all(|&i| (i as i32) < s), "{what}: row {row} out of range");
        let mut rr = r[row * k..(row + 1) * k].to_vec();
        rr.sort_unstable();
        let srow = &sc[row * s as usize..(row + 1) * s as usize];
        let thr = rr.iter().map(|&i| srow[i as usize]).fold(f32::INFINITY, f32::min);
        for i in
            gr.iter().filter(|i| rr.binary_search(i).is_err()).chain(rr.iter().filter(|i| gr.binary_search(i).is_err()))
        {
            let v = srow[*i as usize];
            assert!(
                (v - thr).abs() <= tol,
                "{what}: row {row} position {i} (score {v}) differs, threshold {thr}, tol {tol}"
            );
            boundary += 1;
        }
    }
    println!("{what}: {boundary} boundary position(s) differ within tol {tol:.2e}");
}

/// The cache's layout: `[B, 1, capacity, d]` with the first `s` positions in use (the kernel reads in place).
fn cache_slice(b: i32, s: i32, d: i32, dtype: Dtype, seed: u64) -> Array {
    let full = randn(&[b, 1, s + 7, d], seed).astype(dtype).unwrap();
    full.slice_axis(2, 0, s).unwrap()
}

#[test]
fn fused_decode_topk_matches_mlx_ops() {
    // A CPU primitive (GPU streams keep MLX's ops): on the CPU stream whatever the default device.
    mlx_k3::with_device(Device::Cpu, || {
        // K3.1's indexer shape (32 x 128, a topk of 2048 with 2500 cached positions), and small ones at and around
        // topk; keys in f32, bf16 and f16 as a cache would store them; two batch rows.
        let cases: [(i32, i32, i32, i32); 6] = [
            (32, 128, 2500, 2048),
            (8, 32, 40, 64),
            (8, 32, 64, 64),
            (8, 32, 65, 64),
            (5, 24, 300, 17),
            (64, 16, 1000, 100),
        ];
        let mut seed = 10;
        for (h, d, s, topk) in cases {
            for dt in [Dtype::F32, Dtype::BF16, Dtype::F16] {
                seed += 1;
                let q = randn(&[2, h, d], seed).astype(dt).unwrap();
                let w = randn(&[2, h], seed + 100).multiply(0.1f32).unwrap().astype(dt).unwrap();
                let keys = cache_slice(2, s, d, dt, seed + 200);
                let got = mlx_k3::kernels::indexer_topk(&q, &w, &keys, topk).unwrap();
                check_against_ops(&q, &w, &keys, &got, topk, &format!("H={h} d={d} S={s} topk={topk} {dt:?}"));
            }
        }
    })
    .unwrap();
}

#[test]
fn fused_decode_topk_breaks_ties_toward_earlier_positions() {
    // A CPU primitive (GPU streams keep MLX's ops): on the CPU stream whatever the default device.
    mlx_k3::with_device(Device::Cpu, || {
        // Keys repeating 5 rows (position s holds row s % 5) give 5 distinct scores, each bit-identical across its
        // positions (the kernel scores every position with the same operations): the rows rank by their scores
        // (from MLX's ops on positions 0..5), and the boundary row contributes its earliest positions.
        let (h, d, s, topk) = (16, 32, 103, 30);
        let q = randn(&[1, h, d], 1);
        let w = randn(&[1, h], 2).multiply(0.1f32).unwrap();
        let rows = randn(&[1, 5, d], 3);
        let idx = mlx_k3::ops::arange(0.0, s as f64, 1.0, Dtype::I32).unwrap().remainder(5i32).unwrap();
        let keys = rows.take(&idx, 1).unwrap();
        let got = mlx_k3::kernels::indexer_topk(&q, &w, &keys, topk).unwrap().to_vec::<u32>().unwrap();
        let row_scores = mlx_k3::kernels::indexer_scores_reference(&q, &w, &rows).unwrap().to_vec_f32().unwrap();
        let mut order: Vec<usize> = (0..5).collect();
        order.sort_by(|&a, &b| row_scores[b].partial_cmp(&row_scores[a]).unwrap());
        let mut want = Vec::new();
        for r in order {
            want.extend((0..s as u32).filter(|p| *p as usize % 5 == r).take(topk as usize - want.len()));
        }
        want.sort_unstable();
        assert_eq!(got, want, "row scores {row_scores:?}");

        // Every dot negative (q > 0, keys < 0): relu makes every score 0, and the first topk positions are kept.
        let q = q.abs().unwrap().add(0.01f32).unwrap();
        let keys = keys.abs().unwrap().negative().unwrap().subtract(0.01f32).unwrap();
        let got = mlx_k3::kernels::indexer_topk(&q, &w, &keys, topk).unwrap().to_vec::<u32>().unwrap();
        assert_eq!(got, (0..topk as u32).collect::<Vec<_>>());
    })
    .unwrap();
}

#[test]
fn fused_decode_topk_bad_input_names_the_op() {
    // A CPU primitive (GPU streams keep MLX's ops): on the CPU stream whatever the default device.
    mlx_k3::with_device(Device::Cpu, || {
        let q = randn(&[1, 4, 8], 1);
        let keys = randn(&[1, 1, 20, 8], 2);
        for (w, k, topk, what) in [
            (randn(&[1, 3], 3), keys.clone(), 4, "w must be"),
            (randn(&[1, 4], 3), randn(&[1, 20, 9], 4), 4, "keys must be"),
            (randn(&[1, 4], 3), keys.clone(), 0, "topk"),
        ] {
            let e = mlx_k3::kernels::indexer_topk(&q, &w, &k, topk)
                .and_then(|a| a.eval().map(|_| a))
                .unwrap_err()
                .to_string();
            assert!(e.contains("indexer_topk") && e.contains(what), "{what}: {e}");
        }
    })
    .unwrap();
}

#[test]
fn decode_steps_agree_with_the_ops_path() {
    // The same decode steps through the fused op and through MLX's ops (kernels::set_fused_indexer(false)):
    // same positions up to rounding (the fixtures' boundaries lead by >= 1e-4 of the row's largest score) and
    // attention over them in a different order (ascending vs argpartition's): logits within the file's TOL.
    let f = &manifest()[0];
    let dir = fixtures_dir().join(f["dir"].as_str().unwrap());
    let exp = expected(&dir);
    let model = load(&dir, Dtype::F32);
    let run = |fused: bool| {
        mlx_k3::kernels::set_fused_indexer(fused);
        let mut cache = model.make_cache();
        model.forward(&ids(&exp.prompt), Some(&mut cache)).unwrap();
        let out: Vec<Array> =
            exp.decode_tokens.iter().map(|&t| model.forward(&ids(&[t]), Some(&mut cache)).unwrap()).collect();
        mlx_k3::kernels::set_fused_indexer(true);
        out
    };
    let before = mlx_k3::kernels::fused_indexer_steps();
    let fused = run(true);
    let steps = mlx_k3::kernels::fused_indexer_steps() - before;
    // Every decode step of both MLA-with-indexer layers took the fused path (other tests may add to the count).
    assert!(steps >= exp.decode_tokens.len() as u64, "{steps} fused steps for {} tokens", exp.decode_tokens.len());
    let ops = run(false);
    for (i, (a, b)) in fused.iter().zip(&ops).enumerate() {
        let e = rel_err(a, b);
        assert!(e <= TOL, "decode step {i}: fused vs ops rel err {e}");
    }
}
