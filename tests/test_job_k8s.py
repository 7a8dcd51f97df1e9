"""KubernetesJob: its manifests against the published schemas (strict, Kubernetes 1.30-1.37), and
its whole flow through the official kubernetes client against a test API server
(tests/_k8s_api.py) whose "pods" are network-namespace hosts running real allocators.

Host 0 runs the API server and the controller scripts; hosts 1..3 are the nodes. The API server
validates what it receives, enforces the Role this job generates, answers 409/404, and serves
watches from a resourceVersion. No real cluster is involved: docs/clusters.md says how to try one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for

sys.path.insert(0, str(Path(__file__).parent))
import kubernetes_validate as kv
from _jobhelp import PY, KeyWatch, run_controller
from _netns import NetnsCluster

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(240)]

NS = "mnb"
VERSIONS = [f"1.{v}" for v in range(30, 38)]
IMAGE = "example.org/monarch-nb:test"
#: an image without monarch_nb: its allocator exits at once, the pod crash-loops
BROKEN = "example.org/python:3.11-slim"


def test_manifests_validate_strict_on_every_version() -> None:
    from monarch_nb.job.kubernetes import ImageSpec, KubernetesJob

    job = KubernetesJob(NS)
    job.add_mesh(
        "trainers",
        4,
        image_spec=ImageSpec(IMAGE, {"nvidia.com/gpu": 8, "cpu": "16"}),
        port=26601,
        labels={"team": "ml"},
        annotations={"note": "x"},
    )
    job.add_mesh("loaders", 2, image_spec=ImageSpec(IMAGE))
    objs = job.manifests("abcdef12") + KubernetesJob.rbac_manifests(NS)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["Role", "RoleBinding", "Secret", "Service", "Service", "ServiceAccount", "StatefulSet", "StatefulSet"]
    for obj in objs:
        for v in VERSIONS:
            kv.validate(obj, v, strict=True)
    sts = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "trainers")
    # every add_mesh argument shows in the manifests
    assert sts["spec"]["podManagementPolicy"] == "Parallel" and sts["spec"]["replicas"] == 4
    assert sts["metadata"]["labels"]["team"] == "ml" and sts["metadata"]["annotations"] == {"note": "x"}
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == IMAGE and c["resources"]["limits"] == {"nvidia.com/gpu": "8", "cpu": "16"}
    assert "tcp://$(POD_IP):26601" in c["args"] and c["ports"][0]["containerPort"] == 26601
    svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "trainers-svc")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["port"] == 26601
    # the key: a Secret mounted as a file, never in env or argv
    assert any(v.get("secret") for v in sts["spec"]["template"]["spec"]["volumes"])
    key_b64 = next(o for o in objs if o["kind"] == "Secret")["data"]["key"]
    assert key_b64 not in json.dumps(sts)
    assert not any("secretKeyRef" in json.dumps(e) for e in c["env"])
    role = next(o for o in objs if o["kind"] == "Role")
    assert role["metadata"]["namespace"] == NS
    assert "*" not in json.dumps(role["rules"])
    # strict means strict: a misspelt field is refused
    bad = json.loads(json.dumps(sts))
    bad["spec"]["replica"] = 1
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, "1.33", strict=True)


def test_pod_template_is_merged_and_validates_strict() -> None:
    from kubernetes import client

    from monarch_nb.job.kubernetes import KubernetesJob

    tmpl = client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(labels={"team": "ml"}, annotations={"note": "x"}),
        spec=client.V1PodSpec(
            node_selector={"gpu": "h100"},
            tolerations=[client.V1Toleration(key="gpu", operator="Exists", effect="NoSchedule")],
            containers=[
                client.V1Container(name="sidecar", image="busybox", command=["sleep", "inf"]),
                client.V1Container(
                    name="allocator",
                    image=IMAGE,
                    resources=client.V1ResourceRequirements(limits={"nvidia.com/gpu": "8"}),
                    env=[client.V1EnvVar(name="NCCL_DEBUG", value="INFO")],
                    volume_mounts=[client.V1VolumeMount(name="data", mount_path="/data")],
                ),
            ],
            volumes=[client.V1Volume(name="data", empty_dir=client.V1EmptyDirVolumeSource())],
        ),
    )
    job = KubernetesJob(NS)
    job.add_mesh("trainers", 2, pod_template=tmpl, port=26601)
    objs = job.manifests("abcdef12")
    for obj in objs:
        for v in VERSIONS:
            kv.validate(obj, v, strict=True)
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    t = sts["spec"]["template"]
    # the template's own fields stay
    assert t["metadata"]["labels"]["team"] == "ml" and t["metadata"]["annotations"] == {"note": "x"}
    assert t["spec"]["nodeSelector"] == {"gpu": "h100"} and t["spec"]["tolerations"][0]["key"] == "gpu"
    side, alloc = t["spec"]["containers"]
    assert side == {"name": "sidecar", "image": "busybox", "command": ["sleep", "inf"]}
    assert alloc["image"] == IMAGE and alloc["resources"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in alloc["env"]
    # the allocator's own: command, bind address, key file, readiness, port
    assert alloc["command"][-2:] == ["monarch_nb", "allocator"] and "tcp://$(POD_IP):26601" in alloc["args"]
    assert alloc["readinessProbe"]["exec"]["command"][0] == "test"
    assert {v["name"] for v in t["spec"]["volumes"]} == {"data", "key"}
    assert {vm["mountPath"] for vm in alloc["volumeMounts"]} == {"/data", "/var/run/monarch-nb/key"}
    # pods are still found by the job's selector whatever labels the template has
    assert sts["spec"]["selector"]["matchLabels"].items() <= t["metadata"]["labels"].items()


def test_unsupported_arguments_say_so() -> None:
    from monarch_nb.job.kubernetes import ImageSpec, KubernetesJob

    with pytest.raises(ValueError, match="kubectl port-forward"):
        KubernetesJob(NS, attach_to="127.0.0.1:26601")
    job = KubernetesJob(NS)
    with pytest.raises(ValueError, match="pod_template.spec.containers is empty"):
        job.add_mesh("a", 1, pod_template={"spec": {}})
    with pytest.raises(NotImplementedError, match="sets command"):
        job.add_mesh("a", 1, pod_template={"spec": {"containers": [{"name": "w", "image": IMAGE, "command": ["x"]}]}})
    with pytest.raises(ValueError, match="mutually exclusive"):
        job.add_mesh("a", 1, image_spec=ImageSpec(IMAGE), pod_template={"spec": {"containers": [{"image": IMAGE}]}})
    assert not job._meshes  # nothing refused was kept
    with pytest.raises(ValueError, match="label_selector"):
        job.add_mesh("a", 1, image_spec=ImageSpec(IMAGE), label_selector="x=y")
    with pytest.raises(ValueError, match="invalid"):
        job.add_mesh("Bad_Name", 1)


def test_import_needs_no_kubernetes() -> None:
    code = "import sys; sys.modules['kubernetes'] = None; import monarch_nb.job, monarch_nb.job.kubernetes; print('ok')"
    cp = __import__("subprocess").run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert cp.stdout.strip() == "ok", cp.stderr


# ------------------------------------------------------------ against the test API server


class Cluster:
    def __init__(self) -> None:
        self.shared = tempfile.mkdtemp(prefix="mnb-k8s-", dir="/var/tmp")
        os.chmod(self.shared, 0o755)
        self.net = NetnsCluster(3)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        tokens = {
            "admin-token": "admin",
            "ctl-token": f"system:serviceaccount:{NS}:monarch-nb",
            "weak-token": f"system:serviceaccount:{NS}:weak",
            "nopf-token": f"system:serviceaccount:{NS}:nopf",
        }
        cfg = {
            "port_file": os.path.join(self.shared, "port"),
            "python": PY,
            "images": {BROKEN: "/usr/bin/python3"},
            "tokens": tokens,
            "hosts": [
                {
                    "ip": self.net.ip(i),
                    "wrap": self.net.wrap(i, [], cwd="/"),
                    "root": str(self.net.path(i, "/")),
                    "netns": f"/run/netns/{self.net.netns(i)}",
                }
                for i in (1, 2, 3)
            ],
        }
        Path(self.shared, "api.json").write_text(json.dumps(cfg))
        self.log = open(os.path.join(self.shared, "api.log"), "wb")
        self.server = self.net.popen(
            0,
            [PY, str(Path(__file__).parent / "_k8s_api.py"), os.path.join(self.shared, "api.json")],
            env=self.env(),
            stdout=self.log,
            stderr=self.log,
        )
        wait_for(lambda: os.path.exists(cfg["port_file"]) or self.server.poll() is not None, timeout=60)
        assert self.server.poll() is None, Path(self.shared, "api.log").read_text()
        port = Path(cfg["port_file"]).read_text()
        for user, token in (("admin", "admin-token"), ("ctl", "ctl-token"), ("weak", "weak-token"), ("nopf", "nopf-token")):
            Path(self.shared, f"{user}.kubeconfig").write_text(
                json.dumps(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "current-context": "test",
                        "clusters": [{"name": "test", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                        "users": [{"name": user, "user": {"token": token}}],
                        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user, "namespace": NS}}],
                    }
                )
            )

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        env.update(extra)
        return env

    def run(self, body: str, timeout: float = 150, **extra: str) -> list[dict]:
        code = textwrap.dedent(_HEAD).format(
            shared=self.shared, ns=NS, image=IMAGE, broken=BROKEN, ctl=self.net.ip(0)
        ) + textwrap.dedent(body)
        env = self.env(
            **{
                "MONARCH_NB_RUNTIME_DIR": "/tmp/mnb",
                "MONARCH_NB_ZYGOTE_PRELOAD": "",
                "MONARCH_NB_HEARTBEAT_INTERVAL": "0.2",
                "MONARCH_NB_HEARTBEAT_TIMEOUT": "1.5",
                **extra,
            }
        )
        return run_controller(self.net, self.shared, code, env, timeout=timeout)

    def allocators_on(self, i: int) -> int:
        key = os.stat(f"/run/netns/{self.net.netns(i)}")
        n = 0
        for e in os.listdir("/proc"):
            if not e.isdigit():
                continue
            try:
                st = os.stat(f"/proc/{e}/ns/net")
                cmd = Path(f"/proc/{e}/cmdline").read_bytes()
            except OSError:
                continue
            if (st.st_ino, st.st_dev) == (key.st_ino, key.st_dev) and b"monarch_nb\0allocator" in cmd:
                n += 1
        return n

    def kill_allocators(self, i: int) -> list[int]:
        """SIGKILL the allocators on host i (a container that crashed)."""
        key = os.stat(f"/run/netns/{self.net.netns(i)}")
        pids = []
        for e in os.listdir("/proc"):
            if not e.isdigit():
                continue
            try:
                st = os.stat(f"/proc/{e}/ns/net")
                cmd = Path(f"/proc/{e}/cmdline").read_bytes()
            except OSError:
                continue
            if (st.st_ino, st.st_dev) == (key.st_ino, key.st_dev) and b"monarch_nb\0allocator" in cmd:
                os.kill(int(e), signal.SIGKILL)
                pids.append(int(e))
        return pids

    def close(self) -> None:
        srv = getattr(self, "server", None)
        if srv is not None and srv.poll() is None:
            srv.terminate()
            try:
                srv.wait(20)
            except Exception:
                srv.kill()
        self.net.close()
        shutil.rmtree(self.shared, ignore_errors=True)


_HEAD = """
import json, os, socket, sys
from kubernetes import client, config, watch
from monarch_nb._wire.keys import read_key_file
from monarch_nb.actor import Actor, Channel, endpoint, get_or_spawn_controller, this_proc
from monarch_nb.job import JobError
from monarch_nb.job.kubernetes import ImageSpec, KubeConfig, KubernetesJob

