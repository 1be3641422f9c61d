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
//! float (router, MLA's per-head matrices) a quantized tensor is dequantized, again exactly. Q4_K / Q5_K
//! become affine 4 / 5-bit with group 32 (see [`exact_affine`]) and IQ1_S the codebook format, also exactly.
//! Q6_K, Q3_K and Q2_K (16-value sub-blocks: no MLX group fits) are re-quantized per the recipe (or affine 8-bit),
//! with the error reported per tensor and class; a recipe may also re-encode any module it covers. Any
//! other GGML type is an error naming the tensor and the type. A split model is read from its first shard
//! ([`open_shards`]).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value};

use super::classes::{classify, classify_module, TensorClass};
use super::convert::encode_module;
use super::recipe::Recipe;
use super::store::{fingerprint, HostTensor, Output, Resume};
use crate::codebook::{decode_host, from_iq1s_blocks, SUPER_BLOCK};
use crate::gguf::{
    ggml_type_name, GgufFile, TensorInfo, GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_IQ1_S,
    GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_0, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_Q8_0,
};
use crate::model::{ModelConfig, TextConfig};
use crate::{Dtype, Error, Result};

/// The per-tensor and per-class report an import writes into its output folder.
pub const REPORT_FILE: &str = "gguf_import_report.json";

