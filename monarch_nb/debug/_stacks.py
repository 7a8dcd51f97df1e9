"""Stacks of every rank: every thread's Python stack, merged across ranks into one tree.

Each proc answers on its I/O thread (``__debug__.stacks``), so a rank blocked in a collective,
in a C call that released the GIL, or paused in pdb still answers. A rank that gives no answer
within the deadline is listed as such: its I/O thread could not get the GIL (a C call holding
it) or the process is stopped. ``native=True`` adds ``py-spy dump --native`` from each rank's
allocator, when py-spy is installed there (``pip install 'monarch_nb[stacks]'``).
"""

from __future__ import annotations

import html
import re
import time
from dataclasses import dataclass, field
from typing import Any

from .._errgroup import _internal, cell_number, show_internal_frames
from .._numtext import plural
from .._ranks import format_ranks, select_ranks
from ..actor import _context, _debugwait, _stackdump
from ..actor._refs import ProcRef

__all__ = ["Stacks", "stacks"]

#: thread names that carry a rank or an id (``monarch_nb-io-trainers[3]``), made alike across ranks
_THREAD_SUFFIX = re.compile(r"\[\d+\]$")
#: where every thread starts: not worth a line in each stack
_BOOTSTRAP = {("threading.py", "_bootstrap"), ("threading.py", "_bootstrap_inner"), ("threading.py", "run")}
#: names of the threads monarch_nb starts in a proc for itself (log flushing, the data plane)
_OWN_THREAD = re.compile(r"^(?:mnb|monarch_nb)-")
#: a standard-library file (not an installed package's)
_STDLIB = re.compile(r"/lib/python3\.\d+/(?!(?:site|dist)-packages/)")


@dataclass
class RankStack:
    rank: int
    host: str
    pid: int
    threads: list[dict[str, Any]] | None = None
    error: str = ""
    native: str = ""
    native_error: str = ""
    #: each actor's running calls and asyncio tasks (``_stackdump.collect``'s ``actors``)
    actors: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Node:
    label: str
    source: str = ""
    func: str = ""
    ranks: set[int] = field(default_factory=set)
    children: dict[Any, _Node] = field(default_factory=dict)
    #: (a call's or task's top node) how long its calls have run, who called them, how many
    ages: list[float] = field(default_factory=list)
    callers: set[str] = field(default_factory=set)
    count: int = 0


