//! Kimi K3's vision tower (`moonvit3d`) and its `patchmergerv2` projector, as mlx-vlm 0.7.10's
//! `models/kimi_k3/vision.py` and `kimi_k3.py` compute them (the parity fixture is
//! `tests/fixtures/vision_k3`, made by `scripts/make_vision_k3_fixtures.py`).
//!
//! The input is what the image processor hands over: `pixel_values` `[N, 3, p, p]` (one row per patch,
//! channels first) for a list of grids `(t, h, w)` in patches, one per image (`t = 1`) or video chunk, their
//! patches one after another. For each grid:
//!
//! 1. patch embedding: the `p x p` stride-`p` convolution, i.e. one matmul per patch;
//! 2. position: the learnable `[H0, W0, D]` grid resized to `h x w` by bilinear interpolation (half-pixel
//!    centres, clamped at the edges; unchanged when the sizes agree), plus for `t > 1` a fixed sin-cos time
//!    embedding per frame (at most `init_pos_emb_time` frames);
//! 3. `vt_num_hidden_layers` pre-norm blocks over that grid's patches alone (full attention, no mask):
//!    RMSNorm (eps 2^-7), fused `wqkv`, 2D RoPE on queries and keys (pairs of channels rotate by the
//!    patch's column and row in turn), `wo`; RMSNorm, `fc0`, tanh-approximate GELU, `fc1`; a final RMSNorm;
//! 4. `sd2_tpool` merge: each `kh x kw` block of patches (2 x 2) becomes one token of `kh * kw` vectors,
//!    averaged over the frames.
//!
//! The projector flattens each token to `kh * kw * D`, applies `Linear`, exact GELU, `Linear` to the text
//! model's width and an RMSNorm (`projector_ln_eps`). Activations are float32; weights are used as stored.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use super::MediaGrid;
use crate::fast::{self, AttentionMask};
use crate::model::loader::read_media_tensors;
use crate::model::weights::TensorRecord;
use crate::model::ModelConfig;
use crate::ops::{concatenate, stack};
use crate::{Array, Dtype, Error, Result};

/// mlx-vlm's `kimi_k3` default `media_placeholder_token_id`.
const DEFAULT_PLACEHOLDER: i32 = 163605;

/// The block norms' epsilon, fixed in the reference (not a config field).
const BLOCK_NORM_EPS: f32 = 1.0 / 128.0;

fn default_patch_size() -> usize {
    14
}
fn default_pos_hw() -> usize {
    64
}
fn default_pos_t() -> usize {
    4
}
fn default_heads() -> usize {
    12
}
fn default_layers() -> usize {
    27
}
fn default_hidden() -> usize {
    1024
}
fn default_intermediate() -> usize {
    4096
}
fn default_qkv() -> Option<usize> {
    Some(1536)
}
fn default_merge() -> Vec<usize> {
    vec![2, 2]
}
fn default_ln_eps() -> f32 {
    1e-5
}
fn s(v: &str) -> String {
    v.to_string()
}

/// `vision_config` of a `kimi_k3` checkpoint, with mlx-vlm's `VisionConfig` defaults. Fields the reference
/// accepts but implements one way only are checked against that one value.
#[derive(Clone, Debug, Deserialize)]
pub struct VisionConfig {
    /// `moonvit3d`.
    #[serde(default = "model_type_default")]
    pub model_type: String,
    /// Side of a square patch, in pixels.
    #[serde(default = "default_patch_size")]
    pub patch_size: usize,
    /// Rows of the learnable position grid.
    #[serde(default = "default_pos_hw")]
    pub init_pos_emb_height: usize,
    /// Columns of the learnable position grid.
    #[serde(default = "default_pos_hw")]
    pub init_pos_emb_width: usize,
    /// Frames of the sin-cos time embedding (the most a video chunk may have).
    #[serde(default = "default_pos_t")]
    pub init_pos_emb_time: usize,
    /// `bilinear`.
    #[serde(default = "bilinear")]
    pub pos_emb_interpolation_mode: String,
    /// Attention heads of the tower.
    #[serde(default = "default_heads")]
    pub vt_num_attention_heads: usize,
    /// Blocks of the tower.
    #[serde(default = "default_layers")]
    pub vt_num_hidden_layers: usize,
    /// Width of the tower.
    #[serde(default = "default_hidden")]
    pub vt_hidden_size: usize,
    /// Width of the blocks' MLP.
    #[serde(default = "default_intermediate")]
    pub vt_intermediate_size: usize,
    /// Width of queries, keys and values (all heads); `null` means `vt_hidden_size`.
    #[serde(default = "default_qkv")]
    pub qkv_hidden_size: Option<usize>,
    /// `rmsnorm`.
    #[serde(default = "rmsnorm")]
    pub norm_type: String,
    /// `mlp2`.
    #[serde(default = "mlp2")]
    pub mlp_type: String,
    /// `gelu_pytorch_tanh` (the blocks' MLP).
    #[serde(default = "gelu_tanh")]
    pub activation_func: String,
    /// Biases on `wqkv` and `wo`.
    #[serde(default)]
    pub attn_bias: bool,
    /// Biases on `fc0` and `fc1`.
    #[serde(default)]
    pub linear_bias: bool,
    /// A bias on the patch embedding.
    #[serde(default)]
    pub patch_embed_proj_bias: bool,
    /// Patches merged into one token, `[rows, columns]`; `null` means `[2, 2]`.
    #[serde(default, deserialize_with = "merge_or_default")]
    pub merge_kernel_size: Option<Vec<usize>>,
    /// `sd2_tpool`.
    #[serde(default = "sd2_tpool")]
    pub merge_type: String,
    /// `patchmergerv2`.
    #[serde(default = "patchmergerv2")]
    pub mm_projector_type: String,
    /// The projector's input width per patch (must be `vt_hidden_size`).
    #[serde(default = "default_hidden")]
    pub mm_hidden_size: usize,
    /// `gelu` (exact).
    #[serde(default = "gelu_name")]
    pub projector_hidden_act: String,
    /// The projector's output RMSNorm epsilon.
    #[serde(default = "default_ln_eps")]
    pub projector_ln_eps: f32,
}

