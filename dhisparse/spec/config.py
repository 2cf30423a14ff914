"""`SpecConfig`: the speculative-decoding settings (CLI flags in brackets), validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse.spec.ring import ring_rows

ALGORITHMS = ("dflash", "dflash2", "dspark", "mtp", "ngram", "oracle")
COSTED = ("dflash", "dflash2", "dspark", "mtp")  # network drafters a costed oracle can run (oracle_drafter)
ALIASES = {"nextn": "mtp"}  # SGLang's name for the same drafter
POLICIES = ("fixed", "static", "online")
DEFAULT_WINDOW = 2048  # W of random-weight drafters (and of a full-attention one without a context length)


class SpecConfigError(ValueError):
    """A speculative setting with a bad value; the message names the flag and the fix."""


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings.

    algorithm [--speculative-algorithm]: dflash (block drafter, fixed width; a DFlash2 or DSpark
        checkpoint brings its selector / sequential head), dflash2 (DFlash2: grouped dynamic
        convolutions and the candidate selector), dspark (DFlash backbone + DSpark's sequential head
        and confidence-scheduled width per request), mtp (alias nextn: the target checkpoint's own
        MTP block, chained; spec/mtp.py), ngram (prompt lookup), oracle (benchmark-only replay of a
        reference run).
    num_draft_tokens [--speculative-num-draft-tokens]: K_max, the most target queries per request
        and round, anchor included (>= 2).
    draft_window_size [--speculative-draft-window-size]: W, committed positions the drafter sees;
        None = the drafter's own (a checkpoint's sliding window, the whole context when a layer
        attends to all of it, 2048 for random weights).
    max_context: the engine's max_model_len (set by the engine): the window of a full-attention drafter.
    page_size [--page-size]: p, ring rows are page-rounded (eq. 9).
    block_size [--speculative-dflash-block-size]: DFlash block; None = the checkpoint's, or
        num_draft_tokens for random weights. May exceed K_max (the drafter drafts the whole block,
        the engine verifies at most K_max).
    draft_model_path [--speculative-draft-model-path]: DFlash checkpoint folder; None = seeded
        random weights (dflash / dspark).
    ngram_min_n / ngram_max_n: suffix lengths the n-gram drafter tries, longest first.
    oracle_corrupt_rate / oracle_tokens_per_round: oracle calibration, give at most one.
    oracle_drafter [--speculative-oracle-drafter]: with the oracle, a network drafter (dflash,
        dflash2, dspark, mtp) that runs every round for its cost and memory while the oracle's
        tokens replace its drafts (`CostedOracle`, a measurement tool); None: the plain oracle.
    policy: fixed (always `fixed_width` or K_max), static (width by concurrency), online.
    static_schedule / static_default_width: ((max concurrency, width), ...), width above them all.
    fixed_width: width for the fixed policy; None = K_max.
    online_widths: the widths (>= 2) the online policy chooses among; None = the powers of two below
        K_max and K_max itself (8 -> 2, 4, 8). Every one is a whole-step graph family captured before
        serving: on the H200 all of 1..8 took 112 graphs and 166 s of start-up (session 21), so the
        default keeps eq. 13's choice to a coarse set (ours: the paper does not say which widths).
    seed: drafter weights and corruption / draft sampling streams.
    """

    algorithm: str = "dflash"
    num_draft_tokens: int = 8
    draft_window_size: int | None = None
    page_size: int = 64
    block_size: int | None = None
    draft_model_path: str | None = None
    ngram_min_n: int = 2
    ngram_max_n: int = 4
    oracle_corrupt_rate: float | None = None
    oracle_tokens_per_round: float | None = None
    oracle_drafter: str | None = None
    policy: str = "fixed"
    static_schedule: tuple[tuple[int, int], ...] = ((32, 8), (127, 6))
    static_default_width: int = 4
    fixed_width: int | None = None
    online_widths: tuple[int, ...] | None = None
    seed: int = 0
    max_context: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithm", ALIASES.get(self.algorithm, self.algorithm))
        object.__setattr__(self, "static_schedule", tuple(tuple(s) for s in self.static_schedule))
        if self.online_widths is not None:
            object.__setattr__(self, "online_widths", tuple(sorted(set(self.online_widths))))
        self._check_choices()
        self._check_sizes()
        self._check_widths()
        self._check_oracle()

    def round_widths(self) -> tuple[int, ...]:
        """Widths a whole verification round can run at under this policy (1: a plain decode
        step): what the whole-step graphs capture before serving, so no policy change captures
        mid-window. fixed: {1, width}; static: 1 and the schedule's widths capped at K_max;
        online: 1 and `online_candidates()` (eq. 13 may pick any of them)."""
        k = self.num_draft_tokens
        if self.policy == "online":
            return (1, *self.online_candidates())
        if self.policy == "static":
            return tuple(sorted({1, *(min(w, k) for _, w in self.static_schedule), min(self.static_default_width, k)}))
        return tuple(sorted({1, self.fixed_width or k}))

    def online_candidates(self) -> tuple[int, ...]:
        """The widths (>= 2, ascending) the online policy prices each round: `online_widths`, or
        the powers of two below K_max and K_max itself."""
        if self.online_widths is not None:
            return self.online_widths
        k = self.num_draft_tokens
        return tuple(sorted({*(1 << i for i in range(1, k.bit_length()) if 1 << i < k), k}))

    def _check_choices(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise SpecConfigError(
                f"--speculative-algorithm must be one of {', '.join(ALGORITHMS)}; got {self.algorithm!r}"
            )
        if self.policy not in POLICIES:
            raise SpecConfigError(f"speculative policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")

    def _check_sizes(self) -> None:
        if self.num_draft_tokens < 2:
            raise SpecConfigError(
                f"--speculative-num-draft-tokens must be >= 2 (anchor + at least one draft); "
                f"got {self.num_draft_tokens}"
            )
        if self.page_size < 1:
            raise SpecConfigError(f"--page-size must be >= 1; got {self.page_size}")
        if self.block_size is not None and self.block_size < 2:
            raise SpecConfigError(f"--speculative-dflash-block-size must be >= 2; got {self.block_size}")
        self.check_block(self.block)
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise SpecConfigError(
                f"n-gram sizes need 1 <= ngram_min_n <= ngram_max_n; got {self.ngram_min_n}, {self.ngram_max_n}"
            )

    def _check_widths(self) -> None:
        schedule = [w for _, w in self.static_schedule] + [self.static_default_width]
        for w in schedule:  # schedule widths are capped at K_max when used
            if w < 1:
                raise SpecConfigError(f"verification widths must be >= 1; got {w}")
        for w in [self.fixed_width] if self.fixed_width is not None else []:
            if w < 1:
                raise SpecConfigError(f"verification widths must be >= 1; got {w}")
            if w > self.num_draft_tokens:
                raise SpecConfigError(
                    f"verification width {w} is larger than K_max = --speculative-num-draft-tokens "
                    f"{self.num_draft_tokens}; lower the width or raise --speculative-num-draft-tokens"
                )
        for w in self.online_widths or ():
            if not 2 <= w <= self.num_draft_tokens:
                raise SpecConfigError(f"online_widths must lie in [2, K_max = --speculative-num-draft-tokens "
                                      f"{self.num_draft_tokens}]; got {w}")
        bounds = [c for c, _ in self.static_schedule]
        if bounds != sorted(bounds):
            raise SpecConfigError(f"static_schedule concurrency bounds must increase; got {bounds}")

    def _check_oracle(self) -> None:
        if self.oracle_drafter is not None and (self.algorithm != "oracle" or self.oracle_drafter not in COSTED):
            raise SpecConfigError(f"--speculative-oracle-drafter needs --speculative-algorithm oracle and one of "
                                  f"{', '.join(COSTED)}; got {self.oracle_drafter!r} with {self.algorithm!r}")
        if self.oracle_corrupt_rate is not None and self.oracle_tokens_per_round is not None:
            raise SpecConfigError("give oracle_corrupt_rate or oracle_tokens_per_round, not both")
        if self.oracle_corrupt_rate is not None and not 0.0 <= self.oracle_corrupt_rate <= 1.0:
            raise SpecConfigError(f"oracle_corrupt_rate must be in [0, 1]; got {self.oracle_corrupt_rate}")
        t = self.oracle_tokens_per_round
        if t is not None and not 1.0 <= t <= self.width_for_oracle:
            raise SpecConfigError(
                f"oracle_tokens_per_round must be in [1, {self.width_for_oracle}] (the width); got {t}"
            )

    # ---- derived -------------------------------------------------------------------------------
    @property
    def block(self) -> int:
        """Draft block width: block_size, or K_max when unset."""
        return self.block_size if self.block_size is not None else self.num_draft_tokens

    @property
    def width_for_oracle(self) -> int:
        return self.fixed_width if self.fixed_width is not None else self.num_draft_tokens

    @property
    def ring_rows(self) -> int:
        """R_d of eq. 9 for this window and page, with the block of max(K_max, block) positions."""
        return ring_rows(self.draft_window_size or DEFAULT_WINDOW, self.page_size, max(self.num_draft_tokens, self.block))

    def check_block(self, block: int) -> None:
        """Raise when the draft window cannot hold one block (also used for a checkpoint's block)."""
        if self.draft_window_size is not None and self.draft_window_size < block:
            raise SpecConfigError(
                f"--speculative-draft-window-size {self.draft_window_size} is smaller than the draft block "
                f"({block}); use a window of at least {block} positions"
            )
