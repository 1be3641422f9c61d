//! The ternary codebook format: IQ1_S semantics (llama.cpp) in a planar layout for MLX kernels.
//!
//! A `[N, K]` matrix (K a multiple of 32) is three arrays:
//!
//! | array | dtype | shape | holds |
//! |---|---|---|---|
//! | `codes` | uint8 | `[N, K/8]` | low 8 bits of each 8-weight group's 11-bit grid index |
//! | `qh` | uint16 | `[N, K/32]` | per 32-weight block: bits 3l..3l+2 = index bits 8..10 of group l (l = 0..3); bits 12..14 = block scale L; bit 15 = delta sign |
//! | `scales` | float16 | `[N, ⌈K/256⌉]` | super-block scale d |
//!
//! `w[32b + 8l + j] = d[b/8] · (2L + 1) · (grid[idx_l][j] + δ)`, `δ = −1/8` when bit 15 is set, else `+1/8`; the
//! grid is llama.cpp's 2048 ternary 8-vectors (data generated from the `gguf` package, see
//! `scripts/make_codebook_fixtures.py`). These are exactly IQ1_S's bits (1.5625 bits per weight), split into
//! planes so each plane streams contiguously per row (CPU) and loads coalesced (GPU); an IQ1_S block
//! `{d, qs[32], qh[8]}` maps to `scales`, 32 bytes of `codes` and 8 entries of `qh` without re-quantizing.
//!
//! Extension beyond IQ1_S: K need only be a multiple of 32. When K % 256 != 0 the last super-block of each
//! row is short (it holds the remaining K % 256 / 32 blocks under its own fp16 scale), so narrow matrices
//! such as small experts (K = 128: 1.625 bits per weight; K = 32: 2.0) can use the codebook too. Every full
//! super-block is bit-identical to IQ1_S; GGUF import needs K % 256 == 0 as IQ1_S itself does.

use std::collections::HashMap;
use std::sync::OnceLock;

use half::f16;

use crate::array::s;
use crate::ops::{self};
use crate::{Array, Dtype, Error, Result};

/// Weights per super-block.
pub const SUPER_BLOCK: usize = 256;
/// Weights per block (one 3-bit scale and delta sign); K must be a multiple of this.
pub const BLOCK: usize = 32;

/// Super-blocks per row of K weights (the last one short when K % 256 != 0).
pub fn super_blocks(k: usize) -> usize {
    k.div_ceil(SUPER_BLOCK)
}

/// Bytes of one codebook row of K weights (codes, qh and scales).
pub fn row_bytes(k: usize) -> usize {
    k / 8 + 2 * (k / BLOCK) + 2 * super_blocks(k)
}
/// Bytes of one llama.cpp IQ1_S block.
pub const IQ1S_BLOCK_BYTES: usize = 50;
/// Bits per weight of the format.
pub const BITS_PER_WEIGHT: f64 = 1.5625;

/// A codebook-quantized matrix (or expert stack: a leading `[E]` on every array).
#[derive(Clone, Debug)]
pub struct Codebook {
    /// uint8 `[.., N, K/8]`.
    pub codes: Array,
    /// uint16 `[.., N, K/32]`.
    pub qh: Array,
    /// float16 `[.., N, ⌈K/256⌉]`.
    pub scales: Array,
}

/// How a loaded codebook's first plane holds the grid indices (the checkpoint always stores `Compact`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CodebookLayout {
    /// `codes` as stored: 8-bit index parts, looked up in the grid at run time (1.5625 bits per weight).
    #[default]
    Compact,
    /// The ternary execution layout built at load ([`Codebook::to_ternary`]): every weight's grid value + 1 as a
    /// 2-bit trit, `[.., N, 32·⌈K/128⌉]` bytes in place of `codes` (2.5625 bits per weight with qh and scales).
    /// The CPU kernels decode it with a shift and a mask; GPU streams need the compact layout.
    Ternary,
}

