//! MoonViT, the vision tower of Kimi K2.5 / K2.7 (`kimi_k25` checkpoints), and its `mm_projector`: the
//! graph of mlx-vlm 0.7.10's `models/kimi_k25/vision.py` and `kimi_k25.py`, over MLX ops.
//!
//! For `N` patches `[N, C, p, p]` covering images (grid `h x w`) and video chunks (`t` frames of `h x w`):
//!
//! 1. patch embedding: the `p x p` convolution with stride `p` of each patch, i.e. one matmul `[N, p*p*C]`
//!    by the kernel, plus its bias;
//! 2. position embedding: the learnable `[H0, H0, D]` table resized bicubically (PyTorch's `a = -0.75`
//!    kernel, taps outside the table dropped and the rest renormalized, as mlx-vlm computes it) to each grid,
//!    tiled over a chunk's frames plus the 1-D sin-cos temporal embedding of the frame index when `t > 1`;
//! 3. `depth` pre-norm blocks (LayerNorm eps 1e-6, fused `wqkv` with bias, 2-D RoPE on queries and keys,
//!    softmax attention only within each image / video chunk, `wo`; LayerNorm, `fc0`, exact GELU, `fc1`);
//! 4. the final LayerNorm; `sd2_tpool`: a chunk's frames averaged into one frame; the 2x2 (merge kernel)
//!    neighbours concatenated into one token of `4 D`;
//! 5. the projector: LayerNorm (eps 1e-5) over each of the `4` parts, `Linear(4D, 4D)`, GELU,
//!    `Linear(4D, D_text)`.
//!
//! The 2-D RoPE rotates adjacent feature pairs (`2k, 2k+1`) of each head by `col * f_i` for even pairs
//! `k = 2i` and `row * f_i` for odd ones, `f_i = 10000^(-4i / head_dim)`, positions restarting at each
//! image (and each frame of a chunk).
//!
//! Weights are taken as mlx-vlm's `sanitize` leaves them, from the release names too (`vision_tower.encoder.`,
//! `wqkv` / `wo` on the block, the conv kernel in PyTorch's `[out, in, kh, kw]` layout); `Linear`s may be
//! MLX-quantized like the text model's.

use std::path::Path;

use serde_json::Value;

use super::MediaGrid;
use crate::fast;
use crate::io::Safetensors;
use crate::model::config::ModelConfig;
use crate::model::linear::Linear;
use crate::model::loader::{validate_safetensors, weight_files, RawWeights};
use crate::model::weights::{TensorRecord, WeightStore};
use crate::ops::{concatenate, stack};
use crate::{Array, Dtype, Error, Result};

/// The largest grid side the 2-D RoPE covers (mlx-vlm's table is 512 x 512).
pub const MAX_GRID_SIDE: usize = 512;

/// mlx-vlm's `media_placeholder_token_id` default (Kimi K2.5's `<|media_pad|>`).
const DEFAULT_PLACEHOLDER: i64 = 163_606;

/// `vision_config` of a `kimi_k25` checkpoint, with mlx-vlm's `VisionConfig` names and defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct MoonVitConfig {
    /// Blocks (`depth`).
    pub depth: usize,
    /// Width `D` (`embed_dim`; `hidden_size` must equal it).
    pub embed_dim: usize,
    /// Attention heads (`num_heads`); `embed_dim / num_heads` must be a multiple of 4.
    pub num_heads: usize,
    /// Patch side `p` (`patch_size`).
    pub patch_size: usize,
    /// Input channels (`num_channels`).
    pub num_channels: usize,
    /// MLP width (`intermediate_size`).
    pub intermediate_size: usize,
    /// Side of the learnable position table (`init_pos_emb_height`; mlx-vlm builds it square).
    pub pos_emb_side: usize,
    /// Patches merged into one token, (rows, cols) (`merge_kernel_size`, else `spatial_merge_size` squared).
    pub merge: (usize, usize),
    /// The text model's width (the projector's output).
    pub text_hidden: usize,
    /// Token ids the features replace (`image_token_index`, `media_placeholder_token_id`).
    pub placeholders: Vec<i32>,
}

