"""Workspace sync and in-place reload on one host (multi-host sync is in test_multihost_sync.py)."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

import monarch_nb.mesh as M
import monarch_nb.sync as S
from monarch_nb._workspace import scan
from monarch_nb.actor import Actor, endpoint

MODULE = """
from monarch_nb.actor import Actor, endpoint

from helper import GREETING


class Worker(Actor):
    def __init__(self, base):
        self.base = base
        self.calls = 0

    @endpoint
    def hello(self):
        import os
        self.calls += 1
        return (GREETING, "{version}", self.base + self.calls, os.getpid(), __file__)
"""


def _write(ws: Path, version: str, greeting: str = "hi") -> None:
    (ws / "mymod.py").write_text(textwrap.dedent(MODULE.format(version=version)))
    (ws / "helper.py").write_text(f"GREETING = {greeting!r}\n")


@pytest.fixture
def ws(tmp_path: Path):
    d = tmp_path / "proj"
    d.mkdir()
    _write(d, "v1")
    (d / "data").mkdir()
    (d / "data" / "big.bin").write_bytes(os.urandom(1000))
    (d / ".gitignore").write_text("*.log\nscratch/\n!keep.log\n")
    (d / "run.log").write_text("ignored")
    (d / "keep.log").write_text("kept")
    (d / "scratch").mkdir()
    (d / "scratch" / "x.py").write_text("ignored = True")
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))
    for m in ("mymod", "helper"):
        sys.modules.pop(m, None)


def test_manifest_honours_gitignore_and_excludes(ws: Path) -> None:
    files = set(scan(str(ws), excludes=["data/*"]))
    assert files == {"mymod.py", "helper.py", ".gitignore", "keep.log"}


def test_a_file_removed_while_the_tree_is_scanned_is_left_out(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An editor's temporary file listed, then gone before it is read: not in the tree (the
    scan raised FileNotFoundError, and the sync with it)."""
    from monarch_nb import _workspace, sync

    real = _workspace.file_hash

    def vanishing(path: str) -> str:
        if path.endswith("helper.py"):
            os.remove(path)
        return real(path)

    monkeypatch.setattr(_workspace, "file_hash", vanishing)
    assert set(scan(str(ws), excludes=["data/*"])) == {"mymod.py", ".gitignore", "keep.log"}
    with pytest.raises(FileNotFoundError, match="helper.py was removed from .* while it was being synced: sync again"):
        sync._read(str(ws), "helper.py")


def test_sync_is_incremental_and_reload_keeps_pids_and_state(ws: Path) -> None:
    pm = M.spawn("syncmesh", {"gpus": 2})
    try:
        first = S.sync(str(ws), meshes=pm)[0]
        h = first.hosts[0]
        assert sorted(h.added) == [".gitignore", "data/big.bin", "helper.py", "keep.log", "mymod.py"]
        assert h.bytes_sent == sum((ws / f).stat().st_size for f in h.added)
        import mymod

        w = pm.spawn("w", mymod.Worker, 100)
        before = w.hello.call().get().values()
        assert [b[:3] for b in before] == [("hi", "v1", 101)] * 2
        assert all(b[4].startswith(h.path) for b in before)  # imported from the host's cache

        _write(ws, "v2")  # helper.py is rewritten with the same content: it must not be sent
        again = S.sync(str(ws), meshes=pm)[0]
        h2 = again.hosts[0]
        assert h2.changed == ["mymod.py"] and h2.added == [] and h2.removed == []
        assert h2.bytes_sent == (ws / "mymod.py").stat().st_size
        assert {r["pid"] for r in again.reloads} == {b[3] for b in before}
        after = w.hello.call().get().values()
        assert [a[:3] for a in after] == [("hi", "v2", 102)] * 2  # new code, same object
        assert [a[3] for a in after] == [b[3] for b in before]

        (ws / "helper.py").write_text("GREETING = 'hello'\n")
        (ws / "keep.log").unlink()
        third = S.sync(str(ws), meshes=pm, reload="recreate")[0]
        assert third.hosts[0].removed == ["keep.log"]
        # helper changed: mymod, which uses it, is reloaded after it and the actor is rebuilt
        assert third.reloads[0]["reloaded"] == ["helper", "mymod"]
        assert [a[:3] for a in w.hello.call().get().values()] == [("hello", "v2", 101)] * 2
    finally:
        M.stop("syncmesh")


