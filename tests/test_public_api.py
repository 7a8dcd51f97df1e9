import pytest

import monarch_nb.actor as api

MONARCH_0_7_ALL = """Accumulator Actor ActorError current_actor_name as_endpoint current_rank current_size
concurrent_endpoint endpoint Future returns_future Point ProcMesh ProcId Channel send shutdown_context
ValueMesh debug_controller get_or_spawn_controller this_host this_proc default_bootstrap_cmd HostMesh context
Port PortReceiver Endpoint Extent run_worker_loop_forever run_worker_loop_until_shutdown start_worker_loop_forever
attach_to_workers attach enable_transport Context ChannelTransport unhandled_fault_hook MeshFailure config get_meter
span traced Uid""".split()


def test_every_monarch_name_is_exported():
    missing = [n for n in MONARCH_0_7_ALL if not hasattr(api, n)]
    assert missing == []
    assert set(MONARCH_0_7_ALL) | {"SupervisionError"} <= set(api.__all__)
    assert api.__all__ == sorted(api.__all__, key=str)


def test_extent_and_point_print_like_monarch():
    e = api.Extent(["hosts", "gpus"], [2, 4])
    assert repr(e) == "{hosts: 2, gpus: 4}"
    p = api.Point(5, e)
    assert repr(p) == "{'hosts': 1/2, 'gpus': 1/4}"
    assert dict(p) == {"hosts": 1, "gpus": 1} and p.rank == 5 and p.size("gpus") == 4
    assert repr(api.Extent([], [])) == "{}"
    assert e.nelements == 8 and list(e) == ["hosts", "gpus"]


def test_every_error_class_is_exported_and_drawn_in_the_tree():
    import importlib
    import re

    from monarch_nb import errors

    classes = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)}
    assert classes <= set(errors.__all__)
    drawn = set(re.findall(r"^ +[+-] (\w+)", errors.__doc__ or "", re.M))
    assert drawn == classes - {"MonarchNBError"}
    assert all(issubclass(getattr(errors, n), errors.MonarchNBError) for n in classes)
    for mod in ("errors", "config", "introspect", "allocator", "spmd"):
        m = importlib.import_module(f"monarch_nb.{mod}")
        assert m.__all__ == sorted(m.__all__) and all(hasattr(m, n) for n in m.__all__), mod


def test_settings_refuse_what_no_setting_means(monkeypatch: pytest.MonkeyPatch) -> None:
    """A negative duration, size or count (or NaN) from the environment or configure() is a
    ConfigError naming it; a heartbeat timeout of -1 declared every peer lost at once."""
    from monarch_nb.config import configure, get_config
    from monarch_nb.errors import ConfigError

    monkeypatch.setenv("MONARCH_NB_HEARTBEAT_TIMEOUT", "-1")
    with pytest.raises(
        ConfigError, match=r"MONARCH_NB_HEARTBEAT_TIMEOUT=-1.0: heartbeat_timeout is seconds, bytes or a count, 0 or more"
    ):
        get_config()
    monkeypatch.setenv("MONARCH_NB_HEARTBEAT_TIMEOUT", "nan")
    with pytest.raises(ConfigError, match="0 or more"):
        get_config()
    monkeypatch.setenv("MONARCH_NB_HEARTBEAT_TIMEOUT", "0.5")
    assert get_config().heartbeat_timeout == 0.5
    with pytest.raises(ConfigError, match=r"configure\(rdma_streams\)=-1: rdma_streams is"):
        configure(rdma_streams=-1)


def test_a_word_no_setting_means_is_refused_where_it_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """debug_no_input takes continue, raise or wait (docs/debugging.md): any other word was
    accepted by every command and configure(), and raised only at the first breakpoint hit with
    no input, out of the wait of whatever call the program was making."""
    from monarch_nb.config import configure, get_config
    from monarch_nb.errors import ConfigError

    monkeypatch.setenv("MONARCH_NB_DEBUG_NO_INPUT", "skip")
    with pytest.raises(ConfigError, match=r"^MONARCH_NB_DEBUG_NO_INPUT='skip': debug_no_input is 'continue', 'raise' or 'wait'$"):
        get_config()
    monkeypatch.setenv("MONARCH_NB_DEBUG_NO_INPUT", "raise")
    assert get_config().debug_no_input == "raise"
    with pytest.raises(ConfigError, match=r"configure\(debug_no_input\)='Wait': debug_no_input is"):
        configure(debug_no_input="Wait")


