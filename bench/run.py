"""Side-by-side benchmark of monarch_nb and Monarch (torchmonarch), alternating in one run.

    python -m bench [--monarch-python PATH] [--only PATTERN,...] [--quick] [--rounds N]

Each system is driven by its own controller process (``bench/worker.py``) running the same
workload file (``bench/workloads.py``) with a different import. For every workload both are
set up, then rounds alternate between them (the first system swaps every round) so machine
noise lands on both; medians and p99 are over every sample of every round. Each system runs
the same number of rounds right after the other's (its first call then finds its processes
idle and the caches the other's: a cold call); their first calls are reported apart
(``first_after_other_median_s``). Prints JSON.

Everything runs under a private runtime dir (removed at the end); every process the run
started — workers, the monarch_nb allocator they start, both systems' procs — is stopped,
found by a run id in their environment.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_MONARCH_PY = os.path.join(ROOT, ".bench-venv", "bin", "python")


@dataclass
class Spec:
    name: str
    samples: int  # per round
    kind: str = "latency"  # latency | throughput (ops/bytes per sample given by `per_sample`)
    per_sample: float = 1.0  # calls or MiB moved per sample (throughput workloads)
    unit: str = ""
    target: str = ""  # human readable
    target_median: float | None = None  # max nb/monarch ratio of medians (time)
    target_p99: float | None = None  # max nb/monarch ratio of p99 (time)
    quick: bool = True
    #: the row's floor (bench/floor.py): ("rtt", k) is k raw round trips, ("memcpy", nbytes, k)
    #: k copies of nbytes, ("fanout", k) one raw message to k peers until every echo is back
    floor: tuple[Any, ...] = ("rtt", 1)
    #: (metric, bound): a figure the workload reports beside its times (max over samples), or
    #: ``x_floor`` (the median as a multiple of the floor), whose monarch_nb value must stay at
    #: or below ``bound``
    target_extra: tuple[str, float] | None = None
    #: rounds are multiplied (and samples per round divided) by this: finer alternation spreads
    #: bursts of machine load over both systems, which matters for p99
    interleave: int = 1


def _workloads() -> list[Spec]:
    w = [
        Spec(f"spawn_{n}", 1, target="<= 0.5x" if n == 8 else "", target_median=0.5 if n == 8 else None, quick=n != 16)
        for n in (1, 4, 8, 16)
    ]
    for actor in ("sync", "async"):
        for how in ("get", "await"):
            w.append(
                Spec(
                    f"callone_{actor}_{how}",
                    200,
                    target="median <= 0.2x and <= 4x the floor, p99 <= 0.3x",
                    target_median=0.2,
                    target_p99=0.3,
                    target_extra=("x_floor", 4.0),
                    interleave=4,
                )
            )
    # a call that prints one line: in a script its value waits until the line was shown (the
    # proc's allocator answered a flush), as on Monarch, whose local procs write to the script's
    # stdout themselves (its log forwarding is left off here, its default)
    w.append(Spec("callone_print_get", 200, interleave=4))
    for n in (4, 8, 16):
        w.append(
            Spec(
                f"call_{n}",
                40,
                target="<= 0.2x" if n >= 8 else "",
                target_median=0.2 if n >= 8 else None,
                interleave=2,
                floor=("fanout", n),
            )
        )
    for n in (8, 16):
        # one 64 MiB bytes argument to n actors (each answers its length); the row also gives
        # the controller's peak memory over the payload (``peak_over_payload``, target <= 2)
        w.append(
            Spec(
                f"callarg_64MiB_{n}",
                2,
                target="peak memory <= 2x payload",
                floor=("memcpy", 64 << 20, 1),
                target_extra=("peak_over_payload", 2.0),
                quick=n == 16,
            )
        )
    w.append(Spec("outstanding_2000", 1, "throughput", 2000, "calls/s", ">= 4x throughput", 0.25, floor=("rtt", 2000)))
    for kind in ("bytes", "numpy", "torch"):
        for mib, k in ((1, 20), (16, 3), (64, 2)):
            w.append(
                Spec(
                    f"payload_{kind}_{mib}MiB",
                    k,
                    "throughput",
                    2 * mib,  # echoed: the bytes travel both ways
                    "MiB/s",
                    ">= 6.7x throughput, <= 3x the floor" if mib >= 16 else "",
                    0.15 if mib >= 16 else None,
                    quick=mib != 16,
                    floor=("memcpy", mib << 20, 2),  # an echo moves the payload twice
                    target_extra=("x_floor", 3.0) if mib >= 16 else None,
                )
            )
    # a sample is a burst of 10-50 ms that one burst of machine load can double: enough samples,
    # alternated finely, that the median is not two of them
    w.append(Spec("logs_10000", 8, "latency", target="<= 0.5x", target_median=0.5, interleave=2))
    # one line of 10 MiB printed by a rank, until it reached the controller's stdout
    w.append(Spec("logline_10MiB", 8, target="<= 0.5x", target_median=0.5, floor=("memcpy", 10 << 20, 1), interleave=2))
    return w


WORKLOADS = _workloads()


@dataclass
class Worker:
    impl: str
    python: str
    env: dict[str, str]
    timeout: float
    proc: subprocess.Popen[bytes] | None = None
    res: Any = None
    buf: bytes = b""
    log: str = ""
    errors: list[str] = field(default_factory=list)

    def start(self) -> None:
        r, w = os.pipe()
        self.log = os.path.join(self.env["TMPDIR"], f"worker-{self.impl}.log")
        with open(self.log, "ab") as errf:
            self.proc = subprocess.Popen(
                [self.python, os.path.join(HERE, "worker.py"), str(w)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=errf,
                pass_fds=(w,),
                env=self.env,
                cwd=self.env["TMPDIR"],
                start_new_session=True,
            )
        os.close(w)
        self.res = r
        self.buf = b""
        hello = self._read(120)
        if not hello.get("ok"):
            raise RuntimeError(f"{self.impl} worker did not start: {hello}")

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"ok": False, "error": f"no answer within {timeout:.0f} s", "timeout": True}
            r, _, _ = select.select([self.res], [], [], left)
            if r:
                data = os.read(self.res, 1 << 20)
                if not data:
                    return {"ok": False, "error": f"worker exited; see {self.tail()}", "dead": True}
                self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)  # type: ignore[no-any-return]

    def tail(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-1500:]
        except OSError:
            return "(no log)"

    def ask(self, timeout: float | None = None, **cmd: Any) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        ans = self._read(timeout or self.timeout)
        if ans.get("timeout") or ans.get("dead"):
            # a hung or crashed worker is replaced; the workload counts as failed
            self.kill()
        return ans

    def quit(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.ask(timeout=60, op="quit")
            self.proc.wait(30)
        except Exception:
            pass
        self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self.res is not None:
            os.close(self.res)
            self.res = None


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of a non-empty list."""
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats(spec: Spec, xs: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "n": len(xs),
        "median_s": percentile(xs, 0.5),
        "p90_s": percentile(xs, 0.90),
        "p99_s": percentile(xs, 0.99),
        "min_s": min(xs),
        "max_s": max(xs),
    }
    if spec.kind == "throughput":
        out[f"median_{spec.unit}"] = spec.per_sample / out["median_s"]
    return out


