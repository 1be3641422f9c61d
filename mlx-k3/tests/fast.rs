//! MLX's fused ops against host computations of their formulas.

mod common;

use common::{assert_close, f32s, vals};
use mlx_k3::fast::{self, AttentionMask};
use mlx_k3::{random, Array, Dtype};

fn host_randn(shape: &[i32], seed: u64) -> (Array, Vec<f32>) {
    let a = random::normal(shape, Dtype::F32, 0.0, 1.0, Some(&random::key(seed).unwrap())).unwrap();
    let v = vals(&a);
    (a, v)
}

#[test]
fn rms_norm_and_layer_norm() {
    let (x, xv) = host_randn(&[3, 8], 1);
    let w: Vec<f32> = (0..8).map(|i| 0.5 + i as f32 * 0.1).collect();
    let wa = f32s(&w, &[8]);
    let got = vals(&fast::rms_norm(&x, Some(&wa), 1e-5).unwrap());
    let mut want = vec![];
    for r in xv.chunks(8) {
        let ms = r.iter().map(|v| v * v).sum::<f32>() / 8.0;
        want.extend(r.iter().zip(&w).map(|(v, g)| v / (ms + 1e-5).sqrt() * g));
    }
    assert_close(&got, &want, 1e-5);
    let b: Vec<f32> = (0..8).map(|i| i as f32 * -0.2).collect();
    let got = vals(&fast::layer_norm(&x, Some(&wa), Some(&f32s(&b, &[8])), 1e-5).unwrap());
    let mut want = vec![];
    for r in xv.chunks(8) {
        let m = r.iter().sum::<f32>() / 8.0;
        let var = r.iter().map(|v| (v - m) * (v - m)).sum::<f32>() / 8.0;
        want.extend(r.iter().enumerate().map(|(i, v)| (v - m) / (var + 1e-5).sqrt() * w[i] + b[i]));
    }
    assert_close(&got, &want, 1e-5);
    // Without a weight, rms_norm is the bare normalization.
    let plain = vals(&fast::rms_norm(&f32s(&[3.0, 4.0], &[1, 2]), None, 0.0).unwrap());
    assert_close(&plain, &[3.0 / 12.5f32.sqrt(), 4.0 / 12.5f32.sqrt()], 1e-6);
}

#[test]
fn rope_rotates_pairs_by_position() {
    // x [1, L=3, D=4]; angle(t, i) = (offset + t) * scale * base^(-2i/D) for pair i.
    let (x, xv) = host_randn(&[1, 3, 4], 2);
    let (base, scale, offset) = (10000.0f32, 1.0f32, 5);
    for traditional in [false, true] {
        let got = vals(&fast::rope(&x, 4, traditional, Some(base), scale, offset).unwrap());
        let mut want = vec![0.0; 12];
        for t in 0..3 {
            for i in 0..2 {
                let theta = (offset + t) as f32 * scale * base.powf(-(2 * i) as f32 / 4.0);
                let (c, s) = (theta.cos(), theta.sin());
                // traditional pairs adjacent features (2i, 2i+1); otherwise (i, i + D/2).
                let (p, q) = if traditional { (2 * i, 2 * i + 1) } else { (i, i + 2) };
                let (a, b) = (xv[(t * 4 + p) as usize], xv[(t * 4 + q) as usize]);
                want[(t * 4 + p) as usize] = a * c - b * s;
                want[(t * 4 + q) as usize] = a * s + b * c;
            }
        }
        assert_close(&got, &want, 1e-5);
    }
}

fn host_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    hq: usize,
    hkv: usize,
    l: usize,
    s: usize,
    d: usize,
    scale: f32,
    mask: impl Fn(usize, usize, usize) -> Option<f32>,
) -> Vec<f32> {
    let mut out = vec![0.0; hq * l * d];
    for h in 0..hq {
        let kh = h / (hq / hkv);
        for i in 0..l {
            let mut scores: Vec<f32> = (0..s)
                .map(|j| {
                    let dot: f32 = (0..d).map(|e| q[(h * l + i) * d + e] * k[(kh * s + j) * d + e]).sum();
                    match mask(h, i, j) {
                        Some(add) => dot * scale + add,
                        None => f32::NEG_INFINITY,
                    }
                })
                .collect();
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = scores
                .iter_mut()
                .map(|x| {
                    *x = (*x - m).exp();
                    *x
                })
                .sum();
            for e in 0..d {
                out[(h * l + i) * d + e] = (0..s).map(|j| scores[j] / z * v[(kh * s + j) * d + e]).sum();
            }
        }
    }
    out
}

