//! The block drafter's forward on the host, in plain Rust over `f32` slices: what a drafter of a few million
//! parameters runs on a CPU. There a block forward is about 80 small MLX operations whose scheduling
//! (graph, allocation, thread hand-offs) costs more than their arithmetic (about 26 MFLOP a cycle for
//! k3-nano's drafter); here it is one function call on the calling thread
//! (docs/architecture.md#the-block-drafter). The arithmetic is the same as the MLX path in
//! `block_drafter.rs` (the parity test in `tests/block_drafter.rs` compares both with the training script's
//! reference); summation order differs. No MLX here: plain Rust over `f32` slices, so this crate builds
//! optimised in debug builds too (the workspace's `profile.dev.package.mlx-k3-host`).

/// Weights of one drafter layer, matrices stored input-major (`[in, out]`, row `i` holds input `i`'s
/// weights to every output).
pub struct Layer {
    pub attn_norm: Vec<f32>,
    /// `[D, H * hd]`.
    pub q: Packed,
    /// k and v side by side: `[D, 2 * H * hd]` (the context's rows need only these).
    pub kv: Packed,
    pub o: Packed,
    pub mlp_norm: Vec<f32>,
    /// gate and up side by side: `[D, 2 * F]`.
    pub gate_up: Packed,
    pub down: Packed,
}

/// The whole drafter on the host.
pub struct HostBlock {
    pub d: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub inter: usize,
    pub block: usize,
    pub vocab: usize,
    pub eps: f32,
    pub theta: f32,
    /// `[taps * D_target, D]`.
    pub fc: Packed,
    pub ctx_norm: Vec<f32>,
    pub mask_embed: Vec<f32>,
    /// `[K, D]`.
    pub slot_embed: Vec<f32>,
    pub layers: Vec<Layer>,
    pub norm: Vec<f32>,
    /// The target's embedding `[V, D]` (slot 0's input).
    pub embed: Vec<f32>,
    /// Its transpose `[D, V]` (the output head).
    pub embed_t: Packed,
}

/// Context rows: projected taps `[C, D]` and per layer the keys (RoPE applied) and values `[C, H * hd]`.
#[derive(Clone)]
pub struct Ctx {
    pub feats: Vec<f32>,
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
}

impl Ctx {
    pub fn len(&self, d: usize) -> usize {
        self.feats.len() / d
    }

    /// Keeps rows `a..b` in place (`d` the drafter's width, `w` a key's width `H * hd`).
    pub fn keep_rows(&mut self, a: usize, b: usize, d: usize, w: usize) {
        self.feats.truncate(b * d);
        self.feats.drain(..a * d);
        for (k, v) in &mut self.kv {
            for t in [k, v] {
                t.truncate(b * w);
                t.drain(..a * w);
            }
        }
    }

    pub fn append(&mut self, more: Ctx) {
        self.feats.extend_from_slice(&more.feats);
        for ((k, v), (k2, v2)) in self.kv.iter_mut().zip(more.kv) {
            k.extend_from_slice(&k2);
            v.extend_from_slice(&v2);
        }
    }
}

/// Rows per tile of [`matmul`]: the weight tile loaded once serves this many rows.
const MR: usize = 8;
/// Columns per tile (one AVX-512 register, two AVX2 registers).
const NR: usize = 16;

/// A weight matrix `[k, n]` (input-major) packed for [`matmul`]: each run of `NR` columns stored as one
/// contiguous `[k, NR]` panel, so a tile streams its weights in order (read column strips of the row-major
/// matrix defeat the hardware prefetcher: that layout ran the drafter 10x slower), then the columns past
/// the last full panel, row-major.
pub struct Packed {
    k: usize,
    n: usize,
    data: Vec<f32>,
}

impl Packed {
    /// Packs the row-major `w` `[k, n]`.
    pub fn new(w: &[f32], k: usize, n: usize) -> Packed {
        debug_assert_eq!(w.len(), k * n);
        let full = n / NR * NR;
        let mut data = Vec::with_capacity(k * n);
        for j0 in (0..full).step_by(NR) {
            for kk in 0..k {
                data.extend_from_slice(&w[kk * n + j0..kk * n + j0 + NR]);
            }
        }
        for kk in 0..k {
            data.extend_from_slice(&w[kk * n + full..(kk + 1) * n]);
        }
        Packed { k, n, data }
    }
}

