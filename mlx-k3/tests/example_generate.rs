//! The README's run command, `cargo run --release --example generate`: with no arguments it runs k3-nano and
//! tells the user what k3-nano is before its output.

use std::path::PathBuf;
use std::process::Command;

/// The `generate` example built with this test's profile (`cargo test` builds examples; a filtered run may
/// not have, so it is built here then).
fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap().to_path_buf();
    let path = profile_dir.join("examples").join("generate");
    if !path.exists() {
        let mut cargo = Command::new(env!("CARGO"));
        cargo.args(["build", "--example", "generate", "-p", "mlx-k3"]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cargo.arg("--release");
        }
        assert!(cargo.status().unwrap().success(), "cannot build the generate example");
    }
    path
}

#[test]
fn example_says_what_k3_nano_is() {
    let out = Command::new(example()).args(["--max-tokens", "8", "--temp", "0"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let note = "k3-nano is a 3M-parameter model trained on Python code: expect Python-like text, not answers";
    let at = stderr.find(note).unwrap_or_else(|| panic!("no note on k3-nano:\n{stderr}"));
    assert!(stderr[..at].contains("loading "), "the note follows the loading line:\n{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("import os"));
}
