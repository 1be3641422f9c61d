//! Safetensors through MLX's loader: round trip with metadata, lazy loading, and clear errors that name
//! the file for missing, corrupt and truncated files.

mod common;

use common::f32s;
use half::bf16;
use mlx_k3::io::{save_safetensors, Safetensors};
use mlx_k3::{Array, Dtype, Error};

#[test]
fn round_trip_with_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    let a = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let b = Array::from_slice(&[bf16::from_f32(0.5), bf16::from_f32(-8.0)], &[2]).unwrap();
    let c = Array::from_slice(&[7u32, 9], &[1, 2]).unwrap();
    save_safetensors(&path, &[("layer.w", &a), ("b", &b), ("codes", &c)], &[("format", "mlx")]).unwrap();
    let st = Safetensors::load(&path).unwrap();
    assert_eq!(st.keys(), ["b", "codes", "layer.w"]);
    assert_eq!(st.metadata().get("format").map(String::as_str), Some("mlx"));
    let la = st.get("layer.w").unwrap();
    assert!(!la.is_evaluated(), "loading must be lazy");
    assert_eq!((la.shape(), la.dtype()), (vec![2, 3], Dtype::F32));
    assert_eq!(la.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(st.get("b").unwrap().to_vec::<bf16>().unwrap(), [bf16::from_f32(0.5), bf16::from_f32(-8.0)]);
    assert_eq!(st.get("codes").unwrap().to_vec::<u32>().unwrap(), [7, 9]);
    assert_eq!(st.arrays().unwrap().len(), 3);
    let e = st.get("nope").unwrap_err().to_string();
    assert!(e.contains("t.safetensors") && e.contains("nope"), "{e}");
}

#[test]
fn missing_corrupt_and_truncated_files_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.safetensors");
    match Safetensors::load(&missing) {
        Err(Error::Io { path, .. }) => assert_eq!(path, missing),
        other => panic!("expected an I/O error, got {:?}", other.err()),
    }
    let garbage = dir.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"this is not a safetensors file at all").unwrap();
    let e = Safetensors::load(&garbage).err().expect("garbage must not load");
    assert!(matches!(e, Error::Format { .. }) && e.to_string().contains("garbage.safetensors"), "{e}");
    // A file cut inside its data: the header parses, the data is short. It must fail cleanly either at
    // load or at evaluation, never abort.
    let good = dir.path().join("good.safetensors");
    let big: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    save_safetensors(&good, &[("w", &Array::from_slice(&big, &[64, 64]).unwrap())], &[]).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let failed = match Safetensors::load(&cut) {
        Err(e) => {
            assert!(e.to_string().contains("cut.safetensors"), "{e}");
            true
        }
        Ok(st) => st.get("w").and_then(|w| w.to_vec::<f32>()).is_err(),
    };
    assert!(failed, "a truncated file must not read as valid data");
    // A header cut in the middle.
    std::fs::write(&cut, &bytes[..20]).unwrap();
    assert!(Safetensors::load(&cut).is_err());
}
