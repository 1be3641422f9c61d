"""mlx_k3's kernels against mlx-lm / MLX ops on random inputs (CPU).

References: SiTU and the router against mlx-lm's own ``kimi_k3`` functions; the codebook format against an
independent NumPy decoder that takes IQ1_S's grid from the ``gguf`` package (llama.cpp's Python tooling);
quantized and tiered matmuls against MLX's ``quantized_matmul`` / ``gather_qmm`` / ``gather_mm``.
"""

import numpy as np
import mlx.core as mx
import pytest

import mlx_k3

mx.set_default_device(mx.cpu)
rng = np.random.default_rng(0)


def close(got, want, rtol=1e-4):
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert got.shape == want.shape
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got - want).max()) / scale
    assert err <= rtol, f"max relative error {err:.3g} > {rtol}"


# ---------------------------------------------------------------------------------------------- SiTU


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("linear_beta", [None, 4.0])
def test_situ_matches_mlx_lm(dtype, linear_beta):
    from mlx_lm.models.kimi_k3 import _situ

    up = (mx.random.normal((4, 7, 384)) * 3).astype(dtype)
    gate = (mx.random.normal((4, 7, 384)) * 3).astype(dtype)
    got = mlx_k3.situ(up, gate, 2.0, linear_beta)
    want = _situ(up, gate, 2.0, linear_beta)
    assert got.dtype == dtype
    close(got, want, 1e-6 if dtype == mx.float32 else 1e-2)


def test_situ_broadcasts_and_takes_a_stream():
    up = mx.random.normal((3, 1, 64))
    gate = mx.random.normal((1, 5, 64))
    got = mlx_k3.situ(up, gate, 1.0, stream=mx.cpu)
    assert got.shape == (3, 5, 64)
    close(got, mx.sigmoid(gate) * mx.tanh(gate) * up)


# ----------------------------------------------------------------------------------- codebook format


def iq1s_grid():
    gguf = pytest.importorskip("gguf", reason="the independent reference decoder takes IQ1_S's grid from gguf")
    gguf.quants.IQ1_S.init_grid()
    return np.asarray(gguf.quants.IQ1_S.grid, dtype=np.float32).reshape(2048, 8)


