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
from .._ranks import format_ranks, select_ranks
from ..actor import _context, _debugwait

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


@dataclass
class _Node:
    label: str
    source: str = ""
    func: str = ""
    ranks: set[int] = field(default_factory=set)
    children: dict[Any, _Node] = field(default_factory=dict)


class Stacks:
    """What :func:`stacks` returns: per-rank stacks and their merged tree (HTML in a notebook)."""

    def __init__(self, mesh: str, ranks: list[RankStack], internal: bool) -> None:
        self.mesh = mesh
        self.ranks = ranks
        self.internal = internal
        self.root = _Node("")
        for rs in ranks:
            if rs.threads is None:
                continue
            for t in rs.threads:
                if t.get("collector"):
                    continue  # the I/O thread that answered: its stack is this request
                self._add(rs.rank, t)

    @property
    def unanswered(self) -> list[RankStack]:
        return [r for r in self.ranks if r.threads is None]

    def _add(self, rank: int, thread: dict[str, Any]) -> None:
        name = _THREAD_SUFFIX.sub("", thread["name"])
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
            shown = [("", 0, "(only monarch_nb frames: waiting for work)", "")]
        for file, line, func, src in shown:
            key = (file, line, func)
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(_frame_label(file, line, func), src or _local_source(file, line), func)
            child.ranks.add(rank)
            node = child

    # ------------------------------------------------------------ text
    def __str__(self) -> str:
        out = [f"stacks of mesh {self.mesh!r}: {len(self.ranks)} ranks"]
        for r in self.unanswered:
            out.append(f"  rank {r.rank} ({r.host} pid {r.pid}): {r.error}")
        for group, text in self._native_groups():
            out.append(f"  native stack of {_ranks(group)} (py-spy):")
            out.extend("    " + ln for ln in text.splitlines())
        for r in self.ranks:
            if r.native_error:
                out.append(f"  rank {r.rank}: native stack unavailable: {r.native_error}")
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
            f'<div class="mnb-stacks"><div><b>stacks</b> of mesh {html.escape(self.mesh)}: {len(self.ranks)} ranks</div>',
        ]
        for r in self.unanswered:
            parts.append(
                f'<div class="mnb-stack-missing" data-rank="{r.rank}">rank {r.rank} ({html.escape(r.host)} pid {r.pid}): '
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
    """The Python stack of every thread of every rank of ``mesh`` (a ProcMesh or ActorMesh),
    identical stacks merged with their rank sets. ``ranks`` picks some (``"0-3"``); ``native``
    adds ``py-spy dump --native``; every rank answers within ``timeout`` seconds or is listed
    as not answering. ``internal`` shows monarch_nb's own frames (default: the
    ``traceback_internal_frames`` setting)."""
    view = getattr(mesh, "_view", None)
    if view is None or not hasattr(mesh, "_procs"):
        raise TypeError(f"stacks() takes a ProcMesh or an ActorMesh, got {type(mesh).__name__} (%mesh stacks also takes a name)")
    procs = [mesh._procs[r] for r in view.ranks]
    idx = list(range(len(procs)))
    if ranks is not None:
        idx = select_ranks(ranks, len(procs))
    client = _context.client()
    futs = {i: client.request(procs[i].addr, "stacks", _actor="__debug__") for i in idx}
    nfuts = {}
    if native:
        nfuts = {i: client.request(procs[i].alloc, "native_stack", procs[i].pid, timeout) for i in idx if procs[i].alloc}
    deadline = time.monotonic() + timeout
    out = []
    with _debugwait.quiet():  # a housekeeping wait: paused ranks are what we are looking at
        for i in idx:
            p = procs[i]
            rs = RankStack(i, p.host, p.pid)
            try:
                got = futs[i].get(timeout=max(0.05, deadline - time.monotonic()))
                rs.threads = got["threads"]
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
                if native:
                    rs.native_error = "not a proc of an allocator"
                continue
            try:
                got = f.get(timeout=max(0.05, ndeadline - time.monotonic()))
                rs.native, rs.native_error = got.get("text", ""), got.get("error", "")
            except Exception as e:
                rs.native_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}"
    name = getattr(mesh, "_name", "?")
    return Stacks(name, out, show_internal_frames() if internal is None else internal)
