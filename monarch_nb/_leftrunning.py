"""The cells a failure left running: a ``%%mesh exec`` cell that failed while some of its ranks
still ran it (blocked in a collective with the failed rank, perhaps). What they did then came
back to no one: the next cell on the mesh asks them, and :func:`left_text` says (``mesh``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._errgroup import clip, ranks_text

if TYPE_CHECKING:
    from .actor import Future


@dataclass
class LeftRunning:
    """A cell that failed while some of its ranks still ran it: blocked in a collective with
    the failed rank, perhaps, until the user frees them (the ExecError's advice). What they
    raised then came back to no one: the next cell on the mesh asks them, and says."""

    am: Any
    label: str
    #: the ranks the cell ran on
    ranks: list[int]
    #: how the cell failed, a line per kind (the ranks that raised alike, or the rank that died)
    cause: list[str]
    #: the ranks it failed on
    failed: list[int]
    #: the ranks not yet heard from (a ``--ranks`` cell's running ranks are not known by name:
    #: every rank of it that did not fail)
    waiting: list[int]
    #: rank -> its answer to ``ExecActor.outcome``, once asked
    asked: dict[int, Future[list[Any]]] = field(default_factory=dict)
    #: a cell waited LEFT_WAIT and heard from none: later cells do not wait
    waited: bool = False


#: mesh name -> its cell whose failure left ranks running, until what they did is told
left_by_mesh: dict[str, LeftRunning] = {}
#: how long a cell that may have freed the ranks an earlier cell left running waits for them to
#: answer how it ended there: one that freed them (destroying the process group they wait on) is
#: answered within milliseconds, as their collective fails
LEFT_WAIT = 2.0
#: once a rank has answered, how long the others get to
LEFT_MORE = 0.5


def left_text(name: str, left: LeftRunning, wait: float) -> str:
    """What the ranks ``left`` still waits for did with its cell, for those that have ended it
    since (one line per group of them, after the cell's own error), and which still run it;
    "" when none has."""
    import time

    from ._numtext import merge, template

    deadline = time.monotonic() + wait
    for q in left.asked.values():
        try:
            q.get(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            break
        except Exception:
            pass
        # the ranks one freed free theirs within milliseconds: past that, the rest wait on
        # something else (a rank not freed yet), and this cell has waited enough
        deadline = min(deadline, time.monotonic() + LEFT_MORE)
    answered = {i: q for i, q in left.asked.items() if q.done()}
    if not answered:
        left.waited = left.waited or wait > 0
        return ""
    left.waited = False
    ended: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for i, q in answered.items():
        del left.asked[i]
        left.waiting.remove(i)
        try:
            got = q.get(timeout=0)[0]
        except Exception:
            continue  # its process died since: that death is told as such
        if got is not None:
            etype, msg = got
            ended.setdefault((etype, template(clip(msg))), []).append((i, clip(msg)))
    if not left.waiting and left_by_mesh.get(name) is left:
        del left_by_mesh[name]
    if not ended:
        return ""
    n = len(left.ranks)
    some = " some of" if left.waiting else ""
    lines = [f"cell {left.label} on mesh {name!r} has now ended on{some} the other ranks:"]
    lines.extend(f"  {c}" for c in left.cause)
    # grouped by what they raised (messages differing only in numbers, gloo's ports say, are one)
    for (etype, _), got in sorted(ended.items(), key=lambda kv: kv[1][0][0]):
        ranks = sorted(i for i, _ in got)
        who = f"  {ranks_text(ranks)} ({len(ranks)} of {n})"
        lines.append(f"{who} then raised {etype}: {merge([m for _, m in got])}" if etype else f"{who} then finished it")
    if left.waiting:
        # in a collective with ranks that are out of theirs, perhaps (gloo's ring: the failed rank's
        # neighbours are), whose groups stay open until dropped and destroyed there too
        still = left.waiting
        freed = ranks_text([i for i in left.ranks if i not in still and i not in left.failed])
        runs, it = ("runs", "it") if len(still) == 1 else ("run", "them")
        lines.append(
            f"  {ranks_text(still)} ({len(still)} of {n}) still {runs} it: waiting, perhaps, for {freed} in a "
            f"collective, whose process group is broken there but open: dropping it on {freed} (model = model.module, "
            f"dist.destroy_process_group()) frees {it}"
        )
    return "\n".join(lines)
