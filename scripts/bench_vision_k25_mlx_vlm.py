"""Times mlx-vlm 0.7.10's Kimi K2.5 MoonViT tower and projector (its default sizes, text width 7168) with random
weights, as `examples/vision_tower.rs` times mlx-k3's: one SIDE x SIDE image (patches of 14), REPS encodes after
one warm-up, each evaluated, median wall time and mean CPU time (all threads) printed. f32, the default device.

    /tmp/vlm-venv/bin/python scripts/bench_vision_k25_mlx_vlm.py [SIDE [REPS [DEPTH]]]

(the venv of scripts/make_vision_k25_fixtures.py, which says how to make it).
REPS 0 times one encode without the warm-up (at full depth one of mlx-vlm's encodes takes minutes).
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import mlx.core as mx
from mlx_vlm.models.kimi_k25 import VisionConfig
from mlx_vlm.models.kimi_k25.kimi_k25 import KimiK25MultiModalProjector
from mlx_vlm.models.kimi_k25.vision import VisionModel


def main() -> None:
    args = [int(a) for a in sys.argv[1:]]
    side = args[0] if args else 448
    # REPS 0: one encode and no warm-up (at full depth one mlx-vlm encode takes minutes).
    warm_up = (args[1] if len(args) > 1 else 3) > 0
    reps = max(1, args[1] if len(args) > 1 else 3)
    vc = VisionConfig(depth=args[2]) if len(args) > 2 else VisionConfig()
    tower = VisionModel(vc)
    proj = KimiK25MultiModalProjector(SimpleNamespace(vision_config=vc, text_config=SimpleNamespace(hidden_size=7168)))
    mx.eval(tower.parameters(), proj.parameters())
    n = side // vc.patch_size
    n -= n % 2
    pixels = mx.random.uniform(-1.0, 1.0, (n * n, 3, vc.patch_size, vc.patch_size))
    grid = mx.array([[n, n]], dtype=mx.int32)

    def encode():
        return mx.concatenate(proj(tower(pixels.transpose(0, 2, 3, 1), grid_thw=grid)), axis=0)

    if warm_up:
        mx.eval(encode())
    times = []
    cpu0 = time.process_time()
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(encode())
        times.append(time.perf_counter() - t)
    print(f"CPU time {(time.process_time() - cpu0) / reps:.2f} s per image (all threads)")
    times.sort()
    print(
        f"{side}x{side} ({n}x{n} patches, {(n // 2) ** 2} tokens, {vc.depth} blocks): median {times[len(times) // 2]:.3f} s "
        f"per image over {reps} (min {times[0]:.3f}, max {times[-1]:.3f})"
    )


if __name__ == "__main__":
    main()