/// How one GGUF tensor was written.
#[derive(Clone, Debug, PartialEq)]
pub struct ImportedTensor {
    /// llama.cpp's name.
    pub gguf_name: String,
    /// The checkpoint's name (without `.weight` for quantized ones).
    pub name: String,
    /// Its tensor class (recipe key: `routed_experts`, `mla`, ...).
    pub class: String,
    /// The GGML type in the GGUF.
    pub ggml_type: String,
    /// What was written: `F32`, `F16`, `BF16`, `affine8 g32`, `affine4 g32`, or `F32 (dequantized)`.
    pub stored: String,
    /// Whether the stored tensor reproduces the GGUF's dequantized values bit for bit.
    pub exact: bool,
    /// Re-quantized tensors: `sqrt(Σ (stored − GGUF)² / Σ GGUF²)` over the dequantized values; 0 otherwise.
    pub rel_rms: f64,
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
    /// Per tensor class: `count`, `exact`, `requantized`, `source_types`, `stored`, `rel_rms` (see
    /// [`class_table`]).
    pub classes: Value,
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

/// A GGUF tensor held as MLX affine with group 32: one code per value, and per group an f32 scale and bias
/// such that `scale * code + bias` is the value ggml computes, in f32, exactly.
struct Affine {
    bits: u32,
    codes: Vec<u8>,
    scales: Vec<f32>,
    biases: Vec<f32>,
}

/// Scale and min of sub-block `j` (0..8) in Q4_K / Q5_K's 12 packed bytes (6 bits each: the low four
/// sub-blocks in the low 6 bits of bytes 0..4 and 4..8, the high four in nibbles of bytes 8..12 plus the top
/// two bits of bytes 0..8).
fn k_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// The GGML types held exactly as MLX affine (group 32), or None.
///
/// Q8_0 / Q4_0: `scale = d`, `bias = -128 d` / `-8 d`, codes shifted to unsigned. Q4_K / Q5_K: each 32-value
/// sub-block `j` of a 256-value super-block has `value = (d * sc_j) * q - (dmin * m_j)` with f16 `d`, `dmin`
/// and 6-bit `sc_j`, `m_j`; `scale = d * sc_j` and `bias = -(dmin * m_j)` are exact in f32 (11 + 6 significant
/// bits), `scale * q` too (+ 5 bits), so MLX's `scale * q + bias` rounds once, as ggml's `a - b` does, to the same
/// value. f32 is needed: neither bf16 (8 bits) nor f16 (11 bits) holds `d * sc_j` in general.
fn exact_affine(raw: &[u8], ty: u32) -> Option<Affine> {
    let n_blocks = raw.len() / crate::gguf::block_layout(ty)?.1;
    let mut a = Affine { bits: 0, codes: Vec::new(), scales: Vec::new(), biases: Vec::new() };
    match ty {
        GGML_TYPE_Q8_0 | GGML_TYPE_Q4_0 => {
            let q8 = ty == GGML_TYPE_Q8_0;
            a.bits = if q8 { 8 } else { 4 };
            for blk in raw.chunks_exact(if q8 { 34 } else { 18 }) {
                let d = f16_to_f32([blk[0], blk[1]]);
                let q = &blk[2..];
                if q8 {
                    a.codes.extend(q.iter().map(|&v| (v as i8 as i16 + 128) as u8));
                    a.biases.push(-128.0 * d);
                } else {
                    // ggml: element j < 16 in the low nibble of byte j, element j + 16 in its high nibble.
                    a.codes.extend((0..32).map(|i| if i < 16 { q[i] & 15 } else { q[i - 16] >> 4 }));
                    a.biases.push(-8.0 * d);
                }
                a.scales.push(d);
            }
        }
        GGML_TYPE_Q4_K | GGML_TYPE_Q5_K => {
            let q5 = ty == GGML_TYPE_Q5_K;
            a.bits = if q5 { 5 } else { 4 };
            a.codes.reserve(n_blocks * 256);
            for blk in raw.chunks_exact(if q5 { 176 } else { 144 }) {
                let d = f16_to_f32([blk[0], blk[1]]);
                let dmin = f16_to_f32([blk[2], blk[3]]);
                let sc = &blk[4..16];
                // Q5_K: qh (32 bytes, bit j of byte i = fifth bit of sub-block j's value i), then qs.
                let (qh, qs) = if q5 { (Some(&blk[16..48]), &blk[48..176]) } else { (None, &blk[16..144]) };
                for j in 0..8 {
                    let (s, m) = k_scale_min(sc, j);
                    a.scales.push(d * s as f32);
                    a.biases.push(-(dmin * m as f32));
                    // Sub-blocks 2c and 2c + 1 share the 32 bytes qs[32c..]: low and high nibbles.
                    a.codes.extend((0..32).map(|i| {
                        let lo = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
                        lo | qh.map_or(0, |h| ((h[i] >> j) & 1) << 4)
                    }));
                }
            }
        }
        _ => return None,
    }
    Some(a)
}

/// Codes of `bits` bits packed as MLX packs them: a little-endian bit stream (value i at bits
/// `bits * i ..` of the row), in u32 words.
fn pack_bits(codes: &[u8], bits: u32) -> Vec<u8> {
    let mut out = vec![0u8; codes.len() * bits as usize / 8];
    for (i, &c) in codes.iter().enumerate() {
        let at = i * bits as usize;
        let v = (c as u16) << (at % 8);
        out[at / 8] |= v as u8;
        if at % 8 + bits as usize > 8 {
            out[at / 8 + 1] |= (v >> 8) as u8;
        }
    }
    out
}

/// The values ggml computes for a tensor's blocks, in f32 (`n` values), for every type [`GgufFile::tensor_bytes`]
/// reads. Q6_K: `(d * sc) * (q - 32)` per 16 values; Q3_K: `(d * sc) * q`, `q` in -4..3; Q2_K: `(d * sc) * q - (dmin * m)` per 16 values.
fn dequantize(raw: &[u8], ty: u32, n: usize) -> Result<Vec<f32>> {
    let f16s = |raw: &[u8]| raw.chunks_exact(2).map(|c| f16_to_f32([c[0], c[1]])).collect::<Vec<_>>();
    if let Some(a) = exact_affine(raw, ty) {
        return Ok(a.codes.iter().enumerate().map(|(i, &q)| a.scales[i / 32] * q as f32 + a.biases[i / 32]).collect());
    }
    Ok(match ty {
        GGML_TYPE_F32 => raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        GGML_TYPE_F16 => f16s(raw),
        GGML_TYPE_BF16 => raw.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        GGML_TYPE_IQ1_S => decode_host(&from_iq1s_blocks(raw, n / SUPER_BLOCK, SUPER_BLOCK)?),
        GGML_TYPE_Q6_K => {
            let mut out = Vec::with_capacity(n);
            for blk in raw.chunks_exact(210) {
                let (ql, qh, sc) = (&blk[..128], &blk[128..192], &blk[192..208]);
                let d = f16_to_f32([blk[208], blk[209]]);
                // Value e: half h = e / 128; its low nibble in ql[64 h + r % 64] (nibble r / 64), its two high
                // bits in qh[32 h + r % 32] (pair r / 32), r = e % 128.
                out.extend((0..256).map(|e| {
                    let (h, r) = (e / 128, e % 128);
                    let lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
                    let hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
                    let q = (lo | (hi << 4)) as i32 - 32;
                    (d * sc[e / 16] as i8 as f32) * q as f32
                }));
            }
            out
        }
        GGML_TYPE_Q3_K => {
            let mut out = Vec::with_capacity(n);
            for blk in raw.chunks_exact(110) {
                let (hmask, qs, sc) = (&blk[..32], &blk[32..96], &blk[96..108]);
                let d = f16_to_f32([blk[108], blk[109]]);
                // Scale k (6 bits, less 32): low nibble k % 8 (high nibble for k >= 8) of bytes 0..8, and bits
                // 2 (k / 4) of byte 8 + k % 4 on top.
                let scale = |k: usize| {
                    let lo = (sc[k % 8] >> (4 * (k / 8))) & 15;
                    let hi = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
                    (lo | (hi << 4)) as i32 - 32
                };
                // Value e: two low bits as Q2_K's; the third, bit e / 32 of hmask[e % 32], set for q >= 0
                // (clear: q is the low bits less 4).
                out.extend((0..256).map(|e| {
                    let (h, r) = (e / 128, e % 128);
                    let lo = ((qs[32 * h + r % 32] >> (2 * (r / 32))) & 3) as i32;
                    let q = if (hmask[e % 32] >> (e / 32)) & 1 == 1 { lo } else { lo - 4 };
                    (d * scale(e / 16) as f32) * q as f32
                }));
            }
            out
        }
        GGML_TYPE_Q2_K => {
            let mut out = Vec::with_capacity(n);
            for blk in raw.chunks_exact(84) {
                let (sc, qs) = (&blk[..16], &blk[16..80]);
                let (d, dmin) = (f16_to_f32([blk[80], blk[81]]), f16_to_f32([blk[82], blk[83]]));
                out.extend((0..256).map(|e| {
                    let (h, r) = (e / 128, e % 128);
                    let q = (qs[32 * h + r % 32] >> (2 * (r / 32))) & 3;
                    let s = sc[e / 16];
                    (d * (s & 15) as f32) * q as f32 - dmin * (s >> 4) as f32
                }));
            }
            out
        }
        other => return Err(Error::invalid("gguf import", format!("no dequantizer for {}", ggml_type_name(other)))),
    })
}

/// The recipe for tensors whose GGML type has no exact counterpart and that `--recipe` does not cover:
/// MLX affine 8-bit, group 32, bf16 scales (the closest MLX format that loses less than any such type).
fn fallback_recipe() -> Result<Recipe> {
    let file = serde_json::from_value(json!({"default": {"format": "affine", "bits": 8, "group_size": 32}}))
        .map_err(|e| Error::invalid("gguf import", e.to_string()))?;
    Recipe::check(file)
}

/// What to do with tensors: the user's recipe (if any) and the fallback.
struct Plan<'a> {
    recipe: Option<&'a Recipe>,
    fallback: Recipe,
    text: TextConfig,
}