impl CodebookLayout {
    /// Parses `compact` / `ternary` (the `--codebook-layout` and `K3_CODEBOOK_LAYOUT` values).
    pub fn parse(s: &str) -> Result<CodebookLayout> {
        match s {
            "compact" => Ok(CodebookLayout::Compact),
            "ternary" => Ok(CodebookLayout::Ternary),
            _ => Err(Error::invalid("codebook layout", format!("'{s}' is not 'compact' or 'ternary'"))),
        }
    }

    /// The layout `K3_CODEBOOK_LAYOUT` names (unset: the default, compact); an error names the variable.
    pub fn from_env() -> Result<CodebookLayout> {
        match std::env::var("K3_CODEBOOK_LAYOUT") {
            Ok(v) => CodebookLayout::parse(&v)
                .map_err(|_| Error::invalid("K3_CODEBOOK_LAYOUT", format!("'{v}' is not 'compact' or 'ternary'"))),
            Err(_) => Ok(CodebookLayout::default()),
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            CodebookLayout::Compact => "compact",
            CodebookLayout::Ternary => "ternary",
        }
    }
}

/// The layout loaders give codebook weights: set by [`set_load_layout`] (the CLI's `--codebook-layout`), else
/// `K3_CODEBOOK_LAYOUT`, else compact. 0 = not set, 1 compact, 2 ternary.
static LOAD_LAYOUT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Sets the layout that model loading gives codebook weights (`None`: back to `K3_CODEBOOK_LAYOUT`, unset =
/// compact). Process-wide, read when a model is loaded.
pub fn set_load_layout(layout: Option<CodebookLayout>) {
    let v = match layout {
        None => 0,
        Some(CodebookLayout::Compact) => 1,
        Some(CodebookLayout::Ternary) => 2,
    };
    LOAD_LAYOUT.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// The layout model loading gives codebook weights now (see [`set_load_layout`]); an error names
/// `K3_CODEBOOK_LAYOUT` when it holds anything but `compact` or `ternary`.
pub fn load_layout() -> Result<CodebookLayout> {
    match LOAD_LAYOUT.load(std::sync::atomic::Ordering::Relaxed) {
        1 => Ok(CodebookLayout::Compact),
        2 => Ok(CodebookLayout::Ternary),
        _ => CodebookLayout::from_env(),
    }
}

/// Bytes of one row of the ternary layout's trits (K weights: 32 bytes per 128, the last chunk padded).
pub fn ternary_row_bytes(k: usize) -> usize {
    32 * k.div_ceil(128)
}

impl Codebook {
    /// K, the number of weights per row (32 per `qh` entry).
    pub fn k(&self) -> usize {
        32 * self.qh.shape().last().copied().unwrap_or(0).max(0) as usize
    }

    /// Which layout the first plane holds (told by its last axis: K/8 for compact).
    pub fn layout(&self) -> CodebookLayout {
        if self.codes.shape().last().copied().unwrap_or(0) as usize == self.k() / 8 {
            CodebookLayout::Compact
        } else {
            CodebookLayout::Ternary
        }
    }

    /// Bytes the three planes hold (resident in memory once evaluated).
    pub fn nbytes(&self) -> usize {
        self.codes.nbytes() + self.qh.nbytes() + self.scales.nbytes()
    }

    /// Bytes the checkpoint stores for it (the compact layout's: K/8 code bytes per row), whatever the layout.
    pub fn stored_bytes(&self) -> usize {
        4 * self.qh.size() + self.qh.nbytes() + self.scales.nbytes()
    }

    /// The same matrix (or stack) in the ternary execution layout: trits built from `codes` and `qh` on the CPU
    /// (lossless: every weight keeps its value bit for bit), `qh` and `scales` shared. Lazy, like any op.
    pub fn to_ternary(&self) -> Result<Codebook> {
        if self.layout() == CodebookLayout::Ternary {
            return Ok(self.clone());
        }
        let st = s();
        // SAFETY: live handles in, new handle out.
        let trits = Array::try_from_op("codebook_ternary", |res| unsafe {
            mlx_k3_metal::k3_codebook_ternary(res, self.codes.as_raw(), self.qh.as_raw(), st)
        })?;
        Ok(Codebook { codes: trits, qh: self.qh.clone(), scales: self.scales.clone() })
    }

    /// This codebook in `layout` (compact stays as stored; ternary builds the trits).
    pub fn with_layout(&self, layout: CodebookLayout) -> Result<Codebook> {
        match layout {
            CodebookLayout::Compact if self.layout() == CodebookLayout::Ternary => Err(Error::invalid(
                "codebook layout",
                "a ternary codebook cannot go back to the compact layout (load the checkpoint again)",
            )),
            CodebookLayout::Compact => Ok(self.clone()),
            CodebookLayout::Ternary => self.to_ternary(),
        }
    }
}

/// The ternary layout's trits of host planes, written out independently of the kernels' converter (tests
/// compare the two): byte 32c + j of a row holds at bits 2s, 2s + 1 the value + 1 of weight 128c + 32s + j.
pub fn ternary_host(h: &CodebookHost) -> Vec<u8> {
    let (g, tb) = (grid(), ternary_row_bytes(h.k));
    let mut out = vec![0u8; h.n * tb];
    for r in 0..h.n {
        for b in 0..h.k / 32 {
            let q = h.qh[r * h.k / 32 + b];
            for l in 0..4 {
                let idx = h.codes[r * h.k / 8 + 4 * b + l] as usize | ((((q >> (3 * l)) & 7) as usize) << 8);
                for j in 0..8 {
                    let pos = 32 * b + 8 * l + j;
                    out[r * tb + 32 * (pos / 128) + pos % 32] |= ((g[idx][j] + 1) as u8) << (2 * ((pos / 32) % 4));
                }
            }
        }
    }
    out
}

/// Decodes the ternary layout's trits (with the host planes' qh and scales) to f32 on the host, with the same
/// arithmetic as [`decode_host`]: equal to it bit for bit when the trits came from the same planes.
pub fn decode_ternary_host(h: &CodebookHost, trits: &[u8]) -> Vec<f32> {
    let tb = ternary_row_bytes(h.k);
    let mut out = vec![0f32; h.n * h.k];
    for r in 0..h.n {
        for b in 0..h.k / 32 {
            let q = h.qh[r * h.k / 32 + b];
            let d = h.scales[r * super_blocks(h.k) + b / 8].to_f32();
            let dl = d * (2 * ((q >> 12) & 7) + 1) as f32;
            let delta = if q & 0x8000 != 0 { -0.125f32 } else { 0.125 };
            for i in 0..32 {
                let pos = 32 * b + i;
                let t = (trits[r * tb + 32 * (pos / 128) + i] >> (2 * (b % 4))) & 3;
                out[r * h.k + pos] = dl * ((t as i32 - 1) as f32 + delta);
            }
        }
    }
    out
}

/// Host-side planes of a codebook matrix.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CodebookHost {
    /// Rows.
    pub n: usize,
    /// Columns (a multiple of 32).
    pub k: usize,
    /// `[n, k/8]`.
    pub codes: Vec<u8>,
    /// `[n, k/32]`.
    pub qh: Vec<u16>,
    /// `[n, ⌈k/256⌉]`.
    pub scales: Vec<f16>,
}

impl CodebookHost {
    /// The planes as MLX arrays.
    pub fn to_arrays(&self) -> Result<Codebook> {
        let (n, k) = (self.n as i32, self.k as i32);
        Ok(Codebook {
            codes: Array::from_slice(&self.codes, &[n, k / 8])?,
            qh: Array::from_slice(&self.qh, &[n, k / 32])?,
            scales: Array::from_slice(&self.scales, &[n, super_blocks(self.k) as i32])?,
        })
    }
}

/// The IQ1_S grid: 2048 entries of 8 values in {-1, 0, 1}.
pub fn grid() -> &'static [[i8; 8]; 2048] {
    static GRID: OnceLock<[[i8; 8]; 2048]> = OnceLock::new();
    GRID.get_or_init(|| {
        let mut p: *const u64 = std::ptr::null();
        // SAFETY: returns a pointer to a static table of 2048 u64.
        unsafe { mlx_k3_metal::k3_iq1s_grid_data(&mut p) };
        // SAFETY: the table has 2048 entries and lives for the program.
        let raw = unsafe { std::slice::from_raw_parts(p, 2048) };
        let mut g = [[0i8; 8]; 2048];
        for (i, v) in raw.iter().enumerate() {
            for (j, b) in v.to_le_bytes().iter().enumerate() {
                g[i][j] = *b as i8;
            }
        }
        g
    })
}

