"""mlx-k3's kernels as MLX ops on ``mx.array``.

Each function takes and returns ``mx.array`` without copying (the arrays are shared with the Rust side),
builds a lazy graph node like MLX's own ops, and runs on the default stream, or on ``stream=`` (an
``mx.Stream`` or ``mx.Device``) when given. Passing anything but an ``mx.array`` where an array is expected
raises a ``TypeError`` that names the argument. The signatures are in ``kernels.pyi``.

Adding a kernel: one ``#[pyfunction]`` in ``src/kernels/``, one line below, and its signature in
``kernels.pyi`` and ``_native.pyi``.
"""

import functools

import mlx.core as mx

from . import _native


def _with_stream(f):
    """``f`` with MLX's ``stream=`` keyword (the native functions use the current default stream)."""

    @functools.wraps(f)
    def call(*args, stream=None, **kwargs):
        if stream is None:
            return f(*args, **kwargs)
        with mx.stream(stream):
            return f(*args, **kwargs)

    return call


situ = _with_stream(_native.situ)
codebook_qmm = _with_stream(_native.codebook_qmm)
gather_codebook_qmm = _with_stream(_native.gather_codebook_qmm)
codebook_dequantize = _with_stream(_native.codebook_dequantize)
codebook_quantize = _with_stream(_native.codebook_quantize)
quantized_matmul = _with_stream(_native.quantized_matmul)
gather_qmm = _with_stream(_native.gather_qmm)
gather_tiered_qmm = _with_stream(_native.gather_tiered_qmm)
tiered_dequantize = _with_stream(_native.tiered_dequantize)
tiered_quantize = _with_stream(_native.tiered_quantize)
moe_router = _with_stream(_native.moe_router)
attn_res_mix = _with_stream(_native.attn_res_mix)

__all__ = [
    "situ",
    "codebook_qmm",
    "gather_codebook_qmm",
    "codebook_dequantize",
    "codebook_quantize",
    "quantized_matmul",
    "gather_qmm",
    "gather_tiered_qmm",
    "tiered_dequantize",
    "tiered_quantize",
    "moe_router",
    "attn_res_mix",
]