/// One tensor: its stored arrays (name, tensor) and its report row.
#[allow(clippy::type_complexity)]
fn import_tensor(
    g: &GgufFile,
    path: &Path,
    plan: &Plan,
    info: &TensorInfo,
    name: &str,
    float: bool,
) -> Result<(Vec<(String, HostTensor)>, ImportedTensor, Option<Value>, Option<(f64, f64)>)> {
    let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
    let raw = g.tensor_bytes(&info.name)?;
    let ty = info.ggml_type;
    let base = name.strip_suffix(".weight").unwrap_or(name).to_string();
    let class = classify_module(&base, &plan.text).unwrap_or_else(|| classify(&base, &plan.text));
    let row = |name: &str, stored: &str| ImportedTensor {
        gguf_name: info.name.clone(),
        name: name.to_string(),
        class: class.key().to_string(),
        ggml_type: ggml_type_name(ty),
        stored: stored.to_string(),
        exact: true,
        rel_rms: 0.0,
    };
    let plain = |dtype: Dtype| HostTensor { dtype, shape: shape.clone(), data: raw.clone() };
    let with_last = |last: usize| {
        let mut s = shape.clone();
        *s.last_mut().unwrap() = last;
        s
    };
    let n: usize = shape.iter().product();
    let k = *shape.last().unwrap_or(&0);
    // Where the model keeps a float (router, norms, MLA's per-head matrices), the values as they are.
    if float {
        return Ok(match ty {
            GGML_TYPE_F32 => (vec![(name.to_string(), plain(Dtype::F32))], row(name, "F32"), None, None),
            GGML_TYPE_F16 => (vec![(name.to_string(), plain(Dtype::F16))], row(name, "F16"), None, None),
            GGML_TYPE_BF16 => (vec![(name.to_string(), plain(Dtype::BF16))], row(name, "BF16"), None, None),
            _ => {
                let v = dequantize(&raw, ty, n)?;
                let t = HostTensor::floats(&v, &shape, Dtype::F32);
                (vec![(name.to_string(), t)], row(name, "F32 (dequantized)"), None, None)
            }
        });
    }
    let covered = plan.recipe.filter(|r| r.modules.contains_key(&base) || r.classes.contains_key(&class));
    if covered.is_none() {
        match ty {
            GGML_TYPE_F32 => return Ok((vec![(name.to_string(), plain(Dtype::F32))], row(name, "F32"), None, None)),
            GGML_TYPE_F16 => return Ok((vec![(name.to_string(), plain(Dtype::F16))], row(name, "F16"), None, None)),
            GGML_TYPE_BF16 => return Ok((vec![(name.to_string(), plain(Dtype::BF16))], row(name, "BF16"), None, None)),
            _ => {}
        }
        if let Some(a) = exact_affine(&raw, ty) {
            let entry = json!({"group_size": 32, "bits": a.bits, "mode": "affine"});
            let tensors = vec![
                (
                    format!("{base}.weight"),
                    HostTensor {
                        dtype: Dtype::U32,
                        shape: with_last(k * a.bits as usize / 32),
                        data: pack_bits(&a.codes, a.bits),
                    },
                ),
                (format!("{base}.scales"), HostTensor::floats(&a.scales, &with_last(k / 32), Dtype::F32)),
                (format!("{base}.biases"), HostTensor::floats(&a.biases, &with_last(k / 32), Dtype::F32)),
            ];
            return Ok((tensors, row(&base, &format!("affine{} g32", a.bits)), Some(entry), None));
        }
        // IQ1_S is the codebook format bit for bit (planes split from its blocks), where a codebook can go.
        let codebook_ok =
            class != TensorClass::Embeddings && !base.ends_with(".embed_q") && !base.ends_with(".unembed_out");
        if ty == GGML_TYPE_IQ1_S && codebook_ok {
            let h = g.iq1s_tensor(&info.name)?;
            let tensors = vec![
                (format!("{base}.codes"), HostTensor { dtype: Dtype::U8, shape: with_last(k / 8), data: h.codes }),
                (
                    format!("{base}.qh"),
                    HostTensor {
                        dtype: Dtype::U16,
                        shape: with_last(k / 32),
                        data: h.qh.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    },
                ),
                (
                    format!("{base}.scales"),
                    HostTensor {
                        dtype: Dtype::F16,
                        shape: with_last(k / SUPER_BLOCK),
                        data: h.scales.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    },
                ),
            ];
            return Ok((tensors, row(&base, "codebook"), Some(json!({"mode": "k3_codebook"})), None));
        }
    }
    // Re-quantized: per the recipe where it covers the module, else the fallback; the error is measured
    // against the GGUF's dequantized values.
    let recipe = covered.unwrap_or(&plan.fallback);
    let want = dequantize(&raw, ty, n)?;
    let (encoded, got, entry, label) = encode_module(recipe, &base, class, &shape, &want)
        .map_err(|e| fmt_err(path, format!("tensor '{}' ({}): {e}", info.name, ggml_type_name(ty))))?;
    let (mut sse, mut sig) = (0f64, 0f64);
    for (a, b) in want.iter().zip(&got) {
        sse += (*a as f64 - *b as f64).powi(2);
        sig += (*a as f64).powi(2);
    }
    let tensors: Vec<(String, HostTensor)> =
        encoded.into_iter().map(|(suffix, t)| (format!("{base}.{suffix}"), t)).collect();
    let mut r = row(if entry.is_some() { &base } else { name }, &format!("{label} (re-quantized)"));
    // Exact when every decoded value equals the GGUF's (as IEEE values: -0 == +0), e.g. a float32 target.
    r.exact = want.iter().zip(&got).all(|(a, b)| a == b);
    r.rel_rms = if sig > 0.0 { (sse / sig).sqrt() } else { sse.sqrt() };
    Ok((tensors, r, entry, Some((sse, sig))))
}

