//! The Kimi K3 text model (mlx-lm `KimiK3DecoderLayer`, `KimiK3TextModel`, `LanguageModel`): embedding,
//! KDA or MLA attention per layer, dense or sparse FFN, optional attention residuals, final norm, head.

use std::path::Path;
use std::sync::Arc;

use super::attn_res::{load_w_eff, ResidualBlocks};
use super::cache::{KdaCache, KvCache, LayerCache, ModelCache};
use super::config::{ModelConfig, TextConfig};
use super::kda::Kda;
use super::linear::{Embedding, Linear, RmsNorm};
use super::loader::read_weights;
use super::mla::Mla;
use super::moe::{Ffn, Mlp, SparseMoe};
use super::shard::{Comm, Shard};
use super::weights::{TensorRecord, WeightStore};
use crate::{ops, Array, Device, Dtype, Error, Result};

#[derive(Debug)]
enum Attention {
    Kda(Kda),
    Mla(Mla),
}

#[derive(Debug)]
struct AttnRes {
    block_start: bool,
    attn_w: Array,
    mlp_w: Array,
}

/// One decoder layer (attention, FFN, norms, attention-residual weights), as [`KimiK3::build_layer`] makes
/// it for layer-wise tools.
#[derive(Debug)]
pub struct DecoderLayer {
    attn: Attention,
    ffn: Ffn,
    input_norm: RmsNorm,
    post_norm: RmsNorm,
    res: Option<AttnRes>,
}

impl DecoderLayer {
    pub(super) fn load(ws: &mut WeightStore, i: usize, cfg: &TextConfig, shard: Option<Shard>) -> Result<DecoderLayer> {
        let lp = format!("model.layers.{i}");
        let d = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let attn = if cfg.is_kda(i) {
            Attention::Kda(Kda::load(ws, &format!("{lp}.self_attn"), cfg, shard)?)
        } else {
            Attention::Mla(Mla::load(ws, &format!("{lp}.self_attn"), cfg, shard)?)
        };
        let ffn = if cfg.is_moe(i) {
            Ffn::Moe(SparseMoe::load(ws, &format!("{lp}.mlp"), cfg, shard)?)
        } else {
            // Tensor parallel splits the dense MLP's intermediate units like the shared experts'.
            let units = match shard {
                Some(s) if s.tp && s.size > 1 => {
                    Some(s.even_range(cfg.intermediate_size, &format!("{lp}.mlp: intermediate units"))?)
                }
                _ => None,
            };
            Ffn::Dense(Mlp::load_split(ws, &format!("{lp}.mlp"), cfg, cfg.intermediate_size, units)?)
        };
        let res = match cfg.attn_res_block_size {
            Some(bs) => Some(AttnRes {
                block_start: i % bs == 0,
                attn_w: load_w_eff(ws, &format!("{lp}.self_attention_res"), d, eps)?,
                mlp_w: load_w_eff(ws, &format!("{lp}.mlp_res"), d, eps)?,
            }),
            None => None,
        };
        Ok(DecoderLayer {
            attn,
            ffn,
            input_norm: RmsNorm::load(ws, &format!("{lp}.input_layernorm"), d, eps)?,
            post_norm: RmsNorm::load(ws, &format!("{lp}.post_attention_layernorm"), d, eps)?,
            res,
        })
    }

    fn attend(
        &self,
        x: &Array,
        mask: Option<&Array>,
        cache: Option<&mut LayerCache>,
        comm: Option<&Comm>,
    ) -> Result<Array> {
        match (&self.attn, cache) {
            (Attention::Kda(a), Some(LayerCache::Kda(c))) => a.forward(x, Some(c), comm),
            (Attention::Kda(a), None) => a.forward(x, None, comm),
            (Attention::Mla(a), Some(LayerCache::Mla(c))) => a.forward(x, mask, Some(c), comm),
            (Attention::Mla(a), None) => a.forward(x, mask, None, comm),
            _ => Err(Error::invalid("forward", "the cache does not match the layer types (made for another model?)")),
        }
    }

