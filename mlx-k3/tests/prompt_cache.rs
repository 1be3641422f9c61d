//! The prompt cache across branching conversations (issue 41, item 1): whatever sequence of prompts a
//! session sees (continuations, edits that branch off an earlier point, rewinds, repeats), every greedy
//! output equals the output of a fresh cache, and the state a prompt resumes from is one that was really
//! computed for exactly those tokens.
//!
//! KDA state cannot be rewound, so a model with KDA layers resumes from snapshots taken at the end of each
//! prefill. Prefill runs one token at a time here, so a resumed run performs exactly the operations of a
//! fresh run and the outputs must be identical, not merely close.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use mlx_k3::generate::{generate_tokens, FinishReason, GenerateOptions, PromptCache};
use mlx_k3::model::{KimiK3, LoadOptions};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/k3").join(name)
}

fn nano() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano")
}

/// SplitMix64: a seeded stream of test inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab) as u32).collect()
    }
}

/// Greedy generation of `max_tokens` with one-token prefill chunks; returns (tokens, cached prompt tokens).
fn run(model: &KimiK3, pc: &mut PromptCache, prompt: &[u32], max_tokens: usize) -> (Vec<u32>, usize) {
    let opts = GenerateOptions { max_tokens, prefill_chunk: 1, ..Default::default() };
    let (out, reason, stats) = generate_tokens(model, pc, prompt, &opts, |_| true).unwrap();
    assert_eq!((reason, out.len()), (FinishReason::Length, max_tokens));
    assert_eq!(stats.prompt_tokens, prompt.len());
    (out, stats.prompt_tokens - stats.prefilled_tokens)
}

/// What a session has computed so far, tracked from the prompts and outputs alone: the exact token
/// sequences some state was ever computed for (the end of each prefill, and what the cache holds after
/// each generation: the prompt and all new tokens but the last, which was never run).
#[derive(Default)]
struct Computed {
    states: HashSet<Vec<u32>>,
    held: Vec<u32>,
}

impl Computed {
    fn after(&mut self, prompt: &[u32], out: &[u32]) {
        self.states.insert(prompt[..prompt.len() - 1].to_vec());
        self.held = prompt.iter().chain(&out[..out.len() - 1]).copied().collect();
        self.states.insert(self.held.clone());
    }

    /// Checks the cached count of `prompt` against what was computed.
    fn check(&self, prompt: &[u32], cached: usize, what: &str) {
        assert!(cached < prompt.len(), "{what}: the last prompt token must run");
        assert!(
            cached == 0 || self.states.contains(&prompt[..cached]),
            "{what}: resumed after {cached} tokens from a state that was never computed for them"
        );
        // A prompt that extends what the cache holds resumes exactly there.
        if prompt.len() > self.held.len() && !self.held.is_empty() && prompt.starts_with(&self.held) {
            assert_eq!(cached, self.held.len(), "{what}: a continuation reuses the whole held state");
        }
    }
}

#[test]
fn random_branches_and_rewinds_give_the_fresh_outputs() {
    // A model with KDA layers (the cache cannot be trimmed, only restored from snapshots).
    let model = KimiK3::load(&fixture("a_latent_norm_attnres"), LoadOptions::default()).unwrap();
    let vocab = model.config().vocab_size;
    assert!(!model.make_cache().is_trimmable());
    let mut resumed_from_snapshot = 0;
    for seed in 0..3u64 {
        let mut rng = Rng(seed);
        let mut pc = PromptCache::new();
        let mut seen = Computed::default();
        let mut history: Vec<Vec<u32>> = Vec::new();
        let mut last_out: Vec<u32> = Vec::new();
        for step in 0..20 {
            let choice = rng.below(6);
            let mut prompt: Vec<u32> = match history.last() {
                None => {
                    let n = 6 + rng.below(10);
                    rng.tokens(n, vocab)
                }
                // The next turn: the previous prompt, its output and new tokens.
                Some(p) if choice < 2 => {
                    let n = 1 + rng.below(8);
                    let extra = rng.tokens(n, vocab);
                    p.iter().chain(&last_out).chain(&extra).copied().collect()
                }
                // An edit: any earlier prompt cut anywhere, then new tokens.
                Some(_) if choice < 5 => {
                    let p = &history[rng.below(history.len())];
                    let cut = 1 + rng.below(p.len());
                    let n = 1 + rng.below(10);
                    let extra = rng.tokens(n, vocab);
                    p[..cut].iter().chain(&extra).copied().collect()
                }
                // A rewind to a prefix of an earlier prompt (possibly all of it: the same prompt again).
                Some(_) => {
                    let p = &history[rng.below(history.len())];
                    p[..2 + rng.below(p.len() - 1)].to_vec()
                }
            };
            prompt.truncate(64);
            let what = format!("seed {seed} step {step} (prompt of {})", prompt.len());
            let (out, cached) = run(&model, &mut pc, &prompt, 4);
            let (fresh, fresh_cached) = run(&model, &mut PromptCache::new(), &prompt, 4);
            assert_eq!(fresh_cached, 0);
            assert_eq!(out, fresh, "{what}: the cached run differs from a fresh run");
            seen.check(&prompt, cached, &what);
            if cached > 0 && !prompt.starts_with(&seen.held) {
                resumed_from_snapshot += 1;
            }
            seen.after(&prompt, &out);
            history.push(prompt);
            last_out = out;
        }
    }
    println!("{resumed_from_snapshot} prompts resumed from a snapshot");
    assert!(resumed_from_snapshot >= 8, "the sequences exercised snapshots only {resumed_from_snapshot} times");
}

#[test]
fn an_edit_after_two_branches_resumes_from_the_shared_prefix() {
    // The sequence on k3-nano: X (20 tokens), X+Y (+20), X+Z (+30), then (X+Z)[..45]+W. Snapshots are
    // taken at the end of each prefill (19, 39, 49 tokens); the one at 39 belongs to X+Y, so the last prompt
    // may only resume from 19, the end of X's prefill: by hand, cached counts 0, 19, 19, 19.
    let model = KimiK3::load(&nano(), LoadOptions::default()).unwrap();
    for trial in 0..6u64 {
        let mut rng = Rng(100 + trial);
        let x = rng.tokens(20, 2000);
        let mut y = rng.tokens(20, 2000);
        let mut z = rng.tokens(30, 2000);
        // Branches that differ from their first token on.
        y[0] = (x[0] + 1) % 2000;
        z[0] = (y[0] + 1) % 2000;
        let w = rng.tokens(10, 2000);
        let xy: Vec<u32> = x.iter().chain(&y).copied().collect();
        let xz: Vec<u32> = x.iter().chain(&z).copied().collect();
        let last: Vec<u32> = xz[..45].iter().chain(&w).copied().collect();
        let mut pc = PromptCache::new();
        let mut cached = Vec::new();
        for (i, prompt) in [&x, &xy, &xz, &last].into_iter().enumerate() {
            let (out, c) = run(&model, &mut pc, prompt, 8);
            let (fresh, _) = run(&model, &mut PromptCache::new(), prompt, 8);
            assert_eq!(out, fresh, "trial {trial}, prompt {i}: the cached run differs from a fresh run");
            cached.push(c);
        }
        assert_eq!(cached, [0, 19, 19, 19], "trial {trial}");
    }
}
