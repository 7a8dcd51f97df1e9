"""Telemetry that records: spans and metrics on every rank, gathered from the allocators.

Every endpoint call is a span (actor, method, rank, start, duration, outcome), timed in the
proc that ran it; ``span()`` and ``@traced`` add spans of your own (inside an endpoint they
nest in its call), and ``get_meter()`` gives counters and histograms with the OpenTelemetry
API's names. Each proc keeps its records in a fixed-size ring which its allocator drains
about once a second (and when its mesh stops) into a bounded store: per allocator, the last
4096 spans of each of the 256 procs polled most recently and 262144 in all (about 64 MiB), so
spans outlive the procs and the kernel that made them; a kernel restarted within that bound
reads them back. Spans a proc recorded in its last second before it crashed are lost with it.

``query()`` gathers them from every attached allocator as a pandas DataFrame (pandas is the
``telemetry`` extra: ``pip install 'monarch-nb[telemetry]'``), with each host's clock offset
applied; ``chrome_trace()`` writes them as a Chrome/Perfetto trace and ``stragglers()`` names
the ranks slower than the others; ``latency_summary()`` is what a dashboard shows (per-rank
latency, stragglers, failed spans), reduced by each allocator so its size does not grow with the call rate.
"""

from __future__ import annotations

from ..actor._spans import Counter, Gauge, Histogram, Meter, Span, UpDownCounter, get_meter, span, traced
from ._query import chrome_trace, latency_summary, metrics, query, query_records, stragglers

__all__ = [
    "Counter",
    "Gauge",
    "Histogram",
    "Meter",
    "Span",
    "UpDownCounter",
    "chrome_trace",
    "get_meter",
    "latency_summary",
    "metrics",
    "query",
    "query_records",
    "span",
    "stragglers",
    "traced",
]
