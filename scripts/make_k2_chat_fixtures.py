"""Reference renderings of Kimi K2's chat template, tokenized as Kimi's tokenizer tokenizes a prompt.

Writes mlx-k3/tests/fixtures/chat/k2_encoding.json and the fixture tokenizer k2_tokenizer/ (k3-nano's
`tiktoken.model`, 2,046 regular tokens, with Kimi K2's control tokens at the offsets Kimi K2's
tokenizer_config.json gives them after the regular vocabulary, and a config.json naming model_type
`kimi_k2`). Each case is a conversation rendered by transformers' Jinja2 environment
(`_compile_jinja_template`, as `apply_chat_template` renders) with Kimi-K2-Instruct's template, and the text
encoded by tiktoken with every special token allowed (what Kimi's `TikTokenTokenizer.encode` does with a
rendered prompt). mlx-k3's built-in Kimi K2 encoding must give the same text and ids.

The template is Kimi-K2-Instruct's `chat_template` as llama.cpp ships it (ggml-org/llama.cpp,
models/templates/moonshotai-Kimi-K2.jinja at commit 02f4a631678bc435c5cea7a54ab4222ee32e8453), read from the
file given as the first argument and checked by its SHA-256 (of the text with LF line ends).

Run: .venv/bin/python scripts/make_k2_chat_fixtures.py PATH/TO/moonshotai-Kimi-K2.jinja
(transformers 5.25.0 and tiktoken 0.14.0, as in the project's .venv)
"""

import base64
import hashlib
import json
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

from transformers.utils.chat_template_utils import _compile_jinja_template

ROOT = Path(__file__).resolve().parent.parent
NANO = ROOT / "models/k3-nano"
OUT = ROOT / "mlx-k3/tests/fixtures/chat/k2_encoding.json"
TOKENIZER_DIR = ROOT / "mlx-k3/tests/fixtures/chat/k2_tokenizer"
TEMPLATE_SHA256 = "0d19c3a601c02d8f788799efcaceee9f0cda955e165b9c137ea9f7198fea4d37"
TIKTOKEN = "0.14.0"
TRANSFORMERS = "5.25.0"
NUM_CONTROL = 256
# Kimi K2's control tokens by offset after the regular vocabulary (163584 + offset in Kimi K2).
K2_CONTROL = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    254: "[UNK]", 255: "[PAD]",
}

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Stadt / 城市"}},
                   "required": ["city"]}}}]

CASES = [
    ("one_user", [{"role": "user", "content": "Write a function."}], None, True),
    ("system_first", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None, True),
    ("no_generation_prompt", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
     None, False),
    ("multi_turn", [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "and 3+3?\nexplain"}], None, True),
    ("with_tools", [{"role": "user", "content": "Weather in Paris?"}], WEATHER, True),
    ("tool_result", [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": "Checking."},
                     {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "functions.get_weather:0"}],
     WEATHER, True),
    ("text_parts", [{"role": "user", "content": [{"type": "text", "text": "part one "},
                                                 {"type": "text", "text": "part two"}]}], None, True),
    ("system_later", [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], None, True),
    ("unicode", [{"role": "user", "content": "Привет 👋 東京  tabs\tand\r\nlines  "}], None, True),
    ("empty_content", [{"role": "user", "content": ""}], None, True),
    ("empty_tools_list", [{"role": "user", "content": "x"}], [], True),
]


# A template written for this project in the shape of Kimi K2's later templates, which stop a loop with
# `{% break %}` (Jinja's loop-controls extension, on in transformers): checks that a checkpoint's own template
# of that kind compiles and renders as transformers renders it.
LOOP_CONTROLS = """{%- set ns = namespace(last=-1) -%}
{%- for i in range(messages|length - 1, -1, -1) -%}
  {%- if messages[i]['role'] == 'assistant' -%}
    {%- set ns.last = i -%}
    {%- break -%}
  {%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- if m['role'] == 'system' and not loop.first -%}{%- continue -%}{%- endif -%}
  {%- if m['role'] == 'user' -%}<|im_user|>{%- elif m['role'] == 'assistant' -%}<|im_assistant|>
  {%- else -%}<|im_system|>{%- endif -%}
  {{ m.get('name') or m['role'] }}<|im_middle|>
  {%- if m['role'] == 'assistant' and loop.index0 <= ns.last -%}<think></think>{%- endif -%}
  {{ m['content'] }}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"""