def _sub(rdir: str, name: str) -> str:
    path = os.path.join(rdir, name)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _reap(run_id: str, var: str = "BENCH_RUN_ID") -> list[int]:
    """Kill every process that still carries this run's id in ``var`` (ours, transitively)."""
    needle = f"{var}={run_id}".encode()
    me = os.getpid()
    killed = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            try:
                os.kill(int(d), signal.SIGKILL)
                killed.append(int(d))
            except ProcessLookupError:
                pass
    return killed


def measure_floor(specs: list[Spec], rounds: int) -> dict[str, Any]:
    """The raw AF_UNIX round trip, a memcpy of each payload size and a fan-out to each number
    of peers a row calls, medians of ``rounds``."""
    from bench import floor

    sizes = sorted({s.floor[1] for s in specs if s.floor[0] == "memcpy"})
    widths = sorted({s.floor[1] for s in specs if s.floor[0] == "fanout"})
    rtt: list[float] = []
    same_cpu: list[float] = []
    copies: dict[int, list[float]] = {n: [] for n in sizes}
    fanouts: dict[int, list[float]] = {k: [] for k in widths}
    for _ in range(max(3, rounds)):
        took, same = floor.roundtrip_where(10_000)
        rtt.append(took)
        same_cpu.append(same)
        for n in sizes:
            copies[n].append(floor.memcpy(n))
        for k in widths:
            fanouts[k].append(floor.fanout(k))
    return {
        "roundtrip_s": percentile(rtt, 0.5),
        "roundtrip_rounds_s": rtt,
        # per round, the share of round trips whose peer ran on the caller's CPU: near 1 is the
        # one-CPU mode (a context switch, a few times faster than a cross-CPU wake-up)
        "roundtrip_rounds_same_cpu": same_cpu,
        "memcpy_s": {str(n): percentile(xs, 0.5) for n, xs in copies.items()},
        "fanout_s": {str(k): percentile(xs, 0.5) for k, xs in fanouts.items()},
    }


