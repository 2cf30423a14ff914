"""Case construction for bench/resolver_bench.py: the pinned region, row spaces, states, selections."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch

from dhisparse.kernels.resolver import launch_copies, plan_triton
from dhisparse.kernels.resolver_ref import ResolverState, miss_order_for, plan_reference, with_hot_entry

_DTYPE = {656: torch.float16, 1152: torch.bfloat16}


@dataclass
class Case:
    name: str
    rb: int
    state: ResolverState
    sel: torch.Tensor  # [N, K, k]
    slots: torch.Tensor  # [N]
    history: int
    meta: dict = field(default_factory=dict)
    dev_rows: int = 0  # device rows this case's locations address (0: the rig's default)


def fit(xs: list[float], ys: list[float]) -> dict:
    """Least squares y = a + b x (x bytes, y ms): rate 1/b in GB/s, R^2."""
    n = len(xs)
    if n < 2:
        return {"GBps": float("nan"), "r2": float("nan"), "intercept_ms": float("nan")}
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx if sxx else float("nan")
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return {"GBps": 1.0 / (b * 1e6) if b > 0 else float("nan"), "r2": 1 - res / ss if ss else float("nan"),
            "intercept_ms": a}


class Rig:
    """Pinned host region (>= 4 GiB on GPU), per-row-size views, device row spaces, case builder."""

    def __init__(self, quick: bool, region: int = 0):
        self.cuda = torch.cuda.is_available()
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        self.quick = quick
        if quick:
            self.N, self.K, self.k, self.B, self.ps, self.L = 2, 2, 16, 32, 4, 128
            self.histories, region_default = (64, 128, 256, 1024), 4 << 20
        else:
            self.N, self.K, self.k, self.B, self.ps, self.L = 32, 8, 2048, 4096, 64, 65536
            self.histories, region_default = (8192, 32768, 131072, 524288), 4 << 30
        self.TT = 2 * self.ps
        region = region or region_default
        self.region = torch.empty(region, dtype=torch.uint8, pin_memory=self.cuda)
        self.g = torch.Generator(device=self.dev).manual_seed(0)
        self._dev_rows: dict[int, torch.Tensor] = {}
        self._filled = False

    def shape_doc(self) -> dict:
        return {"N": self.N, "K": self.K, "k": self.k, "B": self.B, "host_page": self.ps, "history": self.L,
                "region_bytes": self.region.numel(), "histories_nomiss": list(self.histories)}

    def host_rows(self, rb: int) -> torch.Tensor:
        """[HP, ps, W] view of the pinned region for rows of rb bytes."""
        dt = _DTYPE.get(rb, torch.uint8)
        W = rb // torch.empty(0, dtype=dt).element_size()
        hp = self.region.numel() // (rb * self.ps)
        return self.region[: hp * self.ps * rb].view(dt).view(hp, self.ps, W)

    def dev_rows(self, rb: int, rows: int = 0) -> torch.Tensor:
        """[P, 64, W] device rows (at least `rows`, default N * (B + TT)), filled with 0xA5."""
        rows = rows or self.N * (self.B + self.TT)
        if (rb, rows) not in self._dev_rows:
            h = self.host_rows(rb)
            t = torch.empty((rows // 64 + 1, 64, h.shape[-1]), dtype=h.dtype, device=self.dev)
            t.view(torch.uint8).fill_(0xA5)
            self._dev_rows[(rb, rows)] = t
        return self._dev_rows[(rb, rows)]

    def fill(self, rb: int) -> None:
        """Random bytes in the region (once) and a distinct pattern in the device rows."""
        if not self._filled:
            chunk = 256 << 20
            for o in range(0, self.region.numel(), chunk):
                part = self.region[o: o + chunk]
                part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, device=self.dev,
                                         generator=self.g), non_blocking=False)
            self._filled = True
        for (b, _), t in self._dev_rows.items():
            if b == rb:
                t.view(torch.uint8).fill_(0xA5)

    def ceiling_counts(self) -> list[int]:
        return [self.N * self.k // 4, self.N * self.k, self.N * self.B]

    # -- states and selections -----------------------------------------------------------------
    def _randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, device=self.dev, generator=self.g)

    def state(self, rb: int, L: int, direct: bool = False, N: int = 0, B: int = 0, rows: int = 0) -> ResolverState:
        """N requests (default the rig's) with B hot slots; device locations (hot rows, then tail rows)
        wrap at `rows` when given. direct: every history position ready in the optional map."""
        N, B, ps, TT = N or self.N, B or self.B, self.ps, self.TT
        hp = self.host_rows(rb).shape[0]
        ppr = hp // N  # host pages per request region
        pages = -(-L // ps)
        table = torch.stack([s * ppr + (self._randperm(ppr)[:pages] if pages <= ppr
                                        else torch.arange(pages, device=self.dev) % ppr) for s in range(N)])
        dev = dict(dtype=torch.int64, device=self.dev)
        wrap = rows or N * (B + TT)
        hot_loc = torch.arange(N * B, **dev).view(N, B) % wrap
        tail_loc = (N * B + torch.arange(N * TT, **dev).view(N, TT)) % wrap
        dmap = None
        if direct:  # every history position ready on device (rows reused: never read here)
            dmap = torch.arange(L, **dev).repeat(N, 1) % min(N * B, wrap)
        return ResolverState(torch.full((N, B), -1, **dev), torch.full((N, B), -1, **dev), hot_loc,
                             torch.full((N,), L, **dev), tail_loc, table, ps, dmap)

    def selection(self, kind: str, K: int, L: int, N: int = 0, k: int = 0) -> torch.Tensor:
        """[N, K, k] positions < L (default N, k: the rig's). shared: one set for all queries;
        partial: 90% common + 10% own; disjoint: no position shared between queries."""
        N, k = N or self.N, k or self.k
        own = {"shared": 0, "partial": max(1, k // 10), "disjoint": k}[kind] if K > 1 else 0
        common = k - own
        out = torch.empty((N, K, k), dtype=torch.int64, device=self.dev)
        for n in range(N):
            p = self._randperm(L)[: common + K * own]
            for q in range(K):
                row = torch.cat([p[:common], p[common + q * own: common + (q + 1) * own]])
                out[n, q] = row[self._randperm(k)]
        return out

    def warm(self, st: ResolverState, sel: torch.Tensor, miss_share: float, L: int) -> None:
        """Fill every hot slot: a (1 - miss_share) part of each request's union plus unselected
        positions; random stamps. miss_share 1.0 on an empty cache = cold."""
        B = st.hot_pos.shape[1]
        for n in range(sel.shape[0]):
            u = torch.unique(sel[n][sel[n] >= 0])
            u = u[self._randperm(u.numel())]
            keep = int(round((1 - miss_share) * min(u.numel(), B)))
            others = self._randperm(L)
            others = others[~torch.isin(others, u)][: B - keep]
            pos = torch.cat([u[:keep], others])
            perm = self._randperm(B)
            st.hot_pos[n, perm[: pos.numel()]] = pos
            st.hot_stamp[n] = torch.randint(0, 100, (B,), device=self.dev, generator=self.g)

    def cases(self, rb: int) -> list[Case]:
        L, K = self.L, self.K
        slots = torch.arange(self.N, device=self.dev)
        out = []

        def add(name, sel, miss_share, hist=L, direct=False, cold=False, **meta):
            st = self.state(rb, hist, direct)
            if not cold:
                self.warm(st, sel, miss_share, hist)
            out.append(Case(name, rb, st, sel, slots, hist, {"miss_share": miss_share, "cold": cold, **meta}))

        for kind, kq in (("partial", K), ("shared", K), ("disjoint", K), ("single", 1)):
            sel = self.selection(kind if kq > 1 else "shared", kq, L)
            add(f"miss_{kind}_K{kq}_cold", sel, 1.0, cold=True, sharing=kind)
            for f in (0.5, 0.1):
                add(f"miss_{kind}_K{kq}_warm{int(f * 100)}", sel, f, sharing=kind)
        for h in self.histories:
            add("nomiss", self.selection("partial", K, h), 0.0, hist=h, sharing="partial")
        sel = self.selection("partial", K, L)
        add("direct_all", sel, 0.0, direct=True, cold=True, sharing="partial")
        add("hot_all", sel, 0.0, sharing="partial")
        one = self.selection("shared", 1, L)
        add("dedup_K1", one, 1.0, cold=True, sharing="single")
        add("dedup_K8_identical", one.expand(-1, K, -1).contiguous(), 1.0, cold=True, sharing="identical")
        return out


def state_restorer(st: ResolverState, after=None):
    """A function that puts st's mutated tables (hot_pos, hot_stamp and a hot_entry index) back as they
    are now, then calls `after` (an L2 flush), so every timed call plans the same input."""
    snap = [(t, t.clone()) for t in (st.hot_pos, st.hot_stamp, st.hot_entry) if t is not None]

    def restore() -> None:
        for t, v in snap:
            t.copy_(v)
        if after is not None:
            after()
    return restore


def index_case(case: Case) -> Case:
    """The same case on a copy of its state with the hot_entry index (the plan looks hits up)."""
    return dataclasses.replace(case, state=with_hot_entry(copy.deepcopy(case.state)), name=case.name + "_index")


def cpu_copy(st: ResolverState) -> ResolverState:
    """A copy of st on the CPU (a copy there too: `plan_reference` updates the state it is given)."""
    cpu = lambda v: v.to("cpu", copy=True) if torch.is_tensor(v) else v  # noqa: E731
    return ResolverState(**{f.name: cpu(getattr(st, f.name)) for f in dataclasses.fields(st)})


def case_order(case: Case) -> str:
    """The miss order the engine's resolver step plans a call of this shape in, for one top-k query a
    request (distinct): `resolver_ref.miss_order_for`."""
    return miss_order_for(case.sel.shape[0], case.sel.shape[1] * case.sel.shape[2], True)


def check_case(rig: Rig, case: Case, distinct: bool = False, miss_order: str = "host") -> dict:
    """plan_triton (with `distinct` and `miss_order` as the timed calls pass them) vs plan_reference (on CPU
    copies) bit for bit, then every copied row's bytes; `fused`: the plan with its copy fused (`copy=`) gives the
    same locations, state and device rows as plan + `launch_copies`."""
    st_t = copy.deepcopy(case.state)
    st_r = cpu_copy(case.state)
    now = int(case.state.hot_stamp.max()) + 1
    ref = plan_reference(case.sel.cpu(), case.slots.cpu(), st_r, now, miss_order=miss_order)
    got = plan_triton(case.sel, case.slots, st_t, now, distinct=distinct, miss_order=miss_order)
    same = {"loc": torch.equal(ref.loc, got.loc.cpu()), "copy_src": torch.equal(ref.copy_src, got.copy_src.cpu()),
            "copy_dst": torch.equal(ref.copy_dst, got.copy_dst.cpu()), "counters": ref.counters == got.counters,
            "hot_pos": torch.equal(st_r.hot_pos, st_t.hot_pos.cpu()),
            "hot_stamp": torch.equal(st_r.hot_stamp, st_t.hot_stamp.cpu())}
    if st_r.hot_entry is not None:  # the lookup path: its index kept the inverse of hot_pos
        same["hot_entry"] = torch.equal(st_r.hot_entry, st_t.hot_entry.cpu())
    host, dev = rig.host_rows(case.rb), rig.dev_rows(case.rb, case.dev_rows)
    dev_f, st_f = dev.clone(), copy.deepcopy(case.state)  # the fused plan + copy (one launch) on the same input
    fused = plan_triton(case.sel, case.slots, st_f, now, distinct=distinct, copy=(host, dev_f), miss_order=miss_order)
    launch_copies(got, host, dev)
    same["fused"] = bool(torch.equal(fused.loc, got.loc) and torch.equal(st_f.hot_pos, st_t.hot_pos)
                         and torch.equal(dev_f.view(torch.uint8), dev.view(torch.uint8)))
    hf, df = host.reshape(-1, host.shape[-1]), dev.reshape(-1, dev.shape[-1])
    src = got.copy_src.cpu()
    same["rows"] = bool(torch.equal(df[got.copy_dst].cpu().view(torch.uint8), hf[src].view(torch.uint8)))
    same["case"], same["copies"] = case.name, int(src.numel())
    return same


# -- Fig. 8 (b), (c) and the GLM direct-vs-scan pair ---------------------------------------------------

def fig8_shapes(quick: bool) -> dict:
    """(b)/(c): DeepSeek-V4.1-Flash single query (K=1, k=512) at batches 8 and 160, B swept, B_ref the
    (c) and direct-vs-scan point; (c) adds `miss` host misses per request. glm: K=8 partial, k=2048,
    batch 32, B=4096 (also K=1). Quick: tiny shapes for the CPU interpreter."""
    if quick:
        return {"batches": (2, 3), "Bs": (16, 32, 64), "B_ref": 32, "k": 8, "miss": 2, "L": 256,
                "glm": {"N": 2, "k": 16, "B": 32, "Ks": (2, 1), "L": 128}}
    return {"batches": (8, 160), "Bs": (2048, 4096, 8192, 16384, 32768), "B_ref": 4096, "k": 512, "miss": 77,
            "L": 32768, "glm": {"N": 32, "k": 2048, "B": 4096, "Ks": (8, 1), "L": 65536}}


def fig8_specs(quick: bool) -> list[tuple[int, int]]:
    """Distinct (K*k, B) kernel shapes of the Fig. 8 cases (one compiled specialization each)."""
    sh = fig8_shapes(quick)
    g = sh["glm"]
    return [(sh["k"], B) for B in sh["Bs"]] + [(K * g["k"], g["B"]) for K in g["Ks"]]


def fig8_cases(rig: Rig, rb: int, quick: bool, only: tuple[int, int] | None = None):
    """Yield Fig. 8 cases one at a time (the large ones are built only when reached). Names:
    fig8b_scan_N{N}_B{B} (every selected row in the hot cache, none direct), fig8b_direct_N{N}_B{B}
    (every row in the optional map; warm cache, untouched), fig8c_miss{m}_N{N} (m of the k rows per
    request not cached: evict LRU victims, copied from host), glm_scan_K{K} / glm_direct_K{K}.
    only=(K*k, B): just the cases of that kernel shape (used to precompile)."""
    sh = fig8_shapes(quick)
    k, L, miss = sh["k"], sh["L"], sh["miss"]
    rows_c = max(sh["batches"]) * (sh["B_ref"] + rig.TT)  # device rows (c) copies into; others wrap
    for B in sh["Bs"]:
        if only not in (None, (k, B)):
            continue
        for N in sh["batches"]:
            slots = torch.arange(N, device=rig.dev)
            sel = rig.selection("shared", 1, L, N=N, k=k)
            meta = {"fig8": "b", "batch": N, "sharing": "single"}
            for kind, direct in (("scan", False), ("direct", True)):
                st = rig.state(rb, L, direct, N=N, B=B, rows=rows_c)
                rig.warm(st, sel, 0.0, L)
                yield Case(f"fig8b_{kind}_N{N}_B{B}", rb, st, sel, slots, L,
                           {**meta, "path": kind, "miss_share": 0.0, "cold": False}, rows_c)
            if B == sh["B_ref"]:
                st = rig.state(rb, L, N=N, B=B, rows=rows_c)
                rig.warm(st, sel, miss / k, L)
                yield Case(f"fig8c_miss{miss}_N{N}", rb, st, sel, slots, L,
                           {**meta, "fig8": "c", "path": "scan", "miss_share": miss / k, "cold": False}, rows_c)
    g = sh["glm"]
    for K in g["Ks"]:
        if only not in (None, (K * g["k"], g["B"])):
            continue
        sel = rig.selection("partial" if K > 1 else "shared", K, g["L"], N=g["N"], k=g["k"])
        slots = torch.arange(g["N"], device=rig.dev)
        for kind, direct in (("scan", False), ("direct", True)):
            st = rig.state(rb, g["L"], direct, N=g["N"], B=g["B"])
            rig.warm(st, sel, 0.0, g["L"])
            yield Case(f"glm_{kind}_K{K}", rb, st, sel, slots, g["L"],
                       {"fig8": "glm", "batch": g["N"], "path": kind, "miss_share": 0.0, "cold": False,
                        "sharing": "partial" if K > 1 else "single"}, g["N"] * (g["B"] + rig.TT))