impl MoonVitConfig {
    /// mlx-vlm's `VisionConfig` defaults (the sizes of Kimi K2.5's tower: 27 blocks of width 1152, 16 heads,
    /// patch 14, MLP 4304, a 64x64 position table, 2x2 merge) feeding a text model `text_hidden` wide.
    pub fn defaults(text_hidden: usize) -> MoonVitConfig {
        MoonVitConfig {
            depth: 27,
            embed_dim: 1152,
            num_heads: 16,
            patch_size: 14,
            num_channels: 3,
            intermediate_size: 4304,
            pos_emb_side: 64,
            merge: (2, 2),
            text_hidden,
            placeholders: vec![DEFAULT_PLACEHOLDER as i32],
        }
    }

    /// Reads `vision_config` (and the placeholder ids) of a parsed `config.json`; None when it has none.
    /// `path` names the file in errors.
    pub fn from_model_config(cfg: &ModelConfig, path: &Path) -> Result<Option<MoonVitConfig>> {
        let Some(vc) = cfg.raw.get("vision_config").filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let fmt = |message: String| Error::Format { path: path.to_path_buf(), message };
        let obj = vc.as_object().ok_or_else(|| fmt(format!("vision_config: expected an object, found {vc}")))?;
        if let Some(t) = obj.get("model_type").filter(|v| !v.is_null()) {
            if !matches!(t.as_str(), Some("moonvit" | "qwen2_vl")) {
                return Err(fmt(format!("vision_config.model_type: {t} is not a MoonViT tower (\"moonvit\")")));
            }
        }
        let uint =
            |field: &str, default: usize| -> Result<usize> {
                match obj.get(field) {
                    None | Some(Value::Null) => Ok(default),
                    Some(v) => v.as_u64().filter(|n| (1..=1 << 20).contains(n)).map(|n| n as usize).ok_or_else(|| {
                        fmt(format!("vision_config.{field}: expected an integer in 1..=2^20, found {v}"))
                    }),
                }
            };
        let depth = uint("depth", 27)?;
        let embed_dim = uint("embed_dim", 1152)?;
        let hidden_size = uint("hidden_size", 1152)?;
        let num_heads = uint("num_heads", 16)?;
        let patch_size = uint("patch_size", 14)?;
        let num_channels = uint("num_channels", 3)?;
        let intermediate_size = uint("intermediate_size", 4304)?;
        let pos_emb_side = uint("init_pos_emb_height", 64)?;
        let sms = uint("spatial_merge_size", 2)?;
        let merge = match obj.get("merge_kernel_size") {
            None | Some(Value::Null) => (sms, sms),
            Some(v) => {
                let bad = || {
                    fmt(format!(
                        "vision_config.merge_kernel_size: expected [rows, cols] of integers in 1..=64, found {v}"
                    ))
                };
                let side = |x: &Value| x.as_u64().filter(|n| (1..=64).contains(n)).map(|n| n as usize);
                match v {
                    Value::Array(a) if a.len() == 2 => (side(&a[0]).ok_or_else(bad)?, side(&a[1]).ok_or_else(bad)?),
                    other => {
                        let s = side(other).ok_or_else(bad)?;
                        (s, s)
                    }
                }
            }
        };
        if depth > 1024 {
            return Err(fmt(format!("vision_config.depth: {depth} blocks is more than 1024")));
        }
        if hidden_size != embed_dim {
            return Err(fmt(format!(
                "vision_config.hidden_size: {hidden_size} differs from embed_dim {embed_dim} (the final LayerNorm \
                 normalizes the blocks' output)"
            )));
        }
        if embed_dim % num_heads != 0 || (embed_dim / num_heads) % 4 != 0 {
            return Err(fmt(format!(
                "vision_config.num_heads: {num_heads} heads of embed_dim {embed_dim} must each be a multiple of 4 \
                 wide (the 2-D RoPE splits a head in quarters)"
            )));
        }
        let top = cfg.raw.as_object();
        let id = |field: &str| -> Result<Option<i32>> {
            match top.and_then(|o| o.get(field)) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_i64()
                    .filter(|n| (0..=i32::MAX as i64).contains(n))
                    .map(|n| Some(n as i32))
                    .ok_or_else(|| fmt(format!("{field}: expected a token id, found {v}"))),
            }
        };
        let media = id("media_placeholder_token_id")?.unwrap_or(DEFAULT_PLACEHOLDER as i32);
        let mut placeholders = vec![id("image_token_index")?.unwrap_or(media)];
        if !placeholders.contains(&media) {
            placeholders.push(media);
        }
        Ok(Some(MoonVitConfig {
            depth,
            embed_dim,
            num_heads,
            patch_size,
            num_channels,
            intermediate_size,
            pos_emb_side,
            merge,
            text_hidden: cfg.text.hidden_size,
            placeholders,
        }))
    }

    fn head_dim(&self) -> usize {
        self.embed_dim / self.num_heads
    }
}

