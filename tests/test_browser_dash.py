"""The dashboard (a widget in a notebook) and the JupyterLab sidebar tell one story, in a real
browser: one legend with the same colours, a mesh with a failed rank failed as a whole in the
same words, a rank's log tab that says how it died, and the jobs with a host the scheduler
lost. Structure, not pixels; screenshots go to ``test-artifacts/browser/``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.environ.get("MONARCH_NB_SKIP_BROWSER") == "1", reason="MONARCH_NB_SKIP_BROWSER=1"),
]

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

# the sidebar tests' fixtures and helpers: a real jupyter lab, chromium, a page per test
from test_browser import (  # noqa: E402, F401
    _SPAWNED,
    browser,
    lab,
    mesh_pids,
    open_sidebar,
    page,
    run_notebook,
    shot,
    write_notebook,
)

FAILED = "failed (healthy ranks still callable; new spawns refused)"


def _bg(loc) -> str:  # type: ignore[no-untyped-def]
    return str(loc.evaluate("e => getComputedStyle(e).backgroundColor"))


def _rgb(hex_colour: str) -> str:
    h = hex_colour.lstrip("#")
    return "rgb({}, {}, {})".format(*(int(h[i : i + 2], 16) for i in (0, 2, 4)))


def test_dashboard_and_sidebar_agree_on_a_failed_mesh(page, lab) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    from monarch_nb._meshhtml import LEGEND, STATE_COLOURS

    _SPAWNED.add("agree")
    cells = ["%load_ext monarch_nb\n%mesh spawn agree --per-host gpus=4\nd = %mesh dashboard agree\nd"]
    nb = run_notebook(page, lab, write_notebook(lab, "agree", cells))
    dash = nb.locator(".jp-OutputArea-output .mnb-dash")
    expect(dash.locator(".mnb-grid .mnb-rank")).to_have_count(4, timeout=90_000)
    panel = open_sidebar(page)
    mesh = panel.locator('.mnb-mesh[data-mesh="agree"]')
    expect(mesh.locator(".mnb-rank")).to_have_count(4)

    # one legend: the same states in the same order, the same colours
    side_legend = panel.locator(".mnb-legend .mnb-legend-item")
    dash_legend = dash.locator(".mnb-legend .mnb-legend-item")
    expect(side_legend).to_have_count(len(LEGEND))
    assert [side_legend.nth(i).get_attribute("data-state") for i in range(len(LEGEND))] == list(LEGEND)
    assert [dash_legend.nth(i).get_attribute("data-state") for i in range(len(LEGEND))] == list(LEGEND)
    for i, s in enumerate(LEGEND):
        assert _bg(side_legend.nth(i).locator(".mnb-swatch")) == _rgb(STATE_COLOURS[s]), s
    # "Start allocator" is not offered while one runs
    expect(panel.locator(".mnb-start-allocator")).to_be_hidden()

    pid = mesh_pids("agree")[2]
    os.kill(pid, signal.SIGKILL)
    # failed as a whole, in the same words, in both
    expect(mesh.locator(".mnb-badge")).to_have_text(FAILED, timeout=10_000)
    expect(mesh.locator(".mnb-hint")).to_contain_text("%mesh stop agree")
    state = dash.locator(".mnb-mesh-state")
    expect(state).to_have_text(FAILED, timeout=10_000)
    expect(dash.locator(".mnb-hint")).to_contain_text("%mesh stop agree")
    # rank by rank: the same state and the same colour
    for r in range(4):
        side = mesh.locator(f'.mnb-rank[data-rank="{r}"]')
        tile = dash.locator(f'.mnb-grid .mnb-rank[data-rank="{r}"]')
        want = "failed" if r == 2 else "(idle|busy)"
        expect(side).to_have_class(re.compile(rf"\bmnb-state-{want}\b"))
        expect(tile).to_have_class(re.compile(rf"\bmnb-state-{want}\b"))
        assert _bg(side) == _bg(tile), r
    assert _bg(mesh.locator('.mnb-rank[data-rank="2"]')) == _rgb(STATE_COLOURS["failed"])
    expect(dash.locator(".mnb-errors")).to_contain_text("rank 2 on")
    dash.scroll_into_view_if_needed()
    shot(page, "dashboard-and-sidebar-failed-mesh")

    # the failed rank's log tab says where it ran and how it died
    mesh.locator('.mnb-rank[data-rank="2"]').click()
    head = page.locator(".mnb-RankLogPanel:visible .mnb-ranklog-head")
    expect(head).to_have_text(re.compile(rf"rank 2 of agree · host \S+ · pid {pid} · failed · .*killed by SIGKILL"))
    shot(page, "sidebar-rank-log-of-a-failed-rank")


def test_job_rows_in_the_sidebar_and_the_dashboard_with_a_lost_host(page, lab) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    from monarch_nb.job import job_load, list_jobs
    from monarch_nb.job._named import named_job_path

    cells = [
        "%load_ext monarch_nb\n%mesh launch process bjob --hosts 2\n"
        "procs = bjob.spawn_procs(per_host={'gpus': 1}, name='bjobp')\nd = %mesh dashboard procs\nd"
    ]
    _SPAWNED.add("bjobp")
    try:
        nb = run_notebook(page, lab, write_notebook(lab, "bjob", cells))
        dash_row = nb.locator('.jp-OutputArea-output .mnb-dash .mnb-jobs tr.mnb-job[data-job="bjob"]')
        expect(dash_row).to_have_attribute("data-state", "running", timeout=120_000)
        expect(dash_row).to_contain_text(re.compile(r"bjob\s*process\s*[0-9a-f]{8}\s*running\s*2"))
        panel = open_sidebar(page)
        side_row = panel.locator('.mnb-job[data-job="bjob"]')
        expect(side_row).to_have_attribute("data-state", "running", timeout=15_000)
        expect(side_row).to_contain_text(re.compile(r"process [0-9a-f]{8} · 2 host\(s\) · age \d+m\d\ds"))

        # the scheduler loses a host: both name it, within their refresh (5 s for jobs)
        slot, info = sorted(job_load(named_job_path("bjob"))._hosts.items())[1]
        os.kill(int(info["pid"]), signal.SIGKILL)
        expect(side_row).to_have_attribute("data-state", "lost", timeout=15_000)
        expect(side_row.locator(".mnb-lost")).to_have_text(f"lost: {slot}")
        expect(dash_row).to_have_attribute("data-state", "lost", timeout=15_000)
        expect(dash_row).to_contain_text(f"({slot} lost)")
        # the job's mesh is in the sidebar too: the rank on the lost host failed, the mesh as a whole
        mesh = panel.locator('.mnb-mesh[data-mesh="bjobp"]')
        expect(mesh.locator(".mnb-badge")).to_have_text(FAILED, timeout=15_000)
        shot(page, "dashboard-and-sidebar-job-lost-host")
    finally:
        if any(r["name"] == "bjob" for r in list_jobs()):
            subprocess.run([sys.executable, "-m", "monarch_nb", "job", "kill", "bjob"], capture_output=True, timeout=60)


def test_a_dashboard_says_it_is_not_live_once_its_kernel_restarts(page, lab) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    _SPAWNED.add("stale")
    cells = ["%load_ext monarch_nb\n%mesh spawn stale --per-host gpus=2", "%load_ext monarch_nb\nd = %mesh dashboard stale\nd"]
    nb = run_notebook(page, lab, write_notebook(lab, "stale", cells))
    dash = nb.locator(".jp-OutputArea-output .mnb-dash")
    expect(dash.locator(".mnb-grid .mnb-rank")).to_have_count(2, timeout=90_000)
    expect(dash.locator(".mnb-stale-note")).to_have_count(0)

    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Kernel$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Restart Kernel…$")).click()
    page.locator(".jp-Dialog button.jp-mod-accept").click()
    # the last drawn view stays: it must not pass for live, and its buttons must not throw
    # "Cannot send" into the console (the page fixture fails the test on a page error)
    expect(dash.locator(".mnb-stale-note")).to_have_text(re.compile(r"^Not live: the kernel that drew this dashboard restarted"))
    for label in ("refresh", "stacks", "stop mesh"):
        expect(dash.locator("button", has_text=label)).to_be_disabled()
    expect(dash.get_by_placeholder("ranks, e.g. 0-3")).to_be_disabled()
    shot(page, "dashboard-stale-after-restart")

    # run the dashboard's cell again (the named mesh outlived the kernel): the new one is live
    expect(page.locator(".jp-StatusBar-Widget", has_text="| Idle").first).to_be_visible(timeout=60_000)
    nb.locator(".jp-Cell").nth(1).locator(".jp-InputPrompt").click()
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run Selected Cell$")).click()
    fresh = nb.locator(".jp-OutputArea-output .mnb-dash:not(.mnb-dash-stale)")
    expect(fresh.locator(".mnb-grid .mnb-rank")).to_have_count(2, timeout=90_000)
    expect(nb.locator(".mnb-stale-note")).to_have_count(0)
    expect(fresh.locator("button", has_text="refresh")).to_be_enabled()
