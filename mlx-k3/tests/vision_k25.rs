//! Kimi K2.5 / K2.7's MoonViT tower and projector against mlx-vlm 0.7.10's `kimi_k25` on the fixtures
//! `scripts/make_vision_k25_fixtures.py` made (tests/fixtures/vision_k25: a tiny random `kimi_k25`
//! checkpoint; one image, two images of different grids in one call, and a 3-frame video chunk).
//!
//! Tolerance: as for the text fixtures (tests/model.rs, tests/deepseek_v3.rs), f32 results within 1e-4 x
//! max |reference|. Both sides run MLX's CPU kernels on the same f32 weights and differ only in op order:
//! the position table is resized by two small matmuls here and by gathers and sums in mlx-vlm, attention
//! goes through MLX's fused op here and explicit matmuls and softmax there. Each is a reassociation of a
//! few f32 terms (~1e-7 relative), printed below. Greedy tokens must be identical: the script checked
//! that every top-1 logit leads by >= 2e-3 and every router choice by >= 2e-4, far above that noise.

mod logit_fixtures;

use std::path::{Path, PathBuf};

use logit_fixtures::{argmax, ids, last_row, rel_err};
use mlx_k3::io::{save_safetensors, Safetensors};
use mlx_k3::model::vision::{merge_features, MediaGrid, VisionTower};
use mlx_k3::model::{KimiK3, LoadOptions};
use mlx_k3::{Array, Dtype};

const TOL: f32 = 1e-4;
const CASES: [&str; 3] = ["image", "two_images", "video"];

fn root() -> PathBuf {
    logit_fixtures::dir("vision_k25")
}

fn expected() -> Safetensors {
    Safetensors::load(root().join("expected.safetensors")).unwrap()
}

/// A case's grids: rows of (h, w) are images, rows of (t, h, w) video chunks.
fn grids(st: &Safetensors, case: &str) -> Vec<MediaGrid> {
    let g = st.get(&format!("{case}.grids")).unwrap();
    let cols = g.dim(1).unwrap() as usize;
    let v: Vec<usize> = g.to_vec::<i32>().unwrap().into_iter().map(|x| x as usize).collect();
    v.chunks(cols)
        .map(|r| if cols == 2 { MediaGrid::image(r[0], r[1]) } else { MediaGrid::video(r[0], r[1], r[2]) })
        .collect()
}

fn tower(dir: &Path) -> VisionTower {
    VisionTower::load(dir, Some(Dtype::F32)).unwrap().expect("the fixture has a vision_config")
}

#[test]
fn tower_features_match_mlx_vlm() {
    let st = expected();
    let model_tower = tower(&root().join("model"));
    // The release names (vision_tower.encoder.*, wqkv/wo on the block, the conv kernel as
    // [out, in, kh, kw]) load to the same tower.
    let release_tower = tower(&root().join("release"));
    for case in CASES {
        let pv = st.get(&format!("{case}.pixel_values")).unwrap();
        let want = st.get(&format!("{case}.features")).unwrap();
        let g = grids(&st, case);
        let n: usize = g.iter().map(|g| model_tower.tokens_for(*g)).sum();
        assert_eq!(want.shape(), vec![n as i32, 32], "{case}: the fixture's feature shape");
        for (names, t) in [("mlx-vlm names", &model_tower), ("release names", &release_tower)] {
            let got = t.encode(&pv, &g).unwrap();
            assert_eq!(got.shape(), want.shape(), "{case} ({names})");
            let e = rel_err(&got, &want);
            println!("{case} ({names}): features rel err {e:.2e}");
            assert!(e <= TOL, "{case} ({names}): features rel err {e}");
        }
    }
}

