//! The block drafter: a small network that reads the target's hidden states at a few tap layers and drafts
//! a block of tokens in one forward (docs/architecture.md#the-block-drafter). It needs no forward of the
//! target of its own: the verify loop hands it the taps of every position the target runs
//! ([`Drafter::observe`]).
//!
//! For a context whose last token `x_n` has not run yet (the target's state covers positions `< n`), slot 0
//! of the block holds the embedding of `x_n` and slots `1..K` a learned mask vector; each slot adds its slot
//! embedding and the projected taps of position `n - 1`. Each of the drafter's layers lets the slots attend
//! to the projected taps of up to `context_window` earlier positions and to each other (RoPE, no mask),
//! then runs a SwiGLU MLP. A final RMSNorm and the target's (tied, frozen) embedding matrix give the
//! logits: slot `i` drafts `x_{n+1+i}`. `scripts/speculative/train_block_drafter.py` trains it.

use std::path::Path;

use super::sample::{RecentTokens, Sampler};
use super::speculative::{Draft, Drafter, SplitMix64};
use crate::fast::{self, AttentionMask};
use crate::io::Safetensors;
use crate::model::KimiK3;
use crate::{ops, Array, Device, Dtype, Error, Result};
use mlx_k3_host::{self as host, HostBlock};

/// `config.json` of a block drafter (`model_type: "k3_block_drafter"`).
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct BlockDrafterConfig {
    /// Always `k3_block_drafter`.
    pub model_type: String,
    /// The drafter's width (the target's embedding width: it reuses the target's embedding).
    pub hidden_size: usize,
    /// The target's hidden size.
    pub target_hidden_size: usize,
    /// The target's vocabulary size.
    pub vocab_size: usize,
    /// Target layers (0-based) whose outputs the drafter reads, concatenated in this order.
    pub tap_layers: Vec<usize>,
    /// Drafter layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// SwiGLU width.
    pub intermediate_size: usize,
    /// Slots in a block: the most tokens one forward drafts.
    pub block_size: usize,
    /// The most earlier positions the block attends to.
    pub context_window: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
}

impl BlockDrafterConfig {
    /// Whether `dir/config.json` describes a block drafter (false when it is absent, unreadable or another
    /// model; [`BlockDrafter::load`] reports what is wrong with a block drafter's files).
    pub fn is_block_drafter(dir: &Path) -> bool {
        std::fs::read_to_string(dir.join("config.json"))
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            .is_some_and(|v| v.get("model_type").and_then(|t| t.as_str()) == Some("k3_block_drafter"))
    }
}

/// The context the block attends to: projected taps `[C, D]` and, per drafter layer, their keys (RoPE at
/// their absolute positions) and values `[1, H, C, hd]`, computed once per position rather than every cycle.
#[derive(Clone)]
struct MlxCtx {
    feats: Array,
    kv: Vec<(Array, Array)>,
}

impl MlxCtx {
    fn len(&self) -> Result<i32> {
        self.feats.dim(0)
    }

    /// Rows `a..b`.
    fn rows(&self, a: i32, b: i32) -> Result<MlxCtx> {
        Ok(MlxCtx {
            feats: self.feats.slice_axis(0, a, b)?,
            kv: self
                .kv
                .iter()
                .map(|(k, v)| Ok((k.slice_axis(2, a, b)?, v.slice_axis(2, a, b)?)))
                .collect::<Result<_>>()?,
        })
    }

    fn append(&self, more: &MlxCtx) -> Result<MlxCtx> {
        Ok(MlxCtx {
            feats: ops::concatenate(&[&self.feats, &more.feats], 0)?,
            kv: self
                .kv
                .iter()
                .zip(&more.kv)
                .map(|((k, v), (k2, v2))| Ok((ops::concatenate(&[k, k2], 2)?, ops::concatenate(&[v, v2], 2)?)))
                .collect::<Result<_>>()?,
        })
    }
}

/// The context in the form the drafter's engine keeps it.
#[derive(Clone)]
enum Ctx {
    Mlx(MlxCtx),
    Host(host::Ctx),
}

/// Where a block drafter's forward runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockEngine {
    /// MLX operations on MLX's default device.
    Mlx,
    /// Plain Rust on the calling thread (the `mlx-k3-host` crate): the default on a CPU for drafters up to
    /// [`HOST_MAX_PARAMS`] parameters, whose forward is too small for MLX's per-operation cost to pay.
    Host,
}

