"""Where a latency row's p99 comes from.

    python -m bench --only 'callone_*' --samples-out S.jsonl ...   # every sample, per round
    python -m bench.p99 S.jsonl          # each row's largest samples, and which made its p99
    python -m bench.p99 --stalls 10      # the machine's own stalls: the floor's slow round trips

A ``call_one`` row is 20 rounds of 50 samples a side, alternating, so each side has exactly
10 rounds that follow the other side's (its first call then finds its processes idle and its
caches the other's: a cold call), and its p99 (linear rule, 1,000 samples) lies between the
10th- and 11th-largest sample. So with no other slow sample, the p99 is the slowest warm
call; one stall of the machine anywhere in the other 990 samples puts it on the fastest of the
10 cold calls. ``--stalls`` measures how often that happens to the bare floor (two Python
processes, a blocking AF_UNIX pair, 64 bytes each way): round trips over 300 µs, per second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from typing import Any

from bench import floor
from bench.run import percentile


def rows(path: str, top: int = 12) -> dict[str, Any]:
    """Per workload and side: the p99, and the ``top`` largest samples (µs) with their kind:
    ``cold`` (the first call after the other side's round), ``first`` (the first after its
    own round) or ``later``."""
    by: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            for i, x in enumerate(r["samples"]):
                kind = "later" if i else ("cold" if r["after_other"] else "first")
                by[(r["w"], r["impl"])].append((x * 1e6, kind))
    out: dict[str, Any] = {}
    for (w, impl), xs in sorted(by.items()):
        p99 = percentile([x for x, _ in xs], 0.99)
        xs.sort(reverse=True)
        out.setdefault(w, {})[impl] = {
            "n": len(xs),
            "p99_us": round(p99, 1),
            "cold": sum(k == "cold" for _, k in xs),
            "above_p99": {k: sum(1 for x, kk in xs if kk == k and x > p99) for k in ("cold", "first", "later")},
            "largest": ", ".join(f"{x:.0f} {k}" for x, k in xs[:top]),
        }
    return out


def stalls(seconds: float, over_us: float = 300.0) -> dict[str, Any]:
    """The floor's round trips for ``seconds``: how many took over ``over_us`` (and 2x that),
    per second, and the median."""
    with floor.echo_peer() as a:
        msg, buf = floor.message(), bytearray(floor.MSG)
        view = memoryview(buf)
        for _ in range(300):
            a.sendall(msg)
            floor.recv_exact(a, buf, view)
        xs: list[float] = []
        end = time.perf_counter() + seconds
        while (t0 := time.perf_counter()) < end:
            a.sendall(msg)
            floor.recv_exact(a, buf, view)
            xs.append((time.perf_counter() - t0) * 1e6)
    return {
        "seconds": seconds,
        "round_trips": len(xs),
        "median_us": round(percentile(xs, 0.5), 1),
        f"over_{over_us:.0f}us_per_s": round(sum(x > over_us for x in xs) / seconds, 1),
        f"over_{2 * over_us:.0f}us_per_s": round(sum(x > 2 * over_us for x in xs) / seconds, 1),
        "largest_us": [round(x) for x in sorted(xs, reverse=True)[:8]],
    }


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.p99")
    ap.add_argument("samples", nargs="?", default="", help="a file written by python -m bench --samples-out")
    ap.add_argument("--stalls", type=float, default=0.0, metavar="SECONDS", help="time the floor's stalls for this long")
    a = ap.parse_args()
    if not a.samples and not a.stalls:
        ap.error("give a samples file, --stalls SECONDS, or both")
    out: dict[str, Any] = {}
    if a.samples:
        out["rows"] = rows(a.samples)
    if a.stalls:
        out["floor_stalls"] = stalls(a.stalls)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
