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
use crate::{ops, Array, Dtype, Error, Result};

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
struct Ctx {
    feats: Array,
    kv: Vec<(Array, Array)>,
}

impl Ctx {
    fn len(&self) -> Result<i32> {
        self.feats.dim(0)
    }

    /// Rows `a..b`.
    fn rows(&self, a: i32, b: i32) -> Result<Ctx> {
        Ok(Ctx {
            feats: self.feats.slice_axis(0, a, b)?,
            kv: self
                .kv
                .iter()
                .map(|(k, v)| Ok((k.slice_axis(2, a, b)?, v.slice_axis(2, a, b)?)))
                .collect::<Result<_>>()?,
        })
    }

    fn append(&self, more: &Ctx) -> Result<Ctx> {
        Ok(Ctx {
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
    /// Loads `dir` (config.json, model.safetensors) for `target`, checking that the two fit together.
    pub fn load(dir: &Path, target: &KimiK3) -> Result<BlockDrafter> {
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
        let drafter = BlockDrafter {
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
        Ok(drafter)
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
    fn context(&self, feats: Array, offset: i32) -> Result<Ctx> {
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
        Ok(Ctx { feats, kv })
    }

    /// The block's logits `[K, V]` for the context `ctx` (none: no
    /// context), the last position's features `last` `[D]`, the unrun token `token` and the block at
    /// positions `block_pos..block_pos + K`.
    fn block(&self, ctx: Option<&Ctx>, last: &Array, token: u32, block_pos: i32) -> Result<Array> {
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
        let rows: usize = self.pending.iter().map(|(n, _)| n).sum();
        self.pending.clear();
        let feats = self.project(&ops::concatenate(&layers.iter().collect::<Vec<_>>(), 1)?)?;
        let new = self.context(feats, (self.ctx_end() - rows) as i32)?;
        let ctx = match &self.ctx {
            Some(c) => c.append(&new)?,
            None => new,
        };
        let c = ctx.len()? as usize;
        let w = self.cfg.context_window;
        self.ctx = Some(if c > w {
            self.ctx_start += c - w;
            ctx.rows((c - w) as i32, c as i32)?
        } else {
            ctx
        });
        Ok(())
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
        } else if let Some(c) = &self.ctx {
            self.ctx = Some(c.rows(0, (pos - self.ctx_start) as i32)?);
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
        let d = self.cfg.hidden_size as i32;
        let (ctx, last, pos) = match &self.ctx {
            Some(c) => {
                let cn = c.len()?;
                let last = if self.ctx_end() == n {
                    c.feats.slice_axis(0, cn - 1, cn)?.squeeze(&[0])?
                } else {
                    ops::zeros(&[d], Dtype::F32)?
                };
                (Some(c), last, n as i32)
            }
            None => (None, ops::zeros(&[d], Dtype::F32)?, n as i32),
        };
        let logits = self.block(ctx, &last, token, pos)?;
        let recent = RecentTokens::new(sampler.config(), &[])?;
        if sampler.config().temperature == 0.0 {
            let best = logits.slice_axis(0, 0, k as i32)?.argmax(-1, false)?;
            crate::eval(&[&best])?;
            return Ok(Draft { tokens: best.to_vec::<u32>()?, probs: None });
        }
        let mut tokens = Vec::with_capacity(k);
        let mut probs = Vec::with_capacity(k);
        for i in 0..k as i32 {
            let row = logits.slice_axis(0, i, i + 1)?;
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
