//! The MTP drafter of DeepSeek-V3-family checkpoints (`--draft-model mtp`) on the fixtures
//! `scripts/make_mtp_fixtures.py` made (tests/fixtures/mtp: a tiny deepseek_v3 checkpoint with an MTP layer,
//! float with the layer in Hugging Face names, and mlx-lm's 4-bit quantization of it), against the script's
//! reference composed from mlx-lm 0.32.2's `deepseek_v3` modules: the target's tapped hidden states, the
//! layer's teacher-forced logits over the prompt and its chained greedy drafts. Then: greedy output with the
//! drafter is plain greedy output, and checkpoints without an MTP layer are refused with a reason.
//!
//! Tolerance: as for the text fixtures (tests/deepseek_v3.rs), f32 values within 1e-4 x max |reference|:
//! both sides run MLX's CPU kernels on the same weights and differ in op order only (mlx-lm compiles SwiGLU
//! and the router), about 1e-6 relative. Greedy choices must be identical: the script checked every MTP
//! top-1/top-2 gap >= 2e-3 and every router selection gap >= 2e-4, far above that noise.

use std::path::{Path, PathBuf};

use mlx_k3::generate::block_drafter::drafter_for;
use mlx_k3::generate::mtp_drafter::MtpDrafter;
use mlx_k3::generate::speculative::{generate_speculative, Drafter, Rollback, SpecOptions};
use mlx_k3::generate::{generate_tokens, GenerateOptions, PromptCache, SamplerConfig};
use mlx_k3::io::Safetensors;
use mlx_k3::model::mtp::MtpLayer;
use mlx_k3::model::{KimiK3, LoadOptions, ModelConfig};
use mlx_k3::{Array, Dtype};

mod logit_fixtures;
use logit_fixtures::{argmax, load, rel_err};

const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    logit_fixtures::dir("mtp")
}

struct Expected {
    prompt: Vec<u32>,
    hidden: Array,
    mtp_logits: Array,
    draft_tokens: Vec<u32>,
    draft_logits: Array,
    greedy: Vec<u32>,
}

fn expected(dir: &Path) -> Expected {
    let st = Safetensors::load(dir.join("expected.safetensors")).unwrap();
    let toks = |k: &str| st.get(k).unwrap().to_vec::<i32>().unwrap().iter().map(|&t| t as u32).collect();
    Expected {
        prompt: toks("prompt"),
        hidden: st.get("hidden").unwrap(),
        mtp_logits: st.get("mtp_logits").unwrap(),
        draft_tokens: toks("draft_tokens"),
        draft_logits: st.get("draft_logits").unwrap(),
        greedy: toks("greedy_tokens"),
    }
}

fn ids(t: &[u32]) -> Array {
    Array::from_slice(t, &[1, t.len() as i32]).unwrap()
}

fn rows(a: &Array) -> Vec<Vec<f32>> {
    let v = a.dim(-1).unwrap() as usize;
    a.to_vec_f32().unwrap().chunks(v).map(|r| r.to_vec()).collect()
}

#[test]
fn mtp_logits_and_drafts_match_the_reference() {
    let names: Vec<String> =
        logit_fixtures::manifest(&fixtures()).iter().map(|f| f["dir"].as_str().unwrap().to_string()).collect();
    assert_eq!(names, ["mtp_hf", "mtp_q4"]);
    for name in names {
        let dir = fixtures().join(&name);
        let exp = expected(&dir);
        let target = load(&dir, Dtype::F32);
        let cfg = ModelConfig::load(&dir).unwrap();
        let layer = MtpLayer::load(&dir, &cfg, &target).unwrap();
        let t = exp.prompt.len() as i32;
        let last = target.config().num_hidden_layers - 1;

        // The drafter's tap: the target's last layer output, before the final norm.
        let (_, taps) = target.forward_with_taps(&ids(&exp.prompt), None, &[last]).unwrap();
        let e_hidden = rel_err(&taps[0].reshape(&[t, -1]).unwrap(), &exp.hidden);
        assert!(e_hidden <= TOL, "{name}: hidden states rel err {e_hidden}");

        // Teacher-forced over the prompt: row i from h_i and prompt[i + 1].
        let h = taps[0].slice_axis(1, 0, t - 1).unwrap();
        let (_, logits) = layer.forward(&ids(&exp.prompt[1..]), &h, &mut layer.make_cache()).unwrap();
        let logits = logits.reshape(&[t - 1, -1]).unwrap();
        let e_mtp = rel_err(&logits, &exp.mtp_logits);
        assert!(e_mtp <= TOL, "{name}: MTP logits rel err {e_mtp}");
        for (i, (g, w)) in rows(&logits).iter().zip(rows(&exp.mtp_logits)).enumerate() {
            assert_eq!(argmax(g), argmax(&w), "{name}: MTP argmax at position {i}");
        }

        // Chained greedy drafts after the whole prompt, through the drafter (observe, then propose).
        let mut drafter = MtpDrafter::new(layer, &target);
        assert_eq!(drafter.tap_layers(), vec![last]);
        drafter.observe(0, &exp.prompt[..t as usize - 1], &[h]).unwrap();
        let k = exp.draft_tokens.len();
        let (tokens, got) = drafter.draft_logits(&exp.prompt, k).unwrap();
        assert_eq!(tokens, exp.draft_tokens, "{name}: drafts");
        let refs: Vec<&Array> = got.iter().collect();
        let got = mlx_k3::ops::stack(&refs, 0).unwrap();
        let e_draft = rel_err(&got, &exp.draft_logits);
        assert!(e_draft <= TOL, "{name}: draft logits rel err {e_draft}");
        // Asking again (nothing new observed) gives the same drafts: the chained positions were rolled back.
        let (again, _) = drafter.draft_logits(&exp.prompt, k).unwrap();
        assert_eq!(again, exp.draft_tokens, "{name}: drafts after a repeated proposal");
        println!("{name}: rel err hidden {e_hidden:.2e}, MTP logits {e_mtp:.2e}, drafts {e_draft:.2e}");
    }
}