#[test]
fn scaled_dot_product_attention_masks() {
    // Grouped-query: 4 query heads share 2 key/value heads; L = 3 queries over S = 5 keys.
    let (hq, hkv, l, s, d) = (4, 2, 3, 5, 8);
    let (q, qv) = host_randn(&[1, hq as i32, l as i32, d as i32], 3);
    let (k, kv) = host_randn(&[1, hkv as i32, s as i32, d as i32], 4);
    let (v, vv) = host_randn(&[1, hkv as i32, s as i32, d as i32], 5);
    let scale = 1.0 / (d as f32).sqrt();
    let none = fast::scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::None, None).unwrap();
    assert_close(&vals(&none), &host_attention(&qv, &kv, &vv, hq, hkv, l, s, d, scale, |_, _, _| Some(0.0)), 1e-5);
    // Causal with more keys than queries: query i sees keys j <= i + (S - L).
    let causal = fast::scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::Causal, None).unwrap();
    let want = host_attention(&qv, &kv, &vv, hq, hkv, l, s, d, scale, |_, i, j| (j <= i + s - l).then_some(0.0));
    assert_close(&vals(&causal), &want, 1e-5);
    // An additive float mask (the MLA rope-bias path) broadcast over heads.
    let bias: Vec<f32> = (0..l * s).map(|x| (x as f32 * 0.37).sin()).collect();
    let ba = f32s(&bias, &[1, 1, l as i32, s as i32]);
    let got = fast::scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::Array(&ba), None).unwrap();
    let want = host_attention(&qv, &kv, &vv, hq, hkv, l, s, d, scale, |_, i, j| Some(bias[i * s + j]));
    assert_close(&vals(&got), &want, 1e-5);
    // A boolean mask: true = attend.
    let keep: Vec<bool> = (0..l * s).map(|x| x % 3 != 1).collect();
    let ka = Array::from_slice(&keep, &[1, 1, l as i32, s as i32]).unwrap();
    let got = fast::scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::Array(&ka), None).unwrap();
    let want = host_attention(&qv, &kv, &vv, hq, hkv, l, s, d, scale, |_, i, j| keep[i * s + j].then_some(0.0));
    assert_close(&vals(&got), &want, 1e-5);
}

/// The CPU RMSNorm primitive (`kernels::rms_norm`) against MLX's `fast::rms_norm` (the op mlx-lm's
/// `nn.RMSNorm` calls): same formula, so the only difference is the order of the f32 sum of squares. Over
/// D <= 2048 terms of one sign that moves mean(x^2) by a few ulps (measured here: at most 6.6e-7 of the
/// output scale, at D = 2048). The bound, 1e-5 of the output scale, is well above that and well below formula
/// errors such as a dropped weight or 1/(D-1) for 1/D (2.4e-4 of the scale at D = 2048).
#[test]
fn kernels_rms_norm_matches_mlx() {
    use mlx_k3::kernels;
    let mut seed = 10;
    for shape in [vec![3, 8], vec![4, 37], vec![2, 5, 2048], vec![40, 2048], vec![1, 1, 1000]] {
        let d = *shape.last().unwrap();
        seed += 1;
        let (x, _) = host_randn(&shape, seed);
        let w = random::uniform(0.5, 1.5, &[d], Dtype::F32, Some(&random::key(seed + 100).unwrap())).unwrap();
        for (weight, eps) in [(Some(&w), 1e-5f32), (None, 1e-6)] {
            let want = vals(&fast::rms_norm(&x, weight, eps).unwrap());
            let got = kernels::rms_norm(&x, weight, eps).unwrap();
            assert_eq!(got.shape(), x.shape());
            assert_eq!(got.dtype(), Dtype::F32);
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_close(&vals(&got), &want, 1e-5 * scale);
        }
    }
    // A strided view (a transpose) is read through its strides.
    let (xt, _) = host_randn(&[64, 3], 30);
    let x = xt.transpose(&[1, 0]).unwrap();
    let w = random::uniform(0.5, 1.5, &[64], Dtype::F32, Some(&random::key(31).unwrap())).unwrap();
    let want = vals(&fast::rms_norm(&x, Some(&w), 1e-5).unwrap());
    assert_close(&vals(&kernels::rms_norm(&x, Some(&w), 1e-5).unwrap()), &want, 1e-5);
    // bf16 runs MLX's own op: bit-identical.
    let xb = x.astype(Dtype::BF16).unwrap();
    let wb = w.astype(Dtype::BF16).unwrap();
    let a = kernels::rms_norm(&xb, Some(&wb), 1e-5).unwrap().astype(Dtype::F32).unwrap();
    let b = fast::rms_norm(&xb, Some(&wb), 1e-5).unwrap().astype(Dtype::F32).unwrap();
    assert_eq!(vals(&a), vals(&b));
    // A weight of the wrong size is MLX's error, not a crash.
    let bad = f32s(&[1.0; 5], &[5]);
    let err = kernels::rms_norm(&x, Some(&bad), 1e-5).unwrap_err().to_string();
    assert!(err.contains("rms_norm"), "{err}");
}

