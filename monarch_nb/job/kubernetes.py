"""``KubernetesJob``: Monarch's ``monarch.job.kubernetes.KubernetesJob``, same constructor and
``add_mesh`` arguments, through the official ``kubernetes`` client (``pip install monarch-nb[k8s]``).

Two modes per mesh, as Monarch's:

- attach-only (no ``image_spec``): pods already running an allocator are found by label selector;
  ranks come from ``pod_rank_label``.
- provisioning (``image_spec``): instead of Monarch's MonarchMesh operator, this creates the
  objects itself (``_k8s_manifests``): a Secret with a new cluster key, mounted as a file; per
  mesh a headless Service and a StatefulSet with ``podManagementPolicy: Parallel`` whose pods run
  ``python -m monarch_nb allocator`` on their own pod IP. The allocator announces itself in a
  file of its container and the readiness probe waits for that file, so a Ready pod is a serving allocator: the
  controller takes ``status.podIP`` and the port of Ready pods (pod status is read for the job's
  state; addresses are the pods' own, not guessed from host names).

Waits watch the pods (list, then watch from its ``resourceVersion``) and fail with why: a Pending
pod with the scheduler's reason (after ``timeout``; without one it waits and shows the reason),
a container in CrashLoopBackOff or an image that cannot be pulled at once (with its last log
lines), a 403 naming the permission the controller lacks (``KubernetesJob.rbac_manifests``).

A notebook in the cluster (or on a node) reaches the pod IPs itself. One outside it (a laptop with
a kubeconfig) reaches them through one gateway: a websocket port-forward
(``kubernetes.stream.portforward``, subprotocol ``v4.channel.k8s.io``) to the gateway port of
rank 0's pod, over which every connection to the job's allocators and procs, and every answer
back, rides (``_runtime/gateway.py``: SOCKS5 for zmq, CurveZMQ end to end, both ends proven to
hold the cluster key). It is used when the pods do not answer directly (``gateway=None``), always
(``gateway=True``), or over a port you forwarded yourself (``attach_to="tcp://127.0.0.1:P"`` for
``kubectl port-forward pod/<mesh>-0 P:<port+1>``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .._runtime import records
from .._wire.keys import write_key_file
from ..actor import HostMesh
from ..config import runtime_dir
from . import _k8s_manifests as m
from ._common import forwarded_config, held_key, host_meshes
from ._job import JobError, JobTrait

logger = logging.getLogger("monarch_nb.job")

_DEFAULT_MONARCH_PORT = 26600
_RFC_1123_MAX_LEN = 63
#: log lines shown for a crashing container
LOG_LINES = 20
#: how long the first pod may take to accept a connection before the gateway is used instead
GATEWAY_PROBE_S = 2.0
#: (connect, read) seconds for one API request: the client's default is none, so an API server
#: that stopped answering (a dead control plane, a VPN that dropped) held job.state() for ever
REQUEST_TIMEOUT = (10.0, 30.0)
#: how often a request the API server throttled (429, or a 5xx with Retry-After, as client-go
#: retries them) is tried again, and the longest wait between tries
RETRIES = 6
RETRY_MAX_WAIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """Container image (with monarch_nb installed) and optional resources (requests = limits)."""

    image: str
    resources: dict[str, str | int] | None = None


@dataclasses.dataclass(frozen=True)
class KubeConfig:
    """Where the API server is: a kubeconfig file (``from_path``), a client ``Configuration``
    (``from_config``), or, with neither, the in-cluster service account."""

    local: Path | None = None
    remote: Any = None

    @classmethod
    def from_path(cls, path: str) -> KubeConfig:
        return cls(local=Path(path).expanduser())

    @classmethod
    def from_config(cls, config: Any) -> KubeConfig:
        return cls(remote=config)

    @property
    def out_of_cluster(self) -> bool:
        return self.remote is not None or self.local is not None

    def api_client(self) -> Any:
        client, config = _k8s()[:2]
        if self.remote is not None:
            return client.ApiClient(self.remote)
        cfg = client.Configuration()
        if self.local is not None:
            try:
                config.load_kube_config(config_file=str(self.local), client_configuration=cfg)
            except config.ConfigException as e:
                raise JobError(f"cannot load kubeconfig {str(self.local)!r}: {e}") from e
            except OSError as e:  # a directory, a file not readable
                raise JobError(f"cannot load kubeconfig {str(self.local)!r}: {e.strerror}") from e
            except (TypeError, AttributeError, ValueError) as e:
                # YAML that is no kubeconfig (a word, a list): the client's TypeError named nothing
                raise JobError(
                    f"cannot load kubeconfig {str(self.local)!r}: not a kubeconfig (YAML with clusters, contexts and users)"
                ) from e
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException as e:
                raise JobError(
                    f"no kubeconfig given and not inside a pod ({e}): pass kubeconfig=KubeConfig.from_path('~/.kube/config')"
                ) from e
        # one more try after a refused or cut connection (a pooled connection the server closed),
        # not urllib3's three: against an API server that does not answer, each would wait REQUEST_TIMEOUT
        cfg.retries = 1
        return client.ApiClient(cfg)


def _k8s() -> tuple[Any, Any, Any, Any]:
    try:
        from kubernetes import client, config, watch
        from kubernetes.client.rest import ApiException
    except ImportError:
        raise ImportError("KubernetesJob needs the kubernetes client: pip install 'monarch-nb[k8s]'") from None
    return client, config, watch, ApiException


class KubernetesJob(JobTrait):
    """Meshes of pods, each running an allocator (Monarch's ``KubernetesJob``).

    job = KubernetesJob("default", kubeconfig=KubeConfig.from_path("~/.kube/config"))
    job.add_mesh("trainers", 4, image_spec=ImageSpec("me/monarch-nb:latest", {"nvidia.com/gpu": 8}))
    state = job.state()
    """

    _scheduler = "k8s"

    def __init__(
        self,
        namespace: str,
        timeout: int | None = None,
        kubeconfig: KubeConfig | None = None,
        attach_to: str | None = None,
        *,
        gateway: bool | None = None,
        meshes: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        if attach_to is not None and not attach_to.startswith("tcp://"):
            raise ValueError(
                f"attach_to={attach_to!r}: give tcp://127.0.0.1:PORT, a local port forwarded to the gateway port "
                "(monarch port + 1) of a pod of the job: kubectl port-forward pod/<mesh>-0 PORT:26601"
            )
        super().__init__()
        self._attach_to = attach_to
        self._gateway_mode = gateway
        self._gw: Any = None  # (GatewayClient, port-forward or None, Route) while open
        self._namespace = namespace
        self._timeout = timeout
        if isinstance(kubeconfig, str):  # from a cached record
            kubeconfig = KubeConfig.from_path(kubeconfig)
        self._kubeconfig = kubeconfig or KubeConfig()
        self._meshes: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (meshes or {}).items()}
        self._dir = ""
        self._created: list[list[str]] = []
        self._hosts: dict[str, list[str]] = {}
        self._pods: dict[str, list[str]] = {}
        self._api: Any = None

    # ------------------------------------------------------------ spec
    def add_mesh(
        self,
        name: str,
        num_replicas: int,
        label_selector: str | None = None,
        pod_rank_label: str = m.RANK_LABEL,
        image_spec: ImageSpec | None = None,
        port: int = _DEFAULT_MONARCH_PORT,
        pod_template: Any = None,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """A mesh of ``num_replicas`` pods: found by ``label_selector`` (attach-only) or created
        from ``image_spec`` or ``pod_template`` (provisioning; a ``V1PodTemplateSpec`` or its dict,
        merged with the allocator's container: see ``_k8s_manifests.merge_pod_template``). Names
        follow RFC 1123 (lowercase alphanumerics)."""
        if not name or len(name) > _RFC_1123_MAX_LEN or not (name.isalnum() and name.islower() and name[0].isalpha()):
            raise ValueError(
                f"mesh name {name!r} is invalid: at most 63 lowercase alphanumeric characters, starting with a letter"
            )
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive number of pods, got {num_replicas!r}")
        if image_spec is not None and pod_template is not None:
            raise ValueError("'image_spec' and 'pod_template' are mutually exclusive")
        template = _template_dict(pod_template) if pod_template is not None else None
        provisioned = image_spec is not None or template is not None
        if provisioned and label_selector is not None:
            raise ValueError("'label_selector' cannot be customized when provisioning")
        if provisioned and pod_rank_label != m.RANK_LABEL:
            raise ValueError("'pod_rank_label' cannot be customized when provisioning")
        if not provisioned and (labels is not None or annotations is not None):
            raise ValueError("'labels' and 'annotations' can only be set when provisioning (image_spec)")
        if template is not None:
            # a template that cannot be honoured is refused here, not at apply()
            m.statefulset(self._namespace, name, "00000000", num_replicas, "x", int(port), pod_template=template)
        self._meshes[name] = {
            "num_replicas": num_replicas,
            "label_selector": label_selector or f"{m.NAME_LABEL}=monarch-worker,{m.MESH_LABEL}={name}",
            "pod_rank_label": pod_rank_label,
            "image": image_spec.image if image_spec else (_template_image(template) if template else None),
            "resources": dict(image_spec.resources) if image_spec and image_spec.resources else None,
            "port": int(port),
            "labels": labels,
            "annotations": annotations,
            "pod_template": template,
        }

    def _spec(self) -> dict[str, Any]:
        if self._kubeconfig.remote is not None:
            kc = None  # a Configuration object is not cached; a re-attach uses the in-cluster account
        else:
            kc = str(self._kubeconfig.local) if self._kubeconfig.local else None
        return {
            "namespace": self._namespace,
            "timeout": self._timeout,
            "kubeconfig": kc,
            "attach_to": self._attach_to,
            "gateway": self._gateway_mode,
            "meshes": self._meshes,
        }

    def _runtime(self) -> dict[str, Any]:
        return {"dir": self._dir, "created": self._created, "hosts": self._hosts, "pods": self._pods}

    def _load_runtime(self, data: dict[str, Any]) -> None:
        self._dir = data.get("dir", "")
        self._created = [list(x) for x in data.get("created") or []]
        self._hosts = dict(data.get("hosts") or {})
        self._pods = dict(data.get("pods") or {})

    def _rebind_connection_inputs(self, spec: JobTrait) -> None:
        # this process's kubeconfig and gateway, not the ones of the process that applied the job
        if isinstance(spec, KubernetesJob):
            self._kubeconfig, self._attach_to = spec._kubeconfig, spec._attach_to
            self._gateway_mode, self._timeout = spec._gateway_mode, spec._timeout
            self._api = None

    def _host_addrs(self) -> list[str]:
        return [a for addrs in self._hosts.values() for a in addrs]

    def _key_path(self) -> str:
        # attach-only jobs (no directory of ours) use MONARCH_NB_KEY_FILE, as the process does
        return os.path.join(self._dir, "key") if self._dir else ""

    @property
    def _job_id(self) -> str:
        return (self._apply_id or "")[:8]

    def manifests(self, apply_id: str | None = None, key: bytes = b"0" * 64) -> list[dict[str, Any]]:
        """The objects ``apply()`` creates (a dry run: no API server needed; the key is a placeholder)."""
        job_id = (apply_id or self._apply_id or "00000000")[:8]
        out = []
        if any(c["image"] for c in self._meshes.values()):
            out.append(m.secret(self._namespace, job_id, key))
        env = forwarded_config()
        for name, c in self._meshes.items():
            if not c["image"]:
                continue
            out.append(m.service(self._namespace, name, job_id, c["port"]))
            out.append(
                m.statefulset(
                    self._namespace,
                    name,
                    job_id,
                    c["num_replicas"],
                    c["image"],
                    c["port"],
                    resources=c["resources"],
                    labels=c["labels"],
                    annotations=c["annotations"],
                    env=env,
                    pod_template=c.get("pod_template"),
                )
            )
        return out

    @staticmethod
    def rbac_manifests(namespace: str, service_account: str = "monarch-nb") -> list[dict[str, Any]]:
        """ServiceAccount, Role and RoleBinding the controller needs (namespaced, no wildcards)."""
        return m.rbac(namespace, service_account)

    # ------------------------------------------------------------ API calls
    def _client(self) -> Any:
        if self._api is None:
            self._api = self._kubeconfig.api_client()
        return self._api

    def _call(self, verb: str, resource: str, fn: Any, *args: Any, absent_ok: bool = False, **kw: Any) -> Any:
        """``fn(*args, **kw)``, bounded in time, a throttled request tried again; a JobError that
        says what to do otherwise (None for a 404 with ``absent_ok``)."""
        ApiException = _k8s()[3]
        kw.setdefault("_request_timeout", REQUEST_TIMEOUT)
        for attempt in range(RETRIES + 1):
            try:
                return fn(*args, **kw)
            except ApiException as e:
                if absent_ok and e.status == 404:
                    return None
                wait = _retry_after(e)
                if wait is None or attempt == RETRIES:
                    raise self._error(verb, resource, e) from None
                logger.info("the API server throttled %s %s (%s): again in %.1f s", verb, resource, e.status, wait)
                time.sleep(wait)
            except Exception as e:
                if _unreachable(e):
                    raise self._unreachable(verb, resource, e) from None
                raise
        raise AssertionError("unreachable")

    def _error(self, verb: str, resource: str, e: Any) -> JobError:
        ns = self._namespace
        if e.status == 401:
            return JobError(
                f"the Kubernetes API server at {self._server()} did not accept this controller's credentials "
                f"(401: {_reason(e)}) when asked to {verb} {resource}: the token of {self._credentials()} has expired "
                "or is wrong; renew it (run any kubectl command with that kubeconfig, or get a new token) and try again"
            )
        if e.status == 403:
            return JobError(
                f"the Kubernetes API refused to {verb} {resource} in namespace {ns!r} (403: "
                f"{_reason(e)}); the controller's account needs '{verb}' on '{resource}': apply "
                f"KubernetesJob.rbac_manifests({ns!r}) and use that service account"
            )
        if e.status == 409:
            return JobError(
                f"{resource} already exists in namespace {ns!r} ({_reason(e)}): another job uses "
                "this mesh name; kill() it or delete the object"
            )
        if e.status == 404 and verb == "create":
            return JobError(
                f"cannot {verb} {resource} in namespace {ns!r} (404: {_reason(e)}): does the namespace exist? "
                f"(kubectl create namespace {ns})"
            )
        if e.status == 429 or e.status >= 500:
            return JobError(
                f"the Kubernetes API server failed to {verb} {resource} ({e.status} {_reason(e)}), "
                f"{RETRIES + 1} tries: it is overloaded or unwell; try again later"
                if _retry_after(e) is not None
                else f"the Kubernetes API server failed to {verb} {resource} ({e.status} {_reason(e)}); try again later"
            )
        return JobError(f"Kubernetes API error on {verb} {resource}: {e.status} {_reason(e)}")

    def _unreachable(self, verb: str, resource: str, e: BaseException) -> JobError:
        why = getattr(e, "reason", None) or e
        return JobError(
            f"cannot reach the Kubernetes API server at {self._server()} to {verb} {resource} "
            f"({type(why).__name__}: {why}); is the cluster up and this the right server? (kubectl cluster-info "
            f"with {self._credentials()})"
        )

    def _server(self) -> str:
        try:
            return str(self._client().configuration.host)
        except Exception:
            return "(unknown)"

    def _credentials(self) -> str:
        if self._kubeconfig.local is not None:
            return f"kubeconfig {str(self._kubeconfig.local)!r}"
        if self._kubeconfig.remote is not None:
            return "the given client Configuration"
        return "the pod's service account"

    # ------------------------------------------------------------ the job
    def _create(self, client_script: str | None) -> None:
        if client_script is not None:
            raise NotImplementedError("KubernetesJob.apply(client_script=...): KubernetesJob has no batch mode")
        if not self._meshes:
            raise ValueError("at least one mesh must be added with add_mesh()")
        client = _k8s()[0]
        api = self._client()
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        key = b""
        if any(c["image"] for c in self._meshes.values()):
            # a cluster key for the pods we create (the one this process holds already, if an
            # earlier job gave it one: a process joins one cluster); attach-only pods use the controller's own
            self._dir = records.make_private_dir(os.path.join(runtime_dir(), "jobs", f"k8s-{self._job_id}"))
            write_key_file(os.path.join(self._dir, "key"), held_key())
            with open(os.path.join(self._dir, "key"), "rb") as f:
                key = f.read()  # the file as the allocator reads it
        ns = self._namespace
        try:
            for obj in self.manifests(self._apply_id, key):
                kind, name = obj["kind"], obj["metadata"]["name"]
                if kind == "Secret":
                    self._call("create", "secrets", core.create_namespaced_secret, ns, obj)
                elif kind == "Service":
                    self._call("create", "services", core.create_namespaced_service, ns, obj)
                else:
                    self._call("create", "statefulsets.apps", apps.create_namespaced_stateful_set, ns, obj)
                self._created.append([kind, name])
                logger.info("created %s %s/%s", kind, ns, name)
            self._hosts = self._wait_ready()
        except BaseException as e:
            try:
                self._kill()
            except Exception as k:  # the first error is the one to see; what is left over, next to it
                e.add_note(f"and cleaning up after it failed: {k}")
            raise

    def _selector(self, name: str) -> str:
        c = self._meshes[name]
        return m.selector(name, self._job_id) if c["image"] else c["label_selector"]

    def _wait_ready(self) -> dict[str, list[str]]:
        """Watch each mesh's pods until every rank is Ready; its addresses by rank."""
        # ``timeout`` is per mesh, as Monarch's
        return {name: self._wait_mesh(name, time.monotonic()) for name in self._meshes}

    def _wait_mesh(self, name: str, start: float) -> list[str]:
        client, _, watch, ApiException = _k8s()
        core = client.CoreV1Api(self._client())
        c = self._meshes[name]
        sel = self._selector(name)
        ns = self._namespace
        lst = self._call("list", "pods", core.list_namespaced_pod, ns, label_selector=sel)
        pods = {p.metadata.name: p for p in lst.items}
        rv = lst.metadata.resource_version
        shown: dict[str, str] = {}
        while True:
            addrs, pending = self._evaluate(name, c, pods, shown)
            if addrs is not None:
                return addrs
            left = None if self._timeout is None else self._timeout - (time.monotonic() - start)
            if left is not None and left <= 0:
                raise JobError(f"mesh {name!r}: {pending} within timeout={self._timeout} s (namespace {ns!r}, selector {sel!r})")
            w = watch.Watch()
            span = max(1, int(min(left or 5, 5)))
            try:
                for ev in w.stream(
                    core.list_namespaced_pod,
                    ns,
                    label_selector=sel,
                    resource_version=rv,
                    timeout_seconds=span,
                    # the server ends the watch after span s; a silent one is dropped a little later
                    _request_timeout=(REQUEST_TIMEOUT[0], span + REQUEST_TIMEOUT[0]),
                ):
                    pod = ev["object"]
                    rv = pod.metadata.resource_version
                    if ev["type"] == "DELETED":
                        pods.pop(pod.metadata.name, None)
                    else:
                        pods[pod.metadata.name] = pod
                    break  # evaluate after each change
            except ApiException as e:
                if e.status == 410:  # our resourceVersion is too old: list again
                    lst = self._call("list", "pods", core.list_namespaced_pod, ns, label_selector=sel)
                    pods = {p.metadata.name: p for p in lst.items}
                    rv = lst.metadata.resource_version
                    continue
                wait = _retry_after(e)
                if wait is None:
                    raise self._error("watch", "pods", e) from None
                logger.info("the API server throttled a watch of pods (%s): again in %.1f s", e.status, wait)
                time.sleep(wait)
            except Exception as e:
                if _unreachable(e):
                    raise self._unreachable("watch", "pods", e) from None
                raise
            finally:
                w.stop()

    def _evaluate(
        self, name: str, c: dict[str, Any], pods: dict[str, Any], shown: dict[str, str]
    ) -> tuple[list[str] | None, str]:
        """Addresses by rank when all are Ready; else (None, what is missing). A crashing pod raises."""
        n = c["num_replicas"]
        ready: dict[int, str] = {}
        names: dict[int, str] = {}
        waiting = []
        #: rank -> why its pod will never be Ready (an attach-only pod that failed, with no owner)
        dead: dict[int, str] = {}
        for pname, pod in sorted(pods.items()):
            for cs in (pod.status.container_statuses or []) if pod.status else []:
                w = cs.state.waiting if cs.state else None
                if w is not None and w.reason in (
                    "CrashLoopBackOff",
                    "ErrImagePull",
                    "ImagePullBackOff",
                    "CreateContainerConfigError",
                    "InvalidImageName",
                ):
                    raise JobError(
                        f"pod {pname} of mesh {name!r} is in {w.reason} ({w.message or 'no message'}, "
                        f"restarts: {cs.restart_count}); its last log lines:\n{self._logs(pname)}"
                    )
            label = (pod.metadata.labels or {}).get(c["pod_rank_label"])
            try:
                rank = int(label) if label is not None else -1
            except ValueError:
                rank = -1
            conds = {x.type: x for x in (pod.status.conditions or [])} if pod.status else {}
            if rank < 0 or rank >= n:
                continue
            if "Ready" in conds and conds["Ready"].status == "True" and pod.status.pod_ip:
                ready[rank] = f"tcp://{pod.status.pod_ip}:{c['port']}"
                names[rank] = pname
                continue
            sched = conds.get("PodScheduled")
            if sched is not None and sched.status == "False":
                why = f"Pending: {sched.reason}: {sched.message}"
            elif pod.status and (pod.status.reason or pod.status.message):
                # the pod's own words for why it stopped: an eviction ("Evicted", "The node was
                # low on resource: memory"), a node shutdown, a deadline; "Failed" alone says none
                why = f"{pod.status.phase}: {pod.status.reason or 'no reason'}: {pod.status.message or 'no message'}"
            else:
                why = f"{pod.status.phase if pod.status else 'unknown'}, not Ready"
            if not c["image"] and pod.status and pod.status.phase in ("Failed", "Succeeded") and not _controller(pod):
                # a pod that ended never runs again, and with no controller nothing replaces it
                # (a StatefulSet's evicted pod is deleted and made again: that one is waited for)
                dead.setdefault(rank, f"pod {pname} {why}")
            waiting.append(f"pod {pname} {why}")
            if shown.get(pname) != why:
                shown[pname] = why
                # shown live in the cell: why the mesh is not there yet
                print(f"mesh {name!r}: pod {pname} {why}", file=sys.stderr, flush=True)
        if len(ready) == n:
            self._pods[name] = [names[i] for i in range(n)]
            return [ready[i] for i in range(n)], ""
        if not pods and shown.get("") is None:
            shown[""] = "none"
            print(
                f"mesh {name!r}: no pod matches {self._selector(name)!r} in namespace {self._namespace!r} yet",
                file=sys.stderr,
                flush=True,
            )
        gone = [why for r, why in sorted(dead.items()) if r not in ready]
        if gone:
            raise JobError(
                f"mesh {name!r}: {'; '.join(gone)}: a pod that ended never runs again and no controller owns it "
                "to replace it; start a new pod running the allocator (with the mesh's labels: "
                f"{self._selector(name)!r}, and its rank in {c['pod_rank_label']!r}), delete the old one "
                f"(kubectl delete pod -n {self._namespace} NAME), then call state() again"
            )
        missing = [i for i in range(n) if i not in ready]
        what = "; ".join(waiting) or f"no pod with rank(s) {missing}"
        return None, f"{n - len(ready)} of {n} pods not Ready ({what})"

    def _logs(self, pod: str) -> str:
        client, _, _, ApiException = _k8s()
        core = client.CoreV1Api(self._client())
        for previous in (True, False):
            try:
                text = core.read_namespaced_pod_log(
                    pod, self._namespace, tail_lines=LOG_LINES, previous=previous, _request_timeout=REQUEST_TIMEOUT
                )
            except ApiException as e:
                if e.status == 403:
                    return "(cannot read its log: the controller's Role lacks 'get' on 'pods/log')"
                continue
            except Exception as e:
                if _unreachable(e):
                    return f"(cannot read its log: {type(e).__name__})"
                raise
            if text:
                return text.rstrip()
        return "(no log)"

    def _state(self) -> dict[str, HostMesh]:
        if self._created or not self._hosts:
            # pods may have moved since apply (rescheduled): read their addresses again
            self._hosts = self._wait_ready()
        key = os.path.join(self._dir, "key") if self._dir else None
        self._ensure_gateway(key or os.environ.get("MONARCH_NB_KEY_FILE"))
        return host_meshes(self._hosts, key_file=key)

    # ------------------------------------------------------------ the gateway
    def _needs_gateway(self, key_file: str | None) -> bool:
        if self._attach_to is not None or self._gateway_mode:
            return True
        if self._gateway_mode is False or not self._kubeconfig.out_of_cluster:
            return False
        from .._runtime.transport import Security
        from .._wire.keys import read_key_file
        from ..actor import _context
        from ..errors import ConnectError

        client = _context.client()
        if key_file:
            client.rt.sockets.set_security(Security(read_key_file(key_file)))
        first = next(a for addrs in self._hosts.values() for a in addrs)
        try:
            # the hello both ways (a raw TCP probe would be logged by the allocator as a failed handshake)
            client.connect(first, timeout=GATEWAY_PROBE_S)
            return False
        except ConnectError as e:
            logger.info("pod %s does not answer from here (%s): reaching the pods through a gateway", first, e)
            return True

    def _ensure_gateway(self, key_file: str | None) -> None:
        """Open the tunnel (once per process) and route the pods' addresses through it."""
        from .._runtime.gateway import GatewayClient, GatewayError
        from .._runtime.transport import split_tcp
        from .._wire.keys import read_key_file
        from ..actor import _context

        if self._gw is not None and self._gw[0].alive:
            return
        self._close_gateway()
        if not self._hosts or not self._needs_gateway(key_file):
            return
        if not key_file:
            raise JobError("the gateway needs the cluster key: this job has none and MONARCH_NB_KEY_FILE is not set")
        mesh = next(iter(self._hosts))
        port = m.gateway_port(self._meshes[mesh]["port"])
        forwards: list[Any] = []
        attach_to = self._attach_to
        if attach_to is not None:
            import socket

            where = f"{attach_to} (attach_to)"

            def connect() -> Any:
                try:
                    return socket.create_connection(split_tcp(attach_to), timeout=10)
                except OSError as e:
                    raise JobError(f"cannot connect to attach_to={attach_to!r}: {e}; is the port-forward running?") from None

        else:
            pod = self._pods[mesh][0]
            where = f"pod {pod} port {port} (port-forward)"

            def connect() -> Any:
                # a new port-forward for each tunnel (the first, and one after a drop)
                pf, sock = self._port_forward(pod, port)
                forwards[:] = [f for f in forwards if f.connected] + [pf]
                return sock

        rt = _context.client().rt
        try:
            gw = GatewayClient(
                connect, read_key_file(key_file), sorted({split_tcp(a)[0] for a in self._host_addrs()}), lambda: rt.tcp_addr
            )
        except GatewayError as e:
            for f in forwards:
                f.close()
            raise JobError(f"gateway at {where}: {e}") from None
        rt.transport.add_route(gw.route)
        self._gw = (gw, forwards, gw.route)
        logger.info("reaching %d pods through the gateway at %s", len(gw.route.hosts), where)

    def _port_forward(self, pod: str, port: int) -> tuple[Any, Any]:
        """A websocket port-forward to ``pod``'s ``port`` (the client's ``portforward``)."""
        client = _k8s()[0]
        from kubernetes.stream import portforward

        core = client.CoreV1Api(self._client())
        try:
            pf = portforward(core.connect_get_namespaced_pod_portforward, pod, self._namespace, ports=str(port))
        except Exception as e:  # the websocket library's errors, or the client's ApiException
            # the client reports a refused websocket upgrade as ApiException(status=0, reason="Handshake status 403 ...")
            status = getattr(e, "status", None) or getattr(e, "status_code", None)
            if status == 403 or "Handshake status 403" in str(getattr(e, "reason", "")):
                raise JobError(
                    f"the Kubernetes API refused a port-forward to pod {pod} (403): the controller's account needs "
                    f"'create' on 'pods/portforward': apply KubernetesJob.rbac_manifests({self._namespace!r})"
                ) from None
            raise JobError(f"port-forward to pod {pod} port {port} failed: {type(e).__name__}: {e}") from None
        sock = pf.socket(port)._socket
        sock.setblocking(True)
        return pf, sock

    def _close_gateway(self) -> None:
        if self._gw is None:
            return
        gw, pf, route = self._gw
        self._gw = None
        from ..actor import _context

        if _context._client is not None:
            _context._client.rt.transport.remove_route(route)
        gw.close()
        for f in pf:
            f.close()

    def can_run(self, spec: JobTrait) -> bool:
        if not (
            isinstance(spec, KubernetesJob)
            and spec._namespace == self._namespace
            and spec._meshes == self._meshes
            and bool(self._hosts)
        ):
            return False
        if self._created:
            # objects deleted from outside (kubectl delete, a namespace clean-up) leave no pod:
            # re-attaching would wait for pods that nothing creates any more (for ever, timeout=None)
            core = _k8s()[0].CoreV1Api(self._client())
            for name, c in self._meshes.items():
                if (
                    c["image"]
                    and not self._call(
                        "list", "pods", core.list_namespaced_pod, self._namespace, label_selector=self._selector(name)
                    ).items
                ):
                    logger.info("no pod of mesh %r of the cached job is left: it was deleted", name)
                    return False
        return True

    def _kill(self) -> None:
        """Delete what this job created (attach-only pods are not ours: they are left alone)."""
        errors = []
        if self._created:
            client = _k8s()[0]
            api = self._client()
            core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
            left = []
            for kind, name in reversed(self._created):
                fn, res = {
                    "Secret": (core.delete_namespaced_secret, "secrets"),
                    "Service": (core.delete_namespaced_service, "services"),
                    "StatefulSet": (apps.delete_namespaced_stateful_set, "statefulsets.apps"),
                }[kind]
                try:
                    # gone already is what kill() wants
                    self._call("delete", res, fn, name, self._namespace, absent_ok=True, propagation_policy="Background")
                except JobError as e:
                    errors.append(f"{res} {name}: {e}")
                    left.append([kind, name])
            if errors:
                # kept, so that a kill() once the API server answers again deletes the rest
                self._created = left[::-1]
                raise JobError(
                    "could not delete every object of the job (kill() it again, or "
                    f"kubectl -n {self._namespace} delete statefulset,service,secret -l {m.JOB_LABEL}={self._job_id}): "
                    + "; ".join(errors)
                )
        self._created = []
        self._hosts = {}
        self._close_gateway()
        if self._dir:
            # the job's key, also when apply() failed before it created anything
            shutil.rmtree(self._dir, ignore_errors=True)

    def _describe(self) -> dict[str, Any]:
        row: dict[str, Any] = {"id": self._job_id, "hosts": sum(len(v) for v in self._hosts.values())}
        client, _, _, ApiException = _k8s()
        try:
            core = client.CoreV1Api(self._client())
            lost: list[str] = []
            shown: list[str] = []
            for name, c in self._meshes.items():
                pods = core.list_namespaced_pod(self._namespace, label_selector=self._selector(name), _request_timeout=10).items
                ready = {
                    (p.metadata.labels or {}).get(c["pod_rank_label"])
                    for p in pods
                    if any(x.type == "Ready" and x.status == "True" for x in (p.status.conditions or []))
                }
                # the pod's own words for why it is gone (an eviction, a node shutdown), where it has them
                why = {
                    (p.metadata.labels or {}).get(c["pod_rank_label"]): _ended(p) for p in pods if p.status and p.status.reason
                }
                for i in range(c["num_replicas"]):
                    if str(i) not in ready:
                        lost.append(f"{name}[{i}]")
                        shown.append(f"{name}[{i}]" + (f" ({why[str(i)]})" if why.get(str(i)) else ""))
        except Exception as e:
            if not isinstance(e, (ApiException, JobError)) and not _unreachable(e):
                raise
            # a job table must list the others when one API server does not answer
            row["state"] = f"unknown ({type(e).__name__}: {e})"[:120]
            return row
        row["state"] = f"lost: {', '.join(shown)}" if lost else "running"
        row["lost"] = lost
        return row


def make_job(
    name: str,
    hosts: int,
    namespace: str = "default",
    image: str | None = None,
    kubeconfig: str | None = None,
    monarch_port: int = _DEFAULT_MONARCH_PORT,
    timeout: int | None = None,
) -> KubernetesJob:
    """``%mesh launch k8s NAME --hosts N [--image I] [--namespace NS] [--kubeconfig F] [--port P]``:
    one mesh ``name`` of ``hosts`` pods, provisioned from ``image`` or, without one, attached to
    by Monarch's labels for ``name``."""
    job = KubernetesJob(namespace, timeout=timeout, kubeconfig=KubeConfig.from_path(kubeconfig) if kubeconfig else None)
    job.add_mesh(name, hosts, image_spec=ImageSpec(image) if image else None, port=monarch_port)
    return job


def _controller(pod: Any) -> str:
    """The kind and name of what manages ``pod`` (and would make it again), or ""."""
    for r in pod.metadata.owner_references or []:
        if r.controller:
            return f"{r.kind} {r.name}"
    return ""


def _ended(pod: Any) -> str:
    """Why a pod stopped, in its own words (``Evicted: The node was low on resource: memory.``)."""
    msg = (pod.status.message or "").strip()
    if len(msg) > 100:
        msg = msg[:99] + "…"
    return f"{pod.status.reason}: {msg}" if msg else str(pod.status.reason)


def _template_dict(t: Any) -> dict[str, Any]:
    """A ``V1PodTemplateSpec`` (or its dict, camelCase as the API takes it) as a plain dict."""
    if isinstance(t, dict):
        return dict(t)
    client = _k8s()[0]
    if not isinstance(t, client.V1PodTemplateSpec):
        raise TypeError(f"pod_template must be a kubernetes.client.V1PodTemplateSpec or a dict, got {type(t).__name__}")
    out: dict[str, Any] = client.ApiClient().sanitize_for_serialization(t)
    return out


def _template_image(t: dict[str, Any]) -> str:
    cs = (t.get("spec") or {}).get("containers") or [{}]
    c = next((c for c in cs if c.get("name") == "allocator"), cs[0])
    return str(c.get("image") or "")


def _retry_after(e: Any) -> float | None:
    """Seconds to wait before trying a refused request again, or None if it is not to be retried:
    a 429 (the API server's max-in-flight or priority-and-fairness limit; the request was not
    served), or a 5xx that says when to come back, as client-go retries them."""
    status = getattr(e, "status", None) or 0
    raw = (getattr(e, "headers", None) or {}).get("Retry-After")
    if status != 429 and not (status >= 500 and raw is not None):
        return None
    try:
        wait = float(raw) if raw is not None else 1.0
    except ValueError:
        wait = 1.0
    return min(max(wait, 0.1), RETRY_MAX_WAIT_S)


def _unreachable(e: BaseException) -> bool:
    """The request did not get an answer: refused, timed out, cut (urllib3's errors or the OS's)."""
    import urllib3

    return isinstance(e, (urllib3.exceptions.HTTPError, OSError))


def _reason(e: Any) -> str:
    import json

    try:
        return str(json.loads(e.body).get("message") or e.reason)
    except Exception:
        # some refusals are plain text (the max-in-flight filter's 429): its line says more than the status
        body = e.body.decode(errors="replace") if isinstance(e.body, bytes) else str(e.body or "")
        return body.strip()[:200] if body.strip() and "\n" not in body.strip() else str(e.reason)


__all__ = ["ImageSpec", "KubeConfig", "KubernetesJob"]
