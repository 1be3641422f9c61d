//! Autodiff over Rust closures (`mlx_k3::transforms`): gradients checked against central finite differences
//! for the ops the model's blocks use, and errors and panics inside the transform contained on both sides of
//! the C ABI.
//!
//! Finite differences are taken in float64. Matmul is exact there, so with step h = 1e-6 the central
//! difference's truncation error is O(h² · f''') ≈ 1e-12 and its rounding ≈ ε64 · |f| / h ≈ 1e-10 · |f|:
//! tolerance 1e-6 (relative to max(1, |g|)). MLX's CPU evaluates exp, sigmoid, sin and the fused RMSNorm,
//! softmax, RoPE and attention in f64 only to about f32 accuracy (relative error ~1e-7, measured against
//! Python's math library), so for those h = 1e-3: perturbing one element changes only the O(1) terms that
//! depend on it, whose evaluation error gives a quotient error of ≈ 1e-7 / h = 1e-4, and the truncation is
//! h²/6 · |f'''| ≈ 2e-7; tolerance 1e-3. A wrong gradient (a missing term, a transposed operand) is off by
//! O(1). Ops that MLX runs in f32 only (gather_mm, the SiTU reference) are checked in f32 with h = 1e-2 (see
//! `situ_reference`).

mod common;

use mlx_k3::fast::{self, AttentionMask};
use mlx_k3::{kernels, ops, random, transforms, with_device, Array, Device, Dtype, Error, Result};

/// A deterministic array of normal values in `dtype`.
/// Runs a test on the CPU: f64 and the finite differences.
fn cpu(f: impl FnOnce()) {
    with_device(Device::Cpu, f).unwrap()
}

fn randn(shape: &[i32], seed: u64, dtype: Dtype) -> Array {
    let key = random::key(seed).unwrap();
    random::normal(shape, Dtype::F32, 0.0, 1.0, Some(&key)).unwrap().astype(dtype).unwrap()
}

