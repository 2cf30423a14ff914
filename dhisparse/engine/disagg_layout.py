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

Expert parallelism inside each role (SGLang's per-role `--enable-dp-attention --ep-size E`; one flag
set here serves both roles): `--ep-size E --enable-dp-attention`, E dividing P and D (E == P == D:
each role one EP group, as an SGLang server per role). The ranks of a role form EP groups of E
consecutive ranks, [0, E), [E, 2E), ... (P % E == 0, so no group spans the roles); attention stays
data-parallel (every rank its own requests and KV), each rank holds 1/E of the routed experts and
the MoE exchanges and lock-step run inside its group. `--tp-size` / `--dp-size` may repeat E (SGLang's
spelling of DP attention) or stay 1. Refused, with the flag named: E not dividing P or D, --ep-size
without --enable-dp-attention, --tp-size / --dp-size inside a role otherwise (TP, DP x TP).
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
    ep_size: int = 1
    enable_dp_attention: bool = False
    tp_size: int = 1
    dp_size: int = 1

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
            self._check_roles()

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

    def _check_roles(self) -> None:
        """Parallelism inside a role: DP attention with EP groups of E ranks (module docstring)."""
        sizes = f"--disaggregation-prefill-size {self.prefill} --disaggregation-decode-size {self.decode}"
        if self.enable_dp_attention:
            for v, flag in ((self.tp_size, "--tp-size"), (self.dp_size, "--dp-size")):
                if v not in (1, self.ep_size):
                    raise DisaggConfigError(f"{flag} {v} inside a role with --enable-dp-attention --ep-size "
                                            f"{self.ep_size}: give {flag} {self.ep_size} (SGLang's spelling) or leave it out; "
                                            "attention TP and MoE TP inside a role are not built")
        else:
            for v, flag in ((self.ep_size, "--ep-size"), (self.tp_size, "--tp-size"), (self.dp_size, "--dp-size")):
                if v != 1:
                    raise DisaggConfigError(
                        f"prefill/decode disaggregation with {flag} {v}: inside a role only DP attention with experts "
                        f"sharded is built (--ep-size E --enable-dp-attention, E dividing both role sizes); the role "
                        f"sizes set the ranks ({sizes})")
        if self.prefill % self.ep_size or self.decode % self.ep_size:
            raise DisaggConfigError(f"--ep-size {self.ep_size} must divide both role sizes ({sizes}): each role's ranks "
                                    "form EP groups of --ep-size ranks")

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1

    @property
    def ep_blocks(self) -> list[range]:
        """The EP groups' global ranks, in the order every rank creates them: [0, E), [E, 2E), ..."""
        E = self.ep_size
        return [range(a, a + E) for a in range(0, self.world_size, E)]

    def ep_rank(self, rank: int) -> int:
        """A rank's index inside its EP group (its expert block: experts [i * n/E, (i + 1) * n/E))."""
        return rank % self.ep_size

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