def test_sync_through_a_staging_area(ws: Path, tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    pm = M.spawn("staged", {"gpus": 1})
    try:
        rep = S.sync(str(ws), meshes=pm, via=f"file://{stage}")[0]
        # contents the host already has (from other tests) are not staged again; big.bin is new
        assert rep.staged_bytes >= 1000 and rep.hosts[0].bytes_sent == 0
        assert 1 <= len(list((stage / "blobs").iterdir())) <= 5
        import mymod

        w = pm.spawn("w", mymod.Worker, 0)
        assert w.hello.call_one().get()[:2] == ("hi", "v1")
    finally:
        M.stop("staged")


def test_staging_writes_content_addressed_blobs_to_any_fsspec_url(ws: Path) -> None:
    import fsspec

    from monarch_nb._workspace import scan as scan_ws

    man = scan_ws(str(ws))
    by_digest = {d: rel for rel, (d, _s, _m) in man.items()}
    n = S._stage("memory://mnb-stage", str(ws), by_digest, list(by_digest))
    fs = fsspec.filesystem("memory")
    assert n == sum(s for _d, s, _m in man.values())
    assert S._stage("memory://mnb-stage", str(ws), by_digest, list(by_digest)) == 0  # already there
    d, _s, _m = man["mymod.py"]
    assert fs.cat_file(f"/mnb-stage/blobs/{d}") == (ws / "mymod.py").read_bytes()


def test_restart_gives_new_procs_that_import_the_synced_code(ws: Path) -> None:
    pm = M.spawn("restarted", {"gpus": 2})
    try:
        S.sync(str(ws), meshes=pm)
        old = sorted(p.pid for p in pm._procs)
        rep = S.sync(str(ws), meshes=pm, reload="restart")[0]
        new_pm = M.get("restarted")
        assert new_pm is not pm and sorted(rep.reloads[0]["pids"]) == sorted(p.pid for p in new_pm._procs)
        assert not set(old) & {p.pid for p in new_pm._procs}
        import mymod

        w = new_pm.spawn("w", mymod.Worker, 0)
        assert all(v[4].startswith(rep.hosts[0].path) for v in w.hello.call().get().values())
    finally:
        M.stop("restarted")


def test_watch_resyncs_and_reloads_on_save(ws: Path) -> None:
    from conftest import wait_for

    pm = M.spawn("watched", {"gpus": 1})
    watcher = None
    try:
        S.sync(str(ws), meshes=pm)
        import mymod

        w = pm.spawn("w", mymod.Worker, 0)
        assert w.hello.call_one().get()[1] == "v1"
        watcher = S.watch([str(ws)], interval=0.1, meshes=pm)
        _write(ws, "v3")
        wait_for(lambda: watcher.reports, 20, "the watcher to sync the edit")
        assert watcher.reports[0].hosts[0].changed == ["mymod.py"] and not watcher.errors
        assert w.hello.call_one().get()[1] == "v3"
    finally:
        if watcher is not None:
            watcher.stop()
        M.stop("watched")


class Stray(Actor):
    @endpoint
    def strand(self, gone: str) -> None:
        # a module known by a path relative to a working directory that is then removed (a
        # persistent proc outlives the notebook directory it was started in)
        import types

        m = types.ModuleType("stray_rel")
        m.__file__ = "stray_rel.py"
        sys.modules["stray_rel"] = m
        os.chdir(gone)


def test_a_proc_whose_working_directory_was_removed_still_reloads(ws: Path, tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    pm = M.spawn("cwdgone", {"gpus": 1})
    try:
        S.sync(str(ws), meshes=pm)
        import mymod

        w = pm.spawn("w", mymod.Worker, 0)
        w.hello.call().get()
        pm.spawn("s", Stray).strand.call(str(gone)).get()
        gone.rmdir()
        _write(ws, "v2")
        rep = S.sync(str(ws), meshes=pm)[0]
        assert rep.reloads[0]["reloaded"] == ["mymod"]
        assert [v[1] for v in w.hello.call().get().values()] == ["v2"]
    finally:
        M.stop("cwdgone")


class _Takes(Actor):
    @endpoint
    def kind(self, obj: object) -> str:
        return f"{type(obj).__module__}.{type(obj).__name__}"


class _ImportsIt(Actor):
    def __init__(self) -> None:
        import onlyhere  # noqa: F401

    @endpoint
    def ok(self) -> bool:
        return True


def test_a_module_the_procs_cannot_import_is_named_with_the_sync_that_fixes_it(tmp_path: Path) -> None:
    # procs spawned the Monarch way (no %mesh name) before the module's folder was on this
    # controller's path: as on a host without the notebook's files
    from monarch_nb.actor import this_host
    from monarch_nb.errors import ActorError, SupervisionError

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "onlyhere.py").write_text("class Thing:\n    pass\n")
    note = (
        f"monarch_nb: 'onlyhere' is a module of this controller ({lib / 'onlyhere.py'}) that the procs cannot import: "
        f"`%mesh sync {lib}` (monarch_nb.sync.sync({str(lib)!r})) puts that folder first on every proc's sys.path; "
        "or install it on every host"
    )
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    sys.path.insert(0, str(lib))
    try:
        import onlyhere

        t = pm.spawn("takes", _Takes)
        # named as the program named the mesh (it read 'takes#3f2a1c.1.kind', an internal name)
        with pytest.raises(
            ActorError, match=r"^Actor call takes\.kind failed\.\nunpickling its arguments failed: .*No module named 'onlyhere'"
        ) as call:
            t.kind.call_one(onlyhere.Thing()).get(timeout=30)
        assert call.value.__notes__ == [note]
        # an actor whose __init__ imports it: its calls fail with the same note
        with pytest.raises(SupervisionError, match="No module named 'onlyhere'") as init:
            pm.spawn("imports", _ImportsIt).ok.call_one().get(timeout=30)
        assert init.value.__notes__ == [note]
        # what the note says to do works, also for procs of no %mesh name (a sync reloaded only
        # the named meshes' procs, and these never saw the synced tree)
        S.sync(str(lib))
        assert t.kind.call_one(onlyhere.Thing()).get(timeout=30) == "onlyhere.Thing"
    finally:
        sys.path.remove(str(lib))
        sys.modules.pop("onlyhere", None)
        pm.stop().get(timeout=30)


def test_a_dead_rank_of_another_mesh_does_not_fail_the_sync(tmp_path: Path) -> None:
    # every live mesh reloads by default now: one with a dead rank must not stop the others
    import signal

    from conftest import wait_for

    from monarch_nb.actor import this_host

    dying = this_host().spawn_procs(per_host={"gpus": 2})
    fine = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        os.kill(dying._procs[1].pid, signal.SIGKILL)
        wait_for(lambda: dying._failed, 15, "the mesh to hear of its dead rank")
        (tmp_path / "after_death.py").write_text("X = 7\n")
        rep = S.sync(str(tmp_path))[0]
        # (the suite's earlier meshes on hosts gone since may be listed too)
        mine = [n for n in rep.not_reloaded if f"process {dying._procs[1].pid} was killed by SIGKILL" in n]
        assert len(mine) == 1, rep
        assert "not reloaded, gone: " in repr(rep)
        pids = {r["pid"] for r in rep.reloads}
        assert {dying._procs[0].pid, fine._procs[0].pid} <= pids and dying._procs[1].pid not in pids
    finally:
        fine.stop().get(timeout=30)
        dying.stop().get(timeout=30)


def test_a_mesh_whose_allocator_is_gone_is_skipped_not_an_error(tmp_path: Path) -> None:
    # an unnamed mesh on a host (here a job) that ended since: nothing to send there, and the
    # sync of every other host goes on
    from monarch_nb.actor import this_host
    from monarch_nb.job import ProcessJob

    job = ProcessJob({"h": 1}, env={"MONARCH_NB_ZYGOTE_PRELOAD": "", "MONARCH_NB_LEASE": "60"})
    here = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        there = job.state(cached_path=None).h.spawn_procs(per_host={"gpus": 1})
        job.kill()
        (tmp_path / "after_kill.py").write_text("X = 8\n")
        # known lost by now (the job's kill says so), or found gone when asked: skipped either way
        rep = S.sync(str(tmp_path))[0]
        assert all(n.startswith("host ") for n in rep.not_reloaded if there._procs[0].alloc in n), rep.not_reloaded
        assert here._procs[0].pid in {r["pid"] for r in rep.reloads}
        assert there._procs[0].alloc not in {h.allocator for h in rep.hosts}
    finally:
        if job.active:
            job.kill()
        here.stop().get(timeout=30)


class _Reads(Actor):
    @endpoint
    def read(self) -> int:
        import other

        return other.X


def test_a_module_that_fails_to_reload_leaves_the_others_reloaded_and_is_retried(ws: Path) -> None:
    from monarch_nb.errors import ActorError

    pm = M.spawn("badreload", {"gpus": 2})
    (ws / "other.py").write_text("X = 1\n")
    try:
        S.sync(str(ws), meshes=pm)
        import mymod

        w = pm.spawn("w", mymod.Worker, 0).slice(gpus=0)  # on both ranks: both reload
        r = pm.spawn("r", _Reads).slice(gpus=0)
        assert w.hello.call_one().get()[:2] == ("hi", "v1") and r.read.call_one().get() == 1
        # one sync: mymod now imports a module not written yet, and good edits of helper (which
        # mymod imports) and of other (reloaded after mymod): the latter used to be dropped
        # after mymod's failure, for good: the next sync did not list it as changed
        (ws / "helper.py").write_text("GREETING = 'hello'\n")
        (ws / "other.py").write_text("X = 2\n")
        (ws / "mymod.py").write_text("import later  # noqa\n" + textwrap.dedent(MODULE.format(version="v2")))
        with pytest.raises(ActorError, match=r"reload failed: mymod.py: ModuleNotFoundError: .*reloaded: helper, other") as e:
            S.sync(str(ws), meshes=pm)
        assert "import later" in str(e.value)  # the remote traceback points at the line
        # what was synced, and which procs failed: the error used to carry the first proc's
        # words only, with no rank, and no report of what reached the hosts
        assert isinstance(e.value, S.SyncError) and e.value.rank == 0
        rep = e.value.report
        assert sorted(rep.hosts[0].changed) == ["helper.py", "mymod.py", "other.py"]
        assert [(f["mesh"], f["rank"]) for f in rep.reload_failed] == [("badreload", 0), ("badreload", 1)]
        shown = str(e.value).splitlines()
        assert "    ~ mymod.py" in shown and "Remote traceback of mesh 'badreload' rank 0:" in shown
        line = "reload failed in 2 procs (mesh 'badreload' ranks 0-1): mymod.py: ModuleNotFoundError: No module named 'later'"
        assert line in shown, "\n".join(shown)
        # and in a notebook (IPython shows _render_traceback_, not str)
        cell = e.value._render_traceback_()
        assert "SyncError" in cell[0] and "(rank 0, host " in cell[0], cell
        assert "    ~ mymod.py" in cell and line in cell, cell
        assert r.read.call_one().get() == 2  # the good edit is live
        assert w.hello.call_one().get()[:2] == ("hi", "v1")  # the actor still runs its old code
        # the sync that fixes it adds a file and changes none: what failed is retried
        (ws / "later.py").write_text("")
        rep = S.sync(str(ws), meshes=pm)[0]
        assert rep.hosts[0].added == ["later.py"] and rep.hosts[0].changed == []
        assert [r["reloaded"] for r in rep.reloads] == [["mymod"], ["mymod"]]
        assert w.hello.call_one().get()[:2] == ("hello", "v2")
    finally:
        M.stop("badreload")


class _Imports(Actor):
    @endpoint
    def load(self, name: str, fresh: bool = False) -> str:
        import importlib

        if fresh:  # as a proc spawned after the sync would
            sys.modules.pop(name, None)
        try:
            return importlib.import_module(name).__name__
        except ImportError as e:
            return repr(e)


def test_a_removed_or_renamed_module_is_not_a_reload_failure(ws: Path) -> None:
    pm = M.spawn("rmreload", {"gpus": 1})
    try:
        (ws / "pkg").mkdir()
        (ws / "pkg" / "__init__.py").write_text("from .sub import f\n")
        (ws / "pkg" / "sub.py").write_text("def f():\n    return 1\n")
        S.sync(str(ws), meshes=pm)
        import mymod

        w = pm.spawn("w", mymod.Worker, 0)
        w.hello.call_one().get()
        pm.spawn("imp", _Imports).load.call_one("pkg").get()
        # it read "reload failed: spec not found for the module 'pkg.sub'", and the other edit was lost
        (ws / "pkg").rename(ws / "pkg2")
        _write(ws, "v2")
        rep = S.sync(str(ws), meshes=pm)[0]
        assert sorted(rep.hosts[0].removed) == ["pkg/__init__.py", "pkg/sub.py"]
        assert rep.reloads[0]["reloaded"] == ["mymod"]
        assert w.hello.call_one().get()[1] == "v2"
        # the emptied folder used to stay on the host, and import as an empty namespace package
        assert not os.path.exists(os.path.join(rep.hosts[0].path, "pkg"))
        got = pm.spawn("imp2", _Imports).load.call_one("pkg", fresh=True).get()
        assert got == "ModuleNotFoundError(\"No module named 'pkg'\")"
    finally:
        M.stop("rmreload")


def test_an_executable_keeps_its_x_bits_on_the_host(tmp_path: Path) -> None:
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tmp_path / "run.sh").chmod(0o755)
    (tmp_path / "same.txt").write_text("#!/bin/sh\necho ran\n")  # the same content, not executable
    (tmp_path / "later.sh").write_text("#!/bin/sh\necho later\n")
    pm = M.spawn("xbits", {"gpus": 1})
    try:
        path = S.sync(str(tmp_path), meshes=pm)[0].hosts[0].path
        assert os.access(os.path.join(path, "run.sh"), os.X_OK)  # it was synced 0644
        assert not os.access(os.path.join(path, "same.txt"), os.X_OK)
        (tmp_path / "later.sh").chmod(0o755)  # a chmod alone is a change
        rep = S.sync(str(tmp_path), meshes=pm)[0]
        assert rep.hosts[0].changed == ["later.sh"]
        assert os.access(os.path.join(path, "later.sh"), os.X_OK)
    finally:
        M.stop("xbits")