/// The tower whose `Linear`s mlx-vlm quantized to affine 8-bit (group 32, blocks and projector; the patch
/// embedding is a convolution and stays float): the same MLX quantized matmuls on the same packed weights,
/// so the same 1e-4 tolerance.
#[test]
fn quantized_tower_features_match_mlx_vlm() {
    let st = expected();
    let q8 = tower(&root().join("q8"));
    let quantized: Vec<_> = q8.tensor_records().iter().filter(|r| r.spec.is_some()).collect();
    assert_eq!(quantized.len(), 10, "2 blocks x (wqkv, wo, fc0, fc1) + 2 projector Linears");
    assert!(quantized.iter().all(|r| r.spec.is_some_and(|s| s.bits == 8 && s.group_size == 32)));
    for case in CASES {
        let pv = st.get(&format!("{case}.pixel_values")).unwrap();
        let want = st.get(&format!("q8.{case}.features")).unwrap();
        let got = q8.encode(&pv, &grids(&st, case)).unwrap();
        assert_eq!(got.shape(), want.shape(), "{case}");
        let e = rel_err(&got, &want);
        println!("{case} (8-bit): features rel err {e:.2e}");
        assert!(e <= TOL, "{case} (8-bit): features rel err {e}");
    }
}

#[test]
fn merged_prompt_logits_and_greedy_tokens_match_mlx_vlm() {
    let st = expected();
    let dir = root().join("model");
    let vt = tower(&dir);
    assert_eq!(vt.placeholder_ids(), &[127]);
    let model = KimiK3::load(&dir, LoadOptions { dtype: Some(Dtype::F32), lazy: false, shard: None }).unwrap();
    for case in CASES {
        let pv = st.get(&format!("{case}.pixel_values")).unwrap();
        let prompt = st.get(&format!("{case}.prompt")).unwrap().to_vec::<i32>().unwrap();
        let prefill = st.get(&format!("{case}.prefill_logits")).unwrap();
        let fed = st.get(&format!("{case}.decode_tokens")).unwrap().to_vec::<i32>().unwrap();
        let decode = st.get(&format!("{case}.decode_logits")).unwrap();

        let features = vt.encode(&pv, &grids(&st, case)).unwrap();
        let h = model.embed_tokens(&ids(&prompt)).unwrap();
        let h = merge_features(&h, &prompt, vt.placeholder_ids(), &features).unwrap();
        let mut cache = model.make_cache();
        let logits = model.forward_embeddings(&h, Some(&mut cache)).unwrap();
        let t = prompt.len() as i32;
        let e = rel_err(&logits.reshape(&[t, -1]).unwrap(), &prefill);
        println!("{case}: prefill logits rel err {e:.2e}");
        assert!(e <= TOL, "{case}: prefill logits rel err {e}");

        let mut tok = argmax(&last_row(&logits));
        let mut worst = 0.0f32;
        for (step, want_tok) in fed.iter().enumerate() {
            assert_eq!(tok, *want_tok, "{case}: greedy token {step} differs from mlx-vlm's");
            let out = model.forward(&ids(&[tok]), Some(&mut cache)).unwrap();
            let want = decode.slice_axis(0, step as i32, step as i32 + 1).unwrap();
            let e = rel_err(&out.reshape(&[1, -1]).unwrap(), &want);
            worst = worst.max(e);
            assert!(e <= TOL, "{case}: decode step {step} logits rel err {e}");
            tok = argmax(&out.to_vec_f32().unwrap());
        }
        println!("{case}: {} greedy tokens equal, worst decode rel err {worst:.2e}", fed.len());
    }
}