/// Splits llama.cpp IQ1_S blocks (`rows x k/256` blocks of 50 bytes, row-major) into the planar layout.
pub fn from_iq1s_blocks(blocks: &[u8], rows: usize, k: usize) -> Result<CodebookHost> {
    if k % SUPER_BLOCK != 0 {
        return Err(Error::invalid("codebook", format!("K = {k} is not a multiple of {SUPER_BLOCK}")));
    }
    let nsb = k / SUPER_BLOCK;
    let want = rows.checked_mul(nsb).and_then(|b| b.checked_mul(IQ1S_BLOCK_BYTES));
    if want != Some(blocks.len()) {
        let want = want.map_or("more than the address space".to_string(), |w| format!("{w} bytes"));
        return Err(Error::invalid(
            "codebook",
            format!("{} bytes do not hold {rows} x {k} IQ1_S weights ({want})", blocks.len()),
        ));
    }
    let mut h = CodebookHost {
        n: rows,
        k,
        codes: Vec::with_capacity(rows * k / 8),
        qh: Vec::with_capacity(rows * k / 32),
        scales: Vec::with_capacity(rows * nsb),
    };
    for b in blocks.chunks_exact(IQ1S_BLOCK_BYTES) {
        h.scales.push(f16::from_bits(u16::from_le_bytes([b[0], b[1]])));
        h.codes.extend_from_slice(&b[2..34]);
        h.qh.extend(b[34..50].chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])));
    }
    Ok(h)
}