fn model_type_default() -> String {
    s("moonvit3d")
}
fn bilinear() -> String {
    s("bilinear")
}
fn rmsnorm() -> String {
    s("rmsnorm")
}
fn mlp2() -> String {
    s("mlp2")
}
fn gelu_tanh() -> String {
    s("gelu_pytorch_tanh")
}
fn sd2_tpool() -> String {
    s("sd2_tpool")
}
fn patchmergerv2() -> String {
    s("patchmergerv2")
}
fn gelu_name() -> String {
    s("gelu")
}
fn merge_or_default<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<Vec<usize>>, D::Error> {
    Ok(Option::<Vec<usize>>::deserialize(d)?.or_else(|| Some(default_merge())))
}

impl VisionConfig {
    /// Parses `vision_config`; `path` names the file in errors (`vision_config.FIELD: ...`).
    pub fn parse(v: &Value, path: &Path) -> Result<VisionConfig> {
        let fmt = |message: String| Error::Format { path: path.to_path_buf(), message };
        let mut c: VisionConfig = serde_path_to_error::deserialize(v.clone())
            .map_err(|e| fmt(format!("vision_config.{}: {}", e.path(), e.inner())))?;
        if c.merge_kernel_size.is_none() {
            c.merge_kernel_size = Some(default_merge());
        }
        for (field, have, want) in [
            ("model_type", &c.model_type, "moonvit3d"),
            ("pos_emb_interpolation_mode", &c.pos_emb_interpolation_mode, "bilinear"),
            ("norm_type", &c.norm_type, "rmsnorm"),
            ("mlp_type", &c.mlp_type, "mlp2"),
            ("activation_func", &c.activation_func, "gelu_pytorch_tanh"),
            ("merge_type", &c.merge_type, "sd2_tpool"),
            ("mm_projector_type", &c.mm_projector_type, "patchmergerv2"),
            ("projector_hidden_act", &c.projector_hidden_act, "gelu"),
        ] {
            if have != want {
                return Err(fmt(format!(
                    "vision_config.{field}: '{have}' is not supported (Kimi K3's tower is '{want}')"
                )));
            }
        }
        let positive = |field: &str, n: usize| -> Result<()> {
            if n == 0 || n > 1 << 20 {
                return Err(fmt(format!("vision_config.{field}: {n} is out of range (1..=2^20)")));
            }
            Ok(())
        };
        for (field, n) in [
            ("patch_size", c.patch_size),
            ("init_pos_emb_height", c.init_pos_emb_height),
            ("init_pos_emb_width", c.init_pos_emb_width),
            ("init_pos_emb_time", c.init_pos_emb_time),
            ("vt_num_attention_heads", c.vt_num_attention_heads),
            ("vt_num_hidden_layers", c.vt_num_hidden_layers),
            ("vt_hidden_size", c.vt_hidden_size),
            ("vt_intermediate_size", c.vt_intermediate_size),
            ("qkv_hidden_size", c.qkv_width()),
            ("mm_hidden_size", c.mm_hidden_size),
        ] {
            positive(field, n)?;
        }
        let merge = c.merge();
        if merge.len() != 2 || merge.iter().any(|&k| k == 0 || k > 64) {
            return Err(fmt(format!("vision_config.merge_kernel_size: expected two sizes in 1..=64, found {merge:?}")));
        }
        if c.qkv_width() % c.vt_num_attention_heads != 0 || c.head_dim() % 4 != 0 {
            return Err(fmt(format!(
                "vision_config.qkv_hidden_size: {} must split into vt_num_attention_heads = {} heads of a multiple \
                 of 4 channels (2D RoPE)",
                c.qkv_width(),
                c.vt_num_attention_heads
            )));
        }
        if c.vt_hidden_size % 2 != 0 {
            return Err(fmt(format!(
                "vision_config.vt_hidden_size: {} must be even (sin-cos time embedding)",
                c.vt_hidden_size
            )));
        }
        if c.mm_hidden_size != c.vt_hidden_size {
            return Err(fmt(format!(
                "vision_config.mm_hidden_size: {} differs from vt_hidden_size {} (the projector reads the tower's output)",
                c.mm_hidden_size, c.vt_hidden_size
            )));
        }
        if !(c.projector_ln_eps.is_finite() && c.projector_ln_eps > 0.0) {
            return Err(fmt(format!("vision_config.projector_ln_eps: {} must be positive", c.projector_ln_eps)));
        }
        Ok(c)
    }

