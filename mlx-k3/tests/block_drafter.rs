//! The block drafter of k3-nano (models/k3-nano/drafter, trained by
//! scripts/speculative/train_block_drafter.py): its logits match the training script's reference, the
//! target's taps match mlx-lm's, greedy output with it is plain greedy output, sampling with it keeps the
//! target's distribution (a statistical test), and broken drafter files give errors that say what is wrong.

use std::path::{Path, PathBuf};

use mlx_k3::generate::block_drafter::{load_drafter, BlockDrafter, BlockEngine};
use mlx_k3::generate::speculative::{generate_speculative, Drafter, Rollback, SpecOptions, SpecStats};
use mlx_k3::generate::{generate_tokens, GenerateOptions, PromptCache, Sampler, SamplerConfig};
use mlx_k3::io::Safetensors;
use mlx_k3::model::{KimiK3, LoadOptions};
use mlx_k3::{Array, Dtype};

fn nano() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano")
}

fn drafter_dir() -> PathBuf {
    nano().join("drafter")
}

fn load_target() -> KimiK3 {
    KimiK3::load(&nano(), LoadOptions { dtype: Some(Dtype::F32), lazy: false, shard: None }).unwrap()
}

/// Held-out code (the drafter never trained on these files): 24-token windows of heldout.safetensors.
fn prompts() -> Vec<Vec<u32>> {
    let st = Safetensors::load(nano().join("heldout.safetensors")).unwrap();
    let tokens = st.get("tokens").unwrap().to_vec::<i32>().unwrap();
    [0usize, 3000, 20000].iter().map(|&s| tokens[s..s + 24].iter().map(|&t| t as u32).collect()).collect()
}

