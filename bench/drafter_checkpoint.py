"""Write a seeded random drafter checkpoint shaped for a model (the public DFlash layout), e.g. the
paper's DFlash2 drafter shape: 6 layers at the target's hidden size.

    python3 bench/drafter_checkpoint.py --model glm52-scaled --kind dflash2 --layers 6 --out /tmp/dflash2

Random weights: for measuring what a drafter of that shape costs (time per round, device memory),
not its acceptance. By default heads and head size follow the target's and the MLP is 2 x hidden
(factory's random_dflash_config); the window is the default sliding window (2048).

--heads / --kv-heads / --head-dim / --intermediate set the attention and MLP shape. `--shape
paper-glm5` is the paper's GLM-5.3 DFlash2 as far as the paper states it (section 3.4 and 4.1):
six layers whose twelve K/V allocations total 12,288 bytes a ring row (bf16: 512 K and 512 V
values a layer, here 4 KV heads of 128) and 4.9 GiB of weights; the query heads (48 x 128 =
hidden 6,144) and the MLP (15,360) are our choice, which gives 4.84 GiB. The target's own shape
(64 heads of 96, K/V heads = heads) gives 147,456 bytes a ring row: 12x the paper's ring.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dhisparse.models.registry import builtin_config  # noqa: E402
from dhisparse.spec.dflash_config import DFlashConfig  # noqa: E402
from dhisparse.spec.dflash_io import save_dflash  # noqa: E402
from dhisparse.spec.dflash_model import DFlashModel  # noqa: E402
from dhisparse.spec.factory import random_dflash_config  # noqa: E402


SHAPES = {"paper-glm5": dict(num_heads=48, num_kv_heads=4, head_dim=128, intermediate_size=15360)}


def shaped(dcfg: DFlashConfig, ns) -> DFlashConfig:
    """dcfg with the named shape, then the explicit flags, applied (K/V heads follow the query heads
    unless set)."""
    over = dict(SHAPES.get(ns.shape or "", {}))
    for flag, key in (("heads", "num_heads"), ("kv_heads", "num_kv_heads"), ("head_dim", "head_dim"),
                      ("intermediate", "intermediate_size")):
        if getattr(ns, flag) is not None:
            over[key] = getattr(ns, flag)
    if "num_heads" in over and "num_kv_heads" not in over:
        over["num_kv_heads"] = over["num_heads"]
    return dataclasses.replace(dcfg, **over)


def ring_row_bytes(dcfg: DFlashConfig) -> int:
    """Bytes of one draft-ring row in bf16: K and V of every layer."""
    return dcfg.num_layers * 2 * dcfg.num_kv_heads * dcfg.head_dim * 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="glm52-scaled")
    p.add_argument("--kind", choices=("dflash", "dflash2", "dspark"), default="dflash2")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=sorted(SHAPES), help="a named attention / MLP shape (module docstring)")
    p.add_argument("--heads", type=int, help="query heads (default: the target's)")
    p.add_argument("--kv-heads", type=int, help="K/V heads (default: = --heads)")
    p.add_argument("--head-dim", type=int, help="head size (default: hidden / heads, even)")
    p.add_argument("--intermediate", type=int, help="MLP size (default: 2 x hidden)")
    p.add_argument("--out", required=True)
    ns = p.parse_args(argv)
    cfg = builtin_config(ns.model)
    fake = SimpleNamespace(model=SimpleNamespace(embed_tokens=None), lm_head=None, config=cfg)  # only its shape is read
    dcfg = shaped(random_dflash_config(fake, ns.block, num_layers=ns.layers, kind=ns.kind), ns)
    model = DFlashModel(dcfg)
    model.init_random(torch.Generator().manual_seed(ns.seed))
    save_dflash(ns.out, dcfg, model.to(torch.bfloat16))
    params = sum(t.numel() for t in model.parameters())
    print(json.dumps({"out": ns.out, "kind": ns.kind, "layers": ns.layers, "hidden": dcfg.hidden_size,
                      "heads": dcfg.num_heads, "kv_heads": dcfg.num_kv_heads, "head_dim": dcfg.head_dim,
                      "intermediate": dcfg.intermediate_size, "params": params, "bf16_bytes": 2 * params,
                      "ring_row_bytes": ring_row_bytes(dcfg)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