SHARED = {shared!r}
NS = {ns!r}
IMAGE = {image!r}
BROKEN = {broken!r}
CTL = {ctl!r}

class Where(Actor):
    @endpoint
    def where(self):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect((CTL, 9))  # the address this host reaches the controller from
        return os.getpid(), s.getsockname()[0]

    @endpoint
    def push(self, port):
        port.send(os.getpid())  # to a Port of the controller's, handed over as an argument

    @endpoint
    def after(self, started):
        # a call still running when the tunnel drops: it says it started, with a Port of its own,
        # and ends only once the controller sends to that Port (after the drop)
        port, release = Channel.open()
        started.send(port)
        release.recv().get(timeout=60)
        return os.getpid()

    @endpoint
    def tally(self, counter=None):
        counter = counter or get_or_spawn_controller("tally", Tally).get()
        return counter.add.call_one().get(timeout=20)

class Tally(Actor):  # a controller: it lives in the controller's process
    def __init__(self):
        self.n = 0

    @endpoint
    def add(self):
        self.n += 1
        return self.n

def out(**kw):
    print(json.dumps(kw), flush=True)

def kc(user):
    return os.path.join(SHARED, user + ".kubeconfig")

def admin():
    return config.new_client_from_config(config_file=kc("admin"))

def grant(sa, rules=None):
    api = admin()
    objs = KubernetesJob.rbac_manifests(NS, sa)
    for o in objs:
        o["metadata"]["name"] = o["metadata"]["name"] + "-" + sa
    objs[2]["roleRef"]["name"] = objs[1]["metadata"]["name"]
    if rules is not None:
        objs[1]["rules"] = rules
    rbac = client.RbacAuthorizationV1Api(api)
    for fn, o in ((client.CoreV1Api(api).create_namespaced_service_account, objs[0]),
                  (rbac.create_namespaced_role, objs[1]), (rbac.create_namespaced_role_binding, objs[2])):
        try:
            fn(NS, o)
        except client.ApiException as e:
            if e.status != 409:  # granted by an earlier test
                raise

