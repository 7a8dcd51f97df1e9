"""In-place reload of synced modules in a running proc, and what it means for its actors.

Changed modules, and the synced modules that import them, are reloaded in dependency order
(a module after the modules it imports).
An actor whose class lives in a reloaded module gets the new class: the same object, so its
state is kept, runs the new endpoint code from its next call on. ``recreate`` builds the
actor again from its constructor arguments instead.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import types
from typing import Any

#: where a ReloadError's message turns from what failed to what it means (sync groups by the former)
KEEPS = ". What failed keeps its previous code"


class ReloadError(ImportError):
    """Some synced modules could not be reloaded in a running proc."""


def modules_under(root: str) -> dict[str, types.ModuleType]:
    """The loaded modules whose files are under ``root``, by name."""
    out = {}
    prefix = root.rstrip(os.sep) + os.sep
    for name, m in list(sys.modules.items()):
        f = getattr(m, "__file__", None)
        if isinstance(m, types.ModuleType) and f and _absolute(f).startswith(prefix):
            out[name] = m
    return out


def _absolute(path: str) -> str:
    """``path`` made absolute, or as it is when it is relative to a working directory that was
    removed since (a proc outlives the notebook directory it was started in): such a module
    cannot be under a synced root, and one of them must not fail the reload of all the others."""
    try:
        return os.path.abspath(path)
    except FileNotFoundError:
        return path


def _rel(root: str, module: types.ModuleType) -> str:
    return os.path.relpath(_absolute(module.__file__ or ""), root).replace(os.sep, "/")


def _imports(m: types.ModuleType) -> set[str]:
    """The modules ``m``'s source imports (absolute names; relative imports resolved)."""
    import ast

    try:
        with open(m.__file__ or "", encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return set()
    pkg = m.__package__ or ""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".") if pkg else []
                parts = parts[: len(parts) - node.level + 1] if node.level > 1 else parts
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _plan(loaded: dict[str, types.ModuleType], changed: set[str]) -> list[str]:
    """Changed modules and the workspace modules that import them, each after what it imports."""
    deps = {n: {d for d in _imports(m) if d in loaded and d != n} for n, m in loaded.items()}
    todo = set(changed)
    grew = True
    while grew:
        grew = False
        for n, ds in deps.items():
            if n not in todo and ds & todo:
                todo.add(n)
                grew = True
    out: list[str] = []
    seen: set[str] = set()

    def visit(n: str, stack: frozenset[str]) -> None:
        if n in seen or n in stack:
            return
        for d in sorted(deps[n] & todo):
            visit(d, stack | {n})
        seen.add(n)
        out.append(n)

    for n in sorted(todo):
        visit(n, frozenset())
    return out


def _lookup(module: types.ModuleType, qualname: str) -> Any:
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


#: synced root -> files whose reload failed in this proc, retried by the next sync even if they
#: did not change again (the fix may have been an environment sync, or another module)
_failed: dict[str, set[str]] = {}


