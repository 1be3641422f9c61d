//! `convert --from-gguf` on a tiny `deepseek_v3` model that `scripts/make_gguf_fixtures.py` wrote as a
//! llama.cpp `deepseek2` GGUF with the `gguf` package (F32, F16, BF16, Q8_0 and Q4_0 tensors; MLA in the
//! attn_k_b / attn_v_b layout). The reference is mlx-lm 0.32.2's deepseek_v3 run on the tensors as gguf-py
//! dequantizes them.
//!
//! Tolerance: as the deepseek_v3 text fixtures (tests/deepseek_v3.rs), f32 logits within 1e-4 x max
//! |reference|: the imported weights hold exactly the reference's values (checked bit for bit below), so
//! both sides differ only in op order (mlx-lm dequantizes up front, we run MLX's quantized matmuls), about
//! 1e-6 relative; greedy tokens are identical (the script keeps every top-1 gap >= 2e-3).

use std::path::{Path, PathBuf};

use mlx_k3::codebook::{self, Codebook};
use mlx_k3::compress::gguf_import::{import_gguf, import_gguf_with, ImportOptions, ImportedTensor};
use mlx_k3::compress::gguf_tokenizer::tokenizer_files;
use mlx_k3::compress::recipe::Recipe;
use mlx_k3::compress::store::{sha256_hex, Resume};
use mlx_k3::gguf::GgufFile;
use mlx_k3::io::Safetensors;
use mlx_k3::model::{KimiK3, LoadOptions};
use mlx_k3::quant::{self, QuantSpec, Quantized};
use mlx_k3::tokenizer::Tokenizer;
use mlx_k3::{Array, Dtype};

fn fixtures_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf").join(name)
}

fn fixture() -> PathBuf {
    fixtures_dir("deepseek2_mixed")
}

/// Both MLA layouts: attn_k_b / attn_v_b (newer llama.cpp) and one attn_kv_b (older, here Q8_0).
const FIXTURES: [&str; 2] = ["deepseek2_mixed", "deepseek2_kv_b"];

fn ids(tokens: &[i32]) -> Array {
    Array::from_slice(tokens, &[1, tokens.len() as i32]).unwrap()
}

