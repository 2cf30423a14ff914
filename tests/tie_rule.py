"""The references' indexers (transformers' models) under our tie rule (helper module, not a test file).

transformers selects with `index_scores.topk(...)`, whose ties among equal scores (exact zeros are
common: scores are sums of ReLUs) break as torch's kernel does; the engine breaks them by lowest
position (dhisparse/core/topk.py). `tie_rule(model)` makes the model's forward run with
`Tensor.topk` replaced by that rule for largest / sorted top-k along the last dimension, which
equals torch's whenever there is no tie. Everything else is torch's."""

from __future__ import annotations

import functools

import torch

from dhisparse.core.topk import stable_topk

_TOPK = torch.Tensor.topk


def _ruled(self, k, dim=-1, largest=True, sorted=True):
    if largest and sorted and dim in (-1, self.dim() - 1) and self.is_floating_point():
        return torch.return_types.topk(stable_topk(self, k))
    return _TOPK(self, k, dim, largest, sorted)


def tie_rule(model):
    """`model` with its forward (and so generate) run under the engine's tie rule."""
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kw):
        torch.Tensor.topk = _ruled
        try:
            return inner(*args, **kw)
        finally:
            torch.Tensor.topk = _TOPK

    model.forward = forward
    return model
