"""What our causal LMs share: the LM head (optionally tied to the embedding), device / dtype and
fp32 logits. Subclasses set `self.model` (with `embed_tokens`) before calling `_init_head`."""

from __future__ import annotations

import torch
from torch import nn


class CausalLMHead(nn.Module):
    supports_cuda_graphs = False
    """Whether the model replays its layers' pure pieces from CUDA graphs (models/graphs.py)."""
    graphs = None
    """The model's `PiecewiseGraphs` when it supports them and they are on, else None."""

    def _init_head(self, hidden_size: int, vocab_size: int, tie: bool) -> None:
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> [n, vocab] fp32."""
        return self.lm_head(hidden).float()