/// Decodes planes to f32 on the host with IQ1_S's arithmetic (bit-exact with llama.cpp / gguf-py).
pub fn decode_host(h: &CodebookHost) -> Vec<f32> {
    let g = grid();
    let mut out = vec![0f32; h.n * h.k];
    for r in 0..h.n {
        for b in 0..h.k / 32 {
            let q = h.qh[r * h.k / 32 + b];
            let d = h.scales[r * super_blocks(h.k) + b / 8].to_f32();
            let dl = d * (2 * ((q >> 12) & 7) + 1) as f32;
            let delta = if q & 0x8000 != 0 { -0.125f32 } else { 0.125 };
            for l in 0..4 {
                let idx = h.codes[r * h.k / 8 + 4 * b + l] as usize | ((((q >> (3 * l)) & 7) as usize) << 8);
                for j in 0..8 {
                    out[r * h.k + 32 * b + 8 * l + j] = dl * (g[idx][j] as f32 + delta);
                }
            }
        }
    }
    out
}

/// The plain-ops reference: dequantizes with MLX ops (grid gather, shifts, masks) to f32 `[.., N, K]`.
/// Either layout (the ternary one: its trits unpacked with shifts and masks).
pub fn dequantize_reference(cb: &Codebook) -> Result<Array> {
    let shape = cb.codes.shape();
    let nd = shape.len();
    let k = cb.k() as i32;
    let k8 = k / 8;
    let qh = cb.qh.astype(Dtype::U32)?;
    let mut vshape = shape[..nd - 1].to_vec();
    vshape.extend([k / 32, 32]);
    let vals = if cb.layout() == CodebookLayout::Ternary {
        // [.., N, chunks, 32] bytes -> [.., N, chunks, 4 (shift), 32] trits -> blocks in order, the padding cut.
        let chunks = shape[nd - 1] / 32;
        let mut cshape = shape[..nd - 1].to_vec();
        cshape.extend([chunks, 1, 32]);
        let t = cb.codes.astype(Dtype::U32)?.reshape(&cshape)?;
        let sh = Array::from_slice(&[0u32, 2, 4, 6], &[4, 1])?;
        let v = t.right_shift(&sh)?.bitwise_and(3u32)?;
        let mut bshape = shape[..nd - 1].to_vec();
        bshape.extend([4 * chunks, 32]);
        let v = v.reshape(&bshape)?.slice_axis(-2, 0, k / 32)?;
        v.astype(Dtype::F32)?.subtract(1.0f32)?
    } else {
        let flat: Vec<i8> = grid().iter().flatten().copied().collect();
        let grid = Array::from_slice(&flat, &[2048, 8])?.astype(Dtype::F32)?;
        // qh repeated per group (4 groups per 32-block), shifted by 3 * (group % 4).
        let qh4 = qh.repeat(4, -1)?;
        let shifts: Vec<u32> = (0..k8).map(|i| 3 * (i as u32 % 4)).collect();
        let shifts = Array::from_slice(&shifts, &[k8])?;
        let high = qh4.right_shift(&shifts)?.bitwise_and(7u32)?.left_shift(8u32)?;
        let idx = cb.codes.astype(Dtype::U32)?.bitwise_or(&high)?;
        grid.take(&idx, 0)?.reshape(&vshape)? // [.., N, K/32, 32]
    };
    let l = qh.right_shift(12u32)?.bitwise_and(7u32)?.astype(Dtype::F32)?;
    let d = cb.scales.astype(Dtype::F32)?.repeat(8, -1)?; // [.., N, 8 * ⌈K/256⌉]
    let d = if k % SUPER_BLOCK as i32 != 0 { d.slice_axis(-1, 0, k / 32)? } else { d };
    let dl = d.multiply(&l.multiply(2.0f32)?.add(1.0f32)?)?;
    let neg = qh.bitwise_and(0x8000u32)?.not_equal(0u32)?;
    let delta = ops::where_(&neg, &Array::scalar(-0.125f32)?, &Array::scalar(0.125f32)?)?;
    let w = vals.add(&delta.expand_dims(&[-1])?)?.multiply(&dl.expand_dims(&[-1])?)?;
    let mut out_shape = shape[..nd - 1].to_vec();
    out_shape.push(k);
    w.reshape(&out_shape)
}

