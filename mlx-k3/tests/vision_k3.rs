//! Kimi K3's vision tower (`moonvit3d` + `patchmergerv2`) and a prompt with images and a video merged in,
//! against mlx-vlm 0.7.10 on the tiny checkpoint of `tests/fixtures/vision_k3`
//! (`scripts/make_vision_k3_fixtures.py`).
//!
//! Tolerance: 1e-4 x max |reference|, the text fixtures' bound. Both sides run the same float32 MLX ops in the
//! same order except where this tower multiplies instead of convolving (the patch embedding is one matmul
//! per patch) and where mlx-vlm compiles GELU, so the differences are float32 rounding: the errors measured
//! are around 1e-6 (printed by the tests). Greedy tokens must be equal: the fixture script keeps every
//! greedy top-2 gap above 2e-3 and every routing gap above 2e-4, far above such rounding.

mod logit_fixtures;

use std::path::{Path, PathBuf};

use logit_fixtures::{argmax, ids, last_row, rel_err};
use mlx_k3::io::{save_safetensors, Safetensors};
use mlx_k3::model::vision::{merge_features, MediaGrid, VisionTower};
use mlx_k3::model::{KimiK3, LoadOptions};
use mlx_k3::{Array, Dtype};

const TOL: f32 = 1e-4;

fn fixture() -> PathBuf {
    logit_fixtures::dir("vision_k3")
}

struct Expected {
    st: Safetensors,
    grids: Vec<MediaGrid>,
}

impl Expected {
    fn load() -> Expected {
        let st = Safetensors::load(fixture().join("expected.safetensors")).unwrap();
        let g = st.get("grids").unwrap().to_vec::<i32>().unwrap();
        let grids = g.chunks(3).map(|c| MediaGrid { t: c[0] as usize, h: c[1] as usize, w: c[2] as usize }).collect();
        Expected { st, grids }
    }

    fn get(&self, name: &str) -> Array {
        self.st.get(name).unwrap()
    }

    /// The pixel rows of grids `range`.
    fn pixels(&self, range: std::ops::Range<usize>) -> Array {
        let start: usize = self.grids[..range.start].iter().map(MediaGrid::patches).sum();
        let len: usize = self.grids[range].iter().map(MediaGrid::patches).sum();
        self.get("pixel_values").slice_axis(0, start as i32, (start + len) as i32).unwrap()
    }
}

fn tower(dir: &Path) -> VisionTower {
    VisionTower::load(dir, Some(Dtype::F32))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .expect("a vision_config")
}

#[test]
fn tower_features_match_mlx_vlm() {
    let exp = Expected::load();
    let t = tower(&fixture());
    assert_eq!(exp.grids, [MediaGrid::image(2, 4), MediaGrid::image(4, 10), MediaGrid::video(3, 2, 4)]);
    for (name, range) in
        [("features_image", 0..1), ("features_images", 0..2), ("features_video", 2..3), ("features_all", 0..3)]
    {
        let got = t.encode(&exp.pixels(range.clone()), &exp.grids[range.clone()]).unwrap();
        let want = exp.get(name);
        assert_eq!(got.shape(), want.shape(), "{name}");
        let tokens: usize = exp.grids[range].iter().map(|&g| t.tokens_for(g)).sum();
        assert_eq!(got.dim(0).unwrap() as usize, tokens, "{name}");
        let e = rel_err(&got, &want);
        println!("{name}: rel err {e:.2e}");
        assert!(e <= TOL, "{name}: rel err {e}");
    }
    // The tower alone (before the projector), so a projector error cannot hide a tower error or vice versa.
    let VisionTower::MoonVit3d(k3) = &t else { panic!("a kimi_k3 checkpoint gives the moonvit3d tower") };
    let merged = k3.tower(&exp.pixels(0..3), &exp.grids).unwrap();
    let e = rel_err(&merged, &exp.get("tower_all"));
    println!("tower_all: rel err {e:.2e}");
    assert!(e <= TOL, "tower rel err {e}");
}

