//! Op groups against values computed independently: closed forms, or small cases checked by hand (the
//! expected numbers in comments were worked out on paper / with the formula next to them, not read from MLX).

mod common;

use common::{assert_close, f32s, vals};
use half::{bf16, f16};
use mlx_k3::ops::{self, arange, concatenate, eye, full, ones, stack, where_, zeros};
use mlx_k3::{random, Array, Dtype};

#[test]
fn arrays_round_trip_every_model_dtype() {
    // Values survive host -> MLX -> host exactly in every dtype the model uses.
    assert_eq!(Array::from_slice(&[true, false, true], &[3]).unwrap().to_vec::<bool>().unwrap(), [true, false, true]);
    assert_eq!(Array::from_slice(&[0u8, 7, 255], &[3]).unwrap().to_vec::<u8>().unwrap(), [0, 7, 255]);
    assert_eq!(Array::from_slice(&[0u32, u32::MAX], &[2]).unwrap().to_vec::<u32>().unwrap(), [0, u32::MAX]);
    assert_eq!(Array::from_slice(&[-5i32, 9], &[2]).unwrap().to_vec::<i32>().unwrap(), [-5, 9]);
    assert_eq!(Array::from_slice(&[i64::MIN, 3], &[2]).unwrap().to_vec::<i64>().unwrap(), [i64::MIN, 3]);
    let h = [f16::from_f32(0.5), f16::from_f32(-2.25)];
    assert_eq!(Array::from_slice(&h, &[2]).unwrap().to_vec::<f16>().unwrap(), h);
    let b = [bf16::from_f32(1.5), bf16::from_f32(-3.0e10)];
    assert_eq!(Array::from_slice(&b, &[2]).unwrap().to_vec::<bf16>().unwrap(), b);
    let a = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    assert_eq!(a.shape(), [2, 3]);
    assert_eq!((a.ndim(), a.size(), a.nbytes(), a.dtype()), (2, 6, 24, Dtype::F32));
    assert_eq!(a.dim(-1).unwrap(), 3);
    // bf16 conversion rounds to nearest even: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> 1.
    let r = f32s(&[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0], &[2]).astype(Dtype::BF16).unwrap();
    assert_eq!(vals(&r), [1.0, 1.0 + 4.0 / 256.0]);
    assert_eq!(Array::scalar(7i32).unwrap().item::<i32>().unwrap(), 7);
    assert_eq!(Array::scalar_i64(1 << 40, Dtype::I64).unwrap().item::<i64>().unwrap(), 1 << 40);
}

#[test]
fn external_memory_is_used_without_copy() {
    // from_vec hands MLX the Vec's buffer; values read back prove it was wired correctly, and the test in
    // memory.rs proves the buffer is released.
    let v: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let a = Array::from_vec(v, &[10, 100]).unwrap();
    let s = a.sum_all(false).unwrap().item::<f32>().unwrap();
    assert_eq!(s, 499_500.0); // 999 * 1000 / 2
}

