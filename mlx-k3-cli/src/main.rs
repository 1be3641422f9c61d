//! The `mlx-k3` program; it lives in the crate's library (`src/lib.rs`).
use std::process::ExitCode;

fn main() -> ExitCode {
    mlx_k3_cli::main()
}
