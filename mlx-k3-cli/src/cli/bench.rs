//! `mlx-k3 bench`: end-to-end generation figures for a checkpoint (decode tok/s, prefill tok/s, time to
//! first token, peak memory, bytes read per decoded token and the share of the measured read bandwidth),
//! the machine's memory read bandwidth, and the fused router against its plain-ops composition.
//!
//! `scripts/bench_e2e.py` runs this next to mlx-lm on the same checkpoint and machine.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args as ClapArgs;

use mlx_k3::generate::speculative::{generate_speculative, Drafter, RandomDrafter, Rollback, SpecOptions, SpecStats};
use mlx_k3::generate::{generate_tokens, GenerateOptions, PromptCache, PromptEncoder};
use mlx_k3::kernels::{self, RouterParams};
use mlx_k3::model::{KimiK3, LoadOptions};
use mlx_k3::{memory, random, Array, Device, Dtype, Error, Result};

/// Options of `bench`.
#[derive(ClapArgs, Debug)]
pub(super) struct Args {
    /// The checkpoint folder: time prefill and decode on it.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt length (random token ids; the prefill runs as one chunk).
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens to generate (greedy).
    #[arg(long, default_value_t = 32)]
    gen_tokens: usize,
    /// Measure the memory read bandwidth (a streaming read of 1 GiB over all threads).
    #[arg(long)]
    bandwidth: bool,
    /// Time the fused MoE router against the plain-ops composition (896 experts, top-16).
    #[arg(long)]
    router: bool,
    /// With --model: print the graph of one decode step instead of timing (MLX nodes by primitive, most
    /// first, and which primitives consume each kind's outputs), after a prefill of --prompt-tokens.
    #[arg(long)]
    graph: bool,
    /// Print one JSON object (last line) instead of the table.
    #[arg(long)]
    json: bool,
    /// With --model: speculative decoding with this draft model (sharing the tokenizer; or a block drafter's
    /// folder, whose config.json says k3_block_drafter; or `mtp`, the model's own MTP layer) against plain decoding in the same run, greedy, on a
    /// code and a prose prompt (or --spec-prompts): tokens per cycle, accept rate, tok/s of both, the gate's
    /// decisions.
    #[arg(long, value_name = "DIR")]
    draft_model: Option<PathBuf>,
    /// With --draft-model/--random-draft: prompts from a token stream (safetensors with int32 `tokens` and
    /// `doc_starts`, e.g. models/k3-nano/heldout.safetensors) instead of the built-in two: for each of the
    /// first --spec-docs documents, its first 32 tokens ("doc": a module's docstring) and 32 tokens from its
    /// middle ("code").
    #[arg(long, value_name = "FILE")]
    spec_prompts: Option<PathBuf>,
    /// Documents --spec-prompts takes prompts from.
    #[arg(long, default_value_t = 6)]
    spec_docs: usize,
    /// With --model: as --draft-model, with a drafter proposing random tokens (the gate's worst case).
    #[arg(long, conflicts_with = "draft_model")]
    random_draft: bool,
    /// The most tokens drafted per cycle.
    #[arg(long, default_value_t = 7)]
    num_draft: usize,
    /// Always draft --num-draft tokens (no adaptive gate).
    #[arg(long)]
    no_gate: bool,
    /// How the target's KDA state is rolled back after a rejection: record (the state after each verified
    /// position) or recompute (run the kept tokens again).
    #[arg(long, default_value = "record")]
    rollback: String,
    #[command(flatten)]
    gate: super::gate::GateArgs,
    /// Runs of each speculative measurement (the fastest is reported; this machine is shared and noisy).
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

pub(super) fn run(args: Args) -> Result<()> {
    if args.bandwidth {
        let (gbs, threads) = read_bandwidth();
        emit(args.json, &format!("memory read bandwidth: {gbs:.2} GB/s over {threads} threads"), || {
            format!("{{\"read_bandwidth_gb_s\": {gbs:.4}, \"threads\": {threads}}}")
        });
        return Ok(());
    }
    if args.router {
        return bench_router(args.json);
    }
    let Some(dir) = args.model.as_ref() else {
        return Err(Error::invalid("bench", "give --model DIR, --bandwidth or --router"));
    };
    if args.draft_model.is_some() || args.random_draft {
        return bench_speculative(dir, &args);
    }
    // Gate flags without a drafter are refused, not ignored.
    args.gate.config(false, true)?;
    bench_model(dir, &args)
}

fn emit(json: bool, text: &str, obj: impl FnOnce() -> String) {
    if json {
        println!("{}", obj());
    } else {
        println!("{text}");
    }
}

/// Bytes one decode step reads: every weight once, expert stacks only for the routed experts (top_k of E
/// per MoE layer; at batch 1 they are distinct), one embedding row, plus the recurrent state (KDA) and the
/// latent KV cache (MLA) at `context` positions.
fn bytes_per_token(model: &KimiK3, context: usize) -> (u64, u64) {
    let cfg = model.config();
    let experts = cfg.num_experts.unwrap_or(0).max(1) as u64;
    let top_k = cfg.num_experts_per_token as u64;
    let mut weights = 0u64;
    for r in model.tensor_records() {
        weights += if r.path.contains(".switch_mlp.") {
            r.bytes * top_k / experts
        } else if r.path.contains("embed_tokens") && !cfg.tie_word_embeddings {
            r.bytes / cfg.vocab_size as u64
        } else {
            r.bytes
        };
    }
    let act = model.dtype().size_of() as u64;
    let mut state = 0u64;
    for i in 0..cfg.num_hidden_layers {
        if cfg.is_kda(i) {
            if let Some(la) = cfg.linear_attn_config.as_ref() {
                let p = (la.num_heads * la.head_dim) as u64;
                state += (la.num_heads * la.head_dim * la.head_dim) as u64 * 4;
                state += (la.short_conv_kernel_size as u64 - 1) * 3 * p * act;
            }
        } else if let Ok(m) = cfg.mla() {
            // With the DSA indexer (DeepSeek-V3.2, Kimi K3.1) a decode step reads every position's indexer key
            // and the latents of the kept positions only.
            let (kept, index_keys) = match &cfg.indexer {
                Some(ix) => (context.min(ix.topk), context * ix.head_dim),
                None => (context, 0),
            };
            state += (kept * (m.kv_lora_rank + m.qk_rope) + index_keys) as u64 * act;
        }
    }
    (weights, state)
}

/// Random token ids from a fixed seed (xorshift), as the Python side uses random ids too.
fn id_source(vocab: u32) -> impl FnMut(usize) -> Vec<u32> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    move |n| {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % vocab as u64) as u32
            })
            .collect()
    }
}

