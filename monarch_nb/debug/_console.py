"""The debugger's command loop (``list``, ``attach``, ``cast``, ``continue``), shared by the
blocked cell, the ``%mesh`` magics and ``monarch-nb debug``."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable, Iterable
from typing import Any

from ..actor import _context, _debugwait
from ..errors import ConfigError, DebugError
from ._sessions import _INT, DebugClient, Session, attach, cast_sessions, format_table, parse_ranks, sessions

_HELP = """\
Commands:
  list (l)                      the session table
  attach [ACTOR] RANK           a pdb on that rank (pdb commands: p, n, s, l, w, up, c, ...; 'detach' returns here)
  cast [ACTOR] RANKS COMMAND    run a pdb command on a rank set: 0-3, 1,5, *, ranks(0:4), ranks(1,3),
                                ranks(gpu=0), ranks(hosts=0, gpus=(1,3))
  continue                      resume every paused rank (in a waiting cell: its controller's)
  quit                          leave the debugger (paused ranks stay paused)
  help                          this text
"""


def _split_ranks(text: str) -> tuple[str, str] | None:
    """``text``'s first word and the rest; a ``ranks(...)`` first word may hold spaces and
    parentheses (``ranks(hosts=0, gpus=(1,3))``)."""
    text = text.lstrip()
    if text.startswith("ranks("):
        depth = 0
        for i, ch in enumerate(text):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0 and ch == ")":
                rest = text[i + 1 :].strip()
                return (text[: i + 1], rest) if rest else None
        return None
    parts = text.split(None, 1)
    return (parts[0], parts[1].strip()) if len(parts) == 2 else None


class Console:
    """The debugger's command loop: one line in, text out.

    ``execute(line)`` runs one command (``False`` after ``quit``); ``interact(read)`` loops over
    ``read(prompt)`` (default ``input``: a terminal, or a kernel cell's input box). ``write`` receives all output.
    """

    prompt = "monarch_dbg> "

    def __init__(
        self,
        write: Callable[[str], Any] | None = None,
        *,
        addresses: Iterable[str] | None = None,
        raise_errors: bool = False,
        own: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        self.write = write or _stdout_write
        self.addresses = list(addresses or [])
        #: the sids ``continue`` resumes (None: every paused rank). A blocked cell's console
        #: passes its controller's own: the table lists every controller's paused ranks, and
        #: another notebook's user may be in the middle of debugging theirs
        self.own = own
        self.attached: DebugClient | None = None
        self.quit = False
        #: commands that failed (an error, an unknown command, a usage message): ``monarch-nb
        #: debug -c`` exits non-zero after one, so a script sees it
        self.failures = 0
        #: ``raise_errors``: a failed command raises :class:`DebugError` with its message rather
        #: than writing it (a magic, whose cell must fail: "Run all" stops there)
        self.raise_errors = raise_errors

    @property
    def current_prompt(self) -> str:
        if self.attached is not None:
            s = self.attached.session
            return f"(Pdb {s.actor} {s.rank}) " if s.actor else f"(Pdb {s.rank}) "
        return self.prompt

    def banner(self) -> None:
        self.write(
            "\n" + "*" * 24 + " MONARCH_NB DEBUGGER " + "*" * 24 + "\n\n"
            "Enter 'help' for a list of commands.\nEnter 'list' to show all active breakpoints.\n\n"
        )

    def show_table(self) -> None:
        self.write(format_table(sessions(addresses=self.addresses)))

    def interact(
        self,
        read: Callable[[str], str] | None = None,
        *,
        first: str | None = None,
        until: Callable[[], bool] | None = None,
        leave_on_detach: bool = False,
    ) -> None:
        """Read and run commands until ``quit``, end of input, or ``until()`` (checked when not attached).

        ``first`` runs before the first read (``%mesh attach`` passes ``"attach ACTOR RANK"``);
        ``leave_on_detach`` returns once an attached session is detached or continues.
        """
        if read is None:
            # looked up now, not at import: a kernel swaps builtins.input for its stdin channel per request
            import builtins

            read = builtins.input
        if first and not self.execute(first):
            return
        been = self.attached is not None  # attached before the loop (first, or the caller)
        while True:
            if self.attached is None:
                if leave_on_detach and (first or been):
                    return
                if until is not None and until():
                    return
            been = been or self.attached is not None
            try:
                line = read(self.current_prompt)
            except EOFError:
                self.write("\n")
                return
            if not self.execute(line):
                return

    def execute(self, line: str) -> bool:
        """Run one command; returns False when the user asked to leave."""
        try:
            if self.attached is not None:
                return self._pdb(line)
            return self._command(line)
        except Exception as e:  # a console reports and goes on; only quit, EOF and interrupts leave it
            if self.raise_errors:
                raise
            msg = str(e) if isinstance(e, (DebugError, ValueError)) else f"{type(e).__name__}: {e}"
            self._fail(f"error: {msg}")
            return True

    def _fail(self, text: str) -> None:
        self.failures += 1
        if self.raise_errors:
            raise DebugError(text.removeprefix("error: "))
        self.write(text + "\n")

    def _pdb(self, line: str) -> bool:
        client = self.attached
        assert client is not None
        if line.strip() == "detach":
            self.write(f"Detached from rank {client.session.rank}; it stays paused.\n")
            client.detach()
            self.attached = None
            return True
        try:
            out = client.send(line)
        except DebugError as e:
            self._fail(f"error: {e}")
            self.attached = None
            return True
        except KeyboardInterrupt:
            # a command that does not return (`n` over a collective the other ranks never join):
            # the rank cannot be interrupted from here, but the console can stop waiting for it
            s = client.session
            self.attached = None
            self._interrupted(
                f"rank {s.rank} is still running {line.strip()!r}; detached. It pauses again when that "
                f"returns: 'list' shows it as running until then, 'attach {s.actor + ' ' if s.actor else ''}{s.rank}' goes on."
            )
            return True
        self.write(out if not out or out.endswith("\n") else out + "\n")
        if client.ended:
            self.write(ended_message(client))
            self.attached = None
        return True

    def _interrupted(self, text: str) -> None:
        """Ctrl-C while a command ran on ranks: say what goes on and stay in the console (a
        second Ctrl-C, at the prompt, leaves it), rather than unwind through the wait."""
        if self.raise_errors:
            raise DebugError(f"interrupted: {text}") from None
        self.write(f"\ninterrupted: {text}\n")

    def _command(self, line: str) -> bool:
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        if not words:
            return True
        cmd = words[0].lower()
        if cmd in ("cast", "continue", "c", "cont"):
            try:
                self._run(cmd, words[1:], line)
            except KeyboardInterrupt:
                self._interrupted(
                    "ranks still running the command go on with it and pause again when it returns "
                    "('list' shows them as running until then)."
                )
            return True
        return self._run(cmd, words[1:], line)

    def _run(self, cmd: str, args: list[str], line: str) -> bool:
        if cmd in ("help", "h", "?"):
            self.write(_HELP)
        elif cmd in ("list", "l", "ls", "sessions"):
            self.show_table()
        elif cmd in ("attach", "a"):
            self._attach(args)
        elif cmd == "cast":
            self._cast(line)
        elif cmd in ("continue", "c", "cont"):
            res = cast_sessions(None, None, "c", addresses=self.addresses, sids=None if self.own is None else set(self.own()))
            self.write(f"continued {len(res)} rank(s)\n" if res else "no paused ranks\n")
            self._outputs(res, only_said=True)
            if self.own is not None:
                done = {r.sid for r, _ in res}
                left = [t for t in sessions(include_gone=False, addresses=self.addresses) if t.sid not in done]
                # a rank of ours listed again stopped since (post-mortem: its call raised after the breakpoint)
                again = [t for t in left if _debugwait.is_ours(t.call_id)]
                others = [t for t in left if not _debugwait.is_ours(t.call_id)]
                if again:
                    pm = [t for t in again if t.post_mortem]
                    how = "post-mortem (their call raised after the breakpoint)" if len(pm) == len(again) else "again"
                    self.write(f"{len(again)} rank(s) stopped {how}: 'list' shows them, 'continue' resumes them\n")
                if others:
                    self.write(
                        f"{len(others)} rank(s) stopped in other controllers' calls stay paused ('cast * c' resumes them too)\n"
                    )
        elif cmd in ("quit", "exit", "q"):
            self.quit = True
            return False
        else:
            self._fail(f"unknown command {cmd!r}; type 'help'")
        return True

    def _attach(self, args: list[str]) -> None:
        if len(args) == 1 and _INT.match(args[0]):
            actor, rank = None, int(args[0])
        elif len(args) == 2 and _INT.match(args[1]):
            actor, rank = args[0], int(args[1])
        else:
            self._fail("usage: attach [ACTOR] RANK")
            return
        client = attach(actor, rank, addresses=self.addresses)
        s = client.session
        self.attached = client
        self.write(f"Attached to debug session for rank {s.rank} ({s.host})\n{s.header}\n")

    def _cast(self, line: str) -> None:
        first = _split_ranks(line.lstrip()[len("cast") :])
        if first is None:
            self._fail("usage: cast [ACTOR] RANKS COMMAND")
            return
        actor: str | None = None
        ranks, cmd = first
        second = _split_ranks(cmd)
        if second is not None and (not _is_rank_set(ranks) or ranks in {s.actor for s in sessions(addresses=self.addresses)}):
            actor, (ranks, cmd) = ranks, second  # the first word was an actor name
        res = cast_sessions(actor, parse_ranks(ranks), cmd, addresses=self.addresses)
        if not res:
            self.write(f"no paused ranks match {ranks}\n")
        self._outputs(res)

    def _outputs(self, res: list[tuple[Session, str]], only_said: bool = False) -> None:
        """One ``[rank]`` line per output line; ``[actor rank]`` when the ranks are of several actors."""
        several = len({s.actor_id or s.actor for s, _ in res}) > 1
        for s, out in sorted(res, key=lambda so: (so[0].rank, so[0].actor, so[0].actor_id)):
            if only_said and not out.strip():
                continue
            tag = f"[{s.actor or '-'} {s.rank}]" if several else f"[{s.rank}]"
            self.write(f"{tag} " + (out.rstrip().replace("\n", f"\n{tag} ") if out.strip() else "") + "\n")


def _is_rank_set(word: str) -> bool:
    try:
        parse_ranks(word)
    except ValueError:
        return False
    return True


def ended_message(client: DebugClient) -> str:
    """What to tell the user once a command ended ``client``'s session."""
    rank = client.session.rank
    if client.session.post_mortem:
        return f"rank {rank} left post-mortem: its call fails with {client.session.post_mortem}.\n"
    if client.quit:
        return f"rank {rank} quit pdb: its endpoint raises BdbQuit, so its call fails ('c' lets a rank go on).\n"
    return f"rank {rank} continued.\n"


def _stdout_write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# ---------------------------------------------------------------------------- the CLI
def run_cli(addresses: list[str] | None = None, key_file: str | None = None, commands: list[str] | None = None) -> int:
    """``monarch-nb debug``: the console in a terminal (or over a pipe), or run ``commands`` and exit."""
    if key_file:
        if _context._runtime is not None:
            raise ConfigError("set the key file before monarch_nb starts its runtime")
        os.environ["MONARCH_NB_KEY_FILE"] = key_file
    client = _context.client()  # a key file that cannot be read is a ConfigError here, not a failed command
    for a in addresses or []:
        # listing skips allocators that do not answer: an address the user typed must answer, or
        # a wrong one would read as "no debug sessions"
        client.connect(a)
    con = Console(addresses=addresses)
    if commands:
        for c in commands:
            con.write(con.current_prompt + c + "\n")
            if not con.execute(c):
                break
        return 1 if con.failures else 0
    con.banner()
    try:
        con.interact(input)
    except KeyboardInterrupt:
        con.write("\n")
    return 0
