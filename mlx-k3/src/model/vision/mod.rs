//! Vision: the image/video towers of the multimodal checkpoints and how their embeddings enter the text
//! model. The tower turns patches into embeddings of the text model's width; [`merge_features`] puts them
//! in place of the prompt's media placeholder tokens; [`crate::model::KimiK3::forward_embeddings`] runs the
//! text model on the result.

use std::path::Path;

use crate::model::ModelConfig;
use crate::ops::concatenate;
use crate::{Array, Error, Result};

pub mod moonvit3d;

pub use moonvit3d::MoonVit3d;

/// A checkpoint's vision tower and projector: images and video chunks in, embeddings of the text model's
/// width out, one row per placeholder token.
#[derive(Clone, Debug)]
pub enum VisionTower {
    /// Kimi K3's `moonvit3d` tower with the `patchmergerv2` projector.
    K3(MoonVit3d),
}

impl VisionTower {
    /// The tower of the checkpoint in `dir`, or `None` when its `config.json` describes no vision part.
    pub fn load(dir: &Path) -> Result<Option<VisionTower>> {
        let cfg = ModelConfig::load(dir)?;
        let path = dir.join("config.json");
        match (cfg.model_type.as_str(), cfg.raw.get("vision_config")) {
            ("kimi_k3", Some(v)) if !v.is_null() => {
                let vc = moonvit3d::VisionConfig::parse(v, &path)?;
                Ok(Some(VisionTower::K3(MoonVit3d::load(dir, vc, cfg.text.hidden_size)?)))
            }
            _ => Ok(None),
        }
    }

    /// Features `[tokens, D_text]` for `pixel_values` `[N, 3, p, p]` (the processor's patches, channels
    /// first) and one grid `(t, h, w)` in patches per image (`t = 1`) or video chunk, in the order the
    /// prompt's placeholders expect them.
    pub fn encode(&self, pixels: &Array, grids: &[(usize, usize, usize)]) -> Result<Array> {
        match self {
            VisionTower::K3(t) => t.encode(pixels, grids),
        }
    }

    /// Placeholder tokens one grid becomes in the prompt.
    pub fn tokens_for(&self, grid: (usize, usize, usize)) -> usize {
        match self {
            VisionTower::K3(t) => t.tokens_for(grid),
        }
    }
}

/// The placeholder token ids of a checkpoint's `config.json` (`image_token_index`, then
/// `media_placeholder_token_id`, default 163605 as mlx-vlm's `kimi_k3` has it): the ids
/// [`merge_features`] replaces.
pub fn placeholder_ids(cfg: &ModelConfig) -> Vec<i32> {
    let mut ids = Vec::new();
    for key in ["image_token_index", "media_placeholder_token_id"] {
        if let Some(id) = cfg.raw.get(key).and_then(|v| v.as_i64()).and_then(|v| i32::try_from(v).ok()) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    if ids.is_empty() && cfg.model_type == "kimi_k3" {
        ids.push(163605);
    }
    ids
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