#[test]
fn prompt_with_images_and_video_matches_mlx_vlm() {
    let exp = Expected::load();
    let dir = fixture();
    let t = tower(&dir);
    let placeholders = t.placeholder_ids().to_vec();
    assert_eq!(placeholders, [250]);
    let model = KimiK3::load(&dir, LoadOptions { dtype: Some(Dtype::F32), lazy: false, shard: None }).unwrap();

    let prompt = exp.get("prompt").to_vec::<i32>().unwrap();
    let features = t.encode(&exp.pixels(0..3), &exp.grids).unwrap();
    let h = model.embed_tokens(&ids(&prompt)).unwrap();
    let h = merge_features(&h, &prompt, &placeholders, &features).unwrap();

    let mut cache = model.make_cache();
    let logits = model.forward_embeddings(&h, Some(&mut cache)).unwrap();
    let e = rel_err(&logits.reshape(&[prompt.len() as i32, -1]).unwrap(), &exp.get("prefill_logits"));
    println!("prefill: rel err {e:.2e}");
    assert!(e <= TOL, "prefill logits rel err {e}");

    let want_tokens = exp.get("decode_tokens").to_vec::<i32>().unwrap();
    let want_logits = exp.get("decode_logits");
    let mut tok = argmax(&last_row(&logits));
    let mut worst = 0.0f32;
    for (step, want) in want_tokens.iter().enumerate() {
        assert_eq!(tok, *want, "greedy token {step} differs");
        let out = model.forward(&ids(&[tok]), Some(&mut cache)).unwrap();
        let row = want_logits.slice_axis(0, step as i32, step as i32 + 1).unwrap();
        let e = rel_err(&out.reshape(&[1, -1]).unwrap(), &row);
        worst = worst.max(e);
        assert!(e <= TOL, "decode step {step} rel err {e}");
        tok = argmax(&out.to_vec_f32().unwrap());
    }
    println!("decode: worst rel err {worst:.2e} over {} steps", want_tokens.len());

    // Without the images the same prompt gives other logits: the merge is what the match above rests on.
    let plain = model.forward(&ids(&prompt), None).unwrap();
    assert!(rel_err(&plain.reshape(&[prompt.len() as i32, -1]).unwrap(), &exp.get("prefill_logits")) > 1e-2);
}

/// A copy of the fixture checkpoint with `edit` applied to its tensors and `config` to its config.json.
fn edited_copy(
    edit: impl FnOnce(&mut std::collections::BTreeMap<String, Array>),
    config: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture();
    let mut tensors = Safetensors::load(src.join("model.safetensors")).unwrap().arrays().unwrap();
    edit(&mut tensors);
    let list: Vec<(&str, &Array)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    save_safetensors(tmp.path().join("model.safetensors"), &list, &[("format", "mlx")]).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config(&mut cfg);
    std::fs::write(tmp.path().join("config.json"), serde_json::to_string(&cfg).unwrap()).unwrap();
    tmp
}

#[test]
fn release_conv_layout_loads_to_the_same_tower() {
    // The release stores the patch embedding as PyTorch's conv [out, in, kh, kw]; mlx-vlm's sanitize
    // transposes it (the fixture script checks that mlx-vlm gives identical features for such a copy).
    let tmp = edited_copy(
        |t| {
            let w = t["vision_tower.patch_embed.proj.weight"].transpose(&[0, 3, 1, 2]).unwrap();
            assert_eq!(w.shape(), [32, 3, 14, 14]);
            t.insert("vision_tower.patch_embed.proj.weight".into(), w);
        },
        |_| {},
    );
    let exp = Expected::load();
    let got = tower(tmp.path()).encode(&exp.pixels(0..3), &exp.grids).unwrap();
    let e = rel_err(&got, &exp.get("features_all"));
    assert!(e <= TOL, "release layout: rel err {e}");
}