/// `bench --model DIR --graph`: the pending graph of one decode step (logits and the updated cache) after a
/// prefill, by primitive.
fn print_step_graph(model: &KimiK3, prompt: &[u32], json: bool) -> Result<()> {
    let mut cache = model.make_cache();
    let ids = |t: &[u32]| Array::from_slice(t, &[1, t.len() as i32]);
    model.forward(&ids(prompt)?, Some(&mut cache))?;
    mlx_k3::eval(&cache.arrays())?;
    let logits = model.forward(&ids(&prompt[..1])?, Some(&mut cache))?;
    let mut outs = cache.arrays();
    outs.push(&logits);
    let rows = mlx_k3::graph_census(&outs)?;
    let total: usize = rows.iter().map(|r| r.nodes).sum();
    if json {
        use serde_json::{json, Map, Value};
        let by: Map<String, Value> = rows
            .iter()
            .map(|r| {
                let c: Map<String, Value> = r.consumers.iter().map(|(n, k)| (n.clone(), json!(k))).collect();
                (r.primitive.clone(), json!({"nodes": r.nodes, "consumers": c}))
            })
            .collect();
        println!("{}", json!({"decode_step_nodes": total, "by_primitive": by}));
        return Ok(());
    }
    println!("one decode step after a {}-token prefill: {total} graph nodes", prompt.len());
    println!("{:>6}  {:<24} consumers (primitive x edges)", "nodes", "primitive");
    for r in rows {
        let c: Vec<String> = r.consumers.iter().map(|(n, k)| format!("{n} x{k}")).collect();
        println!("{:>6}  {:<24} {}", r.nodes, r.primitive, c.join(", "));
    }
    Ok(())
}

