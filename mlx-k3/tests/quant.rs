//! Quantization bindings (`mlx_k3::quant`) checked against values computed independently of MLX.
//!
//! Everything expected here comes from a pure-Rust reading of docs/formats.md#mlx-quantization: a decoder of MLX's packed
//! formats (§1.2 affine bitstreams, §1.6 E2M1 / E4M3 / E8M0), a port of the affine quantizer (§1.3),
//! the nearest-grid-point property of the fp modes, and plain f64 matmuls over the decoded weights.
//! MLX is only used to produce random inputs and to run the ops under test.

use mlx_k3::quant::{self, Gather, QuantMode, QuantSpec, Quantized};
use mlx_k3::{random, Array, Dtype, Error, Result};

// ------------------------------------------------------------------------------------------------
// Inputs

/// Deterministic `N(0, 1)` samples (host copy), from a seeded MLX key.
fn normal_host(n: usize, seed: u64) -> Result<Vec<f32>> {
    random::normal(&[n as i32], Dtype::F32, 0.0, 1.0, Some(&random::key(seed)?))?.to_vec::<f32>()
}

/// A `rows x k` weight whose rows span several magnitudes (so the scales cover many binades),
/// returned as host data and as an MLX array of `shape` (whose product is `rows * k`).
fn weights(shape: &[i32], seed: u64) -> Result<(Vec<f32>, Array)> {
    let k = *shape.last().unwrap() as usize;
    let n: usize = shape.iter().map(|&d| d as usize).product();
    let mut w = normal_host(n, seed)?;
    const ROW_SCALES: [f32; 6] = [1.0, 1e-3, 30.0, 0.1, 2.5, 1e3];
    for (r, row) in w.chunks_mut(k).enumerate() {
        row.iter_mut().for_each(|x| *x *= ROW_SCALES[r % ROW_SCALES.len()]);
    }
    let a = Array::from_slice(&w, shape)?;
    Ok((w, a))
}

fn spec(mode: QuantMode, group_size: i32, bits: i32) -> QuantSpec {
    QuantSpec { group_size, bits, mode }
}

/// The fp modes with their only valid (group size, bits).
fn fp_specs() -> [QuantSpec; 3] {
    [spec(QuantMode::Mxfp4, 32, 4), spec(QuantMode::Mxfp8, 32, 8), spec(QuantMode::Nvfp4, 16, 4)]
}

fn scalar_f32(x: f32) -> Result<Array> {
    Array::from_slice(&[x], &[])
}

// ------------------------------------------------------------------------------------------------
// Element formats (docs/formats.md#floating-point-modes-mxfp4-mxfp8-nvfp4), decoded from their bit definitions

/// E2M1 nibble: sign bit 3, exponent bits 1..2 (bias 1), mantissa bit 0; exponent 0 is subnormal (m/2).
fn e2m1(code: u32) -> f32 {
    let (sign, e, m) = ((code >> 3) & 1, (code >> 1) & 3, code & 1);
    let mag = if e == 0 { m as f32 * 0.5 } else { (1.0 + m as f32 * 0.5) * 2f32.powi(e as i32 - 1) };
    if sign == 1 {
        -mag
    } else {
        mag
    }
}

/// E8M0 scale byte: 2^(e-127) (e = 0 gives the f32 subnormal 2^-127, 0xFF is NaN).
fn e8m0(e: u8) -> f32 {
    match e {
        0xFF => f32::NAN,
        0 => f32::from_bits(1 << 22),
        e => f32::from_bits((e as u32) << 23),
    }
}

/// E4M3 byte: sign bit 7, 4 exponent bits (bias 7), 3 mantissa bits, subnormals, 0x7F/0xFF NaN, no inf.
fn e4m3(b: u8) -> f32 {
    let (sign, e, m) = (b >> 7, ((b >> 3) & 15) as i32, (b & 7) as f32);
    let mag = if e == 15 && m == 7.0 {
        f32::NAN
    } else if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    if sign == 1 {
        -mag
    } else {
        mag
    }
}

/// Element `i` of the LSB-first bitstream held by `words` viewed as little-endian bytes (§1.2).
fn bitstream_code(bytes: &[u8], i: usize, bits: usize) -> u32 {
    (0..bits).fold(0u32, |code, b| {
        let pos = i * bits + b;
        code | (((bytes[pos / 8] >> (pos % 8)) & 1) as u32) << b
    })
}

#[test]
fn element_decoders_match_spec_tables() {
    // §1.6 table: codes 0..7, and 8..15 are the negatives (8 = -0).
    let table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for c in 0..16u32 {
        let v = if c < 8 { table[c as usize] } else { -table[c as usize - 8] };
        assert_eq!(e2m1(c).to_bits(), (v as f32).to_bits(), "e2m1 {c}");
    }
    assert_eq!(e8m0(127), 1.0);
    assert_eq!(e8m0(130), 8.0);
    assert_eq!(e8m0(0), 2f32.powi(-127));
    assert!(e8m0(255).is_nan());
    assert_eq!(e4m3(0x7E), 448.0); // max
    assert_eq!(e4m3(0x38), 1.0);
    assert_eq!(e4m3(0x01), 2f32.powi(-9)); // smallest subnormal
    assert_eq!(e4m3(0x08), 2f32.powi(-6)); // smallest normal
    assert_eq!(e4m3(0xC4), -3.0);
    assert!(e4m3(0x7F).is_nan() && e4m3(0xFF).is_nan());
    // 4-bit stream: nibble i of a word is element i.
    let bytes = 0x7654_3210u32.to_le_bytes();
    assert_eq!((0..8).map(|i| bitstream_code(&bytes, i, 4)).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5, 6, 7]);
}

// ------------------------------------------------------------------------------------------------
// Reference decoder of a `Quantized` (host copy)

/// A quantized tensor copied to the host, decoded without MLX.
struct Host {
    spec: QuantSpec,
    /// Unpacked codes, one per weight element, row-major.
    codes: Vec<u32>,
    /// Affine scales / biases (as stored, f32).
    scales_f: Vec<f32>,
    biases: Vec<f32>,
    /// fp-mode scale bytes (E8M0 or E4M3).
    scale_bytes: Vec<u8>,
}

