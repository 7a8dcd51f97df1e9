"""Remote tracebacks for people: runtime frames hidden, notebook cells named as IPython names
them, and the failures of many ranks grouped.

Ranks fail alike far more often than not (the same bug on every rank, or on every rank that
got a bad shard), so failures with the same exception type and the same frames are shown
once, with their rank set and the messages that differ. Pure text functions: errors.py (a
leaf) formats with them, and so can any frontend.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ._numtext import merge, template
from ._ranks import format_ranks

# a frame line; ``ind``: the indent of a traceback quoted inside a longer text (a supervision
# failure's reason, indented under its headline)
_FRAME = re.compile(r'^(?P<ind> *)  File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<func>.*)$')
#: a frame of a notebook cell as clean_traceback names it
_CELL_FRAME = re.compile(r"^(?P<ind> *)  Cell In\[\d+\], line \d+, in .*$")
_MESH_EXEC = re.compile(r"^<mesh exec In\[(\d+)\]>$")
_PKG = os.path.dirname(os.path.abspath(__file__))


def _internal(path: str) -> bool:
    """A file of monarch_nb itself (also at another path on a remote host: same relative module)."""
    i = path.rfind("/monarch_nb/")
    if i < 0:
        return False
    rel = path[i + len("/monarch_nb/") :]
    return os.path.exists(os.path.join(_PKG, rel))


def cell_number(filename: str) -> int | None:
    """The execution count of the notebook cell ``filename`` was compiled from, if it was
    (IPython's ``/tmp/ipykernel_…/….py`` names, and ``%%mesh exec`` cells' ``<mesh exec In[N]>``)."""
    m = _MESH_EXEC.match(filename)
    if m:
        return int(m.group(1))
    ipy = sys.modules.get("IPython")
    if ipy is None:
        return None
    try:
        shell = ipy.get_ipython()
        number = shell.compile._filename_map.get(filename) if shell is not None else None
    except Exception:
        return None
    return int(number) if isinstance(number, int) else None


def cell_location(filename: str, line: int) -> str:
    """``Cell In[12], line 3`` for code from a notebook cell, else ``file:line``."""
    n = cell_number(filename)
    return f"Cell In[{n}], line {line}" if n is not None else f"{filename}:{line}"


#: the ``traceback_internal_frames`` setting; :mod:`monarch_nb.config` installs its reader here
#: (config imports errors, which formats with this module: reading config from here would
#: close an import cycle)
internal_frames_setting: Callable[[], bool] = bool  # bool() is False until config installs its reader


def show_internal_frames() -> bool:
    try:
        return bool(internal_frames_setting())
    except Exception:
        return False


def clean_traceback(text: str, internal: bool | None = None) -> str:
    """``text`` (a formatted traceback) with monarch_nb's own frames dropped (unless
    ``internal``, default: the ``traceback_internal_frames`` setting) and frames of notebook
    cells named ``Cell In[N], line L`` with their source line."""
    if internal is None:
        internal = show_internal_frames()
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _FRAME.match(lines[i])
        if m is None:
            out.append(lines[i])
            i += 1
            continue
        ind = m.group("ind")
        j = i + 1
        while j < len(lines) and lines[j].startswith(ind + "    "):
            j += 1  # the frame's source line and its carets
        body = lines[i + 1 : j]
        path, lineno, func = m.group("file"), int(m.group("line")), m.group("func")
        if not internal and _internal(path):
            i = j
            continue
        n = cell_number(path)
        if n is not None:
            out.append(f"{ind}  Cell In[{n}], line {lineno}, in {func}")
            if not body:
                src = linecache.getline(path, lineno).strip()
                body = [f"{ind}    {src}"] if src else []
            out.extend(body)
        else:
            out.extend(lines[i:j])
        i = j
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def _exception_start(lines: list[str]) -> int:
    """Index of the final exception's ``Type: message`` line in a formatted traceback's lines:
    past the last frame and a SyntaxError's indented file, source and caret lines."""
    start = i = 0
    ind = ""
    while i < len(lines):
        m = _FRAME.match(lines[i]) or _CELL_FRAME.match(lines[i])
        i += 1
        if m is not None:
            ind = m.group("ind")
            while i < len(lines) and lines[i].startswith(ind + "    "):
                i += 1
            start = i
    if start == 0 and lines and lines[0].startswith("Traceback ("):
        start = 1  # no frame: the header alone
    # a traceback indented inside a message (a SupervisionError's "aborted due to: Traceback…")
    # ends with its exception at its frames' indent: only what is deeper is a SyntaxError's
    while start < len(lines) and lines[start].startswith(ind) and lines[start][len(ind) : len(ind) + 1].isspace():
        start += 1
    return start


