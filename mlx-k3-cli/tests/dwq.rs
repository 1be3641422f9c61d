//! `mlx-k3 dwq` end to end on a tiny random Kimi K3 (3 layers: dense, MoE with latent experts, KDA and MLA,
//! attention residuals): the differentiable layer forward equals the inference forward and its gradients
//! equal finite differences; DWQ lowers the validation KL of affine, codebook and tiered (codebook + MXFP4)
//! builds, never raises it for a layer, trains only float scales and biases (codes, routers and MXFP4's E8M0
//! scales come out byte-identical), and reports the KL that `eval kl` measures independently; a run killed
//! with SIGKILL at several points resumes to byte-identical files. The end-to-end mode (`--mode end-to-end`)
//! is tested the same way, and step by step against mlx-lm's `dwq_quantize` on an mlx-lm-quantized fixture.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use mlx_k3::io::{save_safetensors, Safetensors};
use mlx_k3::model::{KimiK3, LoadOptions, ModelConfig};
use mlx_k3::{transforms, Array, Dtype};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The float teacher: a random model whose logits mlx-lm produced (tests/fixtures/k3/README.md).
fn teacher() -> PathBuf {
    root().join("mlx-k3/tests/fixtures/k3/a_latent_norm_attnres")
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_mlx-k3")
}

#[track_caller]
fn run_ok(args: &[&str]) -> String {
    let out = Command::new(bin()).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "mlx-k3 {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into()
}

/// 12 windows of 33 random token ids (seeded) in `dir/tokens.safetensors`.
fn tokens(dir: &Path) -> String {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let ids: Vec<i32> = (0..12 * 33)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 256) as i32
        })
        .collect();
    let a = Array::from_slice(&ids, &[ids.len() as i32]).unwrap();
    let p = dir.join("tokens.safetensors");
    save_safetensors(&p, &[("tokens", &a)], &[]).unwrap();
    p.display().to_string()
}

fn convert(dir: &Path, name: &str, recipe: &str, extra: &[&str]) -> PathBuf {
    let r = dir.join(format!("{name}.toml"));
    std::fs::write(&r, recipe).unwrap();
    let out = dir.join(name);
    let t = teacher();
    let mut args = vec!["convert", "--from", t.to_str().unwrap(), "--to", out.to_str().unwrap()];
    args.extend(["--recipe", r.to_str().unwrap(), "--quiet"]);
    args.extend(extra);
    run_ok(&args);
    out
}

const AFFINE2: &str = "dtype = \"bfloat16\"\n[default]\nformat = \"affine\"\nbits = 2\ngroup_size = 32\n\
                       [classes.router]\nformat = \"affine\"\nbits = 8\ngroup_size = 32\n";

fn dwq_args<'a>(build: &'a str, data: &'a str, out: &'a str) -> Vec<&'a str> {
    let t = teacher();
    let t: &'static str = Box::leak(t.display().to_string().into_boxed_str());
    vec![
        "dwq",
        "--teacher",
        t,
        "--build",
        build,
        "--data",
        data,
        "--out",
        out,
        "--ctx",
        "33",
        "--windows",
        "8",
        "--skip",
        "0",
        "--val-windows",
        "4",
        "--val-skip",
        "8",
        "--batch",
        "4",
        "--steps",
        "6",
        "--lr",
        "2e-3",
        "--quiet",
    ]
}

fn dwq_json(build: &Path, data: &str, out: &Path) -> Value {
    let (b, o) = (build.display().to_string(), out.display().to_string());
    let mut args = dwq_args(&b, data, &o);
    args.push("--json");
    serde_json::from_str(&run_ok(&args)).unwrap()
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect()
}

/// Every tensor of a checkpoint folder, by stored name, as raw bytes with dtype.
fn tensors(dir: &Path) -> BTreeMap<String, (Dtype, Vec<u8>)> {
    let mut m = BTreeMap::new();
    for f in mlx_k3::model::loader::weight_files(dir).unwrap() {
        let st = Safetensors::load(&f).unwrap();
        for k in st.keys() {
            let a = st.get(&k).unwrap();
            let host = mlx_k3::compress::store::HostTensor::from_array(&a).unwrap();
            m.insert(k, (a.dtype(), host.data));
        }
    }
    m
}

