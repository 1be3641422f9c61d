//! Generation: greedy tokens against mlx-lm's `generate_step`, chunked prefill, the prompt cache across
//! turns, samplers (determinism and never sampling outside their sets), stop conditions, and streaming
//! detokenization.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use mlx_k3::generate::{generate_tokens, FinishReason, GenerateOptions, PromptCache, Sampler, SamplerConfig};
use mlx_k3::io::Safetensors;
use mlx_k3::model::{KimiK3, LoadOptions};
use mlx_k3::tokenizer::StreamDecoder;
use mlx_k3::Array;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/k3").join(name)
}

fn fixture_names() -> Vec<String> {
    let text = std::fs::read_to_string(fixture("manifest.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["fixtures"].as_array().unwrap().iter().map(|f| f["dir"].as_str().unwrap().to_string()).collect()
}

fn load(name: &str) -> KimiK3 {
    KimiK3::load(&fixture(name), LoadOptions::default()).unwrap()
}

fn prompt_and_reference(name: &str) -> (Vec<u32>, Vec<u32>) {
    let st = Safetensors::load(fixture(name).join("expected.safetensors")).unwrap();
    let p = st.get("prompt").unwrap().to_vec::<i32>().unwrap().into_iter().map(|t| t as u32).collect();
    let g = st.get("generate_tokens").unwrap().to_vec::<i32>().unwrap().into_iter().map(|t| t as u32).collect();
    (p, g)
}

fn greedy(max_tokens: usize, prefill_chunk: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, prefill_chunk, ..Default::default() }
}

#[test]
fn greedy_generation_matches_mlx_lm_generate_step() {
    for name in fixture_names() {
        let model = load(&name);
        let (prompt, reference) = prompt_and_reference(&name);
        let mut seen = Vec::new();
        let (tokens, reason, stats) =
            generate_tokens(&model, &mut PromptCache::new(), &prompt, &greedy(32, 512), |ev| {
                seen.push(ev.token);
                true
            })
            .unwrap();
        assert_eq!(tokens, reference, "{name}: greedy tokens differ from mlx_lm.generate");
        assert_eq!(seen, tokens, "{name}: the callback saw every token in order");
        assert_eq!(reason, FinishReason::Length);
        assert_eq!(
            (stats.prompt_tokens, stats.prefilled_tokens, stats.generated_tokens),
            (prompt.len(), prompt.len(), 32)
        );
        assert!(stats.time_to_first_token > 0.0 && stats.peak_memory > 0);
    }
}

#[test]
fn prefill_chunk_size_does_not_change_the_tokens() {
    let name = "d_latent_norm_attnres_untied";
    let model = load(name);
    let (prompt, reference) = prompt_and_reference(name);
    for chunk in [1, 3, 5, 11] {
        let (tokens, _, _) =
            generate_tokens(&model, &mut PromptCache::new(), &prompt, &greedy(32, chunk), |_| true).unwrap();
        assert_eq!(tokens, reference, "prefill chunk {chunk}");
    }
}

#[test]
fn a_second_turn_prefills_only_the_new_suffix() {
    let name = "a_latent_norm_attnres";
    let model = load(name);
    let (p1, _) = prompt_and_reference(name);
    let mut pc = PromptCache::new();
    let (g1, _, s1) = generate_tokens(&model, &mut pc, &p1, &greedy(8, 4), |_| true).unwrap();
    assert_eq!(s1.prefilled_tokens, p1.len());
    // The next turn: the conversation so far plus new tokens (as a chat template would render it).
    let extra = [7u32, 19, 88, 3, 250];
    let p2: Vec<u32> = p1.iter().chain(&g1).chain(&extra).copied().collect();
    let held = pc.tokens().len();
    assert_eq!(held, p1.len() + g1.len() - 1, "the last generated token has not been run yet");
    let (g2, _, s2) = generate_tokens(&model, &mut pc, &p2, &greedy(12, 4), |_| true).unwrap();
    assert_eq!(s2.prefilled_tokens, p2.len() - held, "only the new suffix is prefilled");
    let (fresh, _, s3) = generate_tokens(&model, &mut PromptCache::new(), &p2, &greedy(12, 4), |_| true).unwrap();
    assert_eq!(s3.prefilled_tokens, p2.len());
    assert_eq!(g2, fresh, "reusing the cache must not change the output");

    // A prompt that diverges inside the cached tokens: KDA state cannot be rewound, so the cache resumes
    // from the snapshot taken at the end of the last prefill that is still a prefix.
    let p3: Vec<u32> = p2[..p1.len() + 2].iter().copied().chain([100u32, 101, 102]).collect();
    let (g3, _, s4) = generate_tokens(&model, &mut pc, &p3, &greedy(6, 4), |_| true).unwrap();
    assert!(s4.prefilled_tokens < p3.len(), "a snapshot was reused");
    assert_eq!(s4.prefilled_tokens, p3.len() - (p1.len() - 1));
    let (fresh3, _, _) = generate_tokens(&model, &mut PromptCache::new(), &p3, &greedy(6, 4), |_| true).unwrap();
    assert_eq!(g3, fresh3);
}

#[test]
fn eos_and_callbacks_stop_generation() {
    let name = "b_latent_fullrank_every2";
    let model = load(name);
    let (prompt, reference) = prompt_and_reference(name);
    let opts = GenerateOptions { eos_ids: vec![reference[5]], ..greedy(32, 512) };
    let (tokens, reason, _) = generate_tokens(&model, &mut PromptCache::new(), &prompt, &opts, |_| true).unwrap();
    let first_eos = reference.iter().position(|t| *t == reference[5]).unwrap();
    assert_eq!(tokens, reference[..first_eos], "the EOS token ends the output and is not part of it");
    assert_eq!(reason, FinishReason::Stop);
    let mut n = 0;
    let (tokens, reason, _) = generate_tokens(&model, &mut PromptCache::new(), &prompt, &greedy(32, 512), |_| {
        n += 1;
        n < 3
    })
    .unwrap();
    assert_eq!((tokens.len(), reason), (3, FinishReason::Cancelled));
}

#[test]
fn bad_requests_are_errors() {
    let model = load("b_latent_fullrank_every2");
    let mut pc = PromptCache::new();
    assert!(generate_tokens(&model, &mut pc, &[], &greedy(4, 8), |_| true).is_err());
    assert!(generate_tokens(&model, &mut pc, &[1, 9999], &greedy(4, 8), |_| true).is_err());
    let bad = GenerateOptions { sampler: SamplerConfig { temperature: -1.0, ..Default::default() }, ..greedy(4, 8) };
    assert!(generate_tokens(&model, &mut pc, &[1, 2], &bad, |_| true).unwrap_err().to_string().contains("temperature"));
    let bad = GenerateOptions { sampler: SamplerConfig { top_p: 1.5, ..Default::default() }, ..greedy(4, 8) };
    assert!(generate_tokens(&model, &mut pc, &[1, 2], &bad, |_| true).unwrap_err().to_string().contains("top_p"));
}

fn logprobs(logits: &[f32]) -> Array {
    let a = Array::from_slice(logits, &[1, logits.len() as i32]).unwrap();
    a.subtract(&a.logsumexp(&[-1], true).unwrap()).unwrap()
}

fn draws(cfg: SamplerConfig, lp: &Array, n: usize) -> Vec<u32> {
    let mut s = Sampler::new(cfg).unwrap();
    (0..n).map(|_| s.sample(lp).unwrap().item::<u32>().unwrap()).collect()
}

fn softmax(l: &[f32]) -> Vec<f32> {
    let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = l.iter().map(|x| (x - m).exp()).collect();
    let z: f32 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

const LOGITS: [f32; 10] = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0];

#[test]
fn sampling_is_seeded_and_deterministic() {
    let lp = logprobs(&LOGITS);
    let cfg = |seed| SamplerConfig { temperature: 1.0, seed, ..Default::default() };
    let a = draws(cfg(7), &lp, 200);
    assert_eq!(a, draws(cfg(7), &lp, 200), "same seed, same draws");
    assert_ne!(a, draws(cfg(8), &lp, 200), "another seed, other draws");
    // Frequencies follow softmax(logits / T): token 0 has p = 0.343; 4000 draws give sd 0.0075.
    let many = draws(cfg(1), &lp, 4000);
    let f0 = many.iter().filter(|&&t| t == 0).count() as f32 / 4000.0;
    assert!((f0 - softmax(&LOGITS)[0]).abs() < 0.04, "frequency of token 0: {f0}");
    assert!(draws(SamplerConfig::greedy(), &lp, 5).iter().all(|&t| t == 0));
}

#[test]
fn filters_never_sample_outside_their_sets() {
    let lp = logprobs(&LOGITS);
    let p = softmax(&LOGITS);
    let base = SamplerConfig { temperature: 1.5, seed: 3, ..Default::default() };
    // top-k = 3 -> {0, 1, 2}.
    let got: HashSet<u32> = draws(SamplerConfig { top_k: 3, ..base.clone() }, &lp, 1500).into_iter().collect();
    assert_eq!(got, HashSet::from([0, 1, 2]));
    // top-p = 0.8: the smallest prefix (by probability) whose mass reaches 0.8.
    let mut mass = 0.0;
    let mut want = HashSet::new();
    for (i, pi) in p.iter().enumerate() {
        want.insert(i as u32);
        mass += pi;
        if mass >= 0.8 {
            break;
        }
    }
    let got: HashSet<u32> = draws(SamplerConfig { top_p: 0.8, ..base.clone() }, &lp, 1500).into_iter().collect();
    assert_eq!(got, want, "top-p 0.8 over {p:?}");
    // min-p = 0.2 -> tokens with p >= 0.2 * p_max.
    let want: HashSet<u32> = (0..10).filter(|&i| p[i] >= 0.2 * p[0]).map(|i| i as u32).collect();
    let got: HashSet<u32> = draws(SamplerConfig { min_p: 0.2, ..base.clone() }, &lp, 1500).into_iter().collect();
    assert_eq!(got, want, "min-p 0.2");
    // Combined filters intersect.
    let got: HashSet<u32> =
        draws(SamplerConfig { top_k: 2, min_p: 0.2, top_p: 0.9, ..base }, &lp, 800).into_iter().collect();
    assert!(got.is_subset(&HashSet::from([0, 1])) && !got.is_empty());
}

#[test]
fn logits_processors_follow_their_formulas() {
    let logits = Array::from_slice(&[1.0f32, -2.0, 3.0, 0.5], &[1, 4]).unwrap();
    let cfg = SamplerConfig {
        repetition_penalty: Some(2.0),
        presence_penalty: Some(0.25),
        logit_bias: vec![(3, 10.0)],
        penalty_context: 2,
        ..Default::default()
    };
    let s = Sampler::new(cfg).unwrap();
    // History [2, 0, 1]: only the last 2 (0 and 1) are penalized: positive logits / 2, negative * 2, then
    // -0.25 each; token 3 gets +10.
    let out = s.process(&logits, &[2, 0, 1]).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(out, [1.0 / 2.0 - 0.25, -2.0 * 2.0 - 0.25, 3.0, 10.5]);
}

#[test]
fn stream_decoder_never_splits_a_character() {
    let text = "añ€😀中";
    let bytes = text.as_bytes();
    for split in 1..4 {
        let mut d = StreamDecoder::new();
        let mut out = String::new();
        for chunk in bytes.chunks(split) {
            let piece = d.push(chunk);
            assert!(!piece.contains('\u{FFFD}'), "a half character was emitted");
            out.push_str(&piece);
        }
        out.push_str(&d.finish());
        assert_eq!(out, text);
    }
    let mut d = StreamDecoder::new();
    assert_eq!(d.push(&[0xE2, 0x82]), "");
    assert_eq!(d.pending(), 2);
    assert_eq!(d.push(&[0xAC, b'x']), "€x");
    assert_eq!(d.push(&[0xFF, b'y']), "\u{FFFD}y", "an impossible byte is replaced, not held");
    assert_eq!(d.push(&[0xF0]), "");
    assert_eq!(d.finish(), "\u{FFFD}", "an unfinished character at the end becomes U+FFFD");
}

#[test]
fn logit_bias_steers_greedy_decoding() {
    // With a logit bias of +1000 on one token, greedy decoding picks it at every step.
    let model = load("c_hidden_experts_grouped");
    let (prompt, _) = prompt_and_reference("c_hidden_experts_grouped");
    let opts = GenerateOptions {
        sampler: SamplerConfig { logit_bias: vec![(42, 1000.0)], ..Default::default() },
        ..greedy(5, 512)
    };
    let (tokens, _, _) = generate_tokens(&model, &mut PromptCache::new(), &prompt, &opts, |_| true).unwrap();
    assert_eq!(tokens, [42; 5]);
}
