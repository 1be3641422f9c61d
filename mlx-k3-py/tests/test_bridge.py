"""Zero-copy exchange of mx.array and the Rust Array (lazy graphs included), and TypeErrors naming arguments.

``mlx_k3._native.rust_view(a)`` returns what the Rust side sees after taking ``a`` through the bridge: the id
of the underlying MLX array (the address of its shared node) and whether it is evaluated.
``roundtrip(a)`` takes ``a`` into a Rust ``Array`` and hands it back as a new ``mx.array`` object.
"""

import numpy as np
import mlx.core as mx
import pytest

import mlx_k3
from mlx_k3 import _native

DTYPES = [
    mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32, mx.int64,
    mx.float16, mx.bfloat16, mx.float32, mx.float64, mx.complex64,
]


def _node_id(a):
    """The id of the MLX array behind ``a`` as the Rust side sees it."""
    return _native.rust_view(a)[0]


def test_rust_sees_the_same_array_not_a_copy():
    a = mx.arange(12, dtype=mx.float32).reshape(3, 4)
    b = _native.roundtrip(a)
    assert b is not a
    assert _node_id(a) == _node_id(b)
    assert _node_id(a) != _node_id(mx.arange(12, dtype=mx.float32).reshape(3, 4))


def test_lazy_graph_stays_lazy_both_ways():
    x = mx.arange(6, dtype=mx.float32) * 2 + 1  # a lazy graph: nothing evaluated yet
    assert _native.rust_view(x) == (_node_id(x), False)
    y = _native.roundtrip(x)
    assert _native.rust_view(y)[1] is False  # passing through Rust evaluated nothing
    # A Rust kernel on a lazy input returns a lazy output built on top of the same graph.
    z = mlx_k3.situ(y, y, 2.0, 4.0)
    assert _native.rust_view(z)[1] is False and _native.rust_view(x)[1] is False
    mx.eval(z)
    # Evaluating the output evaluated the shared input node: the same node on both sides.
    assert _native.rust_view(x)[1] is True
    assert np.array_equal(np.array(y), np.arange(6) * 2 + 1)


def test_evaluated_data_is_shared():
    a = mx.random.normal((64, 64))
    mx.eval(a)
    b = _native.roundtrip(a)
    pa = np.array(a, copy=False).__array_interface__["data"][0]
    pb = np.array(b, copy=False).__array_interface__["data"][0]
    assert pa == pb


def test_roundtrip_allocates_nothing():
    a = mx.zeros((32, 1024, 1024), dtype=mx.float32)  # 128 MiB
    mx.eval(a)
    before = mx.get_active_memory()
    copies = [_native.roundtrip(a) for _ in range(8)]
    mx.eval(copies)
    assert mx.get_active_memory() - before < 1 << 20
    assert all(_node_id(c) == _node_id(a) for c in copies)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_crosses_unchanged(dtype):
    a = (mx.arange(10) % 3).astype(dtype).reshape(2, 5)
    b = _native.roundtrip(a)
    assert b.dtype == dtype and b.shape == (2, 5)
    assert mx.array_equal(a, b).item()


def test_arrays_made_in_rust_are_ordinary_mx_arrays():
    """Outputs built in Rust (here host memory wrapped without a copy) work in any mx op."""
    codes, qh, scales = mlx_k3.codebook_quantize(mx.random.normal((8, 256)))
    assert (codes.dtype, qh.dtype, scales.dtype) == (mx.uint8, mx.uint16, mx.float16)
    assert (codes.shape, qh.shape, scales.shape) == ((8, 32), (8, 8), (8, 1))
    total = codes.astype(mx.int32).sum() + qh.astype(mx.int32).sum()
    assert total.item() > 0


@pytest.mark.parametrize("bad", [[1.0, 2.0], np.ones(4, dtype=np.float32), 3.0, None, "x"], ids=repr)
def test_non_array_is_a_type_error_naming_the_argument(bad):
    x = mx.ones((4,))
    with pytest.raises(TypeError, match=r"situ\(\): argument 'gate' must be mlx.core.array, not "):
        mlx_k3.situ(x, bad)
    with pytest.raises(TypeError, match=r"argument 'up' must be mlx.core.array"):
        mlx_k3.situ(bad, x)


def test_optional_array_arguments_are_checked_too():
    x = mx.ones((2, 1, 256))
    codes, qh, scales = mlx_k3.codebook_quantize(mx.random.normal((3, 4, 256)))
    with pytest.raises(TypeError, match=r"gather_codebook_qmm\(\): argument 'rhs_indices' must be mlx.core.array, not list"):
        mlx_k3.gather_codebook_qmm(x, codes, qh, scales, rhs_indices=[0, 1])
    with pytest.raises(TypeError, match=r"argument 'qh' must be mlx.core.array, not int"):
        mlx_k3.codebook_qmm(x, codes, 7, scales)
