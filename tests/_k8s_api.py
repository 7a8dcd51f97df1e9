"""A small Kubernetes API server for the tests: the subset of REST and watch that
``KubernetesJob`` uses through the official client, with a "kubelet" that runs each pod's
container as a real process on a network-namespace host (tests/_netns.py).

Run as ``python _k8s_api.py CONFIG.json`` on the controller's host; CONFIG has ``port_file``,
``python`` (what the container's ``python`` is), ``tokens`` ({token: "admin" or
"system:serviceaccount:NS:NAME"}) and ``hosts`` ([{ip, wrap}] where ``wrap`` is the argv prefix
that runs a command on that host, and ``root`` the host's file system as seen from here).

What it enforces, as a real API server would:
- every object it receives is validated in strict mode against Kubernetes 1.33's schema
  (kubernetes-validate): 422 with the first error;
- a request with a token it does not know (expired, revoked, mistyped) is refused with 401
  ``Unauthorized``, as a real server's authenticator does (anonymous is only a request without one);
- requests with a service account's token are authorized by the Roles bound to it (RoleBindings in
  that namespace; no wildcards are honoured): 403 with the real message otherwise;
- 409 on create of an existing name, 404 on a missing one;
- watches start after the given ``resourceVersion`` (410 Gone if it is older than what is kept);
- port-forward as the client's ``kubernetes.stream.portforward`` speaks it: a websocket upgrade of
  ``GET .../pods/NAME/portforward?ports=P`` (subprotocol ``v4.channel.k8s.io``, authorized as
  ``create`` on ``pods/portforward``), channel 0 data and 1 errors, each opened with the port in
  two little-endian bytes; the connection is made to ``127.0.0.1:P`` in the pod's network
  namespace (``setns``), as a kubelet does.

Failures a real API server presents, on request of a test (``POST /_test/faults``, a list of
``{method, path (a regex on the URL path), status, count, retry_after, body}``): the next
``count`` matching requests get that answer instead. 429 is answered as kube-apiserver's
max-in-flight and priority-and-fairness filters do (plain text "Too many requests, please try
again later." with ``Retry-After``), other codes as a ``Status`` object (``InternalError`` for
500). ``POST /_test/expire`` drops every kept watch event, so a watch from an older
resourceVersion gets 410 Gone (etcd compacted it). ``POST /_test/evict`` ({namespace, name,
message, bare}) evicts a running pod as a kubelet under node pressure does: its container is killed,
the pod stays, ``Failed`` with ``reason: Evicted`` and the message (this server's StatefulSets do
not replace it; with ``bare`` the pod has no owner, as one started by hand, which nothing would).

The kubelet: a StatefulSet's pods are placed one per free host (none free: Pending,
``Unschedulable``); the Secret and emptyDir volumes are directories on the host, ``$(VAR)`` is
expanded from the container's env (``POD_IP`` from the downward API), an exec readiness probe
``test -e PATH`` is checked on the host's files; a container that exits is restarted and its pod
shows ``CrashLoopBackOff`` (with the previous container's log).
"""

from __future__ import annotations

import base64
import ctypes
import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import kubernetes_validate

VALIDATE_VERSION = "1.33"
#: events kept for watches; older resourceVersions get 410 Gone
KEEP_EVENTS = 10000

RESOURCES = {
    # (group, plural) -> kind
    ("", "pods"): "Pod",
    ("", "secrets"): "Secret",
    ("", "services"): "Service",
    ("", "serviceaccounts"): "ServiceAccount",
    ("apps", "statefulsets"): "StatefulSet",
    ("rbac.authorization.k8s.io", "roles"): "Role",
    ("rbac.authorization.k8s.io", "rolebindings"): "RoleBinding",
}