/// Reconstruction errors of a quantization, relative to the signal.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QuantReport {
    /// Σ w (x − x̂)² / Σ w x², with the importance weights used to quantize.
    pub weighted_rel_err: f64,
    /// Σ (x − x̂)² / Σ x².
    pub plain_rel_err: f64,
}

/// For each of the 3^8 ternary patterns (base-3 code, digit j = value j + 1), the grid entries within squared
/// distance 2 (every pattern has at least one: the grid covers the cube to distance 2).
fn neighbours() -> &'static Vec<Vec<u16>> {
    static N: OnceLock<Vec<Vec<u16>>> = OnceLock::new();
    N.get_or_init(|| {
        let g = grid();
        let mut by_code: HashMap<u32, u16> = HashMap::new();
        for (i, e) in g.iter().enumerate() {
            by_code.insert(pattern_code(e), i as u16);
        }
        (0..6561u32)
            .map(|code| {
                let p = pattern_of(code);
                if let Some(&i) = by_code.get(&code) {
                    return vec![i];
                }
                let mut best: Vec<(i32, u16)> = g
                    .iter()
                    .enumerate()
                    .map(|(i, e)| (e.iter().zip(&p).map(|(a, b)| ((a - b) as i32).pow(2)).sum::<i32>(), i as u16))
                    .filter(|(d, _)| *d <= 2)
                    .collect();
                best.sort_unstable();
                best.into_iter().map(|(_, i)| i).collect()
            })
            .collect()
    })
}

fn pattern_code(p: &[i8; 8]) -> u32 {
    p.iter().rev().fold(0u32, |acc, v| acc * 3 + (*v + 1) as u32)
}

