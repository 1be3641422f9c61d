"""Times mlx-vlm 0.7.10's Kimi K3 MoonViT-3d tower and patchmergerv2 projector (its `VisionConfig` defaults: 27
blocks of width 1024, 12 heads, MLP 4096; text width 7168) with random weights, as
`examples/vision_tower.rs k3` times mlx-k3's: one SIDE x SIDE image (patches of 14), or with FRAMES a video
chunk of that many frames, REPS encodes after one warm-up, each evaluated; median wall time and mean CPU time
(all threads) printed. f32, the default device.

    /work/vlm-venv/bin/python scripts/bench_vision_k3_mlx_vlm.py [SIDE [REPS [DEPTH [FRAMES]]]]

(a virtualenv with mlx-vlm==0.7.10, mlx-lm==0.32.2 and mlx[cpu]==0.32.4; see make_vision_k3_fixtures.py).
REPS 0 times one encode without the warm-up (at full depth one of mlx-vlm's encodes takes minutes).
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import mlx.core as mx
from mlx_vlm.models.kimi_k3.config import VisionConfig
from mlx_vlm.models.kimi_k3.kimi_k3 import KimiK3MultiModalProjector
from mlx_vlm.models.kimi_k3.vision import VisionModel


def main() -> None:
    args = [int(a) for a in sys.argv[1:]]
    side = args[0] if args else 448
    # REPS 0: one encode and no warm-up (at full depth one mlx-vlm encode takes minutes).
    warm_up = (args[1] if len(args) > 1 else 3) > 0
    reps = max(1, args[1] if len(args) > 1 else 3)
    vc = VisionConfig(vt_num_hidden_layers=args[2]) if len(args) > 2 else VisionConfig()
    frames = max(1, args[3] if len(args) > 3 else 1)
    tower = VisionModel(vc)
    proj = KimiK3MultiModalProjector(SimpleNamespace(vision_config=vc, text_config=SimpleNamespace(hidden_size=7168)))
    mx.eval(tower.parameters(), proj.parameters())
    n = side // vc.patch_size
    n -= n % 2
    pixels = mx.random.uniform(-1.0, 1.0, (frames * n * n, 3, vc.patch_size, vc.patch_size))
    grid = [[frames, n, n]]

    def encode():
        return proj(tower(pixels.transpose(0, 2, 3, 1), grid_thws=grid))

    if warm_up:
        mx.eval(encode())
    times = []
    cpu0 = time.process_time()
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(encode())
        times.append(time.perf_counter() - t)
    what = "chunk" if frames > 1 else "image"
    print(f"CPU time {(time.process_time() - cpu0) / reps:.2f} s per {what} (all threads)")
    times.sort()
    median = times[len(times) // 2]
    print(
        f"{side}x{side} x {frames} frame(s) ({n}x{n} patches each, {(n // 2) ** 2} tokens, {vc.vt_num_hidden_layers} "
        f"blocks): median {median:.3f} s per {what} over {reps} (min {times[0]:.3f}, max {times[-1]:.3f})"
    )
    if frames > 1:
        print(f"per second of video at 2 frames/s: {median * 2 / frames:.3f} s")


if __name__ == "__main__":
    main()
