"""The drop-in model: after ``import mlx_k3``, ``mlx_lm.load`` loads checkpoints in mlx-k3's formats and
mlx-lm's generation and evaluation use them unchanged; plain checkpoints keep mlx-lm's own classes.

Each format is checked against (a) the same model with its expert stacks decoded to float32 and loaded by
mlx-lm's own class (logits, perplexity, greedy tokens) and (b) the Rust engine's CLI (greedy tokens)."""

import json
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models import kimi_k3 as mlx_lm_kimi_k3
from mlx_lm.perplexity import eval_ppl

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


def test_plain_checkpoints_keep_mlx_lm_classes(plain_ckpt, codebook_ckpts):
    for path in (plain_ckpt, codebook_ckpts[1], checkpoints.K3_NANO):
        model, _ = mlx_lm.load(str(path))
        assert type(model) is drop_in.MlxLmModel  # mlx-lm's own kimi_k3.Model, not a subclass
        moe = model.language_model.model.layers[1].mlp
        assert type(moe.switch_mlp.up_proj).__module__ == "mlx_lm.models.switch_layers"


def test_hook_points_mlx_lm_at_the_drop_in():
    assert mlx_lm_kimi_k3.Model is drop_in.Model
    assert mlx_lm_kimi_k3.ModelArgs is drop_in.ModelArgs


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


@pytest.mark.parametrize("which", ["plain", "codebook", "codebook_narrow", "tiered"])
def test_greedy_tokens_match_the_rust_cli(
    which, rust_cli, plain_ckpt, codebook_ckpts, codebook_narrow_ckpts, tiered_ckpts
):
    """Greedy decoding through mlx_lm.generate gives the Rust CLI's continuation, token for token (the CLI
    prints the prompt, then the continuation, then a newline)."""
    ckpt = {
        "plain": plain_ckpt,
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
