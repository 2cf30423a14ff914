"""Eq. 13's prediction beside the measured ratio: does speculation pay at a load, given its memory?

At offered load C a preset decodes min(C, b) requests, b its slots (speculation's are fewer: its drafter,
ring and staging come out of the same memory as the KV pool, `--charge-spec-memory`), each emitting one
token a TPOT. Output is then about min(C, b) / TPOT, and the speculative preset s over the baseline 0 is

    Q_s / Q_0 ~ (min(C, b_s) / min(C, b_0)) * (TPOT_0 / TPOT_s)                          (eq. 13)

Below the slot bound the first factor is 1 and only the TPOTs decide; at it (C >= b_0) the memory term
b_s / b_0 enters. The paper predicts 0.96x and measures 1.00x at C256 (GLM-5, four GPUs). `eq13_rows`
states both sides for every speculative run series against its baseline at the same load, from the
series' own mean TPOT and slots: the prediction is made from quantities measured in the same windows, so
what it tests is whether output follows decoded requests over TPOT (admission waves and queueing are
what it leaves out).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Series:
    """One (label, C) series of runs: mean output tok/s, mean TPOT (ms) and the engine's request slots."""

    label: str
    concurrency: int
    tok_s: float
    tpot_ms: float | None
    slots: int | None


@dataclass(frozen=True)
class Eq13Row:
    """Eq. 13 for a speculative series against its baseline at one load."""

    label: str
    baseline: str
    concurrency: int
    slots_spec: int
    slots_base: int
    tpot_spec_ms: float
    tpot_base_ms: float
    predicted: float
    measured: float


def predicted_ratio(c: int, b_s: int, b_0: int, tpot_0: float, tpot_s: float) -> float:
    """Eq. 13's Q_s / Q_0 at offered load c (module docstring)."""
    return (min(c, b_s) / min(c, b_0)) * (tpot_0 / tpot_s)


def eq13_rows(series: list[Series], baseline: str = "hisparse") -> list[Eq13Row]:
    """One row for every speculative series (a label whose preset ends in "+spec") with a TPOT and slots,
    against the baseline series at the same load; series missing either side are skipped."""
    base = {s.concurrency: s for s in series if s.label == baseline}
    rows = []
    for s in series:
        b = base.get(s.concurrency)
        if not s.label.partition("@")[0].endswith("+spec") or b is None:
            continue
        if None in (s.tpot_ms, s.slots, b.tpot_ms, b.slots) or not s.tpot_ms or not b.tok_s:
            continue
        rows.append(Eq13Row(s.label, b.label, s.concurrency, s.slots, b.slots, s.tpot_ms, b.tpot_ms,
                            predicted_ratio(s.concurrency, s.slots, b.slots, b.tpot_ms, s.tpot_ms), s.tok_s / b.tok_s))
    return rows


def eq13_dicts(series: list[Series], baseline: str = "hisparse") -> list[dict]:
    """`eq13_rows` as JSON-ready dicts."""
    return [asdict(r) for r in eq13_rows(series, baseline)]
