"""End-to-end reference for images in a Kimi K2.5 chat: from image files to greedy tokens, in mlx-vlm 0.7.10.

`mlx-k3/tests/vision_chat.rs` loads the checkpoint this script writes with `Pipeline::load` and runs the same
chats through `Pipeline::encode_chat_media` (decode, the K2.5 image processor, the checkpoint's chat template
with image parts, each `<|media_pad|>` repeated to its image's token count, the MoonViT tower and projector)
and greedy generation; this script records what mlx-vlm 0.7.10 gives for the same files: `KimiK25Processor`
(`apply_chat_template`, then `__call__` with the images) and its `kimi_k25` `Model`: the prompt ids, the
log-probabilities of the prefill's last position and of each greedy decode step, and the greedy tokens.

What a real Kimi K2.5 checkpoint ships and this one copies in small:
- a `chat_template.jinja` that renders an image part as `<|media_begin|>image<|media_content|><|media_pad|>
  <|media_end|>` (one pad; the processor expands it) and a video part as `<|kimi_k25_video_placeholder|>`.
  The template here is written for this project in the shape of Kimi K2.5's (`<|im_user|>` / `<|im_middle|>`
  / `<|im_end|>` turns, a default system message, the media markers as vLLM's
  `KimiK25ForConditionalGeneration.get_placeholder_str` writes them: Kimi K2-Thinking's `render_content`
  with the `<|media_begin|>` that K2.5's model card says replaced `<|media_start|>`);
  Kimi K2.5's own template is not available offline here, and which template a checkpoint ships is its own
  business: what is checked is that the checkpoint's template is rendered and expanded as mlx-vlm does.
- Kimi's tiktoken tokenizer. mlx-vlm loads it with `AutoTokenizer(trust_remote_code=True)`, i.e. Kimi's
  `tokenization_kimi.py`, which is not here either; `KimiTokenizer` below stands in for the three things
  `KimiK25Processor` asks of it (the template's rendering as transformers renders it, `encode` as tiktoken
  with every special token allowed, token ids of special tokens), as `make_k2_chat_fixtures.py` does.
  The vocabulary is that fixture's (k3-nano's ranks, Kimi K2's control tokens) plus K2.5's media tokens at
  their K2.5 offsets.

The model is `make_vision_k25_fixtures.py`'s tiny random `kimi_k25` (same text and vision configurations and
initialization) with the vocabulary widened to the tokenizer's and `media_placeholder_token_id` set to
`<|media_pad|>`; `preprocessor_config.json` has a patch limit that makes one image shrink. The images are
the preprocessing fixtures' `rgb.png` and `wide.png`. Before writing, every greedy step's top-1/top-2
log-probability gap and every router selection gap are checked to be far above fp32 noise (else the next
candidate user text is tried), so greedy tokens are a fair comparison.

Run with the vision virtualenv of `make_vision_k25_fixtures.py` plus `tiktoken` and `transformers`:

    python3 -m venv /tmp/vlm-venv
    /tmp/vlm-venv/bin/pip install mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 mlx-vlm==0.7.10 tiktoken==0.14.0
    /tmp/vlm-venv/bin/python scripts/make_vision_chat_k25_fixtures.py
"""

from __future__ import annotations

import base64
import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_vision_chat_fixtures as k3chat  # noqa: E402  (the same chats, texts and processor settings)
import make_vision_k25_fixtures as v25  # noqa: E402  (checks the pins on import)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import tiktoken  # noqa: E402
from make_k2_chat_fixtures import K2_CONTROL, NUM_CONTROL  # noqa: E402
from make_tokenizer_fixtures import KIMI_PATTERN  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_vlm.models.cache import KVCache  # noqa: E402
from mlx_vlm.models.kimi_k25.processing_kimi_k25 import KimiK25ImageProcessor, KimiK25Processor  # noqa: E402
from mlx_vlm.utils import load_model  # noqa: E402
from PIL import Image  # noqa: E402
from transformers.utils.chat_template_utils import _compile_jinja_template  # noqa: E402

