"""A real ``jupyter server`` / ``jupyter lab`` on localhost for the server-extension and browser tests.

Everything it writes (config, data, runtime, workspaces, user settings) lives in a private temp
dir; the monarch_nb runtime dir is inherited from the test session (conftest), so the allocators
a kernel in this server starts are the ones the session cleans up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from typing import Any

from conftest import wait_for

TOKEN = "monarch-nb-test-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterServer:
    """``app`` is "server" (REST only, quick) or "lab" (the JupyterLab frontend too)."""

    def __init__(self, app: str = "server", extra_args: list[str] | None = None, extra_env: dict[str, str] | None = None) -> None:
        self.tmp = tempfile.mkdtemp(prefix="mnbj-", dir="/tmp")
        self.root = os.path.join(self.tmp, "work")
        os.makedirs(self.root)
        settings = os.path.join(self.tmp, "user-settings")
        # the news / update toast would cover part of every screenshot
        os.makedirs(os.path.join(settings, "@jupyterlab", "apputils-extension"))
        with open(os.path.join(settings, "@jupyterlab", "apputils-extension", "notification.jupyterlab-settings"), "w") as f:
            json.dump({"checkForUpdates": False, "fetchNews": "false"}, f)
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        # user-level jupyter dirs are private: no user kernelspec or setting leaks in; the
        # venv's own (sys-prefix) kernelspecs, labextensions and server config still apply
        for var, sub in (
            ("JUPYTER_CONFIG_DIR", "config"),
            ("JUPYTER_DATA_DIR", "data"),
            ("JUPYTER_RUNTIME_DIR", "jrt"),
            ("IPYTHONDIR", "ipython"),
        ):
            env[var] = os.path.join(self.tmp, sub)
        env["JUPYTER_PLATFORM_DIRS"] = "1"
        env["JUPYTER_PREFER_ENV_PATH"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra_env or {})
        argv = [
            sys.executable,
            "-m",
            "jupyterlab" if app == "lab" else "jupyter_server",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--port-retries=0",
            f"--IdentityProvider.token={TOKEN}",
            f"--ServerApp.root_dir={self.root}",
            # kernels over ipc sockets in the private runtime dir, as .ci/demo starts them
            "--KernelManager.transport=ipc",
        ]
        if app == "lab":
            argv += [
                "--LabApp.news_url=None",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                f"--LabApp.user_settings_dir={settings}",
                f"--LabApp.workspaces_dir={os.path.join(self.tmp, 'workspaces')}",
            ]
        argv += extra_args or []
        self.log = os.path.join(self.tmp, "server.log")
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_for(self._up, 60, f"jupyter {app} to answer on {self.base}")
        except BaseException:
            self.stop()
            raise

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"jupyter exited with {self.proc.returncode}:\n{self.logtext()[-3000:]}")
        try:
            return self.request("GET", "/api/status")[0] == 200
        except OSError:
            return False

    def request(self, method: str, path: str, body: Any = None, token: str | None = TOKEN) -> tuple[int, Any]:
        """(status, JSON body or text) of one request; HTTP errors are returned, not raised."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if token:
            req.add_header("Authorization", f"token {token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def logtext(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def shutdown_kernels(self) -> None:
        status, kernels = self.request("GET", "/api/kernels")
        for k in kernels if status == 200 else []:
            self.request("DELETE", f"/api/kernels/{k['id']}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            # SIGTERM: the server shuts its kernels down before it exits
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)