fn mtp_hf() -> PathBuf {
    fixtures().join("mtp_hf")
}

fn load_opts() -> LoadOptions {
    LoadOptions { dtype: Some(Dtype::F32), lazy: false, shard: None }
}

fn mtp_drafter(dir: &Path, target: &KimiK3) -> Box<dyn Drafter> {
    drafter_for(Path::new("mtp"), dir, target, load_opts()).unwrap()
}

/// Greedy output with the MTP drafter is the target's plain greedy output (itself the reference's greedy
/// continuation), for several draft counts, both rollbacks and the gate, one drafter reused across requests
/// (a new request rewinds what it holds). The fixture's layer was fitted to the target's continuations, so
/// cycles keep drafts: the count is a check that acceptance and partial rollback were exercised, no speed
/// claim (the target is a random model).
#[test]
fn greedy_output_with_the_mtp_drafter_is_plain_greedy_output() {
    let dir = mtp_hf();
    let exp = expected(&dir);
    let target = load(&dir, Dtype::F32);
    let mut drafter = mtp_drafter(&dir, &target);
    assert_eq!(drafter.name(), "MTP layer");
    let opts = GenerateOptions { max_tokens: exp.greedy.len(), ..Default::default() };
    let mut other = exp.prompt[..7].to_vec();
    other.reverse();
    let (mut kept, mut partial) = (0, 0);
    for prompt in [exp.prompt.clone(), exp.prompt[..7].to_vec(), other] {
        let want = generate_tokens(&target, &mut PromptCache::new(), &prompt, &opts, |_| true).unwrap().0;
        if prompt == exp.prompt {
            assert_eq!(want, exp.greedy, "plain greedy differs from the reference's");
        }
        for (k, rollback) in [(1, Rollback::Record), (4, Rollback::Record), (3, Rollback::Recompute)] {
            let so = SpecOptions { num_draft: k, gate: false, rollback, ..Default::default() };
            let (got, _, _, st) =
                generate_speculative(&target, drafter.as_mut(), &mut PromptCache::new(), &prompt, &opts, &so, |_| true)
                    .unwrap();
            assert_eq!(got, want, "k {k}, {rollback:?}");
            kept += st.accepted;
            // A cycle that kept some drafts but not all of them.
            partial += usize::from(st.accepted > 0 && st.accepted < st.drafted);
        }
        let (got, ..) = generate_speculative(
            &target,
            drafter.as_mut(),
            &mut PromptCache::new(),
            &prompt,
            &opts,
            &SpecOptions::default(),
            |_| true,
        )
        .unwrap();
        assert_eq!(got, want, "with the gate");
    }
    println!("drafts kept: {kept}; generations that kept some drafts and rejected others: {partial}");
    assert!(kept > 0 && partial > 0, "no draft was kept ({kept}) or none rejected after one was ({partial})");
}