def floor_of(spec: Spec, fl: dict[str, Any]) -> float:
    if spec.floor[0] == "memcpy":
        return float(fl["memcpy_s"][str(spec.floor[1])] * spec.floor[2])
    if spec.floor[0] == "fanout":
        return float(fl["fanout_s"][str(spec.floor[1])])
    return float(fl["roundtrip_s"] * spec.floor[1])


def _select(patterns: str, quick: bool) -> list[Spec]:
    if not patterns:
        return [w for w in WORKLOADS if w.quick or not quick]
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = [w for w in WORKLOADS if any(fnmatch.fnmatch(w.name, p) for p in pats)]
    if not chosen:
        raise SystemExit(f"no workload matches {patterns!r}; known: {', '.join(w.name for w in WORKLOADS)}")
    return chosen


def _append_samples(path: str, workload: str, impl: str, rnd: int, after_other: bool, samples: list[float]) -> None:
    """One round's samples, in the order taken, as a JSON line (``--samples-out``)."""
    row = {"w": workload, "impl": impl, "round": rnd, "after_other": after_other, "samples": samples}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--monarch-python",
        default=DEFAULT_MONARCH_PY if os.path.exists(DEFAULT_MONARCH_PY) else "",
        help="interpreter with torchmonarch==0.7.0 and torch==2.13.0 (bench/setup_monarch.sh makes one); "
        "default .bench-venv/bin/python when present",
    )
    ap.add_argument("--no-monarch", action="store_true", help="run monarch_nb only")
    ap.add_argument(
        "--baseline",
        default="",
        metavar="GIT_REF",
        help="instead of Monarch, compare with monarch_nb as of GIT_REF (before/after of an optimisation)",
    )
    ap.add_argument("--only", default="", help="comma-separated workload names or globs, e.g. 'callone_*,call_8'")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and samples, skip spawn_16 and 16 MiB payloads (< 2 min)")
    ap.add_argument("--rounds", type=int, default=0, help="alternation rounds per workload (default 5, quick 3)")
    ap.add_argument("--scale", type=float, default=0.0, help="multiply samples per round (default 1, quick 0.5)")
    ap.add_argument(
        "--nb-env",
        action="append",
        default=[],
        metavar="KEY=VAL",
        help="environment for the monarch_nb worker only (experiments)",
    )
    ap.add_argument("--no-floor", action="store_true", help="skip measuring the machine's floor (bench/floor.py)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one worker request may take")
    ap.add_argument("--out", default="", help="also write the JSON here")
    ap.add_argument(
        "--samples-out",
        default="",
        metavar="FILE",
        help="also write every sample, per workload, side and round in order (JSON lines): where a p99 comes from",
    )
    ap.add_argument("--list", action="store_true", help="list the workloads and exit")
    a = ap.parse_args(argv)
    if a.list:
        print("floor - raw AF_UNIX round trip and memcpy of each payload size (with every run unless --no-floor)")
        for w in WORKLOADS:
            print(w.name, "-", w.target or "(reported)")
        return 0
    floor_only = a.only.strip() == "floor"
    specs = [] if floor_only else _select(",".join(p for p in a.only.split(",") if p.strip() != "floor"), a.quick)
    rounds = a.rounds or (3 if a.quick else 5)
    scale = a.scale or (0.5 if a.quick else 1.0)
    mpy = "" if (a.no_monarch or a.baseline) else a.monarch_python
    if mpy and not os.path.exists(mpy):
        raise SystemExit(f"--monarch-python {mpy!r} does not exist (bench/setup_monarch.sh creates .bench-venv)")

    run_id = secrets.token_hex(8)
    rdir = tempfile.mkdtemp(prefix="mnbb-", dir="/tmp")
    os.chmod(rdir, 0o700)
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MONARCH_NB_", "HYPERACTOR_", "MONARCH_", "PYTHONPATH", "VIRTUAL_ENV"))
    }
    base.update(BENCH_RUN_ID=run_id, TMPDIR=rdir, PYTHONPATH=HERE, PYTHONUNBUFFERED="1")
    nb_env = dict(base, BENCH_IMPL="nb", MONARCH_NB_RUNTIME_DIR=_sub(rdir, "nb"))
    nb_env.update(kv.split("=", 1) for kv in a.nb_env)
    workers = [Worker("nb", sys.executable, nb_env, a.timeout)]
    other = "monarch"
    if mpy:
        workers.append(Worker("monarch", mpy, dict(base, BENCH_IMPL="monarch"), a.timeout))
    elif a.baseline:
        other = "baseline"
        tree = _sub(rdir, "baseline-src")
        subprocess.run(f"git -C {ROOT} archive {a.baseline} monarch_nb | tar -x -C {tree}", shell=True, check=True)
        env = dict(base, BENCH_IMPL="nb", MONARCH_NB_RUNTIME_DIR=_sub(rdir, "baseline"), PYTHONPATH=f"{HERE}:{tree}")
        workers.append(Worker("baseline", sys.executable, env, a.timeout))
    label = {"nb": "monarch_nb", "monarch": "monarch", "baseline": "baseline"}
    result: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench", *(argv if argv is not None else sys.argv[1:])]),
        "rounds": rounds,
        "compared_with": other if len(workers) > 1 else None,
        "workloads": {},
    }
    t_start = time.monotonic()
    fl: dict[str, Any] | None = None
    if not a.no_floor:
        fl = result["floor"] = measure_floor(WORKLOADS if floor_only else specs, rounds)
        sizes = ", ".join(f"{int(n) >> 20} MiB {t * 1e3:.2f} ms" for n, t in fl["memcpy_s"].items())
        if fl["fanout_s"]:
            sizes += "; fan-out to " + ", ".join(f"{k} {t * 1e6:.0f} us" for k, t in fl["fanout_s"].items())
        rounds_us = ", ".join(
            f"{t * 1e6:.1f} ({same:.0%} on one CPU)" for t, same in zip(fl["roundtrip_rounds_s"], fl["roundtrip_rounds_same_cpu"])
        )
        print(
            f"bench: floor: round trip {fl['roundtrip_s'] * 1e6:.1f} us (rounds: {rounds_us}); memcpy {sizes}",
            file=sys.stderr,
            flush=True,
        )
    try:
        for w in workers:
            w.start()
        for spec in specs:
            n = max(1, round(spec.samples * scale / spec.interleave))
            spec_rounds = rounds * spec.interleave
            if len(workers) > 1:
                # each side goes first in as many rounds as the other (the first run of all
                # follows no other side's teardown)
                spec_rounds += spec_rounds % 2
            entry: dict[str, Any] = {"target": spec.target} if spec.target else {}
            samples: dict[str, list[float]] = {w.impl: [] for w in workers}
            # every sample but each round's first (the call after the other system's round, with
            # our processes idle meanwhile: a cold call); reported beside, targets use all samples
            later: dict[str, list[float]] = {w.impl: [] for w in workers}
            extra: dict[str, dict[str, list[float]]] = {w.impl: {} for w in workers}
            failed: dict[str, str] = {}
            t0 = time.monotonic()
            print(f"bench: {spec.name} ({spec_rounds} rounds x {n})", file=sys.stderr, flush=True)
            #: each side's first samples of the rounds that ran right after the other side's
            #: (its processes idle meanwhile, its caches the other's: the cold calls)
            cold: dict[str, list[float]] = {w.impl: [] for w in workers}
            # the side that runs first sets up last, so its first round follows its own set-up
            # (and warm-up), as each of its later rounds that does not follow the other side;
            # set up first, it would run one round more than the other right after the other
            # side's work, and with 20 rounds that one extra cold call is the p99 of 1000 samples
            for w in workers[::-1]:
                ans = w.ask(op="setup", w=spec.name)
                if not ans.get("ok"):
                    failed[w.impl] = ans.get("error", "?") + ("\n" + ans["tb"] if "tb" in ans else "")
            prev = workers[0].impl
            for r in range(spec_rounds):
                order = workers if r % 2 == 0 else workers[::-1]
                for w in order:
                    if w.impl in failed:
                        continue
                    ans = w.ask(op="run", w=spec.name, n=n)
                    if ans.get("ok"):
                        samples[w.impl].extend(ans["samples"])
                        if a.samples_out:
                            _append_samples(a.samples_out, spec.name, w.impl, r, prev != w.impl, ans["samples"])
                        later[w.impl].extend(ans["samples"][1:])
                        if prev != w.impl and ans["samples"]:
                            cold[w.impl].append(ans["samples"][0])
                        prev = w.impl
                        for k, v in (ans.get("extra") or {}).items():
                            extra[w.impl].setdefault(k, []).extend(v)
                    else:
                        failed[w.impl] = ans.get("error", "?") + ("\n" + ans["tb"] if "tb" in ans else "")
            for w in workers:
                if w.impl not in failed or w.proc is not None:
                    w.ask(timeout=120, op="teardown", w=spec.name)
            for impl, xs in samples.items():
                if impl in failed:
                    entry[label[impl]] = {"error": failed[impl][-1500:]}
                elif xs:
                    entry[label[impl]] = st = stats(spec, xs)
                    if spec.kind == "latency" and len(later[impl]) >= 100:
                        st["p99_not_first_s"] = percentile(later[impl], 0.99)
                        if cold[impl]:
                            st["first_after_other_median_s"] = percentile(cold[impl], 0.5)
                            st["first_after_other_n"] = len(cold[impl])
                    for k, v in extra[impl].items():
                        st[k] = max(v)
                    if fl is not None:
                        st["x_floor"] = st["median_s"] / floor_of(spec, fl)
            if fl is not None:
                entry["floor_s"] = floor_of(spec, fl)
            nb, mon = entry.get("monarch_nb", {}), entry.get(other, {})
            if "median_s" in nb and "median_s" in mon:
                entry["ratio_median"] = nb["median_s"] / mon["median_s"]
                entry["ratio_p99"] = nb["p99_s"] / mon["p99_s"]
                if "p99_not_first_s" in nb and "p99_not_first_s" in mon:
                    entry["ratio_p99_not_first"] = nb["p99_not_first_s"] / mon["p99_not_first_s"]
                if "first_after_other_median_s" in nb and "first_after_other_median_s" in mon:
                    entry["ratio_first_after_other"] = nb["first_after_other_median_s"] / mon["first_after_other_median_s"]
                entry["speedup"] = mon["median_s"] / nb["median_s"]
                if spec.target_median is not None and other == "monarch":
                    met = entry["ratio_median"] <= spec.target_median
                    if spec.target_p99 is not None:
                        met = met and entry["ratio_p99"] <= spec.target_p99
                    entry["met"] = met
            if spec.target_extra is not None and spec.target_extra[0] in nb:
                key, bound = spec.target_extra
                entry["met"] = entry.get("met", True) and nb[key] <= bound
            entry["wall_s"] = round(time.monotonic() - t0, 1)
            result["workloads"][spec.name] = entry
            print(f"bench: {spec.name}: {_line(entry)}", file=sys.stderr, flush=True)
    finally:
        for w in workers:
            w.quit()
        leftovers = _reap(run_id)
        shutil.rmtree(rdir, ignore_errors=True)
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    result["leftover_processes_killed"] = len(leftovers)
    checked = {k: v["met"] for k, v in result["workloads"].items() if "met" in v}
    result["targets_met"] = f"{sum(checked.values())}/{len(checked)}"
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