fn pattern_of(mut code: u32) -> [i8; 8] {
    let mut p = [0i8; 8];
    for v in p.iter_mut() {
        *v = (code % 3) as i8 - 1;
        code /= 3;
    }
    p
}

/// One 32-weight block's choice: ternary classes, delta sign, and the block scale.
fn quantize_block(x: &[f32], w: &[f32]) -> ([i8; 32], bool, f32) {
    let mut order: Vec<usize> = (0..32).collect();
    order.sort_by(|&a, &b| x[a].total_cmp(&x[b]).then(a.cmp(&b)));
    let mut swx = [0f64; 33];
    let mut sw = [0f64; 33];
    for (i, &j) in order.iter().enumerate() {
        swx[i + 1] = swx[i] + (w[j] * x[j]) as f64;
        sw[i + 1] = sw[i] + w[j] as f64;
    }
    let mut best = (f64::NEG_INFINITY, 0usize, 0usize, false);
    for neg_delta in [false, true] {
        let delta = if neg_delta { -0.125 } else { 0.125 };
        let lv = [-1.0 + delta, delta, 1.0 + delta];
        for i1 in 0..=32 {
            for i2 in i1..=32 {
                let num = lv[0] * swx[i1] + lv[1] * (swx[i2] - swx[i1]) + lv[2] * (swx[32] - swx[i2]);
                let den =
                    lv[0] * lv[0] * sw[i1] + lv[1] * lv[1] * (sw[i2] - sw[i1]) + lv[2] * lv[2] * (sw[32] - sw[i2]);
                if den > 0.0 {
                    let score = num * num / den;
                    if score > best.0 {
                        best = (score, i1, i2, neg_delta);
                    }
                }
            }
        }
    }
    let (_, i1, i2, mut neg) = best;
    let mut q = [0i8; 32];
    for (i, &j) in order.iter().enumerate() {
        q[j] = if i < i1 {
            -1
        } else if i < i2 {
            0
        } else {
            1
        };
    }
    let mut s = fit_scale(x, w, &q, neg);
    if s < 0.0 {
        // Negating the levels (−1+δ, δ, 1+δ) gives (1−δ, −δ, −1−δ): swap the outer classes and flip δ.
        for v in q.iter_mut() {
            *v = -*v;
        }
        neg = !neg;
        s = -s;
    }
    (q, neg, s)
}

/// Least-squares scale for classes `q` and delta sign: Σ w x q / Σ w q².
fn fit_scale(x: &[f32], w: &[f32], q: &[i8], neg_delta: bool) -> f32 {
    let delta = if neg_delta { -0.125f64 } else { 0.125 };
    let (mut num, mut den) = (0f64, 0f64);
    for i in 0..x.len() {
        let l = q[i] as f64 + delta;
        num += w[i] as f64 * x[i] as f64 * l;
        den += w[i] as f64 * l * l;
    }
    if den > 0.0 {
        (num / den) as f32
    } else {
        0.0
    }
}

