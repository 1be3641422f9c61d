//! The fused MoE router against mlx-lm's `_group_expert_select` composed from plain MLX ops
//! (`route_reference`, and the model's own `moe::route`), on random and adversarial inputs.
//!
//! On the CPU the primitive must be bit-identical: the same indices in the same order (MLX's argpartition
//! is `std::nth_element` with a (value, index) comparator; the kernel runs the same selection) and the same
//! weight bits. Adversarial cases: all-equal logits, few distinct levels (many ties), saturated sigmoids,
//! scores that are exactly 0 next to dropped groups' zeros, negative biased scores (a dropped group's 0 can
//! win), NaN logits, values at the exp cut-offs, bf16/f16 logits. GPU devices (when present) must give the
//! same index sets and weights within fp32 rounding (their kernel sorts, as MLX's GPU argpartition does).

use mlx_k3::kernels::{force_scalar, moe_router, route_reference, RouterParams};
use mlx_k3::model::moe::{route, RouterParams as ModelRouterParams};
use mlx_k3::{with_device, Array, Device, Dtype};

/// xorshift64* for reproducible inputs.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform().max(1e-7), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Clone, Copy, Debug)]
enum Pattern {
    Normal,
    Equal,
    Levels,
    Saturated,
    ExpCutoffs,
    WithNan,
}

fn logits(rng: &mut Rng, rows: usize, e: usize, pat: Pattern) -> Vec<f32> {
    let mut v = vec![0.0f32; rows * e];
    for (i, x) in v.iter_mut().enumerate() {
        *x = match pat {
            Pattern::Normal => 2.0 * rng.normal(),
            Pattern::Equal => 0.25,
            Pattern::Levels => [-1.0, 0.0, 0.5, 1.0][rng.below(4)],
            Pattern::Saturated => [-120.0, -40.0, 17.0, 40.0, 100.0, 0.0][rng.below(6)],
            Pattern::ExpCutoffs => {
                let base = [88.0f32, 87.99999, 88.00001, 0.0, 1e-30, 0.34657359, 60.999996][rng.below(7)];
                if rng.below(2) == 0 {
                    base
                } else {
                    -base
                }
            }
            Pattern::WithNan => {
                if i % 7 == 3 {
                    f32::NAN
                } else {
                    rng.normal()
                }
            }
        };
    }
    v
}

#[derive(Clone, Copy, Debug)]
enum BiasKind {
    None,
    Small,
    Negative,
    Levels,
}

fn bias(rng: &mut Rng, e: usize, kind: BiasKind) -> Option<Vec<f32>> {
    match kind {
        BiasKind::None => None,
        BiasKind::Small => Some((0..e).map(|_| 0.05 * rng.normal()).collect()),
        // Selection scores below zero: a dropped group's 0 beats every kept expert.
        BiasKind::Negative => Some((0..e).map(|_| -2.0 + 0.1 * rng.normal()).collect()),
        BiasKind::Levels => Some((0..e).map(|_| [0.0, 0.125, -0.125][rng.below(3)]).collect()),
    }
}

struct Case {
    rows: usize,
    e: usize,
    p: RouterParams,
    pat: Pattern,
    bias: BiasKind,
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    let pats =
        [Pattern::Normal, Pattern::Equal, Pattern::Levels, Pattern::Saturated, Pattern::ExpCutoffs, Pattern::WithNan];
    let biases = [BiasKind::None, BiasKind::Small, BiasKind::Negative, BiasKind::Levels];
    let shapes: [(usize, i32, i32, i32); 9] = [
        // (experts, top_k, n_group, topk_group)
        (896, 16, 1, 1),
        (1024, 32, 1, 1),
        (256, 8, 8, 4),
        (64, 6, 8, 3),
        (128, 8, 4, 4),
        (16, 4, 1, 1),
        (16, 1, 2, 1),
        (160, 6, 16, 1),
        (7, 7, 1, 1),
    ];
    for (si, &(e, k, ng, kg)) in shapes.iter().enumerate() {
        for (pi, &pat) in pats.iter().enumerate() {
            for (bi, &bias) in biases.iter().enumerate() {
                let rows = [1, 3, 40][(si + pi + bi) % 3];
                let renormalize = (si + bi) % 4 != 3;
                let scale = [1.0, 2.5, 0.7][(pi + bi) % 3];
                let p =
                    RouterParams { top_k: k, n_group: ng, topk_group: kg, routed_scaling_factor: scale, renormalize };
                out.push(Case { rows, e, p, pat, bias });
            }
        }
    }
    out
}

thread_local! {
    /// (rows whose k indices are not in descending-weight order, rows checked): shows that the order
    /// being reproduced is nth_element's, not a sort.
    static UNSORTED: std::cell::RefCell<(usize, usize)> = const { std::cell::RefCell::new((0, 0)) };
}