/// The tensor name mlx-vlm's `kimi_k25` sanitize gives release tensor `key` (None: dropped).
fn sanitized_name(key: &str) -> Option<String> {
    if key.contains("position_ids") {
        return None;
    }
    let mut k = if key.contains("vision_tower") { key.replace("encoder.", "") } else { key.to_string() };
    if k.contains("vision_tower.blocks") && !k.contains("attn") && (k.contains("wqkv") || k.contains("wo")) {
        k = k.replace("wqkv", "attn.wqkv").replace("wo", "attn.wo");
    }
    Some(k)
}

/// mlx-vlm's `check_array_shape` for a 4-D conv kernel: already `[out, kh, kw, in]`?
fn is_mlx_conv_layout(shape: &[i32]) -> bool {
    shape.len() == 4 && shape[0] >= shape[1] && shape[0] >= shape[2] && shape[1] == shape[2]
}

/// The vision tower's and projector's tensors of `dir` under sanitized names.
fn read_vision_weights(dir: &Path) -> Result<RawWeights> {
    let mut raw = RawWeights::default();
    for path in weight_files(dir)? {
        validate_safetensors(&path)?;
        let st = Safetensors::load(&path)?;
        for key in st.keys() {
            if !key.starts_with("vision_tower.") && !key.starts_with("mm_projector.") {
                continue;
            }
            let Some(name) = sanitized_name(&key) else { continue };
            if let Some(prev) = raw.files.get(&name) {
                return Err(Error::Format {
                    path: path.clone(),
                    message: format!("tensor '{key}' (as '{name}') also appears in {}", prev.display()),
                });
            }
            let mut a = st.get(&key)?;
            if name.ends_with("patch_embed.proj.weight") && a.ndim() == 4 && !is_mlx_conv_layout(&a.shape()) {
                a = a.transpose(&[0, 2, 3, 1])?;
            }
            if name != key {
                raw.origins.insert(name.clone(), key.clone());
            }
            raw.tensors.insert(name.clone(), a);
            raw.files.insert(name, path.clone());
        }
    }
    Ok(raw)
}

/// `x @ Wᵀ + b`.
#[derive(Debug)]
struct BiasLinear {
    lin: Linear,
    bias: Array,
}

impl BiasLinear {
    fn load(ws: &mut WeightStore, path: &str, inputs: usize, outputs: usize) -> Result<BiasLinear> {
        let lin = Linear::load(ws, path, inputs, outputs)?;
        let bias = ws.take(&format!("{path}.bias"), &[outputs as i32])?;
        Ok(BiasLinear { lin, bias })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        self.lin.forward(x)?.add(&self.bias)
    }
}

#[derive(Debug)]
struct LayerNorm {
    weight: Array,
    bias: Array,
    eps: f32,
}

impl LayerNorm {
    fn load(ws: &mut WeightStore, path: &str, dims: usize, eps: f32) -> Result<LayerNorm> {
        let weight = ws.take(&format!("{path}.weight"), &[dims as i32])?;
        let bias = ws.take(&format!("{path}.bias"), &[dims as i32])?;
        Ok(LayerNorm { weight, bias, eps })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        fast::layer_norm(x, Some(&self.weight), Some(&self.bias), self.eps)
    }
}

