"""Environment diff and sync: a host whose interpreter lacks a package and has another at a
different version is shown by `env diff` and fixed by `env sync` (files shipped, no index)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest
from conftest import wait_for

from monarch_nb import env

pytestmark = pytest.mark.timeout(180)


def _wheel(out: Path, name: str, version: str) -> Path:
    """A tiny pure-Python wheel, written by hand (no build backend, no index)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}/INSTALLER": b"pip\n",
    }
    record = []
    for p, data in files.items():
        h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{p},sha256={h},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = out / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, data in files.items():
            z.writestr(p, data)
    return path


def _venv(path: Path, *wheels: Path) -> Path:
    """A venv that sees this test run's packages (a .pth) plus its own ``wheels``, unpacked."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    py = path / "bin" / "python"
    site = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    (site / "_mnb_test_base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
    return py


def test_env_diff_shows_and_env_sync_fixes_a_host(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    host_py = _venv(tmp_path / "host", _wheel(wheels, "mnbtest_b", "1.0"))
    ctl_py = _venv(tmp_path / "ctl", _wheel(wheels, "mnbtest_a", "1.0"), _wheel(wheels, "mnbtest_b", "2.0"))
    rdir = tempfile.mkdtemp(prefix="mnbe-", dir="/tmp")
    envvars = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, MONARCH_NB_ZYGOTE_PRELOAD="")
    log = open(tmp_path / "alloc.log", "wb")
    alloc = subprocess.Popen([str(host_py), "-m", "monarch_nb", "allocator"], env=envvars, stdout=log, stderr=log)
    try:
        from monarch_nb._runtime.records import read_connection_files

        addr = wait_for(lambda: next(iter(read_connection_files(rdir)), None), 30, "the host's allocator")["addr"]
        script = f"""
import json, monarch_nb.env as E
from monarch_nb.actor import attach_to_workers
hosts = attach_to_workers(workers=[{addr!r}], ca="trust_all_connections")
d = E.diff([{addr!r}])
print(json.dumps({{"before": [(r["name"], r["controller"], r["host"], r["status"]) for r in d.rows[{addr!r}]]}}))
print(json.dumps({{"sync": E.sync([{addr!r}], index=False)}}))
print(json.dumps({{"after": [(r["name"], r["status"]) for r in E.diff([{addr!r}]).rows[{addr!r}]]}}))
procs = hosts.spawn_procs(per_host={{"gpus": 1}}, name="envcheck")
from monarch_nb.actor import Actor, endpoint
class V(Actor):
    @endpoint
    def versions(self):
        import mnbtest_a, mnbtest_b
        return [mnbtest_a.VERSION, mnbtest_b.VERSION]
print(json.dumps({{"procs": procs.spawn("v", V).versions.call_one().get(timeout=60)}}))
procs.stop().get(timeout=30)
"""
        cp = subprocess.run([str(ctl_py), "-c", script], env=envvars, capture_output=True, text=True, timeout=150)
        assert cp.returncode == 0, cp.stderr[-3000:]
        out = {k: v for line in cp.stdout.splitlines() if line.startswith("{") for k, v in json.loads(line).items()}
        before = {n: (c, h, s) for n, c, h, s in out["before"]}
        assert before["mnbtest_a"] == ("1.0", "", "missing")
        assert before["mnbtest_b"] == ("2.0", "1.0", "different")
        acts = out["sync"][addr]
        assert any(a.startswith("mnbtest_a==1.0: shipped") for a in acts) and any(
            a.startswith("mnbtest_b==2.0: shipped") for a in acts
        )
        assert all(n not in ("mnbtest_a", "mnbtest_b") for n, _s in out["after"]), out["after"]
        assert out["procs"] == ["1.0", "2.0"]
    finally:
        alloc.terminate()
        alloc.wait(30)
        log.close()
        shutil.rmtree(rdir, ignore_errors=True)


def test_a_conda_prefix_is_detected_and_its_packages_listed(tmp_path: Path) -> None:
    meta = tmp_path / "conda-meta"
    meta.mkdir()
    (meta / "numpy-1.26.4-py311h0.json").write_text(json.dumps({"name": "numpy", "version": "1.26.4", "build": "py311h0"}))
    (meta / "libfoo-3.2-0.json").write_text(json.dumps({"name": "libfoo", "version": "3.2"}))
    d = env.describe(str(tmp_path))
    assert d["kind"] == "conda" and d["prefix"] == str(tmp_path)
    assert d["dists"]["libfoo"] == {"name": "libfoo", "version": "3.2", "installer": "conda", "editable": ""}
    mine = {"python": d["python"], "dists": {"libfoo": {**d["dists"]["libfoo"], "version": "3.3"}}}
    rows = env.compare(mine, d)
    assert [(r["name"], r["status"]) for r in rows] == [("libfoo", "different"), ("numpy", "extra")]


def test_critical_mismatches_name_the_fix() -> None:
    probs = env.critical_mismatches({"python": "3.11.7", "torch": "2.13.0"}, {"python": "3.12.1", "torch": "2.12.0"})
    assert "same Python minor version" in probs[0]
    assert "pip install torch==2.13.0" in probs[1]


def test_the_html_of_an_env_diff_escapes_what_a_host_reports() -> None:
    """A host's own description (its environment kind, its Python version string) went into the
    notebook's HTML as markup: an image tag there ran its onerror."""
    bad = "<img src=x onerror=alert(1)>"
    d = env.EnvDiff(controller={}, hosts={"a<b>": {"kind": bad, "prefix": "/p", "python": bad}}, rows={"a<b>": []})
    out = d._repr_html_()
    assert "<img" not in out and "&lt;img src=x onerror=alert(1)&gt;" in out and "a&lt;b&gt;" in out, out
