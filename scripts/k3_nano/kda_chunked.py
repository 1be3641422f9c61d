"""A chunk-parallel form of mlx-lm's gated delta rule (KDA), used only to make TRAINING fast on a CPU.

mlx-lm's `kimi_k3.KimiK3DeltaAttention` calls `gated_delta_update`, whose CPU path (`gated_delta_ops`) is a
Python loop over time with one compiled step per token: on a 2-core CPU it is ~25 passes over a
[B, H, Dv, Dk] state per token and layer, which dominated a training step. This module computes exactly
the same recurrence (same inputs, same outputs, up to fp32 rounding) chunk by chunk with matmuls, the way
flash-linear-attention trains KDA:

For one head, a chunk of C steps starting from state S0 ([Dv, Dk]), per-channel log decays
lg_t = log g_t ([Dk]), cumulative cl_t = sum_{s<=t} lg_s (inside the chunk):

    S_t = S0 diag(exp cl_t) + sum_{s<=t} u_s (k_s * exp(cl_t - cl_s))^T
    u_t = beta_t (v_t - S0 (k_t * exp cl_t) - sum_{s<t} A[t,s] u_s),  A[t,s] = sum_d k_t k_s exp(cl_t - cl_s)
        => U = (I + diag(beta) A)^-1 diag(beta) (V - K~ S0^T)
    y_t = S_t q_t = S0 (q_t * exp cl_t) + sum_{s<=t} Aqk[t,s] u_s,  Aqk[t,s] = sum_d q_t k_s exp(cl_t - cl_s)
    S_C = S0 diag(exp cl_C) + U^T (K * exp(cl_C - cl))

(I + L)^-1 for the strictly lower-triangular (nilpotent) L is the exact finite product
prod_i (I + (-L)^(2^i)), i < log2(C), so everything is differentiable MLX ops. Only the loop over the
T / C chunks stays sequential.

`install()` swaps `mlx_lm.models.kimi_k3.gated_delta_update` for `chunked_gated_delta_update`, which takes
the chunked path only where it is exact (no mask, T a multiple of the chunk) and otherwise defers to the
original. The model classes, parameters and checkpoint are mlx-lm's own; evaluation, perplexity and
sampling in this folder run with the original function (`uninstall()`), and `self_test()` checks outputs
and gradients against it.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta, kimi_k3

CHUNK = 16
_ORIGINAL = kimi_k3.gated_delta_update


def _log_decay(A_log, a, dt_bias, lower_bound):
    """log g, computed directly (not log(exp(...))) so it never hits log(0)."""
    A = mx.exp(A_log.astype(mx.float32))
    if lower_bound is None:
        return -A * nn.softplus(a.astype(mx.float32) + dt_bias)
    return lower_bound * mx.sigmoid(A * (a.astype(mx.float32) + dt_bias))


def _unit_lower_inverse(L: mx.array, C: int) -> mx.array:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C] (C a power of two)."""
    eye = mx.eye(C, dtype=L.dtype)
    P = -L
    R = eye + P
    n = 2
    while n < C:
        P = P @ P
        R = R @ (eye + P)
        n *= 2
    return R