LOOP_CASES = [
    ("loop_one_user", [{"role": "user", "content": "Hi"}], True),
    ("loop_history", [{"role": "system", "content": "S"}, {"role": "user", "content": "a", "name": "ana"},
                      {"role": "assistant", "content": "b"}, {"role": "system", "content": "skipped"},
                      {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}], False),
]


def write_tokenizer() -> int:
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(NANO / "tiktoken.model", TOKENIZER_DIR / "tiktoken.model")
    n = sum(1 for line in (NANO / "tiktoken.model").read_text().splitlines() if line.strip())
    cfg = {
        "added_tokens_decoder": {
            str(n + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True}
            for off, name in sorted(K2_CONTROL.items())
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "tokenizer_class": "TikTokenTokenizer",
        "_comment": "Test fixture by scripts/make_k2_chat_fixtures.py: k3-nano's ranks, Kimi K2's control tokens.",
    }
    (TOKENIZER_DIR / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    (TOKENIZER_DIR / "config.json").write_text(json.dumps({"model_type": "kimi_k2"}, indent=1) + "\n")
    return n


def tiktoken_encoding(n_base: int):
    import tiktoken

    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tokenizer_fixtures import KIMI_PATTERN

    assert version("tiktoken") == TIKTOKEN, f"needs tiktoken=={TIKTOKEN}"
    ranks = {}
    for line in (TOKENIZER_DIR / "tiktoken.model").read_text().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    assert len(ranks) == n_base
    specials = {K2_CONTROL.get(i - n_base, f"<|reserved_token_{i}|>"): i for i in range(n_base, n_base + NUM_CONTROL)}
    return tiktoken.Encoding("k2-fixture", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def main() -> None:
    assert version("transformers") == TRANSFORMERS, f"needs transformers=={TRANSFORMERS}"
    # Line ends as LF and no final newline: Jinja2 renders CRLF and LF alike, so the pin does not depend on them.
    src = Path(sys.argv[1]).read_text().replace("\r\n", "\n").rstrip("\n")
    sha = hashlib.sha256(src.encode()).hexdigest()
    assert sha == TEMPLATE_SHA256, f"template SHA-256 {sha} is not the pinned one"
    template = _compile_jinja_template(src)
    n = write_tokenizer()
    tk = tiktoken_encoding(n)
    cases = []
    for name, messages, tools, gen in CASES:
        text = template.render(messages=messages, tools=tools, add_generation_prompt=gen,
                               bos_token="[BOS]", eos_token="[EOS]")
        ids = tk.encode(text, allowed_special="all")
        assert tk.decode(ids) == text
        cases.append({"name": name, "messages": messages, "tools": tools, "add_generation_prompt": gen,
                      "text": text, "ids": ids})
    loop = _compile_jinja_template(LOOP_CONTROLS)
    loop_cases = []
    for name, messages, gen in LOOP_CASES:
        text = loop.render(messages=messages, add_generation_prompt=gen, bos_token="[BOS]", eos_token="[EOS]")
        loop_cases.append({"name": name, "messages": messages, "add_generation_prompt": gen, "text": text,
                           "ids": tk.encode(text, allowed_special="all")})
    doc = {"reference": f"Kimi-K2-Instruct chat_template (sha256 {sha}) rendered by transformers {TRANSFORMERS}, "
                        f"encoded by tiktoken {TIKTOKEN} with every special token allowed",
           "cases": cases,
           "loop_controls": {"template": LOOP_CONTROLS, "cases": loop_cases}}
    OUT.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}: {len(cases)} cases")


if __name__ == "__main__":
    main()