def objects():
    api = admin()
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    return dict(
        pods=sorted(p.metadata.name for p in core.list_namespaced_pod(NS).items),
        statefulsets=sorted(s.metadata.name for s in apps.list_namespaced_stateful_set(NS).items),
        services=sorted(s.metadata.name for s in core.list_namespaced_service(NS).items),
        secrets=sorted(s.metadata.name for s in core.list_namespaced_secret(NS).items),
    )


def test_api(path, body=None):
    # the test server's controls (faults to present, watch history to drop, its request log)
    import urllib.request
    port = open(os.path.join(SHARED, "port")).read()
    req = urllib.request.Request(f"http://127.0.0.1:{{port}}/_test/{{path}}", data=json.dumps(body).encode(), method="POST")
    return json.loads(urllib.request.urlopen(req, timeout=10).read())
"""

EMPTY = {"pods": [], "statefulsets": [], "services": [], "secrets": []}


@pytest.fixture(scope="module")
def k8s() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


def test_whole_flow(k8s: Cluster) -> None:
    with KeyWatch() as watch:
        out = k8s.run("""
            grant("monarch-nb")
            job = KubernetesJob(NS, timeout=90, kubeconfig=KubeConfig.from_path(kc("ctl")))
            job.add_mesh("trainers", 3, image_spec=ImageSpec(IMAGE))
            state = job.state(cached_path="/tmp/job.json")
            out(objects=objects(), hosts=job._hosts, key=read_key_file(os.path.join(job._dir, "key")).hex())
            procs = state.trainers.spawn_procs(per_host={"gpus": 2}, name="train")
            got = procs.spawn("w", Where).where.call().get()
            out(where=[list(v) for v in got.values()])
            # a second job with the same mesh name: the API server's 409, named
            other = KubernetesJob(NS, timeout=30, kubeconfig=KubeConfig.from_path(kc("ctl")))
            other.add_mesh("trainers", 1, image_spec=ImageSpec(IMAGE))
            try:
                other.apply()
            except JobError as e:
                out(conflict=str(e))
            job.kill()
            # a second job in the same process: it takes the key this process holds (a process
            # joins one cluster; with a key of its own its pods could not be attached)
            again = KubernetesJob(NS, timeout=90, kubeconfig=KubeConfig.from_path(kc("ctl")))
            again.add_mesh("again", 1, image_spec=ImageSpec(IMAGE))
            procs = again.state(cached_path=None).again.spawn_procs(per_host={"gpus": 1}, name="again")
            out(again=len(procs.spawn("w", Where).where.call().get().values()))
            again.kill()
            out(after=objects())
        """)
    first = out[0]
    assert first["objects"]["statefulsets"] == ["trainers"]
    assert first["objects"]["services"] == ["trainers-svc"]
    assert first["objects"]["pods"] == ["trainers-0", "trainers-1", "trainers-2"]
    assert len(first["objects"]["secrets"]) == 1
    # ranks in pod-index order: the pod on host i+1 is rank i
    assert first["hosts"]["trainers"] == [f"tcp://{k8s.net.ip(i)}:26600" for i in (1, 2, 3)]
    where = out[1]["where"]
    assert len(where) == 6 and {ip for _, ip in where} == {k8s.net.ip(i) for i in (1, 2, 3)}
    assert "already exists" in out[2]["conflict"] and "trainers" in out[2]["conflict"]
    assert out[3]["again"] == 1
    assert out[4]["after"] == EMPTY
    # deleting the StatefulSet ended the allocators
    wait_for(lambda: not any(k8s.allocators_on(i) for i in (1, 2, 3)), timeout=30)
    leaks = watch.leaks(bytes.fromhex(first["key"]))
    assert not leaks, leaks


def test_attach_only_by_label_selector(k8s: Cluster) -> None:
    # pods someone else provisioned (here: another job, in another process), found by Monarch's labels
    k8s.run("""
        grant("monarch-nb")
        owner = KubernetesJob(NS, timeout=90, kubeconfig=KubeConfig.from_path(kc("ctl")))
        owner.add_mesh("workers", 2, image_spec=ImageSpec(IMAGE))
        owner.apply()
        owner.dump("/tmp/owner.json")
        import shutil
        shutil.copy(os.path.join(owner._dir, "key"), "/tmp/attach.key")
    """)
    out = k8s.run(
        """
        sel = "app.kubernetes.io/name=monarch-worker,monarch.pytorch.org/mesh-name=workers"
        job = KubernetesJob(NS, timeout=30, kubeconfig=KubeConfig.from_path(kc("ctl")))
        job.add_mesh("workers", 2, label_selector=sel)
        # attach-only pods are authenticated with the controller's own cluster key (its config)
        state = job.state(cached_path=None)
        got = state.workers.spawn_procs(per_host={"gpus": 1}).spawn("w", Where).where.call().get()
        out(n=len(got), created=job._created)
        job.kill()                      # attach-only: the pods are not ours to delete
        out(after_attach_kill=objects()["pods"])
    """,
        MONARCH_NB_KEY_FILE="/tmp/attach.key",
    )
    assert out[0] == {"n": 2, "created": []}
    assert out[1]["after_attach_kill"] == ["workers-0", "workers-1"]
    out = k8s.run("""
        from monarch_nb.job import job_load
        job_load("/tmp/owner.json").kill()
        out(after=objects())
    """)
    assert out[0]["after"] == EMPTY


def test_reattach_from_a_new_process_by_name(k8s: Cluster) -> None:
    # %mesh launch k8s's path (monarch_nb.job.launch): a named job, cached; a second process
    # re-attaches to the same pods and finds the procs it left there, with the same PIDs
    launch = """
        from monarch_nb.actor import ProcMesh
        from monarch_nb.job import kill_job, launch, list_jobs
        grant("monarch-nb")
        state = launch("k8s", "named", 2, namespace=NS, image=IMAGE, kubeconfig=kc("ctl"), timeout=90)
    """
    out = k8s.run(
        launch
        + """
        procs = state.named.spawn_procs(per_host={"gpus": 1}, name="train", persist=True)
        out(pids=sorted(p for p, _ in procs.spawn("w", Where).where.call().get().values()))
    """
    )
    pids = out[0]["pids"]
    out = k8s.run(
        launch
        + """
        procs = ProcMesh.lookup("train", state.named)
        out(pids=sorted(p for p, _ in procs.actor_mesh("w").where.call().get().values()),
            jobs=[(r["name"], r["scheduler"], r["hosts"], r["state"]) for r in list_jobs()])
    """
    )
    assert out[0]["pids"] == pids
    assert ["named", "k8s", 2, "running"] in out[0]["jobs"]
    # the allocator of rank 1 dies: its pod is not Ready (the kubelet backs off), the job shows it lost
    assert k8s.kill_allocators(2)
    out = k8s.run("""
        import time
        from monarch_nb.job import kill_job, list_jobs
        deadline = time.monotonic() + 8
        while True:
            row = next(r for r in list_jobs() if r["name"] == "named")
            if row["state"] != "running" or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # polling the API server's view; no event to wait on here
        out(state=row["state"])
        kill_job("named")
        out(after=objects())
    """)
    assert out[0]["state"] == "lost: named[1]"
    assert out[1]["after"] == EMPTY


def test_pending_pod_says_why(k8s: Cluster) -> None:
    out = k8s.run("""
        grant("monarch-nb")
        job = KubernetesJob(NS, timeout=6, kubeconfig=KubeConfig.from_path(kc("ctl")))
        job.add_mesh("big", 4, image_spec=ImageSpec(IMAGE))     # 3 nodes
        try:
            job.state(cached_path=None)
        except JobError as e:
            out(error=str(e))
        out(after=objects())
    """)
    err = out[0]["error"]
    assert "big-3" in err and "Unschedulable" in err and "0/3 nodes are available" in err and "timeout=6" in err
    assert out[1]["after"] == EMPTY


def test_an_evicted_pod_says_why(k8s: Cluster) -> None:
    # a pod the kubelet evicted read "pod ev-0 Failed, not Ready": the eviction and the node's
    # shortage, in its status.reason and status.message, were not shown
    out = k8s.run("""
        grant("monarch-nb")
        job = KubernetesJob(NS, timeout=90, kubeconfig=KubeConfig.from_path(kc("ctl")))
        job.add_mesh("ev", 1, image_spec=ImageSpec(IMAGE))
        job.state(cached_path=None)
        test_api("evict", {"namespace": NS, "name": "ev-0", "message": "The node was low on resource: memory. "
                 "Threshold quantity: 100Mi, available: 51200Ki."})
        attach = KubernetesJob(NS, timeout=3, kubeconfig=KubeConfig.from_path(kc("ctl")))
        attach.add_mesh("ev", 1)
        try:
            attach.state(cached_path=None)
        except JobError as e:
            out(error=str(e))
        job.kill()
        out(after=objects())
    """)
    err = out[0]["error"]
    assert (
        "1 of 1 pods not Ready (pod ev-0 Failed: Evicted: The node was low on resource: memory. Threshold quantity: "
        "100Mi, available: 51200Ki.)" in err
    ), err
    assert out[1]["after"] == EMPTY


def test_an_evicted_pod_that_nothing_replaces_fails_the_attach_at_once_and_its_row_says_why(k8s: Cluster) -> None:
    # an attach-only mesh whose pod was evicted, with no controller to make it again: the wait
    # ran on until timeout (for ever with none) for a pod that never runs again, and the job's
    # row read only "lost: evb[0]", not why
    out = k8s.run("""
        import time
        from monarch_nb.job import kill_job, launch, list_jobs
        grant("monarch-nb")
        launch("k8s", "evb", 1, namespace=NS, image=IMAGE, kubeconfig=kc("ctl"), timeout=90)
        test_api("evict", {"namespace": NS, "name": "evb-0", "bare": True,
                 "message": "The node was low on resource: memory."})
        out(state=next(r for r in list_jobs() if r["name"] == "evb")["state"])
        attach = KubernetesJob(NS, timeout=120, kubeconfig=KubeConfig.from_path(kc("ctl")))
        attach.add_mesh("evb", 1)
        t0 = time.monotonic()
        try:
            attach.state(cached_path=None)
        except JobError as e:
            out(error=str(e), took=time.monotonic() - t0)
        kill_job("evb")
        client.CoreV1Api(admin()).delete_namespaced_pod("evb-0", NS)  # no longer the StatefulSet's
        out(after=objects())
    """)
    assert out[0]["state"] == "lost: evb[0] (Evicted: The node was low on resource: memory.)", out[0]
    err = out[1]["error"]
    assert err.startswith(
        "mesh 'evb': pod evb-0 Failed: Evicted: The node was low on resource: memory.: a pod that ended never runs "
        "again and no controller owns it to replace it; start a new pod running the allocator"
    ), err
    assert "kubectl delete pod -n mnb NAME" in err and "within timeout" not in err, err
    assert out[1]["took"] < 60, out[1]  # at once, not after the 120 s timeout
    assert out[2]["after"] == EMPTY


def test_crashloop_shows_last_log_lines(k8s: Cluster) -> None:
    out = k8s.run("""
        grant("monarch-nb")
        job = KubernetesJob(NS, timeout=60, kubeconfig=KubeConfig.from_path(kc("ctl")))
        job.add_mesh("broken", 1, image_spec=ImageSpec(BROKEN))
        try:
            job.state(cached_path=None)
        except JobError as e:
            out(error=str(e))
        out(after=objects())
    """)
    err = out[0]["error"]
    assert "broken-0" in err and "CrashLoopBackOff" in err
    assert "No module named monarch_nb" in err  # the container's own last log line
    assert out[1]["after"] == EMPTY


def test_forbidden_names_the_permission(k8s: Cluster) -> None:
    out = k8s.run("""
        # a Role without statefulsets: the job's own Role minus one rule
        grant("weak", rules=[r for r in KubernetesJob.rbac_manifests(NS)[1]["rules"] if r["resources"] != ["statefulsets"]])
        job = KubernetesJob(NS, timeout=30, kubeconfig=KubeConfig.from_path(kc("weak")))
        job.add_mesh("denied", 1, image_spec=ImageSpec(IMAGE))
        try:
            job.state(cached_path=None)
        except JobError as e:
            out(error=str(e))
        out(after=objects())
    """)
    err = out[0]["error"]
    assert "403" in err and "'create' on 'statefulsets.apps'" in err and "rbac_manifests" in err
    assert f"system:serviceaccount:{NS}:weak" in err
    # what it created before the refusal (the Secret, the Service) was deleted again
    assert out[1]["after"] == EMPTY


def test_gateway_reaches_pods_the_controller_cannot_route_to(k8s: Cluster) -> None:
    # the controller's host is cut off from the pods (a notebook outside the cluster): it reaches
    # the API server only, and the pods only through one port-forward to rank 0's gateway
    k8s.net.partition(0)
    try:
        with KeyWatch() as watch:
            out = k8s.run(
                """
                import time
                grant("monarch-nb")
                job = KubernetesJob(NS, timeout=90, kubeconfig=KubeConfig.from_path(kc("ctl")))
                job.add_mesh("gw", 3, image_spec=ImageSpec(IMAGE))
                state = job.state(cached_path="/tmp/gw.json")
                gw = job._gw[0]
                try:
                    socket.create_connection((job._hosts["gw"][1][6:].rsplit(":", 1)[0], 26600), timeout=1)
                    direct = "reachable"
                except OSError as e:
                    direct = type(e).__name__
                procs = state.gw.spawn_procs(per_host={"gpus": 2}, name="train", persist=True)
                w = procs.spawn("w", Where)
                got = w.where.call().get()
                # a Port and the controllers' proc, handed to the pods, are the gateway's reply address
                port, recv = Channel.open()
                w.push.call(port).get()
                pushed = sorted(recv.recv().get(timeout=20) for _ in range(6))
                tallies = sorted(w.tally.call().get().values())
                # and an actor living in the controller's own process, handed over as an argument
                mine = this_proc().spawn("mine", Tally)
                tallies += sorted(w.tally.call(mine).get().values())
                # the port-forward drops: the next connection opens a new one, same reply address
                before, reverse = gw.mux, gw.reverse
                before.close()
                again = w.where.call().get()
                # the tunnel drops again with calls in flight: their answers still come
                started, starts = Channel.open()
                slow = w.after.call(started)
                releases = [starts.recv().get(timeout=20) for _ in range(6)]
                running = not slow.done()  # each rank waits for its release: not done before the drop
                gw.mux.close()
                for r in releases:
                    r.send(None)
                late = sorted(slow.get(timeout=30).values())
                out(direct=direct, reverse=gw.reverse, where=[list(v) for v in got.values()], pushed=pushed, tallies=tallies,
                    reopened=gw.mux is not before and gw.reverse == reverse and sorted(again.values()) == sorted(got.values()),
                    running_at_drop=running, in_flight=late == sorted(v[0] for v in got.values()),
                    key=read_key_file(os.path.join(job._dir, "key")).hex())
            """,
                MONARCH_NB_HEARTBEAT_TIMEOUT="20",
            )  # a dropped tunnel loses heartbeats in flight, not the hosts
            # a new process re-attaches through a port it forwarded itself (attach_to), as with
            # `kubectl port-forward pod/gw-0 P:26601`, and finds its procs with the same PIDs
            out += k8s.run("""
                import threading, time
                from kubernetes.stream import portforward
                from monarch_nb.actor import ProcMesh
                t0 = time.monotonic()
                core = client.CoreV1Api(config.new_client_from_config(config_file=kc("ctl")))
                lst = socket.create_server(("127.0.0.1", 0))

                def pump(a, b):
                    try:
                        while data := a.recv(65536):
                            b.sendall(data)
                    except OSError:
                        pass
                    for x in (a, b):
                        try:
                            x.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass

                def forward():  # what kubectl port-forward does: one forward per local connection
                    while True:
                        c, _ = lst.accept()
                        pf = portforward(core.connect_get_namespaced_pod_portforward, "gw-0", NS, ports="26601")
                        r = pf.socket(26601)._socket
                        r.setblocking(True)
                        threading.Thread(target=pump, args=(c, r), daemon=True).start()
                        threading.Thread(target=pump, args=(r, c), daemon=True).start()

                threading.Thread(target=forward, daemon=True).start()
                # an account whose Role lacks pods/portforward: the 403, named
                grant("nopf", rules=[r for r in KubernetesJob.rbac_manifests(NS)[1]["rules"] if r["resources"] != ["pods/portforward"]])
                denied = KubernetesJob(NS, timeout=90, kubeconfig=KubeConfig.from_path(kc("nopf")), gateway=True)
                denied.add_mesh("gw", 3, image_spec=ImageSpec(IMAGE))
                try:
                    denied.state(cached_path="/tmp/gw.json")
                    forbidden = None
                except JobError as e:
                    forbidden = str(e)
                job = KubernetesJob(NS, timeout=90, kubeconfig=KubeConfig.from_path(kc("ctl")),
                                    attach_to=f"tcp://127.0.0.1:{lst.getsockname()[1]}")
                job.add_mesh("gw", 3, image_spec=ImageSpec(IMAGE))
                state = job.state(cached_path="/tmp/gw.json")
                gw = job._running._gw[0]  # the cached job's, which this spec re-attached to
                w = ProcMesh.lookup("train", state.gw).actor_mesh("w")
                got = w.where.call().get()
                t1 = time.monotonic()
                for _ in range(20):
                    w.where.call().get()
                out(where=[list(v) for v in got.values()], reverse=gw.reverse, to_first_call_s=t1 - t0, forbidden=forbidden,
                    call_s=(time.monotonic() - t1) / 20)
                job.kill()
                out(after=objects(), gateway_closed=not gw.alive)
            """)
    finally:
        k8s.net.heal(0)
    first, again = out[0], out[1]
    print("gateway:", first["direct"], {k: again[k] for k in ("to_first_call_s", "call_s")})
    assert first["direct"] in ("TimeoutError", "OSError"), first
    assert first["reopened"], first
    assert first["running_at_drop"] and first["in_flight"], first
    # the answers come back through a reverse listener on rank 0's pod
    assert first["reverse"].startswith(f"tcp://{k8s.net.ip(1)}:") and again["reverse"].startswith(f"tcp://{k8s.net.ip(1)}:")
    where = first["where"]
    assert len(where) == 6 and {ip for _, ip in where} == {k8s.net.ip(i) for i in (1, 2, 3)}
    assert first["pushed"] == sorted(pid for pid, _ in where) and first["tallies"] == [1, 2, 3, 4, 5, 6] * 2, first
    assert sorted(again["where"]) == sorted(where)  # the same procs, re-attached
    assert "403" in again["forbidden"] and "'create' on 'pods/portforward'" in again["forbidden"], again
    assert out[2] == {"after": EMPTY, "gateway_closed": True}
    wait_for(lambda: not any(k8s.allocators_on(i) for i in (1, 2, 3)), timeout=30)
    assert not watch.leaks(bytes.fromhex(first["key"]))


@pytest.mark.timeout(90)
def test_api_server_unreachable_or_silent_fails_in_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # before: urllib3's MaxRetryError came out raw, and an API server that accepted the connection
    # but never answered held state() for ever (the client has no timeout); the key's directory stayed
    import socket
    import time

    from monarch_nb.config import runtime_dir
    from monarch_nb.job import JobError
    from monarch_nb.job import kubernetes as k
    from monarch_nb.job.kubernetes import ImageSpec, KubeConfig, KubernetesJob

    monkeypatch.setattr(k, "REQUEST_TIMEOUT", (2.0, 2.0))
    silent = socket.create_server(("127.0.0.1", 0))
    silent.listen(20)  # connections wait in its backlog, never answered
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    jobs = os.path.join(runtime_dir(), "jobs")
    before = set(os.listdir(jobs)) if os.path.isdir(jobs) else set()
    for port, why in ((closed.getsockname()[1], "Connection refused"), (silent.getsockname()[1], "timed out")):
        kc = Path(tempfile.mkdtemp(prefix="mnb-kc-"), "config")
        kc.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "t",
                    "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u", "namespace": NS}}],
                }
            )
        )
        job = KubernetesJob(NS, timeout=None, kubeconfig=KubeConfig.from_path(str(kc)))
        job.add_mesh("m", 1, image_spec=ImageSpec(IMAGE))
        t0 = time.monotonic()
        with pytest.raises(JobError) as ei:
            job.state(cached_path=None)
        err = str(ei.value)
        assert f"cannot reach the Kubernetes API server at http://127.0.0.1:{port}" in err and why in err, err
        assert str(kc) in err and "kubectl cluster-info" in err
        assert time.monotonic() - t0 < 20
        shutil.rmtree(kc.parent)
    # the key written for the pods that were never created is gone with them
    assert (set(os.listdir(jobs)) if os.path.isdir(jobs) else set()) == before
    silent.close()
    closed.close()


def test_expired_token_says_401_and_what_to_do(k8s: Cluster) -> None:
    out = k8s.run("""
        bad = json.loads(open(kc("ctl")).read())
        bad["users"][0]["user"]["token"] = "expired-token"
        open("/tmp/expired.kubeconfig", "w").write(json.dumps(bad))
        job = KubernetesJob(NS, timeout=30, kubeconfig=KubeConfig.from_path("/tmp/expired.kubeconfig"))
        job.add_mesh("nokey", 1, image_spec=ImageSpec(IMAGE))
        try:
            job.state(cached_path=None)
        except JobError as e:
            out(error=str(e))
        out(after=objects(), keys=os.listdir("/tmp/mnb/jobs") if os.path.isdir("/tmp/mnb/jobs") else [])
    """)
    err = out[0]["error"]
    assert "401" in err and "Unauthorized" in err and "/tmp/expired.kubeconfig" in err and "expired" in err, err
    assert out[1] == {"after": EMPTY, "keys": []}


def test_throttled_requests_are_retried_and_failures_clean_up(k8s: Cluster) -> None:
    out = k8s.run("""
        grant("monarch-nb")
        # kube-apiserver's priority-and-fairness answer: 429, plain text, Retry-After
        test_api("faults", [
            {"method": "POST", "path": "/secrets$", "status": 429, "count": 2, "retry_after": 1},
            {"method": "GET", "path": "/pods$", "status": 429, "count": 2, "retry_after": 1},
        ])
        job = KubernetesJob(NS, timeout=90, kubeconfig=KubeConfig.from_path(kc("ctl")))
        job.add_mesh("busy", 1, image_spec=ImageSpec(IMAGE))
        n = len(job.state(cached_path=None).busy.spawn_procs(per_host={"gpus": 1}).spawn("w", Where).where.call().get())
        job.kill()
        out(n=n, after=objects(), faults=[x for x in test_api("log") if x.startswith("fault")])
        # a 500 with no Retry-After is not retried: what was created before it is deleted again
        test_api("faults", [{"method": "POST", "path": "/statefulsets$", "status": 500, "count": 1}])
        job = KubernetesJob(NS, timeout=90, kubeconfig=KubeConfig.from_path(kc("ctl")))
        job.add_mesh("busy", 1, image_spec=ImageSpec(IMAGE))
        try:
            job.state(cached_path=None)
        except JobError as e:
            out(error=str(e))
        out(after=objects())
        # the watch's history compacted while a mesh waits (410 Gone): listed again, still the scheduler's reason
        import threading
        done = threading.Event()
        def expire():
            while not done.wait(0.5):  # each re-opened watch starts from a compacted resourceVersion
                test_api("expire")
        threading.Thread(target=expire, daemon=True).start()
        job = KubernetesJob(NS, timeout=8, kubeconfig=KubeConfig.from_path(kc("ctl")))
        job.add_mesh("big", 4, image_spec=ImageSpec(IMAGE))
        try:
            job.state(cached_path=None)
        except JobError as e:
            out(error=str(e), gone=sum(x.startswith("410") for x in test_api("log")))
        done.set()
        out(after=objects())
    """)
    assert out[0]["n"] == 1 and out[0]["after"] == EMPTY, out[0]
    assert len(out[0]["faults"]) == 4, out[0]
    assert "500" in out[1]["error"] and "statefulsets" in out[1]["error"] and "try again later" in out[1]["error"]
    assert out[2]["after"] == EMPTY
    assert "Unschedulable" in out[3]["error"] and "timeout=8" in out[3]["error"] and out[3]["gone"] >= 1, out[3]
    assert out[4]["after"] == EMPTY


def test_reattach_after_the_job_was_deleted_outside(k8s: Cluster) -> None:
    # before: the cached job was taken as running, and state() waited for pods nothing would
    # create again: for ever with timeout=None, silently
    k8s.run("""
        grant("monarch-nb")
        job = KubernetesJob(NS, timeout=90, kubeconfig=KubeConfig.from_path(kc("ctl")))
        job.add_mesh("outside", 1, image_spec=ImageSpec(IMAGE))
        job.state(cached_path="/tmp/outside.json")
        api = admin()
        # kubectl delete statefulset,service,secret -l monarch-nb.pytorch.org/job=...
        client.AppsV1Api(api).delete_namespaced_stateful_set("outside", NS)
        client.CoreV1Api(api).delete_namespaced_service("outside-svc", NS)
        for s in client.CoreV1Api(api).list_namespaced_secret(NS).items:
            client.CoreV1Api(api).delete_namespaced_secret(s.metadata.name, NS)
    """)
    out = k8s.run(
        """
        import warnings
        job = KubernetesJob(NS, timeout=None, kubeconfig=KubeConfig.from_path(kc("ctl")))
        job.add_mesh("outside", 1, image_spec=ImageSpec(IMAGE))
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            state = job.state(cached_path="/tmp/outside.json")
        n = len(state.outside.spawn_procs(per_host={"gpus": 1}).spawn("w", Where).where.call().get())
        out(n=n, warned=[str(w.message) for w in ws if "replaced" in str(w.message)])
        job.kill()
        out(after=objects())
    """,
        timeout=120,
    )
    assert out[0]["n"] == 1 and out[0]["warned"] and "no longer running" in out[0]["warned"][0], out[0]
    assert out[1]["after"] == EMPTY
