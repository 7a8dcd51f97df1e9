"""What the ``%mesh`` magics do, as plain functions a script can call too.

The controller keeps a registry of named proc meshes (``monarch_nb._registry``, re-exported
here). :func:`connect` attaches to allocators (the embedded local one by default) and
re-attaches the meshes already running there, e.g. after a kernel restart; :func:`spawn`
starts a named mesh over every attached host; :func:`exec_cell` runs source code in every
proc of a mesh, each proc keeping its own namespace; :func:`stop` stops meshes this
controller owns.
"""

from __future__ import annotations

import itertools
from typing import Any

from . import _errgroup, _registry
from ._callers import callers_level
from ._deadline import budget
from ._errgroup import clip, ranks_text
from ._leftrunning import LEFT_MORE, LEFT_WAIT, LeftRunning, left_by_mesh, left_text
from ._meshstop import stop_proc_mesh, stopped_elsewhere
from ._ranks import format_ranks, select_ranks
from ._registry import _resolve, connect, get, hosts, meshes, restart, spawn
from .actor import Extent, Future, ProcMesh, ValueMesh, controller_client
from .errors import ActorError, ConnectError, ExecError, MeshError, SpawnError, SupervisionError

__all__ = [
    "CellEndedWarning",
    "ambiguous_meshes",
    "connect",
    "exec_cell",
    "get",
    "hosts",
    "interrupt",
    "meshes",
    "orphaned_meshes",
    "restart",
    "spawn",
    "status",
    "stop",
]


class CellEndedWarning(RuntimeWarning):
    """A ``%%mesh exec`` cell that failed while other ranks still ran it has ended on those ranks:
    a later cell on the mesh tells what they raised then (their collective's error, once the
    failed rank's process group was destroyed, as the cell's error advised)."""


def orphaned_meshes() -> list[str]:
    """Meshes without a ``%mesh`` name whose controller is gone (spawned with
    ``this_host().spawn_procs(...)`` in a kernel since restarted), re-attached by the last
    :func:`connect` under their ``anon-...`` names: use them, or stop them to free their procs."""
    return list(_registry.orphans)


def ambiguous_meshes() -> dict[str, str]:
    """Names the last :func:`connect` found on several hosts as distinct proc meshes (not
    re-attached): name -> the candidates and how to pick one."""
    return dict(_registry.ambiguous)


_cell_counter = itertools.count(1)


def _exec_actors(pm: ProcMesh) -> Any:
    from ._exec import EXEC_ACTOR, ExecActor

    am = _registry._exec_meshes.get(pm.name)
    # keyed by name: a mesh spawned again under the name of one stopped by its own stop() (not
    # %mesh stop, which forgets its namespace) gets a namespace of its own (slices share procs)
    if am is None or am._procs is not pm._procs:
        try:
            am = pm.spawn(EXEC_ACTOR, ExecActor)
        except SpawnError as e:
            if "already exists" not in str(e):
                raise
            am = pm.actor_mesh(EXEC_ACTOR)  # a namespace from before a kernel restart
        _registry._exec_meshes[pm.name] = am
    return am


def _target_ranks(pm: ProcMesh, ranks: str | list[int] | None) -> list[int] | None:
    if ranks is None:
        return None
    return select_ranks(ranks, len(pm._view.ranks))