class Stacks:
    """What :func:`stacks` returns: per-rank stacks and their merged tree (HTML in a notebook)."""

    def __init__(self, mesh: str, ranks: list[RankStack], internal: bool, callers: dict[str, str] | None = None) -> None:
        self.mesh = mesh
        self.ranks = ranks
        self.internal = internal
        self.root = _Node("")
        #: caller address -> how to name it ("this controller", "rank 3")
        self._callers = callers or {}
        #: (actor, ranks) of tasks left out of a rank's answer (too many distinct stacks)
        self.left_out: dict[str, dict[int, int]] = {}
        for rs in ranks:
            if rs.threads is None:
                continue
            waiting = {a for a, v in rs.actors.items() if any(self._shown(g) for g in v.get("groups", []))}
            for t in rs.threads:
                if t.get("collector"):
                    continue  # the I/O thread that answered: its stack is this request
                self._add(rs.rank, t, t.get("actor") in waiting)
            for a, v in rs.actors.items():
                for g in v.get("groups", []):
                    if self._shown(g):
                        self._add_calls(rs.rank, a, g)
                if v.get("left_out"):
                    self.left_out.setdefault(_actor_name(a), {})[rs.rank] = v["left_out"]
                if v.get("queued"):
                    self._add_queued(rs.rank, a, v)
        for key, node in self.root.children.items():
            if key[0] == "queued":
                node.label = f"queued for {key[1]}: {_calls(node.count)} (each starts when the one before it has ended)"
                for child in node.children.values():
                    child.label = self._queued_label(child)
            elif node.count:
                node.label = self._call_label(node)

    @property
    def unanswered(self) -> list[RankStack]:
        return [r for r in self.ranks if r.threads is None]

    def _add(self, rank: int, thread: dict[str, Any], tasks_below: bool = False) -> None:
        name = _THREAD_SUFFIX.sub("", thread["name"])
        if thread.get("actor"):
            name += f" ({_actor_name(thread['actor'])})"
        frames = [
            f for f in thread["frames"] if (f[0].rsplit("/", 1)[-1], f[2]) not in _BOOTSTRAP and not f[0].startswith("<frozen ")
        ]
        if not self.internal and _OWN_THREAD.match(name) and all(_internal(f[0]) or _STDLIB.search(f[0]) for f in frames):
            # monarch_nb's own thread waiting in the standard library (a Condition, a socket):
            # a line in every stack that says nothing about the user's code; one running the
            # user's code (a module reloading) is shown
            return
        node = self.root.children.setdefault(("thread", name), _Node(f"thread {name}"))
        node.ranks.add(rank)
        shown = [f for f in frames if self.internal or not _internal(f[0])]
        if frames and not shown:
            # an async actor's loop thread waits in select while its calls are suspended at awaits
            what = (
                "(event loop idle: its calls and tasks wait at awaits, listed below)"
                if tasks_below
                else "(only monarch_nb frames: waiting for work)"
            )
            shown = [("", 0, what, "")]
        for file, line, func, src in shown:
            key = (file, line, func)
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(_frame_label(file, line, func), src or _local_source(file, line), func)
            child.ranks.add(rank)
            node = child

    def _shown(self, g: dict[str, Any]) -> bool:
        """A group worth a block: a call, or a task running code other than monarch_nb's own
        (the actor's loop waiting for its next message is not)."""
        return bool(g.get("method")) or self.internal or not all(_internal(f[0]) for f in g.get("frames", []))

    def _add_calls(self, rank: int, actor: str, g: dict[str, Any]) -> None:
        name = _actor_name(actor)
        method = g.get("method")
        key = ("call", name, method) if method else ("task", name, g.get("task"))
        node = self.root.children.get(key)
        if node is None:
            node = self.root.children[key] = _Node(f"call {name}.{method}" if method else f"task {name}: {g.get('task')}")
        node.ranks.add(rank)
        node.count += g.get("count", 1)
        for _call_id, caller, age in g.get("calls", []):
            node.ages.append(age)
            node.callers.add(self._callers.get(caller, caller or "nobody (no reply wanted)"))
        frames = [f for f in g.get("frames", []) if not f[0].startswith("<frozen ")]
        shown = [f for f in frames if self.internal or not _internal(f[0])]
        if g.get("running"):
            tail = (
                "(running now on the event loop thread: its stack is above)"
                if g.get("task")
                else "(on the actor's thread: its stack is above)"
            )
        else:
            tail = f"({g.get('awaiting') or 'ready to run: waiting for its turn on the event loop'})"
        for file, line, func, src in [*shown, ("", 0, tail, "")]:
            k = (file, line, func)
            child = node.children.get(k)
            if child is None:
                child = node.children[k] = _Node(
                    _frame_label(file, line, func), src or _local_source(file, line), func if file else ""
                )
            child.ranks.add(rank)
            node = child

    def _add_queued(self, rank: int, actor: str, v: dict[str, Any]) -> None:
        """The calls waiting in an actor's mailbox behind its running ones: one block per
        actor, a line per method and caller, the rest (past the first few) counted."""
        name = _actor_name(actor)
        node = self.root.children.setdefault(("queued", name), _Node(f"queued for {name}"))
        node.ranks.add(rank)
        node.count += int(v["queued"])
        named = v.get("queued_calls") or []
        for method, _call_id, caller, age in named:
            who = self._callers.get(caller, caller or "nobody (no reply wanted)")
            child = node.children.setdefault((method, who), _Node(f"{name}.{method}"))
            child.ranks.add(rank)
            child.count += 1
            child.callers.add(who)
            if age is not None:
                child.ages.append(age)
        rest = int(v["queued"]) - len(named)
        if rest > 0:
            child = node.children.setdefault(("", ""), _Node("more"))
            child.ranks.add(rank)
            child.count += rest

    def _queued_label(self, node: _Node) -> str:
        if node.label == "more":
            return f"and {_calls(node.count)} more behind them"
        n = len(node.ranks)
        parts = [node.label + (f" ×{node.count}" if node.count != n else "")]
        if node.callers:
            parts.append("called by " + ", ".join(sorted(node.callers)))
        # a mailbox keeps no arrival times: what an earlier dump saw queued is at least that old
        lo, hi = min(node.ages, default=0.0), max(node.ages, default=0.0)
        if node.ages and len(node.ages) < node.count:
            parts.append(f"the first queued for at least {hi:.1f} s")  # the others came since the last dump
        elif node.ages:
            parts.append(
                f"queued for at least {lo:.1f} s" if f"{lo:.1f}" == f"{hi:.1f}" else f"queued for at least {lo:.1f}-{hi:.1f} s"
            )
        return " · ".join(parts)

    def _call_label(self, node: _Node) -> str:
        n = len(node.ranks)
        parts = [node.label + (f" ×{node.count}" if node.count != n else "")]
        if node.ages:
            lo, hi = min(node.ages), max(node.ages)
            parts.append(f"running for {lo:.1f} s" if f"{lo:.1f}" == f"{hi:.1f}" else f"running for {lo:.1f}-{hi:.1f} s")
        if node.callers:
            shown = sorted(node.callers)
            parts.append("called by " + ", ".join(shown[:4]) + (f" and {len(shown) - 4} more" if len(shown) > 4 else ""))
        return " · ".join(parts)

    # ------------------------------------------------------------ text
    def __str__(self) -> str:
        out = [f"stacks of mesh {self.mesh!r}: {plural(len(self.ranks), 'rank')}"]
        for r in self.unanswered:
            out.append(f"  rank {r.rank} ({r.host}{f' pid {r.pid}' if r.pid else ''}): {r.error}")
        for group, text in self._native_groups():
            out.append(f"  native stack of {_ranks(group)} (py-spy):")
            out.extend("    " + ln for ln in text.splitlines())
        for r in self.ranks:
            if r.native_error:
                out.append(f"  rank {r.rank}: native stack unavailable: {r.native_error}")
        out.extend("  " + ln for ln in self._left_out_lines())
        for child in self.root.children.values():
            self._text(child, 1, out, True)
        return "\n".join(out)

    __repr__ = __str__

    def _text(self, node: _Node, depth: int, out: list[str], top: bool) -> None:
        chain = _chain(node)
        ind = "  " * depth
        out.append(ind + f"[{_ranks(sorted(node.ranks))}]" + (f" {chain[0].label}" if top else ""))
        for n in chain[1:] if top else chain:
            out.append(ind + "  " + n.label)
            if n.source:
                out.append(ind + "      " + n.source)
        for child in chain[-1].children.values():
            self._text(child, depth + 1, out, False)

    # ------------------------------------------------------------ html
    def _repr_html_(self) -> str:
        parts = [
            _CSS,
            f'<div class="mnb-stacks"><div><b>stacks</b> of mesh {html.escape(self.mesh)}: {plural(len(self.ranks), "rank")}</div>',
        ]
        for r in self.unanswered:
            parts.append(
                f'<div class="mnb-stack-missing" data-rank="{r.rank}">rank {r.rank} '
                f"({html.escape(r.host)}{f' pid {r.pid}' if r.pid else ''}): "
                f"{html.escape(r.error)}</div>"
            )
        for group, text in self._native_groups():
            parts.append(
                f'<details class="mnb-native"><summary>native stack of {_ranks(group)} (py-spy)</summary>'
                f"<pre>{html.escape(text)}</pre></details>"
            )
        for r in self.ranks:
            if r.native_error:
                parts.append(
                    f'<div class="mnb-note">rank {r.rank}: native stack unavailable: {html.escape(r.native_error)}</div>'
                )
        for ln in self._left_out_lines():
            parts.append(f'<div class="mnb-note">{html.escape(ln)}</div>')
        for child in self.root.children.values():
            parts.append(self._html(child, True))
        parts.append("</div>")
        return "".join(parts)

    def _html(self, node: _Node, top: bool) -> str:
        chain = _chain(node)
        ranks = sorted(node.ranks)
        frames = "".join(
            f'<div class="mnb-frame">{html.escape(n.label)}'
            + (f'<div class="mnb-src">{html.escape(n.source)}</div>' if n.source else "")
            + "</div>"
            for n in (chain if not top else chain[1:])
        )
        # summary text only (JupyterLab lays out elements inside <summary> as blocks): the rank
        # set, and the thread, or the function the ranks are in at the end of this block
        head = chain[0].label if top else f"in {chain[-1].func}" if chain[-1].func else chain[-1].label
        kids = "".join(self._html(c, False) for c in chain[-1].children.values())
        return (
            f'<details open class="mnb-stack-node" data-ranks="{format_ranks(ranks)}">'
            f"<summary>{html.escape(f'{_ranks(ranks)} · {head}')}</summary>"
            f'<div class="mnb-frames">{frames}</div>{kids}</details>'
        )

    def _left_out_lines(self) -> list[str]:
        out = []
        for actor, by_rank in self.left_out.items():
            ranks = sorted(by_rank)
            out.append(
                f"{_ranks(ranks)}: {plural(sum(by_rank.values()), 'task')} of {actor} left out "
                f"(each rank sends its first {_stackdump.MAX_GROUPS} distinct stacks per actor)"
            )
        return out

    def _native_groups(self) -> list[tuple[list[int], str]]:
        by: dict[str, list[int]] = {}
        text_of: dict[str, str] = {}
        for r in self.ranks:
            if r.native:
                key = re.sub(r"0x[0-9a-fA-F]+|\d+", "N", r.native)  # pids, thread ids, ranks in names
                by.setdefault(key, []).append(r.rank)
                text_of.setdefault(key, r.native)
        return [(ranks, text_of[k]) for k, ranks in by.items()]


