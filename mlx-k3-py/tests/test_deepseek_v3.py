"""The drop-in for the DeepSeek-V3 family (``deepseek_v3``: DeepSeek-V3/R1, Kimi K2; ``kimi_k25``: Kimi
K2.5/K2.7): after ``import mlx_k3``, ``mlx_lm.load`` builds these checkpoints with mlx-k3's kernels, and
greedy decoding through mlx-lm gives the Rust CLI's tokens and mlx-lm's own.

The checkpoints are the Rust tests' fixtures (``mlx-k3/tests/fixtures/deepseek_v3/``, written by
``scripts/make_deepseek_v3_fixtures.py`` with mlx-lm 0.32.2: float32, mlx-lm's affine 4-bit, MXFP4 and a
mixed-bits quantization), copied with a word-level ``tokenizer.json`` (token ``i`` is the word ``w{i}``) so
that mlx-lm and the CLI can tokenize a prompt. Their ``expected.safetensors`` hold mlx-lm's prefill logits
and its ``generate_step`` greedy tokens."""

import json
import re
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models import deepseek_v3 as mlx_lm_deepseek_v3
from mlx_lm.models import kimi_k25 as mlx_lm_kimi_k25

import checkpoints
import mlx_k3  # noqa: F401  (installs the drop-in)
from mlx_k3.models import deepseek_v3 as drop_in
from mlx_k3.models import kimi_k3 as drop_in_k3
from mlx_k3.models import kimi_k25 as drop_in_k25

FIXTURES = checkpoints.ROOT / "mlx-k3" / "tests" / "fixtures" / "deepseek_v3"
FLOAT = ["a_yarn_grouped", "b_direct_q_plain_rope", "c_kimi_k25"]
QUANTIZED = ["a_yarn_grouped_q4", "a_yarn_grouped_mxfp4", "a_yarn_grouped_mixed"]
MAX_TOKENS = 32  # the fixtures' generate_tokens

mx.set_default_device(mx.cpu)


def _vocab(cfg):
    return cfg.get("text_config", cfg)["vocab_size"]


@pytest.fixture(scope="session")
def ds3_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("deepseek_v3")


def with_tokenizer(name, root):
    """A copy of fixture ``name`` with a word-level tokenizer.json (no decoder), and its expected outputs."""
    src, dst = FIXTURES / name, root / name
    if not dst.exists():
        dst.mkdir()
        for f in src.iterdir():
            if f.name != "expected.safetensors":
                (dst / f.name).symlink_to(f)
        cfg = json.loads((src / "config.json").read_text())
        vocab = {f"w{i}": i for i in range(_vocab(cfg))}
        tok = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [],
            "normalizer": None,
            "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": None,
            "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"},
        }
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst, mx.load(str(src / "expected.safetensors"))


def prompt_text(expected):
    return " ".join(f"w{t}" for t in expected["prompt"].tolist())


@pytest.mark.parametrize("name", FLOAT + QUANTIZED)
def test_mlx_lm_loads_the_drop_in(name, ds3_dir):
    ckpt, _ = with_tokenizer(name, ds3_dir)
    model, _ = mlx_lm.load(str(ckpt))
    k25 = name.startswith("c_kimi_k25")
    assert type(model) is (drop_in_k25.Model if k25 else drop_in.Model)
    if name in QUANTIZED:
        moe = model.model.layers[1].mlp
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert type(getattr(moe.switch_mlp, proj)) is drop_in_k3.K3QuantizedSwitchLinear
        assert type(moe.shared_experts.up_proj) is drop_in_k3.K3QuantizedLinear


def test_hook_points_mlx_lm_at_the_drop_in():
    assert mlx_lm_deepseek_v3.Model is drop_in.Model
    assert mlx_lm_kimi_k25.Model is drop_in_k25.Model
    assert mlx_lm_deepseek_v3.group_expert_select is drop_in._router


