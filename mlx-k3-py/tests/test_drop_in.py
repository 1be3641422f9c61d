"""The drop-in model: after ``import mlx_k3``, ``mlx_lm.load`` builds every Kimi K3 checkpoint as the
drop-in (mlx-k3's kernels, float32 on the CPU, mlx-k3's formats), and mlx-lm's generation and evaluation use
it unchanged.

mlx-k3's formats are checked against the same model with its expert stacks decoded to float32 and loaded by
mlx-lm's own class (logits, perplexity, greedy tokens); MLX's formats and k3-nano as it ships (bf16) against
mlx-lm's own class in float32 (logits); every format against the Rust engine's CLI (greedy tokens)."""

import json
import re
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import kimi_k3 as mlx_lm_kimi_k3
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.perplexity import eval_ppl
from mlx_lm.utils import load_model

import checkpoints
import mlx_k3
from mlx_k3.models import kimi_k3 as drop_in

PROMPT = 'def parse_header(line):\n    """'
MAX_TOKENS = 48

mx.set_default_device(mx.cpu)


def logits(model, tokenizer, text=PROMPT):
    return model(mx.array([tokenizer.encode(text)]))[0].astype(mx.float32)


@pytest.fixture(scope="module", params=["codebook", "codebook_narrow", "tiered"])
def quantized(request, codebook_ckpts, codebook_narrow_ckpts, tiered_ckpts):
    """(format, checkpoint, float32 reference checkpoint); codebook_narrow: short super-blocks (K = 128, 32)."""
    ckpts = {"codebook": codebook_ckpts, "codebook_narrow": codebook_narrow_ckpts, "tiered": tiered_ckpts}
    return (request.param, *ckpts[request.param])


def test_mlx_lm_loads_the_drop_in_for_k3_formats(quantized):
    fmt, ckpt, _ = quantized
    model, _ = mlx_lm.load(str(ckpt))
    assert type(model) is drop_in.Model
    moe = model.language_model.model.layers[1].mlp
    want = drop_in.TieredSwitchLinear if fmt == "tiered" else drop_in.CodebookSwitchLinear
    for proj in checkpoints.PROJECTIONS:
        assert type(getattr(moe.switch_mlp, proj)) is want
    assert type(moe.switch_mlp.activation) is drop_in.FusedSiTU


def test_every_kimi_k3_checkpoint_loads_the_drop_in(plain_ckpt, affine_ckpt, mxfp4_ckpt):
    """Plain float checkpoints (k3-nano as it ships, bf16; float32) and MLX's formats load as the drop-in;
    its quantized layers run mlx-k3's quantized_matmul / gather_qmm."""
    for path in (checkpoints.K3_NANO, plain_ckpt):
        model, _ = mlx_lm.load(str(path))
        assert type(model) is drop_in.Model
        moe = model.language_model.model.layers[1].mlp
        assert type(moe.switch_mlp.up_proj) is SwitchLinear
        assert type(moe.switch_mlp.activation) is drop_in.FusedSiTU
    for path in (affine_ckpt, mxfp4_ckpt):
        model, _ = mlx_lm.load(str(path))
        assert type(model) is drop_in.Model
        lm = model.language_model.model
        moe = lm.layers[1].mlp
        for proj in checkpoints.PROJECTIONS:
            assert type(getattr(moe.switch_mlp, proj)) is drop_in.K3QuantizedSwitchLinear
        assert type(moe.shared_experts.up_proj) is drop_in.K3QuantizedLinear
        assert type(moe.gate) is drop_in.K3QuantizedLinear and moe.gate.bits == 8  # mlx-lm's router predicate
        assert type(lm.embed_tokens) is drop_in.K3QuantizedEmbedding  # tied: the output head