/// Checks the report's monotonicity and improvement, that only float scales/biases changed, and that
/// `eval kl` measures the reported validation KL. Returns (KL before, KL after).
fn check_run(build: &Path, out: &Path, data: &str, report: &Value) -> (f64, f64) {
    let r = &report["dwq"];
    let blocks = r["blocks"].as_array().unwrap();
    assert_eq!(blocks.len(), 3);
    let mut trained = 0;
    for b in blocks {
        let (before, after) = (b["val_kl_before"].as_f64().unwrap(), b["val_kl_after"].as_f64().unwrap());
        assert!(after <= before, "layer {}: validation KL rose {before} -> {after}", b["layer"]);
        trained += b["trained_tensors"].as_u64().unwrap();
    }
    assert!(trained > 0);
    let (before, after) = (r["val_kl_before"].as_f64().unwrap(), r["val_kl_after"].as_f64().unwrap());

    // What changed: float scales and biases only, never in the router.
    let (a, b) = (tensors(build), tensors(out));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut changed = 0;
    for (k, (dt, bytes)) in &a {
        let (dt2, bytes2) = &b[k];
        assert_eq!(dt, dt2, "{k} changed dtype");
        if bytes != bytes2 {
            changed += 1;
            let trainable = (k.ends_with(".scales") || k.ends_with(".biases")) && dt.is_float();
            assert!(trainable && !k.contains("mlp.gate."), "{k} changed but is not a trained parameter");
        }
    }
    assert!(changed > 0, "DWQ changed nothing");

    // `eval kl` on the validation windows (the inference kernels, another code path) measures the same KL.
    let t = teacher().display().to_string();
    let eval = |m: &Path| -> f64 {
        let m = m.display().to_string();
        let args = [
            "eval",
            "kl",
            "--model",
            &m,
            "--teacher",
            &t,
            "--data",
            data,
            "--ctx",
            "33",
            "--skip",
            "8",
            "--windows",
            "4",
            "--json",
            "--quiet",
        ];
        let v: Value = serde_json::from_str(&run_ok(&args)).unwrap();
        v["kl_mean"].as_f64().unwrap()
    };
    let (e0, e1) = (eval(build), eval(out));
    // DWQ's KL is the mean over windows of each window's mean (equal window lengths: the same mean), in f32
    // with the plain-ops layer path for the trained layer; 1e-3 relative covers the summation-order differences.
    for (got, want) in [(before, e0), (after, e1)] {
        assert!((got - want).abs() <= 1e-3 * want.abs() + 1e-7, "reported KL {got}, eval kl {want}");
    }
    (before, after)
}

#[test]
fn dwq_lowers_kl_of_affine_codebook_and_tiered_builds() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tokens(tmp.path());
    let affine = convert(tmp.path(), "a2", AFFINE2, &[]);
    let codebook = convert(
        tmp.path(),
        "cb",
        "dtype = \"bfloat16\"\n[default]\nformat = \"codebook\"\n\
         fallback = { format = \"affine\", bits = 2, group_size = 32 }\n\
         [classes.router]\nformat = \"affine\"\nbits = 8\ngroup_size = 32\n\
         [classes.embeddings]\nformat = \"affine\"\nbits = 8\ngroup_size = 32\n",
        &[],
    );
    let calib = tmp.path().join("calib.safetensors");
    run_ok(&[
        "calibrate",
        "--model",
        teacher().to_str().unwrap(),
        "--data",
        &data,
        "--ctx",
        "33",
        "--windows",
        "4",
        "--out",
        calib.to_str().unwrap(),
        "--quiet",
    ]);
    let tiered = convert(
        tmp.path(),
        "tiered",
        "dtype = \"bfloat16\"\n[default]\nformat = \"affine\"\nbits = 4\ngroup_size = 32\n\
         [classes.routed_experts]\nformat = \"tiered\"\n[tiers]\nlow = { format = \"codebook\" }\n\
         high = { format = \"mxfp4\" }\npromote_fraction = 0.25\n",
        &["--calib", calib.to_str().unwrap()],
    );
    for (name, build) in [("affine 2-bit", &affine), ("codebook", &codebook), ("tiered", &tiered)] {
        let out = tmp.path().join(format!("{}-dwq", build.file_name().unwrap().to_string_lossy()));
        let report = dwq_json(build, &data, &out);
        let (before, after) = check_run(build, &out, &data, &report);
        eprintln!("{name}: validation KL {before:.5} -> {after:.5}");
        assert!(after < before, "{name}: DWQ did not lower the validation KL ({before} -> {after})");
    }
    // The MXFP4 band's E8M0 scales are frozen (uint8: check_run saw them unchanged); the tiered build has some.
    let t = tensors(&tiered);
    assert!(t.iter().any(|(k, (dt, _))| k.ends_with("mxfp4.scales") && *dt == Dtype::U8));
}

