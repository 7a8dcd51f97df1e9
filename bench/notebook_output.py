"""10,000 lines printed by one rank, measured where a notebook sees them: a kernel's iopub.

    .venv/bin/python -m bench.notebook_output [--monarch-python .bench-venv/bin/python] [--repeat 5]

For each system a real IPython kernel runs the controller (monarch_nb: the extension loaded,
aggregation off; Monarch: ``logging_option(stream_to_client=True)``), one proc prints 10,000
numbered lines stamped with the time it printed them, and this process (a jupyter_client, like
a notebook frontend) records when each line arrives on iopub. Reported per system, as medians
over ``--repeat`` runs: the first line's latency (arrival minus print time), the last line's
arrival after the call was sent, and how many lines arrived. Kernels alternate run by run.

A second row, ``first_line_aggregated``: a rank of a mesh with a 1 s aggregation window prints
one line and goes on working for 1.5 s; the time from its print to the first iopub message that shows it (monarch_nb shows a
cell's first line at once, provisionally, and merges it into its group when the window closes;
target 10 ms), and to the message that shows its aggregated group.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import statistics
import sys
import tempfile
import time

import jupyter_client

N = 10_000

SETUP = {
    "nb": """
%load_ext monarch_nb
from monarch_nb.actor import Actor, endpoint, this_host
""",
    "monarch": """
from monarch.actor import Actor, endpoint, this_host
""",
}

COMMON = """
import time

class Spew(Actor):
    @endpoint
    def spew(self, n: int, tag: str = "warmup") -> int:
        for i in range(n):
            print(f"BENCHLINE {tag} {i} {time.time():.6f}", flush=True)
        return n

    @endpoint
    def line_then_wait(self, tag: str, wait: float) -> None:
        print(f"BENCHLINE {tag} 0 {time.time():.6f}", flush=True)
        time.sleep(wait)  # the call (and the cell) still runs while the window is open