fn rel_err(got: &Array, want: &Array) -> f32 {
    let g = got.to_vec_f32().unwrap();
    let w = want.to_vec_f32().unwrap();
    assert_eq!(g.len(), w.len());
    let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    g.iter().zip(&w).fold(0.0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

fn argmax(v: &[f32]) -> i32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as i32
}

#[test]
fn an_imported_gguf_runs_like_mlx_lm_on_its_dequantized_tensors() {
    for name in FIXTURES {
        check_logits(&fixtures_dir(name));
    }
}

fn check_logits(fixture: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let report = import_gguf(&fixture.join("model.gguf"), &out, false).unwrap();
    assert_eq!(report.architecture, "deepseek2");
    assert_eq!(report.resume, Resume::Fresh);
    assert!(report.tensors.iter().all(|t| t.exact), "every type in this fixture is held exactly");
    for ty in ["F32", "F16", "BF16", "Q8_0", "Q4_0"] {
        assert!(report.tensors.iter().any(|t| t.ggml_type == ty), "the fixture has no {ty} tensor");
    }
    run_and_compare(&out, fixture);
}

/// The checkpoint in `out` against the fixture's expected logits and greedy tokens.
fn run_and_compare(out: &Path, fixture: &Path) {
    let fixture = || fixture.to_path_buf();
    let exp = Safetensors::load(fixture().join("expected.safetensors")).unwrap();
    let model = KimiK3::load(out, LoadOptions { dtype: Some(Dtype::F32), lazy: false, shard: None }).unwrap();
    let prompt = exp.get("prompt").unwrap().to_vec::<i32>().unwrap();
    let t = prompt.len() as i32;
    let logits = model.forward(&ids(&prompt), None).unwrap();
    let e = rel_err(&logits.reshape(&[t, -1]).unwrap(), &exp.get("prefill_logits").unwrap());
    println!("{}: prefill rel err {e:.2e}", fixture().display());
    assert!(e <= 1e-4, "prefill logits rel err {e}");

    let want = exp.get("decode_tokens").unwrap().to_vec::<i32>().unwrap();
    let mut cache = model.make_cache();
    let out_logits = model.forward(&ids(&prompt), Some(&mut cache)).unwrap();
    let last = out_logits.slice_axis(1, t - 1, t).unwrap().to_vec_f32().unwrap();
    let mut tok = argmax(&last);
    for (step, w) in want.iter().enumerate() {
        assert_eq!(tok, *w, "greedy token {step}");
        tok = argmax(&model.forward(&ids(&[tok]), Some(&mut cache)).unwrap().to_vec_f32().unwrap());
    }
}

#[test]
fn exact_types_reproduce_the_gguf_values_bit_for_bit() {
    for name in FIXTURES {
        check_values(&fixtures_dir(name));
    }
}

fn check_values(fixture: &Path) {
    let fixture = || fixture.to_path_buf();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let report = import_gguf(&fixture().join("model.gguf"), &out, false).unwrap();
    let exp = Safetensors::load(fixture().join("expected.safetensors")).unwrap();
    let mut weights = std::collections::BTreeMap::new();
    for f in std::fs::read_dir(&out).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            weights.extend(Safetensors::load(&p).unwrap().arrays().unwrap());
        }
    }
    let mut checked = 0;
    for r in &report.tensors {
        let want = exp.get(&format!(
            "w.{}",
            if r.stored.starts_with("affine") { format!("{}.weight", r.name) } else { r.name.clone() }
        ));
        let want = want.unwrap_or_else(|e| panic!("{}: {e}", r.name)).to_vec_f32().unwrap();
        let got = if let Some(bits) = r.stored.strip_prefix("affine").and_then(|s| s.split(' ').next()) {
            let q = Quantized {
                weight: weights[&format!("{}.weight", r.name)].clone(),
                scales: weights[&format!("{}.scales", r.name)].clone(),
                biases: Some(weights[&format!("{}.biases", r.name)].clone()),
            };
            let spec = QuantSpec::affine(32, bits.parse().unwrap());
            quant::dequantize(&q, spec, None, None).unwrap().to_vec_f32().unwrap()
        } else {
            weights[&r.name].astype(Dtype::F32).unwrap().to_vec_f32().unwrap()
        };
        assert_eq!(got.len(), want.len(), "{}", r.name);
        // Equal as IEEE values (so bit for bit except the sign of zero: ggml's `d * (q - 8)` with a negative
        // d gives -0 where MLX's `d * q - 8 d` gives +0; no product or sum can tell them apart). Not NaN-safe
        // on purpose: the fixture holds no NaN, and a NaN here would be a failure.
        let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 0, "{} ({} as {}): {differ} values differ from gguf-py's", r.name, r.ggml_type, r.stored);
        checked += 1;
    }
    assert_eq!(checked, report.tensors.len());
}

