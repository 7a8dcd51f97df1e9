"""Stopping a proc mesh this controller holds, in the words ``%mesh stop`` uses: shared by
:func:`monarch_nb.mesh.stop`, the ``%mesh stop`` magic and the dashboard's stop button, which
must all say the same of a host that did not answer or of a mesh stopped from elsewhere."""

from __future__ import annotations

from ._numtext import plural
from .actor import ProcMesh, controller_client
from .actor._mesh import kills_noted as kills_noted
from .errors import ConnectError
from .introspect import _unreached_note, known_status


def stopped_elsewhere(pm: ProcMesh) -> str | None:
    """What to say when ``pm``'s stop found it stopped already by someone else (its allocators
    knew no such mesh, and had told this controller of that stop or of its procs' exits as a
    mesh's stop: ``ProcMesh.stop`` resolves then, as a second stop does); None when this stop
    did it."""
    root = getattr(pm, "_root", pm)
    if not root._stopped_outside:
        return None
    why = root._stop_reason
    if why.startswith("stopped by "):
        return f"mesh {pm.name!r} was already stopped ({why[len('stopped ') :]})"
    return f"mesh {pm.name!r} was already stopped ({why or 'by whom is not known'})"


def stop_proc_mesh(pm: ProcMesh, force: bool = False) -> None:
    """Stop a proc mesh this controller holds. With ranks on a host that does not answer (a
    job's lost host), the ranks elsewhere are stopped and ``ConnectError`` says so, naming that
    host and the job, as ``monarch-nb stop`` and ``stop_mesh`` do; not the heartbeat's bare
    "allocator ... lost" of one socket address, which read as if nothing had been stopped."""
    try:
        pm.stop(force=force).get(timeout=controller_client().rt.cfg.spawn_timeout)
    except Exception as e:
        allocs = {pm._procs[r].alloc for r in pm._view.ranks}
        sup = controller_client().rt.supervision
        if allocs and all(sup.was_shut_down(a) or sup.local_gone(a) for a in allocs):
            # its allocators shut down (`monarch-nb allocator stop`) or their processes are gone,
            # and the procs went with them: what was asked is done. "could not stop" said at every
            # try failed the cell (Run all stopped there) for a mesh with nothing left to stop
            root = getattr(pm, "_root", pm)
            root._stop_reason, root._stopped_outside = str(getattr(e, "cause", "") or e), True
            return
        # its allocators that did not answer, matched by the address this controller reaches them
        # at (a job's host is listed so, by the job, also once lost)
        there = [a for a in known_status()["allocators"] if a.get("error") and {a.get("addr"), a.get("tcp")} & allocs]
        addrs = {a.get(k) for a in there for k in ("addr", "tcp")}
        missing = [i for i, r in enumerate(pm._view.ranks) if pm._procs[r].alloc in addrs]
        note = _unreached_note(pm.name, there, missing=missing)
        if not note:
            raise
        n = len(pm._view.ranks) - len(missing)
        raise ConnectError(f"{plural(n, 'proc')} of mesh {pm.name!r} stopped on the allocators that answered; {note}") from e