    /// Width of queries, keys and values over all heads.
    pub fn qkv_width(&self) -> usize {
        self.qkv_hidden_size.unwrap_or(self.vt_hidden_size)
    }

    /// Channels per attention head.
    pub fn head_dim(&self) -> usize {
        self.qkv_width() / self.vt_num_attention_heads.max(1)
    }

    /// `(rows, columns)` of patches merged into one token.
    pub fn merge(&self) -> Vec<usize> {
        self.merge_kernel_size.clone().unwrap_or_else(default_merge)
    }
}

/// A dense layer `x @ Wᵀ (+ b)`.
#[derive(Clone, Debug)]
struct Dense {
    w_t: Array,
    b: Option<Array>,
}

impl Dense {
    fn forward(&self, x: &Array) -> Result<Array> {
        let y = x.matmul(&self.w_t)?;
        match &self.b {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }
}

#[derive(Clone, Debug)]
struct Block {
    norm0: Array,
    norm1: Array,
    wqkv: Dense,
    wo: Dense,
    fc0: Dense,
    fc1: Dense,
}

/// The vision tensors of a checkpoint, taken by name with their shapes checked.
struct Tensors {
    dir: PathBuf,
    map: std::collections::BTreeMap<String, (Array, PathBuf)>,
}

impl Tensors {
    fn read(dir: &Path) -> Result<Tensors> {
        let mut map = read_media_tensors(dir)?;
        map.retain(|k, _| k.starts_with("vision_tower.") || k.starts_with("mm_projector."));
        Ok(Tensors { dir: dir.to_path_buf(), map })
    }

    /// `name` with `shape`, float; an error names the tensor and its file.
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Array> {
        let Some((a, path)) = self.map.remove(name) else {
            if self.map.contains_key(&format!("{}.scales", name.trim_end_matches(".weight"))) {
                return Err(Error::Format {
                    path: self.dir.clone(),
                    message: format!("tensor '{name}' is quantized: the vision tower runs float weights only"),
                });
            }
            return Err(Error::Format { path: self.dir.clone(), message: format!("tensor '{name}' is missing") });
        };
        let want: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        if a.shape() != want {
            return Err(Error::Format {
                path,
                message: format!("tensor '{name}' has shape {:?}, expected {want:?} from vision_config", a.shape()),
            });
        }
        if !a.dtype().is_float() {
            return Err(Error::Format {
                path,
                message: format!("tensor '{name}' is {}, expected a float dtype", a.dtype()),
            });
        }
        Ok(a)
    }

    fn dense(&mut self, name: &str, in_dims: usize, out_dims: usize, bias: bool) -> Result<Dense> {
        let w = self.take(&format!("{name}.weight"), &[out_dims, in_dims])?;
        let b = if bias { Some(self.take(&format!("{name}.bias"), &[out_dims])?) } else { None };
        Ok(Dense { w_t: w.t()?, b })
    }