#[test]
fn dwq_killed_at_several_points_resumes_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tokens(tmp.path());
    let build = convert(tmp.path(), "a2", AFFINE2, &[]);
    let whole = tmp.path().join("whole");
    dwq_json(&build, &data, &whole);

    let out = tmp.path().join("killed");
    let (b, o) = (build.display().to_string(), out.display().to_string());
    let args = dwq_args(&b, &data, &o);
    let mut kills = 0;
    for ms in [400u64, 900, 1500, 2200, 3000] {
        let mut child = Command::new(bin()).args(&args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(ms));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap(); // SIGKILL
            kills += 1;
        }
        child.wait().unwrap();
    }
    run_ok(&args);
    eprintln!("killed {kills} times");
    let (want, got) = (files(&whole), files(&out));
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (name, bytes) in &want {
        assert!(got[name] == *bytes, "{name} differs after the interrupted runs");
    }
    // Complete: a rerun changes nothing and reports the same.
    let again = dwq_json(&build, &data, &out);
    assert_eq!(again["written"], 0);
}

#[test]
fn dwq_stopped_between_layers_resumes_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tokens(tmp.path());
    let build = convert(tmp.path(), "a2", AFFINE2, &[]);
    let job = |out: &Path, stop_after: Option<usize>| {
        mlx_k3::compress::dwq::dwq(&mlx_k3::compress::dwq::DwqJob {
            teacher: &teacher(),
            build: &build,
            data: Path::new(&data),
            out,
            ctx: 33,
            windows: 8,
            skip: 0,
            val_windows: 4,
            val_skip: 8,
            batch: 4,
            steps: 6,
            lr: 2e-3,
            retries: 2,
            overwrite: false,
            stop_after,
            only_below_8_bits: false,
            mode: mlx_k3::compress::dwq::Mode::LayerWise,
            progress: &mlx_k3::compress::Silent,
        })
    };
    let whole = tmp.path().join("whole");
    job(&whole, None).unwrap();
    let out = tmp.path().join("stopped");
    for n in [1, 1, 2] {
        let e = job(&out, Some(n)).unwrap_err().to_string();
        assert!(e.contains("stopped after"), "{e}");
    }
    let s = job(&out, None).unwrap();
    assert_eq!(s.written, 0, "every unit was already written");
    assert_eq!(files(&whole), files(&out));

    // Overlapping calibration and validation windows are refused before anything is written.
    let bad = tmp.path().join("bad");
    let e = mlx_k3::compress::dwq::dwq(&mlx_k3::compress::dwq::DwqJob {
        teacher: &teacher(),
        build: &build,
        data: Path::new(&data),
        out: &bad,
        ctx: 33,
        windows: 8,
        skip: 0,
        val_windows: 4,
        val_skip: 6,
        batch: 4,
        steps: 6,
        lr: 2e-3,
        retries: 2,
        overwrite: false,
        stop_after: None,
        only_below_8_bits: false,
        mode: mlx_k3::compress::dwq::Mode::LayerWise,
        progress: &mlx_k3::compress::Silent,
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("overlap"), "{e}");
    assert!(!bad.exists());
}

/// Layer tensors (names without `language_model.`) of a build.
fn layer_tensors(dir: &Path, layer: usize) -> BTreeMap<String, Array> {
    let mut m = BTreeMap::new();
    let prefix = format!("model.layers.{layer}.");
    for f in mlx_k3::model::loader::weight_files(dir).unwrap() {
        let st = Safetensors::load(&f).unwrap();
        for k in st.keys() {
            let name = k.strip_prefix("language_model.").unwrap_or(&k).to_string();
            if name.starts_with(&prefix) {
                m.insert(name, st.get(&k).unwrap());
            }
        }
    }
    m
}