/// Exact GELU, `x (1 + erf(x / sqrt 2)) / 2` (MLX's `nn.GELU()`).
fn gelu(x: &Array) -> Result<Array> {
    x.multiply(&x.divide(std::f32::consts::SQRT_2)?.erf()?.add(1.0f32)?)?.divide(2.0f32)
}

#[derive(Debug)]
struct Block {
    norm0: LayerNorm,
    norm1: LayerNorm,
    wqkv: BiasLinear,
    wo: BiasLinear,
    fc0: BiasLinear,
    fc1: BiasLinear,
}

/// The rotation of each token's feature pairs: `cos`, `sin` `[S, 1, head_dim / 2]`.
struct Rope {
    cos: Array,
    sin: Array,
}

impl Rope {
    /// `x` `[S, H, hd]` with each pair `(2k, 2k+1)` rotated as the complex product by `cos + i sin`.
    fn apply(&self, x: &Array) -> Result<Array> {
        let sh = x.shape();
        let pairs = x.reshape(&[sh[0], sh[1], sh[2] / 2, 2])?;
        let re = pairs.slice_axis(3, 0, 1)?.squeeze(&[3])?;
        let im = pairs.slice_axis(3, 1, 2)?.squeeze(&[3])?;
        let out_re = re.multiply(&self.cos)?.subtract(&im.multiply(&self.sin)?)?;
        let out_im = re.multiply(&self.sin)?.add(&im.multiply(&self.cos)?)?;
        stack(&[&out_re, &out_im], -1)?.reshape(&sh)
    }
}

impl Block {
    fn load(ws: &mut WeightStore, i: usize, c: &MoonVitConfig) -> Result<Block> {
        let p = format!("vision_tower.blocks.{i}");
        let d = c.embed_dim;
        Ok(Block {
            norm0: LayerNorm::load(ws, &format!("{p}.norm0"), d, 1e-6)?,
            norm1: LayerNorm::load(ws, &format!("{p}.norm1"), d, 1e-6)?,
            wqkv: BiasLinear::load(ws, &format!("{p}.attn.wqkv"), d, 3 * d)?,
            wo: BiasLinear::load(ws, &format!("{p}.attn.wo"), d, d)?,
            fc0: BiasLinear::load(ws, &format!("{p}.mlp.fc0"), d, c.intermediate_size)?,
            fc1: BiasLinear::load(ws, &format!("{p}.mlp.fc1"), c.intermediate_size, d)?,
        })
    }

    fn attention(&self, x: &Array, heads: usize, rope: &Rope, bounds: &[i32]) -> Result<Array> {
        let s = x.dim(0)?;
        let d = x.dim(1)?;
        let hd = d / heads as i32;
        let qkv = self.wqkv.forward(x)?.reshape(&[s, 3, heads as i32, hd])?;
        let part = |i: i32| -> Result<Array> { qkv.slice_axis(1, i, i + 1)?.squeeze(&[1]) };
        let q = rope.apply(&part(0)?)?;
        let k = rope.apply(&part(1)?)?;
        let v = part(2)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut outs = Vec::with_capacity(bounds.len().saturating_sub(1));
        for w in bounds.windows(2) {
            let (a, b) = (w[0], w[1]);
            let seg = |t: &Array| -> Result<Array> { t.slice_axis(0, a, b)?.transpose(&[1, 0, 2])?.expand_dims(&[0]) };
            let o = fast::scaled_dot_product_attention(
                &seg(&q)?,
                &seg(&k)?,
                &seg(&v)?,
                scale,
                fast::AttentionMask::None,
                None,
            )?;
            outs.push(o.squeeze(&[0])?.transpose(&[1, 0, 2])?.reshape(&[b - a, d])?);
        }
        let refs: Vec<&Array> = outs.iter().collect();
        let o = if refs.len() == 1 { outs[0].clone() } else { concatenate(&refs, 0)? };
        self.wo.forward(&o)
    }