_CSS = """<style>
.mnb-stacks { font-family: var(--jp-code-font-family, monospace); font-size: 12px; }
.mnb-stacks details { margin-left: 14px; border-left: 1px solid #d0d7de; padding-left: 6px; }
.mnb-stacks > details { margin-left: 0; }
.mnb-stacks summary { cursor: pointer; color: #0969da; font-weight: 600; }
.mnb-stacks .mnb-src { color: #57606a; margin-left: 16px; }
.mnb-stacks .mnb-stack-missing { color: #cf222e; }
</style>"""


def _chain(node: _Node) -> list[_Node]:
    """``node`` and the single-child descendants that ran on the same ranks (one block)."""
    chain = [node]
    while len(chain[-1].children) == 1:
        nxt = next(iter(chain[-1].children.values()))
        if nxt.ranks != node.ranks:
            break
        chain.append(nxt)
    return chain


def _calls(n: int) -> str:
    return f"{n} call" + ("" if n == 1 else "s")


def _actor_name(name: str) -> str:
    """``trainer#1a2b.3`` -> ``trainer``: the same on every rank."""
    return name.partition("#")[0]


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)} ({len(ranks)})"


_LIB = re.compile(r"^.*/(?:site-packages|dist-packages|lib/python3\.\d+)/")


