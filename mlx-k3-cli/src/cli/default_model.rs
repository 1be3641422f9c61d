//! The model `generate`, `chat` and `serve` run without `--model`: k3-nano, from the source tree this program
//! was built from (`models/k3-nano`, as `cargo run --example generate` does), and the note that tells a new
//! user what that model is.

use std::path::{Path, PathBuf};

use mlx_k3::{Error, Result};

/// What k3-nano is, said wherever a new user meets it (the example, `chat`'s banner, `serve`, the web page).
pub const K3_NANO_NOTE: &str =
    "k3-nano is a 3M-parameter model trained on Python code: expect Python-like text, not answers";

/// `models/k3-nano` of the source tree at build time.
pub fn default_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano")
}

/// The checkpoint folder to load: `--model` when given, else k3-nano, saying so on stderr. Without `--model`
/// and without the source tree (a binary copied elsewhere) it is an error that says to pass `--model`.
pub fn resolve(model: Option<&Path>) -> Result<PathBuf> {
    if let Some(m) = model {
        return Ok(m.to_path_buf());
    }
    let dir = default_dir();
    let dir = dir.canonicalize().ok().filter(|d| d.join("config.json").is_file()).ok_or_else(|| {
        Error::invalid(
            "cli",
            format!(
                "no --model given, and the default model k3-nano is not at {} (the models/k3-nano folder of the \
                 mlx-k3 source tree this program was built from): pass --model DIR",
                dir.display()
            ),
        )
    })?;
    eprintln!("using the default model k3-nano ({}): {K3_NANO_NOTE}", dir.display());
    Ok(dir)
}

/// Whether `dir` is k3-nano (by its folder name, as the server's model id and the web page know it).
pub fn is_k3_nano(dir: &Path) -> bool {
    dir.file_name().is_some_and(|n| n == "k3-nano")
}