    fn forward(&self, x: &Array, heads: usize, rope: &Rope, bounds: &[i32]) -> Result<Array> {
        let h = x.add(&self.attention(&self.norm0.forward(x)?, heads, rope, bounds)?)?;
        h.add(&self.fc1.forward(&gelu(&self.fc0.forward(&self.norm1.forward(&h)?)?)?)?)
    }
}

/// PyTorch's bicubic coefficient for `|t|` (`a = -0.75`).
fn cubic(t: f32) -> f32 {
    const A: f32 = -0.75;
    let at = t.abs();
    let (at2, at3) = (at * at, at * at * at);
    if at <= 1.0 {
        (A + 2.0) * at3 - (A + 3.0) * at2 + 1.0
    } else if at < 2.0 {
        A * at3 - 5.0 * A * at2 + 8.0 * A * at - 4.0 * A
    } else {
        0.0
    }
}

/// The `[out, inn]` matrix of a 1-D bicubic resize (half-pixel centres; taps outside `0..inn` dropped and
/// the others renormalized, as mlx-vlm's `bicubic_interpolate` does).
fn resize_matrix(out: usize, inn: usize) -> Vec<f32> {
    let mut m = vec![0f32; out * inn];
    for o in 0..out {
        let coord = (o as f32 + 0.5) / out as f32 * inn as f32 - 0.5;
        let start = (coord - 2.0).floor() as i64 + 1;
        let taps: Vec<(i64, f32)> = (0..5)
            .map(|k| {
                let pix = start + k;
                let w = if (0..inn as i64).contains(&pix) { cubic(coord - pix as f32) } else { 0.0 };
                (pix, w)
            })
            .collect();
        let sum: f32 = taps.iter().map(|t| t.1).sum::<f32>() + 1e-8;
        for (pix, w) in taps {
            if (0..inn as i64).contains(&pix) {
                m[o * inn + pix as usize] += w / sum;
            }
        }
    }
    m
}

/// The MoonViT tower and its projector.
#[derive(Debug)]
pub struct MoonVit {
    cfg: MoonVitConfig,
    dtype: Dtype,
    /// Patch-embedding kernel `[D, p*p*C]` (the conv's `[D, p, p, C]` flattened) and bias.
    patch_w: Array,
    patch_b: Array,
    /// Learnable position table `[H0, H0, D]`.
    pos_emb: Array,
    blocks: Vec<Block>,
    final_norm: LayerNorm,
    proj_norm: LayerNorm,
    proj0: BiasLinear,
    proj2: BiasLinear,
    records: Vec<TensorRecord>,
}

impl MoonVit {
    /// Loads the tower and projector of the checkpoint in `dir` (its `config.json` already parsed as `cfg`)
    /// with activations in `dtype`; None when the config has no `vision_config`.
    pub fn load(dir: &Path, cfg: &ModelConfig, dtype: Dtype) -> Result<Option<MoonVit>> {
        let Some(c) = MoonVitConfig::from_model_config(cfg, &dir.join("config.json"))? else {
            return Ok(None);
        };
        if !dtype.is_float() {
            return Err(Error::invalid("load", format!("activation dtype must be a float type, not {dtype}")));
        }
        let raw = read_vision_weights(dir)?;
        let ws = WeightStore::new(raw, cfg.quantization.clone(), dtype, dir);
        Ok(Some(MoonVit::build(ws, c, dtype)?))
    }

    /// A tower of `cfg`'s sizes with random weights (seeded), f32 activations: for timing and tests that need
    /// no checkpoint.
    pub fn random(cfg: MoonVitConfig, seed: u64) -> Result<MoonVit> {
        MoonVit::build(WeightStore::fabricating(seed, Dtype::F32)?, cfg, Dtype::F32)
    }

