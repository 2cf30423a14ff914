"""Training a DFlash2 block drafter on the TARGET's own greedy outputs (issue 29), in our own words.

Data: seeded random windows of the training token stream are prompts; the frozen target extends
each greedily -> sequences [n, P + G]. The target's features are its layer outputs (layer i's
residual stream after layer i, before the final norm: exactly what the engine captures for
`capture_layers`, dhisparse/models/dsa.py) at the drafter's `target_layer_ids`, concatenated.

One training example is a round as the engine drafts it (dhisparse/spec/dflash.py): an anchor at
position n >= P (a target greedy token, the last emitted one), the n committed positions before
it as context (their features, positions max(0, n - W)..n - 1), the block [x_n, mask * (B - 1)] at
positions n..n + B - 1 embedded with the target's table; block row i (1..B-1) predicts the
target's greedy token at position n + i. The forward calls the very `DFlashModel.context_kv` /
`block_hidden` / `logits` code the engine runs (without their inference-mode wrapper).

Loss = cross-entropy of the draft rows vs the greedy tokens (mean over rows inside the sequence)
+ the selector's loss. The `dflash` reference ships no training code, so the candidate selector
is trained by teacher forcing: at row i its predecessor is the true token of row i - 1 (the anchor
for i = 1), which is what greedy inference conditions on whenever rows < i were accepted (and
acceptance stops at the first miss); its scores over the drafter's top-k candidates (drafter
logits and hidden detached, so the two losses train separate weights) are trained with
cross-entropy towards the greedy token, on rows where that token is among the candidates.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
from torch.nn import functional as F

from dhisparse.spec.config import DEFAULT_WINDOW
from dhisparse.spec.dflash_config import DFlashConfig, default_target_layer_ids
from dhisparse.spec.dflash_io import save_dflash
from dhisparse.spec.dflash_model import DFlashModel
from dhisparse.spec.factory import RANDOM_SELECTOR
from dhisparse.train.corpus import Corpus
from dhisparse.train.dsa import load_target, logged, optimizer_step
from dhisparse.train.records import write_record

# the engine's own drafter code without its torch.inference_mode wrapper (so it records gradients)
_CONTEXT_KV = DFlashModel.context_kv.__wrapped__
_BLOCK_HIDDEN = DFlashModel.block_hidden.__wrapped__


class DrafterData(NamedTuple):
    """seqs [n, L] int64 (prompt + greedy continuation); feats [n, L, F*H]; prompt_len P."""

    seqs: torch.Tensor
    feats: torch.Tensor
    prompt_len: int


@dataclass
class DrafterResult:
    steps: int
    loss: list[float] = field(default_factory=list)
    draft_loss: list[float] = field(default_factory=list)
    selector_loss: list[float] = field(default_factory=list)


def _device(target) -> torch.device:
    return target.lm_head.weight.device


@torch.no_grad()
def greedy_data(target, tokens: torch.Tensor, n_seqs: int, prompt_len: int, gen_len: int, seed: int,
                device: str | torch.device = "cpu", batch: int = 32) -> torch.Tensor:
    """tokens [T] int64 -> [n_seqs, prompt_len + gen_len] int64 (cpu): seeded random prompt windows,
    each extended by the target's argmax token gen_len times (full forward per token, no cache)."""
    if tokens.numel() <= prompt_len:
        raise ValueError(f"the token stream has {tokens.numel()} tokens, fewer than one prompt of {prompt_len + 1}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - prompt_len, (n_seqs,), generator=g).tolist()
    prompts = torch.stack([tokens[s:s + prompt_len] for s in starts])
    out = []
    for chunk in prompts.split(batch):
        x = chunk.to(device)
        for _ in range(gen_len):
            x = torch.cat([x, target(input_ids=x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        out.append(x.cpu())
    return torch.cat(out)


@torch.no_grad()
def target_features(target, seqs: torch.Tensor, layer_ids: tuple[int, ...], batch: int = 32) -> torch.Tensor:
    """seqs [n, L] -> [n, L, F*H] (cpu, target dtype): outputs of decoder layers `layer_ids` (caught
    by forward hooks; transformers' hidden_states[i + 1] equals them except for the last layer,
    whose entry is final-normed), concatenated in layer_ids order."""
    caught: dict[int, torch.Tensor] = {}
    layers = target.model.layers

    def hook(i):
        return lambda mod, args, out: caught.__setitem__(i, out[0] if isinstance(out, tuple) else out)

    handles = [layers[i].register_forward_hook(hook(i)) for i in sorted(set(layer_ids))]
    try:
        out = []
        for chunk in seqs.split(batch):
            target(input_ids=chunk.to(_device(target)))
            out.append(torch.cat([caught[i] for i in layer_ids], dim=-1).cpu())
    finally:
        for h in handles:
            h.remove()
    return torch.cat(out)


def drafter_config(target_config, block_size: int, layers: int, *, target_layer_ids=None,
                   window: int = DEFAULT_WINDOW, heads: int | None = None) -> DFlashConfig:
    """A small DFlash2 config for a transformers target config: hidden / vocab / eps the target's
    (embedding and LM head are the target's), non-causal sliding layers of `window`, the factory's
    DFlash2 convolution / selector shape; layer ids default to `default_target_layer_ids` (deduplicated)."""
    hidden, n_target = target_config.hidden_size, target_config.num_hidden_layers
    heads = heads or target_config.num_attention_heads
    ids = target_layer_ids or tuple(dict.fromkeys(default_target_layer_ids(n_target, layers)))
    group = RANDOM_SELECTOR["conv_group_size"] if hidden % RANDOM_SELECTOR["conv_group_size"] == 0 else 1
    return DFlashConfig(**dict(RANDOM_SELECTOR, conv_group_size=group),
        num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=heads,
        head_dim=max(2, hidden // heads // 2 * 2), intermediate_size=2 * hidden, vocab_size=target_config.vocab_size,
        target_layer_ids=tuple(ids), block_size=block_size, mask_token_id=target_config.pad_token_id or 0,
        rms_norm_eps=target_config.rms_norm_eps, num_target_layers=n_target, sliding_window=window, is_causal=False)


def new_drafter(cfg: DFlashConfig, seed: int) -> DFlashModel:
    """Seeded random init (`DFlashModel.init_random`), fp32, cpu."""
    model = DFlashModel(cfg)
    model.init_random(torch.Generator().manual_seed(seed))
    return model


def block_forward(model: DFlashModel, target, feats: torch.Tensor, anchors: torch.Tensor,
                  starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """feats [N, L, F*H] (positions 0..L-1); anchors [N] (token at position starts[N]); starts [N] = n,
    the committed count -> (hidden [N, B-1, H], fp32 logits [N, B-1, V]) of block rows 1..B-1.
    Context = positions max(0, n - W)..n - 1, as `DFlashDrafter._gather_context` reads them."""
    cfg, dev = model.cfg, model.fc.weight.device
    n, length, _ = feats.shape
    anchors, starts = anchors.to(dev), starts.to(dev)
    ctx_pos = torch.arange(length, device=dev).expand(n, length)
    window = cfg.context_window or DEFAULT_WINDOW
    valid = (ctx_pos < starts[:, None]) & (ctx_pos >= starts[:, None] - window)
    kv = _CONTEXT_KV(model, feats.reshape(n * length, -1), ctx_pos.reshape(-1))
    ctx = [(k.view(n, length, *k.shape[1:]), v.view(n, length, *v.shape[1:])) for k, v in kv]
    ids = torch.full((n, cfg.block_size), cfg.mask_token_id, dtype=torch.int64, device=dev)
    ids[:, 0] = anchors
    positions = starts[:, None] + torch.arange(cfg.block_size, device=dev)[None, :]
    with torch.no_grad():
        x = target.model.embed_tokens(ids).to(model.fc.weight.dtype) * cfg.input_embedding_scale
    hidden = _BLOCK_HIDDEN(model, x, positions, ctx, valid, ctx_pos)[:, 1:]
    return hidden, model.logits(hidden, target.lm_head)


def block_labels(seqs: torch.Tensor, starts: torch.Tensor, block: int) -> torch.Tensor:
    """seqs [N, L]; starts [N] -> labels [N, B-1]: seqs[:, n + 1..n + B - 1], -100 past the end."""
    idx = starts[:, None] + torch.arange(1, block)[None, :]
    inside = idx < seqs.shape[1]
    return torch.where(inside, seqs.gather(1, idx.clamp(max=seqs.shape[1] - 1)), torch.full_like(idx, -100))


def selector_loss(model: DFlashModel, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
                  labels: torch.Tensor) -> torch.Tensor:
    """Teacher-forced selector cross-entropy (module docstring). hidden [N, K, H], logits [N, K, V],
    anchors [N], labels [N, K] (-100 = ignore) -> scalar."""
    sel = model.candidate_selector
    unary, cand = torch.topk(logits.detach(), min(sel.top_k, logits.shape[-1]), dim=-1)  # [N, K, k]
    prev = torch.cat([anchors[:, None].to(labels.device), labels[:, :-1].clamp(min=0)], dim=1)  # [N, K]
    pair = sel.predecessor_codebook(prev) * sel.hidden_projection(hidden.detach())  # [N, K, r]
    scores = unary + torch.einsum("nkr,nkjr->nkj", pair, sel.successor_codebook(cand)).float()
    hit = cand == labels[..., None]
    target = torch.where(hit.any(-1) & (labels >= 0), hit.float().argmax(-1), torch.full_like(labels, -100))
    if not bool((target >= 0).any()):
        return scores.sum() * 0.0
    return F.cross_entropy(scores.flatten(0, 1), target.flatten(), ignore_index=-100)


def _batches(data: DrafterData, batch: int, seed: int):
    """Endless seeded (seq index [N], anchor position [N]) with anchors in [P, L - 2]."""
    g = torch.Generator().manual_seed(seed)
    n, length = data.seqs.shape
    while True:
        rows = torch.randint(0, n, (batch,), generator=g)
        yield rows, torch.randint(data.prompt_len, length - 1, (batch,), generator=g)


def train_drafter(target, drafter: DFlashModel, cfg: DFlashConfig, data: DrafterData, steps: int, *, batch: int = 16,
                  lr: float = 1e-3, seed: int = 0, log_every: int = 10) -> DrafterResult:
    """AdamW on the drafter (target frozen: its embedding / LM head take no gradient); returns the
    loss curves (draft CE + selector CE, every `log_every` steps and the last)."""
    if data.seqs.shape[1] - data.prompt_len < 2:
        raise ValueError("the greedy data needs gen_len >= 2 (an anchor and one label)")
    torch.manual_seed(seed)
    dev = drafter.fc.weight.device
    flags = [(p, p.requires_grad) for p in target.parameters()]
    target.requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    result = DrafterResult(steps)
    drafter.train()
    try:
        for step, (rows, starts) in zip(range(steps), _batches(data, batch, seed)):
            seqs = data.seqs[rows]
            anchors = seqs.gather(1, starts[:, None])[:, 0]
            labels = block_labels(seqs, starts, cfg.block_size).to(dev)
            hidden, logits = block_forward(drafter, target, data.feats[rows].to(dev), anchors, starts)
            draft = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            select = selector_loss(drafter, hidden, logits, anchors.to(dev), labels) if cfg.is_dflash2 else draft * 0
            optimizer_step(opt, draft + select, list(drafter.parameters()))
            if logged(step, steps, log_every):
                result.loss.append(round(float((draft + select).detach()), 4))
                result.draft_loss.append(round(float(draft.detach()), 4))
                result.selector_loss.append(round(float(select.detach()), 4))
    finally:
        drafter.eval()
        for p, flag in flags:
            p.requires_grad_(flag)
    return result


@torch.no_grad()
def draft_tokens(model: DFlashModel, target, feats, anchors, starts, use_selector: bool = True) -> torch.Tensor:
    """Greedy drafts [N, B-1] as the engine picks them: the selector's path (DFlash2), else argmax."""
    hidden, logits = block_forward(model, target, feats, anchors, starts)
    if use_selector and model.cfg.is_dflash2:
        n = anchors.shape[0]
        sel = model.candidate_selector.select(hidden, logits, anchors.to(logits.device), [0.0] * n, [None] * n)
        return sel.tokens
    return logits.argmax(-1)


@torch.no_grad()
def eval_acceptance(model: DFlashModel, target, data: DrafterData, use_selector: bool = True,
                    batch: int = 64) -> float:
    """Held-out block accuracy: mean over every anchor n in [P, L - B] of every sequence of the
    number of leading drafts equal to the target's greedy tokens (= drafts accepted per round
    under greedy verification, the bonus token not counted)."""
    n, length = data.seqs.shape
    b = model.cfg.block_size
    pairs = [(s, a) for s in range(n) for a in range(data.prompt_len, length - b + 1)]
    if not pairs:
        raise ValueError(f"held-out sequences of {length} tokens have no full block of {b} after the prompt")
    total = 0.0
    for i in range(0, len(pairs), batch):
        rows, starts = (torch.tensor(c) for c in zip(*pairs[i:i + batch]))
        seqs = data.seqs[rows]
        anchors, labels = seqs.gather(1, starts[:, None])[:, 0], block_labels(seqs, starts, b)
        feats = data.feats[rows].to(model.fc.weight.device)
        drafts = draft_tokens(model, target, feats, anchors, starts, use_selector)
        total += float((drafts.cpu() == labels).long().cumprod(1).sum())
    return total / len(pairs)


def make_data(target, tokens: torch.Tensor, cfg: DFlashConfig, n_seqs: int, prompt_len: int, gen_len: int, seed: int,
              device: str | torch.device = "cpu") -> DrafterData:
    """Greedy sequences of the target from `tokens` [T] plus their features at cfg.target_layer_ids."""
    seqs = greedy_data(target, tokens, n_seqs, prompt_len, gen_len, seed, device)
    return DrafterData(seqs, target_features(target, seqs, cfg.target_layer_ids), prompt_len)


# ---- the `drafter` sub-command -------------------------------------------------------------------
def add_parser(subparsers):
    """`python -m dhisparse.train drafter ...` (its handler is `drafter_stage`, also set as `func`)."""
    d = subparsers.add_parser("drafter", help="a DFlash2 drafter trained on the target's greedy outputs")
    d.add_argument("--target", required=True, help="a folder written by the model stage (with tokenizer.json)")
    d.add_argument("--out", required=True, help="folder for the drafter checkpoint and drafter_record.json")
    d.add_argument("--steps", type=int, default=2000)
    d.add_argument("--batch", type=int, default=64)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--block-size", type=int, default=8)
    d.add_argument("--layers", type=int, default=2, help="draft layers")
    d.add_argument("--seqs", type=int, default=2048, help="greedy training sequences")
    d.add_argument("--eval-seqs", type=int, default=64, help="greedy held-out sequences (acceptance)")
    d.add_argument("--prompt-len", type=int, default=64)
    d.add_argument("--gen-len", type=int, default=64)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="cpu")
    d.add_argument("--heldout", type=float, default=0.05)
    d.add_argument("--max-files", type=int, default=None, help="CPU smoke mode: only the first N files")
    d.set_defaults(func=drafter_stage)
    return d


def _with_selector(model: DFlashModel, other: DFlashModel) -> DFlashModel:
    """A copy of `model` with `other`'s candidate selector."""
    out = copy.deepcopy(model)
    out.candidate_selector.load_state_dict(other.candidate_selector.state_dict())
    return out


def drafter_stage(ns, argv) -> int:
    """Run the stage: data, training, held-out acceptance trained vs untrained, checkpoint + record."""
    t0 = time.perf_counter()
    try:
        if ns.gen_len < ns.block_size:
            raise ValueError(f"--gen-len {ns.gen_len} is shorter than --block-size {ns.block_size}: "
                             "no full block to score")
        if min(ns.steps, ns.seqs, ns.eval_seqs, ns.batch, ns.prompt_len) < 1:
            raise ValueError("--steps, --seqs, --eval-seqs, --batch and --prompt-len must be >= 1")
        corpus = Corpus.build(share=ns.heldout, max_files=ns.max_files)
        tok, target = load_target(ns.target, ns.device, dtype=torch.float32, flag="--target")
        cfg = drafter_config(target.config, ns.block_size, ns.layers)
        train = torch.tensor(tok.encode(Corpus.text(corpus.train)).ids)
        held = torch.tensor(tok.encode(Corpus.text(corpus.heldout)).ids)
        data = make_data(target, train, cfg, ns.seqs, ns.prompt_len, ns.gen_len, ns.seed, ns.device)
        held_data = make_data(target, held, cfg, ns.eval_seqs, ns.prompt_len, ns.gen_len, ns.seed + 1, ns.device)
    except Exception as e:  # noqa: BLE001 - a bad folder / corpus / shape is the user's (tokenizers: plain Exception)
        print(f"error: {e}", file=sys.stderr)
        return 2
    drafter = new_drafter(cfg, ns.seed).to(ns.device)
    init = new_drafter(cfg, ns.seed).to(ns.device)
    r = train_drafter(target, drafter, cfg, data, ns.steps, batch=ns.batch, lr=ns.lr, seed=ns.seed)
    acceptance = {"trained": eval_acceptance(drafter, target, held_data),
                  "trained_argmax": eval_acceptance(drafter, target, held_data, use_selector=False),
                  "trained_untrained_selector": eval_acceptance(_with_selector(drafter, init), target, held_data),
                  "untrained": eval_acceptance(init, target, held_data)}
    save_dflash(ns.out, cfg, drafter.cpu())
    record = write_record(ns.out, "drafter_record.json", "drafter", argv, corpus=corpus.manifest(), target=str(ns.target),
                          config=cfg.to_hf(), device=str(ns.device), params=sum(p.numel() for p in drafter.parameters()),
                          train_seqs=list(data.seqs.shape), heldout_seqs=list(held_data.seqs.shape),
                          batch=ns.batch, lr=ns.lr, seed=ns.seed, **asdict(r), heldout_acceptance=acceptance,
                          seconds=round(time.perf_counter() - t0, 1))
    print(json.dumps({k: record[k] for k in ("params", "heldout_acceptance", "seconds")}))
    return 0