def exception_text(tb: str) -> str:
    """The final exception of a formatted traceback as it printed: ``Type: message`` and every
    further line of the message (a message may span many lines, its traceback's last line is
    only the last of them)."""
    lines = tb.rstrip("\n").splitlines()
    return "\n".join(lines[_exception_start(lines) :])


#: a notebook's view of an error shortens a message longer than this many characters or lines
#: (a 10 KB message, a tensor's repr): the traceback above it says where, the head says what,
#: and the whole text stays one call away (the hint the view names)
SHOWN_CHARS = 2000
SHOWN_LINES = 30


def shorten_message(tb: str, hint: str) -> str:
    """``tb`` (a formatted traceback) with its final exception's message cut to about
    ``SHOWN_CHARS`` characters and ``SHOWN_LINES`` lines, followed by how long it was and ``hint``
    (where the whole of it is)."""
    lines = tb.rstrip("\n").splitlines()
    start = _exception_start(lines)
    tail = lines[start:]
    text = "\n".join(tail)
    etype, sep, said = text.partition(": ")
    size = len(said) if sep and " " not in etype.strip() else len(text)  # the message's, less "Type: "
    if size <= SHOWN_CHARS and len(tail) <= SHOWN_LINES:
        return tb
    kept: list[str] = []
    budget = SHOWN_CHARS + len(text) - size
    for ln in tail[:SHOWN_LINES]:
        if budget <= 0:
            break
        kept.append(ln[:budget])
        budget -= len(ln) + 1
    more = f", {len(tail):,} lines" if len(tail) > 1 else ""
    note = f"… (the message is {size:,} characters{more}; {hint})"
    return "\n".join([*lines[:start], *kept, note]) + ("\n" if tb.endswith("\n") else "")


def frames_of(text: str) -> tuple[str, ...]:
    """The frame lines of a traceback: what two failures must share to be grouped."""
    return tuple(ln for ln in text.splitlines() if _FRAME.match(ln))


@dataclass
class Group:
    etype: str
    ranks: list[int]
    traceback: str  # the lowest rank's
    messages: dict[int, str] = field(default_factory=dict)


def group(failures: Iterable[tuple[int, str, str, str]]) -> list[Group]:
    """``(rank, exception type, message, traceback)`` → groups of the same type and frames,
    largest first (ties: lowest rank first)."""
    by_key: dict[tuple[str, tuple[str, ...]], Group] = {}
    for rank, etype, msg, tb in sorted(failures, key=lambda f: f[0]):
        key = (etype, frames_of(tb))
        g = by_key.get(key)
        if g is None:
            g = by_key[key] = Group(etype, [], tb)
        g.ranks.append(rank)
        g.messages[rank] = msg
    return sorted(by_key.values(), key=lambda g: (-len(g.ranks), g.ranks[0]))


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


def summary_lines(groups: list[Group], total: int) -> list[str]:
    """``KeyError on 4 of 16 ranks: 0,4,8,12``, one line per type (groups of one type merged)."""
    by_type: dict[str, list[int]] = {}
    for g in groups:
        by_type.setdefault(g.etype, []).extend(g.ranks)
    out = []
    for etype, ranks in by_type.items():
        unit = "rank" if total == 1 else "ranks"
        out.append(f"{etype} on {len(ranks)} of {total} {unit}: {format_ranks(ranks)}")
    return out