impl Host {
    /// Copies `q` (quantized from a weight of `shape`) to the host, checking the §1.1 shapes and dtypes.
    fn new(q: &Quantized, spec: QuantSpec, shape: &[i32]) -> Result<Host> {
        let k = *shape.last().unwrap();
        let batch = &shape[..shape.len() - 1];
        let with_last = |d: i32| [batch, &[d]].concat();
        assert_eq!(q.weight.dtype(), Dtype::U32);
        assert_eq!(q.weight.shape(), with_last(k * spec.bits / 32), "packed shape {spec:?}");
        assert_eq!(q.scales.shape(), with_last(k / spec.group_size), "scales shape {spec:?}");
        assert_eq!(q.biases.is_some(), spec.mode == QuantMode::Affine, "biases only for affine");
        // Each row is K*bits/32 whole words, so the rows' bitstreams simply follow one another.
        let bytes: Vec<u8> = q.weight.to_vec::<u32>()?.iter().flat_map(|w| w.to_le_bytes()).collect();
        let n: usize = shape.iter().map(|&d| d as usize).product();
        let codes = (0..n).map(|i| bitstream_code(&bytes, i, spec.bits as usize)).collect();
        let mut h = Host { spec, codes, scales_f: vec![], biases: vec![], scale_bytes: vec![] };
        if spec.mode == QuantMode::Affine {
            assert_eq!(q.scales.dtype(), Dtype::F32);
            h.scales_f = q.scales.to_vec::<f32>()?;
            h.biases = q.biases.as_ref().unwrap().to_vec::<f32>()?;
        } else {
            assert_eq!(q.scales.dtype(), Dtype::U8);
            h.scale_bytes = q.scales.to_vec::<u8>()?;
        }
        Ok(h)
    }

    fn group_of(&self, i: usize) -> usize {
        i / self.spec.group_size as usize // K % group_size == 0, so flat index / g is the group
    }

    /// The decoded scale of group `g` (nvfp4 folds in `global_scale / 2688`).
    fn scale(&self, g: usize, global_scale: Option<f32>) -> f32 {
        match self.spec.mode {
            QuantMode::Affine => self.scales_f[g],
            QuantMode::Mxfp4 | QuantMode::Mxfp8 => e8m0(self.scale_bytes[g]),
            QuantMode::Nvfp4 => match global_scale {
                // Association as MLX computes it: e2m1 * (e4m3(s) * (gs / 2688)).
                Some(gs) => e4m3(self.scale_bytes[g]) * (gs / 2688.0),
                None => e4m3(self.scale_bytes[g]),
            },
        }
    }

    /// The element value of code `c` before scaling (the integer itself for affine).
    fn element(&self, c: u32) -> f32 {
        match self.spec.mode {
            QuantMode::Affine => c as f32,
            QuantMode::Mxfp8 => e4m3(c as u8),
            QuantMode::Mxfp4 | QuantMode::Nvfp4 => e2m1(c),
        }
    }

    /// Decoded weight element `i`: `s*q + b` (affine) or `element * scale`.
    fn value(&self, i: usize, global_scale: Option<f32>) -> f32 {
        let g = self.group_of(i);
        let e = self.element(self.codes[i]);
        match self.spec.mode {
            QuantMode::Affine => self.scales_f[g] * e + self.biases[g],
            _ => e * self.scale(g, global_scale),
        }
    }

    fn decode(&self, global_scale: Option<f32>) -> Vec<f32> {
        (0..self.codes.len()).map(|i| self.value(i, global_scale)).collect()
    }
}

/// Asserts two f32 vectors are bitwise identical (so -0/+0 and NaN payloads count), naming the first miss.
fn assert_bitwise(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i].to_bits() != want[i].to_bits()).collect();
    if let Some(&i) = bad.first() {
        panic!("{what}: {} of {} differ; first at {i}: got {:e}, want {:e}", bad.len(), got.len(), got[i], want[i]);
    }
}

fn dequant_f32(q: &Quantized, spec: QuantSpec, gs: Option<&Array>) -> Result<Vec<f32>> {
    let d = quant::dequantize(q, spec, gs, Some(Dtype::F32))?;
    assert_eq!(d.dtype(), Dtype::F32);
    d.to_vec::<f32>()
}

// ------------------------------------------------------------------------------------------------
// 1. dequantize(quantize(w)) == reference decoder of the returned codes and scales, bit for bit

const AFFINE_BITS: [i32; 7] = [1, 2, 3, 4, 5, 6, 8];
const GROUPS: [i32; 3] = [32, 64, 128];

#[test]
fn affine_dequantize_matches_reference_decoder_bitwise() -> Result<()> {
    // K = 384 is a multiple of every group size; 6 rows span magnitudes 1e-3..1e3.
    let shape = [6, 384];
    let (_, w) = weights(&shape, 11)?;
    for bits in AFFINE_BITS {
        for g in GROUPS {
            let sp = QuantSpec::affine(g, bits);
            let q = quant::quantize(&w, sp, None)?;
            let h = Host::new(&q, sp, &shape)?;
            assert_bitwise(&dequant_f32(&q, sp, None)?, &h.decode(None), &format!("affine b{bits} g{g}"));
            // Without an explicit dtype the output takes the scales' dtype (f32 here).
            assert_eq!(quant::dequantize(&q, sp, None, None)?.dtype(), Dtype::F32);
        }
    }
    Ok(())
}