@pytest.mark.parametrize("name", FLOAT + QUANTIZED)
def test_prefill_logits_match_mlx_lm(name, ds3_dir):
    """The drop-in's prefill logits are mlx-lm's (recorded by the fixture script with mlx-lm's own class in
    float32). Relative to the largest logit: 1e-4 covers float32 reordering in mlx-k3's CPU kernels against
    MLX's ops over these tiny dims (the Rust tests hold the CLI's logits to the same bound)."""
    ckpt, expected = with_tokenizer(name, ds3_dir)
    model, _ = mlx_lm.load(str(ckpt))
    got = model(expected["prompt"][None])[0].astype(mx.float32)
    want = expected["prefill_logits"]
    err = float(mx.abs(got - want).max() / mx.abs(want).max())
    assert err < 1e-4, err


def test_the_router_kernel_runs_in_the_drop_in(ds3_dir, monkeypatch):
    ckpt, expected = with_tokenizer("a_yarn_grouped", ds3_dir)
    model, _ = mlx_lm.load(str(ckpt))
    calls = []
    real = drop_in.kernels.moe_router
    monkeypatch.setattr(drop_in.kernels, "moe_router", lambda *a, **k: calls.append(1) or real(*a, **k))
    mx.eval(model(expected["prompt"][None]))
    assert len(calls) == model.args.num_hidden_layers - model.args.first_k_dense_replace


def rust_generate(cli, ckpt, prompt):
    r = subprocess.run(
        [str(cli), "generate", "--model", str(ckpt), "--prompt", prompt, "--max-tokens", str(MAX_TOKENS), "--raw"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("name", FLOAT + QUANTIZED)
def test_greedy_tokens_match_the_rust_cli_and_mlx_lm(name, ds3_dir, rust_cli):
    """``mlx_lm.stream_generate`` through the drop-in gives mlx-lm's greedy tokens (the fixture's
    ``generate_tokens``) and the Rust CLI's. The CLI prints the prompt, then the continuation (every token's
    text is ``w<id>``, so the text gives the ids back)."""
    ckpt, expected = with_tokenizer(name, ds3_dir)
    model, tok = mlx_lm.load(str(ckpt))
    prompt = prompt_text(expected)
    ids = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=MAX_TOKENS)]
    assert ids == expected["generate_tokens"].tolist()
    out = rust_generate(rust_cli, ckpt, prompt)
    printed = [int(t) for t in re.findall(r"w(\d+)", out)]
    assert printed == expected["prompt"].tolist() + ids, out


def test_python_m_mlx_k3_generate_says_nothing_on_stderr(ds3_dir):
    """``python -m mlx_k3 generate`` on a ``deepseek_v3`` checkpoint: mlx-lm's generation runs the drop-in and
    nothing is printed on stderr (no warning about the model type or the tokenizer). The fixture with plain
    RoPE: the YaRN fixtures' tiny ``max_position_embeddings`` (far below ``original_max_position_embeddings``
    times ``factor``, unlike a real checkpoint's) makes transformers' config check warn about their RoPE
    scaling when the tokenizer loads."""
    ckpt, expected = with_tokenizer("b_direct_q_plain_rope", ds3_dir)
    r = subprocess.run(
        [sys.executable, "-m", "mlx_k3", "generate", "--model", str(ckpt), "--prompt", prompt_text(expected),
         "--max-tokens", "8", "--ignore-chat-template"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    assert "".join(f"w{t}" for t in expected["generate_tokens"].tolist()[:8]) in r.stdout.replace(" ", ""), r.stdout


def test_drop_in_installs_when_mlx_lm_came_first():
    code = (
        "from mlx_lm.models import kimi_k25, deepseek_v3\n"
        "import mlx_k3\n"
        "from mlx_k3.models import deepseek_v3 as drop_in, kimi_k25 as drop_in_k25\n"
        "assert deepseek_v3.Model is drop_in.Model and kimi_k25.Model is drop_in_k25.Model\n"
        "assert deepseek_v3.group_expert_select is drop_in._router\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # kimi_k25 first: mlx-lm's kimi_k25 imports deepseek_v3, which is patched while kimi_k25 is half imported.
    code = (
        "import mlx_k3\n"
        "from mlx_lm.models import kimi_k25\n"
        "from mlx_lm.models import deepseek_v3\n"
        "from mlx_k3.models import deepseek_v3 as drop_in, kimi_k25 as drop_in_k25\n"
        "assert deepseek_v3.Model is drop_in.Model and kimi_k25.Model is drop_in_k25.Model\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr

