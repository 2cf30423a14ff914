"""Training a small GLM-5-architecture (`glm_moe_dsa`) model with the DSA recipe, in our own words.

The network is transformers' GlmMoeDsaForCausalLM (eager attention), so a trained checkpoint is a
plain Hugging Face folder our loader reads. Three stages, each a call of `train_stage`:

    dense     every indexer keeps all positions (index_topk >= the sequence), the model learns the
              language with dense attention (next-token cross-entropy)
    warmup    the model is frozen; each `full` layer's indexer learns to score like its attention:
              KL(p || q) with p the layer's attention distribution averaged over heads and q the
              softmax of the indexer's scores, over the causal positions
    sparse    indexers keep `index_topk` positions; the model trains on cross-entropy with sparse
              attention, and each indexer on the KL restricted to the positions it selected (its
              inputs detached, so the language loss and the indexer loss train separate weights)

The indexer scores are recomputed here with gradients (transformers' indexer runs under no_grad
and returns only the selection) from the indexer's own weights and the inputs it was called with,
caught by a forward hook: q = wq_b(q_resid), k = k_norm(wk(h)), interleaved RoPE on the first
qk_rope_head_dim dims, score[s, t] = sum_h w_h(h_s) relu(q_sh . k_t) / sqrt(D), plus the causal mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn import functional as F
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

STAGES = ("dense", "warmup", "sparse")


def small_config(vocab_size: int, **over) -> dict:
    """A few-million-parameter glm_moe_dsa config: 6 layers (full, full, shared, full, shared, full
    indexers), two MoE layers after a dense first one, index_topk 64 against 256-token training windows."""
    d = dict(model_type="glm_moe_dsa", vocab_size=vocab_size, hidden_size=256, intermediate_size=512,
             moe_intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
             n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             first_k_dense_replace=4, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32,
             v_head_dim=32, index_topk=64, index_head_dim=32, index_n_heads=4, max_position_embeddings=1024,
             indexer_types=["full", "full", "shared", "full", "shared", "full"],
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=1, bos_token_id=0,
             eos_token_id=0, tie_word_embeddings=False)
    return {**d, **over}


def build_model(config: dict, seed: int):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="eager")


def load_target(folder: str | Path, device: str, dtype: torch.dtype | None = None, flag: str = "--model"):
    """(tokenizer, model in eval mode on `device`) of a folder the model stage wrote; dtype None
    keeps the saved weights' dtype. A folder without config.json / tokenizer.json is a ValueError
    naming `flag`."""
    for name in ("config.json", "tokenizer.json"):
        if not (Path(folder) / name).is_file():
            raise ValueError(f"{flag} {folder}: no {name} there; pass a folder written by the model stage")
    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    kw = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager", **kw)
    return tok, model.to(device).eval()


def indexers(model) -> list:
    return [layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None]


def set_topk(model, k: int) -> None:
    for ix in indexers(model):
        ix.index_topk = k


def indexer_scores(ix, hidden, q_resid, position_embeddings, mask) -> torch.Tensor:
    """The indexer's scores [B, S, T] with gradients (the module docstring's formula)."""
    b, s, _ = hidden.shape
    cos, sin = position_embeddings
    q = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
    k = ix.k_norm(ix.wk(hidden)).unsqueeze(2)
    r = ix.qk_rope_head_dim
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., r:]], dim=-1)
    k = torch.cat([k_rot, k[..., r:]], dim=-1).squeeze(2)
    logits = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale)  # [B,S,H,T]
    w = ix.weights_proj(hidden).float() * ix.n_heads ** -0.5
    scores = torch.matmul(w.unsqueeze(-2), logits).squeeze(-2)
    return scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask


class _Catch:
    """Forward hooks on every indexer keeping the inputs of its last call."""

    def __init__(self, model) -> None:
        self.inputs: dict[int, tuple] = {}
        self.handles = [ix.register_forward_hook(self._hook(i), with_kwargs=True) for i, ix in enumerate(indexers(model))]

    def _hook(self, i: int):
        def hook(module, args, kwargs, out):
            self.inputs[i] = (args[0], args[1], args[2], args[3], out)
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def indexer_kl(model, catch: _Catch, attentions, sparse: bool) -> torch.Tensor:
    """Mean over the full layers of KL(p || q) per query (p: attention averaged over heads; in the
    sparse stage both restricted to the indexer's selection); the indexer's inputs are detached."""
    full = [i for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None]
    total = 0.0
    for j, li in enumerate(full):
        hidden, q_resid, pos, mask, selected = catch.inputs[j]
        scores = indexer_scores(model.model.layers[li].self_attn.indexer, hidden.detach(), q_resid.detach(),
                                tuple(t.detach() for t in pos), mask)
        p = attentions[li].detach().float().mean(dim=1)  # [B, S, T]
        if sparse:
            keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, selected.long(), True)
            scores = scores.masked_fill(~keep, float("-inf"))
            p = p * keep
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
        log_q = torch.log_softmax(scores, dim=-1)
        kl = (p * (torch.log(p.clamp_min(1e-12)) - log_q.clamp_min(-1e4))).sum(-1)
        total = total + kl.mean()
    return total / max(len(full), 1)


@dataclass
class StageResult:
    stage: str
    steps: int
    lm_loss: list[float] = field(default_factory=list)
    kl_loss: list[float] = field(default_factory=list)


def batches(tokens: torch.Tensor, seq_len: int, batch: int, seed: int):
    """Endless random windows [batch, seq_len + 1] of the token stream (seeded)."""
    g = torch.Generator().manual_seed(seed)
    n = tokens.numel() - seq_len - 1
    if n < 1:
        raise ValueError(f"the training text has {tokens.numel()} tokens, fewer than one window of {seq_len + 1}")
    while True:
        starts = torch.randint(0, n, (batch,), generator=g)
        yield torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, params: list, clip: float = 1.0) -> None:
    """One update of `params` on `loss`: fresh gradients, clipped to norm `clip`."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()


def logged(step: int, steps: int, every: int) -> bool:
    """Whether a loss curve records step `step` of `steps` (every `every` steps, and the last)."""
    return step % every == 0 or step == steps - 1


def train_stage(model, stage: str, tokens: torch.Tensor, steps: int, *, seq_len: int = 256, batch: int = 8,
                lr: float = 3e-3, topk: int = 64, seed: int = 0, log_every: int = 10) -> StageResult:
    """Run one stage (see the module docstring) on `tokens` [N] (int64); returns its loss curves."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    device = next(model.parameters()).device
    set_topk(model, seq_len if stage != "sparse" else topk)
    ix_params = [p for ix in indexers(model) for p in ix.parameters()]
    ix_ids = {id(p) for p in ix_params}
    main = [p for p in model.parameters() if id(p) not in ix_ids]
    params = {"dense": main, "warmup": ix_params, "sparse": main + ix_params}[stage]
    for p in model.parameters():
        p.requires_grad_(any(p is q for q in params))
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    result, catch = StageResult(stage, steps), _Catch(model)
    model.train()
    try:
        for step, xb in zip(range(steps), batches(tokens, seq_len, batch, seed)):
            xb = xb.to(device)
            out = model(input_ids=xb[:, :-1], output_attentions=stage != "dense")
            lm = F.cross_entropy(out.logits.float().flatten(0, 1), xb[:, 1:].flatten())
            kl = indexer_kl(model, catch, out.attentions, stage == "sparse") if stage != "dense" else lm * 0
            loss = (lm if stage != "warmup" else 0) + kl
            optimizer_step(opt, loss, params)
            if logged(step, steps, log_every):
                result.lm_loss.append(round(float(lm.detach()), 4))
                result.kl_loss.append(round(float(kl.detach()), 4))
    finally:
        catch.close()
        model.eval()
    return result


@torch.no_grad()
def bits_per_byte(model, tokens: torch.Tensor, n_bytes: int, seq_len: int = 256, topk: int | None = None) -> float:
    """Held-out bits per byte: summed next-token nats over consecutive windows / bytes / ln 2.
    topk None = dense attention (every indexer keeps every position), else sparse selection."""
    device = next(model.parameters()).device
    set_topk(model, seq_len if topk is None else topk)
    nats = 0.0
    for a in range(0, tokens.numel() - 1, seq_len):
        x = tokens[a:a + seq_len + 1].to(device)
        if x.numel() < 2:
            break
        logits = model(input_ids=x[None, :-1]).logits[0].float()
        nats += float(F.cross_entropy(logits, x[1:], reduction="sum"))
    return nats / n_bytes / math.log(2)