#[test]
fn a_rerun_resumes_and_a_changed_source_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let src = fixture().join("model.gguf");
    import_gguf(&src, &out, false).unwrap();
    let first = std::fs::read(out.join("model-00002-of-00003.safetensors")).unwrap();
    assert_eq!(import_gguf(&src, &out, false).unwrap().resume, Resume::Complete);
    // An interrupted run: no manifest yet, a journal listing units 0 and 1 as done (their size and hash),
    // unit 1's file damaged since, unit 2's never written. Only the intact unit 0 is kept; the rest are
    // written again, to the same bytes an uninterrupted run writes.
    let out2 = dir.path().join("ckpt2");
    std::fs::create_dir_all(&out2).unwrap();
    let mut units = serde_json::Map::new();
    for (unit, file) in ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"].iter().enumerate() {
        let bytes = std::fs::read(out.join(file)).unwrap();
        std::fs::write(out2.join(file), &bytes).unwrap();
        units.insert(
            unit.to_string(),
            serde_json::json!({"file": file, "bytes": bytes.len(), "sha256": sha256_hex(&bytes),
                               "tensors": [], "report": null}),
        );
    }
    let damaged = out2.join("model-00002-of-00003.safetensors");
    let mut bytes = std::fs::read(&damaged).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&damaged, bytes).unwrap();
    let journal = serde_json::json!({"fingerprint": fingerprint_of(&out), "units": units});
    std::fs::write(out2.join(".k3_journal.json"), journal.to_string()).unwrap();
    let r = import_gguf(&src, &out2, false).unwrap();
    assert_eq!(r.resume, Resume::Resumed(1));
    for f in [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "config.json",
        "k3_manifest.json",
    ] {
        assert_eq!(std::fs::read(out2.join(f)).unwrap(), std::fs::read(out.join(f)).unwrap(), "{f}");
    }
    assert!(!out2.join(".k3_journal.json").exists());
    assert_eq!(std::fs::read(out2.join("model-00002-of-00003.safetensors")).unwrap(), first);
    // Another GGUF into the same folder is refused.
    let mut bytes = std::fs::read(&src).unwrap();
    bytes.extend([0u8; 32]);
    let other = dir.path().join("other.gguf");
    std::fs::write(&other, bytes).unwrap();
    let e = import_gguf(&other, &out, false).unwrap_err().to_string();
    assert!(e.contains("another job"), "{e}");
}

fn fingerprint_of(out: &Path) -> String {
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("k3_manifest.json")).unwrap()).unwrap();
    m["fingerprint"].as_str().unwrap().to_string()
}

/// The fixture with one metadata string value replaced (same length) or its bytes cut.
fn patched(find: &[u8], replace: &[u8]) -> Vec<u8> {
    let mut b = std::fs::read(fixture().join("model.gguf")).unwrap();
    let at = b.windows(find.len()).position(|w| w == find).unwrap();
    b[at..at + find.len()].copy_from_slice(replace);
    b
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let run = |bytes: Vec<u8>, name: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        import_gguf(&p, &dir.path().join(format!("{name}.out")), false).unwrap_err().to_string()
    };
    // An architecture this importer does not know, named.
    let e = run(patched(b"deepseek2", b"deepseek9"), "arch.gguf");
    assert!(e.contains("'deepseek9'") && e.contains("not supported"), "{e}");
    // A tensor type that is neither exact nor re-quantized yet (Q4_0's id 2 patched to Q4_1's 3 in the
    // directory entry of token_embd.weight... the first Q4_0 tensor, attn_q_a): named with its type.
    let mut b = std::fs::read(fixture().join("model.gguf")).unwrap();
    let name = b"blk.0.attn_q_a.weight";
    let at = b.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let ty_at = at + 4 + 2 * 8; // u32 n_dims (2), two u64 dims, then the u32 type
    assert_eq!(u32::from_le_bytes(b[ty_at..ty_at + 4].try_into().unwrap()), 2);
    b[ty_at..ty_at + 4].copy_from_slice(&3u32.to_le_bytes());
    let e = run(b, "type.gguf");
    assert!(e.contains("blk.0.attn_q_a.weight") && e.contains("Q4_1"), "{e}");
    // Truncated: the tensor data cut short names the file and a tensor.
    let b = std::fs::read(fixture().join("model.gguf")).unwrap();
    let e = run(b[..b.len() - 100].to_vec(), "cut.gguf");
    assert!(e.contains("cut.gguf") && e.contains("truncated"), "{e}");
    // Cut inside the header.
    let e = run(b[..200].to_vec(), "head.gguf");
    assert!(e.contains("head.gguf") && e.contains("truncated"), "{e}");
}

