"""The process layout of prefill/decode disaggregation: P prefill ranks and D decode ranks in one
torch.distributed world (engine/disagg.py runs it).

Flags: SGLang's `--disaggregation-mode {null,prefill,decode}` names the role of the ranks a process
runs when each role is started on its own host; ours, `--disaggregation-prefill-size P` and
`--disaggregation-decode-size D`, give the world (every process passes the same two):

    one host      dhisparse serve --disaggregation-prefill-size P --disaggregation-decode-size D
    several       node k of --nnodes runs ranks [k * n, (k + 1) * n), n = (P + D) / nnodes, each with
                  --dist-init-addr and --node-rank as under --dp-size, and --disaggregation-mode its role
    ranks         0 .. P-1 prefill (rank 0 also fronts the world: router, HTTP), P .. P+D-1 decode

`--disaggregation-mode prefill|decode` alone means P = D = 1. A node's ranks all have one role, so
n divides P; the mode given must be that role (a mismatch is an error naming both).
"""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse.core.parallel import ParallelConfig, ParallelConfigError

MODES = ("null", "prefill", "decode")


class DisaggConfigError(ValueError):
    """A disaggregated layout that cannot run; the message names the flag."""


@dataclass(frozen=True)
class DisaggLayout:
    """mode / prefill_size / decode_size as given (0: not given); nnodes, node_rank,
    dist_init_addr and timeout_s as for data parallelism (core/parallel.py)."""

    mode: str = "null"
    prefill_size: int = 0
    decode_size: int = 0
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise DisaggConfigError(f"--disaggregation-mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        for v, flag in ((self.prefill_size, "--disaggregation-prefill-size"),
                        (self.decode_size, "--disaggregation-decode-size")):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise DisaggConfigError(f"{flag} must be an integer >= 1; got {v!r}")
        if (self.prefill_size > 0) != (self.decode_size > 0):
            raise DisaggConfigError("--disaggregation-prefill-size and --disaggregation-decode-size go together "
                                    f"(got {self.prefill_size} and {self.decode_size}); give both")
        if self.enabled:
            self._check_nodes()

    def _check_nodes(self) -> None:
        try:
            pc = self.parallel_config()
        except ParallelConfigError as e:
            raise DisaggConfigError(str(e)) from None
        if self.nnodes == 1 and self.mode != "null":
            raise DisaggConfigError(
                f"--disaggregation-mode {self.mode} names this node's role in a world of several hosts (--nnodes > 1, "
                "--node-rank, --dist-init-addr); on one host give --disaggregation-prefill-size P "
                "--disaggregation-decode-size D and leave the mode out")
        if self.nnodes > 1:
            n = pc.ranks_per_node
            if self.prefill % n:
                raise DisaggConfigError(f"--nnodes {self.nnodes}: each host runs {n} ranks of one role, so {n} must divide "
                                        f"--disaggregation-prefill-size {self.prefill}")
            if self.mode != self.node_role:
                raise DisaggConfigError(f"--node-rank {self.node_rank} runs {self.node_role} ranks "
                                        f"{list(pc.local_ranks())}; --disaggregation-mode is {self.mode}")

    @property
    def enabled(self) -> bool:
        return self.mode != "null" or self.prefill_size > 0

    @property
    def prefill(self) -> int:
        """P, the prefill ranks (1 when only the mode is given)."""
        return self.prefill_size or 1

    @property
    def decode(self) -> int:
        """D, the decode ranks (1 when only the mode is given)."""
        return self.decode_size or 1

    @property
    def world_size(self) -> int:
        return self.prefill + self.decode

    def role_of(self, rank: int) -> str:
        return "prefill" if rank < self.prefill else "decode"

    @property
    def prefill_ranks(self) -> range:
        return range(self.prefill)

    @property
    def decode_ranks(self) -> range:
        return range(self.prefill, self.world_size)

    @property
    def node_role(self) -> str:
        """The role of this node's ranks."""
        return self.role_of(self.parallel_config().local_ranks()[0])

    def parallel_config(self) -> ParallelConfig:
        """The world as core/parallel.py lays it out (devices, local ranks, rendezvous, deadline)."""
        return ParallelConfig(dp_size=self.world_size, nnodes=self.nnodes, node_rank=self.node_rank,
                              dist_init_addr=self.dist_init_addr, timeout_s=self.timeout_s)