@pytest.mark.parametrize("kernel", ["moe_router", "attn_res_mix", "situ"])
def test_kernels_run_in_the_drop_in_only(kernel, plain_ckpt, monkeypatch):
    """On a CPU the drop-in runs mlx-k3's router, residual mix and SiTU (mlx-lm's module functions dispatch to
    them); mlx-lm's own class (``drop_in.MlxLmModel``) keeps mlx-lm's functions."""
    assert drop_in.MlxLmModel.__module__ == "mlx_lm.models.kimi_k3" and drop_in.MlxLmModel is not drop_in.Model
    drop, _ = mlx_lm.load(str(plain_ckpt))
    own, _ = mlx_lm_load(plain_ckpt)
    calls = []
    real = getattr(drop_in.kernels, kernel)
    monkeypatch.setattr(drop_in.kernels, kernel, lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens = mx.array([[1, 2, 3]])
    mx.eval(own(tokens))
    assert calls == []
    mx.eval(drop(tokens))
    assert calls


def test_hook_points_mlx_lm_at_the_drop_in():
    assert mlx_lm_kimi_k3.Model is drop_in.Model
    assert mlx_lm_kimi_k3.ModelArgs is drop_in.ModelArgs


def mlx_lm_load(path, dtype=None):
    """``path`` loaded by mlx-lm's own ``kimi_k3`` classes (not the drop-in), its float weights cast to
    ``dtype`` as mlx-lm casts them (``cast_predicate``)."""
    model, _ = load_model(path, get_model_classes=lambda config: (drop_in.MlxLmModel, drop_in.MlxLmModelArgs))
    if dtype is not None:
        keep = model.cast_predicate
        params = [
            (k, v.astype(dtype) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v)
            for k, v in tree_flatten(model.parameters())
        ]
        model.update(tree_unflatten(params))
    return model, None


@pytest.mark.parametrize("which", ["k3_nano", "affine", "mxfp4"])
def test_logits_match_mlx_lm_in_float32(which, affine_ckpt, mxfp4_ckpt):
    """k3-nano as it ships (bf16) and mlx-lm's affine / MXFP4 quantizations of it: the drop-in's logits are
    mlx-lm's own class's in float32 (mlx-lm's model cannot run bf16 experts on a CPU: MLX's CPU gather_mm
    takes float32 only)."""
    path = {"k3_nano": checkpoints.K3_NANO, "affine": affine_ckpt, "mxfp4": mxfp4_ckpt}[which]
    model, tok = mlx_lm.load(str(path))
    got = logits(model, tok)
    assert got.dtype == mx.float32
    ref, _ = mlx_lm_load(path, mx.float32)
    want = logits(ref, tok)
    err = float(mx.abs(got - want).max() / mx.abs(want).max())
    assert err < 1e-5, err


def test_mlx_lm_alone_cannot_run_k3_nano_on_the_cpu():
    """What the drop-in fixes: mlx-lm's own model fails on k3-nano's bf16 experts on a CPU."""
    model, _ = mlx_lm_load(checkpoints.K3_NANO)
    with pytest.raises(RuntimeError, match="GatherMM.*float32"):
        mx.eval(model(mx.array([[1, 2, 3]])))


def test_convert_keeps_the_checkpoint_dtype(tmp_path):
    """The float32 cast happens at the first call on a CPU, not at load: loading and saving (what
    ``mlx_lm.convert`` does) keeps k3-nano's bf16."""
    model, _ = mlx_lm.load(str(checkpoints.K3_NANO), lazy=True)
    dtypes = {v.dtype for _, v in tree_flatten(model.parameters())}
    assert mx.bfloat16 in dtypes
    model(mx.array([[1, 2, 3]]))
    dtypes = {k: v.dtype for k, v in tree_flatten(model.parameters())}
    assert set(dtypes.values()) == {mx.float32}, dtypes


def test_logits_match_the_decoded_reference(quantized):
    _, ckpt, ref = quantized
    got = logits(*mlx_lm.load(str(ckpt)))
    want = logits(*mlx_lm.load(str(ref)))
    err = float(mx.abs(got - want).max() / mx.abs(want).max())
    assert err < 1e-5, err


def test_generate_and_stream_generate(quantized):
    _, ckpt, ref = quantized
    model, tok = mlx_lm.load(str(ckpt))
    text = mlx_lm.generate(model, tok, PROMPT, max_tokens=MAX_TOKENS)
    streamed = "".join(r.text for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=MAX_TOKENS))
    assert text == streamed and len(text) > 20
    ref_model, ref_tok = mlx_lm.load(str(ref))
    assert text == mlx_lm.generate(ref_model, ref_tok, PROMPT, max_tokens=MAX_TOKENS)


