"""The package's import graph follows its layering (issue 23): read from the source with `ast`, nothing
is imported.

Rooms, bottom to top (docs/structure.md):

    core -> kernels -> kv (memory -> resident -> hier -> v4, then kv's own modules) -> layers
         -> models -> spec -> engine -> dhisparse/__init__.py (the top-level API) -> server | bench | train -> cli

A module may import its own room and the rooms below it, never one above it nor a peer of its level
(server, bench and train do not import each other). Checked:

  a. layering: every import of a dhisparse module, module-level and function-level, relative ones too;
  b. no import cycles between files: the graph of module-level imports (those under `if TYPE_CHECKING:`
     run only for the type checker and are left out), its strongly connected components;
  c. no function-level (lazy) import of a dhisparse module outside `cli/`, `bench/` (lazy there so
     `dhisparse --help` stays fast) and the top-level `__getattr__`, apart from the exceptions listed
     below with their reason;
  d. the checker itself reports a back-edge, a peer import, a cycle and a lazy import of a fake tree.

`from pkg import name` resolves to the submodule `pkg.name` when there is one, else to `pkg` (its
`__init__`).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "dhisparse"

# room -> rank; a module may import a room of lower rank, or its own room. Sub-rooms of kv rank
# inside kv; kv's own modules (kv/__init__.py, kv/build.py) sit above its sub-rooms.
RANKS: dict[str, tuple] = {
    "core": (0,),
    "kernels": (1,),
    "kv.memory": (2, 0),
    "kv.resident": (2, 1),
    "kv.hier": (2, 2),
    "kv.v4": (2, 3),
    "kv": (2, 9),
    "layers": (3,),
    "models": (4,),
    "spec": (5,),
    "engine": (6,),
    "": (6, 5),  # dhisparse/__init__.py: the top-level API, over engine
    "server": (7,),
    "bench": (7,),
    "train": (7,),
    "cli": (8,),
    "__main__": (9,),  # dhisparse/__main__.py: `python -m dhisparse` runs the CLI
}
SUBROOMS = {"kv": ("memory", "resident", "hier", "v4")}

# c. where a function-level import of a dhisparse module is fine
LAZY_ROOMS = {"cli", "bench"}  # keeps `dhisparse --help` fast: a command imports what it runs
LAZY_FUNCTIONS = {("dhisparse/__init__.py", "__getattr__")}  # `dhisparse.LLM` loads the engine on use

# Other allowed lazy imports, (file, imported module) -> one-line reason. Keep it empty if you can.
LAZY_EXCEPTIONS: dict[tuple[str, str], str] = {}



# -- the checker -------------------------------------------------------------------------------------------


class Imp(NamedTuple):
    """One import of a package module: `src` (module) in `file` at `line` imports `target`."""

    src: str
    file: str
    line: int
    target: str
    func: str | None  # the enclosing function ("outer.inner"), None at module level
    type_only: bool  # under `if TYPE_CHECKING:`

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def module_names(pkg_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package folder (packages: their __init__)."""
    out = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = (pkg_dir.name, *path.relative_to(pkg_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, func: str | None, type_only: bool):
    """(import node, enclosing function, under TYPE_CHECKING) for every import below node."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, func, type_only
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            name = getattr(child, "name", "<lambda>")
            yield from _walk(child, name if func is None else f"{func}.{name}", type_only)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), func, True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), func, type_only)
        else:
            yield from _walk(child, func, type_only)


def collect_imports(pkg_dir: Path) -> tuple[list[Imp], set[str]]:
    """Every import of a module of the package under pkg_dir, and the set of its module names."""
    mods = module_names(pkg_dir)
    base_dir, pkg = pkg_dir.parent, pkg_dir.name
    out: list[Imp] = []
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        file = path.relative_to(base_dir).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, func, type_only in _walk(tree, None, False):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = ".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in dict.fromkeys(targets):  # one per imported module, not per name
                if t == pkg or t.startswith(pkg + "."):
                    out.append(Imp(mod, file, node.lineno, t, func, type_only))
    return out, set(mods)


def room_of(module: str) -> str:
    """'dhisparse.kv.hier.context' -> 'kv.hier'; 'dhisparse.engine.llm' -> 'engine'; 'dhisparse' -> ''."""
    parts = module.split(".")[1:]
    if not parts:
        return ""
    if len(parts) > 1 and parts[1] in SUBROOMS.get(parts[0], ()):
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def layer_violations(imports: list[Imp], ranks: dict[str, tuple] = RANKS) -> list[str]:
    """'file:line: room imports room (module)' for every import of a higher or peer room."""
    bad = []
    for i in imports:
        a, b = room_of(i.src), room_of(i.target)
        if a == b:
            continue
        if a not in ranks or b not in ranks:
            bad.append(f"{i.where}: {i.src} imports {i.target}: room {a or b!r} has no place in the order")
        elif not ranks[b] < ranks[a]:
            kind = "a peer" if ranks[a] == ranks[b] else "a room above it"
            bad.append(f"{i.where}: {a or 'dhisparse'} imports {kind}, {b or 'dhisparse'} ({i.target})")
    return bad


def import_graph(imports: list[Imp]) -> dict[str, dict[str, Imp]]:
    """src -> {target: the first import}: module-level imports that run (no TYPE_CHECKING, no function)."""
    g: dict[str, dict[str, Imp]] = {}
    for i in imports:
        if i.func is None and not i.type_only:
            g.setdefault(i.src, {}).setdefault(i.target, i)
    return g


def strongly_connected(g: dict[str, dict[str, Imp]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, or of one importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g.get(v, {}):
                out.append(sorted(comp))

    nodes = sorted(set(g) | {w for ts in g.values() for w in ts})
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def cycle_in(comp: list[str], g: dict[str, dict[str, Imp]]) -> list[Imp]:
    """One concrete cycle through comp[0] inside the component, as the imports that make it."""
    start, inside = comp[0], set(comp)
    prev: dict[str, Imp] = {}
    frontier = [start]
    while frontier:  # breadth first, so the cycle shown is a shortest one through start
        nxt = []
        for v in frontier:
            for w, imp in sorted(g.get(v, {}).items()):
                if w == start:
                    path = [imp]
                    while path[0].src != start:
                        path.insert(0, prev[path[0].src])
                    return path
                if w in inside and w not in prev:
                    prev[w] = imp
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def cycles(imports: list[Imp]) -> list[str]:
    """'a -> b (file:line) -> a (file:line)' for one cycle of every strongly connected component."""
    g = import_graph(imports)
    out = []
    for comp in strongly_connected(g):
        path = cycle_in(comp, g)
        out.append(f"[{', '.join(comp)}] " + path[0].src + "".join(f" -> {i.target} ({i.where})" for i in path))
    return out


def lazy_imports(imports: list[Imp], allowed: dict[tuple[str, str], str]) -> list[Imp]:
    """Function-level imports outside LAZY_ROOMS / LAZY_FUNCTIONS and not in `allowed`."""
    return [
        i for i in imports
        if i.func is not None and room_of(i.src) not in LAZY_ROOMS
        and (i.file, i.func.split(".")[0]) not in LAZY_FUNCTIONS and (i.file, i.target) not in allowed
    ]


# -- the package -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def package() -> tuple[list[Imp], set[str]]:
    return collect_imports(PACKAGE_DIR)


def test_every_import_names_a_module(package):
    imports, mods = package
    missing = [f"{i.where}: {i.target}" for i in imports if i.target not in mods]
    assert not missing, "imports of dhisparse modules that do not exist:\n" + "\n".join(missing)


def test_every_room_has_a_place(package):
    _, mods = package
    rooms = {room_of(m) for m in mods}
    assert rooms <= set(RANKS), f"rooms missing from RANKS (and docs/structure.md): {sorted(rooms - set(RANKS))}"


def test_no_import_of_a_higher_room(package):
    imports, _ = package
    bad = layer_violations(imports)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycles(package):
    imports, _ = package
    found = cycles(imports)
    assert not found, "import cycles between modules:\n" + "\n".join(found)


def test_no_lazy_imports_outside_cli_and_bench(package):
    imports, _ = package
    bad = lazy_imports(imports, LAZY_EXCEPTIONS)
    assert not bad, "function-level imports of dhisparse modules (move them to module level):\n" + "\n".join(
        f"{i.where} in {i.func}(): {i.target}" for i in bad)


def test_allowlists_are_current(package):
    """An exception that matches nothing must go."""
    imports, _ = package
    lazy = {(i.file, i.target) for i in imports if i.func is not None}
    stale = [k for k in LAZY_EXCEPTIONS if k not in lazy]
    assert not stale, f"LAZY_EXCEPTIONS entries that match no lazy import: {stale}"


# -- d. the checker can fail ----------------------------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "dhisparse"
    for rel, text in files.items():
        p = pkg / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for d in [pkg, *(p for p in pkg.rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    return pkg


def test_checker_reports_a_fake_trees_faults(tmp_path):
    pkg = _tree(tmp_path, {
        "__init__.py": "def __getattr__(name):\n    from dhisparse.engine import b\n    return b\n",
        "core/a.py": "from dhisparse.engine.b import X\n",  # back-edge core -> engine
        "core/ok.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dhisparse.core import a\n",
        "kv/memory/m.py": "def f():\n    from ..hier import h\n",  # lazy and upward (memory -> hier)
        "kv/hier/h.py": "from dhisparse.kv.memory import m\n",  # downward: fine
        "engine/b.py": "from . import c\nX = 1\n",  # b -> c -> b: a cycle (relative import)
        "engine/c.py": "import dhisparse.engine.b\n",
        "server/s.py": "from dhisparse.bench import w\n",  # peer import
        "bench/w.py": "def f():\n    from dhisparse.engine import b\n",  # lazy in bench: allowed
        "cli/main.py": "def f():\n    from dhisparse.server import s\n",  # lazy in cli: allowed
        "models/t.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dhisparse.models import u\n",
        "models/u.py": "from dhisparse.models import t\n",  # a type-only back-reference: no cycle
    })
    imports, mods = collect_imports(pkg)
    assert {"dhisparse", "dhisparse.core.a", "dhisparse.kv.memory.m", "dhisparse.engine.c"} <= mods
    assert all(i.target in mods for i in imports)

    bad = layer_violations(imports)
    assert any(b.startswith("dhisparse/core/a.py:1: core imports a room above it, engine") for b in bad), bad
    assert any(b.startswith("dhisparse/kv/memory/m.py:2: kv.memory imports a room above it, kv.hier") for b in bad)
    assert any(b.startswith("dhisparse/server/s.py:1: server imports a peer, bench") for b in bad), bad
    assert len(bad) == 3, bad

    found = cycles(imports)
    assert found == ["[dhisparse.engine.b, dhisparse.engine.c] dhisparse.engine.b -> dhisparse.engine.c "
                     "(dhisparse/engine/b.py:1) -> dhisparse.engine.b (dhisparse/engine/c.py:1)"], found

    lazy = lazy_imports(imports, {})
    assert [(i.where, i.func, i.target) for i in lazy] == [("dhisparse/kv/memory/m.py:2", "f", "dhisparse.kv.hier.h")]
    assert lazy_imports(imports, {("dhisparse/kv/memory/m.py", "dhisparse.kv.hier.h"): "reason"}) == []


def test_checker_finds_longer_cycles_and_self_imports():
    def imp(a: str, b: str) -> Imp:
        return Imp(a, a.replace(".", "/") + ".py", 1, b, None, False)

    edges = [imp("dhisparse.kv.x", "dhisparse.kv.y"), imp("dhisparse.kv.y", "dhisparse.kv.z"),
             imp("dhisparse.kv.z", "dhisparse.kv.x"), imp("dhisparse.kv.z", "dhisparse.core.q"),
             imp("dhisparse.core.s", "dhisparse.core.s")]
    found = cycles(edges)
    assert len(found) == 2, found
    assert found[0].startswith("[dhisparse.core.s] dhisparse.core.s -> dhisparse.core.s"), found
    assert found[1].endswith("-> dhisparse.kv.y (dhisparse/kv/x.py:1) -> dhisparse.kv.z (dhisparse/kv/y.py:1) "
                             "-> dhisparse.kv.x (dhisparse/kv/z.py:1)"), found
    # edges that do not run at import time make no cycle
    assert cycles([imp("dhisparse.a.b", "dhisparse.a.c"), imp("dhisparse.a.c", "dhisparse.a.b")._replace(func="f")]) == []
