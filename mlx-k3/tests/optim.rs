//! `optim::Adam`: a case derivable by hand, float32 master copies of float16 parameters, errors, and parity
//! with `mlx.optimizers.Adam(bias_correction=True)` on a small least-squares problem (the fixture written by
//! scripts/make_adam_fixture.py with the pinned mlx), gradients from `transforms::value_and_grad`.

use std::path::Path;

use mlx_k3::io::Safetensors;
use mlx_k3::optim::Adam;
use mlx_k3::{transforms, Array, Dtype, Result};

/// With a constant gradient g, bias-corrected Adam's moments are exactly m̂ = g and v̂ = g² at every step, so
/// each step moves a parameter by lr · g / (|g| + ε): lr · sign(g) up to ε / |g| (1e-8 here). After t steps
/// the parameter is p0 − t · lr · sign(g), whatever |g|.
#[test]
fn constant_gradient_moves_by_lr_per_step() {
    let p0 = [1.0f32, -2.0, 0.5, 3.0];
    let g = Array::from_slice(&[0.3f32, -4.0, 1e-3, 250.0], &[4]).unwrap();
    let mut opt = Adam::new(0.01).unwrap();
    opt.add("p", &Array::from_slice(&p0, &[4]).unwrap()).unwrap();
    for t in 1..=5 {
        opt.update(&[("p", &g)]).unwrap();
        assert_eq!(opt.step(), t);
        let got = opt.param("p").unwrap().to_vec::<f32>().unwrap();
        let sign = [1.0f32, -1.0, 1.0, 1.0];
        for i in 0..4 {
            let want = p0[i] - t as f32 * 0.01 * sign[i];
            // f32 arithmetic on values of size ~3: a few ulps per step.
            assert!((got[i] - want).abs() <= 5e-6, "step {t} element {i}: {} vs {want}", got[i]);
        }
    }
    // Hand-derivable moments after 5 steps of the same g: m = (1 − 0.9⁵) g, v = (1 − 0.999⁵) g².
    let (m, v) = opt.moments("p").unwrap();
    let (m, v) = (m.to_vec::<f32>().unwrap(), v.to_vec::<f32>().unwrap());
    for (i, gi) in [0.3f32, -4.0, 1e-3, 250.0].iter().enumerate() {
        let (wm, wv) = ((1.0 - 0.9f64.powi(5)) as f32 * gi, (1.0 - 0.999f64.powi(5)) as f32 * gi * gi);
        assert!((m[i] - wm).abs() <= 1e-6 * wm.abs().max(1.0), "m[{i}] {} vs {wm}", m[i]);
        assert!((v[i] - wv).abs() <= 1e-5 * wv.abs().max(1.0), "v[{i}] {} vs {wv}", v[i]);
    }
}

/// A float16 parameter trained with steps of 1e-4: each is a tenth of an f16 ulp at 1.0 (2^-10 ≈ 9.8e-4), so
/// stepping the f16 value itself would never move it; the f32 master copy accumulates the steps.
#[test]
fn float16_parameters_train_through_the_f32_master() {
    let p = Array::from_slice(&[1.0f32, 1.0], &[2]).unwrap().astype(Dtype::F16).unwrap();
    let g = Array::from_slice(&[1.0f32, -1.0], &[2]).unwrap().astype(Dtype::F16).unwrap();
    let mut opt = Adam::new(1e-4).unwrap();
    opt.add("scales", &p).unwrap();
    for _ in 0..20 {
        opt.update(&[("scales", &g)]).unwrap();
    }
    let master = opt.master("scales").unwrap();
    assert_eq!(master.dtype(), Dtype::F32);
    let m = master.to_vec::<f32>().unwrap();
    // 20 steps of lr · sign(g) (see the test above), in f32 around 1.0: within 1e-6.
    assert!((m[0] - 0.998).abs() <= 1e-6 && (m[1] - 1.002).abs() <= 1e-6, "{m:?}");
    let param = opt.param("scales").unwrap();
    assert_eq!(param.dtype(), Dtype::F16);
    let want = Array::from_slice(&[0.998f32, 1.002], &[2]).unwrap().astype(Dtype::F16).unwrap();
    assert_eq!(
        param.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap(),
        want.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap()
    );
    assert_ne!(param.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap(), vec![1.0, 1.0]);
}

