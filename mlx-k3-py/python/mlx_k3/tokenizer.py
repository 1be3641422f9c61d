"""Kimi's tiktoken tokenizer as a ``tokenizer.json`` that mlx-lm (through transformers) loads exactly.

Kimi checkpoints ship ``tiktoken.model`` and ``tokenizer_config.json`` but no ``tokenizer.json``. Given only
those, transformers converts ``tiktoken.model`` with a generic GPT-style pre-tokenization pattern, which
splits some text differently from Kimi's (contractions such as "don't", for one), so mlx-lm would feed the
model other token ids than mlx-k3 and Kimi's own tokenizer do. :func:`write_tokenizer_json` writes the
same BPE with Kimi's pattern and the special tokens at their ids; mlx-lm then prefers it. mlx-k3's Rust
loader keeps reading ``tiktoken.model``. (``python -m mlx_k3 tokenizer-json DIR`` does the same.)

``import mlx_k3`` does this by itself (:func:`install_tokenizer`): mlx-lm's tokenizer loader then loads a
``kimi_k3`` checkpoint without ``tokenizer.json`` with one written into a temporary folder (the checkpoint's
folder is never written to). Writing it once with ``tokenizer-json`` saves that step at every load (a second
or so for a full 160k-token vocabulary).
"""

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Optional, Union

# As mlx-lm does before it imports transformers: no advice to install PyTorch, which mlx-lm does not use.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# Kimi's pre-tokenization regex (tokenization_kimi.py's pat_str; mlx_k3::tokenizer::KIMI_PATTERN in Rust).
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Special-token slots after the regular vocabulary (Kimi's num_reserved_special_tokens + 2).
NUM_SPECIAL = 258


def special_tokens(model_dir: Union[str, Path], num_base: int) -> list:
    """The special tokens' names in id order (ids ``num_base ..``): named by ``added_tokens_decoder``,
    ``<|reserved_token_{id}|>`` otherwise."""
    cfg = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    named = {int(i): e["content"] for i, e in cfg.get("added_tokens_decoder", {}).items()}
    last = max([num_base + NUM_SPECIAL - 1, *named])
    return [named.get(i, f"<|reserved_token_{i}|>") for i in range(num_base, last + 1)]


def write_tokenizer_json(model_dir: Union[str, Path], out_dir: Optional[Union[str, Path]] = None) -> Path:
    """Writes ``tokenizer.json`` for the Kimi tiktoken tokenizer in ``model_dir`` (``tiktoken.model`` and
    ``tokenizer_config.json``) into ``out_dir`` (default: ``model_dir``). Returns its path."""
    from tiktoken.load import load_tiktoken_bpe
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    model_dir = Path(model_dir)
    vocab = model_dir / "tiktoken.model"
    num_base = len(load_tiktoken_bpe(str(vocab)))
    specials = special_tokens(model_dir, num_base)
    converter = TikTokenConverter(vocab_file=str(vocab), pattern=KIMI_PATTERN, extra_special_tokens=specials)
    tokenizer = converter.converted()
    # BOS/EOS as tokenizer_config.json asks (k3-nano was trained with a leading [BOS]); transformers reads
    # them from the post-processor of a tokenizer.json.
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    added = {}
    for key in ("bos", "eos"):
        name = cfg.get(f"{key}_token")
        name = name.get("content") if isinstance(name, dict) else name
        if cfg.get(f"add_{key}_token") and name in specials:
            added[key] = name
    ids = [(n, num_base + specials.index(n)) for n in added.values()]
    one = " ".join(filter(None, [added.get("bos"), "{}", added.get("eos")]))
    template, pair = one.replace("{}", "$A"), one.replace("{}", "$A") + " " + one.replace("{}", "$B")
    if ids:
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(single=template, pair=pair, special_tokens=ids),
            ]
        )
    out = Path(out_dir or model_dir) / "tokenizer.json"
    tokenizer.save(str(out))
    return out


def needs_tokenizer_json(model_dir: Union[str, Path]) -> bool:
    """Whether ``model_dir`` is a ``kimi_k3`` checkpoint with Kimi's tiktoken tokenizer and no ``tokenizer.json``."""
    d = Path(model_dir)
    if (d / "tokenizer.json").exists() or not (d / "tiktoken.model").is_file():
        return False
    if not (d / "tokenizer_config.json").is_file() or not (d / "config.json").is_file():
        return False
    try:
        return json.loads((d / "config.json").read_text()).get("model_type") == "kimi_k3"
    except (OSError, ValueError):
        return False


def with_kimi_tokenizer_json(load):
    """mlx-lm's tokenizer loader (``mlx_lm.tokenizer_utils.load``, called as ``load(model_path, ...)``), made
    to load a checkpoint that :func:`needs_tokenizer_json` from a temporary folder holding links to its files
    and the ``tokenizer.json`` :func:`write_tokenizer_json` writes; other checkpoints load as before."""
    load = getattr(load, "_mlx_k3_original", load)  # wrapped once only

    @functools.wraps(load)
    def wrapped(model_path, *args, **kwargs):
        if not needs_tokenizer_json(model_path):
            return load(model_path, *args, **kwargs)
        with tempfile.TemporaryDirectory(prefix="mlx_k3_tokenizer_") as tmp:
            view = Path(tmp)
            for f in Path(model_path).iterdir():
                (view / f.name).symlink_to(f.resolve())
            write_tokenizer_json(model_path, view)
            return load(view, *args, **kwargs)

    wrapped._mlx_k3_original = load
    return wrapped


def _register_transformers_config() -> None:
    """Tells transformers the ``kimi_k3`` model type. Its tokenizer loader reads config.json first; for a type
    it does not know it falls back to a generic config and warns ("You are using a model of type kimi_k3 to
    instantiate a model of type ..."). Registering a config class is transformers' way to add a type."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "kimi_k3" in CONFIG_MAPPING:
        return

    class KimiK3Config(transformers.PretrainedConfig):
        model_type = "kimi_k3"

    transformers.AutoConfig.register("kimi_k3", KimiK3Config)


def install_tokenizer(utils) -> None:
    """Makes ``mlx_lm.utils`` (the module ``utils``) load Kimi's tiktoken tokenizer exactly for a ``kimi_k3``
    checkpoint without ``tokenizer.json`` (:func:`with_kimi_tokenizer_json`), and registers the ``kimi_k3``
    model type with transformers (idempotent; ``import mlx_k3`` calls it)."""
    utils._load_tokenizer = with_kimi_tokenizer_json(utils._load_tokenizer)
    _register_transformers_config()