/// `y[m, n] = x[m, k] . w[k, n]`.
pub fn matmul(x: &[f32], m: usize, w: &Packed) -> Vec<f32> {
    debug_assert_eq!(x.len(), m * w.k);
    let mut y = vec![0f32; m * w.n];
    matmul_body(x, m, w, &mut y, isa());
    y
}

/// One `MR x NR` tile with AVX-512: a register per row, the panel row loaded once for all rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512(panel: &[f32], xt: &[f32], k: usize, acc: &mut [[f32; NR]; MR]) {
    use std::arch::x86_64::*;
    debug_assert!(panel.len() >= k * NR && xt.len() >= k * MR);
    let mut r = [_mm512_setzero_ps(); MR];
    for kk in 0..k {
        // SAFETY: kk < k and both slices hold k rows (asserted above).
        let w = _mm512_loadu_ps(panel.as_ptr().add(kk * NR));
        let x = xt.as_ptr().add(kk * MR);
        for (i, ri) in r.iter_mut().enumerate() {
            *ri = _mm512_fmadd_ps(_mm512_set1_ps(*x.add(i)), w, *ri);
        }
    }
    for (i, ri) in r.iter().enumerate() {
        _mm512_storeu_ps(acc[i].as_mut_ptr(), *ri);
    }
}

/// The same with AVX2 and FMA, one 8-column half of the panel at a time (16 accumulators would not leave
/// registers for the operands).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(panel: &[f32], xt: &[f32], k: usize, acc: &mut [[f32; NR]; MR]) {
    use std::arch::x86_64::*;
    debug_assert!(panel.len() >= k * NR && xt.len() >= k * MR);
    for half in 0..2 {
        let mut r = [_mm256_setzero_ps(); MR];
        for kk in 0..k {
            // SAFETY: kk < k and both slices hold k rows (asserted above).
            let w = _mm256_loadu_ps(panel.as_ptr().add(kk * NR + half * 8));
            let x = xt.as_ptr().add(kk * MR);
            for (i, ri) in r.iter_mut().enumerate() {
                *ri = _mm256_fmadd_ps(_mm256_set1_ps(*x.add(i)), w, *ri);
            }
        }
        for (i, ri) in r.iter().enumerate() {
            _mm256_storeu_ps(acc[i].as_mut_ptr().add(half * 8), *ri);
        }
    }
}

/// One tile in plain Rust (other CPUs).
fn tile_plain(panel: &[f32], xt: &[f32], k: usize, acc: &mut [[f32; NR]; MR]) {
    for kk in 0..k {
        let w = &panel[kk * NR..(kk + 1) * NR];
        for (i, a) in acc.iter_mut().enumerate() {
            let xv = xt[kk * MR + i];
            for t in 0..NR {
                a[t] += xv * w[t];
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Isa {
    Plain,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

fn isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return Isa::Avx2;
        }
    }
    Isa::Plain
}

/// The tiled loop: an `MR x NR` tile of `y` accumulates in registers while `k` runs, each panel row
/// loaded once for all `MR` rows.
fn matmul_body(x: &[f32], m: usize, w: &Packed, y: &mut [f32], isa: Isa) {
    let (k, n) = (w.k, w.n);
    let full = n / NR * NR;
    let rest = n - full;
    let tail = &w.data[full * k..];
    let mut xt = vec![0f32; k * MR];
    for i0 in (0..m).step_by(MR) {
        let rows = (m - i0).min(MR);
        // The tile's rows of x, transposed to [k, MR] and zero-padded (the padding's products are never
        // stored).
        xt.iter_mut().for_each(|v| *v = 0.0);
        for r in 0..rows {
            for kk in 0..k {
                xt[kk * MR + r] = x[(i0 + r) * k + kk];
            }
        }
        for (p, panel) in w.data[..full * k].chunks_exact(k * NR).enumerate() {
            let mut acc = [[0f32; NR]; MR];
            match isa {
                // SAFETY: isa() found the instruction set on this CPU; panel and xt hold k rows.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { tile_avx512(panel, &xt, k, &mut acc) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { tile_avx2(panel, &xt, k, &mut acc) },
                Isa::Plain => tile_plain(panel, &xt, k, &mut acc),
            }
            let j0 = p * NR;
            for (r, a) in acc.iter().enumerate().take(rows) {
                y[(i0 + r) * n + j0..(i0 + r) * n + j0 + NR].copy_from_slice(a);
            }
        }
        for j in 0..rest {
            for r in 0..rows {
                y[(i0 + r) * n + full + j] = (0..k).map(|kk| xt[kk * MR + r] * tail[kk * rest + j]).sum();
            }
        }
    }
}

/// RMSNorm of each `weight.len()`-wide row of `x`, in place.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for row in x.chunks_exact_mut(d) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let s = 1.0 / (ms + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v *= s * w;
        }
    }
}

