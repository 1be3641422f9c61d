//! `convert --from-gguf`: a llama.cpp GGUF model (architecture `deepseek2`: DeepSeek-V3/R1, Kimi K2) into
//! a checkpoint this engine (and mlx-lm) loads, through the same resumable, per-unit output folder as
//! `convert` ([`super::store::Output`]: one unit per transformer block plus one for the embedding, final
//! norm and head).
//!
//! Names and config come from llama.cpp's `deepseek2` tensor table and metadata keys (`blk.N.attn_q_a`,
//! `ffn_gate_exps`, `exp_probs_b`, `deepseek2.attention.kv_lora_rank`, ...), mapped onto mlx-lm's
//! `deepseek_v3` names and `ModelArgs`. Both MLA layouts load: `attn_kv_b` (older files: written as
//! `kv_b_proj`, which the loader splits) and `attn_k_b` / `attn_v_b` (newer: they are mlx-lm's `embed_q` /
//! `unembed_out`).
//!
//! Tensor values are kept exactly: F32, F16 and BF16 as they are; Q8_0 and Q4_0 as MLX affine 8 / 4-bit
//! with group 32 and f32 scales and biases (`scale = d`, `bias = -128 d` or `-8 d`, codes shifted to
//! unsigned): MLX's `scale * q + bias` in f32 then gives `d * (q - 128)` exactly (`d` has 11 significant
//! bits, `q` at most 8, so every product and the difference are representable; the one bit that can differ is
//! the sign of a zero, `-0` from ggml where MLX gives `+0`, equal values). Where the model keeps a
//! float (router, MLA's per-head matrices) a quantized tensor is dequantized, again exactly. Any other
//! GGML type is an error naming the tensor and the type.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value};

use super::store::{fingerprint, HostTensor, Output, Resume};
use crate::gguf::{
    ggml_type_name, GgufFile, TensorInfo, GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0,
};
use crate::{Dtype, Error, Result};

/// How one GGUF tensor was written.
#[derive(Clone, Debug, PartialEq)]
pub struct ImportedTensor {
    /// llama.cpp's name.
    pub gguf_name: String,
    /// The checkpoint's name (without `.weight` for quantized ones).
    pub name: String,
    /// The GGML type in the GGUF.
    pub ggml_type: String,
    /// What was written: `F32`, `F16`, `BF16`, `affine8 g32`, `affine4 g32`, or `F32 (dequantized)`.
    pub stored: String,
    /// Whether the stored tensor reproduces the GGUF's dequantized values bit for bit.
    pub exact: bool,
}

/// The result of an import.
#[derive(Clone, Debug)]
pub struct GgufImportReport {
    /// The GGUF's `general.architecture`.
    pub architecture: String,
    /// The checkpoint's config.json.
    pub config: Value,
    /// Every tensor, in GGUF name order.
    pub tensors: Vec<ImportedTensor>,
    /// How the output folder was found.
    pub resume: Resume,
}

fn fmt_err(path: &Path, message: impl Into<String>) -> Error {
    Error::Format { path: path.to_path_buf(), message: message.into() }
}

/// A metadata value of the GGUF, parsed.
fn meta<T: std::str::FromStr>(g: &GgufFile, path: &Path, key: &str) -> Result<Option<T>> {
    match g.metadata.get(key) {
        None => Ok(None),
        Some(v) => {
            v.parse().map(Some).map_err(|_| fmt_err(path, format!("metadata '{key}': '{v}' is not a valid value")))
        }
    }
}

fn need<T: std::str::FromStr>(g: &GgufFile, path: &Path, key: &str) -> Result<T> {
    meta(g, path, key)?.ok_or_else(|| fmt_err(path, format!("metadata '{key}' is missing")))
}

