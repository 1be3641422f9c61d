//! `mlx-k3 serve`: the HTTP server (see [`crate::server`]).

use std::path::PathBuf;

use clap::Args as ClapArgs;

use crate::engine::EngineConfig;
use crate::server::{self, ServerConfig};
use mlx_k3::model::LoadOptions;
use mlx_k3::{Dtype, Error, Result};

/// Options of `serve`.
#[derive(ClapArgs, Debug)]
pub(super) struct Args {
    /// Checkpoint folder (config.json, model*.safetensors, tokenizer) [default: k3-nano from the source tree].
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to bind; the default serves this machine only.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0 picks a free one; the address is printed on stdout).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health and the chat page's static files.
    #[arg(long)]
    api_key: Option<String>,
    /// Activation dtype: float32, bfloat16 or float16 (default: float32 on a CPU, bfloat16 on a GPU).
    #[arg(long)]
    dtype: Option<String>,
    /// Requests that may wait behind the running one; more are answered 503.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// MiB of KV state kept for sessions; least-recently-used sessions are dropped beyond it.
    #[arg(long, default_value_t = 2048)]
    session_cache_mib: usize,
    #[command(flatten)]
    dist: super::dist::DistArgs,
}

pub(super) fn run(args: Args) -> Result<()> {
    let dtype = match args.dtype.as_deref() {
        None => None,
        Some(n) => Some(
            Dtype::from_name(n)
                .filter(|d| d.is_float())
                .ok_or_else(|| Error::invalid("cli", format!("--dtype: '{n}' is not a float dtype")))?,
        ),
    };
    if args.max_queue == 0 {
        return Err(Error::invalid("cli", "--max-queue must be at least 1"));
    }
    let comm = args.dist.join()?;
    let engine = EngineConfig {
        model_dir: super::default_model::resolve(args.model.as_deref())?,
        load: LoadOptions { dtype, lazy: false, shard: None },
        max_queue: args.max_queue,
        session_cache_bytes: args.session_cache_mib.saturating_mul(1 << 20),
        comm: comm.clone(),
    };
    if comm.as_ref().is_some_and(|c| c.shard().rank != 0) {
        // Rank 0 serves HTTP and sends every request to the other ranks, which compute their part of it.
        return crate::engine::run_worker(engine);
    }
    server::run(ServerConfig {
        engine,
        host: args.host,
        port: args.port,
        api_key: args.api_key.filter(|k| !k.is_empty()),
    })
}