#[test]
fn elementwise_closed_forms() {
    let x = f32s(&[-2.0, -0.5, 0.0, 0.5, 2.0], &[5]);
    let xs = [-2.0f32, -0.5, 0.0, 0.5, 2.0];
    let map = |f: fn(f32) -> f32| xs.iter().map(|&v| f(v)).collect::<Vec<_>>();
    assert_close(&vals(&x.exp().unwrap()), &map(f32::exp), 1e-6 * 8.0);
    assert_close(&vals(&x.tanh().unwrap()), &map(f32::tanh), 1e-6);
    assert_close(&vals(&x.sigmoid().unwrap()), &map(|v| 1.0 / (1.0 + (-v).exp())), 1e-6);
    assert_close(&vals(&x.abs().unwrap()), &map(f32::abs), 0.0);
    assert_close(&vals(&x.square().unwrap()), &map(|v| v * v), 0.0);
    assert_close(&vals(&x.negative().unwrap()), &map(|v| -v), 0.0);
    assert_close(&vals(&x.softplus().unwrap()), &map(|v| (1.0 + v.exp()).ln()), 1e-6);
    assert_close(&vals(&x.silu().unwrap()), &map(|v| v / (1.0 + (-v).exp())), 1e-6);
    assert_close(&vals(&x.erf().unwrap()), &[-0.995_322_3, -0.520_499_9, 0.0, 0.520_499_9, 0.995_322_3], 1e-6);
    let p = f32s(&[0.25, 1.0, 4.0], &[3]);
    assert_close(&vals(&p.sqrt().unwrap()), &[0.5, 1.0, 2.0], 0.0);
    assert_close(&vals(&p.rsqrt().unwrap()), &[2.0, 1.0, 0.5], 1e-6);
    assert_close(&vals(&p.log().unwrap()), &[-std::f32::consts::LN_2 * 2.0, 0.0, std::f32::consts::LN_2 * 2.0], 1e-6);
    assert_close(&vals(&p.log2().unwrap()), &[-2.0, 0.0, 2.0], 1e-6);
    assert_close(&vals(&p.reciprocal().unwrap()), &[4.0, 1.0, 0.25], 0.0);
    // log1p / expm1 keep precision near zero: log1p(1e-7) = 1e-7 - 5e-15.
    let tiny = f32s(&[1e-7], &[1]);
    assert_close(&vals(&tiny.log1p().unwrap()), &[1e-7], 1e-13);
    assert_close(&vals(&tiny.expm1().unwrap()), &[1e-7], 1e-13);
    assert_close(&vals(&f32s(&[-1.5, 1.5, 2.5], &[3]).round(0).unwrap()), &[-2.0, 2.0, 2.0], 0.0);
    assert_close(&vals(&f32s(&[-1.5, 1.5], &[2]).floor().unwrap()), &[-2.0, 1.0], 0.0);
    assert_close(&vals(&f32s(&[-1.5, 1.5], &[2]).ceil().unwrap()), &[-1.0, 2.0], 0.0);
    assert_close(&vals(&x.clip(Some(-1.0), Some(1.0)).unwrap()), &[-1.0, -0.5, 0.0, 0.5, 1.0], 0.0);
    assert_close(&vals(&x.clip(None, Some(0.0)).unwrap()), &[-2.0, -0.5, 0.0, 0.0, 0.0], 0.0);
}