/// Per tensor class: how many tensors, their GGML types, how they were stored, how many are exact, and the
/// relative RMS reconstruction error over the class's re-quantized tensors (`sqrt(Σ err² / Σ value²)`, None
/// when none was re-quantized).
pub fn class_table(rows: &[ImportedTensor], sums: &BTreeMap<String, (f64, f64)>) -> Value {
    let mut t: BTreeMap<String, Value> = BTreeMap::new();
    for r in rows {
        let e = t.entry(r.class.clone()).or_insert_with(
            || json!({"count": 0, "exact": 0, "requantized": 0, "source_types": [], "stored": [], "rel_rms": null}),
        );
        e["count"] = json!(e["count"].as_u64().unwrap_or(0) + 1);
        if r.exact {
            e["exact"] = json!(e["exact"].as_u64().unwrap_or(0) + 1);
        }
        if r.stored.ends_with("(re-quantized)") {
            e["requantized"] = json!(e["requantized"].as_u64().unwrap_or(0) + 1);
        }
        for (key, v) in [("source_types", &r.ggml_type), ("stored", &r.stored)] {
            let list = e[key].as_array_mut().expect("list");
            if !list.iter().any(|x| x == v) {
                list.push(json!(v));
            }
        }
    }
    for (class, (sse, sig)) in sums {
        if let Some(e) = t.get_mut(class) {
            e["rel_rms"] = json!(if *sig > 0.0 { (sse / sig).sqrt() } else { sse.sqrt() });
        }
    }
    json!(t)
}