fn bits(a: &Array) -> Vec<u32> {
    a.astype(Dtype::F32).unwrap().to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Runs every case with `dtype` logits on the current device; returns the number of rows checked.
fn run_cases(dtype: Dtype, exact: bool) -> usize {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut rows_checked = 0;
    for c in cases() {
        let lg = logits(&mut rng, c.rows, c.e, c.pat);
        let x = Array::from_slice(&lg, &[1, c.rows as i32, c.e as i32]).unwrap().astype(dtype).unwrap();
        let b = bias(&mut rng, c.e, c.bias).map(|b| Array::from_slice(&b, &[c.e as i32]).unwrap());
        let mask_host: Vec<u8> = (0..c.e).map(|i| (i % 5 == 0) as u8).collect();
        let mask = Array::from_slice(&mask_host, &[c.e as i32]).unwrap();
        let r = moe_router(&x, b.as_ref(), Some(&mask), c.p).unwrap();
        let (ri, rw) = route_reference(&x, b.as_ref(), c.p).unwrap();
        let what = format!("{dtype} {:?} bias {:?} E={} rows={} {:?}", c.pat, c.bias, c.e, c.rows, c.p);
        assert_eq!(r.indices.shape(), ri.shape(), "{what}: index shape");
        assert_eq!(r.weights.dtype(), dtype, "{what}: weight dtype");
        let (gi, wi) = (r.indices.to_vec::<u32>().unwrap(), ri.to_vec::<u32>().unwrap());
        let prot = r.protected.as_ref().unwrap().to_vec::<bool>().unwrap();
        for (j, &i) in gi.iter().enumerate() {
            assert_eq!(prot[j], mask_host[i as usize] != 0, "{what}: protected flag of slot {j}");
        }
        if exact {
            assert_eq!(gi, wi, "{what}: indices (order included)");
            let k = c.p.top_k as usize;
            let sel: Vec<f32> = r.weights.astype(Dtype::F32).unwrap().to_vec_f32().unwrap();
            UNSORTED.with(|u| {
                let mut u = u.borrow_mut();
                for row in 0..c.rows {
                    let w = &sel[row * k..(row + 1) * k];
                    u.1 += 1;
                    if w.windows(2).any(|p| p[0] < p[1]) {
                        u.0 += 1;
                    }
                }
            });
            assert_eq!(bits(&r.weights), bits(&rw), "{what}: weight bits");
            // The model's own port of mlx-lm (moe::route) agrees too.
            let mp = ModelRouterParams {
                top_k: c.p.top_k,
                n_group: c.p.n_group,
                topk_group: c.p.topk_group,
                routed_scaling_factor: c.p.routed_scaling_factor,
                renormalize: c.p.renormalize,
            };
            if c.p.n_group == 1 || c.p.topk_group < c.p.n_group {
                let (mi, mw) = route(&x, b.as_ref(), mp).unwrap();
                assert_eq!(gi, mi.to_vec::<u32>().unwrap(), "{what}: indices vs moe::route");
                assert_eq!(bits(&r.weights), bits(&mw), "{what}: weights vs moe::route");
            }
        } else {
            // GPU: the same sets per row (MLX's GPU sorts; so does the kernel) and weights to fp32 rounding.
            let k = c.p.top_k as usize;
            for row in 0..c.rows {
                let mut a = gi[row * k..(row + 1) * k].to_vec();
                let mut b = wi[row * k..(row + 1) * k].to_vec();
                a.sort_unstable();
                b.sort_unstable();
                if !lg[row * c.e..(row + 1) * c.e].iter().any(|v| v.is_nan()) {
                    assert_eq!(a, b, "{what}: index set of row {row}");
                }
            }
        }
        rows_checked += c.rows;
    }
    rows_checked
}

#[test]
fn router_is_bit_identical_to_mlx_ops_on_cpu() {
    with_device(Device::Cpu, || {
        let mut n = 0;
        for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            n += run_cases(dtype, true);
        }
        // The scalar path (CPUs without AVX2) gives the same bits.
        force_scalar(true);
        n += run_cases(Dtype::F32, true);
        force_scalar(false);
        let (unsorted, total) = UNSORTED.with(|u| *u.borrow());
        println!("router: {n} rows bit-identical to the plain-ops route (indices in order, weight bits)");
        println!("router: {unsorted} of {total} rows come back in a non-sorted (nth_element) order");
        assert!(unsorted > total / 4, "the order check would not notice a sort");
    })
    .unwrap();
}

#[test]
fn router_matches_on_gpu_devices() {
    for device in Device::available() {
        if device == Device::Cpu {
            continue;
        }
        with_device(device, || {
            let n = run_cases(Dtype::F32, false);
            println!("{device:?}: router index sets equal on {n} rows");
        })
        .unwrap();
    }
}