#[test]
fn binary_ops_broadcast_and_take_the_arrays_dtype_for_scalars() {
    let a = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let row = f32s(&[10.0, 20.0, 30.0], &[3]);
    assert_eq!(vals(&a.add(&row).unwrap()), [11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
    assert_eq!(vals(&a.subtract(1.0f32).unwrap()), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(vals(&a.multiply(&row).unwrap()), [10.0, 40.0, 90.0, 40.0, 100.0, 180.0]);
    assert_eq!(vals(&a.divide(2.0f32).unwrap()), [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]);
    assert_eq!(vals(&a.power(2.0f32).unwrap()), [1.0, 4.0, 9.0, 16.0, 25.0, 36.0]);
    assert_eq!(vals(&a.maximum(3.5f32).unwrap()), [3.5, 3.5, 3.5, 4.0, 5.0, 6.0]);
    assert_eq!(vals(&a.minimum(3.5f32).unwrap()), [1.0, 2.0, 3.0, 3.5, 3.5, 3.5]);
    assert_close(
        &vals(&f32s(&[0.0, 1.0], &[2]).logaddexp(0.0f32).unwrap()),
        &[2f32.ln(), (1.0 + 1f32.exp()).ln()],
        1e-6,
    );
    // A Rust scalar adopts a bf16 array's dtype (as Python scalars do), so no promotion to f32.
    let h = a.astype(Dtype::BF16).unwrap();
    assert_eq!(h.multiply(0.5f32).unwrap().dtype(), Dtype::BF16);
    // Comparisons and logic produce bools.
    let gt = a.greater(3.0f32).unwrap();
    assert_eq!(gt.dtype(), Dtype::Bool);
    assert_eq!(gt.to_vec::<bool>().unwrap(), [false, false, false, true, true, true]);
    assert_eq!(a.equal(2.0f32).unwrap().to_vec::<bool>().unwrap(), [false, true, false, false, false, false]);
    assert_eq!(
        gt.logical_and(&a.less(6.0f32).unwrap()).unwrap().to_vec::<bool>().unwrap(),
        [false, false, false, true, true, false]
    );
    assert_eq!(gt.logical_not().unwrap().to_vec::<bool>().unwrap(), [true, true, true, false, false, false]);
    let w = where_(&gt, &a, &zeros(&[2, 3], Dtype::F32).unwrap()).unwrap();
    assert_eq!(vals(&w), [0.0, 0.0, 0.0, 4.0, 5.0, 6.0]);
    // Integer ops stay integers.
    let i = Array::from_slice(&[7i32, -7, 12], &[3]).unwrap();
    assert_eq!(i.floor_divide(2).unwrap().to_vec::<i32>().unwrap(), [3, -4, 6]);
    assert_eq!(i.remainder(5).unwrap().to_vec::<i32>().unwrap(), [2, 3, 2]);
    assert_eq!(i.bitwise_and(4).unwrap().to_vec::<i32>().unwrap(), [4, 0, 4]);
    assert_eq!(i.left_shift(1).unwrap().to_vec::<i32>().unwrap(), [14, -14, 24]);
    let n = f32s(&[f32::NAN, 1.0, f32::INFINITY], &[3]);
    assert_eq!(n.isnan().unwrap().to_vec::<bool>().unwrap(), [true, false, false]);
    assert_eq!(n.isinf().unwrap().to_vec::<bool>().unwrap(), [false, false, true]);
    assert!(a.allclose(&a.add(1e-7f32).unwrap(), 1e-5, 1e-6).unwrap().item::<bool>().unwrap());
    assert!(!a.array_equal(&a.add(1.0f32).unwrap()).unwrap().item::<bool>().unwrap());
}

#[test]
fn reductions_closed_forms() {
    // a[i][j] = 3i + j + 1 for a 2x3 matrix.
    let a = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    assert_eq!(a.sum_all(false).unwrap().item::<f32>().unwrap(), 21.0);
    assert_eq!(vals(&a.sum(&[0], false).unwrap()), [5.0, 7.0, 9.0]);
    assert_eq!(a.sum(&[1], true).unwrap().shape(), [2, 1]);
    assert_eq!(vals(&a.mean(&[1], false).unwrap()), [2.0, 5.0]);
    assert_eq!(vals(&a.max(&[0], false).unwrap()), [4.0, 5.0, 6.0]);
    assert_eq!(vals(&a.min(&[-1], false).unwrap()), [1.0, 4.0]);
    assert_eq!(vals(&a.prod(&[1], false).unwrap()), [6.0, 120.0]);
    assert_eq!(a.argmax(1, false).unwrap().to_vec::<u32>().unwrap(), [2, 2]);
    assert_eq!(a.argmin(0, false).unwrap().to_vec::<u32>().unwrap(), [0, 0, 0]);
    // var of [1,2,3] is 2/3 (ddof 0) and 1 (ddof 1).
    assert_close(&vals(&a.var(&[1], false, 0).unwrap()), &[2.0 / 3.0, 2.0 / 3.0], 1e-6);
    assert_close(&vals(&a.var(&[1], false, 1).unwrap()), &[1.0, 1.0], 1e-6);
    // logsumexp([1,2,3]) = 3 + ln(1 + e^-1 + e^-2).
    let lse = 3.0 + (1.0 + (-1f32).exp() + (-2f32).exp()).ln();
    assert_close(&vals(&a.logsumexp(&[1], false).unwrap()), &[lse, lse + 3.0], 1e-5);
    // softmax([1,2,3]) = e^(x - lse).
    let sm = vals(&a.softmax(&[1], true).unwrap());
    let want: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
        .iter()
        .enumerate()
        .map(|(i, v)| (v - if i < 3 { lse } else { lse + 3.0 }).exp())
        .collect();
    assert_close(&sm, &want, 1e-6);
    // A precise bf16 softmax sums to 1 within bf16 rounding of each term.
    let hsm = a.astype(Dtype::BF16).unwrap().softmax(&[1], true).unwrap();
    assert_close(&vals(&hsm.sum(&[1], false).unwrap()), &[1.0, 1.0], 1.0 / 128.0);
    let b = Array::from_slice(&[true, false, true, true], &[2, 2]).unwrap();
    assert_eq!(b.all(&[1], false).unwrap().to_vec::<bool>().unwrap(), [false, true]);
    assert_eq!(b.any(&[0], false).unwrap().to_vec::<bool>().unwrap(), [true, true]);
    assert_eq!(vals(&a.cumsum(1, false, true).unwrap()), [1.0, 3.0, 6.0, 4.0, 9.0, 15.0]);
    assert_eq!(vals(&a.cumsum(1, true, true).unwrap()), [6.0, 5.0, 3.0, 15.0, 11.0, 6.0]);
    assert_eq!(vals(&a.cumsum(1, false, false).unwrap()), [0.0, 1.0, 3.0, 0.0, 4.0, 9.0]);
}

#[test]
fn sorting_and_selection() {
    let x = f32s(&[3.0, -1.0, 7.0, 0.0, 5.0, 2.0], &[6]);
    assert_eq!(vals(&x.sort(0).unwrap()), [-1.0, 0.0, 2.0, 3.0, 5.0, 7.0]);
    assert_eq!(x.argsort(0).unwrap().to_vec::<u32>().unwrap(), [1, 3, 5, 0, 4, 2]);
    let mut top = vals(&x.topk(2, 0).unwrap());
    top.sort_by(f32::total_cmp);
    assert_eq!(top, [5.0, 7.0]);
    // argpartition(kth=3): the element at position 3 is the 4th smallest (3.0); smaller ones before it.
    let idx = x.argpartition(3, 0).unwrap().to_vec::<u32>().unwrap();
    let xs = [3.0f32, -1.0, 7.0, 0.0, 5.0, 2.0];
    assert_eq!(xs[idx[3] as usize], 3.0);
    assert!(idx[..3].iter().all(|&i| xs[i as usize] < 3.0));
    assert!(idx[4..].iter().all(|&i| xs[i as usize] > 3.0));
    // argsort is stable: equal keys keep their order.
    let ties = f32s(&[1.0, 0.0, 1.0, 0.0], &[4]);
    assert_eq!(ties.argsort(0).unwrap().to_vec::<u32>().unwrap(), [1, 3, 0, 2]);
}

#[test]
fn shapes_and_indexing() {
    let a = arange(0.0, 24.0, 1.0, Dtype::F32).unwrap().reshape(&[2, 3, 4]).unwrap();
    assert_eq!(a.reshape(&[6, -1]).unwrap().shape(), [6, 4]);
    let t = a.transpose(&[2, 0, 1]).unwrap();
    assert_eq!(t.shape(), [4, 2, 3]);
    // t[k][i][j] = a[i][j][k] = 12i + 4j + k; t[1] = [[1,5,9],[13,17,21]].
    assert_eq!(
        vals(&t.take(&Array::from_slice(&[1i32], &[1]).unwrap(), 0).unwrap()),
        [1.0, 5.0, 9.0, 13.0, 17.0, 21.0]
    );
    assert_eq!(a.swapaxes(0, 2).unwrap().shape(), [4, 3, 2]);
    assert_eq!(a.moveaxis(0, -1).unwrap().shape(), [3, 4, 2]);
    assert_eq!(a.expand_dims(&[0, 2]).unwrap().shape(), [1, 2, 1, 3, 4]);
    assert_eq!(a.expand_dims(&[0]).unwrap().squeeze(&[0]).unwrap().shape(), [2, 3, 4]);
    assert_eq!(a.reshape(&[1, 24, 1]).unwrap().squeeze_all().unwrap().shape(), [24]);
    assert_eq!(a.flatten(0, 1).unwrap().shape(), [6, 4]);
    assert_eq!(a.t().unwrap().shape(), [4, 3, 2]);
    // slice a[:, 1:3, ::2] -> [[4,6],[8,10]], [[16,18],[20,22]].
    let s = a.slice(&[0, 1, 0], &[2, 3, 4], &[1, 1, 2]).unwrap();
    assert_eq!(vals(&s), [4.0, 6.0, 8.0, 10.0, 16.0, 18.0, 20.0, 22.0]);
    assert_eq!(vals(&a.slice_axis(-1, -1, 4).unwrap()), [3.0, 7.0, 11.0, 15.0, 19.0, 23.0]);
    // dynamic slice along axis 2 starting at an array-held position (no host read).
    let start = Array::from_slice(&[2i32], &[1]).unwrap();
    assert_eq!(
        vals(&a.slice_dynamic(&start, &[2], &[2, 3, 2]).unwrap().reshape(&[-1]).unwrap())[..4],
        [2.0, 3.0, 6.0, 7.0]
    );
    let upd = a.slice_update(&full(&[2, 1, 4], -1.0, Dtype::F32).unwrap(), &[0, 0, 0], &[2, 1, 4], &[1, 1, 1]).unwrap();
    assert_eq!(
        vals(&upd.sum_all(false).unwrap())[0],
        276.0 - (0.0 + 1.0 + 2.0 + 3.0 + 12.0 + 13.0 + 14.0 + 15.0) - 8.0
    );
    let parts = a.split(2, 2).unwrap();
    assert_eq!(parts.len(), 2);
    assert_eq!(vals(&parts[1].slice_axis(1, 0, 1).unwrap()), [2.0, 3.0, 14.0, 15.0]);
    let at = a.split_at(&[1, 3], 2).unwrap();
    assert_eq!(at.iter().map(|p| p.shape()[2]).collect::<Vec<_>>(), [1, 2, 1]);
    let c = concatenate(&[&parts[0], &parts[1]], 2).unwrap();
    assert!(c.array_equal(&a).unwrap().item::<bool>().unwrap());
    assert_eq!(stack(&[&parts[0], &parts[1]], 0).unwrap().shape(), [2, 2, 3, 2]);
    let m = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let idx = Array::from_slice(&[2u32, 0, 1, 1], &[2, 2]).unwrap();
    assert_eq!(vals(&m.take_along_axis(&idx, 1).unwrap()), [3.0, 1.0, 5.0, 5.0]);
    let put =
        m.put_along_axis(&Array::from_slice(&[1u32, 2], &[2, 1]).unwrap(), &f32s(&[-1.0, -2.0], &[2, 1]), 1).unwrap();
    assert_eq!(vals(&put), [1.0, -1.0, 3.0, 4.0, 5.0, -2.0]);
    assert_eq!(vals(&f32s(&[1.0, 2.0], &[2, 1]).broadcast_to(&[2, 3]).unwrap()), [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
    assert_eq!(vals(&f32s(&[1.0, 2.0], &[2]).pad(&[0], &[1], &[2], Some(9.0)).unwrap()), [9.0, 1.0, 2.0, 9.0, 9.0]);
    assert_eq!(vals(&f32s(&[1.0, 2.0], &[2]).repeat(2, 0).unwrap()), [1.0, 1.0, 2.0, 2.0]);
    assert_eq!(vals(&f32s(&[1.0, 2.0], &[2]).tile(&[2]).unwrap()), [1.0, 2.0, 1.0, 2.0]);
    let sq = ones(&[3, 3], Dtype::F32).unwrap();
    assert_eq!(vals(&sq.tril(0).unwrap()), [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]);
    assert_eq!(vals(&sq.triu(1).unwrap()), [0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]);
    assert_eq!(vals(&eye(2, 3, 1, Dtype::F32).unwrap()), [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]);
    // view reinterprets bits: 1.0f32 is 0x3F800000.
    assert_eq!(f32s(&[1.0], &[1]).view(Dtype::U32).unwrap().to_vec::<u32>().unwrap(), [0x3F80_0000]);
    assert_eq!(f32s(&[1.0], &[1]).view(Dtype::U8).unwrap().shape(), [4]);
    let nc = a.transpose(&[2, 1, 0]).unwrap();
    assert_eq!(nc.contiguous().unwrap().to_vec::<f32>().unwrap(), vals(&nc));
    assert_eq!(vals(&arange(1.0, 2.0, 0.25, Dtype::F32).unwrap()), [1.0, 1.25, 1.5, 1.75]);
}

#[test]
fn matmul_addmm_gather_mm() {
    // [[1,2],[3,4]] @ [[5,6],[7,8]] = [[19,22],[43,50]].
    let a = f32s(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let b = f32s(&[5.0, 6.0, 7.0, 8.0], &[2, 2]);
    assert_eq!(vals(&a.matmul(&b).unwrap()), [19.0, 22.0, 43.0, 50.0]);
    // addmm: 2 * c + 0.5 * (a @ b) with c = 1.
    let c = ones(&[2, 2], Dtype::F32).unwrap();
    assert_eq!(vals(&ops::addmm(&c, &a, &b, 0.5, 2.0).unwrap()), [11.5, 13.0, 23.5, 27.0]);
    // Batched: a stack of [I, 2I] times b.
    let i2 = eye(2, 2, 0, Dtype::F32).unwrap();
    let batch = stack(&[&i2, &i2.multiply(2.0f32).unwrap()], 0).unwrap();
    assert_eq!(vals(&batch.matmul(&b).unwrap()), [5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 14.0, 16.0]);
    // gather_mm picks b[rhs] per row of a: x (3,1,2), experts w (2,2,2) = [I, 2I], rhs [1,0,1].
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 1, 2]);
    let rhs = Array::from_slice(&[1u32, 0, 1], &[3]).unwrap();
    let y = ops::gather_mm(&x, &batch, None, Some(&rhs), false).unwrap();
    assert_eq!(y.shape(), [3, 1, 2]);
    assert_eq!(vals(&y), [2.0, 4.0, 3.0, 4.0, 10.0, 12.0]);
    let sorted = Array::from_slice(&[0u32, 1, 1], &[3]).unwrap();
    assert_eq!(vals(&ops::gather_mm(&x, &batch, None, Some(&sorted), true).unwrap()), [1.0, 2.0, 6.0, 8.0, 10.0, 12.0]);
}

#[test]
fn depthwise_conv1d_matches_hand_computation() {
    // x: [N=1, L=4, C=2], channel c of x is (c+1) * [1,2,3,4]; depthwise kernel K=2: w[c] = [1, c+1]
    // (weight shape [C_out=2, K=2, C_in/groups=1]). y[t][c] = x[t][c] * w[c][0] + x[t+1][c] * w[c][1].
    let x = f32s(&[1.0, 2.0, 2.0, 4.0, 3.0, 6.0, 4.0, 8.0], &[1, 4, 2]);
    let w = f32s(&[1.0, 1.0, 1.0, 2.0], &[2, 2, 1]);
    let y = x.conv1d(&w, 1, 0, 1, 2).unwrap();
    assert_eq!(y.shape(), [1, 3, 2]);
    // c=0: 1+2, 2+3, 3+4; c=1: 2+2*4, 4+2*6, 6+2*8.
    assert_eq!(vals(&y), [3.0, 10.0, 5.0, 16.0, 7.0, 22.0]);
}

#[test]
fn random_is_reproducible_and_in_range() {
    let k = random::key(42).unwrap();
    let a = random::uniform(-2.0, 3.0, &[4096], Dtype::F32, Some(&k)).unwrap();
    let b = random::uniform(-2.0, 3.0, &[4096], Dtype::F32, Some(&k)).unwrap();
    assert!(a.array_equal(&b).unwrap().item::<bool>().unwrap(), "same key, same numbers");
    let v = vals(&a);
    assert!(v.iter().all(|&x| (-2.0..3.0).contains(&x)));
    // Mean of U(-2,3) is 0.5 with sd 5/sqrt(12)/sqrt(4096) = 0.0226; allow 5 sd.
    let mean = v.iter().sum::<f32>() / v.len() as f32;
    assert!((mean - 0.5).abs() < 0.113, "mean {mean}");
    let keys = random::split(&k, 3).unwrap();
    assert_eq!(keys.shape(), [3, 2]);
    let n = vals(&random::normal(&[8192], Dtype::F32, 1.0, 2.0, Some(&k)).unwrap());
    let m = n.iter().sum::<f32>() / n.len() as f32;
    let sd = (n.iter().map(|x| (x - m) * (x - m)).sum::<f32>() / n.len() as f32).sqrt();
    assert!((m - 1.0).abs() < 5.0 * 2.0 / 90.5 && (sd - 2.0).abs() < 0.1, "mean {m} sd {sd}");
    let r = random::randint(3, 7, &[1000], Dtype::I32, Some(&k)).unwrap().to_vec::<i32>().unwrap();
    assert!(r.iter().all(|&x| (3..7).contains(&x)) && (3..7).all(|v| r.contains(&v)));
    // A logit 100 above the rest is chosen (probability 1 - 3e-43).
    let logits = f32s(&[0.0, 100.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], &[2, 4]);
    assert_eq!(random::categorical(&logits, -1, Some(&k)).unwrap().to_vec::<u32>().unwrap(), [1, 0]);
    assert_eq!(random::gumbel(&[5], Dtype::F32, Some(&k)).unwrap().shape(), [5]);
}

#[test]
fn evaluation_is_lazy_until_asked() {
    let a = f32s(&[1.0, 2.0], &[2]).multiply(3.0f32).unwrap();
    assert!(!a.is_evaluated());
    a.async_eval().unwrap();
    a.eval().unwrap();
    assert!(a.is_evaluated());
    let (x, y) = (a.add(1.0f32).unwrap(), a.add(2.0f32).unwrap());
    mlx_k3::eval(&[&x, &y]).unwrap();
    assert!(x.is_evaluated() && y.is_evaluated());
    assert_eq!(format!("{x:?}"), "Array(shape=[2], dtype=float32)");
    assert!(x.to_string_eval().unwrap().contains("4"));
    // Clones share the array.
    assert_eq!(x.clone().id(), x.id());
}