#[test]
fn bf16_tower_weights_are_used_as_stored() {
    // The release's tower is bfloat16. Rounded so (the rest of the checkpoint unchanged), the features move
    // by 5.4e-3 of the largest (the fixture script checks it is above 1e-3), and must match mlx-vlm's run of
    // the same rounded weights (float32 activations on both sides) within the float32 bound.
    let tmp = edited_copy(
        |t| {
            for (name, a) in t.iter_mut() {
                if name.starts_with("vision_tower.") || name.starts_with("mm_projector.") {
                    *a = a.astype(Dtype::BF16).unwrap();
                }
            }
        },
        |_| {},
    );
    let exp = Expected::load();
    let got = tower(tmp.path()).encode(&exp.pixels(0..3), &exp.grids).unwrap();
    assert_eq!(got.dtype(), Dtype::F32);
    let e = rel_err(&got, &exp.get("features_all_bf16w"));
    println!("bf16 weights: rel err {e:.2e}");
    assert!(e <= TOL, "bf16 weights: rel err {e}");
    assert!(rel_err(&got, &exp.get("features_all")) > 1e-3, "the rounding was lost");
}

#[test]
fn text_only_checkpoints_have_no_tower() {
    let dir = logit_fixtures::dir("k3").join("a_latent_norm_attnres");
    assert!(VisionTower::load(&dir, Some(Dtype::F32)).unwrap().is_none());
}

fn err_of<T: std::fmt::Debug>(r: mlx_k3::Result<T>) -> String {
    r.unwrap_err().to_string()
}

#[test]
fn bad_inputs_are_errors_that_name_them() {
    let exp = Expected::load();
    let t = tower(&fixture());
    let px = exp.pixels(0..1);
    // Patch count and grids disagree.
    let e = err_of(t.encode(&px, &[MediaGrid::image(2, 6)]));
    assert!(e.contains("the grids hold 12 patches, pixel_values has 8"), "{e}");
    // Not a multiple of the 2 x 2 merge.
    let e = err_of(t.encode(&exp.pixels(0..1).slice_axis(0, 0, 6).unwrap(), &[MediaGrid::image(2, 3)]));
    assert!(e.contains("grid 0 (1, 2, 3)") && e.contains("multiples of the merge kernel"), "{e}");
    // More frames than the time embedding has.
    let five = Array::from_vec(vec![0f32; 5 * 8 * 3 * 14 * 14], &[40, 3, 14, 14]).unwrap();
    let e = err_of(t.encode(&five, &[MediaGrid::video(5, 2, 4)]));
    assert!(e.contains("5 frames") && e.contains("init_pos_emb_time = 4"), "{e}");
    // Wrong patch shape, no grids, an empty grid.
    let e = err_of(t.encode(&px.transpose(&[0, 2, 3, 1]).unwrap(), &[MediaGrid::image(2, 4)]));
    assert!(e.contains("pixel_values must be [patches, 3, 14, 14]"), "{e}");
    assert!(err_of(t.encode(&px, &[])).contains("no grids"));
    assert!(err_of(t.encode(&px, &[MediaGrid::video(0, 2, 4)])).contains("empty side"));
}

#[test]
fn bad_checkpoints_are_errors_that_name_the_tensor_or_field() {
    let missing = edited_copy(
        |t| {
            t.remove("vision_tower.encoder.blocks.1.wo.weight");
        },
        |_| {},
    );
    let e = err_of(VisionTower::load(missing.path(), Some(Dtype::F32)));
    assert!(e.contains("'vision_tower.encoder.blocks.1.wo.weight' is missing"), "{e}");

    let wrong = edited_copy(
        |t| {
            let w = t["mm_projector.proj.2.weight"].slice_axis(0, 0, 16).unwrap();
            t.insert("mm_projector.proj.2.weight".into(), w);
        },
        |_| {},
    );
    let e = err_of(VisionTower::load(wrong.path(), Some(Dtype::F32)));
    assert!(e.contains("'mm_projector.proj.2.weight' has shape [16, 128], expected [32, 128]"), "{e}");

    let extra = edited_copy(
        |t| {
            let w = t["vision_tower.encoder.blocks.1.wo.weight"].clone();
            t.insert("vision_tower.encoder.blocks.2.wo.weight".into(), w);
        },
        |_| {},
    );
    let e = err_of(VisionTower::load(extra.path(), Some(Dtype::F32)));
    assert!(e.contains("'vision_tower.encoder.blocks.2.wo.weight' is not part of"), "{e}");

    let kind = edited_copy(|_| {}, |c| c["vision_config"]["merge_type"] = "avg".into());
    let e = err_of(VisionTower::load(kind.path(), Some(Dtype::F32)));
    assert!(e.contains("vision_config.merge_type: 'avg' is not supported") && e.contains("config.json"), "{e}");

    let typed = edited_copy(|_| {}, |c| c["vision_config"]["vt_hidden_size"] = "wide".into());
    let e = err_of(VisionTower::load(typed.path(), Some(Dtype::F32)));
    assert!(e.contains("vision_config.vt_hidden_size"), "{e}");

    let heads = edited_copy(|_| {}, |c| c["vision_config"]["vt_num_attention_heads"] = 5.into());
    let e = err_of(VisionTower::load(heads.path(), Some(Dtype::F32)));
    assert!(e.contains("vision_config.qkv_hidden_size: 48 must split into vt_num_attention_heads = 5"), "{e}");
}

