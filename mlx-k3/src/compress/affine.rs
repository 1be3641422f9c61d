//! MLX affine quantization on the host, with an MSE clip search.
//!
//! For each group of `group_size` weights along a row, the min-max candidate is exactly MLX's CPU
//! `quantize` (docs/formats.md#affine-quantization-algorithm: the larger-magnitude edge becomes code 0, so 0.0 stays representable;
//! codes use the unrounded f32 scale and bias, which are then stored in the scale dtype). The clip search
//! repeats that with the range shrunk about its middle by each factor (100/95/90/85/80/75%, the shrink factors of a published 2-bit expert recipe),
//! clamping what falls outside, and keeps the candidate with the least squared error after storage
//! rounding, each column weighted by its importance when given. 1.0 is always a candidate, so the search is
//! never worse than min-max on the measure it minimizes.

use half::{bf16, f16};

use crate::Dtype;

/// The packed result of one matrix (or stack flattened to rows).
#[derive(Clone, Debug, Default)]
pub struct AffineMatrix {
    /// `rows * K * bits / 32` words, each row an LSB-first bitstream of codes.
    pub codes: Vec<u32>,
    /// Per group, already rounded to the storage dtype (held as f32).
    pub scales: Vec<f32>,
    /// Per group, rounded like `scales`.
    pub biases: Vec<f32>,
    /// Errors of this result and of plain min-max.
    pub stats: AffineStats,
}

/// Squared reconstruction errors, plain and importance-weighted, of the chosen result and of min-max.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AffineStats {
    /// Σ (w - ŵ)² of the result.
    pub sse: f64,
    /// Σ imp (w - ŵ)² of the result (equals `sse` without importance).
    pub wsse: f64,
    /// Σ (w - ŵ)² of min-max.
    pub sse_minmax: f64,
    /// Σ imp (w - ŵ)² of min-max.
    pub wsse_minmax: f64,
    /// Σ w².
    pub signal: f64,
    /// Groups whose chosen range is shrunk (not min-max).
    pub clipped_groups: u64,
    /// Groups in all.
    pub groups: u64,
}

impl AffineStats {
    /// Adds another matrix's errors.
    pub fn add(&mut self, o: &AffineStats) {
        self.sse += o.sse;
        self.wsse += o.wsse;
        self.sse_minmax += o.sse_minmax;
        self.wsse_minmax += o.wsse_minmax;
        self.signal += o.signal;
        self.clipped_groups += o.clipped_groups;
        self.groups += o.groups;
    }
}