    fn norm(&mut self, name: &str, dims: usize) -> Result<Array> {
        self.take(&format!("{name}.weight"), &[dims])?.astype(Dtype::F32)
    }
}

/// Kimi K3's `moonvit3d` tower with its `patchmergerv2` projector.
#[derive(Clone, Debug)]
pub struct MoonVit3d {
    cfg: VisionConfig,
    text_hidden: usize,
    /// The dtype [`MoonVit3d::encode`] returns (the tower itself computes in f32).
    dtype: Dtype,
    placeholders: Vec<i32>,
    records: Vec<TensorRecord>,
    /// The patch embedding as a matrix `[p * p * 3, D]` over patches flattened row, column, channel.
    patch_w: Array,
    patch_b: Option<Array>,
    /// The learnable position grid `[H0, W0, D]`.
    pos: Array,
    blocks: Vec<Block>,
    final_norm: Array,
    proj0: Dense,
    proj2: Dense,
    post_norm: Array,
}

impl MoonVit3d {
    /// Reads the tower and projector of the checkpoint in `dir` (`config.json` already parsed as `model`;
    /// `vision_tower.*`, `mm_projector.*` under mlx-vlm's names; the patch embedding in MLX's `[D, p, p, 3]`
    /// or the release's `[D, 3, p, p]` layout); None when the config has no `vision_config`. The tower
    /// computes in f32 whatever the weights' dtype; `dtype` is the dtype of the features it returns.
    pub fn load(dir: &Path, model: &ModelConfig, dtype: Dtype) -> Result<Option<MoonVit3d>> {
        let path = dir.join("config.json");
        let Some(v) = model.raw.get("vision_config").filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        if !dtype.is_float() {
            return Err(Error::invalid("load", format!("feature dtype must be a float type, not {dtype}")));
        }
        let cfg = VisionConfig::parse(v, &path)?;
        let text_hidden = model.text.hidden_size;
        let mut placeholders = Vec::new();
        for key in ["image_token_index", "media_placeholder_token_id"] {
            match model.raw.get(key) {
                None | Some(Value::Null) => {}
                Some(x) => {
                    let id = x.as_i64().and_then(|i| i32::try_from(i).ok()).filter(|&i| i >= 0).ok_or_else(|| {
                        Error::Format { path: path.clone(), message: format!("{key}: expected a token id, found {x}") }
                    })?;
                    if !placeholders.contains(&id) {
                        placeholders.push(id);
                    }
                }
            }
        }
        if placeholders.is_empty() {
            placeholders.push(DEFAULT_PLACEHOLDER);
        }
        let t = Tensors::read(dir)?;
        MoonVit3d::build(cfg, text_hidden, dtype, placeholders, t).map(Some)
    }

    /// A tower of `cfg` with random weights (normal, standard deviation 0.02; norms 1) and a projector to
    /// `text_hidden`, for timing (`examples/vision_tower.rs`).
    pub fn random(cfg: VisionConfig, text_hidden: usize, seed: u64) -> Result<MoonVit3d> {
        let (d, p, q) = (cfg.vt_hidden_size, cfg.patch_size, cfg.qkv_width());
        let merged = d * cfg.merge().iter().product::<usize>();
        let mut shapes: Vec<(String, Vec<usize>)> = vec![
            ("vision_tower.patch_embed.proj.weight".into(), vec![d, p, p, 3]),
            (
                "vision_tower.patch_embed.pos_emb.weight".into(),
                vec![cfg.init_pos_emb_height, cfg.init_pos_emb_width, d],
            ),
            ("vision_tower.encoder.final_layernorm.weight".into(), vec![d]),
            ("mm_projector.proj.0.weight".into(), vec![merged, merged]),
            ("mm_projector.proj.2.weight".into(), vec![text_hidden, merged]),
            ("mm_projector.post_norm.weight".into(), vec![text_hidden]),
        ];
        if cfg.patch_embed_proj_bias {
            shapes.push(("vision_tower.patch_embed.proj.bias".into(), vec![d]));
        }
        for i in 0..cfg.vt_num_hidden_layers {
            let b = format!("vision_tower.encoder.blocks.{i}");
            shapes.push((format!("{b}.norm0.weight"), vec![d]));
            shapes.push((format!("{b}.norm1.weight"), vec![d]));
            for (name, out_dims, in_dims, bias) in [
                ("wqkv", 3 * q, d, cfg.attn_bias),
                ("wo", d, q, cfg.attn_bias),
                ("mlp.fc0", cfg.vt_intermediate_size, d, cfg.linear_bias),
                ("mlp.fc1", d, cfg.vt_intermediate_size, cfg.linear_bias),
            ] {
                shapes.push((format!("{b}.{name}.weight"), vec![out_dims, in_dims]));
                if bias {
                    shapes.push((format!("{b}.{name}.bias"), vec![out_dims]));
                }
            }
        }
        let mut map = std::collections::BTreeMap::new();
        for (i, (name, shape)) in shapes.into_iter().enumerate() {
            let dims: Vec<i32> = shape.iter().map(|&x| x as i32).collect();
            let a = if name.contains("norm") {
                crate::ops::ones(&dims, Dtype::F32)?
            } else {
                let k = crate::random::key(seed.wrapping_mul(1_000_003).wrapping_add(i as u64))?;
                crate::random::normal(&dims, Dtype::F32, 0.0, 0.02, Some(&k))?
            };
            a.eval()?;
            map.insert(name, (a, PathBuf::from("random")));
        }
        let t = Tensors { dir: PathBuf::from("random"), map };
        MoonVit3d::build(cfg, text_hidden, Dtype::F32, vec![DEFAULT_PLACEHOLDER], t)
    }