def _line(e: dict[str, Any]) -> str:
    def fmt(d: dict[str, Any]) -> str:
        if "error" in d:
            return "ERROR " + d["error"].splitlines()[0][:200]
        out = f"median {d['median_s'] * 1e3:.3f} ms p99 {d['p99_s'] * 1e3:.3f} ms"
        if "x_floor" in d:
            out += f" ({d['x_floor']:.1f}x floor)"
        if "peak_over_payload" in d:
            out += f" peak {d['peak_over_payload']:.2f}x payload"
        return out

    parts = [f"nb {fmt(e['monarch_nb'])}" if "monarch_nb" in e else ""]
    for other in ("monarch", "baseline"):
        if other in e:
            parts.append(f"{other} {fmt(e[other])}")
    if "ratio_median" in e:
        p99 = f"p99 {e['ratio_p99']:.2f}"
        if "ratio_p99_not_first" in e:
            p99 += f", without each round's first call {e['ratio_p99_not_first']:.2f}"
        if "ratio_first_after_other" in e:
            p99 += f"; first call after the other's round: median {e['ratio_first_after_other']:.2f}"
        parts.append(f"ratio {e['ratio_median']:.2f} ({p99})" + (f" met={e['met']}" if "met" in e else ""))
    return " | ".join(p for p in parts if p)


if __name__ == "__main__":
    sys.exit(main())