procs = this_host().spawn_procs(per_host={"gpus": 1})
await procs.logging_option(stream_to_client=True, aggregate_window_sec=%s)
spew = procs.spawn("spew", Spew)
spew.spew.call_one(10).get()
agg_procs = this_host().spawn_procs(per_host={"gpus": 1})
await agg_procs.logging_option(stream_to_client=True, aggregate_window_sec=1)
agg = agg_procs.spawn("agg", Spew)
agg.spew.call_one(1).get()
"""


class Kernel:
    def __init__(self, python: str, env: dict[str, str]) -> None:
        from jupyter_client.kernelspec import KernelSpecManager

        d = self.spec_dir = tempfile.mkdtemp(prefix="mnbk-")
        os.makedirs(f"{d}/bench")
        with open(f"{d}/bench/kernel.json", "w") as f:
            json.dump(
                {
                    "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "bench",
                    "language": "python",
                },
                f,
            )
        self.km = jupyter_client.KernelManager(kernel_name="bench", kernel_spec_manager=KernelSpecManager(kernel_dirs=[d]))
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 300) -> list[dict]:  # type: ignore[type-arg]
        mid = self.kc.execute(code)
        msgs = []
        deadline = time.monotonic() + timeout
        while True:
            m = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if m["parent_header"].get("msg_id") != mid:
                continue
            msgs.append(m)
            if m["msg_type"] == "error":
                raise RuntimeError("\n".join(m["content"]["traceback"]))
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                return msgs

    def measure(self, tag: str) -> dict[str, float]:
        """Run the 10,000-line call; stamp each line as it arrives on iopub."""
        mid = self.kc.execute(f"spew.spew.call_one({N}, {tag!r}).get()")
        t_sent = time.time()
        first = last = 0.0
        first_lat = 0.0
        seen = 0
        idle = False
        deadline = time.monotonic() + 300
        while seen < N and time.monotonic() < deadline:
            try:
                m = self.kc.get_iopub_msg(timeout=5 if idle else 60)
            except queue.Empty:
                if idle:
                    break  # the call finished and no more output came
                continue
            now = time.time()
            if m["msg_type"] == "status" and m["parent_header"].get("msg_id") == mid:
                idle = m["content"]["execution_state"] == "idle"
            text = m["content"].get("text") or m["content"].get("data", {}).get("text/plain", "")
            for line in text.splitlines():
                k = line.find("BENCHLINE ")
                if k < 0:
                    continue
                parts = line[k:].split()
                if len(parts) < 4 or parts[1] != tag:
                    continue  # a line of an earlier round arriving late
                try:
                    ts = float(parts[3])
                except ValueError:
                    continue
                if not seen:
                    first, first_lat = now, now - ts
                seen += 1
                last = now
        return {
            "first_line_latency_s": first_lat,
            "last_line_after_send_s": last - t_sent,
            "lines": seen,
            "first_after_send_s": first - t_sent,
        }

    def first_line(self, tag: str) -> dict[str, float]:
        """One line printed by a rank of the aggregated mesh: when is it first seen, and when
        in its aggregated group (a stream message)."""
        mid = self.kc.execute(f"agg.line_then_wait.call_one({tag!r}, 1.5).get()")
        first = grouped = 0.0
        stamp = None
        deadline = time.monotonic() + 60
        while not grouped and time.monotonic() < deadline:
            try:
                m = self.kc.get_iopub_msg(timeout=10)
            except queue.Empty:
                break
            now = time.time()
            if m["parent_header"].get("msg_id") != mid:
                continue
            text = m["content"].get("text") or m["content"].get("data", {}).get("text/plain", "")
            found = re.search(rf"BENCHLINE {tag} \d+ (\d+\.\d+)", text)
            if found is None:
                continue
            if stamp is None:
                stamp = float(found.group(1))
                first = now
            if m["msg_type"] == "stream":
                grouped = now
        if stamp is None:
            return {"first_shown_s": float("nan"), "group_shown_s": float("nan")}
        return {"first_shown_s": first - stamp, "group_shown_s": (grouped or float("nan")) - stamp}

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
        shutil.rmtree(self.spec_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--monarch-python", default="")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rdir = tempfile.mkdtemp(prefix="mnbb-", dir="/tmp")
    os.chmod(rdir, 0o700)
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, PYTHONUNBUFFERED="1")
    systems = {"nb": sys.executable}
    if args.monarch_python:
        systems["monarch"] = args.monarch_python
    kernels = {}
    results: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    firsts: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    try:
        for s, py in systems.items():
            kernels[s] = Kernel(py, env)
            kernels[s].run(SETUP[s] + COMMON % ("0" if s == "nb" else "None"))
        for r in range(args.repeat):
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for s in order:
                results[s].append(kernels[s].measure(f"r{r}"))
                firsts[s].append(kernels[s].first_line(f"f{r}"))
    finally:
        for k in kernels.values():
            k.close()
        if "nb" in systems:
            os.system(f"MONARCH_NB_RUNTIME_DIR={rdir} {sys.executable} -m monarch_nb allocator stop >/dev/null 2>&1")
        shutil.rmtree(rdir, ignore_errors=True)
    out: dict[str, object] = {
        "workload": f"{N:,} lines from one rank, aggregation off, at a kernel's iopub",
        "repeat": args.repeat,
    }
    for s, rows in results.items():
        out[s] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["first_line_aggregated"] = {
        s: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for s, rows in firsts.items() if rows
    }
    nb_first = out["first_line_aggregated"].get("nb", {}).get("first_shown_s")  # type: ignore[attr-defined]
    if nb_first is not None:
        out["first_line_aggregated"]["met"] = nb_first <= 0.010  # type: ignore[index]
    if "monarch" in out:
        nb, mo = out["nb"], out["monarch"]
        out["ratio_last_line"] = nb["last_line_after_send_s"] / mo["last_line_after_send_s"]  # type: ignore[index]
    out["load"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
