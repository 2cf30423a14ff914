"""Declared contracts (issue 23): every store is a `KVStore` and every drafter a `Drafter`, the
engine and kv/ never probe names (`hasattr` / `getattr` with a literal or a default), and an
override keeps the declared signature. Each check has a mutation beside it showing it can fail."""

from __future__ import annotations

import ast
import difflib
import inspect
from pathlib import Path

import pytest

from dhisparse.core.contracts import KVStore, RowPlace, TIERS
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.spec.drafter import Drafter
from v4_engine_util import loaded_v41

ROOT = Path(__file__).resolve().parents[1] / "dhisparse"
PROBE_FREE = ("engine", "kv")  # the rooms the issue names; their stores and drafters are called, never probed


# -- the lint: no capability probes ---------------------------------------------------------------
def probes(source: str, filename: str = "<src>") -> list[str]:
    """`hasattr(...)` calls, and `getattr(x, "literal")` / `getattr(x, name, default)` calls: the
    forms that look up an optional ability by name. `getattr(self, field)` over a dataclass's
    own field names (2 arguments, a variable name) is attribute access, not a probe."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name, args = node.func.id, node.args
        literal = len(args) >= 2 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)
        if name == "hasattr" or (name == "getattr" and (literal or len(args) == 3)):
            out.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_capability_probes_in_engine_and_kv():
    found = [p for room in PROBE_FREE for f in sorted((ROOT / room).rglob("*.py"))
             for p in probes(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == [], "declare the ability in core/contracts.py (or the store's base class) instead:\n" + "\n".join(found)


def test_probe_lint_can_fail():
    bad = 'x = hasattr(store, "covers")\ny = getattr(store, "stage", None)\nz = getattr(kv, "census")\nw = getattr(a, b, 0)\n'
    ok = "v = getattr(self, name)\n"
    assert len(probes(bad)) == 4 and probes(ok) == []


# -- every store satisfies the contract ----------------------------------------------------------
GLM_PRESETS = ("resident", "hisparse", "adaptive", "resident+spec", "adaptive+spec")


def _glm_engine(preset: str) -> Engine:
    return Engine(EngineConfig(preset=preset, device="cpu", page_size=4, hot_cache_rows=32, max_model_len=256,
                               kv_pool_bytes=8 << 20, host_pool_bytes=8 << 20, speculative_algorithm="ngram"
                               if preset.endswith("+spec") else None))


@pytest.fixture(scope="module")
def stores() -> dict[str, KVStore]:
    out = {f"glm/{p}": _glm_engine(p).store for p in GLM_PRESETS}
    v41 = loaded_v41()
    for p in ("resident", "hisparse", "adaptive"):
        out[f"v4/{p}"] = Engine(EngineConfig(preset=p, device="cpu", page_size=4, kv_pool_bytes=8 << 20,
                                             host_pool_bytes=8 << 20), loaded=v41).store
    return out


def declared() -> dict[str, inspect.Signature | None]:
    """Public names KVStore declares -> signature (None for attributes and properties)."""
    out = {}
    for name, value in vars(KVStore).items():
        if name.startswith("_"):
            continue
        out[name] = inspect.signature(value) if inspect.isfunction(value) else None
    return out | {n: None for n in KVStore.__annotations__}


def contract_problems(cls: type) -> list[str]:
    """Why `cls` breaks the KVStore contract: not a subclass, abstract methods left, an override
    whose parameters differ from the declaration, or a public method whose name is a near miss
    of a declared one (a misspelled ability would silently keep the default)."""
    if not issubclass(cls, KVStore):
        return [f"{cls.__name__} is not a KVStore"]
    out = [f"{cls.__name__} leaves {m} abstract" for m in sorted(getattr(cls, "__abstractmethods__", ()))]
    names = declared()
    for klass in cls.__mro__:
        if klass in (KVStore, object):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or not inspect.isfunction(value):
                continue
            if name in names:
                want = names[name]
                if want is not None and list(inspect.signature(value).parameters) != list(want.parameters):
                    out.append(f"{klass.__name__}.{name}{inspect.signature(value)} != declared {name}{want}")
                continue
            near = difflib.get_close_matches(name, list(names), n=1, cutoff=0.85)
            if near:
                out.append(f"{klass.__name__}.{name} looks like a misspelling of the declared {near[0]!r}")
    return out


def test_every_store_satisfies_the_contract(stores):
    assert set(stores) == {f"glm/{p}" for p in GLM_PRESETS} | {f"v4/{p}" for p in ("resident", "hisparse", "adaptive")}
    problems = [p for store in stores.values() for p in contract_problems(type(store))]
    assert problems == []


def test_contract_check_can_fail():
    class Misspelled(type(_glm_engine("hisparse").store)):
        def staging_row(self):  # near miss of staging_rows
            return None

        def loading(self, request):  # renamed parameter
            return False

    class NotAStore:
        pass

    problems = contract_problems(Misspelled)
    assert any("misspelling" in p and "staging_rows" in p for p in problems)
    assert any("loading" in p and "declared" in p for p in problems)
    assert contract_problems(NotAStore) == ["NotAStore is not a KVStore"]


def test_stores_answer_every_declared_ability(stores):
    """Every declared ability is callable on every store and returns its declared kind."""
    for name, store in stores.items():
        assert isinstance(store.supports_prefix, bool), name
        assert isinstance(store.replayable, bool), name
        assert isinstance(store.graph_fingerprint(), tuple), name
        assert store.loading("no-such-request") is False, name
        layout = store.prefix_layout()
        assert layout is None or (len(layout) == 3 and all(isinstance(x, int) for x in layout)), name
        base = name.split("/")[1].split("+")[0]
        hier = base != "resident"
        assert (store.resolver_census() is not None) == hier, name
        assert (store.residency() is not None) == (base == "adaptive"), name
    assert stores["glm/resident+spec"].staging_rows() is None  # resident never stages
    assert stores["glm/adaptive+spec"].staging_rows() is not None  # verification over the hierarchy does
    assert all(s.supports_prefix for s in stores.values())  # V4 prefixes too (kv/v4/prefix.py)


# -- drafters --------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["dflash", "dspark", "ngram", "oracle"])
def test_every_drafter_satisfies_the_protocol(algorithm):
    extra = {"speculative_oracle_tokens_per_round": 2.0} if algorithm == "oracle" else {}
    eng = Engine(EngineConfig(preset="resident", device="cpu", speculative_algorithm=algorithm,
                              kv_pool_bytes=8 << 20, **extra), oracle_reference={})
    drafter = eng.spec.drafter
    assert isinstance(drafter, Drafter)
    assert isinstance(drafter.capture_layers, tuple)
    assert eng.spec.capture == drafter.capture_layers


# -- row places ------------------------------------------------------------------------------------
def test_row_place_tiers_are_declared():
    assert RowPlace("hot", 3).tier in TIERS and RowPlace("tail").device == -1
