//! The multi-token-prediction (MTP) layer that DeepSeek-V3-family checkpoints carry (DeepSeek-V3 technical
//! report, section 2.2): `model.layers.{num_hidden_layers}` of a checkpoint whose config sets
//! `num_nextn_predict_layers`. [`crate::generate::mtp_drafter`] drafts with it.
//!
//! For position `i`, given the model's hidden state `h_i` leaving its last decoder layer (before the final
//! norm) and token `t_{i+1}`:
//!
//! ```text
//! x_i = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))      (embedding first, as vLLM and SGLang)
//! o_i = decoder_layer(x_i)                                      (its own MLA cache over the positions)
//! logits_i = shared_head.head(shared_head.norm(o_i))            (predicts t_{i+2})
//! ```
//!
//! The decoder layer is an ordinary DeepSeek-V3 layer of index `num_hidden_layers` (MoE or dense by the
//! config's rule), loaded by the same code as the model's, from Hugging Face or mlx-lm names, float or
//! quantized as the checkpoint stores it. The embedding and the output head are the model's: the report
//! shares both with the main model, and the copies DeepSeek-V3's checkpoint stores in the layer
//! (`embed_tokens`, `shared_head.head`, identical to the model's) are not read, as SGLang does not (vLLM
//! loads them), which saves two vocabulary-sized matrices.

use std::path::Path;

use super::cache::LayerCache;
use super::config::{Family, ModelConfig};
use super::linear::{Embedding, Linear, RmsNorm};
use super::loader::{read_weights_where, validate_safetensors, weight_files};
use super::model::{causal_mask, DecoderLayer};
use super::weights::{TensorRecord, WeightStore};
use super::KimiK3;
use crate::{ops, Array, Error, Result};

/// `num_nextn_predict_layers` of a config (top level, or under `text_config` for `kimi_k25`); 0 when absent.
pub fn mtp_layer_count(cfg: &ModelConfig) -> usize {
    let get = |v: &serde_json::Value| v.get("num_nextn_predict_layers").and_then(serde_json::Value::as_u64);
    get(&cfg.raw).or_else(|| cfg.raw.get("text_config").and_then(get)).unwrap_or(0) as usize
}

/// Whether `name` (without `language_model.`) is a tensor of MTP layer `index`.
fn in_layer(name: &str, index: usize) -> bool {
    name.strip_prefix("model.layers.")
        .and_then(|r| r.split_once('.'))
        .is_some_and(|(i, _)| i.parse::<usize>().ok() == Some(index))
}

/// How many tensors of the first MTP layer (`model.layers.{num_hidden_layers}.*`) the weight files of `dir`
/// hold (headers only).
pub fn mtp_tensor_count(dir: &Path, cfg: &ModelConfig) -> Result<usize> {
    let index = cfg.text.num_hidden_layers;
    let mut n = 0;
    for path in weight_files(dir)? {
        n += validate_safetensors(&path)?
            .keys()
            .filter(|k| in_layer(k.strip_prefix("language_model.").unwrap_or(k), index))
            .count();
    }
    Ok(n)
}

/// What stops `dir` from drafting with its MTP layer, as a sentence (None: it can).
pub fn mtp_unavailable(dir: &Path, cfg: &ModelConfig) -> Result<Option<String>> {
    if cfg.text.family != Family::DeepseekV3 {
        return Ok(Some(format!(
            "MTP layers are a DeepSeek-V3-family feature; this checkpoint is model_type '{}'",
            cfg.model_type
        )));
    }
    let layers = mtp_layer_count(cfg);
    if layers == 0 {
        return Ok(Some(format!(
            "{} sets no num_nextn_predict_layers (or 0): the checkpoint has no MTP layer",
            dir.join("config.json").display()
        )));
    }
    if mtp_tensor_count(dir, cfg)? == 0 {
        return Ok(Some(format!(
            "config.json sets num_nextn_predict_layers {layers}, but the weights hold no model.layers.{}.* \
             tensors (mlx_lm.convert drops the MTP layer)",
            cfg.text.num_hidden_layers
        )));
    }
    Ok(None)
}

/// A loaded MTP layer (see the module docs).
#[derive(Debug)]
pub struct MtpLayer {
    layer: DecoderLayer,
    enorm: RmsNorm,
    hnorm: RmsNorm,
    eh_proj: Linear,
    head_norm: RmsNorm,
    embed: Embedding,
    head: HeadKind,
    records: Vec<TensorRecord>,
}

