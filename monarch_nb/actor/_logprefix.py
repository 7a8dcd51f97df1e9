"""Monarch's ``[actor=...]`` prefix on Python log records written from inside an actor.

As Monarch's ``_ActorFilter``: a filter on every logging handler (those of the root logger,
and every handler added later, through a wrapped ``Logger.addHandler``) prefixes a record's
message with the qualified name of the actor whose code logged it, e.g.
``[actor=<root>.<__main__.Trainer trainers{'gpus': 0/2}>] step 3``; a controller's records
carry ``[actor=<root>]``. ``config.prefix_python_logs_with_actor = False`` (in the process that
logs) turns it off. Empty messages are left alone (torch.compile's structured logs need them
empty), and so are monarch_nb's own records: they are the runtime's, not an actor's.
"""

from __future__ import annotations

import logging

from . import _context


class _ActorFilter(logging.Filter):
    def __init__(self, client: bool) -> None:
        super().__init__()
        #: a controller process: records outside any actor are <root>'s
        self.client = client

    def filter(self, record: logging.LogRecord) -> bool:
        from ._misc import config

        if not config.prefix_python_logs_with_actor or not record.msg or hasattr(record, "actor_prefix"):
            return True  # off, empty, or already prefixed (a record goes through every handler)
        if record.name.startswith("monarch_nb"):
            return True
        ins = _context.current_instance()
        if ins is not None:
            who = repr(ins)
        elif self.client:
            who = "<root>"
        else:
            return True
        prefix = f"[actor={who}] "
        record.actor_prefix = prefix
        record.msg = f"{prefix}{record.msg}"
        return True


_installed: _ActorFilter | None = None


def install(client: bool) -> None:
    """Add the filter to every handler, now and later (once per process)."""
    global _installed
    if _installed is not None:
        return
    af = _installed = _ActorFilter(client)
    for h in logging.getLogger().handlers:
        h.addFilter(af)
    original = logging.Logger.addHandler

    def add_handler(self: logging.Logger, hdlr: logging.Handler) -> None:
        original(self, hdlr)
        if af not in hdlr.filters:
            hdlr.addFilter(af)

    add_handler.__wrapped__ = original  # type: ignore[attr-defined]
    logging.Logger.addHandler = add_handler  # type: ignore[method-assign]