#[test]
fn differentiable_layer_matches_inference_and_finite_differences() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tokens(tmp.path());
    let _ = data;
    for (name, recipe) in [
        ("a2", AFFINE2),
        (
            "cb",
            "dtype = \"float32\"\n[default]\nformat = \"codebook\"\n\
             fallback = { format = \"affine\", bits = 4, group_size = 32 }\n\
             [classes.router]\nformat = \"float\"\n",
        ),
    ] {
        let build = convert(tmp.path(), name, recipe, &[]);
        let cfg = ModelConfig::load(&build).unwrap();
        let model = KimiK3::load(&build, LoadOptions { dtype: Some(Dtype::F32), ..Default::default() }).unwrap();
        let ids: Vec<i32> = (0..24).map(|i| (i * 37 + 5) % 256).collect();
        let ids = Array::from_slice(&ids, &[2, 12]).unwrap();
        // Layer 1 is the MoE layer (KDA attention, latent experts).
        let b = 1;
        let s0 = model.embed_state(&ids).unwrap();
        let s1 = model.layer_forward(0, None, &s0).unwrap();
        let want = model.layer_forward(b, None, &s1).unwrap().h;
        let base = layer_tensors(&build, b);
        let scale_name = base
            .keys()
            .find(|k| k.contains("switch_mlp.up_proj") && k.ends_with(".scales"))
            .unwrap_or_else(|| panic!("{name}: no expert scales in {:?}", base.keys().collect::<Vec<_>>()))
            .clone();
        let f = |p: &[Array]| -> mlx_k3::Result<Vec<Array>> {
            let _scope = mlx_k3::kernels::differentiable_scope();
            let mut m = base.clone();
            m.insert(scale_name.clone(), p[0].clone());
            let layer = model.build_layer(b, m, &cfg.quantization, &build)?;
            let y = model.layer_forward(b, Some(&layer), &s1)?;
            Ok(vec![y.h.square()?.mean_all(false)?, y.h])
        };
        // The parameter as stored (bf16 affine scales, f16 codebook scales), as DWQ trains it.
        let s = base[&scale_name].clone();
        let (vals, grads) = transforms::value_and_grad(f, &[s.clone()], &[0]).unwrap();
        // Plain ops against the fused kernels: the same numbers up to f32 summation order.
        let (got, w) = (vals[1].to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = got.iter().zip(&w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= 1e-5 * scale, "{name}: differentiable layer differs from inference by {err} (scale {scale})");

        // A central difference along the gradient's signs, each entry moved by 1% of its size (rounded to the
        // stored dtype; the exact moves are used): the loss changes by ~1e-3 relative, far above its f32
        // rounding (~1e-6 relative), and the step leaves the routing (decided before the experts) unchanged.
        // The second-order error of the central difference is ~1e-4 relative; 2% covers that and rounding.
        let f32s = |a: &Array| a.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap();
        let (g, sv) = (f32s(&grads[0]), f32s(&s));
        let moved = |sign: f32| -> (Array, Vec<f32>) {
            let v: Vec<f32> = sv.iter().zip(&g).map(|(x, gi)| x + sign * 0.01 * x.abs() * gi.signum()).collect();
            let a = Array::from_slice(&v, &s.shape()).unwrap().astype(s.dtype()).unwrap();
            let back = f32s(&a);
            (a, back)
        };
        let loss = |a: Array| -> f64 {
            let mut m = base.clone();
            m.insert(scale_name.clone(), a);
            let layer = model.build_layer(b, m, &cfg.quantization, &build).unwrap();
            let y = model.layer_forward(b, Some(&layer), &s1).unwrap();
            y.h.square().unwrap().mean_all(false).unwrap().item::<f32>().unwrap() as f64
        };
        let ((up, upv), (down, downv)) = (moved(1.0), moved(-1.0));
        let predicted: f64 = g.iter().zip(upv.iter().zip(&downv)).map(|(gi, (u, d))| *gi as f64 * (u - d) as f64).sum();
        let fd = loss(up) - loss(down);
        assert!(predicted.abs() > 0.0, "{name}: zero gradient");
        assert!(
            (fd - predicted).abs() <= 0.02 * predicted.abs(),
            "{name}: {scale_name}: autodiff predicts a change of {predicted}, the loss changed by {fd}"
        );
        eprintln!("{name}: {scale_name}: autodiff {predicted:.6e}, finite difference {fd:.6e}");
    }
}