/// The most parameters of a drafter that runs on the host by default (on a CPU): above it, MLX's
/// multithreaded kernels win over one thread.
pub const HOST_MAX_PARAMS: usize = 16 << 20;

/// A block's logits `[K, V]`, from either engine.
enum Logits {
    Mlx(Array),
    Host { data: Vec<f32>, vocab: usize },
}

impl Logits {
    /// The argmax of each of the first `k` rows.
    fn argmax_rows(&self, k: usize) -> Result<Vec<u32>> {
        match self {
            Logits::Mlx(a) => {
                let best = a.slice_axis(0, 0, k as i32)?.argmax(-1, false)?;
                crate::eval(&[&best])?;
                best.to_vec::<u32>()
            }
            Logits::Host { data, vocab } => Ok(data
                .chunks_exact(*vocab)
                .take(k)
                .map(|r| {
                    // First maximum, as MLX's argmax.
                    let mut best = 0;
                    for (i, &v) in r.iter().enumerate() {
                        if v > r[best] {
                            best = i;
                        }
                    }
                    best as u32
                })
                .collect()),
        }
    }

    /// Row `i` as an MLX array `[1, V]`.
    fn row(&self, i: usize) -> Result<Array> {
        match self {
            Logits::Mlx(a) => a.slice_axis(0, i as i32, i as i32 + 1),
            Logits::Host { data, vocab } => Array::from_slice(&data[i * vocab..(i + 1) * vocab], &[1, *vocab as i32]),
        }
    }
}

struct Layer {
    attn_norm: Array,
    q: Array,
    k: Array,
    v: Array,
    o: Array,
    mlp_norm: Array,
    gate: Array,
    up: Array,
    down: Array,
}

/// A trained block drafter bound to its target (see the module docs).
pub struct BlockDrafter {
    cfg: BlockDrafterConfig,
    fc_t: Array,
    ctx_norm: Array,
    mask_embed: Array,
    slot_embed: Array,
    layers: Vec<Layer>,
    norm: Array,
    /// The target's embedding matrix `[V, D]` (f32): slot 0's input and the output projection.
    embed: Array,
    /// The forward on the host (see [`BlockEngine::Host`]); None: MLX operations.
    host: Option<HostBlock>,
    /// The context of positions `ctx_start..ctx_start + C` (C at most `context_window`).
    ctx: Option<Ctx>,
    ctx_start: usize,
    /// The tokens at positions `0..ctx_end` as observed (to tell whether a context continues them).
    tokens: Vec<u32>,
    /// Taps observed but not yet projected: (positions, the taps as `observe` got them), in order; they
    /// cover the last positions before `ctx_end`.
    pending: Vec<(usize, Vec<Array>)>,
}

fn transpose(w: &Array) -> Result<Array> {
    w.t()?.contiguous()
}

impl BlockDrafter {
    /// Loads `dir` (config.json, model.safetensors) for `target`, checking that the two fit together; the
    /// engine is the host on a CPU for a drafter up to [`HOST_MAX_PARAMS`] parameters, else MLX (the
    /// environment's `K3_BLOCK_DRAFTER=host|mlx` chooses instead).
    pub fn load(dir: &Path, target: &KimiK3) -> Result<BlockDrafter> {
        Self::load_with(dir, target, None)
    }