// --- deepseek2_kquants: IQ1_S, Q4_K, Q5_K (exact) and Q6_K, Q3_K, Q2_K (re-quantized) at hidden size 256. The
// fixture keeps gguf-py's dequantized tensors as SHA-256 digests (manifest.json), to stay small.

fn kquants() -> PathBuf {
    fixtures_dir("deepseek2_kquants")
}

/// gguf-py's dequantized values of every tensor of the kquants fixture, as digests by mlx-lm name.
fn kquant_digests() -> serde_json::Map<String, serde_json::Value> {
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(fixtures_dir("manifest.json")).unwrap()).unwrap();
    let f = m["fixtures"].as_array().unwrap().iter().find(|f| f["name"] == "deepseek2_kquants").unwrap();
    f["dequantized_sha256"].as_object().unwrap().clone()
}

/// The digest the fixture script takes: little-endian f32 bytes, -0 written as +0.
fn digest(v: &[f32]) -> String {
    sha256_hex(&v.iter().flat_map(|x| (x + 0.0).to_le_bytes()).collect::<Vec<u8>>())
}

/// Every tensor of a checkpoint folder.
fn load_all(out: &Path) -> std::collections::BTreeMap<String, Array> {
    let mut weights = std::collections::BTreeMap::new();
    for f in std::fs::read_dir(out).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            weights.extend(Safetensors::load(&p).unwrap().arrays().unwrap());
        }
    }
    weights
}

/// The values the checkpoint in `out` holds for report row `r`, decoded with MLX (affine dequantize, or the
/// codebook's plain-ops reference), as its config.json declares the module.
fn decoded(out: &Path, weights: &std::collections::BTreeMap<String, Array>, r: &ImportedTensor) -> Vec<f32> {
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    let entry = &config["quantization"][&r.name];
    if entry["mode"] == "k3_codebook" {
        let cb = Codebook {
            codes: weights[&format!("{}.codes", r.name)].clone(),
            qh: weights[&format!("{}.qh", r.name)].clone(),
            scales: weights[&format!("{}.scales", r.name)].clone(),
        };
        return codebook::dequantize_reference(&cb).unwrap().to_vec_f32().unwrap();
    }
    if entry["mode"] == "affine" {
        let q = Quantized {
            weight: weights[&format!("{}.weight", r.name)].clone(),
            // In f32: MLX decodes in the scales' dtype, and bf16 scales would round every value to bf16; the
            // stored values are `scale * q + bias` with the stored scale and bias, as convert measures them.
            scales: weights[&format!("{}.scales", r.name)].astype(Dtype::F32).unwrap(),
            biases: Some(weights[&format!("{}.biases", r.name)].astype(Dtype::F32).unwrap()),
        };
        let spec =
            QuantSpec::affine(entry["group_size"].as_i64().unwrap() as i32, entry["bits"].as_i64().unwrap() as i32);
        return quant::dequantize(&q, spec, None, Some(Dtype::F32)).unwrap().to_vec_f32().unwrap();
    }
    assert!(entry.is_null(), "{}: {entry}", r.name);
    weights[&r.name].astype(Dtype::F32).unwrap().to_vec_f32().unwrap()
}

/// The mlx-lm tensor name of a report row (quantized rows are named without `.weight`).
fn weight_name(r: &ImportedTensor, digests: &serde_json::Map<String, serde_json::Value>) -> String {
    if digests.contains_key(&r.name) {
        r.name.clone()
    } else {
        format!("{}.weight", r.name)
    }
}

