//! The `mlx-k3` command-line program. Each subcommand lives in `mlx_k3::cli`.
use std::process::ExitCode;

fn main() -> ExitCode {
    mlx_k3::cli::main()
}