def exec_cell(
    mesh: ProcMesh | str | None,
    source: str,
    *,
    ranks: str | list[int] | None = None,
    block: bool = True,
    timeout: float | None = None,
    label: str = "",
) -> ValueMesh[Any] | Future[ValueMesh[Any]]:
    """Run ``source`` in every proc of ``mesh`` (or ``ranks`` of it, e.g. ``"0:4"``).

    Returns a ValueMesh of each rank's last expression; when any rank raises, an
    :class:`~monarch_nb.errors.ExecError` shows every failing rank's remote traceback. With
    ``block=False`` returns a Future of that instead.
    """
    from ._exec import CellFailed

    pm = _resolve(mesh)
    am = _exec_actors(pm)
    sel = _target_ranks(pm, ranks)
    what = f"%%mesh exec on {pm.name}"
    if not label:
        label = str(next(_cell_counter))
    import linecache

    filename = f"<mesh exec {label}>"  # the name ExecActor compiles it under
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    idx = sel if sel is not None else list(range(len(pm._view.ranks)))

    def collect(raw: list[tuple[bool, Any]]) -> ValueMesh[Any]:
        results = [v for _, v in raw]
        if sel is None:
            return ValueMesh._from_view(pm._view, results)
        return ValueMesh(Extent(["ranks"], [len(results)]), results)

    def failed(e: ActorError) -> ExecError:
        """The ranks whose cell raised, as soon as one did (the call fails fast), and the ranks
        still running then: blocked in a collective with a failed rank, perhaps, for good."""
        errs = e.failures or {idx[0]: e}
        failures = {i: f.exception.args for i, f in errs.items() if isinstance(f.exception, CellFailed)}
        groups = [i for i, f in errs.items() if getattr(f.exception, "holds_group", False)]
        on = format_ranks(idx) if sel is not None else ""
        err = ExecError(failures, len(idx), pm.name, running=e.running, group_ranks=groups, cell_ranks=on)
        if e.running:
            waiting = e.running if isinstance(e.running, list) else [i for i in idx if i not in failures]
            said = [
                f"{ranks_text(g.ranks)} ({len(g.ranks)} of {len(idx)}) raised {g.etype}: {clip(g.messages[g.ranks[0]])} "
                "(the cell's error)"
                for g in _errgroup.group((r, *f) for r, f in failures.items())
            ]
            left_by_mesh[pm.name] = LeftRunning(am, label, idx, said, [*failures], waiting)
        return err

    def died(e: SupervisionError, call: Future[Any]) -> SupervisionError:
        """A rank's process died in the cell (os._exit, a segfault, the OOM killer): the call
        fails at once, and, as for a rank that raised, the ranks still running then are named:
        blocked in a collective with the dead rank, perhaps, until the process group times out."""
        if e.rank is None or not e.mesh or e.cause.startswith("mesh stopped"):
            return e
        dead = pm._view.ranks.index(e.rank) if e.rank in pm._view.ranks else e.rank
        left = call._progress[0][0] if call._progress else 0
        # the future counts the ranks that had not answered; when that is every rank but the dead
        # one, they are known by name. Ranks known dead too (their allocator stopped with them)
        # run nothing: they were named as running, and as the live ranks to go on with
        gone = {dead, *am._known_failed_all()}
        others = [i for i in idx if i not in gone]
        running: list[int] | int = others if left == len(others) or not others else min(left, len(others))
        host = f" (host {e.host})" if e.host else ""
        if dead_before is None:
            lines = [f"the cell failed on mesh {pm.name!r}: the process of rank {dead} died{host}: {e.cause}"]
        else:
            # every later cell fails with the same death: read as news, it sent the user looking
            # for what this cell did to rank 3, and it said nothing of how to go on
            lines = [f"the cell failed on mesh {pm.name!r}: the process of rank {dead} had died before it ran{host}: {e.cause}"]
        still = _errgroup.running_line(running, len(idx))
        if still:
            lines.append(f"{still}; the next cell on this mesh waits for them (%mesh stop {pm.name} ends them)")
        if dead_before is not None and not others:
            lines.append(
                f"every rank of this mesh had died ({format_ranks(sorted(gone & set(idx)))}): %mesh stop {pm.name} ends "
                f"the mesh; spawn a new one to go on"
            )
        elif dead_before is not None:
            live = format_ranks(others)
            lines.append(
                f"every cell on all of this mesh's ranks fails so: %%mesh exec {pm.name} --ranks {live} runs one on the "
                f"live ranks; %mesh stop {pm.name} ends the mesh (spawn a new one to use every rank again)"
            )
        if dead_before is None and others:
            # its connections closed with it: the ranks waiting for it in a collective fail (often
            # before the death is known here: their errors were dropped), and this error or a later
            # cell says what they raised (a rank waiting for one of them, not for it, waits on)
            said = [f"rank {dead} (1 of {len(idx)})'s process died{host}: {clip(e.cause)}"]
            left_by_mesh[pm.name] = LeftRunning(am, label, idx, said, [dead], others)
        out = SupervisionError(e.cause, mesh=e.mesh, actor=e.actor, rank=e.rank, host=e.host, message="\n".join(lines))
        out.endpoint = e.endpoint
        return out

    def result(call: Future[list[tuple[bool, Any]]]) -> ValueMesh[Any]:
        try:
            raw = call.get()
        except ActorError as e:
            if not isinstance(e.exception, CellFailed):
                raise
            raise failed(e) from None
        except SupervisionError as e:
            raise died(e, call) from None
        return collect(raw)

    # a rank whose process died in an earlier cell fails this one at once, as it did that one
    dead_before = am._known_failed()
    left = left_by_mesh.get(pm.name)
    if left is not None and left.am is not am:
        del left_by_mesh[pm.name]  # a namespace gone since (the mesh was spawned again)
        left = None
    call = am.run.call_ranks(sel, source, label)
    if left is not None and not left.asked:
        # answered by each rank once it has ended the cell left running there, and this one if it
        # runs there (calls to an actor run in order): when this cell or a later one frees it
        left.asked = {i: am.outcome.call_ranks([i], left.label) for i in left.waiting}
    out: Future[ValueMesh[Any]] = Future._create(what)
    out._progress = call._progress
    call.add_done_callback(lambda c: out._set_raw(c, result))
    if not block:
        return out
    # a cell on the ranks left running is answered right after it there, and one on the others may
    # have freed them (destroyed the group they wait on): those wait for the answers, a while
    wait = LEFT_WAIT if left is not None and not left.waited and set(idx) & set(left.ranks) else 0.0
    try:
        value = out.get(timeout=timeout)
    except (ExecError, TimeoutError) as e:
        # a cell waiting on ranks the failed one left running: which of them are out, and on whom
        # the others wait
        if left is not None:
            text = left_text(pm.name, left, wait)
            if text:
                e.add_note(text)
        raise
    except SupervisionError as e:
        now = left_by_mesh.get(pm.name)
        if now is not None and now.label == label and not now.asked:
            # the live ranks: those that raised have answered, those freed by the death answer
            # within milliseconds
            now.asked = {i: am.outcome.call_ranks([i], label) for i in now.waiting}
            text = left_text(pm.name, now, LEFT_MORE)
            if text:
                e.add_note(text)
        raise
    except KeyboardInterrupt as e:
        # the ranks were interrupted too: the future's "only the wait stopped" is not so here
        vars(e).pop("__notes__", None)
        grace = INTERRUPT_GRACE
        try:
            interrupt(pm, sel)
            _wait_settled(out, INTERRUPT_GRACE)
        except KeyboardInterrupt:
            # an impatient user's next interrupt: it ended the wait for the ranks, not the cell's
            # notes (which ranks still run it, what ends them); raised, it showed a traceback of
            # our waits chained to the first, without them
            grace = -1.0
        _note_not_interrupted(e, out, pm.name, grace)
        _note_where_interrupted(e, out)
        raise
    if left is not None:
        text = left_text(pm.name, left, wait)
        if text:
            import warnings

            warnings.warn(text, CellEndedWarning, callers_level())
    return value


