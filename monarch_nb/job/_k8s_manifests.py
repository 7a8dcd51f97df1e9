"""The Kubernetes objects a ``KubernetesJob`` creates, as plain JSON dicts (camelCase, as the API
server and ``kubectl apply`` take them), so that they can be validated offline and shown in a
dry run without the kubernetes package.

One provisioned mesh is a headless Service and a StatefulSet (``podManagementPolicy: Parallel``,
so every pod starts at once; ranks come from the ``apps.kubernetes.io/pod-index`` label). The job
has one Secret, the cluster key, mounted into every pod as a file (never an environment variable
or an argument). ``rbac`` is the Role the controller needs, namespaced and without wildcards.
"""

from __future__ import annotations

import base64
from typing import Any

#: where the key Secret is mounted in each pod
KEY_DIR = "/var/run/monarch-nb/key"
#: where the allocator announces itself; the readiness probe waits for that file. In the
#: container's own file system, not an emptyDir: a restarted container starts without the last
#: one's file, so it is not Ready before its allocator serves again
ANNOUNCE_DIR = "/tmp/monarch-nb-announce"
ANNOUNCE_NAME = "allocator"
RANK_LABEL = "apps.kubernetes.io/pod-index"
MANAGED_BY = "monarch-nb"
JOB_LABEL = "monarch-nb.pytorch.org/job"
#: Monarch's labels: its attach-only selector finds our pods too
NAME_LABEL = "app.kubernetes.io/name"
MESH_LABEL = "monarch.pytorch.org/mesh-name"

#: (API group, resource, verbs) the controller uses; nothing else is granted
RULES: list[tuple[str, str, list[str]]] = [
    ("", "pods", ["get", "list", "watch"]),
    ("", "pods/log", ["get"]),
    # the gateway of a controller outside the cluster (websocket port-forward: create, or get
    # on API servers before the create check of 1.35)
    ("", "pods/portforward", ["get", "create"]),
    ("", "secrets", ["create", "delete"]),
    ("", "services", ["create", "delete"]),
    ("apps", "statefulsets", ["create", "delete"]),
]


def gateway_port(port: int) -> int:
    """The gateway's port in a pod: next to the allocator's, on the pod's loopback only."""
    return port + 1


def selector_labels(mesh: str, job_id: str) -> dict[str, str]:
    return {NAME_LABEL: "monarch-worker", MESH_LABEL: mesh, JOB_LABEL: job_id}


def selector(mesh: str, job_id: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(mesh, job_id).items())


def secret_name(job_id: str) -> str:
    return f"monarch-nb-{job_id}-key"


def secret(namespace: str, job_id: str, key: bytes) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(job_id),
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": MANAGED_BY, JOB_LABEL: job_id},
        },
        "type": "Opaque",
        "data": {"key": base64.b64encode(key).decode()},
    }


def service(namespace: str, mesh: str, job_id: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{mesh}-svc", "namespace": namespace, "labels": selector_labels(mesh, job_id)},
        "spec": {
            "clusterIP": "None",
            # pods are addressed while they start (the controller waits for readiness itself)
            "publishNotReadyAddresses": True,
            "selector": selector_labels(mesh, job_id),
            "ports": [{"name": "monarch", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def statefulset(
    namespace: str,
    mesh: str,
    job_id: str,
    replicas: int,
    image: str,
    port: int,
    resources: dict[str, str | int] | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    python_exe: str = "python",
    pod_template: dict[str, Any] | None = None,
) -> dict[str, Any]:
    pod_labels = selector_labels(mesh, job_id)
    meta: dict[str, Any] = {"name": mesh, "namespace": namespace, "labels": {**(labels or {}), **pod_labels}}
    if annotations:
        meta["annotations"] = dict(annotations)
    container: dict[str, Any] = {
        "name": "allocator",
        "image": image,
        "command": [python_exe, "-m", "monarch_nb", "allocator"],
        "args": [
            # $(POD_IP) is expanded by the kubelet: the allocator binds its own pod's address
            "--bind",
            f"tcp://$(POD_IP):{port}",
            "--key-file",
            f"{KEY_DIR}/key",
            "--announce-dir",
            ANNOUNCE_DIR,
            "--announce-name",
            ANNOUNCE_NAME,
            # the tunnel end for a controller outside the cluster (port-forward; loopback only)
            "--gateway",
            f"127.0.0.1:{gateway_port(port)}",
        ],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        + [{"name": k, "value": v} for k, v in sorted((env or {}).items())],
        "ports": [{"name": "monarch", "containerPort": port, "protocol": "TCP"}],
        # Ready = the allocator serves (it announces itself only then)
        "readinessProbe": {
            "exec": {"command": ["test", "-e", f"{ANNOUNCE_DIR}/{ANNOUNCE_NAME}.json"]},
            "periodSeconds": 1,
        },
        "volumeMounts": [
            {"name": "key", "mountPath": KEY_DIR, "readOnly": True},
        ],
    }
    if resources:
        rs = {k: str(v) for k, v in resources.items()}
        container["resources"] = {"requests": rs, "limits": dict(rs)}
    tmpl_meta: dict[str, Any] = {"labels": pod_labels}
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": [
            {"name": "key", "secret": {"secretName": secret_name(job_id), "defaultMode": 0o400}},
        ],
    }
    if pod_template is not None:
        tmpl_meta, pod_spec = merge_pod_template(pod_template, tmpl_meta, pod_spec)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "serviceName": f"{mesh}-svc",
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": pod_labels},
            "template": {"metadata": tmpl_meta, "spec": pod_spec},
        },
    }