/// Rounds to the storage dtype.
pub fn round_to(v: f32, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::BF16 => bf16::from_f32(v).to_f32(),
        Dtype::F16 => f16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// One candidate's scale and bias from a range (MLX's algorithm, f32).
fn scale_bias(lo: f32, hi: f32, n_bins: f32) -> (f32, f32) {
    let eps = 1e-7f32;
    let mask = lo.abs() > hi.abs();
    let mut scale = ((hi - lo) / n_bins).max(eps);
    scale = if mask { scale } else { -scale };
    let edge = if mask { lo } else { hi };
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0f32;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    (scale, bias)
}

/// Quantizes `w` (`rows x k`, row-major) to affine `bits` in groups of `group` along rows, trying each
/// range factor in `shrinks` (1.0 = min-max). `importance` (`k` values, or `rows/stack x k` is not
/// supported here: pass one row's worth) weights the error per column. Multi-threaded over rows;
/// the result does not depend on the thread count.
pub fn quantize(
    w: &[f32],
    rows: usize,
    k: usize,
    bits: u32,
    group: usize,
    store: Dtype,
    shrinks: &[f32],
    importance: Option<&[f32]>,
) -> AffineMatrix {
    let words_per_row = k * bits as usize / 32;
    let groups_per_row = k / group;
    let mut out = AffineMatrix {
        codes: vec![0; rows * words_per_row],
        scales: vec![0.0; rows * groups_per_row],
        biases: vec![0.0; rows * groups_per_row],
        stats: AffineStats::default(),
    };
    let threads = std::thread::available_parallelism().map(|t| t.get()).unwrap_or(1).clamp(1, rows.max(1));
    let per = rows.div_ceil(threads).max(1);
    let mut stats = vec![AffineStats::default(); rows];
    std::thread::scope(|scope| {
        let chunks = out
            .codes
            .chunks_mut(per * words_per_row)
            .zip(out.scales.chunks_mut(per * groups_per_row))
            .zip(out.biases.chunks_mut(per * groups_per_row))
            .zip(stats.chunks_mut(per))
            .enumerate();
        for (t, (((codes, scales), biases), st)) in chunks {
            scope.spawn(move || {
                for (ri, s) in st.iter_mut().enumerate() {
                    let r = t * per + ri;
                    let row = &w[r * k..(r + 1) * k];
                    *s = quantize_row(
                        row,
                        bits,
                        group,
                        store,
                        shrinks,
                        importance,
                        &mut codes[ri * words_per_row..(ri + 1) * words_per_row],
                        &mut scales[ri * groups_per_row..(ri + 1) * groups_per_row],
                        &mut biases[ri * groups_per_row..(ri + 1) * groups_per_row],
                    );
                }
            });
        }
    });
    for s in &stats {
        out.stats.add(s);
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn quantize_row(
    row: &[f32],
    bits: u32,
    group: usize,
    store: Dtype,
    shrinks: &[f32],
    importance: Option<&[f32]>,
    codes: &mut [u32],
    scales: &mut [f32],
    biases: &mut [f32],
) -> AffineStats {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let mut st = AffineStats::default();
    let mut q = vec![0u32; group];
    let mut best_q = vec![0u32; group];
    for (g, x) in row.chunks_exact(group).enumerate() {
        let imp = importance.map(|v| &v[g * group..(g + 1) * group]);
        let (mut mn, mut mx) = (f32::INFINITY, f32::NEG_INFINITY);
        for &v in x {
            mn = mn.min(v);
            mx = mx.max(v);
        }
        let mut best: Option<(f64, f64, f32, f32)> = None; // (wsse, sse, scale, bias)
        let mut best_shrink = 1.0f32;
        for &r in shrinks {
            let (lo, hi) = if r == 1.0 {
                (mn, mx)
            } else {
                let (mid, half) = ((mn + mx) * 0.5, (mx - mn) * 0.5 * r);
                (mid - half, mid + half)
            };
            let (scale, bias) = scale_bias(lo, hi, n_bins);
            let (s_st, b_st) = (round_to(scale, store), round_to(bias, store));
            let (mut wsse, mut sse) = (0f64, 0f64);
            for (j, &v) in x.iter().enumerate() {
                let c = ((v - bias) / scale).round_ties_even().clamp(0.0, n_bins);
                q[j] = c as u32;
                let e = (v - (s_st * c + b_st)) as f64;
                sse += e * e;
                wsse += imp.map_or(1.0, |m| m[j] as f64) * e * e;
            }
            if r == 1.0 {
                st.sse_minmax += sse;
                st.wsse_minmax += wsse;
            }
            if best.map_or(true, |b| wsse < b.0) {
                best = Some((wsse, sse, s_st, b_st));
                best_q.copy_from_slice(&q);
                best_shrink = r;
            }
        }
        let (wsse, sse, s, b) = best.unwrap_or((0.0, 0.0, 0.0, 0.0));
        st.sse += sse;
        st.wsse += wsse;
        st.signal += x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>();
        st.groups += 1;
        if best_shrink != 1.0 {
            st.clipped_groups += 1;
        }
        scales[g] = s;
        biases[g] = b;
        // LSB-first bitstream: element i at bits [i*bits, (i+1)*bits) of the row.
        for (j, &c) in best_q.iter().enumerate() {
            let bit = (g * group + j) * bits as usize;
            let (word, off) = (bit / 32, bit % 32);
            codes[word] |= c << off;
            if off + bits as usize > 32 {
                codes[word + 1] |= c >> (32 - off);
            }
        }
    }
    st
}

/// Decodes packed affine rows back to f32 (for measurements).
pub fn dequantize(m: &AffineMatrix, rows: usize, k: usize, bits: u32, group: usize) -> Vec<f32> {
    let words = k * bits as usize / 32;
    let mask = (1u64 << bits) - 1;
    let mut out = vec![0f32; rows * k];
    for r in 0..rows {
        let row = &m.codes[r * words..(r + 1) * words];
        for i in 0..k {
            let bit = i * bits as usize;
            let (word, off) = (bit / 32, bit % 32);
            let lo = row[word] as u64;
            let hi = if word + 1 < words { row[word + 1] as u64 } else { 0 };
            let c = (((hi << 32) | lo) >> off) & mask;
            let g = r * (k / group) + i / group;
            out[r * k + i] = m.scales[g] * c as f32 + m.biases[g];
        }
    }
    out
}
