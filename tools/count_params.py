"""Print a model preset's parameter count, built on the meta device (no weights allocated).

    python tools/count_params.py --preset fbt-1b
"""

from __future__ import annotations

import argparse
import sys

import torch


def count(preset: str) -> dict:
    from fbt_megatron.common import platform
    from fbt_megatron.model.config import make_config
    from fbt_megatron.model.fbt_model import FBTModel

    platform.init_distributed()
    config = make_config(preset, use_cpu_initialization=True, perform_initialization=False)
    with torch.device("meta"):
        model = FBTModel(config)
    params = dict(model.named_parameters())
    assert all(p.is_meta for p in params.values()), "weights were allocated"
    fusion = sum(p.numel() for n, p in params.items() if n.startswith("feedback_fusion."))
    total = sum(p.numel() for p in params.values())
    return {"preset": preset, "total": total, "backbone": total - fusion, "fusion": fusion, "hidden": config.hidden_size}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="fbt-1b")
    args = parser.parse_args(argv)
    try:
        c = count(args.preset)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    d = c["hidden"]
    print(f"{c['preset']}: {c['total']:,} parameters")
    print(f"  backbone (tied embedding, {d=}): {c['backbone']:,}")
    print(f"  latent feedback fusion (2·D² + D = {2 * d * d + d:,}): {c['fusion']:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