#: how long an interrupted cell waits for its ranks to stop before saying which did not
INTERRUPT_GRACE = 1.0


def _wait_settled(out: Future[Any], timeout: float) -> None:
    import threading

    settled = threading.Event()
    out.add_done_callback(lambda _f: settled.set())
    settled.wait(timeout)


def _note_not_interrupted(e: BaseException, out: Future[Any], name: str, grace: float) -> None:
    """A SIGINT ends Python code, not a C call: ranks blocked in a collective (waiting for a
    rank the interrupt stopped, or a dead one) run on, and the next cell would wait on them
    unexplained. Say how many had not stopped ``grace`` s after the interrupt (or when the user
    interrupted again, for a negative ``grace``)."""
    p = out.progress()
    if p is None or p[0] >= p[1]:
        return
    done, n = p
    when = "when you interrupted again" if grace < 0 else f"{grace:g} s after the interrupt"
    e.add_note(
        f"monarch_nb: {n - done} of {n} ranks had not stopped {when}: blocked "
        "in a C call (a collective waiting for another rank, perhaps), which an interrupt does not end; "
        f"the next cell on this mesh waits for them (%mesh stop {name} ends them)"
    )


def _note_where_interrupted(e: BaseException, out: Future[Any]) -> None:
    """The ranks' own interrupts, grouped: where each rank's code was, which is what a user
    interrupting a cell that seems stuck wants to know (the local traceback shows only the
    cell's wait). Only when every rank has stopped (``_wait_settled`` waited)."""
    if not out.done():
        return
    try:
        out.get(timeout=0)
    except ExecError as x:
        lines = str(x).splitlines()[1:]
        e.add_note("\n".join(["monarch_nb: the interrupt stopped the cell on the ranks too; where they were:", *lines]))
    except BaseException:
        pass  # a rank died meanwhile, say: the interrupt is the news, not that