    /// [`BlockDrafter::load`] with the engine chosen (None: the default rule).
    pub fn load_with(dir: &Path, target: &KimiK3, engine: Option<BlockEngine>) -> Result<BlockDrafter> {
        let cpath = dir.join("config.json");
        let text = std::fs::read_to_string(&cpath).map_err(|source| Error::Io { path: cpath.clone(), source })?;
        let cfg: BlockDrafterConfig = serde_json::from_str(&text)
            .map_err(|e| Error::Format { path: cpath.clone(), message: format!("not a block drafter config: {e}") })?;
        let bad = |m: String| Err(Error::Format { path: cpath.clone(), message: m });
        if cfg.model_type != "k3_block_drafter" {
            return bad(format!("model_type is {:?}, not \"k3_block_drafter\"", cfg.model_type));
        }
        let t = target.config();
        if cfg.vocab_size != t.vocab_size || cfg.target_hidden_size != t.hidden_size || cfg.hidden_size != t.hidden_size
        {
            return bad(format!(
                "vocab_size {} / target_hidden_size {} / hidden_size {} do not fit the target (vocab {}, hidden {})",
                cfg.vocab_size, cfg.target_hidden_size, cfg.hidden_size, t.vocab_size, t.hidden_size
            ));
        }
        if !t.tie_word_embeddings {
            return bad("the block drafter uses the target's tied embedding as its output head; this target has a \
                        separate LM head"
                .into());
        }
        if cfg.tap_layers.is_empty() || cfg.tap_layers.iter().any(|&l| l >= t.num_hidden_layers) {
            return bad(format!(
                "tap_layers {:?} must be 0-based layers of the target ({} layers)",
                cfg.tap_layers, t.num_hidden_layers
            ));
        }
        if cfg.num_layers == 0
            || cfg.num_heads == 0
            || cfg.head_dim == 0
            || cfg.head_dim % 2 != 0
            || cfg.intermediate_size == 0
            || cfg.block_size == 0
            || cfg.block_size > 64
            || cfg.context_window == 0
            || !(cfg.rms_norm_eps > 0.0 && cfg.rope_theta > 0.0)
        {
            return bad("num_layers, num_heads, head_dim (even), intermediate_size, block_size (1-64), \
                        context_window, rms_norm_eps and rope_theta must be positive"
                .into());
        }
        let wpath = dir.join("model.safetensors");
        let st = Safetensors::load(&wpath)?;
        let (d, hd) = (cfg.hidden_size as i32, (cfg.num_heads * cfg.head_dim) as i32);
        let get = |name: &str, shape: &[i32]| -> Result<Array> {
            let a = st.get(name)?;
            if a.shape() != shape {
                return Err(Error::Format {
                    path: wpath.clone(),
                    message: format!("tensor '{name}' has shape {:?}, expected {shape:?}", a.shape()),
                });
            }
            let a = a.astype(Dtype::F32)?;
            crate::eval(&[&a])?;
            Ok(a)
        };
        let taps_w = (cfg.target_hidden_size * cfg.tap_layers.len()) as i32;
        let f = cfg.intermediate_size as i32;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |n: &str| format!("layers.{i}.{n}");
            layers.push(Layer {
                attn_norm: get(&p("attn_norm.weight"), &[d])?,
                q: transpose(&get(&p("q_proj.weight"), &[hd, d])?)?,
                k: transpose(&get(&p("k_proj.weight"), &[hd, d])?)?,
                v: transpose(&get(&p("v_proj.weight"), &[hd, d])?)?,
                o: transpose(&get(&p("o_proj.weight"), &[d, hd])?)?,
                mlp_norm: get(&p("mlp_norm.weight"), &[d])?,
                gate: transpose(&get(&p("gate_proj.weight"), &[f, d])?)?,
                up: transpose(&get(&p("up_proj.weight"), &[f, d])?)?,
                down: transpose(&get(&p("down_proj.weight"), &[d, f])?)?,
            });
        }
        let ids = Array::from_slice(&(0..t.vocab_size as u32).collect::<Vec<_>>(), &[1, t.vocab_size as i32])?;
        let embed = target.embed_tokens(&ids)?.squeeze(&[0])?.astype(Dtype::F32)?;
        crate::eval(&[&embed])?;
        let mut drafter = BlockDrafter {
            host: None,
            fc_t: transpose(&get("fc.weight", &[d, taps_w])?)?,
            ctx_norm: get("ctx_norm.weight", &[d])?,
            mask_embed: get("mask_embed", &[d])?,
            slot_embed: get("slot_embed", &[cfg.block_size as i32, d])?,
            norm: get("norm.weight", &[d])?,
            layers,
            embed,
            cfg,
            ctx: None,
            ctx_start: 0,
            tokens: Vec::new(),
            pending: Vec::new(),
        };
        let all: Vec<&Array> =
            drafter.layers.iter().flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]).collect();
        crate::eval(&all)?;
        crate::eval(&[&drafter.fc_t])?;
        let engine = match (engine, std::env::var("K3_BLOCK_DRAFTER").ok().as_deref()) {
            (Some(e), _) => e,
            (None, Some("host")) => BlockEngine::Host,
            (None, Some("mlx")) => BlockEngine::Mlx,
            (None, Some(other)) => {
                return Err(Error::invalid("K3_BLOCK_DRAFTER", format!("must be host or mlx, got {other:?}")))
            }
            (None, None) if Device::default_device()? == Device::Cpu && drafter.parameters() <= HOST_MAX_PARAMS => {
                BlockEngine::Host
            }
            (None, None) => BlockEngine::Mlx,
        };
        if engine == BlockEngine::Host {
            drafter.host = Some(drafter.host_weights()?);
        }
        Ok(drafter)
    }

    /// Its own parameters (the target's embedding, which it borrows, not counted).
    pub fn parameters(&self) -> usize {
        let l: usize =
            self.layers.iter().flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]).map(|a| a.size()).sum();
        l + self.fc_t.size() + self.slot_embed.size() + 3 * self.cfg.hidden_size * (self.cfg.num_layers + 1)
    }

    /// Which engine runs its forward.
    pub fn engine(&self) -> BlockEngine {
        if self.host.is_some() {
            BlockEngine::Host
        } else {
            BlockEngine::Mlx
        }
    }

    /// The host engine's copy of the weights (matrices input-major, as the MLX path keeps them; k and v,
    /// gate and up side by side).
    fn host_weights(&self) -> Result<HostBlock> {
        let pack = |parts: &[&Array]| -> Result<host::Packed> {
            let w = if parts.len() == 1 { parts[0].clone() } else { ops::concatenate(parts, 1)? };
            let (k, n) = (w.dim(0)? as usize, w.dim(1)? as usize);
            Ok(host::Packed::new(&w.to_vec_f32()?, k, n))
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(host::Layer {
                    attn_norm: l.attn_norm.to_vec_f32()?,
                    q: pack(&[&l.q])?,
                    kv: pack(&[&l.k, &l.v])?,
                    o: pack(&[&l.o])?,
                    mlp_norm: l.mlp_norm.to_vec_f32()?,
                    gate_up: pack(&[&l.gate, &l.up])?,
                    down: pack(&[&l.down])?,
                })
            })
            .collect::<Result<_>>()?;
        let c = &self.cfg;
        Ok(HostBlock {
            d: c.hidden_size,
            heads: c.num_heads,
            head_dim: c.head_dim,
            inter: c.intermediate_size,
            block: c.block_size,
            vocab: c.vocab_size,
            eps: c.rms_norm_eps,
            theta: c.rope_theta,
            fc: pack(&[&self.fc_t])?,
            ctx_norm: self.ctx_norm.to_vec_f32()?,
            mask_embed: self.mask_embed.to_vec_f32()?,
            slot_embed: self.slot_embed.to_vec_f32()?,
            layers,
            norm: self.norm.to_vec_f32()?,
            embed: self.embed.to_vec_f32()?,
            embed_t: pack(&[&self.embed.t()?.contiguous()?])?,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &BlockDrafterConfig {
        &self.cfg
    }

    /// Projects concatenated taps `[T, taps * D_target]` to context features `[T, D]`.
    fn project(&self, taps: &Array) -> Result<Array> {
        fast::rms_norm(&taps.astype(Dtype::F32)?.matmul(&self.fc_t)?, Some(&self.ctx_norm), self.cfg.rms_norm_eps)
    }

    /// The context of projected taps `feats` `[C, D]` at positions `offset..offset + C`.
    fn context(&self, feats: Array, offset: i32) -> Result<MlxCtx> {
        let (h, hd) = (self.cfg.num_heads as i32, self.cfg.head_dim as i32);
        let c = feats.dim(0)?;
        let heads = |t: &Array| t.reshape(&[1, c, h, hd])?.transpose(&[0, 2, 1, 3]);
        let kv = self
            .layers
            .iter()
            .map(|l| {
                let k = fast::rope(&heads(&feats.matmul(&l.k)?)?, hd, false, Some(self.cfg.rope_theta), 1.0, offset)?;
                Ok((k, heads(&feats.matmul(&l.v)?)?))
            })
            .collect::<Result<_>>()?;
        Ok(MlxCtx { feats, kv })
    }

    /// The block's logits `[K, V]` for the context `ctx` (none: no
    /// context), the last position's features `last` `[D]`, the unrun token `token` and the block at
    /// positions `block_pos..block_pos + K`.
    fn block(&self, ctx: Option<&MlxCtx>, last: &Array, token: u32, block_pos: i32) -> Result<Array> {
        let (kk, d) = (self.cfg.block_size as i32, self.cfg.hidden_size as i32);
        let (h, hd) = (self.cfg.num_heads as i32, self.cfg.head_dim as i32);
        let eps = self.cfg.rms_norm_eps;
        let tok = self.embed.take(&Array::from_slice(&[token], &[1])?, 0)?;
        let mut slots = vec![tok];
        if kk > 1 {
            slots.push(self.mask_embed.reshape(&[1, d])?.broadcast_to(&[kk - 1, d])?);
        }
        let slot_in = ops::concatenate(&slots.iter().collect::<Vec<_>>(), 0)?;
        let mut x = slot_in.add(&self.slot_embed)?.add(&last.reshape(&[1, d])?)?; // [K, D]
        let heads = |t: &Array| -> Result<Array> {
            let n = t.dim(0)?;
            t.reshape(&[1, n, h, hd])?.transpose(&[0, 2, 1, 3])
        };
        let rope = |t: &Array, offset: i32| fast::rope(t, hd, false, Some(self.cfg.rope_theta), 1.0, offset);
        for (li, l) in self.layers.iter().enumerate() {
            let xn = fast::rms_norm(&x, Some(&l.attn_norm), eps)?;
            let q = rope(&heads(&xn.matmul(&l.q)?)?, block_pos)?;
            let kb = rope(&heads(&xn.matmul(&l.k)?)?, block_pos)?;
            let vb = heads(&xn.matmul(&l.v)?)?;
            let (k, v) = match ctx {
                Some(c) => {
                    let (kc, vc) = &c.kv[li];
                    (ops::concatenate(&[kc, &kb], 2)?, ops::concatenate(&[vc, &vb], 2)?)
                }
                None => (kb, vb),
            };
            let scale = 1.0 / (hd as f32).sqrt();
            let o = fast::scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::None, None)?;
            let o = o.transpose(&[0, 2, 1, 3])?.reshape(&[kk, h * hd])?;
            x = x.add(&o.matmul(&l.o)?)?;
            let y = fast::rms_norm(&x, Some(&l.mlp_norm), eps)?;
            let g = y.matmul(&l.gate)?;
            x = x.add(&g.silu()?.multiply(&y.matmul(&l.up)?)?.matmul(&l.down)?)?;
        }
        fast::rms_norm(&x, Some(&self.norm), eps)?.matmul(&self.embed.t()?)
    }

    /// The block's logits `[K, V]` for the target's taps `[T, taps * D_target]` (positions `0..T`, in
    /// `tap_layers` order) and the unrun token at position `T`: what the parity test compares with the
    /// training script's reference.
    pub fn logits_for_taps(&self, taps: &Array, token: u32) -> Result<Array> {
        let t = taps.dim(0)?;
        if let Some(hb) = &self.host {
            let (t, d) = (t as usize, hb.d);
            let ctx = hb.context(hb.project(&taps.astype(Dtype::F32)?.to_vec_f32()?, t), 0);
            let last = ctx.feats[(t - 1) * d..].to_vec();
            let logits = hb.block(Some(&ctx), &last, token, t);
            return Array::from_slice(&logits, &[hb.block as i32, hb.vocab as i32]);
        }
        let ctx = self.context(self.project(taps)?, 0)?;
        let last = ctx.feats.slice_axis(0, t - 1, t)?.squeeze(&[0])?;
        self.block(Some(&ctx), &last, token, t)
    }

    /// Forgets the context (a new sequence follows).
    pub fn reset(&mut self) {
        self.pending.clear();
        self.ctx = None;
        self.ctx_start = 0;
        self.tokens.clear();
    }

    fn ctx_end(&self) -> usize {
        self.tokens.len()
    }

    /// Projects the taps observed since the last call and appends them to the context window.
    fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let rows: usize = self.pending.iter().map(|(n, _)| n).sum();
        let offset = self.ctx_end() - rows;
        let new = match &self.host {
            Some(hb) => Ctx::Host(hb.context(hb.project(&self.pending_taps_host()?, rows), offset)),
            None => Ctx::Mlx(self.context(self.project(&self.pending_taps_mlx()?)?, offset as i32)?),
        };
        self.pending.clear();
        let w = self.cfg.context_window;
        let (d, kw) = (self.cfg.hidden_size, self.cfg.num_heads * self.cfg.head_dim);
        let mut ctx = match (self.ctx.take(), new) {
            (Some(Ctx::Mlx(c)), Ctx::Mlx(n)) => Ctx::Mlx(c.append(&n)?),
            (Some(Ctx::Host(mut c)), Ctx::Host(n)) => {
                c.append(n);
                Ctx::Host(c)
            }
            (_, n) => n,
        };
        let c = match &ctx {
            Ctx::Mlx(m) => m.len()? as usize,
            Ctx::Host(h) => h.len(d),
        };
        if c > w {
            self.ctx_start += c - w;
            match &mut ctx {
                Ctx::Mlx(m) => *m = m.rows((c - w) as i32, c as i32)?,
                Ctx::Host(h) => h.keep_rows(c - w, c, d, kw),
            }
        }
        self.ctx = Some(ctx);
        Ok(())
    }

    /// The pending taps as one MLX array `[rows, taps * D_target]`.
    fn pending_taps_mlx(&self) -> Result<Array> {
        let d = self.cfg.target_hidden_size as i32;
        let mut layers = Vec::with_capacity(self.cfg.tap_layers.len());
        for l in 0..self.cfg.tap_layers.len() {
            let pieces: Vec<Array> = self
                .pending
                .iter()
                .map(|(n, t)| {
                    let r = t[l].reshape(&[-1, d])?;
                    if r.dim(0)? as usize > *n {
                        r.slice_axis(0, 0, *n as i32)
                    } else {
                        Ok(r)
                    }
                })
                .collect::<Result<_>>()?;
            layers.push(if pieces.len() == 1 {
                pieces.into_iter().next().unwrap_or_else(|| unreachable!())
            } else {
                ops::concatenate(&pieces.iter().collect::<Vec<_>>(), 0)?
            });
        }
        ops::concatenate(&layers.iter().collect::<Vec<_>>(), 1)
    }

    /// The pending taps on the host, `[rows, taps * D_target]` row-major (no MLX operation: each tap is
    /// read as the target's forward left it).
    fn pending_taps_host(&self) -> Result<Vec<f32>> {
        let d = self.cfg.target_hidden_size;
        let nt = self.cfg.tap_layers.len();
        let mut out = Vec::new();
        for (n, taps) in &self.pending {
            let data: Vec<Vec<f32>> = taps.iter().map(|t| t.to_vec_f32()).collect::<Result<_>>()?;
            for r in 0..*n {
                for l in 0..nt {
                    let row = data[l].get(r * d..(r + 1) * d).ok_or_else(|| {
                        Error::invalid("block drafter", format!("a tap holds fewer than {n} positions"))
                    })?;
                    out.extend_from_slice(row);
                }
            }
        }
        Ok(out)
    }

    /// Keeps what is known of positions `< pos` only.
    fn truncate(&mut self, pos: usize) -> Result<()> {
        if pos >= self.ctx_end() {
            return Ok(());
        }
        self.flush()?;
        if pos <= self.ctx_start {
            self.ctx = None;
            self.ctx_start = pos;
        } else if let Some(c) = &mut self.ctx {
            let keep = pos - self.ctx_start;
            let (d, kw) = (self.cfg.hidden_size, self.cfg.num_heads * self.cfg.head_dim);
            match c {
                Ctx::Mlx(m) => *m = m.rows(0, keep as i32)?,
                Ctx::Host(h) => h.keep_rows(0, keep, d, kw),
            }
        }
        self.tokens.truncate(pos);
        Ok(())
    }
}

