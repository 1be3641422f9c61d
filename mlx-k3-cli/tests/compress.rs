//! Compression tools end to end (`convert`, `calibrate`, `prune`, `retier`, `eval`): the host affine
//! quantizer reproduces MLX's `quantize` bit for bit and its clip search beats min-max on real weights;
//! converted checkpoints load and run (and mlx-lm reads the MLX-format ones); conversions and calibrations
//! killed with SIGKILL resume byte-identical; bad input fails before anything is written; a REAP-pruned model
//! computes what the original computes with the dropped experts unreachable; calibration statistics and
//! evaluation numbers match direct computations and repeat exactly; release checkpoints (bf16 with
//! compressed-tensors MXFP4 experts) keep their experts losslessly or re-quantize them as MLX does, and corrupt
//! expert scales are named errors.
//!
//! References are independent of the code under test: MLX's own quantize/dequantize, mlx-lm's logits (committed
//! fixtures, `scripts/compress/mlx_lm_logits.py`), the original model with its router biases masked, the
//! release's per-expert tensors stacked by hand, and f64 recomputations here from the checkpoint's weights and
//! both models' logits.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use half::bf16;
use mlx_k3::compress::affine;
use mlx_k3::io::{save_safetensors, Safetensors};
use mlx_k3::model::{KimiK3, LoadOptions, ModelConfig};
use mlx_k3::quant::{self, QuantMode, QuantSpec};
use mlx_k3::{Array, Dtype};
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/compress")
}

fn nano() -> PathBuf {
    root().join("models/k3-nano")
}

fn heldout() -> String {
    nano().join("heldout.safetensors").display().to_string()
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_mlx-k3")
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin()).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[track_caller]
fn run_ok(args: &[&str]) -> String {
    let (ok, out, err) = run(args);
    assert!(ok, "mlx-k3 {args:?} failed:\n{out}\n{err}");
    out
}

fn write_recipe(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

fn load(dir: &Path) -> KimiK3 {
    KimiK3::load(dir, LoadOptions { dtype: Some(Dtype::F32), ..Default::default() })
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn logits(m: &KimiK3, ids: &[i32]) -> Vec<f32> {
    let x = Array::from_slice(ids, &[1, ids.len() as i32]).unwrap();
    m.forward(&x, None).unwrap().to_vec::<f32>().unwrap()
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Mean KL(softmax(p) || softmax(q)) over rows of `vocab` logits.
fn mean_kl(p: &[f32], q: &[f32], vocab: usize) -> f64 {
    let rows = p.len() / vocab;
    let lsm = |r: &[f32]| {
        let m = r.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let s: f64 = r.iter().map(|&x| (x as f64 - m).exp()).sum();
        r.iter().map(|&x| x as f64 - m - s.ln()).collect::<Vec<f64>>()
    };
    (0..rows)
        .map(|i| {
            let (lp, lq) = (lsm(&p[i * vocab..(i + 1) * vocab]), lsm(&q[i * vocab..(i + 1) * vocab]));
            lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum::<f64>()
        })
        .sum::<f64>()
        / rows as f64
}

const PROMPT: [i32; 12] = [2046, 474, 300, 12, 99, 1500, 7, 260, 2000, 44, 512, 1024];

/// The routed-expert up projection of k3-nano's layer 1 as f32 rows (bf16 values), and its shape.
fn nano_experts() -> (Vec<f32>, usize, usize) {
    let st = Safetensors::load(nano().join("model.safetensors")).unwrap();
    let w = st.get("language_model.model.layers.1.mlp.switch_mlp.up_proj.weight").unwrap();
    let (e, n, k) = (w.dim(0).unwrap() as usize, w.dim(1).unwrap() as usize, w.dim(2).unwrap() as usize);
    (w.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap(), e * n, k)
}

#[test]
fn host_affine_min_max_is_mlx_quantize_bit_for_bit() {
    let (w, rows, k) = nano_experts();
    let wb = Array::from_slice(&w, &[rows as i32, k as i32]).unwrap().astype(Dtype::BF16).unwrap();
    for (bits, group) in [(2, 32), (2, 64), (3, 32), (4, 64), (6, 32), (8, 128)] {
        let spec = QuantSpec::affine(group, bits);
        let want = quant::quantize(&wb, spec, None).unwrap();
        let got = affine::quantize(&w, rows, k, bits as u32, group as usize, Dtype::BF16, &[1.0], None);
        assert_eq!(got.codes, want.weight.to_vec::<u32>().unwrap(), "codes, {bits} bits g{group}");
        let s: Vec<f32> = want.scales.to_vec::<bf16>().unwrap().iter().map(|x| x.to_f32()).collect();
        let b: Vec<f32> = want.biases.unwrap().to_vec::<bf16>().unwrap().iter().map(|x| x.to_f32()).collect();
        assert_eq!(got.scales, s, "scales, {bits} bits g{group}");
        assert_eq!(got.biases, b, "biases, {bits} bits g{group}");
    }
}

#[test]
fn clip_search_reduces_two_bit_error_below_min_max() {
    let (w, rows, k) = nano_experts();
    let shrinks = [1.0, 0.95, 0.9, 0.85, 0.8, 0.75];
    let mut sse = Vec::new();
    for s in [&shrinks[..1], &shrinks[..]] {
        let q = affine::quantize(&w, rows, k, 2, 32, Dtype::BF16, s, None);
        // Decode with MLX itself (independent of the host decoder).
        let packed = quant::Quantized {
            weight: Array::from_slice(&q.codes, &[rows as i32, (k / 16) as i32]).unwrap(),
            scales: Array::from_slice(&q.scales, &[rows as i32, (k / 32) as i32]).unwrap().astype(Dtype::BF16).unwrap(),
            biases: Some(
                Array::from_slice(&q.biases, &[rows as i32, (k / 32) as i32]).unwrap().astype(Dtype::BF16).unwrap(),
            ),
        };
        let d = quant::dequantize(&packed, QuantSpec::affine(32, 2), None, Some(Dtype::F32)).unwrap();
        let d = d.to_vec::<f32>().unwrap();
        sse.push(w.iter().zip(&d).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>());
    }
    let reduction = 1.0 - sse[1] / sse[0];
    println!(
        "affine 2-bit g32 on k3-nano layer-1 experts: min-max SSE {:.5}, clip-searched {:.5} ({:.1}% less)",
        sse[0],
        sse[1],
        reduction * 100.0
    );
    assert!(sse[1] < 0.97 * sse[0], "clip search must cut the squared error measurably: {sse:?}");
}

#[test]
fn converted_checkpoints_load_and_run_and_mlx_lm_reads_the_mlx_formats() {
    let tmp = tempfile::tempdir().unwrap();
    let teacher = load(&nano());
    // 63 held-out tokens (real text: on random ids, near-tied routing decisions make single positions jumpy).
    let tokens =
        Safetensors::load(nano().join("heldout.safetensors")).unwrap().get("tokens").unwrap().to_vec::<i32>().unwrap();
    let window = &tokens[5 * 64..5 * 64 + 63];
    let want = logits(&teacher, window);
    let vocab = teacher.config().vocab_size;
    // 8-bit affine everywhere: weight error ~3e-5 relative, so the KL stays tiny (measured 1.7e-4; through
    // mlx-lm the same). The lossy mixes (4-bit, mxfp4, 2-bit shared experts) measure ~0.02.
    let r8 = write_recipe(tmp.path(), "q8.toml", "[default]\nformat = \"affine\"\nbits = 8\ngroup_size = 32\n");
    // Codebook for the shared experts (K = 128 up/gate: 1.625 bits per weight; K = 32 down: 2.0).
    let cb = write_recipe(
        tmp.path(),
        "cb.json",
        r#"{"default": {"format": "affine", "bits": 4, "group_size": 64,
                        "fallback": {"format": "affine", "bits": 4, "group_size": 32}},
            "classes": {"routed_experts": {"format": "mxfp4"},
                        "shared_experts": {"format": "codebook", "fallback": {"format": "affine", "bits": 2, "group_size": 32, "clip_search": true}},
                        "router": {"format": "float"}}}"#,
    );
    let mix = fixtures().join("mlx_mix.json").display().to_string();
    for (name, recipe, max_kl) in [("q8", &r8, 1e-3), ("cb", &cb, 0.1), ("mix", &mix, 0.1)] {
        let out = tmp.path().join(name);
        run_ok(&["convert", "--from", nano().to_str().unwrap(), "--to", out.to_str().unwrap(), "--recipe", recipe]);
        if name != "q8" {
            check_chunking_changes_nothing(&["convert", "--from", nano().to_str().unwrap(), "--recipe", recipe], &out);
        }
        let got = logits(&load(&out), window);
        let kl = mean_kl(&want, &got, vocab);
        println!("{name}: mean KL to the teacher over 63 held-out tokens {kl:.2e}");
        assert!(kl.is_finite() && kl < max_kl, "{name}: KL {kl}");
        let manifest: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("k3_manifest.json")).unwrap()).unwrap();
        if name == "cb" {
            let reports = manifest["reports"].as_array().unwrap();
            let shared = reports
                .iter()
                .find_map(|r| r.get("model.layers.1.mlp.shared_experts.up_proj"))
                .expect("shared expert report");
            assert_eq!(shared["format"], "codebook");
            let down = reports.iter().find_map(|r| r.get("model.layers.1.mlp.shared_experts.down_proj")).unwrap();
            assert_eq!(down["format"], "codebook", "K = 32: one short super-block per row");
            assert_eq!(down["fallback"], Value::Null, "no fallback taken");
        }
    }
    // mlx-lm's own loader reads the MLX-format output (per-path affine 2/4/8-bit, mxfp4, float router): the
    // committed fixture holds mlx-lm's logits for exactly these files (scripts/compress/mlx_lm_logits.py).
    let out = tmp.path().join("mix");
    let st = Safetensors::load(fixtures().join("mlx_lm_mix_logits.safetensors")).unwrap();
    let recorded: BTreeMap<String, String> = serde_json::from_str(&st.metadata()["files_sha256"]).unwrap();
    for (file, sha) in &recorded {
        let bytes = std::fs::read(out.join(file)).unwrap();
        assert_eq!(
            &mlx_k3::compress::store::sha256_hex(&bytes),
            sha,
            "{file} differs from the files the mlx-lm fixture was made from: regenerate it (scripts/compress/mlx_lm_logits.py)"
        );
    }
    let mlx_lm = st.get("logits").unwrap().to_vec::<f32>().unwrap();
    let ours = logits(&load(&out), &PROMPT);
    let e = rel(&ours, &mlx_lm);
    println!("mix through mlx-lm vs mlx-k3: rel err {e:.2e}");
    assert!(e < 1e-4, "rel err {e}");
}