/// Routed experts 2-bit, everything else 8-bit (the k3-nano ledger's affine build, in small).
const EXPERTS_A2: &str = "dtype = \"bfloat16\"\n[default]\nformat = \"affine\"\nbits = 8\ngroup_size = 32\n\
                          [classes.routed_experts]\nformat = \"affine\"\nbits = 2\ngroup_size = 32\n";

fn e2e_args<'a>(build: &'a str, data: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = dwq_args(build, data, out);
    a.extend(["--mode", "end-to-end", "--val-every", "2"]);
    a.extend(extra);
    a
}

/// `eval kl` of a model against the teacher on the validation windows 8..11.
fn eval_val_kl(model: &Path, data: &str) -> f64 {
    let (m, t) = (model.display().to_string(), teacher().display().to_string());
    let args = [
        "eval",
        "kl",
        "--model",
        &m,
        "--teacher",
        &t,
        "--data",
        data,
        "--ctx",
        "33",
        "--skip",
        "8",
        "--windows",
        "4",
        "--json",
        "--quiet",
    ];
    let v: Value = serde_json::from_str(&run_ok(&args)).unwrap();
    v["kl_mean"].as_f64().unwrap()
}

#[test]
fn dwq_end_to_end_lowers_kl_keeps_the_best_and_trains_only_what_it_says() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tokens(tmp.path());
    let build = convert(tmp.path(), "a2", AFFINE2, &[]);
    let out = tmp.path().join("e2e");
    let (b, o) = (build.display().to_string(), out.display().to_string());
    let mut args = e2e_args(&b, &data, &o, &[]);
    args.push("--json");
    let r: Value = serde_json::from_str(&run_ok(&args)).unwrap();
    let r = &r["dwq"];
    assert_eq!(r["mode"], "end-to-end");
    assert_eq!(r["forward"], "float32 master");
    assert_eq!(r["temperature"].as_f64(), Some(2.0));
    let losses = r["train_loss"].as_array().unwrap();
    assert_eq!(losses.len(), 6);
    // Validation at steps 0 (the build), 2, 4 and 6; the kept parameters are those of the lowest.
    let vals: Vec<(u64, f64)> = r["validations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["step"].as_u64().unwrap(), v["val_kl"].as_f64().unwrap()))
        .collect();
    assert_eq!(vals.iter().map(|v| v.0).collect::<Vec<_>>(), [0, 2, 4, 6]);
    let best = vals.iter().fold(vals[0], |a, &v| if v.1 < a.1 { v } else { a });
    assert_eq!(r["best_step"].as_u64(), Some(best.0));
    let (before, after) = (r["val_kl_before"].as_f64().unwrap(), r["val_kl_after"].as_f64().unwrap());
    assert_eq!((before, after), (vals[0].1, best.1));
    assert!(after < before, "end-to-end DWQ did not lower the validation KL ({before} -> {after})");
    eprintln!("end to end: validation KL {before:.5} -> {after:.5} {vals:?}");
    // `eval kl` (the inference kernels) measures the kept parameters as the run did; 1e-3 relative covers
    // summation order (as in check_run).
    for (got, m) in [(before, &build), (after, &out)] {
        let want = eval_val_kl(m, &data);
        assert!((got - want).abs() <= 1e-3 * want, "reported KL {got}, eval kl {want}");
    }
    // Only float scales and biases outside the router changed; no checkpoint is left behind.
    let (a, bt) = (tensors(&build), tensors(&out));
    assert_eq!(a.keys().collect::<Vec<_>>(), bt.keys().collect::<Vec<_>>());
    let changed: Vec<&String> = a.keys().filter(|k| a[*k] != bt[*k]).collect();
    assert!(!changed.is_empty());
    for k in &changed {
        assert!((k.ends_with(".scales") || k.ends_with(".biases")) && !k.contains("mlp.gate."), "{k} changed");
    }
    assert!(!out.join("dwq-checkpoint.safetensors").exists());

    // --only-below-8-bits on a build with 2-bit experts and 8-bit everything else: only expert planes train.
    let build8 = convert(tmp.path(), "e2", EXPERTS_A2, &[]);
    let out8 = tmp.path().join("e2e-below8");
    let (b8, o8) = (build8.display().to_string(), out8.display().to_string());
    let mut args = e2e_args(&b8, &data, &o8, &["--only-below-8-bits"]);
    args.push("--json");
    let r: Value = serde_json::from_str(&run_ok(&args)).unwrap();
    let (a, bt) = (tensors(&build8), tensors(&out8));
    let changed: Vec<&String> = a.keys().filter(|k| a[*k] != bt[*k]).collect();
    assert!(!changed.is_empty(), "nothing trained: {}", r["dwq"]);
    for k in &changed {
        assert!(k.contains("switch_mlp.") && (k.ends_with(".scales") || k.ends_with(".biases")), "{k} changed");
    }
    let n = a.keys().filter(|k| k.contains("switch_mlp.") && k.ends_with("s") && a[*k].0.is_float()).count();
    assert_eq!(r["dwq"]["trained_tensors"].as_u64(), Some(n as u64));

    // A codebook build (f16 super-block scales, which enter the kernels rounded from their f32 masters).
    let cb = convert(
        tmp.path(),
        "cb",
        "dtype = \"bfloat16\"\n[default]\nformat = \"codebook\"\n\
         fallback = { format = \"affine\", bits = 2, group_size = 32 }\n\
         [classes.router]\nformat = \"affine\"\nbits = 8\ngroup_size = 32\n\
         [classes.embeddings]\nformat = \"affine\"\nbits = 8\ngroup_size = 32\n",
        &[],
    );
    let outcb = tmp.path().join("cb-e2e");
    let (bc, oc) = (cb.display().to_string(), outcb.display().to_string());
    let mut args = e2e_args(&bc, &data, &oc, &["--only-below-8-bits"]);
    args.push("--json");
    let r: Value = serde_json::from_str(&run_ok(&args)).unwrap();
    let (before, after) = (r["dwq"]["val_kl_before"].as_f64().unwrap(), r["dwq"]["val_kl_after"].as_f64().unwrap());
    eprintln!("codebook end to end: validation KL {before:.5} -> {after:.5}");
    assert!(after < before, "codebook: {before} -> {after}");
    let (a, bt) = (tensors(&cb), tensors(&outcb));
    let changed: Vec<&String> = a.keys().filter(|k| a[*k] != bt[*k]).collect();
    assert!(changed.iter().any(|k| a.contains_key(&k.replace(".scales", ".codes"))), "no codebook scale trained");
    for k in &changed {
        assert!((k.ends_with(".scales") || k.ends_with(".biases")) && !k.contains("mlp.gate."), "{k} changed");
    }

    // Bad options fail with the flag named.
    for (flag, v) in [("--temperature", "0"), ("--val-every", "0")] {
        let o = tmp.path().join("bad").display().to_string();
        let mut args = e2e_args(&b, &data, &o, &[]);
        args.extend([flag, v]);
        let res = Command::new(bin()).args(&args).output().unwrap();
        assert!(!res.status.success());
        assert!(String::from_utf8_lossy(&res.stderr).contains(flag), "{}", String::from_utf8_lossy(&res.stderr));
    }
}

