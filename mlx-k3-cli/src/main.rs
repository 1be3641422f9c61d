//! The `mlx-k3` program: the command line (`cli`, one module per subcommand), the engine thread that owns a
//! loaded model (`engine`) and the HTTP server with the web chat (`server`), over the `mlx_k3` library.
use std::process::ExitCode;

mod cli;
mod engine;
mod server;

fn main() -> ExitCode {
    cli::main()
}