fn wide_config(layers: usize) -> Value {
    json!({
        "model_type": "kimi_k3",
        "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": layers, "num_attention_heads": 2,
        "intermediate_size": 256, "rms_norm_eps": 1e-5,
        "linear_attn_config": {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4]},
        "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 8, "v_head_dim": 32,
        "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 256,
        "num_shared_experts": 1, "routed_expert_hidden_size": 256, "latent_moe_use_norm": true,
        "first_k_dense_replace": 1, "tie_word_embeddings": true
    })
}

/// A random checkpoint of `wide_config(layers)` in `dir` (bf16, mlx-lm names).
fn random_checkpoint(dir: &Path, layers: usize, seed: u64) {
    let cfg = wide_config(layers);
    let text = ModelConfig::parse(&cfg.to_string(), Path::new("config.json")).unwrap().text;
    let (_, tensors) = KimiK3::random(&text, seed).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    let cast: BTreeMap<String, Array> = tensors
        .into_iter()
        .map(|(k, v)| {
            let keep = k.ends_with("A_log") || k.ends_with("dt_bias") || k.contains("e_score_correction_bias");
            let v = if keep { v } else { v.astype(Dtype::BF16).unwrap() };
            (format!("language_model.{k}"), v)
        })
        .collect();
    let refs: Vec<(&str, &Array)> = cast.iter().map(|(k, v)| (k.as_str(), v)).collect();
    save_safetensors(dir.join("model.safetensors"), &refs, &[("format", "mlx")]).unwrap();
}

/// Converts again with 1000-weight chunks (rows within experts, single experts of tiered stacks, a few rows
/// of each matrix) and checks that every file but the manifest (whose error sums add up in another order)
/// is byte-identical to `reference`, a conversion with the default chunk size.
#[track_caller]
fn check_chunking_changes_nothing(args: &[&str], reference: &Path) {
    let chunked = reference.with_extension("chunked");
    let mut a: Vec<&str> = args.to_vec();
    a.extend(["--to", chunked.to_str().unwrap(), "--chunk-params", "1000"]);
    let out = Command::new(bin()).args(&a).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (mut want, mut got) = (files(reference), files(&chunked));
    want.remove("k3_manifest.json");
    got.remove("k3_manifest.json");
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (name, bytes) in &want {
        assert!(got[name] == *bytes, "{name} differs when converted in small chunks");
    }
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect()
}

/// What a killed run may leave: shards under their final names are complete; config.json only with a manifest.
fn check_no_half_file(dir: &Path) {
    if !dir.exists() {
        return;
    }
    for (name, _) in files(dir) {
        if name.starts_with("model") && name.ends_with(".safetensors") {
            mlx_k3::model::loader::validate_safetensors(&dir.join(&name))
                .unwrap_or_else(|e| panic!("{name} looks complete but is not: {e}"));
        }
    }
    if dir.join("config.json").exists() {
        assert!(dir.join("model.safetensors.index.json").exists(), "config.json written before the index");
    }
}

#[test]
fn conversion_killed_at_random_points_resumes_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    random_checkpoint(&src, 4, 11);
    let recipe = write_recipe(
        tmp.path(),
        "r.toml",
        "[default]\nformat = \"affine\"\nbits = 2\ngroup_size = 32\nclip_search = true\n\
         [classes.routed_experts]\nformat = \"codebook\"\n[classes.embeddings]\nformat = \"affine\"\nbits = 4\ngroup_size = 64\n",
    );
    let args = |to: &Path| -> Vec<String> {
        ["convert", "--from", src.to_str().unwrap(), "--to", to.to_str().unwrap(), "--recipe", &recipe, "--quiet"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    let reference = tmp.path().join("reference");
    let t0 = Instant::now();
    let out = Command::new(bin()).args(args(&reference)).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let full = t0.elapsed();
    let want = files(&reference);
    println!("uninterrupted conversion: {:.2} s, {} files", full.as_secs_f64(), want.len());
    // Kill points spread over the run (a fixed LCG: the test is reproducible); the first folder is killed
    // three times before it is allowed to finish.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) as f64 / (1u64 << 31) as f64
    };
    let mut kills_mid_run = 0;
    for trial in 0..5 {
        let dir = tmp.path().join(format!("killed{trial}"));
        let kills = if trial == 0 { 3 } else { 1 };
        for _ in 0..kills {
            let delay = full.mul_f64(0.05 + 0.9 * next());
            let mut child =
                Command::new(bin()).args(args(&dir)).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
            std::thread::sleep(delay);
            let finished = child.try_wait().unwrap().is_some();
            child.kill().ok(); // SIGKILL
            child.wait().unwrap();
            if !finished {
                kills_mid_run += 1;
            }
            check_no_half_file(&dir);
        }
        let out = Command::new(bin()).args(args(&dir)).output().unwrap();
        assert!(out.status.success(), "resume {trial}: {}", String::from_utf8_lossy(&out.stderr));
        let got = files(&dir);
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "trial {trial}: file set");
        for (name, bytes) in &want {
            assert!(got[name] == *bytes, "trial {trial}: {name} differs from the uninterrupted run");
        }
    }
    assert!(kills_mid_run >= 4, "only {kills_mid_run} kills landed mid-run");
    // A finished folder is recognized and left alone.
    let out = run_ok(&args(&reference).iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.contains("0 of"), "{out}");
    assert_eq!(files(&reference), want);
}

#[test]
fn bad_input_fails_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let n = nano();
    let n = n.to_str().unwrap();
    let cases: Vec<(&str, String, &str)> = vec![
        ("typo.toml", "[default]\nformat = \"affine\"\nbitz = 4\n".into(), "bitz"),
        ("class.toml", "[classes.experts]\nformat = \"affine\"\n".into(), "unknown tensor class 'experts'"),
        ("mode.toml", "[classes.router]\nformat = \"affine7\"\n".into(), "unknown format 'affine7'"),
        ("bits.toml", "[classes.router]\nformat = \"affine\"\nbits = 7\n".into(), "affine bits 7"),
        (
            "codebook.toml",
            "[classes.mla]\nformat = \"codebook\"\n".into(),
            "MLA head matrices must be dense or MLX-quantized",
        ),
        (
            "group.toml",
            "[classes.kda]\nformat = \"affine\"\nbits = 4\ngroup_size = 64\n".into(),
            "K = 32 is not a multiple of group_size 64",
        ),
        (
            "tiers.toml",
            "[classes.routed_experts]\nformat = \"tiered\"\n[tiers]\nlow = { format = \"affine\", bits = 2, group_size = 32 }\nhigh = { format = \"mxfp4\" }\npromote = 8\n".into(),
            "--calib",
        ),
    ];
    for (file, text, expect) in &cases {
        let recipe = write_recipe(tmp.path(), file, text);
        let to = tmp.path().join(format!("out-{file}"));
        let (ok, _, err) = run(&["convert", "--from", n, "--to", to.to_str().unwrap(), "--recipe", &recipe]);
        assert!(!ok, "{file} was accepted");
        assert!(err.contains(expect), "{file}: error does not say '{expect}':\n{err}");
        assert_eq!(err.trim().lines().count(), 1, "{file}: {err}");
        assert!(!to.exists(), "{file}: output written despite the error");
    }
    // Calibration data shorter than one window, and more windows than the data holds.
    let short = tmp.path().join("short.safetensors");
    let t = Array::from_slice(&[1i32, 2, 3, 4, 5], &[5]).unwrap();
    save_safetensors(&short, &[("tokens", &t)], &[]).unwrap();
    let out = tmp.path().join("calib.safetensors");
    let (ok, _, err) = run(&[
        "calibrate",
        "--model",
        n,
        "--data",
        short.to_str().unwrap(),
        "--ctx",
        "64",
        "--windows",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("short.safetensors") && err.contains("shorter than one window"), "{err}");
    assert!(!out.exists());
    let (ok, _, err) = run(&[
        "calibrate",
        "--model",
        n,
        "--data",
        &heldout(),
        "--ctx",
        "256",
        "--windows",
        "300",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("holds 214 windows of 256 tokens"), "{err}");
    assert!(!out.exists());
    // An output folder holding something else is refused.
    let other = tmp.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "mine").unwrap();
    let recipe = write_recipe(tmp.path(), "ok.toml", "[default]\nformat = \"affine\"\nbits = 8\ngroup_size = 32\n");
    let (ok, _, err) = run(&["convert", "--from", n, "--to", other.to_str().unwrap(), "--recipe", &recipe]);
    assert!(!ok && err.contains("not empty"), "{err}");
    assert_eq!(files(&other).len(), 1);
}