    fn build(
        cfg: VisionConfig,
        text_hidden: usize,
        dtype: Dtype,
        placeholders: Vec<i32>,
        mut t: Tensors,
    ) -> Result<MoonVit3d> {
        let records: Vec<TensorRecord> = t
            .map
            .iter()
            .map(|(name, (a, _))| TensorRecord {
                path: name.clone(),
                params: a.size() as u64,
                bytes: a.nbytes() as u64,
                stored_bytes: a.nbytes() as u64,
                spec: None,
                dtype: a.dtype(),
            })
            .collect();
        let d = cfg.vt_hidden_size;
        let p = cfg.patch_size;
        let name = "vision_tower.patch_embed.proj.weight";
        let conv = match t.map.get(name) {
            // mlx-vlm's sanitize: a 4-D conv weight whose shape does not look like MLX's [out, k, k, in] (out
            // the largest, square kernel) is PyTorch's [out, in, kh, kw] and is transposed.
            Some((a, _)) if a.ndim() == 4 && !mlx_conv_layout(&a.shape()) => {
                let a = a.transpose(&[0, 2, 3, 1])?;
                t.map.get_mut(name).expect("present").0 = a;
                t.take(name, &[d, p, p, 3])?
            }
            _ => t.take(name, &[d, p, p, 3])?,
        };
        let patch_w = conv.reshape(&[d as i32, (p * p * 3) as i32])?.t()?;
        let patch_b =
            if cfg.patch_embed_proj_bias { Some(t.take("vision_tower.patch_embed.proj.bias", &[d])?) } else { None };
        let pos =
            t.take("vision_tower.patch_embed.pos_emb.weight", &[cfg.init_pos_emb_height, cfg.init_pos_emb_width, d])?;
        let q = cfg.qkv_width();
        let mut blocks = Vec::with_capacity(cfg.vt_num_hidden_layers);
        for i in 0..cfg.vt_num_hidden_layers {
            let b = format!("vision_tower.encoder.blocks.{i}");
            blocks.push(Block {
                norm0: t.norm(&format!("{b}.norm0"), d)?,
                norm1: t.norm(&format!("{b}.norm1"), d)?,
                wqkv: t.dense(&format!("{b}.wqkv"), d, 3 * q, cfg.attn_bias)?,
                wo: t.dense(&format!("{b}.wo"), q, d, cfg.attn_bias)?,
                fc0: t.dense(&format!("{b}.mlp.fc0"), d, cfg.vt_intermediate_size, cfg.linear_bias)?,
                fc1: t.dense(&format!("{b}.mlp.fc1"), cfg.vt_intermediate_size, d, cfg.linear_bias)?,
            });
        }
        let final_norm = t.norm("vision_tower.encoder.final_layernorm", d)?;
        let merged = d * cfg.merge().iter().product::<usize>();
        let proj0 = t.dense("mm_projector.proj.0", merged, merged, false)?;
        let proj2 = t.dense("mm_projector.proj.2", merged, text_hidden, false)?;
        let post_norm = t.norm("mm_projector.post_norm", text_hidden)?;
        if let Some((extra, (_, path))) = t.map.iter().next() {
            return Err(Error::Format {
                path: path.clone(),
                message: format!("tensor '{extra}' is not part of the moonvit3d tower this vision_config describes"),
            });
        }
        Ok(MoonVit3d {
            cfg,
            text_hidden,
            dtype,
            placeholders,
            records,
            patch_w,
            patch_b,
            pos,
            blocks,
            final_norm,
            proj0,
            proj2,
            post_norm,
        })
    }

    /// The prompt token ids the features replace (`image_token_index`, then `media_placeholder_token_id`;
    /// 163605 when the config names neither).
    pub fn placeholders(&self) -> &[i32] {
        &self.placeholders
    }

    /// Every tensor of the tower and projector, as stored.
    pub fn tensor_records(&self) -> &[TensorRecord] {
        &self.records
    }

    /// The parsed `vision_config`.
    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// The width of the features [`MoonVit3d::encode`] returns (the text model's hidden size).
    pub fn out_dim(&self) -> usize {
        self.text_hidden
    }