def _frame_label(file: str, line: int, func: str) -> str:
    if not file:
        return func
    n = cell_number(file)
    # installed and standard-library modules by their module path: the prefix is the same everywhere
    where = f"Cell In[{n}], line {line}" if n is not None else f"{_LIB.sub('', file)}:{line}"
    return f"{func} ({where})"


def _local_source(file: str, line: int) -> str:
    """Source the rank could not read: code from this notebook's cells, or a module this
    process runs (a script's ``__main__``), whose file the ranks' hosts may not have."""
    if not file:
        return ""
    import linecache
    import sys

    if cell_number(file) is None and file not in {getattr(m, "__file__", None) for m in list(sys.modules.values())}:
        return ""
    return linecache.getline(file, line).strip()


def stacks(
    mesh: Any, ranks: str | list[int] | None = None, *, native: bool = False, timeout: float = 5.0, internal: bool | None = None
) -> Stacks:
    """The Python stack of every thread of every rank of ``mesh`` (a ProcMesh or ActorMesh, or
    the name of a proc mesh of this host's allocators or its jobs', as ``introspect.known_status()`` lists it: also
    one another controller owns, or whose kernel is gone), identical stacks merged with their rank sets. ``ranks`` picks some (``"0-3"``); ``native``
    adds ``py-spy dump --native``; every rank answers within ``timeout`` seconds or is listed
    as not answering. ``internal`` shows monarch_nb's own frames (default: the
    ``traceback_internal_frames`` setting)."""
    callers: dict[str, str] = {}
    procs: list[ProcRef | None]
    unreached: tuple[str, str] = ("", "")
    if isinstance(mesh, str):
        # by rank: a rank on a host that does not answer has no proc here (None), and is listed as such
        name, procs, unreached = mesh, *_procs_named(mesh, timeout, callers)
    else:
        view = getattr(mesh, "_view", None)
        if view is None or not hasattr(mesh, "_procs"):
            raise TypeError(
                f"stacks() takes a ProcMesh, an ActorMesh or a mesh's name, got {type(mesh).__name__} "
                "(%mesh stacks also takes a name)"
            )
        # an actor mesh by its procs' mesh, whose threads these are (its own name is a spawn id, `trainer#1a2b.3`)
        name = str(getattr(getattr(mesh, "_proc_mesh", None), "_name", None) or getattr(mesh, "_name", "?"))
        procs = [mesh._procs[r] for r in view.ranks]
    idx = list(range(len(procs)))
    if ranks is not None:
        idx = select_ranks(ranks, len(procs))
    client = _context.client()
    futs = {i: client.request(p.addr, "stacks", _actor="__debug__") for i in idx if (p := procs[i]) is not None}
    nfuts = {}
    if native:
        client.revive_lost((p.alloc for i in idx if (p := procs[i]) is not None), timeout)
        nfuts = {
            i: client.request(p.alloc, "native_stack", p.pid, timeout) for i in idx if (p := procs[i]) is not None and p.alloc
        }
    deadline = time.monotonic() + timeout
    out = []
    try:
        with _debugwait.quiet():  # a housekeeping wait: paused ranks are what we are looking at
            for i in idx:
                p = procs[i]
                if p is None:
                    out.append(RankStack(i, unreached[0], 0, error=unreached[1]))
                    continue
                rs = RankStack(i, p.host, p.pid)
                try:
                    got = futs[i].get(timeout=max(0.05, deadline - time.monotonic()))
                    rs.threads = got["threads"]
                    actors = got.get("actors")
                    # an older proc sends {actor: [methods]}: no calls to show
                    rs.actors = {a: v for a, v in actors.items() if isinstance(v, dict)} if isinstance(actors, dict) else {}
                except TimeoutError:
                    rs.error = (
                        f"no answer within {timeout:g} s: its I/O thread could not get the GIL "
                        "(a C call holding it) or the process is stopped"
                    )
                except Exception as e:
                    rs.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}"
                out.append(rs)
            ndeadline = time.monotonic() + timeout + 5.0  # py-spy itself has `timeout`
            for rs in out:
                f = nfuts.get(rs.rank)
                if f is None:
                    if native and not rs.error:
                        rs.native_error = "not a proc of an allocator"
                    continue
                try:
                    got = f.get(timeout=max(0.05, ndeadline - time.monotonic()))
                    rs.native, rs.native_error = got.get("text", ""), got.get("error", "")
                except Exception as e:
                    rs.native_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}"
    except KeyboardInterrupt as e:
        # the note was "only the wait stopped: stacks on ipc:///…/mnb-25942e9b2ae0.sock goes on"
        e.__notes__ = [n for n in getattr(e, "__notes__", []) if "only the wait stopped" not in n]
        late = [i for i, f in futs.items() if not f.done()]
        who = ", ".join(f"{i} (pid {p.pid} on {p.host})" for i in late if (p := procs[i]) is not None)
        if who:
            e.add_note(
                f"monarch_nb: interrupted while waiting for the stacks of mesh {name!r}: "
                f"rank{'s' if len(late) > 1 else ''} {who} had not answered (a C call holding the GIL, or a "
                f"stopped process); `%mesh stacks {name} --native` adds their native stacks (py-spy)"
            )
        raise
    callers.update({p.addr: f"rank {i}" for i, p in enumerate(procs) if p is not None})
    for a in (getattr(client.rt, "ipc_addr", ""), getattr(client.rt, "tcp_addr", "")):
        if a:
            callers[a] = "this controller"
    return Stacks(name, out, show_internal_frames() if internal is None else internal, callers)


