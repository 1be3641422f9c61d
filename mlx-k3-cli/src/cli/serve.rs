//! `mlx-k3 serve`: the HTTP server (see [`crate::server`] and `docs/server.md`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args as ClapArgs;

use crate::engine::EngineConfig;
use crate::server::{self, Access, Limits, ServerConfig};
use mlx_k3::model::LoadOptions;
use mlx_k3::{Dtype, Error, Result};

/// The environment variable that may hold the API key (kept out of `ps`, unlike `--api-key`).
const KEY_ENV: &str = "MLX_K3_API_KEY";

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
    /// Require `Authorization: Bearer KEY` on every route but /health and the chat page's static files
    /// (repeatable: several keys, whose sessions are kept apart). A key given here shows in `ps`: prefer the
    /// MLX_K3_API_KEY environment variable or --api-key-file.
    #[arg(long)]
    api_key: Vec<String>,
    /// A file of API keys, one a line (blank lines and lines starting with # are skipped).
    #[arg(long, value_name = "PATH")]
    api_key_file: Option<PathBuf>,
    /// Also accept requests whose Host header is NAME (repeatable; `*` accepts any). IP addresses,
    /// localhost and the --host name are always accepted.
    #[arg(long, value_name = "NAME")]
    allowed_host: Vec<String>,
    /// Let web pages from ORIGIN (`https://app.example`) call the API, with CORS headers and preflights
    /// (repeatable; `*` allows any origin). Without it, browsers may only call it from the server's own page.
    #[arg(long, value_name = "ORIGIN")]
    cors_origin: Vec<String>,
    /// Largest request body in MiB (a Content-Length above it is refused with 413 before the body is read).
    #[arg(long, default_value_t = 8.0, value_name = "MIB")]
    max_body_mib: f64,
    /// Seconds a client has to send a request's headers; also how long an idle connection is kept.
    #[arg(long, default_value_t = 30.0, value_name = "SECS")]
    header_timeout: f64,
    /// Seconds a client has to send a request's whole body.
    #[arg(long, default_value_t = 60.0, value_name = "SECS")]
    body_timeout: f64,
    /// On SIGTERM or Ctrl-C: seconds running requests get to finish before the server exits anyway.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    shutdown_timeout: f64,
    /// Activation dtype: float32, bfloat16 or float16 (default: float32 on a CPU, bfloat16 on a GPU).
    #[arg(long)]
    dtype: Option<String>,
    /// Requests that may wait behind the running one; more are answered 503.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// MiB of KV state kept for sessions (snapshots included); least-recently-used sessions are dropped
    /// beyond it.
    #[arg(long, default_value_t = 2048)]
    session_cache_mib: usize,
    /// Speculative decoding with this draft model (sharing the tokenizer), a block drafter's folder
    /// (models/k3-nano/drafter), or `mtp` (the MTP layer of the model's DeepSeek-V3-family checkpoint); a
    /// request opts out with `"speculative": false`.
    #[arg(long, value_name = "DIR|mtp")]
    draft_model: Option<PathBuf>,
    /// The most tokens drafted per cycle (with --draft-model).
    #[arg(long, default_value_t = 7)]
    num_draft: usize,
    /// With --draft-model: always draft --num-draft tokens (no adaptive gate).
    #[arg(long)]
    no_gate: bool,
    #[command(flatten)]
    gate: super::gate::GateArgs,
    #[command(flatten)]
    dist: super::dist::DistArgs,
}

fn seconds(flag: &str, v: f64) -> Result<Duration> {
    if !(v > 0.0 && v <= 1e6) {
        return Err(Error::invalid("cli", format!("{flag} must be a number of seconds above 0, got {v}")));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Keys from `--api-key`, `MLX_K3_API_KEY` and `--api-key-file`, without duplicates.
fn api_keys(flags: &[String], file: Option<&Path>) -> Result<Vec<String>> {
    let mut keys: Vec<String> = flags.iter().map(|k| k.trim().to_string()).filter(|k| !k.is_empty()).collect();
    if let Some(k) = std::env::var_os(KEY_ENV) {
        let k = k.into_string().map_err(|_| Error::invalid("cli", format!("{KEY_ENV} is not valid UTF-8")))?;
        keys.extend(Some(k.trim().to_string()).filter(|k| !k.is_empty()));
    }
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let before = keys.len();
        keys.extend(text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(str::to_string));
        if keys.len() == before {
            return Err(Error::invalid("cli", format!("--api-key-file {}: the file holds no key", path.display())));
        }
        warn_if_readable_by_others(path);
    }
    if let Some(bad) = keys.iter().find(|k| !k.bytes().all(|b| b.is_ascii_graphic())) {
        let shown: String = bad.chars().take(4).collect();
        return Err(Error::invalid(
            "cli",
            format!("an API key ('{shown}...') holds spaces or characters other than printable ASCII"),
        ));
    }
    keys.sort();
    keys.dedup();
    Ok(keys)
}

#[cfg(unix)]
fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(m) = std::fs::metadata(path) {
        if m.permissions().mode() & 0o077 != 0 {
            eprintln!("mlx-k3 serve: warning: {} can be read by other users (chmod 600 it)", path.display());
        }
    }
}

#[cfg(not(unix))]
fn warn_if_readable_by_others(_: &Path) {}

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
    if !(args.max_body_mib > 0.0 && args.max_body_mib <= 1e6) {
        return Err(Error::invalid("cli", format!("--max-body-mib must be above 0, got {}", args.max_body_mib)));
    }
    let limits = Limits {
        max_body_bytes: (args.max_body_mib * (1u64 << 20) as f64) as usize,
        header_timeout: seconds("--header-timeout", args.header_timeout)?,
        body_timeout: seconds("--body-timeout", args.body_timeout)?,
        shutdown_timeout: seconds("--shutdown-timeout", args.shutdown_timeout)?,
    };
    for o in args.cors_origin.iter().filter(|o| o.as_str() != "*") {
        if !(o.starts_with("http://") || o.starts_with("https://")) {
            return Err(Error::invalid(
                "cli",
                format!("--cors-origin '{o}' is not an origin like https://app.example (scheme://host[:port])"),
            ));
        }
    }
    let api_keys = api_keys(&args.api_key, args.api_key_file.as_deref())?;
    let gate_config = args.gate.config(args.draft_model.is_some(), !args.no_gate)?;
    let comm = args.dist.join()?;
    let engine = EngineConfig {
        model_dir: super::default_model::resolve(args.model.as_deref())?,
        load: LoadOptions { dtype, lazy: false, shard: None },
        max_queue: args.max_queue,
        session_cache_bytes: args.session_cache_mib.saturating_mul(1 << 20),
        comm: comm.clone(),
        draft: match args.draft_model {
            Some(d) => Some((d, super::gen::spec_options(args.num_draft, !args.no_gate, gate_config)?)),
            None => None,
        },
    };
    if comm.as_ref().is_some_and(|c| c.shard().rank != 0) {
        // Rank 0 serves HTTP and sends every request to the other ranks, which compute their part of it.
        return crate::engine::run_worker(engine);
    }
    let access = Access::new(&args.host, &args.allowed_host, &args.cors_origin);
    server::run(ServerConfig { engine, host: args.host, port: args.port, api_keys, access, limits })
}