/// `(tokens, windows)` for quick runs: 64-token windows of the held-out split.
fn calibrate_nano(dir: &Path, windows: usize, skip: usize) -> PathBuf {
    let out = dir.join(format!("calib-{windows}-{skip}.safetensors"));
    run_ok(&[
        "calibrate",
        "--model",
        nano().to_str().unwrap(),
        "--data",
        &heldout(),
        "--ctx",
        "64",
        "--windows",
        &windows.to_string(),
        "--skip",
        &skip.to_string(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ]);
    out
}

#[test]
fn reap_pruned_model_equals_the_original_with_dropped_experts_masked() {
    let tmp = tempfile::tempdir().unwrap();
    let stats = calibrate_nano(tmp.path(), 6, 400);
    let pruned = tmp.path().join("pruned");
    let report = run_ok(&[
        "prune",
        "--model",
        nano().to_str().unwrap(),
        "--keep",
        "10",
        "--stats",
        stats.to_str().unwrap(),
        "--to",
        pruned.to_str().unwrap(),
        "--json",
        "--quiet",
    ]);
    let report: Value = serde_json::from_str(&report).unwrap();
    // Retained mass recomputed here from the statistics file's counts.
    let st = Safetensors::load(&stats).unwrap();
    let tokens: f64 =
        serde_json::from_str::<Value>(&st.metadata()["k3_calibration"]).unwrap()["tokens"].as_f64().unwrap();
    let mut masked: BTreeMap<String, Array> =
        Safetensors::load(nano().join("model.safetensors")).unwrap().arrays().unwrap();
    for layer in report["layers"].as_array().unwrap() {
        let l = layer["layer"].as_u64().unwrap();
        let kept: Vec<usize> = layer["kept"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        assert_eq!(kept.len(), 10);
        let counts = st.get(&format!("model.layers.{l}.mlp.routing.counts")).unwrap().to_vec::<f32>().unwrap();
        let reap = st.get(&format!("model.layers.{l}.mlp.routing.reap")).unwrap().to_vec::<f32>().unwrap();
        // The kept set is the 10 highest REAP saliencies.
        let min_kept = kept.iter().map(|&e| reap[e]).fold(f32::INFINITY, f32::min);
        assert!((0..16).filter(|e| !kept.contains(e)).all(|e| reap[e] <= min_kept), "layer {l}");
        let want: f64 = kept.iter().map(|&e| counts[e] as f64 / tokens).sum::<f64>() / 4.0;
        let got = layer["retained_mass"]["reap"].as_f64().unwrap();
        assert!((want - got).abs() < 1e-9, "layer {l}: retained mass {got} vs {want}");
        let mut sorted: Vec<f64> = counts.iter().map(|&c| c as f64 / tokens).collect();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let ideal: f64 = sorted[..10].iter().sum::<f64>() / 4.0;
        assert!((layer["retained_mass"]["ideal"].as_f64().unwrap() - ideal).abs() < 1e-9);
        assert!(
            got <= ideal + 1e-12 && (layer["retained_mass"]["random"].as_f64().unwrap() - 10.0 / 16.0).abs() < 1e-12
        );
        // Mask the dropped experts in a copy of the original: a bias no sigmoid score can overcome.
        let key = format!("language_model.model.layers.{l}.mlp.e_score_correction_bias");
        let mut b = masked[&key].to_vec::<f32>().unwrap();
        for (e, v) in b.iter_mut().enumerate() {
            if !kept.contains(&e) {
                *v = -1e9;
            }
        }
        masked.insert(key, Array::from_slice(&b, &[16]).unwrap());
    }
    let mdir = tmp.path().join("masked");
    std::fs::create_dir_all(&mdir).unwrap();
    std::fs::copy(nano().join("config.json"), mdir.join("config.json")).unwrap();
    let refs: Vec<(&str, &Array)> = masked.iter().map(|(k, v)| (k.as_str(), v)).collect();
    save_safetensors(mdir.join("model.safetensors"), &refs, &[("format", "mlx")]).unwrap();
    let ids: Vec<i32> = Safetensors::load(nano().join("eval_reference.safetensors"))
        .unwrap()
        .get("tokens")
        .unwrap()
        .slice_axis(0, 3, 4)
        .unwrap()
        .reshape(&[-1])
        .unwrap()
        .to_vec::<i32>()
        .unwrap()[..96]
        .to_vec();
    let (a, b) = (logits(&load(&pruned), &ids), logits(&load(&mdir), &ids));
    let e = rel(&a, &b);
    println!(
        "pruned (10 of 16) vs masked original: rel err {e:.2e}; mean retained mass {}",
        report["retained_mass_mean"]
    );
    assert!(e < 1e-5, "rel err {e}");
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(pruned.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["text_config"]["num_experts"], 10);
}

#[test]
fn tiers_calibration_retier_and_eval_are_reproducible() {
    let tmp = tempfile::tempdir().unwrap();
    let calib = calibrate_nano(tmp.path(), 4, 400);
    let profile = calibrate_nano(tmp.path(), 4, 600);
    // Calibration is deterministic: the same run gives the same bytes.
    let again = tmp.path().join("again");
    std::fs::create_dir_all(&again).unwrap();
    let calib2 = calibrate_nano(&again, 4, 400);
    assert_eq!(std::fs::read(&calib).unwrap(), std::fs::read(&calib2).unwrap());
    let recipe = write_recipe(
        tmp.path(),
        "tiers.toml",
        "[default]\nformat = \"affine\"\nbits = 4\ngroup_size = 32\n[classes.routed_experts]\nformat = \"tiered\"\n\
         [tiers]\nlow = { format = \"codebook\", fallback = { format = \"affine\", bits = 2, group_size = 32 } }\n\
         high = { format = \"mxfp4\" }\npromote = 12\nmax_per_layer = 4\n",
    );
    let tiered = tmp.path().join("tiered");
    let out = run_ok(&[
        "convert",
        "--from",
        nano().to_str().unwrap(),
        "--to",
        tiered.to_str().unwrap(),
        "--recipe",
        &recipe,
        "--calib",
        calib.to_str().unwrap(),
        "--json",
        "--quiet",
    ]);
    check_chunking_changes_nothing(
        &[
            "convert",
            "--from",
            nano().to_str().unwrap(),
            "--recipe",
            &recipe,
            "--calib",
            calib.to_str().unwrap(),
            "--quiet",
        ],
        &tiered,
    );
    let out: Value = serde_json::from_str(&out).unwrap();
    let plan = &out["tier_plan"]["promoted"];
    let counts: Vec<usize> = plan.as_object().unwrap().values().map(|v| v.as_array().unwrap().len()).collect();
    assert_eq!(counts.iter().sum::<usize>(), 12);
    assert!(counts.iter().all(|&c| c <= 4), "{counts:?}");
    // Re-tiering for another profile keeps every layer's count, and the size.
    let re = tmp.path().join("retiered");
    let r = run_ok(&[
        "retier",
        "--model",
        tiered.to_str().unwrap(),
        "--from",
        nano().to_str().unwrap(),
        "--profile",
        profile.to_str().unwrap(),
        "--calib",
        calib.to_str().unwrap(),
        "--to",
        re.to_str().unwrap(),
        "--json",
        "--quiet",
    ]);
    let r: Value = serde_json::from_str(&r).unwrap();
    let new_counts: Vec<usize> =
        r["tier_plan"]["promoted"].as_object().unwrap().values().map(|v| v.as_array().unwrap().len()).collect();
    assert_eq!(new_counts, counts);
    assert_eq!(r["classes"]["routed_experts"]["bytes"], out["classes"]["routed_experts"]["bytes"]);
    // Evaluation repeats exactly (report files byte-identical), with a cached teacher.
    let cache = tmp.path().join("teacher.safetensors");
    let h = heldout();
    let n = nano();
    let eval = |model: &Path, out: &Path, extra: &[&str]| {
        let mut a = vec![
            "eval",
            "kl",
            "--model",
            model.to_str().unwrap(),
            "--data",
            &h,
            "--ctx",
            "64",
            "--windows",
            "3",
            "--out",
            out.to_str().unwrap(),
            "--quiet",
        ];
        a.extend_from_slice(extra);
        run_ok(&a);
        std::fs::read(out).unwrap()
    };
    let e1 = eval(
        &tiered,
        &tmp.path().join("e1.json"),
        &["--teacher", n.to_str().unwrap(), "--save-teacher-logits", cache.to_str().unwrap()],
    );
    let e2 = eval(&tiered, &tmp.path().join("e2.json"), &["--teacher", n.to_str().unwrap()]);
    assert_eq!(e1, e2, "exact-KL evaluation is not reproducible");
    let c1 = eval(&tiered, &tmp.path().join("c1.json"), &["--teacher-logits", cache.to_str().unwrap()]);
    let c2 = eval(&tiered, &tmp.path().join("c2.json"), &["--teacher-logits", cache.to_str().unwrap()]);
    assert_eq!(c1, c2, "cached-teacher evaluation is not reproducible");
    let exact: Value = serde_json::from_slice(&e1).unwrap();
    let cached: Value = serde_json::from_slice(&c1).unwrap();
    // The same numbers computed here directly from both models' full logits on the same windows.
    let tokens =
        Safetensors::load(nano().join("heldout.safetensors")).unwrap().get("tokens").unwrap().to_vec::<i32>().unwrap();
    let (teacher, build) = (load(&nano()), load(&tiered));
    let vocab = teacher.config().vocab_size;
    let (mut kl_sum, mut flips, mut nll, mut positions) = (0f64, 0usize, 0f64, 0usize);
    for w in tokens.chunks_exact(64).take(3) {
        let (p, q) = (logits(&teacher, &w[..63]), logits(&build, &w[..63]));
        kl_sum += mean_kl(&p, &q, vocab) * 63.0;
        let argmax = |r: &[f32]| r.iter().enumerate().fold(0, |b, (i, v)| if *v > r[b] { i } else { b });
        for t in 0..63 {
            let (pr, qr) = (&p[t * vocab..(t + 1) * vocab], &q[t * vocab..(t + 1) * vocab]);
            flips += usize::from(argmax(pr) != argmax(qr));
            let m = qr.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let lse = m + qr.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            nll += lse - qr[w[t + 1] as usize] as f64;
        }
        positions += 63;
    }
    let (kl_direct, flip_direct, ppl_direct) =
        (kl_sum / positions as f64, flips as f64 / positions as f64, (nll / positions as f64).exp());
    let ke = exact["kl_mean"].as_f64().unwrap();
    println!("tiered build: eval KL {ke:.6} (direct {kl_direct:.6}), flips {} (direct {flip_direct}), ppl {} (direct {ppl_direct})",
        exact["top1_flip_rate"], exact["ppl"]);
    assert!(ke > 1e-4, "a 2-bit/mxfp4 build cannot match the teacher exactly: KL {ke}");
    assert!((ke - kl_direct).abs() < 1e-4 * kl_direct + 1e-7, "KL {ke} vs direct {kl_direct}");
    assert_eq!(exact["top1_flip_rate"].as_f64().unwrap(), flip_direct);
    assert!((exact["ppl"].as_f64().unwrap() / ppl_direct - 1.0).abs() < 1e-5);
    // The top-k cache gives a lower bound of the exact KL; flips and perplexity are the same numbers.
    let kc = cached["kl_mean"].as_f64().unwrap();
    println!("tiered build: exact KL {ke:.5}, cached top-64 KL {kc:.5}");
    assert!(kc <= ke + 1e-9 && kc > 0.5 * ke, "{kc} vs {ke}");
    assert_eq!(exact["top1_flip_rate"], cached["top1_flip_rate"]);
    assert_eq!(exact["ppl"], cached["ppl"]);
    // The teacher against itself: KL 0 and no flips, exactly and from the cache.
    for extra in [vec!["--teacher", n.to_str().unwrap()], vec!["--teacher-logits", cache.to_str().unwrap()]] {
        let s: Value = serde_json::from_slice(&eval(&n, &tmp.path().join("self.json"), &extra)).unwrap();
        assert!(s["kl_mean"].as_f64().unwrap().abs() < 1e-6 && s["kl_p99"].as_f64().unwrap().abs() < 1e-5, "{s}");
        assert_eq!(s["top1_flip_rate"], 0.0, "{s}");
        assert_eq!(s["ppl"], s["teacher_ppl"], "{s}");
    }
    // Windows other than the cache's are refused.
    let (ok, _, err) = run(&[
        "eval",
        "kl",
        "--model",
        tiered.to_str().unwrap(),
        "--data",
        &heldout(),
        "--ctx",
        "64",
        "--windows",
        "2",
        "--teacher-logits",
        cache.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("other windows"), "{err}");
}

/// `[rows, cols]` f32 values of a k3-nano tensor.
fn nano_tensor(st: &Safetensors, name: &str) -> Vec<f64> {
    let a = st.get(&format!("language_model.{name}")).unwrap();
    a.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap().into_iter().map(f64::from).collect()
}

/// `y = W x` for a row-major `[n, k]` W.
fn matvec(w: &[f64], x: &[f64], n: usize) -> Vec<f64> {
    let k = x.len();
    (0..n).map(|r| w[r * k..(r + 1) * k].iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

#[test]
fn calibration_routing_statistics_and_reap_saliency_match_a_direct_computation() {
    let tmp = tempfile::tempdir().unwrap();
    let stats = calibrate_nano(tmp.path(), 1, 410);
    let st = Safetensors::load(&stats).unwrap();
    // The MoE inputs of the same 63 tokens, captured from the model's forward pass; everything after that is
    // recomputed here in f64 from the checkpoint's weights (docs/formats.md#moe-router to #situ, #reap-expert-pruning): sigmoid scores, top-4 of
    // score + bias, weights renormalized over the chosen four, latent down-projection, SiTU experts.
    let tokens =
        Safetensors::load(nano().join("heldout.safetensors")).unwrap().get("tokens").unwrap().to_vec::<i32>().unwrap();
    let ids = &tokens[410 * 64..410 * 64 + 63];
    let model = load(&nano());
    let inputs: std::rc::Rc<std::cell::RefCell<BTreeMap<usize, Vec<f32>>>> = Default::default();
    let sink = inputs.clone();
    mlx_k3::model::probe::with_tap(
        move |path: &str, x: &Array| {
            if let Some(l) = path.strip_prefix("model.layers.").and_then(|p| p.strip_suffix(".mlp.gate")) {
                sink.borrow_mut().insert(l.parse().unwrap(), x.astype(Dtype::F32)?.to_vec::<f32>()?);
            }
            Ok(())
        },
        || model.forward(&Array::from_slice(ids, &[1, 63]).unwrap(), None)?.eval(),
    )
    .unwrap();
    let w = Safetensors::load(nano().join("model.safetensors")).unwrap();
    let (e, top_k, d, lat, inter) = (16, 4, 256, 128, 32);
    let situ = |u: f64, g: f64| (2.0 * (g / 2.0).tanh() / (1.0 + (-g).exp())) * (4.0 * (u / 4.0).tanh());
    let inputs = inputs.borrow();
    assert_eq!(inputs.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3, 4, 5]);
    for (&l, x) in inputs.iter() {
        let p = format!("model.layers.{l}.mlp");
        let (gate, bias) =
            (nano_tensor(&w, &format!("{p}.gate.weight")), nano_tensor(&w, &format!("{p}.e_score_correction_bias")));
        let ld = nano_tensor(&w, &format!("{p}.routed_expert_down_proj.weight"));
        let up = nano_tensor(&w, &format!("{p}.switch_mlp.up_proj.weight"));
        let gt = nano_tensor(&w, &format!("{p}.switch_mlp.gate_proj.weight"));
        let down = nano_tensor(&w, &format!("{p}.switch_mlp.down_proj.weight"));
        let (mut counts, mut mass, mut reap) = (vec![0f64; e], vec![0f64; e], vec![0f64; e]);
        for t in 0..63 {
            let xt: Vec<f64> = x[t * d..(t + 1) * d].iter().map(|&v| v as f64).collect();
            let s: Vec<f64> = matvec(&gate, &xt, e).iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| (s[b] + bias[b]).total_cmp(&(s[a] + bias[a])));
            let chosen = &order[..top_k];
            let norm: f64 = chosen.iter().map(|&j| s[j]).sum();
            let z = matvec(&ld, &xt, lat);
            for &j in chosen {
                let g = s[j] / norm;
                let u = matvec(&up[j * inter * lat..(j + 1) * inter * lat], &z, inter);
                let a = matvec(&gt[j * inter * lat..(j + 1) * inter * lat], &z, inter);
                let h: Vec<f64> = u.iter().zip(&a).map(|(&u, &a)| situ(u, a)).collect();
                let f = matvec(&down[j * lat * inter..(j + 1) * lat * inter], &h, lat);
                counts[j] += 1.0;
                mass[j] += g;
                reap[j] += g * f.iter().map(|v| v * v).sum::<f64>().sqrt();
            }
        }
        let got = |k: &str| st.get(&format!("{p}.routing.{k}")).unwrap().to_vec::<f32>().unwrap();
        let (c, m, r) = (got("counts"), got("gate_mass"), got("reap"));
        for j in 0..e {
            assert_eq!(c[j] as f64, counts[j], "layer {l} expert {j}: selections");
            assert!(
                (m[j] as f64 - mass[j]).abs() < 1e-4 * (1.0 + mass[j]),
                "layer {l} expert {j}: gate mass {} vs {}",
                m[j],
                mass[j]
            );
            let want = if counts[j] > 0.0 { reap[j] / counts[j] } else { 0.0 };
            assert!((r[j] as f64 - want).abs() < 1e-3 * want + 1e-6, "layer {l} expert {j}: REAP {} vs {want}", r[j]);
        }
        println!("layer {l}: counts {counts:?}");
    }
}

#[test]
fn calibration_killed_after_a_checkpoint_resumes_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let args = |out: &Path| -> Vec<String> {
        let n = nano();
        [
            "calibrate",
            "--model",
            n.to_str().unwrap(),
            "--data",
            &heldout(),
            "--ctx",
            "64",
            "--windows",
            "12",
            "--skip",
            "300",
            "--checkpoint-every",
            "3",
            "--out",
            out.to_str().unwrap(),
            "--quiet",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let reference = tmp.path().join("reference.safetensors");
    run_ok(&args(&reference).iter().map(String::as_str).collect::<Vec<_>>());
    let out = tmp.path().join("killed.safetensors");
    let partial = tmp.path().join("killed.safetensors.partial");
    let mut child = Command::new(bin()).args(args(&out)).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    // Kill it as soon as its first saved checkpoint appears (the saves are atomic: the file is complete).
    while !partial.exists() && child.try_wait().unwrap().is_none() {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().ok();
    child.wait().unwrap();
    assert!(partial.exists() && !out.exists(), "the run finished before it could be killed mid-way");
    run_ok(&args(&out).iter().map(String::as_str).collect::<Vec<_>>());
    assert!(std::fs::read(&out).unwrap() == std::fs::read(&reference).unwrap(), "resumed calibration differs");
    assert!(!partial.exists(), "the checkpoint file is left behind");
}

#[test]
fn release_named_checkpoint_converts_to_mlx_names_with_the_same_logits() {
    // Fixture d under the release's tensor names (per-expert w1/w2/w3, fused kv_b_proj): converted with every
    // tensor kept float32, the output is in mlx-lm's names (stacked experts, split kv_b) and computes what the
    // source computes, and what mlx-lm computed for it (expected.safetensors).
    let tmp = tempfile::tempdir().unwrap();
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/k3/d_latent_norm_attnres_untied_release");
    let recipe = write_recipe(tmp.path(), "f32.toml", "dtype = \"float32\"\n");
    let out = tmp.path().join("out");
    run_ok(&[
        "convert",
        "--from",
        src.to_str().unwrap(),
        "--to",
        out.to_str().unwrap(),
        "--recipe",
        &recipe,
        "--quiet",
    ]);
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap()).unwrap();
    let names: Vec<&String> = index["weight_map"].as_object().unwrap().keys().collect();
    assert!(names.iter().any(|n| n.ends_with(".mlp.switch_mlp.up_proj.weight")), "{names:?}");
    assert!(!names.iter().any(|n| n.contains(".experts.0.") || n.contains("kv_b_proj")), "{names:?}");
    let expected = Safetensors::load(src.join("expected.safetensors")).unwrap();
    let prompt = expected.get("prompt").unwrap().to_vec::<i32>().unwrap();
    let want = expected.get("prefill_logits").unwrap().to_vec::<f32>().unwrap();
    let (a, b) = (logits(&load(&src), &prompt), logits(&load(&out), &prompt));
    assert_eq!(a, b, "converted float32 checkpoint computes other logits than its source");
    let e = rel(&b, &want);
    println!("release fixture d converted: rel err vs mlx-lm {e:.2e}");
    // The bound of tests/model.rs (f32 logits within 1e-4 of the largest reference logit): the same model,
    // and its fp32 summation orders (the fused kernels') move this figure between ~7e-6 and ~1.1e-5.
    assert!(e <= 1e-4, "rel err {e}");
}

fn k3_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/k3").join(name)
}

/// Fixture a laid out like the real release: routed experts in compressed-tensors MXFP4 (per-expert
/// `weight_packed` / `weight_scale`), every other weight bf16, the release's `quantization_config`.
const BF16_RELEASE: &str = "a_latent_norm_attnres_bf16_mxfp4_release";
/// Its MoE layers and experts per layer, and the release names of the three projections.
const RELEASE_MOE_LAYERS: [usize; 2] = [1, 2];
const RELEASE_EXPERTS: usize = 8;
const RELEASE_PROJ: [(&str, &str); 3] = [("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")];

/// The fixture's prompt and its 16 greedy decode tokens, and mlx-lm's logits for them (cache-less forward).
fn release_tokens(src: &Path) -> (Vec<i32>, Vec<i32>, Vec<f32>) {
    let exp = Safetensors::load(src.join("expected.safetensors")).unwrap();
    let prompt = exp.get("prompt").unwrap().to_vec::<i32>().unwrap();
    let mut all = prompt.clone();
    all.extend(exp.get("decode_tokens").unwrap().to_vec::<i32>().unwrap());
    (prompt, all, exp.get("full_logits").unwrap().to_vec::<f32>().unwrap())
}

/// Expert stack `w` (w1/w2/w3) of MoE layer `l` as the release stores it, stacked here by hand from the
/// per-expert tensors (not through the loader): uint8 code pairs viewed as uint32 words, uint8 E8M0 scales.
fn release_stack(st: &Safetensors, l: usize, w: &str) -> quant::Quantized {
    let stack = |leaf: &str| {
        let parts: Vec<Array> = (0..RELEASE_EXPERTS)
            .map(|e| {
                st.get(&format!("language_model.model.layers.{l}.block_sparse_moe.experts.{e}.{w}.{leaf}")).unwrap()
            })
            .collect();
        mlx_k3::ops::stack(&parts.iter().collect::<Vec<_>>(), 0).unwrap()
    };
    quant::Quantized {
        weight: stack("weight_packed").view(Dtype::U32).unwrap(),
        scales: stack("weight_scale"),
        biases: None,
    }
}

/// Tensor `name` of a converted folder (found through its index).
fn output_tensor(dir: &Path, name: &str) -> Array {
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    let file = index["weight_map"][name].as_str().unwrap_or_else(|| panic!("{name} is not in the output"));
    Safetensors::load(dir.join(file)).unwrap().get(name).unwrap()
}

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Per-class reports of a converted folder's manifest.
fn manifest_classes(dir: &Path) -> Value {
    let m: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("k3_manifest.json")).unwrap()).unwrap();
    m["classes"].clone()
}

#[test]
fn release_mxfp4_experts_convert_losslessly_and_bf16_modules_stay_exact() {
    // The release layout converted with routed experts kept MXFP4 and everything else float (bf16, the
    // recipe's dtype): the experts decode to exactly the release's values and the model computes exactly
    // the logits of the release itself.
    let tmp = tempfile::tempdir().unwrap();
    let src = k3_fixture(BF16_RELEASE);
    let recipe =
        write_recipe(tmp.path(), "mxfp4.toml", "dtype = \"bfloat16\"\n[classes.routed_experts]\nformat = \"mxfp4\"\n");
    let out = tmp.path().join("out");
    run_ok(&[
        "convert",
        "--from",
        src.to_str().unwrap(),
        "--to",
        out.to_str().unwrap(),
        "--recipe",
        &recipe,
        "--quiet",
    ]);

    let st = Safetensors::load(src.join("model.safetensors")).unwrap();
    let spec = QuantSpec::default_for(QuantMode::Mxfp4);
    let (mut groups, mut rescaled) = (0usize, 0usize);
    for l in RELEASE_MOE_LAYERS {
        for (w, proj) in RELEASE_PROJ {
            let want = release_stack(&st, l, w);
            let name = format!("language_model.model.layers.{l}.mlp.switch_mlp.{proj}");
            let got = quant::Quantized {
                weight: output_tensor(&out, &format!("{name}.weight")),
                scales: output_tensor(&out, &format!("{name}.scales")),
                biases: None,
            };
            assert_eq!((got.weight.shape(), got.weight.dtype()), (want.weight.shape(), Dtype::U32), "{name}");
            assert_eq!((got.scales.shape(), got.scales.dtype()), (want.scales.shape(), Dtype::U8), "{name}");
            let decode = |q: &quant::Quantized| {
                quant::dequantize(q, spec, None, Some(Dtype::F32)).unwrap().to_vec::<f32>().unwrap()
            };
            assert!(
                bits_of(&decode(&got)) == bits_of(&decode(&want)),
                "{name}: decoded experts differ from the release's"
            );
            // Re-encoding picks the smallest E8M0 exponent that holds a group (MLX's rule), so a group whose
            // largest code is at most 3 comes back one or more exponents lower with its codes doubled: the
            // same values, never a larger exponent.
            let (sw, sg) = (want.scales.to_vec::<u8>().unwrap(), got.scales.to_vec::<u8>().unwrap());
            assert!(sw.iter().zip(&sg).all(|(a, b)| b <= a), "{name}: a group got a larger exponent");
            groups += sw.len();
            rescaled += sw.iter().zip(&sg).filter(|(a, b)| a != b).count();
        }
    }
    println!(
        "release MXFP4 experts: decoded bit for bit; {rescaled} of {groups} groups stored with a smaller exponent \
         and doubled codes"
    );
    // Every other module is float and unchanged: bf16 in, bf16 out, no error anywhere.
    let classes = manifest_classes(&out);
    for (class, c) in classes.as_object().unwrap() {
        assert_eq!(c["rel_err"].as_f64(), Some(0.0), "{class}: {c}");
        let bpw = if class == "routed_experts" { 4.25 } else { 16.0 };
        assert_eq!(c["bpw"].as_f64(), Some(bpw), "{class}: {c}");
    }
    let config: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    let q = config["quantization"].as_object().unwrap();
    assert_eq!(q.len(), 3 + 6, "defaults + the six expert stacks: {q:?}");
    assert!(config["text_config"].get("quantization_config").is_none(), "the release's record is left behind");

    // Same bf16 values, same activations: the logits are equal, not merely close (a halved scale times doubled
    // codes gives exactly the same products, so every sum is the same).
    let (_, tokens, mlx_lm) = release_tokens(&src);
    let (a, b) = (logits(&load(&src), &tokens), logits(&load(&out), &tokens));
    assert!(bits_of(&a) == bits_of(&b), "converted logits differ from the release's: rel {:.2e}", rel(&b, &a));
    let e = rel(&b, &mlx_lm);
    println!("release MXFP4 -> MXFP4 experts: logits equal the release's; rel err vs mlx-lm {e:.2e}");
    assert!(e < 1e-4, "rel err vs mlx-lm {e}");
}

#[test]
fn release_mxfp4_experts_requantized_to_affine_match_mlx_and_mlx_lm_reads_them() {
    // The release's MXFP4 experts decoded and re-quantized: 8-, 4- and 2-bit affine (groups of 32, the
    // experts are 32 wide; 2-bit with the clip search), everything else bf16 as in the release.
    let tmp = tempfile::tempdir().unwrap();
    let src = k3_fixture(BF16_RELEASE);
    let (prompt, tokens, _) = release_tokens(&src);
    let release = load(&src);
    let teacher = logits(&release, &tokens);
    let vocab = release.config().vocab_size;
    let st = Safetensors::load(src.join("model.safetensors")).unwrap();
    let a2 = fixtures().join("release_experts_a2.toml").display().to_string();
    let affine = |bits: u32| format!("[classes.routed_experts]\nformat = \"affine\"\nbits = {bits}\ngroup_size = 32\n");
    let recipes = [
        ("a8", write_recipe(tmp.path(), "a8.toml", &affine(8))),
        ("a4", write_recipe(tmp.path(), "a4.toml", &affine(4))),
        ("a2", a2),
    ];
    let mut kls = Vec::new();
    for (name, recipe) in &recipes {
        let out = tmp.path().join(name);
        run_ok(&[
            "convert",
            "--from",
            src.to_str().unwrap(),
            "--to",
            out.to_str().unwrap(),
            "--recipe",
            recipe,
            "--quiet",
        ]);
        let experts = &manifest_classes(&out)["routed_experts"];
        let werr = experts["rel_err"].as_f64().unwrap();
        let got = logits(&load(&out), &tokens);
        let kl = mean_kl(&teacher, &got, vocab);
        let flips = teacher
            .chunks(vocab)
            .zip(got.chunks(vocab))
            .filter(|(t, g)| {
                let am = |r: &[f32]| r.iter().enumerate().fold(0, |b, (i, v)| if *v > r[b] { i } else { b });
                am(t) != am(g)
            })
            .count();
        println!(
            "release experts {name}: weight rel err {werr:.3e}, KL to the release {kl:.4} over {} tokens, {flips} \
             top-1 flips",
            tokens.len()
        );
        kls.push(kl);
        // Weight error: affine b-bit min-max on values spread over a group leaves ~(range / (2^b - 1))^2 / 12
        // per weight; measured 3.9e-5 / 7.4e-3 / 0.115 (0.143 without the clip search).
        let (max_werr, max_kl) = match *name {
            "a8" => (1e-4, 2e-3),
            "a4" => (1e-2, 0.2),
            _ => (0.125, 1.2),
        };
        assert!(werr < max_werr, "{name}: weight rel err {werr}");
        assert!(kl < max_kl, "{name}: KL {kl}");
        if *name == "a2" {
            assert!(werr < experts["minmax_rel_err"].as_f64().unwrap(), "the clip search must beat min-max: {experts}");
        }
        if *name == "a4" {
            // Min-max affine is MLX's quantize bit for bit: the stacks are exactly MLX's quantization of the
            // decoded release experts (rounded to bf16, which holds every E2M1 x 2^e value exactly).
            for l in RELEASE_MOE_LAYERS {
                for (w, proj) in RELEASE_PROJ {
                    let dec = quant::dequantize(
                        &release_stack(&st, l, w),
                        QuantSpec::default_for(QuantMode::Mxfp4),
                        None,
                        Some(Dtype::BF16),
                    )
                    .unwrap();
                    let want = quant::quantize(&dec, QuantSpec::affine(32, 4), None).unwrap();
                    let base = format!("language_model.model.layers.{l}.mlp.switch_mlp.{proj}");
                    let get = |s: &str| output_tensor(&out, &format!("{base}.{s}"));
                    assert_eq!(get("weight").to_vec::<u32>().unwrap(), want.weight.to_vec::<u32>().unwrap(), "{base}");
                    let f = |a: &Array| a.to_vec::<bf16>().unwrap();
                    assert_eq!(f(&get("scales")), f(&want.scales), "{base}");
                    assert_eq!(f(&get("biases")), f(&want.biases.clone().unwrap()), "{base}");
                }
            }
            // mlx-lm on the release with its experts re-quantized by MLX itself (committed fixture): the same
            // computation, up to f32 rounding (both run f32 activations over the same packed weights).
            let mlx_lm = Safetensors::load(fixtures().join("mlx_lm_release_requant4_logits.safetensors")).unwrap();
            let want = mlx_lm.get("logits").unwrap().to_vec::<f32>().unwrap();
            let e = rel(&logits(&load(&out), &prompt), &want);
            println!("release experts a4 vs mlx-lm re-quantizing the release itself: rel err {e:.2e}");
            assert!(e < 1e-4, "rel err {e}");
        }
        if *name == "a2" {
            // mlx-lm's own loader reads the output (committed fixture, scripts/compress/mlx_lm_logits.py).
            let st = Safetensors::load(fixtures().join("mlx_lm_release_a2_logits.safetensors")).unwrap();
            let recorded: BTreeMap<String, String> = serde_json::from_str(&st.metadata()["files_sha256"]).unwrap();
            for (file, sha) in &recorded {
                let bytes = std::fs::read(out.join(file)).unwrap();
                assert_eq!(
                    &mlx_k3::compress::store::sha256_hex(&bytes),
                    sha,
                    "{file} differs from the files the mlx-lm fixture was made from: regenerate it \
                     (scripts/compress/mlx_lm_logits.py)"
                );
            }
            let want = st.get("logits").unwrap().to_vec::<f32>().unwrap();
            let e = rel(&logits(&load(&out), &prompt), &want);
            println!("release experts a2 through mlx-lm vs mlx-k3: rel err {e:.2e}");
            assert!(e < 1e-4, "rel err {e}");
        }
    }
    assert!(kls[0] < kls[1] && kls[1] < kls[2], "fewer bits must cost more: {kls:?}");
}

#[test]
fn corrupt_release_expert_scales_fail_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let src = k3_fixture(BF16_RELEASE);
    let base = Safetensors::load(src.join("model.safetensors")).unwrap().arrays().unwrap();
    let scale = |e: usize| format!("language_model.model.layers.2.block_sparse_moe.experts.{e}.w2.weight_scale");
    let recipe =
        write_recipe(tmp.path(), "mxfp4.toml", "dtype = \"bfloat16\"\n[classes.routed_experts]\nformat = \"mxfp4\"\n");
    // A copy of the release with `edit` applied; `split` names the tensors moved to a second shard.
    let copy = |name: &str, edit: &dyn Fn(&mut BTreeMap<String, Array>), split: &[String]| -> PathBuf {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
        let mut t = base.clone();
        edit(&mut t);
        let second: BTreeMap<String, Array> = split.iter().map(|k| (k.clone(), t.remove(k).unwrap())).collect();
        for (file, part) in [("model-00001-of-00002.safetensors", &t), ("model-00002-of-00002.safetensors", &second)] {
            if !part.is_empty() {
                let refs: Vec<(&str, &Array)> = part.iter().map(|(k, v)| (k.as_str(), v)).collect();
                save_safetensors(dir.join(file), &refs, &[("format", "pt")]).unwrap();
            }
        }
        dir
    };
    let convert = |from: &Path, to: &Path| {
        run(&[
            "convert",
            "--from",
            from.to_str().unwrap(),
            "--to",
            to.to_str().unwrap(),
            "--recipe",
            &recipe,
            "--quiet",
        ])
    };
    let cat = |a: &Array| mlx_k3::ops::concatenate(&[a, a], 1).unwrap();
    let cases: Vec<(&str, PathBuf, Vec<&str>)> = vec![
        (
            "one expert's scales cut to half its rows",
            copy(
                "rows",
                &|t| {
                    let s = t[&scale(5)].slice_axis(0, 0, 16).unwrap();
                    t.insert(scale(5), s);
                },
                &[],
            ),
            vec!["tensor 'model.layers.2.block_sparse_moe.experts.5.w2.weight_scale' is uint8 [16, 1]", "[32, 1]"],
        ),
        (
            "every expert's scales in groups of 16",
            copy(
                "groups",
                &|t| {
                    for e in 0..RELEASE_EXPERTS {
                        let s = cat(&t[&scale(e)]);
                        t.insert(scale(e), s);
                    }
                },
                &[],
            ),
            vec!["'model.layers.2.block_sparse_moe.experts.*.w2.weight_scale'", "declares mxfp4 (groups of 32)"],
        ),
        (
            "a shard cut short inside the scales",
            copy("truncated", &|_| {}, &[scale(5)]),
            vec!["model-00002-of-00002.safetensors", "truncated: tensor", "experts.5.w2.weight_scale"],
        ),
    ];
    // Cut the second shard of the truncated copy inside its only tensor.
    let shard = tmp.path().join("truncated/model-00002-of-00002.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len - 8).unwrap();
    for (what, from, expect) in &cases {
        let to = tmp.path().join(format!("out-{}", from.file_name().unwrap().to_string_lossy()));
        let (ok, _, err) = convert(from, &to);
        assert!(!ok, "{what}: accepted");
        for e in expect {
            assert!(err.contains(e), "{what}: the error does not say '{e}':\n{err}");
        }
        assert_eq!(err.trim().lines().count(), 1, "{what}: {err}");
        assert!(!to.exists(), "{what}: output written despite the error");
        println!("{what}: {}", err.trim());
    }

    // A NaN scale byte (E8M0 0xFF) is only seen when its layer is read: the error names the tensor, and what
    // was written before it does not look like a checkpoint (no config.json, index or manifest; each shard
    // under its final name is complete); running again fails the same way.
    let nan = copy(
        "nan",
        &|t| {
            let mut bytes = t[&scale(5)].to_vec::<u8>().unwrap();
            bytes[7] = 0xFF;
            t.insert(scale(5), Array::from_slice(&bytes, &[32, 1]).unwrap());
        },
        &[],
    );
    let to = tmp.path().join("out-nan");
    for attempt in 0..2 {
        let (ok, _, err) = convert(&nan, &to);
        assert!(!ok, "NaN scale accepted");
        for e in [
            "'model.layers.2.mlp.switch_mlp.down_proj.scales' (from 'model.layers.2.block_sparse_moe.experts.*.w2.weight_scale')",
            "0xFF",
        ] {
            assert!(err.contains(e), "attempt {attempt}: the error does not say '{e}':\n{err}");
        }
        for f in ["config.json", "model.safetensors.index.json", "k3_manifest.json"] {
            assert!(!to.join(f).exists(), "{f} written despite the error");
        }
        check_no_half_file(&to);
        if attempt == 0 {
            println!("NaN scale: {}", err.trim());
        }
    }
}

#[test]
fn release_with_affine_modules_and_no_quantization_record_converts() {
    // The older release-named fixture also packs the modules its `ignore` list leaves alone as affine (4-bit
    // g32, router 8-bit g64), with no record of it. config.json's dimensions give each module's input size,
    // so bits (32 x words / inputs) and group size (inputs / scales) follow from the shapes without guessing.
    let tmp = tempfile::tempdir().unwrap();
    let src = k3_fixture("a_latent_norm_attnres_mxfp4_release");
    let recipe =
        write_recipe(tmp.path(), "f32.toml", "dtype = \"float32\"\n[classes.routed_experts]\nformat = \"mxfp4\"\n");
    let out = tmp.path().join("out");
    run_ok(&[
        "convert",
        "--from",
        src.to_str().unwrap(),
        "--to",
        out.to_str().unwrap(),
        "--recipe",
        &recipe,
        "--quiet",
    ]);
    // Affine values decode exactly into f32, MXFP4 experts re-encode losslessly.
    let classes = manifest_classes(&out);
    for (class, c) in classes.as_object().unwrap() {
        assert_eq!(c["rel_err"].as_f64(), Some(0.0), "{class}: {c}");
    }
    let exp = Safetensors::load(src.join("expected.safetensors")).unwrap();
    let prompt = exp.get("prompt").unwrap().to_vec::<i32>().unwrap();
    let (a, b) = (logits(&load(&src), &prompt), logits(&load(&out), &prompt));
    // The source runs affine quantized matmuls, the output dense f32 matmuls of the same values: f32
    // rounding apart (measured 3.0e-6).
    let e = rel(&b, &a);
    let e_lm = rel(&b, &exp.get("prefill_logits").unwrap().to_vec::<f32>().unwrap());
    println!("affine release modules decoded to f32: rel err {e:.2e} vs the source, {e_lm:.2e} vs mlx-lm");
    assert!(e < 1e-5 && e_lm < 1e-4, "rel err {e} / {e_lm}");

    // Scales that fit no packing of the configured input size are named, not guessed around.
    let dir = tmp.path().join("bad");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let mut t = Safetensors::load(src.join("model.safetensors")).unwrap().arrays().unwrap();
    let name = "language_model.model.embed_tokens.scales";
    let s = &t[name];
    let s = mlx_k3::ops::concatenate(&[s, &s.slice_axis(1, 0, 1).unwrap()], 1).unwrap();
    t.insert(name.into(), s);
    let refs: Vec<(&str, &Array)> = t.iter().map(|(k, v)| (k.as_str(), v)).collect();
    save_safetensors(dir.join("model.safetensors"), &refs, &[("format", "pt")]).unwrap();
    let to = tmp.path().join("out-bad");
    let (ok, _, err) = run(&[
        "convert",
        "--from",
        dir.to_str().unwrap(),
        "--to",
        to.to_str().unwrap(),
        "--recipe",
        &recipe,
        "--quiet",
    ]);
    assert!(!ok && err.contains("'model.embed_tokens.scales' (3 scales a row)") && err.contains("64 inputs"), "{err}");
    assert!(!to.exists());
}

fn ds3_fixture(name: &str) -> PathBuf {
    root().join("mlx-k3/tests/fixtures/deepseek_v3").join(name)
}

fn tensor_names(dir: &Path) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let file = p.file_name().unwrap().to_string_lossy().into_owned();
        if file.starts_with("model") && file.ends_with(".safetensors") {
            names.extend(Safetensors::load(&p).unwrap().keys());
        }
    }
    names
}