ROOT = v25.ROOT
OUT = ROOT / "mlx-k3" / "tests" / "fixtures" / "vision_chat_k25"
K2_TOKENIZER = ROOT / "mlx-k3" / "tests" / "fixtures" / "chat" / "k2_tokenizer"
IMAGES = ROOT / "mlx-k3" / "tests" / "fixtures" / "vision_preprocess"
DECODE_STEPS = k3chat.DECODE_STEPS
# Kimi K2.5's media tokens by offset after the regular vocabulary (163584 + offset in Kimi K2.5).
K25_MEDIA = {18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>"}
# The processor's media_proc_cfg and the chats: the K3 fixture's (a patch limit that wide.png exceeds).
PROC = k3chat.PROC
CANDIDATE_TEXTS = k3chat.CANDIDATE_TEXTS
chats = k3chat.chats
log_softmax = k3chat.log_softmax

TEMPLATE = """{%- macro render_content(msg) -%}
  {%- if msg['content'] is string -%}
    {{ msg['content'] }}
  {%- elif msg['content'] is not none -%}
    {%- for part in msg['content'] -%}
      {%- if part['type'] == 'image' or 'image_url' in part -%}
        <|media_begin|>image<|media_content|><|media_pad|><|media_end|>
      {%- elif part['type'] == 'video' or 'video_url' in part -%}
        <|kimi_k25_video_placeholder|>
      {%- else -%}
        {{ part['text'] }}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}
  <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}<|im_user|>{%- elif m['role'] == 'assistant' -%}<|im_assistant|>
  {%- else -%}<|im_system|>{%- endif -%}
  {{ m.get('name') or m['role'] }}<|im_middle|>{{ render_content(m) }}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""


class KimiTokenizer:
    """What `KimiK25Processor` uses of Kimi's `TikTokenTokenizer`: the chat template rendered as transformers'
    `apply_chat_template` renders it, `encode` with every special token allowed (no BOS: Kimi's tokenizer adds
    none), special-token ids, and the pad id."""

    def __init__(self, folder: Path):
        ranks = {}
        for line in (folder / "tiktoken.model").read_text().splitlines():
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        named = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
        n = len(ranks)
        self.specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + NUM_CONTROL)}
        self.enc = tiktoken.Encoding("k25-fixture", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=self.specials)
        self.template = _compile_jinja_template((folder / "chat_template.jinja").read_text())
        self.pad_token_id = self.specials["[PAD]"]

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=False, **kwargs):
        assert not tokenize
        return self.template.render(messages=conversation, add_generation_prompt=add_generation_prompt,
                                    bos_token="[BOS]", eos_token="[EOS]")

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.specials[token]


def write_tokenizer(ckpt: Path) -> int:
    """The K2 chat fixture's tokenizer with K2.5's media tokens added; returns the vocabulary size."""
    shutil.copyfile(K2_TOKENIZER / "tiktoken.model", ckpt / "tiktoken.model")
    cfg = json.loads((K2_TOKENIZER / "tokenizer_config.json").read_text())
    n = sum(1 for line in (K2_TOKENIZER / "tiktoken.model").read_text().splitlines() if line.strip())
    added = dict(cfg["added_tokens_decoder"])
    for off, name in K25_MEDIA.items():
        assert off not in K2_CONTROL and str(n + off) not in added
        added[str(n + off)] = {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": True}
    cfg["added_tokens_decoder"] = dict(sorted(added.items(), key=lambda kv: int(kv[0])))
    cfg["_comment"] = ("Test fixture by scripts/make_vision_chat_k25_fixtures.py: k3-nano's ranks, Kimi K2's "
                       "control tokens and Kimi K2.5's media tokens.")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    (ckpt / "chat_template.jinja").write_text(TEMPLATE)
    return n + NUM_CONTROL


def run(model, called) -> dict:
    ids = np.array(called["input_ids"])
    cache = [KVCache() for _ in model.language_model.layers]
    out = model(mx.array(ids), mx.array(called["pixel_values"]), cache=cache,
                image_grid_hws=called["image_grid_hws"])
    rows = [np.array(out.logits[0, -1])]
    tokens = []
    for _ in range(DECODE_STEPS):
        tok = int(np.argmax(rows[-1]))
        tokens.append(tok)
        rows.append(np.array(model.language_model(mx.array([[tok]], dtype=mx.int32), cache=cache).logits[0, -1]))
    lp = log_softmax(np.stack(rows[:DECODE_STEPS]))
    gap = min(v25.k3.top_gap(r) for r in lp)
    return {"ids": ids[0].astype(np.int32), "tokens": np.array(tokens, dtype=np.int32), "logprobs": lp, "gap": gap}


def build(tmp: Path) -> dict:
    ckpt = tmp / "vision_chat_k25"
    ckpt.mkdir()
    vocab = write_tokenizer(ckpt)
    tok = KimiTokenizer(ckpt)
    pad = tok.convert_tokens_to_ids("<|media_pad|>")
    config = v25.make_config()
    config["text_config"]["vocab_size"] = vocab
    config["media_placeholder_token_id"] = pad
    mx.random.seed(v25.SEED)
    model = v25.build_model(config)
    v25.init_weights(model, config["text_config"])
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(ckpt / "model.safetensors"), dict(sorted(weights.items())), metadata={"format": "mlx"})
    (ckpt / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (ckpt / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": PROC}, indent=2) + "\n")

    # The reference: mlx-vlm's loader on the saved folder; its processor with the image settings
    # `KimiK25Processor.from_pretrained` reads from that preprocessor_config.json, on the image files.
    model = load_model(ckpt)
    image_processor = KimiK25ImageProcessor(patch_size=PROC["patch_size"], in_token_limit=PROC["in_patch_limit"],
                                            merge_kernel_size=PROC["merge_kernel_size"],
                                            patch_limit_on_one_side=PROC["patch_limit_on_one_side"])
    proc = KimiK25Processor.__new__(KimiK25Processor)  # its __init__ wants a transformers tokenizer class
    proc.image_processor, proc.tokenizer, proc.image_token = image_processor, tok, "<|media_pad|>"
    for text in CANDIDATE_TEXTS:
        cases, arrays, router_gap = [], {}, np.inf
        for i, chat in enumerate(chats(text)):
            images = []
            for name in chat["images"]:
                im = Image.open(IMAGES / name)
                im.load()
                images.append(im)
            rendered = proc.apply_chat_template(chat["messages"], tokenize=False, add_generation_prompt=True)
            called = proc(images=images, text=rendered)
            with v25.RouterProbe() as probe:
                r = run(model, called)
            router_gap = min(router_gap, probe.min_gap()[0])
            grids = np.array(called["image_grid_hws"]).tolist()
            assert int(np.sum(r["ids"] == pad)) == sum(h * w // 4 for h, w in grids)
            cases.append({**chat, "prompt_tokens": int(len(r["ids"])), "grids": grids,
                          "min_top2_logprob_gap": round(r["gap"], 6)})
            arrays.update({f"case{i}_ids": r["ids"], f"case{i}_tokens": r["tokens"], f"case{i}_logprobs": r["logprobs"]})
        gap = min(c["min_top2_logprob_gap"] for c in cases)
        if gap >= v25.MIN_GREEDY_GAP and router_gap >= v25.MIN_ROUTER_GAP:
            mx.save_safetensors(str(ckpt / "expected.safetensors"), {k: mx.array(v) for k, v in sorted(arrays.items())},
                                metadata={"generator": "scripts/make_vision_chat_k25_fixtures.py",
                                          "mlx-vlm": v25.PINS["mlx-vlm"]})
            manifest = {"generator": "scripts/make_vision_chat_k25_fixtures.py", "mlx_vlm": v25.PINS["mlx-vlm"],
                        "placeholder": pad, "decode_steps": DECODE_STEPS, "images_from": "../vision_preprocess",
                        "min_router_selection_gap": round(float(router_gap), 6), "cases": cases}
            (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
            return manifest
        print(f"{text!r}: greedy gap {gap:.2e}, router gap {router_gap:.2e}: too close, next text")
    raise RuntimeError("no candidate text gave greedy steps and router selections with clear margins")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        manifest = build(tmp)
        if OUT.exists():
            shutil.rmtree(OUT)
        shutil.copytree(tmp / "vision_chat_k25", OUT)
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT.relative_to(ROOT)} ({total / 1024:.0f} KiB): {json.dumps(manifest['cases'])}")


if __name__ == "__main__":
    main()