#[test]
fn matches_mlx_optimizers_adam() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/optim/adam.safetensors");
    let st = Safetensors::load(&path).unwrap();
    let meta = st.metadata();
    let steps: u64 = meta["steps"].parse().unwrap();
    let lr: f64 = meta["lr"].parse().unwrap();
    let eps: f64 = meta["eps"].parse().unwrap();
    let betas: Vec<f64> = meta["betas"].split(',').map(|b| b.parse().unwrap()).collect();
    let (x, y) = (st.get("x").unwrap(), st.get("y").unwrap());
    let mut opt = Adam::with_options(lr, (betas[0], betas[1]), eps).unwrap();
    opt.add("w", &st.get("w0").unwrap()).unwrap();
    opt.add("b", &st.get("b0").unwrap()).unwrap();
    let loss = |a: &[Array]| -> Result<Vec<Array>> {
        let r = x.matmul(&a[0])?.add(&a[1])?.subtract(&y)?;
        Ok(vec![r.square()?.mean_all(false)?])
    };
    for t in 1..=steps {
        let (w, b) = (opt.param("w").unwrap(), opt.param("b").unwrap());
        let (vals, grads) = transforms::value_and_grad(loss, &[w, b], &[0, 1]).unwrap();
        let want_loss = st.get(&format!("loss{t}")).unwrap().item::<f32>().unwrap();
        let got_loss = vals[0].item::<f32>().unwrap();
        assert!((got_loss - want_loss).abs() <= 1e-5 * want_loss.abs(), "step {t}: loss {got_loss} vs mlx {want_loss}");
        opt.update(&[("w", &grads[0]), ("b", &grads[1])]).unwrap();
        for name in ["w", "b"] {
            let got = opt.param(name).unwrap().to_vec::<f32>().unwrap();
            let want = st.get(&format!("{name}{t}")).unwrap().to_vec::<f32>().unwrap();
            // The same f32 graph as MLX's except the bias corrections, which we form in f64 on the host and
            // MLX in f32 (a relative difference ~1e-7 of the step): over 6 steps of size 0.05, well under 1e-5.
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-5, "step {t}: {name}[{i}] = {g}, mlx {w}");
            }
        }
    }
}

#[test]
fn bad_use_is_a_named_error() {
    let p = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
    assert!(Adam::new(f64::NAN).unwrap_err().to_string().contains("learning rate"));
    assert!(Adam::with_options(0.1, (1.0, 0.999), 1e-8).unwrap_err().to_string().contains("beta1"));
    assert!(Adam::with_options(0.1, (0.9, 0.999), -1.0).unwrap_err().to_string().contains("eps"));
    let mut opt = Adam::new(0.1).unwrap();
    opt.add("p", &p).unwrap();
    assert!(opt.add("p", &p).unwrap_err().to_string().contains("already added"));
    let ints = Array::from_slice(&[1u32, 2], &[2]).unwrap();
    assert!(opt.add("q", &ints).unwrap_err().to_string().contains("floating-point"));
    let wrong = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
    let e = opt.update(&[("p", &wrong)]).unwrap_err().to_string();
    assert!(e.contains("`p`") && e.contains("[3]"), "{e}");
    let e = opt.update(&[("nope", &p)]).unwrap_err().to_string();
    assert!(e.contains("no parameter named `nope`"), "{e}");
    let e = opt.update(&[("p", &p), ("p", &p)]).unwrap_err().to_string();
    assert!(e.contains("two gradients"), "{e}");
    // Nothing changed on those errors.
    assert_eq!(opt.step(), 0);
    assert_eq!(opt.param("p").unwrap().to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
}

/// A state saved after some steps and restored into a fresh optimizer (a resumed run) continues exactly as
/// the original: the same parameters, bit for bit, after more steps. A saved state of the wrong shape or
/// dtype is refused with the parameter named.
#[test]
fn restored_state_continues_bit_identically() {
    let grads: Vec<Array> = (0..6)
        .map(|t| Array::from_slice(&[0.3f32 * t as f32 - 1.0, 2.0 / (t as f32 + 1.0), -0.7], &[3]).unwrap())
        .collect();
    let p0 = Array::from_slice(&[1.0f32, -2.0, 0.5], &[3]).unwrap().astype(Dtype::BF16).unwrap();
    let mut a = Adam::new(0.05).unwrap();
    a.add("p", &p0).unwrap();
    for g in &grads[..3] {
        a.update(&[("p", g)]).unwrap();
    }
    let (m, v) = a.moments("p").unwrap();
    let (master, m, v) = (a.master("p").unwrap().copy().unwrap(), m.copy().unwrap(), v.copy().unwrap());
    let mut b = Adam::new(0.05).unwrap();
    b.add("p", &p0).unwrap();
    b.restore("p", &master, &m, &v).unwrap();
    b.set_step(a.step());
    for g in &grads[3..] {
        a.update(&[("p", g)]).unwrap();
        b.update(&[("p", g)]).unwrap();
    }
    assert_eq!(a.step(), b.step());
    let bits =
        |o: &Adam| o.master("p").unwrap().to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&b));
    assert_eq!(b.param("p").unwrap().dtype(), Dtype::BF16);

    let short = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
    let e = b.restore("p", &short, &m, &v).unwrap_err().to_string();
    assert!(e.contains("`p`") && e.contains("master"), "{e}");
    let half = master.astype(Dtype::F16).unwrap();
    assert!(b.restore("p", &master, &half, &v).is_err());
    assert!(b.restore("q", &master, &m, &v).is_err());
}