#[test]
fn deepseek_v3_conversions_use_mlx_lm_names() {
    // The Hugging Face-named kimi_k25 copy (per-expert tensors, kv_b_proj, an MTP layer, a vision tower)
    // converted losslessly (float32) must come out under exactly the names mlx-lm's save_model wrote for the
    // same model (c_kimi_k25), router bias under mlp.gate, and compute mlx-lm's logits (the bound of
    // mlx-k3/tests/deepseek_v3.rs). A flat deepseek_v3 one converted to 8 bits keeps mlx-lm's unprefixed
    // names and a float router (mlx-lm's MoEGate is not quantizable); its logits are compared with the float
    // model's loosely (8-bit weights on a tiny random model: measured 9e-2 of the largest logit, mlx-lm's own
    // logits on the same converted checkpoint agree with ours to 1e-5).
    let tmp = tempfile::tempdir().unwrap();
    let f32_recipe = write_recipe(tmp.path(), "f32.toml", "dtype = \"float32\"\n[default]\nformat = \"float\"\n");
    let out = tmp.path().join("k25");
    let from = ds3_fixture("c_kimi_k25_hf");
    run_ok(&["convert", "--from", from.to_str().unwrap(), "--to", out.to_str().unwrap(), "--recipe", &f32_recipe]);
    // The vision tower is carried through under its own names (mlx-lm's text-only save drops it).
    let (media, text): (std::collections::BTreeSet<String>, _) =
        tensor_names(&out).into_iter().partition(|n| mlx_k3::model::loader::is_media_tensor(n));
    let src_media: std::collections::BTreeSet<String> =
        tensor_names(&from).into_iter().filter(|n| mlx_k3::model::loader::is_media_tensor(n)).collect();
    assert!(!media.is_empty() && media == src_media, "{media:?} vs {src_media:?}");
    assert_eq!(text, tensor_names(&ds3_fixture("c_kimi_k25")));
    let st = Safetensors::load(ds3_fixture("c_kimi_k25").join("expected.safetensors")).unwrap();
    let prompt = st.get("prompt").unwrap().to_vec::<i32>().unwrap();
    let want = st.get("prefill_logits").unwrap().to_vec::<f32>().unwrap();
    let e = rel(&logits(&load(&out), &prompt), &want);
    assert!(e <= 1e-4, "lossless conversion: rel err {e} to mlx-lm");

    let q8 = write_recipe(
        tmp.path(),
        "q8.toml",
        "dtype = \"float32\"\n[default]\nformat = \"affine\"\nbits = 8\ngroup_size = 32\nfallback = { format = \"float\" }\n",
    );
    let out = tmp.path().join("q8");
    let from = ds3_fixture("a_yarn_grouped");
    run_ok(&["convert", "--from", from.to_str().unwrap(), "--to", out.to_str().unwrap(), "--recipe", &q8]);
    let names = tensor_names(&out);
    let base = tensor_names(&from);
    assert!(base.iter().all(|n| names.contains(n)), "every mlx-lm name kept: {:?}", base.difference(&names));
    assert!(names.contains("model.layers.1.mlp.gate.e_score_correction_bias"));
    assert!(names.contains("model.layers.1.mlp.switch_mlp.gate_proj.scales"));
    assert!(!names.iter().any(|n| n.starts_with("language_model.") || n == "model.layers.1.mlp.gate.scales"));
    let st = Safetensors::load(from.join("expected.safetensors")).unwrap();
    let prompt = st.get("prompt").unwrap().to_vec::<i32>().unwrap();
    let want = st.get("prefill_logits").unwrap().to_vec::<f32>().unwrap();
    let e = rel(&logits(&load(&out), &prompt), &want);
    println!("deepseek_v3 8-bit conversion: rel err {e:.2e} to the float model");
    assert!(e > 0.0 && e < 0.2, "8-bit conversion: rel err {e}");

    // Per-layer bits (Kimi K2.7 varies down_proj's): `[modules]` overrides the class's format for one path,
    // recorded per path in config.json as mlx-lm records it; a path the checkpoint lacks is refused by name.
    let per_layer = write_recipe(
        tmp.path(),
        "layers.toml",
        "dtype = \"float32\"\n[default]\nformat = \"affine\"\nbits = 8\ngroup_size = 32\nfallback = { format = \"float\" }\n\
         [modules]\n\"model.layers.1.mlp.switch_mlp.down_proj\" = { format = \"affine\", bits = 3, group_size = 32 }\n\
         \"model.layers.0.mlp.down_proj\" = { format = \"affine\", bits = 6, group_size = 32 }\n",
    );
    let out = tmp.path().join("layers");
    run_ok(&["convert", "--from", from.to_str().unwrap(), "--to", out.to_str().unwrap(), "--recipe", &per_layer]);
    let config: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    let q = &config["quantization"];
    assert_eq!(q["model.layers.1.mlp.switch_mlp.down_proj"]["bits"], 3, "{q}");
    assert_eq!(q["model.layers.0.mlp.down_proj"]["bits"], 6, "{q}");
    assert_eq!(q["model.layers.1.mlp.switch_mlp.up_proj"]["bits"], 8, "{q}");
    let st = Safetensors::load(out.join("model-00002-of-00003.safetensors")).unwrap();
    let packed = st.get("model.layers.1.mlp.switch_mlp.down_proj.weight").unwrap();
    // [E, N, K * bits / 32]: 8 experts, 32 outputs, 32 inputs at 3 bits = 3 words.
    assert_eq!(packed.shape(), vec![8, 32, 3]);
    let e3 = rel(&logits(&load(&out), &prompt), &want);
    assert!(e3.is_finite() && e3 < 0.5, "per-layer bits: rel err {e3}");
    let bad = write_recipe(
        tmp.path(),
        "bad.toml",
        "[default]\nformat = \"float\"\n[modules]\n\"model.layers.9.mlp.down_proj\" = { format = \"affine\", bits = 4 }\n",
    );
    let (ok, _, err) = run(&[
        "convert",
        "--from",
        from.to_str().unwrap(),
        "--to",
        tmp.path().join("bad").to_str().unwrap(),
        "--recipe",
        &bad,
    ]);
    assert!(!ok && err.contains("modules.model.layers.9.mlp.down_proj"), "{err}");
}

