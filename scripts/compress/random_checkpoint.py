"""A randomly initialized Kimi K3-architecture checkpoint (mlx-lm's own classes), for measuring the converter's
peak memory on something bigger than k3-nano. Weights bf16 (A_log, dt_bias, e_score_correction_bias fp32),
written by mlx_lm.utils.save_model (sharded at 5 GB, so one file here).

usage: .venv/bin/python scripts/compress/random_checkpoint.py OUT_DIR [LAYERS] [EXPERTS]
"""
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map_with_path
from mlx_lm.models import kimi_k3
from mlx_lm.utils import save_config, save_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k3_nano"))
from common import TEXT_CONFIG, model_config  # noqa: E402


def main():
    out = Path(sys.argv[1])
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    experts = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    text = dict(TEXT_CONFIG)
    text.update(
        num_hidden_layers=layers,
        num_experts=experts,
        moe_intermediate_size=256,
        routed_expert_hidden_size=256,
        linear_attn_config=dict(TEXT_CONFIG["linear_attn_config"], kda_layers=[i + 1 for i in range(layers) if i % 4 != 3],
                                full_attn_layers=[i + 1 for i in range(layers) if i % 4 == 3]),
    )
    config = model_config(text)
    mx.random.seed(0)
    model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(config))
    keep = model.cast_predicate
    model.update(tree_map_with_path(lambda p, v: v.astype(mx.bfloat16) if keep(p) and v.dtype == mx.float32 else v,
                                    model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    print(json.dumps({"out": str(out), "layers": layers, "experts": experts,
                      "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors"))}))


if __name__ == "__main__":
    main()