def test_an_environment_in_the_workspace_is_not_synced_whatever_its_name(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    for env, marker in (("env", "pyvenv.cfg"), ("cuda-env", "conda-meta/history")):
        (tmp_path / env / "lib").mkdir(parents=True)
        (tmp_path / env / "lib" / "torch.so").write_bytes(b"\0" * 100)
        (tmp_path / env / marker).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / env / marker).write_text("")
    (tmp_path / "envs").mkdir()  # only the marker makes a folder an environment
    (tmp_path / "envs" / "cfg.py").write_text("")
    assert set(scan(str(tmp_path))) == {"train.py", "envs/cfg.py"}


def test_a_symlinked_folder_is_followed_and_a_link_back_into_the_tree_is_not(tmp_path: Path) -> None:
    # `ln -s ../common common` in a notebook's folder: it imports there, so it must on the procs
    # (the folder used to be left out: ModuleNotFoundError on every rank)
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "shared_lib.py").write_text("X = 5\n")
    ws = tmp_path / "proj"
    (ws / "src" / "pkg").mkdir(parents=True)
    (ws / "src" / "pkg" / "__init__.py").write_text("Y = 6\n")
    (ws / "common").symlink_to("../common")
    (ws / "pkg").symlink_to("src/pkg")  # inside the tree: both names import
    # loops, each of which walked forever (or through the whole file system) once links were followed
    (ws / "src" / "pkg" / "back").symlink_to("..")
    (ws / "up").symlink_to(tmp_path)
    (ws / "root").symlink_to("/")
    (ws / "self").symlink_to(".")
    (ws / "common" / "again").symlink_to(ws)  # out through one link, back in through another
    skipped: list[str] = []
    assert set(scan(str(ws), skipped=skipped)) == {"common/shared_lib.py", "src/pkg/__init__.py", "pkg/__init__.py"}
    assert sorted(skipped) == [
        f"common/again -> {ws}: a link to a folder it is in, not followed",
        "pkg/back -> ..: a link to a folder it is in, not followed",
        "root -> /: a link to a folder it is in, not followed",
        "self -> .: a link to a folder it is in, not followed",
        "src/pkg/back -> ..: a link to a folder it is in, not followed",
        f"up -> {tmp_path}: a link to a folder it is in, not followed",
    ]
    pm = M.spawn("links", {"gpus": 1})
    try:
        rep = S.sync(str(ws), meshes=pm)[0]
        assert "  not synced: root -> /: a link to a folder it is in, not followed" in repr(rep).splitlines()
        got = pm.spawn("imp", _Imports)
        assert got.load.call_one("common.shared_lib").get(timeout=30) == "common.shared_lib"
        assert got.load.call_one("pkg").get(timeout=30) == "pkg"
    finally:
        M.stop("links")