/// The `deepseek_v3` config.json (mlx-lm `ModelArgs` names) of a `deepseek2` GGUF.
pub fn deepseek2_config(g: &GgufFile, path: &Path) -> Result<Value> {
    let a = "deepseek2";
    let k = |s: &str| format!("{a}.{s}");
    let rope: usize = need(g, path, &k("rope.dimension_count"))?;
    let kv_lora: usize = need(g, path, &k("attention.kv_lora_rank"))?;
    // Newer files (attn_k_b/attn_v_b) write the MQA view in key_length/value_length and the per-head sizes
    // in *_mla; older ones the per-head sizes in key_length/value_length.
    let key_len: usize = match meta(g, path, &k("attention.key_length_mla"))? {
        Some(v) => v,
        None => need(g, path, &k("attention.key_length"))?,
    };
    let v_head: usize = match meta(g, path, &k("attention.value_length_mla"))? {
        Some(v) => v,
        None => need(g, path, &k("attention.value_length"))?,
    };
    let nope = key_len
        .checked_sub(rope)
        .ok_or_else(|| fmt_err(path, format!("attention key length {key_len} is below the rope dimension {rope}")))?;
    let heads: usize = need(g, path, &k("attention.head_count"))?;
    let gating: u32 = meta(g, path, &k("expert_gating_func"))?.unwrap_or(1);
    let scoring = match gating {
        1 => "softmax",
        2 => "sigmoid",
        other => return Err(fmt_err(path, format!("{a}.expert_gating_func {other} is not supported (1 or 2)"))),
    };
    let vocab: usize = match meta(g, path, &k("vocab_size"))? {
        Some(v) => v,
        None => g
            .tensors
            .get("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .ok_or_else(|| fmt_err(path, "no vocab_size and no token_embd.weight"))? as usize,
    };
    let q_lora: Option<usize> = meta(g, path, &k("attention.q_lora_rank"))?.filter(|&r: &usize| r > 0);
    let mut c = json!({
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": need::<usize>(g, path, &k("embedding_length"))?,
        "intermediate_size": need::<usize>(g, path, &k("feed_forward_length"))?,
        "moe_intermediate_size": need::<usize>(g, path, &k("expert_feed_forward_length"))?,
        "num_hidden_layers": need::<usize>(g, path, &k("block_count"))?,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_shared_experts": meta::<usize>(g, path, &k("expert_shared_count"))?.unwrap_or(0),
        "n_routed_experts": need::<usize>(g, path, &k("expert_count"))?,
        "num_experts_per_tok": need::<usize>(g, path, &k("expert_used_count"))?,
        "routed_scaling_factor": meta::<f64>(g, path, &k("expert_weights_scale"))?.unwrap_or(1.0),
        "kv_lora_rank": kv_lora,
        "q_lora_rank": q_lora,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": nope,
        "v_head_dim": v_head,
        "topk_method": "noaux_tc",
        "scoring_func": scoring,
        "norm_topk_prob": meta::<bool>(g, path, &k("expert_weights_norm"))?.unwrap_or(false),
        "n_group": meta::<usize>(g, path, &k("expert_group_count"))?.unwrap_or(1),
        "topk_group": meta::<usize>(g, path, &k("expert_group_used_count"))?.unwrap_or(1),
        "moe_layer_freq": 1,
        "first_k_dense_replace": meta::<usize>(g, path, &k("leading_dense_block_count"))?.unwrap_or(0),
        "max_position_embeddings": meta::<usize>(g, path, &k("context_length"))?.unwrap_or(4096),
        "rms_norm_eps": need::<f64>(g, path, &k("attention.layer_norm_rms_epsilon"))?,
        "rope_theta": meta::<f64>(g, path, &k("rope.freq_base"))?.unwrap_or(10_000.0),
        "attention_bias": false,
        "tie_word_embeddings": false,
    });
    let scaling: Option<String> = meta(g, path, &k("rope.scaling.type"))?;
    match scaling.as_deref() {
        None | Some("none") => {}
        Some("yarn") => {
            // GGUF keeps YaRN's mscale_all_dim as yarn_log_multiplier = 0.1 * mscale_all_dim, and no separate
            // mscale: llama.cpp uses the one value for both (as DeepSeek-V3's and Kimi K2's configs do).
            let m = meta::<f64>(g, path, &k("rope.scaling.yarn_log_multiplier"))?.unwrap_or(0.0) / 0.1;
            c["rope_scaling"] = json!({
                "type": "yarn",
                "factor": need::<f64>(g, path, &k("rope.scaling.factor"))?,
                "original_max_position_embeddings":
                    need::<usize>(g, path, &k("rope.scaling.original_context_length"))?,
                "beta_fast": meta::<f64>(g, path, &k("rope.scaling.yarn_beta_fast"))?.unwrap_or(32.0),
                "beta_slow": meta::<f64>(g, path, &k("rope.scaling.yarn_beta_slow"))?.unwrap_or(1.0),
                "mscale": m,
                "mscale_all_dim": m,
            });
        }
        Some("linear") => {
            c["rope_scaling"] = json!({"type": "linear", "factor": need::<f64>(g, path, &k("rope.scaling.factor"))?});
        }
        Some(other) => return Err(fmt_err(path, format!("{a}.rope.scaling.type '{other}' is not supported"))),
    }
    Ok(c)
}

/// What a llama.cpp `deepseek2` tensor becomes: the mlx-lm name, and whether the model needs it as a float.
fn map_name(gguf: &str) -> Option<(String, bool)> {
    let top = match gguf {
        "token_embd.weight" => Some(("model.embed_tokens.weight", false)),
        "output_norm.weight" => Some(("model.norm.weight", true)),
        "output.weight" => Some(("lm_head.weight", false)),
        _ => None,
    };
    if let Some((n, f)) = top {
        return Some((n.to_string(), f));
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, leaf) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (name, float) = match leaf {
        "attn_norm.weight" => ("input_layernorm.weight", true),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", true),
        "attn_q.weight" => ("self_attn.q_proj.weight", false),
        "attn_q_a.weight" => ("self_attn.q_a_proj.weight", false),
        "attn_q_a_norm.weight" => ("self_attn.q_a_layernorm.weight", true),
        "attn_q_b.weight" => ("self_attn.q_b_proj.weight", false),
        "attn_kv_a_mqa.weight" => ("self_attn.kv_a_proj_with_mqa.weight", false),
        "attn_kv_a_norm.weight" => ("self_attn.kv_a_layernorm.weight", true),
        "attn_kv_b.weight" => ("self_attn.kv_b_proj.weight", true),
        "attn_k_b.weight" => ("self_attn.embed_q.weight", true),
        "attn_v_b.weight" => ("self_attn.unembed_out.weight", true),
        "attn_output.weight" => ("self_attn.o_proj.weight", false),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", false),
        "ffn_up.weight" => ("mlp.up_proj.weight", false),
        "ffn_down.weight" => ("mlp.down_proj.weight", false),
        "ffn_gate_inp.weight" => ("mlp.gate.weight", true),
        "exp_probs_b.bias" => ("mlp.gate.e_score_correction_bias", true),
        "ffn_gate_exps.weight" => ("mlp.switch_mlp.gate_proj.weight", false),
        "ffn_up_exps.weight" => ("mlp.switch_mlp.up_proj.weight", false),
        "ffn_down_exps.weight" => ("mlp.switch_mlp.down_proj.weight", false),
        "ffn_gate_shexp.weight" => ("mlp.shared_experts.gate_proj.weight", false),
        "ffn_up_shexp.weight" => ("mlp.shared_experts.up_proj.weight", false),
        "ffn_down_shexp.weight" => ("mlp.shared_experts.down_proj.weight", false),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{name}"), float))
}

fn f16_to_f32(b: [u8; 2]) -> f32 {
    half::f16::from_le_bytes(b).to_f32()
}

/// Q8_0 / Q4_0 blocks as MLX affine (packed u32 codes, f32 scales, f32 biases), exactly.
fn affine_from_blocks(raw: &[u8], ty: u32, n: usize) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let (bytes, bits) = if ty == GGML_TYPE_Q8_0 { (34, 8) } else { (18, 4) };
    let groups = n / 32;
    let mut codes = Vec::with_capacity(n * bits / 8);
    let (mut scales, mut biases) = (Vec::with_capacity(groups), Vec::with_capacity(groups));
    for blk in raw.chunks_exact(bytes) {
        let d = f16_to_f32([blk[0], blk[1]]);
        let q = &blk[2..];
        if bits == 8 {
            codes.extend(q.iter().map(|&v| (v as i8 as i16 + 128) as u8));
            biases.push(-128.0 * d);
        } else {
            // ggml: element j < 16 in the low nibble of byte j, element j + 16 in its high nibble. MLX packs
            // element i at bits 4 (i % 8) of word i / 8, so byte b holds elements 2b (low) and 2b + 1.
            let nib = |i: usize| if i < 16 { q[i] & 15 } else { q[i - 16] >> 4 };
            codes.extend((0..16).map(|b| nib(2 * b) | (nib(2 * b + 1) << 4)));
            biases.push(-8.0 * d);
        }
        scales.push(d);
    }
    (codes, scales, biases)
}

/// Dequantized values of Q8_0 / Q4_0 blocks, as ggml computes them (`d * q` in f32).
fn dequant_blocks(raw: &[u8], ty: u32) -> Vec<f32> {
    let bytes = if ty == GGML_TYPE_Q8_0 { 34 } else { 18 };
    let mut out = Vec::new();
    for blk in raw.chunks_exact(bytes) {
        let d = f16_to_f32([blk[0], blk[1]]);
        let q = &blk[2..];
        if ty == GGML_TYPE_Q8_0 {
            out.extend(q.iter().map(|&v| d * (v as i8) as f32));
        } else {
            out.extend((0..32).map(|i| {
                let n = if i < 16 { q[i] & 15 } else { q[i - 16] >> 4 };
                d * (n as i32 - 8) as f32
            }));
        }
    }
    out
}

/// One tensor: its stored arrays (name, tensor) and its report row.
fn import_tensor(
    g: &GgufFile,
    path: &Path,
    info: &TensorInfo,
    name: &str,
    float: bool,
) -> Result<(Vec<(String, HostTensor)>, ImportedTensor)> {
    let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
    let raw = g.tensor_bytes(&info.name)?;
    let ty = info.ggml_type;
    let row = |stored: &str| ImportedTensor {
        gguf_name: info.name.clone(),
        name: name.to_string(),
        ggml_type: ggml_type_name(ty),
        stored: stored.to_string(),
        exact: true,
    };
    let plain = |dtype: Dtype| HostTensor { dtype, shape: shape.clone(), data: raw.clone() };
    Ok(match ty {
        GGML_TYPE_F32 => (vec![(name.to_string(), plain(Dtype::F32))], row("F32")),
        GGML_TYPE_F16 => (vec![(name.to_string(), plain(Dtype::F16))], row("F16")),
        GGML_TYPE_BF16 => (vec![(name.to_string(), plain(Dtype::BF16))], row("BF16")),
        GGML_TYPE_Q8_0 | GGML_TYPE_Q4_0 if float => {
            let v = dequant_blocks(&raw, ty);
            (vec![(name.to_string(), HostTensor::floats(&v, &shape, Dtype::F32))], row("F32 (dequantized)"))
        }
        GGML_TYPE_Q8_0 | GGML_TYPE_Q4_0 => {
            let n: usize = shape.iter().product();
            let (codes, scales, biases) = affine_from_blocks(&raw, ty, n);
            let bits = if ty == GGML_TYPE_Q8_0 { 8 } else { 4 };
            let base = name.strip_suffix(".weight").unwrap_or(name);
            let inner = *shape.last().unwrap_or(&0);
            let mut wshape = shape.clone();
            *wshape.last_mut().unwrap() = inner * bits / 32;
            let mut sshape = shape.clone();
            *sshape.last_mut().unwrap() = inner / 32;
            let tensors = vec![
                (format!("{base}.weight"), HostTensor { dtype: Dtype::U32, shape: wshape, data: codes }),
                (format!("{base}.scales"), HostTensor::floats(&scales, &sshape, Dtype::F32)),
                (format!("{base}.biases"), HostTensor::floats(&biases, &sshape, Dtype::F32)),
            ];
            let mut r = row(&format!("affine{bits} g32"));
            r.name = base.to_string();
            (tensors, r)
        }
        other => {
            return Err(fmt_err(
                path,
                format!("tensor '{}' has GGML type {}, which import does not handle", info.name, ggml_type_name(other)),
            ))
        }
    })
}

/// Converts the GGUF model at `path` into a checkpoint in `out` (resuming a previous run of the same
/// import; `overwrite` clears `out` first).
pub fn import_gguf(path: &Path, out: &Path, overwrite: bool) -> Result<GgufImportReport> {
    let g = GgufFile::open(path)?;
    let arch = g
        .metadata
        .get("general.architecture")
        .cloned()
        .ok_or_else(|| fmt_err(path, "metadata 'general.architecture' is missing"))?;
    if arch != "deepseek2" {
        return Err(fmt_err(
            path,
            format!("GGUF architecture '{arch}' is not supported (supported: deepseek2, i.e. DeepSeek-V3/R1, Kimi K2)"),
        ));
    }
    let mut config = deepseek2_config(&g, path)?;
    let layers = config["num_hidden_layers"].as_u64().unwrap_or(0) as usize;

    // Units: 0 = embedding, final norm, head; 1 + i = block i. Every tensor must map somewhere.
    let mut units: BTreeMap<usize, Vec<(&TensorInfo, String, bool)>> = BTreeMap::new();
    for info in g.tensors.values() {
        let Some((name, float)) = map_name(&info.name) else {
            return Err(fmt_err(path, format!("tensor '{}' has no counterpart in deepseek_v3", info.name)));
        };
        let unit = match info.name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((l, _)) => {
                let l: usize = l.parse().unwrap_or(usize::MAX);
                if l >= layers {
                    return Err(fmt_err(path, format!("tensor '{}': block {l} of {layers}", info.name)));
                }
                1 + l
            }
            None => 0,
        };
        units.entry(unit).or_default().push((info, name, float));
    }

    let size = std::fs::metadata(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?.len();
    let dir: Vec<String> =
        g.tensors.values().map(|t| format!("{} {} {:?} {}", t.name, t.ggml_type, t.dims, t.offset)).collect();
    let job = json!({"tool": "gguf-import 1", "bytes": size, "tensors": dir, "config": config});
    let (mut output, resume) = Output::open(out, &fingerprint(&job), overwrite)?;
    let n_units = units.len();
    let mut quant = Map::new();
    let mut report = Vec::new();
    for (i, (unit, list)) in units.iter().enumerate() {
        let file = format!("model-{:05}-of-{n_units:05}.safetensors", i + 1);
        let mut tensors = Vec::new();
        let mut rows = Vec::new();
        for (info, name, float) in list {
            // Even a resumed unit is read again for its report and quantization entries: cheap next to
            // writing, and the rows then never depend on a journal.
            let (t, r) = import_tensor(&g, path, info, name, *float)?;
            if let Some(bits) = r.stored.strip_prefix("affine").and_then(|s| s.split(' ').next()) {
                let bits: u32 = bits.parse().unwrap_or(8);
                quant.insert(r.name.clone(), json!({"group_size": 32, "bits": bits, "mode": "affine"}));
            }
            if output.done(*unit).is_none() {
                tensors.extend(t);
            }
            rows.push(r);
        }
        if output.done(*unit).is_none() {
            let rep = json!(rows
                .iter()
                .map(|r| format!("{} {} -> {}", r.gguf_name, r.ggml_type, r.stored))
                .collect::<Vec<_>>());
            output.write_unit(*unit, &file, &tensors, rep)?;
        }
        report.extend(rows);
    }
    if !quant.is_empty() {
        let mut q = Map::new();
        q.insert("group_size".into(), json!(32));
        q.insert("bits".into(), json!(8));
        q.insert("mode".into(), json!("affine"));
        q.extend(quant);
        config["quantization"] = Value::Object(q.clone());
        config["quantization_config"] = Value::Object(q);
    }
    let text = serde_json::to_string_pretty(&config).map_err(|e| Error::invalid("gguf import", e.to_string()))?;
    output.write_file("config.json", format!("{text}\n").as_bytes())?;
    let exact = report.iter().filter(|r| r.exact).count();
    let manifest = json!({
        "tool": "mlx-k3 convert --from-gguf",
        "source": path.file_name().map(|n| n.to_string_lossy().into_owned()),
        "architecture": arch,
        "fingerprint": fingerprint(&job),
        "exact_tensors": exact,
        "tensors": report.iter().map(|r| json!({
            "gguf": r.gguf_name, "name": r.name, "type": r.ggml_type, "stored": r.stored, "exact": r.exact,
        })).collect::<Vec<_>>(),
    });
    output.finish(&manifest)?;
    Ok(GgufImportReport { architecture: arch, config, tensors: report, resume })
}
