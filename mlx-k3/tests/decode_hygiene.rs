//! Decode-step hygiene (issue 6): one lazy graph per step, evaluated once, step n+1 enqueued before token n is
//! read, no host synchronization inside a step; counted with `mlx_k3::sync_trace`, in every sampling
//! configuration (greedy and sampled, with and without repetition/presence penalties). The penalties see the
//! recent tokens as a lazy array; their tokens are compared with a host-driven reference decode that reads
//! every token and applies the penalties on the host, as generation did before it was pipelined.
//!
//! Models: k3-nano (trained, so penalties change its output) and the mlx-lm fixtures (every model option).

use std::path::{Path, PathBuf};

use mlx_k3::distributed::{Backend, Group};
use mlx_k3::generate::{
    generate_tokens, tripwire, GenerateOptions, PromptCache, RecentTokens, Sampler, SamplerConfig, SYNC_EVERY,
};
use mlx_k3::model::shard::Comm;
use mlx_k3::model::{KimiK3, LoadOptions, ModelCache};
use mlx_k3::sync_trace::{self, Counts, Event, Kind};
use mlx_k3::{Array, Dtype};

fn nano_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano")
}

fn nano() -> KimiK3 {
    KimiK3::load(&nano_dir(), LoadOptions::default()).unwrap()
}

fn fixture_dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/k3");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("manifest.json")).unwrap()).unwrap();
    v["fixtures"].as_array().unwrap().iter().map(|f| root.join(f["dir"].as_str().unwrap())).collect()
}

/// Prompt ids (taken modulo the vocabulary on the 256-token fixtures).
const PROMPT: [u32; 9] = [100, 101, 102, 40, 41, 58, 10, 32, 32];

fn sampled() -> SamplerConfig {
    SamplerConfig { temperature: 0.8, top_p: 0.95, top_k: 40, seed: 11, ..Default::default() }
}

/// Penalties over a window shorter than prompt + output, so tokens leave the window during the run.
fn with_penalties(cfg: SamplerConfig) -> SamplerConfig {
    SamplerConfig { repetition_penalty: Some(1.5), presence_penalty: Some(0.75), penalty_context: 12, ..cfg }
}

fn configs() -> Vec<(&'static str, SamplerConfig)> {
    vec![
        ("greedy", SamplerConfig::greedy()),
        ("greedy + penalties", with_penalties(SamplerConfig::greedy())),
        ("sampled", sampled()),
        ("sampled + penalties", with_penalties(sampled())),
    ]
}

fn opts(max_tokens: usize, sampler: SamplerConfig) -> GenerateOptions {
    GenerateOptions { max_tokens, sampler, prefill_chunk: 4, ..Default::default() }
}

/// Prefill forwards of a fresh cache: the prompt minus its last token, in chunks.
fn prefill_chunks(prompt_len: usize, chunk: usize) -> u64 {
    (prompt_len - 1).div_ceil(chunk) as u64
}

/// The model in `dir` with its cache prefilled on all but the last prompt token (taken modulo its vocabulary),
/// as the decode loop leaves it; also that prompt.
fn prefilled(dir: &Path) -> (KimiK3, ModelCache, Vec<u32>) {
    let model = KimiK3::load(dir, LoadOptions::default()).unwrap();
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = PROMPT.iter().map(|t| t % vocab).collect();
    let mut cache = model.make_cache();
    let ids = Array::from_slice(&prompt[..prompt.len() - 1], &[1, prompt.len() as i32 - 1]).unwrap();
    model.forward(&ids, Some(&mut cache)).unwrap();
    mlx_k3::eval(&cache.arrays()).unwrap();
    (model, cache, prompt)
}

fn kinds(events: &[Event]) -> Vec<Kind> {
    events.iter().map(|e| e.kind).collect()
}

