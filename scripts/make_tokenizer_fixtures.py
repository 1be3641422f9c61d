"""Token ids from Python tiktoken for the k3-nano tokenizer, for the Rust tokenizer test.

Builds a tiktoken.Encoding from models/k3-nano (tiktoken.model ranks, Kimi's pre-tokenization pattern, the
special tokens named in tokenizer_config.json as Kimi's tokenizer assigns them) and writes
mlx-k3/tests/fixtures/tokenizer/k3_nano_ids.json: for each string, `ids` (special tokens allowed, as Kimi's
tokenizer encodes by default) and `ordinary_ids` (special-token text encoded as plain text); and the same for
long pre-tokens and seeded random strings in k3_nano_long_ids.json (`ordinary_ids` only where they differ).

Run: .venv/bin/python scripts/make_tokenizer_fixtures.py   (pip install tiktoken==0.14.0)
"""

import base64
import json
from importlib.metadata import version
from pathlib import Path

import tiktoken

ROOT = Path(__file__).resolve().parent.parent
NANO = ROOT / "models/k3-nano"
OUT = ROOT / "mlx-k3/tests/fixtures/tokenizer/k3_nano_ids.json"
OUT_LONG = ROOT / "mlx-k3/tests/fixtures/tokenizer/k3_nano_long_ids.json"
PIN = "0.14.0"

# Moonshot's tokenization_kimi.py pat_str.
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

CASES = [
    "def add(a, b):\n    return a + b\n",
    "Hello, world! It's a test; they'll see we're done.",
    "你好世界，中文English混合abc",
    "Ünïcödé ñ ß Ω 🙂 emoji 👍🏽 and café",
    "    \t\n\n   spaces   and\ttabs \r\n",
    "x = 12345678901234567890 + 3.14159e-10",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "[BOS]text with specials[EOS] and <|reserved_token_2100|>",
    "import os\nimport sys\n\n\nclass Foo(object):\n    \"\"\"Doc string.\"\"\"\n",
    "ALLCAPS words MixedCase and camelCaseWords, HTTPServer",
    "",
    " ",
    "a" * 50 + " " + "z" * 3,
]




def long_cases() -> list[str]:
    """Long pre-tokens (tiktoken merges pieces of 100 bytes or more with its heap-based merge) and seeded
    random strings over the characters where the split pattern's alternatives meet (whitespace runs with
    and without newlines, multi-byte spaces, marks, apostrophes, digits, Han)."""
    import random

    sample = (NANO / "samples.txt").read_text()
    cases = [
        "hello" * 400,
        "ab" * 600,
        " " * 3000 + "x",
        " " * 3000,
        "\t " * 500 + "1",
        "\n" * 700 + "  \n " * 100 + "y",
        "!" * 500 + "a",
        "\u00e9" * 300,
        "AbCdEfGh" * 60,
        "1234567890" * 50,
        "\u3000" * 500 + "z",
        sample,
    ]
    alphabet = [" ", " ", "  ", "\t", "\n", "\r", "\r\n", "a", "b", "B", "Q", "\u00e9", "\u00df", "\u4e2d",
                "1", "42", "!", ".", "'", "'s", "'LL", "\u3000", "\u00a0", "e\u0301", "\U0001f600", "_", "<|im_end|>"]
    rng = random.Random(41)
    for _ in range(60):
        cases.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120))))
    return cases


def main() -> None:
    assert version("tiktoken") == PIN, f"needs tiktoken=={PIN}"
    ranks = {}
    for line in (NANO / "tiktoken.model").read_text().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    cfg = json.loads((NANO / "tokenizer_config.json").read_text())
    n = len(ranks)
    specials = {}
    for i in range(n, n + 258):
        e = cfg["added_tokens_decoder"].get(str(i))
        specials[e["content"] if e else f"<|reserved_token_{i}|>"] = i
    enc = tiktoken.Encoding("k3-nano", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    cases = [
        {"text": t, "ids": enc.encode(t, allowed_special="all"), "ordinary_ids": enc.encode_ordinary(t)}
        for t in CASES
    ]
    for c in cases:
        assert enc.decode(c["ids"]) == c["text"]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    doc = {"generator": "scripts/make_tokenizer_fixtures.py", "tiktoken": PIN, "cases": cases}
    OUT.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")

    long = []
    for t in long_cases():
        c = {"text": t, "ids": enc.encode(t, allowed_special="all")}
        assert enc.decode(c["ids"]) == t
        if enc.encode_ordinary(t) != c["ids"]:
            c["ordinary_ids"] = enc.encode_ordinary(t)
        long.append(c)
    doc = {"generator": "scripts/make_tokenizer_fixtures.py", "tiktoken": PIN, "cases": long}
    OUT_LONG.write_text(json.dumps(doc, ensure_ascii=False) + "\n")
    print(f"wrote {len(long)} cases to {OUT_LONG}")


if __name__ == "__main__":
    main()
