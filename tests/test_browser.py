"""The JupyterLab sidebar in a real browser: a real ``jupyter lab`` on localhost, real kernels
started by it, and Debian's chromium driven by Playwright (see ../shared/TOOLCHAIN.md).

Screenshots go to ``test-artifacts/browser/`` (or ``$MONARCH_NB_TEST_ARTIFACTS``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from _kernel import poll
from conftest import wait_for

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = (
    Path(os.environ.get("MONARCH_NB_TEST_ARTIFACTS") or Path(__file__).resolve().parent.parent / "test-artifacts") / "browser"
)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.environ.get("MONARCH_NB_SKIP_BROWSER") == "1", reason="MONARCH_NB_SKIP_BROWSER=1"),
]

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

TAB = '.jp-SideBar.jp-mod-left li.lm-TabBar-tab[data-id="monarch-nb-sidebar"]'
PANEL = "#monarch-nb-sidebar"


@pytest.fixture(scope="module")
def lab():
    from _jupyter import JupyterServer

    s = JupyterServer("lab")
    try:
        yield s
        s.shutdown_kernels()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def browser(lab):
    assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing: bash .ci/setup installs Debian's chromium"
    profile = tempfile.mkdtemp(prefix="mnbc-", dir="/tmp")
    # chromium writes crash reports and dconf under HOME/XDG dirs even with a fresh profile
    env = {**os.environ, "HOME": profile, "XDG_CONFIG_HOME": f"{profile}/config", "XDG_CACHE_HOME": f"{profile}/cache"}
    with playwright_sync.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            f"{profile}/user-data",
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
            env=env,
            viewport={"width": 1400, "height": 900},
        )
        # nothing leaves localhost: a request elsewhere would hang a test here
        ctx.route("**/*", lambda r: r.continue_() if r.request.url.startswith(lab.base) else r.abort())
        ctx.set_default_timeout(30_000)
        yield ctx
        ctx.close()
    import shutil

    shutil.rmtree(profile, ignore_errors=True)


#: meshes the tests spawned from notebooks: named meshes outlive their kernel by design
_SPAWNED: set[str] = set()


@pytest.fixture
def page(browser, lab, request):
    pg = browser.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    try:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(ARTIFACTS / f"{request.node.name}-end.png"))
    finally:
        try:
            pg.close()
        finally:
            # the page's kernels and the meshes they spawned go even if the screenshot failed
            lab.shutdown_kernels()
            _stop_spawned()
    assert not errors, errors


def _stop_spawned() -> None:
    from monarch_nb.allocator import stop_mesh
    from monarch_nb.errors import MeshError

    while _SPAWNED:
        try:
            stop_mesh(_SPAWNED.pop())
        except MeshError:
            pass  # the test stopped it already


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def write_notebook(lab, name: str, cells: list[str]) -> str:
    nb = {
        "cells": [
            {"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [], "source": src}
            for i, src in enumerate(cells)
        ],
        "metadata": {
            "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = f"{name}.ipynb"
    with open(os.path.join(lab.root, path), "w") as f:
        json.dump(nb, f)
    return path


def run_notebook(page, lab, path: str):
    """Open the notebook in a fresh workspace, run all its cells; returns the notebook panel."""
    from _jupyter import TOKEN

    page.goto(f"{lab.base}/lab/tree/{path}?reset&token={TOKEN}")
    nb = page.locator(".jp-NotebookPanel:visible")
    expect(nb).to_have_count(1, timeout=60_000)
    expect(page.locator(".jp-StatusBar-Widget", has_text="| Idle").first).to_be_visible(timeout=60_000)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    return nb


def open_sidebar(page):
    tab = page.locator(TAB)
    tab.click()
    panel = page.locator(PANEL)
    expect(panel).to_be_visible()
    return panel


def mesh_pids(name: str) -> dict[int, int]:
    import monarch_nb

    for a in monarch_nb.status()["allocators"]:
        for m in a.get("meshes", []):
            if m["name"] == name:
                return {p["rank"]: p["pid"] for p in m["procs"]}
    return {}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


SPAWN = 'from monarch_nb.actor import this_host\nprocs = this_host().spawn_procs(per_host={{"gpus": 4}}, name="{name}")\nprint("spawned", "{name}")'


def spawn_from_notebook(page, lab, name: str, *more_cells: str):
    _SPAWNED.add(name)
    nb = run_notebook(page, lab, write_notebook(lab, name, [SPAWN.format(name=name), *more_cells]))
    expect(nb.locator(".jp-OutputArea-output", has_text=f"spawned {name}")).to_be_visible(timeout=90_000)
    return nb


def test_sidebar_shows_a_mesh_spawned_from_a_notebook(page, lab) -> None:
    spawn_from_notebook(page, lab, "demo")
    panel = open_sidebar(page)
    mesh = panel.locator('.mnb-mesh[data-mesh="demo"]')
    ranks = mesh.locator(".mnb-rank")
    expect(ranks).to_have_count(4)
    for r in range(4):
        rank = mesh.locator(f'.mnb-rank[data-rank="{r}"]')
        expect(rank).to_have_class(re.compile(r"\bmnb-state-(idle|busy)\b"))
        expect(rank).to_have_attribute("title", re.compile(rf"rank {r} \((idle|busy)[^)]*\)\nhost \S+, pid \d+"))
    expect(mesh.locator(".mnb-badge")).to_have_text(re.compile(r"^(idle|busy)$"))
    expect(panel.locator(".mnb-allocator.mnb-alive").first).to_be_visible()
    expect(panel.locator(".mnb-section-debug .mnb-empty")).to_be_visible()
    shot(page, "sidebar-mesh-running")


def test_sigkilled_proc_turns_red_in_the_sidebar_within_3s(page, lab) -> None:
    nb = spawn_from_notebook(
        page, lab, "victim", "%load_ext monarch_nb\nfrom monarch_nb.widgets import Dashboard\nDashboard(procs)"
    )
    widget_rank2 = nb.locator('.jp-OutputArea-output .mnb-grid .mnb-rank[data-rank="2"]')
    expect(widget_rank2).to_have_class(re.compile(r"\bmnb-state-(idle|busy)\b"), timeout=60_000)
    panel = open_sidebar(page)
    rank2 = panel.locator('.mnb-mesh[data-mesh="victim"] .mnb-rank[data-rank="2"]')
    expect(rank2).to_have_class(re.compile(r"\bmnb-state-(idle|busy)\b"))
    pid = mesh_pids("victim")[2]
    # a keyboard user on rank 0: the mesh's section is rebuilt when rank 2 fails
    rank0 = panel.locator('.mnb-mesh[data-mesh="victim"] .mnb-rank[data-rank="0"]')
    rank0.focus()

    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    expect(rank2).to_have_class(re.compile(r"\bmnb-state-failed\b"), timeout=3000)
    # the dashboard widget in the notebook too, updated by its own thread with no cell running
    expect(widget_rank2).to_have_class(re.compile(r"\bmnb-state-failed\b"), timeout=3000)
    seen_after = time.monotonic() - t0
    assert seen_after < 3.0
    expect(rank0).to_be_focused()  # focus stayed on the rebuilt rank 0
    shot(page, "sidebar-rank-failed")

    # red, and the reason is there for the user
    rgb = rank2.evaluate("e => getComputedStyle(e).backgroundColor")
    r, g, b = (int(x) for x in re.findall(r"\d+", rgb)[:3])
    assert r > 150 and g < 100 and b < 100, rgb
    expect(rank2).to_have_attribute("title", re.compile("SIGKILL"))
    expect(panel.locator('.mnb-mesh[data-mesh="victim"] .mnb-cause[data-rank="2"]')).to_contain_text("killed by SIGKILL")
    # the other ranks are still running
    for r in (0, 1, 3):
        expect(panel.locator(f'.mnb-mesh[data-mesh="victim"] .mnb-rank[data-rank="{r}"]')).to_have_class(
            re.compile(r"\bmnb-state-(idle|busy)\b")
        )


NAP = """from monarch_nb.actor import Actor, endpoint
import time