#[test]
fn building_a_decode_step_waits_for_nothing() {
    let mut dirs = fixture_dirs();
    dirs.push(nano_dir());
    for dir in dirs {
        let (model, mut cache, prompt) = prefilled(&dir);
        let vocab = model.config().vocab_size as u32;
        let cfg = SamplerConfig { logit_bias: vec![(3, 0.5)], penalty_context: 10, ..with_penalties(sampled()) };
        let mut sampler = Sampler::new(cfg.clone()).unwrap();
        let mut recent = RecentTokens::new(&cfg, &prompt).unwrap();

        // Two decode steps, the second fed the first's unevaluated token, as the decode loop does.
        let before = sync_trace::counts();
        sync_trace::start();
        let mut token = Array::from_slice(&prompt[prompt.len() - 1..], &[1]).unwrap();
        let mut outs = Vec::new();
        for _ in 0..2 {
            let logits = model.forward(&token.reshape(&[1, 1]).unwrap(), Some(&mut cache)).unwrap();
            let logits = logits.reshape(&[1, -1]).unwrap();
            let logits = sampler.process_recent(&logits, &recent).unwrap();
            let lp = logits.subtract(logits.logsumexp(&[-1], true).unwrap()).unwrap();
            token = sampler.sample(&lp).unwrap();
            recent.push(&token).unwrap();
            outs.push(token.clone());
        }
        let events = sync_trace::stop();
        let counts = sync_trace::counts().since(&before);
        assert_eq!(counts, Counts::default(), "{}: building two steps synced: {events:?}", dir.display());
        assert!(events.is_empty());
        assert!(!outs[1].is_evaluated(), "the steps stayed lazy");

        // The graph is real: evaluating it gives tokens in the vocabulary and a window of prompt + them.
        let got: Vec<u32> = outs.iter().map(|t| t.item::<u32>().unwrap()).collect();
        assert!(got.iter().all(|&t| t < vocab), "{got:?}");
        let window = recent.array().unwrap().to_vec::<u32>().unwrap();
        let want: Vec<u32> = prompt.iter().chain(&got).copied().collect();
        assert_eq!(window, want[want.len() - 10..], "the lazy window holds the last penalty_context tokens");
    }
}

#[test]
fn each_step_is_one_async_eval_and_each_token_one_read() {
    let model = nano();
    let n = 12;
    for (name, cfg) in configs() {
        let before = sync_trace::counts();
        let (tokens, _, _) =
            generate_tokens(&model, &mut PromptCache::new(), &PROMPT, &opts(n, cfg), |_| true).unwrap();
        let c = sync_trace::counts().since(&before);
        assert_eq!(tokens.len(), n, "{name}");
        // Blocking evals: one per prefill chunk and one of the final cache state (so the prompt cache holds
        // evaluated arrays when generation returns); nothing else waits except the token reads.
        let want = Counts {
            evals: prefill_chunks(PROMPT.len(), 4) + 1,
            async_evals: n as u64,
            reads: n as u64,
            synchronizes: 0,
        };
        assert_eq!(c, want, "{name}");
        assert_eq!(c.host_syncs(), want.evals + n as u64, "{name}");
    }
}

#[test]
fn the_next_step_is_enqueued_before_the_token_is_read() {
    let model = nano();
    let n = 8;
    for (name, cfg) in configs() {
        let before = sync_trace::counts();
        sync_trace::start();
        let mut seen = Vec::new();
        generate_tokens(&model, &mut PromptCache::new(), &PROMPT, &opts(n, cfg), |_| {
            seen.push(sync_trace::counts().since(&before));
            true
        })
        .unwrap();
        let events = sync_trace::stop();
        // Prefill evals; step 0 enqueued; then for each token n < N-1: step n+1 enqueued, token n read;
        // the last token read with no step after it; the final cache eval.
        let mut want = vec![Kind::Eval; prefill_chunks(PROMPT.len(), 4) as usize];
        want.push(Kind::AsyncEval);
        for _ in 0..n - 1 {
            want.extend([Kind::AsyncEval, Kind::Read]);
        }
        want.extend([Kind::Read, Kind::Eval]);
        assert_eq!(kinds(&events), want, "{name}: {events:#?}");
        // Every decode-time sync is the loop's own, in generate/mod.rs (none inside the model or sampler).
        let decode = &events[prefill_chunks(PROMPT.len(), 4) as usize..];
        for e in decode {
            assert!(e.location.file().ends_with("generate/mod.rs"), "{name}: {e:?}");
        }
        // When the callback sees token n, step n+1 has already been enqueued: async_evals are one ahead.
        assert_eq!(seen.len(), n);
        for (i, c) in seen.iter().enumerate() {
            let ahead = if i + 1 < n { 2 } else { 1 };
            assert_eq!((c.reads, c.async_evals), (i as u64 + 1, i as u64 + ahead), "{name}: token {i}");
        }
    }
}

