"""Fixtures for video input (`mlx-k3/tests/video.rs`, `mlx-k3-cli/tests/cli.rs`): frames, the same frames as
animated files written by Pillow, and the frame-sampling rule computed with numpy as Kimi K2.5's video
processor computes it.

Writes `mlx-k3/tests/fixtures/video/`:

    frames/frame_000.png ... frame_005.png   six 40x30 RGB frames (a square moving over a gradient)
    rgba/frame_000.png ... frame_002.png     three 20x16 RGBA frames (opaque, half and fully transparent areas)
    anim.png       the six RGB frames as an animated PNG, 100 ms each (Pillow crops each frame to what changed)
    anim_rgba.png  the RGBA frames as an animated PNG, 100 ms each
    anim.webp      the six RGB frames as a lossless animated WebP, 100 ms each
    sampling.json  frame indices for (frames, source fps, sampling fps, max frames) cases:
                   `KimiK25VisionProcessor.split_video_chunks` (the checkpoint's processor): n = max(1,
                   round(N * min(fps, R) / R)), capped at max frames, indices round(linspace(0, N - 1, n))

The decoders must give back the frames pixel for pixel (APNG and lossless WebP are lossless), so the test
compares each decoded frame with the PNG it was made from.

    /work/vlm-venv/bin/python scripts/make_video_fixtures.py     (any Python with numpy and Pillow)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "mlx-k3" / "tests" / "fixtures" / "video"


def rgb_frames() -> list[Image.Image]:
    w, h = 40, 30
    y, x = np.mgrid[0:h, 0:w]
    frames = []
    for i in range(6):
        a = np.zeros((h, w, 3), dtype=np.uint8)
        a[..., 0] = (x * 6 + i * 10) % 256
        a[..., 1] = (y * 8) % 256
        a[..., 2] = 40 * i
        a[5 + i : 15 + i, 4 + 5 * i : 14 + 5 * i] = (250, 250 - 30 * i, 20)
        frames.append(Image.fromarray(a, "RGB"))
    return frames


def rgba_frames() -> list[Image.Image]:
    w, h = 20, 16
    frames = []
    for i in range(3):
        a = np.zeros((h, w, 4), dtype=np.uint8)
        a[..., 0] = 30 + 60 * i
        a[..., 1] = np.arange(w)[None, :] * 10
        a[..., 2] = np.arange(h)[:, None] * 12
        a[..., 3] = 255
        a[2 + i : 8 + i, 3:9, 3] = 128
        a[10:14, 12 + i : 16 + i, 3] = 0
        frames.append(Image.fromarray(a, "RGBA"))
    return frames


def sample(total: int, source_fps: float, fps: float, max_frames: int | None) -> list[int]:
    # KimiK25VisionProcessor.split_video_chunks, with an optional cap on the count.
    rate = min(fps, source_fps)
    n = max(round(total * rate / source_fps), 1)
    if max_frames is not None:
        n = min(n, max_frames)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


CASES = [
    # (frames, source fps, sampling fps, max frames)
    (60, 30.0, 2.0, None),
    (61, 30.0, 2.0, None),
    (6, 10.0, 2.0, None),
    (6, 10.0, 5.0, None),
    (6, 10.0, 25.0, None),
    (7, 10.0, 5.0, None),  # n = round(3.5) = 4 (ties to even)
    (5, 10.0, 5.0, None),  # n = round(2.5) = 2
    (4, 2.0, 2.0, 3),  # linspace 0, 1.5, 3: 1.5 rounds to 2
    (10, 2.0, 2.0, 3),  # linspace 0, 4.5, 9: 4.5 rounds to 4
    (1, 24.0, 2.0, None),
    (300, 29.97, 2.0, 16),
    (1000, 25.0, 1.0, None),
    (3, 0.5, 2.0, None),
]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "frames").mkdir(exist_ok=True)
    (OUT / "rgba").mkdir(exist_ok=True)
    frames = rgb_frames()
    for i, f in enumerate(frames):
        f.save(OUT / "frames" / f"frame_{i:03d}.png")
    frames[0].save(OUT / "anim.png", save_all=True, append_images=frames[1:], duration=100, loop=0)
    frames[0].save(
        OUT / "anim.webp", save_all=True, append_images=frames[1:], duration=100, loop=0, lossless=True, exact=True
    )
    rgba = rgba_frames()
    for i, f in enumerate(rgba):
        f.save(OUT / "rgba" / f"frame_{i:03d}.png")
    rgba[0].save(OUT / "anim_rgba.png", save_all=True, append_images=rgba[1:], duration=100, loop=0)

    # The written animations really are animations that give the frames back (Pillow's own reading).
    for name, src in (("anim.png", frames), ("anim.webp", frames), ("anim_rgba.png", rgba)):
        with Image.open(OUT / name) as im:
            assert im.n_frames == len(src), name
            for i, f in enumerate(src):
                im.seek(i)
                assert np.array_equal(np.asarray(im.convert(f.mode)), np.asarray(f)), (name, i)

    cases = [
        {"frames": n, "source_fps": r, "fps": f, "max_frames": m, "indices": sample(n, r, f, m)}
        for n, r, f, m in CASES
    ]
    (OUT / "sampling.json").write_text(json.dumps({"generator": "scripts/make_video_fixtures.py", "cases": cases}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