/// RoPE (the non-interleaved form: the two halves of each head rotate together) of `rows` rows of
/// `heads * hd` values, row `r` at position `pos0 + r`, in place.
pub fn rope(x: &mut [f32], heads: usize, hd: usize, pos0: usize, theta: f32) {
    let half = hd / 2;
    let inv: Vec<f32> = (0..half).map(|i| theta.powf(-((2 * i) as f32) / hd as f32)).collect();
    for (r, row) in x.chunks_exact_mut(heads * hd).enumerate() {
        let p = (pos0 + r) as f32;
        let cs: Vec<(f32, f32)> = inv.iter().map(|f| ((p * f).cos(), (p * f).sin())).collect();
        for h in row.chunks_exact_mut(hd) {
            let (a, b) = h.split_at_mut(half);
            for i in 0..half {
                let (c, s) = cs[i];
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * c - x2 * s;
                b[i] = x1 * s + x2 * c;
            }
        }
    }
}

/// Rows of k and v side by side (`[T, 2 * kw]`) as k `[T, kw]` and v `[T, kw]`.
fn split_kv(kv: &[f32], kw: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut k, mut v) = (Vec::with_capacity(kv.len() / 2), Vec::with_capacity(kv.len() / 2));
    for row in kv.chunks_exact(2 * kw) {
        k.extend_from_slice(&row[..kw]);
        v.extend_from_slice(&row[kw..]);
    }
    (k, v)
}