/// The token generation returned, but decoded the old way: every token read before the next step is built,
/// the penalties applied on the host to the logits (distinct recent tokens, repetition then presence).
fn host_reference(model: &KimiK3, prompt: &[u32], cfg: &SamplerConfig, n: usize) -> Vec<u32> {
    let mut cache = model.make_cache();
    let ids = |t: &[u32]| Array::from_slice(t, &[1, t.len() as i32]).unwrap().astype(Dtype::I32).unwrap();
    let body = prompt.len() - 1;
    model.forward(&ids(&prompt[..body]), Some(&mut cache)).unwrap();
    mlx_k3::eval(&cache.arrays()).unwrap();
    let mut sampler = Sampler::new(cfg.clone()).unwrap();
    let mut history = prompt.to_vec();
    let mut next = prompt[body];
    let mut out = Vec::new();
    for _ in 0..n {
        let logits = model.forward(&ids(&[next]), Some(&mut cache)).unwrap();
        let mut host = logits.reshape(&[-1]).unwrap().to_vec::<f32>().unwrap();
        let mut recent = history[history.len().saturating_sub(cfg.penalty_context)..].to_vec();
        recent.sort_unstable();
        recent.dedup();
        for &t in &recent {
            let x = &mut host[t as usize];
            if let Some(p) = cfg.repetition_penalty {
                *x = if *x < 0.0 { *x * p } else { *x / p };
            }
            if let Some(p) = cfg.presence_penalty {
                *x -= p;
            }
        }
        let logits = Array::from_slice(&host, &[1, host.len() as i32]).unwrap();
        let lp = logits.subtract(logits.logsumexp(&[-1], true).unwrap()).unwrap();
        next = sampler.sample(&lp).unwrap().item::<u32>().unwrap();
        history.push(next);
        out.push(next);
    }
    out
}

#[test]
fn pipelined_penalties_give_the_host_reference_tokens() {
    let model = nano();
    let n = 24;
    for base in [SamplerConfig::greedy(), sampled()] {
        let cfg = with_penalties(base.clone());
        let (tokens, _, _) =
            generate_tokens(&model, &mut PromptCache::new(), &PROMPT, &opts(n, cfg.clone()), |_| true).unwrap();
        let reference = host_reference(&model, &PROMPT, &cfg, n);
        assert_eq!(tokens, reference, "temperature {}", cfg.temperature);
        // The penalties matter on this model and prompt, so the comparison tests them.
        let (plain, _, _) =
            generate_tokens(&model, &mut PromptCache::new(), &PROMPT, &opts(n, base), |_| true).unwrap();
        assert_ne!(tokens, plain, "temperature {}: the penalties changed nothing", cfg.temperature);
    }
    // Each penalty alone, and a window longer than everything seen.
    for cfg in [
        SamplerConfig { repetition_penalty: Some(1.3), penalty_context: 64, ..SamplerConfig::greedy() },
        SamplerConfig { presence_penalty: Some(2.0), penalty_context: 5, ..SamplerConfig::greedy() },
    ] {
        let (tokens, _, _) =
            generate_tokens(&model, &mut PromptCache::new(), &PROMPT, &opts(n, cfg.clone()), |_| true).unwrap();
        assert_eq!(tokens, host_reference(&model, &PROMPT, &cfg, n), "{cfg:?}");
    }
}

#[test]
fn recent_tokens_keep_the_window_and_penalize_repeats_once() {
    let cfg = SamplerConfig {
        repetition_penalty: Some(2.0),
        presence_penalty: Some(0.5),
        penalty_context: 4,
        ..SamplerConfig::greedy()
    };
    let mut recent = RecentTokens::new(&cfg, &[9, 1, 2]).unwrap();
    assert_eq!(recent.len(), 3);
    for t in [2u32, 2, 5] {
        recent.push(&Array::from_slice(&[t], &[1]).unwrap()).unwrap();
    }
    assert_eq!(recent.len(), 4);
    assert_eq!(recent.array().unwrap().to_vec::<u32>().unwrap(), [2, 2, 2, 5]);
    // Token 2 appears three times in the window: it is penalized once, as a distinct token.
    let logits = Array::from_slice(&[1.0f32, 1.0, 4.0, -1.0, 1.0, -3.0, 1.0, 1.0, 1.0, 1.0], &[1, 10]).unwrap();
    let s = Sampler::new(cfg.clone()).unwrap();
    let out = s.process_recent(&logits, &recent).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(out, [1.0, 1.0, 4.0 / 2.0 - 0.5, -1.0, 1.0, -3.0 * 2.0 - 0.5, 1.0, 1.0, 1.0, 1.0]);
    // Without a penalty the window is not kept at all.
    let mut off = RecentTokens::new(&SamplerConfig::greedy(), &[1, 2, 3]).unwrap();
    off.push(&Array::from_slice(&[4u32], &[1]).unwrap()).unwrap();
    assert!(off.is_empty() && off.array().is_none());
}

