//! One model over two ranks on localhost (real processes of the `mlx-k3` binary over MLX's ring back-end,
//! set up exactly as `mlx.launch` does: `MLX_RANK` and a `MLX_HOSTFILE`): expert parallel and expert +
//! tensor parallel give mlx-lm's greedy tokens and the one-rank logits; each rank holds about half of the
//! experts; a killed rank makes the other exit with an error.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use mlx_k3::io::Safetensors;
use mlx_k3::model::{KimiK3, LoadOptions};
use mlx_k3::{Array, Dtype};
use serde_json::{json, Value};

mod server_support;
use server_support::Server;

fn nano() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/k3")
}

/// A fixture's folder: `deepseek_v3/NAME` in tests/fixtures/deepseek_v3, `k31/NAME` in tests/fixtures/k31,
/// other names in tests/fixtures/k3.
fn fixture_dir(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures");
    match name.split_once('/') {
        Some((family @ ("deepseek_v3" | "k31"), n)) => root.join(family).join(n),
        _ => fixtures().join(name),
    }
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_mlx-k3")
}

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("dist-model-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A hostfile for `n` ranks on free localhost ports, as `mlx.launch` writes it.
fn hostfile(dir: &Path, n: usize) -> PathBuf {
    let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let hosts: Vec<Vec<String>> =
        listeners.iter().map(|l| vec![format!("127.0.0.1:{}", l.local_addr().unwrap().port())]).collect();
    drop(listeners);
    let path = dir.join("hosts.json");
    std::fs::write(&path, serde_json::to_string(&hosts).unwrap()).unwrap();
    path
}

fn spawn_ranks(dir: &Path, n: usize, args: &[String]) -> Vec<Child> {
    spawn_ranks_with(dir, n, |_| args.to_vec())
}

/// Like [`spawn_ranks`], with each rank's own arguments.
fn spawn_ranks_with(dir: &Path, n: usize, args: impl Fn(usize) -> Vec<String>) -> Vec<Child> {
    let hosts = hostfile(dir, n);
    (0..n)
        .map(|r| {
            Command::new(bin())
                .args(args(r))
                .env("MLX_RANK", r.to_string())
                .env("MLX_HOSTFILE", &hosts)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

/// Waits for every rank (at most `limit`), killing them all if one hangs.
fn wait_all(children: Vec<Child>, limit: Duration) -> Vec<Output> {
    let start = Instant::now();
    let mut children = children;
    loop {
        if children.iter_mut().all(|c| c.try_wait().unwrap().is_some()) {
            break;
        }
        if start.elapsed() > limit {
            for c in children.iter_mut() {
                let _ = c.kill();
            }
            panic!("ranks did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    children.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
}

struct Fixture {
    prompt: Vec<i32>,
    generated: Vec<u32>,
    /// mlx-lm's logits over the prompt.
    prefill: Array,
}

fn fixture(name: &str) -> Fixture {
    let st = Safetensors::load(fixture_dir(name).join("expected.safetensors")).unwrap();
    let prompt = st.get("prompt").unwrap().astype(Dtype::I32).unwrap().to_vec::<i32>().unwrap();
    let generated = st.get("generate_tokens").unwrap().astype(Dtype::U32).unwrap().to_vec::<u32>().unwrap();
    let prefill = st.get("prefill_logits").unwrap();
    prefill.eval().unwrap();
    Fixture { prompt, generated, prefill }
}

/// Runs `logits --generate` for `name` on `ranks` ranks (1: no --distributed); returns rank 0's logits and
/// tokens and every rank's stderr.
fn run_logits(name: &str, ranks: usize, tp: bool, gen: usize) -> (Array, Vec<u32>, Vec<String>) {
    let f = fixture(name);
    let dir = scratch(&format!("{}-{ranks}-{tp}", name.replace('/', "-")));
    let out = dir.join("logits.safetensors");
    let tokens: Vec<String> = f.prompt.iter().map(|t| t.to_string()).collect();
    let mut args: Vec<String> = vec![
        "logits".into(),
        "--model".into(),
        fixture_dir(name).display().to_string(),
        "--tokens".into(),
        tokens.join(","),
        "--out".into(),
        out.display().to_string(),
        "--dtype".into(),
        "float32".into(),
        "--generate".into(),
        gen.to_string(),
    ];
    let outputs = if ranks == 1 {
        let o = Command::new(bin()).args(&args).output().unwrap();
        vec![o]
    } else {
        args.extend(["--distributed".into(), "ring".into()]);
        if tp {
            args.push("--tp".into());
        }
        wait_all(spawn_ranks(&dir, ranks, &args), Duration::from_secs(180))
    };
    let stderr: Vec<String> = outputs.iter().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).collect();
    for (r, o) in outputs.iter().enumerate() {
        assert!(o.status.success(), "{name}: rank {r} failed: {}", stderr[r]);
    }
    let st = Safetensors::load(&out).unwrap();
    let logits = st.get("logits").unwrap();
    logits.eval().unwrap();
    let generated = if gen > 0 { st.get("generated").unwrap().to_vec::<u32>().unwrap() } else { Vec::new() };
    (logits, generated, stderr)
}

fn max_rel_err(a: &Array, b: &Array) -> f32 {
    let (a, b) = (a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap());
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// f32 partial sums added over ranks in another order than one rank's single reduction: differences are
/// rounding only. 1e-5 of the largest logit is ~100 f32 ulps, far below any real graph difference (a
/// missing expert or a wrong head moves logits by percent).
const TOL: f32 = 1e-5;

#[test]
fn expert_parallel_matches_one_rank_and_mlx_lm() {
    // Every fixture family: latent + norm + attention residuals (shared experts on rank 0: their 32 units
    // do not split into quantization groups of 32 on the q4 fixture), full-rank gates, grouped routing,
    // untied head, release names and compressed-tensors MXFP4 experts stacked per rank.
    for name in [
        "a_latent_norm_attnres",
        "a_latent_norm_attnres_q4",
        "a_latent_norm_attnres_mxfp4_release",
        "b_latent_fullrank_every2",
        "c_hidden_experts_grouped",
        "d_latent_norm_attnres_untied_release",
    ] {
        let f = fixture(name);
        let (one, one_gen, _) = run_logits(name, 1, false, f.generated.len());
        let (two, two_gen, _) = run_logits(name, 2, false, f.generated.len());
        assert_eq!(one_gen, f.generated, "{name}: one rank vs mlx-lm");
        assert_eq!(two_gen, f.generated, "{name}: two ranks (EP) vs mlx-lm");
        let err = max_rel_err(&two, &one);
        assert!(err <= TOL, "{name}: EP logits differ from one rank by {err}");
        // The same bound as the one-rank model test against mlx-lm (tests/model.rs).
        let err = max_rel_err(&two, &f.prefill);
        assert!(err <= 2e-5, "{name}: EP logits differ from mlx-lm by {err}");
    }
}

#[test]
fn expert_and_tensor_parallel_match_one_rank_and_mlx_lm() {
    for name in ["b_latent_fullrank_every2", "c_hidden_experts_grouped", "d_latent_norm_attnres_untied"] {
        let f = fixture(name);
        let (one, _, _) = run_logits(name, 1, false, 0);
        let (two, two_gen, _) = run_logits(name, 2, true, f.generated.len());
        assert_eq!(two_gen, f.generated, "{name}: two ranks (EP+TP) vs mlx-lm");
        let err = max_rel_err(&two, &one);
        assert!(err <= TOL, "{name}: EP+TP logits differ from one rank by {err}");
    }
}

#[test]
fn deepseek_v3_expert_and_tensor_parallel_match_one_rank_and_mlx_lm() {
    // The DeepSeek-V3 family on two ranks: YaRN MLA heads split (TP), grouped routing, a shared expert and
    // the dense first layer's units split; the Hugging Face-named kimi_k25 copy stacks each rank's experts
    // from per-expert tensors and drops the MTP layer. Expert parallel alone and expert + tensor parallel
    // both give mlx-lm's greedy tokens and the one-rank logits. The quantized copy runs expert parallel only:
    // its o_proj (4 heads x 8 values = 32 inputs, one group of 32) cannot split over heads, which the
    // loader refuses by name (tensor_parallel_rejects_heads_that_do_not_split checks such errors).
    for (name, tps) in [
        ("deepseek_v3/a_yarn_grouped", &[false, true][..]),
        ("deepseek_v3/c_kimi_k25_hf", &[false, true][..]),
        ("deepseek_v3/a_yarn_grouped_q4", &[false][..]),
    ] {
        let f = fixture(name);
        let (one, one_gen, _) = run_logits(name, 1, false, f.generated.len());
        assert_eq!(one_gen, f.generated, "{name}: one rank vs mlx-lm");
        for &tp in tps {
            let (two, two_gen, _) = run_logits(name, 2, tp, f.generated.len());
            assert_eq!(two_gen, f.generated, "{name}: two ranks (tp {tp}) vs mlx-lm");
            let err = max_rel_err(&two, &one);
            assert!(err <= TOL, "{name}: two-rank (tp {tp}) logits differ from one rank by {err}");
            // The bound of the one-rank test against mlx-lm (mlx-k3/tests/deepseek_v3.rs).
            let err = max_rel_err(&two, &f.prefill);
            assert!(err <= 1e-4, "{name}: two-rank (tp {tp}) logits differ from mlx-lm by {err}");
        }
    }
}

#[test]
fn k31_expert_and_tensor_parallel_match_one_rank_and_the_reference() {
    // Kimi K3.1 (K3 with the DSA indexer on both MLA layers, index_topk 4 under a 12-token prompt) on two
    // ranks: experts split (EP), and KDA heads, MLA heads, the shared expert and the dense layer's units split
    // too (EP+TP), while each rank holds the whole indexer and so keeps the same positions. Both give the
    // reference's greedy tokens (scripts/make_k31_fixtures.py) and the one-rank logits.
    let name = "k31/a_k31_topk4";
    let f = fixture(name);
    let (one, one_gen, _) = run_logits(name, 1, false, f.generated.len());
    assert_eq!(one_gen, f.generated, "{name}: one rank vs the reference");
    for tp in [false, true] {
        let (two, two_gen, _) = run_logits(name, 2, tp, f.generated.len());
        assert_eq!(two_gen, f.generated, "{name}: two ranks (tp {tp}) vs the reference");
        let err = max_rel_err(&two, &one);
        assert!(err <= TOL, "{name}: two-rank (tp {tp}) logits differ from one rank by {err}");
        // The bound of the one-rank test against the reference (mlx-k3/tests/k31.rs).
        let err_ref = max_rel_err(&two, &f.prefill);
        assert!(err_ref <= 1e-4, "{name}: two-rank (tp {tp}) logits differ from the reference by {err_ref}");
        println!("{name} tp {tp}: rel err vs one rank {err:.2e}, vs the reference {err_ref:.2e}");
    }
}

/// "rank r/n: resident weights ... routed experts X (N bytes)" -> N.
fn expert_bytes(stderr: &str) -> u64 {
    let line = stderr.lines().find(|l| l.contains("resident weights")).unwrap_or_else(|| panic!("no report: {stderr}"));
    let start = line.find("routed experts").unwrap();
    let open = line[start..].find('(').unwrap() + start + 1;
    let close = line[open..].find(' ').unwrap() + open;
    line[open..close].parse().unwrap()
}

#[test]
fn each_rank_holds_about_half_of_the_experts() {
    let name = "d_latent_norm_attnres_untied";
    let whole =
        KimiK3::load(&fixtures().join(name), LoadOptions { dtype: Some(Dtype::F32), lazy: true, shard: None }).unwrap();
    let all: u64 = whole.tensor_records().iter().filter(|r| r.path.contains("switch_mlp")).map(|r| r.bytes).sum();
    assert!(all > 0);
    let (_, _, stderr) = run_logits(name, 2, false, 0);
    let per: Vec<u64> = stderr.iter().map(|s| expert_bytes(s)).collect();
    assert_eq!(per.iter().sum::<u64>(), all, "the ranks' experts add up to the model's");
    for (r, b) in per.iter().enumerate() {
        assert_eq!(*b * 2, all, "rank {r} holds {b} of {all} expert bytes (16 experts split 8 + 8)");
    }

    // `plan` reports the same split without loading any data.
    let o = Command::new(bin())
        .args(["plan", "--model", &fixtures().join(name).display().to_string(), "--ranks", "2"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    let row = text.lines().find(|l| l.starts_with("routed experts")).unwrap_or_else(|| panic!("{text}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    // "routed experts <unsplit> <unit> <rank0> <unit> <rank1> <unit>": the rank columns are halves.
    let num = |i: usize| cols[i].parse::<f64>().unwrap();
    assert!((num(4) - num(2) / 2.0).abs() < 0.01 * num(2), "{row}");
    assert!((num(6) - num(2) / 2.0).abs() < 0.01 * num(2), "{row}");
}

#[test]
fn tensor_parallel_rejects_heads_that_do_not_split() {
    // The `a` fixtures have one KDA head: two ranks cannot split it, and the error says so on every rank.
    let name = "a_latent_norm_attnres";
    let dir = scratch("tp-reject");
    let args: Vec<String> = [
        "logits",
        "--model",
        &fixtures().join(name).display().to_string(),
        "--tokens",
        "1,2,3",
        "--out",
        &dir.join("x.safetensors").display().to_string(),
        "--distributed",
        "ring",
        "--tp",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for (r, o) in wait_all(spawn_ranks(&dir, 2, &args), Duration::from_secs(60)).iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "rank {r} should fail");
        assert!(err.contains("KDA heads") && err.contains("2 ranks"), "rank {r}: {err}");
    }
    assert!(!dir.join("x.safetensors").exists());
}

#[test]
fn a_killed_rank_makes_the_other_exit_with_an_error() {
    let nano = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano");
    let dir = scratch("kill");
    let args: Vec<String> = [
        "logits",
        "--model",
        &nano.display().to_string(),
        "--tokens",
        "1,2,3,4",
        "--out",
        &dir.join("x.safetensors").display().to_string(),
        "--generate",
        "100000",
        "--distributed",
        "ring",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut ranks = spawn_ranks(&dir, 2, &args);
    // Wait until rank 1 has loaded its part (it reports), let generation run, then kill it.
    let mut err1 = ranks[1].stderr.take().unwrap();
    let mut seen = String::new();
    let start = Instant::now();
    let mut buf = [0u8; 256];
    while !seen.contains("resident weights") {
        let n = err1.read(&mut buf).unwrap();
        assert!(n > 0 && start.elapsed() < Duration::from_secs(60), "rank 1 never reported: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    std::thread::sleep(Duration::from_millis(1500));
    assert!(ranks[0].try_wait().unwrap().is_none(), "rank 0 ended before the kill");
    ranks[1].kill().unwrap();
    ranks[1].wait().unwrap();
    let killed_at = Instant::now();
    let mut r0 = ranks.remove(0);
    let status = loop {
        if let Some(s) = r0.try_wait().unwrap() {
            break s;
        }
        if killed_at.elapsed() > Duration::from_secs(30) {
            r0.kill().unwrap();
            panic!("rank 0 still running 30 s after rank 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err0 = String::new();
    r0.stderr.take().unwrap().read_to_string(&mut err0).unwrap();
    assert!(!status.success(), "rank 0 must exit non-zero");
    assert!(err0.contains("mlx-k3: error:") && err0.contains("lost"), "rank 0 exited {status:?}, saying: {err0}");
    eprintln!("rank 0 exited {:?} after {:?}: {}", status.code(), killed_at.elapsed(), err0.trim());
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn generate_args(extra: &[&str]) -> Vec<String> {
    let mut a = strings(&["generate", "--model", &nano().display().to_string(), "--prompt", "def main():", "--raw"]);
    a.extend(strings(extra));
    a
}

#[test]
fn generate_over_two_ranks_prints_what_one_rank_prints() {
    let dir = scratch("generate");
    // Greedy, and sampled: every rank draws from its own copy of the logits with the same seeded sampler,
    // so the ranks agree without sending tokens, and agree with one rank (the logits differ by rounding only).
    for extra in [&["--max-tokens", "40", "--temp", "0"][..], &["--max-tokens", "40", "--temp", "0.8", "--seed", "11"]]
    {
        let args = generate_args(extra);
        let one = Command::new(bin()).args(&args).output().unwrap();
        assert!(one.status.success(), "{}", String::from_utf8_lossy(&one.stderr));
        let want = String::from_utf8_lossy(&one.stdout).into_owned();
        assert!(want.len() > "def main():".len() + 10, "one rank printed {want:?}");
        for tp in [false, true] {
            let mut args = args.clone();
            args.extend(strings(&["--distributed", "ring"]));
            if tp {
                args.push("--tp".into());
            }
            let outs = wait_all(spawn_ranks(&dir, 2, &args), Duration::from_secs(180));
            for (r, o) in outs.iter().enumerate() {
                assert!(o.status.success(), "{extra:?} tp {tp}: rank {r}: {}", String::from_utf8_lossy(&o.stderr));
            }
            assert_eq!(String::from_utf8_lossy(&outs[0].stdout), want, "{extra:?} tp {tp}: rank 0 vs one rank");
            assert!(outs[1].stdout.is_empty(), "rank 1 prints nothing: {:?}", String::from_utf8_lossy(&outs[1].stdout));
        }
    }
}

#[test]
fn ranks_that_sample_differently_stop_with_a_divergence_error() {
    // Each rank given its own seed draws different tokens; the tripwire (a hash of the tokens, compared every
    // 16 tokens) must catch it and every rank must say so and exit non-zero.
    let dir = scratch("diverge");
    let outs = wait_all(
        spawn_ranks_with(&dir, 2, |r| {
            let seed = (r + 1).to_string();
            let mut a = generate_args(&["--max-tokens", "64", "--temp", "1.5", "--seed", &seed]);
            a.extend(strings(&["--distributed", "ring"]));
            a
        }),
        Duration::from_secs(120),
    );
    for (r, o) in outs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "rank {r} must fail: {err}");
        assert!(err.contains("ranks diverged"), "rank {r} said: {err}");
    }
}

/// A web-chat turn: (answer, the `done` event).
fn web_turn(s: &Server, messages: &Value, session: &str) -> (String, Value) {
    let events = s.stream_all(
        "/api/chat",
        &json!({"messages": messages, "session": session, "max_tokens": 12, "temperature": 0, "thinking_effort": "off"}),
    );
    let mut answer = String::new();
    for e in &events {
        if e.event == "answer" || e.event == "thinking" {
            answer += e.json()["text"].as_str().unwrap();
        }
    }
    let done = events.last().unwrap();
    assert_eq!(done.event, "done", "{events:?}");
    (answer, done.json())
}

/// Greedy completion text of `prompt`.
fn complete(s: &Server, prompt: &str, max_tokens: usize) -> String {
    let (status, v) = s.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}));
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn the_server_runs_over_two_ranks() {
    let turn1 = json!([{"role": "user", "content": "Write a function that reverses a list."}]);
    let turn2 = |answer: &str| {
        json!([{"role": "user", "content": "Write a function that reverses a list."},
               {"role": "assistant", "content": answer},
               {"role": "user", "content": "Now make it recursive."}])
    };
    // What one rank answers.
    let one = Server::start_with(&nano(), &[]);
    let want = complete(&one, "def main():", 24);
    let (a1, _) = web_turn(&one, &turn1, "conv");
    let (a2, _) = web_turn(&one, &turn2(&a1), "conv");
    drop(one);

    // Rank 0 serves HTTP; rank 1 computes its half of the experts (and heads: --tp) for every request.
    // Rank 0 also drafts with k3-nano's block drafter (speculative decoding over the ranks): every request
    // below but the opted-out one runs drafting cycles, sessions and a hang-up included.
    let dir = scratch("serve");
    let hosts = hostfile(&dir, 2);
    let drafter = nano().join("drafter").display().to_string();
    let args = strings(&[
        "serve",
        "--port",
        "0",
        "--model",
        &nano().display().to_string(),
        "--distributed",
        "ring",
        "--tp",
        "--draft-model",
        &drafter,
    ]);
    let mut rank1 = Command::new(bin())
        .args(&args)
        .env("MLX_RANK", "1")
        .env("MLX_HOSTFILE", &hosts)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rank0 = Command::new(bin())
        .args(&args)
        .env("MLX_RANK", "0")
        .env("MLX_HOSTFILE", &hosts)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let s = Server::attach(rank0, None);
    assert_eq!(complete(&s, "def main():", 24), want, "completion over two ranks");
    let cycles = s.metric("mlx_k3_spec_cycles_total");
    assert!(cycles >= 1.0, "the completion drafted");
    // A request's opt-out decodes plainly on both ranks.
    let body = json!({"prompt": "def main():", "max_tokens": 24, "temperature": 0, "speculative": false});
    let (status, v) = s.post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want, "opted out over two ranks");
    assert_eq!(s.metric("mlx_k3_spec_cycles_total"), cycles, "an opted-out request drafted");

    // A request refused on rank 0 never reaches rank 1; the ranks stay in step.
    let (status, v) = s.post("/v1/completions", &json!({"prompt": [1, 2, 999999], "max_tokens": 4}));
    assert_eq!(status, 400, "{v}");

    // A client that hangs up mid-stream: rank 0 stops, and tells rank 1 at the next check.
    let mut seen = 0;
    let status = s.stream(
        "/v1/completions",
        &json!({"prompt": "def f():", "max_tokens": 300, "temperature": 0, "stream": true}),
        |_| {
            seen += 1;
            seen < 3
        },
    );
    assert_eq!(status, 200);

    // Sessions: the second turn reuses the first turn's caches on both ranks, and answers as one rank does.
    let (b1, _) = web_turn(&s, &turn1, "conv");
    assert_eq!(b1, a1, "turn 1 over two ranks");
    let (b2, done) = web_turn(&s, &turn2(&b1), "conv");
    assert!(done["usage"]["cached_tokens"].as_u64().unwrap() > 0, "turn 2 reuses the session: {done}");
    assert_eq!(b2, a2, "turn 2 over two ranks");
    assert_eq!(complete(&s, "def main():", 24), want, "still in step");

    // Rank 0 going away ends rank 1 with an error, not a hang.
    drop(s);
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = rank1.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            rank1.kill().unwrap();
            panic!("rank 1 still running 30 s after rank 0 was killed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    rank1.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(!status.success(), "rank 1 must exit non-zero: {err}");
    assert!(err.contains("mlx-k3: error:"), "rank 1 said: {err}");
}

/// A copy of the `deepseek_v3/a_yarn_grouped` fixture with a word-level `tokenizer.json` (token `i` is the
/// word `w{i}`, no decoder: decoded tokens are concatenated), and (prompt text, mlx-lm's 32 greedy tokens as
/// text). Each token's text starts with `w`, so the text determines the tokens.
fn deepseek_v3_with_tokenizer(dir: &Path) -> (PathBuf, String, String) {
    let src = fixture_dir("deepseek_v3/a_yarn_grouped");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "model.safetensors", "model.safetensors.index.json"] {
        std::fs::copy(src.join(f), model.join(f)).unwrap();
    }
    let vocab: serde_json::Map<String, Value> = (0..128).map(|i| (format!("w{i}"), json!(i))).collect();
    let tok = json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
                     "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
                     "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}});
    std::fs::write(model.join("tokenizer.json"), tok.to_string()).unwrap();
    let f = fixture("deepseek_v3/a_yarn_grouped");
    let prompt: Vec<String> = f.prompt.iter().map(|t| format!("w{t}")).collect();
    let want: String = f.generated.iter().map(|t| format!("w{t}")).collect();
    (model, prompt.join(" "), want)
}

#[test]
fn deepseek_v3_generate_and_serve_give_mlx_lm_tokens() {
    // `generate` on one rank and on two (expert + tensor parallel), and the server's completion, continue
    // the fixture's prompt with mlx-lm's generate_step tokens (greedy, 32).
    let dir = scratch("ds3-generate");
    let (model, prompt, want) = deepseek_v3_with_tokenizer(&dir);
    let args = strings(&["generate", "--model", &model.display().to_string(), "--prompt", &prompt, "--raw"]);
    let args = [args, strings(&["--max-tokens", "32", "--dtype", "float32"])].concat();
    let one = Command::new(bin()).args(&args).output().unwrap();
    assert!(one.status.success(), "{}", String::from_utf8_lossy(&one.stderr));
    let out = String::from_utf8_lossy(&one.stdout).into_owned();
    assert!(out.contains(&format!("{prompt}{want}")), "one rank printed {out:?}, mlx-lm's continuation {want:?}");

    let two_args = [args.clone(), strings(&["--distributed", "ring", "--tp"])].concat();
    let outs = wait_all(spawn_ranks(&dir, 2, &two_args), Duration::from_secs(120));
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}: {}", String::from_utf8_lossy(&o.stderr));
    }
    assert_eq!(String::from_utf8_lossy(&outs[0].stdout), out, "two ranks print what one rank prints");

    let s = Server::start_with(&model, &[]);
    assert_eq!(complete(&s, &prompt, 32), want, "the server's completion");
}

#[test]
fn an_image_prompt_over_two_ranks_prints_what_one_rank_prints() {
    // The end-to-end vision fixture (tests/vision_chat.rs checks one rank against mlx-vlm): rank 0 runs the
    // vision tower and broadcasts the features; both ranks generate from them.
    let dir = scratch("image");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures");
    let model = root.join("vision_chat").display().to_string();
    let png = root.join("vision_preprocess/rgb.png").display().to_string();
    let args = strings(&[
        "generate",
        "--model",
        &model,
        "--image",
        &png,
        "--prompt",
        "What is in the picture?",
        "--max-tokens",
        "8",
    ]);
    let one = Command::new(bin()).args(&args).output().unwrap();
    assert!(one.status.success(), "{}", String::from_utf8_lossy(&one.stderr));
    let want = String::from_utf8_lossy(&one.stdout).into_owned();
    assert!(want.trim_end_matches('\n').len() >= 4, "one rank printed {want:?}");
    for tp in [false, true] {
        let mut args = args.clone();
        args.extend(strings(&["--distributed", "ring"]));
        if tp {
            args.push("--tp".into());
        }
        let outs = wait_all(spawn_ranks(&dir, 2, &args), Duration::from_secs(180));
        for (r, o) in outs.iter().enumerate() {
            assert!(o.status.success(), "tp {tp}: rank {r}: {}", String::from_utf8_lossy(&o.stderr));
        }
        assert_eq!(String::from_utf8_lossy(&outs[0].stdout), want, "tp {tp}: rank 0 vs one rank");
    }
}

/// The "speculative: ..." statistics line of a `generate` run's stderr.
fn spec_line(stderr: &str) -> String {
    stderr.lines().find(|l| l.starts_with("speculative: ")).unwrap_or_else(|| panic!("no statistics: {stderr}")).into()
}

#[test]
fn speculative_generate_over_two_ranks_prints_what_one_rank_prints() {
    // Rank 0 drafts (k3-nano's block drafter on the split model's hidden states, or k3-nano itself as a
    // separate draft model) and sends the drafts; both ranks verify them in the one split forward. Greedy:
    // the text of plain decoding on one rank, and the cycle statistics of drafting on one rank (the same
    // cycles, kept drafts, plain steps and fallbacks). Sampled (block drafter): what one rank prints with the
    // same seed. Expert parallel and expert + tensor parallel. The block drafter without the gate drafts 7
    // tokens every cycle and has most of them rejected (rollbacks on both ranks); with the gate it falls
    // back on this prompt after its probe (plain stretches between exchanges); k3-nano drafting for itself
    // has every draft kept.
    let dir = scratch("speculative");
    let drafter = nano().join("drafter").display().to_string();
    let draft_model = nano().display().to_string();
    let greedy = ["--max-tokens", "48", "--temp", "0"];
    let one_plain = Command::new(bin()).args(generate_args(&greedy)).output().unwrap();
    assert!(one_plain.status.success(), "{}", String::from_utf8_lossy(&one_plain.stderr));
    let plain = String::from_utf8_lossy(&one_plain.stdout).into_owned();
    let sampled = ["--max-tokens", "48", "--temp", "0.8", "--seed", "5"];
    for (draft, opts, no_gate) in [
        (&drafter, &greedy[..], true),
        (&drafter, &greedy[..], false),
        (&draft_model, &greedy[..], false),
        (&drafter, &sampled[..], true),
    ] {
        let mut args = generate_args(&[opts, &["--draft-model", draft.as_str()][..]].concat());
        if no_gate {
            args.push("--no-gate".into());
        } else {
            // Decisions by tokens, which do not depend on timing, so one rank's statistics are the two ranks'.
            args.extend(strings(&["--gate-cost", "tokens"]));
        }
        let one = Command::new(bin()).args(&args).output().unwrap();
        let one_err = String::from_utf8_lossy(&one.stderr).into_owned();
        assert!(one.status.success(), "{one_err}");
        let want = String::from_utf8_lossy(&one.stdout).into_owned();
        if opts == greedy {
            assert_eq!(want, plain, "{draft}: one rank drafting vs plain");
        }
        let stats = spec_line(&one_err);
        for tp in [false, true] {
            let mut args = args.clone();
            args.extend(strings(&["--distributed", "ring"]));
            if tp {
                args.push("--tp".into());
            }
            let outs = wait_all(spawn_ranks(&dir, 2, &args), Duration::from_secs(180));
            let errs: Vec<String> = outs.iter().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).collect();
            for (r, o) in outs.iter().enumerate() {
                assert!(o.status.success(), "{draft} {opts:?} tp {tp}: rank {r}: {}", errs[r]);
            }
            assert_eq!(String::from_utf8_lossy(&outs[0].stdout), want, "{draft} {opts:?} tp {tp}: rank 0 vs one rank");
            assert!(outs[1].stdout.is_empty(), "rank 1 prints nothing");
            if opts == greedy {
                assert_eq!(spec_line(&errs[0]), stats, "{draft} tp {tp}: cycle statistics");
            }
            println!("{draft} {opts:?} no-gate {no_gate} tp {tp}: {}", spec_line(&errs[0]));
        }
    }
}

#[test]
fn speculative_ranks_that_sample_differently_stop_with_a_divergence_error() {
    // Rank 0 decides every drafting cycle, so drafted tokens agree whatever the ranks' seeds; but a gate that
    // falls back at once (--gate-cost tokens --gate-short 8: a probe of 3 drafts gives at most 4 tokens per
    // cycle) leaves the tokens to each rank's own sampler, and with different seeds they differ: the hash
    // every round's exchange compares must stop every rank with an error.
    let dir = scratch("spec-diverge");
    let drafter = nano().join("drafter").display().to_string();
    let outs = wait_all(
        spawn_ranks_with(&dir, 2, |r| {
            let seed = (r + 1).to_string();
            let mut a = generate_args(&["--max-tokens", "64", "--temp", "1.5", "--seed", &seed]);
            a.extend(strings(&[
                "--draft-model",
                &drafter,
                "--gate-cost",
                "tokens",
                "--gate-short",
                "8",
                "--distributed",
                "ring",
            ]));
            a
        }),
        Duration::from_secs(120),
    );
    for (r, o) in outs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "rank {r} must fail: {err}");
        assert!(err.contains("ranks diverged"), "rank {r} said: {err}");
    }
}