def interrupt(mesh: ProcMesh | str | None, ranks: list[int] | None = None) -> int:
    """Send an interrupt (SIGINT) to code running in ``%%mesh exec`` on the mesh; returns how many were busy."""
    pm = _resolve(mesh)
    client = controller_client()
    procs = [pm._procs[r] for r in pm._view.ranks]
    if ranks is not None:
        procs = [procs[i] for i in ranks]
    futs = [client.request(p.addr, "interrupt", _actor="__sys__") for p in procs]
    n = 0
    left = budget(2.0)
    for f in futs:
        try:
            n += bool(f.get(timeout=left()))
        except Exception:
            pass
    return n


def stop(name: str | None = None, *, all: bool = False, force: bool = False) -> list[str]:
    """Stop the named mesh (or every mesh with ``all=True``); only this controller's unless ``force``.

    A name this controller does not hold (a mesh of a job's hosts spawned by another kernel or a
    script, or of a kernel gone) is stopped where :func:`status` lists it, as ``monarch-nb stop``
    does: refused with ``PermissionError`` while its owner runs, unless ``force``; with ranks on a
    host that does not answer, the others are stopped and ``ConnectError`` names that host."""
    if (name is None) == (not all):
        raise ValueError("give a mesh name or all=True")
    with _registry._lock:
        client = controller_client()
        held = [m for m in _registry._meshes.values() if not m._stopped] + _spawned_here(client)
        if not all and name not in _registry._meshes and not any(m.name == name for m in held):
            from .allocator import stop_mesh

            # read here, a mesh on a job's allocators (their records are in the job's directory) was
            # "no mesh named" though %mesh status listed it
            stop_mesh(str(name), force=force, reason="stopped by %mesh stop in another controller")
            return [str(name)]
        if all:
            groups = _by_procs(held)
        else:
            groups = _by_procs([m for m in held if m.name == name]) or [[get(name)]]  # type: ignore[arg-type]
        stopped = []
        errors = []
        for at, (pm, *same) in enumerate(groups):
            if all and not force and not _owned(client, pm):
                continue
            try:
                stop_proc_mesh(pm, force)
            except KeyboardInterrupt as e:
                # the stop goes on at the allocators; this kernel's handles must not outlive it: a
                # next `%%mesh exec` on the name failed with "actor mesh '__mnb_exec__' was stopped"
                for other in same:
                    other._stopped = True
                _registry._exec_meshes.pop(pm.name, None)
                left_by_mesh.pop(pm.name, None)
                _note_stop_interrupted(e, pm, [g[0].name for g in groups[at + 1 :]] if all else [])
                raise
            except ConnectError as e:
                if not all:
                    raise  # it says what was stopped, and what could not be
                errors.append(f"{pm.name}: {e}")
            except Exception as e:
                errors.append(f"{pm.name}: {e}")
            else:
                gone = stopped_elsewhere(pm)
                if gone is None:
                    stopped.append(pm.name)
                else:
                    # stopped already (`monarch-nb stop --force` from a shell): what was asked
                    # for is done, and this kernel's handle goes as after its own stop
                    print(gone, flush=True)
            for other in same:
                other._stopped = True  # the same procs, held by another object: stopped too
            _registry._exec_meshes.pop(pm.name, None)
            left_by_mesh.pop(pm.name, None)
        gone = _stop_the_others({pm.name for g in groups for pm in g}, stopped, errors) if all and force else ""
        if errors:
            raise MeshError("could not stop " + "; ".join(errors))
        if gone:
            # their meshes are listed nowhere: what was stopped alone read as "nothing left running"
            done = ", ".join(stopped) or "nothing"
            raise ConnectError(f"stopped: {done}; these could not be reached, and no mesh of theirs was stopped: {gone}")
        return stopped