    pub(super) fn forward(
        &self,
        x: &Array,
        mask: Option<&Array>,
        cache: Option<&mut LayerCache>,
        blocks: &mut Option<ResidualBlocks>,
        comm: Option<&Comm>,
    ) -> Result<Array> {
        let (res, blocks) = match (&self.res, blocks.as_mut()) {
            (Some(r), Some(b)) => (r, b),
            _ => {
                let h = x.add(&self.attend(&self.input_norm.forward(x)?, mask, cache, comm)?)?;
                return h.add(&self.ffn.forward(&self.post_norm.forward(&h)?, comm)?);
            }
        };
        let h = blocks.mix(x, &res.attn_w)?;
        let mut partial = Some(x.clone());
        if res.block_start {
            blocks.append(x)?;
            partial = None;
        }
        let y = self.attend(&self.input_norm.forward(&h)?, mask, cache, comm)?;
        let partial = match partial {
            Some(p) => p.add(&y)?,
            None => y,
        };
        let h = blocks.mix(&partial, &res.mlp_w)?;
        partial.add(&self.ffn.forward(&self.post_norm.forward(&h)?, comm)?)
    }
}

/// A loaded Kimi K3 text model.
#[derive(Debug)]
pub struct KimiK3 {
    config: TextConfig,
    dtype: Dtype,
    embed: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    output_res: Option<Array>,
    lm_head: Option<Linear>,
    records: Vec<TensorRecord>,
    shard: Option<Shard>,
    comm: Option<Arc<Comm>>,
}

/// Options of [`KimiK3::load`].
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Activation dtype; default f32 on the CPU (MLX's CPU bf16 path is ~10x slower), bf16 on a GPU.
    pub dtype: Option<Dtype>,
    /// Leave the weights unevaluated (read from disk at first use); by default each layer is evaluated as
    /// it is built.
    pub lazy: bool,
    /// Load only this rank's part of a model split over several ranks (see [`super::shard`]). Such a model
    /// runs once [`KimiK3::set_comm`] gave it the group's communicator.
    pub shard: Option<Shard>,
}

impl KimiK3 {
    /// The default activation dtype on `device`.
    pub fn default_dtype(device: Device) -> Dtype {
        match device {
            Device::Cpu => Dtype::F32,
            Device::Gpu => Dtype::BF16,
        }
    }

    /// Loads the checkpoint in `dir` (config.json + model*.safetensors, mlx-lm or release names). Files are
    /// opened lazily and each layer is evaluated as it is built (unless `lazy`), so sanitize steps (stacking
    /// experts, splitting kv_b_proj) hold at most one layer's sources beside the model, never a second copy
    /// of it.
    pub fn load(dir: &Path, opts: LoadOptions) -> Result<KimiK3> {
        let cfg = ModelConfig::load(dir)?;
        KimiK3::load_with_config(dir, &cfg, opts, &mut |_, _| {})
    }

