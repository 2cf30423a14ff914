"""CI-sized parametrizations: the suite must finish inside CI's budget on 2 CPU cores.

A multi-process test (a DP / TP / EP or prefill/decode world of spawned ranks, ~10-20 s a case on
CI's machine) runs two presets in CI: `hisparse` (the hierarchy under pressure: resolver, hot
cache, host copies) and `adaptive+spec` (residency, reclaim and speculation). The other presets
are marked `slow`: `python -m pytest -m slow` (or `-m ""` for everything) runs them. The worlds'
ranks run on CPU (the tests pin device="cpu") even on the GPU machine, so the slow presets add no
CUDA coverage to the exactness runs, which keep the default selection.
"""

from __future__ import annotations

import pytest

PRESETS = ("resident", "hisparse", "adaptive", "adaptive+spec")
CI_PRESETS = ("hisparse", "adaptive+spec")


def world_presets(presets=PRESETS, ci=CI_PRESETS) -> list:
    """`presets` as pytest params, those outside `ci` marked slow."""
    return [p if p in ci else pytest.param(p, marks=pytest.mark.slow) for p in presets]
