"""``JobTrait`` and ``JobState``, the cached job state, ``LocalJob``.

Monarch's model (``monarch.job``): a job is a declarative spec plus, once applied, a state.
``apply()`` brings the spec into existence (submit, ssh, start processes); ``state()`` returns
the hosts, arranged into the requested meshes, applying the job first if no running job that can
run this spec is cached. The cache is what lets a new kernel re-attach to the allocation (and,
here, to the proc meshes still alive on it: allocators outlive their controllers).

Different from Monarch on purpose: the cached state is JSON (0600, owner checked), not a pickle,
and lives under the runtime directory by default rather than in ``./.monarch``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from .._runtime import records
from ..actor import HostMesh, this_host
from ..config import runtime_dir
from ..errors import MonarchNBError

logger = logging.getLogger("monarch_nb.job")

FORMAT = "monarch_nb.job/1"


class JobError(MonarchNBError, RuntimeError):
    """A job could not be applied, found, attached to or stopped; the message says why.

    Also a ``RuntimeError``: what Monarch's jobs raise for the same failures (sbatch refused,
    the job ended before it started, it is no longer active), so ``except RuntimeError`` written
    for ``monarch.job`` still catches them.
    """


class JobReplacedWarning(RuntimeWarning):
    """``state()`` stopped a running cached job that cannot run the spec it was given (its
    meshes or options changed) and applied that spec instead: the procs on its hosts are gone."""


def _default_job_path() -> str:
    """Where ``state()`` caches a job unless told otherwise (under the runtime directory, 0600)."""
    return os.path.join(runtime_dir(), "jobs", "job_state.json")


class _Default(str):
    """The ``cached_path`` default: resolved when called, so a changed runtime dir is honoured."""


_DEFAULT = _Default("<runtime dir>/jobs/job_state.json")


class JobState:
    """The hosts of a running job, one ``HostMesh`` per requested mesh, as attributes.

    ``state.trainers`` is the host mesh named "trainers"; a name the job does not have raises
    ``AttributeError`` listing the names it has.
    """

    def __init__(self, hosts: dict[str, HostMesh]) -> None:
        self._hosts = dict(hosts)

    def __getattr__(self, attr: str) -> HostMesh:
        if attr.startswith("__"):
            raise AttributeError(attr)
        try:
            return self.__dict__["_hosts"][attr]
        except KeyError:
            available = ", ".join(sorted(self.__dict__.get("_hosts", {}))) or "none"
            raise AttributeError(f"{attr!r} is not a valid host mesh name. Available names: {available}") from None

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._hosts})

    def __repr__(self) -> str:
        return f"JobState(hosts={self._hosts})"


_JOB_TYPES: dict[str, type[JobTrait]] = {}


class JobTrait(ABC):
    """A declarative job spec plus, once applied, its running state (Monarch's ``JobTrait``).

    Subclasses implement ``_create`` (start the job), ``_state`` (attach to its hosts),
    ``_kill`` (leave nothing behind), ``can_run`` (may a cached running job serve this spec),
    and ``_spec``/``_runtime``/``_load_runtime`` (the JSON the job is cached as).
    """

    #: the name this job type is cached under
    _type_name: ClassVar[str] = ""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if not cls.__name__.startswith("_"):
            cls._type_name = cls.__name__
            _JOB_TYPES[cls.__name__] = cls

    def __init__(self) -> None:
        self._status: str = "not_running"
        self._cached: JobTrait | None = None
        self._apply_id: str | None = None
        self._cached_path: str | None = None
        self._started: float = 0.0
        #: where state() caches this job while apply() runs (for _submitted)
        self._record_at: str | None = None

    # ------------------------------------------------------------ lifecycle
    @property
    def _running(self) -> JobTrait | None:
        if self._cached is not None:
            return self._cached
        return self if self._status == "running" else None

    @property
    def active(self) -> bool:
        return self._running is not None

    @property
    def apply_id(self) -> str | None:
        """Identifies the current allocation of this job (new on each ``apply`` that creates one)."""
        running = self._running
        return running._apply_id if running is not None else None

    def apply(self, client_script: str | None = None) -> None:
        """Bring the job as specified into existence; a no-op if it already runs.

        ``client_script``: run that script as the job's controller (batch mode), where the
        scheduler supports it.
        """
        if self._running is None:
            self._apply_id = uuid.uuid4().hex
            self._started = time.time()
            self._create(client_script)
            self._status = "running"

    def state(self, cached_path: str | None = _DEFAULT) -> JobState:
        """The job's hosts, arranged into its meshes: attach to the running job, re-attach to a
        cached one that can run this spec, or apply the job (and cache it at ``cached_path``).

        ``cached_path=None`` neither reads nor writes a cache.
        """
        if isinstance(cached_path, _Default):
            cached_path = _default_job_path()
        running = self._running
        batch = os.environ.get("MONARCH_NB_BATCH_JOB")
        if running is None and batch:
            # a client script inside its own allocation (apply(client_script=...)): that
            # allocation, whatever cache this process was told to use
            job = job_load(batch)
            job._enter_batch()
            self._cached = running = job
        if running is None:
            running = self._apply_cached(cached_path)
        path = running._cached_path
        before = running._runtime() if path is not None else None
        hosts = running._state()
        if path is not None and running._runtime() != before:
            # re-attached to a job recorded while it was queued: record where its hosts are
            running.dump(path)
        # named now: a killed Slurm job forgets its id
        ident = f"{running._type_name} {getattr(running, 'job_id', None) or (running._apply_id or '')[:8]}"
        for hm in hosts.values() if running._host_addrs() else ():
            # a spawn on these hosts after the job ended says so, not "no allocator at ..."; not
            # on this_host() (a LocalJob's), which no job ends
            hm._gone = functools.partial(self._gone, running, ident)
        return JobState(hosts)

    def _apply_cached(self, cached_path: str | None) -> JobTrait:
        """Re-attach to the job cached at ``cached_path`` if it can run this spec, else apply this
        one (and cache it there): the running job."""
        # one process at a time reads, applies and caches the job: another kernel applying
        # the same job now is waited for, and then re-attached to
        with records.job_lock(cached_path) if cached_path is not None else contextlib.nullcontext():
            cached = self._load_cached(cached_path)
            if cached is not None:
                logger.info("re-attaching to the cached %s job at %s", cached._type_name, cached_path)
                cached._rebind_connection_inputs(self)
                self._cached = cached
                self._cached_path = cached_path
                running = cached
            else:
                self._record_at = cached_path
                try:
                    self.apply()
                except BaseException:
                    if cached_path is not None:
                        # _submitted recorded a job that apply() then cancelled
                        _forget_cache(cached_path, self._apply_id)
                    raise
                finally:
                    self._record_at = None
                    self._warn_replaced()
                running = self
                if cached_path is not None:
                    # cached before attaching: a job whose attach fails is still there to kill
                    self.dump(cached_path)
                    self._cached_path = cached_path
        return running

    def _submitted(self) -> None:
        """The scheduler holds the job now: record it before waiting for it to start, so that a
        kernel killed meanwhile (a restart, the OOM killer) leaves a job the next kernel finds,
        re-attaches to or kills, not one nobody knows that holds nodes once it starts."""
        if self._record_at is not None:
            status, self._status = self._status, "running"
            try:
                self.dump(self._record_at)
            finally:
                self._status = status

    def _gone(self, running: JobTrait, ident: str) -> str | None:
        """Why the allocators of ``running`` (applied through this job) are gone, or None if
        its scheduler says it runs."""
        again = "(job.state(), or the same `%mesh launch`) and spawn on its new hosts"
        if self._running is not running:
            return f"{ident} was killed (kill()), and its allocators with it: apply it again {again}"
        try:
            row = running.describe()
        except Exception:  # the scheduler cannot tell (slurmctld down): the error stands as it is
            return None
        state = str(row.get("state", ""))
        if state in ("running", "RUNNING") and not row.get("lost"):
            return None
        return (
            f"{ident} is {'gone' if state == 'running' else state}: its allocators are gone; kill() it and apply it again {again}"
        )

    def kill(self) -> None:
        """Stop the job: every allocator and proc it started, on every host; forget its cache."""
        running = self._running
        if running is not None:
            from ._common import forget_hosts

            forget_hosts(running._host_addrs())
            running._kill()
            path = self._cached_path or running._cached_path
            if path is not None:
                _forget_cache(path, running._apply_id)
        self._status = "not_running"
        self._cached = None

    #: what state() says once it applied this job in place of a cached one it stopped
    _replaced: str | None = None

    def _replaced_why(self, was: dict[str, Any], cached_path: str) -> str | None:
        """The scheduler's own words for why this cached job was replaced though its spec is the
        same (``was``: its ``describe()`` then; ``{new}`` in them: the id of the job applied in its
        place); None: the general ones."""
        return None

    def _warn_replaced(self) -> None:
        note, self._replaced = self._replaced, None
        if note is None:
            return
        applied = self._running is self
        new = (getattr(self, "job_id", None) or (self._apply_id or "")[:8]) if applied else ""
        warnings.warn(note.replace("{new}", str(new) or "(none: applying it failed)"), JobReplacedWarning, stacklevel=4)

    def _load_cached(self, cached_path: str | None) -> JobTrait | None:
        if cached_path is None:
            return None
        try:
            job = job_load(cached_path)
        except FileNotFoundError:
            return None
        running = job._running
        if running is None:
            return None
        if not running.can_run(self):
            try:
                # this machine's LocalJob has nothing to stop; another job is said to be replaced
                was = None if isinstance(running, LocalJob) else running.describe()
            except Exception:
                was = None
            try:
                # asked before the kill below: what the scheduler did to it, in its own words
                said = None if was is None else running._replaced_why(was, cached_path)
            except Exception:
                said = None
            logger.info("the job cached at %s cannot run this spec (changed, or no longer running): replacing it", cached_path)
            try:
                running._kill()
            except Exception as e:  # a dead job's leftovers must not stop a new apply
                logger.info("stopping the cached job failed: %s", e)
            if was is not None:
                # a relaunch with another size stops the running job and every proc on it: say so
                ident = f" {was['id']}" if was.get("id") else ""
                # the same spec: the job ended (walltime, scancel, a host gone), nothing changed;
                # how this process connects to it (a kubeconfig, a timeout) is not a change of the job
                running._rebind_connection_inputs(self)
                changed = running._spec() != self._spec()
                why = "its meshes or options changed" if changed else "it is no longer running"
                # said once the new job is applied, with its id: the user's hosts and ids changed
                self._replaced = (None if changed else said) or (
                    f"replaced the {running._type_name}{ident} cached at {cached_path} ({was.get('hosts')} host(s), "
                    f"{was.get('state')}): it cannot run this spec ({why}), so it was stopped "
                    "with every proc on its hosts"
                )
            records.remove(os.path.realpath(cached_path))
            return None
        running._cached_path = cached_path
        return job

    def describe(self) -> dict[str, Any]:
        """A one-row summary for job tables (``%mesh jobs``, ``monarch-nb job status``, the sidebar
        and the dashboard): scheduler, id, state (asking the scheduler where there is one), hosts,
        age, walltime left (s), ``lost`` (the hosts the scheduler lost), ``addrs`` (where its
        allocators listen) and ``key_file`` (the cluster key they hold; "" for this machine's)."""
        running = self._running
        if running is None:
            return {
                "scheduler": self._scheduler,
                "id": "",
                "state": "not applied",
                "hosts": 0,
                "age_s": None,
                "walltime_left_s": None,
            }
        row = {
            "scheduler": running._scheduler,
            "id": (running._apply_id or "")[:8],
            "state": "running",
            "hosts": 0,
            "age_s": time.time() - running._started if running._started else None,
            "walltime_left_s": None,
            "lost": [],
            # where its allocators listen: the sidebar asks them for their meshes
            "addrs": list(running._host_addrs()),
            # a job's own cluster key: who asks its allocators (the sidebar) must hold it
            "key_file": running._key_path(),
        }
        row.update(running._describe())
        return row

    #: how job tables name this job's scheduler
    _scheduler: ClassVar[str] = "local"

    def _describe(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------ serialization
    def dump(self, filename: str) -> None:
        """Write this job (spec and running state) to ``filename``: JSON, mode 0600."""
        path = filename
        if os.path.islink(filename):
            # followed (Monarch's contexts link job_state to a file), but only a link of ours: one
            # another user planted in a shared directory would choose which of our files the
            # record replaces (as the kernel's protected_symlinks refuses in sticky directories)
            owner = os.lstat(filename).st_uid
            if owner != os.geteuid():
                raise JobError(
                    f"refusing to write the job record through {filename!r}: it is a symbolic link of uid {owner}, "
                    f"not of this user ({os.geteuid()}); remove it or choose another cached_path"
                )
            path = os.path.realpath(filename)
        records.write_json(path, self._to_json())

    def dumps(self) -> bytes:
        return json.dumps(self._to_json(), sort_keys=True).encode()

    def _to_json(self) -> dict[str, Any]:
        running = self._running
        out: dict[str, Any] = {"format": FORMAT, "type": self._type_name, "spec": self._spec(), "running": False}
        if running is not None:
            out["running"] = True
            out["apply_id"] = running._apply_id
            out["started"] = running._started
            out["runtime"] = running._runtime()
            if running is not self:
                out["type"] = running._type_name
                out["spec"] = running._spec()
        return out

    # ------------------------------------------------------------ for subclasses
    @abstractmethod
    def _spec(self) -> dict[str, Any]:
        """The constructor's keyword arguments (JSON), with meshes added by ``add_mesh``."""

    def _runtime(self) -> dict[str, Any]:
        """What a running job must remember to be found again (JSON)."""
        return {}

    def _rebind_connection_inputs(self, spec: JobTrait) -> None:  # noqa: B027 - most jobs connect as cached
        """Take how ``spec`` connects (credentials, a gateway) when re-attaching to a cached job
        that can run it (Monarch's hook of the same name)."""

    def _load_runtime(self, data: dict[str, Any]) -> None:  # noqa: B027 - a job with no runtime state has nothing to load
        """Restore what ``_runtime`` returned."""

    def _enter_batch(self) -> None:
        """Called in a batch job's client before attaching (schedulers with a batch mode)."""
        raise JobError(f"{type(self).__name__} has no batch mode")

    def _host_addrs(self) -> list[str]:
        """The addresses of the allocators this job started (empty when it started none)."""
        return []

    def _key_path(self) -> str:
        """The cluster key file its allocators hold ("": this machine's runtime directory's)."""
        return ""

    @abstractmethod
    def _create(self, client_script: str | None) -> None: ...

    @abstractmethod
    def _state(self) -> dict[str, HostMesh]: ...

    @abstractmethod
    def can_run(self, spec: JobTrait) -> bool:
        """Can this (running) job serve ``spec`` instead of a new allocation?"""

    @abstractmethod
    def _kill(self) -> None: ...


def _forget_cache(path: str, apply_id: str | None) -> None:
    real = os.path.realpath(path)
    try:
        data = records.read_json(real)
    except (OSError, MonarchNBError):
        return
    if isinstance(data, dict) and data.get("apply_id") == apply_id:
        records.remove(real)


def job_loads(data: bytes | str) -> JobTrait:
    """A job from ``dumps()`` output (JSON; only monarch_nb's job types are built)."""
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise JobError(f"not a monarch_nb job record: {e}") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise JobError(f"not a monarch_nb job record (format {obj.get('format') if isinstance(obj, dict) else None!r})")
    kind = obj.get("type", "")
    cls = _JOB_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise JobError(f"unknown job type {kind!r} in job record; known: {sorted(_JOB_TYPES)}")
    # a record edited by hand or cut short: a JobError that says so, not whatever the
    # constructor or _load_runtime trips on (tests/test_fuzz.py)
    try:
        job = cls(**obj["spec"])
        if obj.get("running"):
            job._apply_id = obj.get("apply_id")
            job._started = float(obj.get("started") or 0.0)
            job._load_runtime(obj.get("runtime") or {})
            job._status = "running"
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise JobError(f"malformed {kind} job record ({type(e).__name__}: {e}); delete it and apply the job again") from e
    return job


def job_load(filename: str = _DEFAULT) -> JobTrait:
    """A job from a file written by ``dump()`` (by default the one ``state()`` caches, under the
    runtime directory as it is now); a file that is not ours is refused unread."""
    if isinstance(filename, _Default):
        filename = _default_job_path()
    try:
        raw = records.read_private(filename)
    except PermissionError as e:
        raise JobError(str(e)) from e
    job = job_loads(raw)
    return job


# ------------------------------------------------------------ the current job (``monarch-nb job``)


def _current_spec_file() -> str:
    return os.path.join(runtime_dir(), "jobs", "current-spec")


def set_current_job(module_path: str) -> None:
    """Remember ``module.attr`` (a ``JobTrait`` object in an importable module) as the current job."""
    _split_spec(module_path)
    records.write_json(_current_spec_file(), {"spec": module_path})


def load_current_job() -> JobTrait:
    """A fresh job object for the current job's spec (not attached yet: call ``.state()``)."""
    try:
        spec = records.read_json(_current_spec_file())["spec"]
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no current job: {_current_spec_file()} does not exist; run `monarch-nb job apply module.attr` first"
        ) from None
    return import_job(spec)


def _split_spec(module_path: str) -> tuple[str, str]:
    sep = ":" if ":" in module_path else "."
    if sep not in module_path:
        raise ValueError(f"a job spec is 'module.attr' or 'module:attr', got {module_path!r}")
    mod, attr = module_path.rsplit(sep, 1)
    return mod, attr


def import_job(module_path: str) -> JobTrait:
    """The ``JobTrait`` at ``module.attr`` (or ``module:attr``)."""
    if module_path.endswith(".py") or os.sep in module_path:
        raise ValueError(f"a job spec is 'module.attr' (a JobTrait object in an importable module), not a file: {module_path!r}")
    mod_name, attr = _split_spec(module_path)
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise  # the module was found; something it imports was not
        raise JobError(
            f"cannot import {mod_name!r} for the job spec {module_path!r}: run from the folder that holds it "
            "or put it on PYTHONPATH"
        ) from None
    job = getattr(mod, attr, None)
    if job is None:
        raise AttributeError(f"module {mod_name!r} has no attribute {attr!r}")
    if not isinstance(job, JobTrait):
        raise TypeError(f"{module_path!r} must be a JobTrait, got {type(job).__name__}")
    return job


# ------------------------------------------------------------ LocalJob


class LocalJob(JobTrait):
    """Every mesh is this host (``this_host()``): a stand-in to switch a job between a cluster
    and a laptop by changing only the job."""

    def __init__(self, hosts: Sequence[str] = ("hosts",)) -> None:
        self._host_names = list(hosts)
        self._client_pid = 0
        self._log_dir = ""
        #: the client script apply(client_script=...) started from this object (not cached)
        self._proc: subprocess.Popen[bytes] | None = None
        super().__init__()

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """Monarch's: the client script ``apply(client_script=...)`` started (its logs are in
        the job's folder), to ``wait()`` for or ``poll()``."""
        if self._proc is None:
            raise ValueError("no local batch job")
        return self._proc

    def _spec(self) -> dict[str, Any]:
        return {"hosts": list(self._host_names)}

    def _runtime(self) -> dict[str, Any]:
        return {"client_pid": self._client_pid, "log_dir": self._log_dir}

    def _load_runtime(self, data: dict[str, Any]) -> None:
        self._client_pid = int(data.get("client_pid") or 0)
        self._log_dir = data.get("log_dir") or ""

    def can_run(self, spec: JobTrait) -> bool:
        # always the same host: use the spec itself, with its mesh names
        return False

    def _state(self) -> dict[str, HostMesh]:
        return {k: this_host() for k in self._host_names}

    def _create(self, client_script: str | None) -> None:
        if client_script is None:
            return
        self._log_dir = records.make_private_dir(os.path.join(runtime_dir(), "jobs", f"local-{self._apply_id}"[:24]))
        with (
            open(os.path.join(self._log_dir, "stdout.log"), "wb") as out,
            open(os.path.join(self._log_dir, "stderr.log"), "wb") as err,
        ):
            p = subprocess.Popen(
                [sys.executable, client_script],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                env=dict(os.environ, MONARCH_BATCH_JOB="1"),
            )
        self._client_pid = p.pid
        self._proc = p
        _children.append(p)
        logger.info("started client script %s as pid %d; logs in %s", client_script, p.pid, self._log_dir)

    def _kill(self) -> None:
        if self._client_pid:
            try:
                os.kill(self._client_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self._client_pid = 0


#: processes this interpreter started and must reap (a daemon left running is not a leak)
_children: list[subprocess.Popen[bytes]] = []
