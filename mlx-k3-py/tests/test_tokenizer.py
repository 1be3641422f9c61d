"""The tokenizer.json written for a Kimi tiktoken folder encodes like tiktoken with Kimi's pattern (what the
Rust engine and Kimi's own tokenizer use), which transformers' default conversion does not."""

import sys
import sysconfig
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import checkpoints
from mlx_k3.tokenizer import KIMI_PATTERN

sys.path.insert(0, str(checkpoints.ROOT / "scripts" / "k3_nano"))


@pytest.fixture(scope="module")
def encodings(plain_ckpt):
    infer = pytest.importorskip("infer", reason="scripts/k3_nano/infer.py loads k3-nano's tiktoken encoding")
    return infer.load_encoding(checkpoints.K3_NANO), AutoTokenizer.from_pretrained(str(plain_ckpt))


def texts():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:40]
    samples = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    samples.append("It's, don't, WE'LL, they'Ve 12345 1e-3 \t tabs\r\n CRLF  世界你好 naïve Ünïcödé 🙂 ...!!!\n\n\n")
    return samples


def test_same_pattern_as_the_k3_nano_scripts():
    common = pytest.importorskip("common")
    assert KIMI_PATTERN == common.PAT_STR


def test_tokenizer_json_encodes_like_tiktoken(encodings):
    enc, hf = encodings
    for text in texts():
        want = enc.encode_ordinary(text)
        got = hf.encode(text, add_special_tokens=False)
        assert got == want
        assert hf.decode(got) == enc.decode(want)


def test_bos_is_added_as_tokenizer_config_asks(encodings):
    enc, hf = encodings
    assert hf.encode("x = 1") == [enc.encode_single_token("[BOS]")] + enc.encode_ordinary("x = 1")


def test_command_line_writes_the_same_file(tmp_path, plain_ckpt):
    import shutil
    import subprocess

    for name in checkpoints.TOKENIZER_FILES:
        shutil.copy(checkpoints.K3_NANO / name, tmp_path / name)
    r = subprocess.run(
        [sys.executable, "-m", "mlx_k3", "tokenizer-json", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "tokenizer.json").read_text() == (plain_ckpt / "tokenizer.json").read_text()


def test_mlx_lm_loads_kimis_tokenizer_without_tokenizer_json(encodings):
    """After ``import mlx_k3``, mlx-lm's loader gives k3-nano, which ships no tokenizer.json, the exact Kimi
    tokenizer (transformers alone would convert tiktoken.model with a generic pattern), and leaves k3-nano's
    folder as it is."""
    import mlx_k3  # noqa: F401
    from mlx_lm.utils import load_tokenizer

    enc, _ = encodings
    tok = load_tokenizer(checkpoints.K3_NANO)
    for text in texts():
        assert tok.encode(text, add_special_tokens=False) == enc.encode_ordinary(text)
    assert tok.encode("x = 1") == [enc.encode_single_token("[BOS]")] + enc.encode_ordinary("x = 1")
    assert not (checkpoints.K3_NANO / "tokenizer.json").exists()


def test_transformers_alone_tokenizes_k3_nano_otherwise(encodings):
    """What the loader above fixes: transformers' own conversion of k3-nano's tiktoken.model splits
    contractions differently from Kimi's pattern."""
    enc, _ = encodings
    code = (
        "import sys\n"
        "from transformers import AutoTokenizer\n"
        f"t = AutoTokenizer.from_pretrained({str(checkpoints.K3_NANO)!r})\n"
        "print(t.encode(sys.argv[1], add_special_tokens=False))\n"
    )
    text = "It's, don't, WE'LL, they'Ve"
    import subprocess

    r = subprocess.run([sys.executable, "-c", code, text], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() != str(enc.encode_ordinary(text))