fn bench_model(dir: &std::path::Path, args: &Args) -> Result<()> {
    let t = Instant::now();
    let model = KimiK3::load(dir, LoadOptions::default())?;
    let load_s = t.elapsed().as_secs_f64();
    let mut ids = id_source(model.config().vocab_size as u32);
    if args.graph {
        return print_step_graph(&model, &ids(args.prompt_tokens.max(1)), args.json);
    }
    let opts = |max_tokens: usize| GenerateOptions {
        max_tokens,
        prefill_chunk: args.prompt_tokens.max(1),
        ..GenerateOptions::default()
    };
    // This machine's bandwidth drifts between runs, so the share below takes the better of a measurement
    // before and one after decoding (the conservative share); JSON output leaves bandwidth to the caller.
    // The share is a CPU figure: `read_bandwidth` streams host memory, so on a GPU it is not computed.
    let device = Device::default_device()?;
    let on_cpu = device == Device::Cpu;
    let bw_before = if args.json || !on_cpu { 0.0 } else { read_bandwidth().0 };
    // Warm-up (allocator, first-use costs), then the measured run on a fresh cache.
    let warm = ids(16);
    generate_tokens(&model, &mut PromptCache::new(), &warm, &opts(4), |_| true)?;
    let prompt = ids(args.prompt_tokens.max(1));
    // When each token reaches the host: the spread of the per-token intervals (median, and the fastest tenth,
    // which shared machines disturb least) says more than the mean on a noisy machine.
    let mut arrivals = Vec::with_capacity(args.gen_tokens);
    let (tokens, _, stats) = generate_tokens(&model, &mut PromptCache::new(), &prompt, &opts(args.gen_tokens), |_| {
        arrivals.push(Instant::now());
        true
    })?;
    let mut gaps: Vec<f64> = arrivals.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3).collect();
    gaps.sort_by(f64::total_cmp);
    let quantile = |q: f64| if gaps.is_empty() { 0.0 } else { gaps[((gaps.len() - 1) as f64 * q).round() as usize] };
    let (p10_ms, median_ms) = (quantile(0.1), quantile(0.5));
    let context = prompt.len() + tokens.len() / 2;
    let (weights, state_bytes) = bytes_per_token(&model, context);
    let total = weights + state_bytes;
    let resident: u64 = model.tensor_records().iter().map(|r| r.bytes).sum();
    let stored: u64 = model.tensor_records().iter().map(|r| r.stored_bytes).sum();
    let layout = mlx_k3::codebook::load_layout()?.name();
    if args.json {
        println!(
            "{{\"engine\": \"mlx-k3\", \"load_s\": {load_s:.3}, \"prompt_tokens\": {}, \"generated_tokens\": {}, \
             \"time_to_first_token_s\": {:.6}, \"prefill_tok_s\": {:.4}, \"decode_tok_s\": {:.4}, \
             \"token_interval_median_ms\": {median_ms:.4}, \"token_interval_p10_ms\": {p10_ms:.4}, \
             \"peak_memory_bytes\": {}, \"weight_bytes_per_token\": {weights}, \"state_bytes_per_token\": \
             {state_bytes}, \"bytes_read_per_token\": {total}, \"kernel_threads\": {}, \"avx512_kernels\": {}, \
             \"codebook_layout\": \"{layout}\", \"weight_bytes_resident\": {resident}, \"weight_bytes_stored\": \
             {stored}, \"device\": \"{}\"}}",
            stats.prompt_tokens,
            stats.generated_tokens,
            stats.time_to_first_token,
            stats.prompt_tps,
            stats.generation_tps,
            stats.peak_memory,
            kernels::num_threads(),
            kernels::avx512()?,
            if on_cpu { "cpu" } else { "gpu" }
        );
    } else {
        println!("model: {} (loaded in {load_s:.1} s) on {device:?}", dir.display());
        println!("prompt {} tokens, generated {}", stats.prompt_tokens, stats.generated_tokens);
        println!("time to first token: {:.3} s", stats.time_to_first_token);
        println!("prefill: {:.2} tok/s", stats.prompt_tps);
        println!("decode: {:.2} tok/s", stats.generation_tps);
        println!("per-token interval: median {median_ms:.2} ms, fastest tenth {p10_ms:.2} ms");
        println!(
            "CPU kernel threads: {}; AVX-512 kernels: {}",
            kernels::num_threads(),
            if kernels::avx512()? { "on" } else { "off" }
        );
        println!(
            "codebook layout: {layout}; weights resident {:.3} GB, stored {:.3} GB",
            resident as f64 / 1e9,
            stored as f64 / 1e9
        );
        println!("peak memory: {:.2} GB", stats.peak_memory as f64 / 1e9);
        println!(
            "bytes read per decoded token: {:.1} MB ({:.1} MB weights, {:.1} MB recurrent state and KV cache)",
            total as f64 / 1e6,
            weights as f64 / 1e6,
            state_bytes as f64 / 1e6
        );
        if !on_cpu {
            println!("bandwidth share: not computed on {device:?} (the bandwidth probe reads host memory)");
            return Ok(());
        }
        let bw_after = read_bandwidth().0;
        let gbs = bw_before.max(bw_after);
        let limit = gbs * 1e9 / total as f64;
        println!(
            "read bandwidth {gbs:.2} GB/s (best of {bw_before:.2} before and {bw_after:.2} after) -> limit \
             {limit:.1} tok/s; decode reaches {:.0}% of it",
            100.0 * stats.generation_tps / limit
        );
    }
    Ok(())
}

/// Streaming read bandwidth (GB/s) over 1 GiB with every kernel thread, best of 5 passes.
fn read_bandwidth() -> (f64, usize) {
    let threads = kernels::num_threads().max(1);
    let n = (1usize << 30) / 8;
    let data: Vec<u64> = (0..n as u64).collect();
    let chunk = n.div_ceil(threads);
    let mut best = 0.0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let handles: Vec<_> =
                data.chunks(chunk).map(|c| s.spawn(move || std::hint::black_box(stream_sum(c)))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).fold(0, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        best = best.max((n * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    (best, threads)
}

fn stream_sum(c: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        return unsafe { stream_sum_avx2(c) };
    }
    stream_sum_plain(c)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_sum_avx2(c: &[u64]) -> u64 {
    stream_sum_plain(c)
}

#[inline(always)]
fn stream_sum_plain(c: &[u64]) -> u64 {
    // Eight independent lanes so the adds vectorize and never limit the loads.
    let mut acc = [0u64; 8];
    let mut it = c.chunks_exact(8);
    for w in &mut it {
        for i in 0..8 {
            acc[i] = acc[i].wrapping_add(w[i]);
        }
    }
    it.remainder().iter().fold(acc.iter().fold(0, |a, b| a.wrapping_add(*b)), |a, b| a.wrapping_add(*b))
}

/// The fused router against the plain-ops `route_reference` at 896 experts / top-16 (with the correction
/// bias), for 1 and 512 tokens: the latency of one call (graph build + evaluation), and the cost per call
/// when 64 calls share one evaluation (as inside a model step).
fn bench_router(json: bool) -> Result<()> {
    let (e, k) = (896, 16);
    let p = RouterParams { top_k: k, n_group: 1, topk_group: 1, routed_scaling_factor: 2.827, renormalize: true };
    let key = |s: u64| random::key(s);
    let bias = random::normal(&[e], Dtype::F32, 0.0, 0.05, Some(&key(2)?))?;
    bias.eval()?;
    let mut rows = Vec::new();
    let mut floor = 0.0;
    for tokens in [1, 512] {
        let xs: Vec<Array> = (0..64)
            .map(|i| random::normal(&[1, tokens, e], Dtype::F32, 0.0, 2.0, Some(&key(10 + i)?)))
            .collect::<Result<_>>()?;
        mlx_k3::eval(&xs.iter().collect::<Vec<_>>())?;
        let fused = |x: &Array| -> Result<Vec<Array>> {
            let r = kernels::moe_router(x, Some(&bias), None, p)?;
            Ok(vec![r.indices, r.weights])
        };
        let plain = |x: &Array| -> Result<Vec<Array>> {
            let (i, w) = kernels::route_reference(x, Some(&bias), p)?;
            Ok(vec![i, w])
        };
        let single_n = if tokens == 1 { 400 } else { 20 };
        if tokens == 1 {
            // What any one-op graph costs here, measured just before the fused call: building and evaluating
            // `x + 1` on the same input, the floor under an isolated call (hand-off to the stream's thread and
            // back).
            floor = time_calls(&xs[..1], single_n, &|x: &Array| Ok(vec![x.add(&Array::scalar(1.0f32)?)?]))?;
        }
        let f1 = time_calls(&xs[..1], single_n, &fused)?;
        let p1 = time_calls(&xs[..1], single_n, &plain)?;
        let batch = if tokens == 1 { 64 } else { 8 };
        let fb = time_calls(&xs[..batch], if tokens == 1 { 40 } else { 3 }, &fused)?;
        let pb = time_calls(&xs[..batch], if tokens == 1 { 40 } else { 3 }, &plain)?;
        rows.push((tokens, f1, p1, fb, pb, batch));
    }
    if json {
        let parts: Vec<String> = rows
            .iter()
            .map(|(t, f1, p1, fb, pb, b)| {
                format!(
                    "\"{t}\": {{\"fused_call_us\": {f1:.3}, \"plain_call_us\": {p1:.3}, \"fused_in_graph_us\": {fb:.3}, \
                     \"plain_in_graph_us\": {pb:.3}, \"calls_per_graph\": {b}}}"
                )
            })
            .collect();
        println!(
            "{{\"router\": {{{}}}, \"experts\": {e}, \"top_k\": {k}, \"one_op_call_us\": {floor:.3}}}",
            parts.join(", ")
        );
    } else {
        println!("router, {e} experts top-{k}: microseconds per call (median)");
        println!(
            "{:>7} {:>12} {:>12} {:>16} {:>16}",
            "tokens", "fused", "plain ops", "fused in graph", "plain in graph"
        );
        for (t, f1, p1, fb, pb, _) in rows {
            println!("{t:>7} {f1:>12.1} {p1:>12.1} {fb:>16.1} {pb:>16.1}");
        }
        println!("one call of a one-op graph (x + 1, 1 token): {floor:.1} µs, the floor under an isolated call");
    }
    Ok(())
}

/// Median over `reps` of (time to build and evaluate one graph holding one call per input) / inputs, in µs.
fn time_calls(xs: &[Array], reps: usize, f: &dyn Fn(&Array) -> Result<Vec<Array>>) -> Result<f64> {
    let mut times = Vec::with_capacity(reps);
    for rep in 0..reps + 3 {
        let t = Instant::now();
        let outs: Vec<Array> = xs.iter().map(|x| f(x)).collect::<Result<Vec<_>>>()?.into_iter().flatten().collect();
        mlx_k3::eval(&outs.iter().collect::<Vec<_>>())?;
        if rep >= 3 {
            times.push(t.elapsed().as_secs_f64() * 1e6 / xs.len() as f64);
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    memory::clear_cache();
    Ok(times[times.len() / 2])
}

/// The prompts of `bench --draft-model`: code (k3-nano's training domain is Python's standard library) and
/// English prose.
const SPEC_PROMPTS: [(&str, &str); 2] = [
    ("code", "import os\nimport sys\n\n\ndef"),
    ("prose", "The old lighthouse keeper climbed the stairs every evening, and"),
];

/// The prompts of `--spec-prompts FILE`: for each of the first `docs` documents of the token stream, its
/// first 32 tokens ("docN") and 32 tokens from its middle ("codeN").
fn spec_prompts_from(path: &std::path::Path, docs: usize) -> Result<Vec<(String, Vec<u32>)>> {
    let st = mlx_k3::io::Safetensors::load(path)?;
    let tokens = st.get("tokens")?.astype(mlx_k3::Dtype::I32)?.to_vec::<i32>()?;
    let starts = st.get("doc_starts")?.astype(mlx_k3::Dtype::I32)?.to_vec::<i32>()?;
    let mut out = Vec::new();
    for (i, &s) in starts.iter().enumerate().take(docs) {
        let s = s.max(0) as usize;
        let e = starts.get(i + 1).map_or(tokens.len(), |&e| (e.max(0) as usize).min(tokens.len()));
        if e < s + 96 {
            continue;
        }
        let window = |a: usize| tokens[a..a + 32].iter().map(|&t| t as u32).collect::<Vec<u32>>();
        out.push((format!("doc{i}"), window(s)));
        out.push((format!("code{i}"), window((s + e) / 2 - 16)));
    }
    if out.is_empty() {
        return Err(Error::invalid(
            "bench",
            format!("--spec-prompts {}: no document of 96 tokens or more", path.display()),
        ));
    }
    Ok(out)
}

/// `bench --model DIR --draft-model DIR` (or `--random-draft`): plain and speculative greedy decoding of
/// `--gen-tokens` tokens on each of [`SPEC_PROMPTS`], alternating, `--reps` times; the fastest run of each
/// is reported. tok/s is new tokens over the whole call (the prompts are short: one prefill forward).
fn bench_speculative(dir: &std::path::Path, args: &Args) -> Result<()> {
    let model = KimiK3::load(dir, LoadOptions::default())?;
    let vocab = model.config().vocab_size;
    let enc = PromptEncoder::load(dir)?;
    let rollback = match args.rollback.as_str() {
        "record" => Rollback::Record,
        "recompute" => Rollback::Recompute,
        r => return Err(Error::invalid("bench", format!("--rollback: '{r}' is not record or recompute"))),
    };
    let gate_config = args.gate.config(true, !args.no_gate)?;
    let spec = SpecOptions { rollback, ..super::gen::spec_options(args.num_draft, !args.no_gate, gate_config)? };
    let (mut drafter, name): (Box<dyn Drafter>, String) = match &args.draft_model {
        Some(d) => {
            let load = LoadOptions { dtype: Some(model.dtype()), lazy: false, shard: None };
            let drafter = mlx_k3::generate::block_drafter::drafter_for(d, dir, &model, load)?;
            let name = format!("{} ({})", d.display(), drafter.name());
            (drafter, name)
        }
        None => (Box::new(RandomDrafter::new(vocab, 1)), "random tokens".into()),
    };
    let opts = GenerateOptions { max_tokens: args.gen_tokens, ..GenerateOptions::default() };
    // Warm-up of both paths.
    let warm = enc.encode_raw(SPEC_PROMPTS[0].1)?;
    let short = GenerateOptions { max_tokens: 8, ..opts.clone() };
    generate_tokens(&model, &mut PromptCache::new(), &warm, &short, |_| true)?;
    generate_speculative(&model, drafter.as_mut(), &mut PromptCache::new(), &warm, &short, &spec, |_| true)?;
    let prompts: Vec<(String, Vec<u32>)> = match &args.spec_prompts {
        Some(f) => spec_prompts_from(f, args.spec_docs)?,
        None => SPEC_PROMPTS.iter().map(|(l, t)| Ok((l.to_string(), enc.encode_raw(t)?))).collect::<Result<_>>()?,
    };
    let mut rows = Vec::new();
    for (label, prompt) in &prompts {
        let (label, prompt) = (label.as_str(), prompt.clone());
        let (mut plain_best, mut spec_best) = (f64::INFINITY, f64::INFINITY);
        let mut plain_out = Vec::new();
        let mut best_stats = None;
        for _ in 0..args.reps.max(1) {
            let t = Instant::now();
            plain_out = generate_tokens(&model, &mut PromptCache::new(), &prompt, &opts, |_| true)?.0;
            plain_best = plain_best.min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let (out, _, _, st) =
                generate_speculative(&model, drafter.as_mut(), &mut PromptCache::new(), &prompt, &opts, &spec, |_| {
                    true
                })?;
            let dt = t.elapsed().as_secs_f64();
            if out != plain_out {
                return Err(Error::invalid("bench", format!("{label}: speculative greedy output differs from plain")));
            }
            if dt < spec_best {
                spec_best = dt;
                best_stats = Some(st);
            }
        }
        let st = best_stats.unwrap_or_default();
        let n = plain_out.len() as f64;
        rows.push((label, n / plain_best, n / spec_best, st));
    }
    // All prompts together: total tokens over total best times, and the pooled tokens per cycle.
    let mut all = SpecStats::default();
    let (mut n_all, mut tp, mut ts) = (0.0, 0.0, 0.0);
    for (_, p, s, st) in &rows {
        let n = st.accepted as f64 + st.cycles as f64 + st.plain_steps as f64;
        n_all += n;
        tp += n / p;
        ts += n / s;
        all.cycles += st.cycles;
        all.drafted += st.drafted;
        all.accepted += st.accepted;
        all.plain_steps += st.plain_steps;
        all.fallbacks += st.fallbacks;
        all.draft_seconds += st.draft_seconds;
        all.verify_seconds += st.verify_seconds;
    }
    if rows.len() > 1 {
        rows.push(("all", n_all / tp, n_all / ts, all));
    }
    if args.json {
        let parts: Vec<String> = rows
            .iter()
            .map(|(label, p, s, st)| {
                format!(
                    "\"{label}\": {{\"plain_tok_s\": {p:.3}, \"spec_tok_s\": {s:.3}, \"ratio\": {:.4}, \"tokens_per_cycle\": \
                     {:.4}, \"accept_rate\": {:.4}, \"cycles\": {}, \"plain_steps\": {}, \"fallbacks\": {}, \
                     \"draft_s\": {:.4}, \"verify_s\": {:.4}}}",
                    s / p,
                    st.tokens_per_cycle(),
                    st.accept_rate(),
                    st.cycles,
                    st.plain_steps,
                    st.fallbacks,
                    st.draft_seconds,
                    st.verify_seconds
                )
            })
            .collect();
        println!(
            "{{\"draft\": {:?}, \"num_draft\": {}, \"gate\": {}, \"gate_config\": {}, \"rollback\": \"{}\", \"gen_tokens\": {}, {}}}",
            name,
            args.num_draft,
            !args.no_gate,
            serde_json::to_string(&spec.gate_config).unwrap_or_default(),
            args.rollback,
            args.gen_tokens,
            parts.join(", ")
        );
        return Ok(());
    }
    println!(
        "model: {}; draft: {name}; up to {} drafts per cycle, gate {}, rollback {}; {} greedy tokens, best of {}",
        dir.display(),
        args.num_draft,
        if args.no_gate { "off" } else { "on" },
        args.rollback,
        args.gen_tokens,
        args.reps.max(1)
    );
    println!(
        "{:<6} {:>10} {:>10} {:>7} {:>11} {:>8} {:>7} {:>6} {:>10}",
        "prompt", "plain t/s", "spec t/s", "ratio", "tok/cycle", "accept", "cycles", "plain", "fallbacks"
    );
    for (label, p, s, st) in &rows {
        println!(
            "{label:<6} {p:>10.1} {s:>10.1} {:>7.3} {:>11.2} {:>7.0}% {:>7} {:>6} {:>10}",
            s / p,
            st.tokens_per_cycle(),
            100.0 * st.accept_rate(),
            st.cycles,
            st.plain_steps,
            st.fallbacks
        );
        if !st.events.is_empty() {
            let ev: Vec<String> = st.events.iter().map(|e| format!("{e:?}")).collect();
            println!("       gate: {}", ev.join("; "));
        }
    }
    println!("greedy outputs identical to plain decoding: yes (checked on every run)");
    Ok(())
}