#[test]
fn convert_carries_the_tower_through() {
    use mlx_k3::compress::convert::{convert, ConvertJob, Selection, CHUNK_PARAMS};
    use mlx_k3::compress::{Recipe, Silent};
    use mlx_k3::model::loader::read_media_tensors;

    let tmp = tempfile::tempdir().unwrap();
    // The text model re-encoded (bfloat16, 8-bit embeddings); the tower must come out as stored.
    let recipe_path = tmp.path().join("recipe.toml");
    std::fs::write(
        &recipe_path,
        "dtype = \"bfloat16\"\n[classes.embeddings]\nformat = \"affine\"\nbits = 8\ngroup_size = 32\n",
    )
    .unwrap();
    let recipe = Recipe::load(&recipe_path).unwrap();
    // The fixture with the processor files a vision checkpoint carries (its image settings): they must come
    // through byte for byte, or the converted checkpoint would preprocess images with the defaults.
    let src_dir = tmp.path().join("src");
    std::fs::create_dir(&src_dir).unwrap();
    for e in std::fs::read_dir(fixture()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), src_dir.join(e.file_name())).unwrap();
    }
    let processor_files = [
        ("preprocessor_config.json", "{\"media_proc_cfg\": {\"patch_size\": 14, \"in_patch_limit\": 4}}\n"),
        ("processor_config.json", "{\"processor_class\": \"KimiK3Processor\"}\n"),
        ("video_preprocessor_config.json", "{\"fps\": 2}\n"),
    ];
    for (name, text) in processor_files {
        std::fs::write(src_dir.join(name), text).unwrap();
    }
    let out = tmp.path().join("out");
    let job = ConvertJob {
        from: &src_dir,
        to: &out,
        recipe: &recipe,
        calib: None,
        profile: None,
        selection: Selection::Budget,
        overwrite: false,
        progress: &Silent,
        chunk_params: CHUNK_PARAMS,
        tool: "convert",
    };
    convert(&job).unwrap();
    for (name, text) in processor_files {
        let got = std::fs::read_to_string(out.join(name)).unwrap_or_else(|e| panic!("{name} not copied: {e}"));
        assert_eq!(got, text, "{name} changed");
    }

    let src = read_media_tensors(&fixture()).unwrap();
    let dst = read_media_tensors(&out).unwrap();
    assert_eq!(src.keys().collect::<Vec<_>>(), dst.keys().collect::<Vec<_>>());
    assert_eq!(src.len(), 18, "patch embedding, position grid, 2 x 6 block tensors, final norm, 3 of the projector");
    for (name, (a, _)) in &src {
        let b = &dst[name].0;
        assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{name}");
        assert_eq!(a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap(), "{name} changed");
    }
    // The converted folder's tower gives the source's features exactly, and its text model loads.
    let exp = Expected::load();
    let px = exp.pixels(0..3);
    let want = tower(&fixture()).encode(&px, &exp.grids).unwrap().to_vec_f32().unwrap();
    let got = tower(&out).encode(&px, &exp.grids).unwrap().to_vec_f32().unwrap();
    assert_eq!(got, want);
    KimiK3::load(&out, LoadOptions { dtype: Some(Dtype::F32), lazy: false, shard: None }).unwrap();
}
