"""A real IPython kernel driven through jupyter_client, as a notebook frontend drives it."""

from __future__ import annotations

import os
import queue
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jupyter_client


def poll(cond: str, timeout: float = 30, what: str = "") -> str:
    """Cell source that waits *in the kernel* until the expression ``cond`` is true, failing the
    cell with an AssertionError after ``timeout`` (a kernel cannot import the harness: it would
    be another copy of conftest). Append it to a cell, or run it as one."""
    why = f"timed out after {timeout} s waiting for {what or cond}"
    return (
        "import time as _poll_time\n"
        f"_poll_deadline = _poll_time.monotonic() + {timeout}\n"
        f"while not ({cond}):\n"
        f"    assert _poll_time.monotonic() < _poll_deadline, {why!r}\n"
        "    _poll_time.sleep(0.05)\n"
    )


@dataclass
class Cell:
    msg_id: str
    msgs: list[dict[str, Any]] = field(default_factory=list)
    reply: dict[str, Any] | None = None

    def _of(self, *types: str) -> list[dict[str, Any]]:
        return [m for m in self.msgs if m["msg_type"] in types]

    def stream(self, name: str = "stdout") -> str:
        return "".join(m["content"]["text"] for m in self._of("stream") if m["content"]["name"] == name)

    @property
    def result(self) -> str:
        r = self._of("execute_result")
        return r[0]["content"]["data"]["text/plain"] if r else ""

    @property
    def error(self) -> dict[str, Any] | None:
        e = self._of("error")
        return e[0]["content"] if e else None

    def displays(self) -> list[dict[str, Any]]:
        return [m["content"] for m in self._of("display_data")]

    def display_ids(self) -> list[str]:
        return [d.get("transient", {}).get("display_id", "") for d in self.displays()]