    /// Takes every tensor from `ws`; a store over a checkpoint must then be empty (leftovers are named).
    fn build(mut ws: WeightStore, c: MoonVitConfig, dtype: Dtype) -> Result<MoonVit> {
        let (d, p, ch) = (c.embed_dim as i32, c.patch_size as i32, c.num_channels as i32);
        let patch_w = ws.take("vision_tower.patch_embed.proj.weight", &[d, p, p, ch])?.reshape(&[d, p * p * ch])?;
        let patch_b = ws.take("vision_tower.patch_embed.proj.bias", &[d])?;
        let side = c.pos_emb_side as i32;
        let pos_emb = ws.take("vision_tower.patch_embed.pos_emb.weight", &[side, side, d])?;
        let blocks = (0..c.depth).map(|i| Block::load(&mut ws, i, &c)).collect::<Result<Vec<_>>>()?;
        let final_norm = LayerNorm::load(&mut ws, "vision_tower.final_layernorm", c.embed_dim, 1e-6)?;
        let merged = c.embed_dim * c.merge.0 * c.merge.1;
        let proj_norm = LayerNorm::load(&mut ws, "mm_projector.pre_norm", c.embed_dim, 1e-5)?;
        let proj0 = BiasLinear::load(&mut ws, "mm_projector.proj.0", merged, merged)?;
        let proj2 = BiasLinear::load(&mut ws, "mm_projector.proj.2", merged, c.text_hidden)?;
        ws.materialize()?;
        let records = if ws.fabricated().is_some() { ws.records().to_vec() } else { ws.finish()? };
        Ok(MoonVit { cfg: c, dtype, patch_w, patch_b, pos_emb, blocks, final_norm, proj_norm, proj0, proj2, records })
    }

    /// The parsed vision config.
    pub fn config(&self) -> &MoonVitConfig {
        &self.cfg
    }

    /// Every weight of the tower and projector.
    pub fn tensor_records(&self) -> &[TensorRecord] {
        &self.records
    }

    /// The number of features (prompt placeholder tokens) `grid` gives: its merged `h x w` (frames pooled).
    pub fn tokens_for(&self, grid: MediaGrid) -> usize {
        (grid.h / self.cfg.merge.0) * (grid.w / self.cfg.merge.1)
    }

    fn check_inputs(&self, pixel_values: &Array, grids: &[MediaGrid]) -> Result<i32> {
        let c = &self.cfg;
        let (p, ch) = (c.patch_size as i32, c.num_channels as i32);
        let shape = pixel_values.shape();
        if shape.len() != 4 || shape[1] != ch || shape[2] != p || shape[3] != p {
            return Err(Error::invalid(
                "vision",
                format!("pixel_values must be [patches, {ch}, {p}, {p}], got {shape:?}"),
            ));
        }
        if grids.is_empty() {
            return Err(Error::invalid("vision", "no grids: give one (t, h, w) per image or video chunk"));
        }
        let mut total: u64 = 0;
        for (i, g) in grids.iter().enumerate() {
            if g.t == 0 || g.h == 0 || g.w == 0 || g.h > MAX_GRID_SIDE || g.w > MAX_GRID_SIDE || g.t > 1 << 16 {
                return Err(Error::invalid(
                    "vision",
                    format!("grid {i} {g:?}: t, h and w must be at least 1, h and w at most {MAX_GRID_SIDE}"),
                ));
            }
            if g.h % c.merge.0 != 0 || g.w % c.merge.1 != 0 {
                return Err(Error::invalid(
                    "vision",
                    format!(
                        "grid {i} {g:?}: h and w must be multiples of the merge kernel {}x{}",
                        c.merge.0, c.merge.1
                    ),
                ));
            }
            total += g.patches() as u64;
        }
        if total != shape[0] as u64 {
            return Err(Error::invalid(
                "vision",
                format!("the grids {grids:?} cover {total} patches, but pixel_values has {} patches", shape[0]),
            ));
        }
        Ok(shape[0])
    }

