"""mlx_k3: mlx-k3's kernels on ``mx.array`` and a drop-in Kimi K3 model for mlx-lm and mlx-vlm.

The compiled part (``mlx_k3._native``, Rust over mlx-k3) links the very ``libmlx`` that Python's ``mlx``
loaded: one MLX runtime in the process, so arrays pass between Python and Rust without copies, lazy graphs
included. The kernels are ordinary MLX ops for Python code::

    import mlx.core as mx
    import mlx_k3

    y = mlx_k3.situ(up, gate, beta=2.0, linear_beta=4.0)          # lazy, like any mx op
    z = mlx_k3.gather_codebook_qmm(x, codes, qh, scales, rhs_indices=experts)

and ``import mlx_k3`` makes ``mlx_lm.load`` build every Kimi K3 checkpoint (``model_type: kimi_k3``) as
:class:`mlx_k3.models.kimi_k3.Model`: mlx-lm's model with mlx-k3's kernels (quantized matmuls, router,
SiTU, residual mix), float32 on a CPU as mlx-k3's CLI computes, and the project's codebook and tiered
expert formats (``config.json``'s ``quantization``: ``{"mode": "k3_codebook"}`` / ``"k3_tiered"``), which
``mlx_lm.generate``, ``stream_generate``, the server and perplexity use unchanged. The DeepSeek-V3 family
(``deepseek_v3``: DeepSeek-V3/R1, Kimi K2; ``kimi_k25``: Kimi K2.5/K2.7) loads the same way as
:mod:`mlx_k3.models.deepseek_v3` / :mod:`mlx_k3.models.kimi_k25`. Other model types keep mlx-lm's classes. ``python -m mlx_k3 <mlx_lm command> ...`` runs any mlx-lm command with the drop-in.

Images go through mlx-vlm (0.7.10, the ``vlm`` extra): with ``import mlx_k3``, ``mlx_vlm.load`` builds a
``kimi_k3`` (or ``kimi_k25``) checkpoint as mlx-vlm's model, its vision tower, projector and processor
mlx-vlm's own, whose language model is the drop-in's text model above (:mod:`mlx_k3.models.vlm_kimi_k3`,
:mod:`mlx_k3.models.vlm_kimi_k25`), checkpoints written by ``mlx-k3 convert`` included; ``mlx_vlm.generate``
and ``stream_generate`` take images unchanged::

    import mlx_k3, mlx_vlm

    model, processor = mlx_vlm.load("path/to/kimi-k3")
    prompt = mlx_vlm.apply_chat_template(processor, model.config, "What is in the picture?", num_images=1)
    print(mlx_vlm.generate(model, processor, prompt, image=["photo.png"], max_tokens=64).text)
"""

import mlx.core as mx  # loads libmlx first: the extension below binds to this same copy

from ._pins import MLX as MLX_VERSION  # noqa: E402

if mx.__version__ != MLX_VERSION:
    raise ImportError(
        f"mlx_k3 needs mlx {MLX_VERSION} exactly (it is compiled against that version and shares its libmlx), "
        f"but this environment has mlx {mx.__version__}. "
        f"Install the pinned version: pip install 'mlx=={MLX_VERSION}' (on Linux with 'mlx[cpu]=={MLX_VERSION}' "
        f"or 'mlx[cuda13]=={MLX_VERSION}')."
    )

from . import _native  # noqa: E402
from ._hook import install_drop_in  # noqa: E402
from .kernels import *  # noqa: E402,F401,F403
from .kernels import __all__ as _kernel_names  # noqa: E402

__version__ = _native.__version__

num_threads = _native.num_threads
set_num_threads = _native.set_num_threads

install_drop_in()

__all__ = ["MLX_VERSION", "install_drop_in", "num_threads", "set_num_threads", *_kernel_names]