/// A second request continuing the first one's prompt cache (the drafter keeps what it computed of the
/// shared prefix) still gives plain greedy output; so does one that leaves it early.
#[test]
fn prompt_cache_reuse_keeps_greedy_output() {
    let dir = mtp_hf();
    let exp = expected(&dir);
    let target = load(&dir, Dtype::F32);
    let mut drafter = mtp_drafter(&dir, &target);
    let opts = GenerateOptions { max_tokens: 16, ..Default::default() };
    let so = SpecOptions { num_draft: 3, gate: false, ..Default::default() };
    let mut pc = PromptCache::new();
    let (first, ..) =
        generate_speculative(&target, drafter.as_mut(), &mut pc, &exp.prompt, &opts, &so, |_| true).unwrap();
    let mut longer = exp.prompt.clone();
    longer.extend_from_slice(&first[..8]);
    let mut diverging = exp.prompt[..9].to_vec();
    diverging.extend_from_slice(&[5, 6, 7]);
    for p in [longer, diverging] {
        let want = generate_tokens(&target, &mut PromptCache::new(), &p, &opts, |_| true).unwrap().0;
        let (got, ..) = generate_speculative(&target, drafter.as_mut(), &mut pc, &p, &opts, &so, |_| true).unwrap();
        assert_eq!(got, want);
    }
}

/// Sampling with the MTP drafter runs the speculative-sampling rule on the layer's distributions: the same
/// seed gives the same tokens, and every token is one the target's top-k allows. (The rule itself keeps the
/// target's distribution: tests/speculative.rs and tests/block_drafter.rs test it statistically.)
#[test]
fn sampling_with_the_mtp_drafter_is_seeded() {
    let dir = fixtures().join("mtp_q4");
    let exp = expected(&dir);
    let target = load(&dir, Dtype::F32);
    let mut drafter = mtp_drafter(&dir, &target);
    let sampler = SamplerConfig { temperature: 0.8, top_k: 4, seed: 7, ..Default::default() };
    let opts = GenerateOptions { max_tokens: 12, sampler, ..Default::default() };
    let so = SpecOptions { num_draft: 3, gate: false, ..Default::default() };
    let run = |d: &mut dyn Drafter| {
        generate_speculative(&target, d, &mut PromptCache::new(), &exp.prompt, &opts, &so, |_| true).unwrap()
    };
    let (a, _, _, st) = run(drafter.as_mut());
    let (b, ..) = run(drafter.as_mut());
    assert_eq!(a, b);
    assert!(st.drafted > 0);
    let mut ctx = exp.prompt.clone();
    for &tok in &a {
        let l = target.forward(&ids(&ctx), None).unwrap();
        let last = logit_fixtures::last_row(&l);
        let above = last.iter().filter(|&&x| x > last[tok as usize]).count();
        assert!(above < 4, "token {tok} is outside the target's top 4");
        ctx.push(tok);
    }
}

/// `--draft-model mtp` on a checkpoint that cannot draft with an MTP layer says why.
#[test]
fn checkpoints_without_an_mtp_layer_are_refused() {
    let err = |dir: &Path| {
        let target = load(dir, Dtype::F32);
        match drafter_for(Path::new("mtp"), dir, &target, load_opts()) {
            Ok(_) => panic!("{}: drafted with no MTP layer", dir.display()),
            Err(e) => e.to_string(),
        }
    };
    let dsv3 = logit_fixtures::dir("deepseek_v3");
    // No num_nextn_predict_layers in config.json (the MTP tensors of the _hf copy notwithstanding).
    for name in ["a_yarn_grouped", "c_kimi_k25_hf"] {
        let e = err(&dsv3.join(name));
        assert!(e.contains("num_nextn_predict_layers") && e.contains("config.json"), "{name}: {e}");
    }
    // The config promises a layer the weights lack (what mlx_lm.convert leaves).
    let tmp = std::env::temp_dir().join(format!("k3-no-mtp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    for f in ["model.safetensors", "model.safetensors.index.json"] {
        std::fs::copy(dsv3.join("a_yarn_grouped").join(f), tmp.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dsv3.join("a_yarn_grouped/config.json")).unwrap()).unwrap();
    cfg["num_nextn_predict_layers"] = 1.into();
    std::fs::write(tmp.join("config.json"), cfg.to_string()).unwrap();
    let e = err(&tmp);
    assert!(e.contains("model.layers.2.") && e.contains("num_nextn_predict_layers 1"), "{e}");
    std::fs::remove_dir_all(&tmp).unwrap();
    // Not a DeepSeek-V3-family model (k3-nano is kimi_k3).
    let nano = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano");
    let e = err(&nano);
    assert!(e.contains("DeepSeek-V3") && e.contains("kimi_k3"), "{e}");
    // A folder named mtp is still a folder when written ./mtp: the MTP layer is not what loads.
    let target = load(&mtp_hf(), Dtype::F32);
    let e = drafter_for(Path::new("./mtp"), &mtp_hf(), &target, load_opts()).err().unwrap().to_string();
    assert!(e.contains("mtp") && !e.contains("num_nextn"), "{e}");
}