    /// The position table resized to `h x w`, `[h * w, D]`.
    fn spatial_pos(&self, h: usize, w: usize) -> Result<Array> {
        let s = self.cfg.pos_emb_side;
        let d = self.cfg.embed_dim as i32;
        let table = self.pos_emb.astype(Dtype::F32)?;
        let my = Array::from_vec(resize_matrix(h, s), &[h as i32, s as i32])?;
        let mx = Array::from_vec(resize_matrix(w, s), &[w as i32, s as i32])?;
        // rows: [h, S] @ [S, S*D] -> [h, S, D]; columns: [w, S] @ [h, S, D] -> [h, w, D].
        let rows = my.matmul(&table.reshape(&[s as i32, -1])?)?.reshape(&[h as i32, s as i32, d])?;
        let out = mx.matmul(&rows)?;
        out.astype(self.pos_emb.dtype())?.reshape(&[(h * w) as i32, d])
    }

    /// The 1-D sin-cos embedding of frames `0..t`, `[t, D]` (sines of `t * 10000^(-j / (D/2))`, then cosines).
    fn temporal_pos(&self, t: usize) -> Result<Array> {
        let d = self.cfg.embed_dim;
        let half = (d / 2).max(1);
        let pos = crate::ops::arange(0.0, t as f64, 1.0, Dtype::F32)?.reshape(&[t as i32, 1])?;
        let j = crate::ops::arange(0.0, half as f64, 1.0, Dtype::F32)?;
        let freq = j.multiply(-(10000f64.ln()) as f32)?.divide(half as f32)?.exp()?.reshape(&[1, half as i32])?;
        let ang = pos.multiply(&freq)?;
        let mut emb = concatenate(&[&ang.sin()?, &ang.cos()?], 1)?;
        if 2 * half < d {
            let pad = crate::ops::zeros(&[t as i32, (d - 2 * half) as i32], Dtype::F32)?;
            emb = concatenate(&[&emb, &pad], 1)?;
        }
        emb.slice_axis(1, 0, d as i32)
    }

    fn position_embedding(&self, grids: &[MediaGrid]) -> Result<Array> {
        let s = self.cfg.pos_emb_side;
        let mut parts = Vec::with_capacity(grids.len());
        for g in grids {
            let hw = (g.h * g.w) as i32;
            let pe = if g.t > 1 {
                let spatial = self.spatial_pos(g.h, g.w)?;
                let temporal = self.temporal_pos(g.t)?.astype(spatial.dtype())?;
                spatial.tile(&[g.t as i32, 1])?.add(&temporal.repeat(hw, 0)?)?
            } else if (g.h, g.w) == (s, s) {
                self.pos_emb.reshape(&[hw, -1])?
            } else {
                self.spatial_pos(g.h, g.w)?
            };
            parts.push(pe);
        }
        let refs: Vec<&Array> = parts.iter().collect();
        concatenate(&refs, 0)
    }

    fn rope(&self, grids: &[MediaGrid]) -> Result<Rope> {
        let hd = self.cfg.head_dim();
        let quarter = hd / 4;
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for g in grids {
            for _ in 0..g.t {
                for y in 0..g.h {
                    for x in 0..g.w {
                        xs.push(x as f32);
                        ys.push(y as f32);
                    }
                }
            }
        }
        let n = xs.len() as i32;
        // f_i = 1 / 10000^(4i / head_dim), as MLX computes it (f32 power).
        let expo = crate::ops::arange(0.0, (4 * quarter) as f64, 4.0, Dtype::F32)?.divide(hd as f32)?;
        let freqs = Array::scalar_as(10000.0, Dtype::F32)?.power(&expo)?.reciprocal()?.reshape(&[1, quarter as i32])?;
        let ax = Array::from_vec(xs, &[n, 1])?.multiply(&freqs)?;
        let ay = Array::from_vec(ys, &[n, 1])?.multiply(&freqs)?;
        let ang = stack(&[&ax, &ay], -1)?.reshape(&[n, 1, (hd / 2) as i32])?;
        let dt = self.dtype;
        Ok(Rope { cos: ang.cos()?.astype(dt)?, sin: ang.sin()?.astype(dt)? })
    }