fn spec(
    model: &KimiK3,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    opts: &GenerateOptions,
    so: &SpecOptions,
) -> (Vec<u32>, SpecStats) {
    let (out, _, _, st) =
        generate_speculative(model, drafter, &mut PromptCache::new(), prompt, opts, so, |_| true).unwrap();
    (out, st)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// parity.safetensors holds, from the training script (mlx-lm 0.32.2's kimi_k3 in fp32 and the drafter in
/// fp32 with its stored bf16 weights): the target's taps of 40 held-out tokens and the drafter's logits
/// for the 41st token. Both sides compute in fp32 from the same weights; the differences are summation
/// order (BLAS, the attention kernel) and RoPE's angle evaluation, which stay near 1e-5 relative. The
/// tolerances (1e-3 of the largest tap and 2e-3 absolute on logits of magnitude ~10-20) leave room for
/// that and would still catch a wrong layer, tap or weight (errors of order 1).
#[test]
fn logits_and_taps_match_the_training_script() {
    let target = load_target();
    let drafter = BlockDrafter::load(&drafter_dir(), &target).unwrap();
    let st = Safetensors::load(drafter_dir().join("parity.safetensors")).unwrap();
    let tokens: Vec<u32> = st.get("tokens").unwrap().to_vec::<i32>().unwrap().iter().map(|&t| t as u32).collect();
    let taps = st.get("taps").unwrap().astype(Dtype::F32).unwrap();
    let want = st.get("logits").unwrap().astype(Dtype::F32).unwrap();
    assert_eq!(tokens.len(), 41);

    // The Rust target's taps equal mlx-lm's.
    let ids = Array::from_slice(&tokens[..40], &[1, 40]).unwrap();
    let (_, tapped) = target.forward_with_taps(&ids, None, &drafter.config().tap_layers).unwrap();
    let tapped: Vec<&Array> = tapped.iter().collect();
    let ours = mlx_k3::ops::concatenate(&tapped, 2).unwrap().squeeze(&[0]).unwrap();
    let (a, b) = (ours.to_vec_f32().unwrap(), taps.to_vec_f32().unwrap());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = max_abs_diff(&a, &b);
    assert!(d <= 1e-3 * scale, "taps differ by {d} (largest {scale})");

    // The drafter's logits on the reference taps, from both engines (the default on a CPU is the host).
    assert_eq!(drafter.engine(), BlockEngine::Host);
    let mlx = BlockDrafter::load_with(&drafter_dir(), &target, Some(BlockEngine::Mlx)).unwrap();
    assert_eq!(mlx.engine(), BlockEngine::Mlx);
    let w = want.to_vec_f32().unwrap();
    let argmax =
        |v: &[f32], row: usize, n: usize| (0..n).max_by(|&i, &j| v[row * n + i].total_cmp(&v[row * n + j])).unwrap();
    let v = want.dim(1).unwrap() as usize;
    let mut engines = Vec::new();
    for d in [&drafter, &mlx] {
        let got = d.logits_for_taps(&taps, tokens[40]).unwrap();
        assert_eq!(got.shape(), want.shape());
        let g = got.to_vec_f32().unwrap();
        let diff = max_abs_diff(&g, &w);
        assert!(diff < 2e-3, "{:?}: drafter logits differ by {diff}", d.engine());
        for r in 0..want.dim(0).unwrap() as usize {
            assert_eq!(argmax(&g, r, v), argmax(&w, r, v), "{:?} slot {r}: different argmax", d.engine());
        }
        engines.push(g);
    }
    // The two engines agree more closely than either with the reference (both fp32, summation order only).
    let diff = max_abs_diff(&engines[0], &engines[1]);
    assert!(diff < 2e-4, "host and MLX engines differ by {diff}");
}

/// The MLX engine (what a drafter runs on a GPU, or above the host's size limit) drafts the same tokens as
/// the host engine in whole generations, so both give plain greedy output and the same cycles.
#[test]
fn both_engines_draft_the_same() {
    let target = load_target();
    let opts = GenerateOptions { max_tokens: 32, ..Default::default() };
    let so = SpecOptions { num_draft: 7, gate: false, ..Default::default() };
    let prompt = &prompts()[1];
    let want = generate_tokens(&target, &mut PromptCache::new(), prompt, &opts, |_| true).unwrap().0;
    let mut runs = Vec::new();
    for engine in [BlockEngine::Host, BlockEngine::Mlx] {
        let mut d = BlockDrafter::load_with(&drafter_dir(), &target, Some(engine)).unwrap();
        let (got, st) = spec(&target, &mut d, prompt, &opts, &so);
        assert_eq!(got, want, "{engine:?}");
        runs.push((st.cycles, st.accepted));
    }
    assert_eq!(runs[0], runs[1], "host vs MLX engine: (cycles, accepted)");
}

/// Greedy output with the block drafter is the target's plain greedy output (k3-nano, held-out prompts,
/// with and without the gate, both rollbacks); the drafter is also right often enough that cycles keep
/// drafts (a trained drafter on the target's own domain).
#[test]
fn greedy_output_is_plain_greedy_output() {
    let target = load_target();
    let mut drafter = BlockDrafter::load(&drafter_dir(), &target).unwrap();
    let opts = GenerateOptions { max_tokens: 48, ..Default::default() };
    let mut kept = 0;
    for prompt in prompts() {
        let want = generate_tokens(&target, &mut PromptCache::new(), &prompt, &opts, |_| true).unwrap().0;
        for (k, rollback) in [(7, Rollback::Record), (5, Rollback::Recompute)] {
            let so = SpecOptions { num_draft: k, gate: false, rollback, ..Default::default() };
            let (got, st) = spec(&target, &mut drafter, &prompt, &opts, &so);
            assert_eq!(got, want, "k {k}, {rollback:?}");
            kept += st.accepted;
        }
        let (got, _) = spec(&target, &mut drafter, &prompt, &opts, &SpecOptions::default());
        assert_eq!(got, want, "with the gate");
    }
    assert!(kept > 0, "the drafter never drafted a token the target kept");
}

/// A second request continuing the first one's prompt cache (the drafter keeps the taps it saw of the
/// shared prefix) still gives plain greedy output.
#[test]
fn prompt_cache_reuse_keeps_greedy_output() {
    let target = load_target();
    let mut drafter = load_drafter(&drafter_dir(), &target, LoadOptions::default()).unwrap();
    assert_eq!(drafter.name(), "block drafter");
    let opts = GenerateOptions { max_tokens: 24, ..Default::default() };
    let so = SpecOptions { num_draft: 5, gate: false, ..Default::default() };
    let p = &prompts()[1];
    let mut pc = PromptCache::new();
    let (first, ..) = generate_speculative(&target, drafter.as_mut(), &mut pc, p, &opts, &so, |_| true).unwrap();
    let mut longer = p.clone();
    longer.extend_from_slice(&first[..12]);
    let want = generate_tokens(&target, &mut PromptCache::new(), &longer, &opts, |_| true).unwrap().0;
    let (got, ..) = generate_speculative(&target, drafter.as_mut(), &mut pc, &longer, &opts, &so, |_| true).unwrap();
    assert_eq!(got, want);
}

fn chi_square(counts: &[u64], p: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(p)
        .map(|(&c, &pi)| {
            let e = pi * n as f64;
            if e == 0.0 {
                if c == 0 {
                    0.0
                } else {
                    f64::INFINITY
                }
            } else {
                (c as f64 - e).powi(2) / e
            }
        })
        .sum()
}

/// Sampling with the block drafter keeps the target's distribution: with top-k 8 at temperature 1, the
/// first two tokens of 1,500 seeded generations (each one cycle of 1 draft: max_tokens 2 leaves room for
/// one draft and the target's token after it) are compared
/// with the target's exact marginals (the first token's distribution; the second's, summed over the first)
/// by a chi-square test (7 degrees of freedom at the 1e-4 level: critical value 25.74). A correct rule
/// fails with probability < 1e-4 per check and the seeds make the test deterministic.
#[test]
fn sampling_keeps_the_target_distribution() {
    const N: u64 = 1500;
    const CRIT: f64 = 25.74;
    let target = load_target();
    let mut drafter = BlockDrafter::load(&drafter_dir(), &target).unwrap();
    // A held-out prompt followed by 16 of the target's greedy tokens: the context the drafter was trained
    // on (the target's own output), where its distributions overlap the target's, so acceptance happens.
    let mut prompt = prompts()[1].clone();
    let opts = GenerateOptions { max_tokens: 16, ..Default::default() };
    prompt.extend(generate_tokens(&target, &mut PromptCache::new(), &prompt, &opts, |_| true).unwrap().0);
    let prompt = &prompt;
    let scfg = SamplerConfig { temperature: 1.0, top_k: 8, ..Default::default() };
    let sampler = Sampler::new(scfg.clone()).unwrap();
    // The target's distribution (filters applied) after a token sequence.
    let dist = |ids: &[u32]| -> Vec<f32> {
        let l = target.forward(&Array::from_slice(ids, &[1, ids.len() as i32]).unwrap(), None).unwrap();
        let t = l.dim(1).unwrap();
        let row = l.slice_axis(1, t - 1, t).unwrap().squeeze(&[1]).unwrap();
        let lp = mlx_k3::kernels::log_softmax(&row).unwrap();
        sampler.distribution(&lp).unwrap().to_vec_f32().unwrap()
    };
    let p0 = dist(prompt);
    let support: Vec<usize> = (0..p0.len()).filter(|&i| p0[i] > 0.0).collect();
    assert_eq!(support.len(), 8);
    let mut p1 = vec![0f64; p0.len()];
    for &a in &support {
        let mut ids = prompt.clone();
        ids.push(a as u32);
        for (b, &x) in dist(&ids).iter().enumerate() {
            p1[b] += p0[a] as f64 * x as f64;
        }
    }
    let support1: Vec<usize> = (0..p1.len()).filter(|&i| p1[i] > 0.0).collect();
    let mut c0 = vec![0u64; p0.len()];
    let mut c1 = vec![0u64; p1.len()];
    let so = SpecOptions { num_draft: 2, gate: false, ..Default::default() };
    let mut pc = PromptCache::new();
    let mut accepted = 0;
    for seed in 0..N {
        let opts =
            GenerateOptions { max_tokens: 2, sampler: SamplerConfig { seed, ..scfg.clone() }, ..Default::default() };
        let (out, _, _, st) =
            generate_speculative(&target, &mut drafter, &mut pc, prompt, &opts, &so, |_| true).unwrap();
        c0[out[0] as usize] += 1;
        c1[out[1] as usize] += 1;
        accepted += st.accepted;
    }
    let cells = |c: &[u64], s: &[usize]| s.iter().map(|&i| c[i]).collect::<Vec<_>>();
    let p0s: Vec<f64> = support.iter().map(|&i| p0[i] as f64).collect();
    let x0 = chi_square(&cells(&c0, &support), &p0s);
    assert_eq!(cells(&c0, &support).iter().sum::<u64>(), N, "a first token outside the target's top 8");
    assert!(x0 < CRIT, "first token: chi-square {x0:.1} >= {CRIT}");
    // The second token's support is the union of the 8 continuations' top 8; pool cells below 5 expected
    // counts into one (the chi-square approximation needs it), keeping the degrees of freedom at the
    // number of pooled cells - 1.
    let mut pooled_p = Vec::new();
    let mut pooled_c = Vec::new();
    let (mut rest_p, mut rest_c) = (0.0, 0);
    for &i in &support1 {
        if p1[i] * N as f64 >= 5.0 {
            pooled_p.push(p1[i]);
            pooled_c.push(c1[i]);
        } else {
            rest_p += p1[i];
            rest_c += c1[i];
        }
    }
    pooled_p.push(rest_p);
    pooled_c.push(rest_c);
    assert_eq!(pooled_c.iter().sum::<u64>(), N, "a second token outside the target's support");
    let x1 = chi_square(&pooled_c, &pooled_p);
    // The 1e-4 critical values of chi-square for 1..=40 degrees of freedom would be needed in general;
    // the Wilson-Hilferty approximation gives them within 1% here.
    let df = (pooled_p.len() - 1) as f64;
    let z = 3.719; // the standard normal's 1 - 1e-4 quantile
    let crit1 = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
    assert!(x1 < crit1, "second token: chi-square {x1:.1} >= {crit1:.1} ({df} degrees of freedom)");
    assert!(accepted > 0, "no draft was ever kept: the test did not exercise acceptance");
}

/// Broken drafter folders fail to load with an error naming the file and what is wrong.
#[test]
fn broken_drafter_files_give_clear_errors() {
    let target = load_target();
    let tmp = std::env::temp_dir().join(format!("k3-bad-drafter-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let cfg = std::fs::read_to_string(drafter_dir().join("config.json")).unwrap();
    let err = |dir: &Path| match BlockDrafter::load(dir, &target) {
        Ok(_) => panic!("loaded a broken drafter"),
        Err(e) => e.to_string(),
    };

    // No config.json.
    let e = err(&tmp);
    assert!(e.contains("config.json"), "{e}");
    // A config whose tap layer the target lacks.
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v["tap_layers"] = serde_json::json!([1, 3, 9]);
    std::fs::write(tmp.join("config.json"), v.to_string()).unwrap();
    let e = err(&tmp);
    assert!(e.contains("tap_layers"), "{e}");
    // A good config, no weights.
    std::fs::write(tmp.join("config.json"), &cfg).unwrap();
    let e = err(&tmp);
    assert!(e.contains("model.safetensors"), "{e}");
    // Truncated weights.
    let bytes = std::fs::read(drafter_dir().join("model.safetensors")).unwrap();
    std::fs::write(tmp.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let e = err(&tmp);
    assert!(e.contains("model.safetensors"), "{e}");
    // A tensor of the wrong shape (the config says a wider MLP than the weights have).
    v = serde_json::from_str(&cfg).unwrap();
    v["intermediate_size"] = serde_json::json!(512);
    std::fs::write(tmp.join("config.json"), v.to_string()).unwrap();
    std::fs::write(tmp.join("model.safetensors"), &bytes).unwrap();
    let e = err(&tmp);
    assert!(e.contains("gate_proj") && e.contains("shape"), "{e}");
    // --draft-model on it reports the same (the folder is detected as a block drafter).
    let e = load_drafter(&tmp, &target, LoadOptions::default()).err().unwrap().to_string();
    assert!(e.contains("gate_proj"), "{e}");
    std::fs::remove_dir_all(&tmp).unwrap();
}
