"""Training the target's MTP block (next-next-token prediction) and writing it into the checkpoint.

The block is our own `spec/mtp_model.MtpModule` (DeepSeek-V3 / GLM-5 NextN layout), trained through
its `forward_sequence`, the dense windowed pass the drafter's tests hold equal to its decode steps,
so the weights are trained under exactly the conventions they are served with:

    g_t       the trained target's last hidden state at t after its final norm   [B, T, H]
    e_t       the target's embedding of x_{t+1} (zero at position 0)           [B, T, H]
    h'_t      MtpModule over (e, g), each row attending its window of W = index_topk rows
    loss      cross-entropy of lm_head(shared_head.norm(h'_t)) against x_{t+2}

The target is frozen (its embedding and LM head are shared with the block, as in GLM-5): the
block is trained after the DSA stages on the target's own hidden states, so the target the MTP
block drafts for is bit-for-bit the target that was evaluated. The attention and MoE run the
plain-PyTorch reference kernels (`kernels/backend.py`: the Triton kernels have no backward).

`write_mtp` adds the block to a saved model folder in the checkpoint layout our loader and
SGLang's / vLLM's NextN loaders read: `model.layers.{L}.*` tensors (L = num_hidden_layers) in
their own shard, `model.safetensors.index.json` naming both shards, and
`num_nextn_predict_layers: 1` in config.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.nn import functional as F

from dhisparse.core.config import ModelConfig
from dhisparse.core.params import SamplingParams
from dhisparse.engine.llm import LLM
from dhisparse.kernels.backend import configure, settings
from dhisparse.layers import rope as rope_module
from dhisparse.spec.mtp_io import checkpoint_tensors
from dhisparse.spec.mtp_model import MtpModule
from dhisparse.train.dsa import batches, logged, optimizer_step, set_topk

MTP_SHARD = "model-mtp.safetensors"


@dataclass
class MtpResult:
    """Loss curve (next-next-token cross-entropy every `log_every` steps)."""

    steps: int
    loss: list[float] = field(default_factory=list)


def target_config(model) -> ModelConfig:
    """Our ModelConfig of a transformers glm_moe_dsa model (its config.json form)."""
    return ModelConfig.from_hf(model.config.to_dict())


def build_block(model, seed: int) -> MtpModule:
    """A seeded MTP block for `model` (fp32, on its device): MoE when the target's later layers are."""
    tcfg = target_config(model)
    return MtpModule.random(tcfg, seed=seed, dtype=torch.float32, device=next(model.parameters()).device)


def _inputs(model, xb: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xb [B, S + 2] -> (embeds [B*S, H] of x_{t+1}, hidden [B*S, H] = normed g_t, positions [B*S])."""
    B, S = xb.shape[0], xb.shape[1] - 2
    set_topk(model, topk)
    with torch.no_grad():
        g = model.model(input_ids=xb[:, :S]).last_hidden_state  # after the final norm
        e = model.model.embed_tokens(xb[:, 1 : S + 1])
    pos = torch.arange(S, device=xb.device).repeat(B)
    return e.reshape(B * S, -1).float(), g.reshape(B * S, -1).float(), pos


def block_logits(model, block: MtpModule, xb: torch.Tensor, topk: int) -> torch.Tensor:
    """Next-next-token logits [B*S, V] of windows xb [B, S + 2] (row t predicts x_{t+2})."""
    embeds, hidden, pos = _inputs(model, xb, topk)
    h = block.forward_sequence(embeds, hidden, pos, block.tcfg.index_topk)
    return model.lm_head(block.head_input(h).to(model.lm_head.weight.dtype)).float()


class _TorchKernels:
    """Run the reference kernels (autograd) while training; restore the settings after."""

    def __enter__(self) -> None:
        self.saved = settings()
        configure(replace(self.saved, backend="torch"))
        rope_module._PERMS.clear()  # RoPE's permutation cache may hold inference-mode tensors autograd cannot save

    def __exit__(self, *exc) -> None:
        configure(self.saved)


def train_block(model, block: MtpModule, tokens: torch.Tensor, steps: int, *, seq_len: int = 256, batch: int = 8,
                lr: float = 3e-3, topk: int = 64, seed: int = 0, log_every: int = 10) -> MtpResult:
    """Train `block` on next-next-token prediction over seeded windows of `tokens` [N] with the
    target `model` frozen (sparse attention at `topk`, as it serves)."""
    device = next(model.parameters()).device
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for p in block.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    result = MtpResult(steps)
    block.train()
    with _TorchKernels():
        for step, xb in zip(range(steps), batches(tokens, seq_len + 1, batch, seed)):
            xb = xb.to(device)
            loss = F.cross_entropy(block_logits(model, block, xb, topk), xb[:, 2:].reshape(-1))
            optimizer_step(opt, loss, params)
            if logged(step, steps, log_every):
                result.loss.append(round(float(loss.detach()), 4))
    block.eval()
    return result


@torch.no_grad()
def accuracy(model, block: MtpModule, tokens: torch.Tensor, seq_len: int = 256, topk: int = 64) -> dict:
    """Held-out next-next-token top-1 accuracy and cross-entropy (nats) over consecutive windows."""
    device = next(model.parameters()).device
    hits = total = 0
    nats = 0.0
    with _TorchKernels():
        for a in range(0, tokens.numel() - 2, seq_len):
            x = tokens[a : a + seq_len + 2].to(device)
            if x.numel() < 3:
                break
            logits = block_logits(model, block, x[None], topk)
            target = x[2:]
            hits += int((logits.argmax(-1) == target).sum())
            nats += float(F.cross_entropy(logits, target, reduction="sum"))
            total += target.numel()
    return {"top1": hits / max(total, 1), "nats": nats / max(total, 1), "tokens": total,
            "perplexity": math.exp(nats / max(total, 1))}


def write_mtp(folder: str | Path, block: MtpModule) -> Path:
    """Add the block to a `save_pretrained` folder (see the module docstring)."""
    folder = Path(folder)
    tensors = {n: t.detach().to(torch.float32).contiguous().cpu() for n, t in checkpoint_tensors(block).items()}
    save_file(tensors, str(folder / MTP_SHARD))
    weight_map: dict[str, str] = {}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = {n: f for n, f in json.loads(index.read_text())["weight_map"].items() if f != MTP_SHARD}
    else:
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            weight_map = {n: "model.safetensors" for n in f.keys()}
    weight_map.update({n: MTP_SHARD for n in tensors})
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return folder


def engine_acceptance(folder: str | Path, prompts: list[list[int]], max_tokens: int, device: str,
                      width: int = 4) -> dict:
    """Serve `folder` with its MTP block as the drafter (greedy, `width` queries a round) on
    `prompts`: tokens per round and first-position acceptance, and whether the tokens equal the
    same engine's without speculation (they must: speculation never changes greedy output)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(folder), device=device).generate(prompts, params)]
    llm = LLM(str(folder), device=device, speculative_algorithm="mtp", speculative_num_draft_tokens=width)
    spec = [o.token_ids for o in llm.generate(prompts, params)]
    st = llm.engine.stats().as_dict()
    return {"tokens_per_round": st.get("spec_tokens_per_round"), "accept_pos1": st.get("spec_accept_pos1"),
            "width": width, "prompts": len(prompts), "max_tokens": max_tokens, "tokens_equal": spec == plain}