def _started() -> float:
    """When this process started (0 if unknown: then every module of the local folder is stale)."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return 0.0


def _stale_local(local: str, root: str, loaded: dict[str, types.ModuleType]) -> dict[str, types.ModuleType]:
    """Modules this proc imported from ``local``, the controller's own folder of the synced tree
    (a proc on the notebook's host finds it on its ``sys.path`` before any sync), whose file
    changed since this proc started. They are not under ``root``: a sync reloaded nothing and the
    actors ran the code they started with, sync after sync, with "reloaded nothing" reported."""
    if not local or local == root or not os.path.isdir(local):
        return {}
    started = _started()
    out = {}
    for name, m in modules_under(local).items():
        path = _absolute(m.__file__ or "")
        if name in loaded or not os.path.exists(os.path.join(root, os.path.relpath(path, local))):
            continue  # not synced (a .venv in the folder, an excluded file): not ours to reload
        try:
            edited = os.stat(path).st_mtime >= started
        except OSError:
            continue  # removed here: nothing to reload it from, as for a synced one
        if edited:
            out[name] = m
    return out


#: one reload at a time in a proc: each sync's runs on a thread of its own, and two syncs at once
#: (a cell's and a watch's, or two threads') overlapped. importlib.reload of a module that is
#: still being reloaded returns it half-run: the second sync said it reloaded the module, whose
#: file it had just changed, and the procs kept the first sync's code, sync after sync
_one_at_a_time = threading.Lock()


def reload_changed(rt: Any, root: str, changed: list[str], mode: str = "inplace", local: str = "") -> dict[str, Any]:
    """Reload the modules of ``changed`` files (paths relative to ``root``) in this proc,
    after any reload already running here (see :func:`_reload_changed`)."""
    with _one_at_a_time:
        return _reload_changed(rt, root, changed, mode, local)


def _reload_changed(rt: Any, root: str, changed: list[str], mode: str = "inplace", local: str = "") -> dict[str, Any]:
    """Reload the modules of ``changed`` files (paths relative to ``root``) in this proc.

    A module that fails to reload (a syntax error, an exception at import) does not stop the
    others: each one that can be reloaded is, its actors get the new class, and then the
    failures are raised together; the failed module keeps its previous code until a later
    sync reloads it. A module whose file was removed (deleted, renamed) stays loaded as it
    is, as in a local session: there is nothing to reload it from."""
    from ._actor import endpoints_of, is_async_actor

    if root not in sys.path:
        sys.path.insert(0, root)
    importlib.invalidate_caches()
    wanted = set(changed) | _failed.pop(root, set())
    loaded = modules_under(root)
    present = {n for n, m in loaded.items() if os.path.exists(_absolute(m.__file__ or ""))}
    stale = _stale_local(local, root, loaded)
    # reloaded by name, they are found in the synced tree, first on sys.path, from now on
    loaded.update(stale)
    present |= set(stale)
    order = _plan(loaded, {n for n in present if n in stale or _rel(root, loaded[n]) in wanted})
    reloaded: list[str] = []
    failed: dict[str, BaseException] = {}
    for name in order:
        m = loaded[name]
        if name not in present:
            continue
        cached = getattr(m, "__cached__", None)
        if cached:
            # a same-size edit within one second would pass the .pyc timestamp check
            try:
                os.unlink(cached)
            except OSError:
                pass
        try:
            importlib.reload(m)
        except Exception as e:
            failed[name] = e
            continue
        reloaded.append(name)
    updated, recreated = [], []
    #: actor (as its program names it) -> why it kept its previous class and object
    actors_failed: dict[str, BaseException] = {}
    new_code = set(reloaded)
    for aname, slot in list(rt.actors.items()):
        cls = getattr(slot, "cls", None)
        if cls is None or cls.__module__ not in new_code:
            continue
        new = _lookup(sys.modules[cls.__module__], cls.__qualname__)
        if not isinstance(new, type) or new is cls:
            continue
        # the spawn's id (``name#<process>.<n>``) is internal: the report names the actor mesh
        shown = aname.split("#", 1)[0]
        if is_async_actor(new) != slot.is_async:
            # one actor that cannot be updated used to stop the update of all the others
            actors_failed[shown] = TypeError(f"{cls.__qualname__} changed between sync and async endpoints; use --restart")
            continue
        if mode == "recreate" and slot.init_args is not None:
            args, kwargs = slot.init_args
            obj = new.__new__(new)  # type: ignore[call-overload]
            try:
                obj.__init__(*args, **kwargs)
            except Exception as e:
                # it raised out of the reload as itself ("ValueError: bad init", no report, the
                # other actors not updated): the actor keeps its previous class and object
                actors_failed[f"{shown} ({cls.__qualname__}.__init__)"] = e
                continue
            slot.cls, slot.endpoints, slot.obj = new, endpoints_of(new), obj
            recreated.append(shown)
        else:
            slot.cls = new
            slot.endpoints = endpoints_of(new)
            if slot.obj is not None:
                slot.obj.__class__ = new
                updated.append(shown)
    if failed or actors_failed:
        _failed[root] = {_rel(root, loaded[n]) for n in failed}
        why = "; ".join(
            [f"{_rel(root, loaded[n])}: {type(e).__name__}: {e}" for n, e in failed.items()]
            + [f"actor {a}: {type(e).__name__}: {e}" for a, e in actors_failed.items()]
        )
        raise ReloadError(
            f"{why}{KEEPS} in this proc (its actors too) until a sync "
            f"reloads it; reloaded: {', '.join(reloaded) or 'nothing'}; actors updated: {', '.join(updated + recreated) or 'none'}"
        ) from next(iter([*failed.values(), *actors_failed.values()]))
    return {"pid": os.getpid(), "reloaded": reloaded, "updated": updated, "recreated": recreated}