#[test]
fn a_grid_that_does_not_cover_the_patches_is_an_error_naming_both() {
    let st = expected();
    let vt = tower(&root().join("model"));
    let pv = st.get("image.pixel_values").unwrap(); // 24 patches, grid 4x6
    let e = vt.encode(&pv, &[MediaGrid::image(4, 4)]).unwrap_err().to_string();
    assert!(e.contains("cover 16 patches") && e.contains("has 24 patches"), "{e}");
    let e = vt.encode(&pv, &[MediaGrid::image(3, 8)]).unwrap_err().to_string();
    assert!(e.contains("multiples of the merge kernel 2x2"), "{e}");
    let e = vt.encode(&pv, &[]).unwrap_err().to_string();
    assert!(e.contains("no grids"), "{e}");
    let flat = pv.reshape(&[24, 3, 196]).unwrap();
    let e = vt.encode(&flat, &[MediaGrid::image(4, 6)]).unwrap_err().to_string();
    assert!(e.contains("pixel_values must be [patches, 3, 14, 14]"), "{e}");
}

/// A copy of the fixture checkpoint with `edit` applied to its tensors.
fn edited_copy(name: &str, edit: impl FnOnce(&mut Vec<(String, Array)>)) -> PathBuf {
    let src = root().join("model");
    let dir = std::env::temp_dir().join(format!("mlx_k3_vision_k25_{name}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let st = Safetensors::load(src.join("model.safetensors")).unwrap();
    let mut tensors: Vec<(String, Array)> = st.keys().into_iter().map(|k| (k.clone(), st.get(&k).unwrap())).collect();
    edit(&mut tensors);
    let refs: Vec<(&str, &Array)> = tensors.iter().map(|(k, a)| (k.as_str(), a)).collect();
    save_safetensors(dir.join("model.safetensors"), &refs, &[("format", "mlx")]).unwrap();
    dir
}

#[test]
fn bad_checkpoints_are_errors_naming_the_tensor() {
    let missing = "vision_tower.blocks.1.attn.wo.weight";
    let dir = edited_copy("missing", |t| t.retain(|(k, _)| k != missing));
    let e = VisionTower::load(&dir, Some(Dtype::F32)).unwrap_err().to_string();
    assert!(e.contains(&format!("missing tensor '{missing}'")), "{e}");
    let _ = std::fs::remove_dir_all(&dir);

    let dir = edited_copy("shape", |t| {
        for (k, a) in t.iter_mut() {
            if k == "vision_tower.patch_embed.pos_emb.weight" {
                *a = a.slice_axis(0, 0, 4).unwrap();
            }
        }
    });
    let e = VisionTower::load(&dir, Some(Dtype::F32)).unwrap_err().to_string();
    assert!(e.contains("vision_tower.patch_embed.pos_emb.weight") && e.contains("[8, 8, 16]"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);

    let dir = edited_copy("extra", |t| {
        t.push(("vision_tower.blocks.2.norm0.weight".into(), Array::from_vec(vec![1f32; 16], &[16]).unwrap()))
    });
    let e = VisionTower::load(&dir, Some(Dtype::F32)).unwrap_err().to_string();
    assert!(e.contains("vision_tower.blocks.2.norm0.weight"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_vision_configs_are_errors_naming_the_field() {
    let src = root().join("model");
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("mlx_k3_vision_k25_cfg_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    for (field, value, says) in [
        ("num_heads", serde_json::json!(3), "vision_config.num_heads"),
        ("depth", serde_json::json!(-1), "vision_config.depth"),
        ("merge_kernel_size", serde_json::json!([2]), "vision_config.merge_kernel_size"),
        ("hidden_size", serde_json::json!(32), "vision_config.hidden_size"),
        ("model_type", serde_json::json!("siglip"), "vision_config.model_type"),
    ] {
        let mut cfg = base.clone();
        cfg["vision_config"][field] = value;
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let e = VisionTower::load(&dir, Some(Dtype::F32)).unwrap_err().to_string();
        assert!(e.contains(says) && e.contains("config.json"), "{field}: {e}");
    }
    // No vision_config: no tower (the text model alone).
    let mut cfg = base.clone();
    cfg.as_object_mut().unwrap().remove("vision_config");
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    assert!(VisionTower::load(&dir, Some(Dtype::F32)).unwrap().is_none());
    let _ = std::fs::remove_dir_all(&dir);
}
