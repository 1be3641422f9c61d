//! Vision: the image/video towers of the multimodal checkpoints and how their embeddings enter the text
//! model. The tower turns patches into embeddings of the text model's width; [`merge_features`] puts them
//! in place of the prompt's media placeholder tokens; [`crate::model::KimiK3::forward_embeddings`] runs the
//! text model on the result.

pub mod moonvit;
pub mod moonvit3d;

use std::path::Path;

use crate::model::config::ModelConfig;
use crate::model::weights::TensorRecord;
use crate::model::KimiK3;
use crate::ops::concatenate;
use crate::{Array, Device, Dtype, Error, Result};

/// The patch grid of one image (`t = 1`) or one video chunk (`t` frames): `t * h * w` patches, in frame,
/// then row, then column order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MediaGrid {
    /// Frames.
    pub t: usize,
    /// Patch rows.
    pub h: usize,
    /// Patch columns.
    pub w: usize,
}

impl MediaGrid {
    /// An image of `h x w` patches.
    pub fn image(h: usize, w: usize) -> MediaGrid {
        MediaGrid { t: 1, h, w }
    }

    /// A video chunk of `t` frames of `h x w` patches.
    pub fn video(t: usize, h: usize, w: usize) -> MediaGrid {
        MediaGrid { t, h, w }
    }

    /// Patches the grid covers.
    pub fn patches(&self) -> usize {
        self.t * self.h * self.w
    }
}

/// A checkpoint's vision tower with its projector: patches in, text-width features out.
#[derive(Debug)]
pub enum VisionTower {
    /// Kimi K2.5 / K2.7's MoonViT (`kimi_k25` checkpoints), see [`moonvit`].
    MoonVit(moonvit::MoonVit),
    /// Kimi K3's `moonvit3d` with the `patchmergerv2` projector (`kimi_k3` checkpoints), see [`moonvit3d`].
    MoonVit3d(moonvit3d::MoonVit3d),
}

impl VisionTower {
    /// Loads the tower of the checkpoint in `dir` with activations in `dtype` (default: the text model's
    /// default on this device); None when `config.json` has no `vision_config` or the checkpoint holds no
    /// vision tensors ([`VisionTower::present`]).
    pub fn load(dir: &Path, dtype: Option<Dtype>) -> Result<Option<VisionTower>> {
        VisionTower::load_with_config(dir, &ModelConfig::load(dir)?, dtype)
    }

    /// Whether the checkpoint in `dir` (config `cfg`) has a vision tower: a `vision_config` and tensors under
    /// the tower's prefixes. A config with `vision_config` but no such tensors (a text-only conversion) has
    /// none: the text model loads, and images are refused.
    pub fn present(dir: &Path, cfg: &ModelConfig) -> Result<bool> {
        if cfg.raw.get("vision_config").is_none_or(|v| v.is_null()) {
            return Ok(false);
        }
        crate::model::loader::has_media_tensors(dir)
    }

    /// [`VisionTower::load`] with `dir`'s config already parsed.
    pub fn load_with_config(dir: &Path, cfg: &ModelConfig, dtype: Option<Dtype>) -> Result<Option<VisionTower>> {
        if !VisionTower::present(dir, cfg)? {
            return Ok(None);
        }
        let dtype = match dtype {
            Some(d) => d,
            None => KimiK3::default_dtype(Device::default_device()?),
        };
        match cfg.model_type.as_str() {
            "kimi_k25" => Ok(moonvit::MoonVit::load(dir, cfg, dtype)?.map(VisionTower::MoonVit)),
            "kimi_k3" => Ok(moonvit3d::MoonVit3d::load(dir, cfg, dtype)?.map(VisionTower::MoonVit3d)),
            other => Err(Error::Format {
                path: dir.join("config.json"),
                message: format!("vision_config: no vision tower is implemented for model_type '{other}'"),
            }),
        }
    }

    /// The features `[tokens, D_text]` of `pixel_values` `[patches, C, p, p]` covering `grids` in order.
    pub fn encode(&self, pixel_values: &Array, grids: &[MediaGrid]) -> Result<Array> {
        match self {
            VisionTower::MoonVit(m) => m.encode(pixel_values, grids),
            VisionTower::MoonVit3d(m) => m.encode(pixel_values, grids),
        }
    }