def test_a_file_that_becomes_a_folder_and_back_syncs(tmp_path: Path) -> None:
    # the new file was written before the old one was removed: "FileExistsError: ... cfg" from
    # the allocator, and every later sync failed the same way until the tree was deleted by hand
    (tmp_path / "cfg").write_text("plain file\n")
    pm = M.spawn("filedir", {"gpus": 1})
    try:
        S.sync(str(tmp_path), meshes=pm)
        (tmp_path / "cfg").unlink()
        (tmp_path / "cfg").mkdir()
        (tmp_path / "cfg" / "settings.py").write_text("LR = 0.1\n")
        rep = S.sync(str(tmp_path), meshes=pm)[0]
        assert (rep.hosts[0].added, rep.hosts[0].removed) == (["cfg/settings.py"], ["cfg"])
        assert pm.spawn("imp", _Imports).load.call_one("cfg.settings").get(timeout=30) == "cfg.settings"
        (tmp_path / "cfg" / "settings.py").unlink()
        (tmp_path / "cfg").rmdir()
        (tmp_path / "cfg").write_text("a file again\n")
        rep = S.sync(str(tmp_path), meshes=pm)[0]
        assert (rep.hosts[0].added, rep.hosts[0].removed) == (["cfg"], ["cfg/settings.py"])
        with open(os.path.join(rep.hosts[0].path, "cfg")) as f:
            assert f.read() == "a file again\n"
    finally:
        M.stop("filedir")


def test_a_large_file_crosses_in_parts_no_larger_than_a_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a 1.2 GiB file went as one message: the allocator answered no heartbeat for seconds
    # ("has not answered heartbeats for 2.0 s"), which on a remote host is a lost host and
    # every mesh on it failed; the sync itself took 17 s where parts take 5
    from monarch_nb.actor import _context

    monkeypatch.setattr(S, "BATCH_BYTES", 64 << 10)
    big = os.urandom(300 << 10)
    (tmp_path / "weights.bin").write_bytes(big)
    small = f"X = {os.urandom(8).hex()!r}\n"  # not in the host's cache from an earlier test
    (tmp_path / "small.py").write_text(small)
    pm = M.spawn("parts", {"gpus": 1})
    client = _context.client()
    sizes: list[tuple[str, int]] = []
    real = client.request

    def request(addr: str, method: str, *args, **kwargs):
        if method.startswith("sync_put"):
            sizes.append((method, len(args[3]) if method == "sync_put_part" else sum(map(len, args[0].values()))))
        return real(addr, method, *args, **kwargs)

    monkeypatch.setattr(client, "request", request)
    try:
        rep = S.sync(str(tmp_path), meshes=pm)[0]
        assert sorted(rep.hosts[0].added) == ["small.py", "weights.bin"]
        assert rep.hosts[0].bytes_sent == len(big) + len(small)
        assert max(n for _m, n in sizes) <= 64 << 10
        assert sum(n for m, n in sizes if m == "sync_put_part") == len(big)
        with open(os.path.join(rep.hosts[0].path, "weights.bin"), "rb") as f:
            assert f.read() == big
    finally:
        M.stop("parts")


def test_a_part_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    import hashlib

    from monarch_nb._runtime.codecache import CodeCache
    from monarch_nb.errors import ProtocolError

    cache = CodeCache(str(tmp_path / "code"))
    data = os.urandom(1000)
    digest = hashlib.sha256(data).hexdigest()
    assert cache.put_part(digest, "a1", 0, data[:600], 1000) == 600
    with pytest.raises(ProtocolError, match="does not match its content"):
        cache.put_part(digest, "a1", 600, b"x" * 400, 1000)
    assert cache.missing([digest]) == [digest]
    with pytest.raises(ProtocolError, match="bad part"):
        cache.put_part(digest, "../../x", 0, data, 1000)
    cache.put_part(digest, "b2", 0, data[:500], 1000)
    cache.put_part(digest, "b2", 500, data[500:], 1000)
    assert cache.missing([digest]) == []
    assert not [p for p in os.listdir(os.path.dirname(cache._blob(digest))) if p.endswith(".part")]


RECREATED = """
from monarch_nb.actor import Actor, endpoint

VERSION = {v}


class Counter(Actor):
    def __init__(self):
        {init}
        self.n = 0

    @endpoint
    def bump(self):
        self.n += 1
        return VERSION, self.n, type(self).__name__


class Other(Actor):
    @endpoint
    def version(self):
        return VERSION
"""


def test_a_constructor_that_raises_on_recreate_fails_the_sync_with_its_report(tmp_path: Path) -> None:
    # it came out of S.sync as a bare "ValueError: bad init" (no report, no rank), and the
    # actors after it in the proc were left with their previous class
    (tmp_path / "recmod.py").write_text(textwrap.dedent(RECREATED.format(v=1, init="pass")))
    sys.path.insert(0, str(tmp_path))
    pm = M.spawn("recreate", {"gpus": 2})
    try:
        S.sync(str(tmp_path), meshes=pm)
        import recmod

        c = pm.spawn("counter", recmod.Counter)
        o = pm.spawn("other", recmod.Other)
        assert c.bump.call().get().values() == [(1, 1, "Counter")] * 2
        (tmp_path / "recmod.py").write_text(textwrap.dedent(RECREATED.format(v=2, init="raise ValueError('bad init')")))
        with pytest.raises(S.SyncError) as err:
            S.sync(str(tmp_path), meshes=pm, reload="recreate")
        lines = repr(err.value.report).splitlines()
        assert (
            "reload failed in 2 procs (mesh 'recreate' ranks 0-1): actor counter (Counter.__init__): ValueError: bad init"
            in lines
        )
        assert err.value.report.reloads == []  # every proc failed; what did reload is in the error
        assert "reloaded: recmod; actors updated: other" in str(err.value)
        assert o.version.call().get().values() == [2, 2]
        # the actor whose constructor raised is the object it was, state kept
        assert c.bump.call().get().values() == [(2, 2, "Counter")] * 2
    finally:
        M.stop("recreate")
        sys.path.remove(str(tmp_path))
        sys.modules.pop("recmod", None)