def test_perplexity(quantized):
    _, ckpt, ref = quantized
    tokens = mx.load(str(checkpoints.K3_NANO / "heldout.safetensors"))["tokens"][: 4 * 128].reshape(4, 128)
    ppl, _ = eval_ppl(mlx_lm.load(str(ckpt))[0], tokens, batch_size=2)
    ppl_ref, _ = eval_ppl(mlx_lm.load(str(ref))[0], tokens, batch_size=2)
    assert 1.0 < ppl < 200.0
    assert abs(ppl - ppl_ref) / ppl_ref < 1e-4


def rust_generate(cli, ckpt):
    r = subprocess.run(
        [str(cli), "generate", "--model", str(ckpt), "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--raw"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize(
    "which", ["k3_nano", "plain", "affine", "mxfp4", "codebook", "codebook_narrow", "tiered"]
)
def test_greedy_tokens_match_the_rust_cli(
    which, rust_cli, plain_ckpt, affine_ckpt, mxfp4_ckpt, codebook_ckpts, codebook_narrow_ckpts, tiered_ckpts
):
    """Greedy decoding through mlx_lm.generate gives the Rust CLI's continuation, token for token (the CLI
    prints the prompt, then the continuation, then a newline). k3_nano: the checkpoint as it ships (bf16, no
    tokenizer.json); plain: float32; affine, mxfp4: mlx-lm's quantizations of it (bf16 scales)."""
    ckpt = {
        "k3_nano": checkpoints.K3_NANO,
        "plain": plain_ckpt,
        "affine": affine_ckpt,
        "mxfp4": mxfp4_ckpt,
        "codebook": codebook_ckpts[0],
        "codebook_narrow": codebook_narrow_ckpts[0],
        "tiered": tiered_ckpts[0],
    }[which]
    model, tok = mlx_lm.load(str(ckpt))
    ids = []
    for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=MAX_TOKENS):
        ids.append(r.token)
    assert len(ids) == MAX_TOKENS  # no early stop: the whole budget is compared
    assert rust_generate(rust_cli, ckpt) == PROMPT + tok.decode(ids) + "\n"


def test_k3_format_without_its_tensors_is_a_clear_error(tmp_path, codebook_ckpts):
    ckpt, _ = codebook_ckpts
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization"]["language_model.model.layers.1.mlp.shared_experts.up_proj"] = {"mode": "k3_codebook"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"k3_codebook format but \['language_model.model.layers.1.mlp.shared_experts"):
        mlx_lm.load(str(bad))


def test_mlx_lm_alone_cannot_load_the_codebook_checkpoint(codebook_ckpts):
    """Without ``import mlx_k3`` the same load fails: what loads it above is the drop-in."""
    code = f"import mlx_lm\nmlx_lm.load({str(codebook_ckpts[0])!r})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    # mlx-lm reads the checkpoint's `quantization` as its own format and fails on it (no group size).
    assert "KeyError: 'group_size'" in r.stderr, r.stderr[-2000:]


def test_drop_in_installs_when_mlx_lm_came_first():
    """``import mlx_k3`` patches an already imported mlx-lm as well as one imported later."""
    code = (
        "from mlx_lm.models import kimi_k3\n"
        "import mlx_k3\n"
        "from mlx_k3.models import kimi_k3 as drop_in\n"
        "assert kimi_k3.Model is drop_in.Model and kimi_k3.ModelArgs is drop_in.ModelArgs\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_python_m_mlx_k3_generate_runs_k3_nano_as_the_cli_does(rust_cli):
    """The README's command, ``python -m mlx_k3 generate --model models/k3-nano``: it runs k3-nano as it ships
    (bf16, Kimi's tiktoken tokenizer without tokenizer.json), prints the Rust CLI's greedy continuation, and
    nothing on stderr (no transformers warning about the model type)."""
    r = subprocess.run(
        [sys.executable, "-m", "mlx_k3", "generate", "--model", str(checkpoints.K3_NANO), "--prompt", PROMPT,
         "--max-tokens", str(MAX_TOKENS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    m = re.match(r"=+\n(.*)\n=+\nPrompt: ", r.stdout, re.S)
    assert m, r.stdout
    assert PROMPT + m.group(1) + "\n" == rust_generate(rust_cli, checkpoints.K3_NANO)
    assert not (checkpoints.K3_NANO / "tokenizer.json").exists()  # the checkpoint's folder is not written to
