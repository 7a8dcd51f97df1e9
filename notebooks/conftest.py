"""The suite's harness for notebooks run on their own (``pytest notebooks/01_quickstart.ipynb``):
a private runtime directory and no allocator left behind, as ``tests/conftest.py`` gives the
whole suite. Without it the notebooks' kernels would start a persistent allocator in the user's
own runtime directory, and it would outlive the run."""

from __future__ import annotations

import importlib.util
import os

if not os.environ.get("MONARCH_NB_TEST_SESSION_DIR"):
    # not loaded after tests/conftest.py (that one sets the variable first): load it under a name
    # of its own (both files are "conftest") and take its session end; its fixtures are for tests/
    _spec = importlib.util.spec_from_file_location(
        "_monarch_nb_suite_harness",
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "conftest.py"),
    )
    assert _spec is not None and _spec.loader is not None
    _harness = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_harness)
    pytest_sessionfinish = _harness.pytest_sessionfinish