def _note_stop_interrupted(e: BaseException, pm: ProcMesh, after: list[str]) -> None:
    """The future's "only the wait stopped: stop mesh X goes on, and .get() or await waits for it
    again" named a future the user does not have; say what goes on, and what was not asked."""
    e.__notes__ = [n for n in getattr(e, "__notes__", []) if "only the wait stopped" not in n]
    text = (
        f"monarch_nb: only the wait stopped: the stop of mesh {pm.name!r} goes on (its allocators kill the procs that "
        "do not end by themselves within seconds); `%mesh status` shows when they are gone."
    )
    if after:
        text += f" Not stopped: {', '.join(after)} (`%mesh stop --all` again stops them)."
    e.add_note(text)


def _stop_the_others(done: set[str], stopped: list[str], errors: list[str]) -> str:
    """``stop(all=True, force=True)``: every other mesh :func:`status` lists, also another
    controller's and a job's, as ``monarch-nb stop --all --force`` stops them (it stopped this
    controller's alone, and said "nothing" beside a status table listing meshes). Returns the
    allocators that could not be asked, named, or ""."""
    from .allocator import stop_mesh
    from .introspect import _unreached_where, known_status

    found = known_status()["allocators"]
    for name in sorted({m["name"] for a in found if not a.get("error") for m in a.get("meshes", [])} - done):
        try:
            stop_mesh(name, force=True, reason="stopped by %mesh stop --all --force in another controller")
            stopped.append(name)
        except Exception as e:
            errors.append(f"{name}: {e}")
    return _unreached_where(found)


def _spawned_here(client: Any) -> list[ProcMesh]:
    """This controller's live proc meshes, also those of the Python API
    (``procs = this_host().spawn_procs(..., name="train")``) that no ``%mesh`` name holds:
    ``%mesh status`` lists them as this kernel's, so ``%mesh stop --all`` and ``%mesh stop
    train`` must reach them too, or their persistent procs hold the host until the lease."""
    with client._lock:
        owned = list(client.owned.values())
    return [m for m in owned if isinstance(m, ProcMesh) and not m._stopped]


def _by_procs(pms: list[ProcMesh]) -> list[list[ProcMesh]]:
    """The objects of each mesh, grouped: a mesh of the Python API that ``%mesh connect``
    re-attached is held twice (the spawn's object and the registry's); stopping it twice would
    fail, and an object left unstopped would claim its name."""
    groups: dict[frozenset[str], list[ProcMesh]] = {}
    for pm in pms:
        group = groups.setdefault(frozenset(p.addr for p in pm._procs), [])
        if all(pm is not g for g in group):
            group.append(pm)
    return list(groups.values())


def _owned(client: Any, pm: ProcMesh) -> bool:
    return any(client.owned.get(p.addr) is not None for p in pm._procs)


def _held_procs() -> list[Any]:
    """The procs of the meshes this controller holds and has not stopped (spawned, or
    re-attached by :func:`connect`): ``stop`` stops them as its own, and ``%mesh status`` lists
    them under an allocator that does not answer, whose own list of meshes it cannot read."""
    owned = dict(controller_client().owned)
    return [
        p
        for pm in {id(pm): pm for pm in owned.values()}.values()
        if not pm._stopped and not getattr(pm, "_root", pm)._stopped
        for p in pm._procs
    ]


def status(addresses: list[str] | None = None) -> dict[str, Any]:
    """Allocators, meshes, procs and their states (``monarch_nb.status()``): this machine's, those
    at ``addresses``, and the jobs' (their allocators carry ``job``; a job's lost host is listed
    with ``lost`` and ``error``), as ``monarch-nb status`` lists them."""
    from .introspect import known_status

    return known_status(addresses=addresses)