PATH_RE = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/v1)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Store:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.lock = threading.Condition()
        self.rv = 100
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}  # (group, plural, ns, name)
        self.events: list[tuple[int, str, str, str, dict[str, Any]]] = []  # rv, type, ns, plural, obj
        self.free = list(range(len(cfg["hosts"])))
        self.pods: dict[tuple[str, str], Kubelet] = {}
        self.log: list[str] = []  # requests, for the tests
        self.faults: list[dict[str, Any]] = []  # answers to give instead (POST /_test/faults)
        self.compacted = 0  # watches from before this resourceVersion get 410 (POST /_test/expire)

    def bump(self, obj: dict[str, Any], group: str, plural: str, etype: str) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if group == "" and plural == "pods":
            self.events.append((self.rv, etype, obj["metadata"]["namespace"], plural, json.loads(json.dumps(obj))))
            del self.events[:-KEEP_EVENTS]
        self.lock.notify_all()

    def put(self, group: str, plural: str, obj: dict[str, Any], etype: str = "ADDED") -> None:
        md = obj["metadata"]
        self.objects[(group, plural, md["namespace"], md["name"])] = obj
        self.bump(obj, group, plural, etype)


def matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (selector or "").split(",")):
        k, _, v = term.partition("=")
        if labels.get(k.strip()) != v.strip():
            return False
    return True


