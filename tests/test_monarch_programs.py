"""Monarch programs run unchanged but for the import.

Every ``tests/monarch_programs/NAME.py`` is a program written for ``monarch.actor``
(torchmonarch 0.7.0); ``NAME.expected`` is what it printed there, recorded with
``record_expected.sh``. Here each runs as its own controller process with only its
``monarch.actor`` import lines pointed at ``monarch_nb.actor``, and must print the same:
the client's lines exactly, what its actors print ("actor says ...") in any order
(see ``monarch_programs/_output.py``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_nb.actor import Actor, context, endpoint, this_host
from monarch_nb.errors import SupervisionError

PROGRAMS = Path(__file__).parent / "monarch_programs"
REPO = Path(__file__).parent.parent
NAMES = sorted(p.stem for p in PROGRAMS.glob("*.py") if not p.name.startswith("_"))

_spec = importlib.util.spec_from_file_location("monarch_programs_output", PROGRAMS / "_output.py")
assert _spec is not None and _spec.loader is not None
output = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(output)

# the only lines a port to monarch_nb changes
_IMPORT = re.compile(r"^(\s*)(from\s+monarch\.(actor|rdma|spmd)\s+import\b|import\s+monarch\.(actor|rdma|spmd)\s+as\b)")

pytestmark = pytest.mark.timeout(300)


def port_to_monarch_nb(source: str) -> str:
    """Rewrite the ``monarch.actor`` (and ``monarch.rdma``, ``monarch.spmd``) import lines, refusing
    programs that touch Monarch elsewhere."""
    out = []
    changed = 0
    for line in source.splitlines(keepends=True):
        if _IMPORT.match(line):
            line = re.sub(r"\bmonarch\.(actor|rdma|spmd)\b", r"monarch_nb.\1", line, count=1)
            changed += 1
        elif re.search(r"\bmonarch\b", line):
            raise AssertionError(f"Monarch used outside an import line: {line!r}")
        out.append(line)
    assert changed, "no `from monarch.actor import` line"
    return "".join(out)


def test_every_program_has_expected_output() -> None:
    assert NAMES, "no programs found"
    assert sorted(p.stem for p in PROGRAMS.glob("*.expected")) == NAMES


def test_output_comparison_ignores_only_how_actor_lines_interleave() -> None:
    monarch = "actor says a from 1actor says b from 0\nresult 1\n\nactor says c\ndone\n"
    ours = "[0] actor says b from 0\nresult 1\n[2] actor says c\n[1] actor says a from 1\ndone\n"
    assert output.render(ours) == output.render(monarch)
    assert output.render("result 1 [0] actor says x\n") != output.render("result 1\nactor says x\n")
    assert output.render("actor says x\ndone\n") != output.render("done\n")


def test_the_port_changes_only_import_lines() -> None:
    src = "from monarch.actor import Actor\nimport monarch.actor as api\nfrom monarch.rdma import RDMABuffer\nx = 1\n"
    assert port_to_monarch_nb(src) == (
        "from monarch_nb.actor import Actor\nimport monarch_nb.actor as api\nfrom monarch_nb.rdma import RDMABuffer\nx = 1\n"
    )
    with pytest.raises(AssertionError):
        port_to_monarch_nb("from monarch.actor import Actor\nimport monarch.rdma\n")


@pytest.mark.parametrize("name", NAMES)
def test_program_prints_what_it_printed_on_monarch(name: str, tmp_path: Path) -> None:
    script = tmp_path / f"{name}.py"
    script.write_text(port_to_monarch_nb((PROGRAMS / f"{name}.py").read_text()))
    expected = (PROGRAMS / f"{name}.expected").read_text()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    # run as a user runs a program: with PYTHONUNBUFFERED (which .ci/run sets) print() writes
    # each of its pieces straight to the shared stdout, where rank output may land between
    # them, on Monarch as here; buffered, a line leaves whole
    env.pop("PYTHONUNBUFFERED", None)
    # the runtime dir (and its allocator) is the session's, from conftest; the script's meshes
    # stop when it exits, so nothing of it outlives this test
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{name} exited with {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    assert output.render(r.stdout) == output.render(expected), f"stderr:\n{r.stderr[-4000:]}"


# -- what the programs cannot show: Monarch itself misbehaves there, monarch_nb must not hang


class _OneShot(Actor):
    @endpoint
    def work(self) -> str:
        context().actor_instance.stop()
        return "finishing"

    @endpoint
    def more(self) -> str:
        return "more"


def test_a_call_to_an_actor_that_stopped_itself_fails_instead_of_waiting() -> None:
    # (Monarch 0.7.0 lets such a call wait forever in some meshes, or ends the client)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        # a call sent after the stopping call's answer was not delivered before the stop: it
        # fails, also when the actor's thread was reading its caller's connection itself (that
        # raced with the stop: 6 of 300 were answered on a loaded machine)
        for i in range(20):
            one = procs.spawn(f"one_shot{i}", _OneShot)
            assert one.work.call_one().get(timeout=30) == "finishing"
            with pytest.raises(SupervisionError, match=f"no actor named 'one_shot{i}'"):
                one.more.call_one().get(timeout=30)
    finally:
        procs.stop().get(timeout=30)