    /// [`KimiK3::load`] with a parsed config and a progress callback `(layers done, layers total)`.
    pub fn load_with_config(
        dir: &Path,
        cfg: &ModelConfig,
        opts: LoadOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<KimiK3> {
        let t = &cfg.text;
        let dtype = match opts.dtype {
            Some(d) => d,
            None => KimiK3::default_dtype(Device::default_device()?),
        };
        if !dtype.is_float() {
            return Err(Error::invalid("load", format!("activation dtype must be a float type, not {dtype}")));
        }
        let shard = opts.shard.filter(|s| s.size > 1);
        let experts = match (shard, t.num_experts) {
            (Some(s), Some(e)) if e >= s.size => Some(s.range_of(e)),
            _ => None,
        };
        let raw = read_weights(dir, t, experts)?;
        let mut ws = WeightStore::new(raw, cfg.quantization.clone(), dtype, dir);
        ws.set_direct_reads(!opts.lazy);
        let (d, v) = (t.hidden_size, t.vocab_size);
        let checkpoint = |ws: &mut WeightStore| if opts.lazy { Ok(ws.keep_lazy()) } else { ws.materialize() };
        let embed = Embedding::load(&mut ws, "model.embed_tokens", v, d)?;
        checkpoint(&mut ws)?;
        let n = t.num_hidden_layers;
        let mut layers = Vec::with_capacity(n);
        for i in 0..n {
            let layer = DecoderLayer::load(&mut ws, i, t, shard)?;
            checkpoint(&mut ws)?;
            layers.push(layer);
            progress(i + 1, n);
        }
        let norm = RmsNorm::load(&mut ws, "model.norm", d, t.rms_norm_eps)?;
        let output_res = match t.attn_res_block_size {
            Some(_) => Some(load_w_eff(&mut ws, "model.output_attn_res", d, t.rms_norm_eps)?),
            None => None,
        };
        let lm_head = if t.tie_word_embeddings { None } else { Some(Linear::load(&mut ws, "lm_head", d, v)?) };
        checkpoint(&mut ws)?;
        let records = ws.finish()?;
        Ok(KimiK3 { config: t.clone(), dtype, embed, layers, norm, output_res, lm_head, records, shard, comm: None })
    }

    /// A model with random weights (seeded) for `cfg`, and the tensors it was made of under mlx-lm's names
    /// (without the `language_model.` prefix): save them with a config.json to get a random checkpoint.
    pub fn random(cfg: &TextConfig, seed: u64) -> Result<(KimiK3, std::collections::BTreeMap<String, Array>)> {
        KimiK3::fabricate(cfg, WeightStore::fabricating(seed, Dtype::F32)?)
    }

    /// The unquantized shape of every tensor the model graph of `cfg` takes, under mlx-lm's names (without
    /// the `language_model.` prefix; a weight's shape is `[..., out, in]` under `{path}.weight`). Reads and
    /// allocates no weights, so it also answers for full-size configurations: tools use it to tell a packed
    /// tensor's input dimension from config.json.
    pub fn weight_shapes(cfg: &TextConfig) -> Result<std::collections::BTreeMap<String, Vec<i32>>> {
        let (_, tensors) = KimiK3::fabricate(cfg, WeightStore::probing()?)?;
        Ok(tensors.into_iter().map(|(k, a)| (k, a.shape())).collect())
    }

    fn fabricate(cfg: &TextConfig, mut ws: WeightStore) -> Result<(KimiK3, std::collections::BTreeMap<String, Array>)> {
        cfg.validate()?;
        let (d, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed = Embedding::load(&mut ws, "model.embed_tokens", v, d)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::load(&mut ws, i, cfg, None))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(&mut ws, "model.norm", d, cfg.rms_norm_eps)?;
        let output_res = match cfg.attn_res_block_size {
            Some(_) => Some(load_w_eff(&mut ws, "model.output_attn_res", d, cfg.rms_norm_eps)?),
            None => None,
        };
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(Linear::load(&mut ws, "lm_head", d, v)?) };
        let tensors = ws.fabricated().cloned().unwrap_or_default();
        let records = ws.records().to_vec();
        Ok((
            KimiK3 {
                config: cfg.clone(),
                dtype: Dtype::F32,
                embed,
                layers,
                norm,
                output_res,
                lm_head,
                records,
                shard: None,
                comm: None,
            },
            tensors,
        ))
    }

    /// The token embedding (shared with a multi-token-prediction layer that stores none of its own).
    pub(super) fn embedding(&self) -> &Embedding {
        &self.embed
    }

    /// The output head (None: tied to the embedding).
    pub(super) fn lm_head(&self) -> Option<&Linear> {
        self.lm_head.as_ref()
    }

    /// The text config.
    pub fn config(&self) -> &TextConfig {
        &self.config
    }

    /// The activation dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The part of a split model this is (None: the whole model).
    pub fn shard(&self) -> Option<Shard> {
        self.shard
    }

    /// The communicator a split model runs its collectives through.
    pub fn comm(&self) -> Option<&Arc<Comm>> {
        self.comm.as_ref()
    }

    /// Gives a model loaded with [`LoadOptions::shard`] the group it was split over; its rank, size and
    /// tensor-parallel setting must be the ones it was loaded for.
    pub fn set_comm(&mut self, comm: Arc<Comm>) -> Result<()> {
        match self.shard {
            Some(s) if s == comm.shard() => {
                self.comm = Some(comm);
                Ok(())
            }
            s => Err(Error::invalid(
                "distributed",
                format!("the model was loaded as {s:?} but the group is {:?}", comm.shard()),
            )),
        }
    }

    /// Every weight of the model: path, parameters, bytes and quantization.
    pub fn tensor_records(&self) -> &[TensorRecord] {
        &self.records
    }

    /// Fresh caches for one sequence.
    pub fn make_cache(&self) -> ModelCache {
        ModelCache {
            layers: self
                .layers
                .iter()
                .map(|l| match l.attn {
                    Attention::Kda(_) => LayerCache::Kda(KdaCache::default()),
                    Attention::Mla(_) => LayerCache::Mla(KvCache::default()),
                })
                .collect(),
        }
    }

    /// Logits `[B, T, vocab]` for token ids `[B, T]` (int32/uint32), continuing from `cache` when given
    /// (the cache is updated), else a fresh causal forward.
    pub fn forward(&self, ids: &Array, cache: Option<&mut ModelCache>) -> Result<Array> {
        let h = self.embed_tokens(ids)?;
        Ok(self.run_layers(h, cache, &[])?.0)
    }