    /// The features (placeholder tokens in the prompt) one grid gives.
    pub fn tokens_for(&self, grid: MediaGrid) -> usize {
        match self {
            VisionTower::MoonVit(m) => m.tokens_for(grid),
            VisionTower::MoonVit3d(m) => m.tokens_for(grid),
        }
    }

    /// The prompt token ids that [`merge_features`] replaces with features.
    pub fn placeholder_ids(&self) -> &[i32] {
        match self {
            VisionTower::MoonVit(m) => &m.config().placeholders,
            VisionTower::MoonVit3d(m) => m.placeholders(),
        }
    }

    /// Every weight of the tower and projector.
    pub fn tensor_records(&self) -> &[TensorRecord] {
        match self {
            VisionTower::MoonVit(m) => m.tensor_records(),
            VisionTower::MoonVit3d(m) => m.tensor_records(),
        }
    }
}

/// The input embeddings `h` `[B, T, D]` of the prompt `ids` (`B * T` token ids, row-major) with the rows at
/// placeholder tokens (any id in `placeholders`) replaced, in prompt order, by the rows of `features`
/// `[N, D]` (cast to `h`'s dtype). The number of placeholder tokens must equal `N`: a prompt whose
/// placeholders were not expanded to the image's token count is an error naming both counts.
pub fn merge_features(h: &Array, ids: &[i32], placeholders: &[i32], features: &Array) -> Result<Array> {
    let shape = h.shape();
    if shape.len() != 3 {
        return Err(Error::invalid(
            "merge_features",
            format!("embeddings must be [batch, tokens, dim], got {shape:?}"),
        ));
    }
    let (b, t, d) = (shape[0], shape[1], shape[2]);
    let rows = (b as usize) * (t as usize);
    if ids.len() != rows {
        return Err(Error::invalid(
            "merge_features",
            format!("{} token ids for embeddings of {b} x {t} positions", ids.len()),
        ));
    }
    let fshape = features.shape();
    if fshape.len() != 2 || fshape[1] != d {
        return Err(Error::invalid("merge_features", format!("media features must be [count, {d}], got {fshape:?}")));
    }
    let n = fshape[0] as usize;
    let mut index = Vec::with_capacity(rows);
    let mut k = 0usize;
    for (p, id) in ids.iter().enumerate() {
        if placeholders.contains(id) {
            index.push((rows + k) as i32);
            k += 1;
        } else {
            index.push(p as i32);
        }
    }
    if k != n {
        return Err(Error::invalid(
            "merge_features",
            format!("the prompt has {k} media placeholder tokens for {n} media features (ids {placeholders:?})"),
        ));
    }
    if n == 0 {
        return Ok(h.clone());
    }
    let flat = h.reshape(&[b * t, d])?;
    let all = concatenate(&[&flat, &features.astype(h.dtype())?], 0)?;
    let index = Array::from_vec(index, &[rows as i32])?;
    all.take(&index, 0)?.reshape(&[b, t, d])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholder_rows_take_the_features_in_order() {
        let h = Array::from_vec((0..16).map(|x| x as f32).collect::<Vec<_>>(), &[2, 4, 2]).unwrap();
        let f = Array::from_vec(vec![-1.0f32, -2.0, -3.0, -4.0, -5.0, -6.0], &[3, 2]).unwrap();
        // Placeholders 9 and 8 at flat positions 1, 3 and 6.
        let ids = [5, 9, 7, 8, 1, 2, 9, 3];
        let out = merge_features(&h, &ids, &[9, 8], &f).unwrap().to_vec::<f32>().unwrap();
        let want = [0., 1., -1., -2., 4., 5., -3., -4., 8., 9., 10., 11., -5., -6., 14., 15.];
        assert_eq!(out, want);
    }

    #[test]
    fn a_count_mismatch_names_both_counts() {
        let h = Array::from_vec(vec![0f32; 8], &[1, 4, 2]).unwrap();
        let f = Array::from_vec(vec![1f32; 2], &[1, 2]).unwrap();
        let e = merge_features(&h, &[3, 9, 9, 4], &[9], &f).unwrap_err().to_string();
        assert!(e.contains("2 media placeholder tokens for 1 media features"), "{e}");
        let wide = Array::from_vec(vec![1f32; 3], &[1, 3]).unwrap();
        assert!(merge_features(&h, &[3, 9, 1, 4], &[9], &wide).is_err());
        assert!(merge_features(&h, &[3, 9, 1], &[9], &f).is_err());
    }
}