#[test]
fn iq1s_and_k_quants_import_bit_for_bit_and_the_rest_is_requantized_and_measured() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let report = import_gguf(&kquants().join("model.gguf"), &out, false).unwrap();
    let digests = kquant_digests();
    let weights = load_all(&out);
    let row = |gguf: &str| report.tensors.iter().find(|t| t.gguf_name == gguf).unwrap().clone();
    // What each type became.
    for (gguf, ty, stored) in [
        ("blk.1.ffn_gate_exps.weight", "IQ1_S", "codebook"),
        ("blk.1.ffn_up_exps.weight", "IQ1_S", "codebook"),
        ("blk.0.attn_q_a.weight", "Q4_K", "affine4 g32"),
        ("blk.0.ffn_up.weight", "Q5_K", "affine5 g32"),
        ("output.weight", "Q5_K", "affine5 g32"),
        ("token_embd.weight", "Q6_K", "affine8/g32 (re-quantized)"),
        ("blk.0.attn_kv_a_mqa.weight", "Q2_K", "affine8/g32 (re-quantized)"),
        ("blk.1.attn_q_a.weight", "Q3_K", "affine8/g32 (re-quantized)"),
    ] {
        let r = row(gguf);
        assert_eq!((r.ggml_type.as_str(), r.stored.as_str()), (ty, stored), "{gguf}");
    }
    let mut exact = 0;
    for r in &report.tensors {
        let got = decoded(&out, &weights, r);
        let want = digests[&weight_name(r, &digests)].as_str().unwrap();
        let same = digest(&got) == want;
        // Exact types: the stored tensor decodes to gguf-py's values, bit for bit (the digests match). The
        // re-quantized ones differ (and say so).
        assert_eq!(same, r.exact, "{} ({} as {})", r.gguf_name, r.ggml_type, r.stored);
        assert_eq!(r.exact, !r.stored.ends_with("(re-quantized)"), "{}", r.gguf_name);
        exact += r.exact as usize;
    }
    assert_eq!(exact, report.tensors.len() - 4, "all but the two Q6_K, the Q3_K and the Q2_K tensors are exact");

    // The reported error of the re-quantized tensors, against values decoded from an import that keeps them
    // float32 (exact: checked against gguf-py's digests here too).
    let recipe = recipe_of(
        r#"{"dtype": "float32", "classes": {"embeddings": {"format": "float"},
        "mla": {"format": "float"}, "shared_experts": {"format": "float"}}}"#,
    );
    let out_f = dir.path().join("float");
    let rf = import_gguf_with(
        &kquants().join("model.gguf"),
        &out_f,
        ImportOptions { recipe: Some(&recipe), overwrite: false },
    )
    .unwrap();
    let weights_f = load_all(&out_f);
    for r in report.tensors.iter().filter(|r| !r.exact) {
        let rf_row = rf.tensors.iter().find(|t| t.gguf_name == r.gguf_name).unwrap();
        assert!(rf_row.exact && rf_row.stored == "float (re-quantized)", "{rf_row:?}");
        let want = decoded(&out_f, &weights_f, rf_row);
        assert_eq!(digest(&want), digests[&weight_name(r, &digests)].as_str().unwrap(), "{}", r.gguf_name);
        let got = decoded(&out, &weights, r);
        let sse: f64 = want.iter().zip(&got).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
        let sig: f64 = want.iter().map(|a| (*a as f64).powi(2)).sum();
        let rel = (sse / sig).sqrt();
        // The report's figure is this one (same sums, f64); the MLX decode and the encoder's own may differ
        // by f32 rounding, far below 1e-6 relative.
        assert!(
            (rel - r.rel_rms).abs() <= 1e-6 * rel.max(1e-3),
            "{}: measured {rel}, reported {}",
            r.gguf_name,
            r.rel_rms
        );
        // 8-bit affine in groups of 32: a step of range / 255, so an RMS error near range / 880 per group,
        // well under 1 % of these weights' RMS; a wrong decode would be of order 1.
        assert!(rel > 0.0 && rel < 1e-2, "{}: rel RMS {rel}", r.gguf_name);
    }
    // The per-class table: counts, exactness and the class error.
    let emb = &report.classes["embeddings"];
    assert_eq!(
        (emb["count"].as_u64(), emb["exact"].as_u64(), emb["requantized"].as_u64()),
        (Some(1), Some(0), Some(1))
    );
    assert_eq!(emb["source_types"], serde_json::json!(["Q6_K"]));
    let e = emb["rel_rms"].as_f64().unwrap();
    assert!((e - row("token_embd.weight").rel_rms).abs() < 1e-12, "{e}");
    assert!(report.classes["routed_experts"]["rel_rms"].is_null());
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join(mlx_k3::compress::gguf_import::REPORT_FILE)).unwrap()).unwrap();
    assert_eq!(written["classes"], report.classes);
}