def test_configure_refuses_or_converts_a_value_of_the_wrong_type() -> None:
    """README: a value that is not a number, or a word the setting does not take, is a
    ConfigError naming it. configure() stored any value as given: fanout_local="no" (a true
    string) turned relaying on, and heartbeat_timeout="2" failed later, deep in the runtime."""
    from monarch_nb.config import configured
    from monarch_nb.errors import ConfigError

    with configured(fanout_local="no", heartbeat_timeout="2", direct_ipc=0, send_hwm=2.0) as cfg:
        assert (cfg.fanout_local, cfg.heartbeat_timeout, cfg.direct_ipc, cfg.send_hwm) == (False, 2.0, False, 2)
    for kw, words in [
        ({"heartbeat_timeout": "abc"}, "configure(heartbeat_timeout)='abc' is not a valid float"),
        (
            {"heartbeat_timeout": None},
            "configure(heartbeat_timeout)=None: heartbeat_timeout is a number of seconds, not NoneType",
        ),
        ({"send_hwm": 1.5}, "configure(send_hwm)=1.5: send_hwm is a whole number"),
        ({"direct_ipc": 2}, "configure(direct_ipc)=2: direct_ipc is True or False, not int"),
        ({"fanout_local": "maybe"}, "configure(fanout_local)='maybe' is not a valid bool (1/0, true/false, yes/no, on/off)"),
    ]:
        with pytest.raises(ConfigError) as e:
            with configured(**kw):
                pass
        assert str(e.value) == words


def test_configure_is_where_the_docs_call_it() -> None:
    """docs/debugging.md and the debugging notebook say ``monarch_nb.configure(debug_no_input=...)``."""
    import monarch_nb
    from monarch_nb import config

    assert monarch_nb.configure is config.configure


def test_every_public_subpackage_is_an_attribute_of_monarch_nb() -> None:
    """``import monarch_nb; monarch_nb.telemetry.query(...)`` as the docs write it, without an
    import of its own: each public subpackage is loaded on first use (not before: torch stays out
    of a bare ``import monarch_nb``)."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent / "monarch_nb"
    public = sorted(
        p.stem if p.suffix == ".py" else p.name
        for p in root.iterdir()
        if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").exists())
    )
    public = [n for n in public if n not in ("cli", "kernelspec", "magics")]  # entry points, not APIs
    code = (
        "import sys, monarch_nb\n"
        "assert 'torch' not in sys.modules\n"
        f"for n in {public!r}:\n"
        "    assert getattr(monarch_nb, n).__name__ == 'monarch_nb.' + n, n\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_every_setting_is_in_the_readme_and_every_documented_variable_is_read() -> None:
    """The README's table is where a user looks for a MONARCH_NB_* variable: each Config field is
    one (get_config reads MONARCH_NB_<FIELD>), and a variable the docs name that no code reads
    would be a setting that silently does nothing."""
    import dataclasses
    import pathlib
    import re

    from monarch_nb.config import Config

    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    table = set(re.findall(r"^\| `(MONARCH_NB_\w+)` \|", readme, re.M))
    fields = {f"MONARCH_NB_{f.name.upper()}" for f in dataclasses.fields(Config)}
    assert sorted(fields - table) == []
    code = "\n".join(p.read_text() for p in (root / "monarch_nb").rglob("*.py"))
    docs = readme + "".join(p.read_text() for p in (root / "docs").glob("*.md"))
    named = set(re.findall(r"MONARCH_NB_[A-Z_]*[A-Z]", docs))
    read = fields | set(re.findall(r"MONARCH_NB_[A-Z_]*[A-Z]", code))
    # read by the test suite and .ci/setup, not by the package
    assert sorted(named - read - {"MONARCH_NB_SKIP_BROWSER"}) == []


def test_names_and_parameters_code_written_for_monarch_uses() -> None:
    """Session 28's side-by-side audit of the public API: what Monarch 0.7.0 code calls that
    was missing here (docs/monarch-compat.md 24 lists each difference and what was done)."""
    import inspect

    # an override that calls the base's __cleanup__ (0.7.0's does nothing), as a mixin does
    class Base(api.Actor):
        def __cleanup__(self, exc: Exception | None) -> None:
            super().__cleanup__(exc)

    assert Base().__cleanup__(None) is None
    # keyword names of 0.7.0's static constructors
    uid = api.Uid.from_string(uid="w<3>")
    assert (uid.label, str(api.ProcId.from_string(proc_id="w<3>"))) == ("w", "w<3>")
    # ``async with procs:`` and ``procs.rank_tensors()``
    for name in ("__aenter__", "__aexit__", "rank_tensors"):
        assert callable(getattr(api.ProcMesh, name, None)), name
    assert inspect.iscoroutinefunction(api.ProcMesh.__aexit__)