#[test]
fn fp_modes_dequantize_match_reference_decoder_bitwise() -> Result<()> {
    let shape = [6, 256];
    let (w_host, w) = weights(&shape, 12)?;
    let amax = w_host.iter().fold(0f32, |m, x| m.max(x.abs()));
    for sp in fp_specs() {
        let q = quant::quantize(&w, sp, None)?;
        let h = Host::new(&q, sp, &shape)?;
        assert_bitwise(&dequant_f32(&q, sp, None)?, &h.decode(None), sp.mode.name());
        // §1.6: with no dtype the fp modes dequantize to bf16.
        assert_eq!(quant::dequantize(&q, sp, None, None)?.dtype(), Dtype::BF16);
    }
    // nvfp4 with a global scale (mlx-lm uses max|W|); a second, arbitrary one exercises the rounding order.
    let nv = spec(QuantMode::Nvfp4, 16, 4);
    for gs in [amax, 0.37 * amax] {
        let gsa = scalar_f32(gs)?;
        let q = quant::quantize(&w, nv, Some(&gsa))?;
        let h = Host::new(&q, nv, &shape)?;
        assert_bitwise(&dequant_f32(&q, nv, Some(&gsa))?, &h.decode(Some(gs)), &format!("nvfp4 gs={gs}"));
        if gs == amax {
            // The group holding the tensor's amax gets the largest E4M3 scale, 448 (§1.6).
            assert_eq!(h.scale_bytes.iter().max(), Some(&0x7E));
        }
    }
    Ok(())
}