#[test]
fn deepseek_v3_perplexity_equals_mlx_lm_logits() {
    // `eval ppl` on one window (the fixture's prompt + greedy tokens, 28) against the perplexity computed
    // here in f64 from mlx-lm's cache-less logits of the same sequence. The engine's logits are within ~1e-5
    // of the largest logit (mlx-k3/tests/deepseek_v3.rs), which moves each log-probability by ~1e-4 at most;
    // 1e-3 relative on the perplexity allows that with margin (measured 3e-7).
    let tmp = tempfile::tempdir().unwrap();
    let dir = ds3_fixture("a_yarn_grouped");
    let st = Safetensors::load(dir.join("expected.safetensors")).unwrap();
    let prompt = st.get("prompt").unwrap().to_vec::<i32>().unwrap();
    let fed = st.get("decode_tokens").unwrap().to_vec::<i32>().unwrap();
    let seq: Vec<i32> = prompt.iter().chain(&fed).copied().collect();
    let full = st.get("full_logits").unwrap();
    let vocab = full.dim(-1).unwrap() as usize;
    let full = full.to_vec::<f32>().unwrap();
    let mut nll = 0f64;
    for i in 0..seq.len() - 1 {
        let row: Vec<f64> = full[i * vocab..(i + 1) * vocab].iter().map(|&v| v as f64).collect();
        let m = row.iter().fold(f64::MIN, |a, &b| a.max(b));
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        nll += lse - row[seq[i + 1] as usize];
    }
    let want = (nll / (seq.len() - 1) as f64).exp();
    let data = tmp.path().join("tokens.safetensors");
    let tokens = Array::from_slice(&seq, &[seq.len() as i32]).unwrap();
    save_safetensors(&data, &[("tokens", &tokens)], &[]).unwrap();
    let ctx = seq.len().to_string();
    let out = run_ok(&[
        "eval",
        "ppl",
        "--model",
        dir.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--ctx",
        &ctx,
        "--windows",
        "1",
        "--json",
        "--quiet",
    ]);
    let v: Value = serde_json::from_str(&out).unwrap();
    let got = v["ppl"].as_f64().unwrap();
    assert!((got - want).abs() <= 1e-3 * want, "ppl {got}, from mlx-lm's logits {want}");
}