class Kubelet:
    """One pod's container on one host, restarted when it exits."""

    def __init__(self, store: Store, pod: dict[str, Any], host: int, secrets: dict[str, dict[str, Any]]) -> None:
        self.store, self.pod, self.host = store, pod, host
        self.hcfg = store.cfg["hosts"][host]
        self.name = pod["metadata"]["name"]
        self.dir = f"/tmp/kubelet/{self.name}-{uuid.uuid4().hex[:6]}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopped = False
        self.logs: list[bytes] = []
        self.restarts = 0
        spec = pod["spec"]
        # one container runs here: the allocator's (a pod template's sidecars are not run)
        c = next((c for c in spec["containers"] if c.get("name") == "allocator"), spec["containers"][0])
        self.mounts: dict[str, str] = {}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for vm in c.get("volumeMounts", []):
            v = volumes[vm["name"]]
            hostdir = f"{self.dir}/{vm['name']}"
            os.makedirs(self.host_path(hostdir), mode=0o700)
            if "secret" in v:
                data = secrets[v["secret"]["secretName"]].get("data", {})
                for k, b64 in data.items():
                    p = self.host_path(f"{hostdir}/{k}")
                    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, v["secret"].get("defaultMode", 0o644))
                    os.write(fd, base64.b64decode(b64))
                    os.close(fd)
            self.mounts[vm["mountPath"]] = hostdir
        env = {e["name"]: e.get("value", "") for e in c.get("env", []) if "value" in e}
        for e in c.get("env", []):
            if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                env[e["name"]] = self.hcfg["ip"]
        self.env = env
        argv = list(c.get("command", [])) + list(c.get("args", []))
        argv = [self.expand(a) for a in argv]
        if argv and argv[0] == "python":
            # the image decides the interpreter: one without monarch_nb installed crashes, as it would
            argv[0] = store.cfg.get("images", {}).get(c.get("image"), store.cfg["python"])
        self.argv = argv
        probe = c.get("readinessProbe", {}).get("exec", {}).get("command", [])
        self.probe = self.map_path(probe[2]) if probe[:2] == ["test", "-e"] else None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def host_path(self, p: str) -> str:
        return os.path.join(self.hcfg["root"], p.lstrip("/"))

    def map_path(self, p: str) -> str:
        for mp, hd in self.mounts.items():
            if p == mp or p.startswith(mp + "/"):
                return hd + p[len(mp) :]
        return p

    def expand(self, a: str) -> str:
        a = re.sub(r"\$\((\w+)\)", lambda mo: self.env.get(mo.group(1), mo.group(0)), a)
        return self.map_path(a)

    def set_status(self, **kw: Any) -> None:
        with self.store.lock:
            st = self.pod["status"]
            st.update(kw)
            self.store.bump(self.pod, "", "pods", "MODIFIED")

    def run(self) -> None:
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("MONARCH_NB_")}
        while not self.stopped:
            logpath = self.host_path(f"{self.dir}/container.log")
            # a container starts with a fresh writable layer: what the last one wrote outside its
            # volumes is gone (here: below /tmp of the host, the only such place our pods write)
            for p in c_writes(self.argv):
                shutil.rmtree(self.host_path(p), ignore_errors=True)
            with open(logpath, "wb") as log:
                self.proc = subprocess.Popen(
                    [*self.hcfg["wrap"], *self.argv],
                    env={**base_env, **self.env},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.set_status(
                phase="Running",
                podIP=self.hcfg["ip"],
                hostIP=self.hcfg["ip"],
                conditions=cond(True, False),
                containerStatuses=[cstatus(self.restarts, {"running": {"startedAt": now()}}, False)],
            )
            ready = False
            while self.proc.poll() is None and not self.stopped:
                if not ready and self.probe and os.path.exists(self.host_path(self.map_path(self.probe))):
                    ready = True
                    self.set_status(
                        conditions=cond(True, True),
                        containerStatuses=[cstatus(self.restarts, {"running": {"startedAt": now()}}, True)],
                    )
                time.sleep(0.1)  # the kubelet's probe period
            if self.stopped:
                return
            with open(logpath, "rb") as f:
                self.logs.append(f.read())
            self.restarts += 1
            self.set_status(
                conditions=cond(True, False),
                containerStatuses=[
                    cstatus(
                        self.restarts,
                        {
                            "waiting": {
                                "reason": "CrashLoopBackOff",
                                "message": f"back-off restarting failed container allocator in pod {self.name}",
                            }
                        },
                        False,
                    )
                ],
            )
            # a real kubelet's first back-off is 10 s; 60 s here so that a test watching a crashed
            # pod still finds it not Ready however slowly its next script starts on a loaded machine
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline and not self.stopped:
                time.sleep(0.1)

    def log_text(self, previous: bool) -> str:
        if previous:
            return self.logs[-1].decode(errors="replace") if self.logs else ""
        try:
            with open(self.host_path(f"{self.dir}/container.log"), "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def evict(self, message: str) -> None:
        """As a kubelet under node pressure: the container is killed and the pod object stays,
        Failed, with the eviction's reason and message (kubelet's eviction manager, 1.33)."""
        self.stop()
        t = now()
        self.set_status(
            phase="Failed",
            reason="Evicted",
            message=message,
            conditions=[
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "TerminationByKubelet",
                    "message": message,
                    "lastTransitionTime": t,
                },
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": t},
                {"type": "Ready", "status": "False", "reason": "PodFailed", "lastTransitionTime": t},
            ],
            containerStatuses=[
                cstatus(self.restarts, {"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": t}}, False)
            ],
        )

    def stop(self) -> None:
        self.stopped = True
        p = self.proc
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def c_writes(argv: list[str]) -> list[str]:
    """Paths under /tmp named on a container's command line (its own file system)."""
    return [a for a in argv if a.startswith("/tmp/") and not a.startswith("/tmp/kubelet/")]


def cond(scheduled: bool, ready: bool, reason: str = "", message: str = "") -> list[dict[str, Any]]:
    out = [{"type": "PodScheduled", "status": str(scheduled), "lastTransitionTime": now()}]
    if not scheduled:
        out[0].update(reason=reason, message=message)
    out.append({"type": "Ready", "status": str(ready), "lastTransitionTime": now()})
    return out