    /// Tokens a grid becomes: `(h / kh) * (w / kw)` (frames are averaged).
    pub fn tokens_for(&self, grid: MediaGrid) -> usize {
        let m = self.cfg.merge();
        (grid.h / m[0]) * (grid.w / m[1])
    }

    /// Checks `pixel_values` against `grids`, naming what is wrong.
    fn check_inputs(&self, pixels: &Array, grids: &[MediaGrid]) -> Result<()> {
        let bad = |m: String| Error::invalid("vision encode", m);
        let p = self.cfg.patch_size as i32;
        let shape = pixels.shape();
        if shape.len() != 4 || shape[1] != 3 || shape[2] != p || shape[3] != p {
            return Err(bad(format!("pixel_values must be [patches, 3, {p}, {p}], got {shape:?}")));
        }
        if !pixels.dtype().is_float() {
            return Err(bad(format!("pixel_values must be float, got {}", pixels.dtype())));
        }
        if grids.is_empty() {
            return Err(bad("no grids: give one (t, h, w) per image or video chunk".into()));
        }
        let m = self.cfg.merge();
        let mut total = 0usize;
        for (i, &MediaGrid { t, h, w }) in grids.iter().enumerate() {
            if t == 0 || h == 0 || w == 0 {
                return Err(bad(format!("grid {i} ({t}, {h}, {w}) has an empty side")));
            }
            if h % m[0] != 0 || w % m[1] != 0 {
                return Err(bad(format!(
                    "grid {i} ({t}, {h}, {w}): h and w must be multiples of the merge kernel {} x {}",
                    m[0], m[1]
                )));
            }
            if t > self.cfg.init_pos_emb_time {
                return Err(bad(format!(
                    "grid {i} ({t}, {h}, {w}) has {t} frames; a chunk holds at most init_pos_emb_time = {}",
                    self.cfg.init_pos_emb_time
                )));
            }
            let n = t.checked_mul(h).and_then(|x| x.checked_mul(w)).filter(|&n| n <= i32::MAX as usize);
            let Some(n) = n else { return Err(bad(format!("grid {i} ({t}, {h}, {w}) is too large"))) };
            total = total.saturating_add(n);
        }
        if total != shape[0] as usize {
            return Err(bad(format!("the grids hold {total} patches, pixel_values has {}", shape[0])));
        }
        Ok(())
    }

    /// The tower's merged patches `[tokens, kh * kw, D]` for `pixel_values` `[N, 3, p, p]` and one grid
    /// `(t, h, w)` per image or video chunk (the grids' patches one after another in `pixel_values`).
    pub fn tower(&self, pixels: &Array, grids: &[MediaGrid]) -> Result<Array> {
        self.check_inputs(pixels, grids)?;
        let n = pixels.dim(0)?;
        let p = self.cfg.patch_size as i32;
        let flat = pixels.astype(Dtype::F32)?.transpose(&[0, 2, 3, 1])?.reshape(&[n, p * p * 3])?;
        let mut x = flat.matmul(&self.patch_w)?;
        if let Some(b) = &self.patch_b {
            x = x.add(b)?;
        }
        let mut outs = Vec::with_capacity(grids.len());
        let mut start = 0i32;
        for &MediaGrid { t, h, w } in grids {
            let len = (t * h * w) as i32;
            let xi = x.slice_axis(0, start, start + len)?.add(&self.position(t, h, w)?)?;
            outs.push(self.encode_one(&xi, t, h, w)?);
            start += len;
        }
        let refs: Vec<&Array> = outs.iter().collect();
        concatenate(&refs, 0)
    }

    /// Features `[tokens, D_text]` to put in place of the prompt's placeholders: the tower, then the
    /// projector.
    pub fn encode(&self, pixels: &Array, grids: &[MediaGrid]) -> Result<Array> {
        let merged = self.tower(pixels, grids)?;
        self.project(&merged)?.astype(self.dtype)
    }

    /// The projector over the tower's merged patches `[tokens, kh * kw, D]`.
    pub fn project(&self, merged: &Array) -> Result<Array> {
        let tokens = merged.dim(0)?;
        let h = merged.reshape(&[tokens, -1])?;
        let h = gelu(&self.proj0.forward(&h)?)?;
        let h = self.proj2.forward(&h)?;
        fast::rms_norm(&h, Some(&self.post_norm), self.cfg.projector_ln_eps)
    }

