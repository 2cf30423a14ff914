"""Write a seeded random drafter checkpoint shaped for a model (the public DFlash layout), e.g. the
paper's DFlash2 drafter shape: 6 layers at the target's hidden size.

    python3 bench/drafter_checkpoint.py --model glm52-scaled --kind dflash2 --layers 6 --out /tmp/dflash2

Random weights: for measuring what a drafter of that shape costs (time per round, device memory),
not its acceptance. Heads and head size follow the target's; the MLP is 2 x hidden (factory's
random_dflash_config); the window is the default sliding window (2048).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dhisparse.models.registry import builtin_config  # noqa: E402
from dhisparse.spec.dflash_io import save_dflash  # noqa: E402
from dhisparse.spec.dflash_model import DFlashModel  # noqa: E402
from dhisparse.spec.factory import random_dflash_config  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="glm52-scaled")
    p.add_argument("--kind", choices=("dflash", "dflash2", "dspark"), default="dflash2")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    ns = p.parse_args(argv)
    cfg = builtin_config(ns.model)
    fake = SimpleNamespace(model=SimpleNamespace(embed_tokens=None), lm_head=None, config=cfg)  # only its shape is read
    dcfg = random_dflash_config(fake, ns.block, num_layers=ns.layers, kind=ns.kind)
    model = DFlashModel(dcfg)
    model.init_random(torch.Generator().manual_seed(ns.seed))
    save_dflash(ns.out, dcfg, model.to(torch.bfloat16))
    params = sum(t.numel() for t in model.parameters())
    print(json.dumps({"out": ns.out, "kind": ns.kind, "layers": ns.layers, "hidden": dcfg.hidden_size,
                      "params": params, "bf16_bytes": 2 * params}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