fn recipe_of(json: &str) -> Recipe {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("r.json");
    std::fs::write(&p, json).unwrap();
    Recipe::load(&p).unwrap()
}

#[test]
fn the_kquants_model_runs_like_mlx_lm_on_its_dequantized_tensors() {
    // Re-quantized classes kept as float32 by the recipe, so every tensor holds gguf-py's values exactly and
    // the text fixtures' tolerance applies (see the top of this file).
    let recipe = recipe_of(
        r#"{"dtype": "float32", "classes": {"embeddings": {"format": "float"},
        "mla": {"format": "float"}, "shared_experts": {"format": "float"}}}"#,
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let r = import_gguf_with(
        &kquants().join("model.gguf"),
        &out,
        ImportOptions { recipe: Some(&recipe), overwrite: false },
    )
    .unwrap();
    assert!(r.tensors.iter().all(|t| t.exact), "{:?}", r.tensors.iter().filter(|t| !t.exact).collect::<Vec<_>>());
    for ty in ["IQ1_S", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"] {
        assert!(r.tensors.iter().any(|t| t.ggml_type == ty), "the fixture has no {ty} tensor");
    }
    run_and_compare(&out, &kquants());
    // The recipe is part of the job: rerun with it, the folder is complete; without it, another job.
    let again = import_gguf_with(
        &kquants().join("model.gguf"),
        &out,
        ImportOptions { recipe: Some(&recipe), overwrite: false },
    );
    assert_eq!(again.unwrap().resume, Resume::Complete);
    let e = import_gguf(&kquants().join("model.gguf"), &out, false).unwrap_err().to_string();
    assert!(e.contains("another job"), "{e}");
}

// --- Split GGUF: deepseek2_mixed as three shards (model-0000N-of-00003.gguf).

fn shard(i: usize) -> PathBuf {
    fixtures_dir("deepseek2_split").join(format!("model-{i:05}-of-00003.gguf"))
}

#[test]
fn a_split_gguf_imports_like_the_single_file() {
    let dir = tempfile::tempdir().unwrap();
    let (one, split) = (dir.path().join("one"), dir.path().join("split"));
    let a = import_gguf(&fixture().join("model.gguf"), &one, false).unwrap();
    let b = import_gguf(&shard(1), &split, false).unwrap();
    assert_eq!(a.tensors, b.tensors);
    let files = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".safetensors") || n == "config.json")
            .collect();
        v.sort();
        v
    };
    assert_eq!(files(&one), files(&split));
    assert!(files(&one).len() == 4, "{:?}", files(&one));
    for f in files(&one) {
        assert_eq!(std::fs::read(one.join(&f)).unwrap(), std::fs::read(split.join(&f)).unwrap(), "{f}");
    }
}