    /// The position embedding `[t * h * w, D]` of a grid: the learnable grid resized to `h x w`, plus the
    /// time embedding of each frame when `t > 1`.
    fn position(&self, t: usize, h: usize, w: usize) -> Result<Array> {
        let d = self.cfg.vt_hidden_size as i32;
        let (h0, w0) = (self.cfg.init_pos_emb_height, self.cfg.init_pos_emb_width);
        let pos2d = if (h0, w0) == (h, w) {
            self.pos.clone()
        } else {
            let weight = self.pos.astype(Dtype::F32)?;
            let (r0, r1, rf) = interp_indices(h0, h);
            let rows = lerp(&weight.take(&r0, 0)?, &weight.take(&r1, 0)?, &rf, &[h as i32, 1, 1])?;
            let (c0, c1, cf) = interp_indices(w0, w);
            lerp(&rows.take(&c0, 1)?, &rows.take(&c1, 1)?, &cf, &[1, w as i32, 1])?
        }
        .reshape(&[(h * w) as i32, d])?;
        if t == 1 {
            return pos2d.astype(Dtype::F32);
        }
        let time = sincos_time(self.cfg.vt_hidden_size, t)?.expand_dims(&[1])?;
        pos2d.expand_dims(&[0])?.add(&time)?.reshape(&[(t * h * w) as i32, d])?.astype(Dtype::F32)
    }

    fn encode_one(&self, x: &Array, t: usize, h: usize, w: usize) -> Result<Array> {
        let (cos, sin) = rope_2d(self.cfg.head_dim(), t, h, w)?;
        let mut x = x.clone();
        for b in &self.blocks {
            x = self.block(b, &x, &cos, &sin)?;
        }
        let x = fast::rms_norm(&x, Some(&self.final_norm), BLOCK_NORM_EPS)?;
        // sd2_tpool: [t, h/kh, kh, w/kw, kw, D] -> blocks of kh x kw patches, averaged over the frames.
        let m = self.cfg.merge();
        let (kh, kw) = (m[0] as i32, m[1] as i32);
        let (nh, nw) = (h as i32 / kh, w as i32 / kw);
        let d = self.cfg.vt_hidden_size as i32;
        x.reshape(&[t as i32, nh, kh, nw, kw, d])?.transpose(&[0, 1, 3, 2, 4, 5])?.mean(&[0], false)?.reshape(&[
            nh * nw,
            kh * kw,
            d,
        ])
    }

    fn block(&self, b: &Block, x: &Array, cos: &Array, sin: &Array) -> Result<Array> {
        let l = x.dim(0)?;
        let heads = self.cfg.vt_num_attention_heads as i32;
        let hd = self.cfg.head_dim() as i32;
        let qkv = b.wqkv.forward(&fast::rms_norm(x, Some(&b.norm0), BLOCK_NORM_EPS)?)?.reshape(&[l, 3, heads, hd])?;
        let part = |i: i32| -> Result<Array> { qkv.slice_axis(1, i, i + 1)?.squeeze(&[1]) };
        let q = apply_rope_2d(&part(0)?, cos, sin)?.transpose(&[1, 0, 2])?.expand_dims(&[0])?;
        let k = apply_rope_2d(&part(1)?, cos, sin)?.transpose(&[1, 0, 2])?.expand_dims(&[0])?;
        let v = part(2)?.transpose(&[1, 0, 2])?.expand_dims(&[0])?;
        let scale = (hd as f32).powf(-0.5);
        let out = fast::scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::None, None)?;
        let out = out.squeeze(&[0])?.transpose(&[1, 0, 2])?.reshape(&[l, heads * hd])?;
        let x = x.add(&b.wo.forward(&out)?)?;
        let m =
            b.fc1.forward(&gelu_approx(&b.fc0.forward(&fast::rms_norm(&x, Some(&b.norm1), BLOCK_NORM_EPS)?)?)?)?;
        x.add(&m)
    }
}

/// mlx-vlm's `check_array_shape` for a 4-D conv weight: MLX's `[out, kh, kw, in]` has `out` at least as large as
/// both kernel sides and a square kernel.
fn mlx_conv_layout(shape: &[i32]) -> bool {
    let (o, kh, kw) = (shape[0], shape[1], shape[2]);
    o >= kh && o >= kw && kh == kw
}

/// Source rows for resizing `in_size` to `out_size` (half-pixel centres, clamped): the two neighbours and
/// the weight of the second, computed in f32 as the reference does.
fn interp_indices(in_size: usize, out_size: usize) -> (Array, Array, Vec<f32>) {
    let ratio = (in_size as f64 / out_size as f64) as f32;
    let last = (in_size - 1) as f32;
    let mut i0 = Vec::with_capacity(out_size);
    let mut i1 = Vec::with_capacity(out_size);
    let mut frac = Vec::with_capacity(out_size);
    for o in 0..out_size {
        let src = ((o as f32 + 0.5) * ratio - 0.5).clamp(0.0, last);
        let a = src.floor();
        i0.push(a as i32);
        i1.push((a as i32 + 1).min(in_size as i32 - 1));
        frac.push(src - a);
    }
    let n = out_size as i32;
    (Array::from_vec(i0, &[n]).expect("sizes match"), Array::from_vec(i1, &[n]).expect("sizes match"), frac)
}

