"""The trace timeline of ``%mesh trace`` in JupyterLab in a real browser: a row per rank, calls
as bars with the spans inside them, the straggler named in red. Structure, not pixels; a
screenshot goes to ``test-artifacts/browser/obs-trace-timeline.png``."""

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
    "%load_ext monarch_nb\n%mesh connect\n%mesh spawn traceb --per-host gpus=4",
    """import tempfile, time
from monarch_nb import telemetry
from monarch_nb.actor import Actor, endpoint, current_rank

class Trainer(Actor):
    @endpoint
    def step(self):
        with telemetry.span("load"):
            time.sleep(0.001)
        with telemetry.span("compute"):
            time.sleep(0.06 if current_rank().rank == 3 else 0.002)

trainers = traceb.spawn("trainers", Trainer)
started = time.time()
for _ in range(5):
    trainers.step.call().get()
# the allocators drain the procs' spans about once a second
deadline = time.monotonic() + 60
while len(telemetry.query_records("traceb", since=started)) < 60 and time.monotonic() < deadline:
    time.sleep(0.2)
out = tempfile.mkdtemp(prefix="trace-")""",
    "%mesh trace traceb --last 5m --out {out}/traceb.json",
]


def test_the_trace_timeline_draws_every_rank_and_names_the_straggler(page, lab) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    _SPAWNED.add("traceb")
    nb = run_notebook(page, lab, write_notebook(lab, "trace", CELLS))
    out = nb.locator(".jp-Notebook .jp-Cell").nth(2).locator(".jp-OutputArea-output")
    view = out.locator(".mnb-trace")
    expect(view).to_be_visible(timeout=180_000)
    expect(view).to_contain_text(re.compile(r"60 spans of 4 ranks in the last 5m written to \S+/traceb\.json"))
    expect(view).to_contain_text(re.compile(r"straggler: traceb rank 3 \(\S+\) trainers\.step median [\d.]+ ms"))

    svg = view.locator("svg.mnb-timeline")
    expect(svg).to_be_visible()
    # a row per rank, labelled; the straggler's label in red
    labels = svg.locator("text")
    for r in range(3):
        expect(labels.filter(has_text=re.compile(rf"^traceb r{r}$"))).to_have_count(1)
    slow = labels.filter(has_text="traceb r3 (slow)")
    expect(slow).to_have_count(1)
    expect(slow).to_have_attribute("fill", "#c62828")
    # 5 calls on 4 ranks, each with its two spans inside; a tooltip on every bar
    spans = svg.locator("rect.mnb-span")
    expect(spans).to_have_count(60)
    titles = svg.locator("rect.mnb-span > title").all_text_contents()
    assert sum(bool(re.fullmatch(r"trainers\.step rank 3: [\d.]+ ms \(ok\)", t)) for t in titles) == 5, titles
    assert sum(t.startswith("compute rank ") for t in titles) == 20, titles
    # the bars lie on the timeline: within the drawing, rank 3's calls the widest
    box = svg.bounding_box()
    assert box and box["width"] <= 1000, box
    widths: dict[int, list[float]] = {}
    for i in range(spans.count()):
        s = spans.nth(i)
        b = s.bounding_box()
        assert b and box["x"] - 1 <= b["x"] and b["x"] + b["width"] <= box["x"] + box["width"] + 1, (b, box)
        m = re.fullmatch(r"trainers\.step rank (\d): .*", s.locator("title").text_content() or "")
        if m:
            widths.setdefault(int(m.group(1)), []).append(b["width"])
    assert min(widths[3]) > max(max(widths[r]) for r in (0, 1, 2)), widths
    view.scroll_into_view_if_needed()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    view.screenshot(path=str(ARTIFACTS / "obs-trace-timeline.png"))