impl HostBlock {
    fn kw(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Context features `[T, D]` of concatenated taps `[T, taps * D_target]`.
    pub fn project(&self, taps: &[f32], t: usize) -> Vec<f32> {
        let mut f = matmul(taps, t, &self.fc);
        rms_norm(&mut f, &self.ctx_norm, self.eps);
        f
    }

    /// The context of features `feats` `[C, D]` at positions `offset..offset + C`.
    pub fn context(&self, feats: Vec<f32>, offset: usize) -> Ctx {
        let (c, kw) = (feats.len() / self.d, self.kw());
        let kv = self
            .layers
            .iter()
            .map(|l| {
                let (mut k, v) = split_kv(&matmul(&feats, c, &l.kv), kw);
                rope(&mut k, self.heads, self.head_dim, offset, self.theta);
                (k, v)
            })
            .collect();
        Ctx { feats, kv }
    }

    /// The block's logits `[K, V]` (see `BlockDrafter::block`): context `ctx`, the last position's features
    /// `last` `[D]`, the unrun token `token`, the block at positions `pos..pos + K`.
    pub fn block(&self, ctx: Option<&Ctx>, last: &[f32], token: u32, pos: usize) -> Vec<f32> {
        let (kk, d, kw, hd, h) = (self.block, self.d, self.kw(), self.head_dim, self.heads);
        let t = token as usize;
        let mut x = vec![0f32; kk * d];
        for (i, row) in x.chunks_exact_mut(d).enumerate() {
            let src = if i == 0 { &self.embed[t * d..(t + 1) * d] } else { &self.mask_embed[..] };
            for j in 0..d {
                row[j] = src[j] + self.slot_embed[i * d + j] + last[j];
            }
        }
        let c = ctx.map_or(0, |c| c.len(d));
        let scale = 1.0 / (hd as f32).sqrt();
        for (li, l) in self.layers.iter().enumerate() {
            let mut xn = x.clone();
            rms_norm(&mut xn, &l.attn_norm, self.eps);
            let mut q = matmul(&xn, kk, &l.q);
            let (mut kb, vb) = split_kv(&matmul(&xn, kk, &l.kv), kw);
            rope(&mut q, h, hd, pos, self.theta);
            rope(&mut kb, h, hd, pos, self.theta);
            let empty = (Vec::new(), Vec::new());
            let (kc, vc) = ctx.map_or(&empty, |c| &c.kv[li]);
            // Keys and values of the context, then of the block (no mask: every slot sees all of them).
            let key = |j: usize| if j < c { &kc[j * kw..(j + 1) * kw] } else { &kb[(j - c) * kw..(j - c + 1) * kw] };
            let val = |j: usize| if j < c { &vc[j * kw..(j + 1) * kw] } else { &vb[(j - c) * kw..(j - c + 1) * kw] };
            let n = c + kk;
            let mut att = vec![0f32; kk * kw];
            let mut s = vec![0f32; n];
            for i in 0..kk {
                for hh in 0..h {
                    let qv = &q[i * kw + hh * hd..i * kw + (hh + 1) * hd];
                    for (j, sj) in s.iter_mut().enumerate() {
                        let kv = &key(j)[hh * hd..(hh + 1) * hd];
                        *sj = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale;
                    }
                    let mx = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut z = 0f32;
                    for sj in s.iter_mut() {
                        *sj = (*sj - mx).exp();
                        z += *sj;
                    }
                    let out = &mut att[i * kw + hh * hd..i * kw + (hh + 1) * hd];
                    for (j, sj) in s.iter().enumerate() {
                        let p = sj / z;
                        for (o, v) in out.iter_mut().zip(&val(j)[hh * hd..(hh + 1) * hd]) {
                            *o += p * v;
                        }
                    }
                }
            }
            let o = matmul(&att, kk, &l.o);
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            let mut y = x.clone();
            rms_norm(&mut y, &l.mlp_norm, self.eps);
            let f = self.inter;
            let gu = matmul(&y, kk, &l.gate_up);
            let mut act = vec![0f32; kk * f];
            for (row, a) in gu.chunks_exact(2 * f).zip(act.chunks_exact_mut(f)) {
                for j in 0..f {
                    let g = row[j];
                    a[j] = g / (1.0 + (-g).exp()) * row[f + j];
                }
            }
            let down = matmul(&act, kk, &l.down);
            for (a, b) in x.iter_mut().zip(&down) {
                *a += b;
            }
        }
        rms_norm(&mut x, &self.norm, self.eps);
        matmul(&x, kk, &self.embed_t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiled matmul against the plain triple loop, on shapes with partial row tiles and columns outside
    /// the 16-wide tiles.
    #[test]
    fn matmul_matches_the_plain_loop() {
        for (m, k, n) in [(1, 3, 1), (7, 256, 2304), (9, 33, 50), (16, 5, 16), (3, 64, 17)] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
            let w: Vec<f32> = (0..k * n).map(|i| ((i * 53 % 97) as f32 - 48.0) / 31.0).collect();
            let packed = Packed::new(&w, k, n);
            let mut isas = vec![Isa::Plain, isa()];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                isas.push(Isa::Avx2);
            }
            for isa in isas {
                let mut y = vec![0f32; m * n];
                matmul_body(&x, m, &packed, &mut y, isa);
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k).map(|t| x[i * k + t] as f64 * w[t * n + j] as f64).sum();
                        let got = y[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{m}x{k}x{n} [{i},{j}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// RoPE keeps each rotated pair's norm and at position 0 changes nothing.
    #[test]
    fn rope_rotates_pairs() {
        let mut x: Vec<f32> = (0..2 * 8).map(|i| i as f32 * 0.1 - 0.7).collect();
        let orig = x.clone();
        rope(&mut x, 2, 4, 0, 10000.0);
        assert_eq!(x[..8], orig[..8]);
        for h in 0..4 {
            let (a, b) = (h * 4, h * 4 + 2);
            for i in 0..2 {
                let n0 = orig[a + i].hypot(orig[b + i]);
                let n1 = x[a + i].hypot(x[b + i]);
                assert!((n0 - n1).abs() < 1e-5);
            }
        }
        assert_ne!(x[8..], orig[8..]);
    }
}