#[test]
fn sync_trace_counts_waits_and_logs_their_callers() {
    let a = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
    let before = sync_trace::counts();
    sync_trace::start();
    let b = a.add(1.0f32).unwrap().multiply(2.0f32).unwrap();
    assert_eq!(sync_trace::counts().since(&before), Counts::default(), "ops are lazy");
    b.async_eval().unwrap();
    mlx_k3::eval(&[&b]).unwrap();
    assert_eq!(b.to_vec::<f32>().unwrap(), [4.0, 6.0]);
    assert_eq!(b.sum_all(false).unwrap().item::<f32>().unwrap(), 10.0);
    mlx_k3::synchronize().unwrap();
    let events = sync_trace::stop();
    assert_eq!(kinds(&events), [Kind::AsyncEval, Kind::Eval, Kind::Read, Kind::Read, Kind::Synchronize]);
    assert!(events.iter().all(|e| e.location.file().ends_with("decode_hygiene.rs")), "{events:?}");
    let c = sync_trace::counts().since(&before);
    assert_eq!((c.async_evals, c.evals, c.reads, c.synchronizes, c.host_syncs()), (1, 1, 2, 1, 4));
    // The log is off after stop; counting goes on.
    b.eval().unwrap();
    assert!(sync_trace::stop().is_empty());
    assert_eq!(sync_trace::counts().since(&before).evals, 2);
}

#[test]
fn the_tripwire_is_one_read() {
    // A lone process gets a group of size 1 (its all_gather returns the input). The loader does not split a
    // model over one rank, so generate_tokens never calls the tripwire here; that it runs only every
    // SYNC_EVERY tokens is visible in generate/mod.rs, and tests/distributed_model.rs runs it over two ranks.
    let group = Group::init(Backend::Any, false).unwrap();
    assert_eq!(group.size(), 1);
    let comm = Comm::new(group, false).unwrap();
    let tokens: Vec<u32> = (0..SYNC_EVERY as u32).collect();
    let before = sync_trace::counts();
    sync_trace::start();
    assert!(!tripwire(&comm, &tokens, false).unwrap());
    assert!(tripwire(&comm, &tokens, true).unwrap());
    let events = sync_trace::stop();
    assert_eq!(sync_trace::counts().since(&before), Counts { reads: 2, ..Counts::default() });
    assert!(events.iter().all(|e| e.location.file().ends_with("generate/mod.rs")), "{events:?}");
}

/// The graph of one decode step holds no layout copies and no unfused RMSNorm: the kernels' ops read strided
/// inputs themselves (no `Contiguous` node per weight or activation) and each norm is one `K3RmsNorm` node
/// (MLX's CPU `fast::rms_norm` expands to `Square`, `Sum`, `Rsqrt` and broadcasts). Every node costs MLX's
/// per-node scheduling in every step; on the mid-size benchmark model these two changes took a step from 2455
/// nodes to 718.
#[test]
fn a_decode_step_graph_has_no_layout_copies_or_unfused_norms() {
    let mut dirs = fixture_dirs();
    dirs.push(nano_dir());
    for dir in dirs {
        let (model, mut cache, prompt) = prefilled(&dir);
        let token = Array::from_slice(&prompt[prompt.len() - 1..], &[1, 1]).unwrap();
        let logits = model.forward(&token, Some(&mut cache)).unwrap();
        let state = cache.arrays();
        let mut outs = vec![&logits];
        outs.extend(state.iter());
        let count = |name| mlx_k3::graph_nodes(&outs, Some(name)).unwrap();
        let name = dir.display();
        assert!(mlx_k3::graph_nodes(&outs, None).unwrap() > 100, "{name}: the step graph is pending");
        assert_eq!(count("Contiguous"), 0, "{name}");
        assert_eq!(count("Square"), 0, "{name}: an RMSNorm took MLX's unfused path");
        assert!(count("K3RmsNorm") >= 2 * model.config().num_hidden_layers, "{name}");
        // The count is of pending nodes only: after evaluation nothing is left.
        mlx_k3::eval(&outs).unwrap();
        assert_eq!(mlx_k3::graph_nodes(&outs, None).unwrap(), 0, "{name}");
    }
}