impl Drafter for BlockDrafter {
    fn tap_layers(&self) -> Vec<usize> {
        self.cfg.tap_layers.clone()
    }

    fn observe(&mut self, start: usize, tokens: &[u32], taps: &[Array]) -> Result<()> {
        if taps.len() != self.cfg.tap_layers.len() {
            return Err(Error::invalid(
                "block drafter",
                format!("{} taps given, {} expected", taps.len(), self.cfg.tap_layers.len()),
            ));
        }
        if tokens.is_empty() {
            return Ok(());
        }
        let n = taps[0].size() / self.cfg.target_hidden_size;
        if n < tokens.len() {
            return Err(Error::invalid("block drafter", format!("taps of {n} positions for {} tokens", tokens.len())));
        }
        // Drop what this overwrites; a gap (positions never observed) starts the context afresh.
        if start > self.ctx_end() {
            self.pending.clear();
            self.ctx = None;
            self.ctx_start = start;
            self.tokens.resize(start, u32::MAX);
        } else {
            self.truncate(start)?;
        }
        self.tokens.extend_from_slice(tokens);
        // Kept as they are (no operation per plain decode step); projected in one batch before drafting.
        self.pending.push((tokens.len(), taps.to_vec()));
        Ok(())
    }

    fn propose(&mut self, context: &[u32], k: usize, sampler: &Sampler, rng: &mut SplitMix64) -> Result<Draft> {
        let k = k.min(self.cfg.block_size);
        if context.is_empty() || k == 0 {
            return Ok(Draft::default());
        }
        let n = context.len() - 1;
        let token = context[n];
        // Context features count only where they are of this context's positions < n: keep the longest
        // observed prefix that agrees with it (unknown positions agree with anything).
        let agree = self.tokens.iter().zip(&context[..n]).take_while(|(a, b)| **a == **b || **a == u32::MAX).count();
        self.truncate(agree)?;
        self.flush()?;
        // The last position's features when the context reaches it (else zeros, as in training).
        let at_end = self.ctx_end() == n;
        let logits = match (&self.host, &self.ctx) {
            (Some(hb), ctx) => {
                let ctx = match ctx {
                    Some(Ctx::Host(c)) => Some(c),
                    _ => None,
                };
                let d = hb.d;
                let last = match ctx {
                    Some(c) if at_end => c.feats[(c.len(d) - 1) * d..].to_vec(),
                    _ => vec![0.0; d],
                };
                Logits::Host { data: hb.block(ctx, &last, token, n), vocab: hb.vocab }
            }
            (None, ctx) => {
                let ctx = match ctx {
                    Some(Ctx::Mlx(c)) => Some(c),
                    _ => None,
                };
                let d = self.cfg.hidden_size as i32;
                let last = match ctx {
                    Some(c) if at_end => {
                        let cn = c.len()?;
                        c.feats.slice_axis(0, cn - 1, cn)?.squeeze(&[0])?
                    }
                    _ => ops::zeros(&[d], Dtype::F32)?,
                };
                Logits::Mlx(self.block(ctx, &last, token, n as i32)?)
            }
        };
        let recent = RecentTokens::new(sampler.config(), &[])?;
        if sampler.config().temperature == 0.0 {
            return Ok(Draft { tokens: logits.argmax_rows(k)?, probs: None });
        }
        let mut tokens = Vec::with_capacity(k);
        let mut probs = Vec::with_capacity(k);
        for i in 0..k {
            let row = logits.row(i)?;
            let lp = crate::kernels::log_softmax(&sampler.process_recent(&row, &recent)?)?;
            let q = sampler.distribution(&lp)?.to_vec::<f32>()?;
            tokens.push(rng.draw(&q));
            probs.push(q);
        }
        Ok(Draft { tokens, probs: Some(probs) })
    }

