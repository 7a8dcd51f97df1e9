"""``%mesh launch``, ``%mesh jobs``, ``%mesh kill``: jobs by name, over ``monarch_nb.job``'s public functions."""

from __future__ import annotations

import argparse
import html
import warnings
from typing import Any

from IPython.core.error import UsageError

from ..job import JobError, JobReplacedWarning, kill_job, launch, list_jobs

SUMMARY = """\
%mesh launch slurm|ssh|process|local|k8s NAME --hosts N|h1,h2 [--partition P] [--time T] [--gpus-per-node G] ...
                                               apply (or re-attach to) a job; NAME is bound to its host mesh
%mesh jobs                                     jobs on this machine: scheduler, id, state, hosts, age, walltime left
%mesh kill NAME                                stop a job: every allocator and proc it started"""


def add_parsers(p: dict[str, Any], parser_cls: type) -> None:
    la = p["launch"] = parser_cls(prog="%mesh launch", description="Apply or re-attach to a named job; bind NAME to its hosts.")
    la.add_argument("scheduler", choices=["slurm", "ssh", "process", "local", "k8s"])
    la.add_argument("name", help="job name; also the host mesh's name and the notebook variable bound to it")

    def option(*names: str, **kw: Any) -> None:
        # an error about an option names it as typed: its flag, by the argument name it sets
        a = la.add_argument(*names, **kw)
        _FLAGS[a.dest] = a.option_strings[0]

    option("--hosts", help="a node count (slurm, process, k8s; default 1) or host list h1,h2 (ssh)")
    option("--partition")
    option("--time", dest="time_limit", help="Slurm walltime, e.g. 2:00:00")
    option("--gpus-per-node", type=int)
    option("--cpus-per-task", type=int)
    option("--mem")
    option("--account")
    option("--qos")
    option("--log-dir", help="Slurm: a directory every node sees (default: the current one)")
    option("--no-exclusive", action="store_true", help="Slurm: share nodes with other jobs")
    option("--python", dest="python_exe", help="the interpreter on the hosts")
    option("--port", dest="monarch_port", type=int, help="allocator port (0: any)")
    option("--ssh-arg", dest="ssh_args", action="append", help="ssh: an extra ssh argument (repeatable)")
    option("--slurm-arg", dest="slurm_args", action="append", help="slurm: an extra sbatch option (repeatable)")
    option("--namespace", help="k8s: the namespace (default: default)")
    option("--image", help="k8s: the pods' image (with monarch_nb); without it, attach to pods labelled with NAME")
    option("--kubeconfig", help="k8s: a kubeconfig file (default: the in-cluster service account)")
    p["jobs"] = parser_cls(prog="%mesh jobs", description="Jobs on this machine and their scheduler state.")
    k = p["kill"] = parser_cls(prog="%mesh kill", description="Kill a job: every allocator and proc it started.")
    k.add_argument("name")


_BY_SCHEDULER = {
    "slurm": {
        "partition",
        "time_limit",
        "gpus_per_node",
        "cpus_per_task",
        "mem",
        "account",
        "qos",
        "log_dir",
        "python_exe",
        "monarch_port",
        "slurm_args",
    },
    "ssh": {"python_exe", "monarch_port", "ssh_args"},
    "process": set(),
    "local": set(),
    "k8s": {"namespace", "image", "kubeconfig", "monarch_port"},
}


#: each %mesh launch option's flag by the argument name it sets (--port sets monarch_port): an
#: error said --monarch-port, which is no option
_FLAGS: dict[str, str] = {}


def do_launch(self: Any, args: argparse.Namespace, cell: str | None) -> Any:
    allowed = _BY_SCHEDULER[args.scheduler]
    options = {}
    for key in sorted(_BY_SCHEDULER["slurm"] | _BY_SCHEDULER["ssh"] | _BY_SCHEDULER["k8s"]):
        value = getattr(args, key)
        if value is None:
            continue
        if key not in allowed:
            flag = _FLAGS[key]
            raise UsageError(f"%mesh launch {args.scheduler}: {flag} does not apply to {args.scheduler}")
        options[key] = value
    if args.no_exclusive:
        if args.scheduler != "slurm":
            raise UsageError("%mesh launch: --no-exclusive is a Slurm option")
        options["exclusive"] = False
    self._refuse_taken("%mesh launch", args.name)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", JobReplacedWarning)
            hosts = args.hosts if args.hosts is not None else "" if args.scheduler == "ssh" else "1"
            state = launch(args.scheduler, args.name, hosts, **options)
    except (JobError, NotImplementedError, ValueError) as e:
        raise UsageError(f"%mesh launch: {e}") from None
    for w in said:
        if issubclass(w.category, JobReplacedWarning):
            # a relaunch with another shape stopped the job before it: one line, not a warning's frames
            print(f"{args.name}: {w.message}")
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    hosts = getattr(state, args.name)
    self._bind(args.name, hosts)
    print(f"{args.name}: {len(hosts._refs())} host(s) {', '.join(h.host for h in hosts._refs())} ({args.scheduler})")
    return None


class JobsTable:
    """``%mesh jobs``: text in a terminal, a table in a notebook."""

    COLUMNS = ("name", "scheduler", "id", "state", "hosts", "age", "walltime left")

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = [
            {
                "name": r["name"],
                "scheduler": r.get("scheduler", "?"),
                "id": str(r.get("id", "")),
                "state": str(r.get("state", "")),
                "hosts": str(r.get("hosts", "")),
                "age": _dur(r.get("age_s")),
                "walltime left": _dur(r.get("walltime_left_s")),
            }
            for r in rows
        ]

    def __repr__(self) -> str:
        if not self.rows:
            return "no jobs"
        widths = {c: max(len(c), *(len(r[c]) for r in self.rows)) for c in self.COLUMNS}
        lines = ["  ".join(c.ljust(widths[c]) for c in self.COLUMNS)]
        lines += ["  ".join(r[c].ljust(widths[c]) for c in self.COLUMNS) for r in self.rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<i>no jobs</i>"
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(r[c])}</td>" for c in self.COLUMNS) + "</tr>" for r in self.rows)
        return f"<table class='mnb-jobs'><tr>{head}</tr>{body}</table>"


def _dur(v: float | None) -> str:
    if v is None:
        return "-"
    v = max(0, int(v))
    return f"{v // 3600}h{v % 3600 // 60:02d}m" if v >= 3600 else f"{v // 60}m{v % 60:02d}s"


def do_jobs(self: Any, args: argparse.Namespace, cell: str | None) -> Any:
    return JobsTable(list_jobs())


def do_kill(self: Any, args: argparse.Namespace, cell: str | None) -> Any:
    try:
        kill_job(args.name)
    except JobError as e:
        raise UsageError(f"%mesh kill: {e}") from None
    self.shell.user_ns.pop(args.name, None)
    print(f"killed job {args.name}")
    return None