def cstatus(restarts: int, state: dict[str, Any], ready: bool) -> dict[str, Any]:
    return {"name": "allocator", "image": "x", "imageID": "", "ready": ready, "restartCount": restarts, "state": state}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: Store

    def log_message(self, *a: Any) -> None:
        pass

    # ------------------------------------------------------------ responses
    def send_json(self, code: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def status(self, code: int, reason: str, message: str) -> None:
        self.send_json(
            code,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": message,
                "reason": reason,
                "code": code,
            },
        )

    def fault(self, method: str) -> bool:
        """Answer with a fault the test asked for, if one matches this request."""
        path = urlparse(self.path).path
        with self.store.lock:
            f = next(
                (f for f in self.store.faults if f["count"] > 0 and f["method"] == method and re.search(f["path"], path)),
                None,
            )
            if f is None:
                return False
            f["count"] -= 1
            self.store.log.append(f"fault {f['status']} {method} {path}")
        code = f["status"]
        if code == 429:
            body = (f.get("body") or "Too many requests, please try again later.\n").encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Retry-After", str(f.get("retry_after", 1)))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return True
        reason = {500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}.get(code, "BadRequest")
        self.status(code, reason, f.get("body") or f"Internal error occurred: {reason.lower()} (injected by the test)")
        return True

    def test_control(self, body: bytes) -> bool:
        path = urlparse(self.path).path
        if not path.startswith("/_test/"):
            return False
        st = self.store
        evicted, req = None, {}
        with st.lock:
            if path == "/_test/log":
                self.send_json(200, list(st.log))
                return True
            if path == "/_test/faults":
                st.faults.extend(json.loads(body))
            elif path == "/_test/expire":
                st.events.clear()
                st.rv += 1  # resourceVersions are the whole cluster's: other objects changed meanwhile
                st.compacted = st.rv
            elif path == "/_test/evict":
                req = json.loads(body)
                evicted = st.pods.get((req["namespace"], req["name"]))
                if evicted is None:
                    self.send_json(404, {"ok": False})
                    return True
                if req.get("bare"):
                    evicted.pod["metadata"].pop("ownerReferences", None)
        if evicted is not None:
            evicted.evict(req.get("message") or "The node was low on resource: memory.")
        self.send_json(200, {"ok": True})
        return True

    def parse(self) -> tuple[str, str, str, str | None, str | None, dict[str, list[str]]] | None:
        u = urlparse(self.path)
        mo = PATH_RE.match(u.path)
        if mo is None:
            self.status(404, "NotFound", f"the server could not find the requested resource ({u.path})")
            return None
        return mo.group("group") or "", mo.group("plural"), mo.group("ns"), mo.group("name"), mo.group("sub"), parse_qs(u.query)

    def authorize(self, verb: str, group: str, plural: str, sub: str | None, ns: str) -> bool:
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        user = self.store.cfg["tokens"].get(token)
        self.store.log.append(f"{user} {verb} {group}/{plural}{'/' + sub if sub else ''} {ns}")
        if token and user is None:
            # the authenticator rejects a token before any authorizer sees the request
            self.status(401, "Unauthorized", "Unauthorized")
            return False
        if user == "admin":
            return True
        resource = plural + ("/" + sub if sub else "")
        if user is not None:
            with self.store.lock:
                for (g, p, n, _), rb in list(self.store.objects.items()):
                    if (g, p, n) != ("rbac.authorization.k8s.io", "rolebindings", ns):
                        continue
                    if not any(
                        s.get("kind") == "ServiceAccount"
                        and f"system:serviceaccount:{s.get('namespace', ns)}:{s['name']}" == user
                        for s in rb.get("subjects", [])
                    ):
                        continue
                    role = self.store.objects.get(("rbac.authorization.k8s.io", "roles", ns, rb["roleRef"]["name"]))
                    for rule in (role or {}).get("rules", []):
                        if (
                            group in rule.get("apiGroups", [])
                            and resource in rule.get("resources", [])
                            and verb in rule.get("verbs", [])
                        ):
                            return True
        g = f' in API group "{group}"' if group else ' in API group ""'
        what = f"{plural}.{group}" if group else plural
        self.status(
            403,
            "Forbidden",
            f'{what} is forbidden: User "{user or "system:anonymous"}" cannot {verb} resource "{resource}"{g} in the namespace "{ns}"',
        )
        return False

    # ------------------------------------------------------------ verbs
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.test_control(body) or self.fault("POST"):
            return
        p = self.parse()
        if p is None:
            return
        group, plural, ns, _name, sub, _ = p
        if not self.authorize("create", group, plural, sub, ns):
            return
        obj = json.loads(body)
        try:
            kubernetes_validate.validate(obj, VALIDATE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(map(str, e.path))
            return self.status(
                422, "Invalid", f"{obj.get('kind')} {obj.get('metadata', {}).get('name')} is invalid: {path}: {e.message}"
            )
        except kubernetes_validate.SchemaNotFoundError as e:
            return self.status(404, "NotFound", f"no kind {e.kind!r} in {e.api_version}")
        st = self.store
        md = obj.setdefault("metadata", {})
        md.setdefault("namespace", ns)
        with st.lock:
            if (group, plural, ns, md["name"]) in st.objects:
                what = f"{plural}.{group}" if group else plural
                return self.status(409, "AlreadyExists", f'{what} "{md["name"]}" already exists')
            md.update(uid=str(uuid.uuid4()), creationTimestamp=now())
            st.put(group, plural, obj)
            if (group, plural) == ("apps", "statefulsets"):
                self.start_statefulset(obj)
            self.send_json(201, obj)

    def start_statefulset(self, sts: dict[str, Any]) -> None:
        st = self.store
        ns = sts["metadata"]["namespace"]
        secrets = {n: o for (g, p, n2, n), o in st.objects.items() if (g, p, n2) == ("", "secrets", ns)}
        tmpl = sts["spec"]["template"]
        for i in range(sts["spec"].get("replicas", 1)):
            name = f"{sts['metadata']['name']}-{i}"
            labels = {
                **tmpl["metadata"].get("labels", {}),
                "apps.kubernetes.io/pod-index": str(i),
                "statefulset.kubernetes.io/pod-name": name,
            }
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": ns,
                    "labels": labels,
                    "uid": str(uuid.uuid4()),
                    "creationTimestamp": now(),
                    "ownerReferences": [
                        {
                            "apiVersion": "apps/v1",
                            "kind": "StatefulSet",
                            "name": sts["metadata"]["name"],
                            "uid": sts["metadata"]["uid"],
                            "controller": True,
                        }
                    ],
                },
                "spec": json.loads(json.dumps(tmpl["spec"])),
                "status": {"phase": "Pending", "conditions": cond(False, False)},
            }
            if st.free:
                host = st.free.pop(0)
                pod["spec"]["nodeName"] = f"node{host}"
                st.put("", "pods", pod)
                st.pods[(ns, name)] = Kubelet(st, pod, host, secrets)
            else:
                n = len(st.cfg["hosts"])
                pod["status"]["conditions"] = cond(
                    False, False, "Unschedulable", f"0/{n} nodes are available: {n} Insufficient cpu."
                )
                st.put("", "pods", pod)

    def do_DELETE(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.fault("DELETE"):
            return
        p = self.parse()
        if p is None:
            return
        group, plural, ns, name, sub, _ = p
        if not self.authorize("delete", group, plural, sub, ns):
            return
        st = self.store
        with st.lock:
            obj = st.objects.pop((group, plural, ns, name or ""), None)
            if obj is None:
                return self.status(404, "NotFound", f'{plural} "{name}" not found')
            st.bump(obj, group, plural, "DELETED")
            kubelets = []
            if (group, plural) == ("", "pods") and (ns, name) in st.pods:
                kubelets.append(st.pods.pop((ns, name)))  # a pod deleted by itself (one no StatefulSet owns)
            if (group, plural) == ("apps", "statefulsets"):
                for (g, pl, n, pname), pod in list(st.objects.items()):
                    refs = pod["metadata"].get("ownerReferences", [])
                    if (g, pl, n) == ("", "pods", ns) and any(r["uid"] == obj["metadata"]["uid"] for r in refs):
                        del st.objects[(g, pl, n, pname)]
                        st.bump(pod, "", "pods", "DELETED")
                        k = st.pods.pop((ns, pname), None)
                        if k is not None:
                            kubelets.append(k)
        for k in kubelets:
            k.stop()
            with st.lock:
                st.free.append(k.host)
                st.free.sort()
        if plural in ("services", "pods"):  # as the real server: a deleted Service or Pod comes back as itself
            return self.send_json(200, obj)
        self.send_json(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"})

    def do_GET(self) -> None:
        if self.fault("GET"):
            return
        p = self.parse()
        if p is None:
            return
        group, plural, ns, name, sub, q = p
        watching = q.get("watch", ["false"])[0] in ("true", "1")
        verb = "get" if name else ("watch" if watching else "list")
        if sub == "portforward":
            verb = "create"  # a websocket upgrade is authorized as create (Kubernetes 1.35+; get before)
        if not self.authorize(verb, group, plural, sub, ns):
            return
        st = self.store
        if name and sub == "portforward":
            return self.portforward(ns, name, q)
        if name and sub == "log":
            k = st.pods.get((ns, name))
            if k is None:
                return self.status(404, "NotFound", f'pods "{name}" not found')
            text = k.log_text(q.get("previous", ["false"])[0] == "true")
            n = int(q.get("tailLines", ["0"])[0] or 0)
            if n:
                text = "\n".join(text.splitlines()[-n:]) + "\n"
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if name:
            with st.lock:
                obj = st.objects.get((group, plural, ns, name))
            if obj is None:
                return self.status(404, "NotFound", f'{plural} "{name}" not found')
            return self.send_json(200, obj)
        sel = q.get("labelSelector", [""])[0]
        if watching:
            return self.watch(ns, plural, sel, q)
        with st.lock:
            items = [
                o
                for (g, p2, n, _), o in st.objects.items()
                if (g, p2, n) == (group, plural, ns) and matches(o["metadata"].get("labels", {}), sel)
            ]
            kind = RESOURCES.get((group, plural), "Unknown")
            self.send_json(
                200, {"kind": f"{kind}List", "apiVersion": "v1", "metadata": {"resourceVersion": str(st.rv)}, "items": items}
            )

    def portforward(self, ns: str, name: str, q: dict[str, list[str]]) -> None:
        st = self.store
        k = st.pods.get((ns, name))
        if k is None:
            return self.status(404, "NotFound", f'pods "{name}" not found')
        if (self.headers.get("Upgrade") or "").lower() != "websocket":
            return self.status(400, "BadRequest", "port-forward needs a websocket upgrade")
        offered = [p.strip() for p in (self.headers.get("Sec-WebSocket-Protocol") or "").split(",")]
        if WS_PROTOCOL not in offered:
            return self.status(400, "BadRequest", f"subprotocols {offered}: this server speaks {WS_PROTOCOL}")
        ports = [int(p) for p in q.get("ports", [""])[0].split(",") if p]
        if len(ports) != 1:
            return self.status(400, "BadRequest", "one port per port-forward here")
        port = ports[0]
        accept = base64.b64encode(hashlib.sha1(self.headers["Sec-WebSocket-Key"].encode() + WS_GUID).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.send_header("Sec-WebSocket-Protocol", WS_PROTOCOL)
        self.end_headers()
        self.close_connection = True
        wlock = threading.Lock()

        def send(payload: bytes, opcode: int = 2) -> None:
            n = len(payload)
            head = bytes([0x80 | opcode]) + (
                bytes([n]) if n < 126 else b"\x7e" + struct.pack("!H", n) if n < 65536 else b"\x7f" + struct.pack("!Q", n)
            )
            with wlock:
                self.wfile.write(head + payload)
                self.wfile.flush()

        pb = struct.pack("<H", port)
        send(b"\x00" + pb)
        send(b"\x01" + pb)
        st.log.append(f"portforward {ns}/{name}:{port}")
        try:
            conn = connect_in_netns(k.hcfg["netns"], port)
        except OSError as e:
            # as a kubelet: the reason on the error channel, then the stream ends
            send(b"\x01" + f"error forwarding port {port} to pod {name}: {e}".encode())
            send(b"", 8)
            return

        def from_client() -> None:
            try:
                while True:
                    frame = ws_read(self.rfile)
                    if frame is None or frame[0] == 8:
                        break
                    op, data = frame
                    if op == 9:
                        send(data, 10)
                    elif op == 2 and data[:1] == b"\x00" and len(data) > 1:
                        conn.sendall(data[1:])
            except OSError:
                pass
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        t = threading.Thread(target=from_client, daemon=True)
        t.start()
        try:
            while True:
                data = conn.recv(256 * 1024)
                if not data:
                    break
                send(b"\x00" + data)
            send(b"", 8)
        except OSError:
            pass
        conn.close()
        t.join(5)

    def watch(self, ns: str, plural: str, sel: str, q: dict[str, list[str]]) -> None:
        st = self.store
        since = int(q.get("resourceVersion", ["0"])[0] or 0)
        timeout = float(q.get("timeoutSeconds", ["30"])[0])
        deadline = time.monotonic() + timeout
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(obj: Any) -> None:
            b = json.dumps(obj).encode() + b"\n"
            self.wfile.write(f"{len(b):x}\r\n".encode() + b + b"\r\n")
            self.wfile.flush()

        try:
            with st.lock:
                if since and (since < st.compacted or (st.events and since < st.events[0][0] - 1)):
                    st.log.append(f"410 watch {ns}/{plural} from {since}")
                    chunk(
                        {
                            "type": "ERROR",
                            "object": {
                                "kind": "Status",
                                "apiVersion": "v1",
                                "status": "Failure",
                                "code": 410,
                                "reason": "Expired",
                                "message": f"too old resource version: {since}",
                            },
                        }
                    )
                else:
                    while True:
                        for rv, etype, n, p2, obj in st.events:
                            if rv > since and n == ns and p2 == plural and matches(obj["metadata"].get("labels", {}), sel):
                                chunk({"type": etype, "object": obj})
                                since = rv
                        if st.events:
                            since = max(since, st.events[-1][0])
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        st.lock.wait(left)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True


WS_PROTOCOL = "v4.channel.k8s.io"
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000


def ws_read(rfile: Any) -> tuple[int, bytes] | None:
    """One websocket frame from the client (masked, as clients must): (opcode, payload)."""
    h = rfile.read(2)
    if len(h) < 2:
        return None
    op, n = h[0] & 0x0F, h[1] & 0x7F
    if n == 126:
        (n,) = struct.unpack("!H", rfile.read(2))
    elif n == 127:
        (n,) = struct.unpack("!Q", rfile.read(8))
    mask = rfile.read(4) if h[1] & 0x80 else b""
    data = rfile.read(n)
    if len(data) < n:
        return None
    if mask and n:
        m = (mask * (n // 4 + 1))[:n]
        data = (int.from_bytes(data, "big") ^ int.from_bytes(m, "big")).to_bytes(n, "big")
    return op, data


def connect_in_netns(netns: str, port: int) -> socket.socket:
    """Connect to 127.0.0.1:port inside a pod's network namespace (this thread's, for a moment)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(netns, os.O_RDONLY)
    try:
        if _libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        finally:
            if _libc.setns(own, _CLONE_NEWNET) != 0:
                os._exit(70)  # a thread left in a pod's namespace would serve the API from there
    finally:
        os.close(own)
        os.close(target)


def main() -> None:
    cfg = json.loads(open(sys.argv[1]).read())
    store = Store(cfg)
    Handler.store = store
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True

    def stop(*_: Any) -> None:
        for k in list(store.pods.values()):
            k.stop()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    with open(cfg["port_file"] + ".tmp", "w") as f:
        f.write(str(srv.server_address[1]))
    os.rename(cfg["port_file"] + ".tmp", cfg["port_file"])
    srv.serve_forever()


if __name__ == "__main__":
    main()