#[test]
fn convert_from_gguf_imports_and_the_result_runs() {
    // The library test (mlx-k3/tests/gguf_import.rs) checks the values and logits; here the command line:
    // --from-gguf with --out, the JSON report, a rerun found complete, and `logits` on the checkpoint.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let src = root().join("mlx-k3/tests/fixtures/gguf/deepseek2_mixed/model.gguf");
    let args = ["convert", "--from-gguf", src.to_str().unwrap(), "--out", out.to_str().unwrap(), "--json"];
    let v: Value = serde_json::from_str(&run_ok(&args)).unwrap();
    assert_eq!(v["architecture"], "deepseek2");
    assert_eq!(v["resume"], "Fresh");
    let n = v["tensors"].as_array().unwrap().len();
    assert!(n > 0 && v["exact_tensors"].as_u64() == Some(n as u64), "{v}");
    let again: Value = serde_json::from_str(&run_ok(&args)).unwrap();
    assert_eq!(again["resume"], "Complete");
    let logits = dir.path().join("l.safetensors");
    run_ok(&["logits", "--model", out.to_str().unwrap(), "--tokens", "1,2,3", "--out", logits.to_str().unwrap()]);
    assert!(logits.exists());
    // A missing recipe file is an error naming it.
    let (ok, _, err) = run(&["convert", "--from-gguf", src.to_str().unwrap(), "--out", "x", "--recipe", "r.toml"]);
    assert!(!ok && err.contains("r.toml"), "{err}");
    // K-quants and IQ1_S with a recipe: the per-class table (counts, exact, re-quantized, rel RMS) is printed
    // and written next to the checkpoint.
    let kq = root().join("mlx-k3/tests/fixtures/gguf/deepseek2_kquants/model.gguf");
    let recipe = dir.path().join("r.toml");
    std::fs::write(&recipe, "[classes.routed_experts]\nformat = \"affine\"\nbits = 4\ngroup_size = 32\n").unwrap();
    let out2 = dir.path().join("kq");
    let text = run_ok(&[
        "convert",
        "--from-gguf",
        kq.to_str().unwrap(),
        "--out",
        out2.to_str().unwrap(),
        "--recipe",
        recipe.to_str().unwrap(),
    ]);
    let line = text.lines().find(|l| l.starts_with("routed_experts")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains("IQ1_S") && line.contains("affine4/g32 (re-quantized)"), "{line}");
    assert!(text.lines().any(|l| l.starts_with("embeddings") && l.contains("Q6_K")), "{text}");
    assert!(out2.join("gguf_import_report.json").exists());
    let (ok, _, err) = run(&["convert", "--from-gguf", "/nonexistent/m.gguf", "--out", out.to_str().unwrap()]);
    assert!(!ok && err.contains("m.gguf"), "{err}");
}

