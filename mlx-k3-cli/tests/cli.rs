//! The `mlx-k3` program end to end: `logits` reproduces mlx-lm's prompt logits, `inspect` summarizes a
//! checkpoint, and bad input exits non-zero with a one-line error.

use std::path::{Path, PathBuf};
use std::process::Command;

use mlx_k3::io::Safetensors;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/k3").join(name)
}

fn mlx_k3(args: &[&str]) -> (bool, String, String) {
    mlx_k3_env(&[], args)
}

/// `mlx-k3 args...` with the environment variables `vars` set.
fn mlx_k3_env(vars: &[(&str, &str)], args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mlx-k3")).envs(vars.iter().copied()).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// Each command of `commands` run with `var=value` fails with a one-line `mlx-k3: error:` containing `want`.
fn assert_env_rejected(var: &str, value: &str, want: &str, commands: &[&[&str]]) {
    for args in commands {
        let (ok, _, stderr) = mlx_k3_env(&[(var, value)], args);
        assert!(!ok, "{args:?} with {var}={value} should fail");
        assert!(stderr.starts_with("mlx-k3: error:") && stderr.contains(want), "{stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    }
}

#[test]
fn logits_matches_the_reference() {
    let dir = fixture("c_hidden_experts_grouped");
    let exp = Safetensors::load(dir.join("expected.safetensors")).unwrap();
    let prompt = exp.get("prompt").unwrap().to_vec::<i32>().unwrap();
    let tokens: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("logits.safetensors");
    let (ok, stdout, stderr) = mlx_k3(&[
        "logits",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        &tokens.join(","),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    let got = Safetensors::load(&out).unwrap().get("logits").unwrap();
    assert_eq!(got.shape(), [prompt.len() as i32, 256]);
    let (g, w) = (got.to_vec::<f32>().unwrap(), exp.get("prefill_logits").unwrap().to_vec::<f32>().unwrap());
    let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let diff = g.iter().zip(&w).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff <= 1e-4 * scale, "rel err {}", diff / scale);
}

/// K3_QMM_ACT: q8 changes a quantized checkpoint's logits by the activations' rounding only; an unknown value
/// is a one-line error naming the variable, from `info` and from a forward pass alike. This tiny random model
/// is very sensitive (its 4-bit weights move the logits by ~100% of their scale against the dense fixture
/// with the same weights); int8 activations (rounding ~0.4% per element, against ~7% for 4-bit weights) must
/// move them by well under a quarter of that, and keep every row's argmax.
#[test]
fn qmm_activation_mode_from_the_environment() {
    let dir = fixture("a_latent_norm_attnres_q4");
    let exp = Safetensors::load(dir.join("expected.safetensors")).unwrap();
    let dense = Safetensors::load(fixture("a_latent_norm_attnres").join("expected.safetensors")).unwrap();
    let prompt = exp.get("prompt").unwrap().to_vec::<i32>().unwrap();
    assert_eq!(prompt, dense.get("prompt").unwrap().to_vec::<i32>().unwrap());
    let tokens: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("logits.safetensors");
    let run = |mode: &str, args: &[&str]| mlx_k3_env(&[("K3_QMM_ACT", mode)], args);
    let logits_args =
        ["logits", "--model", dir.to_str().unwrap(), "--tokens", &tokens.join(","), "--out", out.to_str().unwrap()];
    let (ok, stdout, stderr) = run("q8", &logits_args);
    assert!(ok, "{stdout}\n{stderr}");
    let g = Safetensors::load(&out).unwrap().get("logits").unwrap().to_vec::<f32>().unwrap();
    let w = exp.get("prefill_logits").unwrap().to_vec::<f32>().unwrap();
    let d = dense.get("prefill_logits").unwrap().to_vec::<f32>().unwrap();
    let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
    let (act, weights) = (max_diff(&g, &w), max_diff(&d, &w));
    assert!(act > 1e-4 && act < 0.25 * weights, "q8 activations move the logits by {act}; 4-bit weights by {weights}");
    let argmax = |r: &[f32]| r.iter().enumerate().fold(0, |b, (i, v)| if *v > r[b] { i } else { b });
    for (a, b) in g.chunks(256).zip(w.chunks(256)) {
        assert_eq!(argmax(a), argmax(b), "q8 changed a row's argmax");
    }
    let (ok, stdout, _) = run("q8", &["info"]);
    assert!(ok && stdout.contains("activations: q8"), "{stdout}");
    assert_env_rejected("K3_QMM_ACT", "int4", "K3_QMM_ACT must be q8 or f32", &[&["info"], &logits_args]);
}

/// K3_AVX512: 0 keeps the CPU kernels to AVX2, 1 (the default) allows the AVX-512 ones where the CPU has them;
/// both give the fixture's logits (the paths differ only in the order of f32 additions), `info` says which
/// runs, and any other value is a one-line error naming the variable, from `info` and a forward pass alike.
#[test]
fn avx512_switch_from_the_environment() {
    let dir = fixture("a_latent_norm_attnres_mixed_2_8"); // 8-bit routers: the AVX-512 kernel
    let exp = Safetensors::load(dir.join("expected.safetensors")).unwrap();
    let prompt = exp.get("prompt").unwrap().to_vec::<i32>().unwrap();
    let tokens: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("logits.safetensors");
    let run = |mode: &str, args: &[&str]| mlx_k3_env(&[("K3_AVX512", mode)], args);
    let logits_args =
        ["logits", "--model", dir.to_str().unwrap(), "--tokens", &tokens.join(","), "--out", out.to_str().unwrap()];
    #[cfg(target_arch = "x86_64")]
    let has_avx512 = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl");
    #[cfg(not(target_arch = "x86_64"))]
    let has_avx512 = false;
    let w = exp.get("prefill_logits").unwrap().to_vec::<f32>().unwrap();
    let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (mode, on) in [("0", false), ("1", has_avx512)] {
        let (ok, stdout, stderr) = run(mode, &["info"]);
        let want = format!("AVX-512 kernels: {}", if on { "on" } else { "off" });
        assert!(ok && stdout.contains(&want), "K3_AVX512={mode}: {stdout}\n{stderr}");
        let (ok, stdout, stderr) = run(mode, &logits_args);
        assert!(ok, "{stdout}\n{stderr}");
        let g = Safetensors::load(&out).unwrap().get("logits").unwrap().to_vec::<f32>().unwrap();
        let diff = g.iter().zip(&w).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        // (tests/model.rs's bound against mlx-lm's f32 logits; this fixture measures ~7e-6 with either path.)
        assert!(diff <= 1e-4 * scale, "K3_AVX512={mode}: rel err {}", diff / scale);
    }
    assert_env_rejected("K3_AVX512", "yes", "K3_AVX512 must be 0 or 1", &[&["info"], &logits_args]);
}

/// `info` names the kernel MLX's dense f32 matmuls run: the project's SGEMM with the micro-kernel this CPU
/// gets (`K3_AVX512` picks between the x86 ones), or the wheel's BLAS under `K3_BLAS=reference`.
#[cfg(target_os = "linux")]
#[test]
fn info_names_the_dense_matmul_kernel() {
    let info = |vars: &[(&str, &str)]| {
        let (ok, stdout, stderr) = mlx_k3_env(vars, &["info"]);
        assert!(ok, "{stdout}\n{stderr}");
        stdout.lines().find_map(|l| l.strip_prefix("dense f32 matmul: ").map(str::to_string)).expect(&stdout)
    };
    assert_eq!(info(&[("K3_BLAS", "reference")]), "the MLX wheel's BLAS");
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl");
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            assert_eq!(info(&[("K3_AVX512", "0")]), "project SGEMM (AVX2/FMA)");
            let want = if avx512 { "project SGEMM (AVX-512)" } else { "project SGEMM (AVX2/FMA)" };
            assert_eq!(info(&[("K3_AVX512", "1")]), want);
        }
    }
    #[cfg(target_arch = "aarch64")]
    assert_eq!(info(&[]), "project SGEMM (NEON)");
}

#[test]
fn inspect_summarizes_a_quantized_checkpoint() {
    let (ok, stdout, stderr) = mlx_k3(&["inspect", fixture("a_latent_norm_attnres_mixed_2_8").to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("3 layers (2 KDA, 1 MLA"), "{stdout}");
    let experts = stdout.lines().find(|l| l.starts_with("routed experts")).expect("a routed experts row");
    // 2 MoE layers x 3 projections x 8 experts x 32 x 32 parameters at 2 bits + fp32 scale and bias per 32
    // = 2 + 64/32 = 4 bits per parameter.
    assert!(experts.contains("49152") && experts.contains("4.000") && experts.contains("affine2/g32"), "{experts}");
    assert!(stdout.lines().any(|l| l.starts_with("total")), "{stdout}");
}

#[test]
fn inspect_lists_the_vision_tower() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/vision_k3");
    let (ok, stdout, stderr) = mlx_k3(&["inspect", dir.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("media encoder"), "{stdout}");
    // 2 blocks x 6 tensors + patch embedding, position grid and final norm; the projector's two matrices and
    // norm: 128 x 128 + 32 x 128 + 32 parameters. All float32, as the fixture stores them.
    let tower = stdout.lines().find(|l| l.starts_with("vision_tower.*")).expect("a vision_tower row");
    assert!(tower.split_whitespace().nth(1) == Some("15") && tower.ends_with("float32"), "{tower}");
    let proj = stdout.lines().find(|l| l.starts_with("mm_projector.*")).expect("an mm_projector row");
    assert!(proj.split_whitespace().take(3).eq(["mm_projector.*", "3", "20512"]), "{proj}");
}

#[test]
fn inspect_summarizes_a_deepseek_v3_family_checkpoint() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/deepseek_v3");
    let (ok, stdout, stderr) = mlx_k3(&["inspect", dir.join("a_yarn_grouped_mixed").to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains(": deepseek_v3") && stdout.contains("MLA (YaRN RoPE"), "{stdout}");
    assert!(stdout.contains("SwiGLU, routed scaling 2.5"), "{stdout}");
    // Per-layer down_proj bits: 6 in the dense layer 0, 3 in the routed experts of layer 1 (the fixture's
    // mlx-lm quantization); the other expert projections 2-bit.
    let experts = stdout.lines().find(|l| l.starts_with("routed experts")).expect("a routed experts row");
    assert!(experts.contains("affine2/g32") && experts.contains("affine3/g32"), "{experts}");
    let dense = stdout.lines().find(|l| l.starts_with("dense MLP")).expect("a dense MLP row");
    assert!(dense.contains("affine6/g32"), "{dense}");
    // The Hugging Face copy's MTP layer (model.layers.2.*, 43 tensors) is reported and not loaded.
    let (ok, stdout, stderr) = mlx_k3(&["inspect", dir.join("c_kimi_k25_hf").to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains(": kimi_k25"), "{stdout}");
    assert!(stdout.contains("not loaded: 43 tensors") && stdout.contains("model.layers.2.*"), "{stdout}");
    assert!(stdout.contains("no MTP drafting") && stdout.contains("num_nextn_predict_layers"), "{stdout}");
    // A checkpoint whose config declares its MTP layer: present, usable with --draft-model mtp.
    let mtp = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/mtp/mtp_hf");
    let (ok, stdout, stderr) = mlx_k3(&["inspect", mtp.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("MTP present") && stdout.contains("num_nextn_predict_layers 1"), "{stdout}");
    assert!(stdout.contains("--draft-model mtp"), "{stdout}");
}

/// A report piped into a reader that has gone (`mlx-k3 inspect DIR | head -0`) ends quietly: no panic
/// message and backtrace from `println!` on a closed pipe.
#[cfg(unix)]
#[test]
fn a_closed_stdout_ends_a_report_quietly() {
    use std::process::Stdio;
    let dir = fixture("a_latent_norm_attnres_mixed_2_8");
    let mut child = Command::new(env!("CARGO_BIN_EXE_mlx-k3"))
        .args(["inspect", dir.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader hangs up before the report is written
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(13), "ended by SIGPIPE (13 on Linux and macOS): {:?} {stderr}", out.status);
}

/// K3_POOL_STATS=1 makes the kernel thread pool print one line of counts at exit (a profiling aid); unset or
/// any other value prints nothing. With two threads some jobs go to the pool, and each has two tasks or more.
#[test]
fn pool_stats_are_printed_only_when_asked() {
    let dir = fixture("a_latent_norm_attnres_q4");
    let args = ["bench", "--model", dir.to_str().unwrap(), "--prompt-tokens", "5", "--gen-tokens", "3", "--json"];
    let (ok, _, stderr) = mlx_k3_env(&[("K3_POOL_STATS", "1"), ("K3_NUM_THREADS", "2")], &args);
    assert!(ok, "{stderr}");
    let line = stderr.lines().find(|l| l.starts_with("k3 pool: ")).unwrap_or_else(|| panic!("no pool line: {stderr}"));
    // The integer before `marker` (e.g. "182 pool jobs") or after it ("by workers 5").
    let before = |marker: &str| -> u64 {
        let head = &line[..line.find(marker).unwrap_or_else(|| panic!("{marker:?} not in {line}"))];
        head.trim_end().rsplit(' ').next().unwrap().parse().unwrap()
    };
    let after = |marker: &str| -> u64 {
        let tail = &line[line.find(marker).unwrap_or_else(|| panic!("{marker:?} not in {line}")) + marker.len()..];
        tail.trim_start().split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
    };
    let jobs = before(" pool jobs");
    let tasks = after("tasks run by the caller") + after("by workers");
    assert!(jobs > 0, "{line}");
    assert!(tasks >= 2 * jobs, "{line}");
    for value in [None, Some("0"), Some("yes")] {
        let mut vars = vec![("K3_NUM_THREADS", "2")];
        if let Some(v) = value {
            vars.push(("K3_POOL_STATS", v));
        }
        let (ok, _, stderr) = mlx_k3_env(&vars, &args);
        assert!(ok && !stderr.contains("k3 pool:"), "K3_POOL_STATS={value:?}: {stderr}");
    }
}

/// `bench --graph` prints one decode step's graph by primitive (its JSON form too), and the rows add up.
#[test]
fn bench_graph_reports_a_decode_step_by_primitive() {
    let dir = fixture("a_latent_norm_attnres_q4");
    let (ok, stdout, stderr) = mlx_k3(&["bench", "--model", dir.to_str().unwrap(), "--graph", "--prompt-tokens", "5"]);
    assert!(ok, "{stderr}");
    let mut lines = stdout.lines();
    let head = lines.next().unwrap();
    let total: usize = head
        .strip_prefix("one decode step after a 5-token prefill: ")
        .and_then(|t| t.strip_suffix(" graph nodes"))
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{stdout}"));
    lines.next(); // column titles
    let rows: Vec<(usize, String)> = lines
        .map(|l| {
            let mut f = l.split_whitespace();
            (f.next().unwrap().parse().unwrap(), f.next().unwrap().to_string())
        })
        .collect();
    assert_eq!(rows.iter().map(|r| r.0).sum::<usize>(), total, "{stdout}");
    assert!(rows.iter().any(|r| r.1 == "K3RmsNorm"), "{stdout}");
    // The gathered expert matmuls build no index plumbing around them (they took an arange, reshape,
    // broadcast and flatten chain each).
    assert!(rows.iter().any(|r| r.1 == "gather_affine_qmm"), "{stdout}");
    assert!(!rows.iter().any(|r| r.1 == "Arange"), "{stdout}");
    let (ok, stdout, stderr) =
        mlx_k3(&["bench", "--model", dir.to_str().unwrap(), "--graph", "--prompt-tokens", "5", "--json"]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["decode_step_nodes"].as_u64(), Some(total as u64));
    assert!(v["by_primitive"]["K3RmsNorm"]["consumers"].is_object(), "{stdout}");
}

#[test]
fn bad_input_exits_with_a_one_line_error() {
    let dir = fixture("b_latent_fullrank_every2");
    let d = dir.to_str().unwrap();
    for (args, expect) in [
        (vec!["logits", "--model", d, "--tokens", "1,x,3", "--out", "/tmp/never.safetensors"], "'x' is not a token id"),
        (
            vec!["logits", "--model", d, "--tokens", "1,999", "--out", "/tmp/never.safetensors"],
            "outside the vocabulary",
        ),
        (vec!["logits", "--model", "/nonexistent", "--tokens", "1", "--out", "/tmp/x"], "/nonexistent/config.json"),
        (vec!["inspect", "/nonexistent"], "/nonexistent/config.json"),
    ] {
        let (ok, _, stderr) = mlx_k3(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(stderr.starts_with("mlx-k3: error:") && stderr.contains(expect), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// `inspect --check` reads every float tensor: a clean checkpoint passes, a NaN names its tensor and file
/// and makes the command fail with a one-line error.
#[test]
fn inspect_check_reports_tensors_holding_nan_or_inf() {
    use mlx_k3::io::save_safetensors;
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("a_latent_norm_attnres");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), tmp.path().join(f)).unwrap();
    }
    let d = tmp.path().to_str().unwrap();
    let (ok, stdout, stderr) = mlx_k3(&["inspect", "--check", d]);
    assert!(ok && stdout.contains("check: no NaN or Inf in"), "{stdout}\n{stderr}");

    let path = tmp.path().join("model.safetensors");
    let st = Safetensors::load(&path).unwrap();
    let mut tensors: Vec<(String, mlx_k3::Array)> = st.arrays().unwrap().into_iter().collect();
    drop(st);
    let key = "language_model.model.layers.0.input_layernorm.weight";
    for (k, a) in tensors.iter_mut() {
        a.eval().unwrap();
        if k == key {
            let mut v = a.to_vec::<f32>().unwrap();
            (v[2], v[7]) = (f32::NAN, f32::INFINITY);
            *a = mlx_k3::Array::from_slice(&v, &a.shape()).unwrap();
        }
    }
    let refs: Vec<(&str, &mlx_k3::Array)> = tensors.iter().map(|(k, a)| (k.as_str(), a)).collect();
    save_safetensors(&path, &refs, &[("format", "mlx")]).unwrap();
    let (ok, stdout, stderr) = mlx_k3(&["inspect", "--check", d]);
    assert!(!ok, "{stdout}");
    assert!(stdout.contains(&format!("check: tensor '{key}' (model.safetensors): 1 NaN, 1 Inf")), "{stdout}");
    assert!(
        stderr.starts_with("mlx-k3: error:") && stderr.contains("1 of ") && stderr.contains("NaN or Inf"),
        "{stderr}"
    );
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
}

/// A config that claims 10^12 layers made `inspect` loop over them for hours; now it is a one-line error
/// naming the file and the field, at once (the child is killed after 60 s so a regression fails, not hangs).
#[test]
fn inspect_refuses_a_config_with_impossible_sizes_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("a_latent_norm_attnres");
    std::fs::copy(src.join("model.safetensors"), tmp.path().join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["text_config"]["num_hidden_layers"] = 1_000_000_000_000u64.into();
    cfg["text_config"]["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2, 3]);
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_mlx-k3"))
        .args(["inspect", tmp.path().to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("inspect still running after 60 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.starts_with("mlx-k3: error:") && stderr.contains("config.json"), "{stderr}");
    assert!(stderr.contains("num_hidden_layers"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
}

/// `bench --model` on a DeepSeek-V3.2 checkpoint (the DSA indexer; index_topk 4 under an 8-token prompt, so
/// the decode steps take the fused indexer step): it runs, and the state bytes it reads per decoded token
/// count every position's indexer key but only the kept positions' latents.
#[test]
fn bench_runs_a_deepseek_v32_model_and_counts_the_indexer_keys() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/deepseek_v32/b_plain_interleave");
    let args = ["bench", "--model", dir.to_str().unwrap(), "--prompt-tokens", "8", "--gen-tokens", "4", "--json"];
    let (ok, stdout, stderr) = mlx_k3(&args);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(v["generated_tokens"].as_u64(), Some(4), "{v}");
    assert!(v["decode_tok_s"].as_f64().unwrap() > 0.0, "{v}");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let n = |k: &str| cfg[k].as_u64().unwrap_or_else(|| panic!("{k} in the fixture's config"));
    let context = 8 + 4 / 2; // the prompt plus half the generated tokens, as bench counts the mean context
    let per_layer =
        context.min(n("index_topk")) * (n("kv_lora_rank") + n("qk_rope_head_dim")) + context * n("index_head_dim");
    let state = v["state_bytes_per_token"].as_u64().unwrap();
    let units = n("num_hidden_layers") * per_layer;
    assert!(state == units * 4 || state == units * 2, "state bytes {state}, expected {units} x 4 (f32) or x 2 (bf16)");
}

fn nano() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano")
}

/// `generate --draft-model` prints what plain greedy `generate` prints, and reports the drafting; a draft
/// model with another vocabulary is refused with a one-line error naming the flag; k3-nano's block drafter
/// prints the same text too.
#[test]
fn generate_with_a_draft_model_prints_the_same_text() {
    let n = nano();
    let base = ["generate", "--model", n.to_str().unwrap(), "--raw", "--prompt", "def", "--max-tokens", "24"];
    let (ok, plain, stderr) = mlx_k3(&base);
    assert!(ok, "{stderr}");
    let mut args = base.to_vec();
    args.extend(["--draft-model", n.to_str().unwrap(), "--num-draft", "4"]);
    let (ok, spec, stderr) = mlx_k3(&args);
    assert!(ok, "{stderr}");
    assert_eq!(spec, plain);
    assert!(stderr.contains("speculative: ") && stderr.contains("tokens per cycle"), "{stderr}");
    let other = fixture("b_latent_fullrank_every2");
    let mut args = base.to_vec();
    args.extend(["--draft-model", other.to_str().unwrap()]);
    let (ok, _, stderr) = mlx_k3(&args);
    assert!(!ok);
    assert!(stderr.starts_with("mlx-k3: error:") && stderr.contains("--draft-model"), "{stderr}");
    assert!(stderr.contains("vocab_size"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    // k3-nano's block drafter (detected from its config.json): the same text.
    let drafter = n.join("drafter");
    let mut args = base.to_vec();
    args.extend(["--draft-model", drafter.to_str().unwrap()]);
    let (ok, spec, stderr) = mlx_k3(&args);
    assert!(ok, "{stderr}");
    assert_eq!(spec, plain);
    assert!(stderr.contains("tokens per cycle"), "{stderr}");
    // --draft-model mtp on a model without an MTP layer (k3-nano is no DeepSeek-V3-family model): refused.
    let mut args = base.to_vec();
    args.extend(["--draft-model", "mtp"]);
    let (ok, _, stderr) = mlx_k3(&args);
    assert!(!ok);
    assert!(stderr.starts_with("mlx-k3: error:") && stderr.contains("--draft-model mtp"), "{stderr}");
    assert!(stderr.contains("DeepSeek-V3"), "{stderr}");
}

/// "speculative: C cycles, T tokens per cycle, A of D drafts accepted (P%), S plain steps, F fallbacks" ->
/// (C, S, F).
fn spec_counts(stderr: &str) -> (usize, usize, usize) {
    let line = stderr.lines().find(|l| l.starts_with("speculative: ")).unwrap_or_else(|| panic!("{stderr}"));
    let num = |word: &str| -> usize {
        let words: Vec<&str> = line.split([' ', ',']).filter(|w| !w.is_empty()).collect();
        let i = words.iter().position(|w| *w == word).unwrap_or_else(|| panic!("no '{word}' in {line}"));
        words[i - 1].parse().unwrap_or_else(|_| panic!("{line}"))
    };
    (num("cycles"), num("plain"), num("fallbacks"))
}

/// The gate's thresholds are flags: k3-nano drafting for itself keeps every draft and, weighed by tokens
/// (`--gate-cost tokens`), never falls back, while `--gate-short 8` (more tokens per cycle than a probe of
/// 3 drafts can give) falls back after the first probe and decodes the rest plainly. Weighed by time (the
/// default, whose decisions depend on the machine's timing), a zero speed threshold never falls back and
/// an impossible one (64 times plain decoding's speed, from cycles of at most 8 tokens) falls back after the
/// request's first probe. The text is the same every time. Bad values and gate flags that would change
/// nothing are refused, naming the flag, before the model loads.
#[test]
fn gate_flags_change_the_gate_and_bad_values_are_refused() {
    let n = nano();
    let base = ["generate", "--model", n.to_str().unwrap(), "--raw", "--prompt", "def", "--max-tokens", "40"];
    let (ok, plain, stderr) = mlx_k3(&base);
    assert!(ok, "{stderr}");
    let mut args = base.to_vec();
    args.extend(["--draft-model", n.to_str().unwrap()]);
    let (ok, spec, stderr) = mlx_k3(&args);
    assert!(ok, "{stderr}");
    assert_eq!(spec, plain, "the default gate");
    args.extend(["--gate-cost", "tokens"]);
    let (ok, spec, stderr) = mlx_k3(&args);
    assert!(ok, "{stderr}");
    assert_eq!(spec, plain);
    let (cycles, plain_steps, fallbacks) = spec_counts(&stderr);
    assert_eq!(fallbacks, 0, "{stderr}");
    // Every cycle keeps its drafts (k3-nano drafts for itself); only the last token may be plain.
    assert!(cycles >= 5 && plain_steps <= 1, "{stderr}");

    let mut strict = args.clone();
    strict.extend(["--gate-short", "8"]);
    let (ok, spec, stderr) = mlx_k3(&strict);
    assert!(ok, "{stderr}");
    assert_eq!(spec, plain);
    let (cycles, plain_steps, fallbacks) = spec_counts(&stderr);
    // The request's first probe is 2 cycles of 3 drafts (4 tokens each at best), then a fallback and 36
    // plain tokens (the next probe would come after 64).
    assert_eq!((cycles, fallbacks), (2, 1), "{stderr}");
    assert_eq!(plain_steps, 40 - 8, "{stderr}");

    // By time: 4 plain steps timed, then a probe of 2 cycles of 7 drafts (all kept: 16 tokens).
    let timed = |extra: &[&'static str]| {
        let mut a = base.to_vec();
        a.extend(["--draft-model", n.to_str().unwrap()]);
        a.extend(extra);
        let (ok, spec, stderr) = mlx_k3(&a);
        assert!(ok, "{stderr}");
        assert_eq!(spec, plain, "{extra:?}");
        spec_counts(&stderr)
    };
    let (cycles, plain_steps, fallbacks) = timed(&["--gate-speed-short", "64"]);
    assert_eq!((cycles, fallbacks, plain_steps), (2, 1, 40 - 16), "impossible speed");
    let (cycles, plain_steps, fallbacks) = timed(&[
        "--gate-cost",
        "time",
        "--gate-speed-short",
        "0",
        "--gate-speed-long",
        "0",
        "--gate-measure-steps",
        "2",
    ]);
    assert_eq!(fallbacks, 0, "zero speed");
    assert!(cycles >= 4 && (2..=3).contains(&plain_steps), "zero speed: {cycles} cycles, {plain_steps} plain");
    // A long window longer than the output and a short one of 3 cycles: the same text, with the flags taken.
    let mut windows = args.clone();
    windows.extend([
        "--gate-short-window",
        "3",
        "--gate-long-window",
        "4",
        "--gate-drafts",
        "2,4",
        "--gate-raise-at",
        "0.5",
    ]);
    let (ok, spec, stderr) = mlx_k3(&windows);
    assert!(ok, "{stderr}");
    assert_eq!(spec, plain);

    let draft = n.to_str().unwrap();
    for (extra, flag) in [
        (&["--draft-model", draft, "--gate-cost", "tokens", "--gate-short", "-1"][..], "--gate-short"),
        (&["--draft-model", draft, "--gate-cost", "tokens", "--gate-long", "NaN"][..], "--gate-long"),
        (&["--draft-model", draft, "--gate-short", "3"][..], "--gate-short applies with --gate-cost tokens"),
        (&["--draft-model", draft, "--gate-speed-short", "-1"][..], "--gate-speed-short"),
        (&["--draft-model", draft, "--gate-speed-long", "inf"][..], "--gate-speed-long"),
        (&["--draft-model", draft, "--gate-measure-steps", "0"][..], "--gate-measure-steps"),
        (
            &["--draft-model", draft, "--gate-cost", "tokens", "--gate-speed-long", "1"][..],
            "--gate-speed-long applies with --gate-cost time",
        ),
        (&["--draft-model", draft, "--gate-short-window", "0"][..], "--gate-short-window"),
        (&["--draft-model", draft, "--gate-short-window", "20"][..], "--gate-short-window"),
        (&["--draft-model", draft, "--gate-drafts", "5,3"][..], "--gate-drafts"),
        (&["--draft-model", draft, "--gate-raise-at", "0.5"][..], "--gate-raise-at"),
        (&["--draft-model", draft, "--gate-raise-at", "0.9,0.5"][..], "--gate-raise-at"),
        (&["--draft-model", draft, "--num-draft", "0"][..], "--num-draft"),
        (&["--gate-short", "3"][..], "--gate-short"),
        (&["--draft-model", draft, "--no-gate", "--gate-probe-after", "8"][..], "--gate-probe-after"),
    ] {
        let mut args = base.to_vec();
        args.extend(extra);
        let (ok, _, stderr) = mlx_k3(&args);
        assert!(!ok, "{extra:?} was accepted");
        assert!(stderr.starts_with("mlx-k3: error:") && stderr.contains(flag), "{extra:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{extra:?}: {stderr}");
    }
    // `chat` and `serve` take the same flags, checked the same way before anything loads or listens.
    for args in [
        &["chat", "--draft-model", draft, "--gate-drafts", "0,3", "--gate-raise-at", "0.5"][..],
        &["serve", "--port", "0", "--draft-model", draft, "--gate-drafts", "0,3", "--gate-raise-at", "0.5"][..],
    ] {
        let (ok, _, stderr) = mlx_k3(args);
        assert!(!ok && stderr.starts_with("mlx-k3: error:") && stderr.contains("--gate-drafts"), "{args:?}: {stderr}");
    }
}

#[test]
fn generate_refuses_images_for_a_model_without_a_vision_tower() {
    // k3-nano is text only; the image is a real PNG (from the preprocessing fixtures), so the refusal is the
    // model's, not the decoder's.
    let nano = nano();
    let png = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/vision_preprocess/rgb.png");
    assert!(png.exists(), "{} is missing", png.display());
    let (ok, _, err) = mlx_k3(&[
        "generate",
        "--model",
        nano.to_str().unwrap(),
        "--prompt",
        "What is in the picture?",
        "--image",
        png.to_str().unwrap(),
        "--max-tokens",
        "2",
    ]);
    assert!(!ok);
    assert!(err.contains("no vision tower"), "{err}");
    let (ok, _, err) =
        mlx_k3(&["generate", "--model", nano.to_str().unwrap(), "--prompt", "x", "--image", "/no/such.png"]);
    assert!(!ok);
    assert!(err.contains("/no/such.png"), "{err}");
}

#[test]
fn generate_takes_an_image_for_a_vision_checkpoint() {
    // The end-to-end vision fixture (tests/vision_chat.rs checks its tokens against mlx-vlm): the image
    // expands to the prompt mlx-vlm's processor builds (173 tokens for this chat, per the fixture manifest).
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/vision_chat");
    let png = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/vision_preprocess/rgb.png");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let case = &manifest["cases"][0];
    let text = case["messages"][0]["content"][1]["text"].as_str().unwrap();
    let (ok, out, err) = mlx_k3(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--image",
        png.to_str().unwrap(),
        "--prompt",
        text,
        "--max-tokens",
        "4",
    ]);
    assert!(ok, "{err}");
    let want = format!("prompt: {} tokens", case["prompt_tokens"]);
    assert!(out.contains(&want) || err.contains(&want), "{out}\n{err}");
}

#[test]
fn plan_counts_the_vision_tower_on_every_rank() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/vision_chat");
    let (ok, out, err) = mlx_k3(&["plan", "--model", dir.to_str().unwrap(), "--ranks", "2"]);
    assert!(ok, "{err}");
    let row = out.lines().find(|l| l.starts_with("vision tower")).unwrap_or_else(|| panic!("no vision row:\n{out}"));
    // The tower's bytes, independently: every vision_tower.* / mm_projector.* tensor of the checkpoint.
    let st = Safetensors::load(dir.join("model.safetensors")).unwrap();
    let bytes: usize = st
        .keys()
        .iter()
        .filter(|k| k.starts_with("vision_tower.") || k.starts_with("mm_projector."))
        .map(|k| st.get(k).unwrap().nbytes())
        .sum();
    let cells: Vec<&str> = row.split_whitespace().skip(2).collect();
    let want = format!("{:.2}", bytes as f64 / 1024.0);
    assert_eq!(cells.len(), 6, "{row}");
    assert!(cells.chunks(2).all(|c| c[0] == want && c[1] == "KiB"), "{row}: want {want} KiB on every column");
}

fn video_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/video").join(name)
}

#[test]
fn generate_takes_an_image_for_a_k25_checkpoint() {
    // The Kimi K2.5 vision fixture (tests/vision_chat.rs checks it against mlx-vlm: the checkpoint's chat
    // template renders the image part, its pad is repeated to the image's tokens): the program's prompt is
    // the processor's (60 tokens for this chat, per the manifest) and its greedy text the library's.
    use mlx_k3::chat::{ChatMessage, ChatOptions, ThinkingEffort};
    use mlx_k3::generate::{GenerateOptions, ImageInput, Pipeline, PromptCache};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/vision_chat_k25");
    let png = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/vision_preprocess/rgb.png");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let case = &manifest["cases"][0];
    let text = case["messages"][0]["content"][1]["text"].as_str().unwrap();
    let args = ["generate", "--model", dir.to_str().unwrap(), "--image", png.to_str().unwrap(), "--prompt", text];
    let (ok, out, err) = mlx_k3(&[&args[..], &["--max-tokens", "4"]].concat());
    assert!(ok, "{err}");
    assert!(err.contains(&format!("prompt: {} tokens", case["prompt_tokens"])), "{err}");
    let p = Pipeline::load(&dir, mlx_k3::model::LoadOptions::default(), &mut |_, _| {}).unwrap();
    let msgs: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
    let opts = ChatOptions::thinking(ThinkingEffort::Auto);
    let (ids, media) = p.encode_chat_media(&msgs, None, &opts, &[ImageInput::read(&png).unwrap()]).unwrap();
    let g = GenerateOptions { max_tokens: 4, ..GenerateOptions::default() };
    let r = p.generate_media(&mut PromptCache::new(), &ids, media.as_ref(), &g, |_| true).unwrap();
    assert_eq!(out, format!("{}\n", r.text));
}

#[test]
fn generate_takes_a_video_as_the_library_does() {
    // The Kimi K3 vision fixture (tests/vision_chat.rs checks its images against mlx-vlm) with a directory of
    // six frames: chunks of 4 and 2 frames, each with its start time in the prompt. The program's greedy
    // text and prompt length must be what the library gives for the same frames.
    video_as_the_library_does("vision_chat");
}

#[test]
fn generate_takes_a_video_for_a_k25_checkpoint() {
    // The same for Kimi K2.5: its chat template writes the video placeholder, which becomes the chunk prompts.
    // (mlx-vlm 0.7.10 takes no K2.5 video, so there is no reference beyond the library.)
    video_as_the_library_does("vision_chat_k25");
}

fn video_as_the_library_does(fixture: &str) {
    use mlx_k3::chat::{ChatMessage, ChatOptions, ThinkingEffort};
    use mlx_k3::generate::{GenerateOptions, MediaInput, Pipeline, PromptCache, VideoInput};
    use mlx_k3::media::VideoOptions;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures").join(fixture);
    let frames = video_fixture("frames");
    let text = "What happens in the video?";
    let (ok, out, err) = mlx_k3(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--video",
        frames.to_str().unwrap(),
        "--prompt",
        text,
        "--max-tokens",
        "6",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("6 of 6 frames (frame directory") && err.contains("2 chunks"), "{err}");

    let p = Pipeline::load(&dir, mlx_k3::model::LoadOptions::default(), &mut |_, _| {}).unwrap();
    let video = VideoInput::read(&frames, &VideoOptions::default()).unwrap();
    let parts = serde_json::json!([{"type": "video"}, {"type": "text", "text": text}]);
    let msgs = [ChatMessage { content: parts, ..ChatMessage::new("user", "") }];
    let prompt = p
        .encode_chat_visual(&msgs, None, &ChatOptions::thinking(ThinkingEffort::Auto), &[MediaInput::Video(video)])
        .unwrap();
    assert_eq!(prompt.processed.iter().map(|c| c.grid[0]).collect::<Vec<_>>(), [4, 2]);
    // Each chunk's prompt: its start time, then the video marker and the chunk's pads.
    let text_of = p.tokenizer.decode(&prompt.ids).unwrap();
    for (stamp, chunk) in ["00:00:00.000", "00:00:02.000"].iter().zip(&prompt.processed) {
        let pads = "<|media_pad|>".repeat(chunk.tokens);
        let want = format!("{stamp}<|media_begin|>video<|media_content|>{pads}<|media_end|>");
        assert!(text_of.contains(&want), "{text_of}\nwant {want}");
    }
    let media = p.encode_media(&prompt).unwrap();
    let opts = GenerateOptions { max_tokens: 6, ..GenerateOptions::default() };
    let r = p.generate_media(&mut PromptCache::new(), &prompt.ids, Some(&media), &opts, |_| true).unwrap();
    assert_eq!(out, format!("{}\n", r.text));
    let want = format!("prompt: {} tokens", prompt.ids.len());
    assert!(err.contains(&want), "{err}\nwant {want}");
    // The frames matter: the same prompt without the video's features gives other logits, so another
    // prompt length at least (the video's pad tokens are gone).
    assert!(
        prompt.ids.len()
            > p.encode_chat(&[ChatMessage::new("user", text)], None, &ChatOptions::default()).unwrap().len()
    );
}

#[test]
fn generate_refuses_bad_videos_with_one_line_errors() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/vision_chat");
    let model = dir.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let junk = tmp.path().join("clip.mp4");
    std::fs::write(&junk, b"\x00\x00\x00\x18ftypmp42 not really a video").unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let cases: [(Vec<(&str, &str)>, Vec<&str>, &str); 4] = [
        (vec![], vec!["--video", "/no/such/clip.mp4"], "/no/such/clip.mp4"),
        (vec![], vec!["--video", empty.to_str().unwrap()], "no .png"),
        (vec![], vec!["--video-fps", "2"], "--video-fps"),
        (vec![("K3_FFPROBE", "/nonexistent/ffprobe")], vec!["--video", junk.to_str().unwrap()], "K3_FFPROBE"),
    ];
    for (env, extra, want) in cases {
        let mut args = vec!["generate", "--model", model, "--prompt", "x", "--max-tokens", "1"];
        args.extend(extra);
        let (ok, _, stderr) = mlx_k3_env(&env, &args);
        assert!(!ok, "{args:?}");
        assert!(stderr.starts_with("mlx-k3: error:") && stderr.contains(want), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    }
}