/// `a * (1 - f) + b * f` with the weights `f` shaped `shape` to broadcast.
fn lerp(a: &Array, b: &Array, f: &[f32], shape: &[i32]) -> Result<Array> {
    let one_minus: Vec<f32> = f.iter().map(|v| 1.0 - v).collect();
    let wa = Array::from_vec(one_minus, shape)?;
    let wb = Array::from_slice(f, shape)?;
    a.multiply(&wa)?.add(&b.multiply(&wb)?)
}

/// The fixed time embedding `[t, dim]`: `sin` then `cos` of `frame / 10000^(2i/dim)`.
fn sincos_time(dim: usize, t: usize) -> Result<Array> {
    let half = dim / 2;
    let omega = crate::ops::arange(0.0, half as f64, 1.0, Dtype::F32)?.divide(half as f32)?;
    let omega = Array::scalar(1.0f32)?.divide(&Array::scalar(10000.0f32)?.power(&omega)?)?;
    let pos = crate::ops::arange(0.0, t as f64, 1.0, Dtype::F32)?;
    let out = pos.expand_dims(&[1])?.multiply(&omega.expand_dims(&[0])?)?;
    concatenate(&[&out.sin()?, &out.cos()?], 1)
}

/// `cos` and `sin` `[t * h * w, head_dim / 2]` of the 2D RoPE: channel pair `2i` turns by the patch's
/// column times `freq[i]`, pair `2i + 1` by its row; frames repeat the grid.
fn rope_2d(head_dim: usize, t: usize, h: usize, w: usize) -> Result<(Array, Array)> {
    let n = head_dim / 4;
    let exps = crate::ops::arange(0.0, head_dim as f64, 4.0, Dtype::F32)?.slice_axis(0, 0, n as i32)?;
    let freqs = Array::scalar(1.0f32)?.divide(&Array::scalar(10000.0f32)?.power(&exps.divide(head_dim as f32)?)?)?;
    let hw = (h * w) as i32;
    let ys: Vec<f32> = (0..h * w).map(|i| (i / w) as f32).collect();
    let xs: Vec<f32> = (0..h * w).map(|i| (i % w) as f32).collect();
    let freqs = freqs.expand_dims(&[0])?;
    let xf = Array::from_vec(xs, &[hw, 1])?.multiply(&freqs)?;
    let yf = Array::from_vec(ys, &[hw, 1])?.multiply(&freqs)?;
    let mut angles = stack(&[&xf, &yf], -1)?.reshape(&[hw, -1])?;
    if t > 1 {
        angles = angles.tile(&[t as i32, 1])?;
    }
    Ok((angles.cos()?, angles.sin()?))
}

/// Rotates channel pairs `(2i, 2i + 1)` of `x` `[L, H, hd]` by the angles whose `cos`/`sin` are `[L, hd/2]`.
fn apply_rope_2d(x: &Array, cos: &Array, sin: &Array) -> Result<Array> {
    let s = x.shape();
    let (l, heads, hd) = (s[0], s[1], s[2]);
    let pairs = x.astype(Dtype::F32)?.reshape(&[l, heads, hd / 2, 2])?;
    let xe = pairs.slice_axis(3, 0, 1)?.squeeze(&[3])?;
    let xo = pairs.slice_axis(3, 1, 2)?.squeeze(&[3])?;
    let cos = cos.expand_dims(&[1])?;
    let sin = sin.expand_dims(&[1])?;
    let oe = xe.multiply(&cos)?.subtract(&xo.multiply(&sin)?)?;
    let oo = xe.multiply(&sin)?.add(&xo.multiply(&cos)?)?;
    stack(&[&oe, &oo], -1)?.reshape(&[l, heads, hd])?.astype(x.dtype())
}

/// The tanh approximation of GELU (`gelu_pytorch_tanh`).
fn gelu_approx(x: &Array) -> Result<Array> {
    let c = (2.0f64 / std::f64::consts::PI).sqrt() as f32;
    let inner = x.add(&x.power(3.0f32)?.multiply(0.044715f32)?)?.multiply(c)?;
    x.multiply(0.5f32)?.multiply(&inner.tanh()?.add(1.0f32)?)
}

/// Exact GELU, `x * (1 + erf(x / sqrt 2)) / 2`.
fn gelu(x: &Array) -> Result<Array> {
    x.multiply(&x.divide(std::f32::consts::SQRT_2)?.erf()?.add(1.0f32)?)?.divide(2.0f32)
}