class Napper(Actor):
    @endpoint
    def nap(self, s):
        time.sleep(s)

naps = procs.spawn("napper", Napper).nap.call(120)
print("napping")"""


def test_stop_mesh_from_the_sidebar(page, lab) -> None:
    spawn_from_notebook(page, lab, "stopme", NAP)
    panel = open_sidebar(page)
    mesh = panel.locator('.mnb-mesh[data-mesh="stopme"]')
    expect(mesh.locator(".mnb-rank.mnb-state-busy")).to_have_count(4, timeout=30_000)
    pids = mesh_pids("stopme")
    assert len(pids) == 4
    # a busy rank's tooltip says what it does once: it said "(busy: busy in napper.nap)"
    rank0 = mesh.locator('.mnb-rank[data-rank="0"]')
    expect(rank0).to_have_attribute("title", re.compile(r"^rank 0 \(busy in [^)]*nap\)\nhost "))

    # a double-click asks once, and stops once: its second click opened a second dialog which,
    # confirmed, reached the server after the mesh was gone (a 404 toast)
    mesh.locator(".mnb-stop-mesh").dblclick()
    dialog = page.locator(".jp-Dialog")
    expect(dialog).to_have_count(1)
    expect(dialog).to_contain_text("Stop mesh stopme?")
    dialog.locator("button.jp-mod-accept").click()
    # its ranks are in a call: the stop takes the cleanup timeout, with the button disabled
    expect(mesh.locator(".mnb-stop-mesh")).to_be_disabled()

    expect(mesh).to_have_count(0, timeout=15_000)
    expect(page.locator(".jp-Dialog")).to_have_count(0)
    expect(page.get_by_text("Could not stop mesh")).to_have_count(0)
    shot(page, "sidebar-mesh-stopped")
    wait_for(lambda: all(_gone(p) for p in pids.values()), 15, "the stopped mesh's procs to exit")
    assert mesh_pids("stopme") == {}


HELLO = """from monarch_nb.actor import Actor, endpoint, current_rank

