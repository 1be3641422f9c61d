"""Type stubs of ``mlx_k3.kernels``: mlx-k3's kernels as MLX ops on ``mx.array``. Every function also takes
``stream=`` (an ``mx.Stream`` or ``mx.Device``; default: the current default stream), as MLX's ops do."""

from typing import Dict, Optional, Sequence, Tuple, Union

import mlx.core as mx

StreamOrDevice = Union[None, mx.Stream, mx.Device]

__all__: list[str]

def situ(
    up: mx.array,
    gate: mx.array,
    beta: float = 1.0,
    linear_beta: Optional[float] = None,
    *,
    stream: StreamOrDevice = None,
) -> mx.array: ...
def codebook_qmm(
    x: mx.array, codes: mx.array, qh: mx.array, scales: mx.array, *, stream: StreamOrDevice = None
) -> mx.array: ...
def gather_codebook_qmm(
    x: mx.array,
    codes: mx.array,
    qh: mx.array,
    scales: mx.array,
    lhs_indices: Optional[mx.array] = None,
    rhs_indices: Optional[mx.array] = None,
    sorted_indices: bool = False,
    *,
    stream: StreamOrDevice = None,
) -> mx.array: ...
def codebook_dequantize(
    codes: mx.array, qh: mx.array, scales: mx.array, *, stream: StreamOrDevice = None
) -> mx.array: ...
def codebook_quantize(
    w: mx.array,
    importance: Optional[mx.array] = None,
    *,
    stream: StreamOrDevice = None,
) -> Tuple[mx.array, mx.array, mx.array]: ...
def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: Optional[mx.array] = None,
    group_size: Optional[int] = None,
    bits: Optional[int] = None,
    mode: str = "affine",
    *,
    stream: StreamOrDevice = None,
) -> mx.array: ...
def gather_qmm(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: Optional[mx.array] = None,
    lhs_indices: Optional[mx.array] = None,
    rhs_indices: Optional[mx.array] = None,
    group_size: Optional[int] = None,
    bits: Optional[int] = None,
    mode: str = "affine",
    sorted_indices: bool = False,
    *,
    stream: StreamOrDevice = None,
) -> mx.array: ...
def gather_tiered_qmm(
    x: mx.array,
    tier: mx.array,
    slot: mx.array,
    codes: Optional[mx.array] = None,
    qh: Optional[mx.array] = None,
    scales: Optional[mx.array] = None,
    mxfp4_weight: Optional[mx.array] = None,
    mxfp4_scales: Optional[mx.array] = None,
    affine_weight: Optional[mx.array] = None,
    affine_scales: Optional[mx.array] = None,
    affine_biases: Optional[mx.array] = None,
    affine_group_size: int = 64,
    affine_bits: int = 4,
    lhs_indices: Optional[mx.array] = None,
    rhs_indices: Optional[mx.array] = None,
    sorted_indices: bool = False,
    *,
    stream: StreamOrDevice = None,
) -> mx.array: ...
def tiered_dequantize(
    tier: mx.array,
    slot: mx.array,
    codes: Optional[mx.array] = None,
    qh: Optional[mx.array] = None,
    scales: Optional[mx.array] = None,
    mxfp4_weight: Optional[mx.array] = None,
    mxfp4_scales: Optional[mx.array] = None,
    affine_weight: Optional[mx.array] = None,
    affine_scales: Optional[mx.array] = None,
    affine_biases: Optional[mx.array] = None,
    affine_group_size: int = 64,
    affine_bits: int = 4,
    *,
    stream: StreamOrDevice = None,
) -> mx.array: ...
def tiered_quantize(
    w: mx.array,
    tiers: Sequence[int],
    affine_group_size: int = 64,
    affine_bits: int = 4,
    importance: Optional[mx.array] = None,
    *,
    stream: StreamOrDevice = None,
) -> Dict[str, mx.array]: ...
def moe_router(
    logits: mx.array,
    bias: Optional[mx.array] = None,
    *,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
    protected_mask: Optional[mx.array] = None,
    stream: StreamOrDevice = None,
) -> Union[Tuple[mx.array, mx.array], Tuple[mx.array, mx.array, mx.array]]: ...
def attn_res_mix(
    raw: mx.array,
    inv_rms: mx.array,
    partial: mx.array,
    w_eff: mx.array,
    eps: float = 1e-6,
    *,
    stream: StreamOrDevice = None,
) -> mx.array: ...