def running_line(running: list[int] | int, total: int) -> str:
    if isinstance(running, int):
        verb = "was" if running == 1 else "were"
        return f"{running} of {total} ranks {verb} still running when this was raised" if running else ""
    if not running:
        return ""
    verb = "was" if len(running) == 1 else "were"
    return f"{ranks_text(running)} ({len(running)} of {total}) {verb} still running when this was raised"


def sent_after_line(others: list[int] | int, total: int, dead: list[int]) -> str:
    """The note for the other ranks of a call that failed as it was sent, because the process
    of ``dead`` had died before: they get the call after this was raised, and run it."""
    k = others if isinstance(others, int) else len(others)
    if not k:
        return ""
    who = f"{k} of {total} ranks" if isinstance(others, int) else f"{ranks_text(others)} ({k} of {total})"
    of = f"{ranks_text(dead)}'s process" if dead else "a process of the mesh"
    return (
        f"{who} had not answered: the call failed as it was sent, {of} having died before it; "
        "they get the call all the same and run it, and their replies are not waited for"
    )


#: a message in a group's list is clipped to this many characters: the group's traceback above
#: shows its lowest rank's in full, and 16 ranks' megabyte messages would otherwise be 16 MB in
#: one notebook output (a browser tab gives up on that)
MESSAGE_MAX = 300


def clip(msg: str) -> str:
    """``msg`` as one line of a list (or a headline): its first line, at most ``MESSAGE_MAX`` characters."""
    # one line each in the list: a message of many lines shows its first
    first, nl, _ = msg.partition("\n")
    if len(msg) <= MESSAGE_MAX and not nl:
        return msg
    lines = f", {msg.count(chr(10)) + 1:,} lines" if nl else ""
    return f"{first[:MESSAGE_MAX]}… ({len(msg):,} characters{lines})"


#: past this many distinct messages in a group, messages that differ only in their numbers
#: are one line (``ranks 0-15: ValueError: shard 0…15 is empty``), as rank output is
MERGE_OVER = 4


def _merged(by_msg: dict[str, list[int]]) -> dict[str, list[int]]:
    """Messages (with their ranks) that differ only in numbers, merged into one each."""
    by_template: dict[str, list[str]] = {}
    for msg in by_msg:
        by_template.setdefault(template(msg), []).append(msg)
    out: dict[str, list[int]] = {}
    for msgs in by_template.values():
        ranks = sorted(r for m in msgs for r in by_msg[m])
        out[merge(msgs) if len(msgs) > 1 else msgs[0]] = ranks
    return out


def group_lines(groups: list[Group], color: bool = False, internal: bool | None = None, shorten: str = "") -> list[str]:
    """Each group: a header with its ranks, its traceback once, and the messages that differ.
    ``shorten``: where the whole text is, for a view that shortens long messages (a notebook's)."""
    red, off = ("\x1b[0;31m", "\x1b[0m") if color else ("", "")
    out: list[str] = []
    for g in groups:
        out.append("")
        out.append(f"{red}--- {ranks_text(g.ranks)}: {g.etype}{off}")
        tb = clean_traceback(g.traceback, internal)
        out.extend((shorten_message(tb, shorten) if shorten else tb).rstrip().splitlines())
        distinct = set(g.messages.values())
        if len(distinct) > 1:
            out.append(f"messages ({len(distinct)} distinct):")
            by_msg: dict[str, list[int]] = {}
            for r, msg in g.messages.items():
                by_msg.setdefault(msg, []).append(r)
            if len(by_msg) > MERGE_OVER:
                by_msg = _merged(by_msg)
            shown = sorted(by_msg.items(), key=lambda kv: kv[1][0])
            for msg, ranks in shown[:20]:
                out.append(f"  {ranks_text(ranks)}: {g.etype}: {clip(msg)}" if msg else f"  {ranks_text(ranks)}: {g.etype}")
            if len(shown) > 20:
                out.append(f"  … {len(shown) - 20} more")
    return out
