"""What it costs to render a many-rank mesh: the dashboard's build and refresh, ``%mesh status``,
the sidebar's state.

    python -m bench.dashboard [--ranks 128] [--calls 100] [--rounds 3]

One host, an empty zygote preload, a private runtime directory (its allocator is stopped at
the end). Before timing, ``--calls`` calls to every rank and as many broadcasts, as in
``bench.scale``'s hero run: the dashboard's latency view reads the window's spans, which is
what grew with the call rate. Prints JSON: medians over ``--rounds`` (and the load average:
on a shared 2-core machine the absolute figures move with it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_RDIR = tempfile.mkdtemp(prefix="mnbd-", dir="/tmp")
os.chmod(_RDIR, 0o700)
os.environ["MONARCH_NB_RUNTIME_DIR"] = _RDIR
os.environ.setdefault("MONARCH_NB_ZYGOTE_PRELOAD", "")

from monarch_nb.actor import Actor, endpoint, this_host  # noqa: E402


class Echo(Actor):
    @endpoint
    def ping(self) -> int:
        return 1


def _median(fn: Any, rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=128)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    out: dict[str, Any] = {"ranks": a.ranks, "calls_before": a.calls, "load_before": os.getloadavg()[0]}
    try:
        from monarch_nb import mesh as M
        from monarch_nb.magics._tables import StatusTable
        from monarch_nb.widgets import Dashboard

        t = time.perf_counter()
        pm = this_host().spawn_procs(per_host={"gpus": a.ranks}, name="dash")
        am = pm.spawn("e", Echo)
        am.initialized.get(timeout=300)
        out["spawn_s"] = time.perf_counter() - t
        for _ in range(a.calls):
            am.ping.call().get(timeout=60)
        for _ in range(a.calls):
            am.ping.broadcast()
        am.ping.call().get(timeout=60)

        def build() -> None:
            Dashboard(pm, interval=3600).close()

        d = Dashboard(pm, interval=3600)
        d.close()
        out["dashboard_build_s"] = _median(build, a.rounds)
        out["dashboard_refresh_s"] = _median(d.refresh, a.rounds)
        # what %mesh status does: the snapshot, then the cell's HTML and text
        out["mesh_status_s"] = _median(lambda: (lambda s: (s._repr_html_(), repr(s)))(StatusTable(M.status(), "")), a.rounds)
        try:  # the sidebar's state (jupyter-server side), when the server extra is installed
            from monarch_nb.server.manager import MeshManager

            def sidebar() -> None:
                m = MeshManager()
                m.state()

            out["sidebar_state_s"] = _median(sidebar, a.rounds)
        except ImportError:
            pass
        out["load_after"] = os.getloadavg()[0]
        pm.stop().get(timeout=60)
    finally:
        subprocess.run([sys.executable, "-m", "monarch_nb", "allocator", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(_RDIR, ignore_errors=True)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