#[test]
fn split_gguf_errors_name_the_shard() {
    let dir = tempfile::tempdir().unwrap();
    let copy = |name: &str, shards: &[usize]| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        for &i in shards {
            std::fs::copy(shard(i), d.join(format!("model-{i:05}-of-00003.gguf"))).unwrap();
        }
        d
    };
    let import = |d: &Path, i: usize| {
        import_gguf(&d.join(format!("model-{i:05}-of-00003.gguf")), &d.join("out"), false).unwrap_err().to_string()
    };
    // A later shard given instead of the first.
    let e = import(&copy("all", &[1, 2, 3]), 2);
    assert!(e.contains("give the first shard") && e.contains("model-00002-of-00003.gguf"), "{e}");
    // A missing shard, named.
    let e = import(&copy("gap", &[1, 3]), 1);
    assert!(e.contains("model-00002-of-00003.gguf") && e.contains("missing"), "{e}");
    // A truncated shard: its tensor data cut short.
    let d = copy("cut", &[1, 2, 3]);
    let p = d.join("model-00003-of-00003.gguf");
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() - 64]).unwrap();
    let e = import(&d, 1);
    assert!(e.contains("model-00003-of-00003.gguf") && e.contains("truncated"), "{e}");
    // Inconsistent split metadata: shard 3 says it is split.no 1 (u16 value after the key and its type).
    let d = copy("bad", &[1, 2, 3]);
    let p = d.join("model-00003-of-00003.gguf");
    let mut b = std::fs::read(&p).unwrap();
    let key = b"split.no";
    let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4;
    assert_eq!(u16::from_le_bytes([b[at], b[at + 1]]), 2);
    b[at..at + 2].copy_from_slice(&1u16.to_le_bytes());
    std::fs::write(&p, b).unwrap();
    let e = import(&d, 1);
    assert!(e.contains("model-00003-of-00003.gguf") && e.contains("inconsistent split metadata"), "{e}");
}

// --- The embedded tokenizer: k3-nano's written into a GGUF as llama.cpp writes Kimi K2's (tokenizer_kimi.gguf),
// against Python tiktoken's ids for the original tokenizer (tests/fixtures/tokenizer/k3_nano*_ids.json).

fn tokenizer_cases() -> Vec<serde_json::Value> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    let mut cases = Vec::new();
    for f in ["k3_nano_ids.json", "k3_nano_long_ids.json"] {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join(f)).unwrap()).unwrap();
        cases.extend(v["cases"].as_array().unwrap().iter().cloned());
    }
    cases
}

#[test]
fn the_gguf_tokenizer_encodes_like_the_original() {
    let src = fixtures_dir("tokenizer_kimi.gguf");
    let g = GgufFile::open(&src).unwrap();
    let files = tokenizer_files(&g, &src).unwrap().expect("the fixture embeds a tokenizer");
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in &files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    let (tok, cfg) = Tokenizer::load(dir.path()).unwrap();
    let cases = tokenizer_cases();
    assert!(cases.len() > 20, "{}", cases.len());
    for c in &cases {
        let text = c["text"].as_str().unwrap();
        let ids: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        let ordinary: Vec<u32> =
            c.get("ordinary_ids").map_or(ids.clone(), |o| serde_json::from_value(o.clone()).unwrap());
        assert_eq!(tok.encode(text, true).unwrap(), ids, "{text:?}");
        assert_eq!(tok.encode(text, false).unwrap(), ordinary, "{text:?} (special tokens as text)");
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
    assert_eq!(
        (cfg.bos_token.as_deref(), cfg.eos_token.as_deref(), cfg.add_bos_token),
        (Some("[BOS]"), Some("[EOS]"), true)
    );
    assert_eq!(cfg.eos_token_ids, vec![2047]);
    assert!(cfg.chat_template.unwrap().contains("<|im_user|>"));

    // An unknown pre-tokenizer name is refused, named (its regex is not in the file).
    let mut b = std::fs::read(&src).unwrap();
    let at = b.windows(7).position(|w| w == b"kimi-k2").unwrap();
    b[at..at + 7].copy_from_slice(b"kimi-k9");
    let p = dir.path().join("pre.gguf");
    std::fs::write(&p, b).unwrap();
    let e = tokenizer_files(&GgufFile::open(&p).unwrap(), &p).unwrap_err().to_string();
    assert!(e.contains("'kimi-k9'") && e.contains("pre.gguf"), "{e}");
}