#[test]
fn dwq_end_to_end_killed_or_stopped_resumes_to_the_same_result() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tokens(tmp.path());
    let build = convert(tmp.path(), "a2", AFFINE2, &[]);
    let whole = tmp.path().join("whole");
    let (b, w) = (build.display().to_string(), whole.display().to_string());
    run_ok(&e2e_args(&b, &data, &w, &[]));

    // Stopped after each checkpoint (steps 2, 4, 6) and after the first layer units: deterministic points.
    let e2e = mlx_k3::compress::dwq::Mode::EndToEnd(mlx_k3::compress::dwq::EndToEnd {
        temperature: 2.0,
        val_every: 2,
        stored_forward: false,
    });
    let job = |out: &Path, stop_after: Option<usize>| {
        mlx_k3::compress::dwq::dwq(&mlx_k3::compress::dwq::DwqJob {
            teacher: &teacher(),
            build: &build,
            data: Path::new(&data),
            out,
            ctx: 33,
            windows: 8,
            skip: 0,
            val_windows: 4,
            val_skip: 8,
            batch: 4,
            steps: 6,
            lr: 2e-3,
            retries: 2,
            overwrite: false,
            stop_after,
            only_below_8_bits: false,
            mode: e2e,
            progress: &mlx_k3::compress::Silent,
        })
    };
    let stopped = tmp.path().join("stopped");
    for n in [1, 1, 1, 2] {
        let e = job(&stopped, Some(n)).unwrap_err().to_string();
        assert!(e.contains("stopped after"), "{e}");
    }
    let s = job(&stopped, None).unwrap();
    assert_eq!(files(&whole), files(&stopped));
    let manifest = std::fs::read_to_string(whole.join(mlx_k3::compress::store::MANIFEST)).unwrap();
    assert_eq!(s.report, serde_json::from_str::<Value>(&manifest).unwrap()["dwq"]);

    // Killed with SIGKILL at several moments.
    let out = tmp.path().join("killed");
    let o = out.display().to_string();
    let args = e2e_args(&b, &data, &o, &[]);
    let mut kills = 0;
    for ms in [400u64, 600, 800, 1000, 1200, 1400] {
        let mut child = Command::new(bin()).args(&args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(ms));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap(); // SIGKILL
            kills += 1;
        }
        child.wait().unwrap();
    }
    run_ok(&args);
    eprintln!("killed {kills} times");
    let (want, got) = (files(&whole), files(&out));
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (name, bytes) in &want {
        assert!(got[name] == *bytes, "{name} differs after the interrupted runs");
    }
}

