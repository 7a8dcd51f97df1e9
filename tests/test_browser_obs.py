"""What a notebook shows of a cluster, in JupyterLab in a real browser: a grouped 4-of-16
error, an ordered aggregated training log, a 2×8 ValueMesh table, a 128-rank grid and the
stacks tree of a hung collective. Structure, not pixels; screenshots of each output go to
``test-artifacts/browser/``."""

from __future__ import annotations

import os
import re

import pytest

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.environ.get("MONARCH_NB_SKIP_BROWSER") == "1", reason="MONARCH_NB_SKIP_BROWSER=1"),
]

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

# the sidebar tests' fixtures and helpers: a real jupyter lab, chromium, a page per test
from test_browser import _SPAWNED, ARTIFACTS, browser, lab, page, run_notebook, write_notebook  # noqa: E402, F401

CELLS = [
    "%load_ext monarch_nb\n%mesh connect\n%mesh spawn obsb --per-host gpus=16",
    """from monarch_nb.actor import Actor, endpoint, current_rank

class Worker(Actor):
    @endpoint
    def lookup(self):
        r = current_rank().rank
        if r % 4 == 0:
            raise KeyError(f"shard {r}")
        return r

    @endpoint
    def train(self, steps):
        r = current_rank().rank
        for s in range(steps):
            print(f"step {s} loss={(steps - s) * 0.02 + r * 0.001:.3f}")

    @endpoint
    def hello(self):
        return current_rank().rank * 10

workers = obsb.spawn("workers", Worker)""",
    "workers.train.call(8).get();",
    'workers.rename(gpus="all").split(all=("hosts", "gpus"), gpus=8).hello.call().get()',
    "%mesh spawn obsbig --per-host hosts=8,gpus=16\nobsbig",
    """%mesh spawn hungb --per-host gpus=4
from monarch_nb.spmd import setup_env_for_distributed
from monarch_nb import debug
import time

class Hang(Actor):
    @endpoint
    def reduce(self):
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if current_rank().rank == 3:
            return "never joins"
        t = torch.ones(4)
        dist.all_reduce(t)

setup_env_for_distributed(hungb)
pending = hungb.spawn("hangs", Hang).reduce.call()
t = time.monotonic()
while "all_reduce" not in str(debug.stacks(hungb, "0-2")) and time.monotonic() - t < 60:
    time.sleep(0.2)""",
    "%mesh stacks hungb --timeout 10",
    "workers.lookup.call().get()",
]


def _out(nb, i: int):  # type: ignore[no-untyped-def]
    return nb.locator(".jp-Notebook .jp-Cell").nth(i).locator(".jp-OutputArea-output")


def _shot(loc, name: str) -> None:  # type: ignore[no-untyped-def]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    loc.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def test_errors_logs_tables_grids_and_stacks_in_the_page(page, lab) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    _SPAWNED.update({"obsb", "obsbig", "hungb"})
    nb = run_notebook(page, lab, write_notebook(lab, "observability", CELLS))

    # the grouped error (last cell: it ends Run All)
    err = _out(nb, 7).filter(has_text="KeyError on 4 of 16 ranks")
    expect(err).to_be_visible(timeout=180_000)
    text = err.inner_text()
    assert text.splitlines()[0].endswith("Actor call workers.lookup failed."), text
    assert "KeyError on 4 of 16 ranks: 0,4,8,12" in text and text.count("Traceback of where") == 1
    assert re.search(r"Cell In\[\d+\], line 8, in lookup", text) and "monarch_nb" not in text, text
    err.scroll_into_view_if_needed()
    _shot(err, "obs-grouped-error")

    # 8 training steps on 16 ranks: 8 lines, in order
    # (the cell's first output is the provisional first line's display, emptied once its group shows)
    log = _out(nb, 2).filter(has_text="step 7").first
    lines = [ln for ln in log.inner_text().splitlines() if "step" in ln]
    assert [ln.split(" loss=")[0] for ln in lines] == [f"[ranks 0-15 ×16] step {s}" for s in range(8)], lines
    _shot(log, "obs-ordered-training-log")

    # a 2×8 ValueMesh is a 2×8 table
    table = _out(nb, 3).locator("table.mnb-table")
    expect(table).to_have_count(1)
    expect(table.locator("tbody tr")).to_have_count(2)
    for row in range(2):
        expect(table.locator("tbody tr").nth(row).locator("td")).to_have_count(8)
    expect(table.locator('td[data-rank="9"]')).to_have_text("90")
    _shot(table, "obs-value-mesh-2x8")

    # 128 ranks: tiles of at least 8 px, the grid within 1000×700, hover shows host and pid
    grid = _out(nb, 4).locator(".mnb-rg .mnb-grid")
    tiles = grid.locator(".mnb-tile")
    expect(tiles).to_have_count(128)
    box = grid.bounding_box()
    assert box and box["width"] <= 1000 and box["height"] <= 700, box
    for i in (0, 77, 127):
        t = tiles.nth(i).bounding_box()
        assert t and t["width"] >= 8 and t["height"] >= 8, t
    tiles.nth(77).hover()
    expect(tiles.nth(77)).to_have_attribute("title", re.compile(r"rank 77 \(hosts=4, gpus=13\) · host \S+ · pid \d+ · idle"))
    _shot(_out(nb, 4).locator(".mnb-rg"), "obs-128-rank-grid")

    # the stacks of a hung collective: ranks 0-2 merged in all_reduce, collapsible
    node = _out(nb, 6).locator('details.mnb-stack-node[data-ranks="0-2"]').first
    expect(node).to_be_visible()
    expect(node).to_contain_text("all_reduce")
    expect(node).to_contain_text("ranks 0-2 (3)")
    _shot(_out(nb, 6).locator(".mnb-stacks"), "obs-stacks-hung-collective")
    node.locator("summary").first.click()
    expect(node).not_to_have_attribute("open", "")
