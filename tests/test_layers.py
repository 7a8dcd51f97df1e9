"""The layering of monarch_nb, as a test: imports point downward only, and no import cycle
spans two folders.

The import graph counts every ``import`` (inside functions and ``TYPE_CHECKING`` blocks too)
and every ``importlib.import_module``/``__import__`` of a monarch_nb name, read with ``ast``
from the source, so a lazy import cannot hide an upward edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import monarch_nb

pytestmark = pytest.mark.timeout(60)

PKG = Path(monarch_nb.__file__).parent

#: the layers, lowest first: a module may import its own layer and those below (DESIGN.md)
LAYERS: list[tuple[str, set[str]]] = [
    ("leaves", {"errors", "config", "_version"}),
    ("wire", {"_wire"}),
    ("runtime", {"_runtime"}),
    ("actor", {"actor"}),
    ("features", {"logs", "sync", "debug", "env", "spmd", "introspect", "job", "rdma", "tensor", "telemetry"}),
    ("frontends", {"mesh", "magics", "widgets", "server", "cli"}),
]

#: top-level modules the table does not name, placed where what they import and serve puts them
PLACED: dict[str, tuple[str, str]] = {
    "_pyenv": ("leaves", "stdlib-only description of this interpreter; allocators answer hello with it"),
    "_ranks": ("leaves", "rank-set text ('0-3,5'); errors' messages use it"),
    "_errgroup": ("leaves", "groups and cleans remote tracebacks for errors' messages (stdlib, _ranks and _numtext only)"),
    "_numtext": ("leaves", "stdlib-only: texts that differ only in numbers, as one (rank output, grouped errors)"),
    "_meshhtml": ("leaves", "HTML of value tables and rank grids, for the actor API's _repr_html_ (stdlib and _ranks only)"),
    "_workspace": ("leaves", "stdlib-only file manifest shared by the runtime's code cache and sync"),
    "_deadline": ("leaves", "stdlib-only time budget shared by the waits of a fan-out"),
    "_newest": (
        "leaves",
        "stdlib-only dict of the last N entries; runtime, actor API and frontends keep their bounded records in it",
    ),
    "_argtypes": ("leaves", "stdlib-only argparse types the CLI and the magics share"),
    "_callers": ("leaves", "stdlib-only: the stacklevel that makes a warning name the program's line, not ours"),
    "_exec": ("features", "the actor behind %%mesh exec, built on the actor API"),
    "_registry": ("features", "the controller's named meshes, shared by sync/logs/env and mesh"),
    "_leftrunning": ("features", "mesh's bookkeeping of %%mesh exec cells a failure left running on some ranks"),
    "_meshstop": ("features", "a held proc mesh's stop in %mesh stop's words; mesh, the magics and the dashboard share it"),
    "allocator": ("features", "run, find and stop daemons through the records; the CLI and sidebar call it"),
    "kernelspec": ("frontends", "installs the notebook kernel; only the CLI calls it"),
    "__main__": ("entry", "python -m monarch_nb runs the CLI"),
    "__init__": ("entry", "the package facade: lazily reaches status, the magics and the server extension"),
}

#: the one upward import allowed, and why
ALLOWED_UP = {
    ("monarch_nb.actor._debugwait", "monarch_nb.debug"): (
        "the main thread blocked in .get() imports the debugger console when a rank of its call "
        "stops at breakpoint(), in a program that never imported monarch_nb.debug"
    ),
}

#: modules that import names only known at run time, and why that is no hidden edge
DYNAMIC = {
    "monarch_nb": "the facade's __getattr__ imports the submodule named (it sits above every layer)",
    "monarch_nb._runtime.zygote": "imports the modules its allocator names (preloads, the proc entry point)",
    "monarch_nb.job._job": "imports the user's module of `monarch-nb job apply module:attr`",
    "monarch_nb.tensor": "imports the user's function of `mt.remote('pkg.fn')` (Monarch's dotted-name form)",
}

RANK = {name: i for i, (name, _) in enumerate(LAYERS)} | {"entry": len(LAYERS)}


def unit(mod: str) -> str:
    """The folder or top-level module ``mod`` belongs to (``__init__`` for the package itself)."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer(mod: str) -> str:
    u = unit(mod)
    for name, members in LAYERS:
        if u in members:
            return name
    if u in PLACED:
        return PLACED[u][0]
    raise AssertionError(f"{mod}: place {u!r} in a layer (LAYERS or PLACED in tests/test_layers.py)")


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> tuple[dict[str, set[tuple[str, int]]], set[str]]:
    """module -> {(imported monarch_nb module, line)}, and the modules with dynamic imports."""
    mods = modules()
    graph: dict[str, set[tuple[str, int]]] = {}
    dynamic = set()
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {(a.name, node.lineno) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    edges.add((sub if sub in mods else target, node.lineno))
            elif isinstance(node, ast.Call) and node.args:
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name in ("import_module", "__import__"):
                    arg = node.args[0]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        edges.add((arg.value, node.lineno))
                    else:
                        dynamic.add(mod)
        graph[mod] = {(t, line) for t, line in edges if t.split(".")[0] == "monarch_nb" and t != mod}
    return graph, dynamic


def test_every_import_points_down_the_layer_table() -> None:
    graph, _ = import_graph()
    up = {}
    for mod, edges in graph.items():
        for target, line in edges:
            if RANK[layer(target)] > RANK[layer(mod)]:
                up[(mod, target)] = f"{mod}:{line} ({layer(mod)}) imports {target} ({layer(target)})"
    unexpected = [why for edge, why in sorted(up.items()) if edge not in ALLOWED_UP]
    assert unexpected == []
    assert set(up) == set(ALLOWED_UP), "an allowed upward import is gone: remove it from ALLOWED_UP"


def test_dynamic_imports_are_only_the_listed_ones() -> None:
    _, dynamic = import_graph()
    assert dynamic == set(DYNAMIC)


def test_no_import_cycle_spans_two_folders() -> None:
    graph, _ = import_graph()
    succ = {m: {t for t, _ in edges if (m, t) not in ALLOWED_UP} for m, edges in graph.items()}
    for m in list(succ):
        for t in succ[m]:
            succ.setdefault(t, set())
    crossing = [sorted(c) for c in _cycles(succ) if len({unit(m) for m in c}) > 1]
    assert crossing == []


def _cycles(succ: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, iter(sorted(succ[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(succ[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_the_cycle_finder_finds_a_cycle_through_two_folders() -> None:
    succ = {"monarch_nb.a.x": {"monarch_nb.b"}, "monarch_nb.b": {"monarch_nb.a.x"}, "monarch_nb.c": set()}
    assert _cycles(succ) == [{"monarch_nb.a.x", "monarch_nb.b"}]


def test_frontends_use_no_private_module_of_the_actor_api() -> None:
    graph, _ = import_graph()
    private = sorted(
        f"{mod}:{line} imports {target}"
        for mod, edges in graph.items()
        if layer(mod) == "frontends"
        for target, line in edges
        if target.startswith("monarch_nb.actor._")
    )
    assert private == []


def test_runtime_layers_import_no_frontend() -> None:
    """What really gets loaded: the runtime and a proc's bootstrap pull in no notebook stack."""
    code = (
        "import sys, monarch_nb.actor, monarch_nb._runtime.allocator, monarch_nb.actor._bootstrap;"
        "bad=[m for m in sys.modules if m.split('.')[0] in ('IPython','ipykernel','tornado','jupyter_server')"
        " or m.startswith(('monarch_nb.magics','monarch_nb.widgets','monarch_nb.server','monarch_nb.cli'))];"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.strip() == "[]"