def test_a_dangling_symlink_is_listed_as_not_synced(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "ckpt").symlink_to("/nonexistent/ckpt")  # a mount this machine does not have
    skipped: list[str] = []
    assert set(scan(str(tmp_path), skipped=skipped)) == {"train.py"}
    assert skipped == ["ckpt -> /nonexistent/ckpt: a link to nothing, not followed"]


def test_env_sync_ships_contents_in_batches_and_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    # %mesh env sync sent all of a distribution's files in one sync_put (torch: gigabytes in
    # one message, the host's heartbeats held up behind it)
    import hashlib

    from monarch_nb.actor import _context

    monkeypatch.setattr(S, "BATCH_BYTES", 64 << 10)
    blobs = {hashlib.sha256(b).hexdigest(): b for b in [os.urandom(200 << 10), *(os.urandom(20 << 10) for _ in range(7))]}
    pm = M.spawn("envparts", {"gpus": 1})
    client = _context.client()
    sizes: list[int] = []
    real = client.request

    def request(addr: str, method: str, *args, **kwargs):
        if method == "sync_put_part":
            sizes.append(len(args[3]))
        elif method == "sync_put":
            sizes.append(sum(map(len, args[0].values())))
        return real(addr, method, *args, **kwargs)

    monkeypatch.setattr(client, "request", request)
    try:
        alloc = pm._procs[0].alloc
        assert S.put_blobs(client, alloc, blobs, 30) == sum(map(len, blobs.values()))
        assert max(sizes) < 2 * (64 << 10) and len(sizes) > 4
        assert client.request(alloc, "sync_missing", list(blobs)).get(timeout=30) == []
    finally:
        M.stop("envparts")


def test_a_module_the_procs_imported_from_the_notebooks_folder_reloads_on_the_first_sync(tmp_path: Path) -> None:
    # on the notebook's own host a proc imports from the notebook's folder before any sync; its
    # modules were not under the synced tree, so sync after sync said "reloaded nothing" and the
    # actors ran the code they started with
    (tmp_path / "localmod.py").write_text(textwrap.dedent(MODULE.format(version="v1")))
    (tmp_path / "helper.py").write_text("GREETING = 'hi'\n")
    sys.path.insert(0, str(tmp_path))
    pm = M.spawn("localfirst", {"gpus": 1})
    try:
        import localmod

        w = pm.spawn("w", localmod.Worker, 0)
        first = w.hello.call_one().get(timeout=30)
        assert first[1] == "v1" and first[4] == str(tmp_path / "localmod.py")
        (tmp_path / "localmod.py").write_text(textwrap.dedent(MODULE.format(version="v2")))
        rep = S.sync(str(tmp_path), meshes=pm)[0]
        assert rep.reloads[0]["reloaded"] == ["localmod"]  # helper.py did not change since
        assert "reloaded localmod in 1 proc (same PIDs); actors updated: w" in repr(rep).splitlines()
        after = w.hello.call_one().get(timeout=30)
        assert after[:4] == ("hi", "v2", 2, first[3])  # new code, same object, same proc
        assert after[4].startswith(rep.hosts[0].path)  # from the synced tree from now on
    finally:
        M.stop("localfirst")
        sys.path.remove(str(tmp_path))
        for m in ("localmod", "helper"):
            sys.modules.pop(m, None)


@pytest.mark.parametrize("size", [10, 200 << 10], ids=["whole", "in-parts"])
def test_a_file_saved_again_during_the_sync_is_named_with_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    # the host refused it as "ProtocolError: blob d2102092… does not match its content; refusing
    # it": no file named, and it read as corruption (and a staging area kept the wrong blob)
    from monarch_nb import _workspace

    monkeypatch.setattr(S, "BATCH_BYTES", 64 << 10)
    (tmp_path / "train.py").write_bytes(os.urandom(size))
    real = _workspace.scan

    def scan_then_save(root: str, *args, **kwargs):
        manifest = real(root, *args, **kwargs)
        (tmp_path / "train.py").write_bytes(os.urandom(size))  # the editor saves again
        return manifest

    pm = M.spawn("saved", {"gpus": 1})
    try:
        monkeypatch.setattr(_workspace, "scan", scan_then_save)
        with pytest.raises(RuntimeError, match=f"^train.py changed in {tmp_path} while it was being synced: sync again$"):
            S.sync(str(tmp_path), meshes=pm)
        monkeypatch.setattr(_workspace, "scan", real)
        rep = S.sync(str(tmp_path), meshes=pm)[0]  # as it says
        with open(os.path.join(rep.hosts[0].path, "train.py"), "rb") as f:
            assert f.read() == (tmp_path / "train.py").read_bytes()
    finally:
        M.stop("saved")


class _Overwrites(Actor):
    @endpoint
    def overwrite(self, path: str) -> None:
        with open(path, "w") as f:
            f.write("results of run 1\n")


def test_a_rank_rewriting_a_synced_file_does_not_change_what_later_syncs_deliver(tmp_path: Path) -> None:
    # a tree's files are hard links to the host's content store: the rank's bytes became the
    # content of every later sync of that file, in any workspace, and re-syncing did not repair it
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "results.json").write_text(f'{{"baseline": "{tmp_path.name}"}}\n')
    pm = M.spawn("rewrite", {"gpus": 1})
    try:
        first = S.sync(str(a), meshes=pm)[0]
        pm.spawn("w", _Overwrites).overwrite.call_one(os.path.join(first.hosts[0].path, "results.json")).get(timeout=30)
        other = S.sync(str(b), meshes=pm)[0]
        with open(os.path.join(other.hosts[0].path, "results.json")) as f:
            assert f.read() == (b / "results.json").read_text()
        again = S.sync(str(a), meshes=pm)[0]
        assert again.hosts[0].changed == ["results.json"]  # the host's copy is put back
        with open(os.path.join(again.hosts[0].path, "results.json")) as f:
            assert f.read() == (a / "results.json").read_text()
    finally:
        M.stop("rewrite")