#[test]
fn deepseek_family_models_calibrate_and_prune_to_the_masked_original() {
    // REAP pruning on DeepSeek-V3 and DeepSeek-V3.2 checkpoints (ungrouped routers; mlx-lm names, the router
    // bias under mlp.gate): calibrate on two windows of token ids, keep 4 of 8 experts, and the pruned model
    // computes the original's logits with the dropped experts masked out of routing by a -1e9 bias (1e-5 of
    // the largest logit, as for Kimi K3 above: the same weights, fewer candidates in the top-k).
    let tmp = tempfile::tempdir().unwrap();
    for src in
        [ds3_fixture("b_direct_q_plain_rope"), root().join("mlx-k3/tests/fixtures/deepseek_v32/b_plain_interleave")]
    {
        let name = src.file_name().unwrap().to_string_lossy().into_owned();
        let cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
        let vocab = cfg["vocab_size"].as_u64().unwrap() as i32;
        let seq: Vec<i32> = (0..48).map(|i| (i * 37 + 11) % vocab).collect();
        let data = tmp.path().join(format!("{name}-tokens.safetensors"));
        save_safetensors(&data, &[("tokens", &Array::from_slice(&seq, &[48]).unwrap())], &[]).unwrap();
        let stats = tmp.path().join(format!("{name}-calib.safetensors"));
        let s = src.to_str().unwrap();
        run_ok(&[
            "calibrate",
            "--model",
            s,
            "--data",
            data.to_str().unwrap(),
            "--ctx",
            "24",
            "--windows",
            "2",
            "--out",
            stats.to_str().unwrap(),
            "--quiet",
        ]);
        let pruned = tmp.path().join(format!("{name}-pruned"));
        let report = run_ok(&[
            "prune",
            "--model",
            s,
            "--keep",
            "4",
            "--stats",
            stats.to_str().unwrap(),
            "--to",
            pruned.to_str().unwrap(),
            "--json",
            "--quiet",
        ]);
        let report: Value = serde_json::from_str(&report).unwrap();
        let mut masked: BTreeMap<String, Array> =
            Safetensors::load(src.join("model.safetensors")).unwrap().arrays().unwrap();
        let layers = report["layers"].as_array().unwrap();
        assert!(!layers.is_empty(), "{name}: {report}");
        for layer in layers {
            let l = layer["layer"].as_u64().unwrap();
            let kept: Vec<usize> =
                layer["kept"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
            assert_eq!(kept.len(), 4, "{name}");
            let key = format!("model.layers.{l}.mlp.gate.e_score_correction_bias");
            let mut b = masked.get(&key).unwrap_or_else(|| panic!("{name}: no {key}")).to_vec::<f32>().unwrap();
            for (e, v) in b.iter_mut().enumerate() {
                if !kept.contains(&e) {
                    *v = -1e9;
                }
            }
            masked.insert(key, Array::from_slice(&b, &[8]).unwrap());
        }
        let mdir = tmp.path().join(format!("{name}-masked"));
        std::fs::create_dir_all(&mdir).unwrap();
        std::fs::copy(src.join("config.json"), mdir.join("config.json")).unwrap();
        let refs: Vec<(&str, &Array)> = masked.iter().map(|(k, v)| (k.as_str(), v)).collect();
        save_safetensors(mdir.join("model.safetensors"), &refs, &[("format", "mlx")]).unwrap();
        let (a, b) = (logits(&load(&pruned), &seq[..24]), logits(&load(&mdir), &seq[..24]));
        let e = rel(&a, &b);
        println!("{name}: pruned (4 of 8) vs masked original: rel err {e:.2e}");
        assert!(e < 1e-5, "{name}: rel err {e}");
        // Not vacuous: dropping half the experts changes the unmasked original's routing and so its logits.
        let orig = rel(&logits(&load(&src), &seq[..24]), &b);
        assert!(orig > 1e-3, "{name}: the pruned model computes the unpruned one's logits ({orig})");
        let pcfg: Value = serde_json::from_str(&std::fs::read_to_string(pruned.join("config.json")).unwrap()).unwrap();
        assert_eq!(pcfg["n_routed_experts"], 4, "{name}");
    }
}