    /// The projected features `[tokens, D_text]` of `pixel_values` `[N, C, p, p]` (the patches of every
    /// grid, in order: a grid's `t` frames, each `h` rows of `w`), one row per merged token, grids in order.
    pub fn encode(&self, pixel_values: &Array, grids: &[MediaGrid]) -> Result<Array> {
        let c = &self.cfg;
        let n = self.check_inputs(pixel_values, grids)?;
        let d = c.embed_dim as i32;
        let x = pixel_values.astype(self.dtype)?.transpose(&[0, 2, 3, 1])?.reshape(&[n, -1])?;
        let mut h = x.matmul(&self.patch_w.t()?)?.add(&self.patch_b)?;
        h = h.add(&self.position_embedding(grids)?.astype(self.dtype)?)?;
        let rope = self.rope(grids)?;
        let mut bounds = vec![0i32];
        for g in grids {
            bounds.push(bounds.last().copied().unwrap_or(0) + g.patches() as i32);
        }
        for blk in &self.blocks {
            h = blk.forward(&h, c.num_heads, &rope, &bounds)?;
        }
        h = self.final_norm.forward(&h)?;
        let (kh, kw) = (c.merge.0 as i32, c.merge.1 as i32);
        let mut merged = Vec::with_capacity(grids.len());
        for (g, w) in grids.iter().zip(bounds.windows(2)) {
            let (gh, gw) = (g.h as i32, g.w as i32);
            let mut seq = h.slice_axis(0, w[0], w[1])?;
            if g.t > 1 {
                seq = seq.reshape(&[g.t as i32, gh * gw, d])?.mean(&[0], false)?;
            }
            let m = seq.reshape(&[gh / kh, kh, gw / kw, kw, d])?.transpose(&[0, 2, 1, 3, 4])?.reshape(&[
                (gh / kh) * (gw / kw),
                kh * kw,
                d,
            ])?;
            merged.push(m);
        }
        let refs: Vec<&Array> = merged.iter().collect();
        let all = concatenate(&refs, 0)?;
        let tokens = all.dim(0)?;
        let z = self.proj_norm.forward(&all)?.reshape(&[tokens, kh * kw * d])?;
        self.proj2.forward(&gelu(&self.proj0.forward(&z)?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_names_map_to_mlx_vlm_names() {
        let s = |k: &str| sanitized_name(k).unwrap();
        assert_eq!(s("vision_tower.encoder.blocks.3.wqkv.weight"), "vision_tower.blocks.3.attn.wqkv.weight");
        assert_eq!(s("vision_tower.encoder.blocks.0.wo.bias"), "vision_tower.blocks.0.attn.wo.bias");
        assert_eq!(s("vision_tower.encoder.blocks.0.mlp.fc0.weight"), "vision_tower.blocks.0.mlp.fc0.weight");
        assert_eq!(s("vision_tower.encoder.final_layernorm.weight"), "vision_tower.final_layernorm.weight");
        assert_eq!(s("vision_tower.blocks.1.attn.wqkv.weight"), "vision_tower.blocks.1.attn.wqkv.weight");
        assert_eq!(s("mm_projector.proj.0.weight"), "mm_projector.proj.0.weight");
        assert_eq!(sanitized_name("vision_tower.patch_embed.position_ids"), None);
        assert!(is_mlx_conv_layout(&[1152, 14, 14, 3]));
        assert!(!is_mlx_conv_layout(&[1152, 3, 14, 14]));
    }

    #[test]
    fn resizing_to_the_same_size_is_the_identity_and_rows_sum_to_one() {
        let m = resize_matrix(8, 8);
        for o in 0..8 {
            for i in 0..8 {
                let want = if o == i { 1.0 } else { 0.0 };
                assert!((m[o * 8 + i] - want).abs() < 1e-6, "{o} {i}: {}", m[o * 8 + i]);
            }
        }
        for (out, inn) in [(3, 8), (10, 8), (1, 5), (64, 7)] {
            let m = resize_matrix(out, inn);
            for o in 0..out {
                let s: f32 = m[o * inn..(o + 1) * inn].iter().sum();
                assert!((s - 1.0).abs() < 1e-5, "{out}x{inn} row {o} sums to {s}");
            }
        }
    }
}