/// Quantizes rows of `x` (`[n, k]`, k a multiple of 32) with importance `importance` (`[k]`: mean x² per
/// input column from calibration activations; None: x² of each weight), as docs/formats.md#iq1_s-quantizer describes:
/// per 32-block an exhaustive split search over sorted values for both delta signs, snapping each 8-group
/// to the best grid entry within squared distance 2 (by weighted error at the block scale), a refit, then
/// the 3-bit block scales against the super-block scale. Multi-threaded over rows; deterministic.
pub fn quantize(x: &[f32], n: usize, k: usize, importance: Option<&[f32]>) -> Result<(CodebookHost, QuantReport)> {
    if k == 0 || k % BLOCK != 0 {
        return Err(Error::invalid("codebook_quantize", format!("K = {k} is not a positive multiple of {BLOCK}")));
    }
    if x.len() != n * k {
        return Err(Error::invalid("codebook_quantize", format!("{} values do not fill {n} x {k}", x.len())));
    }
    if let Some(imp) = importance {
        if imp.len() != k {
            return Err(Error::invalid(
                "codebook_quantize",
                format!("importance has {} entries, expected {k}", imp.len()),
            ));
        }
        if imp.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(Error::invalid("codebook_quantize", "importance values must be finite and >= 0"));
        }
    }
    if x.iter().any(|v| !v.is_finite()) {
        return Err(Error::invalid("codebook_quantize", "weights must be finite"));
    }
    let nb = neighbours();
    let grid = grid();
    let threads = std::thread::available_parallelism().map(|t| t.get()).unwrap_or(1).min(n.max(1));
    let rows_per = n.div_ceil(threads.max(1)).max(1);
    let mut out = CodebookHost {
        n,
        k,
        codes: vec![0; n * k / 8],
        qh: vec![0; n * k / 32],
        scales: vec![f16::ZERO; n * super_blocks(k)],
    };
    let mut errs = vec![(0f64, 0f64, 0f64, 0f64); n];
    std::thread::scope(|scope| {
        let mut codes = out.codes.chunks_mut(rows_per * k / 8);
        let mut qh = out.qh.chunks_mut(rows_per * k / 32);
        let mut scales = out.scales.chunks_mut(rows_per * super_blocks(k));
        let mut err = errs.chunks_mut(rows_per);
        for t in 0..threads {
            let (c, h, sc, e) = match (codes.next(), qh.next(), scales.next(), err.next()) {
                (Some(c), Some(h), Some(sc), Some(e)) => (c, h, sc, e),
                _ => break,
            };
            let r0 = t * rows_per;
            scope.spawn(move || {
                for (ri, e) in e.iter_mut().enumerate() {
                    let r = r0 + ri;
                    let row = &x[r * k..(r + 1) * k];
                    *e = quantize_row(
                        row,
                        importance,
                        nb,
                        grid,
                        &mut c[ri * k / 8..(ri + 1) * k / 8],
                        &mut h[ri * k / 32..(ri + 1) * k / 32],
                        &mut sc[ri * super_blocks(k)..(ri + 1) * super_blocks(k)],
                    );
                }
            });
        }
    });
    let t = errs.iter().fold((0f64, 0f64, 0f64, 0f64), |a, e| (a.0 + e.0, a.1 + e.1, a.2 + e.2, a.3 + e.3));
    let report = QuantReport {
        weighted_rel_err: if t.1 > 0.0 { t.0 / t.1 } else { 0.0 },
        plain_rel_err: if t.3 > 0.0 { t.2 / t.3 } else { 0.0 },
    };
    Ok((out, report))
}