def decode(codes, qh, scales):
    """IQ1_S semantics on the planar arrays: w[32b + 8l + j] = d (2L + 1) (grid[idx_l][j] + delta)."""
    grid = iq1s_grid()
    codes, qh = np.array(codes).astype(np.int64), np.array(qh).astype(np.int64)
    d = np.array(scales.astype(mx.float32))
    *lead, n, k8 = codes.shape
    shifts = 3 * (np.arange(k8) % 4)
    idx = codes | (((np.repeat(qh, 4, axis=-1) >> shifts) & 7) << 8)
    vals = grid[idx].reshape(*lead, n, k8 // 4, 32)
    dl = np.repeat(d, 8, axis=-1) * (2 * ((qh >> 12) & 7) + 1)
    delta = np.where(qh & 0x8000, -0.125, 0.125)
    return mx.array((dl[..., None] * (vals + delta[..., None])).reshape(*lead, n, k8 * 8).astype(np.float32))


def random_codebook(*shape):
    """Random planes (every bit pattern is a valid code) for a weight of shape ``[..., N, K]``."""
    *lead, n, k = shape
    codes = mx.array(rng.integers(0, 256, (*lead, n, k // 8), dtype=np.uint8))
    qh = mx.array(rng.integers(0, 1 << 16, (*lead, n, k // 32), dtype=np.uint16))
    scales = mx.array(rng.uniform(0.001, 0.02, (*lead, n, k // 256)).astype(np.float16))
    return codes, qh, scales


def test_codebook_dequantize_matches_an_independent_decoder():
    cb = random_codebook(3, 16, 512)
    close(mlx_k3.codebook_dequantize(*cb), decode(*cb), 1e-6)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_codebook_qmm(dtype, m):
    cb = random_codebook(48, 768)
    x = mx.random.normal((2, m, 768)).astype(dtype)
    got = mlx_k3.codebook_qmm(x, *cb)
    assert got.dtype == dtype and got.shape == (2, m, 48)
    close(got, x.astype(mx.float32) @ decode(*cb).T, 1e-4 if dtype == mx.float32 else 1e-2)


def test_gather_codebook_qmm_as_switch_glu_calls_it():
    """Both call shapes of mlx-lm's SwitchGLU: unsorted (x [B, L, 1, 1, K], indices [B, L, k]) and sorted
    (x [T k, 1, K], indices [T k])."""
    experts, n, k = 8, 40, 512
    cb = random_codebook(experts, n, k)
    w_t = decode(*cb).swapaxes(-1, -2)
    x = mx.random.normal((2, 3, 1, 1, k))
    inds = mx.array(rng.integers(0, experts, (2, 3, 4)).astype(np.uint32))
    close(mlx_k3.gather_codebook_qmm(x, *cb, rhs_indices=inds), mx.gather_mm(x, w_t, rhs_indices=inds))
    order = mx.argsort(inds.flatten())
    xs, idx = x.flatten(0, -3)[order // 4], inds.flatten()[order]
    got = mlx_k3.gather_codebook_qmm(xs, *cb, rhs_indices=idx, sorted_indices=True)
    close(got, mx.gather_mm(xs, w_t, rhs_indices=idx, sorted_indices=True))


def test_gather_codebook_qmm_with_lhs_indices():
    cb = random_codebook(4, 24, 256)
    x = mx.random.normal((5, 2, 256))
    lhs = mx.array([4, 0, 2], dtype=mx.uint32)
    rhs = mx.array([1, 3, 3], dtype=mx.uint32)
    got = mlx_k3.gather_codebook_qmm(x, *cb, lhs_indices=lhs, rhs_indices=rhs)
    close(got, mx.gather_mm(x, decode(*cb).swapaxes(-1, -2), lhs_indices=lhs, rhs_indices=rhs))


def test_codebook_quantize_roundtrip_is_close():
    w = mx.random.normal((16, 512)) * 0.02
    codes, qh, scales = mlx_k3.codebook_quantize(w)
    w_hat = decode(codes, qh, scales)
    rel = float(mx.sum((w - w_hat) ** 2) / mx.sum(w**2))
    assert rel < 0.5  # ~1.56 bits per weight on Gaussian data


def test_codebook_errors_name_the_problem():
    codes, qh, scales = random_codebook(8, 256)
    with pytest.raises(ValueError, match="'qh' must be uint16"):
        mlx_k3.codebook_qmm(mx.ones((1, 256)), codes, qh.astype(mx.uint32), scales)
    with pytest.raises(ValueError, match="codebook_qmm"):
        mlx_k3.codebook_qmm(mx.ones((1, 512)), codes, qh, scales)
        mx.eval()


# --------------------------------------------------------------------------- MLX-format quantized matmuls

QUANT_CASES = [("affine", 64, 4), ("affine", 32, 2), ("affine", 128, 8), ("mxfp4", 32, 4)]


@pytest.mark.parametrize("mode,group_size,bits", QUANT_CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_quantized_matmul_matches_mlx(mode, group_size, bits, dtype):
    w = mx.random.normal((96, 512)) * 0.05
    wq, scales, *biases = mx.quantize(w, group_size, bits, mode=mode)
    biases = biases[0] if biases else None
    x = mx.random.normal((3, 7, 512)).astype(dtype)
    got = mlx_k3.quantized_matmul(x, wq, scales, biases, group_size, bits, mode)
    want = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group_size, bits=bits, mode=mode)
    assert got.dtype == want.dtype
    close(got, want, 1e-4 if dtype == mx.float32 else 2e-2)


@pytest.mark.parametrize("mode,group_size,bits", QUANT_CASES)
def test_gather_qmm_matches_mlx(mode, group_size, bits):
    w = mx.random.normal((6, 64, 256)) * 0.05
    wq, scales, *biases = mx.quantize(w, group_size, bits, mode=mode)
    biases = biases[0] if biases else None
    x = mx.random.normal((4, 1, 1, 256))
    inds = mx.array(rng.integers(0, 6, (4, 3)).astype(np.uint32))
    kw = dict(group_size=group_size, bits=bits, mode=mode)
    got = mlx_k3.gather_qmm(x, wq, scales, biases, rhs_indices=inds, **kw)
    want = mx.gather_qmm(x, wq, scales, biases, rhs_indices=inds, transpose=True, **kw)
    close(got, want)


def test_quantized_matmul_rejects_zero_group_size():
    w = mx.random.normal((8, 64))
    wq, scales, biases = mx.quantize(w, 64, 4)
    with pytest.raises(ValueError, match="group_size and bits must be positive"):
        mlx_k3.quantized_matmul(mx.ones((1, 64)), wq, scales, biases, group_size=0, bits=4)


# -------------------------------------------------------------------------------------- tiered stacks

TIERS = [0, 1, 2, 0, 0, 1, 2, 0]  # 0 codebook, 1 mxfp4, 2 affine


def tiered_stack(n=32, k=512):
    w = mx.random.normal((len(TIERS), n, k)) * 0.05
    return w, mlx_k3.tiered_quantize(w, TIERS, affine_group_size=64, affine_bits=4)


def tiered_kwargs(s):
    return dict(
        codes=s["codebook.codes"], qh=s["codebook.qh"], scales=s["codebook.scales"],
        mxfp4_weight=s["mxfp4.weight"], mxfp4_scales=s["mxfp4.scales"],
        affine_weight=s["affine.weight"], affine_scales=s["affine.scales"], affine_biases=s["affine.biases"],
        affine_group_size=64, affine_bits=4,
    )


def test_tiered_dequantize_matches_each_format():
    _, s = tiered_stack()
    got = mlx_k3.tiered_dequantize(s["tier"], s["slot"], **tiered_kwargs(s))
    slots = np.array(s["slot"])
    want = {
        0: decode(s["codebook.codes"], s["codebook.qh"], s["codebook.scales"]),
        1: mx.dequantize(s["mxfp4.weight"], s["mxfp4.scales"], None, 32, 4, mode="mxfp4"),
        2: mx.dequantize(s["affine.weight"], s["affine.scales"], s["affine.biases"], 64, 4),
    }
    for e, t in enumerate(TIERS):
        close(got[e], want[t][int(slots[e])].astype(mx.float32), 1e-5)


def test_gather_tiered_qmm_matches_gather_mm():
    _, s = tiered_stack()
    w_t = mlx_k3.tiered_dequantize(s["tier"], s["slot"], **tiered_kwargs(s)).swapaxes(-1, -2)
    x = mx.random.normal((3, 2, 1, 1, 512))
    inds = mx.array(rng.integers(0, len(TIERS), (3, 2, 4)).astype(np.uint32))
    got = mlx_k3.gather_tiered_qmm(x, s["tier"], s["slot"], rhs_indices=inds, **tiered_kwargs(s))
    close(got, mx.gather_mm(x, w_t, rhs_indices=inds))


# ---------------------------------------------------------------------------------------------- router


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_moe_router_matches_mlx_lm(n_group, topk_group, dtype):
    from mlx_lm.models.kimi_k3 import _group_expert_select

    logits = (mx.random.normal((5, 7, 64)) * 2).astype(dtype)
    bias = mx.random.normal((64,)) * 0.1
    got_i, got_w = mlx_k3.moe_router(
        logits, bias, top_k=6, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5
    )
    want_i, want_w = _group_expert_select(logits, bias, 6, n_group, topk_group, 2.5, True)
    assert got_i.dtype == mx.uint32 and got_w.dtype == dtype
    # Same experts with the same weights (compared in index order).
    gi, wi = np.array(got_i), np.array(want_i)
    go, wo = np.argsort(gi, axis=-1), np.argsort(wi, axis=-1)
    assert np.array_equal(np.take_along_axis(gi, go, -1), np.take_along_axis(wi, wo, -1))
    gw = np.take_along_axis(np.array(got_w.astype(mx.float32)), go, -1)
    ww = np.take_along_axis(np.array(want_w.astype(mx.float32)), wo, -1)
    np.testing.assert_allclose(gw, ww, rtol=1e-6 if dtype == mx.float32 else 1e-2)


def test_moe_router_protected_tier():
    logits = mx.random.normal((3, 16))
    mask = mx.array([1] * 4 + [0] * 12, dtype=mx.uint8)
    inds, _, prot = mlx_k3.moe_router(logits, top_k=4, protected_mask=mask)
    assert prot.dtype == mx.bool_
    assert np.array_equal(np.array(prot), np.array(inds) < 4)


# ---------------------------------------------------------------------------- attention-residual mix


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_attn_res_mix_matches_mlx_lm(dtype):
    from mlx_lm.models.kimi_k3 import _attn_res_combine

    k, b, t, d, eps = 3, 2, 5, 64, 1e-6
    raw = mx.random.normal((k, b, t, d)).astype(dtype)
    rf = raw.astype(mx.float32)
    inv_rms = mx.rsqrt((rf * rf).mean(axis=-1) + eps)
    partial = mx.random.normal((b, t, d)).astype(dtype)
    w_eff = mx.random.normal((d,)) * 0.5
    got = mlx_k3.attn_res_mix(raw, inv_rms, partial, w_eff, eps)
    want = _attn_res_combine(raw, inv_rms, partial, w_eff, eps)
    assert got.dtype == dtype and got.shape == want.shape
    # f32: the same math summed in another order; bf16: one rounding of the result (2 ulp at 2^-7).
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    close(got, want, tol)


# -------------------------------------------------------------------------------- inside compiled code


def test_kernels_work_inside_mx_compile():
    f = mx.compile(lambda u, g: mlx_k3.situ(u, g, 2.0, 4.0) * 2)
    u, g = mx.random.normal((4, 64)), mx.random.normal((4, 64))
    close(f(u, g), mlx_k3.situ(u, g, 2.0, 4.0) * 2, 1e-6)