class Hello(Actor):
    @endpoint
    def hi(self):
        print(f"hello from rank {current_rank().rank}", flush=True)

procs.spawn("hello", Hello).hi.call().get()
print("said hello")"""


def test_rank_log_recent_logs_and_inserting_a_connect_cell(page, lab) -> None:
    nb = spawn_from_notebook(page, lab, "talky", HELLO)
    expect(nb.locator(".jp-OutputArea-output", has_text="said hello")).to_be_visible(timeout=60_000)
    panel = open_sidebar(page)
    expect(panel.locator(".mnb-section-logs .mnb-log-line", has_text="hello from rank 3")).to_contain_text("[talky 3]")

    panel.locator('.mnb-mesh[data-mesh="talky"] .mnb-rank[data-rank="1"]').click()
    log = page.locator(".mnb-RankLogPanel:visible")
    expect(log).to_have_count(1)
    expect(log.locator(".mnb-ranklog-lines")).to_contain_text("hello from rank 1")
    expect(log.locator(".mnb-ranklog-lines")).not_to_contain_text("hello from rank 0")
    expect(page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")).to_contain_text("talky rank 1 log")
    shot(page, "sidebar-rank-log")
    # a rank square is a role=button: Space opens its log as Enter does
    for key, rank in (("Enter", 2), ("Space", 3)):
        panel.locator(f'.mnb-mesh[data-mesh="talky"] .mnb-rank[data-rank="{rank}"]').press(key)
        expect(page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")).to_contain_text(f"talky rank {rank} log")
        expect(page.locator(".mnb-RankLogPanel:visible .mnb-ranklog-lines")).to_contain_text(f"hello from rank {rank}")

    # back to the notebook: the insert action puts a cell into the active notebook
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="talky.ipynb").click()
    addr = panel.locator(".mnb-allocator.mnb-alive").first.get_attribute("data-addr")
    panel.locator(".mnb-allocator.mnb-alive .mnb-insert-connect").first.click()
    nb = page.locator(".jp-NotebookPanel:visible")
    expect(nb.locator(".jp-Cell")).to_have_count(3)
    expect(nb.locator(".jp-Cell.jp-mod-active .cm-content")).to_have_text(f"%mesh connect {addr}")
    shot(page, "sidebar-insert-connect")


PAUSE_TWO = """
from monarch_nb.actor import Actor, endpoint, this_host

class Trainer(Actor):
    @endpoint
    def step(self):
        breakpoint()
        return 1

for name in ("dbg-m1", "dbg-m2"):
    this_host().spawn_procs(per_host={"gpus": 1}, name=name).spawn("trainer", Trainer).step.broadcast()
print("paused both", flush=True)
"""


def test_each_debug_row_inserts_an_attach_that_reaches_its_own_rank(page, lab) -> None:
    # two actor meshes named "trainer", rank 0 of each at a breakpoint: "%mesh attach trainer 0"
    # is refused as ambiguous, so each row names its own session
    _SPAWNED.update(("dbg-m1", "dbg-m2"))
    nb = run_notebook(page, lab, write_notebook(lab, "dbgrows", [PAUSE_TWO]))
    expect(nb.locator(".jp-OutputArea-output", has_text="paused both")).to_be_visible(timeout=90_000)
    panel = open_sidebar(page)
    rows = panel.locator(".mnb-section-debug .mnb-debug")
    expect(rows).to_have_count(2, timeout=30_000)
    row = panel.locator('.mnb-debug[data-mesh="dbg-m2"]')
    expect(row).to_contain_text(re.compile(r"trainer rank 0 of dbg-m2 at .*:\d+ in step"))
    row.locator(".mnb-insert-attach").click()
    expect(nb.locator(".jp-Cell")).to_have_count(2)
    text = nb.locator(".jp-Cell.jp-mod-active .cm-content").inner_text()
    (sid,) = [d["actor_id"] for d in lab.request("GET", "/monarch-nb/api/state")[1]["debug_sessions"] if d["mesh"] == "dbg-m2"]
    assert text == f"%mesh attach '{sid}' 0", text


FLOOD = """
import sys
import monarch_nb.actor as api
from monarch_nb.actor import Actor, current_rank, endpoint, this_host