#[test]
fn expert_stack_quantizes_per_row_like_a_matrix() -> Result<()> {
    // §1.1: a 3-D (E, N, K) stack quantizes exactly as its (E*N, K) reshape.
    let (_, w) = weights(&[3, 8, 128], 13)?;
    let flat = w.reshape(&[24, 128])?;
    for sp in [QuantSpec::affine(64, 4), spec(QuantMode::Mxfp4, 32, 4), spec(QuantMode::Nvfp4, 16, 4)] {
        let q3 = quant::quantize(&w, sp, None)?;
        let q2 = quant::quantize(&flat, sp, None)?;
        assert_eq!(q3.weight.to_vec::<u32>()?, q2.weight.to_vec::<u32>()?);
        let h = Host::new(&q3, sp, &[3, 8, 128])?;
        assert_bitwise(&dequant_f32(&q3, sp, None)?, &h.decode(None), sp.mode.name());
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// 2. The quantizers from first principles

/// docs/formats.md#affine-quantization-algorithm (CPU: f32 math, `rint` = ties to even): codes, scale and bias of one group.
fn ref_affine_group(w: &[f32], bits: i32) -> (Vec<u32>, f32, f32) {
    let n = ((1 << bits) - 1) as f32;
    let eps = 1e-7f32;
    let mn = w.iter().copied().fold(f32::INFINITY, f32::min);
    let mx = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let (s, bias) = if bits == 1 {
        ((mx - mn).max(eps), mn)
    } else {
        let s = ((mx - mn) / n).max(eps);
        let (s, edge) = if mn.abs() > mx.abs() { (s, mn) } else { (-s, mx) };
        let q0 = (edge / s).round_ties_even();
        if q0 != 0.0 {
            (edge / q0, edge)
        } else {
            (s, 0.0)
        }
    };
    let codes = w.iter().map(|&x| ((x - bias) / s).round_ties_even().clamp(0.0, n) as u32).collect();
    (codes, s, bias)
}

#[test]
fn affine_quantizer_matches_spec_algorithm_and_bounds() -> Result<()> {
    let shape = [6, 384];
    let (w_host, w) = weights(&shape, 21)?;
    for bits in AFFINE_BITS {
        let n = (1u32 << bits) - 1;
        for g in GROUPS {
            let sp = QuantSpec::affine(g, bits);
            let q = quant::quantize(&w, sp, None)?;
            let h = Host::new(&q, sp, &shape)?;
            let deq = dequant_f32(&q, sp, None)?;
            let mut zero_exact = 0;
            for (gi, grp) in w_host.chunks(g as usize).enumerate() {
                let at = |j: usize| gi * g as usize + j;
                let tag = format!("b{bits} g{g} group {gi}");
                // Same codes, scale and bias as the §1.3 algorithm (bitwise).
                let (codes, s, b) = ref_affine_group(grp, bits);
                assert_eq!(&h.codes[at(0)..at(g as usize)], &codes[..], "{tag}: codes");
                assert_eq!((h.scales_f[gi].to_bits(), h.biases[gi].to_bits()), (s.to_bits(), b.to_bits()), "{tag}");
                assert!(codes.iter().all(|&c| c <= n));
                let mn = grp.iter().copied().fold(f32::INFINITY, f32::min);
                let mx = grp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                // f32 slack for computing (w - b)/s and s*q + b: a few ulps of the magnitudes involved.
                let slack = 4.0 * f32::EPSILON * (mn.abs().max(mx.abs()) + b.abs() + s.abs() * n as f32);
                for (j, &x) in grp.iter().enumerate() {
                    let err = (x - deq[at(j)]).abs();
                    // Where the grid covers x (real code position within [-0.5, n + 0.5]) the error is at most
                    // half a step; beyond the grid's end x is clamped to the end level (see
                    // affine_far_edge_is_clamped), but never further than one unrounded step (mx - mn)/n.
                    let t = (x - b) / s;
                    let bound = if (-0.5..=n as f32 + 0.5).contains(&t) {
                        s.abs() / 2.0
                    } else {
                        assert!(h.codes[at(j)] == 0 || h.codes[at(j)] == n, "{tag}: clamped code");
                        (mx - mn) / n as f32
                    };
                    assert!(err <= bound + slack, "{tag} elem {j}: |{x} - {}| = {err} > {bound}", deq[at(j)]);
                }
                // §1.3: zero lies on the grid (code -q0 decodes to ~0) for b >= 2 when the group straddles 0.
                if bits >= 2 && mn < 0.0 && mx > 0.0 {
                    let c0 = (-b / s).round_ties_even();
                    assert!((0.0..=n as f32).contains(&c0), "{tag}: zero code {c0} out of range");
                    let z = s * c0 + b;
                    assert!(z.abs() <= 2.0 * f32::EPSILON * b.abs(), "{tag}: zero decodes to {z:e}");
                    zero_exact += (z == 0.0) as usize;
                }
            }
            if bits >= 2 {
                // Most groups decode zero to exactly 0.0 (s = edge/q0 then s*(-q0) + edge rounds back to 0).
                assert!(zero_exact * 2 > w_host.len() / g as usize, "b{bits} g{g}: {zero_exact} exact zeros");
            }
        }
    }
    Ok(())
}

/// The non-negative values of an fp mode's element grid, ascending (E2M1, or E4M3 up to 448).
fn fp_grid(mode: QuantMode) -> Vec<f32> {
    match mode {
        QuantMode::Mxfp8 => (0..=0x7Eu8).map(e4m3).collect(),
        _ => (0..8).map(e2m1).collect(),
    }
}

/// Half the gap between the grid values enclosing |x| (the binade's half step); beyond the top value, the
/// distance to it plus the top binade's half step.
fn half_step(grid: &[f32], x: f32) -> f32 {
    let a = x.abs();
    let top = *grid.last().unwrap();
    if a >= top {
        return (a - top) + (top - grid[grid.len() - 2]) / 2.0;
    }
    let hi = grid.iter().position(|&v| v > a).unwrap();
    (grid[hi] - grid[hi - 1]) / 2.0
}

/// Distance from x to the nearest grid value of either sign.
fn nearest_dist(grid: &[f32], x: f32) -> f32 {
    grid.iter().map(|&v| (x.abs() - v).abs()).fold(f32::INFINITY, f32::min)
}

#[test]
fn fp_quantizers_pick_scales_and_nearest_codes() -> Result<()> {
    let shape = [6, 256];
    let (w_host, w) = weights(&shape, 22)?;
    let e4m3_grid: Vec<f32> = (0..=0x7Eu8).map(e4m3).collect();
    for sp in fp_specs() {
        let q = quant::quantize(&w, sp, None)?;
        let h = Host::new(&q, sp, &shape)?;
        let deq = dequant_f32(&q, sp, None)?;
        let grid = fp_grid(sp.mode);
        let fmax = *grid.last().unwrap();
        for (gi, grp) in w_host.chunks(sp.group_size as usize).enumerate() {
            let tag = format!("{} group {gi}", sp.mode.name());
            let amax = grp.iter().fold(0f32, |m, x| m.max(x.abs()));
            let s = h.scale(gi, None);
            if sp.mode == QuantMode::Nvfp4 {
                // E4M3 scale = a nearest E4M3 value to amax/6 (ties either way).
                let target = amax / 6.0;
                assert!((s - target).abs() <= nearest_dist(&e4m3_grid, target) * (1.0 + 1e-6), "{tag}: scale {s}");
            } else {
                // E8M0 scale = the smallest power of two with amax/scale <= fmax (0.32.4 rounds up, §1.6).
                assert!(amax / s <= fmax && amax / (s / 2.0) > fmax, "{tag}: amax {amax} scale {s}");
            }
            if s == 0.0 {
                // nvfp4 only: amax/6 is below half the smallest E4M3 subnormal (2^-10), so the scale
                // rounds to 0 and the whole group decodes to zeros (what a global scale avoids).
                assert!(sp.mode == QuantMode::Nvfp4 && amax / 6.0 <= 2f32.powi(-10), "{tag}: zero scale");
                let base = gi * sp.group_size as usize;
                assert!(deq[base..base + grp.len()].iter().all(|&v| v == 0.0), "{tag}");
                continue;
            }
            for (j, &x) in grp.iter().enumerate() {
                let i = gi * sp.group_size as usize + j;
                let xs = x / s; // exact for power-of-two scales; one rounding for nvfp4
                let v = h.element(h.codes[i]);
                assert!(v == 0.0 || v.is_sign_negative() == (x < 0.0), "{tag} elem {j}: sign of {x} -> {v}");
                // The code is a nearest grid value (tiny slack for the rounding of x/s in nvfp4).
                let d = (xs - v).abs();
                assert!(d <= nearest_dist(&grid, xs) + 1e-6 * xs.abs(), "{tag} elem {j}: {xs} -> {v}");
                // Round trip within half a step of x's binade, times the group scale.
                let err = (x - deq[i]).abs();
                assert!(err <= half_step(&grid, xs) * s * (1.0 + 1e-6), "{tag} elem {j}: |{x} - {}|", deq[i]);
            }
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// 3. Hand-made exact cases

/// Quantizes one (1, len) row and returns (codes, dequantized f32).
fn roundtrip_row(row: &[f32], sp: QuantSpec, gs: Option<f32>) -> Result<(Host, Vec<f32>)> {
    let shape = [1, row.len() as i32];
    let w = Array::from_slice(row, &shape)?;
    let gsa = gs.map(scalar_f32).transpose()?;
    let q = quant::quantize(&w, sp, gsa.as_ref())?;
    let h = Host::new(&q, sp, &shape)?;
    let d = dequant_f32(&q, sp, gsa.as_ref())?;
    assert_bitwise(&d, &h.decode(gs), "hand case decoder");
    Ok((h, d))
}

#[test]
fn affine_grid_values_reproduce_exactly() -> Result<()> {
    // 4-bit grids of step 0.25 reaching both ends. Larger |min| -> positive scale, bias = min;
    // larger |max| -> negative scale, bias = max (the larger-magnitude edge is code 0).
    let up: Vec<f32> = (0..32).map(|i| -2.0 + 0.25 * (i % 16) as f32).collect();
    let (h, d) = roundtrip_row(&up, QuantSpec::affine(32, 4), None)?;
    assert_eq!((h.scales_f[0], h.biases[0]), (0.25, -2.0));
    assert_eq!(h.codes, (0..32).map(|i| i % 16).collect::<Vec<u32>>());
    assert_bitwise(&d, &up, "affine grid, positive scale");
    assert!(d.contains(&0.0)); // code 8

    let down: Vec<f32> = (0..64).map(|i| 2.0 - 0.25 * ((i * 7) % 16) as f32).collect();
    let (h, d) = roundtrip_row(&down, QuantSpec::affine(64, 4), None)?;
    assert_eq!((h.scales_f[0], h.biases[0]), (-0.25, 2.0));
    assert_eq!(h.codes, (0..64).map(|i| (i * 7) % 16).collect::<Vec<u32>>());
    assert_bitwise(&d, &down, "affine grid, negative scale");

    // 8-bit, group 128: integers -128..127 (|min| larger: s = 1, bias = -128).
    let ints: Vec<f32> = (0..128).map(|i| (2 * i - 128) as f32 + (i % 2) as f32).collect();
    let (h, d) = roundtrip_row(&ints, QuantSpec::affine(128, 8), None)?;
    assert_eq!((h.scales_f[0], h.biases[0]), (1.0, -128.0));
    assert_bitwise(&d, &ints, "affine 8-bit integers");
    Ok(())
}

#[test]
fn affine_zero_and_constant_groups() -> Result<()> {
    for bits in AFFINE_BITS {
        // All zero: scale -1e-7 (eps, negated since |min| > |max| fails), bias 0, codes 0, exact zeros.
        let (h, d) = roundtrip_row(&[0.0; 64], QuantSpec::affine(64, bits), None)?;
        assert!(h.codes.iter().all(|&c| c == 0));
        assert!(d.iter().all(|&x| x == 0.0), "b{bits}: {d:?}");
        assert_eq!(h.biases[0], 0.0);
        assert!(h.scales_f[0].abs() <= 1e-7 * 1.0001);
        // Constant c: bias = c, codes 0, reproduced exactly.
        let (h, d) = roundtrip_row(&[-0.7; 32], QuantSpec::affine(32, bits), None)?;
        assert!(h.codes.iter().all(|&c| c == 0), "b{bits}: {:?}", h.codes);
        assert_eq!(h.biases[0], -0.7);
        assert_bitwise(&d, &[-0.7; 32], "constant group");
    }
    Ok(())
}

#[test]
fn affine_far_edge_is_clamped() -> Result<()> {
    // §1.3 makes the larger edge (-1) code 0 and 0.0 exact: s0 = 1.99/3, q0 = rint(-1/s0) = -2, so
    // s = 0.5, bias = -1 and the grid is {-1, -0.5, 0, 0.5}. 0.99 sits 3.98 steps up and is clamped to
    // code 3 = 0.5: an error of 0.49, which is more than |s|/2 = 0.25.
    let mut row = [0.0f32; 32];
    row[0] = -1.0;
    row[1] = 0.99;
    row[2] = 0.3;
    let (h, d) = roundtrip_row(&row, QuantSpec::affine(32, 2), None)?;
    assert_eq!((h.scales_f[0], h.biases[0]), (0.5, -1.0));
    assert_eq!(&h.codes[..4], &[0, 3, 3, 2]);
    assert_eq!(&d[..4], &[-1.0, 0.5, 0.5, 0.0]);
    Ok(())
}

#[test]
fn affine_ties_round_half_even_on_cpu() -> Result<()> {
    // Grid s = 1, bias = -15 (min -15 has the larger magnitude, 15 steps to max 0).
    // x = -2.5 is 12.5 steps up -> 12 (even); x = -3.5 is 11.5 steps -> 12 (even).
    let mut row = [0.0f32; 32];
    row[0] = -15.0;
    row[1] = -2.5;
    row[2] = -3.5;
    let (h, d) = roundtrip_row(&row, QuantSpec::affine(32, 4), None)?;
    assert_eq!((h.scales_f[0], h.biases[0]), (1.0, -15.0));
    assert_eq!(&h.codes[..3], &[0, 12, 12]);
    assert_eq!(&d[..3], &[-15.0, -3.0, -3.0]);
    Ok(())
}

#[test]
fn fp_grid_values_reproduce_exactly() -> Result<()> {
    let fp4: Vec<f32> = (0..16).map(e2m1).collect(); // includes -0 and +-6
    for k in [-9i32, 0, 5] {
        // mxfp4: every E2M1 value times 2^k, twice; amax = 6 * 2^k -> scale byte 127 + k.
        let row: Vec<f32> = (0..32).map(|i| fp4[i % 16] * 2f32.powi(k)).collect();
        let (h, d) = roundtrip_row(&row, spec(QuantMode::Mxfp4, 32, 4), None)?;
        assert_eq!(h.scale_bytes, vec![(127 + k) as u8]);
        // -0.0 comes back as code 0 (+0) (argmin picks the first index), so compare values, not bits, there.
        assert_eq!(d, row, "mxfp4 2^{k}");
        assert_eq!(&h.codes[1..8], &[1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(&h.codes[9..16], &[9, 10, 11, 12, 13, 14, 15]);

        // mxfp8: 32 E4M3 values from 448 down across binades and subnormals, times 2^k.
        let bytes: Vec<u8> = (0..32).map(|i| (0x7E - 4 * i) as u8 | if i % 3 == 0 { 0x80 } else { 0 }).collect();
        let row: Vec<f32> = bytes.iter().map(|&b| e4m3(b) * 2f32.powi(k)).collect();
        let (h, d) = roundtrip_row(&row, spec(QuantMode::Mxfp8, 32, 8), None)?;
        assert_eq!(h.scale_bytes, vec![(127 + k) as u8]);
        assert_eq!(h.codes, bytes.iter().map(|&b| b as u32).collect::<Vec<_>>());
        assert_bitwise(&d, &row, "mxfp8 grid");
    }
    // nvfp4 (two groups of 16; see nvfp4_odd_group_count): E2M1 values with amax 6 -> scale E4M3(1.0) =
    // 0x38; with amax 3 -> E4M3(0.5) = 0x30.
    let row: Vec<f32> = (1..33).map(|i| fp4[i % 16] * if i <= 16 { 1.0 } else { 0.5 }).collect();
    let (h, d) = roundtrip_row(&row, spec(QuantMode::Nvfp4, 16, 4), None)?;
    assert_eq!(h.scale_bytes, vec![0x38, 0x30]);
    assert_eq!(d, row, "nvfp4");
    // nvfp4 with global scale 2688 (= 448 * 6): scale bytes as without one, and a factor of exactly 1.
    let (h, d) = roundtrip_row(&row, spec(QuantMode::Nvfp4, 16, 4), Some(2688.0))?;
    assert_eq!(h.scale_bytes, vec![0x38, 0x30]);
    assert_eq!(d, row, "nvfp4 global scale");
    Ok(())
}

#[test]
fn nvfp4_odd_group_count() -> Result<()> {
    // MLX 0.32.4 packs nvfp4 through a (-1, 4, 8) reshape, so a tensor with an odd number of 16-groups
    // (e.g. (1, 16), (1, 48), (3, 16)) fails with a `[reshape]` message although K % 16 == 0. It must be an
    // Err, never a crash; should a later MLX accept it, the result must decode correctly.
    for shape in [[1, 16], [3, 16], [1, 48]] {
        let (w_host, w) = weights(&shape, 61)?;
        let sp = spec(QuantMode::Nvfp4, 16, 4);
        match quant::quantize(&w, sp, None) {
            Err(e) => assert!(e.mlx_message().is_some_and(|m| m.contains("reshape")), "{shape:?}: {e}"),
            Ok(q) => {
                let h = Host::new(&q, sp, &shape)?;
                assert_bitwise(&dequant_f32(&q, sp, None)?, &h.decode(None), "odd nvfp4");
                assert_eq!(h.codes.len(), w_host.len());
            }
        }
    }
    Ok(())
}

#[test]
fn fp_zero_groups() -> Result<()> {
    // All-zero groups: E8M0 byte 127 (scale 1) for mx modes (§1.6), E4M3 0 for nvfp4; all codes 0.
    let bytes = [127u8, 127, 0];
    for (sp, byte) in fp_specs().into_iter().zip(bytes) {
        let (h, d) = roundtrip_row(&[0.0; 64], sp, None)?;
        assert!(h.scale_bytes.iter().all(|&b| b == byte), "{}: {:?}", sp.mode.name(), h.scale_bytes);
        assert!(h.codes.iter().all(|&c| c == 0));
        assert!(d.iter().all(|&x| x == 0.0));
    }
    Ok(())
}

#[test]
fn mxfp4_ties_go_to_smaller_magnitude_on_cpu() -> Result<()> {
    // Scale 1 (amax 6). Exact midpoints between E2M1 neighbours; the CPU fallback's argmin picks the first
    // (smaller-magnitude) LUT entry, and -0.25 -> +0 (index 0 comes before -0.5's index 9 and -0's 8).
    let ties = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.75, -3.5, -5.0];
    let want = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, -0.5, -1.5, -3.0, -4.0];
    let mut row = vec![6.0f32; 32];
    row[..ties.len()].copy_from_slice(&ties);
    let (h, d) = roundtrip_row(&row, spec(QuantMode::Mxfp4, 32, 4), None)?;
    assert_eq!(h.scale_bytes, vec![127]);
    assert_eq!(&d[..ties.len()], &want, "codes {:?}", &h.codes[..ties.len()]);
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// 4. quantized_matmul, both layouts, vs an f64 matmul over the reference-decoded weights

/// `x (rows, k) @ w` where w is `(n, k)` when `w_nk`, else `(k, n)`; f64 accumulation.
fn ref_matmul(x: &[f32], w: &[f32], k: usize, n: usize, w_nk: bool) -> Vec<f32> {
    let rows = x.len() / k;
    let mut out = vec![0f32; rows * n];
    for r in 0..rows {
        for c in 0..n {
            let acc: f64 =
                (0..k).map(|i| x[r * k + i] as f64 * if w_nk { w[c * k + i] } else { w[i * n + c] } as f64).sum();
            out[r * n + c] = acc as f32;
        }
    }
    out
}

/// |got - want| <= rtol * max|want| elementwise. MLX sums K = 256 f32 products in its own order (per group,
/// then across groups); the worst-case f32 summation error is ~K * 2^-24 * sum|x*w| and typically
/// sqrt(K) * 2^-24 * that, i.e. ~1e-6 of the output scale, so 1e-5 of max|ref| is ample but still catches
/// any wrong code, scale, group or layout (those move outputs by ~1e-2 relative or more).
fn assert_close(got: &[f32], want: &[f32], rtol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= rtol * scale, "{what}: [{i}] got {g}, want {w} (max|ref| {scale})");
    }
}

const QMM_RTOL: f32 = 1e-5;

/// Every affine bit width (various group sizes) and every fp mode.
fn qmm_specs() -> Vec<QuantSpec> {
    let affine = [(32, 1), (64, 2), (32, 3), (64, 4), (128, 5), (64, 6), (128, 8)];
    let mut v: Vec<QuantSpec> = affine.iter().map(|&(g, b)| QuantSpec::affine(g, b)).collect();
    v.extend(fp_specs());
    v
}

#[test]
fn quantized_matmul_transpose_true_matches_reference() -> Result<()> {
    let (k, n) = (256usize, 96usize);
    let x_host = normal_host(2 * 3 * k, 31)?;
    let x = Array::from_slice(&x_host, &[2, 3, k as i32])?; // batched x
    let (_, w) = weights(&[n as i32, k as i32], 32)?; // W (N, K), quantized along K
    for sp in qmm_specs() {
        let q = quant::quantize(&w, sp, None)?;
        let wd = Host::new(&q, sp, &[n as i32, k as i32])?.decode(None);
        let y = quant::quantized_matmul(&x, &q, sp, true)?;
        assert_eq!(y.shape(), vec![2, 3, n as i32]);
        let want = ref_matmul(&x_host, &wd, k, n, true);
        assert_close(&y.to_vec::<f32>()?, &want, QMM_RTOL, &format!("{sp:?} transpose"));
    }
    Ok(())
}

#[test]
fn quantized_matmul_transpose_false_matches_reference() -> Result<()> {
    // W stored (K, N) and quantized along N (groups run along the output dim), y = x @ W (§1.4).
    let (k, n) = (96usize, 256usize);
    let x_host = normal_host(2 * 3 * k, 33)?;
    let x = Array::from_slice(&x_host, &[2, 3, k as i32])?;
    let (_, w) = weights(&[k as i32, n as i32], 34)?;
    for sp in qmm_specs() {
        let q = quant::quantize(&w, sp, None)?;
        let wd = Host::new(&q, sp, &[k as i32, n as i32])?.decode(None);
        let y = quant::quantized_matmul(&x, &q, sp, false)?;
        assert_eq!(y.shape(), vec![2, 3, n as i32]);
        let want = ref_matmul(&x_host, &wd, k, n, false);
        assert_close(&y.to_vec::<f32>()?, &want, QMM_RTOL, &format!("{sp:?} no transpose"));
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// 5. gather_qmm over an expert stack vs per-index quantized_matmul

/// Expert `e` of a quantized (E, N, ...) stack, as a 2-D `Quantized`.
fn expert(q: &Quantized, e: i32) -> Result<Quantized> {
    let pick = |a: &Array| a.slice_axis(0, e, e + 1)?.squeeze(&[0]);
    let biases = q.biases.as_ref().map(pick).transpose()?;
    Ok(Quantized { weight: pick(&q.weight)?, scales: pick(&q.scales)?, biases })
}

/// Row `i` (of `len` floats) of a host buffer as a (1, len) array.
fn row_array(host: &[f32], i: usize, len: usize) -> Result<Array> {
    Array::from_slice(&host[i * len..(i + 1) * len], &[1, len as i32])
}

fn u32_array(v: &[u32], shape: &[i32]) -> Result<Array> {
    Array::from_slice(v, shape)
}

#[test]
fn gather_qmm_rhs_indices_match_per_expert_matmuls() -> Result<()> {
    let (e, n, k) = (4i32, 32i32, 128i32);
    let (_, w) = weights(&[e, n, k], 41)?;
    let x_host = normal_host(10 * k as usize, 42)?;
    let x = Array::from_slice(&x_host, &[2, 5, 1, 1, k])?; // 10 tokens, M = 1
                                                           // (token, slot) -> expert; the sorted variant is non-decreasing over the flattened (2, 5, 3).
    let unsorted: Vec<u32> = (0..30u32).map(|i| (i * 7 + i / 3) % 4).collect();
    let mut sorted = unsorted.clone();
    sorted.sort();
    for sp in [QuantSpec::affine(64, 4), spec(QuantMode::Mxfp4, 32, 4)] {
        let q = quant::quantize(&w, sp, None)?;
        let experts: Vec<Quantized> = (0..e).map(|i| expert(&q, i)).collect::<Result<_>>()?;
        let h = Host::new(&q, sp, &[e, n, k])?;
        let wd = h.decode(None);
        for (idx, is_sorted) in [(&unsorted, false), (&sorted, true), (&sorted, false)] {
            let rhs = u32_array(idx, &[2, 5, 3])?;
            let g = Gather { rhs_indices: Some(&rhs), sorted_indices: is_sorted, ..Default::default() };
            let y = quant::gather_qmm(&x, &q, sp, true, g)?;
            assert_eq!(y.shape(), vec![2, 5, 3, 1, n]); // broadcast((2,5,1), (2,5,3)) + (M, N)
            let y = y.to_vec::<f32>()?;
            for (p, &ex) in idx.iter().enumerate() {
                let tok = p / 3; // lhs defaults to arange over x's batch (2, 5, 1)
                let got = &y[p * n as usize..(p + 1) * n as usize];
                let xr = row_array(&x_host, tok, k as usize)?;
                let one = quant::quantized_matmul(&xr, &experts[ex as usize], sp, true)?.to_vec::<f32>()?;
                // Same CPU kernel per product, so identical bits.
                assert_bitwise(got, &one, &format!("{} sorted={is_sorted} pair {p}", sp.mode.name()));
                let (k, n, ex) = (k as usize, n as usize, ex as usize);
                let want = ref_matmul(&x_host[tok * k..][..k], &wd[ex * n * k..][..n * k], k, n, true);
                assert_close(got, &want, QMM_RTOL, "gather_qmm vs reference");
            }
        }
    }
    Ok(())
}

#[test]
fn gather_qmm_lhs_and_rhs_indices() -> Result<()> {
    // x (4, 2, K), lhs (5,), rhs (5,) -> (5, 2, N): product i = x[lhs[i]] @ W[rhs[i]]^T (§1.5).
    let (e, n, k) = (4i32, 32i32, 64i32);
    let (_, w) = weights(&[e, n, k], 43)?;
    let x_host = normal_host(4 * 2 * k as usize, 44)?;
    let x = Array::from_slice(&x_host, &[4, 2, k])?;
    let sp = QuantSpec::affine(32, 4);
    let q = quant::quantize(&w, sp, None)?;
    let lhs_v = [3u32, 0, 2, 2, 1];
    for (rhs_v, is_sorted) in [([1u32, 3, 0, 2, 1], false), ([0u32, 1, 1, 2, 3], true)] {
        let (lhs, rhs) = (u32_array(&lhs_v, &[5])?, u32_array(&rhs_v, &[5])?);
        let (lhs_indices, rhs_indices) = (Some(&lhs), Some(&rhs));
        let g = Gather { lhs_indices, rhs_indices, sorted_indices: is_sorted, global_scale: None };
        let y = quant::gather_qmm(&x, &q, sp, true, g)?;
        assert_eq!(y.shape(), vec![5, 2, n]);
        let y = y.to_vec::<f32>()?;
        for i in 0..5 {
            let xm = Array::from_slice(&x_host[lhs_v[i] as usize * 2 * k as usize..][..2 * k as usize], &[2, k])?;
            let one = quant::quantized_matmul(&xm, &expert(&q, rhs_v[i] as i32)?, sp, true)?.to_vec::<f32>()?;
            assert_bitwise(&y[i * 2 * n as usize..(i + 1) * 2 * n as usize], &one, &format!("lhs/rhs product {i}"));
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// 6. Error paths return Err (never panic or abort) and name the op

/// Asserts `r` is an MLX error whose message names `op` (MLX prefixes messages with `[op]`).
fn assert_mlx_err<T: std::fmt::Debug>(r: Result<T>, op: &str) -> Error {
    let e = r.expect_err("expected an error");
    let msg = e.mlx_message().unwrap_or_else(|| panic!("not an MLX error: {e}"));
    assert!(msg.contains(op), "message {msg:?} does not mention {op}");
    assert!(e.to_string().contains(op));
    e
}

#[test]
fn invalid_arguments_are_errors() -> Result<()> {
    let (_, w) = weights(&[4, 256], 51)?;
    // K = 100 not divisible by the group size.
    let (_, w100) = weights(&[4, 100], 52)?;
    assert_mlx_err(quant::quantize(&w100, QuantSpec::affine(32, 4), None), "[quantize]");
    // Unsupported bit widths (MLX 0.32.4 accepts 1, 2, 3, 4, 5, 6, 8).
    for bits in [7, 9, 16] {
        assert_mlx_err(quant::quantize(&w, QuantSpec::affine(64, bits), None), "[quantize]");
    }
    // Unsupported group sizes, and fp modes off their fixed (group, bits).
    assert_mlx_err(quant::quantize(&w, QuantSpec::affine(16, 4), None), "[quantize]");
    assert_mlx_err(quant::quantize(&w, spec(QuantMode::Mxfp4, 64, 4), None), "[quantize]");
    assert_mlx_err(quant::quantize(&w, spec(QuantMode::Mxfp4, 32, 8), None), "[quantize]");
    assert_mlx_err(quant::quantize(&w, spec(QuantMode::Nvfp4, 32, 4), None), "[quantize]");
    // Integer input, and a 1-D input.
    let wi = Array::from_slice(&vec![1i32; 4 * 64], &[4, 64])?;
    assert_mlx_err(quant::quantize(&wi, QuantSpec::affine(64, 4), None), "[quantize]");
    let w1 = Array::from_slice(&[0.5f32; 64], &[64])?;
    assert_mlx_err(quant::quantize(&w1, QuantSpec::affine(64, 4), None), "[quantize]");

    // dequantize with scales of the wrong shape (and spec not matching the packing).
    let sp = QuantSpec::affine(64, 4);
    let q = quant::quantize(&w, sp, None)?;
    let bad = Quantized { scales: q.scales.slice_axis(1, 0, 3)?, biases: q.biases.clone(), weight: q.weight.clone() };
    assert_mlx_err(quant::dequantize(&bad, sp, None, None), "[dequantize]");
    let bad_b = Quantized { biases: Some(q.scales.slice_axis(0, 0, 2)?), ..q.clone() };
    assert_mlx_err(quant::dequantize(&bad_b, sp, None, None), "[dequantize]");
    assert_mlx_err(quant::dequantize(&q, QuantSpec::affine(32, 4), None, None), "[dequantize]");

    // quantized_matmul / gather_qmm with x's K not matching the weights.
    let x = Array::from_slice(&[1.0f32; 2 * 128], &[2, 128])?;
    assert_mlx_err(quant::quantized_matmul(&x, &q, sp, true), "[quantized_matmul]");
    let stack = quant::quantize(&weights(&[2, 32, 256], 53)?.1, sp, None)?;
    let rhs = u32_array(&[0, 1], &[2])?;
    let g = Gather { rhs_indices: Some(&rhs), ..Default::default() };
    assert_mlx_err(quant::gather_qmm(&x.reshape(&[2, 1, 128])?, &stack, sp, true, g), "[gather_qmm]");
    // The binding's own error text also names the op.
    let e = quant::quantize(&wi, sp, None).unwrap_err();
    assert!(matches!(e, Error::Mlx { op: "quantize", .. }));
    Ok(())
}

#[test]
fn gather_qmm_nvfp4_global_scale() -> Result<()> {
    // gather_qmm wants one global scale per expert, shape (E,); MLX 0.32.4 implements it on the GPU only
    // (§1.5), so on the CPU this is an Err. Where it runs, it must match the decoded experts.
    let (e, n, k) = (2i32, 32i32, 64i32);
    let (w_host, w) = weights(&[e, n, k], 71)?;
    let sp = spec(QuantMode::Nvfp4, 16, 4);
    let amax = w_host.iter().fold(0f32, |m, x| m.max(x.abs()));
    let q = quant::quantize(&w, sp, Some(&scalar_f32(amax)?))?;
    let x_host = normal_host(2 * k as usize, 72)?;
    let x = Array::from_slice(&x_host, &[2, 1, k])?;
    let rhs = u32_array(&[1, 0], &[2])?;
    let gs = Array::from_slice(&[amax, amax], &[e])?;
    let g = Gather { rhs_indices: Some(&rhs), global_scale: Some(&gs), ..Default::default() };
    match quant::gather_qmm(&x, &q, sp, true, g).and_then(|y| y.to_vec::<f32>()) {
        Err(err) => {
            assert_mlx_err::<()>(Err(err), "[gather_qmm]");
        }
        Ok(y) => {
            let wd = Host::new(&q, sp, &[e, n, k])?.decode(Some(amax));
            let (k, n) = (k as usize, n as usize);
            for (i, ex) in [1usize, 0].into_iter().enumerate() {
                let want = ref_matmul(&x_host[i * k..][..k], &wd[ex * n * k..][..n * k], k, n, true);
                assert_close(&y[i * n..][..n], &want, QMM_RTOL, "nvfp4 gather with global scale");
            }
        }
    }
    Ok(())
}

/// Regression: MLX 0.32.4 divides by the group size in `quantize` and by the bit width in
/// `quantized_matmul` / `gather_qmm` before validating them, so 0 killed the process with SIGFPE; negative
/// values were read by the shim as "MLX's default". The bindings now reject both with Err.
#[test]
fn zero_group_size_or_bits_are_errors() -> Result<()> {
    let (_, w) = weights(&[4, 256], 81)?;
    let q = quant::quantize(&w, QuantSpec::affine(64, 4), None)?;
    let x = Array::from_slice(&[1.0f32; 2 * 256], &[2, 256])?;
    for mode in [QuantMode::Affine, QuantMode::Mxfp4, QuantMode::Nvfp4] {
        assert!(quant::quantize(&w, spec(mode, 0, 4), None).is_err());
    }
    assert!(quant::quantized_matmul(&x, &q, QuantSpec::affine(64, 0), true).is_err());
    assert!(quant::quantized_matmul(&x, &q, QuantSpec::affine(64, 0), false).is_err());
    let stack = quant::quantize(&weights(&[2, 4, 256], 82)?.1, QuantSpec::affine(64, 4), None)?;
    let rhs = u32_array(&[0, 1], &[2])?;
    let g = Gather { rhs_indices: Some(&rhs), ..Default::default() };
    assert!(quant::gather_qmm(&x.reshape(&[2, 1, 256])?, &stack, QuantSpec::affine(64, 0), true, g).is_err());
    assert!(quant::quantize(&w, QuantSpec::affine(-5, 4), None).is_err());
    assert!(quant::dequantize(&q, QuantSpec::affine(64, -1), None, None).is_err());
    Ok(())
}
