//! Bad input returns `Err` carrying MLX's message, the op and the caller's location; nothing aborts.

mod common;

use common::f32s;
use mlx_k3::distributed::{Backend, Group};
use mlx_k3::{Array, Dtype, Error};

fn mlx_message(e: &Error) -> &str {
    e.mlx_message().unwrap_or_else(|| panic!("expected an MLX error, got {e:?}"))
}

#[test]
fn shape_mismatch_is_an_error_with_mlx_message_and_location() {
    let a = f32s(&[1.0; 6], &[2, 3]);
    let e = a.matmul(&a).unwrap_err();
    assert!(mlx_message(&e).contains("[matmul]"), "{e}");
    let shown = e.to_string();
    assert!(shown.contains("matmul") && shown.contains("tests/errors.rs"), "{shown}");
    let e = a.add(&f32s(&[1.0; 4], &[4])).unwrap_err();
    assert!(mlx_message(&e).to_lowercase().contains("broadcast"), "{e}");
    let e = a.reshape(&[4, 2]).unwrap_err();
    assert!(mlx_message(&e).contains("[reshape]"), "{e}");
    let e = mlx_k3::ops::concatenate(&[&a, &f32s(&[1.0; 4], &[2, 2])], 0).unwrap_err();
    assert!(mlx_message(&e).contains("[concatenate]"), "{e}");
    // Checked on the Rust side before MLX sees it.
    assert!(matches!(Array::from_slice(&[1.0f32; 5], &[2, 3]), Err(Error::InvalidArgument { .. })));
    assert!(matches!(a.slice(&[0], &[1], &[1]), Err(Error::InvalidArgument { op: "slice", .. })));
}

#[test]
fn bad_dtype_is_an_error() {
    let a = f32s(&[1.0, 2.0], &[2]);
    match a.to_vec::<i32>() {
        Err(Error::Dtype { op: "to_vec", expected: Dtype::I32, found: Dtype::F32 }) => {}
        other => panic!("expected a dtype error, got {other:?}"),
    }
    let e = a.left_shift(&a).unwrap_err();
    assert!(mlx_message(&e).contains("left_shift") || mlx_message(&e).contains("integer"), "{e}");
    let e = a.item::<f32>().unwrap_err();
    assert!(e.to_string().contains("2 elements"), "{e}");
    let e = mlx_k3::random::normal(&[2], Dtype::I32, 0.0, 1.0, None).unwrap_err();
    assert!(mlx_message(&e).contains("float"), "{e}");
}

#[test]
fn wrong_axis_is_an_error() {
    let a = f32s(&[1.0; 6], &[2, 3]);
    for r in [
        a.sum(&[5], false),
        a.mean(&[-3], false),
        a.argmax(2, false),
        a.softmax(&[7], false),
        a.transpose(&[0, 0]),
        a.squeeze(&[1]),
        a.take(&Array::from_slice(&[0i32], &[1]).unwrap(), 4),
        a.cumsum(9, false, true),
    ] {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Mlx { .. }), "{e:?}");
    }
    assert!(matches!(a.split(2, 1), Err(Error::Mlx { .. })));
    assert!(a.dim(2).is_err() && a.slice_axis(3, 0, 1).is_err());
}

#[test]
fn failed_distributed_init_is_an_error() {
    // No MLX_RANK / MLX_HOSTFILE in the test environment: a strict ring init must fail cleanly.
    std::env::remove_var("MLX_RANK");
    std::env::remove_var("MLX_HOSTFILE");
    let e = Group::init(Backend::Ring, true).err().expect("strict init without a launcher must fail");
    assert!(mlx_message(&e).contains("MLX_RANK"), "{e}");
    // mpi and nccl are not in the CPU wheel; asking for them strictly fails too.
    if !Backend::Mpi.is_available() {
        assert!(Group::init(Backend::Mpi, true).is_err());
    }
    // A non-strict init gives a singleton group whose all_sum is the identity.
    let g = Group::init(Backend::Any, false).unwrap();
    assert_eq!((g.rank(), g.size()), (0, 1));
    let x = f32s(&[1.0, 2.0], &[2]);
    assert_eq!(g.all_sum(&x).unwrap().to_vec::<f32>().unwrap(), [1.0, 2.0]);
}

#[test]
fn quantize_and_fast_ops_reject_bad_shapes() {
    let w = f32s(&[1.0; 48], &[2, 24]);
    let e = mlx_k3::quant::quantize(&w, mlx_k3::quant::QuantSpec::affine(32, 4), None).unwrap_err();
    assert!(mlx_message(&e).contains("quantize"), "{e}");
    let e = mlx_k3::fast::rms_norm(&w, Some(&f32s(&[1.0; 3], &[3])), 1e-5).unwrap_err();
    assert!(mlx_message(&e).contains("rms_norm"), "{e}");
    let q = f32s(&[1.0; 8], &[1, 1, 2, 4]);
    let k = f32s(&[1.0; 12], &[1, 1, 2, 6]);
    let e = mlx_k3::fast::scaled_dot_product_attention(&q, &k, &k, 1.0, mlx_k3::fast::AttentionMask::None, None)
        .unwrap_err();
    assert!(matches!(e, Error::Mlx { .. }), "{e:?}");
}
