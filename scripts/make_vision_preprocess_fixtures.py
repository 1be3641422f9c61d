"""Reference outputs of the Kimi K2.5 and Kimi K3 image processors, for mlx-k3's media preprocessing
(mlx-k3/src/media/, tested by mlx-k3/tests/media.rs).

The references are mlx-vlm 0.7.10's ``KimiK25ImageProcessor`` (``models/kimi_k25/processing_kimi_k25.py``)
and ``KimiK3ImageProcessor`` (``models/kimi_k3/processing_kimi_k3.py``) with Pillow and numpy as that
environment installs them. The script draws its own small test images with Pillow (RGB, RGBA with partial
transparency, a palette image with transparent entries, grayscale with and without alpha or a transparent
value; 16-bit, 2-bit, interlaced and short-palette PNGs written by hand; JPEG, lossless and lossy WebP; odd
sizes) and writes, into mlx-k3/tests/fixtures/vision_preprocess/:

- each image file, and the pixels Pillow decodes from it (``<file>.decoded.bin``: ``im.tobytes()`` in the mode
  Pillow opens it in, plus ``<file>.rgba.bin``: ``im.convert("RGBA")``, which pins palette and transparency
  handling);
- for every (processor, image) case: the image the processor's ``rescale`` returns (resized, filled and
  padded RGB, ``case_<n>.rgb.bin``), the grid and token count, and for a few cases the full normalized
  ``pixel_values`` (float32, ``case_<n>.f32.bin``);
- ``manifest.json`` describing all of it and the processor configurations, which are chosen so tiny images
  are downscaled by the patch limit, by the per-side limit, or only padded;
- ``prompts.json``: placeholder expansion. Kimi K3: chats with image parts rendered by
  ``KimiK3Processor.apply_chat_template`` and run through the processor's ``__call__`` (placeholders
  expanded at the text level, then tokenized), whose ids must equal the segment-wise encoding
  (``apply_chat_template(tokenize=True, image_prompts=...)``, checked here). Kimi K2.5: a prompt with
  ``<|media_pad|>`` tokens through ``KimiK25Processor.__call__`` (token-level repetition). The tokenizer is
  ``tokenizer/``: the K3 chat fixture tokenizer (mlx-k3/tests/fixtures/chat/k3_tokenizer, written by
  scripts/make_k3_chat_fixtures.py) with the media tokens added among the control tokens (positions chosen
  for the fixture; code looks them up by name).

The processors are built with the same keyword arguments their ``from_pretrained`` derives from a
checkpoint's ``preprocessor_config.json``; the manifest stores that ``preprocessor_config.json`` for the
Rust side to parse.

mlx-vlm is not in the project's .venv (it pins a different transformers): make a separate one,

    python3 -m venv /tmp/vlm-venv && /tmp/vlm-venv/bin/pip install mlx==0.32.4 mlx-vlm==0.7.10 mlx-lm==0.32.2 \
        tiktoken==0.14.0

(on Linux the CPU wheel is ``mlx[cpu]``) and run from the repository root:

    /tmp/vlm-venv/bin/python scripts/make_vision_preprocess_fixtures.py
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import sys
import zlib
from importlib.metadata import version
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from pins import MLX_VLM  # noqa: E402

OUT = ROOT / "mlx-k3/tests/fixtures/vision_preprocess"


def check_pins() -> None:
    if version("mlx-vlm") != MLX_VLM:
        sys.exit(f"mlx-vlm {version('mlx-vlm')} is installed; these fixtures need {MLX_VLM}")
    try:
        import tiktoken  # noqa: F401  (the K3 processor converts the fixture's tiktoken.model with it)
    except ImportError:
        sys.exit("tiktoken is not installed in this environment (pip install tiktoken==0.14.0)")


def draw(w: int, h: int, seed: int) -> np.ndarray:
    """A gradient with sharp edges and noise: every resize rounding path gets exercised."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    r = (x * 255 / max(1, w - 1)).astype(np.int32)
    g = (y * 255 / max(1, h - 1)).astype(np.int32)
    b = np.where((x // 5 + y // 4) % 2 == 0, 230, 20)
    img = np.stack([r, g, b], -1) + rng.integers(-40, 41, size=(h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def png_bytes(samples: np.ndarray, color_type: int, bit_depth: int, interlace: bool = False,
              before_idat: bytes = b"") -> bytes:
    """A PNG written by hand, for layouts Pillow does not save: 16-bit color, 2-bit gray, Adam7 interlacing.
    ``samples`` is ``[h, w, channels]`` (uint16 big-endian for 16 bits) or, for bit depths below 8, ``[h, w]``
    values already in range."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    def rows(img: np.ndarray) -> bytes:
        out = b""
        for row in img:
            if bit_depth < 8:
                per = 8 // bit_depth
                vals = list(row) + [0] * (-len(row) % per)
                packed = bytes(sum(int(v) << (8 - bit_depth * (j + 1)) for j, v in enumerate(vals[i:i + per]))
                               for i in range(0, len(vals), per))
            else:
                packed = row.astype(">u2" if bit_depth == 16 else "u1").tobytes()
            out += b"\0" + packed
        return out

    h, w = samples.shape[:2]
    if interlace:
        passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]
        raw = b"".join(rows(samples[y0::dy, x0::dx]) for x0, y0, dx, dy in passes
                       if samples[y0::dy, x0::dx].size)
    else:
        raw = rows(samples)
    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, int(interlace))
    extra = b""
    while before_idat:  # (kind, data) pairs: 4-byte kind, 4-byte length, data
        kind, n = before_idat[:4], struct.unpack(">I", before_idat[4:8])[0]
        extra += chunk(kind, before_idat[8:8 + n])
        before_idat = before_idat[8 + n:]
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + extra + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


def make_images() -> dict[str, bytes]:
    files: dict[str, bytes] = {}

    def save(name: str, im: Image.Image, fmt: str, **kw) -> None:
        buf = io.BytesIO()
        im.save(buf, fmt, **kw)
        files[name] = buf.getvalue()

    save("rgb.png", Image.fromarray(draw(41, 29, 1)), "PNG")
    rgba = np.dstack([draw(37, 31, 2), np.tile(np.linspace(0, 255, 37).astype(np.uint8), (31, 1))])
    rgba[5:12, 3:9, 3] = 0  # fully transparent block with colored pixels under it
    save("rgba.png", Image.fromarray(rgba, "RGBA"), "PNG")
    pal = Image.fromarray(draw(33, 27, 3)).quantize(colors=16)
    alphas = bytes([0, 128, 255, 60] + [255] * 12)
    save("palette.png", pal, "PNG", transparency=alphas)
    gray = draw(29, 23, 4)[:, :, 0]
    save("gray.png", Image.fromarray(gray, "L"), "PNG")
    save("gray_key.png", Image.fromarray(gray[:20, :21], "L"), "PNG", transparency=int(gray[3, 4]))
    la = np.dstack([draw(26, 35, 5)[:, :, 1], draw(26, 35, 6)[:, :, 2]])
    save("gray_alpha.png", Image.fromarray(la, "LA"), "PNG")
    save("tiny.png", Image.fromarray(draw(3, 2, 7)), "PNG")
    save("wide.png", Image.fromarray(draw(90, 12, 8)), "PNG")
    rng = np.random.default_rng(14)
    files["rgb16.png"] = png_bytes(rng.integers(0, 65536, size=(13, 19, 3)), 2, 16)
    files["rgba16.png"] = png_bytes(rng.integers(0, 65536, size=(11, 17, 4)), 6, 16)
    files["gray2.png"] = png_bytes(rng.integers(0, 4, size=(9, 15)), 0, 2)
    files["interlaced.png"] = png_bytes(draw(23, 18, 15), 2, 8, interlace=True)
    # A 3-entry palette with one tRNS alpha, and indices past the palette (Pillow reads them as opaque black).
    plte = bytes([200, 30, 40, 20, 180, 60, 30, 40, 220])
    chunks = b"PLTE" + struct.pack(">I", len(plte)) + plte + b"tRNS" + struct.pack(">I", 1) + bytes([90])
    files["short_palette.png"] = png_bytes(rng.integers(0, 6, size=(10, 14, 1)), 3, 8, before_idat=chunks)
    save("photo.jpg", Image.fromarray(draw(45, 33, 9)), "JPEG", quality=90)
    save("gray.jpg", Image.fromarray(draw(27, 19, 10)[:, :, 2], "L"), "JPEG", quality=85)
    save("lossless.webp", Image.fromarray(draw(40, 28, 11)), "WEBP", lossless=True)
    la_rgba = np.dstack([draw(30, 22, 12), np.tile(np.linspace(255, 0, 22).astype(np.uint8)[:, None], (1, 30))])
    save("lossless_alpha.webp", Image.fromarray(la_rgba, "RGBA"), "WEBP", lossless=True)
    save("lossy.webp", Image.fromarray(draw(39, 30, 13)), "WEBP", quality=80)
    return files


# preprocessor_config.json contents (media_proc_cfg) per processor, and the reference's kwargs for it.
PROCESSORS = {
    # K2.5, small patches so a 41x29 image exceeds the patch limit (10 * 7 = 70 > 40 patches).
    "k25": ("k25", {"patch_size": 4, "in_patch_limit": 40, "merge_kernel_size": [2, 2]}),
    # K2.5 with the defaults but a per-side limit that the wide image hits.
    "k25_side": ("k25", {"patch_size": 6, "patch_limit_on_one_side": 5, "merge_kernel_size": 2,
                         "image_mean": [0.48145466, 0.4578275, 0.40821073],
                         "image_std": [0.26862954, 0.26130258, 0.27577711]}),
    # K3 with a chessboard background composited before the resize, CLIP's mean/std.
    "k3_chess": ("k3", {"patch_size": 4, "in_patch_limit": 48, "patch_limit_on_one_side": 8,
                        "merge_kernel_size": [2, 2],
                        "image_mean": [0.48145466, 0.4578275, 0.40821073],
                        "image_std": [0.26862954, 0.26130258, 0.27577711],
                        "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 5,
                                                  "chessboard_gray_value": 190},
                        "transparent_bg_fill_stage": "before_resize"}),
    # K3 with a white background composited after the resize, a 1x2 merge kernel.
    "k3_after": ("k3", {"patch_size": 6, "in_patch_limit": 30, "merge_kernel_size": [1, 2],
                        "transparent_bg_config": {"pattern": "white"},
                        "transparent_bg_fill_stage": "after_resize"}),
    # K3 without a background config (alpha dropped), large patches: images are only padded.
    "k3_plain": ("k3", {"patch_size": 14, "in_patch_limit": 4}),
}

# Cases whose full pixel_values are stored (the others store the rescaled uint8 image only).
FULL = {("k25", "rgba.png"), ("k25_side", "photo.jpg"), ("k3_chess", "palette.png"), ("k3_after", "rgb.png")}


def make_processor(kind: str, cfg: dict):
    if kind == "k25":
        from mlx_vlm.models.kimi_k25.processing_kimi_k25 import KimiK25ImageProcessor as P

        kw = {}
        for src, dst in (("patch_size", "patch_size"), ("in_patch_limit", "in_token_limit"),
                         ("patch_limit_on_one_side", "patch_limit_on_one_side")):
            if src in cfg:
                kw[dst] = cfg[src]
    else:
        from mlx_vlm.models.kimi_k3.processing_kimi_k3 import KimiK3ImageProcessor as P

        kw = {k: cfg[k] for k in ("patch_size", "in_patch_limit", "patch_limit_on_one_side",
                                  "transparent_bg_config", "transparent_bg_fill_stage") if k in cfg}
    for k in ("image_mean", "image_std"):
        if k in cfg:
            kw[k] = tuple(cfg[k])
    if "merge_kernel_size" in cfg:
        m = cfg["merge_kernel_size"]
        kw["merge_kernel_size"] = [m, m] if isinstance(m, int) else m
    return P(**kw)


def main() -> None:
    check_pins()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    files = make_images()
    images = []
    for name, data in files.items():
        (OUT / name).write_bytes(data)
        im = Image.open(io.BytesIO(data))
        im.load()
        (OUT / f"{name}.decoded.bin").write_bytes(im.tobytes())
        (OUT / f"{name}.rgba.bin").write_bytes(im.convert("RGBA").tobytes())
        images.append({"file": name, "mode": im.mode, "size": list(im.size)})
    cases = []
    for pname, (kind, cfg) in PROCESSORS.items():
        proc = make_processor(kind, cfg)
        for entry in images:
            name = entry["file"]
            im = Image.open(OUT / name)
            im.load()
            rescaled = proc.rescale(im)
            assert rescaled.mode == "RGB"
            out = proc.preprocess([im])
            pv = np.array(out["pixel_values"], dtype=np.float32)
            grid = [int(v) for v in np.array(out["image_grid_hws" if kind == "k25" else "grid_thws"])[0]]
            if kind == "k25":
                grid = [1, *grid]
            merge = proc.merge_kernel_size
            n = len(cases)
            (OUT / f"case_{n}.rgb.bin").write_bytes(rescaled.tobytes())
            case = {"processor": pname, "image": name, "rescaled_size": list(rescaled.size), "grid": grid,
                    "tokens": grid[0] * grid[1] * grid[2] // (merge[0] * merge[1]),
                    "pixel_values_shape": list(pv.shape)}
            if (pname, name) in FULL:
                (OUT / f"case_{n}.f32.bin").write_bytes(pv.astype("<f4").tobytes())
                case["pixel_values"] = f"case_{n}.f32.bin"
            cases.append(case)
    manifest = {
        "generator": "scripts/make_vision_preprocess_fixtures.py",
        "versions": {"mlx-vlm": version("mlx-vlm"), "Pillow": version("Pillow"), "numpy": version("numpy")},
        "processors": {k: {"kind": kind, "preprocessor_config": {"media_proc_cfg": cfg}}
                       for k, (kind, cfg) in PROCESSORS.items()},
        "images": images,
        "cases": cases,
    }
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    make_prompts()
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {len(images)} images, {len(cases)} cases, {total} bytes to {OUT.relative_to(ROOT)}")


MEDIA_TOKENS = {"<|media_begin|>": 16, "<|media_content|>": 17, "<|media_end|>": 18, "<|media_pad|>": 19,
                "<|kimi_image_placeholder|>": 20}

# K3 chats: images as `image` and `image_url` parts, in one message and across turns.
K3_CHATS = [
    {"processor": "k3_chess", "images": ["rgb.png", "palette.png"],
     "messages": [{"role": "system", "content": "You compare pictures."},
                  {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                               {"type": "image_url", "image_url": {"url": "data:,"}},
                                               {"type": "text", "text": "What differs?"}]}]},
    {"processor": "k3_plain", "images": ["wide.png", "gray_alpha.png"],
     "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},
                  {"role": "assistant", "content": "A striped gradient."},
                  {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]}]},
]

K25_PROMPTS = [
    {"processor": "k25", "images": ["rgba.png", "tiny.png"],
     "text": "Look: <|media_begin|>image<|media_content|><|media_pad|><|media_end|> then "
             "<|media_pad|> - which is brighter?"},
]


def make_prompts() -> None:
    from mlx_vlm.models.kimi_k25.processing_kimi_k25 import KimiK25Processor
    from mlx_vlm.models.kimi_k3.processing_kimi_k3 import KimiK3Processor, _convert_kimi_k3_tiktoken

    src = ROOT / "mlx-k3/tests/fixtures/chat/k3_tokenizer"
    tokdir = OUT / "tokenizer"
    tokdir.mkdir()
    shutil.copy(src / "tiktoken.model", tokdir / "tiktoken.model")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    base = min(int(k) for k in cfg["added_tokens_decoder"])
    for name, offset in MEDIA_TOKENS.items():
        cfg["added_tokens_decoder"][str(base + offset)] = {
            "content": name, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}
    cfg["_comment"] = ("The K3 chat fixture tokenizer with media tokens added for the vision preprocessing "
                       "fixtures (scripts/make_vision_preprocess_fixtures.py).")
    (tokdir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    tok = _convert_kimi_k3_tiktoken(tokdir / "tiktoken.model", tokdir / "tokenizer_config.json")

    def load(name: str) -> Image.Image:
        im = Image.open(OUT / name)
        im.load()
        return im

    out = {"k3": [], "k25": []}
    for chat in K3_CHATS:
        kind, pcfg = PROCESSORS[chat["processor"]]
        proc = KimiK3Processor(image_processor=make_processor(kind, pcfg), tokenizer=tok)
        images = [load(n) for n in chat["images"]]
        text = proc.apply_chat_template(chat["messages"], tokenize=False, add_generation_prompt=True)
        called = proc(images=images, text=text)
        ids = [int(v) for v in np.array(called["input_ids"])[0]]
        grids = np.array(called["grid_thws"])
        merge = proc.image_processor.merge_kernel_size
        prompts = [proc.make_image_prompt(im.size[0], im.size[1], int(np.prod(g)) // (merge[0] * merge[1]))
                   for im, g in zip(images, grids)]
        segment_ids = list(proc.apply_chat_template(chat["messages"], tokenize=True, add_generation_prompt=True,
                                                    image_prompts=prompts))
        assert segment_ids == ids, "the processor's text-level expansion and the segment encoding differ"
        out["k3"].append({**chat, "ids": ids, "image_token_id": int(called["image_token_id"])})
    for case in K25_PROMPTS:
        kind, pcfg = PROCESSORS[case["processor"]]
        proc = KimiK25Processor(image_processor=make_processor(kind, pcfg), tokenizer=tok)
        called = proc(images=[load(n) for n in case["images"]], text=case["text"])
        ids = [int(v) for v in np.array(called["input_ids"])[0]]
        out["k25"].append({**case, "ids": ids, "image_token_id": int(called["image_token_id"])})
    (OUT / "prompts.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
