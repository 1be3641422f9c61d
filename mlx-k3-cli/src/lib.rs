//! The `mlx-k3` program: the command line (`cli`, one module per subcommand), the engine thread that owns a
//! loaded model (`engine`) and the HTTP server with the web chat (`server`), over the `mlx_k3` library.
//!
//! A library only so that `src/main.rs` and the fuzz targets (`fuzz/`) share it: [`main`] is the program,
//! [`requests`] the server's request parsing. Nothing here is a stable API.
use std::process::ExitCode;

mod cli;
mod engine;
mod server;

/// The `mlx-k3` program.
pub fn main() -> ExitCode {
    cli::main()
}

/// How the server turns request bodies into checked requests, without a server or a model: each body is
/// parsed by [`parse_json`] (malformed JSON, wrong types and unknown fields are 400s naming the field) and
/// then checked by its endpoint's `check` (every value it cannot honour is a 400 naming the field).
#[doc(hidden)]
pub mod requests {
    pub use crate::server::error::{parse_json, ApiError};
    pub use crate::server::openai::{
        check_chat, check_completion, ChatRequest, CheckedChat, CheckedCompletion, CompletionRequest,
    };
    pub use crate::server::prompt::Prompt;
    pub use crate::server::web_chat::{check as check_web_chat, CheckedWebChat, StopRequest, WebChatRequest};
}