#: fields of the allocator's container that monarch_nb sets itself: a template that sets them
#: would be ignored, so it is refused instead
OWNED_CONTAINER_FIELDS = ("command", "args", "readinessProbe")


def merge_pod_template(
    template: dict[str, Any], meta: dict[str, Any], spec: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The user's pod template (``add_mesh(pod_template=...)``, camelCase) with the allocator merged
    in: its container is the template's container named ``allocator``, else its first one; the
    template keeps its image, resources, other containers, volumes and pod fields. What the
    allocator needs (command, the key volume, the readiness probe, its port and env) is added; a
    template that sets one of those itself raises ``NotImplementedError`` naming the field."""
    t_meta = dict(template.get("metadata") or {})
    t_spec = dict(template.get("spec") or {})
    containers = [dict(c) for c in t_spec.get("containers") or []]
    if not containers:
        raise ValueError("pod_template.spec.containers is empty: give the container that runs the allocator (its image)")
    idx = next((i for i, c in enumerate(containers) if c.get("name") == "allocator"), 0)
    user = containers[idx]
    if not user.get("image"):
        raise ValueError(f"pod_template container {user.get('name')!r} has no image (one with monarch_nb installed)")
    for f in OWNED_CONTAINER_FIELDS:
        if user.get(f):
            raise NotImplementedError(
                f"pod_template container {user.get('name')!r} sets {f}: monarch_nb sets the allocator's {f} itself; "
                "remove it (other containers of the template may set theirs)"
            )
    ours = spec["containers"][0]
    merged = {**user, **{k: v for k, v in ours.items() if k not in ("image", "resources")}}
    merged["name"] = user.get("name") or ours["name"]
    merged["image"] = user["image"]
    if "resources" in ours and "resources" not in user:
        merged["resources"] = ours["resources"]
    clash = sorted({e.get("name") for e in user.get("env") or []} & {e["name"] for e in ours["env"]})
    if clash:
        raise ValueError(f"pod_template container {user.get('name')!r} sets env {clash}, which the allocator needs; rename them")
    merged["env"] = list(ours["env"]) + list(user.get("env") or [])
    merged["ports"] = list(ours["ports"]) + [p for p in user.get("ports") or [] if p.get("name") != "monarch"]
    merged["volumeMounts"] = list(ours["volumeMounts"]) + list(user.get("volumeMounts") or [])
    containers[idx] = merged
    names = [c.get("name") for c in containers]
    if len(set(names)) != len(names):
        raise ValueError(f"pod_template container names must be unique, got {names}")
    volumes = list(t_spec.get("volumes") or [])
    if any(v.get("name") == "key" for v in volumes):
        raise ValueError("pod_template has a volume named 'key': that name is the cluster key's Secret; rename it")
    out_spec = {**spec, **t_spec, "containers": containers, "volumes": volumes + list(spec["volumes"])}
    if "automountServiceAccountToken" in t_spec:
        out_spec["automountServiceAccountToken"] = t_spec["automountServiceAccountToken"]
    out_meta = {**t_meta, "labels": {**(t_meta.get("labels") or {}), **meta["labels"]}}
    return out_meta, out_spec


def rbac(namespace: str, service_account: str, name: str = "monarch-nb-controller") -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding for the controller (``kubectl apply`` them once)."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": service_account, "namespace": namespace}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": name, "namespace": namespace},
            "rules": [{"apiGroups": [g], "resources": [r], "verbs": list(v)} for g, r, v in RULES],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": name, "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
        },
    ]