#[derive(Debug)]
enum HeadKind {
    Linear(Linear),
    Tied(Embedding),
}

impl MtpLayer {
    /// Loads the first MTP layer of the checkpoint `dir` (the one `target` was loaded from, with config
    /// `cfg`); only its tensors are read. Errors say why a checkpoint has none ([`mtp_unavailable`]).
    /// With `num_nextn_predict_layers` above 1, the further layers are not loaded: drafts chain the first
    /// one (as vLLM and SGLang do for DeepSeek-V3, which has one).
    pub fn load(dir: &Path, cfg: &ModelConfig, target: &KimiK3) -> Result<MtpLayer> {
        if let Some(why) = mtp_unavailable(dir, cfg)? {
            return Err(Error::invalid("mtp", why));
        }
        if target.shard().is_some() {
            return Err(Error::invalid("mtp", "the MTP layer of a model split over ranks is not supported"));
        }
        let n = cfg.text.num_hidden_layers;
        let mut t = cfg.text.clone();
        t.num_hidden_layers = n + 1;
        let raw = read_weights_where(dir, &t, None, &|name| in_layer(name, n))?;
        let mut ws = WeightStore::new(raw, cfg.quantization.clone(), target.dtype(), dir);
        let (d, eps) = (t.hidden_size, t.rms_norm_eps);
        let lp = format!("model.layers.{n}");
        let layer = DecoderLayer::load(&mut ws, n, &t, None)?;
        let enorm = RmsNorm::load(&mut ws, &format!("{lp}.enorm"), d, eps)?;
        let hnorm = RmsNorm::load(&mut ws, &format!("{lp}.hnorm"), d, eps)?;
        let eh_proj = Linear::load(&mut ws, &format!("{lp}.eh_proj"), 2 * d, d)?;
        let head_norm = RmsNorm::load(&mut ws, &format!("{lp}.shared_head.norm"), d, eps)?;
        // The layer's copies of the shared embedding and head (DeepSeek-V3 stores ones identical to the
        // model's) are not read: two vocabulary-sized matrices saved, as SGLang does.
        ws.discard_prefix(&format!("{lp}.embed_tokens."));
        ws.discard_prefix(&format!("{lp}.shared_head.head."));
        let embed = target.embedding().clone();
        let head = match target.lm_head() {
            Some(h) => HeadKind::Linear(h.clone()),
            None => HeadKind::Tied(target.embedding().clone()),
        };
        ws.materialize()?;
        let records = ws.finish()?;
        Ok(MtpLayer { layer, enorm, hnorm, eh_proj, head_norm, embed, head, records })
    }

    /// The weights read for the layer (the model's shared embedding and head excluded).
    pub fn tensor_records(&self) -> &[TensorRecord] {
        &self.records
    }

    /// A fresh cache for the layer.
    pub fn make_cache(&self) -> LayerCache {
        LayerCache::Mla(Default::default())
    }

    /// Runs the layer on tokens `ids` `[1, T]` (each `t_{i+1}`) and hidden states `hidden` `[1, T, D]` (each
    /// `h_i`) at the positions following those in `cache` (updated); returns the layer's output `o` `[1, T,
    /// D]` (what a chained draft feeds back as its hidden state) and the logits `[1, T, vocab]` (each
    /// predicting `t_{i+2}`).
    pub fn forward(&self, ids: &Array, hidden: &Array, cache: &mut LayerCache) -> Result<(Array, Array)> {
        let t = ids.dim(1)?;
        if hidden.ndim() != 3 || hidden.dim(1)? != t {
            return Err(Error::invalid("mtp", format!("hidden states {:?} do not fit {t} tokens", hidden.shape())));
        }
        let e = self.enorm.forward(&self.embed.forward(ids)?)?;
        let h = self.hnorm.forward(&hidden.astype(e.dtype())?)?;
        let x = self.eh_proj.forward(&ops::concatenate(&[&e, &h], -1)?)?;
        let mask = if t > 1 { Some(causal_mask(t, cache.offset() as i32)?) } else { None };
        let o = self.layer.forward(&x, mask.as_ref(), Some(cache), &mut None, None)?;
        let hn = self.head_norm.forward(&o)?;
        let logits = match &self.head {
            HeadKind::Linear(l) => l.forward(&hn)?,
            HeadKind::Tied(e) => e.as_linear(&hn)?,
        };
        Ok((o, logits))
    }
}