#[test]
fn router_batch_shapes_and_errors() {
    with_device(Device::Cpu, || {
        let p = RouterParams { top_k: 2, n_group: 1, topk_group: 1, routed_scaling_factor: 1.0, renormalize: true };
        // Any leading shape; outputs keep it.
        let x =
            Array::from_slice(&(0..2 * 3 * 5 * 8).map(|i| (i % 11) as f32 * 0.1).collect::<Vec<_>>(), &[2, 3, 5, 8])
                .unwrap();
        let r = moe_router(&x, None, None, p).unwrap();
        assert_eq!(r.indices.shape(), vec![2, 3, 5, 2]);
        assert!(r.protected.is_none());
        let (ri, _) = route_reference(&x, None, p).unwrap();
        assert_eq!(r.indices.to_vec::<u32>().unwrap(), ri.to_vec::<u32>().unwrap());
        // A non-contiguous input (transposed view) routes the same as its contiguous copy.
        let xt = x.swapaxes(1, 2).unwrap();
        let a = moe_router(&xt, None, None, p).unwrap().indices.to_vec::<u32>().unwrap();
        let b = moe_router(&xt.contiguous().unwrap(), None, None, p).unwrap().indices.to_vec::<u32>().unwrap();
        assert_eq!(a, b);

        let bad = |p: RouterParams, e: i32| {
            let x = Array::from_slice(&vec![0.0f32; e as usize], &[1, e]).unwrap();
            moe_router(&x, None, None, p).unwrap_err().to_string()
        };
        let msg = bad(RouterParams { top_k: 17, ..p }, 16);
        assert!(msg.contains("[moe_router] top_k (17) must be between 1 and the number of experts (16)"), "{msg}");
        let msg = bad(RouterParams { n_group: 3, ..p }, 16);
        assert!(msg.contains("n_group (3) must divide"), "{msg}");
        let msg = bad(RouterParams { n_group: 4, topk_group: 5, ..p }, 16);
        assert!(msg.contains("topk_group (5)"), "{msg}");
        let x = Array::from_slice(&[0.0f32; 16], &[1, 16]).unwrap();
        let wrong = Array::from_slice(&[0.0f32; 8], &[8]).unwrap();
        let msg = moe_router(&x, Some(&wrong), None, p).unwrap_err().to_string();
        assert!(msg.contains("correction bias must have shape [16]"), "{msg}");
    })
    .unwrap();
}

/// Directly against mlx-lm: `scripts/make_router_fixtures.py` saved what mlx-lm's compiled
/// `_group_expert_select` returns for 7 cases (ungrouped 896/top-16 and 1024/top-32, grouped with negative
/// scores, ties, saturated sigmoids, bf16 logits); the primitive must return the same indices in the same
/// order and the same weight bits.
#[test]
fn router_is_bit_identical_to_mlx_lm() {
    with_device(Device::Cpu, || {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/router/group_expert_select.safetensors");
        let st = mlx_k3::io::Safetensors::load(&path).unwrap();
        let cases: serde_json::Value = serde_json::from_str(&st.metadata()["cases"]).unwrap();
        let mut rows = 0;
        for (i, c) in cases.as_array().unwrap().iter().enumerate() {
            let p = RouterParams {
                top_k: c["top_k"].as_i64().unwrap() as i32,
                n_group: c["n_group"].as_i64().unwrap() as i32,
                topk_group: c["topk_group"].as_i64().unwrap() as i32,
                routed_scaling_factor: c["routed_scaling_factor"].as_f64().unwrap() as f32,
                renormalize: c["renormalize"].as_bool().unwrap(),
            };
            let x = st.get(&format!("case{i}.logits")).unwrap();
            let b = c["has_bias"].as_bool().unwrap().then(|| st.get(&format!("case{i}.bias")).unwrap());
            let r = moe_router(&x, b.as_ref(), None, p).unwrap();
            let want_i = st.get(&format!("case{i}.inds")).unwrap().to_vec::<u32>().unwrap();
            let want_w = st.get(&format!("case{i}.weights")).unwrap();
            assert_eq!(r.indices.to_vec::<u32>().unwrap(), want_i, "case {i} {p:?}: indices");
            assert_eq!(r.weights.dtype(), want_w.dtype(), "case {i}: weight dtype");
            assert_eq!(bits(&r.weights), bits(&want_w), "case {i} {p:?}: weight bits");
            rows += x.size() / x.dim(-1).unwrap() as usize;
        }
        println!("router: {rows} rows of mlx-lm's _group_expert_select reproduced bit for bit");
    })
    .unwrap();
}