class Flood(Actor):
    @endpoint
    def go(self, n):
        r = current_rank().rank
        for i in range(n):
            print(f"flood rank {r} line {i}")
        print(f"flood rank {r} done", flush=True)

procs = this_host().spawn_procs(per_host={"gpus": 4}, name="flood")
print("ready", flush=True)
procs.spawn("flood", Flood).go.call(25000).get(timeout=180)
print("flooded", flush=True)
sys.stdin.read()
"""


def test_sidebar_stays_responsive_during_a_100k_line_flood(page, lab, tmp_path) -> None:
    import subprocess

    from _jupyter import TOKEN
    from conftest import PY

    page.goto(f"{lab.base}/lab?reset&token={TOKEN}")
    panel = open_sidebar(page)
    expect(panel.locator(".mnb-status")).to_contain_text("updated")
    _SPAWNED.add("flood")
    out = tmp_path / "flood.out"
    # a separate controller floods; its own output goes to a file it can never block on
    with open(out, "w") as f:
        ctl = subprocess.Popen([PY, "-c", FLOOD], stdin=subprocess.PIPE, stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: "ready" in out.read_text(), 60, "the flooding controller to spawn its mesh")
        worst = 0.0
        # while 4 ranks print 100,000 lines, the page keeps answering
        while "flooded" not in out.read_text():
            assert ctl.poll() is None, out.read_text()[-2000:]
            t0 = time.monotonic()
            panel.locator(".mnb-status").inner_text(timeout=5000)
            worst = max(worst, time.monotonic() - t0)
        assert worst < 2.0, f"the page took {worst:.1f} s to answer during the flood"
        # and the sidebar still refreshes: the last lines and the states are there
        expect(panel.locator(".mnb-section-logs")).to_contain_text("flood rank 3 done", timeout=10_000)
        expect(panel.locator('.mnb-mesh[data-mesh="flood"] .mnb-rank:is(.mnb-state-idle, .mnb-state-busy)')).to_have_count(4)
        assert panel.locator(".mnb-section-logs .mnb-log-line").count() <= 100
        shot(page, "sidebar-after-flood")
    finally:
        ctl.communicate("", timeout=60)


def test_late_rank_output_shows_in_its_cell_and_a_flood_keeps_the_page_responsive(page, lab, tmp_path) -> None:
    flag = tmp_path / "go"
    _SPAWNED.add("latebr")
    cells = [
        "%load_ext monarch_nb\n%mesh spawn latebr --per-host gpus=2\nprint('spawned latebr')",
        "%%mesh exec latebr --no-block\nimport os, time\nfrom monarch_nb.actor import current_rank\n"
        + poll(f"os.path.exists({str(flag)!r})", 120)
        + "print('late hello from', current_rank().rank)",
        "print('second cell ran')",
    ]
    nb = run_notebook(page, lab, write_notebook(lab, "latebr", cells))
    expect(nb.locator(".jp-OutputArea-output", has_text="second cell ran")).to_be_visible(timeout=90_000)
    expect(page.locator(".jp-StatusBar-Widget", has_text="| Idle").first).to_be_visible(timeout=30_000)
    flag.touch()
    # the output arrives after both cells finished, and lands in the cell that made the call
    cell1 = nb.locator(".jp-Cell").nth(1)
    expect(cell1.locator(".jp-OutputArea-output", has_text="late hello from 0…1")).to_be_visible(timeout=15_000)
    expect(nb.locator(".jp-Cell").nth(2).locator(".jp-OutputArea-output", has_text="late hello")).to_have_count(0)
    shot(page, "late-output-in-calling-cell")

    # 100,000 lines from 16 ranks into a cell, unaggregated: the page and the kernel keep answering
    flood = [
        "%mesh spawn floodnb --per-host gpus=16\nprint('spawned floodnb')",
        "%%mesh exec floodnb --no-aggregate\nfor i in range(6250): print('flood line', i)",
        "print('after the flood')",
    ]
    _SPAWNED.add("floodnb")
    nb = run_notebook(page, lab, write_notebook(lab, "floodnb", ["%load_ext monarch_nb", *flood]))
    worst = 0.0
    deadline = time.monotonic() + 120
    while not nb.locator(".jp-OutputArea-output", has_text="after the flood").count():
        assert time.monotonic() < deadline, "the flood cell never finished"
        t0 = time.monotonic()
        page.locator(".jp-NotebookPanel:visible .jp-Cell").first.inner_text(timeout=5000)
        worst = max(worst, time.monotonic() - t0)
    assert worst < 2.0, f"the page took {worst:.1f} s to answer during the flood"
    expect(nb.locator(".jp-OutputArea-output", has_text="lines suppressed — %mesh logs floodnb")).to_be_visible(timeout=30_000)
    shot(page, "flood-in-a-cell")