def chunked_delta_rule(q, k, v, log_g, beta, state, C: int = CHUNK, factorized: bool = False):
    """q, k: [B, T, H, Dk] (normalized as mlx-lm does), v: [B, T, H, Dv], log_g: [B, T, H, Dk],
    beta: [B, T, H], state: [B, H, Dv, Dk] float32. Returns y [B, T, H, Dv] (q.dtype), state."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    N = T // C
    dtype = q.dtype

    def chunks(x):  # [B, T, H, D] -> [B, H, N, C, D]
        return x.reshape(B, N, C, H, -1).transpose(0, 3, 1, 2, 4).astype(mx.float32)

    q, k, v, lg = chunks(q), chunks(k), chunks(v), chunks(log_g)
    beta = beta.reshape(B, N, C, H).transpose(0, 3, 1, 2).astype(mx.float32)  # [B, H, N, C]
    cl = mx.cumsum(lg, axis=-2)  # [B, H, N, C, Dk]

    idx = mx.arange(C)
    incl = idx[:, None] >= idx[None, :]  # s <= t
    strict = idx[:, None] > idx[None, :]  # s < t
    if factorized:
        # A[t,s] = sum_d (k_t e^{cl_t - r}) (k_s e^{r - cl_s}) with r = cl at the chunk's middle: two
        # matmuls instead of a [C, C, Dk] tensor. Every factor lies in [e^-x, e^x], x = |lower_bound| C / 2,
        # every product in [e^-2x, e^2x]: finite and normal in fp32 for 2x <= 80 (checked by the caller).
        ref = cl[..., C // 2 : C // 2 + 1, :]
        kin = k * mx.exp(ref - cl)
        A = (k * mx.exp(cl - ref)) @ kin.swapaxes(-1, -2) * strict
        Aqk = (q * mx.exp(cl - ref)) @ kin.swapaxes(-1, -2) * incl
    else:
        diff = cl[..., :, None, :] - cl[..., None, :, :]  # [.., t, s, Dk]
        decay = mx.exp(mx.where(incl[..., None], diff, -mx.inf))  # 0 above the diagonal
        kd = k[..., None, :, :] * decay  # k_s * exp(cl_t - cl_s)   [.., t, s, Dk]
        A = (k[..., :, None, :] * kd).sum(-1) * strict  # [.., t, s]
        Aqk = (q[..., :, None, :] * kd).sum(-1)  # inclusive (decay is 0 above the diagonal)

    M = _unit_lower_inverse(beta[..., :, None] * A, C) * beta[..., None, :]  # (I + bA)^-1 diag(b)
    gam = mx.exp(cl)
    MV = M @ v  # [.., C, Dv]
    MK = M @ (k * gam)  # [.., C, Dk]
    Qg = q * gam
    Khat = k * mx.exp(cl[..., -1:, :] - cl)  # [.., C, Dk]
    gam_end = gam[..., -1, :]  # [B, H, N, Dk]

    S = state.astype(mx.float32)  # [B, H, Dv, Dk]
    ys = []
    for n in range(N):
        St = S.swapaxes(-1, -2)  # [B, H, Dk, Dv]
        U = MV[:, :, n] - MK[:, :, n] @ St
        ys.append(Qg[:, :, n] @ St + Aqk[:, :, n] @ U)
        S = S * gam_end[:, :, n, None, :] + U.swapaxes(-1, -2) @ Khat[:, :, n]
    y = mx.stack(ys, axis=2)  # [B, H, N, C, Dv]
    y = y.transpose(0, 2, 3, 1, 4).reshape(B, T, H, Dv)
    return y.astype(dtype), S


def chunked_gated_delta_update(
    q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True, lower_bound=None,
    allow_neg_eigval=False,
):
    T = q.shape[1]
    Hk, Hv = q.shape[2], v.shape[2]
    if mask is not None or T % CHUNK != 0 or allow_neg_eigval or Hk != Hv or a.ndim != 4:
        return _ORIGINAL(
            q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel, lower_bound=lower_bound,
            allow_neg_eigval=allow_neg_eigval,
        )
    beta = mx.sigmoid(b)
    log_g = _log_decay(A_log, a, dt_bias, lower_bound)
    if state is None:
        B, _, H, Dk = q.shape
        state = mx.zeros((B, H, v.shape[-1], Dk), dtype=mx.float32)
    # The two-matmul form needs a bounded decay (see chunked_delta_rule); otherwise the pairwise form.
    factorized = lower_bound is not None and abs(lower_bound) * CHUNK <= 80.0
    return chunked_delta_rule(q, k, v, log_g, beta, state, factorized=factorized)


def install():
    kimi_k3.gated_delta_update = chunked_gated_delta_update


def uninstall():
    kimi_k3.gated_delta_update = _ORIGINAL


def self_test(seed: int = 7, B: int = 2, T: int = 48, H: int = 2, Dk: int = 32, Dv: int = 32):
    """Max |difference| of outputs, final state and input gradients, chunked vs mlx-lm's loop."""
    key = mx.random.key(seed)
    ks = mx.random.split(key, 8)
    q = mx.random.normal((B, T, H, Dk), key=ks[0])
    k = mx.random.normal((B, T, H, Dk), key=ks[1])
    q, k = gated_delta.normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, H, Dv), key=ks[2])
    a = mx.random.normal((B, T, H, Dk), key=ks[3])
    b = mx.random.normal((B, T, H), key=ks[4])
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (H,), key=ks[5])).reshape(H, 1)
    dt_bias = 0.1 * mx.random.normal((H, Dk), key=ks[6])
    s0 = 0.1 * mx.random.normal((B, H, Dv, Dk), key=ks[7])
    worst = {}
    for lb in (-5.0, None):
        def f(fn, q, k, v, a, b):
            y, s = fn(q, k, v, a, b, A_log, dt_bias, s0, None, use_kernel=False, lower_bound=lb)
            return (y * mx.cos(mx.arange(Dv))).sum() + (s * s).sum(), (y, s)

        outs = {}
        for name, fn in (("ref", _ORIGINAL), ("chunked", chunked_gated_delta_update)):
            (val, (y, s)), grads = mx.value_and_grad(
                lambda *xs: f(fn, *xs), argnums=(0, 1, 2, 3, 4)
            )(q, k, v, a, b)
            mx.eval(y, s, grads)
            outs[name] = (y, s, grads)
        r, c = outs["ref"], outs["chunked"]
        worst[f"lb={lb}"] = {
            "y": mx.abs(r[0] - c[0]).max().item(),
            "state": mx.abs(r[1] - c[1]).max().item(),
            "grad": max(mx.abs(gr - gc).max().item() for gr, gc in zip(r[2], c[2])),
            "y_scale": mx.abs(r[0]).max().item(),
        }
    return worst


if __name__ == "__main__":
    import json

    print(json.dumps(self_test(), indent=1))