#[test]
fn kernels_log_softmax_matches_mlx() {
    use mlx_k3::kernels;
    let mlx = |x: &Array| x.subtract(&x.logsumexp(&[-1], true).unwrap()).unwrap();
    // Tolerance: both sides compute the log-sum in fp32, in different orders and with exps a few ulp apart,
    // so results differ by ~1e-7 of |logsumexp| plus an ulp of x: 2e-6 * (1 + max |x|) covers it.
    let mut seed = 40;
    for (shape, scale) in
        [(vec![1, 32000], 8.0f32), (vec![3, 37], 1.0), (vec![2, 5, 1000], 30.0), (vec![130, 600], 4.0)]
    {
        seed += 1;
        let (x, host) = host_randn(&shape, seed);
        let x = x.multiply(scale).unwrap();
        mlx_k3::eval(&[&x]).unwrap();
        let got = kernels::log_softmax(&x).unwrap();
        assert_eq!(mlx_k3::graph_nodes(&[&got], None).unwrap(), 1, "one K3LogSoftmax node");
        assert_eq!(got.shape(), x.shape());
        let xmax = host.iter().fold(0.0f32, |m, v| m.max(v.abs())) * scale;
        assert_close(&vals(&got), &vals(&mlx(&x)), 2e-6 * (1.0 + xmax));
    }
    // A strided view (a transpose) is read through its strides.
    let (xt, _) = host_randn(&[64, 3], 50);
    let x = xt.transpose(&[1, 0]).unwrap();
    assert_close(&vals(&kernels::log_softmax(&x).unwrap()), &vals(&mlx(&x)), 2e-5);
    // Rows with -inf entries (masked words: exactly -inf out), all -inf, +inf and NaN (NaN rows, as MLX's).
    let (ni, inf, nan) = (f32::NEG_INFINITY, f32::INFINITY, f32::NAN);
    let special = f32s(&[1.0, ni, 2.0, ni, ni, ni, ni, ni, 0.5, inf, 1.0, 2.0, 1.0, nan, 3.0, 0.0], &[4, 4]);
    let got = vals(&kernels::log_softmax(&special).unwrap());
    let want = vals(&mlx(&special));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let same = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= 1e-6;
        assert!(same, "element {i}: got {g}, want {w}\n got {got:?}\nwant {want:?}");
    }
    assert_eq!(got[1], ni);
    // bf16 runs MLX's own ops: bit-identical.
    let (x, _) = host_randn(&[2, 300], 51);
    let xb = x.astype(Dtype::BF16).unwrap();
    let a = kernels::log_softmax(&xb).unwrap().astype(Dtype::F32).unwrap();
    let b = mlx(&xb).astype(Dtype::F32).unwrap();
    assert_eq!(vals(&a), vals(&b));
}
