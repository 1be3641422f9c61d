//! The `mlx-k3` command line (clap). Subcommands report errors as one line on stderr and exit non-zero.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod compress;
pub mod default_model;
pub mod dist;
mod dist_check;
pub mod gate;
pub mod gen;
mod info;
pub mod inspect;
mod logits;
mod serve;
mod template;

/// Run Kimi K3-class MoE models on MLX.
#[derive(Parser, Debug)]
#[command(name = "mlx-k3", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Layout of codebook weights in memory: `compact` (as stored, 1.5625 bits per weight) or `ternary` (built at
    /// load, lossless, 2.5625 bits per weight; faster CPU kernels, CPU streams only). Default:
    /// K3_CODEBOOK_LAYOUT, else compact.
    #[arg(long, global = true, value_name = "compact|ternary")]
    codebook_layout: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the MLX version, where it was found, the devices and distributed back-ends available.
    Info,
    /// Check MLX distributed set-up: every rank all_sums and all_gathers a known array and verifies the
    /// result. Start it with MLX's launcher, e.g. `mlx.launch -n 2 --backend ring $(which mlx-k3) dist-check`.
    DistCheck(dist_check::Args),
    /// Generate text from a prompt (streamed), then print statistics.
    Generate(gen::GenerateArgs),
    /// Interactive chat with history and prompt-cache reuse between turns.
    Chat(gen::ChatArgs),
    /// Summarize a checkpoint: architecture, and per tensor class the parameters, bytes, bits per parameter
    /// and formats (reads only headers, no tensor data).
    Inspect(inspect::Args),
    /// One forward pass over the given token ids; writes the f32 logits [T, vocab] under the key `logits`.
    Logits(logits::Args),
    /// Per-rank weight bytes by tensor class for a model split over N ranks (expert parallel, optionally
    /// tensor parallel), as `--distributed` would load it; reads only headers.
    Plan(dist::PlanArgs),
    /// Benchmarks: decode/prefill tok/s, time to first token, peak memory and bytes read per token of a
    /// checkpoint (--model), the memory read bandwidth (--bandwidth), the fused router (--router).
    Bench(bench::Args),
    /// Re-encode a checkpoint per a recipe (format per tensor class, clip search, codebook/MXFP4 tiers), one
    /// decoder layer at a time, into a resumable output folder.
    Convert(compress::ConvertArgs),
    /// Run calibration text through a model: importance (mean x^2 per input column, per expert), routing
    /// statistics and REAP saliency, saved as safetensors.
    Calibrate(compress::CalibrateArgs),
    /// Re-select a tiered checkpoint's MXFP4 experts for a language/domain profile, same count per layer.
    Retier(compress::RetierArgs),
    /// REAP expert pruning: keep the N most salient experts per MoE layer, rewrite router rows and biases.
    Prune(compress::PruneArgs),
    /// DWQ: distil a build's quantization scales and biases toward the teacher, one decoder layer at a time
    /// (validation KL per layer on held-out windows, monotone rollback), into a resumable output folder.
    Dwq(compress::DwqArgs),
    /// Perplexity, or KL(teacher || build) with top-1 flips, on identical windows.
    #[command(subcommand)]
    Eval(compress::EvalCommand),
    /// Serve the model over HTTP: OpenAI-compatible API, /api/chat (SSE, sessions), metrics, web chat page.
    Serve(serve::Args),
    /// Print the prompt a conversation renders to with the checkpoint's chat encoding (Kimi K3's, its
    /// chat_template, Kimi K2's, or Kimi K2-style tokens), or its token ids, as the engine would encode it.
    Template(template::Args),
}

/// Parses the command line and runs the subcommand.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let reporting = match &cli.command {
        Command::Info | Command::Inspect(_) | Command::Plan(_) | Command::Bench(_) | Command::Template(_) => true,
        // A rank that wrote to a peer's closed socket would die of SIGPIPE with no message.
        Command::Logits(a) => !a.dist.is_distributed(),
        Command::Generate(a) => !a.model.dist.is_distributed(),
        _ => false,
    };
    if reporting {
        quiet_on_closed_stdout();
    }
    if let Some(l) = &cli.codebook_layout {
        match mlx_k3::codebook::CodebookLayout::parse(l) {
            Ok(l) => mlx_k3::codebook::set_load_layout(Some(l)),
            Err(e) => {
                eprintln!("mlx-k3: error: --codebook-layout: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let result = match cli.command {
        Command::Info => info::run(),
        Command::DistCheck(args) => dist_check::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Generate(args) => gen::generate(args),
        Command::Chat(args) => gen::chat(args),
        Command::Logits(args) => logits::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Plan(args) => dist::plan(args),
        Command::Bench(args) => bench::run(args),
        Command::Convert(args) => compress::run_convert(args),
        Command::Calibrate(args) => compress::run_calibrate(args),
        Command::Retier(args) => compress::run_retier(args),
        Command::Prune(args) => compress::run_prune(args),
        Command::Dwq(args) => compress::run_dwq(args),
        Command::Eval(cmd) => compress::run_eval(cmd),
        Command::Template(args) => template::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mlx-k3: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Rust ignores SIGPIPE, so `println!` to a closed pipe (`mlx-k3 bench ... | head`) panics with a backtrace.
/// The reporting commands (and a single-process `generate`) take the default action instead and end quietly,
/// as other command-line tools do. Not for commands that own sockets (serve, distributed ranks), where a peer
/// hanging up must be an error.
fn quiet_on_closed_stdout() {
    #[cfg(unix)]
    // SAFETY: signal() with SIG_DFL only changes how the process reacts to SIGPIPE; no Rust state depends on it.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