def test_a_module_of_an_environment_inside_the_notebooks_folder_is_not_reloaded(tmp_path: Path) -> None:
    # the folder's .venv is not synced: its modules are not the sync's to reload, edited or not
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / ".venv" / "lib" / "venvmod.py").write_text("X = 1\n")
    (tmp_path / "train.py").write_text("")
    sys.path.insert(0, str(tmp_path / ".venv" / "lib"))
    pm = M.spawn("venvlocal", {"gpus": 1})
    try:
        assert pm.spawn("imp", _Imports).load.call_one("venvmod").get(timeout=30) == "venvmod"
        (tmp_path / ".venv" / "lib" / "venvmod.py").write_text("X = 2\n")  # a pip install since
        rep = S.sync(str(tmp_path), meshes=pm)[0]
        assert rep.reloads[0]["reloaded"] == []
    finally:
        M.stop("venvlocal")
        sys.path.remove(str(tmp_path / ".venv" / "lib"))
        sys.modules.pop("venvmod", None)


def test_a_report_of_more_files_than_it_lists_says_how_many_more(tmp_path: Path) -> None:
    # the list stopped at 20 files without a word: 25 added read as these 20, in the text a
    # script prints (and %mesh sync --watch) and in the cell's HTML
    for i in range(25):
        (tmp_path / f"m{i:02}.py").write_text(f"x = {i}\n")
    pm = M.spawn("many", {"gpus": 1})
    try:
        rep = S.sync(str(tmp_path), meshes=pm, reload=None)[0]
        text = repr(rep)
        assert "    + m19.py" in text and "m20.py" not in text, text
        assert "    + … and 5 more added (.hosts[0].added lists them all)" in text.splitlines(), text
        assert "<li><code>+ … and 5 more added (.hosts[0].added lists them all)</code></li>" in rep._repr_html_()
        for i in range(21):
            (tmp_path / f"m{i:02}.py").write_text(f"x = {i + 1}\n")
        (tmp_path / "m24.py").unlink()
        rep = S.sync(str(tmp_path), meshes=pm, reload=None)[0]
        lines = repr(rep).splitlines()
        assert "    ~ … and 1 more changed (.hosts[0].changed lists them all)" in lines, lines
        assert "    - m24.py" in lines and not any("more removed" in ln for ln in lines), lines
        assert len(rep.hosts[0].changed) == 21
    finally:
        M.stop("many")


_SCAN_AS_NOBODY = """
import sys, types
m = types.ModuleType("_ws")
sys.modules["_ws"] = m
exec(compile(sys.argv[1], "_workspace.py", "exec"), m.__dict__)
for excludes in (["skip.key"], ["skip.key", "secret.key", "locked", "noexec"]):
    try:
        print("synced", sorted(m.scan(sys.argv[2], excludes)))
    except PermissionError as e:
        print("PermissionError:", e)
"""


def test_files_another_user_cannot_read_are_named_with_what_to_do() -> None:
    """As a user without root's reach (uid 65534, with the scan's own source): a file of mode 000
    raised open()'s bare ``[Errno 13] Permission denied`` from deep inside the scan, and a folder
    it cannot read or enter was left out of the sync without a word."""
    import shutil
    import tempfile

    from _nobody import NOBODY, run_as_nobody

    from monarch_nb import _workspace

    root = tempfile.mkdtemp(prefix="mnb-unreadable-", dir="/tmp")
    try:
        for rel, mode in (("ok.py", 0o644), ("secret.key", 0o000), ("skip.key", 0o000), ("locked/m.py", 0o644)):
            os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w") as f:
                f.write("x = 1\n")
            os.chmod(os.path.join(root, rel), mode)
        os.makedirs(os.path.join(root, "noexec"))
        open(os.path.join(root, "noexec", "b.py"), "w").close()
        os.makedirs(os.path.join(root, ".git"))  # never synced: unreadable, and not a word about it
        for dirpath, _dirs, files in os.walk(root):
            for n in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
                os.chown(n, NOBODY, NOBODY)
        os.chmod(root, 0o755)
        os.chmod(os.path.join(root, "locked"), 0o000)
        os.chmod(os.path.join(root, "noexec"), 0o644)  # listed, never entered
        os.chmod(os.path.join(root, ".git"), 0o000)
        with open(_workspace.__file__) as f:
            out = run_as_nobody(_SCAN_AS_NOBODY, f.read(), root).splitlines()
        assert out[0] == (
            f"PermissionError: cannot sync {root}: 3 files and folders this user (uid {NOBODY}) cannot read: "
            f"locked/ (mode 000, owner uid {NOBODY}); "
            "noexec/b.py (in a folder this user cannot enter: it lacks x); "
            f"secret.key (mode 000, owner uid {NOBODY}). Make them readable (chmod u+r, or chown), or leave them out: "
            "excludes=['locked'] (`%mesh sync --exclude locked`) or a line in .gitignore; nothing was sent"
        ), out
        assert out[1] == "synced ['ok.py']", out  # as it says
    finally:
        shutil.rmtree(root)


def test_an_unreadable_file_fails_the_sync_before_anything_changes_on_the_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # root reads every file: the scan is given open()'s error for one, as another user gets it
    # (test_files_another_user_cannot_read_are_named_with_what_to_do reads as that user)
    from monarch_nb import _workspace

    ws, other = tmp_path / "ws", tmp_path / "other"
    for d in (ws, other):
        d.mkdir()
    (ws / "unread_mod.py").write_text("V = 1\n")
    (other / "unread_other.py").write_text("W = 1\n")
    real = _workspace.file_hash

    def as_another_user(path: str) -> str:
        if path.endswith("secret.key"):
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(_workspace, "file_hash", as_another_user)
    pm = M.spawn("unread", {"gpus": 1})
    try:
        tree = S.sync(str(ws), meshes=pm)[0].hosts[0].path
        (ws / "unread_mod.py").write_text("V = 2\n")
        (ws / "secret.key").write_text("")
        # the other path comes first: it was synced (and reloaded) before the error, its report lost
        with pytest.raises(PermissionError) as e:
            S.sync([str(other), str(ws)], meshes=pm)
        assert str(e.value) == (
            f"cannot sync {ws}: a file this user (uid {os.getuid()}) cannot read: secret.key (mode 644, owner uid "
            f"{os.getuid()}). Make it readable (chmod u+r, or chown), or leave it out: excludes=['secret.key'] "
            "(`%mesh sync --exclude secret.key`) or a line in .gitignore; nothing was sent"
        )
        assert (Path(tree) / "unread_mod.py").read_text() == "V = 1\n"  # the tree the last sync left
        assert not os.path.exists(os.path.join(os.path.dirname(tree), _workspace.workspace_id(str(other))))
        reps = S.sync([str(other), str(ws)], meshes=pm, excludes=["secret.key"])  # as it says
        assert reps[1].hosts[0].changed == ["unread_mod.py"] and (Path(tree) / "unread_mod.py").read_text() == "V = 2\n"
        assert reps[0].hosts[0].path == os.path.join(os.path.dirname(tree), _workspace.workspace_id(str(other)))
    finally:
        M.stop("unread")


