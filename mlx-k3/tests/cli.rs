//! The `mlx-k3` program end to end: `logits` reproduces mlx-lm's prompt logits, `inspect` summarizes a
//! checkpoint, and bad input exits non-zero with a one-line error.

use std::path::{Path, PathBuf};
use std::process::Command;

use mlx_k3::io::Safetensors;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/k3").join(name)
}

fn mlx_k3(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mlx-k3")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
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