    /// The token embeddings `[B, T, D]` of ids `[B, T]`: what [`KimiK3::forward`] feeds its first layer.
    /// Multimodal prompts replace some rows (image placeholders) before [`KimiK3::forward_embeddings`].
    pub fn embed_tokens(&self, ids: &Array) -> Result<Array> {
        if ids.ndim() != 2 {
            return Err(Error::invalid("forward", format!("token ids must be [batch, tokens], got {:?}", ids.shape())));
        }
        self.embed.forward(ids)
    }

    /// Logits `[B, T, vocab]` for input embeddings `[B, T, D]` (as [`KimiK3::embed_tokens`] returns them,
    /// possibly with rows replaced), continuing from `cache` when given.
    pub fn forward_embeddings(&self, h: &Array, cache: Option<&mut ModelCache>) -> Result<Array> {
        Ok(self.run_layers(h.clone(), cache, &[])?.0)
    }

    /// [`KimiK3::forward`] that also returns the hidden states `[B, T, D]` leaving each decoder layer of
    /// `taps` (0-based layer indices, in the order given): what a drafter conditioned on the target's
    /// hidden states reads.
    pub fn forward_with_taps(
        &self,
        ids: &Array,
        cache: Option<&mut ModelCache>,
        taps: &[usize],
    ) -> Result<(Array, Vec<Array>)> {
        if let Some(&bad) = taps.iter().find(|&&t| t >= self.layers.len()) {
            return Err(Error::invalid(
                "forward",
                format!("tap layer {bad} is out of range ({} layers)", self.layers.len()),
            ));
        }
        let h = self.embed_tokens(ids)?;
        self.run_layers(h, cache, taps)
    }

    fn run_layers(
        &self,
        mut h: Array,
        mut cache: Option<&mut ModelCache>,
        taps: &[usize],
    ) -> Result<(Array, Vec<Array>)> {
        if h.ndim() != 3 || h.dim(2)? != self.config.hidden_size as i32 {
            return Err(Error::invalid(
                "forward",
                format!("input embeddings must be [batch, tokens, {}], got {:?}", self.config.hidden_size, h.shape()),
            ));
        }
        if let Some(c) = cache.as_deref() {
            if c.layers.len() != self.layers.len() {
                return Err(Error::invalid("forward", "the cache was made for a model with another layer count"));
            }
        }
        if self.shard.is_some() && self.comm.is_none() {
            return Err(Error::invalid("forward", "a model split over ranks needs its group (KimiK3::set_comm)"));
        }
        let t = h.dim(1)?;
        // The causal mask for MLA layers (mlx-lm: from the first MLA layer's cache offset, None for one token).
        let offset = cache
            .as_deref()
            .and_then(|c| c.layers.iter().find(|l| matches!(l, LayerCache::Mla(_))).map(LayerCache::offset))
            .unwrap_or(0) as i32;
        let mask = if t > 1 { Some(causal_mask(t, offset)?) } else { None };
        let mut blocks = self.output_res.as_ref().map(|_| ResidualBlocks::new(self.config.rms_norm_eps));
        let mut tapped: Vec<Option<Array>> = vec![None; taps.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            let c = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            h = layer.forward(&h, mask.as_ref(), c, &mut blocks, self.comm.as_deref())?;
            for (slot, _) in taps.iter().enumerate().filter(|(_, &t)| t == i) {
                tapped[slot] = Some(h.clone());
            }
        }
        if let (Some(w), Some(b)) = (&self.output_res, &blocks) {
            h = b.mix(&h, w)?;
        }
        let h = self.norm.forward(&h)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(&h)?,
            None => self.embed.as_linear(&h)?,
        };
        let tapped = tapped
            .into_iter()
            .map(|t| t.ok_or_else(|| Error::invalid("forward", "a tap layer was not reached")))
            .collect::<Result<Vec<_>>>()?;
        Ok((logits, tapped))
    }
}

/// The activations between decoder layers of a cache-less forward: the hidden states `[B, T, D]`, the
/// attention-residual block snapshots (when the model has them) and the causal mask. Layer-wise tools
/// ([`crate::compress::dwq`]) run a model one layer at a time with it.
#[derive(Clone, Debug)]
pub struct LayerState {
    /// Hidden states `[B, T, D]` leaving the last layer run (the embeddings before the first).
    pub h: Array,
    blocks: Option<ResidualBlocks>,
    mask: Option<Array>,
}

impl LayerState {
    /// Every array the state holds (to evaluate it).
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = vec![&self.h];
        if let Some(b) = &self.blocks {
            v.extend(b.arrays());
        }
        v
    }
}