/// Quantizes one row; returns (Σ w err², Σ w x², Σ err², Σ x²).
fn quantize_row(
    row: &[f32],
    importance: Option<&[f32]>,
    nb: &[Vec<u16>],
    grid: &[[i8; 8]; 2048],
    codes: &mut [u8],
    qh: &mut [u16],
    scales: &mut [f16],
) -> (f64, f64, f64, f64) {
    let k = row.len();
    let mut acc = (0f64, 0f64, 0f64, 0f64);
    for sb in 0..super_blocks(k) {
        // Every super-block holds 256 weights but the last when K % 256 != 0.
        let len = SUPER_BLOCK.min(k - sb * SUPER_BLOCK);
        let xs = &row[sb * SUPER_BLOCK..sb * SUPER_BLOCK + len];
        let sigma2 = 2.0 * xs.iter().map(|v| v * v).sum::<f32>() / len as f32;
        let wts: Vec<f32> = (0..len)
            .map(|i| {
                let qw = match importance {
                    Some(imp) => imp[sb * SUPER_BLOCK + i],
                    None => xs[i] * xs[i],
                };
                qw * (sigma2 + xs[i] * xs[i]).sqrt()
            })
            .collect();
        let mut blocks = vec![([0u16; 4], false, 0f32); len / BLOCK];
        for (b, blk) in blocks.iter_mut().enumerate() {
            let (x, w) = (&xs[32 * b..32 * b + 32], &wts[32 * b..32 * b + 32]);
            if x.iter().all(|v| v.abs() < 1e-12) || w.iter().all(|v| *v == 0.0) {
                *blk = ([pattern_index(&[0; 8], nb); 4], false, 0.0);
                continue;
            }
            let (mut q, neg, s) = quantize_block(x, w);
            let delta = if neg { -0.125f32 } else { 0.125 };
            let mut idx = [0u16; 4];
            let mut moved = false;
            for l in 0..4 {
                let p: [i8; 8] = q[8 * l..8 * l + 8].try_into().unwrap_or([0; 8]);
                let cands = &nb[pattern_code(&p) as usize];
                let mut best = (f32::INFINITY, cands[0]);
                for &c in cands {
                    let e: f32 = (0..8)
                        .map(|j| {
                            let d = s * (grid[c as usize][j] as f32 + delta) - x[8 * l + j];
                            w[8 * l + j] * d * d
                        })
                        .sum();
                    if e < best.0 {
                        best = (e, c);
                    }
                }
                idx[l] = best.1;
                if grid[best.1 as usize] != p {
                    moved = true;
                    q[8 * l..8 * l + 8].copy_from_slice(&grid[best.1 as usize]);
                }
            }
            let s = if moved { fit_scale(x, w, &q, neg).max(0.0) } else { s };
            *blk = (idx, neg, s);
        }
        let max_s = blocks.iter().map(|b| b.2).fold(0f32, f32::max);
        let d = f16::from_f32(max_s / 15.0);
        let df = d.to_f32();
        scales[sb] = d;
        for (b, (idx, neg, s)) in blocks.iter().enumerate() {
            let l = if df > 0.0 { (((s / df) - 1.0) / 2.0).round().clamp(0.0, 7.0) as u16 } else { 0 };
            let mut h = (l << 12) | if *neg { 0x8000 } else { 0 };
            for (g, i) in idx.iter().enumerate() {
                codes[(sb * 8 + b) * 4 + g] = (*i & 0xff) as u8;
                h |= ((*i >> 8) & 7) << (3 * g);
            }
            qh[sb * 8 + b] = h;
            // Reconstruction error with the stored values.
            let dl = df * (2 * l + 1) as f32;
            let delta = if *neg { -0.125f32 } else { 0.125 };
            for (g, i) in idx.iter().enumerate() {
                for j in 0..8 {
                    let pos = 32 * b + 8 * g + j;
                    let xv = xs[pos];
                    let e = (dl * (grid[*i as usize][j] as f32 + delta) - xv) as f64;
                    acc.0 += wts[pos] as f64 * e * e;
                    acc.1 += wts[pos] as f64 * (xv as f64).powi(2);
                    acc.2 += e * e;
                    acc.3 += (xv as f64).powi(2);
                }
            }
        }
    }
    acc
}

fn pattern_index(p: &[i8; 8], nb: &[Vec<u16>]) -> u16 {
    nb[pattern_code(p) as usize][0]
}

/// `x @ Wᵀ` through the codebook kernel (CPU).
pub fn codebook_qmm(x: &Array, cb: &Codebook) -> Result<Array> {
    let st = s();
    // SAFETY: live handles in, new handle out.
    Array::try_from_op("codebook_qmm", |res| unsafe {
        mlx_k3_metal::k3_codebook_qmm(res, x.as_raw(), cb.codes.as_raw(), cb.qh.as_raw(), cb.scales.as_raw(), st)
    })
}

/// `x @ W[rhs]ᵀ` over a codebook expert stack (MLX gather_qmm semantics).
pub fn gather_codebook_qmm(x: &Array, cb: &Codebook, lhs: Option<&Array>, rhs: Option<&Array>) -> Result<Array> {
    let st = s();
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("gather_codebook_qmm", |res| unsafe {
        mlx_k3_metal::k3_gather_codebook_qmm(
            res,
            x.as_raw(),
            cb.codes.as_raw(),
            cb.qh.as_raw(),
            cb.scales.as_raw(),
            Array::raw_opt(lhs),
            Array::raw_opt(rhs),
            st,
        )
    })
}