/// mlx-lm's DWQ on the tiny teacher, quantized by mlx-lm (routed experts 2-bit, the rest 8-bit), written by
/// scripts/compress/dwq_parity_fixture.py: the training loss (KL at temperature 2) and the gradient's global
/// norm of each of 3 Adam steps equal mlx-lm's, training the same 12 tensors (the 2-bit modules' scales and
/// biases, `--only-below-8-bits`).
#[test]
fn dwq_end_to_end_matches_mlx_lm_dwq_step_by_step() {
    let fx = root().join("mlx-k3/tests/fixtures/dwq_parity");
    let want: Value = serde_json::from_str(&std::fs::read_to_string(fx.join("expected.json")).unwrap()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let (t, b, d, o) = (
        teacher().display().to_string(),
        fx.display().to_string(),
        fx.join("tokens.safetensors").display().to_string(),
        out.display().to_string(),
    );
    let args = [
        "dwq",
        "--teacher",
        &t,
        "--build",
        &b,
        "--data",
        &d,
        "--out",
        &o,
        "--ctx",
        "32",
        "--windows",
        "2",
        "--skip",
        "0",
        "--val-windows",
        "1",
        "--val-skip",
        "2",
        "--batch",
        "2",
        "--steps",
        "3",
        "--lr",
        "1e-3",
        "--mode",
        "end-to-end",
        "--temperature",
        "2",
        "--only-below-8-bits",
        "--val-every",
        "3",
        "--json",
        "--quiet",
    ];
    let got: Value = serde_json::from_str(&run_ok(&args)).unwrap();
    let got = &got["dwq"];
    assert_eq!(got["trained_tensors"], want["trained_tensors"]);
    assert_eq!(got["trained_params"], want["trained_params"]);
    // Both are float32 forwards and backwards of the same model through different kernels (MLX's quantized
    // matmul and gather_qmm against ours, fused against plain ops): they differ by summation order only.
    // Measured: 1.3e-6 relative on the losses, 8e-6 on the gradient norms; 1e-4 leaves a margin without
    // hiding a wrong term (a missing temperature, a transposed KL or an untrained tensor moves them by >1e-2).
    for key in ["train_loss", "grad_norm"] {
        let (g, w) = (got[key].as_array().unwrap(), want[key].as_array().unwrap());
        assert_eq!(g.len(), w.len(), "{key}");
        for (step, (g, w)) in g.iter().zip(w).enumerate() {
            let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
            assert!((g - w).abs() <= 1e-4 * w.abs(), "{key} at step {step}: ours {g}, mlx-lm {w}");
        }
    }
}