def test_a_watch_says_a_file_it_cannot_read_and_keeps_watching(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the scan's error ended the watch's thread: it still said "watching" and never synced again
    from conftest import wait_for

    from monarch_nb import _workspace

    (tmp_path / "a.py").write_text("")
    real_hash, real_scan = _workspace.file_hash, _workspace.scan
    scans = []

    def as_another_user(path: str) -> str:
        if path.endswith("secret.key"):
            raise PermissionError(13, "Permission denied", path)
        return real_hash(path)

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        scans.append(1)
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(_workspace, "file_hash", as_another_user)
    monkeypatch.setattr(_workspace, "scan", counted)
    watcher = S.watch([str(tmp_path)], interval=0.02, meshes=[])
    try:
        (tmp_path / "secret.key").write_text("")
        wait_for(lambda: watcher.errors, 20, "the watch to say why it cannot sync")
        n = len(scans)
        wait_for(lambda: len(scans) > n + 3, 20, "the watch to scan again")
        assert watcher.errors == [str(_workspace.unreadable_error(str(tmp_path), ["secret.key"]))]  # said once
        assert watcher._thread.is_alive()
    finally:
        watcher.stop()


def test_a_file_unreadable_by_the_time_it_is_sent_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # its hash came from the cache (a chmod leaves the mtime), and a new host lacks it
    def as_another_user(path: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise PermissionError(13, "Permission denied", path)

    (tmp_path / "big.bin").write_bytes(b"x")
    monkeypatch.setattr(S, "open", as_another_user, raising=False)
    keeps = f"the hosts keep the tree of {tmp_path} the last sync left$"
    with pytest.raises(PermissionError, match=f"^cannot sync {tmp_path}: a file .* cannot read: big.bin .*; {keeps}"):
        S._read(str(tmp_path), "big.bin")
    with pytest.raises(PermissionError, match=f"^cannot sync {tmp_path}: a file .* cannot read: big.bin .*; {keeps}"):
        S._put_parts(None, "", str(tmp_path), "big.bin", "", 1, 1)


_CONC = """
from monarch_nb.actor import Actor, endpoint
{wait}
VERSION = "{v}"


class W(Actor):
    @endpoint
    def version(self):
        return VERSION
"""

# the first sync's import, held in the proc until the test opens the gate
_CONC_WAIT = """
import os, select
open({started!r}, "w").close()
fd = os.open({gate!r}, os.O_RDONLY | os.O_NONBLOCK)
select.select([fd], [], [], 60)
os.close(fd)
"""


class _CountsReloads(Actor):
    @endpoint
    def install(self, entered: str) -> None:
        from monarch_nb.actor import _reload

        real = _reload.reload_changed

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            with open(entered, "a") as f:
                f.write("entered\n")
            return real(*args, **kwargs)

        _reload.reload_changed = counted


def test_two_syncs_at_once_reload_one_after_the_other(tmp_path: Path, gate) -> None:  # type: ignore[no-untyped-def]
    # a second sync (another thread, a watch) while the first one's reload was importing: the
    # second's reload got the half-run module back from importlib.reload and reported it
    # reloaded; the procs kept the first sync's code, and later syncs saw nothing to reload
    import threading

    from conftest import wait_for

    ws = tmp_path / "ws"
    ws.mkdir()
    started, entered, g = tmp_path / "started", tmp_path / "entered", gate("import")

    def write(v: str, wait: bool = False) -> None:
        held = _CONC_WAIT.format(started=str(started), gate=g.path) if wait else ""
        (ws / "concmod.py").write_text(_CONC.format(v=v, wait=held))

    write("v1")
    sys.path.insert(0, str(ws))
    pm = M.spawn("conc", {"gpus": 1})
    try:
        S.sync(str(ws), meshes=pm)
        import concmod

        w = pm.spawn("w", concmod.W)
        assert w.version.call_one().get(timeout=30) == "v1"
        pm.spawn("counts", _CountsReloads).install.call_one(str(entered)).get(timeout=30)
        out: dict[str, object] = {}

        def run(tag: str) -> None:
            try:
                out[tag] = S.sync(str(ws), meshes=pm)[0]
            except BaseException as e:
                out[tag] = e

        write("v2", wait=True)
        first = threading.Thread(target=run, args=("first",))
        first.start()
        wait_for(started.exists, 30, "the proc to run the first sync's import")
        write("v3")
        second = threading.Thread(target=run, args=("second",))
        second.start()
        wait_for(lambda: entered.read_text().count("entered") == 2, 30, "the second sync's reload to reach the proc")
        g.open()
        first.join(60)
        second.join(60)
        reports = [out["first"], out["second"]]
        assert all(isinstance(r, S.SyncReport) for r in reports), reports
        assert [r.reloads[0]["reloaded"] for r in reports] == [["concmod"], ["concmod"]]  # type: ignore[attr-defined]
        assert w.version.call_one().get(timeout=30) == "v3"
    finally:
        g.open()
        M.stop("conc")
        sys.path.remove(str(ws))
        sys.modules.pop("concmod", None)


_READ_ALL = """
import os, sys
for d, dirs, files in os.walk(sys.argv[1]):
    for n in files:
        try:
            open(os.path.join(d, n), "rb").read()
            print(os.path.relpath(os.path.join(d, n), sys.argv[1]))
        except OSError:
            pass
"""


@pytest.mark.timeout(60)
def test_staged_and_cached_code_is_private_whatever_the_umask(ws: Path) -> None:
    """docs/security.md: ``sync(via=a folder on a shared file system)`` staged the code with
    the umask's modes (a 0755 folder of 0644 files): every user of that file system read it. The
    host's synced tree had 0755 folders and scripts too, private only while the runtime
    directory above stayed 0700."""
    import shutil
    import tempfile

    from _nobody import run_as_nobody

    from monarch_nb._runtime.codecache import CodeCache

    (ws / "pkg" / "sub").mkdir(parents=True)
    (ws / "pkg" / "sub" / "secret.py").write_text("TOKEN = 'hunter2'\n")
    (ws / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (ws / "run.sh").chmod(0o755)
    shared = tempfile.mkdtemp(prefix="mnbs-", dir="/tmp")
    os.chmod(shared, 0o755)  # a folder of a file system other users reach
    umask = os.umask(0o022)
    try:
        man = scan(str(ws))
        by_digest = {d: rel for rel, (d, _s, _m) in man.items()}
        assert S._stage(f"file://{shared}/stage", str(ws), by_digest, list(by_digest)) > 0
        cache = CodeCache(f"{shared}/code")
        cache.put({d: (ws / rel).read_bytes() for d, rel in by_digest.items()})
        tree = cache.commit("proj-1", man)["path"]
        assert os.access(os.path.join(tree, "run.sh"), os.X_OK)
        loose = {
            os.path.relpath(os.path.join(d, n), shared): oct(os.lstat(os.path.join(d, n)).st_mode & 0o777)
            for d, dirs, files in os.walk(shared)
            for n in dirs + files
            if os.lstat(os.path.join(d, n)).st_mode & 0o077
        }
        assert loose == {"stage": "0o755"}  # the folder the user named keeps the mode they gave it
        assert run_as_nobody(_READ_ALL, shared) == ""
        # staged before, with the umask's modes: the folder is closed on the next sync
        os.chmod(f"{shared}/stage/blobs", 0o755)
        S._stage(f"file://{shared}/stage", str(ws), by_digest, list(by_digest))
        assert os.stat(f"{shared}/stage/blobs").st_mode & 0o777 == 0o700
    finally:
        os.umask(umask)
        shutil.rmtree(shared, ignore_errors=True)


_STAGE_FULL = """
import resource, signal, sys
import monarch_nb.sync as S
from monarch_nb._workspace import scan
ws, stage = sys.argv[1:3]
by_digest = {d: rel for rel, (d, _s, _m) in scan(ws).items()}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # a full disk, in effect
try:
    S._stage("file://" + stage, ws, by_digest, list(by_digest))
except OSError as e:
    print(e.errno)
"""


@pytest.mark.timeout(60)
def test_a_blob_whose_staging_write_fails_leaves_no_partial_file(ws: Path, tmp_path: Path) -> None:
    # the half-written temporary file of a failed write (a full disk) stayed in the shared
    # staging folder, one per failed sync
    import errno
    import subprocess

    (ws / "data" / "big.bin").write_bytes(os.urandom(64 << 10))
    stage = tmp_path / "stage"
    r = subprocess.run([sys.executable, "-c", _STAGE_FULL, str(ws), str(stage)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == str(errno.EFBIG), (r.stdout, r.stderr)
    assert [p.name for p in (stage / "blobs").iterdir() if not p.name.isalnum()] == []


@pytest.mark.timeout(60)
def test_a_staging_folder_another_user_made_is_refused(ws: Path) -> None:
    """Another user who made ``<via>/blobs`` first (a shared scratch folder) would have the
    code written into their folder, where a link of theirs could name any file of ours."""
    import shutil
    import tempfile

    shared = tempfile.mkdtemp(prefix="mnbs-", dir="/tmp")
    try:
        os.mkdir(f"{shared}/blobs", 0o777)
        os.chown(f"{shared}/blobs", 65534, 65534)
        man = scan(str(ws))
        by_digest = {d: rel for rel, (d, _s, _m) in man.items()}
        with pytest.raises(PermissionError, match="owned by uid 65534.*a staging folder of your own"):
            S._stage(shared, str(ws), by_digest, list(by_digest))
        assert os.listdir(f"{shared}/blobs") == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_an_interrupted_reload_says_it_goes_on_and_it_does(tmp_path: Path, gate) -> None:  # type: ignore[no-untyped-def]
    # a kernel interrupt while the procs import a slow module: the note named the proc's socket
    # ("reload on ipc://… goes on") and a future the user does not have (".get() or await")
    import signal
    import threading

    from conftest import wait_for

    ws = tmp_path / "ws"
    ws.mkdir()
    started, g = tmp_path / "started", gate("import")

    def write(v: str, wait: bool = False) -> None:
        held = _CONC_WAIT.format(started=str(started), gate=g.path) if wait else ""
        (ws / "intrmod.py").write_text(_CONC.format(v=v, wait=held))

    write("v1")
    sys.path.insert(0, str(ws))
    pm = M.spawn("intrsync", {"gpus": 2})
    try:
        S.sync(str(ws), meshes=pm)
        import intrmod

        w = pm.spawn("w", intrmod.W)
        write("v2", wait=True)
        main = threading.main_thread().ident or 0

        def interrupt_once_importing() -> None:
            wait_for(started.exists, 30, "a proc to import the new module")
            signal.pthread_kill(main, signal.SIGINT)  # the kernel's interrupt

        threading.Thread(target=interrupt_once_importing, daemon=True).start()
        with pytest.raises(KeyboardInterrupt) as ei:
            S.sync(str(ws), meshes=pm)
        notes = "\n".join(getattr(ei.value, "__notes__", []))
        assert (
            f"only the wait stopped: the hosts took the new files of {ws}, and 2 procs of mesh 'intrsync' reload them on" in notes
        ), notes
        assert "ipc://" not in notes and ".get() or await" not in notes, notes
        g.open()
        wait_for(lambda: set(w.version.call().get(timeout=30).values()) == {"v2"}, 30, "the procs to run v2")
    finally:
        sys.path.remove(str(ws))
        sys.modules.pop("intrmod", None)
        M.stop("intrsync")


class _InterruptsItsWait:
    """A host's commit future whose first wait is interrupted (SIGINT, as a kernel's): the
    moment between the hosts taking the files and the procs being asked to reload them."""

    def __init__(self, fut: object) -> None:
        self.fut, self.fired = fut, False

    def get(self, timeout: float | None = None) -> object:
        import signal

        if not self.fired:
            self.fired = True
            signal.raise_signal(signal.SIGINT)
        return self.fut.get(timeout)  # type: ignore[attr-defined]


def test_an_interrupt_between_the_commit_and_the_reload_still_reloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the host took the files, the procs were never asked to reload them, and a second sync found
    # nothing changed: the procs ran the old code until restarted, with nothing said
    from conftest import wait_for

    from monarch_nb.actor import _context

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "commitmod.py").write_text(_CONC.format(v="v1", wait=""))
    sys.path.insert(0, str(ws))
    pm = M.spawn("commitint", {"gpus": 1})
    try:
        S.sync(str(ws), meshes=pm)
        import commitmod

        w = pm.spawn("w", commitmod.W)
        (ws / "commitmod.py").write_text(_CONC.format(v="v2", wait=""))
        client = _context.client()
        real = client.request

        def request(addr: str, method: str, *args: object, **kwargs: object) -> object:
            f = real(addr, method, *args, **kwargs)
            return _InterruptsItsWait(f) if method == "sync_commit" else f

        monkeypatch.setattr(client, "request", request)
        with pytest.raises(KeyboardInterrupt) as ei:
            S.sync(str(ws), meshes=pm)
        monkeypatch.undo()
        notes = "\n".join(getattr(ei.value, "__notes__", []))
        assert "and 1 proc of mesh 'commitint' reload them on" in notes, notes
        wait_for(lambda: w.version.call_one().get(timeout=30) == "v2", 30, "the proc to run v2")
    finally:
        sys.path.remove(str(ws))
        sys.modules.pop("commitmod", None)
        M.stop("commitint")