/// Central differences of the scalar `f` with respect to every element of `primals[arg]`.
fn finite_diff(f: &dyn Fn(&[Array]) -> Result<Vec<Array>>, primals: &[Array], arg: usize, h: f64) -> Vec<f64> {
    let p = &primals[arg];
    let dtype = p.dtype();
    let base: Vec<f64> = p.astype(Dtype::F64).unwrap().to_vec::<f64>().unwrap();
    let shape = p.shape();
    let eval_at = |vals: &[f64]| -> f64 {
        let mut args = primals.to_vec();
        args[arg] = Array::from_slice(vals, &shape).unwrap().astype(dtype).unwrap();
        f(&args).unwrap()[0].astype(Dtype::F64).unwrap().item::<f64>().unwrap()
    };
    (0..base.len())
        .map(|i| {
            let mut v = base.clone();
            v[i] = base[i] + h;
            let up = eval_at(&v);
            v[i] = base[i] - h;
            let down = eval_at(&v);
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// Checks value_and_grad of `f` against finite differences for each argnum.
#[track_caller]
fn check_grads(f: impl Fn(&[Array]) -> Result<Vec<Array>>, primals: &[Array], argnums: &[usize], h: f64, tol: f64) {
    let (values, grads) = transforms::value_and_grad(&f, primals, argnums).unwrap();
    // The value is f itself.
    let direct = f(primals).unwrap()[0].astype(Dtype::F64).unwrap().item::<f64>().unwrap();
    let value = values[0].astype(Dtype::F64).unwrap().item::<f64>().unwrap();
    assert!((direct - value).abs() <= 1e-12 * direct.abs().max(1.0), "value {value} vs f {direct}");
    assert_eq!(grads.len(), argnums.len());
    for (g, &arg) in grads.iter().zip(argnums) {
        assert_eq!(g.shape(), primals[arg].shape(), "gradient {arg} shape");
        let got = g.astype(Dtype::F64).unwrap().to_vec::<f64>().unwrap();
        let want = finite_diff(&f, primals, arg, h);
        let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= tol * scale, "argnum {arg} element {i}: autodiff {a}, finite differences {b}");
        }
        // Not a vacuous check: the gradient is not all zeros.
        assert!(got.iter().any(|v| v.abs() > 1e-3), "argnum {arg}: gradient is ~0");
    }
}

const F64: Dtype = Dtype::F64;
/// Step and tolerance for ops exact in f64 (matmul).
const H: f64 = 1e-6;
const TOL: f64 = 1e-6;
/// Step and tolerance for ops MLX evaluates in f64 to about f32 accuracy (module comment).
const H_APPROX: f64 = 1e-3;
const TOL_APPROX: f64 = 1e-3;
/// Step and tolerance for f32-only ops (see `situ_reference`).
const H_F32: f64 = 1e-2;
const TOL_F32: f64 = 2e-3;

/// A fixed, non-uniform weighting so that losses are not symmetric sums (whose gradients can hide errors).
fn weights(shape: &[i32], seed: u64) -> Array {
    randn(shape, seed, F64)
}

#[test]
fn matmul_both_operands() {
    cpu(|| {
        let c = weights(&[3, 5], 9);
        let f = move |a: &[Array]| Ok(vec![a[0].matmul(&a[1])?.multiply(&c)?.sum_all(false)?]);
        check_grads(f, &[randn(&[3, 4], 1, F64), randn(&[4, 5], 2, F64)], &[0, 1], H, TOL);
    });
}

#[test]
fn rms_norm_input_and_weight() {
    cpu(|| {
        let c = weights(&[2, 3, 8], 11);
        let f = move |a: &[Array]| Ok(vec![fast::rms_norm(&a[0], Some(&a[1]), 1e-5)?.multiply(&c)?.sum_all(false)?]);
        check_grads(f, &[randn(&[2, 3, 8], 3, F64), randn(&[8], 4, F64)], &[0, 1], H_APPROX, TOL_APPROX);
    });
}

#[test]
fn softmax_and_logsumexp() {
    cpu(|| {
        let c = weights(&[4, 6], 12);
        let f = move |a: &[Array]| {
            let p = a[0].softmax(&[-1], true)?.multiply(&c)?.sum_all(false)?;
            Ok(vec![p.add(&a[0].logsumexp(&[-1], false)?.sum_all(false)?)?])
        };
        check_grads(f, &[randn(&[4, 6], 5, F64)], &[0], H_APPROX, TOL_APPROX);
    });
}

#[test]
fn silu_sigmoid_tanh() {
    cpu(|| {
        let c = weights(&[3, 7], 13);
        let f = move |a: &[Array]| {
            let x = &a[0];
            Ok(vec![x.silu()?.add(&x.tanh()?.multiply(&x.sigmoid()?)?)?.multiply(&c)?.sum_all(false)?])
        };
        check_grads(f, &[randn(&[3, 7], 6, F64)], &[0], H_APPROX, TOL_APPROX);
    });
}

/// SiTU, the experts' activation, through the plain-ops reference the model's fallback uses (f32 inside).
/// f32 central differences with h = 1e-2: truncation ≈ h²/6 · |f'''| ≈ 2e-5 per unit of the loss's third
/// derivative, rounding ≈ ε32 · |f| / h ≈ 1e-5 · |f| with |f| ~ 10 here; 2e-3 (relative to max(1, |g|)) leaves
/// a margin of ~10 over both and is still far below a wrong gradient's O(1) error.
#[test]
fn situ_reference() {
    cpu(|| {
        let c = weights(&[2, 16], 14).astype(Dtype::F32).unwrap();
        let f = move |a: &[Array]| {
            let y = kernels::situ_reference(&a[0], &a[1], 3.0, Some(4.0))?;
            Ok(vec![y.multiply(&c)?.sum_all(false)?])
        };
        let up = randn(&[2, 16], 7, Dtype::F32).multiply(2.0f32).unwrap();
        let gate = randn(&[2, 16], 8, Dtype::F32).multiply(2.0f32).unwrap();
        check_grads(f, &[up, gate], &[0, 1], H_F32, TOL_F32);
    });
}

#[test]
fn rope_and_attention() {
    cpu(|| {
        // q, k, v [1, 2, 4, 8]: RoPE on q and k, causal attention, a weighted sum of the output.
        let c = weights(&[1, 2, 4, 8], 15);
        let f = move |a: &[Array]| {
            let q = fast::rope(&a[0], 8, false, Some(10000.0), 1.0, 3)?;
            let k = fast::rope(&a[1], 8, false, Some(10000.0), 1.0, 3)?;
            let o = fast::scaled_dot_product_attention(&q, &k, &a[2], 0.35, AttentionMask::Causal, None)?;
            Ok(vec![o.multiply(&c)?.sum_all(false)?])
        };
        let p = [randn(&[1, 2, 4, 8], 16, F64), randn(&[1, 2, 4, 8], 17, F64), randn(&[1, 2, 4, 8], 18, F64)];
        check_grads(f, &p, &[0, 1, 2], H_APPROX, TOL_APPROX);
    });
}

#[test]
fn embedding_gather_and_expert_gather_mm() {
    cpu(|| {
        // An embedding lookup (take) and an expert-gathered matmul (gather_mm by expert index), as the MoE's
        // fallback computes it. MLX's GatherMM runs in f32 only.
        let ids = Array::from_slice(&[2u32, 0, 2, 1], &[4]).unwrap();
        let experts = Array::from_slice(&[1u32, 0, 1, 1], &[4]).unwrap();
        let c = weights(&[4, 1, 3], 19).astype(Dtype::F32).unwrap();
        let f = move |a: &[Array]| {
            let x = a[0].take(&ids, 0)?.expand_dims(&[1])?; // [4, 1, 5]
            let y = ops::gather_mm(&x, &a[1], None, Some(&experts), false)?; // [4, 1, 3]
            Ok(vec![y.multiply(&c)?.sum_all(false)?])
        };
        check_grads(f, &[randn(&[3, 5], 20, Dtype::F32), randn(&[2, 5, 3], 21, Dtype::F32)], &[0, 1], H_F32, TOL_F32);
    });
}

#[test]
fn vjp_with_several_outputs_and_cotangents() {
    cpu(|| {
        // f(x, y) = (x * y, sin(x)): the vjp with cotangents (u, w) is (u*y + w*cos(x), u*x).
        let x = randn(&[5], 30, F64);
        let y = randn(&[5], 31, F64);
        let u = randn(&[5], 32, F64);
        let w = randn(&[5], 33, F64);
        let (outs, vjps) = transforms::vjp(
            |a: &[Array]| Ok(vec![a[0].multiply(&a[1])?, a[0].sin()?]),
            &[x.clone(), y.clone()],
            &[u.clone(), w.clone()],
        )
        .unwrap();
        assert_eq!((outs.len(), vjps.len()), (2, 2));
        let want_x = u.multiply(&y).unwrap().add(&w.multiply(&x.cos().unwrap()).unwrap()).unwrap();
        let want_y = u.multiply(&x).unwrap();
        for (got, want) in [(&vjps[0], &want_x), (&vjps[1], &want_y), (&outs[0], &x.multiply(&y).unwrap())] {
            let (g, w) = (got.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
            for (a, b) in g.iter().zip(&w) {
                assert!((a - b).abs() <= 1e-12, "{a} vs {b}");
            }
        }
    });
}

#[test]
fn grad_of_grad() {
    cpu(|| {
        // Nested transforms (the callback re-enters the shim): d²/dx² x³ = 6x.
        let x = Array::from_slice(&[0.5f64, -2.0, 3.0], &[3]).unwrap();
        let g2 = transforms::grad(
            |a: &[Array]| {
                let g = transforms::grad(|b: &[Array]| Ok(vec![b[0].power(3.0f64)?.sum_all(false)?]), a, &[0])?;
                Ok(vec![g[0].sum_all(false)?])
            },
            &[x],
            &[0],
        )
        .unwrap();
        assert_eq!(g2[0].to_vec::<f64>().unwrap(), vec![3.0, -12.0, 18.0]);
    });
}

#[test]
fn extra_outputs_pass_through() {
    cpu(|| {
        // value_and_grad: outputs after the loss are returned, not differentiated.
        let x = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
        let (vals, grads) =
            transforms::value_and_grad(|a: &[Array]| Ok(vec![a[0].square()?.sum_all(false)?, a[0].exp()?]), &[x], &[0])
                .unwrap();
        assert_eq!(vals.len(), 2);
        assert_eq!(vals[0].item::<f32>().unwrap(), 5.0);
        assert_eq!(grads[0].to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
    });
}

// ------------------------------------------------------------------ errors and panics

fn scalar_loss(a: &[Array]) -> Result<Vec<Array>> {
    Ok(vec![a[0].square()?.sum_all(false)?])
}

/// After a failure, transforms still work on this thread (MLX's tracing state was unwound).
fn still_works() {
    let x = Array::from_slice(&[3.0f32], &[1]).unwrap();
    let g = transforms::grad(scalar_loss, &[x], &[0]).unwrap();
    assert_eq!(g[0].to_vec::<f32>().unwrap(), vec![6.0]);
}

#[test]
fn closure_error_comes_back_unchanged() {
    cpu(|| {
        let x = Array::from_slice(&[1.0f32], &[1]).unwrap();
        let err = transforms::value_and_grad(
            |_: &[Array]| -> Result<Vec<Array>> { Err(Error::invalid("my_loss", "tensor `blk.3.scales` is missing")) },
            &[x.clone()],
            &[0],
        )
        .unwrap_err();
        match &err {
            Error::InvalidArgument { op, message } => {
                assert_eq!(*op, "my_loss");
                assert_eq!(message, "tensor `blk.3.scales` is missing");
            }
            other => panic!("expected the closure's own error, got {other:?}"),
        }
        // The same through vjp.
        let err = transforms::vjp(|_: &[Array]| Err(Error::invalid("my_fn", "boom")), &[x.clone()], &[x]).unwrap_err();
        assert!(err.to_string().contains("boom"), "{err}");
        still_works();
    });
}

#[test]
fn mlx_error_inside_the_closure() {
    cpu(|| {
        // A shape error raised by MLX inside the traced function: the closure sees Err (from the shim), passes it on.
        let x = Array::from_slice(&[1.0f32, 2.0, 3.0], &[1, 3]).unwrap();
        let err =
            transforms::grad(|a: &[Array]| Ok(vec![a[0].matmul(&a[0])?.sum_all(false)?]), &[x], &[0]).unwrap_err();
        match &err {
            Error::Mlx { op, message, .. } => {
                assert_eq!(*op, "matmul");
                assert!(message.contains("matmul"), "{message}");
            }
            other => panic!("expected an MLX error from matmul, got {other:?}"),
        }
        still_works();
    });
}

#[test]
fn panic_inside_the_closure_is_contained() {
    cpu(|| {
        let x = Array::from_slice(&[1.0f32], &[1]).unwrap();
        let err = transforms::grad(
            |_: &[Array]| -> Result<Vec<Array>> { panic!("scale table has {} rows", 7) },
            &[x.clone()],
            &[0],
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("panicked") && text.contains("scale table has 7 rows"), "{text}");
        // A panic in a nested transform is contained by the inner callback and surfaces as the outer's error.
        let err = transforms::grad(
            |a: &[Array]| {
                let g = transforms::grad(|_: &[Array]| -> Result<Vec<Array>> { panic!("inner") }, a, &[0])?;
                Ok(vec![g[0].sum_all(false)?])
            },
            &[x],
            &[0],
        )
        .unwrap_err();
        assert!(err.to_string().contains("inner"), "{err}");
        still_works();
    });
}

#[test]
fn op_without_a_gradient_fails_in_the_backward_pass() {
    cpu(|| {
        // The fused SiTU kernel is inference-only: its primitive throws from vjp, during the transform's backward
        // pass (after the closure returned). The shim catches it; the caller gets MLX's message.
        let up = randn(&[2, 8], 40, Dtype::F32);
        let gate = randn(&[2, 8], 41, Dtype::F32);
        let err = transforms::grad(
            |a: &[Array]| Ok(vec![kernels::situ(&a[0], &a[1], 3.0, None)?.sum_all(false)?]),
            &[up, gate],
            &[0],
        )
        .unwrap_err();
        match &err {
            Error::Mlx { op, message, .. } => {
                assert_eq!(*op, "value_and_grad");
                assert!(message.contains("[situ] gradients are not implemented"), "{message}");
            }
            other => panic!("expected an MLX error, got {other:?}"),
        }
        still_works();
    });
}

#[test]
fn bad_arguments_are_errors() {
    cpu(|| {
        let x = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
        // The loss is not a scalar.
        let err = transforms::grad(|a: &[Array]| Ok(vec![a[0].square()?]), &[x.clone()], &[0]).unwrap_err();
        assert!(err.to_string().contains("must be a scalar, got shape (2)"), "{err}");
        // No outputs.
        let err = transforms::grad(|_: &[Array]| Ok(vec![]), &[x.clone()], &[0]).unwrap_err();
        assert!(err.to_string().contains("returned no arrays"), "{err}");
        // argnums out of range, or none.
        let err = transforms::grad(scalar_loss, &[x.clone()], &[1]).unwrap_err();
        assert!(err.to_string().contains("argnum 1 is out of range"), "{err}");
        let err = transforms::grad(scalar_loss, &[x.clone()], &[]).unwrap_err();
        assert!(err.to_string().contains("no argnums"), "{err}");
        // vjp: cotangents that do not match the outputs.
        let err = transforms::vjp(|a: &[Array]| Ok(vec![a[0].exp()?]), &[x.clone()], &[]).unwrap_err();
        assert!(matches!(err, Error::Mlx { .. }), "{err:?}");
        still_works();
    });
}