def _procs_named(name: str, timeout: float, callers: dict[str, str]) -> tuple[list[ProcRef | None], tuple[str, str]]:
    """The procs of mesh ``name`` as this host's allocators (and its jobs') list them, asked as any controller
    asks: no lookup that would own them or subscribe to their output (`monarch-nb stacks` of a
    hung kernel's mesh must leave its owner as it is). ``callers`` gets the name of each
    controller attached there, by address: the owner's calls show who made them.

    By rank, over the mesh's extent: None for a rank no allocator that answered runs (a job's lost
    host), with the host and the words for those."""
    from ..config import runtime_dir
    from ..errors import MeshNotFoundError
    from ..introspect import _missing_ranks, _unreached_where, known_status

    procs: list[ProcRef] = []
    names: set[str] = set()
    # the jobs' allocators too: a ProcessJob's, SSHJob's or SlurmJob's records are in the job's directory
    found = known_status(timeout=timeout)["allocators"]
    for a in found:
        for c in a.get("controllers", []):
            if c.get("addr"):
                callers[c["addr"]] = f"controller {c.get('cid')} (pid {c.get('pid')})"
        for m in a.get("meshes", []):
            names.add(m["name"])
            if m["name"] == name:
                procs += [ProcRef(p["addr"], a["addr"], a.get("host", ""), p["pid"], name, p["rank"]) for p in m["procs"]]
    gone = _unreached_where(found)
    if not procs:
        raise MeshNotFoundError(
            f"no mesh named {name!r} on this host's allocators or its jobs' (runtime directory {runtime_dir()}; "
            f"meshes: {', '.join(sorted(names)) or 'none'}" + (f"), and these could not be reached: {gone}" if gone else ")"),
            name,
        )
    size, missing = _missing_ranks(name, found)
    by_rank: list[ProcRef | None] = [None] * max(size, 1 + max(p.rank for p in procs))
    for p in procs:
        by_rank[p.rank] = p
    lost = [a for a in found if a.get("error")]
    host = str(lost[0].get("host") or "?") if len(lost) == 1 else "host not known"
    why = (
        f"on no allocator that answered, and these could not be reached: {gone}"
        if missing and gone
        else "not listed by its allocator"
    )
    return by_rank, (host, why)