    fn name(&self) -> String {
        "block drafter".into()
    }
}

/// A drafter for `--draft-model DIR`: the block drafter when `DIR/config.json` says
/// `k3_block_drafter`, else a separate draft model loaded with `load`.
pub fn load_drafter(dir: &Path, target: &KimiK3, load: crate::model::LoadOptions) -> Result<Box<dyn Drafter>> {
    if BlockDrafterConfig::is_block_drafter(dir) {
        return Ok(Box::new(BlockDrafter::load(dir, target)?));
    }
    let model = KimiK3::load(dir, load)?;
    Ok(Box::new(super::speculative::DraftModel::new(model, target.config().vocab_size)?))
}

/// The `--draft-model` value that selects the MTP layer of the model's own checkpoint
/// ([`super::mtp_drafter::MtpDrafter`]); a folder of that name is given as `./mtp`.
pub const MTP: &str = "mtp";

/// The drafter of a `--draft-model` value: [`MTP`] (the MTP layer of `target`'s checkpoint `target_dir`),
/// else [`load_drafter`] of the folder.
pub fn drafter_for(
    value: &Path,
    target_dir: &Path,
    target: &KimiK3,
    load: crate::model::LoadOptions,
) -> Result<Box<dyn Drafter>> {
    if value.as_os_str() == MTP {
        return Ok(Box::new(super::mtp_drafter::MtpDrafter::load(target_dir, target)?));
    }
    load_drafter(value, target, load)
}