class Kernel:
    """Start a kernel, execute cells and read every iopub message, also the late ones."""

    def __init__(self, env: dict[str, str] | None = None, load_ext: bool = True, kernel_dirs: list[str] | None = None) -> None:
        if kernel_dirs:
            from jupyter_client.kernelspec import KernelSpecManager

            ksm = KernelSpecManager(kernel_dirs=kernel_dirs)
            self.km = jupyter_client.KernelManager(kernel_name="monarch-nb", kernel_spec_manager=ksm, transport="ipc")
        else:
            # ipc (files in the private runtime dir) rather than TCP: nothing in plain text on a port
            self.km = jupyter_client.KernelManager(kernel_name="python3", transport="ipc")
        self.km.start_kernel(env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        self.kc = self.km.client()
        #: every iopub message seen, in arrival order
        self.log: list[dict[str, Any]] = []
        try:
            self.kc.start_channels()
            self.kc.wait_for_ready(timeout=60)
            if load_ext:
                c = self.run("%load_ext monarch_nb")
                assert c.error is None, c.error
        except BaseException:
            self.close()  # the caller never gets this kernel to close: it would outlive the test
            raise

    def _pump(self, timeout: float) -> dict[str, Any] | None:
        try:
            m = self.kc.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            return None
        self.log.append(m)
        return m

    def execute(self, code: str, allow_stdin: bool = False) -> Cell:
        return Cell(self.kc.execute(code, allow_stdin=allow_stdin))

    def wait(self, cell: Cell, timeout: float = 60) -> Cell:
        """Read iopub until ``cell``'s kernel goes idle; keep the messages whose parent is ``cell``."""
        deadline = time.monotonic() + timeout
        seen = {id(m) for m in cell.msgs}
        for m in self.log:
            if m["parent_header"].get("msg_id") == cell.msg_id and id(m) not in seen:
                cell.msgs.append(m)
                if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                    return self._reply(cell, deadline)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"cell {cell.msg_id} did not finish within {timeout} s")
            m = self._pump(left)
            if m is None or m["parent_header"].get("msg_id") != cell.msg_id:
                continue
            cell.msgs.append(m)
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                return self._reply(cell, deadline)

    def _reply(self, cell: Cell, deadline: float) -> Cell:
        while cell.reply is None:
            r = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if r["parent_header"].get("msg_id") == cell.msg_id:
                cell.reply = r
        return cell

    def run(self, code: str, timeout: float = 60) -> Cell:
        return self.wait(self.execute(code), timeout)

    def wait_msg(self, pred: Any, timeout: float = 15, what: str = "an iopub message") -> dict[str, Any]:
        """The first message (already seen or arriving) for which ``pred(msg)`` is true."""
        for m in self.log:
            if pred(m):
                return m
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            m = self._pump(left)
            if m is not None and pred(m):
                return m

    def converse(
        self,
        code: str,
        answer: Callable[[str, str], str] | None = None,
        *,
        allow_stdin: bool = False,
        timeout: float = 90,
    ) -> dict[str, Any]:
        """Run ``code`` as JupyterLab would with an input box: ``answer(prompt, output since the
        last prompt)`` replies to each ``input_request`` (the debugger's prompts).

        Returns ``{"stdout", "stderr", "error", "prompts": [(prompt, output_before_it, reply)]}``.
        """
        msg_id = self.kc.execute(textwrap.dedent(code), allow_stdin=allow_stdin or answer is not None)
        out: dict[str, Any] = {"stdout": "", "stderr": "", "error": None, "prompts": []}
        since = 0
        deadline = time.monotonic() + timeout
        idle = False
        while not idle:
            if time.monotonic() > deadline:
                self.km.interrupt_kernel()
                raise AssertionError(f"cell did not finish in {timeout} s; output so far:\n{out['stdout']}\n{out['stderr']}")
            m = self._pump(0.05)
            if m is not None and m["parent_header"].get("msg_id") == msg_id:
                t, c = m["msg_type"], m["content"]
                if t == "stream":
                    out[c["name"]] += c["text"]
                elif t == "error":
                    out["error"] = c
                elif t == "status" and c["execution_state"] == "idle":
                    idle = True
            try:
                s = self.kc.stdin_channel.get_msg(timeout=0.05)
            except queue.Empty:
                continue
            if s["msg_type"] == "input_request":
                # output printed before the prompt may still be in flight on iopub: drain it
                idle = self._drain_streams(msg_id, out) or idle
                text = out["stdout"][since:]
                since = len(out["stdout"])
                assert answer is not None, f"unexpected input request {s['content']['prompt']!r}"
                reply = answer(s["content"]["prompt"], text)
                out["prompts"].append((s["content"]["prompt"], text, reply))
                self.kc.input(reply)
        self._drain_streams(msg_id, out)
        return out

    def _drain_streams(self, msg_id: str, out: dict[str, Any]) -> bool:
        """Take the cell's stream output that already arrived (the kernel flushes stdout before
        input_request and before idle); True if the cell went idle meanwhile (a console that left
        by itself, with the prompt unanswered): the caller must not wait for that idle again."""
        idle = False
        while (m := self._pump(0.2)) is not None:
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            if m["msg_type"] == "stream":
                out[m["content"]["name"]] += m["content"]["text"]
            elif m["msg_type"] == "error":
                out["error"] = m["content"]
            elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                idle = True
        return idle

    def interrupt(self) -> None:
        self.km.interrupt_kernel()

    def close(self, *meshes: str) -> None:
        """Shut the kernel down, then stop ``meshes`` if still running: spawned in a kernel, a
        named mesh persists, and a later module's ``%mesh connect`` would re-attach one that a
        failed test never reached its stop for (test_magics' first cell ran on one)."""
        try:
            try:
                self.kc.stop_channels()
            finally:
                self.km.shutdown_kernel(now=True)
        finally:
            if meshes:
                from monarch_nb.allocator import stop_mesh
                from monarch_nb.errors import MeshError

                for name in meshes:
                    try:
                        stop_mesh(name)
                    except MeshError:
                        pass  # the test stopped it
