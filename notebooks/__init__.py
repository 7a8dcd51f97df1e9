"""Makes this folder a package, so that pytest imports its conftest.py as ``notebooks.conftest``
and not as a second top-level ``conftest`` (the tests import helpers from tests/conftest.py by
that name)."""