impl KimiK3 {
    /// The state entering layer 0 for token ids `[B, T]` (a fresh, cache-less forward).
    pub fn embed_state(&self, ids: &Array) -> Result<LayerState> {
        if ids.ndim() != 2 {
            return Err(Error::invalid("forward", format!("token ids must be [batch, tokens], got {:?}", ids.shape())));
        }
        if self.shard.is_some() {
            return Err(Error::invalid("forward", "layer-wise forwards take a whole model, not a split one"));
        }
        let h = self.embed.forward(ids)?;
        let t = h.dim(1)?;
        let mask = if t > 1 { Some(causal_mask(t, 0)?) } else { None };
        let blocks = self.output_res.as_ref().map(|_| ResidualBlocks::new(self.config.rms_norm_eps));
        Ok(LayerState { h, blocks, mask })
    }

    /// Runs decoder layer `i` (or `layer` in its place, built by [`KimiK3::build_layer`] for index `i`) on
    /// `state`; the result is the state entering layer `i + 1`. A chain of these from
    /// [`KimiK3::embed_state`] followed by [`KimiK3::head`] is [`KimiK3::forward`] without a cache.
    pub fn layer_forward(&self, i: usize, layer: Option<&DecoderLayer>, state: &LayerState) -> Result<LayerState> {
        let own = self.layers.get(i).ok_or_else(|| {
            Error::invalid("forward", format!("layer {i} is out of range ({} layers)", self.layers.len()))
        })?;
        let mut blocks = state.blocks.clone();
        let h = layer.unwrap_or(own).forward(&state.h, state.mask.as_ref(), None, &mut blocks, None)?;
        Ok(LayerState { h, blocks, mask: state.mask.clone() })
    }

    /// The logits `[B, T, vocab]` for the state leaving the last layer.
    pub fn head(&self, state: &LayerState) -> Result<Array> {
        let mut h = state.h.clone();
        if let (Some(w), Some(b)) = (&self.output_res, &state.blocks) {
            h = b.mix(&h, w)?;
        }
        let h = self.norm.forward(&h)?;
        match &self.lm_head {
            Some(head) => head.forward(&h),
            None => self.embed.as_linear(&h),
        }
    }

    /// Builds decoder layer `i` of this model's architecture from `tensors` (sanitized names,
    /// `model.layers.{i}.*`, as the checkpoint stores them; quantized per `quant`). Nothing is evaluated, so
    /// the tensors may be traced inputs of a transform: the layer's output is then differentiable with
    /// respect to them (build and run it inside [`crate::kernels::differentiable_scope`]). Errors name
    /// `dir`.
    pub fn build_layer(
        &self,
        i: usize,
        tensors: std::collections::BTreeMap<String, Array>,
        quant: &super::config::QuantizationConfig,
        dir: &Path,
    ) -> Result<DecoderLayer> {
        if i >= self.layers.len() {
            return Err(Error::invalid(
                "build_layer",
                format!("layer {i} is out of range ({} layers)", self.layers.len()),
            ));
        }
        let raw = super::loader::RawWeights { tensors, ..Default::default() };
        let mut ws = WeightStore::new(raw, quant.clone(), self.dtype, dir);
        ws.set_direct_reads(false);
        let layer = DecoderLayer::load(&mut ws, i, &self.config, None)?;
        if let Some((name, _)) = ws.remaining().next() {
            return Err(Error::Format {
                path: dir.to_path_buf(),
                message: format!("tensor '{name}' is not used by decoder layer {i}"),
            });
        }
        Ok(layer)
    }

    /// Puts `layer` (built by [`KimiK3::build_layer`] for index `i`) in place of layer `i`; returns the old one.
    pub fn replace_layer(&mut self, i: usize, layer: DecoderLayer) -> Result<DecoderLayer> {
        let n = self.layers.len();
        let slot = self
            .layers
            .get_mut(i)
            .ok_or_else(|| Error::invalid("replace_layer", format!("layer {i} is out of range ({n} layers)")))?;
        Ok(std::mem::replace(slot, layer))
    }
}

/// `mask[i][j] = (offset + i) >= j` for `t` queries over `offset + t` keys.
pub(super) fn causal_mask(t: i32, offset: i32) -> Result<Array> {
    let rows = ops::arange(offset as f64, (offset + t) as f64, 1.0, Dtype::I32)?.expand_dims(&[1])?;
    let cols = ops::arange(0.0, (offset + t) as f64, 1.0, Dtype::I32)?.expand_dims(&[0])?;
    rows.greater_equal(&cols)
}