/// The files of a GGUF model: `path` alone, or, when its metadata says `split.count` = N > 1, the shards
/// `PREFIX-0000i-of-0000N.gguf` next to it (llama.cpp's gguf-split names; `path` must be the first, `split.no`
/// 0). Every shard must exist and say the same `split.count` and its own `split.no`; the first holds the
/// model's metadata.
pub fn open_shards(path: &Path) -> Result<Vec<(std::path::PathBuf, GgufFile)>> {
    let first = GgufFile::open(path)?;
    let count: usize = match meta::<usize>(&first, path, "split.count")? {
        None | Some(0) | Some(1) => return Ok(vec![(path.to_path_buf(), first)]),
        Some(n) => n,
    };
    let no: usize = need(&first, path, "split.no")?;
    if no != 0 {
        return Err(fmt_err(
            path,
            format!(
                "this is shard {} of {count} (split.no = {no}): give the first shard, ...-00001-of-{count:05}.gguf",
                no + 1
            ),
        ));
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let suffix = format!("-00001-of-{count:05}.gguf");
    let Some(stem) = name.strip_suffix(&suffix) else {
        return Err(fmt_err(
            path,
            format!("split.count = {count}, but the file name does not end in '{suffix}' (the shards cannot be found)"),
        ));
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut shards = vec![(path.to_path_buf(), first)];
    for i in 2..=count {
        let p = dir.join(format!("{stem}-{i:05}-of-{count:05}.gguf"));
        if !p.exists() {
            return Err(fmt_err(&p, format!("shard {i} of {count} of {} is missing", path.display())));
        }
        let f = GgufFile::open(&p)?;
        let (c, n) = (meta::<usize>(&f, &p, "split.count")?, meta::<usize>(&f, &p, "split.no")?);
        if c != Some(count) || n != Some(i - 1) {
            let show = |v: Option<usize>| v.map_or("missing".to_string(), |v| v.to_string());
            return Err(fmt_err(
                &p,
                format!(
                    "inconsistent split metadata: split.count = {}, split.no = {}; shard {i} of {count} should say {count} and {}",
                    show(c),
                    show(n),
                    i - 1
                ),
            ));
        }
        shards.push((p, f));
    }
    Ok(shards)
}

/// Options of [`import_gguf_with`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ImportOptions<'a> {
    /// Re-encode the modules it covers (its `modules`, `classes` and `default`), and the tensors of types
    /// that have no exact counterpart; None: those types fall back to MLX affine 8-bit, group 32.
    pub recipe: Option<&'a Recipe>,
    /// Clear the output folder first.
    pub overwrite: bool,
}

/// Converts the GGUF model at `path` into a checkpoint in `out` (resuming a previous run of the same
/// import; `overwrite` clears `out` first).
pub fn import_gguf(path: &Path, out: &Path, overwrite: bool) -> Result<GgufImportReport> {
    import_gguf_with(path, out, ImportOptions { recipe: None, overwrite })
}

/// [`import_gguf`] with a recipe.
pub fn import_gguf_with(path: &Path, out: &Path, opts: ImportOptions) -> Result<GgufImportReport> {
    let shards = open_shards(path)?;
    let g = &shards[0].1;
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
    let mut config = deepseek2_config(g, path)?;
    let layers = config["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    let text = ModelConfig::parse(&config.to_string(), path)?.text;
    let plan = Plan { recipe: opts.recipe, fallback: fallback_recipe()?, text };
    // The embedded tokenizer, when there is one (metadata: the first shard's), checked before anything is
    // written.
    let tokenizer = super::gguf_tokenizer::tokenizer_files(g, path)?;

    // Units: 0 = embedding, final norm, head; 1 + i = block i. Every tensor must map somewhere.
    let mut all: BTreeMap<&str, (&TensorInfo, usize)> = BTreeMap::new();
    for (i, (p, f)) in shards.iter().enumerate() {
        for info in f.tensors.values() {
            if let Some((_, j)) = all.insert(&info.name, (info, i)) {
                return Err(fmt_err(
                    p,
                    format!("tensor '{}' is also in shard {}, {}", info.name, j + 1, shards[j].0.display()),
                ));
            }
        }
    }
    if let Some(want) = meta::<usize>(g, path, "split.tensors.count")? {
        if want != all.len() {
            return Err(fmt_err(
                path,
                format!("inconsistent split metadata: split.tensors.count = {want}, the shards hold {}", all.len()),
            ));
        }
    }
    let mut units: BTreeMap<usize, Vec<(&TensorInfo, String, bool, usize)>> = BTreeMap::new();
    for &(info, shard) in all.values() {
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
        units.entry(unit).or_default().push((info, name, float, shard));
    }

    let mut size = 0;
    for (p, _) in &shards {
        size += std::fs::metadata(p).map_err(|source| Error::Io { path: p.to_path_buf(), source })?.len();
    }
    let dir: Vec<String> =
        all.values().map(|(t, _)| format!("{} {} {:?} {}", t.name, t.ggml_type, t.dims, t.offset)).collect();
    let mut job = json!({"tool": "gguf-import 1", "bytes": size, "tensors": dir, "config": config});
    if shards.len() > 1 {
        job["shards"] = json!(shards.len());
    }
    if let Some(r) = opts.recipe {
        job["recipe"] = r.canonical_json();
    }
    let (mut output, resume) = Output::open(out, &fingerprint(&job), opts.overwrite)?;
    let n_units = units.len();
    let mut quant = Map::new();
    let mut report = Vec::new();
    let mut sums: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for (i, (unit, list)) in units.iter().enumerate() {
        let file = format!("model-{:05}-of-{n_units:05}.safetensors", i + 1);
        let mut tensors = Vec::new();
        let mut rows = Vec::new();
        for (info, name, float, shard) in list {
            // Even a resumed unit is read again for its report and quantization entries: cheap next to
            // writing, and the rows then never depend on a journal.
            let (p, f) = &shards[*shard];
            let (t, r, entry, err) = import_tensor(f, p, &plan, info, name, *float)?;
            if let Some(entry) = entry {
                quant.insert(r.name.clone(), entry);
            }
            if let Some((sse, sig)) = err {
                let s = sums.entry(r.class.clone()).or_default();
                s.0 += sse;
                s.1 += sig;
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
    for (name, text) in tokenizer.iter().flatten() {
        output.write_file(name, text.as_bytes())?;
    }
    let exact = report.iter().filter(|r| r.exact).count();
    let classes = class_table(&report, &sums);
    let tensors_json: Vec<Value> = report
        .iter()
        .map(|r| {
            json!({"gguf": r.gguf_name, "name": r.name, "class": r.class, "type": r.ggml_type, "stored": r.stored,
                   "exact": r.exact, "rel_rms": r.rel_rms})
        })
        .collect();
    let import_report = json!({"source": path.display().to_string(), "exact_tensors": exact, "classes": classes,
                               "tensors": tensors_json});
    let rtext =
        serde_json::to_string_pretty(&import_report).map_err(|e| Error::invalid("gguf import", e.to_string()))?;
    output.write_file(REPORT_FILE, format!("{rtext}\n").as_bytes())?;
    let manifest = json!({
        "tool": "mlx-k3 convert --from-gguf",
        "source": path.file_name().map(|n| n.to_string_lossy().into_owned()),
        "architecture": arch,
        "fingerprint": fingerprint(&job),
        "exact_tensors": exact,
        "classes": classes,
        "tokenizer": g.metadata.get("tokenizer.ggml.pre").filter(|_| tokenizer.is_some()),
        "tensors": tensors_json,
    });
    output.finish(&manifest)?;
    Ok(GgufImportReport { architecture: arch, config, tensors: report, classes, resume })
}
